"""Integer divisions that would crash the host, guarded in guests' PyTorch programs.

An x86-64 integer division traps (SIGFPE, which kills the process) when the divisor is
zero, and when the dividend is the type's minimum and the divisor -1: the quotient,
2**63, does not fit. Most of torch checks for zero, none of its kernels checks for the
overflow, and TorchScript's own integer operators check neither. Measured on torch 2.13,
these crash the host running a model, on values a guest chooses through its inputs:

- TorchScript's ``int`` (and ``Scalar``) operators ``%``, ``//``, ``divmod``,
  ``math.gcd`` and ``aten::__round_to_zero_floordiv``: on zero (``%``,
  ``__round_to_zero_floordiv``) and on ``-2**63`` by ``-1`` (all of them; for ``gcd``
  in either order, since Euclid's steps swap its operands);
- ``torch.div(a, b, rounding_mode="trunc")`` (and ``div_``, ``out=``) when the result is
  ``int32`` or ``int64``: on the minimum by ``-1``. Floor division, ``remainder`` and
  ``fmod`` of tensors return the wrapped result there and raise on zero.

So, as a guest's program is loaded and before anything runs it, each such division gets
a guard that raises ZeroDivisionError on a zero divisor (as Python and the rest of torch
do) and otherwise divides the minimum by 1 instead of -1: the quotient is then the
minimum itself, the two's-complement wrap of the true quotient, which is what numpy and
torch's floor division give, and every remainder by 1 or -1 is 0. A truncating division
by the Scalar -1 of an integer tensor becomes a floor division, which equals it there
and does not trap. A divisor that is a constant other than 0 and -1 needs no guard.

:func:`guard_torchscript_divisions` edits a TorchScript module's method graphs in place
(calls inlined first, so no function it calls is left unguarded; blocks and subgraph
attributes included), before it is frozen: freezing's constant folding of a division
by a constant zero would crash the host too, and folds the guards away where a divisor
is constant. :func:`guard_exported_divisions` swaps the operators of a ``torch.export``
program's fx graphs for guarded ones. The guards are TorchScript functions
(:func:`_guards`), so the two kinds of program share them.

A TorchScript archive's own code is compiled, its constant expressions folded, inside
``torch.jit.load``, before any graph exists to guard: :func:`check_folded_divisions`
reads the code first and finds a division whose operands may all be constants. Its
caller decides what becomes of such an archive (``refuse_unguardable``): in the host's
process it is refused (SecurityError, which names the way out: a sandboxed load); in a
sandboxed graph's own process (:func:`~.base.in_sandbox`) it is logged at debug level
(logger ``wasinn.backends``) and loaded, so a fold that traps ends only that process,
which the host reports as an invalid encoding ("the library crashed on it"). The guards
above apply to the graphs of an archive so loaded as to any other.

A tensor's integer division by zero is left to torch, which raises; :func:`divided_by_zero`
tells its error apart, so that a run reports it as the model's runtime error (the guards'
own ZeroDivisionError, on numbers, is one the model raised).
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable
from typing import Any

import torch

from wasinn.errors import InvalidEncodingError, SecurityError

from ._torch_ops import owned_nodes
from .base import RUN_IT_SANDBOXED, log

#: The guards, in TorchScript (``Union[int, float, complex]`` is TorchScript's Scalar).
#: Each returns the divisor (or rounding mode) to use instead of the one given, never 0:
#: where freezing folds a guard on a constant zero, the raise stays, and the division it
#: guards is folded with a divisor of 1, not executed on 0.
_GUARD_SOURCE = '''
def int_divisor(a: int, b: int) -> int:
    if b == 0 or (b == -1 and a == -9223372036854775807 - 1):
        if b == 0:
            raise ZeroDivisionError("integer division or modulo by zero")
        return 1
    return b

def scalar_divisor(a: Union[int, float, complex],
                   b: Union[int, float, complex]) -> Union[int, float, complex]:
    if isinstance(a, int) and isinstance(b, int):
        if b == 0 or (b == -1 and a == -9223372036854775807 - 1):
            if b == 0:
                raise ZeroDivisionError("integer division or modulo by zero")
            return 1
    return b

def gcd_operand(a: int, b: int) -> int:
    if (b == -1 and a == -9223372036854775807 - 1) or (
            a == -1 and b == -9223372036854775807 - 1):
        return 1
    return b

def trunc_divisor(a: Tensor, b: Tensor, rounding_mode: Optional[str]) -> Tensor:
    if rounding_mode is not None and rounding_mode == "trunc":
        dtype = torch.result_type(a, b)
        if dtype == torch.int64:
            return torch.where((b == -1) & (a == -9223372036854775807 - 1),
                               torch.ones_like(b), b)
        if dtype == torch.int32:
            return torch.where((b == -1) & (a == -2147483648), torch.ones_like(b), b)
    return b

def trunc_mode(a: Tensor, b: Union[int, float, complex],
               rounding_mode: Optional[str]) -> Optional[str]:
    if rounding_mode is not None and rounding_mode == "trunc" and isinstance(b, int):
        if b == -1 and not a.is_floating_point() and not a.is_complex():
            return "floor"
    return rounding_mode
'''


@functools.cache
def _guards() -> Any:
    """The compiled guards (about 30 ms: compiled once, when a program first needs them)."""
    return torch.jit.CompilationUnit(_GUARD_SOURCE)


#: TorchScript operators on numbers that divide: the guard for two ``int`` operands and
#: the one for Scalars (None: only ``int`` operands exist).
_NUMBER_DIVISIONS: dict[str, tuple[str, str | None]] = {
    "aten::remainder": ("int_divisor", "scalar_divisor"),
    "aten::floordiv": ("int_divisor", "scalar_divisor"),
    "aten::divmod": ("int_divisor", "scalar_divisor"),
    "aten::__round_to_zero_floordiv": ("int_divisor", None),
    "aten::gcd": ("gcd_operand", None),
}
_NUMBERS = frozenset({"int", "number"})  # number: a Scalar
#: ``torch.div`` with a rounding mode, in place or not: (self, other, rounding_mode[, out]).
_TENSOR_DIVISIONS = frozenset({"aten::div", "aten::div_"})


# -- TorchScript --------------------------------------------------------------------------


def guard_torchscript_divisions(module: torch.jit.ScriptModule) -> int:
    """Guard every trapping integer division in ``module``'s methods and its submodules'
    (see the module's docstring), in place; how many were guarded."""
    guarded = 0
    for sub in module.modules():
        methods: Any = sub._c  # a RecursiveScriptModule's C++ module
        for name in methods._method_names():
            graph = methods._get_method(name).graph
            torch._C._jit_pass_inline(graph)
            nodes = list(owned_nodes(graph))  # guards are inserted as it goes
            guarded += sum(_guard_script_node(owner, node) for owner, node in nodes)
    return guarded


def _guard_script_node(graph: Any, node: Any) -> bool:
    kind = node.kind()
    if kind not in _NUMBER_DIVISIONS and kind not in _TENSOR_DIVISIONS:
        return False  # most nodes: their inputs are not even read
    inputs = list(node.inputs())
    if kind in _NUMBER_DIVISIONS and len(inputs) == 2:
        types = [str(value.type()) for value in inputs]
        if not _NUMBERS.issuperset(types) or _safe_constant(inputs[1]):
            return False
        int_guard, scalar_guard = _NUMBER_DIVISIONS[kind]
        guard = int_guard if types == ["int", "int"] else scalar_guard
        if guard is None:
            return False
        _replace_input(graph, node, 1, guard, inputs[:2])
        return True
    if kind in _TENSOR_DIVISIONS and "rounding_mode" in str(node.schema()):
        if _constant(inputs[2]) in (None, "floor") or _safe_constant(inputs[1]):
            return False  # true or floor division, or by a constant: no trap
        divisor_type = str(inputs[1].type())
        if divisor_type == "Tensor":
            _replace_input(graph, node, 1, "trunc_divisor", inputs[:3])
        elif divisor_type in _NUMBERS:
            _replace_input(graph, node, 2, "trunc_mode", inputs[:3])
        else:
            return False
        return True
    return False


def _replace_input(graph: Any, node: Any, index: int, guard: str, args: list[Any]) -> None:
    """Make ``node`` take its input ``index`` from ``guard`` applied to ``args``,
    inserted right before it."""
    original = args[index]
    with graph.insert_point_guard(node):
        (value,) = graph.insertGraph(getattr(_guards(), guard).graph, args)
    value.setType(original.type())  # the guard returns the value or one of its type
    node.replaceInput(index, value)


_UNKNOWN = object()


def _constant(value: Any) -> Any:
    """The constant ``value`` holds, or _UNKNOWN."""
    if value.node().kind() != "prim::Constant":
        return _UNKNOWN
    try:
        return value.toIValue()
    except Exception:
        return _UNKNOWN


def _safe_constant(divisor: Any) -> bool:
    """Whether ``divisor`` is a constant number other than 0 and -1 (dividing by it
    cannot trap)."""
    constant = _constant(divisor)
    return isinstance(constant, (int, float)) and constant not in (0, -1)


# -- torch.export -------------------------------------------------------------------------


def _guarded(op: Any) -> Callable[..., Any]:
    """``op`` (a truncating division) with its divisor or rounding mode guarded; a
    program may pass a number where the schema says Tensor."""
    def guarded(a: Any, b: Any, *args: Any, **kwargs: Any) -> Any:
        mode = kwargs.get("rounding_mode")
        if isinstance(b, torch.Tensor):
            b = _guards().trunc_divisor(a, b, mode)
        elif mode is not None:
            kwargs["rounding_mode"] = _guards().trunc_mode(a, b, mode)
        return op(a, b, *args, **kwargs)
    guarded.__name__ = f"guarded_{op.__name__}".replace(".", "_")
    return guarded


def _export_guards() -> dict[Any, Callable[..., Any]]:
    aten: Any = torch.ops.aten
    return {getattr(packet, overload): _guarded(getattr(packet, overload))
            for packet in (aten.div, aten.div_) for overload in packet.overloads()
            if any(a.name == "rounding_mode"
                   for a in getattr(packet, overload)._schema.arguments)}


#: ATen's truncating divisions and their guarded stand-ins, for fx graphs.
_EXPORT_GUARDS = _export_guards()


def guard_exported_divisions(module: torch.nn.Module) -> int:
    """Swap every truncating division in the fx graphs of ``module`` (an exported
    program's ``module()``) for its guarded stand-in, in place; how many were swapped.
    Scalar arithmetic in a program's graph runs on Python's integers, which do not trap."""
    swapped = 0
    for graph_module in module.modules():
        if not isinstance(graph_module, torch.fx.GraphModule):
            continue
        changed = False
        for node in graph_module.graph.nodes:
            guard = _EXPORT_GUARDS.get(node.target) if node.op == "call_function" else None
            if guard is not None:
                node.target = guard
                swapped += 1
                changed = True
        if changed:
            graph_module.recompile()
    return swapped


# -- a run's division by zero -------------------------------------------------------------

#: What torch's CPU kernels raise on an integer tensor's zero divisor (floor and
#: truncating ``div``, ``floor_divide``, ``remainder``, ``fmod``; TorchScript's ``//`` and
#: ``%`` of tensors): a bare ``RuntimeError`` with this message, the last line of the
#: message once TorchScript's interpreter has put its traceback before it (there with
#: ``RuntimeError: `` in front).
_KERNEL_ZERO_DIVISION = "ZeroDivisionError"


def divided_by_zero(exc: BaseException) -> bool:
    """Whether ``exc``, raised by running a program, is torch's error for an integer
    tensor divided by zero: a runtime error of the model on the values it was given, not
    inputs it rejected. (The guards' own ZeroDivisionError, on ``int`` and Scalar
    operands, comes as a ``torch.jit.Error`` the model raised instead.)"""
    if not isinstance(exc, RuntimeError):
        return False
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return bool(lines) and lines[-1] in (_KERNEL_ZERO_DIVISION,
                                         f"RuntimeError: {_KERNEL_ZERO_DIVISION}")


# -- divisions torch.jit.load would fold ------------------------------------------------

#: The names TorchScript code calls integer divisions by (``torch.remainder``,
#: ``math.gcd``, ``ops.aten.__round_to_zero_floordiv`` ...).
_DIVIDING_CALLS = frozenset({
    "remainder", "floordiv", "floor_divide", "divmod", "gcd", "__round_to_zero_floordiv",
})


def check_folded_divisions(backend: str, sources: list[tuple[str, str]], *,
                           refuse_unguardable: bool) -> None:
    """SecurityError, where ``refuse_unguardable`` (in the host's process), if the
    TorchScript code in ``sources`` (file name, text) divides two values that may both be
    constants; else each function's first such division is logged at debug level and left
    to torch.

    ``torch.jit.load`` compiles an archive's code and folds its constant expressions
    as it does, before any graph exists to guard: a division of constants by 0, or of
    the minimum by -1, kills the host there. Code torch itself wrote has no such
    division (scripting folded it before saving), so any is refused there, without
    telling whether it would trap. A value may be a constant if it is a literal, an operation
    on such values, or a local name last assigned one (on some path); a function's
    arguments, attributes and what is assigned from them are not (their values come at
    run time, where the graph guards apply), nor is a name a loop assigns within the
    loop and after it (a loop-carried value). InvalidEncodingError for code that is not
    Python syntax (torch's parser takes a subset of it).
    """
    for name, source in sources:
        try:
            tree = ast.parse(source, filename=name)
        except (SyntaxError, ValueError) as exc:
            raise InvalidEncodingError(
                f"{backend}: cannot read the TorchScript code {name}: {exc}") from exc
        for function in ast.walk(tree):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                site = _folded_division(function)
                if site is None:
                    continue
                found = (f"the TorchScript code {name} divides constants in "
                         f"{function.name}() (line {getattr(site, 'lineno', '?')}: "
                         f"{ast.unparse(site)[:120]}): torch.jit.load would compute that "
                         "division as it compiles the code, where a zero divisor, or the "
                         "minimum by -1, kills the process")
                if refuse_unguardable:
                    raise SecurityError(
                        f"{backend}: {found}, so the archive is refused in the host's "
                        "process: expected the divisions of a model torch saved, whose "
                        f"constants it has folded already; or {RUN_IT_SANDBOXED}")
                log.debug("%s: %s: loaded all the same in this sandbox process (a crash "
                          "there ends only it, which the host reports as an error)",
                          backend, found)


def _folded_division(function: ast.FunctionDef | ast.AsyncFunctionDef) -> ast.AST | None:
    """The first division in ``function`` whose operands may all be constants there."""
    return _scan(function.body, set())  # its arguments come at run time


def _scan(statements: list[ast.stmt], constants: set[str]) -> ast.AST | None:
    """The first division in ``statements`` whose operands may all be constants, given
    the names that may hold a constant before them (``constants``, updated in place to
    those after them): an assignment makes its names constant or not, as its value is;
    after an ``if``, a name is one if it may be on either path; a name a loop assigns is
    carried from one iteration to the next (no constant) within and after the loop."""
    for statement in statements:
        for expression in _own_expressions(statement):
            site = _division(expression, constants)
            if site is not None:
                return site
        if isinstance(statement, ast.Assign):
            constant = _may_be_constant(statement.value, constants)
            for target in statement.targets:
                _assign(constants, _names(target), constant)
        elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
            _assign(constants, _names(statement.target),
                    _may_be_constant(statement.value, constants))
        elif isinstance(statement, ast.AugAssign):
            _assign(constants, _names(statement.target),
                    _may_be_constant(statement.target, constants)
                    and _may_be_constant(statement.value, constants))
        elif isinstance(statement, ast.If):
            body, orelse = set(constants), set(constants)
            site = _scan(statement.body, body) or _scan(statement.orelse, orelse)
            if site is not None:
                return site
            constants.clear()
            constants.update(body | orelse)
        elif isinstance(statement, (ast.For, ast.While)):
            carried = {n for node in ast.walk(statement) for n in _assigned(node)}
            constants -= carried
            site = _scan(statement.body, set(constants)) or _scan(statement.orelse,
                                                                  set(constants))
            if site is not None:
                return site
        elif isinstance(statement, ast.With):
            for item in statement.items:
                if item.optional_vars is not None:
                    _assign(constants, _names(item.optional_vars), False)
            site = _scan(statement.body, constants)
            if site is not None:
                return site
    return None


def _own_expressions(statement: ast.stmt) -> list[ast.AST]:
    """What ``statement`` evaluates itself, not the statements nested in it."""
    if isinstance(statement, ast.If | ast.While):
        return [statement.test]
    if isinstance(statement, ast.For):
        return [statement.iter]
    if isinstance(statement, ast.With):
        return [item.context_expr for item in statement.items]
    if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return []
    return [statement]


def _assigned(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Assign):
        return [n for target in node.targets for n in _names(target)]
    if isinstance(node, ast.AugAssign | ast.AnnAssign | ast.For):
        return _names(node.target)
    return []


def _assign(constants: set[str], names: list[str], constant: bool) -> None:
    if constant:
        constants.update(names)
    else:
        constants.difference_update(names)


def _division(expression: ast.AST, constants: set[str]) -> ast.AST | None:
    """The first integer division in ``expression`` whose operands may all be constants."""
    for node in ast.walk(expression):
        operands: list[ast.expr] = []
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod | ast.FloorDiv):
            if isinstance(node.left, ast.Constant) and isinstance(node.left.value, str):
                continue  # string formatting
            operands = [node.left, node.right]
        elif isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Mod | ast.FloorDiv):
            operands = [node.target, node.value]
        elif isinstance(node, ast.Call) and _callee(node.func) in _DIVIDING_CALLS:
            operands = list(node.args)
        if operands and all(_may_be_constant(o, constants) for o in operands):
            return node
    return None


