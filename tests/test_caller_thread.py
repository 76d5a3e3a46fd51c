"""Requests run by the caller's own thread (what guests do) and inline runs of tiny
graphs, through the public scheduler API with ONNX Runtime. Where a run happened is told
by the device actor's counters: its worker threads count every job they finish."""

from __future__ import annotations

import contextlib
import functools
import gc
import warnings
import weakref
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import wasinn
from tests.loop_model import GUARD_S, HUGE_LOOP, LONG_LOOP, loop_inputs, loop_onnx
from tests.support import cpu_pool, require_backend
from wasinn.actors.inline import RunProfile
from wasinn.configs.loader import packaged_config
from wasinn.configs.schema import PoolConfig
from wasinn.modelgen import affine_onnx

X = np.arange(4, dtype=np.float32).reshape(1, 4)
#: Loop iterations for a run of about 10 ms.
SHORT_LOOP = 15_000
Y = X * 2 + 1


def runtime(inline_below_us: float) -> wasinn.Runtime:
    require_backend("onnxruntime")
    return wasinn.Runtime(cpu_pool(inline_below_us=inline_below_us))


@pytest.fixture
async def rt() -> AsyncIterator[wasinn.Runtime]:
    async with runtime(0) as runtime_:
        yield runtime_


async def wait_for_load(actor: Any, load: int) -> None:
    # The caller's thread needs a moment to reach trio: wait (bounded) until it queued.
    with trio.fail_after(30):
        while actor.load != load:
            await trio.sleep(0.001)


async def test_compute_in_caller_thread_runs_in_that_thread(rt: wasinn.Runtime) -> None:
    graph = await rt.load([affine_onnx()], "onnx")
    (cpu,) = rt.actors
    ctx = graph.init_execution_context()
    before = cpu.threads.finished

    def guest() -> list[Any]:
        return [ctx.compute_in_caller_thread({"x": X})["y"].numpy() for _ in range(3)]

    results = await trio.to_thread.run_sync(guest)
    for y in results:
        np.testing.assert_array_equal(y, Y)
    assert cpu.threads.finished == before  # no job reached the worker thread
    assert ctx.get_output("y").numpy().tolist() == Y.tolist()


async def test_compute_in_caller_thread_refuses_the_trio_thread(rt: wasinn.Runtime) -> None:
    # Whether or not a slot is free: it never runs the backend on the event loop (with a
    # free slot it used to, silently).
    graph = await rt.load([affine_onnx()], "onnx")
    (cpu,) = rt.actors
    ctx = graph.init_execution_context()
    await ctx.compute({"x": X})  # compiled: a slot would be leased at once
    for call in (functools.partial(ctx.compute_in_caller_thread, {"x": X}),
                 ctx.run_in_caller_thread):
        with pytest.raises(RuntimeError, match="trio thread, whose event loop it would"):
            call()
    assert cpu.load == 0  # no slot taken


async def test_run_in_caller_thread_fills_bound_outputs(rt: wasinn.Runtime) -> None:
    graph = await rt.load([affine_onnx()], "onnx")
    ctx = graph.init_execution_context()
    out = np.zeros((1, 4), np.float32)
    ctx.set_input("x", X)
    ctx.set_output("y", out)
    await trio.to_thread.run_sync(ctx.run_in_caller_thread)
    np.testing.assert_array_equal(out, Y)


async def test_a_caller_thread_request_queues_when_the_device_is_busy(
        rt: wasinn.Runtime) -> None:
    graph = await rt.load([affine_onnx()], "onnx")
    (cpu,) = rt.actors
    ctx = graph.init_execution_context()
    held = await ctx.lease({"x": X})  # the only slot, held by "another guest"
    assert ctx.try_lease({"x": X}) is None
    results: list[Any] = []

    async def guest() -> None:
        out = await trio.to_thread.run_sync(ctx.compute_in_caller_thread, {"x": X})
        results.append(out["y"].numpy())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(guest)
        await wait_for_load(cpu, 2)  # queued in trio, in the policy's order
        assert results == []
        await trio.to_thread.run_sync(held.run)
    np.testing.assert_array_equal(results[0], Y)
    assert cpu.load == 0


