"""Request bodies, read and parsed in one place for every route that has one.

What a client sends never decides how much memory the broker uses:

- Size: POST /api/v1/timers takes at most QUEEN_MAX_BODY_BYTES, every
  other route QUEEN_LOG_MAX_BODY_BYTES. A Content-Length over the cap is
  refused before a byte is read; a body without one (chunked) is refused
  as soon as the bytes read pass it. 413 {"error": "body_too_large"}.
- Budget: the bodies in flight of one broker weigh at most
  QUEEN_BODY_BUDGET_BYTES, one tenant's at most half of it (so with one
  other tenant busy, a tenant finds room for its largest legal request at
  once). A body is weighed before it is read (its Content-Length times the
  route's weight; a chunked body as it arrives). A request that does not
  fit waits, in arrival order (BodyBudget), up to QUEEN_BODY_WAIT_MS for
  bodies ahead of it to finish, then gets 503 timers_unavailable with
  Retry-After. The weight is held until
  the response is sent (BodyBudgetRelease), whatever happens to the request.
- JSON: UTF-8 (RFC 8259), no NaN/Infinity, nesting at most MAX_JSON_DEPTH
  levels, at most QUEEN_JSON_MAX_VALUES values in all. A body over
  SMALL_BODY_BYTES is scanned as its bytes arrive (JsonScanner), so an
  excess is refused (400 timers_bad_request) when the parser reaches it,
  not after the whole body was buffered and decoded.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import math
import re
import time
from collections import deque
from heapq import heapify, heappop, heappush
from itertools import accumulate
from typing import Callable

import msgspec
import orjson
from starlette.requests import ClientDisconnect, Request

from .errors import ApiError, bad_request

# The payload ceiling (decoded) and what it weighs in a JSON body as base64.
PAYLOAD_CEILING_BYTES = 1 << 20
BASE64_CEILING_BYTES = 4 * math.ceil(PAYLOAD_CEILING_BYTES / 3)   # 1,398,104
# Per operation, besides the payload: the identifiers at their limits
# (255 + 1024 + 255 + 255 bytes) even if every byte were sent as a 6-byte
# \u escape, field names, delayMs, and `/` of the base64 sent as `\/`.
PER_OP_OVERHEAD_BYTES = 32 * 1024
BODY_ENVELOPE_BYTES = 64 * 1024

MAX_JSON_DEPTH = 128
# Bodies up to this size are read whole and parsed in one call (under a
# millisecond); larger ones are scanned as they arrive.
SMALL_BODY_BYTES = 64 * 1024
# A larger body is scanned (and its member's elements decoded) in slices of
# SCAN_SLICE bytes, and the request's task lets the loop run the others once
# it has scanned for SCAN_TURN_S: a read of up to 256 KiB of a body dense in
# small arrays and objects (Python steps per bracket) took 0.2 s in one go, and
# four such bodies held every other tenant's requests for over a second (the
# Dec 7 audit). With turns of 0.5 ms, four such bodies at once left another
# tenant's DELETE a p50 of 6 ms (20 ms with turns of 2 ms).
SCAN_SLICE = 8 * 1024
SCAN_TURN_S = 0.0005
# A body without a list of elements (configure, ack, lease extend, the cell's
# switches) is decoded in one call at its end, so its size is what bounds that
# call: 64 KiB, where the largest legal one is a few hundred bytes. (A dense 3 MB
# configure took 0.5 s in msgspec alone.) Push, ack/batch and transaction take
# QUEEN_LOG_MAX_BODY_BYTES, element by element.
LISTLESS_MAX_BODY_BYTES = SMALL_BODY_BYTES
LISTLESS_LIMIT = "a body without a list of items, acknowledgments or operations"
# What a body weighs in the budget, per byte of it. The timer route
# decodes each operation's base64 as soon as the operation is complete and
# streams the bytes to PostgreSQL (COPY), so it holds about 3/4 of its
# body. The log routes hold the body, the parsed document, the payloads
# re-encoded, the SQL parameters and libpq's copy of them: a 33 MB push of
# 2 KB messages took 250 MB (7.5x); small values weigh more per byte, and
# the log routes' caps on values and items bound that part.
TIMERS_WEIGHT = 1
LOG_WEIGHT = 16
# A pop's answer (no body) holds each payload several times (libpq's result,
# the row, its base64, the encoded answer) and ~3 KB per message besides: a
# pop of 8,189 messages of 2 KB (16 MiB) took 190 MB. It is weighed by
# QUEEN_POP_MAX_BYTES while it fetches, then by what it fetched.
POP_WEIGHT = 16
POP_MESSAGE_WEIGHT = 4096
POP_MAX_MESSAGES = 10000  # the largest pop batch (routes_log.MAX_BATCH)


def heaviest_request(max_body_bytes: int, log_max_body_bytes: int, pop_max_bytes: int) -> int:
    """The weight of the heaviest legal request: a timer batch, a log body or a pop.
    A tenant's half of the budget must hold it (config checks; the default is twice it)."""
    return max(max_body_bytes * TIMERS_WEIGHT, log_max_body_bytes * LOG_WEIGHT,
               pop_max_bytes * POP_WEIGHT + POP_MAX_MESSAGES * POP_MESSAGE_WEIGHT)
