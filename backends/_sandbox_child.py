"""The process a sandboxed graph runs in (see :mod:`.sandbox`): ``python -c
CHILD_START REQUESTS CANCELS ARENA ENTRY [CONFINE_DIR [gpu]]``, or ``python -c
SPARE_START`` with the same arguments for a spare. A confined one locks itself down
first, before it imports anything that starts a thread (:data:`CHILD_START`); one for a
GPU graph (``gpu``: :data:`GPU`) may use the GPUs' device files (see :mod:`._confine`).

It imports the backend named by ENTRY (``module:Class``) and says so with one byte
(:data:`READY`) on the CANCELS socket. A spare (a process started ahead of its load,
see :mod:`._sandbox_spares`) runs :data:`SPARE_START`: every import, this module's
(numpy, wasinn) and the library's, happens in a thread of the lowest priority (Linux's
``SCHED_IDLE``, nice :data:`SPARE_NICE`; on Linux a priority is a thread's own), so
that it takes only CPU time nobody else wants, while everything after, the load and
the runs, happens in the main thread at the priority the process was started with.

Then it reads one load request from the REQUESTS socket (the model's bytes in the
ARENA, see :mod:`._sandbox_wire`, with a registered ONNX model's external data files,
which it may not read itself: :data:`EXTERNAL`; and the bytes of memory it may hold, or
None), sets its resource limits (:func:`._confine.limit`, when CONFINE_DIR is given)
before the library sees the model's bytes, loads it (a CPU graph's without asking the
library which devices there are: :func:`_list_the_cpu_only`) and then answers run
requests one at a time (their outputs checked against what the graph declared, see
:func:`_run`) until the host kills it or goes away. A thread reads the CANCELS socket: the sequence
number of a run to cancel, which it hands to that run's Cancellation (the backend's own
interruption), if that run is still the current one.

A library error is answered as ``{"error": [class, message]}`` (on a GPU, with
``"lost_context": true`` where it lost the process's CUDA context); a crash just ends
the process, which the host reports. Once done it leaves through ``os._exit``: it holds
nothing to write back, and the interpreter's own exit with a library loaded (its
modules torn down, its thread pools joined) took 0.3 s with torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import socket
import struct
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

from wasinn.backends import _confine
from wasinn.backends._sandbox_wire import (
    AGAIN,
    Arena,
    DeclaredOutputs,
    read_request,
    receive,
    reply,
    send,
)
from wasinn.backends.base import (
    Backend,
    Cancellation,
    CompiledGraph,
    Device,
    mark_sandbox_process,
    running_under,
)
from wasinn.backends.cuda import context_failure, sticky_error
from wasinn.enums import ExecutionTarget
from wasinn.errors import BackendRuntimeError, InvalidArgumentError, WasiNNError
from wasinn.tensor import Tensor

#: The environment variable that holds the path of :mod:`._confine`'s file, which a
#: confined spare loads by path to lock itself down before it imports anything.
CONFINE_MODULE = "WASINN_CONFINE_MODULE"
#: The environment variable that lists (``os.pathsep``-separated) the folders the files
#: a confined process imports really are in (an editable install links them).
CODE_FOLDERS = "WASINN_SANDBOX_CODE"
#: The environment variable that lists (``os.pathsep``-separated) the folders and files an
#: operator lets a confined process read besides (``[runtime] sandbox_read``, resolved and
#: checked by the host: see :mod:`._sandbox_read`); one not there as it locks itself down
#: is left out, and so is one no longer what the host checked (``lock_down``'s ``named``).
READ_PATHS = "WASINN_SANDBOX_READ"
#: The names of a load request's tensors that hold the model's external data files (this,
#: then the file's location; the builders' are their positions: "0", "1" ...).
EXTERNAL = "external:"
#: The argument after CONFINE_DIR that lets a confined process use the GPUs' device files
#: (a GPU graph's: :func:`._confine.lock_down`'s ``gpu``).
GPU = "gpu"
#: A cancel message: the sequence number of the run to stop.
CANCEL = struct.Struct("<Q")
#: What the process sends on the CANCELS socket once it has made its backend.
READY = b"R"
#: The nice value of a spare's imports, under SCHED_IDLE (which alone left a guest's
#: first run as fast as with no spare: nice 19 alone did not).
SPARE_NICE = 19
#: How every sandbox process starts (``python -c``): a confined one locks itself down
#: (:func:`._confine.lock_down`, its file loaded by path) before it imports anything
#: that starts a thread (numpy's OpenBLAS starts one per core as it is imported, the
#: libraries theirs): landlock binds only the threads started after it.
_LOCK_DOWN = f"""
import importlib, importlib.util, os, signal, sys, threading

