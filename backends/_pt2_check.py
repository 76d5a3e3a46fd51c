"""Refusing ``torch.export`` archives (``.pt2``) that would run host code as they load.

``torch.export.load`` trusts its input (its documentation says never to load one from an
untrusted source), and a guest's ``load`` hands the host arbitrary bytes. Reading torch
2.13's loader (``torch/export/__init__.py``, ``export/pt2_archive/_package.py``,
``_export/serde/serialize.py``, ``export/_unlift.py``, ``utils/_pytree.py``) finds these
ways from an archive's bytes to host code, each closed here before torch reads it:

- pickles: a weight or constant whose config entry says ``use_pickle`` is read with
  ``torch.load(weights_only=False)``; a constant named ``custom_obj_*`` with
  ``torch._C._pickle_load_obj``, one named ``opaque_obj_*`` with ``pickle.loads``;
  legacy ``data/weights/<model>.pt`` and ``data/constants/<model>.pt`` files, and the
  sample inputs ``data/sample_inputs/<model>.pt``, with ``torch.load`` that falls back
  to ``weights_only=False`` when the safe load fails; an archive in the 2.7 format (a
  top-level ``version`` file) is read with the same fallback. So: only the records a
  plain ``torch.export.save`` writes are accepted (weights ``weight_N``, constants
  ``tensor_N``, no AOTInductor shared libraries), every payload entry must say
  ``use_pickle: false``, and the sample inputs must load with ``weights_only=True``
  and hold only tensors, numbers and identifier-keyed dicts.
- ``sympy.sympify`` (an ``eval``) of every symbolic expression (``expr_str``): accepted
  only in the forms sympy's ``srepr`` prints (calls of listed sympy and torch functions
  on symbols, numbers and each other), with small literal exponents.
- ``exec`` of generated Python: the input guards (``guards_code``, checked as
  comparisons of ``L['x'].size()[0]``-style paths and numbers), and fx code generated
  from the names in the program (node, argument and input names must be identifiers;
  qualified names such as parameters' and operators' dotted identifiers); the input
  and output tree specs may only be tuples, lists and dicts keyed by identifiers (a
  spec can otherwise import any module: enums, ``defaultdict`` factories).

Node targets are not checked here: they are resolved but not called while loading, and
:mod:`._torch_ops` checks the loaded graphs. Records are read with torch's own archive
reader (``torch._C.PyTorchFileReader``) and decoded as torch decodes them, so the bytes
checked are the bytes torch loads; the top-level layout is read with Python's zipfile,
as torch's 2.7-format fallback reads it. The checks were written against torch 2.13; a
test fails on another version so that they are reviewed again.
"""

from __future__ import annotations

import ast
import io
import json
import re
import zipfile
from collections.abc import Callable, Iterable
from typing import Any

import torch

from wasinn.errors import InvalidEncodingError, SecurityError

#: The torch release whose loader these checks were written against.
AUDITED_TORCH = "2.13."

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DOTTED = re.compile(r"[A-Za-z0-9_.]*")
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_FIXED_RECORDS = frozenset({
    "archive_format", "archive_version", "byteorder", ".data/version",
    ".data/serialization_id",
})
_RECORD_PATTERNS = tuple(re.compile(p) for p in (
    r"models/[A-Za-z0-9_]+\.json",
    r"data/weights/[A-Za-z0-9_]+_weights_config\.json", r"data/weights/weight_\d+",
    r"data/constants/[A-Za-z0-9_]+_constants_config\.json", r"data/constants/tensor_\d+",
    r"data/sample_inputs/[A-Za-z0-9_]+\.pt", r"extra/[^/]+",
))
_MODEL = re.compile(r"models/([A-Za-z0-9_]+)\.json")

#: Keys whose strings may be dotted names (qualified parameter names, operator names).
_DOTTED_KEYS = frozenset({
    "target", "as_operator", "fqn", "parameter_name", "buffer_name",
    "tensor_constant_name", "custom_obj_name", "class_fqn",
})
#: Keys whose strings are data, never code: string arguments (written with repr()).
_TEXT_KEYS = frozenset({"as_string", "as_strings", "torch_version"})
#: Dicts whose keys may be dotted names.
_DOTTED_KEY_DICTS = frozenset({"treespec_namedtuple_fields", "as_string_to_argument"})
_TREESPEC_TYPES = frozenset({
    None, "builtins.tuple", "builtins.list", "builtins.dict", "collections.OrderedDict",
})

