"""Sandbox processes started ahead of sandboxed loads (``[runtime] sandbox_spares``).

What is checked is what makes a spare worth having: it is a real process that has
imported the library before any load asks for it (its memory maps hold ONNX Runtime's
native module), the next load of that kind runs in it, it is replaced once that load
has ended, it takes the bound of the graph it serves, a dead one is never handed out,
and closing the pool (or the runtime) kills every spare. And what keeps it out of the
way: it imports at idle priority and runs at the normal one, and a load does not wait
for a spare still importing. How much faster a load is, is
for ``benchmarks/sandbox_overhead.py``.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from typing import Any

import numpy as np
import psutil
import pytest
import trio

import wasinn
from tests.crashing_backend import CRASH, DEAF, IMPORT_GATE, CrashingBackend
from tests.support import cpu_pool, require_backend, sandbox_children
from wasinn import BackendRuntimeError, GraphEncoding, Tensor
from wasinn.backends import Backend, Device, LoadOptions
from wasinn.backends._sandbox_child import SPARE_NICE
from wasinn.backends.base import Cancellation, running_under
from wasinn.backends.registry import BackendRegistry
from wasinn.backends.sandbox import (
    CANCEL_GRACE_S,
    MAX_SPARES,
    ProcessLimit,
    SandboxedGraph,
    Spares,
    load_sandboxed,
)
from wasinn.configs import ConfigError
from wasinn.configs.loader import parse_config
from wasinn.modelgen import affine_onnx

CPU = Device.parse("cpu")
ONES = {"x": Tensor.from_numpy(np.ones((1, 4), np.float32))}


def _children() -> set[int]:
    return {p.pid for p in sandbox_children()}


def _has_imported_onnxruntime(pid: int) -> bool:
    try:
        return any("onnxruntime_pybind11_state" in m.path
                   for m in psutil.Process(pid).memory_maps())
    except psutil.NoSuchProcess:
        return False


class _Pool:
    """A pool of ``keep`` spares and the graphs loaded through it, all closed at the end
    of the ``with`` block."""

    def __init__(self, keep: int, most: int | None = None) -> None:
        self.spares = Spares(keep, limit=ProcessLimit(most))
        self._graphs: list[SandboxedGraph] = []

    def load(self, model: bytes = b"fake:add=1", options: LoadOptions | None = None, *,
             backend: Backend | None = None, processes: int = 1) -> SandboxedGraph:
        """``model`` loaded sandboxed through the pool (by default with the fake
        backend whose recipes ``tests/crashing_backend.py`` reads)."""
        if backend is None:
            backend, encoding = CrashingBackend(), GraphEncoding.GGML
        else:
            encoding = GraphEncoding.ONNX
        graph = load_sandboxed(backend, [model], encoding, CPU, options, spares=self.spares,
                               processes=processes)
        self._graphs.append(graph)
        return graph

    def wait_ready(self, count: int = 1) -> None:
        """Until ``count`` spares have imported their library (a load takes no other)."""
        deadline = time.monotonic() + 60
        while self.spares.ready() < count:
            assert time.monotonic() < deadline, "the spares never imported their library"
            time.sleep(0.02)

    def __enter__(self) -> _Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        for graph in self._graphs:
            graph.close()
        self.spares.close()


def test_the_next_load_runs_in_a_spare_that_imported_the_library_ahead() -> None:
    require_backend("onnxruntime")
    backend = BackendRegistry().get("onnxruntime")
    with _Pool(1) as pool:
        assert (pool.spares.waiting(), _children()) == (0, set())
        first = pool.load(affine_onnx(2.0, 1.0), backend=backend)
        assert pool.spares.waiting() == 1  # started once the load had ended
        (spare,) = _children() - {first.pid}
        deadline = time.monotonic() + 60
        while not _has_imported_onnxruntime(spare):  # with no load asked of it
            assert time.monotonic() < deadline, "the spare never imported ONNX Runtime"
            time.sleep(0.05)
        pool.wait_ready()
        second = pool.load(affine_onnx(3.0, 0.0), backend=backend)
        assert second.pid == spare
        assert pool.spares.waiting() == 1 and len(_children()) == 3  # a new spare
        for graph in (first, second):
            np.testing.assert_array_equal(graph.run(ONES)["y"].numpy(),
                                          np.full((1, 4), 3.0, np.float32))
    assert _children() == set()


def test_a_spare_takes_the_memory_bound_of_the_graph_it_serves() -> None:
    with _Pool(1) as pool:
        first = pool.load(options=LoadOptions(sandbox=True, max_sandbox_bytes=3 << 30))
        (spare,) = _children() - {first.pid}
        pool.wait_ready()
        second = pool.load(options=LoadOptions(sandbox=True, max_sandbox_bytes=2 << 30))
        assert second.pid == spare
        assert first.pid is not None
        assert psutil.Process(first.pid).rlimit(psutil.RLIMIT_DATA) == (3 << 30, 3 << 30)
        assert psutil.Process(spare).rlimit(psutil.RLIMIT_DATA) == (2 << 30, 2 << 30)


def test_the_reload_after_a_crash_runs_in_the_spare() -> None:
    with _Pool(1) as pool:
        graph = pool.load(b"fake:add=2")
        (spare,) = _children() - {graph.pid}
        pool.wait_ready()
        with pytest.raises(BackendRuntimeError, match=r"was killed by SIGSEGV"):
            graph.run({"x": Tensor.from_numpy(np.full((1, 4), CRASH, np.float32))})
        np.testing.assert_array_equal(graph.run(ONES)["y"].numpy(),
                                      np.full((1, 4), 3.0, np.float32))
        assert graph.pid == spare and pool.spares.waiting() == 1


def test_a_spare_that_died_is_not_handed_out() -> None:
    with _Pool(1) as pool:
        first = pool.load()
        (spare,) = _children() - {first.pid}
        process = psutil.Process(spare)
        process.kill()
        process.wait(30)
        second = pool.load()
        assert second.pid not in (None, spare, first.pid)
        np.testing.assert_array_equal(second.run(ONES)["y"].numpy(),
                                      np.full((1, 4), 2.0, np.float32))


def test_a_closed_pool_kills_its_spares_and_keeps_no_more() -> None:
    with _Pool(2) as pool:
        graph = pool.load()
        assert pool.spares.waiting() == 2 and len(_children()) == 3
        pool.spares.close()
        pool.spares.close()  # idempotent
        assert pool.spares.waiting() == 0 and _children() == {graph.pid}
        with pytest.raises(BackendRuntimeError, match=r"was killed by SIGSEGV"):
            graph.run({"x": Tensor.from_numpy(np.full((1, 4), CRASH, np.float32))})
        graph.run(ONES)  # a process of its own: the pool starts no spare after it
        assert pool.spares.waiting() == 0 and _children() == {graph.pid}
    assert _children() == set()


def test_no_spares_means_each_load_starts_its_own_process() -> None:
    with _Pool(0) as pool:
        graph = pool.load()
        assert pool.spares.waiting() == 0 and _children() == {graph.pid}


@pytest.mark.skipif(sys.platform != "linux", reason="thread priorities are Linux's")
def test_a_spare_imports_at_idle_priority_and_serves_at_the_normal_one() -> None:
    with _Pool(1) as pool:
        plain = pool.load(b"fake:add=0:priorities")
        pool.wait_ready()
        spare = pool.load(b"fake:add=0:priorities")
        normal = [os.SCHED_OTHER, os.getpriority(os.PRIO_PROCESS, 0)]
        # (policy, nice) of the thread that imported the backend, then of the one running
        got = plain.run(ONES)["y"].numpy().astype(int).tolist()
        assert got == [[*normal, *normal]]
        got = spare.run(ONES)["y"].numpy().astype(int).tolist()
        assert got == [[os.SCHED_IDLE, SPARE_NICE, *normal]]


@pytest.mark.skipif(sys.platform != "linux", reason="thread priorities are Linux's")
def test_a_load_does_not_wait_for_a_spare_still_importing(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = tmp_path / "gate"
    gate.touch()  # a spare's import waits while it exists (tests/crashing_backend.py)
    monkeypatch.setenv(IMPORT_GATE, str(gate))
    with _Pool(1) as pool:
        first = pool.load()
        (spare,) = _children() - {first.pid}
        second = pool.load()  # the spare has not imported the backend: not taken
        assert second.pid not in (spare, first.pid)
        assert (pool.spares.waiting(), pool.spares.ready()) == (1, 0)
        gate.unlink()
        pool.wait_ready()
        third = pool.load()
        assert third.pid == spare
        for graph in (first, second, third):
            np.testing.assert_array_equal(graph.run(ONES)["y"].numpy(),
                                          np.full((1, 4), 2.0, np.float32))


@pytest.mark.parametrize("keep", [-1, MAX_SPARES + 1])
def test_a_pool_size_out_of_range_is_refused(keep: int) -> None:
    with pytest.raises(ValueError, match=rf"^keep={keep}: expected 0 to {MAX_SPARES}$"):
        Spares(keep)


# -- in a runtime -------------------------------------------------------------------------
async def test_a_runtime_keeps_one_spare_by_default_and_closes_it() -> None:
    require_backend("onnxruntime")
    async with wasinn.Runtime(cpu_pool(backends=["onnxruntime"])) as rt:
        graphs = [await rt.load([affine_onnx(2.0, float(i))], "onnx",
                                options={"sandbox": True}) for i in range(3)]
        for i, graph in enumerate(graphs):
            out = await graph.compute({"x": np.ones((1, 4), np.float32)})
            np.testing.assert_array_equal(out["y"].numpy(),
                                          np.full((1, 4), 2.0 + i, np.float32))
        assert len(_children()) == 4  # three graphs and one spare
        for graph in graphs:
            await graph.unload()
        await trio.sleep(0)
        assert len(_children()) == 1  # the spare
    assert _children() == set()


async def test_a_runtime_left_from_a_cancelled_scope_closes_its_spare_too() -> None:
    # A timeout, Ctrl-C or a sibling's error leaves ``async with`` cancelled: aclose runs
    # under that cancellation, and the spare must not outlive the runtime.
    require_backend("onnxruntime")
    with trio.CancelScope() as scope:
        async with wasinn.Runtime(cpu_pool(backends=["onnxruntime"])) as rt:
            graph = await rt.load([affine_onnx()], "onnx", options={"sandbox": True})
            await graph.compute({"x": np.ones((1, 4), np.float32)})
            assert len(_children()) == 2  # the graph's process and the spare
            scope.cancel()
    assert scope.cancel_called
    assert _children() == set()


def _spares_config(value: Any) -> Any:
    return parse_config({"runtime": {"sandbox_spares": value}}, None)


def test_the_config_takes_the_number_of_spares() -> None:
    assert parse_config({}, None).runtime.sandbox_spares == 1
    assert _spares_config(0).runtime.sandbox_spares == 0
    for bad in (-1, MAX_SPARES + 1, True, "1"):
        with pytest.raises(ConfigError, match=r"runtime\.sandbox_spares"):
            _spares_config(bad)


# -- the host's bound on sandbox processes -------------------------------------------------
def _values(graph: SandboxedGraph) -> list[float]:
    return graph.run(ONES)["y"].numpy().reshape(-1).tolist()  # type: ignore[no-any-return]


class _Deaf:
    """A run of ``graph`` that ignores its cancellation (tests/crashing_backend.py's 777),
    in a thread, holding one of its processes busy until :meth:`stop` (then the process
    is killed, ``CANCEL_GRACE_S`` after its cancel)."""

    def __init__(self, graph: SandboxedGraph) -> None:
        self.cancellation = Cancellation()
        self.errors: list[BaseException] = []
        idle = len(graph.pids)
        self._thread = threading.Thread(target=self._run, args=(graph,))
        self._thread.start()
        deadline = time.monotonic() + 30
        while len(graph._idle) >= idle:  # until it has taken a process
            assert time.monotonic() < deadline, "the deaf run never started"
            time.sleep(0.01)

    def _run(self, graph: SandboxedGraph) -> None:
        try:
            with running_under(self.cancellation):
                graph.run({"x": Tensor.from_numpy(np.full((1, 4), DEAF, np.float32))})
        except BaseException as exc:
            self.errors.append(exc)

    def stop(self) -> None:
        self.cancellation.cancel()
        self._thread.join(CANCEL_GRACE_S + 30)
        assert not self._thread.is_alive()


def _in_thread(call: Any, cancellation: Cancellation | None = None
               ) -> tuple[threading.Thread, list[Any]]:
    """``call()`` in a thread (under ``cancellation``): the thread, and what it returned
    or raised, once it has."""
    done: list[Any] = []

    def target() -> None:
        try:
            with running_under(cancellation):
                done.append(call())
        except BaseException as exc:
            done.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    return thread, done


def _until_waiting(limit: ProcessLimit) -> None:
    deadline = time.monotonic() + 30
    while limit.wanting < 1:
        assert time.monotonic() < deadline, "nothing waited for room"
        time.sleep(0.01)


def test_at_the_bound_a_start_ends_the_idle_process_of_the_graph_used_least_recently() -> None:
    with _Pool(0, most=2) as pool:
        limit = pool.spares.limit
        first, second = pool.load(b"fake:add=1"), pool.load(b"fake:add=2")
        assert _values(first) == [2.0] * 4  # used more recently than the second
        firsts = first.pids
        third = pool.load(b"fake:add=3")  # at the bound: the second's process goes
        assert (limit.live, limit.ended_idle) == (2, 1)
        assert second.pids == [] and first.pids == firsts
        assert _children() == {*firsts, *third.pids}
        # The second runs again in a process started for it, which ends the first's (the
        # third loaded since), and that is no crash.
        assert _values(second) == [3.0] * 4
        assert first.pids == [] and (limit.live, limit.ended_idle) == (2, 2)
        assert second.backoff.crashes == 0
        assert _values(first) == [2.0] * 4
        assert _values(third) == [4.0] * 4
        assert len(_children()) == 2
        for graph in (first, second, third):
            graph.close()
        assert (limit.live, _children()) == (0, set())


def test_the_count_goes_down_as_graphs_close_and_frees_room_without_ending_any() -> None:
    with _Pool(0, most=2) as pool:
        limit = pool.spares.limit
        first, second = pool.load(), pool.load()
        assert limit.live == 2
        first.close()
        assert limit.live == 1 and _children() == set(second.pids)
        third = pool.load()
        assert (limit.live, limit.ended_idle) == (2, 0) and second.pids != []
        second.close()
        third.close()
        assert (limit.live, _children()) == (0, set())


def test_a_spare_counts_is_started_only_below_the_bound_and_goes_first(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = tmp_path / "gate"
    gate.touch()  # the spare's import waits while it exists: no load takes it
    monkeypatch.setenv(IMPORT_GATE, str(gate))
    with _Pool(1, most=2) as pool:
        limit = pool.spares.limit
        first = pool.load()
        (spare,) = _children() - set(first.pids)
        assert (limit.live, pool.spares.waiting()) == (2, 1)
        second = pool.load()  # needs a process of its own: the spare, not the first, goes
        assert spare not in _children() and first.pids != []
        assert (limit.live, limit.ended_idle, pool.spares.waiting()) == (2, 0, 0)
        assert _children() == {*first.pids, *second.pids}  # and no spare after it
        gate.unlink()


def test_when_every_process_is_busy_a_load_waits_for_one_its_cancel_honoured() -> None:
    with _Pool(0, most=1) as pool:
        limit = pool.spares.limit
        first = pool.load()
        deaf = _Deaf(first)
        try:
            cancellation = Cancellation()
            thread, done = _in_thread(pool.load, cancellation)
            _until_waiting(limit)
            assert limit.live == 1 and _children() == set(first.pids)  # nothing started
            cancellation.cancel()
            thread.join(30)
            (error,) = done
            assert isinstance(error, BackendRuntimeError)
            assert error.message == (
                "crashing: cancelled while waiting for a sandbox process: the host runs its "
                "most, 1 ([runtime] max_sandbox_processes), and every one was busy")
            # A load not cancelled waits until the busy process is done, then loads.
            thread, done = _in_thread(functools.partial(pool.load, b"fake:add=5"))
            _until_waiting(limit)
            deaf.stop()  # the deaf run's process is killed: room for the load
            thread.join(30)
            (second,) = done
            assert isinstance(second, SandboxedGraph), second
            assert _values(second) == [6.0] * 4
            assert _values(first) == [2.0] * 4  # ends the second's idle process
            assert limit.live == 1 and len(_children()) == 1
        finally:
            deaf.stop()


def test_a_graph_beside_its_busy_process_waits_for_it_rather_than_end_anothers() -> None:
    # A second process for a run beside a busy one starts only below the bound: two busy
    # graphs do not end each other's copies in turn.
    with _Pool(0, most=2) as pool:
        limit = pool.spares.limit
        busy = pool.load(processes=2)
        other = pool.load(b"fake:add=2")
        others = other.pids
        deaf = _Deaf(busy)
        try:
            thread, done = _in_thread(lambda: _values(busy))
            deadline = time.monotonic() + 30
            while not busy._cond._waiters:  # type: ignore[attr-defined]
                assert time.monotonic() < deadline, "the run never waited"
                time.sleep(0.01)
            assert (limit.live, other.pids, done) == (2, others, [])
            deaf.stop()  # then it has a process again, in the slot the deaf one freed
            thread.join(30)
            assert done == [[2.0] * 4]
            assert (limit.live, limit.ended_idle, other.pids) == (2, 0, others)
        finally:
            deaf.stop()


async def test_a_runtime_bounds_its_sandbox_processes_as_configured() -> None:
    config = parse_config({"runtime": {"max_sandbox_processes": 2, "sandbox_spares": 0},
                           "pools": {"cpu": {"kind": "cpu", "devices": ["cpu"],
                                             "backends": ["crashing"]}}}, None)
    async with wasinn.Runtime(config, backends=[CrashingBackend()]) as rt:
        graphs = [await rt.load([f"fake:add={i}".encode()], "ggml",
                                options={"sandbox": True}) for i in range(4)]
        for _ in range(2):
            for i, graph in enumerate(graphs):
                out = await graph.compute({"x": np.ones((1, 4), np.float32)})
                np.testing.assert_array_equal(out["y"].numpy(),
                                              np.full((1, 4), 1.0 + i, np.float32))
                assert len(_children()) <= 2
    assert _children() == set()


def test_the_config_takes_the_most_sandbox_processes() -> None:
    from wasinn.backends._sandbox_limit import LEAST_DEFAULT, default_max_processes

    assert parse_config({}, None).runtime.max_sandbox_processes is None
    assert ProcessLimit().most == default_max_processes() >= LEAST_DEFAULT
    config = parse_config({"runtime": {"max_sandbox_processes": 3}}, None)
    assert config.runtime.max_sandbox_processes == 3
    for bad in (0, -1, True, "2", 2.0):
        with pytest.raises(ConfigError, match=r"runtime\.max_sandbox_processes"):
            parse_config({"runtime": {"max_sandbox_processes": bad}}, None)
    with pytest.raises(ValueError, match=r"^most=0: expected at least 1 sandbox process"):
        ProcessLimit(0)
