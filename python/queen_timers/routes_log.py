"""Routes of the Queen-compatible log a timer fires into.

configure, push, pop, ack, ack/batch, message detail, DLQ list, DLQ
replay, transaction and lease extension. Shapes follow Queen MQ's HTTP API
(docs/log-surface.md) so its clients work; every state change is one
queen.* function call (sql/schema/50_log_api.sql). Every call is scoped by
the caller's tenant (the JWT's `tenant`; `default` with auth off): another
tenant's queues are invisible. Payloads are bytes in the log: `data` is the
JSON value when the bytes are JSON, else their base64; `payloadBase64`
is always the exact bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from datetime import datetime, timezone

import orjson

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from . import convertors, db, payloads  # noqa: F401 (convertors: registers {x:anypath})
from .auth import READ_ONLY, READ_WRITE
from .bodies import PAYLOAD_CEILING_BYTES, TENANT_KEY, LoopTurns, read_json, weigh_answer, weigh_fetched
from .convertors import RawRoute, path_param
from .errors import ApiError, bad_request, check_json_unicode, check_text, from_exception, query_int, query_param
from .limits import INT32_MAX, check_name

QUEUE_MODE = "__QUEUE_MODE__"
ACK_STATUSES = ("completed", "success", "failed", "dlq", "retry")
DEFAULT_POP_TIMEOUT_MS = 30000
MAX_POP_TIMEOUT_MS = 60000      # a long poll never holds a request longer than this
MAX_BATCH = 10000
MAX_PUSH_ITEMS = 10000          # per push: one PL/pgSQL call inserts them all (40,000 tiny items took 5 s)
MAX_ACKS = 10000                # per ack/batch
# a pool connection that sent a parameter this large is closed after its request:
# libpq keeps its output buffer at the largest size it ever sent
DISCARD_AFTER_BYTES = 1 << 20


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------

def iso_us(value: datetime | None) -> str | None:
    """'YYYY-MM-DDTHH:MM:SS.ffffffZ' in UTC (Queen's createdAt)."""
    if value is None:
        return None
    return value.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@contextlib.asynccontextmanager
async def _conn(request: Request):
    """A pooled connection; database errors with a meaning (QT* SQLSTATEs,
    capacity) become ApiError here, so the response is an ordinary one."""
    try:
        async with request.app.state.pool.connection(tenant=request.scope.get(TENANT_KEY)) as conn:
            yield conn
    except ApiError:
        raise
    except Exception as exc:
        mapped = from_exception(exc)
        if mapped is None:
            raise
        raise mapped from None


def _s(value) -> str | None:
    return None if value is None else str(value)


async def _json_body(request: Request, member: str | None = None, cap: int | None = None) -> dict:
    """The body, a JSON object. `member`: its array of at most `cap` elements, refused as
    soon as the element past the cap arrives. No lone surrogate can be in it: the parser
    (orjson) refuses one with a 400."""
    body = await read_json(request, empty=None, member=member, member_cap=cap,
                           member_refusal=(lambda n: f"more than {n} {member} per call") if member else None)
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    return body


def _no_nul(what: str, value: str | None) -> str | None:
    """PostgreSQL text cannot hold NUL (nor a lone surrogate): refuse it as a shape
    error, not a database failure. None passes (an absent optional value)."""
    return value if value is None else check_text(value, what)


def _opt_str(obj: dict, key: str, where: str) -> str | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        raise bad_request(f"{where}{key} must be a string")
    return _no_nul(f"{where}{key}", value)


TIMERS_DLQ_GROUP = "__QUEEN_TIMERS__"  # the group timers' dead letters are filed under


def _group(value: str | None, where: str = "", consumer: bool = True) -> str | None:
    """A consumer group name, checked like the other names (a NUL, bad Unicode or over 255
    bytes is 400): it is a key of the cursors' index, where an oversized one would fail as a
    capacity error (503) instead. None passes (the default group). A consumer (a pop, an
    ack) may not name TIMERS_DLQ_GROUP: replay tells a timer's dead letter by it (migration
    043); the DLQ is still listed by it."""
    if value is not None:
        check_name("consumerGroup", value, where)
        if consumer and value == TIMERS_DLQ_GROUP:
            raise bad_request(f"{where}consumerGroup {TIMERS_DLQ_GROUP} is reserved: the group of "
                              "timers' dead letters")
    return value


def _uuid(value: object, what: str) -> uuid.UUID:
    if not isinstance(value, str):
        raise bad_request(f"{what} must be a UUID string")
    try:
        return uuid.UUID(value)
    except ValueError:
        raise bad_request(f"{what} is not a valid UUID") from None


def _read_payload(settings, raw: bytes, is_encrypted: bool) -> bytes:
    """The bytes a consumer reads: decrypted when the frame is encrypted and
    the key is loaded; left as stored (the envelope) otherwise, as Queen does."""
    if is_encrypted and settings.encryption_key is not None:
        try:
            return payloads.decrypt(settings.encryption_key, raw)
        except payloads.PayloadError:
            return raw
    return raw


def _int_param(request: Request, name: str, default: int, minimum: int, maximum: int) -> int:
    value = query_int(request.scope, name)
    return default if value is None else max(minimum, min(maximum, value))


def _bool_param(request: Request, name: str, default: bool = False) -> bool:
    raw = query_param(request.scope, name)
    if raw is None or raw == "":
        return default
    return raw.strip().lower() in ("true", "1", "yes")


# ---------------------------------------------------------------------------
# configure
# ---------------------------------------------------------------------------

async def configure(request: Request) -> JSONResponse:
    principal = request.app.state.auth.require(request, READ_WRITE)
    body = await _json_body(request)
    queue = body.get("queue")
    if not isinstance(queue, str) or not queue:
        raise bad_request("queue is required (a non-empty string)")
    _no_nul("queue", queue)
    check_name("queue", queue)
    namespace = _opt_str(body, "namespace", "")
    task = _opt_str(body, "task", "")
    for name, value in (("namespace", namespace), ("task", task)):
        if value:
            check_name(name, value)
    options = body.get("options")
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise bad_request("options must be an object")
    _no_nul("options", json.dumps(options).replace("\\u0000", "\x00"))
    async with _conn(request) as conn:
        cur = await conn.execute(
            "SELECT * FROM queen.configure_queue(%s, %s, %s, %s, %s::jsonb)",
            (principal.tenant, queue, namespace, task, json.dumps(options)))
        row = await cur.fetchone()
    return JSONResponse({
        "configured": True, "queueId": str(row["queue_id"]), "partitionId": str(row["partition_id"]),
        "queue": row["queue_name"], "namespace": row["namespace"], "task": row["task"],
        "options": row["options"],
    })


# ---------------------------------------------------------------------------
# push
# ---------------------------------------------------------------------------

def _parse_push_item(item: object, where: str) -> tuple:
    """(queue, partition, transactionId or None, traceId or None, payload bytes) of one item."""
    if not isinstance(item, dict):
        raise bad_request(f"{where} must be an object")
    where = f"{where}."
    queue = item.get("queue")
    if not isinstance(queue, str) or not queue:
        raise bad_request(f"{where}queue is required (a non-empty string)")
    check_name("queue", queue, where)
    partition = _opt_str(item, "partition", where) or "Default"
    check_name("partition", partition, where)
    txn = _opt_str(item, "transactionId", where) or None
    if txn is not None:
        check_name("transactionId", txn, where)
    trace = item.get("traceId")
    trace_id = None if trace is None else _uuid(trace, f"{where}traceId")
    payload = item.get("payload", {})
    try:
        data = orjson.dumps(payload)  # compact UTF-8, as json.dumps(separators=(",", ":"), ensure_ascii=False)
    except TypeError:  # an integer past 64 bits: the stdlib writes it
        data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return (queue, partition, txn, trace_id, data)


PARSE_SLICE = 500  # items parsed between two yields to the event loop


async def _parse_push_items(items: list) -> list[tuple]:
    """Every item parsed, the event loop given a turn every PARSE_SLICE items: a push of
    tens of thousands of items must not hold up every other request while it is checked."""
    parsed = []
    for start in range(0, len(items), PARSE_SLICE):
        if start:
            await asyncio.sleep(0)
        parsed.extend(_parse_push_item(item, f"items[{i}]")
                      for i, item in enumerate(items[start:start + PARSE_SLICE], start))
    return parsed


async def _encrypt_items(conn, settings, tenant: str, parsed: list[tuple]) -> list[tuple]:
    """The items with their stored bytes and is_encrypted: encrypted when the
    tenant's queue encrypts at rest and this broker has the key (as Queen)."""
    encrypted: set[str] = set()
    if settings.encryption_key is not None and parsed:
        cur = await conn.execute("SELECT queen.encrypted_queues(%s, %s::text[]) AS name",
                                 (tenant, sorted({p[0] for p in parsed})))
        encrypted = {r["name"] for r in await cur.fetchall()}
    rows = []
    for queue, partition, txn, trace_id, data in parsed:
        if queue in encrypted:
            rows.append((queue, partition, txn, trace_id, payloads.encrypt(settings.encryption_key, data), True))
        else:
            rows.append((queue, partition, txn, trace_id, data, False))
    return rows


async def push(request: Request) -> JSONResponse:
    principal = request.app.state.auth.require(request, READ_WRITE)
    settings = request.app.state.settings
    body = await _json_body(request, "items", MAX_PUSH_ITEMS)
    items = body.get("items")
    if not isinstance(items, list):
        raise bad_request("items is required (an array)")
    if len(items) > MAX_PUSH_ITEMS:  # a small body, parsed whole
        raise bad_request(f"more than {MAX_PUSH_ITEMS} items per call")
    parsed = await _parse_push_items(items)
    del body, items
    if not parsed:
        return JSONResponse([], status_code=201)

    async with _conn(request) as conn:
        rows = await _encrypt_items(conn, settings, principal.tenant, parsed)
        cur = await conn.execute(
            """SELECT * FROM queen.push_messages(
                   %s,
                   ARRAY(SELECT ROW(x.q, x.p, x.t, x.tr, x.pl, x.e)::queen.push_item
                           FROM unnest(%b::text[], %b::text[], %b::text[], %b::uuid[], %b::bytea[], %b::boolean[])
                                WITH ORDINALITY AS x(q, p, t, tr, pl, e, n)
                          ORDER BY x.n),
                   %s)""",
            # binary arrays: bytea in text would be hex, built and sent at twice the size
            (principal.tenant, [r[0] for r in rows], [r[1] for r in rows], db.array_param([r[2] for r in rows]),
             db.array_param([r[3] for r in rows]), [r[4] for r in rows], [r[5] for r in rows], principal.sub))
        results = await cur.fetchall()
        if sum(len(r[4]) for r in rows) > DISCARD_AFTER_BYTES:
            request.app.state.pool.discard(conn)  # closed once committed (see DISCARD_AFTER_BYTES)
    out = []
    for r in results:
        if r["status"] == "queued":
            out.append({"index": r["idx"], "transaction_id": r["transaction_id"], "status": "queued",
                        "message_id": str(r["message_id"]), "partition_id": str(r["partition_id"]),
                        "trace_id": _s(r["trace_id"]), "queueName": r["queue_name"]})
        else:
            out.append({"index": r["idx"], "transaction_id": r["transaction_id"], "status": r["status"],
                        "message_id": str(r["message_id"]), "queueName": r["queue_name"]})
    return _json_answer(out, 201)


def _json_answer(content, status: int = 200) -> Response:
    """JSONResponse's bytes (compact, UTF-8), by orjson: a push or transaction of 10,000 items
    answers 10,000 objects, which the stdlib encoder took about 8 % of the broker's time over
    (Dec 7 profile of one tenant's pushes of 10,000 items, another tenant's DELETEs waiting)."""
    return Response(orjson.dumps(content), status_code=status, media_type="application/json")


# ---------------------------------------------------------------------------
# pop
# ---------------------------------------------------------------------------

async def pop(request: Request) -> Response:
    principal = request.app.state.auth.require(request, READ_WRITE)
    settings = request.app.state.settings
    queue = _no_nul("queue", path_param(request.scope, "queue"))
    partition = _no_nul("partition", path_param(request.scope, "partition", optional=True))
    check_name("queue", queue)
    if partition is not None:
        check_name("partition", partition)
    batch = _int_param(request, "batch", 1, 1, MAX_BATCH)
    wait = _bool_param(request, "wait")
    timeout_ms = _int_param(request, "timeout", DEFAULT_POP_TIMEOUT_MS, 0, MAX_POP_TIMEOUT_MS)
    group = _group(query_param(request.scope, "consumerGroup")) or QUEUE_MODE
    auto_ack = _bool_param(request, "autoAck")

    deadline = time.monotonic() + timeout_ms / 1000
    sleep = 0.05
    # what the answer may hold, weighed before the fetch (nothing is leased yet if
    # the budget has no room): the bytes bound, or batch messages of the largest size
    most = min(settings.pop_max_bytes, batch * _largest_payload(settings))
    while True:
        await weigh_answer(request, principal.tenant, most, batch)
        async with _conn(request) as conn:
            cur = await conn.execute("SELECT * FROM queen.pop_messages(%s, %s, %s, %s, %s, %s, p_max_bytes => %s)",
                                     (principal.tenant, queue, partition, group, batch, auto_ack,
                                      settings.pop_max_bytes))
            rows = await cur.fetchall()
        # from here on the answer weighs what it holds (a long poll's sleep weighs nothing)
        weigh_fetched(request, sum(len(r["payload"]) for r in rows), len(rows))
        remaining = deadline - time.monotonic()
        if rows or not wait or remaining <= 0 or getattr(request.app, "draining", False):
            break  # draining: the broker is stopping, and the client polls another (or this one again)
        await asyncio.sleep(min(sleep, remaining))
        sleep = min(sleep * 2, 0.5)
        if await request.is_disconnected():
            break  # the client left the long poll: nothing more is leased, nor with autoAck consumed, for it
    if not rows:
        return Response(status_code=204)

    lease_id = "" if auto_ack else str(rows[0]["lease_id"])
    messages = []
    turns = LoopTurns()  # a turn once checking the stored payloads has taken its slice
    for r in rows:
        data = _read_payload(settings, bytes(r["payload"]), r["is_encrypted"])
        messages.append({
            "id": str(r["message_id"]), "transactionId": r["transaction_id"], "traceId": _s(r["trace_id"]),
            "data": payloads.json_data_fragment(data), "payloadBase64": payloads.encode_base64(data),
            "producerSub": r["producer_sub"], "createdAt": iso_us(r["created_at"]),
            "queue": r["queue"], "partitionId": str(r["partition_id"]), "partition": r["partition"],
            "leaseId": lease_id, "consumerGroup": r["consumer_group"],
        })
        await turns.maybe()
    first = rows[0]
    del rows
    # orjson: the `data` fragments are embedded as stored; json.dumps of 8,000 messages held the loop ~1 s
    return _json_answer({
        "success": True, "queue": first["queue"], "partition": first["partition"],
        "partitionId": str(first["partition_id"]), "leaseId": lease_id,
        "consumerGroup": first["consumer_group"], "partitionsClaimed": 1,
        "leaseExpiresAt": iso_us(first["lease_expires_at"]), "messages": messages,
    })


# ---------------------------------------------------------------------------
# ack
# ---------------------------------------------------------------------------

def _parse_ack(obj: object, where: str, default_group: str | None) -> tuple:
    if not isinstance(obj, dict):
        raise bad_request(f"{where} must be an object")
    txn = obj.get("transactionId")
    if not isinstance(txn, str) or not txn:
        raise bad_request(f"{where}.transactionId is required (a string)")
    check_name("transactionId", txn, f"{where}.")
    partition_id = _uuid(obj.get("partitionId"), f"{where}.partitionId")
    status = obj.get("status")
    if status is not None and status not in ACK_STATUSES:
        raise bad_request(f"{where}.status must be one of {', '.join(ACK_STATUSES)}")
    error = obj.get("error")
    if error is not None and not isinstance(error, str):
        error = json.dumps(error)
    _no_nul(f"{where}.error", error)
    lease = obj.get("leaseId")
    if lease is not None and not isinstance(lease, str):
        raise bad_request(f"{where}.leaseId must be a string")
    _no_nul(f"{where}.leaseId", lease)
    group = obj.get("consumerGroup")
    if group is not None and not isinstance(group, str):
        raise bad_request(f"{where}.consumerGroup must be a string")
    _group(group, f"{where}.")
    return (txn, partition_id, status, error, lease, group or default_group)


def _binary_columns(kinds: tuple, columns: list[list]) -> list:
    """Columns as binary array parameters (%b), built in bulk by db.binary_array (a kind of
    None: a uuid column, dumped by psycopg): as text parameters, psycopg quoted 1,000 errors
    of 8,000 characters element by element in Python, and held the loop 0.35-0.47 s per 8 MB
    ack batch (Dec 8 review). An all-NULL column is sent as NULL (a multi-argument unnest
    pads it)."""
    return [db.array_param(c) if kind is None else db.binary_array(kind, c) for kind, c in zip(kinds, columns)]


# ack_messages' item columns: transactionId, partitionId, status, error, leaseId, consumerGroup
ACK_KINDS = (db.TextArray, None, db.TextArray, db.TextArray, db.TextArray, db.TextArray)


async def _ack(request: Request, tenant: str, acks: list[tuple]) -> list[dict]:
    if not acks:
        return []
    async with _conn(request) as conn:
        cur = await conn.execute(
            """SELECT * FROM queen.ack_messages(
                   %s,
                   ARRAY(SELECT ROW(x.t, x.p, x.s, x.e, x.l, x.g)::queen.ack_item
                           FROM unnest(%b::text[], %b::uuid[], %b::text[], %b::text[], %b::text[], %b::text[])
                                WITH ORDINALITY AS x(t, p, s, e, l, g, n)
                          ORDER BY x.n))""",
            (tenant, *_binary_columns(ACK_KINDS, [[a[i] for a in acks] for i in range(6)])))
        rows = await cur.fetchall()
    return [{"index": r["idx"], "transactionId": r["transaction_id"], "success": r["success"],
             "error": r["error"], "queueName": r["queue_name"], "partitionName": r["partition_name"],
             "leaseReleased": r["lease_released"], "dlq": r["dlq"]} for r in rows]


async def ack(request: Request) -> JSONResponse:
    principal = request.app.state.auth.require(request, READ_WRITE)
    body = await _json_body(request)
    return JSONResponse(await _ack(request, principal.tenant, [_parse_ack(body, "body", None)]))


async def ack_batch(request: Request) -> JSONResponse:
    principal = request.app.state.auth.require(request, READ_WRITE)
    body = await _json_body(request, "acknowledgments", MAX_ACKS)
    group = body.get("consumerGroup")
    if group is not None and not isinstance(group, str):
        raise bad_request("consumerGroup must be a string")
    _group(group)
    items = body.get("acknowledgments")
    if not isinstance(items, list):
        raise bad_request("acknowledgments is required (an array)")
    if len(items) > MAX_ACKS:
        raise bad_request(f"more than {MAX_ACKS} acknowledgments per call")
    acks = [_parse_ack(a, f"acknowledgments[{i}]", group) for i, a in enumerate(items)]
    return JSONResponse(await _ack(request, principal.tenant, acks))


# ---------------------------------------------------------------------------
# message detail
# ---------------------------------------------------------------------------

async def get_message(request: Request) -> JSONResponse:
    principal = request.app.state.auth.require(request, READ_ONLY)
    settings = request.app.state.settings
    transaction_id = path_param(request.scope, "transactionId")
    try:
        partition_id = uuid.UUID(path_param(request.scope, "partitionId"))
    except ValueError:
        return JSONResponse({"error": "Message not found"}, status_code=404)
    check_name("transactionId", transaction_id)
    # the answer holds the payload three times (payload, data, payloadBase64): weighed
    # as a pop's before the fetch, at the largest a stored payload can be, then as fetched
    await weigh_answer(request, principal.tenant, _largest_payload(settings), 1)
    async with _conn(request) as conn:
        cur = await conn.execute("SELECT * FROM queen.get_message(%s, %s, %s)",
                                 (principal.tenant, partition_id,
                                  _no_nul("transactionId", transaction_id)))
        r = await cur.fetchone()
    if r is None:
        weigh_fetched(request, 0, 0)
        return JSONResponse({"error": "Message not found"}, status_code=404)
    # the payload and the texts beside it: an error of up to 8,192 characters, up to
    # 1,000 consumer groups (queen.get_message)
    weigh_fetched(request, len(r["payload"]) + _text_bytes(r["error_message"], r["producer_sub"])
                  + sum(len(g["name"]) + GROUP_WEIGHT for g in r["consumer_groups"]), 1)
    data = _read_payload(settings, bytes(r["payload"]), r["is_encrypted"])
    # embedded as stored (orjson), as a pop's: parsed into objects and encoded again by the
    # stdlib, a 6.7 MB document held the loop ~1.4 s (Dec 8 review)
    value = payloads.json_data_fragment(data)
    return _json_answer({
        "id": str(r["message_id"]), "transactionId": r["transaction_id"],
        "partitionId": str(r["partition_id"]), "queuePath": f"{r['queue']}/{r['partition']}",
        "queue": r["queue"], "partition": r["partition"], "namespace": r["namespace"], "task": r["task"],
        "status": r["status"], "payload": value, "data": value,
        "payloadBase64": payloads.encode_base64(data), "isEncrypted": r["is_encrypted"],
        "traceId": _s(r["trace_id"]), "producerSub": r["producer_sub"], "createdAt": iso_us(r["created_at"]),
        "errorMessage": r["error_message"], "retryCount": r["retry_count"],
        "leaseExpiresAt": iso_us(r["lease_expires_at"]), "queueConfig": r["queue_config"],
        "mode": r["mode"], "consumerGroups": r["consumer_groups"],
    })


# ---------------------------------------------------------------------------
# DLQ
# ---------------------------------------------------------------------------

# what one entry of a message's consumerGroups weighs in its answer besides its name
GROUP_WEIGHT = 128


def _text_bytes(*texts: str | None) -> int:
    """The UTF-8 bytes of stored texts an answer holds beside a payload (a dead letter's
    error, the producer's sub): counted as the payload is, as queen.list_dlq counts them."""
    return sum(len(t.encode()) for t in texts if t)


def _largest_payload(settings) -> int:
    """The largest payload a stored message can hold: a push's body, or a fired timer's."""
    return max(settings.log_max_body_bytes, 2 * PAYLOAD_CEILING_BYTES)


async def list_dlq(request: Request) -> JSONResponse:
    principal = request.app.state.auth.require(request, READ_ONLY)
    queue = _no_nul("queue", query_param(request.scope, "queue")) or None
    group = _group(query_param(request.scope, "consumerGroup"), consumer=False) or None
    if queue is not None:
        check_name("queue", queue)
    limit = _int_param(request, "limit", 100, 1, 1000)
    offset = _int_param(request, "offset", 0, 0, INT32_MAX)
    settings = request.app.state.settings
    # `partition`, `from` and `to` are ignored, as Queen's dlq route does. A page holds at
    # most QUEEN_POP_MAX_BYTES of payloads (its first entry always), weighed as a pop's
    # answer: 1,000 dead letters of 8 MB each were one 8 GB answer
    await weigh_answer(request, principal.tenant, min(settings.pop_max_bytes, limit * _largest_payload(settings)),
                       limit)
    async with _conn(request) as conn:
        cur = await conn.execute("SELECT * FROM queen.list_dlq(%s, %s, %s, %s, %s, p_max_bytes => %s)",
                                 (principal.tenant, queue, group, limit, offset, settings.pop_max_bytes))
        rows = await cur.fetchall()
        weigh_fetched(request, sum(len(r["payload"]) + _text_bytes(r["error_message"], r["producer_sub"])
                                   for r in rows), len(rows))
        cur = await conn.execute("SELECT queen.count_dlq(%s, %s, %s) AS total", (principal.tenant, queue, group))
        total = (await cur.fetchone())["total"]
    messages = []
    turns = LoopTurns()  # a turn once checking the stored payloads has taken its slice
    for r in rows:
        raw = bytes(r["payload"])  # not decrypted here, as Queen's DLQ route
        messages.append({
            "id": str(r["message_id"]), "dlqId": str(r["dlq_id"]), "transactionId": r["transaction_id"],
            "partitionId": str(r["partition_id"]), "queue": r["queue"], "partition": r["partition"],
            "consumerGroup": r["consumer_group"], "errorMessage": r["error_message"],
            "retryCount": r["retry_count"], "data": payloads.json_data_fragment(raw),
            "payloadBase64": payloads.encode_base64(raw), "isEncrypted": r["is_encrypted"],
            "payloadZstd": r["payload_zstd"],
            "producerSub": r["producer_sub"], "createdAt": iso_us(r["created_at"]),
            "failedAt": iso_us(r["failed_at"]),
        })
        await turns.maybe()
    if len(rows) < limit and offset + len(rows) < total:
        limit = len(rows)  # cut short by the bytes bound: offset + limit is the next page
    del rows
    # orjson, the `data` fragments embedded as stored: a page of 928 dense 18 KB documents,
    # parsed and encoded again by the stdlib, held the loop 2.7-3.1 s (Dec 8 review)
    return _json_answer({"messages": messages, "pagination": {"limit": limit, "offset": offset},
                         "total": total})


async def replay_dlq(request: Request) -> JSONResponse:
    principal = request.app.state.auth.require(request, READ_WRITE)
    try:
        dlq_id = uuid.UUID(path_param(request.scope, "id"))
    except ValueError:
        raise ApiError(404, "not_found", "no DLQ entry with that id (it is not a UUID)") from None
    async with _conn(request) as conn:
        cur = await conn.execute("SELECT queen.replay_dlq_entry(%s, %s) AS message_id", (principal.tenant, dlq_id))
        row = await cur.fetchone()
    return JSONResponse({"replayed": True, "dlqId": str(dlq_id), "messageId": str(row["message_id"])})


# ---------------------------------------------------------------------------
# transaction (atomic pushes + acks) and lease extension
# ---------------------------------------------------------------------------

MAX_TXN_OPS = 10000
# requiredLeases entries per transaction, counted as sent (duplicates too): queen-mq names at
# most one per ack (deduplicated), and a transaction holds at most MAX_TXN_OPS acks
MAX_TXN_LEASES = MAX_TXN_OPS

TXN_SQL = """
SELECT o.transaction_id, o.success, o.error, o.failed_index,
       (SELECT coalesce(jsonb_agg(to_jsonb(r) ORDER BY r.idx), '[]'::jsonb) FROM unnest(o.results) r) AS results
  FROM queen.execute_transaction(
         %s,
         ARRAY(SELECT ROW(x.ty, x.q, x.p, x.t, x.tr, x.pl, x.e, x.pid, x.s, x.err, x.l, x.g)::queen.txn_op
                 FROM unnest(%b::text[], %b::text[], %b::text[], %b::text[], %b::uuid[], %b::bytea[],
                             %b::boolean[], %b::uuid[], %b::text[], %b::text[], %b::text[], %b::text[])
                      WITH ORDINALITY AS x(ty, q, p, t, tr, pl, e, pid, s, err, l, g, n)
                ORDER BY x.n),
         %s::text[],
         %s) o
"""


# execute_transaction's op columns, in TXN_SQL's order (None: a uuid column)
TXN_KINDS = (db.TextArray, db.TextArray, db.TextArray, db.TextArray, None, db.ByteaArray,
             db.BoolArray, None, db.TextArray, db.TextArray, db.TextArray, db.TextArray)


def _txn_result(r: dict) -> dict:
    if r["type"] == "push":
        return {"index": r["idx"], "type": "push", "success": r["success"], "status": r["status"],
                "transactionId": r["transaction_id"], "messageId": r["message_id"],
                "partitionId": r["partition_id"], "queueName": r["queue_name"]}
    return {"index": r["idx"], "type": "ack", "success": r["success"], "transactionId": r["transaction_id"],
            "error": r["error"], "partitionId": r["partition_id"], "queueName": r["queue_name"],
            "partitionName": r["partition_name"], "leaseReleased": r["lease_released"], "dlq": r["dlq"]}


TXN_TOO_MANY = f"at most {MAX_TXN_OPS} operations (pushed items and acks) per transaction"


async def transaction(request: Request) -> JSONResponse:
    """Queen's POST /api/v1/transaction: {operations: [{type: "push", items: [...]} |
    {type: "ack", transactionId, partitionId, status?, error?, leaseId?, consumerGroup?}],
    requiredLeases?: [...]}. One queen.execute_transaction call: all or nothing."""
    principal = request.app.state.auth.require(request, READ_WRITE)
    settings = request.app.state.settings
    body = await _json_body(request, "operations", MAX_TXN_OPS)
    for rider in ("kv", "timers"):
        if body.get(rider):
            raise bad_request(f"{rider} operations in a transaction are not supported by this broker; "
                              "nothing was applied")
    operations = body.get("operations")
    if not isinstance(operations, list):
        raise bad_request("operations is required (an array)")
    if not operations:
        raise bad_request("operations may not be empty")
    required = body.get("requiredLeases")
    if required is None:
        required = []
    if not isinstance(required, list):
        raise bad_request("requiredLeases must be an array of strings")
    if len(required) > MAX_TXN_LEASES:
        raise bad_request(f"at most {MAX_TXN_LEASES} requiredLeases per transaction (duplicates count)")
    if not all(isinstance(x, str) for x in required):
        raise bad_request("requiredLeases must be an array of strings")
    for lease in required:
        _no_nul("requiredLeases", lease)

    pushes: dict[int, tuple] = {}   # flat index -> parsed push item
    acks: dict[int, tuple] = {}     # flat index -> parsed ack
    flat = 0
    for i, op in enumerate(operations):
        where = f"operations[{i}]"
        if not isinstance(op, dict):
            raise bad_request(f"{where} must be an object")
        kind = op.get("type")
        if kind == "push":
            items = op.get("items")
            if not isinstance(items, list):
                raise bad_request(f"{where}.items is required (an array)")
            if flat + len(items) > MAX_TXN_OPS:  # refused before its items are parsed
                raise bad_request(TXN_TOO_MANY)
            for j, item in enumerate(items):
                if j and not j % PARSE_SLICE:
                    await asyncio.sleep(0)  # as a push's items: the other requests get their turn
                if isinstance(item, dict) and "payload" not in item and "data" in item:
                    item = {**item, "payload": item["data"]}  # Queen reads payload, else data
                pushes[flat] = _parse_push_item(item, f"{where}.items[{j}]")
                flat += 1
        elif kind == "ack":
            acks[flat] = _parse_ack(op, where, None)
            flat += 1
        else:
            raise bad_request(f"{where}.type must be push or ack")
        if flat > MAX_TXN_OPS:
            raise bad_request(TXN_TOO_MANY)
    if flat == 0:
        raise bad_request("the transaction has no operations (every push has an empty items array)")

    async with _conn(request) as conn:
        order = sorted(pushes)
        stored = dict(zip(order, await _encrypt_items(conn, settings, principal.tenant,
                                                      [pushes[k] for k in order])))
        cols: list[list] = [[] for _ in range(12)]
        for k in range(flat):
            if k in stored:
                q, p, t, tr, pl, e = stored[k]
                row = ("push", q, p, t, tr, pl, e, None, None, None, None, None)
            else:
                t, pid, st, err, lease, group = acks[k]
                row = ("ack", None, None, t, None, None, None, pid, st, err, lease, group)
            for c, v in zip(cols, row):
                c.append(v)
        # the text form held the loop ~0.3 s for 10,000 pushed items (Dec 8 review)
        cur = await conn.execute(TXN_SQL, (principal.tenant, *_binary_columns(TXN_KINDS, cols), required,
                                           principal.sub))
        out = await cur.fetchone()
    body = {"transactionId": str(out["transaction_id"]), "success": out["success"],
            "results": [_txn_result(r) for r in out["results"]]}
    if not out["success"]:
        body["error"] = out["error"]
        body["failedIndex"] = out["failed_index"]
    return _json_answer(body)


MAX_EXTEND_SECONDS = 86400


async def extend_lease(request: Request) -> JSONResponse:
    """Queen's POST /api/v1/lease/:leaseId/extend {seconds?: 60}: a one-element
    array {index, leaseId, success, error, expiresAt, newExpiresAt, renewed}."""
    principal = request.app.state.auth.require(request, READ_WRITE)
    lease_id = _no_nul("leaseId", path_param(request.scope, "leaseId"))
    body = await read_json(request, empty={})
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    check_json_unicode(body)
    seconds = body.get("seconds")
    if seconds is None:
        seconds = 60
    if isinstance(seconds, bool) or not isinstance(seconds, int) or not 1 <= seconds <= MAX_EXTEND_SECONDS:
        raise bad_request(f"seconds must be an integer from 1 to {MAX_EXTEND_SECONDS}")
    async with _conn(request) as conn:
        cur = await conn.execute("SELECT * FROM queen.extend_lease(%s, %s, %s)",
                                 (principal.tenant, lease_id, seconds))
        r = await cur.fetchone()
    expires = iso_us(r["expires_at"])
    return JSONResponse([{"index": 0, "leaseId": lease_id, "success": r["success"], "error": r["error"],
                          "expiresAt": expires, "newExpiresAt": expires, "renewed": r["renewed"]}])


# The routes with a name in the path are RawRoutes (convertors.py): matched on the raw
# path, so `%2F` is a character of the name it is in (`/api/v1/pop/queue/team%2Fa` is
# queue `team/a`) and a raw `/` separates segments, as the timer routes read theirs.
routes = [
    Route("/api/v1/configure", configure, methods=["POST"]),
    Route("/api/v1/push", push, methods=["POST"]),
    RawRoute("/api/v1/pop/queue/{queue}", pop, methods=["GET"]),
    RawRoute("/api/v1/pop/queue/{queue}/partition/{partition}", pop, methods=["GET"]),
    Route("/api/v1/ack", ack, methods=["POST"]),
    Route("/api/v1/ack/batch", ack_batch, methods=["POST"]),
    RawRoute("/api/v1/messages/{partitionId}/{transactionId:anypath}", get_message, methods=["GET"]),
    Route("/api/v1/dlq", list_dlq, methods=["GET"]),
    RawRoute("/api/v1/dlq/{id}/replay", replay_dlq, methods=["POST"]),
    Route("/api/v1/transaction", transaction, methods=["POST"]),
    RawRoute("/api/v1/lease/{leaseId}/extend", extend_lease, methods=["POST"]),
]
# Starlette answers HEAD on every GET route by running it: a pop's HEAD would take a lease,
# or with autoAck consume messages, and answer none of them. A pop is no safe method: 405.
for _route in routes:
    if _route.endpoint is pop:
        _route.methods.discard("HEAD")


# ---------------------------------------------------------------------------
# OpenAPI 3.1 path items (merged by openapi.py)
# ---------------------------------------------------------------------------

def _json(description: str, schema: dict) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _err(description: str, slugs: list[str] | None = None) -> dict:
    schema: dict = {"$ref": "#/components/schemas/Error"}
    if slugs:
        schema = {"allOf": [schema, {"properties": {"error": {"enum": slugs}}}]}
    return _json(description, schema)


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


_AUTH = {"401": _err("no credential, or a bad one (QUEEN_AUTH=jwt)", ["unauthorized"]),
         "403": _err("the credential's access level is too low", ["forbidden"])}
_BAD = {"400": _err("shape", ["timers_bad_request"])}
_UNAVAILABLE = {"503": _err("the database cannot answer right now", ["timers_unavailable"])}
# the routes whose answers hold stored payloads wait for room in the body budget too
_UNAVAILABLE_WEIGHED = {"503": _err("the database cannot answer right now, or the body budget had no room for the "
                                    "answer within QUEEN_BODY_WAIT_MS (Retry-After)", ["timers_unavailable"])}


def _q(name: str, schema: dict, description: str) -> dict:
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": description}


ENCODED = "{}, percent-encoded: a '/' in it is `%2F` (a raw '/' ends the segment)"


def _p(name: str, description: str) -> dict:
    return {"name": name, "in": "path", "required": True, "schema": {"type": "string"}, "description": description}


_POP_PARAMS = [
    _q("batch", {"type": "integer", "default": 1}, "messages per pop (any integer, clamped to 1..10000)"),
    _q("wait", {"type": "boolean", "default": False}, "long-poll until a message is available or `timeout`"),
    _q("timeout", {"type": "integer", "default": DEFAULT_POP_TIMEOUT_MS},
       f"long-poll bound in ms (any integer, clamped to 0..{MAX_POP_TIMEOUT_MS})"),
    _q("consumerGroup", {"type": "string", "default": QUEUE_MODE},
       "consumer group; the default is the competing-consumers queue mode"),
    _q("autoAck", {"type": "boolean", "default": False}, "move the cursor at once; no lease (leaseId \"\")"),
]

_POP = {
    "summary": "Lease a partition for a consumer group and take up to `batch` messages after its cursor",
    "parameters": None,
    "responses": {"200": _json("messages", _ref("PopResult")), "204": {"description": "nothing available"},
                  **_BAD, **_AUTH, **_UNAVAILABLE},
}

OPENAPI_PATHS: dict = {
    "/api/v1/configure": {"post": {
        "summary": "Create or overwrite a queue (every option; a missing one resets to its default)",
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("ConfigureRequest")}}},
        "responses": {"200": _json("the queue as configured", _ref("ConfigureResult")),
                      **_BAD, **_AUTH, **_UNAVAILABLE}}},
    "/api/v1/push": {"post": {
        "summary": "Append messages; a transactionId already in the partition answers `duplicate`",
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("PushRequest")}}},
        "responses": {"201": _json("one result per item, in input order",
                                   {"type": "array", "items": _ref("PushResult")}),
                      **_BAD, **_AUTH, **_UNAVAILABLE}}},
    "/api/v1/pop/queue/{queue}": {"get": {
        **_POP, "parameters": [_p("queue", ENCODED.format("queue name")), *_POP_PARAMS]}},
    "/api/v1/pop/queue/{queue}/partition/{partition}": {"get": {
        **_POP, "parameters": [_p("queue", ENCODED.format("queue name")), _p("partition", ENCODED.format("partition name")), *_POP_PARAMS]}},
    "/api/v1/ack": {"post": {
        "summary": "Acknowledge one message (completed, failed, dlq or retry)",
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("Ack")}}},
        "responses": {"200": _json("a one-element array", {"type": "array", "items": _ref("AckResult")}),
                      **_BAD, **_AUTH, **_UNAVAILABLE}}},
    "/api/v1/ack/batch": {"post": {
        "summary": "Acknowledge several messages",
        "requestBody": {"required": True, "content": {"application/json": {"schema": {
            "type": "object", "required": ["acknowledgments"],
            "properties": {"consumerGroup": {"type": ["string", "null"]},
                           "acknowledgments": {"type": "array", "items": _ref("Ack")}}}}}},
        "responses": {"200": _json("one result per acknowledgement, in input order",
                                   {"type": "array", "items": _ref("AckResult")}),
                      **_BAD, **_AUTH, **_UNAVAILABLE}}},
    "/api/v1/messages/{partitionId}/{transactionId}": {"get": {
        "summary": "One message by partition id and transaction id, with its derived status",
        "parameters": [_p("partitionId", "partition UUID"), _p("transactionId", "transaction id: the rest of the path, a '/' in it raw or percent-encoded")],
        "responses": {"200": _json("the message", _ref("MessageDetail")),
                      "404": _json("no such message", {"type": "object", "properties": {
                          "error": {"const": "Message not found"}}}),
                      **_AUTH, **_UNAVAILABLE_WEIGHED}}},
    "/api/v1/dlq": {"get": {
        "summary": "Dead letters, newest first (`partition`, `from`, `to` are ignored, as in Queen)",
        "parameters": [_q("queue", {"type": "string"}, "queue name (all queues when absent)"),
                       _q("consumerGroup", {"type": "string"}, "consumer group (all when absent)"),
                       _q("limit", {"type": "integer", "default": 100}, "page size (any integer, clamped to 1..1000)"),
                       _q("offset", {"type": "integer", "default": 0}, "rows to skip (a negative one is 0)")],
        "responses": {"200": _json("a page (at most QUEEN_POP_MAX_BYTES of payloads, its first entry always)",
                                   _ref("DlqPage")), **_BAD, **_AUTH, **_UNAVAILABLE_WEIGHED}}},
    "/api/v1/dlq/{id}/replay": {"post": {
        "summary": "Replay a dead letter into its partition as a new message (not a timer's)",
        "parameters": [_p("id", "the DLQ entry's dlqId")],
        "responses": {"200": _json("replayed", {"type": "object", "properties": {
                          "replayed": {"const": True}, "dlqId": {"type": "string", "format": "uuid"},
                          "messageId": {"type": "string", "format": "uuid"}}}),
                      "404": _err("no such DLQ entry", ["not_found"]),
                      "409": _err("a timer's dead letter cannot be replayed", ["dlq_replay_refused"]),
                      **_AUTH, **_UNAVAILABLE}}},
    "/api/v1/transaction": {"post": {
        "summary": "Pushes and acks in one database transaction: all applied, or none",
        "description": "Each pushed item and each ack is one operation (the flat `index`). An ack that does "
                       "not succeed, or a required lease that is not held, applies nothing: 200 with "
                       "`success: false`, `error` and `failedIndex` (null for a required lease). A push "
                       "whose transactionId is already in the partition is `duplicate`, not a failure.",
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("TransactionRequest")}}},
        "responses": {"200": _json("the outcome", _ref("TransactionResult")), **_BAD, **_AUTH, **_UNAVAILABLE}}},
    "/api/v1/lease/{leaseId}/extend": {"post": {
        "summary": "Extend a pop's lease to at least now + `seconds` (never shortens it)",
        "parameters": [_p("leaseId", "the leaseId a pop returned")],
        "requestBody": {"required": False, "content": {"application/json": {"schema": {
            "type": "object", "properties": {"seconds": {"type": ["integer", "null"], "minimum": 1, "maximum": 86400,
                                                         "default": 60}}}}}},
        "responses": {"200": _json("a one-element array; success false when the lease is unknown, released, "
                                   "expired or another tenant's",
                                   {"type": "array", "items": _ref("LeaseExtendResult")}),
                      **_BAD, **_AUTH, **_UNAVAILABLE}}},
}

