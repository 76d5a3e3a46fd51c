"""Dynamic batching when members leave before their batch starts, on a real ONNX Runtime
graph: the rows of a member that left no longer count against ``max_batch``, so a later
request that fits beside the members still there joins them (one run, not two), a
gathering batch is not cut short as "full", and a queued batch closed for being full
reopens, still only to requests of its tenant whose terms it would not worsen. A member
leaves too when its execution context closes: at once, unrun, while its batch has not
started (queued or gathering); a member of a batch already running runs to its end."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import trio
import trio.testing

import wasinn
from tests.support import cpu_pool
from tests.test_batching import (
    cancellable,
    compute_into,
    device_busy,
    first_row_onnx,
    only_actor,
    rows,
    run_sizes,
)
from tests.test_context_close import dropped, withdrawn
from wasinn import Batching, ClosedResourceError
from wasinn.modelgen import affine_onnx


def expected(value: float, count: int) -> np.ndarray[Any, Any]:
    """What the affine model (``2 x + 1``) gives for ``rows(value, count)``."""
    return 2 * rows(value, count) + 1


async def test_a_member_that_left_a_gathering_batch_leaves_room_for_the_next(
        autojump_clock: trio.testing.MockClock) -> None:
    # The review's scenario: B (1 row) opens a batch that waits for company; A (6 rows)
    # joins, and its caller gives up; C (5 rows) fits beside B. Before: A's rows still
    # counted (1 + 6 + 5 > 8), so C opened a batch of its own: runs of [1, 5].
    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        graph = await rt.load([affine_onnx()], "onnx",
                              batching=Batching(max_batch=8, max_delay=5))
        sizes = run_sizes(rt, graph)
        results: dict[Any, Any] = {}
        scopes: list[trio.CancelScope] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(compute_into, graph, {"x": rows(1, 1)}, results, "B")
            await trio.testing.wait_all_tasks_blocked()  # B's batch holds the slot, waiting
            nursery.start_soon(cancellable, scopes, graph, rows(2, 6))
            await trio.testing.wait_all_tasks_blocked()
            assert only_actor(rt).stats().queued == 2
            scopes[0].cancel()
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(compute_into, graph, {"x": rows(3, 5)}, results, "C")
        assert sizes == [6]
        np.testing.assert_allclose(results["B"], expected(1, 1))
        np.testing.assert_allclose(results["C"], expected(3, 5))
        stats = graph.stats()
        assert (stats.completed, stats.cancelled, stats.batches, stats.batched) == (2, 1, 1, 2)


async def test_a_gathering_batch_is_not_closed_as_full_by_rows_that_left(
        autojump_clock: trio.testing.MockClock) -> None:
    # B (1) opens, A (6) joins and leaves, C (1) joins: 2 live rows. Before: 1 + 6 + 1 =
    # 8 closed the batch as full, which ran at once with 2 rows, and D (5 rows, a second
    # later) had to open another: runs of [2, 5] instead of one of 7 at max_delay.
    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        graph = await rt.load([affine_onnx()], "onnx",
                              batching=Batching(max_batch=8, max_delay=5))
        sizes = run_sizes(rt, graph)
        results: dict[Any, Any] = {}
        scopes: list[trio.CancelScope] = []
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(compute_into, graph, {"x": rows(1, 1)}, results, "B")
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(cancellable, scopes, graph, rows(2, 6))
            await trio.testing.wait_all_tasks_blocked()
            scopes[0].cancel()
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(compute_into, graph, {"x": rows(3, 1)}, results, "C")
            await trio.sleep(1)
            assert sizes == []  # still gathering
            nursery.start_soon(compute_into, graph, {"x": rows(4, 5)}, results, "D")
        assert sizes == [7]
        assert trio.current_time() - start == 5  # (trio's mock clock) at max_delay
        for name, value, count in (("B", 1, 1), ("C", 3, 1), ("D", 4, 5)):
            np.testing.assert_allclose(results[name], expected(value, count), err_msg=name)


async def test_a_queued_batch_closed_as_full_reopens_when_a_member_leaves() -> None:
    # Behind a busy device: B (1) opens a batch, A (7) fills it (closed: 8 rows), A
    # leaves. The batch reopens: C (5) and G (2) join it and fill it again (8), so H (2)
    # opens the next; E (another tenant) and F (a higher priority) never join it. Before:
    # the full batch stayed closed with 1 live row, C opened a batch that G joined, and
    # H did not fit there: runs of [1, 7, 2, 1, 1].
    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        graph = await rt.load([affine_onnx()], "onnx", batching=Batching(max_batch=8))
        sizes = run_sizes(rt, graph)
        actor = only_actor(rt)
        results: dict[Any, Any] = {}
        scopes: list[trio.CancelScope] = []

        def request(nursery: trio.Nursery, name: str, value: float, count: int,
                    **terms: Any) -> None:
            nursery.start_soon(functools.partial(
                compute_into, graph, {"x": rows(value, count)}, results, name, **terms))

        async with device_busy(actor) as nursery:
            request(nursery, "B", 1, 1)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(cancellable, scopes, graph, rows(2, 7))
            await trio.testing.wait_all_tasks_blocked()
            assert actor.stats().queued == 2
            scopes[0].cancel()
            await trio.testing.wait_all_tasks_blocked()
            assert actor.stats().queued == 1
            for name, value, count, terms in (
                    ("C", 3, 5, {}), ("G", 4, 2, {}), ("H", 5, 2, {}),
                    ("E", 6, 1, {"tenant": "other"}), ("F", 7, 1, {"priority": 1})):
                request(nursery, name, value, count, **terms)
                await trio.testing.wait_all_tasks_blocked()
            assert actor.stats().queued == 6
        assert sorted(sizes) == [1, 1, 2, 8], sizes
        for name, value, count in (("B", 1, 1), ("C", 3, 5), ("G", 4, 2), ("H", 5, 2),
                                   ("E", 6, 1), ("F", 7, 1)):
            np.testing.assert_allclose(results[name], expected(value, count), err_msg=name)
        stats = graph.stats()
        assert (stats.completed, stats.cancelled, stats.batches, stats.batched) == (6, 1, 1, 3)
        assert actor.stats().queued == 0


# -- members whose execution context closes -----------------------------------------------
def withdrawn_from_batch(name: str) -> str:
    return (f"the execution context of {name} was closed while its request waited in a "
            "batch that had not started: it was withdrawn, unrun")


async def context_compute(ctx: wasinn.ExecutionContext, x: np.ndarray[Any, Any],
                          results: dict[str, Any], key: str) -> None:
    """``ctx.compute`` on ``x``: its output, or its ClosedResourceError's message."""
    try:
        results[key] = (await ctx.compute({"x": x}))["y"].numpy()
    except ClosedResourceError as exc:
        results[key] = exc.message


