"""Closing an execution context while its requests are in flight: those still waiting in
the device's queue, or for their graph's first compile there, are withdrawn at once,
unrun, and their callers told so; one already running ends its run and is dropped.
Routing and timing come from a fake backend whose gated runs hold the device's only slot
(tests.fake_backend); the user's cases run a real ONNX Runtime graph queued behind a busy
device, or whose compile is held. (Members of batches: tests.test_batching_leave.)"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import wasinn
from tests.fake_backend import FakeBackend
from tests.support import cpu_pool, require_backend
from tests.test_batching import device_busy, run_sizes
from wasinn import ClosedResourceError
from wasinn.actors.queue import PriorityDeadlinePolicy, Request
from wasinn.actors.slots import QUEUE_OWNER, QueueOwner, RequestWithdrawn, Slots
from wasinn.configs.loader import parse_config
from wasinn.configs.schema import RuntimeConfig
from wasinn.modelgen import affine_onnx
from wasinn.scheduler import _sessions

GATED = [b"fake:add=1:gate"]  # each run waits for fake.gate


def withdrawn(name: str) -> str:
    return (f"the execution context of {name} was closed while its request waited in the "
            "device's queue: it was withdrawn, unrun")


def withdrawn_from_compile(name: str) -> str:
    return (f"the execution context of {name} was closed while its request waited for its "
            "graph to compile on the device (the compile goes on): it was withdrawn, unrun")


def dropped(name: str) -> str:
    return (f"the execution context of {name} was closed while its request ran: the outputs "
            "were dropped")


def one_slot(policy: str = "priority") -> RuntimeConfig:
    """One CPU device with one worker slot, run by the fake backend."""
    return parse_config({"pools": {"cpu": {"kind": "cpu", "devices": ["cpu"], "workers": 1,
                                           "backends": ["fake"], "policy": policy}}}, None)


def x(value: float) -> np.ndarray[Any, Any]:
    return np.full((1, 4), value, np.float32)


@pytest.fixture
def fake() -> FakeBackend:
    return FakeBackend(devices=("cpu",))


@pytest.fixture(params=["priority", "fair"])
async def rt(request: pytest.FixtureRequest, fake: FakeBackend
             ) -> AsyncIterator[wasinn.Runtime]:
    try:
        async with wasinn.Runtime(one_slot(request.param), backends=[fake]) as runtime:
            yield runtime
    finally:
        fake.gate.set()


class Outcomes(dict[str, str]):
    """What each named call ended with: "ok", or its ClosedResourceError's message."""

    async def of(self, name: str, call: Callable[[], Awaitable[object]]) -> None:
        try:
            await call()
        except ClosedResourceError as exc:
            self[name] = exc.message
        else:
            self[name] = "ok"


@pytest.mark.parametrize("timeout", [None, 60.0])
async def test_a_queued_compute_is_withdrawn_at_once_and_never_runs(
        rt: wasinn.Runtime, fake: FakeBackend, timeout: float | None) -> None:
    graph = await rt.load(GATED, "ggml", "cpu")
    (actor,) = rt.actors
    busy, victim = graph.init_execution_context(), graph.init_execution_context()
    outcomes = Outcomes()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(outcomes.of, "busy", lambda: busy.compute({"x": x(1)}))
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(outcomes.of, "victim",
                           lambda: victim.compute({"x": x(2)}, timeout=timeout))
        await trio.testing.wait_all_tasks_blocked()
        assert (actor.stats().running, actor.stats().queued) == (1, 1)
        victim.close()
        await trio.testing.wait_all_tasks_blocked()
        # Told at once, while the run it waited behind still holds the device.
        assert outcomes == {"victim": withdrawn(graph.name)}
        assert (actor.stats().running, actor.stats().queued) == (1, 0)
        fake.gate.set()
    assert outcomes["busy"] == "ok"
    assert fake.runs == [("cpu", 1.0)]  # the withdrawn request never ran
    device, model = actor.stats(), graph.stats()
    for stats in (device, model):
        # One completed (the run it waited behind), one that ended unrun: not completed.
        assert (stats.completed, stats.failed + stats.cancelled, stats.finished) == (1, 1, 2)
    assert device.running_seconds == model.running_seconds  # the other run's time only
    # The closed context stays closed; the other one and the graph go on as before.
    victim.close()
    assert victim.closed
    with pytest.raises(ClosedResourceError, match="is closed"):
        await victim.compute({"x": x(3)})
    with pytest.raises(ClosedResourceError, match="is closed"):
        victim.get_output("y")
    out = await busy.compute({"x": x(4)}, keep_on_device=False)
    assert out["y"].numpy().tolist() == [[5.0] * 4]
    busy.close()
    await graph.unload()
    assert fake.closed == ["cpu"]  # every context's hold on the graph was let go once


