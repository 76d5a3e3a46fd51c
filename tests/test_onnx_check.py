"""The external data check (:mod:`wasinn.backends._onnx_check`) against bytes the
libraries read otherwise than the check did: a tag of more than 32 bits, ONNX bytes that
carry ONNX Runtime's ORT-format identifier, nesting beyond protobuf's limit; and the cost
of its walk, which the host pays for every ONNX model from a guest."""

from __future__ import annotations

import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

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
