"""Fixtures every component-guest test module shares: the models a guest may load by
name, and a runtime serving them. Import them into a test module to use them."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

import wasinn
from tests.component_guests import RecordingRuntime, component_models
from tests.support import require_backend
from wasinn.configs.schema import RuntimeConfig
from wasinn.modelgen import ModelFiles


@pytest.fixture(scope="session")
def nn_config(tmp_path_factory: pytest.TempPathFactory, small_mobilenet: ModelFiles
              ) -> RuntimeConfig:
    return component_models(tmp_path_factory.mktemp("component-models"), small_mobilenet.onnx)


@pytest.fixture
async def rt(nn_config: RuntimeConfig) -> AsyncIterator[RecordingRuntime]:
    require_backend("onnxruntime")
    async with wasinn.Runtime(nn_config) as runtime:
        yield RecordingRuntime(runtime)
