"""The OpenAPI 3.1 document of the broker, served at GET /openapi.json (public).

The timer routes and /health are described here. Other route modules
(routes_log, routes_ops, routes_dashboard) add theirs with module-level
dicts, merged at request time:

    OPENAPI_PATHS   = {"/api/v1/...": {"get": {...}}}       # merged into "paths"
    OPENAPI_SCHEMAS = {"Name": {...}}                        # merged into components.schemas

Path templates use OpenAPI's `{name}` (a Starlette `{timerKey:anypath}` is
`{timerKey}` here). Every route the app registers must appear
(tests/py/test_timers_openapi.py checks it).
"""

from __future__ import annotations

import copy
import functools

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from . import __version__

HINT = "DELETE /api/v1/timers/:queue/*timerKey"


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _error(description: str, slugs: list[str], headers: dict | None = None) -> dict:
    schema = {
        "allOf": [_ref("Error"), {"properties": {"error": {"enum": slugs}}}],
    }
    out = {"description": description, "content": {"application/json": {"schema": schema}}}
    if headers:
        out["headers"] = headers
    return out


RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying",
                               "schema": {"type": "integer", "minimum": 1}}}
HINT_HDR = {"x-queen-timers-hint": {
    "description": f"on every refusal of the batch by a rung (and by capacity): `{HINT}`, the cancel "
                   "route that passes no rung of the gate ladder",
    "schema": {"type": "string", "const": HINT}}}

AUTH_RESPONSES = {
    "401": _error("no credential, or a bad one (QUEEN_AUTH=jwt)", ["unauthorized"]),
}


def _forbidden_only() -> dict:
    return _error("the credential's access level is too low", ["forbidden"])


# strict base64 with padding, as the broker decodes it
BASE64_PATTERN = "^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"
_OP_FIELDS: dict[str, dict] = {
    "queue": {"type": "string", "minLength": 1, "description": "destination queue; at most 255 bytes of UTF-8"},
    "timerKey": {"type": "string", "minLength": 1, "description": "identity, with the queue and the tenant; at most 1024 bytes of UTF-8"},
    "delayMs": {"type": "integer", "minimum": -(2 ** 63), "maximum": 2 ** 63 - 1,
                "description": "milliseconds from PostgreSQL's now(); a value in the past is legal and "
                               "fires on the first cycle; beyond the horizon in force is 403"},
    "txn": {"type": "string", "minLength": 1, "description": "transaction id the frame will carry; "
            "required for schedule, minted by the server when a reschedule omits it, echoed by cancel; at most 255 bytes of UTF-8"},
    "payload": {"type": "string", "contentEncoding": "base64", "pattern": BASE64_PATTERN,
                "description": "base64 (with padding); with payloadZstd, a zstd frame"},
    "partition": {"type": ["string", "null"], "minLength": 1, "default": "Default",
                  "description": "at most 255 bytes of UTF-8"},
    "payloadZstd": {"type": ["boolean", "null"], "default": False},
    "encrypted": {"type": ["boolean", "null"], "description": "refused when the destination queue "
                  "encrypts at rest: the broker sets it"},
}


def _timer_op(op: str, required: list[str]) -> dict:
    fields = {k: v for k, v in _OP_FIELDS.items()}
    if "txn" not in required:
        fields["txn"] = {**fields["txn"], "type": ["string", "null"]}
    return {"type": "object", "additionalProperties": False,
            "required": ["op", "queue", "timerKey", *required],
            "properties": {"op": {"const": op}, **fields}}


