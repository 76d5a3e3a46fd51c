"""Graphs run in a process of their own, so that a library crash kills that process only.

Fuzzing the libraries through wasinn's own backends (2026-11-21) found inputs that kill
the process running them, with models no check refuses: OpenVINO's CPU plugin on
``GatherND``, ``ScatterElements``, ``ScatterND``, ``Pad``, ``Slice`` and ``Col2Im`` given
out-of-range indices, pads or steps as *inputs* (SIGSEGV, SIGABRT, SIGFPE); ONNX
Runtime's ``RoiAlign`` and ``MaxRoiPool`` given bad boxes or batch indices; torch's
``ctc_loss``, ``cummax``/``cummin`` helpers and ``linalg.eigvals`` on NaN. In the host's
process each of those kills every guest and caller with it. :func:`load_sandboxed`
compiles a graph in a child process instead (:mod:`._sandbox_child`):

* The child imports the same backend, loads the model and answers runs one at a time.
  The model's bytes, inputs and outputs lie in memory both processes map (an arena, a
  ``memfd`` on Linux); a Unix socket pair carries the messages that place them (the
  host's requests pickled, the child's replies JSON, checked before use: see
  :mod:`._sandbox_wire`). Outputs are host tensors, copied out of the arena: a sandboxed
  graph keeps nothing on its device between runs of different graphs. They must be the
  outputs the run asked for, as the graph declared them when it was loaded (names,
  element types, static dimensions: :class:`~._sandbox_wire.DeclaredOutputs`), and are
  checked so before any is copied, with the memory they take (bounded by what the
  process may hold); other outputs are a reply that is not one, which retires the
  process, like any reply that is not one. So is a description of the model that no
  graph could give (:mod:`._sandbox_specs`). The child checks its library's outputs
  too, and fails the run (keeping the process) where a model computes other than it
  declares. A run takes the inputs and ``outputs`` an in-process graph's takes, checked
  here (:class:`~._graphio.InputChecker`) and sent by name.
* A registered ONNX model's external data (``LoadOptions.source``'s folder, see
  :mod:`._onnx_check`) is read and checked by the host, for each load, and sent with
  the model: a confined process may not read the model's folder. It hands the bytes to
  its backend (``LoadOptions.external_data``): ONNX Runtime takes them in memory,
  OpenVINO writes them into the process's private folder and reads them there.
* On CPU the child confines itself before the library reads the model (:mod:`._confine`:
  no new privileges, no core files, bounded file sizes, seccomp, Landlock where the
  kernel has it) and bounds the memory it may hold (``RLIMIT_DATA``: the options'
  ``max_sandbox_bytes``, by default half the machine's memory). A run or a load that
  needs more fails with the library's allocation error, which then names the bound; the
  process goes on. A GPU child is neither confined nor bounded (its driver opens device
  files and maps its own memory).
* A child that dies (a signal, an exit) fails the run or the load that was under way
  with BackendRuntimeError (InvalidEncodingError for a load) naming the signal; the
  graph starts a new child, and loads the model again, for its next run. The crash is
  charged to the caller whose run it was (:func:`~.base.current_caller`: a device
  actor's request's tenant): after its second crash less than a minute apart, that
  caller's runs are refused at once (TooLargeError), for longer with each crash, rather
  than wait (a waiting run would hold its device's worker slot), while other callers'
  runs go on at once (:mod:`._sandbox_backoff`); inputs that crashed it twice are
  refused at once, whoever sends them. So a caller crashing it on purpose can neither keep the host
  starting processes nor fail, or delay, the good runs of the other callers of a shared
  graph. On a GPU, a run whose library exception lost the process's CUDA context (the
  process says so: :func:`_lost_context`) retires the process and counts as such a
  crash; on the CPU no error retires one.
* Cancelling a run (the actor's :class:`~.base.Cancellation`) tells the child, whose
  backend stops at its library's next check; a run that has not stopped
  :data:`CANCEL_GRACE_S` later (TorchScript code between loops, an OpenVINO ``Loop``)
  has its process killed. A cancel while the model is being loaded (a first compile, or
  the reload before a run after a crash) kills the loading process at once. So a
  sandboxed run can always be stopped, which an in-process one cannot, and a request's
  deadline bounds the reload its run waits for.

* A process is started (:mod:`._sandbox_process`) before it has a model: it imports the
  library while the host goes on, then waits for its load. ``spares``
  (:class:`Spares`, the runtime's ``[runtime] sandbox_spares``) keeps such processes
  started ahead, so that a load or a reload after a crash takes one that has already
  imported its library. Every process, spares included, counts towards the host's
  bound (:class:`ProcessLimit`: the runtime's ``[runtime] max_sandbox_processes``, else
  the one this Python process shares, :func:`host_limit`, which also bounds the loads
  given no ``spares``): at it, a start that a graph cannot run without ends a spare or
  the idle process of the graph used least recently (which starts one again on its next
  run), else waits for a busy one (see :mod:`._sandbox_limit`). A process that cannot
  be started fails the load or the run that needed it with BackendRuntimeError naming
  what failed, having freed what was made for it, its place under the bound included.
* The host never imports the library of a graph it sandboxes: ``backend`` may be a
  :class:`~.base.BackendRef` (``module:Class``), and the scheduler chooses a built-in
  backend for the CPU without importing it. A graph closed has its processes killed
  (they hold nothing to save) and waited for, so its memory is free when ``close``
  returns.

What it costs (``benchmarks/sandbox_overhead.py``): a process per graph, which imports
the library unless a spare had (MobileNetV2-like loads, 2026-11-22: ONNX Runtime 0.23 s
in a new process, 0.08 s in a spare, 0.04 s in the host's process; OpenVINO 0.38 / 0.17 /
0.13 s; PyTorch 1.40 / 0.44 / 0.69 s); a copy of every input into the arena and of
every output out of it; and two process wake-ups per run. A graph runs one run at a
time per process, and up to ``processes`` processes (the scheduler passes its device's
workers), each started when a run finds every other one busy and each holding its own
copy of the model. A process's arena keeps the size of the largest run's inputs and
outputs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from wasinn import errors
from wasinn.enums import ExecutionTarget, GraphEncoding, TensorType
from wasinn.errors import (
    BackendRuntimeError,
    ClosedResourceError,
    InvalidEncodingError,
    TooLargeError,
    WasiNNError,
    bounded_message,
)
from wasinn.tensor import Tensor

from . import _confine
from ._graphio import InputChecker
from ._onnx_check import check_external_data, external_data_folder, read_external_data
from ._sandbox_backoff import QUIET_S, CrashBackoff, digest_of, shapes_of
from ._sandbox_child import EXTERNAL
from ._sandbox_limit import ProcessLimit, default_max_processes, host_limit
from ._sandbox_process import CANCEL_GRACE_S, SandboxProcess
from ._sandbox_spares import MAX_SPARES, Spares
from ._sandbox_specs import read_specs, reserve
from ._sandbox_wire import ALIGN, DeclaredOutputs, Expected
from .base import (
    Backend,
    BackendRef,
    Builders,
    CompiledGraph,
    Device,
    LoadOptions,
    current_caller,
    on_current_cancel,
)
from .formats import detect_encoding

log = logging.getLogger("wasinn.backends")

__all__ = ["CANCEL_GRACE_S", "MAX_SPARES", "MIN_MAX_BYTES", "ProcessLimit", "SandboxedGraph",
           "Spares", "default_max_bytes", "default_max_processes", "host_limit",
           "load_sandboxed"]

#: The least ``max_sandbox_bytes`` the configuration accepts (a process holds about
#: 0.3-0.6 GB once Python and a library are imported: the child checks what it holds).
MIN_MAX_BYTES = 64 * 1024 * 1024


def default_max_bytes() -> int:
    """The memory a sandboxed graph's process may hold by default: half the machine's."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2


