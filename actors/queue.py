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
* dynamic batching (:mod:`wasinn.actors.batching`) needed no change here: a batch waits
  in the queue as one request with its opener's priority, deadline and tenant, and
  compatible requests join it while it waits;
* load shedding: ``queue_limit`` already refuses work past a bound (TooLargeError).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from typing import Protocol

import trio


class Request:
    """One caller waiting for a worker slot on a device actor.

    ``deadline`` is in ``trio.current_time()`` units (``math.inf`` = none). ``granted`` is
    set (by :class:`~wasinn.actors.slots.Slots`) when the request leaves the queue with a
    slot reserved for it.
    """

    __slots__ = ("deadline", "event", "granted", "priority", "removed", "seq", "tenant")

    _counter = itertools.count()

    def __init__(self, priority: int = 0, deadline: float = math.inf, tenant: str = "") -> None:
        self.priority = priority
        self.deadline = deadline
        self.tenant = tenant
        self.seq = next(Request._counter)
        self.event = trio.Event()
        self.granted = False
        self.removed = False

    def sort_key(self) -> tuple[int, float, int]:
        """Higher priority first, then earlier deadline, then arrival order."""
        return (-self.priority, self.deadline, self.seq)


class QueuePolicy(Protocol):
    """Chooses which queued request gets the next free worker slot."""

    def push(self, request: Request) -> None:
        """Add a waiting request."""

    def pop(self) -> Request | None:
        """Remove and return the request to serve next, or None when empty."""

    def remove(self, request: Request) -> None:
        """Forget a request that gave up waiting (cancelled or past its deadline)."""

    def __len__(self) -> int:
        """How many requests are waiting."""


class PriorityDeadlinePolicy:
    """Highest ``priority`` first, then earliest ``deadline``, then first come.

    A binary heap with lazy deletion: ``remove`` marks the request and ``pop`` skips it,
    so cancelling a queued request costs O(1).
    """

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, float, int], Request]] = []
        self._live = 0

    def push(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.sort_key(), request))
        self._live += 1

    def pop(self) -> Request | None:
        while self._heap:
            _, request = heapq.heappop(self._heap)
            if not request.removed:
                self._live -= 1
                return request
        return None

    def remove(self, request: Request) -> None:
        if not request.removed:
            request.removed = True
            self._live -= 1

    def __len__(self) -> int:
        return self._live


class TenantRoundRobinPolicy:
    """Tenants served in turn; within a tenant, priority then deadline then arrival.

    A tenant that floods the queue delays only its own requests: every other tenant with
    a waiting request is served once before the flooding tenant is served again.
    """

    def __init__(self) -> None:
        self._queues: dict[str, PriorityDeadlinePolicy] = {}
        self._turns: deque[str] = deque()  # tenants with waiting requests, next first
        self._in_turns: set[str] = set()
        self._live = 0

    def push(self, request: Request) -> None:
        queue = self._queues.get(request.tenant)
        if queue is None:
            queue = self._queues[request.tenant] = PriorityDeadlinePolicy()
        if request.tenant not in self._in_turns:
            self._in_turns.add(request.tenant)
            self._turns.append(request.tenant)
        queue.push(request)
        self._live += 1

    def pop(self) -> Request | None:
        while self._turns:
            tenant = self._turns.popleft()
            queue = self._queues[tenant]
            request = queue.pop()
            if request is None or not len(queue):
                self._in_turns.discard(tenant)
            else:
                self._turns.append(tenant)
            if request is None:
                continue  # every request of this tenant was removed meanwhile
            self._live -= 1
            return request
        return None

    def remove(self, request: Request) -> None:
        queue = self._queues.get(request.tenant)
        if queue is not None and not request.removed:
            queue.remove(request)
            self._live -= 1

    def __len__(self) -> int:
        return self._live


POLICIES: dict[str, type[PriorityDeadlinePolicy] | type[TenantRoundRobinPolicy]] = {
    "priority": PriorityDeadlinePolicy,
    "fair": TenantRoundRobinPolicy,
}
