"""Pinned hand-offs (a pool's ``pin_handoffs``): the event loop and the worker threads
meet on one CPU, jobs run on every CPU. Real threads, real affinity masks (Linux)."""

from __future__ import annotations

import os
import threading
from collections.abc import AsyncIterator, Iterator

import numpy as np
import pytest
import trio
import trio.testing

import wasinn
from tests.support import cpu_pool, require_backend
from wasinn import ConfigError
from wasinn.actors import DeviceActor, affinity
from wasinn.actors.affinity import LoopPin
from wasinn.backends.base import Device
from wasinn.configs.loader import parse_config
from wasinn.enums import ExecutionTarget
from wasinn.modelgen import affine_onnx

CPU = Device(ExecutionTarget.CPU)

pytestmark = [
    pytest.mark.skipif(affinity.unsupported_reason() is not None,
                       reason=f"pinned hand-offs: {affinity.unsupported_reason()}"),
    pytest.mark.skipif(hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) < 2,
                       reason="a one-CPU mask cannot tell a pinned thread from a free one"),
]


def mask_of(native_id: int) -> frozenset[int]:
    return frozenset(os.sched_getaffinity(native_id))


@pytest.fixture
def own_mask() -> Iterator[frozenset[int]]:
    """The trio thread's mask before the test (restored after it, whatever happens)."""
    mask = mask_of(0)
    yield mask
    os.sched_setaffinity(0, mask)


async def settled(native_id: int, mask: frozenset[int]) -> frozenset[int]:
    """The thread's mask once it is ``mask``, or after 5 s (a worker narrows itself
    right after it has handed a result back)."""
    with trio.move_on_after(5):
        while mask_of(native_id) != mask:
            await trio.sleep(0.001)
    return mask_of(native_id)


@pytest.fixture
async def pinned(own_mask: frozenset[int]) -> AsyncIterator[DeviceActor]:
    """A serving actor with pinned hand-offs, whose worker has run a job: it waits for
    the next one on the loop's CPU."""
    actor = DeviceActor(CPU, workers=1, pin_handoffs=True)
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.serve)
        worker = await actor.execute(threading.get_native_id)
        home = frozenset((min(own_mask),))
        assert await settled(worker, home) == home
        yield actor
        nursery.cancel_scope.cancel()


async def test_a_pinned_job_runs_on_every_cpu_while_the_loop_waits_on_one(
        pinned: DeviceActor, own_mask: frozenset[int]) -> None:
    loop = threading.get_native_id()
    home = frozenset((min(own_mask),))

    def job() -> tuple[frozenset[int], frozenset[int], int]:
        return mask_of(0), mask_of(loop), threading.get_native_id()

    job_mask, loop_mask, worker = await pinned.execute(job)
    assert job_mask == own_mask  # the run itself may use every CPU the loop could
    assert loop_mask == home  # while it ran, the loop waited on one CPU
    assert mask_of(0) == own_mask  # and has its own mask back once the job is
    assert await settled(worker, home) == home  # the worker waits for the next on it
    job_mask, loop_mask, _ = await pinned.execute(job)
    assert (job_mask, loop_mask, mask_of(0)) == (own_mask, home, own_mask)


async def test_threads_a_pinned_job_starts_may_use_every_cpu(
        pinned: DeviceActor, own_mask: frozenset[int]) -> None:
    """What ONNX Runtime's intra-op pool, OpenVINO's TBB arena and torch's OpenMP team
    do: start threads from the thread that calls them, which inherit its mask."""
    seen: list[frozenset[int]] = []

    def job() -> None:
        started = threading.Thread(target=lambda: seen.append(mask_of(0)))
        started.start()
        started.join()

    await pinned.execute(job)
    assert seen == [own_mask]


async def test_a_compile_sees_the_loop_unpinned_even_while_a_run_is_out(
        own_mask: frozenset[int]) -> None:
    """Compiles and warm-ups (unslotted jobs) suspend the pinning: libraries read the
    process's mask (often the trio thread's) when they size their thread pools."""
    loop = threading.get_native_id()
    gate, running = threading.Event(), threading.Event()
    actor = DeviceActor(CPU, workers=2, pin_handoffs=True)

    def held_run() -> None:
        running.set()
        gate.wait(10)

    async with trio.open_nursery() as nursery:
        await nursery.start(actor.serve)
        nursery.start_soon(actor.execute, held_run)
        await trio.to_thread.run_sync(running.wait, 10)
        assert mask_of(0) == {min(own_mask)}  # a run is out: the loop is pinned
        seen: list[frozenset[int]] = []
        await actor.warm_up(lambda: seen.append(mask_of(loop)))
        assert seen == [own_mask]
        assert mask_of(0) == own_mask  # and stays unpinned until that run is back
        gate.set()
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert mask_of(0) == own_mask


async def test_jobs_a_thread_starts_on_its_own_keep_the_pin_until_the_last_is_back(
        pinned: DeviceActor, own_mask: frozenset[int]) -> None:
    """Queued jobs that the worker thread starts one after another, each as the one
    before ends (the slot passed on): each runs on every CPU, the loop stays on its one
    while any is out, and gets its own mask back once the last result is in."""
    gate, first_started = threading.Event(), threading.Event()
    home = frozenset((min(own_mask),))
    loop = threading.get_native_id()
    seen: list[tuple[frozenset[int], frozenset[int]]] = []

    def first() -> None:
        first_started.set()
        gate.wait(10)

    def queued() -> None:
        seen.append((mask_of(0), mask_of(loop)))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pinned.execute, first)
        await trio.to_thread.run_sync(first_started.wait, 10)
        for _ in range(3):
            nursery.start_soon(pinned.execute, queued)
        await trio.testing.wait_all_tasks_blocked()
        assert pinned.queued == 3
        gate.set()
    assert pinned.threads.passed_on == 3
    assert seen == [(own_mask, home)] * 3
    assert mask_of(0) == own_mask and pinned.threads.busy == 0


