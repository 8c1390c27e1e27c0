"""Domain errors and the one place where they become HTTP.

SQL functions raise SQLSTATEs of class QT (see sql/schema/00_base.sql);
capacity problems (pool exhausted, statement timeout, database gone) are
503 timers_unavailable. Routes raise ApiError; app.py renders it.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl

import psycopg
from psycopg import errors as pgerrors
from psycopg_pool import PoolTimeout
from starlette.datastructures import QueryParams

# SQLSTATE -> (HTTP status, error slug)
SQLSTATE_HTTP: dict[str, tuple[int, str]] = {
    "QTBAD": (400, "timers_bad_request"),
    "QTOFF": (503, "timers_disabled"),
    "QTGAT": (403, "feature_gated"),
    "QTBLK": (403, "produce_blocked"),
    "QTRAT": (429, "rate_limited"),
    "QTQUO": (403, "timers_quota_exceeded"),
    "QTHOR": (403, "timer_horizon_exceeded"),
    "QTBIG": (413, "payload_too_large"),
    "QTRPL": (409, "dlq_replay_refused"),
    "QTNFD": (404, "not_found"),
}

# Failures that say "not now", never "never": they cost no fire attempt
# and answer 503 on the HTTP side. 25006 (read_only_sql_transaction): the
# connection reached a standby or a primary fenced read-only, as during a
# switchover; the connection is discarded and the next one finds the primary.
READ_ONLY_SQLSTATE = "25006"
# 55P03 lock_not_available: a fire that waited past its lock_timeout (migration 031) on a
# transaction that will end; a retry later succeeds, so it spends no attempt
TRANSIENT_SQLSTATES = {"40001", "40P01", "55P03", READ_ONLY_SQLSTATE}
TRANSIENT_CLASSES = {"08", "53", "57"}

_RETRY = re.compile(r"retry_after_seconds=(\d+)")


# A request still waiting on the database when a stop cancels it (uvicorn cancels what is
# left STOP_GRACE_S past QUEEN_SHUTDOWN_TIMEOUT_MS: a hung server). Its outcome is unknown,
# as for a 503 in a failover; it answered uvicorn's plain 500, or nothing on the direct lane
# (Dec 7 audit). The body and headers, for every path that answers it.
STOPPED_BODY = (b'{"error":"timers_unavailable","detail":"the broker stopped before the database answered; '
                b'the outcome is unknown: retry (every write is idempotent by its key) on another broker"}')
STOPPED_HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(STOPPED_BODY)).encode()),
                   (b"retry-after", b"1"), (b"connection", b"close")]


class ApiError(Exception):
    """An HTTP error in the documented shape: {"error": slug, "detail": text}."""

    def __init__(self, status: int, error: str, detail: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(f"{status} {error}: {detail or ''}")
        self.status = status
        self.error = error
        self.detail = detail
        self.headers = dict(headers or {})

    def body(self) -> dict:
        body = {"error": self.error}
        if self.detail:
            body["detail"] = self.detail
        return body


def bad_request(detail: str) -> ApiError:
    return ApiError(400, "timers_bad_request", detail)


QUERY_KEY = "queen.query_params"  # scope key: strict_query's parse, once a request


def strict_query(scope: dict) -> QueryParams:
    """The request's query parameters, as Starlette parses them (latin-1 text, then
    parse_qsl keeping blank values) but percent-decoded as strict UTF-8: 400 when a byte
    sequence is not UTF-8. Starlette puts U+FFFD in its place, which read `?after=%FF` as
    a cursor of its own and echoed `?txn=%FF` as another txn (a path is refused the same
    way, convertors.decode_segment)."""
    params = scope.get(QUERY_KEY)
    if params is None:
        try:
            pairs = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True,
                              errors="strict")
        except UnicodeDecodeError:
            raise bad_request("the query string is not valid percent-encoded UTF-8") from None
        params = scope[QUERY_KEY] = QueryParams(pairs)
    return params


def query_param(scope: dict, name: str) -> str | None:
    """The one value of the request's query parameter `name` (strict_query), or None.
    Given more than once it is a 400: servers disagree on which copy wins (Starlette
    keeps the last), so the broker does not guess what the client meant."""
    values = strict_query(scope).getlist(name)
    if len(values) > 1:
        raise bad_request(f"query parameter {name} is given {len(values)} times; give it once")
    return values[0] if values else None


def query_int(scope: dict, name: str) -> int | None:
    """Query parameter `name` as an integer, or None when absent or empty; 400 when it is
    not an integer. Each route bounds it: clamped, or refused past its range."""
    raw = query_param(scope, name)
    if raw is None or raw == "":
        return None
    # ASCII digits only: int() also takes "0_2", " 2 ", "+2" and other scripts' digits
    if _INTEGER.fullmatch(raw) is None:
        raise bad_request(f"query parameter {name} must be an integer")
    try:
        return int(raw)
    except ValueError:  # more than 4,300 digits
        raise bad_request(f"query parameter {name} must be an integer") from None


_INTEGER = re.compile(r"-?[0-9]+")


def text_problem(value: str) -> str | None:
    """Why PostgreSQL's text cannot hold this string (NUL, or a lone surrogate
    that is not UTF-8), or None when it can."""
    if "\x00" in value:
        return "may not contain a NUL character"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid Unicode (a lone surrogate)"
    return None


def check_text(value: str, what: str) -> str:
    """value, or 400 when it cannot reach PostgreSQL as text."""
    problem = text_problem(value)
    if problem:
        raise bad_request(f"{what} {problem}")
    return value


def check_json_unicode(document: object) -> None:
    """400 when any string of a parsed JSON document (a key or a value) holds a lone
    surrogate (`"\\ud800"` parses, but is not Unicode and cannot be stored).
    Iterative: the depth of the document is bounded elsewhere, not here."""
    stack = [document]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise bad_request("the body holds a string that is not valid Unicode "
                                  "(a lone surrogate escape)") from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def is_transient_sqlstate(sqlstate: str | None) -> bool:
    if not sqlstate:
        return True  # no SQLSTATE: the connection broke before the server answered
    return sqlstate in TRANSIENT_SQLSTATES or sqlstate[:2] in TRANSIENT_CLASSES


class ReadOnlyServer(psycopg.OperationalError):
    """The connection's server accepts no writes (hot standby, or fenced read-only)."""


