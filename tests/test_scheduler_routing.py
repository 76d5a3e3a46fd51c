"""Placement on devices this machine lacks, with a fake device backend (routing only):
one actor per device, least-loaded placement, compile on first use per device, native
inputs kept on their device, unload on every device, deadlines through the API."""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import wasinn
from tests.fake_backend import FakeBackend
from wasinn import (
    BackendRuntimeError,
    ExecutionTarget,
    TimeoutError_,
    UnsupportedOperationError,
)
from wasinn.configs.loader import parse_config

RECIPE = [b"fake:add=1"]


def fake_config(gpu_devices: Any = "auto", gpu_workers: int = 1, policy: str = "priority",
                gpu_close_timeout: float = 10.0, **runtime: Any) -> Any:
    return parse_config({
        "runtime": runtime,
        "pools": {
            "cpu": {"kind": "cpu", "devices": ["cpu"], "backends": ["fake"]},
            "gpu": {"kind": "gpu", "devices": gpu_devices, "workers": gpu_workers,
                    "backends": ["fake"], "policy": policy,
                    "close_timeout": gpu_close_timeout},
        },
    }, None)


@pytest.fixture
def fake() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
async def rt(fake: FakeBackend) -> AsyncIterator[wasinn.Runtime]:
    async with wasinn.Runtime(fake_config(), backends=[fake]) as runtime:
        yield runtime
    fake.gate.set()


def x(value: float) -> np.ndarray[Any, Any]:
    return np.full((1, 4), value, np.float32)


async def test_one_actor_per_reported_device(rt: wasinn.Runtime) -> None:
    assert [d.name for d in rt.devices] == ["cpu", "gpu:0", "gpu:1"]
    assert all(a.ready for a in rt.actors)


async def test_load_compiles_on_the_default_target_and_contexts_do_no_work(
        rt: wasinn.Runtime, fake: FakeBackend) -> None:
    graph = await rt.load(RECIPE, "ggml", "cpu")
    assert fake.loads == ["cpu"]
    ctx = graph.init_execution_context(target="gpu")
    assert ctx.target is ExecutionTarget.GPU
    assert fake.loads == ["cpu"]  # a ticket: nothing compiled yet
    out = await ctx.compute({"x": x(1)})
    assert out["y"].device.startswith("gpu")  # native on the GPU by default
    assert fake.loads[1:] in (["gpu:0"], ["gpu:1"])
    await ctx.compute({"x": x(2)})
    assert len(fake.loads) == 2  # cached on that device


async def test_least_loaded_gpu_gets_the_next_request(rt: wasinn.Runtime,
                                                      fake: FakeBackend) -> None:
    graph = await rt.load([b"fake:add=1:gate"], "ggml", "gpu")
    fake.loads.clear()
    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(graph.compute, {"x": x(i)})
            await trio.testing.wait_all_tasks_blocked()
        loads = {a.device.name: a.load for a in rt.actors}
        assert loads == {"cpu": 0, "gpu:0": 2, "gpu:1": 2}
        fake.gate.set()
    assert fake.loads == ["gpu:1"]  # compiled on gpu:0 at load, on gpu:1 at first use
    assert sorted({device for device, _ in fake.runs}) == ["gpu:0", "gpu:1"]


async def test_a_native_input_runs_where_it_lives_without_a_copy(
        rt: wasinn.Runtime, fake: FakeBackend) -> None:
    graph = await rt.load(RECIPE, "ggml", "gpu")
    first = await graph.compute({"x": x(1)})
    home = first["y"].device
    before = wasinn.host_copies()
    out = first
    for _ in range(5):
        out = await graph.compute({"x": out["y"]})
    assert wasinn.host_copies() == before
    assert {device for device, _ in fake.runs[1:]} == {home}
    np.testing.assert_array_equal(out["y"].numpy(), x(7))


async def test_unload_frees_the_graph_on_every_device(rt: wasinn.Runtime,
                                                      fake: FakeBackend) -> None:
    graph = await rt.load([b"fake:add=1:gate"], "ggml", "cpu")
    async with trio.open_nursery() as nursery:
        for target in ("cpu", "gpu", "gpu"):
            nursery.start_soon(lambda t=target: graph.compute({"x": x(0)}, target=t))
            await trio.testing.wait_all_tasks_blocked()
        fake.gate.set()
    compiled_on = sorted(fake.loads)
    assert compiled_on == ["cpu", "gpu:0", "gpu:1"]
    await graph.unload()
    assert sorted(fake.closed) == compiled_on
    assert all(not a.session_keys() for a in rt.actors)


