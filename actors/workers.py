"""A device actor's persistent worker threads, and how their results reach trio.

``trio.to_thread.run_sync`` starts (or wakes a cached) thread, takes a limiter token and
hands the result back through several trio tasks for every call: on a small VM that is
most of the scheduler's round trip for a small model. :class:`WorkerThreads` keeps
``count`` threads alive for the actor's lifetime instead, each with its own job queue
and its own socket pair. A job goes to an idle thread's ``queue.SimpleQueue`` (one futex
wake-up); the thread runs it and writes one byte to its socket, on which the waiting
caller sits with ``trio.lowlevel.wait_readable``: the caller resumes in trio's next
batch, without the extra task hop of ``TrioToken.run_sync_soon`` (measured: ~25 % less
per round trip than run_sync_soon + reschedule, ~40 % less than ``to_thread``).

A job that holds one of the device's request slots (a :class:`Relay`: the device's
:class:`~wasinn.actors.slots.Slots`) passes the slot on from its thread as soon as it
ends: the thread takes the next queued request (:meth:`Slots.pass_on
<wasinn.actors.slots.Slots.pass_on>`) and, when that request's job was prepared before it
queued (:meth:`WorkerThreads.job`), runs it next, without waiting for trio. The byte the
thread writes for the ended job then also tells trio which job its thread runs now: the
caller of the ended job (or the task that reaps it) tells the next request that it was
granted, and that request's caller waits on the same socket for its own byte. Each
finished job's byte is read once, in order, so one socket serves a thread's whole chain.
Trio may take that byte only after the next run has ended (a busy event loop, a run that
holds the GIL), so the thread stamps the moment its run ended (perf_counter) before it
writes it, every job's ``ended``, and, when the slot changed hands then, the next job's
``started``: from these the requests' time queued, running and delivering (the wait for
trio to take the result) are reckoned (see :meth:`RequestRunner.counted
<wasinn.actors.runner.RequestRunner.counted>`): one clock read per job (a run charged
to a tenant is timed besides).
A thread passes nothing on while a job that holds no slot waits for a thread: under
load the queue never empties, and a thread going from one request to the next would
never become free for it. The slot is then freed in trio, and the thread handed to the
job that waited longest before any caller that comes later. (A device actor runs its
compiles and warm-ups in threads of their own, a second instance, so that its request
threads never have such a waiter; the rule keeps one instance safe for both kinds.)

Cancellation: every job runs under its own :class:`~wasinn.backends.base.Cancellation`
(the thread's :func:`~wasinn.backends.base.current_cancellation`), which backends turn
into their library's own interruption (ONNX Runtime's terminate flag, OpenVINO's
``InferRequest.cancel``, a checkpoint before each operator of a ``torch.export``
program), and which names whom the job runs for (its ``caller``: a request's tenant,
:func:`~wasinn.backends.base.current_caller`). A caller that stops waiting (it is
cancelled) abandons its job: the job is cancelled (a backend call ends at its library's
next check where it has one, and a job cancelled before its thread reaches it does not
start), the outcome is dropped, and a trio system task waits for the thread to become
free. ``on_done`` (or the relay's ``free``) runs in trio when the thread has really
finished the job, abandoned or not: the actor frees the job's worker slot there, so a
device never runs more than ``count`` jobs at once.

Shutdown: :meth:`stop` cancels and abandons every job handed to a thread (their callers
get ClosedResourceError at once, even if the job ignores its cancellation) and tells each
thread to exit after its job; :meth:`wait_stopped` waits, for at most a given time, for
every thread, and joins those that exited. Waiting matters: a thread left inside native
code (ONNX Runtime, OpenVINO, torch) when the interpreter exits is killed there, which
aborts the process ("terminate called without an active exception"), and the graphs a
job runs on must not be closed under it. But a call that ignores cancellation (a
TorchScript run outside its loops, an OpenVINO Loop node) may run for ever, so the
wait is bounded: past it, the jobs still running are reported and their threads left
behind as daemons.
"""

from __future__ import annotations

import collections
import contextlib
import math
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, cast

import outcome
import trio

