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
#: CudaCall writes "CUDA failure 710: device-side assert triggered ; GPU=0 ; ..." (the
#: code must agree with the text), which opens the run's status (after the Python
#: binding's "[ONNXRuntimeError] : 1 : FAIL : ") or, for a node's failure, the part after
#: the failing node's name ("... Name:'n' Status Message: ..."), behind the location of
#: the throw where CudaCall threw ("/src/.../cuda_call.cc:129 <its signature> CUDA
#: failure ..."). Only the first library failure there counts: the node's name, and any
#: name a status message quotes further on, are the model's.
_TORCH_WORDS = re.compile(r"^\s*CUDA error: (?P<said>[^\n]+?)\s*(?:\n|$)")
_ORT_PREFIX = re.compile(r"^\s*\[ONNXRuntimeError\] : \d+ : \w+ : ")
_ORT_STATUS = "Status Message:"
_ORT_WORDS = re.compile(
    r"\s*(?:\S*cuda_call\.cc:\d+ [^\n]*?)?"  # where CudaCall threw, if it did
    r"(?P<library>[A-Z][A-Z_]*) failure (?P<code>-?\d+): (?P<said>[^;\n]+?) ; GPU=")


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
    ort_words = _ORT_WORDS.match(_ort_status(text))
    if ort_words is not None and ort_words["library"] == "CUDA":
        code = int(ort_words["code"])
        known = STICKY_ERRORS.get(code)
        if known is not None and known[1] == ort_words["said"]:
            return _describe(code)
    return None


def _ort_status(text: str) -> str:
    # ONNX Runtime's own status text in an exception's ``text``: after the last "Status
    # Message:" (ONNX Runtime's follows the node's name, which may hold the words too),
    # else after the Python binding's prefix.
    _, found, after = text.rpartition(_ORT_STATUS)
    if found:
        return after
    prefix = _ORT_PREFIX.match(text)
    return text if prefix is None else text[prefix.end():]


def context_failure(index: int, driver: Any = None) -> int | None:
    """What the primary CUDA context of device ``index`` (the one torch and ONNX Runtime
    run on) says when synchronized: 0 when it is fine, the CUDA error code when it is not
    (a code in :data:`STICKY_ERRORS` when it is lost), None when it cannot be asked (no
    driver library or one not initialized, no such device, no context on it yet). Asks
    ``driver`` (a loaded driver library) or this host's. Never raises.

    This tells a lost context from an exception that only reads like one. It asks that
    device's context whatever the calling thread has current (the thread that ran a job
    on ``gpu:1`` may have ``gpu:0``'s current again: leaving ``torch.cuda.device`` makes
    the previous device current), and leaves the thread as it found it: the context is
    retained (``cuDevicePrimaryCtxRetain``), pushed (``cuCtxPushCurrent``), synchronized,
    popped and released. A device whose primary context is not active is not asked:
    retaining it would create one. Each call may report an earlier asynchronous error;
    one of the :data:`STICKY_ERRORS` is the answer, any other one that it cannot be
    asked. Meant for failures (it waits for the device's queued work)."""
    try:
        if driver is None:
            driver = _driver()
            if driver is None:
                return None
        device = ctypes.c_int(0)
        if driver.cuDeviceGet(ctypes.byref(device), int(index)) != _CUDA_SUCCESS:
            return None
        flags, active = ctypes.c_uint(0), ctypes.c_int(0)
        failed = int(driver.cuDevicePrimaryCtxGetState(
            device, ctypes.byref(flags), ctypes.byref(active)))
        if failed != _CUDA_SUCCESS or not active.value:
            return _sticky_or_none(failed)
        push = _versioned(driver, "cuCtxPushCurrent")
        pop = _versioned(driver, "cuCtxPopCurrent")
        release = _versioned(driver, "cuDevicePrimaryCtxRelease")
        context = ctypes.c_void_p(None)
        failed = int(driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), device))
        if failed != _CUDA_SUCCESS:
            return _sticky_or_none(failed)
    except Exception:  # not a driver library, or one without those calls
        return None
    try:
        failed = int(push(context))
        if failed != _CUDA_SUCCESS:
            return _sticky_or_none(failed)
        try:
            return int(driver.cuCtxSynchronize())
        finally:
            with contextlib.suppress(Exception):
                pop(ctypes.byref(ctypes.c_void_p(None)))
    except Exception:  # (a foreign library's call misbehaving)
        return None
    finally:
        with contextlib.suppress(Exception):
            release(device)


def _sticky_or_none(code: int) -> int | None:
    # A failed driver call's answer for context_failure: the code if it is the sticky
    # error of an earlier launch, else None (the context cannot be asked).
    return code if code in STICKY_ERRORS else None


def _versioned(driver: Any, name: str) -> Any:
    # The driver's call ``name`` as cuda.h binds it (``name_v2`` where there is one).
    call = getattr(driver, f"{name}_v2", None)
    return call if call is not None else getattr(driver, name)


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
        release = _versioned(driver, "cuDevicePrimaryCtxRelease")
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