async def test_an_abandoned_job_unpins_the_loop_when_its_thread_is_done(
        pinned: DeviceActor, own_mask: frozenset[int]) -> None:
    gate, running = threading.Event(), threading.Event()

    def stubborn() -> None:  # ignores its cancellation, as a TorchScript run does
        running.set()
        gate.wait(10)

    with trio.move_on_after(0.05):
        await pinned.execute(stubborn)
    assert running.is_set()
    assert mask_of(0) == {min(own_mask)}  # its thread still runs it, on the loop's time
    gate.set()
    with trio.fail_after(5):
        while pinned.threads.abandoned:
            await trio.sleep(0.001)
    assert mask_of(0) == own_mask


async def test_closing_with_a_pinned_job_running_gives_the_loop_its_mask_back(
        own_mask: frozenset[int]) -> None:
    actor = DeviceActor(CPU, workers=1, pin_handoffs=True, close_timeout=5)
    gate, running = threading.Event(), threading.Event()

    def stubborn() -> None:
        running.set()
        gate.wait(10)

    async def closed_meanwhile() -> None:
        with pytest.raises(wasinn.ClosedResourceError):
            await actor.execute(stubborn)

    async with trio.open_nursery() as nursery:
        await nursery.start(actor.serve)
        nursery.start_soon(closed_meanwhile)
        await trio.to_thread.run_sync(running.wait, 10)
        threading.Timer(0.1, gate.set).start()
        nursery.cancel_scope.cancel()  # the actor closes and waits for the job
    assert mask_of(0) == own_mask


async def test_without_pinning_nothing_changes_any_mask(own_mask: frozenset[int]) -> None:
    loop = threading.get_native_id()
    actor = DeviceActor(CPU, workers=1)
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.serve)
        job_mask, loop_mask = await actor.execute(lambda: (mask_of(0), mask_of(loop)))
        nursery.cancel_scope.cancel()
    assert job_mask == loop_mask == own_mask == mask_of(0)


def test_the_loop_pin_counts_its_holds(own_mask: frozenset[int]) -> None:
    pin = LoopPin()
    home = frozenset((min(own_mask),))
    assert pin.hold() == (home, own_mask) and pin.hold() == (home, own_mask)
    assert mask_of(0) == home and pin.held == 2
    pin.release()
    assert mask_of(0) == home  # one job still out
    pin.suspend()
    assert mask_of(0) == own_mask and not pin.pinned
    assert pin.hold() is None  # suspended: a job runs unpinned, and is not released
    pin.resume()
    pin.release()
    assert mask_of(0) == own_mask and pin.held == 0
    with pytest.raises(RuntimeError, match="without a hold"):
        pin.release()
    with pytest.raises(RuntimeError, match="without a suspend"):
        pin.resume()


async def test_a_pinned_pool_computes_and_keeps_openvinos_threads_unpinned(
        own_mask: frozenset[int]) -> None:
    """End to end through the config key; OpenVINO's own CPU pinning is off for graphs
    compiled there (it took the pinned loop for the process's CPUs: 1.7x slower runs),
    unless the model's options say otherwise."""
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    async with wasinn.Runtime(cpu_pool(pin_handoffs=True)) as rt:
        (actor,) = rt.actors
        assert actor.pins_handoffs
        graph = await rt.load([affine_onnx()], "onnx")
        out = await graph.init_execution_context().compute({"x": x})
        np.testing.assert_allclose(out["y"].numpy(), 2 * x + 1)
        assert mask_of(0) == own_mask
        require_backend("openvino")
        for extra, expected in (({}, False), ({"ENABLE_CPU_PINNING": True}, True)):
            ov = await rt.load([affine_onnx()], "onnx", backend="openvino", options=extra)
            out = await ov.compute({"x": x})
            np.testing.assert_allclose(out["y"].numpy(), 2 * x + 1)
            session = actor.cached_session(actor.session_keys()[-1])
            assert session is not None and session.backend == "openvino"
            assert session.compiled._handle.get_property("ENABLE_CPU_PINNING") is expected
            await ov.unload()


def test_the_pool_key_is_refused_where_it_cannot_work(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_config({"pools": {"cpu": {"kind": "cpu", "pin_handoffs": True}}},
                        None).pools["cpu"].pin_handoffs
    assert not parse_config({"pools": {"cpu": {"kind": "cpu"}}}, None).pools["cpu"].pin_handoffs
    from wasinn.configs import schema

    monkeypatch.setattr(schema, "unsupported_reason",
                        lambda: "this platform has no os.sched_setaffinity (it is Linux only)")
    with pytest.raises(ConfigError, match=r"pools\.cpu\.pin_handoffs: pin_handoffs = true "
                       r"cannot work here: this platform has no os\.sched_setaffinity"):
        parse_config({"pools": {"cpu": {"kind": "cpu", "pin_handoffs": True}}}, None)
