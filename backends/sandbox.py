"""Graphs run in a process of their own, so that a library crash kills that process only.

Fuzzing the libraries through wasinn's own backends (2026-11-21) found inputs that kill
the process running them, with models no check refuses: OpenVINO's CPU plugin on
``GatherND``, ``ScatterElements``, ``ScatterND``, ``Pad``, ``Slice`` and ``Col2Im`` given
out-of-range indices, pads or steps as *inputs* (SIGSEGV, SIGABRT, SIGFPE); ONNX
Runtime's ``RoiAlign`` and ``MaxRoiPool`` given bad boxes or batch indices; torch's
``ctc_loss``, ``cummax``/``cummin`` helpers and ``linalg.eigvals`` on NaN. In the host's
process each of those kills every guest and caller with it. :func:`load_sandboxed`
compiles a graph in a child process instead (``python -m wasinn.backends._sandbox_child``):

* The child imports the same backend, loads the model and answers runs one at a time.
  The model's bytes, inputs and outputs lie in memory both processes map (an arena, a
  ``memfd`` on Linux); a Unix socket pair carries the messages that place them (the
  host's requests pickled, the child's replies JSON, checked before use: see
  :mod:`._sandbox_wire`). Outputs are host tensors, copied out of the arena: a sandboxed
  graph keeps nothing on its device between runs of different graphs.
* On CPU the child confines itself before the library reads the model (:mod:`._confine`:
  no new privileges, no core files, bounded file sizes, seccomp, Landlock where the
  kernel has it) and bounds the memory it may hold (``RLIMIT_DATA``: the options'
  ``max_sandbox_bytes``, by default half the machine's memory). A run or a load that
  needs more fails with the library's allocation error, which then names the bound; the
  process goes on. A GPU child is neither confined nor bounded (its driver opens device
  files and maps its own memory).
* A child that dies (a signal, an exit) fails the run or the load that was under way
  with BackendRuntimeError (InvalidEncodingError for a load) naming the signal; the
  graph starts a new child, and loads the model again, for its next run.
* Cancelling a run (the actor's :class:`~.base.Cancellation`) tells the child, whose
  backend stops at its library's next check; a run that has not stopped
  :data:`CANCEL_GRACE_S` later (TorchScript code between loops, an OpenVINO ``Loop``)
  has its process killed. A cancel while the model is being loaded (a first compile, or
  the reload before a run after a crash) kills the loading process at once. So a
  sandboxed run can always be stopped, which an in-process one cannot, and a request's
  deadline bounds the reload its run waits for.

What it costs (``benchmarks/sandbox_overhead.py``): starting the child and importing the
library at each load (0.2-0.4 s for ONNX Runtime here, 1.5-2.4 s for torch), a copy of
every input into the arena and of every output out of it, and two process wake-ups per
run. A graph serves one run at a time. Its arena keeps the size of the largest run's
inputs and outputs.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from wasinn import errors
from wasinn.enums import ExecutionTarget, GraphEncoding, TensorType
from wasinn.errors import (
    BackendRuntimeError,
    ClosedResourceError,
    InvalidEncodingError,
    WasiNNError,
)
from wasinn.tensor import Tensor

from . import _confine
from ._sandbox_child import CANCEL
from ._sandbox_wire import AGAIN, ALIGN, Arena, read_reply, receive, request, send
from .base import Backend, Builders, CompiledGraph, Device, LoadOptions, TensorSpec
from .base import current_cancellation as _current_cancellation

log = logging.getLogger("wasinn.backends")

#: How long a cancelled run may go on before its process is killed, in seconds.
CANCEL_GRACE_S = 1.0
#: How long a closing child may take to exit before it is killed, in seconds.
CLOSE_WAIT_S = 5.0
#: The least ``max_sandbox_bytes`` the configuration accepts (a process holds about
#: 0.3-0.6 GB once Python and a library are imported: the child checks what it holds).
MIN_MAX_BYTES = 64 * 1024 * 1024


def default_max_bytes() -> int:
    """The memory a sandboxed graph's process may hold by default: half the machine's."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2


