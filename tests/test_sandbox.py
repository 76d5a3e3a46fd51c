"""Sandboxed graphs (``sandbox = true``): compiled and run in a process of their own, so
that a library crash on a model or on a guest's inputs ends that process, not the host.

The crash that matters is a real one: OpenVINO's CPU plugin reads out of bounds on a
``GatherND`` index of -2**31 and kills its process with SIGSEGV (found by fuzzing
wasinn's backends). A test first shows that in a child process (so that the test says
so when OpenVINO fixes it), then that the same model, sandboxed, only fails that run.
Load crashes, cancels a run ignores and the wire's checks use the fake backend of
``tests/crashing_backend.py``.
"""

from __future__ import annotations

import os
import platform
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import trio

import wasinn
from tests.crashing_backend import (
    CRASH,
    DEAF,
    EXTRA_OUTPUT,
    NO_OUTPUT,
    WRONG_DIM,
    WRONG_TYPE,
    CrashingBackend,
)
from tests.sandbox_memory import held_before_load
from tests.support import (
    core_nn_guest_wat,
    cpu_pool,
    no_spares,
    require_backend,
    sandbox_children,
)
from wasinn import (
    BackendRuntimeError,
    GraphEncoding,
    InvalidArgumentError,
    InvalidEncodingError,
    Tensor,
    UnknownNameError,
)
from wasinn.backends import Device, LoadOptions
from wasinn.backends.sandbox import CANCEL_GRACE_S, SandboxedGraph, load_sandboxed
from wasinn.configs.loader import parse_config
from wasinn.modelgen import affine_onnx, onnx_model_bytes

CPU = Device.parse("cpu")
INT32_MIN = -(2**31)


