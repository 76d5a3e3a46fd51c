"""A component guest's private scratch directory: tensor and model bytes handed over as files.

wasmtime-py passes component values through its C API one element at a time, so even
the fast ``list<u8>`` path (:mod:`wasinn.host.component.fastlist`) costs tens of
milliseconds for an image. WASI file I/O does not: Wasmtime's own (Rust) WASI host
copies a ``descriptor.write`` buffer out of guest memory in one piece. So each guest
gets a directory of its own, preopened at :data:`GUEST_PATH`; the guest writes a
tensor's bytes to a file there and calls ``wasinn:nn/scratch.tensor-from-scratch``,
or asks ``tensor-to-scratch`` for an output and reads the file back. A model is loaded
the same way: the guest writes its file(s) there and calls ``load-from-scratch``
(:meth:`ScratchDir.read_files`), so no model byte passes as a component value either,
which Wasmtime bounds per call (:mod:`wasinn.host.component.hostcall_fuel`).

The directory lives on ``/dev/shm`` when that exists (memory, no disk I/O), otherwise
in the system temporary directory. It is created empty (mode 0700) when the guest
starts and removed with everything in it when the guest ends (:meth:`ScratchDir.remove`,
or at garbage collection / interpreter exit if nobody called it). It is named after the
host's process (``wasinn-scratch-<pid>-<random>``): one left by a host killed before it
could remove it is removed by the next host process that makes one there
(:mod:`wasinn.backends._private_dirs`).

Security: a name is one plain file name (no separator, not ``.`` or ``..``, no NUL);
it is resolved relative to a descriptor of this guest's own directory, never followed
through a symbolic link, and must name a regular file. Every failure is a
:class:`~wasinn.errors.WasiNNError`: NotFoundError for a missing file,
InvalidArgumentError for a bad name or a file of the wrong size or kind, TooLargeError
beyond the guest's ``max_tensor_bytes`` (for a model: ``max_model_bytes``, checked on the
files' sizes before any is read). Tensor and model data are *copied* out of the file, so
a guest rewriting the file later does not change a tensor or graph it already made.

Quota: WASI has no quota of its own, so what a guest writes through plain WASI calls is
measured instead (:meth:`ScratchDir.usage`, :func:`quota_exceeded`): the guest runner
(:mod:`wasinn.host.component.guest`) polls the directory while the guest runs and again
when each call returns, and stops for good a guest over ``[guests] max_scratch_bytes``
or ``max_scratch_files``; ``tensor-to-scratch`` refuses a write that would go over. A
guest can therefore exceed its quota only by what it writes between two measurements.
A measurement that fails (:class:`MeasureError`) counts as over the quota: a guest must
not grow unseen for as long as the host cannot measure it.

A guest can also unlink a file and keep writing through the descriptor it holds open: a
directory listing no longer shows such a file, but it still takes memory or disk. The guest
runs in this process, so its descriptors are this process's: the measurement also counts
the files listed in ``/proc/self/fd`` as unlinked (``st_nlink`` 0) from under this guest's
directory, each once, until the guest closes them. Without ``/proc`` (not Linux, or not
mounted) they cannot be seen: a warning says so once, and only visible entries count.

Descriptors: each file or directory a guest opens through WASI is a descriptor of this
process, and Wasmtime's WASI puts no bound on how many a guest holds, so one guest could
take every descriptor the process may have (``RLIMIT_NOFILE``), and with them the host's
ability to open models, temporary files or other guests' directories. The same
``/proc/self/fd`` walk counts the descriptors open on this guest's directory or anything
in it (its preopened descriptor of the directory included, the host's own not), and the
guest runner stops a guest holding more than ``[guests] max_scratch_open_files``
(:func:`descriptors_exceeded`). The measurement itself opens no descriptor for the top of
the directory and for ``/proc/self/fd``: both are held open from the directory's creation
and listed with :func:`wasinn.host.component.dirents.names`, so a process out of
descriptors can still see who holds them (only a subdirectory the guest made needs one,
to be listed). Between two measurements a guest may open more than its limit, as it may
write more than its bytes: the poll interval bounds how long.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import stat
import tempfile
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from wasinn.backends import _private_dirs as private_dirs
from wasinn.enums import TensorType
from wasinn.errors import (
    InvalidArgumentError,
    NotFoundError,
    TooLargeError,
    UnknownError,
    WasiNNError,
)
from wasinn.host.component import dirents
from wasinn.tensor import Tensor, check_dims

#: Where every component guest finds its scratch directory.
GUEST_PATH = "/.wasinn-scratch"
#: Host directory used when present: memory-backed, so a scratch file never hits a disk.
SHM = Path("/dev/shm")
#: Longest name accepted (Linux's NAME_MAX).
MAX_NAME_BYTES = 255

_PREFIX = "wasinn-scratch-"
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

#: This process's open file descriptors, each a link to what it has open (Linux procfs).
PROC_FD = "/proc/self/fd"
#: How procfs ends the link of a descriptor whose file was unlinked.
_DELETED = " (deleted)"
#: The PROC_FD paths already reported unreadable: the warning is given once, not per poll.
_unreadable_proc: set[str] = set()
#: Why opening a descriptor failed when the process (or the system) has none left.
_OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE})

log = logging.getLogger("wasinn.host.component")


def default_base() -> Path:
    """``/dev/shm`` when it is a writable directory, else the system temporary directory."""
    if SHM.is_dir() and os.access(SHM, os.W_OK | os.X_OK):
        return SHM
    return Path(tempfile.gettempdir())


def check_name(name: str) -> str:
    """``name`` when it is one plain file name; InvalidArgumentError saying why not."""
    expected = "expected a plain file name such as 'input.bin' inside the scratch directory"
    if not name:
        raise InvalidArgumentError(f"scratch file name is empty: {expected}")
    if len(os.fsencode(name)) > MAX_NAME_BYTES:  # first: the messages below quote the name
        raise InvalidArgumentError(
            f"scratch file name is {len(os.fsencode(name))} bytes long: expected at most "
            f"{MAX_NAME_BYTES}")
    if name in {".", ".."}:
        raise InvalidArgumentError(f"scratch file name {name!r} names a directory: {expected}")
    if "/" in name or "\\" in name:
        raise InvalidArgumentError(
            f"scratch file name {name!r} contains a path separator: {expected}")
    if "\0" in name:
        raise InvalidArgumentError(f"scratch file name {name!r} contains a NUL byte: {expected}")
    return name


def _os_error(exc: OSError, name: str, doing: str) -> WasiNNError:
    """The wasi-nn error for an OSError met while ``doing`` scratch file ``name``."""
    where = f"scratch file {name!r}"
    if exc.errno == errno.ENOENT:
        return NotFoundError(
            f"{where} does not exist: write it under {GUEST_PATH} before {doing} it")
    if exc.errno == errno.ELOOP:
        return InvalidArgumentError(f"{where} is a symbolic link: expected a regular file")
    if exc.errno == errno.EISDIR:
        return InvalidArgumentError(f"{where} is a directory: expected a regular file")
    if exc.errno in {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}:
        return TooLargeError(f"no room to write {where}: {exc.strerror}")
    return UnknownError(f"{doing} {where} failed: {exc.strerror or exc}")


def _require_regular(mode: int, name: str) -> None:
    if stat.S_ISREG(mode):
        return
    kind = ("a directory" if stat.S_ISDIR(mode) else
            "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file")
    raise InvalidArgumentError(f"scratch file {name!r} is {kind}: expected a regular file")


def _shrank(name: str, done: int, nbytes: int) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"scratch file {name!r} shrank to {done} bytes while being read: expected {nbytes}")


def _read_exactly(fd: int, name: str, nbytes: int) -> bytes:
    """The next ``nbytes`` of ``fd`` (scratch file ``name``), in one piece when the
    system hands them over at once (no copy); InvalidArgumentError when it ends first."""
    pieces, done = [], 0
    while done < nbytes:
        piece = os.read(fd, nbytes - done)
        if not piece:
            raise _shrank(name, done, nbytes)
        pieces.append(piece)
        done += len(piece)
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def _cleanup(path: str, fd: int, proc: int | None) -> None:
    """Remove the directory at ``path`` and close what it held. Raises nothing: however
    deep the guest nested folders in it, or whatever else goes wrong (logged), closing
    the guest must not fail; what cannot be removed stays for a later process's sweep
    (:func:`wasinn.backends._private_dirs.remove`)."""
    if proc is not None:
        with contextlib.suppress(OSError):
            os.close(proc)
    private_dirs.remove(path, fd)


@dataclass(frozen=True)
class Usage:
    """What a scratch directory holds: allocated bytes and entries (files, directories)."""

    nbytes: int
    entries: int

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.nbytes + other.nbytes, self.entries + other.entries)


class MeasureError(TooLargeError):
    """A scratch directory could not be measured (the reason is in the message). It counts
    as over the guest's quota: a guest must not grow unseen for as long as the host
    cannot measure it."""


@dataclass(frozen=True)
class Measurement:
    """One measurement of a scratch directory: what it holds (:class:`Usage`), and how
    many descriptors are open on it or on anything in it (see the module docstring)."""

    usage: Usage
    descriptors: int


def _measure_error(exc: OSError) -> MeasureError:
    return MeasureError(f"its scratch directory could not be measured "
                        f"({exc.strerror or exc}), which counts as over its limits")


def _open_proc_fd() -> tuple[int | None, str]:
    """A descriptor of :data:`PROC_FD`, or None and why when it cannot be read (no procfs
    here). Raises OSError when the process has no descriptor left for it."""
    try:
        return os.open(PROC_FD, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), ""
    except OSError as exc:
        if exc.errno in _OUT_OF_DESCRIPTORS:
            raise
        return None, str(exc.strerror or exc)


def _warn_unreadable_proc(why: str) -> None:
    """Say once per PROC_FD path that open files cannot be seen here."""
    if PROC_FD in _unreadable_proc:
        return
    _unreadable_proc.add(PROC_FD)
    log.warning(
        "cannot list this process's open files in %s (%s): files that a component guest "
        "unlinked from its scratch directory but keeps open are not counted against "
        "[guests] max_scratch_bytes, nor its open descriptors against "
        "max_scratch_open_files; expected a mounted Linux procfs", PROC_FD, why)


def _open_under(proc: int, name: str, dev: int, path: str) -> tuple[os.stat_result, bool] | None:
    """The status of descriptor ``name`` (listed in ``proc``, a PROC_FD descriptor) and
    whether its file is unlinked, when it is open on directory ``path`` (on device
    ``dev``) or on anything in it; else None.

    Opens nothing: the link is read between two ``fstat`` calls of the descriptor, and a
    descriptor closed meanwhile, or its number reused for another file, is skipped, so
    that a target is never taken for another file's."""
    try:
        fd = int(name)
        before = os.fstat(fd)
    except (ValueError, OSError):  # closed since it was listed
        return None
    # The cheap test first (one fstat, no path): nearly every descriptor is a socket, a
    # pipe or a file on another file system.
    if before.st_dev != dev:
        return None
    try:
        target = os.readlink(name, dir_fd=proc)
        after = os.fstat(fd)
    except OSError:
        return None
    if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
        return None
    deleted = target.endswith(_DELETED)
    if deleted:
        target = target[:-len(_DELETED)]
    if target != path and not target.startswith(path + os.sep):
        return None
    return after, deleted and after.st_nlink == 0


