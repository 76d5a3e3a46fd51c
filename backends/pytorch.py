"""PyTorch behind the wasinn contract: TorchScript archives and ``torch.export`` archives
(``.pt2``) on the CPU and on CUDA devices (``gpu:N`` for ``torch.cuda.device_count()``).

Names. TorchScript records no input or output names beyond ``forward``'s signature, so:
inputs are named after ``forward``'s tensor arguments (``self`` skipped), outputs are
``output`` for a single tensor and ``output_0`` .. ``output_N`` for a tuple of tensors.
The same convention names a ``torch.export`` program's outputs. A program taking or
returning more than a flat tuple of tensors (keyword arguments, nested tuples and lists,
dicts) takes and returns the tensors in them, in torch's pytree order, its inputs named
after its placeholders (``pair_0``, ``pair_1``); an argument that export fixed to a
constant is passed that constant, and is no input. Integer positions work as keys
everywhere.

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
adds a checkpoint before every operator, at a cost: see Cancellation below). Runs happen under
``torch.inference_mode()``; ``keep_on_device`` returns ``torch.Tensor`` natives.
``LoadOptions.threads`` is not applied: torch's thread count is process-wide.

Guests' models are untrusted. A ``.pt2`` archive is checked before torch reads it
(:mod:`._pt2_check`: no pickles, no code in its expressions and names) and a TorchScript
archive's code scanned (its ``__setstate__`` methods run as it loads); once loaded, every
graph may call only operators that compute on tensors (:mod:`._torch_ops`: not
``aten::from_file``, ``aten::save``, RPC, Python ...), and its integer divisions that
would trap on a guest's values (by zero, or the minimum by -1: SIGFPE kills the host)
are guarded (:mod:`._torch_division`); an archive whose code divides constants, which
``torch.jit.load`` would fold before any guard exists, is refused in the host's process
and loaded all the same in a sandbox process (:func:`~.base.in_sandbox`), where a crash
ends only that process. Memory is never shared with the caller: an output whose storage
is an input's, a parameter's, buffer's or constant's, or another output's is cloned, and
a model that writes to its inputs (``x.sub_(mean)``, detected at load from the graph)
runs on copies of them (:mod:`._torch_memory`).

Cancellation: torch offers no way to interrupt an operator, so a ``torch.export``
program is loaded with a checkpoint (:func:`~wasinn.backends.base.stop_if_cancelled`)
before each of its operators, in every graph it holds (control-flow branches included):
once the run's :func:`~wasinn.backends.base.current_cancellation` is cancelled, the run
stops before its next operator and raises BackendRuntimeError. Measured here, a
checkpoint costs about 0.3 µs: +1.2 % on a two-operator model (46 µs a run), +0.07 % on
MobileNetV2 (15 ms). A TorchScript graph runs in C++, where such a Python call would
have to take the GIL back (0.4 µs alone, but milliseconds each while another thread runs
Python), so TorchScript loops are stopped in TorchScript itself (:func:`_with_stop_checks`):
the module's forward, with the calls it makes inlined, gets a ``stop`` flag (a bool tensor
of the run's own, set from the cancelling thread) as an extra input and a check of it
(``if bool(stop): raise``) at the start of every loop iteration, read in C++ without the
GIL; a cancelled loop of large matrix products stops within the product that was
running. A forward without loops runs as loaded: its run is as long as its code. Checks
between straight-line operators were measured and dropped: one before every operator
cost +10 % on MobileNetV2 here, one before every 8th +3 % (each check splits the graph
that TorchScript's executor optimizes), against nothing for loop checks. What the loop
checks cannot reach (straight-line code, a call left un-inlined: logged at load) stops
too in a model loaded ``interruptible``, which also runs every operator through a torch
dispatch mode holding the checkpoint (:class:`_Checkpoints`, +37 % on MobileNetV2 here).
A pipeline stops between steps once cancelled, whatever its backends.
"""

from __future__ import annotations

import contextlib
import functools
import io
import operator
import threading
import zipfile
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.export.passes
import torch.utils._pytree as pytree
import torch.utils.dlpack
from torch.export.graph_signature import ConstantArgument, InputKind
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

