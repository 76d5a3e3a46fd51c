"""Sandbox processes started ahead of the loads they will serve.

A sandboxed load (see :mod:`.sandbox`) needs a process that has imported the backend's
library: 0.1-0.3 s for ONNX Runtime and OpenVINO, 1.4 s for torch on the machine this
was measured on, each time, before the model is even read. :class:`Spares` keeps that
many processes started and waiting for each kind of load it has served (a backend,
confined for the CPU, confined for a GPU, or not confined), so that the next load of
that kind (another guest's model, the reload after a crash) only loads the model. The
first load of each kind starts its own process, and then one spare. A spare is started
once a load has ended, so that its imports do not compete with that load, and it
imports at the lowest CPU priority, so that it does not compete with runs either
(measured on 2 vCPUs with torch: a guest's first run right after its load took 270-360
ms beside a spare importing at normal priority, 47-52 ms with no spare). A load takes a
spare only once it has imported its library; until then the load starts a process of
its own. A spare that cannot be started is logged, never raised: the load it follows
has succeeded.

A spare holds the memory of an interpreter that has imported the library (unshared:
29 MB for ONNX Runtime, 31 MB for OpenVINO, 153 MB for torch) and nothing else: closing
the pool, or a spare that is no longer wanted, kills it. A spare that has died meanwhile
is replaced when it is taken. Spares are started with the environment of the load before them.
A pool's processes, spares included, are given the environment variables the pool is
given (``extra_env``: the runtime's ``[runtime] sandbox_env``) besides the default ones
where they are confined: known as the pool is made, before its first process starts, so
no process started with other variables is ever handed out by it. So are the folders and
files they may read besides the default ones (``extra_read``: ``[runtime]
sandbox_read``), each resolved as a process starts (a spare: when it is started, ahead of
its load), one not there then left out (see :mod:`._sandbox_read`).

The pool also holds the host's bound on sandbox processes (:class:`~._sandbox_limit.
ProcessLimit`; by default the process-wide one, :func:`~._sandbox_limit.host_limit`),
which every process it starts counts towards, spares included: a spare is started only
below the bound, and is the first process ended when a load or a run needs room at it.

Thread-safe: loads on several worker threads share one pool.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Iterable

from ._sandbox_env import env_patterns
from ._sandbox_limit import ProcessLimit, host_limit
from ._sandbox_process import SandboxProcess
from ._sandbox_read import read_paths
from .base import BackendRef

log = logging.getLogger("wasinn.backends")

#: The most spares a pool may keep per kind of load.
MAX_SPARES = 8


class Spares:
    """Up to ``keep`` started sandbox processes per kind of load (see the module
    docstring); ``keep = 0`` keeps none, every load starting its own. ``limit``: the
    bound its processes count against (by default the one every sandbox process of this
    Python process shares, :func:`~._sandbox_limit.host_limit`). ``extra_env``: the
    host's environment variables its confined processes are given besides the default
    ones, each a name or a prefix ending in ``*`` (ValueError for one that is neither,
    or ``*`` alone: see :mod:`._sandbox_env`). ``extra_read``: the folders and files its
    confined processes may read besides the default ones, each an absolute path
    (ValueError for a relative one, ``/``, or a folder that holds the system temporary
    folder: see :mod:`._sandbox_read`; one not there is left out while it is missing)."""

    def __init__(self, keep: int = 1, *, limit: ProcessLimit | None = None,
                 extra_env: Iterable[str] = (), extra_read: Iterable[str] = ()) -> None:
        if not 0 <= keep <= MAX_SPARES:
            raise ValueError(f"keep={keep}: expected 0 to {MAX_SPARES}")
        self.keep = keep
        #: The host's variables its confined processes are given besides the default ones.
        self.extra_env = env_patterns(extra_env)
        #: The paths its confined processes may read besides the default ones.
        self.extra_read = read_paths(extra_read)
        #: The bound on the host's sandbox processes, these spares included.
        self.limit = host_limit() if limit is None else limit
        self._lock = threading.Lock()
        self._waiting: dict[tuple[str, bool, bool], list[SandboxProcess]] = {}
        self._closed = False

    def take(self, backend: BackendRef, confined: bool, *, make_room: bool = True,
             gpu: bool = False) -> SandboxProcess | None:
        """A process for a load with ``backend`` (``confined``, and ``gpu``: one that may
        use the GPUs' device files, see :class:`SandboxProcess`): a live spare that has
        imported its library if there is one, else a new process. A spare still importing stays for
        a later load: at the lowest priority, it may be starved for as long as the
        machine is busy, which a load must not wait for. At the host's bound on sandbox
        processes, a new one is started after another has been ended or waited for
        (see :class:`~._sandbox_limit.ProcessLimit`), or, unless ``make_room``, not at
        all: None. BackendRuntimeError when no process can be started (or the job was
        cancelled while waiting for room)."""
        taken = self._ready_spare(SandboxProcess.key_of(backend, confined, gpu))
        if taken is not None:
            return taken
        slot = self.limit.admit(backend.name) if make_room else self.limit.try_admit()
        return None if slot is None else SandboxProcess(backend, confined, gpu=gpu, slot=slot,
                                                        extra_env=self.extra_env,
                                                        extra_read=self.extra_read)

    def _ready_spare(self, key: tuple[str, bool, bool]) -> SandboxProcess | None:
        """A waiting spare of ``key`` that has imported its library, taken from the pool
        and from the processes the limit may end (spares found dead are forgotten)."""
        dead: list[SandboxProcess] = []
        taken = None
        with self._lock:
            waiting = self._waiting.get(key, [])
            for spare in list(waiting):
                if spare.process.poll() is not None:
                    waiting.remove(spare)
                    if self.limit.claim(spare):  # (else ended to make room, by another)
                        dead.append(spare)
                elif spare.ready() and self.limit.claim(spare):
                    waiting.remove(spare)
                    taken = spare
                    break
        for spare in dead:
            log.debug("spare sandbox process %d for %s had ended (%s)", spare.process.pid,
                      key[0], spare.ended())
        return taken

    def replenish(self, backend: BackendRef, confined: bool, *, gpu: bool = False) -> None:
        """Start spares for loads like this one (see :meth:`take`) until ``keep`` wait
        (none once closed, nor at the host's bound on sandbox processes). A process that
        cannot be started is logged, not raised (its slot freed): the next load starts its
        own. Called right after a load, which this must not fail."""
        key = SandboxProcess.key_of(backend, confined, gpu)
        while True:
            with self._lock:
                if self._closed or len(self._waiting.get(key, ())) >= self.keep:
                    return
            slot = self.limit.try_admit()
            if slot is None:
                log.debug("no spare sandbox process started for %s: the host runs its most "
                          "sandbox processes (%d)", key[0], self.limit.most)
                return
            try:
                spare = SandboxProcess(backend, confined, gpu=gpu, spare=True, slot=slot,
                                       extra_env=self.extra_env, extra_read=self.extra_read)
            except Exception as exc:  # (BackendRuntimeError, naming what failed)
                slot.free()  # (freed already where the process was tried: idempotent)
                log.warning("no spare sandbox process started for %s: %s", key[0], exc)
                return
            with self._lock:
                waiting = self._waiting.setdefault(key, [])
                kept = not self._closed and len(waiting) < self.keep
                if kept:
                    waiting.append(spare)
                    self.limit.idle(spare, functools.partial(self._end, spare), spare=True)
            if not kept:  # closed, or another thread filled the place meanwhile
                spare.close()
                return
            log.debug("spare sandbox process %d started for %s", spare.process.pid, key[0])

    def _end(self, spare: SandboxProcess) -> None:
        """End ``spare`` to make room for another process (the limit's call)."""
        with self._lock:
            for waiting in self._waiting.values():
                if spare in waiting:
                    waiting.remove(spare)
        log.debug("spare sandbox process %d ended to make room for another",
                  spare.process.pid)
        spare.close()

    def waiting(self) -> int:
        """How many spares are waiting, of every kind."""
        with self._lock:
            return sum(len(w) for w in self._waiting.values())

    def ready(self) -> int:
        """How many of them have imported their library (a load would take them)."""
        with self._lock:
            return sum(spare.ready() for w in self._waiting.values() for spare in w)

    def close(self) -> None:
        """Kill every spare; later loads start their own processes. Idempotent."""
        with self._lock:
            self._closed = True
            spares = [s for waiting in self._waiting.values() for s in waiting]
            self._waiting.clear()
        for spare in spares:
            if self.limit.claim(spare):  # else being ended to make room, by another
                spare.close()

