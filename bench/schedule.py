"""Schedule section: queen.schedule_timers against a bare batched upsert of the
same rows, and POST /api/v1/timers against the same SQL (issue 9).

Three sides, each writing the same rows (keys s-<batch>-<i>, a 54-byte
JSON payload, tenant `default`, queue bench-sched, due in an hour) in
batches of 256 from the same number of clients:
- bare:   one `INSERT INTO queen.timers (...) SELECT ... FROM unnest(...)
          ON CONFLICT (tenant, queue, timer_key) DO UPDATE SET ...` per batch;
          no verdicts, no gates, no metering.
- sql:    routes_timers.SCHEDULE_SQL (the ops as parallel binary arrays,
          queen.schedule_timers, the verdict rows fetched; the CLI's
          statement, which the route wraps in json_agg), with the parameters
          the broker builds, one connection per client thread. "Direct SQL"
          of the ratio HTTP / SQL.
- http:   POST /api/v1/timers to the broker, one keep-alive connection per
          client on a minimal HTTP/1.1 client (cancel.RawHttp on uvloop, the
          answers read by orjson: httpx would cost the 2 shared cores more than
          the broker's own work, as psycopg's rows cost the SQL side).
Fairness: before every run the table is emptied and the counters reset the
same way (TRUNCATE, VACUUM ANALYZE, CHECKPOINT), so every run inserts the
same rows into the same empty pages; statements are prepared on both SQL
sides; the rounds rotate the order of the sides; pg_stat_statements tracks
top-level statements only during the timed runs (the cluster tracks nested
ones for the profiles, which bills every statement inside a PL/pgSQL
function and not the bare one); the broker is stopped (SIGSTOP) during the
two SQL sides so its sweeper takes no part. Medians of the rounds are the
figures; per-round values and ratios are printed too. The profile pass
(pg_stat_statements with nested statements, auto_explain) is untimed.
"""

from __future__ import annotations

import asyncio
import base64
import json
import signal
import statistics
import threading
import time

import orjson
import psycopg
import uvloop

from cancel import RawHttp, content_length
from harness import OUT, Broker, connect, explain_rolled_back, log

from queen_timers.routes_timers import SCHEDULE_SQL, _parse_ops, _schedule_params

BATCH = 256
QUEUE = "bench-sched"
TENANT = "default"
DELAY_MS = 3_600_000
HORIZON_MS = 90 * 24 * 3600 * 1000
PAYLOAD = b'{"kind":"bench","pad":"' + b"x" * 40 + b'"}'
TARGET_SQL_VS_BARE = 0.9   # issue 19 (0.6 in issue 9)
TARGET_HTTP_VS_SQL = 0.85  # issue 19 (0.6 in issue 9)

BARE_SQL = """
INSERT INTO queen.timers AS t (tenant, queue, timer_key, partition, deliver_at, txn, message_id, payload)
SELECT %(tenant)s, o.queue, o.timer_key, 'Default', now() + o.delay_ms * interval '1 millisecond', o.txn,
       gen_random_uuid(), o.payload
  FROM unnest(%(queue)s::text[], %(timer_key)s::text[], %(delay_ms)s::bigint[], %(txn)s::text[],
              %(payload)s::bytea[]) AS o(queue, timer_key, delay_ms, txn, payload)
ON CONFLICT (tenant, queue, timer_key) DO UPDATE
   SET partition = EXCLUDED.partition, deliver_at = EXCLUDED.deliver_at, txn = EXCLUDED.txn,
       message_id = EXCLUDED.message_id, payload = EXCLUDED.payload, updated_at = now()
"""


def batches(n_batches: int) -> list[list[dict]]:
    """The same operations for every run of every side: POST bodies' "operations"."""
    b64 = base64.b64encode(PAYLOAD).decode()
    return [[{"op": "schedule", "queue": QUEUE, "timerKey": f"s-{b}-{i}", "delayMs": DELAY_MS,
              "txn": f"s-{b}-{i}", "payload": b64} for i in range(BATCH)] for b in range(n_batches)]


def broker_params(ops: list[dict]) -> dict:
    """SCHEDULE_SQL's parameters as routes_timers.schedule builds them (auth off, default settings):
    the same validation and arrays, built before the clock starts."""
    params = _schedule_params(_parse_ops({"operations": ops}, BATCH))
    params.update(tenant=TENANT, producer_sub=None, horizon_ms=HORIZON_MS, tenancy=False, max_ops=BATCH)
    return params


