"""Which native values another library can share in place, through DLPack.

A chain of models of different libraries keeps its tensors where they are when the
next library takes the last one's native value over the same memory: ONNX Runtime's
``OrtValue`` and torch's tensors both speak DLPack (``__dlpack__``,
``__dlpack_device__``), on the CPU and on CUDA. Each consumer converts with its own
library's ``from_dlpack``; what they share is the question asked here: is this value
where the consumer computes, as DLPack names devices, and is it computed yet.
"""

from __future__ import annotations

from typing import Any

from wasinn.tensor import Tensor

#: DLPack's device types: host memory, and a CUDA device (with its index).
KDL_CPU, KDL_CUDA = 1, 2


def shareable(tensor: Tensor, device: tuple[int, int]) -> Any | None:
    """``tensor``'s native value, where it has a DLPack form on ``device`` (``(KDL_CPU,
    0)`` or ``(KDL_CUDA, index)``), computed (:meth:`Tensor.synchronize`: a GPU value may
    still be being written on its producer's stream); None otherwise (no native value,
    no DLPack form, another device), where the consumer reads it through the host."""
    native = tensor.native
    where = getattr(native, "__dlpack_device__", None)
    if where is None or not hasattr(native, "__dlpack__"):
        return None
    try:
        located = tuple(int(part) for part in where())
    except Exception:
        return None
    if located != device:
        return None
    tensor.synchronize()
    return native
