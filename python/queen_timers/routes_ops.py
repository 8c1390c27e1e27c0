"""Operator routes: the fire's switches, its status, and the Prometheus scrape.

    GET  /api/v1/system/timers             operator  {schedulingPaused, firePaused, pending}
    GET  /api/v1/system/timers/stats       read-only  per-queue aggregates of the caller's tenant
    POST /api/v1/system/timers/scheduling  operator  {"paused": bool} -> status
    POST /api/v1/system/timers/fire        operator  {"paused": bool} -> status
    GET  /metrics/prometheus               public  text/plain; version=0.0.4

The switches are queen.pause_scheduling / queen.pause_fire: one row in
queen.cell_settings, so a pause applies to every broker of the cell, and a
DBA can flip it from psql with no broker running. Over HTTP they need an
`admin` credential of the operator tenant (QUEEN_OPERATOR_TENANT, `default`):
a pause stops every tenant's timers, so one tenant's admin cannot take the
cell's fire down for the others.

The stats (queen.get_timer_stats) are aggregates only, counts per queue and
per time bucket of the caller's tenant: the contract has no tenant-wide
timer list, and this route is not one.
"""

from __future__ import annotations

import math
from datetime import timezone

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from . import db
from .auth import READ_ONLY
from .bodies import TENANT_KEY, read_json
from .errors import bad_request, from_exception, query_int, query_param
from .limits import INT32_MAX, INT32_MIN, check_name
from .metrics import CONTENT_TYPE

STATUS_SQL = "SELECT * FROM queen.get_timer_status()"
STATS_SQL = "SELECT * FROM queen.get_timer_stats(%s, %s, %s, %s, %s, %s)"
TOTALS_SQL = "SELECT * FROM queen.get_timer_totals(%s, %s, %s, %s)"
STATS_START_SQL = "SELECT now() AS as_of, queen.get_pending_timers(%s) AS pending"
# The two stats statements each pass over every timer of the tenant: about 0.6 s a
# million here, 1.6-1.9 s on a loaded machine. At the plain statement timeout a tenant
# of 3,000,000 timers always got the 503 (Dec 7 audit); so their transaction's timeout
# grows by this much per started million of the tenant's pending timers (the counter's
# figure, one lookup). One tenant's requests hold at most its share of the pool.
STATS_MS_PER_MILLION = 2500
# what one stats answer holds at most: queues, and counts of their histograms
# (1,000 queues at the default 60 buckets, 69 at the largest, 1,440)
STATS_MAX_QUEUES = 1000
STATS_MAX_COUNTS = 100_000
STATS_COUNTS = ("pending", "due", "claimed", "retrying")


def _status_body(row: dict) -> dict:
    return {"schedulingPaused": row["scheduling_paused"], "firePaused": row["fire_paused"],
            "pending": int(row["pending"])}


async def _paused_flag(request: Request) -> bool:
    body = await read_json(request, empty=None)
    if not isinstance(body, dict):
        raise bad_request("body must be a JSON object: {\"paused\": true|false}")
    unknown = sorted(set(body) - {"paused"})
    if unknown:
        raise bad_request(f"unknown field(s): {', '.join(unknown)}")
    paused = body.get("paused")
    if not isinstance(paused, bool):
        raise bad_request("paused is required and must be a boolean")
    return paused


async def _status(request: Request) -> dict:
    async with request.app.state.pool.connection(tenant=request.scope.get(TENANT_KEY)) as conn:
        cur = await conn.execute(STATUS_SQL)
        return _status_body(await cur.fetchone())


async def timers_status(request: Request) -> JSONResponse:
    request.app.state.auth.require_operator(request)
    return JSONResponse(await _status(request))


async def _switch(request: Request, function: str) -> JSONResponse:
    request.app.state.auth.require_operator(request)
    paused = await _paused_flag(request)
    async with request.app.state.pool.connection(tenant=request.scope.get(TENANT_KEY)) as conn:
        await conn.execute(f"SELECT queen.{function}(%s)", (paused,))
        cur = await conn.execute(STATUS_SQL)
        return JSONResponse(_status_body(await cur.fetchone()))


