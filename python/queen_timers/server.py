"""The HTTP server's own refusals in the documented JSON shape.

uvicorn answers a request it cannot parse (a malformed request line, or
a request head over the parser's limit: e.g. a path with a megabyte-long
timerKey) with a plain-text 400 before the app sees it. These protocol
classes say the same thing as {"error", "detail"}.

The broker serves HTTP with JsonErrorHttpToolsProtocol (uvicorn's httptools
protocol: the llhttp parser, in C). llhttp itself puts no bound on a
request line or a header; this class refuses a request head (request line
plus headers) over MAX_HEAD_BYTES, the limit h11 applies by default, so that
a client can neither make the broker buffer an unbounded head nor see a
different limit than before. JsonErrorH11Protocol is the pure-Python h11
equivalent (uvicorn's default parser), kept for the tests that compare them.

More bounds that no client can lift: a request head must have arrived
within head_timeout_s of the connection (or of the request's first byte),
else 408 request_timeout and the connection is closed (uvicorn waits for a
head for ever: a client trickling one byte at a time held its connection).
QUEEN_MAX_CONNECTIONS bounds two things. Requests in progress: past it, a
new one is answered 503 timers_unavailable in JSON (uvicorn's own answer is
plain text). Connections held open: past it, the connection idle longest
(between keep-alive requests, or its head not complete) is closed to let the
new one in (_admit), as nginx reuses its keep-alive connections. uvicorn's
limit_concurrency counted idle connections as load: anyone holding that many
open and silent, with no credential, had every other request answered 503.

An answer a client does not read keeps its request's body weight and slot
until it has left the broker's buffer, and a client that takes none of it for
send_timeout_s (QUEEN_SEND_TIMEOUT_MS) has its connection reset (park, below).

The same protocol serves a DELETE on the timer key route without uvicorn's
request cycle (the direct lane, below; docs/design.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import json
import logging
import resource
import socket
import struct
import termios
import urllib.parse

import h11
import httptools
from uvicorn.protocols.http import h11_impl, httptools_impl
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from . import db
from .bodies import PROTOCOL_KEY, TRIM_AFTER_BYTES, release_body, trim_malloc
from .config import MAX_HEAD_BYTES, tenant_share
from .convertors import RAW_PATH_KEY
from .errors import STOPPED_BODY, STOPPED_HEADERS

# header fields in one request head: 3,000 empty ones fit in 16 KiB and cost 2-3 ms of CPU
# for a 401 (every layer walks the list); Node.js stops at 2,000, a client sends about 10
MAX_HEADERS = 100
# requests a connection may have queued behind the one being served (HTTP/1.1 pipelining)
MAX_PIPELINED = 32
# a read longer than this is fed to the parser in pieces of it: a token that never ends is
# refused within MAX_HEAD_BYTES + FEED_SLICE of its start, wherever in a read it starts
FEED_SLICE = MAX_HEAD_BYTES // 2
# an answer sent before its request's body had all come (a 401, 404, 413...): the rest of
# the body is read and dropped for at most this long and this many bytes, then the connection
# is closed (nginx's lingering close); uvicorn read and dropped it for as long as it came
LINGER_S = 2.0
LINGER_BYTES = 1024 * 1024
# file descriptors a broker needs besides its HTTP connections: its database connections
# (the request and read pools, the sweeper's, retention's), the listening socket, stdio, logs
OTHER_FILES = 64


def fit_open_files(settings):
    """QUEEN_MAX_CONNECTIONS connections need as many file descriptors. A process past its
    RLIMIT_NOFILE cannot accept(): every new client, whoever it is, has its connection
    dropped without an answer, so one client holding idle sockets would take the broker
    down before _admit could reclaim any. The soft limit (1,024 under systemd's default)
    is raised as far as the hard one allows; if that is still short, QUEEN_MAX_CONNECTIONS
    is lowered to fit, with a warning, so that the bound the broker enforces is one it can."""
    reserve = OTHER_FILES + 2 * settings.pool_max  # the request and read pools at their largest
    need = settings.max_connections + reserve
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(hard, need)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= need:
        return settings
    fits = max(1, soft - reserve)
    tenant = min(settings.tenant_max_requests, tenant_share(fits, settings.auth))
    logging.getLogger("queen_timers").warning(
        "QUEEN_MAX_CONNECTIONS=%s needs %s open files and this process may open %s (RLIMIT_NOFILE, "
        "hard limit %s): serving at most %s connections (QUEEN_TENANT_MAX_REQUESTS %s); raise the "
        "limit (ulimit -n, systemd LimitNOFILE) to serve more", settings.max_connections, need, soft,
        hard, fits, tenant)
    return dataclasses.replace(settings, max_connections=fits, tenant_max_requests=tenant)

BAD_REQUEST_BODY = json.dumps({
    "error": "timers_bad_request",
    "detail": "the request is not valid HTTP/1.1, or its request line and headers are over "
              "16 KiB or 100 header fields (a path carries a queue of at most 255 bytes and a "
              "timerKey of at most 1024)",
}).encode()


HEAD_TIMEOUT_BODY = json.dumps({
    "error": "request_timeout",
    "detail": "the request line and headers did not arrive in time (QUEEN_HEAD_TIMEOUT_MS)",
}).encode()
BUSY_BODY = json.dumps({
    "error": "timers_unavailable",
    "detail": "the broker is serving QUEEN_MAX_CONNECTIONS requests at once; retry",
}).encode()
STOPPING_BODY = json.dumps({
    "error": "timers_unavailable",
    "detail": "the broker is stopping and this request's body had not all come within "
              "QUEEN_SHUTDOWN_TIMEOUT_MS; nothing was written: retry",
}).encode()
RECLAIMED_BODY = json.dumps({
    "error": "timers_unavailable",
    "detail": "the broker holds QUEEN_MAX_CONNECTIONS connections and closed this one, whose request "
              "head was the slowest to arrive; retry",
}).encode()


async def json_service_unavailable(scope, receive, send) -> None:
    """uvicorn's answer past limit_concurrency, in the documented JSON shape."""
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(BUSY_BODY)).encode()),
                            (b"retry-after", b"1"), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": BUSY_BODY, "more_body": False})


