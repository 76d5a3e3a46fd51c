"""The packaged example configs, copied next to generated models so that they load.

Model files cannot ship in the package: the examples name files relative to the config
(``models/...``), and :func:`example_config` copies a config into a directory and writes
those files there.
"""

from __future__ import annotations

import importlib.resources
import shutil
from pathlib import Path

from wasinn.modelgen import ModelFiles


def scale_onnx(factor: float = 0.5, in_name: str = "x", out_name: str = "y") -> bytes:
    """``y = x * factor`` over f32 images ``(n, 3, 224, 224)`` (a preprocessing step)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    k = numpy_helper.from_array(np.array(factor, np.float32), "k")
    x = helper.make_tensor_value_info(in_name, TensorProto.FLOAT, ["n", 3, 224, 224])
    y = helper.make_tensor_value_info(out_name, TensorProto.FLOAT, ["n", 3, 224, 224])
    graph = helper.make_graph([helper.make_node("Mul", [in_name, "k"], [out_name])],
                              "scale", [x], [y], initializer=[k])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


def packaged_dir() -> Path:
    return Path(str(importlib.resources.files("wasinn.configs")))


def example_config(name: str, directory: Path, mobilenet: ModelFiles) -> Path:
    """Copy packaged config ``name`` into ``directory`` with the models it names."""
    target = directory / name
    shutil.copy(packaged_dir() / name, target)
    models = directory / "models"
    models.mkdir(exist_ok=True)
    (models / "scale.onnx").write_bytes(scale_onnx())
    shutil.copy(mobilenet.onnx, models / "mobilenet.onnx")
    return target
