"""PyTorch behind the wasinn contract: TorchScript archives and ``torch.export`` archives
(``.pt2``) on the CPU and on CUDA devices (``gpu:N`` for ``torch.cuda.device_count()``).

Names. TorchScript records no input or output names beyond ``forward``'s signature, so:
inputs are named after ``forward``'s tensor arguments (``self`` skipped), outputs are
``output`` for a single tensor and ``output_0`` .. ``output_N`` for a tuple of tensors.
The same convention names a ``torch.export`` program's outputs. Integer positions work
as keys everywhere.

Specs. A ``torch.export`` program records element types and shapes (symbolic dims are
reported as None) and inputs are checked against them, a symbolic dim against the range
it was exported with (``Dim("n", max=8)``; like torch, only lower bounds above 2): an
input outside it is InvalidArgumentError naming the input, the dimension and the range.
A TorchScript archive records neither: its specs say f32 with an unknown rank
(``rank_known=False``, described as ``x: f32[...]``) and only input names are checked;
a wrong element type or shape then fails inside the model and is reported as
InvalidArgumentError carrying TorchScript's message.

CPU TorchScript modules are frozen and passed through ``torch.jit.optimize_for_inference``
(``LoadOptions.extra["optimize"] = False`` turns it off; ``extra["interruptible"] = True``
makes their runs stop once cancelled, at a cost: see Cancellation below). Runs happen under
``torch.inference_mode()``; ``keep_on_device`` returns ``torch.Tensor`` natives.
``LoadOptions.threads`` is not applied: torch's thread count is process-wide.

Guests' models are untrusted. A ``.pt2`` archive is checked before torch reads it
(:mod:`._pt2_check`: no pickles, no code in its expressions and names) and a TorchScript
archive's code scanned (its ``__setstate__`` methods run as it loads); once loaded, every
graph may call only operators that compute on tensors (:mod:`._torch_ops`: not
``aten::from_file``, ``aten::save``, RPC, Python ...). Memory is never shared with the
caller: an output whose storage is an input's, a parameter's, buffer's or constant's, or
another output's is cloned, and a model that writes to its inputs (``x.sub_(mean)``,
detected at load from the graph) runs on copies of them (:mod:`._torch_memory`).

Cancellation: torch offers no way to interrupt an operator, so a ``torch.export``
program is loaded with a checkpoint (:func:`~wasinn.backends.base.stop_if_cancelled`)
before each of its operators, in every graph it holds (control-flow branches included):
once the run's :func:`~wasinn.backends.base.current_cancellation` is cancelled, the run
stops before its next operator and raises BackendRuntimeError. Measured here, a
checkpoint costs about 0.3 µs: +1.2 % on a two-operator model (46 µs a run), +0.07 % on
MobileNetV2 (15 ms). A TorchScript module cannot take such checkpoints (its graph runs in
C++): an abandoned TorchScript run goes on until it returns (its result is dropped), and
a device actor's close waits for it only up to its pool's ``close_timeout``; unless it
was loaded with ``interruptible``: then every operator its interpreter calls first goes
through a torch dispatch mode holding the checkpoint (:class:`_Checkpoints`, +37 % on
MobileNetV2 here). A pipeline stops between steps once cancelled, whatever its backends.
"""

from __future__ import annotations

import contextlib
import functools
import io
import operator
import threading
import zipfile
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from wasinn.enums import ExecutionTarget, GraphEncoding, TensorType
from wasinn.errors import (
    BackendRuntimeError,
    InvalidArgumentError,
    InvalidEncodingError,
    UnsupportedOperationError,
    WasiNNError,
)
from wasinn.tensor import Tensor, c_contiguous, numpy_dtype

from ._graphio import CheckedGraph, expect_builders, expect_encoding, no_device, uncarried_type
from ._pt2_check import check_pt2_archive
from ._torch_memory import (
    exported_written_inputs,
    module_storages,
    script_storages,
    script_written_inputs,
    storage_of,
)
from ._torch_ops import check_exported_program, check_torchscript_code, check_torchscript_module
from .base import (
    Backend,
    Builders,
    Cancelled,
    Device,
    LoadOptions,
    TensorSpec,
    current_cancellation,
    stop_if_cancelled,
)

NAME = "pytorch"

