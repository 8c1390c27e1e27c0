"""Performance sections: fire throughput, fire lag + cancel latency, cost growth (schedule: schedule.py)."""

from __future__ import annotations

import asyncio
import signal
import statistics
import time

import httpx
from psycopg.types.composite import CompositeInfo, register_composite

from harness import (Broker, connect, start_broker, exists_pending, lag_stats, load_timers, log, ms, pct, reset,
                     wait_until)

from queen_timers.config import Settings

BATCH = Settings.sweeper_batch  # the sweeper's default batch (QUEEN_SWEEPER_BATCH)
OPS = 256  # ops per schedule batch (QUEEN_TIMERS_MAX_OPS)


def db_now(conn) -> float:
    return conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()[0]


def vacuum(conn, *tables: str) -> None:
    for t in tables or ("queen.timers", "queen.messages"):
        conn.execute(f"VACUUM ANALYZE {t}")


# -------------------------------------------------------------------------
# Fire throughput
# -------------------------------------------------------------------------

def _reload(conn, queue: str, n: int, prefix: str) -> None:
    conn.execute("TRUNCATE queen.timers, queen.messages, bench.expected")
    conn.execute("DELETE FROM queen.tenant_usage_deltas")
    conn.execute("UPDATE queen.tenant_usage SET pending_timers = 0")
    load_timers(conn, queue=queue, n=n, prefix=prefix, expected=False)
    vacuum(conn)


def fire_bare_single(conn, queue: str) -> float:
    """The brief's bare SQL: one statement deletes every due row and appends its frame."""
    pid = conn.execute("SELECT queen.ensure_partition('default', %s, 'Default')", (queue,)).fetchone()[0]
    t0 = time.perf_counter()
    conn.execute("""
        WITH d AS (DELETE FROM queen.timers WHERE queue = %s AND deliver_at <= now() RETURNING *)
        INSERT INTO queen.messages (id, transaction_id, partition_id, payload, is_encrypted, producer_sub)
        SELECT message_id, txn, %s, payload, encrypted, producer_sub FROM d ORDER BY deliver_at""", (queue, pid))
    return time.perf_counter() - t0


def fire_bare_batched(conn, queue: str, batch: int = BATCH) -> float:
    """The same bare SQL in committed batches of the sweeper's size, expiry order, SKIP LOCKED."""
    pid = conn.execute("SELECT queen.ensure_partition('default', %s, 'Default')", (queue,)).fetchone()[0]
    t0 = time.perf_counter()
    for _ in range(100000):
        cur = conn.execute("""
            WITH due AS (SELECT tenant, queue, timer_key FROM queen.timers
                          WHERE queue = %s AND deliver_at <= now()
                          ORDER BY deliver_at LIMIT %s FOR UPDATE SKIP LOCKED),
                 d AS (DELETE FROM queen.timers t USING due
                        WHERE (t.tenant, t.queue, t.timer_key) = (due.tenant, due.queue, due.timer_key)
                       RETURNING t.*)
            INSERT INTO queen.messages (id, transaction_id, partition_id, payload, is_encrypted, producer_sub)
            SELECT message_id, txn, %s, payload, encrypted, producer_sub FROM d ORDER BY deliver_at""",
                           (queue, batch, pid))
        if cur.rowcount == 0:
            break
    return time.perf_counter() - t0


def fire_sql_function(conn, batch: int = BATCH) -> float:
    """queen.fire_due_timers called in a tight loop from one client: the SQL fire path, no broker."""
    t0 = time.perf_counter()
    for _ in range(100000):
        n = conn.execute("SELECT count(*) FROM queen.fire_due_timers(%s)", (batch,)).fetchone()[0]
        if n == 0:
            break
    return time.perf_counter() - t0


def first_fire(conn) -> float | None:
    """The start of the first fire transaction that appended a frame (min messages.created_at),
    on the database clock."""
    return conn.execute("SELECT extract(epoch FROM min(created_at))::float8 FROM queen.messages").fetchone()[0]


def last_commit(conn) -> float | None:
    """The commit instant of the last frame in the log (track_commit_timestamp), on the database clock."""
    return conn.execute("SELECT extract(epoch FROM max(pg_xact_commit_timestamp(xmin)))::float8 "
                        "FROM queen.messages").fetchone()[0]


