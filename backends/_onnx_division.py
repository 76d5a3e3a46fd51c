"""Guarding ONNX Runtime against integer division overflow.

ONNX Runtime's CPU kernels for ``Div`` and ``Mod`` divide int32 and int64 elements with
C++'s ``/`` and ``%``, checking the divisor for zero (from onnxruntime 1.25: older ones
divide by it, which is why the backend refuses them, see
:func:`~.onnxruntime.check_version`) but not the one other case that has no result:
the type's minimum divided by -1. On x86 the ``idiv`` instruction traps on it
and the whole host process dies of SIGFPE (exit 136), every other guest and caller with
it. Guests choose a model's inputs, so any model with an integer Div let a guest kill
the host with two numbers; a model whose Div has the constants MIN and -1 killed it while
ONNX Runtime built the session (constant folding). OpenVINO computes these without a
trap and is left alone.

:func:`guard_integer_division` rewrites such nodes so that they never see that pair:

- Operands of a known int32 or int64 type: the divisor becomes
  ``Where(And(Equal(a, MIN), Equal(b, -1)), 1, b)`` (before opset 9, which has no
  ``Where``: ``b + 2 * Cast(that condition)``). ``MIN / 1`` is MIN, the two's-complement
  wrapped quotient numpy gives too, and ``MIN mod 1`` is 0, the exact remainder; the
  guard broadcasts as the node does, so shapes are unchanged. Other element types cannot
  trap (int8 and int16 are computed in int, floats have no trap, unsigned types have no
  -1) and are left as they are.
- Operands of an unknown type (after an operator of another domain, or inside a
  model-local function, whose inputs are untyped): a guard that holds for every type,
  built with ``CastLike`` (opset 15): ``s`` is -1 where the divisor is -1 of a signed
  type, else 1; the divisor becomes ``b * s`` (1 instead of -1) and a Div's quotient is
  multiplied by ``s``: ``a / -1`` is exactly ``-a`` for floats (-0.0, inf and nan
  included) and wraps like the guarded quotient for integers, and ``x mod 1`` equals
  ``x mod -1`` in both of Mod's modes. ``Where`` selects between int64 values only,
  ``s`` is then cast: ONNX Runtime's CPU ``Where`` has no int16, uint16 or uint64
  kernel. Before opset 15 such a node cannot be guarded without a type (see below).

Found through ``onnx.shape_inference``, run on a second parse of the model whose weights'
``raw_data`` is cleared (inference would serialize and copy them twice; clearing them in
the model being rewritten and putting them back took twice as long as parsing again), over
the main graph, every subgraph at any depth (If, Loop, Scan bodies, any graph-valued
attribute) and the nodes of model-local functions. New nodes and values are named
``wasinn_<n>``, clashing with no name in the model, and are inserted next to their node
(the scalar constants, shared by a node list's guards, at its head), so the nodes stay in
topological order. Opset imports, IR version, metadata and external data references are
kept; external data is never read. A model with no Div or Mod node (most models; told
from the bytes of its nodes, its weights skipped, without parsing it: bytes that hold
the letters Div or Mod, however the op_type field around them is encoded, are parsed)
is returned as it came, and so is one whose divisions all have safe types. The bytes
are read as ONNX Runtime will read them: as an ORT-format model where it will (its
identifier, or a load format in the session's options, decides), and a tag that
protobuf's C++ parser would truncate to another field makes them searched whole (onnx
refuses them: InvalidEncodingError).

Declared types are trusted as ONNX Runtime checks them: a value_info, subgraph input or
initializer whose type differs from the one ONNX Runtime infers fails the session. It
does not check all of them (a value_info naming a graph input is ignored), so every type
a value is declared or inferred with counts: operands declared with more than one are of
unknown type. A model-local function's nodes run inlined, at the model's opset, whatever
the function imports: its divisions are guarded (or refused) whatever that opset.

What cannot be guarded: an ORT-format model's Div and Mod nodes (flatbuffers are not
rewritten here), and a node of unknown type before opset 15. The caller decides
(``refuse_unguardable``). In the host's process, where the trap would end every guest
and caller, the model is refused with UnsupportedOperationError, which names the way out:
a sandboxed load. In a sandboxed graph's own process (:func:`~.base.in_sandbox`), where
the trap ends only that process and the host reports it as that run's (or that load's)
error, those divisions are left as they are, logged at debug level (logger
``wasinn.backends``); every other division of the model is still guarded, so it gives a
result instead of a crash.
"""

