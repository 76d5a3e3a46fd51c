"""Dynamic batching: requests for one graph merged into one run on a device.

A model (or pipeline) loaded with :class:`Batching` lets its requests share runs: the
requests that wait for a worker slot on a device at the same time, for the same graph,
with inputs of the same element types and the same shapes but the first (batch) axis, are
concatenated along that axis, run once, and the outputs split back by rows. On a busy
device this turns a queue of single-row requests into a few large runs, as an inference
server's dynamic batcher does (Triton's ``dynamic_batching``); on an idle one it costs
nothing unless ``max_delay`` asks a batch to wait for company.

How a batch forms (all in trio, per device actor, see :class:`Batcher`):

* A request that finds no open batch it may join, and a free slot with nobody queued,
  runs at once as a plain request (``max_delay`` = 0: batching never delays an idle
  device). Otherwise it opens a batch: one entry in the device's queue, ordered by the
  queue policy with its members' highest priority, earliest deadline and tenant (the
  opener's, until members join or leave: a batch whose most urgent member left moves
  back in the queue to where its remaining members' terms place it).
* Until that entry is granted a slot (and, with ``max_delay``, until ``max_delay`` after
  the batch opened, until it is full, or until half the time left before its earliest
  member's deadline has passed, so that a short timeout is not spent waiting), later
  requests join it when they are for the
  same graph and input signature, of the same tenant, would not be served earlier on
  their own (priority no higher, deadline no earlier than the batch's), and their rows
  fit under ``max_batch`` beside those of the members still there (a member that leaves
  before its batch starts frees its rows: a batch closed for being full, still queued
  or waiting for company, is joinable again). Anything else opens a batch of its own.
* The batch then runs as one job in a worker thread. Each member still gets its own
  outcome, latency (queued: until the batch started running) and stats entry; the
  device's ``batches`` count merged runs, ``batched`` the requests they answered.

Correctness never rests on the merge:

* A merged run that fails, or whose outputs do not have the batch's row count as their
  first dimension, is re-run request by request in the same job, so one bad request
  fails alone and a model whose outputs cannot be split still answers (with a warning).
  Such a model's later requests (for that graph and input signature) run alone, as
  plain requests: they no longer pay for a merged run that is thrown away, nor wait in
  one job for each other where other workers are free.
* A member cancelled or past its deadline leaves the batch (its part of the result is
  dropped); when every member has left, the batch leaves the queue, or its run is
  abandoned like any request's.
* A merged run keeps its outputs on the device when any member asked to
  (``keep_on_device``, the default on a GPU). Each such member gets its rows as a view on
  the device where the backend can cut its value without a copy (torch tensors, OpenVINO
  tensors); an ``OrtValue`` cannot be cut, so its rows are views of one host copy, as are
  those of every member that asked for host outputs.

Only requests whose inputs are host tensors that all share their first dimension are
batched; others (device-resident inputs, scalars) run as plain requests. Enable batching
only for models whose rows are independent of each other (no reduction across the batch
axis): the merged run computes each row as a run of its own would, up to the backend's
floating-point reassociation in larger matrix products.
"""

from __future__ import annotations

import functools
import logging
import math
import operator
import threading
import time
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import outcome
import trio

from wasinn.backends.base import TensorSpec, current_cancellation
from wasinn.errors import (
    ClosedResourceError,
    InvalidArgumentError,
    WasiNNError,
)
from wasinn.tensor import Tensor, as_int, as_tensor

from .jobs import backend_failure
from .queue import Request
from .stats import Account, RequestStats

log = logging.getLogger("wasinn.actors")

#: How many batch keys that run alone (see Batcher) are remembered before starting again.
_MAX_ALONE = 1024

#: The most rows a batch may be given (``Batching.max_batch``, the config's too).
MAX_BATCH = 65_536

#: Runs a graph (or pipeline) on inputs; the flag is ``keep_on_device``.
RunInputs = Callable[[Mapping[Any, Any], bool], dict[str, Tensor]]
#: A request's input signature: (key, element type, dimensions after the first) per input.
Signature = tuple[tuple[Any, Any, tuple[int, ...]], ...]


