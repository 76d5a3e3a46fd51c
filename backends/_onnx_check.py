"""Refusing ONNX models that keep tensor data in external files.

An ONNX ``TensorProto`` may say ``data_location: EXTERNAL`` and name a file in its
``external_data`` entries (``location``, ``offset``, ``length``); the reader then loads
that file's bytes as the tensor's values. ONNX Runtime resolves the path against the
host process's working directory, ``..`` segments included, and OpenVINO accepts
absolute paths: a guest's model could make any file the host can read part of its
weights, then read it back through inference. Models from guests come as one buffer and
must embed their weights, so :func:`check_external_data` raises SecurityError for any
tensor that refers to external data, before either backend parses the model. A model the
host itself read from a file (a registry entry: ``LoadOptions.source``) may keep its
weights next to it, as models beyond protobuf's 2 GB must: each location must then be a
relative path that stays inside that file's folder once resolved (no ``..`` or symlink
leading out), naming a file there. A sandboxed graph's process may not read that folder
(Landlock): the host reads and checks the files, and the process is handed their bytes
(``LoadOptions.external_data``, :func:`given_external_data`).

Every place onnx.proto lets a ``TensorProto`` appear is walked (field numbers checked
against onnx 1.23's descriptors): ModelProto.graph (7), .training_info (20) and
.functions (25); GraphProto.node (1), .initializer (5), .sparse_initializer (15);
NodeProto.attribute (5); AttributeProto.t (5), .g (6), .tensors (10), .graphs (11),
.sparse_tensor (22), .sparse_tensors (23); SparseTensorProto.values (1), .indices (2);
FunctionProto.node (7), .attribute_proto (11); TrainingInfoProto.initialization (1),
.algorithm (2). The walk keeps one field iterator per open message on an explicit
stack (no recursion limit to hit, memory bounded by the nesting depth, never by the
number of nodes) and reads positions in the bytes: weights (``raw_data``) are skipped,
never copied. A node or attribute whose bytes hold no first byte of a tag of the fields
that can hold tensors (the attributes; an attribute's tensors and graphs) cannot hold
one and is skipped unread: a model of millions of empty nodes is searched at C speed.
Bytes that do not parse as protobuf are refused as InvalidEncodingError (what cannot be
walked cannot be vouched for), and so are two things the libraries' parsers read but
the walk would skip: a field number above protobuf's last (a tag of more than 32 bits,
which protobuf's C++ parser truncates to another field) and messages nested deeper than
protobuf's limit of 100. ORT-format flatbuffers carry no file references: they are
skipped where ONNX Runtime reads the bytes as one (:func:`reads_as_ort_format`), never
for OpenVINO, which reads any bytes as ONNX.

:func:`check_external_data` also runs :mod:`._onnx_structure`'s check, which refuses
nodes whose structure alone crashed a library as it read the model (a Pad without its
pads input, a DepthToSpace blocksize of 2^32): every load of ONNX bytes by either
backend comes through it before the library parses them.
"""

from __future__ import annotations

import enum
import os
import re
from collections.abc import Collection, Iterable, Iterator, Mapping
from pathlib import Path

from wasinn.errors import (
    InvalidEncodingError,
    NotFoundError,
    SecurityError,
    UnsupportedOperationError,
)
from wasinn.files import OutsideError, read_regular

from ._onnx_structure import check_structure
from ._onnx_wire import message_fields, onnx_records, onnx_values
from .base import in_sandbox
from .formats import ORT_FORMAT, reads_as_ort_format

__all__ = ["LOAD_FORMAT_KEY", "ORT_FORMAT", "check_external_data", "external_data_folder",
           "given_external_data", "onnx_records", "read_external_data", "reads_as_ort_format"]


class _Kind(enum.Enum):
    MODEL = enum.auto()
    GRAPH = enum.auto()
    FUNCTION = enum.auto()
    TRAINING = enum.auto()
    NODE = enum.auto()
    ATTRIBUTE = enum.auto()
    SPARSE = enum.auto()
    TENSOR = enum.auto()


#: For each message, the fields that hold messages to walk, and what those are.
_CHILDREN: dict[_Kind, dict[int, _Kind]] = {
    _Kind.MODEL: {7: _Kind.GRAPH, 20: _Kind.TRAINING, 25: _Kind.FUNCTION},
    _Kind.GRAPH: {1: _Kind.NODE, 5: _Kind.TENSOR, 15: _Kind.SPARSE},
    _Kind.FUNCTION: {7: _Kind.NODE, 11: _Kind.ATTRIBUTE},
    _Kind.TRAINING: {1: _Kind.GRAPH, 2: _Kind.GRAPH},
    _Kind.NODE: {5: _Kind.ATTRIBUTE},
    _Kind.ATTRIBUTE: {5: _Kind.TENSOR, 6: _Kind.GRAPH, 10: _Kind.TENSOR, 11: _Kind.GRAPH,
                      22: _Kind.SPARSE, 23: _Kind.SPARSE},
    _Kind.SPARSE: {1: _Kind.TENSOR, 2: _Kind.TENSOR},
}
#: TensorProto fields: name, external_data (StringStringEntryProto), data_location.
_NAME, _EXTERNAL_DATA, _DATA_LOCATION = 8, 13, 14
#: StringStringEntryProto: key, value.
_KEY, _VALUE = 1, 2
#: The session config entry that tells ONNX Runtime which format the bytes are in.
LOAD_FORMAT_KEY = "session.load_model_format"
#: Protobuf's parsers refuse messages nested deeper than this (a model as well).
_DEPTH = 100
#: Messages larger than this are walked without the search (they hold children anyway).
_SEARCHED = 4096