from __future__ import annotations

import itertools
import math
from collections import ChainMap
from collections.abc import Iterable, Iterator, MutableSequence
from typing import TYPE_CHECKING, Any

from wasinn.errors import InvalidEncodingError, UnsupportedOperationError, WasiNNError

from ._onnx_check import onnx_records, reads_as_ort_format
from .base import RUN_IT_SANDBOXED, log

if TYPE_CHECKING:
    import onnx

#: The operator types' bytes, sought in a node's bytes as they are: a protobuf string
#: is always stored whole, however its tag and length are encoded.
_PROTO_OPS = (b"Div", b"Mod")
#: ONNX field numbers: ModelProto.graph, .training_info, .functions; GraphProto.node.
_GRAPH, _TRAINING_INFO, _FUNCTIONS, _NODE = 7, 20, 25, 1
#: ORT-format models' strings are a little-endian uint32 length, the bytes and a NUL.
_ORT_OPS = (b"\x03\x00\x00\x00Div\x00", b"\x03\x00\x00\x00Mod\x00")
_OPS = frozenset({"Div", "Mod"})
_DEFAULT_DOMAINS = frozenset({"", "ai.onnx"})
#: TensorProto.DataType: the types whose minimum divided by -1 traps, with that minimum.
_FLOAT, _INT32, _INT64 = 1, 6, 7
_MINIMUM = {_INT32: -(2**31), _INT64: -(2**63)}
#: ONNX Runtime has Div kernels from opset 7; Where (and integer Constants) came in opset
#: 9, CastLike in 15.
_FIRST_DIV_KERNEL, _WHERE, _CASTLIKE = 7, 9, 15
#: Weights of more elements than this are cleared for shape inference (counted from their
#: dimensions: reading ``raw_data`` to measure it would copy it). Small tensors stay:
#: inference reads the values of shape tensors (Reshape's, for instance).
_CLEARED_ABOVE = 256


def guard_integer_division(backend: str, data: bytes, *, refuse_unguardable: bool,
                           ort_format: bool | None = None) -> bytes:
    """``data`` with every default-domain Div and Mod node guarded against the minimum
    of int32 or int64 divided by -1 (see the module docstring); ``data`` itself (the
    same object) when no node needs a guard.

    ``refuse_unguardable``: whether a division that cannot be guarded (an ORT-format
    model's, or one of unknown type before opset 15) refuses the model, as it must in
    the host's process; else it is left unguarded and logged at debug level.
    ``ort_format``: whether ONNX Runtime reads ``data`` as an ORT-format model (None:
    as it decides with no load format in its options, by the bytes' identifier; see
    :func:`~._onnx_check.reads_as_ort_format`).

    Raises UnsupportedOperationError for such a division where ``refuse_unguardable``;
    InvalidEncodingError for bytes ``onnx`` cannot read although they name a Div or Mod.
    """
    if reads_as_ort_format(data) if ort_format is None else ort_format:
        if any(op in data for op in _ORT_OPS):
            _unguardable(backend, refuse_unguardable,
                         "an ORT-format model's Div and Mod nodes cannot be guarded (this "
                         "format cannot be rewritten)", "convert the model to ONNX (protobuf)")
        return data
    if not _may_divide(data):
        return data
    try:
        import onnx
    except ImportError as exc:  # the onnxruntime extra installs it
        raise UnsupportedOperationError(
            f"{backend}: a model with a Div or Mod node needs the 'onnx' package, which "
            "guards integer division (pip install 'wasinn[onnxruntime]')") from exc
    try:
        model = onnx.ModelProto.FromString(data)
        changed = _Guard(backend, data, model, refuse_unguardable).run()
    except WasiNNError:
        raise
    except Exception as exc:  # e.g. a name that is not UTF-8: UnicodeDecodeError
        raise InvalidEncodingError(f"{backend}: cannot read the ONNX model: {exc}") from exc
    if not changed:
        return data
    rewritten: bytes = model.SerializeToString()
    return rewritten


