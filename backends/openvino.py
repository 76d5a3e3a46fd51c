"""OpenVINO behind the wasinn contract: IR, ONNX, TensorFlow Lite and TensorFlow models
(see :mod:`wasinn.backends._ovread`) on the CPU and on the GPU (``GPU.N`` -> ``gpu:N``)
and NPU (``NPU`` -> ``tpu:0``) plugins where ``Core.available_devices`` lists them.

Inference precision defaults to f32 (``LoadOptions.precision``; ``"default"`` leaves the
plugin's choice, which is bf16 on CPUs with AMX) so that outputs agree across machines.
``"tf32"`` (NVIDIA's TensorFloat-32, for the CUDA backends) is read as f32: OpenVINO has
no such mode.

A :class:`OvGraph` owns one ``CompiledModel`` and a pool of ``InferRequest`` s: each run
borrows a request, so concurrent runs on several threads never share one, and holds the
memory OpenVINO may read IR weights from until it ends, whenever the graph is closed.
Inputs are wrapped as ``ov.Tensor`` s over the caller's memory (no copy; a strided or
byte-swapped array is copied first). With ``keep_on_device`` the run's request is not
returned to the pool: its output ``ov.Tensor`` s are handed out as native tensors and can
be set as inputs of another request without a copy; an output that is an input's own
memory (a graph that returns an input, with static shapes) is copied, as the caller may
refill that memory.

Device memory: on a device with a remote context (the GPU and NPU plugins; the CPU has
none) a graph uses the device's default context, which every graph compiled for that
device shares. A run with ``keep_on_device`` allocates its statically shaped outputs in
device memory there (``RemoteContext.create_tensor``) and hands out those
``ov.RemoteTensor`` s; set as inputs of the next run on that device, they never pass
through host memory. Reading one on the host copies it once (``RemoteTensor.copy_to``);
its rows are region-of-interest remote tensors. An output of dynamic shape (a batch
axis) is allocated there once a run on inputs of the same dimensions has shown its
shape; until then, and for outputs without a name to bind by, it stays the request's
own. A run that fails on a shape so learned (an output whose shape depends on the
data) forgets it: that request fails as any failed run does, and later runs on those
dimensions use the request's own outputs until one shows a shape again.

Cancellation: a run under a :class:`~wasinn.backends.base.Cancellation` registers its
infer request's ``cancel`` (repeated until the run returns: OpenVINO ignores a cancel that
comes just before a run starts, see :class:`_Canceller`); OpenVINO stops at the next node
boundary (a Loop/TensorIterator node's own iterations are not interrupted) and the run
raises BackendRuntimeError. A request that may have been cancelled is retired, never
pooled again.

A graph with a dynamic shape is compiled afresh after a run that was cancelled or failed
inside OpenVINO. OpenVINO 2026.4's CPU plugin keeps shape state in the compiled model
that such a run leaves half-updated: later runs, on fresh requests too, whose inputs have
the dimensions of the last completed run come back with outputs shaped for the stopped
one (after a cancel, 140 of 171 tries here; in an 8-thread stress, runs nobody cancelled
got wrong outputs, one with values from elsewhere in memory), and a run that failed on a
data-dependent shape "succeeds" the second time with the previous run's shape. The next
run compiles the graph again (from the ``ov.Model`` such a graph keeps, so the weights are
held twice where the model does not share the caller's buffer) before it starts; runs
already going on the old compile finish there, and their requests are not pooled again.
Statically shaped graphs are not affected and keep nothing.

Element types: all seven wasi-nn types load, but the CPU and GPU plugins compute i64 as
i32. Rather than truncate silently, a run refuses i64 input values outside the i32 range
with InvalidArgumentError.

Likewise f64 is computed as f32, whatever ``precision`` says: about 7 significant digits
(123456789.123 comes back as 123456792), magnitudes below f32's smallest normal lose
precision or become 0, and finite magnitudes above f32's maximum (about 3.4e38) would
come back as 3.4e38 or inf. A run refuses f64 inputs with finite values outside
[-3.4e38, 3.4e38] with InvalidArgumentError (infinities and NaN are not refused, though
the plugin's f64 -> f32 conversion inside a graph may saturate an infinity to +-3.4e38),
and loading a graph with f64 inputs or outputs logs a warning (``wasinn.backends``) once
per load. ONNX Runtime computes f64 exactly.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import queue
import re
import threading
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import openvino as ov

from wasinn.enums import ExecutionTarget, GraphEncoding, TensorType
from wasinn.errors import (
    BackendRuntimeError,
    InvalidArgumentError,
    InvalidEncodingError,
    WasiNNError,
)
from wasinn.tensor import Tensor, numpy_dtype

from ._dlpack import KDL_CPU, shareable
from ._graphio import CheckedGraph, no_device, uncarried_type
from ._ov_options import SET_FROM_OPTIONS
from ._ovread import NAME, ov_message, read_model
from .base import (
    Backend,
    Builders,
    Cancellation,
    Device,
    LoadOptions,
    TensorSpec,
    current_cancellation,
    log,
)

_TYPES: dict[str, TensorType] = {
    "f16": TensorType.F16, "f32": TensorType.F32, "f64": TensorType.F64,
    "bf16": TensorType.BF16, "u8": TensorType.U8, "i32": TensorType.I32, "i64": TensorType.I64,
}
_OV_TYPES = {tt: getattr(ov.Type, name) for name, tt in _TYPES.items()}
_CARRIERS = {tt: numpy_dtype(tt) for tt in TensorType}
_I32 = np.iinfo(np.int32)
_F32_MAX = float(np.finfo(np.float32).max)


_SINK_PORT = re.compile(r"/sink_port_\d+$")


def _port_name(port: Any, is_output: bool) -> str:
    names = port.get_names()
    if len(names) > 1:
        # A port may carry several tensor names: TensorFlow gives an output every name on
        # its path (relu:0, y:0), and compiling may fold an input's first node into it
        # (ONNX's x * 1 leaves {x, t}). The Parameter or Result node keeps the model's
        # own name; any_name is whichever the set yields first. OpenVINO's ONNX reader
        # names a Result after its output: "y/sink_port_0" (an Identity's output y folded
        # into its input h leaves {h, y}).
        node = _SINK_PORT.sub("", port.get_node().get_friendly_name())
        if node in names:
            return str(node)
    return str(port.get_any_name()) if names else f"{'output' if is_output else 'input'}"


def _specs(ports: Sequence[Any], is_output: bool
           ) -> tuple[tuple[TensorSpec, ...], dict[str, int]]:
    specs, aliases = [], {}
    role = "output" if is_output else "input"
    for i, port in enumerate(ports):
        name = _port_name(port, is_output) if port.get_names() else f"{role}_{i}"
        ttype = _TYPES.get(port.get_element_type().get_type_name())
        if ttype is None:
            raise uncarried_type(
                NAME, role, name,
                f"has element type {port.get_element_type().get_type_name()}")
        pshape = port.get_partial_shape()
        if pshape.rank.is_dynamic:  # any number of dimensions
            specs.append(TensorSpec(name, ttype, (), rank_known=False))
        else:
            shape = tuple(d.get_length() if d.is_static else None for d in pshape)
            specs.append(TensorSpec(name, ttype, shape))
        for alias in port.get_names():
            aliases[alias] = i
            if alias.endswith(":0"):
                aliases.setdefault(alias[:-2], i)
    return tuple(specs), aliases


def _host_view(tensor: Tensor) -> np.ndarray[Any, Any] | None:
    """Another library's native value in host memory (an ``OrtValue`` or a torch tensor
    on the CPU) as a numpy array over the same memory (DLPack, see :mod:`._dlpack`), so
    that a CPU chain of models of different libraries copies nothing; None where it has
    no such form (device memory, bf16, which numpy lacks): the caller reads it through
    ``Tensor.numpy``."""
    native = shareable(tensor, (KDL_CPU, 0))
    if native is None:
        return None
    try:
        view: np.ndarray[Any, Any] = np.from_dlpack(native)
    except Exception:
        return None
    return view


def _ov_tensor(tensor: Tensor, device: str, name: str) -> Any:
    """``tensor`` for input ``name`` as OpenVINO takes it (host memory shared, not copied).

    Raises InvalidArgumentError for i64 values outside the i32 range, finite f64
    values outside the f32 range (see the module docstring) and a host array whose
    elements are not of the tensor's type.
    """
    native = tensor.native
    if isinstance(native, ov.Tensor):
        return native
    if isinstance(native, ov.RemoteTensor) and tensor.device == device:
        return native  # device memory, on this device: set as it is
    array = _host_view(tensor) if native is not None and device == "cpu" else None
    if array is None:
        array = tensor.numpy()
    if array.dtype is not _CARRIERS[tensor.type] or not array.flags.c_contiguous:
        array = _shareable(array, tensor.type)
    if tensor.type is TensorType.I64 and array.size and (
        array.min() < _I32.min or array.max() > _I32.max
    ):
        raise InvalidArgumentError(
            f"{NAME}: input {name!r}: i64 values outside the i32 range cannot be computed "
            f"exactly (OpenVINO computes i64 as i32): expected values in "
            f"[{_I32.min}, {_I32.max}]"
        )
    if tensor.type is TensorType.F64 and array.size and _beyond_f32(array):
        raise InvalidArgumentError(
            f"{NAME}: input {name!r}: finite f64 values beyond the f32 range cannot be "
            f"computed (OpenVINO computes f64 as f32): expected magnitudes up to "
            f"{_F32_MAX:.7g}, or onnxruntime for full f64"
        )
    # The (array, shape, type) constructor shares the memory, read-only arrays included;
    # bf16 travels as its uint16 bit pattern.
    carrier = array.view(np.uint16) if tensor.type is TensorType.BF16 else array
    return ov.Tensor(carrier, ov.Shape(array.shape), _OV_TYPES[tensor.type])


def _shareable(array: np.ndarray[Any, Any], ttype: TensorType) -> np.ndarray[Any, Any]:
    """``array`` (of a Tensor built around it, not by ``from_numpy``) as memory OpenVINO
    can share. OpenVINO takes a pointer with the shape and element type it is told: a
    strided array it refuses with a bare RuntimeError, and bytes in the other order it
    reads as they lie, and ``np.longlong`` (which numpy counts as equal to int64, and
    another library's int64 array may be) it refuses. Copied C-contiguous, in native
    byte order, relabelled as the type's own dtype (a Tensor's array holds elements of
    its type: its constructor checks that)."""
    carrier = _CARRIERS[ttype]
    return np.ascontiguousarray(array, dtype=carrier).view(carrier)


def _beyond_f32(array: np.ndarray[Any, Any]) -> bool:
    """Whether ``array`` (f64) holds a finite value of magnitude above f32's maximum.
    Two reductions without temporaries in the usual case; a NaN (which makes min and max
    NaN) or a value beyond the range takes the masked path."""
    if array.min() >= -_F32_MAX and array.max() <= _F32_MAX:
        return False
    with np.errstate(invalid="ignore"):
        over = np.abs(array) > _F32_MAX
    return bool(np.isfinite(array[over]).any())


def _host_array(value: Any, ttype: TensorType, keep_alive: object = None) -> np.ndarray[Any, Any]:
    """A host copy of an ``ov.Tensor`` or ``ov.RemoteTensor`` (``keep_alive``: the
    request that owns its memory)."""
    del keep_alive
    if not isinstance(value, ov.Tensor):  # device memory: copied to the host first
        host = ov.Tensor(_OV_TYPES[ttype], value.get_shape())
        value.copy_to(host)
        value = host
    data = value.data
    if ttype is TensorType.BF16:
        data = data.view(numpy_dtype(TensorType.BF16))
    return np.array(data, copy=True)


def _unshared(value: Any, hosts: list[Any]) -> Any:
    """``value``, a kept output, or a copy of it where it lies in the memory of one of
    ``hosts`` (inputs over the caller's memory)."""
    if isinstance(value, ov.Tensor) and value.byte_size:
        data = value.data
        if any(np.may_share_memory(data, host.data) for host in hosts):
            own = ov.Tensor(value.get_element_type(), value.get_shape())
            value.copy_to(own)
            return own
    return value


def _native(value: Any, ttype: TensorType, device: str, owner: object) -> Tensor:
    """``value`` as it is (``owner``: the request that owns its memory, kept alive with
    it); its rows are region-of-interest tensors over the same memory."""
    return Tensor.from_native(
        value, tuple(value.get_shape()), ttype, device=device,
        materialize=functools.partial(_host_array, value, ttype, owner),
        rows=lambda start, stop: _native(_rows(value, start, stop), ttype, device, owner),
        host_view=(functools.partial(_host_memory, value, ttype, owner)
                   if isinstance(value, ov.Tensor) else None))


def _host_memory(value: Any, ttype: TensorType, owner: object) -> np.ndarray[Any, Any] | None:
    """An ``ov.Tensor``'s data over its own memory (the request ``owner`` retires it with
    the tensor instead of reusing it), as another library reads it; None where numpy
    cannot show it as the tensor's type without a copy."""
    del owner  # (kept alive by the partial, with the memory it owns)
    try:
        data = value.data
        if ttype is TensorType.BF16:
            data = data.view(numpy_dtype(TensorType.BF16))
    except Exception:
        return None
    if data.dtype != numpy_dtype(ttype) or not data.flags.c_contiguous:
        return None
    view: np.ndarray[Any, Any] = data
    return view


def _rows(value: Any, start: int, stop: int) -> Any:
    end = list(value.get_shape())
    begin = [0] * len(end)
    begin[0], end[0] = start, stop
    # ov.Tensor and ov.RemoteTensor both take (tensor, begin, end) for a region of interest.
    return type(value)(value, ov.Coordinate(begin), ov.Coordinate(end))


def _remote_context(compiled: Any, device: Device) -> Any:
    """The device's remote context (the plugin's default one for it), or None where the
    device has none (the CPU) or the plugin cannot give it."""
    if device.kind is ExecutionTarget.CPU:
        return None
    try:
        return compiled.get_context()
    except Exception:  # a plugin without remote contexts: outputs stay the request's
        return None


#: The dimensions of a run's inputs, in order: what learned output shapes are keyed by.
_Dims = tuple[tuple[int, ...], ...]

#: Input dimensions whose output shapes a graph remembers (see the module docstring);
#: past this many, it starts again.
_LEARNED_SHAPES = 64


class _DeviceOutput:
    """What a kept output needs to be allocated in device memory: its port's name (remote
    tensors are set by name), element type and shape (None where dynamic)."""

    __slots__ = ("name", "shape", "type")

    def __init__(self, port: Any) -> None:
        self.name = str(port.get_any_name())
        self.type = port.get_element_type()
        pshape = port.get_partial_shape()
        self.shape: Any = pshape.to_shape() if pshape.is_static else None


def _device_outputs(compiled: Any) -> dict[int, _DeviceOutput]:
    """The outputs that can live in device memory: those with a name to bind them by."""
    return {i: _DeviceOutput(port) for i, port in enumerate(compiled.outputs)
            if port.get_names()}


class OvGraph(CheckedGraph):
    """A model compiled by OpenVINO for one device, with a pool of infer requests."""

    def __init__(self, compiled: Any, device: Device, keep_alive: object = None,
                 recompile: Callable[[], Any] | None = None) -> None:
        """``recompile``: how to compile the model again, for a graph with a dynamic shape
        (see the module docstring); None for a static one."""
        inputs, in_aliases = _specs(compiled.inputs, is_output=False)
        outputs, out_aliases = _specs(compiled.outputs, is_output=True)
        super().__init__(NAME, compiled, device, inputs, outputs, in_aliases=in_aliases,
                         out_aliases=out_aliases)
        self._keep_alive = keep_alive  # weights OpenVINO may share with the model
        self._idle: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._recompile = recompile
        #: Set by a run stopped inside OpenVINO on a dynamic graph: the next run compiles
        #: the graph afresh first (under ``_renewing``), see the module docstring.
        self._stale = False
        self._renewing = threading.Lock()
        #: Compiles after the first (diagnostics, tests).
        self.recompiles = 0
        #: The device's remote context (see the module docstring), None on the CPU.
        self.remote_context = _remote_context(compiled, device)
        self._device_outputs = (_device_outputs(compiled) if self.remote_context is not None
                                else {})
        # Input dimensions -> {output index: shape} seen for them (dynamic outputs only).
        self._learned: dict[_Dims, dict[int, Any]] = {}
        # Remote tensors are set by name: the inputs' (None where a port has none).
        self._input_ports = tuple(str(p.get_any_name()) if p.get_names() else None
                                  for p in compiled.inputs)

    @property
    def compiled_model(self) -> Any:
        """The underlying ``openvino.CompiledModel`` (for benchmarks and diagnostics)."""
        return self._open()

    def _request(self) -> tuple[Any, queue.SimpleQueue[Any]]:
        """An idle infer request, or a new one, and the pool it goes back to: the pool of
        the time it was taken, so that a run that ends after close() does not pool its
        request (which holds the compiled model) in the closed graph."""
        idle = self._idle
        try:
            return idle.get_nowait(), idle
        except queue.Empty:
            return self.compiled_model.create_infer_request(), idle

    def _run(
        self, compiled: Any, ordered: list[Tensor], picked: tuple[int, ...], keep_on_device: bool
    ) -> dict[str, Tensor]:
        # ``compiled`` unused: requests come from the pool, or from ``compiled_model``,
        # which refuses a graph closed since.
        device = self.device.name
        ov_inputs = [_ov_tensor(t, device, spec.name)
                     for t, spec in zip(ordered, self.inputs, strict=True)]
        cancellation = current_cancellation()
        if cancellation is not None and cancellation.cancelled:
            raise BackendRuntimeError(f"{NAME}: run cancelled before it started")
        bound: dict[int, Any] | None = None
        # Where kept outputs may go to device memory: the key their learned shapes go by.
        dims: _Dims | None = None
        if keep_on_device and self.remote_context is not None:
            dims = tuple(t.dims for t in ordered)
        # Held until the run is over: the CPU plugin reads some IR weights in place, from
        # this memory, which close() in another thread lets go of (SIGSEGV once unmapped).
        # Taken before the request: once close() has dropped it, no request can be had.
        weights = self._keep_alive
        if self._stale:
            self._renew()
        started = False
        try:
            request, idle = self._request()
            for i, value in enumerate(ov_inputs):
                if isinstance(value, ov.Tensor):
                    request.set_input_tensor(i, value)
                else:
                    self._set_remote_input(request, i, value)
            if dims is not None:
                bound = self._bind_device_outputs(request, dims, picked)
            started = True
            reusable = _infer(request, cancellation)
            if bound:
                values = [bound[i] if i in bound else request.get_output_tensor(i)
                          for i in picked]
            else:
                values = [request.get_output_tensor(i) for i in picked]
            if dims is not None:
                self._learn(dims, picked, values)
        except WasiNNError:
            raise
        except Exception as exc:
            if bound and dims is not None:  # a learned shape may be wrong here: forget
                self._learned.pop(dims, None)
            if started and self._recompile is not None:
                self._stale = True  # before any other run can take a request
            if cancellation is not None and cancellation.cancelled:
                raise BackendRuntimeError(f"{NAME}: run cancelled ({exc})") from exc
            raise BackendRuntimeError(f"{NAME}: run failed: {exc}") from exc
        finally:
            del weights
        if keep_on_device:
            return self._kept(request, picked, values, ov_inputs, ordered)
        specs = self.outputs
        result = {}
        for i, value in zip(picked, values, strict=True):
            array = _host_array(value, specs[i].type)
            result[specs[i].name] = Tensor(array.shape, specs[i].type, array=array)
        if reusable:
            idle.put(request)
        return result

    def _kept(self, request: Any, picked: tuple[int, ...], values: list[Any],
              ov_inputs: list[Any], ordered: list[Tensor]) -> dict[str, Tensor]:
        # A kept run's outputs, as native tensors of the request, which owns their memory:
        # it is retired with them instead of being reused. A graph input that is also an
        # output (static shapes) comes back as the very memory it was given: the
        # caller's, which it may refill. That gets its own.
        hosts = [v for v, t in zip(ov_inputs, ordered, strict=True) if v is not t.native]
        if hosts:
            values = [_unshared(value, hosts) for value in values]
        specs = self.outputs
        return {specs[i].name: _native(value, specs[i].type, self.device.name, request)
                for i, value in zip(picked, values, strict=True)}

    def _renew(self) -> None:
        # The compile a stopped run left in doubt is replaced before this run starts; a
        # run still going on it keeps its request, which goes back to the old pool.
        recompile = self._recompile
        assert recompile is not None
        with self._renewing:
            if not self._stale or self._handle is None:  # another run renewed it, or closed
                return
            try:
                compiled = recompile()
            except Exception as exc:
                raise BackendRuntimeError(
                    f"{NAME}: compiling the graph again after a stopped run failed: {exc}"
                ) from exc
            self._handle = compiled
            self._idle = queue.SimpleQueue()
            self._learned.clear()
            self.recompiles += 1
            self._stale = False

    def _set_remote_input(self, request: Any, index: int, value: Any) -> None:
        # A remote tensor (device memory) is set by its port's name.
        name = self._input_ports[index]
        if name is None:
            raise InvalidArgumentError(
                f"{NAME}: input {self.inputs[index].name!r} has no name OpenVINO can bind "
                "device memory to: expected a host tensor there")
        request.set_tensor(name, value)

    def _bind_device_outputs(self, request: Any, dims: _Dims,
                             picked: tuple[int, ...]) -> dict[int, Any]:
        # Outputs allocated in the device's memory for this run, on inputs of ``dims``
        # (only where there is a remote context).
        context = self.remote_context
        assert context is not None
        learned = self._learned.get(dims, {})
        bound = {}
        for i in picked:
            out = self._device_outputs.get(i)
            if out is None:
                continue
            shape = out.shape if out.shape is not None else learned.get(i)
            if shape is not None:
                remote = context.create_tensor(out.type, shape, {})
                request.set_tensor(out.name, remote)
                bound[i] = remote
        return bound

    def _learn(self, dims: _Dims, picked: tuple[int, ...],
               values: list[Any]) -> None:
        # Remember the shapes of dynamic outputs that stayed the request's this time.
        shapes = {i: value.get_shape() for i, value in zip(picked, values, strict=True)
                  if (out := self._device_outputs.get(i)) is not None and out.shape is None
                  and isinstance(value, ov.Tensor)}
        if not shapes:
            return
        learned = self._learned
        if len(learned) >= _LEARNED_SHAPES:
            learned.clear()
        learned.setdefault(dims, {}).update(shapes)

    def close(self) -> None:
        super().close()
        self._idle = queue.SimpleQueue()
        self._keep_alive = None
        self._recompile = None


class OpenVinoBackend(Backend):
    """OpenVINO: openvino (IR), onnx, tensorflow and tensorflowlite on cpu / gpu:N / tpu:0."""

    name = NAME
    encodings = frozenset({GraphEncoding.OPENVINO, GraphEncoding.ONNX,
                           GraphEncoding.TENSORFLOW, GraphEncoding.TENSORFLOWLITE})

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._core: Any = None
        self._devices: dict[Device, str] | None = None

    @property
    def core(self) -> Any:
        """The process's ``openvino.Core`` (created on first use)."""
        with self._lock:
            if self._core is None:
                self._core = ov.Core()
            return self._core

    def _device_map(self) -> dict[Device, str]:
        if self._devices is None:
            found: dict[Device, str] = {}
            for name in self.core.available_devices:
                kind, _, index = str(name).partition(".")
                if kind == "CPU":
                    found[Device(ExecutionTarget.CPU)] = name
                elif kind == "GPU":
                    found[Device(ExecutionTarget.GPU, int(index or 0))] = name
                elif kind == "NPU":
                    found[Device(ExecutionTarget.TPU, int(index or 0))] = name
            self._devices = found
        return self._devices

    def devices(self) -> list[Device]:
        return sorted(self._device_map())

    def load(
        self,
        builders: Builders,
        encoding: GraphEncoding,
        device: Device,
        options: LoadOptions | None = None,
    ) -> OvGraph:
        """Read ``builders`` through the frontend for ``encoding`` and compile for ``device``.

        Raises InvalidEncodingError (bytes OpenVINO cannot read as ``encoding``, a wrong
        builder count, IR weights that do not match the XML, input or output names that
        are not UTF-8), SecurityError (an ONNX model that refers to external data files)
        and UnsupportedOperationError (a device OpenVINO does not have here, a type
        outside the wasi-nn set). TensorFlow and TFLite models are read in a child
        process (see :mod:`._ovread`).
        """
        ov_device = self._device_map().get(device)
        if ov_device is None:
            raise no_device(NAME, device, self.devices())
        options = options or LoadOptions()
        model, keep_alive = read_model(self.core, builders, encoding, options.source,
                                       options.external_data)
        config = compile_config(self.core, ov_device, options)
        try:
            compiled = self.core.compile_model(model, ov_device, config)
        except Exception as exc:
            raise self._compile_error(model, ov_device, config, options, exc,
                                      f"the {encoding.value} model for {device}") from exc
        recompile = (functools.partial(self.core.compile_model, model, ov_device, config)
                     if _dynamic(model) else None)
        try:
            graph = OvGraph(compiled, device, keep_alive, recompile)
        except WasiNNError:
            raise
        except Exception as exc:  # e.g. a port name that is not UTF-8: UnicodeDecodeError
            raise InvalidEncodingError(
                f"{NAME}: cannot read the {encoding.value} model's inputs and outputs: {exc}"
            ) from exc
        _warn_f64(graph)
        return graph


    def _compile_error(self, model: Any, ov_device: str, config: dict[str, Any],
                       options: LoadOptions, exc: Exception, what: str) -> WasiNNError:
        """Why ``model`` did not compile with ``config``: the model (InvalidEncodingError),
        or the options the caller gave (InvalidArgumentError) when it compiles without
        them. Only on a failed compile: the second try costs another compile."""
        given = [key for key in options.extra if key in config]
        if given:
            rest = {k: v for k, v in config.items() if k not in given}
            try:
                self.core.compile_model(model, ov_device, rest)
            except Exception:
                pass  # fails without them too: the model is at fault
            else:
                named = ", ".join(f"{key}={options.extra[key]!r:.40}" for key in given)
                return InvalidArgumentError(
                    f"{NAME}: {ov_device} refused option(s) {named}: {ov_message(exc)}: "
                    "expected values the device takes for them")
        return InvalidEncodingError(f"{NAME}: cannot compile {what}: {exc}")


def _dynamic(model: Any) -> bool:
    """Whether any of ``model``'s inputs or outputs has a dynamic shape."""
    return any(port.get_partial_shape().is_dynamic
               for port in (*model.inputs, *model.outputs))


def _infer(request: Any, cancellation: Cancellation | None) -> bool:
    """Run ``request`` to its end, or until ``cancellation`` (hooked to a
    :class:`_Canceller` of the request). Returns whether the request may be pooled again:
    not if it was cancelled (a cancel() may still be running on it)."""
    if cancellation is None:
        request.infer()
        return True
    canceller = _Canceller(request)
    forget = cancellation.on_cancel(canceller)
    try:
        if cancellation.cancelled:  # before the hook was set: it ran at once, for nothing
            raise RuntimeError("cancelled as the run was about to begin")
        request.infer()
    finally:
        canceller.over = True
        forget()
    return not cancellation.cancelled


class _Canceller:
    """Cancels one run's infer request, and goes on cancelling it until the run is over.

    OpenVINO ignores cancel() on a request that is not running yet: a cancel that came
    after the run's last look at its cancellation (:func:`_infer`) but before OpenVINO
    marked the request busy would be lost, and the run would go to its end. Looking again
    after starting needs ``start_async``, which hands every run to OpenVINO's executor
    thread: measured +100-150 us a run through a worker thread on a 2-vCPU VM
    (MobileNetV2: +3.6-5.6 % became +8.7-11 %). Instead, a cancelled run that is not over
    yet gets a thread that cancels the request again, 0.5 ms later and then at growing
    intervals (up to 50 ms), until the run returns: the first repeat after the request
    turned busy stops it. Costs nothing on runs that are not cancelled."""

    __slots__ = ("over", "request")

    def __init__(self, request: Any) -> None:
        self.request = request
        #: Set by the running thread once ``infer()`` has returned (or raised).
        self.over = False

    def __call__(self) -> None:
        self.request.cancel()
        if not self.over:
            threading.Thread(target=self._repeat, name="wasinn openvino cancel",
                             daemon=True).start()

    def _repeat(self) -> None:
        delay = _CANCEL_REPEAT_S
        while not self.over:
            time.sleep(delay)
            if self.over:
                return
            try:
                self.request.cancel()
            except Exception:  # nothing left to cancel
                return
            delay = min(delay * 2, _CANCEL_REPEAT_MAX_S)


#: How soon a cancelled run's request is cancelled again, and the longest interval.
_CANCEL_REPEAT_S, _CANCEL_REPEAT_MAX_S = 0.0005, 0.05


def _warn_f64(graph: OvGraph) -> None:
    """Log, once per load, that the graph's f64 values are computed in f32 precision."""
    f64 = [s.name for s in (*graph.inputs, *graph.outputs) if s.type is TensorType.F64]
    if f64:
        log.warning("%s: %s %s f64: OpenVINO computes f64 in f32 precision (about 7 "
                    "significant digits; inputs beyond +-%.7g are refused): load it on "
                    "onnxruntime for full f64", NAME, ", ".join(map(repr, f64)),
                    "is" if len(f64) == 1 else "are", _F32_MAX)


def compile_config(core: Any, ov_device: str, options: LoadOptions) -> dict[str, Any]:
    """The compile properties wasinn uses; also used by benchmarks for native models.

    ``precision`` becomes ``INFERENCE_PRECISION_HINT`` where the device supports it
    (``"default"`` or ``""`` leaves the plugin's choice; ``"tf32"`` is f32); ``threads``
    becomes ``INFERENCE_NUM_THREADS`` (an ``extra`` entry setting either of those two as
    well is InvalidArgumentError); ``thread_pinning=False`` becomes
    ``ENABLE_CPU_PINNING`` false; ``extra`` entries named after a property the device
    supports (``PERFORMANCE_HINT``, ``NUM_STREAMS``...) are passed as given. An OpenVINO
    property this device lacks (another plugin's, such as ``GPU_HOST_TASK_PRIORITY`` on the
    CPU) is left out with a warning; a key in capitals that names no OpenVINO property (a
    misspelling) is InvalidArgumentError; other keys are ignored (they are meant for
    another backend).
    """
    supported = _supported_properties(core, ov_device)
    config: dict[str, Any] = {}
    precision = options.precision.strip().lower()
    if precision == "tf32":  # NVIDIA's TensorFloat-32: no OpenVINO mode, so f32
        precision = "f32"
    if precision not in ("", "default") and "INFERENCE_PRECISION_HINT" in supported:
        config["INFERENCE_PRECISION_HINT"] = precision
    if options.threads and "INFERENCE_NUM_THREADS" in supported:
        config["INFERENCE_NUM_THREADS"] = options.threads
    if not options.thread_pinning and "ENABLE_CPU_PINNING" in supported:
        config["ENABLE_CPU_PINNING"] = False  # unless extra says otherwise, below
    for key, value in options.extra.items():
        if key in _READ_ONLY:
            raise InvalidArgumentError(
                f"{NAME}: option {key!r} is a property {ov_device} reports, not one it is "
                f"given: expected one it reads ({', '.join(_settable(supported))})")
        if key in config and key in SET_FROM_OPTIONS:
            own = SET_FROM_OPTIONS[key]
            raise InvalidArgumentError(
                f"{NAME}: option {key!r} = {value!r:.40} and {own!r} both set it (to "
                f"{config[key]!r}): expected {own!r} alone")
        if key in supported:
            config[key] = value
        elif key in known_properties():
            log.warning("%s: option %s is not a property of %s: left out (it reads %s)",
                        NAME, key, ov_device, ", ".join(_settable(supported)))
        elif _PROPERTY_FORM.fullmatch(key):
            raise InvalidArgumentError(_unknown_property(key, ov_device, supported))
    return config


_PROPERTY_FORM = re.compile(r"[A-Z][A-Z0-9_]*")

@functools.cache
def _supported_properties(core: Any, ov_device: str) -> Any:
    """Each core's and device's SUPPORTED_PROPERTIES, asked once: OpenVINO (2026.4) keeps
    about 3 KB of native memory for good each time it is asked (54 MB in 18,000 asks).
    (A core hashes by identity; the cache keeps it alive, as the backend does.)"""
    return core.get_property(ov_device, "SUPPORTED_PROPERTIES")


@functools.cache
def known_properties() -> frozenset[str]:
    """Every property name the installed OpenVINO declares, whatever the device: the
    name-returning functions of its property modules (``hint``, ``streams``,
    ``intel_gpu``...). Empty when this OpenVINO lays them out otherwise."""
    try:
        from openvino._pyopenvino import properties as root
    except ImportError:
        return frozenset()
    found: set[str] = set()
    pending: list[types.ModuleType] = [root]
    while pending:
        module = pending.pop()
        for attr in vars(module).values():
            if isinstance(attr, types.ModuleType):
                if attr.__name__.startswith(root.__name__ + "."):
                    pending.append(attr)
            elif isinstance(attr, types.BuiltinFunctionType):
                with contextlib.suppress(Exception):  # one that needs an argument
                    name = attr()
                    if isinstance(name, str):
                        found.add(name)
    return frozenset(found)


def _settable(supported: Sequence[str]) -> list[str]:
    return sorted(str(p) for p in supported if str(p) not in _READ_ONLY)


#: Properties a plugin reports but does not take at compile time.
_READ_ONLY = frozenset({
    "AVAILABLE_DEVICES", "DEVICE_ARCHITECTURE", "DEVICE_ID", "DEVICE_TYPE",
    "EXECUTION_DEVICES", "FULL_DEVICE_NAME", "OPTIMIZATION_CAPABILITIES",
    "RANGE_FOR_ASYNC_INFER_REQUESTS", "RANGE_FOR_STREAMS", "SUPPORTED_PROPERTIES",
})


def _unknown_property(key: str, ov_device: str, supported: Sequence[str]) -> str:
    settable = _settable(supported)
    close = difflib.get_close_matches(key, [*settable, *known_properties()], n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    return (f"{NAME}: option {key!r} is not an OpenVINO property: {hint}expected one "
            f"{ov_device} reads ({', '.join(settable)})")
