"""The request paths of a :class:`~wasinn.actors.device.DeviceActor`: how work reaches its
device.

:meth:`~DeviceRequests.execute` runs a job in a worker thread (or inline),
:meth:`~DeviceRequests.execute_batched` a graph's run merged with others', and
:meth:`~DeviceRequests.lease` and :meth:`~DeviceRequests.try_lease` lend a slot to the
caller's own thread. They hand the work to the actor's
:class:`~wasinn.actors.runner.RequestRunner` and :class:`~wasinn.actors.leasedesk.LeaseDesk`
through methods bound once (:meth:`DeviceRequests._bind_request_paths`), and a request
refused because the device was lost gets that DeviceLostError. They are methods of the
actor itself, inherited from :class:`DeviceRequests`, because every request goes through
one: going through another object would cost each request a call.

A caller that runs in a thread of its own (a WebAssembly guest's) may instead take a
:class:`~wasinn.actors.lease.Lease` (:meth:`DeviceActor.lease`): the slot is reserved in
trio as for any request, and the caller's thread runs the job itself (one trio round trip
instead of two plus a thread hand-off).

Dynamic batching (:meth:`DeviceActor.execute_batched`, :mod:`wasinn.actors.batching`):
requests for one graph that wait for this device at the same time run as one merged job;
each batch is a task in the actor's nursery, living no longer than the actor.

Every request the actor admits is counted by how it ended, with its latency (see
:mod:`wasinn.actors.stats`; :meth:`DeviceActor.stats` reads it).

Cancellation: a caller cancelled while queued is removed from the queue and never runs;
cancelled while running (or past its deadline), its job is abandoned: the job's
:class:`~wasinn.backends.base.Cancellation` is cancelled, which ends an ONNX Runtime run
within milliseconds, an OpenVINO run at its next node outside a Loop (torch where it
can: see its backend), the result is dropped,
and the worker thread keeps the job's slot until the backend call has returned, so a
device never runs more than ``workers`` jobs. A job's exception fails that request only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, TypeVar

from wasinn.errors import ClosedResourceError
from wasinn.tensor import Tensor

from .batching import Batching, BatchInputs, RunInputs
from .inline import RunProfile
from .lease import Lease
from .leasedesk import LeaseDesk
from .runner import RequestRunner
from .slots import Slots
from .stats import Account, outcome_of

T = TypeVar("T")


class DeviceRequests:
    """The request paths of :class:`~wasinn.actors.device.DeviceActor` (see the module
    docstring), inherited by the actor, which builds what they use."""

    _slots: Slots
    _desk: LeaseDesk

    if TYPE_CHECKING:
        def _raise_if_lost(self) -> None: ...

    def _bind_request_paths(self, runner: RequestRunner, desk: LeaseDesk) -> None:
        # What the request and lease paths call, bound once: delegating costs no call.
        self._counted = runner.counted
        self._request = runner.request
        self._batched = runner.batched
        self._record = runner.record
        self._lease_slot = desk.take_slot
        self._new_lease = desk.lend
        self._watch = desk.watch
        self._soon = desk.soon

    async def execute(
        self,
        job: Callable[[], T],
        *,
        priority: int = 0,
        deadline: float = math.inf,
        tenant: str = "",
        profile: RunProfile | None = None,
        nbytes: int | None = None,
        label: str = "run",
        account: Account | None = None,
        reached: float | None = None,
    ) -> T:
        """Run ``job`` in one of this device's worker threads and return its result.

        ``profile`` (the run timings of the graph ``job`` runs) and ``nbytes`` (its input
        size) let a tiny job run inline on the trio thread instead, when the actor's
        ``inline_below`` allows it (off by default), the device is idle and the request
        has no deadline: neither ``deadline`` nor one of the caller's cancel scopes (an
        inline run cannot be interrupted, so it could not time out; see
        :mod:`wasinn.actors.inline`).

        Waits in the queue while every slot is busy. Raises ClosedResourceError when the
        actor is closed, TooLargeError when the queue is full, TimeoutError_ when
        ``deadline`` (trio time) passes first (queued requests are dropped, a running one
        is abandoned), and BackendRuntimeError for an exception that is not a WasiNNError
        (those propagate as they are). Cancellation: see the module docstring. ``label``
        names the job in diagnostics (the close-timeout error). The request is counted in
        the device's stats and, when given, in ``account`` too (its model's), its latency
        and time queued from ``reached`` (perf_counter) when given: when it reached this
        device, before it waited for its graph's compile here (see :meth:`record_unqueued`
        for one that ends in that wait); from now otherwise.
        """
        try:
            return await self._counted(account, reached, self._request, job, priority,
                                       deadline, tenant, profile, nbytes, label)
        except ClosedResourceError:
            self._raise_if_lost()
            raise

    async def execute_batched(
        self,
        key: Hashable,
        inputs: BatchInputs,
        run: RunInputs,
        batching: Batching,
        *,
        keep_on_device: bool = False,
        priority: int = 0,
        deadline: float = math.inf,
        tenant: str = "",
        label: str = "run",
        account: Account | None = None,
        reached: float | None = None,
        probe: bool = False,
    ) -> dict[str, Tensor]:
        """``run(inputs, keep_on_device)`` here, merged with other requests for the same
        ``key`` (a graph on this device) as ``batching`` allows (see
        :mod:`wasinn.actors.batching`): outputs of a merged run are host tensors.
        ``probe``: check the first merged run of each input signature against a run
        alone, for a graph that does not declare its outputs batch-major (see
        :func:`~wasinn.actors.batching.check_batchable`).

        Same errors, deadline, cancellation and accounting (``reached`` included) as
        :meth:`execute`; a request that runs alone (a free slot with nobody queued and no
        ``max_delay``, or more rows than ``max_batch``) runs exactly as :meth:`execute`
        runs it.
        """
        try:
            return await self._counted(account, reached, self._batched, key, inputs, run,
                                       batching, keep_on_device, priority, deadline, tenant,
                                       label, account, probe)
        except ClosedResourceError:
            self._raise_if_lost()
            raise


    def record_unqueued(self, account: Account | None, exc: BaseException,
                        seconds: float) -> None:
        """Count a request placed on this device that ended with ``exc`` before it
        reached the queue (while it waited for its graph to compile here), as
        :meth:`execute` counts one that ends in it."""
        self._record(account, outcome_of(exc), seconds)

    async def lease(
        self,
        job: Callable[[], T],
        *,
        priority: int = 0,
        deadline: float = math.inf,
        tenant: str = "",
        account: Account | None = None,
        reached: float | None = None,
        label: str = "",
    ) -> Lease[T]:
        """Reserve a worker slot for ``job``, to be run by the caller's own thread.

        Waits in the queue like :meth:`execute` (same errors while waiting: ClosedResourceError,
        TooLargeError, TimeoutError_ when ``deadline`` passes first); returns once the slot
        is held. Cancelled while queued, the request is removed. The holder must call
        :meth:`Lease.run` (from a thread that is not trio's) or :meth:`Lease.cancel`; a run
        still going when ``deadline`` passes is stopped (see :meth:`Lease.interrupt`) and
        raises TimeoutError_ there. ``account`` and ``reached``: as in :meth:`execute`;
        ``label`` names its run (a model's) in these errors ("" for none: the device
        alone). Its backend sees ``tenant`` as the run's caller (as a worker thread's
        job's: see :func:`~wasinn.backends.base.current_caller`).
        """
        start = time.perf_counter() if reached is None else reached
        try:
            expires = await self._lease_slot(priority, deadline, tenant, label)
        except BaseException as exc:
            # Never run (no slot): not a request run in the caller's thread.
            self._record(account, outcome_of(exc), time.perf_counter() - start)
            if isinstance(exc, ClosedResourceError):
                self._raise_if_lost()
            raise
        lease = self._new_lease(job, expires, start, time.perf_counter(), account,
                                tenant if self._slots.charges else None, caller=tenant,
                                label=label)
        if deadline != math.inf:
            self._watch(lease, deadline)
        return lease

    def try_lease(self, job: Callable[[], T], *, timeout: float | None = None,
                  tenant: str = "", account: Account | None = None, label: str = ""
                  ) -> Lease[T] | None:
        """A lease on a free slot, taken from any thread without waiting for trio, or None
        when every slot is busy, a request is queued (it must not be overtaken), or the
        actor is not serving: then use :meth:`lease` through trio.

        ``timeout`` (seconds) bounds the run as ``deadline`` does in :meth:`lease`;
        ``tenant``: whom the time it holds the slot is charged to, as in :meth:`lease`
        (a fair policy counts it, though the request never queued); ``account``: as in
        :meth:`execute`; ``label``: as in :meth:`lease`.
        """
        if not self._slots.try_take():
            return None
        start = time.perf_counter()
        charged = tenant if self._slots.charges else None
        if timeout is None or timeout == math.inf:
            return self._new_lease(job, math.inf, start, start, account, charged,
                                   caller=tenant, label=label)
        lease = self._new_lease(job, start + timeout, start, start, account, charged,
                                caller=tenant, label=label)
        self._soon(self._watch, lease, None)
        return lease

    @property
    def watched_leases(self) -> int:
        """Leases whose deadline is being watched, finished ones not yet dropped included:
        fewer than 64, or about twice the running ones once there are more."""
        return self._desk.watched