def bare_params(ops: list[dict]) -> dict:
    return {"tenant": TENANT, "queue": [o["queue"] for o in ops], "timer_key": [o["timerKey"] for o in ops],
            "delay_ms": [o["delayMs"] for o in ops], "txn": [o["txn"] for o in ops],
            "payload": [base64.b64decode(o["payload"]) for o in ops]}


def clean(admin, expected: bool = True) -> None:
    """The same starting state before every run: no timer rows, counters at 0, fresh stats, a checkpoint.
    expected=False: a database without the bench's own schema (bench/schedule_compare.py)."""
    admin.execute("TRUNCATE queen.timers, bench.expected" if expected else "TRUNCATE queen.timers")
    admin.execute("DELETE FROM queen.tenant_usage_deltas")
    admin.execute("UPDATE queen.tenant_usage SET pending_timers = 0")
    for t in ("queen.timers", "queen.tenant_usage", "queen.tenant_usage_deltas"):
        admin.execute(f"VACUUM ANALYZE {t}")
    admin.execute("CHECKPOINT")


def _sql_side(url: str, sql: str, params: list[dict], clients: int, fetch: bool) -> tuple[float, int]:
    """Every batch once, from `clients` connections (one thread each), prepared statements.
    Returns (seconds, verdict rows fetched)."""
    conns = [psycopg.connect(url, autocommit=True) for _ in range(clients)]
    empty = {k: ([] if isinstance(v, list) else v) for k, v in params[0].items()}
    for c in conns:  # prepared on every connection before the clock starts (an empty batch)
        c.execute(sql, empty, prepare=True)
    it = iter(params)
    lock = threading.Lock()
    rows = [0]

    def worker(conn):
        while True:
            with lock:
                p = next(it, None)
            if p is None:
                return
            cur = conn.execute(sql, p, prepare=True)
            if fetch:
                got = len(cur.fetchall())
                with lock:
                    rows[0] += got

    threads = [threading.Thread(target=worker, args=(c,)) for c in conns]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    secs = time.perf_counter() - t0
    for c in conns:
        c.close()
    return secs, rows[0]


class RawPost(RawHttp):
    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        head = await self.reader.readuntil(b"\r\n\r\n")
        return int(head[9:12]), await self.reader.readexactly(content_length(head))


async def _http_side(broker: Broker, bodies: list[bytes], clients: int) -> tuple[float, dict, int]:
    it = iter(bodies)
    codes: dict[int, int] = {}
    scheduled = [0]

    async def worker(c: RawPost):
        for body in it:
            status, resp = await c.post("/api/v1/timers", body)
            codes[status] = codes.get(status, 0) + 1
            if status == 200:
                scheduled[0] += sum(1 for r in orjson.loads(resp)["results"] if r["status"] == "scheduled")

    conns = [await RawPost("127.0.0.1", broker.port).open() for _ in range(clients)]
    try:
        for c in conns:
            await c.request("GET", "/health")
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(c) for c in conns))
        return time.perf_counter() - t0, codes, scheduled[0]
    finally:
        for c in conns:
            c.close()


def run_side(url: str, broker: Broker, admin, side: str, ops: list[list[dict]], clients: int,
             floor: Broker | None = None) -> dict:
    clean(admin)
    total = sum(len(b) for b in ops)
    out: dict = {}
    if side in ("http", "floor"):
        bodies = [json.dumps({"operations": b}).encode() for b in ops]
        if side == "floor":  # the broker stopped, as for the SQL sides
            broker.proc.send_signal(signal.SIGSTOP)
        try:
            # uvloop and orjson: the client costs little beside the SQL side's (psycopg's rows)
            secs, codes, ok = uvloop.run(_http_side(floor if side == "floor" else broker, bodies, clients))
        finally:
            if side == "floor":
                broker.proc.send_signal(signal.SIGCONT)
        out["codes"] = codes
        out["scheduled"] = ok
    else:
        if side == "sql":
            params, sql = [broker_params(b) for b in ops], SCHEDULE_SQL
        else:
            params, sql = [bare_params(b) for b in ops], BARE_SQL
        broker.proc.send_signal(signal.SIGSTOP)
        try:
            secs, rows = _sql_side(url, sql, params, clients, fetch=(side == "sql"))
        finally:
            broker.proc.send_signal(signal.SIGCONT)
        if side == "sql":
            out["verdicts"] = rows
    out["rows"] = admin.execute("SELECT count(*) FROM queen.timers WHERE queue = %s", (QUEUE,)).fetchone()[0]
    out["counter"] = admin.execute("SELECT queen.get_pending_timers(%s)", (TENANT,)).fetchone()[0]
    out["secs"] = secs
    out["per_s"] = total / secs
    return out


