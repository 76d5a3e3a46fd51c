"""ONNX Runtime behind the wasinn contract: ONNX models on the CPU and, where
``onnxruntime-gpu`` is installed, on CUDA devices (``gpu:N``): one for each device the
CUDA driver reports (:mod:`.cuda`; ``onnxruntime-gpu`` lists its CUDA provider on hosts
without a GPU too, so its word alone reports none).

Every wasi-nn element type runs (f16, f32, f64, bf16, u8, i32, i64). numpy has no bf16,
and ONNX Runtime's Python API cannot build or read bf16 values from ``ml_dtypes``
arrays, so bf16 tensors cross the boundary as a ``uint16`` view tagged with ONNX's
BFLOAT16 element type and are read back through the value's raw bytes.

A :class:`OrtGraph` owns one ``InferenceSession`` (thread-safe for concurrent runs).
A run of host tensors calls ``InferenceSession.run`` directly, so the layer adds only
input checks (and counts the outputs it hands back as host arrays, see
:func:`wasinn.host_copies`); native inputs, bf16 and ``keep_on_device`` go through a
per-run ``IOBinding`` so that ``OrtValue`` s are bound as they are, without a copy.

Cancellation: a run under a :class:`~wasinn.backends.base.Cancellation` (see
:func:`~wasinn.backends.base.current_cancellation`) runs with a ``RunOptions`` of its
thread's own, whose ``terminate`` flag the cancellation sets: ONNX Runtime checks it
between nodes and between a Loop's iterations, and the run raises BackendRuntimeError.
A thread reuses its ``RunOptions`` for its next run unless a cancellation reached it (a
late one could otherwise stop a later run): one object less to build per inference.

``LoadOptions.precision``: on the CPU it is not applied (ONNX Runtime computes in the
model's own types). On CUDA, ``"f32"`` (the default) turns the provider's TF32 off
(``use_tf32``, on by default in ONNX Runtime: Ampere and later GPUs would round the
inputs of f32 convolutions and matrix products to a 10-bit mantissa, and outputs would
differ from the CPU's by about 1e-3), ``"tf32"`` turns it on, and the other values leave
the provider's default; ``extra["provider_options"]["use_tf32"]`` overrides either.

Hostile bytes: a model whose tensors refer to external data files is refused with
SecurityError before ONNX Runtime sees it (:mod:`._onnx_check`: ORT would read any file
the host can, relative to its working directory). ORT's Python fallback is off (see
:func:`._ort_session._session`): it printed a banner to stdout and parsed a malformed
model twice, and would quietly move a GPU graph to the CPU. An int32 or int64 Div or Mod
of the type's minimum by minus one killed the host with SIGFPE (at run time, or at load
when both were constants): every such node is guarded before ORT sees the model
(:mod:`._onnx_division`; a model without Div or Mod goes through untouched, unparsed).
One that cannot be guarded (an ORT-format model's; one of unknown type before opset 15)
is refused in the host's process only: loaded sandboxed (:func:`~.base.in_sandbox`),
where a trap ends just the sandbox process, it is left unguarded and the rest of the
model guarded.

Loading: ONNX Runtime reads an ONNX model from a pipe, not from bytes, which its binding
copies holding the GIL (every thread, the trio loop included, would stall: 0.3 to 1.1 s
for 512 MB); see :func:`._ort_session._built` for where it still gets the bytes.

Spinning: each session's intra-op threads spin while a run is in progress (ONNX Runtime's
default), but stop when it returns (``session.force_spinning_stop``; ``extra`` can set it
back to ``"0"``). Left spinning, they hold the cores for a while after every run, and the
next run of another model — another session, or another backend — finds them taken:
measured on a 2-core machine, a MobileNetV2-like run right after a small ONNX Runtime
model took 6.9 ms instead of 2.9 ms, and an OpenVINO run right after an ONNX Runtime one
5.4 ms instead of 3.0 ms; with spinning stopped, 2.9 ms and 3.1-3.3 ms. Back-to-back runs
of one model are unaffected (2.9 ms either way).
"""

from __future__ import annotations

import re
import threading

import onnxruntime as ort

from wasinn.enums import ExecutionTarget, GraphEncoding
from wasinn.errors import InvalidEncodingError, UnsupportedOperationError, WasiNNError

from . import cuda
from ._graphio import expect_builders, expect_encoding, no_device
from ._onnx_check import (
    LOAD_FORMAT_KEY,
    check_external_data,
    external_data_folder,
    given_external_data,
    read_external_data,
    reads_as_ort_format,
)
from ._onnx_division import guard_integer_division
from ._ort_cuda_libraries import preload_once
from ._ort_graph import OrtGraph, _shapeless
from ._ort_session import (
    NAME,
    SESSION_DEFAULTS,
    _entry_text,
    _session,
    providers_for,
    session_options,
)
from .base import (
    Backend,
    Builders,
    Device,
    LoadOptions,
    in_sandbox,
    warn_precision_not_applied,
)
from .formats import check_declared

__all__ = ["NAME", "SESSION_DEFAULTS", "OnnxRuntimeBackend", "OrtGraph", "providers_for",
           "session_options"]

_CPU = Device(ExecutionTarget.CPU)


