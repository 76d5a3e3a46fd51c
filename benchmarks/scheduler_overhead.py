"""Overhead of the scheduler (Runtime -> context -> device actor -> worker thread) over a
direct backend call, measured in the same run.

    python benchmarks/scheduler_overhead.py [--iters N] [--width W] [--seconds S]

``--iters`` (600) is the MobileNetV2-like round trips per kind; the tiny model gets ten
times as many.

1. Round trip, tiny model (an ONNX ``y = 2x + 1`` on f32[1, 4], ONNX Runtime): median of
   ``await ctx.compute(...)`` minus median of ``CompiledGraph.run(...)`` on the same
   compiled graph. Goal: <= 60 us. Measured three ways: with the embedded default config
   (every run goes through the device's worker thread), from a thread of the caller's
   own (``ctx.compute_in_caller_thread``, what guests use: the backend runs in that
   thread; the direct call is timed in the same thread), and with inline runs enabled
   explicitly (a CPU pool with ``inline_below_us = 100``: such a graph runs on the event
   loop once timed). Inline runs are opt-in, off by default: they hold the event loop for
   the whole run (see ``wasinn.actors.inline`` for the risk).
2. Round trip, MobileNetV2-like (width W, batch 1, ONNX Runtime and OpenVINO): ratio of
   the medians, through the worker thread and from a caller's thread. Goal: <= 3 %.
3. Throughput of 1, 4 and 16 concurrent callers on the CPU pool (MobileNetV2-like, each
   backend), each against the native best: the library's own call on the compiled model
   the runtime holds (ONNX Runtime's ``InferenceSession.run``, an OpenVINO
   ``InferRequest.infer``, as ``backend_overhead.py`` times them: no wasinn code on the
   way) from 1 or ``workers`` plain threads, whichever is faster. Callers are trio tasks
   (``await ctx.compute``), then as many threads of their own computing as guests do
   (``ctx.compute_in_caller_thread``: in the guest's thread when a slot is free, else
   queued). Every rate, native ones included, is the completions divided by the time
   from the start to the last completion: callers start requests until ``--seconds``
   have passed, and the requests still queued or running then are counted with the
   time they take, not for free. Under load a worker thread passes its slot straight to
   the next queued request and starts its run (see ``wasinn.actors.slots``): the line
   says how many runs started so.
4. Contexts: creation rate (goal >= 100,000/s) and size (tracemalloc, goal <= 2 KB).

Then, on Linux, the same again in a fresh process (``--pin-handoffs``) whose CPU pool
pins its hand-offs (``pin_handoffs = true``, opt-in: the event loop and the worker thread
hand a job to each other on one CPU; see ``wasinn.actors.affinity`` for the price). A
fresh process, because that is how it is deployed: OpenVINO's threads, once pinned by a
graph compiled with its own CPU pinning on (the default pool's), stay pinned and slow
the pinned pool's OpenVINO runs down (measured: 3.6 ms became 6.0 ms).

Calls alternate in short blocks (20 direct, 20 scheduled, ...) so that noise from other
processes hits both alike while each block keeps its thread's caches warm; a round is
one block of each kind. Each round-trip figure comes with a 95 % bootstrap interval
(whole rounds resampled) and says whether that interval lies within its goal, beyond
it, or across it: on a noisy machine a median alone cannot tell a 2 % overhead from a
4 % one. A result no overhead can give (an interval wholly below no overhead: the
scheduled call faster than the direct call it wraps; a throughput above 1.1x the native
best) says the direct measurement was slowed, and reads "baseline disturbed: not a
verdict" instead. Figures vary with the machine's load, printed first (a warning when it
exceeds the CPU count): compare ratios, not absolutes. The
worker-thread path costs two cross-thread wake-ups per request, so it is printed next
to the machine's own wake-up latency (a two-thread queue ping-pong, measured in the same
run): on a busy or
virtualised host that latency alone can be several times a tiny model's run time. A KVM
guest whose kernel does not poll before halting an idle vCPU (cpuidle-haltpoll's
``guest_halt_poll_ns`` = 0, printed when present) pays a halt and a wake-up IPI on every
hand-off: measured on such a VM, 59 us per ping-pong with 0 against 5.9 us with the
kernel's default of 200000 ns.

The worker-thread figures are split in two, measured in the same alternating blocks: the
thread hand-off itself (the same direct call given as a job to the device's own worker
thread and its result handed back to trio, as any design that keeps inference off the
event loop must) and what the scheduler, the queue, the slots and the context add on top.
"""

