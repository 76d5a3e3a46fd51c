"""Dynamic batching at its edges, on real ONNX Runtime graphs: what one window may mix
(shapes, element types, key styles, device-resident values, terms), outputs bound to
buffers, runs that all fail, members that leave while their batch runs, a context
closed or the runtime closed under a waiting batch, and ``max_delay`` in trio's time."""

from __future__ import annotations

import functools
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import wasinn
from tests.support import cpu_pool
from tests.test_batching import (
    compute_into,
    device_busy,
    first_row_onnx,
    only_actor,
    run_sizes,
)
from wasinn import Batching, ClosedResourceError, TimeoutError_
from wasinn.actors import DeviceActor
from wasinn.modelgen import affine_onnx, onnx_model_bytes
from wasinn.tensor import as_tensor

#: A compiled graph's run: (inputs, keep_on_device=...) -> outputs.
RunFn = Callable[..., dict[str, wasinn.Tensor]]


def rows(value: float, count: int = 1, width: int = 4) -> np.ndarray[Any, Any]:
    return np.full((count, width), value, np.float32)


@pytest.fixture
async def rt() -> AsyncIterator[wasinn.Runtime]:
    """A runtime with one CPU worker."""
    async with wasinn.Runtime(cpu_pool(workers=1)) as runtime:
        yield runtime


def sum_and_difference_onnx() -> bytes:
    """``s = a + b`` and ``d = a - b`` over f32 ``(n, k)``: two inputs, two outputs."""
    from onnx import TensorProto, helper

    values = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["n", "k"]) for n in "absd"]
    nodes = [helper.make_node("Add", ["a", "b"], ["s"]), helper.make_node("Sub", ["a", "b"], ["d"])]
    return onnx_model_bytes(helper.make_graph(nodes, "sum_diff", values[:2], values[2:]))


def wrap_runs(actor: DeviceActor, graph: wasinn.Graph,
              wrapper: Callable[[RunFn], RunFn]) -> Callable[[], None]:
    """Every run of ``graph``'s compiled graph on ``actor`` goes through
    ``wrapper(the real run)`` until the returned function is called."""
    session = actor.cached_session(graph._executable.id)  # type: ignore[attr-defined]
    assert session is not None
    compiled = session.compiled
    real_run = compiled.run
    compiled.run = wrapper(real_run)  # type: ignore[method-assign]
    return functools.partial(setattr, compiled, "run", real_run)


async def loaded(rt: wasinn.Runtime, model: bytes, max_batch: int = 8
                 ) -> tuple[wasinn.Graph, DeviceActor, list[int]]:
    """``model`` (ONNX) loaded with batching, the runtime's only device, and the row count
    of each of its runs there from now on (see run_sizes)."""
    graph = await rt.load([model], "onnx", batching=Batching(max_batch=max_batch))
    return graph, only_actor(rt), run_sizes(rt, graph)


async def outcome_of(results: dict[Any, Any], key: Any, call: Any) -> None:
    """``results[key]``: what ``await call()`` returned, or the WasiNNError it raised."""
    try:
        results[key] = await call()
    except wasinn.WasiNNError as exc:
        results[key] = exc


# -- what one window may hold ------------------------------------------------------------------
async def test_a_window_of_mixed_shapes_types_and_keys_is_never_concatenated_wrongly(
        rt: wasinn.Runtime) -> None:
    graph, actor, sizes = await loaded(rt, sum_and_difference_onnx(), max_batch=16)
    cases: dict[str, dict[Any, Any]] = {
        # Only requests with the same keys, in the same order, with the same element types
        # and the same dimensions after the first, may share a run: positions are the
        # names they stand for (resolved before the request reaches the device).
        "k4 names": {"a": rows(1, 2), "b": rows(10, 2)},
        "k4 names again": {"a": rows(2, 1), "b": rows(20, 1)},
        "k3 names": {"a": rows(3, 1, 3), "b": rows(30, 1, 3)},
        "k4 reversed": {"b": rows(40, 1), "a": rows(4, 1)},
        "k4 positions": {0: rows(5, 3), 1: rows(50, 3)},
        "k4 positions again": {0: rows(6, 1), 1: rows(60, 1)},
        # A wrong element type fails alone, and so do first dimensions that differ (the
        # model names both n: they must agree), never merged with others.
        "f64": {"a": rows(7).astype(np.float64), "b": rows(70).astype(np.float64)},
        "ragged": {"a": rows(8, 2), "b": rows(80, 1)},
        "ragged again": {"a": rows(9, 2), "b": rows(90, 1)},
    }
    results: dict[str, Any] = {}
    async with device_busy(actor) as nursery:
        for name, inputs in cases.items():
            nursery.start_soon(outcome_of, results, name,
                               functools.partial(graph.compute, inputs))
    for name, inputs in cases.items():
        a, b = (inputs["a"], inputs["b"]) if "a" in inputs else (inputs[0], inputs[1])
        if name == "f64" or name.startswith("ragged"):
            assert isinstance(results[name], wasinn.InvalidArgumentError), results[name]
            continue
        np.testing.assert_array_equal(results[name]["s"].numpy(), a + b, err_msg=name)
        np.testing.assert_array_equal(results[name]["d"].numpy(), a - b, err_msg=name)
    # One merged run (names 2 + 1 rows and positions 3 + 1, in the same order); every
    # other request alone.
    assert sorted(sizes) == sorted([7, 1, 1, 1, 2, 2]), sizes
    assert (graph.stats().batches, graph.stats().batched) == (1, 4)