_INT = {"type": ["integer", "null"], "minimum": 0, "maximum": 999999999}  # null: the default
_BOOL = {"type": ["boolean", "null"]}
_OPTIONS = {
    "leaseTime": _INT, "retryLimit": _INT, "retryDelay": _INT, "maxSize": _INT, "ttl": _INT, "priority": _INT,
    "delayedProcessing": _INT, "windowBuffer": _INT, "retentionSeconds": _INT, "completedRetentionSeconds": _INT,
    "retentionEnabled": _BOOL, "encryptionEnabled": _BOOL, "deadLetterQueue": _BOOL,
    "dlqAfterMaxRetries": _BOOL, "maxWaitTimeSeconds": _INT,
}
_MESSAGE_FIELDS = {
    "id": {"type": "string", "format": "uuid"}, "transactionId": {"type": "string"},
    "traceId": {"type": ["string", "null"]},
    "data": {"description": "the payload: its JSON value when the bytes are JSON, else their base64"},
    "payloadBase64": {"type": "string", "contentEncoding": "base64", "description": "the exact bytes"},
    "producerSub": {"type": ["string", "null"]},
    "createdAt": {"type": "string", "description": "YYYY-MM-DDTHH:MM:SS.ffffffZ"},
    "partitionId": {"type": "string", "format": "uuid"}, "partition": {"type": "string"},
    "queue": {"type": "string"},
}

