"""How tensors cross between wasinn and torch (for :mod:`wasinn.backends.pytorch`).

In: a run's input as a torch tensor on the graph's device, sharing the caller's memory
unless the model writes to it; another library's native value over DLPack where it has
that form, else through the host; a GPU tensor of another stream read only once its
``ready`` event says it is computed. Out: an output as a host array (bf16 as its bit
pattern), or left on its device as a native tensor that keeps that event with it.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
import torch.utils.dlpack

from wasinn.enums import TensorType
from wasinn.tensor import Tensor, c_contiguous, numpy_dtype

from ._dlpack import KDL_CPU, KDL_CUDA, shareable

_TORCH_TYPES: dict[TensorType, torch.dtype] = {
    TensorType.F16: torch.float16, TensorType.F32: torch.float32,
    TensorType.F64: torch.float64, TensorType.BF16: torch.bfloat16,
    TensorType.U8: torch.uint8, TensorType.I32: torch.int32, TensorType.I64: torch.int64,
}
_TYPES = {dt: tt for tt, dt in _TORCH_TYPES.items()}
_BF16 = numpy_dtype(TensorType.BF16)


#: The attribute of a GPU output that holds its ``ready`` event (see :func:`_native`).
_READY = "_wasinn_ready"


def _ready(value: torch.Tensor) -> torch.cuda.Stream | None:
    """For a GPU output read outside the stream that computes it: the current stream of
    its device in this thread, made to wait until the output is computed (None for any
    other tensor). An output stays on its device's actor, whose runs share one stream:
    every other reader (a copy to the host or to another device) is on another stream,
    which would not wait for the kernels still writing it."""
    ready: torch.cuda.Event | None = getattr(value, _READY, None)
    if ready is None:
        return None
    stream = torch.cuda.current_stream(value.device)
    stream.wait_event(ready)
    return stream


def _to_torch(tensor: Tensor, device: torch.device, private: bool) -> torch.Tensor:
    """``tensor`` as torch's, sharing its memory unless ``private`` (the model writes to
    it) asks for a copy of its own."""
    native = tensor.native
    if isinstance(native, torch.Tensor):
        if native.device != device:
            reader = _ready(native)
            moved = native.to(device)
            if reader is not None:
                # The copy reads it on ``reader``: its memory must not go back to the
                # producer's stream (and a later run there) before the copy is done.
                native.record_stream(reader)
            return moved
        return native.clone() if private else native
    view = None
    if native is not None:
        shared = _from_dlpack(tensor, device)
        if shared is not None:
            return shared.clone() if private else shared
        view = tensor.host_view()  # an OpenVINO tensor's host memory, as it is
    array = tensor.numpy() if view is None else view
    if not array.flags.writeable:
        array = array.copy()  # torch.from_numpy warns on read-only memory
    elif private and device.type == "cpu":
        array = array.copy()
    if tensor.type is TensorType.BF16:
        value = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    else:
        value = torch.from_numpy(array)
    return value if device.type == "cpu" else value.to(device)


def _from_dlpack(tensor: Tensor, device: torch.device) -> torch.Tensor | None:
    """Another library's native value (an ONNX Runtime ``OrtValue``) on ``device``, as a
    torch tensor over the same memory (DLPack, see :mod:`._dlpack`): a chain of models of
    different libraries keeps its tensors where they are. None where it has no DLPack
    form there: the caller copies it through the host."""
    where = (KDL_CPU, 0) if device.type == "cpu" else (KDL_CUDA, device.index or 0)
    native = shareable(tensor, where)
    if native is None:
        return None
    try:
        # The capsule itself, not the value: torch would ask a CUDA value for one on its
        # stream, which not every library takes; a computed value needs no stream.
        shared: torch.Tensor = torch.utils.dlpack.from_dlpack(native.__dlpack__())
    except Exception:
        return None
    return shared


def _foreign(tensor: Tensor) -> bool:
    """Whether ``tensor`` is another library's native value (read over DLPack or through
    the host), not torch's."""
    native = tensor.native
    return native is not None and not isinstance(native, torch.Tensor)


def _to_numpy(value: torch.Tensor) -> np.ndarray[Any, Any]:
    _ready(value)  # .cpu() copies on this stream, and waits for it
    value = value.detach().cpu()
    if value.dtype is torch.bfloat16:
        return c_contiguous(value.view(torch.int16).numpy().view(_BF16))
    return c_contiguous(value.numpy())


def _native(value: torch.Tensor, ttype: TensorType, device: str,
            ready: torch.cuda.Event | None = None) -> Tensor:
    """``value`` left where it is; its rows are views on the same device. ``ready``: the
    event that marks it computed, on a GPU (see :func:`_ready`), kept with it."""
    if ready is not None:
        setattr(value, _READY, ready)
    return Tensor.from_native(
        value, tuple(value.shape), ttype, device=device,
        materialize=functools.partial(_to_numpy, value),
        rows=lambda start, stop: _native(value[start:stop], ttype, device, ready),
        synchronize=None if ready is None else ready.synchronize)
