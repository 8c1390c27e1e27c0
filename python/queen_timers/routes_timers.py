"""The four timer routes: a thin Starlette shell over the queen.* timer functions.

    POST   /api/v1/timers                     write-only   queen.schedule_timers (gate ladder in SQL)
    DELETE /api/v1/timers/:queue/*timerKey    read-write   queen.cancel_timer (passes no rung)
    GET    /api/v1/timers/:queue/*timerKey    read-only    queen.peek_timer
    GET    /api/v1/timers/:queue              read-only    queen.list_timers

The two GET routes read QUEEN_READ_DATABASE_URL (a hot standby, possibly a
little behind) when it is set; POST and DELETE always go to the primary.

Python checks shapes (400 before any SQL), decodes base64, inflates zstd
with a bound to learn the decompressed size, encrypts for queues that
encrypt at rest, and maps results to HTTP. It never writes a timer row:
every state change is one queen.* call. SQLSTATE -> HTTP is errors.py.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from datetime import datetime, timezone
from itertools import repeat
from typing import Optional

import msgspec
from msgspec.structs import astuple
import orjson
from psycopg.rows import tuple_row
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from . import convertors, db, payloads  # noqa: F401 (convertors: registers {x:anypath})
from .auth import READ_ONLY, READ_WRITE, WRITE_ONLY
from .bodies import (PAYLOAD_CEILING_BYTES, SMALL_BODY_BYTES, TENANT_KEY, read_json, values_bound, weigh_answer,
                     weigh_fetched)
from .convertors import RawRoute, path_param
from .errors import ApiError, bad_request, from_exception, query_int, query_param
from .limits import INT32_MAX, INT32_MIN, INT64_MAX, INT64_MIN, MAX_PARTITION_BYTES, MAX_QUEUE_BYTES, MAX_TIMER_KEY_BYTES, MAX_TXN_BYTES, check_name
from .openapi import openapi_endpoint

log = logging.getLogger("queen_timers.timers")

PREFIX = "/api/v1/timers"
HINT_HEADER = "x-queen-timers-hint"
HINT_VALUE = "DELETE /api/v1/timers/:queue/*timerKey"

OPS = ("schedule", "reschedule", "cancel")
SERVER_OWNED = ("producerSub", "messageId", "tenant")
# field -> the ops that accept it (op, queue and timerKey are always required)
FIELDS: dict[str, tuple[str, ...]] = {
    "op": OPS,
    "queue": OPS,
    "timerKey": OPS,
    "txn": OPS,  # required for schedule; echoed by cancel
    "delayMs": ("schedule", "reschedule"),
    "payload": ("schedule", "reschedule"),
    "partition": ("schedule", "reschedule"),
    "payloadZstd": ("schedule", "reschedule"),
    "encrypted": ("schedule", "reschedule"),
}
FIELD_NAMES = frozenset(FIELDS)
# the ops that some field does not apply to (cancel): only theirs are checked field by field
NARROW_OPS = frozenset(op for op in OPS if any(op not in ops for ops in FIELDS.values()))

# The ops travel as ten parallel arrays in binary format (%b), built in bulk by
# db.binary_array (psycopg's own dump of a list runs element by element in
# Python): what costs PostgreSQL least (the same batch as one JSON parameter
# took 31 % more of its CPU). An array that is all NULL is sent as NULL: a
# multi-argument unnest pads it. SCHEDULE_ROWS is the verdicts in no order
# (SCHEDULE_JSON_SQL orders them in its aggregate: one sort, not two).
OPS_ARRAY = """ARRAY(SELECT ROW(o.op, o.queue, o.timer_key, o.delay_ms, o.txn, o.payload, o.partition,
                          o.payload_zstd, o.encrypted, o.raw_size)::queen.timer_op
                 FROM unnest(%(op)b::text[], %(queue)b::text[], %(timer_key)b::text[],
                             %(delay_ms)b::bigint[], %(txn)b::text[], %(payload)b::bytea[],
                             %(partition)b::text[], %(payload_zstd)b::boolean[],
                             %(encrypted)b::boolean[], %(raw_size)b::integer[])
                      WITH ORDINALITY AS o(op, queue, timer_key, delay_ms, txn, payload, partition,
                                           payload_zstd, encrypted, raw_size, n)
                ORDER BY o.n)"""
SCHEDULE_ROWS = f"""
SELECT v.ordinal, v.ok, v.status, v.queue, v.timer_key, v.txn, v.message_id, v.deliver_at
  FROM queen.schedule_timers(
         %(tenant)s,
         {OPS_ARRAY},
         %(producer_sub)s,
         %(horizon_ms)s::bigint,
         %(tenancy)s::boolean,
         p_max_ops => %(max_ops)s::integer,
         p_staged => %(staged)s::uuid) AS v
