"""What a device actor has done: request outcomes and recent latencies.

Every request an actor admits ends in exactly one :class:`Outcome`, counted by
:class:`RequestStats`, whichever path ran it (a worker thread, inline on the event loop,
or a lease holder's own thread). Latency is end to end as the caller sees it: from the
request reaching the device (before it waits for its graph's compile there, or any
queueing) to its result, for completed requests, over a window of the most recent ones.
It is split, as an inference server's metrics are, into three phases that add up to it
(see :meth:`RequestRunner.counted <wasinn.actors.runner.RequestRunner.counted>`): the
time queued (until a worker slot was granted, that compile included), the time running
(from the grant to the run's end in its worker thread, the hand-off to that thread
included) and the time delivering (from the run's end to its caller's task taking the
result: the wait for a busy event loop; none for a run in the caller's own thread), so
that a saturated device (queue time grows) can be told from a slow model (run time
grows) and from an overloaded event loop (delivery time grows).
:meth:`DeviceActor.stats` reads it all, with the actor's current queue and slots, as one
:class:`DeviceStats` snapshot. Each completed request's running time is also summed
(``running_seconds``): the device time it took.

A request is also counted in the :class:`Account` its caller gives: its model's
(:class:`ModelStats`), or one that counts it in its model's and its tenant's
(:class:`TenantStats`; see :mod:`wasinn.scheduler.tenants`). A pipeline's step models
count the runs its requests make of them as their own requests
(:meth:`RequestStats.record_run`; see :class:`wasinn.scheduler.pipeline.StepsAccount`);
what a merged run records is held back (:class:`MergedRun`) until its job knows how many
requests that run answered.

Recording is thread-safe (lease holders record from their own threads) and costs one
uncontended lock per request and account.
"""

from __future__ import annotations

import contextlib
import enum
import math
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import trio

from wasinn.errors import QueueFullError, TimeoutError_

from .slots import RequestWithdrawn


class Outcome(enum.Enum):
    """How one request ended."""

    COMPLETED = "completed"  #: returned its outputs
    FAILED = "failed"  #: raised an error (backend failure, bad input, device closed...)
    TIMED_OUT = "timed_out"  #: its deadline passed, queued or running
    CANCELLED = "cancelled"  #: its caller gave up: dropped from the queue, or abandoned
    REJECTED = "rejected"  #: the queue was full (TooLargeError)

    #: By identity (members are singletons), in C: Enum's own hashes the name in Python,
    #: which every request's counting pays once per account.
    __hash__ = object.__hash__


@dataclass(frozen=True, slots=True)
class RequestFigures:
    """Requests by how they ended and their recent latencies: a device's
    (:class:`DeviceStats`) or a model's (:class:`ModelStats`)."""

    completed: int
    failed: int
    timed_out: int
    cancelled: int
    rejected: int
    #: of those requests, the ones a lease holder's own thread ran (whatever the run's
    #: outcome); a lease cancelled, dropped or refused before its run started is not one
    in_caller_thread: int
    latency_p50: float | None  #: seconds, over the last completed requests (None: none)
    latency_p99: float | None
    latency_window: int  #: completed requests the percentiles are taken over
    #: of those latencies, seconds queued: waiting for the graph's compile on the
    #: device, then for a worker slot
    queued_p50: float | None
    queued_p99: float | None
    #: seconds running: from the grant of a worker slot to the run's end in its thread
    running_p50: float | None
    running_p99: float | None
    #: and seconds delivering: from the run's end in its thread to the caller's task
    #: taking the result (waiting for a busy event loop; 0 in the caller's own thread)
    delivering_p50: float | None
    delivering_p99: float | None
    batches: int  #: merged runs (dynamic batching): two requests or more run as one
    batched: int  #: requests answered by those merged runs
    #: Seconds running, summed over every completed request (not only the window's): the
    #: device time they took, a tenant's use of the devices.
    running_seconds: float

    @property
    def finished(self) -> int:
        """Requests that have ended, whatever the outcome."""
        return self.completed + self.failed + self.timed_out + self.cancelled + self.rejected

    def describe_requests(self) -> str:
        """The outcomes and the latencies, for people."""
        latency = ""
        if self.latency_window:
            latency = (f", latency {_ms(self.latency_p50, self.latency_p99)}: queued "
                       f"{_ms(self.queued_p50, self.queued_p99)}, running "
                       f"{_ms(self.running_p50, self.running_p99)}, delivering "
                       f"{_ms(self.delivering_p50, self.delivering_p99)} (last "
                       f"{self.latency_window})")
        batches = ""
        if self.batches:
            batches = (f", {self.batched} in {self.batches} merged batch(es) "
                       f"(mean {self.batched / self.batches:.1f})")
        return (f"{self.completed} completed, {self.failed} failed, {self.timed_out} timed "
                f"out, {self.cancelled} cancelled, {self.rejected} rejected "
                f"({self.in_caller_thread} in the caller's thread{batches}){latency}")


