"""Loading the CUDA and cuDNN libraries ONNX Runtime's CUDA provider needs, once.

``onnxruntime-gpu`` does not bring CUDA or cuDNN: the provider's library is loaded when a
CUDA session is first made, and it finds them on the system's library path, or already
loaded by torch's CUDA build. Installed as pip packages (``onnxruntime-gpu[cuda,cudnn]``,
the ``nvidia-*`` wheels) without torch, they are on neither, and ONNX Runtime makes the
session on the CPU provider alone, with a logged error. Its ``preload_dlls()`` (1.21 and
later) loads them from those packages: tried here once a process, only after a CUDA
session came up without its provider, so that a machine where they are found already is
left as it is.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger("wasinn.backends")

_lock = threading.Lock()
_tried = threading.Event()


def preload_once(ort: Any) -> bool:
    """Have ONNX Runtime ``ort`` load CUDA and cuDNN from their pip packages, the first time
    a process asks; True if this call tried it (the caller may then make its session
    again), False if it was tried before or ``ort`` cannot."""
    preload = getattr(ort, "preload_dlls", None)
    with _lock:
        if _tried.is_set() or preload is None:
            return False
        _tried.set()
    try:
        preload()
    except Exception as exc:  # (nothing more is loaded: the caller's error says so)
        log.warning("onnxruntime.preload_dlls() failed: %s: %s", type(exc).__name__, exc)
    return True