from ._dlpack import KDL_CPU, KDL_CUDA, shareable
from ._graphio import CheckedGraph, expect_builders, expect_encoding, no_device, uncarried_type
from ._pt2_check import check_pt2_archive
from ._torch_division import (
    check_folded_divisions,
    guard_exported_divisions,
    guard_torchscript_divisions,
)
from ._torch_memory import (
    exported_written_inputs,
    module_storages,
    script_keeps_tensors,
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
    in_sandbox,
    log,
    stop_if_cancelled,
    warn_precision_not_applied,
)
from .formats import check_declared

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


#: The attribute of a GPU output that holds its ``ready`` event (see :func:`_native`).
_READY = "_wasinn_ready"


def _ready(value: torch.Tensor) -> torch.cuda.Stream | None:
    """For a GPU output read outside the stream that computes it: the current stream of
    its device in this thread, made to wait until the output is computed (None for any
    other tensor). An output stays on its device's actor, whose runs share one stream:
    every other reader (a copy to the host or to another device) is on another stream,
    which would not wait for the kernels still writing it."""
    ready: torch.cuda.Event | None = getattr(value, _READY, None)
    if ready is None:
        return None
    stream = torch.cuda.current_stream(value.device)
    stream.wait_event(ready)
    return stream


def _to_torch(tensor: Tensor, device: torch.device, private: bool) -> torch.Tensor:
    """``tensor`` as torch's, sharing its memory unless ``private`` (the model writes to
    it) asks for a copy of its own."""
    native = tensor.native
    if isinstance(native, torch.Tensor):
        if native.device != device:
            reader = _ready(native)
            moved = native.to(device)
            if reader is not None:
                # The copy reads it on ``reader``: its memory must not go back to the
                # producer's stream (and a later run there) before the copy is done.
                native.record_stream(reader)
            return moved
        return native.clone() if private else native
    view = None
    if native is not None:
        shared = _from_dlpack(tensor, device)
        if shared is not None:
            return shared.clone() if private else shared
        view = tensor.host_view()  # an OpenVINO tensor's host memory, as it is
    array = tensor.numpy() if view is None else view
    if not array.flags.writeable:
        array = array.copy()  # torch.from_numpy warns on read-only memory
    elif private and device.type == "cpu":
        array = array.copy()
    if tensor.type is TensorType.BF16:
        value = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    else:
        value = torch.from_numpy(array)
    return value if device.type == "cpu" else value.to(device)


def _from_dlpack(tensor: Tensor, device: torch.device) -> torch.Tensor | None:
    """Another library's native value (an ONNX Runtime ``OrtValue``) on ``device``, as a
    torch tensor over the same memory (DLPack, see :mod:`._dlpack`): a chain of models of
    different libraries keeps its tensors where they are. None where it has no DLPack
    form there: the caller copies it through the host."""
    where = (KDL_CPU, 0) if device.type == "cpu" else (KDL_CUDA, device.index or 0)
    native = shareable(tensor, where)
    if native is None:
        return None
    try:
        # The capsule itself, not the value: torch would ask a CUDA value for one on its
        # stream, which not every library takes; a computed value needs no stream.
        shared: torch.Tensor = torch.utils.dlpack.from_dlpack(native.__dlpack__())
    except Exception:
        return None
    return shared


def _foreign(tensor: Tensor) -> bool:
    """Whether ``tensor`` is another library's native value (read over DLPack or through
    the host), not torch's."""
    native = tensor.native
    return native is not None and not isinstance(native, torch.Tensor)


def _to_numpy(value: torch.Tensor) -> np.ndarray[Any, Any]:
    _ready(value)  # .cpu() copies on this stream, and waits for it
    value = value.detach().cpu()
    if value.dtype is torch.bfloat16:
        return c_contiguous(value.view(torch.int16).numpy().view(_BF16))
    return c_contiguous(value.numpy())


#: ``LoadOptions.precision`` -> whether torch may compute f32 in TF32 on CUDA (other
#: values leave torch's own setting: TF32 for cuDNN convolutions by default).
_ALLOW_TF32 = {"f32": False, "tf32": True}


