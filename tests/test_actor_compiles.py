"""Compiles and warm-ups run in a device's compile threads, not in its worker threads: a
graph compiling (or warming up) on a device never keeps a request for another graph
there waiting, however few worker threads the device has. A pool's ``compile_threads``
(1 by default) compiles that many graphs at once; one graph compiles once. A graph
unloaded while it compiles is not kept: its compile is cancelled (a sandboxed load's
process killed), and one that lands all the same is closed, not cached; so is one that
lands after the actor closed, or that landed as its job failed or the actor closed. Real
threads, real trio; the tests order events (a request's job opens the gate a compile
waits on) instead of timing them: a timeout here only keeps a broken build from
hanging."""

from __future__ import annotations

import functools
import os
import re
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import wasinn
from tests.crashing_backend import CrashingBackend
from tests.fake_backend import FakeBackend, FakeGraph
from tests.support import (
    cooperative_job,
    require_backend,
    sandbox_children,
    serving_actor,
    until_cancelled,
)
from wasinn import BackendRuntimeError, ClosedResourceError, ConfigError
from wasinn.actors import DeviceActor
from wasinn.actors import device as device_module
from wasinn.actors.devicectx import DeviceContext
from wasinn.actors.session import Session
from wasinn.actors.sessioncache import SessionCache
from wasinn.backends.base import CompiledGraph, Device
from wasinn.backends.sandbox import SandboxedGraph, load_sandboxed
from wasinn.configs.loader import load_config, parse_config
from wasinn.enums import ExecutionTarget, GraphEncoding
from wasinn.modelgen import affine_onnx
from wasinn.tensor import Tensor

CPU = Device(ExecutionTarget.CPU)
#: How long a gated compile waits for the request that should open its gate: only ever
#: reached when that request cannot run (the defect), never a measure of speed.
GUARD_S = 5.0


@pytest.fixture
async def actor() -> AsyncIterator[DeviceActor]:
    async with serving_actor(workers=1, queue_limit=8) as started:
        yield started


@pytest.fixture
def fake() -> FakeBackend:
    return FakeBackend()


def fake_graph(fake: FakeBackend, add: int = 1) -> CompiledGraph:
    return fake.load([f"fake:add={add}".encode()], GraphEncoding.GGML, CPU)


def gated(result: Callable[[], Any], gate: threading.Event, entered: threading.Event,
          order: list[str], what: str) -> Callable[[], Any]:
    """A compile (or warm-up) that waits for ``gate`` (opened by a request's job), notes
    whether it was opened or gave up, then returns ``result()``."""
    def job() -> Any:
        entered.set()
        order.append(f"{what} ends" if gate.wait(GUARD_S) else f"{what} gave up")
        return result()
    return job


def run_of(session: Session, gate: threading.Event, order: list[str]
           ) -> Callable[[], list[list[float]]]:
    """A request's job: runs ``session``'s graph, then opens ``gate``."""
    def job() -> list[list[float]]:
        order.append("request ran")
        gate.set()
        x = Tensor.from_numpy(np.zeros((1, 4), np.float32))
        y: list[list[float]] = session.compiled.run({"x": x})["y"].numpy().tolist()
        return y
    return job


async def test_a_request_runs_while_another_graph_compiles_on_the_only_worker(
        actor: DeviceActor, fake: FakeBackend) -> None:
    """workers = 1: a compile in progress does not hold the thread a request of an
    already compiled graph needs (before: the request waited for the compile, which here
    would only end by giving up once ``GUARD_S`` had passed)."""
    ready = await actor.session("ready", functools.partial(fake_graph, fake), "fake")
    gate, compiling = threading.Event(), threading.Event()
    order: list[str] = []
    big = gated(functools.partial(fake_graph, fake, 2), gate, compiling, order, "compile")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor.session, "big", big, "fake")
        await trio.to_thread.run_sync(compiling.wait, GUARD_S)
        assert await actor.execute(run_of(ready, gate, order)) == [[1.0] * 4]
    assert order == ["request ran", "compile ends"]
    assert actor.cached("big") and actor.stats().compiles == 2


