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
The host runs this check, so its cost is bounded by the model's size, whatever the
bytes: a vector of tables is read in chunks of its offsets (never a Python object per
element), a table is checked once however many elements refer to it (a bit per byte
of the model remembers where each kind of table was checked; the results the other
elements need are bits too), and the vector elements read, counted each time their
vector is read, may number at most the model's size in bytes (each element takes 4
bytes where vectors are not shared). A 9.5 MB model whose 2.5 M buffers all refer to
one table took 8-10 s and 509 MB before it was refused; it takes 0.05 s and 6 MB. A
table that appears once costs a few microseconds, as before (about 2 s for 6 MB of
800,000 distinct empty buffers). Where a model has several faults, the one named is
the first the walk meets: a table's fields are checked before the next element's
table is read (once, every table of a vector was read first).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

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
#: Offsets of a vector of tables read at a time.
_CHUNK = 1 << 14

Ints = np.ndarray[tuple[int], np.dtype[np.int32]]
Positions = np.ndarray[tuple[int], np.dtype[np.int64]]


class _Buffer:
    """Bounds-checked little-endian reads from the model bytes, and the count of vector
    elements the check may still read."""

    __slots__ = ("data", "left", "size")

    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.size = len(data)
        self.left = self.size

    def need(self, pos: int, length: int, what: str) -> None:
        """ValueError unless ``length`` bytes from ``pos`` lie inside the buffer."""
        if pos < 0 or length < 0 or pos + length > self.size:
            raise ValueError(f"{what} (byte {pos}, {length} bytes) lies outside the "
                             f"{self.size}-byte model")

    def spend(self, count: int, what: str) -> None:
        """Count ``count`` more vector elements read; ValueError past the model's size."""
        self.left -= count
        if self.left < 0:
            raise ValueError(
                f"{what}: the model's vectors, counted each time one is referred to, hold "
                f"more elements than its {self.size} bytes could (expected each vector "
                "referred to once)")

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


class _Tables:
    """A vector of tables: its length, and where its elements point, a chunk at a time."""

    __slots__ = ("buf", "count", "start", "what")

    def __init__(self, buf: _Buffer, start: int, count: int, what: str) -> None:
        self.buf, self.start, self.count, self.what = buf, start, count, what

    def chunks(self) -> Iterator[tuple[int, Positions]]:
        """(index of the first, positions) of the tables the elements point to."""
        self.buf.spend(self.count, self.what)
        for first in range(0, self.count, _CHUNK):
            n = min(_CHUNK, self.count - first)
            at = self.start + 4 * first
            offsets = np.frombuffer(self.buf.data, "<u4", n, at).astype(np.int64)
            yield first, offsets + np.arange(at, at + 4 * n, 4, dtype=np.int64)

    def each(self, seen: _Seen, added: list[int] | None = None
             ) -> Iterator[tuple[int, _Table]]:
        """(index, table) of each element whose table ``seen`` has not had yet (which
        it then has), in order: each table once, named by its first element. ``added``:
        where to list the positions added, for a check that depends on more than the
        table (to forget them after)."""
        for first, positions in self.chunks():
            yield from self.new(seen, first, positions, added)

    def new(self, seen: _Seen, first: int, positions: Positions,
            added: list[int] | None = None) -> Iterator[tuple[int, _Table]]:
        """:meth:`each` for one chunk."""
        for j in np.flatnonzero(~seen.has(positions)).tolist():
            pos = int(positions[j])
            if seen.add(pos):
                if added is not None:
                    added.append(pos)
                yield first + j, self.buf.table(pos, f"{self.what}[{first + j}]")