def fire_by_broker(conn, queue: str, timeout: float) -> dict:
    """Resume the fire and time the broker's sweeper until the queue is empty.

    Returns seconds from resume to the last frame's commit, and from the first fire
    transaction's start (min messages.created_at) to it, all on the database clock. The
    poll for "empty" is lazy (0.2 s) and not part of the figure, so that it takes no CPU
    from the fire it measures."""
    t_resume = conn.execute("SELECT queen.resume_fire(), extract(epoch FROM clock_timestamp())::float8").fetchone()[1]
    ok = wait_until(lambda: not exists_pending(conn, queue), timeout, 0.2)
    t_end = last_commit(conn) or db_now(conn)
    first = first_fire(conn)
    return {"drained": ok, "resume_to_empty": t_end - t_resume,
            "first_fire_to_empty": (t_end - first) if first else None}


def bench_fire_throughput(url: str, broker: Broker, res, n: int, rounds: int, alt_batch: int | None = None) -> None:
    """One broker's sweeper against the bare batched statement at the same batch, `rounds` rounds
    in rotating order; the verdict is on the medians. Round 1 also times the single bare
    statement and a broker with QUEEN_SWEEPER_BATCH=alt_batch, for reference."""
    log(f"\n== fire throughput: {n} due timers, plain payloads, sweeper batch {BATCH} (the default), "
        f"{rounds} rounds ==")
    q = "bench-fire"
    rates: dict[str, list[float]] = {}
    per_round: list[float] = []
    core = ["bare_batched", "sql_function", "broker"]
    with connect(url) as conn:
        for r in range(rounds):
            methods = core[r % 3:] + core[:r % 3]
            if r == 0:
                methods = methods + ["bare_single"] + (["broker_alt"] if alt_batch else [])
            got: dict[str, float] = {}
            for method in methods:
                conn.execute("SELECT queen.pause_fire()")  # nothing fires while the backlog loads
                _reload(conn, q, n, "f")
                if method in ("broker", "broker_alt"):
                    other = None
                    if method == "broker_alt":
                        # the same fire by a broker with another QUEEN_SWEEPER_BATCH (the main broker stopped)
                        other = start_broker(url, f"b{alt_batch}", QUEEN_SWEEPER_BATCH=alt_batch)
                        broker.proc.send_signal(signal.SIGSTOP)
                    try:
                        out = fire_by_broker(conn, q, timeout=max(60, n / 500))
                    finally:
                        conn.execute("SELECT queen.pause_fire()")
                        if other:
                            broker.proc.send_signal(signal.SIGCONT)
                            other.stop()
                    if not out["drained"]:
                        log(f"  round {r + 1} {method}: NOT drained in time ({pending_left(conn, q)} left)")
                        continue
                    secs = out["first_fire_to_empty"]
                    label = "broker sweeper" if method == "broker" else f"broker batch {alt_batch}"
                    log(f"  round {r + 1} {label:15s}: {n / secs:9.0f} timers/s "
                        f"({secs:.2f} s from first fire txn; {out['resume_to_empty']:.2f} s from resume_fire)")
                else:
                    if method == "sql_function":
                        secs = _fire_sql_function_alone(conn, broker)
                    elif method == "bare_single":
                        secs = fire_bare_single(conn, q)
                    else:
                        secs = fire_bare_batched(conn, q)
                    left = pending_left(conn, q)
                    log(f"  round {r + 1} {method:15s}: {n / secs:9.0f} timers/s ({secs:.2f} s)"
                        f"{'' if not left else f' LEFT {left}'}")
                got[method] = n / secs
                rates.setdefault(method, []).append(n / secs)
            if "broker" in got and "bare_batched" in got:
                per_round.append(got["broker"] / got["bare_batched"])
            conn.execute("SELECT queen.resume_fire()")
    med = {k: statistics.median(v) for k, v in rates.items()}
    for k in ("bare_single", "bare_batched", "sql_function", "broker", "broker_alt"):
        if k in med:
            label = f"broker batch {alt_batch}" if k == "broker_alt" else k
            log(f"  median {label:15s}: {med[k]:9.0f} timers/s  (rounds: {', '.join(f'{x:.0f}' for x in rates[k])})")
    ratio = med["broker"] / med["bare_batched"] if "broker" in med and "bare_batched" in med else None
    if ratio is not None:
        log(f"  ratio broker / bare_batched (batch {BATCH}): {ratio:.2f} on the medians; per round "
            f"{', '.join(f'{x:.2f}' for x in per_round)}, median {statistics.median(per_round):.2f} (target >= 0.8)"
            f" -> {'met' if ratio >= 0.8 else 'MISSED'}")
        if "sql_function" in med:
            log(f"  ratio broker / sql_function: {med['broker'] / med['sql_function']:.2f}; "
                f"sql_function / bare_batched: {med['sql_function'] / med['bare_batched']:.2f}")
        if "bare_single" in med:
            log(f"  ratio broker / bare_single (one statement, round 1): {med['broker'] / med['bare_single']:.2f}")
    res.put("fire_throughput", n=n, rounds=rounds, batch=BATCH, alt_batch=alt_batch,
            median_rates_per_s={k: round(v) for k, v in med.items()},
            rates_per_s={k: [round(x) for x in v] for k, v in rates.items()},
            ratio_vs_bare_batched=round(ratio, 3) if ratio else None,
            ratio_per_round=[round(x, 3) for x in per_round],
            ratio_vs_sql_function=round(med["broker"] / med["sql_function"], 3)
            if "broker" in med and "sql_function" in med else None)