# uvicorn looks the function up in its protocol modules when the limit is passed
httptools_impl.service_unavailable = json_service_unavailable
h11_impl.service_unavailable = json_service_unavailable


class ProtocolLog(logging.LoggerAdapter):
    """uvicorn.error as the protocol and its request cycles use it, less the warning uvicorn
    writes for every request it cannot parse: answered (a JSON 400) and closed, that is the
    client's mistake, and with one connection each a client could fill the broker's log."""

    QUIET = frozenset({"Invalid HTTP request received."})

    @property
    def level(self) -> int:  # uvicorn reads logger.level
        return self.logger.level

    def warning(self, msg, *args, **kwargs) -> None:
        if msg not in self.QUIET:
            self.logger.warning(msg, *args, **kwargs)


class HeadTooLarge(Exception):
    """Raised from a parser callback: llhttp stops and raises HttpParserCallbackError."""


class OneWrite:
    """A request cycle's transport that sends a response's head with its body.

    uvicorn writes the status line and headers on http.response.start and the
    body on http.response.body: two send() calls, two TCP segments, and the
    client woken twice for a small answer. This holds the head of a response
    that has a body to come (a Content-Length above 0) and writes it with the
    first piece of the body. Anything else goes through at once: a 100 Continue,
    a chunked or empty response, an answer to HEAD; close() writes a head still
    held first (a response that failed after its start ends as before)."""

    __slots__ = ("_transport", "_cycle", "_head", "_sent_head")
    JOIN_BYTES = 64 * 1024  # a larger body is written after the head, not copied onto it

    def __init__(self, transport, cycle):
        self._transport, self._cycle = transport, cycle
        self._head: bytes | None = None
        self._sent_head = False

    def write(self, data: bytes) -> None:
        scope = self._cycle.scope
        scope[ANSWER_BYTES_KEY] = scope.get(ANSWER_BYTES_KEY, 0) + len(data)  # park weighs it
        head = self._head
        if head is not None:
            self._head = None
            if len(data) <= self.JOIN_BYTES:
                self._transport.write(head + data)
                return
            self._transport.write(head)
        elif not self._sent_head and self._cycle.response_started:
            self._sent_head = True  # the first write after the start is the head
            c = self._cycle
            if c.chunked_encoding is False and c.expected_content_length > 0 and c.scope["method"] != "HEAD":
                self._head = data
                return
        self._transport.write(data)

    def close(self) -> None:
        if self._head is not None:
            self._transport.write(self._head)
            self._head = None
        self._transport.close()

    def __getattr__(self, name):
        return getattr(self._transport, name)


class _NoEvent:
    def set(self) -> None:
        pass


class DirectCycle:
    """What uvicorn's protocol reads and writes of a request cycle (on_message_complete,
    connection_lost, shutdown, the next request's on_headers_complete), for a request
    the direct lane serves: it has no body and no ASGI messages."""

    __slots__ = ("keep_alive", "response_complete", "disconnected", "more_body", "body", "began")
    message_event = _NoEvent()
    transport = None

    def __init__(self, keep_alive: bool):
        self.keep_alive = keep_alive
        self.response_complete = self.disconnected = self.began = False
        self.more_body = True
        self.body = b""


def json_headers(body: bytes) -> list[tuple[bytes, bytes]]:
    """A JSON 200's headers as Starlette's Response writes them (app.HotRoutes.respond_direct
    and DirectWait give them to _write_direct)."""
    return [(b"content-length", b"%d" % len(body)), (b"content-type", b"application/json")]


