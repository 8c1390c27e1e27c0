"""The broker's own deadline over a request's database work (db.BrokerPool's watch).

PostgreSQL's statement timeout does not bound a server that is hung but up (its kernel
still acknowledges, so keepalives pass) nor a commit waiting for a synchronous standby.
Both are made real here: a synchronous_standby_names no standby answers to, and the
request connections' server processes stopped with SIGSTOP. Each request must get the
documented JSON 503 by its statement timeout plus QUEEN_DEADLINE_GRACE_MS, and the broker
must serve again once the server does, on new connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time

import httpx
import psycopg
import pytest

from timers_util import assert_error, op, post

TIMEOUTS = {"QUEEN_STATEMENT_TIMEOUT_MS": "400", "QUEEN_DEADLINE_GRACE_MS": "400"}
LATEST_S = 6.0  # the deadline is 0.8 s here: a hang would go on until the server answers


def _timed(fn) -> tuple[httpx.Response, float]:
    began = time.monotonic()
    response = fn()
    return response, time.monotonic() - began


@contextlib.contextmanager
def no_synchronous_standby(admin_dsn: str):
    """Every commit that asks for a synchronous standby waits: none is connected. Released
    (the waiters woken, their commits done) on the way out."""
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute("ALTER SYSTEM SET synchronous_standby_names = 'nobody'")
        admin.execute("SELECT pg_reload_conf()")
        time.sleep(1.0)  # the checkpointer applies it to shared memory on its reload
        try:
            yield
        finally:
            admin.execute("ALTER SYSTEM RESET synchronous_standby_names")
            admin.execute("SELECT pg_reload_conf()")


@contextlib.contextmanager
def _request_backends_stopped(db):
    """The server processes of every request connection of the test's brokers, stopped
    (SIGSTOP: the kernel still acknowledges their sockets), resumed on the way out."""
    pids = [r["pid"] for r in db.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name LIKE 'queen-broker:%'").fetchall()]
    assert pids, "the broker holds no request connection"
    try:
        for pid in pids:
            os.kill(pid, 0)
    except PermissionError:
        pytest.skip("the test server's processes belong to another user (QUEEN_TEST_ADMIN_DSN): "
                    "they cannot be stopped from here")
    try:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def test_a_commit_waiting_for_a_synchronous_standby_answers_503_by_the_deadline(spawn_broker, db, admin_dsn):
    b = spawn_broker(QUEEN_POOL_MAX="4", **TIMEOUTS)
    with b.client(timeout=30) as c:
        assert post(c, op("schedule", "held")).status_code == 200
        assert c.post("/api/v1/configure", json={"queue": "orders"}).status_code == 200
        with no_synchronous_standby(admin_dsn):
            # the three ways a request waits for PostgreSQL: the direct lane (DELETE),
            # fetch_row (POST /api/v1/timers) and psycopg's cursor (a log push)
            for send in (lambda: c.delete("/api/v1/timers/reminders/held"),
                         lambda: post(c, op("schedule", "new")),
                         lambda: c.post("/api/v1/push", json={"items": [{"queue": "orders", "payload": {"n": 1}}]})):
                response, took = _timed(send)
                body = assert_error(response, 503, "timers_unavailable")
                assert body["detail"] == "the database did not answer in time", body
                assert response.headers["retry-after"] == "1"
                assert took < LATEST_S, took
            # nothing waits on the broker's side meanwhile: /health reads (no commit to wait for)
            assert c.get("/health").status_code == 200
            # but no cancel was sent: the three commits still wait on the server (docs/failover.md)
            waiting = db.execute("SELECT count(*) AS n FROM pg_stat_activity WHERE wait_event = 'SyncRep'"
                                 " AND datname = current_database()"
                                 " AND application_name LIKE 'queen-broker:%'").fetchone()["n"]
            assert waiting == 3, waiting
        # the standby requirement lifted, the commits that waited are done (a 503 of a
        # write has an unknown outcome: docs/failover.md), and new requests are served
        deadline = time.monotonic() + 10
        while db.execute("SELECT count(*) AS n FROM queen.timers WHERE timer_key = 'new'").fetchone()["n"] == 0:
            assert time.monotonic() < deadline, "the schedule whose commit waited never completed"
            time.sleep(0.05)
        assert post(c, op("schedule", "after")).json()["results"][0]["status"] == "scheduled"
        assert c.delete("/api/v1/timers/reminders/after").json()["status"] == "cancelled"
    log = b.log()
    # the request pool's three cuts, and no other (the sweeper's sessions are not watched)
    assert log.count("pool queen-requests: a statement had no answer within its deadline") == 3, log
    assert log.count("a statement had no answer within its deadline") == 3, log
    metrics = httpx.get(f"{b.url}/metrics/prometheus", timeout=10).text
    assert "\nqueen_timers_database_deadlines_total 3.0\n" in metrics, metrics
    assert "Traceback" not in log


def test_a_hung_server_answers_503_by_the_deadline_and_the_broker_serves_again(spawn_broker, db):
    # one request connection: the one stopped is the one the request gets
    b = spawn_broker(QUEEN_POOL_MIN="1", QUEEN_POOL_MAX="1", **TIMEOUTS)
    with b.client(timeout=30) as c:
        assert post(c, op("schedule", "held")).status_code == 200
        for send in (lambda: c.get("/api/v1/timers/reminders/held"),  # a read: psycopg's cursor
                     lambda: c.delete("/api/v1/timers/reminders/held")):  # the direct lane
            assert c.get("/api/v1/timers/reminders/held").status_code == 200  # the pool's connection is up
            with _request_backends_stopped(db):
                response, took = _timed(send)
            body = assert_error(response, 503, "timers_unavailable")
            assert body["detail"] == "the database did not answer in time", body
            assert took < LATEST_S, took
        # the stopped processes resumed; the pool replaced the connections it closed
        assert c.get("/api/v1/timers/reminders/held").status_code == 200
        assert c.delete("/api/v1/timers/reminders/held").json()["status"] == "cancelled"
    assert "Traceback" not in b.log()


def test_without_a_statement_timeout_there_is_no_deadline(spawn_broker, db, admin_dsn):
    """QUEEN_STATEMENT_TIMEOUT_MS=0 asks for no bound on a statement: the broker adds none of
    its own either (the request waits for the server, then is answered)."""
    b = spawn_broker(QUEEN_STATEMENT_TIMEOUT_MS="0", QUEEN_DEADLINE_GRACE_MS="100")
    with b.client(timeout=30) as c:
        assert post(c, op("schedule", "held")).status_code == 200
        with _request_backends_stopped(db):
            answer: list = []
            t = threading.Thread(target=lambda: answer.append(c.delete("/api/v1/timers/reminders/held")))
            t.start()
            time.sleep(1.5)  # fifteen times the grace
            assert not answer
        t.join(10)
        assert answer and answer[0].json()["status"] == "cancelled", answer
    assert "had no answer" not in b.log()


def _on_pool(database_url: str, body):
    """`await body(pool)` on a BrokerPool whose budget is 1 s of statement timeout + 0.3 s."""
    from queen_timers import db as qdb
    from queen_timers.config import Settings

    async def go():
        pool = qdb.make_pool(Settings(database_url=database_url, broker_id="deadline", pool_min=1, pool_max=1,
                                      statement_timeout_ms=1000, deadline_grace_ms=300))
        await pool.open(wait=True)
        try:
            return await body(pool), len(pool.watch._cut), pool.get_stats().get("connections_lost", 0)
        finally:
            await pool.close()
    return asyncio.run(go())


def test_the_time_a_lease_spends_before_its_statement_is_not_counted(database_url):
    """The budget counts a statement's silence, not the lease's age: a request that held its
    connection past the budget (its own work, a loop slow to come back to it) before sending
    a statement that needs half the budget still gets its answer."""
    async def body(pool):
        async with pool.connection() as conn:
            await asyncio.sleep(2.0)  # the connection idle in the lease, past its 1.3 s
            cur = await conn.execute("SELECT 1 AS n FROM pg_sleep(0.7)")
            return (await cur.fetchone())["n"]

    assert _on_pool(database_url, body) == (1, 0, 0)


def test_an_answer_the_loop_is_late_to_read_is_not_cut(database_url):
    """A statement answered while the event loop was busy elsewhere for longer than the budget:
    the answer waits in the socket, and the check leaves the connection alone."""
    async def body(pool):
        async with pool.connection() as conn:
            task = asyncio.ensure_future(conn.execute("SELECT 2 AS n"))
            for _ in range(3):
                await asyncio.sleep(0)  # the statement is on the wire, its answer awaited
            time.sleep(1.8)  # the whole loop held (a request's long parse, say)
            return (await (await task).fetchone())["n"]

    assert _on_pool(database_url, body) == (2, 0, 0)
