"""Each tenant's requests, counted beside its model's on every path (a worker thread, a
lease holder's thread, a merged batch, a pipeline, a request that ends while its graph
compiles), and tenants' weights changed while the runtime serves."""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import trio
import trio.testing

import wasinn
from tests.fake_backend import FakeBackend
from tests.support import cpu_pool, require_backend
from tests.test_batching import device_busy
from tests.test_fair_policy import serve
from tests.test_pipeline_edges import three_steps
from tests.test_scheduler_routing import SLOW, fake_config
from wasinn import InvalidArgumentError, TimeoutError_
from wasinn.actors import FairSharePolicy, TenantStats
from wasinn.actors.queue import POLICIES
from wasinn.configs.loader import parse_config
from wasinn.modelgen import affine_onnx
from wasinn.scheduler.tenants import TenantLedger

X = np.ones((1, 4), np.float32)


def by_name(stats: list[TenantStats]) -> dict[str, TenantStats]:
    return {s.name: s for s in stats}


async def test_each_tenants_requests_are_counted_on_every_path() -> None:
    require_backend("onnxruntime")
    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        graph = await rt.load([affine_onnx()], "onnx", name="affine")
        for _ in range(3):
            await graph.compute({"x": X}, tenant="alice")
        with pytest.raises(InvalidArgumentError, match="the model expects"):
            await graph.compute({"x": np.ones((1, 5), np.float32)}, tenant="alice")
        ctx = graph.init_execution_context()
        await ctx.compute({"x": X}, tenant="bob")
        # Bob's thread runs the model itself: a lease taken from a free slot.
        await trio.to_thread.run_sync(
            functools.partial(ctx.compute_in_caller_thread, {"x": X}, tenant="bob"))
        await graph.compute({"x": X})  # no tenant named
        tenants = by_name(rt.tenant_stats())
        model = graph.stats()
    assert list(tenants) == ["alice", "bob", ""]  # the most recently active last
    alice, bob, untagged = tenants["alice"], tenants["bob"], tenants[""]
    assert (alice.completed, alice.failed, alice.in_caller_thread) == (3, 1, 0)
    assert (bob.completed, bob.failed, bob.in_caller_thread) == (2, 0, 1)
    assert (untagged.completed, untagged.failed) == (1, 0)
    # Counted in the model's stats as before, and once each.
    assert (model.completed, model.failed) == (6, 1)
    assert sum(t.completed for t in tenants.values()) == model.completed
    assert alice.latency_window == 3 and alice.running_p50 is not None
    # The device time each took: the running time of its completed requests.
    assert 0 < alice.running_seconds <= 3 * alice.latency_p99  # type: ignore[operator]
    assert alice.weight == 1.0
    assert alice.describe().startswith("tenant 'alice' (weight 1, ")
    assert "3 completed, 1 failed" in alice.describe()


async def test_a_merged_batch_and_a_pipeline_count_for_their_tenant(tmp_path: Path) -> None:
    require_backend("onnxruntime")
    config = three_steps(tmp_path, affine_onnx(1.0, 0.0))
    async with wasinn.Runtime(config) as rt:
        graph = await rt.load([affine_onnx()], "onnx", batching=wasinn.Batching(max_batch=8))
        await graph.compute({"x": X})  # compiled
        (actor,) = rt.actors
        async with device_busy(actor) as nursery:
            for rows in (1, 3, 2):
                nursery.start_soon(functools.partial(graph.compute, {"x": np.ones((rows, 4),
                                                                                  np.float32)},
                                                     tenant="batch"))
        pipeline = await rt.load_by_name("p")
        outputs = await pipeline.compute({"x": X}, tenant="chain")
        tenants = by_name(rt.tenant_stats())
    np.testing.assert_allclose(outputs["y"].numpy(), 3 * (2 * X + 1))
    batch = tenants["batch"]
    assert (batch.completed, batch.batches, batch.batched) == (3, 1, 3)
    # One merged run's device time, counted once: each request its rows' share of it (so
    # the sum lies within the members' running times, not at three times one of them).
    assert batch.running_seconds <= batch.running_p99  # type: ignore[operator]
    assert tenants["chain"].completed == 1  # one request, however many steps
    assert "batch" not in tenants["chain"].describe()


async def test_a_request_that_times_out_while_its_graph_compiles_counts_for_its_tenant(
        ) -> None:
    fake = FakeBackend()
    async with wasinn.Runtime(fake_config(gpu_devices=["gpu:0"]), backends=[fake]) as rt:
        graph = await rt.load(SLOW, "ggml", "cpu")
        ctx = graph.init_execution_context(target="gpu")  # compiled there on first use
        with trio.fail_after(5):  # (the compile would hold it 30 s)
            with pytest.raises(TimeoutError_, match=r"deadline passed while .* compiled"):
                await ctx.compute({"x": X}, timeout=0.1, tenant="late")
        fake.load_gate.set()
        late = by_name(rt.tenant_stats())["late"]
    assert (late.completed, late.timed_out) == (0, 1)


