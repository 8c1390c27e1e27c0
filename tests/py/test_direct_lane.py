"""server.py's direct lane: a DELETE on the timer key route served without uvicorn's
request cycle must answer byte for byte as uvicorn's path does, keep the connection's
HTTP/1.1 state (keep-alive, pipelining, a graceful shutdown), and leave anything
unusual to uvicorn.

Real brokers over real sockets. The same DELETE with an empty chunked body takes
uvicorn's path (the lane takes no request with a body), so each case is asked both
ways on one broker; queen_timers_http_direct_requests_total tells which way it went.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import psycopg
import pytest

from timers_util import JWT_SECRET, op, post, token


def direct_count(broker) -> float:
    text = httpx.get(f"{broker.url}/metrics/prometheus", timeout=10).text
    return float(re.search(r"^queen_timers_http_direct_requests_total (\S+)$", text, re.M).group(1))


def raw(broker, request: bytes) -> tuple[bytes, dict, bytes]:
    """One request on its own connection: (status line, headers without date, body)."""
    with socket.create_connection(("127.0.0.1", broker.port), timeout=20) as sock:
        sock.sendall(request)
        sock.settimeout(20)
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        headers = dict(line.split(b": ", 1) for line in lines[1:])
        while len(body) < int(headers[b"content-length"]):
            body += sock.recv(65536)
    headers.pop(b"date")
    return lines[0], headers, body


class Responses:
    """The answers on one connection, in order, however the bytes arrive."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buf = sock, b""
        sock.settimeout(30)

    def _more(self) -> None:
        chunk = self.sock.recv(65536)
        assert chunk, "the broker closed the connection"
        self.buf += chunk

    def next(self) -> tuple[int, dict, dict]:
        while b"\r\n\r\n" not in self.buf:
            self._more()
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        length = int(headers["content-length"])
        while len(self.buf) < length:
            self._more()
        body, self.buf = self.buf[:length], self.buf[length:]
        return int(lines[0].split()[1]), headers, json.loads(body)


def delete(path: str, extra: str = "", *, chunked: bool) -> bytes:
    if chunked:
        return (f"DELETE {path} HTTP/1.1\r\nHost: t\r\n{extra}Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n").encode()
    return f"DELETE {path} HTTP/1.1\r\nHost: t\r\n{extra}\r\n".encode()


CASES = [
    ("/api/v1/timers/reminders/k1", "", "cancelled"),
    ("/api/v1/timers/reminders/k1?txn=order-9", "", "cancelled"),
    ("/api/v1/timers/reminders/a%2Fb/c", "", "cancelled"),          # the key `a/b/c`
    ("/api/v1/timers/reminders/never-scheduled", "", "absent"),
    ("/api/v1/timers/reminders/", "", 400),                          # no timerKey
    ("/api/v1/timers/reminders/%ff", "", 400),                       # not UTF-8
    ("/api/v1/timers/reminders/k1?txn=" + "x" * 300, "", 400),       # txn past its cap
    ("/api/v1/timers/" + "q" * 300 + "/k", "", 400),                 # queue past its cap
]


@pytest.mark.parametrize("path,extra,expected", CASES)
def test_the_lane_answers_byte_for_byte_as_uvicorns_path(broker, client, db, path, extra, expected):
    answers = []
    for chunked in (False, True):
        if expected == "cancelled":
            key = "a/b/c" if "a%2Fb" in path else "k1"
            assert post(client, op("schedule", key)).status_code == 200
        before = direct_count(broker)
        answers.append(raw(broker, delete(path, extra, chunked=chunked)))
        assert direct_count(broker) - before == (0 if chunked else 1)
    lane, uvicorn = answers
    assert lane == uvicorn
    status, headers, body = lane
    if isinstance(expected, int):
        assert status.startswith(b"HTTP/1.1 %d " % expected) and b'"timers_bad_request"' in body
    else:
        assert status == b"HTTP/1.1 200 OK" and b'"status":"%s"' % expected.encode() in body
    assert headers[b"content-type"] == b"application/json"


