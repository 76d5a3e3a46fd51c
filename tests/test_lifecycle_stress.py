"""Lifetimes under concurrency: handles, contexts, leases and loads racing unloads,
closes and cancellations, with the real ONNX Runtime backend and a tiny model.

The seeded stress test runs a few hundred operations from many tasks (and worker
threads) with random cancellations, then checks that every device's and every model's
request figures agree with what the callers saw, that nothing is queued or running, and
that no compiled graph outlives its last handle.
"""

from __future__ import annotations

import asyncio
import random
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import wasinn
from tests.loop_model import loop_inputs, loop_onnx
from tests.support import cpu_pool, require_backend
from wasinn import ClosedResourceError
from wasinn.configs.loader import parse_config
from wasinn.configs.schema import RuntimeConfig
from wasinn.modelgen import affine_onnx

X = np.ones((1, 4), np.float32)

pytestmark = pytest.mark.usefixtures("onnxruntime")


@pytest.fixture
def onnxruntime() -> None:
    require_backend("onnxruntime")


def registry_config(tmp_path: Path, workers: int = 2) -> RuntimeConfig:
    """Models ``a`` and ``b`` (the affine graph) and the pipeline ``twice`` of them."""
    (tmp_path / "affine.onnx").write_bytes(affine_onnx())
    return parse_config({
        "pools": {"cpu": {"kind": "cpu", "devices": ["cpu"], "workers": workers}},
        "models": {"a": {"files": ["affine.onnx"]}, "b": {"files": ["affine.onnx"]}},
        "pipelines": {"twice": {"steps": [{"model": "a"}, {"model": "b"}]}},
    }, tmp_path / "wasinn.toml")


async def settled(rt: wasinn.Runtime) -> None:
    """Until no worker thread runs a job (an abandoned compile or run) and every task is
    blocked."""
    while any(actor.busy for actor in rt.actors):
        await trio.sleep(0.005)
    await trio.testing.wait_all_tasks_blocked()


# -- outside trio --------------------------------------------------------------------------
def test_a_runtime_started_outside_trio_says_so_and_can_still_start_in_trio() -> None:
    # Before: under asyncio, trio's own "must be called from async context" came out of a
    # worker-thread call, and the runtime was marked started: trio.run then got "a
    # Runtime can be started once".
    rt = wasinn.Runtime(cpu_pool())

    async def in_asyncio() -> None:
        async with rt:
            pass

    with pytest.raises(RuntimeError, match=r"Runtime.start must be awaited in trio"):
        asyncio.run(in_asyncio())

    async def in_trio() -> None:
        async with rt:
            graph = await rt.load([affine_onnx()], "onnx")
            assert (await graph.compute({"x": X}))["y"].numpy().tolist() == [[3.0] * 4]

    trio.run(in_trio)


def test_a_runtime_used_from_another_trio_run_says_so() -> None:
    async def run_in_another_trio(rt: wasinn.Runtime) -> None:
        def other() -> None:
            async def load() -> None:
                await rt.load([affine_onnx()], "onnx")

            with pytest.raises(RuntimeError, match="started in another trio run"):
                trio.run(load)

        await trio.to_thread.run_sync(other)

    async def main() -> None:
        async with wasinn.Runtime(cpu_pool()) as rt:
            await run_in_another_trio(rt)
            assert rt.actors[0].session_keys() == []

    trio.run(main)


