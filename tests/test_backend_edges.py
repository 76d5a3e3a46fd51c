"""Edge cases of the backend contract, each backend with its real library: bit patterns of
every element type, zero-size and pass-through tensors, outputs named twice, graphs with
no inputs, several inputs given out of order, native tensors crossing backends and
outliving the graph that made them."""
# Inputs and outputs are also named by position (ints), which run()'s annotations leave out.
# mypy: disable-error-code="dict-item,list-item,arg-type"

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest

from tests import backend_models
from tests.support import require_backend
from wasinn import ClosedResourceError, GraphEncoding, InvalidArgumentError, Tensor, TensorType
from wasinn.backends import Backend, Device
from wasinn.backends.registry import BUILTIN, BackendRegistry
from wasinn.modelgen import identity_onnx, onnx_model_bytes
from wasinn.tensor import numpy_dtype

LIBRARY = {spec.name: spec.library or spec.name for spec in BUILTIN}
BACKENDS = ["onnxruntime", "openvino", "pytorch"]
ONNX_BACKENDS = ["onnxruntime", "openvino"]
CPU = Device.parse("cpu")


@pytest.fixture(scope="module")
def registry() -> BackendRegistry:
    return BackendRegistry(discover_plugins=False)


def _backend(registry: BackendRegistry, name: str) -> Backend:
    require_backend(LIBRARY[name])
    return registry.get(name)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, registry: BackendRegistry) -> Backend:
    return _backend(registry, request.param)


@pytest.fixture(params=ONNX_BACKENDS)
def onnx_backend(request: pytest.FixtureRequest, registry: BackendRegistry) -> Backend:
    return _backend(registry, request.param)


def _only(result: dict[str, Tensor]) -> Tensor:
    (value,) = result.values()
    return value


def _onnx_graph(nodes: list[Any], inputs: list[Any], outputs: list[Any],
                initializer: list[Any] | None = None) -> bytes:
    from onnx import helper

    return onnx_model_bytes(helper.make_graph(nodes, "edge", inputs, outputs,
                                              initializer=initializer or []))


def _f32_info(name: str, shape: list[int | str]) -> Any:
    from onnx import TensorProto, helper

    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


# -- element types: bit patterns -----------------------------------------------------------
def _bit_patterns(ttype: TensorType) -> np.ndarray[Any, Any]:
    """Values each backend carries exactly: infinities, NaN, subnormals, -0, extremes."""
    if ttype is TensorType.F16:
        bits = [0x7C00, 0xFC00, 0x7E00, 0x0001, 0x8000, 0x7BFF, 0x3C00, 0x3555]
        return np.array(bits, np.uint16).view(np.float16).reshape(2, 4)
    if ttype is TensorType.BF16:
        bits = [0x7F80, 0xFF80, 0x7FC0, 0x0001, 0x8000, 0x7F7F, 0x3F80, 0x4049]
        return np.array(bits, np.uint16).view(numpy_dtype(ttype)).reshape(2, 4)
    if ttype in (TensorType.F32, TensorType.F64):
        tiny = 1e-45 if ttype is TensorType.F32 else 1e-300  # (OpenVINO: f64 as f32)
        values = [np.inf, -np.inf, np.nan, tiny, -0.0, 3.4e38, 1.0, 1 / 3]
        if ttype is TensorType.F64:
            values[-1] = 0.25  # exact in f32 as well
        return np.array(values, numpy_dtype(ttype)).reshape(2, 4)
    if ttype is TensorType.U8:
        return np.array([0, 255, 1, 128, 7, 8, 9, 10], np.uint8).reshape(2, 4)
    i32 = np.iinfo(np.int32)  # OpenVINO computes i64 as i32: the extremes that fit
    return np.array([i32.min, i32.max, -1, 0, 1, 2, 3, 4], numpy_dtype(ttype)).reshape(2, 4)


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("ttype", list(TensorType))
def test_identity_keeps_every_bit_pattern(backend: Backend, ttype: TensorType,
                                          keep: bool) -> None:
    if backend.name == "openvino" and ttype is TensorType.F64:
        pytest.skip("OpenVINO computes f64 as f32 (documented): subnormals differ")
    builders, encoding = backend_models.identity(backend.name, ttype)
    graph = backend.load(builders, encoding, CPU)
    arr = _bit_patterns(ttype)
    out = _only(graph.run({0: Tensor.from_numpy(arr)}, keep_on_device=keep)).numpy()
    assert out.dtype == arr.dtype and out.shape == arr.shape
    assert out.tobytes() == arr.tobytes()


