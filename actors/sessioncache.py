"""``SessionCache``: the graphs compiled on one device, each compiled once, lazily.

A device actor keeps one :class:`~wasinn.actors.session.Session` per key (a model, on
that device), shared by every context that runs it there. The first caller that asks for
a key starts its compile; callers that ask meanwhile wait for that same compile instead
of starting their own. The compile is a task of the actor's (its nursery), not the
caller's: a caller that gives up (its deadline passed) does not take the compile down
with it, and the next caller finds the graph cached.

A session is freed by :meth:`SessionCache.evict` (its model unloaded, the actor closing):
at once, or when the last job running it ends (see :class:`~wasinn.actors.session.Session`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable
from typing import Any

import trio

from wasinn.backends.base import CompiledGraph
from wasinn.errors import ClosedResourceError, WasiNNError

from .pending import Pending
from .session import Session

#: Runs a task as long as the actor serves (ClosedResourceError once it does not).
StartTask = Callable[[Callable[[Any], Awaitable[None]], Any], None]
#: Runs a compile in one of the device's worker threads, without a request slot.
CompileInThread = Callable[[Callable[[], CompiledGraph]], Awaitable[CompiledGraph]]


class SessionCache:
    """The sessions compiled on ``device``, by key (see the module docstring).

    ``start_task`` runs each compile as a task of the actor's; ``compile_in_thread`` runs
    the backend's compile call in one of the actor's worker threads. Used in trio only.
    """

    def __init__(self, device: str, start_task: StartTask,
                 compile_in_thread: CompileInThread) -> None:
        self.device = device
        #: The cached sessions, by key: read directly by the actor (``cached_session`` is on
        #: every request's path).
        self.sessions: dict[Hashable, Session] = {}
        #: Compiles that succeeded (cached or not).
        self.compiles = 0
        self._compiling: dict[Hashable, Pending] = {}
        self._start_task = start_task
        self._compile_in_thread = compile_in_thread
        self._closed = False

    async def session(self, key: Hashable, compile_graph: Callable[[], CompiledGraph],
                      backend: str, *, wanted: Callable[[], bool] = lambda: True) -> Session:
        """The session cached under ``key``, compiled on first use by a task of
        ``start_task``'s, which callers wait for (cancelled, a caller stops waiting and
        the compile goes on). The contract, errors and ``wanted`` included, is
        :meth:`DeviceActor.session <wasinn.actors.device.DeviceActor.session>`'s."""
        while True:
            session = self.sessions.get(key)
            if session is not None:
                return session
            pending = self._compiling.get(key)
            if pending is None:
                pending = self._compiling[key] = Pending()
                try:
                    self._start_task(self._compile_task,
                                     (key, pending, compile_graph, backend, wanted))
                except ClosedResourceError:
                    del self._compiling[key]
                    raise
            await pending.wait()

    async def _compile_task(self, job: tuple[Hashable, Pending,
                                             Callable[[], CompiledGraph], str,
                                             Callable[[], bool]]) -> None:
        # In the actor's nursery: compile, cache, tell the waiting callers.
        key, pending, compile_graph, backend, wanted = job

        def compile_if_wanted() -> CompiledGraph:
            # Checked again once a worker thread is free (``wanted`` reads a flag: safe
            # from any thread): callers that keep giving up while others compile must
            # not leave a compile queued for each of them.
            if not wanted():
                raise ClosedResourceError(
                    f"{self.device}: the graph was unloaded before it compiled")
            return compile_graph()

        try:
            compiled = await self._compile_in_thread(compile_if_wanted)
            self.compiles += 1
            session = Session(compiled, backend)
            if self._closed:
                session.evict()
                raise ClosedResourceError(f"{self.device}: the device actor is closed")
            if not wanted():
                session.evict()
                raise ClosedResourceError(
                    f"{self.device}: the graph was unloaded while it compiled")
            self.sessions[key] = session
        except WasiNNError as exc:
            pending.error = exc
        except trio.Cancelled:  # the actor is closing: the compile is abandoned
            pending.error = ClosedResourceError(
                f"{self.device}: the device actor closed while the graph compiled")
            raise
        finally:
            del self._compiling[key]
            pending.done.set()

    def evict(self, key: Hashable) -> None:
        """Free the graph cached under ``key`` (now, or when its running jobs end)."""
        session = self.sessions.pop(key, None)
        if session is not None:
            session.evict()

    def close(self) -> None:
        """Cache nothing more: a compile that ends from now on is closed at once, and its
        callers get ClosedResourceError. The sessions already cached stay until
        :meth:`clear`."""
        self._closed = True

    def clear(self) -> None:
        """Evict every cached graph (a session still used by a job that outlived the
        actor's close is closed by that job's thread when it ends)."""
        for key in list(self.sessions):
            self.evict(key)
