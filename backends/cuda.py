"""How many CUDA devices this host's NVIDIA driver reports, and which CUDA errors leave
a process unable to use its GPU again.

A backend whose library can run on CUDA (ONNX Runtime with ``onnxruntime-gpu``) asks here
which ``gpu:N`` devices exist: the library's own answer says only that it was built with
CUDA support (``onnxruntime-gpu`` lists its CUDA provider on every host, GPU or not), not
how many GPUs there are.

The count comes from the CUDA driver API, through ``ctypes``: ``cuInit(0)``, then
``cuDeviceGetCount``. That needs only the NVIDIA driver's ``libcuda.so.1`` (no CUDA
toolkit), initializes the driver without creating a context on any device, and honours
``CUDA_VISIBLE_DEVICES`` as the CUDA libraries themselves will (as set when the process
first initializes the driver). Not through torch: importing it costs about 0.9 s, and a
CPU build of torch may sit beside ``onnxruntime-gpu``, reporting no GPU where there are
some. Not through NVML: it counts every GPU on the host, ignoring
``CUDA_VISIBLE_DEVICES``, so it would report devices the process cannot use.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Iterable
from typing import Any, Final, TypeVar

#: The CUDA driver library, by its soname (the unversioned ``libcuda.so`` is a toolkit
#: link, or the toolkit's stub, which reports no device).
_DRIVER_LIBRARIES: tuple[str, ...] = (
    ("nvcuda.dll",) if sys.platform == "win32"
    else ("libcuda.so.1",) if sys.platform.startswith("linux")
    else ()  # no CUDA driver elsewhere (macOS)
)

_CUDA_SUCCESS = 0


@functools.cache
def device_count() -> int:
    """How many CUDA devices the driver reports to this process: 0 where there is no
    driver library or any call fails. Asked once per process (the answer is cached);
    never raises."""
    return count_devices(_DRIVER_LIBRARIES)


def count_devices(libraries: Iterable[str]) -> int:
    """The device count reported by the first of ``libraries`` (CUDA driver libraries,
    by name) that loads; 0 where none loads or its calls fail. Never raises."""
    for name in libraries:
        try:
            driver = ctypes.CDLL(name)
        except Exception:  # OSError: not there, or not loadable
            continue
        return driver_device_count(driver)
    return 0


def driver_device_count(driver: Any) -> int:
    """``cuInit(0)`` then ``cuDeviceGetCount`` on the loaded driver library ``driver``:
    the count, or 0 where either returns an error (no device, a stub library, a driver
    older than the kernel module...) or the library lacks them. Never raises."""
    try:
        count = ctypes.c_int(0)
        if driver.cuInit(0) != _CUDA_SUCCESS:
            return 0
        if driver.cuDeviceGetCount(ctypes.pointer(count)) != _CUDA_SUCCESS:
            return 0
        return max(int(count.value), 0)
    except Exception:  # AttributeError: no such symbol
        return 0



#: The CUDA runtime errors after which "the process is left in an inconsistent state and
#: any further CUDA work will return the same error. To continue using CUDA, the process
#: must be terminated and relaunched" (the CUDA runtime API's ``cudaError`` reference):
#: code -> (name, what ``cudaGetErrorString`` says). ONNX Runtime's CUDA provider and
#: torch both put that text in their exceptions ("CUDA failure 710: device-side assert
#: triggered ; GPU=0 ...", "CUDA error: device-side assert triggered"); torch's
#: ``AcceleratorError`` also carries the code as ``error_code``.
STICKY_ERRORS: Final[dict[int, tuple[str, str]]] = {
    700: ("cudaErrorIllegalAddress", "an illegal memory access was encountered"),
    702: ("cudaErrorLaunchTimeout", "the launch timed out and was terminated"),
    710: ("cudaErrorAssert", "device-side assert triggered"),
    714: ("cudaErrorHardwareStackError", "hardware stack error"),
    715: ("cudaErrorIllegalInstruction", "an illegal instruction was encountered"),
    716: ("cudaErrorMisalignedAddress", "misaligned address"),
    717: ("cudaErrorInvalidAddressSpace",
          "operation not supported on global/shared address space"),
    718: ("cudaErrorInvalidPc", "invalid program counter"),
    719: ("cudaErrorLaunchFailure", "unspecified launch failure"),
}


#: The attribute that marks an exception whose CUDA error happened in another process (a
#: sandboxed graph's): this process's own CUDA context is not lost.
_ELSEWHERE = "_wasinn_cuda_error_elsewhere"

E = TypeVar("E", bound=BaseException)


def happened_elsewhere(exc: E) -> E:
    """``exc``, marked as reporting a CUDA error of another process: :func:`sticky_error`
    does not take it for a loss of this process's context."""
    setattr(exc, _ELSEWHERE, True)
    return exc


def sticky_error(exc: BaseException) -> str | None:
    """``name (code): description`` when ``exc``, or an exception it was raised from, is
    one of the :data:`STICKY_ERRORS` (the CUDA context of this process is lost: every
    later call on it fails the same way); None otherwise, and for an error that
    :func:`happened_elsewhere`. Never raises."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if getattr(error, _ELSEWHERE, False):
            return None
        code = getattr(error, "error_code", None)
        if isinstance(code, int) and code in STICKY_ERRORS:
            return _describe(code)
        try:
            text = str(error)
        except Exception:  # a broken __str__: nothing to read
            text = ""
        for code, (name, description) in STICKY_ERRORS.items():
            if description in text or name in text:
                return _describe(code)
        error = error.__cause__ or error.__context__
    return None


def _describe(code: int) -> str:
    name, description = STICKY_ERRORS[code]
    return f"{name} ({code}): {description}"