"""
SCHEDULE_SQL = SCHEDULE_ROWS + " ORDER BY v.ordinal\n"

# The route's form, one round trip in the common case: which of the batch's
# upsert queues (%(encrypt_check)b) encrypt at rest, and only when none does,
# the batch itself and its verdicts as two texts: "status messageId deliverAt"
# for every operation in input order, all joined by spaces ("-" for a value the
# verdict has not), and the txns PostgreSQL minted as "ordinal:txn" pairs
# joined by commas. Spaces cannot occur in a status, a uuid or deliverAt (as
# iso() writes it), nor commas in a minted txn. The broker echoes queue,
# timerKey and txn from the batch it validated (schedule_timers echoes them
# too) and writes the JSON (_results_json): json_agg(json_build_object(...))
# of the same verdicts cost PostgreSQL 1.2 ms per 256-op batch, this 0.25 ms.
# Only an upsert without txn gets a minted one (every other verdict echoes its
# op's txn): the minted pairs are looked for only when %(minting)s says the
# batch has such an op. The lookup reads the input txn array by subscript, a
# walk from its start for every row (text elements have no fixed width): 0.13
# ms of the server's time a 256-op batch in which nothing was minted.
# The batch is a lateral subquery under `WHERE e.queues IS NULL`, a qual with
# no column of its own that PostgreSQL plans as a one-time filter: when a queue
# encrypts, the batch is never executed (test_timers_encryption: scheduled, not
# rescheduled, billed once); it is encrypted and sent again without the check.
# Every column is a text (db.fetch_row reads texts): the encrypting queues as a
# JSON array, NULL when none.
SCHEDULE_JSON_SQL = f"""
SELECT to_json(e.queues)::text, r.triples, r.minted
  FROM (SELECT array_agg(q) AS queues
          FROM queen.encrypted_queues(%(tenant)s, %(encrypt_check)b::text[]) AS q) AS e
  LEFT JOIN LATERAL (
       SELECT coalesce(string_agg(concat_ws(' ', v.status, coalesce(v.message_id::text, '-'),
                                            coalesce(to_char(v.deliver_at AT TIME ZONE 'UTC',
                                                             'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'), '-')),
                                  ' ' ORDER BY v.ordinal), '') AS triples,
              coalesce(string_agg(v.ordinal || ':' || v.txn, ',')
                         FILTER (WHERE %(minting)s::boolean
                                   AND v.txn IS DISTINCT FROM ((SELECT %(txn)b::text[]))[v.ordinal]), '') AS minted
         FROM ({SCHEDULE_ROWS}) AS v
        WHERE e.queues IS NULL) AS r ON true
"""

# The fast path's names (ASCII, no NUL) travel as one text a column, joined by
# U+001F: one C-level join where a binary array takes 40 us a column, and
# string_to_array costs PostgreSQL no more than reading the array. A batch with
# that character in a name keeps the arrays (_route_statement). The txn column is
# read once for the minted filter (an InitPlan), not once a row.
UNIT_SEPARATOR = "\x1f"
_PACKED_COLUMNS = ("queue", "timer_key", "txn")


def _packed(sql: str) -> str:
    for name in _PACKED_COLUMNS:
        sql = sql.replace(f"%({name})b::text[]", f"string_to_array(%({name})s, E'\\x1f')")
    return sql


SCHEDULE_PACKED_JSON_SQL = _packed(SCHEDULE_JSON_SQL)
# run by db.fetch_row, compiled once
_STATEMENTS = {sql: db.Statement(sql) for sql in (SCHEDULE_JSON_SQL, SCHEDULE_PACKED_JSON_SQL)}

# the caller's queues only: a queue name is unique per tenant, not per cell
ENCRYPTING_QUEUES_SQL = "SELECT queen.encrypted_queues(%s, %s::text[]) AS name"
# The contract's ladder (DECISIONS.md: its rungs, in order) comes before this broker's own
# refusal of a queue that encrypts while it has no QUEEN_ENCRYPTION_KEY (403 feature_gated,
# _encrypt_ops): the rungs run for the batch in a transaction rolled back (rate tokens given
# back), and only a batch they pass gets the 403. A paused cell answered 403 instead of
# 503, a rate-limited tenant 403 instead of 429 (Dec 7 audit).
GATES_SQL = f"SELECT 1 FROM queen.check_timer_gates(%(tenant)s, {OPS_ARRAY}, %(horizon_ms)s::bigint, %(tenancy)s::boolean)"

# A batch whose payloads pass QUEEN_TIMERS_STAGE_BYTES is staged: its bytes are
# streamed to queen.staged_payloads by COPY (never one parameter of hundreds of
# MB, never a copy in the broker), then schedule_timers(p_staged => batch) runs
# in the same transaction, with the same checks and verdicts. Its statements may
# take longer than QUEEN_STATEMENT_TIMEOUT_MS: the transaction's timeout grows
# by STAGED_MS_PER_MIB per MiB staged (a 256 x 1 MiB batch took ~3.5 s here; the
# margin is for slow storage, where a retry would meet the same bound).
STAGE_SQL = "COPY queen.staged_payloads (batch, n, payload) FROM STDIN (FORMAT BINARY)"
STAGED_MS_PER_MIB = 250
# The JSON text of one operation is parsed whole, so it is bounded: 8 MiB, far
# past a legal one (a payload at the ceiling as base64 is 1.4 MB, 2.8 MB if every
# `/` is sent as `\/`): a larger payload or name meets its own 413 or 400 first.
OP_TEXT_CAP = 8 * 1024 * 1024


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------

def iso(value: datetime | None) -> str | None:
    """ISO-8601 UTC with microseconds and 'Z', like Queen's createdAt."""
    if value is None:
        return None
    # isoformat is C (strftime parses its format on every call): '...+00:00' -> '...Z'
    return value.astimezone(timezone.utc).isoformat(timespec="microseconds")[:-6] + "Z"


# The fields of one element of POST /api/v1/timers's "results", in the order of
# the contract (docs/http-timers.md); _results_json writes them all with one join.
_RESULT_FIELDS = ("ok", "status", "queue", "timerKey", "txn", "messageId", "deliverAt")
_OK_STATUSES = {"scheduled": "true", "rescheduled": "true", "cancelled": "true"}
_UPSERTED = frozenset(("scheduled", "rescheduled"))


def _plain(values: list) -> bool:
    """Every value a string that is its own JSON text between quotes: printable
    ASCII without a quote or backslash (the common names), checked in C."""
    if None in values:
        return False
    joined = "".join(values)
    return joined.isascii() and joined.isprintable() and '"' not in joined and "\\" not in joined