def _cuda_allow_tf32(allow: bool) -> None:
    """Let torch compute f32 cuDNN convolutions and RNNs and CUDA matrix products in
    TensorFloat-32 (a 10-bit mantissa, on Ampere and later GPUs), or not. These settings
    are process-wide in torch, so each CUDA run sets its graph's before it starts (a
    write only where one differs). Through torch's ``allow_tf32`` flags, which keep its
    newer ``fp32_precision`` settings in step; set through the newer ones alone, the
    flags would raise when read (torch sees the two APIs mixed)."""
    flags: Any  # (torch.backends.cudnn's flags are module properties, untyped)
    for flags in (torch.backends.cudnn, torch.backends.cuda.matmul):
        try:
            same = flags.allow_tf32 == allow
        except RuntimeError:  # mixed already (by the application): set it right
            same = False
        if not same:
            flags.allow_tf32 = allow


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
        stop_checked: _StopChecked | None = None,
        stateful: bool = False,
    ) -> None:
        """``private``: the inputs the model writes to (it gets copies); ``model_storages``:
        the memory of its parameters, buffers and constants (outputs there are cloned);
        ``stateful``: the model keeps tensors it computes (an attribute it assigns), which
        ``model_storages`` cannot name, so every output is cloned;
        ``dim_ranges``: the symbolic dims' ranges to check before each run;
        ``checkpoints``: run under :class:`_Checkpoints` (a TorchScript module loaded
        with ``interruptible``); ``stop_checked``: a TorchScript module's forward with
        stop checks, run in its place."""
        # TorchScript declares no element types: its specs' f32 is a placeholder, unchecked
        # (their ranks are unknown, so their shapes go unchecked as well).
        unchecked: frozenset[int] = frozenset() if checked else frozenset(range(len(inputs)))
        super().__init__(NAME, module, device, inputs, outputs, any_type=unchecked)
        self._checked = checked
        self.output_types_declared = checked
        self._private = private
        self._model_storages = model_storages
        self._dim_ranges = dim_ranges
        self._checkpoints = checkpoints
        self._stop_checked = stop_checked
        self._stateful = stateful
        self._torch_device = torch.device(
            "cpu" if device.kind is ExecutionTarget.CPU else f"cuda:{device.index}"
        )
        #: Whether f32 convolutions and matrix products may compute in TF32 on CUDA, set
        #: before each run; None leaves torch's setting as it is (see
        #: :func:`_cuda_allow_tf32`).
        self.allow_tf32: bool | None = None

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
        on_cuda = device.type == "cuda"
        if on_cuda and self.allow_tf32 is not None:
            _cuda_allow_tf32(self.allow_tf32)
        try:
            args = [_to_torch(t, device, i in private) for i, t in enumerate(ordered)]
            with torch.inference_mode():
                stop_checked = self._stop_checked
                if self._checkpoints:
                    with _Checkpoints():
                        result = (module(*args) if stop_checked is None
                                  else stop_checked(module, args))
                elif stop_checked is None:
                    result = module(*args)
                else:
                    result = stop_checked(module, args)
        except WasiNNError:
            raise
        except Cancelled:
            raise _stopped() from None
        except Exception as exc:
            if _cancelled():
                # A TorchScript run stopped by a stop check (torch.jit.Error), or by the
                # checkpoint's Cancelled, which TorchScript's interpreter turns into a
                # RuntimeError on its way out of C++.
                raise _stopped() from None
            if self._checked and isinstance(exc, AssertionError) \
                    and str(exc).startswith("Guard failed"):
                # torch.export's input guards (a relation between dims, say)
                raise InvalidArgumentError(
                    f"{NAME}: the inputs break the model's shape constraints: {exc}"
                ) from exc
            if isinstance(exc, torch.jit.Error):  # raised by the model's TorchScript code
                raise BackendRuntimeError(
                    f"{NAME}: the model raised {_first_line(exc)}") from exc
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
        # Outputs left on a GPU are still being computed on this thread's stream when the
        # run returns; whoever reads them on another stream (a copy to the host or to
        # another device, in another thread) first waits for this event, recorded once
        # every output's kernels (clones included) are queued. A later run of this
        # device's actor, on the same stream, needs no wait.
        ready = (torch.cuda.Event()  # type: ignore[no-untyped-call]
                 if on_cuda and keep_on_device else None)
        outputs = {self.outputs[i].name: self._wrap(values[i], taken, keep_on_device, ready)
                   for i in picked}
        if ready is not None:
            ready.record(torch.cuda.current_stream(device))
        if on_cuda and any(_foreign(t) for t in ordered):
            # An input over another library's CUDA memory (DLPack): that library gives
            # the memory back to its own allocator once the value is dropped, which
            # knows nothing of this stream, so its next run (on its own stream) could
            # overwrite it while these kernels still read it. Wait for them here.
            torch.cuda.current_stream(device).synchronize()
        return outputs

    def close(self) -> None:
        super().close()
        self._stop_checked = None  # (its graph holds the frozen module's weights)

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

    def _wrap(self, value: Any, taken: set[int], keep: bool,
              ready: torch.cuda.Event | None) -> Tensor:
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
        if value.device.type != "cpu" and value.device != self._torch_device:
            # A meta tensor has no data to hand out: numpy() would raise torch's own error.
            raise BackendRuntimeError(
                f"{NAME}: the model returned a tensor on {value.device}: expected tensors "
                f"on {self.device.name}" + ("" if self.device.name == "cpu" else " or the cpu")
            )
        if value.is_neg():  # (torch._neg_view): numpy() refuses it, so does a consumer's
            value = value.resolve_neg()
        storage = storage_of(value)
        if self._stateful or storage in taken or storage in self._model_storages:
            # A view of an input (guest memory), a weight (a caller's edit would change
            # the model for every later run), another output or, in a model that keeps
            # tensors it computed, one it may write to in a later run: a copy of its own.
            value = value.clone(memory_format=torch.contiguous_format)
        else:
            taken.add(storage)
        if keep:
            on_device = value.device.type != "cpu"
            return _native(value, ttype, self.device.name if on_device else "cpu",
                           ready if on_device else None)
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


