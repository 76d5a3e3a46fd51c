"""A device actor's request queue and the policy that picks the next request.

A :class:`Request` is what waits for a worker slot on a device: it carries the fields
every scheduling policy needs (``priority``, ``deadline``, ``tenant``, arrival order
``seq``), so policies can change without touching the actor or the callers.

:class:`PriorityDeadlinePolicy` (the default) serves the highest priority first, then the
earliest deadline, then the oldest request. Policies are objects behind the small
:class:`QueuePolicy` protocol, so the next steps slot in without a rewrite:

* per-tenant fairness: :class:`TenantRoundRobinPolicy` keeps one priority/deadline
  sub-queue per ``tenant`` and serves the tenants in turn (a pool's ``policy = "fair"``);
  weighted shares (deficit counters) fit behind the same ``push``/``pop``/``remove``;
* dynamic batching (:mod:`wasinn.actors.batching`) needed one addition, ``requeue``: a
  batch waits in the queue as one request with its members' highest priority and
  earliest deadline, which change when a member leaves;
* load shedding: ``queue_limit`` already refuses work past a bound (TooLargeError).
"""

from __future__ import annotations

import heapq
import itertools
import math
import operator
from collections import deque
from typing import Protocol

import trio


class Request:
    """One caller waiting for a worker slot on a device actor.

    ``deadline`` is in ``trio.current_time()`` units (``math.inf`` = none); ``priority``
    any integer (a numpy one is converted: ``-priority`` of an unsigned one would wrap
    around). ``queued`` is set (by :class:`~wasinn.actors.slots.Slots`) when it enters a
    queue, ``granted`` when it leaves the queue with a slot reserved for it, ``removed``
    once it is no longer queued (popped or removed), so that removing it again does
    nothing. ``key`` is its place in a queue (:meth:`sort_key` as of its last push).

    ``handoff``: the job the request will run once granted, prepared before it queued,
    so that the worker thread that frees a slot can start it at once (see
    :meth:`Slots.pass_on <wasinn.actors.slots.Slots.pass_on>`); ``started`` is set when
    one did, and the slot is then the job's.
    """

    __slots__ = ("deadline", "event", "granted", "handoff", "key", "priority", "queued",
                 "removed", "seq", "started", "tenant")

    _counter = itertools.count()

    def __init__(self, priority: int = 0, deadline: float = math.inf, tenant: str = "") -> None:
        self.priority = priority if type(priority) is int else operator.index(priority)
        self.deadline = deadline
        self.tenant = tenant
        self.seq = next(Request._counter)
        self.event = trio.Event()
        self.granted = False
        self.queued = False
        self.removed = False
        self.key: tuple[int, float, int] | None = None
        self.handoff: Handoff | None = None
        self.started = False

    def sort_key(self) -> tuple[int, float, int]:
        """Higher priority first, then earlier deadline, then arrival order."""
        return (-self.priority, self.deadline, self.seq)


class Handoff(Protocol):
    """A prepared job that a worker thread may start for a queued request."""

    def abandon(self) -> None:
        """Its caller gave up (in trio) after a worker thread had started it: cancel the
        run and let the job free its slot once it is over."""


class QueuePolicy(Protocol):
    """Chooses which queued request gets the next free worker slot."""

    def push(self, request: Request) -> None:
        """Add a waiting request."""

    def pop(self) -> Request | None:
        """Remove and return the request to serve next, or None when empty."""

    def remove(self, request: Request) -> None:
        """Forget a request that gave up waiting (cancelled or past its deadline)."""

    def requeue(self, request: Request, priority: int, deadline: float) -> None:
        """Give a waiting request a new priority and deadline (it keeps its arrival
        order among requests of equal terms)."""

    def __len__(self) -> int:
        """How many requests are waiting."""


