"""An ONNX model in an ONNX Runtime session on one device, and its runs (for
:mod:`wasinn.backends.onnxruntime`, whose docstring describes the behaviour in full).

:class:`OrtGraph` takes its input and output specs from the session, of unknown rank
where the model declares a value without a shape (:func:`_shapeless`, read from the
model's protobuf). A run of host tensors calls ``InferenceSession.run``; native inputs,
bf16 and ``keep_on_device`` go through a per-run ``IOBinding`` (:mod:`._ort_tensors`);
a run under a cancellation passes its thread's ``RunOptions`` (:mod:`._ort_cancel`).
"""

from __future__ import annotations

import functools
from typing import Any

from wasinn.enums import ExecutionTarget, TensorType
from wasinn.errors import BackendRuntimeError, WasiNNError
from wasinn.tensor import Tensor, count_host_copies

from ._dlpack import KDL_CPU, KDL_CUDA
from ._graphio import CheckedGraph, uncarried_type
from ._ort_cancel import _run_options, _spare, _terminate
from ._ort_session import NAME
from ._ort_tensors import _host_array, _ort_input, _owned, _spans, _within
from .base import Device, TensorSpec, current_cancellation
from .formats import protobuf_records

_TYPES: dict[str, TensorType] = {
    "tensor(float16)": TensorType.F16,
    "tensor(float)": TensorType.F32,
    "tensor(double)": TensorType.F64,
    "tensor(bfloat16)": TensorType.BF16,
    "tensor(uint8)": TensorType.U8,
    "tensor(int32)": TensorType.I32,
    "tensor(int64)": TensorType.I64,
}


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


#: What an overridable initializer is, in the error for a run that sets one.
_INITIALIZER = ("an initializer with a default value (a weight the model also lists as a "
                "graph input), which wasinn does not let a run override")


class OrtGraph(CheckedGraph):
    """An ONNX model in one ONNX Runtime session on one device."""

    def __init__(self, session: Any, device: Device,
                 shapeless: frozenset[str] = frozenset()) -> None:
        """``shapeless``: the names of the inputs and outputs the model declares without a
        shape (:func:`_shapeless`); their specs have an unknown rank. Inputs whose
        dimensions share a name (``a: [n, 3]``, ``b: [n, 3]``) must be given them of one
        size (see :class:`._graphio.InputChecker`). The session's overridable
        initializers (graph inputs that are also weights, their default) are no inputs:
        a run that sets one is refused with an error that says what it is (ONNX Runtime
        would take it, but a guest, a sandboxed graph or a warm-up sees only the inputs
        a run must set)."""
        inputs = session.get_inputs()
        super().__init__(
            NAME, session, device,
            tuple(_spec(a, "input", shapeless) for a in inputs),
            tuple(_spec(a, "output", shapeless) for a in session.get_outputs()),
            dim_names={a.name: a.shape or () for a in inputs},
            not_inputs=dict.fromkeys(
                (a.name for a in session.get_overridable_initializers()), _INITIALIZER),
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
        specs = self.outputs
        out: dict[str, Tensor] = {}
        for i, arr in zip(picked, results, strict=True):
            out[names[i]] = Tensor(arr.shape, specs[i].type, array=arr)
        count_host_copies(len(out))  # ORT's values, handed back as numpy arrays (an output
        return out  # asked for twice is handed back once)

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