async def test_a_request_runs_while_a_warm_up_runs_on_the_only_worker(
        actor: DeviceActor, fake: FakeBackend) -> None:
    """Warm-ups run in the compile thread too (they hold no slot either)."""
    ready = await actor.session("ready", functools.partial(fake_graph, fake), "fake")
    gate, warming = threading.Event(), threading.Event()
    order: list[str] = []
    warm_up = gated(lambda: None, gate, warming, order, "warm-up")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor.warm_up, warm_up)
        await trio.to_thread.run_sync(warming.wait, GUARD_S)
        assert await actor.execute(run_of(ready, gate, order)) == [[1.0] * 4]
    assert order == ["request ran", "warm-up ends"]
    assert actor.stats().warm_ups == 1


class _Compiled(FakeGraph):
    """A fake graph that notes the thread that compiled it."""

    def __init__(self, fake: FakeBackend) -> None:
        super().__init__(fake, CPU, 1.0, gated=False)
        self.thread = threading.get_ident()


async def test_compiles_and_warm_ups_have_a_thread_of_their_own(fake: FakeBackend) -> None:
    async with serving_actor(workers=2) as actor:
        workers = {thread.ident for thread in actor.threads.threads}
        session = await actor.session("m", functools.partial(_Compiled, fake), "fake")
        warmed_in: list[int] = []
        await actor.warm_up(lambda: warmed_in.append(threading.get_ident()))
        (compiler,) = actor.compiler.threads
        assert isinstance(session.compiled, _Compiled)
        assert session.compiled.thread == compiler.ident == warmed_in[0]
        assert compiler.ident not in workers
        assert compiler.name == "wasinn cpu compiler 0"
    assert not compiler.is_alive()  # stopped and joined with the worker threads


async def test_a_compile_that_lands_after_its_graph_was_unloaded_is_closed(
        actor: DeviceActor, fake: FakeBackend) -> None:
    """Every caller gave up, then the graph was unloaded (a guest killed while its model
    compiled): the compile, which goes on, is closed when it lands, not cached."""
    gate, compiling = threading.Event(), threading.Event()
    compiled: list[CompiledGraph] = []
    unloaded = False

    def compile_graph() -> CompiledGraph:
        compiling.set()
        gate.wait(GUARD_S)
        compiled.append(fake_graph(fake))
        return compiled[-1]

    with trio.CancelScope() as caller:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(actor.session, "m", compile_graph, "fake",
                                                 wanted=lambda: not unloaded))
            await trio.to_thread.run_sync(compiling.wait, GUARD_S)
            caller.cancel()  # the only caller gives up; the compile goes on
    unloaded = True
    actor.evict("m")  # (what unloading does: nothing is cached yet)
    gate.set()
    with trio.fail_after(GUARD_S):
        while actor.stats().compiles == 0:  # (it lands, and is dealt with, in one step)
            await trio.sleep(0.001)
    (graph,) = compiled
    assert isinstance(graph, FakeGraph) and graph.closed and fake.closed == ["cpu"]
    assert not actor.cached("m") and actor.stats().graphs == 0


def stoppable(started: threading.Event, log: list[str], fake: FakeBackend
              ) -> Callable[[], CompiledGraph]:
    """A compile that runs until its job is cancelled (as a sandboxed load is: its
    process killed), noting "stopped", or gives up after ``GUARD_S``, noting "ran out"
    and returning a graph."""
    def compile_graph() -> CompiledGraph:
        if until_cancelled(started, GUARD_S):
            log.append("stopped")
            raise RuntimeError("interrupted")
        log.append("ran out")
        return fake_graph(fake)
    return compile_graph


async def test_the_compile_of_a_graph_unloaded_meanwhile_is_stopped(
        actor: DeviceActor, fake: FakeBackend) -> None:
    """Every caller gave up, then the graph was unloaded: its compile is cancelled, so a
    backend that can stop a load frees the compile thread at once for the next graph
    (before: the compile ran to its end, and the next one waited for it)."""
    started, log = threading.Event(), list[str]()
    unloaded = False
    with trio.CancelScope() as caller:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(
                actor.session, "m", stoppable(started, log, fake), "fake",
                wanted=lambda: not unloaded))
            await trio.to_thread.run_sync(started.wait, GUARD_S)
            caller.cancel()
    unloaded = True
    actor.evict("m")
    await actor.session("next", functools.partial(fake_graph, fake), "fake")
    assert log == ["stopped"]
    assert actor.session_keys() == ["next"] and actor.stats().compiles == 1


