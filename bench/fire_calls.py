"""What one sweeper cycle's statements cost when only a few timers are due a call.

    .venv/bin/python bench/fire_calls.py [--calls 1500] [--due 5] [--rounds 3] [--compare /path/to/other/checkout]

At 1,000 timers/s the sweeper wakes for every few timers, so a batch's fixed cost
(planning, function calls) is what its fire lag pays, not the rows. Starts a
throwaway cluster (fsync on), builds one database from this checkout's schema (and
one from --compare's, e.g. an older commit's worktree, when given), holds 20,000
timers due in an hour, and per call inserts --due timers due now, then times the
sweeper's own statements one after the other on one connection: the fast path
(sweeper.FIRE_DUE), the leased path's claim (sweeper.CLAIM, zstd only: nothing to
claim) and the next due time (sweeper.NEXT_DUE). Rounds alternate the databases;
prints p50 / p99 per statement and round, and the medians of the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
from harness import checkouts, load_timers, log, pct, stop_on_sigterm  # noqa: E402
from queen_timers.sweeper import CLAIM, FIRE_DUE, NEXT_DUE  # noqa: E402

QUEUE = "calls"
STATEMENTS = ("fire", "claim", "next")
WARMUP = 100  # the first calls plan and warm caches: not counted


def measure(url: str, calls: int, due: int) -> dict[str, list[float]]:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE queen.timers, queen.messages, queen.tenant_usage, queen.tenant_usage_deltas")
        conn.execute("SELECT queen.configure_queue('default', %s)", (QUEUE,))
        load_timers(conn, queue=QUEUE, n=20000, prefix="f", expected=False,
                    deliver_sql="now() + interval '1 hour' + g * interval '3 ms'")
        conn.execute("VACUUM ANALYZE queen.timers")
        took: dict[str, list[float]] = {name: [] for name in STATEMENTS}
        for i in range(calls):
            load_timers(conn, queue=QUEUE, n=due, prefix=f"k-{i}", expected=False,
                        deliver_sql="now() - interval '1 ms'")
            t0 = time.perf_counter()
            fired = conn.execute(FIRE_DUE, (256, "")).fetchone()
            t1 = time.perf_counter()
            conn.execute(CLAIM, ("bench-calls", 256, 30000, True, 16 << 20, "")).fetchall()
            t2 = time.perf_counter()
            conn.execute(NEXT_DUE).fetchone()
            t3 = time.perf_counter()
            assert fired[1] == due, fired  # (turn, n, fired, ...): the lag summary of sweeper.FIRE_DUE
            for name, seconds in zip(STATEMENTS, (t1 - t0, t2 - t1, t3 - t2)):
                took[name].append(seconds * 1000)
        return {name: v[WARMUP:] for name, v in took.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=1500)
    ap.add_argument("--due", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compare", type=Path, help="another checkout measured in the same run")
    args = ap.parse_args()
    stop_on_sigterm()
    if args.calls <= WARMUP:
        ap.error(f"--calls must be more than the {WARMUP} warm-up calls, which are not counted")
    with checkouts("calls", args.compare, setup=False) as (_, targets, _):
        p50s: dict[tuple[str, str], list[float]] = {}
        for r in range(args.rounds):
            for name, url in targets.items():
                took = measure(url, args.calls, args.due)
                parts = []
                for stmt in STATEMENTS:
                    p50s.setdefault((name, stmt), []).append(statistics.median(took[stmt]))
                    parts.append(f"{stmt} p50 {statistics.median(took[stmt]):.3f} p99 {pct(took[stmt], 99):.3f}")
                log(f"round {r + 1} {name:8s} ms a call ({args.due} due a call): " + ", ".join(parts))
        for name in targets:
            log(f"{name:8s} median of rounds, p50 ms: "
                + ", ".join(f"{stmt} {statistics.median(p50s[(name, stmt)]):.3f}" for stmt in STATEMENTS)
                + f"; a cycle {sum(statistics.median(p50s[(name, stmt)]) for stmt in STATEMENTS):.3f}")


if __name__ == "__main__":
    main()
