"""Fault drills: broker SIGKILL mid-fire, PostgreSQL restart under load, a starved pool.

Each drill is bounded in count and time and ends with fired / lost /
duplicated counts by txn over what the drill knows was accepted.
"""

from __future__ import annotations

import asyncio
import base64
import random
import threading
import time

import httpx
import psycopg
import zstandard
from psycopg.types.composite import CompositeInfo, register_composite

from harness import (Cluster, connect, fate, log, metric_sum, start_broker, wait_healthy, wait_until)


def _report(res, section: str, f: dict, **extra) -> None:
    log(f"  expected {f['expected']}  fired {f['fired']}  lost {f['lost']}  duplicated {f['duplicated']}"
        f"  still pending {f['pending']}  dead-lettered {f['dead_lettered']}")
    res.put(section, **f, **extra)


class SqlFeeder(threading.Thread):
    """Schedules timers through queen.schedule_timers at a steady rate (half zstd, half plain),
    due within 0..200 ms, recording each accepted txn in bench.expected in the same transaction."""

    def __init__(self, url: str, queue: str, per_tick: int = 40, tick_s: float = 0.1, max_s: float = 900):
        super().__init__(daemon=True)
        self.url, self.queue, self.per_tick, self.tick_s, self.max_s = url, queue, per_tick, tick_s, max_s
        self.stop_evt = threading.Event()
        self.sent = 0
        self.errors = 0

    def run(self) -> None:
        cctx = zstandard.ZstdCompressor()
        raw = b'{"kind":"drill","pad":"' + b"z" * 200 + b'"}'
        zpayload = cctx.compress(raw)
        conn = psycopg.connect(self.url, autocommit=True)
        info = CompositeInfo.fetch(conn, "queen.timer_op")
        register_composite(info, conn)
        T = info.python_type
        t_end = time.monotonic() + self.max_s
        i = 0
        while not self.stop_evt.is_set() and time.monotonic() < t_end:
            ops = []
            for _ in range(self.per_tick):
                i += 1
                z = i % 2 == 0
                ops.append(T("schedule", self.queue, f"k{i}", random.randint(0, 200), f"{self.queue}-{i}",
                             zpayload if z else raw, None, z, False, len(raw) if z else None))
            try:
                conn.execute("""INSERT INTO bench.expected (txn, queue, deliver_at)
                                SELECT txn, queue, deliver_at FROM queen.schedule_timers('default', %s::queen.timer_op[])""",
                             (ops,))
                self.sent += len(ops)
            except psycopg.Error:
                self.errors += 1
            time.sleep(self.tick_s)
        conn.close()


def _in_fire(conn, broker_id: str) -> bool:
    """True when one of the broker's sessions is running a claim or fire statement right now."""
    return conn.execute("""SELECT EXISTS (SELECT 1 FROM pg_stat_activity
                            WHERE application_name LIKE %s AND state IN ('active', 'idle in transaction')
                              AND query ~ '(fire_due_timers|claim_timers|fire_timers)')""",
                        (f"%{broker_id}",)).fetchone()[0]


