"""A lost GPU: a CUDA error that leaves the process's CUDA context unusable (a device-side
assert, an illegal memory access) fails its request with DeviceLostError, takes that
device out of service, and leaves every other device serving.

The error classifier is checked against the messages torch and ONNX Runtime build; the
actor and placement behaviour with the fake device backend (routing only: this machine
has no GPU), whose runs on a GPU fail with torch's message for a device-side assert and
keep failing, as a real lost GPU's do. The test with a real device-side assert is marked
``gpu``: it runs in a process of its own, whose CUDA context it loses.
"""

from __future__ import annotations

import contextlib
import functools
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import numpy as np
import pytest
import trio

import wasinn
from tests.fake_backend import CUDA_ASSERT_MESSAGE, DEVICE_ASSERT, FakeBackend
from tests.support import require_backend
from tests.test_scheduler_routing import fake_config
from wasinn import (
    BackendRuntimeError,
    DeviceLostError,
    ErrorCode,
    Tensor,
    UnsupportedOperationError,
)
from wasinn.actors import devicectx
from wasinn.backends import cuda
from wasinn.backends.cuda import (
    STICKY_ERRORS,
    context_failure,
    retain_primary_context,
    sticky_error,
)
from wasinn.backends.sandbox import load_sandboxed

RECIPE = [b"fake:add=1"]

#: ONNX Runtime's CUDA provider's message for the same error (CudaCall in cuda_call.cc),
#: as onnxruntime's Python binding raises it.
ORT_ASSERT_STATUS = (
    "CUDA failure 710: device-side assert triggered ; GPU=0 ; hostname=host ; "
    "file=cuda_execution_provider.cc ; line=453 ; "
    "expr=cudaStreamSynchronize(static_cast<cudaStream_t>(stream)); ")
ORT_ASSERT_MESSAGE = f"[ONNXRuntimeError] : 1 : FAIL : {ORT_ASSERT_STATUS}"


@pytest.fixture(autouse=True)
def _driver_cannot_tell(monkeypatch: pytest.MonkeyPatch) -> None:
    """The losses here are simulated (a fake library raising CUDA's words): where a real
    CUDA driver is loaded it would have the last word and find this process's context
    fine, so every test starts with a driver that cannot tell (as on a machine without
    one); a test that asks the driver patches it itself."""
    monkeypatch.setattr(devicectx, "context_failure", lambda index: None)


def x(value: float) -> np.ndarray[Any, Any]:
    return np.full((1, 4), value, np.float32)


async def compute_failing_into(errors: list[BaseException], graph: wasinn.Graph,
                               value: float) -> None:
    try:
        await graph.compute({"x": x(value)})
    except BackendRuntimeError as exc:
        errors.append(exc)


# -- which errors lose a device -------------------------------------------------------------
@pytest.mark.parametrize("message", [CUDA_ASSERT_MESSAGE, ORT_ASSERT_MESSAGE])
def test_a_device_side_assert_is_recognised_in_either_librarys_words(message: str) -> None:
    assert sticky_error(RuntimeError(message)) == (
        "cudaErrorAssert (710): device-side assert triggered")


def test_every_sticky_error_is_recognised_by_its_code_or_in_either_librarys_words() -> None:
    for code, (name, text) in STICKY_ERRORS.items():
        want = f"{name} ({code}): {text}"
        assert sticky_error(RuntimeError(f"CUDA error: {text}\nCUDA kernel errors")) == want
        ort = (f"[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code returned "
               f"while running Gather node. Name:'g' Status Message: cuda_call.cc:129 "
               f"CudaCall(...) CUDA failure {code}: {text} ; GPU=0 ; hostname=h ; expr=x; ")
        assert sticky_error(RuntimeError(ort)) == want
        coded = RuntimeError("CUDA error")
        coded.error_code = code  # type: ignore[attr-defined]  # torch.AcceleratorError's
        assert sticky_error(coded) == want


@pytest.mark.parametrize("error", [
    # wasinn's own errors may quote what a caller sent: an input's name, a model's bytes
    wasinn.UnknownNameError("the graph has no input 'misaligned address': expected x"),
    wasinn.InvalidEncodingError("cannot read b'CUDA error: unspecified launch failure'"),
    BackendRuntimeError("CUDA error: device-side assert triggered"),
    # a library's text that names one without being one
    RuntimeError("input 'CUDA error: device-side assert triggered' is unknown"),
    RuntimeError("CUDA failure 700: device-side assert triggered ; GPU=0"),  # code != text
    RuntimeError("cudaErrorAssert"),
])
def test_text_that_only_quotes_a_sticky_error_does_not_lose_a_gpu(error: Exception) -> None:
    assert sticky_error(error) is None


