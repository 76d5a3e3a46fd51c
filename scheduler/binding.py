"""Host buffers bound to a context's outputs (``ExecutionContext.set_output``).

A run that ends copies each bound output into its buffer (the backend returns outputs
of its own), as wasi-nn's ``get-output`` copies one into a guest's. Two kinds of buffer
are accepted:

* a byte buffer (``bytearray``, a ``memoryview``, a ``uint8`` array, a ctypes byte array:
  what guests bind): it receives the output's bytes and may be larger than they are;
* a typed numpy array: its dtype must be the output's element type and its shape the
  output's (or flat with as many elements), so that it never holds reinterpreted bytes
  or a partly written result.

Every bound buffer is checked against the run's outputs before any is written: a run
whose outputs do not fit leaves every buffer as it was, and its TooLargeError says what
each bound output needed (``bound_sizes``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from wasinn.errors import BoundSize, InvalidArgumentError, TooLargeError
from wasinn.tensor import Tensor, numpy_dtype, tensor_type_of

#: memoryview formats of plain bytes (bytearray, bytes-like objects, numpy u8).
_BYTE_FORMATS = frozenset({"B", "b", "c"})


class OutputBuffer:
    """One bound buffer: its bytes, and the typed array it came from (None for bytes)."""

    __slots__ = ("array", "name", "raw")

    def __init__(self, name: str, buffer: Any) -> None:
        """Raises InvalidArgumentError for anything but a writable contiguous buffer, or
        a numpy array whose dtype carries no wasi-nn element type."""
        what = f"output {name!r}"
        # A buffer of typed elements (a numpy array other than u8, an array.array, a cast
        # memoryview) is checked as an array of them; one of bytes is filled as bytes.
        # A numpy array is taken as it is, not through a memoryview: the buffer protocol
        # has no format for some of the dtypes that carry wasi-nn types (bf16's).
        array: np.ndarray[Any, Any] | None = None
        if isinstance(buffer, np.ndarray):
            if not buffer.flags.writeable:
                raise _read_only(what)
            if not buffer.flags.c_contiguous:
                raise _not_contiguous(what)
            array = buffer if buffer.dtype != np.uint8 else None
            raw = buffer.reshape(-1).view(np.uint8)
        else:
            try:
                view = memoryview(buffer)
            except TypeError:
                raise InvalidArgumentError(
                    f"{what}: {type(buffer).__name__} is not a buffer: expected a writable "
                    "numpy array, bytearray or memoryview"
                ) from None
            if view.readonly:
                raise _read_only(what)
            if not view.c_contiguous:
                raise _not_contiguous(what)
            # ctypes writes a byte order before even a single byte's format ("<B").
            if view.format.lstrip("@=<>!") not in _BYTE_FORMATS:
                array = np.asarray(view)  # the same memory, with its element type and shape
            raw = np.frombuffer(view.cast("B"), dtype=np.uint8)
        if array is not None:
            try:
                tensor_type_of(array.dtype)
            except InvalidArgumentError as exc:
                raise InvalidArgumentError(f"{what}: {exc.message}") from None
        self.name = name
        self.array = array
        self.raw = raw

    def check(self, tensor: Tensor) -> None:
        """InvalidArgumentError (a typed buffer of another dtype or shape) or TooLargeError
        (too few bytes) unless ``tensor`` can be written here."""
        array = self.array
        if array is not None:
            dims = tuple(tensor.dims)
            expected = numpy_dtype(tensor.type)
            if array.dtype != expected:
                raise InvalidArgumentError(
                    f"output {self.name!r} is {tensor.type.value} but its bound buffer is "
                    f"{array.dtype}: expected a {expected} array, or a byte buffer")
            count = math.prod(dims)
            if array.shape != dims and not (array.ndim == 1 and array.size == count):
                raise InvalidArgumentError(
                    f"output {self.name!r} has shape {list(dims)} but its bound buffer has "
                    f"shape {list(array.shape)}: expected that shape (or {count} elements "
                    "in one dimension), or a byte buffer")
            return
        nbytes = tensor.nbytes
        if nbytes > self.raw.nbytes:
            raise TooLargeError(
                f"output {self.name!r} is {nbytes} bytes ({list(tensor.dims)} of "
                f"{tensor.type.value}) but its bound buffer holds {self.raw.nbytes}"
            )

    def write(self, tensor: Tensor) -> None:
        """Copy ``tensor`` in (after :meth:`check`)."""
        raw = tensor.numpy().reshape(-1).view(np.uint8)
        self.raw[: raw.nbytes] = raw


def _read_only(what: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"{what}: the buffer is read-only: expected a writable one")


def _not_contiguous(what: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"{what}: the buffer is not contiguous: expected one block")


def fill(bound: dict[str, OutputBuffer], outputs: dict[str, Tensor]) -> None:
    """Write each of ``outputs`` into its bound buffer: all of them, or (an error) none.

    Raises what :meth:`OutputBuffer.check` raises for the first that does not fit; a
    TooLargeError carries every bound output's size in this run and its buffer's
    (``bound_sizes``): the context records no outputs of a refused run, so this is the
    only place that knows what a dynamic output needed.
    """
    pairs = [(buffer, outputs[name]) for name, buffer in bound.items() if name in outputs]
    for buffer, tensor in pairs:
        try:
            buffer.check(tensor)
        except TooLargeError as exc:
            exc.bound_sizes = {b.name: BoundSize(t.nbytes, b.raw.nbytes) for b, t in pairs}
            raise
    for buffer, tensor in pairs:
        buffer.write(tensor)
