"""OpenVINO's GPUs: only Intel ones are offered, numbered after the CUDA GPUs.

OpenVINO 2026.4 lists an NVIDIA GPU too (through its OpenCL driver), which its GPU plugin
does not support. The Core here is a real one whose device list and GPU properties are
replaced: a listed GPU compiles on the CPU, and the test records which OpenVINO device
it was asked for.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

import wasinn
from tests.support import require_backend
from wasinn import ExecutionTarget, GraphEncoding, Tensor, UnsupportedOperationError
from wasinn.backends import Device
from wasinn.configs.loader import parse_config
from wasinn.modelgen import affine_onnx

pytestmark = pytest.mark.usefixtures("_openvino")

GPU = ExecutionTarget.GPU
X = np.array([[-1.0, 2.0, -3.0, 4.0]], np.float32)

#: What OpenVINO 2026.4.1 said of the H100 it listed as "GPU" (FULL_DEVICE_NAME as
#: seen there; DEVICE_ARCHITECTURE in the form the GPU plugin writes it).
NVIDIA = {"FULL_DEVICE_NAME": "NVIDIA H100 80GB HBM3 (dGPU)",
          "DEVICE_ARCHITECTURE": "GPU: vendor=0x10de arch=NVIDIA H100 80GB HBM3"}
INTEL = {"FULL_DEVICE_NAME": "Intel(R) UHD Graphics 770 (iGPU)",
         "DEVICE_ARCHITECTURE": "GPU: vendor=0x8086 arch=v12.2.0"}


@pytest.fixture
def _openvino(monkeypatch: pytest.MonkeyPatch) -> None:
    require_backend("openvino")
    from wasinn.backends import _ov_devices

    monkeypatch.setattr(_ov_devices, "_TOLD", set())  # each test sees its own log


class ListingCore:
    """A real ``ov.Core`` that lists ``gpus`` (OpenVINO name -> its properties) beside the
    CPU, and compiles for them on the CPU, noting the device asked for in ``compiled_on``."""

    def __init__(self, gpus: dict[str, dict[str, str]]) -> None:
        import openvino as ov

        self._real = ov.Core()
        self.gpus = gpus
        self.available_devices = ["CPU", *gpus]
        self.compiled_on: list[str] = []

    def get_property(self, name: str, key: str) -> Any:
        if name not in self.gpus:
            return self._real.get_property(name, key)
        if key == "SUPPORTED_PROPERTIES":
            return self._real.get_property("CPU", key)
        try:
            return self.gpus[name][key]
        except KeyError:
            raise RuntimeError(f"Unsupported property {key} by {name}") from None

    def compile_model(self, model: Any, name: str, config: dict[str, Any]) -> Any:
        self.compiled_on.append(name)
        return self._real.compile_model(model, "CPU" if name in self.gpus else name, config)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._real, attr)


def openvino_on(core: ListingCore) -> Any:
    from wasinn.backends.openvino import OpenVinoBackend

    backend = OpenVinoBackend()
    backend._core = core
    return backend


def cuda_gpus(monkeypatch: pytest.MonkeyPatch, count: int, torch_count: int = 0) -> None:
    """Make the CUDA driver report ``count`` GPUs to the OpenVINO backend, and torch
    ``torch_count`` (none by default: the same on a machine whose torch sees GPUs)."""
    import importlib.util

    from wasinn.backends import cuda

    monkeypatch.setattr(cuda, "device_count", lambda: count)
    if importlib.util.find_spec("torch") is not None:
        import torch

        monkeypatch.setattr(torch.cuda, "is_available", lambda: torch_count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: torch_count)


def names(devices: list[Device]) -> list[str]:
    return [d.name for d in devices]


def test_an_nvidia_gpu_openvino_lists_is_not_offered(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    cuda_gpus(monkeypatch, 1)
    with caplog.at_level(logging.INFO, logger="wasinn.backends"):
        assert names(openvino_on(ListingCore({"GPU": NVIDIA})).devices()) == ["cpu"]
        assert names(openvino_on(ListingCore({"GPU": NVIDIA})).devices()) == ["cpu"]
    told = [r for r in caplog.records if "not offered" in r.getMessage()]
    assert len(told) == 1, "said once per process"
    assert told[0].levelno == logging.INFO
    assert told[0].getMessage() == (
        "openvino: GPU (NVIDIA H100 80GB HBM3 (dGPU)) has vendor id 0x10de, not Intel's "
        "0x8086, and OpenVINO's GPU plugin supports Intel GPUs only: GPU is not offered "
        "as a gpu device (CUDA GPUs run on pytorch, or on onnxruntime with "
        "onnxruntime-gpu)")


def test_a_load_on_that_gpu_says_why_it_is_not_there(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda_gpus(monkeypatch, 1)
    core = ListingCore({"GPU": NVIDIA})
    with pytest.raises(UnsupportedOperationError) as caught:
        openvino_on(core).load([affine_onnx()], GraphEncoding.ONNX, Device(GPU, 0))
    assert caught.value.message == (
        "openvino: no device gpu:0 here: expected one of cpu (GPU (NVIDIA H100 80GB HBM3 "
        "(dGPU)) has vendor id 0x10de, not Intel's 0x8086: OpenVINO's GPU plugin supports "
        "Intel GPUs only)")
    assert core.compiled_on == []


@pytest.mark.parametrize(("cuda", "expected"), [(1, "gpu:1"), (2, "gpu:2"), (0, "gpu:0")])
def test_an_intel_gpu_comes_after_the_cuda_gpus(
        monkeypatch: pytest.MonkeyPatch, cuda: int, expected: str) -> None:
    # OpenVINO calls an integrated Intel GPU GPU.0 always; the CUDA GPUs have gpu:0...
    cuda_gpus(monkeypatch, cuda)
    core = ListingCore({"GPU.0": INTEL, "GPU.1": NVIDIA})
    backend = openvino_on(core)
    assert names(backend.devices()) == ["cpu", expected]
    graph = backend.load([affine_onnx(2.0, 1.0)], GraphEncoding.ONNX, Device.parse(expected))
    assert core.compiled_on == ["GPU.0"]
    (out,) = graph.run({"x": Tensor.from_numpy(X)}).values()
    np.testing.assert_allclose(out.numpy(), X * 2 + 1)


def test_an_intel_gpu_comes_after_the_gpus_torch_numbers_where_the_cuda_driver_sees_none(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A ROCm build of torch numbers AMD GPUs gpu:0, gpu:1 through torch.cuda, which the
    # CUDA driver does not see: before, the Intel GPU was a second gpu:0 (one actor for
    # two devices).
    pytest.importorskip("torch")
    cuda_gpus(monkeypatch, 0, torch_count=2)
    assert names(openvino_on(ListingCore({"GPU.0": INTEL})).devices()) == ["cpu", "gpu:2"]


def test_intel_gpus_keep_openvinos_order(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda_gpus(monkeypatch, 1)
    backend = openvino_on(ListingCore({"GPU.0": INTEL, "GPU.1": NVIDIA, "GPU.2": INTEL}))
    assert names(backend.devices()) == ["cpu", "gpu:1", "gpu:2"]
    assert backend._listed().offered[Device(GPU, 2)] == "GPU.2"


@pytest.mark.parametrize(
    ("properties", "offered"),
    [
        ({"FULL_DEVICE_NAME": "Intel(R) Arc(TM) A770 Graphics (dGPU)"}, True),
        ({"FULL_DEVICE_NAME": "NVIDIA H100 80GB HBM3 (dGPU)"}, False),
        ({"DEVICE_ARCHITECTURE": "GPU: vendor=0x8086 arch=v12.55.8"}, True),
        ({"DEVICE_ARCHITECTURE": "GPU: vendor=0x1002 arch=gfx1100"}, False),  # AMD
        # a vendor id outranks the name
        ({"DEVICE_ARCHITECTURE": "GPU: vendor=0x10de arch=x", "FULL_DEVICE_NAME": "Intel"},
         False),
        # an architecture without a vendor id: the name decides
        ({"DEVICE_ARCHITECTURE": "GPU: arch=v12.0.0",
          "FULL_DEVICE_NAME": "Intel(R) Graphics [0x9a49] (iGPU)"}, True),
        ({}, False),  # neither can be read
        ({"DEVICE_ARCHITECTURE": "", "FULL_DEVICE_NAME": " "}, False),
    ],
    ids=["intel-name", "nvidia-name", "intel-vendor", "amd-vendor", "vendor-first",
         "no-vendor-id", "no-properties", "empty-properties"],
)
def test_the_vendor_is_read_from_what_openvino_reports(
        monkeypatch: pytest.MonkeyPatch, properties: dict[str, str], offered: bool) -> None:
    cuda_gpus(monkeypatch, 0)
    backend = openvino_on(ListingCore({"GPU": properties}))
    assert names(backend.devices()) == (["cpu", "gpu:0"] if offered else ["cpu"])


def test_a_gpu_without_properties_is_passed_over_saying_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cuda_gpus(monkeypatch, 0)
    listed = openvino_on(ListingCore({"GPU.1": {}}))._listed()
    assert listed.passed_over == {"GPU.1": "OpenVINO reports neither the vendor "
                                           "(DEVICE_ARCHITECTURE) nor the name "
                                           "(FULL_DEVICE_NAME) of GPU.1"}


def test_the_registry_chooses_another_backend_for_the_gpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from wasinn.backends.registry import BackendRegistry

    cuda_gpus(monkeypatch, 1)
    registry = BackendRegistry(("openvino",), extra=[openvino_on(ListingCore({"GPU": NVIDIA}))],
                               discover_plugins=False)
    assert not registry.has_device("openvino", GPU)
    with pytest.raises(UnsupportedOperationError,
                       match=r"^no backend runs openvino on gpu: .*openvino: no gpu device here"):
        registry.choose_name(GraphEncoding.OPENVINO, GPU)
    mixed = BackendRegistry(("openvino",), discover_plugins=False,
                            extra=[openvino_on(ListingCore({"GPU.0": INTEL, "GPU.1": NVIDIA}))])
    backend, devices = mixed.choose(GraphEncoding.OPENVINO, GPU)
    assert backend.name == "openvino" and names(devices) == ["gpu:1"]


def gpu_config() -> Any:
    return parse_config({"pools": {
        "cpu": {"kind": "cpu", "devices": ["cpu"]},
        "gpu": {"kind": "gpu", "devices": "auto", "backends": ["openvino"]},
    }}, None)


async def test_no_gpu_actor_for_a_gpu_openvino_cannot_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cuda_gpus(monkeypatch, 1)
    core = ListingCore({"GPU": NVIDIA})
    async with wasinn.Runtime(gpu_config(), backends=[openvino_on(core)]) as rt:
        assert names(rt.devices) == ["cpu"]
        with pytest.raises(UnsupportedOperationError, match="no gpu device in this runtime"):
            await rt.load([affine_onnx()], "onnx", "gpu")
    assert core.compiled_on == []


async def test_an_intel_gpu_beside_an_nvidia_one_is_placed_as_gpu1(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cuda_gpus(monkeypatch, 1)
    core = ListingCore({"GPU.0": INTEL, "GPU.1": NVIDIA})
    async with wasinn.Runtime(gpu_config(), backends=[openvino_on(core)]) as rt:
        assert names(rt.devices) == ["cpu", "gpu:1"]
        graph = await rt.load([affine_onnx(2.0, 1.0)], "onnx", "gpu")
        out = await graph.init_execution_context().compute({"x": X})
        np.testing.assert_allclose(out["y"].numpy(), X * 2 + 1)
    assert core.compiled_on == ["GPU.0"]
