"""Stopping a running torch model once its run is cancelled (for
:mod:`wasinn.backends.pytorch`, whose docstring says what each costs).

A ``torch.export`` program gets a checkpoint before each operator of its fx graphs
(:func:`_interruptible`). A TorchScript module's forward gets a ``stop`` flag and a check
of it at the start of every loop iteration, read in C++ without the GIL
(:func:`_with_stop_checks`, called through :class:`_StopChecked`). A module loaded
``interruptible`` also runs every operator through a dispatch mode holding the
checkpoint (:class:`_Checkpoints`).
"""

from __future__ import annotations

import functools
import operator
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .base import current_cancellation, stop_if_cancelled


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