# A terminal's Ctrl-C goes to the host's whole process group: the host stops its sandbox
# processes itself (SIGKILL), so they do not take it (else each printed a
# KeyboardInterrupt traceback and the host logged a crash). SIGTERM still ends one: a
# process left running by a host killed outright can be ended so.
signal.signal(signal.SIGINT, signal.SIG_IGN)

locked = None
if len(sys.argv) > 5:  # confined
    spec = importlib.util.spec_from_file_location("_wasinn_confine",
                                                  os.environ["{CONFINE_MODULE}"])
    confine = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(confine)
    code_folders = os.environ.get("{CODE_FOLDERS}", "").split(os.pathsep)
    named = os.environ.get("{READ_PATHS}", "").split(os.pathsep)
    locked = confine.lock_down(sys.argv[5], code_folders, named=named,
                               gpu=sys.argv[6:] == ["{GPU}"]).as_dict()
"""
_RUN = """
from wasinn.backends._sandbox_child import run_main
run_main(sys.argv[1:], locked)
"""
#: A process's ``python -c`` program.
CHILD_START = _LOCK_DOWN + _RUN
#: A spare's ``python -c`` program (see the module docstring). An import that fails is
#: left for :func:`main`, which imports again and reports the error. Elsewhere than on
#: Linux a priority is the whole process's: there it is not lowered.
SPARE_START = _LOCK_DOWN + f"""
def imports():
    if sys.platform == "linux":  # each as far as this system allows; 0: this thread
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            pass
        try:
            os.setpriority(os.PRIO_PROCESS, 0, {SPARE_NICE})
        except OSError:
            pass
    try:
        importlib.import_module("wasinn.backends._sandbox_child")
        importlib.import_module(sys.argv[4].partition(":")[0])
    except BaseException:
        pass

thread = threading.Thread(target=imports, name="wasinn spare imports")
thread.start()
thread.join()
""" + _RUN


class _Current:
    """The run under way (its sequence number and Cancellation), shared with the thread
    that reads cancels."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seq = -1
        self.cancellation: Cancellation | None = None

    def start(self, seq: int) -> Cancellation:
        with self.lock:
            self.seq, self.cancellation = seq, Cancellation()
            return self.cancellation

    def cancel(self, seq: int) -> None:
        with self.lock:
            cancellation = self.cancellation if seq == self.seq else None
        if cancellation is not None:
            cancellation.cancel()


def _read_cancels(sock: socket.socket, current: _Current) -> None:
    # The host's end closes when it is gone, killed too: this process then leaves at
    # once, a run under way with it, instead of running on for nobody.
    while True:
        try:
            data = sock.recv(CANCEL.size, socket.MSG_WAITALL)
        except OSError:
            data = b""
        if len(data) != CANCEL.size:
            os._exit(0)
        current.cancel(CANCEL.unpack(data)[0])


#: Room a load needs past what the process holds before it (the least bound allowed).
LOAD_ROOM = 16 * 1024 * 1024


def _error(exc: BaseException, bound: int | None = None) -> dict[str, Any]:
    """The reply for ``exc``; one that looks like a failed allocation names ``bound``,
    the memory this process may hold."""
    if isinstance(exc, WasiNNError):
        kind, message = type(exc).__name__, exc.message
    else:
        kind, message = "BackendRuntimeError", f"{type(exc).__name__}: {exc}"
    if bound is not None and (isinstance(exc, MemoryError) or "alloc" in message.lower()):
        message = (f"{message.rstrip()} (a sandboxed graph's process may hold {bound} bytes: "
                   "max_sandbox_bytes)")
    return {"error": [kind, message]}