async def test_a_closed_contexts_member_leaves_its_queued_batch_at_once() -> None:
    # Behind a busy device, A (1 row: it opened the batch), B (2) and C (1) wait in one
    # batch, and A's context closes. A is told at once, unrun; the batch runs B and C
    # (3 rows), its queue entry (opened by A's task) left alone. Before: A ran with the
    # batch (4 rows) and was told only then that its outputs were dropped.
    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        graph = await rt.load([affine_onnx()], "onnx", batching=Batching(max_batch=8))
        sizes = run_sizes(rt, graph)
        actor = only_actor(rt)
        contexts = {name: graph.init_execution_context() for name in "ABC"}
        results: dict[str, Any] = {}
        async with device_busy(actor) as nursery:
            for name, value, count in (("A", 1, 1), ("B", 2, 2), ("C", 3, 1)):
                nursery.start_soon(context_compute, contexts[name], rows(value, count),
                                   results, name)
                await trio.testing.wait_all_tasks_blocked()
            assert actor.stats().queued == 3
            contexts["A"].close()
            await trio.testing.wait_all_tasks_blocked()
            # Told at once, while the run the batch waits behind still holds the device.
            assert results == {"A": withdrawn_from_batch(graph.name)}
            assert actor.stats().queued == 2
        assert sizes == [3]
        np.testing.assert_allclose(results["B"], expected(2, 2))
        np.testing.assert_allclose(results["C"], expected(3, 1))
        stats = graph.stats()
        assert (stats.completed, stats.cancelled, stats.batches, stats.batched) == (2, 1, 1, 2)


