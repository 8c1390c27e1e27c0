"""Operator routes: the fire's switches, its status, and the Prometheus scrape.

    GET  /api/v1/system/timers             admin   {schedulingPaused, firePaused, pending}
    POST /api/v1/system/timers/scheduling  admin   {"paused": bool} -> status
    POST /api/v1/system/timers/fire        admin   {"paused": bool} -> status
    GET  /metrics/prometheus               public  text/plain; version=0.0.4

The switches are queen.pause_scheduling / queen.pause_fire: one row in
queen.cell_settings, so a pause applies to every broker of the cell, and a
DBA can flip it from psql with no broker running.
"""

from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .auth import ADMIN
from .errors import ApiError, bad_request, from_exception
from .metrics import CONTENT_TYPE

STATUS_SQL = "SELECT * FROM queen.get_timer_status()"


def _status_body(row: dict) -> dict:
    return {"schedulingPaused": row["scheduling_paused"], "firePaused": row["fire_paused"],
            "pending": int(row["pending"])}


async def _paused_flag(request: Request) -> bool:
    raw = await request.body()
    try:
        body = json.loads(raw or b"null")
    except ValueError:
        raise bad_request("body must be JSON: {\"paused\": true|false}") from None
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
    async with request.app.state.pool.connection() as conn:
        cur = await conn.execute(STATUS_SQL)
        return _status_body(await cur.fetchone())


async def timers_status(request: Request) -> JSONResponse:
    request.app.state.auth.require(request, ADMIN)
    return JSONResponse(await _status(request))


async def _switch(request: Request, function: str) -> JSONResponse:
    request.app.state.auth.require(request, ADMIN)
    paused = await _paused_flag(request)
    async with request.app.state.pool.connection() as conn:
        await conn.execute(f"SELECT queen.{function}(%s)", (paused,))
        cur = await conn.execute(STATUS_SQL)
        return JSONResponse(_status_body(await cur.fetchone()))


async def pause_scheduling(request: Request) -> JSONResponse:
    return await _switch(request, "pause_scheduling")


async def pause_fire(request: Request) -> JSONResponse:
    return await _switch(request, "pause_fire")


async def prometheus(request: Request) -> Response:
    metrics = request.app.state.sweeper.metrics
    try:
        async with request.app.state.pool.connection() as conn:
            cur = await conn.execute(STATUS_SQL)
            metrics.set_status(await cur.fetchone())
    except Exception as exc:
        # the counters are this process's and are still worth a scrape; the
        # gauges read from PostgreSQL keep their last value
        if from_exception(exc) is None:
            raise
    return Response(metrics.render(), media_type=CONTENT_TYPE)


routes = [
    Route("/api/v1/system/timers", timers_status, methods=["GET"]),
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


def _switch_op(summary: str, description: str) -> dict:
    return {"post": {"summary": summary, "description": description, "tags": ["system"],
                     "x-access-level": "admin", "requestBody": _PAUSED_BODY,
                     "responses": {**_STATUS_OK, **_ERRORS}}}


# Merged by openapi.py into the document served by the broker.
OPENAPI_PATHS: dict = {
    "/api/v1/system/timers": {
        "get": {"summary": "Status of the fire", "tags": ["system"], "x-access-level": "admin",
                "description": "The operator switches (queen.cell_settings) and the cell's pending timers.",
                "responses": {**_STATUS_OK, **{k: v for k, v in _ERRORS.items() if k != "400"}}},
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