# -------------------------------------------------------------------------
# Profile (untimed)
# -------------------------------------------------------------------------

def explain_schedule(conn, ops: list[dict]) -> str:
    """auto_explain (ANALYZE, BUFFERS, nested statements) of one batch through SCHEDULE_SQL, rolled back."""
    n, secs, notices = explain_rolled_back(
        conn, lambda c: len(c.execute(SCHEDULE_SQL, broker_params(ops)).fetchall()))
    return f"-- schedule_timers of {len(ops)} ops: {n} verdicts in {secs * 1000:.1f} ms\n" + "\n\n".join(notices)


def profile(url: str, admin, ops: list[list[dict]]) -> list[str]:
    clean(admin)
    report = []
    with psycopg.connect(url, autocommit=True) as c:
        c.execute("SET pg_stat_statements.track = 'all'")
        half = len(ops) // 2
        for b in ops[:max(1, min(6, half))]:  # past the plan cache's first custom plans
            c.execute(SCHEDULE_SQL, broker_params(b), prepare=True).fetchall()
        report.append(explain_schedule(c, ops[-1]))
        admin.execute("SELECT pg_stat_statements_reset()")
        for b in ops[max(1, min(6, half)):]:
            c.execute(SCHEDULE_SQL, broker_params(b), prepare=True).fetchall()
    again = _explain_again(url, ops)
    rows = admin.execute("""
        SELECT toplevel, calls, round((mean_exec_time * 1000)::numeric, 1),
               round(total_exec_time::numeric, 1), regexp_replace(left(query, 110), '\\s+', ' ', 'g')
          FROM pg_stat_statements
         WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
           AND query NOT ILIKE '%%pg_stat_statements%%'
         ORDER BY toplevel DESC, total_exec_time DESC LIMIT 16""").fetchall()
    lines = ["-- pg_stat_statements, nested statements tracked (top, calls, mean us, total ms, query)"]
    for r in rows:
        lines.append(f"  {'top ' if r[0] else '    '}{r[1]:>7} {r[2]:>10} {r[3]:>9}  {r[4]}")
    report.insert(0, "\n".join(lines))
    report.append(again)
    return report


def _explain_again(url: str, ops: list[list[dict]]) -> str:
    """The upsert's plan: new keys take the plain INSERT (no verdict join), a batch sent
    again (every key there) the upsert, whose verdicts join its rows to the batch. Sent
    again on a new session past the plan cache's custom plans, then one explained."""
    with psycopg.connect(url, autocommit=True) as c:
        for b in ops[:6]:
            c.execute(SCHEDULE_SQL, broker_params(b), prepare=True).fetchall()
        return explain_schedule(c, ops[0]).replace("-- schedule_timers", "-- sent again: schedule_timers", 1)


def verdict_join(again_plan: str) -> str:
    """How the upsert's statement joins its verdicts (a batch sent again)."""
    upsert = next((n for n in again_plan.split("\n\n") if "ON CONFLICT (tenant, queue, timer_key)" in n), "")
    if not upsert:
        return "no upsert in the plan (the op-by-op path?)"
    if "Hash Left Join" in upsert or "Hash Right Join" in upsert:
        return "hash join"
    return "NESTED LOOP (quadratic in the batch)" if "Nested Loop" in upsert else "no join found"


# -------------------------------------------------------------------------
# The section
# -------------------------------------------------------------------------

def bench_schedule(url: str, broker: Broker, res, n_batches: int, clients: list[int], rounds: int,
                   floor: Broker | None = None) -> None:
    """`floor`: bench/shell_floor.py, a fourth side (POST through it, the broker stopped)."""
    try:
        for i, c in enumerate(clients):
            _bench_schedule(url, broker, res, n_batches, c, rounds, profile_after=(i == len(clients) - 1),
                            floor=floor)
    finally:
        if floor is not None:
            floor.stop()


