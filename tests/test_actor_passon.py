"""A worker thread passes its slot on: when a job ends and requests are queued, the
thread grants the slot to the next one (the queue policy's choice) and, when that
request brought its job prepared, runs it at once, without waiting for the event loop.
Real threads, real trio: the tests hold the event loop (a blocking wait in the trio
thread) to show that the next runs start without it, then check that every caller gets
its own result, that cancellation and closing still reach a job so started, and that the
slot counts come back to zero."""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

from tests.support import (
    cooperative_job,
    cpu_pool,
    gate_job,
    require_backend,
    serving_actor,
)
from wasinn import ClosedResourceError
from wasinn.actors import DeviceActor
from wasinn.actors.workers import WorkerThreads
from wasinn.backends.base import Cancelled, Device
from wasinn.enums import ExecutionTarget

CPU = Device(ExecutionTarget.CPU)
GUARD_S = 10.0  # far more than any job here needs


@pytest.fixture
async def actor() -> AsyncIterator[DeviceActor]:
    async with serving_actor(workers=1, queue_limit=8) as started:
        yield started


def recorded(tag: str, log: list[tuple[str, int]], done: threading.Event | None = None,
             last: int = 0) -> Callable[[], str]:
    """A job that records (tag, its thread) and sets ``done`` once ``log`` has ``last``
    entries."""
    def job() -> str:
        log.append((tag, threading.get_ident()))
        if done is not None and len(log) == last:
            done.set()
        return tag
    return job


async def test_queued_jobs_run_one_after_another_while_the_event_loop_is_held(
        actor: DeviceActor) -> None:
    gate, first_started, done = threading.Event(), threading.Event(), threading.Event()
    log: list[tuple[str, int]] = []
    results: dict[str, str] = {}

    async def request(tag: str, priority: int) -> None:
        results[tag] = await actor.execute(recorded(tag, log, done, 3), priority=priority)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor.execute, gate_job(gate, first_started))
        await trio.to_thread.run_sync(first_started.wait, GUARD_S)
        for tag, priority in [("low", 0), ("high", 5), ("mid", 1)]:
            nursery.start_soon(request, tag, priority)
            await trio.testing.wait_all_tasks_blocked()
        assert actor.queued == 3 and actor.threads.passed_on == 0
        gate.set()
        # The event loop is held here: nothing in trio runs until the wait returns, so
        # each next job is started by the thread that ran the one before it.
        assert done.wait(GUARD_S), f"the queued jobs did not run without trio: {log}"
        assert [tag for tag, _ in log] == ["high", "mid", "low"]  # the policy's order
        assert len({thread for _, thread in log}) == 1
    assert results == {"high": "high", "mid": "mid", "low": "low"}
    assert actor.threads.passed_on == 3
    stats = actor.stats()
    assert (stats.passed_on, stats.running, stats.queued, stats.completed) == (3, 0, 0, 4)


async def test_a_request_without_a_prepared_job_is_granted_the_slot(
        actor: DeviceActor) -> None:
    """A lease queued behind a running job: the thread grants it the slot, and it runs
    in the caller's own thread as leases do."""
    gate, started = threading.Event(), threading.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor.execute, gate_job(gate, started))
        await trio.to_thread.run_sync(started.wait, GUARD_S)
        with trio.fail_after(GUARD_S):
            async with trio.open_nursery() as leasing:
                leasing.start_soon(trio.to_thread.run_sync, gate.set)
                lease = await actor.lease(threading.get_ident)
    assert actor.load == 1  # the lease holds the slot it was passed
    assert await trio.to_thread.run_sync(lease.run) != threading.get_ident()
    assert actor.load == 0 and actor.threads.passed_on == 0


