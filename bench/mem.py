"""Section `mem`: one tenant floods the broker with the worst requests it can send,
while another tenant cancels timers (issue 17).

Kinds, each sent by 8 clients at once (tenant `flood`):
  batch    the full legal batch: QUEEN_TIMERS_MAX_OPS schedules with a 1 MiB random
           payload each (~358 MB of JSON). A 503 is retried after its Retry-After,
           so every one of them must end in 200.
  array    one JSON array of 1-character strings, ~360 MB (refused: too many values)
  keys     an object with millions of keys, ~360 MB (refused)
  deep     legal nesting (127 levels), repeated to ~360 MB (refused: too many values)
  push     the largest legal push (QUEEN_LOG_MAX_BODY_BYTES of 2 KB messages): 201
  pop      what the pushes left, by batches of 10,000 (QUEEN_POP_MAX_BYTES bounds each)
  unread   3 pops per client of 3,500 messages of 2 KB (a 17 MB answer each) whose clients
           never read the answer, held for --mem-unread-s seconds: the answers wait in the
           broker's buffers, weighed in the body budget (before 40ec5d9 they weighed nothing;
           every other one sends Connection: close, which let its weight go before 377f526)
Meanwhile tenant `quiet` sends DELETEs at --mem-delete-rate/s on its own connection.

Printed: the broker's idle RSS, its peak RSS per kind (VmHWM, reset before each
kind) and overall, its RSS 30 s after the flood, every request's answer, the time
a refusal took from the first body byte, and the DELETEs' p50/p99.
Targets: peak <= 1.5 GB; back within 200 MB of idle 30 s after; every answer a
documented JSON status; the other tenant's DELETE p99 <= 50 ms.
"""

from __future__ import annotations

import asyncio
import base64
import json
import multiprocessing
import os
import socket
import threading
import time

import jwt

from cancel import content_length
from harness import log, metric_sum, pct, start_broker

SECRET = "bench-secret-for-queen-timers-mem-section-0123"
MB = 1_000_000
TARGET_PEAK_MB = 1500
TARGET_BACK_MB = 200
TARGET_DELETE_P99_S = 0.050
DOCUMENTED = {(200, None), (201, None), (204, None), (400, "timers_bad_request"), (413, "body_too_large"),
              (413, "payload_too_large"), (503, "timers_unavailable")}


def bearer(tenant: str, role: str = "read-write") -> str:
    claims = {"sub": f"bench-{tenant}", "tenant": tenant, "role": role, "exp": int(time.time()) + 7200}
    return "Bearer " + jwt.encode(claims, SECRET, algorithm="HS256")


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1000
    raise RuntimeError(field)


def reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


# ---------------------------------------------------------------------------
# bodies
# ---------------------------------------------------------------------------

def batch_body(max_ops: int) -> bytes:
    ops = [{"op": "schedule", "queue": "flood", "timerKey": f"c0-{i:04d}", "txn": f"t{i}",
            "delayMs": 3_600_000, "payload": base64.b64encode(os.urandom(1 << 20)).decode()}
           for i in range(max_ops)]
    return json.dumps({"operations": ops}).encode()


