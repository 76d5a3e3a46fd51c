"""ONNX Runtime specifics: natives are OrtValues, bf16 through a uint16 carrier, options, CUDA."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from tests.backend_models import scalar_onnx
from tests.support import (
    armed_cancellation,
    require_backend,
    require_ort_gpu,
)
from wasinn import (
    GraphEncoding,
    InvalidArgumentError,
    InvalidEncodingError,
    Tensor,
    TensorType,
    UnsupportedOperationError,
)
from wasinn.backends import Device, LoadOptions, cuda
from wasinn.modelgen import affine_onnx, identity_onnx, onnx_model_bytes

pytestmark = pytest.mark.usefixtures("_ort")

CPU = Device.parse("cpu")
NAME = "onnxruntime"


@pytest.fixture
def _ort() -> None:
    require_backend("onnxruntime")


@pytest.fixture
def backend() -> Any:
    from wasinn.backends.onnxruntime import OnnxRuntimeBackend

    return OnnxRuntimeBackend()


def test_devices_start_with_the_cpu(backend: Any) -> None:
    import onnxruntime as ort

    devices = backend.devices()
    assert devices[0] == CPU
    # A gpu:N for each device the CUDA driver reports, where the CUDA provider is there.
    has_provider = "CUDAExecutionProvider" in ort.get_available_providers()
    gpus = cuda.device_count() if has_provider else 0
    assert devices[1:] == [Device.parse(f"gpu:{i}") for i in range(gpus)]


# -- GPU discovery ------------------------------------------------------------------------
def _with_cuda(monkeypatch: pytest.MonkeyPatch, provider: bool, count: int) -> None:
    """ONNX Runtime lists its CUDA provider (as onnxruntime-gpu does, GPU or not) or not,
    and the CUDA driver reports ``count`` devices."""
    import onnxruntime as ort

    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if provider else [
        "CPUExecutionProvider"]
    monkeypatch.setattr(ort, "get_available_providers", lambda: providers)
    monkeypatch.setattr(cuda, "device_count", lambda: count)


def test_each_device_the_cuda_driver_reports_is_a_gpu(
        backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    _with_cuda(monkeypatch, provider=True, count=2)
    assert [d.name for d in backend.devices()] == ["cpu", "gpu:0", "gpu:1"]


def test_the_cuda_provider_alone_reports_no_gpu_where_the_driver_reports_none(
        backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # onnxruntime-gpu on a machine without a GPU (or without the NVIDIA driver).
    _with_cuda(monkeypatch, provider=True, count=0)
    assert backend.devices() == [CPU]
    with pytest.raises(UnsupportedOperationError, match="no device gpu:0"):
        backend.load([affine_onnx()], GraphEncoding.ONNX, Device.parse("gpu:0"))


def test_gpus_without_the_cuda_provider_are_not_reported(
        backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    _with_cuda(monkeypatch, provider=False, count=2)
    assert backend.devices() == [CPU]


def test_a_cpu_load_does_not_ask_the_cuda_driver(
        backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # cuInit takes a while on a GPU machine: a CPU load (a sandbox process's) skips it.
    def asked() -> int:
        raise AssertionError("the CUDA driver was asked")

    monkeypatch.setattr(cuda, "device_count", asked)
    graph = backend.load([affine_onnx(2.0, 1.0)], GraphEncoding.ONNX, CPU)
    (y,) = graph.run({"x": Tensor.from_numpy(np.ones((2, 4), np.float32))}).values()
    np.testing.assert_allclose(y.numpy(), np.full((2, 4), 3.0))


def _driver_loads() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def test_the_cuda_device_count_is_a_count_and_none_without_a_driver() -> None:
    count = cuda.device_count()
    assert isinstance(count, int) and count >= 0
    if not _driver_loads() and ctypes.util.find_library("cuda") is None:
        assert count == 0  # no NVIDIA driver on this machine
    assert cuda.device_count() == count  # asked once, then cached


def test_a_driver_library_that_does_not_load_or_lacks_the_calls_counts_no_device() -> None:
    assert cuda.count_devices([]) == 0
    assert cuda.count_devices(["libwasinn-no-such-cuda-driver.so.1"]) == 0
    libc = ctypes.util.find_library("c")
    if libc is not None:  # a real library, loaded through ctypes, without cuInit
        assert cuda.count_devices([libc]) == 0
    assert cuda.driver_device_count(object()) == 0


class _Driver:
    """A stand-in for ``libcuda``: each call returns its CUresult (0 is success)."""

    def __init__(self, init: int = 0, get: int = 0, count: int = 0) -> None:
        self.results = {"cuInit": init, "cuDeviceGetCount": get}
        self.count = count
        self.calls: list[tuple[str, Any]] = []

    def cuInit(self, flags: int) -> int:
        self.calls.append(("cuInit", flags))
        return self.results["cuInit"]

    def cuDeviceGetCount(self, count: Any) -> int:
        self.calls.append(("cuDeviceGetCount", type(count).__name__))
        if self.results["cuDeviceGetCount"] == 0:
            count.contents.value = self.count
        return self.results["cuDeviceGetCount"]


def test_the_driver_is_initialized_then_asked_for_its_device_count() -> None:
    driver = _Driver(count=3)
    assert cuda.driver_device_count(driver) == 3
    assert driver.calls == [("cuInit", 0), ("cuDeviceGetCount", "LP_c_int")]


def test_a_driver_error_counts_no_device() -> None:
    no_device = _Driver(init=100, count=3)  # CUDA_ERROR_NO_DEVICE, from cuInit
    assert cuda.driver_device_count(no_device) == 0
    assert no_device.calls == [("cuInit", 0)]
    stub = _Driver(init=34, count=3)  # CUDA_ERROR_STUB_LIBRARY: the toolkit's stub
    assert cuda.driver_device_count(stub) == 0
    failed = _Driver(get=3, count=3)  # CUDA_ERROR_NOT_INITIALIZED, from the count
    assert cuda.driver_device_count(failed) == 0


# -- providers ----------------------------------------------------------------------------
def _cuda_options(options: LoadOptions, device: str = "gpu:1") -> dict[str, Any]:
    """The CUDA provider's options for a load with ``options`` on ``device``."""
    from wasinn.backends.onnxruntime import providers_for

    (name, cuda_options), fallback = providers_for(Device.parse(device), options)
    assert (name, fallback) == ("CUDAExecutionProvider", "CPUExecutionProvider")
    return dict(cuda_options)