# A chunked body (no Content-Length) is weighed in steps of this much.
CHUNKED_STEP_BYTES = 1 << 20


def default_max_body_bytes(max_ops: int) -> int:
    """QUEEN_MAX_BODY_BYTES when unset: a full batch of full-size payloads fits.

    max_ops * (4 * ceil(1 MiB / 3) + 32 KiB) + 64 KiB; 366,368,768 for 256 ops."""
    return max_ops * (BASE64_CEILING_BYTES + PER_OP_OVERHEAD_BYTES) + BODY_ENVELOPE_BYTES


def body_too_large(cap: int, seen: int | None = None, *, variable: str = "QUEEN_MAX_BODY_BYTES") -> ApiError:
    said = f"Content-Length {seen}" if seen is not None else "the body"
    return ApiError(413, "body_too_large", f"{said} is over the broker's limit of {cap} bytes ({variable})")


# ---------------------------------------------------------------------------
# the budget of bodies in flight
# ---------------------------------------------------------------------------

HELD_KEY = "queen.body_held"    # scope key: [(tenant, weight), ...] this request holds
TENANT_KEY = "queen.tenant"     # scope key: set by Authenticator.require
SLOT_KEY = "queen.request_slot"  # scope key: the tenant whose request slot this request holds
PROTOCOL_KEY = "queen.protocol"  # scope key: the connection's protocol (server.py), which parks releases


def count_down(counts: dict[str, int], key: str, n: int) -> None:
    """Take n off a per-tenant count, dropping the tenant when it reaches 0."""
    left = counts[key] - n
    if left:
        counts[key] = left
    else:
        del counts[key]


class _Waiter:
    __slots__ = ("scope", "tenant", "n", "future", "admitted", "queued", "seq")

    def __init__(self, scope: dict, tenant: str, n: int, future: asyncio.Future, seq: int):
        self.scope, self.tenant, self.n, self.future, self.seq = scope, tenant, n, future, seq
        self.admitted = False
        self.queued = True  # in its tenant's line


