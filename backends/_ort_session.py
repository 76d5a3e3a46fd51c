"""The ``InferenceSession`` ONNX Runtime builds for a model, and what it is built with
(for :mod:`wasinn.backends.onnxruntime`, whose docstring describes the behaviour in full).

:func:`_session` builds it with ORT's provider fallback off (a GPU session that fails is
tried on the CPU once, only to tell the failures apart); :func:`session_options` makes its
``SessionOptions`` from ``LoadOptions`` (threads, external data in memory, session config
entries with :data:`SESSION_DEFAULTS`, unknown keys warned about once);
:func:`providers_for` its execution providers (CUDA's ``device_id`` and ``use_tf32``).
Also the backend's :data:`NAME`.

An ONNX model reaches ONNX Runtime through a pipe it reads as a file (:mod:`._model_pipe`),
not as bytes, where it can: its binding holds the GIL while it copies bytes (every thread,
the trio loop included, stalls: 0.3 to 1.1 s for 512 MB on a 2-core machine), not while
it reads a file.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import onnxruntime as ort
import psutil

from wasinn.enums import ExecutionTarget
from wasinn.errors import InvalidArgumentError, InvalidEncodingError, UnsupportedOperationError

from ._model_pipe import piped
from ._onnx_check import external_data_folder
from ._ort_config_keys import is_config_key
from ._ort_config_keys import unknown as unknown_config_keys
from .base import Device, LoadOptions, in_sandbox, log

NAME = "onnxruntime"

#: What ONNX Runtime raises for a well-formed model it has no kernel for.
_NotImplemented: type[Exception] = ort.capi.onnxruntime_pybind11_state.NotImplemented


#: What ONNX Runtime says of a well-formed model of an opset or IR version newer than it
#: supports (which another library, or a newer onnxruntime, may run).
_TOO_NEW = ("is till opset", "Unsupported model IR version")


def _session(data: bytes, device: Device, options: LoadOptions,
             external: Mapping[str, bytes], *, ort_format: bool) -> Any:
    """An ``InferenceSession`` for ``data`` on ``device``, with ORT's provider fallback off.

    ORT's Python wrapper treats any ValueError or RuntimeError while it builds a session
    as a provider failure: it prints an "EP Error" banner to stdout and builds the
    session again with the CPU provider alone (a malformed model is parsed twice), and
    at run time it swaps a failing provider for the CPU one in place, so a graph placed
    on a GPU would quietly run on the CPU. Both are off here. A GPU session that fails to
    build is tried on the CPU once, only to tell the two failures apart.

    Raises InvalidEncodingError for a model ONNX Runtime cannot load,
    UnsupportedOperationError where only the CUDA provider fails on it or where ONNX
    Runtime has no kernel for what a well-formed model uses (NOT_IMPLEMENTED) or reads
    no model of its opset or IR version (newer than this build's), and
    InvalidArgumentError for provider options that contradict ``device``
    (:func:`providers_for`). ``external``: the model's external data files, by location;
    ``ort_format``: whether the checks read ``data`` as an ORT-format model (which ONNX
    Runtime is given as bytes: see :func:`_built`).
    """
    providers = providers_for(device, options)
    try:
        session = _built(data, options, external, providers, ort_format)
    except Exception as exc:
        if device.kind is ExecutionTarget.GPU and _loads_on_cpu(data, options, external,
                                                                ort_format):
            raise UnsupportedOperationError(
                f"{NAME}: the CUDA provider failed on {device}: {exc}") from exc
        if isinstance(exc, _NotImplemented):  # a kernel this build lacks (bf16 Add)
            raise UnsupportedOperationError(
                f"{NAME}: ONNX Runtime cannot run the model on {device}: {exc}: expected "
                "operators and element types it implements there") from exc
        if any(sign in str(exc) for sign in _TOO_NEW):
            raise UnsupportedOperationError(
                f"{NAME}: the model is newer than this ONNX Runtime reads: {exc}: expected "
                "an opset and IR version it supports (a newer onnxruntime may)") from exc
        raise InvalidEncodingError(f"{NAME}: cannot load the ONNX model: {exc}") from exc
    session.disable_fallback()  # enable_fallback=0 did so already; said again for run()
    return session


def _loads_on_cpu(data: bytes, options: LoadOptions, external: Mapping[str, bytes],
                  ort_format: bool) -> bool:
    """Whether a CPU-only session can be built for ``data`` (the model is readable)."""
    try:
        _built(data, options, external, ["CPUExecutionProvider"], ort_format)
    except Exception:
        return False
    return True


#: What an ONNX Runtime error says instead of the pipe's path.
MODEL_BYTES = "<the model's bytes>"


def _built(data: bytes, options: LoadOptions, external: Mapping[str, bytes],
           providers: list[Any], ort_format: bool) -> Any:
    """An ``InferenceSession`` for ``data``, ORT's fallback off, read through a pipe
    (:func:`~._model_pipe.piped`) so that ONNX Runtime takes it with the GIL released
    (and as ONNX, by the pipe's name, which does not end in ``.ort``). Bytes instead for
    what the checks read as an ORT-format model (``ort_format``: ONNX Runtime reads one
    by its file's size, which a pipe has not), where there is no pipe to name, in a sandbox
    process (its stall holds up only its own graph's requests, and its confinement need
    not allow the path), and where ONNX Runtime is told a folder for the model's
    external data (:func:`session_options`), which it reads for a model given as bytes
    only. ONNX Runtime's errors name the model :data:`MODEL_BYTES`, not the pipe."""
    so = session_options(options, external)
    if in_sandbox() or ort_format or _has_entry(so, _EXTERNAL_DATA_FOLDER):
        return _from_bytes(data, so, providers)
    with piped(data, "wasinn-onnx-model") as path:
        if path is None:
            return _from_bytes(data, so, providers)
        try:
            return ort.InferenceSession(path, sess_options=so, providers=providers,
                                        enable_fallback=0)
        except Exception as exc:
            exc.args = tuple(a.replace(path, MODEL_BYTES) if isinstance(a, str) else a
                             for a in exc.args)
            raise


def _from_bytes(data: bytes, so: Any, providers: list[Any]) -> Any:
    return ort.InferenceSession(data, sess_options=so, providers=providers, enable_fallback=0)


def _has_entry(so: Any, key: str) -> bool:
    """Whether the ``SessionOptions`` ``so`` hold the session config entry ``key``."""
    try:
        so.get_session_config_entry(key)
    except RuntimeError:  # (what ONNX Runtime raises for a key it was not given)
        return False
    return True


#: Session config entries wasinn sets unless ``LoadOptions.extra`` says otherwise: stop the
#: intra-op threads spinning when a run returns (see :mod:`wasinn.backends.onnxruntime`).
SESSION_DEFAULTS: Mapping[str, str] = {"session.force_spinning_stop": "1"}


def session_options(options: LoadOptions, external: Mapping[str, bytes] | None = None) -> Any:
    """The ``SessionOptions`` wasinn uses; also used by benchmarks for native sessions.

    ``external``: a registered model's external data files (location -> bytes, read and
    checked by the host), handed to ONNX Runtime in memory, so that it opens no file
    itself (the paths may name other files by the time it would). An ONNX Runtime without
    that call (older versions) is told the model's folder and reads them there, except
    in a sandbox process, which may not read it (UnsupportedOperationError).

    ``options.extra`` keys of the form ``AREA.NAME`` (``session.``, ``optimization.``,
    ``mlas.``, ``ep.``) become session config entries; one ONNX Runtime is not known to
    read is logged once (:mod:`._ort_config_keys`).
    """
    so = ort.SessionOptions()
    so.log_severity_level = 3  # errors only: warnings go to the exception, not stderr
    if options.threads:
        so.intra_op_num_threads = options.threads
    elif in_sandbox():
        # Left to choose, ONNX Runtime starts a thread per physical core and pins each
        # to a CPU, which a sandbox process may not do to a thread other than the
        # calling one (see _confine): the same number, given, leaves them unpinned,
        # instead of a logged failure per thread.
        so.intra_op_num_threads = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    bounded: dict[str, str] = {}
    if in_sandbox():  # (its memory is bounded: see _arena_as_asked)
        _arena_as_asked()
        bounded[_USE_ENV_ALLOCATORS] = "1"
    entries = {**SESSION_DEFAULTS, **bounded, **options.extra}
    if external:
        in_memory = getattr(so, "add_external_initializers_from_files_in_memory", None)
        if in_memory is not None:
            in_memory(list(external), list(external.values()),
                      [len(data) for data in external.values()])
        elif options.external_data:
            raise UnsupportedOperationError(
                f"{NAME}: ONNX Runtime {ort.__version__} cannot take a model's external data "
                "in memory (no SessionOptions.add_external_initializers_from_files_in_memory), "
                "and a sandboxed model's process may not read the model's folder: expected "
                "a newer ONNX Runtime, or the model loaded without sandbox")
        else:
            entries[_EXTERNAL_DATA_FOLDER] = str(external_data_folder(options.source))
    for key, value in entries.items():
        if is_config_key(key):
            so.add_session_config_entry(key, _entry_text(value))
    _warn_unknown_keys(entries)
    return so


#: The session config entry that has a session use the allocators registered for the
#: process (:func:`_arena_as_asked`'s).
_USE_ENV_ALLOCATORS = "session.use_env_allocators"
_arena_registered: list[bool] = []
_arena_lock = threading.Lock()


def _arena_as_asked() -> None:
    """Register, once in this process, a CPU arena that grows by what an allocation asks
    (``arena_extend_strategy`` 1), for a sandbox process, whose memory is bounded (see
    :mod:`.sandbox`). The default arena doubles its next growth until it covers a request,
    before it allocates, and keeps that size when the allocation fails: after a run that
    asked for more than the bound, the next run that needed the arena to grow took all
    that was left under the bound, and the runs after it failed (std::bad_alloc) however
    little they needed (a 4 MB output after a 3.6 GB one failed under a 1 GiB bound).
    This one runs as fast as the default (MobileNetV2 at batch 8, 2 busy vCPUs: 195-198
    ms against 193-198); without an arena runs were slower (180-330 ms against 130-190 ms,
    mapping their buffers afresh each time)."""
    with _arena_lock:
        if not _arena_registered:
            cpu = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0,
                                    ort.OrtMemType.DEFAULT)
            ort.create_and_register_allocator(cpu, ort.OrtArenaCfg(0, 1, -1, -1))
            _arena_registered.append(True)


def _entry_text(value: object) -> str:
    """A session config entry's value as ONNX Runtime is given it ("1" and "0" for
    flags)."""
    return ("1" if value else "0") if isinstance(value, bool) else str(value)


#: The unknown session config keys already warned about (once each in a process).
_warned: set[str] = set()


def _warn_unknown_keys(keys: Iterable[str]) -> None:
    for key, alike in unknown_config_keys(keys):
        if key not in _warned:
            _warned.add(key)
            hint = f" (did you mean {alike[0]!r}?)" if alike else ""
            log.warning("%s: %r is not a session config entry ONNX Runtime reads (as of "
                        "version 1.31; this is %s)%s: it is passed on, and ignored unless "
                        "this version reads it", NAME, key, ort.__version__, hint)


#: Where ONNX Runtime reads the external data of a model given as bytes.
_EXTERNAL_DATA_FOLDER = "session.model_external_initializers_file_folder_path"


#: The CUDA provider's ``use_tf32`` for each ``LoadOptions.precision`` that sets it
#: (the others leave ONNX Runtime's default, TF32 on).
_CUDA_TF32: Mapping[str, str] = {"f32": "0", "tf32": "1"}


def providers_for(device: Device, options: LoadOptions) -> list[Any]:
    """The execution providers for ``device``. For CUDA: ``device_id``, ``use_tf32`` by
    ``options.precision`` (see :mod:`wasinn.backends.onnxruntime`), then
    ``extra["provider_options"]``, whose entries win, except a ``device_id`` naming another
    GPU than ``device`` (InvalidArgumentError): the graph would compute there while its
    outputs, its actor and its stats said ``device``."""
    if device.kind is ExecutionTarget.GPU:
        cuda_options: dict[str, Any] = {"device_id": device.index}
        tf32 = _CUDA_TF32.get(options.precision.strip().lower())
        if tf32 is not None:
            cuda_options["use_tf32"] = tf32
        given = dict(options.extra.get("provider_options", {}))
        if "device_id" in given and str(given["device_id"]).strip() != str(device.index):
            raise InvalidArgumentError(
                f"{NAME}: provider_options device_id = {given['device_id']!r} names another "
                f"GPU than the one this graph is placed on ({device}): leave device_id out "
                "(the pool's devices and the context's target choose the GPU)")
        cuda_options.update(given)
        return [("CUDAExecutionProvider", cuda_options), "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]
