"""The numbering of the legacy core-module ABI (``wasi_ephemeral_nn``, WITX).

Real core-module guests send WITX numbers, which differ from both wasinn's own enums
and the WIT (component) numbering: in WITX ``autodetect`` is 5 and ``ggml`` 6. This
module is the only place those numbers live; :mod:`wasinn.host.nn_core` uses it to
decode what a guest sends and to encode the errno it gets back.

Quirks of guests in the wild, handled here:

- Guests built with the Rust ``wasi-nn`` crate <= 0.5 number tensor types with an
  older table (f16=0, f32=1, u8=2, i32=3). :func:`decode_tensor_type` picks the table
  whose element size agrees with the tensor's byte length.
- Only the low byte of the 32-bit type field is meaningful: guests leave garbage in
  the padding after it (``0x100301`` for u8 has been seen).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence

from wasinn.enums import ExecutionTarget, GraphEncoding, TensorType
from wasinn.errors import (
    ErrorCode,
    InvalidArgumentError,
    InvalidEncodingError,
    QueueFullError,
    TooLargeError,
    UnsupportedOperationError,
    WasiNNError,
)

#: The import module every legacy guest uses.
MODULE = "wasi_ephemeral_nn"


class Errno(enum.IntEnum):
    """WITX ``nn_errno``, plus the WasmEdge/WAMR extension codes (>= 100)."""

    SUCCESS = 0
    INVALID_ARGUMENT = 1
    INVALID_ENCODING = 2
    MISSING_MEMORY = 3
    BUSY = 4
    RUNTIME_ERROR = 5
    UNSUPPORTED_OPERATION = 6
    TOO_LARGE = 7
    NOT_FOUND = 8
    END_OF_SEQUENCE = 100
    CONTEXT_FULL = 101
    PROMPT_TOO_LONG = 102
    MODEL_NOT_FOUND = 103


#: wasinn's error codes onto WITX errnos. WITX has no timeout, security or unknown:
#: a timeout and an unknown failure are runtime errors of the call; a refusal for
#: safety reasons is reported as an invalid argument (the guest asked for something
#: it may not have), never as "not found", which would leak what exists.
_ERRNO_OF_CODE: dict[ErrorCode, Errno] = {
    ErrorCode.INVALID_ARGUMENT: Errno.INVALID_ARGUMENT,
    ErrorCode.INVALID_ENCODING: Errno.INVALID_ENCODING,
    ErrorCode.TIMEOUT: Errno.RUNTIME_ERROR,
    ErrorCode.RUNTIME_ERROR: Errno.RUNTIME_ERROR,
    ErrorCode.UNSUPPORTED_OPERATION: Errno.UNSUPPORTED_OPERATION,
    ErrorCode.TOO_LARGE: Errno.TOO_LARGE,
    ErrorCode.NOT_FOUND: Errno.NOT_FOUND,
    ErrorCode.SECURITY: Errno.INVALID_ARGUMENT,
    ErrorCode.UNKNOWN: Errno.RUNTIME_ERROR,
}


class ModelNotFoundError(WasiNNError):
    """A registered (preloaded) model name whose model file is missing (WasmEdge errno 103)."""

    code = ErrorCode.NOT_FOUND


class EndOfSequenceError(WasiNNError):
    """``compute_single`` has nothing more to produce (WasmEdge errno 100)."""

    code = ErrorCode.RUNTIME_ERROR


class MissingMemoryError(WasiNNError):
    """The guest exports no linear memory called ``memory``."""

    code = ErrorCode.INVALID_ARGUMENT


def errno_of(error: WasiNNError) -> Errno:
    """The errno a guest receives for ``error``. A refusal that the same request may get
    past later (a full device queue, a crash back-off: what ``retry_after`` is set for)
    is ``busy``, so that a guest can tell it from a request too large for good (the WIT
    has no such code: a component sees too-large)."""
    if isinstance(error, QueueFullError) or (
            isinstance(error, TooLargeError) and error.retry_after is not None):
        return Errno.BUSY
    if isinstance(error, ModelNotFoundError):
        return Errno.MODEL_NOT_FOUND
    if isinstance(error, EndOfSequenceError):
        return Errno.END_OF_SEQUENCE
    if isinstance(error, MissingMemoryError):
        return Errno.MISSING_MEMORY
    return _ERRNO_OF_CODE[error.code]


#: WITX graph_encoding numbers.
ENCODINGS: dict[int, GraphEncoding] = {
    0: GraphEncoding.OPENVINO,
    1: GraphEncoding.ONNX,
    2: GraphEncoding.TENSORFLOW,
    3: GraphEncoding.PYTORCH,
    4: GraphEncoding.TENSORFLOWLITE,
    5: GraphEncoding.AUTODETECT,
    6: GraphEncoding.GGML,
}

#: WasmEdge's encodings beyond WITX: known names, not run by wasinn.
WASMEDGE_ENCODINGS: dict[int, str] = {
    7: "neuralspeed", 8: "burn", 9: "whisper", 10: "mlx", 11: "piper", 12: "chattts",
}

#: WITX execution_target numbers.
TARGETS: dict[int, ExecutionTarget] = {
    0: ExecutionTarget.CPU,
    1: ExecutionTarget.GPU,
    2: ExecutionTarget.TPU,
}

#: WITX tensor_type numbers (current table). 6 = bf16 is a wasinn extension: WITX has no
#: bf16, and the number is the next free one, so no existing guest sends it by mistake.
TENSOR_TYPES: dict[int, TensorType] = {
    0: TensorType.F16,
    1: TensorType.F32,
    2: TensorType.F64,
    3: TensorType.U8,
    4: TensorType.I32,
    5: TensorType.I64,
    6: TensorType.BF16,
}

#: The table of the Rust ``wasi-nn`` crate <= 0.5.
LEGACY_TENSOR_TYPES: dict[int, TensorType] = {
    0: TensorType.F16,
    1: TensorType.F32,
    2: TensorType.U8,
    3: TensorType.I32,
}

def decode_encoding(value: int) -> GraphEncoding:
    """The encoding a guest means by WITX number ``value``.

    Raises UnsupportedOperationError for WasmEdge's encodings that wasinn does not run
    (naming them) and InvalidEncodingError for numbers no host defines.
    """
    value &= 0xFFFFFFFF
    try:
        return ENCODINGS[value]
    except KeyError:
        pass
    if value in WASMEDGE_ENCODINGS:
        raise UnsupportedOperationError(
            f"graph encoding {value} ({WASMEDGE_ENCODINGS[value]}) is a WasmEdge extension "
            f"wasinn does not run: expected one of {_listing(ENCODINGS)}"
        )
    raise InvalidEncodingError(
        f"unknown graph encoding {value}: expected one of {_listing(ENCODINGS)}"
    )


def decode_target(value: int) -> ExecutionTarget:
    """The execution target a guest means by WITX number ``value`` (InvalidArgumentError)."""
    value &= 0xFFFFFFFF
    try:
        return TARGETS[value]
    except KeyError:
        raise InvalidArgumentError(
            f"unknown execution target {value}: expected one of {_listing(TARGETS)}"
        ) from None


def decode_tensor_type(type_field: int, dims: Sequence[int], data_len: int) -> TensorType:
    """The element type of a tensor record whose type field is ``type_field``.

    Only the low byte is read (guests leave garbage in the padding). When the current
    table's element size disagrees with ``data_len`` but the older Rust-crate table's
    agrees, the older table wins. Raises InvalidArgumentError for an unknown type or a
    byte length that no table explains, saying what length was expected.
    """
    number = type_field & 0xFF
    count = math.prod(dims)
    current = TENSOR_TYPES.get(number)
    if current is not None and count * current.itemsize == data_len:
        return current
    legacy = LEGACY_TENSOR_TYPES.get(number)
    if legacy is not None and count * legacy.itemsize == data_len:
        return legacy
    if current is None:
        raise InvalidArgumentError(
            f"unknown tensor type {number}: expected one of {_listing(TENSOR_TYPES)}"
        )
    raise InvalidArgumentError(
        f"tensor data is {data_len} bytes but dimensions {list(dims)} of {current.value} "
        f"need {count * current.itemsize} bytes"
    )


def _listing(table: dict[int, GraphEncoding] | dict[int, ExecutionTarget]
             | dict[int, TensorType]) -> str:
    return ", ".join(f"{n}={member.value}" for n, member in table.items())