@dataclass(frozen=True, slots=True)
class Batching:
    """How one model's requests are merged on a device.

    ``max_batch``: the most rows one run takes (a request with more runs alone).
    ``max_delay``: seconds a batch that holds a slot waits for more requests before it
    runs, unless it fills up first; 0 (the default) batches only what queued while the
    device was busy and never delays a request on an idle device. Other values raise
    :class:`BatchingError` (an InvalidArgumentError, and a ValueError).
    """

    max_batch: int
    max_delay: float = 0.0

    def __post_init__(self) -> None:
        # InvalidArgumentError like every bad value wasinn is given; also a ValueError,
        # which is what this raised before it joined the error tree.
        max_batch, max_delay = self.max_batch, self.max_delay
        count = as_int(max_batch)
        if count is None or not 2 <= count <= MAX_BATCH:
            raise BatchingError(f"Batching: max_batch must be an integer from 2 to "
                               f"{MAX_BATCH}, got {max_batch!r}")
        if not (isinstance(max_delay, int | float | np.integer | np.floating)
                and not isinstance(max_delay, bool | np.bool_) and 0 <= max_delay <= 10):
            raise BatchingError(f"Batching: max_delay must be between 0 and 10 seconds, got "
                               f"{max_delay!r}")
        # numpy numbers (np.int64(8)) are kept as Python ones.
        object.__setattr__(self, "max_batch", count)
        object.__setattr__(self, "max_delay", float(max_delay))


class BatchingError(InvalidArgumentError, ValueError):
    """A :class:`Batching` with bounds out of range (``wasinn.BatchingError``):
    invalid-argument, and a ValueError for callers that caught that before."""


def check_batchable(name: str, inputs: Sequence[TensorSpec],
                    outputs: Sequence[TensorSpec]) -> None:
    """InvalidArgumentError unless every input and output whose rank is known has a
    variable first (batch) dimension: rows cannot be merged along a fixed one, nor along
    a scalar's, which has none."""
    for role, specs in (("input", inputs), ("output", outputs)):
        for spec in specs:
            if not spec.rank_known:
                continue
            if not spec.shape:
                raise InvalidArgumentError(
                    f"{name}: batching merges requests along the first dimension, but "
                    f"{role} {spec.describe()} is a scalar: expected a variable batch "
                    "dimension, or load the model without batching")
            if spec.shape[0] is not None:
                raise InvalidArgumentError(
                    f"{name}: batching merges requests along the first dimension, but "
                    f"{role} {spec.describe()} fixes it: expected a variable batch "
                    "dimension (export the model with a dynamic first axis), or load it "
                    "without batching")


class BatchInputs:
    """A request's inputs as a batch member: host tensors sharing their first dimension."""

    __slots__ = ("rows", "signature", "tensors")

    def __init__(self, tensors: dict[Any, Tensor], rows: int, signature: Signature) -> None:
        self.tensors = tensors
        self.rows = rows
        self.signature = signature

    @classmethod
    def of(cls, inputs: Mapping[Any, object]) -> BatchInputs | None:
        """``inputs`` ready to batch, or None when they cannot be (a device-resident or
        scalar input, first dimensions that differ, a value that is not a tensor: such
        a request runs as a plain one, which reports bad inputs as usual)."""
        tensors: dict[Any, Tensor] = {}
        signature = []
        rows = -1
        for key, value in inputs.items():
            try:
                tensor = value if type(value) is Tensor else as_tensor(value)  # type: ignore[arg-type]
            except (WasiNNError, TypeError, ValueError):
                return None
            dims = tensor.dims
            if not tensor.is_host or not dims or (rows >= 0 and dims[0] != rows):
                return None
            rows = dims[0]
            tensors[key] = tensor
            signature.append((key, tensor.type, dims[1:]))
        if rows < 1:
            return None
        return cls(tensors, rows, tuple(signature))


class _Member:
    """One request in a batch: its inputs and terms, and its outcome once the batch has
    run."""

    __slots__ = ("abandoned", "deadline", "done", "granted", "inputs", "keep", "priority",
                 "result", "share")

    def __init__(self, inputs: BatchInputs, keep: bool, priority: int, deadline: float
                 ) -> None:
        self.inputs = inputs
        self.keep = keep
        self.priority = priority
        self.deadline = deadline
        self.done = trio.Event()
        self.result: outcome.Outcome[dict[str, Tensor]] | None = None
        self.granted = math.inf  # perf_counter when its batch started running
        self.share = 1.0  # its rows' share of the batch's run (its device time)
        self.abandoned = False


