"""A guest's worker thread, waited for at most :data:`STOP_GRACE_S` once the guest is stopped.

Guest code (a core module's ``_start``, a component's instantiation or one of its calls)
runs in a trio worker thread of its own, started by :meth:`GuestRun.run`. Stopping the
guest (its caller is cancelled, its ``run_timeout`` passes, it overflows its scratch
quota) asks it to stop: the ``stop`` callback given to :class:`GuestRun` requests its
:class:`~wasinn.host.interrupt.Interrupter` and interrupts the inference it runs, and
every call it waits on in trio is cancelled. Nearly every guest then ends at once (while
it has not, the run reminds it every :data:`REMIND_S`: a guest computing in wasm whose
request fell between its epoch-deadline callback and its new deadline is reached so, see
:mod:`wasinn.host.interrupt`). One
blocked in a host call that wasinn cannot interrupt ends only when that call returns:
a component sleeping in ``wasi:io/poll`` (wasmtime's own WASI 0.2), any guest opening or
reading a FIFO in a directory it was given, an inference that ignores interruption (a
TorchScript module without a loop). The stop waits :data:`STOP_GRACE_S` seconds for the thread, then
*abandons* it, and the caller's cancellation (or whatever the stop raises) goes on.

Once a thread is abandoned:

* a warning names the program; :func:`abandoned_guest_threads` counts it until it ends;
* the host releases what the guest held, as for a guest that ended: its graphs and
  contexts, its scratch directory. The thread traps at its next epoch check when its
  host call returns (its interrupter stays requested). A straight run of host calls has
  no epoch check, so every wasi-nn host function checks first (the legacy ABI's
  :class:`~wasinn.host.nn_core.GuestNN` refuses with ClosedResourceError, a component's
  linker traps), and a scheduler object that reaches the guest after its release (a
  load that ignored the cancellation) is released at once, never handed to the guest;
* an inference the thread runs itself (on a device slot it leased) goes on until the
  backend returns; its context is closed under it, so its outputs are dropped (the
  guest gets ClosedResourceError), and its graph's session is closed by the device when
  that run ends (:mod:`wasinn.actors.session`);
* a component guest whose call was abandoned cannot be called again (its thread still
  holds its store);
* the thread itself is one of trio's worker threads, which are daemon threads: one that
  never returns does not hold the interpreter's exit. It is named ``guest PROGRAM``;
* its token of :func:`guest_threads` is given back at once, not when the thread ends
  (trio's own abandonment keeps it until then, and for ever if the thread never ends): the
  limiter counts the threads a run waits for, so a thread sleeping for ever does not take
  a place in the pool for ever; abandoned threads are counted apart, by
  :func:`abandoned_guest_threads`, and an info line says when one ends.

A guest that ends within the grace is not abandoned: its run ends as it always did.

The guest's calls into trio go through :class:`GuestPortal`. In a thread run here,
trio runs them in system tasks, each in a cancel scope of its run (trio runs the calls of
an abandonable thread outside the caller's task, so the run cancels them itself when the
guest is stopped, as the caller's cancellation would reach them in its own task). A task
per call costs more than running it in the caller's task: about 75 us more per round
trip (209 against 133 us, the best of 6 runs of 3000 on a busy 2-core VM). Only loads,
contexts made and closed, and requests queued on a busy device take one; a compute on a
free slot takes none.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

import outcome
import trio

from wasinn._groups import collapsed_groups
from wasinn._requester import requested_by
from wasinn.errors import ClosedResourceError

log = logging.getLogger("wasinn.host")

T = TypeVar("T")

#: Seconds a stopped guest's thread is waited for before it is abandoned (see the module
#: docstring); ``wasinn run`` says the same on Ctrl-C and at ``run_timeout``.
STOP_GRACE_S = 2.0

#: Seconds between the reminders of a stopped guest whose thread has not ended yet
#: (see :class:`GuestRun`).
REMIND_S = 0.05

# Every guest gets its own worker thread for as long as it runs: guests mostly wait in
# wasi-nn calls, so they must not compete with the device actors' inference threads.
_GUEST_THREADS = trio.lowlevel.RunVar[trio.CapacityLimiter]("wasinn_guest_threads")


class _Count:
    """A counter several threads change."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0

    def add(self, delta: int) -> int:
        with self._lock:
            self.value += delta
            return self.value


#: Abandoned guest threads still running, in this process.
_ABANDONED = _Count()

# The GuestRun whose guest code this thread runs (unset in any other thread).
_current = threading.local()


def guest_threads() -> trio.CapacityLimiter:
    """The limiter of this trio run's guest threads (no bound: one thread per guest)."""
    try:
        return _GUEST_THREADS.get()
    except LookupError:
        limiter = trio.CapacityLimiter(math.inf)
        _GUEST_THREADS.set(limiter)
        return limiter