SCHEMAS: dict[str, dict] = {
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {"error": {"type": "string", "description": "machine-readable slug"},
                       "detail": {"type": "string", "description": "what went wrong, for a human"}},
    },
    "TimerOperation": {
        "oneOf": [_ref("ScheduleOperation"), _ref("RescheduleOperation"), _ref("CancelOperation")],
        "description": "one operation, by `op`. producerSub, messageId, tenant and any field starting "
                       "with '_' are owned by the server and refused (400), as is any unknown field or "
                       "a field that does not apply to the op; null is the same as absent.",
    },
    "ScheduleOperation": _timer_op("schedule", ["delayMs", "txn", "payload"]),
    "RescheduleOperation": _timer_op("reschedule", ["delayMs", "payload"]),
    "CancelOperation": {
        "type": "object",
        "additionalProperties": False,
        "required": ["op", "queue", "timerKey"],
        "properties": {"op": {"const": "cancel"}, "queue": _OP_FIELDS["queue"],
                       "timerKey": _OP_FIELDS["timerKey"],
                       "txn": {**_OP_FIELDS["txn"], "type": ["string", "null"]}},
    },
    "ScheduleRequest": {
        "type": "object",
        "additionalProperties": False,
        "required": ["operations"],
        "properties": {"operations": {"type": "array", "items": _ref("TimerOperation"),
                                      "description": "at most QUEEN_TIMERS_MAX_OPS (256)"}},
    },
    "TimerStatus": {
        "type": "string",
        "enum": ["scheduled", "rescheduled", "cancelled", "absent", "too_late"],
        "description": "closed taxonomy. absent means no longer pending: it may mean already "
                       "delivered; the authority is the log (look for the txn).",
    },
    "TimerVerdict": {
        "type": "object",
        "required": ["ok", "status", "queue", "timerKey", "txn", "messageId", "deliverAt"],
        "properties": {
            "ok": {"type": "boolean"},
            "status": _ref("TimerStatus"),
            "queue": {"type": "string"},
            "timerKey": {"type": "string"},
            "txn": {"type": ["string", "null"]},
            "messageId": {"type": ["string", "null"], "format": "uuid"},
            "deliverAt": {"type": ["string", "null"], "format": "date-time",
                          "description": "not before; ISO-8601 UTC with microseconds"},
        },
    },
    "ScheduleResult": {
        "type": "object",
        "required": ["results"],
        "additionalProperties": False,
        "properties": {"results": {"type": "array", "items": _ref("TimerVerdict"),
                                   "description": "index-aligned with `operations`"}},
    },
    "CancelResult": {
        "type": "object",
        "required": ["ok", "status", "queue", "timerKey", "txn"],
        "properties": {
            "ok": {"type": "boolean"},
            "status": {"type": "string", "enum": ["cancelled", "absent", "too_late"]},
            "queue": {"type": "string"},
            "timerKey": {"type": "string"},
            "txn": {"type": ["string", "null"], "description": "echo of the ?txn= query parameter"},
        },
    },
    "TimerSummary": {
        "type": "object",
        "properties": {
            "timerKey": {"type": "string"},
            "partition": {"type": "string"},
            "deliverAt": {"type": "string", "format": "date-time"},
            "txn": {"type": "string"},
            "messageId": {"type": "string", "format": "uuid"},
            "payloadZstd": {"type": "boolean"},
            "encrypted": {"type": "boolean"},
            "producerSub": {"type": ["string", "null"]},
            "attempts": {"type": "integer"},
            "lastError": {"type": ["string", "null"]},
            "claimed": {"type": "boolean", "description": "a broker holds it and is about to "
                        "deliver it; a row in backoff is not claimed"},
            "createdAt": {"type": "string", "format": "date-time"},
            "updatedAt": {"type": "string", "format": "date-time"},
        },
    },
    "TimerPeek": {
        "oneOf": [
            {"type": "object", "required": ["found"], "additionalProperties": False,
             "properties": {"found": {"const": False}}},
            {"allOf": [
                _ref("TimerSummary"),
                {"type": "object",
                 "required": ["found", "queue", "timerKey", "payload"],
                 "properties": {
                     "found": {"const": True},
                     "queue": {"type": "string"},
                     "payload": {"type": "string", "contentEncoding": "base64",
                                 "description": "as stored: never decrypted, never inflated"},
                 }},
            ]},
        ],
    },
    "TimerPage": {
        "type": "object",
        "required": ["rows", "truncated", "nextAfter"],
        "properties": {
            "rows": {"type": "array", "items": _ref("TimerSummary")},
            "truncated": {"type": "boolean"},
            "nextAfter": {"type": ["string", "null"],
                          "description": "pass as ?after= for the next page"},
        },
    },
    "Health": {
        "type": "object",
        "properties": {"status": {"type": "string", "enum": ["healthy", "unhealthy"]},
                       "database": {"type": "string", "enum": ["connected", "disconnected"]},
                       "server": {"type": "string"}, "worker_id": {"type": "string"},
                       "version": {"type": "string"}},
    },
}

QUEUE_PARAM = {"name": "queue", "in": "path", "required": True, "schema": {"type": "string"},
               "description": "the queue's name, percent-encoded: a '/' in it is `%2F` (queue `/a` is "
                              "`%2Fa`); a raw '/' ends the segment"}