def _gathernd_onnx() -> bytes:
    from onnx import TensorProto, helper

    node = helper.make_node("GatherND", ["x", "i"], ["y"])
    graph = helper.make_graph(
        [node], "gathernd",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2, 3]),
         helper.make_tensor_value_info("i", TensorProto.INT64, [2, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    return onnx_model_bytes(graph)


def _gathernd_inputs(first_index: int) -> dict[str, np.ndarray[Any, Any]]:
    x = np.arange(12, dtype=np.float32).reshape(2, 2, 3)
    return {"x": x, "i": np.array([[first_index, 1], [1, 0]], np.int64)}




# -- a real library crash -----------------------------------------------------------------
def test_openvino_gathernd_kills_the_process_that_runs_it() -> None:
    require_backend("openvino")
    require_backend("onnx")
    code = textwrap.dedent(f"""
        import numpy as np
        from tests.test_sandbox import _gathernd_onnx, _gathernd_inputs
        from wasinn import GraphEncoding, Tensor
        from wasinn.backends import Device
        from wasinn.backends.openvino import OpenVinoBackend
        graph = OpenVinoBackend().load([_gathernd_onnx()], GraphEncoding.ONNX,
                                       Device.parse("cpu"))
        inputs = _gathernd_inputs({INT32_MIN})
        graph.run({{k: Tensor.from_numpy(v) for k, v in inputs.items()}})
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, check=False,
                          timeout=120)
    assert done.returncode == -signal.SIGSEGV, (
        f"OpenVINO no longer crashes here (status {done.returncode}): "
        f"{done.stderr.decode()[-400:]}")


async def test_a_sandboxed_graph_survives_the_crash_and_runs_again() -> None:
    require_backend("openvino")
    require_backend("onnx")
    async with wasinn.Runtime(no_spares(cpu_pool(backends=["openvino"]))) as rt:
        graph = await rt.load([_gathernd_onnx()], "onnx", options={"sandbox": True})
        (first,) = sandbox_children()
        with pytest.raises(BackendRuntimeError, match=(
                r"^openvino: the process running the model was killed by SIGSEGV: the "
                r"library crashed on this model or these inputs \(the host goes on; the "
                r"next run starts a new process\)$")):
            await graph.compute(_gathernd_inputs(INT32_MIN))
        assert not first.is_running() or first.status() == psutil.STATUS_ZOMBIE
        good = _gathernd_inputs(1)
        out = await graph.compute(good)
        x, i = good["x"], good["i"]
        np.testing.assert_array_equal(out["y"].numpy(), np.stack([x[tuple(r)] for r in i]))
        (second,) = sandbox_children()
        assert second.pid != first.pid
        await graph.unload()
        await trio.sleep(0)
    assert sandbox_children() == []


def _gathernd_guest_wat() -> str:
    """A core-module guest that loads the GatherND model from its own bytes, computes with
    the index that crashes OpenVINO, then with a good one, and exits with 10 x the first
    compute's error code + the second's."""
    model = _gathernd_onnx()
    mem = bytearray(640)
    struct.pack_into("<2IB3xII", mem, 128, 256, 3, 1, 512, 48)    # x: f32[2, 2, 3]
    struct.pack_into("<2IB3xII", mem, 160, 272, 2, 5, 576, 32)    # i: i64[2, 2]
    struct.pack_into("<3I", mem, 256, 2, 2, 3)
    struct.pack_into("<2I", mem, 272, 2, 2)
    struct.pack_into("<12f", mem, 512, *_gathernd_inputs(0)["x"].reshape(-1))
    struct.pack_into("<4q", mem, 576, *_gathernd_inputs(INT32_MIN)["i"].reshape(-1))
    return core_nn_guest_wat(mem, model, """
    (drop (call $set (local.get $ctx) (i32.const 0) (i32.const 128)))
    (drop (call $set (local.get $ctx) (i32.const 1) (i32.const 160)))
    (local.set $first (call $compute (local.get $ctx)))
    (i64.store (i32.const 576) (i64.const 1))
    (drop (call $set (local.get $ctx) (i32.const 1) (i32.const 160)))
    (call $exit (i32.add (i32.mul (local.get $first) (i32.const 10))
                         (call $compute (local.get $ctx))))""", "(local $first i32)")


async def test_a_guest_whose_own_model_crashes_the_library_gets_an_error_by_default(
        tmp_path: Any) -> None:
    # The default [guests] sandbox = "cpu": in the host's process this guest kills it
    # (test_openvino_gathernd_kills_the_process_that_runs_it).
    require_backend("openvino")
    require_backend("onnx")
    from wasinn.host.abi import Errno

    guest = tmp_path / "gathernd.wat"
    guest.write_text(_gathernd_guest_wat())
    async with wasinn.Runtime(no_spares(cpu_pool(backends=["openvino"]))) as rt:
        code = await rt.run_wasm(guest)
        assert code == 10 * Errno.RUNTIME_ERROR + Errno.SUCCESS
        assert sandbox_children() == []  # the guest's graph went with the guest
        graph = await rt.load([_gathernd_onnx()], "onnx")  # the host's own: in-process
        out = await graph.compute(_gathernd_inputs(1))
        assert out["y"].numpy().shape == (2, 3)


# -- the same results as in the host's process --------------------------------------------
@pytest.mark.parametrize("backend_name", ["onnxruntime", "openvino"])
def test_results_specs_and_errors_are_those_of_the_backend_in_process(
        backend_name: str) -> None:
    require_backend(backend_name)
    backend = wasinn.backends.registry.BackendRegistry().get(backend_name)
    model = affine_onnx(3.0, -1.0)
    inside = backend.load([model], GraphEncoding.ONNX, CPU)
    sandboxed = load_sandboxed(backend, [model], GraphEncoding.ONNX, CPU)
    try:
        assert isinstance(sandboxed, SandboxedGraph) and sandboxed.pid is not None
        assert (sandboxed.inputs, sandboxed.outputs) == (inside.inputs, inside.outputs)
        assert dict(sandboxed.input_aliases) == dict(inside.input_aliases)
        x = Tensor.from_numpy(np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32))
        np.testing.assert_array_equal(sandboxed.run({"x": x})["y"].numpy(),
                                      inside.run({"x": x})["y"].numpy())
        for bad, error in (({"z": x}, UnknownNameError),
                           ({"x": Tensor.from_numpy(np.zeros((2, 5), np.float32))},
                            InvalidArgumentError)):
            with pytest.raises(error) as in_process:
                inside.run(bad)
            with pytest.raises(error) as in_sandbox:
                sandboxed.run(bad)
            assert in_sandbox.value.message == in_process.value.message
    finally:
        sandboxed.close()
        inside.close()
    with pytest.raises(wasinn.ClosedResourceError):
        sandboxed.run({"x": x})


def _torchscript_affine() -> bytes:
    import io

    import torch

    class Affine(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2.0 + 1.0

    saved = io.BytesIO()
    torch.jit.save(torch.jit.script(Affine()), saved)
    return saved.getvalue()


@pytest.mark.parametrize(("library", "encoding"), [("onnxruntime", "onnx"),
                                                   ("torch", "pytorch"),
                                                   ("onnxruntime", "autodetect")])
def test_the_host_never_imports_the_library_of_a_graph_it_sandboxes(
        tmp_path: Any, library: str, encoding: str) -> None:
    # In a fresh interpreter: this one has imported every library already.
    require_backend(library)
    model = tmp_path / "model"
    model.write_bytes(_torchscript_affine() if library == "torch" else affine_onnx())
    code = textwrap.dedent(f"""
        import sys, numpy as np, trio, wasinn
        async def main():
            async with wasinn.Runtime() as rt:
                graph = await rt.load([open({str(model)!r}, "rb").read()], {encoding!r},
                                      options={{"sandbox": True}})
                out = await graph.compute({{0: np.ones((1, 4), np.float32)}})
                print([*out.values()][0].numpy().tolist(), graph.backend,
                      [m for m in ("onnxruntime", "openvino", "torch") if m in sys.modules])
        trio.run(main)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    backend = "pytorch" if library == "torch" else library
    assert out.stdout.split() == ["[[3.0,", "3.0,", "3.0,", "3.0]]", backend, "[]"]


def test_bytes_no_backend_reads_are_an_invalid_encoding_as_in_process() -> None:
    require_backend("onnxruntime")
    backend = wasinn.backends.registry.BackendRegistry().get("onnxruntime")
    with pytest.raises(InvalidEncodingError, match=r"^onnxruntime: "):
        load_sandboxed(backend, [b"not a model"], GraphEncoding.ONNX, CPU)
    assert sandbox_children() == []


# -- crashes, cancels, bad options (the fake backend) ---------------------------------------
def test_a_crash_while_loading_is_an_invalid_encoding() -> None:
    with pytest.raises(InvalidEncodingError, match=(
            r"^crashing: the process loading the model was killed by SIGSEGV: the library "
            r"crashed on it \(the host goes on\)$")):
        load_sandboxed(CrashingBackend(), [b"fake:add=1:loadcrash"], GraphEncoding.GGML, CPU)
    assert sandbox_children() == []


def test_a_crash_while_running_fails_that_run_and_the_next_run_reloads() -> None:
    graph = load_sandboxed(CrashingBackend(), [b"fake:add=2"], GraphEncoding.GGML, CPU)
    try:
        first = graph.pid
        with pytest.raises(BackendRuntimeError, match=r"was killed by SIGSEGV"):
            graph.run({"x": Tensor.from_numpy(np.full((1, 4), CRASH, np.float32))})
        assert graph.pid is None
        out = graph.run({"x": Tensor.from_numpy(np.ones((1, 4), np.float32))})
        np.testing.assert_array_equal(out["y"].numpy(), np.full((1, 4), 3.0, np.float32))
        assert graph.pid not in (None, first)
    finally:
        graph.close()


def test_a_process_that_died_while_idle_is_replaced_without_failing_a_run(
        caplog: pytest.LogCaptureFixture) -> None:
    # Before: the next run failed, blaming "this model or these inputs", and the death
    # counted towards the crash back-off.
    import logging

    graph = load_sandboxed(CrashingBackend(), [b"fake:add=2"], GraphEncoding.GGML, CPU)
    try:
        x = {"x": Tensor.from_numpy(np.ones((1, 4), np.float32))}
        graph.run(x)
        first = graph.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        # Until it can be waited for (all its threads gone), not reaped here: the graph
        # reads its status. (A process in the middle of dying is not seen as dead.)
        deadline = time.monotonic() + 10
        while os.waitid(os.P_PID, first, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with caplog.at_level(logging.WARNING, logger="wasinn.backends"):
            out = graph.run(x)
        np.testing.assert_array_equal(out["y"].numpy(), np.full((1, 4), 3.0, np.float32))
        assert graph.pid not in (None, first)
        assert [r.getMessage() for r in caplog.records] == [
            f"crashing: sandbox process {first} was killed by SIGKILL while idle: a new "
            "one runs the next run"]
    finally:
        graph.close()


def _signalled_when_started(signum: int, pid: Any) -> None:
    """Send ``signum`` to the sandbox process ``pid()`` gives once it gives one (in a
    thread: the caller is blocked in the call the signal is for)."""
    import threading

    def send() -> None:
        deadline = time.monotonic() + 20
        while (target := pid()) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # (well into the run or the load)
        os.kill(target, signum)

    threading.Thread(target=send, daemon=True).start()


def test_a_process_stopped_from_outside_did_not_crash(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    # SIGTERM reaches every process of a service that systemd stops, an operator's kill
    # sends it. Before: the run's error said the library crashed on these inputs, which
    # counted towards the back-off (twice: refused), and a load's called the bytes
    # malformed (InvalidEncodingError). A process can send itself the signal too (code a
    # hostile model got to run): a second one in a minute counts as a crash.
    import logging

    slow = tmp_path / "slow"
    graph = load_sandboxed(CrashingBackend(), [f"fake:add=2:slowload-if={slow}".encode()],
                           GraphEncoding.GGML, CPU)
    ones = {"x": Tensor.from_numpy(np.ones((1, 4), np.float32))}
    deaf = {"x": Tensor.from_numpy(np.full((1, 4), DEAF, np.float32))}
    try:
        stopped = graph.pid
        _signalled_when_started(signal.SIGTERM, lambda: stopped)
        with caplog.at_level(logging.WARNING, logger="wasinn.backends"), pytest.raises(
                BackendRuntimeError, match=(
                    r"^crashing: the process running the model was killed by SIGTERM, "
                    r"sent from outside wasinn \(an operator's kill, or a service "
                    r"manager stopping the service's processes\): not a crash of the "
                    r"model or of these inputs")):
            graph.run(deaf)
        assert graph.backoff.crashes == 0
        assert [r.getMessage() for r in caplog.records] == [
            f"crashing: sandbox process {stopped} on cpu was killed by SIGTERM during a run, "
            "sent from outside wasinn: not counted as a crash"]
        np.testing.assert_array_equal(graph.run(ones)["y"].numpy(),
                                      np.full((1, 4), 3.0, np.float32))
        again = graph.pid
        _signalled_when_started(signal.SIGTERM, lambda: again)
        with pytest.raises(BackendRuntimeError, match=(
                r"^crashing: the process running the model was killed by SIGTERM a second "
                r"time in 60 s \(which counts as a crash\): the library crashed")):
            graph.run(deaf)
        assert graph.backoff.crashes == 1
        graph.close()  # the next process loads the model again, which takes a minute
        slow.touch()
        _signalled_when_started(signal.SIGHUP, lambda: next(
            (p.pid for p in sandbox_children()), None))
        with pytest.raises(BackendRuntimeError, match=(
                r"^crashing: the process loading the model was killed by SIGHUP, sent from "
                r"outside wasinn .*: not a crash on the model's bytes")):
            load_sandboxed(CrashingBackend(), [f"fake:add=2:slowload-if={slow}".encode()],
                           GraphEncoding.GGML, CPU)
    finally:
        graph.close()


def test_a_cancel_stops_the_reload_a_run_waits_for_at_once(tmp_path: Any) -> None:
    import threading
    import time

    from wasinn.backends.base import Cancellation, running_under

    slow = tmp_path / "slow"
    graph = load_sandboxed(CrashingBackend(), [f"fake:add=1:slowload-if={slow}".encode()],
                           GraphEncoding.GGML, CPU)
    ones = {"x": Tensor.from_numpy(np.ones((1, 4), np.float32))}
    try:
        with pytest.raises(BackendRuntimeError, match=r"was killed by SIGSEGV"):
            graph.run({"x": Tensor.from_numpy(np.full((1, 4), CRASH, np.float32))})
        slow.touch()  # the next process takes a minute to load the model
        cancellation = Cancellation()
        threading.Timer(0.3, cancellation.cancel).start()
        started = time.monotonic()
        with running_under(cancellation), pytest.raises(BackendRuntimeError, match=(
                r"^crashing: cancelled while a process loaded the model: it was stopped$")):
            graph.run(ones)
        assert time.monotonic() - started < 20  # not the minute
        assert graph.pid is None and sandbox_children() == []
        slow.unlink()
        np.testing.assert_array_equal(graph.run(ones)["y"].numpy(),
                                      np.full((1, 4), 2.0, np.float32))
    finally:
        graph.close()


async def test_a_cancelled_run_that_does_not_stop_has_its_process_killed() -> None:
    config = parse_config({"pools": {"cpu": {"kind": "cpu", "devices": ["cpu"],
                                             "backends": ["crashing"]}}}, None)
    async with wasinn.Runtime(no_spares(config), backends=[CrashingBackend()]) as rt:
        graph = await rt.load([b"fake:add=1"], "ggml", options={"sandbox": True})
        (first,) = sandbox_children()
        with trio.move_on_after(0.5) as scope:
            await graph.compute({"x": np.full((1, 4), DEAF, np.float32)})
        assert scope.cancelled_caught
        # The run ignores its cancellation; the sandbox kills its process after the grace.
        with trio.fail_after(CANCEL_GRACE_S + 30):
            while first.is_running() and first.status() != psutil.STATUS_ZOMBIE:
                await trio.sleep(0.05)
        out = await graph.compute({"x": np.zeros((1, 4), np.float32)})
        np.testing.assert_array_equal(out["y"].numpy(), np.ones((1, 4), np.float32))


async def test_sandbox_must_be_a_boolean() -> None:
    async with wasinn.Runtime(cpu_pool()) as rt:
        with pytest.raises(InvalidArgumentError, match=(
                r"^options sandbox='yes': expected True \(the graph runs in a process of its "
                r"own\), 'cpu' \(so on the CPU only\) or False$")):
            await rt.load([affine_onnx()], "onnx", options={"sandbox": "yes"})
        with pytest.raises(InvalidArgumentError, match=r"^options sandbox='gpu': "):
            await rt.load([affine_onnx()], "onnx", options=LoadOptions(sandbox="gpu"))  # type: ignore[arg-type]


# -- the memory a sandboxed graph's process may hold ---------------------------------------
def _constant_of_shape_onnx() -> bytes:
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("ConstantOfShape", ["shape"], ["y"])], "fill",
        [helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)],
                             ir_version=8).SerializeToString()


def _data_in_use(pid: int | None) -> int:
    """What the process ``pid`` holds of what RLIMIT_DATA bounds (its VmData), in bytes."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmData:"))
               .split()[1]) * 1024


def _data_limit(pid: int | None) -> tuple[int, int]:
    assert pid is not None
    limits: tuple[int, int] = psutil.Process(pid).rlimit(psutil.RLIMIT_DATA)
    return limits


@pytest.mark.parametrize("backend_name", ["onnxruntime", "openvino"])
def test_a_run_that_needs_more_memory_than_the_bound_fails_and_the_process_goes_on(
        backend_name: str) -> None:
    require_backend(backend_name)
    require_backend("onnx")
    backend = wasinn.backends.registry.BackendRegistry().get(backend_name)
    model = [_constant_of_shape_onnx()]
    # 1 GiB past what the process holds before its load (0.1 GB on 2 cores, 0.7 GB on 16):
    # room for the library's threads and a 100 MB output, not for a 3.6 GB one.
    held = held_before_load(backend, model, GraphEncoding.ONNX)
    bound = held + (1 << 30)
    assert bound < 3_600_000_000, f"the process holds {held} bytes already"
    graph = load_sandboxed(backend, model, GraphEncoding.ONNX, CPU,
                           LoadOptions(sandbox=True, max_sandbox_bytes=bound))
    try:
        pid = graph.pid
        assert graph.max_bytes == bound and _data_limit(pid) == (bound, bound)
        with pytest.raises(BackendRuntimeError, match=(
                rf"(?s)^{backend_name}: .*alloc.* \(a sandboxed graph's process may hold "
                rf"{bound} bytes: max_sandbox_bytes\)$")):  # 3.6 GB of zeros (ONNX
            # Runtime: "Failed to allocate memory" or "std::bad_alloc", as it fails)
            graph.run({"shape": Tensor.from_numpy(np.array([30_000, 30_000], np.int64))})
        # Before, with ONNX Runtime: its CPU arena, left to grow by 4 GiB next, took all
        # that was left under the bound for the next run that needed it to grow (100 MB
        # here), and the runs after failed with std::bad_alloc wherever they allocated
        # outside it (on 16 cores: the next 4 MB output, and [2, 3]).
        for shape in ([5_000, 5_000], [2, 3], [5_000, 5_000]):
            out = graph.run({"shape": Tensor.from_numpy(np.array(shape, np.int64))})
            assert out["y"].numpy().shape == tuple(shape) and not out["y"].numpy().any()
            assert _data_in_use(pid) < held + (512 << 20)  # (the threads' stacks, 100 MB)
        assert graph.pid == pid
    finally:
        graph.close()


def test_the_bound_defaults_to_half_the_memory_and_must_leave_room_to_load() -> None:
    from wasinn._memory import total_memory
    from wasinn.backends.sandbox import default_max_bytes

    graph = load_sandboxed(CrashingBackend(), [b"fake:add=1"], GraphEncoding.GGML, CPU)
    try:
        # the machine's, or a container's cgroup limit (tests/test_memory_cgroup.py)
        half = total_memory() // 2
        assert 0 < half <= psutil.virtual_memory().total // 2
        assert default_max_bytes() == half
        assert graph.max_bytes == default_max_bytes()
        assert _data_limit(graph.pid) == (graph.max_bytes, graph.max_bytes)
    finally:
        graph.close()
    with pytest.raises(InvalidArgumentError, match=(
            r"^max_sandbox_bytes = 67108864: the sandbox process holds \d+ bytes before it "
            r"loads the model \(Python, the library, the model's bytes\): expected at least "
            r"\d+, and room for the model's working memory$")):
        load_sandboxed(CrashingBackend(), [b"fake:add=1"], GraphEncoding.GGML, CPU,
                       LoadOptions(sandbox=True, max_sandbox_bytes=64 << 20))
    assert sandbox_children() == []


@pytest.mark.parametrize(("options", "said"), [
    ({"max_sandbox_bytes": 1 << 30}, r"^options max_sandbox_bytes=1073741824 without "
     r"sandbox=True: it bounds the process a sandboxed graph runs in"),
    ({"sandbox": True, "max_sandbox_bytes": 1000}, r"^options max_sandbox_bytes=1000: "
     r"expected the bytes a sandboxed graph's process may hold, an integer of at least "
     r"67108864$"),
    ({"sandbox": True, "max_sandbox_bytes": True}, r"^options max_sandbox_bytes=True: "),
    ({"sandbox": True, "max_sandbox_bytes": "1 GiB"}, r"^options max_sandbox_bytes='1 GiB': "),
    (LoadOptions(max_sandbox_bytes=1 << 30), r"^options max_sandbox_bytes=1073741824 without"),
])
async def test_a_bad_memory_bound_is_refused(options: Any, said: str) -> None:
    async with wasinn.Runtime(cpu_pool()) as rt:
        with pytest.raises(InvalidArgumentError, match=said):
            await rt.load([affine_onnx()], "onnx", options=options)
    assert sandbox_children() == []


# -- a registered model's external data ----------------------------------------------------
def _large_external_model(folder: Path, size: int) -> Path:
    """``y = x + sum(w)`` (x: f32[1, 4]) saved as ``folder/big.onnx``, with ``w``, f32[size]
    (all zeros but 1 and 2 at its ends), in the external data file ``w.data``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = np.zeros(size, np.float32)
    w[0], w[-1] = 1.0, 2.0
    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["w"], ["s"], keepdims=0),
         helper.make_node("Add", ["x", "s"], ["y"])], "big",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = folder / "big.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="w.data",
              size_threshold=0)
    return path


