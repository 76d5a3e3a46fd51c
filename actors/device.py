"""``DeviceActor``: everything one device owns, and the only way work reaches it.

An actor owns, for one device (``cpu``, ``gpu:0``, ...):

* the compiled graphs run there (:meth:`DeviceActor.session`: compiled lazily at first use,
  once, however many contexts share them; :meth:`DeviceActor.evict` frees them);
* its compile threads (``compile_threads``, 1 by default: a
  :class:`~wasinn.actors.workers.WorkerThreads` of their own), where compiles and
  warm-ups run, that many at a time, in the order they came: never in a worker thread,
  so a graph compiling (seconds, minutes for a big model) keeps no request for another
  graph waiting, however few workers the device has;
* its request queue and ``workers`` persistent worker threads
  (:class:`~wasinn.actors.workers.WorkerThreads`, started by :meth:`DeviceActor.serve` and
  stopped when the actor closes): a job runs in one of them, so the event loop never
  blocks on inference. At most ``workers`` requests hold a slot at once; when every slot
  is busy callers wait in the queue, served in the order the
  :class:`~wasinn.actors.queue.QueuePolicy` chooses (priority, then deadline);
* its device context (a CUDA stream where torch sees the GPU), opened in a worker thread
  before the actor reports ready.

The actor is the front door; the ideas behind it live in modules of their own, which it
composes: :mod:`wasinn.actors.sessioncache` (the compiled graphs),
:mod:`wasinn.actors.runner` (how a request runs once admitted: admission by the caller's
own task, not a dispatcher's, worker threads, inline runs, batches, counting),
:mod:`wasinn.actors.leasedesk` (the leases lent to callers' threads) and
:mod:`wasinn.actors._graph_closer` (evicted graphs whose close blocks). The actor's
``serve`` task only holds the device's lifetime.

Inline runs (``inline_below``, a pool's ``inline_below_us``; 0 = off, the default): an
opt-in, for graphs whose run time is bounded whatever their inputs. Such a run holds the
event loop and nothing can interrupt it; requests with a deadline never run inline (see
:mod:`wasinn.actors.runner` for the risk, :mod:`wasinn.actors.inline` for the timing).

Pinned hand-offs (``pin_handoffs``, a pool's key of the same name; off by default): the
event loop and the worker threads hand jobs to each other on one CPU, which saves the
cross-CPU wake-ups (see :mod:`wasinn.actors.affinity` for the price).

The request methods (:meth:`DeviceActor.execute`, :meth:`DeviceActor.execute_batched`,
the leases) come from :mod:`wasinn.actors._device_requests`, which says how each request
is counted and what cancellation does to it.

A lost device (a CUDA error that leaves the process's CUDA context unusable, see
:mod:`wasinn.actors.devicectx`): the request that hit it fails with DeviceLostError, and
the actor closes itself as if the runtime had closed it, except that every request it
refuses from then on, queued or new, gets that DeviceLostError (:attr:`DeviceActor.lost`)
instead of ClosedResourceError. Placement sends new requests to the kind's other devices.

Closing cancels every running job (worker threads', leases' and the compile threads';
their callers get ClosedResourceError) and waits for them at most ``close_timeout``
seconds. Past it (a backend call that ignores cancellation), an error is logged naming
the device and the jobs still running, and the actor returns anyway: the graphs those
jobs run on are closed only when each job ends (by its daemon thread), and the device
context is left open. A compile that lands all the same, then or later, is closed by its
thread, never cached nor dropped (see :mod:`wasinn.actors.sessioncache`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

import trio

from wasinn.backends.base import CompiledGraph, Device
from wasinn.errors import (
    ClosedResourceError,
    DeviceLostError,
    UnsupportedOperationError,
    WasiNNError,
)

from ._device_requests import DeviceRequests
from ._graph_closer import GraphCloser
from .devicectx import DeviceContext, context_for
from .leasedesk import LeaseDesk
from .queue import PriorityDeadlinePolicy, QueuePolicy
from .runner import RequestRunner
from .session import Session
from .sessioncache import SessionCache
from .slots import Slots
from .stats import DeviceStats, RequestStats
from .workers import WorkerThreads

log = logging.getLogger("wasinn.actors")

#: Threads per device for compiles and warm-ups (jobs that hold no request slot), unless
#: a pool says otherwise (``compile_threads``). One: a compile is heavy on memory (a
#: model's weights, held more than once while the library converts them) and on CPU
#: (graph optimisers, which take the cores running requests use), so two at once on a
#: device would mostly slow each other and the requests down and raise the peak;
#: torch.export archives load one at a time anyway. The price: a device's compiles wait
#: for each other, first come first served, which a runtime preloading many models at
#: start-up, before any request, may prefer to trade.
COMPILE_THREADS = 1


class DeviceActor(DeviceRequests):
    """The owner of one device. Start it with ``await nursery.start(actor.serve)``.
    ``pool``: where the device's pool is configured (``"[pools.cpu]"``; "" for none), which
    a full queue's error names with the ``queue_limit`` to raise."""

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
        compile_threads: int = COMPILE_THREADS,
        pool: str = "",
    ) -> None:
        if workers < 1:
            raise ValueError("workers must be >= 1")
        if compile_threads < 1:
            raise ValueError("compile_threads must be >= 1")
        if not close_timeout >= 0:
            raise ValueError("close_timeout must be >= 0 seconds")
        #: How long closing waits for cancelled jobs to end (seconds) before giving up.
        self.close_timeout = close_timeout
        if not inline_below >= 0:
            raise ValueError("inline_below must be >= 0 seconds")
        self.device = device
        self.workers = workers
        self.queue_limit = queue_limit
        self._threads = WorkerThreads(str(device), workers, pin=pin_handoffs)
        # Its jobs see the loop unpinned (the runner hands them over with pin=False): a
        # pinned pool's compile threads only suspend the loop's pinning while one is out
        # (see wasinn.actors.affinity); the threads themselves are never pinned. Compiles
        # of one graph are one compile however many threads (the session cache's).
        self._compiler = WorkerThreads(str(device), compile_threads, pin=pin_handoffs,
                                       role="compiler")
        self._slots = Slots(str(device), workers, queue_limit,
                            policy if policy is not None else PriorityDeadlinePolicy(), pool)
        #: Requests placed here that wait for their graph to be compiled on this device.
        self.placed = 0
        self._context: DeviceContext | None = None
        self._ready = False
        self._serving = False  # worker threads started and not yet waited for
        self._closed = False
        self._lost: DeviceLostError | None = None
        self._warm_ups = 0
        self._stats = RequestStats()
        self._nursery: trio.Nursery | None = None  # batches' and compiles' tasks, while serving
        self._runner = runner = RequestRunner(str(device), self._threads, self._compiler,
                                              self._slots, self._stats, self._start_task,
                                              inline_below=inline_below)
        self._batcher = runner.batcher
        self._slots.waiting = lambda: self.queued  # (a full queue's error names both)
        self._closer = GraphCloser(device, self._start_task)
        self._cache = SessionCache(
            str(device), self._start_task,
            functools.partial(runner.unslotted, label="compile", failure="compiling failed"),
            self._closer.close_later)
        # The cache's own dict, read here directly: cached_session is on every request's
        # path, which must not pay a call into the cache.
        self._sessions = self._cache.sessions
        self._desk = desk = LeaseDesk(str(device), runner.take_slot,
                                      self._slots.free_from_thread, runner.record,
                                      lambda: self._lost)
        self._unslotted = runner.unslotted
        self._bind_request_paths(runner, desk)

    def __repr__(self) -> str:
        return f"<DeviceActor {self.device} load={self.load} sessions={len(self._sessions)}>"

    # -- lifetime -----------------------------------------------------------------------
    async def serve(self, *, task_status: trio.TaskStatus[DeviceActor] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        """Open the device, start the worker threads and the compile threads, report
        ready, then hold it until cancelled.

        Raises UnsupportedOperationError (before reporting ready) when the device cannot be
        opened. On exit (shielded from cancellation, bounded by ``close_timeout``): queued
        callers get ClosedResourceError, running jobs (compiles and warm-ups included) are
        cancelled, the threads finish them and are joined, and only then are the cached
        graphs and the device context closed (see :meth:`close` and the module docstring
        for jobs that outlive ``close_timeout``).
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
        context.on_lost = self._device_lost
        if type(context) is not DeviceContext:
            self._runner.wrap = context.wrap
            self._batcher.fatal = context.fatal
        self._desk.open(self._runner.wrap)
        self._serving = True
        self._threads.start()
        self._compiler.start()
        self._slots.open()
        self._ready = True
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await self._desk.watch_deadlines(functools.partial(task_status.started, self))
        finally:
            self._nursery = None
            self._desk.stop_watching()
            self.close()
            with trio.CancelScope(shield=True):
                # Threads finish the (cancelled) jobs handed to them, then exit. Only then
                # are the graphs and the device context closed: never under a running
                # job, and never left to a thread the interpreter would kill inside
                # native code at exit. A call that ignores cancellation may never end,
                # so the wait is bounded.
                stragglers = await self._wait_stopped()
            self._serving = False
            if stragglers:
                log.error(
                    "%s: %d job(s) still running %g s after the device closed and "
                    "cancelled them (the backend ignores cancellation): %s; their threads "
                    "are left running, the graphs they use are closed when they end, the "
                    "device context is left open", self.device, len(stragglers),
                    self.close_timeout, "; ".join(stragglers))
            self._release_all(close_context=not stragglers)

    async def _wait_stopped(self) -> list[str]:
        # The worker threads and the compile threads, each for at most close_timeout (at
        # once: neither wait eats into the other's): the jobs still running past it.
        stragglers: list[str] = []

        async def wait(threads: WorkerThreads) -> None:
            stragglers.extend(await threads.wait_stopped(self.close_timeout))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait, self._threads)
            nursery.start_soon(wait, self._compiler)
        return stragglers

    def _open_context(self) -> DeviceContext:
        context = context_for(self.device)
        context.open()
        return context

    def _device_lost(self, error: DeviceLostError) -> None:
        # From the thread whose job found the device lost (see the module docstring):
        # placement avoids it and its slots go to nobody at once (its worker thread would
        # pass its slot on to a queued request as the job ends); the actor closes in trio.
        self._lost = error
        self._slots.refuse()
        self._soon(self._close_lost)

    def _close_lost(self) -> None:
        if not self._closed:
            log.error("%s", self._lost)
            self.close()

    @property
    def lost(self) -> DeviceLostError | None:
        """Why this device can run nothing more in this process, or None while it can."""
        return self._lost

    def _raise_if_lost(self) -> None:
        # A request refused because the actor closed: say why, if the device was lost.
        if self._lost is not None:
            raise self._lost.for_another_caller()

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
        self._runner.close()  # a request granted a slot from now on does not start
        self._cache.close()  # a compile that ends from now on is not cached
        self._threads.stop()  # cancels the jobs running in the worker threads
        self._compiler.stop()  # and the compile or warm-up under way
        self._desk.close()  # cancels the runs of leases
        self._slots.close()
        if not self._serving:
            self._release_all()

    def _release_all(self, *, close_context: bool = True) -> None:
        # Evict every cached graph (a session still used by a job that outlived the close
        # is closed by that job's thread when it ends) and close the device context: only
        # once no worker thread runs a job on it (see close).
        self._cache.clear()
        if self._context is not None and close_context:
            self._context.close()
            self._context = None

    @property
    def inline_below(self) -> float:
        """Jobs of graphs whose runs take less (seconds) may run inline (0 = never)."""
        return self._runner.inline_below

    @inline_below.setter
    def inline_below(self, seconds: float) -> None:
        self._runner.inline_below = seconds

    @property
    def ready(self) -> bool:
        return self._ready and not self._closed

    @property
    def busy(self) -> int:
        """Jobs handed to the device's threads and not finished yet, abandoned ones
        included: runs (worker threads), compiles and warm-ups (its compile threads),
        those waiting for a compile thread included."""
        return self._threads.busy + self._compiler.busy

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
    def context(self) -> DeviceContext | None:
        """The device context its jobs run under (a CUDA stream, the lost-device watch),
        None before the actor has started or after it has stopped (for diagnostics and
        benchmarks: :meth:`DeviceContext.wrap` makes a call run as the actor's jobs do)."""
        return self._context

    @property
    def compiler(self) -> WorkerThreads:
        """The compile threads, where compiles and warm-ups run (for diagnostics and
        tests)."""
        return self._compiler

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
            graphs=len(self._sessions), compiles=self._cache.compiles,
            warm_ups=self._warm_ups,
            abandoned_running=self._threads.abandoned, passed_on=self._threads.passed_on,
            lost=None if self._lost is None else self._lost.message,
        )

    def set_tenant_weight(self, tenant: str, weight: float) -> None:
        """``tenant``'s share of this device's time from now on, where its queue policy
        shares it among tenants (``fair``; ValueError unless ``weight`` is a finite
        number > 0); other policies ignore weights. From any thread."""
        self._slots.set_weight(tenant, weight)

    @property
    def completed(self) -> int:
        """Successful compiles plus slots given back (by requests that ran, failed or not,
        and by those granted a slot that then left without running): a counter that
        moves with any backend work, for tests."""
        return self._cache.compiles + self._slots.released

    # -- compiled graphs ------------------------------------------------------------------
    async def session(self, key: Hashable, compile_graph: Callable[[], CompiledGraph],
                      backend: str, *, wanted: Callable[[], bool] = lambda: True) -> Session:
        """The graph cached under ``key``, compiling it on first use (once, however many
        callers ask at the same time; see :mod:`wasinn.actors.sessioncache`).

        The compile runs in a task of the actor's own (in one of the device's compile
        threads: neither a worker thread nor a request slot, so the device's requests go
        on meanwhile), not in the caller's: a caller cancelled meanwhile (its deadline
        passed) stops waiting at once, and the compile goes on and is cached for the next
        caller, unless its graph is unloaded meanwhile (``wanted()`` false, then
        :meth:`evict`): the compile is then cancelled (a backend that can stop a load
        stops), one that ends all the same is closed, and the callers still waiting get
        ClosedResourceError. A failed compile is not cached: its error reaches every
        caller waiting for it, and a later call tries again. Raises ClosedResourceError
        once the actor is closed (a compile under way is cancelled then, and closed if it
        lands all the same), and RequestWithdrawn (one) at once when the caller's
        :class:`~wasinn.actors.slots.QueueOwner` (its execution context) withdraws it
        while it waits: the compile goes on, as for a caller cancelled.
        """
        try:
            return await self._cache.session(key, compile_graph, backend, wanted=wanted)
        except ClosedResourceError:
            self._raise_if_lost()
            raise

    async def warm_up(self, job: Callable[[], object], *, label: str = "warm-up") -> None:
        """Run ``job`` once in one of the device's compile threads, outside the request
        accounting: it takes no slot and is not a request in :meth:`stats` (only
        ``warm_ups`` counts it).

        For start-up work done before requests are served (see
        :mod:`wasinn.scheduler.warmup`): it finishes what a compile began (a backend's
        first-run work), so it runs where compiles run, in their order, and like them it
        holds neither a slot nor a worker thread: requests (worker threads, callers' own
        threads) may overlap it.
        Raises ClosedResourceError once the actor is closed, BackendRuntimeError for a
        backend's own exception; cancelled, the run is abandoned.
        """
        try:
            await self._unslotted(job, label=label, failure="the backend failed")
        except ClosedResourceError:
            self._raise_if_lost()
            raise
        self._warm_ups += 1

    def cached(self, key: Hashable) -> bool:
        """Whether a compiled graph is cached under ``key``."""
        return key in self._sessions

    def cached_session(self, key: Hashable) -> Session | None:
        """The session cached under ``key``, or None (no compiling)."""
        return self._sessions.get(key)

    def session_keys(self) -> list[Hashable]:
        return list(self._sessions)

    def evict(self, key: Hashable) -> None:
        """Free the graph cached under ``key`` (now, or when its running jobs end), and
        cancel a compile of it under way that is no longer ``wanted`` (see
        :meth:`session`). A graph whose close blocks (a sandboxed one: its processes end)
        is closed in a thread, not on the event loop: :meth:`graphs_closed` waits for
        it."""
        self._cache.evict(key)

    async def graphs_closed(self) -> None:
        """Wait until the graphs evicted so far whose close blocks are closed (at once
        when none is being closed); not for those evicted meanwhile."""
        await self._closer.wait()

    def gathering_ended(self, key: Hashable) -> contextlib.AbstractContextManager[None]:
        """A block while which the batches of graph ``key`` (as :meth:`execute_batched` is
        given it) wait for no more company: those waiting for it now run at once with
        the members they have (see :meth:`Batcher.gathering_ended
        <wasinn.actors._batcher.Batcher.gathering_ended>`). For a graph that nobody can
        send requests to any more (unloaded), whose requests in flight are all it gets."""
        return self._batcher.gathering_ended(key)

    # -- the actor's tasks ----------------------------------------------------------------
    def _start_task(self, fn: Callable[[Any], Awaitable[None]], arg: Any) -> None:
        # A task that lives as long as the actor serves (a batch's, a compile's).
        if self._nursery is None or self._closed:
            raise ClosedResourceError(f"{self.device}: the device actor is closed")
        try:
            self._nursery.start_soon(fn, arg)
        except RuntimeError as exc:  # its nursery closed: serve() is being cancelled
            raise ClosedResourceError(f"{self.device}: the device actor is closing") from exc
