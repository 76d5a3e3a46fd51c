"""The processes of one sandboxed graph (see :mod:`.sandbox`): each started with the model
loaded, taken by a run and given back after it, and ended to make room for another
graph's.

:class:`GraphProcesses` is the part of :class:`~.sandbox.SandboxedGraph` that keeps them:
up to ``processes`` at once, idle or busy. A process is taken from the graph's spares, or
started, under the host's bound on sandbox processes (:mod:`._sandbox_spares`,
:mod:`._sandbox_limit`), when a run finds every other one busy, or after a crash once the
graph's back-off allows (:mod:`._sandbox_backoff`); an idle one may be ended to make room
for another graph's. The state it works on is the graph's, set in its ``__init__`` and
guarded by its condition ``_cond``, notified when a process becomes idle or goes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import weakref
from collections.abc import Mapping
from typing import Any

from wasinn.enums import GraphEncoding
from wasinn.errors import (
    BackendRuntimeError,
    ClosedResourceError,
    InvalidEncodingError,
    TooLargeError,
)
from wasinn.tensor import Tensor

from . import _confine
from ._sandbox_backoff import QUIET_S, CrashBackoff
from ._sandbox_errors import child_error
from ._sandbox_external import external_files
from ._sandbox_limit import ProcessLimit
from ._sandbox_process import OUTSIDE_SENDERS, SandboxProcess
from ._sandbox_spares import Spares
from .base import BackendRef, Builders, Device, LoadOptions, on_current_cancel

log = logging.getLogger("wasinn.backends")


class NoRoom(Exception):
    """No process was started beside a busy one: the host runs its most."""


class GraphProcesses:
    """The processes of a :class:`~.sandbox.SandboxedGraph` (see the module docstring):
    its ``__init__`` sets what follows."""

    device: Device
    processes: int
    backoff: CrashBackoff
    confinement: dict[str, Any] | None
    #: What crash and refusal errors and log lines start with (see the graph's).
    _name: str
    _backend: BackendRef
    _spares: Spares
    _limit: ProcessLimit
    _confined: bool
    _gpu: bool
    _load: tuple[GraphEncoding, Device, LoadOptions, int | None]
    _files: dict[str, Tensor]
    _external_of: tuple[Builders, GraphEncoding, LoadOptions]
    _cond: threading.Condition
    _closed: bool
    _idle: list[SandboxProcess]
    _busy: set[SandboxProcess]
    _starting: int

    # -- a process with the model loaded --------------------------------------------------
    def _start(self, *, make_room: bool = True) -> tuple[SandboxProcess, dict[str, Any]]:
        """A process that has loaded the model, and what it said of the model. Unless
        ``make_room``, at the host's bound on sandbox processes: :class:`NoRoom`, and
        nothing started."""
        # (first: a registered model's external data may be refused)
        files = {**self._files, **external_files(self._backend.name, *self._external_of)}
        child = self._spares.take(self._backend, self._confined, make_room=make_room,
                                  gpu=self._gpu)
        if child is None:
            raise NoRoom
        payload = self._load_in(child, files)
        try:
            # (after the load: a spare's imports would slow it; it raises nothing)
            self._spares.replenish(self._backend, self._confined, gpu=self._gpu)
            if self._confined:
                confined = payload.get("confined")
                self.confinement = confined if isinstance(confined, dict) else None
                _confine.log_report(self.confinement, "sandboxed model", "sandbox processes")
        except BaseException:  # (nobody else holds the loaded process: not left running)
            child.close()
            raise
        return child, payload

    def _excused_stop(self) -> bool:
        """Whether a process a signal from outside ended is no crash (see
        :meth:`CrashBackoff.excused_stop`: the graph's first in :data:`QUIET_S`)."""
        with self._cond:
            return self.backoff.excused_stop()

    def _load_in(self, child: SandboxProcess, files: Mapping[str, Tensor]) -> dict[str, Any]:
        """Have ``child`` load the model from ``files``: what it said of the model."""
        name = self._backend.name
        forget = on_current_cancel(child.stop_loading)
        try:
            payload, _ = child.call(self._load, files)
            child.loaded()
            child.arena.release()  # the model's bytes
        except (EOFError, OSError):
            how = child.ended()
            if child.killed_for_cancel:
                raise BackendRuntimeError(
                    f"{name}: cancelled while a process loaded the model: it was "
                    "stopped") from None
            if child.stopped_from_outside and self._excused_stop():
                log.warning("%s: sandbox process %d on %s %s loading the model, sent "
                            "from outside wasinn: not counted as a crash", self._name,
                            child.process.pid, self.device.name, how)
                raise BackendRuntimeError(
                    f"{name}: the process loading the model {how}, sent from outside "
                    f"wasinn ({OUTSIDE_SENDERS}): not a crash on the model's bytes (the "
                    "host goes on; a load again starts a new process)") from None
            if child.stopped_from_outside:
                how += f" a second time in {QUIET_S:g} s (which counts as a crash)"
            log.warning("%s: sandbox process %d on %s %s loading the model", self._name,
                        child.process.pid, self.device.name, how)
            with self._cond:
                self.backoff.crashed(how)
            raise InvalidEncodingError(
                f"{name}: the process loading the model {how}: the library "
                "crashed on it (the host goes on)") from None
        except ValueError as exc:
            child.close()
            raise BackendRuntimeError(
                f"{name}: the process loading the model answered badly: {exc}") from None
        except BaseException:  # the arena could not grow for the model, ...: not kept
            child.close()
            raise
        finally:
            forget()
        if "error" in payload:
            child.close()
            raise child_error(payload)
        log.debug("%s: sandbox process %d on %s loaded the model", self._name,
                  child.process.pid, self.device.name)
        return payload

    # -- the processes a run takes --------------------------------------------------------
    def _acquire(self, caller: str | None) -> SandboxProcess:
        """An idle process, or a new one where fewer than :attr:`processes` run (after a
        crash, once the graph's back-off allows: waited for); else wait for one to be
        idle. A process beside a busy one starts only below the host's bound on sandbox
        processes. TooLargeError, nothing taken or started, while the back-off of a
        ``caller`` whose runs crashed the process holds its runs (see :meth:`_refused`);
        BackendRuntimeError when the job is cancelled while it waits."""
        cancelled = threading.Event()
        forget = on_current_cancel(functools.partial(self._wake, cancelled))
        try:
            room = True  # whether a process beside a busy one may be tried
            while True:
                got = self._idle_or_start(room, cancelled, caller)
                if isinstance(got, SandboxProcess):
                    return got
                child = self._started(first=got)
                if child is not None:
                    return child
                room = False  # at the host's bound: wait for its own
        finally:
            forget()

    def _idle_or_start(self, room: bool, cancelled: threading.Event, caller: str | None
                       ) -> SandboxProcess | bool:
        """An idle process, taken; else True to start the graph's only process (the
        back-off's wait over), False to start one beside a busy one (``room``): counted
        as starting. Waits meanwhile; TooLargeError once ``caller``'s back-off holds its
        runs, before or while it waits."""
        name = self._backend.name
        backoff = self.backoff
        with self._cond:
            while True:
                if self._closed:
                    raise ClosedResourceError(f"{name}: the graph is closed")
                held = backoff.holding(caller)
                if held:
                    raise self._refused(caller, held)
                child = self._take_idle()
                if child is not None:
                    return child
                live = len(self._busy) + self._starting
                wait = backoff.remaining(caller)
                if not live and not wait:
                    self._starting += 1
                    return True
                if live and room and live < self.processes and not wait:
                    self._starting += 1
                    return False
                if cancelled.is_set():
                    raise BackendRuntimeError(
                        f"{name}: cancelled while waiting for a process of the model "
                        + self._why_waiting(live, wait))
                self._cond.wait(None if live else wait)

    def _refused(self, caller: str | None, held: float) -> TooLargeError:
        """The refusal of a run of ``caller``, whose back-off holds its runs ``held`` s
        more (under the lock). Refused, not kept waiting: a run waits in its device's
        worker thread, so a caller crashing the process with several requests in flight
        would hold every worker slot of the device, and starve the other callers that
        its back-off is there to spare. Its ``retry_after`` is ``held``."""
        refusal = TooLargeError(
            f"{self._name}: this caller's runs crashed the model's process "
            f"{self.backoff.crashes_of(caller)} times less than {QUIET_S:g} s apart: its "
            f"runs are refused for {held:.1f} s more, without a process taken or started; "
            "other callers' runs go on: retry after that")
        refusal.retry_after = held
        return refusal

    def _why_waiting(self, live: int, wait: float) -> str:
        """Why a run waited for a process, in brackets (under the lock)."""
        if live:
            return "(each was busy)"
        return (f"(after {self.backoff.crashes_of(None)} crashes, a new one starts in "
                f"{wait:.1f} s)")

    def _take_idle(self) -> SandboxProcess | None:
        """An idle process, moved to the busy ones (under the lock); one that died while
        idle is dropped, and one being ended to make room for another graph's is left to
        that."""
        while self._idle:
            child = self._idle.pop()
            if not self._limit.claim(child):
                continue
            if child.process.poll() is not None:  # died while idle (OOM killer)
                log.warning("%s: sandbox process %d %s while idle: a new one runs the next "
                            "run", self._name, child.process.pid, child.ended())
                continue
            self._busy.add(child)
            return child
        return None

    def _started(self, *, first: bool) -> SandboxProcess | None:
        """A process started for a run (counted as starting), the graph's ``first`` (only)
        one or one beside a busy one: None for the latter at the host's bound."""
        try:
            child, _ = self._start(make_room=first)
        except NoRoom:
            child = None
        except BaseException:
            with self._cond:
                self._starting -= 1
                self._cond.notify()
            raise
        with self._cond:
            self._starting -= 1
            if child is None:
                return None
            if not self._closed:
                self._busy.add(child)
                return child
        child.close()
        raise ClosedResourceError(f"{self._backend.name}: the graph is closed")

    def _release(self, child: SandboxProcess) -> None:
        """Back to the idle processes after a run, unless it died (it was then waited
        for) or the graph was closed meanwhile."""
        alive = child.process.poll() is None
        with self._cond:
            self._busy.discard(child)
            keep = alive and not self._closed
            if keep:
                self._idle.append(child)
                self._may_end(child)
            self._cond.notify()
        if alive and not keep:  # the graph was closed while it ran
            child.close()

    def _may_end(self, child: SandboxProcess) -> None:
        """``child``, idle now, may be ended to make room for another graph's process
        (under the lock). The bound holds the graph weakly: one dropped without
        :meth:`close` is collected, its idle processes closed then (see its ``__init__``)."""
        self._limit.idle(child, functools.partial(_end_idle, weakref.ref(self), child))

    def _end(self, child: SandboxProcess) -> None:
        """End idle ``child`` to make room for another graph's process (the limit's call):
        the next run starts one again, as after a crash, which this is not."""
        with self._cond:
            with contextlib.suppress(ValueError):
                self._idle.remove(child)
            self._cond.notify()
        log.info("%s: idle sandbox process %d ended to make room for another graph's (the "
                 "host runs its most sandbox processes); the next run starts one again",
                 self._backend.name, child.process.pid)
        child.close()

    def _wake(self, cancelled: threading.Event) -> None:
        cancelled.set()
        with self._cond:
            self._cond.notify_all()



def _end_idle(graph: weakref.ref[GraphProcesses], child: SandboxProcess) -> None:
    # The bound's call to end idle ``child`` (see GraphProcesses._may_end): through its
    # graph, or, the graph collected meanwhile, by closing it (which frees its slot).
    alive = graph()
    if alive is not None:
        alive._end(child)
    else:
        child.close()


def close_idle(idle: list[SandboxProcess], limit: ProcessLimit) -> None:
    # A graph's idle processes, as it is closed or collected without close(): but one the
    # bound is ending to make room for another graph's (whoever claims a process closes
    # it).
    for child in list(idle):
        if limit.claim(child):
            child.close()