def quota_exceeded(usage: Usage, max_bytes: int, max_entries: int, *,
                   holds: str = "holds") -> str | None:
    """Why ``usage`` is over the guest's scratch limits, or None when it is within them;
    ``holds`` is the verb (``"would hold"`` for a write refused before it is made)."""
    if usage.entries > max_entries:
        return (f"its scratch directory {holds} more than {max_entries} entries "
                "([guests] max_scratch_files)")
    if usage.nbytes > max_bytes:
        return (f"its scratch directory {holds} {usage.nbytes} bytes, over the limit of "
                f"{max_bytes} ([guests] max_scratch_bytes)")
    return None


def descriptors_exceeded(descriptors: int, max_descriptors: int) -> str | None:
    """Why ``descriptors`` open in a guest's scratch directory are too many, or None."""
    if descriptors > max_descriptors:
        return (f"it holds more than {max_descriptors} descriptors open in its scratch "
                "directory ([guests] max_scratch_open_files)")
    return None


class ScratchDir:
    """One guest's scratch directory on the host. Its measurements may run in another
    thread than the guest's file calls (they take a lock of their own)."""

    def __init__(self, base: str | os.PathLike[str] | None = None) -> None:
        """Create an empty private directory under ``base`` (default :func:`default_base`).

        Raises OSError when it cannot be created, or when the process has no descriptor
        left for what its measurement keeps open.
        """
        path, held = private_dirs.create(_PREFIX, base or default_base())
        self.path = Path(path)
        #: Serializes measurements (they move the read offset of the held descriptors)
        #: and their end against :meth:`remove`.
        self._lock = threading.Lock()
        try:
            # All file access goes through this descriptor, so names resolve inside this
            # directory even if its host path were renamed or replaced meanwhile. It also
            # holds the directory's lock, which tells a sweep that its owner lives.
            self._fd = held if held is not None else os.open(
                self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            private_dirs.remove(path, None)
            raise
        try:
            # Held for the directory's life: measuring must not need a descriptor of its
            # own, or a guest holding every descriptor would make it fail.
            self._proc, self._proc_error = _open_proc_fd()
        except OSError:
            _cleanup(str(self.path), self._fd, None)
            raise
        self._finalizer = weakref.finalize(self, _cleanup, str(self.path), self._fd,
                                           self._proc)

    @property
    def removed(self) -> bool:
        return not self._finalizer.alive

    def remove(self) -> None:
        """Delete the directory and everything the guest left in it. Idempotent."""
        with self._lock:
            self._finalizer()

    def usage(self, max_entries: int | None = None) -> Usage:
        """What the guest keeps here: bytes of every entry (files, directories, links,
        counted in allocated blocks) and the number of entries, at any depth, links not
        followed, plus the files it unlinked from here but keeps open (see the module's
        docstring). With ``max_entries`` the scan stops once more than that many are seen
        (so a guest cannot make the host's measurement itself slow). Raises
        :class:`MeasureError` when the directory cannot be measured."""
        return self.measure(max_entries).usage

    def measure(self, max_entries: int | None = None,
                max_descriptors: int | None = None) -> Measurement:
        """:meth:`usage`, and the descriptors open on this directory or anything in it (the
        guest's preopened one included, the host's own not); the count stops once past
        ``max_descriptors``, the whole measurement once past either bound. Raises
        :class:`MeasureError` when the directory cannot be measured."""
        with self._lock:
            if self.removed:
                return Measurement(Usage(0, 0), 0)
            seen: set[tuple[int, int]] = set()
            visible = self._visible_usage(max_entries, seen)
            if max_entries is not None and visible.entries > max_entries:
                return Measurement(visible, 0)
            left = None if max_entries is None else max_entries - visible.entries
            unlinked, descriptors = self._open_files(left, max_descriptors, seen)
            return Measurement(visible + unlinked, descriptors)

    def _visible_usage(self, max_entries: int | None, seen: set[tuple[int, int]]) -> Usage:
        """The entries a directory listing shows; adds each one's (device, inode) to
        ``seen``. The top is listed through the descriptor held open (no new one)."""
        nbytes = entries = 0
        stack: list[str] = []
        pending = self._top_entries()
        while True:
            for name, info in pending:
                entries += 1
                if max_entries is not None and entries > max_entries:
                    return Usage(nbytes, entries)
                nbytes += info.st_blocks * 512
                seen.add((info.st_dev, info.st_ino))
                if stat.S_ISDIR(info.st_mode):
                    stack.append(name)
            if not stack:
                return Usage(nbytes, entries)
            pending = self._subdirectory_entries(stack.pop())

    def _top_entries(self) -> list[tuple[str, os.stat_result]]:
        """The top's entries and their status, skipping any removed while listed."""
        found = []
        try:
            for name in dirents.names(self._fd):
                try:
                    found.append((name, os.stat(name, dir_fd=self._fd, follow_symlinks=False)))
                except FileNotFoundError:
                    continue
        except OSError as exc:
            raise _measure_error(exc) from None
        return found

    def _subdirectory_entries(self, relative: str) -> list[tuple[str, os.stat_result]]:
        """The entries of subdirectory ``relative`` (a path from the top) and their status;
        none when it was removed or replaced meanwhile."""
        found = []
        try:
            with os.scandir(self.path / relative) as listing:
                for entry in listing:
                    try:
                        info = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    found.append((os.path.join(relative, entry.name), info))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            if exc.errno == errno.ENAMETOOLONG:
                # (which bounds how deep a guest may nest folders and keep running)
                raise MeasureError(
                    f"its scratch directory nests folders too deep to be measured (a path "
                    f"of {len(os.fsencode(relative))} bytes from its top: "
                    f"{exc.strerror or exc}), which counts as over its limits") from None
            raise _measure_error(exc) from None
        return found

    def _open_files(self, max_entries: int | None, max_descriptors: int | None,
                    seen: set[tuple[int, int]]) -> tuple[Usage, int]:
        """The files unlinked from under this directory that this process still has open,
        each counted once and not again if in ``seen`` (stops past ``max_entries``), and
        the descriptors open on the directory or anything in it (stops past
        ``max_descriptors``)."""
        proc = self._proc
        if proc is None:
            _warn_unreadable_proc(self._proc_error)
            return Usage(0, 0), 0
        try:
            # The directory's path as procfs spells the links (symbolic links resolved).
            path = os.readlink(str(self._fd), dir_fd=proc)
            dev = os.fstat(self._fd).st_dev
            listed = dirents.names(proc)
        except OSError as exc:
            raise _measure_error(exc) from None
        if path.endswith(_DELETED):  # removed meanwhile: the guest has ended
            return Usage(0, 0), 0
        own = {str(self._fd), str(proc)}
        nbytes = entries = descriptors = 0
        for name in listed:
            found = None if name in own else _open_under(proc, name, dev, path)
            if found is None:
                continue
            descriptors += 1
            info, unlinked = found
            if unlinked and (info.st_dev, info.st_ino) not in seen:
                seen.add((info.st_dev, info.st_ino))
                nbytes += info.st_blocks * 512
                entries += 1
            if ((max_entries is not None and entries > max_entries)
                    or (max_descriptors is not None and descriptors > max_descriptors)):
                break
        return Usage(nbytes, entries), descriptors

    def _require_open(self) -> None:
        if self.removed:
            raise NotFoundError("this guest's scratch directory was already removed")

    def _open_regular(self, name: str) -> tuple[int, os.stat_result]:
        """A read-only descriptor of scratch file ``name`` and its status: a plain name,
        resolved in this directory only, never through a symbolic link, naming a regular
        file (else the errors of the module docstring). The caller closes it."""
        check_name(name)
        self._require_open()
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=self._fd)
        except OSError as exc:
            raise _os_error(exc, name, "reading") from None
        opened = False
        try:
            info = os.fstat(fd)
            _require_regular(info.st_mode, name)
            opened = True
        except OSError as exc:
            raise _os_error(exc, name, "reading") from None
        finally:
            if not opened:
                os.close(fd)
        return fd, info

    def _size(self, name: str) -> int:
        """The size of scratch file ``name``, checked as :meth:`_open_regular` does but
        without opening it (no descriptor that would count against the guest)."""
        check_name(name)
        self._require_open()
        try:
            info = os.stat(name, dir_fd=self._fd, follow_symlinks=False)
        except OSError as exc:
            raise _os_error(exc, name, "reading") from None
        _require_regular(info.st_mode, name)
        return info.st_size

    def read_files(self, names: Sequence[str], check_total: Callable[[int], None]
                   ) -> list[bytes]:
        """Copies of scratch files ``names``, whole, in order (a name may repeat).

        Every name is checked and every file's size taken first; ``check_total`` is then
        given their total and raises (its error propagates) when that is more than may be
        read, so nothing past a limit is ever read. The files are then read one at a time
        (one descriptor at once); one whose size changed meanwhile is InvalidArgumentError.
        Other errors as :meth:`read`.
        """
        sizes = [self._size(name) for name in names]
        check_total(sum(sizes))
        copies = []
        for name, size in zip(names, sizes, strict=True):
            fd, info = self._open_regular(name)
            try:
                if info.st_size != size:
                    raise InvalidArgumentError(
                        f"scratch file {name!r} changed from {size} to {info.st_size} bytes "
                        "while it was being read")
                copies.append(_read_exactly(fd, name, size))
            except OSError as exc:
                raise _os_error(exc, name, "reading") from None
            finally:
                os.close(fd)
        return copies

    def read(self, name: str, nbytes: int) -> np.ndarray[Any, Any]:
        """A copy of scratch file ``name``, which must be exactly ``nbytes`` long (uint8)."""
        fd, info = self._open_regular(name)
        try:
            if info.st_size != nbytes:
                raise InvalidArgumentError(
                    f"scratch file {name!r} is {info.st_size} bytes but the tensor needs "
                    f"exactly {nbytes}")
            data = np.empty(nbytes, dtype=np.uint8)
            view, done = data.data, 0
            while done < nbytes:
                got = os.readv(fd, [view[done:]])
                if got == 0:
                    raise _shrank(name, done, nbytes)
                done += got
            return data
        except OSError as exc:
            raise _os_error(exc, name, "reading") from None
        finally:
            os.close(fd)

    def replaced(self, name: str) -> tuple[Usage, int]:
        """What :meth:`write` to scratch file ``name`` replaces: its usage as a measurement
        counts it (allocated bytes and one entry; none when there is no such file yet),
        and how many names it has in all (a hard link's bytes are counted under each of
        its names, and a write changes them all). InvalidArgumentError, as :meth:`write`
        gives, when ``name`` is not a plain name or names something else than a regular
        file."""
        check_name(name)
        self._require_open()
        try:
            info = os.stat(name, dir_fd=self._fd, follow_symlinks=False)
        except FileNotFoundError:
            return Usage(0, 0), 0
        except OSError as exc:
            raise _os_error(exc, name, "writing") from None
        _require_regular(info.st_mode, name)
        return Usage(info.st_blocks * 512, 1), info.st_nlink

    def write(self, name: str, data: np.ndarray[Any, Any] | bytes) -> int:
        """Replace scratch file ``name`` with ``data``; returns the bytes written."""
        check_name(name)
        self._require_open()
        flat = (np.ascontiguousarray(data).reshape(-1).view(np.uint8).data
                if isinstance(data, np.ndarray) else memoryview(data))
        try:
            fd = os.open(name, _WRITE_FLAGS, 0o600, dir_fd=self._fd)
        except OSError as exc:
            raise _os_error(exc, name, "writing") from None
        try:
            _require_regular(os.fstat(fd).st_mode, name)
            done = 0
            while done < len(flat):
                done += os.write(fd, flat[done:])
            return done
        except OSError as exc:
            raise _os_error(exc, name, "writing") from None
        finally:
            os.close(fd)

    def read_tensor(self, name: str, dims: tuple[int, ...], ttype: TensorType,
                    max_bytes: int) -> Tensor:
        """A tensor of ``dims`` and ``ttype`` whose data is scratch file ``name``.

        InvalidArgumentError beyond MAX_RANK dimensions, TooLargeError when the tensor would
        exceed ``max_bytes`` (both checked before the file is opened); otherwise as
        :meth:`read`.
        """
        dims = check_dims(dims)  # the rank before any product of guest numbers
        nbytes = math.prod(dims) * ttype.itemsize
        if nbytes > max_bytes:
            raise TooLargeError(
                f"tensor of {nbytes} bytes exceeds this guest's limit of {max_bytes} bytes "
                f"per tensor")
        return Tensor.from_bytes(dims, ttype, self.read(name, nbytes))

    def write_tensor(self, name: str, data: np.ndarray[Any, Any] | bytes, max_bytes: int) -> int:
        """Write a tensor's bytes to scratch file ``name``; TooLargeError beyond ``max_bytes``."""
        nbytes = data.nbytes if isinstance(data, np.ndarray) else len(data)
        if nbytes > max_bytes:
            raise TooLargeError(
                f"tensor of {nbytes} bytes exceeds this guest's limit of {max_bytes} bytes "
                f"per tensor")
        return self.write(name, data)
