"""``DeviceActor``: everything one device owns, and the only way work reaches it.

An actor owns, for one device (``cpu``, ``gpu:0``, ...):

* the compiled graphs run there (:meth:`DeviceActor.session`: compiled lazily at first use,
  once, however many contexts share them; :meth:`DeviceActor.evict` frees them);
* its request queue and ``workers`` persistent worker threads
  (:class:`~wasinn.actors.workers.WorkerThreads`, started by :meth:`DeviceActor.serve` and
  stopped when the actor closes): a job runs in one of them, so the event loop never
  blocks on inference. At most ``workers`` requests hold a slot at once; when every slot
  is busy callers wait in the queue, served in the order the
  :class:`~wasinn.actors.queue.QueuePolicy` chooses (priority, then deadline);
* its device context (a CUDA stream where torch sees the GPU), opened in a worker thread
  before the actor reports ready.

Admission, not a dispatcher task: a caller whose request is granted a slot hands the job
to the worker threads from its own task, which saves a task switch per request (the
actor's ``serve`` task only holds the device's lifetime). A slot is freed when the worker
thread has finished the job, and the next queued request is granted there.

A caller that runs in a thread of its own (a WebAssembly guest's) may instead take a
:class:`~wasinn.actors.lease.Lease` (:meth:`DeviceActor.lease`): the slot is reserved in
trio as for any request, and the caller's thread runs the job itself (one trio round trip
instead of two plus a thread hand-off).

Inline runs (``inline_below``, a pool's ``inline_below_us``; 0 = off, the default): an
opt-in. A graph whose runs here are timed below that bound (see
:mod:`wasinn.actors.inline`) runs on the trio thread itself when the device is idle and
the request has no deadline, because two thread hand-offs would cost several times the
run. The risk, plainly: the event loop is held for that run and nothing can interrupt
it. The bound is a prediction from past runs, not a limit: a run whose time depends on
its input values (an ONNX Loop's trip count, a dynamic-shape graph fed a larger tensor of
the same byte size...) can hold the loop for seconds, during which no other request,
timeout or cancellation is served. Requests with a deadline are therefore never run
inline. Enable it only for graphs whose run time is bounded whatever their inputs.

Pinned hand-offs (``pin_handoffs``, a pool's key of the same name; off by default): the
event loop and the worker threads hand jobs to each other on one CPU, which saves the
cross-CPU wake-ups (see :mod:`wasinn.actors.affinity` for the price).

Dynamic batching (:meth:`DeviceActor.execute_batched`, :mod:`wasinn.actors.batching`):
requests for one graph that wait for this device at the same time run as one merged job;
each batch is a task in the actor's nursery, living no longer than the actor.

Every request the actor admits is counted by how it ended, with its latency (see
:mod:`wasinn.actors.stats`; :meth:`DeviceActor.stats` reads it).

Cancellation: a caller cancelled while queued is removed from the queue and never runs;
cancelled while running (or past its deadline), its job is abandoned: the job's
:class:`~wasinn.backends.base.Cancellation` is cancelled, which ends an ONNX Runtime or
OpenVINO run within milliseconds (a torch run goes on to its end), the result is dropped,
and the worker thread keeps the job's slot until the backend call has returned, so a
device never runs more than ``workers`` jobs. A job's exception fails that request only.

Closing cancels every running job (worker threads' and leases'; their callers get
ClosedResourceError) and waits for them at most ``close_timeout`` seconds. Past it (a
backend call that ignores cancellation), an error is logged naming the device and the
jobs still running, and the actor returns anyway: the graphs those jobs run on are closed
only when each job ends (by its daemon thread), and the device context is left open.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import itertools
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, TypeVar

import trio

from wasinn.backends.base import Cancellation, CompiledGraph, Device
from wasinn.errors import (
    BackendRuntimeError,
    ClosedResourceError,
    TimeoutError_,
    UnsupportedOperationError,
    WasiNNError,
)
from wasinn.tensor import Tensor

from .batching import Batcher, Batching, BatchInputs, RunInputs
from .devicectx import DeviceContext, context_for
from .inline import RunProfile
from .jobs import Wrap, backend_failure, in_context
from .lease import Lease
from .queue import PriorityDeadlinePolicy, QueuePolicy, Request
from .session import Session
from .slots import Slots
from .stats import DeviceStats, Outcome, RequestStats, outcome_of
from .workers import WorkerThreads

T = TypeVar("T")

#: Deadline heap size from which finished leases are dropped when they are most of it.
_COMPACT_AT = 64

log = logging.getLogger("wasinn.actors")


class _Compiling:
    """A compile in progress: callers wait on ``done``; ``error`` says how it failed."""

    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.error: WasiNNError | None = None


class DeviceActor:
    """The owner of one device. Start it with ``await nursery.start(actor.serve)``."""

    def __init__(
        self,
        device: Device,
        *,
        workers: int = 1,
        queue_limit: int = 1024,
        policy: QueuePolicy | None = None,
        inline_below: float = 0.0,
        close_timeout: float = 10.0,
        pin_handoffs: bool = False,
    ) -> None:
        if workers < 1:
            raise ValueError("workers must be >= 1")
        if not close_timeout >= 0:
            raise ValueError("close_timeout must be >= 0 seconds")
        #: How long closing waits for cancelled jobs to end (seconds) before giving up.
        self.close_timeout = close_timeout
        if not inline_below >= 0:
            raise ValueError("inline_below must be >= 0 seconds")
        #: Jobs of graphs whose runs take less (seconds) may run inline (0 = never).
        self.inline_below = inline_below
        self.device = device
        self.workers = workers
        self.queue_limit = queue_limit
        self._threads = WorkerThreads(str(device), workers, pin=pin_handoffs)
        self._slots = Slots(str(device), workers, queue_limit,
                            policy if policy is not None else PriorityDeadlinePolicy())
        #: Requests placed here that wait for their graph to be compiled on this device.
        self.placed = 0
        self._sessions: dict[Hashable, Session] = {}
        self._compiling: dict[Hashable, _Compiling] = {}
        self._context: DeviceContext | None = None
        self._wrap: Wrap | None = None
        self._ready = False
        self._serving = False  # worker threads started and not yet waited for
        self._closed = False
        self._compiles = 0
        self._warm_ups = 0
        self._leases_lock = threading.Lock()
        self._leases: set[Cancellation] = set()  # runs of leases in progress
        # Leases with a deadline, as a heap of (deadline in trio time, tie-break, lease):
        # one task stops those still running when theirs passes (see _watch_deadlines).
        self._deadlines: list[tuple[float, int, Lease[Any]]] = []
        self._deadline_ids = itertools.count()
        self._earlier_deadline: trio.Event | None = None  # set: the heap's head changed
        self._token: trio.lowlevel.TrioToken | None = None
        self._stats = RequestStats()
        self._nursery: trio.Nursery | None = None  # the batches' tasks, while serving
        self._batcher = Batcher(str(device), self._take_batch_slot, self._slots.requeue,
                                self._slots.free, self._run_in_slot, self._start_task,
                                self._stats)

    def __repr__(self) -> str:
        return f"<DeviceActor {self.device} load={self.load} sessions={len(self._sessions)}>"

    # -- lifetime -----------------------------------------------------------------------
    async def serve(self, *, task_status: trio.TaskStatus[DeviceActor] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        """Open the device, start the worker threads, report ready, then hold it until
        cancelled.

        Raises UnsupportedOperationError (before reporting ready) when the device cannot be
        opened. On exit (shielded from cancellation, bounded by ``close_timeout``): queued
        callers get ClosedResourceError, running jobs are cancelled, the worker threads
        finish them and are joined, and only then are the cached graphs and the device
        context closed (see :meth:`close` and the module docstring for jobs that outlive
        ``close_timeout``).
        """
        try:
            # In a worker thread: finding out what the device needs may import torch.
            context = await trio.to_thread.run_sync(self._open_context)
        except WasiNNError:
            raise
        except Exception as exc:
            raise UnsupportedOperationError(f"{self.device}: cannot open the device: {exc}"
                                            ) from exc
        self._context = context
        if type(context) is not DeviceContext:
            self._wrap = context.wrap
        self._serving = True
        self._threads.start()
        self._slots.open()
        self._ready = True
        self._token = trio.lowlevel.current_trio_token()
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await self._watch_deadlines(task_status)
        finally:
            self._nursery = None
            self._earlier_deadline = None
            self._deadlines.clear()
            self.close()
            with trio.CancelScope(shield=True):
                # Threads finish the (cancelled) jobs handed to them, then exit. Only then
                # are the graphs and the device context closed: never under a running
                # job, and never left to a thread the interpreter would kill inside
                # native code at exit. A call that ignores cancellation may never end,
                # so the wait is bounded.
                stragglers = await self._threads.wait_stopped(self.close_timeout)
            self._serving = False
            if stragglers:
                log.error(
                    "%s: %d job(s) still running %g s after the device closed and "
                    "cancelled them (the backend ignores cancellation): %s; their threads "
                    "are left running, the graphs they use are closed when they end, the "
                    "device context is left open", self.device, len(stragglers),
                    self.close_timeout, "; ".join(stragglers))
            self._release_all(close_context=not stragglers)

    def _open_context(self) -> DeviceContext:
        context = context_for(self.device)
        context.open()
        return context

    def close(self) -> None:
        """Stop serving: fail queued requests and refuse new ones, tell the worker threads
        to exit once the jobs already handed to them are done. Idempotent.

        The cached graphs and the device context are freed once no job can be running
        on them: here when the actor is not serving, otherwise when :meth:`serve` exits,
        after it has waited for every worker thread (abandoned jobs included) and joined
        it. A graph a caller's own thread still runs (a lease) is closed when that run
        ends (see :class:`~wasinn.actors.session.Session`).
        """
        if self._closed:
            return
        self._closed = True
        self._threads.stop()  # cancels the jobs running in the worker threads
        with self._leases_lock:
            leases = list(self._leases)
        for cancellation in leases:
            cancellation.cancel()
        self._slots.close()
        if not self._serving:
            self._release_all()

    def _release_all(self, *, close_context: bool = True) -> None:
        # Evict every cached graph (a session still used by a job that outlived the close
        # is closed by that job's thread when it ends) and close the device context: only
        # once no worker thread runs a job on it (see close).
        for key in list(self._sessions):
            self.evict(key)
        if self._context is not None and close_context:
            self._context.close()
            self._context = None

    @property
    def ready(self) -> bool:
        return self._ready and not self._closed

    @property
    def busy(self) -> int:
        """Jobs (runs and compiles) handed to the worker threads and not finished yet,
        abandoned ones included."""
        return self._threads.busy

    @property
    def pins_handoffs(self) -> bool:
        """Whether this actor's runs are handed off on the event loop's CPU (see
        :mod:`wasinn.actors.affinity`)."""
        return self._threads.pin

    @property
    def threads(self) -> WorkerThreads:
        """The worker threads (for diagnostics and tests)."""
        return self._threads

    @property
    def load(self) -> int:
        """Running, queued and placed (waiting for a compile) requests: what placement
        compares."""
        return self._slots.running + self.queued + self.placed

    @property
    def queued(self) -> int:
        """Requests waiting to start: in the queue, or in a batch that has not started."""
        batcher = self._batcher
        return self._slots.queued - batcher.queued_batches + batcher.waiting

    def slot_free(self) -> bool:
        """Whether a request made now would take a slot at once (one free, nobody
        queued)."""
        return self._slots.would_take()

    def stats(self) -> DeviceStats:
        """What this actor holds and has done so far (see :mod:`wasinn.actors.stats`)."""
        return DeviceStats(
            **self._stats.figures(),
            device=str(self.device), workers=self.workers, running=self._slots.running,
            queued=self.queued, queue_limit=self.queue_limit,
            graphs=len(self._sessions), compiles=self._compiles, warm_ups=self._warm_ups,
            abandoned_running=self._threads.abandoned,
        )

    @property
    def completed(self) -> int:
        """Successful compiles plus slots given back (by requests that ran, failed or not,
        and by those granted a slot that then left without running): a counter that
        moves with any backend work, for tests."""
        return self._compiles + self._slots.released

    # -- compiled graphs ------------------------------------------------------------------
    async def session(self, key: Hashable, compile_graph: Callable[[], CompiledGraph],
                      backend: str, *, wanted: Callable[[], bool] = lambda: True) -> Session:
        """The graph cached under ``key``, compiling it on first use (once, however many
        callers ask at the same time).

        The compile runs in a task of the actor's own (a worker thread, no request slot),
        not in the caller's: a caller cancelled meanwhile (its deadline passed) stops
        waiting at once, and the compile goes on and is cached for the next caller,
        unless ``wanted()`` is false once it ends (its graph was unloaded meanwhile: it
        is closed, and the callers still waiting get ClosedResourceError). A failed
        compile is not cached: its error reaches every caller waiting for it, and a later
        call tries again. Raises ClosedResourceError once the actor is closed (a compile
        under way is abandoned then).
        """
        while True:
            session = self._sessions.get(key)
            if session is not None:
                return session
            pending = self._compiling.get(key)
            if pending is None:
                pending = self._compiling[key] = _Compiling()
                try:
                    self._start_task(self._compile_task,
                                     (key, pending, compile_graph, backend, wanted))
                except ClosedResourceError:
                    del self._compiling[key]
                    raise
            await pending.done.wait()
            if pending.error is not None:  # this caller's own error, the compile's as cause
                raise pending.error.for_another_caller()

    async def _compile_task(self, job: tuple[Hashable, _Compiling,
                                             Callable[[], CompiledGraph], str,
                                             Callable[[], bool]]) -> None:
        # In the actor's nursery: compile, cache, tell the waiting callers.
        key, pending, compile_graph, backend, wanted = job

        def compile_if_wanted() -> CompiledGraph:
            # Checked again once a worker thread is free (``wanted`` reads a flag: safe
            # from any thread): callers that keep giving up while others compile must
            # not leave a compile queued for each of them.
            if not wanted():
                raise ClosedResourceError(
                    f"{self.device}: the graph was unloaded before it compiled")
            return compile_graph()

        try:
            compiled = await self._unslotted(compile_if_wanted, label="compile",
                                             failure="compiling failed")
            self._compiles += 1
            session = Session(compiled, backend)
            if self._closed:
                session.evict()
                raise ClosedResourceError(f"{self.device}: the device actor is closed")
            if not wanted():
                session.evict()
                raise ClosedResourceError(
                    f"{self.device}: the graph was unloaded while it compiled")
            self._sessions[key] = session
        except WasiNNError as exc:
            pending.error = exc
        except trio.Cancelled:  # the actor is closing: the compile is abandoned
            pending.error = ClosedResourceError(
                f"{self.device}: the device actor closed while the graph compiled")
            raise
        finally:
            del self._compiling[key]
            pending.done.set()

    async def warm_up(self, job: Callable[[], object], *, label: str = "warm-up") -> None:
        """Run ``job`` once in a worker thread, outside the request accounting: it takes
        no slot and is not a request in :meth:`stats` (only ``warm_ups`` counts it).

        For start-up work done before requests are served (see
        :mod:`wasinn.scheduler.warmup`): like a compile, it takes one of the worker
        threads but no slot, so a run in a caller's own thread (a lease) may overlap it.
        Raises ClosedResourceError once the actor is closed, BackendRuntimeError for a
        backend's own exception; cancelled, the run is abandoned.
        """
        await self._unslotted(job, label=label, failure="the backend failed")
        self._warm_ups += 1

    async def _unslotted(self, job: Callable[[], T], *, label: str, failure: str) -> T:
        # A job in one of the worker threads that holds no request slot.
        work = in_context(job, self._wrap)
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            return await self._threads.run(work, label=label, pin=False)
        except WasiNNError:
            raise
        except Exception as exc:
            raise BackendRuntimeError(
                f"{self.device}: {failure}: {type(exc).__name__}: {exc}"
            ) from exc

    def cached(self, key: Hashable) -> bool:
        """Whether a compiled graph is cached under ``key``."""
        return key in self._sessions

    def cached_session(self, key: Hashable) -> Session | None:
        """The session cached under ``key``, or None (no compiling)."""
        return self._sessions.get(key)

    def session_keys(self) -> list[Hashable]:
        return list(self._sessions)

    def evict(self, key: Hashable) -> None:
        """Free the graph cached under ``key`` (now, or when its running jobs end)."""
        session = self._sessions.pop(key, None)
        if session is not None:
            session.evict()

    # -- running work ---------------------------------------------------------------------
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
        account: RequestStats | None = None,
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
        the device's stats and, when given, in ``account`` too (its model's).
        """
        return await self._counted(account, self._request, job, priority, deadline, tenant,
                                   profile, nbytes, label)

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
        account: RequestStats | None = None,
    ) -> dict[str, Tensor]:
        """``run(inputs, keep_on_device)`` here, merged with other requests for the same
        ``key`` (a graph on this device) as ``batching`` allows (see
        :mod:`wasinn.actors.batching`): outputs of a merged run are host tensors.

        Same errors, deadline, cancellation and accounting as :meth:`execute`; a request
        that runs alone (a free slot with nobody queued and no ``max_delay``, or more rows
        than ``max_batch``) runs exactly as :meth:`execute` runs it.
        """
        return await self._counted(account, self._batched, key, inputs, run, batching,
                                   keep_on_device, priority, deadline, tenant, label,
                                   account)

    async def _counted(self, account: RequestStats | None,
                       request: Callable[..., Awaitable[tuple[T, float]]], *args: Any) -> T:
        # ``request(*args)``, counted (device and ``account``) by how it ended, with its
        # latency. (Arguments, not a partial: this is on every request's path.)
        start = time.perf_counter()
        try:
            result, granted = await request(*args)
        except BaseException as exc:
            self._record(account, outcome_of(exc), time.perf_counter() - start)
            raise
        self._record(account, Outcome.COMPLETED, time.perf_counter() - start,
                     queued=granted - start)
        return result

    async def _batched(self, key: Hashable, inputs: BatchInputs, run: RunInputs,
                       batching: Batching, keep: bool, priority: int, deadline: float,
                       tenant: str, label: str, account: RequestStats | None
                       ) -> tuple[dict[str, Tensor], float]:
        job = functools.partial(run, inputs.tensors, keep)
        await trio.lowlevel.checkpoint_if_cancelled()
        if inputs.rows >= batching.max_batch:  # a batch of its own already
            return await self._request(job, priority, deadline, tenant, None, None, label)
        if (not batching.max_delay and not self._closed and trio.current_time() < deadline
                and self._slots.try_take()):
            # Nobody to share a run with: run now, as a plain request.
            granted = time.perf_counter()
            return await self._within(deadline, self._run_in_slot, job, label), granted
        if self._closed:
            raise ClosedResourceError(f"{self.device}: the device actor is closed")
        return await self._within(
            deadline, functools.partial(
                self._batcher.submit, key, inputs, keep, run, batching, priority=priority,
                deadline=deadline, tenant=tenant, label=label, account=account))

    def _start_task(self, fn: Callable[[Any], Awaitable[None]], arg: Any) -> None:
        # A task that lives as long as the actor serves (a batch's).
        if self._nursery is None or self._closed:
            raise ClosedResourceError(f"{self.device}: the device actor is closed")
        try:
            self._nursery.start_soon(fn, arg)
        except RuntimeError as exc:  # its nursery closed: serve() is being cancelled
            raise ClosedResourceError(f"{self.device}: the device actor is closing") from exc

    def record_unqueued(self, account: RequestStats | None, exc: BaseException,
                        seconds: float) -> None:
        """Count a request placed on this device that ended with ``exc`` before it
        reached the queue (while it waited for its graph to compile here), as
        :meth:`execute` counts one that ends in it."""
        self._record(account, outcome_of(exc), seconds)

    def _record(self, account: RequestStats | None, outcome: Outcome, seconds: float, *,
                queued: float = 0.0, leased: bool = False) -> None:
        self._stats.record(outcome, seconds, queued=queued, leased=leased)
        if account is not None:
            account.record(outcome, seconds, queued=queued, leased=leased)

    async def _request(self, job: Callable[[], T], priority: int, deadline: float,
                       tenant: str, profile: RunProfile | None, nbytes: int | None,
                       label: str) -> tuple[T, float]:
        # The job's result, and when (perf_counter) it was granted a slot.
        if profile is not None and self.inline_below and nbytes is not None:
            # A run's time can depend on its input values (an ONNX Loop's trip count),
            # not only on their size: a request that must end by a deadline always goes
            # to a worker thread, where it can be abandoned when the deadline passes.
            if (profile.qualifies(nbytes, self.inline_below) and not self._threads.busy
                    and deadline == math.inf
                    and trio.current_effective_deadline() == math.inf
                    and await self._take_idle_slot()):
                granted = time.perf_counter()
                return await self._run_inline(job, profile, nbytes), granted
            job = self._timed(job, profile, nbytes)
        if deadline == math.inf:  # (the common case, without _within's frame)
            return await self._execute(job, priority, deadline, tenant, label)
        return await self._within(deadline, self._execute, job, priority, deadline, tenant,
                                  label)

    async def _within(self, deadline: float, request: Callable[..., Awaitable[T]],
                      *args: Any) -> T:
        # ``request(*args)``, or TimeoutError_ once ``deadline`` (trio time) passes.
        if deadline == math.inf:
            return await request(*args)
        with trio.move_on_at(deadline) as scope:
            return await request(*args)
        assert scope.cancelled_caught
        raise TimeoutError_(f"{self.device}: the request's deadline passed before it finished")

    async def _execute(self, job: Callable[[], T], priority: int, deadline: float,
                       tenant: str, label: str) -> tuple[T, float]:
        await self._take_slot(priority, deadline, tenant)
        granted = time.perf_counter()
        return await self._run_in_slot(job, label), granted

    async def _run_in_slot(self, job: Callable[[], T], label: str) -> T:
        # On a held slot, which is freed when the worker thread has finished the job
        # (abandoned or not).
        work = in_context(job, self._wrap)
        try:
            return await self._threads.run(work, on_done=self._slots.free, label=label)
        except WasiNNError:
            raise
        except Exception as exc:
            raise backend_failure(self.device, exc) from exc

    def _timed(self, job: Callable[[], T], profile: RunProfile, nbytes: int
                ) -> Callable[[], T]:
        bound = self.inline_below

        def timed() -> T:  # in a worker thread
            start = time.perf_counter()
            result = job()
            # Only runs that succeeded: a bad request can fail at once whatever the
            # graph's real run time, and must not make a slow graph look tiny.
            profile.observe(time.perf_counter() - start, nbytes, bound)
            return result

        return timed

    async def _take_idle_slot(self) -> bool:
        # A slot for an inline run: only when the device is idle (nothing running, nobody
        # queued), so that the run overtakes nobody; it counts against the workers bound.
        await trio.lowlevel.checkpoint_if_cancelled()
        return not self._closed and self._slots.try_take_idle()

    async def _run_inline(self, job: Callable[[], T], profile: RunProfile, nbytes: int) -> T:
        # On the trio thread, holding an idle slot: run, time it, free the slot, then
        # yield to the other tasks so that a stream of tiny requests cannot starve them.
        work = in_context(job, self._wrap)
        start = time.perf_counter()
        try:
            result = work()
        except WasiNNError:
            raise
        except Exception as exc:
            raise backend_failure(self.device, exc) from exc
        finally:
            self._slots.free()
        profile.observe(time.perf_counter() - start, nbytes, self.inline_below)
        await trio.lowlevel.cancel_shielded_checkpoint()
        return result

    async def lease(
        self,
        job: Callable[[], T],
        *,
        priority: int = 0,
        deadline: float = math.inf,
        tenant: str = "",
        account: RequestStats | None = None,
    ) -> Lease[T]:
        """Reserve a worker slot for ``job``, to be run by the caller's own thread.

        Waits in the queue like :meth:`execute` (same errors while waiting: ClosedResourceError,
        TooLargeError, TimeoutError_ when ``deadline`` passes first); returns once the slot
        is held. Cancelled while queued, the request is removed. The holder must call
        :meth:`Lease.run` (from a thread that is not trio's) or :meth:`Lease.cancel`; a run
        still going when ``deadline`` passes is stopped (see :meth:`Lease.interrupt`) and
        raises TimeoutError_ there. ``account``: as in :meth:`execute`.
        """
        start = time.perf_counter()
        try:
            expires = await self._lease_slot(priority, deadline, tenant)
        except BaseException as exc:
            self._record(account, outcome_of(exc), time.perf_counter() - start, leased=True)
            raise
        lease = self._new_lease(job, expires, start, time.perf_counter(), account)
        if deadline != math.inf:
            self._watch(lease, deadline)
        return lease

    async def _lease_slot(self, priority: int, deadline: float, tenant: str) -> float:
        # A slot for a lease; returns when its run expires (perf_counter; inf: never).
        if deadline == math.inf:
            await self._take_slot(priority, deadline, tenant)
            return math.inf
        with trio.move_on_at(deadline) as scope:
            await self._take_slot(priority, deadline, tenant)
        if scope.cancelled_caught:
            raise TimeoutError_(f"{self.device}: the request's deadline passed before it started")
        return time.perf_counter() + (deadline - trio.current_time())

    def try_lease(self, job: Callable[[], T], *, timeout: float | None = None,
                  account: RequestStats | None = None) -> Lease[T] | None:
        """A lease on a free slot, taken from any thread without waiting for trio, or None
        when every slot is busy, a request is queued (it must not be overtaken), or the
        actor is not serving: then use :meth:`lease` through trio.

        ``timeout`` (seconds) bounds the run as ``deadline`` does in :meth:`lease`;
        ``account``: as in :meth:`execute`.
        """
        if not self._slots.try_take():
            return None
        start = time.perf_counter()
        if timeout is None or timeout == math.inf:
            return self._new_lease(job, math.inf, start, start, account)
        lease = self._new_lease(job, start + timeout, start, start, account)
        self._soon(self._watch, lease, None)
        return lease

    @property
    def watched_leases(self) -> int:
        """Leases whose deadline is being watched, finished ones not yet dropped included:
        fewer than 64, or about twice the running ones once there are more."""
        return len(self._deadlines)

    def _watch(self, lease: Lease[Any], deadline: float | None) -> None:
        # In trio: have _watch_deadlines stop the lease's run when its deadline (trio
        # time; None: from its perf_counter expiry) passes first.
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

    async def _watch_deadlines(self, task_status: trio.TaskStatus[DeviceActor]) -> None:
        # Runs while the actor serves: sleeps until the earliest deadline (or until an
        # earlier one is added), then stops every lease whose deadline has passed.
        heap = self._deadlines
        self._earlier_deadline = trio.Event()
        task_status.started(self)
        while True:
            with trio.move_on_at(heap[0][0] if heap else math.inf):
                await self._earlier_deadline.wait()
            self._earlier_deadline = trio.Event()
            now = trio.current_time()
            while heap and heap[0][0] <= now:
                heapq.heappop(heap)[2].interrupt(deadline=True)  # a no-op once over

    def _new_lease(self, job: Callable[[], T], expires: float, start: float, granted: float,
                   account: RequestStats | None) -> Lease[T]:
        # A lease's run is cancelled if the actor closes meanwhile (see close). ``start``
        # and ``granted``: when the request reached the actor and when it got its slot
        # (perf_counter), for its latency.
        cancellation = Cancellation()
        with self._leases_lock:
            self._leases.add(cancellation)
            closed = self._closed
        if closed:  # closed between the slot and now: the run fails at once
            cancellation.cancel()
        return Lease(str(self.device), job, self._wrap,
                     functools.partial(self._lease_done, cancellation, account, start,
                                       granted - start),
                     expires,
                     cancellation,
                     self._soon)

    def _soon(self, call: Callable[..., object], *args: object) -> None:
        # From any thread, even inside a collection: ``call(*args)`` in trio (trio's entry
        # queue takes a reentrant lock); dropped if trio has ended (nothing is left to
        # watch or free: nobody closes the actor any more).
        token = self._token
        if token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(call, *args)

    def _lease_done(self, cancellation: Cancellation, account: RequestStats | None,
                    start: float, queued: float, outcome: Outcome) -> None:
        # From the lease holder's thread: forget the run, give its slot back, count it.
        with self._leases_lock:
            self._leases.discard(cancellation)
        self._slots.free_from_thread()
        self._record(account, outcome, time.perf_counter() - start, queued=queued,
                     leased=True)

    async def _take_slot(self, priority: int, deadline: float, tenant: str, *,
                         request: Request | None = None) -> None:
        await self._slots.take(priority, deadline, tenant, request=request)
        if self._closed:  # closed between the grant and now: nothing may start any more
            self._slots.free()
            raise ClosedResourceError(f"{self.device}: the device actor is closed")

    async def _take_batch_slot(self, request: Request) -> None:
        # A batch waits in the queue as ``request``, whose terms change as members leave.
        await self._take_slot(request.priority, request.deadline, request.tenant,
                              request=request)
