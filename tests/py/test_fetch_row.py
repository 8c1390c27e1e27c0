"""db.fetch_row: the hot routes' statements run through libpq itself, against a real
PostgreSQL: placeholders, texts and NULLs, prepared or not, errors as psycopg raises
them with the connection still usable, a parameter larger than the socket's buffer,
a broken connection and a task cancelled mid-query (the connection is closed, never
pooled mid-query)."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from queen_timers import db
from queen_timers.config import Settings
from queen_timers.errors import from_exception


def run(database_url, body):
    async def go():
        conn = await psycopg.AsyncConnection.connect(database_url, autocommit=True, client_encoding="utf8")
        try:
            return await body(conn)
        finally:
            await conn.close()
    return asyncio.run(go())


def test_placeholders_compile_to_numbered_parameters():
    s = db.Statement("SELECT %(a)s::text, %(b)b::text[], %(a)s || '%%', %(c)s")
    assert s.text == b"SELECT $1::text, $2::text[], $1 || '%', $3"
    assert s.names == ("a", "b", "c") and s.formats == [0, 1, 0]
    assert db.Statement("SELECT 1").name != db.Statement("SELECT 1").name  # one name per statement
    with pytest.raises(ValueError, match="both text and binary"):
        db.Statement("SELECT %(a)s, %(a)b")


def test_values_texts_nulls_and_no_row(database_url):
    s = db.Statement("SELECT %(t)s::text, %(n)s::bigint + 1, %(f)s::boolean, %(none)s::text, "
                     "%(arr)b::text[], 'é' FROM generate_series(1, %(rows)s::int)")

    async def body(conn):
        params = {"t": "ä\"x", "n": 41, "f": False, "none": None,
                  "arr": db.binary_array(db.TextArray, ["a", None, "c"]), "rows": 2}
        first = await db.fetch_row(conn, s, params)
        again = await db.fetch_row(conn, s, params)  # the prepared statement, reused
        none = await db.fetch_row(conn, s, dict(params, rows=0))
        return first, again, none

    first, again, none = run(database_url, body)
    assert first == again == ("ä\"x", "42", "f", None, "{a,NULL,c}", "é")
    assert none is None


def test_prepared_once_per_connection_and_never_when_told_not_to(database_url):
    s = db.Statement("SELECT %(x)s::int * 2")
    count = db.Statement("SELECT count(*) FROM pg_prepared_statements WHERE name = %(name)s")

    async def body(conn):
        seen = []
        for prepare in (False, True, True):
            assert await db.fetch_row(conn, s, {"x": 21}, prepare=prepare) == ("42",)
            seen.append((await db.fetch_row(conn, count, {"name": s.name.decode()}, prepare=False))[0])
        return seen

    assert run(database_url, body) == ["0", "1", "1"]


def test_by_default_prepared_as_the_connections_prepare_threshold_says(database_url):
    """Behind a transaction pooler the broker's connections have prepare_threshold=None
    (db.connect_kwargs): fetch_row then prepares nothing, as psycopg would not."""
    s = db.Statement("SELECT %(x)s::int + 1")
    count = db.Statement("SELECT count(*) FROM pg_prepared_statements WHERE name = %(name)s")

    async def go(threshold):
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True,
                                                         prepare_threshold=threshold) as conn:
            assert await db.fetch_row(conn, s, {"x": 1}) == ("2",)
            return (await db.fetch_row(conn, count, {"name": s.name.decode()}, prepare=False))[0]

    assert asyncio.run(go(None)) == "0"
    assert asyncio.run(go(5)) == "1"
    kwargs = db.connect_kwargs(Settings(database_url=database_url, pool_mode="transaction"), "t")
    assert kwargs["prepare_threshold"] is None


def test_a_statement_dropped_under_it_is_prepared_again(database_url):
    """psycopg sends DEALLOCATE ALL after a ROLLBACK on a connection where it has prepared
    statements of its own (prepare_threshold: the fifth run of a query), which drops
    fetch_row's too. The next fetch_row prepares its statement again and answers."""
    s = db.Statement("SELECT %(x)s::int * 3")
    count = "SELECT count(*) FROM pg_prepared_statements WHERE name = %s"

    async def body(conn):
        assert await db.fetch_row(conn, s, {"x": 1}) == ("3",)
        for _ in range(6):  # psycopg prepares this one of its own
            await conn.execute("SELECT %s::int", (1,))
        with pytest.raises(ZeroDivisionError):
            async with conn.transaction():
                await conn.execute("SELECT 1")
                1 / 0
        dropped = (await (await conn.execute(count, (s.name.decode(),))).fetchone())[0]
        again = [await db.fetch_row(conn, s, {"x": x}) for x in (2, 3)]
        kept = (await (await conn.execute(count, (s.name.decode(),))).fetchone())[0]
        return dropped, again, kept

    assert run(database_url, body) == (0, [("6",), ("9",)], 1)


