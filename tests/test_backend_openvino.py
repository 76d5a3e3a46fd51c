"""OpenVINO specifics: IR, TensorFlow and TFLite frontends, precision, i64, device names."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests import backend_models
from tests.support import armed_cancellation, require_backend
from tests.tfmodels import (
    FRONTEND_ARGS,
    FRONTEND_CASES,
    FRONTEND_IDS,
    relu_graphdef,
    relu_tflite,
)
from wasinn import (
    BackendRuntimeError,
    ExecutionTarget,
    GraphEncoding,
    InvalidArgumentError,
    InvalidEncodingError,
    Tensor,
    TensorType,
    UnsupportedOperationError,
)
from wasinn.backends import Device, LoadOptions
from wasinn.modelgen import affine_onnx, identity_onnx, onnx_model_bytes

pytestmark = pytest.mark.usefixtures("_openvino")

CPU = Device.parse("cpu")
X = np.array([[-1.0, 2.0, -3.0, 4.0]], np.float32)


@pytest.fixture
def _openvino() -> None:
    require_backend("openvino")


@pytest.fixture
def backend() -> Any:
    from wasinn.backends.openvino import OpenVinoBackend

    return OpenVinoBackend()


def test_ir_runs_from_xml_and_weights(backend: Any) -> None:
    builders, encoding = backend_models.affine_ir(2.0, 1.0)
    graph = backend.load(builders, encoding, CPU)
    assert [s.describe() for s in graph.inputs] == ["x: f32[?, 4]"]
    (out,) = graph.run({"x": Tensor.from_numpy(X)}).values()
    np.testing.assert_allclose(out.numpy(), X * 2 + 1)


def test_ir_files_given_the_wrong_way_round_are_named_so(backend: Any) -> None:
    (xml, weights), encoding = backend_models.affine_ir(2.0, 1.0)
    with pytest.raises(InvalidEncodingError,
                       match=r"the IR's two builders are the wrong way round \(the second is "
                             r"the XML\): expected the \.xml first, then the \.bin"):
        backend.load([weights, xml], encoding, CPU)


@pytest.mark.parametrize(FRONTEND_ARGS, FRONTEND_CASES, ids=FRONTEND_IDS)
def test_tensorflow_frontends_run(
    backend: Any, make: Any, encoding: GraphEncoding, in_name: str, out_name: str
) -> None:
    graph = backend.load([make()], encoding, CPU)
    assert [s.describe() for s in graph.inputs] == [f"{in_name}: f32[1, 4]"]
    assert [s.name for s in graph.outputs] == [out_name]
    out = graph.run({in_name: Tensor.from_numpy(X)})
    np.testing.assert_array_equal(out[out_name].numpy(), np.maximum(X, 0))
    # TensorFlow's "x:0" tensor names also answer to the node name "x".
    short = in_name.removesuffix(":0")
    np.testing.assert_array_equal(
        graph.run({short: Tensor.from_numpy(X)}, outputs=[out_name.removesuffix(":0")])[
            out_name].numpy(),
        np.maximum(X, 0),
    )


@pytest.mark.parametrize(
    ("builders", "encoding", "what"),
    [
        (lambda: [affine_onnx(), b""], GraphEncoding.OPENVINO,
         "declared openvino but its first builder is onnx"),
        (lambda: [affine_onnx()], GraphEncoding.OPENVINO, "declared openvino but its first "
                                                          "builder is onnx bytes"),
        (lambda: [backend_models.affine_ir(2.0, 1.0)[0][0]], GraphEncoding.ONNX,
         "declared onnx but its first builder is openvino"),
        (lambda: [backend_models.affine_ir(2.0, 1.0)[0][0], b"\x00" * 4], GraphEncoding.OPENVINO,
         "weights"),
        (lambda: [relu_tflite()[:40]], GraphEncoding.TENSORFLOWLITE, "model.tflite"),
        (lambda: [relu_graphdef()[:60]], GraphEncoding.TENSORFLOW, "model.pb"),
        (lambda: [relu_tflite()], GraphEncoding.TENSORFLOW, "declared tensorflow"),
        (lambda: [affine_onnx()], GraphEncoding.GGML, "cannot read ggml"),
    ],
    ids=["onnx-as-ir", "ir-one-builder", "ir-as-onnx", "ir-bad-weights", "tflite-truncated",
         "graphdef-truncated", "tflite-as-tf", "ggml"],
)
def test_mislabelled_or_broken_models_are_invalid_encoding(
    backend: Any, builders: Any, encoding: GraphEncoding, what: str
) -> None:
    with pytest.raises(InvalidEncodingError, match=r"^openvino: ") as info:
        backend.load(builders(), encoding, CPU)
    assert what in str(info.value)


def test_a_port_of_dynamic_rank_has_an_unknown_rank_not_rank_0(backend: Any) -> None:
    from wasinn.backends._ov_graph import _specs

    # The CPU plugin compiles no input of dynamic rank: the ports of the read model.
    shapeless = backend.core.read_model(backend_models.scalar_onnx(declared=False))
    (spec,), _ = _specs(shapeless.inputs, is_output=False)
    assert (spec.shape, spec.rank_known, spec.describe()) == ((), False, "x: f32[...]")
    scalar = backend.core.read_model(backend_models.scalar_onnx())
    (spec,), _ = _specs(scalar.inputs, is_output=False)
    assert (spec.shape, spec.rank_known, spec.describe()) == ((), True, "x: f32[]")


def test_inference_precision_defaults_to_f32(backend: Any) -> None:
    import openvino as ov

    graph = backend.load([affine_onnx()], GraphEncoding.ONNX, CPU)
    assert graph.compiled_model.get_property("INFERENCE_PRECISION_HINT") == ov.Type.f32
    plugin_default = backend.load([affine_onnx()], GraphEncoding.ONNX, CPU,
                                  LoadOptions(precision="default"))
    expected = backend.core.get_property("CPU", "INFERENCE_PRECISION_HINT")
    assert plugin_default.compiled_model.get_property("INFERENCE_PRECISION_HINT") == expected


def test_tf32_precision_is_read_as_f32(backend: Any) -> None:
    # NVIDIA's TensorFloat-32 (for the CUDA backends): OpenVINO has no such mode.
    import openvino as ov

    graph = backend.load([affine_onnx()], GraphEncoding.ONNX, CPU, LoadOptions(precision="TF32"))
    assert graph.compiled_model.get_property("INFERENCE_PRECISION_HINT") == ov.Type.f32


def test_i64_outside_the_i32_range_is_refused_not_truncated(backend: Any) -> None:
    graph = backend.load([identity_onnx(TensorType.I64)], GraphEncoding.ONNX, CPU)
    fits = np.array([[-(2**31), 0, 1, 2**31 - 1]], np.int64)
    np.testing.assert_array_equal(graph.run({"x": Tensor.from_numpy(fits)})["y"].numpy(), fits)
    with pytest.raises(InvalidArgumentError, match="outside the i32 range"):
        graph.run({"x": Tensor.from_numpy(np.array([[2**40, 0, 0, 0]], np.int64))})


def test_keep_on_device_returns_ov_tensors(backend: Any) -> None:
    import openvino as ov

    graph = backend.load([affine_onnx(2.0, 1.0)], GraphEncoding.ONNX, CPU)
    first = graph.run({"x": Tensor.from_numpy(X)}, keep_on_device=True)["y"]
    second = graph.run({"x": Tensor.from_numpy(X * 0)}, keep_on_device=True)["y"]
    assert isinstance(first.native, ov.Tensor)
    # A later run must not overwrite an earlier run's native output.
    np.testing.assert_allclose(first.numpy(), X * 2 + 1)
    np.testing.assert_allclose(second.numpy(), np.ones_like(X))


class _HostMemoryContext:
    """Stands in for a device's remote context, which the CPU lacks: its "device memory"
    is host ``ov.Tensor`` s, so that which outputs are allocated there, and how they
    chain, can be checked on the CPU (the real one needs an Intel GPU or NPU)."""

    def __init__(self) -> None:
        self.created: list[Any] = []

    def create_tensor(self, type: Any, shape: Any, properties: dict[str, Any]) -> Any:
        import openvino as ov

        assert properties == {}  # the device's default memory
        tensor = ov.Tensor(type, shape)
        self.created.append(tensor)
        return tensor


def test_the_cpu_has_no_remote_context(backend: Any) -> None:
    graph = backend.load([affine_onnx()], GraphEncoding.ONNX, CPU)
    assert graph.remote_context is None
    graph.run({"x": Tensor.from_numpy(X)}, keep_on_device=True)  # request-owned outputs


def test_kept_outputs_live_in_the_devices_remote_context_and_chain(backend: Any) -> None:
    import openvino as ov

    from wasinn.backends import _ov_graph

    graph = backend.load([affine_onnx(2.0, 1.0)], GraphEncoding.ONNX, CPU)
    graph.remote_context = context = _HostMemoryContext()
    graph._device_outputs = _ov_graph._device_outputs(graph.compiled_model)
    # y is (n, 4): its shape is learned from a first run on x's dimensions.
    learning = graph.run({"x": Tensor.from_numpy(X)}, keep_on_device=True)["y"]
    assert context.created == [] and isinstance(learning.native, ov.Tensor)
    first = graph.run({"x": Tensor.from_numpy(X)}, keep_on_device=True)["y"]
    assert len(context.created) == 1 and first.native is context.created[0]
    chained = graph.run({"x": first}, keep_on_device=True)["y"]  # set as it is
    assert len(context.created) == 2 and chained.native is context.created[1]
    # Other dimensions: learned anew, then allocated in device memory too.
    three = Tensor.from_numpy(np.concatenate([X, X, X]))
    graph.run({"x": three}, keep_on_device=True)
    assert len(context.created) == 2
    assert graph.run({"x": three}, keep_on_device=True)["y"].dims == (3, 4)
    assert len(context.created) == 3
    np.testing.assert_allclose(chained.numpy(), (X * 2 + 1) * 2 + 1)
    np.testing.assert_allclose(first.numpy(), X * 2 + 1)  # not overwritten by the chain
    rows = first.slice_rows(0, 1)
    assert rows.native is not None and not rows.is_host
    np.testing.assert_allclose(rows.numpy(), X * 2 + 1)
    graph.run({"x": Tensor.from_numpy(X)})  # host outputs: nothing allocated there
    assert len(context.created) == 3


class _DeviceMemory:
    """What an ``ov.RemoteTensor`` offers: a shape, ``copy_to`` and a region-of-interest
    constructor; no ``.data`` and no ``.shape``."""

    def __init__(self, source: Any, begin: Any = None, end: Any = None) -> None:
        array = source if isinstance(source, np.ndarray) else source._array
        if begin is not None:
            array = array[begin[0]:end[0]]
        self._array = array
        self.copies = 0

    def get_shape(self) -> Any:
        import openvino as ov

        return ov.Shape(self._array.shape)

    def copy_to(self, host: Any) -> None:
        self.copies += 1
        host.data[...] = self._array


def test_device_memory_is_read_by_one_copy_and_cut_into_remote_rows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import openvino as ov

    from wasinn.backends import _ov_tensors

    monkeypatch.setattr(ov, "RemoteTensor", _DeviceMemory)
    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    memory = _DeviceMemory(rows)
    kept = _ov_tensors._native(memory, TensorType.F32, "gpu:0", owner=None)
    assert kept.dims == (3, 4) and not kept.is_host
    middle = kept.slice_rows(1, 3)
    assert isinstance(middle.native, _DeviceMemory) and middle.dims == (2, 4)
    np.testing.assert_array_equal(middle.numpy(), rows[1:3])
    np.testing.assert_array_equal(kept.numpy(), rows)
    assert memory.copies == 1
    # Set as an input on its own device, as it is, by its port's name; elsewhere, a copy.
    assert _ov_tensors._ov_tensor(kept, "gpu:0", "x") is memory
    assert isinstance(_ov_tensors._ov_tensor(kept, "gpu:1", "x"), ov.Tensor)


def test_device_memory_inputs_are_set_by_name(backend: Any) -> None:
    class Request:
        def __init__(self) -> None:
            self.set: list[tuple[str, object]] = []

        def set_tensor(self, name: str, value: object) -> None:
            self.set.append((name, value))

    graph = backend.load([affine_onnx()], GraphEncoding.ONNX, CPU)
    request, memory = Request(), _DeviceMemory(X)
    graph._set_remote_input(request, 0, memory)
    assert request.set == [("x", memory)]
    graph._input_ports = (None,)  # a port with no name cannot take device memory
    with pytest.raises(InvalidArgumentError, match="no name OpenVINO can bind"):
        graph._set_remote_input(request, 0, memory)


def test_a_run_that_fails_before_inference_is_a_runtime_error(backend: Any) -> None:
    import openvino as ov

    graph = backend.load([affine_onnx()], GraphEncoding.ONNX, CPU)
    wrong = ov.Tensor(np.ones((1, 4), np.float64))  # f64 where the model takes f32
    tensor = Tensor.from_native(wrong, (1, 4), TensorType.F32, device="cpu",
                                materialize=lambda: X)
    with pytest.raises(BackendRuntimeError, match="run failed"):
        graph.run({"x": tensor}, keep_on_device=True)


def test_kept_outputs_stay_in_intel_gpu_memory(backend: Any) -> None:
    import openvino as ov

    from tests.support import skip_unless

    gpus = [d for d in backend.devices() if d.kind is ExecutionTarget.GPU]
    skip_unless("openvino-gpu", bool(gpus),
                "OpenVINO sees no Intel GPU here (its GPU plugin supports Intel GPUs only)")
    gpu = gpus[0]  # gpu:1 beside one CUDA GPU
    graph = backend.load([affine_onnx(2.0, 1.0)], GraphEncoding.ONNX, gpu)
    assert graph.remote_context is not None
    graph.run({"x": Tensor.from_numpy(X)}, keep_on_device=True)  # y's shape: (n, 4)
    first = graph.run({"x": Tensor.from_numpy(X)}, keep_on_device=True)["y"]
    assert isinstance(first.native, ov.RemoteTensor) and not first.is_host
    chained = graph.run({"x": first}, keep_on_device=True)["y"]
    assert isinstance(chained.native, ov.RemoteTensor)
    np.testing.assert_allclose(chained.numpy(), (X * 2 + 1) * 2 + 1)
    np.testing.assert_allclose(first.slice_rows(0, 1).numpy(), X * 2 + 1)


class _FakeCore:
    """Stands in for ov.Core to test the device-name mapping only: its GPUs are Intel's."""

    def __init__(self, names: list[str]) -> None:
        self.available_devices = names

    def get_property(self, name: str, key: str) -> str:
        assert name.startswith("GPU"), name  # only GPUs are asked
        return {"DEVICE_ARCHITECTURE": "GPU: vendor=0x8086 arch=v12.0.0",
                "FULL_DEVICE_NAME": "Intel(R) UHD Graphics 630 (iGPU)"}[key]


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (["CPU"], ["cpu"]),
        (["CPU", "GPU"], ["cpu", "gpu:0"]),
        (["CPU", "GPU.0", "GPU.1", "NPU"], ["cpu", "gpu:0", "gpu:1", "tpu:0"]),
        (["CPU", "GNA", "HETERO"], ["cpu"]),
    ],
)
def test_device_names_map_onto_wasi_nn_targets(
    backend: Any, names: list[str], expected: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from wasinn.backends import cuda

    monkeypatch.setattr(cuda, "device_count", lambda: 0)  # no CUDA GPU: GPU.N is gpu:N
    backend._core = _FakeCore(names)
    assert [d.name for d in backend.devices()] == expected


def test_a_device_openvino_lacks_is_unsupported(backend: Any) -> None:
    with pytest.raises(UnsupportedOperationError, match="no device gpu:3"):
        backend.load([affine_onnx()], GraphEncoding.ONNX, Device.parse("gpu:3"))


def test_extra_options_pass_through_when_openvino_knows_them(backend: Any) -> None:
    options = LoadOptions(extra={"PERFORMANCE_HINT": "THROUGHPUT", "optimize": False})
    graph = backend.load([affine_onnx()], GraphEncoding.ONNX, CPU, options)
    assert str(graph.compiled_model.get_property("PERFORMANCE_HINT")).endswith("THROUGHPUT")


def test_a_misspelt_property_is_refused_with_the_closest_name(backend: Any) -> None:
    options = LoadOptions(extra={"PERFORMANCE_HNT": "LATENCY"})
    with pytest.raises(InvalidArgumentError,
                       match=r"'PERFORMANCE_HNT' is not an OpenVINO property: did you mean "
                             r"PERFORMANCE_HINT\? expected one CPU reads \(.*NUM_STREAMS"):
        backend.load([affine_onnx()], GraphEncoding.ONNX, CPU, options)


@pytest.mark.parametrize(("extra", "said"), [
    ({"PERFORMANCE_HINT": "BOGUS"}, r"(?s)CPU refused option\(s\) PERFORMANCE_HINT='BOGUS': .*"
                                    r"expected values the device takes"),
    ({"NUM_STREAMS": -5}, r"CPU refused option\(s\) NUM_STREAMS=-5: "),
    ({"FULL_DEVICE_NAME": "x"}, r"option 'FULL_DEVICE_NAME' is a property CPU reports, not "
                                r"one it is given: expected one it reads \(.*NUM_STREAMS"),
])
def test_an_option_value_the_device_refuses_is_an_invalid_argument(
        backend: Any, extra: dict[str, Any], said: str) -> None:
    # Not InvalidEncodingError: the model is fine, and compiles without the option.
    with pytest.raises(InvalidArgumentError, match=said):
        backend.load([affine_onnx()], GraphEncoding.ONNX, CPU, LoadOptions(extra=extra))


def test_another_devices_property_is_left_out_with_a_warning(
        backend: Any, caplog: pytest.LogCaptureFixture) -> None:
    from wasinn.backends.openvino import known_properties

    assert "GPU_HOST_TASK_PRIORITY" in known_properties()  # the GPU plugin's
    options = LoadOptions(extra={"GPU_HOST_TASK_PRIORITY": "HIGH"})
    with caplog.at_level(logging.WARNING, logger="wasinn"):
        graph = backend.load([affine_onnx()], GraphEncoding.ONNX, CPU, options)
    assert "option GPU_HOST_TASK_PRIORITY is not a property of CPU: left out" in caplog.text
    (out,) = graph.run({"x": Tensor.from_numpy(X)}).values()
    np.testing.assert_allclose(out.numpy(), X * 2 + 1)


# -- cancellation -------------------------------------------------------------------------
def test_a_cancel_between_the_hook_and_the_run_is_not_lost(backend: Any) -> None:
    """The canceller fires after the run's first check, as the backend hooks
    ``InferRequest.cancel`` to the run's cancellation, before the run begins: OpenVINO
    ignores a cancel on a request that is not running, so the backend must look again."""
    from tests.loop_model import LONG_LOOP, loop_inputs, loop_onnx
    from wasinn.backends.base import Cancellation, running_under

    class CancelledAsHooked(Cancellation):
        def on_cancel(self, callback: Any) -> Any:
            forget = super().on_cancel(callback)
            self.cancel()  # the other thread's cancel lands exactly here
            return forget

    graph = backend.load([loop_onnx()], GraphEncoding.ONNX, CPU)
    inputs = {k: Tensor.from_numpy(v) for k, v in loop_inputs(LONG_LOOP).items()}
    with running_under(CancelledAsHooked()), \
            pytest.raises(BackendRuntimeError, match=r"^openvino: run cancelled \("):
        graph.run(inputs)
    # The next run, under no cancellation, goes to its end.
    (out,) = graph.run({k: Tensor.from_numpy(v) for k, v in loop_inputs(3).items()}).values()
    assert out.numpy().tolist() == [[3.0] * 4]


def test_a_cancelled_run_stops_with_a_runtime_error(backend: Any) -> None:
    import threading
    import time

    from tests.test_cancel_runs import OV_ROWS, OV_SIZE, OV_STEPS, matmul_chain_onnx
    from wasinn import BackendRuntimeError
    from wasinn.backends.base import Cancellation, running_under

    graph = backend.load([matmul_chain_onnx(OV_STEPS, OV_SIZE)], GraphEncoding.ONNX, CPU)
    big = {"x": Tensor.from_numpy(np.ones((OV_ROWS, OV_SIZE), np.float32))}
    cancellation = armed_cancellation()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with running_under(cancellation):
                graph.run(big)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    # The run registered InferRequest.cancel: its infer (tens of seconds of work) starts.
    assert cancellation.armed.wait(30), "the run never reached its infer request"
    # ...and is under way once OpenVINO's threads compute (nothing else here does), so
    # that this test sees the first cancel() stop it (InferRequest.cancel ignores an idle
    # request: one that early is caught by the repeats, see the next test module).
    armed_at = time.process_time()
    while time.process_time() - armed_at < 0.2 and thread.is_alive():
        time.sleep(0.01)
    cancellation.cancel()
    thread.join(timeout=30)
    assert not thread.is_alive(), "InferRequest.cancel did not stop the run"
    (error,) = errors
    assert isinstance(error, BackendRuntimeError), error
    # Stopped by InferRequest.cancel, not refused before the infer started.
    assert "openvino: run cancelled (" in error.message, error.message
    assert "before it started" not in error.message
    # The cancelled request is retired: later runs (one row: quick) are unaffected.
    one = np.ones((1, OV_SIZE), np.float32)
    for _ in range(2):
        with running_under(Cancellation()):
            (y,) = graph.run({"x": Tensor.from_numpy(one)}).values()
            np.testing.assert_array_equal(y.numpy(), one)


def test_a_run_under_an_already_cancelled_cancellation_does_not_run(backend: Any) -> None:
    from wasinn import BackendRuntimeError
    from wasinn.backends.base import Cancellation, running_under

    graph = backend.load([identity_onnx(TensorType.F32)], GraphEncoding.ONNX, CPU)
    cancellation = Cancellation()
    cancellation.cancel()
    with running_under(cancellation), pytest.raises(BackendRuntimeError, match="cancelled"):
        graph.run({"x": Tensor.from_numpy(X)})


# -- defences against hostile model bytes -------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]

#: A host process that loads relu_tflite with byte 224 (its operator's output count) set
#: to 3: the operator then also writes the subgraph's input. ``unchecked`` leaves out the
#: flatbuffer check, so that only the throw-away reader process stands between the bytes
#: and the host.
_HOST = """
import sys
import wasinn.backends._ovread as ovread
from tests.tfmodels import relu_tflite
from wasinn import GraphEncoding, WasiNNError
from wasinn.backends import Device
from wasinn.backends.openvino import OpenVinoBackend

if sys.argv[1] == "unchecked":
    ovread.check_tflite = lambda data: None
data = bytearray(relu_tflite())
assert data[224] == 1
data[224] = 3
try:
    OpenVinoBackend().load([bytes(data)], GraphEncoding.TENSORFLOWLITE, Device.parse("cpu"))
    print("loaded")
except WasiNNError as exc:
    print(type(exc).__name__, exc)
"""


@pytest.mark.parametrize(("mode", "what"), [
    ("checked", "tensor 0 is written by more than one operator"),
    ("unchecked", ""),  # the frontend's own message, or the crash of the reader process
])
def test_tflite_bytes_that_crashed_the_host_are_an_invalid_encoding(mode: str, what: str) -> None:
    # Before: OpenVINO's TFLite frontend read wild memory in the host: SIGSEGV (rc -11).
    done = subprocess.run([sys.executable, "-c", _HOST, mode], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(
        "InvalidEncodingError openvino: cannot read the model.tflite: "), done.stdout
    assert what in done.stdout


def _patched(offset: int, old: int, new: int) -> bytes:
    data = bytearray(relu_tflite())
    assert data[offset] == old  # relu_tflite's layout (checked, so a change shows here)
    data[offset] = new
    return bytes(data)


@pytest.mark.parametrize(("data", "what"), [
    (lambda: _patched(236, 0, 7), "operators[0].inputs holds index 7, outside [-1, 2)"),
    (lambda: _patched(192, 0, 5), "subgraphs[0].inputs holds index 5, outside [0, 2)"),
    (lambda: _patched(220, 0, 5), "opcode_index is 5, outside the model's 1 operator codes"),
    (lambda: _patched(312, 1, 9), "tensors[0].buffer is 9, outside the model's 3 buffers"),
    (lambda: _patched(232, 1, 200), "lies outside the 344-byte model"),
    (lambda: _patched(3, 0, 1), "lies outside the 344-byte model"),
    (lambda: _patched(4, ord("T"), ord("X")), "no TFL3 file identifier"),
    (lambda: relu_tflite()[:120], "lies outside the 120-byte model"),
], ids=["op-input", "subgraph-input", "opcode", "buffer", "vector-length", "root-offset",
        "identifier", "truncated"])
def test_tflite_offsets_and_indices_are_checked_before_openvino_reads_them(
    backend: Any, data: Any, what: str
) -> None:
    # Before: no check; OpenVINO's frontend follows offsets and indices as they are.
    with pytest.raises(InvalidEncodingError, match=r"^openvino: cannot read the model.tflite: ") \
            as info:
        backend.load([data()], GraphEncoding.TENSORFLOWLITE, CPU)
    assert what in str(info.value)


@pytest.mark.parametrize(("script", "what"), [
    ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)",
     "OpenVINO's frontend crashed on it (SIGSEGV) in the throw-away process"),
    ("import time; time.sleep(60)", "reading it took over 1 s"),
    ("import sys; sys.stdout.write('bad model'); sys.exit(3)", "model.pb: bad model"),
    ("raise SystemExit('no openvino here')", "exited with status 1: no openvino here"),
])
def test_a_reader_process_that_crashes_hangs_or_refuses_is_an_invalid_encoding(
    backend: Any, monkeypatch: pytest.MonkeyPatch, script: str, what: str
) -> None:
    # Before: the TensorFlow frontends ran in the host, so a crash there killed it.
    import wasinn.backends._ovread as ovread

    monkeypatch.setattr(ovread, "_CONVERT", script)
    monkeypatch.setattr(ovread, "CONVERT_TIMEOUT_S", 1.0)
    with pytest.raises(InvalidEncodingError, match=r"^openvino: cannot read the model.pb: ") \
            as info:
        backend.load([relu_graphdef()], GraphEncoding.TENSORFLOW, CPU)
    assert what in str(info.value)


