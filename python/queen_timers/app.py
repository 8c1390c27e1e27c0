"""The broker: one Starlette app (HTTP shell) plus the sweeper, sharing one process."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import psycopg
from psycopg_pool import PoolTimeout
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from . import __version__, routes_dashboard, routes_log, routes_ops, routes_timers
from .auth import Authenticator
from .bodies import BodyBudget, BodyBudgetRelease, release_body, tune_malloc
from .config import Settings
from .convertors import RawRoute, raw_route_path
from .db import make_pool
from .errors import STOPPED_BODY, STOPPED_HEADERS, ApiError, from_exception
from .retention import Retention
from .server import json_headers
from .sweeper import Sweeper
from .turns import SharedCall, Turns

log = logging.getLogger("queen_timers")


async def api_error(request: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def database_error(request: Request, exc: Exception) -> JSONResponse:
    """Database failures a route did not map itself (capacity -> 503, QT* -> their status)."""
    mapped = from_exception(exc)
    if mapped is not None:
        return await api_error(request, mapped)
    log.exception("unexpected database error on %s %s", request.method, request.url.path)
    return internal_error_response()


def internal_error_response() -> JSONResponse:
    return JSONResponse({"error": "internal_error",
                         "detail": "the broker met an unexpected error; its log has the details"},
                        status_code=500)


async def answer_stopped(scope, receive, send) -> None:
    """The answer of a request a stop cancelled in its database call (errors.STOPPED_BODY),
    sent if it can be: the caller re-raises the cancel either way."""
    response = Response(STOPPED_BODY, status_code=503)
    response.raw_headers = list(STOPPED_HEADERS)
    with contextlib.suppress(Exception):
        await response(scope, receive, send)


HTTP_SLUGS = {404: "not_found", 405: "method_not_allowed"}


async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own refusals (no such route, wrong method) in the documented shape."""
    slug = HTTP_SLUGS.get(exc.status_code, "http_error")
    # the path as sent, still percent-encoded: `%2F` is part of a name (convertors.RawRoute),
    # and the decoded path would show `/api/v1/timers/%2Fa` as `/api/v1/timers//a`
    path = request.scope.get("root_path", "") + (raw_route_path(request.scope) or request.url.path)
    if exc.status_code == 404:
        detail = f"no route {request.method} {path}"
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        detail = f"{request.method} is not allowed on {path}; allowed: {allowed}"
    else:
        detail = str(exc.detail)
    return JSONResponse({"error": slug, "detail": detail}, status_code=exc.status_code,
                        headers=exc.headers)


async def client_gone(request: Request, exc: ClientDisconnect) -> Response:
    """The client closed its connection before its body had all come: nobody is left to
    answer (uvicorn drops what is sent), and nothing is wrong with the broker. It used to
    log an "unexpected error" traceback, 1 KB a time: a client could fill the log at will."""
    return Response(status_code=400)


async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    """Last resort (ServerErrorMiddleware): an error in a middleware itself."""
    return internal_error_response()


class UnexpectedErrors:
    """Any exception no handler knows is a bug: log its traceback and answer
    a JSON 500 internal_error. Caught here, inside ServerErrorMiddleware,
    so that the error is not re-raised into uvicorn, which would drop the
    client's keep-alive connection."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except asyncio.CancelledError:
            # uvicorn cancels what is still running STOP_GRACE_S past the stop's timeout: a
            # request whose database never answered (a hung server; Dec 7 audit). It answered
            # uvicorn's plain 500; the outcome is unknown, as for a 503 in a failover.
            if not started:
                await answer_stopped(scope, receive, send)
            raise
        except Exception:
            if started:  # too late for a response of our own
                raise
            log.exception("unexpected error on %s %s", scope.get("method"), scope.get("path"))
            await internal_error_response()(scope, receive, send)


def _decoded_matcher(route: Route):
    """scope -> the route's converted parameters when its pattern matches the decoded path, else None."""
    regex, convertors = route.path_regex, route.param_convertors

    def match(scope):
        if (m := regex.match(scope["path"])) is None:
            return None
        return {k: convertors[k].convert(v) for k, v in m.groupdict().items()}
    return match