#: The stop check put into TorchScript graphs (:func:`_with_stop_checks`): raise once the
#: run's ``stop`` flag is set. The ``fill_`` runs only on a set flag, where it changes
#: nothing: it is there to show TorchScript's optimizer that the flag is written, else its
#: common subexpression elimination folds every read of it into the first one.
_STOP_CHECK = """
graph(%stop : Tensor):
  %message : str = prim::Constant[value="wasinn: run cancelled"]()
  %none : NoneType = prim::Constant()
  %set : bool = aten::Bool(%stop)
  prim::If(%set)
    block0():
      %one : int = prim::Constant[value=1]()
      %same : Tensor = aten::fill_(%stop, %one)
      prim::RaiseException(%message, %none)
      -> ()
    block1():
      -> ()
  return ()
"""
#: The stop flag of runs that cannot be cancelled: never set.
_NEVER = torch.zeros((), dtype=torch.bool)
#: Each thread's stop flag, reused for its next run unless a cancellation reached it (a
#: late one could otherwise stop a later run): a ``(tensor, set it)`` pair.
_spare = threading.local()


class _StopChecked:
    """A TorchScript module's forward with stop checks (:func:`_with_stop_checks`),
    called as the module would be, with a stop flag that only the run's cancellation
    sets."""

    __slots__ = ("_defaults", "_function")

    def __init__(self, function: Any, defaults: tuple[Any, ...]) -> None:
        self._function = function  # (self, *forward's arguments, stop)
        self._defaults = defaults  # forward's arguments after its tensors

    def __call__(self, module: Any, args: list[torch.Tensor]) -> Any:
        cancellation = current_cancellation()
        if cancellation is None:
            return self._function(module._c, *args, *self._defaults, _NEVER)
        flag = getattr(_spare, "flag", None)
        if flag is None:
            array = np.zeros((), np.bool_)  # set from the cancelling thread, lock-free
            flag = _spare.flag = (torch.from_numpy(array), functools.partial(array.fill, True))
        forget = cancellation.on_cancel(flag[1])
        try:
            return self._function(module._c, *args, *self._defaults, flag[0])
        finally:
            forget()
            if cancellation.cancelled:  # its flag may be set, now or later: not reused
                _spare.flag = None


