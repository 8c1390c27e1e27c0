"""app.HotRoutes: POST /api/v1/timers and DELETE /api/v1/timers/:queue/*timerKey served
without Starlette's stack must route and answer exactly as the stack does.

The routing table is checked against Starlette's own matching (no database); the
answers, in process (httpx's ASGI transport, the app's own lifespan) against the
test database, with the lane on and off: same status, body and headers, for
verdicts, refusals and a bug."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import urllib.parse

import httpx
import pytest
from starlette.routing import Match

from queen_timers import routes_timers
from queen_timers.app import create_app
from queen_timers.config import Settings


def _scope(method: str, path: str, raw: str | None = None) -> dict:
    """A request's scope; `raw`: the target as sent (percent-encoded), `path` its decoding."""
    scope = {"type": "http", "method": method, "path": path, "root_path": "", "headers": [],
             "query_string": b""}
    if raw is not None:
        scope["raw_path"] = raw.encode("ascii")
    return scope


PATHS = [
    ("POST", "/api/v1/timers"), ("POST", "/api/v1/timers/"), ("POST", "/api/v1/timers/q"),
    ("GET", "/api/v1/timers"), ("PUT", "/api/v1/timers"),
    ("DELETE", "/api/v1/timers/q/k"), ("DELETE", "/api/v1/timers/q/a/b/c"), ("DELETE", "/api/v1/timers/q/"),
    ("DELETE", "/api/v1/timers/q"), ("DELETE", "/api/v1/timers/q/a%2Fb"), ("DELETE", "/api/v1/timers/q/a\nb"),
    ("GET", "/api/v1/timers/q/k"), ("PATCH", "/api/v1/timers/q/k"), ("DELETE", "/api/v1/timers"),
    ("DELETE", "/api/v1/queues/q"), ("POST", "/api/v1/push"), ("GET", "/health"),
]


# sent percent-encoded: the key route matches the raw path, where `%2F` is inside a segment
# (a queue `/a`, `/`, `a/b`); the lane must match it the same way, not on the decoded path
RAW_PATHS = [
    ("DELETE", "/api/v1/timers/%2Fa/k"), ("DELETE", "/api/v1/timers/%2F/%2F"), ("DELETE", "/api/v1/timers/a%2Fb/k"),
    ("DELETE", "/api/v1/timers/a%2Fb"), ("DELETE", "/api/v1/timers/%2Fa"), ("DELETE", "/api/v1/timers//a/k"),
    ("DELETE", "/api/v1/timers/q/k%2F"), ("DELETE", "/api/v1/timers/%FF/k"), ("GET", "/api/v1/timers/%2Fa/k"),
    ("DELETE", "/api/v1/timers/q%2F"), ("POST", "/api/v1/timers%2F"), ("DELETE", "/api/v1/timers%2Fq%2Fk"),
]


@pytest.mark.parametrize("method,path,raw", [(m, p, None) for m, p in PATHS]
                         + [(m, urllib.parse.unquote(r), r) for m, r in RAW_PATHS])
def test_a_request_takes_the_lane_only_where_the_router_would_send_it_to_that_route(method, path, raw):
    app = create_app(Settings.from_env({"QUEEN_DATABASE_URL": "postgresql://unused/db"}))
    scope = _scope(method, path, raw)
    first_full = next((r for r in app.router.routes if r.matches(dict(scope))[0] == Match.FULL), None)
    hit = app.hot.match(dict(scope))
    lanes = [(routes_timers.SCHEDULE_ROUTE, "POST"), (routes_timers.KEY_ROUTE, "DELETE")]
    if any(first_full is route and method == m for route, m in lanes):
        assert hit is not None and hit[0] is first_full.endpoint
        assert hit[1] == first_full.matches(dict(scope))[1]["path_params"]
    else:
        assert hit is None