class DeadlinePassed(psycopg.OperationalError):
    """A statement had no answer by its statement timeout plus QUEEN_DEADLINE_GRACE_MS: the
    broker closed its connection (db.BrokerPool's watch: a hung server, or a commit waiting
    for a synchronous standby, where PostgreSQL's own timeout does not apply)."""


def is_read_only(exc: BaseException) -> bool:
    """The server refused a write because it is read-only (standby or fenced primary)."""
    return isinstance(exc, ReadOnlyServer) or (
        isinstance(exc, psycopg.Error) and exc.sqlstate == READ_ONLY_SQLSTATE)


def classify_failure(exc: BaseException) -> str:
    """'transient' (backs off, costs no attempt) or 'permanent' for a fire failure."""
    if isinstance(exc, psycopg.Error):
        sqlstate = exc.sqlstate
        if sqlstate is None:
            return "transient" if isinstance(exc, psycopg.OperationalError) else "permanent"
        return "transient" if is_transient_sqlstate(sqlstate) else "permanent"
    if isinstance(exc, (PoolTimeout, ConnectionError, TimeoutError, OSError)):
        return "transient"
    return "permanent"


def from_exception(exc: BaseException) -> ApiError | None:
    """The ApiError for a database-side exception, or None if it is a bug."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, PoolTimeout):
        return ApiError(503, "timers_unavailable", "no database connection available",
                        {"Retry-After": "1"})
    if isinstance(exc, psycopg.Error):
        sqlstate = exc.sqlstate
        diag = exc.diag
        if sqlstate in SQLSTATE_HTTP:
            status, slug = SQLSTATE_HTTP[sqlstate]
            headers = {}
            match = _RETRY.search(diag.message_hint or "")
            if match:
                headers["Retry-After"] = match.group(1)
            elif status in (429, 503):
                headers["Retry-After"] = "1"
            return ApiError(status, slug, diag.message_detail, headers)
        if sqlstate == READ_ONLY_SQLSTATE or isinstance(exc, ReadOnlyServer):
            return ApiError(503, "timers_unavailable",
                            "the database is read-only right now (a standby, or a primary being switched over)",
                            {"Retry-After": "1"})
        if isinstance(exc, (pgerrors.QueryCanceled, DeadlinePassed)):
            return ApiError(503, "timers_unavailable", "the database did not answer in time",
                            {"Retry-After": "1"})
        if sqlstate is None or is_transient_sqlstate(sqlstate) or isinstance(exc, psycopg.OperationalError):
            return ApiError(503, "timers_unavailable", "the database cannot answer right now",
                            {"Retry-After": "1"})
    return None
