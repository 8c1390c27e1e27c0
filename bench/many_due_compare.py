"""More tenants due at once than the fair share's window: this checkout against another's.

    .venv/bin/python bench/many_due_compare.py --compare /path/to/other/checkout
        [--tenants 5000] [--per-tenant 100] [--rounds 1]

Migration 022's A/B. Starts a throwaway cluster (fsync on, track_commit_timestamp), builds one
database from this checkout's schema and one from --compare's (e.g. `git worktree add
/tmp/old REV`). In each: --tenants tenants hold --per-tenant timers each, all due at one
instant T (inserted straight into queen.timers, counted in their counter rows with T as their
bound), and tenant `late` schedules one timer due 100 ms after T through queen.schedule_timers:
its bound is the newest. One broker of this checkout at its defaults starts before T and fires
everything. Printed per side: how long the backlog took, and `late`'s lag (the commit of its
frame minus its deliver_at, both in the database). The fair share's window holds the 4,096
tenants with the oldest bound; before migration 022 a tenant past them was not probed until
fewer than 4,096 had rows due. Each side's broker knows only its own checkout's migrations
(QUEEN_SQL_DIR): a broker applies the migrations it knows when it starts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import checkouts, connect, log, rotated, start_broker, stop_on_sigterm, wait_until  # noqa: E402

LATE_AFTER_MS = 100


FOLD_SQL = """
    SELECT coalesce(sum(calls), 0), coalesce(sum(total_exec_time), 0)
      FROM pg_stat_statements
     WHERE toplevel AND query LIKE '%fold_pending_deltas%'
       AND dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"""


def run(url: str, root: Path, tenants: int, per_tenant: int) -> tuple[float, float, int, float]:
    """The backlog's seconds, late's lag (ms), and the sweeper's folds of the pending-counter
    deltas meanwhile: calls and total ms (pg_stat_statements, top-level)."""
    with connect(url) as c:
        c.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        c.execute("TRUNCATE queen.timers, queen.messages, queen.tenant_usage, queen.tenant_usage_deltas")
        c.execute("SELECT count(queen.ensure_partition('md-' || g, 'mq', 'Default')) FROM generate_series(1, %s) g",
                  (tenants,))
        due = c.execute("SELECT clock_timestamp() + make_interval(secs => %s)",
                        (6 + tenants * per_tenant / 100_000,)).fetchone()[0]
        c.execute("""
            INSERT INTO queen.timers (tenant, queue, timer_key, partition, deliver_at, txn, message_id, payload)
            SELECT 'md-' || t, 'mq', 'k-' || k, 'Default', %(due)s, 'md-' || t || '-' || k, gen_random_uuid(), '\\x7b7d'
              FROM generate_series(1, %(n)s) t, generate_series(1, %(k)s) k""",
                  {"due": due, "n": tenants, "k": per_tenant})
        c.execute("""INSERT INTO queen.tenant_usage (tenant, pending_timers, next_due_at)
                     SELECT 'md-' || t, %s, %s FROM generate_series(1, %s) t""", (per_tenant, due, tenants))
        c.execute("VACUUM ANALYZE queen.timers")
        c.execute("VACUUM ANALYZE queen.tenant_usage")
        late_due = c.execute(f"""
            SELECT deliver_at FROM queen.schedule_timers('late', ARRAY[ROW(
                'schedule', 'late-q', 'late-1',
                (extract(epoch FROM %s::timestamptz + interval '{LATE_AFTER_MS} milliseconds' - now()) * 1000)::bigint,
                'late-1', '\\x7b7d'::bytea, NULL, NULL, NULL, NULL)::queen.timer_op])""", (due,)).fetchone()[0]
        # the broker applies the migrations it knows at start: it must know only its side's
        # (QUEEN_SQL_DIR), or it would bring the other checkout's schema up to this one's
        c.execute("SELECT pg_stat_statements_reset()")
        broker = start_broker(url, name="many-due", QUEEN_SQL_DIR=str(root / "sql"))
        try:
            if c.execute("SELECT clock_timestamp() >= %s", (due,)).fetchone()[0]:
                raise RuntimeError("the broker was not up before the backlog fell due")
            if not wait_until(lambda: c.execute("SELECT NOT EXISTS (SELECT 1 FROM queen.timers)").fetchone()[0],
                              600, interval=0.2):
                raise RuntimeError("the backlog was not fired within 600 s")
        finally:
            broker.stop()
        fold_calls, fold_ms = c.execute(FOLD_SQL).fetchone()
        secs, lag_ms = c.execute("""
            SELECT extract(epoch FROM max(pg_xact_commit_timestamp(xmin)) - %s),
                   extract(epoch FROM max(pg_xact_commit_timestamp(xmin)) FILTER (WHERE transaction_id = 'late-1')
                                      - %s) * 1000
              FROM queen.messages""", (due, late_due)).fetchone()
        n = c.execute("SELECT count(*) FROM queen.messages").fetchone()[0]
        if n != tenants * per_tenant + 1:
            raise RuntimeError(f"{n} frames for {tenants * per_tenant + 1} timers")
        return float(secs), float(lag_ms), int(fold_calls), float(fold_ms)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compare", type=Path, required=True, help="another checkout measured in the same run")
    ap.add_argument("--tenants", type=int, default=5000)
    ap.add_argument("--per-tenant", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    stop_on_sigterm()
    with checkouts("many", args.compare) as (_, sides, roots):
        got: dict[str, list[tuple[float, float, int, float]]] = {k: [] for k in sides}
        log(f"== {args.tenants:,} tenants with {args.per_tenant:,} timers each due at T, tenant late's one "
            f"due {LATE_AFTER_MS} ms after T; one broker ==")
        for r in range(args.rounds):
            for name in rotated(list(sides), r):
                got[name].append(run(sides[name], roots[name], args.tenants, args.per_tenant))
                secs, lag, folds, fold_ms = got[name][-1]
                log(f"  round {r + 1} {name:8}: backlog fired in {secs:6.2f} s; late's timer fired {lag:9.1f} ms "
                    f"after its deliver_at; {folds} folds took {fold_ms / 1000:5.2f} s of the sweeper's")
        for name, v in got.items():
            log(f"  median {name:8}: backlog {statistics.median(x[0] for x in v):6.2f} s; late's lag "
                f"{statistics.median(x[1] for x in v):9.1f} ms; folds {statistics.median(x[3] for x in v) / 1000:5.2f} s")


if __name__ == "__main__":
    main()
