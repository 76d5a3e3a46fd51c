"""What memory a PyTorch model shares with its caller, found once at load.

torch hands tensors around by reference: an input made with ``torch.from_numpy`` is the
caller's memory (a guest's linear memory, for a wasm guest), and a model's output may be
a view of an input (``x[1:]``), or a parameter, buffer or constant itself. The backend
uses what is computed here to keep every run's memory its own:

- :func:`storage_of` names a tensor's memory block (views of one tensor share it); an
  output whose block is an input's, another output's or one of the model's
  (:func:`module_storages`, :func:`script_storages`) is cloned before it is handed out.
  Otherwise a guest's later writes would change a result already returned, and a
  caller's in-place edit of a result would change the model for every later caller.
- :func:`exported_written_inputs` and :func:`script_written_inputs` find the inputs a
  model writes to (``x.sub_(mean)``, ``x[0].relu_()``), which then get a copy each run;
  a model that writes only to its intermediates (an in-place ReLU) costs no copy. Both
  follow the operators' alias annotations (through views, lists of views from ``split``
  or ``unbind`` included), which some operators lack although they may return their
  input itself or a view of it (:data:`UNANNOTATED_ALIASES`): an input given to one of
  those counts as written.
- :func:`script_keeps_tensors` finds a TorchScript model that keeps tensors it computes
  (``self.state = x * 2``): :func:`script_storages` cannot name their memory at load,
  so each of its outputs is cloned.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from ._torch_ops import graph_nodes, script_graphs

#: ATen operators whose schemas promise a new tensor but that may return their input
#: itself or a view of it (``dropout`` in eval mode, ``type_as`` to the same type,
#: ``_unsafe_view``; ``set_`` makes its first argument a view of its second), found by
#: calling every ATen operator of torch 2.13 on a small tensor: a write to what they
#: return may write to their input, which alias annotations do not show.
UNANNOTATED_ALIASES = frozenset({
    "aten::_cast_Byte", "aten::_cast_Char", "aten::_cast_Double", "aten::_cast_Float",
    "aten::_cast_Half", "aten::_cast_Int", "aten::_cast_Long", "aten::_cast_Short",
    "aten::_foobar", "aten::_remove_batch_dim", "aten::_saturate_weight_to_fp16",
    "aten::_test_parallel_materialize", "aten::_test_string_default", "aten::_unsafe_view",
    "aten::alpha_dropout", "aten::atleast_1d", "aten::atleast_2d", "aten::atleast_3d",
    "aten::conj_physical", "aten::data", "aten::dequantize", "aten::dropout",
    "aten::feature_alpha_dropout", "aten::feature_dropout", "aten::lift", "aten::set",
    "aten::set_", "aten::to_dense", "aten::to_dense_backward", "aten::to_mkldnn_backward",
    "aten::type_as", "aten::unsafe_chunk", "aten::unsafe_split",
    "aten::unsafe_split_with_sizes",
})


def storage_of(value: torch.Tensor) -> int:
    """The address of ``value``'s memory block: views of one tensor share it."""
    return int(value.untyped_storage().data_ptr())


def module_storages(module: torch.nn.Module) -> frozenset[int]:
    """The memory of every tensor ``module`` and its submodules hold: parameters,
    buffers and plain tensor attributes (an unlifted program's constants)."""
    storages: set[int] = set()
    for sub in module.modules():
        for value in (*sub._parameters.values(), *sub._buffers.values(),
                      *vars(sub).values()):
            if isinstance(value, torch.Tensor):
                storages.add(storage_of(value))
    return frozenset(storages)


def script_storages(module: Any) -> frozenset[int]:
    """The memory of every tensor the TorchScript ``module`` holds: its and its
    submodules' attributes (parameters, buffers, plain tensors) and the constants in its
    graphs (where freezing puts the weights)."""
    storages: set[int] = set()
    for sub in module.modules():
        attributes = torch._C._jit_debug_module_iterators(  # type: ignore[attr-defined]
            sub._c)["named_attributes"]
        storages.update(storage_of(v) for _, v in attributes if isinstance(v, torch.Tensor))
    for graph in script_graphs(module):
        storages.update(storage_of(node.t("value")) for node in graph_nodes(graph)
                        if node.kind() == "prim::Constant" and node.hasAttribute("value")
                        and node.kindOf("value") == "t")
    return frozenset(storages)


def script_written_inputs(module: Any) -> frozenset[int]:
    """The tensor inputs (by position among them) that the TorchScript ``module``'s
    forward may write to, in place or through a view, by TorchScript's alias analysis,
    and those that may reach an operator of :data:`UNANNOTATED_ALIASES`; all of them if
    it cannot tell."""
    arguments = module.forward.schema.arguments[1:]
    tensors = [i for i, arg in enumerate(arguments) if str(arg.type) == "Tensor"]
    try:
        graph = module.inlined_graph
        arguments = list(graph.inputs())[1:]  # [0] is self
        values = [arguments[i] for i in tensors]
        db = graph.alias_db()
        unannotated = [value for node in graph_nodes(graph)
                       if node.kind() in UNANNOTATED_ALIASES for value in node.inputs()]
        return frozenset(n for n, value in enumerate(values) if db.has_writers(value)
                         or any(db.may_contain_alias(value, u) for u in unannotated))
    except Exception:
        return frozenset(range(len(tensors)))


