"""Models generated offline, for tests, benchmarks, examples and the demo.

wasinn never downloads a model: this module builds a MobileNetV2-like network in plain
torch (fixed seed) and exports it to ONNX, TorchScript and OpenVINO IR, and builds tiny
``onnx.helper`` graphs for the element-type matrix. It needs the ``torch``, ``onnx`` and
``openvino`` packages (the ``all`` and ``dev`` extras) and imports them only when called.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from wasinn.enums import TensorType

#: Input and output names of the generated classifier, shared by every export.
INPUT_NAME = "input"
OUTPUT_NAME = "output"
NUM_CLASSES = 1000
IMAGE_SHAPE = (1, 3, 224, 224)
#: Which weights :func:`mobilenet_v2` makes (part of the exported files' names).
GENERATION = "g2"


@dataclass(frozen=True)
class ModelFiles:
    """One network exported three ways."""

    onnx: Path
    torchscript: Path
    ir_xml: Path
    ir_bin: Path


def _make_divisible(v: float, divisor: int = 8) -> int:
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < 0.9 * v else new_v


def mobilenet_v2(width: float = 1.0, seed: int = 0, num_classes: int = NUM_CLASSES) -> Any:
    """A MobileNetV2-shaped torch module (inverted residuals, ReLU6), eval mode, fixed seed."""
    import torch
    from torch import nn

    def conv_bn(inp: int, out: int, k: int, stride: int, groups: int = 1, act: bool = True) -> Any:
        layers: list[Any] = [
            nn.Conv2d(inp, out, k, stride, k // 2, groups=groups, bias=False),
            nn.BatchNorm2d(out),
        ]
        if act:
            layers.append(nn.ReLU6(inplace=True))
        return nn.Sequential(*layers)

    class InvertedResidual(nn.Module):
        def __init__(self, inp: int, out: int, stride: int, expand: int) -> None:
            super().__init__()
            hidden = inp * expand
            self.use_res = stride == 1 and inp == out
            layers: list[Any] = []
            if expand != 1:
                layers.append(conv_bn(inp, hidden, 1, 1))
            layers += [conv_bn(hidden, hidden, 3, stride, groups=hidden),
                       conv_bn(hidden, out, 1, 1, act=False)]
            self.conv = nn.Sequential(*layers)

        def forward(self, x: Any) -> Any:
            return x + self.conv(x) if self.use_res else self.conv(x)

    class MobileNetV2(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            settings = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
                        (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]
            inp = _make_divisible(32 * width)
            last = _make_divisible(1280 * max(1.0, width))
            feats: list[Any] = [conv_bn(3, inp, 3, 2)]
            for t, c, n, s in settings:
                out = _make_divisible(c * width)
                for i in range(n):
                    feats.append(InvertedResidual(inp, out, s if i == 0 else 1, t))
                    inp = out
            feats.append(conv_bn(inp, last, 1, 1))
            self.features = nn.Sequential(*feats)
            self.classifier = nn.Linear(last, num_classes)

        def forward(self, x: Any) -> Any:
            x = self.features(x)
            x = nn.functional.adaptive_avg_pool2d(x, 1).flatten(1)
            return self.classifier(x)

    torch.manual_seed(seed)
    model = MobileNetV2()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.Conv2d):
                # He-normal over each filter's fan-in (a depthwise filter's is 9): with
                # torch's default initialisation the input's part of the signal shrinks
                # about 10x per stage while the batch-norm offsets stay, and the outputs
                # come out the same whatever the image (to 1e-7), so a test comparing
                # them could not tell a right input from a wrong one.
                fan_in = mod.weight[0].numel()
                mod.weight.normal_(0.0, (2.0 / fan_in) ** 0.5, generator=gen)
            elif isinstance(mod, nn.Linear):
                mod.weight.normal_(0.0, mod.in_features ** -0.5, generator=gen)
                assert mod.bias is not None
                mod.bias.zero_()
            elif isinstance(mod, nn.BatchNorm2d):
                # Non-trivial statistics so that eval mode is not an identity.
                assert mod.running_mean is not None and mod.running_var is not None
                mod.running_mean.copy_(torch.randn(mod.num_features, generator=gen) * 0.1)
                mod.running_var.copy_(torch.rand(mod.num_features, generator=gen) + 0.5)
    return model.eval()


def export_mobilenet(directory: Path | str, width: float = 1.0, seed: int = 0) -> ModelFiles:
    """Export the MobileNetV2-like network to ONNX, TorchScript and OpenVINO IR in ``directory``.

    Files already there from an earlier call with the same arguments are reused. Each is
    written under a temporary name and renamed into place, so an interrupted export leaves
    no partial model that a later call would reuse.
    """
    import warnings

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # The generation tag changes whenever the network's weights do: cached files of an
    # older generation are not reused.
    stem = f"mobilenet_{GENERATION}_w{width:g}_s{seed}"
    files = ModelFiles(directory / f"{stem}.onnx", directory / f"{stem}.pt",
                       directory / f"{stem}.xml", directory / f"{stem}.bin")
    if all(p.exists() for p in (files.onnx, files.torchscript, files.ir_xml, files.ir_bin)):
        return files
    import torch

    model = mobilenet_v2(width, seed)
    example = torch.zeros(IMAGE_SHAPE)
    _export_onnx(model, files.onnx)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            traced = torch.jit.trace(model, example)  # type: ignore[no-untyped-call]
        tmp = files.torchscript.with_suffix(f".pt.{os.getpid()}")
        traced.save(str(tmp))
        tmp.replace(files.torchscript)
    import openvino as ov

    # Through temporary names too: an interrupted save must not leave a truncated IR that
    # the check above would take for a finished one. (save_model writes the .bin beside
    # the .xml, under its stem; the .bin is renamed first, so a .xml in place has its .bin.)
    tmp_xml = files.ir_xml.with_name(f"{stem}.{os.getpid()}.partial.xml")
    tmp_bin = tmp_xml.with_suffix(".bin")
    try:
        ov.save_model(ov.convert_model(str(files.onnx)), str(tmp_xml), compress_to_fp16=False)
        tmp_bin.replace(files.ir_bin)
        tmp_xml.replace(files.ir_xml)
    finally:
        tmp_xml.unlink(missing_ok=True)
        tmp_bin.unlink(missing_ok=True)
    return files


def _export_onnx(model: Any, path: Path) -> None:
    """``model`` (the MobileNetV2-like network) exported to ONNX at ``path``, through a
    temporary file: a reader never sees half a model."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tmp = path.with_suffix(f".onnx.{os.getpid()}")
        torch.onnx.export(
            model, (torch.zeros(IMAGE_SHAPE),), str(tmp), opset_version=17,
            input_names=[INPUT_NAME], output_names=[OUTPUT_NAME],
            dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}}, dynamo=False,
        )
        tmp.replace(path)