@dataclass(frozen=True, slots=True)
class DeviceStats(RequestFigures):
    """One device actor at one moment (see :meth:`DeviceActor.stats`): every request it
    admitted, whatever the model, and what it holds."""

    device: str
    workers: int  #: requests that may run at once
    running: int  #: slots held now
    queued: int  #: requests waiting for a slot now
    queue_limit: int
    graphs: int  #: compiled graphs held on the device
    compiles: int  #: graphs compiled since the actor started
    warm_ups: int  #: warm-up runs at the runtime's start (not requests: counted only here)
    abandoned_running: int  #: abandoned runs still in a worker thread
    #: Runs a worker thread started on its own as the run before ended (under load: the
    #: slot passed straight to the next queued request, see :mod:`wasinn.actors.slots`).
    passed_on: int = 0
    #: Why the device can run nothing more in this process (see DeviceLostError), or None.
    lost: str | None = None

    def describe(self) -> str:
        """One line for people: the outcomes, the latencies and what the device holds."""
        return (f"{self.device}: {self.describe_requests()}; "
                f"{self.running}/{self.workers} running, {self.queued} queued, "
                f"{self.graphs} graph(s) held, {self.compiles} compiled"
                + (f", {self.warm_ups} warm-up run(s)" if self.warm_ups else "")
                + (f"; LOST: {self.lost}" if self.lost else ""))


@dataclass(frozen=True, slots=True)
class ModelStats(RequestFigures):
    """One model's or pipeline's requests, on every device, since it was loaded (see
    :meth:`wasinn.Graph.stats`)."""

    name: str

    @classmethod
    def of(cls, name: str, requests: RequestStats) -> ModelStats:
        """A snapshot of ``requests``, the stats a model called ``name`` keeps."""
        return cls(**requests.figures(), name=name)

    def describe(self) -> str:
        """One line for people: the model's name, its requests' outcomes and latencies."""
        return f"{self.name}: {self.describe_requests()}"


@dataclass(frozen=True, slots=True)
class TenantStats(RequestFigures):
    """One tenant's requests (a request's ``tenant``; ``""``: those that name none), on
    every device and for every model, since the runtime started (see
    :meth:`wasinn.Runtime.tenant_stats`)."""

    name: str
    #: Its share of a ``fair`` pool's device time (see :meth:`wasinn.Runtime.set_tenant_weight`).
    weight: float

    def describe(self) -> str:
        """One line for people: the tenant, its weight, its device time and requests."""
        return (f"tenant {self.name!r} (weight {self.weight:g}, "
                f"{self.running_seconds:.3f} s running): {self.describe_requests()}")


def _ms(p50: float | None, p99: float | None) -> str:
    return f"p50 {(p50 or 0.0) * 1e3:.2f} ms p99 {(p99 or 0.0) * 1e3:.2f} ms"


#: The RequestFigures fields' stem of each of Latencies' lists, in order.
_STEMS = ("latency", "queued", "running", "delivering")


