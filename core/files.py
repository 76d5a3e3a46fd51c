"""Reading a file that must be a regular file.

A FIFO put where a file was expected blocks the open, and then the read, until a writer
comes, in a thread that no cancellation reaches; a device such as ``/dev/zero`` is read
for ever. :func:`read_regular` opens without blocking and reads only a regular file.
"""

from __future__ import annotations

import errno
import os
import stat


def read_regular(path: str | os.PathLike[str], *, own: bool = False) -> bytes:
    """The bytes of the regular file at ``path``.

    OSError for anything else: what ``open`` raises, and EINVAL saying what the path is
    (``not a regular file (a FIFO)``). With ``own``, the file must also be the path's
    own: a symbolic link (ELOOP) and a file with other hard links (EINVAL) are refused,
    as neither is a file a process that wrote it there can be trusted to own.
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
        return file.read()


def _kind(mode: int) -> str:
    for test, kind in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a directory")):
        if test(mode):
            return kind
    return "a special file"
