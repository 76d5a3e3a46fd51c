"""The external data check (:mod:`wasinn.backends._onnx_check`) against bytes the
libraries read otherwise than the check did: a tag of more than 32 bits, ONNX bytes that
carry ONNX Runtime's ORT-format identifier, nesting beyond protobuf's limit; and the cost
of its walk, which the host pays for every ONNX model from a guest. Then the node checks
that run with it (:mod:`wasinn.backends._onnx_structure`): nodes that crashed a library
as it read the model load in a child process, which must survive them."""

from __future__ import annotations

import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import wasinn
from tests.support import require_backend
from tests.tfmodels import varint
from wasinn import GraphEncoding, InvalidEncodingError, SecurityError, Tensor
from wasinn.backends import Device, LoadOptions

CPU = Device.parse("cpu")
SECRET = b"SECRET-KEY-1234"


def _field(number: int, payload: bytes, *, key: int | None = None) -> bytes:
    """A length-delimited field; ``key``: its tag, where it is not ``number``'s own."""
    return varint(number << 3 | 2 if key is None else key) + varint(len(payload)) + payload


#: Bit 32 of a tag: protobuf's C++ parser keeps a tag's low 32 bits, the field they name.
ABOVE_32_BITS = 1 << 32


def _external(location: str, *, high: int = 0) -> bytes:
    """A u8[15] TensorProto ``w`` whose data is the first 15 bytes of the file at
    ``location``; ``high``: bits added to the tags of its external data fields
    (data_location, external_data)."""
    from onnx import TensorProto

    tensor = bytes(TensorProto(name="w", data_type=TensorProto.UINT8, dims=[15])
                   .SerializeToString())
    tensor += varint(high | 14 << 3) + varint(TensorProto.EXTERNAL)
    for key, value in (("location", location), ("offset", "0"), ("length", "15")):
        entry = _field(1, key.encode()) + _field(2, value.encode())
        tensor += _field(13, entry, key=high | 13 << 3 | 2)
    return tensor


