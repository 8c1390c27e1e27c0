"""The broker: one Starlette app (HTTP shell) plus the sweeper, sharing one process."""

from __future__ import annotations

import contextlib
import logging

import psycopg
from psycopg_pool import PoolTimeout
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from . import __version__, routes_log, routes_ops, routes_timers
from .auth import Authenticator
from .config import Settings
from .db import make_pool
from .errors import ApiError, from_exception
from .retention import Retention
from .sweeper import Sweeper

log = logging.getLogger("queen_timers")


async def api_error(request: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def database_error(request: Request, exc: Exception) -> JSONResponse:
    """Database failures a route did not map itself (capacity -> 503, QT* -> their status)."""
    mapped = from_exception(exc)
    if mapped is not None:
        return await api_error(request, mapped)
    log.exception("unexpected database error on %s %s", request.method, request.url.path)
    return JSONResponse({"error": "internal_error"}, status_code=500)


async def health(request: Request) -> JSONResponse:
    state = request.app.state
    body = {"status": "healthy", "database": "connected", "server": "queen-timers",
            "worker_id": state.settings.broker_id, "version": __version__,
            "queen": {"worker_id": state.settings.broker_id, "status": "active"}}
    try:
        async with state.pool.connection() as conn:
            await conn.execute("SELECT 1")
    except Exception:  # any failure to reach the database is "unhealthy", by definition
        body.update(status="unhealthy", database="disconnected")
        return JSONResponse(body, status_code=503)
    return JSONResponse(body)


def create_app(settings: Settings | None = None) -> Starlette:
    settings = settings or Settings.from_env()
    pool = make_pool(settings)
    sweeper = Sweeper(settings)
    retention = Retention(settings, sweeper.metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        await pool.open(wait=False)
        await sweeper.start()
        await retention.start()
        try:
            yield
        finally:
            await retention.stop()
            await sweeper.stop()
            await pool.close()

    app = Starlette(
        routes=[Route("/health", health, methods=["GET"]),
                *routes_timers.routes, *routes_log.routes, *routes_ops.routes],
        # Handlers keyed by class run in ExceptionMiddleware and keep the connection
        # alive; anything else is a bug and reaches ServerErrorMiddleware as a 500.
        exception_handlers={ApiError: api_error, psycopg.Error: database_error,
                            PoolTimeout: database_error},
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.pool = pool
    app.state.auth = Authenticator(settings)
    app.state.sweeper = sweeper
    app.state.retention = retention
    return app
