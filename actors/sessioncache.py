"""``SessionCache``: the graphs compiled on one device, each compiled once, lazily.

A device actor keeps one :class:`~wasinn.actors.session.Session` per key (a model, on
that device), shared by every context that runs it there. The first caller that asks for
a key starts its compile; callers that ask meanwhile wait for that same compile instead
of starting their own. The compile is a task of the actor's (its nursery), not the
caller's: a caller that gives up (its deadline passed) does not take the compile down
with it, and the next caller finds the graph cached.

A session is freed by :meth:`SessionCache.evict` (its model unloaded, the actor closing):
at once, or when the last job running it ends (see :class:`~wasinn.actors.session.Session`).
A graph unloaded while it compiles (every caller gone: a guest killed while its model
loaded) is not kept: its compile is cancelled, which stops it where the backend can stop
a load (a sandboxed one: its process is killed), and a compile that lands all the same is
closed at once, never cached.

A compile nobody waits for any more is closed, never dropped: a compiled graph holds
backend memory (a sandboxed one, a process), which must not wait for the garbage
collector. Its task stops waiting only when the actor closes, or when the job fails
after the graph landed (a device context's check once the job is done); a caller that
gives up leaves the compile going on, for the next caller. Then whoever holds the graph
last closes it: the compile thread, when the compile lands after its task stopped
waiting (a call that ignored its cancellation, possibly after the actor has gone), or the
task, when the graph had landed and the job then failed or was given up before the task
took it (see :class:`_Compile`).

A caller waiting for a compile on behalf of an execution context (its
:class:`~wasinn.actors.slots.QueueOwner`, named by :data:`~wasinn.actors.slots.QUEUE_OWNER`)
is withdrawn at once when that context closes (:meth:`SessionCache.withdraw`): it stops
waiting and raises RequestWithdrawn, as a caller that gives up does, and the compile goes
on for the next caller.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

import trio

from wasinn.backends.base import Cancellation, CompiledGraph, current_cancellation
from wasinn.errors import ClosedResourceError, WasiNNError

from .pending import Pending
from .session import Session
from .slots import QUEUE_OWNER, QueueOwner, RequestWithdrawn, withdrawal

log = logging.getLogger("wasinn.actors")

#: Runs a task as long as the actor serves (ClosedResourceError once it does not).
StartTask = Callable[[Callable[[Any], Awaitable[None]], Any], None]
#: Runs a compile in a compile thread of the device's (no worker thread, no request slot).
CompileInThread = Callable[[Callable[[], CompiledGraph]], Awaitable[CompiledGraph]]


class _Compile:
    """One compile under way: what its callers wait on (``pending``), whether its graph
    is still wanted, and ``stop``, cancelled once it is not (see :meth:`SessionCache.evict`).

    Who closes a graph its task will never take (see the module docstring) is decided
    under a lock, once: the compile thread hands the graph over (:meth:`run`) unless the
    task has given up already (:meth:`give_up`), and closes it itself if it has; a task
    that gives up after the hand-over gets the graph back from :meth:`give_up` and closes
    it.
    """

    __slots__ = ("_given_up", "_landed", "_lock", "compile_graph", "pending", "stop",
                 "wanted")

    def __init__(self, compile_graph: Callable[[], CompiledGraph],
                 wanted: Callable[[], bool]) -> None:
        self.compile_graph = compile_graph
        self.wanted = wanted
        self.pending = Pending()
        self.stop = Cancellation()
        self._lock = threading.Lock()
        self._given_up = False
        #: The graph handed over to the task, which may give up before it takes it.
        self._landed: CompiledGraph | None = None

    def run(self, device: str) -> CompiledGraph:
        """The backend's compile call, in the compile thread, under that job's
        cancellation, which ``stop`` cancels too. A graph that lands once its task has
        given up is closed here, and ClosedResourceError raised for nobody."""
        job = current_cancellation()
        forget = None if job is None else self.stop.on_cancel(job.cancel)
        try:
            # Checked once the compile thread is free, after ``stop`` is linked (a graph
            # unloaded from now on cancels the call): ``wanted`` reads a flag, safe from
            # any thread. Callers that keep giving up while others compile must not
            # leave a compile queued for each of them.
            if not self.wanted():
                raise ClosedResourceError(
                    f"{device}: the graph was unloaded before it compiled")
            compiled = self.compile_graph()
        finally:
            if forget is not None:
                forget()
        with self._lock:
            given_up = self._given_up
            if not given_up:
                self._landed = compiled
        if not given_up:
            return compiled
        compiled.close()
        raise ClosedResourceError(
            f"{device}: the device actor closed while the graph compiled (the graph, which "
            "nobody took, was closed)")

    def give_up(self) -> CompiledGraph | None:
        """In trio: the task stops waiting for the graph (the actor is closing, or its job
        failed). A graph that lands from now on is closed by the compile thread; the one
        that landed already, if any, is returned, for the caller to close."""
        with self._lock:
            self._given_up = True
            landed, self._landed = self._landed, None
        return landed


class _CompileWait:
    """One caller waiting for a compile on behalf of an execution context: ``scope``
    (around its wait) is cancelled once the context withdraws it, ``why`` says why."""

    __slots__ = ("scope", "why")

    def __init__(self) -> None:
        self.scope = trio.CancelScope()
        self.why: str | None = None


class SessionCache:
    """The sessions compiled on ``device``, by key (see the module docstring).

    ``start_task`` runs each compile as a task of the actor's; ``compile_in_thread`` runs
    the backend's compile call in one of the actor's compile threads; ``close_later``
    closes an evicted graph whose close blocks (see :meth:`Session.evict`). Used in trio
    only.
    """

    def __init__(self, device: str, start_task: StartTask,
                 compile_in_thread: CompileInThread,
                 close_later: Callable[[CompiledGraph], None] | None = None) -> None:
        self.device = device
        #: Closes an evicted graph whose close blocks off the event loop (see
        #: Session.evict; None: every graph is closed where it is evicted).
        self._close_later = close_later
        #: The cached sessions, by key: read directly by the actor (``cached_session`` is on
        #: every request's path).
        self.sessions: dict[Hashable, Session] = {}
        #: Compiles that succeeded (cached or not).
        self.compiles = 0
        self._compiling: dict[Hashable, _Compile] = {}
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
            compiling = self._compiling.get(key)
            if compiling is None:
                compiling = self._compiling[key] = _Compile(compile_graph, wanted)
                try:
                    self._start_task(self._compile_task, (key, compiling, backend))
                except ClosedResourceError:
                    del self._compiling[key]
                    raise
            owner = QUEUE_OWNER.get()
            if owner is None:
                await compiling.pending.wait()
            else:
                await self._wait_owned(compiling.pending, owner)

    async def _wait_owned(self, pending: Pending, owner: QueueOwner) -> None:
        # ``pending.wait()`` for a request ``owner`` may withdraw meanwhile (see withdraw).
        wait = _CompileWait()
        owner.queued(wait, self)  # (withdrawn at once if its context closed already)
        try:
            with wait.scope:
                await pending.wait()
        finally:
            owner.left(wait)
        if wait.why is not None:  # (even if the compile ended as it was withdrawn)
            raise RequestWithdrawn(wait.why)

    def withdraw(self, wait: _CompileWait, why: str, /) -> bool:
        """Stop a caller waiting for a compile (in trio; see
        :class:`~wasinn.actors.slots.WaitingPlace`): it raises RequestWithdrawn saying
        ``why``; the compile goes on, and is cached for the next caller. False once it
        was withdrawn already."""
        if wait.why is not None:
            return False
        wait.why = withdrawal(why, "for its graph to compile on the device (the compile "
                                   "goes on)")
        wait.scope.cancel()
        return True

    async def _compile_task(self, job: tuple[Hashable, _Compile, str]) -> None:
        # In the actor's nursery: compile, cache, tell the waiting callers.
        key, compiling, backend = job
        pending, wanted = compiling.pending, compiling.wanted
        try:
            try:
                compiled = await self._compile_in_thread(
                    functools.partial(compiling.run, self.device))
            except BaseException:
                self._close_landed(compiling)
                raise
            self.compiles += 1
            session = Session(compiled, backend)
            if self._closed:
                session.evict()
                raise ClosedResourceError(f"{self.device}: the device actor is closed")
            if not wanted():  # (a compile its stop could not interrupt)
                session.evict()
                raise self._unloaded()
            self.sessions[key] = session
        except WasiNNError as exc:
            # A compile stopped because its graph was unloaded says so, not how the
            # backend took the cancel.
            pending.error = exc if wanted() else self._unloaded()
        except trio.Cancelled:  # the actor is closing: the compile is abandoned
            pending.error = ClosedResourceError(
                f"{self.device}: the device actor closed while the graph compiled")
            raise
        finally:
            del self._compiling[key]
            pending.done.set()

    def _close_landed(self, compiling: _Compile) -> None:
        # The task gives up on ``compiling`` (its job failed, or the actor is closing):
        # a graph that landed before is closed here, one landing later by its thread. In
        # an exception handler: a failing close is logged, not raised over a Cancelled.
        landed = compiling.give_up()
        if landed is None:
            return
        try:
            landed.close()
        except Exception:
            log.exception("%s: closing a compiled graph nobody took failed", self.device)

    def _unloaded(self) -> ClosedResourceError:
        return ClosedResourceError(f"{self.device}: the graph was unloaded while it compiled")

    def evict(self, key: Hashable) -> None:
        """Free the graph cached under ``key`` (now, or when its running jobs end). A
        compile of it under way whose graph is no longer wanted (its model was
        unloaded) is cancelled: stopped where the backend can stop a load, closed when
        it lands otherwise (see the module docstring)."""
        session = self.sessions.pop(key, None)
        if session is not None:
            session.evict(self._close_later)
        compiling = self._compiling.get(key)
        if compiling is not None and not compiling.wanted():
            compiling.stop.cancel()

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
