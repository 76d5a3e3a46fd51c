"""OpenVINO behind the wasinn contract: IR, ONNX, TensorFlow Lite and TensorFlow models
(see :mod:`wasinn.backends._ovread`) on the CPU and on the GPU and NPU (``NPU`` ->
``tpu:0``) plugins where ``Core.available_devices`` lists them: Intel GPUs only, numbered
after the CUDA GPUs (``GPU.0`` is ``gpu:1`` beside one CUDA GPU; see
:mod:`wasinn.backends._ov_devices`).

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
comes just before a run starts, see :mod:`._ov_cancel`); OpenVINO stops at the next node
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

import functools
import threading
from typing import Any

import openvino as ov

from wasinn.enums import ExecutionTarget, GraphEncoding, TensorType
from wasinn.errors import InvalidArgumentError, InvalidEncodingError, WasiNNError

from ._graphio import no_device
from ._ov_compile import compile_config, known_properties
from ._ov_devices import OvDevices, list_devices
from ._ov_graph import (
    OvGraph,
)
from ._ov_tensors import (
    _F32_MAX,
)
from ._ovread import NAME, ov_message, read_model
from .base import Backend, Builders, Device, LoadOptions, log
from .onnx_dims import declared_dims

__all__ = ["NAME", "OpenVinoBackend", "OvGraph", "compile_config", "known_properties"]


_CORE: Any = None
_CORE_LOCK = threading.Lock()


def _process_core() -> Any:
    """The process's one ``openvino.Core``, made on first use and never dropped.

    Every :class:`OpenVinoBackend` uses it, and each Runtime makes its own backend: with a
    Core per backend, each Runtime that compiled anything left its Core alive for good
    (about 117 KB; the properties cache of :mod:`._ov_compile` holds it), and dropping
    those Cores while graphs compiled by them closed aborted the process now and then
    ("Owner died"). Sharing changes nothing a graph sees: wasinn sets nothing on the Core
    itself, and every property it uses is passed to one compile (``compile_config``),
    which leaves the Core's own as they were.
    """
    global _CORE  # noqa: PLW0603 (one Core for the process is the point)
    with _CORE_LOCK:
        if _CORE is None:
            _CORE = ov.Core()
        return _CORE


class OpenVinoBackend(Backend):
    """OpenVINO: openvino (IR), onnx, tensorflow and tensorflowlite on cpu / gpu:N / tpu:0."""

    name = NAME
    encodings = frozenset({GraphEncoding.OPENVINO, GraphEncoding.ONNX,
                           GraphEncoding.TENSORFLOW, GraphEncoding.TENSORFLOWLITE})

    def __init__(self) -> None:
        self._core: Any = None  # a stand-in for the process's Core, where one is set
        self._devices: OvDevices | None = None

    @property
    def core(self) -> Any:
        """The process's ``openvino.Core`` (:func:`_process_core`), which every instance
        shares (unless a stand-in is set as ``_core``)."""
        return self._core if self._core is not None else _process_core()

    def _listed(self) -> OvDevices:
        # Asked once per backend (see _ov_devices.list_devices).
        if self._devices is None:
            self._devices = list_devices(self.core)
        return self._devices

    def _ov_name(self, device: Device) -> str:
        """OpenVINO's name for ``device``, listed; UnsupportedOperationError where it is
        not offered (naming the GPUs passed over, and why)."""
        listed = self._listed()
        ov_device = listed.offered.get(device)
        if ov_device is None:
            error = no_device(NAME, device, self.devices())
            if device.kind is ExecutionTarget.GPU and listed.passed_over:
                raise error.suffixed(f"({'; '.join(listed.passed_over.values())}: "
                                     "OpenVINO's GPU plugin supports Intel GPUs only)")
            raise error
        return ov_device

    def devices(self) -> list[Device]:
        """cpu, and gpu:N / tpu:N where OpenVINO lists an Intel GPU / an NPU (a GPU of
        another vendor, which OpenVINO's GPU plugin does not support, is not offered)."""
        return sorted(self._listed().offered)

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
        outside the wasi-nn set; for a GPU, the non-Intel GPUs OpenVINO lists are named,
        with why they are not offered). TensorFlow and TFLite models are read in a child
        process (see :mod:`._ovread`).
        """
        # The CPU without listing: that loads every plugin, the GPU's with OpenCL's
        # drivers, which a sandbox process's lock-down makes fail, crash or hang.
        ov_device = "CPU" if device.kind is ExecutionTarget.CPU else self._ov_name(device)
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
            graph = OvGraph(compiled, device, keep_alive, recompile,
                            dim_names=declared_dims(builders[0])
                            if encoding is GraphEncoding.ONNX else None)
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


def _warn_f64(graph: OvGraph) -> None:
    """Log, once per load, that the graph's f64 values are computed in f32 precision."""
    f64 = [s.name for s in (*graph.inputs, *graph.outputs) if s.type is TensorType.F64]
    if f64:
        log.warning("%s: %s %s f64: OpenVINO computes f64 in f32 precision (about 7 "
                    "significant digits; inputs beyond +-%.7g are refused): load it on "
                    "onnxruntime for full f64", NAME, ", ".join(map(repr, f64)),
                    "is" if len(f64) == 1 else "are", _F32_MAX)
