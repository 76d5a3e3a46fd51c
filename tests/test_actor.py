"""DeviceActor: readiness, worker threads, queue order, deadlines, cancellation, errors,
compile-once sessions and deferred close. Jobs here are plain callables in real threads."""

from __future__ import annotations

import math
import threading
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

from tests.fake_backend import FakeBackend, FakeGraph
from tests.support import closed_while_running, cooperative_job, gate_job, serving_actor
from wasinn import (
    BackendRuntimeError,
    ClosedResourceError,
    InvalidArgumentError,
    InvalidEncodingError,
    TimeoutError_,
    TooLargeError,
)
from wasinn.actors import DeviceActor, FairSharePolicy, PriorityDeadlinePolicy, Request
from wasinn.actors.session import Session
from wasinn.backends.base import CompiledGraph, Device
from wasinn.enums import ExecutionTarget

CPU = Device(ExecutionTarget.CPU)


@pytest.fixture
async def actor() -> AsyncIterator[DeviceActor]:
    async with serving_actor(workers=1, queue_limit=8) as started:
        yield started


async def test_actor_reports_ready_only_after_start() -> None:
    actor = DeviceActor(CPU, workers=2)
    assert not actor.ready
    assert actor.context is None
    async with trio.open_nursery() as nursery:
        assert await nursery.start(actor.serve) is actor
        assert actor.ready
        assert actor.context is not None and actor.context.device == CPU
        nursery.cancel_scope.cancel()
    assert not actor.ready
    assert actor.context is None  # closed with the actor


async def test_jobs_run_in_worker_threads_and_the_loop_keeps_running(
        actor: DeviceActor) -> None:
    # The job can only finish if a trio task runs while it waits: a job that held the loop
    # would time out in the thread and fail the test.
    release = threading.Event()

    def job() -> int:
        if not release.wait(timeout=10):
            raise RuntimeError("the event loop never ran while the job waited")
        return threading.get_ident()

    async def opener() -> None:
        await trio.sleep(0.01)
        release.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(opener)
        ident = await actor.execute(job)
    assert ident != threading.get_ident()


async def test_queue_serves_priority_then_deadline_then_arrival(actor: DeviceActor) -> None:
    gate = threading.Event()
    order: list[str] = []

    async def request(tag: str, priority: int, deadline: float) -> None:
        await actor.execute(lambda: order.append(tag), priority=priority, deadline=deadline)

    now = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor.execute, gate_job(gate))
        await trio.testing.wait_all_tasks_blocked()
        for tag, priority, deadline in [("low", 0, math.inf), ("high-late", 5, now + 900),
                                        ("mid", 1, math.inf), ("high-soon", 5, now + 600),
                                        ("low-2", 0, math.inf)]:
            nursery.start_soon(request, tag, priority, deadline)
            await trio.testing.wait_all_tasks_blocked()
        assert actor.load == 6
        gate.set()
    assert order == ["high-soon", "high-late", "mid", "low", "low-2"]


def test_policy_orders_and_removes() -> None:
    policy = PriorityDeadlinePolicy()
    a, b, c = Request(0, 5.0), Request(0, 1.0), Request(3)
    for r in (a, b, c):
        policy.push(r)
    policy.remove(b)
    assert len(policy) == 2
    assert policy.pop() is c
    assert policy.pop() is a
    assert policy.pop() is None and len(policy) == 0


def test_fair_policy_serves_tenants_in_turn() -> None:
    policy = FairSharePolicy()
    flood = [Request(0, tenant="a") for _ in range(4)]
    for r in flood:
        policy.push(r)
    b1, b2, c1 = Request(0, tenant="b"), Request(5, tenant="b"), Request(0, tenant="c")
    for r in (b1, b2, c1):
        policy.push(r)
    policy.remove(flood[1])
    assert len(policy) == 6
    order = [policy.pop() for _ in range(6)]
    # a, b (its high priority first), c, then a and b again, then a.
    assert order == [flood[0], b2, c1, flood[2], b1, flood[3]]
    assert policy.pop() is None and len(policy) == 0
    # A tenant whose only request was removed keeps its place in the turns for the next.
    lone, other = Request(tenant="x"), Request(tenant="y")
    policy.push(lone)
    policy.push(other)
    policy.remove(lone)
    policy.push(again := Request(tenant="x"))
    assert [policy.pop(), policy.pop(), policy.pop()] == [again, other, None]