class BodyBudget:
    """Weights of the bodies in flight, per broker and per tenant, with a bounded wait.

    Waiters are served in arrival order, and each reserves what it waits for: a
    later request may use only the room the ones ahead of it leave (the broker's
    and its own tenant's), so a stream of small bodies never keeps a large one
    out. A request that waits for its own tenant's half reserves nothing of the
    broker's room: it holds up its own tenant's later requests, never another's.
    A later step of a chunked body that already holds weight goes first (it must
    finish to give its weight back).

    The line is kept per tenant: a heap of the tenants' first waiters in arrival
    order, and aside the tenants whose first waiter does not fit their own half,
    until that half frees up or that waiter leaves. Admitting costs what it
    admits, however many requests a tenant has waiting on its own half (a walk
    of the whole line on every release made each of another tenant's requests
    pay for them)."""

    def __init__(self, total: int, wait_ms: int, on_refuse: Callable[[], None] | None = None):
        self.total = total
        self.on_refuse = on_refuse
        self.per_tenant = total // 2
        self.wait_s = wait_ms / 1000
        self.used = 0
        self.by_tenant: dict[str, int] = {}
        self._lines: dict[str, deque[_Waiter]] = {}  # each tenant's waiters, in arrival order
        self._heads: list[tuple[int, str]] = []  # heap: (a line's first waiter's seq, its tenant)
        self._held_up: set[str] = set()  # tenants whose first waiter waits for their own half
        self._seq = 0  # arrival order
        self._front_seq = 0  # a chunked body's later step: a seq below every other, to go first
        self._waiting = 0

    def _hold(self, scope: dict, tenant: str, n: int) -> None:
        self.used += n
        self.by_tenant[tenant] = self.by_tenant.get(tenant, 0) + n
        scope.setdefault(HELD_KEY, []).append((tenant, n))

    def _unhold(self, tenant: str, n: int) -> None:
        self.used -= n
        count_down(self.by_tenant, tenant, n)
        if tenant in self._held_up:  # its half has room again: its first waiter is looked at anew
            self._new_first(tenant, self._lines[tenant])

    async def take(self, scope: dict, tenant: str, n: int, deadline: float | None = None) -> float:
        """Hold `n` for `tenant` until the request ends; returns the wait's deadline
        (a chunked body's later steps share it). 503 when it does not fit in time."""
        loop = asyncio.get_running_loop()
        if deadline is None:
            deadline = loop.time() + self.wait_s
        if n > self.per_tenant:  # cannot happen for a legal request (config checks it)
            raise busy(f"the body weighs {n} bytes, over a tenant's share of the budget")
        if n <= 0 or (not self._waiting and self.used + n <= self.total
                      and self.by_tenant.get(tenant, 0) + n <= self.per_tenant):
            self._hold(scope, tenant, n)  # nobody waits and it fits: the common case
            return deadline
        line = self._lines.get(tenant)
        if line is None:
            line = self._lines[tenant] = deque()
        if scope.get(HELD_KEY):
            self._front_seq -= 1
            waiter = _Waiter(scope, tenant, n, loop.create_future(), self._front_seq)
            line.appendleft(waiter)
        else:
            self._seq += 1
            waiter = _Waiter(scope, tenant, n, loop.create_future(), self._seq)
            line.append(waiter)
        self._waiting += 1
        if line[0] is waiter:
            self._new_first(tenant, line)
        self._admit()
        if not waiter.admitted:
            timer = loop.call_at(deadline, self._expire, waiter)
            try:
                await waiter.future
            except asyncio.CancelledError:  # the client went away: its place is given up
                self._leave(waiter)
                raise
            finally:
                timer.cancel()
        if not waiter.admitted:
            if self.on_refuse is not None:
                self.on_refuse()
            raise busy("the broker's budget for request bodies in flight is in use")
        return deadline

    def _new_first(self, tenant: str, line: deque[_Waiter]) -> None:
        self._held_up.discard(tenant)
        heads = self._heads
        heappush(heads, (line[0].seq, tenant))
        if len(heads) > 2 * len(self._lines) + 64:
            # entries of firsts that left while the budget was full (_admit pops them only
            # when there is room): rebuilt in place, so the heap stays bounded by the lines
            heads[:] = [(waiting[0].seq, t) for t, waiting in self._lines.items() if t not in self._held_up]
            heapify(heads)

    def _expire(self, waiter: _Waiter) -> None:
        if not waiter.future.done():
            self._leave(waiter)
            waiter.future.set_result(None)

    def _leave(self, waiter: _Waiter) -> None:
        """A waiter that gives up: what it reserved is free for the ones behind it."""
        if waiter.admitted or not waiter.queued:
            return
        self._dequeue(waiter)
        self._admit()

    def _dequeue(self, waiter: _Waiter) -> None:
        tenant = waiter.tenant
        line = self._lines[tenant]
        first = line[0] is waiter
        if first:
            line.popleft()
        else:
            line.remove(waiter)  # its own tenant's line
        waiter.queued = False
        self._waiting -= 1
        if not line:
            del self._lines[tenant]
            self._held_up.discard(tenant)
        elif first:
            self._new_first(tenant, line)
        if not self._waiting:
            self._heads.clear()  # what is left there is stale

    def _admit(self) -> None:
        """Admit the waiters that fit, in arrival order: each one, admitted or not, takes
        its weight off the room left for those behind it (the broker's room unless it is
        its own tenant's half that holds it up, and then it holds up only its tenant's)."""
        room = self.total - self.used
        heads, lines = self._heads, self._lines
        while heads and room > 0:
            seq, tenant = heads[0]
            line = lines.get(tenant)
            if line is None or line[0].seq != seq or tenant in self._held_up:
                heappop(heads)  # stale: that waiter has gone, or its tenant is set aside
                continue
            w = line[0]
            if w.future.done():  # cancelled (its client gone): leaves the line, reserving nothing
                self._dequeue(w)
                continue
            if w.n > self.per_tenant - self.by_tenant.get(tenant, 0):
                heappop(heads)  # its own tenant's half holds it up, and its tenant's later ones
                self._held_up.add(tenant)
                continue
            if w.n > room:
                return  # it reserves the room it waits for: nobody behind it is admitted
            room -= w.n
            self._dequeue(w)
            self._hold(w.scope, tenant, w.n)
            w.admitted = True
            w.future.set_result(None)

    def resize_last(self, scope: dict, n: int) -> None:
        """Shrink (or drop, n=0) what this request took last: a pop holds its estimate
        while it fetches, then what it actually holds."""
        held = scope.get(HELD_KEY)
        tenant, had = held[-1]
        n = min(n, had)
        if n:
            held[-1] = (tenant, n)
        else:
            held.pop()
        self._unhold(tenant, had - n)
        self._admit()

    def shrink_to(self, scope: dict, n: int) -> int:
        """Hold at most `n` in all for this request (its last weights cut first): an
        answer that has left Python for the connection's buffer holds its bytes there,
        no longer the objects it was built from (server.py's park). Returns what it cut."""
        held = scope.get(HELD_KEY)
        excess = sum(w for _, w in held) - max(n, 0) if held else 0
        if excess <= 0:
            return 0
        cut_total = excess
        while excess > 0 and held:
            tenant, w = held[-1]
            cut = min(w, excess)
            if cut == w:
                held.pop()
            else:
                held[-1] = (tenant, w - cut)
            self._unhold(tenant, cut)
            excess -= cut
        self._admit()
        return cut_total

    def release(self, scope: dict) -> int:
        """Give back everything the request holds; admit the waiters that now fit."""
        held = scope.pop(HELD_KEY, None)
        if not held:
            return 0
        freed = 0
        for tenant, n in held:
            self._unhold(tenant, n)
            freed += n
        self._admit()
        return freed

    @property
    def waiting(self) -> int:
        return self._waiting