async def test_device_resident_inputs_run_alone_and_read_ones_batch(rt: wasinn.Runtime) -> None:
    graph, actor, sizes = await loaded(rt, affine_onnx())
    kept = [(await graph.compute({"x": rows(i)}, keep_on_device=True))["y"] for i in range(3)]
    del sizes[:]  # those three ran alone: count from here
    assert not any(t.is_host for t in kept)
    read = kept[2]
    read.numpy()  # now it has host data too: it batches like any host tensor
    results: dict[Any, Any] = {}
    async with device_busy(actor) as nursery:
        for i, tensor in enumerate(kept):
            nursery.start_soon(outcome_of, results, i,
                               functools.partial(graph.compute, {"x": tensor}))
        nursery.start_soon(outcome_of, results, "host",
                           functools.partial(graph.compute, {"x": rows(9)}))
    assert sorted(sizes) == [1, 1, 2]  # the two native values alone, read + host merged
    for i in range(3):
        np.testing.assert_allclose(results[i]["y"].numpy(), 2 * (2 * rows(i) + 1) + 1)
    np.testing.assert_allclose(results["host"]["y"].numpy(), 2 * rows(9) + 1)


async def test_lower_priority_and_later_deadline_requests_ride_along_with_their_rows(
        rt: wasinn.Runtime) -> None:
    graph, actor, sizes = await loaded(rt, affine_onnx())
    terms: dict[str, dict[str, Any]] = {
        "opener": {"priority": 5, "timeout": 60},
        "lower": {"priority": 1},             # joins: served no later than alone
        "later deadline": {"timeout": 120},   # joins too
        "higher": {"priority": 9},            # its own batch, run first
        "other tenant": {"priority": 5, "tenant": "t"},
    }
    order: list[str] = []
    results: dict[str, np.ndarray[Any, Any]] = {}

    async def call(name: str, value: float) -> None:
        out = await graph.compute({"x": rows(value, 2)}, **terms[name])
        results[name] = out["y"].numpy()
        order.append(name)

    async with device_busy(actor) as nursery:
        for value, name in enumerate(terms):
            nursery.start_soon(call, name, float(value))
            await trio.testing.wait_all_tasks_blocked()
    for value, name in enumerate(terms):
        np.testing.assert_allclose(results[name], 2 * rows(value, 2) + 1, err_msg=name)
    assert order[0] == "higher" and set(order[1:4]) == {"opener", "lower", "later deadline"}
    assert sorted(sizes) == [2, 2, 6]


