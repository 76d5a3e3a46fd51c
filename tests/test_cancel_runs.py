"""Abandoned runs are really stopped, and closing a runtime never hangs on a run.

Real ONNX Runtime and OpenVINO runs that would last far longer than the test (an ONNX
Loop with a huge trip count; a long chain of large MatMuls) are abandoned by a timeout:
the device's only worker slot must be free again at once (a second request completes),
and the runtime must close promptly. A ``torch.export`` program (a long chain of large
MatMuls) is stopped before its next operator, a TorchScript loop at its next iteration.
A fake backend that ignores cancellation stands for a run nothing can interrupt (one long
library call): the close gives up after
``close_timeout``, logs the device and the job, and leaves the graph open under it.

Trip counts are finite (tens of seconds of work here), so that without cancellation the
``trio.fail_after`` guards fail the test instead of hanging it for days (the close's
wait is shielded from them).
"""

from __future__ import annotations

import functools
import io
import logging
import struct
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import wasinn
from tests.backend_models import affine
from tests.fake_backend import FakeBackend, FakeGraph
from tests.loop_model import GUARD_S, HUGE_LOOP, loop_inputs, loop_onnx
from tests.support import (
    cancelled_runs,
    core_nn_guest_wat,
    cpu_pool,
    in_process_guests,
    recorded_runs,
    require_backend,
)
from wasinn.backends.base import Builders, Device, LoadOptions
from wasinn.configs.loader import parse_config
from wasinn.enums import ExecutionTarget, GraphEncoding
from wasinn.errors import BackendRuntimeError, ClosedResourceError, TimeoutError_
from wasinn.host.abi import Errno


# -- ONNX Runtime ------------------------------------------------------------------------
async def test_an_abandoned_onnxruntime_loop_stops_and_frees_its_worker_slot(
        monkeypatch: pytest.MonkeyPatch) -> None:
    require_backend("onnxruntime")
    runs = recorded_runs(monkeypatch)
    async with wasinn.Runtime(cpu_pool(workers=1, backends=["onnxruntime"])) as rt:
        graph = await rt.load([loop_onnx()], "onnx", "cpu")
        assert graph.backend == "onnxruntime"
        with pytest.raises(TimeoutError_):
            await graph.compute(loop_inputs(HUGE_LOOP), timeout=0.2)
        with trio.fail_after(GUARD_S):
            # The only worker slot was the abandoned run's: this runs only once it ended.
            out = await graph.compute(loop_inputs(3))
            assert out["y"].numpy().tolist() == [[3.0] * 4]
            (actor,) = rt.actors
            assert actor.threads.abandoned == 0 and actor.busy == 0
    # The abandoned run ended because it was cancelled, not because its Loop ran out.
    (abandoned,) = cancelled_runs(runs)
    assert runs[-2:] == [abandoned, None]
    # (closing is immediate; the wait is checked by the tests below)