class _Seen:
    """A bit per byte of the model: the positions where one kind of table was checked
    (or, set by its check, where one has a property its referrers need)."""

    __slots__ = ("bits", "size", "view")

    def __init__(self, size: int) -> None:
        self.size = size
        self.bits = bytearray((size >> 3) + 1)
        self.view = np.frombuffer(self.bits, np.uint8)

    def has(self, positions: Positions) -> np.ndarray[tuple[int], np.dtype[np.bool_]]:
        """For each position, whether it is set (positions outside the model: no)."""
        inside = positions < self.size
        found = np.zeros(positions.size, bool)
        where = positions[inside]
        found[inside] = (self.view[where >> 3] >> (where & 7).astype(np.uint8)) & 1
        return found

    def add(self, pos: int) -> bool:
        """Set ``pos``; whether it was not set before."""
        byte, bit = pos >> 3, 1 << (pos & 7)
        if 0 <= pos < self.size and not self.bits[byte] & bit:
            self.bits[byte] |= bit
            return True
        return not 0 <= pos < self.size  # outside: never set (its table check refuses it)

    def drop(self, pos: int) -> None:
        if 0 <= pos < self.size:
            self.bits[pos >> 3] &= ~(1 << (pos & 7)) & 0xFF


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

    def tables(self, index: int, what: str) -> _Tables | None:
        """A vector-of-tables field (None when absent)."""
        found = self.vector(index, 4, what)
        return None if found is None else _Tables(self.buf, *found, what)

    def require(self, found: object, what: str) -> None:
        if found is None or found is False:
            raise ValueError(f"{self.what} has no {what}")


def _indices(buf: _Buffer, values: Ints | None, limit: int, what: str, *,
             optional: bool = False) -> None:
    """ValueError unless every index is below ``limit`` (or -1 where ``optional``)."""
    if values is None or not values.size:
        return
    buf.spend(values.size, what)
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
    if not subgraphs or not subgraphs.count:
        raise ValueError("the model has no subgraph")
    tensor_counts = _subgraphs(subgraphs, codes, filled)
    _metadata(model, filled.size)
    _signatures(model, tensor_counts)


def _operator_codes(model: _Table) -> int:
    codes = model.tables(1, "Model.operator_codes")
    if codes is None:
        return 0
    for _, code in codes.each(_Seen(model.buf.size)):
        deprecated = code.scalar(0, "<b")
        builtin = code.scalar(3, "<i")
        if deprecated < 0 or builtin < 0:
            raise ValueError(f"{code.what} has a negative builtin code")
        effective = deprecated if deprecated < _PLACEHOLDER_FOR_GREATER_OP_CODES else builtin
        has_name = code.string(1, f"{code.what}.custom_code")
        if effective == _CUSTOM and not has_name:
            raise ValueError(f"{code.what} is CUSTOM but names no custom_code")
    return codes.count


def _buffers(model: _Table) -> np.ndarray[tuple[int], np.dtype[np.bool_]]:
    """Check the model's buffers; for each, whether it holds data (a constant's)."""
    buffers = model.tables(4, "Model.buffers")
    if buffers is None:
        return np.zeros(0, bool)
    size = model.buf.size
    filled = np.zeros(buffers.count, bool)
    seen, full = _Seen(size), _Seen(size)
    for first, positions in buffers.chunks():
        for _, buffer in buffers.new(seen, first, positions):
            data = buffer.vector(0, 1, f"{buffer.what}.data")
            external = _external(buffer, 1, 2, model.buf)
            if bool(data and data[1]) or external:
                full.add(buffer.pos)
        filled[first:first + positions.size] = full.has(positions)
    return filled


def _external(table: _Table, offset_field: int, size_field: int, buf: _Buffer) -> bool:
    """Whether the table has data stored after the flatbuffer (models over 2 GB), whose
    ``offset`` counts from the start of the file and is only meaningful above 1."""
    offset = table.scalar(offset_field, "<Q")
    if offset <= 1:
        return False
    buf.need(offset, table.scalar(size_field, "<Q"), f"{table.what}'s external data")
    return True


def _subgraphs(subgraphs: _Tables, codes: int,
               filled: np.ndarray[tuple[int], np.dtype[np.bool_]]
               ) -> np.ndarray[tuple[int], np.dtype[np.int64]]:
    """Check each subgraph (once, however many elements refer to it); each element's
    tensor count."""
    counts = np.zeros(subgraphs.count, np.int64)
    seen = _Seen(subgraphs.buf.size)
    checks = _Checks(subgraphs.buf.size)
    known: dict[int, int] = {}  # a subgraph's tensor count, by its position
    for first, positions in subgraphs.chunks():
        for _, sg in subgraphs.new(seen, first, positions):
            known[sg.pos] = _subgraph(sg, codes, filled, checks)
        counts[first:first + positions.size] = [known[p] for p in positions.tolist()]
    return counts


