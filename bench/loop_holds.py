#!/usr/bin/env python3
"""How long one client's large log request holds the broker's event loop from
everyone else: the broker at another commit against this tree.

    bench/loop_holds.py REV [--rounds 3]

One throwaway cluster and database, one broker per side (REV's python/ in a
temporary git worktree, this tree's); while one side is measured the other is
stopped (SIGSTOP). The same stored data serves both sides: a DLQ of 1,000 dead
letters of 18 KB dense JSON each, and one message of 6.7 MB of dense JSON. Each
case sends one request while a second connection sends DELETE
/api/v1/timers/q/k (an absent timer) back to back; the figure is that probe's
slowest answer during the request (the loop held by the request shows as that
wait), beside the request's own time. Cases: the DLQ page (limit 1,000), the
message lookup, an ack batch of 1,000 acks with 8,000-character errors, a
transaction of 1,100 such acks, and a transaction pushing 10,000 items of 780
bytes. The REV side must have this tree's sql/ (the cases write through the
routes only). Not part of `make test`; one bench at a time on the machine.
"""

from __future__ import annotations

import argparse
import http.client
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ROOT, Cluster, log, start_broker, stop_on_sigterm  # noqa: E402

DENSE_18K = {f"k{i}": [i, {"a": i}] for i in range(800)}       # about 18 KB compact
DENSE_6M = {f"k{i}": [i, {"a": i}] for i in range(220_000)}    # about 6.7 MB compact


def req(port: int, method: str, path: str, body: bytes | None = None, timeout: float = 120) -> tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    headers = {"Content-Type": "application/json"} if body is not None else {}
    c.request(method, path, body=body, headers=headers)
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data


def post(port: int, path: str, obj) -> tuple[int, object]:
    s, d = req(port, "POST", path, json.dumps(obj, separators=(",", ":")).encode())
    return s, json.loads(d) if d else None


def setup(port: int) -> str:
    """The stored data both sides read: returns the big message's partition id."""
    s, conf = post(port, "/api/v1/configure", {"queue": "dlqbig", "options": {"retryLimit": 0}})
    assert s == 200, (s, conf)
    for r in range(4):
        s, _ = post(port, "/api/v1/push", {"items": [{"queue": "dlqbig", "payload": DENSE_18K,
                                                      "transactionId": f"d{r}-{i}"} for i in range(250)]})
        assert s == 201, s
    while True:
        s, d = req(port, "GET", "/api/v1/pop/queue/dlqbig?batch=1000")
        if s != 200:
            break
        m = json.loads(d)
        acks = [{"transactionId": x["transactionId"], "partitionId": x["partitionId"], "leaseId": m["leaseId"],
                 "status": "dlq", "error": "e"} for x in m["messages"]]
        s, _ = post(port, "/api/v1/ack/batch", {"acknowledgments": acks})
        assert s == 200, s
    s, out = post(port, "/api/v1/push", {"items": [{"queue": "mbig", "payload": DENSE_6M, "transactionId": "big1"}]})
    assert s == 201, (s, out)
    return out[0]["partition_id"]


def cases(pid: str) -> list[tuple[str, str, str, bytes | None]]:
    ack_pid = pid  # any partition: the acks name messages that do not exist, answered one by one
    return [
        ("DLQ page, limit 1,000", "GET", "/api/v1/dlq?queue=dlqbig&limit=1000", None),
        ("message lookup, 6.7 MB", "GET", f"/api/v1/messages/{pid}/big1", None),
        ("ack/batch, 1,000 x 8,000-char error", "POST", "/api/v1/ack/batch", json.dumps(
            {"acknowledgments": [{"transactionId": "x", "partitionId": ack_pid, "error": "e" * 8000}
                                 for _ in range(1000)]}).encode()),
        ("transaction, 1,100 acks x 7,000", "POST", "/api/v1/transaction", json.dumps(
            {"operations": [{"type": "ack", "transactionId": "x", "partitionId": ack_pid, "error": "e" * 7000}
                            for _ in range(1100)]}).encode()),
        ("transaction, push 10,000 x 780 B", "POST", "/api/v1/transaction", json.dumps(
            {"operations": [{"type": "push", "items": [{"queue": "tq", "payload": "e" * 780}
                                                       for _ in range(10_000)]}]}).encode()),
    ]


def held(port: int, method: str, path: str, body: bytes | None) -> tuple[int, float, float]:
    """(status, the request's seconds, the probe's slowest DELETE in seconds meanwhile)."""
    stop, waits = threading.Event(), []

    def probe() -> None:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        while not stop.is_set():
            t = time.perf_counter()
            c.request("DELETE", "/api/v1/timers/q/k")
            c.getresponse().read()
            waits.append(time.perf_counter() - t)
            time.sleep(0.002)
        c.close()

    th = threading.Thread(target=probe)
    th.start()
    time.sleep(0.3)
    t = time.perf_counter()
    status, _ = req(port, method, path, body)
    took = time.perf_counter() - t
    time.sleep(0.3)
    stop.set()
    th.join()
    return status, took, max(waits)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rev", help="the commit to compare this tree with")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    stop_on_sigterm()
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.rev], check=True,
                         capture_output=True, text=True).stdout.strip()
    if subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", rev, "--", "sql"]).returncode != 0:
        sys.exit(f"{rev}'s sql/ differs from this tree's: the sides must share one database")
    with tempfile.TemporaryDirectory(prefix="loop-holds-") as tmp:
        tree = Path(tmp) / rev
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(tree), rev], check=True)
        cl = Cluster()
        brokers = {}
        try:
            cl.setup()
            url = cl.create_db("bench")
            brokers = {rev: start_broker(url, "holds-rev", PYTHONPATH=str(tree / "python")),
                       "this tree": start_broker(url, "holds-tree")}
            pid = setup(brokers["this tree"].port)
            figures: dict[tuple[str, str], list[tuple[float, float]]] = {}
            log(f"== loop holds: {rev} against this tree, {args.rounds} rounds, sides alternating ==")
            for rnd in range(args.rounds):
                order = list(brokers) if rnd % 2 == 0 else list(reversed(brokers))
                for side in order:
                    for other in brokers:
                        brokers[other].proc.send_signal(signal.SIGCONT if other == side else signal.SIGSTOP)
                    for name, method, path, body in cases(pid):
                        status, took, wait = held(brokers[side].port, method, path, body)
                        assert status == 200, (side, name, status)
                        figures.setdefault((name, side), []).append((took, wait))
                        log(f"  round {rnd + 1} {side:>9}: {name:36s} {took * 1000:7.0f} ms; "
                            f"the other connection's slowest DELETE {wait * 1000:7.0f} ms")
            for b in brokers.values():
                b.proc.send_signal(signal.SIGCONT)
            log(f"\n  median of the rounds: the other connection's slowest DELETE ({rev} -> this tree)")
            for name, *_ in cases(pid):
                a = statistics.median(w for _, w in figures[(name, rev)])
                b = statistics.median(w for _, w in figures[(name, "this tree")])
                log(f"  {name:36s} {a * 1000:7.0f} ms -> {b * 1000:6.0f} ms ({a / b:.1f}x shorter)")
        finally:
            for b in brokers.values():
                b.proc.send_signal(signal.SIGCONT)
                b.stop()
            cl.destroy()
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