async def test_requests_and_unload_from_asyncio_or_another_trio_run_say_so_and_change_nothing(
        tmp_path: Path) -> None:
    # Before: under asyncio every request failed with trio's bare "must be called from
    # async context"; from another trio run a compute went through, mixing that run's
    # task with this run's queues (one queued behind a busy slot would have been woken by
    # the wrong run), and an unload from asyncio unloaded, then failed.
    async with wasinn.Runtime(registry_config(tmp_path, workers=1)) as rt:
        graph = await rt.load([affine_onnx()], "onnx")
        pipeline = await rt.load_by_name("twice")
        ctx = graph.init_execution_context()
        ctx.set_input("x", X)
        requests = {
            "ctx.compute": lambda: ctx.compute({"x": X}),
            "ctx.run": ctx.run,
            "ctx.lease": lambda: ctx.lease({"x": X}),
            "graph.compute": lambda: graph.compute({"x": X}),
            "graph.lease": lambda: graph.lease({"x": X}),
            "pipeline.compute": lambda: pipeline.compute({"x": X}),
            # (A timeout reads trio's clock: under asyncio that once failed first.)
            "ctx.compute(timeout)": lambda: ctx.compute({"x": X}, timeout=1),
            "ctx.lease(timeout)": lambda: ctx.lease({"x": X}, timeout=1),
            "graph.compute(timeout)": lambda: graph.compute({"x": X}, timeout=1),
        }
        said: dict[str, list[str]] = {"asyncio": [], "trio": []}
        (actor,) = rt.actors
        completed = actor.completed

        async def each(loop: str) -> None:
            for name, request in requests.items():
                with pytest.raises(RuntimeError) as caught:
                    await request()
                said[loop].append(f"{name}: {caught.value}")
            with pytest.raises(RuntimeError) as caught:
                await graph.unload()
            said[loop].append(f"unload: {caught.value}")

        def elsewhere() -> None:
            asyncio.run(each("asyncio"))
            trio.run(each, "trio")

        await trio.to_thread.run_sync(elsewhere)
        assert len(said["asyncio"]) == len(said["trio"]) == len(requests) + 1
        assert all("must be awaited in trio" in line for line in said["asyncio"]), said
        assert all("started in another trio run" in line for line in said["trio"]), said
        # Nothing was queued, run, counted or unloaded meanwhile.
        stats = graph.stats()
        assert not graph.unloaded
        assert (stats.completed, stats.failed, stats.rejected, stats.cancelled) == (0, 0, 0, 0)
        assert (actor.completed, actor.queued, actor.busy) == (completed, 0, 0)
        assert (await ctx.compute({"x": X}))["y"].numpy().tolist() == [[3.0] * 4]
        assert (await pipeline.compute({"x": X}))["y"].numpy().tolist() == [[7.0] * 4]


# -- cancellation at every checkpoint ---------------------------------------------------------
@pytest.mark.parametrize("what", ["bytes", "a", "twice"])
async def test_a_load_cancelled_at_any_point_leaves_nothing_compiled(
        tmp_path: Path, what: str) -> None:
    async with wasinn.Runtime(registry_config(tmp_path)) as rt:
        (actor,) = rt.actors
        for checkpoints in range(30):
            got: list[wasinn.Graph] = []

            async def load() -> None:
                got.append(await rt.load([affine_onnx()], "onnx") if what == "bytes"  # noqa: B023
                           else await rt.load_by_name(what))

            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(load)
                    for _ in range(checkpoints):
                        await trio.lowlevel.checkpoint()
                    scope.cancel()
            for graph in got:  # the load won the race: its handle frees it
                await graph.unload()
            await settled(rt)
            assert actor.session_keys() == [], checkpoints
            assert actor.stats().graphs == 0
        graph = await (rt.load([affine_onnx()], "onnx") if what == "bytes"
                       else rt.load_by_name(what))
        out = await graph.compute({"x": X})
        assert next(iter(out.values())).numpy().shape == (1, 4)
        await graph.unload()
        assert actor.session_keys() == []


# -- unload, close ------------------------------------------------------------------------
async def test_unload_twice_and_from_two_tasks_at_once_frees_once() -> None:
    async with wasinn.Runtime(cpu_pool()) as rt:
        (actor,) = rt.actors
        graph = await rt.load([affine_onnx()], "onnx")
        other = await rt.load([affine_onnx(3.0)], "onnx")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(graph.unload)
            nursery.start_soon(graph.unload)
        await graph.unload()
        assert graph.unloaded and len(actor.session_keys()) == 1  # the other's only
        assert (await other.compute({"x": X}))["y"].numpy().tolist() == [[4.0] * 4]
        again = await rt.load([affine_onnx()], "onnx")  # a later load of the same model
        assert (await again.compute({"x": X}))["y"].numpy().tolist() == [[3.0] * 4]


async def test_unload_while_computes_are_queued_running_and_leased() -> None:
    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        (actor,) = rt.actors
        slow = await rt.load([loop_onnx()], "onnx")
        graph = await rt.load([affine_onnx()], "onnx")
        ctx = graph.init_execution_context()
        lease = await graph.lease({"x": X})  # holds the only slot
        results: list[Any] = []

        async def compute() -> None:
            results.append((await ctx.compute({"x": X}))["y"].numpy().tolist())

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(compute)
            await trio.testing.wait_all_tasks_blocked()
            assert actor.queued == 3
            await graph.unload()  # the context and the lease still hold it
            assert actor.cached(ctx._executable.id)  # type: ignore[attr-defined]
            assert (await trio.to_thread.run_sync(lease.run))["y"].numpy().tolist() == [[3.0] * 4]
        assert results == [[[3.0] * 4]] * 3
        ctx.close()
        assert actor.session_keys() == [slow._executable.id]  # type: ignore[attr-defined]
        await slow.unload()
        assert actor.session_keys() == []
        stats = actor.stats()
        assert (stats.completed, stats.finished, stats.running, stats.queued) == (4, 4, 0, 0)


