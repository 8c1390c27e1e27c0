"""Section `conns`: one client holds the broker's connections, one tenant its requests in
progress, while another tenant cancels timers (the edges of issue 17: what one client can
make the broker hold besides memory).

Phases, each --conns-seconds long, on one broker at its defaults (QUEEN_AUTH=jwt):
  idle   --conns-sockets sockets (3,000) opened and held silent, with no credential, against
         QUEEN_MAX_CONNECTIONS (1,000); each one the broker closes is opened again at once.
  slow   tenant `flood` starts --conns-slow POST /api/v1/timers (1,100) whose bodies never end
         (a head, a Content-Length, 5 bytes): past its share of requests in progress
         (QUEEN_TENANT_MAX_REQUESTS, 500) they are answered 503 timers_unavailable.
  two    tenants `flood` and then `flood2` start --conns-slow such POSTs each: flood2 stops
         where it holds as many as are free (past three quarters in use), so the two never
         hold every slot between them.
  cheap  --conns-cheap-clients processes (2) of 64 keep-alive connections each send, as fast
         as they are answered, requests the broker answers without waiting on anything:
         a quarter each GET /health, GET /metrics/prometheus and a GET with no credential
         (401), all public, and tenant `flood`'s DELETEs with a read-only token (403).
         Requests start in turns per tenant, those with no credential as one more
         (turns.py); /health and /metrics make one call at a time for all their callers.
Meanwhile tenant `quiet` sends DELETEs at --conns-delete-rate/s on one keep-alive connection,
opening another and sending again when the broker closed it while idle (as HTTP clients do;
the time counts in the DELETE's latency).

Printed per phase: quiet's DELETE p50/p99 and its non-200 answers and reconnects, the
broker's open files and reclaimed connections, the flood's answers.
Target: every DELETE of quiet answered 200, p99 <= 50 ms, in each phase.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import selectors
import socket
import threading
import time

from cancel import RawHttp
from harness import log, metric_sum, pct, start_broker
from mem import SECRET, _deletes_main, bearer

TARGET_DELETE_P99_S = 0.050


# ---------------------------------------------------------------------------
# the flood: silent sockets kept open, slow bodies
# ---------------------------------------------------------------------------

class SilentSockets:
    """n sockets held open with nothing sent; each one the server closes is opened again."""

    def __init__(self, port: int, n: int):
        self.port, self.n = port, n
        self.sel = selectors.DefaultSelector()
        self.reopened = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _open(self) -> None:
        sock = socket.socket()
        sock.setblocking(False)
        try:
            sock.connect(("127.0.0.1", self.port))
        except BlockingIOError:
            pass
        self.sel.register(sock, selectors.EVENT_READ)

    def _run(self) -> None:
        for _ in range(self.n):
            self._open()
        while not self.stop.is_set():
            for key, _ in self.sel.select(timeout=0.1):
                sock = key.fileobj
                try:
                    data = sock.recv(65536)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if not data:  # closed by the broker: the attacker opens another
                    self.sel.unregister(sock)
                    sock.close()
                    self.reopened += 1
                    self._open()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(10)
        for key in list(self.sel.get_map().values()):
            key.fileobj.close()
        self.sel.close()


def slow_posts(port: int, n: int, tenant: str = "flood") -> list[socket.socket]:
    body_len = 1000
    head = (f"POST /api/v1/timers HTTP/1.1\r\nHost: x\r\nAuthorization: {bearer(tenant)}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {body_len}\r\n\r\n").encode()
    out = []
    for _ in range(n):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(head + b'{"ope')
        out.append(sock)
    return out


CHEAP_CONNS = 64  # per process


def cheap_main(port: int, stop, queue) -> None:
    """One process of the cheap flood: CHEAP_CONNS keep-alive connections, each sending its
    kind of request as soon as the last one is answered. Puts the answers' statuses."""
    read_only = bearer("flood", "read-only")
    kinds = [("GET", "/health", ""), ("GET", "/metrics/prometheus", ""), ("GET", "/api/v1/timers/q", ""),
             ("DELETE", "/api/v1/timers/q/k", f"Authorization: {read_only}\r\n")]
    codes: dict = {}

    async def one(method: str, path: str, headers: str) -> None:
        conn: RawHttp | None = None
        while not stop.is_set():
            try:
                if conn is None:
                    conn = await RawHttp("127.0.0.1", port).open()
                status = str((await conn.request(method, path, headers))[0])
            except (OSError, asyncio.IncompleteReadError) as exc:
                status = type(exc).__name__
                if conn is not None:
                    conn.close()
                conn = None
            codes[status] = codes.get(status, 0) + 1
        if conn is not None:
            conn.close()

    async def main() -> None:
        await asyncio.gather(*(one(*kinds[i % len(kinds)]) for i in range(CHEAP_CONNS)))

    asyncio.run(main())
    queue.put(codes)


def answers(socks: list[socket.socket]) -> dict:
    """The status lines the slow requests got so far (none: still in progress)."""
    tally: dict = {}
    for sock in socks:
        sock.setblocking(False)
        try:
            data = sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            data = None
        except OSError as exc:
            data = type(exc).__name__.encode()
        key = "in progress" if data is None else (data[9:12].decode() + (
            " timers_unavailable" if b"timers_unavailable" in data else "") if data.startswith(b"HTTP/") else
            (data.decode() or "closed"))
        tally[key] = tally.get(key, 0) + 1
    return tally