from __future__ import annotations

import argparse
import functools
import operator
import os
import queue
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import trio

import wasinn
from wasinn.actors.affinity import unsupported_reason
from wasinn.actors.session import Session
from wasinn.configs.loader import parse_config
from wasinn.modelgen import affine_onnx, export_mobilenet, sample_image

#: The opt-in bound the "inline" line enables (microseconds); the default config has 0.
INLINE_BELOW_US = 100.0


def cpu_pool(workers: int, **keys: Any) -> wasinn.Runtime:
    """A runtime with one CPU pool: the default's, with ``keys`` changed."""
    return wasinn.Runtime(parse_config({"pools": {"cpu": {
        "kind": "cpu", "devices": ["cpu"], "workers": workers, **keys}}}, None))


def compiled_of(rt: wasinn.Runtime) -> Session:
    (actor,) = rt.actors
    session = actor.cached_session(actor.session_keys()[-1])
    assert session is not None
    return session


def warm_up(kinds: int, iters: int) -> Iterator[int]:
    """The untimed calls before :func:`alternating`'s: one of each kind in turn."""
    for _ in range(max(20, iters // 10)):
        yield from range(kinds)


def alternating(kinds: int, iters: int) -> Iterator[tuple[int, int]]:
    """The timed calls, in order, as (round, kind): blocks of up to 20 calls of one kind,
    the next kind's block, and so on (see the module docstring); a round is one block of
    each kind. The caller makes and times each call: the same schedule serves calls that
    are awaited and calls that are not."""
    block = max(1, min(20, iters // 10))
    for round_ in range(max(1, iters // block)):
        for kind in range(kinds):
            for _ in range(block):
                yield round_, kind


class Timings:
    """One kind of call's times (seconds), by the round of blocks they were taken in."""

    def __init__(self) -> None:
        self.rounds: list[list[float]] = []

    def add(self, round_: int, seconds: float) -> None:
        while len(self.rounds) <= round_:
            self.rounds.append([])
        self.rounds[round_].append(seconds)

    @property
    def median(self) -> float:
        return statistics.median(t for r in self.rounds for t in r)

    def median_of(self, rounds: list[int]) -> float:
        return statistics.median(t for i in rounds for t in self.rounds[i])


def interval(stat: Callable[[float, float], float], a: Timings, b: Timings,
             resamples: int = 400) -> tuple[float, float]:
    """A 95 % bootstrap interval of ``stat(median of a, median of b)``: whole rounds are
    resampled, a's and b's blocks of a round together, because blocks taken close in
    time share the machine's noise (a burst of load from elsewhere slows both)."""
    rng = random.Random(0)
    n = min(len(a.rounds), len(b.rounds))
    values = []
    for _ in range(resamples):
        picks = [rng.randrange(n) for _ in range(n)]
        values.append(stat(a.median_of(picks), b.median_of(picks)))
    values.sort()
    return values[int(0.025 * resamples)], values[int(0.975 * resamples) - 1]


#: What a figure that cannot be a result is reported as, instead of a verdict.
DISTURBED = "baseline disturbed: not a verdict"

#: How far above the library's own best a rate through wasinn may read before it is taken
#: for a disturbed baseline: wasinn makes the same library call with more work around it,
#: so only a slowed native measurement (load from other processes) can put it above.
DISTURBED_ABOVE = 1.1


def verdict(low: float, high: float, goal: float, *, no_overhead: float) -> str:
    """Whether the whole interval of an overhead is within ``goal``, beyond it, or across
    it. ``no_overhead`` is the value of a call that costs nothing on top of the direct
    call it wraps (1 for a ratio, 0 for a difference): an interval wholly below it says
    the wrapped call ran faster than the call itself, which only a disturbed direct
    measurement gives, so it gets :data:`DISTURBED`, not "goal met"."""
    if high < no_overhead:
        return (f"{DISTURBED} (the whole interval says the scheduled call beat the direct "
                "call it wraps)")
    if high <= goal:
        return "goal met"
    if low > goal:
        return "goal missed"
    return "the interval spans the goal: this machine's noise cannot tell"


class Trip(NamedTuple):
    """One round-trip measurement's times."""

    direct: Timings  #: the compiled graph called directly, in the event loop's thread
    scheduled: Timings  #: ``await ctx.compute(...)``
    handed_off: Timings  #: the same direct call as a job of the device's worker thread


async def round_trip(rt: wasinn.Runtime, builders: list[bytes], inputs: dict[str, Any],
                     iters: int, backend: str = "onnxruntime") -> Trip:
    """Direct call, ctx.compute and the direct call handed off, in alternating blocks.

    The hand-off is what any design that keeps inference off the event loop pays: the
    direct call given as a job to the device's own worker thread (the thread
    ``ctx.compute`` uses) and its result handed back to trio, without the scheduler, the
    actor's queue and slots or the context. ``scheduled - handed_off`` is what those add.
    """
    graph = await rt.load(builders, "onnx", backend=backend)
    compiled = compiled_of(rt).compiled
    (actor,) = rt.actors
    threads = actor.threads
    ctx = graph.init_execution_context()
    tensors = {k: wasinn.Tensor.from_numpy(v) for k, v in inputs.items()}
    run_direct = functools.partial(compiled.run, tensors)
    # Kind 0, the direct call, returns its result; the others return an awaitable.
    calls: tuple[Callable[[], Any], ...] = (
        run_direct,
        functools.partial(ctx.compute, inputs),
        functools.partial(threads.run, run_direct),
    )
    for kind in warm_up(len(calls), iters):
        result = calls[kind]()
        if kind:
            await result
    times = [Timings() for _ in calls]
    for round_, kind in alternating(len(calls), iters):
        call = calls[kind]
        t0 = time.perf_counter()
        result = call()
        if kind:
            await result
        times[kind].add(round_, time.perf_counter() - t0)
    ctx.close()
    await graph.unload()
    return Trip(*times)


def caller_thread_round_trip(compiled: Any, ctx: Any, tensors: dict[str, wasinn.Tensor],
                             inputs: dict[str, Any], iters: int) -> tuple[Timings, Timings]:
    """In a thread of the caller's own: times of the direct call and of
    ``ctx.compute_in_caller_thread``, in alternating blocks."""
    calls = (functools.partial(compiled.run, tensors),
             functools.partial(ctx.compute_in_caller_thread, inputs))
    for kind in warm_up(len(calls), iters):
        calls[kind]()
    direct, scheduled = Timings(), Timings()
    times = (direct, scheduled)
    for round_, kind in alternating(len(calls), iters):
        call = calls[kind]
        t0 = time.perf_counter()
        call()
        times[kind].add(round_, time.perf_counter() - t0)
    return direct, scheduled


async def both_round_trips(rt: wasinn.Runtime, builders: list[bytes], inputs: dict[str, Any],
                           iters: int, backend: str = "onnxruntime"
                           ) -> tuple[Trip, tuple[Timings, Timings]]:
    """The worker-thread :class:`Trip` and (direct, compute_in_caller_thread) times."""
    trip = await round_trip(rt, builders, inputs, iters, backend)
    graph = await rt.load(builders, "onnx", backend=backend)
    compiled = compiled_of(rt).compiled
    ctx = graph.init_execution_context()
    tensors = {k: wasinn.Tensor.from_numpy(v) for k, v in inputs.items()}
    caller = await trio.to_thread.run_sync(caller_thread_round_trip, compiled, ctx, tensors,
                                           inputs, iters)
    ctx.close()
    await graph.unload()
    return trip, caller


def halt_polling() -> str:
    """", guest_halt_poll_ns = N" on a KVM guest using cpuidle-haltpoll, else ""."""
    knob = Path("/sys/module/haltpoll/parameters/guest_halt_poll_ns")
    try:
        return f", guest_halt_poll_ns = {knob.read_text().strip()}"
    except OSError:
        return ""


def wakeup_latency(rounds: int = 2000) -> float:
    """Median round trip (seconds) of a two-thread queue ping-pong: two wake-ups."""
    ping: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    pong: queue.SimpleQueue[int] = queue.SimpleQueue()

    def echo() -> None:
        while (item := ping.get()) is not None:
            pong.put(item)

    thread = threading.Thread(target=echo)
    thread.start()
    times = []
    for i in range(rounds):
        t0 = time.perf_counter()
        ping.put(i)
        pong.get()
        times.append(time.perf_counter() - t0)
    ping.put(None)
    thread.join()
    return statistics.median(times)


def rate_in_threads(threads: int, seconds: float,
                    step_for: Callable[[], Callable[[], object]]) -> float:
    """Calls a second from ``threads`` threads, each calling its own ``step_for()`` (made
    before the clock starts) over and over, at least once, until ``seconds`` have passed;
    divided by the time from the start to the last call's end, so that the calls still
    running at the deadline are paid for."""
    steps = [step_for() for _ in range(threads)]
    counts = [0] * threads
    start = time.perf_counter()
    ends = [start] * threads
    stop = start + seconds

    def worker(i: int) -> None:
        step = steps[i]
        while time.perf_counter() < stop or not counts[i]:
            step()
            counts[i] += 1
            ends[i] = time.perf_counter()

    pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return sum(counts) / (max(ends) - start)


async def rate_in_tasks(tasks: int, seconds: float,
                        step_for: Callable[[], Callable[[], Awaitable[object]]]) -> float:
    """Calls a second from ``tasks`` trio tasks, each awaiting its own ``step_for()`` (made
    before the clock starts) over and over, at least once, until ``seconds`` have passed
    on trio's clock; divided by the time from the start to the last call's end, as
    :func:`rate_in_threads`."""
    steps = [step_for() for _ in range(tasks)]
    done = 0
    start = end = trio.current_time()
    stop = start + seconds

    async def task(step: Callable[[], Awaitable[object]]) -> None:
        nonlocal done, end
        mine = 0
        while trio.current_time() < stop or not mine:
            await step()
            mine += 1
            end = trio.current_time()  # one thread: the latest end is the last set
        done += mine

    async with trio.open_nursery() as nursery:
        for step in steps:
            nursery.start_soon(task, step)
    return done / (end - start)


def library_step(backend: str, compiled: Any,
                 inputs: dict[str, Any]) -> Callable[[], Callable[[], object]]:
    """A maker of the library's own call on ``compiled`` (a graph of ``backend``) with
    ``inputs`` (numpy arrays by input name), one for each thread, as
    ``backend_overhead.py``'s ``SETUPS`` make them: no wasinn code runs in the call.
    OpenVINO gets an infer request per thread (a request runs one inference at a time);
    its ``infer`` copies the outputs into new arrays, as wasinn does.

    Raises SystemExit for a backend with no such call here."""
    if backend == "onnxruntime":
        session = compiled.session
        return lambda: functools.partial(session.run, None, inputs)
    if backend == "openvino":
        model = compiled.compiled_model

        def request_for() -> Callable[[], object]:
            request = model.create_infer_request()
            return functools.partial(request.infer, inputs, share_inputs=True)

        return request_for
    raise SystemExit(f"--backends: no native throughput baseline for {backend!r}; "
                     f"expected one of {', '.join(LIBRARY_CALLS)}")


#: The library call :func:`library_step` makes, by backend, as the report names it.
LIBRARY_CALLS = {"onnxruntime": "InferenceSession.run", "openvino": "InferRequest.infer"}


def rate_verdict(rate: float, native_best: float) -> str:
    """"" for a rate through wasinn that can be a result; :data:`DISTURBED` and why for
    one above :data:`DISTURBED_ABOVE` times ``native_best``, the library's own best rate
    on the same model (a ratio to it above 1 is noise; far above, the native side was
    slowed)."""
    if rate <= DISTURBED_ABOVE * native_best:
        return ""
    return (f"{DISTURBED} (above {DISTURBED_ABOVE:g}x the library's own best on the same "
            "model)")


def load_report(load: tuple[float, float, float] | None, cpus: int | None) -> str:
    """A line on the machine's load average (``os.getloadavg()``, None where there is
    none) against its CPU count, with a warning when the last minute's exceeds it: then
    other processes share the CPUs and every figure of the run is noise-bound."""
    if load is None:
        return "load average: not available on this platform"
    line = (f"load average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1 / 5 / 15 min) "
            f"on {cpus or '?'} CPU(s)")
    if cpus and load[0] > cpus:
        line += (": WARNING: more runnable work than CPUs; other processes will disturb "
                 "these figures, the native baselines included")
    return line


def print_load() -> None:
    """Prints :func:`load_report` for this machine now."""
    try:
        load: tuple[float, float, float] | None = os.getloadavg()
    except (AttributeError, OSError):
        load = None
    print(load_report(load, os.cpu_count()), flush=True)


def native_throughput(backend: str, compiled: Any, inputs: dict[str, Any], threads: int,
                      seconds: float) -> float:
    return rate_in_threads(threads, seconds, library_step(backend, compiled, inputs))


async def scheduled_throughput(graph: wasinn.Graph, inputs: dict[str, Any], callers: int,
                               seconds: float) -> float:
    """``callers`` trio tasks, each awaiting ``ctx.compute`` on a context of its own."""
    contexts: list[wasinn.ExecutionContext] = []

    def step_for() -> Callable[[], Awaitable[object]]:
        contexts.append(ctx := graph.init_execution_context())
        return functools.partial(ctx.compute, inputs)

    try:
        return await rate_in_tasks(callers, seconds, step_for)
    finally:
        for ctx in contexts:
            ctx.close()


def guest_throughput(graph: wasinn.Graph, inputs: dict[str, Any], guests: int,
                     seconds: float) -> float:
    """``guests`` threads of their own, each computing with its own context as guests do
    (``compute_in_caller_thread``); in a thread, so that trio serves them meanwhile."""
    contexts: list[wasinn.ExecutionContext] = []

    def step_for() -> Callable[[], object]:
        contexts.append(ctx := graph.init_execution_context())
        return functools.partial(ctx.compute_in_caller_thread, inputs)

    try:
        return rate_in_threads(guests, seconds, step_for)
    finally:
        for ctx in contexts:
            ctx.close()


class Load(NamedTuple):
    """One throughput configuration's best round, and how its runs went."""

    rate: float
    runs: int
    passed_on: int  #: runs a worker thread started as the run before ended
    in_callers: int  #: runs in the callers' own threads


async def throughput(rt: wasinn.Runtime, graph: wasinn.Graph, image: Any, backend: str,
                     workers: int, args: argparse.Namespace) -> None:
    """Item 3 for ``graph`` (loaded on ``backend``): 1, 4 and 16 concurrent callers in
    trio, and as many guest threads, against the library's best from 1 or ``workers``
    plain threads, with how many runs a worker thread started on its own as the run
    before ended (the slot passed on)."""
    compiled = compiled_of(rt).compiled
    (actor,) = rt.actors
    # Rounds interleave every configuration, and each keeps its best round, so that a
    # burst of load from other processes does not decide a comparison.
    native: dict[int, float] = {}
    loads: dict[tuple[str, int], Load] = {}
    for _ in range(args.rounds):
        for t in sorted({1, workers}):
            native[t] = max(native.get(t, 0.0),
                            native_throughput(backend, compiled, {"input": image}, t,
                                              args.seconds))
        for how in ("trio", "guest"):
            for callers in (1, 4, 16):
                before = actor.stats()
                if how == "trio":
                    got = await scheduled_throughput(graph, {"input": image}, callers,
                                                     args.seconds)
                else:
                    got = await trio.to_thread.run_sync(
                        guest_throughput, graph, {"input": image}, callers, args.seconds)
                after = actor.stats()
                if got > loads.get((how, callers), Load(0.0, 0, 0, 0)).rate:
                    loads[how, callers] = Load(
                        got, after.completed - before.completed,
                        after.passed_on - before.passed_on,
                        after.in_caller_thread - before.in_caller_thread)
    best_threads = max(native, key=lambda t: native[t])
    best = native[best_threads]
    print(f"throughput on {backend}: native best (the library's own "
          f"{LIBRARY_CALLS[backend]}) {best:.1f} inferences/s ({best_threads} thread(s); "
          + ", ".join(f"{t} thread(s): {v:.1f}/s" for t, v in native.items()) + ")")
    for (how, callers), load in loads.items():
        who = "concurrent callers" if how == "trio" else "guest threads"
        where = "" if how == "trio" else f", {load.in_callers} in the guests' own threads"
        note = rate_verdict(load.rate, best)
        print(f"  {callers:2d} {who:<18}: {load.rate:.1f} inferences/s, ratio to native best "
              f"{load.rate / best:.3f} ({load.passed_on} of {load.runs} runs started by the "
              f"worker thread as the run before ended{where})" + (f": {note}" if note else ""))


def context_figures(graph: wasinn.Graph, count: int) -> tuple[float, float]:
    """(contexts per second, bytes per context)."""
    start = time.perf_counter()
    contexts = [graph.init_execution_context() for _ in range(count)]
    rate = count / (time.perf_counter() - start)
    for ctx in contexts:
        ctx.close()
    del contexts
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    contexts = [graph.init_execution_context() for _ in range(10_000)]
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    size = sum(s.size_diff for s in after.compare_to(before, "filename")) / len(contexts)
    for ctx in contexts:
        ctx.close()
    return rate, size


def report_round_trip(backend: str, width: float, direct: Timings, sched: Timings,
                      path: str = "worker thread") -> None:
    low, high = interval(operator.truediv, sched, direct)
    ratio = sched.median / direct.median
    judged = verdict(low, high, 1.03, no_overhead=1.0)
    print(f"MobileNetV2-like w{width:g} batch 1 on {backend} ({path}): direct "
          f"{direct.median * 1e3:.2f} ms, scheduled {sched.median * 1e3:.2f} ms, ratio "
          f"{ratio:.3f} (overhead {(ratio - 1) * 100:+.1f} %, 95 % interval "
          f"{(low - 1) * 100:+.1f} to {(high - 1) * 100:+.1f} % over "
          f"{len(direct.rounds)} rounds; goal <= 3 %: {judged})")


def report_tiny(path: str, direct: Timings, sched: Timings) -> None:
    low, high = interval(operator.sub, sched, direct)
    print(f"tiny model round trip ({path}): direct {direct.median * 1e6:.1f} us, scheduled "
          f"{sched.median * 1e6:.1f} us, overhead {(sched.median - direct.median) * 1e6:.1f} us "
          f"(95 % interval {low * 1e6:.1f} to {high * 1e6:.1f} us; goal <= 60 us: "
          f"{verdict(low, high, 60e-6, no_overhead=0.0)})")


def report_handoff(trip: Trip) -> None:
    """The worker-thread overhead split into the bare hand-off and what wasinn adds."""
    direct, handed_off = trip.direct.median, trip.handed_off.median
    handoff = handed_off - direct
    above = trip.scheduled.median - handed_off
    print(f"  of which the thread hand-off itself (the direct call run by the same worker "
          f"thread): {handoff * 1e6:.1f} us; scheduler, queue and context on top: "
          f"{above * 1e6:.1f} us ({above / direct * 100:+.1f} % of the direct call)")


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        files = export_mobilenet(Path(tmp), width=args.width, seed=0)
        mobilenet = [files.onnx.read_bytes()]
    image = sample_image(0)
    default = wasinn.Runtime()
    workers = default.config.pools["cpu"].workers
    worker_path, tiny_path = "worker thread", "default config: worker thread"
    if args.pin_handoffs:
        default = cpu_pool(workers, pin_handoffs=True)
        worker_path = tiny_path = "worker thread, pinned hand-offs"
    print_load()
    async with default as rt:
        print(f"devices: {[d.name for d in rt.devices]}, cpu workers: {workers}"
              + (", pin_handoffs = true" if args.pin_handoffs else ""))

        print(f"this machine's cross-thread wake-up: two-thread queue ping-pong "
              f"{wakeup_latency() * 1e6:.1f} us per round trip{halt_polling()}")
        tiny = {"x": np.ones((1, 4), np.float32)}
        trip, caller = await both_round_trips(rt, [affine_onnx()], tiny, args.iters * 10)
        report_tiny(tiny_path, trip.direct, trip.scheduled)
        report_handoff(trip)
        report_tiny("caller's thread", *caller)
        if not args.pin_handoffs:
            # Inline runs are opt-in (off in the default config): enable them explicitly.
            async with cpu_pool(workers, inline_below_us=INLINE_BELOW_US) as rt_inline:
                direct, sched, _ = await round_trip(rt_inline, [affine_onnx()], tiny,
                                                    args.iters * 10)
            report_tiny(f"opt-in inline, inline_below_us={INLINE_BELOW_US:g}: on the event "
                        "loop once timed", direct, sched)

        trip, caller = await both_round_trips(rt, mobilenet, {"input": image}, args.iters)
        report_round_trip("onnxruntime", args.width, trip.direct, trip.scheduled,
                          worker_path)
        report_handoff(trip)
        report_round_trip("onnxruntime", args.width, *caller, path="caller's thread")

        graph = await rt.load(mobilenet, "onnx")
        await throughput(rt, graph, image, "onnxruntime", workers, args)
        rate, size = context_figures(graph, 100_000)
        print(f"contexts: {rate:,.0f} created/s (goal >= 100,000), {size:.0f} bytes each "
              "(goal <= 2048)")
        await graph.unload()

        # Other backends last: OpenVINO's thread pool outlives its graphs and was seen to
        # slow the ONNX Runtime figures measured after it on a 2-core machine.
        for backend in args.backends.split(","):
            if backend and backend != "onnxruntime":
                trip, caller = await both_round_trips(
                    rt, mobilenet, {"input": image}, args.iters, backend)
                report_round_trip(backend, args.width, trip.direct, trip.scheduled,
                                  worker_path)
                report_handoff(trip)
                report_round_trip(backend, args.width, *caller, path="caller's thread")
                graph = await rt.load(mobilenet, "onnx", backend=backend)
                await throughput(rt, graph, image, backend, workers, args)
                await graph.unload()


def pinned_run(argv: list[str]) -> None:
    """The same measurements in a fresh process with pinned hand-offs (see the module
    docstring), where this platform has them."""
    print()
    if (reason := unsupported_reason()) is not None:
        print(f"pinned hand-offs (pin_handoffs = true): not measured: {reason}")
        return
    print("the same in a fresh process, opt-in pinned hand-offs (pin_handoffs = true):",
          flush=True)
    subprocess.run([sys.executable, __file__, *argv, "--pin-handoffs"], check=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=600)
    parser.add_argument("--width", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backends", default="onnxruntime,openvino",
                        help="backends for the MobileNetV2-like round trip")
    parser.add_argument("--pin-handoffs", action="store_true",
                        help="measure a CPU pool with pin_handoffs = true (only)")
    parser.add_argument("--no-pinned", action="store_true",
                        help="do not measure pinned hand-offs in a second process")
    arguments = parser.parse_args()
    trio.run(main, arguments)
    if not (arguments.pin_handoffs or arguments.no_pinned):
        pinned_run(sys.argv[1:])