def _first_bytes(numbers: Iterable[int]) -> re.Pattern[bytes]:
    """Any first byte of a tag of the length-delimited fields ``numbers``, however long
    its encoding: a tag's first byte holds its low 7 bits, with or without the
    continuation bit."""
    low = {(number << 3 | 2) & 0x7F for number in numbers}
    return re.compile(b"[" + b"".join(re.escape(bytes([b, b | 0x80])) for b in low) + b"]")


#: The messages whose children are sought by their tags' first bytes before a walk.
_SOUGHT = {kind: _first_bytes(_CHILDREN[kind]) for kind in (_Kind.NODE, _Kind.ATTRIBUTE)}


def check_external_data(backend: str, data: bytes | bytearray | memoryview,
                        folder: Path | None = None, *,
                        given: Collection[str] | None = None,
                        ort_format: bool | None = None) -> frozenset[str]:
    """The external data files the ONNX model ``data`` names (their locations, as the
    model writes them; empty for a model that embeds its weights), where it may: with no
    ``folder``, SecurityError (naming the tensor) if any tensor refers to external data;
    with one, SecurityError for a location that is absolute or leads outside it,
    NotFoundError for one that names no file there; with ``given`` (the locations of the
    files the host read and checked for a sandbox process, see
    :func:`given_external_data`), SecurityError for a location not among them.
    InvalidEncodingError if ``data`` is no protobuf message the libraries read alike
    (see the module docstring), or with a node whose structure alone crashed a library
    reading it (:func:`._onnx_structure.check_structure`). ``ort_format``: whether the
    library reads ``data`` as an ORT-format model, which holds no file references and
    is not checked (None: as ONNX Runtime decides with no load format set,
    :func:`reads_as_ort_format`; False for OpenVINO).

    The files are checked by their paths here; read them with :func:`read_external_data`,
    which checks the files it opened, and hand the library their bytes: a library that
    opens them itself later would open whatever the paths name by then."""
    view = memoryview(data).cast("B")
    if reads_as_ort_format(view) if ort_format is None else ort_format:
        return frozenset()
    inside = None if folder is None else os.path.realpath(folder)
    try:
        locations = frozenset(_tensor_locations(backend, view, inside, given))
    except ValueError as exc:
        raise InvalidEncodingError(
            f"{backend}: cannot read the ONNX model: not a well-formed protobuf ({exc})"
        ) from exc
    check_structure(backend, view)  # (every ONNX model either library reads comes here)
    return locations


def _tensor_locations(backend: str, view: memoryview, inside: str | None,
                      given: Collection[str] | None) -> Iterator[str]:
    """The external data location of each tensor of the model ``view`` that has one
    (a location once per tensor), each checked by :func:`_check_tensor`. ValueError
    (as it gets there) for bytes the walk cannot read (see the module docstring)."""
    stack = [(_Kind.MODEL, message_fields(view, 0, len(view)))]
    while stack:
        kind, fields = stack[-1]
        children = _CHILDREN[kind]
        for number, start, end in fields:
            child = children.get(number)
            if child is None or start == end:  # an empty message holds nothing
                continue
            if child is _Kind.TENSOR:
                location = _check_tensor(backend, view[start:end], inside, given)
                if location is not None:
                    yield location
                continue
            sought = _SOUGHT.get(child)
            if sought is not None and end - start <= _SEARCHED and not sought.search(
                    view, start, end):
                continue  # no tag of a field that holds tensors: nothing to walk
            if len(stack) >= _DEPTH:
                raise ValueError(f"messages nested deeper than protobuf's {_DEPTH}")
            stack.append((child, message_fields(view, start, end)))
            break
        else:
            stack.pop()


def given_external_data(backend: str, data: bytes | bytearray | memoryview,
                        given: Mapping[str, bytes], *,
                        ort_format: bool | None = None) -> dict[str, bytes]:
    """The bytes of each external data file the ONNX model ``data`` names, from ``given``
    (location -> bytes): in a sandboxed graph's process, which may not read the model's
    folder, the files the host read there and checked (``LoadOptions.external_data``).
    SecurityError for a location the host did not read, InvalidEncodingError as
    :func:`check_external_data` raises it (``ort_format``: as it takes it)."""
    return {location: given[location] for location in check_external_data(
        backend, data, given=given.keys(), ort_format=ort_format)}