async def test_close_a_context_during_its_own_compute_after_the_graph_was_unloaded() -> None:
    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        (actor,) = rt.actors
        graph = await rt.load([loop_onnx()], "onnx")
        ctx = graph.init_execution_context()
        await graph.unload()
        caught: list[BaseException] = []

        async def compute() -> None:
            with pytest.raises(ClosedResourceError) as raised:
                await ctx.compute(loop_inputs(20_000))
            caught.append(raised.value)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(compute)
            while actor.stats().running == 0:
                await trio.sleep(0.001)
            ctx.close()  # the last reference: freed once the run ends
            await trio.lowlevel.checkpoint()
        # Closed once its run held the graph: the outputs are dropped; a moment before
        # (slot taken, graph not yet held): the graph was freed and nothing ran.
        assert ("was closed while its request ran" in caught[0].args[0]
                or "was freed before this run started" in caught[0].args[0]), caught
        assert actor.session_keys() == [] and actor.stats().graphs == 0
        with pytest.raises(ClosedResourceError, match="is closed"):
            await ctx.compute(loop_inputs(1))


async def test_a_context_made_before_unload_keeps_working_until_closed() -> None:
    async with wasinn.Runtime(cpu_pool()) as rt:
        (actor,) = rt.actors
        graph = await rt.load([affine_onnx()], "onnx")
        ctx = graph.init_execution_context("cpu")
        await graph.unload()
        with pytest.raises(ClosedResourceError, match="was unloaded"):
            graph.init_execution_context()
        with pytest.raises(ClosedResourceError, match="was unloaded"):
            await graph.compute({"x": X})
        assert (await ctx.compute({"x": X}))["y"].numpy().tolist() == [[3.0] * 4]
        run = ctx.try_lease({"x": X})
        assert run is not None
        assert (await trio.to_thread.run_sync(run.run))["y"].numpy().tolist() == [[3.0] * 4]
        ctx.close()
        assert actor.session_keys() == []


