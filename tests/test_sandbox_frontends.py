"""TensorFlow and TFLite models in a sandbox process (``sandbox = true``, and the models
guests load from their own bytes under the default ``[guests] sandbox = "cpu"``).

In the host's process OpenVINO's frontends for these read the model in a throw-away
child (:mod:`wasinn.backends._ovread`). A sandbox process may start none (its seccomp
filter refuses ``fork`` and ``execve``, Landlock leaves ``/dev/null`` read-only), so
there they read it in that process, which a crash ends instead of the host's.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import wasinn
from tests.support import cpu_pool, no_spares, require_backend, sandbox_children
from tests.tfmodels import (
    FRONTEND_ARGS,
    FRONTEND_CASES,
    FRONTEND_IDS,
    relu_graphdef,
    relu_tflite,
)
from wasinn import GraphEncoding, InvalidEncodingError, Tensor
from wasinn.backends import Device
from wasinn.backends.sandbox import SandboxedGraph, load_sandboxed

pytestmark = pytest.mark.usefixtures("_openvino")

CPU = Device.parse("cpu")
X = np.array([[-1.0, 2.0, -3.0, 4.0]], np.float32)


@pytest.fixture
def _openvino() -> None:
    require_backend("openvino")
    require_backend("flatbuffers")


def _openvino_backend() -> Any:
    from wasinn.backends.openvino import OpenVinoBackend

    return OpenVinoBackend()


@pytest.mark.parametrize(FRONTEND_ARGS, FRONTEND_CASES, ids=FRONTEND_IDS)
def test_tensorflow_models_load_sandboxed_as_in_process(
        make: Any, encoding: GraphEncoding, in_name: str, out_name: str) -> None:
    # Before: "openvino: cannot start a process to read the model.pb in: [Errno 13]
    # Permission denied: '/dev/null'" (BackendRuntimeError), sandboxed only.
    backend = _openvino_backend()
    inside = backend.load([make()], encoding, CPU)
    sandboxed = load_sandboxed(backend, [make()], encoding, CPU)
    try:
        assert isinstance(sandboxed, SandboxedGraph) and sandboxed.pid is not None
        assert (sandboxed.inputs, sandboxed.outputs) == (inside.inputs, inside.outputs)
        assert dict(sandboxed.input_aliases) == dict(inside.input_aliases)
        x = {in_name: Tensor.from_numpy(X)}
        np.testing.assert_array_equal(sandboxed.run(x)[out_name].numpy(), np.maximum(X, 0))
        np.testing.assert_array_equal(sandboxed.run(x)[out_name].numpy(),
                                      inside.run(x)[out_name].numpy())
    finally:
        sandboxed.close()
        inside.close()


@pytest.mark.parametrize(
    ("data", "encoding"),
    [
        (lambda: relu_graphdef()[:60], GraphEncoding.TENSORFLOW),
        (lambda: relu_tflite()[:120], GraphEncoding.TENSORFLOWLITE),  # the flatbuffer check
    ],
    ids=["graphdef-truncated", "tflite-truncated"],
)
def test_a_model_the_frontend_refuses_gets_the_same_error_sandboxed(
        data: Any, encoding: GraphEncoding) -> None:
    backend = _openvino_backend()
    with pytest.raises(InvalidEncodingError, match=r"^openvino: cannot read the model\.") \
            as in_process:
        backend.load([data()], encoding, CPU)
    with pytest.raises(InvalidEncodingError) as sandboxed:
        load_sandboxed(backend, [data()], encoding, CPU)
    # (OpenVINO names the model's file, in a private folder of its own each time)
    private = re.compile(r"/\S*/wasinn-ov-[\w-]+/")
    assert (private.sub("DIR/", sandboxed.value.message)
            == private.sub("DIR/", in_process.value.message))
    assert sandbox_children() == []


def test_a_frontend_crash_in_a_sandbox_process_ends_only_that_process() -> None:
    # relu_tflite with its operator's output count (byte 224) set to 3 crashes OpenVINO's
    # TFLite frontend with SIGSEGV (test_backend_openvino.py, "unchecked"); the backend
    # loaded here turns the flatbuffer check, which refuses the bytes, off.
    # Before: "cannot start a process to read the model.tflite in" (BackendRuntimeError).
    from tests.unchecked_tflite_backend import UncheckedTfliteBackend

    data = bytearray(relu_tflite())
    assert data[224] == 1
    data[224] = 3
    with pytest.raises(InvalidEncodingError, match=(
            r"^openvino: the process loading the model was killed by SIGSEGV: the library "
            r"crashed on it \(the host goes on\)$")):
        load_sandboxed(UncheckedTfliteBackend(), [bytes(data)], GraphEncoding.TENSORFLOWLITE,
                       CPU)
    assert sandbox_children() == []


def _tflite_relu_guest_wat(model: bytes) -> str:
    """A core-module guest that loads ``model`` (TFLite, CPU) from its own bytes, computes
    relu([-1, 2, -3, 4]) and exits with 0 where the output is [0, 2, 0, 4] in 16 bytes;
    100, 200, 300, 400 or 500 + the error where load, init_execution_context, set_input,
    compute or get_output fails; 1 for another output."""
    mem = bytearray(768)
    struct.pack_into("<2I", mem, 0, 4096, len(model))            # the builder
    struct.pack_into("<2IB3xII", mem, 128, 256, 2, 1, 512, 16)   # x: f32[1, 4]
    struct.pack_into("<2I", mem, 256, 1, 4)
    struct.pack_into("<4f", mem, 512, *X.reshape(-1))
    struct.pack_into("<4f", mem, 704, *np.maximum(X, 0).reshape(-1))  # expected
    data = "".join(f"\\{b:02x}" for b in mem)
    esc = "".join(f"\\{b:02x}" for b in model)
    fail = "(if (local.get $e) (then (call $exit (i32.add (i32.const {}) (local.get $e)))))"
    return f"""(module
  (import "wasi_ephemeral_nn" "load" (func $load (param i32 i32 i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "init_execution_context"
    (func $init (param i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "set_input" (func $set (param i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "compute" (func $compute (param i32) (result i32)))
  (import "wasi_ephemeral_nn" "get_output"
    (func $get (param i32 i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
  (memory (export "memory") 2)
  (data (i32.const 0) "{data}")
  (data (i32.const 4096) "{esc}")
  (func (export "_start") (local $e i32)
    (local.set $e (call $load (i32.const 0) (i32.const 1) (i32.const 4) (i32.const 0)
                              (i32.const 64)))
    {fail.format(100)}
    (local.set $e (call $init (i32.load (i32.const 64)) (i32.const 68)))
    {fail.format(200)}
    (local.set $e (call $set (i32.load (i32.const 68)) (i32.const 0) (i32.const 128)))
    {fail.format(300)}
    (local.set $e (call $compute (i32.load (i32.const 68))))
    {fail.format(400)}
    (local.set $e (call $get (i32.load (i32.const 68)) (i32.const 0) (i32.const 640)
                             (i32.const 16) (i32.const 660)))
    {fail.format(500)}
    (call $exit (i32.or (i32.or (i64.ne (i64.load (i32.const 640)) (i64.load (i32.const 704)))
                                (i64.ne (i64.load (i32.const 648)) (i64.load (i32.const 712))))
                        (i32.ne (i32.load (i32.const 660)) (i32.const 16))))))"""


async def test_a_guest_loads_a_tflite_model_under_the_default_sandbox(tmp_path: Path) -> None:
    # The default [guests] sandbox = "cpu". Before: load failed with runtime_error
    # (exit 105), "cannot start a process to read the model.tflite in: [Errno 13]
    # Permission denied: '/dev/null'".
    guest = tmp_path / "tflite_relu.wat"
    guest.write_text(_tflite_relu_guest_wat(relu_tflite()))
    async with wasinn.Runtime(no_spares(cpu_pool(backends=["openvino"]))) as rt:
        assert rt.config.guests.sandbox == "cpu"
        assert await rt.run_wasm(guest) == 0
        assert sandbox_children() == []  # the guest's graph went with the guest