async def test_a_batch_whose_only_member_is_withdrawn_leaves_the_queue_at_once() -> None:
    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        graph = await rt.load([affine_onnx()], "onnx", batching=Batching(max_batch=8))
        sizes = run_sizes(rt, graph)
        actor = only_actor(rt)
        ctx = graph.init_execution_context()
        results: dict[str, Any] = {}
        async with device_busy(actor) as nursery:
            nursery.start_soon(context_compute, ctx, rows(1), results, "only")
            await trio.testing.wait_all_tasks_blocked()
            assert actor.stats().queued == 1
            ctx.close()
            await trio.testing.wait_all_tasks_blocked()
            assert results == {"only": withdrawn_from_batch(graph.name)}
            # Nothing waits in the queue any more: the batch's entry left it too.
            assert (actor.stats().queued, actor.load, actor.stats().running) == (0, 1, 1)
        assert sizes == []  # never ran
        np.testing.assert_allclose((await graph.compute({"x": rows(5)}))["y"].numpy(),
                                   expected(5, 1))
        stats = graph.stats()
        assert (stats.completed, stats.cancelled, stats.batches) == (1, 1, 0)
        assert actor.stats().running == 0


@contextlib.asynccontextmanager
async def a_joins_bs_gathering_batch(rt: wasinn.Runtime, results: dict[str, Any]
                                     ) -> AsyncIterator[tuple[wasinn.Graph, list[int], Any]]:
    """Within: on a graph loaded in ``rt`` with batching (max_delay 5 s), B's batch holds
    the slot and waits for company, and A, a request of the context given, has joined it
    (their results go to ``results``); gives the graph, its run sizes and A's context."""
    graph = await rt.load([affine_onnx()], "onnx", batching=Batching(max_batch=8, max_delay=5))
    sizes = run_sizes(rt, graph)
    ctx = graph.init_execution_context()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(compute_into, graph, {"x": rows(1, 1)}, results, "B")
        await trio.testing.wait_all_tasks_blocked()  # B's batch holds the slot, waiting
        nursery.start_soon(context_compute, ctx, rows(2, 3), results, "A")
        await trio.testing.wait_all_tasks_blocked()
        yield graph, sizes, ctx


async def test_a_closed_contexts_member_leaves_a_gathering_batch_at_once(
        autojump_clock: trio.testing.MockClock) -> None:
    # B opens a batch that holds the slot and waits for company (max_delay); A joins, and
    # its context closes: A is told at once, and B runs alone at max_delay.
    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        results: dict[str, Any] = {}
        start = trio.current_time()
        async with a_joins_bs_gathering_batch(rt, results) as (graph, sizes, ctx):
            assert only_actor(rt).stats().queued == 2
            ctx.close()
            await trio.testing.wait_all_tasks_blocked()
            assert results == {"A": withdrawn_from_batch(graph.name)}
            assert trio.current_time() == start  # at once, not at the run
        assert sizes == [1]
        assert trio.current_time() - start == 5  # (trio's mock clock) at max_delay
        np.testing.assert_allclose(results["B"], expected(1, 1))
        stats = graph.stats()
        assert (stats.completed, stats.cancelled, stats.batches) == (1, 1, 0)