_TORCH_TYPES: dict[TensorType, torch.dtype] = {
    TensorType.F16: torch.float16, TensorType.F32: torch.float32,
    TensorType.F64: torch.float64, TensorType.BF16: torch.bfloat16,
    TensorType.U8: torch.uint8, TensorType.I32: torch.int32, TensorType.I64: torch.int64,
}
_TYPES = {dt: tt for tt, dt in _TORCH_TYPES.items()}
_BF16 = numpy_dtype(TensorType.BF16)


def _output_names(count: int) -> list[str]:
    return ["output"] if count == 1 else [f"output_{i}" for i in range(count)]


class _DimRange(NamedTuple):
    """A symbolic input dimension's exported range, as torch's input guards check it."""

    input: int
    axis: int
    low: int  # 0 when torch does not check it (a lower bound of 2 or less)
    high: int | None


def _to_torch(tensor: Tensor, device: torch.device, private: bool) -> torch.Tensor:
    """``tensor`` as torch's, sharing its memory unless ``private`` (the model writes to
    it) asks for a copy of its own."""
    native = tensor.native
    if isinstance(native, torch.Tensor):
        if native.device != device:
            return native.to(device)
        return native.clone() if private else native
    array = tensor.numpy()
    if not array.flags.writeable:
        array = array.copy()  # torch.from_numpy warns on read-only memory
    elif private and device.type == "cpu":
        array = array.copy()
    if tensor.type is TensorType.BF16:
        value = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    else:
        value = torch.from_numpy(array)
    return value if device.type == "cpu" else value.to(device)


def _to_numpy(value: torch.Tensor) -> np.ndarray[Any, Any]:
    value = value.detach().cpu()
    if value.dtype is torch.bfloat16:
        return c_contiguous(value.view(torch.int16).numpy().view(_BF16))
    return c_contiguous(value.numpy())