def drill_kill(cluster: Cluster, res, kills: int, lease_ms: int = 1500) -> None:
    log(f"\n== drill: SIGKILL a broker mid-fire x{kills} (two brokers, zstd + plain, lease {lease_ms} ms) ==")
    url = cluster.create_db("queen_drill_kill")
    env = {"QUEEN_SWEEPER_LEASE_MS": lease_ms}
    b = start_broker(url, "kb", **env)
    a = start_broker(url, "ka", **env)
    feeder = SqlFeeder(url, "drill-kill", max_s=kills * 10 + 60)
    feeder.start()
    mid = 0
    t0 = time.monotonic()
    try:
        with connect(url) as conn:
            for k in range(kills):
                # wait (bounded) until A's sweeper is inside a claim or fire statement, then kill at once
                # (odd kills after a random 0-10 ms more, to land between statements too)
                hit = wait_until(lambda: _in_fire(conn, a.broker_id), 2.0, 0.001)
                if k % 2:
                    time.sleep(random.random() * 0.01)
                a.kill()
                mid += hit
                a = start_broker(url, "ka", **env)
                if (k + 1) % 20 == 0:
                    log(f"  {k + 1} kills, {mid} seen inside a claim/fire statement just before, "
                        f"{time.monotonic() - t0:.0f} s")
        feeder.stop_evt.set()
        feeder.join(30)
        with connect(url) as conn:
            wait_until(lambda: conn.execute("SELECT count(*) FROM queen.timers").fetchone()[0] == 0,
                       lease_ms / 1000 + 60, 0.2)
            f = fate(conn)
        dup = sum(metric_sum(x.metrics(), "queen_timers_fired_total", outcome="duplicate") or 0 for x in (a, b))
        lost_claims = sum(metric_sum(x.metrics(), "queen_timers_claims_lost_total") or 0 for x in (a, b))
        log(f"  surviving brokers' counters: fires deduped by the log (outcome=duplicate) {dup:.0f}, "
            f"claims lost {lost_claims:.0f}")
        log(f"  {kills} kills ({mid} with A seen inside a claim/fire statement just before the SIGKILL), "
            f"{feeder.sent} timers scheduled (half zstd)")
        _report(res, "drill_kill", f, kills=kills, kills_mid_statement=mid, feeder_errors=feeder.errors,
                surviving_dedupe_hits=dup, surviving_claims_lost=lost_claims)
    finally:
        feeder.stop_evt.set()
        a.stop()
        b.stop()


async def _http_clients(urls: list[str], queue: str, clients: int, ops: int, seconds: float, prefix: str,
                        delay_max: int = 1000, timeout: float = 10) -> dict:
    """clients async workers POSTing batches of ops schedules until seconds pass.
    Returns accepted verdicts, txns whose outcome is unknown (transport error), status counts,
    and whether every 503 carried Retry-After."""
    accepted: list[tuple[str, str]] = []
    unknown: list[str] = []
    codes: dict = {}
    missing_retry_after = 0
    seq = 0
    payload = base64.b64encode(b'{"kind":"drill"}').decode()
    t_end = time.monotonic() + seconds

    async def worker(w: int):
        nonlocal seq, missing_retry_after
        async with httpx.AsyncClient(timeout=timeout) as c:
            n = 0
            while time.monotonic() < t_end:
                n += 1
                base = urls[(w + n) % len(urls)]
                batch = []
                for _ in range(ops):
                    seq += 1
                    key = f"{prefix}-{seq}"
                    batch.append({"op": "schedule", "queue": queue, "timerKey": key,
                                  "delayMs": random.randint(0, delay_max), "txn": key, "payload": payload})
                try:
                    r = await c.post(f"{base}/api/v1/timers", json={"operations": batch})
                except httpx.HTTPError as exc:
                    codes[type(exc).__name__] = codes.get(type(exc).__name__, 0) + 1
                    unknown.extend(o["txn"] for o in batch)
                    await asyncio.sleep(0.05)
                    continue
                codes[r.status_code] = codes.get(r.status_code, 0) + 1
                if r.status_code == 200:
                    body = r.json()
                    rows = body["results"]
                    for v in rows:
                        if v.get("ok") and v.get("status") in ("scheduled", "rescheduled"):
                            accepted.append((v["txn"], v.get("deliverAt")))
                else:
                    if r.status_code == 503 and "retry-after" not in r.headers:
                        missing_retry_after += 1
                    if r.status_code >= 500 and r.status_code != 503:
                        unknown.extend(o["txn"] for o in batch)
                    await asyncio.sleep(0.01)

    await asyncio.gather(*(worker(w) for w in range(clients)))
    return {"accepted": accepted, "unknown": unknown, "codes": codes, "missing_retry_after": missing_retry_after}


def _record(url: str, queue: str, out: dict) -> None:
    with connect(url) as conn:
        with conn.cursor() as cur:
            cur.executemany("INSERT INTO bench.expected (txn, queue, deliver_at, kind) VALUES (%s, %s, %s, 'fire') "
                            "ON CONFLICT (txn) DO NOTHING", [(t, queue, d) for t, d in out["accepted"]])
            cur.executemany("INSERT INTO bench.expected (txn, queue, kind) VALUES (%s, %s, 'unknown') "
                            "ON CONFLICT (txn) DO NOTHING", [(t, queue) for t in out["unknown"]])


