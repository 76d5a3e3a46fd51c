"""Checking a TensorFlow Lite flatbuffer before OpenVINO's frontend reads it.

OpenVINO's TFLite frontend follows the flatbuffer's offsets and indices as they are: it
runs no flatbuffers ``Verifier`` and does not bound-check the tensor indices of a
subgraph's or an operator's inputs and outputs, a tensor's buffer index or an
operator's ``opcode_index``, and dereferences optional fields (a tensor's name, an
operator's inputs) without a null check. One changed byte of a valid model (an input
index pushed past its vector) made it read wild memory and kill the host with SIGSEGV.
Guests hand the host arbitrary bytes, so :func:`check_tflite` walks every table, vector
and string of ``tensorflow/lite/schema/schema.fbs`` that the frontend reads, checks that
each lies inside the buffer, and checks every index against the vector it indexes.
The frontend itself then runs in a throw-away process (see :mod:`._ovread`): this check
gives clear errors and keeps malformed bytes away from unchecked C++, the child keeps
whatever this check misses away from the host.

Refused although valid: sparse tensors (``Tensor.sparsity``), since densifying them
follows index arrays stored in the model that this check does not interpret.

Cost: a few microseconds per tensor and operator; integer vectors are checked with numpy.
"""

from __future__ import annotations

import struct

import numpy as np

_IDENTIFIER = b"TFL3"
#: ``BuiltinOperator.CUSTOM``: such an operator's code names it in ``custom_code``.
_CUSTOM = 32
#: Below this, ``OperatorCode.deprecated_builtin_code`` is the operator; from it on,
#: ``builtin_code`` is (``BuiltinOperator.PLACEHOLDER_FOR_GREATER_OP_CODES``).
_PLACEHOLDER_FOR_GREATER_OP_CODES = 127
#: ``BuiltinOptions`` union members whose vectors the frontend reads: ReshapeOptions
#: (new_shape) and SqueezeOptions (squeeze_dims, dereferenced without a null check).
_RESHAPE_OPTIONS, _SQUEEZE_OPTIONS = 17, 30
_CUSTOM_QUANTIZATION = 1  # QuantizationDetails union: CustomQuantization


class _Buffer:
    """Bounds-checked little-endian reads from the model bytes."""

    __slots__ = ("data", "size")

    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.size = len(data)

    def need(self, pos: int, length: int, what: str) -> None:
        """ValueError unless ``length`` bytes from ``pos`` lie inside the buffer."""
        if pos < 0 or length < 0 or pos + length > self.size:
            raise ValueError(f"{what} (byte {pos}, {length} bytes) lies outside the "
                             f"{self.size}-byte model")

    def read(self, fmt: str, pos: int, what: str) -> int:
        self.need(pos, struct.calcsize(fmt), what)
        value: int = struct.unpack_from(fmt, self.data, pos)[0]
        return value

    def deref(self, pos: int, what: str) -> int:
        """The position a ``uoffset`` stored at ``pos`` points to."""
        return pos + self.read("<I", pos, what)

    def table(self, pos: int, what: str) -> _Table:
        return _Table(self, pos, what)

    def vector(self, pos: int, item_size: int, what: str) -> tuple[int, int]:
        """(position of the first item, item count) of the vector at ``pos``."""
        count = self.read("<I", pos, what)
        self.need(pos + 4, count * item_size, what)
        return pos + 4, count


