"""Integer division overflow in ONNX Runtime, and the guard that keeps it from the host.

ONNX Runtime's CPU Div and Mod kernels divide int32 and int64 elements with C++'s ``/``
and ``%``: the type's minimum by -1 traps, and the whole process died of SIGFPE, at run
time or (both operands constant) while the session was built. Every computation that did
so runs here in a child process, so that a regression fails its test instead of killing
pytest; values that cannot trap, and the guard's rewrites, are checked in this process.
What cannot be guarded is refused in the host's process, and runs unguarded in a
sandboxed graph's process, where the trap ends only that process (the last tests).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import wasinn
from tests.support import cpu_pool, require_backend
from tests.tfmodels import varint
from wasinn import BackendRuntimeError, GraphEncoding, Tensor, UnsupportedOperationError
from wasinn.backends import Device, LoadOptions
from wasinn.modelgen import affine_onnx, onnx_model_bytes

pytestmark = pytest.mark.usefixtures("_ort")

CPU = Device.parse("cpu")
NAME = "onnxruntime"
DOMAIN = "wasinn.test"  # the model-local functions' domain
Arrays = dict[str, np.ndarray[Any, Any]]


@pytest.fixture
def _ort() -> None:
    require_backend("onnxruntime")
    require_backend("onnx")


@pytest.fixture
def backend() -> Any:
    from wasinn.backends.onnxruntime import OnnxRuntimeBackend

    return OnnxRuntimeBackend()


def _guard(data: bytes, *, refuse_unguardable: bool = True) -> bytes:
    """``data`` guarded as in the host's process (``refuse_unguardable``), or as in a
    sandbox process."""
    from wasinn.backends._onnx_division import guard_integer_division

    return guard_integer_division(NAME, data, refuse_unguardable=refuse_unguardable)


# -- models ------------------------------------------------------------------------------
def _element(dtype: Any) -> int:
    from onnx import helper

    return int(helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))


def _binary(op: str, dtype: Any, shape_a: list[int], shape_b: list[int], opset: int = 17,
            **attrs: Any) -> bytes:
    """``y = op(a, b)`` in the main graph, the operands of a declared type."""
    from onnx import helper

    element = _element(dtype)
    shape = list(np.broadcast_shapes(tuple(shape_a), tuple(shape_b)))
    graph = helper.make_graph(
        [helper.make_node(op, ["a", "b"], ["y"], **attrs)], "binary",
        [helper.make_tensor_value_info("a", element, shape_a),
         helper.make_tensor_value_info("b", element, shape_b)],
        [helper.make_tensor_value_info("y", element, shape)])
    return onnx_model_bytes(graph, opset)


def _in_function(op: str, dtype: Any, size: int, opset: int = 17, **attrs: Any) -> bytes:
    """``y = op(a, b)`` inside a model-local function, whose inputs have no type."""
    from onnx import helper

    element = _element(dtype)
    function = helper.make_function(DOMAIN, "Divide", ["x", "z"], ["q"],
                                    [helper.make_node(op, ["x", "z"], ["q"], **attrs)],
                                    [helper.make_opsetid("", opset)])
    graph = helper.make_graph(
        [helper.make_node("Divide", ["a", "b"], ["y"], domain=DOMAIN)], "call",
        [helper.make_tensor_value_info(n, element, [size]) for n in "ab"],
        [helper.make_tensor_value_info("y", element, [size])])
    model = helper.make_model(graph, functions=[function], opset_imports=[
        helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, 1)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


def _constant_operands() -> bytes:
    """``y = MIN / -1 + x`` over int64[1], MIN and -1 initializers: folded at load."""
    from onnx import TensorProto, helper, numpy_helper

    minimum = numpy_helper.from_array(np.array([np.iinfo(np.int64).min]), "minimum")
    minus_one = numpy_helper.from_array(np.array([-1]), "minus_one")
    graph = helper.make_graph(
        [helper.make_node("Div", ["minimum", "minus_one"], ["q"]),
         helper.make_node("Add", ["q", "x"], ["y"])], "folded",
        [helper.make_tensor_value_info("x", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, [1])],
        initializer=[minimum, minus_one])
    return onnx_model_bytes(graph)


def _in_if() -> bytes:
    """``y = a / b if flag else a``, the Div in the If's then-branch (outer-scope a, b)."""
    from onnx import TensorProto, helper

    i64 = TensorProto.INT64
    then = helper.make_graph([helper.make_node("Div", ["a", "b"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", i64, [3])])
    other = helper.make_graph([helper.make_node("Identity", ["a"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", i64, [3])])
    graph = helper.make_graph(
        [helper.make_node("Cast", ["flag"], ["cond"], to=TensorProto.BOOL),
         helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)], "if",
        [helper.make_tensor_value_info("flag", i64, []),
         *(helper.make_tensor_value_info(n, i64, [3]) for n in "ab")],
        [helper.make_tensor_value_info("y", i64, [3])])
    return onnx_model_bytes(graph)


def _in_loop() -> bytes:
    """``y = a / b`` as one iteration of a Loop whose body divides its carried value."""
    from onnx import TensorProto, helper, numpy_helper

    i64 = TensorProto.INT64
    body = helper.make_graph(
        [helper.make_node("Identity", ["c_in"], ["c_out"]),
         helper.make_node("Div", ["v_in", "b"], ["v_out"])], "body",
        [helper.make_tensor_value_info("i", i64, []),
         helper.make_tensor_value_info("c_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_in", i64, None)],
        [helper.make_tensor_value_info("c_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_out", i64, None)])
    graph = helper.make_graph(
        [helper.make_node("Loop", ["trips", "", "a"], ["y"], body=body)], "loop",
        [helper.make_tensor_value_info(n, i64, [3]) for n in "ab"],
        [helper.make_tensor_value_info("y", i64, [3])],
        initializer=[numpy_helper.from_array(np.array(1, np.int64), "trips")])
    return onnx_model_bytes(graph)


# -- expected values ----------------------------------------------------------------------
def _expected(op: str, a: np.ndarray[Any, Any], b: np.ndarray[Any, Any],
              fmod: int = 0) -> np.ndarray[Any, Any]:
    """ONNX's integer Div (truncating) or Mod (the divisor's sign; with ``fmod`` the
    dividend's, as C's fmod), wrapped to the type as two's complement (MIN / -1 is MIN)."""
    bits = int(a.dtype.itemsize) * 8
    signed = np.issubdtype(a.dtype, np.signedinteger)

    def one(x: int, y: int) -> int:
        if op == "Div":
            q = abs(x) // abs(y)
            r = q if (x < 0) == (y < 0) else -q
        elif fmod:
            r = abs(x) % abs(y) * (-1 if x < 0 else 1)
        else:
            r = x % y
        if not signed:
            return r
        return (r + (1 << (bits - 1))) % (1 << bits) - (1 << (bits - 1))

    wide_a, wide_b = np.broadcast_arrays(a, b)
    values = [one(int(x), int(y)) for x, y in zip(wide_a.ravel(), wide_b.ravel(), strict=True)]
    return np.array(values, a.dtype).reshape(wide_a.shape)


def _traps(dtype: Any) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Operands with MIN / -1 among ordinary pairs, first and last: ONNX Runtime divides
    int32 vectors in SIMD packets (through double, no trap) and the rest one by one."""
    minimum = np.iinfo(dtype).min
    return (np.array([minimum, 7, -7, minimum, 9, minimum], dtype),
            np.array([-1, 2, 2, 3, -1, -1], dtype))


# -- what crashed the host ------------------------------------------------------------------
_CHILD = """
import json, sys
import numpy as np
from wasinn import GraphEncoding, Tensor, WasiNNError
from wasinn.backends import Device, LoadOptions
from wasinn.backends.onnxruntime import OnnxRuntimeBackend

model, inputs, outputs, extra = sys.argv[1:]
with open(model, "rb") as file:
    data = file.read()
try:
    graph = OnnxRuntimeBackend().load([data], GraphEncoding.ONNX, Device.parse("cpu"),
                                      LoadOptions(extra=json.loads(extra)))
except WasiNNError as exc:  # told to the parent, which expects it or not
    print(f"{type(exc).__name__}: {exc}")
    sys.exit(3)
with np.load(inputs) as arrays:
    feeds = {name: Tensor.from_numpy(arrays[name]) for name in arrays.files}
np.savez(outputs, **{name: t.numpy() for name, t in graph.run(feeds).items()})
"""


def _child(tmp_path: Path, model: bytes, inputs: Arrays, extra: dict[str, Any]
           ) -> tuple[Arrays | None, str]:
    """Load ``model`` through the backend (``extra``: its options) and run it on
    ``inputs``, in a child process: the outputs, or None and the load's WasiNNError."""
    paths = [tmp_path / n for n in ("model.onnx", "inputs.npz", "outputs.npz")]
    paths[0].write_bytes(model)
    np.savez(paths[1], **inputs)  # type: ignore[arg-type]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    result = subprocess.run([sys.executable, "-c", _CHILD, *map(str, paths), json.dumps(extra)],
                            capture_output=True, text=True, env=env, timeout=60, check=False)
    if result.returncode == 3:
        return None, result.stdout.strip()
    assert result.returncode == 0, (
        f"the child exited with {result.returncode} (-8 is SIGFPE): {result.stderr[-2000:]}")
    with np.load(paths[2]) as outputs:
        return {name: outputs[name] for name in outputs.files}, ""


def _run_in_child(tmp_path: Path, model: bytes, inputs: Arrays,
                  extra: dict[str, Any] | None = None) -> Arrays:
    """Load ``model`` through the backend and run it on ``inputs``, in a child process."""
    outputs, error = _child(tmp_path, model, inputs, extra or {})
    assert outputs is not None, f"the load failed: {error}"
    return outputs


def _case_binary(op: str, dtype: Any, **attrs: Any) -> tuple[bytes, Arrays, Arrays]:
    a, b = _traps(dtype)
    model = _binary(op, dtype, [6], [6], **attrs)
    return model, {"a": a, "b": b}, {"y": _expected(op, a, b)}


def _case_broadcast() -> tuple[bytes, Arrays, Arrays]:
    minimum = np.iinfo(np.int64).min
    a = np.array([[minimum, 5, minimum], [-6, minimum, 8]], np.int64)
    b = np.array([-1, -1, 3], np.int64)
    return _binary("Div", np.int64, [2, 3], [3]), {"a": a, "b": b}, {"y": _expected("Div", a, b)}


def _case_folded() -> tuple[bytes, Arrays, Arrays]:
    x = np.array([5], np.int64)
    return _constant_operands(), {"x": x}, {"y": np.iinfo(np.int64).min + x}


def _case_if() -> tuple[bytes, Arrays, Arrays]:
    a, b = (v[:3] for v in _traps(np.int64))
    return _in_if(), {"flag": np.array(1, np.int64), "a": a, "b": b}, {
        "y": _expected("Div", a, b)}


def _case_loop() -> tuple[bytes, Arrays, Arrays]:
    a, b = (v[:3] for v in _traps(np.int64))
    return _in_loop(), {"a": a, "b": b}, {"y": _expected("Div", a, b)}


def _case_function(op: str, dtype: Any) -> tuple[bytes, Arrays, Arrays]:
    a, b = _traps(dtype)
    return _in_function(op, dtype, a.size), {"a": a, "b": b}, {"y": _expected(op, a, b)}


CRASHES: dict[str, Callable[[], tuple[bytes, Arrays, Arrays]]] = {
    "div-int64": lambda: _case_binary("Div", np.int64),
    "div-int32": lambda: _case_binary("Div", np.int32),
    "mod-int64": lambda: _case_binary("Mod", np.int64),
    "mod-int32": lambda: _case_binary("Mod", np.int32),
    "div-int32-opset8": lambda: (_binary("Div", np.int32, [6], [6], opset=8),
                                 *_case_binary("Div", np.int32)[1:]),
    "div-broadcast": _case_broadcast,
    "div-folded-at-load": _case_folded,
    "div-in-if": _case_if,
    "div-in-loop": _case_loop,
    "div-in-function": lambda: _case_function("Div", np.int64),
    "mod-in-function": lambda: _case_function("Mod", np.int32),
}


@pytest.mark.parametrize("case", list(CRASHES))
def test_the_minimum_divided_by_minus_one_no_longer_kills_the_host(
    tmp_path: Path, case: str
) -> None:
    # Before: the child died of SIGFPE, at run time, or at load for constant operands.
    model, inputs, expected = CRASHES[case]()
    outputs = _run_in_child(tmp_path, model, inputs)
    assert outputs.keys() == expected.keys()
    for name, want in expected.items():
        assert outputs[name].dtype == want.dtype
        np.testing.assert_array_equal(outputs[name], want)


@pytest.mark.parametrize("case", list(CRASHES))
def test_guarded_models_stay_valid_onnx(case: str) -> None:
    # Unique names, nodes in topological order (subgraphs and functions too), types that
    # check: the checker runs full shape inference on the rewrite.
    import onnx

    model, _, _ = CRASHES[case]()
    guarded = _guard(model)
    assert guarded is not model
    onnx.checker.check_model(onnx.ModelProto.FromString(guarded), full_check=True)


# -- however the model writes its divisions -----------------------------------------------------
#: Encodings of a NodeProto's op_type "Div" that onnx and ONNX Runtime both read as Div:
#: protobuf parsers accept varints (tags, lengths) longer than they need be. The guard
#: searched for the minimal encoding only and let all of these through unguarded.
SPELLINGS = {
    "length-in-two-bytes": b'"\x83\x00Div',
    "tag-in-two-bytes": b'\xa2\x00\x03Div',
    "tag-and-length-in-three-bytes": b'\xa2\x80\x00\x83\x80\x00Div',
}
#: The name given to each Div node before it is respelt, shortened by as many bytes as
#: the spelling adds: every enclosing message keeps its length.
_NAME = b"wasinn-respelt"


def _respelt(model: bytes, spelling: bytes) -> bytes:
    """``model`` with every Div node's op_type field written as ``spelling``."""
    import onnx

    parsed = onnx.ModelProto.FromString(model)
    graphs = [parsed.graph, *(f for f in parsed.functions)]
    while graphs:  # every node list: graphs, subgraphs, functions
        for node in graphs.pop().node:
            if node.op_type == "Div":
                node.name = _NAME.decode()
            graphs.extend(a.g for a in node.attribute if a.HasField("g"))
    data = bytes(parsed.SerializeToString())
    name = _NAME[:len(_NAME) - (len(spelling) - len(b'"\x03Div'))]
    old = b"\x1a" + bytes([len(_NAME)]) + _NAME + b'"\x03Div'
    assert old in data
    respelt = data.replace(old, b"\x1a" + bytes([len(name)]) + name + spelling)
    assert len(respelt) == len(data) and b'"\x03Div' not in respelt
    assert [n.op_type for n in onnx.ModelProto.FromString(respelt).graph.node] == [
        n.op_type for n in parsed.graph.node]
    return respelt


RESPELT = {  # where the Div is: each case of CRASHES that has a Div
    "main-graph": "div-int32",
    "folded-at-load": "div-folded-at-load",
    "if-branch": "div-in-if",
    "loop-body": "div-in-loop",
    "function": "div-in-function",
}


@pytest.mark.parametrize("spelling", list(SPELLINGS))
@pytest.mark.parametrize("place", list(RESPELT))
def test_a_division_however_encoded_no_longer_kills_the_host(
    tmp_path: Path, place: str, spelling: str
) -> None:
    # Before: the guard's byte search missed these op_types; the child died of SIGFPE, at
    # run time, or while ONNX Runtime built the session for constant operands.
    from wasinn.backends._onnx_division import _may_divide

    model, inputs, expected = CRASHES[RESPELT[place]]()
    respelt = _respelt(model, SPELLINGS[spelling])
    outputs = _run_in_child(tmp_path, respelt, inputs)
    for name, want in expected.items():
        np.testing.assert_array_equal(outputs[name], want)
    assert _may_divide(respelt)


def test_a_graph_behind_a_tag_above_32_bits_is_an_invalid_encoding() -> None:
    # ModelProto.graph's tag with a bit above the 32nd set: protobuf's C++ parser (ONNX
    # Runtime's) keeps the low 32 bits and read the graph and its Div; the guard's walk
    # read field 2**29 + 7, which holds no node, and let it through unguarded. onnx
    # refuses such bytes: so does the guard now.
    import onnx

    from wasinn.backends._onnx_division import _may_divide
    from wasinn.errors import InvalidEncodingError

    model = onnx.ModelProto.FromString(_binary("Div", np.int32, [6], [6]))
    graph = bytes(model.graph.SerializeToString())
    model.ClearField("graph")
    data = bytes(model.SerializeToString()) + varint(1 << 32 | 7 << 3 | 2) + varint(
        len(graph)) + graph
    assert _may_divide(data)
    with pytest.raises(InvalidEncodingError, match=r"^onnxruntime: cannot read the ONNX model"):
        _guard(data)


def _function_of_opset(opset: int) -> bytes:
    """``y = Divide(a, b)`` over int32[6], the model-local function Divide importing the
    default domain at ``opset``, the model at 17."""
    import onnx
    from onnx import helper

    model = onnx.ModelProto.FromString(_in_function("Div", np.int32, 6))
    model.functions[0].ClearField("opset_import")
    model.functions[0].opset_import.append(helper.make_opsetid("", opset))
    return bytes(model.SerializeToString())


def _input_declared_twice() -> bytes:
    """``y = a / b`` over int32[6], where a value_info says a and b are floats: ONNX
    Runtime types them by the graph's inputs and ignores it."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.ModelProto.FromString(_binary("Div", np.int32, [6], [6]))
    model.graph.value_info.extend(helper.make_tensor_value_info(n, TensorProto.FLOAT, [6])
                                  for n in "ab")
    return bytes(model.SerializeToString())


def _ort_identifier(model: bytes) -> bytes:
    """``model`` with ONNX Runtime's ORT-format identifier at bytes 4 to 8: a
    producer_name "xxORTM" written first (protobuf reads fields in any order)."""
    return b"\x12\x06xxORTM" + model


def test_a_function_importing_an_opset_without_a_div_kernel_is_refused(tmp_path: Path) -> None:
    # Before: the guard left a Div of opset 6 (which ONNX Runtime has no kernel for) as it
    # was, but a function's nodes run inlined at the model's opset, 17: SIGFPE.
    a, b = _traps(np.int32)
    outputs, error = _child(tmp_path, _function_of_opset(6), {"a": a, "b": b}, {})
    assert outputs is None
    assert error.startswith(
        "UnsupportedOperationError: onnxruntime: the Div node producing 'q' in function "
        "wasinn.test:Divide cannot be guarded: its operands' element type is unknown and "
        "the model's opset 6 predates CastLike (15)")


@pytest.mark.parametrize("case", ["value-info-contradicting-the-inputs",
                                  "ort-identifier-read-as-onnx"])
def test_a_division_whose_type_or_format_is_told_twice_no_longer_kills_the_host(
        tmp_path: Path, case: str) -> None:
    # Before: the guard believed the value_info (floats: left alone), or took the bytes
    # for an ORT-format model (no protobuf Div to look for) although the options told
    # ONNX Runtime to read them as ONNX; the child died of SIGFPE.
    a, b = _traps(np.int32)
    if case == "value-info-contradicting-the-inputs":
        model, extra = _input_declared_twice(), {}
    else:
        model = _ort_identifier(_binary("Div", np.int32, [6], [6]))
        extra = {"session.load_model_format": "ONNX"}
    outputs = _run_in_child(tmp_path, model, {"a": a, "b": b}, extra)
    np.testing.assert_array_equal(outputs["y"], _expected("Div", a, b))


def test_types_declared_differently_before_opset_15_are_refused() -> None:
    import onnx

    model = onnx.ModelProto.FromString(_input_declared_twice())
    model.opset_import[0].version = 13
    with pytest.raises(UnsupportedOperationError, match=(
            r"^onnxruntime: the Div node producing 'y' in the main graph cannot be guarded: "
            r"its operands are declared with different element types \(float, int32\) and "
            r"the model's opset 13 predates CastLike \(15\); .*" + WAY_OUT)):
        _guard(bytes(model.SerializeToString()))


def test_the_default_domain_by_its_alias_is_guarded_too(tmp_path: Path) -> None:
    # "ai.onnx" is the default domain's other name, for the node and the opset import.
    import onnx

    model = onnx.ModelProto.FromString(_binary("Div", np.int32, [6], [6]))
    model.graph.node[0].domain = "ai.onnx"
    model.opset_import[0].domain = "ai.onnx"
    a, b = _traps(np.int32)
    outputs = _run_in_child(tmp_path, bytes(model.SerializeToString()), {"a": a, "b": b})
    np.testing.assert_array_equal(outputs["y"], _expected("Div", a, b))


def test_bytes_onnx_runtime_reads_as_onnx_are_guarded_whatever_their_identifier() -> None:
    from wasinn.backends._onnx_division import guard_integer_division

    model = _ort_identifier(_binary("Div", np.int64, [3], [3]))
    assert _guard(model) is model  # read as ORT's flatbuffer: it has no Div of its own
    assert guard_integer_division(NAME, model, refuse_unguardable=True,
                                  ort_format=False) is not model


# -- what did not crash, with the guard in place ---------------------------------------------
def _random_operands(dtype: Any, seed: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Random dividends over the whole type, divisors small and large, some -1 (never
    with MIN, which this process must not divide), none 0."""
    info = np.iinfo(dtype)
    rng = np.random.default_rng(seed)
    a = rng.integers(info.min, info.max, 400, dtype, endpoint=True)
    a[:4] = info.min, info.max, 0, -1
    b = np.concatenate([rng.integers(-9, 10, 200, dtype),
                        rng.integers(info.min, info.max, 200, dtype, endpoint=True)])
    b[b == 0] = 1
    b[::7] = -1
    b[3] = info.min
    a[(b == -1) & (a == info.min)] = info.min + 1
    return a, b


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize(("op", "fmod"), [("Div", 0), ("Mod", 0), ("Mod", 1)])
def test_guarded_integer_results_equal_numpy(backend: Any, dtype: Any, op: str,
                                             fmod: int) -> None:
    import onnxruntime as ort

    a, b = _random_operands(dtype, seed=fmod + 2 * (op == "Div"))
    attrs = {"fmod": fmod} if op == "Mod" else {}
    model = _binary(op, dtype, [a.size], [b.size], **attrs)
    assert _guard(model) is not model
    graph = backend.load([model], GraphEncoding.ONNX, CPU)
    (y,) = graph.run({"a": Tensor.from_numpy(a), "b": Tensor.from_numpy(b)}).values()
    unguarded = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(y.numpy(), unguarded.run(None, {"a": a, "b": b})[0])
    if op == "Mod" and fmod and dtype == np.int64:
        return  # ONNX Runtime computes an int64 fmod in double: off for large operands
    np.testing.assert_array_equal(y.numpy(), _expected(op, a, b, fmod))
    if op == "Mod":
        np.testing.assert_array_equal(y.numpy(), (np.fmod if fmod else np.mod)(a, b))


def _run_guarded(model: bytes, inputs: Arrays) -> np.ndarray[Any, Any]:
    """The guarded ``model``'s one output, run by ONNX Runtime itself: for element types
    outside wasi-nn's set, which the backend does not take."""
    import onnxruntime as ort

    guarded = _guard(model)
    assert guarded is not model
    session = ort.InferenceSession(guarded, providers=["CPUExecutionProvider"])
    (y,) = session.run(None, inputs)
    return np.asarray(y)


_SPECIAL = [-0.0, 0.0, -1.0, 1.0, 2.5, -3.0, 1e-30, np.inf, -np.inf, np.nan]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("op", ["Div", "Mod"])
def test_the_guard_for_any_type_keeps_float_results(dtype: Any, op: str) -> None:
    # The generic guard multiplies by -1 where the divisor is -1: exactly a / -1, signed
    # zeros, infinities and NaN included; fmod(x, 1) is fmod(x, -1).
    values = np.array(_SPECIAL, dtype)
    a, b = np.repeat(values, values.size), np.tile(values, values.size)
    attrs = {"fmod": 1} if op == "Mod" else {}
    y = _run_guarded(_in_function(op, dtype, a.size, **attrs), {"a": a, "b": b})
    with np.errstate(all="ignore"):
        want = np.divide(a, b) if op == "Div" else np.fmod(a, b)
    np.testing.assert_array_equal(y, want)
    number = ~np.isnan(want)
    np.testing.assert_array_equal(np.signbit(y[number]), np.signbit(want[number]))


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64,
                                   np.uint8, np.uint16, np.uint32, np.uint64])
@pytest.mark.parametrize(("op", "fmod"), [("Div", 0), ("Mod", 0), ("Mod", 1)])
def test_the_guard_for_any_type_keeps_integer_results(dtype: Any, op: str, fmod: int) -> None:
    # Unsigned: -1 cast to the type is its maximum, a divisor like any other. int8 and
    # int16 are computed in int by ONNX Runtime, so their MIN / -1 ran here before too.
    import onnxruntime as ort

    info = np.iinfo(dtype)
    rng = np.random.default_rng(7)
    a = rng.integers(info.min, info.max, 64, dtype, endpoint=True)
    b = rng.integers(info.min, info.max, 64, dtype, endpoint=True)
    b[:8] = info.max, info.max - 1, 1, 2, 3, info.max, 1, 5
    a[:8] = info.max, info.min, info.max, 0, 7, info.max - 1, info.min, 9
    if info.min:
        b[8:16] = -1
        b[16] = info.min
        a[8:10] = info.min + 1, info.max
        if info.bits < 32:
            a[10] = info.min  # MIN / -1 computed in int: no trap
    b[b == 0] = 1
    if info.bits >= 32:
        a[(b == -1) & (a == info.min)] = 0
    attrs = {"fmod": fmod} if op == "Mod" else {}
    model = _in_function(op, dtype, a.size, **attrs)
    y = _run_guarded(model, {"a": a, "b": b})
    unguarded = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(y, unguarded.run(None, {"a": a, "b": b})[0])
    if not (fmod and info.bits == 64):  # ONNX Runtime computes those in double
        np.testing.assert_array_equal(y, _expected(op, a, b, fmod))


@pytest.mark.parametrize("op", ["Div", "Mod"])
def test_division_by_zero_is_still_a_runtime_error(backend: Any, op: str) -> None:
    graph = backend.load([_binary(op, np.int64, [3], [3])], GraphEncoding.ONNX, CPU)
    operands = {"a": Tensor.from_numpy(np.array([1, 2, 3])),
                "b": Tensor.from_numpy(np.array([1, 0, -1]))}
    with pytest.raises(BackendRuntimeError, match=r"Integer (division|modulo) by zero"):
        graph.run(operands)


# -- what is left alone ------------------------------------------------------------------------
def test_a_model_without_div_or_mod_is_the_same_bytes_object() -> None:
    model = affine_onnx()
    assert _guard(model) is model


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int8, np.int16,
                                   np.uint8, np.uint32, np.uint64])
@pytest.mark.parametrize("op", ["Div", "Mod"])
def test_divisions_that_cannot_trap_are_left_unguarded(dtype: Any, op: str) -> None:
    import onnx

    attrs = {"fmod": 1} if op == "Mod" and np.issubdtype(dtype, np.floating) else {}
    model = _binary(op, dtype, [3], [3], **attrs)
    assert _guard(model) is model  # unparsed further, unserialized: the very same bytes
    assert len(onnx.ModelProto.FromString(model).graph.node) == 1


def test_only_node_bytes_are_searched_for_a_division() -> None:
    # Weights that happen to hold a Div op_type's bytes cost no parse; a Div anywhere in
    # the nodes (subgraphs, functions) is found.
    from onnx import TensorProto, helper

    from wasinn.backends._onnx_division import _may_divide

    marker = np.frombuffer(b'"\x03Div"\x03Mod', np.uint8)
    weights = helper.make_tensor("w", TensorProto.UINT8, [marker.size], marker.tobytes(),
                                 raw=True)
    graph = helper.make_graph(
        [helper.make_node("Identity", ["w"], ["y"])], "weights", [],
        [helper.make_tensor_value_info("y", TensorProto.UINT8, [marker.size])],
        initializer=[weights])
    model = onnx_model_bytes(graph)
    assert b'"\x03Div' in model and not _may_divide(model)
    assert _guard(model) is model
    assert all(_may_divide(m) for m in (_in_if(), _in_loop(), _in_function("Mod", np.int32, 2),
                                        _binary("Div", np.float32, [1], [1])))


def test_guards_share_their_constants_within_a_node_list() -> None:
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Div", ["a", "b"], ["q"]), helper.make_node("Mod", ["q", "b"], ["y"])],
        "two", [helper.make_tensor_value_info(n, TensorProto.INT64, [2]) for n in "ab"],
        [helper.make_tensor_value_info("y", TensorProto.INT64, [2])])
    model = onnx_model_bytes(graph)
    guarded = onnx.ModelProto.FromString(_guard(model))
    onnx.checker.check_model(guarded, full_check=True)
    kinds = [n.op_type for n in guarded.graph.node]
    assert kinds[:3] == ["Constant"] * 3 and kinds.count("Constant") == 3  # MIN, -1, 1
    assert kinds.count("Where") == 2
    y = _run_guarded(model, {"a": np.array([7, -7]), "b": np.array([2, -1])})
    np.testing.assert_array_equal(y, [1, 0])


def test_a_division_of_another_domain_is_left_alone() -> None:
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Div", ["a", "b"], ["y"], domain="custom.ops")], "custom",
        [helper.make_tensor_value_info(n, TensorProto.INT64, [1]) for n in "ab"],
        [helper.make_tensor_value_info("y", TensorProto.INT64, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("custom.ops", 1)])
    data = bytes(model.SerializeToString())
    assert _guard(data) is data


def test_the_rewrite_keeps_the_rest_of_the_model(backend: Any, tmp_path: Path) -> None:
    # Weights (set aside during inference) come back byte for byte, external data
    # references stay references, and a registered model's weights file is still read.
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    (tmp_path / "w.bin").write_bytes(np.array([2, -1, 3], np.int64).tobytes())
    divisor = TensorProto(name="w", data_type=TensorProto.INT64, dims=[3],
                          data_location=TensorProto.EXTERNAL)
    for key, value in (("location", "w.bin"), ("offset", "0"), ("length", "24")):
        divisor.external_data.add(key=key, value=value)
    weights = numpy_helper.from_array(
        np.random.default_rng(0).standard_normal(50_000).astype(np.float32), "big")
    graph = helper.make_graph(
        [helper.make_node("Div", ["a", "w"], ["q"]),
         helper.make_node("ReduceSum", ["big"], ["s"], keepdims=0),
         helper.make_node("Identity", ["q"], ["y"])], "kept",
        [helper.make_tensor_value_info("a", TensorProto.INT64, [3])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, [3]),
         helper.make_tensor_value_info("s", TensorProto.FLOAT, [])],
        initializer=[divisor, weights])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                              producer_name="kept", doc_string="a model")
    model.ir_version = 8
    helper.set_model_props(model, {"author": "wasinn"})
    data = bytes(model.SerializeToString())

    rewritten = onnx.ModelProto.FromString(_guard(data))
    assert len(rewritten.graph.node) > len(model.graph.node)
    assert list(rewritten.graph.initializer) == list(model.graph.initializer)
    for field in ("ir_version", "opset_import", "producer_name", "doc_string",
                  "metadata_props"):
        assert getattr(rewritten, field) == getattr(model, field)
    assert list(rewritten.graph.input) == list(model.graph.input)
    assert list(rewritten.graph.output) == list(model.graph.output)

    path = tmp_path / "model.onnx"
    path.write_bytes(data)
    loaded = backend.load([data], GraphEncoding.ONNX, CPU, LoadOptions(source=str(path)))
    outputs = loaded.run({"a": Tensor.from_numpy(np.array([7, 7, -7]))})
    np.testing.assert_array_equal(outputs["y"].numpy(), [3, -7, -2])


