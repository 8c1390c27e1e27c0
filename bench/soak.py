"""Soak section (issue 20 part 3): an hour of steady load on two brokers, watched every minute.

`bench/run --only soak --soak-minutes N` (default 60). Not in the default run: it is long.

Load, all over HTTP, split between two brokers on one database:
  - `rate` schedules per second (default 1,000) of new timers, each due 5 s later, in POST
    /api/v1/timers batches 20 times a second, over 8 partitions of one queue;
  - a quarter of them with a zstd payload (payloadZstd: keys 1 and 3 of every 10, 7 of every 20),
    so the sweeper's leased path (inflate in place, then fire with the plain rows of the
    partition, migration 036) runs all along; every popped frame's data is checked against its
    key's schedule;
  - 10 % of them (key % 10 == 3) rescheduled 2 s after their schedule was answered, to 4 s from then
    (a new txn, so the old and the new frame can be told apart);
  - 10 % of them (key % 10 == 7) cancelled 2 s after their schedule was answered (3 s before due);
  - consumers (two per broker) pop every fired frame (GET /api/v1/pop/queue, wait=true) and ack
    it (POST /api/v1/ack/batch);
  - retention on: both brokers run it every QUEEN_RETENTION_INTERVAL_MS (5 s here) and the queue
    deletes frames every group has consumed once they are SOAK_KEEP_S old
    (completedRetentionSeconds), so the log does not grow without end;
  - autovacuum at PostgreSQL's defaults (the bench cluster sets none of its parameters).

Each minute, one line: the load actually sent and its HTTP failures, fire lag p50/p99 of the
frames fired in that minute (commit of the frame, track_commit_timestamp, minus the deliverAt the
schedule's answer gave: both on the database clock, as the lag sections measure it), size and
dead tuples of queen.timers and queen.messages, each broker's VmRSS, PostgreSQL's client
connections. At the end the verdicts, and the fate of every timer from the HTTP answers (accepted,
rescheduled, cancelled, too_late, absent) against what the consumers popped and what the log holds.

Every loop is bounded by the run's length; after the load stops the drain is bounded too.

`--soak-setup deployed`: the same load the way a cell is deployed (docs/failover.md,
docs/pgbouncer.md): a Patroni cell (scripts/patroni-cell: etcd, two members, synchronous
replication), a pgbouncer in transaction pooling in front of each member (scripts/pgbouncer),
the brokers' requests through both pgbouncers on one multi-host URL
(target_session_attrs=read-write, QUEEN_POOL_MODE=transaction) and their sweepers on the members'
multi-host URL (QUEEN_DIRECT_DATABASE_URL), and halfway through a planned switchover
(`patronictl switchover`): the fate of every timer is checked across it.
"""

from __future__ import annotations

import asyncio
import base64
import subprocess
import threading
import time
from array import array
from datetime import datetime

import httpx
import psycopg
import zstandard

from harness import Broker, Cluster, connect, log, pct, start_broker, wait_until
from pgbouncer import Pgbouncer
from scale import _rss_kb

QUEUE = "soak"
PARTS = 8
TICKS_PER_S = 20
DELAY_MS = 5000  # schedule: due 5 s after the answer
FOLLOW_S = 2.0  # reschedule / cancel 2 s after the schedule's answer
RESCHED_DELAY_MS = 4000  # the reschedule: due 4 s after its own answer
SOAK_KEEP_S = 120  # completedRetentionSeconds: consumed frames stay this long (the lag sampler reads them)
RETENTION_INTERVAL_MS = 5000
CONSUMERS_PER_BROKER = 2
POP_BATCH = 1000
MAX_IN_FLIGHT = 16  # POSTs in flight; at the limit the generator waits (and the minute line shows the rate fall)
PAYLOAD = base64.b64encode(b'{"soak":1}').decode()
# a quarter of the schedules carry a zstd payload (payloadZstd): the sweeper's leased path inflates
# them in place and a later cycle fires them with the plain rows of their partition (migration 036).
# Their frames say {"soak":2}: every popped frame's data is checked against its key's schedule.
ZSTD_PAYLOAD = base64.b64encode(zstandard.ZstdCompressor().compress(b'{"soak":2}')).decode()
DATA_PLAIN, DATA_ZSTD = {"soak": 1}, {"soak": 2}


def _zstd(i: int) -> bool:
    """Key i's schedule is zstd: 1 and 3 of every 10 (3 is rescheduled, to a plain payload) and
    one cancel in two (7 of every 20)."""
    return i % 10 in (1, 3) or i % 20 == 7

