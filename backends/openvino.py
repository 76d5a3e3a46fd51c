"""OpenVINO behind the wasinn contract: IR, ONNX, TensorFlow Lite and TensorFlow models
(see :mod:`wasinn.backends._ovread`) on the CPU and on the GPU (``GPU.N`` -> ``gpu:N``)
and NPU (``NPU`` -> ``tpu:0``) plugins where ``Core.available_devices`` lists them.

Inference precision defaults to f32 (``LoadOptions.precision``; ``"default"`` leaves the
plugin's choice, which is bf16 on CPUs with AMX) so that outputs agree across machines.

A :class:`OvGraph` owns one ``CompiledModel`` and a pool of ``InferRequest`` s: each run
borrows a request, so concurrent runs on several threads never share one. Inputs are
wrapped as ``ov.Tensor`` s over the caller's memory (no copy). With ``keep_on_device``
the run's request is not returned to the pool: its output ``ov.Tensor`` s are handed out
as native tensors and can be set as inputs of another request without a copy.

Cancellation: a run under a :class:`~wasinn.backends.base.Cancellation` registers its
infer request's ``cancel``; OpenVINO stops at the next node boundary (a Loop/TensorIterator
node's own iterations are not interrupted) and the run raises BackendRuntimeError. A
request that may have been cancelled is retired, never pooled again.

Element types: all seven wasi-nn types load, but the CPU and GPU plugins compute i64 as
i32. Rather than truncate silently, a run refuses i64 input values outside the i32 range
with InvalidArgumentError.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Sequence
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

from ._graphio import CheckedGraph, no_device, uncarried_type
from ._ovread import NAME, read_model
from .base import Backend, Builders, Device, LoadOptions, TensorSpec, current_cancellation

_TYPES: dict[str, TensorType] = {
    "f16": TensorType.F16, "f32": TensorType.F32, "f64": TensorType.F64,
    "bf16": TensorType.BF16, "u8": TensorType.U8, "i32": TensorType.I32, "i64": TensorType.I64,
}
_OV_TYPES = {tt: getattr(ov.Type, name) for name, tt in _TYPES.items()}
_I32 = np.iinfo(np.int32)


def _port_name(port: Any, is_output: bool) -> str:
    names = port.get_names()
    if is_output and len(names) > 1:
        # TensorFlow gives an output every tensor name on its path (relu:0, y:0); the
        # Result node is named after the graph's own output.
        result = port.get_node().get_friendly_name()
        if result in names:
            return str(result)
    return str(port.get_any_name()) if names else f"{'output' if is_output else 'input'}"


def _specs(ports: Sequence[Any], is_output: bool) -> tuple[
    tuple[TensorSpec, ...], dict[str, int], frozenset[int]
]:
    specs, aliases, any_rank = [], {}, set()
    role = "output" if is_output else "input"
    for i, port in enumerate(ports):
        name = _port_name(port, is_output) if port.get_names() else f"{role}_{i}"
        ttype = _TYPES.get(port.get_element_type().get_type_name())
        if ttype is None:
            raise uncarried_type(NAME, role, name, f"has element type {port.get_element_type()}")
        pshape = port.get_partial_shape()
        if pshape.rank.is_dynamic:
            shape: tuple[int | None, ...] = ()
            any_rank.add(i)
        else:
            shape = tuple(d.get_length() if d.is_static else None for d in pshape)
        specs.append(TensorSpec(name, ttype, shape))
        for alias in port.get_names():
            aliases[alias] = i
            if alias.endswith(":0"):
                aliases.setdefault(alias[:-2], i)
    return tuple(specs), aliases, frozenset(any_rank)


def _ov_tensor(tensor: Tensor) -> Any:
    native = tensor.native
    if isinstance(native, ov.Tensor):
        return native
    array = tensor.numpy()
    if tensor.type is TensorType.I64 and array.size and (
        array.min() < _I32.min or array.max() > _I32.max
    ):
        raise InvalidArgumentError(
            f"{NAME}: i64 values outside the i32 range cannot be computed exactly (OpenVINO "
            f"computes i64 as i32): expected values in [{_I32.min}, {_I32.max}]"
        )
    # The (array, shape, type) constructor shares the memory, read-only arrays included;
    # bf16 travels as its uint16 bit pattern.
    carrier = array.view(np.uint16) if tensor.type is TensorType.BF16 else array
    return ov.Tensor(carrier, ov.Shape(array.shape), _OV_TYPES[tensor.type])


def _host_array(value: Any, ttype: TensorType, keep_alive: object = None) -> np.ndarray[Any, Any]:
    """A host copy of an ``ov.Tensor`` (``keep_alive``: the request that owns its memory)."""
    del keep_alive
    data = value.data
    if ttype is TensorType.BF16:
        data = data.view(numpy_dtype(TensorType.BF16))
    return np.array(data, copy=True)


def _native(value: Any, ttype: TensorType, device: str, owner: object) -> Tensor:
    """``value`` as it is (``owner``: the request that owns its memory, kept alive with
    it); its rows are region-of-interest tensors over the same memory."""
    return Tensor.from_native(
        value, tuple(value.shape), ttype, device=device,
        materialize=functools.partial(_host_array, value, ttype, owner),
        rows=lambda start, stop: _native(_rows(value, start, stop), ttype, device, owner))


def _rows(value: Any, start: int, stop: int) -> Any:
    end = list(value.shape)
    begin = [0] * len(end)
    begin[0], end[0] = start, stop
    return ov.Tensor(value, ov.Coordinate(begin), ov.Coordinate(end))


class OvGraph(CheckedGraph):
    """A model compiled by OpenVINO for one device, with a pool of infer requests."""

    def __init__(self, compiled: Any, device: Device, keep_alive: object = None) -> None:
        inputs, in_aliases, any_rank = _specs(compiled.inputs, is_output=False)
        outputs, out_aliases, _ = _specs(compiled.outputs, is_output=True)
        super().__init__(NAME, compiled, device, inputs, outputs, in_aliases=in_aliases,
                         out_aliases=out_aliases, any_rank=any_rank)
        self._keep_alive = keep_alive  # weights OpenVINO may share with the model
        self._idle: queue.SimpleQueue[Any] = queue.SimpleQueue()

    @property
    def compiled_model(self) -> Any:
        """The underlying ``openvino.CompiledModel`` (for benchmarks and diagnostics)."""
        return self._open()

    def _request(self) -> Any:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            return self.compiled_model.create_infer_request()

    def _run(
        self, compiled: Any, ordered: list[Tensor], picked: tuple[int, ...], keep_on_device: bool
    ) -> dict[str, Tensor]:
        # ``compiled`` unused: requests come from the pool, or from ``compiled_model``,
        # which refuses a graph closed since.
        ov_inputs = [_ov_tensor(t) for t in ordered]
        cancellation = current_cancellation()
        if cancellation is not None and cancellation.cancelled:
            raise BackendRuntimeError(f"{NAME}: run cancelled before it started")
        forget = None
        reusable = True
        try:
            request = self._request()
            for i, value in enumerate(ov_inputs):
                request.set_input_tensor(i, value)
            if cancellation is not None:
                forget = cancellation.on_cancel(request.cancel)
            try:
                request.infer()
            finally:
                if forget is not None and cancellation is not None:
                    forget()
                    # Cancelled, or cancel() may still be running on it: never reuse it.
                    reusable = not cancellation.cancelled
            values = [request.get_output_tensor(i) for i in picked]
        except WasiNNError:
            raise
        except Exception as exc:
            if cancellation is not None and cancellation.cancelled:
                raise BackendRuntimeError(f"{NAME}: run cancelled ({exc})") from exc
            raise BackendRuntimeError(f"{NAME}: run failed: {exc}") from exc
        specs = self.outputs
        if keep_on_device:
            # The request owns the outputs' memory: retire it with them instead of reusing.
            return {specs[i].name: _native(value, specs[i].type, self.device.name, request)
                    for i, value in zip(picked, values, strict=True)}
        result = {}
        for i, value in zip(picked, values, strict=True):
            array = _host_array(value, specs[i].type)
            result[specs[i].name] = Tensor(array.shape, specs[i].type, array=array)
        if reusable:
            self._idle.put(request)
        return result

    def close(self) -> None:
        super().close()
        self._idle = queue.SimpleQueue()
        self._keep_alive = None


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
        builder count, IR weights that do not match the XML) and UnsupportedOperationError
        (a device OpenVINO does not have here, a type outside the wasi-nn set).
        """
        ov_device = self._device_map().get(device)
        if ov_device is None:
            raise no_device(NAME, device, self.devices())
        model, keep_alive = read_model(self.core, builders, encoding)
        config = compile_config(self.core, ov_device, options or LoadOptions())
        try:
            compiled = self.core.compile_model(model, ov_device, config)
        except Exception as exc:
            raise InvalidEncodingError(
                f"{NAME}: cannot compile the {encoding.value} model for {device}: {exc}"
            ) from exc
        return OvGraph(compiled, device, keep_alive)


def compile_config(core: Any, ov_device: str, options: LoadOptions) -> dict[str, Any]:
    """The compile properties wasinn uses; also used by benchmarks for native models.

    ``precision`` becomes ``INFERENCE_PRECISION_HINT`` where the device supports it
    (``"default"`` or ``""`` leaves the plugin's choice); ``threads`` becomes
    ``INFERENCE_NUM_THREADS``; ``extra`` entries named after a property the device
    supports (``PERFORMANCE_HINT``, ``NUM_STREAMS``...) are passed as given, others are
    ignored (they may be meant for another backend).
    """
    supported = core.get_property(ov_device, "SUPPORTED_PROPERTIES")
    config: dict[str, Any] = {}
    precision = options.precision.strip().lower()
    if precision not in ("", "default") and "INFERENCE_PRECISION_HINT" in supported:
        config["INFERENCE_PRECISION_HINT"] = precision
    if options.threads and "INFERENCE_NUM_THREADS" in supported:
        config["INFERENCE_NUM_THREADS"] = options.threads
    config.update({k: v for k, v in options.extra.items() if k in supported})
    return config
