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
reported as None, their exported range as the spec's ``bounds``) and inputs are checked
against them, a symbolic dim against the range it was exported with (``Dim("n", max=8)``;
like torch, only lower bounds above 2): an input outside it is InvalidArgumentError
naming the input, the dimension and the range.
A TorchScript archive records neither: its specs declare no element type and no rank
(``type_known=False``, ``rank_known=False``, described as ``x: any[...]``; their f32 is a
placeholder) and only input names are checked;
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
Python), so TorchScript loops are stopped in TorchScript itself (:mod:`._torch_cancel`):
the module's forward, with the calls it makes inlined, gets a ``stop`` flag (a bool tensor
of the run's own, set from the cancelling thread) as an extra input and a check of it
(``if bool(stop): raise``) at the start of every loop iteration, read in C++ without the
GIL (a loop that ``torch.jit.freeze`` unrolls included: at each unrolled iteration); a
cancelled loop of large matrix products stops within the product that was running. A
forward without loops runs as loaded: its run is as long as its code. Checks
between straight-line operators were measured and dropped: one before every operator
cost +10 % on MobileNetV2 here, one before every 8th +3 % (each check splits the graph
that TorchScript's executor optimizes), against nothing for loop checks. What the loop
checks cannot reach (straight-line code, a call left un-inlined: logged at load) stops
too in a model loaded ``interruptible``, which also runs every operator through a torch
dispatch mode holding the checkpoint (:mod:`._torch_cancel`, +37 % on MobileNetV2 here).
A pipeline stops between steps once cancelled, whatever its backends.
"""

from __future__ import annotations

import threading

import torch

from wasinn.enums import ExecutionTarget, GraphEncoding

from ._graphio import expect_builders, expect_encoding, no_device
from ._torch_export import (
    _is_exported_program,
    _load_exported,
)
from ._torch_graph import (
    _ALLOW_TF32,
    NAME,
    TorchGraph,
)
from ._torch_script import _load_torchscript
from .base import Backend, Builders, Device, LoadOptions, warn_precision_not_applied
from .formats import check_declared

__all__ = ["NAME", "TorchBackend", "TorchGraph"]


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
