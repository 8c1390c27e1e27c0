"""bodies.BodyBudget's waiters: served in arrival order, each reserving what it waits for;
and bodies.RequestSlots: what busy tenants leave the others.

A stream of small bodies must never keep a large legal one out, and a
request that waits for its own tenant's half must never hold up another
tenant. Pure asyncio on the class itself (the broker-level case is in
test_body_budget.py): no database needed.
"""

from __future__ import annotations

import asyncio

import pytest

from queen_timers.bodies import HELD_KEY, BodyBudget, RequestSlots
from queen_timers.errors import ApiError

TOTAL = 100  # so a tenant's half is 50


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


class Requests:
    """Requests against one budget: take() as tasks, each with its own scope."""

    def __init__(self, budget: BodyBudget):
        self.budget = budget
        self.scopes: dict[str, dict] = {}
        self.tasks: dict[str, asyncio.Task] = {}

    def take(self, name: str, tenant: str, n: int) -> asyncio.Task:
        scope = self.scopes.setdefault(name, {})
        self.tasks[name] = asyncio.ensure_future(self.budget.take(scope, tenant, n))
        return self.tasks[name]

    def admitted(self, name: str) -> bool:
        return bool(self.scopes[name].get(HELD_KEY))

    def release(self, name: str) -> None:
        self.budget.release(self.scopes[name])


def consistent(budget: BodyBudget) -> None:
    assert budget.used == sum(budget.by_tenant.values())
    assert 0 <= budget.used <= budget.total
    assert all(0 < n <= budget.per_tenant for n in budget.by_tenant.values()), budget.by_tenant


def test_later_small_bodies_never_take_the_room_a_large_one_waits_for():
    async def main():
        budget = BodyBudget(TOTAL, wait_ms=5000)
        r = Requests(budget)
        await r.take("acme", "acme", 50)      # its half
        await r.take("initech", "initech", 10)
        r.take("globex", "globex", 50)         # the largest legal weight: 40 left, it waits
        await settle()
        assert not r.admitted("globex") and budget.waiting == 1
        # 40 is free and 5 would fit, but it is room globex waits for: umbrella queues behind it
        r.take("umbrella", "umbrella", 5)
        await settle()
        assert not r.admitted("umbrella") and budget.waiting == 2
        r.release("initech")                   # 50 free: globex first, umbrella still behind it
        await settle()
        assert r.admitted("globex") and not r.admitted("umbrella")
        assert budget.used == 100
        r.release("acme")
        await settle()
        assert r.admitted("umbrella") and budget.waiting == 0
        await asyncio.gather(*r.tasks.values())
        consistent(budget)
    run(main())


def test_what_is_left_after_the_reservations_ahead_is_used_at_once():
    async def main():
        budget = BodyBudget(TOTAL, wait_ms=5000)
        r = Requests(budget)
        await r.take("acme", "acme", 30)
        r.take("globex", "globex", 50)         # 70 free: admitted at once
        r.take("initech", "initech", 30)       # 20 free: waits
        r.take("umbrella", "umbrella", 5)      # behind a reservation of 30 on 20 free: waits
        await settle()
        assert r.admitted("globex") and not r.admitted("initech") and not r.admitted("umbrella")
        r.release("acme")                      # 50 free: initech's 30, then umbrella's 5 in what is left
        await settle()
        assert r.admitted("initech") and r.admitted("umbrella") and budget.used == 85
        consistent(budget)
    run(main())


def test_a_request_waiting_for_its_own_tenants_half_holds_up_no_other_tenant():
    async def main():
        budget = BodyBudget(TOTAL, wait_ms=5000)
        r = Requests(budget)
        await r.take("acme-1", "acme", 50)
        r.take("acme-2", "acme", 10)           # over acme's half: waits
        await settle()
        assert not r.admitted("acme-2")
        await r.take("globex", "globex", 50)   # the other half, at once, though acme-2 came first
        assert budget.used == 100
        # and within acme the order holds: acme-3 would fit nowhere before acme-2 anyway,
        # but once acme-1 ends acme-2 goes first
        r.release("globex")
        r.take("acme-3", "acme", 45)
        await settle()
        assert not r.admitted("acme-2") and not r.admitted("acme-3")
        r.release("acme-1")                    # acme's 50: acme-2's 10, then acme-3's 45 no longer fits
        await settle()
        assert r.admitted("acme-2") and not r.admitted("acme-3")
        r.release("acme-2")
        await settle()
        assert r.admitted("acme-3")
        consistent(budget)
    run(main())


def test_a_small_body_of_a_tenant_does_not_pass_its_own_large_one():
    async def main():
        budget = BodyBudget(TOTAL, wait_ms=5000)
        r = Requests(budget)
        await r.take("acme-1", "acme", 20)
        r.take("acme-big", "acme", 40)         # 20 + 40 over its half: waits
        r.take("acme-small", "acme", 5)        # 25 would fit the half, but acme-big is ahead
        await settle()
        assert not r.admitted("acme-big") and not r.admitted("acme-small")
        r.release("acme-1")
        await settle()
        assert r.admitted("acme-big") and r.admitted("acme-small") and budget.by_tenant == {"acme": 45}
    run(main())