def _model(initializer: bytes, *, graph_key: int | None = None,
           initializer_key: int | None = None) -> bytes:
    """``y = x + w`` over u8[15], ``w`` the serialized TensorProto ``initializer``."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.UINT8, [15])],
        [helper.make_tensor_value_info("y", TensorProto.UINT8, [15])])
    body = bytes(graph.SerializeToString()) + _field(5, initializer, key=initializer_key)
    model = helper.make_model(helper.make_graph([], "g", [], []),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    model.ClearField("graph")
    return bytes(model.SerializeToString()) + _field(7, body, key=graph_key)


def _ort_identifier(model: bytes) -> bytes:
    """``model`` with ONNX Runtime's ORT-format identifier at bytes 4 to 8: a
    producer_name "xxORTM" written first (protobuf reads fields in any order)."""
    return b"\x12\x06xxORTM" + model


@pytest.fixture
def _secret_in_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """key.txt in the working directory, where ONNX Runtime reads a model's bytes'
    external data."""
    (tmp_path / "key.txt").write_bytes(SECRET)
    monkeypatch.chdir(tmp_path)


def _onnxruntime() -> Any:
    require_backend("onnxruntime")
    require_backend("onnx")
    from wasinn.backends.onnxruntime import OnnxRuntimeBackend

    return OnnxRuntimeBackend()


def _x() -> dict[str, Tensor]:
    return {"x": Tensor.from_numpy(np.zeros(15, np.uint8))}


@pytest.mark.usefixtures("_secret_in_cwd")
@pytest.mark.parametrize("tag", ["ModelProto.graph", "GraphProto.initializer",
                                 "TensorProto.external_data"])  # (and data_location)
def test_a_tag_above_32_bits_is_an_invalid_encoding_not_a_file_read(tag: str) -> None:
    # Before: the walk read field 2**29 + N, which holds no tensor (or no file reference),
    # and passed the model; ONNX Runtime read the tag's low 32 bits as the field, and
    # loaded key.txt into the weights, which a run returned.
    backend = _onnxruntime()
    keys: dict[str, Any] = {"graph_key": None, "initializer_key": None}
    if tag == "ModelProto.graph":
        keys["graph_key"] = ABOVE_32_BITS | 7 << 3 | 2
    elif tag == "GraphProto.initializer":
        keys["initializer_key"] = ABOVE_32_BITS | 5 << 3 | 2
    high = ABOVE_32_BITS if tag == "TensorProto.external_data" else 0
    model = _model(_external("key.txt", high=high), **keys)
    with pytest.raises(InvalidEncodingError, match=(
            r"^onnxruntime: cannot read the ONNX model: not a well-formed protobuf \(field "
            r"number \d+ is above protobuf's 536870911\)$")):
        backend.load([model], GraphEncoding.ONNX, CPU)


@pytest.mark.usefixtures("_secret_in_cwd")
def test_onnx_bytes_with_an_ort_identifier_are_walked_where_onnx_runtime_reads_onnx() -> None:
    # Before: bytes 4-8 "ORTM" made the walk skip the model as an ORT-format flatbuffer,
    # but the load format in the options made ONNX Runtime read it as ONNX, key.txt too.
    backend = _onnxruntime()
    model = _ort_identifier(_model(_external("key.txt")))
    with pytest.raises(SecurityError, match=r"^onnxruntime: tensor 'w' refers to external "
                       r"data \(location 'key.txt'\)"):
        backend.load([model], GraphEncoding.ONNX, CPU,
                     LoadOptions(extra={"session.load_model_format": "ONNX"}))
    with pytest.raises(InvalidEncodingError, match="ORT model verification failed"):
        backend.load([model], GraphEncoding.ONNX, CPU)  # read as ORT's: not a flatbuffer


@pytest.mark.usefixtures("_secret_in_cwd")
def test_onnx_bytes_with_an_ort_identifier_are_walked_for_openvino() -> None:
    # Before: the walk skipped them as an ORT-format model, which OpenVINO cannot read:
    # it read them as ONNX, and key.txt (below its working directory) into the weights.
    require_backend("openvino")
    require_backend("onnx")
    from wasinn.backends.openvino import OpenVinoBackend

    model = _ort_identifier(_model(_external("key.txt")))
    with pytest.raises(SecurityError, match=r"^openvino: tensor 'w' refers to external data"):
        OpenVinoBackend().load([model], GraphEncoding.ONNX, CPU)


def _nested(levels: int) -> bytes:
    """A model whose graph's one node holds a graph attribute holding a node ... to
    ``levels`` graphs (3 messages each), the innermost with an external initializer."""
    graph = _field(5, _external("key.txt"))
    for _ in range(levels):
        attribute = _field(1, b"then_branch") + _field(6, graph)
        graph = _field(1, _field(4, b"If") + _field(5, attribute))
    return _field(7, graph) + _field(8, b"\x10\x11")  # opset_import: version 17


def test_nesting_beyond_protobufs_limit_is_an_invalid_encoding() -> None:
    from wasinn.backends._onnx_check import check_external_data

    with pytest.raises(SecurityError, match="tensor 'w' refers to external data"):
        check_external_data("onnxruntime", _nested(32))  # 98 messages deep
    # Before: walked to any depth (the libraries' parsers refuse these bytes).
    with pytest.raises(InvalidEncodingError, match=(
            r"not a well-formed protobuf \(messages nested deeper than protobuf's 100\)")):
        check_external_data("onnxruntime", _nested(33))


def test_the_walk_holds_no_more_than_its_nesting_depth() -> None:
    # 500,000 empty nodes (1 MB). Before: each was pushed on the walk's stack before any
    # was looked at, about 70 MB of Python objects (1.3 GB for a 10 MB model).
    from wasinn.backends._onnx_check import check_external_data

    model = _field(7, b"\x0a\x00" * 500_000) + _field(8, b"")
    tracemalloc.start()
    try:
        assert check_external_data("onnxruntime", model) == frozenset()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 * 1024


@pytest.mark.parametrize("node", ["attribute", "attribute-tag-in-two-bytes",
                                  "long-name-then-attribute"])
def test_a_node_that_may_hold_an_attribute_is_walked(node: str) -> None:
    # Nodes without a byte that could start an attribute's tag are skipped unread; one
    # that has it (however the tag is encoded), or is too long to search, is walked.
    from wasinn.backends._onnx_check import check_external_data

    attribute = _field(1, b"value") + _field(5, _external("key.txt"))
    if node == "attribute":
        body = _field(5, attribute)
    elif node == "attribute-tag-in-two-bytes":
        body = b"\xaa\x00" + varint(len(attribute)) + attribute
    else:
        body = _field(3, b"n" * 5000) + _field(5, attribute)
    model = _field(7, _field(1, b"") * 3 + _field(1, body)) + _field(8, b"")
    with pytest.raises(SecurityError, match="tensor 'w' refers to external data"):
        check_external_data("onnxruntime", model)


# -- nodes whose structure alone crashed a library (:mod:`wasinn.backends._onnx_structure`)
ROOT = Path(__file__).resolve().parents[1]
X = np.arange(16, dtype=np.float32).reshape(1, 4, 2, 2)


def _one_node(op: str, inputs: list[str], opset: int = 18, *,
              initializers: dict[str, np.ndarray[Any, Any]] | None = None,
              imports: list[tuple[str, int]] | None = None, **attrs: Any) -> bytes:
    """``y = op(inputs)`` (the node named after ``op`` in lower case) over the input x,
    f32[1, 4, 2, 2]; ``imports``: the model's opset imports, where not the default
    domain at ``opset``."""
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node(op, inputs, ["y"], name=op.lower(), **attrs)], "one_node",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(X.shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, k) for k, v in (initializers or {}).items()])
    model = helper.make_model(graph, opset_imports=[
        helper.make_opsetid(domain, version) for domain, version in imports or [("", opset)]])
    model.ir_version = 8
    return bytes(model.SerializeToString())


def _backend(name: str) -> Any:
    require_backend(name)
    require_backend("onnx")
    return wasinn.backends.registry.BackendRegistry().get(name)


def _check(model: bytes) -> None:
    from wasinn.backends._onnx_structure import check_structure

    check_structure("onnxruntime", model)


#: A host process that loads the ONNX model in the file ``sys.argv[2]`` with
#: ``rt.load`` (in the host's own process: not sandboxed) on the backend ``sys.argv[1]``
#: and prints the error's type and message, or "loaded".
_HOST_LOAD = """
import sys
from pathlib import Path
import trio, wasinn
from wasinn.configs.loader import parse_config