def _with_stop_checks(module: Any, tensors: int) -> _StopChecked | None:
    """``module``'s forward (its first ``tensors`` arguments are its tensors, the others
    have defaults: the load checked) with its calls inlined, a ``stop`` flag as one more
    argument and a check of the flag (:data:`_STOP_CHECK`) at the start of every loop
    iteration; None for a forward without loops (its run is as long as its code: it runs
    as loaded). Only ATen and TorchScript operators that the archive checks allow are
    added."""
    graph = module._c._get_method("forward").inlined_graph  # a copy
    loops = list(_loops(graph.block()))
    if not loops:
        return None
    rest = module.forward.schema.arguments[1 + tensors:]  # [0] is self
    stop = graph.addInput("wasinn_stop")
    stop.setType(torch._C.TensorType.get())
    check = torch._C.parse_ir(_STOP_CHECK)
    for loop in loops:
        (body,) = loop.blocks()
        _insert(graph, check, stop, next(iter(body.nodes()), body.returnNode()))
    function = torch._C._create_function_from_graph("wasinn_stop_checked", graph)
    return _StopChecked(function, tuple(arg.default_value for arg in rest))


def _loops(block: Any) -> Iterator[Any]:
    """The ``prim::Loop`` nodes of ``block`` and of the blocks nested in it."""
    for node in block.nodes():
        if node.kind() == "prim::Loop":
            yield node
        for inner in node.blocks():
            yield from _loops(inner)


def _insert(graph: Any, check: Any, stop: Any, before: Any) -> None:
    with graph.insert_point_guard(before):
        graph.insertGraph(check, [stop])


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


def _native(value: torch.Tensor, ttype: TensorType, device: str,
            ready: torch.cuda.Event | None = None) -> Tensor:
    """``value`` left where it is; its rows are views on the same device. ``ready``: the
    event that marks it computed, on a GPU (see :func:`_ready`), kept with it."""
    if ready is not None:
        setattr(value, _READY, ready)
    return Tensor.from_native(
        value, tuple(value.shape), ttype, device=device,
        materialize=functools.partial(_to_numpy, value),
        rows=lambda start, stop: _native(value[start:stop], ttype, device, ready),
        synchronize=None if ready is None else ready.synchronize)


