"""Dynamic batching of models whose outputs do not have the batch axis first: refused at
load where the model declares it (ONNX dimension names, on ONNX Runtime and OpenVINO
alike), else caught by the first merged run's check against a run alone (TorchScript,
OpenVINO IR, ONNX without names), so that no caller gets another's rows. Real exports
of batch-major models load, and pay for that check at most once per input signature."""

from __future__ import annotations

import io
import logging
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio.testing

import wasinn
from tests.backend_models import scripted
from tests.support import cpu_pool
from tests.test_batching import device_busy, only_actor, run_sizes
from tests.test_pipeline_edges import three_steps
from wasinn import Batching, GraphEncoding, InvalidArgumentError
from wasinn.actors.batching import check_batchable
from wasinn.backends.base import TensorSpec
from wasinn.configs.loader import parse_config
from wasinn.enums import TensorType
from wasinn.modelgen import onnx_model_bytes

#: Two requests of 3 rows of 6 merge into 6 rows: as many as a transposed output's first
#: dimension, so that the rows check alone would pass.
ROWS, WIDTH, MAX_BATCH = 3, 6, 6


def transpose_onnx(x: list[Any], z: list[Any], y: list[Any] | None = None,
                   out: str = "z") -> bytes:
    """``z = x.T`` (and ``y = x``), declared with the dimensions given; ``out``: z's name."""
    from onnx import TensorProto, helper

    outputs = [helper.make_tensor_value_info(out, TensorProto.FLOAT, z)]
    nodes = [helper.make_node("Transpose", ["x"], [out], perm=[1, 0])]
    if y is not None:
        outputs.insert(0, helper.make_tensor_value_info("y", TensorProto.FLOAT, y))
        nodes.append(helper.make_node("Identity", ["x"], ["y"]))
    x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, x)
    return onnx_model_bytes(helper.make_graph(nodes, "transpose", [x_info], outputs))


def gram_onnx() -> bytes:
    """``z = x @ x.T``, declared ``x: [n, m]``, ``z: [n, n]``: it mixes the rows."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0]),
             helper.make_node("MatMul", ["x", "t"], ["z"])]
    graph = helper.make_graph(
        nodes, "gram", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", "m"])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n", "n"])])
    return onnx_model_bytes(graph)


def memory_onnx() -> bytes:
    """``z = x + y.sum(0)``, declared ``x: [n, 4]``, ``y: [m, 4]``, ``z: [n, 4]``: ``y``'s
    rows are each request's own memory, an axis apart from ``x``'s rows."""
    from onnx import TensorProto, helper, numpy_helper

    nodes = [helper.make_node("ReduceSum", ["y", "axes"], ["s"], keepdims=1),
             helper.make_node("Add", ["x", "s"], ["z"])]
    graph = helper.make_graph(
        nodes, "memory", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4]),
                          helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", 4])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n", 4])],
        [numpy_helper.from_array(np.array([0], np.int64), "axes")])
    return onnx_model_bytes(graph)


def to_ir(onnx: bytes) -> list[bytes]:
    """``onnx`` converted to OpenVINO IR (xml, bin): its dimensions lose their names."""
    import openvino as ov

    with tempfile.TemporaryDirectory() as tmp:
        source, xml = Path(tmp) / "m.onnx", Path(tmp) / "m.xml"
        source.write_bytes(onnx)
        ov.save_model(ov.convert_model(str(source)), str(xml), compress_to_fp16=False)
        return [xml.read_bytes(), xml.with_suffix(".bin").read_bytes()]


def transpose_script() -> bytes:
    """``(x, x.T)`` as TorchScript, which declares no shapes at all."""
    import torch

    class Transpose(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x + 0, x.t()

    return scripted(Transpose())


def torch_onnx(dynamic_axes: dict[str, Any]) -> bytes:
    """``(y, z) = (2x + 1, x.sum(1, keepdim=True))`` exported by ``torch.onnx.export``."""
    import torch

    class Rows(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return 2 * x + 1, x.sum(1, keepdim=True)

    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's deprecations and notes
        torch.onnx.export(Rows(), (torch.zeros(2, WIDTH),), buf, input_names=["x"],
                          output_names=["y", "z"], dynamic_axes=dynamic_axes,
                          opset_version=17, dynamo=False)
    return buf.getvalue()


def request(value: float) -> np.ndarray[Any, Any]:
    return np.arange(ROWS * WIDTH, dtype=np.float32).reshape(ROWS, WIDTH) + 100 * value


async def two_queued(rt: wasinn.Runtime, graph: wasinn.Graph, first: float = 1
                     ) -> list[list[np.ndarray[Any, Any]]]:
    """Two requests queued together on the busy device (so that they may share a run):
    each one's outputs, in order."""
    results: dict[int, list[np.ndarray[Any, Any]]] = {}

    async def call(i: int) -> None:
        outputs = await graph.compute({"x": request(first + i)})
        results[i] = [t.numpy() for t in outputs.values()]

    async with device_busy(only_actor(rt)) as nursery:
        for i in range(2):
            nursery.start_soon(call, i)
        await trio.testing.wait_all_tasks_blocked()
    return [results[0], results[1]]