async def test_a_member_of_a_batch_that_started_runs_to_its_end_and_is_dropped() -> None:
    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        graph = await rt.load([affine_onnx()], "onnx", batching=Batching(max_batch=8))
        sizes = run_sizes(rt, graph)
        session = only_actor(rt).cached_session(graph._executable.id)  # type: ignore[attr-defined]
        assert session is not None
        compiled, counted_run = session.compiled, session.compiled.run
        running, go_on = threading.Event(), threading.Event()

        def held_run(inputs: Any, **kwargs: Any) -> dict[str, wasinn.Tensor]:
            running.set()
            if not go_on.wait(30):
                raise RuntimeError("never let go on")
            return counted_run(inputs, **kwargs)

        compiled.run = held_run  # type: ignore[method-assign]
        ctx = graph.init_execution_context()
        results: dict[str, Any] = {}
        try:
            async with trio.open_nursery() as nursery:
                async with device_busy(only_actor(rt)):
                    nursery.start_soon(compute_into, graph, {"x": rows(1)}, results, "B")
                    nursery.start_soon(context_compute, ctx, rows(2), results, "C")
                    await trio.testing.wait_all_tasks_blocked()
                await trio.to_thread.run_sync(running.wait, 30)  # the merged run started
                ctx.close()
                await trio.testing.wait_all_tasks_blocked()
                assert results == {}  # not withdrawn: its run goes on
                go_on.set()
        finally:
            go_on.set()
        assert sizes == [2]  # one merged run, C's row in it
        np.testing.assert_allclose(results["B"], expected(1, 1))
        assert results["C"] == dropped(graph.name)


async def test_a_request_of_a_model_that_runs_alone_is_withdrawn_at_once() -> None:
    # A model whose merged outputs cannot be split runs its requests alone, each queued
    # on its own terms: a closed context's is withdrawn from the queue as any request is.
    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        graph = await rt.load([first_row_onnx()], "onnx", batching=Batching(max_batch=8))
        actor = only_actor(rt)
        results: dict[str, Any] = {}
        async with device_busy(actor) as nursery:  # a merged run: found unsplittable
            for i in range(2):
                nursery.start_soon(compute_into, graph, {"x": rows(i, 2)}, results, f"r{i}")
        ctx = graph.init_execution_context()
        async with device_busy(actor) as nursery:
            nursery.start_soon(context_compute, ctx, rows(3, 2), results, "alone")
            await trio.testing.wait_all_tasks_blocked()
            assert actor.stats().queued == 1
            ctx.close()
            await trio.testing.wait_all_tasks_blocked()
            assert results["alone"] == withdrawn(graph.name)
            assert actor.stats().queued == 0
        stats = graph.stats()
        assert (stats.completed, stats.cancelled) == (2, 1)


# -- a graph whose gathering has ended (its last handle unloaded) -------------------------
def graph_key(graph: wasinn.Graph) -> int:
    """What ``graph``'s batches are keyed by on a device (a model's id)."""
    return graph._executable.id  # type: ignore[attr-defined,no-any-return]


async def test_a_member_leaving_a_batch_whose_gathering_ended_does_not_reopen_it(
        autojump_clock: trio.testing.MockClock) -> None:
    # B's batch waits for company, A (a context's) in it; the graph's gathering ends and
    # A's context closes before B's batch resumes: the batch stays closed and runs B at
    # once. Before: A's leaving reopened it (as one closed for being full), so it went on
    # waiting for company until max_delay.
    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        results: dict[str, Any] = {}
        start = trio.current_time()
        async with a_joins_bs_gathering_batch(rt, results) as (graph, sizes, ctx):
            with only_actor(rt).gathering_ended(graph_key(graph)):
                ctx.close()  # (no checkpoint: before B's batch resumes)
        assert trio.current_time() == start  # (trio's mock clock) at once
        assert sizes == [1]
        assert results["A"] == withdrawn_from_batch(graph.name)
        np.testing.assert_allclose(results["B"], expected(1, 1))


async def test_a_batch_opened_while_its_graphs_gathering_has_ended_waits_for_nobody(
        autojump_clock: trio.testing.MockClock) -> None:
    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        graph = await rt.load([affine_onnx()], "onnx",
                              batching=Batching(max_batch=8, max_delay=5))
        results: dict[str, Any] = {}
        start = trio.current_time()
        with only_actor(rt).gathering_ended(graph_key(graph)):
            await compute_into(graph, {"x": rows(1, 1)}, results, "during")
            assert trio.current_time() == start  # (trio's mock clock) at once
        # Once the block is over, a batch waits for company again.
        await compute_into(graph, {"x": rows(2, 1)}, results, "after")
        assert trio.current_time() - start == 5
        np.testing.assert_allclose(results["during"], expected(1, 1))
        np.testing.assert_allclose(results["after"], expected(2, 1))
