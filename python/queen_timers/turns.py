"""Requests start in turns, per tenant (QUEEN_AUTH=jwt).

One event loop serves every request of a broker, in the order their bytes
arrive: a client holding 128 connections in a tight loop puts 128 requests
ahead of everybody else's, on every turn of the loop. Before this, requests
answered without waiting for anything (401s, 403s, /health's pool turn)
sent from one host pushed another tenant's DELETE p50 from 1.2 to 48 ms,
and /metrics/prometheus to 100 ms (bench/run --only conns, phase `cheap`).

So each request, once the broker knows whose it is, takes a turn: in one
iteration of the event loop a tenant starts at most PER_TURN requests, and
the rest of its requests wait for the next iterations, in arrival order,
PER_TURN each. Requests with no valid credential (the public routes, every
401) are one more tenant, ANONYMOUS. A tenant alone loses nothing (the loop
turns at once); a tenant arriving while another floods starts on the next
iteration, behind at most PER_TURN requests of each busy tenant. What is
started is not limited: a long poll or a slow body holds its request slot
(bodies.RequestSlots), not a turn. A request waiting for its turn holds
nothing but its connection (QUEEN_MAX_CONNECTIONS bounds those).
"""

from __future__ import annotations

import asyncio
from collections import deque

PER_TURN = 4
ANONYMOUS = None  # the key of requests with no valid credential: no tenant is named None


class Turns:
    def __init__(self, per_turn: int = PER_TURN):
        self.per_turn = per_turn
        self.started: dict[str | None, int] = {}      # requests started this iteration, per tenant
        self.queues: dict[str | None, deque] = {}     # requests waiting, per tenant, in arrival order
        self.waiting = 0
        self._armed = False

    def start(self, key: str | None) -> asyncio.Future | None:
        """None: start now. A future: start once it is done (await it)."""
        n = self.started.get(key, 0)
        if n < self.per_turn and key not in self.queues:
            self.started[key] = n + 1
            self._arm()
            return None
        future = asyncio.get_running_loop().create_future()
        self.queues.setdefault(key, deque()).append(future)
        self.waiting += 1
        self._arm()
        return future

    def _arm(self) -> None:
        # call_soon: the next iteration of the loop, after what this one made ready
        if not self._armed:
            self._armed = True
            asyncio.get_running_loop().call_soon(self._turn)

    def _turn(self) -> None:
        self._armed = False
        self.started.clear()
        for key in list(self.queues):
            queue, n = self.queues[key], 0
            while queue and n < self.per_turn:
                future = queue.popleft()
                self.waiting -= 1
                if not future.done():  # a cancelled request lets the next one go
                    future.set_result(None)
                    n += 1
            if n:
                self.started[key] = n
            if not queue:
                del self.queues[key]
        if self.started:
            self._arm()


class SharedCall:
    """The public routes' work, done once for every caller that arrives while it runs:
    a flood of GET /health or /metrics/prometheus (no credential needed) costs one
    pool connection and one query or rendering at a time, not one each. A caller
    gets the result of a call that started at most one call's time before it came."""

    def __init__(self, work):
        self.work = work
        self.running: asyncio.Future | None = None

    async def __call__(self):
        if self.running is None:
            self.running = asyncio.ensure_future(self.work())
            self.running.add_done_callback(self._done)
        # shield: a caller that goes away does not cancel the others' call
        return await asyncio.shield(self.running)

    def _done(self, future: asyncio.Future) -> None:
        self.running = None
        if not future.cancelled():
            future.exception()  # retrieved: every caller has had it raised, or none was left