class Latencies(NamedTuple):
    """The completed requests of a window, each list sorted (seconds)."""

    total: list[float]  #: end to end
    queued: list[float]  #: waiting for the graph's compile, then for a worker slot
    running: list[float]  #: from the slot's grant to the run's end in its thread
    delivering: list[float]  #: from the run's end to the caller's task taking the result

    def figures(self) -> dict[str, Any]:
        """The :class:`RequestFigures` latency fields: the window's size and each
        phase's p50 and p99."""
        figures: dict[str, Any] = {"latency_window": len(self.total)}
        for stem, ordered in zip(_STEMS, self, strict=True):
            figures[f"{stem}_p50"] = percentile(ordered, 0.5)
            figures[f"{stem}_p99"] = percentile(ordered, 0.99)
        return figures


class Account(Protocol):
    """Where a request is counted beside its device's stats: its model's
    :class:`RequestStats`, or its model's and its tenant's
    (:class:`wasinn.scheduler.tenants.TenantAccount`)."""

    def record(self, outcome: Outcome, seconds: float, *, queued: float = 0.0,
               delivering: float = 0.0, leased: bool = False, share: float = 1.0) -> None:
        """One request ended (see :meth:`RequestStats.record`)."""

    def record_batch(self, requests: int) -> None:
        """One merged run answered ``requests`` requests."""


class RequestStats:
    """Outcome counters and a window of recent latencies (see the module docstring)."""

    def __init__(self, window: int = 1024) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(Outcome, 0)
        self._leased = 0
        self._batches = 0
        self._batched = 0
        self._running = 0.0
        #: (total, queued, delivering) seconds of the latest completed requests
        self._latencies: deque[tuple[float, float, float]] = deque(maxlen=window)

    def record(self, outcome: Outcome, seconds: float, *, queued: float = 0.0,
               delivering: float = 0.0, leased: bool = False, share: float = 1.0) -> None:
        """One request ended with ``outcome``, ``seconds`` after it reached the actor, of
        which it spent ``queued`` waiting (for its graph's compile, for a worker slot)
        and ``delivering`` after its run (its result on the way to its caller; see the
        module docstring); the rest is its time running, of which ``share`` was its own
        device time (less than all of it for a merged batch's member, whose run was
        shared: its rows' share), summed in ``running_seconds``. ``leased``: its run
        started in a lease holder's own thread (``in_caller_thread``)."""
        with self._lock:
            self._counts[outcome] += 1
            if leased:
                self._leased += 1
            if outcome is Outcome.COMPLETED:
                self._latencies.append((seconds, queued, delivering))
                self._running += (seconds - queued - delivering) * share

    def record_batch(self, requests: int) -> None:
        """One merged run answered ``requests`` requests (each also ``record``-ed)."""
        with self._lock:
            self._batches += 1
            self._batched += requests

    def record_run(self, seconds: float, *, failed: bool = False, leased: bool = False
                   ) -> None:
        """One run of the model as a pipeline's step, of ``seconds`` (timed in its
        thread), counted as a request of the model (see
        :class:`wasinn.scheduler.pipeline.StepsAccount`): one that raised as failed, one
        that returned as completed, its time in the window's latencies (as a request's
        that neither queued nor waited to be delivered: the chain ran it at once) and in
        ``running_seconds``; ``leased``: run in a lease holder's own thread. Made while a
        :class:`MergedRun` runs in this thread, it is held there until that run's job
        knows how many requests the run answered."""
        held = _HELD.runs
        if held is not None:
            held.append((self, seconds, failed, leased))
            return
        with self._lock:
            if leased:
                self._leased += 1
            if failed:
                self._counts[Outcome.FAILED] += 1
                return
            self._counts[Outcome.COMPLETED] += 1
            self._latencies.append((seconds, 0.0, 0.0))
            self._running += seconds

    def record_merged_run(self, seconds: float, requests: int, *, failed: bool = False,
                          leased: bool = False) -> None:
        """A :meth:`record_run` of a merged run that answered ``requests`` requests (see
        :class:`MergedRun`): they are counted as completed, with the run's latency once
        (one run) and its time in ``running_seconds``. One that answered none (raised,
        or its outputs were thrown away) counts no request, only its time if it returned:
        the device spent it (its own ``running_seconds`` has the whole job)."""
        with self._lock:
            if failed:
                return
            self._running += seconds
            if requests:
                self._counts[Outcome.COMPLETED] += requests
                self._latencies.append((seconds, 0.0, 0.0))
                if leased:
                    self._leased += requests

    def figures(self) -> dict[str, Any]:
        """The :class:`RequestFigures` fields, as keyword arguments for it or a subclass."""
        counts, leased, latencies = self.snapshot()
        with self._lock:
            batches, batched, running_seconds = self._batches, self._batched, self._running
        return {
            "batches": batches, "batched": batched, "running_seconds": running_seconds,
            "completed": counts[Outcome.COMPLETED], "failed": counts[Outcome.FAILED],
            "timed_out": counts[Outcome.TIMED_OUT], "cancelled": counts[Outcome.CANCELLED],
            "rejected": counts[Outcome.REJECTED], "in_caller_thread": leased,
            **latencies.figures(),
        }

    def snapshot(self) -> tuple[dict[Outcome, int], int, Latencies]:
        """(counts per outcome, lease runs, the window's latencies)."""
        with self._lock:
            counts, leased, window = dict(self._counts), self._leased, list(self._latencies)
        return counts, leased, Latencies(
            sorted(total for total, _, _ in window), sorted(queued for _, queued, _ in window),
            sorted(total - queued - delivering for total, queued, delivering in window),
            sorted(delivering for _, _, delivering in window))