def _results_json(verdicts: list[str], queue: list, key: list, txn: list, plain: bool = False) -> bytes:
    """{"results": [...]} from SCHEDULE_JSON_SQL's verdict texts and the batch's
    own queue, timerKey and txn columns (one value per operation, in order).
    Every element is 7 values between 8 constant pieces: the pieces are laid
    out by slice assignment and joined once (a per-element format costs 1.5 us).
    A column of plain strings takes its quotes from the pieces; any other is
    encoded element by element (orjson; null for None). plain: the caller knows
    every name is plain (a minted txn, a uuid, is plain too)."""
    n = len(queue)
    if n == 0:
        return b'{"results":[]}'
    triples, minted = verdicts
    if minted:  # a reschedule without txn: PostgreSQL minted one
        txn = list(txn)
        for pair in minted.split(","):
            i, _, value = pair.partition(":")
            txn[int(i) - 1] = value
    flat = triples.split(" ")
    if len(flat) != 3 * n:
        raise RuntimeError(f"{len(flat)} verdict values for {n} operations")
    statuses, ids, ats = flat[0::3], flat[1::3], flat[2::3]
    if set(statuses) <= _UPSERTED:  # every verdict ok: one constant for the column
        oks: object = repeat("true", n)
    else:
        oks = list(map(_OK_STATUSES.get, statuses, repeat("false")))
    columns = [oks, statuses, queue, key, txn, ids, ats]
    quoted = [False, True]
    for c in (2, 3, 4):
        quoted.append(plain or _plain(columns[c]))
        if not quoted[c]:
            columns[c] = [orjson.dumps(v).decode() for v in columns[c]]
    for c in (5, 6):  # a uuid or a timestamp; "-" for a verdict without one
        quoted.append("-" not in columns[c])
        if not quoted[c]:
            columns[c] = ["null" if v == "-" else '"' + v + '"' for v in columns[c]]
    parts: list = [None] * (15 * n)
    close = ""
    for c, (name, values, q) in enumerate(zip(_RESULT_FIELDS, columns, quoted)):
        opener = ',{"' if c == 0 else ',"'
        parts[2 * c::15] = repeat(close + opener + name + ('":"' if q else '":'), n)
        parts[2 * c + 1::15] = values
        close = '"' if q else ""
    parts[14::15] = repeat(close + "}", n)
    # {"results": [...]}: the envelope Queen's clients read (queen-mq's
    # Timers.batch takes response["results"]); index-aligned with the ops.
    return ('{"results":[' + "".join(parts)[1:] + "]}").encode()


def _str(value: object) -> str | None:
    return None if value is None else str(value)


def peek_json(r: dict) -> dict:
    """A queen.peek_timer row as GET /api/v1/timers/:queue/*timerKey answers it (also the CLI's peek)."""
    return {
        "found": True, "queue": r["queue"], "timerKey": r["timer_key"], "partition": r["partition"],
        "deliverAt": iso(r["deliver_at"]), "txn": r["txn"], "messageId": _str(r["message_id"]),
        "payload": payloads.encode_base64(bytes(r["payload"])), "payloadZstd": r["payload_zstd"],
        "encrypted": r["encrypted"], "producerSub": r["producer_sub"], "attempts": r["attempts"],
        "lastError": r["last_error"], "claimed": r["claimed"],
        "createdAt": iso(r["created_at"]), "updatedAt": iso(r["updated_at"]),
    }


def list_row_json(r: dict) -> dict:
    """A queen.list_timers row as GET /api/v1/timers/:queue lists it (also the CLI's list)."""
    return {
        "timerKey": r["timer_key"], "partition": r["partition"], "deliverAt": iso(r["deliver_at"]),
        "txn": r["txn"], "messageId": _str(r["message_id"]), "payloadZstd": r["payload_zstd"],
        "encrypted": r["encrypted"], "producerSub": r["producer_sub"], "attempts": r["attempts"],
        "lastError": r["last_error"], "claimed": r["claimed"],
        "createdAt": iso(r["created_at"]), "updatedAt": iso(r["updated_at"]),
    }


def _path_or_400(request: Request) -> tuple[str, str | None]:
    return _scope_path_or_400(request.scope)


def _scope_path_or_400(scope: dict) -> tuple[str, str | None]:
    """(queue, timerKey or None) from the route's parameters. The routes are RawRoutes
    (convertors.py): matched on the raw path, so `%2F` is part of the queue's name
    (`/api/v1/timers/%2Fa/k` is queue `/a`), and `tenant/42` and `tenant%2F42` are the
    same key; each is decoded exactly once."""
    queue = path_param(scope, "queue")
    key = path_param(scope, "timerKey", optional=True)
    if not queue:
        raise bad_request("queue is required")
    check_name("queue", queue, "")
    if key is not None:
        check_name("timerKey", key, "")
    return queue, key


async def _run(request: Request, fn, *, hint: bool = False, read: bool = False):
    """Run fn(conn) on a pooled connection; map database failures to ApiError.

    hint=True (POST) adds x-queen-timers-hint to every refusal by a rung or
    by capacity, naming the cancel route that passes no rung. read=True (peek,
    list) uses the read pool (QUEEN_READ_DATABASE_URL, a hot standby) when the
    broker has one; the verdict routes always use the primary's pool."""
    return await _run_on(request.app, request.scope, fn, hint=hint, read=read)


