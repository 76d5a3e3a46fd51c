"""Stopping a running torch model once its run is cancelled (for
:mod:`wasinn.backends.pytorch`, whose docstring says what each costs).

A ``torch.export`` program gets a checkpoint before each operator of its fx graphs
(:func:`_interruptible`). A TorchScript module's forward gets a ``stop`` flag and a check
of it at the start of every loop iteration, read in C++ without the GIL
(:func:`_with_stop_checks`, called through :class:`_StopChecked`), the iterations of the
loops that freezing unrolled included (:class:`LoopSources`). A module loaded
``interruptible`` also runs every operator through a dispatch mode holding the
checkpoint (:class:`_Checkpoints`).
"""

from __future__ import annotations

import functools
import operator
import threading
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
        #: What an operator raised, as raised: TorchScript's interpreter passes on only
        #: a bare ``RuntimeError`` without its message (a kernel's zero divisor, say).
        self.failed: Exception | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        stop_if_cancelled()
        try:
            return func(*args, **(kwargs or {}))
        except Exception as exc:
            self.failed = exc
            raise


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


def _with_stop_checks(module: Any, tensors: int, loaded: LoopSources | None = None
                      ) -> tuple[_StopChecked | None, list[str]]:
    """``module``'s forward (its first ``tensors`` arguments are its tensors, the others
    have defaults: the load checked) with its calls inlined, a ``stop`` flag as one more
    argument and a check of the flag (:data:`_STOP_CHECK`) at the start of every loop
    iteration, and, given the loops of the module as ``loaded`` before it was frozen, at
    the start of every iteration that freezing unrolled (:meth:`LoopSources.unrolled`);
    None for a forward without either (its run is as long as its code: it runs as
    loaded); and the loops freezing took out whose iterations cannot be told, which have
    no checks (:meth:`LoopSources.unrolled`). Only ATen and TorchScript operators that the
    archive checks allow are added."""
    graph = module._c._get_method("forward").inlined_graph  # a copy
    loops = _loops(graph)
    starts, unchecked = loaded.unrolled(graph) if loaded is not None else ([], [])
    if not loops and not starts:
        return None, unchecked
    rest = module.forward.schema.arguments[1 + tensors:]  # [0] is self
    stop = graph.addInput("wasinn_stop")
    stop.setType(torch._C.TensorType.get())
    check = torch._C.parse_ir(_STOP_CHECK)
    for loop in loops:
        (body,) = loop.blocks()
        _insert(graph, check, stop, next(iter(body.nodes()), body.returnNode()))
    for start in starts:
        _insert(graph, check, stop, start)
    function = torch._C._create_function_from_graph("wasinn_stop_checked", graph)
    return _StopChecked(function, tuple(arg.default_value for arg in rest)), unchecked


def _loops(graph: Any) -> list[Any]:
    """The ``prim::Loop`` nodes of ``graph``, nested ones included (found in C++: a walk
    over a scripted model's thousands of nodes in Python takes tens of ms)."""
    return list(graph.findAllNodes("prim::Loop", True))


def _origin(node: Any) -> str:
    """Where ``node`` comes from: the module it was called in (its path from the module
    loaded) and its source range, or ``""`` where it has no source range."""
    source = node.sourceRange()
    return f"{node.getModuleHierarchy()}\n{source}" if source else ""


class LoopSources:
    """Where the nodes of a TorchScript forward's loops come from, read before freezing.

    ``torch.jit.freeze`` unrolls a loop of constant trip count under 64 completely,
    leaving no ``prim::Loop`` to put a check in (a longer one it unrolls by 8 within a
    loop it keeps). Unrolling copies each node's origin (the module it was called in, its
    source range: :func:`_origin`), so the iterations show in the frozen graph as runs of
    nodes from the loop's body, in the body's order: an iteration starts at a node from a
    loop body that comes, in that body, at or before the node from a loop body before it
    (:meth:`unrolled`). A check there costs what the loop's own check did: one an
    iteration (more where the body runs the same code twice, or where code outside the
    loop shares its origin: the same submodule called there too)."""

    __slots__ = ("_loops", "_places")

    def __init__(self, module: Any) -> None:
        graph = module._c._get_method("forward").inlined_graph  # a copy
        self._loops: set[str] = set()  # each loop's own origin
        #: a loop body's node's origin -> (its innermost loop's origin, its place there)
        self._places: dict[str, tuple[str, int]] = {}
        for loop in _loops(graph):
            origin = _origin(loop)
            self._loops.add(origin)
            self._read(next(loop.blocks()), origin, 0)

    def _read(self, block: Any, loop: str, place: int) -> int:
        for node in block.nodes():
            place += 1
            kind = node.kind()
            if kind != "prim::Constant":
                origin = _origin(node)
                if origin:
                    self._places.setdefault(origin, (loop, place))
            if kind != "prim::Loop":  # (a loop in the body is read as one of its own)
                for inner in node.blocks():
                    place = self._read(inner, loop, place)
        return place

    def unrolled(self, graph: Any) -> tuple[list[Any], list[str]]:
        """The nodes of ``graph`` (the forward frozen, then inlined) that start an
        iteration of a loop, but for the first of a body that a kept loop's own check
        starts; and the loops freezing took out whose nodes cannot be told (the code
        carries no source ranges), each as the first line of its source or ``"(no
        source)"``. A loop taken out of which no node is left was dead code (e.g. a
        check in a training-mode branch, which freezing drops): it needs no check."""
        if not self._loops:
            return [], []
        starts: list[Any] = []
        self._starts(graph.block(), None, starts)
        gone = self._loops - {_origin(loop) for loop in _loops(graph)}
        unknown = sorted(gone - {loop for loop, _ in self._places.values()})
        return starts, [origin.split("\n")[1].strip() if origin else "(no source)"
                        for origin in unknown]

    def _starts(self, block: Any, last: tuple[str, int] | None, starts: list[Any]) -> None:
        # last: where the node from a loop body before this one comes from: None where
        # none came before, _CHECKED at a kept loop's body's start (it has a check there)
        for node in block.nodes():
            kind = node.kind()
            place = None if kind == "prim::Constant" else self._places.get(_origin(node))
            if place is not None:
                if last is None or (last is not _CHECKED
                                    and (place[0] != last[0] or place[1] <= last[1])):
                    starts.append(node)
                last = place
            for inner in node.blocks():  # an If's blocks go on from the If
                self._starts(inner, _CHECKED if kind == "prim::Loop" else last, starts)


#: In :meth:`LoopSources._starts`, a block that starts with a check: a kept loop's body.
_CHECKED = ("", -1)


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
