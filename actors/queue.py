"""A device actor's request queue and the policy that picks the next request.

A :class:`Request` is what waits for a worker slot on a device: it carries the fields
every scheduling policy needs (``priority``, ``deadline``, ``tenant``, arrival order
``seq``), so policies can change without touching the actor or the callers.

:class:`PriorityDeadlinePolicy` (the default) serves the highest priority first, then the
earliest deadline, then the oldest request. Policies are objects behind the small
:class:`QueuePolicy` protocol, so the next steps slot in without a rewrite:

* per-tenant fairness in device time: :class:`FairSharePolicy` (a pool's ``policy =
  "fair"``) keeps one priority/deadline sub-queue per ``tenant`` and serves next the
  waiting tenant that has had the least device time for its weight (weighted start-time
  fair queuing; the weights are the config's ``[tenants.NAME] weight``). That needed one
  addition, ``charge``: where a run ends (in its worker thread, before the slot is
  passed on; in trio for an inline run) its device seconds are charged to its request's
  tenant, under the same lock as ``push`` and ``pop``. Policies that do not use it say
  so (``charges = False``): runs are then not even timed for it;
* dynamic batching (:mod:`wasinn.actors.batching`) needed one addition, ``requeue``: a
  batch waits in the queue as one request with its members' highest priority and
  earliest deadline, which change when a member leaves;
* load shedding: ``queue_limit`` refuses work past a bound (TooLargeError); a policy
  may instead let the newcomer take a waiting request's place (``displace``: a fair
  policy does, so that one tenant cannot fill the queue and lock the others out).

A policy is not thread-safe by itself: its owner (:class:`~wasinn.actors.slots.Slots`)
calls every method under one lock, worker threads (``pass_on``, ``charge``) and trio
alike.
"""

from __future__ import annotations

import heapq
import itertools
import math
import numbers
import operator
from collections.abc import Mapping
from typing import Protocol

import trio

