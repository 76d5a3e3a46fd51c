"""``DeviceActor``: everything one device owns, and the only way work reaches it.

An actor owns, for one device (``cpu``, ``gpu:0``, ...):

* the compiled graphs run there (:meth:`DeviceActor.session`: compiled lazily at first use,
  once, however many contexts share them; :meth:`DeviceActor.evict` frees them);
* its request queue and worker threads: a job runs in ``trio.to_thread.run_sync`` under
  the actor's one ``CapacityLimiter`` (``workers`` tokens), so the event loop never blocks
  on inference; when every slot is busy callers wait in the queue, served in the order
  the :class:`~wasinn.actors.queue.QueuePolicy` chooses (priority, then deadline);
* its device context (a CUDA stream where torch sees the GPU), opened in a worker thread
  before the actor reports ready.

Admission, not a dispatcher task: a caller whose request is granted a slot runs the job
from its own task, which saves a task switch per request (the actor's ``serve`` task only
holds the device's lifetime). Cancellation: a caller cancelled while queued is removed
from the queue and never runs; cancelled while running, its thread is abandoned (it runs
to completion and keeps its limiter token until then, so a device never runs more than
``workers`` jobs) and the result is dropped. A job's exception fails that request only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import trio

from wasinn.backends.base import CompiledGraph, Device
from wasinn.errors import (
    BackendRuntimeError,
    ClosedResourceError,
    TimeoutError_,
    TooLargeError,
    UnsupportedOperationError,
    WasiNNError,
)

from .devicectx import DeviceContext, context_for
from .queue import PriorityDeadlinePolicy, QueuePolicy, Request
from .session import Session

T = TypeVar("T")


class _Compiling:
    """A compile in progress: callers wait on ``done``; ``error`` says how it failed."""

    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.error: WasiNNError | None = None


class DeviceActor:
    """The owner of one device. Start it with ``await nursery.start(actor.serve)``."""

    def __init__(
        self,
        device: Device,
        *,
        workers: int = 1,
        queue_limit: int = 1024,
        policy: QueuePolicy | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self.device = device
        self.workers = workers
        self.queue_limit = queue_limit
        self.limiter = trio.CapacityLimiter(workers)
        self._policy: QueuePolicy = policy if policy is not None else PriorityDeadlinePolicy()
        self._running = 0
        #: Requests placed here that wait for their graph to be compiled on this device.
        self.placed = 0
        self._sessions: dict[Hashable, Session] = {}
        self._compiling: dict[Hashable, _Compiling] = {}
        self._context: DeviceContext | None = None
        self._wrap: Callable[[Callable[[], Any]], Callable[[], Any]] | None = None
        self._ready = False
        self._closed = False
        #: Finished jobs (compiles and runs, failed or not), for tests and metrics.
        self.completed = 0

    def __repr__(self) -> str:
        return f"<DeviceActor {self.device} load={self.load} sessions={len(self._sessions)}>"

    # -- lifetime -----------------------------------------------------------------------
    async def serve(self, *, task_status: trio.TaskStatus[DeviceActor] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        """Open the device, report ready, then hold it until cancelled.

        Raises UnsupportedOperationError (before reporting ready) when the device cannot be
        opened. On exit, queued callers get ClosedResourceError and cached graphs are freed
        (a graph still running in an abandoned thread is freed when that run ends).
        """
        try:
            # In a worker thread: finding out what the device needs may import torch.
            context = await trio.to_thread.run_sync(self._open_context, limiter=self.limiter)
        except WasiNNError:
            raise
        except Exception as exc:
            raise UnsupportedOperationError(f"{self.device}: cannot open the device: {exc}"
                                            ) from exc
        self._context = context
        if type(context) is not DeviceContext:
            self._wrap = context.wrap
        self._ready = True
        task_status.started(self)
        try:
            await trio.sleep_forever()
        finally:
            self.close()

    def _open_context(self) -> DeviceContext:
        context = context_for(self.device)
        context.open()
        return context

    def close(self) -> None:
        """Stop serving: fail queued requests, free every cached graph. Idempotent."""
        if self._closed:
            return
        self._closed = True
        while (request := self._policy.pop()) is not None:
            request.event.set()  # not granted: the waiter raises ClosedResourceError
        for key in list(self._sessions):
            self.evict(key)
        if self._context is not None:
            self._context.close()

    @property
    def ready(self) -> bool:
        return self._ready and not self._closed

    @property
    def load(self) -> int:
        """Running, queued and placed (waiting for a compile) requests: what placement
        compares."""
        return self._running + len(self._policy) + self.placed

    # -- compiled graphs ------------------------------------------------------------------
    async def session(self, key: Hashable, compile_graph: Callable[[], CompiledGraph],
                      backend: str) -> Session:
        """The graph cached under ``key``, compiling it on first use (once, however many
        callers ask at the same time). A failed compile is not cached: its error reaches
        every caller waiting for it, and a later call tries again.
        """
        while True:
            session = self._sessions.get(key)
            if session is not None:
                return session
            pending = self._compiling.get(key)
            if pending is None:
                break
            await pending.done.wait()
            if pending.error is not None:
                raise type(pending.error)(pending.error.message)
            # Otherwise it was cached, or its compiler was cancelled: look again.
        pending = self._compiling[key] = _Compiling()
        try:
            compiled = await self._compile(compile_graph)
            session = Session(compiled, backend)
            if self._closed:
                session.evict()
                raise ClosedResourceError(f"{self.device}: the device actor is closed")
            self._sessions[key] = session
            return session
        except WasiNNError as exc:
            pending.error = exc
            raise
        finally:
            del self._compiling[key]
            pending.done.set()

    async def _compile(self, compile_graph: Callable[[], CompiledGraph]) -> CompiledGraph:
        # A compile takes one of the device's thread tokens but no request slot, so it is
        # not counted as load twice. It is not abandoned on cancellation (the thread would
        # go on loading weights anyway): the result is cached for the next caller.
        work = compile_graph if self._wrap is None else self._wrap(compile_graph)
        try:
            compiled: CompiledGraph = await trio.to_thread.run_sync(work, limiter=self.limiter)
        except WasiNNError:
            raise
        except Exception as exc:
            raise BackendRuntimeError(
                f"{self.device}: compiling failed: {type(exc).__name__}: {exc}"
            ) from exc
        self.completed += 1
        return compiled

    def cached(self, key: Hashable) -> bool:
        """Whether a compiled graph is cached under ``key``."""
        return key in self._sessions

    def cached_session(self, key: Hashable) -> Session | None:
        """The session cached under ``key``, or None (no compiling)."""
        return self._sessions.get(key)

    def session_keys(self) -> list[Hashable]:
        return list(self._sessions)

    def evict(self, key: Hashable) -> None:
        """Free the graph cached under ``key`` (now, or when its running jobs end)."""
        session = self._sessions.pop(key, None)
        if session is not None:
            session.evict()

    # -- running work ---------------------------------------------------------------------
    async def execute(
        self,
        job: Callable[[], T],
        *,
        priority: int = 0,
        deadline: float = math.inf,
        tenant: str = "",
    ) -> T:
        """Run ``job`` in one of this device's worker threads and return its result.

        Waits in the queue while every slot is busy. Raises ClosedResourceError when the
        actor is closed, TooLargeError when the queue is full, TimeoutError_ when
        ``deadline`` (trio time) passes first (queued requests are dropped, a running one
        is abandoned), and BackendRuntimeError for an exception that is not a WasiNNError
        (those propagate as they are). Cancellation: see the module docstring.
        """
        if deadline == math.inf:
            return await self._execute(job, priority, deadline, tenant)
        with trio.move_on_at(deadline) as scope:
            return await self._execute(job, priority, deadline, tenant)
        assert scope.cancelled_caught
        raise TimeoutError_(f"{self.device}: the request's deadline passed before it finished")

    async def _execute(self, job: Callable[[], T], priority: int, deadline: float,
                       tenant: str) -> T:
        if self._closed:
            raise ClosedResourceError(f"{self.device}: the device actor is closed")
        if self._running < self.workers and not len(self._policy):
            self._running += 1
        else:
            await self._wait_turn(Request(priority, deadline, tenant))
        try:
            work: Callable[[], T] = job if self._wrap is None else self._wrap(job)
            return await trio.to_thread.run_sync(work, abandon_on_cancel=True,
                                                 limiter=self.limiter)
        except WasiNNError:
            raise
        except Exception as exc:
            raise BackendRuntimeError(
                f"{self.device}: the backend failed: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            self.completed += 1
            self._running -= 1
            self._grant_next()

    async def _wait_turn(self, request: Request) -> None:
        if len(self._policy) >= self.queue_limit:
            raise TooLargeError(
                f"{self.device}: the request queue is full ({self.queue_limit} waiting): "
                "retry later or raise the pool's queue_limit"
            )
        self._policy.push(request)
        try:
            await request.event.wait()
        except BaseException:
            if request.granted:
                # A slot was reserved for us just as we were cancelled: hand it on.
                self._running -= 1
                self._grant_next()
            else:
                self._policy.remove(request)
            raise
        if not request.granted:
            raise ClosedResourceError(f"{self.device}: the device actor closed while queued")

    def _grant_next(self) -> None:
        while self._running < self.workers and not self._closed:
            request = self._policy.pop()
            if request is None:
                return
            self._running += 1
            request.granted = True
            request.event.set()
