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