from wasinn.backends.base import Cancellation, Cancelled, running_under
from wasinn.errors import ClosedResourceError

from .affinity import LoopPin, Mask, loop_pin, pin_current_thread
from .queue import Request
from .wakeup import wake

T = TypeVar("T")


class Relay(Protocol):
    """Where the request slot a job holds goes when the job ends (a device's Slots)."""

    def pass_on(self, tenant: str | None = None, seconds: float = 0.0) -> Request | None:
        """In the job's thread, once it ended: the next request, granted the slot (after
        charging ``tenant``, unless None, the job's ``seconds``)."""

    def charge(self, tenant: str, seconds: float) -> None:
        """In the job's thread: ``tenant``'s job took ``seconds`` (no slot passed on)."""

    def free(self) -> None:
        """In trio: nobody took the slot over; give it back."""

    def granted_on(self, request: Request) -> None:
        """In trio: tell ``request`` that the slot is its own now."""


class Job:
    """A job for the worker threads, made by :meth:`WorkerThreads.job`; run it with
    :meth:`WorkerThreads.run_job`. Also what a queued request carries so that a worker
    thread may start it (``Request.handoff``)."""

    __slots__ = ("abandoned", "cancellation", "ended", "fn", "label", "on_done", "pin",
                 "relay", "result", "started", "successor", "tenant", "threads",
                 "unpinned", "worker")

    def __init__(self, threads: WorkerThreads, fn: Callable[[], Any], label: str,
                 on_done: Callable[[], None] | None, relay: Relay | None,
                 tenant: str | None = None, caller: str | None = None) -> None:
        self.threads = threads
        #: Whom the relay charges the job's run time to (None: nobody; the run is not
        #: even timed).
        self.tenant = tenant
        self.fn: Callable[[], Any] | None = fn
        self.result: outcome.Outcome[Any] | None = None
        #: The job's own; it names the job's ``caller`` to the backend too.
        self.cancellation = Cancellation(caller)
        self.label = label
        self.on_done = on_done
        self.relay = relay
        #: When (perf_counter) it was handed to a thread: by trio, or by the thread that
        #: passed it its slot (then also when its request was granted the slot).
        self.started = math.nan
        #: When (perf_counter) its thread ended it, its slot passed on to the next request
        #: then if it was (else trio frees the slot once it has the result); inf: not yet.
        self.ended = math.inf
        self.abandoned = False
        #: The thread that runs it, once trio knows.
        self.worker: _Worker | None = None
        #: The request its thread passed its slot on to (set before the thread signals).
        self.successor: Request | None = None
        #: (the loop's CPU, the mask to run under) for a pinned job (see .affinity).
        self.pin: tuple[Mask, Mask] | None = None
        #: The job keeps the loop unpinned while it is out (LoopPin.suspend).
        self.unpinned = False

    def describe(self) -> str:
        state = ", abandoned" if self.abandoned else ""
        return f"{self.label} (for {time.perf_counter() - self.started:.1f} s{state})"

    def abandon(self) -> None:
        """Its caller gave up on it after a worker thread had started it on its own (in
        trio; see :class:`~wasinn.actors.queue.Handoff`)."""
        self.threads._abandon_started(self)

    def release(self) -> None:
        """In trio, once the job is over (or will never run): its slot goes back."""
        if self.on_done is not None:
            self.on_done()
        elif self.relay is not None:
            self.relay.free()


class _Waiter:
    """A caller waiting for a thread: handed one (``worker``), or none once stopped."""

    __slots__ = ("handed", "worker")

    def __init__(self) -> None:
        self.handed = trio.Event()
        self.worker: _Worker | None = None


class _Worker:
    """One thread, its job queue, and the socket pair it signals a finished job on."""

    __slots__ = ("_lock", "_sides", "inbox", "reader", "thread", "writer")

    def __init__(self, name: str, work: Callable[[_Worker], None]) -> None:
        self.inbox: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.reader, self.writer = socket.socketpair()
        self.reader.setblocking(False)
        self.thread = threading.Thread(target=work, args=(self,), name=name, daemon=True)
        self._lock = threading.Lock()
        self._sides: set[str] = set()

    def done(self, side: str) -> None:
        """``side`` ("trio": nobody will wait on the reader again; "thread": the thread
        will not write again) is done with the sockets; the last one closes them, so a
        socket is never closed under a trio waiter nor under a writing thread."""
        with self._lock:
            self._sides.add(side)
            close = len(self._sides) == 2
        if close:
            self.reader.close()
            self.writer.close()


