"""Cancel section: queen.cancel_timer against a bare DELETE by key, the HTTP
DELETE route with 1 and 4 clients, and the HTTP DELETE under fire load.

Fairness of the SQL comparison (issue 12):
- one client connection for both sides (same settings), statements prepared
  on both sides (psycopg prepare=True), the same N keys re-seeded before
  every run (same rows, same pages: VACUUM ANALYZE + CHECKPOINT after the
  seed), rounds alternating the order of the two sides, median of rounds;
- the broker is stopped (SIGSTOP) during the SQL rounds, so that its
  sweeper takes no part; pg_stat_statements tracks top-level statements
  only on the timing connection (the extension's default; the bench's
  cluster tracks nested ones too, for the profile, which would bill every
  nested statement of the function for the profiler's own bookkeeping).
  The profile is a separate, untimed pass with nested tracking on.
"""

from __future__ import annotations

import asyncio
import json
import signal
import statistics
import threading
import time

import psycopg
from psycopg.types.composite import CompositeInfo, register_composite

from harness import OUT, Broker, connect, explain_nested_statements, load_timers, log, pct

QUEUE = "bench-cancel"
TENANT = "default"  # the broker's tenant when auth is off

CANCEL_SQL = "SELECT queen.cancel_timer(%s, %s, %s)"
BARE_SQL = ("DELETE FROM queen.timers WHERE (tenant, queue, timer_key) = (%s, %s, %s) "
            "RETURNING timer_key")


def _key(i: int) -> str:
    return f"c-{i}"


def seed(conn, n: int, queue: str = QUEUE) -> None:
    """The same n pending timers (keys c-1..c-n, deliver in 30 days) and a
    counter that matches the table; same pages for every run."""
    conn.execute("DELETE FROM queen.timers WHERE queue = %s", (queue,))
    load_timers(conn, queue=queue, n=n, prefix="c", expected=False,
                deliver_sql="now() + interval '30 days'")
    conn.execute("DELETE FROM queen.tenant_usage_deltas WHERE tenant = %s", (TENANT,))
    conn.execute("""UPDATE queen.tenant_usage
                       SET pending_timers = (SELECT count(*) FROM queen.timers WHERE tenant = %(t)s)
                     WHERE tenant = %(t)s""", {"t": TENANT})
    conn.execute("VACUUM ANALYZE queen.timers")
    conn.execute("VACUUM ANALYZE queen.tenant_usage")
    conn.execute("VACUUM ANALYZE queen.tenant_usage_deltas")
    conn.execute("CHECKPOINT")


def counter(conn) -> int:
    return conn.execute("SELECT queen.get_pending_timers(%s)", (TENANT,)).fetchone()[0]


def left(conn, queue: str = QUEUE) -> int:
    return conn.execute("SELECT count(*) FROM queen.timers WHERE queue = %s", (queue,)).fetchone()[0]


def _summary(lat: list[float], secs: float) -> dict:
    return {"per_s": len(lat) / secs if secs else 0.0, "p50_ms": pct(lat, 50) * 1000, "p99_ms": pct(lat, 99) * 1000,
            "max_ms": max(lat) * 1000}


def sql_run(client, admin, method: str, n: int) -> dict:
    """n single cancels by key from one client: queen.cancel_timer or the bare DELETE."""
    seed(admin, n)
    before = counter(admin)
    sql = CANCEL_SQL if method == "cancel_timer" else BARE_SQL
    admin.execute("SELECT pg_stat_statements_reset()")
    lat = []
    hits = 0
    t0 = time.perf_counter()
    for i in range(1, n + 1):
        t = time.perf_counter()
        row = client.execute(sql, (TENANT, QUEUE, _key(i)), prepare=True).fetchone()
        lat.append(time.perf_counter() - t)
        if method == "cancel_timer":
            hits += row is not None and row[0] == "cancelled"
        else:
            hits += row is not None
    secs = time.perf_counter() - t0
    out = _summary(lat, secs)
    # the server's own time per call (top-level statement, pg_stat_statements)
    server = admin.execute("""SELECT mean_exec_time FROM pg_stat_statements
                               WHERE calls >= %s AND query LIKE %s""",
                           (n, "SELECT queen.cancel_timer(%" if method == "cancel_timer"
                            else "DELETE FROM queen.timers WHERE (tenant, queue, timer_key)%")).fetchone()
    out.update(hits=hits, left=left(admin), counter_drop=before - counter(admin),
               server_us=server[0] * 1000 if server else None)
    return out