class HotRoutes:
    """The two routes a client calls once per timer, POST /api/v1/timers and
    DELETE /api/v1/timers/:queue/*timerKey, served without Starlette's
    middleware stack and router: five layers of wrappers around every request
    and every message it sends (a sixth of a DELETE's broker CPU in py-spy).
    The same endpoints, the same exception handlers (app.exception_handlers),
    the same JSON 500 for anything unexpected (UnexpectedErrors) and the same
    release of the body budget (BodyBudgetRelease): the answers are those of
    the stack, which still serves every other route and method. A request
    takes this lane only where the router's first full match is one of these
    routes (tests/py/test_hot_routes.py checks the routing table)."""

    on_direct = staticmethod(lambda: None)  # counts the requests server.py's direct lane serves

    def __init__(self, routes: list[tuple[Route, str]], answers: dict | None = None, starts: dict | None = None,
                 bodies: dict | None = None):
        # a route's own matching: a RawRoute (the timer key route) on the raw path, where
        # `%2F` is inside a segment; any other Route on the decoded path, as Starlette does
        self.lanes = [(route.raw_params if isinstance(route, RawRoute) else _decoded_matcher(route),
                       method, route.endpoint) for route, method in routes]
        # method -> [(raw_match, endpoint)] where every lane of the method is a RawRoute: server.py's
        # direct lane matches the raw path it has just parsed, without the scope (match_raw)
        self.raw_lanes = {method: [(route.raw_match, route.endpoint) for route, m in routes if m == method]
                          for method in {m for _, m in routes}
                          if all(isinstance(route, RawRoute) for route, m in routes if m == method)}
        # endpoint -> answer(app, scope, started=None): its 200 answer's JSON without a Request
        # or a Response, for server.py's direct lane (respond_direct)
        self.answers = answers or {}
        # endpoint -> start(app, scope): the answer's first half, synchronous (its statement on
        # the wire), which the direct lane runs before it builds the request's task
        self.starts = starts or {}
        # endpoint -> body(started, row): the 200 answer's JSON from what start returned (its
        # `call`, a db.Call) and the call's row, synchronous: the direct lane writes it from
        # the database socket's reader callback when the call ends at once (server.DirectWait)
        self.bodies = bodies or {}

    def match(self, scope):
        method = scope["method"]
        for matcher, lane_method, endpoint in self.lanes:
            if method == lane_method and (params := matcher(scope)) is not None:
                return endpoint, params
        return None

    def match_raw(self, method: str, raw_path: str):
        """match, for a request without a root path whose route path the client sent as
        `raw_path` (ASCII, still percent-encoded): the same hit, or None when no lane
        matches (or the method has a lane on the decoded path: match serves it)."""
        for raw_match, endpoint in self.raw_lanes.get(method, ()):
            if (params := raw_match(raw_path)) is not None:
                return endpoint, params
        return None

    async def respond(self, app: Starlette, hit, scope, receive, send=None) -> Response:
        """The endpoint's response, or its exception's handler's, or a JSON 500."""
        endpoint, scope["path_params"] = hit
        scope["app"] = app
        request = Request(scope, receive, send)
        try:
            return await endpoint(request)
        except Exception as exc:
            return await self._handle(app, request, exc)

    async def respond_direct(self, app: Starlette, answer, hit, scope, receive,
                             started=None) -> tuple[int, list, bytes]:
        """respond's status, headers and body for an endpoint with an answer function: the
        same bytes (Response's headers for a JSON body), without building either object
        on success (a tenth of the direct lane's CPU on a DELETE). `started`: what the
        endpoint's start returned, or the exception it raised (answered as raised by answer)."""
        scope["app"] = app
        scope["path_params"] = hit[1]
        try:
            if isinstance(started, Exception):
                raise started
            body = await answer(app, scope, started)
        except Exception as exc:
            response = await self._handle(app, Request(scope, receive), exc)
            return response.status_code, response.raw_headers, response.body
        return 200, json_headers(body), body

    async def _handle(self, app: Starlette, request: Request, exc: Exception) -> Response:
        """exc's handler's response (app.exception_handlers), or a JSON 500."""
        try:
            handler = next((app.exception_handlers[c] for c in type(exc).__mro__
                            if c is not Exception and c in app.exception_handlers), None)
            if handler is None:
                raise exc
            return await handler(request, exc)
        except Exception:
            log.exception("unexpected error on %s %s", request.scope.get("method"), request.scope.get("path"))
            return internal_error_response()

    async def serve(self, app: Starlette, hit, scope, receive, send) -> None:
        try:
            try:
                response = await self.respond(app, hit, scope, receive, send)
            except asyncio.CancelledError:  # a stop, its database call unanswered (UnexpectedErrors)
                await answer_stopped(scope, receive, send)
                raise
            await response(scope, receive, send)
        finally:
            release_body(scope)


class BrokerApp(Starlette):
    """Starlette, with HotRoutes in front of its stack, and every request in its
    tenant's turn (turns.py) before either."""

    hot: HotRoutes | None = None
    turns: Turns | None = None  # QUEEN_AUTH=jwt only: with auth off every request is one tenant's
    auth: Authenticator | None = None
    on_connection_reclaimed = staticmethod(lambda: None)  # server.py closed an idle connection to admit one
    on_send_timed_out = staticmethod(lambda: None)  # server.py closed a connection whose client took no answer
    draining = False  # the broker is stopping: a long-poll pop answers what it has at once

    def begin_drain(self) -> None:
        self.draining = True

    async def take_turn(self, scope) -> None:
        if (wait := self.turn_now(scope)) is not None:
            await wait

    def turn_now(self, scope) -> asyncio.Future | None:
        """take_turn, synchronously: None when the request starts now, else the future to
        await before it does (the turn is taken either way)."""
        return None if self.turns is None else self.turns.start(self.auth.turn_key(scope))

    async def __call__(self, scope, receive, send) -> None:
        if self.turns is not None and scope["type"] == "http":
            await self.take_turn(scope)
        if (self.hot is not None and scope["type"] == "http" and not scope.get("root_path")
                and (hit := self.hot.match(scope)) is not None):
            await self.hot.serve(self, hit, scope, receive, send)
            return
        await super().__call__(scope, receive, send)


