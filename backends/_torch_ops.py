"""Which operators a guest's PyTorch program may call.

A TorchScript archive or ``torch.export`` program is code: besides tensor math, ATen and
TorchScript offer operators that read and write host files (``aten::from_file``,
``aten::save``), call other machines (``prim::rpc_*``, the ``c10d`` collectives), run
Python (``prim::PythonOp``), write to the host's stdout (``prim::Print``) or reseed the
random generator every model in the process shares (``aten::manual_seed``). A
``torch.export`` graph may even name any Python callable reachable from ``torch``,
``operator`` or ``math`` (``torch.os.system``): torch's deserializer puts whatever the
name resolves to into the graph. Guests' models may only compute on tensors, so:

- :func:`check_exported_program` walks every fx graph of a loaded program (control-flow
  branches included) and allows ATen and prims operators but the ones above, a listed
  set of higher-order operators (``cond``, ``while_loop``, ``map``, ...) and the scalar
  arithmetic torch's serializer itself emits (``operator.add``, ``torch.sym_max``, ...):
  anything else, a callable passed as an argument included, is refused.
- :func:`check_torchscript_module` walks every method of the module, with the functions
  and methods they call inlined (and every method of every submodule where a call is
  dispatched at run time), into every block and subgraph, and allows the namespaces
  TorchScript models use (``aten``, ``prim``, the quantized and prepacked kernels) but
  the operators above.
- :func:`check_torchscript_code` runs before ``torch.jit.load``: loading runs a class's
  ``__setstate__`` (TorchScript code) as it restores the object, before any graph can
  be walked. So every source file in the archive is scanned for the names through which
  TorchScript reaches the refused operators (``from_file``, ``save``, ...); a model
  whose code mentions one, even in a string, is refused. That over-refuses a model with
  an attribute called ``save``; it never lets a load-time call through, since
  TorchScript resolves operators by name only.

Each refusal is a SecurityError naming the operator. :func:`check_torchscript_code` also
refuses, as InvalidEncodingError, an archive whose pickles give a tensor more bytes than
its record holds: ``torch.jit.load`` does not compare the two, so the tensor would read
host memory past the record (an empty record crashed the host as the module was frozen).
"""

from __future__ import annotations

import io
import math
import operator
import pickle
import re
from collections.abc import Iterator
from typing import Any

import torch

from wasinn.errors import InvalidEncodingError, SecurityError

#: Operators that reach outside the model's tensors, whatever their namespace.
DENIED_OPS = frozenset({
    "aten::from_file",  # maps a host file (shared=True writes it back)
    "aten::save",  # TorchScript's torch.save: writes a host file
    "prim::rpc_sync", "prim::rpc_async", "prim::rpc_remote",  # torch.distributed.rpc
    "prim::PythonOp", "prim::IgnoredPythonOp",  # Python functions in the host
    "prim::Print", "aten::_print",  # the host's stdout
    "aten::manual_seed", "aten::seed",  # the RNG every model in the process shares
    "debugprims::load_tensor",
})
#: The only namespaces a torch.export program's operators may come from.
_EXPORT_NAMESPACES = frozenset({"aten", "prims"})
#: The namespaces of TorchScript graphs: ATen and TorchScript's own, plus the kernels
#: that quantization, freezing and optimize_for_inference put in.
_SCRIPT_NAMESPACES = frozenset({
    "aten", "prim", "prims", "quantized", "_quantized", "prepacked", "mkldnn",
    "mkldnn_prepacked", "onednn", "mkl",
})
#: Higher-order operators that only run subgraphs of the same program (themselves
#: checked) or an operator passed as an argument (checked as any other).
_HIGHER_ORDER = frozenset({
    "cond", "while_loop", "while_loop_stack_output", "map_impl", "scan",
    "associative_scan", "wrap_with_set_grad_enabled", "wrap_with_autocast",
    "invoke_subgraph", "auto_functionalized", "auto_functionalized_v2", "with_effects",
    "out_dtype", "hints_wrapper", "flex_attention",
})
#: The Python callables torch's serializer emits for shape arithmetic, and getitem.
_PYTHON_OPS: frozenset[object] = frozenset({
    operator.getitem, operator.add, operator.sub, operator.mul, operator.truediv,
    operator.floordiv, operator.mod, operator.pow, operator.neg, operator.pos,
    operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge,
    operator.and_, operator.or_, operator.lshift, operator.rshift, math.trunc,
    torch.sym_int, torch.sym_float, torch.sym_ite, torch.sym_max, torch.sym_min,
    torch.sym_not, torch.sym_sqrt,  # torch.sym_sqrt is torch._sym_sqrt
})
#: The names TorchScript source uses to reach the refused operators and namespaces.
_DENIED_NAMES = frozenset({
    "from_file", "save", "rpc_sync", "rpc_async", "rpc_remote", "load_tensor",
    "manual_seed", "PythonOp", "c10d", "_c10d_functional", "_c10d_functional_autograd",
    "symm_mem", "_dtensor",
})
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: Calls that inlining leaves in a graph: their callee is only known at run time.
_DYNAMIC_CALLS = frozenset({"prim::CallMethod", "prim::CallFunction"})