class _Held(threading.local):
    """This thread's runs held by the :class:`MergedRun` running there (None: none)."""

    runs: list[tuple[RequestStats, float, bool, bool]] | None = None


_HELD = _Held()


class MergedRun:
    """What one merged run (a batch's rows in one run) records in
    :meth:`RequestStats.record_run` while it runs (a pipeline's chain, each step's run),
    held back until its job knows how many requests it answered: :meth:`answered`
    counts it once. So a step counts the requests each of its runs answered: a
    merged run, those given its rows; a run of one request alone (the probe's, or
    after the merged run failed or could not be split), that request."""

    __slots__ = ("_runs",)

    def __init__(self) -> None:
        self._runs: list[tuple[RequestStats, float, bool, bool]] = []

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """While this block lasts, this thread's :meth:`RequestStats.record_run` calls are
        held here (the block runs the merged run, in its worker thread)."""
        _HELD.runs = self._runs
        try:
            yield
        finally:
            _HELD.runs = None

    def answered(self, requests: int) -> None:
        """Count what was held as a run that answered ``requests`` requests (0: none; see
        :meth:`RequestStats.record_merged_run`). Once: held runs are then forgotten."""
        runs, self._runs = self._runs, []
        for stats, seconds, failed, leased in runs:
            stats.record_merged_run(seconds, requests, failed=failed, leased=leased)


def outcome_of(exc: BaseException) -> Outcome:
    """The outcome of a request that raised ``exc`` (in trio: cancelled is the caller's)."""
    if isinstance(exc, QueueFullError):
        return Outcome.REJECTED
    if isinstance(exc, TimeoutError_):
        return Outcome.TIMED_OUT
    if isinstance(exc, (trio.Cancelled, RequestWithdrawn)):  # (withdrawn: its context
        return Outcome.CANCELLED  # closed while it waited, unrun)
    return Outcome.FAILED


def percentile(ordered: list[float], fraction: float) -> float | None:
    """The nearest-rank percentile (``fraction`` in (0, 1]) of sorted values, or None."""
    if not ordered:
        return None
    rank = math.ceil(round(fraction * len(ordered), 9))
    return ordered[min(max(rank, 1), len(ordered)) - 1]