# ---------------------------------------------------------------------------
# the section
# ---------------------------------------------------------------------------

def bench_conns(url: str, res, sockets: int, slow: int, seconds: float, delete_rate: float,
                cheap_clients: int = 2) -> None:
    log(f"\n== conns: {sockets} silent sockets, then {slow} never-ending bodies of one tenant, then {slow} of each "
        f"of two tenants, then {cheap_clients * CHEAP_CONNS} connections of requests answered at once, while "
        f"another tenant cancels at {delete_rate:.0f}/s ({seconds:g} s a phase) ==")
    b = start_broker(url, "conns", QUEEN_AUTH="jwt", QUEEN_JWT_SECRET=SECRET)
    figures: dict = {"sockets": sockets, "slow": slow, "seconds": seconds}
    ctx = multiprocessing.get_context("spawn")
    stop, phase, queue = ctx.Event(), ctx.Array("c", 16), ctx.Queue()
    phase.value = b"before"
    proc = ctx.Process(target=_deletes_main, args=(b.port, delete_rate, stop, queue, phase), daemon=True)
    try:
        limits = open(f"/proc/{b.proc.pid}/limits").read()
        log("  broker " + next(line for line in limits.splitlines() if line.startswith("Max open files")))
        proc.start()
        time.sleep(2)
        notes: dict = {}
        phase.value = b"idle"
        with SilentSockets(b.port, sockets) as flood:
            time.sleep(seconds)
            notes["idle"] = {"broker_files": len(os.listdir(f"/proc/{b.proc.pid}/fd")),
                             "reopened": flood.reopened}
        phase.value = b"between"
        time.sleep(2)
        phase.value = b"slow"
        held = slow_posts(b.port, slow)
        try:
            time.sleep(seconds)
            notes["slow"] = {"broker_files": len(os.listdir(f"/proc/{b.proc.pid}/fd")), "answers": answers(held)}
        finally:
            for sock in held:
                sock.close()
        phase.value = b"between2"
        time.sleep(2)
        phase.value = b"two"
        held = slow_posts(b.port, slow)
        held2 = slow_posts(b.port, slow, "flood2")
        try:
            time.sleep(seconds)
            notes["two"] = {"broker_files": len(os.listdir(f"/proc/{b.proc.pid}/fd")),
                            "answers": answers(held), "answers2": answers(held2)}
        finally:
            for sock in held + held2:
                sock.close()
        phase.value = b"between3"
        time.sleep(2)
        phase.value = b"cheap"
        cheap_stop, cheap_queue = ctx.Event(), ctx.Queue()
        cheap = [ctx.Process(target=cheap_main, args=(b.port, cheap_stop, cheap_queue), daemon=True)
                 for _ in range(cheap_clients)]
        for p in cheap:
            p.start()
        time.sleep(seconds)
        cheap_stop.set()
        tally: dict = {}
        for _ in cheap:
            for status, count in cheap_queue.get(timeout=60).items():
                tally[status] = tally.get(status, 0) + count
        for p in cheap:
            p.join(30)
        notes["cheap"] = {"broker_files": len(os.listdir(f"/proc/{b.proc.pid}/fd")), "answers": tally}
        phase.value = b"after"
        time.sleep(2)
        stop.set()
        out = queue.get(timeout=60)
        proc.join(30)
        reclaimed = metric_sum(b.metrics(), "queen_timers_http_connections_reclaimed_total")
        met = True
        for name in ("idle", "slow", "two", "cheap"):
            d = out.get(name, {"lat": [], "errors": {}, "reconnects": 0})
            lat = d["lat"]
            p50, p99 = pct(lat, 50), pct(lat, 99)
            ok = bool(lat) and not d["errors"] and p99 <= TARGET_DELETE_P99_S
            met &= ok
            log(f"  {name:4s}: quiet's DELETEs {len(lat)}, p50 {p50 * 1000:.2f} ms, p99 {p99 * 1000:.2f} ms, "
                f"max {max(lat) * 1000:.1f} ms; non-200 {d['errors'] or 'none'}; reconnects {d['reconnects']}; "
                f"broker open files {notes[name]['broker_files']}"
                + (f"; silent sockets closed by the broker and opened again {notes[name]['reopened']}"
                   if name == "idle" else f"; the flood's answers {notes[name]['answers']}"
                   + (f" and {notes[name]['answers2']}" if name == "two" else ""))
                + ("" if ok else "  <-- MISSED"))
            figures[name] = {"deletes": len(lat), "p50_ms": round(p50 * 1000, 2), "p99_ms": round(p99 * 1000, 2),
                             "errors": d["errors"], "reconnects": d["reconnects"], **notes[name]}
        log(f"  connections reclaimed by the broker: {reclaimed if reclaimed is None else round(reclaimed)}")
        log(f"  target: every DELETE of the other tenant a 200, p99 <= {TARGET_DELETE_P99_S * 1000:.0f} ms in "
            f"each phase: {'met' if met else 'MISSED'}")
        figures.update(reclaimed=reclaimed, target_met=met)
    finally:
        stop.set()
        if proc.is_alive():
            proc.terminate()
        b.stop()
    res.put("conns", **figures)