def _check_bound(bound: int) -> None:
    """InvalidArgumentError when ``bound`` leaves no room for a load."""
    used = _confine.data_in_use()
    if used is not None and bound < used + LOAD_ROOM:
        raise InvalidArgumentError(
            f"max_sandbox_bytes = {bound}: the sandbox process holds {used} bytes before it "
            f"loads the model (Python, the library, the model's bytes): expected at least "
            f"{used + LOAD_ROOM}, and room for the model's working memory")


def _specs(graph: CompiledGraph) -> dict[str, Any]:
    def spec(s: Any) -> list[Any]:
        # (null for a type the model does not declare: TorchScript's placeholder; the
        # bounds, [low, high] per dimension, only where the model has them)
        said = [s.name, s.type.value if s.type_known else None, list(s.shape), s.rank_known]
        return [*said, [list(b) for b in s.bounds]] if s.bounds else said

    return {"inputs": [spec(s) for s in graph.inputs],
            "outputs": [spec(s) for s in graph.outputs],
            "input_aliases": dict(graph.input_aliases),
            "output_aliases": dict(graph.output_aliases),
            "output_types_declared": bool(graph.output_types_declared)}


def _load(backend: Backend, load: tuple[Any, ...], files: dict[str, Tensor],
          locked: _confine.Report | None, bound: int | None) -> CompiledGraph:
    """The graph, loaded once this process's resource limits are set (a confined one's,
    whose lock-down ``locked`` notes them). Each file it writes may hold
    :data:`~._confine.FILE_SIZE_FACTOR` times the model's bytes, its external data's
    included (which OpenVINO writes to this process's folder to read them), plus the
    margin."""
    encoding, device, options = load
    # Copied out: the library may keep them, and the arena's next request overwrites it.
    external = {name.removeprefix(EXTERNAL): tensor.tobytes()
                for name, tensor in files.items() if name.startswith(EXTERNAL)}
    builders = [files[str(i)].tobytes() for i in range(len(files) - len(external))]
    del files
    if external:
        options = dataclasses.replace(options, external_data=external)
    if locked is not None:
        if bound is not None:
            _check_bound(bound)
        size = sum(map(len, builders)) + sum(map(len, external.values()))
        _confine.limit(locked, _confine.FILE_SIZE_FACTOR * size + _confine.FILE_SIZE_MARGIN,
                       data=bound, nofile=_confine.GPU_NOFILE
                       if device.kind is ExecutionTarget.GPU else _confine.NOFILE)
    if device.kind is ExecutionTarget.CPU:
        _list_the_cpu_only(backend)
    return backend.load(builders, encoding, device, options)


def _list_the_cpu_only(backend: Backend) -> None:
    """Have ``backend`` list the CPU alone, asking its library nothing (a CPU graph's
    process): which devices there are is the host's to find (it chose this one), and a
    library's listing loads the GPUs' drivers, which under the lock-down fail, crash or
    hang. On a machine with an NVIDIA GPU, torch's ``cudaGetDeviceCount`` failed (CUDA
    error 304: the driver is denied its device files, and may not start
    ``nvidia-modprobe``), and OpenVINO's ``Core.available_devices``, which loads its GPU
    plugin and every OpenCL driver, killed the process (SIGSEGV) or hung it. So its
    ``devices()`` answers the CPU (torch's load asks it; ONNX Runtime's and OpenVINO's
    ask it for another device only)."""
    cpu = Device(ExecutionTarget.CPU)
    vars(backend)["devices"] = lambda: [cpu]


