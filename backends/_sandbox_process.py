"""A sandbox process (see :mod:`.sandbox`): the child process one sandboxed graph runs in,
the memory and the sockets shared with it, and how it is cancelled, killed and closed.

It is started by :class:`SandboxProcess`'s constructor, which returns at once: the child
then imports the backend's library (0.1-1.5 s) while the host goes on, says it is
:meth:`~SandboxProcess.ready`, and waits for its load request. So a process can be
started ahead of the load it will serve (a spare, see :mod:`._sandbox_spares`, which
imports at the lowest priority). A start that fails (no descriptor left for a socket, no
room for the private folder, no process) frees what it made, its place under the host's
bound included, and raises BackendRuntimeError naming what failed.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import platform
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from wasinn.errors import BackendRuntimeError
from wasinn.tensor import Tensor

from . import _confine
from ._private_dirs import PrivateDir
from ._sandbox_child import (
    CANCEL,
    CHILD_START,
    CODE_FOLDERS,
    CONFINE_MODULE,
    GPU,
    READ_PATHS,
    READY,
    SPARE_START,
)
from ._sandbox_env import given, held_back
from ._sandbox_limit import Slot
from ._sandbox_read import readable_now
from ._sandbox_wire import AGAIN, Arena, Expected, read_reply, receive, request, send
from .base import BackendRef

log = logging.getLogger("wasinn.backends")

#: How long a cancelled run may go on before its process is killed, in seconds.
CANCEL_GRACE_S = 1.0
#: How long a child whose socket closed may take to exit before it is killed, in seconds.
EXIT_WAIT_S = 5.0
#: What a CPU graph's confined process is given to see no CUDA GPU: torch then answers
#: ``cuda.is_available()``, which it asks itself (``torch.export.load`` does), from these
#: alone, without the CUDA driver, which the lock-down denies its device files (on a
#: machine with an NVIDIA GPU: a warning of CUDA error 304 at each such load).
NO_CUDA = {"CUDA_VISIBLE_DEVICES": "", "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
#: The private folders of confined processes: ``wasinn-sandbox-<host's pid>-<random>``,
#: in the system temporary folder.
PRIVATE_DIR_PREFIX = "wasinn-sandbox-"
#: What a process that could not start sends on the CANCELS socket instead of
#: :data:`~._sandbox_child.READY`, before the error that ended it (``Type: message``,
#: UTF-8, at most :data:`START_FAILURE_BYTES` bytes).
START_FAILED = b"F"
START_FAILURE_BYTES = 2000
#: Put before the start program of every process (standard library only: it runs before
#: the lock-down and before wasinn can be imported): an error that ends the process
#: uncaught (Python cannot import wasinn or its dependencies, for one that a confined
#: process may not read; the lock-down fails) is sent to the host, which then reports
#: that the process could not start (:meth:`SandboxProcess.start_failure`) rather than a
#: crash on the model, which it has not read. Its traceback goes to stderr as before.
_REPORT_START_FAILURE = f"""
import os as _os, sys as _sys

def _start_failed(kind, exc, tb, _shown=_sys.excepthook):
    try:
        said = f"{{kind.__name__}}: {{exc}}".encode("utf-8", "replace")
        _os.write(int(_sys.argv[2]), {START_FAILED!r} + said[:{START_FAILURE_BYTES}])
    except Exception:
        pass
    _shown(kind, exc, tb)

