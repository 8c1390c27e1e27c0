#!/usr/bin/env python3
"""A/B of the DELETE at one client: the broker at another commit against this tree.

    bench/ab_delete.py REV [--rounds 8] [--n 4000]

One throwaway cluster, one database per side (each with its own commit's schema),
one broker per side. Rounds rotate which side goes first; while one side is timed
the other broker is stopped (SIGSTOP), so the two never share the CPU. Each round
is bench/cancel.py's `http_run` (n DELETEs from one blocking keep-alive socket);
the figures are the p50 and the broker's own CPU per DELETE (/proc utime + stime).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cancel  # noqa: E402
from harness import ROOT, Cluster, connect, log, proc_cpu, start_broker  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rev", help="the commit to compare this tree with")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--n", type=int, default=4000, help="DELETEs per round and side")
    args = ap.parse_args()
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.rev], check=True,
                         capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="ab-delete-") as tmp:
        tree = Path(tmp) / rev
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(tree), rev], check=True)
        cl = Cluster()
        try:
            cl.setup()
            urls = {rev: cl.create_db("bench_ab", root=tree), "this tree": cl.create_db("bench")}
            brokers = {rev: start_broker(urls[rev], "ab", PYTHONPATH=str(tree / "python")),
                       "this tree": start_broker(urls["this tree"], "this", PYTHONPATH=str(ROOT / "python"))}
            admins = {k: connect(u) for k, u in urls.items()}
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


if __name__ == "__main__":
    sys.exit(main())