def abandoned_guest_threads() -> int:
    """Guest threads abandoned by a stop (see the module docstring) and still running, in
    this process: each is blocked in a host call, and traps once that call returns."""
    return _ABANDONED.value


def in_abandoned_thread() -> bool:
    """Whether this thread runs guest code whose run was abandoned: what it does from then
    on must not touch the guest's host objects, released already."""
    run: GuestRun | None = getattr(_current, "run", None)
    return run is not None and run.abandoned


class _Borrow:
    """One thread's token of :func:`guest_threads`, given back once: when the thread ends,
    or when its run abandons it (a CapacityLimiter-like object for ``trio.to_thread``)."""

    def __init__(self, limiter: trio.CapacityLimiter) -> None:
        self._limiter = limiter
        self._held = False

    async def acquire_on_behalf_of(self, _borrower: object) -> None:
        await self._limiter.acquire_on_behalf_of(self)
        self._held = True

    def release_on_behalf_of(self, _borrower: object) -> None:
        self.give_back()

    def give_back(self) -> None:
        if self._held:
            self._held = False
            self._limiter.release_on_behalf_of(self)


class GuestRun:
    """One stretch of a guest's code in a worker thread, stopped by cancellation or
    :meth:`stop` and abandoned :data:`STOP_GRACE_S` seconds later if it has not ended.

    ``stop`` asks the guest to stop (from the trio thread, at most once): request its
    interrupter, interrupt its inference. ``remind`` (from the trio thread, every
    :data:`REMIND_S` while the stopped guest's thread goes on, during the grace) asks
    again where a request may have been missed: it moves the epoch once more
    (:meth:`~wasinn.host.interrupt.Interrupter.remind`). ``program`` names it in logs and
    thread names. One GuestRun runs one function once.
    """

    def __init__(self, program: str, stop: Callable[[], None],
                 remind: Callable[[], None] | None = None) -> None:
        self.program = program
        self._stop_guest = stop
        self._remind = remind
        self._stop_requested = trio.Event()
        # The cancel scopes of the guest's calls in trio (trio thread only).
        self._calls: set[trio.CancelScope] = set()
        self._lock = threading.Lock()  # the thread's end against its abandonment
        self._abandoned = False
        self._ended = False

    @property
    def stopped(self) -> bool:
        return self._stop_requested.is_set()

    @property
    def abandoned(self) -> bool:
        return self._abandoned

    def stop(self) -> None:
        """Ask the guest to stop (in trio): its ``stop`` callback, and every call it waits
        on in trio is cancelled. A run under way abandons the thread if it has not ended
        :data:`STOP_GRACE_S` seconds later. Idempotent."""
        if self._stop_requested.is_set():
            return
        self._stop_requested.set()
        self._stop_guest()
        for scope in self._calls:
            scope.cancel()

    async def run(self, fn: Callable[..., T], *args: Any) -> outcome.Outcome[T] | None:
        """Call ``fn(*args)`` in a new guest thread; return what it returned or raised.

        Cancellation stops the guest (:meth:`stop`) and waits for its thread at most
        :data:`STOP_GRACE_S` seconds (shielded); then, ended or abandoned, Cancelled is
        raised. A :meth:`stop` from within (no cancellation) waits as long, then returns
        None if it abandoned the thread. A KeyboardInterrupt that trio delivers meanwhile
        stops the guest the same way and is raised as itself, never in an exception
        group (:mod:`wasinn._groups`).
        """
        await trio.lowlevel.checkpoint_if_cancelled()  # (no thread for a cancelled caller)
        result: outcome.Outcome[T] | None = None
        ended = trio.Event()
        keep = trio.CancelScope(shield=True)  # cancelled only to abandon the thread
        borrow = _Borrow(guest_threads())

        async def thread() -> None:
            nonlocal result
            with keep:
                result = await trio.to_thread.run_sync(
                    self._work, fn, args, abandon_on_cancel=True,
                    limiter=cast(trio.CapacityLimiter, borrow),
                    # (not "wasinn ...": the runtime's own threads, which its close ends)
                    thread_name=f"guest {self.program}")
            ended.set()
            nursery.cancel_scope.cancel()

        async def watch() -> None:
            try:
                await self._stop_requested.wait()
            finally:
                if not ended.is_set():
                    self.stop()
                    with trio.CancelScope(shield=True) as grace:
                        grace.deadline = trio.current_time() + STOP_GRACE_S
                        while not ended.is_set():
                            with trio.move_on_after(REMIND_S):
                                await ended.wait()
                            if not ended.is_set() and self._remind is not None:
                                self._remind()
                    if not ended.is_set() and self._abandon(borrow):
                        keep.cancel()
                    with trio.CancelScope(shield=True):
                        await ended.wait()  # at once once abandoned (or just ended)

        with collapsed_groups():  # (a Ctrl-C meanwhile reaches the caller as itself)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(thread)
                nursery.start_soon(watch)
        return result

    def _work(self, fn: Callable[..., T], args: tuple[Any, ...]) -> outcome.Outcome[T]:
        # In the guest's thread: everything it raises is its outcome, never trio's.
        _current.run = self
        try:
            with requested_by(self.program):  # (its warnings point at the guest)
                result = outcome.capture(fn, *args)
        finally:
            _current.run = None
        with self._lock:
            self._ended = True
            abandoned = self._abandoned
        if abandoned:
            left = _ABANDONED.add(-1)
            log.info("the abandoned thread of %s ended (%s); %d guest thread(s) still "
                     "abandoned", self.program, _describe(result), left)
        return result

    def _abandon(self, borrow: _Borrow) -> bool:
        # In trio, the grace over: False if the thread has ended meanwhile after all.
        with self._lock:
            if self._ended:
                return False
            self._abandoned = True
        count = _ABANDONED.add(1)
        borrow.give_back()
        log.warning(
            "%s was stopped but did not end within %g s: its thread is abandoned, blocked "
            "in a host call that cannot be interrupted (such as a component's WASI sleep or "
            "a read of a FIFO); what the guest held is released now, and the thread traps as "
            "soon as that call returns (%d guest thread(s) abandoned)", self.program,
            STOP_GRACE_S, count)
        return True

    # -- the guest's calls into trio (GuestPortal) ----------------------------------------
    def call(self, afn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """From the guest's thread: ``await afn(*args)`` in trio, cancelled when the guest
        is stopped (trio.Cancelled is raised here then, as for a cancelled caller)."""
        result: outcome.Outcome[T] = self._reach_trio(self._in_trio, afn, args)
        return result.unwrap()

    def call_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """From the guest's thread: ``fn(*args)`` in trio."""
        result: outcome.Outcome[T] = self._reach_trio(self._sync_in_trio, fn, args)
        return result.unwrap()

    def _reach_trio(self, afn: Callable[..., Awaitable[outcome.Outcome[T]]], *args: Any
                    ) -> outcome.Outcome[T]:
        try:
            return trio.from_thread.run(afn, *args)
        except trio.RunFinishedError:
            raise ClosedResourceError(
                f"{self.program}: the trio run serving the runtime has ended") from None

    async def _in_trio(self, afn: Callable[..., Awaitable[T]], args: tuple[Any, ...]
                       ) -> outcome.Outcome[T]:
        with trio.CancelScope() as scope:
            if self.stopped:
                scope.cancel()
            self._calls.add(scope)
            try:
                # Captured inside the scope: a Cancelled reaches the guest's thread as it
                # would from the caller's own task, instead of ending the scope quietly.
                return await outcome.acapture(afn, *args)
            finally:
                self._calls.discard(scope)
        raise AssertionError("unreachable: the outcome is captured inside the scope")

    @staticmethod
    async def _sync_in_trio(fn: Callable[..., T], args: tuple[Any, ...]) -> outcome.Outcome[T]:
        return outcome.capture(fn, *args)


class GuestPortal:
    """The :class:`~wasinn.host.scheduler_api.Portal` of a guest's host objects. From a
    thread that :meth:`GuestRun.run` started, a call belongs to that run (cancelled when
    the guest is stopped); from any other thread started by ``trio.to_thread`` (the one
    that releases a component guest), it is plain ``trio.from_thread``."""

    def run(self, afn: Callable[..., Awaitable[T]], *args: Any) -> T:
        run: GuestRun | None = getattr(_current, "run", None)
        if run is None:
            return trio.from_thread.run(afn, *args)
        return run.call(afn, *args)

    def run_sync(self, fn: Callable[..., T], *args: Any) -> T:
        run: GuestRun | None = getattr(_current, "run", None)
        if run is None:
            return trio.from_thread.run_sync(fn, *args)
        return run.call_sync(fn, *args)


async def shielded(afn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``await afn(*args)`` shielded from cancellation: for a release that must happen
    even in a stopped guest's call (through its portal)."""
    with trio.CancelScope(shield=True):
        return await afn(*args)
    raise AssertionError("unreachable: a shielded scope is never cancelled")


def guest_stopped() -> ClosedResourceError:
    """What a wasi-nn call of a guest whose host objects were released gets (its thread,
    abandoned, woke and called on: see the module docstring)."""
    return ClosedResourceError(
        "this guest was stopped: its graphs and contexts are released (expected no wasi-nn "
        "call after the guest's run ended)")


def _describe(result: outcome.Outcome[Any]) -> str:
    if isinstance(result, outcome.Value):
        return f"it returned {result.value!r}"
    assert isinstance(result, outcome.Error)
    error = result.error
    return f"{type(error).__name__}: {str(error).strip()[:200]}"
