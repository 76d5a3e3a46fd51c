"""Confining a child process that reads untrusted bytes, before it reads them.

OpenVINO's TensorFlow and TensorFlow Lite frontends run in a throw-away child (see
:mod:`._ovread`) because malformed models crashed them, and sandboxed graphs run in a
process of their own (:mod:`.sandbox`). A crash kills only the child; this module is the
defence against worse (code run by a memory-safety bug), applied by the child to itself
before the library sees the model, in two parts.

:func:`lock_down`, before the process starts any thread (so before it imports the
library: ONNX Runtime and OpenVINO each start one as they are imported, numpy's OpenBLAS
one per core unless ``OPENBLAS_NUM_THREADS`` is 1), because landlock binds the calling
thread and the threads it starts later only:

* ``no_new_privs``; every capability dropped (the bounding, ambient, effective,
  permitted and inheritable sets: a child of a root host is no longer root's equal).
* ``landlock`` (Linux 5.13 and later, where enabled): the file system is read-only in
  the Python installation, the directories on ``sys.path`` (a sandbox process is given
  only its backend's and wasinn's own folders, not the host's working directory or
  script folder: see :mod:`._sandbox_process`) and what the links directly in them lead
  to (a site-packages whose packages are links, as Nix and Bazel lay them out), the
  system's libraries and what the caller names (a sandbox process: the folders and
  files of ``[runtime] sandbox_read``,
  see :mod:`._sandbox_read`, each as the host resolved and checked it: opened through
  no symlink and checked again, see :func:`_add_named_rule`), and writable only in the
  child's own temporary directory;
  nothing may be executed; where the kernel can, TCP, abstract Unix sockets and signals
  to processes outside the sandbox are refused too (and so are ``ptrace`` and
  ``/proc/<pid>/mem`` of the host); of ``/proc`` only the process's own folder and the
  CPU and memory files are readable (:data:`SYSTEM_READ`), not the host's environment,
  command line or open files. A GPU graph's process (``gpu=True``) may also read, write
  and send ioctls to the GPUs' device files that exist (:func:`gpu_device_files`:
  NVIDIA's, which the CUDA driver opens, but for the MIG configuration's and monitor's,
  and ``/dev/dri``'s render nodes, OpenCL's), read what their drivers read in ``/proc``
  and ``/etc`` (:data:`GPU_READ`) and name its own threads (their ``/proc`` ``comm``
  files, which the CUDA driver writes); a CPU graph's gets none of it.
* ``seccomp``: a deny-list filter (x86-64 only: :mod:`._seccomp_filter`), given to every
  thread of the process
  (``SECCOMP_FILTER_FLAG_TSYNC``, which sets their ``no_new_privs`` too), under which
  these fail with EPERM: starting programs or processes (``execve``, ``fork``, ``clone``
  without ``CLONE_THREAD`` or with a namespace flag), sockets, ``ptrace`` and
  cross-process memory access, mounts, namespaces, keyrings, ``bpf``,
  ``perf_event_open``, ``io_uring``, the machine's own settings (``reboot``, kernel
  modules, clocks, swap, host names, port I/O), opening files by handle, and acting on
  another process: its resource limits (``prlimit64``), priority and scheduling
  (``setpriority``, ``sched_set*``, ``ioprio_set``) and signals (``kill``,
  ``tgkill``, ``rt_sigqueueinfo``, pidfds). The process may do these to itself: the
  scheduling calls (which libraries make on their own threads' ids) to the calling
  thread or the process as a whole. ``clone3``, whose flags a filter cannot read, fails
  with ENOSYS, which glibc answers by creating its threads with ``clone``. Everything
  else is allowed, so that a new library version keeps working. The CUDA driver needs
  nothing it refuses (it maps its device files, ``mmap``/``mremap``, and talks to them
  through ``ioctl``, which it allows), but for starting ``nvidia-modprobe`` (a ``fork``
  and an ``execve``) where a device file or a kernel module is missing, which a GPU
  graph's process cannot do: its host must have made them.

Then :func:`limit`, once the model's size is known, the resource limits, which hold for
the whole process: no core files, a bound on each file it writes (``RLIMIT_FSIZE``),
few open files (``RLIMIT_NOFILE``: more for a GPU graph's process, whose driver opens its
device files once per context and library), and where the caller gives one a bound on
the memory it allocates (``RLIMIT_DATA``: private writable memory, which glibc's reserved
but unused malloc arenas are not; an allocation past it fails in the library, which
reports it). ``RLIMIT_AS`` is left alone: glibc reserves 64 MiB of address space per malloc
arena and TBB starts a thread per core, so any bound that holds on a many-core host
bounds little. :func:`confine` does both at once (the frontend child, which starts no
thread before it).

The frontend child loads this file by path (it runs with ``python -I`` and imports
nothing of wasinn), and so does a spare sandbox process, before its imports: it uses
the standard library only. The reports say what was applied: the frontend child writes
its one to stderr as a line (:func:`report_line`), which the host reads back with
:func:`take_report` and logs with :func:`log_report`.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import re
import resource
import signal
import stat
import struct
import sys
import threading
from collections.abc import Iterable
from types import ModuleType

if __package__:  # imported as wasinn.backends._confine: in the host
    from ._confine_paths import open_resolved, read_refusal
    from ._seccomp_filter import seccomp_program
else:  # loaded from its file by a confined child (see _sibling)

    def _sibling(name: str) -> ModuleType:
        """Module ``name`` beside this file, loaded from its file as this one was: a
        confined child loads this module before it may import wasinn (whose imports
        start threads, which landlock would not bind: see :mod:`._sandbox_child`)."""
        import importlib.util

        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
        spec = importlib.util.spec_from_file_location(f"_wasinn{name}", path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    _paths, _filter = _sibling("_confine_paths"), _sibling("_seccomp_filter")
    open_resolved, read_refusal = _paths.open_resolved, _paths.read_refusal
    seccomp_program = _filter.seccomp_program

log = logging.getLogger("wasinn.backends")

#: Open files the child may hold: Python and OpenVINO need about 20.
NOFILE = 256
#: Open files a GPU graph's process may hold: its driver opens the device files again for
#: each context and library (torch's CUDA libraries, ONNX Runtime's CUDA provider).
GPU_NOFILE = 1024
#: Each file a confined child writes may hold this many times the model's bytes, plus
#: the margin (``RLIMIT_FSIZE``: a library's cache, OpenVINO's IR).
FILE_SIZE_FACTOR = 4
FILE_SIZE_MARGIN = 64 << 20
#: The prefix of the child's report line on stderr.
REPORT_PREFIX = "wasinn-confine: "

# -- seccomp ----------------------------------------------------------------------------
_PR_SET_NO_NEW_PRIVS = 38
_NR_SECCOMP = 317
_SECCOMP_SET_MODE_FILTER, _SECCOMP_FILTER_FLAG_TSYNC = 1, 1
_PR_CAPBSET_DROP = 24
_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
_NR_CAPSET = 126
_CAPABILITY_VERSION_3 = 0x20080522

# -- landlock ---------------------------------------------------------------------------
_NR_LANDLOCK_CREATE_RULESET = 444
_NR_LANDLOCK_ADD_RULE = 445
_NR_LANDLOCK_RESTRICT_SELF = 446
_LANDLOCK_CREATE_RULESET_VERSION = 1
_LANDLOCK_RULE_PATH_BENEATH = 1
_FS_EXECUTE, _FS_WRITE_FILE, _FS_READ_FILE, _FS_READ_DIR = 1, 2, 4, 8
_FS_REMOVE_DIR, _FS_REMOVE_FILE, _FS_MAKE_DIR, _FS_MAKE_REG = 16, 32, 128, 256
_FS_REFER, _FS_TRUNCATE, _FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_NET_BIND_TCP, _NET_CONNECT_TCP = 1, 2
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1, 2
_READ = _FS_READ_FILE | _FS_READ_DIR
#: A GPU's device files: opened for reading and writing, and their ioctls (Landlock ABI 5).
_DEVICE = _READ | _FS_WRITE_FILE | _FS_IOCTL_DEV
_WRITE = _READ | _FS_WRITE_FILE | _FS_REMOVE_DIR | _FS_REMOVE_FILE | _FS_MAKE_DIR \
    | _FS_MAKE_REG | _FS_REFER | _FS_TRUNCATE
#: Read-only beyond ``sys.path`` and the Python installation: shared libraries and what
#: the loader, the C library and TBB read (CPU topology, cgroup limits). Of ``/proc``,
#: only the process's own folder (``/proc/self`` is resolved when the rules are made:
#: ``/proc/<its pid>``, its threads' folders included) and the machine-wide CPU and
#: memory files: another process's folder, the host's included (its environment,
#: command line, open files, memory map), is not readable.
SYSTEM_READ = ("/usr", "/lib", "/lib32", "/lib64", "/etc/ld.so.cache", "/etc/localtime",
               "/proc/self", "/proc/cpuinfo", "/proc/meminfo", "/proc/stat",
               "/sys", "/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
#: Where :func:`gpu_device_files` looks for the GPUs' device files.
DEV = "/dev"
#: The names, in :data:`DEV`, of the device files a GPU graph's process may read, write and
#: send ioctls to: the NVIDIA driver's control file and one per GPU (``nvidia0``...), and
#: its unified memory's two.
GPU_DEVICE_NAMES = re.compile(r"nvidiactl|nvidia[0-9]+|nvidia-uvm|nvidia-uvm-tools")
#: The folders in :data:`DEV` whose device files of these names it may use too, one by
#: one (each folder itself it may only list): the render nodes that OpenCL drivers open
#: (OpenVINO's GPU plugin), not ``card*``, the display's nodes (whose first opener becomes
#: the DRM master, who may set the display's modes); and the NVIDIA driver's MIG
#: capabilities, but for the configuration's and the monitor's (see :data:`MIG_MINORS`).
GPU_DEVICE_FOLDERS = {"dri": re.compile(r"renderD[0-9]+"),
                      "nvidia-caps": re.compile(r"nvidia-cap[0-9]+")}
#: The NVIDIA driver's list of its MIG capabilities' device minors (lines such as
#: ``config 1``, ``monitor 2``, ``gpu0/gi1/access 12``): ``nvidia-capN`` is minor N.
MIG_MINORS = "/proc/driver/nvidia-caps/mig-minors"
#: The MIG capabilities no CUDA process needs (it needs only the access capabilities of
#: its GPU or compute instance): configuring the GPU's instances and monitoring them all.
MIG_ADMIN = ("config", "monitor")
#: Their minors where :data:`MIG_MINORS` cannot be read (the driver's own numbers).
MIG_ADMIN_MINORS = frozenset({1, 2})
#: What a GPU graph's process may read besides :data:`SYSTEM_READ` (those that exist): the
#: NVIDIA driver's settings and GPUs (``params``, ``gpus/``, ``capabilities/``) and its
#: unified memory's (which its initialisation reads), the device numbers and modules the
#: CUDA driver checks before it opens its device files (not finding them there, it would
#: start ``nvidia-modprobe``, which seccomp refuses), and the OpenCL drivers' list
#: (OpenVINO's GPU plugin).
GPU_READ = ("/proc/driver/nvidia", "/proc/driver/nvidia-uvm", "/proc/devices",
            "/proc/modules", "/etc/OpenCL/vendors")


class Report:
    """What :func:`confine` applied, and why the rest was not."""

    def __init__(self) -> None:
        self.applied: list[str] = []
        #: The platform lacks it (another OS or architecture, an old kernel): no warning.
        self.unsupported: dict[str, str] = {}
        #: It should have worked and did not: worth a warning.
        self.failed: dict[str, str] = {}
        #: Paths an operator named (``named``) that it may not read after all: why, each.
        self.left_out: dict[str, str] = {}

    def as_dict(self) -> dict[str, object]:
        return {"applied": self.applied, "unsupported": self.unsupported,
                "failed": self.failed, "left_out": self.left_out}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> Report:
        """The report :meth:`as_dict` gave (as another copy of this module wrote it)."""
        report = cls()
        applied = data.get("applied")
        report.applied = [str(a) for a in applied] if isinstance(applied, list) else []
        report.unsupported, report.failed, report.left_out = (
            _reasons(data.get(key)) for key in ("unsupported", "failed", "left_out"))
        return report


def _reasons(value: object) -> dict[str, str]:
    return {str(k): str(v) for k, v in value.items()} if isinstance(value, dict) else {}


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _call(libc: ctypes.CDLL, name: str, *args: object) -> int:
    """``libc.name(*args)``; OSError with errno on -1."""
    result = int(getattr(libc, name)(*args))
    if result == -1:
        code = ctypes.get_errno()
        raise OSError(code, f"{name}: {os.strerror(code)}")
    return result


def confine(fsize: int, writable: str, readable: Iterable[str] = (),
            data: int | None = None) -> Report:
    """:func:`lock_down`, then :func:`limit`; never raises."""
    report = lock_down(writable, readable)
    limit(report, fsize, data)
    return report


def lock_down(writable: str, readable: Iterable[str] = (), *, named: Iterable[str] = (),
              gpu: bool = False) -> Report:
    """Confine this process but for its resource limits (see the module's docstring);
    never raises. ``writable``: the one directory it may write in. ``readable``:
    directories (everything below each) and files it may read besides the defaults,
    read only (its files read, its folders listed: nothing written, made, removed or
    executed there); those not there are left out. ``named``: more of them, paths an
    operator named (``[runtime] sandbox_read``) that the host resolved and checked as it
    started this process: each only if it is still what the host checked
    (:func:`_add_named_rule`; one that is not is left out, and the report's
    ``left_out`` says why). ``gpu``: it may use the GPUs' device files (a GPU graph's
    process). Call it before the process starts a thread: landlock binds the calling
    thread and those it starts later only (one started before is named in the report's
    failures)."""
    report = Report()
    if not sys.platform.startswith("linux"):
        for name in ("no_new_privs", "capabilities", "landlock", "seccomp"):
            report.unsupported[name] = f"not Linux ({sys.platform})"
        return report
    libc = _libc()
    try:
        _call(libc, "prctl", ctypes.c_int(_PR_SET_NO_NEW_PRIVS), *map(ctypes.c_ulong, (1, 0, 0, 0)))
        report.applied.append("no_new_privs")
    except OSError as exc:
        report.failed["no_new_privs"] = str(exc)
    _drop_capabilities(report, libc)
    _landlock(report, libc, writable, readable, named, gpu)
    _seccomp(report, libc)
    return report


def limit(report: Report, fsize: int, data: int | None = None, *,
          nofile: int = NOFILE) -> None:
    """Set this process's resource limits, noting them in ``report``; never raises.
    ``fsize``: the most bytes a file it writes may hold. ``data``: the most private
    writable memory it may hold, in bytes (None: no bound). ``nofile``: the most files
    it may hold open (:data:`GPU_NOFILE` for a GPU graph's process)."""
    _limit(report, "core", resource.RLIMIT_CORE, 0)
    _limit(report, "fsize", resource.RLIMIT_FSIZE, fsize)
    _limit(report, "nofile", resource.RLIMIT_NOFILE, nofile)
    if data is not None:
        _limit(report, "data", resource.RLIMIT_DATA, data)


def _drop_capabilities(report: Report, libc: ctypes.CDLL) -> None:
    # The bounding set needs CAP_SETPCAP to shrink (a process without it has nothing to
    # drop there that it could use); the effective, permitted and inheritable sets are
    # cleared through capset (version 3: two 32-bit words of each).
    try:
        with open("/proc/sys/kernel/cap_last_cap", encoding="ascii") as last:
            last_cap = int(last.read())
    except (OSError, ValueError):
        last_cap = 63
    for cap in range(last_cap + 1):
        try:
            _call(libc, "prctl", ctypes.c_int(_PR_CAPBSET_DROP), ctypes.c_ulong(cap),
                  *map(ctypes.c_ulong, (0, 0, 0)))
        except OSError:
            break  # EPERM (no CAP_SETPCAP) or EINVAL (past the last): nothing more to do
    try:
        _call(libc, "prctl", ctypes.c_int(_PR_CAP_AMBIENT),
              ctypes.c_ulong(_PR_CAP_AMBIENT_CLEAR_ALL), *map(ctypes.c_ulong, (0, 0, 0)))
        header = struct.pack("=Ii", _CAPABILITY_VERSION_3, 0)
        _syscall(libc, "capset", _NR_CAPSET, ctypes.c_char_p(header),
                 ctypes.c_char_p(bytes(24)))
        report.applied.append("capabilities")
    except OSError as exc:
        report.failed["capabilities"] = str(exc)


def data_in_use() -> int | None:
    """The private writable memory this process holds, in bytes: what ``RLIMIT_DATA``
    bounds (Linux's ``VmData``; None elsewhere)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _limit(report: Report, name: str, which: int, value: int) -> None:
    try:
        _soft, hard = resource.getrlimit(which)
        bound = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(which, (bound, bound))
        report.applied.append(f"{name}={bound}")
    except (OSError, ValueError) as exc:
        report.failed[name] = str(exc)


def _seccomp(report: Report, libc: ctypes.CDLL) -> None:
    machine = os.uname().machine.lower()
    if machine not in ("x86_64", "amd64"):
        report.unsupported["seccomp"] = f"no filter for {machine or 'this machine'}"
        return
    if "no_new_privs" not in report.applied:
        report.failed["seccomp"] = "needs no_new_privs"
        return
    code = seccomp_program()
    filters = ctypes.create_string_buffer(code, len(code))
    prog = struct.pack("=HxxxxxxQ", len(code) // 8, ctypes.addressof(filters))
    try:
        # Every thread gets it (TSYNC): one a library started before it (a thread the
        # lock-down came too late for) could otherwise make any call. A positive result
        # is a thread that could not take it.
        thread = _syscall(libc, "seccomp", _NR_SECCOMP, ctypes.c_uint(_SECCOMP_SET_MODE_FILTER),
                          ctypes.c_uint(_SECCOMP_FILTER_FLAG_TSYNC), ctypes.c_char_p(prog))
        if thread:
            report.failed["seccomp"] = f"thread {thread} could not take the filter"
        else:
            report.applied.append("seccomp")
    except OSError as exc:
        report.failed["seccomp"] = str(exc)


def _syscall(libc: ctypes.CDLL, what: str, number: int, *args: object) -> int:
    """The raw system call ``number``; OSError with errno when it fails."""
    syscall = libc.syscall
    syscall.restype = ctypes.c_long
    result = int(syscall(ctypes.c_long(number), *args))
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")
    return result


def _landlock(report: Report, libc: ctypes.CDLL, writable: str,
              readable: Iterable[str], named: Iterable[str], gpu: bool) -> None:
    try:
        abi = _syscall(libc, "landlock_create_ruleset", _NR_LANDLOCK_CREATE_RULESET, None,
                       ctypes.c_size_t(0), ctypes.c_uint32(_LANDLOCK_CREATE_RULESET_VERSION))
    except OSError as exc:
        reason = {errno.ENOSYS: "the kernel has no landlock (Linux 5.13 or later)",
                  errno.EOPNOTSUPP: "landlock is disabled in this kernel"}.get(exc.errno or 0)
        if reason is None:
            report.failed["landlock"] = str(exc)
        else:
            report.unsupported["landlock"] = reason
        return
    if "no_new_privs" not in report.applied:
        report.failed["landlock"] = "needs no_new_privs"
        return
    handled = (1 << 13) - 1  # ABI 1: EXECUTE .. MAKE_SYM
    if abi >= 2:
        handled |= _FS_REFER
    if abi >= 3:
        handled |= _FS_TRUNCATE
    if abi >= 5:
        handled |= _FS_IOCTL_DEV
    net = _NET_BIND_TCP | _NET_CONNECT_TCP if abi >= 4 else 0
    scoped = _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL if abi >= 6 else 0
    attr = struct.pack("=QQQ", handled, net, scoped)[:24 if abi >= 6 else 16 if abi >= 4 else 8]
    try:
        ruleset = _syscall(libc, "landlock_create_ruleset", _NR_LANDLOCK_CREATE_RULESET,
                           ctypes.c_char_p(attr), ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    except OSError as exc:
        report.failed["landlock"] = str(exc)
        return
    try:
        # (listed now: once restricted, the process may not list /dev)
        devices = gpu_device_files() if gpu else []
        rules = landlock_rules(writable, readable, gpu=gpu, handled=handled)
        for path, access in rules:
            _add_rule(libc, ruleset, path, access)
        # (where the private folders are: this process's own folder's)
        temp = os.path.dirname(os.path.realpath(writable))
        for path in dict.fromkeys(path for path in named if path):
            why = _add_named_rule(libc, ruleset, path, temp)
            if why is not None:
                report.left_out[path] = why
        _syscall(libc, "landlock_restrict_self", _NR_LANDLOCK_RESTRICT_SELF,
                 ctypes.c_int(ruleset), ctypes.c_uint32(0))
        report.applied.append(f"landlock(abi={abi})")
        if gpu:  # which device files (a GPU graph whose driver finds none fails to load)
            report.applied.append(f"gpu({' '.join(devices) or f'no device file in {DEV}'})")
        others = _other_threads()
        if others:
            report.failed["landlock"] = (f"{len(others)} thread(s) started before it are not "
                                         f"bound by it ({', '.join(others)})")
    except OSError as exc:
        report.failed["landlock"] = str(exc)
    finally:
        os.close(ruleset)


def _other_threads() -> list[str]:
    """The ids of this process's threads other than the calling one (Linux)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    me = str(threading.get_native_id())
    return sorted(t for t in tasks if t != me)


def landlock_rules(writable: str, readable: Iterable[str] = (), *, gpu: bool = False,
                   handled: int = _DEVICE | _WRITE) -> list[tuple[str, int]]:
    """The paths :func:`lock_down` lets this process reach, each with its access rights
    (of ``handled``, those the kernel's Landlock knows): ``writable`` to write in, what
    :func:`_readable` lists and what the links in ``readable``'s and ``sys.path``'s
    folders lead to (:func:`_link_targets`) to read, and for a GPU graph's process
    (``gpu``) the GPUs' device files (:func:`gpu_device_files`, read, written and sent
    ioctls), the folders
    of :data:`GPU_DEVICE_FOLDERS` (listed) and :data:`GPU_READ` (read), those that exist,
    and its own threads' ``/proc`` folders (read and written, see below)."""
    readable = list(readable)
    rules = [(writable, _WRITE & handled)]
    rules += [(path, _READ) for path in _readable(readable)]
    temp = os.path.dirname(os.path.realpath(writable))  # (as for the paths named)
    rules += [(path, _READ) for path in _link_targets([*readable, *sys.path], temp)]
    if gpu:
        rules += [(path, _DEVICE & handled) for path in gpu_device_files()]
        folders = (os.path.join(DEV, name) for name in GPU_DEVICE_FOLDERS)
        rules += [(path, _FS_READ_DIR) for path in folders if os.path.isdir(path)]
        rules += [(path, _READ) for path in GPU_READ if os.path.exists(path)]
        # Its threads' names (``task/<tid>/comm``): the NVIDIA driver (570 and later) names
        # the threads it starts in cuInit with pthread_setname_np, which writes that file
        # of a thread other than the caller, and fails with CUDA error 304 where it may
        # not. The folder, resolved by the process that applies the rules (its own pid),
        # holds the threads it starts later too; no other process's.
        rules.append((os.path.realpath("/proc/self/task"), (_READ | _FS_WRITE_FILE) & handled))
    return rules


def gpu_device_files() -> list[str]:
    """The GPUs' device files in :data:`DEV` (see :data:`GPU_DEVICE_NAMES` and
    :data:`GPU_DEVICE_FOLDERS`, less the MIG capabilities of :data:`MIG_ADMIN`), sorted;
    none where it cannot be listed."""
    files = [os.path.join(DEV, name) for name in _listing(DEV)
             if GPU_DEVICE_NAMES.fullmatch(name)]
    admin = {f"nvidia-cap{minor}" for minor in _mig_admin_minors()}
    for folder, names in GPU_DEVICE_FOLDERS.items():
        files += [os.path.join(DEV, folder, name) for name in _listing(os.path.join(DEV, folder))
                  if names.fullmatch(name) and name not in admin]
    return sorted(files)


def _listing(folder: str) -> list[str]:
    """The names in ``folder``; none where it cannot be listed."""
    try:
        return os.listdir(folder)
    except OSError:
        return []


def _mig_admin_minors() -> set[int]:
    """The device minors of the MIG capabilities of :data:`MIG_ADMIN`, as
    :data:`MIG_MINORS` lists them; :data:`MIG_ADMIN_MINORS` where it cannot be read."""
    try:
        with open(MIG_MINORS, encoding="ascii") as file:
            lines = file.read().splitlines()
    except (OSError, ValueError):
        return set(MIG_ADMIN_MINORS)
    fields = [line.split() for line in lines]
    return {int(minor) for name, minor in (f for f in fields if len(f) == 2)
            if name in MIG_ADMIN and minor.isdigit()}


def _readable(extra: Iterable[str]) -> list[str]:
    """The directories and files to read: ``extra``, ``sys.path``, the Python installation,
    :data:`SYSTEM_READ`, and ``LD_LIBRARY_PATH``; those that exist, each once."""
    paths = [*extra, *sys.path, sys.prefix, sys.base_prefix, sys.exec_prefix,
             sys.base_exec_prefix, *SYSTEM_READ,
             *os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep)]
    seen: dict[str, None] = {}
    for path in paths:
        if path and os.path.exists(path):
            seen.setdefault(os.path.realpath(path))
    return list(seen)


