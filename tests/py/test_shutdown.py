"""A broker asked to stop (SIGTERM: systemd, Kubernetes, make run's Ctrl-C) stops within
QUEEN_SHUTDOWN_TIMEOUT_MS whatever its clients hold, answers a long-poll pop at once
instead of keeping it up to its minute, and fires what falls due while it drains."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import pytest

from sweeper_support import schedule, timer, wait_until
from test_direct_lane import delete_held_through_sigterm


def _exit_within(proc, seconds: float) -> float:
    """How long the broker took to exit after now; fails past `seconds`."""
    start = time.monotonic()
    proc.wait(timeout=seconds)
    return time.monotonic() - start


def test_a_long_poll_pop_is_answered_at_once_when_the_broker_stops(spawn_broker, db):
    b = spawn_broker()
    with b.client() as c:
        assert c.post("/api/v1/configure", json={"queue": "idle"}).status_code == 200
    answers: list = []

    def long_poll():
        with httpx.Client(base_url=b.url, timeout=90) as c:
            started = time.monotonic()
            r = c.get("/api/v1/pop/queue/idle", params={"wait": "true", "timeout": "60000"})
            answers.append((r.status_code, r.headers.get("connection"), time.monotonic() - started))

    poller = threading.Thread(target=long_poll)
    poller.start()
    time.sleep(1.0)  # the pop is waiting on its empty queue
    assert not answers
    b.proc.send_signal(signal.SIGTERM)
    poller.join(10)
    assert answers, "the long poll was still held 10 s after SIGTERM"
    status, connection, waited = answers[0]
    assert status == 204 and connection == "close"
    assert waited < 5, waited
    assert _exit_within(b.proc, 15) < 15
    assert b.proc.returncode == -signal.SIGTERM
    assert "Traceback" not in b.log_path.read_text()


def test_a_stop_is_bounded_by_the_shutdown_timeout_and_the_fire_goes_on_meanwhile(spawn_broker, db):
    b = spawn_broker(QUEEN_SHUTDOWN_TIMEOUT_MS="4000", QUEEN_SWEEPER_MAX_SLEEP_MS="200")
    # a client that sends a head announcing a body and then nothing: its body may take
    # QUEEN_BODY_TIMEOUT_MS (120 s) to come, and a drain waits for the requests in flight
    hold = socket.create_connection(("127.0.0.1", b.port), timeout=30)
    try:
        hold.sendall(b"POST /api/v1/timers HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 100000\r\n\r\n{\"operations\": [")
        time.sleep(0.5)
        schedule(db, [timer("drain", f"d{i}", 1500, b"x") for i in range(20)])
        stopped_at = time.monotonic()
        b.proc.send_signal(signal.SIGTERM)
        # while the held request keeps the broker draining, the sweeper fires what falls due
        wait_until(lambda: db.execute("SELECT count(*) AS n FROM queen.timers WHERE queue = 'drain'")
                   .fetchone()["n"] == 0, 4, message="the fire while the broker drains")
        assert b.proc.poll() is None  # still draining: the held request is in flight
        b.proc.wait(timeout=4 + 10)  # the timeout, then the sweeper's stop and the pools' close
        took = time.monotonic() - stopped_at
        assert 3.5 < took < 14, took
        # the held request was answered in the documented shape: nothing written, retry
        answer = b""
        while chunk := hold.recv(65536):
            answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 "), answer
        assert b"retry-after: 1" in head.lower() and b"connection: close" in head.lower()
        assert json.loads(body)["error"] == "timers_unavailable"
    finally:
        hold.close()
    fired = db.execute("SELECT count(*) AS n FROM queen.messages m JOIN queen.partitions p ON p.id = m.partition_id "
                       "JOIN queen.queues q ON q.id = p.queue_id WHERE q.name = 'drain'").fetchone()["n"]
    assert fired == 20
    assert "Traceback" not in b.log_path.read_text()


@pytest.mark.parametrize("chunked", [False, True])
def test_a_request_in_its_database_call_is_answered_past_the_shutdown_timeout(spawn_broker, db, database_url,
                                                                               chunked):
    """A verdict PostgreSQL is deciding is never answered 503: the cancel may commit, and the
    client must learn it did. Chunked: the DELETE takes uvicorn's path (no direct lane)."""
    b = spawn_broker(QUEEN_SHUTDOWN_TIMEOUT_MS="1000")
    # past the shutdown timeout, the row still locked
    status, headers, body = delete_held_through_sigterm(b, db, database_url, chunked=chunked, held_s=2.5)
    assert (status, body["status"]) == (200, "cancelled")
    assert headers.get("connection") == "close"
    assert _exit_within(b.proc, 15) < 15
    assert "Traceback" not in b.log_path.read_text()


def test_a_client_that_does_not_take_its_answer_is_reset_at_the_shutdown_timeout(spawn_broker, db):
    b = spawn_broker(QUEEN_SHUTDOWN_TIMEOUT_MS="2000")
    with b.client() as c:
        assert c.post("/api/v1/configure", json={"queue": "big"}).status_code == 200
        for i in range(8):  # 8 MB of answer: more than the socket buffers hold
            r = c.post("/api/v1/push", json={"items": [{"queue": "big", "transactionId": f"t{i}",
                                                        "payload": {"blob": "x" * 1_000_000}}]})
            assert r.status_code == 201, r.text
    sock = socket.create_connection(("127.0.0.1", b.port), timeout=30)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        sock.sendall(b"GET /api/v1/pop/queue/big?batch=8 HTTP/1.1\r\nHost: t\r\n\r\n")
        time.sleep(1.0)  # the answer is written and waits in the buffers; the client reads none
        stopped_at = time.monotonic()
        b.proc.send_signal(signal.SIGTERM)
        b.proc.wait(timeout=2 + 10)
        assert 1.5 < time.monotonic() - stopped_at < 12
    finally:
        sock.close()
    assert "Traceback" not in b.log_path.read_text()


@pytest.mark.parametrize("chunked", [False, True])
def test_a_request_whose_database_never_answers_gets_a_json_503_when_the_stop_cancels_it(
        spawn_broker, db, database_url, chunked):
    """A database that holds a request past QUEEN_SHUTDOWN_TIMEOUT_MS + 6 s (a hung server;
    here a row lock and no statement timeout): uvicorn cancels it, and the client gets a JSON
    503 saying the outcome is unknown, not uvicorn's plain 500 (Dec 7 audit)."""
    from test_direct_lane import Responses, delete, held
    from timers_util import op, post
    b = spawn_broker(QUEEN_SHUTDOWN_TIMEOUT_MS="300", QUEEN_STATEMENT_TIMEOUT_MS="0")
    with b.client() as c:
        assert post(c, op("schedule", "hung")).status_code == 200
    answer: list = []
    sock = socket.create_connection(("127.0.0.1", b.port), timeout=30)
    try:
        with held(database_url, db, "hung") as wait_for_delete:
            sock.sendall(delete("/api/v1/timers/reminders/hung", chunked=chunked))
            reader = threading.Thread(target=lambda: answer.append(Responses(sock).next()))
            reader.start()
            wait_for_delete()
            b.proc.send_signal(signal.SIGTERM)
            reader.join(20)  # the lock is held all along: only the stop's cancel ends the wait
            assert answer, "no answer within 20 s"
        status, headers, body = answer[0]
        assert status == 503 and headers["content-type"].startswith("application/json"), answer
        assert body["error"] == "timers_unavailable" and "outcome is unknown" in body["detail"], body
    finally:
        sock.close()
    assert b.proc.wait(timeout=30) is not None