async def test_a_queued_caller_thread_request_is_dropped_on_cancel(
        rt: wasinn.Runtime) -> None:
    graph = await rt.load([affine_onnx()], "onnx")
    (cpu,) = rt.actors
    ctx = graph.init_execution_context()
    held = await ctx.lease({"x": X})
    ran: list[object] = []

    async def guest(scope: trio.CancelScope) -> None:
        with scope:
            ran.append(await trio.to_thread.run_sync(ctx.compute_in_caller_thread, {"x": X}))

    scope = trio.CancelScope()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(guest, scope)
        await wait_for_load(cpu, 2)
        scope.cancel()
    assert scope.cancelled_caught and ran == [] and cpu.load == 1
    held.cancel()
    await trio.testing.wait_all_tasks_blocked()
    assert cpu.load == 0


@pytest.mark.parametrize(("inline_below_us", "inline"), [(10_000, True), (0, False)])
async def test_tiny_graphs_run_inline_only_when_configured(inline_below_us: float,
                                                           inline: bool) -> None:
    async with runtime(inline_below_us) as rt:
        graph = await rt.load([affine_onnx()], "onnx")
        (cpu,) = rt.actors
        ctx = graph.init_execution_context()
        before = cpu.threads.finished
        for _ in range(RunProfile.WARMUP + 5):
            np.testing.assert_array_equal((await ctx.compute({"x": X}))["y"].numpy(), Y)
        in_workers = cpu.threads.finished - before
        assert in_workers == (RunProfile.WARMUP if inline else RunProfile.WARMUP + 5)
        # A larger input than any timed one goes to the worker thread again.
        big = np.ones((64, 4), np.float32)
        await ctx.compute({"x": big})
        assert cpu.threads.finished - before == in_workers + 1


async def test_a_sandboxed_graph_never_runs_inline() -> None:
    # Its run may wait for a process (its start, the crash back-off, room under the
    # host's process cap), which must not hold the event loop: every run goes to the
    # worker thread, however quick (10 ms, the bound's most, qualifies it here).
    async with runtime(10_000) as rt:
        graph = await rt.load([affine_onnx()], "onnx", options={"sandbox": True})
        (cpu,) = rt.actors
        before = cpu.threads.finished
        for _ in range(RunProfile.WARMUP + 5):
            np.testing.assert_array_equal((await graph.compute({"x": X}))["y"].numpy(), Y)
        assert cpu.threads.finished - before == RunProfile.WARMUP + 5
        await graph.unload()


async def test_inline_runs_are_off_by_default() -> None:
    require_backend("onnxruntime")
    assert PoolConfig(kind="cpu").inline_below_us == 0
    assert packaged_config().pools["cpu"].inline_below_us == 0
    async with wasinn.Runtime() as rt:  # the embedded default config
        (cpu,) = rt.actors
        assert cpu.inline_below == 0
        graph = await rt.load([affine_onnx()], "onnx")
        before = cpu.threads.finished
        for _ in range(RunProfile.WARMUP + 5):
            await graph.compute({"x": X})
        assert cpu.threads.finished - before == RunProfile.WARMUP + 5  # all in the thread


async def test_a_qualified_graph_still_times_out_when_its_inputs_make_it_slow() -> None:
    # The graph qualifies for inline runs by its input SIZE, but an ONNX Loop's run time
    # depends on the VALUE of its trip count: a request with a timeout must not be run on
    # the event loop, where it could neither be abandoned nor time out.
    async with runtime(10_000) as rt:
        (cpu,) = rt.actors
        graph = await rt.load([loop_onnx()], "onnx")
        for _ in range(RunProfile.WARMUP + 5):
            out = await graph.compute(loop_inputs(1))
        before = cpu.threads.finished
        await graph.compute(loop_inputs(1))
        assert cpu.threads.finished == before  # qualified: this one ran inline
        with pytest.raises(wasinn.TimeoutError_):
            await graph.compute(loop_inputs(LONG_LOOP), timeout=0.05)
        assert cpu.threads.abandoned == 1  # it went to the worker thread, abandoned there
    assert out["y"].numpy().tolist() == [[1.0] * 4]


