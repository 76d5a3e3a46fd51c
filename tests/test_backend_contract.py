"""Every built-in backend against the same contract, with real libraries and generated models.

Parametrized over ONNX Runtime, OpenVINO and PyTorch; a missing library is skipped
(or fails where WASINN_REQUIRE names it).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import wasinn
from tests import backend_models
from tests.support import LibraryInputs, passed_as_is, require_backend
from wasinn import (
    ClosedResourceError,
    GraphEncoding,
    InvalidArgumentError,
    InvalidEncodingError,
    Tensor,
    TensorType,
)
from wasinn.backends import Backend, CompiledGraph, Device, TensorSpec
from wasinn.backends.registry import BUILTIN, BackendRegistry
from wasinn.modelgen import ModelFiles, affine_onnx, sample_image
from wasinn.tensor import numpy_dtype

LIBRARY = {spec.name: spec.library or spec.name for spec in BUILTIN}
BACKENDS = ["onnxruntime", "openvino", "pytorch"]
CPU = Device.parse("cpu")


@pytest.fixture(scope="module")
def registry() -> BackendRegistry:
    return BackendRegistry(discover_plugins=False)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, registry: BackendRegistry) -> Backend:
    name: str = request.param
    require_backend(LIBRARY[name])
    return registry.get(name)


def load(backend: Backend, model: backend_models.Model) -> CompiledGraph:
    builders, encoding = model
    return backend.load(builders, encoding, CPU)


def f32(*rows: list[float]) -> Tensor:
    return Tensor.from_numpy(np.array(rows, dtype=np.float32))


# -- same model, same answer ---------------------------------------------------------------
def _reference(image: int = 0) -> np.ndarray[Any, Any]:
    import torch

    from wasinn.modelgen import mobilenet_v2

    with torch.inference_mode():
        return mobilenet_v2(1.0, 0)(torch.from_numpy(sample_image(image))).numpy()  # type: ignore[no-any-return]


@pytest.mark.slow
def test_the_generated_network_answers_each_image_differently() -> None:
    # Comparisons of its outputs (here, in the guests' and pipelines' tests) check the
    # data path only if a wrong or zeroed input would change them far beyond 1e-4.
    require_backend("torch")
    first, second = _reference(0), _reference(1)
    assert float(np.abs(first - second).mean()) > 0.05
    assert float(np.abs(first).max()) < 50  # and stays in f32's comfortable range


@pytest.mark.slow
def test_mobilenet_gives_the_same_answer_on_every_backend(
    mobilenet: ModelFiles, registry: BackendRegistry
) -> None:
    for name in BACKENDS:
        require_backend(LIBRARY[name])
    image = Tensor.from_numpy(sample_image())
    onnx, ts = mobilenet.onnx.read_bytes(), mobilenet.torchscript.read_bytes()
    ir = [mobilenet.ir_xml.read_bytes(), mobilenet.ir_bin.read_bytes()]
    runs = {
        "onnxruntime/onnx": (registry.get("onnxruntime"), [onnx], GraphEncoding.ONNX, "input"),
        "openvino/onnx": (registry.get("openvino"), [onnx], GraphEncoding.ONNX, "input"),
        "openvino/ir": (registry.get("openvino"), ir, GraphEncoding.OPENVINO, "input"),
        "pytorch/torchscript": (registry.get("pytorch"), [ts], GraphEncoding.PYTORCH, "x"),
    }
    expected = _reference()
    for label, (backend, builders, encoding, in_name) in runs.items():
        graph = backend.load(builders, encoding, CPU)
        (out,) = graph.run({in_name: image}).values()
        got = out.numpy()
        assert got.shape == (1, 1000) and out.type is TensorType.F32, label
        diff = float(np.abs(got - expected).max())
        assert diff <= 1e-4, f"{label}: max abs diff {diff}"
        assert int(got.argmax()) == int(expected.argmax()), label


# -- element types -------------------------------------------------------------------------
def _values(ttype: TensorType) -> np.ndarray[Any, Any]:
    base = np.array([[0, 1, 2, 250], [-3, 7, 100, 5]])
    if ttype is TensorType.U8:
        base = np.abs(base)
    arr = base.astype(numpy_dtype(ttype))
    if ttype in (TensorType.F16, TensorType.F32, TensorType.F64, TensorType.BF16):
        arr = (arr / 4).astype(numpy_dtype(ttype))  # fractions survive exactly
    if ttype in (TensorType.I32, TensorType.I64):
        arr[0, 3] = np.iinfo(np.int32).max  # the extreme that still fits every backend
    return arr


@pytest.mark.parametrize("ttype", list(TensorType))
def test_every_element_type_round_trips(backend: Backend, ttype: TensorType) -> None:
    graph = load(backend, backend_models.identity(backend.name, ttype))
    assert graph.inputs[0].type is ttype and graph.inputs[0].shape == (None, 4)
    assert graph.outputs[0].type is ttype
    arr = _values(ttype)
    for keep in (False, True):
        (out,) = graph.run({"x": Tensor.from_numpy(arr)}, keep_on_device=keep).values()
        assert out.type is ttype and out.dims == arr.shape
        got = out.numpy()
        assert got.dtype == arr.dtype
        np.testing.assert_array_equal(got, arr)


@pytest.mark.parametrize(("producer", "consumer"), [
    (p, c) for p in BACKENDS for c in BACKENDS if p != c])
def test_an_int64_host_output_feeds_every_other_backend(
        registry: BackendRegistry, producer: str, consumer: str) -> None:
    # ONNX Runtime's int64 host outputs are numpy longlong ('q'), which numpy counts equal
    # to int64 ('l') and OpenVINO refused ("Unsupported data type: int64").
    require_backend(LIBRARY[producer])
    require_backend(LIBRARY[consumer])
    first = load(registry.get(producer), backend_models.identity(producer, TensorType.I64))
    second = load(registry.get(consumer), backend_models.identity(consumer, TensorType.I64))
    arr = _values(TensorType.I64)
    (mid,) = first.run({"x": Tensor.from_numpy(arr)}).values()
    (out,) = second.run({"x": mid}).values()
    np.testing.assert_array_equal(out.numpy(), arr)
    (out,) = second.run({"x": Tensor.from_numpy(arr.astype(np.longlong))}).values()
    np.testing.assert_array_equal(out.numpy(), arr)


def test_a_tensor_over_a_big_endian_array_holds_its_values(backend: Backend) -> None:
    # Before, the constructor kept the array as given: ONNX Runtime read its bytes as
    # native (2.0 came back as 9.2e-41) and torch refused it.
    graph = load(backend, backend_models.affine(backend.name, 2.0, 0.0))
    big = np.array([[1, 2, 3, 4]], ">f4")
    (out,) = graph.run({"x": Tensor((1, 4), TensorType.F32, array=big)}).values()
    np.testing.assert_array_equal(out.numpy(), [[2, 4, 6, 8]])


# -- bad input -----------------------------------------------------------------------------
@pytest.fixture
def affine_graph(backend: Backend) -> CompiledGraph:
    return load(backend, backend_models.affine(backend.name, 2.0, 1.0))


def test_bytes_of_another_format_than_declared_are_refused_plainly(backend: Backend) -> None:
    # Not the library's own words for bytes it cannot parse (torch's "miniz" advice, a
    # "not a well-formed protobuf"): what was declared and what the bytes are.
    reads = next(e for e in (GraphEncoding.ONNX, GraphEncoding.PYTORCH)
                 if e in backend.encodings)
    other, seen = ((backend_models.affine("pytorch", 2.0, 1.0)[0], "pytorch")
                   if reads is GraphEncoding.ONNX
                   else (backend_models.affine("onnxruntime", 2.0, 1.0)[0], "onnx"))
    with pytest.raises(InvalidEncodingError,
                       match=rf"^{backend.name}: the model was declared {reads.value} but its "
                             rf"first builder is {seen} bytes$"):
        backend.load(other, reads, CPU)


def test_affine_runs(affine_graph: CompiledGraph) -> None:
    (out,) = affine_graph.run({"x": f32([1, 2, 3, 4], [0, 0, 0, 0])}).values()
    np.testing.assert_allclose(out.numpy(), [[3, 5, 7, 9], [1, 1, 1, 1]])
    (by_index,) = affine_graph.run({0: f32([1, 1, 1, 1])}).values()  # type: ignore[dict-item]
    np.testing.assert_allclose(by_index.numpy(), [[3, 3, 3, 3]])


@pytest.mark.parametrize(
    ("inputs", "what"),
    [
        ({"nope": np.zeros((1, 4), np.float32)}, "no input 'nope'"),
        ({"x": np.zeros((1, 4), np.float64)}, "input 'x' is f64"),
        ({"x": [[0.0, 1.0, 2.0, 3.0]]},
         "(Python floats and numpy's default are f64: convert with .astype(np.float32))"),
        ({"x": np.zeros((1, 4), np.int32)}, "input 'x' is i32"),
        ({"x": np.zeros((1, 5), np.float32)}, "has shape [1, 5]"),
        ({"x": np.zeros((4,), np.float32)}, "has shape [4]"),
        ({"x": np.zeros((1, 1, 4), np.float32)}, "has shape [1, 1, 4]"),
        ({}, "missing inputs"),
    ],
)
def test_bad_inputs_name_what_the_model_expects(
    affine_graph: CompiledGraph, inputs: dict[str, Any], what: str
) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        affine_graph.run({k: Tensor.from_numpy(v) for k, v in inputs.items()})
    message = str(info.value)
    assert what in message
    assert affine_graph.inputs[0].describe() in message  # "x: f32[?, 4]"


def test_unknown_output_names_the_outputs(affine_graph: CompiledGraph) -> None:
    with pytest.raises(InvalidArgumentError, match="no output 'nope'") as info:
        affine_graph.run({"x": f32([1, 2, 3, 4])}, outputs=["nope"])
    assert affine_graph.outputs[0].describe() in str(info.value)


def _garbage() -> bytes:
    return np.random.default_rng(7).integers(0, 256, 4096, dtype=np.uint8).tobytes()


def _bad_loads(name: str) -> list[tuple[list[bytes], GraphEncoding, str]]:
    good, encoding = backend_models.affine(name, 2.0, 1.0)
    return [
        ([], encoding, "empty builder list"),
        ([good[0], good[0]], encoding, "2 builders"),
        ([good[0][: len(good[0]) // 2]], encoding, ""),
        ([_garbage()], encoding, ""),
        ([b"\x00" * 64], encoding, ""),
    ]


def test_bad_model_bytes_are_invalid_encoding(backend: Backend) -> None:
    for builders, encoding, what in _bad_loads(backend.name):
        with pytest.raises(InvalidEncodingError) as info:
            backend.load(builders, encoding, CPU)
        assert backend.name in str(info.value) and what in str(info.value)


def test_an_encoding_the_backend_does_not_read_is_invalid_encoding(backend: Backend) -> None:
    wrong = next(e for e in (GraphEncoding.GGML, GraphEncoding.PYTORCH) if e not in
                 backend.encodings)
    with pytest.raises(InvalidEncodingError, match=backend.name):
        backend.load([affine_onnx()], wrong, CPU)


# -- scalars (rank 0) ----------------------------------------------------------------------
@pytest.mark.parametrize("keep", [False, True])
def test_a_scalar_input_and_output_keep_rank_0(backend: Backend, keep: bool) -> None:
    builders, encoding, out = backend_models.scalar(backend.name, 2.0)
    graph = backend.load(builders, encoding, CPU)
    (spec,) = graph.inputs
    assert (spec.shape, spec.rank_known, spec.describe()) == ((), True, "x: f32[]")
    assert (graph.outputs[0].shape, graph.outputs[0].rank_known) == ((), True)
    for x in (np.array(3.0, np.float32), np.float32(3)):
        y = graph.run({"x": Tensor.from_numpy(x)}, keep_on_device=keep)[out]
        assert y.is_host is not keep
        assert y.dims == () and y.numpy().shape == ()  # a kept one materializes as 0-d too
        assert float(y.numpy()) == 6.0
        if keep:  # a kept scalar feeds the next run as it is
            (again,) = graph.run({"x": y}).values()
            assert again.dims == () and float(again.numpy()) == 12.0


def test_a_scalar_input_refuses_a_one_element_array(backend: Backend) -> None:
    builders, encoding, _ = backend_models.scalar(backend.name)
    graph = backend.load(builders, encoding, CPU)
    with pytest.raises(InvalidArgumentError,
                       match=r"input 'x' has shape \[1\] but the model expects x: f32\[\]"):
        graph.run({"x": Tensor.from_numpy(np.array([3.0], np.float32))})


def test_only_an_unknown_rank_goes_unchecked() -> None:
    from wasinn.backends._graphio import InputChecker

    unknown = InputChecker("b", [TensorSpec("x", TensorType.F32, (), rank_known=False)])
    scalar = InputChecker("b", [TensorSpec("x", TensorType.F32, ())])
    for shape in [(), (1,), (2, 3)]:
        assert unknown.check({"x": Tensor.from_numpy(np.zeros(shape, np.float32))})
    assert scalar.check({"x": Tensor.from_numpy(np.float32(0))})
    with pytest.raises(InvalidArgumentError, match=r"has shape \[1\] but the model expects "
                                                   r"x: f32\[\]"):
        scalar.check({"x": Tensor.from_numpy(np.zeros((1,), np.float32))})


def test_a_spec_of_unknown_rank_has_no_dimensions() -> None:
    with pytest.raises(InvalidArgumentError, match=r"'x' has shape \[2\] but says its rank is "
                                                   r"unknown: expected shape \(\)"):
        TensorSpec("x", TensorType.F32, (2,), rank_known=False)


# -- keeping tensors on the device ---------------------------------------------------------
def test_keep_on_device_chains_without_host_copies(backend: Backend) -> None:
    first = load(backend, backend_models.affine(backend.name, 2.0, 1.0, out_name="y"))
    second = load(backend, backend_models.affine(backend.name, 3.0, -1.0, in_name="y",
                                                 out_name="z"))
    x = np.array([[1, 2, 3, 4], [-1, -2, -3, -4]], np.float32)
    before = wasinn.host_copies()
    (mid,) = first.run({"x": Tensor.from_numpy(x)}, keep_on_device=True).values()
    assert not mid.is_host and mid.native is not None
    assert mid.dims == (2, 4) and mid.type is TensorType.F32
    in_name = second.inputs[0].name
    with LibraryInputs(backend.name) as received:
        (out,) = second.run({in_name: mid}, keep_on_device=True).values()
    assert wasinn.host_copies() == before  # nothing crossed into host memory
    # ...nor went round it: the library was handed the first run's native value itself.
    assert passed_as_is(received, mid.native), (received, mid.native)
    np.testing.assert_allclose(out.numpy(), (x * 2 + 1) * 3 - 1)
    assert wasinn.host_copies() == before + 1  # the final read is the one copy


def test_every_output_brought_to_the_host_is_counted_as_a_host_copy(
        backend: Backend) -> None:
    # The library's own copies too (ONNX Runtime's run returning numpy arrays, an
    # OpenVINO output's data copied out, a torch output's .numpy()): before, only
    # Tensor.numpy() counted, so a chain whose intermediate went through host memory
    # showed no host copy.
    builders, encoding, names = backend_models.two_outputs(backend.name)
    graph = backend.load(builders, encoding, CPU)
    x = f32([1, 2, 3, 4])
    before = wasinn.host_copies()
    kept = graph.run({"x": x}, keep_on_device=True)
    assert wasinn.host_copies() == before
    assert not any(t.is_host for t in kept.values())
    for inputs in ({"x": x}, {"x": kept[names[0]]}):  # host, then a native input
        before = wasinn.host_copies()
        out = graph.run(inputs)
        assert wasinn.host_copies() == before + 2, inputs  # one per output, no more
        assert all(t.is_host for t in out.values())
        np.testing.assert_array_equal(out[names[1]].numpy(), -x.numpy())
        assert wasinn.host_copies() == before + 2  # a host output is read as it is
    before = wasinn.host_copies()
    graph.run({"x": x}, outputs=[names[1]])
    assert wasinn.host_copies() == before + 1  # only the outputs asked for
    before = wasinn.host_copies()
    assert list(graph.run({"x": x}, outputs=[names[1], names[1]])) == [names[1]]
    assert wasinn.host_copies() == before + 1  # asked for twice, handed back once


def test_kept_outputs_are_cut_into_rows_in_place_where_the_library_can(
        backend: Backend) -> None:
    # What a merged batch relies on: torch tensors and OpenVINO tensors give row views
    # that stay native and chain on; an OrtValue cannot be cut without a copy.
    graph = load(backend, backend_models.affine(backend.name, 2.0, 1.0, out_name="y"))
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    (out,) = graph.run({"x": Tensor.from_numpy(x)}, keep_on_device=True).values()
    before = wasinn.host_copies()
    piece = out.slice_rows(1, 3)
    if backend.name == "onnxruntime":
        assert piece is None
        return
    assert piece is not None and piece.native is not None and piece.dims == (2, 4)
    with LibraryInputs(backend.name) as received:
        (again,) = graph.run({"x": piece}, keep_on_device=True).values()
    assert wasinn.host_copies() == before
    assert passed_as_is(received, piece.native), (received, piece.native)  # the rows' view
    np.testing.assert_allclose(piece.numpy(), x[1:3] * 2 + 1)
    np.testing.assert_allclose(again.numpy(), (x[1:3] * 2 + 1) * 2 + 1)


@pytest.mark.parametrize(("producer", "consumer"), [
    ("onnxruntime", "pytorch"), ("pytorch", "onnxruntime"), ("onnxruntime", "openvino"),
    ("pytorch", "openvino"), ("openvino", "onnxruntime"), ("openvino", "pytorch")])
def test_native_tensor_of_another_backend_is_accepted(
        registry: BackendRegistry, producer: str, consumer: str) -> None:
    # A value one library keeps (an OrtValue, a torch tensor) reaches another over the
    # same memory (DLPack), and an OpenVINO tensor on the CPU as a numpy view of its
    # memory (it has no DLPack form): no host copy.
    require_backend(LIBRARY[producer])
    require_backend(LIBRARY[consumer])
    first = registry.get(producer).load(*backend_models.affine(producer, 2.0, 1.0), CPU)
    second = registry.get(consumer).load(*backend_models.affine(consumer, 3.0, 0.0), CPU)
    (mid,) = first.run({"x": f32([1, 2, 3, 4])}, keep_on_device=True).values()
    assert not mid.is_host
    before = wasinn.host_copies()
    (out,) = second.run({"x": mid}).values()
    assert out.is_host
    assert wasinn.host_copies() == before + 1  # the output brought to the host, only
    np.testing.assert_allclose(out.numpy(), [[9, 15, 21, 27]])


def test_a_strided_torch_value_reaches_onnx_runtime_through_the_host(
        registry: BackendRegistry) -> None:
    # ONNX Runtime takes only contiguous DLPack values: a transposed output is copied.
    import torch

    require_backend("onnxruntime")
    require_backend("torch")

    class Transposed(torch.nn.Module):
        def forward(self, x: Any) -> Any:
            return (x * 2 + 1).t()

    first = registry.get("pytorch").load(
        [backend_models.exported(Transposed(), (torch.zeros(4, 2),))], GraphEncoding.PYTORCH,
        CPU)
    second = registry.get("onnxruntime").load([affine_onnx(3.0, 0.0)], GraphEncoding.ONNX, CPU)
    x = np.arange(8, dtype=np.float32).reshape(4, 2)
    (mid,) = first.run({"x": Tensor.from_numpy(x)}, keep_on_device=True).values()
    assert not mid.native.is_contiguous()
    before = wasinn.host_copies()
    (out,) = second.run({"x": mid}).values()
    assert wasinn.host_copies() == before + 2  # the input through the host, the output to it
    np.testing.assert_allclose(out.numpy(), (x * 2 + 1).T * 3)


# -- threads and lifetime ------------------------------------------------------------------
def test_concurrent_runs_on_one_graph(affine_graph: CompiledGraph) -> None:
    results: dict[int, np.ndarray[Any, Any]] = {}
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for _ in range(20):
                x = np.full((3, 4), k, np.float32)
                (out,) = affine_graph.run({"x": Tensor.from_numpy(x)}).values()
                results[k] = out.numpy()
                np.testing.assert_allclose(results[k], x * 2 + 1)
        except BaseException as exc:  # collected and re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sorted(results) == [0, 1, 2, 3]


def test_closed_graph_refuses_to_run(affine_graph: CompiledGraph) -> None:
    affine_graph.close()
    affine_graph.close()  # idempotent
    with pytest.raises(ClosedResourceError):
        affine_graph.run({"x": f32([1, 2, 3, 4])})


def test_specs_report_dynamic_dims(affine_graph: CompiledGraph) -> None:
    (spec,) = affine_graph.inputs
    assert spec.type is TensorType.F32 and spec.shape == (None, 4)
    assert affine_graph.outputs[0].shape == (None, 4)
    assert affine_graph.device == CPU


@pytest.mark.parametrize("keep", [False, True])
def test_outputs_selects_by_name_in_any_order(backend: Backend, keep: bool) -> None:
    builders, encoding, (same, negated) = backend_models.two_outputs(backend.name)
    graph = backend.load(builders, encoding, CPU)
    assert [s.name for s in graph.outputs] == [same, negated]
    x = f32([1, 2, 3, 4])
    out = graph.run({"x": x}, outputs=[negated, same], keep_on_device=keep)
    assert sorted(out) == sorted([same, negated])
    np.testing.assert_array_equal(out[negated].numpy(), -x.numpy())
    np.testing.assert_array_equal(out[same].numpy(), x.numpy())
    only = graph.run({"x": x}, outputs=[negated], keep_on_device=keep)
    assert list(only) == [negated]
    assert graph.run({"x": x}, outputs=[], keep_on_device=keep) == {}