def pending_left(conn, q: str) -> int:
    return conn.execute("SELECT count(*) FROM queen.timers WHERE queue = %s", (q,)).fetchone()[0]


def _fire_sql_function_alone(conn, broker: Broker) -> float:
    """fire_due_timers from this client while the broker's sweeper is stopped (SIGSTOP), so
    that the figure is the SQL path alone; the broker is continued afterwards."""
    import signal
    broker.proc.send_signal(signal.SIGSTOP)
    try:
        conn.execute("SELECT queen.resume_fire()")
        return fire_sql_function(conn)
    finally:
        conn.execute("SELECT queen.pause_fire()")
        broker.proc.send_signal(signal.SIGCONT)


# -------------------------------------------------------------------------
# Fire lag at a steady rate, and cancel latency under that load
# -------------------------------------------------------------------------

def schedule_ahead(url: str, queue: str, rate: int, seconds: float, lead_s: float, prefix: str) -> dict:
    """Schedule rate*seconds timers through queen.schedule_timers, deliver times 1/rate apart
    starting lead_s from now (p_now pins one base instant for every batch); each verdict's
    deliverAt is recorded in bench.expected in the same transaction."""
    n = int(rate * seconds)
    step = 1000.0 / rate
    with connect(url) as conn:
        info = CompositeInfo.fetch(conn, "queen.timer_op")
        register_composite(info, conn)
        T = info.python_type
        base = conn.execute("SELECT now()").fetchone()[0]
        payload = b'{"kind":"lag"}'
        t0 = time.perf_counter()
        for start in range(0, n, OPS):
            ops = [T("schedule", queue, f"{prefix}-{i}", int(lead_s * 1000 + i * step), f"{prefix}-{i}", payload,
                     None, False, False, None) for i in range(start, min(n, start + OPS))]
            conn.execute("""INSERT INTO bench.expected (txn, queue, deliver_at)
                            SELECT txn, queue, deliver_at
                              FROM queen.schedule_timers('default', %s::queen.timer_op[], NULL, NULL, false, %s)""",
                         (ops, base))
        load_s = time.perf_counter() - t0
        first_due = conn.execute("SELECT extract(epoch FROM min(deliver_at) - clock_timestamp())::float8 "
                                 "FROM bench.expected WHERE queue = %s", (queue,)).fetchone()[0]
    return {"n": n, "load_s": load_s, "first_due_in_s": first_due, "base": base}