KEY_PARAM = {"name": "timerKey", "in": "path", "required": True,
             "description": "any text, '/' included: the contract's catch-all `*timerKey`. As OpenAPI "
                            "3.1 serialises a path parameter, a '/' in the key is percent-encoded "
                            "(`tenant%2F42`); the broker also takes it raw (`tenant/42`), and both "
                            "name the same key. Everything after `{queue}/` is the key.",
             "schema": {"type": "string", "minLength": 1},
             "examples": {"slash": {"summary": "a key with a slash", "value": "tenant/42"},
                          "plain": {"value": "trial:acme:day7"}}}
UNAVAILABLE = _error("the database cannot answer (pool exhausted, statement timeout, unreachable)",
                     ["timers_unavailable"], RETRY_AFTER)
# a peek holds its payload: it also waits for room in the body budget (docs/request-bodies.md)
UNAVAILABLE_WEIGHED = _error("the database cannot answer (pool exhausted, statement timeout, unreachable), or "
                             "the body budget had no room for the answer within QUEEN_BODY_WAIT_MS",
                             ["timers_unavailable"], RETRY_AFTER)


def _json(description: str, schema: dict) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


TIMER_PATHS: dict[str, dict] = {
    "/health": {"get": {
        "summary": "liveness and database reachability", "security": [],
        "responses": {"200": _json("healthy", _ref("Health")),
                      "503": _json("the database is unreachable", _ref("Health"))},
    }},
    "/openapi.json": {"get": {
        "summary": "this document", "security": [],
        "responses": {"200": {"description": "OpenAPI 3.1 document",
                              "content": {"application/json": {"schema": {"type": "object"}}}}},
    }},
    "/api/v1/timers": {"post": {
        "summary": "schedule, reschedule and cancel, in one batch",
        "description": "Access level write-only. The gate ladder (SQL, queen.check_timer_gates) runs "
                       "in order: operator pause (503 timers_disabled), plan grant (403 "
                       "feature_gated), produce block (403 produce_blocked), rate (429 rate_limited), "
                       "pending-timer quota (403 timers_quota_exceeded), horizon (403 "
                       "timer_horizon_exceeded), payload ceiling (413 payload_too_large). A refusal "
                       "refuses the whole batch and writes nothing.",
        "x-access-level": "write-only",
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": _ref("ScheduleRequest")}}},
        "responses": {
            "200": _json("one verdict per operation, in input order, under `results` "
                         "(the envelope Queen's clients read)", _ref("ScheduleResult")),
            "400": _error("shape: the batch is refused before any SQL", ["timers_bad_request"]),
            **AUTH_RESPONSES,
            "403": _error("a rung refused the batch (or the credential is too low: forbidden)",
                          ["forbidden", "feature_gated", "produce_blocked", "timers_quota_exceeded",
                           "timer_horizon_exceeded"], HINT_HDR),
            "413": _error("payload_too_large: a decoded (or decompressed) payload is over min(1 MiB, "
                          "the plan's max), a rung, with the hint header; body_too_large: the request "
                          "body is over QUEEN_MAX_BODY_BYTES, or one operation's JSON over 8 MiB (refused "
                          "before it is read whole, no hint)",
                          ["payload_too_large", "body_too_large"], HINT_HDR),
            "429": _error("rate exceeded", ["rate_limited"], {**RETRY_AFTER, **HINT_HDR}),
            "503": _error("an operator paused scheduling, the database cannot answer, or the body budget "
                          "(QUEEN_BODY_BUDGET_BYTES) had no room in time",
                          ["timers_disabled", "timers_unavailable"], {**RETRY_AFTER, **HINT_HDR}),
        },
    }},
    "/api/v1/timers/{queue}": {"get": {
        "summary": "keyset list of a queue's pending timers (no payloads)",
        "x-access-level": "read-only",
        "parameters": [
            QUEUE_PARAM,
            {"name": "after", "in": "query", "required": False, "schema": {"type": "string"},
             "description": "exclusive cursor over timerKey (byte order)"},
            {"name": "limit", "in": "query", "required": False,
             "schema": {"type": "integer", "default": 100},
             "description": "any integer, clamped to 1..1000 (not rejected); a non-integer is 400"},
        ],
        "responses": {
            "200": _json("a page", _ref("TimerPage")),
            "400": _error("limit is not an integer", ["timers_bad_request"]),
            **AUTH_RESPONSES,
            "403": _forbidden_only(),
            "503": UNAVAILABLE,
        },
    }},
    "/api/v1/timers/{queue}/{timerKey}": {
        "get": {
            "summary": "peek one timer, with its payload as stored",
            "x-access-level": "read-only",
            "parameters": [QUEUE_PARAM, KEY_PARAM],
            "responses": {
                "200": _json("the timer, or {\"found\": false}", _ref("TimerPeek")),
                "400": _error("shape", ["timers_bad_request"]),
                **AUTH_RESPONSES,
                "403": _forbidden_only(),
                "503": UNAVAILABLE_WEIGHED,
            },
        },
        "delete": {
            "summary": "cancel, on its own route: passes no rung of the gate ladder",
            "description": "Access level read-write. Not a paused schedule, not a missing grant, "
                           "not a full quota may refuse it. absent (ok: false) means no longer "
                           "pending, which may mean already delivered: look for the txn in the log.",
            "x-access-level": "read-write",
            "parameters": [QUEUE_PARAM, KEY_PARAM,
                           {"name": "txn", "in": "query", "required": False,
                            "schema": {"type": "string"}, "description": "echoed in the response"}],
            "responses": {
                "200": _json("the verdict", _ref("CancelResult")),
                "400": _error("shape", ["timers_bad_request"]),
                **AUTH_RESPONSES,
                "403": _forbidden_only(),
                "503": UNAVAILABLE,
            },
        },
    },
}