@pytest.mark.parametrize("closer", ["application thread", "trio worker thread"])
async def test_a_close_from_another_thread_withdraws_and_lets_the_graph_go(
        rt: wasinn.Runtime, fake: FakeBackend, closer: str) -> None:
    # close() is synchronous and documented for any caller: one from a thread that is not
    # trio's hands the withdrawal to trio. It raised trio's "must be called from async
    # context" midway, the queued caller hung for ever and the graph stayed held.
    graph = await rt.load(GATED, "ggml", "cpu")
    (actor,) = rt.actors
    victim = graph.init_execution_context()
    outcomes = Outcomes()
    raised: list[BaseException] = []

    def close() -> None:
        try:
            victim.close()
        except BaseException as exc:
            raised.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(graph.compute, {"x": x(1)})
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(outcomes.of, "victim", lambda: victim.compute({"x": x(2)}))
        await trio.testing.wait_all_tasks_blocked()
        assert actor.stats().queued == 1
        if closer == "trio worker thread":
            await trio.to_thread.run_sync(close)
        else:
            thread = threading.Thread(target=close)
            thread.start()
            await trio.to_thread.run_sync(thread.join)
        assert raised == []
        assert victim.closed
        with trio.fail_after(10):
            while "victim" not in outcomes:
                await trio.sleep(0.001)
        assert outcomes == {"victim": withdrawn(graph.name)}
        assert actor.stats().queued == 0
        fake.gate.set()
    assert fake.runs == [("cpu", 1.0)]
    await graph.unload()
    assert fake.closed == ["cpu"]  # the context's hold on the graph was let go


async def test_a_withdrawn_request_counts_as_cancelled(rt: wasinn.Runtime,
                                                      fake: FakeBackend) -> None:
    graph = await rt.load(GATED, "ggml", "cpu")
    (actor,) = rt.actors
    victim = graph.init_execution_context()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(graph.compute, {"x": x(1)})
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(Outcomes().of, "victim", lambda: victim.compute({"x": x(2)}))
        await trio.testing.wait_all_tasks_blocked()
        victim.close()
        await trio.testing.wait_all_tasks_blocked()
        fake.gate.set()
    for stats in (actor.stats(), graph.stats()):
        assert (stats.completed, stats.failed, stats.cancelled) == (1, 0, 1)


async def test_the_running_request_ends_and_is_dropped_the_queued_ones_never_run(
        rt: wasinn.Runtime, fake: FakeBackend) -> None:
    # One context, three requests: the first runs, the others wait behind it.
    graph = await rt.load(GATED, "ggml", "cpu")
    (actor,) = rt.actors
    ctx = graph.init_execution_context()
    buffer = np.zeros((1, 4), np.float32)
    ctx.set_output("y", buffer)
    outcomes = Outcomes()
    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(outcomes.of, f"r{i}",
                               lambda i=i: ctx.compute({"x": x(i + 1)}))
            await trio.testing.wait_all_tasks_blocked()
        assert (actor.stats().running, actor.stats().queued) == (1, 2)
        ctx.close()
        await trio.testing.wait_all_tasks_blocked()
        assert outcomes == {"r1": withdrawn(graph.name), "r2": withdrawn(graph.name)}
        assert actor.stats().running == 1  # the first still runs: it is not abandoned
        fake.gate.set()
    assert outcomes["r0"] == dropped(graph.name)
    assert fake.runs == [("cpu", 1.0)]
    assert not buffer.any()  # its outputs went nowhere
    stats = actor.stats()
    assert (stats.completed, stats.failed + stats.cancelled, stats.queued,
            stats.running) == (1, 2, 0, 0)


