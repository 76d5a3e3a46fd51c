"""How tensors cross between wasinn and OpenVINO (for :mod:`wasinn.backends.openvino`).

In: a run's input as an ``ov.Tensor`` over the caller's memory (copied first only where
OpenVINO cannot share it: strided, byte-swapped or another library's device memory),
another library's host value read over DLPack, a remote tensor of the same device set as
it is; i64 values outside the i32 range and finite f64 values beyond the f32 range are
refused, as the plugins compute them in those types. Out: an output copied to a host
array, or handed out as a native tensor of the request that owns its memory, whose rows
are region-of-interest tensors.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import openvino as ov

from wasinn.enums import TensorType
from wasinn.errors import InvalidArgumentError
from wasinn.tensor import Tensor, numpy_dtype

from ._dlpack import KDL_CPU, shareable
from ._ovread import NAME

_TYPES: dict[str, TensorType] = {
    "f16": TensorType.F16, "f32": TensorType.F32, "f64": TensorType.F64,
    "bf16": TensorType.BF16, "u8": TensorType.U8, "i32": TensorType.I32, "i64": TensorType.I64,
}
_OV_TYPES = {tt: getattr(ov.Type, name) for name, tt in _TYPES.items()}
_CARRIERS = {tt: numpy_dtype(tt) for tt in TensorType}
_I32 = np.iinfo(np.int32)
_F32_MAX = float(np.finfo(np.float32).max)


def _host_view(tensor: Tensor) -> np.ndarray[Any, Any] | None:
    """Another library's native value in host memory (an ``OrtValue`` or a torch tensor
    on the CPU) as a numpy array over the same memory (DLPack, see :mod:`._dlpack`), so
    that a CPU chain of models of different libraries copies nothing; None where it has
    no such form (device memory, bf16, which numpy lacks): the caller reads it through
    ``Tensor.numpy``."""
    native = shareable(tensor, (KDL_CPU, 0))
    if native is None:
        return None
    try:
        view: np.ndarray[Any, Any] = np.from_dlpack(native)
    except Exception:
        return None
    return view


def _ov_tensor(tensor: Tensor, device: str, name: str) -> Any:
    """``tensor`` for input ``name`` as OpenVINO takes it (host memory shared, not copied).

    Raises InvalidArgumentError for i64 values outside the i32 range, finite f64
    values outside the f32 range (see :mod:`.openvino`) and a host array whose
    elements are not of the tensor's type.
    """
    native = tensor.native
    if isinstance(native, ov.Tensor):
        return native
    if isinstance(native, ov.RemoteTensor) and tensor.device == device:
        return native  # device memory, on this device: set as it is
    array = _host_view(tensor) if native is not None and device == "cpu" else None
    if array is None:
        array = tensor.numpy()
    if array.dtype is not _CARRIERS[tensor.type] or not array.flags.c_contiguous:
        array = _shareable(array, tensor.type)
    if tensor.type is TensorType.I64 and array.size and (
        array.min() < _I32.min or array.max() > _I32.max
    ):
        raise InvalidArgumentError(
            f"{NAME}: input {name!r}: i64 values outside the i32 range cannot be computed "
            f"exactly (OpenVINO computes i64 as i32): expected values in "
            f"[{_I32.min}, {_I32.max}]"
        )
    if tensor.type is TensorType.F64 and array.size and _beyond_f32(array):
        raise InvalidArgumentError(
            f"{NAME}: input {name!r}: finite f64 values beyond the f32 range cannot be "
            f"computed (OpenVINO computes f64 as f32): expected magnitudes up to "
            f"{_F32_MAX:.7g}, or onnxruntime for full f64"
        )
    # The (array, shape, type) constructor shares the memory, read-only arrays included;
    # bf16 travels as its uint16 bit pattern.
    carrier = array.view(np.uint16) if tensor.type is TensorType.BF16 else array
    return ov.Tensor(carrier, ov.Shape(array.shape), _OV_TYPES[tensor.type])


def _shareable(array: np.ndarray[Any, Any], ttype: TensorType) -> np.ndarray[Any, Any]:
    """``array`` (of a Tensor built around it, not by ``from_numpy``) as memory OpenVINO
    can share. OpenVINO takes a pointer with the shape and element type it is told: a
    strided array it refuses with a bare RuntimeError, and bytes in the other order it
    reads as they lie, and ``np.longlong`` (which numpy counts as equal to int64, and
    another library's int64 array may be) it refuses. Copied C-contiguous, in native
    byte order, relabelled as the type's own dtype (a Tensor's array holds elements of
    its type: its constructor checks that)."""
    carrier = _CARRIERS[ttype]
    return np.ascontiguousarray(array, dtype=carrier).view(carrier)


def _beyond_f32(array: np.ndarray[Any, Any]) -> bool:
    """Whether ``array`` (f64) holds a finite value of magnitude above f32's maximum.
    Two reductions without temporaries in the usual case; a NaN (which makes min and max
    NaN) or a value beyond the range takes the masked path."""
    if array.min() >= -_F32_MAX and array.max() <= _F32_MAX:
        return False
    with np.errstate(invalid="ignore"):
        over = np.abs(array) > _F32_MAX
    return bool(np.isfinite(array[over]).any())


def _host_array(value: Any, ttype: TensorType, keep_alive: object = None) -> np.ndarray[Any, Any]:
    """A host copy of an ``ov.Tensor`` or ``ov.RemoteTensor`` (``keep_alive``: the
    request that owns its memory)."""
    del keep_alive
    if not isinstance(value, ov.Tensor):  # device memory: copied to the host first
        host = ov.Tensor(_OV_TYPES[ttype], value.get_shape())
        value.copy_to(host)
        value = host
    data = value.data
    if ttype is TensorType.BF16:
        data = data.view(numpy_dtype(TensorType.BF16))
    return np.array(data, copy=True)


def _unshared(value: Any, hosts: list[Any]) -> Any:
    """``value``, a kept output, or a copy of it where it lies in the memory of one of
    ``hosts`` (inputs over the caller's memory)."""
    if isinstance(value, ov.Tensor) and value.byte_size:
        data = value.data
        if any(np.may_share_memory(data, host.data) for host in hosts):
            own = ov.Tensor(value.get_element_type(), value.get_shape())
            value.copy_to(own)
            return own
    return value


def _native(value: Any, ttype: TensorType, device: str, owner: object) -> Tensor:
    """``value`` as it is (``owner``: the request that owns its memory, kept alive with
    it); its rows are region-of-interest tensors over the same memory."""
    return Tensor.from_native(
        value, tuple(value.get_shape()), ttype, device=device,
        materialize=functools.partial(_host_array, value, ttype, owner),
        rows=lambda start, stop: _native(_rows(value, start, stop), ttype, device, owner),
        host_view=(functools.partial(_host_memory, value, ttype, owner)
                   if isinstance(value, ov.Tensor) else None))


def _host_memory(value: Any, ttype: TensorType, owner: object) -> np.ndarray[Any, Any] | None:
    """An ``ov.Tensor``'s data over its own memory (the request ``owner`` retires it with
    the tensor instead of reusing it), as another library reads it; None where numpy
    cannot show it as the tensor's type without a copy."""
    del owner  # (kept alive by the partial, with the memory it owns)
    try:
        data = value.data
        if ttype is TensorType.BF16:
            data = data.view(numpy_dtype(TensorType.BF16))
    except Exception:
        return None
    if data.dtype != numpy_dtype(ttype) or not data.flags.c_contiguous:
        return None
    view: np.ndarray[Any, Any] = data
    return view


def _rows(value: Any, start: int, stop: int) -> Any:
    end = list(value.get_shape())
    begin = [0] * len(end)
    begin[0], end[0] = start, stop
    # ov.Tensor and ov.RemoteTensor both take (tensor, begin, end) for a region of interest.
    return type(value)(value, ov.Coordinate(begin), ov.Coordinate(end))
