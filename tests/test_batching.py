"""Dynamic batching on a real ONNX Runtime graph: requests queued on a busy device merge
into one run and each gets its own rows back; shapes, tenants and priorities that must not
share a run do not; a bad request fails alone; cancellation, deadlines and closing reach
every member; guests' leases, configs and pipelines batch too."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import wasinn
from tests.backend_models import affine, scalar_onnx
from tests.support import closed_while_running, cpu_pool
from wasinn import Batching, ClosedResourceError, InvalidArgumentError, TimeoutError_
from wasinn.actors import DeviceActor
from wasinn.configs.loader import parse_config
from wasinn.modelgen import affine_onnx
from wasinn.tensor import as_tensor


def gather_onnx() -> bytes:
    """``y = table[idx]`` over ``idx: i64[n, 1]``: an index past the table's 4 entries
    makes ONNX Runtime fail the run, whatever the other rows hold."""
    from onnx import TensorProto, helper, numpy_helper

    table = numpy_helper.from_array(np.array([10, 20, 30, 40], np.float32), "table")
    node = helper.make_node("Gather", ["table", "idx"], ["y"], axis=0)
    idx = helper.make_tensor_value_info("idx", TensorProto.INT64, ["n", 1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 1])
    graph = helper.make_graph([node], "gather", [idx], [y], initializer=[table])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


def first_row_onnx() -> bytes:
    """``y = x[0:1]``, declared with a variable first dimension but always one row:
    outputs that cannot be split by request."""
    from onnx import TensorProto, helper, numpy_helper

    bounds = [numpy_helper.from_array(np.array([v], np.int64), name)
              for name, v in (("starts", 0), ("ends", 1), ("axes", 0))]
    node = helper.make_node("Slice", ["x", "starts", "ends", "axes"], ["y"])
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", 4])
    graph = helper.make_graph([node], "first_row", [x], [y], initializer=bounds)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


def rows(value: float, count: int = 1) -> np.ndarray[Any, Any]:
    return np.full((count, 4), value, np.float32)


@pytest.fixture
async def rt() -> AsyncIterator[wasinn.Runtime]:
    async with wasinn.Runtime(cpu_pool(workers=1)) as runtime:
        yield runtime


def only_actor(rt: wasinn.Runtime) -> DeviceActor:
    (actor,) = rt.actors
    return actor


@contextlib.asynccontextmanager
async def device_busy(actor: DeviceActor) -> AsyncIterator[trio.Nursery]:
    """The device's only slot held by another request until the block ends; the nursery
    to start requests in (they queue behind it, and run once the block is left)."""
    gate = threading.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(functools.partial(actor.execute, lambda: gate.wait(30)))
        await trio.testing.wait_all_tasks_blocked()
        try:
            yield nursery
            await trio.testing.wait_all_tasks_blocked()
        finally:
            gate.set()


def run_sizes(rt: wasinn.Runtime, graph: wasinn.Graph) -> list[int]:
    """Record the row count of every run of ``graph``'s compiled ONNX Runtime graph."""
    session = only_actor(rt).cached_session(graph._executable.id)  # type: ignore[attr-defined]
    assert session is not None
    compiled = session.compiled
    sizes: list[int] = []
    real_run = compiled.run

    def counting_run(inputs: Any, **kwargs: Any) -> dict[str, wasinn.Tensor]:
        sizes.append(as_tensor(next(iter(inputs.values()))).dims[0])
        return real_run(inputs, **kwargs)

    compiled.run = counting_run  # type: ignore[method-assign]
    return sizes


async def compute_into(graph: wasinn.Graph, inputs: dict[str, Any],
                       results: dict[Any, Any], key: Any, **kwargs: Any) -> None:
    try:
        results[key] = (await graph.compute(inputs, **kwargs))["y"].numpy()
    except wasinn.WasiNNError as exc:
        results[key] = exc


async def test_requests_queued_on_a_busy_device_run_as_one_batch(rt: wasinn.Runtime) -> None:
    graph = await rt.load([affine_onnx()], "onnx", batching=Batching(max_batch=8))
    sizes = run_sizes(rt, graph)
    results: dict[Any, Any] = {}
    async with device_busy(only_actor(rt)) as nursery:
        for i in range(5):
            nursery.start_soon(compute_into, graph, {"x": rows(i, 1 + i % 2)}, results, i)
        await trio.testing.wait_all_tasks_blocked()
        assert only_actor(rt).stats().queued == 5  # waiting members, not batches
    assert sizes == [7]  # 1 + 2 + 1 + 2 + 1 rows, one run
    for i in range(5):
        np.testing.assert_allclose(results[i], 2 * rows(i, 1 + i % 2) + 1)
    stats = graph.stats()
    assert (stats.completed, stats.batches, stats.batched) == (5, 1, 5)
    assert only_actor(rt).stats().batches == 1
    assert "5 in 1 merged batch(es) (mean 5.0)" in stats.describe()