from wasinn._utf8 import utf8_text
from wasinn.errors import InvalidArgumentError


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
    one did, and the slot is then the job's. ``withdrawn`` says why its owner took it
    out of the queue unrun (see :meth:`Slots.withdraw <wasinn.actors.slots.Slots.withdraw>`).

    ``expires`` (trio time; ``math.inf``: never) is when the request may no longer be
    granted a slot: its ``deadline`` where its waiter's own cancel scope ends the wait
    then (set by :meth:`Slots.take <wasinn.actors.slots.Slots.take>` for the requests it
    makes), so that a slot freed past it, by trio or by a worker thread, goes to the next
    request and the waiter times out as any. A batch's entry never expires: its deadline
    is its earliest member's, which moves when that member leaves.
    """

    __slots__ = ("deadline", "displaced_by", "event", "expires", "granted", "handoff", "key",
                 "priority", "queued", "removed", "seq", "started", "tenant", "withdrawn")

    _counter = itertools.count()

    def __init__(self, priority: int = 0, deadline: float = math.inf, tenant: str = "") -> None:
        self.priority = priority if type(priority) is int else operator.index(priority)
        self.deadline = deadline
        self.expires = math.inf
        self.tenant = tenant
        self.seq = next(Request._counter)
        self.event = trio.Event()
        self.granted = False
        self.queued = False
        self.removed = False
        self.key: tuple[int, float, int] | None = None
        self.handoff: Handoff | None = None
        self.started = False
        #: Set when a full queue pushed it out for another tenant's request (see
        #: :meth:`QueuePolicy.displace`): the tenant whose request took its place.
        self.displaced_by: str | None = None
        #: Set when its owner withdrew it from the queue (an execution context that
        #: closed): why, as its waiter's ClosedResourceError says.
        self.withdrawn: str | None = None

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

    #: Whether :meth:`charge` does anything (else callers need not time runs for it).
    charges: bool

    def push(self, request: Request) -> None:
        """Add a waiting request."""

    def pop(self) -> Request | None:
        """Remove and return the request to serve next, or None when empty."""

    def remove(self, request: Request) -> None:
        """Forget a request that gave up waiting (cancelled or past its deadline)."""

    def requeue(self, request: Request, priority: int, deadline: float) -> None:
        """Give a waiting request a new priority and deadline (it keeps its arrival
        order among requests of equal terms)."""

    def charge(self, tenant: str, seconds: float) -> None:
        """A run of a request of ``tenant`` (granted earlier) took ``seconds`` of device
        time."""

    def set_weight(self, tenant: str, weight: float) -> None:
        """From now on, ``tenant``'s share of device time is ``weight`` (checked by the
        caller: see :func:`check_weight`)."""

    def displace(self, tenant: str) -> Request | None:
        """The queue is full and a request of ``tenant`` comes: remove and return the
        waiting request it may take the place of, or None to refuse it."""

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

    charges = False

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

    def charge(self, tenant: str, seconds: float) -> None:
        """Device time does not matter here."""

    def set_weight(self, tenant: str, weight: float) -> None:
        """Nor do weights."""

    def displace(self, tenant: str) -> Request | None:
        """A full queue refuses what comes: first come, first queued."""
        return None

    def last(self) -> Request | None:
        """The waiting request that would be served last (None when empty): O(n)."""
        live = [entry for entry in self._heap
                if not entry[1].removed and entry[0] is entry[1].key]
        return max(live, key=lambda entry: entry[0])[1] if live else None

    def _compact(self) -> None:
        if len(self._heap) > 2 * self._live + 64:
            self._heap = [entry for entry in self._heap
                          if not entry[1].removed and entry[0] is entry[1].key]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return self._live


class WeightError(InvalidArgumentError, ValueError):
    """A tenant's weight that is not a finite number > 0: invalid-argument, and a
    ValueError for callers that caught that before."""


class TenantNameError(InvalidArgumentError, TypeError):
    """A tenant named by something other than a str: invalid-argument, and a TypeError
    for callers that caught that before."""


def check_weight(weight: object) -> float:
    """``weight`` as a tenant's weight in a :class:`FairSharePolicy`: a finite real
    number > 0 (:class:`WeightError`, a ValueError, otherwise, naming what was expected;
    a bool is no weight)."""
    try:
        value = (float(weight) if isinstance(weight, numbers.Real)
                 and not isinstance(weight, bool) else math.nan)
    except OverflowError:  # an int past the floats
        value = math.inf
    if not (math.isfinite(value) and value > 0):
        raise WeightError(f"{weight!r:.60}: expected a finite number > 0 (a share of device "
                          "time: weight 2 gets twice the device time of weight 1)")
    return value


def check_tenant_weight(tenant: object, weight: object, where: str = "") -> float:
    """``weight`` checked as :func:`check_weight` does, as ``tenant``'s (WeightError
    naming the tenant), and ``tenant`` as a tenant's name (:class:`TenantNameError`, a
    TypeError, unless a str; InvalidArgumentError unless valid UTF-8, as a request's
    tenant must be; ``where`` says where it was given)."""
    if not isinstance(tenant, str):
        raise TenantNameError(f"tenant {tenant!r:.60} ({type(tenant).__name__}){where}: "
                              "expected a str naming a tenant")
    utf8_text(f"tenant{where}", tenant)
    try:
        return check_weight(weight)
    except WeightError as exc:
        raise WeightError(f"the weight of tenant {tenant!r:.60}: {exc}") from None


class _Tenant:
    """One tenant of a :class:`FairSharePolicy`: its requests, its virtual time (device
    seconds charged divided by its weight, from where it joined), and its place among
    tenants of equal time."""

    __slots__ = ("in_heap", "order", "queue", "vtime", "weight")

    def __init__(self, vtime: float, order: int, weight: float) -> None:
        self.queue = PriorityDeadlinePolicy()
        self.vtime = vtime
        self.order = order
        self.weight = weight
        self.in_heap = False  # whether an entry of it is in the policy's heap


class FairSharePolicy:
    """Device time shared among the tenants with waiting requests in proportion to their
    weights (a pool's ``"fair"``); within a tenant, priority then deadline then arrival.

    ``weights`` maps tenant names to weights (``""``: the requests that name no tenant);
    a tenant not in it has ``default_weight``. Each weight must be a finite number > 0
    (ValueError otherwise, naming the tenant; TypeError for a tenant name that is not a
    str). With equal weights (the default) every waiting tenant gets the same device
    time; a tenant of weight 2 gets twice the device time of one of weight 1 while both
    wait.

    Weighted start-time fair queuing over tenants: each tenant has a virtual time,
    advanced by the device seconds its runs took divided by its weight (:meth:`charge`,
    called where a run ends, before the slot is passed on), and the next request comes
    from the waiting tenant with the least virtual time (among equal ones, the one served
    longest ago). Two tenants of equal weight, one whose requests cost 100 ms and one
    whose requests cost 1 ms, thus get about the same device time while both wait, not
    the same number of runs; tenants of equal cost and weight alternate. Runs in flight
    are charged when they end, so with ``workers`` > 1 the shares are exact only to
    within a run per worker.

    No banked credit: a tenant that becomes backlogged again (or a new one) starts at
    the least virtual time among the waiting tenants (at the virtual time of the latest
    request served, when none waits), unless its own is higher (a tenant charged more
    than the others keeps that debt). So a tenant that was idle gets its share from
    then on, not the time it did not use, and a new tenant is served soon without
    starving the others. A weight sets a share from then on, not a credit: a new tenant
    of weight 10 gets ten times the device time of the others as of its first request,
    not a burst for the time before it.

    A tenant with no waiting request is kept (its run may still be charged) until the
    idle tenants outnumber the waiting ones plus 64: then they are forgotten, but for
    those that may still owe device time (a run not yet charged, or a debt: a virtual
    time at or past that of the latest request served), the latest served first, up to
    half that bound: a stream of one-off tenant names cannot grow the policy. (Past that
    bound a tenant's debt may be forgotten: the price of bounded memory.) A request that
    gives up leaves its tenant's sub-queue (lazy deletion, as in
    :class:`PriorityDeadlinePolicy`). ``requeue`` (batches) moves a request within its
    tenant's sub-queue; a batch holds one tenant's requests only, and its run is charged
    to that tenant.
    """

    charges = True

    def __init__(self, weights: Mapping[str, float] | None = None,
                 default_weight: float = 1.0) -> None:
        self._weights = {tenant: check_tenant_weight(tenant, weight, " in weights")
                         for tenant, weight in (weights or {}).items()}
        try:
            self._default_weight = check_weight(default_weight)
        except WeightError as exc:
            raise WeightError(f"default_weight: {exc}") from None
        self._tenants: dict[str, _Tenant] = {}
        #: Entries (virtual time, order, tenant), least first: at most one per tenant; a
        #: tenant's time may have grown since its entry was made (charged while waiting:
        #: re-keyed when it comes to the top), and one with no waiting request left is
        #: dropped when it comes to the top.
        self._heap: list[tuple[float, int, _Tenant]] = []
        self._orders = itertools.count()
        self._clock = 0.0  # the virtual time of the latest request served
        self._backlogged = 0  # tenants with a waiting request
        self._idle = 0  # kept tenants with none
        self._live = 0

    def push(self, request: Request) -> None:
        state = self._tenants.get(request.tenant)
        if state is None:
            state = self._tenants[request.tenant] = _Tenant(
                self._floor(), next(self._orders), self.weight(request.tenant))
            self._idle += 1
        if not len(state.queue):  # becomes backlogged: no credit for its idle time
            floor = self._floor()  # (before it counts among the waiting)
            state.vtime = max(state.vtime, floor)
            if not state.in_heap:
                state.in_heap = True
                heapq.heappush(self._heap, (state.vtime, state.order, state))
            self._idle -= 1
            self._backlogged += 1
        state.queue.push(request)
        self._live += 1

    def pop(self) -> Request | None:
        state = self._top()
        if state is None:
            return None
        request = state.queue.pop()
        assert request is not None  # (a tenant at the top has a waiting request)
        self._live -= 1
        self._clock = max(self._clock, state.vtime)
        state.order = order = next(self._orders)  # behind the tenants of equal time
        if len(state.queue):
            heapq.heapreplace(self._heap, (state.vtime, order, state))
        else:
            heapq.heappop(self._heap)
            state.in_heap = False
            self._became_idle()
        return request

    def weight(self, tenant: str) -> float:
        """``tenant``'s weight (its share of device time relative to other tenants')."""
        return self._weights.get(tenant, self._default_weight)

    def charge(self, tenant: str, seconds: float) -> None:
        """``tenant``'s run took ``seconds`` of device time: its virtual time advances by
        ``seconds`` divided by its weight. A tenant not known here (one whose runs all
        found a slot free, so never queued; or one forgotten since) is charged as a
        known idle one is, from where a newcomer starts. Only time taken while others
        wait is a debt: a run charged while no tenant waits moves the virtual clock with
        it, so that device time nobody else wanted is never held against a tenant."""
        state = self._tenants.get(tenant)
        if state is None:
            state = self._tenants[tenant] = _Tenant(
                self._floor(), next(self._orders), self.weight(tenant))
            self._backlogged += 1  # (counted as it would have been, waiting...)
            self._became_idle()  # (...then idle, which may forget idle ones)
            if tenant not in self._tenants:  # forgotten at once: nothing to charge
                return
        state.vtime += seconds / state.weight
        if not self._backlogged:
            # Nobody waits: this run took time nobody else wanted. The virtual clock
            # follows it, so that it is no debt (what a tenant arriving now starts at).
            self._clock = max(self._clock, state.vtime)

    def set_weight(self, tenant: str, weight: float) -> None:
        """``tenant``'s weight is ``weight`` from now on (ValueError unless a finite number
        > 0): the device time it takes from now is divided by it, the virtual time it
        has so far stays (a share from now on, not one made up for the past)."""
        value = check_weight(weight)
        self._weights[tenant] = value
        state = self._tenants.get(tenant)
        if state is not None:
            state.weight = value

    def displace(self, tenant: str) -> Request | None:
        """Where the full queue holds more requests of another tenant than of ``tenant``
        plus one, the request that tenant would have served last leaves for the new one
        (no tenant can lock the others out by filling the queue); among tenants with
        equally many waiting, the one with the most device time for its weight gives
        way. None otherwise (the new request is refused): a tenant never pushes out its
        own requests. O(tenants + that tenant's requests), on a full queue only."""
        state = self._tenants.get(tenant)
        mine = len(state.queue) if state is not None else 0
        longest = max((other for other in self._tenants.values() if len(other.queue)),
                      key=lambda other: (len(other.queue), other.vtime), default=None)
        if longest is None or len(longest.queue) <= mine + 1:
            return None
        victim = longest.queue.last()
        assert victim is not None  # (it has requests waiting)
        self.remove(victim)
        return victim

    def remove(self, request: Request) -> None:
        state = self._tenants.get(request.tenant)
        if state is not None and not request.removed:
            state.queue.remove(request)
            self._live -= 1
            if not len(state.queue):  # its heap entry is dropped when it is at the top
                self._became_idle()

    def requeue(self, request: Request, priority: int, deadline: float) -> None:
        state = self._tenants.get(request.tenant)
        if state is not None:
            state.queue.requeue(request, priority, deadline)

    def _top(self) -> _Tenant | None:
        # The backlogged tenant with the least virtual time (its entry at the top).
        heap = self._heap
        while heap:
            vtime, order, state = heap[0]
            if not len(state.queue):  # nothing waits for it any more
                heapq.heappop(heap)
                state.in_heap = False
            elif vtime != state.vtime:  # charged since: times only grow
                heapq.heapreplace(heap, (state.vtime, order, state))
            else:
                return state
        return None

    def _floor(self) -> float:
        # Where a tenant that starts waiting starts: the least waiting virtual time.
        top = self._top()
        if top is None or top.vtime < self._clock:
            return self._clock
        return top.vtime

    def _became_idle(self) -> None:
        self._backlogged -= 1
        self._idle += 1
        if self._idle > self._backlogged + 64:
            self._sweep()

    def _sweep(self) -> None:
        # Forget idle tenants, but those that may still owe device time: served at or
        # after the latest request's virtual time (a run in flight, not yet charged) or
        # charged past it (a debt), at most half the bound, the latest served first, so
        # that the next sweep is as far away (amortised O(1) per request).
        clock = self._clock
        idle = [(name, state) for name, state in self._tenants.items()
                if not len(state.queue)]
        owing = [(state.order, name) for name, state in idle if state.vtime >= clock]
        keep = {name for _, name in heapq.nlargest((self._backlogged + 64) // 2, owing)}
        for name, _ in idle:
            if name not in keep:
                del self._tenants[name]
        self._idle = len(keep)
        # Drop the entries of tenants with nothing waiting (forgotten ones included).
        for entry in self._heap:
            if not len(entry[2].queue):
                entry[2].in_heap = False
        self._heap = [entry for entry in self._heap if entry[2].in_heap]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return self._live


#: The former name of :class:`FairSharePolicy` (which served tenants in turn, one
#: request each, whatever their requests cost).
TenantRoundRobinPolicy = FairSharePolicy


POLICIES: dict[str, type[PriorityDeadlinePolicy] | type[FairSharePolicy]] = {
    "priority": PriorityDeadlinePolicy,
    "fair": FairSharePolicy,
}


def policy_for(name: str, weights: Mapping[str, float] | None = None) -> QueuePolicy:
    """A new policy of the kind a pool's ``policy = name`` names (KeyError for a name
    not in :data:`POLICIES`); ``weights`` (tenant -> weight) are a fair policy's shares,
    and mean nothing to the others."""
    kind = POLICIES[name]
    if issubclass(kind, FairSharePolicy):
        return kind(weights)
    return kind()
