"""Unloading a sandboxed graph does not hold the event loop while its processes end.

Closing a sandboxed graph kills each of its processes and waits for it (~25 ms a
process here): on the trio thread that froze every device's requests, deadlines and
cancellations for as long, at every guest's exit (models guests load from their own bytes
are sandboxed by default). The graph is closed in a thread; ``unload`` still returns once
its processes are gone.
"""

from __future__ import annotations

import numpy as np
import trio

import wasinn
from tests.loopwatch import Heartbeat, heartbeat  # noqa: F401 - a fixture
from tests.support import cpu_pool, no_spares, require_backend, sandbox_children
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