async def _run_on(app, scope: dict, fn, *, hint: bool = False, read: bool = False):
    state = app.state
    pool = state.read_pool if read and state.read_pool is not None else state.pool
    try:
        async with pool.connection(tenant=scope.get(TENANT_KEY)) as conn:
            return await fn(conn)
    except Exception as exc:  # mapped here or re-raised to app.py's handler
        if (mapped := _mapped(exc, hint)) is exc:
            raise
        raise mapped from None


def _mapped(exc: Exception, hint: bool = False) -> Exception:
    """What a route raises for `exc`, raised by its database work: the ApiError it maps
    to (errors.from_exception), or `exc` itself (re-raised, for app.py's handler)."""
    mapped = from_exception(exc)
    if mapped is None:
        return exc
    if hint:
        _add_hint(mapped)
    return mapped


def _add_hint(error: ApiError) -> None:
    if error.status in (403, 413, 429, 503) and error.error != "forbidden":
        error.headers[HINT_HEADER] = HINT_VALUE


# ---------------------------------------------------------------------------
# POST /api/v1/timers
# ---------------------------------------------------------------------------

def _parse_ops(body: object, max_ops: int) -> list[dict]:
    """The shape checks of a batch, before any SQL. Returns the ops, validated."""
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object {\"operations\": [...]}")
    extra = sorted(k for k in body if k != "operations")
    if extra:
        raise bad_request(f"unknown field {extra[0]!r} in the body; only 'operations' is accepted")
    ops = body.get("operations")
    if not isinstance(ops, list):
        raise bad_request("operations is required and must be an array")
    if len(ops) > max_ops:
        raise bad_request(f"{len(ops)} operations; at most {max_ops} per call")
    seen: set[tuple[str, str]] = set()
    out = []
    for n, raw in enumerate(ops):
        where = f"operation {n}: "
        if not isinstance(raw, dict):
            raise bad_request(f"{where}must be an object")
        if not raw.keys() <= FIELD_NAMES:  # only then is there a name to refuse, the first one in body order
            for name in raw:
                if name in SERVER_OWNED or name.startswith("_"):
                    raise bad_request(f"{where}{name!r} is owned by the server and may not be supplied")
                if name not in FIELDS:
                    raise bad_request(f"{where}unknown field {name!r}")
        op = raw.get("op")
        if op not in OPS:
            raise bad_request(f"{where}unknown op {op!r}; expected schedule, reschedule or cancel")
        if op in NARROW_OPS:
            for name, value in raw.items():
                if op not in FIELDS[name] and value is not None:
                    raise bad_request(f"{where}{name!r} does not apply to {op}")
        parsed = {"op": op}
        for name in ("queue", "timerKey"):
            value = raw.get(name)
            if not isinstance(value, str) or value == "":
                raise bad_request(f"{where}{name} is required and must be a non-empty string")
            check_name(name, value, where)
            parsed[name] = value
        key = (parsed["queue"], parsed["timerKey"])
        if key in seen:
            raise bad_request(f"{where}({key[0]}, {key[1]}) appears more than once in the batch")
        seen.add(key)

        txn = raw.get("txn")
        if txn is not None and (not isinstance(txn, str) or txn == ""):
            raise bad_request(f"{where}txn must be a non-empty string")
        if op == "schedule" and txn is None:
            raise bad_request(f"{where}txn is required for schedule")
        if txn is not None:
            check_name("txn", txn, where)
        parsed["txn"] = txn
        if op == "cancel":
            out.append(parsed)
            continue

        delay = raw.get("delayMs")
        if delay is None:
            raise bad_request(f"{where}delayMs is required for {op}")
        if isinstance(delay, float) and not -2.0 ** 63 < delay < 2.0 ** 63:
            # the parser gives an integer past 64 bits as a float
            raise bad_request(f"{where}delayMs is out of range (a 64-bit integer)")
        if isinstance(delay, bool) or not isinstance(delay, int):
            raise bad_request(f"{where}delayMs must be an integer number of milliseconds")
        if not INT64_MIN <= delay <= INT64_MAX:
            raise bad_request(f"{where}delayMs is out of range (a 64-bit integer)")
        parsed["delayMs"] = delay

        partition = raw.get("partition")
        if partition is not None:
            if not isinstance(partition, str) or partition == "":
                raise bad_request(f"{where}partition must be a non-empty string")
            check_name("partition", partition, where)
        parsed["partition"] = partition

        for name in ("payloadZstd", "encrypted"):
            value = raw.get(name)
            if value is not None and not isinstance(value, bool):
                raise bad_request(f"{where}{name} must be a boolean")
            parsed[name] = value
        parsed["encryptedGiven"] = "encrypted" in raw and raw["encrypted"] is not None

        payload = raw.get("payload")
        if payload is None:
            raise bad_request(f"{where}payload is required for {op}")
        if isinstance(payload, Decoded):
            data = payload.data
        else:
            try:
                data = payloads.decode_base64(payload)
            except payloads.PayloadError as exc:
                raise bad_request(f"{where}{exc}") from None
        parsed["payload"] = data
        parsed["raw_size"] = None
        parsed["plain"] = None
        if parsed["payloadZstd"]:
            try:
                plain, over = payloads.inflate(data)
            except payloads.PayloadError as exc:
                raise bad_request(f"{where}{exc}") from None
            # over the absolute ceiling: limit + 1 bytes, so SQL's QTBIG rung,
            # last in the ladder, refuses it; the bytes are never stored.
            parsed["raw_size"] = len(plain)
            parsed["plain"] = None if over else plain
        out.append(parsed)
    return out


class Decoded:
    """An operation's payload, decoded from base64 as soon as the operation's text had
    arrived (the text is dropped then: a large batch is never held twice)."""
    __slots__ = ("data",)

    def __init__(self, data: bytes):
        self.data = data