async def test_an_unloaded_graphs_sandboxed_load_has_its_process_killed(
        actor: DeviceActor, tmp_path: Path) -> None:
    """The real case: a guest's own model loads in a sandbox process (a minute here);
    the guest is killed, its graph unloaded: the process is killed, not waited for."""
    slow = tmp_path / "slow"
    slow.touch()  # the process takes a minute to load the model
    unloaded = False
    compile_graph = functools.partial(
        load_sandboxed, CrashingBackend(), [f"fake:add=1:slowload-if={slow}".encode()],
        GraphEncoding.GGML, CPU)
    with trio.fail_after(30):  # (only a guard: without the kill it waits the minute)
        with trio.CancelScope() as caller:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(
                    actor.session, "m", compile_graph, "crashing",
                    wanted=lambda: not unloaded))
                while not await trio.to_thread.run_sync(sandbox_children):
                    await trio.sleep(0.01)
                caller.cancel()
        unloaded = True
        actor.evict("m")
        await actor.session("next", functools.partial(fake_graph, FakeBackend()), "fake")
    assert await trio.to_thread.run_sync(sandbox_children) == []
    assert actor.session_keys() == ["next"] and actor.stats().compiles == 1


async def test_a_caller_waiting_for_a_compile_stopped_by_an_unload_is_told_so(
        actor: DeviceActor, fake: FakeBackend) -> None:
    started, log = threading.Event(), list[str]()
    unloaded = False

    async def unload_once_started() -> None:
        nonlocal unloaded
        await trio.to_thread.run_sync(started.wait, GUARD_S)
        unloaded = True
        actor.evict("m")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(unload_once_started)
        with pytest.raises(ClosedResourceError, match="unloaded while it compiled"):
            await actor.session("m", stoppable(started, log, fake), "fake",
                                wanted=lambda: not unloaded)
    assert log == ["stopped"] and not actor.cached("m")


async def test_closing_cancels_a_compile_and_waits_for_its_thread(
        fake: FakeBackend) -> None:
    started, log = threading.Event(), list[str]()
    actor = DeviceActor(CPU, workers=1)
    errors: list[BaseException] = []

    stopped = cooperative_job(started, log)

    def compile_graph() -> CompiledGraph:
        stopped()  # raises once cancelled
        return fake_graph(fake)

    async def ask() -> None:
        try:
            await actor.session("m", compile_graph, "fake")
        except ClosedResourceError as exc:
            errors.append(exc)

    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as outer, trio.open_nursery() as nursery:
            await nursery.start(actor.serve)
            outer.start_soon(ask)
            await trio.to_thread.run_sync(started.wait, GUARD_S)
            nursery.cancel_scope.cancel()  # closes the actor
    assert log == ["stopped"] and len(errors) == 1 and "closed" in str(errors[0])
    assert not any(t.is_alive() for t in actor.compiler.threads)
    assert actor.busy == 0 and not actor.cached("m")