#: The sympy and torch functions ``srepr`` prints in export's symbolic expressions.
_SYMPY_CALLS = frozenset({
    "Symbol", "Integer", "Rational", "Float", "Add", "Mul", "Pow", "Mod", "Max", "Min",
    "Abs", "floor", "ceiling", "sign", "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "Equality",
    "Unequality", "StrictLessThan", "StrictGreaterThan", "LessThan", "GreaterThan",
    "And", "Or", "Not", "Piecewise", "ExprCondPair", "Infinity", "NegativeInfinity",
    "IntInfinity", "NegativeIntInfinity", "BooleanTrue", "BooleanFalse",
    # torch.utils._sympy.functions, as the deserializer names them
    "FloorDiv", "ModularIndexing", "Where", "PythonMod", "CleanDiv", "CeilToInt",
    "FloorToInt", "CeilDiv", "LShift", "RShift", "PowByNatural", "FloatPow",
    "FloatTrueDiv", "IntTrueDiv", "IsNonOverlappingAndDenseIndicator", "TruncToFloat",
    "TruncToInt", "RoundToInt", "RoundDecimal", "ToFloat", "Identity",
})
_SYMPY_NAMES = frozenset({"oo", "zoo", "nan", "int_oo", "true", "false"})
_POWERS = frozenset({"Pow", "PowByNatural", "FloatPow"})
_ASSUMPTIONS = frozenset({
    "positive", "negative", "nonnegative", "nonpositive", "integer", "real", "finite",
    "infinite", "zero", "nonzero", "rational", "even", "odd", "commutative",
    "extended_real", "precision",
})
#: Functions and tensor methods guards may call (export's SYMPY_INTERP names).
_GUARD_CALLS = frozenset({
    "Max", "Min", "Abs", "FloorDiv", "CeilDiv", "PythonMod", "Mod", "IntTrueDiv",
    "FloatTrueDiv", "TruncToInt", "CeilToInt", "FloorToInt", "ToFloat",
})
_GUARD_METHODS = frozenset({"size", "stride", "storage_offset", "dim", "numel"})
_BIG = 2**64
_MAX_EXPONENT = 64
_MAX_EXPRESSION = 10_000
#: How deep an expression's nodes may nest (a sum of N terms nests N deep; torch.export's
#: are a few levels deep): the checks walk them without recursion, torch would not.
_MAX_DEPTH = 200


def check_pt2_archive(backend: str, data: bytes) -> None:
    """Raise unless ``data`` is an archive that ``torch.export.load`` reads without
    running host code (see the module's docstring).

    SecurityError for what could run code (a pickle, an unlisted record, an expression
    or name outside the accepted forms), naming it; InvalidEncodingError for an archive
    that cannot be read.
    """
    _check_zip_layout(backend, data)
    try:
        reader = torch._C.PyTorchFileReader(io.BytesIO(data))
        records = set(reader.get_all_records())
    except Exception as exc:
        raise InvalidEncodingError(f"{backend}: cannot read the .pt2 archive: {exc}") from exc
    for model in _check_records(backend, records):
        for config, prefix in ((f"data/weights/{model}_weights_config.json", "weight_"),
                               (f"data/constants/{model}_constants_config.json", "tensor_")):
            _check_payloads(backend, config, _read_json(backend, reader, records, config),
                            prefix)
        _check_program(backend, _read_json(backend, reader, records, f"models/{model}.json"))
        inputs = f"data/sample_inputs/{model}.pt"
        if inputs in records:
            _check_sample_inputs(backend, bytes(reader.get_record(inputs)))