class RequestSlots:
    """Requests in progress on this broker, per tenant: one tenant holds at most
    `per_tenant` of them (QUEEN_TENANT_MAX_REQUESTS), so requests it keeps open
    (slow bodies, long polls) cannot take every slot of QUEEN_MAX_CONNECTIONS
    from the others. Two busy tenants at their shares would still fill them, so
    once fewer than a quarter of the `total` slots are free, a tenant that shares
    the broker takes another only while it holds fewer than are free: each further
    busy tenant leaves half of what it found, and a tenant holding none always
    finds one unless about log2(total) tenants are busy at once. A slot is taken
    when the request is authenticated (Authenticator.require) and given back with
    its body weight (release_body)."""

    def __init__(self, per_tenant: int, total: int | None = None):
        self.per_tenant = per_tenant
        self.total = total
        self.in_use = 0
        self.by_tenant: dict[str, int] = {}

    def take(self, scope: dict, tenant: str) -> None:
        if SLOT_KEY in scope:  # a route that authenticates twice holds one slot
            return
        n = self.by_tenant.get(tenant, 0)
        # capacity, as the body budget's tenant half: 503 (a 429 is a rung of the gate ladder,
        # which a DELETE never meets; docs/limits.md)
        if n >= self.per_tenant:
            raise ApiError(503, "timers_unavailable",
                           f"this tenant has {n} requests in progress on this broker, its share "
                           f"(QUEEN_TENANT_MAX_REQUESTS); retry when one ends", {"Retry-After": "1"})
        if self.total is not None and self.in_use > n:  # another tenant holds slots too
            free = self.total - self.in_use
            if free < self.total // 4 and n >= free:
                raise ApiError(503, "timers_unavailable",
                               f"this tenant has {n} requests in progress on this broker and {free} of "
                               f"QUEEN_MAX_CONNECTIONS's slots are free, which other tenants may need; "
                               f"retry when one ends", {"Retry-After": "1"})
        self.by_tenant[tenant] = n + 1
        self.in_use += 1
        scope[SLOT_KEY] = tenant

    def release(self, scope: dict) -> None:
        tenant = scope.pop(SLOT_KEY, None)
        if tenant is not None:
            count_down(self.by_tenant, tenant, 1)
            self.in_use -= 1


def busy(detail: str) -> ApiError:
    return ApiError(503, "timers_unavailable",
                    f"{detail} (QUEEN_BODY_BUDGET_BYTES); retry", {"Retry-After": "1"})


# glibc keeps freed memory for reuse unless told otherwise: a broker that
# parsed a few hundred MB would keep that RSS for good. Allocations of
# 128 KiB and more are mapped and unmapped on their own (a fixed threshold:
# glibc otherwise raises it to the largest block freed), and after a large
# body the heap is trimmed.
_M_MMAP_THRESHOLD = -3
TRIM_AFTER_BYTES = 8 << 20


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return None


_LIBC = _libc()


def tune_malloc() -> None:
    if _LIBC is not None and hasattr(_LIBC, "mallopt"):
        _LIBC.mallopt(_M_MMAP_THRESHOLD, 128 * 1024)


def trim_malloc() -> None:
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


class BodyBudgetRelease:
    """ASGI middleware: whatever a request held of the budget is given back when it
    ends: after its response, on an error, or when the client went away mid-body."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            release_body(scope)


def answer_weight(payload_bytes: int, messages: int) -> int:
    """What an answer holding stored payloads weighs: a pop's weights (each payload is
    held several times: libpq's result, the row, its base64 and JSON, the encoded answer)."""
    return POP_WEIGHT * payload_bytes + POP_MESSAGE_WEIGHT * messages


async def weigh_answer(request: Request, tenant: str, most_bytes: int, most_messages: int) -> None:
    """Before a fetch of stored payloads (a message's detail, a DLQ page, a timer's peek):
    hold what the answer may weigh at most, waiting as a body does (503 past
    QUEEN_BODY_WAIT_MS); once fetched, weigh_fetched shrinks it to what it holds."""
    budget = request.app.state.body_budget
    # at most a tenant's half: the heaviest legal request fits it (config), and a stored
    # payload is smaller than the body that brought it
    await budget.take(request.scope, tenant, min(answer_weight(most_bytes, most_messages), budget.per_tenant))


def weigh_fetched(request: Request, payload_bytes: int, messages: int) -> None:
    request.app.state.body_budget.resize_last(request.scope, answer_weight(payload_bytes, messages))


def release_body(scope, park: bool = True) -> None:
    """Give back what the request of `scope` holds of the body budget (if anything),
    and its tenant's request slot (RequestSlots): now, or, while its answer is still
    in the connection's buffer (a client not reading), once it has left (server.py's
    park) or the connection is closed."""
    if SLOT_KEY not in scope and HELD_KEY not in scope:
        return
    if park and (protocol := scope.get(PROTOCOL_KEY)) is not None and protocol.park(scope):
        return
    if SLOT_KEY in scope:
        scope["app"].state.request_slots.release(scope)
    if HELD_KEY in scope:
        budget = scope.get("app") and scope["app"].state.body_budget
        if budget is not None and budget.release(scope) >= TRIM_AFTER_BYTES:
            trim_malloc()


# ---------------------------------------------------------------------------
# the incremental scan
# ---------------------------------------------------------------------------

class JsonLimit(ValueError):
    """The text passes a limit (nesting, values, elements of an array)."""


