#!/usr/bin/env python3
"""One tenant's legal bodies dense in tiny arrays and objects, against another tenant's DELETE.

    bench/dense_bodies.py [--seconds 10] [--senders 4]

One throwaway cluster, one broker (QUEEN_AUTH=jwt, two tenants). Tenant A sends
legal bodies from `--senders` threads at once, each kind for `--seconds`: a push
whose one item's payload is an array of 330,000 `{"a":[]}` (3 MB), a push of 10,000
small items, and a transaction whose one push operation holds 200,000 items (refused:
more than 10,000 operations). Meanwhile tenant B sends DELETEs of a missing timer,
one at a time. B's p50 / p99 / max are printed for each kind, beside B alone in the
same run (the baseline). The Dec 7 audit measured B at a p50 of 0.6-1.7 s under the
first kind, when a read of a body was scanned in one go (bench/history/2026-12-07-dense-bodies.md).
Not part of `make test`; one bench at a time on the machine.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import httpx
import jwt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Cluster, log, pct, start_broker, stop_on_sigterm  # noqa: E402

SECRET = "dense-bodies-bench-secret-of-32-bytes!"


def bearer(tenant: str) -> str:
    claims = {"sub": f"bench-{tenant}", "tenant": tenant, "role": "read-write", "exp": int(time.time()) + 3600}
    return "Bearer " + jwt.encode(claims, SECRET, algorithm="HS256")


def kinds() -> dict[str, tuple[str, bytes]]:
    objs = b",".join([b'{"a":[]}'] * 330_000)
    many = b",".join([b'{"queue":"dq","payload":{"a":[{"b":[]}]}}'] * 10_000)
    txn = b",".join([b'{"queue":"dq","payload":{}}'] * 200_000)
    return {
        "push, one item of 330,000 tiny objects": ("/api/v1/push", b'{"items":[{"queue":"dq","payload":[' + objs + b"]}]}"),
        "push of 10,000 small items": ("/api/v1/push", b'{"items":[' + many + b"]}"),
        "transaction, one push of 200,000 items (400)": ("/api/v1/transaction",
                                                          b'{"operations":[{"type":"push","items":[' + txn + b"]}]}"),
    }


def b_deletes(url: str, seconds: float) -> tuple[list[float], int]:
    lat, bad = [], 0
    with httpx.Client(base_url=url, headers={"Authorization": bearer("B")}, timeout=60) as c:
        stop = time.monotonic() + seconds
        while time.monotonic() < stop:
            t = time.perf_counter()
            r = c.delete("/api/v1/timers/q/missing")
            lat.append(time.perf_counter() - t)
            bad += r.status_code not in (200, 404)
    return lat, bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--senders", type=int, default=4)
    args = ap.parse_args()
    stop_on_sigterm()
    cl = Cluster()
    try:
        cl.setup()
        url = cl.create_db("bench")
        b = start_broker(url, "dense", QUEEN_AUTH="jwt", QUEEN_JWT_SECRET=SECRET)
        log(f"== tenant B's DELETE (one at a time) while tenant A sends dense legal bodies from "
            f"{args.senders} threads, {args.seconds:.0f} s a kind ==")
        lat, bad = b_deletes(b.url, args.seconds)
        base = pct(lat, 50) * 1000
        log(f"  B alone: n={len(lat)} p50 {base:.2f} ms, p99 {pct(lat, 99) * 1000:.2f} ms, "
            f"max {max(lat) * 1000:.1f} ms, non-2xx/404 {bad}")
        for name, (path, body) in kinds().items():
            answers: list[tuple[int, float]] = []
            stop = time.monotonic() + args.seconds

            def sender():
                with httpx.Client(base_url=b.url, timeout=120, headers={
                        "Authorization": bearer("A"), "content-type": "application/json"}) as c:
                    while time.monotonic() < stop:
                        t = time.perf_counter()
                        r = c.post(path, content=body)
                        answers.append((r.status_code, time.perf_counter() - t))

            threads = [threading.Thread(target=sender) for _ in range(args.senders)]
            for t in threads:
                t.start()
            time.sleep(0.3)
            lat, bad = b_deletes(b.url, max(1.0, stop - time.monotonic()))
            for t in threads:
                t.join()
            codes = sorted({s for s, _ in answers})
            log(f"  {name} ({len(body) / 1e6:.1f} MB): A {len(answers)} answers {codes}, "
                f"median {sorted(x for _, x in answers)[len(answers) // 2]:.2f} s")
            log(f"    B: n={len(lat)} p50 {pct(lat, 50) * 1000:.2f} ms ({pct(lat, 50) * 1000 / base:.1f}x alone), "
                f"p99 {pct(lat, 99) * 1000:.1f} ms, max {max(lat) * 1000:.1f} ms, non-2xx/404 {bad}")
        b.stop()
    finally:
        cl.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