async def test_load_by_name_after_the_last_handle_is_released_loads_it_again(
        tmp_path: Path) -> None:
    async with wasinn.Runtime(registry_config(tmp_path)) as rt:
        (actor,) = rt.actors
        first = await rt.load_by_name("a")
        model = first._executable
        ctx = first.init_execution_context()
        await first.unload()
        again = await rt.load_by_name("a")  # the context still holds it: shared
        assert again._executable is model and rt.name_registry.loads["a"] == 1
        await again.unload()
        ctx.close()  # the last one: released
        assert model.released and actor.session_keys() == []

        # A waiter for a load that its loader unloads before the waiter wakes must not
        # get the released model.
        graphs: list[wasinn.Graph] = []

        async def load_and_unload() -> None:
            graph = await rt.load_by_name("a")
            await graph.unload()  # no checkpoint before the handle is ended

        async def load() -> None:
            graphs.append(await rt.load_by_name("a"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(load_and_unload)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(load)
        (graph,) = graphs
        assert not graph._executable.released and rt.name_registry.loads["a"] == 3
        assert (await graph.compute({"x": X}))["y"].numpy().tolist() == [[3.0] * 4]
        await graph.unload()
        assert actor.session_keys() == []


# -- the runtime closed under everything ----------------------------------------------------
async def test_aclose_while_loads_computes_leases_and_compiles_are_in_flight(
        tmp_path: Path) -> None:
    rt = wasinn.Runtime(registry_config(tmp_path, workers=2))
    await rt.start()
    (actor,) = rt.actors
    slow = await rt.load([loop_onnx()], "onnx")
    graph = await rt.load([affine_onnx()], "onnx")
    ctx = graph.init_execution_context()
    outcomes: dict[str, object] = {}

    async def call(name: str, fn: Any) -> None:
        try:
            got = await fn()
        except ClosedResourceError as exc:
            outcomes[name] = exc
            return
        outcomes[name] = got

    def in_thread() -> object:
        return ctx.compute_in_caller_thread({"x": X})

    async with trio.open_nursery() as nursery:
        nursery.start_soon(call, "slow", lambda: slow.compute(loop_inputs(10**9)))
        nursery.start_soon(call, "slow2", lambda: slow.compute(loop_inputs(10**9)))
        while rt.actors[0].stats().running < 2:  # both slots held: the rest queue
            await trio.sleep(0.001)
        for i in range(3):
            nursery.start_soon(call, f"queued{i}", lambda: ctx.compute({"x": X}))
        nursery.start_soon(call, "lease", lambda: graph.lease({"x": X}))
        nursery.start_soon(call, "ctx lease", lambda: ctx.lease({"x": X}))
        nursery.start_soon(call, "load", lambda: rt.load([affine_onnx(3.0)], "onnx"))
        nursery.start_soon(call, "by name", lambda: rt.load_by_name("twice"))
        nursery.start_soon(call, "thread", lambda: trio.to_thread.run_sync(in_thread))
        await trio.testing.wait_all_tasks_blocked()
        await rt.aclose()
    assert set(outcomes) == {"slow", "slow2", "queued0", "queued1", "queued2", "lease",
                             "ctx lease", "load", "by name", "thread"}
    for name, outcome in outcomes.items():
        if name in ("load", "by name") and isinstance(outcome, wasinn.Graph):
            # A load whose thread finished before aclose began (the thread's work does
            # not count as blocked for wait_all_tasks_blocked): done, then closed with
            # the runtime, as every graph is.
            with pytest.raises(ClosedResourceError):
                await outcome.compute({"x": X})
            continue
        assert isinstance(outcome, ClosedResourceError), (name, outcome)
    assert actor.session_keys() == [] and actor.stats().running == 0
    assert not actor.ready and actor.busy == 0
    assert not [t.name for t in threading.enumerate() if t.name.startswith("wasinn ")]
    with pytest.raises(ClosedResourceError, match="the runtime is closed"):
        await trio.to_thread.run_sync(in_thread)


# -- the seeded stress test ----------------------------------------------------------------
async def one_operation(graph: wasinn.Graph, ctx: wasinn.ExecutionContext, seed: int,
                        tally: dict[str, int]) -> None:
    """One compute of a random kind, cancelled after a random number of checkpoints (or
    not); ``tally`` counts the operations begun ("ops") and those each graph completed."""
    local = random.Random(seed)
    kind = local.choice(["ctx", "graph", "lease", "thread", "staged"])
    cancel_after = local.choice([None, None, 0, 1, 2, 5])
    with trio.CancelScope() as scope:

        async def canceller(checkpoints: int) -> None:
            for _ in range(checkpoints):
                await trio.lowlevel.checkpoint()
            scope.cancel()

        try:
            async with trio.open_nursery() as nursery:
                if cancel_after is not None:
                    nursery.start_soon(canceller, cancel_after)
                tally["ops"] += 1
                if kind == "ctx":
                    out = await ctx.compute({"x": X})
                elif kind == "graph":
                    out = await graph.compute({"x": X})
                elif kind == "staged":
                    ctx.set_input("x", X)
                    await ctx.run()
                    out = {"y": ctx.get_output("y")}
                elif kind == "lease":
                    lease = await graph.lease({"x": X})
                    with trio.CancelScope(shield=True):  # this thread runs it to its end
                        out = await trio.to_thread.run_sync(lease.run)
                else:
                    out = await trio.to_thread.run_sync(
                        lambda: ctx.compute_in_caller_thread({"x": X}))
                tally[graph.name] += 1
                assert out["y"].numpy().shape == (1, 4)
                scope.cancel()  # done: stop the canceller
        except ClosedResourceError:
            pytest.fail("nothing here was closed")


async def test_many_contexts_from_many_tasks_with_random_cancellations() -> None:
    rng = random.Random(20261121)
    async with wasinn.Runtime(cpu_pool(workers=2)) as rt:
        (actor,) = rt.actors
        graphs = [await rt.load([affine_onnx(float(i))], "onnx", name=f"m{i}")
                  for i in range(3)]
        tally = {"ops": 0, **{g.name: 0 for g in graphs}}
        contexts = [(g, g.init_execution_context()) for g in graphs for _ in range(4)]
        async with trio.open_nursery() as nursery:
            for i in range(300):
                graph, ctx = rng.choice(contexts)
                nursery.start_soon(one_operation, graph, ctx, rng.getrandbits(32), tally)
                if i % 7 == 0:
                    await trio.lowlevel.checkpoint()
        stats = actor.stats()
        assert stats.running == 0 and stats.queued == 0 and actor.load == 0
        assert stats.completed == sum(tally[g.name] for g in graphs) > 0
        assert stats.failed == stats.timed_out == stats.rejected == 0
        assert stats.cancelled > 0 and stats.finished <= tally["ops"] == 300
        for graph in graphs:
            model = graph.stats()
            assert model.completed == tally[graph.name], graph.name
            assert model.failed == model.timed_out == model.rejected == 0
        assert sum(g.stats().finished for g in graphs) == stats.finished
        for _, ctx in contexts:
            ctx.close()
        for graph in graphs:
            await graph.unload()
        assert actor.session_keys() == [] and actor.stats().graphs == 0
        assert all(g._executable.refs == 0 and g._executable.released for g in graphs)