class _Batch:
    """Requests that will run together; open (joinable) until it starts or fills up
    (open again if a member leaves it full before it starts: ``rows`` counts its live
    members' rows until then).
    ``priority`` and ``deadline``: its live members' highest and earliest; ``request``:
    its entry in the device's queue until it is granted a slot."""

    __slots__ = ("account", "batching", "deadline", "full", "key", "label", "live",
                 "members", "open", "opened", "priority", "request", "rows", "run", "scope",
                 "tenant")

    def __init__(self, key: Hashable, run: RunInputs, batching: Batching, priority: int,
                 deadline: float, tenant: str, label: str,
                 account: Account | None) -> None:
        self.key = key
        self.run = run
        self.batching = batching
        self.priority = priority
        self.deadline = deadline
        self.tenant = tenant
        self.label = label
        self.account = account
        self.members: list[_Member] = []
        self.rows = 0
        self.live = 0  # members still waiting for their result
        self.open = True
        self.opened = trio.current_time()
        self.full = trio.Event()
        self.scope = trio.CancelScope()  # its runner's: cancelled once every member left
        self.request: Request | None = None

    def left(self) -> bool:
        """A member left: recompute the terms from those still live; whether they
        changed."""
        live = [m for m in self.members if not m.abandoned]
        if not live:
            return False
        priority = max(m.priority for m in live)
        deadline = min(m.deadline for m in live)
        if (priority, deadline) == (self.priority, self.deadline):
            return False
        self.priority, self.deadline = priority, deadline
        return True

    def admits(self, inputs: BatchInputs, priority: int, deadline: float,
               tenant: str) -> bool:
        return (self.open and tenant == self.tenant and priority <= self.priority
                and deadline >= self.deadline
                and self.rows + inputs.rows <= self.batching.max_batch)