def load_sandboxed(backend: Backend | BackendRef, builders: Builders,
                   encoding: GraphEncoding, device: Device, options: LoadOptions | None = None,
                   *, spares: Spares | None = None, processes: int = 1) -> SandboxedGraph:
    """``backend.load(...)``, run in a process of its own (see the module docstring);
    taken from ``spares`` where it has one started (and then replaced there), else
    started for it, every process counted against ``spares.limit`` (the host's bound on
    sandbox processes; without ``spares``, the bound this Python process shares,
    :func:`host_limit`: at it, a load or a run ends the idle process of the graph used
    least recently, as under a runtime; close the graph once done with it: its idle
    processes count against that bound until then, or until it is collected).
    ``processes``: the most runs at once,
    each in a process of its own (more are started as concurrent runs need them).
    ``backend`` may be a :class:`~wasinn.backends.base.BackendRef`: this process then
    never imports its library.

    Raises what the backend's load raises, InvalidEncodingError when the process dies
    loading the model, and BackendRuntimeError when no process can be started.
    """
    if isinstance(backend, Backend):
        backend = BackendRef.of(backend)
    return SandboxedGraph(backend, builders, encoding, device, options or LoadOptions(),
                          spares=spares, processes=processes)


def _external_files(backend: str, builders: Builders, encoding: GraphEncoding,
                    options: LoadOptions) -> dict[str, Tensor]:
    """The external data files of a registered ONNX model, for its process, which may not
    read the model's folder: tensors named :data:`EXTERNAL` + their location, which the
    process hands its backend (``LoadOptions.external_data``). Those the caller gave in
    ``options.external_data``, else read and checked here (see :func:`_read_external`)."""
    files = options.external_data or _read_external(backend, builders, encoding,
                                                    options.source)
    return {EXTERNAL + location: Tensor.from_bytes([len(data)], TensorType.U8, data)
            for location, data in files.items()}