async def test_a_queued_lease_is_withdrawn_at_once(rt: wasinn.Runtime,
                                                   fake: FakeBackend) -> None:
    graph = await rt.load(GATED, "ggml", "cpu")
    ctx = graph.init_execution_context()
    outcomes = Outcomes()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(graph.compute, {"x": x(1)})
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(outcomes.of, "lease", lambda: ctx.lease({"x": x(2)}))
        await trio.testing.wait_all_tasks_blocked()
        ctx.close()
        await trio.testing.wait_all_tasks_blocked()
        assert outcomes == {"lease": withdrawn(graph.name)}
        fake.gate.set()
    assert fake.runs == [("cpu", 1.0)]


async def test_a_request_from_a_callers_thread_is_withdrawn_at_once(
        rt: wasinn.Runtime, fake: FakeBackend) -> None:
    # A guest's thread: no free slot, so its request queues in trio (through a lease).
    graph = await rt.load(GATED, "ggml", "cpu")
    (actor,) = rt.actors
    ctx = graph.init_execution_context()
    raised: list[ClosedResourceError] = []

    def in_thread() -> None:
        try:
            ctx.compute_in_caller_thread({"x": x(2)})
        except ClosedResourceError as exc:
            raised.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(graph.compute, {"x": x(1)})
        await trio.testing.wait_all_tasks_blocked()
        done = trio.Event()

        async def thread() -> None:
            await trio.to_thread.run_sync(in_thread)
            done.set()

        nursery.start_soon(thread)
        with trio.fail_after(10):
            while actor.stats().queued == 0:
                await trio.sleep(0.001)
        ctx.close()
        with trio.fail_after(10):
            await done.wait()  # while the device is still busy
        assert [exc.message for exc in raised] == [withdrawn(graph.name)]
        fake.gate.set()
    assert fake.runs == [("cpu", 1.0)]


def fake_pipeline(directory: Path) -> RuntimeConfig:
    """Pipeline ``p`` of two fake models on one CPU slot, and a gated model ``gate``."""
    recipes = {"one": "add=1", "two": "add=2", "gate": "add=1:gate"}
    for name, recipe in recipes.items():
        (directory / f"{name}.bin").write_bytes(f"fake:{recipe}".encode())
    return parse_config({
        "pools": {"cpu": {"kind": "cpu", "devices": ["cpu"], "workers": 1,
                          "backends": ["fake"]}},
        "models": {name: {"files": [f"{name}.bin"], "encoding": "ggml"} for name in recipes},
        "pipelines": {"p": {"steps": [{"model": "one"}, {"model": "two"}]}},
    }, directory / "wasinn.toml", backends=["fake"])


async def test_a_pipelines_queued_request_is_withdrawn_at_once(tmp_path: Path,
                                                               fake: FakeBackend) -> None:
    async with wasinn.Runtime(fake_pipeline(tmp_path), backends=[fake]) as rt:
        gate, pipeline = await rt.load_by_name("gate"), await rt.load_by_name("p")
        ctx = pipeline.init_execution_context()
        outcomes = Outcomes()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(gate.compute, {"x": x(1)})
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(outcomes.of, "p", lambda: ctx.compute({"x": x(2)}))
                await trio.testing.wait_all_tasks_blocked()
                ctx.close()
                await trio.testing.wait_all_tasks_blocked()
                assert outcomes == {"p": withdrawn("p")}
                fake.gate.set()
        finally:
            fake.gate.set()
        assert fake.runs == [("cpu", 1.0)]  # neither step ran
        stats = pipeline.stats()
        assert (stats.completed, stats.failed + stats.cancelled) == (0, 1)