# -- zero-size tensors ---------------------------------------------------------------------
@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("ttype", [TensorType.F32, TensorType.BF16, TensorType.I64])
def test_a_zero_size_batch_runs(backend: Backend, ttype: TensorType, keep: bool) -> None:
    graph = backend.load(*backend_models.identity(backend.name, ttype), CPU)
    empty = np.zeros((0, 4), numpy_dtype(ttype))
    out = _only(graph.run({0: Tensor.from_numpy(empty)}, keep_on_device=keep))
    assert out.dims == (0, 4) and out.type is ttype
    assert out.numpy().shape == (0, 4)


# -- dynamic shapes back to back -----------------------------------------------------------
@pytest.mark.parametrize("keep", [False, True])
def test_changing_batch_sizes_back_to_back(backend: Backend, keep: bool) -> None:
    graph = backend.load(*backend_models.affine(backend.name, 2.0, 1.0), CPU)
    for n in (1, 3, 2, 5, 0, 1):
        x = np.arange(n * 4, dtype=np.float32).reshape(n, 4)
        out = _only(graph.run({0: Tensor.from_numpy(x)}, keep_on_device=keep))
        assert out.dims == (n, 4)
        np.testing.assert_array_equal(out.numpy(), x * 2 + 1)


# -- the caller's memory -------------------------------------------------------------------
def _passthrough_onnx() -> bytes:
    """A graph whose output is its input, with no node between."""
    x = _f32_info("x", ["n", 4])
    return _onnx_graph([], [x], [x])


@pytest.mark.parametrize("keep", [False, True])
def test_a_passed_through_input_is_not_the_callers_memory(onnx_backend: Backend,
                                                           keep: bool) -> None:
    graph = onnx_backend.load([_passthrough_onnx()], GraphEncoding.ONNX, CPU)
    caller = np.arange(8, dtype=np.float32).reshape(2, 4)
    out = _only(graph.run({"x": Tensor.from_numpy(caller)}, keep_on_device=keep))
    got = out.numpy()
    np.testing.assert_array_equal(got, np.arange(8).reshape(2, 4))
    assert not np.shares_memory(got, caller)
    if got.flags.writeable:
        got[0, 0] = 99
    caller[0, 1] = -5  # the caller reuses its buffer: the result must not change
    assert caller[0, 0] == 0 and out.numpy()[0, 1] == 1


@pytest.mark.parametrize("keep", [False, True])
def test_a_passed_through_bf16_graph_input_is_not_the_callers_memory(
        registry: BackendRegistry, keep: bool) -> None:
    # A bf16 tensor anywhere in the graph sends ONNX Runtime through its IOBinding path.
    from onnx import TensorProto, helper

    ort = _backend(registry, "onnxruntime")
    x = _f32_info("x", [2])
    b = helper.make_tensor_value_info("b", TensorProto.BFLOAT16, [2])
    c = helper.make_tensor_value_info("c", TensorProto.BFLOAT16, [2])
    graph = ort.load([_onnx_graph([helper.make_node("Identity", ["b"], ["c"])], [x, b],
                                  [x, c])], GraphEncoding.ONNX, CPU)
    caller = np.array([1.0, 2.0], np.float32)
    bf16 = np.array([1.0, 2.0], np.float32).astype(numpy_dtype(TensorType.BF16))
    out = graph.run({"x": Tensor.from_numpy(caller), "b": Tensor.from_numpy(bf16)},
                    keep_on_device=keep)
    assert not np.shares_memory(out["x"].numpy(), caller)


def test_identity_outputs_never_write_the_callers_array(backend: Backend) -> None:
    graph = backend.load(*backend_models.identity(backend.name, TensorType.F32), CPU)
    caller = np.arange(8, dtype=np.float32).reshape(2, 4)
    for keep in (False, True):
        out = _only(graph.run({0: Tensor.from_numpy(caller)}, keep_on_device=keep)).numpy()
        if out.flags.writeable:
            out[:] = 7
        np.testing.assert_array_equal(caller, np.arange(8).reshape(2, 4))


@pytest.mark.parametrize("keep", [False, True])
def test_read_only_and_big_endian_inputs_run(backend: Backend, keep: bool) -> None:
    graph = backend.load(*backend_models.affine(backend.name, 2.0, 1.0), CPU)
    frozen = np.arange(8, dtype=np.float32).reshape(2, 4)
    frozen.flags.writeable = False
    big = np.arange(8, dtype=">f4").reshape(2, 4)
    strided = np.arange(16, dtype=np.float32).reshape(2, 8)[:, ::2]
    for arr in (frozen, big, strided):
        out = _only(graph.run({0: Tensor.from_numpy(arr)}, keep_on_device=keep))
        np.testing.assert_array_equal(out.numpy(), arr.astype(np.float32) * 2 + 1)


