"""QUEEN_MAX_CONNECTIONS and QUEEN_TENANT_MAX_REQUESTS: no client, with or without a
credential, can lock the others out of a broker by holding connections or requests.

- Connections held open and silent (or between keep-alive requests, or with a head
  half sent) are reclaimed, the one idle longest first, when a new connection
  arrives past the limit; a half-sent head is told so in JSON (503, Retry-After).
- Requests in progress are never reclaimed; past the limit a new request is
  answered 503 timers_unavailable with Retry-After, and served once one ends.
- One tenant holds at most its share of the requests in progress (half, under
  JWT): its next one is 503 timers_unavailable with Retry-After (capacity, as the
  body budget's tenant half: a DELETE meets no rung of the gate ladder), while another tenant
  is served; a share is given back however the request ends.
- Two tenants at their shares would fill the broker: past three quarters in use, a
  tenant that shares the broker takes a slot only while it holds fewer than are free,
  so a third tenant still finds one.
- An answer the client does not take keeps its request's body weight and slot until
  it has left the broker's buffer; a client that takes none of it for
  QUEEN_SEND_TIMEOUT_MS has its connection reset. A slow reader that keeps reading
  gets the whole answer.
"""

from __future__ import annotations

import json
import os
import re
import resource
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from test_body_budget import budget_in_use, open_post, wait_budget_free
from test_direct_lane import held, lock_waiters
from test_input_limits import assert_json_error, read_response
from timers_util import HINT, JWT_SECRET, op, token

PATH = "/api/v1/timers/reminders"


def reclaimed(broker) -> float:
    text = httpx.get(f"{broker.url}/metrics/prometheus", timeout=10).text
    return float(re.search(r"^queen_timers_http_connections_reclaimed_total (\S+)$", text, re.M).group(1))


def closed_by_server(sock: socket.socket, timeout: float = 5.0) -> bytes | None:
    """What the server sent before closing `sock` (b"" for a bare close), or None if it is still open."""
    sock.settimeout(timeout)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except socket.timeout:
        return None
    except ConnectionResetError:
        pass
    return got


def still_open(sock: socket.socket) -> bool:
    sock.settimeout(0.05)
    try:
        return sock.recv(1, socket.MSG_PEEK) != b""
    except socket.timeout:
        return True  # nothing to read and no EOF
    except OSError:
        return False