async def test_a_compute_queued_behind_a_busy_device_on_onnxruntime() -> None:
    # The user's case on a real backend: a client's context closed while its request
    # waits behind another's run.
    require_backend("onnxruntime")
    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        graph = await rt.load([affine_onnx()], "onnx")
        (actor,) = rt.actors
        sizes = run_sizes(rt, graph)
        ctx = graph.init_execution_context()
        outcomes = Outcomes()
        async with device_busy(actor) as nursery:
            nursery.start_soon(outcomes.of, "victim",
                               lambda: ctx.compute({"x": np.ones((1, 4), np.float32)}))
            await trio.testing.wait_all_tasks_blocked()
            assert actor.stats().queued == 1
            ctx.close()
            await trio.testing.wait_all_tasks_blocked()
            assert outcomes == {"victim": withdrawn(graph.name)}  # the device still busy
        assert sizes == []  # ONNX Runtime never ran it
        stats = graph.stats()
        assert (stats.completed, stats.failed + stats.cancelled, stats.running_seconds) == (
            0, 1, 0.0)


# -- the queue's side ------------------------------------------------------------------------
def queue_withdrawal(why: str) -> str:
    return f"{why} while its request waited in the device's queue: it was withdrawn, unrun"


async def queued(slots: Slots, owner: QueueOwner, outcome: list[BaseException | None]
                 ) -> None:
    """Take a slot as a request of ``owner``; note how it ended (None: granted)."""
    token = QUEUE_OWNER.set(owner)
    try:
        await slots.take()
    except RequestWithdrawn as exc:
        outcome.append(exc)
    else:
        outcome.append(None)
    finally:
        QUEUE_OWNER.reset(token)


async def test_withdrawal_takes_only_requests_still_queued() -> None:
    slots = Slots("dev", 1, 8, PriorityDeadlinePolicy())
    slots.open()
    await slots.take()  # the only slot, held
    first, second = QueueOwner(), QueueOwner()
    ends: dict[str, list[BaseException | None]] = {"first": [], "second": []}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(queued, slots, first, ends["first"])
        nursery.start_soon(queued, slots, second, ends["second"])
        await trio.testing.wait_all_tasks_blocked()
        assert slots.queued == 2
        second.withdraw_all("second closed")
        await trio.testing.wait_all_tasks_blocked()
        assert [str(e) for e in ends["second"]] == [queue_withdrawal("second closed")]
        assert (slots.queued, slots.running) == (1, 1)
        slots.free()  # granted to the first: withdrawing it now changes nothing
        first.withdraw_all("first closed")
    assert ends["first"] == [None] and slots.running == 1
    # An owner already withdrawn has a request that queues later withdrawn at once (one
    # that waited for its graph's compile when its context closed, say).
    late: list[BaseException | None] = []
    with trio.fail_after(10):
        await queued(slots, second, late)
    assert [str(e) for e in late] == [queue_withdrawal("second closed")]
    assert slots.queued == 0
    # Nor does a request that never queued (a free slot) concern its owner.
    slots.free()
    token = QUEUE_OWNER.set(first)
    try:
        assert await slots.take() is False
    finally:
        QUEUE_OWNER.reset(token)
    assert slots.running == 1


async def test_a_given_request_is_withdrawn_by_the_owner_its_task_names() -> None:
    # A request given to take (a batched model's that runs alone) is its caller's own:
    # withdrawn as one made there. (A batch's task names no owner: see
    # tests.test_batching_leave.)
    slots = Slots("dev", 1, 8, PriorityDeadlinePolicy())
    slots.open()
    await slots.take()
    owner = QueueOwner()
    request = Request()

    async def take_as_given() -> None:
        QUEUE_OWNER.set(owner)
        with pytest.raises(RequestWithdrawn) as raised:
            await slots.take(request=request)
        assert str(raised.value) == queue_withdrawal("closed")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(take_as_given)
        await trio.testing.wait_all_tasks_blocked()
        owner.withdraw_all("closed")
        assert slots.queued == 0 and request.withdrawn is not None
    assert slots.running == 1