@pytest.fixture
async def rt() -> Any:
    async with wasinn.Runtime(cpu_pool(workers=1)) as runtime:
        yield runtime


# -- refused at load where the model declares it ------------------------------------------------
@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
async def test_an_output_declared_with_another_first_dimension_is_refused_at_load(
        rt: wasinn.Runtime, backend: str) -> None:
    # Before: accepted; two requests of 3 x 6 merged into 6 rows, z came back 6 x 6 and
    # each caller got a (3, 6) z holding both callers' values.
    model = transpose_onnx(["n", "m"], ["m", "n"], y=["n", "m"])
    with pytest.raises(InvalidArgumentError) as err:
        await rt.load([model], "onnx", backend=backend, name="t",
                      batching=Batching(max_batch=MAX_BATCH))
    assert str(err.value) == (
        "model 't': t: batching merges requests along the first dimension, but output z is "
        "declared [m, n]: its first dimension is m (input x's dimension 1), not the "
        "inputs' batch dimension n: expected every output to have the batch dimension "
        "first, or load the model without batching")
    assert only_actor(rt).stats().graphs == 0  # nothing left compiled
    graph = await rt.load([model], "onnx", backend=backend)  # without batching: fine
    z = (await graph.compute({"x": request(1)}))["z"].numpy()
    np.testing.assert_array_equal(z, request(1).T)


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
async def test_inputs_whose_first_dimensions_are_named_apart_are_refused_at_load(
        rt: wasinn.Runtime, backend: str) -> None:
    # Before: accepted as batch-major (z's first dimension, n, was one of the inputs'),
    # and two requests of one row each merged along y's rows too: y = 1 and y = 100 both
    # got z = 101.
    with pytest.raises(InvalidArgumentError) as err:
        await rt.load([memory_onnx()], "onnx", backend=backend, name="memory",
                      batching=Batching(max_batch=MAX_BATCH))
    assert str(err.value) == (
        "model 'memory': memory: batching merges requests along the first dimension of "
        "every input, but the inputs name their first dimensions apart (x: [n, 4], y: "
        "[m, 4]): two requests of the same row counts would have their rows mixed: "
        "expected every input's first dimension to be the batch dimension, named alike, "
        "or load the model without batching")
    graph = await rt.load([memory_onnx()], "onnx", backend=backend)  # without: fine
    x = np.zeros((1, 4), np.float32)
    z = (await graph.compute({"x": x, "y": np.full((2, 4), 50, np.float32)}))["z"].numpy()
    np.testing.assert_array_equal(z, np.full((1, 4), 100, np.float32))


