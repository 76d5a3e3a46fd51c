"""What a device needs around the work its actor runs: nothing on the CPU; on a CUDA
GPU, a watch for the errors that lose it, and its own stream where torch sees it.

A :class:`DeviceContext` is opened once in a worker thread when the actor starts (that is
the readiness probe: a device that cannot be opened fails the actor's start; on a CUDA
GPU it opens the device's primary context, which torch and ONNX Runtime share), entered
around every job the actor runs (in its worker threads, a caller's thread or inline), and
closed when the actor stops.

A lost device: some CUDA errors (a device-side assert, an illegal memory access: see
:data:`wasinn.backends.cuda.STICKY_ERRORS`) leave the process's CUDA context unusable,
and every later call on that GPU fails the same way until the process restarts. A
malformed input can cause one (an out-of-range index in a gather). A job that raises
one (in the library's own words, and, where the CUDA driver can be asked, confirmed by
synchronizing that device's primary context, whatever context the job's thread has
current) raises
:class:`~wasinn.errors.DeviceLostError` instead, which says so plainly,
and the context records the loss once (:attr:`DeviceContext.lost`) and tells its
``on_lost`` callback, from the thread that ran the job.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from wasinn.backends.base import Device
from wasinn.backends.cuda import (
    context_failure,
    device_count,
    retain_primary_context,
    sticky_error,
)
from wasinn.enums import ExecutionTarget
from wasinn.errors import DeviceLostError, UnsupportedOperationError

#: Told, from the thread that ran the job, that the device is lost.
OnLost = Callable[[DeviceLostError], None]


class DeviceContext:
    """The CPU (and any device without per-actor state): nothing to open or enter."""

    def __init__(self, device: Device) -> None:
        self.device = device
        #: Why the device can run nothing more (the first such error), or None.
        self.lost: DeviceLostError | None = None
        #: Called once, from the thread that found it, when the device is lost.
        self.on_lost: OnLost | None = None

    def open(self) -> None:
        """Make the device usable; raise UnsupportedOperationError if it is not."""

    def wrap(self, job: Callable[[], Any]) -> Callable[[], Any]:
        """``job`` made to run under this device's context (unchanged here)."""
        return job

    def fatal(self, exc: BaseException) -> bool:
        """Whether ``exc``, raised by a run inside a job, may have lost the device: the
        job must then raise it rather than go on (a batch's other runs), for
        :meth:`wrap` to see. Never, here."""
        return False

    def close(self) -> None:
        """Release what ``open`` created. Idempotent."""


class CudaContext(DeviceContext):
    """A CUDA device: opened by retaining its primary context through the driver (the
    one ONNX Runtime's CUDA provider then uses: a device that cannot take a context fails
    the actor's start, not its first request), held until the actor stops; a job that
    fails with an error that loses the device raises DeviceLostError, and the loss is
    recorded (see the module docstring)."""

    _release: Callable[[], None] | None = None

    def open(self) -> None:
        self._release = retain_primary_context(self.device.index)

    def close(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    def wrap(self, job: Callable[[], Any]) -> Callable[[], Any]:
        def watched() -> Any:
            try:
                return job()
            except Exception as exc:
                lost = self.loss(exc)
                if lost is None:
                    raise
                raise lost from exc

        return watched

    def fatal(self, exc: BaseException) -> bool:
        return self._lost_by(exc) is not None

    def _lost_by(self, exc: BaseException) -> str | None:
        # What lost the device in ``exc`` (see sticky_error), unless the driver, asked,
        # finds the device's context fine (its answer is None where it cannot be asked).
        cause = sticky_error(exc)
        if cause is None or context_failure(self.device.index) == 0:
            return None
        return cause

    def loss(self, exc: BaseException) -> DeviceLostError | None:
        """The DeviceLostError for a job's exception ``exc`` if it lost the device (the
        first loss is recorded and told to ``on_lost``); None when the device is fine."""
        cause = self._lost_by(exc)
        if cause is None:
            return None
        said = str(exc).strip()
        first_line = said.splitlines()[0] if said else ""
        error = DeviceLostError(
            f"{self.device} is lost: {cause} ({type(exc).__name__}: {first_line}). A CUDA "
            "error of this kind leaves the process's CUDA context unusable: nothing more "
            f"can run on {self.device} until the process restarts; other devices keep "
            "serving")
        if self.lost is None:
            self.lost = error
            if self.on_lost is not None:
                self.on_lost(error)
        return error


class TorchCudaContext(CudaContext):
    """A CUDA device seen through torch: jobs run on the actor's own stream.

    One stream per actor keeps chained torch work ordered on the device without host
    synchronisation between steps; ONNX Runtime's CUDA provider ignores it (its runs
    synchronise their own stream before they return).

    A job ends when the kernels it queued have run: a torch call returns once its
    kernels are queued, so without the wait at the end of each job (one
    ``stream.synchronize()``, not one per step of a pipeline) a run would hand its slot
    to the next request while the GPU still computed it, ``workers`` would bound launches
    rather than runs, a deadline and the inline-run timings would measure the launch, and
    the first ``.numpy()`` of a kept output, in the event loop, would wait there for the
    GPU. A run's kept outputs are complete when its caller gets them.
    """

    def __init__(self, device: Device) -> None:
        super().__init__(device)
        self.stream: Any = None

    def open(self) -> None:  # (torch opens the primary context: none retained here)
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
                result = job()
            stream.synchronize()  # its kernels have run (see the class docstring)
            return result

        return super().wrap(on_stream)

    def close(self) -> None:
        self.stream = None


def context_for(device: Device) -> DeviceContext:
    """The context an actor for ``device`` owns: a CUDA stream where torch sees that GPU,
    the watch for lost devices on any CUDA GPU (ONNX Runtime's alone); none for a GPU
    only another backend reports (an Intel GPU seen by OpenVINO beside an NVIDIA one:
    ``gpu:1`` with one CUDA device)."""
    if device.kind is ExecutionTarget.GPU:
        if torch_sees(device):
            return TorchCudaContext(device)
        if device.index < device_count():
            return CudaContext(device)
    return DeviceContext(device)


def torch_sees(device: Device) -> bool:
    """Whether torch is installed and sees CUDA GPU ``device`` (never imports a torch that
    is not installed; a torch that fails to start CUDA sees none)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return False
    with contextlib.suppress(Exception):
        import torch

        return bool(torch.cuda.is_available()) and device.index < torch.cuda.device_count()
    return False