def script_keeps_tensors(module: Any) -> bool:
    """Whether the TorchScript ``module``'s forward may keep a tensor it computed for a
    later run, which may then write to it: it assigns an attribute (``self.state = y``),
    or writes to a list or dict attribute (``self.history.append(y)``); True if it
    cannot tell."""
    try:
        graph = module.inlined_graph
        db = graph.alias_db()
        for node in graph_nodes(graph):
            kind = node.kind()
            if kind in ("prim::SetAttr", "prim::CallMethod", "prim::CallFunction"):
                return True  # (a call left un-inlined: what it does is not in this graph)
            if kind == "prim::GetAttr" and isinstance(node.output().type(), (
                    torch.ListType, torch.DictType)) and db.has_writers(node.output()):
                return True
        return False
    except Exception:
        return True


def exported_written_inputs(program: Any, placeholders: list[Any]) -> frozenset[int]:
    """The inputs (by position among ``placeholders``) that the exported ``program``
    may write to: those its signature says it mutates (a functionalized program), and
    those an operator writes to in place, directly or through a view (export's default
    IR keeps in-place operators), by the operators' schema alias annotations
    (:func:`_returns_alias`). A view is followed through every operator whose schema
    says it returns one, those returning a list of views (``unbind``, ``split``,
    ``chunk``...) and the items taken from it included. A higher-order operator
    (``cond``...), any other call that is no ATen operator, or an operator of
    :data:`UNANNOTATED_ALIASES` given an input or a view of one counts as writing to it;
    all inputs count as written if the graph cannot be read this way."""
    try:
        return _exported_written_inputs(program, placeholders)
    except Exception:
        return frozenset(range(len(placeholders)))


def _exported_written_inputs(program: Any, placeholders: list[Any]) -> frozenset[int]:
    mutated = set(program.graph_signature.user_inputs_to_mutate.values())
    written = {i for i, node in enumerate(placeholders) if node.name in mutated}
    roots: dict[Any, set[int]] = {node: {i} for i, node in enumerate(placeholders)}
    for node in program.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        bound = _bound_arguments(node) if node.op == "call_function" else None
        if bound is not None and node.target._schema.name in UNANNOTATED_ALIASES:
            written |= _roots(roots, (node.args, node.kwargs))
        if bound is None:  # not an ATen operator: a HOP, getitem, shape arithmetic
            reached = _roots(roots, (node.args, node.kwargs))
            if reached and node.target is operator.getitem:
                roots[node] = reached  # an item of a view op's list of views
            elif reached:
                written |= reached
            continue
        returns = node.target._schema.returns
        for value, argument in bound:
            info = argument.alias_info
            reached = _roots(roots, value) if info is not None else set()
            if not reached:
                continue
            if info.is_write:
                written |= reached
            if _returns_alias(info, returns):
                roots.setdefault(node, set()).update(reached)  # returns a view of it
    return frozenset(written)


def _returns_alias(argument: Any, returns: list[Any]) -> bool:
    """Whether a schema's ``returns`` may alias the argument whose alias annotation is
    ``argument``. The argument joins the wildcard set (``Tensor(a -> *) self``: what
    ``split`` returns, a list of its views), or shares a set with an annotated return.
    The Python schema objects show the annotation of a list's elements (``Tensor(a)[]``,
    ``Tensor(a!)[]``) as one with no sets: such an annotation, on either side, is taken
    to share every set."""
    if "*" in argument.after_set:
        return True
    for result in returns:
        info = result.alias_info
        if info is None:
            continue
        sets = info.before_set | info.after_set
        if not sets or not argument.before_set or "*" in sets or sets & argument.before_set:
            return True
    return False


def _bound_arguments(node: Any) -> list[tuple[Any, Any]] | None:
    """An ATen node's ``(value, schema argument)`` pairs; None for other nodes."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return None
    arguments = node.target._schema.arguments
    by_name = {arg.name: arg for arg in arguments}
    return [*zip(node.args, arguments, strict=False),  # trailing defaults not passed
            *((value, by_name[name]) for name, value in node.kwargs.items()
              if name in by_name)]


def _roots(roots: dict[Any, set[int]], value: Any) -> set[int]:
    """The inputs that the fx nodes in ``value`` (however nested) may be views of."""
    found: list[Any] = []
    torch.fx.node.map_arg(value, found.append)
    return set().union(*(roots.get(node, set()) for node in found))