async def test_backend_failure_through_the_api_fails_one_request(rt: wasinn.Runtime) -> None:
    graph = await rt.load(RECIPE, "ggml", "gpu")
    with pytest.raises(BackendRuntimeError, match="exploded"):
        await graph.compute({"x": x(-1)})
    out = await graph.compute({"x": x(1)}, keep_on_device=False)
    assert out["y"].is_host and out["y"].numpy().tolist() == [[2.0] * 4]


async def test_timeout_through_the_api(autojump_clock: trio.testing.MockClock,
                                       fake: FakeBackend) -> None:
    async with wasinn.Runtime(fake_config(gpu_devices=["gpu:0"]), backends=[fake]) as rt:
        graph = await rt.load([b"fake:add=1:gate"], "ggml", "gpu")
        ctx = graph.init_execution_context()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(graph.compute, {"x": x(0)})
            await trio.testing.wait_all_tasks_blocked()
            start = trio.current_time()
            with pytest.raises(TimeoutError_, match=r"^run of graph#\d+ \(fake\) on gpu:0: the "
                               r"request's deadline passed before it finished "
                               r"\(timeout=3 s\)$"):
                await ctx.compute({"x": x(5)}, timeout=3)
            assert trio.current_time() - start == pytest.approx(3)
            fake.gate.set()
        assert [v for _, v in fake.runs] == [0.0]  # the timed-out request never ran


# -- a request's deadline or cancellation while its graph compiles ------------------------
SLOW = [b"fake:add=1:slowload"]  # its compile on a GPU waits for fake.load_gate


@pytest.fixture
async def one_gpu(fake: FakeBackend) -> AsyncIterator[wasinn.Runtime]:
    async with wasinn.Runtime(fake_config(gpu_devices=["gpu:0"]), backends=[fake]) as runtime:
        yield runtime
    fake.load_gate.set()


async def test_a_deadline_covers_the_first_use_compile(one_gpu: wasinn.Runtime,
                                                       fake: FakeBackend) -> None:
    graph = await one_gpu.load(SLOW, "ggml", "cpu")
    ctx = graph.init_execution_context(target="gpu")
    with trio.fail_after(5):  # the compile would hold it 30 s
        with pytest.raises(TimeoutError_, match=r"deadline passed while .* compiled.*"
                           r"\(timeout=0\.1 s\)$"):
            await ctx.compute({"x": x(1)}, timeout=0.1)
    assert fake.loading.is_set() and fake.loads == ["cpu"]
    # The compile went on in the background; once it ends, it serves the next request.
    fake.load_gate.set()
    out = await ctx.compute({"x": x(1)})
    assert out["y"].numpy().tolist() == [[2.0] * 4]
    assert sorted(fake.loads) == ["cpu", "gpu:0"]  # compiled once on the GPU


async def test_a_compile_whose_graph_was_unloaded_while_it_waited_is_skipped(
        one_gpu: wasinn.Runtime, fake: FakeBackend) -> None:
    """The GPU's only worker thread is busy compiling; meanwhile three callers give up on
    graphs whose compiles then wait for that thread, and unload them. Once the thread
    is free, those compiles are not done: only the first graph is compiled there."""
    first = await one_gpu.load(SLOW, "ggml", "cpu")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(functools.partial(first.compute, {"x": x(1)}, target="gpu"))
        while not fake.loading.is_set():
            await trio.sleep(0.01)
        for _ in range(3):
            other = await one_gpu.load(SLOW, "ggml", "cpu")
            with trio.move_on_after(0.05) as gave_up:
                await other.compute({"x": x(1)}, target="gpu")
            assert gave_up.cancelled_caught
            await other.unload()
        fake.load_gate.set()
    (gpu,) = [stats for stats in one_gpu.stats() if stats.device == "gpu:0"]
    assert (fake.loads.count("gpu:0"), gpu.compiles, gpu.graphs) == (1, 1, 1)


