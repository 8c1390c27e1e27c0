"""What a client can make the HTTP layer do past a request's head, with no credential needed:
a trailer or chunk line that never ends, a body that keeps coming after its answer, a long poll
it leaves. Each was found by an audit (uvicorn and llhttp as they are) and each
is bounded here; the numbers in the comments are the audit's, on the code before."""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.parse

import pytest

from test_input_limits import read_response
from timers_util import assert_error


def rss_mb(pid: int) -> float:
    return int(re.search(r"VmRSS:\s+(\d+)", open(f"/proc/{pid}/status").read()).group(1)) / 1024


def send_for(sock: socket.socket, piece: bytes, seconds: float, most: int) -> int:
    """Send `piece` again and again for `seconds` or `most` bytes; the bytes sent before the
    broker closed the connection (or the time ran out)."""
    sock.setblocking(False)
    sent, end = 0, time.monotonic() + seconds
    while time.monotonic() < end and sent < most:
        try:
            sent += sock.send(piece)
        except BlockingIOError:
            time.sleep(0.002)
        except (BrokenPipeError, ConnectionResetError):
            break
    sock.setblocking(True)
    return sent


def answers_then_eof(sock: socket.socket, seconds: float = 10) -> bytes:
    sock.settimeout(seconds)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def status_line_and_body(data: bytes) -> tuple[bytes, bytes]:
    """The first answer's status line and what follows its head."""
    return data.partition(b"\r\n")[0], data.partition(b"\r\n\r\n")[2]


@pytest.mark.parametrize("path", ["/nope", "/api/v1/timers"])
def test_a_trailer_that_never_ends_is_refused(spawn_broker, db, path):
    # before: 120 MB sent in 15 s took the broker from 92 to 311 MB at a full core
    # (llhttp rebuilds the unfinished value), whatever the route answered
    b = spawn_broker()
    before = rss_mb(b.proc.pid)
    with socket.create_connection(("127.0.0.1", b.port), timeout=10) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     "Transfer-Encoding: chunked\r\n\r\n".encode() +
                     (b"2\r\n{}\r\n" if path != "/nope" else b"") + b"0\r\nX-T: ")
        sent = send_for(sock, b"a" * 65536, 10, 64 << 20)
        assert sent < 8 << 20, f"{sent} bytes of one trailer taken"
        data = answers_then_eof(sock)
    assert rss_mb(b.proc.pid) - before < 30
    head = data.split(b"\r\n", 1)[0]
    if path == "/nope":  # answered before its body and closed while the body still came (404), or,
        # when 16 KiB of the trailer came in the head's read, refused for it before the route ran
        assert head.startswith((b"HTTP/1.1 404", b"HTTP/1.1 400")), head
    else:  # read its body: the endless trailer is the request's error
        assert head.startswith(b"HTTP/1.1 400")
        assert json.loads(data.partition(b"\r\n\r\n")[2])["error"] == "timers_bad_request"
    with b.client() as c:
        assert c.get("/health").status_code == 200
    assert "Traceback" not in b.log_path.read_text()


@pytest.mark.parametrize("framing", ["content-length", "chunks of one byte"])
def test_a_body_that_keeps_coming_after_its_answer_is_cut_off(spawn_broker, db, framing):
    # before: read and dropped for as long as it came, 1 GB/s at a full core, or with
    # one-byte chunks 50 ms of CPU per MB and the loop held 0.9-1.8 s at a time
    b = spawn_broker()
    if framing == "content-length":
        head, piece = b"Content-Length: 1000000000000\r\n", b"x" * 65536
    else:
        head, piece = b"Transfer-Encoding: chunked\r\n", b"1\r\n \r\n" * 10000
    with socket.create_connection(("127.0.0.1", b.port), timeout=10) as sock:
        sock.sendall(b"POST /nope HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n")
        start = time.monotonic()
        sent = send_for(sock, piece, 15, 512 << 20)
        took = time.monotonic() - start
        data = answers_then_eof(sock)
    assert took < 8, f"the broker took the body for {took:.1f} s ({sent} bytes)"
    status, text = status_line_and_body(data)
    assert status.startswith(b"HTTP/1.1 404") and json.loads(text)["error"] == "not_found"
    with b.client() as c:
        assert c.get("/health").status_code == 200


def test_a_body_that_ends_soon_after_its_answer_keeps_the_connection(spawn_broker, db):
    b = spawn_broker()
    with socket.create_connection(("127.0.0.1", b.port), timeout=10) as sock:
        sock.sendall(b"POST /nope HTTP/1.1\r\nHost: x\r\nContent-Length: 20000\r\n\r\n" + b"x" * 100)
        status, _, _ = read_response(sock)
        assert status == 404
        sock.sendall(b"x" * 19900)  # the rest of it, within the linger
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, text = read_response(sock)
        assert status == 200 and json.loads(text)["status"] == "healthy"


