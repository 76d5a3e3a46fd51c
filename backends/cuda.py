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

import contextlib
import ctypes
import functools
import re
import sys
from collections.abc import Callable, Iterable
from typing import Any, Final

from wasinn.errors import UnsupportedOperationError, WasiNNError

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
    driver = _driver()
    return 0 if driver is None else driver_device_count(driver)


def count_devices(libraries: Iterable[str]) -> int:
    """The device count reported by the first of ``libraries`` (CUDA driver libraries,
    by name) that loads; 0 where none loads or its calls fail. Never raises."""
    driver = _first_loadable(libraries)
    return 0 if driver is None else driver_device_count(driver)


def _first_loadable(libraries: Iterable[str]) -> Any:
    # The first of ``libraries`` that loads, or None.
    for name in libraries:
        try:
            return ctypes.CDLL(name)
        except Exception:  # OSError: not there, or not loadable
            continue
    return None


@functools.cache
def _driver() -> Any:
    # This host's CUDA driver library (loaded once), or None.
    return _first_loadable(_DRIVER_LIBRARIES)


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


#: How the libraries word one of them in their own exceptions: torch's c10 CUDA check
#: opens its message with "CUDA error: device-side assert triggered"; ONNX Runtime's
#: CudaCall writes "CUDA failure 710: device-side assert triggered ; GPU=0 ; ..." after
#: the failing node's name and the throwing function's signature (the code must agree
#: with the text).
_TORCH_WORDS = re.compile(r"^\s*CUDA error: (?P<said>[^\n]+?)\s*(?:\n|$)")
_ORT_WORDS = re.compile(r"CUDA failure (?P<code>\d+): (?P<said>[^;\n]+?) ; GPU=")


def sticky_error(exc: BaseException) -> str | None:
    """``name (code): description`` when ``exc``, or an exception it was raised from, is
    one of the :data:`STICKY_ERRORS` (the CUDA context of this process is lost: every
    later call on it fails the same way); None otherwise. Never raises.

    Only the libraries' own exceptions are read (the code torch's ``AcceleratorError``
    carries, or their message's opening words, exactly as they write it), never a
    wasinn error's message: that may quote what a caller sent (an input's name, a
    model's bytes), and a caller's text must not take a GPU out of service."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        code = getattr(error, "error_code", None)
        if isinstance(code, int) and code in STICKY_ERRORS:
            return _describe(code)
        if not isinstance(error, WasiNNError):
            found = _in_library_words(error)
            if found is not None:
                return found
        error = error.__cause__ or error.__context__
    return None


def _in_library_words(error: BaseException) -> str | None:
    try:
        text = str(error)
    except Exception:  # a broken __str__: nothing to read
        return None
    torch_words = _TORCH_WORDS.match(text)
    if torch_words is not None:
        for code, (_, description) in STICKY_ERRORS.items():
            if torch_words["said"] == description:
                return _describe(code)
    for ort_words in _ORT_WORDS.finditer(text):
        code = int(ort_words["code"])
        known = STICKY_ERRORS.get(code)
        if known is not None and known[1] == ort_words["said"]:
            return _describe(code)
    return None


def context_failure(driver: Any = None) -> int | None:
    """What the CUDA context current in this thread says when synchronized: 0 when it is
    fine, the CUDA error code when it is not (a code in :data:`STICKY_ERRORS` when it is
    lost), None when it cannot be asked (no driver library, no context current here).
    Asks ``driver`` (a loaded driver library) or this host's. Never raises.

    The thread that ran a job on a GPU has that GPU's context current (torch and ONNX
    Runtime both make the primary context current), so this tells a lost context from
    an exception that only reads like one."""
    try:
        if driver is None:
            driver = _driver()
            if driver is None:
                return None
        context = ctypes.c_void_p(None)
        if driver.cuCtxGetCurrent(ctypes.byref(context)) != _CUDA_SUCCESS or not context.value:
            return None
        return int(driver.cuCtxSynchronize())
    except Exception:  # a library without those symbols
        return None


def retain_primary_context(index: int, driver: Any = None) -> Callable[[], None]:
    """Open the primary CUDA context of device ``index`` (``cuDevicePrimaryCtxRetain``:
    the context the CUDA runtime, and so ONNX Runtime's CUDA provider and torch, use on
    that device), which proves the device usable, and return the call that releases it
    again (``cuDevicePrimaryCtxRelease``; safe to call more than once). Asks ``driver``
    (a loaded driver library) or this host's.

    Raises UnsupportedOperationError, with the driver's name for the error, where the
    device cannot take a context: held by another process in exclusive mode, out of
    memory, or no such device."""
    if driver is None:
        driver = _driver()
        if driver is None:
            raise UnsupportedOperationError(f"gpu:{index}: no CUDA driver library here")
    device = ctypes.c_int(0)
    context = ctypes.c_void_p(None)
    try:
        failed = int(driver.cuDeviceGet(ctypes.byref(device), int(index)))
        if failed == _CUDA_SUCCESS:
            failed = int(driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), device))
        release = getattr(driver, "cuDevicePrimaryCtxRelease_v2", None)
        if release is None:
            release = driver.cuDevicePrimaryCtxRelease
    except AttributeError as exc:  # not a driver library, or one without those calls
        raise UnsupportedOperationError(
            f"gpu:{index}: the CUDA driver library lacks a call it needs ({exc})") from exc
    if failed != _CUDA_SUCCESS:
        raise UnsupportedOperationError(
            f"gpu:{index}: CUDA could not open a context on it: {_error_name(driver, failed)}")
    released = False

    def release_once() -> None:
        nonlocal released
        if not released:
            released = True
            with contextlib.suppress(Exception):
                release(device)

    return release_once


def _error_name(driver: Any, code: int) -> str:
    # The driver's own name and description for CUresult ``code`` (or just the number).
    name, text = ctypes.c_char_p(None), ctypes.c_char_p(None)
    try:
        driver.cuGetErrorName(code, ctypes.byref(name))
        driver.cuGetErrorString(code, ctypes.byref(text))
    except Exception:  # a library without those calls
        pass
    if not name.value:
        return f"CUresult {code}"
    what = f"{text.value.decode(errors='replace')}, " if text.value else ""
    return f"{name.value.decode(errors='replace')} ({what}CUresult {code})"


def _describe(code: int) -> str:
    name, description = STICKY_ERRORS[code]
    return f"{name} ({code}): {description}"