@pytest.mark.parametrize("raw,queue,key", [("/api/v1/timers/%2Fa/k", "/a", "k"), ("/api/v1/timers/%2F/%2F", "/", "/"),
                                            ("/api/v1/timers/a%2Fb/k/x", "a/b", "k/x"),
                                            ("/api/v1/timers/a%2Fb/k%2Fx", "a/b", "k/x")])
def test_the_lane_reads_an_encoded_slash_as_part_of_the_queue(raw, queue, key):
    app = create_app(Settings.from_env({"QUEEN_DATABASE_URL": "postgresql://unused/db"}))
    hit = app.hot.match(_scope("DELETE", urllib.parse.unquote(raw), raw))
    assert hit is not None and hit[0] is routes_timers.KEY_ROUTE.endpoint
    assert hit[1] == {"queue": queue, "timerKey": key}


@contextlib.asynccontextmanager
async def _apps(database_url):
    """The broker's app twice over one database: the lane on, and off (every request
    through Starlette's stack); each with its lifespan (pool, sweeper) running."""
    settings = Settings.from_env({"QUEEN_DATABASE_URL": database_url})
    hot_app, stack_app = create_app(settings), create_app(settings)
    stack_app.hot = None
    async with hot_app.router.lifespan_context(hot_app), stack_app.router.lifespan_context(stack_app):
        clients = [httpx.AsyncClient(transport=httpx.ASGITransport(app=a, raise_app_exceptions=False),
                                     base_url="http://broker") for a in (hot_app, stack_app)]
        try:
            yield hot_app, clients[0], stack_app, clients[1]
        finally:
            for c in clients:
                await c.aclose()


async def _same(a, b, method, path, **kw):
    ra, rb = await a.request(method, path, **kw), await b.request(method, path, **kw)
    assert (ra.status_code, ra.headers.get("content-type"), ra.headers.get("retry-after"),
            ra.headers.get(routes_timers.HINT_HEADER)) == \
        (rb.status_code, rb.headers.get("content-type"), rb.headers.get("retry-after"),
         rb.headers.get(routes_timers.HINT_HEADER))
    return ra, rb


def op(key: str, **over) -> dict:
    o = {"op": "schedule", "queue": "q", "timerKey": key, "delayMs": 3_600_000, "txn": f"t-{key}",
         "payload": base64.b64encode(b'{"a":1}').decode()}
    o.update(over)
    return o


def test_verdicts_and_refusals_are_the_stacks(db, database_url):
    async def main():
        async with _apps(database_url) as (hot_app, hot, stack_app, stack):
            # DELETE: absent, refused key, query txn, a key over its limit
            for path in ("/api/v1/timers/q/none", "/api/v1/timers/q/a%00b", "/api/v1/timers/q/k?txn=x",
                         "/api/v1/timers/q/" + "k" * 2000, "/api/v1/timers/%2Fa/k", "/api/v1/timers/%2F/%2F?txn=y",
                         "/api/v1/timers/%FF/k", "/api/v1/timers//a/k", "/api/v1/timers/%2Fa"):
                ra, rb = await _same(hot, stack, "DELETE", path)
                assert ra.json() == rb.json()
            # POST: refusals of every kind are the same bytes
            bodies = [b"", b"{", b"[]", b'{"operations": 5}', b'{"operations": [{"op": "fire"}]}',
                      b'{"operations": [' + b"[" * 200 + b"]" * 200 + b"]}",
                      b'{"operations": [{"op": "schedule", "queue": "q", "timerKey": "k", "delayMs": 1, '
                      b'"txn": "t", "payload": "QQ"}]}']
            for raw in bodies:
                ra, rb = await _same(hot, stack, "POST", "/api/v1/timers", content=raw,
                                     headers={"content-type": "application/json"})
                assert ra.status_code == 400 and ra.content == rb.content
            # POST: the verdicts (keys of their own each), then a cancel through the lane
            for side, client in (("a", hot), ("b", stack)):
                r = await client.post("/api/v1/timers", json={"operations": [op(f"{side}1"), op(f"{side}2")]})
                assert r.status_code == 200
                assert [x["status"] for x in r.json()["results"]] == ["scheduled", "scheduled"]
            ra = await hot.delete("/api/v1/timers/q/a1")
            assert ra.json()["status"] == "cancelled"
            assert hot_app.state.body_budget.used == 0 and stack_app.state.body_budget.used == 0

    asyncio.run(main())


