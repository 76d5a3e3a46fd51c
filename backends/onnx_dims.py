"""The shapes an ONNX model declares for its graph inputs and outputs, symbolic
dimension names included, read from its bytes without any backend library.

ONNX Runtime reports a symbolic dimension's name (``dim_param``) but OpenVINO keeps only
``?``, and a :class:`~wasinn.backends.base.TensorSpec` keeps neither: both read ``None``.
The names say which dynamic dimensions are the same one: an exporter names the batch
axis alike on the inputs and outputs that have it (``torch.onnx.export`` with
``dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}}``, or the dynamo exporter's
``s0``), and a transposed output ``z = x.T`` of ``x: [n, m]`` is declared ``[m, n]``.
Dynamic batching reads them (:mod:`wasinn.actors._batch_axes`) to tell, at load, an
output that has the inputs' batch axis first from one that does not, on either backend;
the backends' input check (:class:`~wasinn.backends._graphio.InputChecker`) to refuse
inputs whose dimensions of one name are given different sizes, which the ONNX standard
says are one size.

Only the graph's value declarations are read; its nodes and weights are skipped, each
in constant time, as :mod:`.formats` sniffs.
"""

from __future__ import annotations

from collections.abc import Iterator

from .formats import protobuf_values

#: One declared dimension: its size, its symbolic name, or None (neither is declared).
DeclaredDim = int | str | None

#: ONNX field numbers: ModelProto.graph; GraphProto.input, .output (ValueInfoProto);
#: ValueInfoProto.name, .type; TypeProto.tensor_type; TypeProto.Tensor.shape;
#: TensorShapeProto.dim; Dimension.dim_value, .dim_param.
_GRAPH, _INPUT, _OUTPUT, _NAME, _TYPE, _TENSOR_TYPE, _SHAPE = 7, 11, 12, 1, 2, 1, 2
_DIM, _DIM_VALUE, _DIM_PARAM = 1, 1, 2


def declared_dims(model: bytes | bytearray | memoryview
                  ) -> dict[str, tuple[DeclaredDim, ...]]:
    """Graph input and output name -> the dimensions ``model`` declares for it (a size,
    a symbolic name, or None for a dimension declared with neither). A value declared
    without a shape (of unknown rank) is left out, as is everything of bytes that are not
    a well-formed ONNX protobuf (an ORT-format model): nothing is known of those."""
    dims: dict[str, tuple[DeclaredDim, ...]] = {}
    try:
        graph = _first(model, _GRAPH)
        if graph is None:
            return {}
        for number, _, info in protobuf_values(graph):
            if number not in (_INPUT, _OUTPUT) or not isinstance(info, memoryview):
                continue
            name = _first(info, _NAME)
            shape = _first(_first(_first(info, _TYPE), _TENSOR_TYPE), _SHAPE)
            if name is None or shape is None:
                continue
            dims[bytes(name).decode("utf-8", "replace")] = tuple(
                _dim(dim) for dim in _all(shape, _DIM))
    except ValueError:  # not well-formed: no ONNX protobuf
        return {}
    return dims


def _dim(dim: memoryview) -> DeclaredDim:
    value: DeclaredDim = None
    for number, _, field in protobuf_values(dim):
        if number == _DIM_VALUE and isinstance(field, int):
            value = field if field < 1 << 63 else None  # (a negative int64)
        elif number == _DIM_PARAM and isinstance(field, memoryview) and len(field):
            value = bytes(field).decode("utf-8", "replace")
    return value


def _all(message: memoryview, number: int) -> Iterator[memoryview]:
    for n, _, value in protobuf_values(message):
        if n == number and isinstance(value, memoryview):
            yield value


def _first(message: bytes | bytearray | memoryview | None, number: int) -> memoryview | None:
    """The first length-delimited field ``number`` of a protobuf message (None if absent)."""
    if message is None:
        return None
    return next(_all(memoryview(message), number), None)