# sched[i]: fate of key i's schedule op
S_NONE, S_OK, S_FAILED, S_OTHER = 0, 1, 2, 3
# follow[i]: fate of key i's reschedule (key % 10 == 3) or cancel (key % 10 == 7)
F_NONE, F_RESCHEDULED, F_SCHEDULED, F_FAILED, F_CANCELLED, F_TOO_LATE, F_ABSENT, F_OTHER = range(8)
FOLLOW_NAMES = {F_RESCHEDULED: "rescheduled", F_SCHEDULED: "scheduled", F_CANCELLED: "cancelled",
                F_TOO_LATE: "too_late", F_ABSENT: "absent"}
FOLLOW_CODES = {v: k for k, v in FOLLOW_NAMES.items()}


def windows(minutes: int) -> tuple[int, int, int]:
    """(lag window, growth window, RSS reference minute): 5, 20, 5 for an hour, scaled down
    proportionally for a shorter run (at least 1, 2 and 1 minutes)."""
    w5 = max(1, round(5 * minutes / 60))
    w20 = min(max(2, round(20 * minutes / 60)), max(1, minutes - 1))
    return w5, w20, w5


def _epoch(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def _key(i: int) -> str:
    return f"k{i}"


def _txn(i: int, v: int) -> str:
    return f"s{i}" if v == 0 else f"s{i}r"


def _parse_txn(txn: str) -> tuple[int, int] | None:
    if not txn.startswith("s"):
        return None
    try:
        return (int(txn[1:-1]), 1) if txn.endswith("r") else (int(txn[1:]), 0)
    except ValueError:
        return None


class State:
    """What the HTTP answers said, and what the consumers saw, per key (arrays: an hour is 3.6 M keys)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.sched = bytearray(capacity)
        self.follow = bytearray(capacity)
        self.deliv = (bytearray(capacity), bytearray(capacity))  # pops per txn variant (saturating)
        # acks per txn variant that failed: the frame is popped again once its lease ends (the
        # log's at-least-once delivery), which is not a second fire
        self.unacked = (bytearray(capacity), bytearray(capacity))
        self.due = (array("d", bytes(8 * capacity)), array("d", bytes(8 * capacity)))  # deliverAt epoch
        self.sent = 0  # keys whose schedule was sent
        # counters, cumulative (the minute line prints differences)
        self.c = {"sched_ok": 0, "follow_ok": 0, "ops_sent": 0, "posts": 0, "post_fail": 0, "ops_failed": 0,
                  "popped": 0, "pops": 0, "pop_fail": 0, "acked": 0, "ack_fail": 0, "unknown_frames": 0, "bad_data": 0,
                  "too_late": 0, "cancelled": 0, "absent": 0, "post_ms_max": 0.0}
        self.post_ms: list[float] = []  # POST latencies of the current minute


class Soak:
    def __init__(self, cluster: Cluster | None, url: str, res, minutes: int, rate: int, *,
                 broker_url: str | None = None, broker_env: dict | None = None, setup: str = "direct",
                 midway=None):
        self.cluster, self.url, self.res, self.minutes, self.rate = cluster, url, res, minutes, rate
        # deployed: the brokers' URL and settings, and what happens halfway (a switchover)
        self.broker_url, self.broker_env, self.setup, self.midway = broker_url or url, broker_env or {}, setup, midway
        self.st = State(rate * 60 * minutes + rate * 2)
        self.brokers: list[Broker] = []
        self.rows: list[dict] = []
        self.lags: dict[int, list[float]] = {}
        self.pids: list[str] = []
        self._lag_lo = None

    # ---------------------------------------------------------------- load
    async def _post(self, client: httpx.AsyncClient, ops: list[tuple[str, int]], body: list[dict],
                    sem: asyncio.Semaphore) -> None:
        st = self.st
        try:
            t0 = time.perf_counter()
            r = await client.post("/api/v1/timers", json={"operations": body})
            dt = (time.perf_counter() - t0) * 1000
            st.post_ms.append(dt)
            results = r.json().get("results") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            results = None
        finally:
            sem.release()
        st.c["posts"] += 1
        loop = asyncio.get_running_loop()
        now = loop.time()
        if not results or len(results) != len(ops):
            st.c["post_fail"] += 1
            st.c["ops_failed"] += len(ops)
            for kind, i in ops:
                if kind == "s":
                    st.sched[i] = S_FAILED
                else:
                    st.follow[i] = F_FAILED
            return
        for (kind, i), res in zip(ops, results):
            status = res.get("status")
            if kind == "s":
                if status == "scheduled":
                    st.sched[i] = S_OK
                    st.due[0][i] = _epoch(res["deliverAt"])
                    st.c["sched_ok"] += 1
                    if i % 10 == 3:
                        self.follow_q.append((now + FOLLOW_S, "r", i))
                    elif i % 10 == 7:
                        self.follow_q.append((now + FOLLOW_S, "c", i))
                else:
                    st.sched[i] = S_OTHER
            else:
                code = FOLLOW_CODES.get(status, F_OTHER)
                st.follow[i] = code
                st.c["follow_ok"] += 1
                if code in (F_RESCHEDULED, F_SCHEDULED) and res.get("deliverAt"):
                    st.due[1][i] = _epoch(res["deliverAt"])
                if code == F_CANCELLED:
                    st.c["cancelled"] += 1
                elif code == F_TOO_LATE:
                    st.c["too_late"] += 1
                elif code == F_ABSENT:
                    st.c["absent"] += 1

    async def generate(self, seconds: float) -> None:
        """Bounded: one tick every 1/TICKS_PER_S s for `seconds`, then the follow-ups still due."""
        st = self.st
        per_tick = self.rate / TICKS_PER_S
        sem = asyncio.Semaphore(MAX_IN_FLIGHT)
        clients = [httpx.AsyncClient(base_url=b.url, timeout=30) for b in self.brokers]
        tasks: set[asyncio.Task] = set()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        end = t0 + seconds
        tick = 0
        owed = 0.0
        try:
            while True:
                now = loop.time()
                load_on = now < end
                if not load_on and not self.follow_q:
                    break
                if now > end + FOLLOW_S + 30:  # bound: follow-ups whose schedule answered very late
                    break
                ops: list[tuple[str, int]] = []
                body: list[dict] = []
                if load_on:
                    owed += per_tick
                    while owed >= 1 and st.sent < st.capacity:
                        i = st.sent
                        st.sent += 1
                        owed -= 1
                        ops.append(("s", i))
                        op = {"op": "schedule", "queue": QUEUE, "timerKey": _key(i), "delayMs": DELAY_MS,
                              "txn": _txn(i, 0), "payload": PAYLOAD, "partition": f"p{i % PARTS}"}
                        if _zstd(i):
                            op.update(payload=ZSTD_PAYLOAD, payloadZstd=True)
                        body.append(op)
                while self.follow_q and self.follow_q[0][0] <= now and len(body) < 250:
                    _, kind, i = self.follow_q.pop(0)
                    ops.append((kind, i))
                    if kind == "r":
                        body.append({"op": "reschedule", "queue": QUEUE, "timerKey": _key(i),
                                     "delayMs": RESCHED_DELAY_MS, "txn": _txn(i, 1), "payload": PAYLOAD,
                                     "partition": f"p{i % PARTS}"})
                    else:
                        body.append({"op": "cancel", "queue": QUEUE, "timerKey": _key(i)})
                if body:
                    await sem.acquire()
                    st.c["ops_sent"] += len(body)
                    t = asyncio.create_task(self._post(clients[tick % len(clients)], ops, body, sem))
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)
                tick += 1
                delay = t0 + tick / TICKS_PER_S - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
            if tasks:
                await asyncio.wait(tasks, timeout=60)
        finally:
            for c in clients:
                await c.aclose()

    async def consume(self, broker: Broker, stop: asyncio.Event) -> None:
        st = self.st
        async with httpx.AsyncClient(base_url=broker.url, timeout=30) as c:
            while not stop.is_set():
                try:
                    r = await c.get(f"/api/v1/pop/queue/{QUEUE}",
                                    params={"batch": POP_BATCH, "wait": "true", "timeout": 1000})
                except httpx.HTTPError:
                    st.c["pop_fail"] += 1
                    await asyncio.sleep(0.2)
                    continue
                st.c["pops"] += 1
                if r.status_code == 204:
                    continue
                if r.status_code != 200:
                    st.c["pop_fail"] += 1
                    await asyncio.sleep(0.2)
                    continue
                msgs = r.json()["messages"]
                acks, keys = [], []
                for m in msgs:
                    p = _parse_txn(m["transactionId"])
                    if p is None or p[0] >= st.capacity:
                        st.c["unknown_frames"] += 1
                        p = None
                    else:
                        d = st.deliv[p[1]]
                        if d[p[0]] < 255:
                            d[p[0]] += 1
                        # variant 0 is the schedule's payload, variant 1 the reschedule's (plain)
                        if m.get("data") != (DATA_ZSTD if p[1] == 0 and _zstd(p[0]) else DATA_PLAIN):
                            st.c["bad_data"] += 1
                    keys.append(p)
                    acks.append({"transactionId": m["transactionId"], "partitionId": m["partitionId"],
                                 "leaseId": m["leaseId"], "status": "completed"})
                st.c["popped"] += len(msgs)
                try:
                    a = await c.post("/api/v1/ack/batch", json={"acknowledgments": acks})
                    done = [bool(x.get("success")) for x in a.json()] if a.status_code == 200 else []
                except (httpx.HTTPError, ValueError):
                    done = []
                done += [False] * (len(acks) - len(done))
                for p, ok in zip(keys, done):
                    if not ok and p is not None and st.unacked[p[1]][p[0]] < 255:
                        st.unacked[p[1]][p[0]] += 1
                ok = sum(done)
                st.c["acked"] += ok
                st.c["ack_fail"] += len(acks) - ok

    # ---------------------------------------------------------------- the minute's figures
    def _frame_lags(self, conn, final: bool = False) -> list[float]:
        """Fire lag of the frames whose fire transaction started since the last call (up to 2 s ago,
        or now when final): commit time of the frame minus its timer's deliverAt, both DB clock."""
        hi_sql = "clock_timestamp()" if final else "clock_timestamp() - interval '2 seconds'"
        hi = conn.execute(f"SELECT {hi_sql}").fetchone()[0]
        rows = conn.execute("""
            SELECT m.transaction_id, extract(epoch FROM pg_xact_commit_timestamp(m.xmin))::float8
              FROM queen.messages m
             WHERE m.partition_id = ANY(%s::uuid[]) AND m.created_at >= %s AND m.created_at < %s""",
                            (self.pids, self._lag_lo, hi)).fetchall()
        self._lag_lo = hi
        st = self.st
        out = []
        for txn, commit in rows:
            p = _parse_txn(txn)
            if p is None or commit is None or p[0] >= st.capacity:
                continue
            due = st.due[p[1]][p[0]]
            if due:
                out.append(commit - due)
        return out

    def sample(self, conn, minute: int, prev: dict, final: bool = False) -> dict:
        st = self.st
        lags = self._frame_lags(conn, final)
        tabs = {r[0]: r[1:] for r in conn.execute("""
            SELECT c.relname, pg_total_relation_size(c.oid), s.n_live_tup, s.n_dead_tup, s.autovacuum_count
              FROM pg_class c JOIN pg_stat_user_tables s ON s.relid = c.oid
             WHERE s.schemaname = 'queen' AND c.relname IN ('timers', 'messages')""")}
        conns = conn.execute("SELECT count(*) FILTER (WHERE backend_type = 'client backend'), count(*) "
                             "FROM pg_stat_activity").fetchone()
        pending = conn.execute("SELECT count(*) FROM queen.timers").fetchone()[0]
        rss = [(_rss_kb(b.proc.pid) or 0) / 1024 for b in self.brokers]
        c = dict(st.c)
        d = {k: c[k] - prev.get(k, 0) for k in c if k != "post_ms_max"}
        post_ms, st.post_ms = st.post_ms, []
        row = {"minute": minute, "final": final, "n_lag": len(lags),
               "lag_p50_ms": round(pct(lags, 50) * 1000, 1) if lags else None,
               "lag_p99_ms": round(pct(lags, 99) * 1000, 1) if lags else None,
               "lag_max_ms": round(max(lags) * 1000, 1) if lags else None,
               "timers_mb": round(tabs["timers"][0] / 2**20, 1), "timers_live": tabs["timers"][1],
               "timers_dead": tabs["timers"][2], "timers_autovac": tabs["timers"][3],
               "messages_mb": round(tabs["messages"][0] / 2**20, 1), "messages_live": tabs["messages"][1],
               "messages_dead": tabs["messages"][2], "messages_autovac": tabs["messages"][3],
               "pending": pending, "rss_mb": [round(x, 1) for x in rss], "pg_client_conns": conns[0],
               "pg_backends": conns[1], "post_p99_ms": round(pct(post_ms, 99), 1) if post_ms else None, **d}
        self.rows.append(row)
        self.lags[minute] = lags
        tag = "drain" if final else f"min {minute:3d}"
        log(f"  {tag}: sched {d['sched_ok']:6d} follow {d['follow_ok']:5d} fail {d['ops_failed']:d} "
            f"(POST p99 {row['post_p99_ms']} ms) | popped {d['popped']:6d} acked {d['acked']:6d} | "
            f"lag n {len(lags):6d} p50 {row['lag_p50_ms']} p99 {row['lag_p99_ms']} max {row['lag_max_ms']} ms | "
            f"timers {row['timers_mb']} MB dead {row['timers_dead']} av {row['timers_autovac']} pend {pending} | "
            f"messages {row['messages_mb']} MB live {row['messages_live']} dead {row['messages_dead']} "
            f"av {row['messages_autovac']} | rss {' / '.join(f'{x:.1f}' for x in rss)} MB | "
            f"pg conns {conns[0]} (backends {conns[1]})")
        return c

    def _sampler(self, stop: threading.Event, t0: float) -> None:
        """Thread: one line per minute of load, on its own connection (opened again when a
        switchover closed it). Bounded by the run's minutes."""
        prev: dict = {}
        conn = connect(self.url)
        try:
            for minute in range(1, self.minutes + 1):
                if stop.wait(max(0.0, t0 + 60 * minute - time.monotonic())):
                    return
                for attempt in range(10):
                    try:
                        prev = self.sample(conn, minute, prev)
                        break
                    except psycopg.OperationalError as exc:
                        log(f"  (the sampler's connection: {str(exc).strip().splitlines()[0]}; again)")
                        conn.close()
                        time.sleep(1)
                        try:
                            conn = connect(self.url)
                        except psycopg.OperationalError:
                            continue
            self._prev = prev
        finally:
            conn.close()

    def _midway(self, stop: threading.Event, t0: float) -> None:
        """Thread: halfway through the load, self.midway() (the deployed set-up's switchover)."""
        if stop.wait(max(0.0, t0 + 30 * self.minutes - time.monotonic())):
            return
        at = time.monotonic() - t0
        try:
            said = self.midway()
        except Exception as exc:  # printed; the run goes on and its verdicts say what followed
            said = f"FAILED: {exc}"
        log(f"  at {at / 60:.1f} min: {said} ({time.monotonic() - t0 - at:.1f} s)")

    # ---------------------------------------------------------------- the run
    async def _run_async(self, seconds: float) -> None:
        self.follow_q: list = []
        stop_consumers = asyncio.Event()
        consumers = [asyncio.create_task(self.consume(b, stop_consumers))
                     for b in self.brokers for _ in range(CONSUMERS_PER_BROKER)]
        try:
            await self.generate(seconds)
            # drain: every timer of the queue fired, then every frame consumed (both bounded)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 120
            with connect(self.url) as conn:
                while loop.time() < deadline:
                    left = conn.execute("SELECT count(*) FROM queen.timers WHERE queue = %s", (QUEUE,)).fetchone()[0]
                    if left == 0:
                        break
                    await asyncio.sleep(0.5)
                popped, quiet_since = -1, loop.time()
                while loop.time() < deadline + 60:
                    if self.st.c["popped"] != popped:
                        popped, quiet_since = self.st.c["popped"], loop.time()
                    elif loop.time() - quiet_since > 5:
                        break
                    await asyncio.sleep(0.5)
        finally:
            stop_consumers.set()
            await asyncio.wait(consumers, timeout=30)

    def run(self) -> None:
        m, rate = self.minutes, self.rate
        w5, w20, wr = windows(m)
        log(f"\n== soak: {m} min, {rate} schedules/s over HTTP (25 % zstd, 10 % rescheduled, 10 % cancelled) on 2 brokers, "
            f"{CONSUMERS_PER_BROKER * 2} consumers popping and acking, retention every {RETENTION_INTERVAL_MS} ms "
            f"(completedRetentionSeconds {SOAK_KEEP_S}), autovacuum at its defaults; set-up {self.setup} ==")
        if self.setup != "direct":
            log(f"  brokers: QUEEN_DATABASE_URL={self.broker_url} "
                + " ".join(f"{k}={v}" for k, v in self.broker_env.items()))
        if m < 60:
            log(f"  short run: windows scaled by {m}/60: lag over the first and last {w5} min, size growth over "
                f"the last {w20} min, RSS against minute {wr} (an hour: 5, 20, 5)")
        with connect(self.url) as conn:
            conn.execute("SELECT queen.configure_queue('default', %s, NULL, NULL, %s::jsonb)",
                         (QUEUE, '{"leaseTime": 60, "retentionEnabled": true, '
                                 f'"completedRetentionSeconds": {SOAK_KEEP_S}}}'))
            for p in range(PARTS):
                conn.execute("SELECT queen.ensure_partition('default', %s, %s)", (QUEUE, f"p{p}"))
            self.pids = [str(r[0]) for r in conn.execute(
                "SELECT p.id FROM queen.partitions p JOIN queen.queues q ON q.id = p.queue_id "
                "WHERE q.tenant = 'default' AND q.name = %s", (QUEUE,))]
            autovac = conn.execute("SELECT name, setting FROM pg_settings WHERE name IN "
                                   "('autovacuum', 'autovacuum_naptime', 'autovacuum_vacuum_scale_factor', "
                                   "'autovacuum_vacuum_insert_scale_factor', 'autovacuum_vacuum_cost_limit') "
                                   "ORDER BY name").fetchall()
            log("  " + ", ".join(f"{k}={v}" for k, v in autovac))
            self._lag_lo = conn.execute("SELECT clock_timestamp()").fetchone()[0]
        env = {"QUEEN_RETENTION_INTERVAL_MS": RETENTION_INTERVAL_MS, **self.broker_env}
        self.brokers = [start_broker(self.broker_url, f"soak{k}", **env) for k in (1, 2)]
        stop = threading.Event()
        try:
            t0 = time.monotonic()
            th = threading.Thread(target=self._sampler, args=(stop, t0), daemon=True)
            th.start()
            if self.midway is not None:
                threading.Thread(target=self._midway, args=(stop, t0), daemon=True).start()
            asyncio.run(self._run_async(60 * m + 0.5))
            th.join(timeout=90)
            stop.set()
            with connect(self.url) as conn:
                self.sample(conn, m + 1, getattr(self, "_prev", {}), final=True)
                self.verdicts(conn, w5, w20, wr)
        finally:
            stop.set()
            for b in self.brokers:
                b.stop()

    # ---------------------------------------------------------------- verdicts
    def fate(self, conn) -> dict:
        st = self.st
        # frames still in the log that no consumer popped count as delivered too (there should be none)
        in_log = 0
        unconsumed = 0
        for (txn,) in conn.execute("SELECT m.transaction_id FROM queen.messages m WHERE m.partition_id = ANY(%s::uuid[])",
                                   (self.pids,)):
            in_log += 1
            p = _parse_txn(txn)
            if p is not None and p[0] < st.capacity and st.deliv[p[1]][p[0]] == 0:
                unconsumed += 1
                st.deliv[p[1]][p[0]] = 1
        f = {"keys_sent": st.sent, "accepted": 0, "not_accepted": 0, "delivered_unaccepted": 0,
             "popped_again_after_a_failed_ack": 0,
             "delivered_once": 0, "cancelled": 0, "too_late": 0, "absent_after_fire": 0,
             "rescheduled": 0, "resched_after_fire": 0, "neither": 0, "both": 0, "duplicated": 0,
             "ambiguous": 0, "frames_in_log_at_end": in_log, "unconsumed_in_log": unconsumed,
             "examples": []}

        def bad(kind: str, i: int) -> None:
            f[kind] += 1
            if len(f["examples"]) < 10:
                f["examples"].append(f"{kind}: key {_key(i)} sched {st.sched[i]} follow {st.follow[i]} "
                                     f"pops {st.deliv[0][i]}/{st.deliv[1][i]}")

        def once(pops: int, i: int) -> None:
            """The timer's frame(s) should have been popped exactly once in all."""
            if pops == 1:
                f["delivered_once"] += 1
            else:
                bad("neither" if pops == 0 else "duplicated", i)

        def distinct(v: int, i: int) -> int:
            """Pops of frame variant v of key i, less those that followed a failed ack."""
            n = st.deliv[v][i]
            again = min(st.unacked[v][i], max(n - 1, 0))
            f["popped_again_after_a_failed_ack"] += again
            return n - again

        for i in range(st.sent):
            d0, d1, s, fo = distinct(0, i), distinct(1, i), st.sched[i], st.follow[i]
            if s != S_OK:
                f["not_accepted"] += 1
                if d0 or d1:
                    f["delivered_unaccepted"] += 1
                continue
            f["accepted"] += 1
            kind = i % 10
            if kind == 3:  # rescheduled
                if fo == F_RESCHEDULED:
                    f["rescheduled"] += 1
                    if d0:
                        bad("both", i)  # the replaced frame fired too
                    else:
                        once(d1, i)
                elif fo == F_SCHEDULED:  # the first had fired already: two timers, each once
                    f["resched_after_fire"] += 1
                    if d0 == 1 and d1 == 1:
                        f["delivered_once"] += 1
                    elif d0 > 1 or d1 > 1:
                        bad("duplicated", i)
                    else:
                        bad("neither", i)
                else:  # the reschedule's answer was lost: either frame, exactly one of them
                    f["ambiguous"] += 1
                    once(d0 + d1, i)
            elif kind == 7:  # cancelled
                if fo == F_CANCELLED:
                    f["cancelled"] += 1
                    if d0:
                        bad("both", i)
                elif fo in (F_TOO_LATE, F_ABSENT):
                    f["too_late" if fo == F_TOO_LATE else "absent_after_fire"] += 1
                    once(d0, i)
                else:  # the cancel's answer was lost: cancelled or delivered once, either is right
                    f["ambiguous"] += 1
                    if d0 > 1:
                        bad("duplicated", i)
                    elif d0 == 1:
                        f["delivered_once"] += 1
                    else:
                        f["cancelled"] += 1
            else:
                once(d0, i)
            if d1 and kind != 3:
                bad("duplicated", i)
        return f

    def verdicts(self, conn, w5: int, w20: int, wr: int) -> None:
        m = self.minutes
        rows = [r for r in self.rows if not r["final"]]
        by = {r["minute"]: r for r in rows}
        first = [x for k in range(1, w5 + 1) for x in self.lags.get(k, [])]
        last = [x for k in range(m - w5 + 1, m + 1) for x in self.lags.get(k, [])]
        p_first = pct(first, 99)
        p_last = pct(last, 99)
        log(f"\n  verdicts ({m} min{'' if m >= 60 else f'; windows scaled: {w5} / {w20} / minute {wr}'}):")
        ok_lag = None
        if p_first is not None and p_last is not None:
            ok_lag = p_last <= 1.5 * p_first and p_last * 1000 <= 50
            log(f"  lag p99: first {w5} min {p_first * 1000:.1f} ms (n {len(first)}), last {w5} min "
                f"{p_last * 1000:.1f} ms (n {len(last)}); target last <= 1.5 x first "
                f"({1.5 * p_first * 1000:.1f} ms) and <= 50 ms -> {'met' if ok_lag else 'MISSED'}")
        else:
            log("  lag p99: no frames measured in a window -> MISSED")
            ok_lag = False
        growth = {}
        ok_size = True
        ref = m - w20
        for t in ("timers", "messages"):
            a, b = by.get(ref, {}).get(f"{t}_mb"), by.get(m, {}).get(f"{t}_mb")
            if a and b is not None:
                g = (b - a) / a
                growth[t] = round(g * 100, 1)
                ok_size &= g < 0.10
                log(f"  queen.{t}: {a} MB at minute {ref}, {b} MB at minute {m}: {g * 100:+.1f} % "
                    f"(target < +10 %) -> {'met' if g < 0.10 else 'MISSED'}")
            else:
                ok_size = False
                log(f"  queen.{t}: no size at minute {ref} or {m} -> MISSED")
        ok_rss = True
        rss_dev = []
        if wr in by:
            for k, base in enumerate(by[wr]["rss_mb"]):
                later = [r["rss_mb"][k] for r in rows if r["minute"] >= wr]
                lo, hi = min(later), max(later)
                dev = max(abs(lo - base), abs(hi - base)) / base if base else None
                rss_dev.append(round(dev * 100, 1) if dev is not None else None)
                good = dev is not None and dev <= 0.15
                ok_rss &= good
                log(f"  broker {k + 1} VmRSS: {base:.1f} MB at minute {wr}, {lo:.1f}-{hi:.1f} MB from then on, "
                    f"end {later[-1]:.1f} MB: at most {dev * 100:.1f} % off (target +-15 %) -> "
                    f"{'met' if good else 'MISSED'}")
        else:
            ok_rss = False
            log(f"  VmRSS: no sample at minute {wr} -> MISSED")
        f = self.fate(conn)
        c = self.st.c
        ok_fate = (f["neither"] == 0 and f["both"] == 0 and f["duplicated"] == 0 and f["delivered_unaccepted"] == 0
                   and c["bad_data"] == 0 and c["unknown_frames"] == 0)
        log(f"  HTTP: {c['posts']} POSTs, {c['ops_sent']} ops sent, {c['post_fail']} POSTs failed "
            f"({c['ops_failed']} ops); pops {c['pops']} (failed {c['pop_fail']}), frames popped {c['popped']}, "
            f"acked {c['acked']} (failed {c['ack_fail']}), unknown frames {c['unknown_frames']}, frames whose data "
            f"is not their schedule's {c['bad_data']}")
        log(f"  fate: {f['keys_sent']} schedules sent, {f['accepted']} accepted ({f['not_accepted']} not: failed "
            f"requests); delivered exactly once {f['delivered_once']}, cancelled {f['cancelled']}, too_late "
            f"{f['too_late']} (delivered), absent at cancel {f['absent_after_fire']}, rescheduled {f['rescheduled']} "
            f"(+{f['resched_after_fire']} after the first fired), answer lost {f['ambiguous']}; "
            f"frames in the log at the end {f['frames_in_log_at_end']}, of them never popped {f['unconsumed_in_log']}; "
            f"popped again after a failed ack (the log's at-least-once delivery, not a second fire) "
            f"{f['popped_again_after_a_failed_ack']}")
        log(f"  never both and never neither: neither {f['neither']}, both {f['both']}, duplicated "
            f"{f['duplicated']}, delivered without an accepted schedule {f['delivered_unaccepted']}, wrong data "
            f"{c['bad_data']}, unknown frames {c['unknown_frames']} -> "
            f"{'met' if ok_fate else 'MISSED'}")
        for e in f["examples"]:
            log(f"    {e}")
        self.res.put("soak", minutes=m, rate=self.rate, windows={"lag_min": w5, "growth_min": w20, "rss_minute": wr},
                     lag_first_p99_ms=round(p_first * 1000, 1) if p_first is not None else None,
                     lag_last_p99_ms=round(p_last * 1000, 1) if p_last is not None else None,
                     growth_pct=growth, rss_dev_pct=rss_dev, fate=f, http=dict(c),
                     verdicts={"lag": ok_lag, "size": ok_size, "rss": ok_rss, "fate": ok_fate}, minutes_rows=self.rows)


def bench_soak(cluster: Cluster, url: str, res, minutes: int, rate: int, setup: str = "direct") -> None:
    if setup == "direct":
        Soak(cluster, url, res, minutes, rate).run()
        return
    from patroni import PatroniCell, _create_db
    cell, bouncers = PatroniCell(), []
    try:
        cell.start()
        direct = _create_db(cell)
        ports = dict(line.strip().split("=", 1) for line in (cell.dir / "ports").read_text().splitlines())
        for member in ("M1", "M2"):
            bouncers.append(Pgbouncer(ports[f"{member}_PG"], f"pgbouncer-soak-{member.lower()}"))
        listen = ",".join(f"127.0.0.1:{b.port}" for b in bouncers)
        pooled = f"postgresql://postgres@{listen}/queen?target_session_attrs=read-write&connect_timeout=2"
        versions = subprocess.run(["patroni", "--version"], capture_output=True, text=True).stdout.strip()
        pgb = subprocess.run(["pgbouncer", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
        log(f"\n  set-up: {versions}, 2 members (synchronous_mode on), etcd; {pgb} in front of each member "
            f"(pool_mode=transaction, default_pool_size=20); the members' URL {direct}")

        def switchover() -> str:
            before = cell.leader()
            cell.run("switchover")
            ok = wait_until(lambda: (now := cell.leader()) is not None and now[0] != before[0], 60, 0.2)
            synced = wait_until(cell.has_sync_standby, 120, 0.5)
            return (f"switchover {before[0]} -> {cell.leader()[0] if ok else '?'} "
                    f"({'done' if ok else 'NOT DONE'}; the old leader {'is' if synced else 'is NOT'} the "
                    f"synchronous standby again)")

        Soak(None, direct, res, minutes, rate, broker_url=pooled, setup="deployed", midway=switchover,
             broker_env={"QUEEN_POOL_MODE": "transaction", "QUEEN_DIRECT_DATABASE_URL": direct}).run()
    finally:
        for bouncer in bouncers:
            bouncer.stop()
        cell.destroy()
