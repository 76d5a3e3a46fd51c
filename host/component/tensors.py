"""A component guest's tensors: made from its data, read back, dropped.

:class:`TensorOperations` is the part of :class:`~wasinn.host.component.service.NNService`
that implements wasi-nn's ``tensor`` interface and the wasinn extensions' ways for tensor
data in and out: ``wasinn:nn/bulk`` words and ``wasinn:nn/scratch`` files
(:mod:`wasinn.host.component.scratch`; without a directory those calls raise
UnsupportedOperationError). Tensor types and dimensions are WIT values here:
:data:`WIT_TENSOR_TYPES` names the element types, :func:`guest_shape` checks the
dimensions a guest passes before any arithmetic on them, and :func:`output_dims` those it
is handed back in ``tensor-dimensions``. Every tensor counts against the guest's tensor
limits (:mod:`~wasinn.host.component.tables`); the data handed back to the guest is
bounded by ``max_data_bytes`` (:meth:`TensorOperations.tensor_data`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from wasinn.enums import TensorType
from wasinn.errors import (
    InvalidArgumentError,
    NotFoundError,
    TooLargeError,
    UnsupportedOperationError,
    WasiNNError,
    quoted,
)
from wasinn.host.component.scratch import ScratchDir, Usage, check_name, quota_exceeded
from wasinn.host.component.tables import GuestTables, ResourceExhausted, TensorEntry
from wasinn.host.limits import LOWERING_BYTES_PER_VALUE, GuestLimits
from wasinn.tensor import MAX_RANK, Tensor

#: WIT ``tensor-type`` case names, in WIT order, onto wasinn's element types.
WIT_TENSOR_TYPES: dict[str, TensorType] = {
    "FP16": TensorType.F16,
    "FP32": TensorType.F32,
    "FP64": TensorType.F64,
    "BF16": TensorType.BF16,
    "U8": TensorType.U8,
    "I32": TensorType.I32,
    "I64": TensorType.I64,
}
_WIT_TYPE_NAME = {tt: name for name, tt in WIT_TENSOR_TYPES.items()}
#: The largest value of a WIT ``u32`` (each of ``tensor-dimensions``).
U32_MAX = 0xFFFF_FFFF


def wit_type_name(tensor_type: TensorType) -> str:
    return _WIT_TYPE_NAME[tensor_type]


def output_dims(name: str, tensor: Tensor) -> tuple[int, ...]:
    """An output's dimensions as a guest's ``tensor-dimensions`` (a ``list<u32>``) holds
    them; TooLargeError naming the output when one is above the u32 range (wasmtime-py
    would hand the guest that dimension silently cut to its low 32 bits)."""
    dims = tuple(int(d) for d in tensor.dims)
    if any(not 0 <= d <= U32_MAX for d in dims):
        raise TooLargeError(
            f"output {quoted(name)} has dimensions {list(dims)}: a guest's "
            f"tensor-dimensions holds u32 values, at most {U32_MAX}")
    return dims


def guest_shape(dims: Sequence[int]) -> tuple[int, ...]:
    """Dimensions a guest passed, as a shape; InvalidArgumentError beyond MAX_RANK.

    Checked before anything multiplies them: a product of thousands of u32 dimensions is
    a huge integer that takes seconds to compute while holding the GIL.
    """
    if len(dims) > MAX_RANK:
        raise InvalidArgumentError(
            f"tensor has {len(dims)} dimensions: expected at most {MAX_RANK}")
    return tuple(int(d) for d in dims)


class TensorOperations:
    """The tensor operations of :class:`~wasinn.host.component.service.NNService`, which
    sets what follows."""

    limits: GuestLimits
    scratch: ScratchDir | None
    tables: GuestTables

    def tensor_new(self, dims: Sequence[int], type_name: str, data: bytes) -> int:
        """The tensor constructor: never raises for bad arguments (WIT gives it no error).

        An inconsistent tensor is stored with its error (and its dimensions and bytes,
        charged to the guest's tensor budget); compute reports it. A tensor over
        ``max_tensor_bytes``, or that does not fit the budget, is stored without its
        data, as a too-large error for compute (and a trap for :meth:`tensor_data`).
        Raises ResourceExhausted (the guest is trapped) when the guest already holds
        ``max_tensors`` tensors: the constructor cannot answer with an error.
        """
        table = self.tables.tensors
        if table.full:
            raise ResourceExhausted(
                f"{table.full_message()}; tensor constructor (which cannot return an error)")
        try:
            shape = guest_shape(dims)
            entry = TensorEntry(shape, type_name, self._make_tensor(shape, type_name, data))
        except WasiNNError as exc:
            # Over max_tensor_bytes the bytes are not worth keeping for data().
            raw = b"" if isinstance(exc, TooLargeError) else bytes(data)
            entry = TensorEntry(tuple(int(d) for d in dims), type_name, None, invalid=exc,
                                raw=raw)
        try:
            return table.add(entry)
        except TooLargeError as exc:  # over the byte budget: keep dims and type, no data
            dims_kept = entry.dims if len(entry.dims) <= MAX_RANK else ()
            return table.add(TensorEntry(dims_kept, type_name, None, invalid=exc),
                             placeholder=True)

    def tensor_from_words(self, dims: Sequence[int], type_name: str, words: bytes) -> int:
        """``wasinn:nn/bulk.tensor-from-words``: data as little-endian u64 words (padded)."""
        shape = guest_shape(dims)
        ttype = self._tensor_type(type_name)
        size = math.prod(shape) * ttype.itemsize
        need = (size + 7) // 8 * 8
        if len(words) != need:
            raise InvalidArgumentError(
                f"tensor-from-words got {len(words) // 8} words but dimensions {list(shape)} "
                f"of {type_name} need {need // 8} ({size} bytes, padded to whole words)"
            )
        tensor = self._make_tensor(shape, type_name, memoryview(words)[:size])
        return self.tables.tensors.add(TensorEntry(shape, type_name, tensor))

    def tensor_from_scratch(self, name: str, dims: Sequence[int], type_name: str) -> int:
        """``wasinn:nn/scratch.tensor-from-scratch``: data copied from a scratch file.

        The guest's tensor limits are checked before the file is read.
        """
        shape = guest_shape(dims)
        ttype = self._tensor_type(type_name)
        nbytes = math.prod(shape) * ttype.itemsize
        if nbytes <= self.limits.max_tensor_bytes:  # else read_tensor says why
            self.tables.tensors.check_room(nbytes)
        tensor = self._scratch().read_tensor(name, shape, ttype, self.limits.max_tensor_bytes)
        return self.tables.tensors.add(TensorEntry(shape, type_name, tensor))

    def tensor_to_scratch(self, rep: int, name: str) -> int:
        """``wasinn:nn/scratch.tensor-to-scratch``: the tensor's bytes into a scratch file;
        a tensor whose data does not fit its dimensions gets the error ``compute`` would
        give, not a file that looks like a tensor."""
        self.tables.tensors.get(rep).require()
        data = self.tensor_bytes(rep)
        scratch = self._scratch()
        check_name(name)  # before the name appears in a message
        limits = self.limits
        usage = scratch.usage(limits.max_scratch_files)
        # A file written over is replaced: its bytes go (under each of its names), and
        # its entry stays; a new file is one entry more.
        old, names = scratch.replaced(name)
        if names:
            grown = Usage(usage.nbytes + names * (len(data) - old.nbytes), usage.entries)
        else:
            grown = Usage(usage.nbytes + len(data), usage.entries + 1)
        reason = quota_exceeded(grown, limits.max_scratch_bytes, limits.max_scratch_files,
                                holds="would hold")
        if reason is not None:
            raise TooLargeError(f"writing {len(data)} bytes to {name!r}: {reason}")
        return scratch.write_tensor(name, data, limits.max_tensor_bytes)

    def _scratch(self) -> ScratchDir:
        if self.scratch is None:
            raise UnsupportedOperationError(
                "this guest was started without a scratch directory: pass tensor data "
                "through wasi:nn/tensor or wasinn:nn/bulk instead")
        return self.scratch

    def _tensor_type(self, type_name: str) -> TensorType:
        try:
            return WIT_TENSOR_TYPES[type_name]
        except KeyError:
            raise InvalidArgumentError(
                f"unknown tensor-type {type_name!r}: expected one of {', '.join(WIT_TENSOR_TYPES)}"
            ) from None

    def _make_tensor(self, shape: tuple[int, ...], type_name: str, data: Any) -> Tensor:
        ttype = self._tensor_type(type_name)
        if len(data) > self.limits.max_tensor_bytes:
            raise TooLargeError(
                f"tensor of {len(data)} bytes exceeds this guest's limit of "
                f"{self.limits.max_tensor_bytes} bytes per tensor ([guests] max_tensor_bytes)"
            )
        # Data and dimensions that disagree are the mistake (invalid-argument, as in the
        # legacy ABI), whatever size the dimensions would need; once they agree, the size
        # is the data's, within the limit.
        return Tensor.from_bytes(shape, ttype, data)

    def tensor_dims(self, rep: int) -> list[int]:
        return list(self.tables.tensors.get(rep).dims)

    def tensor_type(self, rep: int) -> str:
        return self.tables.tensors.get(rep).type_name

    def tensor_bytes(self, rep: int) -> np.ndarray[Any, Any] | bytes:
        """The tensor's bytes; a device-resident output is materialized here, once."""
        entry = self.tables.tensors.get(rep)
        if entry.tensor is None:
            return entry.raw
        return entry.tensor.numpy().reshape(-1).view(np.uint8)

    def tensor_data(self, rep: int, *, words: bool = False) -> np.ndarray[Any, Any] | bytes:
        """The bytes ``tensor.data()`` (``words``: ``tensor-words``) hands the guest.

        Checked before anything is materialized or converted: wasmtime's C API spends
        about :data:`~wasinn.host.limits.LOWERING_BYTES_PER_VALUE` bytes of host memory
        per list value it lowers into the guest (80 per byte here, 10 as words), and an
        allocation it cannot make aborts the whole process. Raises ResourceExhausted
        (the call has no error case: the guest is trapped) for a tensor over
        ``max_tensor_bytes`` or over ``max_data_bytes`` (8 times that as words), and for
        one whose constructor kept no data (:meth:`tensor_new`), naming the limit.
        """
        entry = self.tables.tensors.get(rep)
        nbytes = len(entry.raw) if entry.tensor is None else entry.tensor.nbytes
        call = "tensor-words" if words else "tensor.data()"
        if entry.tensor is None and isinstance(entry.invalid, TooLargeError):
            # Its constructor kept no data (past max_tensor_bytes, or the live bytes'
            # budget): an empty list would pass for its data.
            raise ResourceExhausted(
                f"{call} of a tensor whose data its constructor did not keep: "
                f"{entry.invalid.message}")
        limits = self.limits
        if nbytes > limits.max_tensor_bytes:
            raise ResourceExhausted(
                f"{call} of a tensor of {nbytes} bytes: over this guest's limit of "
                f"{limits.max_tensor_bytes} bytes per tensor ([guests] max_tensor_bytes)")
        limit = limits.max_data_bytes * (8 if words else 1)
        if nbytes > limit:
            raise ResourceExhausted(
                f"{call} of a tensor of {nbytes} bytes: over this guest's limit of {limit} "
                f"bytes a call ([guests] max_data_bytes{' x 8 for words' if words else ''}: "
                f"handing a list to a guest costs the host about {LOWERING_BYTES_PER_VALUE} "
                f"bytes of memory per value); {self._data_instead(nbytes, words)}")
        return self.tensor_bytes(rep)

    def _data_instead(self, nbytes: int, words: bool) -> str:
        """What a guest refused a ``tensor.data()`` of ``nbytes`` can use instead."""
        ways = ["wasinn:nn/scratch tensor-to-scratch, which has no such limit"
                + ("" if self.scratch is not None else
                   " (this guest has no scratch directory: a guest gets one when it "
                   "imports wasinn:nn/scratch)")]
        if not words and nbytes <= self.limits.max_data_bytes * 8:
            ways.append(f"wasinn:nn/bulk tensor-words, up to {self.limits.max_data_bytes * 8} "
                        f"bytes a call")
        return "read it with " + " or ".join(ways)

    def tensor_drop(self, rep: int) -> None:
        self.tables.tensors.pop(rep)

    def take_tensor(self, rep: int) -> TensorEntry:
        """Take over an owned tensor handle (it leaves the guest's table)."""
        entry = self.tables.tensors.pop(rep)
        if entry is None:
            raise NotFoundError(f"tensor handle {rep} is no longer live")
        return entry