# -- outputs ---------------------------------------------------------------------------------
async def test_bound_buffers_of_batched_requests_each_get_their_own_rows(
        rt: wasinn.Runtime) -> None:
    graph, actor, sizes = await loaded(rt, sum_and_difference_onnx())
    contexts = [graph.init_execution_context() for _ in range(4)]
    typed = [np.zeros((1 + i, 4), np.float32) for i in range(3)]
    raw = bytearray(64)  # a guest's byte buffer, larger than the output
    for ctx, buffer in zip(contexts, typed, strict=False):
        ctx.set_output("d", buffer)
    contexts[3].set_output("s", raw)
    wrong = np.zeros((5, 4), np.float32)  # not the output's shape: that request fails alone
    contexts[2].set_output("s", wrong)
    results: dict[int, Any] = {}
    async with device_busy(actor) as nursery:
        for i, ctx in enumerate(contexts):
            ctx.set_input("a", rows(i, 1 + i % 3))
            ctx.set_input("b", rows(10 * i, 1 + i % 3))
            nursery.start_soon(outcome_of, results, i, ctx.run)
    assert sizes == [1 + 2 + 3 + 1]  # one merged run
    for i in (0, 1):
        np.testing.assert_array_equal(typed[i], rows(i, 1 + i) - rows(10 * i, 1 + i))
        np.testing.assert_array_equal(contexts[i].get_output("s").numpy(),
                                      rows(11 * i, 1 + i))
    assert isinstance(results[2], wasinn.InvalidArgumentError)
    assert not typed[2].any() and not wrong.any()  # a run that did not fit writes nothing
    np.testing.assert_array_equal(np.frombuffer(raw, np.float32)[:4], rows(33).ravel())
    assert not any(raw[16:])
    for ctx in contexts:
        ctx.close()


async def test_after_outputs_that_cannot_be_split_the_graphs_requests_run_alone(
        rt: wasinn.Runtime, caplog: pytest.LogCaptureFixture) -> None:
    # Before: every batch of such a model ran merged (its outputs thrown away), then each
    # request in turn in the batch's one job: n + 1 runs for n requests, for ever.
    graph, actor, sizes = await loaded(rt, first_row_onnx())
    results: dict[Any, Any] = {}
    for round_ in range(2):
        async with device_busy(actor) as nursery:
            for i in range(3):
                nursery.start_soon(compute_into, graph, {"x": rows(i + 1, 2)}, results,
                                   (round_, i))
            await trio.testing.wait_all_tasks_blocked()
            assert actor.stats().queued == 3
    assert sizes == [6, 2, 2, 2, 2, 2, 2]  # the second round: no merged run
    for (_, i), y in results.items():
        np.testing.assert_allclose(y, rows(i + 1))  # each request's own first row
    assert caplog.text.count("cannot batch") == 1
    assert (graph.stats().completed, graph.stats().batches) == (6, 0)
    assert (actor.stats().running, actor.stats().queued) == (0, 0)


async def test_each_runtime_and_each_load_warns_of_outputs_that_cannot_be_split(
        caplog: pytest.LogCaptureFixture) -> None:
    # Before: warned once a process for a label: a second runtime, or the model loaded
    # again under its name, fell back to one-by-one runs without a word.
    async def found_unsplittable(rt: wasinn.Runtime) -> None:
        graph = await rt.load([first_row_onnx()], "onnx", name="first_row",
                              batching=Batching(max_batch=8))
        actor, sizes = only_actor(rt), run_sizes(rt, graph)
        async with device_busy(actor) as nursery:
            for i in range(2):
                nursery.start_soon(graph.compute, {"x": rows(i + 1, 2)})
            await trio.testing.wait_all_tasks_blocked()
        assert sizes == [4, 2, 2]  # merged, thrown away, then one by one
        await graph.unload()

    for _ in range(2):
        async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
            await found_unsplittable(rt)
            await found_unsplittable(rt)  # loaded again: a graph of its own
    assert caplog.text.count("cannot batch") == 4


# -- failures and members that leave -----------------------------------------------------------
async def test_a_batch_whose_every_run_fails_fails_each_member_and_the_device_goes_on(
        rt: wasinn.Runtime) -> None:
    graph, actor, _ = await loaded(rt, affine_onnx())
    runs: list[int] = []

    def exploding(_real_run: RunFn) -> RunFn:
        def run(inputs: Any, **kwargs: Any) -> dict[str, wasinn.Tensor]:
            runs.append(as_tensor(inputs["x"]).dims[0])
            raise RuntimeError("the library exploded")

        return run

    undo = wrap_runs(actor, graph, exploding)
    results: dict[int, Any] = {}
    async with device_busy(actor) as nursery:
        for i in range(3):
            nursery.start_soon(outcome_of, results, i,
                               functools.partial(graph.compute, {"x": rows(i)}))
    assert runs == [3, 1, 1, 1]  # the merged run, then each request alone
    errors = [results[i] for i in range(3)]
    assert all(isinstance(e, wasinn.BackendRuntimeError) and "library exploded" in str(e)
               for e in errors), errors
    assert len({id(e) for e in errors}) == 3  # each caller raises an error of its own
    undo()
    out = await graph.compute({"x": rows(4)})
    np.testing.assert_allclose(out["y"].numpy(), 2 * rows(4) + 1)
    stats = graph.stats()
    assert (stats.failed, stats.completed, stats.batches) == (3, 1, 0)
    assert (actor.stats().running, actor.stats().queued) == (0, 0)