@pytest.mark.parametrize("path", ["queued through trio", "free slot taken in the thread"])
async def test_a_caller_thread_run_is_stopped_when_its_timeout_passes(path: str) -> None:
    # The run happens in the caller's thread, so it cannot be abandoned: the device must
    # stop it (ONNX Runtime's terminate flag) once the timeout passes, and free the slot.
    require_backend("onnxruntime")
    async with wasinn.Runtime(cpu_pool(workers=1, backends=["onnxruntime"])) as rt:
        graph = await rt.load([loop_onnx()], "onnx", "cpu")
        ctx = graph.init_execution_context()
        if path == "free slot taken in the thread":  # compiled: try_lease takes the slot
            await ctx.compute(loop_inputs(1))
        with trio.fail_after(GUARD_S):
            with pytest.raises(wasinn.errors.TimeoutError_,
                               match=r"deadline passed while it ran.*\(timeout=0\.2 s\)$"):
                await trio.to_thread.run_sync(
                    lambda: ctx.compute_in_caller_thread(loop_inputs(HUGE_LOOP), timeout=0.2))
            # The graph's own one-shot lease names its timeout too.
            if path == "queued through trio":
                lease = await graph.lease(loop_inputs(HUGE_LOOP), timeout=0.2)
            else:
                taken = graph.try_lease(loop_inputs(HUGE_LOOP), timeout=0.2)
                assert taken is not None  # compiled, the slot free
                lease = taken
            with pytest.raises(wasinn.errors.TimeoutError_,
                               match=r"deadline passed while it ran.*\(timeout=0\.2 s\)$"):
                await trio.to_thread.run_sync(lease.run)
            # The device's only slot is free again, and the thread's next run is not stopped.
            out = await trio.to_thread.run_sync(
                lambda: ctx.compute_in_caller_thread(loop_inputs(2), timeout=GUARD_S))
        assert out["y"].numpy().tolist() == [[2.0] * 4]
        ctx.close()


@pytest.mark.parametrize("when", ["before it ran", "while it ran"])
async def test_an_interrupted_caller_thread_run_is_counted_as_cancelled(when: str) -> None:
    """A guest cancelled by its own caller interrupts the run its thread holds: the
    caller gave up, as for an abandoned compute, so the request counts as cancelled (not
    as failed: nothing went wrong on the device)."""
    require_backend("onnxruntime")
    async with wasinn.Runtime(cpu_pool(workers=1, backends=["onnxruntime"])) as rt:
        graph = await rt.load([loop_onnx()], "onnx", "cpu")
        ctx = graph.init_execution_context()
        run = await ctx.lease(loop_inputs(HUGE_LOOP if when == "while it ran" else 1))
        (actor,) = rt.actors
        with trio.fail_after(GUARD_S):
            if when == "before it ran":
                run.interrupt()
                with pytest.raises(wasinn.BackendRuntimeError, match="interrupted before"):
                    await trio.to_thread.run_sync(run.run)
            else:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(expect_interrupted, run)
                    while not in_backend(run):
                        await trio.sleep(0.01)
                    run.interrupt()
        stats, model = actor.stats(), graph.stats()
        assert (stats.cancelled, stats.failed, stats.running) == (1, 0, 0)
        assert (model.cancelled, model.failed) == (1, 0)
        ctx.close()


def in_backend(run: Any) -> bool:
    """Whether the caller's thread has entered the backend's run: ONNX Runtime has hooked
    its terminate flag to the run's cancellation (an interrupt from then on stops the
    run inside the library)."""
    return bool(run._lease.cancellation._callbacks)


async def expect_interrupted(run: Any) -> None:
    with pytest.raises(wasinn.BackendRuntimeError, match="interrupted while it ran"):
        await trio.to_thread.run_sync(run.run)