def _unguardable(backend: str, refuse: bool, what: str, remedy: str) -> None:
    """Refuse (``refuse``) or leave unguarded, logged, the division(s) ``what`` tells of,
    which cannot be guarded; ``remedy``: how the model could be guarded instead."""
    if refuse:
        raise UnsupportedOperationError(
            f"{backend}: {what}; an integer division of the minimum value by -1 would "
            "crash the host process, so the model is refused in the host's process: "
            f"{remedy}, or {RUN_IT_SANDBOXED}")
    log.debug("%s: %s: left unguarded in this sandbox process (the minimum value divided "
              "by -1 there ends only it, which the host reports as an error)", backend, what)


class _Constants:
    """The scalar constants of the guards in one node list, each made once and put at
    the list's head (a subgraph has its own: each of its nodes is guarded in it)."""

    def __init__(self, guard: _Guard, opset: int) -> None:
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self._guard = guard
        self._made: dict[tuple[int, int], str] = {}

    def get(self, element: int, value: int) -> str:
        """The name of the scalar ``value`` of type ``element``. Before opset 9 a Constant
        holds floats only: an integer is then a float Constant cast to ``element`` (exact
        for the values used here: small, or a power of two)."""
        from onnx import helper

        name = self._made.get((element, value))
        if name is None:
            if self.opset >= _WHERE:
                tensor = helper.make_tensor("value", element, [], [value])
                name = self._guard.add(self.nodes, "Constant", value=tensor)
            else:
                tensor = helper.make_tensor("value", _FLOAT, [], [float(value)])
                number = self._guard.add(self.nodes, "Constant", value=tensor)
                name = self._guard.add(self.nodes, "Cast", number, to=element)
            self._made[element, value] = name
        return name


def _may_divide(data: bytes) -> bool:
    """Whether the ONNX model ``data`` may have a Div or Mod node: whether the bytes of
    a node of its graph (subgraphs are inside their nodes' attributes), of a function or
    of a training graph hold the letters "Div" or "Mod". Only those are searched, the
    graph's initializers skipped: searching all of a 10 MB model's bytes took 10 ms,
    this walk 0.03 ms. The letters are sought, not the op_type field's encoding: a
    string's bytes are stored whole whatever encodes its tag and length (a non-minimal
    varint such as ``"\\x83\\x00Div`` reads as Div for onnx and ONNX Runtime alike), and a
    node that only names them elsewhere costs a parse. Bytes that do not walk as
    protobuf, or whose tags protobuf's C++ parser would read as other fields
    (:func:`~._onnx_check.onnx_records`), are searched whole."""
    try:
        for number, _, value in onnx_records(data):
            if value is None:
                continue
            if number in (_FUNCTIONS, _TRAINING_INFO) and _names_division(value):
                return True
            if number == _GRAPH and any(
                    n == _NODE and node is not None and _names_division(node)
                    for n, _, node in onnx_records(value)):
                return True
    except ValueError:
        return _names_division(data)
    return False


def _names_division(data: bytes | memoryview) -> bool:
    """Whether ``data`` holds the letters of a Div or Mod operator type."""
    chunk = bytes(data)  # a copy of a node, a function: small (unless a Constant's)
    return any(op in chunk for op in _PROTO_OPS)