async def test_an_idle_device_runs_a_request_at_once_without_a_batch(
        rt: wasinn.Runtime) -> None:
    graph = await rt.load([affine_onnx()], "onnx", batching=Batching(max_batch=8))
    sizes = run_sizes(rt, graph)
    for i in range(3):
        out = await graph.compute({"x": rows(i)})
        np.testing.assert_allclose(out["y"].numpy(), 2 * rows(i) + 1)
    assert sizes == [1, 1, 1]
    assert graph.stats().batches == 0


async def test_batches_hold_at_most_max_batch_rows(rt: wasinn.Runtime) -> None:
    graph = await rt.load([affine_onnx()], "onnx", batching=Batching(max_batch=4))
    sizes = run_sizes(rt, graph)
    results: dict[Any, Any] = {}
    async with device_busy(only_actor(rt)) as nursery:
        for i in range(10):
            nursery.start_soon(compute_into, graph, {"x": rows(i)}, results, i)
        nursery.start_soon(compute_into, graph, {"x": rows(99, 6)}, results, "big")
    assert sorted(sizes) == [2, 4, 4, 6]  # the 6-row request is a batch of its own
    assert max(size for size in sizes if size != 6) <= 4
    for i in range(10):
        np.testing.assert_allclose(results[i], 2 * rows(i) + 1)
    np.testing.assert_allclose(results["big"], 2 * rows(99, 6) + 1)
    assert (graph.stats().batches, graph.stats().batched) == (3, 10)


async def test_only_matching_requests_share_a_run(rt: wasinn.Runtime) -> None:
    graph = await rt.load([affine_onnx()], "onnx", batching=Batching(max_batch=16))
    other = await rt.load([affine_onnx(scale=3.0)], "onnx", batching=Batching(max_batch=16))
    sizes = run_sizes(rt, graph)
    other_sizes = run_sizes(rt, other)
    results: dict[Any, Any] = {}
    async with device_busy(only_actor(rt)) as nursery:
        for i in range(2):
            nursery.start_soon(compute_into, graph, {"x": rows(i)}, results, ("a", i))
            nursery.start_soon(compute_into, other, {"x": rows(i)}, results, ("other", i))
            # another tenant's requests share a run of their own
            nursery.start_soon(functools.partial(compute_into, graph, {"x": rows(10 + i)},
                                                 results, ("t", i), tenant="t"))
    assert sorted(sizes) == [2, 2] and other_sizes == [2]
    for i in range(2):
        np.testing.assert_allclose(results[("a", i)], 2 * rows(i) + 1)
        np.testing.assert_allclose(results[("other", i)], 3 * rows(i) + 1)
        np.testing.assert_allclose(results[("t", i)], 2 * rows(10 + i) + 1)


async def test_device_resident_inputs_are_not_batched(rt: wasinn.Runtime) -> None:
    graph = await rt.load([affine_onnx()], "onnx", batching=Batching(max_batch=8))
    native = (await graph.compute({"x": rows(1)}, keep_on_device=True))["y"]
    assert not native.is_host
    sizes = run_sizes(rt, graph)
    results: dict[Any, Any] = {}
    async with device_busy(only_actor(rt)) as nursery:
        nursery.start_soon(compute_into, graph, {"x": native}, results, "native")
        nursery.start_soon(compute_into, graph, {"x": rows(2)}, results, "host")
        nursery.start_soon(compute_into, graph, {"x": rows(3)}, results, "host2")
    assert sorted(sizes) == [1, 2]
    np.testing.assert_allclose(results["native"], 2 * (2 * rows(1) + 1) + 1)


@pytest.mark.parametrize(("backend", "native_on_device"),
                         [("pytorch", True), ("openvino", True), ("onnxruntime", False)])
