"""``LeaseDesk``: the leases one device actor has lent, from its slot to its give-back.

The actor grants a lease its worker slot (:meth:`DeviceActor.lease
<wasinn.actors.device.DeviceActor.lease>` through trio, :meth:`DeviceActor.try_lease
<wasinn.actors.device.DeviceActor.try_lease>` from any thread); the desk makes the
:class:`~wasinn.actors.lease.Lease` on it and keeps track of it until it is over:

* every run in progress, so that closing the actor cancels them (:meth:`LeaseDesk.close`:
  their holders get ClosedResourceError, or the device's DeviceLostError if it was lost);
* the deadlines of the leases that have one, in a heap watched by one task while the
  actor serves (:meth:`LeaseDesk.watch_deadlines`): a run still going when its deadline
  passes is stopped (:meth:`Lease.interrupt <wasinn.actors.lease.Lease.interrupt>`);
* the give-back, from the holder's thread: the slot is freed (trio is woken only when a
  queued request gets it) and the request is counted by how it ended (and as run in the
  caller's thread if its run started there).

:meth:`LeaseDesk.lend`, :meth:`LeaseDesk.soon`, :meth:`LeaseDesk.close` and the
give-back may be called from any thread; the rest in trio.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import itertools
import math
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import trio

from wasinn.backends.base import Cancellation
from wasinn.errors import DeviceLostError, TimeoutError_

from .jobs import Wrap
from .lease import Lease
from .slots import requested
from .stats import Account, Outcome

T = TypeVar("T")

#: Deadline heap size from which finished leases are dropped when they are most of it.
_COMPACT_AT = 64


class Record(Protocol):
    """Counts one request (in the device's stats and ``account``) by how it ended."""

    def __call__(self, account: Account | None, outcome: Outcome, seconds: float, *,
                 queued: float = ..., leased: bool = ...) -> None: ...


class LeaseDesk:
    """The leases lent on ``device`` (see the module docstring).

    ``take_slot(priority, deadline, tenant, label)`` waits in trio for one of the device's
    slots (``label`` names the request's run in its errors);
    ``free_slot(tenant, seconds)`` gives one back from any thread, charging ``tenant``
    (unless None) the seconds it held it; ``record`` counts a request; ``lost``
    says why the device can run nothing more, if it was lost (see :class:`Lease`).
    """

    def __init__(self, device: str,
                 take_slot: Callable[[int, float, str, str], Awaitable[None]],
                 free_slot: Callable[[str | None, float], None], record: Record,
                 lost: Callable[[], DeviceLostError | None] | None = None) -> None:
        self.device = device
        self._lost = lost
        self._take_slot = take_slot
        self._free_slot = free_slot
        self._record = record
        #: The device context's wrapper, once it is open (see :meth:`open`).
        self._wrap: Wrap | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._lock = threading.Lock()
        self._running: set[Cancellation] = set()  # runs of leases in progress
        self._closed = False
        # Leases with a deadline, as a heap of (deadline in trio time, tie-break, lease):
        # one task stops those still running when theirs passes (see watch_deadlines).
        self._deadlines: list[tuple[float, int, Lease[Any]]] = []
        self._deadline_ids = itertools.count()
        self._earlier_deadline: trio.Event | None = None  # set: the heap's head changed

    def open(self, wrap: Wrap | None) -> None:
        """The device is open (``wrap``: its context's wrapper, if any): bind to the
        current trio run, which the leases' threads reach through its token."""
        self._wrap = wrap
        self._token = trio.lowlevel.current_trio_token()

    def close(self) -> None:
        """Cancel every lease's run in progress (its holder gets ClosedResourceError, or
        the device's DeviceLostError if it was lost); a lease lent from now on is cancelled
        at once. From any thread; idempotent."""
        with self._lock:
            self._closed = True
            leases = list(self._running)
        for cancellation in leases:
            cancellation.cancel()

    @property
    def watched(self) -> int:
        """Leases whose deadline is being watched, finished ones not yet dropped included:
        fewer than 64, or about twice the running ones once there are more."""
        return len(self._deadlines)

    async def take_slot(self, priority: int, deadline: float, tenant: str, label: str = ""
                        ) -> float:
        """A slot for a lease; returns when its run expires (perf_counter; inf: never).

        Raises what taking a slot raises, and TimeoutError_ when ``deadline`` (trio time)
        passes while the request is queued (it leaves the queue); ``label`` names the
        request's run (a model's) in these errors."""
        if deadline == math.inf:
            await self._take_slot(priority, deadline, tenant, label)
            return math.inf
        with trio.move_on_at(deadline) as scope:
            await self._take_slot(priority, deadline, tenant, label)
        if scope.cancelled_caught:
            raise TimeoutError_(f"{requested(label, self.device)}: the request's deadline "
                                "passed before it started")
        return time.perf_counter() + (deadline - trio.current_time())

    def lend(self, job: Callable[[], T], expires: float, start: float, granted: float,
             account: Account | None, tenant: str | None = None, *,
             caller: str | None = None, label: str = "") -> Lease[T]:
        """A lease on a slot already taken, for ``job`` (from any thread). Its run is
        cancelled if the actor closes meanwhile (see :meth:`close`). ``start`` and
        ``granted``: when the request reached the actor and when it got its slot
        (perf_counter), for its latency; ``account``: where it is counted too;
        ``tenant``: whom the time it holds the slot is charged to (None: nobody; a fair
        queue policy's device time); ``caller``: whom the run is for, as its backend sees
        it (the request's tenant: :func:`~wasinn.backends.base.current_caller` in the
        holder's thread while the lease runs); ``label``: its run's (see :class:`Lease`)."""
        cancellation = Cancellation(caller)
        with self._lock:
            self._running.add(cancellation)
            closed = self._closed
        if closed:  # closed between the slot and now: the run fails at once
            cancellation.cancel()
        return Lease(self.device, job, self._wrap,
                     functools.partial(self._given_back, cancellation, account, start,
                                       granted, tenant),
                     expires,
                     cancellation,
                     self.soon,
                     self._lost,
                     label)

    def _given_back(self, cancellation: Cancellation, account: Account | None,
                    start: float, granted: float, tenant: str | None,
                    outcome: Outcome, ran: bool) -> None:
        # From the lease holder's thread: forget the run, give its slot back (charging
        # its tenant the time it held it), count it (in the caller's thread if it ran).
        with self._lock:
            self._running.discard(cancellation)
        now = time.perf_counter()
        self._free_slot(tenant, now - granted)
        self._record(account, outcome, now - start, queued=granted - start, leased=ran)

    def soon(self, call: Callable[..., object], *args: object) -> None:
        """From any thread, even inside a collection: ``call(*args)`` in trio (trio's
        entry queue takes a reentrant lock); dropped if trio has ended (nothing is left
        to watch or free: nobody closes the actor any more)."""
        token = self._token
        if token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(call, *args)

    def watch(self, lease: Lease[Any], deadline: float | None) -> None:
        """In trio: have :meth:`watch_deadlines` stop the lease's run when its deadline
        (trio time; None: from its perf_counter expiry) passes first. A no-op while no
        watcher runs, and for a lease already over."""
        wake = self._earlier_deadline
        if wake is None or lease.over:
            return
        if deadline is None:
            deadline = trio.current_time() + (lease.expires - time.perf_counter())
        heap = self._deadlines
        if len(heap) >= _COMPACT_AT and 2 * sum(not e[2].over for e in heap) < len(heap):
            # Mostly finished leases waiting for their deadline: drop them.
            heap[:] = [entry for entry in heap if not entry[2].over]
            heapq.heapify(heap)
        heapq.heappush(heap, (deadline, next(self._deadline_ids), lease))
        if heap[0][2] is lease:
            wake.set()

    async def watch_deadlines(self, started: Callable[[], object]) -> None:
        """Run while the actor serves (until cancelled): sleep until the earliest deadline
        (or until an earlier one is added), then stop every lease whose deadline has
        passed. Calls ``started()`` once leases are watched."""
        heap = self._deadlines
        self._earlier_deadline = trio.Event()
        started()
        while True:
            with trio.move_on_at(heap[0][0] if heap else math.inf):
                await self._earlier_deadline.wait()
            self._earlier_deadline = trio.Event()
            now = trio.current_time()
            while heap and heap[0][0] <= now:
                heapq.heappop(heap)[2].interrupt(deadline=True)  # a no-op once over

    def stop_watching(self) -> None:
        """The actor stopped serving: watch no more deadlines, and let go of the leases
        watched."""
        self._earlier_deadline = None
        self._deadlines.clear()
