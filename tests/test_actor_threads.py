"""How jobs reach a device: persistent worker threads, leases run by the caller's own
thread, and inline runs of tiny jobs. Real threads, real trio; jobs are plain callables
(a RunProfile stands for the compiled graph a job would run)."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence

import numpy as np
import pytest
import trio
import trio.testing

from tests.fake_backend import FakeBackend, FakeGraph
from tests.support import require_backend, serving_actor
from wasinn import BackendRuntimeError, ClosedResourceError, InvalidArgumentError, TimeoutError_
from wasinn.actors import DeviceActor
from wasinn.actors.inline import RunProfile
from wasinn.backends.base import Builders, Device, LoadOptions
from wasinn.enums import ExecutionTarget, GraphEncoding
from wasinn.tensor import Tensor

CPU = Device(ExecutionTarget.CPU)


@pytest.fixture
async def actor() -> AsyncIterator[DeviceActor]:
    async with serving_actor(workers=1, queue_limit=8) as started:
        yield started


def where() -> int:
    return threading.get_ident()


# -- persistent worker threads ---------------------------------------------------------
async def test_jobs_run_in_the_actors_own_persistent_threads() -> None:
    actor = DeviceActor(CPU, workers=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.serve)
        threads = actor.threads.threads
        assert len(threads) == 2 and all(t.is_alive() and t.daemon for t in threads)
        idents = {await actor.execute(where) for _ in range(20)}
        assert idents <= {t.ident for t in threads}
        assert threading.get_ident() not in idents
        assert actor.threads.finished == 20 and actor.busy == 0
        nursery.cancel_scope.cancel()
    assert not any(t.is_alive() for t in threads)  # stopped and waited for on close


async def test_workers_bound_the_jobs_running_at_once() -> None:
    actor = DeviceActor(CPU, workers=2)
    lock = threading.Lock()
    running, peak = 0, 0

    def job() -> None:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.005)
        with lock:
            running -= 1

    async with trio.open_nursery() as nursery:
        await nursery.start(actor.serve)
        async with trio.open_nursery() as callers:
            for _ in range(10):
                callers.start_soon(actor.execute, job)
        nursery.cancel_scope.cancel()
    assert peak == 2


async def test_closing_the_runtime_stops_the_worker_threads() -> None:
    import wasinn

    async with wasinn.Runtime() as rt:
        (cpu,) = rt.actors
        threads = cpu.threads.threads
        assert threads and all(t.is_alive() for t in threads)
    assert not any(t.is_alive() for t in threads)


class RecordingGraph(FakeGraph):
    """A fake compiled graph that logs when a run ends and when it is closed, and notes
    a close that happens while a run is still going on."""

    def __init__(self, backend: RecordingBackend, device: Device, add: float,
                 gated: bool) -> None:
        super().__init__(backend, device, add, gated)
        self.log = backend.log

    def run(self, inputs: Mapping[str, Tensor], *, outputs: Sequence[str] | None = None,
            keep_on_device: bool = False) -> dict[str, Tensor]:
        try:
            return super().run(inputs, outputs=outputs, keep_on_device=keep_on_device)
        finally:
            self.log.append("run ended")

    def close(self) -> None:
        self.log.append("closed while running" if self.running else "closed")
        super().close()


class RecordingBackend(FakeBackend):
    def __init__(self) -> None:
        super().__init__(devices=("cpu",))
        self.log: list[str] = []

    def load(self, builders: Builders, encoding: GraphEncoding, device: Device,
             options: LoadOptions | None = None) -> RecordingGraph:
        graph = super().load(builders, encoding, device, options)
        return RecordingGraph(self, device, graph.add, graph.gated)


async def _open_gate_once_all_wait(backend: RecordingBackend) -> None:
    # Runs when every task is blocked, i.e. while the runtime's close waits for the
    # abandoned run; logs first, so the log shows the close had not finished before.
    await trio.testing.wait_all_tasks_blocked()
    backend.log.append("gate opened")
    backend.gate.set()


async def test_closing_the_runtime_waits_for_an_abandoned_run_then_closes_its_graph() -> None:
    import wasinn
    from wasinn.configs.loader import parse_config

    backend = RecordingBackend()
    config = parse_config({"pools": {"cpu": {"kind": "cpu", "devices": ["cpu"],
                                             "backends": ["fake"]}}}, None)
    async with trio.open_nursery() as nursery:
        async with wasinn.Runtime(config, backends=[backend]) as rt:
            (actor,) = rt.actors
            threads = actor.threads.threads
            graph = await rt.load([b"fake:add=1:gate"], "ggml", "cpu")
            with trio.CancelScope() as scope:
                nursery.start_soon(_cancel_when, backend.started, scope)
                await graph.compute({"x": np.zeros((1, 4), np.float32)})
            assert scope.cancelled_caught  # the caller gave up: the run is abandoned
            assert actor.busy == 1 and backend.log == []  # still running
            nursery.start_soon(_open_gate_once_all_wait, backend)
        # The close returned only after the abandoned run ended, and closed the graph
        # after that, never under it.
        assert backend.log == ["gate opened", "run ended", "closed"]
        assert actor.busy == 0 and actor.threads.abandoned == 0
        assert threads and not any(t.is_alive() for t in threads)  # joined


async def test_closing_an_actor_waits_for_an_abandoned_job_and_joins_its_thread() -> None:
    actor = DeviceActor(CPU, workers=1)
    gate, started = threading.Event(), threading.Event()
    log: list[str] = []

    def stuck() -> str:
        started.set()
        gate.wait(timeout=30)
        log.append("job ended")
        return "late"

    async def open_gate() -> None:
        await trio.testing.wait_all_tasks_blocked()
        log.append("gate opened")
        gate.set()

    async with trio.open_nursery() as outer:
        async with trio.open_nursery() as nursery:
            await nursery.start(actor.serve)
            (thread,) = actor.threads.threads
            with trio.CancelScope() as scope:
                nursery.start_soon(_cancel_when, started, scope)
                await actor.execute(stuck)
            assert scope.cancelled_caught and actor.busy == 1
            outer.start_soon(open_gate)
            nursery.cancel_scope.cancel()  # serve exits only once the job has ended
        assert log == ["gate opened", "job ended"]
        assert not thread.is_alive() and actor.busy == 0


async def _cancel_when(event: threading.Event, scope: trio.CancelScope) -> None:
    await trio.to_thread.run_sync(event.wait, 10)
    scope.cancel()


async def test_a_job_queued_behind_an_abandoned_one_runs_when_its_thread_is_free(
        actor: DeviceActor) -> None:
    gate, started = threading.Event(), threading.Event()
    ran: list[str] = []

    def first() -> None:
        started.set()
        gate.wait(timeout=30)
        ran.append("first")

    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_when, started, scope)
            await actor.execute(first)
    # The abandoned job keeps its slot: the next request queues until it finishes.
    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor.execute, lambda: ran.append("second"))
        await trio.testing.wait_all_tasks_blocked()
        assert actor.load == 2 and ran == []
        gate.set()
    assert ran == ["first", "second"]


# -- leases: the caller's own thread runs the job -----------------------------------------
async def test_a_lease_runs_the_job_in_the_callers_thread(actor: DeviceActor) -> None:
    def guest() -> tuple[int, int]:
        lease = trio.from_thread.run(actor.lease, where)
        return lease.run(), threading.get_ident()

    ran_in, caller = await trio.to_thread.run_sync(guest)
    assert ran_in == caller != threading.get_ident()
    assert actor.threads.finished == 0 and actor.load == 0


async def test_a_lease_holds_a_slot_and_queues_like_any_request(actor: DeviceActor) -> None:
    order: list[str] = []
    # Each job records itself while it runs (the slot is still held), so the order is
    # that of the runs, not of when their callers woke up.
    lease = await actor.lease(lambda: order.append("leased"))
    assert actor.load == 1
    assert actor.try_lease(lambda: "other") is None  # the only slot is lent

    async def queued() -> None:
        await actor.execute(lambda: order.append("queued"))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(queued)
        await trio.testing.wait_all_tasks_blocked()
        assert order == [] and actor.load == 2
        # Given back from another thread: trio is woken to grant the queued request.
        await trio.to_thread.run_sync(lease.run)
    assert order == ["leased", "queued"]
    assert actor.load == 0


async def test_try_lease_never_overtakes_a_queued_request(actor: DeviceActor) -> None:
    gate = threading.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor.execute, lambda: gate.wait(30))
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(actor.execute, lambda: None)
        await trio.testing.wait_all_tasks_blocked()
        assert actor.try_lease(lambda: None) is None
        gate.set()
    lease = actor.try_lease(where)
    assert lease is not None
    assert await trio.to_thread.run_sync(lease.run) != threading.get_ident()


async def test_a_lease_cancelled_while_queued_leaves_the_queue(actor: DeviceActor) -> None:
    gate = threading.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor.execute, lambda: gate.wait(30))
        await trio.testing.wait_all_tasks_blocked()
        with trio.move_on_after(0.01) as scope:
            await actor.lease(lambda: None)
        assert scope.cancelled_caught and actor.load == 1
        gate.set()
    assert actor.load == 0


async def test_a_lease_maps_errors_and_gives_its_slot_back(actor: DeviceActor) -> None:
    def boom() -> None:
        raise RuntimeError("library exploded")

    lease = await actor.lease(boom)
    with pytest.raises(BackendRuntimeError, match="library exploded"):
        await trio.to_thread.run_sync(lease.run)
    with pytest.raises(InvalidArgumentError, match="was already used or cancelled"):
        await trio.to_thread.run_sync(lease.run)
    cancelled = await actor.lease(lambda: None)
    cancelled.cancel()
    cancelled.cancel()
    await trio.testing.wait_all_tasks_blocked()
    assert actor.load == 0
    assert await actor.execute(lambda: "still serving") == "still serving"


async def test_a_lease_refuses_to_run_in_the_trio_thread(actor: DeviceActor) -> None:
    ran: list[int] = []
    lease = await actor.lease(lambda: ran.append(threading.get_ident()))
    with pytest.raises(RuntimeError, match="trio thread, whose event loop it would block"):
        lease.run()
    assert ran == [] and actor.load == 1  # still held, still unused: it runs elsewhere
    await trio.to_thread.run_sync(lease.run)
    assert ran and ran[0] != threading.get_ident() and actor.load == 0


async def test_a_lease_run_past_its_deadline_is_a_timeout(actor: DeviceActor) -> None:
    lease = await actor.lease(lambda: time.sleep(0.05), deadline=trio.current_time() + 0.01)
    with pytest.raises(TimeoutError_):
        await trio.to_thread.run_sync(lease.run)
    assert actor.load == 0


async def test_no_lease_once_closed(actor: DeviceActor) -> None:
    actor.close()
    assert actor.try_lease(lambda: None) is None
    with pytest.raises(ClosedResourceError):
        await actor.lease(lambda: None)


# -- inline runs of tiny jobs -------------------------------------------------------------
BOUND = 0.05  # seconds: generous, so a no-op job always qualifies


@pytest.fixture
async def inline_actor() -> AsyncIterator[DeviceActor]:
    async with trio.open_nursery() as nursery:
        started = await nursery.start(DeviceActor(CPU, inline_below=BOUND).serve)
        yield started
        nursery.cancel_scope.cancel()


async def run_where(actor: DeviceActor, profile: RunProfile, nbytes: int = 16,
                    job: Callable[[], object] | None = None) -> str:
    def record() -> int:
        if job is not None:
            job()
        return threading.get_ident()

    ident = await actor.execute(record, profile=profile, nbytes=nbytes)
    return "inline" if ident == threading.get_ident() else "worker"


async def test_a_tiny_job_runs_inline_after_its_warmup(inline_actor: DeviceActor) -> None:
    profile = RunProfile()
    places = [await run_where(inline_actor, profile) for _ in range(RunProfile.WARMUP + 3)]
    assert places == ["worker"] * RunProfile.WARMUP + ["inline"] * 3


async def test_a_slow_run_sends_the_job_back_to_the_workers(inline_actor: DeviceActor) -> None:
    profile = RunProfile()
    for _ in range(RunProfile.WARMUP):
        await run_where(inline_actor, profile)
    slow = BOUND * RunProfile.MULTIPLE * 1.5
    assert await run_where(inline_actor, profile, job=lambda: time.sleep(slow)) == "inline"
    # Disqualified: back to the worker thread until it qualifies again.
    places = [await run_where(inline_actor, profile) for _ in range(RunProfile.WARMUP + 1)]
    assert places == ["worker"] * RunProfile.WARMUP + ["inline"]


async def test_failed_runs_do_not_qualify_a_graph_for_inline_runs(
        inline_actor: DeviceActor) -> None:
    # A bad request fails at once whatever the graph's real run time: it says nothing of
    # how long the graph runs, so a slow graph cannot be made to look tiny with them.
    profile = RunProfile()

    def bad() -> None:
        raise BackendRuntimeError("input rejected")

    for _ in range(RunProfile.WARMUP * 2):
        with pytest.raises(BackendRuntimeError):
            await run_where(inline_actor, profile, job=bad)
    assert profile.runs == 0
    assert await run_where(inline_actor, profile) == "worker"


async def test_a_larger_input_than_timed_is_not_run_inline(inline_actor: DeviceActor) -> None:
    profile = RunProfile()
    for _ in range(RunProfile.WARMUP):
        await run_where(inline_actor, profile, nbytes=16)
    assert await run_where(inline_actor, profile, nbytes=16) == "inline"
    assert await run_where(inline_actor, profile, nbytes=1 << 20) == "worker"


async def test_no_inline_run_while_the_device_is_busy(inline_actor: DeviceActor) -> None:
    profile = RunProfile()
    for _ in range(RunProfile.WARMUP):
        await run_where(inline_actor, profile)
    gate = threading.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(inline_actor.execute, lambda: gate.wait(30))
        await trio.testing.wait_all_tasks_blocked()
        places: list[str] = []

        async def tiny() -> None:
            places.append(await run_where(inline_actor, profile))

        nursery.start_soon(tiny)
        await trio.testing.wait_all_tasks_blocked()
        assert places == [] and inline_actor.load == 2  # queued, not run on the loop
        gate.set()
    assert places == ["worker"]


async def test_a_request_with_a_deadline_is_never_run_inline(inline_actor: DeviceActor
                                                             ) -> None:
    # Qualifying is a prediction from past runs: a run whose time depends on its input
    # values could hold the loop past any deadline, so such requests go to a thread.
    profile = RunProfile()
    for _ in range(RunProfile.WARMUP):
        await run_where(inline_actor, profile)
    assert profile.qualifies(16, BOUND)

    async def with_deadline() -> str:
        def record() -> int:
            return threading.get_ident()

        ident = await inline_actor.execute(record, profile=profile, nbytes=16,
                                           deadline=trio.current_time() + 3600)
        return "inline" if ident == threading.get_ident() else "worker"

    assert await with_deadline() == "worker"
    with trio.move_on_after(3600):  # a caller's own cancel scope with a deadline
        assert await run_where(inline_actor, profile) == "worker"
    assert await run_where(inline_actor, profile) == "inline"  # still qualifies


async def test_inline_off_never_runs_on_the_loop(actor: DeviceActor) -> None:
    profile = RunProfile()
    places = {await run_where(actor, profile) for _ in range(RunProfile.WARMUP + 3)}
    assert places == {"worker"}


async def test_an_inline_failure_fails_only_that_request(inline_actor: DeviceActor) -> None:
    profile = RunProfile()
    for _ in range(RunProfile.WARMUP):
        await run_where(inline_actor, profile)

    def boom() -> None:
        raise RuntimeError("library exploded")

    with pytest.raises(BackendRuntimeError, match="library exploded"):
        await inline_actor.execute(boom, profile=profile, nbytes=16)
    assert inline_actor.load == 0
    assert await run_where(inline_actor, profile) == "inline"


def test_run_profile_rules() -> None:
    profile = RunProfile()
    for _ in range(RunProfile.WARMUP - 1):
        profile.observe(0.001, 100, BOUND)
    assert not profile.qualifies(100, BOUND)
    profile.observe(0.001, 100, BOUND)
    assert profile.qualifies(100, BOUND) and not profile.qualifies(101, BOUND)
    profile.observe(BOUND * RunProfile.MULTIPLE * 2, 100, BOUND)
    assert not profile.qualifies(100, BOUND) and profile.runs == 0


def test_only_gpus_torch_sees_get_a_cuda_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    # One NVIDIA GPU beside a GPU only OpenVINO reports: gpu:1 must not ask CUDA for a
    # device it does not have (its actor would fail to start).
    require_backend("torch")
    import torch

    from wasinn.actors.devicectx import DeviceContext, TorchCudaContext, context_for

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert type(context_for(Device(ExecutionTarget.GPU, 0))) is TorchCudaContext
    assert type(context_for(Device(ExecutionTarget.GPU, 1))) is DeviceContext
    assert type(context_for(CPU)) is DeviceContext
