"""The ``fair`` queue policy shares device time, not turns, among backlogged tenants.

Device time is charged with synthetic durations (``charge``), or, through a device actor,
measured by its worker thread on a fake clock that the jobs advance: nothing here
depends on wall time.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
import types
from collections import Counter
from collections.abc import Awaitable, Callable

import pytest
import trio
import trio.testing

from tests.support import gate_job
from wasinn.actors import DeviceActor, FairSharePolicy, Request
from wasinn.actors import device as device_module
from wasinn.actors import leasedesk as leasedesk_module
from wasinn.actors import workers as workers_module
from wasinn.backends.base import Device
from wasinn.enums import ExecutionTarget


def serve(policy: FairSharePolicy, costs: dict[str, float], grants: int,
          backlog: int = 3) -> list[str]:
    """One device serving ``grants`` requests: each tenant of ``costs`` keeps ``backlog``
    requests waiting (one pushed back for each served), each run is charged its
    tenant's cost. Returns the tenants served, in order."""
    for tenant in costs:
        for _ in range(backlog):
            policy.push(Request(tenant=tenant))
    order = []
    for _ in range(grants):
        request = policy.pop()
        assert request is not None
        order.append(request.tenant)
        policy.charge(request.tenant, costs[request.tenant])
        policy.push(Request(tenant=request.tenant))
    return order


def time_of(order: list[str], costs: dict[str, float]) -> Counter[str]:
    spent: Counter[str] = Counter()
    for tenant in order:
        spent[tenant] += costs[tenant]  # type: ignore[assignment]
    return spent


def test_device_time_is_shared_equally_by_tenants_of_unequal_cost() -> None:
    costs = {"heavy": 10.0, "light": 1.0}
    order = serve(FairSharePolicy(), costs, 1100)
    spent = time_of(order, costs)
    # Equal device time, to within one heavy run: ~100 heavy runs, ~1000 light ones.
    assert abs(spent["heavy"] - spent["light"]) <= 10.0
    assert Counter(order)["light"] == pytest.approx(10 * Counter(order)["heavy"], abs=11)


def test_equal_cost_tenants_alternate_and_a_double_cost_one_gets_half_the_turns() -> None:
    costs = {"a": 1.0, "b": 1.0, "c": 2.0}
    order = serve(FairSharePolicy(), costs, 600)
    ab = [tenant for tenant in order if tenant != "c"]
    assert all(x != y for x, y in itertools.pairwise(ab))  # a and b alternate
    turns = Counter(order)
    assert turns["a"] == pytest.approx(turns["b"], abs=1)
    assert turns["c"] == pytest.approx(turns["a"] / 2, abs=1)
    spent = time_of(order, costs)
    assert max(spent.values()) - min(spent.values()) <= 2.0


def test_an_idle_tenant_that_returns_gets_its_share_and_no_banked_credit() -> None:
    policy = FairSharePolicy()
    costs = {"heavy": 10.0, "light": 1.0}
    policy.push(Request(tenant="light"))
    assert policy.pop() is not None  # served once, then idle while "heavy" runs alone
    policy.charge("light", 1.0)
    serve(policy, {"heavy": 10.0}, 200)  # 2000 s of device time the light one did not use
    for _ in range(50):
        policy.push(Request(tenant="light"))
    order = []
    lead = 0.0  # how far light's device time since its return is ahead of heavy's
    for _ in range(200):
        request = policy.pop()
        assert request is not None
        order.append(request.tenant)
        policy.charge(request.tenant, costs[request.tenant])
        lead += costs[request.tenant] if request.tenant == "light" else -10.0
        # Never ahead by more than one turn of the other (no burst from banked credit).
        assert lead <= 10.0
        if request.tenant == "heavy":
            policy.push(Request(tenant="heavy"))
        elif order.count("light") == 50:
            break
    # Served at once (its turn), then about its share: ten light runs per heavy one.
    assert "light" in order[:2]
    assert abs(lead) <= 10.0
    assert order.count("heavy") == pytest.approx(5, abs=1)


