"""``RequestRunner``: how a request runs on one device once it reaches the actor.

Admission, not a dispatcher task: a caller whose request is granted one of the device's
slots (:class:`~wasinn.actors.slots.Slots`) hands the job to the worker threads
(:class:`~wasinn.actors.workers.WorkerThreads`) from its own task, which saves a task
switch per request. A request that has to queue brings its job prepared, so that the
worker thread that frees a slot grants it to the next queued request and starts that
request's job itself (see :mod:`wasinn.actors.slots`); otherwise a slot is freed when
trio has taken the worker thread's result (abandoned or not), and the next queued
request is granted there. A request with a
deadline runs within it: queued, it leaves the queue; running, its job is abandoned
(TimeoutError_ either way).

Inline runs (the actor's ``inline_below``; 0 = off, the default): a graph whose runs here
are timed below that bound (see :mod:`wasinn.actors.inline`) runs on the trio thread
itself when the device is idle and the request has no deadline, because two thread
hand-offs would cost several times the run. The risk, plainly: the event loop is held for
that run and nothing can interrupt it. The bound is a prediction from past runs, not a
limit: a run whose time depends on its input values (an ONNX Loop's trip count, a
dynamic-shape graph fed a larger tensor of the same byte size...) can hold the loop for
seconds, during which no other request, timeout or cancellation is served. Requests with
a deadline are therefore never run inline. Enable it only for graphs whose run time is
bounded whatever their inputs.

Batched requests go to the :class:`~wasinn.actors.batching.Batcher` unless they would
run alone anyway. Every request is counted (device and model stats, see
:mod:`wasinn.actors.stats`) by how it ended, with its latency.

Everything here runs in trio. The actor binds the methods on its request paths once
(``execute`` calls :meth:`RequestRunner.counted` with :meth:`RequestRunner.request`
directly), so going through the runner costs no call per request.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, TypeVar

import trio

from wasinn.errors import BackendRuntimeError, ClosedResourceError, TimeoutError_, WasiNNError
from wasinn.tensor import Tensor

from .batching import Batcher, Batching, BatchInputs, RunInputs
from .inline import RunProfile
from .jobs import Wrap, backend_failure, in_context
from .queue import Request
from .slots import Slots, requested
from .stats import Account, Outcome, RequestStats, outcome_of
from .workers import Job, WorkerThreads

T = TypeVar("T")


class RequestRunner:
    """The request paths of one device (see the module docstring).

    ``threads`` run the requests; ``compiler`` runs the jobs that hold no slot (compiles,
    warm-ups: see :meth:`unslotted`). ``start_task`` runs a task as long as the actor
    serves (a batch's). ``inline_below``: jobs of graphs whose runs take less (seconds)
    may run inline (0 = never).
    """

    def __init__(self, device: str, threads: WorkerThreads, compiler: WorkerThreads,
                 slots: Slots, stats: RequestStats,
                 start_task: Callable[[Callable[[Any], Awaitable[None]], Any], None], *,
                 inline_below: float) -> None:
        self.device = device
        self.inline_below = inline_below
        #: The device context's wrapper, once the device is open (None: none needed).
        self.wrap: Wrap | None = None
        self._threads = threads
        self._compiler = compiler
        self._slots = slots
        self._stats = stats
        #: Whether runs are timed and charged to their tenant (a fair queue policy).
        self._charges = slots.charges
        self._closed = False
        self.batcher = Batcher(device, self._take_batch_slot, slots.requeue, slots.free,
                               self.run_in_slot, start_task, stats, idle_slot=slots.idle)

    def close(self) -> None:
        """Start nothing more: a request granted a slot from now on, or that would run
        inline or alone beside a batch, gets ClosedResourceError (the slots and the
        threads are closed by the actor)."""
        self._closed = True

    # -- counting ---------------------------------------------------------------------------
    async def counted(self, account: Account | None, reached: float | None,
                      request: Callable[..., Awaitable[tuple[T, float, float, float]]],
                      *args: Any) -> T:
        """``request(*args)``, counted (device and ``account``) by how it ended, with its
        latency; ``request`` returns its result, when (perf_counter) it was granted its
        slot and when its run ended (stamped by its worker thread; inf: not known, taken
        to be now), and its share of the run's device time (1, but for a merged batch's
        member). The latency and the time queued run from ``reached`` (perf_counter):
        when the request reached the device, before it waited there for its graph's
        compile; None: now.

        The latency is split in three phases that add up to it: queued, until the grant;
        running, from the grant to the run's end; delivering, from the run's end to now,
        as this task takes the result: the wait for the event loop (busy with other
        tasks, or held by a run that keeps the GIL) to get round to it, which an
        inline run's yield to the other tasks is too. Under load a worker thread grants
        the slot to the next request as a run ends and starts that request's run at
        once (see :mod:`wasinn.actors.workers`), before trio learns of either: the run's
        end and the next grant come from the thread's stamp, not from when trio got
        round to them. So a busy loop's late pick-up counts as delivering, neither as
        queued (a saturated device) nor as running (a slow model); each request's
        running time is its own run's, and no run is counted for two requests (in the
        device time its model and its tenant are charged)."""
        # (Arguments, not a partial: this is on every request's path.)
        start = time.perf_counter() if reached is None else reached
        try:
            result, granted, ended, share = await request(*args)
        except BaseException as exc:
            self.record(account, outcome_of(exc), time.perf_counter() - start)
            raise
        end = time.perf_counter()
        self.record(account, Outcome.COMPLETED, end - start, queued=granted - start,
                    delivering=end - ended if ended < end else 0.0,  # (inf: not known)
                    share=share)
        return result

    def record(self, account: Account | None, outcome: Outcome, seconds: float, *,
               queued: float = 0.0, delivering: float = 0.0, leased: bool = False,
               share: float = 1.0) -> None:
        """Count one request in the device's stats, and in ``account`` when given (from
        any thread); ``queued`` and ``delivering``: the phases of its ``seconds`` before
        and after its run (see :meth:`counted`); ``share``: the part of its running time
        that was its own device time (a merged batch's member's rows' share)."""
        self._stats.record(outcome, seconds, queued=queued, delivering=delivering,
                           leased=leased, share=share)
        if account is not None:
            account.record(outcome, seconds, queued=queued, delivering=delivering,
                           leased=leased, share=share)

    # -- one request --------------------------------------------------------------------------
    async def request(self, job: Callable[[], T], priority: int, deadline: float,
                      tenant: str, profile: RunProfile | None, nbytes: int | None,
                      label: str) -> tuple[T, float, float, float]:
        """The job's result, when (perf_counter) it was granted a slot and when its run
        ended (see :meth:`counted`), and its share of the run (1: its own): run inline or
        in a worker thread, within ``deadline``."""
        if profile is not None and self.inline_below and nbytes is not None:
            # A run's time can depend on its input values (an ONNX Loop's trip count),
            # not only on their size: a request that must end by a deadline always goes
            # to a worker thread, where it can be abandoned when the deadline passes.
            if (profile.qualifies(nbytes, self.inline_below) and not self._threads.busy
                    and deadline == math.inf
                    and trio.current_effective_deadline() == math.inf
                    and await self._take_idle_slot()):
                granted = time.perf_counter()
                result, ended = await self._run_inline(job, profile, nbytes, tenant)
                return result, granted, ended, 1.0
            job = self._timed(job, profile, nbytes)
        if deadline == math.inf:  # (the common case, without _within's frame)
            return await self._execute(job, priority, deadline, tenant, label)
        return await self._within(deadline, label, self._execute, job, priority, deadline,
                                  tenant, label)

    async def _within(self, deadline: float, label: str,
                      request: Callable[..., Awaitable[T]], *args: Any) -> T:
        # ``request(*args)``, or TimeoutError_ once ``deadline`` (trio time) passes, named
        # by ``label`` (the request's run: "run of resnet (onnxruntime)").
        if deadline == math.inf:
            return await request(*args)
        with trio.move_on_at(deadline) as scope:
            return await request(*args)
        assert scope.cancelled_caught
        raise TimeoutError_(f"{requested(label, self.device)}: the request's deadline "
                            "passed before it finished")

    async def _execute(self, job: Callable[[], T], priority: int, deadline: float,
                       tenant: str, label: str) -> tuple[T, float, float, float]:
        work = self._slot_job(job, label, tenant)
        await self.take_slot(priority, deadline, tenant, label, handoff=work)
        # A job that a worker thread started as it passed its slot on (its thread known,
        # then) was granted the slot when the thread started it, maybe runs ago.
        granted = work.started if work.worker is not None else time.perf_counter()
        result = await self._run_job(work)
        return result, granted, work.ended, 1.0

    async def run_in_slot(self, job: Callable[[], T], label: str, tenant: str
                          ) -> tuple[T, float]:
        """``job`` in a worker thread, on a slot already held, which is passed on or
        freed when the worker thread has finished the job (abandoned or not); its run
        is ``tenant``'s device time. Its result, and when (perf_counter) the thread ended
        the run (see :meth:`counted`)."""
        work = self._slot_job(job, label, tenant)
        result: T = await self._run_job(work)
        return result, work.ended

    def _slot_job(self, job: Callable[[], Any], label: str, tenant: str) -> Job:
        # ``job`` for the worker threads, holding one of the device's slots, which its
        # thread passes on (or trio frees) when it ends, after charging its run time to
        # ``tenant`` where the queue policy wants it; its backend sees ``tenant`` as the
        # job's caller whatever the policy (a sandboxed graph's crash back-off).
        return self._threads.job(in_context(job, self.wrap), label=label, relay=self._slots,
                                 tenant=tenant if self._charges else None, caller=tenant)

    async def _run_job(self, work: Job) -> Any:
        try:
            return await self._threads.run_job(work)
        except WasiNNError:
            raise
        except Exception as exc:
            raise backend_failure(self.device, exc) from exc

    async def unslotted(self, job: Callable[[], T], *, label: str, failure: str) -> T:
        """``job`` in one of the device's compile threads, holding no request slot (a
        compile, a warm-up): never in a worker thread, which a request would then wait
        for (a compile can take minutes). Such jobs wait for a compile thread first come
        first served, and run with the event loop unpinned (see
        :class:`~wasinn.actors.affinity.LoopPin`). Raises ClosedResourceError once the
        threads have stopped, BackendRuntimeError (saying ``failure``) for a backend's
        own exception."""
        work = in_context(job, self.wrap)
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            return await self._compiler.run(work, label=label, pin=False)
        except WasiNNError:
            raise
        except Exception as exc:
            raise BackendRuntimeError(
                f"{self.device}: {failure}: {type(exc).__name__}: {exc}"
            ) from exc

    # -- inline runs --------------------------------------------------------------------------
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

    async def _run_inline(self, job: Callable[[], T], profile: RunProfile, nbytes: int,
                          tenant: str) -> tuple[T, float]:
        # On the trio thread, holding an idle slot: run, time it, free the slot, then
        # yield to the other tasks so that a stream of tiny requests cannot starve them.
        # The result, and when (perf_counter) the run ended: the yield is its delivery.
        work = in_context(job, self.wrap)
        start = time.perf_counter()
        try:
            result = work()
        except WasiNNError:
            raise
        except Exception as exc:
            raise backend_failure(self.device, exc) from exc
        finally:
            ended = time.perf_counter()
            seconds = ended - start
            if self._charges:  # before the slot goes to a request queued meanwhile
                self._slots.charge(tenant, seconds)
            self._slots.free()
        profile.observe(seconds, nbytes, self.inline_below)
        await trio.lowlevel.cancel_shielded_checkpoint()
        return result, ended

    # -- batched requests ---------------------------------------------------------------------
    async def batched(self, key: Hashable, inputs: BatchInputs, run: RunInputs,
                      batching: Batching, keep: bool, priority: int, deadline: float,
                      tenant: str, label: str, account: Account | None,
                      probe: bool = False
                      ) -> tuple[dict[str, Tensor], float, float, float]:
        """:meth:`request` for ``run(inputs, keep)``, merged with others for ``key`` as
        ``batching`` allows (see :mod:`wasinn.actors.batching`; ``probe``: see
        :meth:`Batcher.submit <wasinn.actors._batcher.Batcher.submit>`)."""
        job = functools.partial(run, inputs.tensors, keep)
        await trio.lowlevel.checkpoint_if_cancelled()
        if inputs.rows >= batching.max_batch:  # a batch of its own already
            return await self.request(job, priority, deadline, tenant, None, None, label)
        if (not batching.max_delay and not self._closed and trio.current_time() < deadline
                and self._slots.try_take()):
            # Nobody to share a run with: run now, as a plain request.
            granted = time.perf_counter()
            result, ended = await self._within(deadline, label, self.run_in_slot, job,
                                               label, tenant)
            return result, granted, ended, 1.0
        if self._closed:
            raise ClosedResourceError(f"{self.device}: the device actor is closed")
        return await self._within(
            deadline, label, functools.partial(
                self.batcher.submit, key, inputs, keep, run, batching, priority=priority,
                deadline=deadline, tenant=tenant, label=label, account=account,
                probe=probe))

    # -- slots --------------------------------------------------------------------------------
    async def take_slot(self, priority: int, deadline: float, tenant: str, label: str = "",
                        *, request: Request | None = None, handoff: Job | None = None
                        ) -> None:
        """Hold one of the device's slots (see :meth:`Slots.take
        <wasinn.actors.slots.Slots.take>` for the queue, its errors and cancellation;
        ``label`` names the request's run in them; ``handoff`` is the job a worker thread
        may start when it grants the slot); ClosedResourceError when the actor closed
        meanwhile (the slot is given back, or the job already started abandoned)."""
        started = await self._slots.take(priority, deadline, tenant, label, request=request,
                                         handoff=handoff)
        if self._closed:  # closed between the grant and now: nothing may start any more
            if started:
                assert handoff is not None
                handoff.abandon()  # it frees the slot once it is over
            else:
                self._slots.free()
            raise ClosedResourceError(f"{self.device}: the device actor is closed")

    async def _take_batch_slot(self, request: Request, label: str) -> None:
        # A batch waits in the queue as ``request``, whose terms change as members leave
        # (``label``: its run's, a batch's members being requests of one run).
        await self.take_slot(request.priority, request.deadline, request.tenant, label,
                             request=request)
