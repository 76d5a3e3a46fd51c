"""Blocking work that cancellation leaves to finish in its worker thread.

Some work that an async caller waits for cannot be interrupted: importing a backend
library and asking it for its devices, exporting a model with torch and OpenVINO, a
compiler run, compiling a guest. It takes seconds, and Ctrl-C must not wait for it. Its
caller runs it with :func:`run_abandonable`: cancellation then ends the wait at once,
and the work goes on in its thread (one of trio's, a daemon thread) until it returns,
its result dropped. Such work writes what it makes under a temporary name and renames it
into place, so that an abandoned one that the process's exit cuts short leaves nothing
half written for a later call to take.

A process must not go through the interpreter's normal exit while such work still runs
in a C++ library: the library's static objects are destroyed under it (torch's thread
pool: "terminate called without an active exception", and the process aborts).
:func:`unfinished_work` counts the calls whose thread still runs; the ``wasinn`` command,
once it has ended, exits at once (``os._exit``) while there are any.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
#: The calls of run_abandonable whose thread runs their work now.
_running = 0


async def run_abandonable(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a trio worker thread (``trio.to_thread.run_sync``): its result,
    or what it raised. Cancellation abandons it: the caller gets ``trio.Cancelled`` at
    once, and ``fn`` runs on in its thread, counted by :func:`unfinished_work` until it
    returns. ``fn`` must be safe to abandon so: what it writes, it renames into place."""
    import trio

    return await trio.to_thread.run_sync(_counted, fn, args, abandon_on_cancel=True)


def _counted(fn: Callable[..., T], args: tuple[Any, ...]) -> T:
    global _running  # noqa: PLW0603 - one count for the process, as its threads are
    with _lock:
        _running += 1
    try:
        return fn(*args)
    finally:
        with _lock:
            _running -= 1


def unfinished_work() -> int:
    """How many calls of :func:`run_abandonable` still run in their threads: once their
    callers have all ended (a command's end), the ones that cancellation abandoned."""
    with _lock:
        return _running