async def test_merged_outputs_stay_on_the_device_where_the_backend_cuts_them(
        rt: wasinn.Runtime, backend: str, native_on_device: bool) -> None:
    # torch and OpenVINO values are cut into rows in place (views); an OrtValue cannot
    # be, so its members get views of one host copy. A member that asked for host
    # outputs gets host rows either way.
    builders, encoding = affine(backend, 2.0, 1.0)
    graph = await rt.load(builders, encoding, backend=backend, batching=Batching(max_batch=8))
    (out,) = [spec.name for spec in graph.outputs]
    sizes = run_sizes(rt, graph)
    results: dict[Any, wasinn.Tensor] = {}

    async def call(key: Any, inputs: np.ndarray[Any, Any], keep: bool) -> None:
        results[key] = (await graph.compute({"x": inputs}, keep_on_device=keep))[out]

    copies = wasinn.host_copies()
    async with device_busy(only_actor(rt)) as nursery:
        for i in range(3):
            nursery.start_soon(call, i, rows(i, 1 + i), True)
        nursery.start_soon(call, "host", rows(7, 2), False)
    # 1 + 2 + 3 + 2 rows, one run; a torch.export program does not name its batch
    # dimension, so its first merged run is checked against its 1-row member alone.
    assert sizes == ([8, 1] if backend == "pytorch" else [8])
    assert results["host"].is_host
    kept = [results[i] for i in range(3)]
    assert [t.dims for t in kept] == [(1, 4), (2, 4), (3, 4)]
    if native_on_device:
        assert all(t.native is not None and t.device == "cpu" for t in kept), kept
        assert wasinn.host_copies() - copies == 1  # the host member's rows, once
    else:
        assert all(t.is_host for t in kept)
        assert wasinn.host_copies() - copies == 1  # one copy shared by every member
    for i, tensor in enumerate(kept):
        np.testing.assert_allclose(tensor.numpy(), 2 * rows(i, 1 + i) + 1)
    np.testing.assert_allclose(results["host"].numpy(), 2 * rows(7, 2) + 1)
    if native_on_device:  # the rows still chain into another compute without a copy
        again = (await graph.compute({"x": kept[2]}, keep_on_device=True))[out]
        np.testing.assert_allclose(again.numpy(), 2 * (2 * rows(2, 3) + 1) + 1)


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
async def test_a_merged_gpu_run_hands_out_rows_on_the_gpu() -> None:
    config = parse_config({"pools": {"gpu": {"kind": "gpu", "devices": ["gpu:0"],
                                             "workers": 1, "backends": ["pytorch"]}}}, None)
    async with wasinn.Runtime(config) as rt:
        builders, encoding = affine("pytorch", 2.0, 1.0)
        graph = await rt.load(builders, encoding, target="gpu",
                              batching=Batching(max_batch=8))
        sizes = run_sizes(rt, graph)
        results: dict[int, wasinn.Tensor] = {}

        async def call(i: int) -> None:
            results[i] = (await graph.compute({"x": rows(i, 1 + i)}))["output"]

        copies = wasinn.host_copies()
        async with device_busy(only_actor(rt)) as nursery:
            for i in range(3):
                nursery.start_soon(call, i)
        assert sizes == [6, 1]  # and the probe of the first merged run (see above)
        assert all(results[i].device == "gpu:0" and not results[i].is_host
                   for i in range(3))
        assert wasinn.host_copies() == copies
        for i in range(3):
            np.testing.assert_allclose(results[i].numpy(), 2 * rows(i, 1 + i) + 1)


async def test_a_higher_priority_request_does_not_wait_in_a_lower_batch(
        rt: wasinn.Runtime) -> None:
    graph = await rt.load([affine_onnx()], "onnx", batching=Batching(max_batch=8))
    order: list[str] = []

    async def call(name: str, priority: int) -> None:
        await graph.compute({"x": rows(1)}, priority=priority)
        order.append(name)

    async with device_busy(only_actor(rt)) as nursery:
        nursery.start_soon(call, "low", 0)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(call, "low2", 0)
        nursery.start_soon(call, "high", 5)
    assert order.index("high") < order.index("low")
    assert (graph.stats().batches, graph.stats().batched) == (1, 2)


async def test_a_batch_whose_most_urgent_member_left_moves_back_in_the_queue(
        rt: wasinn.Runtime) -> None:
    # Before: the batch kept its opener's priority (and deadline) after the opener left,
    # so a priority-0 member overtook a priority-5 request queued before it.
    graph = await rt.load([affine_onnx()], "onnx", batching=Batching(max_batch=8))
    plain = await rt.load([affine_onnx()], "onnx")  # never batched: no batch to join
    order: list[str] = []
    opener = trio.CancelScope()

    async def call(name: str, priority: int, scope: trio.CancelScope | None = None,
                   g: wasinn.Graph = graph) -> None:
        with scope or trio.CancelScope():
            await g.compute({"x": rows(1)}, priority=priority)
            order.append(name)

    async with device_busy(only_actor(rt)) as nursery:
        nursery.start_soon(functools.partial(call, "plain 5", 5, g=plain))
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(call, "opener 10", 10, opener)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(call, "member 0", 0)
        await trio.testing.wait_all_tasks_blocked()
        opener.cancel()
    assert order == ["plain 5", "member 0"]


async def test_a_batch_whose_earliest_deadline_left_moves_back_in_the_queue(
        rt: wasinn.Runtime) -> None:
    graph = await rt.load([affine_onnx()], "onnx", batching=Batching(max_batch=8))
    plain = await rt.load([affine_onnx()], "onnx")
    order: list[str] = []

    async def call(name: str, g: wasinn.Graph = graph, **terms: Any) -> None:
        with contextlib.suppress(TimeoutError_):
            await g.compute({"x": rows(1)}, **terms)
            order.append(name)

    async with device_busy(only_actor(rt)) as nursery:
        nursery.start_soon(functools.partial(call, "due in 30 s", plain, timeout=30))
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(functools.partial(call, "opener", timeout=0.05))
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(call, "member without a deadline")
        await trio.sleep(0.2)  # the opener times out
    assert order == ["due in 30 s", "member without a deadline"]


