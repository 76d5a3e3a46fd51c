"""The built-in backends, made in a process where asking which devices there are fails: for
the tests that a CPU graph's sandbox process asks its library no such thing (listing
loads the GPUs' drivers, which the lock-down made fail, crash or hang there).

Each backend's constructor sets the traps, in the process that makes it (a sandbox
process: :func:`wasinn.backends._sandbox_child._make`), on what lists devices: torch's
``cuda.is_available`` and ``cuda.device_count`` as a CUDA build of torch has them
(answered without the CUDA driver or NVML only where ``CUDA_VISIBLE_DEVICES`` names no
GPU and ``PYTORCH_NVML_BASED_CUDA_CHECK`` is 1: a CPU build asks no one), OpenVINO's
``Core.available_devices`` and ``get_available_devices`` and its properties of a device
other than the CPU, and the CUDA driver's count (``wasinn.backends.cuda.device_count``,
which ONNX Runtime's and OpenVINO's backends ask). A trap raises :class:`Listed`, naming
what was asked. Each class is made when a ``BackendRef`` to it (:data:`ENTRIES`) is first
resolved, importing its library only.
"""

from __future__ import annotations

from typing import Any

from wasinn.backends import cuda


class Listed(RuntimeError):
    """A device listing was asked for where none may be."""


def _trap(what: str) -> Any:
    def asked(*args: object, **kwargs: object) -> Any:
        raise Listed(f"{what} was asked for the devices")

    return asked


def _trap_cuda_driver() -> None:
    vars(cuda)["device_count"] = _trap("the CUDA driver")


def _onnxruntime() -> Any:
    from wasinn.backends.onnxruntime import OnnxRuntimeBackend

    class TrappedOnnxRuntime(OnnxRuntimeBackend):
        def __init__(self) -> None:
            super().__init__()
            _trap_cuda_driver()

    return TrappedOnnxRuntime


def _openvino() -> Any:
    import openvino as ov

    from wasinn.backends.openvino import OpenVinoBackend

    class TrappedOpenVino(OpenVinoBackend):
        def __init__(self) -> None:
            super().__init__()
            _trap_cuda_driver()
            core: Any = ov.Core
            core.available_devices = property(_trap("openvino.Core.available_devices"))
            core.get_available_devices = _trap("openvino.Core.get_available_devices")
            real = core.get_property

            def get_property(self: Any, device: object, *args: Any) -> Any:
                if str(device).split(".")[0] != "CPU":
                    raise Listed(f"openvino.Core.get_property was asked of {device}")
                return real(self, device, *args)

            core.get_property = get_property

    return TrappedOpenVino


def _pytorch() -> Any:
    import torch

    from wasinn.backends.pytorch import TorchBackend

    class TrappedTorch(TorchBackend):
        def __init__(self) -> None:
            super().__init__()
            # As a CUDA build of torch answers (a CPU build asks no one): without the
            # driver or NVML only where no GPU is visible and NVML is to be asked first.
            for name, none in (("is_available", False), ("device_count", 0)):
                vars(torch.cuda)[name] = _as_cuda_torch(torch, name, none)

    return TrappedTorch


def _as_cuda_torch(torch: Any, name: str, none: object) -> Any:
    asked = _trap(f"torch.cuda.{name}")

    def answer() -> object:
        if torch.cuda._nvml_based_avail() and not torch.cuda._parse_visible_devices():
            return none
        return asked()

    return answer


#: Each backend's class, by the name a BackendRef gives (``tests.listing_traps:NAME``),
#: made when first asked for: only its own library is imported.
_MAKERS = {"TrappedOnnxRuntime": _onnxruntime, "TrappedOpenVino": _openvino,
           "TrappedTorch": _pytorch}

#: The built-in backends' names, and the entry of each one's trapped class.
ENTRIES = {"onnxruntime": "tests.listing_traps:TrappedOnnxRuntime",
           "openvino": "tests.listing_traps:TrappedOpenVino",
           "pytorch": "tests.listing_traps:TrappedTorch"}


def __getattr__(name: str) -> Any:
    if name not in _MAKERS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    made = globals()[name] = _MAKERS[name]()
    return made
