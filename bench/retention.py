"""Retention section: the fire rate while log retention deletes a large expired backlog.

One broker with the retention task on (QUEEN_RETENTION_INTERVAL_MS=100,
QUEEN_RETENTION_BATCH=1000) fires N due timers twice per round, in the same
database with the same backlog of expired frames in queen.messages:
  idle: the backlog's queue has retentionEnabled false, so every retention pass
        finds nothing to do;
  busy: retentionEnabled true just before the fire resumes, so the broker's
        retention task deletes the backlog while its sweeper fires.
The figure is busy rate / idle rate, measured in the same run (median over rounds).
"""

from __future__ import annotations

import signal
import statistics
import time

from harness import connect, exists_pending, load_timers, log, start_broker, wait_until

LOG_QUEUE = "bench-ret-log"
PARTS = 4


def _backlog(conn) -> int:
    return conn.execute("""SELECT count(*) FROM queen.messages m JOIN queen.partitions p ON p.id = m.partition_id
                            JOIN queen.queues q ON q.id = p.queue_id
                           WHERE q.tenant = 'default' AND q.name = %s""", (LOG_QUEUE,)).fetchone()[0]


def _top_up(conn, size: int, tag: str) -> None:
    """Expired frames (2 hours old) in the log queue's partitions, up to `size` in all."""
    missing = size - _backlog(conn)
    if missing <= 0:
        return
    for i in range(PARTS):
        conn.execute("SELECT queen.ensure_partition('default', %s, %s)", (LOG_QUEUE, f"p{i}"))
    conn.execute("""
        INSERT INTO queen.messages (id, transaction_id, partition_id, payload, created_at)
        SELECT queen.uuid_v7(), %(tag)s || '-' || g, p.id, convert_to(rpad('{"n":' || g || '}', 64, ' '), 'UTF8'),
               now() - interval '2 hours'
          FROM generate_series(1, %(n)s) g
          JOIN queen.partitions p ON p.name = 'p' || (g %% %(parts)s)
          JOIN queen.queues q ON q.id = p.queue_id AND q.tenant = 'default' AND q.name = %(q)s""",
                 {"tag": tag, "n": missing, "parts": PARTS, "q": LOG_QUEUE})


def _fire(conn, queue: str, n: int, timeout: float) -> float | None:
    """Resume the fire; seconds from the first fire transaction to the queue's last timer gone."""
    conn.execute("SELECT queen.resume_fire()")
    if not wait_until(lambda: not exists_pending(conn, queue), timeout, 0.02):
        return None
    end = conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()[0]
    first = conn.execute("""SELECT extract(epoch FROM min(m.created_at))::float8 FROM queen.messages m
                              JOIN queen.partitions p ON p.id = m.partition_id
                              JOIN queen.queues q ON q.id = p.queue_id
                             WHERE q.tenant = 'default' AND q.name = %s""", (queue,)).fetchone()[0]
    return end - first


def bench_retention(url: str, perf_broker, res, n: int, backlog: int, rounds: int) -> None:
    log(f"\n== retention: fire {n} due timers with retention idle vs deleting a {backlog}-frame expired backlog ==")
    ratios, idle_rates, busy_rates, del_rates = [], [], [], []
    if perf_broker:
        perf_broker.proc.send_signal(signal.SIGSTOP)  # only the retention broker fires here
    broker = start_broker(url, "ret", QUEEN_RETENTION_INTERVAL_MS=100, QUEEN_RETENTION_BATCH=1000)
    try:
        with connect(url) as conn:
            conn.execute("SELECT queen.pause_fire()")
            conn.execute("SELECT queen.configure_queue('default', %s, NULL, NULL, '{\"retentionSeconds\": 3600}')", (LOG_QUEUE,))
            for r in range(rounds):
                rate = {}
                for mode in ("idle", "busy"):
                    queue = f"bench-ret-fire-{r}-{mode}"
                    conn.execute("UPDATE queen.queues SET retention_enabled = false WHERE tenant = 'default' AND name = %s", (LOG_QUEUE,))
                    _top_up(conn, backlog, f"bl{r}{mode}")
                    conn.execute("TRUNCATE queen.timers")
                    conn.execute("DELETE FROM queen.tenant_usage_deltas")
                    conn.execute("UPDATE queen.tenant_usage SET pending_timers = 0")
                    load_timers(conn, queue=queue, n=n, prefix=f"ret{r}{mode}", expected=False)
                    conn.execute("VACUUM ANALYZE queen.timers")
                    conn.execute("VACUUM ANALYZE queen.messages")
                    before = _backlog(conn)
                    if mode == "busy":
                        conn.execute("UPDATE queen.queues SET retention_enabled = true WHERE tenant = 'default' AND name = %s", (LOG_QUEUE,))
                        if not wait_until(lambda: _backlog(conn) < before, 5, 0.01):
                            log("  retention did not start within 5 s")
                        before = _backlog(conn)
                    t0 = time.monotonic()
                    secs = _fire(conn, queue, n, timeout=max(60, n / 500))
                    wall = time.monotonic() - t0
                    after = _backlog(conn)
                    conn.execute("SELECT queen.pause_fire()")
                    if secs is None:
                        log(f"  round {r + 1} {mode}: NOT drained in time")
                        continue
                    rate[mode] = n / secs
                    line = f"  round {r + 1} {mode:4}: {rate[mode]:9.0f} timers/s ({secs:.2f} s)"
                    if mode == "busy":
                        gone = before - after
                        del_rates.append(gone / wall)
                        line += f"; retention deleted {gone} frames meanwhile ({gone / wall:.0f}/s)"
                        if after == 0:
                            line += "  [backlog ran out before the fire ended: raise --retention-backlog]"
                    log(line)
                if "idle" in rate and "busy" in rate:
                    idle_rates.append(rate["idle"])
                    busy_rates.append(rate["busy"])
                    ratios.append(rate["busy"] / rate["idle"])
                    log(f"  round {r + 1} ratio busy/idle: {ratios[-1]:.2f}")
            conn.execute("UPDATE queen.queues SET retention_enabled = false WHERE tenant = 'default' AND name = %s", (LOG_QUEUE,))
            conn.execute("SELECT queen.resume_fire()")
    finally:
        broker.stop()
        if perf_broker:
            perf_broker.proc.send_signal(signal.SIGCONT)
    if ratios:
        med = statistics.median(ratios)
        log(f"  => fire rate with retention deleting / idle: median {med:.2f} over {len(ratios)} rounds "
            f"(idle {statistics.median(idle_rates):.0f}/s, busy {statistics.median(busy_rates):.0f}/s, "
            f"deleting {statistics.median(del_rates):.0f} frames/s)")
        res.put("retention", n=n, backlog=backlog, rounds=len(ratios), ratio_median=med, ratios=ratios,
                idle_rates=idle_rates, busy_rates=busy_rates, delete_rates=del_rates)
    else:
        res.put("retention", n=n, backlog=backlog, error="no complete round")
