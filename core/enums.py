"""The wasi-nn enumerations: graph encodings, execution targets, tensor element types.

Each enum is accepted as itself or by its (case-insensitive) name through ``coerce``,
so that ``target="gpu"`` and ``ExecutionTarget.GPU`` mean the same thing everywhere.
The *values* of these enums are wasinn's own; the numbering each guest ABI uses lives
with that ABI's bindings (WITX and WIT number encodings differently).
"""

from __future__ import annotations

import enum
import re
from typing import Self

from wasinn.errors import InvalidArgumentError


class _NamedEnum(enum.Enum):
    # Members are singletons compared by identity: hash them by identity too, in C. (Enum's
    # own __hash__ is Python code, and members key dicts on every inference's hot path.)
    __hash__ = object.__hash__

    @classmethod
    def coerce(cls, value: Self | str) -> Self:
        """Return ``value`` as a member, accepting a member or its name (any case, ``-``/``_``)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            key = value.strip().lower().replace("-", "_")
            for member in cls:
                if member.value == key or member.name.lower() == key:
                    return member
        expected = ", ".join(m.value for m in cls)
        what = re.sub(r"(?<!^)(?=[A-Z])", " ", cls.__name__).lower()  # "graph encoding"
        raise InvalidArgumentError(f"unknown {what} {value!r}: expected one of {expected}")


class GraphEncoding(_NamedEnum):
    """The format of a model's bytes (wasi-nn ``graph-encoding``)."""

    OPENVINO = "openvino"
    ONNX = "onnx"
    TENSORFLOW = "tensorflow"
    PYTORCH = "pytorch"
    TENSORFLOWLITE = "tensorflowlite"
    GGML = "ggml"
    AUTODETECT = "autodetect"


class ExecutionTarget(_NamedEnum):
    """The kind of device a graph or context runs on (wasi-nn ``execution-target``)."""

    CPU = "cpu"
    GPU = "gpu"
    TPU = "tpu"


class TensorType(_NamedEnum):
    """Element type of a tensor: the wasi-nn set."""

    F16 = "f16"
    F32 = "f32"
    F64 = "f64"
    BF16 = "bf16"
    U8 = "u8"
    I32 = "i32"
    I64 = "i64"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]


_ITEMSIZE = {
    TensorType.F16: 2,
    TensorType.F32: 4,
    TensorType.F64: 8,
    TensorType.BF16: 2,
    TensorType.U8: 1,
    TensorType.I32: 4,
    TensorType.I64: 8,
}