async def test_a_thread_trio_did_not_start_queues_when_the_device_is_busy() -> None:
    """From an application's own thread (threading.Thread), the same whatever the load:
    a free slot is taken there, and a busy device queues the request in the runtime's
    trio run."""
    import threading

    async with wasinn.Runtime(cpu_pool(workers=1, backends=["onnxruntime"])) as rt:
        graph = await rt.load([affine_onnx()])
        hog = await rt.load([loop_onnx()])
        ctx = graph.init_execution_context()
        await ctx.compute({"x": X})  # compiled: an idle device's slot is taken in the thread
        (actor,) = rt.actors
        results: list[object] = []

        def own_thread() -> None:
            try:
                results.append(ctx.compute_in_caller_thread({"x": X})["y"].numpy().tolist())
            except Exception as exc:
                results.append(exc)

        async def in_own_thread() -> None:
            thread = threading.Thread(target=own_thread)
            thread.start()
            await trio.to_thread.run_sync(thread.join)

        await in_own_thread()  # idle
        with trio.fail_after(GUARD_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(hog.compute, loop_inputs(LONG_LOOP))
                while not actor.busy:
                    await trio.sleep(0.01)
                nursery.start_soon(in_own_thread)  # busy: it has to queue
                while not actor.queued:
                    await trio.sleep(0.01)
                assert actor.busy  # the hog still holds the only slot
        assert results == [[[1.0, 3.0, 5.0, 7.0]]] * 2
        ctx.close()


async def test_a_thread_of_another_trio_run_queues_in_the_runtimes_run(
        rt: wasinn.Runtime) -> None:
    """A thread ``trio.to_thread`` started in another trio run (an application running
    trio.run in a thread of its own) is served as any thread of the application's: on a
    busy device its request queues in the runtime's run. Before, it went to its own run,
    which refused it (RuntimeError) whenever the device was busy."""
    graph = await rt.load([affine_onnx()], "onnx")
    (cpu,) = rt.actors
    ctx = graph.init_execution_context()
    results: list[object] = []

    def in_another_trio_run() -> None:
        def call() -> None:
            try:
                results.append(ctx.compute_in_caller_thread({"x": X})["y"].numpy().tolist())
            except Exception as exc:
                results.append(exc)

        async def other() -> None:
            await trio.to_thread.run_sync(call)

        trio.run(other)

    await trio.to_thread.run_sync(in_another_trio_run)  # idle: taken in that thread
    held = await ctx.lease({"x": X})  # the only slot
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.to_thread.run_sync, in_another_trio_run)
        await wait_for_load(cpu, 2)  # queued in this run, in the policy's order
        assert len(results) == 1
        await trio.to_thread.run_sync(held.run)
    assert results == [Y.tolist()] * 2
    assert cpu.load == 0


async def test_a_lease_whose_deadline_passed_before_its_run_never_runs() -> None:
    # A run that will be thrown away is not started (a torch run could not be stopped):
    # the holder gets TimeoutError_ at once and the slot is free again.
    from tests.support import serving_actor

    ran: list[str] = []
    async with serving_actor(workers=1) as actor:
        lease = await actor.lease(lambda: ran.append("ran"),
                                  deadline=trio.current_time() + 0.02)
        while not lease.cancellation.cancelled:  # the device's deadline watcher
            await trio.sleep(0.01)
        with pytest.raises(wasinn.TimeoutError_, match="deadline passed before it ran"):
            await trio.to_thread.run_sync(lease.run)
        assert (ran, actor.stats().running, actor.stats().timed_out) == ([], 0, 1)


async def test_finished_caller_thread_runs_with_a_timeout_leave_nothing_behind() -> None:
    # A run's deadline is watched until it passes, but neither its inputs nor an entry
    # per finished run are kept that long. Runs of about 10 ms: each is still
    # going when the device actor starts watching it.
    require_backend("onnxruntime")
    async with wasinn.Runtime(cpu_pool(workers=1, backends=["onnxruntime"])) as rt:
        graph = await rt.load([loop_onnx()], "onnx", "cpu")
        ctx = graph.init_execution_context()
        await ctx.compute(loop_inputs(1))  # compiled: the runs below take the free slot
        (actor,) = rt.actors

        def run(inputs: dict[str, np.ndarray[Any, Any]]) -> None:
            ctx.compute_in_caller_thread(inputs, timeout=3600)

        inputs = loop_inputs(SHORT_LOOP)
        alive = weakref.ref(inputs["x"])
        await trio.to_thread.run_sync(run, inputs)
        assert actor.watched_leases == 1  # watched, and kept until its deadline
        del inputs
        gc.collect()
        assert alive() is None  # ... but without the job and its inputs
        for _ in range(150):
            await trio.to_thread.run_sync(run, loop_inputs(SHORT_LOOP))
        assert 0 < actor.watched_leases <= 64  # finished ones were dropped along the way
        ctx.close()