async def test_names_an_exporter_made_up_for_each_input_prove_nothing(
        rt: wasinn.Runtime) -> None:
    # torch.onnx.export with dynamic_axes as lists names each tensor's axis apart
    # (x_dynamic_axes_1, y_dynamic_axes_1): such a model is not refused, but checked.
    import torch

    class Add(torch.nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return x + y

    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's deprecations and notes
        torch.onnx.export(Add(), (torch.zeros(2, 4), torch.zeros(2, 4)), buf,
                          input_names=["x", "y"], output_names=["z"],
                          dynamic_axes={"x": [0], "y": [0], "z": [0]}, dynamo=False)
    graph = await rt.load([buf.getvalue()], "onnx", batching=Batching(max_batch=4))
    z = (await graph.compute({"x": np.ones((1, 4), np.float32),
                              "y": np.ones((1, 4), np.float32)}))["z"].numpy()
    np.testing.assert_array_equal(z, np.full((1, 4), 2, np.float32))


async def test_an_output_with_the_batch_dimension_on_another_axis_is_refused(
        rt: wasinn.Runtime) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        await rt.load([gram_onnx()], "onnx", name="gram", batching=Batching(max_batch=4))
    assert str(err.value) == (
        "model 'gram': gram: batching merges requests along the first dimension, but "
        "output z is declared [n, n]: its dimension 1 is n too, the inputs' batch "
        "dimension, so its size would change with the rows merged: expected the batch "
        "dimension first and nowhere else, or load the model without batching")


async def test_a_registry_model_and_a_pipeline_step_name_where_batching_was_asked(
        tmp_path: Path) -> None:
    (tmp_path / "t.onnx").write_bytes(transpose_onnx(["n", "m"], ["m", "n"]))
    config = parse_config({
        "pools": {"cpu": {"kind": "cpu", "devices": ["cpu"], "workers": 1}},
        "models": {"t": {"files": ["t.onnx"], "batching": {"max_batch": MAX_BATCH}}},
    }, tmp_path / "wasinn.toml")
    async with wasinn.Runtime(config) as rt:
        with pytest.raises(InvalidArgumentError, match="output z is declared") as err:
            await rt.load_by_name("t")
        assert str(err.value).startswith(f"{tmp_path / 'wasinn.toml'}: models.t: t: ")
    # A pipeline's middle step: x: [n, m] -> y: [m, n].
    middle = transpose_onnx(["n", "m"], ["m", "n"], out="y")
    async with wasinn.Runtime(three_steps(tmp_path, middle, batching={"max_batch": 4})) as rt:
        with pytest.raises(InvalidArgumentError) as err:
            await rt.load_by_name("p")
        assert str(err.value).startswith(
            f"{tmp_path / 'wasinn.toml'}: pipelines.p.batching: pipeline 'p' step 1 (m): "
            "batching merges requests along the first dimension, but output y is declared "
            "[m, n]: its first dimension is m (input x's dimension 1)")


# -- caught by the first merged run where the model does not say -------------------------------
def _undeclared(kind: str) -> tuple[list[bytes], GraphEncoding, str]:
    if kind == "torchscript":
        return [transpose_script()], GraphEncoding.PYTORCH, "pytorch"
    named = transpose_onnx(["n", "m"], ["m", "n"], y=["n", "m"])
    if kind == "openvino-ir":  # the same model, its names lost
        return to_ir(named), GraphEncoding.OPENVINO, "openvino"
    unnamed = transpose_onnx([None, None], [None, None], y=[None, None])
    return [unnamed], GraphEncoding.ONNX, kind


@pytest.mark.parametrize("kind", ["torchscript", "openvino-ir", "onnxruntime", "openvino"])
async def test_a_transposed_output_of_undeclared_shape_gives_each_caller_its_own_result(
        rt: wasinn.Runtime, kind: str, caplog: pytest.LogCaptureFixture) -> None:
    builders, encoding, backend = _undeclared(kind)
    graph = await rt.load(builders, encoding, backend=backend,
                          batching=Batching(max_batch=MAX_BATCH))
    sizes = run_sizes(rt, graph)
    with caplog.at_level(logging.WARNING, "wasinn.actors"):
        first = await two_queued(rt, graph)
    for i, (y, z) in enumerate(first):  # as a run alone gives
        np.testing.assert_array_equal(y, request(1 + i))
        np.testing.assert_array_equal(z, request(1 + i).T)
    # The merged run, checked against its first member alone (kept as that one's
    # result), then the other alone.
    assert sizes == [6, 3, 3]
    (z_name,) = [spec.name for spec in graph.outputs][1:]
    assert caplog.text.count("cannot batch") == 1
    assert (f"output {z_name!r} of a merged run of 6 rows has shape [6, 6], but one of "
            "its requests (3 rows) run alone gives shape [6, 3], not [3, 6]") in caplog.text
    # From then on its requests run alone: no merged run to throw away.
    again = await two_queued(rt, graph, first=5)
    assert sizes == [6, 3, 3, 3, 3]
    for i, (_, z) in enumerate(again):
        np.testing.assert_array_equal(z, request(5 + i).T)
    assert graph.stats().batches == 0


async def test_a_batch_major_model_of_undeclared_shapes_is_checked_once_per_signature(
        rt: wasinn.Runtime) -> None:
    import torch

    class Twice(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * x

    graph = await rt.load([scripted(Twice())], "pytorch",
                          batching=Batching(max_batch=MAX_BATCH))
    sizes = run_sizes(rt, graph)
    for round_ in range(2):
        for i, (y,) in enumerate(await two_queued(rt, graph, first=10 * round_)):
            np.testing.assert_array_equal(y, 2 * request(10 * round_ + i))
    assert sizes == [6, 3, 6]  # the first merged run checked by one member's run alone
    assert graph.stats().batches == 2


# -- what real exports declare ------------------------------------------------------------------
async def test_torch_onnx_exports_load_and_named_batch_axes_skip_the_check(
        rt: wasinn.Runtime) -> None:
    # dynamic_axes as a dict names the batch axis alike on x and y: declared batch-major.
    named = await rt.load([torch_onnx({"x": {0: "batch"}, "y": {0: "batch"},
                                       "z": {0: "batch"}})], "onnx",
                          batching=Batching(max_batch=MAX_BATCH))
    # As lists, each tensor's axis gets a name of its own (x_dynamic_axes_1,
    # y_dynamic_axes_1): not known to be one axis, so checked once, and accepted.
    listed = await rt.load([torch_onnx({"x": [0], "y": [0], "z": [0]})], "onnx",
                           batching=Batching(max_batch=MAX_BATCH))
    for graph, expected in ((named, [6]), (listed, [6, 3])):
        sizes = run_sizes(rt, graph)
        for i, (y, z) in enumerate(await two_queued(rt, graph)):
            np.testing.assert_allclose(y, 2 * request(1 + i) + 1)
            np.testing.assert_allclose(z, request(1 + i).sum(1, keepdims=True))
        assert sizes == expected
        assert graph.stats().batches == 1


def test_what_declared_dimensions_prove() -> None:
    x = TensorSpec("x", TensorType.F32, (None, 6))
    y = TensorSpec("y", TensorType.F32, (None, 6))
    assert check_batchable("m", [x], [y], {"x": ("n", 6), "y": ("n", 6)})
    assert not check_batchable("m", [x], [y])  # no names: not known
    assert not check_batchable("m", [x], [y], {"x": ("a", 6), "y": ("b", 6)})
    assert not check_batchable("m", [x], [y], {"x": ("n", 6), "y": ("n", 6, 1)})  # rank?
    free = TensorSpec("y", TensorType.F32, (None, None))
    assert not check_batchable("m", [x], [free], {"x": ("n", 6), "y": ("n", "k")})
    undeclared = TensorSpec("y", TensorType.F32, (), rank_known=False)
    assert not check_batchable("m", [x], [undeclared], {"x": ("n", 6)})
    two = [x, TensorSpec("w", TensorType.F32, (None, 6))]
    with pytest.raises(InvalidArgumentError, match="name their first dimensions apart"):
        check_batchable("m", two, [y], {"x": ("n", 6), "w": ("m", 6), "y": ("n", 6)})
    assert check_batchable("m", two, [y], {"x": ("n", 6), "w": ("n", 6), "y": ("n", 6)})
    made_up = {"x": ("x_dynamic_axes_1", 6), "w": ("unk__7", 6), "y": ("n", 6)}
    assert not check_batchable("m", two, [y], made_up)  # named by nothing: not known
    square = TensorSpec("x", TensorType.F32, (None, None))
    with pytest.raises(InvalidArgumentError, match="input x is declared \\[n, n\\]: its "
                       "dimension 1 is n too"):
        check_batchable("m", [square], [y], {"x": ("n", "n"), "y": ("n", 6)})