class _Checks:
    """What one check of the model remembers across subgraphs: where tensors (and their
    variants) were checked, which of them are constants (their buffer holds data); where
    the subgraph being checked has its operators."""

    __slots__ = ("constant", "operators", "tensors", "variants")

    def __init__(self, size: int) -> None:
        self.tensors, self.constant = _Seen(size), _Seen(size)
        self.operators, self.variants = _Seen(size), _Seen(size)


def _subgraph(sg: _Table, codes: int, filled: np.ndarray[tuple[int], np.dtype[np.bool_]],
              checks: _Checks) -> int:
    """Check one subgraph; its tensor count."""
    tensors = sg.tables(0, f"{sg.what}.tensors")
    sg.require(tensors, "tensors")
    assert tensors is not None
    count = tensors.count
    constants = np.zeros(count, bool)
    for first, positions in tensors.chunks():
        for _, tensor in tensors.new(checks.tensors, first, positions):
            if filled[_tensor(tensor, filled.size, checks.variants)]:
                checks.constant.add(tensor.pos)
        constants[first:first + positions.size] = checks.constant.has(positions)
    for index, name in ((1, "inputs"), (2, "outputs")):
        values = sg.ints(index, f"{sg.what}.{name}")
        sg.require(values, name)
        _indices(sg.buf, values, count, f"{sg.what}.{name}")
    operators = sg.tables(3, f"{sg.what}.operators")
    sg.require(operators, "operators")
    assert operators is not None
    writers = _Writers(sg, constants)
    # An operator's checks depend on this subgraph's tensor count: each is checked once
    # in it, and forgotten after.
    checked: list[int] = []
    for first, positions in operators.chunks():
        before = checks.operators.has(positions)
        for _, op in operators.new(checks.operators, first, positions, checked):
            writers.add(_operator(op, count, codes))
        for pos in _repeats(positions, before).tolist():  # each writes its outputs again
            writers.again(pos)
    for pos in checked:
        checks.operators.drop(pos)
    writers.check()
    sg.string(4, f"{sg.what}.name")
    return count


class _Writers:
    """The single-writer check of one subgraph, an operator at a time: every tensor has
    at most one producer, one operator output, the subgraph's input, or its constant
    data. (The frontend crashed on operators that listed a subgraph input, one tensor
    twice, or a constant among their outputs.)"""

    __slots__ = ("constant", "constants", "once", "repeated", "sg", "twice")

    def __init__(self, sg: _Table, constants: np.ndarray[tuple[int], np.dtype[np.bool_]]
                 ) -> None:
        self.sg, self.constants = sg, constants
        self.once = np.zeros(constants.size, bool)
        self.twice = np.zeros(constants.size, bool)
        self.constant: int | None = None  # the first constant tensor an operator writes
        self.repeated: set[int] = set()  # operators listed more than once, counted twice
        inputs = sg.ints(1, f"{sg.what}.inputs")
        self._produce(inputs if inputs is not None else np.empty(0, np.int32))

    def add(self, outputs: Ints) -> None:
        """An operator's outputs (indices checked)."""
        if self.constant is None and outputs.size and self.constants[outputs].any():
            self.constant = int(outputs[self.constants[outputs]][0])
        self._produce(outputs)

    def again(self, pos: int) -> None:
        """The operator at ``pos``, checked in this subgraph, listed once more."""
        if pos in self.repeated:
            return  # its outputs have two writers already
        self.repeated.add(pos)
        outputs = self.sg.buf.table(pos, "an operator").ints(2, "its outputs")
        if outputs is not None:
            self._produce(outputs)

    def _produce(self, indices: Ints) -> None:
        self.sg.buf.spend(indices.size, f"{self.sg.what}'s operators' outputs")
        unique, counts = np.unique(indices, return_counts=True)
        self.twice[unique[counts > 1]] = True
        self.twice[unique[self.once[unique]]] = True
        self.once[unique] = True

    def check(self) -> None:
        if self.constant is not None:
            raise ValueError(f"{self.sg.what}: an operator writes constant tensor "
                             f"{self.constant}")
        if self.twice.any():
            raise ValueError(
                f"{self.sg.what}: tensor {int(np.flatnonzero(self.twice)[0])} is written by "
                "more than one operator (or is a subgraph input written by an operator)")