def _decode_early(op: object) -> object:
    """read_json's on_item for each element of "operations": a valid base64 payload
    becomes Decoded; anything else is left for _parse_ops to refuse in its turn."""
    if isinstance(op, dict):
        text = op.get("payload")
        if isinstance(text, str):
            try:
                op["payload"] = Decoded(payloads.decode_base64(text))
            except payloads.PayloadError:
                pass
    return op


# The operator's warning that a queue encrypts at rest and the broker has no key: once a
# minute at most, however many requests meet it (a line per request would let any client
# write the log as fast as it sends).
NO_KEY_WARNING_EVERY_S = 60.0
_no_key_warned_at = [-math.inf]


def _warn_no_key(queue: str) -> None:
    now = time.monotonic()
    if now - _no_key_warned_at[0] >= NO_KEY_WARNING_EVERY_S:
        _no_key_warned_at[0] = now
        log.warning("queue %r encrypts at rest and QUEEN_ENCRYPTION_KEY is not set (said once a minute at "
                    "most; every request into such a queue is answered 403 feature_gated)", queue)


async def _ladder_first(conn, ops: list[dict], principal, settings) -> None:
    """GATES_SQL for the batch: raises the first rung that refuses it. Each payload
    travels as its size alone (raw_size), as a staged batch's does."""
    sized = [o if o["op"] == "cancel" else
             {**o, "payload": b"", "raw_size": max(len(o["payload"]), o["raw_size"] or 0)} for o in ops]
    async with conn.transaction(force_rollback=True):
        await conn.execute(GATES_SQL, _schedule_call(sized, principal.tenant, principal.sub, settings))


def _encrypt_ops(ops: list[dict], encrypting: set[str], key: bytes | None) -> None:
    """Encryption happens at schedule: for a queue that encrypts at rest the
    stored payload is Queen's envelope of the (decompressed) bytes."""
    for n, o in enumerate(ops):
        if o["op"] == "cancel" or o["queue"] not in encrypting:
            continue
        if o["encryptedGiven"]:
            raise bad_request(f"operation {n}: 'encrypted' may not be supplied: queue {o['queue']!r} "
                              "encrypts at rest and the broker sets it")
        if key is None:
            _warn_no_key(o["queue"])
            raise ApiError(403, "feature_gated",
                           f"queue {o['queue']!r} encrypts at rest and this broker has no "
                           "QUEEN_ENCRYPTION_KEY; timers into it are not available until an "
                           "operator configures one",
                           {HINT_HEADER: HINT_VALUE})
        if o["payloadZstd"]:
            if o["plain"] is None:
                continue  # decompresses past the ceiling: QTBIG refuses it, nothing is stored
            plain = o["plain"]
        else:
            plain = o["payload"]
        # the ceiling is on the client's decoded (and decompressed) bytes, not on the
        # envelope stored (queen.timer_payload_size): raw_size carries their size
        o["raw_size"] = max(len(o["payload"]), len(plain))
        o["payload"] = payloads.encrypt(key, plain)
        o["payloadZstd"] = False
        o["encrypted"] = True


COLUMNS = ("op", "queue", "timer_key", "delay_ms", "txn", "payload", "partition", "payload_zstd",
           "encrypted", "raw_size")
KINDS = (db.TextArray, db.TextArray, db.TextArray, db.Int8Array, db.TextArray, db.ByteaArray, db.TextArray,
         db.BoolArray, db.BoolArray, db.Int4Array)


def _array_params(columns: dict[str, list | tuple]) -> dict:
    """SCHEDULE_SQL's ten arrays from the columns (a column left out is all NULL)."""
    params = {name: db.binary_array(kind, columns[name]) if name in columns else None
              for name, kind in zip(COLUMNS, KINDS)}
    params["staged"] = None
    return params


def _schedule_params(ops: list[dict]) -> dict:
    """SCHEDULE_SQL's ten arrays, built in one pass from _parse_ops's operations."""
    cols: tuple[list, ...] = tuple([] for _ in COLUMNS)
    op_, queue, key, delay, txn, payload, partition, zstd, encrypted, raw_size = cols
    for o in ops:
        op_.append(o["op"])
        queue.append(o["queue"])
        key.append(o["timerKey"])
        txn.append(o["txn"])
        if o["op"] == "cancel":
            delay.append(None)
            payload.append(None)
            partition.append(None)
            zstd.append(None)
            encrypted.append(None)
            raw_size.append(None)
        else:
            delay.append(o["delayMs"])
            payload.append(o["payload"])
            partition.append(o["partition"])
            zstd.append(o["payloadZstd"])
            encrypted.append(o["encrypted"])
            raw_size.append(o["raw_size"])
    return _array_params(dict(zip(COLUMNS, cols)))


class FastBatch:
    """A batch _fast_batch proved valid: its columns, and the body's text for the rarer
    path (a queue that encrypts at rest, read from the database) that needs _parse_ops."""
    __slots__ = ("raw", "columns", "upserts", "plain")

    def __init__(self, raw: bytes, columns: dict[str, tuple], upserts: list[str], plain: bool = False):
        self.raw, self.columns, self.upserts = raw, columns, upserts
        self.plain = plain  # every name its own JSON text between quotes (see _results_json)

    def ops(self, max_ops: int) -> list[dict]:
        return _parse_ops(orjson.loads(self.raw), max_ops)