def _histogram(text: str | None, name: str) -> dict[float, float]:
    out: dict[float, float] = {}
    if not text:
        return out
    for line in text.splitlines():
        if line.startswith(name + "_bucket"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            v = float(line.rsplit(" ", 1)[1])
            k = float("inf") if le == "+Inf" else float(le)
            out[k] = out.get(k, 0) + v
    return out


def _hist_quantile(before: dict, after: dict, q: float) -> float | None:
    ks = sorted(after)
    if not ks:
        return None
    counts = [after[k] - before.get(k, 0) for k in ks]
    total = counts[-1]
    if total <= 0:
        return None
    for k, c in zip(ks, counts):
        if c >= q * total:
            return k
    return None


async def _cancel_loop(url: str, queue: str, targets: list[tuple[str, float]], t_db0: float, t_mono0: float,
                       deadline: float) -> list[tuple[str, int, float, str | None, bool]]:
    """DELETE each target at about 3 s before its deliver time; (txn, status, latency, verdict, retry_after)."""
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        for txn, deliver_epoch in targets:
            when = t_mono0 + (deliver_epoch - 3.0 - t_db0)
            now = time.monotonic()
            if when > deadline:
                break
            if when > now:
                await asyncio.sleep(when - now)
            t = time.perf_counter()
            try:
                r = await c.delete(f"/api/v1/timers/{queue}/{txn}", params={"txn": txn})
                lat = time.perf_counter() - t
                verdict = None
                try:
                    verdict = r.json().get("status")
                except ValueError:
                    pass
                out.append((txn, r.status_code, lat, verdict, "retry-after" in r.headers))
            except httpx.HTTPError as exc:
                out.append((txn, -1, time.perf_counter() - t, type(exc).__name__, False))
    return out


def _histograms(brokers: list[Broker]) -> dict[float, float]:
    """The fire-lag histogram buckets summed over brokers."""
    out: dict[float, float] = {}
    for b in brokers:
        for k, v in _histogram(b.metrics(), "queen_timers_fire_lag_seconds").items():
            out[k] = out.get(k, 0) + v
    return out


def bench_lag(url: str, broker: Broker, res, rate: int, seconds: float, section: str = "fire_lag",
              cancels: bool = True, queue: str = "bench-lag", prefix: str = "lag", others: tuple = (),
              target_ms: float = 50) -> dict:
    """Fire lag of `rate` timers/s due for `seconds`, fired by `broker` and the brokers in `others`
    (all on this database); cancels (when asked) go to `broker`."""
    brokers = [broker, *others]
    log(f"\n== fire lag: {rate} timers/s becoming due for {seconds:g} s, {len(brokers)} broker(s)"
        f"{', with cancels over HTTP' if cancels else ''} ==")
    with connect(url) as conn:
        conn.execute("DELETE FROM bench.expected WHERE queue = %s", (queue,))
        conn.execute("DELETE FROM queen.timers WHERE queue = %s", (queue,))
    # leave room for the load itself (a few thousand ops/s through schedule_timers)
    lead = 4 + rate * seconds / 4000
    sched = schedule_ahead(url, queue, rate, seconds, lead, prefix)
    log(f"  scheduled {sched['n']} timers in {sched['load_s']:.1f} s; first due in {sched['first_due_in_s']:.1f} s")
    if sched["first_due_in_s"] < 0.5:
        log("  WARNING: the load took longer than its lead; early timers were due before they existed")
    before = _histograms(brokers)
    cancel_rows = []
    with connect(url) as conn:
        t_db0 = db_now(conn)
        t_mono0 = time.monotonic()
        end_epoch = conn.execute("SELECT extract(epoch FROM max(deliver_at))::float8 FROM bench.expected "
                                 "WHERE queue = %s", (queue,)).fetchone()[0]
        deadline = t_mono0 + (end_epoch - t_db0) + 1
        if cancels:
            # every 50th timer (2 %), cancelled ~3 s before it is due: about rate/50 cancels per second
            targets = [(t, e) for t, e in conn.execute(
                "SELECT txn, extract(epoch FROM deliver_at)::float8 FROM bench.expected "
                "WHERE queue = %s AND (split_part(txn, '-', 2))::int %% 50 = 25 ORDER BY deliver_at", (queue,))]
            cancel_rows = asyncio.run(_cancel_loop(broker.url, queue, targets, t_db0, t_mono0, deadline))
        wait_until(lambda: time.monotonic() > deadline, seconds + 60, 0.2)
        wait_until(lambda: not exists_pending(conn, queue), 60, 0.1)
        left = pending_left(conn, queue)
        cancelled = [r[0] for r in cancel_rows if r[1] == 200 and r[3] == "cancelled"]
        if cancelled:
            conn.execute("UPDATE bench.expected SET kind = 'cancel' WHERE txn = ANY(%s)", (cancelled,))
        stats = lag_stats(conn, queue)
    after = _histograms(brokers)
    fired = stats["n"]
    log(f"  fired {fired} (expected {sched['n'] - len(cancelled)}), left pending {left}")
    log(f"  lag at commit of the frame : p50 {ms(stats['commit_p50'])}  p99 {ms(stats['commit_p99'])}  "
        f"max {ms(stats['commit_max'])}   (target p99 <= {target_ms:g} ms"
        f"{'' if stats['commit_p99'] is None else ' -> met' if stats['commit_p99'] * 1000 <= target_ms else ' -> MISSED'})")
    log(f"  lag at fire txn start      : p50 {ms(stats['start_p50'])}  p99 {ms(stats['start_p99'])}  "
        f"max {ms(stats['start_max'])}")
    hp99 = _hist_quantile(before, after, 0.99)
    hp50 = _hist_quantile(before, after, 0.50)
    if hp99 is not None:
        log(f"  brokers' histogram queen_timers_fire_lag_seconds: p50 <= {hp50}s, p99 <= {hp99}s (bucket bounds)")
    figures = {"rate": rate, "seconds": seconds, "brokers": len(brokers), "target_p99_ms": target_ms,
               "scheduled": sched["n"], "fired": fired, "left": left,
               **{k: (round(v * 1000, 2) if isinstance(v, float) else v) for k, v in stats.items() if k != "n"},
               "lag_unit": "ms", "histogram_p50_le_s": hp50, "histogram_p99_le_s": hp99}
    if cancels:
        lat = [r[2] for r in cancel_rows if r[1] == 200]
        codes: dict = {}
        verdicts: dict = {}
        for r in cancel_rows:
            codes[r[1]] = codes.get(r[1], 0) + 1
            verdicts[r[3]] = verdicts.get(r[3], 0) + 1
        log(f"  cancel DELETE latency: n {len(cancel_rows)}  p50 {ms(pct(lat, 50))}  p99 {ms(pct(lat, 99))}  "
            f"max {ms(max(lat) if lat else None)}  codes {codes}  verdicts {verdicts}")
        figures.update(cancels=len(cancel_rows), cancel_codes=codes, cancel_verdicts=verdicts,
                       cancel_p50_ms=round(pct(lat, 50) * 1000, 2) if lat else None,
                       cancel_p99_ms=round(pct(lat, 99) * 1000, 2) if lat else None)
    res.put(section, **figures)
    return figures


# -------------------------------------------------------------------------
# Cost growth: fire rate and lag with many pending (not yet due) timers
# -------------------------------------------------------------------------

def bench_growth(url: str, broker: Broker, res, sizes: list[int], batch_n: int, lag_rate: int,
                 lag_seconds: float, profile_cb=None) -> None:
    log(f"\n== cost growth: pending timers {sizes}; due batch {batch_n}; lag {lag_rate}/s for {lag_seconds:g} s ==")
    loaded = 0
    with connect(url) as conn:
        reset(conn)
        for size in sorted(sizes):
            if size > loaded:
                t0 = time.perf_counter()
                load_timers(conn, queue="bench-pending", n=size - loaded, prefix="p", start=loaded + 1,
                            deliver_sql="now() + interval '30 days' + g * interval '1 millisecond'", expected=False)
                loaded = size
                vacuum(conn)
                log(f"  pending = {size}: loaded in {time.perf_counter() - t0:.1f} s")
            # a due batch of fixed size
            conn.execute("SELECT queen.pause_fire()")
            conn.execute("DELETE FROM queen.messages")
            conn.execute("DELETE FROM bench.expected")
            load_timers(conn, queue="bench-growth", n=batch_n, prefix=f"g{size}", expected=False)
            vacuum(conn)
            if profile_cb:
                profile_cb(conn, size)
            out = fire_by_broker(conn, "bench-growth", timeout=max(60, batch_n / 200))
            rate = batch_n / out["first_fire_to_empty"] if out["drained"] and out["first_fire_to_empty"] else None
            log(f"  pending {size:>8}: fire {rate or 0:8.0f} timers/s"
                f" ({out['first_fire_to_empty'] or 0:.2f} s from first fire txn)")
            lag = bench_lag(url, broker, res, lag_rate, lag_seconds, section=f"growth_lag_{size}", cancels=False,
                            queue="bench-glag", prefix=f"gl{size}")
            res.put(f"growth_{size}", pending=size, due_batch=batch_n, fire_rate_per_s=round(rate) if rate else None,
                    lag_commit_p50_ms=lag["commit_p50"], lag_commit_p99_ms=lag["commit_p99"],
                    lag_commit_max_ms=lag["commit_max"])
        conn.execute("SELECT queen.resume_fire()")