async def pause_scheduling(request: Request) -> JSONResponse:
    return await _switch(request, "pause_scheduling")


async def pause_fire(request: Request) -> JSONResponse:
    return await _switch(request, "pause_fire")


def _iso(value) -> str | None:
    return None if value is None else value.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _int_query(request: Request, name: str, default: int) -> int:
    """An integer query parameter the SQL checks the range of; past a 32-bit integer a 400."""
    value = query_int(request.scope, name)
    if value is None:
        return default
    if not INT32_MIN <= value <= INT32_MAX:
        raise bad_request(f"query parameter {name} is out of range (a 32-bit integer)")
    return value


async def timers_stats(request: Request) -> JSONResponse:
    """Counts per queue and per bucket of deliverAt; the ranges are checked by SQL (QTBAD -> 400).

    The queues come a page at a time (?after=, ?limit=): at most STATS_MAX_QUEUES
    queues and STATS_MAX_COUNTS histogram counts per answer, so that what one
    request makes the broker hold does not grow with the tenant's queues."""
    principal = request.app.state.auth.require(request, READ_ONLY)
    buckets = _int_query(request, "buckets", 60)
    bucket_seconds = _int_query(request, "bucketSeconds", 60)
    page = stats_page_size(buckets)
    asked = query_int(request.scope, "limit")
    limit = page if asked is None else max(1, min(asked, page))  # clamped (docs/limits.md)
    after = query_param(request.scope, "after") or None
    if after is not None:
        check_name("queue", after, "after: ")  # a queue name: its limits
    settings = request.app.state.settings
    async with request.app.state.pool.connection(tenant=request.scope.get(TENANT_KEY)) as conn, \
            conn.transaction():
        cur = await conn.execute(STATS_START_SQL, (principal.tenant,))
        start = await cur.fetchone()
        as_of = start["as_of"]
        if settings.statement_timeout_ms:  # each statement passes over the tenant's timers
            timeout = settings.statement_timeout_ms + math.ceil(start["pending"] / 1e6) * STATS_MS_PER_MILLION
            await db.set_statement_timeout(conn, settings, timeout, statements=2)  # the totals, the page
        cur = await conn.execute(TOTALS_SQL, (principal.tenant, buckets, bucket_seconds, as_of))
        totals = await cur.fetchone()
        # one row past the page says whether another page follows
        cur = await conn.execute(STATS_SQL, (principal.tenant, buckets, bucket_seconds, as_of, after, limit + 1))
        rows = await cur.fetchall()
    truncated = len(rows) > limit
    del rows[limit:]
    queues = [{"queue": r["queue"], **{k: int(r[k]) for k in STATS_COUNTS},
               "nextDeliverAt": _iso(r["next_deliver_at"]),
               "dueByBucket": r["due_by_bucket"]} for r in rows]
    return JSONResponse({
        "tenant": principal.tenant, "asOf": _iso(as_of),
        "buckets": buckets, "bucketSeconds": bucket_seconds,
        "totals": {k: int(totals[k]) for k in STATS_COUNTS},
        "dueByBucket": totals["due_by_bucket"],
        "queueCount": int(totals["queues"]),
        "queues": queues,
        "truncated": truncated,
        "nextAfter": queues[-1]["queue"] if truncated else None,
    })


