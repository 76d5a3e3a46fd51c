"""``Batcher``: the batches of one device actor, from a request's arrival to each
member's outcome.

A batched request joins an open batch it may join or opens one (:meth:`Batcher.submit`);
each batch is a task in the actor's nursery that queues for a worker slot on its
members' terms, waits for company if ``max_delay`` asks it to, runs them as one
:class:`~wasinn.actors._batch_job.BatchJob` and hands each member its outcome. Batch
keys whose merged outputs could not be split are remembered, and their requests run
alone; so are those whose merged outputs a run alone checked (the first merged run of a
key whose model does not declare its outputs batch-major probes: see
:mod:`wasinn.actors._batch_axes`). The rules (who may join, when a batch runs, what a
member that leaves frees) are in :mod:`wasinn.actors.batching`.

A member leaves a batch that has not started when its caller is cancelled, or when its
:class:`~wasinn.actors.slots.QueueOwner` withdraws it (its execution context closed:
:meth:`Batcher.withdraw`); either way the batch goes on without its rows, or leaves the
queue when nobody is left. The batch's own entry in the device's queue belongs to no
owner: it serves several callers.

A graph that nobody can send requests to any more (unloaded while its requests are in
flight) has its batches run with the members they have, waiting for no company
(:meth:`Batcher.gathering_ended`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import operator
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Hashable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import outcome
import trio

from wasinn.errors import ClosedResourceError, WasiNNError
from wasinn.tensor import Tensor

from ._batch import Batch, Member
from ._batch_job import BatchJob
from ._batch_rows import BatchInputs, RunInputs
from .jobs import backend_failure
from .queue import Request
from .slots import QUEUE_OWNER, RequestWithdrawn, withdrawal
from .stats import Account, RequestStats

log = logging.getLogger("wasinn.actors")

if TYPE_CHECKING:
    from .batching import Batching

#: How many batch keys that run alone, or that were checked (see Batcher), are remembered
#: before starting again.
_MAX_ALONE = 1024


class Batcher:
    """The batches of one device actor (trio only; see the module docstring).

    ``take_slot(request, label)`` queues for a worker slot as ``request`` (``label`` names
    its run in the errors it may get); ``requeue_slot(request,
    priority, deadline)`` gives it new terms while it waits; ``free_slot`` gives a slot
    back; ``run_in_slot(job, label, tenant)`` runs a job in a worker thread on a held slot
    (which it frees when the thread is done) and returns its result and when
    (perf_counter) its thread passed the slot on (inf: it did not), the run charged to
    ``tenant`` (a batch's members are all of one tenant, so a merged run is charged whole
    to it); ``start`` starts a task that lives as long as the actor; ``stats`` counts the
    device's batches; ``idle_slot(scope)``, while a batch holds a slot waiting for
    company in ``scope``, cancels it once other work waits for the device (None: none
    ever does). A run whose exception :attr:`fatal` says the device cannot survive
    (a lost GPU) ends the whole batch with it: nothing more is run there, and the job
    raises it, for the device context to see.
    """

    def __init__(self, device: str,
                 take_slot: Callable[[Request, str], Awaitable[None]],
                 requeue_slot: Callable[[Request, int, float], None],
                 free_slot: Callable[[], None],
                 run_in_slot: Callable[[Callable[[], Any], str, str],
                                       Awaitable[tuple[Any, float]]],
                 start: Callable[[Callable[[Batch], Awaitable[None]], Batch], None],
                 stats: RequestStats, *,
                 idle_slot: Callable[[trio.CancelScope], contextlib.AbstractContextManager[None]]
                 | None = None) -> None:
        self._device = device
        #: Whether a run's exception leaves the device unusable (set by the actor from
        #: its device context once the device is open; never, until then).
        self.fatal: Callable[[BaseException], bool] = _survivable
        self._take_slot = take_slot
        self._requeue_slot = requeue_slot
        self._free_slot = free_slot
        self._run_in_slot = run_in_slot
        self._start = start
        self._stats = stats
        self._idle_slot = idle_slot
        self._open: dict[Hashable, list[Batch]] = {}
        #: Requests in batches that have not started running (queued or gathering).
        self.waiting = 0
        #: The queue entries of batches that have not been granted a slot yet.
        self._requests: set[Request] = set()
        #: Batch keys whose merged outputs could not be split: their requests run alone.
        self._alone: set[Hashable] = set()
        #: Batch keys whose merged outputs a member's run alone found batch-major.
        self._checked: set[Hashable] = set()
        #: Graphs (``submit``'s ``key``) whose batches wait for no company now: see
        #: :meth:`gathering_ended` (a count: its blocks may overlap).
        self._ended: Counter[Hashable] = Counter()

    @property
    def queued_batches(self) -> int:
        """Batches whose entry is in the device's queue now (one entry each): counted from
        the entries themselves, so a slot granted a moment ago (its batch's task not yet
        resumed) is not subtracted from the queue it has already left."""
        # (a tuple first: one C call, which any thread may make while trio changes the set;
        # DeviceActor.stats is read from a metrics scrape's thread)
        return sum(1 for request in tuple(self._requests)
                   if request.queued and not request.removed)

    async def submit(self, key: Hashable, inputs: BatchInputs, keep: bool, run: RunInputs,
                     batching: Batching, *, priority: int, deadline: float, tenant: str,
                     label: str, account: Account | None, probe: bool = False
                     ) -> tuple[dict[str, Tensor], float, float, float]:
        """Join (or open) a batch for ``inputs``; the request's outputs once it has run,
        when (perf_counter) its batch started running and when its worker thread passed
        the slot on (inf: it did not), and its share of that run (its rows' share: the
        part of the run's device time that is its own). ``key`` names
        what may run together (the graph on this device); the input signature is added
        to it. ``probe``: check the first merged run of each such key against a run of one
        of its requests alone, for a graph that does not declare its outputs batch-major
        (see :mod:`wasinn.actors._batch_axes`): unsplittable when their shapes differ."""
        await trio.lowlevel.checkpoint_if_cancelled()
        if type(priority) is not int:
            priority = operator.index(priority)  # a numpy integer: compared and negated
        full_key = (key, inputs.signature)
        if full_key in self._alone:
            return await self._run_alone(inputs, keep, run, priority, deadline, tenant,
                                         label)
        batch = self._joinable(full_key, inputs, priority, deadline, tenant)
        if batch is None:
            batch = Batch(full_key, run, batching, priority, deadline, tenant, label,
                           account, probe=probe)
            self._start(self._lead, batch)  # raises ClosedResourceError once closed
            self._open.setdefault(full_key, []).append(batch)
        member = Member(inputs, keep, priority, deadline)
        batch.members.append(member)
        batch.rows += inputs.rows
        batch.live += 1
        self.waiting += 1
        if batch.rows >= batching.max_batch:
            self._close(batch)
            batch.full.set()
        # Noted (withdrawn when its context closes) only here, where it waits: a request
        # that found a free slot above never pays for it.
        owner = QUEUE_OWNER.get()
        entry = (batch, member)
        if owner is not None:
            owner.queued(entry, self)  # (withdrawn at once if its context closed already)
        try:
            await member.done.wait()
        except BaseException:
            if member.result is None:  # still waiting: leave the batch
                self._leave(batch, member)
            raise
        finally:
            if owner is not None:
                owner.left(entry)
        result = member.result
        assert result is not None
        try:
            return result.unwrap(), member.granted, member.released, member.share
        except WasiNNError:
            raise
        except Exception as exc:
            raise backend_failure(self._device, exc) from exc

    @contextlib.contextmanager
    def gathering_ended(self, key: Hashable) -> Iterator[None]:
        """While this block lasts, the batches of graph ``key`` (as :meth:`submit` is given
        it) wait for no more company: those open now are closed and run with the members
        they have as soon as they hold a slot (at once, those that hold one and wait
        for company), as a batch that filled up does, and a member that leaves one does
        not reopen it; those opened meanwhile run as soon as they hold a slot, as with
        no ``max_delay``. For a graph that nobody can send a request to any more (its
        last handle unloaded, its requests in flight are all it will get), so that
        neither they nor the unload that waits for them wait out ``max_delay``."""
        self._ended[key] += 1
        try:
            for full_key, batches in list(self._open.items()):
                if _graph(full_key) == key:
                    for batch in list(batches):
                        self._close(batch)
                        batch.full.set()  # (wakes one that waits for company)
            yield
        finally:
            self._ended[key] -= 1
            if not self._ended[key]:
                del self._ended[key]

    def withdraw(self, entry: tuple[Batch, Member], why: str, /) -> bool:
        """Take a member out of its batch unrun if that batch has not started (in trio; see
        :class:`~wasinn.actors.slots.WaitingPlace`): its caller raises RequestWithdrawn
        saying ``why``, and the batch goes on without its rows (or leaves the queue when
        nobody is left), as when a member's caller is cancelled. False, changing nothing,
        once the batch has started running (the member runs to its end) or the member
        has its outcome."""
        batch, member = entry
        if member.result is not None or member.granted != math.inf:
            return False
        member.result = outcome.Error(RequestWithdrawn(
            withdrawal(why, "in a batch that had not started")))
        self._leave(batch, member)
        member.done.set()
        return True

    def _leave(self, batch: Batch, member: Member) -> None:
        # ``member`` no longer wants its result (its caller was cancelled, or it was
        # withdrawn). Before its batch starts, its rows free room for others, and the
        # batch requeues on the terms of the members left; a batch everyone left leaves
        # the queue (or, started, its run is abandoned).
        member.abandoned = True
        batch.live -= 1
        if member.granted == math.inf:  # its batch has not started: its rows free
            self.waiting -= 1
            batch.rows -= member.inputs.rows
        if not batch.live:  # nobody wants it any more
            self._close(batch)
            batch.scope.cancel()
        else:
            if member.granted == math.inf and batch.full.is_set():
                self._reopen(batch)
            if batch.left() and batch.request is not None:
                # Still queued: it waits on its remaining members' terms.
                self._requeue_slot(batch.request, batch.priority, batch.deadline)

    async def _run_alone(self, inputs: BatchInputs, keep: bool, run: RunInputs,
                         priority: int, deadline: float, tenant: str, label: str
                         ) -> tuple[dict[str, Tensor], float, float, float]:
        # A plain request: queued on its own terms (withdrawn as any, by the owner its
        # caller's task names), run in a job of its own.
        await self._take_slot(Request(priority, deadline, tenant), label)
        granted = time.perf_counter()
        job = functools.partial(run, inputs.tensors, keep)
        result, released = await self._run_in_slot(job, label, tenant)
        return result, granted, released, 1.0

    def _joinable(self, key: Hashable, inputs: BatchInputs, priority: int, deadline: float,
                  tenant: str) -> Batch | None:
        for batch in self._open.get(key, ()):
            if batch.admits(inputs, priority, deadline, tenant):
                return batch
        return None

    def _close(self, batch: Batch) -> None:
        # No more members: take it out of the open batches.
        if not batch.open:
            return
        batch.open = False
        batches = self._open[batch.key]
        batches.remove(batch)
        if not batches:
            del self._open[batch.key]

    def _reopen(self, batch: Batch) -> None:
        # A batch closed for being full, not started yet (queued or gathering), whose
        # member left: joinable again while its live members leave room, unless its
        # graph's gathering has ended (gathering_ended closed it as full). (Closed for
        # any other reason, it has started, or every member has left, or it has settled.)
        if batch.rows >= batch.batching.max_batch or _graph(batch.key) in self._ended:
            return
        batch.open = True
        batch.full = trio.Event()  # (a trio.Event cannot be cleared)
        self._open.setdefault(batch.key, []).append(batch)

    async def _lead(self, batch: Batch) -> None:
        # The batch's own task (in the actor's nursery): queue for a slot, wait for
        # company if asked, run every member as one job, hand each its outcome.
        outcomes: list[outcome.Outcome[dict[str, Tensor]]] | None = None
        failure: BaseException | None = None
        # Started from its opener's task, it inherited that caller's owner: its entry in
        # the queue serves every member, so no member's context may withdraw it (each
        # member is withdrawn on its own, see withdraw).
        QUEUE_OWNER.set(None)
        try:
            with batch.scope:
                batch.request = Request(batch.priority, batch.deadline, batch.tenant)
                self._requests.add(batch.request)
                try:
                    await self._take_slot(batch.request, batch.label)
                finally:
                    self._requests.discard(batch.request)
                    batch.request = None
                outcomes = await self._gather_and_run(batch)
        except Exception as exc:  # queue full, device closed: every member's error
            failure = exc
        except BaseException:  # the actor's nursery is cancelled: the device is closing
            failure = ClosedResourceError(f"{self._device}: the device closed while the "
                                          "request waited in a batch")
            raise
        finally:
            self._close(batch)
            self._settle(batch, outcomes, failure)

    async def _gather_and_run(self, batch: Batch
                              ) -> list[outcome.Outcome[dict[str, Tensor]]] | None:
        # Holding a slot: the slot is freed here, or by the worker thread once the job ran.
        try:
            delay = batch.batching.max_delay
            if delay and batch.open and _graph(batch.key) not in self._ended:
                until = batch.opened + delay
                if batch.deadline < until:  # leave the run half of the time that is left
                    now = trio.current_time()
                    until = min(until, now + (batch.deadline - now) / 2)
                with trio.move_on_at(until) as waiting, self._idling(waiting):
                    # Woken as it filled up: it runs, unless a member left meanwhile and
                    # reopened it (a new event then). Other work queued for the device
                    # ends the wait too (a request that may join has joined instead).
                    while batch.open:
                        await batch.full.wait()
            self._close(batch)
        except BaseException:
            self._free_slot()
            raise
        members = [member for member in batch.members if not member.abandoned]
        if not members:
            self._free_slot()
            return None
        granted = time.perf_counter()
        rows = sum(member.inputs.rows for member in members)
        for member in members:
            member.granted = granted
            member.share = member.inputs.rows / rows if rows else 1 / len(members)
        self.waiting -= len(members)
        job = BatchJob(batch.run, members, batch.label, self.fatal,
                       probe=batch.probe and batch.key not in self._checked)
        outcomes: list[outcome.Outcome[dict[str, Tensor]]]
        outcomes, released = await self._run_in_slot(job, batch.label, batch.tenant)
        for member in members:
            member.released = released
        if job.unsplittable is not None:
            if batch.key not in self._alone:  # (once: another batch may have found it)
                log.warning("%s: cannot batch: %s", batch.label, job.unsplittable)
            _remember(self._alone, batch.key)
        if job.checked:
            _remember(self._checked, batch.key)
        if job.merged:
            # Members that left while it ran are counted as they ended, not as answered.
            answered = sum(not member.abandoned for member in members)
            self._stats.record_batch(answered)
            if batch.account is not None:
                batch.account.record_batch(answered)
        return outcomes

    def _idling(self, scope: trio.CancelScope) -> contextlib.AbstractContextManager[None]:
        # The slot idles in ``scope`` until other work waits for the device.
        if self._idle_slot is None:
            return contextlib.nullcontext()
        return self._idle_slot(scope)

    def _settle(self, batch: Batch, outcomes: Sequence[outcome.Outcome[Any]] | None,
                failure: BaseException | None) -> None:
        ran = [member for member in batch.members if member.granted != math.inf]
        if outcomes is not None:
            for member, result in zip(ran, outcomes, strict=True):
                member.result = result
        for member in batch.members:
            if member.result is None:
                if member.granted == math.inf and not member.abandoned:
                    self.waiting -= 1
                member.result = outcome.Error(self._failure_for(failure))
            member.done.set()

    def _failure_for(self, failure: BaseException | None) -> BaseException:
        # Each member raises an error of its own (one exception object raised in several
        # tasks would collect all their tracebacks), the batch's as its cause.
        if failure is None:
            return ClosedResourceError(f"{self._device}: the batch was dropped")
        if isinstance(failure, WasiNNError):
            return failure.for_another_caller()
        return failure


def _survivable(exc: BaseException) -> bool:
    return False


def _graph(full_key: Hashable) -> Hashable:
    """The graph of a batch's key (the ``key`` given to :meth:`Batcher.submit`; the input
    signature is the rest)."""
    return cast("tuple[Hashable, Hashable]", full_key)[0]


def _remember(keys: set[Hashable], key: Hashable) -> None:
    if len(keys) >= _MAX_ALONE:  # graphs loaded and unloaded for ever
        keys.clear()
    keys.add(key)