def _read_external(backend: str, builders: Builders, encoding: GraphEncoding, source: str
                   ) -> dict[str, bytes]:
    """The external data files of the ONNX model the host read from the file ``source``,
    read and checked (see :mod:`._onnx_check`); again for each load (as a load in this
    process reads them), so that the host keeps no copy. Empty for another model, and
    for bytes that are no ONNX model (the process's backend says what is wrong with
    them)."""
    folder = external_data_folder(source)
    if folder is None or len(builders) != 1 or not _onnx(builders, encoding):
        return {}
    try:
        locations = check_external_data(backend, builders[0], folder)
    except InvalidEncodingError:
        return {}
    return read_external_data(backend, folder, locations) if locations else {}


def _onnx(builders: Builders, encoding: GraphEncoding) -> bool:
    if encoding is GraphEncoding.AUTODETECT:
        try:
            encoding = detect_encoding(builders)
        except InvalidEncodingError:
            return False
    return encoding is GraphEncoding.ONNX


def _error(payload: Mapping[str, Any]) -> WasiNNError:
    """The wasinn error a child reported (BackendRuntimeError for a class it may not
    name)."""
    kind, message = payload["error"]  # (two strs: checked by read_reply)
    cls = getattr(errors, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, WasiNNError)):
        cls = BackendRuntimeError
    return cls(bounded_message(message, MAX_MESSAGE_BYTES))


#: The most UTF-8 bytes of a child's error message an error keeps (its start and end).
MAX_MESSAGE_BYTES = 16 * 1024


def _lost_context(payload: Mapping[str, Any], device: Device) -> bool:
    """Whether the process that reported a run's error in ``payload`` has lost its CUDA
    context: on a GPU only, where the process found that from its library's own
    exception (see :func:`wasinn.backends.cuda.sticky_error`) and said so with a flag.
    Never from the error's message, which may quote the model (a node's name) or a
    caller's text (an input's): a CPU process has no CUDA context to lose, and a
    phrase a model names must not retire its process at every run."""
    return device.kind is not ExecutionTarget.CPU and payload.get("lost_context") is True


class _NoRoom(Exception):
    """No process was started beside a busy one: the host runs its most."""


