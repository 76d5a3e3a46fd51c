"""Loading a big model leaves the event loop serving other requests.

ONNX Runtime's binding holds the GIL while it copies a model given as bytes (0.3 to 1.1 s
for 512 MB, during which no Python code of any thread runs, the trio loop's included),
and releases it while it parses and builds the session. wasinn has it read the model from
a pipe instead (:mod:`wasinn.backends._model_pipe`), with the GIL released.

No wall-time assertion: the stall of a copy can only be seen with a clock. The binding's
session constructor is wrapped instead, to see what it was given (a file's name, never
the bytes) and how far a trio heartbeat and another model's requests got between its
start and its end (they must have moved: the loop served while the model was read).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
import trio

import wasinn
from tests.support import cpu_pool, require_backend
from wasinn import InvalidEncodingError
from wasinn.backends import Device, LoadOptions
from wasinn.backends._model_pipe import piped
from wasinn.modelgen import affine_onnx, onnx_model_bytes

#: Big enough that reading it takes tens of milliseconds on a fast machine, small enough
#: for a shared CI machine's memory.
BIG_MB = 64
#: Loads of the big model tried before the test gives up on seeing the loop move: a
#: loaded machine may leave the loop's thread unscheduled through one build.
ATTEMPTS = 3
#: Where a pipe can be named by a path (``/proc/self/fd``); elsewhere the bytes go as before.
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="a pipe is named by /proc/self/fd on Linux only")


@pytest.fixture
def _ort() -> None:
    require_backend("onnxruntime")


def big_matmul_onnx(mb: int) -> bytes:
    """``y = x @ W``, x (1, 1024) f32, with W an initializer of ``mb`` MiB."""
    from onnx import TensorProto, helper, numpy_helper

    columns = mb * 2**20 // 4 // 1024
    weight = numpy_helper.from_array(np.full((1024, columns), 0.5, np.float32), "W")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1024])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, columns])
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "big",
                              [x], [y], initializer=[weight])
    return onnx_model_bytes(graph)


class Watch:
    """What a trio heartbeat and another model's requests did while ONNX Runtime's session
    constructor ran (``during``: one (beats, requests) pair per constructor call)."""

    def __init__(self) -> None:
        self.beats = 0
        self.requests = 0
        self.during: list[tuple[int, int]] = []
        #: Whether each call was given a file's name (else the model's bytes).
        self.from_file: list[bool] = []

    def wrap(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Wraps the binding's ``InferenceSession``, which takes the model and parses it
        (ONNX Runtime's Python ``InferenceSession`` looks it up as it builds a session)."""
        from onnxruntime.capi import _pybind_state

        constructor = _pybind_state.InferenceSession

        def watched(*args: Any) -> Any:
            self.from_file.append(args[2])  # (options, model, is_arg_file_name, ...)
            beats, requests = self.beats, self.requests
            try:
                return constructor(*args)
            finally:
                self.during.append((self.beats - beats, self.requests - requests))

        monkeypatch.setattr(_pybind_state, "InferenceSession", watched)

    async def heartbeat(self) -> None:
        while True:
            self.beats += 1
            await trio.sleep(0)

    async def serve(self, graph: wasinn.Graph) -> None:
        """Another model's requests, one after the other."""
        x = np.ones((1, 4), np.float32)
        while True:
            out = await graph.compute({"x": x})
            assert out["y"].numpy().tolist() == [[3.0] * 4]
            self.requests += 1


@linux_only
@pytest.mark.usefixtures("_ort")
async def test_onnx_runtime_reads_a_big_model_from_a_file_while_the_loop_serves_others(
        monkeypatch: pytest.MonkeyPatch) -> None:
    watch = Watch()
    big = big_matmul_onnx(BIG_MB)
    async with wasinn.Runtime(cpu_pool(workers=2)) as rt, trio.open_nursery() as nursery:
        small = await rt.load([affine_onnx()], encoding="onnx", target="cpu")
        nursery.start_soon(watch.heartbeat)
        nursery.start_soon(watch.serve, small)
        watch.wrap(monkeypatch)
        for attempt in range(ATTEMPTS):
            graph = await rt.load([big], encoding="onnx", target="cpu", name=f"big{attempt}")
            out = await graph.compute({"x": np.ones((1, 1024), np.float32)})
            assert out["y"].numpy()[0, :3].tolist() == [512.0] * 3
            await graph.unload()
            if any(beats and requests for beats, requests in watch.during):
                break
        nursery.cancel_scope.cancel()
    assert watch.from_file, "ONNX Runtime built no session"
    assert all(watch.from_file), (
        "ONNX Runtime's binding was given the model's bytes, which it copies holding the GIL")
    assert any(beats and requests for beats, requests in watch.during), (
        f"while ONNX Runtime read a {BIG_MB} MB model and built its session (each of "
        f"{len(watch.during)} times), the loop's heartbeat moved "
        f"{[b for b, _ in watch.during]} times and another model's requests "
        f"{[r for _, r in watch.during]}: the build held the GIL")


