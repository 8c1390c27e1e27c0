"""GET /dashboard: the operator dashboard, static files shipped inside the package.

    GET /dashboard           public  the page (text/html)
    GET /dashboard/{asset}   public  dashboard.js, dashboard.css

The files live in queen_timers/dashboard/ (package data, so a wheel carries
them) and hold no data: the page reads the JSON routes with the caller's
token (GET /api/v1/system/timers/stats, /api/v1/dlq, /metrics/prometheus,
and the admin switches), so every access check stays where it is.
"""

from __future__ import annotations

from importlib import resources

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .errors import ApiError

ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
# The page handles a bearer token: nothing but its own files may run in it.
HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "Referrer-Policy": "no-referrer",
}


def _file(name: str) -> Response:
    body = resources.files(__package__).joinpath("dashboard", name).read_bytes()
    return Response(body, media_type=ASSETS[name], headers=HEADERS)


async def page(request: Request) -> Response:
    return _file("index.html")


async def asset(request: Request) -> Response:
    name = request.path_params["asset"]
    if name not in ASSETS:
        raise ApiError(404, "not_found", f"no dashboard file {name!r}")
    return _file(name)


routes = [
    Route("/dashboard", page, methods=["GET"]),
    Route("/dashboard/", page, methods=["GET"]),  # no redirect (app.py): the page at both, its assets by absolute path
    Route("/dashboard/{asset}", asset, methods=["GET"]),
]

_FILE = {"content": {"text/html": {"schema": {"type": "string"}}}}

# Merged by openapi.py into the document served by the broker.
OPENAPI_PATHS: dict = {
    "/dashboard": {"get": {
        "summary": "The operator dashboard (HTML)", "tags": ["system"], "security": [],
        "x-access-level": "public",
        "description": "Static; it holds no data. Its script reads GET /api/v1/system/timers/stats, "
                       "GET /api/v1/dlq, GET /metrics/prometheus and the admin switches with the "
                       "token typed into it (kept in sessionStorage, sent as Authorization: Bearer).",
        "responses": {"200": {"description": "the page", **_FILE}}}},
    "/dashboard/": {"get": {
        "summary": "The operator dashboard (HTML), as at /dashboard", "tags": ["system"], "security": [],
        "x-access-level": "public",
        "responses": {"200": {"description": "the page", **_FILE}}}},
    "/dashboard/{asset}": {"get": {
        "summary": "The dashboard's script and stylesheet", "tags": ["system"], "security": [],
        "x-access-level": "public",
        "parameters": [{"name": "asset", "in": "path", "required": True,
                        "schema": {"type": "string", "enum": sorted(ASSETS)}}],
        "responses": {"200": {"description": "the file",
                              "content": {m.split(";")[0]: {"schema": {"type": "string"}}
                                          for m in sorted(set(ASSETS.values()))}},
                      "404": {"description": "no such file (not_found)",
                              "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}}}},
}
