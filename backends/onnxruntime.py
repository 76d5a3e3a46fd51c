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
:func:`_session`): it printed a banner to stdout and parsed a malformed model twice, and
would quietly move a GPU graph to the CPU. An int32 or int64 Div or Mod of the type's
minimum by minus one killed the host with SIGFPE (at run time, or at load when both were
constants): every such node is guarded before ORT sees the model (:mod:`._onnx_division`;
a model without Div or Mod goes through untouched, unparsed). One that cannot be guarded
(an ORT-format model's; one of unknown type before opset 15) is refused in the host's
process only: loaded sandboxed (:func:`~.base.in_sandbox`), where a trap ends just the
sandbox process, it is left unguarded and the rest of the model guarded.

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

import ctypes
import functools
import os
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import onnxruntime as ort
import psutil

from wasinn.enums import ExecutionTarget, GraphEncoding, TensorType
from wasinn.errors import (
    BackendRuntimeError,
    InvalidArgumentError,
    InvalidEncodingError,
    UnsupportedOperationError,
    WasiNNError,
)
from wasinn.tensor import Tensor, count_host_copies, numpy_dtype

from . import cuda
from ._dlpack import KDL_CPU, KDL_CUDA, shareable
from ._graphio import CheckedGraph, expect_builders, expect_encoding, no_device, uncarried_type
from ._onnx_check import (
    LOAD_FORMAT_KEY,
    check_external_data,
    external_data_folder,
    given_external_data,
    read_external_data,
    reads_as_ort_format,
)
from ._onnx_division import guard_integer_division
from ._ort_config_keys import is_config_key
from ._ort_config_keys import unknown as unknown_config_keys
from .base import (
    Backend,
    Builders,
    Device,
    LoadOptions,
    TensorSpec,
    current_cancellation,
    in_sandbox,
    log,
    warn_precision_not_applied,
)
from .formats import check_declared, protobuf_records

NAME = "onnxruntime"

#: What ONNX Runtime raises for a well-formed model it has no kernel for.
_NotImplemented: type[Exception] = ort.capi.onnxruntime_pybind11_state.NotImplemented

_TYPES: dict[str, TensorType] = {
    "tensor(float16)": TensorType.F16,
    "tensor(float)": TensorType.F32,
    "tensor(double)": TensorType.F64,
    "tensor(bfloat16)": TensorType.BF16,
    "tensor(uint8)": TensorType.U8,
    "tensor(int32)": TensorType.I32,
    "tensor(int64)": TensorType.I64,
}
_ONNX_BFLOAT16 = 16
_CPU = Device(ExecutionTarget.CPU)
_BF16 = numpy_dtype(TensorType.BF16)


def _spec(arg: Any, role: str, shapeless: frozenset[str]) -> TensorSpec:
    """The spec of an input or output ``arg``; of unknown rank where its name is in
    ``shapeless`` and ONNX Runtime reports no dimensions (see :func:`_shapeless`)."""
    ttype = _TYPES.get(arg.type)
    if ttype is None:
        raise uncarried_type(NAME, role, arg.name, f"has element type {arg.type}")
    shape = tuple(d if isinstance(d, int) and d >= 0 else None for d in (arg.shape or ()))
    if not shape and arg.name in shapeless:
        return TensorSpec(arg.name, ttype, (), rank_known=False)
    return TensorSpec(arg.name, ttype, shape)


#: ONNX field numbers: ModelProto.graph; GraphProto.input and .output (ValueInfoProto);
#: ValueInfoProto.name and .type; TypeProto.tensor_type; TypeProto.Tensor.shape.
_GRAPH, _GRAPH_VALUES, _NAME, _TYPE, _TENSOR_TYPE, _SHAPE = 7, (11, 12), 1, 2, 1, 2


def _shapeless(model: bytes) -> frozenset[str]:
    """The names of the graph inputs and outputs that ``model`` declares without a shape,
    so of unknown rank (ONNX Runtime reports those as shape ``[]``, as it does scalars,
    whose shape is declared with no dimensions); empty for bytes that are no ONNX protobuf
    (an ORT-format model). Only the graph's value declarations are read, its weights
    skipped: ``onnx`` would parse them all."""
    names = set()
    try:
        graph = _field(memoryview(model), _GRAPH)
        if graph is None:
            return frozenset()
        for number, _, info in protobuf_records(graph):
            if number not in _GRAPH_VALUES or info is None:
                continue
            tensor = _field(_field(info, _TYPE), _TENSOR_TYPE)
            if _field(tensor, _SHAPE) is None:
                names.add(bytes(_field(info, _NAME) or b"").decode("utf-8", "replace"))
    except ValueError:  # not well-formed: no ONNX protobuf
        return frozenset()
    return frozenset(names)


def _field(message: memoryview | None, number: int) -> memoryview | None:
    """The first length-delimited field ``number`` of a protobuf message (None if absent)."""
    if message is None:
        return None
    return next((value for n, _, value in protobuf_records(message)
                 if n == number and value is not None), None)


def _host_array(value: Any, ttype: TensorType) -> np.ndarray[Any, Any]:
    """Copy an OrtValue into a host numpy array (bf16 through its raw bytes on the CPU)."""
    if ttype is not TensorType.BF16:
        return value.numpy()  # type: ignore[no-any-return]
    if value.device_name().lower() != "cpu":
        raise UnsupportedOperationError(
            f"{NAME}: cannot read a bf16 value on {value.device_name()}"
        )
    shape = tuple(value.shape())
    size = int(value.tensor_size_in_bytes())
    raw = (ctypes.c_uint8 * size).from_address(value.data_ptr()) if size else b""
    return np.frombuffer(bytes(raw), dtype=_BF16).reshape(shape)


def _spans(values: list[Any]) -> list[tuple[int, int]]:
    """The host memory (start, end) of the CPU OrtValues among ``values``, empty ones
    left out."""
    spans = []
    for value in values:
        if value.device_name().lower() == "cpu":
            size = int(value.tensor_size_in_bytes())
            if size:
                start = int(value.data_ptr())
                spans.append((start, start + size))
    return spans


def _within(value: Any, spans: list[tuple[int, int]]) -> bool:
    """Whether the CPU OrtValue ``value`` lies in memory of one of ``spans``."""
    if value.device_name().lower() != "cpu" or not value.tensor_size_in_bytes():
        return False
    start = int(value.data_ptr())
    return any(low <= start < high for low, high in spans)


def _owned(value: Any, ttype: TensorType) -> Any:
    """A copy of the CPU OrtValue ``value`` in memory of its own."""
    array = np.array(_host_array(value, ttype), copy=True)
    if ttype is TensorType.BF16:
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array.view(np.uint16),
                                                               _ONNX_BFLOAT16)
    return ort.OrtValue.ortvalue_from_numpy(array)