class _Table:
    """One flatbuffer table: its vtable checked, its fields read by index."""

    __slots__ = ("buf", "pos", "size", "vsize", "vtable", "what")

    def __init__(self, buf: _Buffer, pos: int, what: str) -> None:
        self.buf, self.pos, self.what = buf, pos, what
        self.vtable = pos - buf.read("<i", pos, what)
        self.vsize = buf.read("<H", self.vtable, f"{what}'s vtable")
        self.size = buf.read("<H", self.vtable + 2, f"{what}'s vtable")
        if self.vsize < 4 or self.vsize % 2 or self.size < 4:
            raise ValueError(f"{what} has a malformed vtable")
        buf.need(self.vtable, self.vsize, f"{what}'s vtable")
        buf.need(pos, self.size, what)

    def field(self, index: int, size: int) -> int | None:
        """The position of field ``index`` (``size`` bytes inline), None when absent."""
        slot = 4 + 2 * index
        if slot >= self.vsize:
            return None
        offset = self.buf.read("<H", self.vtable + slot, self.what)
        if offset == 0:
            return None
        if offset + size > self.size:
            raise ValueError(f"{self.what}: field {index} lies outside its table")
        return self.pos + offset

    def scalar(self, index: int, fmt: str, default: int = 0) -> int:
        pos = self.field(index, struct.calcsize(fmt))
        return default if pos is None else self.buf.read(fmt, pos, self.what)

    def target(self, index: int, what: str) -> int | None:
        """Where the offset field ``index`` points (None when absent)."""
        pos = self.field(index, 4)
        return None if pos is None else self.buf.deref(pos, what)

    def table(self, index: int, what: str) -> _Table | None:
        pos = self.target(index, what)
        return None if pos is None else self.buf.table(pos, what)

    def vector(self, index: int, item_size: int, what: str) -> tuple[int, int] | None:
        pos = self.target(index, what)
        return None if pos is None else self.buf.vector(pos, item_size, what)

    def ints(self, index: int, what: str) -> np.ndarray[tuple[int], np.dtype[np.int32]] | None:
        """An ``[int]`` vector field (None when absent)."""
        found = self.vector(index, 4, what)
        if found is None:
            return None
        start, count = found
        return np.frombuffer(self.buf.data, "<i4", count, start)

    def string(self, index: int, what: str) -> bool:
        """Whether the string field ``index`` is present; ValueError if it is malformed."""
        found = self.vector(index, 1, what)
        if found is None:
            return False
        start, count = found
        if self.buf.read("<B", start + count, what) != 0:
            raise ValueError(f"{what} is not NUL-terminated")
        return True

    def tables(self, index: int, what: str) -> list[_Table] | None:
        """A vector-of-tables field (None when absent)."""
        found = self.vector(index, 4, what)
        if found is None:
            return None
        start, count = found
        return [self.buf.table(self.buf.deref(start + 4 * i, what), f"{what}[{i}]")
                for i in range(count)]

    def require(self, found: object, what: str) -> None:
        if found is None or found is False:
            raise ValueError(f"{self.what} has no {what}")


def _indices(values: np.ndarray[tuple[int], np.dtype[np.int32]] | None, limit: int, what: str,
             *, optional: bool = False) -> None:
    """ValueError unless every index is below ``limit`` (or -1 where ``optional``)."""
    if values is None or not values.size:
        return
    low = -1 if optional else 0
    if int(values.min()) < low or int(values.max()) >= limit:
        bad = values[(values < low) | (values >= limit)][0]
        raise ValueError(f"{what} holds index {int(bad)}, outside [{low}, {limit})")


def check_tflite(data: bytes | bytearray | memoryview) -> None:
    """Raise ValueError, naming the first problem, unless ``data`` is a TFLite flatbuffer
    whose every offset, length and index that OpenVINO's frontend follows is in range."""
    buf = _Buffer(memoryview(data).cast("B"))
    buf.need(0, 8, "the flatbuffer header")
    if bytes(buf.data[4:8]) != _IDENTIFIER:
        raise ValueError("no TFL3 file identifier at bytes 4-8")
    model = buf.table(buf.deref(0, "the root offset"), "Model")
    codes = _operator_codes(model)
    filled = _buffers(model)
    subgraphs = model.tables(2, "Model.subgraphs")
    if not subgraphs:
        raise ValueError("the model has no subgraph")
    tensor_counts = [_subgraph(sg, codes, filled) for sg in subgraphs]
    _metadata(model, len(filled))
    _signatures(model, tensor_counts)