def test_an_unexpected_error_is_the_stacks_json_500(db, database_url, monkeypatch):
    async def broken(request):
        raise RuntimeError("a bug")

    monkeypatch.setattr(routes_timers, "cancel", broken)

    async def main():
        async with _apps(database_url) as (_, hot, _, stack):
            ra, rb = await _same(hot, stack, "DELETE", "/api/v1/timers/q/k")
            assert ra.status_code == 500 and ra.json() == rb.json() == {
                "error": "internal_error", "detail": "the broker met an unexpected error; its log has the details"}
            assert (await hot.get("/health")).status_code == 200  # the app goes on

    asyncio.run(main())


# ---------------------------------------------------------------------------
# server.OneWrite: a response's head goes out with its body
# ---------------------------------------------------------------------------

class _Transport:
    def __init__(self):
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


class _Cycle:
    def __init__(self, method="GET"):
        self.response_started = False
        self.chunked_encoding = None
        self.expected_content_length = 0
        self.scope = {"method": method}


def _start(cycle, length=None, chunked=False):
    cycle.response_started = True
    cycle.chunked_encoding = chunked if length is None else False
    cycle.expected_content_length = length or 0


def test_one_write_joins_a_head_with_its_body_and_passes_everything_else():
    from queen_timers.server import OneWrite

    t, c = _Transport(), _Cycle()
    w = OneWrite(t, c)
    w.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # before the response starts: at once
    assert t.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]
    _start(c, length=2)
    w.write(b"HEAD\r\n\r\n")
    assert len(t.writes) == 1  # held
    w.write(b"{}")
    assert t.writes[1] == b"HEAD\r\n\r\n{}"
    assert w.is_closing() is False  # anything else is the transport's

    for cycle, how in ((_Cycle(), dict(chunked=True)), (_Cycle(), dict(length=0)), (_Cycle("HEAD"), dict(length=5))):
        t = _Transport()
        w = OneWrite(t, cycle)
        _start(cycle, **how)
        w.write(b"head")
        assert t.writes == [b"head"]  # chunked, empty, HEAD: no body to wait for

    t, c = _Transport(), _Cycle()
    w = OneWrite(t, c)
    _start(c, length=10)
    w.write(b"head")
    w.close()  # the response failed after its start: the head goes, then the close
    assert t.writes == [b"head"] and t.closed

    t, c = _Transport(), _Cycle()
    w = OneWrite(t, c)
    big = b"x" * (OneWrite.JOIN_BYTES + 1)
    _start(c, length=len(big))
    w.write(b"head")
    w.write(big)
    assert t.writes == [b"head", big]  # a large body is not copied onto its head


# ---------------------------------------------------------------------------
# db.BrokerPool hands out the connection used last
# ---------------------------------------------------------------------------

def test_the_pool_hands_out_the_connection_returned_last(db, database_url):
    from queen_timers.db import make_pool

    async def main():
        settings = Settings.from_env({"QUEEN_DATABASE_URL": database_url, "QUEEN_POOL_MIN": "3"})
        pool = make_pool(settings)
        await pool.open(wait=True)
        try:
            conns = [await pool.getconn() for _ in range(3)]
            for c in conns:
                await pool.putconn(c)
            again = await pool.getconn()
            assert again is conns[-1]  # psycopg_pool's own order would give conns[0]
            await pool.putconn(again)
            async with pool.connection() as c:
                assert c is conns[-1]
        finally:
            await pool.close()

    asyncio.run(main())