def _check_zip_layout(backend: str, data: bytes) -> None:
    """Every file inside one top-level folder: torch reads an archive with a top-level
    ``version`` file (with Python's zipfile) in the 2.7 format, whose pickles load
    unchecked."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            names = archive.namelist()
    except Exception as exc:
        raise InvalidEncodingError(f"{backend}: cannot read the .pt2 archive: {exc}") from exc
    top = {name.split("/", 1)[0] for name in names}
    outside = sorted(name for name in names if "/" not in name) or sorted(top)
    if len(top) != 1 or any("/" not in name for name in names):
        raise SecurityError(
            f"{backend}: the .pt2 archive has files outside one top-level folder "
            f"({', '.join(outside[:5])}): expected the layout torch.export.save writes"
        )


def _check_records(backend: str, records: set[str]) -> list[str]:
    """The archive's model names; SecurityError for a record torch.export.save does not
    write for a plain program."""
    for name in sorted(records):
        if name not in _FIXED_RECORDS and not any(p.fullmatch(name)
                                                  for p in _RECORD_PATTERNS):
            raise SecurityError(
                f"{backend}: the .pt2 archive holds {name!r}: expected only what "
                "torch.export.save writes for a plain program (models/*.json, weights "
                "weight_N, constants tensor_N, their configs, sample inputs, extra/); "
                "pickled payloads, legacy .pt weights and AOTInductor libraries are refused"
            )
    return [m.group(1) for name in sorted(records) if (m := _MODEL.fullmatch(name))]


def _read_json(backend: str, reader: Any, records: set[str], name: str) -> Any:
    """The JSON record ``name`` decoded as torch decodes it (UTF-8); None where it is
    missing (torch then fails on its own); InvalidEncodingError where it does not parse."""
    if name not in records:
        return None
    try:
        return json.loads(bytes(reader.get_record(name)).decode("utf-8"))
    except Exception as exc:
        raise InvalidEncodingError(
            f"{backend}: cannot read {name} in the .pt2 archive: {exc}"
        ) from exc


def _check_payloads(backend: str, where: str, config: Any, prefix: str) -> None:
    """Every weight or constant is a raw tensor file (``use_pickle: false``)."""
    if config is None:
        return
    entries = config.get("config") if isinstance(config, dict) else None
    if not isinstance(entries, dict):
        raise InvalidEncodingError(f"{backend}: {where} has no 'config' mapping")
    for fqn, meta in entries.items():
        if not isinstance(meta, dict) or meta.get("use_pickle") is not False:
            raise SecurityError(
                f"{backend}: {where} stores {fqn!r} as a pickle (use_pickle), which "
                "would run code as it loads: expected raw tensor data (use_pickle: false)"
            )
        path = meta.get("path_name")
        if not isinstance(path, str) or not re.fullmatch(re.escape(prefix) + r"\d+", path):
            raise SecurityError(
                f"{backend}: {where} stores {fqn!r} in {path!r}: expected a raw tensor "
                f"file {prefix}N (custom and opaque objects are pickles)"
            )


def _check_sample_inputs(backend: str, data: bytes) -> None:
    """The sample inputs load with torch's restricted unpickler (so torch's own first
    attempt succeeds and its unrestricted fallback is never reached) and hold tensors,
    numbers and dicts keyed by identifiers (the keys become code in the input guards
    torch generates)."""
    if not data:
        return
    try:
        value = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:
        raise SecurityError(
            f"{backend}: the .pt2 archive's sample inputs are not plain tensors "
            f"(torch.load(weights_only=True) refuses them: {str(exc).splitlines()[0]}): "
            "torch would unpickle them unrestricted"
        ) from exc
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, (tuple, list)):
            stack.extend(item)
        elif isinstance(item, dict):
            for key in item:
                if not (isinstance(key, str) and _IDENT.fullmatch(key)):
                    raise SecurityError(
                        f"{backend}: the .pt2 archive's sample inputs have the key "
                        f"{key!r}: expected identifiers"
                    )
            stack.extend(item.values())
        elif not isinstance(item, (torch.Tensor, int, float, bool, type(None))):
            raise SecurityError(f"{backend}: the .pt2 archive's sample inputs hold a "
                                f"{type(item).__name__}: expected tensors and numbers")


def _check_program(backend: str, doc: Any) -> None:
    """Every string of a serialized program in the form its key allows."""
    checked: set[tuple[str, str]] = set()  # a graph repeats its expressions and names
    stack: list[tuple[Any, str]] = [(doc, "")]
    while stack:
        value, key = stack.pop()
        if isinstance(value, dict):
            for k, v in value.items():
                _check_name(backend, key, k, dotted=key in _DOTTED_KEY_DICTS)
                if key != "metadata":  # stack traces and module paths: kept, not run
                    stack.append((v, k))
        elif isinstance(value, list):
            stack.extend((v, key) for v in value)
        elif isinstance(value, str) and (key, value) not in checked:
            checked.add((key, value))
            _check_string(backend, key, value)


def _check_string(backend: str, key: str, value: str) -> None:
    if key in _TEXT_KEYS:
        return
    if key == "expr_str":
        _check_expression(backend, value, _sympy_node, "a symbolic expression")
    elif key == "guards_code":
        _check_expression(backend, value, _guard_node, "an input guard")
    elif key in ("in_spec", "out_spec"):
        _check_treespec(backend, key, value)
    else:
        _check_name(backend, key, value, dotted=key in _DOTTED_KEYS)


def _check_name(backend: str, key: str, value: str, *, dotted: bool) -> None:
    ok = _DOTTED.fullmatch(value) if dotted else (not value or _IDENT.fullmatch(value))
    if not ok:
        raise SecurityError(
            f"{backend}: the .pt2 program has {key or 'a key'} {value[:80]!r}: expected "
            f"{'a dotted name' if dotted else 'an identifier'} (names become Python code "
            "when torch rebuilds the graph)"
        )


def _check_treespec(backend: str, key: str, text: str) -> None:
    """Tuples, lists and dicts keyed by identifiers or integers (the keys become code)."""
    try:
        protocol, root = json.loads(text)
    except Exception:
        protocol, root = None, None
    if protocol != 1 or not isinstance(root, dict):
        raise SecurityError(f"{backend}: the .pt2 program's {key} is not a tree spec")
    stack = [root]
    while stack:
        node = stack.pop()
        kind = node.get("type") if isinstance(node, dict) else "?"
        context = node.get("context") if isinstance(node, dict) else None
        if not (kind in _TREESPEC_TYPES and _identifier_keys(context)):
            raise SecurityError(
                f"{backend}: the .pt2 program's {key} has a {kind} node with context "
                f"{str(context)[:80]!r}: expected tuples, lists and dicts keyed by "
                "identifiers (other kinds import Python modules as they load)"
            )
        stack.extend(node.get("children_spec") or ())


def _identifier_keys(context: object) -> bool:
    """A tree spec node's context (JSON text) is null or a list of identifiers and
    integers: a dict's keys."""
    try:
        keys = json.loads(context) if isinstance(context, str) else context
    except (ValueError, RecursionError):
        return False
    if keys is None:
        return True
    return isinstance(keys, list) and all(
        type(k) is int or (isinstance(k, str) and _IDENT.fullmatch(k)) for k in keys)