def drill_pg_restart(cluster: Cluster, res, seconds: float = 20, down_s: float = 2) -> None:
    log(f"\n== drill: PostgreSQL restart under load ({seconds:g} s of HTTP schedules, restart at 1/3, "
        f"down {down_s:g} s) ==")
    url = cluster.create_db("queen_drill_pg")
    env = {"QUEEN_SWEEPER_LEASE_MS": 2000}
    a = start_broker(url, "pa", **env)
    b = start_broker(url, "pb", **env)
    restart_info = {}

    def restarter():
        time.sleep(seconds / 3)
        t = time.monotonic()
        cluster.stop()
        time.sleep(down_s)
        cluster.start()
        restart_info["down_s"] = time.monotonic() - t
        restart_info["at"] = time.time()

    th = threading.Thread(target=restarter, daemon=True)
    th.start()
    try:
        out = asyncio.run(_http_clients([a.url, b.url], "drill-pg", clients=4, ops=32, seconds=seconds,
                                        prefix="pg", timeout=10))
        th.join(120)
        recovered = True
        for br in (a, b):
            try:
                wait_healthy(br, 60)
            except RuntimeError:
                recovered = False
        log(f"  PostgreSQL was down {restart_info.get('down_s', 0):.1f} s; POST status counts {out['codes']}; "
            f"brokers alive and healthy after: {recovered and a.alive() and b.alive()}")
        _record(url, "drill-pg", out)
        with connect(url) as conn:
            wait_until(lambda: conn.execute("SELECT count(*) FROM queen.timers").fetchone()[0] == 0, 90, 0.2)
            f = fate(conn)
            unknown_fired = conn.execute("""SELECT count(*) FROM bench.expected e JOIN queen.messages m
                                             ON m.transaction_id = e.txn WHERE e.kind = 'unknown'""").fetchone()[0]
            after = conn.execute("SELECT count(*) FROM queen.messages WHERE created_at > to_timestamp(%s)",
                                 (restart_info.get("at", 0),)).fetchone()[0]
        log(f"  {len(out['unknown'])} txns with unknown outcome (transport error), of which {unknown_fired} fired; "
            f"{after} frames fired after the restart; 503 without Retry-After: {out['missing_retry_after']}")
        _report(res, "drill_pg_restart", f, codes={str(k): v for k, v in out["codes"].items()},
                unknown=len(out["unknown"]), unknown_fired=unknown_fired, fired_after_restart=after,
                brokers_recovered=recovered and a.alive() and b.alive(),
                missing_retry_after=out["missing_retry_after"])
    finally:
        a.stop()
        b.stop()


def drill_pool(cluster: Cluster, res, clients: int = 48, seconds: float = 10) -> None:
    log(f"\n== drill: pool starved (QUEEN_POOL_MAX=1, QUEEN_POOL_TIMEOUT_MS=20), {clients} concurrent clients, "
        f"{seconds:g} s ==")
    url = cluster.create_db("queen_drill_pool")
    a = start_broker(url, "pool", QUEEN_POOL_MAX=1, QUEEN_POOL_MIN=1, QUEEN_POOL_TIMEOUT_MS=20)
    try:
        out = asyncio.run(_http_clients([a.url], "drill-pool", clients=clients, ops=16, seconds=seconds,
                                        prefix="pool", delay_max=500))
        _record(url, "drill-pool", out)
        n503 = out["codes"].get(503, 0)
        log(f"  status counts {out['codes']}; 503s {n503}, of which without Retry-After {out['missing_retry_after']}")
        if not a.alive():
            log(f"  BROKER EXITED with {a.proc.returncode}; log tail:\n"
                + a.log_path.read_text(errors="replace")[-2000:])
        with connect(url) as conn:
            wait_until(lambda: conn.execute("SELECT count(*) FROM queen.timers").fetchone()[0] == 0, 60, 0.2)
            f = fate(conn)
        _report(res, "drill_pool", f, codes={str(k): v for k, v in out["codes"].items()}, status_503=n503,
                missing_retry_after=out["missing_retry_after"], unknown=len(out["unknown"]),
                broker_alive_after=a.alive())
    finally:
        a.stop()