class _Guard:
    """One model's rewrite: fresh names, and the walk over its graphs and functions."""

    def __init__(self, backend: str, data: bytes, model: onnx.ModelProto,
                 refuse_unguardable: bool) -> None:
        """``model``: ``data`` parsed, to be rewritten in place; ``refuse_unguardable``:
        see :func:`guard_integer_division`."""
        self._backend = backend
        self._refuse_unguardable = refuse_unguardable
        self._data = data
        self._model = model
        self._names = _all_names(model)
        self._counter = itertools.count()
        self._changed = False
        self._in_function = False

    def run(self) -> bool:
        """Guard every division that needs it; whether the model changed."""
        model = self._model
        opset = _default_opset(model.opset_import) or 0
        if any(_divides(n) for g in _graphs([model.graph]) for n in g.node):
            typed = _inferred(self._data, model)
            self._graph(model.graph, typed.graph, ChainMap(), opset, "the main graph")
        # A function's nodes run where ONNX Runtime inlines them, at the model's opset
        # whatever the function imports (an opset 6 function's Div ran at 17).
        self._in_function = True
        for function in model.functions:
            where = f"function {function.domain}:{function.name}"
            self._nodes(function.node, function.node, ChainMap(),
                        _default_opset(function.opset_import) or opset, where)
        return self._changed

    def _graph(self, graph: onnx.GraphProto, typed: onnx.GraphProto,
               outer: ChainMap[str, set[int]], opset: int, where: str) -> None:
        """Guard ``graph``'s nodes and its subgraphs', with the element types ``typed``
        (the same graph after shape inference) gives its values, and those ``graph``
        declares; ``outer``: those of the enclosing graphs, whose values a subgraph may
        use."""
        if typed is not graph and _outline(typed) != _outline(graph):
            typed = graph  # not the same graph after all: its declared types only
        types = _declared(graph)
        if typed is not graph:
            for name, elements in _declared(typed).items():
                types.setdefault(name, set()).update(elements)
        self._nodes(graph.node, typed.node, outer.new_child(types), opset, where)

    def _nodes(self, nodes: MutableSequence[onnx.NodeProto], typed: Iterable[onnx.NodeProto],
               types: ChainMap[str, set[int]], opset: int, where: str) -> None:
        found = []
        for index, (node, twin) in enumerate(zip(nodes, typed, strict=True)):
            for attr, tattr in zip(node.attribute, twin.attribute, strict=True):
                inner = f"{where}, node {_describe(node)}, attribute {attr.name}"
                if attr.HasField("g"):
                    self._graph(attr.g, tattr.g, types, opset, inner)
                for graph, tgraph in zip(attr.graphs, tattr.graphs, strict=True):
                    self._graph(graph, tgraph, types, opset, inner)
            if _divides(node):
                found.append(index)
        constants = _Constants(self, opset)
        for index in reversed(found):  # inserting from the end keeps earlier indices
            self._guard(nodes, index, types, constants, where)
        for offset, new in enumerate(constants.nodes):  # no inputs: first is in order
            nodes.insert(offset, new)

    def _guard(self, nodes: MutableSequence[onnx.NodeProto], index: int,
               types: ChainMap[str, set[int]], constants: _Constants, where: str) -> None:
        node, opset = nodes[index], constants.opset
        if len(node.input) != 2 or not all(node.input) or len(node.output) != 1:
            return  # malformed: ONNX Runtime refuses it
        if opset < _FIRST_DIV_KERNEL and not self._in_function:
            return  # ONNX Runtime has no kernel to run it
        # Every type either operand is declared (or inferred) with, in this graph and
        # the enclosing ones: ONNX Runtime ignores some declarations (a value_info of a
        # graph input), so one that disagrees with another decides nothing.
        elements = {e for name in node.input for m in types.maps for e in m.get(name, ())}
        after: list[onnx.NodeProto] = []
        if len(elements) == 1 and elements <= _MINIMUM.keys():
            before = self._known(node, elements.pop(), constants)
        elif len(elements) == 1:
            return  # a type whose division cannot trap
        elif opset >= _CASTLIKE:
            before, after = self._any_type(node, constants)
        else:
            unknown = (f"its operands are declared with different element types "
                       f"({', '.join(sorted(map(_type_name, elements)))})" if elements else
                       "its operands' element type is unknown")
            _unguardable(self._backend, self._refuse_unguardable,
                         f"the {node.op_type} node {_describe(node)} in {where} cannot be "
                         f"guarded: {unknown} and the model's opset {opset} predates "
                         f"CastLike ({_CASTLIKE})",
                         "declare the operands' types or use opset 15 or later")
            return
        for offset, new in enumerate(before):
            nodes.insert(index + offset, new)
        for offset, new in enumerate(after, start=index + len(before) + 1):
            nodes.insert(offset, new)
        self._changed = True

    def _known(self, node: onnx.NodeProto, element: int,
               constants: _Constants) -> list[onnx.NodeProto]:
        """Guard nodes for operands of type ``element`` (int32 or int64): the divisor of
        MIN / -1 becomes 1."""
        a, b = node.input
        guard: list[onnx.NodeProto] = []
        is_min = self.add(guard, "Equal", a, constants.get(element, _MINIMUM[element]))
        is_minus_one = self.add(guard, "Equal", b, constants.get(element, -1))
        both = self.add(guard, "And", is_min, is_minus_one)
        if constants.opset >= _WHERE:
            divisor = self.add(guard, "Where", both, constants.get(element, 1), b)
        else:  # b + 2 * flag: -1 + 2 is 1, b + 0 is b
            flag = self.add(guard, "Cast", both, to=element)
            step = self.add(guard, "Mul", flag, constants.get(element, 2))
            divisor = self.add(guard, "Add", b, step)
        node.input[1] = divisor
        return guard

    def _any_type(self, node: onnx.NodeProto, constants: _Constants
                  ) -> tuple[list[onnx.NodeProto], list[onnx.NodeProto]]:
        """Guard nodes (before, after ``node``) for operands of any type: ``s`` is -1
        where the divisor is -1 of a signed type (-1 cast to an unsigned type is its
        maximum, not below 0), else 1; the divisor becomes ``b * s`` and a Div's quotient
        is multiplied by ``s``."""
        b = node.input[1]
        before: list[onnx.NodeProto] = []
        minus_one, zero, one = (constants.get(_INT64, v) for v in (-1, 0, 1))
        typed_minus_one = self.add(before, "CastLike", minus_one, b)
        equal = self.add(before, "Equal", b, typed_minus_one)
        signed = self.add(before, "Less", typed_minus_one,
                           self.add(before, "CastLike", zero, b))
        negative = self.add(before, "And", equal, signed)
        sign = self.add(before, "CastLike", self.add(before, "Where", negative, minus_one, one),
                         b)
        node.input[1] = self.add(before, "Mul", b, sign)
        if node.op_type == "Mod":
            return before, []
        after: list[onnx.NodeProto] = []
        out = node.output[0]
        node.output[0] = quotient = self._fresh()
        self.add(after, "Mul", quotient, sign, output=out)
        return before, after

    def add(self, nodes: list[onnx.NodeProto], op_type: str, *inputs: str,
             output: str | None = None, **attributes: Any) -> str:
        """Append an ``op_type`` node of ``inputs`` to ``nodes``; its output's name (a
        fresh one unless ``output`` is given), which its node also takes."""
        from onnx import helper

        name = self._fresh()
        output = output or name
        nodes.append(helper.make_node(op_type, inputs, [output], name=name, **attributes))
        return output

    def _fresh(self) -> str:
        """A value name (also used as its node's name) no name in the model has."""
        while True:
            name = f"wasinn_{next(self._counter)}"
            if name not in self._names:
                self._names.add(name)
                return name


