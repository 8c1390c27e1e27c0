"""What a pop costs in a partition whose frames share one transaction (migration 026).

    .venv/bin/python bench/pop_one_xid.py --compare /path/to/other/checkout [--frames 200000] [--pops 200]

A pop hands out a batch after its cursor and bounds it by (xid, seq) <= (the
batch's last frame); a btree scan ends at such a bound only past its xid, so
before migration 026 every pop in a partition pushed in one transaction (one
large push, a DBA's loop of pushes in one transaction) read all of that
transaction's later frames. Starts a throwaway cluster (fsync on), builds one
database from this checkout's schema and one from --compare's (e.g. a worktree
of an older commit), pushes --frames frames into one partition in ONE
transaction in each, then times --pops pops of 10 (auto-ack, so the cursor
walks through the frames) per round, rounds alternating the databases. Prints
p50 / p99 per pop and the pages of the log order's index one more pop visits
(pg_stat_get_xact_blocks_fetched in its transaction).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import checkouts, log, pct, rotated, stop_on_sigterm  # noqa: E402

QUEUE = "one-xid"
CHUNK = 10_000  # push_messages' largest batch
PAGES = "SELECT pg_stat_get_xact_blocks_fetched('queen.messages_partition_xid_seq_idx'::regclass)"


def load(url: str, frames: int) -> None:
    with psycopg.connect(url) as conn:  # one transaction: every frame gets its xid
        conn.execute("TRUNCATE queen.messages, queen.partition_consumers")
        for start in range(1, frames + 1, CHUNK):
            conn.execute("""SELECT count(*) FROM queen.push_messages('default', ARRAY(
                                SELECT ROW(%s, NULL, 'm' || i, NULL,
                                           convert_to('{"i":' || i || '}', 'UTF8'), false)::queen.push_item
                                  FROM generate_series(%s::int, %s::int) i))""",
                         (QUEUE, start, min(start + CHUNK - 1, frames)))
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE queen.messages")


def pops(url: str, n: int) -> tuple[list[float], float]:
    """n pops of 10 with auto-ack: seconds each, and the index pages one more pop visits."""
    lat = []
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("UPDATE queen.partition_consumers SET last_consumed_xid = '0', last_consumed_seq = 0")
        for _ in range(n):
            t = time.perf_counter()
            got = conn.execute("SELECT count(*) FROM queen.pop_messages('default', %s, p_batch => 10, "
                               "p_auto_ack => true)", (QUEUE,)).fetchone()[0]
            lat.append(time.perf_counter() - t)
            assert got == 10, got
        with conn.transaction():  # the index pages one more pop visits, in this transaction's counters
            before = conn.execute(PAGES).fetchone()[0]
            conn.execute("SELECT count(*) FROM queen.pop_messages('default', %s, p_batch => 10, "
                         "p_auto_ack => true)", (QUEUE,))
            pages = conn.execute(PAGES).fetchone()[0] - before
    return lat, float(pages)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compare", type=Path, required=True, help="another checkout measured in the same run")
    ap.add_argument("--frames", type=int, default=200_000)
    ap.add_argument("--pops", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    stop_on_sigterm()
    with checkouts("pop", args.compare) as (_, sides, _):
        log(f"== {args.frames:,} frames in one partition, pushed in one transaction; {args.pops} pops of 10 "
            f"(auto-ack) a round ==")
        for name, url in sides.items():
            t = time.perf_counter()
            load(url, args.frames)
            log(f"  {name:8}: loaded in {time.perf_counter() - t:.1f} s")
        got: dict[str, list[tuple[float, float, float]]] = {k: [] for k in sides}
        for r in range(args.rounds):
            for name in rotated(list(sides), r):
                lat, reads = pops(sides[name], args.pops)
                got[name].append((pct(lat, 50) * 1000, pct(lat, 99) * 1000, reads))
                log(f"  round {r + 1} {name:8}: pop p50 {got[name][-1][0]:8.3f} ms  p99 {got[name][-1][1]:8.3f} ms  "
                    f"index pages a pop visits {reads:,.0f}")
        med = {k: [statistics.median(x[i] for x in v) for i in range(3)] for k, v in got.items()}
        for name, (p50, p99, reads) in med.items():
            log(f"  median {name:8}: pop p50 {p50:8.3f} ms  p99 {p99:8.3f} ms  index pages {reads:,.0f}")
        log(f"  ratio of p50s compare / this: {med['compare'][0] / med['this'][0]:.1f}x")


if __name__ == "__main__":
    main()