def _check_expression(backend: str, text: str, rule: _Rule, what: str) -> None:
    """``text`` parses as one Python expression every node of which ``rule`` allows,
    nested at most :data:`_MAX_DEPTH` deep (SecurityError otherwise)."""
    try:
        tree = ast.parse(text, mode="eval") if len(text) <= _MAX_EXPRESSION else None
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        tree = None
    verdict = "unreadable" if tree is None else _allowed(tree.body, rule)
    if verdict == "deep":
        raise SecurityError(
            f"{backend}: the .pt2 program has {what} {text[:120]!r} nested more than "
            f"{_MAX_DEPTH} levels deep, beyond the forms torch.export writes: refused, "
            "since torch evaluates it as Python code")
    if verdict is not None:
        raise SecurityError(
            f"{backend}: the .pt2 program has {what} {text[:120]!r} outside the forms "
            "torch.export writes: refused, since torch evaluates it as Python code"
        )


#: What a rule makes of one node of an expression: None where it is not allowed, else
#: its children to check, each with the rule for it (the walk goes no deeper by itself).
_Rule = Callable[[ast.AST], "Iterable[tuple[ast.AST, Any]] | None"]


def _allowed(root: ast.AST, rule: _Rule) -> str | None:
    """None where ``rule`` allows ``root`` and, by the rules it names for them, every
    node below it; "deep" where they nest deeper than :data:`_MAX_DEPTH`, "form" where
    a node is not allowed. Walked with an explicit stack: however deep the expression,
    no recursion."""
    stack: list[tuple[ast.AST, _Rule, int]] = [(root, rule, 1)]
    while stack:
        node, node_rule, depth = stack.pop()
        if depth > _MAX_DEPTH:
            return "deep"
        children = node_rule(node)
        if children is None:
            return "form"
        stack.extend((child, child_rule, depth + 1) for child, child_rule in children)
    return None