class PriorityDeadlinePolicy:
    """Highest ``priority`` first, then earliest ``deadline``, then first come.

    A binary heap with lazy deletion: ``remove`` marks the request and ``pop`` skips it,
    so cancelling a queued request costs O(1); ``requeue`` pushes a new entry and leaves
    the old one stale (its key is no longer the request's). The heap is rebuilt without
    dead entries once they are most of it, so requests that gave up (timed out behind a
    long run) cannot grow it past twice the live ones.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, float, int], Request]] = []
        self._live = 0

    def push(self, request: Request) -> None:
        request.key = key = request.sort_key()
        heapq.heappush(self._heap, (key, request))
        self._live += 1

    def pop(self) -> Request | None:
        while self._heap:
            key, request = heapq.heappop(self._heap)
            if not request.removed and key is request.key:
                request.removed = True
                self._live -= 1
                return request
        return None

    def remove(self, request: Request) -> None:
        if not request.removed:
            request.removed = True
            self._live -= 1
            self._compact()

    def requeue(self, request: Request, priority: int, deadline: float) -> None:
        request.priority, request.deadline = priority, deadline
        if request.removed or request.key == request.sort_key():
            return
        request.key = key = request.sort_key()
        heapq.heappush(self._heap, (key, request))
        self._compact()

    def _compact(self) -> None:
        if len(self._heap) > 2 * self._live + 64:
            self._heap = [entry for entry in self._heap
                          if not entry[1].removed and entry[0] is entry[1].key]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return self._live


class TenantRoundRobinPolicy:
    """Tenants served in turn; within a tenant, priority then deadline then arrival.

    A tenant that floods the queue delays only its own requests: every other tenant with
    a waiting request is served once before the flooding tenant is served again.

    A tenant whose requests all gave up keeps its place in the round until the round
    reaches it, so one that submits again is not sent to the back. Such idle tenants are
    forgotten, all at once, when they outnumber the tenants with waiting requests (plus
    64): a stream of one-off tenant names cannot grow the policy.
    """

    def __init__(self) -> None:
        self._queues: dict[str, PriorityDeadlinePolicy] = {}
        #: Places in the round (tenant, ticket), next first; a place is live while the
        #: tenant's ticket in ``_ticket_of`` is the same.
        self._turns: deque[tuple[str, int]] = deque()
        self._ticket_of: dict[str, int] = {}
        self._tickets = itertools.count()
        self._idle = 0  # kept tenants with no waiting request
        self._live = 0

    def push(self, request: Request) -> None:
        tenant = request.tenant
        queue = self._queues.get(tenant)
        if queue is None:
            queue = self._queues[tenant] = PriorityDeadlinePolicy()
            ticket = self._ticket_of[tenant] = next(self._tickets)
            self._turns.append((tenant, ticket))
        elif not len(queue):
            self._idle -= 1
        queue.push(request)
        self._live += 1

    def pop(self) -> Request | None:
        while self._turns:
            tenant, ticket = self._turns.popleft()
            if self._ticket_of.get(tenant) != ticket:
                continue  # a place swept out with its idle tenant
            queue = self._queues[tenant]
            request = queue.pop()
            if request is not None and len(queue):
                self._turns.append((tenant, ticket))
            else:
                self._forget(tenant)
            if request is None:
                self._idle -= 1
                continue  # every request of this tenant gave up meanwhile
            self._live -= 1
            return request
        return None

    def remove(self, request: Request) -> None:
        queue = self._queues.get(request.tenant)
        if queue is not None and not request.removed:
            queue.remove(request)
            self._live -= 1
            if not len(queue):
                self._idle += 1
                if self._idle > len(self._queues) - self._idle + 64:
                    self._sweep()

    def requeue(self, request: Request, priority: int, deadline: float) -> None:
        queue = self._queues.get(request.tenant)
        if queue is not None:
            queue.requeue(request, priority, deadline)

    def _forget(self, tenant: str) -> None:
        del self._queues[tenant]
        del self._ticket_of[tenant]

    def _sweep(self) -> None:
        # Forget every idle tenant and drop the places that are no longer live.
        for tenant in [t for t, queue in self._queues.items() if not len(queue)]:
            self._forget(tenant)
        self._idle = 0
        self._turns = deque(place for place in self._turns
                            if self._ticket_of.get(place[0]) == place[1])

    def __len__(self) -> int:
        return self._live


POLICIES: dict[str, type[PriorityDeadlinePolicy] | type[TenantRoundRobinPolicy]] = {
    "priority": PriorityDeadlinePolicy,
    "fair": TenantRoundRobinPolicy,
}