def keep_alive_get(port: int) -> socket.socket:
    """A connection that made one request and now sits idle between requests."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(f"GET {PATH} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    status, _, _ = read_response(sock, timeout=10)
    assert status == 200
    return sock


def test_silent_and_idle_connections_cannot_lock_others_out(spawn_broker, db):
    # before: uvicorn's limit counted every open connection, so 4 silent sockets (no credential,
    # not a byte sent) had every other request answered 503 until the head timeout closed them
    b = spawn_broker(QUEEN_MAX_CONNECTIONS="4")
    before = reclaimed(b)
    idle = [keep_alive_get(b.port) for _ in range(2)]
    silent = [socket.create_connection(("127.0.0.1", b.port), timeout=10) for _ in range(10)]
    try:
        time.sleep(0.2)
        for _ in range(12):  # a new connection each time, as a client whose pool is empty
            r = httpx.get(f"{b.url}{PATH}", timeout=10)
            assert r.status_code == 200, r.text
        # the idle ones were closed first, oldest first, without a word (as a keep-alive timeout does)
        for sock in idle:
            assert closed_by_server(sock) == b""
        # 12 held on a limit of 4: 8 reclaimed as they came, then one for the first request's
        # connection (each later one found room left by the one before, closed by httpx)
        # (at least: a request's connection may arrive before the server has seen the last one close)
        assert sum(closed_by_server(s, 0.5) == b"" for s in silent) >= 7
        assert sum(still_open(s) for s in silent) <= 3
        assert reclaimed(b) - before >= 9
    finally:
        for sock in idle + silent:
            sock.close()


def test_a_head_half_sent_when_reclaimed_is_answered_a_json_503(spawn_broker, db):
    b = spawn_broker(QUEEN_MAX_CONNECTIONS="2")
    slow = socket.create_connection(("127.0.0.1", b.port), timeout=10)
    try:
        slow.sendall(b"GET /api/v1/timers/reminders HTTP/1.1\r\nHost: x\r\nX-Slow:")
        time.sleep(0.2)
        with httpx.Client(base_url=b.url, timeout=10) as c1, httpx.Client(base_url=b.url, timeout=10) as c2:
            assert c1.get(PATH).status_code == 200
            assert c2.get(PATH).status_code == 200  # the third connection: the half head makes room
            status, headers, body = read_response(slow, timeout=5)
            assert status == 503 and headers["content-type"] == "application/json", body
            assert headers["retry-after"] == "1" and headers["connection"] == "close"
            assert json.loads(body)["error"] == "timers_unavailable"
            assert c1.get(PATH).status_code == 200  # a keep-alive client goes on as before
    finally:
        slow.close()


def test_requests_in_progress_are_never_reclaimed_and_past_the_limit_a_request_is_a_json_503(
        spawn_broker, db):
    b = spawn_broker(QUEEN_MAX_CONNECTIONS="3")
    body = json.dumps({"operations": [op("schedule", "k1")]}).encode()
    # three requests in progress: heads complete, bodies still to come
    held = [open_post(b.port, "/api/v1/timers", len(body), body[:5]) for _ in range(3)]
    try:
        time.sleep(0.3)
        r = httpx.get(f"{b.url}{PATH}", timeout=10)
        assert_json_error(r, 503, "timers_unavailable")
        assert r.headers["retry-after"] == "1"
        assert all(still_open(s) for s in held)  # busy connections are not reclaimed
        held[0].sendall(body[5:])  # one ends: its answer arrives, and there is room again
        status, _, answer = read_response(held[0], timeout=10)
        assert status == 200 and json.loads(answer)["results"][0]["status"] == "scheduled", answer
        deadline = time.monotonic() + 5
        while (r := httpx.get(f"{b.url}{PATH}", timeout=10)).status_code != 200:
            assert r.status_code == 503 and time.monotonic() < deadline, r.text
            time.sleep(0.05)
        assert [t["timerKey"] for t in r.json()["rows"]] == ["k1"]
    finally:
        for sock in held:
            sock.close()


def test_one_tenant_holds_at_most_its_share_of_the_requests_in_progress(spawn_broker, db):
    b = spawn_broker(QUEEN_MAX_CONNECTIONS="6", QUEEN_AUTH="jwt", QUEEN_JWT_SECRET=JWT_SECRET)  # a share: 3
    acme = token("read-write", tenant="acme")
    globex = token("read-write", tenant="globex")
    auth_line = f"Authorization: {acme['Authorization']}\r\n"
    body = json.dumps({"operations": [op("schedule", "k1")]}).encode()
    held = [open_post(b.port, "/api/v1/timers", len(body), body[:5], auth_line) for _ in range(3)]
    try:
        time.sleep(0.3)
        with b.client() as c:
            r = c.get(PATH, headers=acme)  # acme's fourth request in progress
            err = assert_json_error(r, 503, "timers_unavailable")
            assert r.headers["retry-after"] == "1" and "QUEEN_TENANT_MAX_REQUESTS" in err["detail"]
            assert "x-queen-timers-hint" not in r.headers  # a GET: the hint is the POST's alone
            r = c.post("/api/v1/timers", headers=acme, json={"operations": [op("schedule", "a2")]})
            assert_json_error(r, 503, "timers_unavailable")
            assert r.headers["x-queen-timers-hint"] == HINT  # every 503 of the POST names the cancel route
            r = c.delete(f"{PATH}/k1", headers=acme)  # the direct lane
            assert_json_error(r, 503, "timers_unavailable")
            assert "x-queen-timers-hint" not in r.headers
            # another tenant is served meanwhile, reads and writes
            assert c.get(PATH, headers=globex).json()["rows"] == []
            r = c.post("/api/v1/timers", headers=globex, json={"operations": [op("schedule", "g1")]})
            assert r.status_code == 200, r.text
            assert c.delete(f"{PATH}/g1", headers=globex).json()["status"] == "cancelled"
            # acme's requests end (one answered, two abandoned by their client): its share is back
            held[0].sendall(body[5:])
            assert read_response(held[0], timeout=10)[0] == 200
            held[1].close()
            held[2].close()
            deadline = time.monotonic() + 5
            while (r := c.get(PATH, headers=acme)).status_code == 503:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert r.status_code == 200 and [t["timerKey"] for t in r.json()["rows"]] == ["k1"]
            more = [open_post(b.port, "/api/v1/timers", len(body), body[:5], auth_line) for _ in range(2)]
            try:
                time.sleep(0.3)
                assert c.get(PATH, headers=acme).status_code == 200  # 2 held + this one: within 3
            finally:
                for sock in more:
                    sock.close()
    finally:
        for sock in held:
            sock.close()
    assert db.execute("SELECT count(*) AS n FROM queen.timers").fetchone()["n"] == 1  # k1; g1 cancelled


def test_a_keep_alive_client_at_the_limit_is_never_refused_for_its_own_last_request(spawn_broker, db):
    # one request held, one slot left: a client's requests one after another on one connection
    # all fit it (before, its last request's task still counted for a loop turn: some were 503)
    b = spawn_broker(QUEEN_MAX_CONNECTIONS="2")
    body = json.dumps({"operations": [op("schedule", "k1")]}).encode()
    holder = open_post(b.port, "/api/v1/timers", len(body), body[:5])
    try:
        time.sleep(0.3)
        with b.client() as c:
            codes = [c.get(PATH).status_code for _ in range(150)]
            codes += [c.delete(f"{PATH}/k{i}").status_code for i in range(150)]  # the direct lane
        assert set(codes) == {200}, {code: codes.count(code) for code in set(codes)}
    finally:
        holder.close()


def test_a_client_that_closes_mid_body_leaves_nothing_held_and_nothing_in_the_log(spawn_broker, db):
    # each one used to log an "unexpected error" traceback (1 KB): 1,100 slow bodies closed
    # at once wrote 1.2 MB, and a client could go on at will
    b = spawn_broker(QUEEN_AUTH="jwt", QUEEN_JWT_SECRET=JWT_SECRET)
    line = f"Authorization: {token('read-write', tenant='acme')['Authorization']}\r\n"
    socks = [open_post(b.port, path, 1000, b'{"ope', line)
             for path in ("/api/v1/timers", "/api/v1/push") for _ in range(20)]
    time.sleep(0.3)
    assert budget_in_use(b) > 0
    for sock in socks:
        sock.close()
    wait_budget_free(b)
    with b.client() as c:  # and the tenant's slots came back: it is served
        r = c.post("/api/v1/timers", headers=token("read-write", tenant="acme"),
                   json={"operations": [op("schedule", "k1")]})
        assert r.status_code == 200, r.text
    log = b.log()
    assert "unexpected error" not in log and "Traceback" not in log, log[-3000:]


def test_two_busy_tenants_cannot_take_the_last_slots_from_a_third(spawn_broker, db):
    # 8 slots, a share of 4: acme takes its 4; before, globex took the other 4 and initech's
    # every request was 503 until one of theirs ended
    b = spawn_broker(QUEEN_MAX_CONNECTIONS="8", QUEEN_AUTH="jwt", QUEEN_JWT_SECRET=JWT_SECRET)
    body = json.dumps({"operations": [op("schedule", "k1")]}).encode()

    def hold(tenant: str, n: int) -> list[socket.socket]:
        line = f"Authorization: {token('read-write', tenant=tenant)['Authorization']}\r\n"
        socks = [open_post(b.port, "/api/v1/timers", len(body), body[:5], line) for _ in range(n)]
        time.sleep(0.3)
        return socks

    acme = hold("acme", 4)
    globex = hold("globex", 3)  # 7 in use, 1 free: below a quarter
    try:
        with socket.create_connection(("127.0.0.1", b.port), timeout=10) as sock:
            # globex holds 3 and 1 is free: its next request is refused, and says why
            headers = token("read-write", tenant="globex")
            sock.sendall(f"GET {PATH} HTTP/1.1\r\nHost: x\r\nAuthorization: {headers['Authorization']}\r\n\r\n"
                         .encode())
            status, head, text = read_response(sock)
            assert status == 503 and head["retry-after"] == "1", (status, text)
            assert json.loads(text)["error"] == "timers_unavailable" and "free" in json.loads(text)["detail"]
        with b.client() as c:
            initech = token("read-write", tenant="initech")
            r = c.post("/api/v1/timers", headers=initech, json={"operations": [op("schedule", "i1")]})
            assert r.status_code == 200, r.text
            r = c.get(PATH, headers=initech)
            assert r.status_code == 200 and r.json()["rows"][0]["timerKey"] == "i1", r.text
            r = c.delete(f"{PATH}/i1", headers=initech)
            assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
        # once globex's requests end its slots come back to it
        for sock in globex:
            sock.close()
        with b.client() as c:
            deadline = time.monotonic() + 5
            while (r := c.get(PATH, headers=token("read-write", tenant="globex"))).status_code == 503:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert r.status_code == 200
    finally:
        for sock in acme + globex:
            sock.close()


def assert_weighed_then_reset(b, sock: socket.socket) -> None:
    """A pop's answer the client on `sock` does not read: weighed in the budget while it waits,
    then the connection reset at the send timeout and the weight given back (one reset counted)."""
    try:
        deadline = time.monotonic() + 10
        while budget_in_use(b) == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(1.0)  # the pop is long done: its answer waits in the buffer, weighed
        assert budget_in_use(b) > 0
        deadline = time.monotonic() + 10
        while budget_in_use(b) != 0:
            assert time.monotonic() < deadline, "the weight came back when the connection was reset"
            time.sleep(0.05)
        sock.settimeout(5)
        with pytest.raises(ConnectionResetError):
            while sock.recv(65536):
                pass
    finally:
        sock.close()
    text = httpx.get(f"{b.url}/metrics/prometheus", timeout=10).text
    assert re.search(r"^queen_timers_http_send_timeouts_total 1\.0$", text, re.M), text


def test_an_answer_the_client_does_not_take_is_weighed_until_it_leaves_and_reset_after_the_send_timeout(
        spawn_broker, db):
    # before: uvicorn ended the request as soon as the answer was in the buffer, so its weight
    # came back at once; twenty pops of 17 MB nobody read held 400 MB of RSS with the budget at 0
    b = spawn_broker(QUEEN_SEND_TIMEOUT_MS="1500")
    item = {"queue": "big", "payload": {"blob": "z" * 2000}}
    with b.client(timeout=60) as c:
        for queue in ("big", "slow"):
            r = c.post("/api/v1/push", json={"items": [{**item, "queue": queue}] * 3500})
            assert r.status_code == 201, r.text

    def pop_socket(queue: str, rcvbuf: int | None = None) -> socket.socket:
        sock = socket.socket()
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.connect(("127.0.0.1", b.port))
        sock.sendall(f"GET /api/v1/pop/queue/{queue}?batch=3500 HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        return sock

    # a slow reader that keeps reading (256 KB every 50 ms, past the timeout in all) gets it all
    slow = pop_socket("slow")
    try:
        data = b""
        start = time.monotonic()
        held_while_reading = None
        while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < int(
                re.search(rb"content-length: (\d+)", data).group(1)):
            chunk = slow.recv(256 * 1024)
            assert chunk, "the connection closed midway"
            data += chunk
            time.sleep(0.05)
            if held_while_reading is None and time.monotonic() - start > 1.0:
                held_while_reading = budget_in_use(b)  # the pop is done; its answer is still leaving
        assert time.monotonic() - start > 1.5  # it took longer than the send timeout, reading throughout
        assert held_while_reading and held_while_reading > 0
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and len(json.loads(body)["messages"]) == 3500
        deadline = time.monotonic() + 5
        while budget_in_use(b) != 0:  # read to the end, the connection still open: its weight is back
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        slow.close()

    sock = pop_socket("big", rcvbuf=4096)  # the answer stays on the broker's side
    assert_weighed_then_reset(b, sock)
    with b.client() as c:
        assert c.get("/health").status_code == 200


def test_an_answer_read_too_slowly_weighs_its_bytes_and_is_reset_at_the_minimum_rate(spawn_broker, db):
    # before: the parked answer kept its pop's weight (16x its payloads) for as long as its
    # client took a few bytes now and then: two such clients held 571 MB of the budget and a
    # third tenant's pops got 503 (Dec 8 review)
    b = spawn_broker(QUEEN_SEND_TIMEOUT_MS="1500", QUEEN_SEND_MIN_BYTES_PER_S="4000000")
    with b.client(timeout=60) as c:
        r = c.post("/api/v1/push", json={"items": [{"queue": "big", "payload": {"blob": "z" * 2000}}] * 3500})
        assert r.status_code == 201, r.text
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", b.port))
    sock.sendall(b"GET /api/v1/pop/queue/big?batch=3500 HTTP/1.1\r\nHost: x\r\n\r\n")
    try:
        sock.settimeout(10)
        data = sock.recv(4096)
        length = int(re.search(rb"content-length: (\d+)", data).group(1))
        start = time.monotonic()
        peak = 0
        with pytest.raises(ConnectionResetError):
            while time.monotonic() - start < 60:  # 64 KB every 0.1 s: about 0.6 MB/s, reading throughout
                chunk = sock.recv(64 * 1024)
                if not chunk or len(data) + len(chunk) >= length:  # closed, or read to the end
                    break
                data += chunk
                peak = max(peak, budget_in_use(b))
                time.sleep(0.1)
        took = time.monotonic() - start
    finally:
        sock.close()
    # the pop weighed 16x its 7 MB of payloads while it built the answer; parked, the answer
    # weighs its own bytes (the body uvloop holds until it has all left)
    assert 0 < peak <= length + 65536, (peak, length)
    # reset at about the send timeout plus the answer's size at the minimum rate (1.5 + ~4 s),
    # long before the client would have read it all (~25 s) and with most of it unread
    assert 2 < took < 20 and len(data) < length / 2, (took, len(data), length)
    deadline = time.monotonic() + 10
    while budget_in_use(b) != 0:
        assert time.monotonic() < deadline, "the weight came back when the connection was reset"
        time.sleep(0.05)
    text = httpx.get(f"{b.url}/metrics/prometheus", timeout=10).text
    assert re.search(r"^queen_timers_http_send_timeouts_total 1\.0$", text, re.M), text


@pytest.mark.parametrize("request_line, header", [("HTTP/1.1", "Connection: close\r\n"), ("HTTP/1.0", "")])
def test_an_unread_answer_on_a_connection_closing_after_it_is_weighed_and_reset_too(
        spawn_broker, db, request_line, header):
    # the transport closes once its buffer has left: the send watch stopped at "closing" and
    # the budget let the weight go, so the answer stayed in the broker's memory for ever
    b = spawn_broker(QUEEN_SEND_TIMEOUT_MS="1500")
    with b.client(timeout=60) as c:
        r = c.post("/api/v1/push", json={"items": [{"queue": "big", "payload": {"blob": "z" * 2000}}] * 3500})
        assert r.status_code == 201, r.text
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", b.port))
    sock.sendall(f"GET /api/v1/pop/queue/big?batch=3500 {request_line}\r\nHost: x\r\n{header}\r\n".encode())
    assert_weighed_then_reset(b, sock)


# ---------------------------------------------------------------------------
# pipelining: the requests queued behind the one being served are bounded
# ---------------------------------------------------------------------------

PIPELINED = 32  # server.MAX_PIPELINED


def read_answers(sock: socket.socket) -> list[tuple[int, dict, bytes]]:
    """Every answer on the connection until the broker closes it."""
    data = b""
    sock.settimeout(30)
    while chunk := sock.recv(1 << 20):
        data += chunk
    answers = []
    while data:
        head, _, data = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        headers = {k.decode().lower(): v.decode() for k, _, v in (line.partition(b": ") for line in lines[1:])}
        n = int(headers["content-length"])
        answers.append((int(lines[0].split()[1]), headers, data[:n]))
        data = data[n:]
    return answers


def test_a_pipelined_flood_is_answered_up_to_the_queue_and_the_connection_closes(spawn_broker, db):
    """uvicorn parsed every request of a chunk and queued each: 256 KB of tiny pipelined
    requests held 5 MB on one connection (50 connections: a quarter of a GB), whatever the
    budget said. The requests queued behind the one being served are now at most 32: those
    are answered, in order, the last with Connection: close, and the client sends the rest
    again on a new connection (RFC 9112 9.3.2), as nginx's keepalive_requests makes it."""
    b = spawn_broker()
    with b.client() as c:
        assert c.post("/api/v1/timers", json={"operations": [op("schedule", "k0")]}).status_code == 200
    one = b"DELETE /api/v1/timers/reminders/k0 HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection(("127.0.0.1", b.port), timeout=30) as sock:
        sock.sendall(one * 1000)
        answers = read_answers(sock)
    assert len(answers) == 1 + PIPELINED
    assert [json.loads(body)["status"] for _, _, body in answers] == ["cancelled"] + ["absent"] * PIPELINED
    assert all(status == 200 for status, _, _ in answers)
    assert answers[-1][1].get("connection") == "close"
    assert all("connection" not in headers for _, headers, _ in answers[:-1])

    # the memory it may hold: 50 connections each sending a megabyte of tiny requests, unread
    pid = b.proc.pid

    def rss_mb() -> float:
        text = open(f"/proc/{pid}/status").read()
        return int(re.search(r"VmRSS:\s+(\d+)", text).group(1)) / 1024

    before = rss_mb()
    tiny = b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n" * ((1 << 20) // 31)
    socks = []
    try:
        for _ in range(50):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", b.port))
            sock.setblocking(False)
            try:
                sock.send(tiny)
            except BlockingIOError:
                pass
            socks.append(sock)
        time.sleep(2)
        grown = rss_mb() - before
        assert grown < 60, f"{grown:.0f} MB for 50 pipelining connections"
    finally:
        for sock in socks:
            sock.close()
    with b.client() as c:
        assert c.get("/health").status_code == 200
    assert "Traceback" not in b.log_path.read_text()


