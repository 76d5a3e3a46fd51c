"""The preference order with the real libraries: a valid model that one library cannot
read (an operator domain or opset it does not know) runs on the next one that can, with
a warning, and where none can, the error gives every library's reason."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import wasinn
from tests.support import require_backend
from wasinn import UnsupportedOperationError

#: ``y = inverse(x)`` of 4 x 4 matrices with ONNX Runtime's ``com.microsoft`` contrib
#: operator: OpenVINO's frontend has no conversion rule for it.
INVERSE_X = np.diag([2.0, 4.0, 5.0, 8.0]).astype(np.float32)


@pytest.fixture(autouse=True)
def both_libraries() -> None:
    require_backend("onnxruntime")
    require_backend("openvino")


def model_bytes(graph: Any, opsets: dict[str, int]) -> bytes:
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[
        helper.make_opsetid(domain, version) for domain, version in opsets.items()])
    model.ir_version = 8
    return bytes(model.SerializeToString())


def inverse_onnx(opset: int = 17) -> bytes:
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Inverse", ["x"], ["y"], domain="com.microsoft")], "inverse",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])])
    return model_bytes(graph, {"": opset, "com.microsoft": 1})


def relu_onnx(opset: int) -> bytes:
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])])
    return model_bytes(graph, {"": opset})


def newest_ort_opset() -> int:
    """One past the newest ONNX opset this ONNX Runtime reads, which OpenVINO may."""
    import onnxruntime as ort

    for opset in range(17, 64):
        try:
            ort.InferenceSession(relu_onnx(opset), providers=["CPUExecutionProvider"])
        except Exception:
            return opset
    pytest.skip("this onnxruntime reads every opset up to 63")


def pool(directory: Path, *backends: str) -> Path:
    path = directory / "wasinn.toml"
    listed = ", ".join(f'"{name}"' for name in backends)
    path.write_text(f'[pools.cpu]\nkind = "cpu"\ndevices = ["cpu"]\nbackends = [{listed}]\n')
    return path


async def test_a_contrib_operator_openvino_cannot_convert_runs_on_onnxruntime(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Before: OpenVINO's "No conversion rule found" was an invalid-encoding, which the
    # preference order did not fall back from: onnxruntime, listed next, was never tried.
    async with wasinn.Runtime.from_config(pool(tmp_path, "openvino", "onnxruntime")) as rt:
        with caplog.at_level(logging.WARNING, logger="wasinn.scheduler"):
            graph = await rt.load([inverse_onnx()], "onnx", name="inverse")
        assert graph.backend == "onnxruntime"
        out = await graph.compute({"x": INVERSE_X})
        np.testing.assert_allclose(np.diag(out["y"].numpy()), [0.5, 0.25, 0.2, 0.125])
        (warning,) = [r.getMessage() for r in caplog.records]
        assert warning.startswith("inverse: backend openvino cannot run it on cpu (openvino: "
                                  "cannot convert the ONNX model: ")
        assert "com.microsoft.Inverse" in warning
        assert warning.endswith("): it runs on onnxruntime instead")
        # Named, the library's refusal is what it is: an operator it cannot convert.
        with pytest.raises(UnsupportedOperationError) as caught:
            await rt.load([inverse_onnx()], "onnx", backend="openvino")
        assert "No conversion rule found for operations: com.microsoft.Inverse" in (
            caught.value.message)
        assert caught.value.message.endswith(": expected operators OpenVINO's frontend "
                                             "converts")


async def test_an_opset_onnxruntime_does_not_read_runs_on_openvino(tmp_path: Path) -> None:
    opset = newest_ort_opset()
    async with wasinn.Runtime.from_config(pool(tmp_path, "onnxruntime", "openvino")) as rt:
        graph = await rt.load([relu_onnx(opset)], "onnx")
        assert graph.backend == "openvino"
        out = await graph.compute({"x": -np.ones((2, 4), np.float32)})
        assert out["y"].numpy().tolist() == [[0.0] * 4] * 2
        with pytest.raises(UnsupportedOperationError) as caught:
            await rt.load([relu_onnx(opset)], "onnx", backend="onnxruntime")
        assert caught.value.message.startswith(
            "onnxruntime: the model is newer than this ONNX Runtime reads: ")
        assert caught.value.message.endswith(
            ": expected an opset and IR version it supports (a newer onnxruntime may)")


async def test_where_no_library_can_the_error_gives_each_ones_reason(tmp_path: Path) -> None:
    # Before: "... (nor could openvino)", without OpenVINO's reason.
    opset = newest_ort_opset()
    async with wasinn.Runtime.from_config(pool(tmp_path, "onnxruntime", "openvino")) as rt:
        with pytest.raises(UnsupportedOperationError) as caught:
            await rt.load([inverse_onnx(opset)], "onnx")
    message: Any = caught.value.message
    first, _, rest = message.partition(" (nor could openvino: cannot convert the ONNX model: ")
    assert first.startswith("onnxruntime: the model is newer than this ONNX Runtime reads")
    assert "No conversion rule found for operations: com.microsoft.Inverse" in rest
    assert rest.endswith(": expected operators OpenVINO's frontend converts)")
