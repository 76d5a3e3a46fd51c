"""Unloading a sandboxed graph does not hold the event loop while its processes end.

Closing a sandboxed graph kills each of its processes and waits for it (~25 ms a
process here): on the trio thread that froze every device's requests, deadlines and
cancellations for as long, at every guest's exit (models guests load from their own bytes
are sandboxed by default). The graph is closed in a thread; ``unload`` still returns once
its processes are gone.
"""

from __future__ import annotations

import functools
import threading

import numpy as np
import trio
import trio.testing

import wasinn
from tests.loopwatch import Heartbeat, heartbeat  # noqa: F401 - a fixture
from tests.support import cpu_pool, no_spares, require_backend, sandbox_children
from wasinn.actors import DeviceActor
from wasinn.backends.base import Device
from wasinn.enums import ExecutionTarget
from wasinn.modelgen import affine_onnx

WORKERS = 4
X = {"x": np.ones((1, 4), np.float32)}


async def test_unloading_a_sandboxed_graph_leaves_the_loop_serving(
        heartbeat: Heartbeat) -> None:  # noqa: F811 - the fixture
    require_backend("onnxruntime")
    config = no_spares(cpu_pool(workers=WORKERS, backends=["onnxruntime"]))
    async with wasinn.Runtime(config) as rt:
        graph = await rt.load([affine_onnx()], "onnx", options={"sandbox": True})
        with trio.fail_after(60):  # every worker's process started (runs at once)
            while len(sandbox_children()) < WORKERS:
                async with trio.open_nursery() as nursery:
                    for _ in range(4 * WORKERS):
                        nursery.start_soon(graph.compute, X)
        with heartbeat.watch():  # the loop was held for less than half the unload
            await graph.unload()
        assert sandbox_children() == []  # gone once unload returned
        # Another model loads and runs sandboxed as before.
        other = await rt.load([affine_onnx(3.0)], "onnx", options={"sandbox": True})
        out = await other.compute(X)
        assert out["y"].numpy().tolist() == [[4.0] * 4]


class _SlowClose:
    """A compiled graph whose close blocks until ``gate`` is set (as a sandboxed one's
    waits for its processes), for the actor's session cache (never run)."""

    may_run_inline = False
    close_blocks = True

    def __init__(self, gate: threading.Event) -> None:
        self.gate = gate
        self.closed = threading.Event()

    def close(self) -> None:
        self.gate.wait()
        self.closed.set()


async def test_waiting_for_closes_waits_for_those_evicted_before_not_after() -> None:
    # Before, graphs_closed (what unload waits on) waited until no graph was closing at
    # all: other guests' unloads, one after another, could hold an unload off for ever.
    first_gate, later_gate = threading.Event(), threading.Event()
    first, later = _SlowClose(first_gate), _SlowClose(later_gate)
    actor = DeviceActor(Device(ExecutionTarget.CPU), workers=1)
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.serve)
        for key, graph in (("first", first), ("later", later)):
            await actor.session(key, functools.partial(lambda g: g, graph), "fake")
        actor.evict("first")  # its close hangs until first_gate
        waited = trio.Event()

        async def wait_for_first() -> None:
            await actor.graphs_closed()
            waited.set()

        nursery.start_soon(wait_for_first)
        await trio.testing.wait_all_tasks_blocked()  # (the waiter is waiting)
        actor.evict("later")  # evicted after the wait began: its close hangs on
        try:
            first_gate.set()
            with trio.fail_after(10):
                await waited.wait()
            assert first.closed.is_set() and not later.closed.is_set()
        finally:
            first_gate.set()
            later_gate.set()
        with trio.fail_after(10):
            await actor.graphs_closed()
        assert later.closed.is_set()
        nursery.cancel_scope.cancel()