async def test_numpy_integer_priorities_order_as_their_values(rt: wasinn.Runtime) -> None:
    # Before: -np.uint8(10) wrapped around to 246, so the highest priority ran last.
    graph = await rt.load([affine_onnx()], "onnx")
    order: list[str] = []

    async def call(name: str, priority: Any) -> None:
        await graph.compute({"x": rows(1)}, priority=priority)
        order.append(name)

    async with device_busy(only_actor(rt)) as nursery:
        for name, priority in (("5", 5), ("uint8 10", np.uint8(10)), ("7", 7),
                               ("uint64 6", np.uint64(6))):
            nursery.start_soon(call, name, priority)
            await trio.testing.wait_all_tasks_blocked()
    assert order == ["uint8 10", "7", "uint64 6", "5"]


async def test_a_failing_request_fails_alone(rt: wasinn.Runtime,
                                             caplog: pytest.LogCaptureFixture) -> None:
    graph = await rt.load([gather_onnx()], "onnx", batching=Batching(max_batch=8))
    results: dict[Any, Any] = {}
    async with device_busy(only_actor(rt)) as nursery:
        for i in (0, 7, 2, 3):  # 7 is past the table's end
            nursery.start_soon(compute_into, graph, {"idx": np.array([[i]], np.int64)},
                               results, i)
    assert isinstance(results[7], wasinn.BackendRuntimeError)
    assert "onnxruntime" in str(results[7])
    for i, want in ((0, 10.0), (2, 30.0), (3, 40.0)):
        np.testing.assert_array_equal(results[i], [[want]])
    stats = graph.stats()
    assert (stats.completed, stats.failed, stats.batches) == (3, 1, 0)


async def test_outputs_that_cannot_be_split_run_one_by_one(
        rt: wasinn.Runtime, caplog: pytest.LogCaptureFixture) -> None:
    graph = await rt.load([first_row_onnx()], "onnx", batching=Batching(max_batch=8))
    results: dict[Any, Any] = {}
    with caplog.at_level(logging.WARNING, logger="wasinn.actors"):
        async with device_busy(only_actor(rt)) as nursery:
            for i in range(3):
                nursery.start_soon(compute_into, graph, {"x": rows(i + 1, 2)}, results, i)
    for i in range(3):
        np.testing.assert_allclose(results[i], rows(i + 1))  # each request's own first row
    assert graph.stats().batches == 0
    assert "cannot batch" in caplog.text and "not 6 rows" in caplog.text


async def test_a_member_cancelled_while_queued_leaves_its_batch(rt: wasinn.Runtime) -> None:
    graph = await rt.load([affine_onnx()], "onnx", batching=Batching(max_batch=8))
    sizes = run_sizes(rt, graph)
    results: dict[Any, Any] = {}
    actor = only_actor(rt)
    scopes: list[trio.CancelScope] = []
    async with device_busy(actor) as nursery:
        nursery.start_soon(compute_into, graph, {"x": rows(1)}, results, "stays")
        nursery.start_soon(cancellable, scopes, graph, rows(2))
        await trio.testing.wait_all_tasks_blocked()
        assert actor.stats().queued == 2
        scopes[0].cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert actor.stats().queued == 1
    assert sizes == [1]
    np.testing.assert_allclose(results["stays"], 2 * rows(1) + 1)
    assert graph.stats().cancelled == 1


async def test_a_batch_everyone_left_leaves_the_queue(rt: wasinn.Runtime) -> None:
    graph = await rt.load([affine_onnx()], "onnx", batching=Batching(max_batch=8))
    sizes = run_sizes(rt, graph)
    actor = only_actor(rt)
    scopes: list[trio.CancelScope] = []
    async with device_busy(actor) as nursery:
        for i in range(3):
            nursery.start_soon(cancellable, scopes, graph, rows(i))
        await trio.testing.wait_all_tasks_blocked()
        assert actor.stats().queued == 3
        for scope in scopes:
            scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert actor.stats().queued == 0
    assert sizes == []
    # The slot the batch never used is free: the next request runs.
    np.testing.assert_allclose((await graph.compute({"x": rows(5)}))["y"].numpy(),
                               2 * rows(5) + 1)
    assert actor.stats().running == 0 and graph.stats().cancelled == 3