async def test_a_member_timing_out_while_its_batch_runs_leaves_the_others_their_rows(
        rt: wasinn.Runtime) -> None:
    graph, actor, _ = await loaded(rt, affine_onnx())
    in_run, go_on = threading.Event(), threading.Event()

    def held(real_run: RunFn) -> RunFn:
        def run(inputs: Any, **kwargs: Any) -> dict[str, wasinn.Tensor]:
            in_run.set()
            go_on.wait(30)
            return real_run(inputs, **kwargs)

        return run

    undo = wrap_runs(actor, graph, held)
    results: dict[Any, Any] = {}
    gate = threading.Event()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(actor.execute, lambda: gate.wait(30)))
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(outcome_of, results, "patient",
                               functools.partial(graph.compute, {"x": rows(1)}))
            nursery.start_soon(outcome_of, results, "hurried",
                               functools.partial(graph.compute, {"x": rows(2, 2)},
                                                 timeout=0.2))
            nursery.start_soon(outcome_of, results, "also patient",
                               functools.partial(graph.compute, {"x": rows(3, 3)}))
            await trio.testing.wait_all_tasks_blocked()
            gate.set()
            await trio.to_thread.run_sync(in_run.wait)  # the merged run of all three
            while "hurried" not in results:  # its timeout passes while the run is held
                await trio.sleep(0.05)
            go_on.set()
    assert isinstance(results["hurried"], TimeoutError_)
    np.testing.assert_allclose(results["patient"]["y"].numpy(), 2 * rows(1) + 1)
    np.testing.assert_allclose(results["also patient"]["y"].numpy(), 2 * rows(3, 3) + 1)
    stats = graph.stats()
    assert (stats.timed_out, stats.completed, stats.batches, stats.batched) == (1, 2, 1, 2)
    undo()


async def test_a_context_closed_while_its_request_waits_in_a_batch(rt: wasinn.Runtime) -> None:
    graph, actor, _ = await loaded(rt, affine_onnx())
    contexts = [graph.init_execution_context() for _ in range(3)]
    await graph.unload()  # the contexts hold the model now
    results: dict[int, Any] = {}
    async with device_busy(actor) as nursery:
        for i, ctx in enumerate(contexts):
            nursery.start_soon(outcome_of, results, i,
                               functools.partial(ctx.compute, {"x": rows(i)}))
        await trio.testing.wait_all_tasks_blocked()
        contexts[0].close()
    assert isinstance(results[0], ClosedResourceError)
    for i in (1, 2):
        np.testing.assert_allclose(results[i]["y"].numpy(), 2 * rows(i) + 1)
    assert actor.stats().graphs == 1
    for ctx in contexts[1:]:
        ctx.close()
    assert actor.stats().graphs == 0


async def test_closing_the_runtime_while_a_batch_gathers_fails_every_member() -> None:
    rt = wasinn.Runtime(cpu_pool(workers=1))
    await rt.start()
    actor = only_actor(rt)
    try:
        graph = await rt.load([affine_onnx()], "onnx",
                              batching=Batching(max_batch=8, max_delay=5.0))
        results: dict[int, Any] = {}
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(compute_into, graph, {"x": rows(i)}, results, i)
            await trio.testing.wait_all_tasks_blocked()
            assert actor.stats().running == 1  # held while it gathers for 5 s
            await rt.aclose()  # at once, not 5 s later
        assert all(isinstance(results[i], ClosedResourceError) for i in range(3)), results
        assert "closed" in str(results[0])
    finally:
        await rt.aclose()
    assert actor.stats().running == 0


# -- max_delay, in trio's time -------------------------------------------------------------------
async def runs_of(batching: Batching, arrivals: list[tuple[float, int]]
                  ) -> tuple[list[int], list[float]]:
    """Requests of ``rows`` rows made ``when`` seconds (trio time) after the first, each
    ``(when, rows)`` of ``arrivals``, on an idle runtime of one worker: the size of each
    run of the graph, and how long after the first arrival each request finished."""
    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        graph = await rt.load([affine_onnx()], "onnx", batching=batching)
        sizes = run_sizes(rt, graph)
        start = trio.current_time()
        finished: list[float] = []

        async def call_at(when: float, count: int) -> None:
            await trio.sleep_until(start + when)
            x = rows(when, count)
            np.testing.assert_allclose((await graph.compute({"x": x}))["y"].numpy(), 2 * x + 1)
            finished.append(trio.current_time() - start)

        async with trio.open_nursery() as nursery:
            for when, count in arrivals:
                nursery.start_soon(call_at, when, count)
        return sizes, finished