_NONE: tuple[tuple[ast.AST, _Rule], ...] = ()


def _sympy_node(node: ast.AST) -> Iterable[tuple[ast.AST, _Rule]] | None:
    """What ``srepr`` prints: listed calls of numbers, symbols and each other."""
    if isinstance(node, ast.Constant):
        return _NONE if _small_number(node.value) else None
    if isinstance(node, ast.Name):
        return _NONE if node.id in _SYMPY_NAMES else None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return [(node.operand, _sympy_node)]
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in _SYMPY_CALLS):
        return None
    name, args = node.func.id, node.args
    if not all(k.arg in _ASSUMPTIONS and isinstance(k.value, ast.Constant)
               and isinstance(k.value.value, (bool, int)) for k in node.keywords):
        return None
    if name in ("Symbol", "Float") and args and isinstance(args[0], ast.Constant) \
            and isinstance(args[0].value, str):
        pattern = _IDENT if name == "Symbol" else _NUMBER
        return _NONE if len(args) == 1 and pattern.fullmatch(args[0].value) else None
    children: list[tuple[ast.AST, _Rule]] = [(a, _sympy_node) for a in args]
    if name in _POWERS:  # 10 ** 10 ** 9 would hang the host
        if len(args) != 2:
            return None
        children.append((args[1], _small_exponent))
    return children


def _small_number(value: object) -> bool:
    if isinstance(value, bool) or value is None:
        return True
    if isinstance(value, (int, float)):
        return abs(value) <= _BIG
    return False


def _small_exponent(node: ast.AST) -> Iterable[tuple[ast.AST, _Rule]] | None:
    """A literal integer of at most :data:`_MAX_EXPONENT`, negated or not, or
    ``Integer``/``Rational`` of such."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
            and node.func.id in ("Integer", "Rational") and not node.keywords:
        return [(a, _small_exponent) for a in node.args]
    if (isinstance(node, ast.Constant) and isinstance(node.value, int)
            and abs(node.value) <= _MAX_EXPONENT):
        return _NONE
    return None


def _guard_node(node: ast.AST) -> Iterable[tuple[ast.AST, _Rule]] | None:
    """Comparisons and arithmetic of numbers and input sizes (``L['x'].size()[0]``)."""
    if isinstance(node, ast.Constant):
        return _NONE if not isinstance(node.value, str) and _small_number(node.value) else None
    if isinstance(node, ast.BoolOp):
        return [(v, _guard_node) for v in node.values]
    if isinstance(node, ast.UnaryOp):
        ok = isinstance(node.op, (ast.Not, ast.USub, ast.UAdd))
        return [(node.operand, _guard_node)] if ok else None
    if isinstance(node, ast.BinOp):
        if isinstance(node.op, ast.Pow):
            return [(node.left, _guard_node), (node.right, _small_exponent)]
        if isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod)):
            return [(node.left, _guard_node), (node.right, _guard_node)]
        return None
    if isinstance(node, ast.Compare):
        return [(v, _guard_node) for v in (node.left, *node.comparators)]
    if isinstance(node, ast.Call):
        if node.keywords:
            return None
        if isinstance(node.func, ast.Name) and node.func.id in _GUARD_CALLS:
            return [(a, _guard_node) for a in node.args]
        ok = (isinstance(node.func, ast.Attribute) and node.func.attr in _GUARD_METHODS
              and _input_path(node.func.value)
              and all(isinstance(a, ast.Constant) and type(a.value) is int
                      for a in node.args))
        return _NONE if ok else None
    if isinstance(node, ast.Subscript):
        if _input_path(node):
            return _NONE
        if (isinstance(node.value, ast.Call) and isinstance(node.slice, ast.Constant)
                and type(node.slice.value) is int):
            return [(node.value, _guard_node)]
    return None


def _input_path(node: ast.AST) -> bool:
    """``L['x']``, ``L['x'][0]``, ``L['x']['k']``: identifier keys and integer indices."""
    while isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        key = node.slice.value
        if not (type(key) is int or (isinstance(key, str) and _IDENT.fullmatch(key))):
            return False
        if isinstance(node.value, ast.Name):
            return node.value.id == "L" and isinstance(key, str)
        node = node.value
    return False