class DirectWait:
    """A direct-lane request whose statement is on the wire, waiting for its result
    without a task: the database socket's reader callback reads it (db.Call.take_result)
    and, when the call ends at once (db.Call.row_now), writes the 200 from the route's
    body function, as _serve_direct would, without waking a task (about 12 us of a
    DELETE at one client, bench/history/2026-12-07-delete-blocks.md). An error, a
    statement the session lost or a connection that cannot be given back at once goes
    on in _serve_direct's task, from the result already read. In the protocol's tasks
    until it ends, as a task is: the admission count, the wait of a stop and its cancel."""

    __slots__ = ("proto", "cycle", "hit", "scope", "started", "body", "fd", "ended")

    def __init__(self, proto: "JsonErrorHttpToolsProtocol", cycle: DirectCycle, hit, scope, started, body, fd: int):
        self.proto, self.cycle, self.hit, self.scope = proto, cycle, hit, scope
        self.started, self.body, self.fd = started, body, fd
        self.ended = False
        proto.tasks.add(self)
        proto.loop.add_reader(fd, self.readable)

    def done(self) -> bool:
        return self.ended

    def readable(self) -> None:
        call = self.started.call
        if not call.take_result():
            return
        self._end()
        self.proto.tasks.discard(self)
        try:
            row = call.row_now()
        except Exception as exc:  # row() raises it, with the lease's end
            call.error, row = exc, db.NOT_NOW
        proto, cycle, scope = self.proto, self.cycle, self.scope
        if row is db.NOT_NOW:  # row() ends it, in the task, from the result read
            proto._serve_by_task(cycle, self.hit, scope, None, self.started)
            return
        try:
            body = self.body(self.started, row)
        except Exception as exc:  # answered as the endpoint's own raise
            proto._serve_by_task(cycle, self.hit, scope, None, exc)
            return
        try:
            proto._write_direct(cycle, 200, json_headers(body), body)
        finally:
            release_body(scope)

    def _end(self) -> None:
        self.ended = True
        self.proto.loop.remove_reader(self.fd)

    def cancel(self, msg=None) -> bool:
        """A stop that waited long enough (uvicorn cancels what is left, iterating over
        the tasks: removed on the loop's next turn, as a cancelled task is)."""
        if self.ended:
            return False
        self._end()
        self.started.abandon()  # a statement in flight: the connection is closed, never pooled
        if not self.cycle.response_complete:  # its database never answered (errors.STOPPED_BODY)
            self.proto._write_direct(self.cycle, 503, STOPPED_HEADERS, STOPPED_BODY)
        release_body(self.scope)
        self.proto.loop.call_soon(self.proto.tasks.discard, self)
        return True


def _cancelled(timer) -> None:
    """Cancel a loop timer if one is armed; None, for the attribute that held it."""
    if timer is not None:
        timer.cancel()


def _nothing() -> None:
    pass


async def _no_body() -> dict:
    return {"type": "http.request", "body": b"", "more_body": False}


ANSWER_BYTES_KEY = "queen.answer_bytes"  # scope key: the bytes of the answer's body written (OneWrite)


def _shrink_held(scope: dict, n: int) -> None:
    """The body budget's weight of a parked request down to `n`, what its answer still
    holds; the objects it was built from are freed: the allocator is trimmed after a
    large cut, as release_body does."""
    app = scope.get("app")
    budget = getattr(getattr(app, "state", None), "body_budget", None)
    if budget is not None and budget.shrink_to(scope, n) >= TRIM_AFTER_BYTES:
        trim_malloc()