class _FastOp(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """One operation of the common batch. msgspec checks each JSON type as it parses
    (an integer delayMs, strings, booleans; an unknown field or a null where a string
    is required fails the decode; a repeated member keeps its last value, as orjson
    does) and decodes the payload from standard base64, strictly: what
    b64decode(validate=True) refuses it refuses too (it also refuses excess padding,
    which the general path then takes)."""
    op: str
    queue: str
    timerKey: str
    delayMs: int
    txn: str
    payload: bytes
    partition: Optional[str] = None
    payloadZstd: Optional[bool] = None
    encrypted: Optional[bool] = None


class _FastBody(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    operations: list[_FastOp]


_FAST_DECODER = msgspec.json.Decoder(_FastBody)
_UPSERTS = frozenset(("schedule", "reschedule"))
_NAME_LIMITS = ((1, MAX_QUEUE_BYTES), (2, MAX_TIMER_KEY_BYTES), (4, MAX_TXN_BYTES))
_FAST_FIELDS = _FastOp.__struct_fields__  # the order of astuple's values: _fast_batch's columns


def _names_ok(values: list[str] | tuple[str, ...], limit: int) -> bool:
    """Every value non-empty ASCII without NUL, within `limit` bytes."""
    if values and values[0] == values[-1] and values.count(values[0]) == len(values):  # one value n times
        values = values[:1]
    if not all(values):
        return False
    joined = "".join(values)
    return joined.isascii() and "\x00" not in joined and max(map(len, values)) <= limit


def _fast_batch(raw: bytes, max_values: int, *, max_ops: int, stage_bytes: int) -> FastBatch | None:
    """read_json's fast path for the common batch: decoded by type (msgspec) and then
    checked column by column in C-level passes instead of field by field: every
    operation a schedule or reschedule with ASCII names, a txn, an integer delayMs,
    standard base64 and no zstd; the batch within every limit. It proves exactly
    what _parse_ops would accept and builds the same columns; anything else (an
    error to name, a cancel, zstd, non-ASCII names, a batch to stage) returns None
    and takes the general path, refusals and all."""
    if len(raw) > max_values and values_bound(raw) > max_values:  # a value takes a byte at least
        return None
    try:
        ops = _FAST_DECODER.decode(raw).operations  # depth: nothing nests past the types
    except msgspec.MsgspecError:
        return None
    if not 0 < len(ops) <= max_ops:
        return None
    # the columns, in _FAST_FIELDS' order, in one transposition of the decoded ops (a pass per
    # field, and one for the optional fields, took 2.5 times as long); tuples, as zip makes them
    n = len(ops)
    cols: list[tuple | None] = list(zip(*map(astuple, ops)))
    escaped = b"\\" in raw
    optional = any(cols[i].count(None) != n for i in (6, 7, 8))
    if not optional:  # no operation gives one: not sent
        cols[6:] = (None, None, None)
    op, queue, key, delay, txn, payload, partition, zstd, encrypted = cols
    if not set(op) <= _UPSERTS:
        return None
    if not all(_names_ok(cols[i], limit) for i, limit in _NAME_LIMITS):  # type: ignore[arg-type]
        return None
    one_queue = queue.count(queue[0]) == n
    if len(set(key) if one_queue else set(zip(queue, key))) != n:  # no (queue, timerKey) twice
        return None
    if min(delay) < INT64_MIN or max(delay) > INT64_MAX:
        return None
    if optional:  # a column no operation gives is all NULL: not sent
        if partition.count(None) == n:
            cols[6] = None
        elif not _names_ok([p for p in partition if p is not None], MAX_PARTITION_BYTES):
            return None
        if True in zstd:
            return None
        if zstd.count(None) == n:
            cols[7] = None
        if encrypted.count(None) == n:
            cols[8] = None
    if sum(map(len, payload)) > stage_bytes:
        return None  # the staged path
    # with no backslash in the text, no string was written with an escape: every
    # one is its own JSON between quotes (no quote, backslash or control character:
    # msgspec refuses raw ones)
    return FastBatch(raw, {k: v for k, v in zip(COLUMNS, cols) if v is not None},
                     queue[:1] if one_queue else sorted(set(queue)), plain=not escaped)


def _schedule_call(ops: list[dict] | FastBatch, tenant: str, producer_sub: str | None, settings,
                   **extra) -> dict:
    """SCHEDULE_SQL's parameters: the ops' columns and the caller's and broker's settings."""
    params = _array_params(ops.columns) if isinstance(ops, FastBatch) else _schedule_params(ops)
    return _with_settings(params, tenant, producer_sub, settings, minting=_minting(ops), **extra)


def _minting(ops: list[dict] | FastBatch) -> bool:
    """Whether PostgreSQL may mint a txn for the batch: an op without one (only an
    upsert's is minted). Never a fast batch: it has a txn in every op."""
    return not isinstance(ops, FastBatch) and not all(o["txn"] for o in ops)


def _with_settings(params: dict, tenant: str, producer_sub: str | None, settings, **extra) -> dict:
    params.update(tenant=tenant, producer_sub=producer_sub, horizon_ms=settings.timers_horizon_ms,
                  tenancy=settings.tenancy, max_ops=settings.timers_max_ops, **extra)
    return params


def _route_statement(batch: list[dict] | FastBatch, principal, settings, upserts: list[str]) -> tuple[str, dict]:
    """The route's statement and its parameters: a fast batch whose names hold no
    UNIT_SEPARATOR sends them packed (SCHEDULE_PACKED_JSON_SQL), anything else as arrays."""
    check = db.binary_array(db.TextArray, upserts) if upserts else None
    if isinstance(batch, FastBatch):
        cols = batch.columns
        n = len(cols["queue"])
        packed = {name: UNIT_SEPARATOR.join(cols[name]) for name in _PACKED_COLUMNS}
        if all(text.count(UNIT_SEPARATOR) == n - 1 for text in packed.values()):
            params = _array_params({k: v for k, v in cols.items() if k not in packed})
            params.update(packed)
            return SCHEDULE_PACKED_JSON_SQL, _with_settings(params, principal.tenant, principal.sub, settings,
                                                             encrypt_check=check, minting=_minting(batch))
    return SCHEDULE_JSON_SQL, _schedule_call(batch, principal.tenant, principal.sub, settings,
                                             encrypt_check=check)


async def schedule(request: Request) -> Response:
    settings = request.app.state.settings
    max_ops = settings.timers_max_ops
    try:
        principal = request.app.state.auth.require(request, WRITE_ONLY)
        body = await read_json(request, unicode=True, timers=True, member="operations", member_cap=max_ops,
                               member_refusal=lambda cap: f"more than {cap} operations; at most {cap} per call",
                               on_item=_decode_early, kept_cap=SMALL_BODY_BYTES, item_cap=OP_TEXT_CAP,
                               fast=lambda raw, max_values: _fast_batch(
                                   raw, max_values, max_ops=max_ops, stage_bytes=settings.timers_stage_bytes))
    except ApiError as exc:
        # the broker's own bounds (the tenant's share of requests, the body budget): every
        # 503 of this route names the cancel route, as the database's do (_run_on)
        if exc.status == 503:
            _add_hint(exc)
        raise
    if isinstance(body, FastBatch):
        batch: list[dict] | FastBatch = body
        upserts = body.upserts
    else:
        ops = _parse_ops(body, max_ops)
        del body
        staged = sum(len(o["payload"]) for o in ops if o["op"] != "cancel")
        if staged > settings.timers_stage_bytes:
            verdicts = await _run(request, lambda conn: _schedule_staged(conn, ops, staged, principal, settings),
                                  hint=True)
            return Response(_results_json(verdicts, *_echo_columns(ops)), media_type="application/json")
        batch = ops
        upserts = sorted({o["queue"] for o in ops if o["op"] != "cancel"})

    async def work(conn):
        sql, params = _route_statement(batch, principal, settings, upserts)
        encrypting, *verdicts = await db.fetch_row(conn, _STATEMENTS[sql], params)
        if encrypting:  # nothing was written: encrypt those queues' payloads, then the batch alone
            ops = batch.ops(max_ops) if isinstance(batch, FastBatch) else batch
            if settings.encryption_key is None:
                await _ladder_first(conn, ops, principal, settings)
            _encrypt_ops(ops, set(orjson.loads(encrypting)), settings.encryption_key)
            params.update(_schedule_params(ops), encrypt_check=None)  # the arrays, in every column
            encrypting, *verdicts = await db.fetch_row(conn, _STATEMENTS[SCHEDULE_JSON_SQL], params)
        return verdicts

    verdicts = await _run(request, work, hint=True)
    if isinstance(batch, FastBatch):
        cols = batch.columns
        return Response(_results_json(verdicts, cols["queue"], cols["timer_key"], cols["txn"], batch.plain),
                        media_type="application/json")
    return Response(_results_json(verdicts, *_echo_columns(batch)), media_type="application/json")


def _echo_columns(ops: list[dict]) -> tuple[list, list, list]:
    """The queue, timerKey and txn columns of _parse_ops's operations."""
    return [o["queue"] for o in ops], [o["timerKey"] for o in ops], [o["txn"] for o in ops]


async def _schedule_staged(conn, ops: list[dict], staged: int, principal, settings) -> list[str]:
    """The staged form of the batch (see STAGE_SQL): one transaction, its own timeout."""
    upserts = sorted({o["queue"] for o in ops if o["op"] != "cancel"})
    async with conn.transaction():
        if settings.statement_timeout_ms:
            timeout = settings.statement_timeout_ms + math.ceil(staged / (1 << 20)) * STAGED_MS_PER_MIB
            await db.set_statement_timeout(conn, settings, timeout, statements=2)  # the COPY, the call
        if upserts:
            cur = await conn.execute(ENCRYPTING_QUEUES_SQL, (principal.tenant, upserts))
            encrypting = {r["name"] for r in await cur.fetchall()}
            if encrypting:
                if settings.encryption_key is None:
                    await _ladder_first(conn, ops, principal, settings)
                _encrypt_ops(ops, encrypting, settings.encryption_key)
        batch = uuid.uuid4()
        cur = conn.cursor(row_factory=tuple_row)
        async with cur.copy(STAGE_SQL) as copy:
            copy.set_types(["uuid", "int4", "bytea"])
            for n, o in enumerate(ops, 1):
                if o["op"] != "cancel":
                    await copy.write_row((batch, n, o["payload"]))
                    o["payload"] = o["plain"] = None  # PostgreSQL has the bytes now
        params = _schedule_call(ops, principal.tenant, principal.sub, settings, encrypt_check=None, staged=batch)
        await cur.execute(SCHEDULE_JSON_SQL, params)
        _, *verdicts = await cur.fetchone()
    return verdicts


# ---------------------------------------------------------------------------
# DELETE /api/v1/timers/:queue/*timerKey
# ---------------------------------------------------------------------------

CANCEL_SQL = "SELECT queen.cancel_timer(%(tenant)s, %(queue)s, %(timer_key)s)"
CANCEL = db.Statement(CANCEL_SQL)


async def cancel(request: Request) -> Response:
    return Response(await cancel_answer(request.app, request.scope), media_type="application/json")


class CancelStart:
    """cancel_start's half of a DELETE: the checked request (CANCEL's parameters and the
    txn it echoes), and its statement's call when a connection was to be had at once
    (None: cancel_answer waits for one)."""
    __slots__ = ("params", "txn", "call")

    def __init__(self, params: dict, txn: str | None, call: db.Call | None):
        self.params, self.txn, self.call = params, txn, call

    def abandon(self) -> None:
        """The request's task was cancelled before it began: its call is never awaited."""
        if self.call is not None:
            self.call.abandon()


def cancel_start(app, scope: dict) -> CancelStart:
    """The DELETE up to its statement on the wire, synchronously: server.py's direct lane
    calls it from the parser's callback, so that PostgreSQL runs queen.cancel_timer while
    the broker builds the request's task (app.HotRoutes). Raises what the route answers
    before any database work (ApiError: 401, 403, 400, a tenant's request share)."""
    principal = app.auth.require_scope(scope, READ_WRITE)
    queue, key = _scope_path_or_400(scope)
    if not key:
        raise bad_request("timerKey is required")
    txn = query_param(scope, "txn") if scope["query_string"] else None
    if txn is not None:
        check_name("txn", txn, "")
    params = {"tenant": principal.tenant, "queue": queue, "timer_key": key}
    # through libpq itself, prepared on its pooled connection (never behind a transaction
    # pooler: the next call may run on another server connection; see db.fetch_row)
    return CancelStart(params, txn, db.Call.start(app.state.pool, scope.get(TENANT_KEY), CANCEL, params))


async def cancel_answer(app, scope: dict, start: CancelStart | None = None) -> bytes:
    """The DELETE's answer (JSON), from the request's scope alone (and cancel_start's half,
    when the direct lane began it): server.py's direct lane writes it without a Request
    or a Response (app.HotRoutes). Raises what the route's handlers answer (ApiError,
    and the database's errors mapped by _mapped)."""
    if start is None:
        start = cancel_start(app, scope)
    if start.call is not None:
        try:
            row = await start.call.row()
        except Exception as exc:
            if (mapped := _mapped(exc)) is exc:
                raise
            raise mapped from None
    else:  # no connection to be had at once: the pool's queue, the tenant's share

        async def work(conn):
            return await db.fetch_row(conn, CANCEL, start.params)

        row = await _run_on(app, scope, work)
    return cancel_body(start, row)


def cancel_body(start: CancelStart, row: tuple) -> bytes:
    """The DELETE's JSON from queen.cancel_timer's row (server.DirectWait writes it from
    the database socket's reader callback, without the request's task)."""
    status = row[0]
    # orjson: the same compact UTF-8 JSON as JSONResponse, without the stdlib encoder's cost
    return orjson.dumps({"ok": status == "cancelled", "status": status, "queue": start.params["queue"],
                         "timerKey": start.params["timer_key"], "txn": start.txn or None})


# ---------------------------------------------------------------------------
# GET /api/v1/timers/:queue/*timerKey and GET /api/v1/timers/:queue
# ---------------------------------------------------------------------------

async def peek(request: Request) -> JSONResponse:
    principal = request.app.state.auth.require(request, READ_ONLY)
    queue, key = _path_or_400(request)
    if not key:
        raise bad_request("timerKey is required")

    async def work(conn):
        cur = await conn.execute("SELECT * FROM queen.peek_timer(%s, %s, %s)",
                                 (principal.tenant, queue, key))
        return await cur.fetchone()

    # its payload (up to the 1 MiB ceiling) weighed as a pop's answer, before the fetch
    await weigh_answer(request, principal.tenant, 2 * PAYLOAD_CEILING_BYTES, 1)
    r = await _run(request, work, read=True)
    weigh_fetched(request, 0 if r is None else len(r["payload"]), 0 if r is None else 1)
    if r is None:
        return JSONResponse({"found": False})
    return JSONResponse(peek_json(r))


async def list_timers(request: Request) -> JSONResponse:
    principal = request.app.state.auth.require(request, READ_ONLY)
    queue, _ = _path_or_400(request)
    return await _list(request, principal, queue)


async def _list(request: Request, principal, queue: str) -> JSONResponse:
    after = query_param(request.scope, "after")
    if after is not None:
        check_name("after", after, "")
    limit = query_int(request.scope, "limit")
    # queen.list_timers clamps to 1..1000; only keep the value an integer
    limit = 100 if limit is None else max(INT32_MIN, min(INT32_MAX, limit))

    async def work(conn):
        cur = await conn.execute("SELECT * FROM queen.list_timers(%s, %s, %s, %s::integer)",
                                 (principal.tenant, queue, after, limit))
        return await cur.fetchall()

    rows = await _run(request, work, read=True)
    return JSONResponse({
        "rows": [list_row_json(r) for r in rows],
        "truncated": bool(rows and rows[0]["truncated"]),
        "nextAfter": rows[0]["next_after"] if rows else None,
    })


async def peek_or_cancel(request: Request) -> JSONResponse:
    """One route for both methods, so a 405 on the key's URL lists both in `Allow`."""
    return await (cancel(request) if request.method == "DELETE" else peek(request))


# Order: the one-segment list route first; `{queue}` never matches a slash,
# so it cannot shadow the catch-all, and the catch-all needs at least "/".
# Both are RawRoutes: matched on the raw path, where a queue's `/` is `%2F`.
SCHEDULE_ROUTE = Route(PREFIX, schedule, methods=["POST"])
KEY_ROUTE = RawRoute(PREFIX + "/{queue}/{timerKey:anypath}", peek_or_cancel, methods=["GET", "DELETE"])
routes: list = [
    Route("/openapi.json", openapi_endpoint, methods=["GET"]),
    SCHEDULE_ROUTE,
    RawRoute(PREFIX + "/{queue}", list_timers, methods=["GET"]),
    KEY_ROUTE,
]