def test_the_driver_has_the_last_word_where_it_can_be_asked() -> None:
    driver = _PrimaryContexts()
    driver.open(0)
    assert context_failure(0, driver) == 0  # fine: the text misled
    driver.lost[driver.context(0)] = 710
    assert context_failure(0, driver) == 710  # lost
    assert context_failure(1, driver) is None  # no context there yet: cannot tell
    assert 11 not in driver.retained  # (and none was made to ask)
    assert context_failure(2, driver) is None  # no such device
    assert context_failure(0, object()) is None  # not a driver library
    driver.pushing = 710  # an earlier launch's sticky error, reported by the push
    assert context_failure(0, driver) == 710
    driver.pushing = 201  # any other failure to push: cannot tell
    assert context_failure(0, driver) is None
    assert driver.retained == {10: 1} and driver.stack() == []  # left as it was found
    context = devicectx.CudaContext(wasinn.backends.Device.parse("gpu:0"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(devicectx, "context_failure", lambda index: 0)

        def fails() -> None:
            raise RuntimeError(CUDA_ASSERT_MESSAGE)

        with pytest.raises(RuntimeError, match="device-side assert"):
            context.wrap(fails)()  # raised as it is: the device is fine
        assert context.lost is None
        patch.setattr(devicectx, "context_failure", lambda index: 710)
        with pytest.raises(DeviceLostError):
            context.wrap(fails)()


def _in_a_new_thread(call: Any) -> BaseException | None:
    # What ``call`` raised in a thread of its own (a worker's: its device is 0).
    raised: list[BaseException | None] = [None]

    def run() -> None:
        try:
            call()
        except BaseException as exc:
            raised[0] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return raised[0]


def test_a_lost_gpu_other_than_gpu_0_is_found_whatever_the_job_thread_has_current(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: the driver was asked about the context current in the job's thread, which
    # leaving torch.cuda.device(1) had made gpu:0's again: a device-side assert on gpu:1
    # came out as the library's error, and gpu:1 stayed in service.
    require_backend("torch")
    import torch

    driver = _PrimaryContexts()
    driver.open(0)  # both actors have opened their device
    driver.open(1)
    monkeypatch.setattr(cuda, "_driver", lambda: driver)
    monkeypatch.setattr(devicectx, "context_failure", context_failure)

    class CudaDevice:  # torch.cuda.device: selects its device, then the previous again
        def __init__(self, index: int) -> None:
            self.index = index

        def __enter__(self) -> None:
            self.previous = driver.device()
            driver.select(self.index)

        def __exit__(self, *exc: object) -> None:
            driver.select(self.previous)

    class Stream:
        def synchronize(self) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "device", CudaDevice)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())

    def kernel_assert() -> None:
        driver.hit_assert()  # on the context current in the job: its device's
        raise RuntimeError(CUDA_ASSERT_MESSAGE)

    for index in (1, 0):
        driver.lost.clear()
        context = devicectx.TorchCudaContext(wasinn.backends.Device.parse(f"gpu:{index}"))
        context.stream = Stream()
        lost = _in_a_new_thread(context.wrap(kernel_assert))
        assert isinstance(lost, DeviceLostError), lost
        assert f"gpu:{index} is lost: cudaErrorAssert (710)" in lost.message
        assert context.lost is lost
        assert driver.lost == {driver.context(index): 710}
    assert driver.retained == {10: 1, 11: 1}  # each check released what it retained


def test_a_cuda_gpu_asks_the_driver_about_its_own_context(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # ONNX Runtime alone (no torch stream): a caller's thread that last ran on gpu:0,
    # running gpu:1's job. Before: the driver was asked about gpu:0's context, in either
    # direction; and a batch ended on the words alone, the driver unasked.
    driver = _PrimaryContexts()
    driver.open(0)
    driver.open(1)
    monkeypatch.setattr(cuda, "_driver", lambda: driver)
    monkeypatch.setattr(devicectx, "context_failure", context_failure)
    gpu1 = devicectx.CudaContext(wasinn.backends.Device.parse("gpu:1"))

    def on_gpu_0_then(job: Any) -> Any:
        def run() -> Any:
            driver.select(0)
            return job()

        return run

    def fails() -> None:
        raise RuntimeError(ORT_ASSERT_MESSAGE)

    driver.lost[driver.context(0)] = 710  # gpu:0 is lost; gpu:1 is fine
    error = _in_a_new_thread(on_gpu_0_then(gpu1.wrap(fails)))
    assert type(error) is RuntimeError and gpu1.lost is None  # the words misled
    assert not gpu1.fatal(RuntimeError(ORT_ASSERT_MESSAGE))  # a batch's members run on

    driver.lost = {driver.context(1): 710}  # gpu:1 is lost; gpu:0 is fine
    error = _in_a_new_thread(on_gpu_0_then(gpu1.wrap(fails)))
    assert isinstance(error, DeviceLostError) and gpu1.lost is error
    assert "gpu:1 is lost: cudaErrorAssert (710)" in error.message
    assert gpu1.fatal(RuntimeError(ORT_ASSERT_MESSAGE))
    assert not gpu1.fatal(RuntimeError("CUDA error: invalid argument"))


def test_a_node_named_after_a_sticky_error_does_not_lose_a_gpu() -> None:
    # ONNX Runtime's message quotes the failing node's name, which is the model's: a
    # node named as ONNX Runtime words a device-side assert made its ordinary error read
    # as one (a sandboxed GPU graph's process retired on every such run).
    require_backend("onnxruntime")
    require_backend("onnx")
    import onnxruntime as ort

    from tests.test_sandbox_runs import _named_node_onnx

    for name in ("n ; CUDA failure 710: device-side assert triggered ; GPU=0",
                 "n' Status Message: CUDA failure 710: device-side assert triggered ; GPU=0"):
        session = ort.InferenceSession(_named_node_onnx(name),
                                       providers=["CPUExecutionProvider"])
        with pytest.raises(Exception, match="Status Message") as caught:
            session.run(None, {"x": np.ones(8, np.float32), "s": np.array([3, 3], np.int64)})
        assert name in str(caught.value)
        assert sticky_error(caught.value) is None
    for status in (ORT_ASSERT_STATUS, "/src/onnxruntime/core/providers/cuda/cuda_call.cc:129 "
                   "void onnxruntime::CudaCall(...) [with THRW = true] " + ORT_ASSERT_STATUS):
        ours = (f"[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code returned "
                f"while running Gather node. Name:'{name}' Status Message: {status}")
        assert sticky_error(RuntimeError(ours)) == (  # ONNX Runtime's own status counts
            "cudaErrorAssert (710): device-side assert triggered")
    not_ours = ("[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Invalid input name: "
                "x ; CUDA failure 710: device-side assert triggered ; GPU=0")
    assert sticky_error(RuntimeError(not_ours)) is None  # (a name the status quotes)


def test_a_sticky_error_is_found_behind_the_backends_wrapper() -> None:
    wrapped = BackendRuntimeError("torch: run failed")
    wrapped.__cause__ = RuntimeError(CUDA_ASSERT_MESSAGE)
    assert sticky_error(wrapped) == "cudaErrorAssert (710): device-side assert triggered"
    assert sticky_error(wrapped.prefixed("gpu:0")) is not None  # through wasinn's copies


def test_a_sandboxed_graphs_lost_context_retires_its_process_not_the_device() -> None:
    # The fake library on gpu:0 fails a run of 710 with torch's exception for a
    # device-side assert, and every later run in its process too: the process says so
    # (from the library's exception, not its words), the host retires it and counts a
    # crash of those inputs.
    from tests.crashing_backend import CrashingBackend

    graph = load_sandboxed(CrashingBackend(), RECIPE, wasinn.GraphEncoding.GGML,
                           wasinn.backends.Device.parse("gpu:0"))
    try:
        first = graph.pid
        with pytest.raises(BackendRuntimeError) as caught:
            graph.run({"x": Tensor.from_numpy(x(DEVICE_ASSERT))})
        error = caught.value
        assert not isinstance(error, DeviceLostError)
        assert "device-side assert triggered" in error.message
        assert error.message.endswith(
            "(in the process that ran the sandboxed model, whose CUDA context this lost: it "
            "was retired; the next run starts a new process)")
        assert graph.pid is None and graph.backoff.crashes == 1
        assert sticky_error(error) is None  # the host's own CUDA context is fine
        assert sticky_error(error.prefixed("gpu:0")) is None
        context = devicectx.CudaContext(wasinn.backends.Device.parse("gpu:0"))

        def fails() -> None:
            raise error

        with pytest.raises(BackendRuntimeError, match="retired"):
            context.wrap(fails)()
        assert context.lost is None

        # counted as a crash of those inputs: the second retires the process too, and
        # says they are refused, the third is refused without a process
        with pytest.raises(BackendRuntimeError, match=r"these inputs, which crashed it 2 "
                                                      r"times, are refused for 600 s\)$"):
            graph.run({"x": Tensor.from_numpy(x(DEVICE_ASSERT))})
        with pytest.raises(BackendRuntimeError, match=(
                r"^crashing: these inputs crashed the model's process 2 times \(the last "
                r"[0-9.]+ s ago: it lost its CUDA context\)")):
            graph.run({"x": Tensor.from_numpy(x(DEVICE_ASSERT))})
        assert graph.pid is None
        out = graph.run({"x": Tensor.from_numpy(x(1))})
        assert out["y"].numpy().tolist() == [[2.0] * 4]
        second = graph.pid
        assert second not in (None, first)
        with pytest.raises(BackendRuntimeError, match=r"^RuntimeError: fake library exploded "
                                                      r"on a negative input$") as plain:
            graph.run({"x": Tensor.from_numpy(x(-1))})
        assert "retired" not in plain.value.message and graph.pid == second  # kept
    finally:
        graph.close()


@pytest.mark.parametrize("message", [
    "CUDA out of memory. Tried to allocate 2.00 GiB",  # recoverable: the context survives
    "CUDA error: invalid argument",
    "[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Got invalid dimensions for input: x",
    "fake library exploded on a negative input",
])
def test_errors_a_gpu_survives_do_not_lose_it(message: str) -> None:
    assert sticky_error(RuntimeError(message)) is None


def test_a_cuda_context_turns_a_sticky_error_into_device_lost_once() -> None:
    context = devicectx.CudaContext(wasinn.backends.Device.parse("gpu:0"))
    told: list[DeviceLostError] = []
    context.on_lost = told.append

    def fails() -> None:
        raise RuntimeError(CUDA_ASSERT_MESSAGE)

    for _ in range(2):
        with pytest.raises(DeviceLostError) as lost:
            context.wrap(fails)()
        assert lost.value.code is ErrorCode.RUNTIME_ERROR
        assert "gpu:0 is lost: cudaErrorAssert (710)" in lost.value.message
        assert "until the process restarts" in lost.value.message
        assert isinstance(lost.value.__cause__, RuntimeError)
    assert len(told) == 1 and context.lost is told[0]  # recorded and told once

    def explodes() -> None:
        raise ValueError("an ordinary failure")

    with pytest.raises(ValueError, match="ordinary"):  # any other error passes unchanged
        devicectx.CudaContext(context.device).wrap(explodes)()


class _PrimaryContexts:
    """Stands for libcuda's context calls, on ``count`` devices: each returns its
    CUresult (``retain``: what retaining a primary context answers, ``pushing``: what
    pushing one does). A device's primary context is active while retained (counted in
    ``retained``, by CUdevice); one whose kernel hit a sticky error (``lost``: context ->
    code) answers it when synchronized. Each thread has its own stack of current
    contexts, whose top :meth:`select` replaces as the CUDA runtime's ``cudaSetDevice``
    does (torch's device switch), a thread's device being 0 until it selects one."""

    def __init__(self, retain: int = 0, count: int = 2) -> None:
        self.retain = retain
        self.count = count
        self.pushing = 0
        self.calls: list[tuple[str, int]] = []
        self.retained: dict[int, int] = {}
        self.lost: dict[int, int] = {}
        self._thread = threading.local()

    # -- as the CUDA runtime, or a kernel, acts on it
    @staticmethod
    def context(ordinal: int) -> int:
        """Device ``ordinal``'s primary context."""
        return 0x1000 + 10 + ordinal

    def open(self, ordinal: int) -> None:
        """The runtime's first use of the device (an actor's start): retains its context."""
        self.retained[10 + ordinal] = self.retained.get(10 + ordinal, 0) + 1

    def stack(self) -> list[int]:
        """The calling thread's stack of current contexts."""
        if not hasattr(self._thread, "stack"):
            self._thread.stack, self._thread.device = [], 0
        stack: list[int] = self._thread.stack
        return stack

    def device(self) -> int:
        """The calling thread's device (``cudaGetDevice``)."""
        self.stack()
        device: int = self._thread.device
        return device

    def select(self, ordinal: int) -> None:
        """``cudaSetDevice``: makes the device's primary context current here."""
        stack = self.stack()
        self._thread.device = ordinal
        stack[-1:] = [self.context(ordinal)]

    def hit_assert(self) -> None:
        """A kernel queued on the context current here hits a device-side assert."""
        self.lost[self.stack()[-1]] = 710

    # -- the driver's calls
    def cuDeviceGet(self, device: Any, ordinal: int) -> int:
        if ordinal >= self.count:
            return 101  # CUDA_ERROR_INVALID_DEVICE
        device._obj.value = 10 + ordinal  # a CUdevice is the driver's own handle
        self.calls.append(("cuDeviceGet", ordinal))
        return 0

    def cuDevicePrimaryCtxGetState(self, device: Any, flags: Any, active: Any) -> int:
        active._obj.value = int(self.retained.get(device.value, 0) > 0)
        return 0

    def cuDevicePrimaryCtxRetain(self, context: Any, device: Any) -> int:
        self.calls.append(("cuDevicePrimaryCtxRetain", device.value))
        if self.retain == 0:
            context._obj.value = 0x1000 + device.value
            self.retained[device.value] = self.retained.get(device.value, 0) + 1
        return self.retain

    def cuDevicePrimaryCtxRelease_v2(self, device: Any) -> int:
        self.calls.append(("cuDevicePrimaryCtxRelease_v2", device.value))
        self.retained[device.value] -= 1
        if not self.retained[device.value]:
            del self.retained[device.value]
        return 0

    def cuCtxPushCurrent_v2(self, context: Any) -> int:
        if self.pushing:
            return self.pushing
        self.stack().append(context.value)
        return 0

    def cuCtxPopCurrent_v2(self, context: Any) -> int:
        context._obj.value = self.stack().pop()
        return 0

    def cuCtxGetCurrent(self, context: Any) -> int:
        stack = self.stack()
        context._obj.value = stack[-1] if stack else None
        return 0

    def cuCtxSynchronize(self) -> int:
        stack = self.stack()
        if not stack:
            return 201  # CUDA_ERROR_INVALID_CONTEXT
        return self.lost.get(stack[-1], 0)

    def cuGetErrorName(self, code: int, out: Any) -> int:
        out._obj.value = b"CUDA_ERROR_OUT_OF_MEMORY"
        return 0

    def cuGetErrorString(self, code: int, out: Any) -> int:
        out._obj.value = b"out of memory"
        return 0


def test_a_cuda_device_is_opened_by_retaining_its_primary_context_until_closed() -> None:
    driver = _PrimaryContexts()
    release = retain_primary_context(1, driver)
    assert driver.calls == [("cuDeviceGet", 1), ("cuDevicePrimaryCtxRetain", 11)]
    release()
    release()  # once only
    assert driver.calls[2:] == [("cuDevicePrimaryCtxRelease_v2", 11)]


def test_a_cuda_device_that_cannot_take_a_context_is_not_opened() -> None:
    with pytest.raises(UnsupportedOperationError,
                       match=r"^gpu:0: CUDA could not open a context on it: "
                             r"CUDA_ERROR_OUT_OF_MEMORY \(out of memory, CUresult 2\)$"):
        retain_primary_context(0, _PrimaryContexts(retain=2))
    with pytest.raises(UnsupportedOperationError, match=r"lacks a call it needs"):
        retain_primary_context(0, object())


async def test_a_cuda_gpu_actor_holds_its_context_while_it_serves(
        monkeypatch: pytest.MonkeyPatch) -> None:
    driver = _PrimaryContexts()
    monkeypatch.setattr(devicectx, "device_count", lambda: 2)
    monkeypatch.setattr(devicectx, "torch_sees", lambda device: False)  # (a GPU torch sees
    # gets torch's context: the driver's primary one is for the GPUs it does not)
    monkeypatch.setattr(devicectx, "retain_primary_context",
                        lambda index: retain_primary_context(index, driver))
    async with wasinn.Runtime(fake_config(), backends=[FakeBackend()]) as rt:
        assert sorted(driver.calls) == [("cuDeviceGet", 0), ("cuDeviceGet", 1),
                                        ("cuDevicePrimaryCtxRetain", 10),
                                        ("cuDevicePrimaryCtxRetain", 11)]
        graph = await rt.load(RECIPE, "ggml", "gpu")
        await graph.compute({"x": x(1)})
        driver.calls.clear()
    assert sorted(driver.calls) == [("cuDevicePrimaryCtxRelease_v2", 10),
                                    ("cuDevicePrimaryCtxRelease_v2", 11)]


async def test_a_gpu_that_cannot_take_a_context_fails_the_start_naming_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Ready means usable: the error comes at the start, not at the first request.
    monkeypatch.setattr(devicectx, "device_count", lambda: 2)
    monkeypatch.setattr(devicectx, "torch_sees", lambda device: False)
    monkeypatch.setattr(devicectx, "retain_primary_context",
                        lambda index: retain_primary_context(index, _PrimaryContexts(retain=2)))
    with pytest.raises(UnsupportedOperationError,
                       match=r"^gpu:\d: CUDA could not open a context on it: "
                             r"CUDA_ERROR_OUT_OF_MEMORY"):
        async with wasinn.Runtime(fake_config(), backends=[FakeBackend()]):
            pass  # pragma: no cover


# -- the actors and placement (fake CUDA devices) -------------------------------------------
@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeBackend:
    # The fake's GPUs stand for CUDA devices: their actors watch for lost devices (and
    # open a context with no driver to ask).
    monkeypatch.setattr(devicectx, "device_count", lambda: 2)
    monkeypatch.setattr(devicectx, "retain_primary_context", lambda index: lambda: None)
    return FakeBackend()


def actor(rt: wasinn.Runtime, name: str) -> Any:
    return next(a for a in rt.actors if a.device.name == name)


async def test_a_lost_gpu_fails_its_request_and_the_other_gpu_takes_the_next(
        fake: FakeBackend) -> None:
    async with wasinn.Runtime(fake_config(), backends=[fake]) as rt:
        await lose_one_gpu_then_serve_on(rt, fake)


async def lose_one_gpu_then_serve_on(rt: wasinn.Runtime, fake: FakeBackend) -> None:
    graph = await rt.load(RECIPE, "ggml", "gpu")
    with pytest.raises(DeviceLostError, match=r"gpu:\d is lost: cudaErrorAssert") as lost:
        await graph.compute({"x": x(DEVICE_ASSERT)})
    (gone,) = fake.lost
    await trio.testing.wait_all_tasks_blocked()  # the actor closes itself in trio
    other = "gpu:1" if gone == "gpu:0" else "gpu:0"
    stats = {s.device: s for s in rt.stats()}
    assert stats[gone].lost is not None and "cudaErrorAssert" in stats[gone].lost
    assert "LOST: " in stats[gone].describe()
    assert stats[other].lost is None and stats["cpu"].lost is None
    assert not actor(rt, gone).ready and actor(rt, gone).lost is not None

    fake.runs.clear()
    for _ in range(3):  # new contexts and one-shot computes: all on the other GPU
        ctx = graph.init_execution_context(target="gpu")
        out = await ctx.compute({"x": x(1)}, keep_on_device=False)
        assert out["y"].numpy().tolist() == [[2.0] * 4]
        await graph.compute({"x": x(2)})
    assert {device for device, _ in fake.runs} == {other}
    cpu = await graph.compute({"x": x(3)}, target="cpu")  # the runtime is not closed
    assert cpu["y"].numpy().tolist() == [[4.0] * 4]
    assert "restart" in str(lost.value)


async def test_a_tensor_left_on_a_lost_gpu_is_gone(fake: FakeBackend) -> None:
    async with wasinn.Runtime(fake_config(), backends=[fake]) as rt:
        await lose_the_gpu_a_tensor_lives_on(rt, fake)


async def lose_the_gpu_a_tensor_lives_on(rt: wasinn.Runtime, fake: FakeBackend) -> None:
    graph = await rt.load(RECIPE, "ggml", "gpu")
    kept = (await graph.compute({"x": x(DEVICE_ASSERT - 1)}, keep_on_device=True))["y"]
    home = kept.device
    with pytest.raises(DeviceLostError, match=f"{home} is lost"):
        await graph.compute({"x": kept})  # runs where its input lives: 710 there
    assert fake.lost == {home}
    await trio.testing.wait_all_tasks_blocked()
    runs = len(fake.runs)
    with pytest.raises(DeviceLostError, match=f"{home} is lost"):
        await graph.compute({"x": kept})  # its value lived on that GPU only
    assert len(fake.runs) == runs  # refused, not run


async def test_requests_queued_on_a_gpu_when_it_is_lost_get_its_error(
        fake: FakeBackend) -> None:
    async with wasinn.Runtime(fake_config(gpu_devices=["gpu:0"]), backends=[fake]) as rt:
        graph = await rt.load([b"fake:add=1:gate"], "ggml", "gpu")
        errors: list[BaseException] = []
        compute = functools.partial(compute_failing_into, errors, graph)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(compute, DEVICE_ASSERT)
            await trio.to_thread.run_sync(fake.started.wait)
            for value in (1, 2, 3):
                nursery.start_soon(compute, value)
            await trio.testing.wait_all_tasks_blocked()
            assert actor(rt, "gpu:0").queued == 3
            fake.gate.set()
        assert len(errors) == 4
        assert all(isinstance(e, DeviceLostError) and "gpu:0 is lost" in str(e)
                   for e in errors), errors
        # Refused, not run: the queued requests never reached the poisoned device.
        assert [value for _, value in fake.runs] == [DEVICE_ASSERT]
        with pytest.raises(DeviceLostError, match="gpu:0 is lost"):
            await graph.compute({"x": x(1)})
        cpu = await graph.compute({"x": x(1)}, target="cpu")  # the runtime serves on
        assert cpu["y"].numpy().tolist() == [[2.0] * 4]
        with pytest.raises(DeviceLostError, match="gpu:0 is lost"):  # compiling there too
            await rt.load([b"fake:add=2"], "ggml", "gpu")


async def test_a_batch_that_loses_the_gpu_stops_there_and_every_member_is_told(
        fake: FakeBackend) -> None:
    # A batch job answers each member itself (a merged run that fails is re-run member
    # by member): a lost device must end it, not be run on again, and reach the watch.
    from wasinn.actors.batching import Batching

    async with wasinn.Runtime(fake_config(gpu_devices=["gpu:0"]), backends=[fake]) as rt:
        graph = await rt.load(RECIPE, "ggml", "gpu",
                              batching=Batching(max_batch=4, max_delay=0.05))
        errors: list[BaseException] = []
        compute = functools.partial(compute_failing_into, errors, graph)

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(compute, DEVICE_ASSERT)
        assert len(errors) == 3 and all(isinstance(e, DeviceLostError) for e in errors)
        assert len(fake.runs) == 1  # the merged run only: no member ran on alone
        await trio.testing.wait_all_tasks_blocked()
        assert actor(rt, "gpu:0").lost is not None
        with pytest.raises(DeviceLostError):
            await graph.compute({"x": x(1)})
        assert len(fake.runs) == 1


async def test_a_guest_thread_that_loses_the_gpu_gets_its_error(fake: FakeBackend) -> None:
    async with wasinn.Runtime(fake_config(gpu_devices=["gpu:0"]), backends=[fake]) as rt:
        graph = await rt.load(RECIPE, "ggml", "gpu")
        ctx = graph.init_execution_context(target="gpu")
        await ctx.compute({"x": x(1)})  # compiled there: the next run is leased

        def in_thread(value: float) -> BaseException | None:
            try:
                ctx.compute_in_caller_thread({"x": x(value)})
            except BaseException as exc:
                return exc
            return None

        first = await trio.to_thread.run_sync(in_thread, DEVICE_ASSERT)
        assert isinstance(first, DeviceLostError), first
        assert threading.current_thread() is threading.main_thread()
        await trio.testing.wait_all_tasks_blocked()
        again = await trio.to_thread.run_sync(in_thread, 1)
        assert isinstance(again, DeviceLostError) and "gpu:0 is lost" in str(again)
        assert [value for _, value in fake.runs] == [1, DEVICE_ASSERT]


async def test_with_every_gpu_lost_requests_fail_or_fall_back_as_configured(
        fake: FakeBackend) -> None:
    async with wasinn.Runtime(fake_config(), backends=[fake]) as rt:
        graph = await rt.load(RECIPE, "ggml", "gpu")
        for _ in range(2):
            with pytest.raises(DeviceLostError):
                await graph.compute({"x": x(DEVICE_ASSERT)})
            await trio.testing.wait_all_tasks_blocked()
        assert fake.lost == {"gpu:0", "gpu:1"}
        with pytest.raises(DeviceLostError, match="is lost"):
            await graph.compute({"x": x(1)})

    fake = FakeBackend()
    async with wasinn.Runtime(fake_config(gpu_devices=["gpu:0"], fallback="cpu"),
                              backends=[fake]) as rt:
        graph = await rt.load(RECIPE, "ggml", "gpu")
        with pytest.raises(DeviceLostError):
            await graph.compute({"x": x(DEVICE_ASSERT)})
        await trio.testing.wait_all_tasks_blocked()
        fake.runs.clear()
        with pytest.warns(RuntimeWarning, match=r"every gpu device here is lost .*falls "
                                                r"back to cpu"):
            out = await graph.compute({"x": x(1)})
        assert out["y"].numpy().tolist() == [[2.0] * 4]
        assert fake.runs == [("cpu", 1.0)]


# -- a real device-side assert ----------------------------------------------------------------
_REAL_ASSERT = textwrap.dedent("""
    import numpy as np, torch, trio, wasinn
    from wasinn.configs.loader import parse_config

    CONFIG = parse_config({"pools": {
        "cpu": {"kind": "cpu", "devices": ["cpu"], "backends": ["pytorch"]},
        "gpu": {"kind": "gpu", "devices": "auto", "backends": ["pytorch"]},
    }}, None)  # no fallback: a request for the lost GPU fails

    class Gather(torch.nn.Module):
        def forward(self, table, index):
            return table[index]  # an index out of range: a device-side assert on CUDA

    async def main():
        traced = torch.jit.trace(Gather(), (torch.zeros(4, 3), torch.zeros(2, dtype=torch.int64)))
        traced.save("gather.pt")
        model = open("gather.pt", "rb").read()
        async with wasinn.Runtime(CONFIG) as rt:
            graph = await rt.load([model], "pytorch", "gpu")
            table = np.arange(12, dtype=np.float32).reshape(4, 3)
            ok = await graph.compute({0: table, 1: np.array([1, 3])}, keep_on_device=False)
            assert ok["output"].numpy().tolist() == [[3, 4, 5], [9, 10, 11]]
            try:
                await graph.compute({0: table, 1: np.array([1, 99])}, keep_on_device=False)
            except wasinn.DeviceLostError as exc:
                print("LOST", exc)
            else:
                raise SystemExit("no DeviceLostError")
            try:
                await graph.compute({0: table, 1: np.array([0, 1])})
            except wasinn.DeviceLostError:
                print("STILL LOST")
            cpu = await graph.compute({0: table, 1: np.array([2])}, target="cpu")
            print("CPU", cpu["output"].numpy().tolist())

    trio.run(main)
""")


@pytest.mark.gpu
def test_a_real_device_side_assert_loses_only_the_gpu(gpu: None, tmp_path: Any) -> None:
    done = subprocess.run([sys.executable, "-c", _REAL_ASSERT], cwd=tmp_path, check=False,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert any(line.startswith("LOST gpu:0 is lost: cudaErrorAssert") for line in lines), lines
    assert "STILL LOST" in lines
    assert "CPU [[6.0, 7.0, 8.0]]" in lines


async def test_a_tensor_on_the_lost_gpu_does_not_fall_back(fake: FakeBackend) -> None:
    # The fallback serves requests for the lost GPU's kind, but a value that lived on
    # that GPU only is gone: running its graph on the CPU would read nothing.
    async with wasinn.Runtime(fake_config(gpu_devices=["gpu:0"], fallback="cpu"),
                              backends=[fake]) as rt:
        graph = await rt.load(RECIPE, "ggml", "gpu")
        kept = (await graph.compute({"x": x(1)}, keep_on_device=True))["y"]
        with pytest.raises(DeviceLostError):
            await graph.compute({"x": x(DEVICE_ASSERT)})
        await trio.testing.wait_all_tasks_blocked()
        runs = len(fake.runs)
        with pytest.raises(DeviceLostError, match="gpu:0 is lost"):
            await graph.compute({"x": kept})
        assert len(fake.runs) == runs


async def test_a_runtime_whose_every_device_was_lost_still_closes(fake: FakeBackend) -> None:
    from wasinn.configs.loader import parse_config

    config = parse_config({"pools": {
        "gpu": {"kind": "gpu", "devices": ["gpu:0"], "backends": ["fake"]}}}, None)
    async with wasinn.Runtime(config, backends=[fake]) as rt:
        graph = await rt.load(RECIPE, "ggml", "gpu")
        with pytest.raises(DeviceLostError):
            await graph.compute({"x": x(DEVICE_ASSERT)})
        await trio.testing.wait_all_tasks_blocked()
        graph.init_execution_context()  # lost, not closed: a ticket is still issued
    with pytest.raises(wasinn.ClosedResourceError, match="runtime is closed"):
        graph.init_execution_context()
    with pytest.raises(wasinn.ClosedResourceError, match="runtime is closed"):
        await graph.compute({"x": x(1)})  # closed first: the loss is old news


async def test_a_request_with_any_tensor_on_a_lost_gpu_gets_its_error_wherever_sent(
        fake: FakeBackend) -> None:
    # Placement reads every native input, not the first: a request that also holds a
    # tensor on the healthy GPU (or names another target) must not run where reading the
    # lost GPU's tensor would raise its error and take that device for lost as well.
    async with wasinn.Runtime(fake_config(), backends=[fake]) as rt:
        graph = await rt.load(RECIPE, "ggml", "gpu")
        gone = (await graph.compute({"x": x(1)}, keep_on_device=True))["y"]
        with pytest.raises(DeviceLostError):  # on the same GPU: both idle, the first wins
            await graph.compute({"x": x(DEVICE_ASSERT)})
        await trio.testing.wait_all_tasks_blocked()
        assert fake.lost == {gone.device}
        kept = (await graph.compute({"x": x(2)}, keep_on_device=True))["y"]
        assert kept.device != gone.device
        runs = len(fake.runs)
        with pytest.raises(DeviceLostError, match=f"{gone.device} is lost"):
            # (The fake's one input is "x": placement decides before the inputs' names
            # are checked, so a second one shows it reads past the first.)
            await graph.compute({"x": kept, "z": gone})
        with pytest.raises(DeviceLostError, match=f"{gone.device} is lost"):
            await graph.compute({"x": gone}, target="cpu")
        assert len(fake.runs) == runs  # refused, not run
        assert fake.lost == {gone.device} and actor(rt, kept.device).lost is None
        out = await graph.compute({"x": kept}, keep_on_device=False)
        assert out["y"].numpy().tolist() == [[4.0] * 4]


def _lease_run(lease: Any) -> BaseException | None:
    try:
        lease.run()
    except BaseException as exc:
        return exc
    return None


async def test_leases_cut_off_by_the_loss_get_its_error_not_a_closed_device(
        fake: FakeBackend) -> None:
    # A guest thread's lease: the one that hit the assert, one granted before the loss
    # and run after it, and one running on the other slot as the device was lost.
    async with wasinn.Runtime(fake_config(gpu_devices=["gpu:0"], gpu_workers=3),
                              backends=[fake]) as rt:
        fake.gate.set()
        gated = (await rt.load([b"fake:add=1:gate"], "ggml", "gpu")).init_execution_context()
        plain = (await rt.load(RECIPE, "ggml", "gpu")).init_execution_context()
        await gated.compute({"x": x(1)})
        await plain.compute({"x": x(1)})  # both compiled there: the next runs are leased
        fake.gate.clear()
        fake.started.clear()
        granted = await trio.to_thread.run_sync(plain.try_lease, {"x": x(2)})
        assert granted is not None
        running: list[BaseException | None] = []
        thread = threading.Thread(
            target=lambda: running.append(_lease_run(gated.try_lease({"x": x(3)}))))
        thread.start()
        await trio.to_thread.run_sync(fake.started.wait)  # on the gate, holding a slot

        # Trio closing the lost actor before this thread reaches Lease.run's except:
        context = actor(rt, "gpu:0")._context
        on_lost = context.on_lost

        def slowly(error: DeviceLostError) -> None:
            on_lost(error)
            time.sleep(0.2)  # the guest thread descheduled here; trio closes the actor

        context.on_lost = slowly
        hit = await trio.to_thread.run_sync(
            lambda: _lease_run(plain.try_lease({"x": x(DEVICE_ASSERT)})))
        assert not actor(rt, "gpu:0").ready
        fake.gate.set()
        await trio.to_thread.run_sync(thread.join)
        after = await trio.to_thread.run_sync(_lease_run, granted)
        for error in (hit, running[0], after):
            assert isinstance(error, DeviceLostError), error
            assert "gpu:0 is lost: cudaErrorAssert" in str(error)


async def test_a_lease_past_its_deadline_that_then_loses_the_gpu_says_so(
        fake: FakeBackend) -> None:
    # The deadline watcher interrupted the run (the fake goes on: not every run can be
    # cut short), which then hit the assert: the device's loss is the news, not the
    # deadline.
    async with wasinn.Runtime(fake_config(gpu_devices=["gpu:0"]), backends=[fake]) as rt:
        fake.gate.set()
        gated = (await rt.load([b"fake:add=1:gate"], "ggml", "gpu")).init_execution_context()
        await gated.compute({"x": x(1)})
        fake.gate.clear()
        fake.started.clear()
        lease = await trio.to_thread.run_sync(
            functools.partial(gated.try_lease, {"x": x(DEVICE_ASSERT)}, timeout=0.05))
        assert lease is not None
        result: list[BaseException | None] = []
        thread = threading.Thread(target=lambda: result.append(_lease_run(lease)))
        thread.start()
        await trio.to_thread.run_sync(fake.started.wait)
        await trio.sleep(0.3)  # its deadline passes while it runs: the watcher interrupts it
        fake.gate.set()
        await trio.to_thread.run_sync(thread.join)
        assert isinstance(result[0], DeviceLostError), result[0]
        assert actor(rt, "gpu:0").lost is not None


async def test_a_request_is_refused_between_the_loss_and_the_close(fake: FakeBackend) -> None:
    # The loss is found in a job's thread; the actor closes in trio a moment later. A
    # request placed there meanwhile (its input lives there) gets the loss, not what
    # compiling its graph there would say (a backend with no GPU: unsupported).
    from wasinn.configs.loader import parse_config

    class CpuOnly(FakeBackend):
        name = "cpuonly"

    config = parse_config({"pools": {
        "cpu": {"kind": "cpu", "devices": ["cpu"], "backends": ["cpuonly", "fake"]},
        "gpu": {"kind": "gpu", "devices": ["gpu:0", "gpu:1"], "backends": ["fake"]}}}, None)
    async with wasinn.Runtime(config, backends=[fake, CpuOnly(devices=("cpu",))]) as rt:
        graph = await rt.load(RECIPE, "ggml", "gpu", backend="fake")
        kept = (await graph.compute({"x": x(1)}, keep_on_device=True))["y"]
        cpu_only = await rt.load(RECIPE, "ggml", "cpu", backend="cpuonly")
        home = actor(rt, kept.device)
        home._device_lost(DeviceLostError(f"{kept.device} is lost: (as a job finds it)"))
        assert home.ready  # not closed yet: that is trio's, at its next turn
        with pytest.raises(DeviceLostError, match="as a job finds it"):
            await cpu_only.compute({"x": kept}, target="cpu")