async def test_callers_waiting_on_one_compile_leave_on_their_own_deadlines(
        one_gpu: wasinn.Runtime, fake: FakeBackend) -> None:
    graph = await one_gpu.load(SLOW, "ggml", "cpu")
    outcomes: dict[str, object] = {}

    async def compute(name: str, **how: Any) -> None:
        try:
            outcomes[name] = (await graph.compute({"x": x(1)}, target="gpu", **how)
                              )["y"].numpy().tolist()
        except TimeoutError_ as exc:
            outcomes[name] = exc

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(compute, "first", timeout=0.1))
            nursery.start_soon(functools.partial(compute, "second", timeout=0.2))
            with trio.move_on_after(0.1):  # a third caller, cancelled
                await graph.compute({"x": x(1)}, target="gpu")
            nursery.start_soon(compute, "patient")
            await trio.sleep(0.3)
            assert "patient" not in outcomes
            fake.load_gate.set()
    assert isinstance(outcomes["first"], TimeoutError_)
    assert isinstance(outcomes["second"], TimeoutError_)
    assert outcomes["patient"] == [[2.0] * 4]
    assert sorted(fake.loads) == ["cpu", "gpu:0"]
    # Each request is counted by how it ended, those that ended during the compile too
    # (before: only "patient" was counted, anywhere).
    (gpu,) = [stats for stats in one_gpu.stats() if stats.device == "gpu:0"]
    for stats in (graph.stats(), gpu):
        assert (stats.completed, stats.timed_out, stats.cancelled) == (1, 2, 1), stats


async def test_a_load_cancelled_while_it_compiles_keeps_nothing(one_gpu: wasinn.Runtime,
                                                                fake: FakeBackend) -> None:
    # Before: the compile ended after the cancelled load and was cached for a model that
    # nobody held and nobody could unload, for the runtime's lifetime.
    with trio.move_on_after(5) as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(one_gpu.load, SLOW, "ggml", "gpu"))
            await trio.to_thread.run_sync(fake.loading.wait)
            nursery.cancel_scope.cancel()
    assert not scope.cancelled_caught
    fake.load_gate.set()
    with trio.fail_after(5):
        while "gpu:0" not in fake.closed:  # compiled, then closed at once: nobody's
            await trio.sleep(0.01)
    (gpu,) = [stats for stats in one_gpu.stats() if stats.device == "gpu:0"]
    assert (gpu.graphs, gpu.compiles) == (0, 1)


async def test_a_graph_unloaded_while_it_compiles_is_not_kept(one_gpu: wasinn.Runtime,
                                                              fake: FakeBackend) -> None:
    graph = await one_gpu.load(SLOW, "ggml", "cpu")
    with pytest.raises(TimeoutError_, match=r"\(timeout=0\.1 s\)$"):  # Graph.compute too
        await graph.compute({"x": x(1)}, target="gpu", timeout=0.1)
    await graph.unload()
    (gpu,) = [a for a in one_gpu.actors if str(a.device) == "gpu:0"]
    fake.load_gate.set()
    with trio.fail_after(5):
        while "gpu:0" not in fake.closed:  # compiled, then closed at once: nobody's
            await trio.sleep(0.01)
    assert not gpu.session_keys() and gpu.stats().graphs == 0


async def test_closing_the_runtime_does_not_wait_for_a_compile(fake: FakeBackend) -> None:
    config = fake_config(gpu_devices=["gpu:0"], gpu_close_timeout=0.2)
    failures: list[BaseException] = []

    async def compute(graph: Any) -> None:
        try:
            await graph.compute({"x": x(1)}, target="gpu")
        except wasinn.ClosedResourceError as exc:
            failures.append(exc)

    try:
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery, wasinn.Runtime(config,
                                                                      backends=[fake]) as rt:
                graph = await rt.load(SLOW, "ggml", "cpu")
                nursery.start_soon(compute, graph)
                await trio.to_thread.run_sync(fake.loading.wait)
        (error,) = failures
        assert "closed" in str(error)
    finally:
        fake.load_gate.set()


async def test_closing_the_last_context_fails_its_queued_request_saying_so(
        fake: FakeBackend) -> None:
    async with wasinn.Runtime(fake_config(gpu_devices=["gpu:0"]), backends=[fake]) as rt:
        busy = await rt.load([b"fake:add=1:gate"], "ggml", "gpu")
        graph = await rt.load([b"fake:add=2"], "ggml", "gpu")
        await graph.compute({"x": x(0)})  # compiled
        ctx = graph.init_execution_context()
        await graph.unload()  # the context keeps the model
        errors: list[BaseException] = []

        async def queued() -> None:
            try:
                await ctx.compute({"x": x(1)})
            except wasinn.ClosedResourceError as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(busy.compute, {"x": x(0)})  # holds the only slot
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(queued)
            await trio.testing.wait_all_tasks_blocked()
            ctx.close()  # the model's last user: its graph is freed
            fake.gate.set()
        (error,) = errors
        # Withdrawn from the queue as the context closed: it never reaches the freed graph.
        assert "was closed while its request waited in the device's queue" in str(error)
        assert [v for _, v in fake.runs] == [0.0, 0.0]  # the first compute and busy's