def test_the_lane_answers_a_bad_token_and_a_read_only_role_as_uvicorns_path(broker_factory):
    b = broker_factory(QUEEN_AUTH="jwt", QUEEN_JWT_SECRET=JWT_SECRET)
    for extra, slug in (("Authorization: Bearer not-a-jwt\r\n", b"unauthorized"),
                        ("", b"unauthorized"),
                        (f"Authorization: {token('read-only')['Authorization']}\r\n", b"forbidden")):
        lane = raw(b, delete("/api/v1/timers/q/k", extra, chunked=False))
        assert lane == raw(b, delete("/api/v1/timers/q/k", extra, chunked=True))
        assert b'"error":"%s"' % slug in lane[2], lane


def test_two_tenants_on_the_lane_cancel_only_their_own_timer(broker_factory, db):
    b = broker_factory(QUEEN_AUTH="jwt", QUEEN_JWT_SECRET=JWT_SECRET)
    acme, globex = token("read-write", tenant="acme"), token("read-write", tenant="globex")
    with b.client() as c:
        for who in (acme, globex):
            assert post(c, op("schedule", "shared"), headers=who).status_code == 200
    before = direct_count(b)
    first = raw(b, delete("/api/v1/timers/reminders/shared", f"Authorization: {acme['Authorization']}\r\n",
                          chunked=False))
    again = raw(b, delete("/api/v1/timers/reminders/shared", f"Authorization: {acme['Authorization']}\r\n",
                          chunked=False))
    assert direct_count(b) - before == 2
    assert b'"status":"cancelled"' in first[2] and b'"status":"absent"' in again[2]
    left = db.execute("SELECT tenant FROM queen.timers WHERE timer_key = 'shared'").fetchall()
    assert [r["tenant"] for r in left] == ["globex"]


def test_keep_alive_and_pipelined_requests_are_answered_in_order_on_one_connection(broker, client):
    for i in range(3):
        assert post(client, op("schedule", f"p{i}")).status_code == 200
    before = direct_count(broker)
    with socket.create_connection(("127.0.0.1", broker.port), timeout=20) as sock:
        answers = Responses(sock)
        # one after another on a kept-alive connection, then three in one segment
        for i in range(3):
            sock.sendall(delete(f"/api/v1/timers/reminders/p{i}", chunked=False))
            status, _, body = answers.next()
            assert (status, body["status"]) == (200, "cancelled")
        sock.sendall(b"".join([delete("/api/v1/timers/reminders/p0", chunked=False),
                               b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n",
                               delete("/api/v1/timers/reminders/p1", chunked=False)]))
        answers = [answers.next() for _ in range(3)]
    assert [(s, b.get("status")) for s, _, b in answers] == [(200, "absent"), (200, "healthy"), (200, "absent")]
    # the pipelined DELETE behind the GET waited for it on uvicorn's queue: one lane request fewer
    assert direct_count(broker) - before in (4, 5)


