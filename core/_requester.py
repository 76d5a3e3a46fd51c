"""Warnings pointed at whoever asked for the work: a line of Python, or a guest.

A warning the scheduler raises for a request (a target that falls back to another) belongs
where the request was made. For a Python caller that is the first frame outside wasinn.
A guest's request has no such frame: its thread was started by trio and its calls come
through wasmtime, so the first frame outside wasinn is a line of trio's or outcome's. The
code that runs a guest therefore names it with :func:`requested_by` (a context variable,
which trio carries into the guest's thread and back through ``trio.from_thread``), and the
warning points at the guest's file instead: ``classify.wasm:0: RuntimeWarning: ...``.
"""

from __future__ import annotations

import contextvars
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

#: The guest making the current requests (its file's name), None for Python callers.
_REQUESTER: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "wasinn_requester", default=None)


@contextmanager
def requested_by(guest: str) -> Iterator[None]:
    """Within: the requests made are ``guest``'s (a file name), and so are their
    warnings."""
    token = _REQUESTER.set(guest)
    try:
        yield
    finally:
        _REQUESTER.reset(token)


def warn_requester(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """Warn ``message`` at the requester's place: the guest named by
    :func:`requested_by`, else the first frame outside wasinn (the user's line)."""
    guest = _REQUESTER.get()
    if guest is not None:
        # Line 0: a guest has no line to show (nothing is printed under the warning).
        warnings.warn_explicit(message, category, guest, 0)
    else:
        warnings.warn(message, category, stacklevel=_outside_wasinn())


def _outside_wasinn() -> int:
    # The stacklevel, for a warnings.warn in this function's caller, of the first frame
    # outside wasinn.
    level = 1
    frame: FrameType | None = sys._getframe(1)  # the caller: level 1
    while frame is not None and _in_wasinn(frame.f_globals.get("__name__")):
        frame = frame.f_back
        level += 1
    return level


def _in_wasinn(module: object) -> bool:
    return isinstance(module, str) and (module == "wasinn" or module.startswith("wasinn."))
