"""The packaged example configs, copied next to generated models so that they load.

Model files cannot ship in the package: the examples name files relative to the config
(``models/...``), and :func:`example_config` copies a config into a directory and writes
those files there.
"""

from __future__ import annotations

import importlib.resources
import shutil
from pathlib import Path

from wasinn.modelgen import ModelFiles, scale_onnx


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
