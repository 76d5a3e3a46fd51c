"""``Slots``: admission to a device's ``workers`` worker slots, in trio and from threads.

A request runs only while it holds one of ``workers`` slots. In trio, a request takes a
free slot at once when nobody is queued, or waits in the queue (ordered by the
:class:`~wasinn.actors.queue.QueuePolicy`) until a slot is granted to it. A thread that
is not trio's (a guest's, running its own backend calls through a
:class:`~wasinn.actors.lease.Lease`) may also take a free slot directly, without a trip
through trio, but only when nobody is queued: so it never overtakes a queued request,
and priorities, deadlines and fairness apply exactly as before. Giving a slot back from
such a thread wakes trio only when a queued request is waiting for it.

A worker thread that finishes a job passes its slot on itself (:meth:`Slots.pass_on`):
it takes the next request from the queue, in the policy's order, at the very moment the
slot frees, and when that request came with its job prepared (``Request.handoff``) the
thread starts it at once, before trio has even seen the previous result. Under load a
device therefore goes from one run to the next without waiting for the event loop (two
cross-thread wake-ups and two trio scheduling rounds, 0.2-0.3 ms on a small VM), while
priorities, deadlines and fairness decide exactly as when trio grants the slot. The
request's caller learns it was granted once trio has taken the previous result.

Neither trio nor a worker thread grants a slot to a request whose deadline has passed
(``Request.expires``, read on trio's own clock: a worker thread reads it too, so a
test's ``MockClock`` decides there as in trio): it leaves the queue unrun, the slot goes
to the next request, and its caller's cancel scope, due already, times it out as if
trio had dropped it. Without this, a busy event loop (a long synchronous callback) would
let a worker thread chain the runs of requests that had all timed out, spending device
time on callers that get ``TimeoutError_`` anyway.

A policy that shares device time among tenants (``policy = "fair"``) is charged each
run's device seconds in the worker thread where it ended, in the same critical section
as that thread's ``pass_on``, so the next choice already counts it.

The counts and the queue (the policy: every one of its calls) are guarded by one lock,
so that the check "free slot and empty queue" and the queueing of a request are atomic
with respect to a slot given back by another thread (otherwise a request could queue
just after the last slot was freed and wait for ever). Granting a queued request
(setting its trio Event) happens in trio.

A request's owner may withdraw it while it waits (:class:`QueueOwner`: an execution
context that closes drops the requests it has queued, unrun, instead of letting them run
for nobody). The owner is named for the request's duration by :data:`QUEUE_OWNER`, a
context variable read only when a request has to wait: the scheduler and the runner
between the context and the queue have no business with it, and a request that takes a
free slot at once pays nothing for it. Withdrawal is decided under the lock, so a request
is either withdrawn unrun or granted its slot, never both. The queue is one place a
request waits (a :class:`WaitingPlace`); the others are a batch that has not started
(:mod:`wasinn.actors.batching`) and its graph's first compile on the device
(:mod:`wasinn.actors.sessioncache`), which withdraw it the same way.

A slot may be held idle: a batch waiting for company (``max_delay``, see
:mod:`wasinn.actors.batching`). It waits only while the device has nothing else to do:
the request that queues next ends the wait (:meth:`Slots.idle`), so nothing that cannot
join the batch waits behind an idle slot. A request that finds a free slot pays nothing
for it.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import trio

from wasinn.errors import ClosedResourceError, QueueFullError

from .queue import Handoff, QueuePolicy, Request


class RequestWithdrawn(ClosedResourceError):
    """A waiting request its owner withdrew, unrun (see :class:`QueueOwner`)."""


def requested(label: str, device: str) -> str:
    """What a request's errors start with: its run's ``label`` where it has one (``"run
    of resnet (onnxruntime)"``: a model's, or a pipeline's) and its ``device`` (``"run
    of resnet (onnxruntime) on gpu:0"``), else the device's name alone."""
    return f"{label} on {device}" if label else device


def withdrawal(why: str, where: str) -> str:
    """What the caller of a request withdrawn while it waited ``where`` is told, its
    owner having withdrawn it because ``why`` (see :meth:`QueueOwner.withdraw_all`)."""
    return f"{why} while its request waited {where}: it was withdrawn, unrun"


class WaitingPlace(Protocol):
    """Where a request waits before it runs (a device's queue, a batch that has not
    started, its graph's compile): it can take one of its waiting requests out, unrun."""

    def withdraw(self, waiting: Any, why: str, /) -> bool:
        """Take ``waiting`` out unrun if it still waits here (in trio): its caller wakes
        at once and raises :class:`RequestWithdrawn`, saying ``why`` (see
        :func:`withdrawal`). False, changing nothing, once it has stopped waiting."""
        ...


class QueueOwner:
    """Who may withdraw the requests made on its behalf while they wait on a device (in
    its queue, in a batch that has not started, for its graph's first compile): an
    execution context, which withdraws them when it closes. Named as
    :data:`QUEUE_OWNER` while a request is made; in trio only.

    Only requests that wait are noted (until they stop waiting), so an owner costs
    nothing while its requests find free slots.
    """

    __slots__ = ("_waiting", "why")

    def __init__(self) -> None:
        self._waiting: dict[Any, WaitingPlace] = {}
        #: Once :meth:`withdraw_all` was called: why (a request that waits later is
        #: withdrawn at once).
        self.why: str | None = None

    def queued(self, waiting: Any, place: WaitingPlace) -> None:
        """``waiting`` (a request, as ``place`` knows it) waits in ``place``: withdraw it
        with the others (at once when they were withdrawn already)."""
        if self.why is not None:
            place.withdraw(waiting, self.why)
        else:
            self._waiting[waiting] = place

    def left(self, waiting: Any) -> None:
        """``waiting`` no longer waits (granted, withdrawn, cancelled, refused)."""
        self._waiting.pop(waiting, None)

    def withdraw_all(self, why: str) -> None:
        """Withdraw every request of this owner still waiting, and any that waits from
        now on: their callers raise :class:`RequestWithdrawn` saying ``why`` (what
        happened: "the execution context of m was closed") and where the request waited
        (see :func:`withdrawal`). A request already granted its slot is left to run."""
        self.why = why
        waiting, self._waiting = self._waiting, {}
        for request, place in waiting.items():
            place.withdraw(request, why)


#: The owner of the request the current task is making (None: nobody may withdraw it):
#: set by the caller around the request, read by :meth:`Slots.take` when it queues one.
QUEUE_OWNER: contextvars.ContextVar[QueueOwner | None] = contextvars.ContextVar(
    "wasinn_queue_owner", default=None)


class Slots:
    """``workers`` slots and the queue of requests waiting for one (see the module).
    ``name``: the device's; ``pool``: where its pool's ``queue_limit`` is set
    (``"[pools.gpu]"``, "" where there is none), which a full queue's error names."""

    def __init__(self, name: str, workers: int, queue_limit: int, policy: QueuePolicy,
                 pool: str = "") -> None:
        self.name = name
        self.workers = workers
        self.queue_limit = queue_limit
        self.pool = pool
        self._policy = policy
        self._lock = threading.Lock()
        self._running = 0
        self._closed = False
        self._token: trio.lowlevel.TrioToken | None = None
        #: Slots given back: by every request that held one, whether its job ran or not.
        self.released = 0
        #: The scopes of slot holders idling until other work comes (see :meth:`idle`),
        #: the longest idle first.
        self._idle: dict[trio.CancelScope, None] = {}
        #: Trio's clock (any thread may read it; bound to the run's own by :meth:`open`),
        #: for the requests' ``expires``.
        self._now: Callable[[], float] = trio.current_time
        #: How many requests wait (a merged batch's members each count: the device
        #: actor's figure), for a full queue's error; None: the queue's entries.
        self.waiting: Callable[[], int] | None = None

    @property
    def running(self) -> int:
        """Slots held now."""
        return self._running

    @property
    def queued(self) -> int:
        """Entries in the queue (a merged batch is one)."""
        return len(self._policy)

    def open(self) -> None:
        """Bind to the current trio run (threads giving slots back reach it through its
        token; worker threads read its clock)."""
        self._token = trio.lowlevel.current_trio_token()
        self._now = trio.lowlevel.current_clock().current_time

    # -- in trio ----------------------------------------------------------------------------
    async def take(self, priority: int = 0, deadline: float = math.inf, tenant: str = "",
                   label: str = "", *, request: Request | None = None,
                   handoff: Handoff | None = None) -> bool:
        """Hold a slot: at once if one is free and nobody is queued, else after queueing.
        ``label`` names the request's run (its model's, see :func:`requested`) in the
        errors it may get here.

        ``request``: the queue entry to wait as (its own terms then apply), for a caller
        that may :meth:`requeue` it while it waits; by default one is made from
        ``priority``, ``deadline`` and ``tenant`` when the request has to queue, which
        expires at ``deadline`` (trio time): the caller must wait within a cancel scope
        of its own that ends the wait then (a timeout), for a request past it is never
        granted a slot and left to that scope (see ``Request.expires``).
        ``handoff``: the request's job, prepared, which the worker thread that frees the
        slot may start at once (:meth:`pass_on`). Returns whether one did: the slot is
        then the job's, which frees it when it is over.
        Raises ClosedResourceError when closed (before or while queued), QueueFullError (a
        TooLargeError) when the queue is full, naming the pool's ``queue_limit`` and its
        value, RequestWithdrawn (a ClosedResourceError) when the request's
        :class:`QueueOwner` (the task's :data:`QUEUE_OWNER`) withdraws it while it waits
        (a batch's task names none: its entry serves several callers). Cancelled while
        queued, the request leaves the queue (a slot granted at that very moment is handed
        on; a job started by then is abandoned).
        """
        if self._closed:
            raise ClosedResourceError(f"{self.name}: the device actor is closed")
        await trio.lowlevel.checkpoint_if_cancelled()
        owner = None
        with self._lock:
            if self._running < self.workers and not len(self._policy):
                self._running += 1
                return False
            if request is None:
                request = Request(priority, deadline, tenant)
                request.expires = deadline
            owner = QUEUE_OWNER.get()
            displaced = None
            if len(self._policy) >= self.queue_limit:
                displaced = self._policy.displace(request.tenant)
                if displaced is None:
                    raise QueueFullError(f"{requested(label, self.name)}: {self._full()}: "
                                         f"retry later or {self._raise_limit()}")
                displaced.displaced_by = request.tenant
                displaced.handoff = None  # (and the inputs its job holds)
            request.handoff = handoff
            self._enqueue(request)
        if displaced is not None:
            displaced.event.set()  # not granted: its waiter raises QueueFullError
        if owner is not None:
            owner.queued(request, self)
        try:
            await request.event.wait()
        except BaseException:
            with self._lock:  # a worker thread may grant it meanwhile (pass_on)
                granted = request.granted
                if not granted:
                    self._policy.remove(request)
                    # The queue forgets it lazily (a heap keeps removed entries for a
                    # while): let go of its job, and of the inputs the job holds, now.
                    request.handoff = None
            if granted:  # granted just as we were cancelled: hand it on
                if request.started:
                    assert handoff is not None
                    handoff.abandon()  # the job frees the slot once it is over
                else:
                    self.free()
            raise
        finally:
            if owner is not None:
                owner.left(request)
        if not request.granted:
            if request.withdrawn is not None:
                raise RequestWithdrawn(request.withdrawn)
            if request.displaced_by is not None:
                raise QueueFullError(
                    f"{requested(label, self.name)}: {self._full()} "
                    f"and this request, of the tenant with the most waiting, gave its place "
                    f"to one of tenant {request.displaced_by!r}: retry later or "
                    f"{self._raise_limit()}")
            raise ClosedResourceError(f"{self.name}: the device actor closed while queued")
        return request.started

    def _full(self) -> str:
        # What a full queue's error says: its entries, and the requests waiting where a
        # merged batch (one entry) makes them differ, as the device's ``queued`` counts
        # them (a batch that has not queued yet included: the refused request's own,
        # when it formed one).
        entries = len(self._policy)
        requests = entries if self.waiting is None else self.waiting()
        if requests == entries:
            return f"the request queue is full ({entries} waiting)"
        return (f"the request queue is full ({entries} of {self.queue_limit} entries, "
                f"{requests} requests waiting: a merged batch is one entry)")

    def _raise_limit(self) -> str:
        # The way out a full queue's error names: the pool's setting, and its value.
        where = self.pool or "the pool's"
        return f"raise {where} queue_limit (now {self.queue_limit})"

    @contextlib.contextmanager
    def idle(self, scope: trio.CancelScope) -> Iterator[None]:
        """While a held slot idles in ``scope`` (in trio: a batch waiting for company),
        cancel ``scope`` as soon as a request queues for a slot, at once if one waits
        already: the device has other work, which an idle slot must not keep waiting.
        One request ends one idle slot's wait, the longest idle's: the others keep
        waiting for their company."""
        if len(self._policy):
            scope.cancel()
            yield
            return
        self._idle[scope] = None
        try:
            yield
        finally:
            self._idle.pop(scope, None)

    def _enqueue(self, request: Request) -> None:
        # (Under the lock, in trio.) The device now has work for a slot kept idle: the
        # longest idle one's wait ends (the cancel only marks the scope; the idler wakes
        # when trio runs it), and it no longer counts as idle.
        request.queued = True
        self._policy.push(request)
        if self._idle:
            scope = next(iter(self._idle))
            del self._idle[scope]
            scope.cancel()

    def withdraw(self, request: Request, why: str, /) -> bool:
        """Take ``request`` out of the queue unrun if it still waits there (in trio): its
        waiter wakes at once and raises RequestWithdrawn saying ``why`` (see
        :func:`withdrawal`). False, changing nothing, once it has left the queue (granted
        a slot: it runs; or refused)."""
        with self._lock:
            if request.removed:  # granted, refused or withdrawn already
                return False
            self._policy.remove(request)
            request.withdrawn = withdrawal(why, "in the device's queue")
            request.handoff = None  # (and the inputs its job holds)
        request.event.set()
        return True

    def requeue(self, request: Request, priority: int, deadline: float) -> None:
        """New terms for ``request`` (in trio): it moves in the queue if it waits there,
        and queues with them if it has not reached the queue yet."""
        with self._lock:
            if request.queued:
                self._policy.requeue(request, priority, deadline)
            else:
                request.priority, request.deadline = priority, deadline

    def free(self) -> None:
        """Give a slot back (in trio) and grant it to the next queued request."""
        with self._lock:
            self._running -= 1
            self.released += 1
        self.grant()

    def grant(self) -> None:
        """Grant free slots to queued requests, in the policy's order (in trio); one past
        its ``expires`` leaves the queue ungranted (its waiter times out)."""
        while not self._closed:
            with self._lock:
                if self._running >= self.workers:
                    return
                request = self._policy.pop()
                if request is None:
                    return
                if self._expired(request):
                    continue
                self._running += 1
            request.granted = True
            request.event.set()

    def close(self) -> None:
        """Refuse new requests; queued ones raise ClosedResourceError (in trio)."""
        with self._lock:
            self._closed = True
            waiting = []
            while (request := self._policy.pop()) is not None:
                waiting.append(request)
        for request in waiting:
            request.event.set()  # not granted: the waiter raises ClosedResourceError

    # -- from any thread --------------------------------------------------------------------
    def refuse(self) -> None:
        """Grant nothing more, from now on (any thread): no slot is taken, passed on or
        granted; queued requests wait until :meth:`close` (in trio) tells them."""
        with self._lock:
            self._closed = True

    def would_take(self) -> bool:
        """Whether :meth:`try_take` would succeed now (read without the lock: a hint that
        another thread may make stale at once)."""
        return not self._closed and self._running < self.workers and not len(self._policy)

    def try_take(self) -> bool:
        """Hold a slot if one is free and nobody is queued (any thread; never waits)."""
        with self._lock:
            if self._closed or self._token is None or self._running >= self.workers \
                    or len(self._policy):
                return False
            self._running += 1
            return True

    def try_take_idle(self) -> bool:
        """Hold a slot if none is held and nobody is queued (any thread; never waits)."""
        with self._lock:
            if self._closed or self._token is None or self._running or len(self._policy):
                return False
            self._running += 1
            return True

    @property
    def charges(self) -> bool:
        """Whether the policy wants runs' device time (:meth:`charge`)."""
        return self._policy.charges

    def charge(self, tenant: str, seconds: float) -> None:
        """A run for ``tenant`` took ``seconds`` of device time (any thread)."""
        with self._lock:
            self._policy.charge(tenant, seconds)

    def set_weight(self, tenant: str, weight: float) -> None:
        """``tenant``'s share of device time, for a policy that shares it (any thread)."""
        with self._lock:
            self._policy.set_weight(tenant, weight)

    def pass_on(self, tenant: str | None = None, seconds: float = 0.0) -> Request | None:
        """In a worker thread whose job, holding a slot, has just ended: grant that slot
        to the next queued request (the policy's choice), or return None when nobody is
        queued (then the slot is freed in trio as usual). The request is marked granted,
        and ``started`` when it came with a job, which the calling thread must then run.
        Trio tells the request (:meth:`granted_on`) once it has taken the ended job's
        result. ``tenant`` (None: not charged) is charged the job's ``seconds`` first,
        under the same lock, so the choice counts the run that just ended. A request
        past its ``expires`` is taken out of the queue, neither granted nor started: its
        waiter's cancel scope, due already, times it out as if trio had dropped it (a
        busy event loop would otherwise let this thread run requests that all timed
        out)."""
        with self._lock:
            if tenant is not None:
                self._policy.charge(tenant, seconds)
            if self._closed or not len(self._policy):
                return None
            while True:
                request = self._policy.pop()
                if request is None:
                    return None
                # (_expired inlined: this is every hand-off's path.)
                expires = request.expires
                if expires == math.inf or expires > self._now():
                    break
                request.handoff = None
            self.released += 1
            request.granted = True
            request.started = request.handoff is not None
            return request

    def _expired(self, request: Request) -> bool:
        # (Under the lock, ``request`` just popped.) Whether its deadline has passed on
        # trio's clock, as trio itself decides (``deadline <= now``): then it lets go of
        # its job (and the inputs it holds) now; its waiter wakes when its scope fires.
        # One comparison for a request without one.
        if request.expires == math.inf or request.expires > self._now():
            return False
        request.handoff = None
        return True

    @staticmethod
    def granted_on(request: Request) -> None:
        """Tell ``request`` (in trio) that a worker thread granted it a slot (pass_on)."""
        request.event.set()

    def free_from_thread(self, tenant: str | None = None, seconds: float = 0.0) -> None:
        """Give a slot back from any thread; trio is woken only to grant it to a queued
        request. ``tenant`` (None: not charged) is charged the ``seconds`` it held the
        slot first, under the same lock (a lease's run: see :meth:`charge`)."""
        with self._lock:
            if tenant is not None:
                self._policy.charge(tenant, seconds)
            self._running -= 1
            self.released += 1
            wake = bool(len(self._policy)) and not self._closed
        if wake and self._token is not None:
            with contextlib.suppress(trio.RunFinishedError):  # trio gone: nobody to grant
                self._token.run_sync_soon(self.grant)
