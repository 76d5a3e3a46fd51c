"""``Graph.unload`` returns once the graph's compiled sessions are closed: after the runs
still using them (a lease, a compute queued or running) have ended, bounded by the
``close_timeout`` of the pools the graph is on; a cancelled unload has still unloaded;
an unload from the task holding a lease of the graph does not wait for it. And a lease
granted on a registry model's load that ends after the name was loaded again is counted
for the name.

Runs are held in flight with leases (a real ONNX Runtime graph, run by a thread when the
test says so) and a compute queued behind one (``workers = 1``); the bound is measured on
trio's autojump clock, beside a second pool (a fake GPU's) with a close_timeout of its
own."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import wasinn
from tests.fake_backend import FakeBackend
from tests.support import affine_pipeline_config, cpu_pool, require_backend
from tests.test_batching import compute_into, only_actor, run_sizes
from wasinn import Batching
from wasinn.actors.device import DeviceActor
from wasinn.backends._ort_graph import OrtGraph
from wasinn.configs.loader import parse_config
from wasinn.configs.schema import RuntimeConfig
from wasinn.errors import ClosedResourceError
from wasinn.modelgen import affine_onnx
from wasinn.scheduler._sessions import Sessions

X = np.ones((1, 4), np.float32)


@pytest.fixture
def closed(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[OrtGraph]]:
    """The ONNX Runtime graphs closed so far, in order."""
    require_backend("onnxruntime")
    seen: list[OrtGraph] = []
    close = OrtGraph.close

    def recording(self: OrtGraph) -> None:
        close(self)
        seen.append(self)

    monkeypatch.setattr(OrtGraph, "close", recording)
    yield seen


async def unload_in(nursery: trio.Nursery, graph: wasinn.Graph) -> trio.Event:
    """Unload ``graph`` in a task of its own (not the one holding its leases); the event
    is set once the unload has returned."""
    done = trio.Event()

    async def unload() -> None:
        await graph.unload()
        done.set()

    nursery.start_soon(unload)
    await trio.testing.wait_all_tasks_blocked()
    return done


async def test_unload_returns_once_a_lease_in_flight_has_run(closed: list[OrtGraph]) -> None:
    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        graph = await rt.load([affine_onnx(2.0, 1.0)], "onnx", name="affine")
        lease = await graph.lease({"x": X})
        async with trio.open_nursery() as nursery:
            unloaded = await unload_in(nursery, graph)
            assert not unloaded.is_set() and closed == []  # the lease holds the graph
            with pytest.raises(ClosedResourceError, match="affine was unloaded"):
                await graph.compute({"x": X})  # unusable from the start
            out = await trio.to_thread.run_sync(lease.run)
            await unloaded.wait()
            assert len(closed) == 1  # closed before unload returned
        assert out["y"].numpy().tolist() == [[3.0] * 4]


async def test_unload_waits_for_a_compute_queued_behind_a_lease(
        closed: list[OrtGraph]) -> None:
    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        graph = await rt.load([affine_onnx(2.0, 1.0)], "onnx", name="affine")
        lease = await graph.lease({"x": X})  # the device's one slot
        outputs: list[Any] = []
        async with trio.open_nursery() as nursery:

            async def compute() -> None:
                outputs.append(await graph.compute({"x": 2 * X}))

            nursery.start_soon(compute)
            await trio.testing.wait_all_tasks_blocked()
            assert rt.stats()[0].queued == 1
            unloaded = await unload_in(nursery, graph)
            assert not unloaded.is_set() and closed == []
            await trio.to_thread.run_sync(lease.run)
            await unloaded.wait()
            assert outputs and len(closed) == 1  # the compute ran, then the graph closed
        assert outputs[0]["y"].numpy().tolist() == [[5.0] * 4]
        assert graph.stats().completed == 2


async def test_a_cancelled_unload_has_unloaded_and_the_lease_frees_the_graph(
        closed: list[OrtGraph]) -> None:
    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        graph = await rt.load([affine_onnx(2.0, 1.0)], "onnx", name="affine")
        lease = await graph.lease({"x": X})
        scope = trio.CancelScope()
        caught: list[bool] = []
        async with trio.open_nursery() as nursery:

            async def unload() -> None:
                with scope:
                    await graph.unload()
                caught.append(scope.cancelled_caught)

            nursery.start_soon(unload)
            await trio.testing.wait_all_tasks_blocked()
            scope.cancel()
        assert caught == [True]  # it was waiting, and the cancellation reached it
        assert graph.unloaded and closed == []
        with pytest.raises(ClosedResourceError, match="affine was unloaded"):
            graph.init_execution_context()
        await trio.to_thread.run_sync(lease.run)
        assert len(closed) == 1  # the lease's run closed it as it ended


async def test_past_close_timeout_unload_returns_with_a_warning(
        closed: list[OrtGraph], caplog: pytest.LogCaptureFixture) -> None:
    async with wasinn.Runtime(cpu_pool(workers=1, close_timeout=0)) as rt:
        graph = await rt.load([affine_onnx(2.0, 1.0)], "onnx", name="affine")
        lease = await graph.lease({"x": X})
        async with trio.open_nursery() as nursery:
            with caplog.at_level(logging.WARNING, logger="wasinn.scheduler"):
                unloaded = await unload_in(nursery, graph)
            assert unloaded.is_set() and closed == []
        (record,) = [r for r in caplog.records if "still waits for" in r.getMessage()]
        assert "affine" in record.getMessage()
        assert "1 lease(s) not yet run or cancelled" in record.getMessage()
        assert "a run on its onnxruntime graph on cpu" in record.getMessage()
        await trio.to_thread.run_sync(lease.run)
        assert len(closed) == 1


#: A hang guard (never reached when the unload returns as it should): far below the
#: pools' close_timeout of an hour, far above anything these runs take.
HANG_GUARD_S = 120


async def test_an_unload_waiting_for_a_lease_returns_as_the_runtime_closes(
        closed: list[OrtGraph]) -> None:
    # The lease can never run once the runtime is closed: its close frees the graph.
    rt = wasinn.Runtime(cpu_pool(workers=1, close_timeout=3600))
    with trio.fail_after(HANG_GUARD_S):
        async with rt, trio.open_nursery() as nursery:
            graph = await rt.load([affine_onnx(2.0, 1.0)], "onnx", name="affine")
            lease = await graph.lease({"x": X})
            unloaded = await unload_in(nursery, graph)
            assert not unloaded.is_set()
            await rt.aclose()
            await trio.testing.wait_all_tasks_blocked()
            assert unloaded.is_set()
    with pytest.raises(ClosedResourceError, match="the device closed before it ran"):
        await trio.to_thread.run_sync(lease.run)


async def test_an_unload_after_the_runtime_closed_waits_for_no_lease(
        closed: list[OrtGraph]) -> None:
    leases: list[Any] = []

    async def take_lease(graph: wasinn.Graph) -> None:  # another task than the unload's
        leases.append(await graph.lease({"x": X}))

    rt = wasinn.Runtime(cpu_pool(workers=1, close_timeout=3600))
    with trio.fail_after(HANG_GUARD_S):
        async with rt:
            graph = await rt.load([affine_onnx(2.0, 1.0)], "onnx", name="affine")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(take_lease, graph)
        await graph.unload()  # (the runtime is closed: nothing left to wait for)
    with pytest.raises(ClosedResourceError, match="the device closed before it ran"):
        await trio.to_thread.run_sync(leases[0].run)


async def test_an_unload_from_the_task_holding_a_lease_does_not_wait_for_it(
        closed: list[OrtGraph], caplog: pytest.LogCaptureFixture) -> None:
    # It could not run before the unload returned: waiting would only stall until
    # close_timeout (10 s here), then warn.
    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        graph = await rt.load([affine_onnx(2.0, 1.0)], "onnx", name="affine")
        lease = await graph.lease({"x": X})
        with caplog.at_level(logging.WARNING, logger="wasinn.scheduler"):
            await graph.unload()
        assert not [r for r in caplog.records if "still waits for" in r.getMessage()]
        assert closed == []
        out = await trio.to_thread.run_sync(lease.run)
        assert out["y"].numpy().tolist() == [[3.0] * 4] and len(closed) == 1


async def test_an_open_context_keeps_the_graph_and_unload_returns_at_once(
        closed: list[OrtGraph]) -> None:
    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        graph = await rt.load([affine_onnx(2.0, 1.0)], "onnx", name="affine")
        ctx = graph.init_execution_context()
        lease = await graph.lease({"x": X})
        async with trio.open_nursery() as nursery:
            unloaded = await unload_in(nursery, graph)
            assert unloaded.is_set()  # the context keeps it: nothing to wait for
        await trio.to_thread.run_sync(lease.run)
        assert closed == []
        ctx.close()
        assert len(closed) == 1


async def test_a_pipeline_unload_waits_for_its_lease_then_loads_again(
        tmp_path: Path, closed: list[OrtGraph]) -> None:
    async with wasinn.Runtime.from_config(affine_pipeline_config(tmp_path)) as rt:
        pipeline = await rt.load_by_name("p")
        lease = await pipeline.lease({"x": X})
        async with trio.open_nursery() as nursery:
            unloaded = await unload_in(nursery, pipeline)
            assert not unloaded.is_set() and closed == []
            out = await trio.to_thread.run_sync(lease.run)
            await unloaded.wait()
            assert len(closed) == 2  # both steps' graphs, freed with the pipeline
        assert out["y"].numpy().tolist() == [[9.0] * 4]
        again = await rt.load_by_name("p")
        assert rt.name_registry.loads["p"] == 2
        assert (await again.compute({"x": X}))["y"].numpy().tolist() == [[9.0] * 4]
        assert {s.name: s.completed for s in rt.model_stats()}["p"] == 2


def affine_config(tmp_path: Path) -> Path:
    (tmp_path / "affine.onnx").write_bytes(affine_onnx(2.0, 1.0))
    path = tmp_path / "wasinn.toml"
    path.write_text('[pools.cpu]\nkind = "cpu"\ndevices = ["cpu"]\nworkers = 1\n\n'
                    '[models.affine]\nfiles = ["affine.onnx"]\nencoding = "onnx"\n')
    return path


def completed(rt: wasinn.Runtime) -> int:
    (stats,) = rt.model_stats()
    return stats.completed


async def test_a_lease_run_on_a_load_replaced_by_a_reload_is_counted(
        tmp_path: Path) -> None:
    require_backend("onnxruntime")
    async with wasinn.Runtime.from_config(affine_config(tmp_path)) as rt:
        first = await rt.load_by_name("affine")
        await first.compute({"x": X})
        lease = await first.lease({"x": X})
        await first.unload()  # (this task holds the lease: returns at once)
        second = await rt.load_by_name("affine")
        assert rt.name_registry.loads["affine"] == 2
        assert completed(rt) == 1
        await trio.to_thread.run_sync(lease.run)  # ends on the first load
        assert completed(rt) == 2
        await second.compute({"x": X})
        assert completed(rt) == 3
        # Loaded a third time: the first load's counts, now over, are summed for good.
        await second.unload()
        third = await rt.load_by_name("affine")
        await third.compute({"x": X})
        assert completed(rt) == 4
        assert not rt.name_registry._replaced
    assert completed(rt) == 4  # the final figures


async def test_runs_ending_wake_the_event_loop_only_while_an_unload_waits(
        closed: list[OrtGraph], monkeypatch: pytest.MonkeyPatch) -> None:
    # On every request's path: a wake-up of the loop per request ending costs tens of
    # microseconds on a virtual machine, for nobody, when no unload waits.
    wakes: list[None] = []
    wake = Sessions._wake_runs_over

    def counted(self: Sessions) -> None:
        wakes.append(None)
        wake(self)

    monkeypatch.setattr(Sessions, "_wake_runs_over", counted)
    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        graph = await rt.load([affine_onnx(2.0, 1.0)], "onnx", name="affine")
        ctx = graph.init_execution_context()
        for _ in range(5):
            await graph.compute({"x": X})
            await ctx.compute({"x": X})
            await trio.to_thread.run_sync(ctx.compute_in_caller_thread, {"x": X})
            lease = await graph.lease({"x": X})
            await trio.to_thread.run_sync(lease.run)
        await trio.testing.wait_all_tasks_blocked()
        assert wakes == []
        # ... but while one waits, a lease ending wakes it.
        lease = await graph.lease({"x": X})
        ctx.close()
        async with trio.open_nursery() as nursery:
            unloaded = await unload_in(nursery, graph)
            await trio.to_thread.run_sync(lease.run)
            await unloaded.wait()
        assert wakes and len(closed) == 1


# -- the bound: the close_timeout of the pools the graph is on -------------------------
def two_pools(cpu_close_timeout: float, gpu_close_timeout: float) -> RuntimeConfig:
    """A CPU pool (ONNX Runtime, the fake backend's recipes too) and a fake GPU pool,
    each with its ``close_timeout``."""
    return parse_config({"pools": {
        "cpu": {"kind": "cpu", "devices": ["cpu"], "workers": 1,
                "backends": ["onnxruntime", "fake"], "close_timeout": cpu_close_timeout},
        "gpu": {"kind": "gpu", "devices": ["gpu:0"], "workers": 1, "backends": ["fake"],
                "close_timeout": gpu_close_timeout},
    }}, None)


async def unload_timed(graph: wasinn.Graph) -> float:
    """Unload ``graph`` in a task of its own (not the one holding its leases): the
    seconds (trio's clock) it took to return."""
    took: list[float] = []

    async def unload() -> None:
        start = trio.current_time()
        await graph.unload()
        took.append(trio.current_time() - start)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(unload)
    return took[0]


def still_waits(caplog: pytest.LogCaptureFixture) -> str:
    (record,) = [r for r in caplog.records if "still waits for" in r.getMessage()]
    return record.getMessage()


async def test_an_unload_waits_no_longer_than_the_close_timeout_of_the_pools_it_is_on(
        autojump_clock: trio.testing.MockClock, closed: list[OrtGraph],
        caplog: pytest.LogCaptureFixture) -> None:
    # The GPU pool's hour is no bound for a graph that never ran there.
    async with wasinn.Runtime(two_pools(1, 3600), backends=[FakeBackend()]) as rt:
        graph = await rt.load([affine_onnx(2.0, 1.0)], "onnx", "cpu", name="affine")
        lease = await graph.lease({"x": X})  # held past the CPU pool's close_timeout
        with caplog.at_level(logging.WARNING, logger="wasinn.scheduler"):
            took = await unload_timed(graph)
        assert closed == []
        await trio.to_thread.run_sync(lease.run)
        assert len(closed) == 1
    assert took == pytest.approx(1)
    assert "affine: unloaded, but after 1 s (close_timeout) it still waits" in (
        still_waits(caplog))


async def test_an_unload_waits_up_to_the_largest_close_timeout_of_the_pools_it_is_on(
        autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture) -> None:
    # Compiled on both pools: its run on the CPU is waited for up to the GPU pool's bound.
    fake = FakeBackend()
    async with wasinn.Runtime(two_pools(1, 30), backends=[fake]) as rt:
        graph = await rt.load([b"fake:add=1"], "ggml", "cpu", name="twice")
        await graph.compute({"x": X}, target="gpu")
        lease = await graph.lease({"x": X})
        with caplog.at_level(logging.WARNING, logger="wasinn.scheduler"):
            took = await unload_timed(graph)
        assert fake.closed == ["gpu:0"]  # the CPU graph waits for the lease
        await trio.to_thread.run_sync(lease.run)
        assert fake.closed == ["gpu:0", "cpu"]
    assert took == pytest.approx(30)
    assert "twice: unloaded, but after 30 s (close_timeout) it still waits" in (
        still_waits(caplog))


# -- a batch waiting for company (max_delay) when the last handle goes ------------------
async def threads_done(actor: DeviceActor) -> None:
    """Wait until no job runs in ``actor``'s worker threads, holding trio's autojump clock
    still meanwhile (a task in wait_all_tasks_blocked is woken before the clock jumps):
    it would jump to the next deadline, an unload's close_timeout, while a run is in a
    thread."""
    await trio.testing.wait_all_tasks_blocked()
    while actor.threads.busy:
        await trio.testing.wait_all_tasks_blocked()


@contextlib.asynccontextmanager
async def waiting_for_company(graph: wasinn.Graph, results: dict[str, Any],
                              caplog: pytest.LogCaptureFixture) -> AsyncIterator[trio.Nursery]:
    """Within: request B, on ``graph`` with batching, waits in its batch for company (its
    result goes to ``results``), in the nursery given; wasinn.scheduler's warnings are
    captured."""
    with caplog.at_level(logging.WARNING, logger="wasinn.scheduler"):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(compute_into, graph, {"x": X}, results, "B")
            await trio.testing.wait_all_tasks_blocked()
            yield nursery


async def test_an_unload_runs_at_once_the_batch_its_last_request_waits_in(
        autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture) -> None:
    # B's batch holds the slot and waits for company (max_delay 5 s) when the graph's only
    # handle is unloaded: nobody can join it any more, so it runs now with B. Before, it
    # waited out max_delay, and the unload warned past its close_timeout (1 s) that it
    # "still waits for 1 compute" that only waited for company.
    require_backend("onnxruntime")
    async with wasinn.Runtime(cpu_pool(workers=1, close_timeout=1)) as rt:
        graph = await rt.load([affine_onnx(2.0, 1.0)], "onnx", name="affine",
                              batching=Batching(max_batch=8, max_delay=5))
        sizes = run_sizes(rt, graph)
        results: dict[str, Any] = {}
        start = trio.current_time()
        async with waiting_for_company(graph, results, caplog) as nursery:
            unloaded = await unload_in(nursery, graph)
            await threads_done(only_actor(rt))
            assert unloaded.is_set() and "B" in results
            assert trio.current_time() == start  # (trio's mock clock) at once
        assert sizes == [1]
        assert results["B"].tolist() == [[3.0] * 4]
        assert "still waits" not in caplog.text


async def test_a_pipelines_batch_runs_at_once_when_its_last_handle_is_unloaded(
        autojump_clock: trio.testing.MockClock, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    # While another handle keeps the pipeline, a request may still join B's batch, which
    # goes on waiting for company; once the last handle goes, it runs at once.
    require_backend("onnxruntime")
    path = affine_pipeline_config(tmp_path)
    path.write_text(path.read_text().replace("workers = 1\n", "workers = 1\nclose_timeout = 1\n")
                    + "batching = { max_batch = 8, max_delay_ms = 5000 }\n")
    async with wasinn.Runtime.from_config(path) as rt:
        first, second = await rt.load_by_name("p"), await rt.load_by_name("p")
        results: dict[str, Any] = {}
        start = trio.current_time()
        async with waiting_for_company(first, results, caplog) as nursery:
            await second.unload()  # (the first handle keeps it: returns at once)
            await threads_done(only_actor(rt))
            assert results == {}  # still waiting for company
            unloaded = await unload_in(nursery, first)
            await threads_done(only_actor(rt))
            assert unloaded.is_set() and "B" in results
            assert trio.current_time() == start  # (trio's mock clock) at once
        assert results["B"].tolist() == [[9.0] * 4]
        assert "still waits" not in caplog.text
        stats = first.stats()
        assert (stats.completed, stats.batches) == (1, 0)
