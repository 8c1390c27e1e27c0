"""Database access: the request pools and where the SQL lives.

Every timer state change is one call of a queen.* function; this module
only opens connections. The sweeper keeps its own connections so that a
starved request pool never stops the fire.

High availability is PostgreSQL's own: QUEEN_DATABASE_URL may name several
hosts (libpq multi-host, `postgresql://h1:p1,h2:p2/db` or `host=h1,h2
port=p1,p2`), and libpq's target_session_attrs=read-write (the broker's
default when the URL sets none) picks the one that accepts writes. After a
promotion the broker's connections to the old primary break; every new
connection lands on the new primary by the same rule. The broker adds no
cluster protocol of its own: it only bounds every wait (connect_timeout,
TCP keepalives, tcp_user_timeout, a deadline over a request's statements)
and discards a pooled connection whose server closed it or turned read-only
(a standby, or a primary fenced with default_transaction_read_only) instead
of handing it to a request.

Behind a transaction pooler (QUEEN_POOL_MODE=transaction: pgbouncer's
pool_mode=transaction) a connection's session is not its own: each
transaction may run on another server connection. So nothing rides on the
session there: no `options` startup parameter (pgbouncer refuses it), no
server-side prepared statement (prepare_threshold=None), and the statement
timeout is set per transaction (set_config(..., true) in a transaction
around each request's work and each sweeper call). LISTEN needs a session:
the sweeper takes it on QUEEN_DIRECT_DATABASE_URL, or polls.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import logging
import os
import re
import select
import socket
import struct
import weakref
from importlib import resources
from pathlib import Path
from time import monotonic

import psycopg
from psycopg import AsyncConnection, pq
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.pq import ConnStatus, ExecStatus, TransactionStatus
from psycopg.rows import dict_row, tuple_row
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from .bodies import count_down
from .config import Settings, tenant_share
from .errors import DeadlinePassed, ReadOnlyServer

log = logging.getLogger("queen_timers.db")


class _QuietDiscard(logging.Filter):
    """psycopg_pool warns "discarding closed connection" for any connection given back
    closed. The broker closes some on purpose (Pool.discard: after a parameter over
    1 MiB, a standby's, a broken one): those are not news, and a WARNING for every large
    push told operators something was wrong. A connection closed by anyone else still
    warns."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "discarding closed connection: %s" and record.args
                    and getattr(record.args[0], "queen_discarded", False))


logging.getLogger("psycopg.pool").addFilter(_QuietDiscard())


def find_sql_dir() -> Path:
    """Where sql/ (schema/ and migrations/) is: QUEEN_SQL_DIR when set; else the copy a
    wheel carries inside the package (queen_timers/sql, see setup.py); else the
    checkout's sql/ at the repository root (an editable install, tests)."""
    override = os.environ.get("QUEEN_SQL_DIR")
    if override:
        return Path(override)
    packaged = resources.files("queen_timers") / "sql"
    if packaged.is_dir() and isinstance(packaged, Path):
        return packaged
    return Path(__file__).resolve().parents[2] / "sql"


SQL_DIR = find_sql_dir()

# libpq parameters the broker sets when neither the URL nor the matching PG*
# environment variable does: no connection attempt or silent peer can hold a
# request or the sweeper for long (a dead host that sends no RST included).
KEEPALIVE_DEFAULTS = {
    "keepalives": ("PGKEEPALIVES", "1"),
    "keepalives_idle": ("PGKEEPALIVESIDLE", "5"),
    "keepalives_interval": ("PGKEEPALIVESINTERVAL", "2"),
    "keepalives_count": ("PGKEEPALIVESCOUNT", "3"),
    # unacknowledged data (or keepalive probes) for this long: the connection is dead
    "tcp_user_timeout": ("PGTCPUSERTIMEOUT", "10000"),
}

# After this long of failed attempts a pool slot stops retrying on its own
# schedule (psycopg_pool backs off 1, 2, 4, 8... s) and the next request
# starts a fresh attempt at once: a promoted primary is found within seconds
# of the promotion, not after the backoff has grown to minutes.
POOL_RECONNECT_TIMEOUT_S = 5.0
READ_ONLY_PAUSE_S = 0.05  # first pause after a read-only connection at checkout; doubles to 1 s


def conninfo(url: str, settings: Settings, *, writable: bool = True) -> str:
    """The URL with the broker's defaults for what it leaves unset.

    writable=True (every connection but the read pool's) adds
    target_session_attrs=read-write: with several hosts, libpq skips the
    standbys and connects to the primary."""
    params = conninfo_to_dict(url)
    defaults = {"connect_timeout": ("PGCONNECT_TIMEOUT", str(settings.connect_timeout_s)),
                **KEEPALIVE_DEFAULTS}
    if writable:
        defaults["target_session_attrs"] = ("PGTARGETSESSIONATTRS", "read-write")
    for key, (env, value) in defaults.items():
        if key not in params and not os.environ.get(env):
            params[key] = value
    return make_conninfo("", **params)


def pooled(settings: Settings) -> bool:
    """True behind a transaction pooler (QUEEN_POOL_MODE=transaction)."""
    return settings.pool_mode == "transaction"


def connect_kwargs(settings: Settings, application_name: str) -> dict:
    # client_encoding: fetch_row reads and writes UTF-8 itself (psycopg follows the server's)
    kwargs = {"application_name": application_name, "row_factory": dict_row, "autocommit": True,
              "client_encoding": "utf8"}
    if pooled(settings):
        kwargs["prepare_threshold"] = None  # a prepared statement lives on one server connection
    elif settings.statement_timeout_ms:
        kwargs["options"] = f"-c statement_timeout={settings.statement_timeout_ms}"
    return kwargs


SET_TIMEOUT = "SELECT set_config('statement_timeout', %s, true)"


@contextlib.asynccontextmanager
async def bounded(conn: AsyncConnection, settings: Settings):
    """Behind a transaction pooler: a transaction whose statement timeout is the broker's
    (SET LOCAL; the session's setting would be another server connection's). Directly:
    nothing (the timeout rode on the connection's startup options)."""
    if not pooled(settings) or not settings.statement_timeout_ms:
        yield conn
        return
    async with conn.transaction():
        await conn.execute(SET_TIMEOUT, (str(settings.statement_timeout_ms),))
        yield conn