def test_requests_that_gave_up_do_not_pile_up_in_the_queue() -> None:
    # Requests timing out behind a long run are removed from the middle of the queue:
    # the heap is swept once they are most of it, and idle tenants are forgotten.
    policy = PriorityDeadlinePolicy()
    keep = Request(0)
    policy.push(keep)
    for _ in range(10_000):
        policy.push(gone := Request(1))
        policy.remove(gone)
    assert len(policy) == 1 and len(policy._heap) <= 2 * 1 + 64 + 1
    assert policy.pop() is keep and policy.pop() is None

    fair = FairSharePolicy()
    fair.push(waiting := Request(tenant="stays"))
    for i in range(10_000):
        fair.push(gone := Request(tenant=f"one-off {i}"))
        fair.remove(gone)
    assert len(fair) == 1 and len(fair._tenants) <= 2 + 64 + 1 and len(fair._heap) <= 2 + 64 + 1
    assert fair.pop() is waiting and fair.pop() is None


@pytest.mark.parametrize("policy", [PriorityDeadlinePolicy, FairSharePolicy])
def test_a_requeued_request_moves_and_keeps_its_arrival_order(policy: type[Any]) -> None:
    queue = policy()
    early, urgent, late = Request(2, tenant="a"), Request(9, tenant="a"), Request(2, tenant="a")
    for r in (early, urgent, late):
        queue.push(r)
    queue.requeue(urgent, 2, math.inf)  # its most urgent part left: now as early's terms
    assert len(queue) == 3
    # Among equal terms, arrival order: urgent came after early and before late.
    assert [queue.pop(), queue.pop(), queue.pop(), queue.pop()] == [early, urgent, late, None]
    queue.push(r := Request(0, 5.0, tenant="a"))
    queue.requeue(r, 0, 1.0)
    queue.requeue(r, 0, 1.0)  # the same terms again: no second entry
    queue.remove(r)
    assert len(queue) == 0 and queue.pop() is None  # its stale entries are skipped
    for _ in range(1000):  # requeued over and over: the heap stays bounded
        queue.push(r := Request(0, tenant="a"))
        for step in range(5):
            queue.requeue(r, step, math.inf)
        assert queue.pop() is r
    heaps = [queue._heap] if policy is PriorityDeadlinePolicy else [
        t.queue._heap for t in queue._tenants.values()]
    assert all(len(heap) <= 2 * 1 + 64 + 1 for heap in heaps)


def test_a_numpy_priority_is_an_int() -> None:
    # -np.uint8(10) wraps around: the queue would serve it last.
    request = Request(np.uint8(10))  # type: ignore[arg-type]
    assert type(request.priority) is int and request.sort_key()[0] == -10


@pytest.mark.parametrize("policy", [PriorityDeadlinePolicy, FairSharePolicy])
def test_a_request_no_longer_queued_is_not_removed_twice(policy: type[Any]) -> None:
    queue = policy()
    queue.push(first := Request(tenant="a"))
    queue.push(Request(tenant="a"))
    assert queue.pop() is first
    queue.remove(first)  # (a waiter cancelled just as the queue handed it on)
    assert len(queue) == 1


async def test_a_caller_cancelled_as_the_device_closes_leaves_the_counts_sound(
        actor: DeviceActor) -> None:
    gate = threading.Event()
    waiter = trio.CancelScope()

    async def queued() -> None:
        with waiter, pytest.raises(ClosedResourceError):
            await actor.execute(lambda: None)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(closed_while_running, actor, gate_job(gate))
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(queued)
        await trio.testing.wait_all_tasks_blocked()
        assert actor.queued == 1
        waiter.cancel()  # in the same tick as the close
        actor.close()
        gate.set()
    assert (actor.queued, actor.stats().queued) == (0, 0)


async def test_deadline_drops_a_queued_request(autojump_clock: trio.testing.MockClock,
                                               actor: DeviceActor) -> None:
    gate = threading.Event()
    ran = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor.execute, gate_job(gate))
        await trio.testing.wait_all_tasks_blocked()
        start = trio.current_time()
        with pytest.raises(TimeoutError_, match="deadline"):
            await actor.execute(lambda: ran.append(1), deadline=start + 10)
        assert trio.current_time() - start == pytest.approx(10)
        assert actor.load == 1  # the queued request is gone; the gate job still runs
        gate.set()
    assert ran == []


async def test_deadline_abandons_a_running_request(autojump_clock: trio.testing.MockClock,
                                                   actor: DeviceActor) -> None:
    gate = threading.Event()
    with pytest.raises(TimeoutError_):
        await actor.execute(gate_job(gate), deadline=trio.current_time() + 5)
    # The abandoned job still holds the device's only worker until it finishes.
    assert actor.busy == 1
    gate.set()
    assert await actor.execute(lambda: "next") == "next"