class Batcher:
    """The batches of one device actor (trio only; see the module docstring).

    ``take_slot(request)`` queues for a worker slot as ``request``; ``requeue_slot(request,
    priority, deadline)`` gives it new terms while it waits; ``free_slot`` gives a slot
    back; ``run_in_slot(job, label, tenant)`` runs a job in a worker thread on a held slot
    (which it frees when the thread is done), its run charged to ``tenant`` (a batch's
    members are all of one tenant, so a merged run is charged whole to it); ``start``
    starts a task that lives as long as the actor; ``stats`` counts the device's
    batches. A run whose exception :attr:`fatal` says the device cannot survive (a lost
    GPU) ends the whole batch with it: nothing more is run there, and the job raises it,
    for the device context to see.
    """

    def __init__(self, device: str,
                 take_slot: Callable[[Request], Awaitable[None]],
                 requeue_slot: Callable[[Request, int, float], None],
                 free_slot: Callable[[], None],
                 run_in_slot: Callable[[Callable[[], Any], str, str], Awaitable[Any]],
                 start: Callable[[Callable[[_Batch], Awaitable[None]], _Batch], None],
                 stats: RequestStats) -> None:
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
        self._open: dict[Hashable, list[_Batch]] = {}
        #: Requests in batches that have not started running (queued or gathering).
        self.waiting = 0
        #: The queue entries of batches that have not been granted a slot yet.
        self._requests: set[Request] = set()
        #: Batch keys whose merged outputs could not be split: their requests run alone.
        self._alone: set[Hashable] = set()

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
                     label: str, account: Account | None
                     ) -> tuple[dict[str, Tensor], float, float]:
        """Join (or open) a batch for ``inputs``; the request's outputs once it has run,
        when (perf_counter) its batch started running, and its share of that run (its
        rows' share: the part of the run's device time that is its own). ``key`` names
        what may run together (the graph on this device); the input signature is added
        to it."""
        await trio.lowlevel.checkpoint_if_cancelled()
        if type(priority) is not int:
            priority = operator.index(priority)  # a numpy integer: compared and negated
        full_key = (key, inputs.signature)
        if full_key in self._alone:
            return await self._run_alone(inputs, keep, run, priority, deadline, tenant,
                                         label)
        batch = self._joinable(full_key, inputs, priority, deadline, tenant)
        if batch is None:
            batch = _Batch(full_key, run, batching, priority, deadline, tenant, label,
                           account)
            self._start(self._lead, batch)  # raises ClosedResourceError once closed
            self._open.setdefault(full_key, []).append(batch)
        member = _Member(inputs, keep, priority, deadline)
        batch.members.append(member)
        batch.rows += inputs.rows
        batch.live += 1
        self.waiting += 1
        if batch.rows >= batching.max_batch:
            self._close(batch)
            batch.full.set()
        try:
            await member.done.wait()
        except BaseException:
            if member.result is None:  # still waiting: leave the batch
                member.abandoned = True
                batch.live -= 1
                if member.granted == math.inf:  # its batch has not started: its rows free
                    self.waiting -= 1
                    batch.rows -= inputs.rows
                if not batch.live:  # nobody wants it any more
                    self._close(batch)
                    batch.scope.cancel()
                else:
                    if member.granted == math.inf and batch.full.is_set():
                        self._reopen(batch)
                    if batch.left() and batch.request is not None:
                        # Still queued: it waits on its remaining members' terms.
                        self._requeue_slot(batch.request, batch.priority, batch.deadline)
            raise
        result = member.result
        assert result is not None
        try:
            return result.unwrap(), member.granted, member.share
        except WasiNNError:
            raise
        except Exception as exc:
            raise backend_failure(self._device, exc) from exc

    async def _run_alone(self, inputs: BatchInputs, keep: bool, run: RunInputs,
                         priority: int, deadline: float, tenant: str, label: str
                         ) -> tuple[dict[str, Tensor], float, float]:
        # A plain request: queued on its own terms, run in a job of its own.
        await self._take_slot(Request(priority, deadline, tenant))
        granted = time.perf_counter()
        job = functools.partial(run, inputs.tensors, keep)
        return await self._run_in_slot(job, label, tenant), granted, 1.0

    def _joinable(self, key: Hashable, inputs: BatchInputs, priority: int, deadline: float,
                  tenant: str) -> _Batch | None:
        for batch in self._open.get(key, ()):
            if batch.admits(inputs, priority, deadline, tenant):
                return batch
        return None

    def _close(self, batch: _Batch) -> None:
        # No more members: take it out of the open batches.
        if not batch.open:
            return
        batch.open = False
        batches = self._open[batch.key]
        batches.remove(batch)
        if not batches:
            del self._open[batch.key]

    def _reopen(self, batch: _Batch) -> None:
        # A batch closed for being full, not started yet (queued or gathering), whose
        # member left: joinable again while its live members leave room. (Closed for any
        # other reason, it has started, or every member has left, or it has settled.)
        if batch.rows >= batch.batching.max_batch:
            return
        batch.open = True
        batch.full = trio.Event()  # (a trio.Event cannot be cleared)
        self._open.setdefault(batch.key, []).append(batch)

    async def _lead(self, batch: _Batch) -> None:
        # The batch's own task (in the actor's nursery): queue for a slot, wait for
        # company if asked, run every member as one job, hand each its outcome.
        outcomes: list[outcome.Outcome[dict[str, Tensor]]] | None = None
        failure: BaseException | None = None
        try:
            with batch.scope:
                batch.request = Request(batch.priority, batch.deadline, batch.tenant)
                self._requests.add(batch.request)
                try:
                    await self._take_slot(batch.request)
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

    async def _gather_and_run(self, batch: _Batch
                              ) -> list[outcome.Outcome[dict[str, Tensor]]] | None:
        # Holding a slot: the slot is freed here, or by the worker thread once the job ran.
        try:
            delay = batch.batching.max_delay
            if delay and batch.open:
                until = batch.opened + delay
                if batch.deadline < until:  # leave the run half of the time that is left
                    now = trio.current_time()
                    until = min(until, now + (batch.deadline - now) / 2)
                with trio.move_on_at(until):
                    # Woken as it filled up: it runs, unless a member left meanwhile and
                    # reopened it (a new event then).
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
        job = _BatchJob(batch.run, members, batch.label, self.fatal)
        outcomes: list[outcome.Outcome[dict[str, Tensor]]] = await self._run_in_slot(
            job, batch.label, batch.tenant)
        if job.unsplittable:
            if len(self._alone) >= _MAX_ALONE:  # graphs loaded and unloaded for ever
                self._alone.clear()
            self._alone.add(batch.key)
        if job.merged:
            # Members that left while it ran are counted as they ended, not as answered.
            answered = sum(not member.abandoned for member in members)
            self._stats.record_batch(answered)
            if batch.account is not None:
                batch.account.record_batch(answered)
        return outcomes

    def _settle(self, batch: _Batch, outcomes: Sequence[outcome.Outcome[Any]] | None,
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


class _BatchJob:
    """The job a batch runs in a worker thread: one merged run, split by rows, or (when
    that fails or cannot be split) one run per member. ``merged`` says which happened;
    ``unsplittable``, that the merged run's outputs could not be split by rows."""

    __slots__ = ("fatal", "label", "members", "merged", "run", "unsplittable")

    def __init__(self, run: RunInputs, members: Sequence[_Member], label: str,
                 fatal: Callable[[BaseException], bool]) -> None:
        self.run = run
        self.fatal = fatal
        self.members = members
        self.label = label
        self.merged = False
        self.unsplittable = False

    def __call__(self) -> list[outcome.Outcome[dict[str, Tensor]]]:
        # Members that left since the batch was granted its slot (their flag is set in
        # trio; reading a stale False only costs a wasted row) are not run.
        results: list[outcome.Outcome[dict[str, Tensor]]] = [self._left] * len(self.members)
        alive = [i for i, m in enumerate(self.members) if not m.abandoned]
        members = [self.members[i] for i in alive]
        if len(members) == 1:
            only = members[0]
            results[alive[0]] = self._alone(only)
            return results
        if not members:
            return results
        keeps = [m.keep for m in members]
        try:
            parts = split_rows(self.run(merge_rows([m.inputs for m in members]), any(keeps)),
                               [m.inputs.rows for m in members], keeps)
        except _Unsplittable as exc:
            self.unsplittable = True
            _warn_once(self.label, str(exc))
        except Exception as exc:  # each request is re-run alone below, and fails alone
            if self.fatal(exc):
                raise  # the device is lost: no run more there
            log.debug("%s: a merged run failed; its requests run one by one", self.label,
                      exc_info=True)
        else:
            self.merged = True
            for i, part in zip(alive, parts, strict=True):
                results[i] = outcome.Value(part)
            return results
        cancellation = current_cancellation()
        for i, member in zip(alive, members, strict=True):
            if member.abandoned:
                continue
            if cancellation is not None and cancellation.cancelled:
                results[i] = outcome.Error(ClosedResourceError(
                    f"{self.label}: the batch was cancelled (its device is closing) before "
                    "this request ran"))
                continue
            results[i] = self._alone(member)
        return results

    def _alone(self, member: _Member) -> outcome.Outcome[dict[str, Tensor]]:
        # One member's run; an exception the device cannot survive ends the batch.
        try:
            return outcome.Value(self.run(member.inputs.tensors, member.keep))
        except BaseException as exc:
            if self.fatal(exc):
                raise
            return outcome.Error(exc)

    @property
    def _left(self) -> outcome.Outcome[dict[str, Tensor]]:
        # The outcome of a member that left: never handed to anyone.
        return outcome.Error(ClosedResourceError(f"{self.label}: the request left its batch"))


def _survivable(exc: BaseException) -> bool:
    return False


class _Unsplittable(Exception):
    """A merged run's outputs do not have one row per input row."""


def merge_rows(members: Sequence[BatchInputs]) -> dict[Any, Tensor]:
    """Every member's inputs concatenated along the first axis, in member order."""
    merged: dict[Any, Tensor] = {}
    for key, first in members[0].tensors.items():
        array = np.concatenate([m.tensors[key].numpy() for m in members])
        merged[key] = Tensor(tuple(array.shape), first.type, array=array)
    return merged


def split_rows(outputs: Mapping[str, Tensor], rows: Sequence[int], keeps: Sequence[bool]
               ) -> list[dict[str, Tensor]]:
    """``outputs`` of a merged run cut back into each member's rows, without a copy:
    views of host outputs; of a device-resident output, native views on the device for
    the members that keep theirs there (``keeps``) where the backend can cut its value,
    else views of one host copy.

    Raises _Unsplittable when an output's first dimension is not the total row count.
    """
    total = sum(rows)
    parts: list[dict[str, Tensor]] = [{} for _ in rows]
    for name, tensor in outputs.items():
        if not tensor.dims or tensor.dims[0] != total:
            raise _Unsplittable(
                f"output {name!r} has shape {list(tensor.dims)}, not {total} rows (one per "
                "input row): its requests run one by one, and alone from now on")
        start = 0
        for part, count, keep in zip(parts, rows, keeps, strict=True):
            stop = start + count
            piece = tensor.slice_rows(start, stop) if keep else None
            if piece is None:  # materialized once (if native), for the first that needs it
                host = tensor.numpy()[start:stop]
                piece = Tensor(tuple(host.shape), tensor.type, array=host)
            part[name] = piece
            start = stop
    return parts


_warned: set[str] = set()
_warned_lock = threading.Lock()


def _warn_once(label: str, why: str) -> None:
    with _warned_lock:
        if label in _warned:
            return
        _warned.add(label)
    log.warning("%s: cannot batch: %s", label, why)
