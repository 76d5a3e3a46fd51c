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

Every removal here, an owner's and a sweep's, empties a folder with :func:`empty`, which
does not recurse and holds a few descriptors whatever the depth: a guest that nests
thousands of folders in its scratch directory (a folder is one of its entries, and it may
have 10,000) must not make the removal fail, where ``shutil.rmtree`` recurses once per
level and meets Python's recursion limit at about 1,000 (``RecursionError``, which its
``ignore_errors`` does not catch), and one descriptor a level would meet a soft
``RLIMIT_NOFILE`` of 1,024 at about the same depth.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
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

#: Whether folders can be removed through descriptors here (:func:`empty`).
BY_DESCRIPTOR = (hasattr(os, "O_DIRECTORY") and hasattr(os, "O_NOFOLLOW")
                 and {os.open, os.stat, os.unlink, os.rmdir} <= os.supports_dir_fd
                 and os.scandir in os.supports_fd)
#: Whether folders can be locked and swept here (see the module docstring).
CAN_SWEEP = fcntl is not None and BY_DESCRIPTOR
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
        remove(path, None)
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
        remove(path, None)
        raise
    if (there.st_dev, there.st_ino) != (mine.st_dev, mine.st_ino):
        os.close(fd)
        return None
    return fd


def remove(path: str, fd: int | None) -> None:
    """Remove the folder :func:`create` made, with everything in it, then close its
    descriptor (its lock goes with it). Raises nothing: what cannot be removed stays,
    for the sweep of a later process (an error other than OSError, which would be a bug
    here, is logged as a warning)."""
    try:
        remove_tree(path)
    except OSError as exc:
        log.debug("cannot remove %s (%s): left for a later process's sweep", path, exc)
    except Exception:
        log.warning("removing %s failed: left for a later process's sweep", path,
                    exc_info=True)
    finally:
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def remove_tree(path: str) -> None:
    """Remove folder ``path`` and everything in it (:func:`empty`). A symbolic link at
    ``path`` is not followed (OSError). Raises OSError at the first entry that cannot be
    removed: it, and what was not reached yet, stay."""
    if not BY_DESCRIPTOR:  # pragma: no cover - not POSIX
        shutil.rmtree(path)
        return
    fd = os.open(path, _OPEN_FLAGS)
    try:
        empty(fd)
    finally:
        os.close(fd)
    os.rmdir(path)


@dataclasses.dataclass
class _Level:
    """A folder under the one being emptied, on the way down: its name in its parent, its
    parent's identity (device, inode), and the subfolders of its parent still to empty."""

    name: str
    parent: tuple[int, int]
    siblings: list[str]


def empty(top: int) -> None:
    """Remove everything in the folder open as ``top``; ``top`` stays open, and its
    folder stays (empty). No symbolic link is followed: one is removed as a file is.

    Does not recurse, and holds at most two descriptors besides ``top`` whatever the
    depth (see the module docstring): the folder being emptied's, and one more while a
    subfolder or the parent is opened or a folder is listed. Each subfolder
    is opened relative to its parent (``O_DIRECTORY | O_NOFOLLOW``), its files removed and
    its subfolders noted; the way back up is the subfolder's ``..``, which must be the
    folder it was opened from (device and inode): else a folder was moved meanwhile, and
    OSError ends the removal rather than go on somewhere else. A folder is removed after
    what was in it. Raises OSError at the first entry that cannot be removed: it, and
    what was not reached yet, stay.
    """
    levels: list[_Level] = []
    fd = top
    try:
        pending = _remove_files(fd)
        while True:
            if pending:
                name = pending.pop()
                child = _open_subfolder(fd, name)
                if child is None:
                    continue
                levels.append(_Level(name, _identity(os.fstat(fd)), pending))
                if fd != top:
                    os.close(fd)
                fd = child
                pending = _remove_files(fd)
                continue
            if not levels:
                return
            level = levels.pop()
            parent = _open_parent(fd, level) if levels else top
            os.close(fd)
            fd = parent
            os.rmdir(level.name, dir_fd=fd)
            pending = level.siblings
    finally:
        if fd != top:
            os.close(fd)


def _identity(info: os.stat_result) -> tuple[int, int]:
    return info.st_dev, info.st_ino


def _remove_files(fd: int) -> list[str]:
    """Remove every entry but the subfolders in the folder open as ``fd``; the names of
    its subfolders."""
    os.lseek(fd, 0, os.SEEK_SET)  # (a listing reads on from the descriptor's offset)
    with os.scandir(fd) as listing:
        entries = list(listing)  # all listed before any is removed
    subfolders = []
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                subfolders.append(entry.name)
            else:
                os.unlink(entry.name, dir_fd=fd)
        except FileNotFoundError:  # removed meanwhile
            continue
    return subfolders


def _open_subfolder(fd: int, name: str) -> int | None:
    """A descriptor of subfolder ``name`` of ``fd``; None when it is gone, or was replaced
    by something else than a folder since it was listed (then that is removed)."""
    try:
        return os.open(name, _OPEN_FLAGS, dir_fd=fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno not in {errno.ENOTDIR, errno.ELOOP}:
            raise
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=fd)
    return None


def _open_parent(fd: int, level: _Level) -> int:
    """A descriptor of the parent of the folder open as ``fd`` (``level``'s folder);
    OSError when it is no longer the folder it was opened from."""
    parent = os.open("..", _OPEN_FLAGS, dir_fd=fd)
    if _identity(os.fstat(parent)) != level.parent:
        os.close(parent)
        raise OSError(errno.ESTALE, f"folder {level.name!r} was moved while it was being "
                                    "removed: its removal stops there")
    return parent


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
            except Exception:  # a bug: the sweep goes on with the next folder
                log.warning("removing %s/%s, left by a process that ended, failed", base,
                            name, exc_info=True)
    except OSError as exc:
        log.debug("cannot sweep %s for %s* folders: %s", base, prefix, exc)
    except Exception:  # a bug: a sweep never raises
        log.warning("the sweep of %s for %s* folders failed", base, prefix, exc_info=True)
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
        empty(fd)
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