def _operator_codes(model: _Table) -> int:
    codes = model.tables(1, "Model.operator_codes") or []
    for code in codes:
        deprecated = code.scalar(0, "<b")
        builtin = code.scalar(3, "<i")
        if deprecated < 0 or builtin < 0:
            raise ValueError(f"{code.what} has a negative builtin code")
        effective = deprecated if deprecated < _PLACEHOLDER_FOR_GREATER_OP_CODES else builtin
        has_name = code.string(1, f"{code.what}.custom_code")
        if effective == _CUSTOM and not has_name:
            raise ValueError(f"{code.what} is CUSTOM but names no custom_code")
    return len(codes)


def _buffers(model: _Table) -> list[bool]:
    """Check the model's buffers; for each, whether it holds data (a constant's)."""
    filled = []
    for buffer in model.tables(4, "Model.buffers") or []:
        data = buffer.vector(0, 1, f"{buffer.what}.data")
        external = _external(buffer, 1, 2, model.buf)
        filled.append(bool(data and data[1]) or external)
    return filled


def _external(table: _Table, offset_field: int, size_field: int, buf: _Buffer) -> bool:
    """Whether the table has data stored after the flatbuffer (models over 2 GB), whose
    ``offset`` counts from the start of the file and is only meaningful above 1."""
    offset = table.scalar(offset_field, "<Q")
    if offset <= 1:
        return False
    buf.need(offset, table.scalar(size_field, "<Q"), f"{table.what}'s external data")
    return True


def _subgraph(sg: _Table, codes: int, filled: list[bool]) -> int:
    """Check one subgraph; its tensor count."""
    tensors = sg.tables(0, f"{sg.what}.tensors")
    sg.require(tensors, "tensors")
    assert tensors is not None
    constants = np.array([filled[_tensor(tensor, len(filled))] for tensor in tensors], bool)
    count = len(tensors)
    for index, name in ((1, "inputs"), (2, "outputs")):
        values = sg.ints(index, f"{sg.what}.{name}")
        sg.require(values, name)
        _indices(values, count, f"{sg.what}.{name}")
    operators = sg.tables(3, f"{sg.what}.operators")
    sg.require(operators, "operators")
    written = [_operator(op, count, codes) for op in operators or ()]
    _single_writer(sg, written, constants)
    sg.string(4, f"{sg.what}.name")
    return count


def _single_writer(sg: _Table, written: list[np.ndarray[tuple[int], np.dtype[np.int32]]],
                   constants: np.ndarray[tuple[int], np.dtype[np.bool_]]) -> None:
    """ValueError unless every tensor has at most one producer: one operator output, the
    subgraph's input, or its constant data. (The frontend crashed on operators that
    listed a subgraph input, one tensor twice, or a constant among their outputs.)"""
    inputs = sg.ints(1, f"{sg.what}.inputs")
    outputs = np.concatenate([np.empty(0, np.int32), *written])
    if outputs.size and constants[outputs].any():
        raise ValueError(f"{sg.what}: an operator writes constant tensor "
                         f"{int(outputs[constants[outputs]][0])}")
    produced = np.concatenate([inputs if inputs is not None else np.empty(0, np.int32),
                               outputs])
    unique, counts = np.unique(produced, return_counts=True)
    if unique.size != produced.size:
        raise ValueError(f"{sg.what}: tensor {int(unique[counts > 1][0])} is written by more "
                         "than one operator (or is a subgraph input written by an operator)")