def _refuse(backend: str, what: str, expected: str) -> SecurityError:
    return SecurityError(
        f"{backend}: the model calls {what}, which a guest's model may not: {expected}"
    )


# -- torch.export -------------------------------------------------------------------------


def check_exported_program(backend: str, graph_module: torch.nn.Module) -> None:
    """SecurityError unless every node of every fx graph in ``graph_module`` calls an
    allowed operator (see the module's docstring) and passes no other callable.

    Call it on the program's own graph module, before ``ExportedProgram.module()``
    adds its input-guard submodule (code torch generates, not the guest).
    """
    for module in graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op in ("placeholder", "output", "get_attr"):
                continue
            if node.op != "call_function":
                raise _refuse(backend, f"{node.op} {node.target!r}",
                              "a torch.export graph calls functions only")
            _check_target(backend, node.target)
            for value in _leaves((node.args, node.kwargs)):
                if callable(value) and not isinstance(value, torch.fx.Node):
                    _check_target(backend, value)


def _check_target(backend: str, target: Any) -> None:
    if isinstance(target, torch._ops.OpOverload):
        name = str(target.name()).split(".")[0]  # type: ignore[no-untyped-call]
        if target.namespace not in _EXPORT_NAMESPACES or name in DENIED_OPS:
            raise _refuse(backend, name, "expected ATen or prims operators that compute "
                          "on tensors")
    elif isinstance(target, torch._ops.HigherOrderOperator):
        hop = str(target.name())  # type: ignore[no-untyped-call]
        if hop not in _HIGHER_ORDER:
            raise _refuse(backend, f"the higher-order operator {hop}",
                          f"expected one of {', '.join(sorted(_HIGHER_ORDER))}")
    elif not _is_python_op(target):
        name = f"{getattr(target, '__module__', None)}.{getattr(target, '__name__', target)}"
        raise _refuse(backend, f"the Python callable {name}",
                      "expected operators, or the shape arithmetic torch.export emits")


def _is_python_op(target: Any) -> bool:
    try:
        return target in _PYTHON_OPS
    except TypeError:  # unhashable: not one of them
        return False


def _leaves(value: Any) -> Iterator[Any]:
    """The non-container values in nested tuples, lists, dicts and slices."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, (tuple, list)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, slice):
            stack.extend((item.start, item.stop, item.step))
        else:
            yield item


# -- TorchScript --------------------------------------------------------------------------


def check_torchscript_code(backend: str, data: bytes) -> list[tuple[str, str]]:
    """SecurityError if a source file of the TorchScript archive ``data`` mentions a
    name through which TorchScript reaches a refused operator; InvalidEncodingError if
    the archive cannot be read, or a tensor its pickles describe needs more bytes than
    the record holding it. Returns the source files (name, text), for the other checks
    of the code (:func:`~._torch_division.check_folded_divisions`).

    Read with torch's own archive reader, so the files scanned are the ones
    ``torch.jit.load`` compiles.
    """
    try:
        reader = torch._C.PyTorchFileReader(io.BytesIO(data))
        names = reader.get_all_records()
        sources = [(name, reader.get_record(name)) for name in names if name.endswith(".py")]
    except Exception as exc:
        raise InvalidEncodingError(
            f"{backend}: cannot read the TorchScript archive: {exc}"
        ) from exc
    _check_storages(backend, reader, set(names))
    texts = [(name, bytes(source).decode("utf-8", "replace")) for name, source in sources]
    for name, text in texts:
        words = set(_WORD.findall(text))
        found = sorted(words & _DENIED_NAMES)
        if found:
            raise SecurityError(
                f"{backend}: the TorchScript code {name} mentions {', '.join(found)}, "
                "names of operators that reach outside the model (files, network, the "
                "host process), which a guest's model may not call: its code runs as "
                "the archive is loaded"
            )
    return texts


def _check_storages(backend: str, reader: Any, records: set[str]) -> None:
    """InvalidEncodingError unless every storage that ``data.pkl`` and ``constants.pkl``
    name (``('storage', torch.FloatStorage, key, device, elements)``, read from
    ``data/<key>`` and ``constants/<key>`` as ``torch.jit.load`` reads them) is a record
    holding at least its elements' bytes."""
    for folder in ("data", "constants"):
        if f"{folder}.pkl" not in records:
            continue
        refs = _StorageRefs(bytes(reader.get_record(f"{folder}.pkl")))
        try:
            refs.load()
        except Exception as exc:
            raise InvalidEncodingError(
                f"{backend}: cannot read {folder}.pkl in the TorchScript archive: {exc}"
            ) from exc
        for key, kind, elements in refs.storages:
            name = f"{folder}/{key}"
            itemsize = _STORAGE_ITEMSIZES.get(kind) if isinstance(kind, str) else None
            size = _record_size(reader, name) if name in records else None
            if itemsize is None or type(elements) is not int or elements < 0 \
                    or size is None or size < elements * itemsize:
                raise InvalidEncodingError(
                    f"{backend}: the TorchScript archive's {folder}.pkl gives storage "
                    f"{str(key)[:80]!r} {str(elements)[:20]} elements of {str(kind)[:40]}, "
                    f"but {name[:90]!r} " + ("is missing" if size is None
                                             else f"holds {size} bytes")
                    + ": expected a record holding them (torch would read past it)"
                )


