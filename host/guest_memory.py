"""Bounds-checked, zero-copy access to a guest's linear memory.

A :class:`GuestMemory` is a numpy ``uint8`` view over the whole linear memory as it is
*during one host call*. It must not outlive that call: a guest that grows its memory
may move it. Every pointer and length is a u32 (the caller masks the signed i32 that
wasmtime hands over) and is checked against the memory's current size before any byte
is read or written, so a bad guest pointer becomes an InvalidArgumentError, never an
out-of-bounds access of the host.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from wasinn.enums import TensorType
from wasinn.errors import InvalidArgumentError
from wasinn.host.abi import decode_tensor_type
from wasinn.tensor import MAX_RANK, check_dims

_U32 = np.dtype("<u4")
_RECORD = struct.Struct("<5I")
_DIMS = struct.Struct("<2I")  # the record's dims_ptr, dims_len
_U32_LE = struct.Struct("<I")
_EMPTY = np.zeros(0, dtype=np.uint8)

#: Size of the WITX tensor record: dims_ptr, dims_len, type (+3 bytes padding), data_ptr,
#: data_len, each a little-endian u32.
TENSOR_RECORD_SIZE = 20
#: Size of one graph builder (ptr, len) in the ``load`` builders array.
BUILDER_SIZE = 8


def u32(value: int) -> int:
    """An i32 as wasmtime passes it (signed) read as the u32 the guest meant."""
    return value & 0xFFFFFFFF


@dataclass(frozen=True)
class TensorRecord:
    """A decoded WITX tensor record; the data stays in guest memory at ``data_ptr``."""

    dims: tuple[int, ...]
    type: TensorType
    data_ptr: int
    data_len: int

    @property
    def span(self) -> tuple[int, int]:
        return self.data_ptr, self.data_ptr + self.data_len


#: The most graph builders one ``load`` may pass.
MAX_BUILDERS = 16

#: The longest name (of a model, an input or an output) a guest may pass, in bytes: far
#: more than any registry key or tensor name, and short enough that a host log line which
#: quotes a name the host does not know stays readable.
MAX_NAME_BYTES = 1024

#: The largest size a u32 result can hold; a larger one is written as this.
_U32_MAX = 0xFFFFFFFF


def _check_name_bytes(length: int, what: str) -> None:
    if length > MAX_NAME_BYTES:
        raise InvalidArgumentError(
            f"{what} is {length} bytes long: expected at most {MAX_NAME_BYTES} bytes of "
            "UTF-8 (no model, input or output has a longer name)")


def check_name_length(name: str, what: str) -> None:
    """The bound :meth:`GuestMemory.read_str` sets, for a name a component guest passed as
    a string: InvalidArgumentError beyond MAX_NAME_BYTES bytes of UTF-8 (the same answer
    in both ABIs)."""
    if len(name) > MAX_NAME_BYTES // 4:  # (only a name that could be too long is encoded)
        _check_name_bytes(len(name.encode("utf-8", "surrogatepass")), what)


def check_model_name(name: str) -> None:
    """A model name a guest asks for: InvalidArgumentError when it is empty or longer
    than any name (both ABIs)."""
    if not name:
        raise InvalidArgumentError("model name is empty: expected the name of a registered "
                                   "model or pipeline")
    check_name_length(name, "model name")


class GuestMemory:
    """The guest's linear memory during one host call (see the module docstring)."""

    __slots__ = ("data", "size")

    def __init__(self, data: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
        self.data = data
        #: The memory's size in bytes.
        self.size = int(data.shape[0])

    @classmethod
    def at(cls, address: int, size: int) -> GuestMemory:
        """A view over ``size`` bytes of host memory at ``address`` (the wasm memory base)."""
        if size == 0 or not address:
            return cls(_EMPTY)
        buf = (ctypes.c_uint8 * size).from_address(address)
        return cls(np.frombuffer(memoryview(buf), dtype=np.uint8))

    def span(self, ptr: int, length: int, what: str = "buffer") -> np.ndarray[Any, Any]:
        """The ``length`` bytes at ``ptr`` as a writable uint8 view (InvalidArgumentError)."""
        ptr &= 0xFFFFFFFF  # u32, inline: this runs several times per inference
        length &= 0xFFFFFFFF
        end = ptr + length
        if end > self.size:
            raise InvalidArgumentError(
                f"{what} at guest address {ptr:#x} of {length} bytes ends at {end:#x}, "
                f"outside guest memory of {self.size:#x} bytes"
            )
        return self.data[ptr:end]

    def read_u32(self, ptr: int, what: str = "u32") -> int:
        return int(self.span(ptr, 4, what).view(_U32)[0])

    def write_u32(self, ptr: int, value: int, what: str = "result") -> None:
        self.span(ptr, 4, what)  # the bounds check
        data: Any = self.data  # (numpy declares the buffer protocol only for Python 3.12+)
        _U32_LE.pack_into(data, ptr & 0xFFFFFFFF, value)  # one C call, no view

    def write_size(self, ptr: int, nbytes: int, what: str = "bytes-written result") -> None:
        """Write the byte size ``nbytes`` as a u32; a size of 4 GiB or more (which no guest
        buffer can hold) as 0xffffffff, the largest one a u32 says."""
        self.write_u32(ptr, min(nbytes, _U32_MAX), what)

    def check_writable_u32(self, ptr: int, what: str = "result") -> None:
        """Fail now, before any work is done, if a result pointer is out of bounds."""
        self.span(ptr, 4, what)

    def read_u32s(self, ptr: int, count: int, what: str) -> np.ndarray[Any, Any]:
        count = u32(count)
        if count * 4 > 0xFFFFFFFF:
            raise InvalidArgumentError(f"{what}: {count} entries cannot fit in guest memory")
        return self.span(ptr, count * 4, what).view(_U32)

    def read_str(self, ptr: int, length: int, what: str = "name") -> str:
        """A UTF-8 name of at most MAX_NAME_BYTES bytes; InvalidArgumentError when it is
        longer or not valid UTF-8."""
        length &= 0xFFFFFFFF
        _check_name_bytes(length, what)
        raw = self.span(ptr, length, what).tobytes()
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidArgumentError(
                f"{what} is not valid UTF-8 ({exc.reason} at byte {exc.start}): "
                f"expected a UTF-8 string"
            ) from None

    def builders(self, ptr: int, count: int) -> list[np.ndarray[Any, Any]]:
        """The ``count`` graph builders (ptr, len pairs) at ``ptr`` as views, each checked.

        Raises InvalidArgumentError for more than MAX_BUILDERS (no model format has more
        than three parts; a guest must not make the host build millions of views).
        """
        if u32(count) > MAX_BUILDERS:
            raise InvalidArgumentError(
                f"{u32(count)} graph builders: expected at most {MAX_BUILDERS} (a model is "
                "one file, or a few for formats such as OpenVINO IR's xml + weights)"
            )
        pairs = self.read_u32s(ptr, u32(count) * 2, "graph builder array").reshape(-1, 2)
        return [
            self.span(int(p), int(n), f"graph builder {i}") for i, (p, n) in enumerate(pairs)
        ]

    def _dims(self, dims_ptr: int, dims_len: int) -> np.ndarray[Any, Any]:
        """A tensor record's dimension array (its rank checked first, then its span)."""
        if dims_len > MAX_RANK:
            raise InvalidArgumentError(
                f"tensor rank {dims_len} is too large: expected <= {MAX_RANK}"
            )
        return self.span(dims_ptr, dims_len * 4, "tensor dimensions")

    def tensor_key(self, ptr: int) -> bytes:
        """The 20-byte tensor record at ``ptr`` followed by the dimensions it points to,
        as bytes (InvalidArgumentError for either outside memory): equal keys describe
        the same tensor (type, dimensions, data span)."""
        record = self.span(ptr, TENSOR_RECORD_SIZE, "tensor record").tobytes()
        return record + self._dims(*_DIMS.unpack_from(record)).tobytes()

    def tensor(self, ptr: int) -> TensorRecord:
        """Decode the 20-byte tensor record at ``ptr`` and check that its data is in bounds.

        Raises InvalidArgumentError for a record, dimension array or data span outside
        memory, a rank above MAX_RANK, a type/length mismatch (see
        :func:`wasinn.host.abi.decode_tensor_type`), or an empty tensor whose non-zero
        dimensions multiply to more than numpy can index.
        """
        # struct on the checked span: this runs on every set_input, and a handful of
        # numpy scalar operations would cost several times more.
        record = self.span(ptr, TENSOR_RECORD_SIZE, "tensor record")
        dims_ptr, dims_len, type_field, data_ptr, data_len = _RECORD.unpack_from(record.data)
        dims_raw = self._dims(dims_ptr, dims_len)
        dims: tuple[int, ...] = struct.unpack_from(f"<{dims_len}I", dims_raw.data)
        self.span(data_ptr, data_len, "tensor data")
        ttype = decode_tensor_type(type_field, dims, data_len)
        if not data_len and 0 in dims:
            # An empty tensor whose other dimensions numpy cannot index (a non-empty one
            # has at most 4 GiB of elements): InvalidArgumentError saying so.
            check_dims(dims, ttype.itemsize)
        return TensorRecord(dims, ttype, data_ptr, data_len)


def check_apart(buffer_ptr: int, buffer_len: int, written_ptr: int, what: str) -> None:
    """InvalidArgumentError when the u32 result at ``written_ptr`` overlaps the non-empty
    output buffer of ``buffer_len`` bytes at ``buffer_ptr`` (each already bounds-checked):
    the size written there would corrupt the output, or the output the size."""
    buffer_ptr, buffer_len, written_ptr = u32(buffer_ptr), u32(buffer_len), u32(written_ptr)
    if buffer_len and buffer_ptr < written_ptr + 4 and written_ptr < buffer_ptr + buffer_len:
        raise InvalidArgumentError(
            f"bytes_written at guest address {written_ptr:#x} overlaps the {what} at "
            f"{buffer_ptr:#x} of {buffer_len} bytes: expected the 4-byte size outside the "
            "buffer"
        )


#: A range of guest memory a call names: what it is, its address, its length.
Span = tuple[str, int, int]


def check_disjoint(mine: Sequence[Span], theirs: Sequence[Span]) -> None:
    """InvalidArgumentError when one of ``mine`` overlaps one of ``theirs`` (empty ranges
    overlap nothing): ranges one call writes, each of which would corrupt the other."""
    for what, *mine_at in mine:
        start, length = map(u32, mine_at)
        for other, *theirs_at in theirs:
            other_start, other_length = map(u32, theirs_at)
            if (length and other_length and start < other_start + other_length
                    and other_start < start + length):
                raise InvalidArgumentError(
                    f"the {what} at guest address {start:#x} ({length} bytes) overlaps "
                    f"{other} at {other_start:#x} ({other_length} bytes); compute writes "
                    "both: expected separate ranges")