@pytest.mark.parametrize("backend_name", ["onnxruntime", "openvino"])
@pytest.mark.parametrize("given", [False, True])
def test_external_data_larger_than_the_file_bound_of_the_models_bytes_loads_sandboxed(
        tmp_path: Path, backend_name: str, given: bool) -> None:
    # The process's files may hold 4 x what it was sent + 64 MiB: its external data
    # counts (OpenVINO writes it to the process's folder to read it; before, only the
    # .onnx file's bytes counted, and writing 68 MB of weights failed there). Read from
    # the model's folder by the host, or given by the caller in memory (which goes in
    # the shared memory too, not in the load request's header of at most 16 MiB).
    require_backend(backend_name)
    require_backend("onnx")
    from wasinn.backends._confine import FILE_SIZE_MARGIN

    size = (FILE_SIZE_MARGIN + (4 << 20)) // 4
    path = _large_external_model(tmp_path, size)
    assert (tmp_path / "w.data").stat().st_size > FILE_SIZE_MARGIN + 4 * path.stat().st_size
    backend = wasinn.backends.registry.BackendRegistry().get(backend_name)
    options = (LoadOptions(sandbox=True, external_data={"w.data": (tmp_path / "w.data")
                                                        .read_bytes()})
               if given else LoadOptions(sandbox=True, source=str(path)))
    model = path.read_bytes()
    x = {"x": Tensor.from_numpy(np.arange(4, dtype=np.float32).reshape(1, 4))}
    inside = backend.load([model], GraphEncoding.ONNX, CPU, options)
    sandboxed = load_sandboxed(backend, [model], GraphEncoding.ONNX, CPU, options)
    try:
        assert sandboxed.confinement is not None
        assert "fsize" not in sandboxed.confinement["failed"]
        np.testing.assert_array_equal(sandboxed.run(x)["y"].numpy(), inside.run(x)["y"].numpy())
        np.testing.assert_array_equal(sandboxed.run(x)["y"].numpy(),
                                      np.array([[3.0, 4.0, 5.0, 6.0]], np.float32))
    finally:
        sandboxed.close()
        inside.close()


def test_an_onnx_runtime_that_cannot_take_external_data_in_memory_says_so_sandboxed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # ONNX Runtime before add_external_initializers_from_files_in_memory reads external
    # data from the model's folder only, which a sandbox process may not read.
    require_backend("onnxruntime")
    import onnxruntime as ort

    from wasinn import UnsupportedOperationError
    from wasinn.backends import onnxruntime as ort_backend

    real = ort.SessionOptions

    class Older:  # its SessionOptions, without that call
        def __init__(self) -> None:
            object.__setattr__(self, "_options", real())

        def __getattr__(self, name: str) -> Any:
            if name == "add_external_initializers_from_files_in_memory":
                raise AttributeError(name)
            return getattr(self._options, name)

        def __setattr__(self, name: str, value: Any) -> None:
            setattr(self._options, name, value)

    monkeypatch.setattr(ort, "SessionOptions", Older)
    external = {"w.data": b"\0" * 16}
    with pytest.raises(UnsupportedOperationError, match=(
            r"^onnxruntime: ONNX Runtime \S+ cannot take a model's external data in memory "
            r"\(no SessionOptions\.add_external_initializers_from_files_in_memory\), and a "
            r"sandboxed model's process may not read the model's folder: expected a newer "
            r"ONNX Runtime, or the model loaded without sandbox$")):
        ort_backend.session_options(LoadOptions(external_data=external), external)
    in_process = ort_backend.session_options(LoadOptions(source="/models/m.onnx"), external)
    assert in_process.get_session_config_entry(
        "session.model_external_initializers_file_folder_path") == "/models"


