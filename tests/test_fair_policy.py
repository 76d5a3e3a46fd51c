"""The ``fair`` queue policy shares device time, not turns, among backlogged tenants, in
proportion to their weights (``[tenants.NAME] weight``).

Device time is charged with synthetic durations (``charge``), or, through a device actor,
measured by its worker thread on a fake clock that the jobs advance, or, through a
runtime, measured on real runs and compared only with itself: nothing here depends on
wall time.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import threading
import types
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import wasinn
from tests.support import gate_job, require_backend
from wasinn import ConfigError
from wasinn.actors import DeviceActor, FairSharePolicy, PriorityDeadlinePolicy, Request
from wasinn.actors import _device_requests as requests_module
from wasinn.actors import leasedesk as leasedesk_module
from wasinn.actors import workers as workers_module
from wasinn.actors.queue import policy_for
from wasinn.backends.base import Device
from wasinn.configs.loader import load_config
from wasinn.enums import ExecutionTarget
from wasinn.modelgen import onnx_model_bytes


def serve(policy: FairSharePolicy, costs: dict[str, float], grants: int,
          backlog: int = 3) -> list[str]:
    """One device serving ``grants`` requests: each tenant of ``costs`` keeps ``backlog``
    requests waiting (one pushed back for each served), each run is charged its
    tenant's cost. Returns the tenants served, in order."""
    for tenant in costs:
        for _ in range(backlog):
            policy.push(Request(tenant=tenant))
    return granted(policy, costs, grants, lambda tenant: True)


def serve_newcomer(policy: FairSharePolicy, costs: dict[str, float], grants: int,
                   newcomer: str, requests: int) -> list[str]:
    """``newcomer`` queues ``requests`` requests at once on ``policy`` (already serving
    others, each with a request waiting); then ``grants`` runs are served, each charged
    its tenant's cost, and every tenant but the newcomer pushes a request back for each
    one served. Returns the tenants served, in order."""
    for _ in range(requests):
        policy.push(Request(tenant=newcomer))
    return granted(policy, costs, grants, lambda tenant: tenant != newcomer)


def granted(policy: FairSharePolicy, costs: dict[str, float], grants: int,
            pushes_back: Callable[[str], bool]) -> list[str]:
    """``grants`` runs served from ``policy``, each charged its tenant's cost, and a
    request pushed back for each one served whose tenant ``pushes_back``; the tenants
    served, in order."""
    order = []
    for _ in range(grants):
        request = policy.pop()
        assert request is not None
        order.append(request.tenant)
        policy.charge(request.tenant, costs[request.tenant])
        if pushes_back(request.tenant):
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
    order = serve_newcomer(policy, costs, 120, "new", 200)
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


class RecordingFairPolicy(FairSharePolicy):
    """A fair policy that notes each charge, ``(tenant, seconds)``, in ``charged``."""

    def __init__(self) -> None:
        super().__init__()
        self.charged: list[tuple[str, float]] = []

    def charge(self, tenant: str, seconds: float) -> None:
        self.charged.append((tenant, seconds))  # (any thread: list.append is atomic)
        super().charge(tenant, seconds)


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
    monkeypatch.setattr(requests_module, "time", fake)
    monkeypatch.setattr(leasedesk_module, "time", fake)

    async def leased(actor: DeviceActor, job: Callable[[], None], tenant: str) -> None:
        lease = await actor.lease(job, tenant=tenant)
        await trio.to_thread.run_sync(lease.run)

    assert await serve_load(fake_clock, leased) == SHARED_ORDER


async def test_a_fair_device_charges_a_run_that_ends_while_a_job_waits_for_its_thread(
        fake_clock: list[float]) -> None:
    # A job that holds no slot (a compile or a warm-up handed to the worker threads)
    # waits for the only thread while a's run goes on. When that run ends, its thread
    # passes no slot on (the slot is freed in trio, and the thread handed to that job
    # first), but the run is a's device time all the same: queued before b's, a's next
    # request would be served first were its 10 s not charged.
    ran: list[str] = []

    def job(name: str, cost: float, gate: threading.Event | None = None) -> None:
        if gate is not None and not gate.wait(timeout=30):
            raise RuntimeError("gate never opened")
        ran.append(name)
        fake_clock[0] += cost

    def request(tenant: str, cost: float, gate: threading.Event | None = None
                ) -> Callable[[], Awaitable[object]]:
        return functools.partial(actor.execute,
                                 functools.partial(job, tenant, cost, gate), tenant=tenant)

    policy = RecordingFairPolicy()
    actor = DeviceActor(Device(ExecutionTarget.CPU), workers=1, policy=policy)
    gate = threading.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.serve)
        async with trio.open_nursery() as requests:
            requests.start_soon(request("a", 10.0, gate))
            await trio.testing.wait_all_tasks_blocked()
            requests.start_soon(actor.threads.run, functools.partial(job, "unslotted", 0.0))
            await trio.testing.wait_all_tasks_blocked()
            for tenant in ("a", "b"):
                requests.start_soon(request(tenant, 1.0))
                await trio.testing.wait_all_tasks_blocked()
            assert actor.queued == 2 and actor.threads.busy == 2
            gate.set()
        nursery.cancel_scope.cancel()
    assert ran == ["a", "unslotted", "b", "a"]
    assert policy.charged == [("a", 10.0), ("b", 1.0), ("a", 1.0)]