async def test_batched_counts_only_the_members_a_merged_run_answered(
        rt: wasinn.Runtime) -> None:
    # Before: members cancelled while the merged run ran were counted as batched too.
    graph = await rt.load([affine_onnx()], "onnx", batching=Batching(max_batch=8))
    session = only_actor(rt).cached_session(graph._executable.id)  # type: ignore[attr-defined]
    assert session is not None
    compiled = session.compiled
    real_run, in_run, go_on = compiled.run, threading.Event(), threading.Event()

    def slow_merged_run(inputs: Any, **kwargs: Any) -> dict[str, wasinn.Tensor]:
        in_run.set()
        go_on.wait(30)
        return real_run(inputs, **kwargs)

    compiled.run = slow_merged_run  # type: ignore[method-assign]
    scopes: list[trio.CancelScope] = []
    results: dict[Any, Any] = {}
    gate = threading.Event()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(only_actor(rt).execute,
                                                 lambda: gate.wait(30)))
            await trio.testing.wait_all_tasks_blocked()
            for i in range(2):
                nursery.start_soon(cancellable, scopes, graph, rows(i))
            nursery.start_soon(compute_into, graph, {"x": rows(2)}, results, "stays")
            await trio.testing.wait_all_tasks_blocked()
            gate.set()
            await trio.to_thread.run_sync(in_run.wait)  # the merged run of all three
            for scope in scopes:
                scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
            go_on.set()
    np.testing.assert_allclose(results["stays"], 2 * rows(2) + 1)
    stats = graph.stats()
    assert (stats.completed, stats.cancelled, stats.batches, stats.batched) == (1, 2, 1, 1)


async def cancellable(scopes: list[trio.CancelScope], graph: wasinn.Graph,
                      x: np.ndarray[Any, Any]) -> None:
    """``graph.compute`` under a cancel scope of its own, added to ``scopes``."""
    with trio.CancelScope() as scope:
        scopes.append(scope)
        await graph.compute({"x": x})


async def test_a_member_past_its_deadline_times_out_and_the_rest_run(
        rt: wasinn.Runtime) -> None:
    graph = await rt.load([affine_onnx()], "onnx", batching=Batching(max_batch=8))
    results: dict[Any, Any] = {}
    async with device_busy(only_actor(rt)) as nursery:
        nursery.start_soon(compute_into, graph, {"x": rows(1)}, results, "patient")
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(functools.partial(compute_into, graph, {"x": rows(2)}, results,
                                             "hurried", timeout=0.05))
        await trio.sleep(0.2)
        assert isinstance(results["hurried"], TimeoutError_)
    np.testing.assert_allclose(results["patient"], 2 * rows(1) + 1)
    assert (graph.stats().timed_out, graph.stats().completed) == (1, 1)


async def test_closing_the_runtime_fails_waiting_members() -> None:
    results: dict[Any, Any] = {}
    gate = threading.Event()
    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        graph = await rt.load([affine_onnx()], "onnx", batching=Batching(max_batch=8))
        actor = only_actor(rt)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(closed_while_running, actor, lambda: gate.wait(30))
            await trio.testing.wait_all_tasks_blocked()
            for i in range(3):
                nursery.start_soon(compute_into, graph, {"x": rows(i)}, results, i)
            await trio.testing.wait_all_tasks_blocked()
            actor.close()
            gate.set()
    assert all(isinstance(results[i], ClosedResourceError) for i in range(3)), results


async def test_max_delay_gathers_requests_on_an_idle_device(rt: wasinn.Runtime) -> None:
    graph = await rt.load([affine_onnx()], "onnx",
                          batching=Batching(max_batch=8, max_delay=0.5))
    sizes = run_sizes(rt, graph)
    results: dict[Any, Any] = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(compute_into, graph, {"x": rows(1)}, results, 1)
        await trio.sleep(0.01)  # the device is idle: the first request waits for company
        nursery.start_soon(compute_into, graph, {"x": rows(2)}, results, 2)
    assert sizes == [2]
    np.testing.assert_allclose(results[2], 2 * rows(2) + 1)


async def test_max_delay_does_not_outlast_a_short_timeout(rt: wasinn.Runtime) -> None:
    # Before: the batch waited out max_delay, past the request's deadline, on an idle
    # device: a request with timeout < max_delay always timed out.
    graph = await rt.load([affine_onnx()], "onnx",
                          batching=Batching(max_batch=8, max_delay=2))
    with trio.fail_after(1):
        out = await graph.compute({"x": rows(1)}, timeout=0.4)
    np.testing.assert_allclose(out["y"].numpy(), 2 * rows(1) + 1)
    assert graph.stats().completed == 1


async def test_a_full_batch_does_not_wait_out_max_delay() -> None:
    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        graph = await rt.load([affine_onnx()], "onnx",
                              batching=Batching(max_batch=2, max_delay=10))
        results: dict[Any, Any] = {}
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                for i in range(2):
                    nursery.start_soon(compute_into, graph, {"x": rows(i)}, results, i)
        assert graph.stats().batches == 1


