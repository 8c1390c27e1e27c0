#!/usr/bin/env python3
"""The body budget's line (bodies.BodyBudget) under one tenant's flood: the cost of another
tenant's take and release while tenant A has W requests waiting on its own half of the
budget (held up by A's half, they must cost B nothing). Pure Python on the class itself, no
broker, no database: a few seconds. Prints the cost per W and the ratio to W = 0.

    bench/budget_line.py [--rounds 5] [--n 20000]

Target: B's take + release with 500 of A's requests waiting <= 1.5x its cost with 10 waiting
(500: the waiters one tenant may have under JWT, QUEEN_TENANT_MAX_REQUESTS; with none waiting
B takes the fast path, which skips the line altogether). The line walked whole on every
release, before it was kept per tenant, cost 6.5 / 38 / 172 / 347 us at W 10 / 100 / 500 / 1000."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from queen_timers.bodies import BodyBudget  # noqa: E402

TOTAL = 1_000_000


async def cost(waiters: int, n: int) -> float:
    """us per take + release of tenant B with `waiters` of tenant A held up by A's half."""
    budget = BodyBudget(TOTAL, wait_ms=600_000)
    half = budget.per_tenant
    for _ in range(50):  # A fills its half
        await budget.take({}, "A", half // 50)
    held_up = [asyncio.ensure_future(budget.take({}, "A", 1000)) for _ in range(waiters)]
    for _ in range(3):
        await asyncio.sleep(0)
    assert budget.waiting == waiters, budget.waiting
    start = time.perf_counter()
    for _ in range(n):
        scope: dict = {}
        await budget.take(scope, "B", 5000)
        budget.release(scope)
    took = (time.perf_counter() - start) / n * 1e6
    for task in held_up:
        task.cancel()
    await asyncio.gather(*held_up, return_exceptions=True)
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n", type=int, default=20000, help="B's requests per measure")
    args = ap.parse_args()
    sizes = (0, 10, 100, 500, 1000)
    got: dict[int, list[float]] = {w: [] for w in sizes}
    for r in range(args.rounds):  # the sizes interleaved, round after round
        for w in (sizes if r % 2 == 0 else sizes[::-1]):
            got[w].append(asyncio.run(cost(w, args.n)))
    print(f"== body budget line: tenant B's take + release while tenant A has W requests held up by "
          f"its own half; {args.rounds} rounds of {args.n} ==")
    base = statistics.median(got[10])
    for w in sizes:
        m = statistics.median(got[w])
        print(f"  W {w:5d}: {m:7.1f} us  (rounds: {', '.join(f'{x:.1f}' for x in got[w])})  ratio to W 10: {m / base:.2f}"
              + ("  (nobody waits: the fast path)" if w == 0 else ""))
    ratio = statistics.median(got[500]) / base
    print(f"  ratio W 500 / W 10: {ratio:.2f} (target <= 1.5) -> {'met' if ratio <= 1.5 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