def test_a_new_tenant_is_served_soon_and_starves_nobody() -> None:
    policy = FairSharePolicy()
    costs = {"a": 10.0, "b": 10.0, "new": 1.0}
    serve(policy, {"a": 10.0, "b": 10.0}, 100, backlog=2)
    for _ in range(200):
        policy.push(Request(tenant="new"))
    order = []
    for _ in range(120):
        request = policy.pop()
        assert request is not None
        order.append(request.tenant)
        policy.charge(request.tenant, costs[request.tenant])
        if request.tenant != "new":
            policy.push(Request(tenant=request.tenant))
    assert order.index("new") <= 2
    # a and b each run at least once in any 12 grants (10 new runs per a or b run).
    for start in range(len(order) - 24):
        window = order[start:start + 24]
        assert "a" in window and "b" in window
    spent = time_of(order, costs)
    assert max(spent.values()) - min(spent.values()) <= 20.0


def test_priority_then_deadline_then_arrival_within_a_tenant() -> None:
    policy = FairSharePolicy()
    heavy = [Request(0, tenant="heavy"), Request(5, 9.0, tenant="heavy"),
             Request(5, 3.0, tenant="heavy"), Request(0, 1.0, tenant="heavy"),
             Request(0, tenant="heavy")]
    for queued in heavy:
        policy.push(queued)
    for _ in range(40):
        policy.push(Request(tenant="light"))
    served: list[Request] = []
    while (request := policy.pop()) is not None:
        served.append(request)
        policy.charge(request.tenant, 10.0 if request.tenant == "heavy" else 1.0)
    heavy_order = [r for r in served if r.tenant == "heavy"]
    assert heavy_order == [heavy[2], heavy[1], heavy[3], heavy[0], heavy[4]]
    # Between two heavy runs, ten light ones (until the light ones run out).
    first, second = (served.index(r) for r in heavy_order[:2])
    assert second - first == 11


def test_requests_that_give_up_leave_and_their_tenant_banks_nothing() -> None:
    policy = FairSharePolicy()
    costs = {"heavy": 10.0, "light": 1.0}
    gone = [Request(tenant="light") for _ in range(5)]
    for request in gone:
        policy.push(request)
    policy.push(heavy := Request(tenant="heavy"))
    policy.remove(gone[2])
    policy.remove(gone[2])  # removed twice: nothing more
    assert len(policy) == 5
    assert policy.pop() is gone[0]  # first pushed, first among equal times
    policy.charge("light", 1.0)
    for request in gone[1:]:  # every light request gives up
        policy.remove(request)
    assert len(policy) == 1
    assert policy.pop() is heavy
    policy.charge("heavy", 10.0)
    assert policy.pop() is None and len(policy) == 0
    serve(policy, {"heavy": 10.0}, 50)  # the light tenant, idle, must bank nothing
    for _ in range(30):
        policy.push(Request(tenant="light"))
    order: list[str] = []
    while len(order) < 33:
        served = policy.pop()
        assert served is not None and served not in gone
        request = served
        order.append(request.tenant)
        policy.charge(request.tenant, costs[request.tenant])
        if request.tenant == "heavy":
            policy.push(Request(tenant="heavy"))
    assert order.count("heavy") == 3  # 30 light runs, 3 heavy ones: equal time


