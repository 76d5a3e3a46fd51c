"""How tensors cross between wasinn and ONNX Runtime (for :mod:`wasinn.backends.onnxruntime`).

In: a run's input as an ``OrtValue`` over the caller's host memory (bf16 as a ``uint16``
view tagged with ONNX's BFLOAT16 element type), an ``OrtValue`` as it is, or another
library's native value on the graph's device over DLPack, where it has that form. Out: an
``OrtValue`` copied to a host array (bf16 through its raw bytes), and the check that
finds an output which is an input's own memory, so that it gets memory of its own.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import onnxruntime as ort

from wasinn.enums import TensorType
from wasinn.errors import UnsupportedOperationError
from wasinn.tensor import Tensor, numpy_dtype

from ._dlpack import shareable
from ._ort_session import NAME

_ONNX_BFLOAT16 = 16
_BF16 = numpy_dtype(TensorType.BF16)


def _host_array(value: Any, ttype: TensorType) -> np.ndarray[Any, Any]:
    """Copy an OrtValue into a host numpy array (bf16 through its raw bytes on the CPU)."""
    if ttype is not TensorType.BF16:
        return value.numpy()  # type: ignore[no-any-return]
    if value.device_name().lower() != "cpu":
        raise UnsupportedOperationError(
            f"{NAME}: cannot read a bf16 value on {value.device_name()}"
        )
    shape = tuple(value.shape())
    size = int(value.tensor_size_in_bytes())
    raw = (ctypes.c_uint8 * size).from_address(value.data_ptr()) if size else b""
    return np.frombuffer(bytes(raw), dtype=_BF16).reshape(shape)


def _spans(values: list[Any]) -> list[tuple[int, int]]:
    """The host memory (start, end) of the CPU OrtValues among ``values``, empty ones
    left out."""
    spans = []
    for value in values:
        if value.device_name().lower() == "cpu":
            size = int(value.tensor_size_in_bytes())
            if size:
                start = int(value.data_ptr())
                spans.append((start, start + size))
    return spans


def _within(value: Any, spans: list[tuple[int, int]]) -> bool:
    """Whether the CPU OrtValue ``value`` lies in memory of one of ``spans``."""
    if value.device_name().lower() != "cpu" or not value.tensor_size_in_bytes():
        return False
    start = int(value.data_ptr())
    return any(low <= start < high for low, high in spans)


def _owned(value: Any, ttype: TensorType) -> Any:
    """A copy of the CPU OrtValue ``value`` in memory of its own."""
    array = np.array(_host_array(value, ttype), copy=True)
    if ttype is TensorType.BF16:
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array.view(np.uint16),
                                                               _ONNX_BFLOAT16)
    return ort.OrtValue.ortvalue_from_numpy(array)


def _ort_input(tensor: Tensor, dl_device: tuple[int, int]) -> Any:
    """An OrtValue for ``tensor`` without copying host data (bf16 tagged as BFLOAT16),
    nor another library's native value on this graph's device ``dl_device`` (as DLPack
    names it: see :func:`_shared`)."""
    native = tensor.native
    if isinstance(native, ort.OrtValue):
        return native
    array = None
    if native is not None:
        shared = _shared(tensor, dl_device)
        if shared is not None:
            return shared
        array = tensor.host_view()  # an OpenVINO tensor's host memory, as it is
    if array is None:
        array = tensor.numpy()
    if tensor.type is TensorType.BF16:
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array.view(np.uint16),
                                                               _ONNX_BFLOAT16)
    return ort.OrtValue.ortvalue_from_numpy(array)


def _shared(tensor: Tensor, dl_device: tuple[int, int]) -> Any | None:
    """Another library's native value (a torch tensor) on ``dl_device``, as an OrtValue
    over the same memory (DLPack, see :mod:`._dlpack`): a chain of models of different
    libraries keeps its tensors where they are. None where it has no DLPack form there,
    or is a strided view (ONNX Runtime refuses those): the caller copies it through the
    host."""
    native = shareable(tensor, dl_device)
    if native is None:
        return None
    try:
        return ort.OrtValue.from_dlpack(native)
    except Exception:
        return None

