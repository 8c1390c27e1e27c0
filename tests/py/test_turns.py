"""turns.Turns: requests start in turns, per tenant, so that one client's burst of
cheap requests (401s, 403s, /health) never goes ahead of another tenant's; and
turns.SharedCall: a flood of /health or /metrics/prometheus costs one call at a time.

The classes on their own (pure asyncio), then a broker under QUEEN_AUTH=jwt.
"""

from __future__ import annotations

import asyncio
import select
import socket
import time

import httpx

from queen_timers.turns import ANONYMOUS, SharedCall, Turns
from test_input_limits import read_response
from timers_util import JWT_SECRET, token


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


async def settle(n: int = 1) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


class Starts:
    """Requests taking their turns, as tasks; `order` is the order they started in."""

    def __init__(self, turns: Turns):
        self.turns = turns
        self.order: list[str] = []
        self.tasks: dict[str, asyncio.Task] = {}

    def arrive(self, name: str, key) -> None:
        async def request():
            wait = self.turns.start(key)
            if wait is not None:
                await wait
            self.order.append(name)
        self.tasks[name] = asyncio.ensure_future(request())


def test_a_tenant_starts_at_most_per_turn_requests_an_iteration_and_the_rest_in_arrival_order():
    async def main():
        turns, loop_turns = Turns(per_turn=2), 0
        s = Starts(turns)
        for i in range(7):
            s.arrive(f"a{i}", "acme")
        await settle()  # every task ran once: two started, five wait
        assert s.order == ["a0", "a1"] and turns.waiting == 5
        while turns.waiting:
            await settle()
            loop_turns += 1
        await settle(2)
        assert s.order == [f"a{i}" for i in range(7)]
        assert loop_turns >= 3  # five waiting, two a turn
        assert turns.queues == {} and turns.waiting == 0
    run(main())


def test_a_tenant_arriving_during_anothers_burst_starts_at_once():
    async def main():
        turns = Turns(per_turn=4)
        s = Starts(turns)
        for i in range(100):
            s.arrive(f"flood{i}", ANONYMOUS)
        s.arrive("quiet", "quiet")
        await settle()
        # behind 100 requests in the loop's queue, quiet started with the first four
        assert s.order[:5] == ["flood0", "flood1", "flood2", "flood3", "quiet"], s.order[:6]
        assert turns.waiting == 96
        # a second request of quiet's, arriving while 96 of the flood wait, also goes first
        s.arrive("quiet2", "quiet")
        await settle()
        assert s.order.index("quiet2") < 5 + 4 + 1, s.order
        while turns.waiting:
            await settle()
        await settle(2)
        assert len(s.order) == 102
    run(main())


def test_each_busy_tenant_gets_the_same_turns():
    async def main():
        turns = Turns(per_turn=3)
        s = Starts(turns)
        for i in range(30):
            s.arrive(f"a{i}", "acme")
        for i in range(30):
            s.arrive(f"g{i}", "globex")
        while turns.waiting or len(s.order) < 60:
            await settle()
        # in every stretch of started requests, neither tenant is more than a turn ahead
        for n in range(1, 61):
            first = s.order[:n]
            a, g = sum(x[0] == "a" for x in first), sum(x[0] == "g" for x in first)
            assert abs(a - g) <= 3, (n, first)
    run(main())


def test_a_request_cancelled_while_it_waits_lets_the_next_one_start():
    async def main():
        turns = Turns(per_turn=1)
        s = Starts(turns)
        for name in ("a0", "a1", "a2"):
            s.arrive(name, "acme")
        await settle()
        assert s.order == ["a0"]
        s.tasks["a1"].cancel()
        while turns.waiting:
            await settle()
        await settle(2)
        assert s.order == ["a0", "a2"] and turns.queues == {}
    run(main())