def _repeats(positions: Positions, before: np.ndarray[tuple[int], np.dtype[np.bool_]]
             ) -> Positions:
    """The ``positions`` that come again: those seen ``before``, and each later
    occurrence of the others."""
    fresh = np.flatnonzero(~before)
    _, firsts = np.unique(positions[fresh], return_index=True)
    again = np.ones(positions.size, bool)
    again[fresh[firsts]] = False
    return positions[again]


def _tensor(tensor: _Table, buffers: int, variants: _Seen) -> int:
    """Check one tensor; its buffer index. ``variants``: where variant tensors were
    checked."""
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
    variant_tensors = tensor.tables(9, f"{what}.variant_tensors")
    for _, variant in variant_tensors.each(variants) if variant_tensors else ():
        variant.ints(0, f"{variant.what}.shape")
    return buffer


def _quantization(q: _Table) -> None:
    for index, name, size in ((0, "min", 4), (1, "max", 4), (2, "scale", 4),
                              (3, "zero_point", 8)):
        q.vector(index, size, f"{q.what}.{name}")
    details = q.table(5, f"{q.what}.details")
    if details is not None and q.scalar(4, "<B") == _CUSTOM_QUANTIZATION:
        details.vector(0, 1, f"{details.what}.custom")


def _operator(op: _Table, tensors: int, codes: int) -> Ints:
    """Check one operator; the tensors it writes."""
    what = op.what
    opcode = op.scalar(0, "<I")
    if opcode >= codes:
        raise ValueError(f"{what}.opcode_index is {opcode}, outside the model's {codes} "
                         "operator codes")
    inputs = op.ints(1, f"{what}.inputs")
    op.require(inputs, "inputs")
    _indices(op.buf, inputs, tensors, f"{what}.inputs", optional=True)
    outputs = op.ints(2, f"{what}.outputs")
    op.require(outputs, "outputs")
    _indices(op.buf, outputs, tensors, f"{what}.outputs")
    _indices(op.buf, op.ints(8, f"{what}.intermediates"), tensors, f"{what}.intermediates",
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
    _indices(model.buf, model.ints(5, "Model.metadata_buffer"), buffers,
             "Model.metadata_buffer")
    entries = model.tables(6, "Model.metadata")
    for _, entry in entries.each(_Seen(model.buf.size)) if entries else ():
        entry.string(0, f"{entry.what}.name")
        if entry.scalar(1, "<I") >= buffers:
            raise ValueError(f"{entry.what}.buffer is outside the model's {buffers} buffers")


def _signatures(model: _Table, tensor_counts: np.ndarray[tuple[int], np.dtype[np.int64]]
                ) -> None:
    signatures = model.tables(7, "Model.signature_defs")
    maps = _Seen(model.buf.size)
    for _, signature in signatures.each(_Seen(model.buf.size)) if signatures else ():
        index = signature.scalar(4, "<I")
        if index >= tensor_counts.size:
            raise ValueError(f"{signature.what}.subgraph_index is {index}, outside the "
                             f"model's {tensor_counts.size} subgraphs")
        signature.string(2, f"{signature.what}.signature_key")
        limit = int(tensor_counts[index])
        checked: list[int] = []  # a tensor map's check depends on the subgraph
        for field, name in ((0, "inputs"), (1, "outputs")):
            entries = signature.tables(field, f"{signature.what}.{name}")
            for _, entry in entries.each(maps, checked) if entries else ():
                entry.string(0, f"{entry.what}.name")
                if entry.scalar(1, "<I") >= limit:
                    raise ValueError(f"{entry.what}.tensor_index is outside subgraph "
                                     f"{index}'s {limit} tensors")
        for pos in checked:
            maps.drop(pos)