async def test_close_timeout_bounds_the_wait_for_a_compile_that_ignores_cancellation(
        caplog: pytest.LogCaptureFixture, fake: FakeBackend) -> None:
    gate, compiling = threading.Event(), threading.Event()
    actor = DeviceActor(CPU, workers=1, close_timeout=0.2)
    compile_graph = gated(functools.partial(fake_graph, fake), gate, compiling, [], "compile")
    try:
        with trio.fail_after(GUARD_S):
            async with trio.open_nursery() as nursery:
                await nursery.start(actor.serve)
                nursery.start_soon(actor.session, "m", compile_graph, "fake")
                await trio.to_thread.run_sync(compiling.wait, GUARD_S)
                nursery.cancel_scope.cancel()
        (thread,) = actor.compiler.threads
        assert thread.is_alive()  # left behind, a daemon
        (record,) = [r for r in caplog.records if r.name == "wasinn.actors"]
        assert "cpu" in record.message and "compile" in record.message
    finally:
        gate.set()


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux affinity masks and two CPUs to tell them apart")
async def test_a_warm_up_after_pinned_runs_may_use_every_cpu() -> None:
    """On a pool with pinned hand-offs a worker thread waits for its next job on the
    loop's CPU. Before, a warm-up (or compile) that worker ran next ran on that one CPU
    too, and so did the threads a library started in it; the compile thread is never
    pinned."""
    own_mask = frozenset(os.sched_getaffinity(0))
    home = frozenset((min(own_mask),))
    actor = DeviceActor(CPU, workers=1, pin_handoffs=True)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(actor.serve)
            worker = await actor.execute(threading.get_native_id)
            with trio.fail_after(GUARD_S):  # it narrows itself once it handed back
                while frozenset(os.sched_getaffinity(worker)) != home:
                    await trio.sleep(0.001)
            seen: list[frozenset[int]] = []
            await actor.warm_up(lambda: seen.append(frozenset(os.sched_getaffinity(0))))
            assert seen == [own_mask]
            nursery.cancel_scope.cancel()
    finally:
        os.sched_setaffinity(0, own_mask)


# -- through the runtime ------------------------------------------------------------------
SLOW = [b"fake:add=1:slowload"]  # its compile on a GPU waits for fake.load_gate


@pytest.fixture
async def one_gpu(fake: FakeBackend) -> AsyncIterator[wasinn.Runtime]:
    config = parse_config({"pools": {
        "cpu": {"kind": "cpu", "devices": ["cpu"], "backends": ["fake"]},
        "gpu": {"kind": "gpu", "devices": ["gpu:0"], "workers": 1, "backends": ["fake"]},
    }}, None)
    async with wasinn.Runtime(config, backends=[fake]) as runtime:
        try:
            yield runtime
        finally:
            fake.load_gate.set()  # (before the runtime closes: it would wait for it)


async def test_a_guests_compute_runs_while_another_model_loads_on_the_device(
        one_gpu: wasinn.Runtime, fake: FakeBackend) -> None:
    """Two models on one GPU with one worker: the second's first compute compiles it (a
    load of seconds to minutes), and the first model's computes go on meanwhile. The
    compile's gate opens only once that compute is back (before, the compute waited for
    the compile: stuck until the guard below failed the test)."""
    ready = await one_gpu.load([b"fake:add=1"], "ggml", "gpu")
    await ready.compute({"x": np.zeros((1, 4), np.float32)})  # compiled on gpu:0
    slow = await one_gpu.load(SLOW, "ggml", "cpu")  # compiled on the GPU at first use
    with trio.fail_after(GUARD_S * 2):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(
                slow.compute, {"x": np.zeros((1, 4), np.float32)}, target="gpu"))
            await trio.to_thread.run_sync(fake.loading.wait, GUARD_S)
            out = await ready.compute({"x": np.ones((1, 4), np.float32)})
            assert not fake.load_gate.is_set()  # the compile is still held
            fake.load_gate.set()
    assert out["y"].numpy().tolist() == [[2.0] * 4]
    assert fake.loads.count("gpu:0") == 2



# -- compile threads ------------------------------------------------------------------------
async def test_two_compile_threads_compile_two_graphs_at_once(fake: FakeBackend) -> None:
    """``compile_threads = 2``: both compiles are under way before either is let go (with
    one thread the second would only start once the first gave up, after ``GUARD_S``)."""
    gate = threading.Event()
    entered = {key: threading.Event() for key in ("a", "b")}
    order: list[str] = []
    async with serving_actor(workers=1, compile_threads=2) as actor:
        try:
            async with trio.open_nursery() as nursery:
                for key, event in entered.items():
                    nursery.start_soon(actor.session, key, gated(
                        functools.partial(fake_graph, fake), gate, event, order, key), "fake")
                for event in entered.values():
                    assert await trio.to_thread.run_sync(event.wait, GUARD_S)
                assert order == []  # neither let go yet: both were in at once
                gate.set()
        finally:
            gate.set()
        assert sorted(order) == ["a ends", "b ends"]
        assert actor.cached("a") and actor.cached("b") and actor.stats().compiles == 2
        assert sorted(t.name for t in actor.compiler.threads) == [
            "wasinn cpu compiler 0", "wasinn cpu compiler 1"]