def _divides(node: onnx.NodeProto) -> bool:
    """Whether ``node`` is ONNX's own Div or Mod."""
    return node.op_type in _OPS and node.domain in _DEFAULT_DOMAINS


def _describe(node: onnx.NodeProto) -> str:
    return repr(node.name) if node.name else f"producing {node.output[0]!r}" if (
        node.output) else "(unnamed)"


def _default_opset(imports: Iterable[onnx.OperatorSetIdProto]) -> int | None:
    """The version of the default domain among ``imports``, None if it is not there."""
    versions = [i.version for i in imports if i.domain in _DEFAULT_DOMAINS]
    return max(versions) if versions else None


def _outline(graph: onnx.GraphProto) -> list[tuple[str, list[str], int]]:
    """Each node's operator, attribute names and subgraph count: what the walk pairs."""
    return [(n.op_type, [a.name for a in n.attribute],
             sum(a.HasField("g") + len(a.graphs) for a in n.attribute)) for n in graph.node]


def _declared(graph: onnx.GraphProto) -> dict[str, set[int]]:
    """The element types each tensor value ``graph`` declares (or inference gave it):
    more than one where its declarations disagree."""
    types: dict[str, set[int]] = {}
    for info in (*graph.input, *graph.output, *graph.value_info):
        element = info.type.tensor_type.elem_type
        if info.type.HasField("tensor_type") and element:
            types.setdefault(info.name, set()).add(element)
    for tensor in (*graph.initializer, *(s.values for s in graph.sparse_initializer)):
        types.setdefault(tensor.name, set()).add(tensor.data_type)
    return types