class SandboxedGraph(CompiledGraph):
    """A graph compiled and run in child processes (see the module docstring): up to
    ``processes`` at once, one per concurrent run, each started when a run first finds
    every other one busy, and each holding its own copy of the model. ``spares``: the
    pool its processes are taken from and counted under (None: a pool that keeps no
    spares, under :func:`host_limit`)."""

    #: A run may wait for a process (its start, the crash back-off, room under the host's
    #: cap): never on the event loop.
    may_run_inline = False
    #: Closing kills its processes and waits for each to end.
    close_blocks = True

    def __init__(self, backend: BackendRef, builders: Builders, encoding: GraphEncoding,
                 device: Device, options: LoadOptions, *, spares: Spares | None = None,
                 processes: int = 1) -> None:
        if processes < 1:
            raise ValueError(f"processes={processes}: expected at least 1")
        self.device = device
        #: The most processes (and so runs) at once.
        self.processes = processes
        self._backend = backend
        # (without spares, every process is started for a load or a run, as by a pool
        # that keeps none, and counted against the bound every such graph shares)
        self._spares = Spares(0) if spares is None else spares
        #: The host's bound on sandbox processes.
        self._limit = self._spares.limit
        #: Whether its processes confine themselves: on the CPU only (a GPU's driver
        #: opens device files).
        self._confined = device.kind is ExecutionTarget.CPU
        #: What the latest process to load the model reported of its confinement
        #: (applied, unsupported, failed; None: not confined, or it said nothing).
        self.confinement: dict[str, Any] | None = None
        #: The memory each of its processes may hold (None: not bounded).
        self.max_bytes = (options.max_sandbox_bytes or default_max_bytes()
                          if self._confined else None)
        #: The most bytes a run's outputs may take beside its inputs' (which an output
        #: may share): what a process may hold, a GPU's half the machine's memory.
        self._most = self.max_bytes or default_max_bytes()
        # (external data goes in the arena, as the model's bytes do: see _load_in)
        self._load = (encoding, device, dataclasses.replace(options, external_data={}),
                      self.max_bytes)
        self._files = {str(i): Tensor.from_bytes([len(b)], TensorType.U8, bytes(b))
                       for i, b in enumerate(builders)}
        #: Where a registered ONNX model's external data is read from for each load: the
        #: builders, encoding and options (see _external_files).
        self._external_of = (builders, encoding, options)
        #: Bytes a run's outputs are expected to need in the arena: the largest so far.
        self._reserve = 0
        # Guards what follows; notified when a process becomes idle or goes.
        self._cond = threading.Condition()
        self._closed = False
        self.backoff = CrashBackoff(backend.name)
        self._idle: list[SandboxProcess] = []
        # Dropped without close(): its idle processes are closed as it is collected (the
        # bound holds it only weakly), so they do not hold places under the bound for ever.
        weakref.finalize(self, _close_idle, self._idle, self._limit)
        self._busy: set[SandboxProcess] = set()
        self._starting = 0
        try:
            child, payload = self._start()
        except BaseException:
            self.close()
            raise
        with self._cond:
            self._idle.append(child)
            self._may_end(child)
        try:
            specs = read_specs(payload)
        except BaseException as exc:  # (ValueError: what the process got wrong)
            self.close()
            if not isinstance(exc, Exception):
                raise
            raise BackendRuntimeError(
                f"{backend.name}: the process loading the model answered badly: {exc}"
                ) from None
        self.inputs, self.outputs = specs.inputs, specs.outputs
        self.input_aliases, self.output_aliases = specs.input_aliases, specs.output_aliases
        self.output_types_declared = specs.output_types_declared
        #: What every run's inputs are checked against, and keyed by (their names), as
        #: an in-process graph's are: where the graph's types are placeholders
        #: (TorchScript's, whose outputs' types do not hold either), not their types.
        self._checker = InputChecker(
            backend.name, self.inputs, aliases=self.input_aliases,
            any_type=frozenset() if self.output_types_declared
            else frozenset(range(len(self.inputs))))
        #: What every run's outputs are checked against (see :meth:`_run_in`).
        self._declared = DeclaredOutputs(backend.name, self.outputs, self.output_aliases,
                                         self.output_types_declared)
        self._reserve = reserve(self.outputs, self._most, ALIGN)

    @property
    def pids(self) -> list[int]:
        """The processes serving this graph now, idle or running (none after a crash,
        until the next run)."""
        with self._cond:
            return sorted(c.process.pid for c in (*self._idle, *self._busy))

    @property
    def pid(self) -> int | None:
        """The first of :attr:`pids` (None when there is none)."""
        pids = self.pids
        return pids[0] if pids else None

    def _start(self, *, make_room: bool = True) -> tuple[SandboxProcess, dict[str, Any]]:
        """A process that has loaded the model, and what it said of the model. Unless
        ``make_room``, at the host's bound on sandbox processes: :class:`_NoRoom`, and
        nothing started."""
        # (first: a registered model's external data may be refused)
        files = {**self._files, **_external_files(self._backend.name, *self._external_of)}
        child = self._spares.take(self._backend, self._confined, make_room=make_room)
        if child is None:
            raise _NoRoom
        payload = self._load_in(child, files)
        try:
            # (after the load: a spare's imports would slow it; it raises nothing)
            self._spares.replenish(self._backend, self._confined)
            if self._confined:
                confined = payload.get("confined")
                self.confinement = confined if isinstance(confined, dict) else None
                _confine.log_report(self.confinement, "sandboxed model", "sandbox processes")
        except BaseException:  # (nobody else holds the loaded process: not left running)
            child.close()
            raise
        return child, payload

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
            raise _error(payload)
        log.debug("sandbox process %d for %s on %s loaded the model", child.process.pid,
                  name, self.device.name)
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
        its back-off is there to spare."""
        return TooLargeError(
            f"{self._backend.name}: this caller's runs crashed the model's process "
            f"{self.backoff.crashes_of(caller)} times less than {QUIET_S:g} s apart: its "
            f"runs are refused for {held:.1f} s more, without a process taken or started; "
            "other callers' runs go on: retry after that")

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
                            "run", self._backend.name, child.process.pid, child.ended())
                continue
            self._busy.add(child)
            return child
        return None

    def _started(self, *, first: bool) -> SandboxProcess | None:
        """A process started for a run (counted as starting), the graph's ``first`` (only)
        one or one beside a busy one: None for the latter at the host's bound."""
        try:
            child, _ = self._start(make_room=first)
        except _NoRoom:
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

    # -- runs -----------------------------------------------------------------------------
    def run(self, inputs: Mapping[str, Tensor], *, outputs: Sequence[str] | None = None,
            keep_on_device: bool = False) -> dict[str, Tensor]:
        """As an in-process graph's run (see :class:`~.base.CompiledGraph`), which takes
        the same ``inputs`` (host tensors or numpy arrays, by name, alias or position)
        and ``outputs`` (a str is one name), checked here: the process gets the inputs
        by name. Outputs are host tensors whatever ``keep_on_device``."""
        if self._closed:
            raise ClosedResourceError(f"{self._backend.name}: the graph is closed")
        ordered = self._checker.check(inputs)
        named = {spec.name: t for spec, t in zip(self.inputs, ordered, strict=True)}
        asked = None if outputs is None else [outputs] if isinstance(outputs, str) else list(
            outputs)
        # (outputs may share the inputs' memory in the process: not counted in its bound)
        expected = Expected(self._declared, self._declared.wanted(asked),
                            self._most + sum(t.nbytes for t in ordered))
        known = self._refuse_crashed(named)
        caller = current_caller()
        child = self._acquire(caller)
        try:
            payload, result = self._run_in(child, named, expected, known, caller)
            if "error" in payload and _lost_context(payload, self.device):
                raise self._retired(child, payload, named, known, caller)
        finally:
            self._release(child)
        if known is not None:
            with self._cond:
                self.backoff.ran(known)  # an earlier crash was not theirs
        if "error" in payload:
            raise _error(payload)
        self._reserve = max(self._reserve, min(self._most, sum(t.nbytes + ALIGN
                                                               for t in result.values())))
        return result

    def _refuse_crashed(self, inputs: Mapping[str, Tensor]) -> bytes | None:
        """BackendRuntimeError for inputs that crashed the process often enough to be
        refused (see :mod:`._sandbox_backoff`); the digest of inputs shaped as some that
        crashed it (else None: not hashed)."""
        shapes = shapes_of(inputs)
        with self._cond:
            if not self.backoff.knows(shapes):
                return None
        digest = digest_of(inputs)  # (not under the lock: it reads every input)
        with self._cond:
            refusal = self.backoff.refusal(digest)
        if refusal is not None:
            raise BackendRuntimeError(refusal)
        return digest

    def _run_in(self, child: SandboxProcess, inputs: Mapping[str, Tensor], expected: Expected,
                digest: bytes | None, caller: str | None
                ) -> tuple[dict[str, Any], dict[str, Tensor]]:
        """The reply of ``child`` to a run of ``caller`` (``inputs`` by name; ``digest``:
        theirs, where known) that asked for the outputs ``expected`` names;
        BackendRuntimeError when it died (a crash charged to ``caller``) or answered
        badly (then it has ended: a reply that is not one, or outputs other than those
        the run asked for as the graph declared them: see :func:`~._sandbox_wire.
        read_reply`), or when the arena could not grow for the outputs (then it goes
        on)."""
        name = self._backend.name
        child.seq += 1
        seq = child.running = child.seq
        forget = on_current_cancel(lambda: child.cancel(seq))
        try:
            answer = child.call(("run", seq, list(expected.wanted)), inputs,
                                reserve=self._reserve, expected=expected)
        except (EOFError, OSError):
            how = child.ended()
            if child.killed_for_cancel:
                raise BackendRuntimeError(
                    f"{name}: the run was cancelled and did not stop within "
                    f"{CANCEL_GRACE_S:g} s: its process was killed") from None
            then = self._crashed(how, inputs, digest, caller)
            raise BackendRuntimeError(
                f"{name}: the process running the model {how}: the library crashed "
                f"on this model or these inputs (the host goes on; {then})") from None
        except ValueError as exc:
            child.close()
            raise BackendRuntimeError(
                f"{name}: the process running the model answered badly: {exc}") from None
        finally:
            child.running = -1
            forget()
        return answer

    def _retired(self, child: SandboxProcess, payload: Mapping[str, Any],
                 inputs: Mapping[str, Tensor], digest: bytes | None, caller: str | None
                 ) -> WasiNNError:
        """The error a run's process reported, which lost its CUDA context (see
        :func:`_lost_context`): the process is retired, as its every later run would fail
        the same way, and this counts as a crash of ``caller``'s ``inputs`` (see
        :meth:`_crashed`), so that inputs that keep doing it do not keep the host
        starting processes. The host's own context is fine: the error is a wasinn error
        carrying the child's text, which the host's device watch does not read (see
        :func:`wasinn.backends.cuda.sticky_error`)."""
        error = _error(payload)
        child.close()
        then = self._crashed("lost its CUDA context", inputs, digest, caller)
        return error.suffixed(
            "(in the process that ran the sandboxed model, whose CUDA context this lost: it "
            f"was retired; {then})")

    def _crashed(self, how: str, inputs: Mapping[str, Tensor], digest: bytes | None,
                 caller: str | None) -> str:
        """Count a crash (``how`` the process ended) of a run of ``caller``'s ``inputs``
        (``digest``: theirs, where known) towards the back-off: what happens next, for
        the run's error. Raises nothing: reading the inputs may not hide the crash (were
        they unreadable, it counts as the graph's own)."""
        try:
            inputs_of = (shapes_of(inputs), digest or digest_of(inputs))
        except Exception:
            log.exception("%s: the inputs of a run that crashed its sandbox process cannot "
                          "be remembered: the crash counts as the graph's", self._backend.name)
            inputs_of = None
        with self._cond:
            return self.backoff.crashed(how, inputs_of, caller)

    def close(self) -> None:
        """Close the idle processes now, and those running when their run ends."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cond.notify_all()
        _close_idle(idle, self._limit)


def _end_idle(graph: weakref.ref[SandboxedGraph], child: SandboxProcess) -> None:
    # The bound's call to end idle ``child`` (see SandboxedGraph._may_end): through its
    # graph, or, the graph collected meanwhile, by closing it (which frees its slot).
    alive = graph()
    if alive is not None:
        alive._end(child)
    else:
        child.close()


def _close_idle(idle: list[SandboxProcess], limit: ProcessLimit) -> None:
    # A graph's idle processes, as it is closed or collected without close(): but one the
    # bound is ending to make room for another graph's (whoever claims a process closes
    # it).
    for child in list(idle):
        if limit.claim(child):
            child.close()
