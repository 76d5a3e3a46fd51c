"""Tiny TensorFlow and TensorFlow Lite models, encoded by hand (TensorFlow is not installed).

Both compute ``y = relu(x)`` over an f32 ``x`` of shape ``(1, 4)``:

* :func:`relu_graphdef` is a frozen ``GraphDef`` protobuf, ``Placeholder -> Relu -> Identity``,
  written field by field (tensorflow/core/framework/{graph,node_def,attr_value}.proto);
* :func:`relu_tflite` is a ``TFL3`` flatbuffer with one RELU operator, built with the
  ``flatbuffers`` package following tensorflow/lite/schema/schema.fbs.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from wasinn import GraphEncoding

SHAPE = (1, 4)


# -- protobuf ------------------------------------------------------------------------------
def varint(value: int) -> bytes:
    """``value`` as a protobuf varint (the shortest encoding)."""
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field_bytes(number: int, payload: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def _field_varint(number: int, value: int) -> bytes:
    return varint(number << 3) + varint(value)


_DT_FLOAT = 1


def _attr(key: str, value: bytes) -> bytes:
    # NodeDef.attr is map<string, AttrValue>: field 5, entries {1: key, 2: value}.
    return _field_bytes(5, _field_bytes(1, key.encode()) + _field_bytes(2, value))


def _attr_type(dtype: int) -> bytes:
    return _field_varint(6, dtype)  # AttrValue.type


def _attr_shape(dims: tuple[int, ...]) -> bytes:
    shape = b"".join(_field_bytes(2, _field_varint(1, d)) for d in dims)  # TensorShapeProto.dim
    return _field_bytes(7, shape)  # AttrValue.shape


def _node(name: str, op: str, inputs: tuple[str, ...], attrs: bytes) -> bytes:
    body = _field_bytes(1, name.encode()) + _field_bytes(2, op.encode())
    body += b"".join(_field_bytes(3, i.encode()) for i in inputs)
    return _field_bytes(1, body + attrs)  # GraphDef.node


def relu_graphdef() -> bytes:
    """A frozen GraphDef: x (Placeholder f32[1,4]) -> Relu -> y (Identity)."""
    nodes = _node("x", "Placeholder", (),
                  _attr("dtype", _attr_type(_DT_FLOAT)) + _attr("shape", _attr_shape(SHAPE)))
    nodes += _node("relu", "Relu", ("x",), _attr("T", _attr_type(_DT_FLOAT)))
    nodes += _node("y", "Identity", ("relu",), _attr("T", _attr_type(_DT_FLOAT)))
    versions = _field_bytes(4, _field_varint(1, 1000))  # GraphDef.versions {producer}
    return nodes + versions


def relu_chain(length: int) -> bytes:
    """A frozen GraphDef: x (Placeholder f32[1, 4]) -> Relu ``length`` times -> y
    (Identity), then its versions: ``length`` + 3 top-level fields, one a node."""
    nodes = [_node("x", "Placeholder", (), _attr("dtype", _attr_type(_DT_FLOAT))
                   + _attr("shape", _attr_shape(SHAPE)))]
    nodes += [_node(f"r{i}", "Relu", (f"r{i - 1}" if i else "x",),
                    _attr("T", _attr_type(_DT_FLOAT))) for i in range(length)]
    nodes.append(_node("y", "Identity", (f"r{length - 1}",), _attr("T", _attr_type(_DT_FLOAT))))
    return b"".join(nodes) + _field_bytes(4, _field_varint(1, 1000))  # versions


# -- flatbuffer ----------------------------------------------------------------------------
_RELU = 19  # BuiltinOperator.RELU
_FLOAT32 = 0  # TensorType.FLOAT32


def _int_vector(b: Any, values: tuple[int, ...]) -> int:
    b.StartVector(4, len(values), 4)
    for v in reversed(values):
        b.PrependInt32(v)
    return int(b.EndVector())


def _offset_vector(b: Any, offsets: list[int]) -> int:
    b.StartVector(4, len(offsets), 4)
    for off in reversed(offsets):
        b.PrependUOffsetTRelative(off)
    return int(b.EndVector())


def _tensor(b: Any, name: str, buffer: int) -> int:
    name_off = b.CreateString(name)
    shape = _int_vector(b, SHAPE)
    b.StartObject(8)
    b.PrependUOffsetTRelativeSlot(0, shape, 0)
    b.PrependInt8Slot(1, _FLOAT32, -1)  # -1 default forces FLOAT32 (0) to be written
    b.PrependUint32Slot(2, buffer, 0)
    b.PrependUOffsetTRelativeSlot(3, name_off, 0)
    return int(b.EndObject())


def _subgraph(b: Any) -> int:
    tensors = _offset_vector(b, [_tensor(b, "x", 1), _tensor(b, "y", 2)])
    op_inputs, op_outputs = _int_vector(b, (0,)), _int_vector(b, (1,))
    b.StartObject(5)  # Operator
    b.PrependUint32Slot(0, 0, 1)  # opcode_index 0 (default 1 forces it to be written)
    b.PrependUOffsetTRelativeSlot(1, op_inputs, 0)
    b.PrependUOffsetTRelativeSlot(2, op_outputs, 0)
    operator = b.EndObject()
    sg_inputs, sg_outputs = _int_vector(b, (0,)), _int_vector(b, (1,))
    operators = _offset_vector(b, [operator])
    sg_name = b.CreateString("main")
    b.StartObject(5)  # SubGraph
    b.PrependUOffsetTRelativeSlot(0, tensors, 0)
    b.PrependUOffsetTRelativeSlot(1, sg_inputs, 0)
    b.PrependUOffsetTRelativeSlot(2, sg_outputs, 0)
    b.PrependUOffsetTRelativeSlot(3, operators, 0)
    b.PrependUOffsetTRelativeSlot(4, sg_name, 0)
    return int(b.EndObject())


def relu_tflite() -> bytes:
    """A TFLite model: one subgraph, tensors x, y (f32[1,4]), y = RELU(x)."""
    import flatbuffers  # type: ignore[import-untyped]

    b = flatbuffers.Builder(1024)
    subgraph = _subgraph(b)
    b.StartObject(4)  # OperatorCode
    b.PrependInt8Slot(0, _RELU, 0)  # deprecated_builtin_code
    b.PrependInt32Slot(2, 1, 0)  # version
    b.PrependInt32Slot(3, _RELU, 0)  # builtin_code
    opcode = b.EndObject()
    buffers = []
    for _ in range(3):  # buffer 0 is the empty sentinel; x and y have no constant data
        b.StartObject(1)
        buffers.append(b.EndObject())
    opcodes = _offset_vector(b, [opcode])
    subgraphs = _offset_vector(b, [subgraph])
    buffer_vec = _offset_vector(b, buffers)
    description = b.CreateString("wasinn relu")
    b.StartObject(5)  # Model
    b.PrependUint32Slot(0, 3, 0)  # schema version 3
    b.PrependUOffsetTRelativeSlot(1, opcodes, 0)
    b.PrependUOffsetTRelativeSlot(2, subgraphs, 0)
    b.PrependUOffsetTRelativeSlot(3, description, 0)
    b.PrependUOffsetTRelativeSlot(4, buffer_vec, 0)
    model = b.EndObject()
    b.Finish(model, file_identifier=b"TFL3")
    data = bytes(b.Output())
    assert struct.unpack_from("<4s", data, 4)[0] == b"TFL3"
    return data


def _tensor_info(name: str) -> bytes:
    return _field_bytes(1, name.encode()) + _field_varint(2, _DT_FLOAT)  # TensorInfo


def _map_entry(number: int, key: str, value: bytes) -> bytes:
    return _field_bytes(number, _field_bytes(1, key.encode()) + _field_bytes(2, value))


def relu_saved_model() -> bytes:
    """A ``saved_model.pb`` without variables: the GraphDef above under the ``serve`` tag
    with a ``serving_default`` signature x -> y."""
    meta_info = _field_bytes(4, b"serve")  # MetaInfoDef.tags
    signature = (_map_entry(1, "x", _tensor_info("x:0")) + _map_entry(2, "y", _tensor_info("y:0"))
                 + _field_bytes(3, b"tensorflow/serving/predict"))
    meta_graph = (_field_bytes(1, meta_info) + _field_bytes(2, relu_graphdef())
                  + _map_entry(5, "serving_default", signature))
    return _field_varint(1, 1) + _field_bytes(2, meta_graph)  # SavedModel


#: Each TensorFlow model kind: its maker, encoding and input and output names, for a
#: test parametrized over the frontends (``pytest.mark.parametrize(FRONTEND_ARGS,
#: FRONTEND_CASES, ids=FRONTEND_IDS)``).
FRONTEND_ARGS = ("make", "encoding", "in_name", "out_name")
FRONTEND_CASES: list[tuple[Callable[[], bytes], GraphEncoding, str, str]] = [
    (relu_graphdef, GraphEncoding.TENSORFLOW, "x:0", "y:0"),
    (relu_saved_model, GraphEncoding.TENSORFLOW, "x", "y"),
    (relu_tflite, GraphEncoding.TENSORFLOWLITE, "x", "y"),
]
FRONTEND_IDS = ["graphdef", "savedmodel", "tflite"]