def test_requests_the_parser_refuses_are_answered_in_json_and_log_nothing(spawn_broker, db):
    # uvicorn logged "Invalid HTTP request received." for each: one connection a line
    b = spawn_broker()
    logged = b.log_path.stat().st_size
    for garbage in (b"GARBAGE\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n", b"GET /\x00 HTTP/1.1\r\n\r\n") * 40:
        with socket.create_connection(("127.0.0.1", b.port), timeout=10) as sock:
            sock.sendall(garbage)
            status, _, text = read_response(sock)
            assert status == 400 and json.loads(text)["error"] == "timers_bad_request", (garbage, text)
    assert b.log_path.stat().st_size == logged, b.log_path.read_text()[logged:]
    with b.client() as c:
        assert c.get("/health").status_code == 200


def test_requests_asking_for_a_websocket_are_served_as_http_and_log_nothing_each(spawn_broker, db):
    # uvicorn logged two warnings (183 bytes) for each, with or without a credential
    b = spawn_broker()
    logged = b.log_path.stat().st_size
    with socket.create_connection(("127.0.0.1", b.port), timeout=10) as sock:
        for _ in range(200):
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
                         b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
            status, _, text = read_response(sock)
            assert status == 200 and json.loads(text)["status"] == "healthy"
    assert b.log_path.stat().st_size - logged < 400, b.log_path.read_text()[logged:]