# -- outputs -------------------------------------------------------------------------------
@pytest.mark.parametrize("keep", [False, True])
def test_an_output_named_twice_is_returned_once(backend: Backend, keep: bool) -> None:
    graph = backend.load(*backend_models.identity(backend.name, TensorType.F32), CPU)
    name = graph.outputs[0].name
    x = Tensor.from_numpy(np.ones((2, 4), np.float32))
    for outputs in ([name, name], [name, 0]):
        result = graph.run({0: x}, outputs=outputs, keep_on_device=keep)
        assert list(result) == [name]
        np.testing.assert_array_equal(result[name].numpy(), np.ones((2, 4)))


@pytest.mark.parametrize("keep", [False, True])
def test_an_output_named_twice_with_bf16_is_returned_once(registry: BackendRegistry,
                                                         keep: bool) -> None:
    ort = _backend(registry, "onnxruntime")
    graph = ort.load(*backend_models.identity("onnxruntime", TensorType.BF16), CPU)
    x = Tensor.from_numpy(np.ones((2, 4), numpy_dtype(TensorType.BF16)))
    result = graph.run({"x": x}, outputs=["y", "y", 0], keep_on_device=keep)
    assert list(result) == ["y"]
    assert result["y"].numpy().astype(np.float32).tolist() == [[1.0] * 4] * 2


# -- inputs --------------------------------------------------------------------------------
def _sub_model(backend: str) -> backend_models.Model:
    """``z = x - y`` over f32 ``(n, 4)``."""
    if backend == "pytorch":
        import torch

        class Sub(torch.nn.Module):
            def forward(self, x: Any, y: Any) -> Any:
                return x - y

        program = torch.export.export(Sub(), (torch.zeros(2, 4), torch.zeros(2, 4)))
        buf = io.BytesIO()
        torch.export.save(program, buf)
        return [buf.getvalue()], GraphEncoding.PYTORCH
    from onnx import helper

    x, y, z = (_f32_info(n, ["n", 4]) for n in "xyz")
    return [_onnx_graph([helper.make_node("Sub", ["x", "y"], ["z"])], [x, y], [z])], \
        GraphEncoding.ONNX


@pytest.mark.parametrize("keep", [False, True])
def test_several_inputs_given_out_of_order(backend: Backend, keep: bool) -> None:
    graph = backend.load(*_sub_model(backend.name), CPU)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    by_name = graph.run({"y": Tensor.from_numpy(x), "x": Tensor.from_numpy(x * 3)},
                        keep_on_device=keep)
    by_index = graph.run({1: Tensor.from_numpy(x), 0: Tensor.from_numpy(x * 3)},
                         keep_on_device=keep)
    for result in (by_name, by_index):
        np.testing.assert_array_equal(_only(result).numpy(), x * 2)
    with pytest.raises(InvalidArgumentError, match="given twice"):
        graph.run({"x": Tensor.from_numpy(x), 0: Tensor.from_numpy(x)})


def _named_dims_model(a: list[int | str], b: list[int | str], op: str = "Add",
                      **attributes: Any) -> bytes:
    """``y = op(a, b)`` over f32 inputs declared of shapes ``a`` and ``b``."""
    from onnx import helper

    return _onnx_graph([helper.make_node(op, ["a", "b"], ["y"], **attributes)],
                       [_f32_info("a", a), _f32_info("b", b)], [_f32_info("y", ["r", 3])])


def _rows(a: int, b: int, columns: tuple[int, int] = (3, 3)) -> dict[str, Tensor]:
    return {"a": Tensor.from_numpy(np.ones((a, columns[0]), np.float32)),
            "b": Tensor.from_numpy(np.ones((b, columns[1]), np.float32))}


def test_inputs_whose_dimensions_share_a_name_must_agree(onnx_backend: Backend) -> None:
    # Before: a=(2, 3), b=(4, 3) went to the library, which failed inside its Add node
    # (BackendRuntimeError, with C++ text naming neither input nor n).
    graph = onnx_backend.load([_named_dims_model(["n", 3], ["n", 3])], GraphEncoding.ONNX, CPU)
    assert [s.describe() for s in graph.inputs] == ["a: f32[?, 3]", "b: f32[?, 3]"]
    assert _only(graph.run(_rows(2, 2))).dims == (2, 3)
    with pytest.raises(InvalidArgumentError) as caught:
        graph.run(_rows(2, 4))
    assert caught.value.message == (
        f"{onnx_backend.name}: input 'b' has size 4 in dimension 0, but input 'a' has size 2 "
        "in dimension 0, and the model names both 'n': expected the same size in both (the "
        "model expects a: f32[?, 3], b: f32[?, 3])")


