"""Reading a file that must be a regular file, and may have to lie inside a directory.

A FIFO put where a file was expected blocks the open, and then the read, until a writer
comes, in a thread that no cancellation reaches; a device such as ``/dev/zero`` is read
for ever. :func:`read_regular` opens without blocking and reads only a regular file.

A path checked to lie inside a directory may change before it is opened (a file, or a
folder on the way, swapped for a symbolic link leading out). With ``inside``,
:func:`read_regular` checks the file it opened, not the path: the path, resolved again
after the open, must still lie inside the directory and name that very file (same device
and inode), else :class:`OutsideError`. A swap between the open and that check shows as
another file.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


class OutsideError(PermissionError):
    """The file opened does not lie inside the directory it had to (see the module
    docstring)."""


def read_regular(path: str | os.PathLike[str], *, own: bool = False,
                 inside: str | os.PathLike[str] | None = None) -> bytes:
    """The bytes of the regular file at ``path``.

    OSError for anything else: what ``open`` raises, and EINVAL saying what the path is
    (``not a regular file (a FIFO)``). With ``own``, the file must also be the path's
    own: a symbolic link (ELOOP) and a file with other hard links (EINVAL) are refused,
    as neither is a file a process that wrote it there can be trusted to own. With
    ``inside`` (a resolved directory), the file opened must lie in it: OutsideError.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if own:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags)  # O_NONBLOCK changes nothing for a regular file
    with open(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, f"not a regular file ({_kind(info.st_mode)})")
        if own and info.st_nlink != 1:
            raise OSError(errno.EINVAL, f"a file with {info.st_nlink - 1} other hard link(s)")
        if inside is not None:
            _check_inside(path, info, Path(inside))
        return file.read()


def _check_inside(path: str | os.PathLike[str], opened: os.stat_result, inside: Path) -> None:
    try:
        resolved = Path(os.path.realpath(path))
        same = os.path.samestat(opened, os.stat(resolved))
    except OSError:  # (changed again, or gone: what was opened cannot be vouched for)
        resolved, same = Path(path), False
    if not same or not resolved.is_relative_to(inside):
        raise OutsideError(
            errno.EACCES, f"the file opened is not the one inside {inside} that the path "
            "named when it was checked (it changed while it was opened): expected a file "
            "that stays inside the directory")


def _kind(mode: int) -> str:
    for test, kind in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a directory")):
        if test(mode):
            return kind
    return "a special file"