class WorkerThreads:
    """``count`` long-lived threads running one device's jobs (see the module docstring).

    ``role`` names what the threads are for in their names (``wasinn cpu worker 0``: a
    device's request threads; a device's compile threads are another instance). Everything
    but the threads' own loop is called from the trio thread.
    """

    def __init__(self, name: str, count: int, *, pin: bool = False,
                 role: str = "worker") -> None:
        if count < 1:
            raise ValueError("count must be >= 1")
        self.name = name
        self.count = count
        self.role = role
        #: Hand-offs kept on the event loop's CPU (see :mod:`wasinn.actors.affinity`).
        self.pin = pin
        self._loop_pin: LoopPin | None = None
        self._workers: list[_Worker] = []
        self._idle: list[_Worker] = []
        #: Callers waiting for a thread (every one busy), served first come first served
        #: (see :meth:`_thread`).
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self._token: trio.lowlevel.TrioToken | None = None
        self._stopped = False
        self._alive = 0
        #: Jobs handed to the threads and not finished yet (running or waiting for one).
        self.busy = 0
        #: Jobs the threads have finished (for tests and metrics).
        self.finished = 0
        #: Jobs a thread started on its own, passed the slot of the job before them.
        self.passed_on = 0
        self._abandoned = 0
        self._quiet: trio.Event | None = None
        self._running: dict[_Worker, Job] = {}  # jobs handed to a thread, not finished
        self._exited_workers: set[_Worker] = set()

    def __repr__(self) -> str:
        return f"<WorkerThreads {self.name} alive={self._alive} busy={self.busy}>"

    @property
    def abandoned(self) -> int:
        """Jobs whose caller gave up on them and that are still running."""
        return self._abandoned

    @property
    def threads(self) -> list[threading.Thread]:
        """The threads started (alive or not), for diagnostics and tests."""
        return [worker.thread for worker in self._workers]

    def start(self) -> None:
        """Start the threads (in trio: they report back through its token)."""
        if self._token is not None or self._stopped:
            return
        self._token = trio.lowlevel.current_trio_token()
        if self.pin:
            self._loop_pin = loop_pin()
        for i in range(self.count):
            worker = _Worker(f"wasinn {self.name} {self.role} {i}", self._work)
            worker.thread.start()  # counted only once started: wait_stopped joins these
            self._workers.append(worker)
            self._idle.append(worker)
            self._alive += 1

    def running_jobs(self) -> list[str]:
        """The jobs handed to a thread and not finished yet, described (label, age,
        abandoned or not), for diagnostics."""
        return [job.describe() for job in self._running.values()]

    def job(self, fn: Callable[[], Any], *, label: str = "job",
            on_done: Callable[[], None] | None = None, relay: Relay | None = None,
            tenant: str | None = None, caller: str | None = None) -> Job:
        """A job running ``fn``, for :meth:`run_job`. ``relay``: the request slot the job
        holds, which its thread passes on when the job ends (see the module docstring);
        ``on_done``: what to call in trio once it is over, for a job without one.
        ``tenant`` (with a relay): its thread times the run and charges it to the relay
        (a fair queue policy's device time) as the job ends. ``caller``: whom the job
        runs for, as its backend sees it (:func:`~wasinn.backends.base.current_caller`:
        a request's tenant, whatever the queue policy; None: nobody named, as a compile
        or a warm-up, which are the host's)."""
        return Job(self, fn, label, on_done, relay, tenant, caller)

    async def run(self, fn: Callable[[], T], *, on_done: Callable[[], None] | None = None,
                  label: str = "job", pin: bool = True) -> T:
        """Run ``fn`` in one of the threads; its result, or the exception it raised
        (:meth:`run_job` of a new :meth:`job`)."""
        result: T = await self.run_job(self.job(fn, label=label, on_done=on_done), pin=pin)
        return result

    async def run_job(self, job: Job, *, pin: bool = True) -> Any:
        """Run ``job`` in one of the threads, or wait for the thread that started it on its
        own; its result, or the exception it raised.

        Raises ClosedResourceError once stopped (or before ``start``), and when
        :meth:`stop` cancelled the job while it ran. Cancelled, the caller abandons the
        job (see the module docstring); the job's slot is released (``on_done``, or its
        relay's ``free``) in trio once the job is over: finished by its thread (abandoned
        or not) and not passed on, or never started (stopped already, or cancelled or
        stopped while waiting for a free thread). ``label`` names the job in diagnostics.
        Where the threads pin hand-offs, ``pin=False`` runs the job with the loop
        unpinned (a compile: see :class:`~wasinn.actors.affinity.LoopPin`).
        """
        worker = job.worker
        if worker is not None:  # started by a thread that passed its slot on
            if self._stopped:
                self._abandon(job, worker)
                await trio.lowlevel.checkpoint_if_cancelled()
                raise ClosedResourceError(
                    f"{self.name}: the device closed while the job ran (it was cancelled)")
            return await self._wait(job, worker)
        self.busy += 1
        try:
            worker = job.worker = await self._thread()
        except BaseException:
            self.busy -= 1
            job.release()
            raise
        job.started = time.perf_counter()
        if self._loop_pin is not None:
            if pin:
                job.pin = self._loop_pin.hold()
            else:
                self._loop_pin.suspend()
                job.unpinned = True
        self._running[worker] = job
        worker.inbox.put(job)
        return await self._wait(job, worker)

    async def _thread(self) -> _Worker:
        # An idle thread for a job: at once when one is idle and nobody waits before this
        # caller, else once a thread is handed over (_give, first come first served).
        self._check_running()
        if self._idle and not self._waiters:
            return self._idle.pop()
        waiter = _Waiter()
        self._waiters.append(waiter)
        try:
            await waiter.handed.wait()
        except BaseException:
            if waiter.worker is not None:  # handed over just as the caller gave up
                self._give(waiter.worker)
            elif waiter in self._waiters:  # (stop() has taken every waiter out)
                self._waiters.remove(waiter)
            raise
        if self._stopped:
            # Stopped meanwhile, a thread handed over first or not: a job put in its
            # inbox now would sit behind the exit stop() sent it, never run, and its
            # caller would wait for ever. Let go of the thread, refuse the job.
            if waiter.worker is not None:
                self._give(waiter.worker)
            self._check_running()
        assert waiter.worker is not None
        return waiter.worker

    def _give(self, worker: _Worker) -> None:
        # In trio: ``worker`` is free; the caller that waited longest gets it, else it
        # idles. A waiter is served before any newcomer can take the thread.
        if self._stopped:
            worker.done("trio")  # no job will be handed to it again
        elif self._waiters:
            waiter = self._waiters.popleft()
            waiter.worker = worker
            waiter.handed.set()
        else:
            self._idle.append(worker)

    async def _wait(self, job: Job, worker: _Worker) -> Any:
        # The caller's side of a job handed to (or started by) ``worker``.
        try:
            await trio.lowlevel.wait_readable(worker.reader)
        except trio.ClosedResourceError:
            # stop() woke this caller (notify_closing): the device is closing, and the job
            # may go on for a while (a call that ignores its cancellation).
            self._abandon(job, worker)
            await trio.lowlevel.checkpoint_if_cancelled()  # a caller cancelled meanwhile
            raise ClosedResourceError(
                f"{self.name}: the device closed while the job ran (it was cancelled)"
            ) from None
        except BaseException:
            # Nobody wants the result: interrupt the backend call where it can be.
            self._abandon(job, worker)
            raise
        self._finish(job, worker)
        result, job.result = job.result, None
        assert result is not None
        if isinstance(result, outcome.Error) and job.cancellation.cancelled and self._stopped:
            raise ClosedResourceError(
                f"{self.name}: the device closed while the job ran (it was cancelled)"
            ) from result.error
        return result.unwrap()

    def _abandon(self, job: Job, worker: _Worker) -> None:
        # The caller stops waiting: cancel the job; a system task frees its thread later.
        job.abandoned = True
        job.cancellation.cancel()
        self._abandoned += 1
        trio.lowlevel.spawn_system_task(self._reap, job, worker,
                                        name=f"{self.name} abandoned job")

    def _abandon_started(self, job: Job) -> None:
        # A job a thread started on its own, given up on by its caller (in trio). Until
        # trio has taken the result of the job before it, nobody knows its thread: the
        # job is cancelled now and reaped once that result is in (_finish).
        if job.worker is not None:
            self._abandon(job, job.worker)
        else:
            job.abandoned = True
            job.cancellation.cancel()

    def _check_running(self) -> None:
        if self._stopped or self._token is None:
            raise ClosedResourceError(f"{self.name}: the worker threads are stopped")

    def _work(self, worker: _Worker) -> None:
        # The thread's loop. Nothing here may raise: a job's exception is its outcome.
        try:
            while (job := worker.inbox.get()) is not None:
                pin = job.pin  # trio clears it once the job is back
                if pin is not None:
                    pin_current_thread(pin[1])  # the job may use every CPU
                while True:
                    fn, job.fn = job.fn, None  # drop the job's references (inputs) once run
                    assert fn is not None
                    tenant = job.tenant  # (None: the run is charged to nobody)
                    seconds = 0.0
                    if job.cancellation.cancelled:  # abandoned before it started
                        job.result = outcome.Error(Cancelled(f"{job.label}: cancelled"))
                    elif tenant is None:
                        with running_under(job.cancellation):
                            job.result = outcome.capture(fn)
                    else:
                        seconds = time.perf_counter()
                        with running_under(job.cancellation):
                            job.result = outcome.capture(fn)
                        seconds = time.perf_counter() - seconds
                    following: Job | None = None
                    successor: Request | None = None
                    relay = job.relay
                    # Not while a job waits for a thread (a compile, a warm-up: they
                    # hold no slot): passed on from job to job under load, the thread
                    # would never become free for it. Then the slot is freed in trio,
                    # and the thread handed to that job first (_give).
                    if relay is not None and not self._stopped and not self._waiters:
                        # (Charged first, under the same lock: the choice counts it.)
                        successor = job.successor = relay.pass_on(tenant, seconds)
                    elif relay is not None and tenant is not None:
                        relay.charge(tenant, seconds)  # the slot is freed in trio
                    # The run's end and, the slot passed on, the grant of the next
                    # request, which trio learns only once it takes this job's result
                    # (maybe after the next run has ended): stamped here, after the
                    # grant (the next request reached the device before it) and before
                    # the byte lets trio read them.
                    job.ended = ended = time.perf_counter()
                    if successor is not None and successor.started:
                        following = cast(Job, successor.handoff)
                        following.started = ended
                        if self._stopped:  # stop() ran meanwhile, and missed it
                            following.cancellation.cancel()
                    try:
                        wake(worker.writer)  # keeping the GIL: see wasinn.actors.wakeup
                    except OSError:
                        return  # trio let go of the reader (it is shutting down)
                    if following is None:
                        break
                    job = following  # under the same mask: trio moves the pin over
                if pin is not None:
                    # Wait for the next job on the loop's CPU. After the send: a thread
                    # that the run moved to another CPU would otherwise migrate back
                    # first, on the caller's time, and gain nothing: the loop is woken on
                    # its own CPU whatever the mask of the thread that wakes it.
                    pin_current_thread(pin[0])
                # Idle, the thread holds nothing of its last job: its callable (the
                # inputs, a compile's model bytes) and its outcome (the outputs, a
                # compiled graph) are freed as their callers let go of them, not when
                # this thread's next job comes, maybe never.
                del fn, job, following
        finally:
            worker.done("thread")
            token = self._token
            assert token is not None
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(self._exited, worker)

    def _finish(self, job: Job, worker: _Worker) -> None:
        # In trio, once the worker signalled the end of ``job``: consume its byte (one:
        # the byte of the job its thread runs next may follow), then pass its slot on
        # or free it, and the thread with it.
        with contextlib.suppress(BlockingIOError):
            worker.reader.recv(1)
        self._running.pop(worker, None)
        self.busy -= 1
        self.finished += 1
        successor, job.successor = job.successor, None
        following = successor.handoff if successor is not None and successor.started \
            else None
        if following is not None:
            # The thread runs the next request's job already, on this slot and this pin.
            assert isinstance(following, Job)
            following.pin, job.pin = job.pin, None
            following.worker = worker
            self._running[worker] = following
            self.busy += 1
            self.passed_on += 1
            if following.abandoned:  # its caller gave up before now
                self._abandoned += 1
                trio.lowlevel.spawn_system_task(self._reap, following, worker,
                                                name=f"{self.name} abandoned job")
            elif self._stopped:
                following.cancellation.cancel()
        else:
            self._give(worker)  # (to nobody once stopped)
        self._unpin(job)
        if successor is None:
            job.release()
        else:
            assert job.relay is not None
            job.relay.granted_on(successor)

    async def _reap(self, job: Job, worker: _Worker) -> None:
        # A system task: waits for an abandoned job's thread, then frees it (and the
        # job's slot). Cancelled only when trio itself ends: then nobody needs either.
        try:
            await trio.lowlevel.wait_readable(worker.reader)
        except trio.Cancelled:
            worker.done("trio")  # trio is ending: nobody waits on this reader any more
            self._unpin(self._running.pop(worker, None))
            return
        self._abandoned -= 1
        self._finish(job, worker)
        self._check_quiet()

    def _unpin(self, job: Job | None) -> None:
        # In trio: a job is back, or its thread given up on (trio is ending).
        if job is None or self._loop_pin is None:
            return
        if job.pin is not None:
            job.pin = None
            self._loop_pin.release()
        if job.unpinned:
            job.unpinned = False
            self._loop_pin.resume()

    def _exited(self, worker: _Worker) -> None:
        self._exited_workers.add(worker)
        self._alive -= 1
        self._check_quiet()

    def _check_quiet(self) -> None:
        if self._quiet is not None and self._alive == 0:
            self._quiet.set()

    def stop(self) -> None:
        """No new jobs; every job handed to a thread is cancelled (see the module
        docstring), and their callers get ClosedResourceError at once; every thread
        exits after its current job. Idempotent. In trio."""
        if self._stopped:
            return
        self._stopped = True
        for worker, job in list(self._running.items()):
            job.cancellation.cancel()
            successor = job.successor  # (a job its thread may start next: _finish checks)
            if successor is not None and isinstance(successor.handoff, Job):
                successor.handoff.cancellation.cancel()
            if not job.abandoned:
                # Its caller raises ClosedResourceError now, not once the job returns.
                trio.lowlevel.notify_closing(worker.reader)
        for worker in self._workers:
            worker.inbox.put(None)
        for worker in self._idle:
            worker.done("trio")  # busy ones are let go of once their job is consumed
        self._idle.clear()
        while self._waiters:  # (no thread: each raises ClosedResourceError)
            self._waiters.popleft().handed.set()

    async def wait_stopped(self, timeout: float = math.inf) -> list[str]:
        """Wait (after :meth:`stop`) until every thread has exited, for at most
        ``timeout`` seconds, and join those that did. Returns the jobs still running
        (described, see :meth:`running_jobs`): empty when every thread is gone.

        Call it shielded from cancellation: returning early would leave threads inside
        backend calls whose graphs the caller is about to close. A job still running
        past ``timeout`` (a backend call that ignores cancellation) keeps its thread, a
        daemon; its slot and its graph are released when it returns, if trio still runs.
        """
        if self._alive:
            self._quiet = trio.Event()
            with trio.move_on_after(timeout):
                await self._quiet.wait()
        else:
            await trio.lowlevel.checkpoint()
        # Each thread that said it is exiting only has to return: join them
        # (microseconds), so that "stopped" means gone.
        for worker in self._workers:
            if worker in self._exited_workers:
                worker.thread.join()
        if not self._alive:
            return []
        return self.running_jobs() or [f"{self._alive} worker thread(s) still exiting"]
