"""Fire into ONE queue from 1 and from 2 concurrent sessions (issue 9: the partition lock).

    .venv/bin/python bench/fire_sessions.py [--timers 20000] [--rounds 3] [--compare /path/to/other/checkout]

Starts a throwaway cluster (fsync on), builds one database from this checkout's
schema (and one from --compare's, e.g. main's, when given), loads N due timers
into one queue's one partition and times queen.fire_due_timers(256) called in a
loop until nothing is due, from 1 session and from 2 sessions at once. Rounds
alternate 1 and 2 sessions; prints every round, the medians and the ratio
(2 sessions / 1 session, frames per second) measured in this run, and how
often a firing session was seen waiting on a lock.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import checkouts, log, stop_on_sigterm  # noqa: E402

QUEUE = "scale"


def load(url: str, n: int) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE queen.timers, queen.messages")
        conn.execute("DELETE FROM queen.tenant_usage_deltas")
        conn.execute("UPDATE queen.tenant_usage SET pending_timers = 0")
        conn.execute("SELECT queen.configure_queue('default', %s)", (QUEUE,))
        conn.execute("""
            INSERT INTO queen.timers (tenant, queue, timer_key, partition, deliver_at, txn, message_id, payload)
            SELECT 'default', %s, 'k-' || g, 'Default', now() - interval '1 second', 'k-' || g,
                   gen_random_uuid(), convert_to(rpad('{"n":' || g || '}', 64, ' '), 'UTF8')
              FROM generate_series(1, %s) g""", (QUEUE, n))
        conn.execute("SELECT queen.bump_tenant_usage('default', %s, 0)", (n,))
        conn.execute("VACUUM ANALYZE queen.timers")
        conn.execute("VACUUM ANALYZE queen.messages")


def fire(url: str, sessions: int, n: int) -> tuple[float, float]:
    """Frames per second of `sessions` sessions firing until nothing is due, and the
    share of samples (pg_stat_activity, every ~2 ms) in which a session waited on a
    heavyweight lock (the partition lock on main)."""
    conns = [psycopg.connect(url, autocommit=True) for _ in range(sessions)]
    pids = [c.info.backend_pid for c in conns]
    fired = [0] * sessions
    start = threading.Barrier(sessions + 1)
    done = threading.Event()
    samples = [0, 0]  # [session samples, of them waiting on a Lock]

    def sample() -> None:
        with psycopg.connect(url, autocommit=True) as mon:
            while not done.is_set():
                rows = mon.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = ANY(%s) AND state = 'active'",
                                   (pids,)).fetchall()
                samples[0] += len(rows)
                samples[1] += sum(1 for r in rows if r[0] == "Lock")
                time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()

    def run(i: int) -> None:
        start.wait()
        while True:
            k = len(conns[i].execute("SELECT 1 FROM queen.fire_due_timers(256)").fetchall())
            fired[i] += k
            if k == 0:
                return

    threads = [threading.Thread(target=run, args=(i,)) for i in range(sessions)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    done.set()
    sampler.join()
    for c in conns:
        c.close()
    assert sum(fired) == n, (sum(fired), n)
    return n / elapsed, samples[1] / max(samples[0], 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--timers", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compare", type=Path, help="another checkout (e.g. main) measured in the same run")
    args = ap.parse_args()
    stop_on_sigterm()
    with checkouts("scale", args.compare, setup=False) as (_, targets, _):
        rates: dict[tuple[str, int], list[float]] = {}
        for r in range(args.rounds):
            for name, url in targets.items():
                for sessions in (1, 2):
                    load(url, args.timers)
                    rate, waited = fire(url, sessions, args.timers)
                    rates.setdefault((name, sessions), []).append(rate)
                    log(f"round {r + 1} {name:8s} {sessions} session(s): {rate:8.0f} frames/s, "
                        f"lock wait in {waited:5.1%} of active samples")
        for name in targets:
            one = statistics.median(rates[(name, 1)])
            two = statistics.median(rates[(name, 2)])
            log(f"{name:8s} median 1 session {one:8.0f}/s, 2 sessions {two:8.0f}/s, ratio 2/1 = {two / one:.2f}")


if __name__ == "__main__":
    main()