class JsonErrorHttpToolsProtocol(HttpToolsProtocol):
    head_timeout_s = 10.0  # with_timeouts() makes a class with the broker's settings
    send_timeout_s = 60.0
    send_min_rate = 0.0  # bytes per second a parked answer must leave at, on average (0: no bound)
    shutdown_timeout_s = 10.0
    _drain_timer: asyncio.TimerHandle | None = None
    _head_bytes = 0
    _head_fields = 0
    _head_open = False  # a request has begun and its headers are not complete
    _raw_head = 0       # bytes received while a head stayed open
    _head_timer: asyncio.TimerHandle | None = None
    _head_since = 0.0   # when the open head (or the connection, before its first) began
    _keep_timer: asyncio.TimerHandle | None = None
    _kept_since: float | None = None  # when the connection went idle after an answer (None: it is not)
    _send_watch: asyncio.TimerHandle | None = None
    _send_left = 0       # bytes the client had not taken at the last look (_unsent)
    _send_progress = 0.0  # when the client last took some of them
    _parked: list | None = None  # requests whose answer is still in the buffer (park)
    _park_deadline: float | None = None  # when the parked answers must have left (send_min_rate)
    _refusing = False  # MAX_PIPELINED queued: the rest of what the client sent is dropped
    _events = 0          # parser callbacks so far: bytes that bring none are one unfinished token
    _quiet = 0           # bytes received past a request's head since the parser's last callback
    _linger_timer: asyncio.TimerHandle | None = None  # armed: answered, the body still coming, dropped
    _linger_bytes = 0

    @classmethod
    def with_timeouts(cls, head_seconds: float, send_seconds: float,
                      shutdown_seconds: float = 10.0, send_min_rate: float = 0.0) -> type["JsonErrorHttpToolsProtocol"]:
        return type(cls.__name__, (cls,), {"head_timeout_s": head_seconds, "send_timeout_s": send_seconds,
                                           "shutdown_timeout_s": shutdown_seconds, "send_min_rate": send_min_rate})

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.logger = ProtocolLog(self.logger, {})
        # uvicorn's check counts connections as well as requests; _busy counts requests
        self.max_requests, self.limit_concurrency = self.limit_concurrency, None
        state = self.server_state
        if not hasattr(state, "queen_idle"):
            # connections serving no request, the one idle longest first (dicts keep their order)
            state.queen_idle = {}
            state.queen_default_head = (None, b"")  # _answer's: (uvicorn's default headers, their bytes)
        self._idle: dict = state.queen_idle

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_since = self.loop.time()
        self._start_head_timer()  # a connection that never sends a head is closed too
        self._idle[self] = None
        if self.max_requests is not None and len(self.connections) > self.max_requests:
            self._admit()

    def connection_lost(self, exc) -> None:
        self._stop_head_timer()
        self._stop_linger()
        self._drain_timer = _cancelled(self._drain_timer)
        self._keep_timer = _cancelled(self._keep_timer)
        self._stop_send_watch()
        self._idle.pop(self, None)
        super().connection_lost(exc)
        self._release_parked()

    # -- answers the client does not take -----------------------------------
    # uvicorn writes an answer into the transport's buffer and ends the request
    # at once: a client that never reads left it there (a pop's 17 MB answer,
    # twenty of them 400 MB of RSS while the body budget said 0 in use). A request
    # whose answer is still above the buffer's high-water mark keeps its weight in
    # the body budget and its request slot until the buffer drains (park, from
    # bodies.release_body), and a client that takes none of it for
    # send_timeout_s (QUEEN_SEND_TIMEOUT_MS) has its connection reset, which
    # gives them back: nginx's send_timeout. A parked answer weighs what it still
    # holds: its body, whole (uvloop keeps the object written until its last byte has
    # left the buffer), and anything ahead of it; no longer the objects it was built
    # from. One that a client reads, but slower than send_min_rate on average
    # (QUEEN_SEND_MIN_BYTES_PER_S, after a send timeout's grace), is reset too: two
    # clients reading 64 KB every 30 s held 571 MB of the budget, their pops'
    # weights, for as long as they liked, and a third tenant's pops got 503 (Dec 8
    # review).

    def park(self, scope: dict) -> bool:
        """Hold the release of `scope`'s budget weight and slot until this connection's
        answers have left the buffer (or the connection is gone); False: nothing to wait for.
        A transport closing after its answer (the client sent Connection: close) still holds
        it until the client takes it; a lost connection's flow is no longer paused."""
        if not self.flow.write_paused:
            return False
        if self._parked is None:
            self._parked = []
        self._parked.append(scope)
        left = self._unsent()
        _shrink_held(scope, max(left, scope.get(ANSWER_BYTES_KEY, 0)))
        if self.send_min_rate > 0:
            due = self.loop.time() + self.send_timeout_s + left / self.send_min_rate
            self._park_deadline = due if self._park_deadline is None else max(self._park_deadline, due)
        return True

    def _release_parked(self) -> None:
        self._park_deadline = None
        parked, self._parked = self._parked, None
        for scope in parked or ():
            release_body(scope, park=False)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_watch is None:
            self._send_left = self._unsent()
            self._send_progress = self.loop.time()
            self._send_watch = self.loop.call_later(self._send_step(), self._watch_send)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stop_send_watch()
        self._release_parked()

    def _unsent(self) -> int:
        """Bytes of answers the client has not acknowledged: the transport's buffer and
        the kernel's send queue (TIOCOUTQ), which holds megabytes the client may read slowly."""
        left = self.transport.get_write_buffer_size()
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            try:
                left += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
            except OSError:
                pass
        return left

    def _send_step(self) -> float:
        return min(1.0, self.send_timeout_s / 4)

    def _stop_send_watch(self) -> None:
        self._send_watch = _cancelled(self._send_watch)

    def _watch_send(self) -> None:
        self._send_watch = None
        # a closing transport is watched too: it closes only once its buffer has left,
        # and a client that sent Connection: close and reads nothing held it for ever
        if not self.flow.write_paused:
            return
        left, now = self._unsent(), self.loop.time()
        too_slow = self._park_deadline is not None and now >= self._park_deadline
        if left < self._send_left and not too_slow:  # the client took some: it is reading
            self._send_left, self._send_progress = left, now
        elif too_slow or now - self._send_progress >= self.send_timeout_s:
            getattr(self.app, "on_send_timed_out", _nothing)()
            sock = self.transport.get_extra_info("socket")
            if sock is not None:  # a reset: the kernel drops what it still holds for the client too
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.transport.abort()  # connection_lost releases what its requests held
            return
        self._send_watch = self.loop.call_later(self._send_step(), self._watch_send)

    def _admit(self) -> None:
        """One connection too many: close the one idle longest, not this new one. A
        keep-alive connection between requests is closed as its keep-alive timeout
        would close it (its client opens another); one still sending its head gets
        a JSON 503. None idle (every connection is serving a request): this one stays,
        and its request meets _busy; the next connection to arrive reclaims it first
        if it is still idle, so connections never exceed the limit by more than one."""
        victim = next(iter(self._idle))
        if victim is self:
            return
        self._idle.pop(victim)
        getattr(self.app, "on_connection_reclaimed", _nothing)()
        if victim._head_open:
            victim._send_json(503, RECLAIMED_BODY, ((b"retry-after", b"1"),))
        else:
            victim.transport.close()

    def _busy(self) -> bool:
        if self.max_requests is None or len(self.tasks) < self.max_requests:
            return False
        # a task that has just answered leaves the set a loop turn later (its done callback):
        # a keep-alive client's next request must not be refused for its own last one
        return sum(1 for task in self.tasks if not task.done()) >= self.max_requests

    # -- a stop (SIGTERM) ---------------------------------------------------
    # uvicorn closes the idle connections, lets each request in flight finish and
    # waits for every connection to close, for ever by default: a client trickling
    # a body (QUEEN_BODY_TIMEOUT_MS, 120 s) or slowly reading an answer held a stop
    # that long. The app's long polls answer at once (app.begin_drain); after
    # shutdown_timeout_s (QUEEN_SHUTDOWN_TIMEOUT_MS) a request still receiving its
    # body is answered 503 (it has written nothing) and a connection whose client
    # has yet to take an answer is reset. A request in its database call is left to
    # end (its statement timeout bounds it); cli.py gives uvicorn a later deadline
    # that cancels anything left.

    def shutdown(self) -> None:
        getattr(self.app, "begin_drain", _nothing)()
        super().shutdown()
        if self._drain_timer is None:  # closing too: an answer may still wait for its client
            self._drain_timer = self.loop.call_later(self.shutdown_timeout_s, self._drain_lapsed)

    def _drain_lapsed(self) -> None:
        self._drain_timer = None  # connection_lost cancels it: the connection is still here
        cycle = self._unanswered()
        if cycle is None:
            self.transport.abort()  # an answer the client has not taken (closing or not), or no request
        elif cycle.more_body and not isinstance(cycle, DirectCycle) and not self.transport.is_closing():
            self._answer_instead(cycle, 503, STOPPING_BODY, ((b"retry-after", b"1"),))
        # else: in its database call; its statement timeout ends it

    def _unanswered(self):
        """The request being served when its answer has not begun, else None."""
        cycle = self.cycle
        if cycle is None or cycle.response_complete or getattr(cycle, "response_started", False):
            return None
        return cycle

    def _answer_instead(self, cycle, status: int, body: bytes, extra=()) -> None:
        """Answer `cycle`'s request with this JSON error and close; its own answer, if it
        ever comes, is dropped (a disconnected cycle sends nothing)."""
        cycle.disconnected = True
        self._send_json(status, body, extra)

    def on_response_complete(self) -> None:
        cycle = self.cycle  # the request just answered, unless others wait behind it
        if (not self.pipeline and cycle is not None and cycle.response_complete and cycle.more_body
                and not self.transport.is_closing()):
            self._start_linger()
        if self.pipeline or self.transport.is_closing():
            super().on_response_complete()  # uvicorn's: the next pipelined request, or nothing
            return
        # uvicorn's, with its keep-alive timer armed lazily as the head's is (_keep_alive_lapsed);
        # uvicorn's own (timeout_keep_alive_task) is never armed: only its path above arms it
        self.server_state.total_requests += 1
        self.flow.resume_reading()
        self._kept_since = self.loop.time()
        if self._keep_timer is None:
            self._keep_timer = self.loop.call_later(self.timeout_keep_alive, self._keep_alive_lapsed)
        self._idle.pop(self, None)  # idle, waiting for the next request:
        self._idle[self] = None  # the most recently idle goes last

    # -- an answer before the body, a token that never ends ------------------

    def _start_linger(self) -> None:
        self._linger_bytes = 0
        if self._linger_timer is None:
            self._linger_timer = self.loop.call_later(LINGER_S, self._linger_lapsed)

    def _stop_linger(self) -> None:
        self._linger_timer = _cancelled(self._linger_timer)

    def _linger_lapsed(self) -> None:
        self._linger_timer = None
        self.transport.close()

    # A client's end of stream (FIN) closes the connection, as uvicorn does: TCP does not tell
    # a half-close (shutdown(SHUT_WR)) from a close, and a client gone must not keep a long
    # poll leasing or consuming for nobody. nginx takes it the same way (its 499).

    def _too_quiet(self) -> None:
        """MAX_HEAD_BYTES past a request's head with no parser callback: a chunk-size line,
        chunk extension or trailer that never ends (llhttp buffers it, at a cost that grows
        with its square; the head's bound did not reach it)."""
        cycle = self._unanswered()
        if cycle is None:
            self.transport.abort()
        else:
            self._answer_instead(cycle, 400, BAD_REQUEST_BODY)

    def _keep_alive_lapsed(self) -> None:
        self._keep_timer = None
        if self._kept_since is None:
            return  # a request came: its answer arms the timer again
        left = self._kept_since + self.timeout_keep_alive - self.loop.time()
        if left > 0:  # idle again since a later answer
            self._keep_timer = self.loop.call_later(left, self._keep_alive_lapsed)
            return
        self.timeout_keep_alive_handler()

    # The head's timer is armed lazily: a head that completes leaves it armed, and when
    # it fires with a later head open it is armed again for that head's time left. A
    # busy keep-alive connection pays one call_later per head_timeout_s, not a
    # call_later and a cancel per request.

    def _start_head_timer(self, delay: float | None = None) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s if delay is None else delay,
                                                    self._head_timed_out)

    def _stop_head_timer(self) -> None:
        self._head_timer = _cancelled(self._head_timer)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or (self.cycle is not None and not self._head_open):
            return  # no head open (a request is being served, or the connection waits for its next)
        left = self._head_since + self.head_timeout_s - self.loop.time()
        if left > 0:  # this head began after the timer was armed
            self._start_head_timer(left)
            return
        self._send_json(408, HEAD_TIMEOUT_BODY)

    # -- pipelining -----------------------------------------------------------
    # llhttp parses a whole chunk (up to 256 KB) at once and uvicorn queues every
    # request in it behind the one being served: 256 KB of tiny requests held 5 MB
    # on one connection, outside any budget. Past MAX_PIPELINED queued, the
    # connection answers those and closes after the last (Connection: close), as
    # nginx's keepalive_requests closes one; the rest of the chunk is parsed and
    # dropped, and what comes after is not read. A client sends what was not
    # answered again on a new connection (RFC 9112 9.3.2).

    def _queue_full(self) -> bool:
        if len(self.pipeline) < MAX_PIPELINED:
            return False
        self._refusing = True
        self.pipeline[0][0].keep_alive = False  # the newest queued: the connection's last answer
        self.flow.pause_reading()
        return True

    def on_message_begin(self) -> None:
        self._events += 1
        if self._refusing:
            return  # nothing of a dropped request is built (uvicorn's callbacks below are skipped too)
        self._head_bytes = 0
        self._head_fields = 0
        self._head_open = True
        self._raw_head = 0
        self._head_since = self.loop.time()
        self._start_head_timer()
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._events += 1
        self._head_open = False  # the head's timer lapses when it finds no head open
        if self._refusing or self._queue_full():
            return
        self._idle.pop(self, None)  # serving a request: never reclaimed
        self.scope[PROTOCOL_KEY] = self  # bodies.release_body parks the request's release here
        if self._direct():
            return
        if self._busy():  # uvicorn's path to its (JSON) 503
            app, self.app = self.app, json_service_unavailable
            try:
                super().on_headers_complete()
            finally:
                self.app = app
        else:
            super().on_headers_complete()
        if self.cycle is not None and not isinstance(self.cycle.transport, OneWrite):
            self.cycle.transport = OneWrite(self.transport, self.cycle)

    # -- the direct lane --------------------------------------------------
    # A DELETE on the timer key route (app.HotRoutes) has no body and a small JSON
    # answer: it is served here, without uvicorn's RequestResponseCycle and ASGI
    # messages (an asyncio.Event, the cycle, two send() calls with a regex per
    # header; it took 10 us of the broker's CPU and 0.03 ms of p50 off a DELETE in
    # an A/B on this machine, docs/design.md). The endpoint, its handlers, JSON 500
    # and budget release are app.HotRoutes.respond's; the answer's bytes are those
    # uvicorn writes (status line, its default headers, the response's headers, the
    # body) in one write. Anything unusual (a body, Expect, an upgrade, HTTP/1.0 or
    # Connection: close, a pipelined request, the concurrency limit, a root path,
    # the access log) takes uvicorn's own path.

    def _direct(self) -> bool:
        if self.parser.get_method() != b"DELETE" or self.access_log or self.root_path:
            return False
        hot = getattr(self.app, "hot", None)
        if hot is None or self.expect_100_continue or self.parser.get_http_version() != "1.1" \
                or self.parser.should_upgrade() or not self.parser.should_keep_alive():
            return False
        if self.cycle is not None and not self.cycle.response_complete:
            return False  # pipelined behind a request still being served: uvicorn queues it
        if self.flow.write_paused:
            return False  # an answer before it is still unsent: uvicorn's path waits for the client
        if self._busy():
            return False  # uvicorn's path to the JSON 503
        for name, value in self.headers:
            if name == b"transfer-encoding" or (name == b"content-length" and value != b"0"):
                return False
        scope = self.scope
        parsed = httptools.parse_url(self.url)
        raw_path = parsed.path
        path = text = raw_path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        scope["method"], scope["path"], scope["raw_path"] = "DELETE", path, raw_path
        scope[RAW_PATH_KEY] = (path, text)  # the key route matches the raw path (convertors.RawRoute)
        scope["query_string"] = parsed.query or b""
        hit = hot.match_raw("DELETE", text)
        if hit is None:
            return False
        # The endpoint's first half (its statement on the wire) before anything else is built:
        # PostgreSQL runs it while the task is made and scheduled (app.HotRoutes.starts).
        app, started = self.app, None
        wait = app.turn_now(scope)
        start = hot.starts.get(hit[0])
        if start is not None and wait is None:
            scope["app"], scope["path_params"] = app, hit[1]
            try:
                started = start(app, scope)
            except Exception as exc:  # answered by the task, as the endpoint's own raise
                started = exc
        hot.on_direct()
        self.cycle = cycle = DirectCycle(keep_alive=True)
        body = hot.bodies.get(hit[0])
        if body is not None and started is not None and not isinstance(started, Exception) \
                and started.call is not None and (fd := started.call.waitable()) is not None:
            DirectWait(self, cycle, hit, scope, started, body, fd)
            return True
        self._serve_by_task(cycle, hit, scope, wait, started)
        return True

    def _serve_by_task(self, cycle: DirectCycle, hit, scope, wait, started) -> None:
        task = self.loop.create_task(self._serve_direct(cycle, hit, scope, wait, started))
        # the task may be cancelled before its first step (a stop): its finally never runs
        task.add_done_callback(lambda t: self._direct_done(t, cycle, scope, started))
        self.tasks.add(task)

    def _direct_done(self, task, cycle: DirectCycle, scope, started) -> None:
        self.tasks.discard(task)
        if not cycle.began:  # what the request holds, given back as its finally would
            if started is not None and not isinstance(started, Exception):
                started.abandon()
            release_body(scope)

    async def _serve_direct(self, cycle: DirectCycle, hit, scope, wait, started) -> None:
        # the answer is written first and the request's slot given back after it, as on
        # uvicorn's path (app.HotRoutes.serve): an answer the client does not take parks it
        cycle.began = True
        try:
            if wait is not None:  # its tenant's turn (turns.py), taken in _direct
                await wait
            hot = self.app.hot
            answer = hot.answers.get(hit[0])
            if answer is not None:
                status, headers, body = await hot.respond_direct(self.app, answer, hit, scope, _no_body, started)
            else:
                response = await hot.respond(self.app, hit, scope, _no_body)
                status, headers, body = response.status_code, response.raw_headers, response.body
            self._write_direct(cycle, status, headers, body)
        except asyncio.CancelledError:  # a stop, its database call unanswered (errors.STOPPED_BODY)
            if not cycle.response_complete:
                self._write_direct(cycle, 503, STOPPED_HEADERS, STOPPED_BODY)
            raise
        finally:
            release_body(scope)

    def _write_direct(self, cycle: DirectCycle, status: int, headers, body: bytes) -> None:
        if cycle.disconnected:
            return
        if any(name == b"connection" and b"close" in value.lower() for name, value in headers):
            cycle.keep_alive = False
        elif not cycle.keep_alive:  # shutdown() asked for it
            headers = [*headers, (b"connection", b"close")]
        self.transport.write(self._answer(status, headers, body))
        cycle.response_complete = True
        if not cycle.keep_alive:
            self.transport.close()
        self.on_response_complete()

    def data_received(self, data: bytes) -> None:
        if len(data) <= FEED_SLICE:
            self._feed(data)
            return
        # A long read is fed in slices: what the parser holds without a callback (a chunk
        # line, extension or trailer that never ends) is counted from the slice it starts
        # in, not only from the next read when the same read also carried the head or a
        # chunk (one read is up to 256 KiB).
        for start in range(0, len(data), FEED_SLICE):
            self._feed(data[start:start + FEED_SLICE])
            if self.transport.is_closing() or self._refusing:
                return

    def _feed(self, data: bytes) -> None:
        if self._refusing:  # the last queued answer closes the connection; nothing more is read
            self.flow.pause_reading()
            return
        if self._linger_timer is not None:  # the timer closes it at LINGER_S
            self._linger_bytes += len(data)
            if self._linger_bytes > LINGER_BYTES:
                self.transport.close()
                return
        # httptools buffers a header's name or value until it ends, so on_header
        # alone would let a header that never ends grow without bound: count the
        # bytes of every chunk after which the head is still open.
        self._kept_since = None  # not idle: the keep-alive timer lapses when it fires
        events = self._events
        super().data_received(data)
        if self.transport.is_closing():
            return
        if self._head_open:
            self._raw_head += len(data)
            if self._raw_head > MAX_HEAD_BYTES:
                self.send_400_response("request head too large")
        elif events == self._events and self.cycle is not None and self.cycle.more_body:
            self._quiet += len(data)  # past the head, and not one callback: a token still open
            if self._quiet > MAX_HEAD_BYTES:
                self._too_quiet()
        else:
            self._quiet = 0

    def on_url(self, url: bytes) -> None:  # called once per chunk of the request target
        self._events += 1
        if self._refusing:
            return
        self._head_bytes += len(url)
        if self._head_bytes > MAX_HEAD_BYTES:
            raise HeadTooLarge
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._events += 1
        if self._refusing:
            return
        self._head_bytes += len(name) + len(value) + 4  # ": " and CRLF
        self._head_fields += 1
        if self._head_bytes > MAX_HEAD_BYTES or self._head_fields > MAX_HEADERS:
            raise HeadTooLarge
        super().on_header(name, value)

    def on_body(self, body: bytes) -> None:
        self._events += 1
        if not self._refusing:
            super().on_body(body)

    def on_chunk_header(self) -> None:  # defined: llhttp reports each chunk, progress for _quiet
        self._events += 1

    def on_chunk_complete(self) -> None:
        self._events += 1

    def on_message_complete(self) -> None:
        self._events += 1
        self._stop_linger()  # the body came whole (if it was lingering): the connection goes on
        if not self._refusing:
            super().on_message_complete()

    _upgrade_noted = False

    def _unsupported_upgrade_warning(self) -> None:
        # uvicorn logs two warnings (183 bytes) for every request asking for a WebSocket,
        # credential or not: a client could fill the disk. The broker has no WebSocket
        # route and serves such a request as plain HTTP (RFC 9110 7.8 lets it ignore
        # Upgrade); that is said once per process.
        if not JsonErrorHttpToolsProtocol._upgrade_noted:
            JsonErrorHttpToolsProtocol._upgrade_noted = True
            self.logger.warning("a request asked to upgrade the connection (WebSocket); the broker has no "
                                "WebSocket route and serves such requests as plain HTTP (said once)")

    def send_400_response(self, msg: str) -> None:  # overrides uvicorn's text/plain answer
        self._send_json(400, BAD_REQUEST_BODY)

    def _send_json(self, status: int, body: bytes, extra=()) -> None:
        if self.transport.is_closing():
            return
        self.transport.write(self._answer(status, [(b"content-type", b"application/json"),
                                                   (b"content-length", str(len(body)).encode()),
                                                   (b"connection", b"close"), *extra], body))
        self.transport.close()

    def _answer(self, status: int, headers, body: bytes) -> bytes:
        """A response as uvicorn writes one: status line, its default headers (date,
        server), the given headers, the body. The default headers' bytes are joined once
        per list: uvicorn replaces the list when the date changes, once a second."""
        state = self.server_state
        defaults, head = state.queen_default_head
        if defaults is not state.default_headers:
            defaults = state.default_headers
            head = b"".join(b"%s: %s\r\n" % pair for pair in defaults)
            state.queen_default_head = (defaults, head)
        out = [STATUS_LINE[status], head]
        for name, value in headers:
            out += (name, b": ", value, b"\r\n")
        out += (b"\r\n", body)
        return b"".join(out)


class JsonErrorH11Protocol(H11Protocol):
    def send_400_response(self, msg: str) -> None:  # overrides uvicorn's text/plain answer
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(BAD_REQUEST_BODY)).encode()),
                   (b"connection", b"close")]
        try:
            self.transport.write(self.conn.send(h11.Response(status_code=400, headers=headers,
                                                             reason=b"Bad Request")))
            self.transport.write(self.conn.send(h11.Data(data=BAD_REQUEST_BODY)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:  # h11 cannot answer in this state: fall back
            super().send_400_response(msg)
            return
        self.transport.close()