_STRUCT = re.compile(rb'["\[\]{},]')
# strings without escapes, and anything but quotes, backslashes and brackets
_RUN = re.compile(rb'(?:"[^"\\]*"|[^"\\\[\]{}])*')
_SIMPLE_STRING = re.compile(rb'"[^"\\]*"')
# Inside a value (past the member's level), a run of complete values nested at
# most FAST_NEST levels below where it starts, in one C call: possessive and
# atomic, so it never backtracks, and it stops before a container or string the
# bytes so far leave open. Its commas and brackets, strings taken out, are the
# values it adds; nothing else is kept of it. Body dense in small arrays and
# objects cost a Python step per bracket before: 2 s of CPU for a 3 MB body.
_ANY_STRING_TEXT = rb'"(?:[^"\\]++|\\.)*+"'
_ANY_STRING = re.compile(_ANY_STRING_TEXT, re.DOTALL)
FAST_NEST = 12


def _segment_pattern(levels: int) -> bytes:
    inner = rb'(?:[^\[\]{}"]++|' + _ANY_STRING_TEXT + rb')*+'
    for _ in range(levels):
        inner = rb'(?:[^\[\]{}"]++|' + _ANY_STRING_TEXT + rb'|[\[{]' + inner + rb'[\]}])*+'
    return inner


_SEGMENT = re.compile(_segment_pattern(FAST_NEST), re.DOTALL)
# the rest of a string's body: stops at its closing quote, or at the end of
# what has arrived (a trailing backslash is left for the next chunk)
_STRING_REST = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*', re.DOTALL)


class JsonScanner:
    """Follows a JSON text chunk by chunk, in C loops (regular expressions over
    strings and between structural characters), and refuses it (JsonLimit) the
    moment it nests deeper than max_depth or holds more than max_values values
    (commas plus arrays and objects: an upper bound), or the array of the top-level
    member `member` holds more than member_cap elements.

    It keeps the bytes for one parse at the end (finish), except that each element
    of the member array is cut out as soon as it is complete, parsed alone, given
    to on_item, and replaced by `0` in the kept text: the timer route decodes an
    operation's base64 while the next one arrives, and never holds the text."""

    def __init__(self, *, max_values: int, max_depth: int = MAX_JSON_DEPTH,
                 member: bytes | None = None, member_cap: int | None = None,
                 member_refusal: Callable[[int], str] | None = None,
                 on_item: Callable[[object], object] | None = None,
                 kept_cap: int | None = None, item_cap: int | None = None):
        self.max_values, self.max_depth = max_values, max_depth
        self.kept_cap, self.item_cap = kept_cap, item_cap
        self.member, self.member_cap = member, member_cap
        self.member_refusal = member_refusal
        self.on_item = on_item
        self.buf = bytearray()
        self.pos = 0
        self.in_string = False
        self.string_start = 0
        self.depth = 0
        self.values = 1
        self.top_is_object = None      # the first container's kind, once seen
        self.last_key = (0, 0)         # span of the last string closed at depth 1
        self.in_member = False         # inside the member array (depth 2)
        self.member_arrays = 0
        self.item_start = 0
        self.item_count = 0
        self.items: list = []

    def feed(self, chunk: bytes) -> None:
        buf = self.buf
        buf += chunk
        i, n = self.pos, len(buf)
        while i < n:
            if self.in_string:
                # memchr first: a base64 payload has no backslash, so no escape to honour
                end = buf.find(b'"', i)
                if buf.find(b"\\", i, n if end < 0 else end) >= 0:
                    end = _STRING_REST.match(buf, i).end()  # stops before a trailing lone backslash
                    closed = end < n and buf[end] == 0x22
                else:
                    closed = end >= 0
                    end = end if closed else n
                if not closed:  # resume here with the next chunk
                    i = end
                    break
                self.in_string = False
                if self.depth == 1:
                    self.last_key = (self.string_start, end)
                i = end + 1
                continue
            if self.depth >= 2 + self.in_member and self.depth + FAST_NEST <= self.max_depth:
                end = _SEGMENT.match(buf, i).end()
                if end > i:
                    seg = bytes(buf[i:end])
                    if b'"' in seg:
                        seg = _ANY_STRING.sub(b"", seg)
                    k = seg.count(b",") + seg.count(b"[") + seg.count(b"{")
                    if k:
                        self._count(k)
                    i = end
                    if i >= n:
                        break
            if not (self.in_member and self.depth == 2):
                # a run of values in one C call: strings without escapes, numbers, literals,
                # commas (only the member array's commas delimit elements one by one)
                end = _RUN.match(buf, i).end()
                if end > i:
                    run = bytes(buf[i:end])
                    commas = run.count(b",")
                    if b'"' in run:
                        if commas:
                            commas = _SIMPLE_STRING.sub(b"", run).count(b",")
                        if self.depth == 1:  # the run's last string may be the next key
                            close = i + run.rindex(b'"')
                            self.last_key = (buf.rindex(b'"', 0, close) + 1, close)
                    if commas:
                        self._count(commas)
                    i = end
                    if i >= n:
                        break
            m = _STRUCT.search(buf, i)
            if m is None:
                i = n
                break
            j = m.start()
            c = buf[j]
            if c == 0x22:  # "
                self.in_string = True
                self.string_start = j + 1
            elif c == 0x2C:  # ,
                self._count(1)
                if self.in_member and self.depth == 2:
                    j = self._cut_item(j)
                    n = len(buf)
            elif c in (0x5B, 0x7B):  # [ {
                self.depth += 1
                if self.depth > self.max_depth:
                    raise JsonLimit(f"nests deeper than {self.max_depth} levels")
                self._count(1)
                if self.depth == 1:
                    self.top_is_object = c == 0x7B
                elif (self.depth == 2 and c == 0x5B and self.top_is_object and self.member is not None
                      and bytes(buf[self.last_key[0]:self.last_key[1]]) == self.member):
                    self.member_arrays += 1
                    if self.member_arrays > 1:
                        raise JsonLimit(f"has the member {self.member.decode()!r} more than once")
                    self.in_member = True
                    self.item_start = j + 1
            else:  # ] }
                if self.in_member and self.depth == 2:
                    j = self._cut_item(j)
                    n = len(buf)
                    self.in_member = False
                self.depth -= 1
            i = j + 1
        self.pos = i
        if self.kept_cap is not None:
            self._check_kept()

    def _check_kept(self) -> None:
        """With a member (the timer route), what is kept besides the element that is
        arriving stays small, and so does that element: the text of one operation
        is parsed whole, so it is bounded like everything else."""
        outside = self.item_start if self.in_member else len(self.buf)
        if outside > self.kept_cap:
            raise JsonLimit(f"has more than {self.kept_cap} bytes outside the elements of "
                            f"{self.member.decode()!r}")
        if self.in_member and self.item_cap is not None and len(self.buf) - self.item_start > self.item_cap:
            raise ApiError(413, "body_too_large",
                           f"element {self.item_count} of {self.member.decode()!r} is over {self.item_cap} "
                           f"bytes of JSON, the most one element may take")

    def _count(self, k: int) -> None:
        self.values += k
        if self.values > self.max_values:
            raise JsonLimit(f"holds more than {self.max_values} JSON values")

    def _cut_item(self, j: int) -> int:
        """The member array's element in buf[item_start:j] is complete: parse it
        alone, hand it to on_item, keep `0` in its place. Returns where j is now."""
        raw = bytes(self.buf[self.item_start:j])
        if not raw.strip():  # `[]`, or a stray comma: left for the final parse to judge
            self.item_start = j + 1
            return j
        self.item_count += 1
        if self.member_cap is not None and self.item_count > self.member_cap:
            if self.member_refusal is not None:
                raise bad_request(self.member_refusal(self.member_cap))
            raise JsonLimit(f"has more than {self.member_cap} elements in {self.member.decode()!r}")
        item = _loads(raw)
        self.items.append(self.on_item(item) if self.on_item is not None else item)
        self.buf[self.item_start:j] = b"0"
        j = self.item_start + 1
        self.item_start = j + 1
        return j

    def finish(self) -> object:
        """The whole document, the member array's elements put back in place."""
        document = _loads(bytes(self.buf))
        if self.member_arrays:
            array = document.get(self.member.decode()) if isinstance(document, dict) else None
            if not isinstance(array, list) or len(array) != len(self.items):
                raise ValueError("the kept text does not match the elements cut out")
            array[:] = self.items
        return document