def test_f32_precision_turns_the_cuda_providers_tf32_off() -> None:
    # LoadOptions' default: outputs agree with the CPU's, not rounded to a 10-bit mantissa.
    assert _cuda_options(LoadOptions()) == {"device_id": 1, "use_tf32": "0"}
    assert _cuda_options(LoadOptions(precision=" F32 ")) == {"device_id": 1, "use_tf32": "0"}


def test_tf32_precision_turns_the_cuda_providers_tf32_on() -> None:
    assert _cuda_options(LoadOptions(precision="tf32"), "gpu:0") == {
        "device_id": 0, "use_tf32": "1"}


def test_other_precisions_leave_the_cuda_providers_tf32_default() -> None:
    for precision in ("default", "f16", "bf16", ""):
        assert _cuda_options(LoadOptions(precision=precision)) == {"device_id": 1}


def test_provider_options_set_tf32_over_the_precision() -> None:
    given = {"use_tf32": "1", "gpu_mem_limit": "1048576"}
    for precision in ("f32", "default"):
        options = LoadOptions(precision=precision, extra={"provider_options": given})
        assert _cuda_options(options) == {"device_id": 1, **given}
    off = LoadOptions(precision="tf32", extra={"provider_options": {"use_tf32": "0"}})
    assert _cuda_options(off)["use_tf32"] == "0"


