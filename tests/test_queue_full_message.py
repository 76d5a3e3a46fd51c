"""What a full queue's error says, against the device's figures.

``queue_limit`` counts queue entries, and a merged batch waits as one: the refusal then
names the entries against the limit and the requests waiting, the figure
``stats().queued`` and ``wasinn_device_queued`` show, so that an operator comparing the
error with the gauge reads the same numbers. Without batching the two are one number,
said once. It starts with the refused request's run (its model and backend) and device,
and names the pool's setting to raise and its value. A real ONNX Runtime graph, its
device held by a gated job. (A refused
request that had formed a batch of its own is among the requests the device counts
then: the newcomers here would run alone, and are told the figure from before.)
"""

from __future__ import annotations

import functools
import struct
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import wasinn
from tests.support import core_nn_guest_wat, cpu_pool, in_process_guests, require_backend
from wasinn import Batching, QueueFullError
from wasinn.modelgen import affine_onnx


async def compute_into(graph: wasinn.Graph, value: float, outcomes: dict[float, Any]
                       ) -> None:
    try:
        await graph.compute({"x": np.full((1, 4), value, np.float32)})
        outcomes[value] = "ran"
    except QueueFullError as exc:
        outcomes[value] = exc


async def refused_while_full(batching: Batching | None, waiting: int, rows: int = 1
                             ) -> tuple[QueueFullError, int, dict[float, Any]]:
    """One worker, ``queue_limit = 2``, its slot held; ``waiting`` one-row requests
    queue, then one of ``rows`` rows comes. Its error, the device's ``queued`` figure
    then, and every outcome."""
    require_backend("onnxruntime")
    outcomes: dict[float, Any] = {}
    gate = threading.Event()
    async with wasinn.Runtime(cpu_pool(workers=1, queue_limit=2)) as rt:
        graph = await rt.load([affine_onnx()], "onnx", batching=batching, name="affine")
        (actor,) = rt.actors
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(actor.execute, lambda: gate.wait(30)))
            await trio.testing.wait_all_tasks_blocked()
            try:
                for value in range(waiting):
                    nursery.start_soon(compute_into, graph, float(value), outcomes)
                    await trio.testing.wait_all_tasks_blocked()
                queued = rt.stats()[0].queued
                with pytest.raises(QueueFullError) as refused:
                    await graph.compute({"x": np.zeros((rows, 4), np.float32)})
            finally:
                gate.set()
    return refused.value, queued, outcomes


async def test_a_full_queue_of_merged_batches_names_entries_and_requests() -> None:
    # Two batches of two: the queue's two entries are its limit, for four requests. The
    # newcomer has max_batch rows, so it would have run alone, a plain entry: the
    # figure it is told is the one the device showed before it came.
    error, queued, outcomes = await refused_while_full(Batching(max_batch=2), 4, rows=2)
    assert queued == 4
    assert str(error) == (
        "run of affine (onnxruntime) on cpu: the request queue is full (2 of 2 entries, 4 "
        "requests waiting: a merged batch is one entry): retry later or raise [pools.cpu] "
        "queue_limit (now 2)")
    assert outcomes == {0.0: "ran", 1.0: "ran", 2.0: "ran", 3.0: "ran"}


async def test_without_batching_entries_and_requests_are_one_number() -> None:
    error, queued, outcomes = await refused_while_full(None, 2)
    assert queued == 2
    assert str(error) == ("run of affine (onnxruntime) on cpu: the request queue is full "
                          "(2 waiting): retry later or raise [pools.cpu] queue_limit (now 2)")
    assert outcomes == {0.0: "ran", 1.0: "ran"}


async def test_a_core_guest_refused_by_a_full_queue_gets_busy(tmp_path: Path) -> None:
    # Before: too_large (7), which also says "a buffer too small" or "a guest limit": the
    # guest could not tell a refusal it may retry from one for good. WITX has busy (4).
    require_backend("onnxruntime")
    from wasinn.host.abi import Errno

    memory = bytearray(640)
    struct.pack_into("<2IB3xII", memory, 128, 256, 2, 1, 512, 16)  # x: f32[1, 4] at 512
    struct.pack_into("<2I", memory, 256, 1, 4)
    guest = tmp_path / "busy.wat"
    guest.write_text(core_nn_guest_wat(memory, affine_onnx(), """
    (drop (call $set (local.get $ctx) (i32.const 0) (i32.const 128)))
    (call $exit (call $compute (local.get $ctx)))"""))
    gate = threading.Event()
    config = in_process_guests(cpu_pool(workers=1, queue_limit=1))
    async with wasinn.Runtime(config) as rt:
        graph = await rt.load([affine_onnx()], "onnx")
        (actor,) = rt.actors
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(actor.execute, lambda: gate.wait(30)))
            await trio.testing.wait_all_tasks_blocked()
            try:
                nursery.start_soon(compute_into, graph, 1.0, {})  # the queue's one entry
                await trio.testing.wait_all_tasks_blocked()
                assert await rt.run_wasm(guest) == Errno.BUSY
            finally:
                gate.set()
        assert await rt.run_wasm(guest) == Errno.SUCCESS  # the queue drained: it runs