OPENAPI_SCHEMAS: dict = {
    "ConfigureRequest": {"type": "object", "required": ["queue"], "properties": {
        "queue": {"type": "string", "minLength": 1}, "namespace": {"type": ["string", "null"]},
        "task": {"type": ["string", "null"]},
        "options": {"type": ["object", "null"], "properties": _OPTIONS,
                    "description": "camelCase; unknown keys are dropped, missing ones reset to the default"}}},
    "ConfigureResult": {"type": "object", "properties": {
        "configured": {"const": True}, "queueId": {"type": "string", "format": "uuid"},
        "partitionId": {"type": "string", "format": "uuid", "description": "the Default partition"},
        "queue": {"type": "string"}, "namespace": {"type": ["string", "null"]}, "task": {"type": ["string", "null"]},
        "options": {"type": "object", "properties": _OPTIONS}}},
    "PushRequest": {"type": "object", "required": ["items"], "properties": {"items": {"type": "array", "items": {
        "type": "object", "required": ["queue"], "properties": {
            "queue": {"type": "string", "minLength": 1},
            "partition": {"type": "string", "default": "Default"},
            "payload": {"description": "any JSON value (default {}); stored as its compact JSON bytes"},
            "transactionId": {"type": "string", "description": "unique per partition; generated when absent"},
            "traceId": {"type": ["string", "null"], "format": "uuid"}},
        "description": "producerSub and messageId are set by the server; values sent are ignored"}}}},
    "PushResult": {"type": "object", "properties": {
        "index": {"type": "integer"}, "transaction_id": {"type": "string"},
        "status": {"enum": ["queued", "duplicate"]}, "message_id": {"type": "string", "format": "uuid"},
        "partition_id": {"type": "string", "format": "uuid"}, "trace_id": {"type": ["string", "null"]},
        "queueName": {"type": "string"}}},
    "PopResult": {"type": "object", "properties": {
        "success": {"const": True}, "queue": {"type": "string"}, "partition": {"type": "string"},
        "partitionId": {"type": "string", "format": "uuid"}, "leaseId": {"type": "string"},
        "consumerGroup": {"type": "string"}, "partitionsClaimed": {"type": "integer"},
        "leaseExpiresAt": {"type": ["string", "null"]},
        "messages": {"type": "array", "items": {"type": "object", "properties": {
            **_MESSAGE_FIELDS, "leaseId": {"type": "string"}, "consumerGroup": {"type": "string"}}}}}},
    "Ack": {"type": "object", "required": ["transactionId", "partitionId"], "properties": {
        "transactionId": {"type": "string", "minLength": 1}, "partitionId": {"type": "string", "format": "uuid"},
        "status": {"enum": list(ACK_STATUSES), "default": "completed"},
        "error": {"description": "a string, or any JSON value (stored as its JSON text); null: none"},
        "leaseId": {"type": ["string", "null"]},
        "consumerGroup": {"type": ["string", "null"]}}},
    "AckResult": {"type": "object", "properties": {
        "index": {"type": "integer"}, "transactionId": {"type": "string"}, "success": {"type": "boolean"},
        "error": {"enum": [None, "Message not found", "Invalid or expired lease", "Message not yet readable"]},
        "queueName": {"type": ["string", "null"]}, "partitionName": {"type": ["string", "null"]},
        "leaseReleased": {"type": "boolean"}, "dlq": {"type": "boolean"}}},
    "MessageDetail": {"type": "object", "properties": {
        **_MESSAGE_FIELDS, "queuePath": {"type": "string"},
        "status": {"enum": ["dead_letter", "completed", "processing", "pending"]},
        "payload": {"description": "same as data (Queen's field name)"},
        "isEncrypted": {"type": "boolean"}, "namespace": {"type": ["string", "null"]},
        "task": {"type": ["string", "null"]}, "errorMessage": {"type": ["string", "null"]},
        "retryCount": {"type": "integer"}, "leaseExpiresAt": {"type": ["string", "null"]},
        "queueConfig": {"type": "object"}, "mode": {"type": "object"}, "consumerGroups": {"type": "array"}}},
    "DlqPage": {"type": "object", "properties": {
        "messages": {"type": "array", "items": {"type": "object", "properties": {
            **_MESSAGE_FIELDS, "dlqId": {"type": "string", "format": "uuid",
                                         "description": "the DLQ entry (for replay); `id` is the message id"},
            "consumerGroup": {"type": "string"}, "errorMessage": {"type": ["string", "null"]},
            "retryCount": {"type": "integer"}, "isEncrypted": {"type": "boolean"},
            "payloadZstd": {"type": "boolean", "description": "a timer's zstd payload, dead-lettered as stored"},
            "failedAt": {"type": "string"}}}},
        "pagination": {"type": "object", "properties": {
            "limit": {"type": "integer", "description": "the page size; when QUEEN_POP_MAX_BYTES of payloads cut the "
                                                        "page short, the number of entries it holds (offset + limit "
                                                        "is the next page either way)"},
            "offset": {"type": "integer"}}},
        "total": {"type": "integer"}}},
    "TransactionRequest": {"type": "object", "required": ["operations"], "properties": {
        "operations": {"type": "array", "minItems": 1, "items": {"oneOf": [
            {"type": "object", "required": ["type", "items"], "properties": {
                "type": {"const": "push"},
                "items": {"type": "array", "items": {"type": "object", "required": ["queue"], "properties": {
                    "queue": {"type": "string", "minLength": 1}, "partition": {"type": "string"},
                    "payload": {"description": "any JSON value (`data` is read when payload is absent)"},
                    "transactionId": {"type": "string"}, "traceId": {"type": ["string", "null"], "format": "uuid"}}}}}},
            {"allOf": [{"type": "object", "required": ["type"], "properties": {"type": {"const": "ack"}}},
                       _ref("Ack")]}]}},
        "requiredLeases": {"type": "array", "items": {"type": "string"}, "maxItems": MAX_TXN_LEASES,
                           "description": "leases that must be held (an id that is not a UUID is held by "
                                          "nobody; duplicates count once, but toward maxItems too); an ack "
                                          "without its own leaseId borrows the lease when exactly one "
                                          "distinct lease is named"},
        "kv": {"description": "not supported by this broker: a non-empty value is 400"},
        "timers": {"description": "not supported by this broker: a non-empty value is 400"}}},
    "TransactionResult": {"type": "object", "properties": {
        "transactionId": {"type": "string", "format": "uuid"}, "success": {"type": "boolean"},
        "error": {"type": "string", "description": "only when success is false"},
        "failedIndex": {"type": ["integer", "null"], "description": "only when success is false"},
        "results": {"type": "array", "description": "one per operation when success; empty otherwise",
                    "items": {"type": "object", "properties": {
                        "index": {"type": "integer"}, "type": {"enum": ["push", "ack"]},
                        "success": {"type": "boolean"}, "status": {"enum": ["queued", "duplicate"]},
                        "transactionId": {"type": "string"}, "messageId": {"type": "string", "format": "uuid"},
                        "partitionId": {"type": "string", "format": "uuid"}, "queueName": {"type": "string"},
                        "partitionName": {"type": "string"}, "error": {"type": ["string", "null"]},
                        "leaseReleased": {"type": "boolean"}, "dlq": {"type": "boolean"}}}}}},
    "LeaseExtendResult": {"type": "object", "properties": {
        "index": {"const": 0}, "leaseId": {"type": "string"}, "success": {"type": "boolean"},
        "error": {"enum": [None, "Lease not found", "Lease already expired"]},
        "expiresAt": {"type": ["string", "null"]}, "newExpiresAt": {"type": ["string", "null"]},
        "renewed": {"type": "integer", "description": "partitions extended"}}},
}