def test_a_free_slot_run_that_ends_while_others_wait_is_a_debt_of_its_tenant() -> None:
    # Before, a tenant the policy did not know yet (it never queued: its runs all found
    # a slot free) was not charged at all, where a known one is: its run taken while
    # others waited (it started on a free slot; they queued meanwhile) cost it nothing.
    policy = FairSharePolicy()
    for _ in range(3):
        policy.push(Request(tenant="fresh"))  # queued while "free"'s run goes on
    policy.charge("free", 10.0)  # that run ends
    for _ in range(3):
        policy.push(Request(tenant="free"))
    # fresh is served until it has had about as much (free's 10 s, 3 runs here).
    assert granted(policy, {"free": 1.0, "fresh": 1.0}, 6, lambda _: False) == [
        "fresh"] * 3 + ["free"] * 3
    assert not len(policy)


def test_device_time_nobody_else_wanted_is_no_debt() -> None:
    # alice alone for 600 s (every run on a free slot), then bob arrives and both wait:
    # they share from then on; bob gets no burst for the time alice used alone.
    policy = FairSharePolicy()
    for _ in range(600):
        policy.charge("alice", 1.0)
    for tenant in ("bob", "alice"):
        for _ in range(100):
            policy.push(Request(tenant=tenant))
    order = granted(policy, {"alice": 1.0, "bob": 1.0}, 100, lambda _: False)
    assert Counter(order) == {"alice": 50, "bob": 50}


async def test_a_lease_on_a_free_slot_is_charged_to_its_tenant(
        fake_clock: list[float], monkeypatch: pytest.MonkeyPatch) -> None:
    # try_lease (a guest's thread finding the slot free, nobody waiting) never queues,
    # but the time it holds the slot is its tenant's all the same: uncharged, a tenant
    # whose requests mostly find the device idle would owe nothing once others wait.
    fake = types.SimpleNamespace(perf_counter=lambda: fake_clock[0])
    monkeypatch.setattr(requests_module, "time", fake)
    monkeypatch.setattr(leasedesk_module, "time", fake)
    policy = RecordingFairPolicy()

    def job() -> None:
        fake_clock[0] += 2.5

    actor = DeviceActor(Device(ExecutionTarget.CPU), workers=1, policy=policy)
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.serve)
        lease = actor.try_lease(job, tenant="bob")
        assert lease is not None
        await trio.to_thread.run_sync(lease.run)
        untagged = actor.try_lease(job)
        assert untagged is not None
        await trio.to_thread.run_sync(untagged.run)
        nursery.cancel_scope.cancel()
    assert policy.charged == [("bob", 2.5), ("", 2.5)]


# Weighted shares ([tenants.NAME] weight).


@pytest.mark.parametrize("gold", ["gold", ""])  # "": the requests that name no tenant
def test_a_tenant_of_weight_2_gets_two_runs_for_each_run_of_a_weight_1_tenant(
        gold: str) -> None:
    costs = {gold: 1.0, "silver": 1.0}
    order = serve(FairSharePolicy({gold: 2.0}), costs, 900)
    turns = Counter(order)
    assert turns[gold] == pytest.approx(600, abs=1)
    assert turns["silver"] == pytest.approx(300, abs=1)
    # All along, not only on the whole: never more than two gold runs in a row, and
    # never two silver ones.
    runs = {tenant: max(len(list(group)) for t, group in itertools.groupby(order)
                        if t == tenant) for tenant in costs}
    assert runs == {gold: 2, "silver": 1}


@pytest.mark.parametrize("weights", [{"a": 1.0, "b": 2.0, "c": 4.0},
                                     {"a": 0.25, "b": 3.0, "c": 1.0}])
def test_device_time_follows_the_weights_whatever_the_requests_cost(
        weights: dict[str, float]) -> None:
    costs = {"a": 1.0, "b": 3.0, "c": 0.5}
    policy = FairSharePolicy(weights)
    spent = time_of(serve(policy, costs, 3000), costs)
    # Each tenant's device time per unit of weight is the same, to within one run's.
    per_weight = {tenant: spent[tenant] / weights[tenant] for tenant in costs}
    assert max(per_weight.values()) - min(per_weight.values()) <= max(
        costs[tenant] / weights[tenant] for tenant in costs)
    assert min(per_weight.values()) > 100  # (every tenant was served all along)