# -- from the config ----------------------------------------------------------------------
async def test_a_registered_model_with_sandbox_runs_in_a_process_of_its_own(tmp_path: Any
                                                                            ) -> None:
    require_backend("onnxruntime")
    (tmp_path / "affine.onnx").write_bytes(affine_onnx(2.0, 1.0))
    config = tmp_path / "wasinn.toml"
    config.write_text('[models.affine]\nfiles = ["affine.onnx"]\nsandbox = true\n'
                      'max_sandbox_bytes = 2147483648\n'
                      '[models.plain]\nfiles = ["affine.onnx"]\n'
                      '[runtime]\nsandbox_spares = 0\n')
    async with wasinn.Runtime(config) as rt:
        plain = await rt.load_by_name("plain")
        await plain.compute({"x": np.ones((1, 4), np.float32)})
        assert sandbox_children() == []
        graph = await rt.load_by_name("affine")
        out = await graph.compute({"x": np.ones((1, 4), np.float32)})
        np.testing.assert_array_equal(out["y"].numpy(), np.full((1, 4), 3.0, np.float32))
        (child,) = sandbox_children()
        assert child.rlimit(psutil.RLIMIT_DATA) == (2 << 30, 2 << 30)
    assert sandbox_children() == []


async def test_a_sandbox_process_does_not_take_a_ctrl_c_sent_to_the_group() -> None:
    # A terminal's Ctrl-C reaches the host's whole process group. Before: each sandbox
    # process died of it with a KeyboardInterrupt traceback, and the host logged a
    # crash. The host ends them itself (SIGKILL) as it closes.
    require_backend("onnxruntime")
    x = {"x": np.ones((1, 4), np.float32)}
    async with wasinn.Runtime(parse_config({"runtime": {"sandbox_spares": 0}}, None)) as rt:
        graph = await rt.load([affine_onnx(2.0, 1.0)], "onnx", options={"sandbox": True})
        await graph.compute(x)
        (child,) = sandbox_children()
        child.send_signal(signal.SIGINT)
        await trio.sleep(0.2)  # (a process that took them would be gone by now)
        out = await graph.compute(x)  # on the same process: no crash, no new one
        np.testing.assert_array_equal(out["y"].numpy(), np.full((1, 4), 3.0, np.float32))
        assert sandbox_children() == [child] and child.is_running()
        assert graph.stats().failed == 0
    assert sandbox_children() == []


@pytest.mark.parametrize("table", ["models", "guests"])
def test_a_memory_bound_without_sandbox_is_a_config_error(table: str) -> None:
    def config(**keys: Any) -> Any:
        body = {"files": ["m.onnx"], **keys} if table == "models" else keys
        return parse_config({table: {"m": body} if table == "models" else body}, None)

    where = "models[.]m" if table == "models" else "guests"
    with pytest.raises(wasinn.ConfigError, match=(
            rf"{where}[.]max_sandbox_bytes: set without sandbox = true")):
        config(sandbox=False, max_sandbox_bytes=1 << 30)
    with pytest.raises(wasinn.ConfigError, match=rf"{where}[.]max_sandbox_bytes: .*67108864"):
        config(sandbox=True, max_sandbox_bytes=10)
    with pytest.raises(wasinn.ConfigError, match=rf"{where}[.]sandbox: "):
        config(sandbox="gpu")
    assert config(sandbox="cpu", max_sandbox_bytes=1 << 30) is not None


def test_guests_sandbox_reaches_the_guests_loads() -> None:
    from wasinn.host.limits import GuestLimits, limits_of

    config = parse_config({"guests": {"sandbox": True}}, None)
    limits = limits_of(type("R", (), {"config": config})())
    assert limits.sandbox and limits.load_options() == {"sandbox": True}
    assert GuestLimits().load_options() == {"sandbox": "cpu"}  # the default
    assert limits_of(None).load_options() == {"sandbox": "cpu"}
    config = parse_config({"guests": {"sandbox": False}}, None)
    assert limits_of(type("R", (), {"config": config})()).load_options() is None
    config = parse_config({"guests": {"sandbox": True, "max_sandbox_bytes": 1 << 30}}, None)
    limits = limits_of(type("R", (), {"config": config})())
    assert limits.load_options() == {"sandbox": True, "max_sandbox_bytes": 1 << 30}


def test_load_options_default_to_the_host_process() -> None:
    assert LoadOptions().sandbox is False


# -- the arena: what the processes share ----------------------------------------------
def test_a_model_larger_than_any_message_loads_and_large_outputs_come_back() -> None:
    require_backend("onnxruntime")
    require_backend("onnx")
    from onnx import TensorProto, helper, numpy_helper

    width = 1_500_000  # 24 MB of weights, 6 MB of output: more than a header may be
    weights = np.arange(4 * width, dtype=np.float32).reshape(4, width) % 7
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "wide",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, width])],
        [numpy_helper.from_array(weights, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)],
                              ir_version=8).SerializeToString()
    assert len(model) > 16 * 1024 * 1024
    backend = wasinn.backends.registry.BackendRegistry().get("onnxruntime")
    sandboxed = load_sandboxed(backend, [model], GraphEncoding.ONNX, CPU)
    try:
        x = np.array([[1.0, 2.0, 0.0, -1.0]], np.float32)
        y = sandboxed.run({"x": Tensor.from_numpy(x)})["y"].numpy()
        np.testing.assert_array_equal(y, x @ weights)
        assert y.flags.writeable  # as in the host's process
    finally:
        sandboxed.close()


def test_outputs_larger_than_the_arena_grow_it_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import wasinn.backends._sandbox_process as process_module

    verbs: list[object] = []
    request = process_module.request

    def counted(arena: Any, payload: Any, *args: Any, **kwargs: Any) -> bytes:
        verbs.append(payload[0])
        return request(arena, payload, *args, **kwargs)

    monkeypatch.setattr(process_module, "request", counted)
    graph = load_sandboxed(CrashingBackend(), [b"fake:add=1"], GraphEncoding.GGML, CPU)
    try:
        verbs.clear()
        for rows in (300_000, 300_000, 10, 1):  # outputs of 4.8 MB: unknown until the run
            x = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)
            out = graph.run({"x": Tensor.from_numpy(x)})
            np.testing.assert_array_equal(out["y"].numpy(), x + 1)
        assert verbs == ["run", "again", "run", "run", "run"]
    finally:
        graph.close()


