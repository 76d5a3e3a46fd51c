"""PyTorch specifics: TorchScript naming, torch.export specs, torch natives, CUDA."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest

import wasinn
from tests import backend_models
from tests.support import require_backend, require_gpu
from wasinn import (
    GraphEncoding,
    InvalidArgumentError,
    Tensor,
    TensorType,
    UnsupportedOperationError,
)
from wasinn.backends import Device, LoadOptions
from wasinn.modelgen import ModelFiles, sample_image

pytestmark = pytest.mark.usefixtures("_torch")

CPU = Device.parse("cpu")
PT = GraphEncoding.PYTORCH


@pytest.fixture
def _torch() -> None:
    require_backend("torch")


@pytest.fixture
def backend() -> Any:
    from wasinn.backends.pytorch import TorchBackend

    return TorchBackend()


def _scripted(module: Any) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.jit.save(torch.jit.script(module), buf)
    return buf.getvalue()


def _pair_module() -> Any:
    import torch

    class Pair(torch.nn.Module):
        def forward(self, image: torch.Tensor, offset: torch.Tensor, scale: float = 2.0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
            return image * scale + offset, image.sum(dim=1)

    return Pair()


def test_torchscript_names_come_from_forward(backend: Any) -> None:
    graph = backend.load([_scripted(_pair_module())], PT, CPU)
    assert [s.name for s in graph.inputs] == ["image", "offset"]  # self and scale skipped
    assert [s.name for s in graph.outputs] == ["output_0", "output_1"]
    image = Tensor.from_numpy(np.ones((2, 3), np.float32))
    offset = Tensor.from_numpy(np.full((2, 3), 0.5, np.float32))
    by_name = graph.run({"image": image, "offset": offset})
    np.testing.assert_allclose(by_name["output_0"].numpy(), np.full((2, 3), 2.5))
    np.testing.assert_allclose(by_name["output_1"].numpy(), [3.0, 3.0])
    by_index = graph.run({0: image, 1: offset}, outputs=["output_1"])
    assert list(by_index) == ["output_1"]


def test_torchscript_specs_have_an_unknown_rank_not_rank_0(backend: Any) -> None:
    graph = backend.load([_scripted(_pair_module())], PT, CPU)
    specs = (*graph.inputs, *graph.outputs)
    assert [(s.shape, s.rank_known) for s in specs] == [((), False)] * 4
    assert [s.describe() for s in graph.inputs] == ["image: f32[...]", "offset: f32[...]"]
    scalar = Tensor.from_numpy(np.float32(1))  # any rank goes through: here, rank 0
    out = graph.run({"image": Tensor.from_numpy(np.ones((2, 3), np.float32)), "offset": scalar})
    assert out["output_0"].dims == (2, 3)


def test_single_output_is_named_output(backend: Any, small_mobilenet: ModelFiles) -> None:
    graph = backend.load([small_mobilenet.torchscript.read_bytes()], PT, CPU)
    assert [s.name for s in graph.inputs] == ["x"]
    assert [s.name for s in graph.outputs] == ["output"]
    (out,) = graph.run({"x": Tensor.from_numpy(sample_image())}).values()
    assert out.dims == (1, 1000)


def test_torchscript_rejecting_its_inputs_is_invalid_argument(
    backend: Any, small_mobilenet: ModelFiles
) -> None:
    graph = backend.load([small_mobilenet.torchscript.read_bytes()], PT, CPU)
    with pytest.raises(InvalidArgumentError, match=r"rejected its inputs .*f32\[1, 3, 4\]"):
        graph.run({"x": Tensor.from_numpy(np.zeros((1, 3, 4), np.float32))})
    with pytest.raises(InvalidArgumentError, match="no input 'image'"):
        graph.run({"image": Tensor.from_numpy(sample_image())})


def test_optimization_can_be_turned_off(backend: Any, small_mobilenet: ModelFiles) -> None:
    data = small_mobilenet.torchscript.read_bytes()
    image = Tensor.from_numpy(sample_image())
    plain = backend.load([data], PT, CPU, LoadOptions(extra={"optimize": False}))
    optimized = backend.load([data], PT, CPU)
    a, b = (g.run({"x": image})["output"].numpy() for g in (plain, optimized))
    assert np.abs(a - b).max() <= 1e-4


def test_dict_outputs_are_unsupported(backend: Any) -> None:
    import torch

    class Named(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"y": x}

    with pytest.raises(UnsupportedOperationError, match="expected a Tensor or a tuple"):
        backend.load([_scripted(Named())], PT, CPU)


def test_exported_program_reports_types_and_dynamic_dims(backend: Any) -> None:
    builders, encoding = backend_models.identity("pytorch", TensorType.I32)
    graph = backend.load(builders, encoding, CPU)
    assert [s.describe() for s in graph.inputs] == ["x: i32[?, 4]"]
    assert [s.describe() for s in graph.outputs] == ["output: i32[?, 4]"]


def test_identity_output_does_not_alias_the_input(backend: Any) -> None:
    builders, encoding = backend_models.identity("pytorch", TensorType.F32)
    graph = backend.load(builders, encoding, CPU)
    arr = np.ones((2, 4), np.float32)
    (out,) = graph.run({"x": Tensor.from_numpy(arr)}).values()
    assert not np.shares_memory(out.numpy(), arr)


def test_read_only_input_memory_is_accepted(backend: Any) -> None:
    builders, encoding = backend_models.affine("pytorch", 2.0, 1.0)
    graph = backend.load(builders, encoding, CPU)
    x = Tensor.from_bytes([1, 4], "f32", np.ones(4, np.float32).tobytes())  # read-only view
    (out,) = graph.run({"x": x}).values()
    np.testing.assert_allclose(out.numpy(), [[3, 3, 3, 3]])


def test_keep_on_device_returns_torch_tensors(backend: Any) -> None:
    import torch

    builders, encoding = backend_models.affine("pytorch", 2.0, 1.0)
    graph = backend.load(builders, encoding, CPU)
    (out,) = graph.run({"x": Tensor.from_numpy(np.ones((1, 4), np.float32))},
                       keep_on_device=True).values()
    assert isinstance(out.native, torch.Tensor) and out.device == "cpu"


@pytest.mark.gpu
def test_cuda_runs_and_chains_on_the_gpu(backend: Any, small_mobilenet: ModelFiles) -> None:
    require_gpu()
    gpu = Device.parse("gpu:0")
    assert gpu in backend.devices()
    first_b, enc = backend_models.affine("pytorch", 2.0, 1.0)
    second_b, _ = backend_models.affine("pytorch", 3.0, 0.0)
    first, second = backend.load(first_b, enc, gpu), backend.load(second_b, enc, gpu)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    before = wasinn.host_copies()
    (mid,) = first.run({"x": Tensor.from_numpy(x)}, keep_on_device=True).values()
    (out,) = second.run({"x": mid}, keep_on_device=True).values()
    assert mid.device == "gpu:0" and out.native.is_cuda
    assert wasinn.host_copies() == before
    np.testing.assert_allclose(out.numpy(), (x * 2 + 1) * 3)
    net = backend.load([small_mobilenet.torchscript.read_bytes()], PT, gpu)
    cpu_net = backend.load([small_mobilenet.torchscript.read_bytes()], PT, CPU)
    image = Tensor.from_numpy(sample_image())
    diff = np.abs(net.run({"x": image})["output"].numpy()
                  - cpu_net.run({"x": image})["output"].numpy()).max()
    assert diff <= 1e-3
