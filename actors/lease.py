"""``Lease``: a device's worker slot lent to a thread that is not trio's.

A caller that already sits in a worker thread of its own (a WebAssembly guest, which runs
in a ``trio.to_thread`` thread and reaches trio with ``trio.from_thread.run``) would
otherwise cross into trio, have the actor hand the job to a device worker thread, and
cross back twice more: two trio wake-ups and two thread wake-ups per request. With a
lease it asks trio only for the slot (the request is queued and ordered like any other,
and counts against the device's ``workers`` bound), runs the job in its own thread, and
gives the slot back without waiting: at most one round trip into trio per request, none
when a slot is free and nobody is queued (:meth:`DeviceActor.try_lease`, see
:mod:`wasinn.actors.slots`).

A lease cannot be abandoned: its job runs in the caller's own thread, which waits for it.
Its run is cancelled (see :class:`~wasinn.backends.base.Cancellation`; ONNX Runtime and
OpenVINO stop within milliseconds, torch where it can) when its deadline passes
(TimeoutError_: the device actor watches leases that have one), when another thread
interrupts it (:meth:`Lease.interrupt`: BackendRuntimeError), or when the device actor
closes (ClosedResourceError; DeviceLostError when it closed because its device was lost).
Whoever holds one must call :meth:`Lease.run` (or :meth:`Lease.cancel`) exactly once. One
dropped without either (its holder's bug) does not hold its slot for ever: once collected,
its slot and graphs are given back in trio and a ResourceWarning says so, as an unclosed
file's does (a lease with a deadline is kept by the device's deadline watcher until that
deadline has passed).
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
import warnings
from collections.abc import Callable
from typing import Generic, TypeVar

import trio

from wasinn.backends.base import Cancellation, running_under
from wasinn.errors import (
    BackendRuntimeError,
    ClosedResourceError,
    DeviceLostError,
    InvalidArgumentError,
    TimeoutError_,
    WasiNNError,
)

from .jobs import Wrap, backend_failure, in_context
from .slots import requested
from .stats import Outcome

T = TypeVar("T")

log = logging.getLogger("wasinn.actors")


class Lease(Generic[T]):
    """One worker slot of ``device`` reserved for ``job``, to be run by the caller's thread.

    ``release`` gives the slot back, told how the request ended (see
    :class:`~wasinn.actors.stats.Outcome`) and whether its run started in the holder's
    thread (False: cancelled, dropped, or stopped before it ran).

    ``expires`` is a ``time.perf_counter()`` instant (``math.inf`` = none): a run still
    going then is stopped where its backend can (:meth:`interrupt`, called by the device
    actor's deadline watcher), and a run that ends after it raises TimeoutError_ and its
    result is dropped, as a request abandoned at its deadline would be.

    Its holder must end it, with :meth:`run` or :meth:`cancel`, even after the device has
    closed (run then raises ClosedResourceError at once): until then the lease holds its
    slot and whatever it was given to hold (:meth:`then`), a compiled graph included.
    ``later`` hands a call to trio (the actor's ``TrioToken.run_sync_soon``): a lease
    dropped unended gives its slot back through it (see the module docstring). ``lost``
    says why the device can run nothing more, if it was lost: the error a run the device's
    close cut off raises, rather than ClosedResourceError. ``label`` names its run (a
    model's: ``"run of resnet (onnxruntime)"``; "" for none) in its deadline's error and
    in the DEBUG line (logger ``wasinn.actors``) of a run that fails or times out.
    """

    __slots__ = ("_done", "_interrupted", "_later", "_lock", "_lost", "_over", "_release",
                 "_then", "_wrap", "cancellation", "device", "expires", "job", "label",
                 "timeout")

    def __init__(self, device: str, job: Callable[[], T],
                 wrap: Wrap | None,
                 release: Callable[[Outcome, bool], None], expires: float,
                 cancellation: Cancellation | None = None,
                 later: Callable[[Callable[[], None]], None] | None = None,
                 lost: Callable[[], DeviceLostError | None] | None = None,
                 label: str = "") -> None:
        #: Cancelled when the device closes during the run (None: never); it names whom
        #: the run is for to its backend too (its ``caller``: the request's tenant).
        self.cancellation = cancellation
        self.device = device
        self.label = label
        #: The job, until it is taken (run or cancelled): then dropped, with the inputs it
        #: holds, though the lease itself may be kept a while (a deadline watcher).
        self.job: Callable[[], T] | None = job
        self.expires = expires
        #: The timeout (seconds) the request was given, if its holder sets it: named in
        #: the TimeoutError_ that :meth:`run` raises, so the caller knows which one passed.
        self.timeout: float | None = None
        self._wrap = wrap
        self._release = release
        self._lock = threading.Lock()
        self._done = False  # taken: run or cancelled
        self._over = False  # run and given back, or cancelled
        self._interrupted = ""  # why interrupt() stopped the run: "deadline" or "interrupt"
        self._then: tuple[Callable[[], object], ...] = ()  # see then()
        self._later = later
        self._lost = lost

    def __del__(self) -> None:
        # Dropped unended. A collection may run this in any thread, even inside a lock
        # that giving back takes (a cycle collected there): hand the give-back to trio
        # instead of doing it here, then warn (a warning turned into an error must not
        # keep the slot).
        if self._done or self._later is None:
            return
        self._later(functools.partial(_give_back_dropped, self._release, self._then))
        warnings.warn(
            f"a lease on {self.device} was dropped without being run or cancelled: its "
            "worker slot and graphs are given back; end every lease with run() or cancel()",
            ResourceWarning, stacklevel=2)

    def __repr__(self) -> str:
        return f"<Lease on {self.device} {'done' if self._done else 'held'}>"

    def run(self) -> T:
        """Run the job here, in the calling thread, then give the slot back.

        Call it from a thread that is not trio's: in the trio thread it raises
        RuntimeError (the run would block the event loop), and the lease stays unused.
        Raises what the job raises (a WasiNNError as it is, any other exception as
        BackendRuntimeError), TimeoutError_ when the run ended past ``expires``,
        ClosedResourceError when the device closed and cancelled the run (DeviceLostError
        when it closed because the device was lost), and
        InvalidArgumentError when the lease was already used or cancelled.
        """
        if trio.lowlevel.in_trio_run():
            raise RuntimeError(
                "a lease runs its backend in the calling thread, and this is the trio "
                "thread, whose event loop it would block: call run() from a worker thread "
                "(trio.to_thread.run_sync), or await the async compute instead")
        job = self._take()
        cancellation = self.cancellation
        if cancellation is not None and cancellation.cancelled:
            # Stopped before it started (its deadline passed, the device closed): a run
            # now would only be thrown away, and not every run can be cut short.
            error = self._stopped("before it ran")
            self._give_back(self._stopped_outcome())
            raise self._failed(error)
        outcome = Outcome.FAILED
        try:
            work = in_context(job, self._wrap)
            with running_under(cancellation):
                result = work()
            if time.perf_counter() <= self.expires:
                outcome = Outcome.COMPLETED
            else:
                outcome = Outcome.TIMED_OUT
        except Exception as exc:
            if isinstance(exc, DeviceLostError):
                self._failed(exc)
                raise  # this run found the device lost: the close that follows is its own
            if cancellation is not None and cancellation.cancelled:
                outcome = self._stopped_outcome()
                raise self._failed(self._stopped("while it ran")) from exc
            if isinstance(exc, WasiNNError):
                self._failed(exc)
                raise
            raise self._failed(backend_failure(self.device, exc)) from exc
        finally:
            self._give_back(outcome, ran=True)
        if outcome is Outcome.TIMED_OUT:
            raise self._failed(self._timed_out("before it finished"))
        return result

    def _failed(self, error: WasiNNError) -> WasiNNError:
        # ``error``, which its run raises, logged at DEBUG: the trio side logs the other
        # requests that fail (see wasinn.scheduler), not this run in the holder's thread.
        log.debug("%s: %s: %s", requested(self.label, self.device), type(error).__name__,
                  error)
        return error

    def _stopped(self, when: str) -> WasiNNError:
        # Why a cancelled lease did not give a result: its deadline, an interrupt, or
        # its device closing.
        if self._interrupted == "deadline":
            return self._timed_out(f"{when}; the run was stopped")
        if self._interrupted:
            return BackendRuntimeError(f"{self.device}: the request was interrupted {when}")
        lost = None if self._lost is None else self._lost()
        if lost is not None:
            return lost.for_another_caller()
        return ClosedResourceError(f"{self.device}: the device closed {when}")

    def _timed_out(self, when: str) -> TimeoutError_:
        timeout = "" if self.timeout is None else f" (timeout={self.timeout:g} s)"
        return TimeoutError_(f"{requested(self.label, self.device)}: the request's deadline "
                             f"passed {when}{timeout}")

    def _stopped_outcome(self) -> Outcome:
        # How a cancelled lease is counted: its deadline passed, its caller gave up
        # (interrupted: a guest cancelled by its own caller), or its device closed.
        if self._interrupted == "deadline":
            return Outcome.TIMED_OUT
        return Outcome.CANCELLED if self._interrupted else Outcome.FAILED

    @property
    def over(self) -> bool:
        """The job has run (or the lease was cancelled) and the slot is given back."""
        return self._over

    def interrupt(self, *, deadline: bool = False) -> None:
        """Stop the run in progress (or the one about to start) where its backend can
        (ONNX Runtime, OpenVINO, torch where it can): :meth:`run` then raises
        BackendRuntimeError, or TimeoutError_ when ``deadline`` (its deadline passed).
        From any thread; a no-op once the lease is over; the first reason given stays."""
        if self._over:
            return
        if not self._interrupted:
            self._interrupted = "deadline" if deadline else "interrupt"
        if self.cancellation is not None:
            self.cancellation.cancel()

    def then(self, callback: Callable[[], object]) -> None:
        """Have ``callback`` called once the lease is over (its run has given the slot
        back and been counted, or it was cancelled), in the thread that ends it: to let
        go of what the job holds (a compiled graph kept open for it). It must not raise.
        Set it before the lease is handed to the thread that runs it; callbacks set on
        one lease are called in the order they were set."""
        self._then = (*self._then, callback)

    @property
    def lends_slot(self) -> bool:
        """Whether it holds a slot until it is over (False: a settled lease, whose
        request has run elsewhere and been counted there)."""
        return self._release is not _nothing_to_give_back

    def cancel(self) -> None:
        """Give the slot back without running the job (from any thread). Idempotent."""
        with self._lock:
            if self._done:
                return
            self._done = True
            self.job = None
        self._give_back(Outcome.CANCELLED)

    def _take(self) -> Callable[[], T]:
        with self._lock:
            job = self.job
            if self._done or job is None:
                raise InvalidArgumentError(f"{self!r} was already used or cancelled: "
                                           "expected one run() or cancel() per lease")
            self._done = True
            self.job = None
            return job

    def _give_back(self, outcome: Outcome, *, ran: bool = False) -> None:
        # Thread-safe and never waits: trio is woken only if a queued request gets the slot.
        self._over = True
        self._release(outcome, ran)
        then, self._then = self._then, ()
        for callback in then:
            callback()


def _give_back_dropped(release: Callable[[Outcome, bool], None],
                       then: tuple[Callable[[], object], ...]) -> None:
    """In trio: what :meth:`Lease.run` or :meth:`Lease.cancel` would have given back.
    Nothing may escape: an exception here would end trio itself."""
    try:
        release(Outcome.CANCELLED, False)
        for callback in then:
            callback()
    except Exception:
        log.exception("giving back a dropped lease's slot and graphs failed")


def settled(device: str, result: T) -> Lease[T]:
    """A lease for a request that has already run elsewhere (in a worker thread, or in a
    batch, see :mod:`wasinn.actors.batching`): it holds no slot, and :meth:`Lease.run` returns
    ``result`` at once, so a lease holder's code needs no second path."""
    return Lease(device, lambda: result, None, _nothing_to_give_back, math.inf)


def _nothing_to_give_back(outcome: Outcome, ran: bool) -> None:
    """A settled lease holds no slot (its request was counted where it ran)."""