def test_an_arena_that_cannot_grow_fails_that_run_only(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    import errno

    from wasinn.backends._sandbox_wire import Arena

    grow = Arena.grow

    def short_of_memory(self: Arena, size: int) -> None:
        if size > 8 << 20:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        grow(self, size)

    graph = load_sandboxed(CrashingBackend(), [b"fake:add=1"], GraphEncoding.GGML, CPU)
    try:
        pid = graph.pid
        monkeypatch.setattr(Arena, "grow", short_of_memory)  # the host's side only
        with pytest.raises(BackendRuntimeError, match=(
                r"^crashing: the tensors cannot be placed in the memory shared with the "
                r"sandbox process: growing it failed: \[Errno 12\] Cannot allocate memory$")):
            graph.run({"x": Tensor.from_numpy(np.ones((1 << 20, 4), np.float32))})
        out = graph.run({"x": Tensor.from_numpy(np.ones((2, 4), np.float32))})
        np.testing.assert_array_equal(out["y"].numpy(), np.full((2, 4), 2.0, np.float32))
        assert graph.pid == pid
    finally:
        graph.close()


def _arena_pair() -> tuple[Any, Any]:
    import os

    from wasinn.backends._sandbox_wire import Arena

    host = Arena.create(4096)
    return host, Arena.attach(os.dup(host.fd))


def test_the_child_cannot_shrink_the_arena_under_the_host() -> None:
    import os

    if not hasattr(os, "memfd_create"):
        pytest.skip("no memfd_create here: the arena is a plain file, which is not sealed")
    host, child = _arena_pair()
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(child.fd, 0)
        host.view(4000, 96)[:] = bytes(range(96))  # the host's whole mapping still holds
        assert bytes(child.view(4000, 96)) == bytes(range(96))
    finally:
        host.close()
        child.close()


def _expect(*names: str, most: int = 1 << 20) -> Any:
    """What a reply to a run of a graph declaring outputs ``names`` (f32 of any shape)
    that asked for every one may hold, of ``most`` bytes."""
    from wasinn.backends._sandbox_wire import DeclaredOutputs
    from wasinn.backends.base import TensorSpec

    specs = [TensorSpec(name, wasinn.TensorType.F32, (), rank_known=False) for name in names]
    return DeclaredOutputs("b", specs, {}, typed=True).expect(None, most)


def test_a_reply_round_trips_its_tensors_through_the_arena() -> None:
    from wasinn.backends._sandbox_wire import (
        DeclaredOutputs,
        read_reply,
        read_request,
        reply,
        request,
    )
    from wasinn.backends.base import TensorSpec

    specs = [TensorSpec(name, wasinn.TensorType.F32, (), rank_known=False)
             for name in ("s", "m", "e", "big")]
    expected = DeclaredOutputs("b", specs, {}, typed=False).expect(None, 1 << 20)
    host, child = _arena_pair()
    try:
        scalar = Tensor.from_numpy(np.float64(2.5))
        matrix = Tensor.from_numpy(np.arange(6, dtype=np.int64).reshape(2, 3).T)  # F order
        empty = Tensor.from_numpy(np.zeros((0, 3), np.float32))
        header = request(host, ("run", 1, None), {"s": scalar, "m": matrix, "e": empty})
        payload, tensors, at = read_request(child, header)
        assert payload == ("run", 1, None) and at % 64 == 0
        np.testing.assert_array_equal(tensors["m"].numpy(), matrix.numpy())
        big = Tensor.from_numpy(np.arange(2000, dtype=np.float32))
        header, fits = reply(child, {"ok": True}, {**tensors, "big": big}, at=at)
        assert not fits
        asked, none = read_reply(host, header, expected)
        assert none == {} and asked["grow"] > host.size
        host.grow(asked["grow"])
        read_request(child, request(host, ("again", 1, None)))
        header, fits = reply(child, {"ok": True}, {**tensors, "big": big}, at=at)
        payload, back = read_reply(host, header, expected)
        assert fits and payload == {"ok": True}
        assert back["s"].dims == () and back["s"].numpy() == 2.5
        np.testing.assert_array_equal(back["m"].numpy(), matrix.numpy())
        assert back["e"].dims == (0, 3)
        np.testing.assert_array_equal(back["big"].numpy(), big.numpy())
        child.view(at, host.size - at)[:] = bytes(host.size - at)  # the copies are the host's
        np.testing.assert_array_equal(back["big"].numpy(), big.numpy())
    finally:
        host.close()
        child.close()


# -- the host believes nothing the child says ---------------------------------------------
@pytest.mark.parametrize(("header", "said"), [
    (b"[1, 2]", r"^a reply that is no JSON object$"),
    (b'{"ok": true, "tensors": {"y": 0}}', r"^a reply whose tensors are no list$"),
    (b'{"ok": true, "tensors": [["y", "f32", [2], 4090]]}',
     r"^tensor 'y': 8 bytes at offset 4090, outside the arena's 4096$"),
    (b'{"ok": true, "tensors": [["y", "f32", [2], -64]]}', r"^tensor 'y': 8 bytes at "),
    (b'{"ok": true, "tensors": [["y", "f32", [4096, 4096, 4096, 4096], 0]]}',
     r"^tensor 'y': "),
    (b'{"ok": true, "tensors": [["y", "f128", [1], 0]]}', r"^tensor 'y': "),
    (b'{"ok": true, "tensors": [["y", "f32", [-1], 0]]}', r"^tensor 'y': "),
    (b'{"ok": true, "tensors": [["y", "f32", [1]]]}', r"^a tensor described as "),
    (b'{"ok": true, "tensors": [["y", "f32", [1], true]]}', r"^a tensor described as "),
    # (at most the arena's bytes, and those of the outputs a process may hold, each aligned)
    (b'{"grow": 4096}', r"^a reply asking for an arena of 4096 bytes: expected more than "
     r"its 4096 and at most 1052736$"),
    (b'{"grow": 1052737}', r"^a reply asking for an arena of 1052737 bytes: "),
    (b'{"grow": 1099511627777}', r"^a reply asking for an arena of "),
    (b'{"grow": "more"}', r"^a reply asking for an arena of 'more' bytes"),
    # Before: these escaped as a TypeError, a ValueError and a RecursionError, the
    # process stayed in service, and every later run got the previous run's outputs.
    (b'{"error": 5}', r"^an error reported as 5: expected \[class, message\]$"),
    (b'{"error": ["BackendRuntimeError"]}', r"^an error reported as \['Backend"),
    (b'{"error": ["BackendRuntimeError", 7]}', r"^an error reported as "),
    (b"[" * 100_000, r"^a reply nested too deeply$"),
    (b'{"ok": true, "tensors": [["y", "f32", [1], 0], ["y", "f32", [1], 64]]}',
     r"^tensor 'y' described twice$"),
])
def test_a_reply_that_is_not_one_is_refused(header: bytes, said: str) -> None:
    from wasinn.backends._sandbox_wire import read_reply

    host, child = _arena_pair()
    try:
        with pytest.raises(ValueError, match=said):
            read_reply(host, header, _expect("y"))
    finally:
        host.close()
        child.close()


@pytest.mark.parametrize(("first", "said"), [
    (EXTRA_OUTPUT, r"output 'z', which the model does not declare: expected outputs "
                   r"y: f32\[\?, 4\]"),
    (WRONG_TYPE, r"output 'y' is i32\[1, 4\]: expected y: f32\[\?, 4\], as the model declares"),
    (WRONG_DIM, r"output 'y' is f32\[1, 5\]: expected y: f32\[\?, 4\], as the model declares"),
    (NO_OUTPUT, r"no output y: f32\[\?, 4\]: expected outputs y: f32\[\?, 4\]"),
])
def test_a_child_answering_other_outputs_than_the_graph_declares_is_retired(
        first: float, said: str) -> None:
    # Before: the host passed on whatever outputs a compromised child named, of whatever
    # type and shape, or none. This child's own check of its outputs is off (hostile).
    graph = load_sandboxed(CrashingBackend(), [b"fake:add=1:hostile"], GraphEncoding.GGML, CPU)
    ones = {"x": Tensor.from_numpy(np.ones((1, 4), np.float32))}
    try:
        hostile = graph.pid
        with pytest.raises(BackendRuntimeError, match=(
                rf"^crashing: the process running the model answered badly: {said}$")):
            graph.run({"x": Tensor.from_numpy(np.full((1, 4), first, np.float32))})
        assert graph.pid is None  # retired
        np.testing.assert_array_equal(graph.run(ones)["y"].numpy(),
                                      np.full((1, 4), 2.0, np.float32))
        assert graph.pid not in (None, hostile)
    finally:
        graph.close()
    assert sandbox_children() == []


def test_outputs_a_model_declares_otherwise_fail_that_run_in_the_process_that_goes_on(
        ) -> None:
    # ONNX Runtime returns what the model computed where that contradicts a static
    # dimension the model declares (it logs a warning): the sandbox process says so as
    # the run's error instead of answering what the host would refuse (before the
    # process checked its outputs itself, the host retired it for each such run).
    require_backend("onnxruntime")
    require_backend("onnx")
    from onnx import TensorProto, helper

    graph_proto = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])], "declared",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    backend = wasinn.backends.registry.BackendRegistry().get("onnxruntime")
    graph = load_sandboxed(backend, [onnx_model_bytes(graph_proto)], GraphEncoding.ONNX, CPU)
    try:
        pid = graph.pid
        with pytest.raises(BackendRuntimeError, match=(
                r"^onnxruntime: the run's outputs are not those the model declares: output "
                r"'y' is f32\[2, 4\]: expected y: f32\[1, 4\], as the model declares$")):
            graph.run({"x": Tensor.from_numpy(np.ones((2, 4), np.float32))})
        out = graph.run({"x": Tensor.from_numpy(np.full((1, 4), 3.0, np.float32))})
        np.testing.assert_array_equal(out["y"].numpy(), np.full((1, 4), 3.0, np.float32))
        assert graph.pid == pid
    finally:
        graph.close()