# ---------------------------------------------------------------------------
# the open-files limit: the connection limit is one the process can keep
# ---------------------------------------------------------------------------

def open_files_limit(soft: int, hard: int | None = None):
    def apply():
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, resource.getrlimit(resource.RLIMIT_NOFILE)[1]
                                                    if hard is None else hard))
    return apply


def hold_silent(port: int, n: int) -> list[socket.socket]:
    held = []
    for _ in range(n):
        sock = socket.socket()
        sock.setblocking(False)
        try:
            sock.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        held.append(sock)
    return held


def test_past_a_low_open_files_limit_a_flood_of_silent_sockets_still_cannot_lock_others_out(spawn_broker, db):
    # before: with QUEEN_MAX_CONNECTIONS over what RLIMIT_NOFILE allows, the flood ran the process out
    # of file descriptors before the limit was reached, and every other client's connection was dropped
    # with no answer at all (httpx: RemoteProtocolError)
    b = spawn_broker(preexec_fn=open_files_limit(200, 200))  # QUEEN_MAX_CONNECTIONS 1000 by default
    assert "serving at most 116 connections" in b.log()  # 200 - 64 - 2 x QUEEN_POOL_MAX
    held = hold_silent(b.port, 400)
    try:
        time.sleep(0.5)
        for _ in range(10):
            r = httpx.get(f"{b.url}{PATH}", timeout=10)
            assert r.status_code == 200, r.text
        assert len(os.listdir(f"/proc/{b.proc.pid}/fd")) <= 200
    finally:
        for sock in held:
            sock.close()