async def test_cancelled_while_queued_never_runs(actor: DeviceActor) -> None:
    gate = threading.Event()
    ran = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor.execute, gate_job(gate))
        await trio.testing.wait_all_tasks_blocked()
        with trio.CancelScope() as scope:
            nursery.start_soon(lambda: _cancel_soon(scope))
            await actor.execute(lambda: ran.append(1))
        assert scope.cancelled_caught
        assert actor.load == 1
        gate.set()
    assert ran == []
    assert await actor.execute(lambda: 7) == 7


async def _cancel_soon(scope: trio.CancelScope) -> None:
    await trio.testing.wait_all_tasks_blocked()
    scope.cancel()


async def test_cancelled_while_running_abandons_the_result(actor: DeviceActor) -> None:
    gate, started = threading.Event(), threading.Event()
    finished = threading.Event()

    def job() -> str:
        started.set()
        gate.wait(timeout=30)
        finished.set()
        return "late"

    with trio.move_on_after(30) as scope:
        async with trio.open_nursery() as nursery:
            async def cancel_when_started() -> None:
                await trio.to_thread.run_sync(started.wait)
                scope.cancel()
            nursery.start_soon(cancel_when_started)
            await actor.execute(job)
    assert scope.cancelled_caught and not finished.is_set()
    # A new request waits for the abandoned thread's token, then runs.
    async with trio.open_nursery() as nursery:
        result: list[str] = []

        async def follow() -> None:
            result.append(await actor.execute(lambda: "next"))
        nursery.start_soon(follow)
        await trio.testing.wait_all_tasks_blocked()
        assert result == []
        gate.set()
    assert finished.is_set() and result == ["next"]


async def test_a_failing_job_fails_only_its_request(actor: DeviceActor) -> None:
    def boom() -> None:
        raise RuntimeError("library exploded")

    def bad_input() -> None:
        raise InvalidArgumentError("input x is wrong")

    with pytest.raises(BackendRuntimeError, match="library exploded"):
        await actor.execute(boom)
    with pytest.raises(InvalidArgumentError, match="input x is wrong"):
        await actor.execute(bad_input)
    assert await actor.execute(lambda: "still serving") == "still serving"


async def test_a_full_queue_refuses_more(actor: DeviceActor) -> None:
    gate = threading.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor.execute, gate_job(gate))
        await trio.testing.wait_all_tasks_blocked()
        for _ in range(actor.queue_limit):
            nursery.start_soon(actor.execute, lambda: None)
        await trio.testing.wait_all_tasks_blocked()
        try:
            with pytest.raises(TooLargeError, match="queue is full"):
                await actor.execute(lambda: None)
        finally:
            gate.set()


async def test_closing_fails_queued_requests() -> None:
    actor = DeviceActor(CPU, workers=1)
    gate = threading.Event()
    errors: list[BaseException] = []

    async def queued() -> None:
        try:
            await actor.execute(lambda: None)
        except ClosedResourceError as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        await nursery.start(actor.serve)
        nursery.start_soon(closed_while_running, actor, gate_job(gate))
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(queued)
        await trio.testing.wait_all_tasks_blocked()
        actor.close()
        await trio.testing.wait_all_tasks_blocked()
        gate.set()
        nursery.cancel_scope.cancel()
    assert len(errors) == 1
    with pytest.raises(ClosedResourceError):
        await actor.execute(lambda: None)


async def test_session_compiles_once_for_concurrent_callers(actor: DeviceActor) -> None:
    backend = FakeBackend()
    sessions: list[Session] = []

    def compile_graph() -> CompiledGraph:
        return backend.load([b"fake:add=1"], backend.encodings.__iter__().__next__(), CPU)

    async def ask() -> None:
        sessions.append(await actor.session("m", compile_graph, "fake"))

    async with trio.open_nursery() as nursery:
        for _ in range(5):
            nursery.start_soon(ask)
    assert backend.loads == ["cpu"]
    assert len({id(s) for s in sessions}) == 1
    assert actor.cached("m")


async def test_failed_compile_reaches_every_waiter_and_is_not_cached(
        actor: DeviceActor) -> None:
    attempts = []

    def bad() -> CompiledGraph:
        attempts.append(1)
        raise InvalidEncodingError("fake: unreadable")

    errors: list[InvalidEncodingError] = []

    async def ask() -> None:
        try:
            await actor.session("m", bad, "fake")
        except InvalidEncodingError as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(ask)
    assert len(attempts) == 1  # one compile for every concurrent caller
    assert [e.message for e in errors] == ["fake: unreadable"] * 4
    assert not actor.cached("m")
    with pytest.raises(InvalidEncodingError):
        await actor.session("m", bad, "fake")
    assert len(attempts) == 2  # not cached: a later call tries again


