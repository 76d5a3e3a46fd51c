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
* On the CPU the child confines itself before the library reads the model
  (:mod:`._confine`: no new privileges, no core files, bounded file sizes, seccomp,
  Landlock where the kernel has it) and bounds the memory it may hold (``RLIMIT_DATA``:
  the options' ``max_sandbox_bytes``, by default half the machine's memory or of a lower
  cgroup limit). A run or a
  load that needs more fails with the library's allocation error, which then names the
  bound; the process goes on. A GPU child confines itself too, and may besides use the
  GPUs' device files and read what their drivers read (``gpu`` in :mod:`._confine`),
  which a CPU child may not; its memory is not bounded (its driver maps memory of its
  own). A CPU child lists no device (see :func:`._sandbox_child._list_the_cpu_only`) and
  sees no CUDA GPU (:data:`._sandbox_process.NO_CUDA`): listing loads GPU drivers, which
  the lock-down made fail, crash or hang. A GPU child's confinement has not run on a GPU
  yet: see the README.
* A child that dies (a signal, an exit) fails the run or the load that was under way
  with BackendRuntimeError (InvalidEncodingError for a load) naming the signal, and is
  logged as a warning (logger ``wasinn.backends``) naming the model (the ``label`` of
  :func:`load_sandboxed`), the process and the signal; the graph starts a new child,
  and loads the model again, for its next run. The crash is charged to the caller
  whose run it was (:func:`~.base.current_caller`: a device actor's request's
  tenant): after its second crash less than a minute apart, that
  caller's runs are refused at once (TooLargeError), for longer with each crash, rather
  than wait (a waiting run would hold its device's worker slot), while other callers'
  runs go on at once (:mod:`._sandbox_backoff`); inputs that crashed it twice are
  refused at once, whoever sends them, and those that crashed it once run on one
  process at a time meanwhile (:meth:`SandboxedGraph._turn`). So a caller crashing it
  on purpose can neither keep the host starting processes nor fail, or delay, the good
  runs of the other callers of a shared graph. On a GPU, a run whose library exception
  lost the process's CUDA context (the process says so:
  :func:`~._sandbox_errors.lost_context`) retires the process and counts as such a
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
  imported its library. The confined processes it gives out, spares or new, are given
  the host's environment variables its ``extra_env`` names (the runtime's ``[runtime]
  sandbox_env``, see :mod:`._sandbox_env`) besides the default ones, and may read the
  folders and files its ``extra_read`` names (``[runtime] sandbox_read``, see
  :mod:`._sandbox_read`) besides the default ones. Every process,
  spares included, counts towards the host's bound (:class:`ProcessLimit`: the runtime's
  ``[runtime] max_sandbox_processes``, else the one this Python process shares,
  :func:`host_limit`, which also bounds the loads given no ``spares``): at it, a start
  that a graph cannot run without ends a spare or the idle process of the graph used
  least recently (which starts one again on its next run), else waits for a busy one
  (see :mod:`._sandbox_limit`). A process that cannot be started fails the load or the
  run that needed it with BackendRuntimeError naming what failed, having freed what was
  made for it, its place under the bound included.
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

import dataclasses
import functools
import logging
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from wasinn._memory import total_memory
from wasinn.enums import ExecutionTarget, GraphEncoding, TensorType
from wasinn.errors import BackendRuntimeError, ClosedResourceError, WasiNNError
from wasinn.tensor import Tensor, count_host_copies

from ._graphio import InputChecker
from ._sandbox_backoff import QUIET_S, CrashBackoff, digest_of, shapes_of
from ._sandbox_env import env_pattern_problem
from ._sandbox_errors import child_error, lost_context
from ._sandbox_limit import ProcessLimit, default_max_processes, host_limit
from ._sandbox_pool import GraphProcesses, close_idle
from ._sandbox_process import CANCEL_GRACE_S, OUTSIDE_SENDERS, SandboxProcess
from ._sandbox_read import read_path_problem
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

log = logging.getLogger("wasinn.backends")

__all__ = ["CANCEL_GRACE_S", "MAX_SPARES", "MIN_MAX_BYTES", "ProcessLimit", "SandboxedGraph",
           "Spares", "default_max_bytes", "default_max_processes", "env_pattern_problem",
           "host_limit", "load_sandboxed", "read_path_problem"]

#: The least ``max_sandbox_bytes`` the configuration accepts (a process holds about
#: 0.3-0.6 GB once Python and a library are imported: the child checks what it holds).
MIN_MAX_BYTES = 64 * 1024 * 1024


