"""Section `fairness`: how long one tenant's backlog of due timers delays another tenant's
timer (docs/sweeper.md, "Order across tenants"). Target: B's timer fires within
TARGET_MS of its deliver_at whatever the size of A's backlog.

Per size in --fairness-backlogs: tenant `tenant-a` holds n timers due at one instant T (inserted
straight into queen.timers by bench.harness.load_timers), tenant `tenant-b` schedules one
through queen.schedule_timers due 100 ms after T. One broker at its defaults starts before T.
Printed: how long the broker took to fire A's backlog, and B's lag: the commit of B's frame
minus B's deliver_at, both in the database (track_commit_timestamp). Then the largest size again
with --fairness-idle-tenants (10,000) other tenants holding one timer each, due in a day. Before
migration 019 the fire probed every tenant with pending timers, 64 a batch in turn, so B waited
up to ceil(tenants / 64) batches to be found (1,283.7 ms late with 10,000) and every batch of
A's paid the probes; since, a tenant whose timers are all in the future is not a candidate
(queen.tenant_usage.next_due_at).

Last, the largest size loaded while an ANALYZE of queen.timers runs from another session before
the load commits, as autovacuum may: the statistics then say the table is empty over all its
pages. Before migration 025 every plan of the fire took all due rows by a bitmap scan and sorted
them at every batch until the next ANALYZE (the backlog fired at half speed and B waited for the
first slow batches: 460-670 ms, seen in runs 12 and 13 whenever autovacuum happened to run so).

A batch takes the cell's oldest due timers; when it is full and its oldest was due
p_fair_after_ms (100) ago or more, each tenant it left out also gets its share in the same
transaction (queen.fire_due_batch). In expiry order alone (before migration 018) B's timer
waited for every one of A's: 26.6 s behind 1,000,000.
"""

from __future__ import annotations

from harness import Results, connect, load_timers, log, start_broker, wait_until

LEAD_S = 6.0  # A's backlog falls due this long (plus 1 s per 100,000) after it is chosen: the broker is up by then
B_AFTER_MS = 100
TARGET_MS = 250  # p_fair_after_ms (100) and a few batches


IDLE_SQL = """
SELECT count(*) FROM generate_series(1, %s) g, LATERAL queen.schedule_timers('idle-' || g, ARRAY[ROW(
    'schedule', 'idle', 'k', 86400000, 'k', '\\x7b7d'::bytea, NULL, NULL, NULL, NULL)::queen.timer_op]) v
"""


def bench_fairness(url: str, res: Results, backlogs: list[int], idle_tenants: int = 0) -> None:
    log(f"\n== fairness: tenant A's backlog of n timers due at one instant, tenant B's one timer "
        f"due {B_AFTER_MS} ms later; one broker ==")
    rows = []
    runs = [(n, 0, False) for n in backlogs] + ([(max(backlogs), idle_tenants, False)] if idle_tenants and backlogs else [])
    runs += [(max(backlogs), 0, True)] if backlogs else []
    with connect(url) as c, connect(url) as other:
        for n, idle, stale in runs:
            c.execute("TRUNCATE queen.timers, queen.messages")
            c.execute("DELETE FROM queen.tenant_usage WHERE tenant LIKE 'idle-%%'")
            if idle:
                c.execute(IDLE_SQL, (idle,))
            # one instant T for A, chosen first: inserting a million rows takes seconds
            due = c.execute("SELECT clock_timestamp() + make_interval(secs => %s)",
                            (LEAD_S + n / 100_000,)).fetchone()[0]
            with c.transaction():
                load_timers(c, queue="fair-a", n=n, prefix="a", tenant="tenant-a", payload_bytes=2, expected=False,
                            deliver_sql=f"'{due.isoformat()}'::timestamptz")
                if stale:  # the rows are not committed yet: ANALYZE counts none of them
                    other.execute("ANALYZE queen.timers")
            if stale:
                reltuples = c.execute("SELECT reltuples FROM pg_class WHERE oid = 'queen.timers'::regclass").fetchone()[0]
                if reltuples > n / 10:
                    raise RuntimeError(f"the stale statistics did not take: reltuples {reltuples}")
            b_due = c.execute(f"""
                SELECT deliver_at FROM queen.schedule_timers('tenant-b', ARRAY[ROW(
                    'schedule', 'fair-b', 'b-1',
                    (extract(epoch FROM %s::timestamptz + interval '{B_AFTER_MS} milliseconds' - now()) * 1000)::bigint,
                    'b-1', '\\x7b7d'::bytea, NULL, NULL, NULL, NULL)::queen.timer_op])""", (due,)).fetchone()[0]
            broker = start_broker(url, name="fairness")
            try:
                if c.execute("SELECT clock_timestamp() >= %s", (due,)).fetchone()[0]:
                    raise RuntimeError("the broker was not up before the backlog fell due")
                left = "SELECT count(*) FROM queen.timers WHERE tenant IN ('tenant-a', 'tenant-b')"  # not the idle ones
                if not wait_until(lambda: c.execute(left).fetchone()[0] == 0,
                                  LEAD_S + 300, interval=0.2):
                    raise RuntimeError(f"the backlog of {n} was not fired within {LEAD_S + 300:.0f} s")
            finally:
                broker.stop()
            a_secs, b_lag = c.execute("""
                SELECT extract(epoch FROM max(pg_xact_commit_timestamp(xmin)) FILTER (WHERE transaction_id LIKE 'a-%%')
                                          - min(pg_xact_commit_timestamp(xmin)) FILTER (WHERE transaction_id LIKE 'a-%%')),
                       extract(epoch FROM max(pg_xact_commit_timestamp(xmin)) FILTER (WHERE transaction_id = 'b-1')
                                          - %s) * 1000
                  FROM queen.messages""", (b_due,)).fetchone()
            rows.append({"backlog": n, "idle_tenants": idle, "stale_stats": stale, "a_fire_s": float(a_secs),
                         "b_lag_ms": float(b_lag)})
            with_idle = (f" (+{idle:,} tenants with a timer due tomorrow)" if idle
                         else " (analyzed before the load committed)" if stale else "")
            log(f"  A's backlog {n:>9,}{with_idle}: fired in {float(a_secs):6.2f} s; B's timer (due {B_AFTER_MS} ms "
                f"after A's) fired {float(b_lag):8.1f} ms after its deliver_at")
    worst = max(r["b_lag_ms"] for r in rows)
    log(f"  B's timer, worst of the sizes: {worst:.1f} ms late (target <= {TARGET_MS} ms) -> "
        f"{'met' if worst <= TARGET_MS else 'MISSED'}")
    res.put("fairness", rows=rows, worst_b_lag_ms=worst, target_ms=TARGET_MS, met=worst <= TARGET_MS)