def hostile_body(kind: str, size: int) -> bytes:
    if kind == "array":
        return b"[" + b'"a",' * (size // 4 - 1) + b'"a"]'
    if kind == "keys":  # distinct keys, built a block at a time
        n = (size - 2) // 15
        blocks = [b",".join(b'"k%09d":0' % i for i in range(start, min(start + 100_000, n)))
                  for start in range(0, n, 100_000)]
        return b"{" + b",".join(blocks) + b"}"
    if kind == "deep":
        block = b"[" * 127 + b"0" + b"]" * 127
        n = size // (len(block) + 1)
        return b"[" + b",".join([block] * n) + b"]"
    raise ValueError(kind)


def in_push(body: bytes) -> bytes:
    """A hostile value as one message's payload: the log routes' form of it."""
    return b'{"items":[{"queue":"flood-log","payload":' + body + b"}]}"


def push_body(cap: int) -> bytes:
    item = json.dumps({"queue": "flood-log", "payload": {"blob": "z" * 2000}}).encode()
    n = (cap - 64) // (len(item) + 1)
    return b'{"items":[' + b",".join([item] * n) + b"]}"


def unread_pops(b, pid: int, clients: int, hold_s: float) -> dict:
    """3 pops per client whose answers are never read; the peak RSS while they are held."""
    import httpx
    queues = [f"flood-unread-{k}" for k in range(3 * clients)]
    item = {"payload": {"blob": "z" * 2000}}
    with httpx.Client(base_url=b.url, timeout=300, headers={"Authorization": bearer("flood")}) as h:
        for q in queues:
            r = h.post("/api/v1/push", json={"items": [{**item, "queue": q}] * 3500})
            assert r.status_code == 201, r.text
    reset_peak(pid)
    refusals0 = metric_sum(b.metrics(), "queen_timers_body_budget_refusals_total") or 0
    socks = []
    t = time.monotonic()
    try:
        for k, q in enumerate(queues):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", b.port))
            # every other one, the first included (the budget admits one at a time at the
            # defaults), asks to close after its answer: such a connection is watched too
            close = "" if k % 2 else "Connection: close\r\n"
            sock.sendall(f"GET /api/v1/pop/queue/{q}?batch=3500 HTTP/1.1\r\nHost: x\r\n"
                         f"Authorization: {bearer('flood')}\r\n{close}\r\n".encode())
            socks.append(sock)
        time.sleep(hold_s)
        text = b.metrics()
        held = metric_sum(text, "queen_timers_body_budget_in_use_bytes") or 0
        refused = (metric_sum(text, "queen_timers_body_budget_refusals_total") or 0) - refusals0
    finally:
        for sock in socks:
            sock.close()
    return {"pops": len(queues), "seconds": round(time.monotonic() - t, 1), "peak_rss_mb": round(rss_mb(pid, "VmHWM"), 1),
            "budget_held_mb": round(held / MB, 1), "refused_503": int(refused)}


# ---------------------------------------------------------------------------
# a raw HTTP/1.1 POST that notices an early answer
# ---------------------------------------------------------------------------

def raw_get(port: int, path: str, token: str, timeout: float = 300) -> dict:
    import httpx
    t0 = time.monotonic()
    r = httpx.get(f"http://127.0.0.1:{port}{path}", headers={"Authorization": token}, timeout=timeout)
    out = {"sent": 0, "t": time.monotonic() - t0, "status": r.status_code, "error": None,
           "json": r.status_code == 204 or r.headers.get("content-type", "").startswith("application/json"),
           "retry_after": r.headers.get("retry-after")}
    if r.status_code >= 400:
        out.update(slug=r.json().get("error"), detail=r.json().get("detail"))
    elif r.status_code == 200:
        out["messages"] = len(r.json()["messages"])
    return out


def raw_post(port: int, path: str, token: str, body: bytes, timeout: float = 300) -> dict:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    got: dict = {}
    t0 = time.monotonic()

    def reader():
        data = b""
        try:
            while b"\r\n\r\n" not in data:
                chunk = sock.recv(65536)
                if not chunk:
                    got["error"] = "closed without an answer"
                    return
                data += chunk
            got["t"] = time.monotonic() - t0
            head, _, rest = data.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:])}
            length = int(headers.get("content-length", "0"))
            while len(rest) < length:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                rest += chunk
            got.update(status=int(lines[0].split()[1]), headers=headers, body=rest[:length])
        except OSError as exc:
            got["error"] = repr(exc)

    th = threading.Thread(target=reader, daemon=True)
    try:
        sock.sendall((f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: {token}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode())
        th.start()
        view = memoryview(body)
        sent = 0
        try:
            for i in range(0, len(body), 1 << 20):
                if "t" in got or "error" in got:
                    break  # answered early: the rest is never sent
                sock.sendall(view[i:i + (1 << 20)])
                sent = i + len(view[i:i + (1 << 20)])
        except OSError:
            pass
        th.join(timeout)
    finally:
        sock.close()
    out = {"sent": sent, "t": got.get("t"), "status": got.get("status"), "error": got.get("error")}
    if got.get("status") is not None:
        headers = got["headers"]
        out["json"] = headers.get("content-type", "").startswith("application/json")
        out["retry_after"] = headers.get("retry-after")
        try:
            answer = json.loads(got["body"])
            out["slug"] = answer.get("error") if isinstance(answer, dict) else None
            out["detail"] = answer.get("detail") if isinstance(answer, dict) else None
        except ValueError:
            out["json"] = False
    return out


def documented(r: dict) -> bool:
    if r.get("status") is None or not r.get("json"):
        return False
    if (r["status"], r.get("slug")) not in DOCUMENTED:
        return False
    return r["status"] != 503 or r.get("retry_after") is not None


# ---------------------------------------------------------------------------
# the other tenant's DELETEs
# ---------------------------------------------------------------------------

class Deletes:
    """The other tenant's DELETEs, in a process of their own: the flood's clients (which
    build and send hundreds of MB) must not hold the GIL of the process that times them."""

    def __init__(self, port: int, rate: float):
        self.port, self.rate = port, rate
        self.lat: list[float] = []
        self.errors: dict = {}
        ctx = multiprocessing.get_context("spawn")
        self.stop = ctx.Event()
        self.queue = ctx.Queue()
        self.proc = ctx.Process(target=_deletes_main, args=(port, rate, self.stop, self.queue), daemon=True)

    def __enter__(self):
        self.proc.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        out = self.queue.get(timeout=60).get("all", {"lat": [], "errors": {}})
        self.lat, self.errors = out["lat"], out["errors"]
        self.proc.join(30)


def _deletes_main(port: int, rate: float, stop, queue, phase=None) -> None:
    """The quiet tenant's DELETEs at `rate`, reconnecting when the broker closes the
    connection; per phase (a shared name the parent sets, "all" without one): latencies,
    non-200 answers, reconnects. Shared by the mem and conns sections."""
    out: dict = {}
    asyncio.run(_deletes(port, rate, stop, phase, out))
    queue.put(out)


async def _deletes(port: int, rate: float, stop, phase, out: dict) -> None:
    token = bearer("quiet")
    conn: list = [None, None]

    async def request(data: bytes) -> int:
        for attempt in (1, 2):
            if conn[0] is None:
                conn[0], conn[1] = await asyncio.open_connection("127.0.0.1", port)
            try:
                conn[1].write(data)
                head = await conn[0].readuntil(b"\r\n\r\n")
                await conn[0].readexactly(content_length(head))
                return int(head[9:12])
            except (asyncio.IncompleteReadError, ConnectionError):
                conn[1].close()
                conn[0] = conn[1] = None
                stats["reconnects"] += 1
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    i = 0
    next_at = time.monotonic()
    stats: dict = {}
    while not stop.is_set():
        name = phase.value.decode() if phase is not None else "all"
        stats = out.setdefault(name, {"lat": [], "errors": {}, "reconnects": 0})
        i += 1
        t = time.perf_counter()
        try:
            status = await request(f"DELETE /api/v1/timers/quiet/k{i} HTTP/1.1\r\nHost: x\r\n"
                                   f"Authorization: {token}\r\n\r\n".encode())
        except (OSError, asyncio.IncompleteReadError) as exc:
            status = type(exc).__name__
        stats["lat"].append(time.perf_counter() - t)
        if status != 200:
            stats["errors"][status] = stats["errors"].get(status, 0) + 1
        next_at += 1 / rate
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
    if conn[1] is not None:
        conn[1].close()


# ---------------------------------------------------------------------------
# the section
# ---------------------------------------------------------------------------

def send_kind(port: int, path: str, bodies: list[bytes], retry_503_until: float | None) -> list[dict]:
    out: list[dict | None] = [None] * len(bodies)

    def client(k: int):
        tries = 0
        while True:
            tries += 1
            r = (raw_post(port, path, bearer("flood"), bodies[k]) if bodies[k]
                 else raw_get(port, path, bearer("flood")))
            if r.get("status") == 503 and retry_503_until is not None and time.monotonic() < retry_503_until:
                time.sleep(float(r.get("retry_after") or 1))
                continue
            r["tries"] = tries
            out[k] = r
            return

    threads = [threading.Thread(target=client, args=(k,)) for k in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out  # type: ignore[return-value]


def bench_mem(url: str, res, clients: int, size_mb: int, delete_rate: float, settle_s: float,
              max_ops: int = 256, unread_s: float = 10) -> None:
    log("\n== mem: one tenant floods the broker with its worst requests, another cancels ==")
    b = start_broker(url, "mem", QUEEN_AUTH="jwt", QUEEN_JWT_SECRET=SECRET, QUEEN_TIMERS_MAX_OPS=str(max_ops))
    pid = b.proc.pid
    figures: dict = {"clients": clients}
    try:
        from queen_timers.config import Settings
        settings = Settings.from_env({"QUEEN_DATABASE_URL": url, "QUEEN_TIMERS_MAX_OPS": str(max_ops)})
        log(f"  limits: QUEEN_MAX_BODY_BYTES {settings.max_body_bytes:,}, QUEEN_LOG_MAX_BODY_BYTES "
            f"{settings.log_max_body_bytes:,}, QUEEN_BODY_BUDGET_BYTES {settings.body_budget_bytes:,} "
            f"(a tenant's share {settings.body_budget_bytes // 2:,}), QUEEN_BODY_WAIT_MS {settings.body_wait_ms}, "
            f"QUEEN_JSON_MAX_VALUES {settings.json_max_values:,}")
        size = min(size_mb * MB, settings.max_body_bytes)

        def batches() -> list[bytes]:
            template = batch_body(max_ops)
            return [template.replace(b'"c0-', b'"c%d-' % k) for k in range(clients)]

        # (name, route, bodies built when the kind's turn comes, legal: a 503 is retried)
        kinds = [
            ("batch", "/api/v1/timers", batches, True),
            ("array", "/api/v1/timers", lambda: [hostile_body("array", size)] * clients, False),
            ("keys", "/api/v1/timers", lambda: [hostile_body("keys", size)] * clients, False),
            ("deep", "/api/v1/timers", lambda: [hostile_body("deep", size)] * clients, False),
            # the same three at the log routes' cap, where they are parsed as JSON values
            ("array-log", "/api/v1/push",
             lambda: [in_push(hostile_body("array", settings.log_max_body_bytes - 64))] * clients, False),
            # ~560,000 keys: under QUEEN_JSON_MAX_VALUES, so a legal (if odd) message
            ("keys-log", "/api/v1/push",
             lambda: [in_push(hostile_body("keys", settings.log_max_body_bytes - 64))] * clients, True),
            ("deep-log", "/api/v1/push",
             lambda: [in_push(hostile_body("deep", settings.log_max_body_bytes - 64))] * clients, False),
            ("push", "/api/v1/push", lambda: [push_body(settings.log_max_body_bytes)] * clients, True),
            # what the pushes left, popped by batches of 10,000 (QUEEN_POP_MAX_BYTES bounds each)
            ("pop", "/api/v1/pop/queue/flood-log?batch=10000&autoAck=true", lambda: [b""] * clients, True),
        ]
        time.sleep(2)
        idle = rss_mb(pid)
        log(f"  broker idle RSS {idle:.0f} MB; {clients} clients per kind; DELETEs of tenant quiet at "
            f"{delete_rate:.0f}/s throughout")
        figures["idle_rss_mb"] = round(idle, 1)
        all_ok = True
        peak_all = 0.0
        with Deletes(b.port, delete_rate) as deletes:
            time.sleep(1)
            for name, path, build, legal in kinds:
                bodies = build()
                reset_peak(pid)
                t = time.monotonic()
                answers = send_kind(b.port, path, bodies, time.monotonic() + 300 if legal else None)
                secs = time.monotonic() - t
                peak = rss_mb(pid, "VmHWM")
                peak_all = max(peak_all, peak)
                tally: dict = {}
                for r in answers:
                    key = f"{r.get('status')} {r.get('slug') or ''}".strip() if r.get("status") else r.get("error")
                    tally[key] = tally.get(key, 0) + 1
                ok = all(documented(r) for r in answers) and (
                    not legal or all(r.get("status") in (200, 201, 204) for r in answers))
                all_ok &= ok
                refusal_t = [r["t"] for r in answers if r.get("status") == 400 and r.get("t") is not None]
                tries = sum(r.get("tries", 1) for r in answers)
                log(f"  {name:5s} {len(bodies[0]) / MB:6.1f} MB x{clients}: {secs:5.1f} s, peak RSS {peak:6.0f} MB; "
                    f"answers {tally}"
                    + (f" after {tries} tries (503s retried)" if legal else "")
                    + (f"; refused after {min(refusal_t):.2f}-{max(refusal_t):.2f} s, "
                       f"{max(r['sent'] for r in answers) / MB:.1f} MB sent at most" if refusal_t else "")
                    + ("" if ok else "  <-- NOT every answer documented/legal"))
                popped = [r["messages"] for r in answers if r.get("messages")]
                if popped:
                    log(f"        messages per pop: {popped}")
                details = {r.get("detail") for r in answers if r.get("detail")}
                for d in sorted(details)[:2]:
                    log(f"        e.g. {d[:150]}")
                figures[name] = {"mb": round(len(bodies[0]) / MB, 1), "seconds": round(secs, 1),
                                 "peak_rss_mb": round(peak, 1), "answers": tally, "tries": tries,
                                 "refused_within_s": round(max(refusal_t), 3) if refusal_t else None}
                del bodies
            u = unread_pops(b, pid, clients, unread_s)
            peak_all = max(peak_all, u["peak_rss_mb"])
            log(f"  unread {u['pops']} pops of 17 MB answers nobody reads, held {u['seconds']:.0f} s: peak RSS "
                f"{u['peak_rss_mb']:6.0f} MB; the budget holds {u['budget_held_mb']:.0f} MB for the answers "
                f"waiting to be read; {u['refused_503']} of the pops answered 503 (no room within QUEEN_BODY_WAIT_MS)")
            figures["unread"] = u
            flood_end = time.monotonic()
        lat = deletes.lat
        p50, p99 = pct(lat, 50), pct(lat, 99)
        log(f"  tenant quiet's DELETE during the flood: {len(lat)} calls, p50 {p50 * 1000:.2f} ms, "
            f"p99 {p99 * 1000:.2f} ms, max {max(lat) * 1000:.1f} ms; non-200: {deletes.errors or 'none'}")
        time.sleep(max(0.0, settle_s - (time.monotonic() - flood_end)))
        after = rss_mb(pid)
        log(f"  RSS {settle_s:.0f} s after the flood: {after:.0f} MB (idle {idle:.0f} MB)")
        figures.update(peak_rss_mb=round(peak_all, 1), rss_after_mb=round(after, 1),
                       delete_p50_ms=round(p50 * 1000, 2), delete_p99_ms=round(p99 * 1000, 2),
                       delete_calls=len(lat), delete_errors=deletes.errors)
        verdicts = {
            "peak": peak_all <= TARGET_PEAK_MB,
            "back": after - idle <= TARGET_BACK_MB,
            "answers": all_ok,
            "delete_p99": p99 <= TARGET_DELETE_P99_S and not deletes.errors,
        }
        figures["targets_met"] = verdicts
        log(f"  targets: peak RSS {peak_all:.0f} MB <= {TARGET_PEAK_MB}: {'met' if verdicts['peak'] else 'MISSED'}; "
            f"back within {TARGET_BACK_MB} MB of idle after {settle_s:.0f} s (+{after - idle:.0f} MB): "
            f"{'met' if verdicts['back'] else 'MISSED'}; every answer a documented JSON status: "
            f"{'met' if verdicts['answers'] else 'MISSED'}; other tenant's DELETE p99 {p99 * 1000:.1f} ms <= 50: "
            f"{'met' if verdicts['delete_p99'] else 'MISSED'}")
    finally:
        b.stop()
    res.put("mem", **figures)