async def health(request: Request) -> JSONResponse:
    state = request.app.state
    body = {"status": "healthy", "database": "connected", "server": "queen-timers",
            "worker_id": state.settings.broker_id, "version": __version__,
            "queen": {"worker_id": state.settings.broker_id, "status": "active"}}
    if not await state.health_check():
        body.update(status="unhealthy", database="disconnected")
        return JSONResponse(body, status_code=503)
    return JSONResponse(body)


async def database_reachable(pool) -> bool:
    try:
        async with pool.connection() as conn:
            await conn.execute("SELECT 1")
    except Exception:  # any failure to reach the database is "unhealthy", by definition
        return False
    return True


def create_app(settings: Settings | None = None) -> Starlette:
    settings = settings or Settings.from_env()
    tune_malloc()
    pool = make_pool(settings)
    # QUEEN_READ_DATABASE_URL: peek and list read a hot standby; nothing else does
    read_pool = make_pool(settings, read=True) if settings.read_database_url else None
    sweeper = Sweeper(settings)
    retention = Retention(settings, sweeper.metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        await pool.open(wait=False)
        if read_pool is not None:
            await read_pool.open(wait=False)
        await sweeper.start()
        await retention.start()
        try:
            yield
        finally:
            await retention.stop()
            await sweeper.stop()
            if read_pool is not None:
                await read_pool.close()
            await pool.close()

    app = BrokerApp(
        routes=[Route("/health", health, methods=["GET"]),
                *routes_timers.routes, *routes_log.routes, *routes_ops.routes,
                *routes_dashboard.routes],
        # Handlers keyed by class run in ExceptionMiddleware and keep the connection
        # alive; anything else is a bug and reaches ServerErrorMiddleware, whose
        # handler (Exception) answers a JSON 500 internal_error.
        exception_handlers={ApiError: api_error, psycopg.Error: database_error,
                            PoolTimeout: database_error, HTTPException: http_error,
                            ClientDisconnect: client_gone, Exception: unexpected_error},
        # outermost: a request's share of the body budget is given back however it ends
        middleware=[Middleware(BodyBudgetRelease), Middleware(UnexpectedErrors)],
        lifespan=lifespan,
    )
    # Starlette answers a path that matches only with or without its trailing slash with a
    # 307 to the other, empty-bodied, before any auth, its Location built from the client's
    # Host header: an unknown path is a JSON 404 here like any other
    app.router.redirect_slashes = False
    app.hot = HotRoutes([(routes_timers.SCHEDULE_ROUTE, "POST"), (routes_timers.KEY_ROUTE, "DELETE")],
                        answers={routes_timers.KEY_ROUTE.endpoint: routes_timers.cancel_answer},
                        starts={routes_timers.KEY_ROUTE.endpoint: routes_timers.cancel_start},
                        bodies={routes_timers.KEY_ROUTE.endpoint: routes_timers.cancel_body})
    app.hot.on_direct = sweeper.metrics.http_direct.inc
    app.on_connection_reclaimed = sweeper.metrics.http_reclaimed.inc
    app.on_send_timed_out = sweeper.metrics.http_send_timeouts.inc
    for p in (pool, read_pool):
        if p is not None:
            p.watch.on_cut = sweeper.metrics.database_deadlines.inc
    app.state.settings = settings
    budget = app.state.body_budget = BodyBudget(settings.body_budget_bytes, settings.body_wait_ms,
                                                on_refuse=sweeper.metrics.body_budget_refusals.inc)
    sweeper.metrics.body_budget_in_use.set_function(lambda: budget.used)
    sweeper.metrics.body_budget_waiting.set_function(lambda: budget.waiting)
    app.state.pool = pool
    app.state.health_check = SharedCall(lambda: database_reachable(pool))
    app.state.metrics_scrape = SharedCall(lambda: routes_ops.scrape(pool, sweeper.metrics))
    app.state.read_pool = read_pool
    app.state.auth = app.auth = Authenticator(settings)
    if app.auth.enabled:
        app.turns = Turns()
        sweeper.metrics.turns_waiting.set_function(lambda: app.turns.waiting)
    app.state.request_slots = app.state.auth.slots
    app.state.sweeper = sweeper
    app.state.retention = retention
    return app
