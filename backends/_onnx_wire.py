"""Reading ONNX protobuf bytes field by field, as the libraries' parser reads them.

ONNX Runtime and OpenVINO parse models with protobuf's C++ parser, which truncates a tag
of more than 32 bits to its low 32 bits: a field number above protobuf's last reads as
another field. The readers here raise ValueError for one, so that the checks of
:mod:`._onnx_check` and :mod:`._onnx_structure` never skip a field the libraries read.
Positions and views into the bytes are handed out, never copies.
"""

from __future__ import annotations

from collections.abc import Iterator

from .formats import protobuf_values, read_varint

#: Protobuf's last field number. A larger one comes from a tag of more than 32 bits,
#: which protobuf's C++ parser (ONNX Runtime's, OpenVINO's) truncates to its low 32 bits
#: (another field, which it reads) and onnx's refuses.
LAST_FIELD = 2**29 - 1


def onnx_values(data: bytes | bytearray | memoryview
                ) -> Iterator[tuple[int, int, memoryview | int | None]]:
    """:func:`~.formats.protobuf_values`, also raising ValueError for a field number
    above :data:`LAST_FIELD` (where the libraries' parser reads another field)."""
    for number, wire, value in protobuf_values(data):
        if number > LAST_FIELD:
            raise ValueError(f"field number {number} is above protobuf's {LAST_FIELD}")
        yield number, wire, value


def onnx_records(data: bytes | bytearray | memoryview
                 ) -> Iterator[tuple[int, int, memoryview | None]]:
    """:func:`~.formats.protobuf_records`, checked as :func:`onnx_values` checks."""
    for number, wire, value in onnx_values(data):
        yield number, wire, value if isinstance(value, memoryview) else None


def message_fields(view: memoryview, start: int, end: int) -> Iterator[tuple[int, int, int]]:
    """The length-delimited fields of the message at ``view[start:end]``, in order:
    (field number, start, end) of each one's bytes in ``view``; the other fields are
    skipped. ValueError (as it gets there) for bytes that are no protobuf message, or a
    field number above :data:`LAST_FIELD`. (:func:`~.formats.protobuf_values` reads the
    same, slower: the checks' walks visit every node of a model.)"""
    pos = start
    while pos < end:
        key = view[pos]
        pos += 1
        if key >= 0x80:
            key, pos = read_varint(view, pos - 1, end)
            if key >> 3 > LAST_FIELD:
                raise ValueError(f"field number {key >> 3} is above protobuf's {LAST_FIELD}")
        wire = key & 7
        if key < 8:
            raise ValueError("field number 0")
        if wire == 2:
            length = view[pos] if pos < end else 0x80
            if length < 0x80:
                pos += 1
            else:
                length, pos = read_varint(view, pos, end)
            first = pos
            pos += length
            if pos > end:
                raise ValueError("field runs past the end")
            yield key >> 3, first, pos
            continue
        if wire == 0:
            _, pos = read_varint(view, pos, end)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
        if pos > end:
            raise ValueError("field runs past the end")