async def test_guests_threads_batch_through_their_leases(rt: wasinn.Runtime) -> None:
    graph = await rt.load([affine_onnx()], "onnx", batching=Batching(max_batch=8))
    sizes = run_sizes(rt, graph)
    contexts = [graph.init_execution_context() for _ in range(4)]
    results: dict[int, Any] = {}

    def guest(i: int) -> None:  # a guest's own thread, as wasinn.host runs guests
        results[i] = contexts[i].compute_in_caller_thread({"x": rows(i)}, keep_on_device=True)

    async with device_busy(only_actor(rt)) as nursery:
        for i in range(4):
            nursery.start_soon(functools.partial(trio.to_thread.run_sync, guest, i))
        await _wait_until(lambda: only_actor(rt).stats().queued == 4)
    assert sizes == [4]
    for i in range(4):
        np.testing.assert_allclose(results[i]["y"].numpy(), 2 * rows(i) + 1)
        np.testing.assert_allclose(contexts[i].get_output("y").numpy(), 2 * rows(i) + 1)


async def _wait_until(condition: Callable[[], bool]) -> None:
    with trio.fail_after(10):
        while not condition():
            await trio.sleep(0.005)


async def test_batching_needs_a_variable_first_dimension(rt: wasinn.Runtime) -> None:
    from onnx import TensorProto, helper

    node = helper.make_node("Identity", ["x"], ["y"])
    graph = helper.make_graph(
        [node], "fixed", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    with pytest.raises(InvalidArgumentError, match=r"input x: f32\[1, 4\] fixes it"):
        await rt.load([model.SerializeToString()], "onnx", batching=Batching(max_batch=4))
    # A scalar has no first dimension; a value of unknown rank may have one.
    with pytest.raises(InvalidArgumentError, match=r"input x: f32\[\] is a scalar"):
        await rt.load([scalar_onnx()], "onnx", batching=Batching(max_batch=4))
    graph = await rt.load([scalar_onnx(declared=False)], "onnx", batching=Batching(max_batch=4))
    out = await graph.compute({"x": np.ones((3, 2), np.float32)})
    assert out["y"].numpy().tolist() == [[2.0, 2.0]] * 3
    with pytest.raises(InvalidArgumentError, match=r"must be a wasinn\.Batching"):
        await rt.load([affine_onnx()], "onnx", batching=8)  # type: ignore[arg-type]


def plus_one_times_ten_onnx() -> bytes:
    """``y = x + 1`` and ``z = 10 x`` over f32 (n, 4)."""
    from onnx import TensorProto, helper

    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    ten = helper.make_tensor("ten", TensorProto.FLOAT, [1], [10.0])
    nodes = [helper.make_node("Add", ["x", "one"], ["y"]),
             helper.make_node("Mul", ["x", "ten"], ["z"])]
    x, y, z = (helper.make_tensor_value_info(n, TensorProto.FLOAT, ["n", 4]) for n in "xyz")
    graph = helper.make_graph(nodes, "two", [x], [y, z], initializer=[one, ten])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


async def test_pipelines_of_the_same_models_wired_differently_never_share_a_run(
        tmp_path: Any) -> None:
    (tmp_path / "two.onnx").write_bytes(plus_one_times_ten_onnx())
    (tmp_path / "ident.onnx").write_bytes(affine_onnx(scale=1.0, bias=0.0))
    config = parse_config({
        "pools": {"cpu": {"kind": "cpu", "devices": ["cpu"], "workers": 1}},
        "models": {"two": {"files": ["two.onnx"]}, "ident": {"files": ["ident.onnx"]}},
        "pipelines": {
            name: {"steps": [{"model": "two"}, {"model": "ident", "wire": {wired: "x"}}],
                   "batching": {"max_batch": 8}}
            for name, wired in (("plus_one", "y"), ("times_ten", "z"))},
    }, tmp_path / "wasinn.toml")
    async with wasinn.Runtime(config) as rt:
        plus_one = await rt.load_by_name("plus_one")
        times_ten = await rt.load_by_name("times_ten")
        results: dict[Any, Any] = {}
        async with device_busy(only_actor(rt)) as nursery:
            for i in range(2):
                nursery.start_soon(compute_into, plus_one, {"x": rows(3)}, results, ("+", i))
                nursery.start_soon(compute_into, times_ten, {"x": rows(3)}, results, ("*", i))
        for i in range(2):
            np.testing.assert_allclose(results[("+", i)], rows(4))
            np.testing.assert_allclose(results[("*", i)], rows(30))
        assert (plus_one.stats().batches, plus_one.stats().batched) == (1, 2)
        assert (times_ten.stats().batches, times_ten.stats().batched) == (1, 2)


async def test_a_registry_model_and_pipeline_batch_as_configured(tmp_path: Any) -> None:
    (tmp_path / "affine.onnx").write_bytes(affine_onnx())
    (tmp_path / "triple.onnx").write_bytes(affine_onnx(scale=3.0, bias=0.0))
    config = parse_config({
        "pools": {"cpu": {"kind": "cpu", "devices": ["cpu"], "workers": 1}},
        "models": {
            "affine": {"files": ["affine.onnx"],
                       "batching": {"max_batch": 8, "max_delay_ms": 1}},
            "triple": {"files": ["triple.onnx"]},
        },
        "pipelines": {"chain": {"steps": [{"model": "affine"}, {"model": "triple"}],
                                "batching": {"max_batch": 4}}},
    }, tmp_path / "wasinn.toml")
    async with wasinn.Runtime(config) as rt:
        affine = await rt.load_by_name("affine")
        chain = await rt.load_by_name("chain")
        results: dict[Any, Any] = {}
        async with device_busy(only_actor(rt)) as nursery:
            for i in range(3):
                nursery.start_soon(compute_into, affine, {"x": rows(i)}, results, ("a", i))
                nursery.start_soon(compute_into, chain, {"x": rows(i)}, results, ("c", i))
        for i in range(3):
            np.testing.assert_allclose(results[("a", i)], 2 * rows(i) + 1)
            np.testing.assert_allclose(results[("c", i)], 3 * (2 * rows(i) + 1))
        assert (chain.stats().batches, chain.stats().batched) == (1, 3)
        # affine's own merged run, and the chain's through it (a step counts its runs for
        # the pipeline too: see wasinn.scheduler.pipeline.StepsAccount)
        assert (affine.stats().batches, affine.stats().batched) == (2, 6)


def test_config_errors_name_the_batching_key(tmp_path: Any) -> None:
    with pytest.raises(wasinn.ConfigError, match=r"models\.m\.batching\.max_batch"):
        parse_config({"models": {"m": {"files": ["m.onnx"], "batching": {"max_batch": 1}}}},
                     tmp_path / "wasinn.toml")
    with pytest.raises(wasinn.ConfigError, match=r"models\.m\.batching\.max_delay"):
        parse_config({"models": {"m": {"files": ["m.onnx"],
                                       "batching": {"max_batch": 2, "max_delay": 5}}}},
                     tmp_path / "wasinn.toml")


@pytest.mark.parametrize(("workers", "policy"), [(1, "priority"), (2, "fair")])
async def test_a_storm_of_cancellations_leaves_no_request_or_slot_behind(
        workers: int, policy: str) -> None:
    # Many callers of three tenants, some cancelled at random moments (queued, gathering
    # or running), some with deadlines: every caller that finished got its own rows, and
    # afterwards the device holds nothing: no queued request, no slot, no batch.
    async with wasinn.Runtime(cpu_pool(workers=workers, policy=policy)) as rt:
        await _storm(rt)


async def _storm(rt: wasinn.Runtime) -> None:
    graph = await rt.load([affine_onnx()], "onnx",
                          batching=Batching(max_batch=4, max_delay=0.002))
    actor = only_actor(rt)
    rng = np.random.default_rng(7)
    finished: list[tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]] = []

    async def caller(i: int, give_up: float | None, timeout: float | None) -> None:
        x = rows(i, 1 + i % 3)
        with trio.move_on_after(give_up if give_up is not None else math.inf):
            try:
                out = await graph.compute({"x": x}, timeout=timeout, tenant=f"t{i % 3}")
            except TimeoutError_:
                return
            finished.append((x, out["y"].numpy()))

    async with trio.open_nursery() as nursery:
        for i in range(300):
            give_up = float(rng.uniform(0, 0.004)) if rng.random() < 0.3 else None
            timeout = float(rng.uniform(0.001, 0.01)) if rng.random() < 0.2 else None
            nursery.start_soon(caller, i, give_up, timeout)
            if i % 10 == 0:
                await trio.sleep(float(rng.uniform(0, 0.002)))
    for x, y in finished:
        np.testing.assert_allclose(y, 2 * x + 1)
    assert finished, "no caller finished"
    with trio.fail_after(10):
        while actor.threads.busy:  # abandoned runs finishing in the worker thread
            await trio.sleep(0.01)
    stats = actor.stats()
    assert (stats.running, stats.queued, actor.load) == (0, 0, 0)
    assert stats.finished == 300 and stats.batches > 0
    np.testing.assert_allclose((await graph.compute({"x": rows(1)}))["y"].numpy(),
                               2 * rows(1) + 1)


