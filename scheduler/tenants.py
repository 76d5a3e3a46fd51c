"""Each tenant's requests and its weight: what :meth:`wasinn.Runtime.tenant_stats`
reports and :meth:`wasinn.Runtime.set_tenant_weight` changes.

A request names its tenant (``tenant=``; a guest's is its program's file name unless
its embedder names another; ``""`` when none is named). The scheduler counts each
request in its tenant's :class:`~wasinn.actors.stats.RequestStats` as well as in its
model's (a :class:`TenantAccount`), on every path: a worker thread,
inline, a lease holder's own thread, a merged batch (whose members share one tenant),
and a request that ends while its graph compiles. The devices' time a tenant took is its
completed requests' summed running time (``running_seconds``), whatever the pools'
policies; a ``fair`` pool also charges it to the tenant to share its device time.

Tenant names come from callers, so the ledger is bounded: once a new tenant takes it past
:data:`MAX_TENANTS`, it forgets the eighth of its tenants whose latest requests are the
oldest (their figures start again from zero if they come back), and counts how many it
forgot. A known tenant's request takes no lock here: it is a dict look-up and a stamp
(forgetting in eighths keeps a stream of new names at an amortised O(log n) each).
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Iterable, Mapping
from typing import Protocol

from wasinn.actors.queue import check_tenant_weight, check_weight
from wasinn.actors.stats import Account, Outcome, RequestStats, TenantStats

#: The most tenants whose figures are kept (the least recently active forgotten first).
MAX_TENANTS = 1024


class Weighted(Protocol):
    """What shares its time among tenants by weight: a device actor (whose queue policy
    ignores weights unless it is ``fair``)."""

    def set_tenant_weight(self, tenant: str, weight: float) -> None: ...


class TenantLedger:
    """The requests of each tenant, and the weights tenants have in ``fair`` pools
    (``weights``: the config's ``[tenants]``; ``default_weight``: a tenant's not there),
    which :meth:`set_weight` changes on every actor :meth:`attach` gave them to.
    Thread-safe: lease holders count their requests from their own threads."""

    def __init__(self, weights: Mapping[str, float] | None = None,
                 default_weight: float = 1.0, *, most: int = MAX_TENANTS) -> None:
        if most < 1:
            raise ValueError(f"most={most}: expected at least 1 tenant")
        self._lock = threading.Lock()
        self._weights = {tenant: check_weight(weight)
                         for tenant, weight in (weights or {}).items()}
        self._default_weight = check_weight(default_weight)
        self._most = most
        self._actors: list[Weighted] = []
        self._requests: dict[str, _Tenant] = {}
        self._stamps = itertools.count()  # (next() is atomic: no lock needed)
        #: Tenants forgotten to keep at most ``most`` (their figures with them).
        self.forgotten = 0

    def account(self, model: Account | None, tenant: str) -> TenantAccount:
        """Where a request of ``tenant`` is counted: in its tenant's requests, and in
        ``model`` too (its model's or pipeline's) unless None."""
        return TenantAccount(self, model, tenant)

    def requests(self, tenant: str) -> RequestStats:
        """``tenant``'s requests, stamped as its latest activity (from any thread)."""
        known = self._requests.get(tenant)
        if known is None:
            return self._new(tenant)
        known.stamp = next(self._stamps)
        return known.requests

    def _new(self, tenant: str) -> RequestStats:
        with self._lock:
            known = self._requests.get(tenant)  # (another thread may have added it)
            if known is None:
                known = _Tenant()
                if len(self._requests) >= self._most:
                    self._forget(len(self._requests) - self._most + 1 + self._most // 8)
                self._requests[tenant] = known  # (a new dict entry: atomic for readers)
            known.stamp = next(self._stamps)
            return known.requests

    def _forget(self, count: int) -> None:
        # Under the lock: drop the ``count`` tenants least recently active.
        oldest = heapq.nsmallest(count, self._requests.items(), key=lambda kv: kv[1].stamp)
        for tenant, _ in oldest:
            del self._requests[tenant]
        self.forgotten += len(oldest)

    def weight(self, tenant: str) -> float:
        """``tenant``'s weight in ``fair`` pools."""
        with self._lock:
            return self._weights.get(tenant, self._default_weight)

    def set_weight(self, tenant: str, weight: float) -> float:
        """Make ``tenant``'s weight ``weight`` (checked: an InvalidArgumentError that is a
        ValueError unless a finite number > 0, one that is a TypeError for a tenant that
        is not a str; see :func:`check_tenant_weight`); returns it as a float."""
        value = check_tenant_weight(tenant, weight)
        with self._lock:  # (held: an actor attached meanwhile gets it too, in order)
            self._weights[tenant] = value
            for actor in self._actors:
                actor.set_tenant_weight(tenant, value)
        return value

    def attach(self, actors: Iterable[Weighted]) -> None:
        """Give ``actors`` every weight set so far, and those set from now on."""
        with self._lock:
            for actor in actors:
                for tenant, weight in self._weights.items():
                    actor.set_tenant_weight(tenant, weight)
                self._actors.append(actor)

    def stats(self) -> list[TenantStats]:
        """Each tenant's figures, the most recently active last."""
        with self._lock:
            tenants = sorted(self._requests.items(), key=lambda kv: kv[1].stamp)
            weights = [self._weights.get(tenant, self._default_weight) for tenant, _ in tenants]
        return [TenantStats(**known.requests.figures(), name=tenant, weight=weight)
                for (tenant, known), weight in zip(tenants, weights, strict=True)]


class _Tenant:
    """A tenant's requests, and the stamp of its latest one (a :class:`TenantLedger`'s
    count: higher is more recent)."""

    __slots__ = ("requests", "stamp")

    def __init__(self) -> None:
        self.requests = RequestStats()
        self.stamp = 0


class TenantAccount:
    """Counts a request in ``model`` (unless None) and in ``tenant``'s requests in
    ``ledger``, looked up when the request ends: a request that never reaches a device
    (refused before it is counted) makes no tenant appear, and a tenant forgotten while
    its request ran has it counted in its new figures."""

    __slots__ = ("ledger", "model", "tenant")

    def __init__(self, ledger: TenantLedger, model: Account | None, tenant: str) -> None:
        self.ledger = ledger
        self.model = model
        self.tenant = tenant

    def record(self, outcome: Outcome, seconds: float, *, queued: float = 0.0,
               delivering: float = 0.0, leased: bool = False, share: float = 1.0) -> None:
        if self.model is not None:
            self.model.record(outcome, seconds, queued=queued, delivering=delivering,
                              leased=leased, share=share)
        self.ledger.requests(self.tenant).record(outcome, seconds, queued=queued,
                                                 delivering=delivering, leased=leased,
                                                 share=share)

    def record_batch(self, requests: int) -> None:
        if self.model is not None:
            self.model.record_batch(requests)
        self.ledger.requests(self.tenant).record_batch(requests)