def test_a_soft_open_files_limit_below_the_connection_limit_is_raised(spawn_broker, db):
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    need = 300 + 64 + 20
    assert hard == resource.RLIM_INFINITY or hard >= need, "this machine's hard limit is below the test's need"
    b = spawn_broker(preexec_fn=open_files_limit(100), QUEEN_MAX_CONNECTIONS="300")
    limits = open(f"/proc/{b.proc.pid}/limits").read()
    soft = int(re.search(r"^Max open files\s+(\d+)", limits, re.M).group(1))
    assert soft == need and "serving at most" not in b.log()
    held = hold_silent(b.port, 500)
    try:
        time.sleep(0.5)
        for _ in range(10):
            assert httpx.get(f"{b.url}{PATH}", timeout=10).status_code == 200
    finally:
        for sock in held:
            sock.close()


# ---------------------------------------------------------------------------
# the request pool: one tenant's slow statements cannot hold it from another
# ---------------------------------------------------------------------------

def test_one_tenant_whose_statements_wait_holds_at_most_half_the_pool(spawn_broker, db, database_url):
    # psycopg_pool's queue is one line: acme's two DELETEs, each waiting on a row lock, held both
    # connections, and globex's request waited out QUEEN_POOL_TIMEOUT_MS behind them (503)
    b = spawn_broker(QUEEN_AUTH="jwt", QUEEN_JWT_SECRET=JWT_SECRET, QUEEN_POOL_MAX="2",
                     QUEEN_POOL_TIMEOUT_MS="5000")  # a tenant's share: 1 connection
    acme, globex = token("read-write", tenant="acme"), token("read-write", tenant="globex")
    with b.client() as c:
        r = c.post("/api/v1/timers", headers=acme, json={"operations": [op("schedule", "a1"), op("schedule", "a2")]})
        assert r.status_code == 200, r.text
        with ThreadPoolExecutor(2) as pool:
            with held(database_url, db, "a1", "a2") as wait_for_delete:
                waiting = [pool.submit(c.delete, f"{PATH}/{k}", headers=acme) for k in ("a1", "a2")]
                wait_for_delete()
                time.sleep(0.3)
                assert lock_waiters(db) == 1  # acme's second DELETE waits for its share, not in the pool
                started = time.monotonic()
                r = c.get(PATH, headers=globex)
                assert r.status_code == 200 and r.json()["rows"] == [], r.text
                assert time.monotonic() - started < 2.5  # not behind acme's DELETEs
            assert [f.result().json()["status"] for f in waiting] == ["cancelled", "cancelled"]


def test_a_request_that_waits_out_its_tenants_share_of_the_pool_is_a_json_503(spawn_broker, db, database_url):
    b = spawn_broker(QUEEN_AUTH="jwt", QUEEN_JWT_SECRET=JWT_SECRET, QUEEN_POOL_MAX="2",
                     QUEEN_POOL_TIMEOUT_MS="500")
    acme, globex = token("read-write", tenant="acme"), token("read-write", tenant="globex")
    with b.client() as c:
        assert c.post("/api/v1/timers", headers=acme, json={"operations": [op("schedule", "a1")]}).status_code == 200
        with ThreadPoolExecutor(1) as pool:
            with held(database_url, db, "a1") as wait_for_delete:
                waiting = pool.submit(c.delete, f"{PATH}/a1", headers=acme)
                wait_for_delete()
                r = c.get(PATH, headers=acme)  # acme's share (1) is held: it waits 500 ms, then 503
                assert_json_error(r, 503, "timers_unavailable")  # as when the pool itself has none
                assert r.headers["retry-after"] == "1"
                assert c.get(PATH, headers=globex).status_code == 200
            assert waiting.result().json()["status"] == "cancelled"
        assert c.get(PATH, headers=acme).status_code == 200  # its share is back