async def set_statement_timeout(conn: AsyncConnection, settings: Settings, ms: int, *, statements: int) -> None:
    """A statement timeout of `ms` for the rest of the caller's transaction (SET LOCAL), for
    work scaled to its size, and the lease's deadline with it (BrokerPool's watch): that
    many such statements back to back, plus QUEEN_DEADLINE_GRACE_MS."""
    await conn.execute(SET_TIMEOUT, (str(ms),))
    pool = getattr(conn, "_pool", None)  # the pool a connection belongs to while it is out
    lease = pool._leased.get(conn) if isinstance(pool, BrokerPool) else None
    if lease is not None:
        lease.budget = (statements * ms + settings.deadline_grace_ms) / 1000


async def fetch_bounded(conn: AsyncConnection, settings: Settings, sql: str, params: tuple) -> list:
    """One statement's rows, under the broker's statement timeout (see bounded) when `conn`
    goes through the pooler (a dedicated connection on QUEEN_DIRECT_DATABASE_URL does not)."""
    async with (contextlib.nullcontext(conn) if conn in _DIRECT else bounded(conn, settings)):
        cur = await conn.execute(sql, params)
        return await cur.fetchall()


# connections made on QUEEN_DIRECT_DATABASE_URL behind a pooler: their timeout rides on the session
_DIRECT: "weakref.WeakSet[AsyncConnection]" = weakref.WeakSet()


# ---------------------------------------------------------------------------
# The hot routes' statements, run through libpq itself
# ---------------------------------------------------------------------------
# A call through psycopg's cursor cost the broker 190-230 us of CPU and 370-550
# us of wall time for a trivial statement on this machine; the same statement
# through its pq wrapper (the libpq calls psycopg makes, without the query
# conversion, the dumpers, the row makers and a timer armed for every wait)
# 70-110 us and 170-290 us. The routes a client calls in a loop (POST and
# DELETE /api/v1/timers) use fetch_row; every other statement keeps the cursor.

_PLACEHOLDER = re.compile(r"%\((\w+)\)([sb])|%%")
_STATEMENT_NAMES = itertools.count(1)


class Statement:
    """A statement with psycopg's named placeholders (%(name)s text, %(name)b binary)
    compiled once to libpq's $n form. A text parameter is sent with type 0, so
    PostgreSQL infers it from the statement, as psycopg does for a str: every
    placeholder sits in a cast or a function argument."""
    __slots__ = ("text", "names", "formats", "name")

    def __init__(self, sql: str):
        names: list[str] = []
        formats: list[int] = []

        def number(match: re.Match) -> str:
            if match.group(0) == "%%":
                return "%"
            name, fmt = match.group(1), 1 if match.group(2) == "b" else 0
            if name not in names:
                names.append(name)
                formats.append(fmt)
            elif formats[names.index(name)] != fmt:
                raise ValueError(f"parameter {name} is both text and binary")
            return f"${names.index(name) + 1}"

        self.text = _PLACEHOLDER.sub(number, sql).encode()
        self.names = tuple(names)
        self.formats = formats
        self.name = b"queen_%d" % next(_STATEMENT_NAMES)

    def values(self, params: dict) -> list[bytes | None]:
        return [_wire(params[name], fmt) for name, fmt in zip(self.names, self.formats)]


def _wire(value: object, fmt: int) -> bytes | None:
    if value is None:
        return None
    if fmt:
        if isinstance(value, BinaryArray):
            return value.data
        raise TypeError(f"a binary parameter must be a BinaryArray, not {type(value).__name__}")
    if value is True or value is False:
        return b"t" if value else b"f"
    data = str(value).encode()  # str, int, uuid
    if b"\0" in data:  # libpq would send the text up to it, silently: refuse, as psycopg does
        raise psycopg.DataError("PostgreSQL text fields cannot contain NUL (0x00) bytes")
    return data