async def test_a_caller_that_gives_up_after_its_job_was_started_abandons_it(
        actor: DeviceActor) -> None:
    gate, first_started, second_started = (threading.Event(), threading.Event(),
                                            threading.Event())
    log: list[str] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor.execute, gate_job(gate, first_started))
        await trio.to_thread.run_sync(first_started.wait, GUARD_S)
        scope = trio.CancelScope()

        async def second() -> None:
            with scope:
                await actor.execute(cooperative_job(second_started, log))

        nursery.start_soon(second)
        await trio.testing.wait_all_tasks_blocked()
        gate.set()
        # Held loop: the second job starts in the worker thread, then its caller gives
        # up before trio has even seen the first job's result.
        assert second_started.wait(GUARD_S)
        scope.cancel()
    assert scope.cancelled_caught
    with trio.fail_after(GUARD_S):  # the second job would otherwise hold the slot 10 s
        assert await actor.execute(lambda: "next") == "next"
    assert log == ["stopped"]
    assert actor.threads.abandoned == 0 and actor.load == 0


async def test_closing_reaches_a_job_a_thread_started_on_its_own() -> None:
    gate, first_started, second_started = (threading.Event(), threading.Event(),
                                           threading.Event())
    log: list[str] = []
    errors: list[BaseException] = []
    actor = DeviceActor(CPU, workers=1)

    async def second() -> None:
        try:
            await actor.execute(cooperative_job(second_started, log))
        except ClosedResourceError as exc:
            errors.append(exc)

    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as outer, trio.open_nursery() as nursery:
            await nursery.start(actor.serve)
            outer.start_soon(actor.execute, gate_job(gate, first_started))
            await trio.to_thread.run_sync(first_started.wait, GUARD_S)
            outer.start_soon(second)
            await trio.testing.wait_all_tasks_blocked()
            gate.set()
            assert second_started.wait(GUARD_S)  # held loop, as above
            nursery.cancel_scope.cancel()  # closes the actor
    assert log == ["stopped"] and len(errors) == 1
    assert not any(t.is_alive() for t in actor.threads.threads)


async def test_a_request_cancelled_while_queued_lets_go_of_its_job_at_once(
        actor: DeviceActor) -> None:
    # The queue drops removed entries lazily; the job a request brought (and the inputs
    # it holds: a guest's copies) must not wait for that.
    import gc
    import weakref

    class Inputs:
        pass

    gate, started = threading.Event(), threading.Event()
    inputs = Inputs()
    held = weakref.ref(inputs)
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(actor.execute, gate_job(gate, started))
            await trio.to_thread.run_sync(started.wait, GUARD_S)
            async with trio.open_nursery() as queued:
                queued.start_soon(actor.execute, functools.partial(id, inputs))
                await trio.testing.wait_all_tasks_blocked()
                assert actor.queued == 1
                queued.cancel_scope.cancel()
            try:
                assert actor.queued == 0
                del inputs
                gc.collect()
                assert held() is None  # while the job before it still runs
            finally:
                gate.set()


class _Compiled:
    """What a compile returns, for the session cache (only closed, never run)."""

    may_run_inline = True
    close_blocks = False

    def close(self) -> None:
        pass


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_compile_and_a_warm_up_get_a_thread_while_the_queue_never_empties(
        workers: int) -> None:
    # Closed-loop callers keep requests queued, so a thread that ends a job always finds
    # one to pass its slot on to; a compile or a warm-up (no slot) must still run, not
    # wait until the load stops (it stops here only once both are done: the guard would
    # fail the test first). They run in the device's compile thread, which the worker
    # threads' passing on never holds; the worker threads' rule (a job that waits for a
    # thread gets the next one free) is kept for jobs handed to them without a slot.
    actor = DeviceActor(CPU, workers=workers)
    done = trio.Event()
    runs = 0

    async def caller() -> None:
        nonlocal runs
        while not done.is_set():
            await actor.execute(lambda: threading.Event().wait(0.001))
            runs += 1

    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(actor.serve)
            async with trio.open_nursery() as callers:
                for _ in range(2 * workers + 2):
                    callers.start_soon(caller)
                while actor.threads.passed_on < 20:  # saturated: runs go back to back
                    await trio.sleep(0.001)
                await actor.warm_up(lambda: None)
                session = await actor.session("second model", _Compiled, "fake")
                assert session is not None and not done.is_set()
                passed = actor.threads.passed_on
                while actor.threads.passed_on < passed + 20:  # and back to passing on
                    await trio.sleep(0.001)
                done.set()
            nursery.cancel_scope.cancel()
    assert actor.queued == 0 and actor.busy == 0