def _type_name(element: int) -> str:
    """The name of the TensorProto element type ``element`` (its number if it has none)."""
    from onnx import TensorProto

    try:
        return str(TensorProto.DataType.Name(element)).lower()
    except ValueError:
        return str(element)


def _subgraphs(nodes: Iterable[onnx.NodeProto]) -> Iterator[onnx.GraphProto]:
    for node in nodes:
        for attr in node.attribute:
            if attr.HasField("g"):
                yield attr.g
            yield from attr.graphs


def _graphs(roots: Iterable[onnx.GraphProto]) -> Iterator[onnx.GraphProto]:
    """``roots`` and every graph nested in their nodes, at any depth."""
    stack = list(roots)
    while stack:
        graph = stack.pop()
        yield graph
        stack.extend(_subgraphs(graph.node))


def _every_graph(model: onnx.ModelProto) -> Iterator[onnx.GraphProto]:
    """Every graph of ``model``: the main one, training graphs, functions' subgraphs."""
    roots = [model.graph]
    for info in model.training_info:
        roots += [info.initialization, info.algorithm]
    for function in model.functions:
        roots += _subgraphs(function.node)
    return _graphs(roots)


def _all_names(model: onnx.ModelProto) -> set[str]:
    """Every value, node and function name in ``model``."""
    names: set[str] = set()
    node_lists: list[Iterable[onnx.NodeProto]] = []
    for graph in _every_graph(model):
        names.update(v.name for v in (*graph.input, *graph.output, *graph.value_info))
        names.update(t.name for t in graph.initializer)
        names.update(s.values.name for s in graph.sparse_initializer)
        node_lists.append(graph.node)
    for function in model.functions:
        names.update((function.name, *function.input, *function.output))
        names.update(v.name for v in function.value_info)
        node_lists.append(function.node)
    for nodes in node_lists:
        for node in nodes:
            names.update((node.name, *node.input, *node.output))
    return names


def _tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every dense tensor in ``model``'s graphs and functions: initializers, sparse
    tensors' parts, attribute values (Constant nodes')."""
    node_lists: list[Iterable[onnx.NodeProto]] = [f.node for f in model.functions]
    for graph in _every_graph(model):
        yield from graph.initializer
        for sparse in graph.sparse_initializer:
            yield from (sparse.values, sparse.indices)
        node_lists.append(graph.node)
    for nodes in node_lists:
        for node in nodes:
            for attr in node.attribute:
                if attr.HasField("t"):
                    yield attr.t
                yield from attr.tensors
                for sparse in (*attr.sparse_tensors,
                               *([attr.sparse_tensor] if attr.HasField("sparse_tensor") else [])):
                    yield from (sparse.values, sparse.indices)


def _inferred(data: bytes, model: onnx.ModelProto) -> onnx.ModelProto:
    """``data``, parsed again without its large weights, after ONNX shape inference;
    ``model`` (``data`` parsed) if inference fails: its declared types are then all
    there is."""
    import onnx
    from onnx import shape_inference

    skeleton = onnx.ModelProto.FromString(data)
    for tensor in _tensors(skeleton):
        if math.prod(tensor.dims) > _CLEARED_ABOVE:
            tensor.ClearField("raw_data")
    try:
        return shape_inference.infer_shapes(skeleton, check_type=False, strict_mode=False)
    except Exception:  # a model inference cannot follow: unknown types, guarded generically
        return model