async def test_max_delay_gathers_for_that_long_from_the_first_request(
        autojump_clock: trio.testing.MockClock) -> None:
    # 0, 0.2 and 0.49 arrive within 0.5 s of the first; 0.6 opens the next batch, which
    # 0.7 joins.
    sizes, _ = await runs_of(Batching(max_batch=8, max_delay=0.5),
                             [(0.0, 1), (0.2, 1), (0.49, 1), (0.6, 1), (0.7, 1)])
    assert sizes == [3, 2]


async def test_a_batch_that_fills_up_runs_before_max_delay(
        autojump_clock: trio.testing.MockClock) -> None:
    sizes, finished = await runs_of(Batching(max_batch=3, max_delay=10), [(0.0, 1), (1.0, 2)])
    assert sizes == [3]
    assert finished == [1.0, 1.0]  # when the second made it full, not at 10 s


# A batch that holds the device's only slot while it waits for company must not keep other
# work waiting: once another request queues for the device, it runs with what it has
# (as Triton's dynamic batcher sends its batch when the next request cannot join it).

#: Real seconds the clock waits, idle, before it jumps, once the runs of a scenario are
#: under way: a run in a worker thread takes real time, which the clock must not skip
#: (at 0 it would jump to a request's deadline while the run before it is still going).
RUN_ALLOWANCE = 2.0


async def gather_then(clock: trio.testing.MockClock,
                      arrivals: list[tuple[float, str, dict[str, Any]]], *,
                      workers: int = 1, policy: str = "priority",
                      ) -> tuple[list[int], dict[str, Any]]:
    """On an idle runtime of ``workers`` workers, tenant alice's request ("opener") for a
    graph loaded with ``max_delay=5`` opens a batch at once; each of ``arrivals``
    ``(when, graph, compute's keyword arguments)`` is made ``when`` seconds (trio time)
    later, for that graph ("batched") or for another that does not batch ("other"). The
    size of each run of the batching graph, and for each request (named "opener" or by
    its index in ``arrivals``) when it finished (trio seconds after the first) or the
    WasiNNError it raised."""
    async with wasinn.Runtime(cpu_pool(workers=workers, policy=policy)) as rt:
        graphs = {
            "batched": await rt.load([affine_onnx()], "onnx",
                                     batching=Batching(max_batch=8, max_delay=5)),
            "other": await rt.load([affine_onnx(scale=3.0, bias=0.0)], "onnx"),
        }
        expected = {"batched": lambda x: 2 * x + 1, "other": lambda x: 3 * x}
        sizes = run_sizes(rt, graphs["batched"])
        start = trio.current_time()
        finished: dict[str, Any] = {}

        async def call_at(name: str, when: float, graph: str, kwargs: dict[str, Any]
                          ) -> None:
            await trio.sleep_until(start + when)
            if when == arrivals[-1][0]:
                clock.autojump_threshold = RUN_ALLOWANCE
            x = rows(when + 1)
            try:
                out = await graphs[graph].compute({"x": x}, **kwargs)
            except wasinn.WasiNNError as exc:
                finished[name] = exc
                return
            np.testing.assert_allclose(out["y"].numpy(), expected[graph](x))
            finished[name] = trio.current_time() - start

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call_at, "opener", 0.0, "batched", {"tenant": "alice"})
            for i, (when, graph, kwargs) in enumerate(arrivals):
                nursery.start_soon(call_at, str(i), when, graph, kwargs)
        return sizes, finished


@pytest.mark.parametrize(("policy", "kwargs"), [
    ("priority", {"priority": 5}),
    ("priority", {"timeout": 1}),
    ("fair", {"tenant": "carol"}),
], ids=["higher-priority", "short-timeout", "other-tenant-on-a-fair-pool"])
async def test_a_batch_waiting_for_company_runs_once_other_work_queues(
        autojump_clock: trio.testing.MockClock, policy: str, kwargs: dict[str, Any]) -> None:
    # Before: the other request waited behind the batch's idle slot for the whole 5 s
    # (and the one with timeout=1 timed out on an idle device).
    sizes, finished = await gather_then(autojump_clock, [(0.1, "other", kwargs)],
                                        policy=policy)
    assert sizes == [1]
    assert finished["opener"] < 1, finished
    assert finished["0"] < 1, finished