# -------------------------------------------------------------------------
# HTTP
# -------------------------------------------------------------------------

class RawHttp:
    """One keep-alive HTTP/1.1 connection on asyncio streams: a request line, the
    response head, Content-Length bytes of body. The bench's client must cost
    little beside the broker it measures: httpx spends about 2 ms of CPU per
    request on a 2-core machine, more than the broker does, and would be what
    the figures measure."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> "RawHttp":
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def request(self, method: str, path: str) -> tuple[int, bytes]:
        self.writer.write(f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\n\r\n".encode())
        head = await self.reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return int(head[9:12]), await self.reader.readexactly(length)

    def close(self) -> None:
        if self.writer:
            self.writer.close()


def _verdict(status: int, body: bytes) -> str:
    if status == 200:
        try:
            return json.loads(body).get("status")
        except ValueError:
            pass
    return body[:60].decode(errors="replace")


async def _http_cancels(broker: Broker, keys: list[str], clients: int) -> tuple[float, list[float], dict]:
    it = iter(keys)
    lat: list[float] = []
    outcomes: dict = {}

    async def worker(c: RawHttp):
        for key in it:
            t = time.perf_counter()
            status, body = await c.request("DELETE", f"/api/v1/timers/{QUEUE}/{key}")
            lat.append(time.perf_counter() - t)
            k = (status, _verdict(status, body))
            outcomes[k] = outcomes.get(k, 0) + 1

    conns = [await RawHttp("127.0.0.1", broker.port).open() for _ in range(clients)]
    try:
        for c in conns:  # every connection open and served once before the clock starts
            await c.request("GET", "/health")
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(c) for c in conns))
        return time.perf_counter() - t0, lat, outcomes
    finally:
        for c in conns:
            c.close()


def http_run(broker: Broker, admin, clients: int, n: int) -> dict:
    seed(admin, n)
    before = counter(admin)
    secs, lat, outcomes = asyncio.run(_http_cancels(broker, [_key(i) for i in range(1, n + 1)], clients))
    out = _summary(lat, secs)
    out.update(outcomes={f"{k[0]} {k[1]}": v for k, v in outcomes.items()}, left=left(admin),
               counter_drop=before - counter(admin))
    return out


# -------------------------------------------------------------------------
# Profile (untimed): pg_stat_statements with nested statements, auto_explain
# -------------------------------------------------------------------------

def explain_cancel(conn, key: str) -> str:
    """EXPLAIN (ANALYZE, BUFFERS) of every statement queen.cancel_timer runs for one key
    (auto_explain, nested statements), rolled back."""
    notices: list[str] = []
    handler = lambda d: notices.append(d.message_primary or "")  # noqa: E731
    conn.add_notice_handler(handler)
    try:
        conn.execute("BEGIN")
        try:
            explain_nested_statements(conn)
            notices.clear()
            status = conn.execute(CANCEL_SQL, (TENANT, QUEUE, key)).fetchone()[0]
        finally:
            conn.execute("ROLLBACK")
    finally:
        conn.remove_notice_handler(handler)
    return f"-- queen.cancel_timer('{TENANT}', '{QUEUE}', '{key}') -> {status}\n" + "\n\n".join(notices)


def profile(url: str, admin, n: int) -> list[str]:
    report = []
    seed(admin, n)
    with psycopg.connect(url, autocommit=True) as c:
        c.execute("SET pg_stat_statements.track = 'all'")
        for i in range(1, 6):  # past the plan cache's custom plans
            c.execute(CANCEL_SQL, (TENANT, QUEUE, _key(i)), prepare=True).fetchone()
        report.append(explain_cancel(c, _key(n)))
        report.append(explain_cancel(c, "no-such-key"))
        admin.execute("SELECT pg_stat_statements_reset()")
        for i in range(6, n):
            c.execute(CANCEL_SQL, (TENANT, QUEUE, _key(i)), prepare=True).fetchone()
        c.execute(BARE_SQL, (TENANT, QUEUE, _key(n)), prepare=True).fetchone()
        for _ in range(3):  # absent verdicts: the path a miss takes
            c.execute(CANCEL_SQL, (TENANT, QUEUE, "no-such-key"), prepare=True).fetchone()
    rows = admin.execute("""
        SELECT toplevel, calls, round((mean_exec_time * 1000)::numeric, 1),
               round(total_exec_time::numeric, 1), regexp_replace(left(query, 100), '\\s+', ' ', 'g')
          FROM pg_stat_statements
         WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
           AND calls >= 3
           AND (query ILIKE '%%cancel_timer%%' OR query ILIKE '%%queen.timers%%'
                OR query ILIKE '%%tenant_usage%%' OR query ILIKE '%%delete_unclaimed%%')
         ORDER BY toplevel DESC, total_exec_time DESC LIMIT 12""").fetchall()
    lines = ["-- pg_stat_statements, nested statements tracked (top, calls, mean us, total ms, query)"]
    for r in rows:
        lines.append(f"  {'top ' if r[0] else '    '}{r[1]:>7} {r[2]:>9} {r[3]:>9}  {r[4]}")
    report.insert(0, "\n".join(lines))
    return report


# -------------------------------------------------------------------------
# Under load: HTTP DELETE at a steady rate while timers fire continuously
# -------------------------------------------------------------------------

def _scheduler(url: str, stop: threading.Event, t0: float, seconds: float, fire_rate: int, cancel_rate: int,
               tick: float, fire_delay_ms: int, cancel_delay_ms: int, stats: dict, run: str) -> None:
    """Every tick: fire_rate*tick timers due fire_delay_ms later (they fire) and
    cancel_rate*tick timers due cancel_delay_ms later (the cancel targets), one
    queen.schedule_timers call."""
    per_fire = round(fire_rate * tick)
    per_cancel = round(cancel_rate * tick)
    with psycopg.connect(url, autocommit=True) as conn:
        info = CompositeInfo.fetch(conn, "queen.timer_op")
        register_composite(info, conn)
        T = info.python_type
        payload = b'{"kind":"cancel-load"}'
        b = 0
        while not stop.is_set():
            when = t0 + b * tick
            if when - t0 >= seconds:
                break
            now = time.monotonic()
            if when > now:
                time.sleep(when - now)
            elif now - when > 1.0:
                stats["late_ticks"] = stats.get("late_ticks", 0) + 1
            ops = [T("schedule", QUEUE + "-load", f"lf{run}-{b}-{i}", fire_delay_ms, f"lf{run}-{b}-{i}", payload,
                     None, False, False, None) for i in range(per_fire)]
            ops += [T("schedule", QUEUE + "-load", f"lc{run}-{b}-{i}", cancel_delay_ms, f"lc{run}-{b}-{i}", payload,
                      None, False, False, None) for i in range(per_cancel)]
            conn.execute("SELECT count(*) FROM queen.schedule_timers(%s, %s::queen.timer_op[], NULL, NULL, false)",
                         (TENANT, ops)).fetchone()
            stats["scheduled"] = stats.get("scheduled", 0) + len(ops)
            b += 1
        stats["batches"] = b


async def _paced_cancels(broker: Broker, targets: list[tuple[float, str]]) -> list[tuple[int, float, str]]:
    """Open loop: each DELETE is sent at its own time on an idle keep-alive
    connection (a new one when none is idle), whatever the others are doing."""
    out: list[tuple[int, float, str]] = []
    idle: list[RawHttp] = []
    opened: list[RawHttp] = []
    for _ in range(4):
        c = await RawHttp("127.0.0.1", broker.port).open()
        await c.request("GET", "/health")
        opened.append(c)
        idle.append(c)

    async def one(at: float, key: str):
        delay = at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        t = time.perf_counter()
        path = f"/api/v1/timers/{QUEUE}-load/{key}"
        while idle and idle[-1].reader.at_eof():  # closed by the server while idle (keep-alive timeout)
            idle.pop()
        c = idle.pop() if idle else None
        reused = c is not None
        for attempt in (0, 1):
            try:
                if c is None:
                    c = await RawHttp("127.0.0.1", broker.port).open()
                    opened.append(c)
                status, body = await c.request("DELETE", path)
                out.append((status, time.perf_counter() - t, _verdict(status, body)))
                idle.append(c)
                return
            except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                if attempt == 0 and reused:
                    c = None  # a kept-alive connection the server closed: once more on a new one
                    continue
                out.append((-1, time.perf_counter() - t, type(exc).__name__))
                return

    try:
        await asyncio.gather(*(one(at, key) for at, key in targets))
    finally:
        for c in opened:
            c.close()
    return out


def under_load(url: str, broker: Broker, admin, seconds: float, fire_rate: int, cancel_rate: int) -> dict:
    tick = 0.05
    fire_delay_ms, cancel_delay_ms, cancel_after = 1000, 2500, 1.25
    q = QUEUE + "-load"
    admin.execute("SELECT queen.resume_fire()")  # whatever an earlier section left
    admin.execute("DELETE FROM queen.timers WHERE queue = %s", (q,))
    admin.execute("SELECT queen.ensure_partition(%s, 'Default')", (q,))
    per_cancel = round(cancel_rate * tick)
    t0 = time.monotonic() + 0.5
    n_ticks = int(seconds / tick)
    # each cancel target is cancelled cancel_after s after its batch, evenly spread within the tick
    run = str(int(time.time()))  # keys and txns of this run only (a txn fires once per partition)
    targets = [(t0 + b * tick + cancel_after + i * tick / per_cancel, f"lc{run}-{b}-{i}")
               for b in range(n_ticks) for i in range(per_cancel)]
    stop = threading.Event()
    stats: dict = {}
    th = threading.Thread(target=_scheduler, args=(url, stop, t0, seconds, fire_rate, cancel_rate, tick,
                                                   fire_delay_ms, cancel_delay_ms, stats, run), daemon=True)
    th.start()
    t_db0 = admin.execute("SELECT clock_timestamp()").fetchone()[0]
    admin.execute("SELECT pg_stat_statements_reset()")
    try:
        rows = asyncio.run(_paced_cancels(broker, targets))
    finally:
        stop.set()
        th.join(60)
    # let the last fire timers go out, then count what fired during the window
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and admin.execute(
            "SELECT EXISTS (SELECT 1 FROM queen.timers WHERE queue = %s AND timer_key LIKE 'lf%%')", (q,)).fetchone()[0]:
        time.sleep(0.1)
    fired, span, targets_fired = admin.execute("""
        SELECT count(*) FILTER (WHERE m.transaction_id LIKE 'lf' || %s || '-%%'),
               extract(epoch FROM max(m.created_at) - min(m.created_at))::float8,
               count(*) FILTER (WHERE m.transaction_id LIKE 'lc' || %s || '-%%')
          FROM queen.messages m JOIN queen.partitions p ON p.id = m.partition_id
          JOIN queen.queues qq ON qq.id = p.queue_id
         WHERE qq.name = %s AND m.created_at >= %s""", (run, run, q, t_db0)).fetchone()
    lat = [r[1] for r in rows if r[0] == 200]
    outcomes: dict = {}
    for r in rows:
        k = f"{r[0]} {r[2]}"
        outcomes[k] = outcomes.get(k, 0) + 1
    # where a cancel's time went on the server during the window (the broker's statements)
    sql = admin.execute("""
        SELECT calls, round(mean_exec_time::numeric, 3), round(max_exec_time::numeric, 2),
               regexp_replace(left(query, 80), '\\s+', ' ', 'g')
          FROM pg_stat_statements
         WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
           AND (query ILIKE '%%cancel_timer%%' OR query ILIKE 'UPDATE queen.tenant_usage%%'
                OR query ILIKE 'INSERT INTO queen.tenant_usage%%' OR query ILIKE '%%fold_pending_deltas%%'
                OR query ILIKE 'DELETE FROM queen.timers%%' OR query ILIKE '%%schedule_timers(%%'
                OR query ILIKE '%%bump_tenant_usage%%' OR query ILIKE '%%fire_due_timers%%')
         ORDER BY total_exec_time DESC LIMIT 8""").fetchall()
    admin.execute("DELETE FROM queen.timers WHERE queue = %s", (q,))
    return {"server_sql": [[r[0], float(r[1]), float(r[2]), r[3]] for r in sql], "seconds": seconds, "cancels": len(rows), "cancel_rate": cancel_rate, "fire_rate": fire_rate,
            "scheduled": stats.get("scheduled", 0), "late_ticks": stats.get("late_ticks", 0),
            "fired": fired, "fired_per_s": fired / span if span else None,
            "p50_ms": pct(lat, 50) * 1000 if lat else None, "p99_ms": pct(lat, 99) * 1000 if lat else None,
            "max_ms": max(lat) * 1000 if lat else None, "outcomes": outcomes, "targets_fired": targets_fired}


# -------------------------------------------------------------------------
# The section
# -------------------------------------------------------------------------

def bench_cancel(url: str, broker: Broker, res, n: int, rounds: int, http_n: int, load_seconds: float,
                 fire_rate: int = 1000, cancel_rate: int = 200) -> None:
    log(f"\n== cancel: {n} single cancels by key from one client, queen.cancel_timer vs a bare DELETE, "
        f"{rounds} alternating rounds ==")
    sql_runs: dict[str, list[dict]] = {"cancel_timer": [], "bare_delete": []}
    with connect(url) as admin, psycopg.connect(url, autocommit=True) as client:
        client.execute("SET pg_stat_statements.track = 'top'")
        broker.proc.send_signal(signal.SIGSTOP)
        try:
            for r in range(rounds):
                order = ("cancel_timer", "bare_delete") if r % 2 == 0 else ("bare_delete", "cancel_timer")
                for method in order:
                    out = sql_run(client, admin, method, n)
                    sql_runs[method].append(out)
                    log(f"  round {r + 1} {method:12s}: {out['per_s']:7.0f} cancels/s  p50 {out['p50_ms']:.3f} ms  "
                        f"p99 {out['p99_ms']:.3f} ms  server {out['server_us'] or 0:.1f} us/call  "
                        f"(hits {out['hits']}, left {out['left']}, counter -{out['counter_drop']})")
        finally:
            broker.proc.send_signal(signal.SIGCONT)
        med = {m: {k: statistics.median(x[k] or 0 for x in v) for k in ("per_s", "p50_ms", "p99_ms", "server_us")}
               for m, v in sql_runs.items()}
        ratios = [a["per_s"] / b["per_s"] for a, b in zip(sql_runs["cancel_timer"], sql_runs["bare_delete"])]
        for m, v in med.items():
            log(f"  median {m:12s}: {v['per_s']:7.0f} cancels/s  p50 {v['p50_ms']:.3f} ms  p99 {v['p99_ms']:.3f} ms  "
                f"server {v['server_us']:.1f} us/call")
        ratio = med["cancel_timer"]["per_s"] / med["bare_delete"]["per_s"]
        p50_ratio = med["bare_delete"]["p50_ms"] / med["cancel_timer"]["p50_ms"]
        log(f"  ratio cancel_timer / bare delete: {ratio:.2f} (medians; per-round "
            f"{', '.join(f'{x:.2f}' for x in ratios)}; median of per-round ratios {statistics.median(ratios):.2f}) "
            f"(target >= 0.8)")
        log(f"  same ratio by p50 latency (bare p50 / cancel_timer p50): {p50_ratio:.2f}; server time per call "
            f"{med['cancel_timer']['server_us']:.1f} vs {med['bare_delete']['server_us']:.1f} us")
        bad = [x for x in sql_runs["cancel_timer"] if x["hits"] != n or x["counter_drop"] != n or x["left"]]
        if bad:
            log(f"  WARNING: {len(bad)} cancel_timer runs did not cancel all {n} (or the counter moved otherwise)")
        res.put("cancel_sql", n=n, rounds=rounds,
                median={m: {k: round(x, 3) for k, x in v.items()} for m, v in med.items()},
                runs={m: [{k: (round(x, 3) if isinstance(x, float) else x) for k, x in o.items()} for o in v]
                      for m, v in sql_runs.items()},
                ratio_medians=round(ratio, 3), ratio_per_round=[round(x, 3) for x in ratios],
                ratio_p50=round(p50_ratio, 3))

        log(f"\n== cancel over HTTP: DELETE /api/v1/timers/:queue/:key, {http_n} per run, 1 and 4 clients, "
            f"{rounds} alternating rounds ==")
        http_runs: dict[int, list[dict]] = {1: [], 4: []}
        for r in range(rounds):
            for clients in ((1, 4) if r % 2 == 0 else (4, 1)):
                out = http_run(broker, admin, clients, http_n)
                http_runs[clients].append(out)
                log(f"  round {r + 1} {clients} client{'s' if clients > 1 else ' '}: {out['per_s']:6.0f} cancels/s  "
                    f"p50 {out['p50_ms']:.2f} ms  p99 {out['p99_ms']:.2f} ms  {out['outcomes']}")
        hmed = {c: {k: statistics.median(x[k] for x in v) for k in ("per_s", "p50_ms", "p99_ms")}
                for c, v in http_runs.items()}
        for c, v in hmed.items():
            log(f"  median {c} client{'s' if c > 1 else ' '}: {v['per_s']:6.0f} cancels/s  p50 {v['p50_ms']:.2f} ms  "
                f"p99 {v['p99_ms']:.2f} ms")
        res.put("cancel_http", n=http_n, rounds=rounds,
                median={f"{c}_clients": {k: round(x, 3) for k, x in v.items()} for c, v in hmed.items()},
                runs={f"{c}_clients": [{k: (round(x, 3) if isinstance(x, float) else x) for k, x in o.items()}
                                       for o in v] for c, v in http_runs.items()})

        log("  profile (untimed): pg_stat_statements with nested statements, auto_explain")
        report = profile(url, admin, min(n, 2000))
        for line in report[0].splitlines():
            log("  " + line)
        (OUT / "cancel-profile.txt").write_text("\n\n".join(report))
        log(f"  plans: {OUT / 'cancel-profile.txt'}")
        admin.execute("DELETE FROM queen.timers WHERE queue = %s", (QUEUE,))

        log(f"\n== cancel under load: HTTP DELETE at {cancel_rate}/s while {fire_rate} timers/s are scheduled "
            f"and fire, {load_seconds:g} s ==")
        out = under_load(url, broker, admin, load_seconds, fire_rate, cancel_rate)
        log(f"  scheduled {out['scheduled']} (late ticks {out['late_ticks']}); fired {out['fired']} "
            f"({out['fired_per_s'] or 0:.0f}/s); cancel targets fired {out['targets_fired']}")
        log(f"  DELETE latency: n {out['cancels']}  p50 {out['p50_ms'] or 0:.2f} ms  p99 {out['p99_ms'] or 0:.2f} ms  "
            f"max {out['max_ms'] or 0:.2f} ms  {out['outcomes']}  (target p99 <= 5 ms)")
        log("  server side during the window (calls, mean ms, max ms, statement):")
        for r in out["server_sql"]:
            log(f"    {r[0]:>6} {r[1]:>8.3f} {r[2]:>8.2f}  {r[3]}")
        res.put("cancel_load", **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items()})