def _torchscript_argmax() -> bytes:
    import io

    import torch

    class TwoOutputs(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x * 2.0, x.argmax()

    saved = io.BytesIO()
    torch.jit.save(torch.jit.script(TwoOutputs()), saved)
    return saved.getvalue()


def test_a_torchscript_models_outputs_may_be_of_any_type_and_shape_sandboxed() -> None:
    # TorchScript records no types or shapes: its specs' f32 of unknown rank is a
    # placeholder, which an output of another type (i64 here) does not contradict.
    require_backend("torch")
    backend = wasinn.backends.registry.BackendRegistry().get("pytorch")
    graph = load_sandboxed(backend, [_torchscript_argmax()], GraphEncoding.PYTORCH, CPU)
    try:
        assert [s.describe() for s in graph.outputs] == ["output_0: any[...]",
                                                         "output_1: any[...]"]
        assert graph.output_types_declared is False
        x = np.array([[1.0, 5.0, 2.0]], np.float32)
        out = graph.run({"x": Tensor.from_numpy(x)})
        np.testing.assert_array_equal(out["output_0"].numpy(), x * 2)
        assert out["output_1"].type is wasinn.TensorType.I64 and out["output_1"].dims == ()
        assert int(out["output_1"].numpy()) == 1
    finally:
        graph.close()


def test_a_runs_outputs_are_checked_against_what_it_asked_for() -> None:
    # A run may ask for an output by an alias or its position: the library answers it
    # under its declared name.
    from wasinn.backends._sandbox_wire import DeclaredOutputs
    from wasinn.backends.base import TensorSpec

    specs = (TensorSpec("y", wasinn.TensorType.F32, (None, 4)),
             TensorSpec("s", wasinn.TensorType.I64, (), rank_known=False))
    declared = DeclaredOutputs("b", specs, {"y:0": 0}, typed=True)
    y = Tensor.from_numpy(np.zeros((3, 4), np.float32))
    s = Tensor.from_numpy(np.zeros((2, 2, 2), np.int64))  # unknown rank: any shape
    assert declared.problem({"y": y, "s": s}, None) is None
    assert declared.problem({"y": y}, ["y:0"]) is None
    assert declared.problem({"y": y}, [0]) is None  # type: ignore[list-item]
    assert declared.problem({}, []) is None
    assert declared.problem({"y": y, "s": s}, ["y"]) == (
        "output 's', which the run did not ask for: expected outputs y: f32[?, 4]")
    assert declared.problem({"y:0": y}, ["y:0"]) == (
        "output 'y:0', which the model does not declare: expected outputs y: f32[?, 4]")
    assert declared.problem({"y": y}, ["w"]) == (
        "outputs for a run that asked for one the model lacks (b: the model has no output "
        "'w': expected outputs y: f32[?, 4], s: i64[...])")
    wrong = Tensor.from_numpy(np.zeros((2, 2), np.float32))
    assert declared.problem({"y": y, "s": wrong}, None) == (
        "output 's' is f32[2, 2]: expected s: i64[...], as the model declares")
    assert declared.problem({"y": wrong}, ["y"]) == (
        "output 'y' is f32[2, 2]: expected y: f32[?, 4], as the model declares")
    untyped = DeclaredOutputs("b", specs, {}, typed=False)
    assert untyped.problem({"y": y, "s": wrong}, None) is None
    assert untyped.problem({"y": Tensor.from_numpy(np.zeros((3, 4), np.int64))}, ["y"]) is None
    assert untyped.problem({"y": wrong}, ["y"]) is not None  # a declared rank still holds


def test_a_childs_long_error_message_keeps_its_start_and_end() -> None:
    from wasinn.backends._sandbox_errors import MAX_MESSAGE_BYTES, child_error

    message = "start " + "x" * 1_000_000 + " expected the end"
    error = child_error({"error": ["InvalidArgumentError", message]})
    assert isinstance(error, InvalidArgumentError)
    assert len(error.message.encode()) <= MAX_MESSAGE_BYTES + 64
    assert error.message.startswith("start xxx") and error.message.endswith(
        "x expected the end")
    assert "bytes elided" in error.message
    short = child_error({"error": ["NoSuchClass", "short"]})
    assert type(short) is BackendRuntimeError and short.message == "short"


# -- a graph that keeps crashing -----------------------------------------------------------
@pytest.fixture
def spawns(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The pids of the sandbox processes graphs loaded without spares start, in order
    (each by a pool that keeps none: :mod:`wasinn.backends._sandbox_spares`)."""
    from wasinn.backends import _sandbox_spares

    started: list[int] = []

    class Counted(_sandbox_spares.SandboxProcess):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            started.append(self.process.pid)

    monkeypatch.setattr(_sandbox_spares, "SandboxProcess", Counted)
    return started


def _poison(variant: float = 0.0) -> dict[str, Tensor]:
    """Inputs that crash the fake library (first element 666); each ``variant`` other."""
    return {"x": Tensor.from_numpy(np.array([[CRASH, variant, 0, 0]], np.float32))}


ONES = {"x": Tensor.from_numpy(np.ones((1, 4), np.float32))}
REFUSED = (r"^crashing: these inputs crashed the model's process 2 times \(the last "
           r"[0-9.]+ s ago: it was killed by SIGSEGV\): they are refused without a run "
           r"until 600 s after their last crash; other inputs run as usual$")


def test_a_poison_input_that_keeps_crashing_the_model_does_not_fail_a_good_one(
        spawns: list[int]) -> None:
    # Before: after the second crash in a row every run failed at once for a while (the
    # back-off), a good input too: on a shared model, another guest's.
    graph = load_sandboxed(CrashingBackend(), [b"fake:add=1"], GraphEncoding.GGML, CPU)
    try:
        for _ in range(2):
            with pytest.raises(BackendRuntimeError, match=r"was killed by SIGSEGV"):
                graph.run(_poison())
        # The good input waits for the process the back-off delays, and runs.
        np.testing.assert_array_equal(graph.run(ONES)["y"].numpy(),
                                      np.full((1, 4), 2.0, np.float32))
        assert len(spawns) == 3  # the load's, and one after each crash
        with pytest.raises(BackendRuntimeError, match=REFUSED):
            graph.run(_poison())  # the same poison: refused, not run
        assert len(spawns) == 3 and graph.pids == [spawns[-1]]  # its process goes on
        np.testing.assert_array_equal(graph.run(ONES)["y"].numpy(),
                                      np.full((1, 4), 2.0, np.float32))
    finally:
        graph.close()


def test_the_same_poison_sent_again_starts_no_process_after_the_wait_either(
        spawns: list[int]) -> None:
    # Before: each time the back-off's wait was over, the poison was run again, in a
    # process started for it, and crashed it.
    from wasinn.backends._sandbox_backoff import MAX_DELAY_S, CrashBackoff

    now = [1000.0]
    graph = load_sandboxed(CrashingBackend(), [b"fake:add=1"], GraphEncoding.GGML, CPU)
    graph.backoff = CrashBackoff("crashing", clock=lambda: now[0])
    try:
        with pytest.raises(BackendRuntimeError, match=r"the next run starts a new process\)$"):
            graph.run(_poison())
        with pytest.raises(BackendRuntimeError, match=(
                r"SIGSEGV: the library crashed on this model or these inputs \(the host goes "
                r"on; the next process starts in 0\.5 s, after 2 crashes less than 60 s "
                r"apart: runs wait for it; these inputs, which crashed it 2 times, are "
                r"refused for 600 s\)$")):
            graph.run(_poison())
        for _ in range(5):
            now[0] += MAX_DELAY_S  # past any wait
            with pytest.raises(BackendRuntimeError, match=REFUSED):
                graph.run(_poison())
        assert len(spawns) == 2 and graph.pids == []  # the load's, and one after a crash
    finally:
        graph.close()


def test_poison_varied_between_good_runs_still_delays_the_next_process(
        spawns: list[int]) -> None:
    # Before: a run that succeeded ended the crash streak, so a caller crashing the model
    # between good runs of its own had a process started at once after every crash.
    graph = load_sandboxed(CrashingBackend(), [b"fake:add=1"], GraphEncoding.GGML, CPU)
    try:
        then = []
        for variant in (1.0, 2.0, 3.0):  # other inputs each time: none refused
            with pytest.raises(BackendRuntimeError) as caught:
                graph.run(_poison(variant))
            then.append(caught.value.message.split("(the host goes on; ")[1])
            if variant < 3.0:
                graph.run(ONES)  # waits for the delayed process, then runs
        assert then == [
            "the next run starts a new process)",
            "the next process starts in 0.5 s, after 2 crashes less than 60 s apart: runs "
            "wait for it)",
            "the next process starts in 1 s, after 3 crashes less than 60 s apart: runs "
            "wait for it)"]
        assert len(spawns) == 3 and graph.pids == []  # the next one waits for its delay
    finally:
        graph.close()


def test_a_run_waiting_for_the_delayed_process_can_be_cancelled(spawns: list[int]) -> None:
    # Before: such a run was refused at once.
    import threading

    from wasinn.backends._sandbox_backoff import CrashBackoff
    from wasinn.backends.base import Cancellation, running_under

    now = [1000.0]
    graph = load_sandboxed(CrashingBackend(), [b"fake:add=1"], GraphEncoding.GGML, CPU)
    graph.backoff = CrashBackoff("crashing", clock=lambda: now[0])
    try:
        for variant in (1.0, 2.0):
            with pytest.raises(BackendRuntimeError, match=r"was killed by SIGSEGV"):
                graph.run(_poison(variant))
        cancellation = Cancellation()
        threading.Timer(0.3, cancellation.cancel).start()
        with running_under(cancellation), pytest.raises(BackendRuntimeError, match=(
                r"^crashing: cancelled while waiting for a process of the model \(after 2 "
                r"crashes, a new one starts in 0\.5 s\)$")):
            graph.run(ONES)  # (the clock stands still: it would wait for ever)
        assert len(spawns) == 2 and graph.pids == []  # nothing was started
        now[0] += 0.5
        np.testing.assert_array_equal(graph.run(ONES)["y"].numpy(),
                                      np.full((1, 4), 2.0, np.float32))
    finally:
        graph.close()


def test_the_wait_doubles_with_each_crash_up_to_a_bound_and_a_quiet_minute_ends_it() -> None:
    from wasinn.backends._sandbox_backoff import MAX_DELAY_S, QUIET_S, CrashBackoff

    now = [0.0]
    backoff = CrashBackoff("b", clock=lambda: now[0])
    delays = []
    for _ in range(8):
        backoff.crashed("was killed by SIGFPE")
        delays.append(backoff.delay())
        now[0] += 1.0
    assert delays == [0.0, 0.5, 1.0, 2.0, 4.0, 8.0, MAX_DELAY_S, MAX_DELAY_S]
    assert MAX_DELAY_S == 10.0
    assert backoff.remaining() == MAX_DELAY_S - 1.0
    now[0] += QUIET_S  # a minute without a crash: the next one starts a new streak
    assert backoff.remaining() == 0.0
    assert backoff.crashed("was killed by SIGFPE") == "the next run starts a new process"
    assert backoff.delay() == 0.0


def test_inputs_are_refused_once_they_crashed_twice_and_forgotten_once_they_ran() -> None:
    from wasinn.backends._sandbox_backoff import (
        MAX_REMEMBERED,
        REMEMBERED_S,
        CrashBackoff,
        digest_of,
        shapes_of,
    )

    now = [0.0]
    backoff = CrashBackoff("b", clock=lambda: now[0])
    shapes, digest = shapes_of(ONES), digest_of(ONES)
    assert not backoff.knows(shapes)
    backoff.crashed("was killed by SIGSEGV", (shapes, digest))
    # Once: perhaps another run's doing (a corrupted heap); they run again.
    assert backoff.knows(shapes) and backoff.refusal(digest) is None
    backoff.crashed("was killed by SIGABRT", (shapes, digest))
    refusal = backoff.refusal(digest)
    assert refusal is not None and "2 times" in refusal and "SIGABRT" in refusal
    assert backoff.refusal(digest_of(_poison(1.0))) is None  # other bytes run
    backoff.ran(digest)  # they ran without a crash: forgotten
    assert backoff.refusal(digest) is None and not backoff.knows(shapes)
    for _ in range(2):
        backoff.crashed("was killed by SIGSEGV", (shapes, digest))
    now[0] += REMEMBERED_S  # long enough after their last crash
    assert not backoff.knows(shapes)
    for variant in range(MAX_REMEMBERED + 1):  # the oldest is forgotten past the most
        poison = _poison(float(variant))
        for _ in range(2):
            backoff.crashed("was killed by SIGSEGV", (shapes_of(poison), digest_of(poison)))
    assert backoff.refusal(digest_of(_poison(0.0))) is None
    assert backoff.refusal(digest_of(_poison(1.0))) is not None


# -- several runs at once ------------------------------------------------------------------
def test_a_graph_with_two_processes_runs_while_the_other_process_is_busy() -> None:
    import threading

    from wasinn.backends.base import Cancellation, running_under

    graph = load_sandboxed(CrashingBackend(), [b"fake:add=1"], GraphEncoding.GGML, CPU,
                           processes=2)
    cancellation = Cancellation()
    stuck: list[BaseException] = []

    def deaf_run() -> None:  # ignores its cancellation for a minute
        try:
            with running_under(cancellation):
                graph.run({"x": Tensor.from_numpy(np.full((1, 4), DEAF, np.float32))})
        except BaseException as exc:
            stuck.append(exc)

    first = graph.pid
    thread = threading.Thread(target=deaf_run)
    try:
        thread.start()
        while _idle(graph):
            time.sleep(0.01)  # until the deaf run has taken the first process
        out = graph.run({"x": Tensor.from_numpy(np.ones((1, 4), np.float32))})
        np.testing.assert_array_equal(out["y"].numpy(), np.full((1, 4), 2.0, np.float32))
        assert len(graph.pids) == 2 and first in graph.pids  # a second process ran it
        cancellation.cancel()  # the deaf one is killed after the grace
        thread.join(CANCEL_GRACE_S + 30)
        assert not thread.is_alive()
        (error,) = stuck
        assert isinstance(error, BackendRuntimeError) and "did not stop" in error.message
        assert graph.pids != [] and first not in graph.pids
        graph.run({"x": Tensor.from_numpy(np.ones((1, 4), np.float32))})
    finally:
        cancellation.cancel()
        graph.close()
        thread.join(CANCEL_GRACE_S + 30)
    assert sandbox_children() == []


def _idle(graph: SandboxedGraph) -> bool:
    return bool(graph._idle)


def test_a_graph_may_not_have_fewer_than_one_of_its_processes() -> None:
    with pytest.raises(ValueError, match=r"^processes=0: expected at least 1$"):
        load_sandboxed(CrashingBackend(), [b"fake:add=1"], GraphEncoding.GGML, CPU,
                       processes=0)


async def test_a_pool_with_two_workers_runs_a_sandboxed_graph_twice_at_once() -> None:
    config = parse_config({"pools": {"cpu": {"kind": "cpu", "devices": ["cpu"], "workers": 2,
                                             "backends": ["crashing"]}}}, None)
    async with wasinn.Runtime(no_spares(config), backends=[CrashingBackend()]) as rt:
        graph = await rt.load([b"fake:add=1"], "ggml", options={"sandbox": True})
        async with trio.open_nursery() as nursery:
            nursery.start_soon(graph.compute, {"x": np.full((1, 4), DEAF, np.float32)})
            while rt.stats()[0].running < 1:
                await trio.sleep(0.01)
            await trio.sleep(0.2)  # its worker thread has taken the first process
            out = await graph.compute({"x": np.ones((1, 4), np.float32)})
            np.testing.assert_array_equal(out["y"].numpy(), np.full((1, 4), 2.0, np.float32))
            assert len(sandbox_children()) == 2
            nursery.cancel_scope.cancel()  # the deaf run: killed after the grace


# -- confinement of the process --------------------------------------------------------------
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's /proc")
@pytest.mark.parametrize("backend_name", ["onnxruntime", "openvino", "pytorch"])
def test_every_thread_of_a_sandbox_process_is_confined(
        backend_name: str, capfd: pytest.CaptureFixture[str]) -> None:
    # Before: the threads numpy's OpenBLAS and the libraries start as they are imported
    # ran before the process confined itself: no seccomp filter, no no_new_privs, no
    # landlock (they could exec, open sockets and write the host's files).
    from tests.backend_models import affine

    require_backend({"pytorch": "torch"}.get(backend_name, backend_name))
    backend = wasinn.backends.registry.BackendRegistry().get(backend_name)
    builders, encoding = affine(backend_name, 2.0, 1.0)
    graph = load_sandboxed(backend, builders, encoding, CPU, LoadOptions(sandbox=True))
    try:
        graph.run({"x": Tensor.from_numpy(np.ones((1, 4), np.float32))})
        assert graph.pid is not None
        statuses = [t.read_text() for t in
                    sorted(Path(f"/proc/{graph.pid}/task").glob("*/status"))]
        assert len(statuses) > 1  # (the libraries' threads)
        for status in statuses:
            fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
            assert fields["NoNewPrivs"].strip() == "1", status
            if "Seccomp" in fields and platform.machine() in ("x86_64", "AMD64"):
                assert fields["Seccomp"].strip() == "2", status
            assert int(fields["CapEff"], 16) == 0, status
        report = graph.confinement
        assert report is not None and "landlock" not in report["failed"], report
    finally:
        graph.close()
    # ONNX Runtime pins its pool's threads by their ids, which the filter refuses: it is
    # given their number there, and so pins none (before: a logged failure per thread).
    assert "pthread_setaffinity_np failed" not in capfd.readouterr().err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's landlock")
@pytest.mark.parametrize("backend_name", ["user-name", "pytorch"])
def test_a_confined_sandbox_process_is_told_the_users_name(
        backend_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Where the environment names no user (LOGNAME, USER: unset on a GPU machine, as
    # root), getpass.getuser() reads the passwd database, which landlock keeps from a
    # confined process. torch 2.11's torch.export.load asks for it (its import of
    # torch._dynamo): before, every sandboxed .pt2 load there failed with
    # "getpwuid(): uid not found: 0" (torch 2.13 gets by without it). The fake backend
    # asks as torch 2.11 does, whatever torch is here.
    import pwd

    from tests.backend_models import affine
    from tests.user_name_backend import UserNameBackend
    from wasinn.backends._sandbox_process import USER_NAME_VARIABLES

    for variable in USER_NAME_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    backend: Any
    if backend_name == "pytorch":
        require_backend("torch")
        backend = wasinn.backends.registry.BackendRegistry().get("pytorch")
        builders, encoding = affine("pytorch", 2.0, 1.0)
    else:
        name = pwd.getpwuid(os.getuid()).pw_name
        backend, builders = UserNameBackend(), [f"fake:add=1:user={name}".encode()]
        encoding = GraphEncoding.GGML
    graph = load_sandboxed(backend, builders, encoding, CPU, LoadOptions(sandbox=True))
    try:
        report = graph.confinement
        assert report is not None
        if not any(a.startswith("landlock") for a in report["applied"]):  # (readable)
            pytest.skip(f"landlock was not applied here: {report}")
        out = graph.run({"x": Tensor.from_numpy(np.ones((1, 4), np.float32))})
        np.testing.assert_array_equal(out[graph.outputs[0].name].numpy(),
                                      np.full((1, 4), 2.0 if backend_name == "user-name"
                                              else 3.0, np.float32))
    finally:
        graph.close()


@pytest.mark.skipif(os.name != "posix", reason="the passwd database")
def test_a_sandbox_process_keeps_the_user_name_its_environment_gives() -> None:
    import pwd

    from wasinn.backends._sandbox_process import _name_the_user

    given = {"USER": "alice", "HOME": "/x"}
    _name_the_user(given)
    assert given == {"USER": "alice", "HOME": "/x"}
    unnamed = {"USER": "", "HOME": "/x"}  # (empty: getpass reads on)
    _name_the_user(unnamed)
    name = pwd.getpwuid(os.getuid()).pw_name
    assert unnamed == {"USER": name, "LOGNAME": name, "HOME": "/x"}


def test_a_sandbox_process_asks_numpys_openblas_for_one_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: numpy's OpenBLAS started a thread per core in each process, each reserving a
    # 32 MB buffer: about 40 MB of data a core (0.7 GB on a 16-core machine) counted
    # against max_sandbox_bytes, for a process whose library has BLAS of its own.
    import platform

    from wasinn.backends._sandbox_process import _child_env
    from wasinn.backends.base import BackendRef

    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    ort = BackendRef("onnxruntime", "wasinn.backends.onnxruntime:OnnxRuntimeBackend")
    torch = BackendRef("pytorch", "wasinn.backends.pytorch:TorchBackend")
    assert _child_env(ort)["OPENBLAS_NUM_THREADS"] == "1"
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    assert _child_env(torch)["OPENBLAS_NUM_THREADS"] == "1"  # (torch's BLAS is MKL there)
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")  # (OpenBLAS is torch's)
    assert "OPENBLAS_NUM_THREADS" not in _child_env(torch)
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "4")  # the environment's, kept
    assert _child_env(ort)["OPENBLAS_NUM_THREADS"] == "4"
    monkeypatch.delenv("OPENBLAS_NUM_THREADS")

    require_backend("onnxruntime")
    registry = wasinn.backends.registry.BackendRegistry()
    graph = load_sandboxed(registry.get("onnxruntime"), [affine_onnx()], GraphEncoding.ONNX,
                           CPU, LoadOptions(sandbox=True))
    try:
        environ = Path(f"/proc/{graph.pid}/environ").read_bytes().split(b"\0")
        assert b"OPENBLAS_NUM_THREADS=1" in environ
    finally:
        graph.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's /proc/<pid>/environ")
def test_a_confined_sandbox_process_is_given_none_of_the_hosts_secrets(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: it was given the host's whole environment, which it could hand to the guest
    # in its outputs were it compromised.
    from wasinn.backends._sandbox_process import _child_env
    from wasinn.backends.base import BackendRef

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "host-secret")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # (a library's: kept)
    require_backend("onnxruntime")
    registry = wasinn.backends.registry.BackendRegistry()
    graph = load_sandboxed(registry.get("onnxruntime"), [affine_onnx()], GraphEncoding.ONNX,
                           CPU, LoadOptions(sandbox=True))
    try:
        environ = dict(entry.split(b"=", 1) for entry in
                       Path(f"/proc/{graph.pid}/environ").read_bytes().split(b"\0") if entry)
        assert b"AWS_SECRET_ACCESS_KEY" not in environ
        assert environ[b"PATH"] == os.environ["PATH"].encode()
        assert environ[b"OMP_WAIT_POLICY"] == b"PASSIVE"
        out = graph.run({graph.inputs[0].name: Tensor.from_numpy(np.ones((1, 4), np.float32))})
        assert out[graph.outputs[0].name].numpy().shape == (1, 4)
    finally:
        graph.close()
    # (one not confined, for a device other than the CPU or a GPU, is given all of it)
    ort = BackendRef("onnxruntime", "wasinn.backends.onnxruntime:OnnxRuntimeBackend")
    assert _child_env(ort, confined=False)["AWS_SECRET_ACCESS_KEY"] == "host-secret"


def test_a_sandbox_process_reads_no_folder_of_the_hosts_path_but_wasinns_and_its_backends(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: every folder on the host's sys.path was on the child's import path and
    # readable under landlock: the host's working directory or script folder (a home
    # directory, with its .ssh) included.
    from wasinn.backends._sandbox_process import _child_env
    from wasinn.backends.base import BackendRef

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "path", ["", *sys.path])
    env = _child_env(BackendRef("onnxruntime", "wasinn.backends.onnxruntime:OnnxRuntimeBackend"))
    for variable in ("PYTHONPATH", "WASINN_SANDBOX_CODE"):
        folders = env[variable].split(os.pathsep)
        assert str(tmp_path) not in folders and "" not in folders, folders
        assert os.getcwd() not in folders
    wasinn_root = Path(wasinn.__file__).parents[1]
    assert env["PYTHONPATH"].split(os.pathsep) == [str(wasinn_root)] * 2
    assert os.path.dirname(os.path.realpath(wasinn.backends.__file__)) in env[
        "WASINN_SANDBOX_CODE"].split(os.pathsep)


#: A plug-in backend (ONNX Runtime's, under another module) for a package folder that is
#: a symlink, as Nix's python.withPackages and Bazel's runfiles lay out site-packages.
_LINKED_BACKEND = """
from wasinn.backends.onnxruntime import OnnxRuntimeBackend


class LinkedBackend(OnnxRuntimeBackend):
    pass
"""


def test_a_confined_process_imports_a_package_whose_folder_is_a_symlink(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: landlock let it read the folders on its import path, not where the links in
    # them lead (it checks the file a link leads to): the import failed with
    # PermissionError, and so did every sandboxed load in such a site-packages.
    import importlib

    from tests.test_confine import HAS_LANDLOCK

    require_backend("onnxruntime")
    real = tmp_path / "store" / "wasinn_linked_backend"
    real.mkdir(parents=True)
    (real / "__init__.py").write_text(_LINKED_BACKEND)
    site = tmp_path / "site"
    site.mkdir()
    (site / "wasinn_linked_backend").symlink_to(real, target_is_directory=True)
    monkeypatch.syspath_prepend(str(site))
    linked = importlib.import_module("wasinn_linked_backend")
    monkeypatch.setitem(sys.modules, "wasinn_linked_backend", linked)  # (forgotten after)
    backend = linked.LinkedBackend()
    graph = load_sandboxed(backend, [affine_onnx()], GraphEncoding.ONNX, CPU,
                           LoadOptions(sandbox=True))
    try:
        report = graph.confinement
        assert report is not None
        assert any(a.startswith("landlock") for a in report["applied"]) == HAS_LANDLOCK, report
        out = graph.run({graph.inputs[0].name: Tensor.from_numpy(np.ones((1, 4), np.float32))})
        assert out[graph.outputs[0].name].numpy().shape == (1, 4)
    finally:
        graph.close()


def test_a_process_that_cannot_import_wasinn_did_not_start_and_the_model_is_not_blamed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # What a confined process met that could not read a dependency (a package folder it
    # was not let read): before, the host said the library crashed on the model
    # (InvalidEncodingError), which the process never read, and named no path.
    from wasinn.backends import _sandbox_process

    shadow = tmp_path / "path"
    (shadow / "wasinn").mkdir(parents=True)
    denied = tmp_path / "deps" / "ml_dtypes" / "__init__.py"
    (shadow / "wasinn" / "__init__.py").write_text(
        f"raise PermissionError(13, 'Permission denied', {str(denied)!r})\n")
    # (its import path: the shadow wasinn alone, found before the real one)
    monkeypatch.setattr(_sandbox_process, "_top_folder", lambda module: shadow)
    with pytest.raises(BackendRuntimeError) as failed:
        load_sandboxed(CrashingBackend(), [b"fake:add=1"], GraphEncoding.GGML, CPU)
    assert str(failed.value) == (
        "crashing: the sandbox process exited with status 1 as it started, before it read "
        f"the model: PermissionError: [Errno 13] Permission denied: '{denied}' (it could "
        "not set itself up: the model is not to blame; a confined one may read only the "
        "folders of its import path, the Python installation, the system's libraries and "
        "[runtime] sandbox_read)")
    assert sandbox_children() == []


_HOST_THAT_DIES = """
import sys, numpy as np
from tests.loop_model import LONG_LOOP, loop_inputs, loop_onnx
from wasinn import GraphEncoding, Tensor
from wasinn.backends import Device, LoadOptions
from wasinn.backends.registry import BackendRegistry
from wasinn.backends.sandbox import load_sandboxed
backend = BackendRegistry().get("onnxruntime")
graph = load_sandboxed(backend, [loop_onnx()], GraphEncoding.ONNX, Device.parse("cpu"),
                       LoadOptions(sandbox=True))
print(graph.pid, flush=True)
graph.run({k: Tensor.from_numpy(v) for k, v in loop_inputs(LONG_LOOP).items()})
"""


def test_a_sandbox_process_ends_with_its_host_even_in_a_run(tmp_path: Path) -> None:
    # Before: a host killed (as the OOM killer kills) left the process of a run under way
    # running on at full CPU for nobody, reparented to init.
    require_backend("onnxruntime")
    host = subprocess.Popen([sys.executable, "-c", _HOST_THAT_DIES], stdout=subprocess.PIPE,
                            text=True, cwd=Path(__file__).parents[1])
    try:
        assert host.stdout is not None
        child = psutil.Process(int(host.stdout.readline()))
        time.sleep(0.5)  # (in its run)
        assert child.status() != psutil.STATUS_ZOMBIE
    finally:
        host.kill()
        host.wait()
        if host.stdout is not None:
            host.stdout.close()
    _, alive = psutil.wait_procs([child], timeout=30)
    assert alive == [], "the sandbox process outlived its host"