def test_a_long_poll_its_client_left_consumes_nothing(spawn_broker, db):
    # before: the poll went on for its whole timeout and, with autoAck, consumed a message
    # pushed after the client had gone: lost
    b = spawn_broker()
    with b.client() as c:
        assert c.post("/api/v1/configure", json={"queue": "zq"}).status_code == 200
    with socket.create_connection(("127.0.0.1", b.port), timeout=10) as sock:
        sock.sendall(b"GET /api/v1/pop/queue/zq?wait=true&timeout=20000&autoAck=true HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.5)
    time.sleep(1.0)  # the broker has seen the client go
    with b.client() as c:
        r = c.post("/api/v1/push", json={"items": [{"queue": "zq", "transactionId": "kept", "payload": {"n": 1}}]})
        assert r.status_code == 201, r.text
        time.sleep(1.5)  # a zombie poll would have taken it by now (it polls every 0.5 s at most)
        r = c.get("/api/v1/pop/queue/zq", params={"autoAck": "true"})
        assert r.status_code == 200 and [m["transactionId"] for m in r.json()["messages"]] == ["kept"]


@pytest.mark.parametrize("where", ["head", "trailers"])
def test_more_than_100_header_fields_are_refused(spawn_broker, db, where):
    # before: 3,000 empty headers fit in 16 KiB and cost 2-3 ms of CPU for their 401
    b = spawn_broker()
    many = b"".join(b"X-%d:\r\n" % i for i in range(101))
    with socket.create_connection(("127.0.0.1", b.port), timeout=10) as sock:
        if where == "head":
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n")
        else:
            body = b'{"queue": "tq"}'  # a valid configure: 200 without the trailers
            sock.sendall(b"POST /api/v1/configure HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n" % (len(body), body)
                         + many + b"\r\n")
        status, _, text = read_response(sock)
    assert status == 400 and json.loads(text)["error"] == "timers_bad_request", text
    with socket.create_connection(("127.0.0.1", b.port), timeout=10) as sock:  # 100 are fine
        sock.sendall(b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d:\r\n" % i for i in range(99)) +
                     b"Host: x\r\n\r\n")
        status, _, _ = read_response(sock)
    assert status == 200


# A query string percent-decodes to UTF-8 or it is refused. Starlette put U+FFFD in the place of
# bytes that are not UTF-8 (as a path is refused, convertors.decode_segment): `?txn=%FF` echoed
# another txn, `?after=%FF` paged from another cursor, `?consumerGroup=%FF` popped for a group
# nobody named. A well-encoded U+FFFD is an ordinary character and passes.

def test_a_query_string_that_is_not_utf8_is_a_json_400_and_changes_nothing(client, db):
    from test_input_limits import assert_json_error
    from test_log_api import pop, push
    from timers_util import op, post

    assert post(client, op("schedule", "k1", queue="q"), op("schedule", "k2", queue="q")).status_code == 200
    push(client, {"queue": "logq", "payload": {"n": 1}})
    refused = [client.delete("/api/v1/timers/q/k1?txn=%FF"),        # the direct lane
               client.delete("/api/v1/timers/q/k1?txn=ok&x=%C3"),   # a name it ignores, cut short
               client.get("/api/v1/timers/q?after=%FF"),
               client.get("/api/v1/timers/q?limit=1&after=a%E2%82"),
               client.get("/api/v1/pop/queue/logq?consumerGroup=%FF&autoAck=true"),
               client.get("/api/v1/dlq?queue=%FF")]
    for r in refused:
        body = assert_json_error(r, 400, "timers_bad_request")
        assert "UTF-8" in body["detail"], body
    assert [r["timer_key"] for r in db.execute("SELECT timer_key FROM queen.timers ORDER BY 1")] == ["k1", "k2"]
    assert [m["data"] for m in pop(client, "logq", autoAck="true")["messages"]] == [{"n": 1}]  # none taken

    r = client.delete("/api/v1/timers/q/k1?txn=%EF%BF%BD")  # U+FFFD itself, well encoded
    assert r.status_code == 200 and r.json()["status"] == "cancelled" and r.json()["txn"] == "\ufffd", r.text
    r = client.get("/api/v1/timers/q?after=k1")
    assert r.status_code == 200 and [t["timerKey"] for t in r.json()["rows"]] == ["k2"], r.text


# int() takes more than integers: "0_2", " 2 ", "+2" and other scripts' digits were read as 2
NOT_INTEGERS = ["0_2", " 2 ", "+2", "\u0662", "\uff12", "2.0", "0x2", "2\n"]


@pytest.mark.parametrize("path, name", [
    ("/api/v1/timers/reminders", "limit"), ("/api/v1/dlq?queue=q", "limit"),
    ("/api/v1/system/timers/stats", "buckets"), ("/api/v1/pop/queue/q", "batch")])
def test_an_integer_query_parameter_is_ascii_digits_only(client, db, path, name):
    sep = "&" if "?" in path else "?"
    for raw in NOT_INTEGERS:
        r = client.get(f"{path}{sep}{name}={urllib.parse.quote(raw)}")
        answer = assert_error(r, 400, "timers_bad_request")
        assert answer["detail"] == f"query parameter {name} must be an integer", (raw, answer)
    for raw in ("2", "0002"):
        assert client.get(f"{path}{sep}{name}={raw}").status_code in (200, 204), raw


@pytest.mark.parametrize("first", ["the head", "the head and a chunk"])
def test_a_chunk_extension_that_never_ends_is_refused_in_the_read_of_the_head(spawn_broker, db, first):
    """A chunk line that never ends is refused once 16 KiB of it have come, even when it
    comes in the same read as the head (and a first chunk): the bytes after a read's last
    parser callback were not counted, and such a request waited for its body timeout."""
    b = spawn_broker()
    head = (b"POST /api/v1/push HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + (b"2\r\n{}\r\n" if first != "the head" else b""))
    with socket.create_connection(("127.0.0.1", b.port), timeout=10) as sock:
        start = time.monotonic()
        sock.sendall(head + b"1;" + b"a" * 30000)
        data = answers_then_eof(sock, seconds=10)
        took = time.monotonic() - start
    assert took < 5, f"answered after {took:.1f} s"
    status, text = status_line_and_body(data)
    assert status.startswith(b"HTTP/1.1 400") and json.loads(text)["error"] == "timers_bad_request", data[:300]
    with b.client() as c:
        assert c.get("/health").status_code == 200
