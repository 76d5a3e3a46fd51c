"""Private folders named after the process that made them, and the removal of those whose
process ended without removing them.

A sandbox process's home (:mod:`._sandbox_process`), a component guest's scratch
directory (:mod:`wasinn.host.component.scratch`) and the folder OpenVINO reads some
models from (:mod:`._ovread`) are removed by their owner when it is done with them, or at
its exit. A process killed by SIGKILL, or by SIGTERM where nothing handles it (Python's
default runs no ``finally`` and no finalizer), leaves them behind: about 100 KB each for
a sandbox process's home, one per process at every stop of a service. So each folder is
named ``<prefix><pid>-<random>`` after the process that made it, and is held locked
(``flock``) by a descriptor its owner keeps open until the folder is removed. The first
folder of a kind that a process makes in a base folder sets off a sweep of that base
folder, in a thread of its own (once per process, kind and base folder), which removes
the folders of that kind whose owner has ended.

A folder is removed only when all of these hold:

* its name is exactly its kind's pattern: a folder named as before, without a pid, is
  left alone (who made it cannot be told);
* it is a directory (a symbolic link is never followed) owned by this user;
* no process has its pid: a pid that another process has taken since keeps the folder,
  which costs only its room;
* its lock can be taken: an owner in another pid namespace (a container sharing ``/tmp``
  or ``/dev/shm`` with the host), whose pid is not seen here, keeps it.

It is then emptied through a descriptor of it (no symbolic link in it is followed) and
removed. A sweep never raises: a folder it cannot remove stays, for the next one.
Where there is no ``flock`` or no descriptor-based removal (not POSIX), folders are named
the same way and nothing is swept.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import stat
import tempfile
import threading
import weakref
from types import TracebackType

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("wasinn.backends")

#: Whether folders can be locked and swept here (see the module docstring).
CAN_SWEEP = (fcntl is not None and hasattr(os, "O_DIRECTORY") and hasattr(os, "O_NOFOLLOW")
             and shutil.rmtree.avoids_symlink_attacks)
#: How a folder is opened to be locked, by its owner or by a sweep.
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) \
    | getattr(os, "O_CLOEXEC", 0)
#: How many times a folder is made again when a sweep in another pid namespace removed
#: it between its creation and its lock.
_ATTEMPTS = 3

#: The (pid, prefix, base folder) already swept, or being swept.
_swept: set[tuple[int, str, str]] = set()
_swept_lock = threading.Lock()


def pattern(prefix: str) -> re.Pattern[str]:
    """The names of the folders of kind ``prefix``: the prefix, a pid, ``-``, and the
    random part :func:`tempfile.mkdtemp` adds."""
    return re.compile(rf"{re.escape(prefix)}([1-9][0-9]{{0,9}})-[A-Za-z0-9_]+")


def create(prefix: str, base: str | os.PathLike[str] | None = None) -> tuple[str, int | None]:
    """Make an empty folder (mode 0700) named ``<prefix><pid>-<random>`` in ``base``
    (default: the system temporary folder); its path, and a descriptor of it that holds
    its lock (None where there is no lock: see :data:`CAN_SWEEP`). The caller owns both:
    it removes the folder, then closes the descriptor. The first call per kind and base
    folder in this process sets off a sweep (see the module docstring).

    Raises OSError when the folder cannot be made or opened (then nothing is left).
    """
    base = tempfile.gettempdir() if base is None else os.fspath(base)
    for _ in range(_ATTEMPTS):
        path = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=base)
        if not CAN_SWEEP:
            return path, None
        locked = _lock_new(path)
        if locked == _UNLOCKED:
            return path, None  # (no sweep: nothing on that file system can be told live)
        if locked is not None:
            _sweep_once(prefix, base)
            return path, locked
    raise OSError(f"cannot make a private folder in {base}: it was removed by another "
                  f"process each of {_ATTEMPTS} times, before it could be locked")


#: What :func:`_lock_new` returns for a folder kept unlocked: its file system locks no
#: directory (NFS without local locks: ENOLCK; some FUSE file systems).
_UNLOCKED = -1


def _lock_new(path: str) -> int | None:
    """A locked descriptor of the folder just made at ``path``; None when a sweep in
    another pid namespace (to which this process's pid means nothing) took it first;
    :data:`_UNLOCKED` where its file system cannot lock it (the folder is kept, without a
    lock). Raises OSError, removing the folder, when it cannot be opened."""
    assert fcntl is not None
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        return None
    except OSError:
        shutil.rmtree(path, ignore_errors=True)
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError as exc:
        log.debug("%s cannot be locked (%s): kept without a lock, and not swept", path, exc)
        os.close(fd)
        return _UNLOCKED
    try:
        mine = os.fstat(fd)
        there = os.lstat(path)
    except FileNotFoundError:
        os.close(fd)
        return None
    except OSError:
        os.close(fd)
        shutil.rmtree(path, ignore_errors=True)
        raise
    if (there.st_dev, there.st_ino) != (mine.st_dev, mine.st_ino):
        os.close(fd)
        return None
    return fd


def remove(path: str, fd: int | None) -> None:
    """Remove the folder :func:`create` made, with everything in it, then close its
    descriptor (its lock goes with it). Raises nothing: what cannot be removed stays,
    for the sweep of a later process."""
    shutil.rmtree(path, ignore_errors=True)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


class PrivateDir:
    """A folder of :func:`create`'s, removed by :meth:`remove` (idempotent), at the end of
    a ``with`` block (which gives its path), or else when it is garbage collected or at
    the interpreter's exit."""

    def __init__(self, prefix: str, base: str | os.PathLike[str] | None = None) -> None:
        """Raises OSError when the folder cannot be made (see :func:`create`)."""
        self.path, fd = create(prefix, base)
        self._finalizer = weakref.finalize(self, remove, self.path, fd)

    def remove(self) -> None:
        self._finalizer()

    def __enter__(self) -> str:
        return self.path

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.remove()


def _sweep_once(prefix: str, base: str) -> None:
    """Start :func:`sweep` of ``base`` for ``prefix`` in a thread, unless this process has
    already (a daemon thread: an exit cuts it short, and the next process goes on)."""
    key = (os.getpid(), prefix, base)  # (a folder spelt two ways is swept twice)
    with _swept_lock:
        if key in _swept:
            return
        _swept.add(key)
    threading.Thread(target=sweep, args=(prefix, base), daemon=True,
                     name=f"sweep of stale {prefix}* folders").start()


def sweep(prefix: str, base: str | os.PathLike[str]) -> int:
    """Remove the folders of kind ``prefix`` in ``base`` whose owner has ended (see the
    module docstring); how many were removed. Raises nothing."""
    if not CAN_SWEEP:
        return 0
    names = pattern(prefix)
    removed = 0
    try:
        base_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        log.debug("cannot sweep %s for %s* folders: %s", base, prefix, exc)
        return 0
    try:
        for name in os.listdir(base_fd):
            found = names.fullmatch(name) if name.startswith(prefix) else None
            if found is None or int(found[1]) == os.getpid():
                continue
            try:
                removed += _remove_stale(base_fd, name, int(found[1]))
            except OSError as exc:
                log.debug("cannot remove %s/%s, left by a process that ended: %s",
                          base, name, exc)
    except OSError as exc:
        log.debug("cannot sweep %s for %s* folders: %s", base, prefix, exc)
    finally:
        os.close(base_fd)
    if removed:
        log.debug("removed %d %s* folder(s) from %s, left by processes that ended",
                  removed, prefix, base)
    return removed


def _remove_stale(base_fd: int, name: str, pid: int) -> bool:
    """Remove folder ``name`` of ``base_fd`` if it is a directory of this user's whose
    owner ``pid`` has ended and whose lock is free; whether it was removed."""
    assert fcntl is not None
    info = os.stat(name, dir_fd=base_fd, follow_symlinks=False)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or _alive(pid):
        return False
    fd = os.open(name, _OPEN_FLAGS, dir_fd=base_fd)
    try:
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (info.st_dev, info.st_ino):
            return False  # replaced since
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its owner lives, where its pid is another's or none
        for entry in os.listdir(fd):
            if stat.S_ISDIR(os.stat(entry, dir_fd=fd, follow_symlinks=False).st_mode):
                shutil.rmtree(entry, dir_fd=fd)
            else:
                os.unlink(entry, dir_fd=fd)
        now = os.stat(name, dir_fd=base_fd, follow_symlinks=False)
        if (now.st_dev, now.st_ino) != (info.st_dev, info.st_ino):
            return False
        os.rmdir(name, dir_fd=base_fd)
        return True
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` exists, as far as this process can tell: one of another
    user's (EPERM), a zombie, or where signals to others are refused, counts as alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):
        return True
    return True