def _names(target: ast.expr) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for element in target.elts for n in _names(element)]
    return []


def _callee(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _may_be_constant(expr: ast.expr, constants: set[str]) -> bool:
    """Whether TorchScript's constant folding could make ``expr`` a constant number."""
    if isinstance(expr, ast.Constant):
        return True
    if isinstance(expr, ast.Name):
        return expr.id in constants
    if isinstance(expr, ast.UnaryOp):
        return _may_be_constant(expr.operand, constants)
    if isinstance(expr, ast.BinOp):
        return _may_be_constant(expr.left, constants) and _may_be_constant(expr.right, constants)
    if isinstance(expr, (ast.BoolOp, ast.Tuple)):
        return all(_may_be_constant(v, constants)
                   for v in (expr.values if isinstance(expr, ast.BoolOp) else expr.elts))
    if isinstance(expr, ast.Compare):
        return all(_may_be_constant(v, constants) for v in (expr.left, *expr.comparators))
    if isinstance(expr, ast.IfExp):
        return all(_may_be_constant(v, constants) for v in (expr.test, expr.body, expr.orelse))
    if isinstance(expr, ast.Subscript):
        return _may_be_constant(expr.value, constants) and _may_be_constant(expr.slice,
                                                                           constants)
    if isinstance(expr, ast.Call):  # a pure operator of constants folds: torch.sub(1, 1)
        return all(_may_be_constant(a, constants) for a in expr.args) and all(
            _may_be_constant(k.value, constants) for k in expr.keywords)
    return False  # an attribute (self.d, CONSTANTS.c0), a list, a lambda ...