async def test_with_one_compile_thread_a_second_graph_waits_for_the_first(
        actor: DeviceActor, fake: FakeBackend) -> None:
    """The default: a device's compiles run one at a time, first come first served."""
    gate, entered = threading.Event(), threading.Event()
    order: list[str] = []

    def second() -> CompiledGraph:
        order.append("b starts")
        return fake_graph(fake, 2)

    first = gated(functools.partial(fake_graph, fake), gate, entered, order, "a")
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(actor.session, "a", first, "fake")
            assert await trio.to_thread.run_sync(entered.wait, GUARD_S)
            nursery.start_soon(actor.session, "b", second, "fake")
            await trio.testing.wait_all_tasks_blocked()
            assert actor.compiler.busy == 2 and order == []  # b waits for the thread
            gate.set()
    finally:
        gate.set()
    assert order == ["a ends", "b starts"]
    assert actor.cached("a") and actor.cached("b")


async def test_one_graph_compiles_once_however_many_compile_threads(
        fake: FakeBackend) -> None:
    """Two callers of one graph on a device with two compile threads share one compile
    (a thread stays free)."""
    gate, entered = threading.Event(), threading.Event()
    order: list[str] = []
    compile_graph = gated(functools.partial(fake_graph, fake), gate, entered, order, "m")
    sessions: list[Session] = []
    async with serving_actor(compile_threads=2) as actor:

        async def ask() -> None:
            sessions.append(await actor.session("m", compile_graph, "fake"))

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask)
                nursery.start_soon(ask)
                assert await trio.to_thread.run_sync(entered.wait, GUARD_S)
                await trio.testing.wait_all_tasks_blocked()
                assert actor.compiler.busy == 1
                gate.set()
        finally:
            gate.set()
        assert actor.stats().compiles == 1
    assert order == ["m ends"] and fake.loads == ["cpu"]
    assert len(sessions) == 2 and sessions[0] is sessions[1]


def test_an_actor_needs_a_compile_thread() -> None:
    with pytest.raises(ValueError, match="compile_threads must be >= 1"):
        DeviceActor(CPU, compile_threads=0)


@pytest.mark.parametrize(("value", "expected"), [
    ("0", r"Input should be greater than or equal to 1 \(got 0\)"),
    ("65", r"Input should be less than or equal to 64 \(got 65\)"),
    ('"x"', r"Input should be a valid integer \(got 'x'\)"),
    ('"2"', r"Input should be a valid integer \(got '2'\)"),
    ("1.5", r"Input should be a valid integer \(got 1.5\)"),
])
def test_a_bad_compile_threads_names_the_file_and_the_key(
        tmp_path: Path, value: str, expected: str) -> None:
    path = tmp_path / "wasinn.toml"
    path.write_text(f'[pools.cpu]\nkind = "cpu"\ncompile_threads = {value}\n')
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: "
                                          rf"pools\.cpu\.compile_threads: {expected}$"):
        load_config(path)