def stats_page_size(buckets: int) -> int:
    """The most queues one stats answer holds at this many buckets."""
    return max(1, min(STATS_MAX_QUEUES, STATS_MAX_COUNTS // max(buckets, 1)))


async def prometheus(request: Request) -> Response:
    return Response(await request.app.state.metrics_scrape(), media_type=CONTENT_TYPE)


async def scrape(pool, metrics) -> bytes:
    """The gauges read from PostgreSQL, then every metric rendered (one at a time for every
    scrape that comes meanwhile: turns.SharedCall, app.py)."""
    try:
        async with pool.connection() as conn:
            cur = await conn.execute(STATUS_SQL)
            metrics.set_status(await cur.fetchone())
    except Exception as exc:
        # the counters are this process's and are still worth a scrape; the
        # gauges read from PostgreSQL keep their last value
        if from_exception(exc) is None:
            raise
    return metrics.render()


routes = [
    Route("/api/v1/system/timers", timers_status, methods=["GET"]),
    Route("/api/v1/system/timers/stats", timers_stats, methods=["GET"]),
    Route("/api/v1/system/timers/scheduling", pause_scheduling, methods=["POST"]),
    Route("/api/v1/system/timers/fire", pause_fire, methods=["POST"]),
    Route("/metrics/prometheus", prometheus, methods=["GET"]),
]

_STATUS_SCHEMA = {
    "type": "object",
    "required": ["schedulingPaused", "firePaused", "pending"],
    "properties": {
        "schedulingPaused": {"type": "boolean", "description": "POST /api/v1/timers answers 503 timers_disabled"},
        "firePaused": {"type": "boolean", "description": "no broker of the cell fires timers"},
        "pending": {"type": "integer", "description": "pending timers in the cell"},
    },
}
_COUNTS = {
    "pending": {"type": "integer", "description": "every timer not yet fired, claimed and in backoff included"},
    "due": {"type": "integer", "description": "deliverAt has passed and no broker holds it"},
    "claimed": {"type": "integer", "description": "a broker holds it (lease running)"},
    "retrying": {"type": "integer", "description": "not claimed, at least one fire of it failed"},
}
_HISTOGRAM = {"type": "array", "items": {"type": "integer", "minimum": 0},
              "description": "`buckets` counts of unclaimed timers by deliverAt, from asOf"}
_STATS_SCHEMA = {
    "type": "object",
    "required": ["tenant", "asOf", "buckets", "bucketSeconds", "totals", "dueByBucket", "queueCount", "queues",
                 "truncated", "nextAfter"],
    "properties": {
        "tenant": {"type": "string"},
        "asOf": {"type": "string", "format": "date-time", "description": "PostgreSQL's now(): the buckets' origin"},
        "buckets": {"type": "integer"},
        "bucketSeconds": {"type": "integer"},
        "totals": {"type": "object", "required": list(_COUNTS), "properties": _COUNTS},
        "dueByBucket": _HISTOGRAM,
        "queueCount": {"type": "integer", "description": "the tenant's queues holding a timer (every page)"},
        "truncated": {"type": "boolean", "description": "more queues follow this page"},
        "nextAfter": {"type": ["string", "null"], "description": "pass as ?after= for the next page"},
        "queues": {"type": "array", "description": "one per queue holding a timer of the tenant, by name, "
                                                   "a page at a time (totals and dueByBucket cover every queue)",
                   "items": {"type": "object",
                             "required": ["queue", *_COUNTS, "nextDeliverAt", "dueByBucket"],
                             "properties": {"queue": {"type": "string"}, **_COUNTS,
                                            "nextDeliverAt": {"type": ["string", "null"], "format": "date-time",
                                                              "description": "soonest deliverAt of an unclaimed timer"},
                                            "dueByBucket": _HISTOGRAM}}},
    },
}
_ERROR = {"type": "object", "required": ["error"],
          "properties": {"error": {"type": "string"}, "detail": {"type": "string"}}}
_ERRORS = {
    "400": {"description": "body is not {\"paused\": bool}", "content": {"application/json": {"schema": _ERROR}}},
    "401": {"description": "no or bad credential", "content": {"application/json": {"schema": _ERROR}}},
    "403": {"description": "the credential is not admin", "content": {"application/json": {"schema": _ERROR}}},
    "503": {"description": "the database cannot answer", "content": {"application/json": {"schema": _ERROR}}},
}
_STATUS_OK = {"200": {"description": "the fire's switches and the pending count",
                      "content": {"application/json": {"schema": _STATUS_SCHEMA}}}}
_PAUSED_BODY = {
    "required": True,
    "content": {"application/json": {"schema": {
        "type": "object", "required": ["paused"], "additionalProperties": False,
        "properties": {"paused": {"type": "boolean"}}}}},
}


OPERATOR_NOTE = (" Needs an admin credential of the operator tenant (QUEEN_OPERATOR_TENANT, `default`); "
                 "another tenant's admin gets 403 forbidden: a switch acts on every tenant of the cell.")


def _switch_op(summary: str, description: str) -> dict:
    return {"post": {"summary": summary, "description": description + OPERATOR_NOTE, "tags": ["system"],
                     "x-access-level": "admin", "requestBody": _PAUSED_BODY,
                     "responses": {**_STATUS_OK, **_ERRORS}}}


# Merged by openapi.py into the document served by the broker.
OPENAPI_PATHS: dict = {
    "/api/v1/system/timers": {
        "get": {"summary": "Status of the fire", "tags": ["system"], "x-access-level": "admin",
                "description": "The operator switches (queen.cell_settings) and the cell's pending timers."
                               + OPERATOR_NOTE,
                "responses": {**_STATUS_OK, **{k: v for k, v in _ERRORS.items() if k != "400"}}},
    },
    "/api/v1/system/timers/stats": {
        "get": {"summary": "Aggregates of the caller's pending timers, per queue and per time bucket",
                "tags": ["system"], "x-access-level": "read-only",
                "description": "Counts only, never a timer (there is no tenant-wide timer list), and only "
                               "the caller's tenant (queen.get_timer_stats). dueByBucket[i] counts the "
                               "unclaimed timers with asOf + i*bucketSeconds <= deliverAt < asOf + "
                               "(i+1)*bucketSeconds (and deliverAt > asOf); a timer already due is in `due`. "
                               "Costs two passes over the tenant's timers (the totals, then the page): for a dashboard, "
                               "not a hot path. The queues come a page at a time: at most 1,000 and at most "
                               "100,000 histogram counts (queues x buckets) per answer.",
                "parameters": [
                    {"name": "buckets", "in": "query", "required": False,
                     "schema": {"type": "integer", "default": 60, "minimum": 1, "maximum": 1440}},
                    {"name": "bucketSeconds", "in": "query", "required": False,
                     "schema": {"type": "integer", "default": 60, "minimum": 1, "maximum": 86400}},
                    {"name": "after", "in": "query", "required": False,
                     "description": "the page starts after this queue name (the previous page's nextAfter)",
                     "schema": {"type": "string", "maxLength": 255}},
                    {"name": "limit", "in": "query", "required": False,
                     "description": "queues per page, clamped to 1..min(1000, 100000 / buckets) "
                                    "(the default is that maximum)",
                     "schema": {"type": "integer"}}],
                "responses": {
                    "200": {"description": "the aggregates",
                            "content": {"application/json": {"schema": _STATS_SCHEMA}}},
                    "400": {"description": "buckets, bucketSeconds or limit not an integer, buckets or "
                                           "bucketSeconds out of range, after over 255 bytes "
                                           "(timers_bad_request)",
                            "content": {"application/json": {"schema": _ERROR}}},
                    **{k: v for k, v in _ERRORS.items() if k in ("401", "503")},
                    "403": {"description": "the credential has no read-only access (write-only)",
                            "content": {"application/json": {"schema": _ERROR}}}}},
    },
    "/api/v1/system/timers/scheduling": _switch_op(
        "Pause or resume scheduling",
        "paused=true: POST /api/v1/timers answers 503 timers_disabled in every broker; "
        "DELETE, peek, list and the fire go on (queen.pause_scheduling)."),
    "/api/v1/system/timers/fire": _switch_op(
        "Pause or resume the fire",
        "paused=true: no broker of the cell claims or fires a timer until resumed (queen.pause_fire). "
        "The only switch that stops the fire."),
    "/metrics/prometheus": {
        "get": {"summary": "Prometheus metrics", "tags": ["system"], "x-access-level": "public",
                "security": [],
                "responses": {"200": {"description": "text exposition format 0.0.4",
                                      "content": {"text/plain": {"schema": {"type": "string"}}}}}},
    },
}