def _link_targets(folders: Iterable[str], temp: str) -> list[str]:
    """Where the symlinks directly in ``folders`` (code folders: ``sys.path``'s and those
    the caller names) lead, resolved, each once: in a site-packages laid out as links
    (Nix's ``python.withPackages``, a Bazel runfiles tree) each package's folder is a
    link to one elsewhere, and landlock checks the file a link leads to, so the folder
    that holds the links is not enough to import them. One level only: links deeper
    inside a package (a tree linked file by file) are not followed. ``""`` (the working
    directory) and folders that cannot be listed give none, and a target that would
    undo the confinement (:func:`read_refusal`, ``temp`` as there: a link to ``/``)
    is left out."""
    targets: dict[str, None] = {}
    for folder in folders:
        if not folder:
            continue
        try:
            with os.scandir(folder) as entries:
                links = [entry.path for entry in entries if entry.is_symlink()]
        except OSError:  # (not there, not a folder: a zip on sys.path)
            continue
        for link in links:
            target = os.path.realpath(link)
            if os.path.exists(target) and read_refusal(target, temp) is None:
                targets.setdefault(target)
    return list(targets)


def _add_rule(libc: ctypes.CDLL, ruleset: int, path: str, access: int) -> None:
    """Let the process reach ``path`` with ``access``. A path removed since it was listed
    (a folder an operator lets it read, a device file) is left out rather than failing
    the whole lock-down: a rule left out only takes access away."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return
    try:
        _add_rule_at(libc, ruleset, fd, path, access)
    finally:
        os.close(fd)


def _add_rule_at(libc: ctypes.CDLL, ruleset: int, fd: int, path: str, access: int) -> None:
    """Let the process reach what ``fd`` (an ``O_PATH`` descriptor, of ``path``) is, with
    ``access``."""
    if not stat.S_ISDIR(os.fstat(fd).st_mode):  # a file takes only the rights for files
        access &= _FS_EXECUTE | _FS_WRITE_FILE | _FS_READ_FILE | _FS_TRUNCATE | _FS_IOCTL_DEV
    attr = struct.pack("=Qi", access, fd)
    _syscall(libc, f"landlock_add_rule({path})", _NR_LANDLOCK_ADD_RULE,
             ctypes.c_int(ruleset), ctypes.c_int(_LANDLOCK_RULE_PATH_BENEATH),
             ctypes.c_char_p(attr), ctypes.c_uint32(0))


# -- the paths an operator names ----------------------------------------------------------
def _add_named_rule(libc: ctypes.CDLL, ruleset: int, path: str, temp: str) -> str | None:
    """Let the process read ``path``, one an operator named (``[runtime] sandbox_read``)
    that the host resolved and checked as it started the process, if it is still what the
    host checked: reached from the root through no symlink (:func:`open_resolved`; a
    second resolution here would follow a folder swapped for a symlink to ``/`` since),
    still at ``path`` once opened, and passing the host's check (:func:`read_refusal`,
    ``temp`` as there). The rule is added on the descriptor so opened, so it is for what
    was checked. Returns why it is left out (a sentence), or None: its rule is added, or
    it is not there (left out without a word, as the host leaves out one missing as the
    process starts)."""
    try:
        fd = open_resolved(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.EINVAL):  # (a folder it may not search)
            return f"it cannot be opened: {exc.strerror or exc}"
        return (f"it is not the path the host checked as it started this process "
                f"({exc.strerror}; changed since): expected the folder or file it "
                "resolved, with no symlink on its way")
    try:
        try:
            where = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # (no /proc: the walk alone says where it is)
            where = path
        why = (f"it moved to {where} as this process opened it: expected it where the host "
               "checked it" if where != path else read_refusal(path, temp))
        if why is None:
            try:
                _add_rule_at(libc, ruleset, fd, path, _READ)
            except OSError as exc:  # (this path alone: the process stays confined)
                why = f"the kernel refused its rule: {exc.strerror or exc}"
        return why
    finally:
        os.close(fd)


def signal_name(signum: int) -> str:
    """``SIGSEGV`` for 11; ``signal 99`` for a number with no name here."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


