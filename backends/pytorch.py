"""PyTorch behind the wasinn contract: TorchScript archives and ``torch.export`` archives
(``.pt2``) on the CPU and on CUDA devices (``gpu:N`` for ``torch.cuda.device_count()``).

Names. TorchScript records no input or output names beyond ``forward``'s signature, so:
inputs are named after ``forward``'s tensor arguments (``self`` skipped), outputs are
``output`` for a single tensor and ``output_0`` .. ``output_N`` for a tuple of tensors.
The same convention names a ``torch.export`` program's outputs. Integer positions work
as keys everywhere.

Specs. A ``torch.export`` program records element types and shapes (symbolic dims are
reported as None) and inputs are checked against them. A TorchScript archive records
neither: its specs say f32 with an unknown rank (``rank_known=False``, described as
``x: f32[...]``) and only input names are checked; a wrong element type or shape then
fails inside the model and is reported as InvalidArgumentError carrying TorchScript's
message.

CPU TorchScript modules are frozen and passed through ``torch.jit.optimize_for_inference``
(``LoadOptions.extra["optimize"] = False`` turns it off). Runs happen under
``torch.inference_mode()``; ``keep_on_device`` returns ``torch.Tensor`` natives.
``LoadOptions.threads`` is not applied: torch's thread count is process-wide.

Cancellation: torch offers no way to interrupt an operator, so a ``torch.export``
program is loaded with a checkpoint (:func:`~wasinn.backends.base.stop_if_cancelled`)
before each of its operators, in every graph it holds (control-flow branches included):
once the run's :func:`~wasinn.backends.base.current_cancellation` is cancelled, the run
stops before its next operator and raises BackendRuntimeError. Measured here, a
checkpoint costs about 0.3 µs: +1.2 % on a two-operator model (46 µs a run), +0.07 % on
MobileNetV2 (15 ms). A TorchScript module cannot take such checkpoints (its graph runs in
C++): an abandoned TorchScript run goes on until it returns (its result is dropped), and
a device actor's close waits for it only up to its pool's ``close_timeout``. A pipeline
stops between steps once cancelled, whatever its backends.
"""

from __future__ import annotations

import contextlib
import functools
import io
import operator
import threading
import zipfile
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

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
from .base import (
    Backend,
    Builders,
    Cancelled,
    Device,
    LoadOptions,
    TensorSpec,
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


def _to_torch(tensor: Tensor, device: torch.device) -> torch.Tensor:
    native = tensor.native
    if isinstance(native, torch.Tensor):
        return native if native.device == device else native.to(device)
    array = tensor.numpy()
    if not array.flags.writeable:
        array = array.copy()  # torch.from_numpy warns on read-only memory
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
    ) -> None:
        # TorchScript declares no element types: its specs' f32 is a placeholder, unchecked
        # (their ranks are unknown, so their shapes go unchecked as well).
        unchecked: frozenset[int] = frozenset() if checked else frozenset(range(len(inputs)))
        super().__init__(NAME, module, device, inputs, outputs, any_type=unchecked)
        self._checked = checked
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
        try:
            args = [_to_torch(t, device) for t in ordered]
            with torch.inference_mode():
                result = module(*args)
        except WasiNNError:
            raise
        except Cancelled:
            raise BackendRuntimeError(
                f"{NAME}: run cancelled (stopped before its next operator)") from None
        except Exception as exc:
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
        return {self.outputs[i].name: self._wrap(values[i], args, keep_on_device)
                for i in picked}

    def _wrap(self, value: Any, args: list[torch.Tensor], keep: bool) -> Tensor:
        if not isinstance(value, torch.Tensor):
            raise BackendRuntimeError(
                f"{NAME}: the model returned {type(value).__name__}: expected tensors"
            )
        ttype = _TYPES.get(value.dtype)
        if ttype is None:
            raise BackendRuntimeError(
                f"{NAME}: the model returned a {value.dtype} tensor, which wasi-nn cannot carry"
            )
        if any(value.data_ptr() == a.data_ptr() for a in args):
            value = value.clone()  # never hand the caller's input memory back as an output
        if keep:
            return _native(value, ttype, self.device.name if value.device.type != "cpu"
                           else "cpu")
        array = _to_numpy(value)
        return Tensor(array.shape, ttype, array=array)


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
        or bytes torch cannot load; UnsupportedOperationError for a device it lacks.
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
        return _load_torchscript(data, device, torch_device, bool(options.extra.get("optimize",
                                                                                      True)))


def _is_exported_program(data: bytes) -> bool:
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            return any(n.endswith("/archive_format") for n in archive.namelist())
    except (zipfile.BadZipFile, ValueError):
        return False


def _load_torchscript(
    data: bytes, device: Device, torch_device: torch.device, optimize: bool
) -> TorchGraph:
    try:
        module = torch.jit.load(  # type: ignore[no-untyped-call]
            io.BytesIO(data), map_location=torch_device
        ).eval()
        schema = module.forward.schema
    except Exception as exc:
        raise InvalidEncodingError(
            f"{NAME}: cannot load the TorchScript archive: {_first_line(exc)}"
        ) from exc
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
    return TorchGraph(module, device, tuple(inputs), outputs, checked=False)


def _spec_of(name: str, value: Any, role: str) -> TensorSpec:
    ttype = _TYPES.get(getattr(value, "dtype", None))  # type: ignore[arg-type]
    if ttype is None:
        raise uncarried_type(
            NAME, role, name, f"is {getattr(value, 'dtype', type(value).__name__)}"
        )
    shape = tuple(d if isinstance(d, int) else None for d in value.shape)
    return TensorSpec(name, ttype, shape)


def _load_exported(data: bytes, device: Device, torch_device: torch.device) -> TorchGraph:
    try:
        program = torch.export.load(io.BytesIO(data))
        module = program.module()
        module.to(torch_device)
        _interruptible(module)
    except Exception as exc:
        raise InvalidEncodingError(
            f"{NAME}: cannot load the torch.export archive: {_first_line(exc)}"
        ) from exc
    user_inputs = set(program.graph_signature.user_inputs)
    placeholders = [n for n in program.graph.nodes
                    if n.op == "placeholder" and n.name in user_inputs]
    inputs = tuple(_spec_of(n.name, n.meta.get("val"), "input") for n in placeholders)
    out_node = next(n for n in program.graph.nodes if n.op == "output")
    user_outputs = list(out_node.args[0])[-len(program.graph_signature.user_outputs):]
    names = _output_names(len(user_outputs))
    outputs = tuple(_spec_of(name, node.meta.get("val"), "output")
                    for name, node in zip(names, user_outputs, strict=True))
    return TorchGraph(module, device, inputs, outputs, checked=True)
