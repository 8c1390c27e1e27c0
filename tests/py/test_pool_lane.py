"""db.BrokerPool's idle lane (_take_idle, _give_idle): a request that finds a connection
idle and nobody queued takes it, and gives it back, without psycopg_pool's path. These
check that the lane decides as that path would, against a real PostgreSQL: the last one
used serves next and the pool's count is kept; a connection whose server went away while
idle is never served; one returned mid-transaction, or past its lifetime, is not stacked
as it is; a request queued for a connection gets the one given back."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from queen_timers import db
from queen_timers.config import Settings


def pool_for(database_url: str, **kw) -> db.BrokerPool:
    return db.make_pool(Settings(database_url=database_url, broker_id="lane", pool_timeout_ms=5000, **kw))


def run(database_url: str, body, **kw):
    async def go():
        pool = pool_for(database_url, **kw)
        await pool.open(wait=True)
        try:
            return await body(pool)
        finally:
            await pool.close()
    return asyncio.run(go())


async def backend_pid(pool: db.BrokerPool) -> int:
    async with pool.connection() as conn:
        return (await (await conn.execute("SELECT pg_backend_pid() AS p")).fetchone())["p"]


def test_the_connection_used_last_serves_next_and_the_count_is_kept(database_url):
    async def body(pool):
        pids = [await backend_pid(pool) for _ in range(50)]
        return pids, len(pool._pool), pool.get_stats()["pool_size"]

    pids, idle, size = run(database_url, body, pool_min=3, pool_max=3)
    assert len(set(pids)) == 1  # last in, first out: the warm one
    assert (idle, size) == (3, 3)


def test_a_connection_whose_server_went_away_while_idle_is_never_served(database_url):
    async def body(pool):
        first = await backend_pid(pool)
        with psycopg.connect(database_url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (first,))
        await asyncio.sleep(0.2)  # its FATAL message and the close have arrived
        after = [await backend_pid(pool) for _ in range(5)]
        for _ in range(50):  # the pool replaces what it discarded
            if len(pool._pool) == 2:
                break
            await asyncio.sleep(0.1)
        return first, after, len(pool._pool)

    first, after, idle = run(database_url, body, pool_min=2, pool_max=2)
    assert first not in after
    assert idle == 2


def test_a_connection_given_back_mid_transaction_is_rolled_back_not_stacked(database_url):
    async def body(pool):
        async with pool.connection() as conn:
            await conn.execute("BEGIN")
            await conn.execute("CREATE TEMP TABLE lane_left_open (x int)")
            given = conn
        status = given.pgconn.transaction_status
        async with pool.connection() as conn:
            seen = (await (await conn.execute(
                "SELECT to_regclass('pg_temp.lane_left_open') IS NULL AS gone")).fetchone())["gone"]
        return status, seen

    status, gone = run(database_url, body, pool_min=1, pool_max=1)
    assert status == psycopg.pq.TransactionStatus.IDLE  # the pool's own path rolled it back
    assert gone


def test_a_connection_past_its_lifetime_is_closed_when_given_back(database_url):
    async def body(pool):
        async with pool.connection() as conn:
            conn._expire_at = 0.0  # psycopg_pool's best-before date, passed
            old = conn
        for _ in range(50):
            if len(pool._pool) == 1:
                break
            await asyncio.sleep(0.1)
        return old.closed, old in pool._pool, len(pool._pool)

    closed, stacked, idle = run(database_url, body, pool_min=1, pool_max=1)
    assert closed and not stacked
    assert idle == 1  # and a new one opened in its place


def test_a_request_queued_for_a_connection_gets_the_one_given_back(database_url):
    async def body(pool):
        order = []

        async def hold(name, seconds):
            async with pool.connection() as conn:
                order.append(name)
                await conn.execute("SELECT pg_sleep(%s)", (seconds,))

        first = asyncio.create_task(hold("first", 0.3))
        await asyncio.sleep(0.05)
        second = asyncio.create_task(hold("second", 0))  # queued: the only connection is out
        await asyncio.sleep(0.05)
        queued = len(pool._waiting)
        await asyncio.gather(first, second)
        return order, queued, len(pool._pool)

    order, queued, idle = run(database_url, body, pool_min=1, pool_max=1)
    assert queued == 1
    assert order == ["first", "second"]
    assert idle == 1


@pytest.mark.parametrize("state", ["waiting", "locked"])
def test_the_lane_stands_aside_while_the_pool_is_busy_deciding(database_url, state):
    async def body(pool):
        if state == "waiting":
            pool._waiting.append(object())
            try:
                return pool._take_idle()
            finally:
                pool._waiting.clear()
        async with pool._lock:
            return pool._take_idle()

    assert run(database_url, body, pool_min=1, pool_max=1) is None


# db.Call: fetch_row in two halves on the lane (the direct lane's DELETE, server.py)

ADD = db.Statement("SELECT %(a)s::int + 1, pg_backend_pid()")


def test_a_call_is_on_the_wire_when_start_returns_and_gives_the_connection_back(database_url):
    async def body(pool):
        first = db.Call.start(pool, "t1", ADD, {"a": 1})
        in_flight = first.conn.pgconn.transaction_status  # sent, the answer not read yet
        preparing, held = first.preparing, dict(pool._by_tenant)
        row1 = await first.row()
        second = db.Call.start(pool, "t1", ADD, {"a": 41})  # the same (warm) connection, prepared now
        row2 = await second.row()
        return in_flight, preparing, second.preparing, held, row1, row2, dict(pool._by_tenant), len(pool._pool)

    in_flight, preparing, prepared_later, held, row1, row2, after, idle = run(database_url, body,
                                                                               pool_min=2, pool_max=2)
    assert in_flight == psycopg.pq.TransactionStatus.ACTIVE
    assert preparing and not prepared_later  # a new connection prepares first, once
    assert held == {"t1": 1}
    assert row1[0] == "2" and row2 == ("42", row1[1])
    assert after == {} and idle == 2


def test_a_call_starts_only_when_nothing_is_to_be_waited_for(database_url):
    async def body(pool):
        out = {}
        pool._by_tenant["t1"] = pool.tenant_share  # the tenant holds its share
        out["share"] = (db.Call.start(pool, "t1", ADD, {"a": 1}), len(pool._pool))
        pool._by_tenant.clear()
        held = await pool.getconn()  # the only connection is out
        out["none idle"] = (db.Call.start(pool, "t2", ADD, {"a": 1}), dict(pool._by_tenant))
        await pool.putconn(held)
        out["after"] = await db.Call.start(pool, "t2", ADD, {"a": 1}).row()
        return out

    out = run(database_url, body, pool_min=1, pool_max=1)
    assert out["share"] == (None, 1)  # nothing taken: the route waits for its share
    assert out["none idle"] == (None, {})  # the share it took is given back
    assert out["after"][0] == "2"


def test_no_call_starts_behind_a_transaction_pooler(database_url):
    async def body(pool):
        return db.Call.start(pool, None, ADD, {"a": 1}), len(pool._pool)

    # behind pgbouncer, the statement timeout's transaction comes first (db.bounded)
    assert run(database_url, body, pool_min=1, pool_max=1, pool_mode="transaction") == (None, 1)


def test_an_error_before_the_send_is_raised_by_row_and_the_connection_is_given_back(database_url):
    async def body(pool):
        call = db.Call.start(pool, "t1", ADD, {"a": "1\0"})  # libpq would cut it at the NUL
        try:
            await call.row()
        except psycopg.DataError as exc:
            error = exc
        fine = await db.Call.start(pool, "t1", ADD, {"a": 2}).row()
        return error, fine, dict(pool._by_tenant), len(pool._pool)

    error, fine, held, idle = run(database_url, body, pool_min=1, pool_max=1)
    assert "NUL" in str(error)
    assert fine[0] == "3" and held == {} and idle == 1


def test_a_database_error_is_raised_by_row_and_the_connection_stays_in_the_pool(database_url):
    async def body(pool):
        call = db.Call.start(pool, None, ADD, {"a": "x"})
        try:
            await call.row()
        except psycopg.errors.InvalidTextRepresentation as exc:
            error = exc
        again = await db.Call.start(pool, None, ADD, {"a": 1}).row()
        return error.sqlstate, call.conn is not None and not call.conn.closed, again, len(pool._pool)

    state, open_, again, idle = run(database_url, body, pool_min=1, pool_max=1)
    assert state == "22P02" and open_ and again[0] == "2" and idle == 1


def test_an_abandoned_call_closes_its_connection_and_the_pool_replaces_it(database_url):
    async def body(pool):
        call = db.Call.start(pool, "t1", db.Statement("SELECT pg_sleep(%(s)s::float8)"), {"s": 0.5})
        call.abandon()  # its task was cancelled before it began: row() never runs
        call.abandon()  # once only
        for _ in range(50):
            if len(pool._pool) == 1 and pool._pool[0] is not call.conn:
                break
            await asyncio.sleep(0.1)
        fresh = await db.Call.start(pool, "t1", ADD, {"a": 1}).row()
        return call.conn.closed, dict(pool._by_tenant), len(pool._pool), fresh

    closed, held, idle, fresh = run(database_url, body, pool_min=1, pool_max=1)
    assert closed and held == {} and idle == 1
    assert fresh[0] == "2"