class _Wire:
    """fetch_row's state of one connection: the loop it runs on (asyncio.get_running_loop
    costs a getpid() syscall a call on Python 3.11), whether it prepares statements (as
    psycopg does on it: not when connect_kwargs set prepare_threshold=None, behind a
    transaction pooler) and the statements prepared on it (a new connection has none)."""
    __slots__ = ("loop", "prepare", "prepared")

    def __init__(self, conn: AsyncConnection, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.prepare = conn.prepare_threshold is not None
        self.prepared: set[bytes] = set()


_WIRES: "weakref.WeakKeyDictionary[AsyncConnection, _Wire]" = weakref.WeakKeyDictionary()


async def fetch_row(conn: AsyncConnection, statement: Statement, params: dict, *,
                    prepare: bool | None = None) -> tuple[str | None, ...] | None:
    """The first row of `statement` as texts (None for NULL), or None for no row.

    prepare: a server-side prepared statement on this connection (parsed and
    planned once); by default as the connection's prepare_threshold says, so
    never behind a transaction pooler, where the next call may land on another
    server connection. A database error is raised as psycopg
    raises it (errors.from_exception maps it); a lost connection as
    OperationalError, and the connection is closed (the pool replaces it)."""
    values = statement.values(params)
    wire, preparing = _send(conn, statement, values, prepare)
    return await _receive(conn.pgconn, wire, statement, preparing, values)


def _send(conn: AsyncConnection, statement: Statement, values: list, prepare: bool | None) -> tuple[_Wire, bool]:
    """fetch_row's first message on the wire, without waiting: the statement, or its
    PREPARE when this connection has yet to prepare it (True: _receive sends the
    statement once that is done)."""
    pg = conn.pgconn
    wire = _WIRES.get(conn)
    if wire is None:
        wire = _WIRES[conn] = _Wire(conn, asyncio.get_running_loop())
    if not (wire.prepare if prepare is None else prepare):
        pg.send_query_params(statement.text, values, param_formats=statement.formats)
        return wire, False
    if statement.name in wire.prepared:
        pg.send_query_prepared(statement.name, values, param_formats=statement.formats)
        return wire, False
    pg.send_prepare(statement.name, statement.text)
    return wire, True


async def _receive(pg: pq.abc.PGconn, wire: _Wire, statement: Statement, preparing: bool,
                   values: list | None = None, received: pq.abc.PGresult | None = None
                   ) -> tuple[str | None, ...] | None:
    """fetch_row's row, once _send's message is on the wire (`received`: its result,
    already read by Call.take_result)."""
    if preparing:
        _check(await _result(wire.loop, pg))
        wire.prepared.add(statement.name)
        pg.send_query_prepared(statement.name, values, param_formats=statement.formats)
    res = received if received is not None else await _result(wire.loop, pg)
    if not preparing and _statement_gone(res, pg):
        # The session's prepared statements were dropped under us: psycopg sends
        # DEALLOCATE ALL after a ROLLBACK on a connection where it prepared statements
        # of its own (a refused staged batch's transaction, a pool's reset), and DISCARD
        # ALL does the same. The Bind failed, so nothing ran: prepare again, run it once.
        wire.prepared.clear()
        pg.send_prepare(statement.name, statement.text)
        _check(await _result(wire.loop, pg))
        wire.prepared.add(statement.name)
        pg.send_query_prepared(statement.name, values, param_formats=statement.formats)
        res = await _result(wire.loop, pg)
    return _row_of(_check(res))


def _row_of(res: pq.abc.PGresult) -> tuple[str | None, ...] | None:
    if res.ntuples == 0:
        return None
    return tuple(None if (v := res.get_value(0, i)) is None else v.decode() for i in range(res.nfields))


NOT_NOW = object()  # Call.row_now: the row needs row()'s path


class Call:
    """fetch_row in two halves on a leased connection, for a request that can be
    started synchronously (server.py's direct lane sends the DELETE's statement from
    the parser's callback, before the request's task exists, so PostgreSQL runs it
    while the broker builds the rest): `start` takes a pool connection at once
    (Lease.take_now) and puts the statement on the wire, or returns None when a
    connection (or the tenant's share of them) would have to be waited for; `row`
    waits for the row and gives the connection back. `row` raises what fetch_row and
    the lease raise (an error of the send included), the connection already given
    back; `abandon` ends a call whose `row` will never run (its task was cancelled
    before it started)."""
    __slots__ = ("lease", "conn", "statement", "values", "wire", "preparing", "error", "open", "received")

    def __init__(self, lease: Lease, conn: AsyncConnection, statement: Statement, params: dict):
        self.lease, self.conn, self.statement = lease, conn, statement
        self.wire = self.error = self.received = None
        self.values = None
        self.preparing = False
        self.open = True
        try:
            self.values = statement.values(params)
            self.wire, self.preparing = _send(conn, statement, self.values, None)
        except Exception as exc:  # raised by row(), with the lease's end
            self.error = exc

    @classmethod
    def start(cls, pool: BrokerPool, tenant: str | None, statement: Statement, params: dict) -> "Call | None":
        lease = pool.connection(tenant=tenant)
        conn = lease.take_now()
        return None if conn is None else cls(lease, conn, statement, params)

    async def row(self) -> tuple[str | None, ...] | None:
        lease, self.open = self.lease, False
        try:
            if self.error is not None:
                raise self.error
            row = await _receive(self.conn.pgconn, self.wire, self.statement, self.preparing, self.values,
                                 self.received)
        except BaseException as exc:
            await lease.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        if not lease.give_now():
            await lease.__aexit__(None, None, None)
        return row

    # The direct lane's way without a task (server.DirectWait): its statement flushed,
    # the socket's reader callback reads the result (take_result) and, in the common case,
    # ends the call at once (row_now); anything else goes on in row(), from the result read.

    def waitable(self) -> int | None:
        """The socket to wait on for the result, when the statement (already prepared) is
        all on the wire; None: row() waits instead."""
        if self.error is not None or self.preparing:
            return None
        pg = self.conn.pgconn
        try:
            if pg.flush():
                return None
        except Exception as exc:  # raised by row(), with the lease's end
            self.error = exc
            return None
        return pg.socket

    def take_result(self) -> bool:
        """What the socket has, read without blocking: True once the result is whole (in
        `received`; an error reading it in `error`), False while more is to come."""
        pg = self.conn.pgconn
        try:
            whole, self.received = _read_result(pg, self.received)
        except Exception as exc:
            self.error = exc
            _drop_if_unusable(pg)
            return True
        return whole

    def row_now(self):
        """row(), once take_result is True, when nothing is left to wait for: the row, the
        connection given back. NOT_NOW (nothing done) for an error, a statement the session
        lost, or a connection that cannot be given back at once: row() ends those."""
        res = self.received
        if self.error is not None or res is None or res.status != ExecStatus.TUPLES_OK:
            return NOT_NOW
        row = _row_of(res)  # before the connection goes back: a raise here leaves the call to row()
        if not self.lease.give_now():
            return NOT_NOW
        self.open = False
        return row

    def abandon(self) -> None:
        if self.open:
            self.open = False
            self.conn.pgconn.finish()  # a statement may be in flight: no one may reuse the connection
            asyncio.get_running_loop().create_task(self.lease._end(None))


def _statement_gone(res: pq.abc.PGresult, pg: pq.abc.PGconn) -> bool:
    """A prepared statement's execution refused because no such statement exists
    (26000), on a connection outside any transaction (an aborted one could not run it
    again)."""
    return (res.status == ExecStatus.FATAL_ERROR and res.error_field(pq.DiagnosticField.SQLSTATE) == b"26000"
            and pg.transaction_status == TransactionStatus.IDLE)


def _check(res: pq.abc.PGresult) -> pq.abc.PGresult:
    if res.status == ExecStatus.FATAL_ERROR:
        raise psycopg.errors.error_from_result(res, encoding="utf-8")
    if res.status not in (ExecStatus.TUPLES_OK, ExecStatus.COMMAND_OK):
        raise psycopg.InterfaceError(f"unexpected result status {res.status.name}")
    return res


async def _result(loop: asyncio.AbstractEventLoop, pg: pq.abc.PGconn) -> pq.abc.PGresult:
    """The one result of the query just sent: flushed, then read as the socket becomes
    readable (one reader callback per wait, no timer: the statement timeout bounds the
    server, TCP keepalives and tcp_user_timeout a silent network, BrokerPool's watch the
    rest). The connection was idle, libpq's buffer empty: the first read waits for the
    socket (a read straight after the send only meets EAGAIN). Interrupted midway (the
    broker shutting down), the connection is closed, never pooled mid-query."""
    fd = pg.socket
    result = None
    try:
        while pg.flush():  # a large batch may not fit the socket's buffer at once
            await _ready(loop, fd, loop.add_writer, loop.remove_writer)
        while True:
            await _ready(loop, fd, loop.add_reader, loop.remove_reader)
            whole, result = _read_result(pg, result)
            if whole:
                return result
    except BaseException:
        _drop_if_unusable(pg)
        raise


def _read_result(pg: pq.abc.PGconn, result: pq.abc.PGresult | None) -> tuple[bool, pq.abc.PGresult | None]:
    """One read of what the socket has, without blocking: (True, the query's result) once
    it is whole, else (False, the result so far)."""
    pg.consume_input()
    while not pg.is_busy():
        res = pg.get_result()
        if res is None:
            if result is None:
                raise psycopg.InterfaceError("the server sent no result")
            return True, result
        result = res  # the last one is the query's (there is one)
    return False, result


def _nothing() -> None:
    pass


def _unread(fd: int) -> bool:
    """The socket holds what the server sent and no one has read yet (a busy loop, not a
    silent server). poll, not select: a broker's descriptors may pass FD_SETSIZE."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


def _drop_if_unusable(pg: pq.abc.PGconn) -> None:
    if pg.transaction_status == TransactionStatus.ACTIVE or pg.status == ConnStatus.BAD:
        pg.finish()  # a query still in flight, or a broken link: no one may reuse it


class StatementWatch:
    """The broker's own deadline over its statements. PostgreSQL's statement timeout bounds
    a statement the server runs, TCP keepalives and tcp_user_timeout a server that vanished;
    neither bounds a server that is hung but up (stuck on its storage, stopped: its kernel
    still acknowledges) nor a commit waiting for a synchronous standby (no statement timeout
    applies to that wait).

    `out` maps each leased connection to its Lease, whose `budget` is how long a statement
    may go unanswered; the lease puts it in and takes it out, nothing more (a dict store and
    a pop on the hot paths). A timer on the loop looks at them four times a second: a
    connection seen with a statement in flight and nothing from the server to read, in the
    same lease, for its budget, has its socket shut down under it. The waiting coroutine
    wakes on the closed socket with an OperationalError (cut() then says why), and the
    connection is done for. Time the loop took to send the statement or to read an answer
    already there is not counted, nor the gaps between statements. No cancel is sent: on a
    commit waiting for its standby a cancel makes the commit visible on the primary alone,
    which synchronous_mode_strict exists to prevent. The price: the server process of a cut
    connection waits on (docs/failover.md), and the pool's replacement may be cut in turn.
    The sweeper's own sessions are not watched: a cut there would only add such processes,
    and its fire resumes when the server answers."""

    def __init__(self, name: str, settings: Settings):
        self.name = name
        self.every_s = max(min(0.25, settings.deadline_grace_ms / 4000), 0.005)
        self.out: dict[AsyncConnection, Lease] = {}
        self._busy: dict[AsyncConnection, tuple[Lease, float]] = {}  # seen waiting: in which lease, since when
        self._cut: set[AsyncConnection] = set()  # shut by _check, until cut() is asked
        self._timer: asyncio.TimerHandle | None = None
        self.on_cut = _nothing  # app.py counts them (queen_timers_database_deadlines_total)

    def start(self) -> None:
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.every_s, self._check)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def cut(self, conn: AsyncConnection) -> bool:
        """Whether the watch shut `conn` (asked once, when its work ends in an error)."""
        if conn in self._cut:
            self._cut.discard(conn)
            return True
        return False

    def _check(self) -> None:
        try:
            now = monotonic()
            busy = self._busy
            for conn, lease in list(self.out.items()):
                try:
                    pg = conn.pgconn
                    if pg.transaction_status != TransactionStatus.ACTIVE or _unread(pg.socket):
                        busy.pop(conn, None)  # between statements, or an answer to read: not waiting
                        continue
                    seen = busy.get(conn)
                    if seen is None or seen[0] is not lease:
                        busy[conn] = (lease, now)
                    elif now - seen[1] >= lease.budget:
                        self._shut(conn)
                except Exception:  # closed meanwhile, or its socket gone: its lease ends it
                    log.debug("%s: deadline check skipped a connection", self.name, exc_info=True)
            for conn in [c for c in busy if c not in self.out]:
                del busy[conn]
        finally:
            self._timer = asyncio.get_running_loop().call_later(self.every_s, self._check)

    def _shut(self, conn: AsyncConnection) -> None:
        with socket.socket(fileno=os.dup(conn.pgconn.socket)) as sock:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # already closed by the peer
                pass
        del self.out[conn]
        self._busy.pop(conn, None)
        self._cut.add(conn)
        self.on_cut()
        log.warning("%s: a statement had no answer within its deadline (the statement timeout plus "
                    "QUEEN_DEADLINE_GRACE_MS): its connection is closed (a hung server, or a commit waiting "
                    "for a synchronous standby)", self.name)


def _wake(future: asyncio.Future) -> None:
    if not future.done():  # the loop may call a reader again before the task has run
        future.set_result(None)


async def _ready(loop: asyncio.AbstractEventLoop, fd: int, add, remove) -> None:
    future = loop.create_future()
    add(fd, _wake, future)
    try:
        await future
    finally:
        remove(fd)


def array_param(values: list) -> list | None:
    """A binary array parameter; all NULL is sent as NULL (psycopg cannot type it)."""
    return values if any(v is not None for v in values) else None


# ---------------------------------------------------------------------------
# One-dimensional arrays in PostgreSQL's binary format, built in bulk
# ---------------------------------------------------------------------------
# psycopg dumps a list element by element in Python (0.7 ms for the six arrays
# of a 256-op schedule batch). These build the same bytes in a few C-level
# passes (struct, bytes.join). Binary arrays are also what costs PostgreSQL
# least: the same batch as one JSON parameter took 31 % more of the server's
# CPU (json_to_record parses it twice; the payloads as base64 to decode).

class BinaryArray:
    """An array already in PostgreSQL's binary format (a %b parameter)."""
    __slots__ = ("data",)
    OID = ELEMENT = 0

    def __init__(self, data: bytes):
        self.data = data

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other.data == self.data

    __hash__ = None  # type: ignore[assignment]


class TextArray(BinaryArray):
    __slots__ = ()
    OID, ELEMENT = 1009, 25  # text[], text


class ByteaArray(BinaryArray):
    __slots__ = ()
    OID, ELEMENT = 1001, 17  # bytea[], bytea


class Int8Array(BinaryArray):
    __slots__ = ()
    OID, ELEMENT = 1016, 20  # bigint[], bigint


class Int4Array(BinaryArray):
    __slots__ = ()
    OID, ELEMENT = 1007, 23  # integer[], integer


class BoolArray(BinaryArray):
    __slots__ = ()
    OID, ELEMENT = 1000, 16  # boolean[], boolean


_ARRAY_HEAD = struct.Struct("!iiIii")  # dimensions, has-NULL flag, element OID, length, lower bound
_NULL = struct.pack("!i", -1)
# the length words of elements up to 4 KiB (names, small payloads); index -1 is NULL's
_LENGTHS_UPTO = 4096
_LENGTHS = [struct.pack("!i", i) for i in range(_LENGTHS_UPTO)] + [_NULL]
_LENGTH_CHARS = [word.decode("latin-1") for word in _LENGTHS]  # the same words as text, for ASCII arrays
_FIXED = {Int8Array: (8, "q"), Int4Array: (4, "i"), BoolArray: (1, "?")}


def binary_array(kind: type[BinaryArray], values: list | tuple) -> BinaryArray | None:
    """`values` (None for NULL) as a `kind` parameter; None (SQL NULL) when every value
    is None, as array_param. Text is encoded as UTF-8: callers have refused lone surrogates."""
    n = len(values)
    nulls = values.count(None)
    if nulls == n:
        return None
    head = _ARRAY_HEAD.pack(1, 1 if nulls else 0, kind.ELEMENT, n, 1)
    if not nulls and values.count(values[0]) == n:  # one value n times (a batch's op, queue, delay)
        first = values[0]
        one = (struct.pack("!" + _FIXED[kind][1], first) if kind in _FIXED
               else first.encode() if kind is TextArray else first)
        return kind(head + (struct.pack("!i", len(one)) + one) * n)
    if kind in _FIXED:
        size, code = _FIXED[kind]
        if not nulls:  # length and value n times, in one pack
            flat = [size] * (2 * n)
            flat[1::2] = values
            return kind(head + struct.pack("!" + ("i" + code) * n, *flat))
        one = struct.Struct("!i" + code)
        return kind(head + b"".join(_NULL if v is None else one.pack(size, v) for v in values))
    if not nulls and kind is TextArray:
        lengths = list(map(len, values))
        if max(lengths) < _LENGTHS_UPTO and "".join(values).isascii():
            # ASCII: a character is a byte; the words and values joined as text, encoded once
            parts = [None] * (2 * n)
            parts[0::2] = map(_LENGTH_CHARS.__getitem__, lengths)
            parts[1::2] = values
            return kind(head + "".join(parts).encode("latin-1"))
    items = values
    if kind is TextArray:
        items = [None if v is None else v.encode() for v in values] if nulls else list(map(str.encode, values))
    if nulls:
        lengths = [-1 if v is None else len(v) for v in items]
        items = [b"" if v is None else v for v in items]
    else:
        lengths = list(map(len, items))
    parts: list = [None] * (2 * n)
    if max(lengths) < _LENGTHS_UPTO:  # each element's length word from a table, in one C-level pass
        parts[0::2] = map(_LENGTHS.__getitem__, lengths)  # -1 (NULL) is the table's last entry
    else:
        prefixes = struct.pack(f"!{n}i", *lengths)
        parts[0::2] = [prefixes[i:i + 4] for i in range(0, 4 * n, 4)]
    parts[1::2] = items
    return kind(head + b"".join(parts))


class _BinaryArrayDumper(psycopg.adapt.Dumper):
    format = psycopg.pq.Format.BINARY

    def dump(self, obj: BinaryArray) -> bytes:
        return obj.data


for _kind in (TextArray, ByteaArray, Int8Array, Int4Array, BoolArray):
    # registered before any connection exists: every connection's adapters inherit them
    psycopg.adapters.register_dumper(_kind, type(f"{_kind.__name__}Dumper", (_BinaryArrayDumper,),
                                                {"oid": _kind.OID}))


def read_only_server(conn: psycopg.AsyncConnection | psycopg.Connection) -> bool:
    """True when the server says (ParameterStatus, no round trip) it takes no writes.

    PostgreSQL 14+ reports in_hot_standby and default_transaction_read_only on
    connect and whenever they change (a promotion, a reload); libpq's
    target_session_attrs=read-write reads the same two."""
    pg = conn.pgconn  # libpq's own lookup: psycopg's ConnectionInfo decodes through the client encoding
    return (pg.parameter_status(b"in_hot_standby") == b"on"
            or pg.parameter_status(b"default_transaction_read_only") == b"on")


class Lease:
    """BrokerPool.connection's context: its share of the pool for the tenant, then a
    connection (the idle lane, else getconn), given back on the way out; a statement
    that failed on what turned out to be a standby raises ReadOnlyServer. A class, not
    an asynccontextmanager: its generator and wrappers cost 2 us a request."""

    __slots__ = ("pool", "timeout", "tenant", "conn", "bound", "budget")

    def __init__(self, pool: BrokerPool, timeout: float | None, tenant: str | None):
        self.pool, self.timeout, self.tenant = pool, timeout, tenant
        self.conn: AsyncConnection | None = None
        self.bound = None  # bounded()'s context behind a transaction pooler
        self.budget = pool.budget_s  # how long a statement may go unanswered (StatementWatch)

    async def __aenter__(self) -> AsyncConnection:
        pool, tenant = self.pool, self.tenant
        deadline = monotonic() + (pool.timeout if self.timeout is None else self.timeout)
        if tenant is not None and not pool._take_share_now(tenant):
            await pool._take_share(tenant, deadline)
        try:
            conn = pool._take_idle()
            if conn is None:
                conn = await pool.getconn(max(deadline - monotonic(), 0.0))
        except BaseException:
            if tenant is not None:
                pool._give_share(tenant)
            raise
        self.conn = conn
        if pool.budget_s is not None:
            pool._leased[conn] = self
        if pool.pooled:
            bound = bounded(conn, pool.settings)
            try:
                await bound.__aenter__()
            except BaseException as exc:
                await self._end(exc)
                raise
            self.bound = bound
        return conn

    def take_now(self) -> AsyncConnection | None:
        """__aenter__ where it has nothing to wait for, without a coroutine: the connection
        (an idle one, within the tenant's share, directly to PostgreSQL), or None, having
        taken nothing (await the lease instead)."""
        pool, tenant = self.pool, self.tenant
        if pool.pooled:
            return None  # behind a transaction pooler: the statement timeout's transaction first
        if tenant is not None and not pool._take_share_now(tenant):
            return None
        conn = pool._take_idle()
        if conn is None:
            if tenant is not None:
                pool._give_share(tenant)
            return None
        self.conn = conn
        if pool.budget_s is not None:
            pool._leased[conn] = self
        return conn

    def give_now(self) -> bool:
        """The common end of a lease whose work succeeded, without a coroutine: False when
        it needs __aexit__ (a transaction to commit, a connection to close or to queue)."""
        pool, conn = self.pool, self.conn
        if self.bound is None and id(conn) not in pool._discard and pool._give_idle(conn):
            pool._leased.pop(conn, None)
            if self.tenant is not None:
                pool._give_share(self.tenant)
            return True
        return False

    async def __aexit__(self, typ, exc, tb) -> None:
        if exc is None and self.give_now():
            return  # the common end, without _end's coroutine
        bound, self.bound = self.bound, None
        if bound is not None:
            try:
                await bound.__aexit__(typ, exc, tb)  # commits, or rolls back on exc
            except BaseException as error:  # its end failed: that error is the request's
                await self._end(error)
                raise
        await self._end(exc)

    async def _end(self, exc: BaseException | None) -> None:
        """Give the connection and the tenant's share back; raises ReadOnlyServer when
        the statement's error `exc` came from a standby."""
        pool, conn = self.pool, self.conn
        try:
            if pool._leased.pop(conn, None) is None and pool.watch.cut(conn) and exc is not None:
                # the watch closed the connection under the statement
                raise DeadlinePassed("the database did not answer by the deadline (the statement timeout "
                                     "plus QUEEN_DEADLINE_GRACE_MS): the connection was closed") from exc
            if isinstance(exc, psycopg.Error) and pool.writable and await pool._on_standby(conn, exc):
                raise ReadOnlyServer("the database is read-only right now (a standby, or a primary "
                                     "being switched over)") from exc
        finally:
            try:
                if id(conn) in pool._discard:
                    pool._discard.discard(id(conn))
                    conn.queen_discarded = True  # see _QuietDiscard
                    await conn.close()  # the pool drops a closed connection and opens another
                if not pool._give_idle(conn):
                    await pool.putconn(conn)
            finally:
                if self.tenant is not None:
                    pool._give_share(self.tenant)


def _check_alive(conn: AsyncConnection) -> None:
    """Read what the server sent while the connection sat idle, without blocking
    (libpq's socket is non-blocking) and without a round trip: a closed peer shows up
    as an error here, so a request never gets a connection whose server is already gone.

    A terminated backend sends an error message and then closes: the first read takes
    the message, parsing it (is_busy) turns it into a notice and applies any
    ParameterStatus, and the second read meets the end of the stream."""
    pg = conn.pgconn
    pg.consume_input()
    pg.is_busy()
    pg.consume_input()
    if pg.status != ConnStatus.OK:
        raise psycopg.OperationalError("the connection is broken")


async def check(conn: AsyncConnection, *, writable: bool) -> None:
    """Alive, and (writable=True) not on a read-only server. Raises psycopg.Error."""
    check_now(conn, writable=writable)


def check_now(conn: AsyncConnection, *, writable: bool) -> None:
    """check, which needs no wait (a pool's lane that cannot yield to the loop)."""
    _check_alive(conn)
    if writable and read_only_server(conn):
        raise ReadOnlyServer("the server is read-only (a standby, or fenced)")


READ_ONLY_SQL = "SELECT pg_is_in_recovery() OR current_setting('transaction_read_only')::bool"


async def _read_only(conn: AsyncConnection) -> bool:
    """Asked of the server, one round trip: a standby, or a fenced primary."""
    async with conn.cursor(row_factory=tuple_row) as cur:
        await cur.execute(READ_ONLY_SQL)
        return bool((await cur.fetchone())[0])


def _host_attempts(conninfo: str) -> list[str]:
    """One conninfo per host of a multi-host conninfo (libpq's rules: one port for all, or
    one per host), in order, each with target_session_attrs=any: WritableBehindPooler asks."""
    params = {**conninfo_to_dict(conninfo), "target_session_attrs": "any"}
    hosts = str(params.get("host") or "").split(",")
    if len(hosts) < 2:
        return [make_conninfo("", **params)]
    ports = str(params.get("port") or "").split(",")
    addrs = str(params["hostaddr"]).split(",") if params.get("hostaddr") else None
    out = []
    for i, host in enumerate(hosts):
        one = {**params, "host": host, "port": ports[i] if len(ports) == len(hosts) else ports[0]}
        if addrs is not None:
            one["hostaddr"] = addrs[i]
        if not one["port"]:
            del one["port"]
        out.append(make_conninfo("", **one))
    return out


class WritableBehindPooler(AsyncConnection):
    """The request pool's connections behind a transaction pooler (QUEEN_POOL_MODE=transaction):
    each host of the URL in turn, the first whose server answers that it takes writes.

    libpq's target_session_attrs=read-write believes the ParameterStatus a pgbouncer replays
    from the server it first met: after a switchover the old primary's pgbouncer still says
    in_hot_standby=off while its server is a standby, libpq takes it, and every statement
    fails; and the new primary's still says on, and libpq refuses it. Asked with a query,
    the pooler routes the question to the server itself."""

    @classmethod
    async def connect(cls, conninfo: str = "", **kwargs):
        errors: list[Exception] = []
        for one in _host_attempts(conninfo):
            try:
                conn = await super().connect(one, **kwargs)
            except psycopg.OperationalError as exc:
                errors.append(exc)
                continue
            try:
                read_only = await _read_only(conn)
            except psycopg.Error as exc:
                await conn.close()
                errors.append(exc)
                continue
            if not read_only:
                return conn
            await conn.close()
            params = conninfo_to_dict(one)
            errors.append(ReadOnlyServer(f"{params.get('host')}:{params.get('port')}: the server behind it "
                                         "takes no writes (a standby, or fenced)"))
        if len(errors) == 1:
            raise errors[0]
        raise psycopg.OperationalError("no host takes writes: " + "; ".join(str(e).strip() for e in errors))


class BrokerPool(AsyncConnectionPool):
    """psycopg_pool's pool, with a checkout check that costs no round trip.

    A connection that fails the check (its server closed it, or turned read-only)
    is closed and returned, so the pool discards it and opens a replacement, and
    the request takes the next one at once. psycopg_pool's own `check` callback
    would sleep a backoff of 1 s, 2 s... between failed checks: after a failover
    every idle connection is stale, and a request would spend its whole
    QUEEN_POOL_TIMEOUT_MS stepping over them."""

    def __init__(self, *args, writable: bool, settings: Settings, **kwargs):
        super().__init__(*args, **kwargs)
        self.writable = writable
        self.settings = settings
        self.pooled = pooled(settings) and bool(settings.statement_timeout_ms)
        # a transaction pooler replays the ParameterStatus of the server it first met, which a
        # switchover makes wrong either way: then writability is asked of the server instead
        # (WritableBehindPooler on connect, _on_standby after a failed statement)
        self.behind_pooler = pooled(settings)
        self._discard: set[int] = set()
        # connections one tenant may hold or queue for at once (see _take_share)
        self.tenant_share = tenant_share(self.max_size, settings.auth)
        self._by_tenant: dict[str, int] = {}
        self._tenant_waiters: dict[str, collections.deque] = {}
        # the broker's deadline over the statements of the connections out (StatementWatch),
        # with their lease; none without a statement timeout
        timeout_ms = settings.statement_timeout_ms
        self.budget_s = (timeout_ms + settings.deadline_grace_ms) / 1000 if timeout_ms else None
        self.watch = StatementWatch(f"pool {self.name}", settings)
        self._leased = self.watch.out

    async def open(self, wait: bool = False, timeout: float = 30.0) -> None:
        await super().open(wait=wait, timeout=timeout)
        if self.budget_s is not None:
            self.watch.start()

    async def close(self, timeout: float = 5.0) -> None:
        self.watch.stop()
        await super().close(timeout=timeout)

    def connection(self, timeout: float | None = None, tenant: str | None = None) -> "Lease":
        """A connection for one request's work (`async with pool.connection() as conn`): in a
        transaction with the statement timeout behind a transaction pooler (see bounded);
        closed instead of kept when the work asked for it (discard). The connections are
        autocommit: there is no transaction of psycopg's to end (its connection() would
        commit one anyway). `tenant`: the request's, which holds or queues for at most
        tenant_share of them."""
        return Lease(self, timeout, tenant)

    # The lane of the common case, a connection idle and nobody queued: what getconn and
    # putconn decide then, without their path through psycopg_pool (its lock, logging,
    # statistics and the coroutines around them: 15-40 us of a DELETE's CPU in an A/B, of
    # the 125 us the broker spent beyond bench/shell_floor.py). Synchronous, so atomic on
    # the loop; taken only while no coroutine is inside the pool's critical section.
    # Anything else (no idle connection, waiters, a connection to close or replace) takes
    # the pool's path.

    def _take_idle(self) -> AsyncConnection | None:
        if not self._pool or self._waiting or self._closed or self._lock.locked():
            return None
        conn = self._pop_idle()  # last in, first out, as _get_ready_connection
        try:
            check_now(conn, writable=self.writable and not self.behind_pooler)
        except psycopg.Error:  # broken, or now on a read-only server: the pool's own path handles it
            self._pool.append(conn)
            return None
        conn._pool = self  # as psycopg_pool's getconn: it belongs to the pool while out
        self._stats[self._REQUESTS_NUM] += 1  # get_stats() counts it as getconn would
        return conn

    def _give_idle(self, conn: AsyncConnection) -> bool:
        if (self._waiting or self._closed or self._lock.locked() or self._pool_full_event is not None
                or conn.pgconn.transaction_status != TransactionStatus.IDLE
                or conn._created_at <= self._drained_at or conn._expire_at <= monotonic()):
            return False
        conn._pool = None
        self._pool.append(conn)
        return True

    async def _on_standby(self, conn: AsyncConnection, exc: psycopg.Error) -> bool:
        """After a statement failed: is the connection's server a standby now (or a fenced,
        read-only primary)? Then it is discarded, and the next one is opened on the primary
        (target_session_attrs directly, WritableBehindPooler behind a pooler).
        A direct connection says so without a round trip (getconn's check), but behind
        pgbouncer no ParameterStatus of the server comes through: after a switchover a pooled
        connection to the pgbouncer of the old primary reaches a standby, and every statement
        fails (25006, or 0A000 for the staging tables) until the connection is dropped.
        Asked only after errors that are not the broker's own (QT*) nor of a class a standby
        never causes (data, integrity, rollback, cancel): one round trip, on an error."""
        state = exc.sqlstate or ""
        if not state or state.startswith("QT") or state[:2] in ("22", "23", "40", "57") or conn.closed:
            return False
        try:
            # a fenced primary (default_transaction_read_only) is refused the same way
            standby = await _read_only(conn)
        except psycopg.Error:  # broken, or busy mid-result: not to be reused either way
            standby = False
            self._discard.add(id(conn))
        if standby:
            self._discard.add(id(conn))
        return standby

    def _take_share_now(self, tenant: str) -> bool:
        """_take_share when the tenant is under its share: taken at once (no coroutine)."""
        n = self._by_tenant.get(tenant, 0)
        if n >= self.tenant_share:
            return False
        self._by_tenant[tenant] = n + 1
        return True

    async def _take_share(self, tenant: str, deadline: float) -> None:
        """Wait (first come, first served among the tenant's own requests) until the tenant
        holds fewer than tenant_share connections, within the request's pool deadline.
        psycopg_pool's queue is one line for everyone: a tenant with slow statements (a
        long stats page, a row lock) and many requests would put all of them ahead of
        another tenant's, which would wait out QUEEN_POOL_TIMEOUT_MS and get 503s."""
        while self._by_tenant.get(tenant, 0) >= self.tenant_share:
            waiter = asyncio.get_running_loop().create_future()
            self._tenant_waiters.setdefault(tenant, collections.deque()).append(waiter)
            try:
                await asyncio.wait_for(waiter, max(deadline - monotonic(), 0.0))
            except BaseException as exc:
                if waiter.done() and not waiter.cancelled():
                    self._wake_one(tenant)  # woken, and going anyway: the turn passes on
                if isinstance(exc, asyncio.TimeoutError):
                    raise PoolTimeout(f"the tenant holds {self.tenant_share} of the pool's connections, its "
                                      f"share, and none came free in time") from None
                raise
        self._by_tenant[tenant] = self._by_tenant.get(tenant, 0) + 1

    def _give_share(self, tenant: str) -> None:
        count_down(self._by_tenant, tenant, 1)
        self._wake_one(tenant)

    def _wake_one(self, tenant: str) -> None:
        waiters = self._tenant_waiters.get(tenant)
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():  # one that timed out is done (cancelled)
                waiter.set_result(None)
                break
        if waiters is not None and not waiters:
            del self._tenant_waiters[tenant]

    async def _get_ready_connection(self, timeout: float | None) -> AsyncConnection | None:
        """psycopg_pool's, last in first out: the connection used last (its server
        process warm in a CPU's caches) serves the next request, and the idle ones
        at the other end are those the pool closes when it shrinks. psycopg_pool
        takes the oldest: at a few requests at once every call woke another server
        process (a DELETE's p50 went from 0.88 to 1.2 ms with four connections)."""
        if timeout is not None and timeout <= 0.0:
            raise PoolTimeout()
        if not self._pool:
            return await super()._get_ready_connection(timeout)  # none idle: its queue rules
        return self._pop_idle()

    def _pop_idle(self) -> AsyncConnection:
        """The idle connection used last, with the pool's low-water mark of idle connections
        kept as psycopg_pool keeps it (its shrink closes those that stayed unused)."""
        conn = self._pool.pop()
        self._nconns_min = min(self._nconns_min, len(self._pool))
        return conn

    def discard(self, conn: AsyncConnection) -> None:
        """Close `conn` once its work is done (committed) rather than keep it: libpq keeps
        its buffers at the largest size they ever held."""
        self._discard.add(id(conn))

    async def getconn(self, timeout: float | None = None) -> AsyncConnection:
        deadline = monotonic() + (self.timeout if timeout is None else timeout)
        pause = READ_ONLY_PAUSE_S
        while True:
            conn = await super().getconn(timeout=max(deadline - monotonic(), 0.0))
            try:
                await check(conn, writable=self.writable and not self.behind_pooler)
            except psycopg.Error as exc:
                log.info("pool %s: discarding a connection (%s)", self.name, str(exc).splitlines()[0])
                try:
                    await conn.close()
                finally:
                    await self.putconn(conn)  # closed: the pool drops it and adds a new one
                if isinstance(exc, ReadOnlyServer):
                    # a dead connection is stepped over at once; a live read-only server
                    # (target_session_attrs=any on a standby, a fence) would hand the pool
                    # a fresh read-only connection as fast as it can connect: pace it
                    await asyncio.sleep(min(pause, max(deadline - monotonic(), 0.0)))
                    pause = min(pause * 2, 1.0)
                continue
            return conn


async def _reconnect_failed(pool: AsyncConnectionPool) -> None:
    log.warning("pool %s: no database connection for %.0f s; the next request tries again",
                pool.name, POOL_RECONNECT_TIMEOUT_S)


def make_pool(settings: Settings, *, read: bool = False) -> BrokerPool:
    """The request pool (read=False: the primary) or the read pool (QUEEN_READ_DATABASE_URL)."""
    url = settings.read_database_url if read else settings.database_url
    assert url is not None
    role = "queen-broker-read" if read else "queen-broker"
    return BrokerPool(
        conninfo(url, settings, writable=not read),
        # behind a transaction pooler the primary is found by asking (WritableBehindPooler)
        connection_class=WritableBehindPooler if pooled(settings) and not read else AsyncConnection,
        writable=not read,
        settings=settings,
        min_size=settings.pool_min,
        max_size=settings.pool_max,
        timeout=settings.pool_timeout_ms / 1000,
        kwargs=connect_kwargs(settings, f"{role}:{settings.broker_id}"),
        reconnect_timeout=POOL_RECONNECT_TIMEOUT_S,
        reconnect_failed=_reconnect_failed,
        open=False,
        name="queen-reads" if read else "queen-requests",
    )


async def connect(settings: Settings, role: str, url: str | None = None) -> AsyncConnection:
    """A dedicated autocommit connection to the primary (sweeper, LISTEN).

    Refuses a read-only server: with target_session_attrs=any in the URL libpq
    may land on a standby, where the sweeper could only fail."""
    direct = url is not None and url == settings.direct_database_url and pooled(settings)
    if direct:  # a real session, without the pooler: the timeout rides on it as when direct
        kwargs = connect_kwargs(dataclasses.replace(settings, pool_mode="session"),
                                f"queen-{role}:{settings.broker_id}")
    else:
        kwargs = connect_kwargs(settings, f"queen-{role}:{settings.broker_id}")
    # through the pooler, the primary is found by asking (WritableBehindPooler)
    cls = WritableBehindPooler if pooled(settings) and not direct else AsyncConnection
    conn = await cls.connect(conninfo(url or settings.database_url, settings), **kwargs)
    if direct:
        _DIRECT.add(conn)
    if cls is AsyncConnection and read_only_server(conn):  # WritableBehindPooler asked already
        await conn.close()
        raise ReadOnlyServer(f"{role}: the server is read-only (a standby, or fenced); not using it")
    return conn