async def main():
    config = parse_config({"pools": {"cpu": {"kind": "cpu", "devices": ["cpu"],
                                             "backends": [sys.argv[1]]}}}, None)
    async with wasinn.Runtime(config) as rt:
        try:
            await rt.load([Path(sys.argv[2]).read_bytes()], "onnx")
            print("loaded")
        except wasinn.WasiNNError as exc:
            print(type(exc).__name__, exc)

trio.run(main)
"""


@pytest.mark.parametrize(("backend_name", "model", "what"), [
    ("openvino", lambda: _one_node("Pad", ["x"]),
     "node 'pad' (Pad) has 1 input: expected at least 2, the inputs ONNX requires of Pad "
     "at opset 18"),
    ("openvino", lambda: _one_node("Pad", ["x"], imports=[("com.microsoft", 1)],
                                   pads=[0, 0, 1, 1, 0, 0, 1, 1]),
     "node 'pad' (Pad) has 1 input: expected at least 2, the inputs ONNX requires of Pad "
     "at the latest opset (the model imports none)"),
    ("openvino", lambda: _one_node("Max", []),
     "node 'max' (Max) has 0 inputs: expected at least 1, the inputs ONNX requires of Max "
     "at opset 18"),
    ("openvino", lambda: _one_node("FusedConv", ["x"], domain="com.microsoft",
                                   imports=[("", 18), ("com.microsoft", 1)]),
     "node 'fusedconv' (FusedConv) has 1 input: expected at least 2, the inputs ONNX "
     "Runtime's com.microsoft domain requires of FusedConv"),
    ("onnxruntime", lambda: _one_node("DepthToSpace", ["x"], blocksize=2**32),
     "node 'depthtospace' (DepthToSpace) has blocksize 4294967296: expected 1 to "
     "2,147,483,647 (2**31 - 1; a larger one fits no tensor)"),
], ids=["openvino-pad-without-pads", "openvino-pad-no-default-opset", "openvino-max-of-none",
        "openvino-microsoft-fusedconv", "onnxruntime-depthtospace-2**32"])
def test_a_node_that_crashed_the_host_as_it_loaded_is_an_invalid_encoding(
        tmp_path: Path, backend_name: str, model: Any, what: str) -> None:
    # Before: the library died as it read the model in the host's process: OpenVINO's
    # read_model of SIGSEGV (rc -11), ONNX Runtime's session build of SIGFPE (rc -8).
    require_backend(backend_name)
    require_backend("onnx")
    path = tmp_path / "model.onnx"
    path.write_bytes(model())
    done = subprocess.run([sys.executable, "-c", _HOST_LOAD, backend_name, str(path)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    # (The pool's other library is tried next, and refuses it as well.)
    other = "openvino" if backend_name == "onnxruntime" else "onnxruntime"
    assert done.stdout.strip() == (
        f"InvalidEncodingError {backend_name}: cannot read the ONNX model: {what} (nor could "
        f"{other}, for the same reason)"), done.stdout


@pytest.mark.parametrize("backend_name", ["onnxruntime", "openvino"])
@pytest.mark.parametrize(("model", "expected"), [
    (lambda: _one_node("Pad", ["x", "pads"], initializers={"pads": np.array(
        [0, 0, 1, 0, 0, 0, 0, 1], np.int64)}), np.pad(X, [(0, 0), (0, 0), (1, 0), (0, 1)])),
    (lambda: _one_node("Pad", ["x", "pads", "", "axes"], initializers={
        "pads": np.array([1, 1], np.int64), "axes": np.array([3], np.int64)}),
     np.pad(X, [(0, 0), (0, 0), (0, 0), (1, 1)])),  # an omitted optional input between
    (lambda: _one_node("Pad", ["x"], opset=2, pads=[0, 0, 0, 1, 0, 0, 0, 0]),
     np.pad(X, [(0, 0), (0, 0), (0, 0), (1, 0)])),  # before opset 11: pads an attribute
    (lambda: _one_node("DepthToSpace", ["x"], blocksize=2, mode="CRD"),
     X.reshape(1, 1, 2, 2, 2, 2).transpose(0, 1, 4, 2, 5, 3).reshape(1, 1, 4, 4)),
    (lambda: _one_node("SpaceToDepth", ["x"], blocksize=1), X),
    (lambda: _one_node("Max", ["x"]), X),
], ids=["pad", "pad-with-axes", "pad-opset-2", "depthtospace", "spacetodepth", "max"])
def test_valid_neighbours_of_those_nodes_load_and_compute(
        backend_name: str, model: Any, expected: np.ndarray[Any, Any]) -> None:
    graph = _backend(backend_name).load([model()], GraphEncoding.ONNX, CPU)
    (y,) = graph.run({"x": Tensor.from_numpy(X)}).values()
    np.testing.assert_array_equal(y.numpy(), expected)


@pytest.mark.parametrize(("model", "what"), [
    (lambda: _one_node("Pad", ["x", ""]), None),  # counted: the libraries refuse it cleanly
    (lambda: _one_node("Pad", ["x"], opset=10, pads=[0] * 8), None),
    (lambda: _one_node("Pad", ["x"], domain="com.example"), None),  # another domain's
    (lambda: _one_node("Pad", ["x"], domain="ai.onnx"),
     "node 'pad' (Pad) has 1 input: expected at least 2, the inputs ONNX requires of Pad "
     "at opset 18"),
    (lambda: _one_node("Pad", ["x"], opset=10, imports=[("", 10), ("ai.onnx", 11)]),
     "node 'pad' (Pad) has 1 input: expected at least 2, the inputs ONNX requires of Pad "
     "at opset 11"),  # imported twice: the higher
    (lambda: _one_node("Conv", ["x"]), "node 'conv' (Conv) has 1 input: expected at least 2"),
    (lambda: _one_node("NotAnOperator", []), None),
    (lambda: _one_node("Pad", ["x"], domain="com.microsoft"), "node 'pad' (Pad) has 1 input: "
     "expected at least 2, the inputs ONNX Runtime's com.microsoft domain requires of Pad"),
    (lambda: _one_node("Gelu", [], domain="com.microsoft"), None),  # not seen to crash
    (lambda: _one_node("DepthToSpace", ["x"], blocksize=2**31 - 1), None),
    (lambda: _one_node("DepthToSpace", ["x"], blocksize=2**31), "has blocksize 2147483648: "),
    (lambda: _one_node("SpaceToDepth", ["x"], blocksize=0), "has blocksize 0: "),
    (lambda: _one_node("SpaceToDepth", ["x"], blocksize=-2**32), "has blocksize -4294967296: "),
    (lambda: _one_node("DepthToSpace", ["x"], blocksize=-2**63), "has blocksize "
     "-9223372036854775808: "),  # a 10-byte varint
], ids=["pad-empty-pads", "pad-opset-10", "other-domain", "ai.onnx-domain", "two-imports",
        "conv-without-weights", "unknown-operator", "microsoft-pad", "microsoft-other",
        "blocksize-2**31-1", "blocksize-2**31",
        "blocksize-0", "blocksize-negative", "blocksize-int64-min"])
def test_the_checks_read_the_opset_domain_and_attribute_as_the_libraries_do(
        model: Any, what: str | None) -> None:
    require_backend("onnx")
    if what is None:
        _check(model())
        return
    with pytest.raises(InvalidEncodingError, match=r"^onnxruntime: cannot read the ONNX "
                       r"model: ") as info:
        _check(model())
    assert what in str(info.value)


def _pad_in_subgraph(depth: int, opset: int = 18) -> bytes:
    """An If ``if0`` whose then-branch holds an If ``if1`` ... (``depth`` Ifs, built as
    bytes: onnx's own parser stops at protobuf's nesting limit), the innermost branch a
    Pad without its pads input."""
    graph = _field(1, _field(1, b"x") + _field(2, b"y") + _field(4, b"Pad"))
    for level in reversed(range(depth)):
        attribute = _field(1, b"then_branch") + _field(6, graph) + varint(20 << 3) + b"\x05"
        graph = _field(1, _field(1, b"c") + _field(2, b"y") + _field(3, f"if{level}".encode())
                       + _field(4, b"If") + _field(5, attribute))
    return _field(7, graph) + _field(8, varint(2 << 3) + varint(opset))


def test_nodes_in_subgraphs_and_functions_are_checked() -> None:
    require_backend("onnx")
    from onnx import helper

    with pytest.raises(InvalidEncodingError, match=(
            r"node #0 of attribute 'then_branch' of node 'if2' \(Pad\) has 1 input")):
        _check(_pad_in_subgraph(3))
    _check(_pad_in_subgraph(32, opset=2))
    # The innermost graph 98 messages deep; one level more, beyond protobuf's limit.
    with pytest.raises(InvalidEncodingError, match=r"\(messages nested deeper than protobuf's "
                       r"100\)$"):
        _check(_pad_in_subgraph(33))

    def with_function(function_opset: list[Any]) -> bytes:
        pad = helper.make_node("Pad", ["a"], ["b"], pads=[0, 1])
        function = helper.make_function("local", "F", ["a"], ["b"], [pad], function_opset)
        model = helper.make_model(helper.make_graph(
            [helper.make_node("F", ["x"], ["y"], domain="local")], "g", [], []),
            functions=[function],
            opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("local", 1)])
        return bytes(model.SerializeToString())

    _check(with_function([helper.make_opsetid("", 2)]))  # the function's own opset
    with pytest.raises(InvalidEncodingError, match=(
            r"node #0 of function 'F' \(Pad\) has 1 input: expected at least 2, the inputs "
            r"ONNX requires of Pad at opset 18$")):
        _check(with_function([]))  # none of its own: the model's


def test_the_required_inputs_are_those_of_the_installed_onnx() -> None:
    require_backend("onnx")
    import onnx.defs

    from wasinn.backends._onnx_structure import LATEST, required_inputs

    newest = onnx.defs.onnx_opset_version()
    checked = 0
    for schema in onnx.defs.get_all_schemas_with_history():
        if schema.domain not in ("", "ai.onnx"):
            continue
        for opset in range(1, newest + 1):
            try:
                at = onnx.defs.get_schema(schema.name, opset)
            except onnx.defs.SchemaError:
                continue
            assert required_inputs(schema.name, opset) == at.min_input, (schema.name, opset)
            checked += 1
        assert required_inputs(schema.name, LATEST) == onnx.defs.get_schema(
            schema.name).min_input
    assert checked > 3000


def test_the_microsoft_required_inputs_are_those_of_the_installed_onnx_runtime() -> None:
    require_backend("onnxruntime")
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

    from wasinn.backends._onnx_structure import _MICROSOFT_REQUIRED_INPUTS

    schemas = {schema.name.encode(): schema.min_input
               for schema in ort_state.get_all_operator_schema()
               if schema.domain == "com.microsoft"}
    assert {op: schemas[op] for op in _MICROSOFT_REQUIRED_INPUTS} == _MICROSOFT_REQUIRED_INPUTS