def test_tenants_not_listed_have_the_default_weight() -> None:
    costs = {"listed": 1.0, "other": 1.0}
    turns = Counter(serve(FairSharePolicy({"listed": 1.0}, default_weight=3.0), costs, 800))
    assert turns["other"] == pytest.approx(600, abs=1)
    assert turns["listed"] == pytest.approx(200, abs=1)
    # Without weights, tenants are equal (what a "fair" pool did before weights).
    turns = Counter(serve(FairSharePolicy(), costs, 800))
    assert turns["other"] == turns["listed"] == 400


def test_a_new_tenant_of_high_weight_gets_its_share_from_then_on_and_no_banked_credit(
        ) -> None:
    policy = FairSharePolicy({"vip": 10.0})
    serve(policy, {"old": 1.0}, 500)  # 500 s the vip tenant did not ask for
    order = serve_newcomer(policy, {"old": 1.0, "vip": 1.0}, 220, "vip", 1000)
    assert order.index("vip") <= 1  # served at once
    # Ten vip runs for each old one from its first request: no burst of vip runs for
    # the 500 s before it (with banked credit, old would wait for 5000 vip runs).
    assert order.count("old") == pytest.approx(20, abs=1)
    runs = [len(list(group)) for tenant, group in itertools.groupby(order) if tenant == "vip"]
    assert max(runs) <= 11


def test_a_forgotten_weighted_tenant_comes_back_with_its_weight() -> None:
    policy = FairSharePolicy({"gold": 2.0})
    policy.push(Request(tenant="gold"))
    assert policy.pop() is not None
    policy.charge("gold", 1.0)
    for i in range(200):  # one-off tenants: the idle gold tenant is swept
        policy.push(Request(tenant=f"once {i}"))
        request = policy.pop()
        assert request is not None
        policy.charge(request.tenant, 1.0)
    assert "gold" not in policy._tenants
    turns = Counter(serve(policy, {"gold": 1.0, "silver": 1.0}, 300))
    assert turns["gold"] == pytest.approx(200, abs=1)


@pytest.mark.parametrize("weight", [0, 0.0, -1, -0.5, math.nan, math.inf, -math.inf, "2",
                                    True, None, 10**400])
def test_a_weight_that_is_not_a_finite_number_above_0_is_refused(weight: Any) -> None:
    with pytest.raises(ValueError, match=r"^the weight of tenant 'alice': .*: expected a "
                                         r"finite number > 0 \(a share of device time"):
        FairSharePolicy({"bob": 2.0, "alice": weight})
    with pytest.raises(ValueError, match=r"^default_weight: .*: expected a finite number > 0"):
        FairSharePolicy(default_weight=weight)


def test_weights_name_tenants_by_str() -> None:
    with pytest.raises(TypeError, match=r"tenant 7 \(int\) in weights: expected a str"):
        FairSharePolicy({7: 2.0})  # type: ignore[dict-item]
    assert FairSharePolicy({"a": 2, "": np.float64(0.5)}).weight("") == 0.5


def test_a_pools_policy_name_makes_its_policy_and_only_a_fair_one_takes_weights() -> None:
    fair = policy_for("fair", {"gold": 3.0})
    assert isinstance(fair, FairSharePolicy)
    assert (fair.weight("gold"), fair.weight("other")) == (3.0, 1.0)
    assert isinstance(policy_for("priority", {"gold": 3.0}), PriorityDeadlinePolicy)
    with pytest.raises(KeyError):
        policy_for("lottery")


def write_config(tmp_path: Path, tenants: str, policy: str = "fair") -> Path:
    path = tmp_path / "wasinn.toml"
    path.write_text(f'[pools.cpu]\nkind = "cpu"\ndevices = ["cpu"]\npolicy = "{policy}"\n'
                    f"{tenants}")
    return path