_sys.excepthook = _start_failed
"""


def _died(process: subprocess.Popen[bytes]) -> str:
    """How ``process`` ended: "was killed by SIGSEGV", "exited with status 1"."""
    try:
        code = process.wait(EXIT_WAIT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        code = process.wait()
    if code < 0:
        return f"was killed by {_confine.signal_name(-code)}"
    return f"exited with status {code}"


#: Who sends the signals of :data:`._confine.OUTSIDE_STOPS`, for the errors of the runs and
#: loads they end.
OUTSIDE_SENDERS = "an operator's kill, or a service manager stopping the service's processes"

#: The host's environment variables a confined process is given (:func:`_child_env`), by
#: name: where its programs and libraries are, its language and time zone. An operator
#: names others (``[runtime] sandbox_env``, see :mod:`._sandbox_env`).
CONFINED_ENV_NAMES = frozenset({"PATH", "LD_LIBRARY_PATH", "LANG", "LANGUAGE", "TZ",
                                "SYSTEMROOT"})
#: ... and by prefix: the locale's, the GPUs' and their drivers', the thread pools' (OpenMP,
#: MKL, OpenBLAS, TBB), the libraries' own (OpenVINO, ONNX Runtime, torch) and wasinn's.
CONFINED_ENV_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "CUDNN_", "OMP_", "KMP_", "GOMP_",
                         "MKL_", "OPENBLAS_", "TBB_", "OV_", "OPENVINO_", "ORT_",
                         "ONNXRUNTIME_", "TORCH_", "PYTORCH_", "WASINN_")


def _confined_env(extra: tuple[str, ...] = ()) -> dict[str, str]:
    """The host's environment variables that :data:`CONFINED_ENV_NAMES` and
    :data:`CONFINED_ENV_PREFIXES` name, those that name the user
    (:data:`USER_NAME_VARIABLES`), and those that ``extra`` gives (names, and prefixes
    ending in ``*``, which never give a name that looks like a credential: see
    :func:`._sandbox_env.given`; those held back are logged, :func:`_log_held_back`)."""
    patterns = _DEFAULT_PATTERNS + extra
    env = {key: value for key, value in os.environ.items()
           if key in CONFINED_ENV_NAMES or key in USER_NAME_VARIABLES or given(key, patterns)}
    _log_held_back([key for key in os.environ if key not in env and held_back(key, patterns)],
                   patterns)
    return env


#: :data:`CONFINED_ENV_PREFIXES` as prefix patterns (which hold back credential-looking
#: names as an operator's do: ``NVIDIA_API_KEY``).
_DEFAULT_PATTERNS = tuple(f"{prefix}*" for prefix in CONFINED_ENV_PREFIXES)


#: The variables :func:`_log_held_back` has named at INFO.
_told: set[str] = set()


def _log_held_back(names: list[str], patterns: tuple[str, ...]) -> None:
    """Say (one line) that a process started now is not given ``names``, which a prefix
    of ``patterns`` (the default list's, then [runtime] sandbox_env's) matches: at INFO
    where one of them is new, else at DEBUG."""
    if not names:
        return
    level = logging.DEBUG if _told.issuperset(names) else logging.INFO
    _told.update(names)
    prefixes = [pattern for pattern in patterns if pattern.endswith("*")
                and any(name.startswith(pattern[:-1]) for name in names)]
    log.log(level, "a confined sandbox process is not given %s, which %s of the default "
            "list or of [runtime] sandbox_env match%s: a prefix never gives a variable "
            "whose name looks like a credential; name it exactly in sandbox_env to give it",
            ", ".join(sorted(names)), " or ".join(f'"{p}"' for p in prefixes),
            "" if len(prefixes) > 1 else "es")


def _child_env(backend: BackendRef, confined: bool = True, extra: tuple[str, ...] = (),
               read: tuple[str, ...] = ()) -> dict[str, str]:
    """The environment of a process for ``backend``: of the host's, for a ``confined`` one
    only what :func:`_confined_env` keeps, the variables ``extra`` names included (not
    the host's secrets, its keys and tokens: a compromised child could hand them to the
    guest in its outputs), for one not
    confined all of it (its library may need what no list foresees, and such a process
    may read the host's ``/proc/<pid>/environ`` anyway). With an import path of two
    folders: the one the backend's module is found in and wasinn's own (the child imports
    that module, a plug-in's too, as the host would, whether or not the host has
    imported it). Not the rest of the host's ``sys.path``: a confined child may read the
    folders on its path, and the host's holds its working directory or its script's
    folder (a home directory, with its keys). A confined one is also told the paths of
    ``read`` it may read (:data:`~._sandbox_child.READ_PATHS`: those there now, resolved,
    see :func:`._sandbox_read.readable_now`), never the host's own value of that
    variable."""
    env = _confined_env(extra) if confined else dict(os.environ)
    tops = [_top_folder(backend.module), _top_folder("wasinn")]
    env["PYTHONPATH"] = os.pathsep.join(str(top) for top in tops if top is not None)
    env[CONFINE_MODULE] = str(Path(_confine.__file__).resolve())
    env[CODE_FOLDERS] = os.pathsep.join(_code_folders(tops))
    env[READ_PATHS] = os.pathsep.join(readable_now(read)) if confined else ""
    if _blas_unused(backend):
        env.setdefault("OPENBLAS_NUM_THREADS", "1")
    return env


def _blas_unused(backend: BackendRef) -> bool:
    """Whether the child computes without numpy's OpenBLAS: it copies tensors with numpy,
    and its library has BLAS of its own (ONNX Runtime's, OpenVINO's; torch's MKL on
    x86-64, but OpenBLAS on other machines). There OpenBLAS's threads, one per core, each
    reserving a 32 MB buffer at import (about 40 MB of data a core, 0.7 GB on 16 cores),
    count against the process's memory bound for nothing: one thread is asked for, unless
    the environment says otherwise."""
    return backend.name != "pytorch" or platform.machine().lower() in ("x86_64", "amd64")


#: The variables :func:`getpass.getuser` reads the user's name from, in its order, before
#: it asks the passwd database.
USER_NAME_VARIABLES = ("LOGNAME", "USER", "LNAME", "USERNAME")


def _name_the_user(env: dict[str, str]) -> None:
    """Give a confined child's ``env`` the user's name (``LOGNAME`` and ``USER``) where
    it names none: the child may not read the passwd database (``/etc/passwd``, which
    landlock keeps from it), and torch 2.11's ``import torch._dynamo``, which
    ``torch.export.load`` makes, asks :func:`getpass.getuser` for it and fails with
    ``KeyError`` ('getpwuid(): uid not found'). The host asks the database instead;
    where it cannot either, ``env`` is left as it was."""
    if any(env.get(variable) for variable in USER_NAME_VARIABLES):
        return
    name = _database_user_name()
    if name is not None:
        env["LOGNAME"] = env["USER"] = name


@functools.cache  # (asked once: a database on the network may take its time)
def _database_user_name() -> str | None:
    """This process's user's name in the passwd database; None where it has no entry or
    there is no such database."""
    try:
        import pwd  # (not on Windows)

        return pwd.getpwuid(os.getuid()).pw_name
    except (ImportError, KeyError):
        return None


def _top_folder(module: str) -> Path | None:
    """The folder ``module``'s top package is found in (None: not found; the child then
    says what is missing)."""
    try:
        spec = importlib.util.find_spec(module)  # imports its parents only
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    # (a package's origin is its __init__.py: one folder deeper than a module's file)
    depth = module.count(".") + (spec.submodule_search_locations is not None)
    root = Path(os.path.abspath(spec.origin)).parents[depth]
    return root if root.is_dir() else None


def _code_folders(tops: list[Path | None]) -> list[str]:
    """Where the files a confined child imports from ``tops`` and wasinn really are: an
    editable install's are links into the source tree, whose folders landlock must let
    it read (it checks the file a link leads to)."""
    folders = {os.path.realpath(top) for top in tops if top is not None}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if (name == "wasinn" or name.startswith("wasinn.")) and path:
            folders.add(os.path.dirname(os.path.realpath(path)))
    return sorted(folders)


class SandboxProcess:
    """One process serving one graph (once loaded), and the sockets to it.

    ``confined``: whether it confines itself before the library reads the model (see
    :mod:`._confine`), in a private folder that is its working directory; ``gpu``: it
    may then use the GPUs' device files (a GPU graph's process). ``spare``: it imports
    at the lowest priority (see :mod:`._sandbox_child`).
    ``slot``: its place under the host's bound on sandbox processes
    (:class:`~._sandbox_limit.ProcessLimit`), freed when it has ended (or could not be
    started). ``extra_env``: the host's environment variables a confined process is given
    besides the default ones (names, and prefixes ending in ``*``, checked already: see
    :mod:`._sandbox_env`); one not confined is given all of them. ``extra_read``: the
    folders and files a confined process may read besides the default ones (absolute
    paths, checked already: see :mod:`._sandbox_read`; those not there as it starts are
    left out); one not confined may read anything its user may.

    Raises BackendRuntimeError, naming what could not be made (the shared memory, the
    sockets, the private folder, the process), when it cannot be started: then whatever
    was made for it is freed, ``slot`` included.
    """

    def __init__(self, backend: BackendRef, confined: bool, *, gpu: bool = False,
                 spare: bool = False, slot: Slot | None = None,
                 extra_env: tuple[str, ...] = (), extra_read: tuple[str, ...] = ()) -> None:
        self._slot = slot
        self._name = backend.name
        self._confined = confined
        self._confine_dir: PrivateDir | None = None
        # Each step names what it makes, for the error should it fail (EMFILE from a
        # socket pair, ENOSPC from the private folder, EAGAIN from fork ...): everything
        # made so far is then freed, the slot included, or the host's bound on sandbox
        # processes would count it for ever (and at that bound every load would wait).
        made: list[socket.socket] = []
        step = "make memory to share with a sandbox process"
        try:
            self.arena = Arena.create()
            step = "open the sockets to a sandbox process"
            requests, theirs = socket.socketpair()
            made += (requests, theirs)
            cancels, their_cancels = socket.socketpair()
            made += (cancels, their_cancels)
            start = ["-c", _REPORT_START_FAILURE + (SPARE_START if spare else CHILD_START)]
            command = [sys.executable, *start, str(theirs.fileno()),
                       str(their_cancels.fileno()), str(self.arena.fd), backend.entry]
            step = "prepare the environment of a sandbox process"
            env = _child_env(backend, confined, extra_env, extra_read)
            if confined:
                step = "make the private folder of a sandbox process"
                # (named after this process: a later one removes it should this one
                # be killed before it could, see ._private_dirs)
                self._confine_dir = PrivateDir(PRIVATE_DIR_PREFIX)
                command.append(self._confine_dir.path)
                if gpu:
                    command.append(GPU)
                else:
                    env.update(NO_CUDA)
                # Its home and temporary folder too: what libraries write there (OpenVINO
                # writes a telemetry id as it starts, and an ONNX model's external data
                # files to read them) it may write only in its own folder.
                env["HOME"] = env["XDG_CACHE_HOME"] = env["TMPDIR"] = self._confine_dir.path
                _name_the_user(env)
            step = "start a process to run the model in"
            self.process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(), their_cancels.fileno(), self.arena.fd),
                env=env, cwd=self._confine_dir.path if self._confine_dir else None)
        except BaseException as exc:
            for end in made:
                end.close()
            self._cleanup()
            if not isinstance(exc, Exception):  # (KeyboardInterrupt: as it is)
                raise
            raise BackendRuntimeError(f"{backend.name}: cannot {step}: {exc}") from exc
        theirs.close()  # (the child's ends: it has them now)
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
        self._ready = False

    def ready(self) -> bool:
        """Whether it has imported its library (without waiting)."""
        if not self._ready:
            with contextlib.suppress(OSError):  # BlockingIOError: not yet
                # (peeked: what one that could not start said stays for start_failure)
                self._ready = self._cancels.recv(
                    len(READY), socket.MSG_DONTWAIT | socket.MSG_PEEK) == READY
        return self._ready

    def start_failure(self) -> BackendRuntimeError | None:
        """Why it ended on its own before it was ready, so before it read any model
        (Python could not import wasinn, the library or a dependency; the lock-down
        failed): how it ended and the error it sent. None where it was ready, or was
        ended by a signal (killed for a cancel or by its closing, stopped from outside,
        a crash: the caller's to report). Call it once its socket has closed: it waits
        for the process to end (see :func:`_died`)."""
        if self.ready() or self.killed_for_cancel:
            return None
        how = _died(self.process)
        said = bytearray()
        with contextlib.suppress(OSError):  # BlockingIOError: nothing (more) sent
            while chunk := self._cancels.recv(4096, socket.MSG_DONTWAIT):
                said += chunk
        if said.startswith(READY):  # (said as it ended)
            self._ready = True
            return None
        failed = said.startswith(START_FAILED)
        if not failed and self.process.returncode <= 0:
            return None
        error = said[len(START_FAILED):].decode("utf-8", "replace") if failed else ""
        hint = ("; a confined one may read only the folders of its import path, the Python "
                "installation, the system's libraries and [runtime] sandbox_read"
                if self._confined and error.startswith("PermissionError") else "")
        return BackendRuntimeError(
            f"{self._name}: the sandbox process {how} as it started, before it read the "
            f"model{': ' if error else ''}{error} (it could not set itself up: the model "
            f"is not to blame{hint})")

    @staticmethod
    def key_of(backend: BackendRef, confined: bool, gpu: bool = False
               ) -> tuple[str, bool, bool]:
        """What the processes that can serve the same loads share: the backend's
        ``module:Class``, whether they are confined, and whether they may use the GPUs'
        device files (a process confined for the CPU cannot load on a GPU, and one that
        may use them is not a CPU graph's)."""
        return backend.entry, confined, confined and gpu

    def call(self, payload: object, tensors: Mapping[str, Tensor] | None = None, *,
             reserve: int = 0, expected: Expected | None = None
             ) -> tuple[dict[str, Any], dict[str, Tensor]]:
        """Send a request (``reserve``: bytes its reply's tensors are expected to need) and
        read its reply, growing the arena once if the reply asks; ``expected``: what the
        reply may hold (None: no tensor, as a load's reply; see
        :func:`~._sandbox_wire.read_reply`). EOFError or OSError when the process is
        gone, BackendRuntimeError when it is gone before it was ready
        (:meth:`start_failure`) or the arena cannot grow, ValueError for a reply that is
        not one."""
        try:
            return self._exchange(payload, tensors, reserve,
                                  Expected() if expected is None else expected)
        except (EOFError, OSError):
            failure = self.start_failure()
            if failure is None:
                raise
            raise failure from None

    def _exchange(self, payload: object, tensors: Mapping[str, Tensor] | None,
                  reserve: int, expected: Expected
                  ) -> tuple[dict[str, Any], dict[str, Tensor]]:
        """:meth:`call`'s request and reply."""
        with self._growing():
            header = request(self.arena, payload, tensors, reserve=reserve)
        send(self.conn, header)
        answer, result = read_reply(self.arena, receive(self.conn), expected)
        if "grow" in answer:
            with self._growing():
                self.arena.grow(answer["grow"])
            send(self.conn, request(self.arena, (AGAIN, self.running, None)))
            answer, result = read_reply(self.arena, receive(self.conn), expected)
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

    @property
    def stopped_from_outside(self) -> bool:
        """Whether it has ended by a signal sent from outside (SIGTERM, SIGHUP: see
        :data:`._confine.OUTSIDE_STOPS`), not by a crash of its library."""
        return _confine.stopped_from_outside(self.process.returncode)

    def close(self) -> None:
        """Kill the process, wait for it and free what it shared. Killed rather than
        asked to exit: it holds nothing to save (the model's bytes and every output
        are the host's), and it is gone in about half the time (measured with torch:
        17 against 32 ms), which an unload waits for."""
        with contextlib.suppress(OSError):
            self.process.kill()
        self.process.wait()
        self._cleanup()

    def _cleanup(self) -> None:
        slot, self._slot = self._slot, None
        if slot is not None:
            slot.free()
        for closeable in (getattr(self, "conn", None), getattr(self, "_cancels", None)):
            if closeable is not None:
                with contextlib.suppress(OSError):
                    closeable.close()
        if self._confine_dir is not None:
            self._confine_dir.remove()
            self._confine_dir = None
        if getattr(self, "arena", None) is not None:
            self.arena.close()