def test_a_provider_device_id_naming_another_gpu_is_refused(
        backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # The graph would compute on gpu:0 while its actor, outputs and stats said gpu:1.
    other = LoadOptions(extra={"provider_options": {"device_id": 0}})
    with pytest.raises(InvalidArgumentError, match=r"device_id = 0 names another GPU .*gpu:1"):
        _cuda_options(other)
    _with_cuda(monkeypatch, provider=True, count=2)  # refused as such by load, before ORT
    with pytest.raises(InvalidArgumentError, match="names another GPU"):
        backend.load([affine_onnx()], GraphEncoding.ONNX, Device.parse("gpu:1"), other)
    same = LoadOptions(extra={"provider_options": {"device_id": "1"}})
    assert _cuda_options(same)["device_id"] == "1"  # the graph's own: accepted as given


def test_the_cpu_gets_the_cpu_provider_alone_whatever_the_precision() -> None:
    from wasinn.backends.onnxruntime import providers_for

    for precision in ("f32", "tf32", "default"):
        assert providers_for(CPU, LoadOptions(precision=precision)) == ["CPUExecutionProvider"]


def test_keep_on_device_returns_ortvalues_that_bind_back(backend: Any) -> None:
    import onnxruntime as ort

    graph = backend.load([affine_onnx(2.0, 1.0)], GraphEncoding.ONNX, CPU)
    x = Tensor.from_numpy(np.ones((2, 4), np.float32))
    (out,) = graph.run({"x": x}, keep_on_device=True).values()
    assert isinstance(out.native, ort.OrtValue) and out.device == "cpu"
    (again,) = graph.run({"x": out}).values()
    np.testing.assert_allclose(again.numpy(), np.full((2, 4), 7.0))


def test_a_value_declared_without_a_shape_has_an_unknown_rank(backend: Any) -> None:
    # ONNX Runtime reports it as shape [], as it does a scalar: the model tells them apart.
    graph = backend.load([scalar_onnx(declared=False)], GraphEncoding.ONNX, CPU)
    specs = (*graph.inputs, *graph.outputs)
    assert [(s.shape, s.rank_known, s.describe()) for s in specs] == [
        ((), False, "x: f32[...]"), ((), False, "y: f32[...]")]
    for shape in [(), (3,), (2, 2)]:  # any rank is accepted
        (y,) = graph.run({"x": Tensor.from_numpy(np.full(shape, 3.0, np.float32))}).values()
        assert y.dims == shape and (y.numpy() == 6.0).all()
    scalar = backend.load([scalar_onnx()], GraphEncoding.ONNX, CPU)
    assert [(s.shape, s.rank_known) for s in (*scalar.inputs, *scalar.outputs)] == [
        ((), True), ((), True)]


def test_only_an_onnx_protobuf_is_read_for_undeclared_shapes() -> None:
    from wasinn.backends._ort_graph import _shapeless

    assert _shapeless(scalar_onnx(declared=False)) == {"x", "y"}
    assert _shapeless(scalar_onnx()) == frozenset()
    assert _shapeless(b"\xff\xff") == frozenset()  # no protobuf (an ORT-format model)


def test_bf16_values_keep_their_bits(backend: Any) -> None:
    graph = backend.load([identity_onnx(TensorType.BF16)], GraphEncoding.ONNX, CPU)
    arr = np.array([[1.5, -2.0, 3.0e38, 1.0e-30]], dtype=ml_dtypes.bfloat16)
    (out,) = graph.run({"x": Tensor.from_numpy(arr)}).values()
    assert out.numpy().dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(out.numpy().view(np.uint16), arr.view(np.uint16))


def test_a_type_outside_wasi_nn_is_unsupported(backend: Any) -> None:
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.BOOL, [2])
    y = helper.make_tensor_value_info("y", TensorProto.BOOL, [2])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y])
    with pytest.raises(UnsupportedOperationError, match=r"input 'x' has element type tensor\(bool"):
        backend.load([onnx_model_bytes(graph)], GraphEncoding.ONNX, CPU)


