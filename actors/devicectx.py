"""What a device needs around the work its actor runs: nothing on the CPU, a CUDA stream
on a torch-visible GPU.

A :class:`DeviceContext` is opened once in a worker thread when the actor starts (that is
the readiness probe: a device that cannot be opened fails the actor's start), entered
around every job in the actor's worker threads, and closed when the actor stops.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from wasinn.backends.base import Device
from wasinn.enums import ExecutionTarget
from wasinn.errors import UnsupportedOperationError


class DeviceContext:
    """The CPU (and any device without per-actor state): nothing to open or enter."""

    def __init__(self, device: Device) -> None:
        self.device = device

    def open(self) -> None:
        """Make the device usable; raise UnsupportedOperationError if it is not."""

    def wrap(self, job: Callable[[], Any]) -> Callable[[], Any]:
        """``job`` made to run under this device's context (unchanged here)."""
        return job

    def close(self) -> None:
        """Release what ``open`` created. Idempotent."""


class TorchCudaContext(DeviceContext):
    """A CUDA device seen through torch: jobs run on the actor's own stream.

    One stream per actor keeps chained torch work ordered on the device without host
    synchronisation between steps; ONNX Runtime's CUDA provider ignores it.
    """

    def __init__(self, device: Device) -> None:
        super().__init__(device)
        self.stream: Any = None

    def open(self) -> None:
        import torch

        if not torch.cuda.is_available() or self.device.index >= torch.cuda.device_count():
            raise UnsupportedOperationError(f"{self.device}: no such CUDA device here")
        with torch.cuda.device(self.device.index):
            self.stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            torch.zeros(1, device=f"cuda:{self.device.index}")  # initialise the context now

    def wrap(self, job: Callable[[], Any]) -> Callable[[], Any]:
        import torch

        stream = self.stream

        def on_stream() -> Any:
            with torch.cuda.device(self.device.index), torch.cuda.stream(stream):
                return job()

        return on_stream

    def close(self) -> None:
        self.stream = None


def context_for(device: Device) -> DeviceContext:
    """The context an actor for ``device`` owns: a CUDA stream where torch sees that GPU;
    none for a GPU only another backend reports (an Intel GPU seen by OpenVINO beside an
    NVIDIA one: ``gpu:1`` with one CUDA device)."""
    if device.kind is ExecutionTarget.GPU:
        import importlib.util

        if importlib.util.find_spec("torch") is not None:
            with contextlib.suppress(Exception):
                import torch

                if torch.cuda.is_available() and device.index < torch.cuda.device_count():
                    return TorchCudaContext(device)
    return DeviceContext(device)
