"""A compiled graph cached on one device actor, and when it may really be closed.

A graph compiled for a device is shared by every context that runs it there. Unloading
evicts it, but a worker thread may still be running it (a caller that was cancelled
abandons its thread, which runs on to completion): the session is closed by whichever
comes last, the eviction or the last run. Runs happen in worker threads, so the count is
guarded by a lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from wasinn.backends.base import CompiledGraph
from wasinn.errors import ClosedResourceError

from .inline import RunProfile


class Session:
    """One :class:`CompiledGraph` on one device, with an in-use count."""

    __slots__ = ("_evicted", "_lock", "_unused", "_users", "backend", "compiled", "profile")

    def __init__(self, compiled: CompiledGraph, backend: str) -> None:
        self.compiled = compiled
        self.backend = backend
        self._lock = threading.Lock()
        self._users = 0
        self._evicted = False
        #: Called once an evicted session's last run has closed it (see when_unused).
        self._unused: list[Callable[[], None]] = []
        #: How long its runs take here: decides whether they may run inline (None: they
        #: never may, see CompiledGraph.may_run_inline).
        self.profile = RunProfile() if compiled.may_run_inline else None

    @property
    def evicted(self) -> bool:
        return self._evicted

    def acquire(self) -> CompiledGraph:
        """Count one more run; ClosedResourceError once evicted."""
        with self._lock:
            if self._evicted:
                raise ClosedResourceError(
                    f"the {self.backend} graph on {self.compiled.device} was freed before "
                    "this run started: its model was unloaded, or the last execution "
                    "context using it was closed"
                )
            self._users += 1
        return self.compiled

    def release(self) -> None:
        """A run finished (in any thread); close the graph if it was evicted meanwhile."""
        with self._lock:
            self._users -= 1
            close = self._evicted and self._users == 0
            unused, self._unused = (self._unused, []) if close else ([], self._unused)
        if close:
            try:
                self.compiled.close()
            finally:
                for callback in unused:
                    callback()

    def when_unused(self, callback: Callable[[], None]) -> bool:
        """Have ``callback`` called once the last run using this evicted session has
        ended and closed its graph, in that run's thread (it must not raise); False,
        keeping nothing, when no run uses it now (from any thread)."""
        with self._lock:
            if self._users == 0:
                return False
            self._unused.append(callback)
            return True

    def evict(self, close_later: Callable[[CompiledGraph], None] | None = None) -> None:
        """No new runs; close now, or when the last running one finishes. Idempotent.
        ``close_later``: what closes a graph whose close blocks (``close_blocks``: a
        sandboxed one's waits for its processes) when that would be now, so that the
        caller (trio) does not wait; the last run's thread closes it itself."""
        with self._lock:
            if self._evicted:
                return
            self._evicted = True
            close = self._users == 0
        if close:
            if close_later is not None and self.compiled.close_blocks:
                close_later(self.compiled)
            else:
                self.compiled.close()