class JsonNotUnicode(ValueError):
    """A string of the text is a lone surrogate escape: JSON, but no Unicode."""


class JsonNumberRange(ValueError):
    """A number of the text is beyond what the broker holds: a float past a 64-bit
    float's range (about 1.8e308), or an integer of more than 4,300 digits (Python's
    bound on turning one into text). JSON sets no limit."""


_decode = msgspec.json.decode


def _loads(raw: bytes) -> object:
    """Strict JSON (RFC 8259) as Python values. msgspec reads it: an integer past 64
    bits stays an exact int, where orjson reads it as a float and a pushed payload's
    digits changed (found Dec 7). A text msgspec refuses is read again by orjson,
    whose words tell a lone surrogate and a number out of range from bad JSON."""
    try:
        return _decode(raw)
    except msgspec.DecodeError as refused:
        try:
            orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            if "surrogate in string" in str(exc):  # orjson's words for a lone \uD800-\uDFFF escape
                raise JsonNotUnicode(str(exc)) from None
            if "infinity when parsed as double" in str(exc):  # 1e400, or an integer of 310 digits or more
                raise JsonNumberRange(str(exc)) from None
            raise
        if "out of range" in str(refused):  # msgspec's words for an integer past 4,300 digits
            raise JsonNumberRange(str(refused)) from None
        raise ValueError(str(refused)) from None


# A JSON string (an unterminated one runs to the end: never rescanned), or
# anything else; brackets outside strings are what nest.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = [0] * 256
for _b in b"[{":
    _STEP[_b] = 1
for _b in b"]}":
    _STEP[_b] = -1


def _outside_strings(raw: bytes) -> bytes:
    """The JSON text with its strings cut out (what is left is where brackets nest)."""
    if b"\\" in raw:
        return _STRING.sub(b"", raw)
    # no escapes: the strings are exactly every other piece between quotes (5x faster than the regex)
    return b"".join(raw.split(b'"')[::2])


