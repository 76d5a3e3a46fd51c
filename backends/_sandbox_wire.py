"""The messages between the host and a sandboxed graph's process (see :mod:`.sandbox`).

A message is one header and the raw buffers it refers to, each sent with
``Connection.send_bytes`` and read with ``recv_bytes_into`` (no extra copy of tensor data).

The host trusts what it sends, so its requests are pickled. It does not trust the child:
a library bug that let a model run code in the child must not reach the host through
its replies, so the child answers in JSON (never unpickled) and raw bytes, which the host
checks (:func:`tensor_from_wire`) before wrapping them as tensors.
"""

from __future__ import annotations

import json
import pickle
import struct
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from wasinn.enums import TensorType
from wasinn.errors import InvalidArgumentError
from wasinn.tensor import Tensor, check_dims, numpy_dtype

#: The most buffers one message may carry, and the longest header (a reply's tensors are
#: described in its header): a child sending more is refused rather than believed.
MAX_BUFFERS = 4096
MAX_HEADER = 16 * 1024 * 1024

_COUNT = struct.Struct("<IQ")  # buffer count, header length


def send(conn: Connection, header: bytes, buffers: list[memoryview]) -> None:
    """Send ``header`` and ``buffers`` (byte views) as one message."""
    sizes = struct.pack(f"<{len(buffers)}Q", *(b.nbytes for b in buffers))
    conn.send_bytes(_COUNT.pack(len(buffers), len(header)) + sizes + header)
    for buffer in buffers:
        conn.send_bytes(buffer)


def receive(conn: Connection) -> tuple[bytes, list[bytearray]]:
    """One message: its header and its buffers (writable). Raises EOFError when the other
    end is gone, ValueError for a message that is not one."""
    first = conn.recv_bytes(MAX_HEADER + _COUNT.size + 8 * MAX_BUFFERS)
    if len(first) < _COUNT.size:
        raise ValueError("a message shorter than its prefix")
    count, header_len = _COUNT.unpack_from(first)
    if count > MAX_BUFFERS or len(first) != _COUNT.size + 8 * count + header_len:
        raise ValueError(f"a message announcing {count} buffers and a {header_len}-byte "
                         f"header in {len(first)} bytes")
    sizes = struct.unpack_from(f"<{count}Q", first, _COUNT.size)
    header = first[_COUNT.size + 8 * count:]
    buffers = []
    for size in sizes:
        buffer = bytearray(size)
        got = conn.recv_bytes_into(buffer) if size else len(conn.recv_bytes(1))
        if got != size:
            raise ValueError(f"a buffer of {got} bytes where {size} were announced")
        buffers.append(buffer)
    return header, buffers


# -- the host's requests -----------------------------------------------------------------
def _tensor_buffers(tensors: dict[str, Tensor] | None
                    ) -> tuple[list[tuple[str, str, list[int]]], list[memoryview]]:
    """``[name, type, dims]`` of each tensor, and its host data in native byte order and
    C order (copied only where it is not already)."""
    described = []
    buffers: list[memoryview] = []
    for name, tensor in (tensors or {}).items():
        # (np.ascontiguousarray makes a 0-d array 1-d: the dimensions are the tensor's.)
        array = np.ascontiguousarray(tensor.numpy(), dtype=numpy_dtype(tensor.type))
        described.append((name, tensor.type.value, list(tensor.dims)))
        buffers.append(memoryview(array.reshape(-1).view(np.uint8)))  # type: ignore[arg-type]
    return described, buffers


def request(payload: object, tensors: dict[str, Tensor] | None = None
            ) -> tuple[bytes, list[memoryview]]:
    """A request from the host: ``payload`` and the tensors' descriptions pickled, and
    their host data (see :func:`_tensor_buffers`)."""
    described, buffers = _tensor_buffers(tensors)
    return pickle.dumps((payload, described), protocol=pickle.HIGHEST_PROTOCOL), buffers


def read_request(header: bytes, buffers: list[bytearray]) -> tuple[Any, dict[str, Tensor]]:
    """A request as the child reads it: the payload and its tensors over the buffers."""
    payload, described = pickle.loads(header)  # from the host: trusted
    tensors = {name: Tensor.from_bytes(dims, TensorType(type_), buffer)
               for (name, type_, dims), buffer in zip(described, buffers, strict=True)}
    return payload, tensors


# -- the child's replies -------------------------------------------------------------------
def reply(payload: dict[str, Any], tensors: dict[str, Tensor] | None = None
          ) -> tuple[bytes, list[memoryview]]:
    """A reply from the child: ``payload`` (JSON-able) and ``tensors``' host data."""
    described, buffers = _tensor_buffers(tensors)
    return json.dumps({**payload, "tensors": described}).encode(), buffers


def read_reply(header: bytes, buffers: list[bytearray]) -> tuple[dict[str, Any],
                                                                  dict[str, Tensor]]:
    """A child's reply, checked: ValueError for anything that is not one."""
    payload = json.loads(header)
    if not isinstance(payload, dict):
        raise ValueError("a reply that is no JSON object")  # noqa: TRY004 - one kind
    described = payload.pop("tensors", [])
    if not isinstance(described, list) or len(described) != len(buffers):
        raise ValueError("a reply whose tensors are not its buffers")
    tensors = {}
    for entry, buffer in zip(described, buffers, strict=True):
        name, tensor = tensor_from_wire(entry, buffer)
        tensors[name] = tensor
    return payload, tensors


def tensor_from_wire(entry: object, buffer: bytearray) -> tuple[str, Tensor]:
    """``[name, type, dims]`` and its bytes as a host tensor; ValueError for anything else
    (the buffer's size is checked against the dimensions by Tensor.from_bytes)."""
    if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
            and isinstance(entry[1], str) and isinstance(entry[2], list)):
        raise ValueError(f"a tensor described as {entry!r:.80}")
    name, type_, dims = entry
    try:
        ttype = TensorType(type_)
        return name, Tensor.from_bytes(check_dims(dims, ttype.itemsize), ttype, buffer)
    except (ValueError, InvalidArgumentError) as exc:
        raise ValueError(f"tensor {name!r:.80}: {exc}") from None