def test_new_names_clash_with_none_in_the_model() -> None:
    import onnx
    from onnx import TensorProto, helper

    taken = [f"wasinn_{i}" for i in range(11)]  # every one a value's or a node's name
    nodes = [helper.make_node("Div", [taken[0], taken[1]], [taken[2]], name=taken[3])]
    nodes += [helper.make_node("Identity", [taken[i]], [taken[i + 1]], name=taken[i + 5])
              for i in range(2, 6)]
    graph = helper.make_graph(
        nodes, "taken", [helper.make_tensor_value_info(n, TensorProto.INT64, [2])
                         for n in taken[:2]],
        [helper.make_tensor_value_info(taken[6], TensorProto.INT64, [2])])
    model = onnx_model_bytes(graph)
    rewritten = onnx.ModelProto.FromString(_guard(model))
    onnx.checker.check_model(rewritten, full_check=True)
    added = {n.name for n in rewritten.graph.node} - {n.name for n in nodes}
    assert added and not added & set(taken)
    y = _run_guarded(model, {taken[0]: np.array([7, -7]), taken[1]: np.array([2, -1])})
    np.testing.assert_array_equal(y, [3, 7])


# -- what is refused in the host's process -----------------------------------------------------
#: The end of every refusal: how to run the model all the same.
WAY_OUT = (r"or load it sandboxed to run it unguarded, in a process of its own that a crash "
           r"ends instead of the host's \(sandbox = true in its \[models\.NAME\] table or "
           r"options=\{'sandbox': True\} in rt\.load; \[guests\] sandbox .*\)$")