class TorchGraph(CheckedGraph):
    """A TorchScript module or exported program on one device."""

    def __init__(
        self,
        module: Callable[..., Any],
        device: Device,
        inputs: tuple[TensorSpec, ...],
        outputs: tuple[TensorSpec, ...],
        *,
        checked: bool,
        private: frozenset[int] = frozenset(),
        model_storages: frozenset[int] = frozenset(),
        dim_ranges: tuple[_DimRange, ...] = (),
        checkpoints: bool = False,
    ) -> None:
        """``private``: the inputs the model writes to (it gets copies); ``model_storages``:
        the memory of its parameters, buffers and constants (outputs there are cloned);
        ``dim_ranges``: the symbolic dims' ranges to check before each run;
        ``checkpoints``: run under :class:`_Checkpoints` (a TorchScript module loaded
        with ``interruptible``)."""
        # TorchScript declares no element types: its specs' f32 is a placeholder, unchecked
        # (their ranks are unknown, so their shapes go unchecked as well).
        unchecked: frozenset[int] = frozenset() if checked else frozenset(range(len(inputs)))
        super().__init__(NAME, module, device, inputs, outputs, any_type=unchecked)
        self._checked = checked
        self._private = private
        self._model_storages = model_storages
        self._dim_ranges = dim_ranges
        self._checkpoints = checkpoints
        self._torch_device = torch.device(
            "cpu" if device.kind is ExecutionTarget.CPU else f"cuda:{device.index}"
        )

    @property
    def module(self) -> Callable[..., Any]:
        """The underlying TorchScript module or ``torch.fx.GraphModule`` (for benchmarks)."""
        module: Callable[..., Any] = self._open()
        return module

    def _run(
        self, module: Any, ordered: list[Tensor], picked: tuple[int, ...], keep_on_device: bool
    ) -> dict[str, Tensor]:
        device = self._torch_device
        if self._dim_ranges:
            self._check_ranges(ordered)
        private = self._private
        try:
            args = [_to_torch(t, device, i in private) for i, t in enumerate(ordered)]
            with torch.inference_mode():
                if self._checkpoints:
                    with _Checkpoints():
                        result = module(*args)
                else:
                    result = module(*args)
        except WasiNNError:
            raise
        except Cancelled:
            raise _stopped() from None
        except Exception as exc:
            if self._checkpoints and _cancelled():
                # TorchScript's interpreter turns the checkpoint's Cancelled into a
                # RuntimeError on its way out of C++.
                raise _stopped() from None
            if self._checked and isinstance(exc, AssertionError) \
                    and str(exc).startswith("Guard failed"):
                # torch.export's input guards (a relation between dims, say)
                raise InvalidArgumentError(
                    f"{NAME}: the inputs break the model's shape constraints: {exc}"
                ) from exc
            if (not self._checked and isinstance(exc, RuntimeError)
                    and not isinstance(exc, torch.OutOfMemoryError)):
                raise InvalidArgumentError(
                    f"{NAME}: the TorchScript model rejected its inputs (it declares no types "
                    f"or shapes; given {[f'{t.type.value}{list(t.dims)}' for t in ordered]}): "
                    f"{_first_line(exc)}"
                ) from exc
            raise BackendRuntimeError(f"{NAME}: run failed: {exc}") from exc
        values = list(result) if isinstance(result, (tuple, list)) else [result]
        if len(values) != len(self.outputs):
            raise BackendRuntimeError(
                f"{NAME}: the model returned {len(values)} values but declares "
                f"{len(self.outputs)} outputs"
            )
        # Storages the caller must not get: its inputs' (a guest's memory) and, as they
        # are handed out, earlier outputs'; the model's own are in _model_storages.
        taken = {storage_of(a) for a in args}
        return {self.outputs[i].name: self._wrap(values[i], taken, keep_on_device)
                for i in picked}

    def _check_ranges(self, ordered: list[Tensor]) -> None:
        """InvalidArgumentError for a symbolic dim outside its exported range, which
        torch reports as a failed guard."""
        for index, axis, low, high in self._dim_ranges:
            size = ordered[index].dims[axis]
            if size < low or (high is not None and size > high):
                raise InvalidArgumentError(
                    f"{NAME}: input {self.inputs[index].name!r} has size {size} in "
                    f"dimension {axis}, but the model was exported for "
                    f"{_describe_range(low, high)} there (expected "
                    f"{self.inputs[index].describe()})"
                )

    def _wrap(self, value: Any, taken: set[int], keep: bool) -> Tensor:
        if not isinstance(value, torch.Tensor) or value.layout is not torch.strided:
            what = value.layout if isinstance(value, torch.Tensor) else type(value).__name__
            raise BackendRuntimeError(
                f"{NAME}: the model returned {what}: expected dense (strided) tensors"
            )
        ttype = _TYPES.get(value.dtype)
        if ttype is None:
            raise BackendRuntimeError(
                f"{NAME}: the model returned a {value.dtype} tensor, which wasi-nn cannot carry"
            )
        storage = storage_of(value)
        if storage in taken or storage in self._model_storages:
            # A view of an input (guest memory), a weight (a caller's edit would change
            # the model for every later run) or another output: a copy of its own.
            value = value.clone(memory_format=torch.contiguous_format)
        else:
            taken.add(storage)
        if keep:
            return _native(value, ttype, self.device.name if value.device.type != "cpu"
                           else "cpu")
        array = _to_numpy(value)
        return Tensor(array.shape, ttype, array=array)


def _cancelled() -> bool:
    cancellation = current_cancellation()
    return cancellation is not None and cancellation.cancelled


def _stopped() -> BackendRuntimeError:
    """What a run stopped at a checkpoint raises."""
    return BackendRuntimeError(f"{NAME}: run cancelled (stopped before its next operator)")


class _Checkpoints(TorchDispatchMode):  # type: ignore[no-untyped-call]  # (torch's)
    """A :func:`~wasinn.backends.base.stop_if_cancelled` before every operator a run
    calls, TorchScript's included (its interpreter calls them through torch's
    dispatcher, which hands each to this mode first). Each operator then goes through
    Python: measured +37 % on MobileNetV2 (7.6 -> 10.5 ms), so only a module loaded with
    ``interruptible`` runs under it."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        stop_if_cancelled()
        return func(*args, **(kwargs or {}))


def _interruptible(module: torch.nn.Module) -> None:
    """Put a :func:`~wasinn.backends.base.stop_if_cancelled` call before every operator
    of every fx graph in ``module`` (its own and its control-flow branches'), in place;
    not before a tuple's ``getitem``, which does no work."""
    for graph_module in module.modules():
        if not isinstance(graph_module, torch.fx.GraphModule):
            continue
        graph = graph_module.graph
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target is not operator.getitem:
                with graph.inserting_before(node):
                    graph.call_function(stop_if_cancelled, ())
        graph_module.recompile()


def _describe_range(low: int, high: int | None) -> str:
    if high is None:
        return f"at least {low}"
    return f"at most {high}" if low == 0 else f"{low} to {high}"


def _native(value: torch.Tensor, ttype: TensorType, device: str) -> Tensor:
    """``value`` left where it is; its rows are views on the same device."""
    return Tensor.from_native(
        value, tuple(value.shape), ttype, device=device,
        materialize=functools.partial(_to_numpy, value),
        rows=lambda start, stop: _native(value[start:stop], ttype, device))


def _first_line(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).splitlines() if ln.strip()]
    return lines[-1].strip() if lines else type(exc).__name__