async def test_a_pools_compile_threads_preload_its_models_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the setting is for: two models preloaded on a CPU pool with
    ``compile_threads = 2`` compile at once (their real ONNX Runtime loads wait for each
    other before they go on: with one thread the first would wait alone until its guard
    broke the start)."""
    require_backend("onnxruntime")
    from wasinn.backends.onnxruntime import OnnxRuntimeBackend

    meeting = threading.Barrier(2, timeout=GUARD_S)
    load = OnnxRuntimeBackend.load

    def meet_then_load(self: OnnxRuntimeBackend, *args: Any, **kwargs: Any) -> Any:
        meeting.wait()
        return load(self, *args, **kwargs)

    monkeypatch.setattr(OnnxRuntimeBackend, "load", meet_then_load)
    (tmp_path / "affine.onnx").write_bytes(affine_onnx(2.0, 1.0))
    path = tmp_path / "wasinn.toml"
    path.write_text('[pools.cpu]\nkind = "cpu"\ndevices = ["cpu"]\ncompile_threads = 2\n'
                    '[models.a]\nfiles = ["affine.onnx"]\nbackend = "onnxruntime"\n'
                    'preload = true\n'
                    '[models.b]\nfiles = ["affine.onnx"]\nbackend = "onnxruntime"\n'
                    'preload = true\n')
    async with wasinn.Runtime(load_config(path)) as runtime:
        (actor,) = runtime.actors
        assert actor.compiler.count == 2 and actor.stats().compiles == 2
        model = await runtime.load_by_name("b")
        out = await model.compute({"x": np.ones((1, 4), np.float32)})
    assert out["y"].numpy().tolist() == [[3.0] * 4]


# -- compiles nobody takes --------------------------------------------------------------------
def deaf(gate: threading.Event, entered: threading.Event,
         compile_graph: Callable[[], CompiledGraph], made: list[CompiledGraph]
         ) -> Callable[[], CompiledGraph]:
    """A compile that makes its graph, then waits for ``gate`` deaf to cancellation (as
    an OpenVINO compile or a torch load does), noting the graph in ``made``."""
    def compile_in_thread() -> CompiledGraph:
        made.append(compile_graph())
        entered.set()
        gate.wait(GUARD_S)
        return made[-1]
    return compile_in_thread


async def test_a_compile_that_lands_after_the_actor_closed_is_closed_once(
        fake: FakeBackend) -> None:
    """The actor closes while a compile that ignores its cancellation runs: its caller
    is told at once, and the graph, landing later, is closed (once) by the compile
    thread, not dropped (before: dropped, its memory left to the garbage collector)."""
    gate, entered = threading.Event(), threading.Event()
    made: list[CompiledGraph] = []
    errors: list[ClosedResourceError] = []
    actor = DeviceActor(CPU, workers=1)

    async def ask() -> None:
        with pytest.raises(ClosedResourceError, match="closed") as caught:
            await actor.session("m", deaf(gate, entered, functools.partial(fake_graph, fake),
                                          made), "fake")
        errors.append(caught.value)

    try:
        with trio.fail_after(GUARD_S):
            async with trio.open_nursery() as nursery:
                await nursery.start(actor.serve)
                async with trio.open_nursery() as callers:
                    callers.start_soon(ask)
                    assert await trio.to_thread.run_sync(entered.wait, GUARD_S)
                    actor.close()  # the caller is told now, the compile goes on
                assert len(errors) == 1 and fake.closed == []
                gate.set()  # it lands: nobody will take it
                nursery.cancel_scope.cancel()  # serve waits for the compile thread
    finally:
        gate.set()
    (graph,) = made
    assert isinstance(graph, FakeGraph) and graph.closed and fake.closed == ["cpu"]
    assert not actor.cached("m") and actor.stats().compiles == 0


async def test_a_sandboxed_compile_that_lands_after_its_device_closed_ends_its_process(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime's close (serve cancelled) while a guest's own model loads in a
    sandbox process: the load lands after ``close_timeout`` (its thread left behind), and
    its process is ended then, by that thread (before: the graph was dropped and its
    process left running)."""
    closes: list[SandboxedGraph] = []
    close = SandboxedGraph.close

    def counted_close(self: SandboxedGraph) -> None:
        closes.append(self)
        close(self)

    monkeypatch.setattr(SandboxedGraph, "close", counted_close)
    gate, entered = threading.Event(), threading.Event()
    made: list[CompiledGraph] = []
    compile_graph = deaf(gate, entered, functools.partial(
        load_sandboxed, CrashingBackend(), [b"fake:add=1"], GraphEncoding.GGML, CPU), made)
    actor = DeviceActor(CPU, workers=1, close_timeout=0)

    async def ask() -> None:
        with pytest.raises(ClosedResourceError, match="closed while the graph compiled"):
            await actor.session("m", compile_graph, "crashing")

    try:
        with trio.fail_after(30):  # (a guard: a sandbox process takes a moment to start)
            async with trio.open_nursery() as outer, trio.open_nursery() as nursery:
                await nursery.start(actor.serve)
                outer.start_soon(ask)
                assert await trio.to_thread.run_sync(entered.wait, 30)
                assert len(await trio.to_thread.run_sync(sandbox_children)) == 1
                nursery.cancel_scope.cancel()
            gate.set()  # after the actor has gone: its compile thread lands the graph
            (thread,) = actor.compiler.threads
            await trio.to_thread.run_sync(thread.join, 30)
    finally:
        gate.set()
    assert closes == made and len(closes) == 1
    assert await trio.to_thread.run_sync(sandbox_children) == []


