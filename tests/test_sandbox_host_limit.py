"""The bound this Python process shares on its sandbox processes (``host_limit``).

Sandboxed loads given no spares, and every runtime whose configuration leaves
``[runtime] max_sandbox_processes`` unset, count their processes against one bound made
from the machine, so that neither a direct ``load_sandboxed`` nor two runtimes side by
side start more processes than the machine's bound; a runtime that sets the key has a
bound of its own. Each test puts a small bound in place of the machine's, and checks the
processes counted, the idle one ended to make room (that graph still runs) and a cancel
honoured while waiting for room.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import wasinn
import wasinn.backends._sandbox_limit as sandbox_limit
from tests.crashing_backend import DEAF, CrashingBackend
from tests.support import cpu_pool, no_spares, require_backend, sandbox_children
from wasinn import BackendRuntimeError, GraphEncoding, Tensor
from wasinn.backends import Device
from wasinn.backends.base import Cancellation, running_under
from wasinn.backends.registry import BackendRegistry
from wasinn.backends.sandbox import (
    ProcessLimit,
    SandboxedGraph,
    default_max_processes,
    host_limit,
    load_sandboxed,
)
from wasinn.modelgen import affine_onnx

CPU = Device.parse("cpu")
ONES = np.ones((1, 4), np.float32)


@pytest.fixture
def small_host_limit(monkeypatch: pytest.MonkeyPatch) -> Iterator[ProcessLimit]:
    """A host bound of 2 processes in place of the machine's, for this test; every
    sandbox process ended by its end."""
    limit = ProcessLimit(2)
    monkeypatch.setattr(sandbox_limit, "_host_limit", limit)
    yield limit
    assert limit.live == 0 and sandbox_children() == []


def _children() -> set[int]:
    return {p.pid for p in sandbox_children()}


def _y(graph: SandboxedGraph) -> float:
    """The first output value of ``graph`` on ones (an affine model: its scale + bias)."""
    return float(graph.run({"x": Tensor.from_numpy(ONES)})["y"].numpy()[0, 0])


def _until_waiting(limit: ProcessLimit) -> None:
    deadline = time.monotonic() + 30
    while limit.wanting < 1:
        assert time.monotonic() < deadline, "nothing waited for room under the host's bound"
        time.sleep(0.01)


def test_the_host_limit_is_made_once_from_the_machine(monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:
    monkeypatch.setattr(sandbox_limit, "_host_limit", None)  # as in a fresh process
    got: list[ProcessLimit] = []
    threads = [threading.Thread(target=lambda: got.append(host_limit())) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({id(limit) for limit in got}) == 1 and host_limit() is got[0]
    assert got[0].most == default_max_processes() and got[0].live == 0


def test_loads_without_spares_end_the_idle_process_used_least_recently_at_the_bound(
        small_host_limit: ProcessLimit) -> None:
    require_backend("onnxruntime")
    limit = small_host_limit
    backend = BackendRegistry().get("onnxruntime")
    graphs = []
    try:
        for scale in (2.0, 3.0, 4.0):
            graphs.append(load_sandboxed(backend, [affine_onnx(scale, 1.0)],
                                         GraphEncoding.ONNX, CPU))
            if scale == 3.0:
                assert (limit.live, limit.ended_idle) == (2, 0)
                assert _y(graphs[0]) == 3.0  # the second is now used least recently
        first, second, third = graphs
        firsts = first.pids
        # The third's load, at the bound, ended the second's idle process.
        assert (limit.live, limit.ended_idle) == (2, 1)
        assert second.pids == [] and first.pids == firsts
        assert _children() == {*firsts, *third.pids}
        # The second runs again in a process started for it, ending the first's, and that
        # is no crash.
        assert _y(second) == 4.0
        assert first.pids == [] and (limit.live, limit.ended_idle) == (2, 2)
        assert second.backoff.crashes == 0 and len(_children()) == 2
    finally:
        for graph in graphs:
            graph.close()
    assert (limit.live, _children()) == (0, set())


def test_a_load_without_spares_waits_for_room_under_the_host_bound_its_cancel_honoured(
        monkeypatch: pytest.MonkeyPatch) -> None:
    limit = ProcessLimit(1)
    monkeypatch.setattr(sandbox_limit, "_host_limit", limit)
    first = load_sandboxed(CrashingBackend(), [b"fake:add=1"], GraphEncoding.GGML, CPU)
    deaf = Cancellation()  # a run that ignores its cancel, holding the only process busy
    deaf_ended: list[BaseException] = []
    threads = []
    try:
        def run_deaf() -> None:
            try:
                with running_under(deaf):
                    first.run({"x": Tensor.from_numpy(np.full((1, 4), DEAF, np.float32))})
            except BaseException as exc:
                deaf_ended.append(exc)

        threads.append(threading.Thread(target=run_deaf))
        threads[-1].start()
        deadline = time.monotonic() + 30
        while first._idle:  # until the deaf run has taken the process
            assert time.monotonic() < deadline, "the deaf run never started"
            time.sleep(0.01)
        cancellation = Cancellation()
        done: list[Any] = []

        def load() -> None:
            try:
                with running_under(cancellation):
                    load_sandboxed(CrashingBackend(), [b"fake:add=2"], GraphEncoding.GGML,
                                   CPU)
            except BaseException as exc:
                done.append(exc)

        threads.append(threading.Thread(target=load))
        threads[-1].start()
        _until_waiting(limit)
        assert limit.live == 1 and _children() == set(first.pids)  # nothing started
        cancellation.cancel()
        threads[-1].join(30)
        (error,) = done
        assert isinstance(error, BackendRuntimeError)
        assert error.message == (
            "crashing: cancelled while waiting for a sandbox process: the host runs its "
            "most, 1 ([runtime] max_sandbox_processes), and every one was busy")
        assert limit.live == 1
    finally:
        deaf.cancel()  # its process is killed a moment later
        for thread in threads:
            thread.join(30)
        first.close()
    (ended,) = deaf_ended
    assert isinstance(ended, BackendRuntimeError) and "did not stop" in ended.message
    assert (limit.live, _children()) == (0, set())


def _onnx_config(most: int | None = None) -> Any:
    config = no_spares(cpu_pool(backends=["onnxruntime"]))
    if most is None:
        return config
    runtime = config.runtime.model_copy(update={"max_sandbox_processes": most})
    return config.model_copy(update={"runtime": runtime})


async def _y_of(graph: Any) -> float:
    out = await graph.compute({"x": ONES})
    return float(out["y"].numpy()[0, 0])


async def test_runtimes_that_leave_the_bound_unset_share_the_hosts(
        small_host_limit: ProcessLimit) -> None:
    require_backend("onnxruntime")
    limit = small_host_limit
    sandboxed = {"sandbox": True}
    async with (wasinn.Runtime(_onnx_config()) as one,
                wasinn.Runtime(_onnx_config()) as two):
        first = await one.load([affine_onnx(2.0, 1.0)], "onnx", options=sandboxed)
        second = await two.load([affine_onnx(3.0, 1.0)], "onnx", options=sandboxed)
        assert (limit.live, limit.ended_idle, len(_children())) == (2, 0, 2)
        # A third, in the first runtime, ends the idle process used least recently: the
        # first's, in the other runtime's count too.
        third = await one.load([affine_onnx(4.0, 1.0)], "onnx", options=sandboxed)
        assert (limit.live, limit.ended_idle, len(_children())) == (2, 1, 2)
        assert [await _y_of(g) for g in (first, second, third)] == [3.0, 4.0, 5.0]
        assert limit.live == 2 and len(_children()) == 2
        # A runtime that sets the key has a bound of its own: its processes are not the
        # host's, and at its bound it ends its own idle one.
        async with wasinn.Runtime(_onnx_config(most=1)) as own:
            ended = limit.ended_idle
            mine = [await own.load([affine_onnx(5.0 + i, 1.0)], "onnx", options=sandboxed)
                    for i in range(2)]
            assert (limit.live, limit.ended_idle, len(_children())) == (2, ended, 3)
            assert await _y_of(mine[1]) == 7.0
    assert (limit.live, _children()) == (0, set())



def test_a_graph_dropped_without_close_gives_its_place_back(
        small_host_limit: ProcessLimit) -> None:
    # The bound holds the graphs whose idle processes it may end only weakly: one dropped
    # without close() is collected, and its process ends, freeing its place.
    require_backend("onnxruntime")
    backend = BackendRegistry().ref("onnxruntime")
    graph = load_sandboxed(backend, [affine_onnx(2.0, 1.0)], GraphEncoding.ONNX, CPU)
    assert _y(graph) == 3.0 and small_host_limit.live == 1
    dropped = weakref.ref(graph)
    del graph
    gc.collect()
    assert dropped() is None
    assert small_host_limit.live == 0  # (and no process left: the fixture checks it)