class TorchBackend(Backend):
    """PyTorch: TorchScript and torch.export archives (``pytorch``) on cpu and gpu:N."""

    name = NAME
    encodings = frozenset({GraphEncoding.PYTORCH})

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._devices: list[Device] | None = None

    def devices(self) -> list[Device]:
        with self._lock:
            if self._devices is None:
                count = torch.cuda.device_count() if torch.cuda.is_available() else 0
                self._devices = [Device(ExecutionTarget.CPU)] + [
                    Device(ExecutionTarget.GPU, i) for i in range(count)
                ]
            return list(self._devices)

    def load(
        self,
        builders: Builders,
        encoding: GraphEncoding,
        device: Device,
        options: LoadOptions | None = None,
    ) -> TorchGraph:
        """Load one TorchScript or ``torch.export`` archive onto ``device``.

        Raises InvalidEncodingError for another encoding, a builder count other than one
        or bytes torch cannot load; UnsupportedOperationError for a device it lacks;
        SecurityError for a model that would run host code as it loads (a pickle, code
        in a ``.pt2`` program's expressions or names) or call an operator that reaches
        outside its tensors (``aten::from_file``...), naming what it found.
        """
        expect_encoding(NAME, encoding, GraphEncoding.PYTORCH)
        expect_builders(NAME, builders, 1, "one builder holding a TorchScript or .pt2 archive")
        devices = self.devices()
        if device not in devices:
            raise no_device(NAME, device, devices)
        options = options or LoadOptions()
        data = bytes(builders[0])
        torch_device = torch.device(
            "cpu" if device.kind is ExecutionTarget.CPU else f"cuda:{device.index}"
        )
        if _is_exported_program(data):
            return _load_exported(data, device, torch_device)
        return _load_torchscript(data, device, torch_device,
                                 optimize=bool(options.extra.get("optimize", True)),
                                 interruptible=bool(options.extra.get("interruptible", False)))