BODY_TOO_LARGE = _error("the request body is over its cap (QUEEN_MAX_BODY_BYTES for POST /api/v1/timers, "
                        "QUEEN_LOG_MAX_BODY_BYTES for every other route) by its Content-Length, or by the "
                        "bytes streamed so far; nothing is written", ["body_too_large"])
BODY_BUSY = _error("the broker's budget for request bodies in flight (QUEEN_BODY_BUDGET_BYTES) had no room "
                   "within QUEEN_BODY_WAIT_MS; retry after Retry-After", ["timers_unavailable"], RETRY_AFTER)
BODY_TIMEOUT = _error("the body did not arrive within QUEEN_BODY_TIMEOUT_MS (120 s by default); the "
                      "connection is closed", ["request_timeout"])
JSON_LIMITS = _error("not JSON, or past a JSON limit (nesting 128, QUEEN_JSON_MAX_VALUES values, an "
                     "array's element cap); refused as soon as the parser reaches it", ["timers_bad_request"])
INTERNAL_ERROR = _error("a bug: the broker log has the traceback; nothing is promised written or not",
                        ["internal_error"])


def _add_common_responses(paths: dict) -> None:
    """Every operation may answer 500 internal_error; every one with a body 413 body_too_large,
    400 for its JSON and 503 timers_unavailable when the body budget is full."""
    for methods in paths.values():
        for operation in methods.values():
            responses = operation.setdefault("responses", {})
            if "requestBody" in operation:
                responses.setdefault("413", copy.deepcopy(BODY_TOO_LARGE))
                responses.setdefault("400", copy.deepcopy(JSON_LIMITS))
                responses.setdefault("503", copy.deepcopy(BODY_BUSY))
                responses.setdefault("408", copy.deepcopy(BODY_TIMEOUT))
            responses.setdefault("500", copy.deepcopy(INTERNAL_ERROR))


def _merge_paths(target: dict, extra: dict) -> None:
    for path, methods in (extra or {}).items():
        target.setdefault(path, {}).update(copy.deepcopy(methods))


def build_document() -> dict:
    """The whole document: the timer routes here, plus what routes_log and
    routes_ops declare in OPENAPI_PATHS / OPENAPI_SCHEMAS."""
    from . import routes_dashboard, routes_log, routes_ops  # at call time: those modules import freely

    paths = copy.deepcopy(TIMER_PATHS)
    schemas = copy.deepcopy(SCHEMAS)
    for module in (routes_log, routes_ops, routes_dashboard):
        _merge_paths(paths, getattr(module, "OPENAPI_PATHS", {}))
        schemas.update(copy.deepcopy(getattr(module, "OPENAPI_SCHEMAS", {})))
    _add_common_responses(paths)
    return {
        "openapi": "3.1.0",
        "info": {"title": "queen-timers", "version": __version__,
                 "description": "A PostgreSQL-centric timer engine for a Queen MQ-style broker. "
                                "Every error body is {\"error\", \"detail\"}: an unknown path is "
                                "404 not_found, a method a path does not take 405 "
                                "method_not_allowed (with Allow)."},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer", "bearerFormat": "JWT",
                                           "description": "only when QUEEN_AUTH=jwt"}},
        },
        "security": [{"bearer": []}],
    }


@functools.cache
def _document_bytes() -> bytes:
    return JSONResponse(build_document()).body


async def openapi_endpoint(request: Request) -> Response:
    # public: built and encoded once (4.2 ms of CPU a call when built each time)
    return Response(_document_bytes(), media_type="application/json")