# -- the actor's batching edges, with a plain run function ---------------------------------
def _plus_one(ran: list[str]) -> Callable[[Any, bool], dict[str, wasinn.Tensor]]:
    def run(inputs: Any, keep: bool) -> dict[str, wasinn.Tensor]:
        ran.append("run")
        return {"y": wasinn.Tensor.from_numpy(as_tensor(inputs["x"]).numpy() + 1)}

    return run


async def test_a_request_past_its_deadline_never_starts_on_an_idle_device() -> None:
    from tests.support import serving_actor
    from wasinn.actors.batching import BatchInputs

    ran: list[str] = []
    inputs = BatchInputs.of({"x": rows(1)})
    assert inputs is not None
    async with serving_actor(workers=1) as actor:
        with pytest.raises(TimeoutError_):
            await actor.execute_batched("g", inputs, _plus_one(ran), Batching(max_batch=8),
                                        deadline=trio.current_time() - 1)
        assert (ran, actor.stats().running) == ([], 0)


async def test_a_batch_gathering_when_the_device_closes_gives_its_slot_back() -> None:
    from tests.support import serving_actor
    from wasinn.actors.batching import BatchInputs

    ran: list[str] = []
    inputs = BatchInputs.of({"x": rows(1)})
    assert inputs is not None
    async with serving_actor(workers=1) as actor:
        async with trio.open_nursery() as nursery:
            async def member() -> None:
                with pytest.raises(ClosedResourceError):
                    await actor.execute_batched("g", inputs, _plus_one(ran),
                                                Batching(max_batch=8, max_delay=5.0))

            nursery.start_soon(member)
            await trio.testing.wait_all_tasks_blocked()
            assert actor.stats().running == 1  # held while the batch waits for company
            actor.close()
        assert (ran, actor.stats().running) == ([], 0)