def _is_exported_program(data: bytes) -> bool:
    """Whether ``data`` is a ``.pt2`` archive: False for bytes that are no zip (torch
    then reads them as TorchScript, and says what is wrong); InvalidEncodingError for a
    zip that zipfile cannot read, whatever it raises (NotImplementedError for a
    compression or version it lacks, among others)."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            return any(n.endswith("/archive_format") for n in archive.namelist())
    except zipfile.BadZipFile:
        return False
    except Exception as exc:
        raise InvalidEncodingError(
            f"{NAME}: cannot read the model's zip archive ({type(exc).__name__}: {exc}): "
            "expected a TorchScript or torch.export archive"
        ) from exc


def _load_torchscript(
    data: bytes, device: Device, torch_device: torch.device, *, optimize: bool,
    interruptible: bool
) -> TorchGraph:
    check_torchscript_code(NAME, data)  # before __setstate__ methods run in torch.jit.load
    try:
        module = torch.jit.load(  # type: ignore[no-untyped-call]
            io.BytesIO(data), map_location=torch_device
        ).eval()
        schema = module.forward.schema
    except Exception as exc:
        raise InvalidEncodingError(
            f"{NAME}: cannot load the TorchScript archive: {_first_line(exc)}"
        ) from exc
    check_torchscript_module(NAME, module)
    inputs = []
    for arg in schema.arguments[1:]:  # [0] is self
        if str(arg.type) != "Tensor":
            if arg.has_default_value():
                continue
            raise UnsupportedOperationError(
                f"{NAME}: forward() argument {arg.name!r} is {arg.type}: expected Tensor "
                "arguments (others need a default value)"
            )
        inputs.append(TensorSpec(arg.name, TensorType.F32, (), rank_known=False))
    returns = str(schema.returns[0].type) if schema.returns else "None"
    if returns == "Tensor":
        count = 1
    elif returns.startswith("Tuple[") and all(
        part.strip() == "Tensor" for part in returns[6:-1].split(",")
    ):
        count = len(returns[6:-1].split(","))
    else:
        raise UnsupportedOperationError(
            f"{NAME}: forward() returns {returns}: expected a Tensor or a tuple of Tensors"
        )
    outputs = tuple(TensorSpec(n, TensorType.F32, (), rank_known=False)
                    for n in _output_names(count))
    if optimize and device.kind is ExecutionTarget.CPU:
        # A module that cannot be frozen (e.g. it mutates attributes) still runs as loaded.
        with contextlib.suppress(Exception):
            module = torch.jit.optimize_for_inference(torch.jit.freeze(module))
    return TorchGraph(module, device, tuple(inputs), outputs, checked=False,
                      private=script_written_inputs(module),
                      model_storages=script_storages(module),
                      checkpoints=interruptible)


def _spec_of(name: str, value: Any, role: str) -> TensorSpec:
    ttype = _TYPES.get(getattr(value, "dtype", None))  # type: ignore[arg-type]
    if ttype is None:
        raise uncarried_type(
            NAME, role, name, f"is {getattr(value, 'dtype', type(value).__name__)}"
        )
    shape = tuple(d if isinstance(d, int) else None for d in value.shape)
    return TensorSpec(name, ttype, shape)


#: torch.export.load keeps the archive it is reading in a module global
#: (``_CURRENT_DESERIALIZER``): two loads at once in different threads fail with "already
#: set". Loads on different devices' worker threads, or a runtime preloading several
#: programs, take turns.
_EXPORT_LOAD = threading.Lock()


def _load_exported(data: bytes, device: Device, torch_device: torch.device) -> TorchGraph:
    check_pt2_archive(NAME, data)  # torch.export.load unpickles and evaluates what it reads
    try:
        with _EXPORT_LOAD:
            program = torch.export.load(io.BytesIO(data))
    except Exception as exc:
        raise InvalidEncodingError(
            f"{NAME}: cannot load the torch.export archive: {_first_line(exc)}"
        ) from exc
    check_exported_program(NAME, program.graph_module)
    try:
        module = program.module()
        module.to(torch_device)
        _interruptible(module)
    except Exception as exc:
        raise InvalidEncodingError(
            f"{NAME}: cannot load the torch.export archive: {_first_line(exc)}"
        ) from exc
    signature = program.graph_signature
    user_inputs = set(signature.user_inputs)
    placeholders = [n for n in program.graph.nodes
                    if n.op == "placeholder" and n.name in user_inputs]
    inputs = tuple(_spec_of(n.name, n.meta.get("val"), "input") for n in placeholders)
    out_node = next(n for n in program.graph.nodes if n.op == "output")
    user_outputs = list(out_node.args[0])[-len(signature.user_outputs):]
    names = _output_names(len(user_outputs))
    outputs = tuple(_spec_of(name, node.meta.get("val"), "output")
                    for name, node in zip(names, user_outputs, strict=True))
    return TorchGraph(
        module, device, inputs, outputs, checked=True,
        private=exported_written_inputs(program, placeholders),
        model_storages=module_storages(module),
        dim_ranges=_dim_ranges(program, placeholders),
    )


def _dim_ranges(program: Any, placeholders: list[Any]) -> tuple[_DimRange, ...]:
    """The checked range of each input dim that is a plain symbol (``Dim("n")``), where
    torch checks one: a lower bound above 2 (torch does not check 0, 1 or 2), a finite
    upper bound."""
    ranges = []
    for index, node in enumerate(placeholders):
        for axis, size in enumerate(getattr(node.meta.get("val"), "shape", ())):
            if not isinstance(size, torch.SymInt):
                continue
            bounds = program.range_constraints.get(size.node.expr)
            if bounds is None:
                continue
            low = int(bounds.lower) if bounds.lower.is_Integer else 0  # not -int_oo
            high = int(bounds.upper) if bounds.upper.is_Integer else None  # not int_oo
            low = low if low > 2 else 0
            if low or high is not None:
                ranges.append(_DimRange(index, axis, low, high))
    return tuple(ranges)
