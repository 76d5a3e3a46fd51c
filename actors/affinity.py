"""Keeping the event loop and a pool's worker threads on one CPU while they hand work to
each other: a pool's ``pin_handoffs`` (opt-in, Linux).

A request that runs in a worker thread costs two cross-thread wake-ups: the event loop
wakes the worker, the worker wakes the loop. When the woken thread last ran on another
CPU that is idle, the kernel wakes that CPU with an inter-processor interrupt; on a KVM
guest that does not poll before halting an idle vCPU (``guest_halt_poll_ns`` = 0) that
is a VM exit and entry each time, tens of microseconds. A wake-up on the waker's own CPU
is a plain context switch. Measured on a 2-vCPU KVM guest (2026-11-21): a bare trio
thread hand-off 116-151 us across the two vCPUs, 41-47 us with both threads on one.

What pinning does, per job handed to a pinned pool's worker thread:

- The event loop: while at least one pinned job is out, the trio thread may run only on
  the first CPU of its own mask: ONNX Runtime and OpenVINO keep that one for the thread
  that calls them and pin their own threads to the others, so the worker, which runs
  there, does not fight them for a core (homed on the CPU the loop happened to be on, a
  run shared it with ONNX Runtime's pinned thread: 0.36x the throughput). The loop's
  own mask is restored when the last job is back, so between requests, and in a
  program that is not computing, the loop is free to move.
- The worker: it waits for jobs on the loop's CPU; for the job itself it may run on
  every CPU the loop could, so a backend's run, and any thread that run starts (ONNX
  Runtime's intra-op pool, OpenVINO's TBB arena, torch's OpenMP team, which inherit the
  mask of the thread that starts them), use every core as before. It hands the result
  back from wherever the run left it: the loop is woken on its own CPU anyway.
- Jobs that compile or warm up a graph see the loop unpinned (:meth:`LoopPin.suspend`),
  and OpenVINO's own CPU pinning is off for graphs compiled on such a pool
  (``LoadOptions.thread_pinning``): libraries size and pin their thread pools from the
  process's mask, which is the main thread's, often the trio thread.

Measured with ``benchmarks/scheduler_overhead.py`` on that VM: a tiny model's round trip
through the worker thread 117-133 us over the direct call by default, 45-63 us pinned;
MobileNetV2-like runs (3 ms) showed no gain in the benchmark's ratios (ONNX Runtime
+3.9-5.3 % pinned, +3.5-4.9 % not; timed phase by phase, the two hand-offs of such a
run took 90 us pinned against 170 us not, but the run-to-run spread hides it). OpenVINO
threads that a graph compiled with its pinning on (in another pool of the process) has
pinned stay so, and slowed the pinned pool's OpenVINO runs from 3.6 to 6.0 ms.

The price, and why it is off by default: a thread that the trio thread itself starts
while a pinned job is out inherits its one-CPU mask for life (``trio.to_thread``'s
cached threads included), so CPU-heavy work a program sends to such threads shares one
core. A program that changes the trio thread's affinity while a pinned job is out has
its change undone when the last one is back. Enable it where the loop does little but
serve requests, and where latency of small models matters.
"""

from __future__ import annotations

import contextlib
import os

import trio

__all__ = ["LoopPin", "loop_pin", "pin_current_thread", "unsupported_reason"]

#: The mask every thread may narrow to or widen back from, as os.sched_*affinity use it.
Mask = frozenset[int]


def unsupported_reason() -> str | None:
    """Why pinning cannot work here (a sentence), or None where it can."""
    if not hasattr(os, "sched_setaffinity"):
        return "this platform has no os.sched_setaffinity (it is Linux only)"
    return None


def pin_current_thread(cpus: Mask) -> bool:
    """Let the calling thread run only on ``cpus``; False (and nothing changed) if the
    kernel refuses (a CPU gone offline, a cgroup's cpuset changed meanwhile)."""
    try:
        os.sched_setaffinity(0, cpus)  # 0: the calling thread, on Linux
    except OSError:
        return False
    return True


class LoopPin:
    """The trio thread's side: pinned while at least one pinned job is out, unless a job
    that must not see it pinned is out.

    Those are the jobs that compile (or warm up) a graph, where backends create their
    thread pools: a library that sizes or pins them from the process's mask (the main
    thread's, which is often the trio thread) must not see it held to one CPU. OpenVINO
    pins its threads from it at a graph's first run, too: with the loop held then, its
    runs went to one core, 1.7x slower (measured on 2 vCPUs), which is why graphs
    compiled on a pinned pool have its CPU pinning off (``LoadOptions.thread_pinning``).

    Used from the trio thread only (no lock). Get the run's one with :func:`loop_pin`.
    """

    __slots__ = ("_held", "_saved", "_suspended")

    def __init__(self) -> None:
        self._held = 0
        self._suspended = 0
        self._saved: Mask | None = None  # the loop's own mask, while it is pinned

    @property
    def held(self) -> int:
        """Pinned jobs out now."""
        return self._held

    @property
    def pinned(self) -> bool:
        """Whether the trio thread is held to one CPU now."""
        return self._saved is not None

    def hold(self) -> tuple[Mask, Mask] | None:
        """A pinned job leaves: the mask its worker should wait and hand back under (the
        first CPU of the loop's mask, which is where ONNX Runtime and OpenVINO expect
        the thread that calls them: they pin their own threads to the others), and the
        mask to run the job under (the loop's own). None when the loop cannot be pinned
        now (a job of :meth:`suspend` is out, or the kernel refused): then the job runs
        as an unpinned one, not to be released."""
        if self._suspended:
            return None
        if self._saved is None:
            mask = frozenset(os.sched_getaffinity(0))
            if not pin_current_thread(frozenset((min(mask),))):
                return None
            self._saved = mask
        self._held += 1
        return frozenset((min(self._saved),)), self._saved

    def release(self) -> None:
        """A job :meth:`hold` pinned is back (or given up on for good): the last one
        gives the loop its own mask back."""
        if self._held <= 0:
            raise RuntimeError("LoopPin.release() without a hold()")
        self._held -= 1
        if self._held == 0:
            self._unpin()

    def suspend(self) -> None:
        """A job that must see the loop's own mask leaves: the loop gets it back now,
        and no job is pinned until :meth:`resume` (jobs pinned already still hand back
        on the loop's CPU, to a loop that may have moved: slower, not wrong)."""
        self._suspended += 1
        self._unpin()

    def resume(self) -> None:
        """A job of :meth:`suspend` is back."""
        if self._suspended <= 0:
            raise RuntimeError("LoopPin.resume() without a suspend()")
        self._suspended -= 1

    def _unpin(self) -> None:
        if self._saved is not None:
            pin_current_thread(self._saved)
            self._saved = None


_LOOP_PIN: trio.lowlevel.RunVar[LoopPin] = trio.lowlevel.RunVar("wasinn_loop_pin")


def loop_pin() -> LoopPin:
    """The current trio run's :class:`LoopPin` (every pinned pool of the run shares it)."""
    with contextlib.suppress(LookupError):
        return _LOOP_PIN.get()
    pin = LoopPin()
    _LOOP_PIN.set(pin)
    return pin