def _ort_input(tensor: Tensor, dl_device: tuple[int, int]) -> Any:
    """An OrtValue for ``tensor`` without copying host data (bf16 tagged as BFLOAT16),
    nor another library's native value on this graph's device ``dl_device`` (as DLPack
    names it: see :func:`_shared`)."""
    native = tensor.native
    if isinstance(native, ort.OrtValue):
        return native
    array = None
    if native is not None:
        shared = _shared(tensor, dl_device)
        if shared is not None:
            return shared
        array = tensor.host_view()  # an OpenVINO tensor's host memory, as it is
    if array is None:
        array = tensor.numpy()
    if tensor.type is TensorType.BF16:
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array.view(np.uint16),
                                                               _ONNX_BFLOAT16)
    return ort.OrtValue.ortvalue_from_numpy(array)


def _shared(tensor: Tensor, dl_device: tuple[int, int]) -> Any | None:
    """Another library's native value (a torch tensor) on ``dl_device``, as an OrtValue
    over the same memory (DLPack, see :mod:`._dlpack`): a chain of models of different
    libraries keeps its tensors where they are. None where it has no DLPack form there,
    or is a strided view (ONNX Runtime refuses those): the caller copies it through the
    host."""
    native = shareable(tensor, dl_device)
    if native is None:
        return None
    try:
        return ort.OrtValue.from_dlpack(native)
    except Exception:
        return None