async def test_closing_the_runtime_cancels_a_running_onnxruntime_loop(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    require_backend("onnxruntime")
    runs = recorded_runs(monkeypatch)
    caplog.set_level(logging.ERROR, logger="wasinn.actors")
    failures: list[BaseException] = []

    async def compute(graph: Any) -> None:
        try:
            await graph.compute(loop_inputs(HUGE_LOOP))
        except ClosedResourceError as exc:
            failures.append(exc)

    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            # (close_timeout: the close's wait is shielded from the guard)
            rt = wasinn.Runtime(cpu_pool(backends=["onnxruntime"], close_timeout=GUARD_S))
            async with rt:
                graph = await rt.load([loop_onnx()], "onnx", "cpu")
                await graph.compute(loop_inputs(1))  # compiled
                nursery.start_soon(compute, graph)
                (actor,) = rt.actors
                threads = actor.threads.threads
                while not actor.busy:
                    await trio.sleep(0.01)
            # Closed: the caller of the running request was told so, not left waiting.
    assert len(failures) == 1 and "closed" in str(failures[0])
    # The close returned because ONNX Runtime stopped the run, not because close_timeout
    # gave up on it (which logs that the backend ignores cancellation).
    (stopped,) = cancelled_runs(runs)
    assert runs[-1] is stopped
    assert actor.busy == 0 and not any(thread.is_alive() for thread in threads)
    assert [r.message for r in caplog.records if r.name == "wasinn.actors"] == []


# -- OpenVINO ----------------------------------------------------------------------------
def matmul_chain_onnx(steps: int, size: int) -> bytes:
    """``y = x @ I @ I ...`` (``steps`` MatMuls by a ``size`` x ``size`` identity;
    ``x: f32[rows, size]``, rows dynamic): many nodes, so OpenVINO can stop between them
    (it does not interrupt a Loop node's iterations); a run's time grows with ``rows``."""
    from onnx import TensorProto, helper, numpy_helper

    nodes, previous = [], "x"
    for i in range(steps):
        nodes.append(helper.make_node("MatMul", [previous, "w"], [f"v{i}"]))
        previous = f"v{i}"
    nodes.append(helper.make_node("Identity", [previous], ["y"]))
    graph = helper.make_graph(
        nodes, "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", size])],
        [numpy_helper.from_array(np.eye(size, dtype=np.float32), "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


#: With ``OV_ROWS`` rows, ~55 ms a step here: ~11 s for the whole chain (and 0.1 s to
#: compile: thousands of steps took seconds).
OV_STEPS, OV_SIZE, OV_ROWS = 200, 1024, 8192


# -- PyTorch (torch.export) ---------------------------------------------------------------
@functools.cache
def matmul_chain_torch(steps: int, size: int) -> bytes:
    """A ``torch.export`` archive of ``y = x @ I @ I ...`` (``steps`` MatMuls by a
    ``size`` x ``size`` identity; ``x: f32[rows, size]``, rows dynamic): one operator
    per step, so a run's time grows with ``rows`` and it can stop between steps."""
    import torch

    class Chain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.eye(size), requires_grad=False)

        def forward(self, x: Any) -> Any:
            for _ in range(steps):
                x = x @ self.w
            return x

    program = torch.export.export(Chain(), (torch.ones(2, size),),
                                  dynamic_shapes={"x": {0: torch.export.Dim("rows")}})
    buf = io.BytesIO()
    torch.export.save(program, buf)
    return buf.getvalue()


#: With ``TORCH_ROWS`` rows, ~30 ms a step here: ~12 s for the whole chain.
TORCH_STEPS, TORCH_SIZE, TORCH_ROWS = 400, 1024, 4096


def counting_operators(graph: Any, executed: list[object],
                       first: threading.Event | None = None) -> Any:
    """A torch dispatch mode that appends to ``executed`` each operator of ``graph`` (a
    ``torch.export`` program's TorchGraph) that the current thread starts under it, and
    sets ``first`` at the first; the conversions of inputs and outputs around the
    program are not counted."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    model_operators = {node.target for module in graph.module.modules()
                       if isinstance(module, torch.fx.GraphModule)
                       for node in module.graph.nodes if node.op == "call_function"}

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            if func in model_operators:
                executed.append(func)
                if first is not None:
                    first.set()
            return func(*args, **(kwargs or {}))

    return Counting()


def cancelled_mid_run(graph: Any, inputs: dict[str, Any],
                      watching: Any, executed: list[object]) -> tuple[object, int]:
    """Run ``graph`` on ``inputs`` in a thread under a Cancellation and cancel it once its
    first counted operator started (``watching(first)``: a torch dispatch mode that sets
    ``first`` and appends to ``executed``); what the run raised or returned, and how many
    operators had started when it was cancelled. Fails if it goes on past GUARD_S."""
    from wasinn.backends.base import Cancellation, running_under

    cancellation = Cancellation()
    outcome: list[object] = []
    first = threading.Event()

    def run() -> None:
        with running_under(cancellation), watching(first):
            try:
                outcome.append(graph.run(inputs))
            except BaseException as exc:
                outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    assert first.wait(GUARD_S), "the run never reached a counted operator"
    ran_before = len(executed)
    cancellation.cancel()
    thread.join(GUARD_S)
    assert not thread.is_alive(), f"the run went on {GUARD_S} s after its cancellation"
    (result,) = outcome  # a finished run would have returned its outputs instead
    return result, ran_before


def test_a_cancelled_torch_export_run_stops_before_its_next_operator() -> None:
    require_backend("torch")
    from wasinn.backends.base import Cancellation, running_under
    from wasinn.backends.pytorch import TorchBackend

    graph = TorchBackend().load([matmul_chain_torch(TORCH_STEPS, TORCH_SIZE)],
                                GraphEncoding.PYTORCH, Device(ExecutionTarget.CPU))
    executed: list[object] = []
    error, ran_before = cancelled_mid_run(
        graph, {"x": np.ones((TORCH_ROWS, TORCH_SIZE), np.float32)},
        lambda first: counting_operators(graph, executed, first), executed)
    assert isinstance(error, BackendRuntimeError), error
    assert "pytorch: run cancelled" in str(error) and "next operator" in str(error)
    # At most the operator that was starting as it was cancelled ran after it: the
    # ~TORCH_STEPS left were not.
    assert ran_before <= len(executed) <= ran_before + 1 < TORCH_STEPS
    # The graph serves the next run, and its answer is right.
    with running_under(Cancellation()):
        out = graph.run({"x": np.full((1, TORCH_SIZE), 2.0, np.float32)})
    assert out["output"].numpy().tolist() == [[2.0] * TORCH_SIZE]
    graph.close()


@functools.cache
def matmul_loop_torchscript(size: int, *, constant: bool = False) -> bytes:
    """A TorchScript archive of ``for _ in range(steps): x = x @ I`` (``steps`` an input:
    a loop TorchScript's interpreter runs in C++); ``constant``: of ``range(63)``
    (UNROLLED_STEPS) instead, a loop ``torch.jit.freeze`` unrolls: none is left."""
    import torch

    class Loop(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.eye(size), requires_grad=False)

        def forward(self, x: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
            for _ in range(int(steps.item())):
                x = x @ self.w
            return x

    class Constant(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.eye(size), requires_grad=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(63):  # UNROLLED_STEPS
                x = x @ self.w
            return x

    module = Constant() if constant else Loop()
    buf = io.BytesIO()
    torch.jit.save(torch.jit.script(module), buf)  # type: ignore[no-untyped-call]
    return buf.getvalue()


#: A constant trip count that ``torch.jit.freeze`` unrolls (under 64), and a product
#: 4x TORCH_SIZE's: with ``TORCH_ROWS`` rows, ~8 s for the whole loop here.
UNROLLED_STEPS, UNROLLED_SIZE = 63, 2048


def started_matmuls(first: threading.Event, started: list[object] | None = None) -> Any:
    """A torch dispatch mode that sets ``first`` once a matrix product starts, and
    appends to ``started`` each one that starts."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Started(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            if func in (torch.ops.aten.mm.default, torch.ops.aten.matmul.default):
                first.set()
                if started is not None:
                    started.append(func)
            return func(*args, **(kwargs or {}))

    return Started()


@pytest.mark.parametrize(("interruptible", "optimize", "constant"), [
    (False, True, False), (False, False, False), (True, True, False),
    # range(63): freezing (optimize) unrolls the loop; the checks stay at its iterations
    (False, True, True), (False, False, True)])
def test_a_cancelled_torchscript_run_stops_at_its_next_loop_iteration(
        interruptible: bool, optimize: bool, constant: bool) -> None:
    """TorchScript's interpreter runs its graph in C++, out of reach of the checkpoints a
    torch.export program gets: its forward gets stop checks of its own, read in C++, at
    each loop iteration, by default (frozen or not, a loop that freezing unrolled
    included); ``interruptible`` adds a checkpoint before each operator it calls
    (through a torch dispatch mode)."""
    require_backend("torch")
    from wasinn.backends import LoadOptions
    from wasinn.backends.base import Cancellation, running_under
    from wasinn.backends.pytorch import TorchBackend

    if constant:  # ~8 s of work, a constant UNROLLED_STEPS products
        model, size, steps = (matmul_loop_torchscript(UNROLLED_SIZE, constant=True),
                              UNROLLED_SIZE, UNROLLED_STEPS)
    else:  # ~12 s of work, TORCH_STEPS products
        model, size, steps = matmul_loop_torchscript(TORCH_SIZE), TORCH_SIZE, TORCH_STEPS
    graph = TorchBackend().load([model], GraphEncoding.PYTORCH, Device(ExecutionTarget.CPU),
                                LoadOptions(extra={"interruptible": interruptible,
                                                   "optimize": optimize}))
    trip = {} if constant else {"steps": np.array(steps, np.int64)}
    executed: list[object] = []
    error, ran_before = cancelled_mid_run(
        graph, {"x": np.ones((TORCH_ROWS, size), np.float32), **trip},
        lambda first: started_matmuls(first, executed), executed)
    assert isinstance(error, BackendRuntimeError), error
    assert "pytorch: run cancelled" in str(error)
    # At most the product that was running as it was cancelled ended after it: the
    # products left never started.
    assert ran_before <= len(executed) <= ran_before + 1 < steps
    trip = {} if constant else {"steps": np.array(3, np.int64)}
    with running_under(Cancellation()):  # the graph serves the next run
        out = graph.run({"x": np.full((1, size), 2.0, np.float32), **trip})
    assert out["output"].numpy().tolist() == [[2.0] * size]
    graph.close()


def test_a_torchscript_run_cancelled_before_it_starts_does_no_work() -> None:
    require_backend("torch")
    from wasinn.backends.base import Cancellation, running_under
    from wasinn.backends.pytorch import TorchBackend

    graph = TorchBackend().load([matmul_loop_torchscript(4)], GraphEncoding.PYTORCH,
                                Device(ExecutionTarget.CPU))
    cancellation = Cancellation()
    cancellation.cancel()
    executed: list[object] = []
    inputs = {"x": np.ones((2, 4), np.float32), "steps": np.array(5, np.int64)}
    with running_under(cancellation), started_matmuls(threading.Event(), executed), \
            pytest.raises(BackendRuntimeError, match="run cancelled"):
        graph.run(inputs)
    assert executed == []
    # A later run on the same thread is not stopped by that cancellation's flag.
    with running_under(Cancellation()), started_matmuls(threading.Event(), executed):
        out = graph.run(inputs)
    assert out["output"].numpy().tolist() == [[1.0] * 4] * 2 and len(executed) == 5


def test_a_torch_export_run_cancelled_before_it_starts_does_no_work() -> None:
    require_backend("torch")
    from wasinn.backends.base import Cancellation, running_under

    builders, encoding = affine("pytorch", 2.0, 1.0)
    from wasinn.backends.pytorch import TorchBackend

    graph = TorchBackend().load(builders, encoding, Device(ExecutionTarget.CPU))
    cancellation = Cancellation()
    cancellation.cancel()
    executed: list[object] = []
    with running_under(cancellation), counting_operators(graph, executed), \
            pytest.raises(BackendRuntimeError, match="cancelled"):
        graph.run({"x": np.zeros((1, 4), np.float32)})
    assert executed == []  # not one of the model's operators ran
    with counting_operators(graph, executed):
        out = graph.run({"x": np.zeros((1, 4), np.float32)})  # no cancellation: runs
    assert out["output"].numpy().tolist() == [[1.0] * 4]
    assert executed  # (operators are seen where they run)


@pytest.mark.parametrize(("library", "backend", "model"), [
    ("openvino", "openvino", "onnx"), ("torch", "pytorch", "export"),
    ("torch", "pytorch", "torchscript range(63)")])
async def test_an_abandoned_matmul_chain_stops_and_frees_its_worker_slot(
        library: str, backend: str, model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # OpenVINO is cancelled at its next node, a torch.export program before its next
    # operator, a TorchScript loop that freezing unrolled at its next iteration: seconds
    # of work left undone either way.
    require_backend(library)
    runs = recorded_runs(monkeypatch)
    if model == "onnx":
        data, encoding, size, rows = matmul_chain_onnx(OV_STEPS, OV_SIZE), "onnx", OV_SIZE, OV_ROWS
    elif model == "export":
        data, encoding = matmul_chain_torch(TORCH_STEPS, TORCH_SIZE), "pytorch"
        size, rows = TORCH_SIZE, TORCH_ROWS
    else:
        data = matmul_loop_torchscript(UNROLLED_SIZE, constant=True)
        encoding, size, rows = "pytorch", UNROLLED_SIZE, TORCH_ROWS
    async with wasinn.Runtime(cpu_pool(workers=1, backends=[backend])) as rt:
        graph = await rt.load([data], encoding, "cpu")
        assert graph.backend == backend
        with pytest.raises(TimeoutError_):
            await graph.compute({"x": np.ones((rows, size), np.float32)}, timeout=0.3)
        with trio.fail_after(GUARD_S):
            # The only worker slot was the abandoned run's: this runs only once it ended.
            (out,) = (await graph.compute({"x": np.full((1, size), 3.0, np.float32)})).values()
            assert out.numpy().tolist() == [[3.0] * size]
            (actor,) = rt.actors
            assert actor.threads.abandoned == 0 and actor.busy == 0
    # The abandoned run ended because it was cancelled, not because its chain ran out.
    (abandoned,) = cancelled_runs(runs)
    assert runs[-2:] == [abandoned, None]


class CancelledAsItStarts:
    """An OpenVINO infer request whose run is cancelled at the last moment before it
    starts: after the backend's last look at its cancellation, before OpenVINO marks the
    request busy. OpenVINO ignores that cancel() (the request is idle)."""

    def __init__(self, request: Any, cancellation: Any) -> None:
        self._request = request
        self._cancellation = cancellation

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)

    def infer(self) -> None:
        self._cancellation.cancel()  # the hook's cancel() finds the request idle
        self._request.infer()


def test_an_openvino_run_cancelled_just_before_it_starts_is_still_stopped() -> None:
    # Without the repeated cancel, the chain would run to its end (~11 s here).
    require_backend("openvino")
    from wasinn.backends.base import Cancellation, running_under
    from wasinn.backends.openvino import OpenVinoBackend

    graph = OpenVinoBackend().load([matmul_chain_onnx(OV_STEPS, OV_SIZE)], GraphEncoding.ONNX,
                                   Device(ExecutionTarget.CPU))
    cancellation = Cancellation()
    make_request = graph._request

    def cancelled_as_it_starts() -> tuple[CancelledAsItStarts, Any]:
        request, pool = make_request()
        return CancelledAsItStarts(request, cancellation), pool

    graph._request = cancelled_as_it_starts  # type: ignore[method-assign]
    outcome: list[BaseException | dict[str, wasinn.Tensor]] = []

    def run() -> None:
        with running_under(cancellation):
            try:
                outcome.append(graph.run({"x": np.ones((OV_ROWS, OV_SIZE), np.float32)}))
            except BaseException as exc:
                outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(GUARD_S)
    assert not thread.is_alive(), f"the run went on {GUARD_S} s after its cancellation"
    (error,) = outcome  # a finished run would have returned its outputs instead
    assert isinstance(error, BackendRuntimeError) and "run cancelled" in str(error), error
    # The thread that repeated the cancel stops once the run is over.
    deadline = time.monotonic() + GUARD_S
    while any(t.name == "wasinn openvino cancel" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the repeated cancel outlived its run"
        time.sleep(0.01)
    # The graph serves the next run (the cancelled request is not pooled again).
    del graph._request
    with running_under(Cancellation()):
        (out,) = graph.run({"x": np.full((1, OV_SIZE), 2.0, np.float32)}).values()
    assert out.numpy().tolist() == [[2.0] * OV_SIZE]
    graph.close()


# -- a run nothing can interrupt ----------------------------------------------------------
class UncancellableGraph(FakeGraph):
    """Blocks each run on ``backend.gate`` whatever the cancellation (like torch)."""

    def __init__(self, backend: UncancellableBackend, device: Device) -> None:
        super().__init__(backend, device, 1.0, gated=True)


class UncancellableBackend(FakeBackend):
    def __init__(self) -> None:
        super().__init__(devices=("cpu",))
        self.graphs: list[UncancellableGraph] = []

    def load(self, builders: Builders, encoding: GraphEncoding, device: Device,
             options: LoadOptions | None = None) -> UncancellableGraph:
        super().load(builders, encoding, device, options)
        graph = UncancellableGraph(self, device)
        self.graphs.append(graph)
        return graph


async def test_close_gives_up_on_an_uncancellable_run_after_close_timeout(
        caplog: pytest.LogCaptureFixture) -> None:
    backend = UncancellableBackend()
    config = cpu_pool(backends=["fake"], close_timeout=0.3)
    caplog.set_level(logging.ERROR, logger="wasinn.actors")
    try:
        with trio.fail_after(GUARD_S):
            async with wasinn.Runtime(config, backends=[backend]) as rt:
                graph = await rt.load([b"fake:add=1:gate"], "ggml", "cpu")
                with pytest.raises(TimeoutError_):
                    await graph.compute({"x": np.zeros((1, 4), np.float32)}, timeout=0.1)
                (actor,) = rt.actors
                (thread,) = actor.threads.threads
                assert actor.busy == 1  # the abandoned run ignores its cancellation
        # The close returned although the run still goes on: it said so, and left the
        # graph open under the run.
        (compiled,) = backend.graphs
        assert thread.is_alive() and compiled.running == 1 and not compiled.closed
        (record,) = [r for r in caplog.records if r.name == "wasinn.actors"]
        assert record.levelno == logging.ERROR
        assert "cpu" in record.message and "run of" in record.message
        assert "abandoned" in record.message
    finally:
        backend.gate.set()
    # Once the run ends, its thread closes the graph it used (the runtime evicted it).
    with trio.fail_after(GUARD_S):
        await trio.to_thread.run_sync(thread.join, GUARD_S)
    assert not thread.is_alive() and compiled.closed and not compiled.closed_while_running


async def test_closing_tells_a_caller_waiting_on_an_uncancellable_run_at_once() -> None:
    # The caller has no timeout: it waits on a run that ignores its cancellation. The
    # close must fail it with ClosedResourceError now, not hand it a result (or an
    # error) once the run ends after the runtime is gone.
    backend = UncancellableBackend()
    outcomes: list[object] = []

    async def compute(graph: Any) -> None:
        try:
            outcomes.append(await graph.compute({"x": np.zeros((1, 4), np.float32)}))
        except ClosedResourceError as exc:
            outcomes.append(exc)

    try:
        with trio.fail_after(GUARD_S):
            async with trio.open_nursery() as nursery:
                rt = wasinn.Runtime(cpu_pool(backends=["fake"], close_timeout=0.2),
                                    backends=[backend])
                async with rt:
                    graph = await rt.load([b"fake:add=1:gate"], "ggml", "cpu")
                    nursery.start_soon(compute, graph)
                    (actor,) = rt.actors
                    while not actor.busy:
                        await trio.sleep(0.01)
                # Closed (after close_timeout): the caller was told, the run still goes on.
                assert not backend.gate.is_set() and actor.busy == 1
        (error,) = outcomes
        assert isinstance(error, ClosedResourceError) and "closed" in str(error)
    finally:
        backend.gate.set()


async def test_close_timeout_is_a_pool_setting_with_a_default() -> None:
    assert cpu_pool().pools["cpu"].close_timeout == 10.0
    with pytest.raises(wasinn.ConfigError):
        cpu_pool(close_timeout=-1)


# -- a core guest (end to end) ----------------------------------------------------------
def _hang_guest_wat(model: bytes, trip: int) -> str:
    """A guest that loads ``model`` (the Loop), sets ``m = trip`` and ``x``, computes
    once, and exits with compute's error code."""
    mem = bytearray(512)
    struct.pack_into("<2IB3xII", mem, 128, 256, 1, 5, 272, 8)   # m: i64[1]
    struct.pack_into("<2IB3xII", mem, 160, 264, 2, 1, 288, 16)  # x: f32[1, 4]
    struct.pack_into("<I", mem, 256, 1)
    struct.pack_into("<2I", mem, 264, 1, 4)
    struct.pack_into("<q", mem, 272, trip)
    return core_nn_guest_wat(mem, model, """
    (drop (call $set (local.get $ctx) (i32.const 0) (i32.const 128)))
    (drop (call $set (local.get $ctx) (i32.const 1) (i32.const 160)))
    (call $exit (call $compute (local.get $ctx)))""")


@pytest.mark.parametrize("sandbox", [False, "cpu"])
async def test_a_core_guest_whose_compute_times_out_cannot_hang_the_runtime(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sandbox: object) -> None:
    # In the host's process (watched) and in the sandbox process the guest's model runs in
    # by default (there the run is stopped by the child's own ONNX Runtime, or killed).
    require_backend("onnxruntime")
    runs = recorded_runs(monkeypatch)
    guest = tmp_path / "hang.wat"
    guest.write_text(_hang_guest_wat(loop_onnx(), HUGE_LOOP))
    config = parse_config({"guests": {"compute_timeout": 0.2, "sandbox": sandbox},
                           "pools": {"cpu": {"kind": "cpu", "devices": ["cpu"],
                                             "backends": ["onnxruntime"]}}}, None)
    with trio.fail_after(GUARD_S):
        async with wasinn.Runtime(config) as rt:
            code = await rt.run_wasm(guest)
            assert code == Errno.RUNTIME_ERROR  # compute timed out (no timeout errno here)
            # The guest's abandoned run no longer holds the CPU's only worker slot.
            graph = await rt.load([loop_onnx()], "onnx", "cpu")
            out = await graph.compute(loop_inputs(2))
            assert out["y"].numpy().tolist() == [[2.0] * 4]
    if sandbox:
        assert runs == [None]  # the runtime's own load, in this process
        return
    # The guest's run ended because it was cancelled, not because its Loop ran out.
    (abandoned,) = cancelled_runs(runs)
    assert runs[-2:] == [abandoned, None]


async def test_cancelling_a_core_guest_interrupts_its_running_inference(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # No compute timeout: the guest's thread runs the ONNX Runtime Loop itself (a lease).
    # Cancelling run_wasm must stop that run, not wait the ~30 s it would take.
    require_backend("onnxruntime")
    runs = recorded_runs(monkeypatch)
    guest = tmp_path / "hang.wat"
    guest.write_text(_hang_guest_wat(loop_onnx(), HUGE_LOOP))
    config = in_process_guests(cpu_pool(workers=1, backends=["onnxruntime"]))
    with trio.fail_after(GUARD_S):
        async with wasinn.Runtime(config) as rt:
            with trio.move_on_after(0.5) as scope:
                await rt.run_wasm(guest)
            assert scope.cancelled_caught
            # The device's only worker slot was the interrupted run's: this needs it back.
            graph = await rt.load([loop_onnx()], "onnx", "cpu")
            out = await graph.compute(loop_inputs(2))
            assert out["y"].numpy().tolist() == [[2.0] * 4]
    # The guest's run ended because it was cancelled, not because its Loop ran out.
    (interrupted,) = cancelled_runs(runs)
    assert runs[-2:] == [interrupted, None]


# -- the Cancellation itself ---------------------------------------------------------------
def test_a_cancellation_runs_each_callback_once_and_late_ones_at_once(
        caplog: pytest.LogCaptureFixture) -> None:
    from wasinn.backends.base import Cancellation

    calls: list[str] = []
    cancellation = Cancellation()
    cancellation.on_cancel(lambda: calls.append("early"))
    forget = cancellation.on_cancel(lambda: calls.append("forgotten"))
    forget()

    def explode() -> None:
        raise RuntimeError("boom")

    cancellation.on_cancel(explode)
    assert not cancellation.cancelled and calls == []
    cancellation.cancel()
    cancellation.cancel()
    assert cancellation.cancelled and calls == ["early"]
    assert any("boom" in (r.exc_text or "") or r.exc_info for r in caplog.records
               if r.name == "wasinn.backends")  # logged, not raised
    cancellation.on_cancel(lambda: calls.append("late"))
    assert calls == ["early", "late"]


def test_running_under_is_per_thread_and_nests() -> None:
    from wasinn.backends.base import Cancellation, current_cancellation, running_under

    outer, inner = Cancellation(), Cancellation()
    seen: list[object] = []
    assert current_cancellation() is None
    with running_under(outer):
        with running_under(inner):
            assert current_cancellation() is inner
            thread = threading.Thread(target=lambda: seen.append(current_cancellation()))
            thread.start()
            thread.join()
        assert current_cancellation() is outer
    assert current_cancellation() is None and seen == [None]


def test_a_cancelled_pipeline_stops_between_steps() -> None:
    from wasinn.actors.session import Session
    from wasinn.backends.base import Cancellation, current_cancellation, running_under
    from wasinn.errors import BackendRuntimeError
    from wasinn.scheduler._jobs import run_chain
    from wasinn.tensor import Tensor

    backend = FakeBackend(devices=("cpu",))
    cpu = Device.parse("cpu")

    class CancellingGraph(FakeGraph):
        def run(self, inputs: Any, *, outputs: Any = None, keep_on_device: bool = False
                ) -> dict[str, Any]:
            result = super().run(inputs, outputs=outputs, keep_on_device=keep_on_device)
            cancellation = current_cancellation()
            assert cancellation is not None
            cancellation.cancel()  # as if the caller gave up during this step
            return result

    first = Session(CancellingGraph(backend, cpu, 1.0, gated=False), "fake")
    second = Session(FakeGraph(backend, cpu, 10.0, gated=False), "fake")
    x = {"x": Tensor.from_numpy(np.zeros((1, 4), np.float32))}
    with running_under(Cancellation()), pytest.raises(BackendRuntimeError, match="cancelled"):
        run_chain([first, second], [(("y", "x"),)], x, False)
    assert backend.runs == [("cpu", 0.0)]  # the second step never ran
    # Not cancelled, both steps run.
    plain = Session(FakeGraph(backend, cpu, 1.0, gated=False), "fake")
    with running_under(Cancellation()):
        out = run_chain([plain, second], [(("y", "x"),)], x, False)
    assert out["y"].numpy().tolist() == [[11.0] * 4]