def test_one_off_tenant_names_do_not_grow_the_policy() -> None:
    policy = FairSharePolicy()
    costs = {"heavy": 10.0, "light": 1.0}
    for tenant in costs:
        policy.push(Request(tenant=tenant))
    served: Counter[str] = Counter()
    for i in range(20_000):
        # A one-off tenant: one that gives up, one that is served and charged.
        policy.push(gone := Request(tenant=f"gone {i}"))
        policy.remove(gone)
        policy.push(Request(tenant=f"once {i}"))
        for _ in range(2):
            request = policy.pop()
            assert request is not None
            tenant = request.tenant
            cost = costs.get(tenant, 1.0)
            policy.charge(tenant, cost)
            served[tenant if tenant in costs else "once"] += cost  # type: ignore[assignment]
            if tenant in costs:
                policy.push(Request(tenant=tenant))
        assert len(policy._tenants) <= 2 * (2 + 64) + 2
        assert len(policy._heap) <= 2 * (2 + 64) + 2
    # The backlogged tenants still share their device time equally (a heavy one whose
    # run is in flight when the one-off names are swept keeps its charge), and each
    # one-off tenant was served.
    assert abs(served["heavy"] - served["light"]) <= 10.0
    assert served["once"] >= 20_000 - 1


@pytest.fixture
def fake_clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The worker threads' perf_counter, advanced only by the jobs themselves."""
    now = [0.0]
    fake = types.SimpleNamespace(perf_counter=lambda: now[0], monotonic=lambda: 0.0)
    monkeypatch.setattr(workers_module, "time", fake)
    return now


#: Each fair-device test's load: three requests of 10 s for "heavy", twenty of 1 s for
#: "light", queued behind a gated job, in that order.
LOAD = (("heavy", 10.0, 3), ("light", 1.0, 20))
#: Ten light runs (10 s) for each heavy one (10 s), whatever the order of arrival.
SHARED_ORDER = (["heavy"] + ["light"] * 10) * 2 + ["heavy"]


async def serve_load(fake_clock: list[float],
                     submit: Callable[[DeviceActor, Callable[[], None], str], Awaitable[None]]
                     ) -> list[str]:
    """A fair device with one worker serving :data:`LOAD`, each request started with
    ``submit(actor, job, tenant)`` once the gated job holds the slot; the tenants in the
    order their jobs ran (each job advances ``fake_clock`` by its cost)."""
    ran: list[str] = []

    def job(tenant: str, cost: float) -> None:
        ran.append(tenant)
        fake_clock[0] += cost

    actor = DeviceActor(Device(ExecutionTarget.CPU), workers=1, policy=FairSharePolicy())
    gate = threading.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.serve)
        async with trio.open_nursery() as requests:
            requests.start_soon(actor.execute, gate_job(gate))
            await trio.testing.wait_all_tasks_blocked()
            for tenant, cost, count in LOAD:
                for _ in range(count):
                    requests.start_soon(submit, actor, functools.partial(job, tenant, cost),
                                        tenant)
                    await trio.testing.wait_all_tasks_blocked()
            assert actor.queued == 23
            gate.set()
        nursery.cancel_scope.cancel()
    return ran


async def test_a_fair_device_charges_the_run_time_its_worker_thread_measures(
        fake_clock: list[float]) -> None:
    async def executed(actor: DeviceActor, job: Callable[[], None], tenant: str) -> None:
        await actor.execute(job, tenant=tenant)

    assert await serve_load(fake_clock, executed) == SHARED_ORDER
    assert math.isclose(fake_clock[0], 50.0)


async def test_a_fair_device_charges_a_lease_the_time_its_holder_kept_the_slot(
        fake_clock: list[float], monkeypatch: pytest.MonkeyPatch) -> None:
    # A lease's run is in its holder's thread (a guest's path): the time from its grant
    # to its slot given back is charged to its tenant when the slot comes back.
    fake = types.SimpleNamespace(perf_counter=lambda: fake_clock[0])
    monkeypatch.setattr(device_module, "time", fake)
    monkeypatch.setattr(leasedesk_module, "time", fake)

    async def leased(actor: DeviceActor, job: Callable[[], None], tenant: str) -> None:
        lease = await actor.lease(job, tenant=tenant)
        await trio.to_thread.run_sync(lease.run)

    assert await serve_load(fake_clock, leased) == SHARED_ORDER
