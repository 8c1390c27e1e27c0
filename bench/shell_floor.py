"""The floor of this stack for a DELETE and a schedule batch: what any Python HTTP
shell on uvloop, httptools and libpq must spend, measured beside the broker
(`bench/run --only cancel --cancel-load-variant floor`, `bench/run --only schedule
--sched-floor`).

Serves `DELETE /api/v1/timers/:queue/:timerKey`, `POST /api/v1/timers` (the common
batch only) and `GET /health` and nothing else, with the least the broker's own stack can do: an asyncio.Protocol on
uvloop, the httptools (llhttp) parser, four database connections opened at
start (a stack of idle ones, a line of waiters), `queen.cancel_timer` prepared
once and sent through libpq as the broker's hot routes do
(queen_timers.db.fetch_row: send, then one reader callback per wait), and the
answer the broker gives (orjson, the same keys) in one write. It does not
authenticate, match routes, check names, queue for a pool or a tenant's share,
count metrics or bound anything: the broker's DELETE against this one is what
the broker's own work costs; this one against `queen.cancel_timer` in SQL is
what the HTTP hop and the event loop cost on this machine, whatever the shell.
Not a server anyone should run: a ruler for bench/cancel.py.
"""

from __future__ import annotations

import asyncio
import collections
import os
import sys
from pathlib import Path

import httptools
import orjson
import psycopg
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
from queen_timers import db  # noqa: E402  (the broker's own libpq path)
from queen_timers.auth import ANONYMOUS  # noqa: E402  (the principal when auth is off)
from queen_timers.config import Settings  # noqa: E402
from queen_timers.routes_timers import (  # noqa: E402  (the routes' own statements and steps)
    _STATEMENTS, CANCEL, _fast_batch, _results_json, _route_statement)

TENANT = ANONYMOUS.tenant  # the broker's tenant when auth is off, as bench/cancel.py's
PREFIX = b"/api/v1/timers/"
BATCHES = b"/api/v1/timers"
SETTINGS = Settings.from_env(dict(os.environ))
HEALTH = b'{"status":"healthy"}'
POOL = 4


def answer(status: int, body: bytes) -> bytes:
    reason = {200: b"OK", 400: b"Bad Request"}.get(status, b"Not Found")
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (status, reason, len(body), body))


class Conns:
    """The least a pool can be: idle connections on a stack (the one used last first,
    as the broker's pool), and a line of futures when none is idle."""

    def __init__(self, conns: list[psycopg.AsyncConnection]):
        self.idle = conns
        self.waiters: collections.deque[asyncio.Future] = collections.deque()

    async def take(self) -> psycopg.AsyncConnection:
        if self.idle:
            return self.idle.pop()
        waiter = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        return await waiter

    def give(self, conn: psycopg.AsyncConnection) -> None:
        if self.waiters:
            self.waiters.popleft().set_result(conn)
        else:
            self.idle.append(conn)


class Floor(asyncio.Protocol):
    def __init__(self, conns: Conns):
        self.conns = conns
        self.parser = httptools.HttpRequestParser(self)
        self.transport = None
        self.url = b""

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_begin(self) -> None:
        self.url = b""
        self.body: list[bytes] = []

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_message_complete(self) -> None:
        if self.parser.get_method() == b"DELETE" and self.url.startswith(PREFIX):
            asyncio.get_running_loop().create_task(self.cancel(self.url))
        elif self.parser.get_method() == b"POST" and self.url == BATCHES:
            asyncio.get_running_loop().create_task(self.schedule(b"".join(self.body)))
        elif self.url == b"/health":
            self.transport.write(answer(200, HEALTH))
        else:
            self.transport.write(answer(404, b'{"error":"not_found"}'))

    async def cancel(self, url: bytes) -> None:
        queue, _, key = url[len(PREFIX):].decode().partition("/")
        conn = await self.conns.take()
        try:
            row = await db.fetch_row(conn, CANCEL, {"tenant": TENANT, "queue": queue, "timer_key": key},
                                     prepare=True)
        finally:
            self.conns.give(conn)
        status = row[0]
        self.transport.write(answer(200, orjson.dumps({"ok": status == "cancelled", "status": status,
                                                       "queue": queue, "timerKey": key, "txn": None})))


    async def schedule(self, raw: bytes) -> None:
        batch = _fast_batch(raw, len(raw), max_ops=SETTINGS.timers_max_ops, stage_bytes=SETTINGS.timers_stage_bytes)
        if batch is None:  # the floor serves the common batch only
            self.transport.write(answer(400, b'{"error":"not_the_common_batch"}'))
            return
        sql, params = _route_statement(batch, ANONYMOUS, SETTINGS, batch.upserts)
        conn = await self.conns.take()
        try:
            _, *verdicts = await db.fetch_row(conn, _STATEMENTS[sql], params, prepare=True)
        finally:
            self.conns.give(conn)
        cols = batch.columns
        self.transport.write(answer(200, _results_json(verdicts, cols["queue"], cols["timer_key"], cols["txn"],
                                                       batch.plain)))


async def main() -> None:
    url = os.environ["QUEEN_DATABASE_URL"]
    # a paced load overlaps requests now and then: more than one connection
    conns = Conns([await psycopg.AsyncConnection.connect(url, autocommit=True) for _ in range(POOL)])
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Floor(conns), os.environ.get("QUEEN_HOST", "127.0.0.1"),
                                      int(os.environ["QUEEN_PORT"]))
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    uvloop.run(main())
