"""Recognising a model's format from its bytes, without importing any backend library.

``detect_encoding`` answers ``autodetect`` for the registry: ONNX and TensorFlow
protobufs are told apart by walking their top-level protobuf fields, OpenVINO IR by its
``<net`` XML root, TorchScript and ``torch.export`` archives by their zip layout,
TensorFlow Lite by the ``TFL3`` flatbuffer identifier, ONNX Runtime's ORT-format models
(encoding ``onnx``) by their ``ORTM`` one (:func:`reads_as_ort_format`), GGUF by its
magic. A ``torch.save`` checkpoint (pickled weights or module: no model any backend
reads) is recognised too, and refused saying how to save a model that loads
(:func:`check_not_torch_save`); it is never unpickled.

The host sniffs a guest's bytes before any sandbox, so what sniffing reads is bounded
whatever the model's size: the first 64 KiB for IR, the first :data:`SNIFF_FIELDS`
top-level protobuf fields, the first :data:`SNIFF_ZIP_ENTRIES` zip entries (read in
place, one name at a time: :mod:`._zip_directory`), each field or entry in constant
time and memory.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterator
from itertools import islice

from wasinn.enums import GraphEncoding
from wasinn.errors import InvalidEncodingError

from ._zip_directory import NoEndRecordError, central_directory_names
from .base import Builders

_ONNX_FIELDS = frozenset({1, 2, 3, 4, 5, 6, 7, 8, 14, 20, 25, 26})  # onnx.ModelProto
_GRAPHDEF_FIELDS = frozenset({1, 2, 3, 4})
_SAVEDMODEL_FIELDS = frozenset({1, 2})

#: The most top-level protobuf fields sniffing reads; the answer is taken from those.
#: A real model is told apart by its first few fields (a length-delimited one, such as
#: ONNX's ``graph``, is skipped at once, whatever its size), written in field number
#: order: ONNX's ``graph`` (7) and ``opset_import`` (8) come before its repeated
#: ``metadata_props`` and ``functions``, and a GraphDef of more nodes than this (field
#: 1, one each) is all nodes as far as read.
SNIFF_FIELDS = 4096
#: The most central directory entries sniffing reads: a TorchScript or torch.export
#: archive names its code, constants or format after an entry for each of its tensors.
SNIFF_ZIP_ENTRIES = 65_536


def read_varint(data: memoryview, pos: int, end: int | None = None) -> tuple[int, int]:
    """The protobuf varint at ``pos`` (before ``end``: the view's end by default) and the
    position after it; ValueError when it is cut short or longer than 64 bits."""
    if end is None:
        end = len(data)
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def protobuf_values(data: bytes | bytearray | memoryview
                    ) -> Iterator[tuple[int, int, memoryview | int | None]]:
    """Each top-level field of a protobuf message, in order: (field number, wire type,
    value): the field's bytes (a view, not a copy) if it is length-delimited, its integer
    if it is a varint, else None.

    Raises ValueError (as it gets there) when the bytes are not a well-formed protobuf
    message.
    """
    view = memoryview(data).cast("B")
    end = len(view)
    pos = 0
    while pos < end:
        key = view[pos]  # one-byte keys (fields 1-15) skip the general varint reader
        if key < 0x80:
            pos += 1
        else:
            key, pos = read_varint(view, pos)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise ValueError("field number 0")
        value: memoryview | int | None = None
        if wire == 0:
            value, pos = read_varint(view, pos)
        elif wire == 1:
            pos += 8
        elif wire == 2:
            length, pos = read_varint(view, pos)
            value = view[pos:pos + length]
            pos += length
        elif wire == 5:
            pos += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
        if pos > end:
            raise ValueError("field runs past the end")
        yield number, wire, value


def protobuf_records(data: bytes | bytearray | memoryview
                     ) -> Iterator[tuple[int, int, memoryview | None]]:
    """Each top-level field of a protobuf message, in order: (field number, wire type,
    the field's bytes if it is length-delimited, else None).

    Raises ValueError (as it gets there) when the bytes are not a well-formed protobuf
    message.
    """
    for number, wire, value in protobuf_values(data):
        yield number, wire, value if isinstance(value, memoryview) else None


def protobuf_fields(data: bytes | bytearray | memoryview, limit: int | None = None
                    ) -> dict[int, int]:
    """Top-level field numbers of a protobuf message -> wire type of their first occurrence,
    among its first ``limit`` fields (all by default).

    Raises ValueError when the bytes read are not a well-formed protobuf message.
    """
    fields: dict[int, int] = {}
    for number, wire, _ in islice(protobuf_records(data), limit):
        fields.setdefault(number, wire)
    return fields


#: ORT-format models are flatbuffers with this file identifier (bytes 4 to 8).
ORT_FORMAT = b"ORTM"


def reads_as_ort_format(data: bytes | bytearray | memoryview, load_format: str = "") -> bool:
    """Whether ONNX Runtime reads ``data`` as an ORT-format model (a flatbuffer), as it
    decides: by ``load_format``, the session config entry
    :data:`~._onnx_check.LOAD_FORMAT_KEY` it is given ("ORT": yes; any other text: no,
    the bytes are read as ONNX), else (empty) by the identifier at bytes 4 to 8 of more
    than 8 bytes."""
    if load_format:
        return load_format == "ORT"
    return len(data) > 8 and bytes(memoryview(data).cast("B")[4:8]) == ORT_FORMAT


#: How far into an IR XML its ``<net`` root element is looked for.
_IR_HEAD = 64 * 1024
#: Before the root element: a declaration, comments, processing instructions, a DOCTYPE.
_PROLOG = re.compile(rb"\s*(?:<\?.*?\?>|<!--.*?-->|<!DOCTYPE[^>]*>)", re.DOTALL)


def _looks_like_ir(data: bytes | bytearray | memoryview) -> bool:
    """Whether ``data`` is XML whose root element is ``<net``: after an optional UTF-8
    byte-order mark, the prolog is skipped item by item, however long its comments (a
    licence header) are, within the first 64 KiB."""
    head = bytes(memoryview(data).cast("B")[:_IR_HEAD]).removeprefix(b"\xef\xbb\xbf")
    pos = 0
    while match := _PROLOG.match(head, pos):
        if match.end() == pos:
            break
        pos = match.end()
    root = head[pos:].lstrip()
    return root.startswith(b"<net") and root[4:5] in (b" ", b">", b"\t", b"\n", b"\r", b"/")


#: How a ``torch.save`` file in its legacy format (before torch 1.6, or with
#: ``_use_new_zipfile_serialization=False``) begins: a protocol 2 pickle of its magic
#: number 0x1950a86a20f9469cfc6c.
_LEGACY_TORCH_SAVE = b"\x80\x02\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")

#: What a ``torch.save`` checkpoint is, and what to give instead.
_TORCH_SAVE_CHECKPOINT = (
    "the model is a torch.save checkpoint (pickled weights or a pickled module), not a "
    "TorchScript or torch.export archive, and is not unpickled (that would run any code "
    "it holds): expected a model saved with torch.jit.save(torch.jit.script(model), f) or "
    "torch.export.save(torch.export.export(model, args), f)")


def _unreadable_zip(who: str, exc: ValueError) -> InvalidEncodingError:
    """What to say of a zip archive that cannot be read for ``exc``: one with no end
    record of its own is most likely cut short (an upload or copy that stopped early)."""
    hint = ": the file may be cut short" if isinstance(exc, NoEndRecordError) else ""
    return InvalidEncodingError(f"{who}: a zip archive that cannot be read ({exc}{hint}): "
                                "expected a TorchScript or torch.export archive")


class _ZipHolds(enum.Enum):
    """What a zip archive holds, judged by its member names."""

    #: A TorchScript archive's ``code/`` or ``constants.pkl``, or a torch.export
    #: archive's ``archive_format``.
    MODEL = enum.auto()
    #: A ``data.pkl`` (which TorchScript archives hold too) and none of a model's names:
    #: a ``torch.save`` checkpoint.
    CHECKPOINT = enum.auto()
    #: Neither.
    OTHER = enum.auto()
    #: More entries than were read, none of those read a model's.
    UNREAD = enum.auto()


def _zip_holds(data: bytes | bytearray | memoryview, limit: int | None) -> _ZipHolds:
    """What the zip archive ``data`` holds, judged by its first ``limit`` entries (all
    for None); the first name of a model's ends the reading.

    Raises ValueError, saying why, for a zip that cannot be read.
    """
    pickle = False
    for index, name in enumerate(central_directory_names(data)):
        if index == limit:
            return _ZipHolds.UNREAD
        if name.endswith((b"/constants.pkl", b"/archive_format")) or b"/code/" in name:
            return _ZipHolds.MODEL
        pickle = pickle or name.endswith(b"/data.pkl")
    return _ZipHolds.CHECKPOINT if pickle else _ZipHolds.OTHER


def check_not_torch_save(backend: str, data: bytes | bytearray | memoryview) -> None:
    """InvalidEncodingError, naming ``backend``: saying how to save a model that loads,
    when ``data`` is a ``torch.save`` checkpoint (its zip format or its legacy pickle);
    saying that the file may be cut short, for a zip with no end of central directory
    record of its own (whose last one found may be that of a ``torch.save`` archive
    stored in it, as a ``.pt2`` stores its sample inputs). Other bytes, a zip that cannot
    be read otherwise included, are left for the library to judge."""
    view = memoryview(data).cast("B")
    found = _is_legacy_torch_save(view)
    if not found and bytes(view[:4]) == b"PK\x03\x04":
        # Every entry: the backend's library reads them all next.
        try:
            found = _zip_holds(view, None) is _ZipHolds.CHECKPOINT
        except NoEndRecordError as exc:
            raise _unreadable_zip(backend, exc) from exc
        except ValueError:
            return
    if found:
        raise InvalidEncodingError(f"{backend}: {_TORCH_SAVE_CHECKPOINT}")


def _is_legacy_torch_save(data: bytes | bytearray | memoryview) -> bool:
    return bytes(memoryview(data).cast("B")[:len(_LEGACY_TORCH_SAVE)]) == _LEGACY_TORCH_SAVE


def _protobuf_encoding(data: bytes | bytearray | memoryview) -> GraphEncoding | None:
    """ONNX or TensorFlow, as the first :data:`SNIFF_FIELDS` top-level fields say (all
    of a message with no more), else None."""
    try:
        fields = protobuf_fields(data, SNIFF_FIELDS)
    except ValueError:
        return None
    numbers = set(fields)
    if 7 in numbers and 8 in numbers and numbers <= _ONNX_FIELDS and fields[7] == 2:
        return GraphEncoding.ONNX
    if numbers <= _SAVEDMODEL_FIELDS and fields.get(2) == 2 and fields.get(1, 0) == 0:
        return GraphEncoding.TENSORFLOW
    if numbers <= _GRAPHDEF_FIELDS and fields.get(1) == 2:
        return GraphEncoding.TENSORFLOW
    return None


def detect_encoding(builders: Builders) -> GraphEncoding:
    """The encoding of ``builders`` judged by content: by a bounded part of it, whatever
    its size (see the module's docstring).

    Raises InvalidEncodingError when no known format matches, saying what was seen (and
    nothing else, whatever the bytes), and for a zip archive of more than
    :data:`SNIFF_ZIP_ENTRIES` entries none of which is a model's (saying to declare the
    encoding).
    """
    if not builders:
        raise InvalidEncodingError("autodetect: no model bytes given (empty builder list)")
    first = builders[0]
    head = bytes(memoryview(first)[:8])
    if _looks_like_ir(first):
        return GraphEncoding.OPENVINO
    if head[4:8] == b"TFL3":
        return GraphEncoding.TENSORFLOWLITE
    if head[:4] == b"GGUF":
        return GraphEncoding.GGML
    if head[:4] == b"PK\x03\x04":
        return _zip_encoding(first)
    if _is_legacy_torch_save(first):
        raise InvalidEncodingError(f"autodetect: {_TORCH_SAVE_CHECKPOINT}")
    found = _protobuf_encoding(first)
    if found is not None:
        return found
    # After the protobufs: a GraphDef whose first node's name begins "ORTM" stays one.
    if reads_as_ort_format(first):
        return GraphEncoding.ONNX
    raise InvalidEncodingError(
        f"autodetect: {len(memoryview(first).cast('B'))} bytes starting {head.hex()} match no "
        "known format: expected ONNX (protobuf, or ONNX Runtime's ORT format), OpenVINO IR "
        "(xml + bin), TorchScript, TensorFlow Lite or a TensorFlow GraphDef/SavedModel"
    )


def _zip_encoding(data: bytes | bytearray | memoryview) -> GraphEncoding:
    """PYTORCH for a TorchScript or torch.export archive; InvalidEncodingError saying
    what it is for another zip archive."""
    try:
        holds = _zip_holds(data, SNIFF_ZIP_ENTRIES)
    except ValueError as exc:
        raise _unreadable_zip("autodetect", exc) from exc
    if holds is _ZipHolds.MODEL:
        return GraphEncoding.PYTORCH
    if holds is _ZipHolds.CHECKPOINT:
        raise InvalidEncodingError(f"autodetect: {_TORCH_SAVE_CHECKPOINT}")
    if holds is _ZipHolds.UNREAD:
        raise InvalidEncodingError(
            f"autodetect: a zip archive of more than {SNIFF_ZIP_ENTRIES} entries, none of "
            f"the first {SNIFF_ZIP_ENTRIES} a TorchScript archive's (code/, constants.pkl) "
            "or a torch.export archive's (archive_format): to have the pytorch backend "
            "read it, declare its encoding (pytorch) rather than autodetect"
        )
    raise InvalidEncodingError(
        "autodetect: a zip archive that is neither a TorchScript archive (no data.pkl) "
        "nor a torch.export archive (no archive_format)"
    )


def check_declared(backend: str, builders: Builders, encoding: GraphEncoding) -> None:
    """InvalidEncodingError, saying so plainly, when the first builder is recognisably
    another format than the ``encoding`` declared (bytes the sniffer does not know are
    left for the library to judge and explain)."""
    try:
        seen = detect_encoding(builders[:1])
    except InvalidEncodingError:
        return
    if seen is not encoding:
        raise InvalidEncodingError(
            f"{backend}: the model was declared {encoding.value} but its first builder is "
            f"{seen.value} bytes"
        )