class OrtGraph(CheckedGraph):
    """An ONNX model in one ONNX Runtime session on one device."""

    def __init__(self, session: Any, device: Device,
                 shapeless: frozenset[str] = frozenset()) -> None:
        """``shapeless``: the names of the inputs and outputs the model declares without a
        shape (:func:`_shapeless`); their specs have an unknown rank."""
        super().__init__(
            NAME, session, device,
            tuple(_spec(a, "input", shapeless) for a in session.get_inputs()),
            tuple(_spec(a, "output", shapeless) for a in session.get_outputs()),
        )
        self._input_names = tuple(s.name for s in self.inputs)
        self._output_names = tuple(s.name for s in self.outputs)
        self._all_names = list(self._output_names)
        self._has_bf16 = any(s.type is TensorType.BF16 for s in (*self.inputs, *self.outputs))
        if device.kind is ExecutionTarget.GPU:
            self._ort_device: tuple[str, int] = ("cuda", device.index)
            self._dl_device = (KDL_CUDA, device.index)  # as DLPack names it
        else:
            self._ort_device = ("cpu", 0)
            self._dl_device = (KDL_CPU, 0)

    @property
    def session(self) -> Any:
        """The underlying ``onnxruntime.InferenceSession`` (for benchmarks and diagnostics)."""
        return self._open()

    def _run(
        self, session: Any, ordered: list[Tensor], picked: tuple[int, ...], keep_on_device: bool
    ) -> dict[str, Tensor]:
        if not picked:
            return {}  # ORT refuses to run for no outputs (and reads [] as "all")
        cancellation = current_cancellation()
        if cancellation is None:
            return self._dispatch(session, ordered, picked, keep_on_device, None)
        options = _run_options()
        forget = cancellation.on_cancel(functools.partial(_terminate, options))
        try:
            return self._dispatch(session, ordered, picked, keep_on_device, options)
        except BackendRuntimeError as exc:
            if cancellation.cancelled:
                raise BackendRuntimeError(f"{NAME}: run cancelled ({exc.message})") from exc
            raise
        finally:
            forget()
            if cancellation.cancelled:  # its terminate may be set, now or later: not reused
                _spare.options = None

    def _dispatch(self, session: Any, ordered: list[Tensor], picked: tuple[int, ...],
                  keep_on_device: bool, options: Any) -> dict[str, Tensor]:
        if not keep_on_device and not self._has_bf16:
            for tensor in ordered:  # (a loop, not all(genexpr): this runs on every request)
                if not tensor.is_host:
                    break
            else:
                return self._run_host(session, ordered, picked, options)
        return self._run_bound(session, ordered, picked, keep_on_device, options)

    def _run_host(
        self, session: Any, ordered: list[Tensor], picked: tuple[int, ...], options: Any
    ) -> dict[str, Tensor]:
        # Plain loops, not comprehensions: each comprehension is one more frame (3.11), and
        # this runs on every request, with caches cold from the inference before it.
        names = self._output_names
        wanted = self._all_names if picked is self._all else [names[i] for i in picked]
        feed = {}
        for name, tensor in zip(self._input_names, ordered, strict=True):
            feed[name] = tensor.numpy()
        try:
            results = session.run(wanted, feed, options)
        except Exception as exc:
            raise BackendRuntimeError(f"{NAME}: run failed: {exc}") from exc
        count_host_copies(len(results))  # ORT's values, handed back as numpy arrays
        specs = self.outputs
        out: dict[str, Tensor] = {}
        for i, arr in zip(picked, results, strict=True):
            out[names[i]] = Tensor(arr.shape, specs[i].type, array=arr)
        return out

    def _run_bound(
        self, session: Any, ordered: list[Tensor], picked: tuple[int, ...], keep: bool,
        options: Any,
    ) -> dict[str, Tensor]:
        # An output named twice (by name and position) is bound, and returned, once.
        unique = tuple(dict.fromkeys(picked))
        try:
            binding = session.io_binding()
            fed = []
            for name, tensor in zip(self._input_names, ordered, strict=True):
                value = _ort_input(tensor, self._dl_device)
                fed.append(value)
                binding.bind_ortvalue_input(name, value)
            for i in unique:
                spec = self.outputs[i]
                # ORT cannot hand bf16 back from a CUDA buffer: bf16 outputs land on the CPU.
                where = "cpu" if not keep or spec.type is TensorType.BF16 else self._ort_device[0]
                binding.bind_output(spec.name, where, self._ort_device[1] if where != "cpu" else 0)
            session.run_with_iobinding(binding, options)
            values = binding.get_outputs()
            # A graph output that is a graph input comes back as the very OrtValue bound
            # for it, over the caller's memory: such an output gets memory of its own.
            inputs = _spans(fed)
            if inputs:
                values = [_owned(v, self.outputs[i].type) if _within(v, inputs) else v
                          for i, v in zip(unique, values, strict=True)]
        except WasiNNError:
            raise
        except Exception as exc:
            raise BackendRuntimeError(f"{NAME}: run failed: {exc}") from exc
        result: dict[str, Tensor] = {}
        for i, value in zip(unique, values, strict=True):
            spec = self.outputs[i]
            if keep:
                result[spec.name] = Tensor.from_native(
                    value, value.shape(), spec.type,
                    device=self.device.name if value.device_name().lower() != "cpu" else "cpu",
                    materialize=functools.partial(_host_array, value, spec.type),
                )
            else:
                array = _host_array(value, spec.type)
                result[spec.name] = Tensor(array.shape, spec.type, array=array)
        if not keep:
            count_host_copies(len(unique))
        return result