def lock_waiters(db) -> int:
    """DELETEs (cancel_timer) waiting in PostgreSQL on a row lock."""
    return db.execute("SELECT count(*) AS n FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                      "AND query LIKE '%%cancel_timer%%'").fetchone()["n"]


@contextlib.contextmanager
def held(database_url: str, db, *keys: str):
    """The timers' rows locked by another transaction: a DELETE of one waits in PostgreSQL
    until the block ends. Yields a function that waits until such a DELETE is waiting."""
    with psycopg.connect(database_url) as lock:
        lock.execute("SELECT 1 FROM queen.timers WHERE timer_key = ANY(%s) FOR UPDATE", (list(keys),))

        def wait_for_delete() -> None:
            deadline = time.monotonic() + 20
            while not lock_waiters(db):
                assert time.monotonic() < deadline, "the DELETE never reached PostgreSQL"
                time.sleep(0.02)

        yield wait_for_delete
        lock.rollback()


def test_a_client_gone_before_its_answer_leaves_the_broker_serving(broker, client, db, database_url):
    assert post(client, op("schedule", "gone")).status_code == 200
    logged = len(broker.log_path.read_text())
    with held(database_url, db, "gone") as wait_for_delete:
        sock = socket.create_connection(("127.0.0.1", broker.port), timeout=20)
        sock.sendall(delete("/api/v1/timers/reminders/gone", chunked=False))
        wait_for_delete()
        # gone with a reset while PostgreSQL is still deciding
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sock.close()
        time.sleep(0.2)
    # the cancel still ran, once (PostgreSQL's verdict does not depend on the client staying)
    deadline = time.monotonic() + 10
    while db.execute("SELECT count(*) AS n FROM queen.timers WHERE timer_key = 'gone'").fetchone()["n"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert client.delete("/api/v1/timers/reminders/gone").json()["status"] == "absent"
    assert "Traceback" not in broker.log_path.read_text()[logged:]


def delete_held_through_sigterm(b, db, database_url, *, chunked: bool = False, held_s: float = 0.5):
    """The answer (status, headers, body) to a DELETE of timer `held` that waits on the row's
    lock while the broker gets SIGTERM; the lock is kept `held_s` seconds after the signal, the
    broker still up and nothing answered meanwhile (test_shutdown uses it too)."""
    with b.client() as c:
        assert post(c, op("schedule", "held")).status_code == 200
    answer: list = []
    sock = socket.create_connection(("127.0.0.1", b.port), timeout=30)
    reader = threading.Thread(target=lambda: answer.append(Responses(sock).next()))
    try:
        with held(database_url, db, "held") as wait_for_delete:
            sock.sendall(delete("/api/v1/timers/reminders/held", chunked=chunked))
            reader.start()
            wait_for_delete()
            b.proc.send_signal(signal.SIGTERM)
            time.sleep(held_s)
            assert b.proc.poll() is None and not answer  # uvicorn waits for the request in flight
        reader.join(30)
        return answer[0]
    finally:
        sock.close()


def test_a_graceful_shutdown_answers_the_delete_in_flight_and_closes(spawn_broker, db, database_url):
    b = spawn_broker()
    status, headers, body = delete_held_through_sigterm(b, db, database_url)
    assert (status, body["status"]) == (200, "cancelled")
    assert headers.get("connection") == "close"
    # uvicorn re-raises the signal once it has shut down: the exit of a graceful stop
    assert b.proc.wait(timeout=30) == -signal.SIGTERM
    assert "Traceback" not in b.log_path.read_text()


def on_one_connection(database_url, body) -> dict:
    """`await body(pool, slots, app)` on a pool of one connection (tenant t1's share of it)
    and a RequestSlots, `app` being what a request's scope names; its dict, with the pool's
    connections and shares at the end."""
    from types import SimpleNamespace

    from queen_timers import db as qdb
    from queen_timers.bodies import RequestSlots
    from queen_timers.config import Settings

    async def go():
        pool = qdb.make_pool(Settings(database_url=database_url, broker_id="lane", pool_min=1, pool_max=1))
        await pool.open(wait=True)
        try:
            slots = RequestSlots(per_tenant=4)
            out = await body(pool, slots, SimpleNamespace(state=SimpleNamespace(request_slots=slots, body_budget=None)))
            out["pool"] = (len(pool._pool), dict(pool._by_tenant))
            return out
        finally:
            await pool.close()

    return asyncio.run(go())


async def pool_whole_again(pool) -> None:
    """Until the pool holds one open connection (it replaces a closed one)."""
    for _ in range(50):
        if len(pool._pool) == 1 and not pool._pool[0].closed:
            return
        await asyncio.sleep(0.1)


def test_a_delete_whose_task_is_cancelled_before_it_begins_gives_back_what_it_took(database_url):
    """The lane sends the DELETE's statement before it builds the task (cancel_start); a task
    cancelled before its first step (a stop) never runs its finally, so its done callback
    gives back the request slot and the connection, which the pool replaces."""
    from queen_timers import db as qdb
    from queen_timers.routes_timers import CancelStart
    from queen_timers.server import DirectCycle, JsonErrorHttpToolsProtocol

    async def body(pool, slots, app):
        out = {}
        for began in (False, True):
            scope = {"app": app}
            slots.take(scope, "t1")
            call = qdb.Call.start(pool, "t1", qdb.Statement("SELECT pg_sleep(%(s)s::float8)"), {"s": 0.2})
            started = CancelStart({"tenant": "t1", "queue": "q", "timer_key": "k"}, None, call)
            cycle = DirectCycle(keep_alive=True)
            cycle.began = began
            task = asyncio.get_running_loop().create_future()
            task.cancel()
            protocol = SimpleNamespace(tasks={task})
            JsonErrorHttpToolsProtocol._direct_done(protocol, task, cycle, scope, started)
            out[began] = (protocol.tasks, slots.in_use, call.conn.closed, call.open)
            if began:  # its own finally gives back what it holds
                await call.row()
                slots.release(scope)
            await pool_whole_again(pool)
        return out

    out = on_one_connection(database_url, body)
    assert out[False] == (set(), 0, True, False)  # the slot and the call given back, its connection closed
    assert out[True] == (set(), 1, False, True)  # begun: nothing done for it here
    assert out["pool"] == (1, {})


def test_a_delete_waits_for_its_row_without_a_task_and_leaves_the_rest_to_one(database_url):
    """server.DirectWait: the lane's DELETE waits for its result on the database socket's
    reader callback. A row ends it there (the 200 written, the connection and the slot
    given back, no task made); an error goes on in _serve_direct's task with the result
    already read; a stop that cancels it answers the 503 of an unknown outcome, gives back the
    slot and closes the connection."""
    from queen_timers import db as qdb
    from queen_timers.routes_timers import CancelStart, cancel_body
    from queen_timers.server import DirectCycle, DirectWait

    cases = {"row": (qdb.Statement("SELECT 'cancelled'::text WHERE pg_sleep(%(s)s::float8) IS NOT NULL"), 0.1),
             "error": (qdb.Statement("SELECT 1 / (%(s)s::float8 * 0)::int"), 0.1),
             "cancel": (qdb.Statement("SELECT pg_sleep(%(s)s::float8)::text"), 5)}

    async def body(pool, slots, app):
        out = {}
        for case, (statement, seconds) in cases.items():
            # prepared by a first call: the lane waits on the socket for a prepared statement only
            first = qdb.Call.start(pool, "t1", statement, {"s": 0})
            if case == "error":
                with pytest.raises(psycopg.errors.DivisionByZero):
                    await first.row()
            else:
                await first.row()
            written, by_task = [], []
            proto = SimpleNamespace(tasks=set(), loop=asyncio.get_running_loop(),
                                    _write_direct=lambda *a: written.append(a[1:]),
                                    _serve_by_task=lambda *a: by_task.append(a[4]))
            scope = {"app": app}
            slots.take(scope, "t1")
            call = qdb.Call.start(pool, "t1", statement, {"s": seconds})
            started = CancelStart({"tenant": "t1", "queue": "q", "timer_key": "k"}, "x", call)
            fd = call.waitable()
            assert fd is not None, case
            wait = DirectWait(proto, DirectCycle(keep_alive=True), ("endpoint", {}), scope, started, cancel_body, fd)
            assert proto.tasks == {wait} and not wait.done()
            if case == "cancel":
                await asyncio.sleep(0.2)
                assert wait.cancel(msg="a stop") and wait.done()
                assert proto.tasks == {wait}  # removed on the loop's next turn, as a task is
            for _ in range(100):
                if wait.done() and not proto.tasks:
                    break
                await asyncio.sleep(0.02)
            out[case] = (wait.done(), proto.tasks, slots.in_use, written,
                         [s is started for s in by_task], call.open, call.conn.closed)
            if by_task:  # the task's row() ends it, from the result read
                with pytest.raises(psycopg.errors.DivisionByZero):
                    await call.row()
                slots.release(scope)
            await pool_whole_again(pool)
        return out

    out = on_one_connection(database_url, body)
    answer = b'{"ok":true,"status":"cancelled","queue":"q","timerKey":"k","txn":"x"}'
    headers = [(b"content-length", b"%d" % len(answer)), (b"content-type", b"application/json")]
    assert out["row"] == (True, set(), 0, [(200, headers, answer)], [], False, False)
    assert out["error"][:6] == (True, set(), 1, [], [True], True)  # the task's now, the slot still held
    # a stop's cancel: the JSON 503 of an unknown outcome written (errors.STOPPED_BODY), the
    # connection closed, never pooled
    from queen_timers.errors import STOPPED_BODY, STOPPED_HEADERS
    assert out["cancel"] == (True, set(), 0, [(503, STOPPED_HEADERS, STOPPED_BODY)], [], False, True)
    assert out["pool"] == (1, {})