#: The signals that end a process from outside: an operator's ``kill``, a service manager
#: stopping every process of the service (systemd's default), a closed terminal. No
#: library raises them on itself as it crashes, so a process they end did not crash.
OUTSIDE_STOPS = frozenset({signal.SIGTERM, signal.SIGHUP})


def stopped_from_outside(returncode: int | None) -> bool:
    """Whether a process's ``returncode`` says one of :data:`OUTSIDE_STOPS` ended it."""
    return returncode is not None and returncode < 0 and -returncode in OUTSIDE_STOPS


def report_line(report: Report) -> str:
    """The line the child writes to stderr."""
    return REPORT_PREFIX + json.dumps(report.as_dict(), separators=(",", ":")) + "\n"


# -- in the host ------------------------------------------------------------------------
def take_report(stderr: bytes) -> tuple[dict[str, object] | None, bytes]:
    """The report the child wrote to ``stderr`` (None if none), and ``stderr`` without it."""
    prefix = REPORT_PREFIX.encode()
    report: dict[str, object] | None = None
    rest = []
    for line in stderr.splitlines(keepends=True):
        if report is None and line.startswith(prefix):
            try:
                loaded = json.loads(line[len(prefix):])
            except ValueError:
                loaded = None
            if isinstance(loaded, dict):
                report = loaded
                continue
        rest.append(line)
    return report, b"".join(rest)