def load_sandboxed(backend: Backend, builders: Builders, encoding: GraphEncoding,
                   device: Device, options: LoadOptions | None = None) -> SandboxedGraph:
    """``backend.load(...)``, run in a process of its own (see the module docstring).

    Raises what the backend's load raises, InvalidEncodingError when the process dies
    loading the model, and BackendRuntimeError when no process can be started.
    """
    return SandboxedGraph(backend, builders, encoding, device, options or LoadOptions())


def _entry(backend: Backend) -> str:
    cls = type(backend)
    return f"{cls.__module__}:{cls.__qualname__}"


def _died(process: subprocess.Popen[bytes]) -> str:
    """How ``process`` ended: "was killed by SIGSEGV", "exited with status 1"."""
    try:
        code = process.wait(CLOSE_WAIT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        code = process.wait()
    if code < 0:
        return f"was killed by {_confine.signal_name(-code)}"
    return f"exited with status {code}"


def _child_env(backend: Backend) -> dict[str, str]:
    """The host's environment, with its import path and the folder the backend's module
    was imported from: the child imports that module (a plug-in's too) as the host did."""
    env = dict(os.environ)
    paths = [os.path.abspath(p or os.curdir) for p in sys.path]
    module = sys.modules.get(type(backend).__module__)
    file = getattr(module, "__file__", None)
    if file is not None:  # the folder holding its top-level package
        root = Path(file).resolve().parents[type(backend).__module__.count(".")]
        paths.insert(0, str(root))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if os.path.isdir(p))
    return env


class _Child:
    """One process serving one graph, and the sockets to it."""

    def __init__(self, backend: Backend, confined: bool, max_bytes: int | None) -> None:
        self._name = backend.name
        self._confine_dir: tempfile.TemporaryDirectory[str] | None = None
        try:
            self.arena = Arena.create()
        except OSError as exc:
            raise BackendRuntimeError(
                f"{backend.name}: cannot make memory to share with a sandbox process: {exc}"
            ) from exc
        requests, theirs = socket.socketpair()
        cancels, their_cancels = socket.socketpair()
        command = [sys.executable, "-m", "wasinn.backends._sandbox_child",
                   str(theirs.fileno()), str(their_cancels.fileno()), str(self.arena.fd),
                   _entry(backend)]
        if confined:
            self._confine_dir = tempfile.TemporaryDirectory(prefix="wasinn-sandbox-")
            command.append(self._confine_dir.name)
            if max_bytes is not None:
                command.append(str(max_bytes))
        try:
            self.process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(), their_cancels.fileno(), self.arena.fd),
                env=_child_env(backend), cwd=self._confine_dir.name if self._confine_dir else None)
        except OSError as exc:
            requests.close()
            cancels.close()
            self._cleanup()
            raise BackendRuntimeError(
                f"{backend.name}: cannot start a process to run the model in: {exc}") from exc
        finally:
            theirs.close()
            their_cancels.close()
        self.conn = Connection(requests.detach())
        self._cancels = cancels
        self._cancel_lock = threading.Lock()
        self.seq = 0
        #: The sequence number of the run under way (-1: none).
        self.running = -1
        #: Whether it is loading the model (a cancel then kills it at once).
        self.loading = True
        self.killed_for_cancel = False

    def call(self, payload: object, tensors: Mapping[str, Tensor] | None = None, *,
             reserve: int = 0) -> tuple[dict[str, Any], dict[str, Tensor]]:
        """Send a request (``reserve``: bytes its reply's tensors are expected to need) and
        read its reply, growing the arena once if the reply asks. EOFError or OSError when
        the process is gone, ValueError for a reply that is not one, BackendRuntimeError
        when the arena cannot grow."""
        with self._growing():
            header = request(self.arena, payload, tensors, reserve=reserve)
        send(self.conn, header)
        answer, result = read_reply(self.arena, receive(self.conn))
        if "grow" in answer:
            with self._growing():
                self.arena.grow(answer["grow"])
            send(self.conn, request(self.arena, (AGAIN, self.running, None)))
            answer, result = read_reply(self.arena, receive(self.conn))
            if "grow" in answer:
                raise ValueError("a reply asking twice for a larger arena")
        return answer, result

    @contextlib.contextmanager
    def _growing(self) -> Iterator[None]:
        """Around what may grow the arena: BackendRuntimeError when the system has not
        the memory."""
        try:
            yield
        except OSError as exc:
            raise BackendRuntimeError(
                f"{self._name}: the tensors cannot be placed in the memory shared with the "
                f"sandbox process: growing it failed: {exc}") from None

    def cancel(self, seq: int) -> None:
        """Ask the child to stop run ``seq``; kill it if that run is still going
        :data:`CANCEL_GRACE_S` later. Called from any thread."""
        with self._cancel_lock, contextlib.suppress(OSError):
            self._cancels.sendall(CANCEL.pack(seq))
        timer = threading.Timer(CANCEL_GRACE_S, self._kill_if_running, (seq,))
        timer.daemon = True
        timer.start()

    def stop_loading(self) -> None:
        """Kill the process if it is still loading the model: a library's load cannot be
        interrupted, and one that takes long must not hold the run it is for (a cancel
        callback; any thread)."""
        with self._cancel_lock:
            if self.loading:
                self._kill_for_cancel()

    def loaded(self) -> None:
        with self._cancel_lock:
            self.loading = False

    def _kill_if_running(self, seq: int) -> None:
        if self.running == seq:
            self._kill_for_cancel()

    def _kill_for_cancel(self) -> None:
        if self.process.poll() is None:
            self.killed_for_cancel = True
            with contextlib.suppress(OSError):
                self.process.kill()

    def ended(self) -> str:
        """How the process ended (it has, or is about to: its socket closed)."""
        how = _died(self.process)
        self._cleanup()
        return how

    def close(self) -> None:
        """Ask the process to exit, wait for it (killing it past :data:`CLOSE_WAIT_S`)."""
        with contextlib.suppress(OSError, ValueError):
            send(self.conn, request(self.arena, ("close", -1, None)))
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(CLOSE_WAIT_S)
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._cleanup()

    def _cleanup(self) -> None:
        for closeable in (getattr(self, "conn", None), getattr(self, "_cancels", None)):
            if closeable is not None:
                with contextlib.suppress(OSError):
                    closeable.close()
        if self._confine_dir is not None:
            self._confine_dir.cleanup()
            self._confine_dir = None
        if getattr(self, "arena", None) is not None:
            self.arena.close()