@linux_only
@pytest.mark.usefixtures("_ort")
def test_an_onnx_runtime_error_names_the_models_bytes_not_the_pipe() -> None:
    from wasinn.backends._ort_session import MODEL_BYTES
    from wasinn.backends.onnxruntime import OnnxRuntimeBackend

    no_graph = b"\x08\x07"  # ModelProto.ir_version = 7, and nothing more
    with pytest.raises(InvalidEncodingError) as caught:
        OnnxRuntimeBackend().load([no_graph], wasinn.GraphEncoding.ONNX, Device.parse("cpu"))
    assert "/proc/self/fd" not in caught.value.message
    assert MODEL_BYTES in caught.value.message


@pytest.mark.usefixtures("_ort")
def test_without_proc_self_fd_the_model_goes_as_bytes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Not Linux (no /proc/self/fd to name the pipe by): built as before, from the bytes.
    from wasinn.backends.onnxruntime import OnnxRuntimeBackend

    isdir = os.path.isdir
    monkeypatch.setattr(os.path, "isdir", lambda p: p != "/proc/self/fd" and isdir(p))
    watch = Watch()
    watch.wrap(monkeypatch)
    graph = OnnxRuntimeBackend().load([affine_onnx()], wasinn.GraphEncoding.ONNX,
                                      Device.parse("cpu"), LoadOptions())
    out = graph.run({"x": wasinn.Tensor.from_numpy(np.ones((1, 4), np.float32))})
    assert out["y"].numpy().tolist() == [[3.0] * 4]
    assert watch.from_file == [False]


@pytest.mark.usefixtures("_ort")
def test_a_sandbox_process_gives_onnx_runtime_the_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    # Its stall holds up only its own graph, and its confinement need not allow the path.
    from wasinn.backends import _ort_session
    from wasinn.backends.onnxruntime import OnnxRuntimeBackend

    monkeypatch.setattr(_ort_session, "in_sandbox", lambda: True)
    watch = Watch()
    watch.wrap(monkeypatch)
    graph = OnnxRuntimeBackend().load([affine_onnx()], wasinn.GraphEncoding.ONNX,
                                      Device.parse("cpu"), LoadOptions())
    out = graph.run({"x": wasinn.Tensor.from_numpy(np.ones((1, 4), np.float32))})
    assert out["y"].numpy().tolist() == [[3.0] * 4]
    assert watch.from_file == [False]


@linux_only
@pytest.mark.parametrize("read", [0, 10], ids=["never-opened", "read-in-part"])
def test_a_pipe_its_reader_left_ends_its_writer_even_where_sigpipe_kills(read: int) -> None:
    # ONNX Runtime stops reading a model it cannot parse, or never opens it (an error
    # before): the writing thread, in a process that leaves SIGPIPE at its default action
    # (which ends the process), must end with EPIPE, not take the process with it.
    code = f"""
        import signal, threading
        from wasinn.backends._model_pipe import piped
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        with piped(bytes(8 << 20), "feeder") as path:
            if {read}:
                with open(path, "rb") as f:
                    assert f.read({read}) == bytes({read})
        print(path.startswith("/proc/self/fd/"),
              [t.name for t in threading.enumerate() if t.name == "feeder"])
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert done.stdout.split() == ["True", "[]"]


@linux_only
@pytest.mark.parametrize("size", [100, 3 << 20], ids=["in-its-buffer", "past-its-buffer"])
def test_a_pipe_read_to_its_end_holds_the_bytes(size: int) -> None:
    data = np.random.default_rng(0).bytes(size)
    with piped(data, "feeder") as path:
        assert path is not None
        with open(path, "rb") as f:
            assert f.read() == data