def sample_image(seed: int = 0, batch: int = 1) -> np.ndarray[Any, Any]:
    """A deterministic f32 "image" in NCHW layout, normalized like ImageNet inputs."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((batch, *IMAGE_SHAPE[1:]), dtype=np.float32)


_ONNX_TYPES = {
    TensorType.F16: 10, TensorType.F32: 1, TensorType.F64: 11, TensorType.BF16: 16,
    TensorType.U8: 2, TensorType.I32: 6, TensorType.I64: 7,
}


def onnx_model_bytes(graph: Any, opset: int = 17) -> bytes:
    """``graph`` (an onnx GraphProto) as a serialized model: IR version 8, which every
    backend here reads, and the default domain at ``opset``. Also for tests that build
    their own graphs."""
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                              producer_name="wasinn.modelgen")
    model.ir_version = 8
    return bytes(model.SerializeToString())


def identity_onnx(tensor_type: TensorType, shape: tuple[int | str, ...] = ("n", 4),
                  opset: int = 17) -> bytes:
    """A one-node ONNX graph ``y = Identity(x)`` of ``tensor_type``; x, y are its names."""
    from onnx import TensorProto, helper

    elem = _ONNX_TYPES[tensor_type]
    assert TensorProto.DataType.Name(elem)  # the table above matches onnx's numbering
    x = helper.make_tensor_value_info("x", elem, list(shape))
    y = helper.make_tensor_value_info("y", elem, list(shape))
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "identity", [x], [y])
    return onnx_model_bytes(graph, opset)


def affine_onnx(scale: float = 2.0, bias: float = 1.0, size: int = 4,
                in_name: str = "x", out_name: str = "y") -> bytes:
    """A tiny f32 ONNX graph ``y = x * scale + bias`` over shape (n, size)."""
    from onnx import TensorProto, helper, numpy_helper

    s = numpy_helper.from_array(np.full((size,), scale, np.float32), "scale")
    b = numpy_helper.from_array(np.full((size,), bias, np.float32), "bias")
    nodes = [helper.make_node("Mul", [in_name, "scale"], ["t"]),
             helper.make_node("Add", ["t", "bias"], [out_name])]
    x = helper.make_tensor_value_info(in_name, TensorProto.FLOAT, ["n", size])
    y = helper.make_tensor_value_info(out_name, TensorProto.FLOAT, ["n", size])
    graph = helper.make_graph(nodes, "affine", [x], [y], initializer=[s, b])
    return onnx_model_bytes(graph)


def scale_onnx(factor: float = 0.5, in_name: str = "x", out_name: str = "y") -> bytes:
    """``y = x * factor`` over f32 images ``(n, 3, 224, 224)`` (a preprocessing step)."""
    from onnx import TensorProto, helper, numpy_helper

    k = numpy_helper.from_array(np.array(factor, np.float32), "k")
    x = helper.make_tensor_value_info(in_name, TensorProto.FLOAT, ["n", *IMAGE_SHAPE[1:]])
    y = helper.make_tensor_value_info(out_name, TensorProto.FLOAT, ["n", *IMAGE_SHAPE[1:]])
    graph = helper.make_graph([helper.make_node("Mul", [in_name, "k"], [out_name])],
                              "scale", [x], [y], initializer=[k])
    return onnx_model_bytes(graph)


#: What :func:`example_models` needs: torch builds the MobileNetV2-like network and
#: exports it, onnx writes ``scale.onnx`` (both in ``wasinn[all]``).
EXAMPLE_MODEL_LIBRARIES = ("torch", "onnx")


def example_models(directory: Path | str, width: float = 1.0) -> list[Path]:
    """The model files the example configs name (``configs/pipeline.toml``:
    ``models/scale.onnx`` and ``models/mobilenet.onnx``), written into ``directory``
    (their ``models/`` folder); returns their paths. Raises ImportError, before anything
    is written, where a library of :data:`EXAMPLE_MODEL_LIBRARIES` cannot be imported:
    the configs name both files, and half of them would leave a config that fails later."""
    _import_all(EXAMPLE_MODEL_LIBRARIES, "the example models (scale.onnx, mobilenet.onnx)")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    scale = directory / "scale.onnx"
    scale.write_bytes(scale_onnx())
    mobilenet = directory / "mobilenet.onnx"
    _export_onnx(mobilenet_v2(width, 0), mobilenet)  # only the ONNX file is named
    return [scale, mobilenet]


def _import_all(libraries: tuple[str, ...], what: str) -> None:
    # ImportError naming every library of those needed that cannot be imported, why, and
    # how to install them.
    import importlib

    missing: list[str] = []
    for library in libraries:
        try:
            importlib.import_module(library)
        except ImportError as exc:
            missing.append(f"{library} ({exc})")
    if missing:
        raise ImportError(
            f"generating {what} needs {' and '.join(libraries)}, and cannot import "
            f"{', '.join(missing)}: expected pip install \"wasinn[all]\" (or "
            f"{' and '.join(libraries)} installed beside wasinn)")


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    """``python -m wasinn.modelgen DIR [--width W]``: :func:`example_models` into DIR."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m wasinn.modelgen",
        description="Write the models the example configs name into DIR (their models/ "
                    "folder): scale.onnx and a MobileNetV2-like mobilenet.onnx. Needs torch "
                    "and onnx (pip install \"wasinn[all]\"); without them it writes "
                    "nothing and exits with status 1.")
    parser.add_argument("directory", metavar="DIR")
    parser.add_argument("--width", type=float, default=1.0,
                        help="MobileNetV2 width multiplier (default 1.0)")
    args = parser.parse_args(argv)
    try:
        paths = example_models(args.directory, args.width)
    except ImportError as exc:  # (as wasinn demo says it: one line, not a traceback)
        parser.exit(1, f"{parser.prog}: error: {exc}\n")
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