async def test_a_job_a_thread_passes_its_slot_to_as_the_device_closes_is_cancelled(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The thread that ends the first job reads "not stopped", then passes its slot on
    # after the close has stopped the threads but before it closes the slots (held
    # here in that window): the job it then starts must be cancelled, as close cancels
    # every job handed to a thread, not run to its end.
    import time

    from wasinn.actors.slots import Slots

    actor = DeviceActor(CPU, workers=1)
    pass_on, entered, passed = Slots.pass_on, threading.Event(), threading.Event()

    def late_pass_on(slots: Slots, *args: Any) -> object:
        entered.set()  # the thread read "not stopped"
        deadline = time.monotonic() + GUARD_S
        while not actor.threads._stopped and time.monotonic() < deadline:
            time.sleep(0.0005)
        try:
            return pass_on(slots, *args)
        finally:
            passed.set()

    def close_desk_late(close: Callable[[], None]) -> None:
        passed.wait(GUARD_S)  # between stopping the threads and closing the slots
        close()

    monkeypatch.setattr(Slots, "pass_on", late_pass_on)
    monkeypatch.setattr(actor._desk, "close",
                        functools.partial(close_desk_late, actor._desk.close))
    gate, first_started = threading.Event(), threading.Event()
    second_ran: list[bool] = []
    errors: list[BaseException] = []

    async def call(job: Callable[[], object]) -> None:
        try:
            await actor.execute(job)
        except ClosedResourceError as exc:
            errors.append(exc)

    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as outer, trio.open_nursery() as nursery:
            await nursery.start(actor.serve)
            outer.start_soon(call, gate_job(gate, first_started))
            await trio.to_thread.run_sync(first_started.wait, GUARD_S)
            outer.start_soon(call, lambda: second_ran.append(True))
            await trio.testing.wait_all_tasks_blocked()
            assert actor.queued == 1
            gate.set()  # the first job ends
            await trio.to_thread.run_sync(entered.wait, GUARD_S)  # its thread in pass_on
            nursery.cancel_scope.cancel()  # closes the actor
    assert second_ran == [] and len(errors) == 2


async def test_a_job_cancelled_before_its_thread_reaches_it_does_not_start() -> None:
    threads = WorkerThreads("test", 1)
    threads.start()
    ran: list[str] = []
    job = threads.job(lambda: ran.append("ran"), label="doomed")
    job.cancellation.cancel()
    with pytest.raises(Cancelled, match="doomed: cancelled"):
        await threads.run_job(job)
    assert ran == [] and threads.finished == 1
    assert await threads.run(lambda: "still serving") == "still serving"
    threads.stop()
    assert await threads.wait_stopped(GUARD_S) == []


async def test_onnx_runtime_runs_queued_requests_back_to_back() -> None:
    """A real graph (ONNX Runtime, a Loop that keeps it busy for a while) holds the only
    worker; the requests queued meanwhile each get their own result, and every one of
    them was started by the worker thread as the run before it ended."""
    require_backend("onnxruntime")
    import wasinn
    from tests.loop_model import LONG_LOOP, loop_inputs, loop_onnx

    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        graph = await rt.load([loop_onnx()], "onnx")
        (actor,) = rt.actors
        outputs: dict[int, np.ndarray] = {}

        async def compute(m: int) -> None:
            outputs[m] = (await graph.compute(loop_inputs(m)))["y"].numpy()

        await compute(1)  # compiled and warm
        async with trio.open_nursery() as nursery:
            nursery.start_soon(compute, LONG_LOOP)
            await trio.testing.wait_all_tasks_blocked()
            for m in (2, 3, 4):
                nursery.start_soon(compute, m)
                await trio.testing.wait_all_tasks_blocked()
            assert actor.queued == 3, "the long run ended before the others queued"
        for m, y in outputs.items():
            np.testing.assert_array_equal(y, np.full((1, 4), m, np.float32))
        stats = actor.stats()
        assert (stats.passed_on, stats.completed, stats.running) == (3, 5, 0)


async def test_a_caller_handed_a_thread_as_the_threads_stop_is_refused_not_left_waiting(
        ) -> None:
    # The job that ends frees its thread, which goes to the waiting caller; the task
    # that ran the job stops the threads in the same trio step, before that caller
    # resumes. Its job would sit behind the thread's exit and its caller wait for ever.
    threads = WorkerThreads("test", 1)
    threads.start()
    gate = threading.Event()
    outcome: dict[str, object] = {}

    async def running_then_stop() -> None:
        outcome["first"] = await threads.run(lambda: gate.wait(GUARD_S), label="first")
        threads.stop()

    async def waiting() -> None:
        try:
            outcome["second"] = await threads.run(lambda: "ran", label="second", pin=False)
        except ClosedResourceError as exc:
            outcome["second"] = exc

    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(running_then_stop)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(waiting)
            await trio.testing.wait_all_tasks_blocked()
            gate.set()
        assert await threads.wait_stopped(GUARD_S) == []
    assert outcome["first"] is True
    assert isinstance(outcome["second"], ClosedResourceError)
    assert threads.busy == 0 and threads.abandoned == 0


async def test_a_waiting_caller_cancelled_as_the_threads_stop_sees_its_cancellation(
        ) -> None:
    # Cancelled, then the threads stop (and take every waiter out) before it resumes.
    threads = WorkerThreads("test", 1)
    threads.start()
    gate = threading.Event()
    seen: list[BaseException] = []

    async def waiting(task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        with trio.CancelScope() as scope:
            task_status.started(scope)
            try:
                await threads.run(lambda: "ran", label="waiting")
            except BaseException as exc:
                seen.append(exc)
                raise

    async def running() -> None:
        with pytest.raises(ClosedResourceError, match="closed while the job ran"):
            await threads.run(lambda: gate.wait(GUARD_S), label="running")

    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(running)
            await trio.testing.wait_all_tasks_blocked()
            scope = await nursery.start(waiting)
            await trio.testing.wait_all_tasks_blocked()
            scope.cancel()
            threads.stop()
            gate.set()
        assert await threads.wait_stopped(GUARD_S) == []
    assert len(seen) == 1 and isinstance(seen[0], trio.Cancelled)


async def test_a_thread_passes_its_slot_over_queued_requests_whose_deadline_passed(
        ) -> None:
    """The event loop is held past the deadline of three queued requests while the run
    before them ends: the worker thread must not start them (device time for callers
    that time out anyway), but pass its slot to the request after them. They end as
    when trio drops them from the queue: TimeoutError_, counted timed out for the
    device, the model and the tenant, and the slot counts come back to zero."""
    import time

    import wasinn
    from tests.fake_backend import FakeBackend
    from wasinn import TimeoutError_

    fake = FakeBackend(devices=("cpu",))
    config = cpu_pool(workers=1, backends=["fake"])
    outcomes: dict[float, object] = {}
    timeout = 0.1
    async with wasinn.Runtime(config, backends=[fake]) as rt:
        gated = await rt.load([b"fake:add=1:gate"], "ggml", name="gated")
        graph = await rt.load([b"fake:add=1"], "ggml", name="plain")
        await graph.compute({"x": np.zeros((1, 4), np.float32)})  # compiled here
        (actor,) = rt.actors

        async def compute(value: float, tenant: str, **terms: Any) -> None:
            x = np.full((1, 4), value, np.float32)
            try:
                outcomes[value] = (await graph.compute({"x": x}, tenant=tenant, **terms)
                                   )["y"].numpy()[0, 0]
            except TimeoutError_ as exc:
                outcomes[value] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(
                gated.compute, {"x": np.full((1, 4), 100.0, np.float32)}))
            await trio.to_thread.run_sync(fake.started.wait, GUARD_S)
            for value in (1.0, 2.0, 3.0):  # earliest deadline first: ahead of 9
                nursery.start_soon(functools.partial(compute, value, "late",
                                                     timeout=timeout))
            nursery.start_soon(compute, 9.0, "live")
            await trio.testing.wait_all_tasks_blocked()
            queued_by = trio.current_time()
            # Held loop: every deadline passes before the gated run ends, and trio sees
            # neither until the thread has made its choice and started the next run.
            while trio.current_time() <= queued_by + timeout:
                time.sleep(0.005)
            fake.gate.set()
            held_until = time.monotonic() + GUARD_S
            while ("cpu", 9.0) not in fake.runs and time.monotonic() < held_until:
                time.sleep(0.001)
        assert [x for _, x in fake.runs] == [0.0, 100.0, 9.0], "expired requests ran"
        assert outcomes[9.0] == 10.0
        for value in (1.0, 2.0, 3.0):
            assert isinstance(outcomes[value], TimeoutError_)
            assert "deadline passed" in str(outcomes[value])
        device = actor.stats()
        assert (device.timed_out, device.completed, device.passed_on) == (3, 3, 1)
        assert (device.running, device.queued, actor.load) == (0, 0, 0)
        model = graph.stats()
        assert (model.timed_out, model.completed) == (3, 2)
        tenants = {s.name: s for s in rt.tenant_stats()}
        assert (tenants["late"].timed_out, tenants["late"].completed) == (3, 0)
        assert (tenants["live"].timed_out, tenants["live"].completed) == (0, 1)
        with trio.fail_after(GUARD_S):  # the slot is free again
            await compute(4.0, "late")
        assert outcomes[4.0] == 5.0


async def test_no_slot_is_granted_past_a_request_s_deadline_on_trio_s_clock(
        mock_clock: trio.testing.MockClock) -> None:
    """Slots alone, on a mock clock that jumps past queued requests' deadlines before
    trio has seen it: a worker thread passing its slot on, then trio freeing one, skip
    the requests whose deadline passed on trio's clock (the thread reads it too) and
    grant the next; those skipped time out in their own scope, never granted."""
    from wasinn.actors import PriorityDeadlinePolicy
    from wasinn.actors.queue import Request
    from wasinn.actors.slots import Slots

    slots = Slots("dev", 2, 8, PriorityDeadlinePolicy())
    slots.open()
    assert not await slots.take() and not await slots.take()  # both slots held
    results: dict[str, str] = {}
    start = trio.current_time()

    class Prepared:
        def abandon(self) -> None:
            raise AssertionError("nothing here was started")

    async def wait(tag: str, priority: int, deadline: float) -> None:
        with trio.move_on_at(deadline):
            started = await slots.take(priority, deadline, handoff=Prepared())
            results[tag] = "started" if started else "granted"
            return
        results[tag] = "timed out"

    async with trio.open_nursery() as nursery:
        # In the queue's order (priority first): a, b, c, d.
        for tag, priority, after in [("a", 3, 1.0), ("b", 2, math.inf), ("c", 1, 4.0),
                                     ("d", 0, math.inf)]:
            nursery.start_soon(wait, tag, priority, start + after)
            await trio.testing.wait_all_tasks_blocked()
        assert slots.queued == 4
        mock_clock.jump(2.0)  # past a's deadline; trio has not seen it yet
        passed: list[Request | None] = []
        thread = threading.Thread(target=lambda: passed.append(slots.pass_on()))
        thread.start()
        thread.join(GUARD_S)  # (the loop held: trio decides nothing meanwhile)
        assert passed and passed[0] is not None and passed[0].priority == 2, "not b"
        assert passed[0].started  # its job is the thread's to run now
        Slots.granted_on(passed[0])
        mock_clock.jump(3.0)  # past c's deadline too
        slots.free()  # in trio, b's slot (say): c is skipped, d granted
        await trio.testing.wait_all_tasks_blocked()
        # (Within the nursery: were one left waiting, the failure cancels it.)
        assert results == {"a": "timed out", "b": "started", "c": "timed out",
                           "d": "granted"}
    assert (slots.running, slots.queued, slots.released) == (2, 0, 2)