# -- the compile's side -----------------------------------------------------------------------
async def test_a_request_waiting_for_its_graphs_compile_is_withdrawn_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The graph's compile on the device is held; a context's request waits for it with
    # the queue free, and the context closes. Before: the request went on waiting, then
    # ran on the free slot for nobody once the compile ended.
    require_backend("onnxruntime")
    loading, go_on = threading.Event(), threading.Event()
    load_here = _sessions._load_here

    def held_load(*args: Any) -> Any:
        loading.set()
        if not go_on.wait(30):
            raise RuntimeError("the compile was never let go on")
        return load_here(*args)

    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        graph = await rt.load([affine_onnx()], "onnx")
        (actor,) = rt.actors
        key = graph._executable.id  # type: ignore[attr-defined]
        monkeypatch.setattr(_sessions, "_load_here", held_load)
        actor.evict(key)  # the next request compiles it again, held
        compiles = actor.stats().compiles
        ctx = graph.init_execution_context()
        outcomes = Outcomes()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(outcomes.of, "victim",
                                   lambda: ctx.compute({"x": np.ones((1, 4), np.float32)}))
                await trio.to_thread.run_sync(loading.wait, 30)
                await trio.testing.wait_all_tasks_blocked()
                assert (actor.load, actor.stats().running) == (1, 0)  # placed, waiting
                ctx.close()
                await trio.testing.wait_all_tasks_blocked()
                # Told at once, while the compile still runs.
                assert outcomes == {"victim": withdrawn_from_compile(graph.name)}
                assert actor.load == 0 and not actor.cached(key)
                go_on.set()
        finally:
            go_on.set()
        # The compile went on and is kept: the next request runs on it.
        with trio.fail_after(30):
            while not actor.cached(key):
                await trio.sleep(0.01)
        out = await graph.compute({"x": np.ones((1, 4), np.float32)})
        np.testing.assert_allclose(out["y"].numpy(), np.full((1, 4), 3.0))
        assert actor.stats().compiles == compiles + 1  # compiled once
        for stats in (actor.stats(), graph.stats()):
            assert (stats.completed, stats.cancelled, stats.failed) == (1, 1, 0), stats


async def test_closing_the_last_context_of_an_unloaded_graph_as_its_request_starts(
        ) -> None:
    # Before: a close between the request's slot and its run freed the compiled graph
    # under it ("freed before this run started"), counted as a failed request, in most
    # of these trials. Now the request holds the graph: it runs, and its caller hears
    # that the context closed while it ran, or it was withdrawn unrun (cancelled).
    require_backend("onnxruntime")
    x = np.ones((1, 4), np.float32)
    said: list[str] = []
    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        (actor,) = rt.actors
        for trial in range(30):
            graph = await rt.load([affine_onnx()], "onnx", backend="onnxruntime")
            ctx = graph.init_execution_context()
            await graph.unload()  # the open context keeps the graph
            done = trio.Event()

            async def caller(ctx: wasinn.ExecutionContext = ctx, done: trio.Event = done,
                             name: str = graph.name) -> None:
                try:
                    out = await ctx.compute({"x": x})
                    assert out["y"].numpy().tolist() == [[3.0] * 4]
                    said.append("ran")
                except ClosedResourceError as exc:
                    said.append(exc.message.split(":")[0].replace(name, "g"))
                finally:
                    done.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(caller)
                while actor.stats().running == 0 and not done.is_set():
                    await trio.lowlevel.checkpoint()
                for _ in range(trial % 3):
                    await trio.lowlevel.checkpoint()
                ctx.close()
            while actor.busy:
                await trio.sleep(0.001)
        stats = actor.stats()
    assert stats.failed == 0, set(said)
    assert stats.completed + stats.cancelled == 30
    assert set(said) <= {"ran", "the execution context of g was closed while its request ran",
                         "the execution context of g was closed"}, set(said)