_spare = threading.local()
_GPU_GRAPH_ID = "gpu_graph_id"  # ORT's run config key for a captured CUDA graph's id


def _run_options() -> Any:
    """This thread's ``RunOptions`` for a cancellable run (see the module docstring)."""
    options = getattr(_spare, "options", None)
    if options is None:
        options = ort.RunOptions()
        # A terminated run is expected here: keep ORT's own error log off stderr.
        options.log_severity_level = 4
        # run_with_iobinding looks this entry up on every run, and a missing entry costs
        # a C++ exception turned into a Python one: 25-50 us a run. "0" is the value an
        # unset entry stands for (and only matters with CUDA graph capture, off here).
        options.add_run_config_entry(_GPU_GRAPH_ID, "0")
        _spare.options = options
    return options


def _terminate(options: Any) -> None:
    # Called from the cancelling thread: ORT reads the flag from its own threads.
    options.terminate = True


class OnnxRuntimeBackend(Backend):
    """ONNX Runtime: ``onnx`` on ``cpu`` and, with the CUDA provider, ``gpu:N``."""

    name = NAME
    encodings = frozenset({GraphEncoding.ONNX})

    def __init__(self) -> None:
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
        session = _session(data, device, options, external)
        del external  # (ONNX Runtime has copied what it needs)
        if device.kind is ExecutionTarget.GPU and "CUDAExecutionProvider" not in (
            session.get_providers()
        ):
            raise UnsupportedOperationError(f"{NAME}: the CUDA provider did not start on {device}")
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


def _session(data: bytes, device: Device, options: LoadOptions,
             external: Mapping[str, bytes]) -> Any:
    """An ``InferenceSession`` for ``data`` on ``device``, with ORT's provider fallback off.

    ORT's Python wrapper treats any ValueError or RuntimeError while it builds a session
    as a provider failure: it prints an "EP Error" banner to stdout and builds the
    session again with the CPU provider alone (a malformed model is parsed twice), and
    at run time it swaps a failing provider for the CPU one in place, so a graph placed
    on a GPU would quietly run on the CPU. Both are off here. A GPU session that fails to
    build is tried on the CPU once, only to tell the two failures apart.

    Raises InvalidEncodingError for a model ONNX Runtime cannot load,
    UnsupportedOperationError where only the CUDA provider fails on it or where ONNX
    Runtime has no kernel for what a well-formed model uses (NOT_IMPLEMENTED), and
    InvalidArgumentError for provider options that contradict ``device``
    (:func:`providers_for`). ``external``: the model's external data files, by location.
    """
    providers = providers_for(device, options)
    try:
        session = ort.InferenceSession(
            data, sess_options=session_options(options, external), providers=providers,
            enable_fallback=0,
        )
    except Exception as exc:
        if device.kind is ExecutionTarget.GPU and _loads_on_cpu(data, options, external):
            raise UnsupportedOperationError(
                f"{NAME}: the CUDA provider failed on {device}: {exc}") from exc
        if isinstance(exc, _NotImplemented):  # a kernel this build lacks (bf16 Add)
            raise UnsupportedOperationError(
                f"{NAME}: ONNX Runtime cannot run the model on {device}: {exc}: expected "
                "operators and element types it implements there") from exc
        raise InvalidEncodingError(f"{NAME}: cannot load the ONNX model: {exc}") from exc
    session.disable_fallback()  # enable_fallback=0 did so already; said again for run()
    return session


def _loads_on_cpu(data: bytes, options: LoadOptions, external: Mapping[str, bytes]) -> bool:
    """Whether a CPU-only session can be built for ``data`` (the model is readable)."""
    try:
        ort.InferenceSession(data, sess_options=session_options(options, external),
                             providers=["CPUExecutionProvider"], enable_fallback=0)
    except Exception:
        return False
    return True


#: Session config entries wasinn sets unless ``LoadOptions.extra`` says otherwise: stop the
#: intra-op threads spinning when a run returns (see the module docstring).
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
    entries = {**SESSION_DEFAULTS, **options.extra}
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
    ``options.precision`` (see the module docstring), then ``extra["provider_options"]``,
    whose entries win, except a ``device_id`` naming another GPU than ``device``
    (InvalidArgumentError): the graph would compute there while its outputs, its
    actor and its stats said ``device``."""
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