def test_an_unknown_type_before_opset_15_is_refused(backend: Any) -> None:
    model = _in_function("Div", np.int64, 3, opset=14)
    with pytest.raises(UnsupportedOperationError, match=(
            r"^onnxruntime: the Div node producing 'q' in function wasinn\.test:Divide "
            r"cannot be guarded: its operands' element type is unknown and the model's "
            r"opset 14 predates CastLike \(15\); an integer division of the minimum value "
            r"by -1 would crash the host process, so the model is refused in the host's "
            r"process: declare the operands' types or use opset 15 or later, " + WAY_OUT)):
        backend.load([model], GraphEncoding.ONNX, CPU)


def _ort_format(model: bytes, path: Path) -> bytes:
    """``model`` saved by ONNX Runtime in its ORT (flatbuffers) format."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.optimized_model_filepath = str(path)
    options.add_session_config_entry("session.save_model_format", "ORT")
    ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    return path.read_bytes()


def test_ort_format_models_with_a_division_are_refused(backend: Any, tmp_path: Path) -> None:
    divides = _ort_format(_binary("Div", np.float32, [3], [3]), tmp_path / "div.ort")
    assert divides[4:8] == b"ORTM" and b"\x03\x00\x00\x00Div\x00" in divides
    with pytest.raises(UnsupportedOperationError, match=(
            r"^onnxruntime: an ORT-format model's Div and Mod nodes cannot be guarded \(this "
            r"format cannot be rewritten\); an integer division of the minimum value by -1 "
            r"would crash the host process, so the model is refused in the host's process: "
            r"convert the model to ONNX \(protobuf\), " + WAY_OUT)):
        backend.load([divides], GraphEncoding.ONNX, CPU)
    plain = _ort_format(affine_onnx(), tmp_path / "affine.ort")
    assert _guard(plain) is plain
    graph = backend.load([plain], GraphEncoding.ONNX, CPU)
    (y,) = graph.run({"x": Tensor.from_numpy(np.ones((1, 4), np.float32))}).values()
    np.testing.assert_allclose(y.numpy(), np.full((1, 4), 3.0))


# -- what runs unguarded in a sandbox process --------------------------------------------------
def _typed_then_untyped() -> bytes:
    """``y = Divide(a / b, b)``: the main graph's Div of declared int64 operands, then
    the untyped Div of the model-local function Divide, in an opset 14 model."""
    import onnx
    from onnx import helper

    model = onnx.ModelProto.FromString(_in_function("Div", np.int64, 3, opset=14))
    model.graph.node.insert(0, helper.make_node("Div", ["a", "b"], ["d"], name="typed"))
    model.graph.node[1].input[0] = "d"
    return bytes(model.SerializeToString())


def test_refusal_off_leaves_an_untyped_division_as_it_is_and_guards_the_rest(
        caplog: pytest.LogCaptureFixture) -> None:
    import onnx
    import onnxruntime as ort

    model = _typed_then_untyped()
    with pytest.raises(UnsupportedOperationError, match=r"predates CastLike.*" + WAY_OUT):
        _guard(model)
    with caplog.at_level(logging.DEBUG, logger="wasinn.backends"):
        data = _guard(model, refuse_unguardable=False)
    guarded = onnx.ModelProto.FromString(data)
    original = onnx.ModelProto.FromString(model)
    assert list(guarded.functions) == list(original.functions)  # its Div as it was
    typed = next(n for n in guarded.graph.node if n.name == "typed")
    assert typed.input[0] == "a" and typed.input[1] != "b"  # the divisor is the guard's
    assert [n.op_type for n in guarded.graph.node].count("Where") == 1
    (record,) = [r for r in caplog.records if r.name == "wasinn.backends"]
    assert record.levelno == logging.DEBUG
    assert record.getMessage() == (
        "onnxruntime: the Div node producing 'q' in function wasinn.test:Divide cannot be "
        "guarded: its operands' element type is unknown and the model's opset 14 predates "
        "CastLike (15): left unguarded in this sandbox process (the minimum value divided "
        "by -1 there ends only it, which the host reports as an error)")
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    (y,) = session.run(None, {"a": np.array([7, -70, 9]), "b": np.array([2, 3, -1])})
    np.testing.assert_array_equal(y, [1, -7, 9])  # truncated: 7 / 2 / 2, -70 / 3 / 3, 9 / -1 / -1


def test_refusal_off_passes_an_ort_format_model_with_a_division_as_it_came(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    divides = _ort_format(_binary("Mod", np.int32, [3], [3]), tmp_path / "mod.ort")
    with caplog.at_level(logging.DEBUG, logger="wasinn.backends"):
        assert _guard(divides, refuse_unguardable=False) is divides
    assert caplog.messages == [
        "onnxruntime: an ORT-format model's Div and Mod nodes cannot be guarded (this format "
        "cannot be rewritten): left unguarded in this sandbox process (the minimum value "
        "divided by -1 there ends only it, which the host reports as an error)"]


def _unguardable(kind: str, tmp_path: Path) -> bytes:
    """A model whose int64 Div cannot be guarded: ``y = a / b``."""
    if kind == "ort-format":
        return _ort_format(_binary("Div", np.int64, [3], [3]), tmp_path / "div.ort")
    return _in_function("Div", np.int64, 3, opset=14)


@pytest.mark.parametrize("kind", ["ort-format", "untyped-before-opset-15"])
async def test_a_division_refused_in_the_host_runs_sandboxed_and_a_trap_fails_one_run(
        kind: str, tmp_path: Path) -> None:
    model = _unguardable(kind, tmp_path)
    minimum = np.iinfo(np.int64).min
    good = {"a": np.array([7, -7, minimum]), "b": np.array([2, 2, 1])}
    traps = {"a": np.array([minimum, 7, 9]), "b": np.array([-1, 2, 3])}
    async with wasinn.Runtime(cpu_pool(backends=["onnxruntime"])) as rt:
        with pytest.raises(UnsupportedOperationError, match=WAY_OUT):
            await rt.load([model], "onnx")
        graph = await rt.load([model], "onnx", options={"sandbox": True})
        out = await graph.compute(good)
        np.testing.assert_array_equal(out["y"].numpy(), [3, -3, minimum])
        with pytest.raises(BackendRuntimeError, match=(
                r"^onnxruntime: the process running the model was killed by SIGFPE: the "
                r"library crashed on this model or these inputs \(the host goes on; the "
                r"next run starts a new process\)$")):
            await graph.compute(traps)
        out = await graph.compute(good)
        np.testing.assert_array_equal(out["y"].numpy(), [3, -3, minimum])
        await graph.unload()