async def test_evict_defers_close_until_the_running_job_ends(actor: DeviceActor) -> None:
    backend = FakeBackend()
    graph = backend.load([b"fake:add=1"], next(iter(backend.encodings)), CPU)
    session = await actor.session("m", lambda: graph, "fake")
    started, gate = threading.Event(), threading.Event()

    def job() -> None:
        session.acquire()
        try:
            started.set()
            gate.wait(timeout=30)
        finally:
            session.release()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor.execute, job)
        await trio.to_thread.run_sync(started.wait)
        actor.evict("m")
        assert isinstance(graph, FakeGraph) and not graph.closed
        with pytest.raises(ClosedResourceError):
            session.acquire()
        gate.set()
    assert graph.closed


# -- cancellation of running jobs -----------------------------------------------------------
async def test_an_abandoned_job_is_cancelled_and_frees_its_slot(actor: DeviceActor) -> None:
    started, log = threading.Event(), []
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            async def cancel_when_started() -> None:
                await trio.to_thread.run_sync(started.wait, 10)
                scope.cancel()
            nursery.start_soon(cancel_when_started)
            await actor.execute(cooperative_job(started, log))
    assert scope.cancelled_caught
    with trio.fail_after(10):  # the job would otherwise hold the only slot for 30 s
        assert await actor.execute(lambda: "next") == "next"
    assert log == ["stopped"] and actor.threads.abandoned == 0


async def test_a_deadline_cancels_the_running_job() -> None:
    started, log = threading.Event(), []
    actor = DeviceActor(CPU, workers=1)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(actor.serve)
            with pytest.raises(TimeoutError_):
                await actor.execute(cooperative_job(started, log),
                                    deadline=trio.current_time() + 0.1)
            assert await actor.execute(lambda: "next") == "next"
            nursery.cancel_scope.cancel()
    assert log == ["stopped"]


async def test_closing_cancels_running_jobs_and_their_callers_see_closed() -> None:
    started, log = threading.Event(), []
    actor = DeviceActor(CPU, workers=1)
    errors: list[BaseException] = []

    async def caller() -> None:
        try:
            await actor.execute(cooperative_job(started, log))
        except ClosedResourceError as exc:
            errors.append(exc)

    with trio.fail_after(10):
        async with trio.open_nursery() as outer, trio.open_nursery() as nursery:
            await nursery.start(actor.serve)
            outer.start_soon(caller)
            await trio.to_thread.run_sync(started.wait, 10)
            nursery.cancel_scope.cancel()  # closes the actor
    assert log == ["stopped"] and len(errors) == 1
    assert not any(t.is_alive() for t in actor.threads.threads)


async def test_closing_cancels_a_running_lease() -> None:
    started, log = threading.Event(), []
    actor = DeviceActor(CPU, workers=1)
    errors: list[BaseException] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(actor.serve)
            lease = await actor.lease(cooperative_job(started, log))

            def hold() -> None:
                try:
                    lease.run()
                except ClosedResourceError as exc:
                    errors.append(exc)

            thread = threading.Thread(target=hold, daemon=True)
            thread.start()
            await trio.to_thread.run_sync(started.wait, 10)
            actor.close()
            await trio.to_thread.run_sync(thread.join, 10)
            nursery.cancel_scope.cancel()
    assert log == ["stopped"] and len(errors) == 1 and "closed" in str(errors[0])
    assert actor.load == 0  # the lease's slot was given back


async def cancel_once_started(scope: trio.CancelScope, started: threading.Event) -> None:
    await trio.to_thread.run_sync(started.wait, 10)
    scope.cancel()


async def test_close_timeout_bounds_the_wait_for_a_job_that_ignores_cancellation(
        caplog: pytest.LogCaptureFixture) -> None:
    gate, started = threading.Event(), threading.Event()
    actor = DeviceActor(CPU, workers=1, close_timeout=0.2)
    try:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                await nursery.start(actor.serve)
                with trio.CancelScope() as caller:
                    nursery.start_soon(cancel_once_started, caller, started)
                    await actor.execute(gate_job(gate, started), label="stubborn job")
                assert caller.cancelled_caught  # abandoned while it ran...
                assert actor.busy == 1  # ...and it runs on, ignoring its cancellation
                nursery.cancel_scope.cancel()
        (thread,) = actor.threads.threads
        assert thread.is_alive()  # left behind, a daemon
        (record,) = [r for r in caplog.records if r.name == "wasinn.actors"]
        assert "cpu" in record.message and "stubborn job" in record.message
    finally:
        gate.set()


def test_close_timeout_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="close_timeout"):
        DeviceActor(CPU, close_timeout=-1)