def default_max_bytes() -> int:
    """The memory a sandboxed graph's process may hold by default: half of what this
    process and its children may hold together, the machine's memory or, where less,
    its cgroup's limit (:func:`wasinn._memory.total_memory`)."""
    return total_memory() // 2


def load_sandboxed(backend: Backend | BackendRef, builders: Builders,
                   encoding: GraphEncoding, device: Device, options: LoadOptions | None = None,
                   *, spares: Spares | None = None, processes: int = 1,
                   label: str = "") -> SandboxedGraph:
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
    never imports its library. ``label``: the model's name, where it has one (the
    scheduler's ``model.name``, ``"resnet"``), which the crash and refusal errors and
    log lines start with, beside the backend's (``"resnet (onnxruntime): the process
    running the model was killed by SIGKILL..."``); without it they start with the
    backend's alone.

    Raises what the backend's load raises, InvalidEncodingError when the process dies
    loading the model, and BackendRuntimeError when no process can be started.
    """
    if isinstance(backend, Backend):
        backend = BackendRef.of(backend)
    return SandboxedGraph(backend, builders, encoding, device, options or LoadOptions(),
                          spares=spares, processes=processes, label=label)


class SandboxedGraph(CompiledGraph, GraphProcesses):
    """A graph compiled and run in child processes (see the module docstring): up to
    ``processes`` at once, one per concurrent run, each started when a run first finds
    every other one busy, and each holding its own copy of the model. ``spares``: the
    pool its processes are taken from and counted under (None: a pool that keeps no
    spares, under :func:`host_limit`). ``label``: the model's name, where it has one
    (see :func:`load_sandboxed`)."""

    #: A run may wait for a process (its start, the crash back-off, room under the host's
    #: cap): never on the event loop.
    may_run_inline = False
    #: Closing kills its processes and waits for each to end.
    close_blocks = True

    def __init__(self, backend: BackendRef, builders: Builders, encoding: GraphEncoding,
                 device: Device, options: LoadOptions, *, spares: Spares | None = None,
                 processes: int = 1, label: str = "") -> None:
        if processes < 1:
            raise ValueError(f"processes={processes}: expected at least 1")
        self.device = device
        #: What its crashes' and refusals' errors and log lines start with: the model's
        #: label and the backend's name (``"resnet (onnxruntime)"``), or the backend's.
        self._name = f"{label} ({backend.name})" if label else backend.name
        #: The most processes (and so runs) at once.
        self.processes = processes
        self._backend = backend
        # (without spares, every process is started for a load or a run, as by a pool
        # that keeps none, and counted against the bound every such graph shares)
        self._spares = Spares(0) if spares is None else spares
        #: The host's bound on sandbox processes.
        self._limit = self._spares.limit
        #: Whether its processes confine themselves: on the CPU and on a GPU, whose
        #: processes may use the GPUs' device files (``_gpu``), which a CPU graph's may
        #: not; not on another device (an NPU's needs are not known).
        self._confined = device.kind in (ExecutionTarget.CPU, ExecutionTarget.GPU)
        self._gpu = device.kind is ExecutionTarget.GPU
        #: What the latest process to load the model reported of its confinement
        #: (applied, unsupported, failed; None: not confined, or it said nothing).
        self.confinement: dict[str, Any] | None = None
        #: The memory each of its processes may hold (None: not bounded, on a device
        #: other than the CPU, whose driver maps memory of its own).
        self.max_bytes = (options.max_sandbox_bytes or default_max_bytes()
                          if device.kind is ExecutionTarget.CPU else None)
        #: The most bytes a run's outputs may take beside its inputs' (which an output
        #: may share): what a process may hold, a GPU's half the memory (see
        #: :func:`default_max_bytes`).
        self._most = self.max_bytes or default_max_bytes()
        # (external data goes in the arena, as the model's bytes do: see _load_in)
        self._load = (encoding, device, dataclasses.replace(options, external_data={}),
                      self.max_bytes)
        self._files = {str(i): Tensor.from_bytes([len(b)], TensorType.U8, bytes(b))
                       for i, b in enumerate(builders)}
        #: Where a registered ONNX model's external data is read from for each load: the
        #: builders, encoding and options (see :func:`~._sandbox_external.external_files`).
        self._external_of = (builders, encoding, options)
        #: Bytes a run's outputs are expected to need in the arena: the largest so far.
        self._reserve = 0
        # Guards what follows; notified when a process becomes idle or goes.
        lock = threading.RLock()
        self._cond = threading.Condition(lock)
        #: The digests of the inputs that crashed a process once (suspect) and are being
        #: run, each by one run at a time (see :meth:`_turn`).
        self._suspects: set[bytes] = set()
        # Under the same lock; notified when a run of suspect inputs ends. Apart from
        # ``_cond``: a process given back wakes one of that's waiters, which must be a run
        # waiting for a process, not one waiting for its turn.
        self._settled = threading.Condition(lock)
        self._closed = False
        self.backoff = CrashBackoff(self._name)
        self._idle: list[SandboxProcess] = []
        # Dropped without close(): its idle processes are closed as it is collected (the
        # bound holds it only weakly), so they do not hold places under the bound for ever.
        weakref.finalize(self, close_idle, self._idle, self._limit)
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

    # -- runs -----------------------------------------------------------------------------
    def run(self, inputs: Mapping[str, Tensor], *, outputs: Sequence[str] | None = None,
            keep_on_device: bool = False) -> dict[str, Tensor]:
        """As an in-process graph's run (see :class:`~.base.CompiledGraph`), which takes
        the same ``inputs`` (host tensors or numpy arrays, by name, alias or position)
        and ``outputs`` (a str is one name), checked here: the process gets the inputs
        by name. Outputs are host tensors whatever ``keep_on_device``: each is counted
        by :func:`wasinn.host_copies`, as the host arrays of an in-process run are."""
        if self._closed:
            raise ClosedResourceError(f"{self._backend.name}: the graph is closed")
        ordered = self._checker.check(inputs)
        named = {spec.name: t for spec, t in zip(self.inputs, ordered, strict=True)}
        asked = None if outputs is None else [outputs] if isinstance(outputs, str) else list(
            outputs)
        # (outputs may share the inputs' memory in the process: not counted in its bound)
        expected = Expected(self._declared, self._declared.wanted(asked),
                            self._most + sum(t.nbytes for t in ordered))
        known = self._digest_if_known(named)
        caller = current_caller()
        turn = False  # whether this run holds its suspect inputs' turn (see _turn)
        try:
            while True:
                if known is not None:  # (waited for holding no process)
                    turn = bool(self._turn(known, held=turn, wait=True))
                child = self._acquire(caller)
                try:
                    # Again, now that it has a process: inputs checked before a wait for
                    # one may have crashed it meanwhile (the same poison, sent by another
                    # caller too), and be refused now, or have to wait for their turn.
                    known = self._digest_if_known(named, known)
                    if known is not None:
                        took = self._turn(known, held=turn, wait=False)
                        if took is None:  # another run of them has it: this process is
                            continue  # given back (finally), then their outcome waited for
                        turn = took
                    payload, result = self._run_in(child, named, expected, known, caller)
                    if "error" in payload and lost_context(payload, self.device):
                        raise self._retired(child, payload, named, known, caller)
                finally:
                    self._release(child)
                break
            if known is not None:
                with self._cond:
                    self.backoff.ran(known)  # an earlier crash was not theirs
        finally:
            if turn and known is not None:
                self._end_turn(known)
        if "error" in payload:
            raise child_error(payload)
        self._reserve = max(self._reserve, min(self._most, sum(t.nbytes + ALIGN
                                                               for t in result.values())))
        count_host_copies(len(result))  # each left the library's form, in the process
        return result

    def _digest_if_known(self, inputs: Mapping[str, Tensor], digest: bytes | None = None
                         ) -> bytes | None:
        """The digest of ``inputs`` where they are shaped as some that crashed the process
        (else None: not hashed, so that a graph that never crashed hashes nothing; see
        :mod:`._sandbox_backoff`). ``digest``: theirs, where hashed already."""
        if digest is not None:
            return digest
        with self._cond:
            if not self.backoff.knows(shapes_of(inputs)):
                return None
        return digest_of(inputs)  # (not under the lock: it reads every input)

    def _turn(self, digest: bytes, *, held: bool, wait: bool) -> bool | None:
        """Whether a run of the inputs of ``digest`` holds their turn, once they may run:
        True where they crashed the process once, not yet refused (suspect, see
        :meth:`~._sandbox_backoff.CrashBackoff.suspect`): such inputs run on one process
        at a time, so that the same poison sent at once to a graph of several processes
        crashes it twice, not once in each; False where they run as any inputs do (they
        never crashed it, or ran since). ``held``: the run holds it already (it keeps
        it). BackendRuntimeError where they are refused (crashed often enough).

        Where another run of them holds it: None, unless ``wait``; then wait for that
        run's outcome, and decide again (refused after its crash; run as any after its
        success). A run waits holding no process (see :meth:`run`): the run it waits for
        may need one. BackendRuntimeError when the job is cancelled while it waits (its
        caller gave up, or its deadline passed), ClosedResourceError when the graph is
        closed meanwhile."""
        name = self._name
        cancelled: threading.Event | None = None
        forget = None
        try:
            with self._cond:
                while True:
                    refusal = self.backoff.refusal(digest)
                    if refusal is not None:
                        raise BackendRuntimeError(refusal)
                    if held:
                        return True
                    if not self.backoff.suspect(digest):
                        return False
                    if digest not in self._suspects:
                        self._suspects.add(digest)
                        return True
                    if not wait:
                        return None
                    if self._closed:
                        raise ClosedResourceError(f"{name}: the graph is closed")
                    if cancelled is None:  # (a callback run at once takes the lock again)
                        cancelled = threading.Event()
                        forget = on_current_cancel(
                            functools.partial(self._wake_turns, cancelled))
                    if cancelled.is_set():
                        raise BackendRuntimeError(
                            f"{name}: cancelled while waiting for another run of these "
                            "inputs, which crashed the model's process once: such inputs "
                            "run on one process at a time until they run without a crash "
                            "or are refused")
                    self._settled.wait()
        finally:
            if forget is not None:
                forget()

    def _end_turn(self, digest: bytes) -> None:
        """The run holding the turn of the inputs of ``digest`` ended (see :meth:`_turn`):
        the runs waiting for it decide again."""
        with self._cond:
            self._suspects.discard(digest)
            self._settled.notify_all()

    def _wake_turns(self, cancelled: threading.Event) -> None:
        cancelled.set()
        with self._cond:
            self._settled.notify_all()

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
        name = self._name
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
            if child.stopped_from_outside and self._excused_stop():
                log.warning("%s: sandbox process %d on %s %s during a run, sent from "
                            "outside wasinn: not counted as a crash", name,
                            child.process.pid, self.device.name, how)
                raise BackendRuntimeError(
                    f"{name}: the process running the model {how}, sent from outside "
                    f"wasinn ({OUTSIDE_SENDERS}): not a crash of the model or of these "
                    "inputs, which are not held against them (the host goes on; the next "
                    "run starts a new process)") from None
            if child.stopped_from_outside:
                how += f" a second time in {QUIET_S:g} s (which counts as a crash)"
            then = self._crashed(child, how, inputs, digest, caller)
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
        :func:`~._sandbox_errors.lost_context`): the process is retired, as its every
        later run would fail the same way, and this counts as a crash of ``caller``'s
        ``inputs`` (see :meth:`_crashed`), so that inputs that keep doing it do not keep
        the host starting processes. The host's own context is fine: the error is a
        wasinn error carrying the child's text, which the host's device watch does not
        read (see :func:`wasinn.backends.cuda.sticky_error`)."""
        error = child_error(payload)
        child.close()
        then = self._crashed(child, "lost its CUDA context", inputs, digest, caller)
        return error.suffixed(
            "(in the process that ran the sandboxed model, whose CUDA context this lost: it "
            f"was retired; {then})")

    def _crashed(self, child: SandboxProcess, how: str, inputs: Mapping[str, Tensor],
                 digest: bytes | None, caller: str | None) -> str:
        """Log a crash of ``child`` (``how`` it ended: a warning, whoever asks for the
        run: the host goes on, and an operator must learn which model crashes) during a
        run of ``caller``'s ``inputs`` (``digest``: theirs, where known) and count it
        towards the back-off (which logs a back-off it starts): what happens next, for
        the run's error. Raises nothing: reading the inputs may not hide the crash (were
        they unreadable, it counts as the graph's own)."""
        log.warning("%s: sandbox process %d on %s %s during a run%s", self._name,
                    child.process.pid, self.device.name, how,
                    "" if caller is None else f" of caller {caller!r}")
        try:
            inputs_of = (shapes_of(inputs), digest or digest_of(inputs))
        except Exception:
            log.exception("%s: the inputs of a run that crashed its sandbox process cannot "
                          "be remembered: the crash counts as the graph's", self._name)
            inputs_of = None
        with self._cond:
            return self.backoff.crashed(how, inputs_of, caller)

    def close(self) -> None:
        """Close the idle processes now, and those running when their run ends."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cond.notify_all()
            self._settled.notify_all()
        close_idle(idle, self._limit)