async def test_a_request_refused_before_it_is_counted_makes_no_tenant_appear() -> None:
    require_backend("onnxruntime")
    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        graph = await rt.load([affine_onnx()], "onnx")
        held = await graph.lease({"x": X}, tenant="holder")  # the only slot
        # A thread's try_lease finds it busy: no request, and no tenant with none.
        assert await trio.to_thread.run_sync(
            functools.partial(graph.try_lease, {"x": X}, tenant="ghost")) is None
        held.cancel()
        assert [s.name for s in rt.tenant_stats()] == ["holder"]


def test_the_ledger_forgets_the_least_recently_active_tenant_past_its_bound() -> None:
    ledger = TenantLedger(most=2)
    ledger.requests("a")
    ledger.requests("b")
    ledger.requests("a")  # a is now the most recent
    ledger.requests("c")
    assert [s.name for s in ledger.stats()] == ["a", "c"]
    assert ledger.forgotten == 1
    # In eighths: a stream of new names does not scan the ledger for each one.
    ledger = TenantLedger(most=16)
    for i in range(16):
        ledger.requests(f"t{i}")
    ledger.requests("t0")
    ledger.requests("new")
    names = [s.name for s in ledger.stats()]
    assert names == [f"t{i}" for i in range(4, 16)] + ["t0", "new"]
    assert ledger.forgotten == 3
    with pytest.raises(ValueError, match="most=0: expected at least 1 tenant"):
        TenantLedger(most=0)


def test_a_changed_weight_sets_the_shares_from_then_on() -> None:
    policy = FairSharePolicy()
    costs = {"a": 1.0, "b": 1.0}
    assert Counter(serve(policy, costs, 200)) == {"a": 100, "b": 100}
    policy.set_weight("a", 3.0)
    order = serve(policy, costs, 400)
    assert Counter(order) == {"a": 300, "b": 100}
    # From then on, not made up for: b is not starved for a burst of a's runs.
    assert max(len(run) for run in "".join(order).split("b")) <= 3
    assert policy.weight("a") == 3.0
    with pytest.raises(ValueError, match=r"^0: expected a finite number > 0"):
        policy.set_weight("a", 0)
    assert policy.weight("a") == 3.0


class MadePolicies(FairSharePolicy):
    made: ClassVar[list[MadePolicies]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        MadePolicies.made.append(self)


async def test_set_tenant_weight_reaches_every_fair_pool_before_and_after_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(MadePolicies, "made", [])
    monkeypatch.setitem(POLICIES, "fair", MadePolicies)
    config = parse_config({
        "pools": {"cpu": {"kind": "cpu", "devices": ["cpu"], "policy": "fair"}},
        "tenants": {"gold": {"weight": 2}},
    }, None)
    rt = wasinn.Runtime(config)
    assert rt.tenant_weight("gold") == 2.0 and rt.tenant_weight("other") == 1.0
    rt.set_tenant_weight("silver", 0.5)  # before the runtime starts
    async with rt:
        (policy,) = MadePolicies.made
        assert (policy.weight("gold"), policy.weight("silver")) == (2.0, 0.5)
        rt.set_tenant_weight("gold", 4)
        await trio.to_thread.run_sync(rt.set_tenant_weight, "bronze", 0.25)  # any thread
        assert (policy.weight("gold"), policy.weight("bronze")) == (4.0, 0.25)
        assert rt.tenant_weight("gold") == 4.0
        with pytest.raises(ValueError, match=r"^the weight of tenant 'gold': -1: expected a "
                                             r"finite number > 0"):
            rt.set_tenant_weight("gold", -1)
        with pytest.raises(TypeError, match=r"tenant 7 \(int\): expected a str"):
            rt.set_tenant_weight(7, 1.0)  # type: ignore[arg-type]
        assert policy.weight("gold") == 4.0  # a refused weight changes nothing
        graph = await rt.load([affine_onnx()], "onnx")
        await graph.compute({"x": X}, tenant="gold")
        (gold,) = rt.tenant_stats()
        assert (gold.name, gold.weight) == ("gold", 4.0)


def test_a_refused_tenant_weight_is_in_the_error_tree(tmp_path: Path) -> None:
    # The same bad values as a config's: invalid-argument (a WasiNNError), and still the
    # builtin error a caller may have caught before; the config keeps its ConfigError.
    rt = wasinn.Runtime(cpu_pool(policy="fair"))
    with pytest.raises(InvalidArgumentError, match=r"^the weight of tenant 'bob': 0\.0: ") as bad:
        rt.set_tenant_weight("bob", 0.0)
    assert isinstance(bad.value, ValueError)
    assert bad.value.code is wasinn.ErrorCode.INVALID_ARGUMENT
    with pytest.raises(InvalidArgumentError, match=r"^tenant 3 \(int\): expected a str") as bad:
        rt.set_tenant_weight(3, 1.0)  # type: ignore[arg-type]
    assert isinstance(bad.value, TypeError)
    assert rt.tenant_weight("bob") == 1.0  # a refused weight changes nothing
    path = tmp_path / "w0.toml"
    path.write_text("[tenants.bob]\nweight = 0\n")
    with pytest.raises(wasinn.ConfigError, match=r"w0\.toml.*tenants\.bob\.weight"):
        wasinn.Runtime.from_config(path)


async def test_a_priority_pool_takes_weights_without_using_them() -> None:
    async with wasinn.Runtime(cpu_pool(policy="priority")) as rt:
        rt.set_tenant_weight("gold", 2.0)
        assert rt.tenant_weight("gold") == 2.0