async def test_a_dropped_lease_gives_its_slot_and_graph_back_with_a_warning(
        rt: wasinn.Runtime) -> None:
    # A holder that never runs nor cancels its lease (a bug) must not stall the device for
    # ever: collected, the lease gives its slot back in trio and says so.
    graph = await rt.load([affine_onnx()], "onnx")
    (cpu,) = rt.actors
    ctx = graph.init_execution_context()
    await ctx.compute({"x": X})  # compiled
    workers = cpu.stats().workers
    runs = [await ctx.lease({"x": X}) for _ in range(workers)]
    assert cpu.stats().running == workers
    with pytest.warns(ResourceWarning, match="dropped without being run or cancelled"):
        del runs
        gc.collect()
    await trio.testing.wait_all_tasks_blocked()
    assert cpu.stats().running == 0
    with trio.fail_after(30):  # the slots serve again
        np.testing.assert_array_equal((await ctx.compute({"x": X}))["y"].numpy(), Y)
    # The graph it held is let go of: an unload closes it at once.
    (key,) = cpu.session_keys()
    session = cpu.cached_session(key)
    assert session is not None
    ctx.close()
    await graph.unload()
    assert session.evicted and session._users == 0


async def test_an_ended_lease_is_collected_without_a_warning(rt: wasinn.Runtime) -> None:
    graph = await rt.load([affine_onnx()], "onnx")
    ctx = graph.init_execution_context()
    run = await ctx.lease({"x": X})
    await trio.to_thread.run_sync(run.run)
    cancelled = await ctx.lease({"x": X})
    cancelled.cancel()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del run, cancelled
        gc.collect()
    (cpu,) = rt.actors
    assert cpu.stats().running == 0
    ctx.close()