def _spec(entry: Any) -> TensorSpec:
    name, type_, shape, rank_known = entry
    return TensorSpec(str(name), TensorType(type_),
                      tuple(None if d is None else int(d) for d in shape), bool(rank_known))


def _static_nbytes(spec: TensorSpec) -> int:
    """The bytes a tensor of ``spec`` takes, where its shape is known (else 0)."""
    dims = [d for d in spec.shape if d is not None]
    if not spec.rank_known or len(dims) != len(spec.shape):
        return 0
    return math.prod(dims) * spec.type.itemsize


def _aliases(value: Any) -> Mapping[str, int]:
    return {str(k): int(v) for k, v in dict(value).items()}


def _error(payload: Mapping[str, Any]) -> WasiNNError:
    """The wasinn error a child reported (BackendRuntimeError for a class it may not
    name)."""
    kind, message = payload["error"]
    cls = getattr(errors, str(kind), None)
    if not (isinstance(cls, type) and issubclass(cls, WasiNNError)):
        cls = BackendRuntimeError
    return cls(str(message))


class SandboxedGraph(CompiledGraph):
    """A graph compiled and run in a child process (see the module docstring)."""

    def __init__(self, backend: Backend, builders: Builders, encoding: GraphEncoding,
                 device: Device, options: LoadOptions) -> None:
        self.device = device
        self._backend = backend
        #: Whether its processes confine themselves: on the CPU only (a GPU's driver
        #: opens device files).
        self._confined = device.kind is ExecutionTarget.CPU
        #: The memory its processes may hold (None: not bounded).
        self.max_bytes = (options.max_sandbox_bytes or default_max_bytes()
                          if self._confined else None)
        self._load = (encoding, device, options)
        self._files = {str(i): Tensor.from_bytes([len(b)], TensorType.U8, bytes(b))
                       for i, b in enumerate(builders)}
        #: Bytes a run's outputs are expected to need in the arena: the largest so far.
        self._reserve = 0
        self._lock = threading.Lock()
        self._closed = False
        self._child: _Child | None = None
        try:
            payload = self._start()
            self.inputs = tuple(_spec(e) for e in payload["inputs"])
            self.outputs = tuple(_spec(e) for e in payload["outputs"])
            self.input_aliases = _aliases(payload["input_aliases"])
            self.output_aliases = _aliases(payload["output_aliases"])
            self._reserve = sum(_static_nbytes(spec) + ALIGN for spec in self.outputs)
        except (KeyError, TypeError, ValueError) as exc:
            self.close()
            raise BackendRuntimeError(
                f"{backend.name}: the process loading the model answered {exc!r:.200}: "
                "expected the model's inputs and outputs") from None
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int | None:
        """The process serving this graph now (None between a crash and the next run)."""
        child = self._child
        return None if child is None else child.process.pid

    def _start(self) -> dict[str, Any]:
        child = _Child(self._backend, self._confined, self.max_bytes)
        name = self._backend.name
        cancellation = _current_cancellation()
        forget = (cancellation.on_cancel(child.stop_loading)
                  if cancellation is not None else None)
        try:
            payload, _ = child.call(self._load, self._files)
            child.loaded()
            child.arena.release()  # the model's bytes
        except (EOFError, OSError):
            how = child.ended()
            if child.killed_for_cancel:
                raise BackendRuntimeError(
                    f"{name}: cancelled while a process loaded the model: it was "
                    "stopped") from None
            raise InvalidEncodingError(
                f"{name}: the process loading the model {how}: the library "
                "crashed on it (the host goes on)") from None
        except ValueError as exc:
            child.close()
            raise BackendRuntimeError(
                f"{name}: the process loading the model answered badly: {exc}") from None
        finally:
            if forget is not None:
                forget()
        if "error" in payload:
            child.close()
            raise _error(payload)
        self._child = child
        log.debug("sandbox process %d for %s on %s loaded the model", child.process.pid,
                  name, self.device.name)
        if self._confined:
            confined = payload.get("confined")
            _confine.log_report(confined if isinstance(confined, dict) else None,
                                "sandboxed model", "sandbox processes")
        return payload

    def run(self, inputs: Mapping[str, Tensor], *, outputs: Sequence[str] | None = None,
            keep_on_device: bool = False) -> dict[str, Tensor]:
        name = self._backend.name
        with self._lock:
            if self._closed:
                raise ClosedResourceError(f"{name}: the graph is closed")
            child = self._child
            if child is None:  # the last one died: a new process, the model loaded again
                self._start()
                child = self._child
                assert child is not None
            child.seq += 1
            seq = child.running = child.seq
            cancellation = _current_cancellation()
            forget = (cancellation.on_cancel(lambda: child.cancel(seq))
                      if cancellation is not None else None)
            try:
                payload, result = child.call(
                    ("run", seq, None if outputs is None else list(outputs)), inputs,
                    reserve=self._reserve)
            except (EOFError, OSError):
                self._child = None
                how = child.ended()
                if child.killed_for_cancel:
                    raise BackendRuntimeError(
                        f"{name}: the run was cancelled and did not stop within "
                        f"{CANCEL_GRACE_S:g} s: its process was killed") from None
                raise BackendRuntimeError(
                    f"{name}: the process running the model {how}: the library crashed "
                    "on this model or these inputs (the host goes on; the next run "
                    "starts a new process)") from None
            except ValueError as exc:
                self._child = None
                child.close()
                raise BackendRuntimeError(
                    f"{name}: the process running the model answered badly: {exc}"
                ) from None
            finally:
                child.running = -1
                if forget is not None:
                    forget()
        if "error" in payload:
            raise _error(payload)
        self._reserve = max(self._reserve, sum(t.nbytes + ALIGN for t in result.values()))
        return result

    def close(self) -> None:
        with self._lock:
            self._closed = True
            child, self._child = self._child, None
        if child is not None:
            child.close()