async def test_a_short_timeout_behind_a_waiting_batch_of_its_graph_does_not_time_out(
        autojump_clock: trio.testing.MockClock) -> None:
    # Its deadline keeps it out of the batch: it queues in a batch of its own, which ends
    # the first one's wait, and gathers for half the time left to its deadline.
    sizes, finished = await gather_then(autojump_clock, [(0.1, "batched", {"timeout": 1})])
    assert sizes == [1, 1]
    assert finished["opener"] < 1, finished
    assert finished["0"] < 1, finished


async def test_a_request_that_may_join_a_waiting_batch_joins_it(
        autojump_clock: trio.testing.MockClock) -> None:
    # The same graph and terms join the waiting batch (no queueing, no end to its wait);
    # the other graph's request then queues and the batch runs with both rows.
    sizes, finished = await gather_then(autojump_clock, [
        (0.05, "batched", {"tenant": "alice"}), (0.1, "other", {"priority": 5})])
    assert sizes == [2]
    assert max(finished.values()) < 1, finished


async def test_a_batch_waits_out_max_delay_while_other_work_finds_a_free_slot(
        autojump_clock: trio.testing.MockClock) -> None:
    # Two workers: the other graph's request takes the free one without queueing, so the
    # batch still waits for company, and the later request joins it.
    sizes, finished = await gather_then(autojump_clock, [
        (0.1, "other", {}), (0.2, "batched", {"tenant": "alice"})], workers=2)
    assert sizes == [2]
    assert finished["opener"] == finished["1"] == 5.0, finished


async def test_a_batch_granted_its_slot_with_others_queued_does_not_wait(
        autojump_clock: trio.testing.MockClock) -> None:
    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        batched = await rt.load([affine_onnx()], "onnx",
                                batching=Batching(max_batch=8, max_delay=5))
        other = await rt.load([affine_onnx(scale=3.0, bias=0.0)], "onnx")
        start = trio.current_time()
        results: dict[Any, Any] = {}
        async with device_busy(only_actor(rt)) as nursery:
            # Queued in this order behind the busy slot: the batch is granted it first.
            nursery.start_soon(compute_into, batched, {"x": rows(1)}, results, "batched")
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(compute_into, other, {"x": rows(2)}, results, "other")
            await trio.testing.wait_all_tasks_blocked()
            autojump_clock.autojump_threshold = RUN_ALLOWANCE
        assert trio.current_time() - start < 1
        np.testing.assert_allclose(results["batched"], 2 * rows(1) + 1)
        np.testing.assert_allclose(results["other"], 3 * rows(2))


async def test_one_queued_request_ends_one_waiting_batchs_wait_the_longest_idle(
        autojump_clock: trio.testing.MockClock) -> None:
    # Two workers, each held by a batch waiting for company (first: graph 1's). One
    # request for a third graph needs one slot: graph 1's batch gives its up, graph 2's
    # keeps waiting, and graph 2's later request joins it.
    async with wasinn.Runtime(cpu_pool(workers=2)) as rt:
        batching = Batching(max_batch=8, max_delay=5)
        first = await rt.load([affine_onnx()], "onnx", batching=batching)
        second = await rt.load([affine_onnx(scale=5.0, bias=0.0)], "onnx", batching=batching)
        other = await rt.load([affine_onnx(scale=3.0, bias=0.0)], "onnx")
        sizes = {"first": run_sizes(rt, first), "second": run_sizes(rt, second)}
        start = trio.current_time()
        finished: dict[str, float] = {}

        async def call_at(name: str, when: float, graph: wasinn.Graph) -> None:
            await trio.sleep_until(start + when)
            if name == "second, later":
                autojump_clock.autojump_threshold = RUN_ALLOWANCE
            await graph.compute({"x": rows(1)})
            finished[name] = trio.current_time() - start

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call_at, "first", 0.0, first)
            nursery.start_soon(call_at, "second", 0.05, second)
            nursery.start_soon(call_at, "other", 0.1, other)
            nursery.start_soon(call_at, "second, later", 0.2, second)
    assert sizes == {"first": [1], "second": [2]}
    assert finished["first"] < 1 and finished["other"] < 1, finished
    assert finished["second"] == finished["second, later"] == 5.05, finished
