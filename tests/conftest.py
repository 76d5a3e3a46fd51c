"""Fixtures shared by every test module: generated models, cached once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import require_gpu
from wasinn.modelgen import ModelFiles, export_mobilenet

# `nn_config` and `rt` for the component-guest tests (a module's own fixtures of the same
# name take precedence).
pytest_plugins = ["tests.component_fixtures"]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def mobilenet(model_dir: Path) -> ModelFiles:
    """The MobileNetV2-like network (width 1.0, seed 0) as ONNX, TorchScript and IR."""
    return export_mobilenet(model_dir, width=1.0, seed=0)


@pytest.fixture(scope="session")
def small_mobilenet(model_dir: Path) -> ModelFiles:
    """A narrower MobileNetV2-like network (width 0.35) for quick tests."""
    return export_mobilenet(model_dir, width=0.35, seed=1)


@pytest.fixture
def gpu() -> None:
    """Skip (with its reason) where there is no GPU, fail instead under
    ``WASINN_REQUIRE=gpu``; a sync fixture, so the reason shows."""
    require_gpu()
