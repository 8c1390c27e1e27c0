"""Path parameters: `{name:anypath}`, and RawRoute, a route matched on the raw path.

`{name:anypath}` is Starlette's `path` convertor, newlines included. `path` is the
regex `.*`, and `.` does not match a newline, so a catch-all segment holding one
(`/api/v1/timers/q/a%0Ab`) matched no route and answered Starlette's plain-text 404
instead of reaching the handler. A timerKey or a transactionId is any text; the
handler decides what it may hold.

RawRoute: Starlette matches a route against the *decoded* path, so a name holding
a percent-encoded slash (`/api/v1/timers/%2Fa/k`, `/api/v1/pop/queue/team%2Fa`) is
split at that slash before any route sees it: `{queue}` (`[^/]+`) then meets an
empty segment or one too many, and the request answered 404 (or a redirect) though
the name was accepted when it was written. A RawRoute matches its pattern against
the raw path, still percent-encoded, so a raw `/` separates segments and `%2F` is a
character of the segment it is in; each parameter is then percent-decoded exactly
once (UTF-8). A parameter whose bytes are not UTF-8 is None in `path_params`;
path_param() refuses it with a 400 (docs/http-timers.md, docs/log-surface.md).
"""

from __future__ import annotations

from urllib.parse import quote, unquote, unquote_to_bytes

from starlette.convertors import Convertor, StringConvertor, register_url_convertor
from starlette.routing import Match, Route, get_route_path

from .errors import bad_request


class AnyPathConvertor(Convertor[str]):
    regex = r"[\s\S]*"

    def convert(self, value: str) -> str:
        return str(value)

    def to_string(self, value: str) -> str:
        return str(value)


register_url_convertor("anypath", AnyPathConvertor())

# scope key: (decoded route path, the raw one it was read from), computed once a request
RAW_PATH_KEY = "queen.raw_route_path"


def raw_route_path(scope: dict) -> str | None:
    """The route path as the client sent it, still percent-encoded (ASCII), or None
    when there is no telling where its segments end.

    The scope's raw_path (query string dropped: httpx's ASGI transport keeps it) when
    it is the decoded path's own. Otherwise the decoded path percent-encoded again with
    `/` kept: the scope has no raw path (or a root path), or its path was rewritten (the
    router's redirect_slashes probe adds or strips a trailing `/` in `path` and leaves
    `raw_path`). That reading splits the path where the client did only if the client
    sent no encoded slash; if it did, None: a RawRoute matches nothing, so the probe
    never redirects to a URL whose `%2F` was decoded into a separator."""
    path = get_route_path(scope)
    cached = scope.get(RAW_PATH_KEY)
    if cached is not None and cached[0] == path:
        return cached[1]
    raw = scope.get("raw_path")
    if raw:
        candidate = raw.partition(b"?")[0].decode("latin-1")
        if candidate.isascii() and (candidate == path or ("%" in candidate and unquote(candidate) == path)):
            text = candidate
        elif "%2f" in candidate.lower():
            text = None
        else:
            text = quote(path, safe="/", errors="surrogatepass")
    else:
        text = quote(path, safe="/", errors="surrogatepass")
    scope[RAW_PATH_KEY] = (path, text)
    return text


def decode_segment(value: str) -> str | None:
    """A raw (ASCII) path parameter percent-decoded once; None when its bytes are not UTF-8."""
    if "%" not in value:
        return value
    try:
        return unquote_to_bytes(value).decode("utf-8")
    except UnicodeDecodeError:
        return None


class RawRoute(Route):
    """A Route whose pattern is matched against the raw path (see the module's doc).
    Its parameters may only be `{x}` (one raw segment) or `{x:anypath}` (the rest)."""

    def __init__(self, path: str, endpoint, **kw) -> None:
        super().__init__(path, endpoint, **kw)
        for name, convertor in self.param_convertors.items():
            if not isinstance(convertor, (StringConvertor, AnyPathConvertor)):
                raise ValueError(f"RawRoute {path}: {{{name}}} must be a string or anypath parameter")

    def raw_params(self, scope: dict) -> dict | None:
        """The decoded parameters when the raw path matches, else None (any method)."""
        raw = raw_route_path(scope)
        return None if raw is None else self.raw_match(raw)

    def raw_match(self, raw: str) -> dict | None:
        """raw_params, for the raw route path itself."""
        m = self.path_regex.match(raw)
        if m is None:
            return None
        return {name: decode_segment(value) for name, value in m.groupdict().items()}

    def matches(self, scope: dict) -> tuple[Match, dict]:
        if scope["type"] != "http":
            return Match.NONE, {}
        params = self.raw_params(scope)
        if params is None:
            return Match.NONE, {}
        path_params = dict(scope.get("path_params", {}))
        path_params.update(params)
        child_scope = {"endpoint": self.endpoint, "path_params": path_params}
        if self.methods and scope["method"] not in self.methods:
            return Match.PARTIAL, child_scope
        return Match.FULL, child_scope


def path_param(scope: dict, name: str, optional: bool = False) -> str | None:
    """A RawRoute's parameter, or 400 timers_bad_request when it is not percent-encoded UTF-8;
    optional: None when the route has no such parameter."""
    params = scope["path_params"]
    if optional and name not in params:
        return None
    value = params[name]
    if value is None:
        raise bad_request("the path is not valid percent-encoded UTF-8")
    return value
