"""The bound on the sandbox processes one host runs at once (``[runtime]
max_sandbox_processes``).

The host is this Python process: :func:`host_limit` is its bound, one
:class:`ProcessLimit` of :func:`default_max_processes` (which the machine sets), made on
first use and shared by everything that starts sandbox processes here without a bound
of its own: :func:`~.sandbox.load_sandboxed` without spares, :class:`~._sandbox_spares.
Spares` made without a limit, and so every ``wasinn.Runtime`` whose configuration leaves
``[runtime] max_sandbox_processes`` unset. Two such runtimes in one process share the
machine's bound rather than each run up to it. A runtime that sets the key bounds its
own processes by a limit of that size instead (counted apart from the host's: the key
is the operator's word for that runtime).

Every sandboxed graph holds a process of its own (up to one per worker of its device),
each with its own copy of the model and each allowed ``max_sandbox_bytes``; spares wait
beside them (see :mod:`._sandbox_spares`). Many guests, each within its own limits,
could together make the host start processes until its memory or its PIDs ran out.
:class:`ProcessLimit` counts every sandbox process, spares included (each holds memory
and a PID too), from before it is started until it has ended, and bounds them. A
process that must start at the bound makes room, as an inference server unloads the
model used least recently:

1. it ends a waiting spare (the oldest), which only saved a library import;
2. else the idle process of a graph that ran least recently: that graph starts a process
   again, and loads its model, on its next run, as after a crash, though this counts as
   none (see :mod:`._sandbox_backoff`);
3. else, every process being busy in a run or a load, it waits until one is idle or has
   ended (each does: a run ends, fails or is cancelled, its process killed
   ``CANCEL_GRACE_S`` later), honouring its job's cancellation (a request's deadline).
   Refusing instead would fail a good request for a moment's burst; waiting is what a
   request queue does, and the caller's deadline still bounds it.

Only a start that a graph cannot run without (its load, or its run when it has no
process left) makes room so. A graph that has a process busy starts another, for a run
beside it, only below the bound, and otherwise queues that run for its own process: two
busy graphs do not take each other's copies in turn. A spare is started only below the
bound, and never ends anything.

Thread-safe. Its lock is never held while it calls out (a process's owner ends it), so
an owner may call it while holding its own lock.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Callable, Hashable

from wasinn._memory import total_memory
from wasinn.errors import BackendRuntimeError

from .base import on_current_cancel

#: The memory a sandbox process is reckoned to take, for the default bound: an
#: interpreter with its library imported (29 MB for ONNX Runtime to 153 MB for torch,
#: unshared) and a small model.
MEMORY_PER_PROCESS = 256 * 1024 * 1024
#: Processes per CPU, for the default bound: a run takes every core (the library's
#: threads), so more than a few busy at once only take turns.
PROCESSES_PER_CPU = 8
#: The least default bound, on the smallest machine.
LEAST_DEFAULT = 4


def default_max_processes() -> int:
    """The default bound on a host's sandbox processes, from the machine: one per
    :data:`MEMORY_PER_PROCESS` of half its memory (the machine's or, where less, this
    process's cgroup's limit, :func:`wasinn._memory.total_memory`; the other half left
    to the host and the models), at most :data:`PROCESSES_PER_CPU` per CPU this process
    may use, and at least :data:`LEAST_DEFAULT`."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    memory = total_memory()
    return max(LEAST_DEFAULT, min(PROCESSES_PER_CPU * cpus, memory // 2 // MEMORY_PER_PROCESS))


# The host's bound, made by host_limit on first use (tests replace it).
_host_limit: ProcessLimit | None = None
_host_limit_lock = threading.Lock()


def host_limit() -> ProcessLimit:
    """The bound on every sandbox process of this Python process that is not counted
    against a bound of its own (see the module docstring): a :class:`ProcessLimit` of
    :func:`default_max_processes`, made on the first call (thread-safe) and the same
    object on every call."""
    global _host_limit  # noqa: PLW0603 (one bound for the process is the point)
    with _host_limit_lock:
        if _host_limit is None:
            _host_limit = ProcessLimit()
        return _host_limit


class Slot:
    """The place of one process under a :class:`ProcessLimit`: held from before the
    process starts until it has ended (:meth:`free`, idempotent)."""

    __slots__ = ("_limit", "held")

    def __init__(self, limit: ProcessLimit) -> None:
        self._limit = limit
        self.held = True

    def free(self) -> None:
        self._limit._free(self)


class ProcessLimit:
    """At most ``most`` sandbox processes at once (None: :func:`default_max_processes`);
    see the module docstring."""

    def __init__(self, most: int | None = None) -> None:
        if most is not None and most < 1:
            raise ValueError(f"most={most}: expected at least 1 sandbox process (None: "
                             "the default, from the machine)")
        self.most = default_max_processes() if most is None else most
        self._cond = threading.Condition()
        self._live = 0
        # Processes that may be ended to make room, least recently idle first, each with
        # what ends it (its owner forgets it, then closes it).
        self._spares: collections.OrderedDict[Hashable, Callable[[], None]] = (
            collections.OrderedDict())
        self._idle: collections.OrderedDict[Hashable, Callable[[], None]] = (
            collections.OrderedDict())
        # Threads in admit: a spare's try_admit leaves them the slots that free up.
        self._wanting = 0
        #: How many idle processes of graphs were ended to make room (spares not counted).
        self.ended_idle = 0

    @property
    def live(self) -> int:
        """The processes counted now: started, or about to be, and not yet ended."""
        with self._cond:
            return self._live

    @property
    def wanting(self) -> int:
        """The starts waiting for a slot (or ending a process to make one)."""
        with self._cond:
            return self._wanting

    def try_admit(self) -> Slot | None:
        """A slot for a process, if one is free now and no start that must have one is
        waiting (None otherwise): for a spare, or a graph's process beside a busy one."""
        with self._cond:
            if self._live >= self.most or self._wanting:
                return None
            return self._take()

    def admit(self, name: str) -> Slot:
        """A slot for a process ``name``'s load or run cannot go without: a free one, else
        one made by ending a spare or the idle process that ran least recently, else one
        waited for. BackendRuntimeError when the job is cancelled while it waits."""
        cancelled = threading.Event()
        forget = on_current_cancel(lambda: self._wake(cancelled))
        with self._cond:
            self._wanting += 1
        try:
            while True:
                got = self._slot_or_victim(name, cancelled)
                if isinstance(got, Slot):
                    return got
                got()  # ends that process: its slot frees up, for the next pass
        finally:
            forget()
            with self._cond:
                self._wanting -= 1
                self._cond.notify_all()

    def idle(self, process: Hashable, end: Callable[[], None], *, spare: bool = False
             ) -> None:
        """``process`` waits for a run (or, a ``spare``, for a load): it may be ended to
        make room, by calling ``end`` (outside this lock: it has its owner forget the
        process, then closes it), unless its owner :meth:`claim` s it first."""
        queue = self._spares if spare else self._idle
        with self._cond:
            queue[process] = end
            queue.move_to_end(process)
            self._cond.notify_all()

    def claim(self, process: Hashable) -> bool:
        """Take ``process`` back from the idle ones, to use or close it: False when it is
        being ended to make room (then whoever ends it closes it)."""
        with self._cond:
            return (self._idle.pop(process, None) is not None
                    or self._spares.pop(process, None) is not None)

    def _slot_or_victim(self, name: str, cancelled: threading.Event
                        ) -> Slot | Callable[[], None]:
        with self._cond:
            while True:
                if self._live < self.most:
                    return self._take()
                if self._spares:
                    return self._spares.popitem(last=False)[1]
                if self._idle:
                    self.ended_idle += 1
                    return self._idle.popitem(last=False)[1]
                if cancelled.is_set():
                    raise BackendRuntimeError(
                        f"{name}: cancelled while waiting for a sandbox process: the host "
                        f"runs its most, {self.most} ([runtime] max_sandbox_processes), "
                        "and every one was busy")
                self._cond.wait()

    def _take(self) -> Slot:
        self._live += 1
        return Slot(self)

    def _free(self, slot: Slot) -> None:
        with self._cond:
            if slot.held:
                slot.held = False
                self._live -= 1
                self._cond.notify_all()

    def _wake(self, cancelled: threading.Event) -> None:
        cancelled.set()
        with self._cond:
            self._cond.notify_all()
