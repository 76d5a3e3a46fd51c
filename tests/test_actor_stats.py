"""DeviceActor.stats() and Runtime.stats(): every request counted once, by how it ended,
whichever path ran it; latencies end to end, queueing included, and split into the time
queued for a worker slot, the time running and the time delivering its result."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import trio
import trio.testing

from tests.example_configs import example_config
from tests.support import cpu_pool, require_backend, serving_actor
from wasinn import BackendRuntimeError, InvalidArgumentError, TimeoutError_, TooLargeError
from wasinn.actors import DeviceActor, DeviceStats
from wasinn.actors.stats import ModelStats, Outcome, RequestStats, percentile
from wasinn.backends.base import Device
from wasinn.enums import ExecutionTarget
from wasinn.modelgen import ModelFiles, affine_onnx, sample_image
from wasinn.scheduler import Runtime

CPU = Device(ExecutionTarget.CPU)


@pytest.fixture
async def actor() -> AsyncIterator[DeviceActor]:
    async with serving_actor(workers=1, queue_limit=1) as started:
        yield started


@contextlib.asynccontextmanager
async def slot_held(actor: DeviceActor) -> AsyncIterator[tuple[trio.Nursery, threading.Event]]:
    """A request holding the actor's only slot until the gate is set (on exit at the
    latest), and the nursery it runs in."""
    gate = threading.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor.execute, lambda: gate.wait(30))
        await trio.testing.wait_all_tasks_blocked()
        try:
            yield nursery, gate
        finally:
            gate.set()


def counts(stats: DeviceStats) -> dict[str, int]:
    return {"completed": stats.completed, "failed": stats.failed,
            "timed_out": stats.timed_out, "cancelled": stats.cancelled,
            "rejected": stats.rejected}


def boom() -> None:
    raise RuntimeError("library exploded")


async def test_a_fresh_actor_has_done_nothing(actor: DeviceActor) -> None:
    stats = actor.stats()
    assert stats.device == "cpu" and stats.workers == 1 and stats.queue_limit == 1
    assert (stats.running, stats.queued, stats.graphs, stats.compiles) == (0, 0, 0, 0)
    assert stats.finished == 0 and stats.latency_window == 0
    assert stats.latency_p50 is None and stats.latency_p99 is None
    assert (stats.queued_p50, stats.running_p99, stats.delivering_p50) == (None, None, None)
    assert "latency" not in stats.describe()


async def test_every_outcome_of_a_worker_thread_request_is_counted(
        actor: DeviceActor) -> None:
    for value in range(3):
        assert await actor.execute(lambda v=value: v) == value  # type: ignore[misc]
    with pytest.raises(BackendRuntimeError):
        await actor.execute(boom)

    async with slot_held(actor) as (nursery, gate):
        with trio.CancelScope() as queued:  # waits in the queue, then its caller gives up
            nursery.start_soon(_cancel_when_blocked, queued)
            await actor.execute(lambda: None)
        assert queued.cancelled_caught
        with pytest.raises(TimeoutError_):  # waits in the queue past its deadline
            await actor.execute(lambda: None, deadline=trio.current_time() + 0.05)
        nursery.start_soon(actor.execute, lambda: None)  # fills the queue (limit 1)
        await trio.testing.wait_all_tasks_blocked()
        now = actor.stats()
        assert (now.running, now.queued) == (1, 1)
        with pytest.raises(TooLargeError, match="queue is full"):
            await actor.execute(lambda: None)
        await trio.sleep(0.05)  # the queued request waits at least this long
        gate.set()

    stats = actor.stats()
    assert counts(stats) == {"completed": 5, "failed": 1, "timed_out": 1, "cancelled": 1,
                             "rejected": 1}
    assert stats.finished == 9 and stats.in_caller_thread == 0
    assert (stats.running, stats.queued) == (0, 0)
    # Latencies of the 5 completed requests: the gated one and the one queued behind it
    # took longer than the 0.05 s they were held.
    assert stats.latency_window == 5
    assert stats.latency_p50 is not None and stats.latency_p99 is not None
    assert 0 < stats.latency_p50 <= stats.latency_p99
    assert stats.latency_p99 >= 0.05
    # Split: the gated request ran for the 0.05 s, the one behind it queued for them.
    assert stats.queued_p99 is not None and stats.running_p99 is not None
    assert stats.queued_p99 >= 0.05 and stats.running_p99 >= 0.05
    assert stats.queued_p50 is not None and stats.running_p50 is not None
    assert stats.queued_p50 <= stats.queued_p99 and stats.running_p50 <= stats.running_p99
    assert "queued p50" in stats.describe() and "running p50" in stats.describe()


async def _cancel_when_blocked(scope: trio.CancelScope) -> None:
    await trio.testing.wait_all_tasks_blocked()
    scope.cancel()


async def test_requests_run_by_a_lease_holder_are_counted_too(actor: DeviceActor) -> None:
    def in_thread() -> None:
        done = actor.try_lease(lambda: "ran")
        assert done is not None and done.run() == "ran"
        failing = actor.try_lease(boom)
        assert failing is not None
        with pytest.raises(BackendRuntimeError, match="library exploded"):
            failing.run()
        unused = actor.try_lease(lambda: "never")
        assert unused is not None
        unused.cancel()

    await trio.to_thread.run_sync(in_thread)
    held = await actor.lease(lambda: "through trio")
    assert await trio.to_thread.run_sync(held.run) == "through trio"

    stats = actor.stats()
    assert counts(stats) == {"completed": 2, "failed": 1, "timed_out": 0, "cancelled": 1,
                             "rejected": 0}
    # Run in the holder's thread, whatever the outcome: not the one cancelled unrun.
    assert stats.in_caller_thread == 3 and stats.latency_window == 2
    assert stats.running == 0
    # Run in the caller's own thread: no result to hand back, nothing delivering.
    assert (stats.delivering_p50, stats.delivering_p99) == (0.0, 0.0)


async def test_a_lease_that_waited_for_its_slot_is_counted_as_queued(
        actor: DeviceActor) -> None:
    async with slot_held(actor) as (nursery, gate):
        nursery.start_soon(_open_gate_after, gate, 0.05)
        held = await actor.lease(lambda: "after the gate")  # queued until the gate opens
        assert await trio.to_thread.run_sync(held.run) == "after the gate"
    stats = actor.stats()
    assert (stats.completed, stats.in_caller_thread) == (2, 1)
    # The lease queued >= 0.05 s and ran briefly; the gated request the other way round.
    assert stats.queued_p99 is not None and stats.queued_p99 >= 0.05
    assert stats.running_p99 is not None and stats.running_p99 >= 0.05
    assert stats.queued_p50 is not None and stats.queued_p50 < 0.05


async def _open_gate_after(gate: threading.Event, seconds: float) -> None:
    await trio.sleep(seconds)
    gate.set()


async def test_a_lease_whose_deadline_passes_in_the_queue_is_timed_out(
        actor: DeviceActor) -> None:
    async with slot_held(actor):
        with pytest.raises(TimeoutError_):
            await actor.lease(lambda: None, deadline=trio.current_time() + 0.05)
    stats = actor.stats()
    # It never ran, in the caller's thread or any other.
    assert (stats.timed_out, stats.in_caller_thread, stats.completed) == (1, 0, 1)


async def test_leases_ended_before_their_run_started_are_not_counted_as_run(
        actor: DeviceActor) -> None:
    def in_thread() -> None:
        for _ in range(3):
            unused = actor.try_lease(lambda: "never")
            assert unused is not None
            unused.cancel()
        stopped = actor.try_lease(lambda: "never")
        assert stopped is not None
        stopped.interrupt()  # its caller gave up before the run started
        with pytest.raises(BackendRuntimeError, match="interrupted before it ran"):
            stopped.run()

    await trio.to_thread.run_sync(in_thread)
    stats = actor.stats()
    assert (stats.cancelled, stats.in_caller_thread, stats.completed) == (4, 0, 0)
    assert "(0 in the caller's thread)" in stats.describe()


def test_the_three_phases_add_up_to_the_latency() -> None:
    requests = RequestStats()
    requests.record(Outcome.COMPLETED, 10.0, queued=2.0, delivering=3.0, share=0.5)
    requests.record(Outcome.FAILED, 7.0, queued=7.0)  # no latency, no running time
    figures = ModelStats.of("m", requests)
    assert (figures.latency_p50, figures.queued_p50, figures.running_p50,
            figures.delivering_p99) == (10.0, 2.0, 5.0, 3.0)
    assert figures.running_seconds == 2.5  # its share of the 5 s running, not delivering
    assert ("latency p50 10000.00 ms p99 10000.00 ms: queued p50 2000.00 ms p99 2000.00 ms, "
            "running p50 5000.00 ms p99 5000.00 ms, delivering p50 3000.00 ms p99 "
            "3000.00 ms (last 1)") in figures.describe()


async def test_a_requests_phases_add_up_to_its_latency_on_each_path() -> None:
    require_backend("onnxruntime")
    x = {"x": np.ones((1, 4), np.float32)}
    async with Runtime(cpu_pool(workers=1)) as rt:
        threaded = await rt.load([affine_onnx()], "onnx", backend="onnxruntime", name="t")
        leased = await rt.load([affine_onnx()], "onnx", backend="onnxruntime", name="l")
        await threaded.compute(x)  # in a worker thread
        ctx = leased.init_execution_context()
        await trio.to_thread.run_sync(ctx.compute_in_caller_thread, x)
        figures = {s.name: s for s in rt.model_stats()}
    for name in ("t", "l"):  # one request each: its own phases
        stats = figures[name]
        assert stats.latency_window == 1, name
        phases = (stats.queued_p50, stats.running_p50, stats.delivering_p50)
        assert all(phase is not None and phase >= 0 for phase in phases), (name, phases)
        assert sum(phases) == pytest.approx(stats.latency_p50, abs=1e-12), (name, phases)
    assert figures["l"].in_caller_thread == 1 and figures["l"].delivering_p50 == 0.0


def test_a_latency_window_must_hold_something() -> None:
    with pytest.raises(ValueError, match="window must be >= 1"):
        RequestStats(window=0)


def test_percentile_is_nearest_rank() -> None:
    ordered = [float(v) for v in range(1, 101)]
    assert percentile(ordered, 0.5) == 50.0
    assert percentile(ordered, 0.99) == 99.0
    assert percentile(ordered, 1.0) == 100.0
    assert percentile([0.25], 0.99) == 0.25
    assert percentile([1.0, 2.0, 3.0], 0.5) == 2.0
    assert percentile([], 0.5) is None


async def test_runtime_stats_cover_each_device_and_its_graphs() -> None:
    require_backend("onnxruntime")
    async with Runtime(cpu_pool(workers=2)) as rt:
        graph = await rt.load([affine_onnx()], "onnx", backend="onnxruntime")
        ctx = graph.init_execution_context()
        for _ in range(5):
            await ctx.compute({"x": np.ones((1, 4), np.float32)})
        with pytest.raises(InvalidArgumentError, match="the model expects"):
            await ctx.compute({"x": np.ones((1, 5), np.float32)})
        (stats,) = rt.stats()
    assert stats.device == "cpu" and stats.workers == 2
    assert (stats.graphs, stats.compiles) == (1, 1)
    assert (stats.completed, stats.failed) == (5, 1)


async def test_each_model_counts_its_own_requests_on_every_path() -> None:
    require_backend("onnxruntime")
    x = {"x": np.ones((1, 4), np.float32)}
    async with Runtime(cpu_pool(workers=2)) as rt:
        a = await rt.load([affine_onnx()], "onnx", backend="onnxruntime", name="a")
        b = await rt.load([affine_onnx(scale=3.0)], "onnx", backend="onnxruntime", name="b")
        ctx = a.init_execution_context()
        for _ in range(4):
            await ctx.compute(x)
        await a.compute(x)  # one-shot, no context
        with pytest.raises(InvalidArgumentError, match="the model expects"):
            await ctx.compute({"x": np.ones((1, 5), np.float32)})
        other = b.init_execution_context()
        for _ in range(2):  # from a thread of the caller's own: a lease
            await trio.to_thread.run_sync(other.compute_in_caller_thread, x)
        await other.compute(x)
        stats_a, stats_b = a.stats(), b.stats()
        (device,) = rt.stats()
    assert (stats_a.name, stats_a.completed, stats_a.failed, stats_a.in_caller_thread) == (
        "a", 5, 1, 0)
    assert (stats_b.name, stats_b.completed, stats_b.failed, stats_b.in_caller_thread) == (
        "b", 3, 0, 2)
    assert stats_a.latency_window == 5 and stats_b.latency_window == 3
    assert stats_b.running_p99 is not None and stats_b.queued_p50 is not None
    assert stats_a.describe().startswith("a: 5 completed, 1 failed, ")
    # The device saw both models' requests.
    assert (device.completed, device.failed, device.in_caller_thread) == (8, 1, 2)


async def test_a_pipeline_counts_its_requests_in_its_steps_too_not_warm_ups(
        tmp_path: Path, small_mobilenet: ModelFiles) -> None:
    require_backend("onnxruntime")
    config = example_config("pipeline.toml", tmp_path, small_mobilenet)
    async with Runtime.from_config(config) as rt:
        # mobilenet is preloaded with 2 warm-up runs: not requests.
        assert [(s.name, s.finished) for s in rt.model_stats()] == [("mobilenet", 0)]
        classify = await rt.load_by_name("classify")
        for _ in range(3):
            await classify.compute({"x": sample_image(0)})
        mobilenet = await rt.load_by_name("mobilenet")
        await mobilenet.compute({"input": sample_image(0)})
        by_name = {s.name: s for s in rt.model_stats()}
        assert classify.stats() == by_name["classify"]
        assert mobilenet.stats() == by_name["mobilenet"]  # a handle sees its step runs too
        (device,) = rt.stats()
    assert list(by_name) == ["scale", "mobilenet", "classify"]  # the registry's order
    assert by_name["classify"].completed == 3
    # As an inference server counts an ensemble's composing models: each step counts the
    # pipeline's requests (mobilenet: and the one asked of it directly), each with its
    # run's time; the device counted each request once.
    assert (by_name["scale"].completed, by_name["scale"].finished) == (3, 3)
    assert (by_name["mobilenet"].completed, by_name["mobilenet"].finished) == (4, 4)
    assert (by_name["scale"].latency_window, by_name["mobilenet"].latency_window) == (3, 4)
    assert by_name["scale"].running_seconds > 0 and by_name["scale"].queued_p99 == 0.0
    assert (device.completed, device.finished) == (4, 4)
