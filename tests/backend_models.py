"""Tiny models for the backend tests, one per backend: ``(builders, encoding)`` pairs.

ONNX Runtime and OpenVINO read the ``onnx.helper`` graphs of :mod:`wasinn.modelgen`;
OpenVINO also reads them as IR (converted here); PyTorch reads ``torch.export`` archives
of equivalent modules (they record element types and shapes, unlike TorchScript).
"""

from __future__ import annotations

import inspect
import io
import tempfile
from pathlib import Path
from typing import Any

from wasinn import GraphEncoding, TensorType
from wasinn.modelgen import affine_onnx, identity_onnx, onnx_model_bytes

Model = tuple[list[bytes], GraphEncoding]


def scripted(module: Any) -> bytes:
    """``module`` (a torch.nn.Module) as a TorchScript archive."""
    import torch

    buf = io.BytesIO()
    torch.jit.save(torch.jit.script(module), buf)
    return buf.getvalue()


def exported(module: Any, example: Any, dynamic_batch: bool = True) -> bytes:
    import torch

    names = list(inspect.signature(module.forward).parameters)
    dynamic = {n: {0: torch.export.Dim("n")} for n in names} if dynamic_batch else None
    program = torch.export.export(module, example, dynamic_shapes=dynamic)
    buf = io.BytesIO()
    torch.export.save(program, buf)
    return buf.getvalue()


def _torch_dtype(ttype: TensorType) -> Any:
    import torch

    return {
        TensorType.F16: torch.float16, TensorType.F32: torch.float32,
        TensorType.F64: torch.float64, TensorType.BF16: torch.bfloat16,
        TensorType.U8: torch.uint8, TensorType.I32: torch.int32, TensorType.I64: torch.int64,
    }[ttype]


def identity(backend: str, ttype: TensorType) -> Model:
    """``y = x`` over ``(n, 4)`` of ``ttype``: input ``x``, output ``y`` (torch: ``output``)."""
    if backend == "pytorch":
        import torch

        class Identity(torch.nn.Module):
            def forward(self, x: Any) -> Any:
                return x

        example = (torch.zeros(2, 4, dtype=_torch_dtype(ttype)),)
        return [exported(Identity(), example)], GraphEncoding.PYTORCH
    return [identity_onnx(ttype)], GraphEncoding.ONNX


def affine(backend: str, scale: float, bias: float, in_name: str = "x",
           out_name: str = "y") -> Model:
    """``out = in * scale + bias`` over f32 ``(n, 4)``.

    The names apply to ONNX; a torch.export program's are always ``x`` and ``output``.
    """
    if backend == "pytorch":
        import torch

        class Affine(torch.nn.Module):
            def forward(self, x: Any) -> Any:
                return x * scale + bias

        return [exported(Affine(), (torch.zeros(2, 4),))], GraphEncoding.PYTORCH
    return [affine_onnx(scale, bias, in_name=in_name, out_name=out_name)], GraphEncoding.ONNX


def affine_ir(scale: float, bias: float) -> Model:
    """The affine ONNX graph converted to OpenVINO IR (xml, bin)."""
    import openvino as ov

    with tempfile.TemporaryDirectory() as tmp:
        onnx_path = Path(tmp) / "affine.onnx"
        onnx_path.write_bytes(affine_onnx(scale, bias))
        xml = Path(tmp) / "affine.xml"
        ov.save_model(ov.convert_model(str(onnx_path)), str(xml), compress_to_fp16=False)
        return [xml.read_bytes(), xml.with_suffix(".bin").read_bytes()], GraphEncoding.OPENVINO


def two_outputs(backend: str) -> tuple[list[bytes], GraphEncoding, tuple[str, str]]:
    """``(x, -x)`` over f32 ``(n, 4)``, and the two output names."""
    if backend == "pytorch":
        import torch

        class Pair(torch.nn.Module):
            def forward(self, x: Any) -> Any:
                return x + 0, -x

        return ([exported(Pair(), (torch.zeros(2, 4),))], GraphEncoding.PYTORCH,
                ("output_0", "output_1"))
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["n", 4]) for n in ("a", "b")]
    nodes = [helper.make_node("Identity", ["x"], ["a"]), helper.make_node("Neg", ["x"], ["b"])]
    graph = helper.make_graph(nodes, "pair", [x], outs)
    return [onnx_model_bytes(graph)], GraphEncoding.ONNX, ("a", "b")


def scalar_onnx(scale: float = 2.0, declared: bool = True) -> bytes:
    """``y = x * scale`` in ONNX over f32 scalars: ``x: f32[]``, ``y: f32[]``; with
    ``declared=False`` x and y are declared without a shape (their rank unknown)."""
    from onnx import TensorProto, helper

    shape: list[int] | None = [] if declared else None
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)
    factor = helper.make_tensor("scale", TensorProto.FLOAT, [], [scale])
    graph = helper.make_graph([helper.make_node("Mul", ["x", "scale"], ["y"])], "scalar",
                              [x], [y], initializer=[factor])
    return onnx_model_bytes(graph)


def scalar(backend: str, scale: float = 2.0) -> tuple[list[bytes], GraphEncoding, str]:
    """``y = x * scale`` over f32 scalars (rank 0), and the output's name (torch:
    ``output``)."""
    if backend == "pytorch":
        import torch

        class Scale(torch.nn.Module):
            def forward(self, x: Any) -> Any:
                return x * scale

        example = (torch.tensor(1.0),)
        return [exported(Scale(), example, dynamic_batch=False)], GraphEncoding.PYTORCH, "output"
    return [scalar_onnx(scale)], GraphEncoding.ONNX, "y"