_warned: set[str] = set()


def log_report(report: dict[str, object] | None, what: str,
               processes: str = "the processes that read TensorFlow and TensorFlow Lite "
                                "models") -> None:
    """Log what the child applied (DEBUG); what failed, once a process (WARNING); what the
    platform lacks, once a process (INFO), saying which ``processes`` go without it."""
    if report is None:
        log.debug("the process that read the %s sent no confinement report", what)
        return
    log.debug("the process that read the %s was confined: %s", what,
              ", ".join(map(str, _list(report.get("applied")))) or "nothing applied")
    left_out = report.get("left_out")
    for path, why in (left_out.items() if isinstance(left_out, dict) else ()):
        log.warning("the process that read the %s was started without reading %s, which "
                    "it may read (sandbox_read): %s", what, path, why)
    for key, level, how in (("failed", logging.WARNING, "could not be applied"),
                            ("unsupported", logging.INFO, "is not available here")):
        reasons = report.get(key)
        for name, reason in (reasons.items() if isinstance(reasons, dict) else ()):
            if f"{processes}:{key}:{name}" not in _warned:
                _warned.add(f"{processes}:{key}:{name}")
                log.log(level, "%s are not confined by %s, which %s: %s", processes, name,
                        how, reason)


def _list(value: object) -> list[object]:
    return value if isinstance(value, list) else []