def test_tenants_weights_load_from_toml_any_name_the_untagged_one_included(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write_config(tmp_path, '[tenants.alice]\nweight = 2\n[tenants.""]\n'
                                  'weight = 0.5\n[tenants."team b/eu"]\nweight = 1.5\n')
    with caplog.at_level(logging.WARNING, logger="wasinn.configs"):
        config = load_config(path)
    assert config.tenant_weights == {"alice": 2.0, "": 0.5, "team b/eu": 1.5}
    assert caplog.records == []  # a fair pool uses them
    assert load_config(write_config(tmp_path, "")).tenant_weights == {}


@pytest.mark.parametrize("value", ["0", "-1", '"x"', '"2"', "nan", "inf", "true", "[2]"])
def test_a_bad_tenant_weight_names_the_file_the_key_and_what_was_expected(
        tmp_path: Path, value: str) -> None:
    path = write_config(tmp_path, f'[tenants."a b"]\nweight = {value}\n')
    with pytest.raises(ConfigError, match=rf'^{path}: tenants\."a b"\.weight: .*expected a '
                                          r"finite number > 0"):
        load_config(path)


@pytest.mark.parametrize(("tenants", "message"), [
    ("[tenants.alice]\nweight = 2\nshare = 3\n",
     r"tenants\.alice\.share: unknown key: expected one of weight$"),
    ("[tenants.alice]\nwieght = 2\n",
     r"tenants\.alice\.weight: required, and missing; tenants\.alice\.wieght: unknown key: "
     r"did you mean weight\? expected one of weight$"),
    ("[tenants]\nalice = 2\n", r"tenants\.alice: expected a table"),
])
def test_a_tenant_table_takes_its_weight_only(tmp_path: Path, tenants: str,
                                              message: str) -> None:
    path = write_config(tmp_path, tenants)
    with pytest.raises(ConfigError, match=rf"^{path}: {message}"):
        load_config(path)


def test_weights_with_no_fair_pool_are_warned_about_not_refused(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write_config(tmp_path, '[tenants.alice]\nweight = 2\n[tenants.""]\nweight = 3\n',
                        policy="priority")
    with caplog.at_level(logging.WARNING, logger="wasinn.configs"):
        config = load_config(path)
    assert config.tenant_weights == {"alice": 2.0, "": 3.0}
    (record,) = caplog.records
    assert record.getMessage() == (
        f'{path}: tenants: weights given (alice, ""), but no pool has policy = "fair" '
        "(pools: cpu (priority)), so none is used (weights share a fair pool's device time)")


def matmul_onnx(size: int) -> bytes:
    """``y = x @ w`` over f32 ``(n, size)``: runs of equal cost for equal inputs."""
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.eye(size, dtype=np.float32), "w")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", size])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", size])
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "matmul",
                              [x], [y], initializer=[w])
    return onnx_model_bytes(graph)


async def test_a_fair_pool_gives_a_weight_2_tenant_twice_the_device_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through a runtime from a TOML config, on ONNX Runtime: two tenants of equal
    requests queued behind a gated job; while both wait, gold (weight 2) gets twice the
    device time that silver (weight 1) gets, as its worker thread measured it."""
    require_backend("onnxruntime")
    charged: list[tuple[str, float]] = []
    charge = FairSharePolicy.charge

    def spy(self: FairSharePolicy, tenant: str, seconds: float) -> None:
        charged.append((tenant, seconds))  # (in a worker thread: list.append is atomic)
        charge(self, tenant, seconds)

    monkeypatch.setattr(FairSharePolicy, "charge", spy)
    path = write_config(tmp_path, "[tenants.gold]\nweight = 2\n")
    per_tenant = 40
    async with wasinn.Runtime.from_config(path) as rt:
        graph = await rt.load([matmul_onnx(256)], "onnx", options={"threads": 1})
        (actor,) = rt.actors
        x = np.ones((256, 256), np.float32)
        for _ in range(3):
            await graph.compute({"x": x})  # compiled and warm
        gate = threading.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(actor.execute, gate_job(gate), tenant="gate"))
            await trio.testing.wait_all_tasks_blocked()
            charged.clear()
            for _ in range(per_tenant):
                for tenant in ("gold", "silver"):
                    nursery.start_soon(functools.partial(graph.compute, {"x": x},
                                                         tenant=tenant))
            await trio.testing.wait_all_tasks_blocked()
            assert actor.queued == 2 * per_tenant
            gate.set()
    runs = [(tenant, seconds) for tenant, seconds in charged if tenant != "gate"]
    assert Counter(tenant for tenant, _ in runs) == {"gold": per_tenant, "silver": per_tenant}
    # While both waited: up to gold's last run (silver's other runs came after, alone).
    last = max(i for i, (tenant, _) in enumerate(runs) if tenant == "gold")
    both = runs[:last + 1]
    gold = sum(seconds for tenant, seconds in both if tenant == "gold")
    silver = sum(seconds for tenant, seconds in both if tenant == "silver")
    # Twice the device time, to within a run of each (however long a run took: a busy
    # machine may stall one): equal shares would leave gold / 2 - silver at -gold / 2.
    bound = (max(s for t, s in both if t == "gold") / 2
             + max(s for t, s in both if t == "silver"))
    assert abs(gold / 2 - silver) <= bound + 1e-9