def test_options_reach_the_session(backend: Any) -> None:
    options = LoadOptions(threads=1, extra={"session.intra_op.allow_spinning": "0"})
    graph = backend.load([affine_onnx()], GraphEncoding.ONNX, CPU, options)
    so = graph.session.get_session_options()
    assert so.intra_op_num_threads == 1
    assert so.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert graph.session.get_providers() == ["CPUExecutionProvider"]


def test_every_area_of_session_config_entries_reaches_the_session(backend: Any) -> None:
    extra = {"optimization.enable_gelu_approximation": True, "mlas.use_lut_gemm": "0",
             "ep.context_enable": "0"}
    graph = backend.load([affine_onnx()], GraphEncoding.ONNX, CPU, LoadOptions(extra=extra))
    so = graph.session.get_session_options()
    assert [so.get_session_config_entry(key) for key in extra] == ["1", "0", "0"]


def test_an_entry_onnx_runtime_is_not_known_to_read_is_passed_on_with_a_warning(
        backend: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    # A newer ONNX Runtime may read it; this one would ignore it without a word.
    from wasinn.backends import _ort_session
    monkeypatch.setattr(_ort_session, "_warned", set())
    key = "session.an_entry_from_the_future"
    with caplog.at_level(logging.WARNING, logger="wasinn.backends"):
        graph = backend.load([affine_onnx()], GraphEncoding.ONNX, CPU,
                             LoadOptions(extra={key: "1"}))
        backend.load([affine_onnx()], GraphEncoding.ONNX, CPU, LoadOptions(extra={key: "1"}))
    assert graph.session.get_session_options().get_session_config_entry(key) == "1"
    said = [r.getMessage() for r in caplog.records if key in r.getMessage()]
    assert len(said) == 1  # once in a process
    assert "is not a session config entry ONNX Runtime reads (as of version 1.31" in said[0]
    assert "ignored unless this version reads it" in said[0]


def test_intra_op_threads_stop_spinning_when_a_run_returns_unless_told_otherwise(
        backend: Any) -> None:
    # Spinning threads left behind by one session slow the next model's run (module doc).
    key = "session.force_spinning_stop"
    graph = backend.load([affine_onnx()], GraphEncoding.ONNX, CPU)
    assert graph.session.get_session_options().get_session_config_entry(key) == "1"
    kept = backend.load([affine_onnx()], GraphEncoding.ONNX, CPU, LoadOptions(extra={key: "0"}))
    assert kept.session.get_session_options().get_session_config_entry(key) == "0"


def test_a_missing_device_is_unsupported(backend: Any) -> None:
    with pytest.raises(UnsupportedOperationError, match="no device tpu:0"):
        backend.load([affine_onnx()], GraphEncoding.ONNX, Device.parse("tpu:0"))


@pytest.mark.gpu
def test_cuda_provider_runs_and_keeps_outputs_on_the_gpu(backend: Any) -> None:
    require_ort_gpu(backend)  # onnxruntime-gpu and a GPU the CUDA driver reports, no torch
    gpu = Device.parse("gpu:0")
    first = backend.load([affine_onnx(2.0, 1.0, out_name="y")], GraphEncoding.ONNX, gpu)
    second = backend.load([affine_onnx(3.0, 0.0, in_name="y", out_name="z")],
                          GraphEncoding.ONNX, gpu)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    (mid,) = first.run({"x": Tensor.from_numpy(x)}, keep_on_device=True).values()
    assert mid.device == "gpu:0" and mid.native.device_name().lower() == "cuda"
    (out,) = second.run({"y": mid}).values()
    np.testing.assert_allclose(out.numpy(), (x * 2 + 1) * 3)


# -- cancellation -------------------------------------------------------------------------
def _run_in_thread(fn: Any) -> tuple[Any, list[BaseException]]:
    import threading

    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, errors


@pytest.mark.parametrize("keep_on_device", [False, True], ids=["run", "iobinding"])
def test_a_cancelled_run_stops_with_a_runtime_error(backend: Any, keep_on_device: bool) -> None:
    from tests.loop_model import loop_inputs, loop_onnx
    from wasinn import BackendRuntimeError
    from wasinn.backends.base import Cancellation, running_under

    graph = backend.load([loop_onnx()], GraphEncoding.ONNX, CPU)
    # ~30 s of work here: long enough to fail (not hang) if the cancel were ignored.
    inputs = {k: Tensor.from_numpy(v) for k, v in loop_inputs(50_000_000).items()}
    cancellation = armed_cancellation()

    def run() -> None:
        with running_under(cancellation):
            graph.run(inputs, keep_on_device=keep_on_device)

    thread, errors = _run_in_thread(run)
    # The run registered its terminate flag: ONNX Runtime's run is starting (the flag
    # stops it at its start or between two nodes or Loop iterations alike).
    assert cancellation.armed.wait(15), "the run never reached ONNX Runtime"
    cancellation.cancel()
    thread.join(timeout=15)
    assert not thread.is_alive(), "the terminate flag did not stop the run"
    (error,) = errors
    assert isinstance(error, BackendRuntimeError), error
    assert "onnxruntime: run cancelled" in error.message, error.message
    # The graph is still usable, with or without a cancellation.
    small = {k: Tensor.from_numpy(v) for k, v in loop_inputs(3).items()}
    assert graph.run(small)["y"].numpy().tolist() == [[3.0] * 4]
    with running_under(Cancellation()):
        assert graph.run(small)["y"].numpy().tolist() == [[3.0] * 4]


def test_a_run_under_an_already_cancelled_cancellation_does_not_run(backend: Any) -> None:
    from tests.loop_model import loop_inputs, loop_onnx
    from wasinn import BackendRuntimeError
    from wasinn.backends.base import Cancellation, running_under

    graph = backend.load([loop_onnx()], GraphEncoding.ONNX, CPU)
    cancellation = Cancellation()
    cancellation.cancel()
    inputs = {k: Tensor.from_numpy(v) for k, v in loop_inputs(10_000_000).items()}
    with running_under(cancellation), pytest.raises(BackendRuntimeError, match="cancelled"):
        graph.run(inputs)  # seconds of work if the flag were not read at the start


def test_cancellable_run_options_answer_the_graph_id_lookup_without_an_exception() -> None:
    # run_with_iobinding (pipelines, kept outputs, GPU runs) asks the run options for
    # "gpu_graph_id" on every run; a missing entry is a C++ exception each time (25-50 us,
    # benchmarks/pipeline.py). The value set is the one an unset entry stands for.
    from wasinn.backends._ort_cancel import _run_options

    assert _run_options().get_run_config_entry("gpu_graph_id") == "0"


# -- defences against hostile model bytes -------------------------------------------------
def _external(name: str, location: str, *, mark: bool = True) -> Any:
    """A u8[15] TensorProto whose data is ``location``'s first 15 bytes (``mark``: with
    data_location EXTERNAL; without, the external_data entries alone)."""
    from onnx import TensorProto

    tensor = TensorProto(name=name, data_type=TensorProto.UINT8, dims=[15])
    if mark:
        tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", "15")):
        tensor.external_data.add(key=key, value=value)
    return tensor


def _model(nodes: list[Any], initializer: tuple[Any, ...] = (), **graph: Any) -> bytes:
    """A graph x (u8[15]) -> ``nodes`` -> y, with the opsets of :func:`_placements`."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.UINT8, [15])
    y = helper.make_tensor_value_info("y", TensorProto.UINT8, [15])
    body = helper.make_graph(nodes, "g", [x], [y], initializer=list(initializer), **graph)
    model = helper.make_model(body, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid("local", 1)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


def _placements() -> dict[str, bytes]:
    """A model per place onnx.proto lets a TensorProto refer to external data."""
    from onnx import ModelProto, SparseTensorProto, TensorProto, helper

    add = helper.make_node("Add", ["x", "w"], ["y"])
    const = helper.make_node("Constant", [], ["w"], value=_external("w", "key.txt"))
    indices = helper.make_tensor("i", TensorProto.INT64, [15], list(range(15)))
    sparse = SparseTensorProto(values=_external("w", "key.txt"), indices=indices, dims=[15])
    branch = helper.make_graph([helper.make_node("Identity", ["w"], ["b"])], "then", [],
                               [helper.make_tensor_value_info("b", TensorProto.UINT8, [15])],
                               initializer=[_external("w", "key.txt")])
    cond = helper.make_tensor("c", TensorProto.BOOL, [], [True])
    if_node = helper.make_node("If", ["c"], ["w"], then_branch=branch, else_branch=branch)
    function = helper.make_function("local", "F", [], ["w"], [const], [
        helper.make_opsetid("", 17)])
    call = helper.make_node("F", [], ["w"], domain="local")
    with_function = ModelProto.FromString(_model([call, add]))
    with_function.functions.append(function)
    return {
        "initializer": _model([add], (_external("w", "key.txt"),)),
        "entries-only": _model([add], (_external("w", "key.txt", mark=False),)),
        "constant": _model([const, add]),
        "sparse": _model([add], sparse_initializer=[sparse]),
        "subgraph": _model([if_node, add], (cond,)),
        "function": bytes(with_function.SerializeToString()),
    }


@pytest.mark.parametrize("place", ["initializer", "entries-only", "constant", "sparse",
                                   "subgraph", "function"])
def test_external_data_anywhere_in_the_model_is_a_security_error(
    backend: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, place: str
) -> None:
    # Before: ONNX Runtime read key.txt from the host's working directory into the model.
    from wasinn import SecurityError

    (tmp_path / "key.txt").write_bytes(b"SECRET-KEY-1234")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SecurityError, match=r"^onnxruntime: tensor 'w' refers to external "
                       r"data \(location 'key.txt'\).*must embed its weights"):
        backend.load([_placements()[place]], GraphEncoding.ONNX, CPU)


def test_a_path_out_of_the_working_directory_is_refused_before_onnx_runtime_reads_it(
    backend: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: '..' segments were resolved against the host's cwd; the guest got the bytes.
    from onnx import helper

    from wasinn import SecurityError

    (tmp_path / "private").mkdir()
    (tmp_path / "private" / "key.txt").write_bytes(b"SECRET-KEY-1234")
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    model = _model([helper.make_node("Add", ["x", "w"], ["y"])],
                   (_external("w", "../private/key.txt"),))
    with pytest.raises(SecurityError, match=r"'\.\./private/key\.txt'"):
        backend.load([model], GraphEncoding.ONNX, CPU)


def test_embedded_weights_are_walked_without_a_security_error(
    backend: Any, small_mobilenet: Any
) -> None:
    from wasinn.backends._onnx_check import check_external_data

    assert check_external_data(NAME, small_mobilenet.onnx.read_bytes()) == frozenset()
    with pytest.raises(InvalidEncodingError, match="not a well-formed protobuf"):
        check_external_data(NAME, b"\x0a\x10abc")


def test_names_that_are_not_utf8_are_an_invalid_encoding_without_a_fallback_banner(
    backend: Any, capfd: pytest.CaptureFixture[str]
) -> None:
    # Before: an input name raised a raw UnicodeDecodeError once the session was built,
    # and an operator type made ORT's wrapper print an "EP Error" banner to stdout and
    # build the session a second time (it took the UnicodeDecodeError for a provider's).
    model = affine_onnx(in_name="xx")
    bad_input = model.replace(b"\x02xx", b"\x02\xfe\xff")
    bad_op = affine_onnx().replace(b"Add", b"A\xfed")
    assert bad_input != model and bad_op != affine_onnx()
    with pytest.raises(InvalidEncodingError, match="onnxruntime: cannot read the ONNX "
                       "model's inputs and outputs: 'utf-8' codec can't decode"):
        backend.load([bad_input], GraphEncoding.ONNX, CPU)
    with pytest.raises(InvalidEncodingError, match="onnxruntime: cannot load the ONNX model"):
        backend.load([bad_op], GraphEncoding.ONNX, CPU)
    assert "EP Error" not in capfd.readouterr().out


def test_sessions_do_not_fall_back_to_another_provider(backend: Any) -> None:
    # Before: ORT's wrapper could swap a failing provider for the CPU one at run time.
    graph = backend.load([affine_onnx()], GraphEncoding.ONNX, CPU)
    assert graph.session._enable_fallback is False


@pytest.mark.parametrize("precision", ["f16", "bf16"])
def test_a_precision_onnx_runtime_cannot_apply_is_said_so(
        backend: Any, precision: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="wasinn.backends"):
        backend.load([affine_onnx()], GraphEncoding.ONNX, CPU, LoadOptions(precision=precision))
    assert [r.getMessage() for r in caplog.records] == [
        f"onnxruntime: precision {precision!r} is not applied: ONNX Runtime computes in the "
        f"model's own types (save the model in {precision} to compute in it)"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="wasinn.backends"):
        backend.load([affine_onnx()], GraphEncoding.ONNX, CPU, LoadOptions(precision="f32"))
    assert not caplog.records


class _CudaSessions:
    """``onnxruntime-gpu`` on one GPU, whose sessions come up without the CUDA provider
    until ``found`` (CUDA and cuDNN as pip packages and no torch: ONNX Runtime makes such a
    session on the CPU provider alone, and logs why). Sessions are real CPU ones; ``made``
    counts them. ``onnxruntime.preload_dlls`` is ``preload`` (set by the test)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import threading

        import onnxruntime as ort

        from wasinn.backends import _ort_cuda_libraries
        from wasinn.backends import onnxruntime as ort_backend

        _with_cuda(monkeypatch, provider=True, count=1)
        monkeypatch.setattr(_ort_cuda_libraries, "_tried", threading.Event())
        self.made = 0
        self.found = False
        self.preloads = 0
        real_session = ort_backend._session
        sessions = self

        class Session:
            def __init__(self, real: Any) -> None:
                self.real = real

            def __getattr__(self, name: str) -> Any:
                return getattr(self.real, name)

            def get_providers(self) -> list[str]:
                return (["CUDAExecutionProvider"] if sessions.found else []) + [
                    "CPUExecutionProvider"]

        def session(data: bytes, device: Device, *args: Any, **kwargs: Any) -> Session:
            self.made += 1
            return Session(real_session(data, CPU, *args, **kwargs))

        monkeypatch.setattr(ort_backend, "_session", session)
        monkeypatch.setattr(ort, "preload_dlls", self.preload, raising=False)

    def preload(self) -> None:
        self.preloads += 1


_GPU0 = Device.parse("gpu:0")


def test_a_cuda_session_without_its_provider_preloads_cuda_once_then_says_what_is_missing(
        backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    sessions = _CudaSessions(monkeypatch)
    with pytest.raises(UnsupportedOperationError,
                       match=r"^onnxruntime: the CUDA provider did not start on gpu:0: ONNX "
                             r"Runtime could not load CUDA or cuDNN .*onnxruntime\.preload_dlls"
                             r"\(\)\): expected them installed"):
        backend.load([affine_onnx()], GraphEncoding.ONNX, _GPU0)
    assert (sessions.made, sessions.preloads) == (2, 1)  # made again after the preload
    with pytest.raises(UnsupportedOperationError, match="did not start"):
        backend.load([affine_onnx()], GraphEncoding.ONNX, _GPU0)
    assert (sessions.made, sessions.preloads) == (4, 1)  # preloaded once a process


def test_where_the_preload_finds_cuda_the_session_is_made_again_with_it(
        backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    sessions = _CudaSessions(monkeypatch)

    def finds() -> None:
        sessions.found = True

    import onnxruntime as ort

    monkeypatch.setattr(ort, "preload_dlls", finds, raising=False)
    graph = backend.load([affine_onnx()], GraphEncoding.ONNX, _GPU0)
    assert sessions.made == 2 and graph.device == _GPU0
    graph.close()


def test_a_load_during_another_threads_preload_waits_for_it(
        backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: the second load, whose session came up without the provider while the
    # first load's preload ran, failed for good.
    import threading

    import onnxruntime as ort

    sessions = _CudaSessions(monkeypatch)
    preloading, finish = threading.Event(), threading.Event()

    def slow() -> None:
        preloading.set()
        assert finish.wait(30)
        sessions.found = True

    monkeypatch.setattr(ort, "preload_dlls", slow, raising=False)
    errors: list[BaseException] = []

    def load() -> None:
        try:
            backend.load([affine_onnx()], GraphEncoding.ONNX, _GPU0).close()
        except BaseException as exc:
            errors.append(exc)

    first = threading.Thread(target=load)
    first.start()
    assert preloading.wait(30)
    second = threading.Thread(target=load)
    second.start()
    finish.set()
    first.join(30)
    second.join(30)
    assert errors == []


def test_without_preload_dlls_the_error_does_not_claim_a_preload(
        backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import onnxruntime as ort

    sessions = _CudaSessions(monkeypatch)
    monkeypatch.delattr(ort, "preload_dlls")  # onnxruntime before 1.21
    with pytest.raises(UnsupportedOperationError,
                       match=r"did not start on gpu:0: .*before 1\.21\) cannot load them "
                             r"from their pip packages: expected"):
        backend.load([affine_onnx()], GraphEncoding.ONNX, _GPU0)
    assert (sessions.made, sessions.preloads) == (1, 0)


def test_an_overridable_initializer_is_no_input_and_setting_it_says_what_it_is(
        backend: Any) -> None:
    # A graph input that also has an initializer (its default; older exporters write
    # these): ONNX Runtime lets a run override it, wasinn does not. Before: "the model has
    # no input 'b'", for a name the model lists among its graph inputs.
    from onnx import TensorProto, helper, numpy_helper

    from wasinn import UnknownNameError

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    b = helper.make_tensor_value_info("b", TensorProto.FLOAT, [3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    default = numpy_helper.from_array(np.array([10, 20, 30], np.float32), "b")
    model = onnx_model_bytes(helper.make_graph(
        [helper.make_node("Add", ["x", "b"], ["y"])], "add", [x, b], [y],
        initializer=[default]))
    graph = backend.load([model], GraphEncoding.ONNX, CPU)
    assert [s.describe() for s in graph.inputs] == ["x: f32[2, 3]"]
    ones = Tensor.from_numpy(np.ones((2, 3), np.float32))
    assert graph.run({"x": ones})["y"].numpy().tolist() == [[11.0, 21.0, 31.0]] * 2
    with pytest.raises(UnknownNameError) as caught:
        graph.run({"x": ones, "b": Tensor.from_numpy(np.zeros(3, np.float32))})
    assert caught.value.message == (
        "onnxruntime: 'b' is an initializer with a default value (a weight the model also "
        "lists as a graph input), which wasinn does not let a run override: expected "
        "inputs x: f32[2, 3]")