def _external_onnx(location: str, size: int) -> bytes:
    """``y = x + w`` over u8[size], where ``w`` is external data read from ``location``."""
    from onnx import TensorProto, helper

    w = TensorProto(name="w", data_type=TensorProto.UINT8, dims=[size],
                    data_location=TensorProto.EXTERNAL)
    for key, value in (("location", location), ("offset", "0"), ("length", str(size))):
        w.external_data.add(key=key, value=value)
    x = helper.make_tensor_value_info("x", TensorProto.UINT8, [size])
    y = helper.make_tensor_value_info("y", TensorProto.UINT8, [size])
    graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g", [x], [y],
                              initializer=[w])
    return onnx_model_bytes(graph)


def test_onnx_external_data_naming_a_host_file_is_a_security_error(
    backend: Any, tmp_path: Path
) -> None:
    # Before: OpenVINO read the file (absolute paths accepted) into the weights, and a run
    # handed its bytes to the guest.
    from wasinn import SecurityError

    secret = tmp_path / "api_key.txt"
    secret.write_bytes(b"SECRET-KEY-1234")
    with pytest.raises(SecurityError, match=r"^openvino: tensor 'w' refers to external data "
                       r".*must embed its weights"):
        backend.load([_external_onnx(str(secret), 15)], GraphEncoding.ONNX, CPU)


