#!/usr/bin/env python3
"""A/B of the DELETE at one client: the broker at another commit against this tree.

    bench/ab_delete.py REV [--rounds 8] [--n 4000]

One throwaway cluster, one broker per side; while one side is timed the other
broker is stopped (SIGSTOP), so the two never share the CPU. When REV's sql/ is
this tree's, both brokers serve one database and each round is bench/cancel.py's
`delete_blocks`: the two sides (and cancel_timer in SQL beside them) interleaved
in blocks of 200 DELETEs from one blocking keep-alive socket, so that both meet
the same seconds of the disk, whose WAL flush switches between two modes within
tens of milliseconds (bench/history/2026-12-07-delete-blocks.md); the figures add
each side's p50 with its flushes in their fast mode and its share of slow blocks.
Otherwise each side has a database with its own commit's schema, and each round
runs `http_run` (n DELETEs) on each side in turn, rotating which goes first.
The figures are the p50 and the broker's own CPU per DELETE (/proc utime + stime).
REV is checked out in a temporary git worktree, removed afterwards. The design
notes (docs/design.md) and the bench records cite A/Bs taken with this script.
Not part of `make test`; one bench at a time on the machine.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cancel  # noqa: E402
from harness import ROOT, Cluster, connect, log, proc_cpu, start_broker, stop_on_sigterm  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rev", help="the commit to compare this tree with")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--n", type=int, default=4000, help="DELETEs per round and side")
    args = ap.parse_args()
    stop_on_sigterm()
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.rev], check=True,
                         capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="ab-delete-") as tmp:
        tree = Path(tmp) / rev
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(tree), rev], check=True)
        cl = Cluster()
        try:
            cl.setup()
            same_schema = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", rev, "--", "sql"]).returncode == 0
            if same_schema:
                url = cl.create_db("bench")
                urls = {rev: url, "this tree": url}
            else:
                urls = {rev: cl.create_db("bench_ab", root=tree), "this tree": cl.create_db("bench")}
            brokers = {rev: start_broker(urls[rev], "ab", PYTHONPATH=str(tree / "python")),
                       "this tree": start_broker(urls["this tree"], "this", PYTHONPATH=str(ROOT / "python"))}
            admins = {k: connect(u) for k, u in urls.items()}
            if same_schema:
                blocks(brokers, urls["this tree"], admins["this tree"], rev, args)
                return 0
            res: dict[str, dict[str, list[float]]] = {k: {"p50": [], "cpu": []} for k in brokers}
            log(f"== DELETE at one client: {rev} against this tree, {args.rounds} rotating rounds of {args.n} ==")
            for r in range(args.rounds):
                order = list(brokers) if r % 2 == 0 else list(brokers)[::-1]
                for side in order:
                    for name, b in brokers.items():
                        b.proc.send_signal(signal.SIGCONT if name == side else signal.SIGSTOP)
                    b = brokers[side]
                    c0 = proc_cpu(b.proc.pid)
                    out = cancel.http_run(b, admins[side], 1, args.n)
                    res[side]["cpu"].append((proc_cpu(b.proc.pid) - c0) / args.n * 1e6)
                    res[side]["p50"].append(out["p50_ms"])
                for b in brokers.values():
                    b.proc.send_signal(signal.SIGCONT)
                log(f"  round {r + 1}: " + ", ".join(f"{k} p50 {v['p50'][-1]:.3f} ms, {v['cpu'][-1]:.1f} us CPU"
                                                     for k, v in res.items()))
            for k, v in res.items():
                log(f"  median {k}: p50 {statistics.median(v['p50']):.3f} ms "
                    f"({min(v['p50']):.3f}-{max(v['p50']):.3f}), broker CPU {statistics.median(v['cpu']):.1f} us "
                    f"per DELETE")
            for b in brokers.values():
                b.stop()
            for a in admins.values():
                a.close()
        finally:
            cl.destroy()
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    return 0


def blocks(brokers: dict, url: str, admin, rev: str, args) -> None:
    """The A/B in blocks, both brokers on one database (the two trees share sql/)."""
    sides = {**brokers, "sql": None}
    runs: dict[str, list[dict]] = {k: [] for k in sides}
    cpu: dict[str, list[float]] = {k: [] for k in brokers}
    log(f"== DELETE at one client: {rev} against this tree (the same sql/), {args.rounds} rounds of "
        f"{args.n} a side in blocks of {cancel.BLOCK} beside cancel_timer in SQL ==")
    with psycopg.connect(url, autocommit=True) as client:
        for r in range(args.rounds):
            c0 = {k: proc_cpu(b.proc.pid) for k, b in brokers.items()}  # delete_blocks rotates the order itself
            outs, drop = cancel.delete_blocks(sides, client, None, admin, args.n, list(brokers.values()), None)
            for b in brokers.values():
                b.proc.send_signal(signal.SIGCONT)
            for k, b in brokers.items():  # a broker runs only in its own blocks (the other stopped)
                cpu[k].append((proc_cpu(b.proc.pid) - c0[k]) / args.n * 1e6)
            for k, out in outs.items():
                runs[k].append(out)
            if drop != args.n * len(sides) or any(o["left"] for o in outs.values()):
                log(f"  WARNING: not every key cancelled once (counter -{drop})")
            log(f"  round {r + 1}: " + ", ".join(f"{k} p50 {outs[k]['p50_ms']:.3f} ms" for k in sides)
                + "; " + ", ".join(f"{k} {cpu[k][-1]:.1f} us CPU" for k in brokers))
    modes = cancel.flush_modes(runs, list(sides))
    for k in sides:
        m = modes[k]
        log(f"  median {k}: p50 {statistics.median(o['p50_ms'] for o in runs[k]):.3f} ms; in the fast mode "
            f"{m['fast_p50_ms']:.3f} ms, {m['slow_blocks']} of {m['blocks']} blocks slow"
            + (f"; broker CPU {statistics.median(cpu[k]):.1f} us per DELETE" if k in cpu else ""))
    fast = {k: modes[k]["fast_p50_ms"] for k in brokers}
    log(f"  this tree / {rev}, p50 in the fast mode: {fast['this tree'] / fast[rev]:.3f}")
    for b in brokers.values():
        b.stop()


if __name__ == "__main__":
    sys.exit(main())