class _QueueFigures(trio.abc.Instrument):
    """Reads a device's queued count and load after every task step."""

    def __init__(self, actor: DeviceActor) -> None:
        self.actor = actor
        self.lowest = 0

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        self.lowest = min(self.lowest, self.actor.stats().queued,
                          self.actor.load - self.actor.stats().running)


async def test_a_batch_granted_a_slot_as_its_member_leaves_is_never_counted_below_zero(
) -> None:
    """The slot a long run frees goes to a queued batch (its worker thread passes it on),
    and its only member is cancelled in the trio step that takes the run's result: until
    the batch's task resumes, the batch has left the queue and has no member, and the
    device's queued count (and the load placement compares) must not go negative."""
    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        (actor,) = rt.actors
        graph = await rt.load([affine_onnx()], batching=Batching(max_batch=4))
        figures = _QueueFigures(actor)
        trio.lowlevel.add_instrument(figures)
        # A hang here is a bug in the device (a slot or a waiter lost): fail naming its
        # state rather than hold the run for ever.
        hang = trio.move_on_after(120)
        try:
            with hang:
                await _grant_as_members_leave(actor, graph, 20)
            assert not hang.cancelled_caught, (
                f"hung: {actor.stats()}, busy {actor.busy}, lowest {figures.lowest}")
        finally:
            trio.lowlevel.remove_instrument(figures)
        assert figures.lowest == 0
        with trio.fail_after(5):  # the last batch's task gives its slot back
            while actor.stats().running:
                await trio.sleep(0.01)
        stats = actor.stats()
        assert (stats.queued, stats.completed, stats.cancelled) == (0, 20, 20)


async def _grant_as_members_leave(actor: DeviceActor, graph: wasinn.Graph, rounds: int
                                  ) -> None:
    # Each round: a run holding the only slot ends once the batch is queued behind it, and
    # the batch's only member leaves in the step that takes its result (the batch's task,
    # granted the slot by the run's thread, resumes before or after it: either is fine,
    # and trio picks at random). The run is held by a gate, not timed: a run timed to
    # outlast the member's start (an ONNX Loop, before) could end before an event loop
    # stalled on a loaded machine saw it start, and the round then polled for ever for a
    # busy device that had come and gone (the test's one CI hang: a loop stalled for
    # 0.3 s once the run was out reproduced it every time).
    for _ in range(rounds):
        member_scope = trio.CancelScope()
        gate = threading.Event()

        async def long_run(scope: trio.CancelScope = member_scope,
                           gate: threading.Event = gate) -> None:
            await actor.execute(lambda: gate.wait(30))  # frees the slot for the batch
            scope.cancel()  # ...whose only member leaves

        async def member(scope: trio.CancelScope = member_scope) -> None:
            with scope:
                await graph.compute({"x": np.ones((1, 4), np.float32)})

        # The last round's batch may still hold the slot: its task resumed before its
        # member left, started it, and the run, abandoned, ends in its thread.
        with trio.fail_after(30):
            while actor.stats().running:
                await trio.sleep(0.001)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(long_run)
            await trio.testing.wait_all_tasks_blocked()  # the run holds the only slot
            nursery.start_soon(member)
            await trio.testing.wait_all_tasks_blocked()
            assert (actor.stats().running, actor.stats().queued) == (1, 1)  # batch queued
            gate.set()
