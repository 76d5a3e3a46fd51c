"""How many CUDA devices this host's NVIDIA driver reports.

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
from typing import Any

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

