"""What a sandboxed graph's process reports of a failed load or run, as the host takes it
(see :mod:`.sandbox`): the wasinn error it stands for (:func:`child_error`), and whether
the process lost its CUDA context with it (:func:`lost_context`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from wasinn import errors
from wasinn.enums import ExecutionTarget
from wasinn.errors import BackendRuntimeError, WasiNNError, bounded_message

from .base import Device


def child_error(payload: Mapping[str, Any]) -> WasiNNError:
    """The wasinn error a child reported (BackendRuntimeError for a class it may not
    name)."""
    kind, message = payload["error"]  # (two strs: checked by read_reply)
    cls = getattr(errors, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, WasiNNError)):
        cls = BackendRuntimeError
    return cls(bounded_message(message, MAX_MESSAGE_BYTES))


#: The most UTF-8 bytes of a child's error message an error keeps (its start and end).
MAX_MESSAGE_BYTES = 16 * 1024


def lost_context(payload: Mapping[str, Any], device: Device) -> bool:
    """Whether the process that reported a run's error in ``payload`` has lost its CUDA
    context: on a GPU only, where the process found that from its library's own
    exception (see :func:`wasinn.backends.cuda.sticky_error`) and said so with a flag.
    Never from the error's message, which may quote the model (a node's name) or a
    caller's text (an input's): a CPU process has no CUDA context to lose, and a
    phrase a model names must not retire its process at every run."""
    return device.kind is not ExecutionTarget.CPU and payload.get("lost_context") is True