def _tensor(tensor: _Table, buffers: int) -> int:
    """Check one tensor; its buffer index."""
    what = tensor.what
    tensor.ints(0, f"{what}.shape")
    buffer = tensor.scalar(2, "<I")
    if buffer >= buffers:
        raise ValueError(f"{what}.buffer is {buffer}, outside the model's {buffers} buffers")
    tensor.require(tensor.string(3, f"{what}.name"), "name")
    quantization = tensor.table(4, f"{what}.quantization")
    if quantization is not None:
        _quantization(quantization)
    if tensor.field(6, 4) is not None:
        raise ValueError(f"{what} is sparse (Tensor.sparsity): sparse tensors are not "
                         "supported, expected dense constants")
    tensor.ints(7, f"{what}.shape_signature")
    for variant in tensor.tables(9, f"{what}.variant_tensors") or ():
        variant.ints(0, f"{variant.what}.shape")
    return buffer


def _quantization(q: _Table) -> None:
    for index, name, size in ((0, "min", 4), (1, "max", 4), (2, "scale", 4),
                              (3, "zero_point", 8)):
        q.vector(index, size, f"{q.what}.{name}")
    details = q.table(5, f"{q.what}.details")
    if details is not None and q.scalar(4, "<B") == _CUSTOM_QUANTIZATION:
        details.vector(0, 1, f"{details.what}.custom")


def _operator(op: _Table, tensors: int, codes: int
              ) -> np.ndarray[tuple[int], np.dtype[np.int32]]:
    """Check one operator; the tensors it writes."""
    what = op.what
    opcode = op.scalar(0, "<I")
    if opcode >= codes:
        raise ValueError(f"{what}.opcode_index is {opcode}, outside the model's {codes} "
                         "operator codes")
    inputs = op.ints(1, f"{what}.inputs")
    op.require(inputs, "inputs")
    _indices(inputs, tensors, f"{what}.inputs", optional=True)
    outputs = op.ints(2, f"{what}.outputs")
    op.require(outputs, "outputs")
    _indices(outputs, tensors, f"{what}.outputs")
    _indices(op.ints(8, f"{what}.intermediates"), tensors, f"{what}.intermediates",
             optional=True)
    _options(op, 3, 4, "builtin_options")
    _options(op, 11, 12, "builtin_options_2")
    op.vector(5, 1, f"{what}.custom_options")
    op.vector(7, 1, f"{what}.mutating_variable_inputs")
    _external(op, 9, 10, op.buf)
    assert outputs is not None
    return outputs


def _options(op: _Table, type_field: int, value_field: int, name: str) -> None:
    """A union of option tables: the table checked; the vectors the frontend reads too."""
    options = op.table(value_field, f"{op.what}.{name}")
    if options is None or name != "builtin_options":
        return
    kind = op.scalar(type_field, "<B")
    if kind == _RESHAPE_OPTIONS:
        options.ints(0, f"{options.what}.new_shape")
    elif kind == _SQUEEZE_OPTIONS:
        options.require(options.ints(0, f"{options.what}.squeeze_dims"), "squeeze_dims")


def _metadata(model: _Table, buffers: int) -> None:
    _indices(model.ints(5, "Model.metadata_buffer"), buffers, "Model.metadata_buffer")
    for entry in model.tables(6, "Model.metadata") or ():
        entry.string(0, f"{entry.what}.name")
        if entry.scalar(1, "<I") >= buffers:
            raise ValueError(f"{entry.what}.buffer is outside the model's {buffers} buffers")


def _signatures(model: _Table, tensor_counts: list[int]) -> None:
    for signature in model.tables(7, "Model.signature_defs") or ():
        index = signature.scalar(4, "<I")
        if index >= len(tensor_counts):
            raise ValueError(f"{signature.what}.subgraph_index is {index}, outside the "
                             f"model's {len(tensor_counts)} subgraphs")
        signature.string(2, f"{signature.what}.signature_key")
        for field, name in ((0, "inputs"), (1, "outputs")):
            for entry in signature.tables(field, f"{signature.what}.{name}") or ():
                entry.string(0, f"{entry.what}.name")
                if entry.scalar(1, "<I") >= tensor_counts[index]:
                    raise ValueError(f"{entry.what}.tensor_index is outside subgraph "
                                     f"{index}'s {tensor_counts[index]} tensors")
