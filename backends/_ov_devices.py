"""Which of OpenVINO's devices the OpenVINO backend offers, and as which wasi-nn devices.

``CPU`` is ``cpu`` and ``NPU`` (``NPU.N``) is ``tpu:N``. The GPU plugin's devices
(``GPU``, ``GPU.N``) are offered only where they are Intel GPUs, the only ones that
plugin supports: OpenVINO 2026.4 lists any GPU an OpenCL driver reports (on a machine
with one NVIDIA H100 it listed ``GPU``, "NVIDIA H100 80GB HBM3 (dGPU)", and a graph
compiled there had no remote context, so its outputs could not stay on the device). The
vendor is read from ``DEVICE_ARCHITECTURE`` (``"GPU: vendor=0x8086 arch=..."``: 0x8086 is
Intel's PCI vendor id), else from ``FULL_DEVICE_NAME`` (a name that says Intel); a GPU
whose vendor neither property tells is not offered either. Each GPU passed over is
logged (info, logger ``wasinn.backends``) once per process, with why.

Numbering: ``gpu:N`` is one index space for every backend (a pool's ``gpu:0`` is one
actor, whichever backend compiles there), in which CUDA GPUs come first, as torch and
ONNX Runtime number them: ``gpu:0`` to ``gpu:n-1``, n being the CUDA driver's count (see
:mod:`wasinn.backends.cuda`), or torch's where it counts more (a ROCm build's AMD GPUs).
The Intel GPUs follow, in OpenVINO's order: ``gpu:n``, ``gpu:n+1``... So an Intel GPU
beside one NVIDIA GPU is ``gpu:1`` (OpenVINO calls an integrated one ``GPU.0`` always,
which would otherwise have been a second ``gpu:0``), and on a machine without CUDA GPUs
OpenVINO's ``GPU.N`` is ``gpu:N`` (with every GPU OpenVINO lists an Intel one). The CUDA
driver (and torch) are asked only where an Intel GPU is found.
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
import threading
from dataclasses import dataclass, field
from typing import Any

from wasinn.enums import ExecutionTarget

from . import cuda
from ._ovread import NAME
from .base import Device, log

#: Intel's PCI vendor id, as ``DEVICE_ARCHITECTURE`` gives it.
INTEL_VENDOR_ID = 0x8086

_VENDOR = re.compile(r"\bvendor=0x([0-9a-fA-F]+)")

_TOLD: set[str] = set()  # the passed-over GPUs logged so far, by what was said
_TOLD_LOCK = threading.Lock()


@dataclass(frozen=True)
class OvDevices:
    """The devices OpenVINO lists here that the backend offers, and the GPUs it does not."""

    #: wasi-nn device -> OpenVINO's name for it (``"GPU.0"``).
    offered: dict[Device, str] = field(default_factory=dict)
    #: OpenVINO's name for each GPU not offered -> why (a phrase).
    passed_over: dict[str, str] = field(default_factory=dict)


def list_devices(core: Any) -> OvDevices:
    """The devices ``core`` (an ``openvino.Core``) lists, as the backend offers them (see
    the module docstring). Raises what ``core.available_devices`` raises; a property that
    cannot be read counts as missing."""
    devices = OvDevices()
    gpus: list[tuple[int, str]] = []
    for listed in core.available_devices:
        name = str(listed)
        kind, _, suffix = name.partition(".")
        index = int(suffix) if suffix.isdigit() else 0 if not suffix else None
        if index is None:
            continue  # not a device of its own (a tile, "GPU.0.1"): its GPU is listed
        if kind == "CPU":
            devices.offered[Device(ExecutionTarget.CPU)] = name
        elif kind == "NPU":
            devices.offered[Device(ExecutionTarget.TPU, index)] = name
        elif kind == "GPU":
            gpus.append((index, name))
    intel = []
    for _, name in sorted(gpus):
        why = not_intel(core, name)
        if why is None:
            intel.append(name)
        else:
            devices.passed_over[name] = why
            _tell(name, why)
    first = gpus_numbered_first() if intel else 0
    for k, name in enumerate(intel):
        devices.offered[Device(ExecutionTarget.GPU, first + k)] = name
    return devices


def gpus_numbered_first() -> int:
    """How many GPUs come before the Intel ones: those the CUDA driver reports, or those
    torch reports, where more (a ROCm build of torch numbers AMD GPUs ``gpu:0``... through
    ``torch.cuda``, which the CUDA driver does not see)."""
    count = cuda.device_count()
    if importlib.util.find_spec("torch") is not None:
        with contextlib.suppress(Exception):  # (a torch that cannot start counts none)
            import torch

            if torch.cuda.is_available():
                count = max(count, torch.cuda.device_count())
    return count


def not_intel(core: Any, name: str) -> str | None:
    """None where OpenVINO's GPU ``name`` is an Intel GPU, else why it is not taken for
    one: what its ``DEVICE_ARCHITECTURE`` (its vendor id) or, where that says no vendor,
    its ``FULL_DEVICE_NAME`` says, or that neither can be read."""
    full_name = _read(core, name, "FULL_DEVICE_NAME")
    called = f"{name} ({full_name})" if full_name else name
    architecture = _read(core, name, "DEVICE_ARCHITECTURE")
    vendor = _VENDOR.search(architecture or "")
    if vendor is not None:
        vendor_id = int(vendor.group(1), 16)
        if vendor_id == INTEL_VENDOR_ID:
            return None
        return f"{called} has vendor id {vendor_id:#06x}, not Intel's {INTEL_VENDOR_ID:#06x}"
    if full_name:
        if "intel" in full_name.lower():
            return None
        return f"{called} is not named as an Intel GPU"
    return (f"OpenVINO reports neither the vendor (DEVICE_ARCHITECTURE) nor the name "
            f"(FULL_DEVICE_NAME) of {name}")


def _read(core: Any, name: str, key: str) -> str | None:
    # ``name``'s property ``key`` as text, or None where the plugin cannot give it.
    try:
        value = core.get_property(name, key)
    except Exception:  # a plugin without it, or a device that fails to answer
        return None
    text = str(value).strip()
    return text or None


def _tell(name: str, why: str) -> None:
    """Log, once per process, that OpenVINO's GPU ``name`` is not offered and why."""
    with _TOLD_LOCK:
        if why in _TOLD:
            return
        _TOLD.add(why)
    log.info("%s: %s, and OpenVINO's GPU plugin supports Intel GPUs only: %s is not "
             "offered as a gpu device (CUDA GPUs run on pytorch, or on onnxruntime with "
             "onnxruntime-gpu)", NAME, why, name)