def _f64_add() -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    zero = numpy_helper.from_array(np.zeros(3, np.float64), "z")
    x = helper.make_tensor_value_info("x", TensorProto.DOUBLE, [3])
    y = helper.make_tensor_value_info("y", TensorProto.DOUBLE, [3])
    graph = helper.make_graph([helper.make_node("Add", ["x", "z"], ["y"])], "add64", [x], [y],
                              initializer=[zero])
    return onnx_model_bytes(graph)


def test_f64_beyond_the_f32_range_is_refused_and_f32_precision_is_announced(
    backend: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: 1e300 came back as 3.4e38 (and 123456789.123 as 123456792), silently.
    with caplog.at_level(logging.WARNING, logger="wasinn.backends"):
        graph = backend.load([_f64_add()], GraphEncoding.ONNX, CPU)
    warned = [r.getMessage() for r in caplog.records if "f64" in r.getMessage()]
    assert len(warned) == 1 and "f32 precision" in warned[0] and "'x', 'y'" in warned[0]
    fits = np.array([-3.0e38, np.inf, 0.5])
    out = graph.run({"x": Tensor.from_numpy(fits)})["y"].numpy()
    assert out[0] == pytest.approx(-3.0e38, rel=1e-7) and out[2] == 0.5
    with pytest.raises(InvalidArgumentError, match=r"input 'x': finite f64 values beyond the "
                       r"f32 range .* up to 3.402823e\+38"):
        graph.run({"x": Tensor.from_numpy(np.array([1.0, np.nan, 1e300]))})


def test_a_port_name_that_is_not_utf8_is_an_invalid_encoding(backend: Any) -> None:
    # Before: a raw UnicodeDecodeError from port.get_names() once the model had compiled.
    model = affine_onnx(in_name="xx")
    bad = model.replace(b"\x02xx", b"\x02\xfe\xff")
    assert bad != model
    with pytest.raises(InvalidEncodingError, match="openvino: cannot read the onnx model's "
                       "inputs and outputs: 'utf-8' codec can't decode"):
        backend.load([bad], GraphEncoding.ONNX, CPU)


def test_an_output_made_by_an_identity_keeps_the_models_name(backend: Any) -> None:
    # Exported models often end in Identity: compiling folds y = Identity(h) into h, and
    # the port carries {h, y}. The output is the model's y, as on ONNX Runtime.
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Relu", ["x"], ["h"]), helper.make_node("Identity", ["h"], ["y"])]
    graph = helper.make_graph(
        nodes, "relu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])])
    compiled = backend.load([onnx_model_bytes(graph)], GraphEncoding.ONNX, CPU)
    assert [spec.name for spec in compiled.outputs] == ["y"]
    x = np.array([[-1.0, 2.0, -3.0, 4.0]], np.float32)
    out = compiled.run({"x": Tensor.from_numpy(x)})
    assert list(out) == ["y"]
    np.testing.assert_array_equal(out["y"].numpy(), np.maximum(x, 0))


def test_a_devices_properties_are_asked_once_per_core(backend: Any) -> None:
    # OpenVINO keeps native memory for good each time SUPPORTED_PROPERTIES is asked: about
    # 3 KB a load (6.7 MB over 2,000 loads) when every load asked.
    from wasinn.backends import openvino

    class Core:  # counts what the real core is asked
        def __init__(self) -> None:
            self.asked = 0

        def get_property(self, device: str, name: str) -> Any:
            self.asked += 1
            return backend.core.get_property(device, name)

    core = Core()
    for _ in range(3):
        config = openvino.compile_config(core, "CPU", LoadOptions(extra={"NUM_STREAMS": 1}))
        assert config["NUM_STREAMS"] == 1
    assert core.asked == 1


def test_an_option_setting_what_precision_or_threads_set_is_refused(backend: Any) -> None:
    # Before: INFERENCE_PRECISION_HINT = "bf16" beside precision "f16" compiled in bf16,
    # without a word.
    for options, own in ((LoadOptions(precision="f16",
                                      extra={"INFERENCE_PRECISION_HINT": "bf16"}), "precision"),
                         (LoadOptions(threads=1, extra={"INFERENCE_NUM_THREADS": 2}), "threads")):
        with pytest.raises(InvalidArgumentError,
                           match=rf"^openvino: option 'INFERENCE_\w+' = .* and '{own}' both "
                                 rf"set it \(to .*\): expected '{own}' alone$"):
            backend.load([affine_onnx()], GraphEncoding.ONNX, CPU, options)
    # Where wasinn's own key leaves it alone, the property passes as given.
    graph = backend.load([affine_onnx()], GraphEncoding.ONNX, CPU,
                         LoadOptions(extra={"INFERENCE_NUM_THREADS": 1}))
    assert int(graph.compiled_model.get_property("INFERENCE_NUM_THREADS")) == 1


def test_onnx_bytes_declared_as_ir_are_named_onnx(backend: Any) -> None:
    # Before: "1 builder given: expected two builders", which did not say what the bytes were.
    with pytest.raises(InvalidEncodingError, match=r"^openvino: the model was declared openvino "
                                                   r"but its first builder is onnx bytes$"):
        backend.load([affine_onnx()], GraphEncoding.OPENVINO, CPU)


def test_a_boolean_output_is_refused_by_its_type_name(backend: Any) -> None:
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Greater", ["x", "x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TensorProto.BOOL, [3])])
    with pytest.raises(UnsupportedOperationError,
                       match="output 'y' has element type boolean, which wasi-nn cannot carry"):
        backend.load([onnx_model_bytes(graph)], GraphEncoding.ONNX, CPU)