def test_shared_call_runs_once_for_every_caller_that_arrives_while_it_runs():
    async def main():
        calls = []
        gate = asyncio.Event()

        async def work():
            calls.append(1)
            await gate.wait()
            return len(calls)

        shared = SharedCall(work)
        callers = [asyncio.ensure_future(shared()) for _ in range(50)]
        await settle(3)
        callers[0].cancel()  # one caller goes away: the others still get the call's result
        gate.set()
        results = await asyncio.gather(*callers[1:])
        assert calls == [1] and results == [1] * 49
        assert await shared() == 2  # the next caller after it ended starts a new call
    run(main())


def test_shared_call_raises_its_error_to_every_caller_and_the_next_call_is_fresh():
    async def main():
        n = []

        async def work():
            n.append(1)
            await asyncio.sleep(0.01)
            if len(n) == 1:
                raise OSError("database gone")
            return "ok"

        shared = SharedCall(work)
        got = await asyncio.gather(*(shared() for _ in range(5)), return_exceptions=True)
        assert all(isinstance(e, OSError) for e in got) and len(n) == 1
        assert await shared() == "ok"
    run(main())


# ---------------------------------------------------------------------------
# on a broker
# ---------------------------------------------------------------------------

def readable(socks: list[socket.socket]) -> int:
    ready, _, _ = select.select(socks, [], [], 0)
    return len(ready)


def test_a_burst_of_requests_without_a_credential_does_not_go_ahead_of_a_tenants_request(spawn_broker, db):
    # 300 requests without a credential, each on its own connection, all sent at once, then
    # tenant quiet's DELETE: the broker reads them in the same turns of its loop. Before
    # turns.py the DELETE was served after every 401 read before it (its answer came after
    # 270-300 of them); now it starts with the first turn of ANONYMOUS's.
    b = spawn_broker(QUEEN_AUTH="jwt", QUEEN_JWT_SECRET=JWT_SECRET)
    quiet = token("read-write", tenant="quiet")["Authorization"]
    delete = f"DELETE /api/v1/timers/q/k HTTP/1.1\r\nHost: x\r\nAuthorization: {quiet}\r\n\r\n".encode()
    anon = b"GET /api/v1/timers/q HTTP/1.1\r\nHost: x\r\n\r\n"
    n = 300
    flood = [socket.create_connection(("127.0.0.1", b.port), timeout=10) for _ in range(n)]
    try:
        with socket.create_connection(("127.0.0.1", b.port), timeout=10) as sock:
            sock.sendall(delete)  # a first DELETE: the connection and the statement warm
            assert read_response(sock)[0] == 200
            time.sleep(0.3)
            ahead = []
            for _ in range(3):  # three bursts: the figure is their best (the machine is shared)
                for s in flood:
                    s.sendall(anon)
                answered_before = readable(flood)
                sock.sendall(delete)
                status, _, text = read_response(sock)
                assert status == 200, text
                ahead.append(readable(flood) - answered_before)
                for s in flood:  # every one of them a JSON 401, all read before the next burst
                    st, _, body = read_response(s)
                    assert st == 401 and b'"unauthorized"' in body, (st, body)
            assert min(ahead) < n // 4, ahead
    finally:
        for s in flood:
            s.close()


def test_health_and_metrics_floods_are_served_from_one_call_at_a_time(spawn_broker, db):
    b = spawn_broker(QUEEN_AUTH="jwt", QUEEN_JWT_SECRET=JWT_SECRET)

    async def main():
        async with httpx.AsyncClient(base_url=b.url, timeout=30,
                                     limits=httpx.Limits(max_connections=200)) as c:
            rs = await asyncio.gather(*(c.get(p) for p in ("/health", "/metrics/prometheus") * 100))
        return rs

    rs = asyncio.run(main())
    health = [r for r in rs if r.url.path == "/health"]
    metrics = [r for r in rs if r.url.path == "/metrics/prometheus"]
    assert all(r.status_code == 200 and r.json()["database"] == "connected" for r in health)
    assert all(r.status_code == 200 and "queen_timers_requests_waiting_turn" in r.text for r in metrics)