def test_a_waiter_that_runs_out_of_time_is_refused_and_frees_what_it_reserved():
    async def main():
        refusals = []
        budget = BodyBudget(TOTAL, wait_ms=200, on_refuse=lambda: refusals.append(1))
        r = Requests(budget)
        await r.take("acme", "acme", 50)
        await r.take("initech", "initech", 10)
        big = r.take("globex", "globex", 50)
        await settle()
        small = r.take("umbrella", "umbrella", 5)
        await settle()
        assert not r.admitted("umbrella")
        with pytest.raises(ApiError) as refused:
            await big
        assert refused.value.status == 503 and refused.value.error == "timers_unavailable"
        assert refused.value.headers == {"Retry-After": "1"} and refusals == [1]
        await settle()
        assert r.admitted("umbrella") and not r.admitted("globex")  # no release needed
        await small
        assert budget.used == 65 and budget.waiting == 0
        consistent(budget)
    run(main())


def test_a_waiter_whose_client_goes_away_leaves_the_line_and_holds_nothing():
    async def main():
        budget = BodyBudget(TOTAL, wait_ms=5000)
        r = Requests(budget)
        await r.take("acme", "acme", 50)
        await r.take("initech", "initech", 10)
        big = r.take("globex", "globex", 50)
        r.take("umbrella", "umbrella", 5)
        await settle()
        big.cancel()                           # the request's task is cancelled: the client left
        with pytest.raises(asyncio.CancelledError):
            await big
        await settle()
        assert r.admitted("umbrella") and not r.admitted("globex") and budget.waiting == 0
        assert budget.used == 65
        consistent(budget)
    run(main())


def test_a_later_step_of_a_chunked_body_goes_first():
    async def main():
        budget = BodyBudget(TOTAL, wait_ms=5000)
        r = Requests(budget)
        await r.take("acme", "acme", 40)
        await r.take("chunked", "initech", 30)     # its first step
        r.take("globex", "globex", 30)             # the 30 left: admitted at once
        await settle()
        assert r.admitted("globex") and budget.used == 100
        r.take("umbrella", "umbrella", 10)         # waits
        await settle()
        # the chunked body's next step arrives after umbrella but goes ahead of it
        step = asyncio.ensure_future(budget.take(r.scopes["chunked"], "initech", 10))
        await settle()
        assert budget.waiting == 2
        r.release("globex")                        # 30 free: the step (10), then umbrella (10)
        await settle()
        assert step.done() and r.admitted("umbrella")
        assert budget.by_tenant == {"acme": 40, "initech": 40, "umbrella": 10}
        r.release("chunked")
        assert budget.by_tenant == {"acme": 40, "umbrella": 10}
        consistent(budget)
    run(main())


def test_many_tenants_many_requests_end_with_nothing_held():
    async def main():
        budget = BodyBudget(TOTAL, wait_ms=2000)
        outcomes = {"ok": 0, "busy": 0}

        async def request(i: int):
            scope: dict = {}
            try:
                await budget.take(scope, f"t{i % 7}", 1 + (i * 37) % 50)
                await asyncio.sleep(((i * 13) % 5) / 1000)
                outcomes["ok"] += 1
            except ApiError:
                outcomes["busy"] += 1
            finally:
                budget.release(scope)

        await asyncio.gather(*(request(i) for i in range(400)))
        assert outcomes["ok"] == 400, outcomes  # all of them in time: the line always moves
        assert budget.used == 0 and budget.by_tenant == {} and budget.waiting == 0
    run(main())


# ---------------------------------------------------------------------------
# bodies.RequestSlots: what busy tenants leave the others
# ---------------------------------------------------------------------------

def fill(slots, tenant: str) -> int:
    """Take slots for `tenant` until one is refused; how many it got."""
    got = 0
    while True:
        try:
            slots.take({}, tenant)
        except ApiError as refused:
            assert refused.status == 503 and refused.headers == {"Retry-After": "1"}
            return got
        got += 1


def test_busy_tenants_leave_each_next_tenant_half_of_what_they_found():
    slots = RequestSlots(per_tenant=500, total=1000)
    shares = [fill(slots, f"t{i}") for i in range(12)]
    # the first at its share, the second to a quarter free, then halving what is left
    assert shares[:5] == [500, 251, 125, 62, 31], shares
    assert sum(shares) <= 1000 and all(shares[:9]), shares  # nine busy tenants: each still got one
    assert slots.in_use == sum(shares) == sum(slots.by_tenant.values())


def test_one_tenant_alone_is_held_only_by_its_own_share():
    assert fill(RequestSlots(per_tenant=1000, total=1000), "default") == 1000  # auth off: every slot
    slots = RequestSlots(per_tenant=500, total=1000)
    assert fill(slots, "acme") == 500
    scopes = [{} for _ in range(3)]
    for scope in scopes:
        slots.take(scope, "globex")
    for scope in scopes:
        slots.release(scope)
    assert slots.by_tenant == {"acme": 500} and slots.in_use == 500