def _first_line(exc: BaseException) -> str:
    # The line of torch's message that says what went wrong: its last. A bare
    # "RuntimeError:" (TorchScript's interpreter, in a graph loaded ``interruptible``,
    # can lose the reason) is said to be one, rather than shown as if cut short.
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    last = lines[-1]
    if last.endswith(":") and last[:-1].replace(".", "").isidentifier():
        return f"{last[:-1]}, with no message from torch"
    return last


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
        in a ``.pt2`` program's expressions or names), call an operator that reaches
        outside its tensors (``aten::from_file``...) or, outside a sandbox process, have
        ``torch.jit.load`` fold a division of constants, naming what it found.
        """
        expect_encoding(NAME, encoding, GraphEncoding.PYTORCH)
        expect_builders(NAME, builders, 1, "one builder holding a TorchScript or .pt2 archive")
        check_declared(NAME, builders, GraphEncoding.PYTORCH)
        devices = self.devices()
        if device not in devices:
            raise no_device(NAME, device, devices)
        options = options or LoadOptions()
        warn_precision_not_applied(NAME, options, "torch")
        data = bytes(builders[0])
        torch_device = torch.device(
            "cpu" if device.kind is ExecutionTarget.CPU else f"cuda:{device.index}"
        )
        if _is_exported_program(data):
            graph = _load_exported(data, device, torch_device)
        else:
            graph = _load_torchscript(
                data, device, torch_device, optimize=bool(options.extra.get("optimize", True)),
                interruptible=bool(options.extra.get("interruptible", False)))
        if device.kind is not ExecutionTarget.CPU:
            graph.allow_tf32 = _ALLOW_TF32.get(options.precision.strip().lower())
        return graph


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
    sources = check_torchscript_code(NAME, data)  # before torch.jit.load runs __setstate__
    # Before torch.jit.load folds them as it compiles; a sandbox process risks the fold.
    check_folded_divisions(NAME, sources, refuse_unguardable=not in_sandbox())
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
    guard_torchscript_divisions(module)  # before freezing folds a division by a constant 0
    inputs = []
    defaulted = None  # the first argument left to its default
    for arg in schema.arguments[1:]:  # [0] is self
        if str(arg.type) != "Tensor":
            if arg.has_default_value():
                defaulted = defaulted or arg
                continue
            raise UnsupportedOperationError(
                f"{NAME}: forward() argument {arg.name!r} is {arg.type}: expected Tensor "
                "arguments (others need a default value)"
            )
        if defaulted is not None:
            # A run passes its tensors by position: this one would land in that argument.
            raise UnsupportedOperationError(
                f"{NAME}: forward() argument {arg.name!r} (Tensor) follows {defaulted.name!r} "
                f"({defaulted.type}, left to its default): expected the Tensor arguments "
                "first, the others after them"
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
    stop_checked = None
    try:
        stop_checked = _with_stop_checks(module, len(inputs))
    except Exception as exc:  # a graph torch cannot edit still runs, as loaded
        log.warning("%s: no stop checks could be put into the loops of this TorchScript "
                    "model (%s: %s): a cancelled run of it goes on to its end", NAME,
                    type(exc).__name__, exc)
    return TorchGraph(module, device, tuple(inputs), outputs, checked=False,
                      private=script_written_inputs(module),
                      model_storages=script_storages(module),
                      checkpoints=interruptible, stop_checked=stop_checked,
                      stateful=script_keeps_tensors(module))


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
        program = _program_on(program, torch_device)
        module = program.module()
        guard_exported_divisions(module)
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
    # A constant output (None, an int) is no fx node: it has no tensor to hand out.
    outputs = tuple(_spec_of(name, node.meta.get("val") if isinstance(node, torch.fx.Node)
                             else node, "output")
                    for name, node in zip(names, user_outputs, strict=True))
    return TorchGraph(
        _flat_calls(program, module, len(placeholders), len(outputs)), device, inputs,
        outputs, checked=True,
        private=exported_written_inputs(program, placeholders),
        model_storages=module_storages(module),
        dim_ranges=_dim_ranges(program, placeholders),
    )


def _program_on(program: Any, torch_device: torch.device) -> Any:
    """``program`` moved to ``torch_device``: its parameters and buffers, and also its
    lifted tensor constants and the devices its graph names (``torch.arange(n)`` records
    ``device=cpu``), which the module's ``.to()`` would leave on the CPU, so that every
    run on a GPU would fail with tensors on two devices."""
    if torch_device.type == "cpu":
        return program
    return torch.export.passes.move_to_device_pass(program, torch_device)


#: Where :class:`_Flattened` passes one of the run's tensors.
_TENSOR = object()


class _Flattened(torch.nn.Module):
    """An exported program whose inputs or outputs are more than a flat tuple of tensors,
    called as its specs describe it: with its tensor inputs in order (placed, with the
    constants export fixed, into the arguments it was exported with), returning the
    tensors of its result in pytree order."""

    def __init__(self, program: torch.nn.Module, leaves: list[Any], in_spec: Any) -> None:
        super().__init__()
        self.program = program
        self._leaves = leaves  # each input leaf: _TENSOR, or the constant export fixed
        self._in_spec = in_spec

    def forward(self, *tensors: torch.Tensor) -> list[Any]:
        given = iter(tensors)
        args, kwargs = pytree.tree_unflatten(
            [next(given) if leaf is _TENSOR else leaf for leaf in self._leaves], self._in_spec)
        return pytree.tree_leaves(self.program(*args, **kwargs))


def _flat_calls(program: Any, module: torch.nn.Module, inputs: int,
                outputs: int) -> torch.nn.Module:
    """``module`` (the program's), called with ``inputs`` tensors and returning
    ``outputs`` (one, or a tuple or list of them) as the specs say; else a
    :class:`_Flattened` wrapping it: without it, such a program loads but every run fails
    in torch's input pytree check, or returns a dict or nested tuple."""
    in_spec, out_spec = program.call_spec.in_spec, program.call_spec.out_spec
    leaves = [spec.arg.value if isinstance(spec.arg, ConstantArgument) else _TENSOR
              for spec in program.graph_signature.input_specs
              if spec.kind is InputKind.USER_INPUT]
    flat_in = in_spec == pytree.tree_structure((tuple(range(inputs)), {})) \
        and all(leaf is _TENSOR for leaf in leaves)
    flat_out = out_spec in (pytree.tree_structure(0), pytree.tree_structure(tuple(range(outputs))),
                            pytree.tree_structure(list(range(outputs))))
    return module if flat_in and flat_out else _Flattened(module, leaves, in_spec)


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