def _record_size(reader: Any, name: str) -> int:
    """The size of record ``name`` as torch's reader sees it: asked directly where the
    reader can say (torch 2.13), else by reading the record (earlier releases)."""
    size = getattr(reader, "get_record_size", None)
    return int(size(name)) if size is not None else len(reader.get_record(name))


def _storage_itemsizes() -> dict[str, int]:
    """The element size of every storage class name TorchScript's pickler writes: the
    legacy names (``FloatStorage``, ``ComplexHalfStorage``) and, for later element types,
    the C++ type's (``Float8_e4m3fnStorage``, ``UInt16Storage``)."""
    sizes = {f"{name[6].upper()}{name[7:]}Storage".replace("Uint", "UInt"): dtype.itemsize
             for dtype in vars(torch).values() if isinstance(dtype, torch.dtype)
             for name in [str(dtype)]}
    sizes.update((name, dtype.itemsize)
                 for dtype, name in torch.storage._dtype_to_storage_type_map().items())
    sizes["ComplexHalfStorage"] = torch.complex32.itemsize
    return sizes


_STORAGE_ITEMSIZES = _storage_itemsizes()


class _Stand:
    """What every global of a pickle read by :class:`_StorageRefs` stands for, but the
    storage classes: it takes any arguments, state and items, and does nothing."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __setstate__(self, state: object) -> None:
        pass

    def __setitem__(self, key: object, value: object) -> None:
        pass

    def append(self, value: object) -> None:
        pass

    def extend(self, values: object) -> None:
        pass


class _StorageRefs(pickle.Unpickler):
    """Reads a TorchScript pickle without running anything of it (a global it names is
    :class:`_Stand`, a storage class its name), noting each storage it references as
    ``(key, class name, elements)``."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.storages: list[tuple[object, object, object]] = []

    def find_class(self, module: str, name: str) -> Any:
        return name if name.endswith("Storage") else _Stand

    def persistent_load(self, pid: Any) -> object:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unexpected persistent id {str(pid)[:80]}")
        self.storages.append((pid[2], pid[1], pid[4]))
        return _Stand()


def check_torchscript_module(backend: str, module: torch.jit.ScriptModule) -> None:
    """SecurityError unless every operator ``module``'s methods can run (see
    :func:`script_graphs`; blocks and subgraphs included) is allowed."""
    for graph in script_graphs(module):
        for node in graph_nodes(graph):
            kind = node.kind()
            if kind.split("::")[0] not in _SCRIPT_NAMESPACES or kind in DENIED_OPS:
                raise _refuse(backend, kind, "expected operators that compute on tensors")


def script_graphs(module: torch.jit.ScriptModule) -> list[torch.Graph]:
    """The graphs of ``module``'s methods with the functions and methods they call
    inlined: all the code they can run, unless a call could not be inlined (a method
    of an interface type, picked at run time); then the graphs of every method of every
    submodule as well."""
    graphs = _inlined_methods(module)
    if any(node.kind() in _DYNAMIC_CALLS for graph in graphs for node in graph_nodes(graph)):
        for sub in module.modules():
            if sub is not module:
                graphs += _inlined_methods(sub)
    return graphs


def _inlined_methods(module: torch.nn.Module) -> list[torch.Graph]:
    methods: Any = module._c  # a RecursiveScriptModule's C++ module
    return [methods._get_method(name).inlined_graph for name in methods._method_names()]


def graph_nodes(graph: torch.Graph) -> Iterator[torch.Node]:
    """Every node of ``graph``: those in blocks (if, loop) and in subgraph attributes
    (``prim::fork``, fusion groups) too."""
    return (node for _, node in owned_nodes(graph))


def owned_nodes(graph: torch.Graph) -> Iterator[tuple[torch.Graph, torch.Node]]:
    """Every node of ``graph`` as :func:`graph_nodes` walks them, each with the graph
    that holds it (``graph`` itself, or the subgraph attribute it is in): where a node
    must be inserted before it."""
    stack = [(graph, iter(graph.nodes()))]
    while stack:
        owner, nodes = stack[-1]
        node = next(nodes, None)
        if node is None:
            stack.pop()
            continue
        yield owner, node
        stack.extend((owner, iter(block.nodes())) for block in node.blocks())
        for attr in node.attributeNames():
            kind = node.kindOf(attr)
            if kind == "g":
                stack.append((node.g(attr), iter(node.g(attr).nodes())))
            elif kind == "gs":
                stack.extend((g, iter(g.nodes())) for g in node.gs(attr))