def _brackets_exceed(outside: bytes, limit: int) -> bool:
    brackets = outside.translate(None, _NOT_BRACKET)
    if brackets.count(b"[") + brackets.count(b"{") <= limit:
        return False
    # Innermost pairs stripped, at most two levels a pass: a text emptied within limit // 2
    # passes is well nested and no deeper than the limit (a 6.7 MB document: 7 ms, where
    # the running sum below took 42). Anything else gets the exact sum.
    rest = brackets
    for _ in range(limit // 2):
        shorter = rest.replace(b"[]", b"").replace(b"{}", b"")
        if not shorter:
            return False
        if len(shorter) == len(rest):
            break
        rest = shorter
    return max(accumulate(map(_STEP.__getitem__, brackets))) > limit


def json_depth_exceeds(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when the JSON text nests arrays/objects deeper than `limit`.
    Linear, in C loops: strings are cut out, brackets kept, depth summed."""
    return _brackets_exceed(_outside_strings(raw), limit)


# A number token's exponent (a digit then e/E), and a run of 300 digits: the only
# numbers that can fall outside what parse_json reads (a float's range, 4,300 digits).
# Found in one translation of the text outside strings: digits to 0, e and E to e.
_NUMBER_SHAPE = bytes(0x30 if 0x30 <= b <= 0x39 else 0x65 if b in b"eE" else 0x20 for b in range(256))
_LONG_NUMBER = b"0" * 300
# below this size a payload is parsed whole: quicker than the steps (2 us for 54 bytes)
_SKIP_FROM_BYTES = 4096


def json_text_ok(raw: bytes) -> bool:
    """parse_json(raw) would accept `raw`: decided without building its values (a
    stored payload shown as `data` is embedded as it is, payloads.json_data_fragment).
    UTF-8 and the depth checked in C loops, the grammar by msgspec skipping over the
    text (msgspec.Raw: 12 ms for a 6.7 MB document dense in objects, where parsing it
    into values took 310 ms, all of it holding the event loop); a text with an exponent
    or a 300-digit run outside its strings is parsed whole, for the numbers' range."""
    if len(raw) < _SKIP_FROM_BYTES:
        return _parses(raw)
    try:
        raw.decode("utf-8")  # the skip does not check the bytes inside strings
    except UnicodeDecodeError:
        return False
    outside = _outside_strings(raw)
    if _brackets_exceed(outside, MAX_JSON_DEPTH):
        return False
    try:
        _RAW.decode(raw)  # the grammar, lone surrogate escapes included
    except (msgspec.DecodeError, RecursionError):
        return False
    shape = outside.translate(_NUMBER_SHAPE)
    return not (b"0e" in shape or _LONG_NUMBER in shape) or _parses(raw)


def _parses(raw: bytes) -> bool:
    try:
        parse_json(raw)
    except ValueError:
        return False
    return True


_RAW = msgspec.json.Decoder(msgspec.Raw)


class JsonTooDeep(JsonLimit):
    """The text nests deeper than the limit."""


def values_bound(raw: bytes) -> int:
    """An upper bound of the values in a JSON text (commas and brackets), in C."""
    return raw.count(b",") + raw.count(b"[") + raw.count(b"{") + 1


def parse_json(raw: bytes, *, limit: int = MAX_JSON_DEPTH, max_values: int | None = None) -> object:
    """Strict JSON from bytes, parsed whole; ValueError (with a reason) when it is not."""
    if json_depth_exceeds(raw, limit):
        raise JsonTooDeep(f"nests deeper than {limit} levels")
    # commas and brackets bound the values from above: only a body near the
    # cap pays for the exact scan
    if max_values is not None and values_bound(raw) > max_values:
        scanner = JsonScanner(max_values=max_values, max_depth=limit)
        scanner.feed(raw)
    return _loads(raw)


# ---------------------------------------------------------------------------
# reading a body
# ---------------------------------------------------------------------------

class LoopTurns:
    """The loop's turn for the others, once a request's task has worked for SCAN_TURN_S
    (counted from its last turn, or from its start: at worst one turn too many): a body's
    scan, and the stored payloads an answer checks one by one (routes_log)."""

    __slots__ = ("since",)

    def __init__(self) -> None:
        self.since = time.perf_counter()

    async def maybe(self) -> None:
        if time.perf_counter() - self.since > SCAN_TURN_S:
            await asyncio.sleep(0)
            self.since = time.perf_counter()


async def _pieces(request: Request, turns: LoopTurns, *, timers: bool, listless: bool):
    """The body in pieces of at most SCAN_SLICE bytes, under the route's cap and the
    budget; the loop gets its turn between pieces once this request has had its
    SCAN_TURN_S (the caller's work on a piece counts). `listless`: a log route whose
    body has no list of elements (LISTLESS_MAX_BODY_BYTES)."""
    settings = request.app.state.settings
    if timers:
        cap, weight, variable = settings.max_body_bytes, TIMERS_WEIGHT, "QUEEN_MAX_BODY_BYTES"
    elif listless:
        cap, weight, variable = LISTLESS_MAX_BODY_BYTES, LOG_WEIGHT, LISTLESS_LIMIT
    else:
        cap, weight, variable = settings.log_max_body_bytes, LOG_WEIGHT, "QUEEN_LOG_MAX_BODY_BYTES"
    budget: BodyBudget = request.app.state.body_budget
    tenant = request.scope.get(TENANT_KEY, "default")
    declared = request.headers.get("content-length")
    held = 0
    deadline = None
    if declared is not None:
        try:
            length = int(declared)
        except ValueError:
            raise bad_request("Content-Length is not an integer") from None
        if length > cap:
            raise body_too_large(cap, length, variable=variable)
        if length > 0:  # weighed before a byte is read
            deadline = await budget.take(request.scope, tenant, length * weight)
            held = length
    seen = 0
    try:
        # a body trickled in (or never finished) must not hold its weight for ever
        async with asyncio.timeout(settings.body_timeout_ms / 1000):
            async for chunk in request.stream():
                if not chunk:
                    continue
                seen += len(chunk)
                if seen > cap:
                    raise body_too_large(cap, variable=variable)
                if seen > held:  # chunked (or a body longer than announced: uvicorn refuses that)
                    step = min(max(CHUNKED_STEP_BYTES, seen - held), cap - held)
                    deadline = await budget.take(request.scope, tenant, step * weight, deadline)
                    held += step
                if seen <= SMALL_BODY_BYTES:  # parsed whole at its end, in well under a millisecond a KiB
                    yield chunk
                    continue
                for start in range(0, len(chunk), SCAN_SLICE):
                    yield chunk[start:start + SCAN_SLICE]
                    await turns.maybe()
    except TimeoutError:
        raise ApiError(408, "request_timeout",
                       f"the body did not arrive within {settings.body_timeout_ms} ms (QUEEN_BODY_TIMEOUT_MS); "
                       f"{seen} bytes had", {"Connection": "close"}) from None


async def read_json(request: Request, *, empty: object = ..., unicode: bool = False,
                    timers: bool = False, member: str | None = None, member_cap: int | None = None,
                    member_refusal: Callable[[int], str] | None = None,
                    on_item: Callable[[object], object] | None = None,
                    kept_cap: int | None = None, item_cap: int | None = None,
                    fast: Callable[[bytes, int], object] | None = None) -> object:
    """The body as JSON (400 timers_bad_request when it is not, 413 when too
    large, 503 when the budget has no room in time). `empty`, when given, is the
    value of an empty body. No string can hold a lone surrogate: the parser
    (orjson) refuses one, 400 (`unicode` is accepted for the callers that ask
    for that explicitly). timers=True: the timer route's cap and
    weight. member/member_cap/on_item: the top-level member whose array is
    counted and cut out element by element as it arrives (see JsonScanner).
    fast(raw, max_values): a route's fast path for a body read whole; what it
    returns (not None) is the answer. It returns None for anything it cannot
    prove valid, and the checks and refusals below then run as ever."""
    max_values = request.app.state.settings.json_max_values
    small = bytearray()
    scanner: JsonScanner | None = None

    turns = LoopTurns()

    async def consume() -> None:
        nonlocal scanner
        async with contextlib.aclosing(_pieces(request, turns, timers=timers, listless=member is None)) as pieces:
            async for piece in pieces:
                if scanner is not None:
                    scanner.feed(piece)
                    continue
                small.extend(piece)
                if len(small) <= SMALL_BODY_BYTES:
                    continue
                scanner = JsonScanner(max_values=max_values, member=member.encode() if member else None,
                                      member_cap=member_cap, member_refusal=member_refusal, on_item=on_item,
                                      kept_cap=kept_cap, item_cap=item_cap)
                first = bytes(small)
                small.clear()
                _check_utf8_prefix(first)
                for start in range(0, len(first), SCAN_SLICE):
                    scanner.feed(first[start:start + SCAN_SLICE])
                    await turns.maybe()

    try:
        try:
            await consume()
            if scanner is None:
                raw = bytes(small)
                if not raw and empty is not ...:
                    return empty
                if fast is not None and (done := fast(raw, max_values)) is not None:
                    return done
                raw.decode("utf-8")  # UnicodeDecodeError is a ValueError
                return parse_json(raw, max_values=max_values)
            body = scanner.finish()
            return body
        except ClientDisconnect:
            raise
        except JsonLimit as exc:
            raise bad_request(f"the body {exc}: see the JSON limits (nesting {MAX_JSON_DEPTH}, "
                              f"QUEEN_JSON_MAX_VALUES {max_values})") from None
        except UnicodeDecodeError:
            raise bad_request("the body is not valid JSON (not UTF-8)") from None
        except JsonNotUnicode:
            raise bad_request("the body holds a string that is not valid Unicode "
                              "(a lone surrogate escape)") from None
        except JsonNumberRange:
            raise bad_request("the body holds a number beyond the broker's range: a 64-bit float's "
                              "(about 1.8e308), or an integer of more than 4,300 digits") from None
        except ValueError:
            raise bad_request("the body is not valid JSON") from None
    except ApiError:
        raise


def _check_utf8_prefix(raw: bytes) -> None:
    """The scanned path's first bytes are UTF-8 (orjson checks every piece it
    parses; this catches a binary body before the scan walks it)."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(raw) - 3:  # not merely a character cut at the chunk's end
            raise