def test_dimensions_one_input_names_alike_must_agree(onnx_backend: Backend) -> None:
    # a: [n, n], a square; b's k is its own.
    model = _named_dims_model(["n", "n"], ["k", "n"], op="MatMul")
    graph = onnx_backend.load([model], GraphEncoding.ONNX, CPU)
    assert _only(graph.run(_rows(3, 3))).dims == (3, 3)
    with pytest.raises(InvalidArgumentError,
                       match=r"input 'a' has size 2 in dimension 1, but it has size 3 in "
                             r"dimension 0, and the model names both 'n'"):
        graph.run(_rows(3, 2, columns=(2, 2)))


def test_dimensions_of_different_names_may_differ(onnx_backend: Backend) -> None:
    # n and m are two dimensions: the libraries concatenate 2 and 4 rows.
    model = _named_dims_model(["n", 3], ["m", 3], op="Concat", axis=0)
    graph = onnx_backend.load([model], GraphEncoding.ONNX, CPU)
    assert _only(graph.run(_rows(2, 4))).dims == (6, 3)


def _constant_model(backend: str) -> backend_models.Model:
    """No inputs; one f32 output ``[1.5, 2.5]`` held by the model."""
    if backend == "pytorch":
        import torch

        class Const(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.register_buffer("c", torch.tensor([1.5, 2.5]))

            def forward(self) -> Any:
                return self.c

        program = torch.export.export(Const(), ())
        buf = io.BytesIO()
        torch.export.save(program, buf)
        return [buf.getvalue()], GraphEncoding.PYTORCH
    from onnx import helper, numpy_helper

    c = numpy_helper.from_array(np.array([1.5, 2.5], np.float32), "c")
    return [_onnx_graph([helper.make_node("Identity", ["c"], ["y"])], [],
                        [_f32_info("y", [2])], [c])], GraphEncoding.ONNX


@pytest.mark.parametrize("keep", [False, True])
def test_a_graph_without_inputs_keeps_its_constant(backend: Backend, keep: bool) -> None:
    graph = backend.load(*_constant_model(backend.name), CPU)
    assert graph.inputs == ()
    first = _only(graph.run({}, keep_on_device=keep)).numpy()
    if first.flags.writeable:
        first[:] = 99  # must not change the model
    np.testing.assert_array_equal(_only(graph.run({}, keep_on_device=keep)).numpy(), [1.5, 2.5])


# -- native tensors across backends and lifetimes ------------------------------------------
@pytest.mark.parametrize("consumer", BACKENDS)
def test_a_kept_output_outlives_its_graph_and_feeds_any_backend(
        backend: Backend, registry: BackendRegistry, consumer: str) -> None:
    other = _backend(registry, consumer)
    producer = backend.load(*backend_models.affine(backend.name, 2.0, 1.0), CPU)
    graph = other.load(*backend_models.affine(consumer, 3.0, 0.0), CPU)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    mid = _only(producer.run({0: Tensor.from_numpy(x)}, keep_on_device=True))
    producer.close()
    producer.close()  # idempotent
    with pytest.raises(ClosedResourceError):
        producer.run({0: Tensor.from_numpy(x)})
    for keep in (False, True):
        out = _only(graph.run({0: mid}, keep_on_device=keep))
        np.testing.assert_array_equal(out.numpy(), (x * 2 + 1) * 3)
    np.testing.assert_array_equal(mid.numpy(), x * 2 + 1)


def test_threads_option_is_honoured(registry: BackendRegistry) -> None:
    from wasinn.backends import LoadOptions

    ort = _backend(registry, "onnxruntime")
    graph: Any = ort.load([identity_onnx(TensorType.F32)], GraphEncoding.ONNX, CPU,
                          LoadOptions(threads=1))
    assert graph.session.get_session_options().intra_op_num_threads == 1
    ov = _backend(registry, "openvino")
    graph = ov.load([identity_onnx(TensorType.F32)], GraphEncoding.ONNX, CPU,
                    LoadOptions(threads=1))
    assert int(graph.compiled_model.get_property("INFERENCE_NUM_THREADS")) == 1
