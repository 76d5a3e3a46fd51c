"""A model compiled by OpenVINO for one device, and its runs (for
:mod:`wasinn.backends.openvino`, whose docstring describes the behaviour in full).

:class:`OvGraph` names its inputs and outputs after their ports (:func:`_specs`), keeps a
pool of infer requests, holds the memory IR weights may be read from while a run uses
it, compiles a dynamically shaped model again after a run stopped inside OpenVINO, and
keeps outputs in device memory where the device has a remote context (learning the
shapes of dynamic outputs per input dimensions).
"""

from __future__ import annotations

import queue
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import openvino as ov

from wasinn.enums import ExecutionTarget
from wasinn.errors import BackendRuntimeError, InvalidArgumentError, WasiNNError
from wasinn.tensor import Tensor, count_host_copies

from ._graphio import CheckedGraph, uncarried_type
from ._ov_cancel import _infer
from ._ov_tensors import _TYPES, _host_array, _native, _ov_tensor, _unshared
from ._ovread import NAME
from .base import Device, TensorSpec, current_cancellation

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
            specs.append(TensorSpec(name, ttype, shape, bounds=_bounds(pshape)))
        for alias in port.get_names():
            aliases[alias] = i
            if alias.endswith(":0"):
                aliases.setdefault(alias[:-2], i)
    return tuple(specs), aliases


def _bounds(pshape: Any) -> tuple[tuple[int, int | None], ...]:
    """The ``(low, high)`` of each dimension of ``pshape`` (a static one's its size,
    ``high`` None where unbounded), where an interval dimension (``1..4``) bounds one;
    ``()`` where none does."""
    bounds = tuple((d.get_min_length(), None if d.get_max_length() < 0 else d.get_max_length())
                   for d in pshape)
    limited = any(d.is_dynamic and (low > 0 or high is not None)
                  for d, (low, high) in zip(pshape, bounds, strict=True))
    return bounds if limited else ()


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

#: Input dimensions whose output shapes a graph remembers (see :mod:`.openvino`);
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
                 recompile: Callable[[], Any] | None = None, *,
                 dim_names: Mapping[str, Sequence[object]] | None = None) -> None:
        """``recompile``: how to compile the model again, for a graph with a dynamic shape
        (see :mod:`.openvino`); None for a static one. ``dim_names``: an ONNX model's
        declared input dimensions (:func:`.onnx_dims.declared_dims`), whose shared names
        OpenVINO does not keep: inputs whose dimensions share one must agree (see
        :class:`._graphio.InputChecker`)."""
        inputs, in_aliases = _specs(compiled.inputs, is_output=False)
        outputs, out_aliases = _specs(compiled.outputs, is_output=True)
        super().__init__(NAME, compiled, device, inputs, outputs, in_aliases=in_aliases,
                         out_aliases=out_aliases, dim_names=dim_names)
        self._keep_alive = keep_alive  # weights OpenVINO may share with the model
        self._idle: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._recompile = recompile
        #: Set by a run stopped inside OpenVINO on a dynamic graph: the next run compiles
        #: the graph afresh first (under ``_renewing``), see :mod:`.openvino`.
        self._stale = False
        self._renewing = threading.Lock()
        #: Compiles after the first (diagnostics, tests).
        self.recompiles = 0
        #: The device's remote context (see :mod:`.openvino`), None on the CPU.
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
        result = self._copied(picked, values)
        if reusable:
            idle.put(request)
        return result

    def _copied(self, picked: tuple[int, ...], values: list[Any]) -> dict[str, Tensor]:
        # A host run's outputs, copied out of the request's memory (which its next run
        # reuses): each counted as a host copy.
        specs = self.outputs
        result = {}
        for i, value in zip(picked, values, strict=True):
            array = _host_array(value, specs[i].type)
            result[specs[i].name] = Tensor(array.shape, specs[i].type, array=array)
        count_host_copies(len(values))
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