async def test_a_dropped_lease_frees_its_slot_even_when_its_warning_is_an_error(
        rt: wasinn.Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    # Under -W error the warning raises inside __del__ (reported as unraisable): the
    # give-back must already be on its way by then.
    graph = await rt.load([affine_onnx()], "onnx")
    (cpu,) = rt.actors
    ctx = graph.init_execution_context()
    run = await ctx.lease({"x": X})
    unraisable: list[Any] = []
    monkeypatch.setattr("sys.unraisablehook", unraisable.append)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del run
        gc.collect()
    assert [type(u.exc_value) for u in unraisable] == [ResourceWarning]
    await trio.testing.wait_all_tasks_blocked()
    assert cpu.stats().running == 0
    ctx.close()


async def test_on_a_busy_device_a_caller_thread_request_runs_where_the_slot_frees() -> None:
    """A caller's-thread request that finds the device busy queues as compute does: the
    worker thread that ends the running job starts it at once (passed on, no caller's
    thread waiting for trio to grant it the slot), and the caller's thread gets its
    outputs, recorded on the context and written into its bound buffer."""
    async with wasinn.Runtime(cpu_pool(workers=1, backends=["onnxruntime"])) as rt:
        graph = await rt.load([affine_onnx()])
        hog = await rt.load([loop_onnx()])
        ctx = graph.init_execution_context()
        await ctx.compute({"x": X})
        await hog.compute(loop_inputs(1))  # both compiled
        (actor,) = rt.actors
        before = actor.stats()
        out = np.zeros((1, 4), np.float32)
        ctx.set_input("x", X)
        ctx.set_output("y", out)
        with trio.fail_after(GUARD_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(hog.compute, loop_inputs(LONG_LOOP))
                while not actor.busy:
                    await trio.sleep(0.01)
                nursery.start_soon(functools.partial(trio.to_thread.run_sync,
                                                     ctx.run_in_caller_thread))
                while not actor.queued:
                    await trio.sleep(0.01)
                assert actor.busy  # the hog still runs: the request waits for its slot
        after = actor.stats()
        assert after.passed_on - before.passed_on == 1
        assert after.in_caller_thread == before.in_caller_thread
        assert after.completed - before.completed == 2
        np.testing.assert_array_equal(out, Y)
        np.testing.assert_array_equal(ctx.get_output("y").numpy(), Y)
        ctx.close()


def test_a_thread_trio_did_not_start_hears_the_runtime_went_away_with_its_trio_run() -> None:
    """Its trio run ended (the runtime never closed) while the thread's request was
    queued: ClosedResourceError, as after a close, not trio.Cancelled (a BaseException
    such a thread has no trio task to expect)."""
    import threading

    require_backend("onnxruntime")
    got: list[BaseException] = []
    held: list[Any] = []
    thread: list[threading.Thread] = []

    def own_thread(ctx: wasinn.ExecutionContext) -> None:
        try:
            ctx.compute_in_caller_thread({"x": X})
        except BaseException as exc:
            got.append(exc)

    async def main() -> None:
        rt = wasinn.Runtime(cpu_pool(workers=1))
        await rt.start()  # never closed: it stops when trio.run ends
        graph = await rt.load([affine_onnx()])
        held.append(await graph.init_execution_context().lease({"x": X}))  # the one slot
        thread.append(threading.Thread(target=own_thread,
                                       args=(graph.init_execution_context(),)))
        thread[0].start()
        await wait_for_load(rt.actors[0], 2)  # its request is queued

    trio.run(main)
    thread[0].join(30)
    held[0].cancel()
    assert len(got) == 1 and isinstance(got[0], wasinn.ClosedResourceError), got
    assert "the trio run serving the runtime ended" in str(got[0])


async def test_a_request_refused_at_once_lets_the_event_loop_run() -> None:
    # A full queue says "retry later": a caller that retries at once must not hold the
    # loop (a refusal without a checkpoint would: nothing else could run, the queue
    # would never drain, and no timeout could end it).
    from wasinn.configs.loader import parse_config

    config = parse_config({"pools": {"cpu": {"kind": "cpu", "devices": ["cpu"],
                                             "workers": 1, "queue_limit": 2}}}, None)
    async with wasinn.Runtime(config) as full:
        graph = await full.load([affine_onnx()])
        ctx = graph.init_execution_context()
        run = await ctx.lease({"x": X})  # holds the only slot
        async with trio.open_nursery() as nursery:
            for _ in range(2):  # and two queued: the queue is full
                nursery.start_soon(ctx.compute, {"x": X})
            await wait_for_load(full.actors[0], 3)
            run.cancel()  # the slot is free; trio grants it at its next turn
            for _ in range(1000):
                try:
                    out = await ctx.compute({"x": X})
                    break
                except wasinn.TooLargeError:
                    continue
            else:
                pytest.fail("1000 refusals in a row: the queued requests never ran")
        assert out["y"].numpy().tolist() == Y.tolist()
        closed = graph.init_execution_context()
        closed.close()
        for _ in range(3):  # closed: refused at once, every time, yet the loop runs
            with pytest.raises(wasinn.ClosedResourceError), trio.testing.assert_checkpoints():
                await closed.compute({"x": X})
        # ...and a deadline ends a loop that retries a request refused for good.
        with trio.move_on_after(0.05) as scope:
            while True:
                with contextlib.suppress(wasinn.ClosedResourceError):
                    await closed.compute({"x": X})
        assert scope.cancelled_caught
        # Loads refused at once yield too (a name not registered, bytes no backend reads).
        for refused in (lambda: full.load_by_name("nope"), lambda: full.load([b"junk"])):
            with pytest.raises(wasinn.WasiNNError), trio.testing.assert_checkpoints():
                await refused()