def _bench_schedule(url: str, broker: Broker, res, n_batches: int, clients: int, rounds: int,
                    profile_after: bool, floor: Broker | None = None) -> None:
    key = f"schedule_throughput_c{clients}"
    total = n_batches * BATCH
    sides = ("sql", "bare", "http", "floor") if floor else ("sql", "bare", "http")
    log(f"\n== schedule: {total} ops in {n_batches} batches of {BATCH}, {clients} concurrent clients; "
        f"queen.schedule_timers vs a bare batched upsert, HTTP vs SQL; {rounds} rotating rounds ==")
    ops = batches(n_batches)
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    with connect(url) as admin:
        admin.execute("ALTER SYSTEM SET pg_stat_statements.track = 'top'")
        admin.execute("SELECT pg_reload_conf()")
        try:
            for r in range(rounds):
                order = sides[r % len(sides):] + sides[:r % len(sides)]
                for side in order:
                    out = run_side(url, broker, admin, side, ops, clients, floor)
                    runs[side].append(out)
                    extra = ("" if side == "bare" else f"{out['verdicts']} verdicts" if side == "sql"
                             else f"{out['scheduled']} scheduled, status {out['codes']}")  # http, floor
                    log(f"  round {r + 1} {side:4s}: {out['per_s']:8.0f} ops/s ({out['secs']:.2f} s; "
                        f"{out['rows']} rows, counter {out['counter']}{'; ' + extra if extra else ''})")
                    if out["rows"] != total or (side != "bare" and out["counter"] != total):
                        log(f"  WARNING: {side} left {out['rows']} rows / counter {out['counter']}, expected {total}")
        finally:
            admin.execute("ALTER SYSTEM SET pg_stat_statements.track = 'all'")
            admin.execute("SELECT pg_reload_conf()")
        med = {s: statistics.median(x["per_s"] for x in v) for s, v in runs.items()}
        r_sb = [a["per_s"] / b["per_s"] for a, b in zip(runs["sql"], runs["bare"])]
        r_hs = [a["per_s"] / b["per_s"] for a, b in zip(runs["http"], runs["sql"])]
        for s in sides:
            per_round = ", ".join(f"{x['per_s']:.0f}" for x in runs[s])
            log(f"  median {s:4s}: {med[s]:8.0f} ops/s  (rounds: {per_round})")
        ratio_sb = med["sql"] / med["bare"]
        ratio_hs = med["http"] / med["sql"]
        log(f"  ratio schedule_timers / bare upsert: {ratio_sb:.2f} (medians; per round "
            f"{', '.join(f'{x:.2f}' for x in r_sb)}; median {statistics.median(r_sb):.2f}) "
            f"(target >= {TARGET_SQL_VS_BARE}) {'met' if ratio_sb >= TARGET_SQL_VS_BARE else 'MISSED'}")
        log(f"  ratio HTTP / SQL: {ratio_hs:.2f} (medians; per round "
            f"{', '.join(f'{x:.2f}' for x in r_hs)}; median {statistics.median(r_hs):.2f}) "
            f"(target >= {TARGET_HTTP_VS_SQL}) {'met' if ratio_hs >= TARGET_HTTP_VS_SQL else 'MISSED'}")
        if floor:
            r_fs = [a["per_s"] / b["per_s"] for a, b in zip(runs["floor"], runs["sql"])]
            r_hf = [a["per_s"] / b["per_s"] for a, b in zip(runs["http"], runs["floor"])]
            log(f"  ratio floor / SQL: {med['floor'] / med['sql']:.2f} (the least a shell on this stack costs; per "
                f"round {', '.join(f'{x:.2f}' for x in r_fs)}); HTTP / floor: {med['http'] / med['floor']:.2f} "
                f"(the broker's plumbing; per round {', '.join(f'{x:.2f}' for x in r_hf)})")
            res.put(key, ratio_floor_vs_sql=round(med["floor"] / med["sql"], 3),
                    ratio_http_vs_floor=round(med["http"] / med["floor"], 3))
        res.put(key, ops=total, clients=clients, rounds=rounds,
                median_ops_per_s={k: round(v) for k, v in med.items()},
                runs_ops_per_s={k: [round(x["per_s"]) for x in v] for k, v in runs.items()},
                ratio_sql_vs_bare=round(ratio_sb, 3), ratio_sql_vs_bare_per_round=[round(x, 3) for x in r_sb],
                ratio_http_vs_sql=round(ratio_hs, 3), ratio_http_vs_sql_per_round=[round(x, 3) for x in r_hs])

        if not profile_after:
            clean(admin)
            return
        log("  profile (untimed): pg_stat_statements with nested statements, auto_explain")
        broker.proc.send_signal(signal.SIGSTOP)
        try:
            report = profile(url, admin, ops)
        finally:
            broker.proc.send_signal(signal.SIGCONT)
        for line in report[0].splitlines():
            log("  " + line)
        join = verdict_join(report[-1])
        log("  new keys: the plain INSERT, no verdict join; the verdict join of the upsert (the batch sent "
            f"again), past the plan cache's custom plans: {join}")
        res.put(key, verdict_join=join)
        (OUT / "schedule-profile.txt").write_text("\n\n".join(report))
        log(f"  plans: {OUT / 'schedule-profile.txt'}")
        clean(admin)