async def test_priority_through_the_api(fake: FakeBackend) -> None:
    async with wasinn.Runtime(fake_config(gpu_devices=["gpu:0"]), backends=[fake]) as rt:
        graph = await rt.load([b"fake:add=1:gate"], "ggml", "gpu")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(graph.compute, {"x": x(0)})
            await trio.testing.wait_all_tasks_blocked()
            for value, priority in ((1, 0), (2, 9), (3, 4)):
                nursery.start_soon(lambda v=value, p=priority: graph.compute({"x": x(v)},
                                                                            priority=p))
                await trio.testing.wait_all_tasks_blocked()
            fake.gate.set()
        assert [v for _, v in fake.runs] == [0.0, 2.0, 3.0, 1.0]


async def test_missing_explicit_device_fails_the_start(fake: FakeBackend) -> None:
    with pytest.raises(UnsupportedOperationError, match="gpu:5 is not reported"):
        async with wasinn.Runtime(fake_config(gpu_devices=["gpu:5"]), backends=[fake]):
            pass


async def test_no_device_of_the_kind_and_the_fallback(fake: FakeBackend) -> None:
    async with wasinn.Runtime(fake_config(), backends=[fake]) as rt:
        graph = await rt.load(RECIPE, "ggml", "gpu")
        with pytest.raises(UnsupportedOperationError, match="no tpu device"):
            graph.init_execution_context("tpu")
    async with wasinn.Runtime(fake_config(fallback="gpu"), backends=[fake]) as rt:
        graph = await rt.load(RECIPE, "ggml", "cpu")
        with pytest.warns(RuntimeWarning, match="tpu falls back to gpu"):
            ctx = graph.init_execution_context("tpu")
        out = await ctx.compute({"x": x(1)})
        assert out["y"].device.startswith("gpu")
    # A fallback of the very kind that is missing cannot help, and says so.
    no_gpu = FakeBackend(devices=("cpu",))
    async with wasinn.Runtime(fake_config(fallback="gpu"), backends=[no_gpu]) as rt:
        graph = await rt.load(RECIPE, "ggml", "cpu")
        with pytest.raises(UnsupportedOperationError,
                           match=r"fallback = 'gpu' is that same kind: expected a fallback "
                                 r"this runtime has a device for \(cpu\)"):
            graph.init_execution_context("gpu")


async def test_tenants_take_turns_on_a_fair_pool(fake: FakeBackend) -> None:
    config = fake_config(gpu_devices=["gpu:0"], policy="fair")
    async with wasinn.Runtime(config, backends=[fake]) as rt:
        graph = await rt.load([b"fake:add=1:gate"], "ggml", "gpu")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(graph.compute, {"x": x(0)})
            await trio.testing.wait_all_tasks_blocked()
            for value, tenant in ((1, "flood"), (2, "flood"), (3, "flood"), (4, "quiet")):
                nursery.start_soon(lambda v=value, t=tenant: graph.compute({"x": x(v)},
                                                                          tenant=t))
                await trio.testing.wait_all_tasks_blocked()
            fake.gate.set()
        assert [v for _, v in fake.runs] == [0.0, 1.0, 4.0, 2.0, 3.0]