def read_external_data(backend: str, folder: Path, locations: Iterable[str]
                       ) -> dict[str, bytes]:
    """The bytes of each external data file at ``locations`` (checked by
    :func:`check_external_data`) in ``folder``, each checked once opened: a file swapped
    since for a link leading out of the folder is SecurityError, not read."""
    inside = os.path.realpath(folder)
    files = {}
    for location in sorted(locations):
        path = os.path.join(inside, location)
        try:
            files[location] = read_regular(path, inside=inside)
        except OutsideError as exc:
            raise SecurityError(f"{backend}: external data {location!r}: {exc.strerror}"
                                ) from None
        except PermissionError as exc:
            if in_sandbox():  # landlock: a confined process may read no model folder
                raise UnsupportedOperationError(
                    f"{backend}: external data {location!r}: a sandboxed model's process "
                    f"may not read its folder {inside}: expected the model loaded without "
                    "sandbox, or with its weights inside the .onnx file") from None
            raise _unreadable(backend, location, inside, exc) from None
        except OSError as exc:
            raise _unreadable(backend, location, inside, exc) from None
    return files


def _unreadable(backend: str, location: str, inside: str, exc: OSError) -> NotFoundError:
    return NotFoundError(
        f"{backend}: external data {location!r} in {inside} cannot be read: "
        f"{exc.strerror or exc}: expected the model's external data file")


def _check_tensor(backend: str, tensor: memoryview, inside: str | None,
                  given: Collection[str] | None) -> str | None:
    """This TensorProto's external data location, or None where it embeds its data
    (external: entries, or a data location other than DEFAULT: any encoding of that
    field but a zero varint counts); with locations ``given``, SecurityError for one not
    among them; else with no folder ``inside``, SecurityError if it is external, else
    the location's checks."""
    name = b""
    location: bytes | None = None
    external = False
    for number, _, value in onnx_values(tensor):
        if number == _NAME and isinstance(value, memoryview):
            name = bytes(value)
        elif number == _EXTERNAL_DATA:
            external = True
            if isinstance(value, memoryview):
                location = _location(value) or location
        elif number == _DATA_LOCATION and value != 0:
            external = True
    if not external:
        return None
    tensor_name = name.decode("utf-8", "replace")
    if given is not None:
        return _given_location(backend, tensor_name, location, given)
    if inside is None:
        where = f" (location {location.decode('utf-8', 'replace')!r})" if location else ""
        raise SecurityError(
            f"{backend}: tensor {tensor_name!r} refers to external data{where}, which would "
            "be read from the host's files: a model from a guest or a caller must embed "
            "its weights (only a registered model's file may keep them next to it)"
        )
    return _check_location(backend, tensor_name, location, inside)


def _check_location(backend: str, tensor: str, location: bytes | None, inside: str) -> str:
    # A registered model's external data file: relative, inside the model's folder.
    if not location:
        raise InvalidEncodingError(
            f"{backend}: tensor {tensor!r} is marked as external data but names no "
            "location: expected a file next to the model")
    text = location.decode("utf-8", "replace")
    try:
        resolved = os.path.realpath(os.path.join(inside, text))
    except OSError as exc:  # (a link that changed while it was followed)
        raise NotFoundError(
            f"{backend}: tensor {tensor!r} keeps its data in {text!r}, which cannot be "
            f"resolved in {inside} ({exc.strerror}): expected the model's external data "
            "file next to it") from None
    if "\0" in text or os.path.isabs(text) or os.path.commonpath([inside, resolved]) != inside:
        raise SecurityError(
            f"{backend}: tensor {tensor!r} keeps its data in {text!r}, outside the model's "
            f"folder {inside}: expected a relative path that stays inside it")
    if not os.path.isfile(resolved):
        raise NotFoundError(
            f"{backend}: tensor {tensor!r} keeps its data in {text!r}, which is no file in "
            f"{inside}: expected the model's external data file next to it")
    return text


def _given_location(backend: str, tensor: str, location: bytes | None,
                    given: Collection[str]) -> str:
    # A sandbox process's: the host read the model's files, from the same bytes.
    text = (location or b"").decode("utf-8", "replace")
    if text not in given:
        raise SecurityError(
            f"{backend}: tensor {tensor!r} keeps its data in {text!r}, which the host did "
            f"not read for this process: expected one of {sorted(given)!r:.200}")
    return text


def external_data_folder(source: str) -> Path | None:
    """The folder a model's external data may be read from: its file's, for a model the
    host read from the file ``source`` (``LoadOptions.source``), else None (none may
    be)."""
    return Path(source).parent if source else None


def _location(entry: memoryview) -> bytes | None:
    """The value of an external_data entry whose key is ``location``, else None."""
    key = value = None
    for number, _, field in onnx_records(entry):
        if number == _KEY and field is not None:
            key = bytes(field)
        elif number == _VALUE and field is not None:
            value = bytes(field)
    return value if key == b"location" else None