def test_a_statement_gone_inside_a_transaction_is_an_error_not_run_twice(database_url):
    """Within a transaction the failed execution has aborted it: fetch_row raises
    (psycopg's InvalidSqlStatementName) instead of running the statement again."""
    s = db.Statement("SELECT %(x)s::int * 5")

    async def body(conn):
        assert await db.fetch_row(conn, s, {"x": 1}) == ("5",)
        await conn.execute("DEALLOCATE ALL")
        async with conn.transaction(force_rollback=True):
            with pytest.raises(psycopg.errors.InvalidSqlStatementName):
                await db.fetch_row(conn, s, {"x": 2})
            return conn.pgconn.transaction_status

    assert run(database_url, body) == psycopg.pq.TransactionStatus.INERROR


def test_a_database_error_is_psycopgs_and_leaves_the_connection_usable(database_url):
    s = db.Statement("SELECT 1 / %(x)s::int")
    raise_it = db.Statement("SELECT queen.cancel_timer(%(tenant)s, %(queue)s, %(key)s)")

    async def body(conn):
        with pytest.raises(psycopg.errors.DivisionByZero):
            await db.fetch_row(conn, s, {"x": 0})
        after = await db.fetch_row(conn, s, {"x": 1})
        with pytest.raises(psycopg.Error) as caught:  # a domain error: its own SQLSTATE, mapped to HTTP
            await db.fetch_row(conn, raise_it, {"tenant": "default", "queue": "", "key": "k"})
        mapped = from_exception(caught.value)
        return after, conn.pgconn.transaction_status, caught.value.sqlstate, mapped

    after, status, sqlstate, mapped = run(database_url, body)
    assert after == ("1",) and status == psycopg.pq.TransactionStatus.IDLE
    assert sqlstate.startswith("QT") and mapped is not None and mapped.status == 400


def test_a_binary_placeholder_takes_only_a_binary_array(database_url):
    s = db.Statement("SELECT cardinality(%(a)b::text[])")

    async def body(conn):
        with pytest.raises(TypeError, match="BinaryArray"):
            await db.fetch_row(conn, s, {"a": ["x"]})
        return await db.fetch_row(conn, s, {"a": db.binary_array(db.TextArray, ["x", "y"])})

    assert run(database_url, body) == ("2",)  # nothing was sent: the connection is usable


def test_a_text_with_a_nul_is_refused_never_cut_short(database_url):
    # libpq sends a text parameter up to its first NUL: "acme\0evil" would arrive as "acme"
    s = db.Statement("SELECT %(t)s::text")

    async def body(conn):
        with pytest.raises(psycopg.DataError, match="NUL"):
            await db.fetch_row(conn, s, {"t": "acme\x00evil"})
        return await db.fetch_row(conn, s, {"t": "acme"})

    assert run(database_url, body) == ("acme",)  # nothing was sent: the connection is usable


def test_a_parameter_larger_than_the_socket_buffer(database_url):
    s = db.Statement("SELECT octet_length(%(x)s::text), md5(%(x)s::text)")
    big = "0123456789abcdef" * (1 << 20)  # 16 MiB: libpq flushes it over many writes

    async def body(conn):
        return await db.fetch_row(conn, s, {"x": big}, prepare=False)

    import hashlib
    assert run(database_url, body) == (str(len(big)), hashlib.md5(big.encode()).hexdigest())


def test_a_broken_connection_raises_operational_error_and_is_closed(database_url):
    s = db.Statement("SELECT %(x)s::int")

    async def body(conn):
        pid = conn.info.backend_pid
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as other:
            await other.execute("SELECT pg_terminate_backend(%s)", (pid,))
        await asyncio.sleep(0.2)
        with pytest.raises(psycopg.OperationalError) as caught:
            await db.fetch_row(conn, s, {"x": 1})
        return conn.closed, from_exception(caught.value)

    closed, mapped = run(database_url, body)
    assert closed and mapped.status == 503 and mapped.headers["Retry-After"] == "1"


def test_a_task_cancelled_mid_query_closes_the_connection(database_url):
    """A query left running must never go back to the pool: the broker shutting down
    cancels its tasks, and the connection is closed (psycopg's pool drops a closed one)."""
    s = db.Statement("SELECT pg_sleep(%(s)s::float8)")

    async def body(conn):
        task = asyncio.ensure_future(db.fetch_row(conn, s, {"s": 5}, prepare=False))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return conn.closed

    assert run(database_url, body) is True
