"""A loaded PyTorch model on one device, and its runs (for :mod:`wasinn.backends.pytorch`).

:class:`TorchGraph` holds a TorchScript module or an exported program with its specs and
runs it: inputs checked against the exported ranges of symbolic dims, handed to torch
(copies for those the model writes to), run under ``torch.inference_mode()`` and, where
asked, stop checks or checkpoints; torch's failures told apart (a cancelled run, a
broken shape guard, an error the model raised, an integer tensor divided by zero, inputs
TorchScript rejected); outputs cloned where their memory is not theirs alone, and on
CUDA the run's TF32 setting and the events that let other streams read its outputs.
Also the names both archive loaders share: the backend's :data:`NAME`,
:func:`_output_names` and :func:`_first_line`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from wasinn.enums import ExecutionTarget
from wasinn.errors import BackendRuntimeError, InvalidArgumentError, WasiNNError
from wasinn.tensor import Tensor, count_host_copies

from ._graphio import CheckedGraph
from ._torch_cancel import _Checkpoints, _StopChecked
from ._torch_division import divided_by_zero
from ._torch_memory import storage_of
from ._torch_tensors import _TYPES, _foreign, _native, _to_numpy, _to_torch
from ._torch_tf32 import tf32_runs
from .base import Cancelled, Device, TensorSpec, current_cancellation

#: The backend's name, which its messages begin with.
NAME = "pytorch"


def _output_names(count: int) -> list[str]:
    return ["output"] if count == 1 else [f"output_{i}" for i in range(count)]


#: ``LoadOptions.precision`` -> whether torch may compute f32 in TF32 on CUDA (other
#: values leave torch's own setting: TF32 for cuDNN convolutions by default).
_ALLOW_TF32 = {"f32": False, "tf32": True}


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
        checkpoints: bool = False,
        stop_checked: _StopChecked | None = None,
        stateful: bool = False,
    ) -> None:
        """``private``: the inputs the model writes to (it gets copies); ``model_storages``:
        the memory of its parameters, buffers and constants (outputs there are cloned);
        ``stateful``: the model keeps tensors it computes (an attribute it assigns), which
        ``model_storages`` cannot name, so every output is cloned;
        ``checkpoints``: run under :class:`_Checkpoints` (a TorchScript module loaded
        with ``interruptible``); ``stop_checked``: a TorchScript module's forward with
        stop checks, run in its place."""
        # TorchScript declares no element types (type_known=False): its specs' f32 is a
        # placeholder, unchecked (their ranks are unknown, so their shapes go unchecked
        # as well).
        unchecked = frozenset(i for i, spec in enumerate(inputs) if not spec.type_known)
        # (A torch.export program's symbolic dims carry their exported ranges as their
        # specs' bounds, which the input check checks, as torch's input guards would.)
        super().__init__(NAME, module, device, inputs, outputs, any_type=unchecked,
                         bounds_said="was exported for")
        self._checked = checked
        self.output_types_declared = all(spec.type_known for spec in outputs)
        self._private = private
        self._model_storages = model_storages
        self._checkpoints = checkpoints
        self._stop_checked = stop_checked
        self._stateful = stateful
        self._torch_device = torch.device(
            "cpu" if device.kind is ExecutionTarget.CPU else f"cuda:{device.index}"
        )
        #: Whether f32 convolutions and matrix products may compute in TF32 on CUDA, set
        #: before each run; None leaves torch's setting as it is (see
        #: :func:`._torch_tf32.tf32_runs`).
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
        private = self._private
        on_cuda = device.type == "cuda"
        checkpoints = _Checkpoints() if self._checkpoints else None
        try:
            args = [_to_torch(t, device, i in private) for i, t in enumerate(ordered)]
            with torch.inference_mode(), tf32_runs(self.allow_tf32 if on_cuda else None):
                stop_checked = self._stop_checked
                if checkpoints is not None:
                    with checkpoints:
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
            # An operator's own error where TorchScript passed on a bare one.
            cause = exc if checkpoints is None or checkpoints.failed is None \
                else checkpoints.failed
            if divided_by_zero(cause):  # on the values given: not inputs it rejected
                raise BackendRuntimeError(
                    f"{NAME}: the model divided by zero: an integer division or remainder "
                    "of tensors had a zero divisor (torch raised ZeroDivisionError)") from exc
            if (not self._checked and isinstance(exc, RuntimeError)
                    and not isinstance(exc, torch.OutOfMemoryError)):
                raise InvalidArgumentError(
                    f"{NAME}: the TorchScript model rejected its inputs (it declares no types "
                    f"or shapes; given {[f'{t.type.value}{list(t.dims)}' for t in ordered]}): "
                    f"{_first_line(cause)}"
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
        count_host_copies(1)
        return Tensor(array.shape, ttype, array=array)


def _cancelled() -> bool:
    cancellation = current_cancellation()
    return cancellation is not None and cancellation.cancelled


def _stopped() -> BackendRuntimeError:
    """What a run stopped at a checkpoint raises."""
    return BackendRuntimeError(f"{NAME}: run cancelled (stopped before its next operator)")


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
