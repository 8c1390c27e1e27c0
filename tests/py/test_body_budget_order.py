"""bodies.BodyBudget's waiters: served in arrival order, each reserving what it waits for;
and bodies.RequestSlots: what busy tenants leave the others.

A stream of small bodies must never keep a large legal one out, and a
request that waits for its own tenant's half must never hold up another
tenant. Pure asyncio on the class itself (the broker-level case is in
test_body_budget.py): no database needed.
"""

from __future__ import annotations

import asyncio
import random

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


# ---------------------------------------------------------------------------
# the line kept per tenant against the line walked whole (the model)
# ---------------------------------------------------------------------------

class WalkedLine:
    """The budget's rule as one line walked whole on every change: what BodyBudget
    did before it kept a line per tenant, the specification its lines must match."""

    def __init__(self, total: int):
        self.total, self.per_tenant = total, total // 2
        self.used, self.by_tenant, self.line, self.held = 0, {}, [], {}

    def _hold(self, name, tenant, n):
        self.used += n
        self.by_tenant[tenant] = self.by_tenant.get(tenant, 0) + n
        self.held.setdefault(name, []).append((tenant, n))

    def take(self, name, tenant, n):
        if not self.line and self.used + n <= self.total and self.by_tenant.get(tenant, 0) + n <= self.per_tenant:
            self._hold(name, tenant, n)
        elif self.held.get(name):
            self.line.insert(0, (name, tenant, n))  # a later step of a chunked body goes first
            self.admit()
        else:
            self.line.append((name, tenant, n))
            self.admit()

    def leave(self, name):
        self.line = [w for w in self.line if w[0] != name]
        self.admit()

    def give_back(self, tenant, n):
        self.used -= n
        self.by_tenant[tenant] -= n
        if not self.by_tenant[tenant]:
            del self.by_tenant[tenant]

    def release(self, name):
        for tenant, n in self.held.pop(name, []):
            self.give_back(tenant, n)
        self.admit()

    def resize_last(self, name, n):
        tenant, had = self.held[name][-1]
        n = min(n, had)
        if n:
            self.held[name][-1] = (tenant, n)
        else:
            self.held[name].pop()
        self.give_back(tenant, had - n)
        self.admit()

    def admit(self):
        room, tenant_room, kept = self.total - self.used, {}, []
        for i, (name, tenant, n) in enumerate(self.line):
            if room <= 0:
                kept += self.line[i:]
                break
            mine = tenant_room.get(tenant, self.per_tenant - self.by_tenant.get(tenant, 0))
            tenant_room[tenant] = mine - n
            if n > mine or n > room:
                if n <= mine:
                    room -= n
                kept.append((name, tenant, n))
                continue
            room -= n
            self._hold(name, tenant, n)
        self.line = kept


@pytest.mark.parametrize("seed", range(40))
def test_the_lines_per_tenant_admit_what_the_whole_line_walked_admits(seed):
    rng = random.Random(seed)
    tenants = [f"t{i}" for i in range(rng.choice((1, 2, 3, 6)))]

    async def main():
        budget, model = BodyBudget(TOTAL, wait_ms=60_000), WalkedLine(TOTAL)
        r = Requests(budget)
        for step in range(300):
            waiting = [name for name, task in r.tasks.items() if not task.done()]
            holding = [name for name in model.held if model.held[name]]
            op = rng.random()
            if op < 0.45 or not (waiting or holding):
                name = f"r{step}"
                if holding and rng.random() < 0.15:  # a chunked body's next step
                    name = rng.choice(holding)
                    if name in waiting:
                        continue
                tenant = model.held[name][0][0] if name in model.held and model.held[name] else rng.choice(tenants)
                n = rng.choice((1, 2, 5, 10, 20, 30, 45, 50))
                r.take(name, tenant, n)
                model.take(name, tenant, n)
            elif op < 0.6 and waiting:
                name = rng.choice(waiting)
                r.tasks[name].cancel()
                model.leave(name)
            elif op < 0.7 and holding:
                name = rng.choice(holding)
                n = rng.choice((0, 1, 5))
                budget.resize_last(r.scopes[name], n)
                model.resize_last(name, n)
            elif holding:
                name = rng.choice(holding)
                r.release(name)
                model.release(name)
            await settle()
            assert budget.used == model.used and budget.by_tenant == model.by_tenant, step
            assert budget.waiting == len(model.line), step
            held = {name: scope.get(HELD_KEY) for name, scope in r.scopes.items() if scope.get(HELD_KEY)}
            assert held == {name: h for name, h in model.held.items() if h}, step
            consistent(budget)
        for task in r.tasks.values():
            task.cancel()
        await asyncio.gather(*r.tasks.values(), return_exceptions=True)
        assert budget.waiting == 0
    run(main())


def test_the_heap_of_first_waiters_stays_bounded_while_the_budget_is_full():
    # firsts that leave while nothing fits leave stale entries that _admit never reaches:
    # a tenant retrying for an hour against a full budget must not grow the broker's memory
    async def main():
        budget = BodyBudget(TOTAL, wait_ms=60_000)
        r = Requests(budget)
        await r.take("a", "acme", 50)
        await r.take("b", "globex", 50)  # full
        r.take("big", "initech", 40)  # waits, reserving the room: nothing behind it fits
        for i in range(2000):
            r.take(f"w{i}", "umbrella", 10)  # a client that gives up and comes back
            await settle()
            r.tasks[f"w{i}"].cancel()
            await settle()
        assert budget.waiting == 1
        assert len(budget._heads) <= 2 * len(budget._lines) + 65, len(budget._heads)
        r.release("a")  # the line still moves
        await settle()
        assert r.admitted("big")
        consistent(budget)
    run(main())