def _without_cuda(session: ort.InferenceSession, device: Device) -> bool:
    """Whether ``session``, made for ``device``, is a GPU's without the CUDA provider."""
    return device.kind is ExecutionTarget.GPU and "CUDAExecutionProvider" not in (
        session.get_providers())


#: The oldest onnxruntime wasinn runs models on: the first whose integer Div and Mod
#: check the divisor for zero (1.17 to 1.24 divide by it: SIGFPE ends the host process).
OLDEST = (1, 25)


def check_version(version: str) -> None:
    """UnsupportedOperationError where onnxruntime ``version`` is older than
    :data:`OLDEST` (the registry then passes the backend over, saying why)."""
    found = tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    if found < OLDEST:
        oldest = ".".join(map(str, OLDEST))
        raise UnsupportedOperationError(
            f"onnxruntime {version} is older than {oldest}, the first that checks an "
            "integer division's divisor for zero (older ones end the host process with "
            f"SIGFPE on a division by zero): expected onnxruntime>={oldest} "
            "(pip install -U 'wasinn[onnxruntime]')")


class OnnxRuntimeBackend(Backend):
    """ONNX Runtime: ``onnx`` on ``cpu`` and, with the CUDA provider, ``gpu:N``."""

    name = NAME
    encodings = frozenset({GraphEncoding.ONNX})

    def __init__(self) -> None:
        check_version(ort.__version__)
        self._devices: list[Device] | None = None
        self._lock = threading.Lock()

    def devices(self) -> list[Device]:
        with self._lock:
            if self._devices is None:
                found = [Device(ExecutionTarget.CPU)]
                # The provider is listed wherever onnxruntime-gpu is installed: the
                # driver says whether there are GPUs, and how many (see .cuda).
                if "CUDAExecutionProvider" in ort.get_available_providers():
                    found += [Device(ExecutionTarget.GPU, i)
                              for i in range(cuda.device_count())]
                self._devices = found
            return list(self._devices)

    def load(
        self,
        builders: Builders,
        encoding: GraphEncoding,
        device: Device,
        options: LoadOptions | None = None,
    ) -> OrtGraph:
        """Compile one ONNX builder into a session on ``device``.

        Raises InvalidEncodingError for another encoding, a builder count other than one
        or bytes ONNX Runtime cannot read (input or output names that are not UTF-8
        included); SecurityError for a model that refers to external data files (see
        :mod:`._onnx_check`); UnsupportedOperationError for a device it lacks, a model
        whose inputs/outputs use a type outside the wasi-nn set, or an integer division
        that cannot be guarded, outside a sandbox process (see :mod:`._onnx_division`).
        """
        expect_encoding(NAME, encoding, GraphEncoding.ONNX)
        expect_builders(NAME, builders, 1, "one builder holding an ONNX model")
        check_declared(NAME, builders, GraphEncoding.ONNX)
        if device != _CPU:  # (a CPU load asks no CUDA driver, not in a sandbox either)
            devices = self.devices()
            if device not in devices:
                raise no_device(NAME, device, devices)
        options = options or LoadOptions()
        warn_precision_not_applied(NAME, options, "ONNX Runtime")
        data = bytes(builders[0])
        # As ONNX Runtime decides (a load format in the options wins over the bytes'
        # identifier): the checks must read the bytes as it will.
        ort_format = reads_as_ort_format(
            data, _entry_text(options.extra.get(LOAD_FORMAT_KEY, "")))
        if options.external_data:  # in a sandbox process: read by the host
            external = given_external_data(NAME, data, options.external_data,
                                           ort_format=ort_format)
        else:
            folder = external_data_folder(options.source)
            locations = check_external_data(NAME, data, folder, ort_format=ort_format)
            external = (read_external_data(NAME, folder, locations)
                        if locations and folder is not None else {})
        data = guard_integer_division(NAME, data, refuse_unguardable=not in_sandbox(),
                                      ort_format=ort_format)
        session = _session(data, device, options, external, ort_format=ort_format)
        if _without_cuda(session, device) and preload_once(ort):
            session = _session(data, device, options, external, ort_format=ort_format)
        del external  # (ONNX Runtime has copied what it needs)
        if _without_cuda(session, device):
            tried = ("not even from their pip packages (onnxruntime.preload_dlls())"
                     if hasattr(ort, "preload_dlls") else "and this onnxruntime "
                     f"({ort.__version__}, before 1.21) cannot load them from their pip "
                     "packages")
            raise UnsupportedOperationError(
                f"{NAME}: the CUDA provider did not start on {device}: ONNX Runtime could "
                f"not load CUDA or cuDNN (its log says which library), {tried}: expected "
                "them installed (onnxruntime-gpu[cuda,cudnn], or torch's CUDA build) or on "
                "the library path (LD_LIBRARY_PATH)")
        try:
            values = (*session.get_inputs(), *session.get_outputs())
            # A value reported without dimensions is a scalar, or declared without a shape.
            shapeless = _shapeless(data) if any(not v.shape for v in values) else frozenset()
            return OrtGraph(session, device, shapeless)
        except WasiNNError:
            raise
        except Exception as exc:  # e.g. a name that is not UTF-8: UnicodeDecodeError
            raise InvalidEncodingError(
                f"{NAME}: cannot read the ONNX model's inputs and outputs: {exc}") from exc
