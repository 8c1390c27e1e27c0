"""The quota rung as one tenant grows: this checkout against another's, in one cluster and one run.

    .venv/bin/python bench/quota_compare.py --compare /path/to/other/checkout
        [--batches 400] [--chunk 50] [--rounds 3] [--others 1000]

Migration 021's A/B. Starts a throwaway cluster (fsync on), builds one database from
this checkout's schema and one from --compare's (e.g. `git worktree add /tmp/old REV`),
and in each: a pending-timer quota on (cell_settings.max_pending_timers, as the bench's
batches run with tenancy off), `--others` other tenants holding 20 timers each, ANALYZE,
then one connection sends the bench's schedule batches (bench/schedule.py: 256 new keys,
the broker's statement, prepared) for one tenant, which grows from 0 to batches x 256
rows. Also the same into this checkout's database with no quota, the baseline. Autovacuum
runs as configured. Prints ms per batch by chunk of batches, per side and round, rounds
rotating the order, and the medians' ratios of the last chunk to the first.
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
import schedule as S  # noqa: E402
from harness import checkouts, connect, log, rotated, stop_on_sigterm  # noqa: E402
from queen_timers.routes_timers import SCHEDULE_SQL  # noqa: E402


def prepare(url: str, quota: bool, others: int) -> None:
    admin = connect(url)
    try:
        S.clean(admin, expected=False)
        admin.execute("UPDATE queen.cell_settings SET max_pending_timers = %s", (10**9 if quota else None,))
        admin.execute("""
            INSERT INTO queen.timers (tenant, queue, timer_key, deliver_at, txn, message_id, payload)
            SELECT 'other-' || t, 'q', 'k-' || k, now() + interval '1 day', 't', gen_random_uuid(), '\\x00'
              FROM generate_series(1, %s) t, generate_series(1, 20) k""", (others,))
        admin.execute("VACUUM ANALYZE queen.timers")
        admin.execute("CHECKPOINT")
    finally:
        admin.close()


def run(url: str, params: list[dict], chunk: int) -> list[float]:
    """ms per batch of each chunk of batches, one connection (one session: one plan cache)."""
    out = []
    with psycopg.connect(url, autocommit=True) as conn:
        for i in range(0, len(params), chunk):
            t = time.perf_counter()
            for p in params[i:i + chunk]:
                conn.execute(SCHEDULE_SQL, p, prepare=True).fetchall()
            out.append((time.perf_counter() - t) * 1000 / len(params[i:i + chunk]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compare", type=Path, required=True, help="another checkout measured in the same run")
    ap.add_argument("--batches", type=int, default=400)
    ap.add_argument("--chunk", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--others", type=int, default=1000)
    args = ap.parse_args()
    stop_on_sigterm()
    params = [S.broker_params(b) for b in S.batches(args.batches)]
    with checkouts("quota", args.compare) as (_, dbs, _):
        sides = {"this": (dbs["this"], True), "compare": (dbs["compare"], True), "no quota": (dbs["this"], False)}
        got: dict[str, list[list[float]]] = {k: [] for k in sides}
        for r in range(args.rounds):
            for name in rotated(list(sides), r):
                url, quota = sides[name]
                prepare(url, quota, args.others)
                got[name].append(run(url, params, args.chunk))
                log(f"  round {r + 1} {name}: ms/batch by chunk of {args.chunk}: "
                    + " ".join(f"{x:.2f}" for x in got[name][-1]))
        rows = [f"{(i + 1) * args.chunk * S.BATCH:,}" for i in range(len(got['this'][0]))]
        log(f"medians, ms per batch of {S.BATCH}, by the tenant's rows after the chunk:")
        log("  rows:     " + " ".join(f"{r:>9}" for r in rows))
        med = {}
        for name, runs in got.items():
            med[name] = [statistics.median(x) for x in zip(*runs)]
            log(f"  {name:9} " + " ".join(f"{x:9.2f}" for x in med[name]))
        for name, m in med.items():
            log(f"{name}: last chunk / first chunk {m[-1] / m[0]:.2f}")
        log(f"last chunk: this / compare {med['this'][-1] / med['compare'][-1]:.3f}, "
            f"this / no quota {med['this'][-1] / med['no quota'][-1]:.3f}")


if __name__ == "__main__":
    main()
