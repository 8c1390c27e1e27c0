"""queen.schedule_timers of this checkout against another's, in one cluster and one run.

    .venv/bin/python bench/schedule_compare.py --compare /path/to/other/checkout
        [--batches 300] [--rounds 5] [--clients 1,4]

Starts a throwaway cluster (fsync on), builds one database from this checkout's schema
and one from --compare's (e.g. a worktree of an older commit: `git worktree add
/tmp/old REV`), and times the bench's schedule batches (bench/schedule.py: 256 new keys
each, the broker's statement and parameters, one connection per client, prepared) into
each, rounds rotating the order. Two cases: `new`, every key new (the common batch), and
`again`, the same batches sent a second time (every key exists: all rescheduled). Also
the bare upsert (schedule.BARE_SQL) on this checkout's database, the schedule section's
baseline. Prints ops/s per round, the medians and the ratios this / compare.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import schedule as S  # noqa: E402
from harness import checkouts, connect, log, rotated, stop_on_sigterm  # noqa: E402
from queen_timers.routes_timers import SCHEDULE_SQL  # noqa: E402


def run(url: str, sql: str, params: list[dict], clients: int, again: bool, n: int) -> float:
    admin = connect(url)
    try:
        S.clean(admin, expected=False)
        if again:  # every key there before the clock starts
            S._sql_side(url, sql, params, clients, fetch=sql is SCHEDULE_SQL)
            for t in ("queen.timers", "queen.tenant_usage"):
                admin.execute(f"VACUUM ANALYZE {t}")
            admin.execute("CHECKPOINT")
        secs, _ = S._sql_side(url, sql, params, clients, fetch=sql is SCHEDULE_SQL)
        rows = admin.execute("SELECT count(*) FROM queen.timers").fetchone()[0]
        assert rows == n, (rows, n)
        return n / secs
    finally:
        admin.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compare", type=Path, required=True, help="another checkout measured in the same run")
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--clients", default="1,4")
    args = ap.parse_args()
    stop_on_sigterm()
    ops = S.batches(args.batches)
    broker = [S.broker_params(b) for b in ops]
    bare = [S.bare_params(b) for b in ops]
    with checkouts("sched", args.compare) as (_, dbs, _):
        sides = {"this": (dbs["this"], SCHEDULE_SQL, broker), "compare": (dbs["compare"], SCHEDULE_SQL, broker),
                 "bare": (dbs["this"], S.BARE_SQL, bare)}
        for case in ("new", "again"):
            for clients in (int(c) for c in args.clients.split(",")):
                got: dict[str, list[float]] = {k: [] for k in sides}
                for r in range(args.rounds):
                    for name in rotated(list(sides), r):
                        url, sql, params = sides[name]
                        got[name].append(run(url, sql, params, clients, again=case == "again",
                                             n=args.batches * S.BATCH))
                    log(f"  {case} {clients} client(s) round {r + 1}: "
                        + ", ".join(f"{k} {v[-1]:,.0f}/s" for k, v in got.items()))
                med = {k: statistics.median(v) for k, v in got.items()}
                log(f"{case} {clients} client(s), medians: " + ", ".join(f"{k} {v:,.0f}/s" for k, v in med.items())
                    + f"; this / compare {med['this'] / med['compare']:.3f}, this / bare {med['this'] / med['bare']:.3f},"
                    f" compare / bare {med['compare'] / med['bare']:.3f}")


if __name__ == "__main__":
    main()