async def test_a_compile_whose_job_fails_once_the_graph_landed_is_closed(
        fake: FakeBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """The device context's check after a job (a CUDA stream's synchronize finding an
    error) fails the compile after the graph was made: the graph is closed, not cached,
    and the caller gets the failure."""

    class FailsAfterJobs(DeviceContext):
        def wrap(self, job: Callable[[], Any]) -> Callable[[], Any]:
            def checked() -> Any:
                job()
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return checked

    monkeypatch.setattr(device_module, "context_for", FailsAfterJobs)
    made: list[CompiledGraph] = []

    def compile_graph() -> CompiledGraph:
        made.append(fake_graph(fake))
        return made[-1]

    async with serving_actor() as actor:
        with pytest.raises(BackendRuntimeError, match=r"compiling failed: .*illegal memory"):
            await actor.session("m", compile_graph, "fake")
        (graph,) = made
        assert isinstance(graph, FakeGraph) and graph.closed and fake.closed == ["cpu"]
        assert not actor.cached("m") and actor.stats().compiles == 0
    assert fake.closed == ["cpu"]  # once


async def test_a_graph_that_landed_as_the_actor_closed_is_closed_by_its_task(
        fake: FakeBackend) -> None:
    """The compile thread handed its graph over, and the actor's close cancelled the
    compile's task before it took the graph (the hand-over and the cancel in one trio
    step): the task closes the graph, once."""
    landed = trio.Event()

    async def lands_as_the_actor_closes(compile_graph: Callable[[], CompiledGraph]
                                        ) -> CompiledGraph:
        compile_graph()  # (in trio here: a compile thread's part, handing the graph over)
        landed.set()
        await trio.sleep_forever()  # cancelled before the graph is taken
        raise AssertionError("not reached")

    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            cache = SessionCache("cpu", nursery.start_soon, lands_as_the_actor_closes)
            nursery.start_soon(cache.session, "m", functools.partial(fake_graph, fake),
                               "fake")
            await landed.wait()
            assert fake.closed == []
            nursery.cancel_scope.cancel()  # what serve's exit does to the compile task
    assert fake.closed == ["cpu"] and cache.sessions == {} and cache.compiles == 0


async def test_a_compile_one_caller_gave_up_on_is_kept_for_the_one_still_waiting(
        actor: DeviceActor, fake: FakeBackend) -> None:
    """A caller that gives up does not make the compile nobody's: the graph lands,
    is cached for the caller still waiting, and is not closed."""
    gate, entered = threading.Event(), threading.Event()
    order: list[str] = []
    compile_graph = gated(functools.partial(fake_graph, fake), gate, entered, order, "m")
    impatient = trio.CancelScope()
    sessions: list[Session] = []

    async def gives_up() -> None:
        with impatient:
            await actor.session("m", compile_graph, "fake")

    async def waits() -> None:
        sessions.append(await actor.session("m", compile_graph, "fake"))

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(gives_up)
            nursery.start_soon(waits)
            assert await trio.to_thread.run_sync(entered.wait, GUARD_S)
            impatient.cancel()
            await trio.testing.wait_all_tasks_blocked()  # it has gone
            gate.set()
    finally:
        gate.set()
    (session,) = sessions
    assert impatient.cancelled_caught and order == ["m ends"]
    assert actor.cached_session("m") is session and not session.evicted
    assert isinstance(session.compiled, FakeGraph) and not session.compiled.closed
    assert fake.closed == [] and actor.stats().compiles == 1