def _run(graph: CompiledGraph, inputs: dict[str, Tensor], outputs: list[str] | None,
         declared: DeclaredOutputs, bound: int | None
         ) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The reply to a run: its outputs, or the error it raised; outputs that are not what
    the graph declared (a model that declares a shape it does not compute: ONNX Runtime
    only logs that) are an error here, so that the host, which checks them too, does not
    take this process for a compromised one. On a GPU, an error that lost this process's
    CUDA context, as the library's own exception says (never a message's words, which
    may be the model's) and, where the CUDA driver can be asked, that device's context
    confirms (as in the host: :meth:`wasinn.actors.devicectx.CudaContext.loss`), says so
    (``"lost_context": true``): the host then retires this process, whose every later
    run would fail the same way."""
    try:
        result = graph.run(inputs, outputs=outputs)
    except Exception as exc:
        error = _error(exc, bound)
        if _lost_context(graph.device, exc):
            error["lost_context"] = True
        return error, {}
    problem = declared.problem(result, outputs)
    if problem is not None:
        return {"error": ["BackendRuntimeError", f"{declared.backend}: the run's outputs are "
                          f"not those the model declares: {problem}"]}, {}
    return {"ok": True}, result


def _lost_context(device: Device, exc: BaseException) -> bool:
    """Whether ``exc``, raised by a run on ``device``, lost this process's CUDA context:
    one of the sticky CUDA errors in the library's own words, unless the driver, asked,
    finds the device's context fine (where it cannot be asked, the words decide)."""
    return (device.kind is not ExecutionTarget.CPU and sticky_error(exc) is not None
            and context_failure(device.index) != 0)


def _serve(conn: Connection, arena: Arena, graph: CompiledGraph, current: _Current,
           backend: str, bound: int | None) -> None:
    declared = DeclaredOutputs(backend, graph.outputs, graph.output_aliases,
                               graph.output_types_declared)
    # A reply that did not fit in the arena, kept until the host has grown it and asks
    # again: its payload, tensors and place.
    pending: tuple[dict[str, Any], dict[str, Tensor], int] | None = None
    while True:
        try:
            header = receive(conn)
        except EOFError:
            return
        (verb, seq, outputs), inputs, reply_at = read_request(arena, header)
        if verb == AGAIN and pending is not None:
            send(conn, reply(arena, pending[0], pending[1], at=pending[2])[0])
            pending = None
            continue
        pending = None
        with running_under(current.start(seq)):
            payload, result = _run(graph, inputs, outputs, declared, bound)
        message, fits = reply(arena, payload, result, at=reply_at)
        if not fits:
            pending = payload, result, reply_at
        send(conn, message)


def _make(entry: str) -> Backend:
    module, _, attr = entry.partition(":")
    try:
        backend: Backend = getattr(importlib.import_module(module), attr)()
    except Exception as exc:
        raise BackendRuntimeError(
            f"the sandbox process cannot make the backend {entry}: "
            f"{type(exc).__name__}: {exc}") from None
    return backend


def main(argv: list[str], locked: dict[str, Any] | None = None) -> int:
    """Serve one graph (see the module docstring). ``locked``: the report of the
    lock-down :data:`CHILD_START` or :data:`SPARE_START` applied before the imports,
    where CONFINE_DIR is given (this process's resource limits are added to it)."""
    mark_sandbox_process()
    requests = Connection(int(argv[0]))
    cancels = socket.socket(fileno=int(argv[1]))
    arena = Arena.attach(int(argv[2]))
    report: _confine.Report | None = None
    if len(argv) > 4:  # confined: locked down by CHILD_START or SPARE_START already
        report = _confine.Report.from_dict(locked or {})
    current = _Current()
    # Started after the lock-down, which binds the threads started after it.
    threading.Thread(target=_read_cancels, args=(cancels, current), daemon=True).start()
    bound = None
    try:
        backend = _make(argv[3])
        with contextlib.suppress(OSError):
            cancels.sendall(READY)
        (*load, bound), files, _ = read_request(arena, receive(requests))
        graph = _load(backend, tuple(load), files, report, bound)
    except EOFError:
        return 0
    except Exception as exc:
        send(requests, reply(arena, _error(exc, bound))[0])
        return 0
    confined = None if report is None else report.as_dict()
    send(requests, reply(arena, {"ok": True, "confined": confined, **_specs(graph)})[0])
    try:
        _serve(requests, arena, graph, current, backend.name, bound)
    finally:
        graph.close()
    return 0


def run_main(argv: list[str], locked: dict[str, Any] | None = None) -> None:
    """:func:`main`, then leave at once (see the module docstring)."""
    code = main(argv, locked)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run_main(sys.argv[1:])