async def test_a_device_that_cannot_be_opened_fails_the_start(
        fake: FakeBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    from wasinn.actors import device as device_module
    from wasinn.actors.devicectx import DeviceContext

    class Broken(DeviceContext):
        def open(self) -> None:
            if self.device.name == "gpu:1":
                raise RuntimeError("driver says no")

    monkeypatch.setattr(device_module, "context_for", Broken)
    with pytest.raises(UnsupportedOperationError, match="gpu:1: cannot open the device: driver"):
        async with wasinn.Runtime(fake_config(), backends=[fake]):
            pass


async def test_a_pool_that_finds_no_device_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    # A CPU-only host with a gpu pool (devices = "auto"): not an error, but said loudly.
    cpu_only = FakeBackend(devices=("cpu",))
    with caplog.at_level(logging.WARNING, logger="wasinn.scheduler"):
        async with wasinn.Runtime(fake_config(), backends=[cpu_only]) as rt:
            assert [d.name for d in rt.devices] == ["cpu"]
    (record,) = [r for r in caplog.records if r.name == "wasinn.scheduler"]
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert "pool gpu (kind gpu): no device found (backends asked: fake)" in message
    assert "gpu targets get unsupported-operation" in message


async def test_a_pool_that_finds_devices_logs_nothing(caplog: pytest.LogCaptureFixture,
                                                     fake: FakeBackend) -> None:
    with caplog.at_level(logging.WARNING, logger="wasinn.scheduler"):
        async with wasinn.Runtime(fake_config(), backends=[fake]):
            pass
    assert not [r for r in caplog.records if r.name == "wasinn.scheduler"]


class _Unable(FakeBackend):
    """A fake backend under another name that lacks a kernel for every model on the
    CPU, as ONNX Runtime lacks one for a bf16 Add."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def load(self, builders: Any, encoding: Any, device: Any, options: Any = None) -> Any:
        if device.name == "cpu":
            self.loads.append("refused")
            raise UnsupportedOperationError(f"{self.name}: no kernel for it on {device}")
        return super().load(builders, encoding, device, options)


async def test_the_next_backend_that_reads_a_model_compiles_what_the_first_cannot(
        caplog: pytest.LogCaptureFixture) -> None:
    first, second, third = _Unable("first"), _Unable("second"), FakeBackend()
    config = parse_config({"pools": {"cpu": {"kind": "cpu", "devices": ["cpu"],
                                             "backends": ["first", "second", "fake"]},
                                     "gpu": {"kind": "gpu", "devices": "auto",
                                             "backends": ["first", "second", "fake"]}}},
                          None)
    async with wasinn.Runtime(config, backends=[first, second, third]) as rt:
        with caplog.at_level(logging.WARNING, logger="wasinn.scheduler"):
            graph = await rt.load(RECIPE, "ggml")
        assert graph.backend == "fake" and first.loads == second.loads == ["refused"]
        assert [r.getMessage() for r in caplog.records] == [
            f"{graph.name}: backend first cannot run it on cpu (first: no kernel for it on "
            "cpu): it runs on fake instead"]
        out = await graph.compute({"x": x(1)})
        assert out["y"].numpy().tolist() == [[2.0] * 4]
        # Another device of the kind asks again from the first backend: gpu is fine.
        ctx = graph.init_execution_context(target="gpu")
        await ctx.compute({"x": x(1)})
        assert first.loads[-1].startswith("gpu")
        # A model that names its backend gets that backend's error, and no other.
        with pytest.raises(UnsupportedOperationError, match=r"^first: no kernel for it on cpu$"):
            await rt.load(RECIPE, "ggml", backend="first")
        assert third.loads.count("cpu") == 1


async def test_where_no_backend_can_compile_a_model_the_first_ones_error_is_raised() -> None:
    first, second = _Unable("first"), _Unable("second")
    config = parse_config({"pools": {"cpu": {"kind": "cpu", "devices": ["cpu"],
                                             "backends": ["first", "second"]}}}, None)
    async with wasinn.Runtime(config, backends=[first, second]) as rt:
        with pytest.raises(UnsupportedOperationError,
                           match=r"^first: no kernel for it on cpu \(nor could second, for "
                                 r"the same reason\)$"):
            await rt.load(RECIPE, "ggml")


class _UnableAnywhere(_Unable):
    """As :class:`_Unable`, on every device (the fake's slow compile is a GPU's)."""

    def load(self, builders: Any, encoding: Any, device: Any, options: Any = None) -> Any:
        self.loads.append("refused")
        raise UnsupportedOperationError(f"{self.name}: no kernel for it on {device}")


async def test_the_runtime_closing_while_the_next_backend_compiles_says_so() -> None:
    # Before, the ClosedResourceError of that compile was taken for the next backend's
    # refusal: the caller heard the first backend's unsupported-operation.
    first, fake = _UnableAnywhere("first"), FakeBackend()
    config = parse_config({"pools": {"gpu": {"kind": "gpu", "devices": "auto",
                                             "backends": ["first", "fake"],
                                             "close_timeout": 0.2}}}, None)
    failures: list[BaseException] = []

    async def load(rt: wasinn.Runtime) -> None:
        try:
            await rt.load(SLOW, "ggml", "gpu")
        except wasinn.WasiNNError as exc:
            failures.append(exc)

    try:
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery, wasinn.Runtime(
                    config, backends=[first, fake]) as rt:
                nursery.start_soon(load, rt)
                await trio.to_thread.run_sync(fake.loading.wait)  # fake compiles it
        (error,) = failures
        assert isinstance(error, wasinn.ClosedResourceError), repr(error)
        assert first.loads == ["refused"]
    finally:
        fake.load_gate.set()
