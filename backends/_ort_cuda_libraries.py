"""Loading the CUDA and cuDNN libraries ONNX Runtime's CUDA provider needs, once.

``onnxruntime-gpu`` does not bring CUDA or cuDNN: the provider's library is loaded when a
CUDA session is first made, and it finds them on the system's library path, or already
loaded by torch's CUDA build. Installed as pip packages (``onnxruntime-gpu[cuda,cudnn]``,
the ``nvidia-*`` wheels) without torch, they are on neither, and ONNX Runtime makes the
session on the CPU provider alone, with a logged error. Its ``preload_dlls()`` (1.21 and
later) loads them from those packages: tried here once a process, only after a CUDA
session came up without its provider, so that a machine where they are found already is
left as it is. A session made without the provider after that is made once more (the
preload may have been another thread's, done after that session was begun).
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
    a process asks (a call while another thread's preload runs waits for it). True where
    ``ort`` can preload (this call or an earlier one did): the caller may make its session
    again; False where it cannot (before 1.21)."""
    preload = getattr(ort, "preload_dlls", None)
    if preload is None:
        return False
    with _lock:
        if not _tried.is_set():
            try:
                preload()
            except Exception as exc:  # (nothing more is loaded: the caller's error says so)
                log.warning("onnxruntime.preload_dlls() failed: %s: %s",
                            type(exc).__name__, exc)
            finally:
                _tried.set()
    return True
