"""Dynamic batching when members leave before their batch starts, on a real ONNX Runtime
graph: the rows of a member that left no longer count against ``max_batch``, so a later
request that fits beside the members still there joins them (one run, not two), a
gathering batch is not cut short as "full", and a queued batch closed for being full
reopens, still only to requests of its tenant whose terms it would not worsen."""

from __future__ import annotations

import functools
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
    only_actor,
    rows,
    run_sizes,
)
from wasinn import Batching
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
