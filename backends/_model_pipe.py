"""A model's bytes handed to a library as a file it reads from a pipe, for a library that
holds the GIL while it takes bytes but not while it reads a file.

ONNX Runtime's binding copies a model given as bytes into a ``std::string`` before it
lets go of the GIL: the whole process stalls, the trio loop that serves every other
request included (measured on a 2-core machine: 35-110 ms for a 64 MB model, 0.3-1.1 s
for 512 MB, the longer the busier the machine). Given a file's name, it reads the file
with the GIL released.

:func:`piped` names the read end of a pipe (``/proc/self/fd/N``) that is filled with the
bytes as the library reads them (by a thread of its own, where they do not fit in the
pipe's buffer at once): no copy of the model is made beyond that buffer (an anonymous
file would hold a whole one while the library builds its session), nothing is written
to disk, and the pipe has no name in any folder, where another process could swap it.

:func:`memory_file` is for a library that seeks in the file it reads (torch's zip reader,
which a pipe fails with "fseek returned -1"): a private file in memory (a ``memfd``, also
named ``/proc/self/fd/N``) holding one copy of the model while the library reads it,
written with the GIL released and sealed against writes before the library opens it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import threading
from collections.abc import Iterator

#: The pipe's buffer (Linux's default bound for an unprivileged process; 64 KiB where it
#: may not be raised).
_BUFFER = 1 << 20


@contextlib.contextmanager
def piped(data: bytes, name: str) -> Iterator[str | None]:
    """The path of a pipe's read end holding ``data`` while the block runs, or None where
    there is none to be had (no ``/proc/self/fd``: not Linux): the caller then passes the
    bytes. The reader must read it once, from its start to its end (ONNX Runtime reads an
    ONNX model so, but an ORT-format one by the file's size, which a pipe has not).

    Bytes that fit in the pipe's buffer are written into it at once; more, by a thread
    called ``name``, as the reader makes room. When the block ends the read end is closed,
    which ends the writing where the reader stopped early (a model it could not parse, or
    one it never opened), and that thread is joined. Neither end is inherited by a child
    process started meanwhile.
    """
    if not os.path.isdir("/proc/self/fd"):
        yield None
        return
    reader, writer = os.pipe2(os.O_CLOEXEC)
    feeder = None
    try:
        with contextlib.suppress(OSError):  # (fewer hand-offs between the two threads)
            fcntl.fcntl(writer, fcntl.F_SETPIPE_SZ, _BUFFER)
        if len(data) > fcntl.fcntl(writer, fcntl.F_GETPIPE_SZ):
            feeder = threading.Thread(target=_feed_in_thread, args=(writer, data), name=name,
                                      daemon=True)
            feeder.start()
    except BaseException:
        os.close(reader)
        os.close(writer)
        raise
    if feeder is None:
        _feed(writer, data)  # it fits: no wait for the reader (nor a thread to start)
    try:
        yield f"/proc/self/fd/{reader}"
    finally:
        os.close(reader)
        if feeder is not None:
            feeder.join()


@contextlib.contextmanager
def memory_file(data: bytes, name: str) -> Iterator[str | None]:
    """The path (``/proc/self/fd/N``) of a private file in memory holding ``data`` while
    the block runs, which a library may read as it likes (seek included); or None where
    there is none to be had (no ``memfd``, no ``/proc/self/fd``: not Linux; or the system
    refuses one, for lack of memory or by a seccomp filter): the caller then passes the
    bytes. The file is never on disk, has no name in any folder, is not inherited by a
    child process, and is sealed once written, so it holds exactly ``data`` (what the
    caller checked) whoever opens it; it is gone when the block ends and the library has
    closed it. ``name`` is the file's in ``/proc/self/fd``'s links."""
    if not hasattr(os, "memfd_create") or not os.path.isdir("/proc/self/fd"):
        yield None
        return
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError:
        yield None
        return
    try:
        try:
            _write(fd, data)
            if hasattr(fcntl, "F_ADD_SEALS"):
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK
                            | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        except OSError:  # (no memory for its pages: as where there is no such file)
            path = None
        else:
            path = f"/proc/self/fd/{fd}"
        yield path
    finally:
        os.close(fd)


def _write(fd: int, data: bytes) -> None:
    """All of ``data`` into the file ``fd``: by ``os.write``, which copies it with the GIL
    released (up to 2 GiB a call)."""
    view = memoryview(data)
    written = 0
    while written < len(view):
        written += os.write(fd, view[written:])


def _feed_in_thread(writer: int, data: bytes) -> None:
    """:func:`_feed` with SIGPIPE blocked in this thread, the one the kernel sends it to
    if the reader stops early: where the process leaves it at its default action (the
    CLI, a host's own choice), it would end the process; here the write fails with EPIPE
    instead."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGPIPE})
    _feed(writer, data)


def _feed(writer: int, data: bytes) -> None:
    """Writes ``data`` into the pipe ``writer``, then closes it; stops where the read end
    was closed."""
    view = memoryview(data)
    written = 0
    try:
        # All that is left at once: the kernel takes it as the reader makes room (up to
        # 2 GiB a call), while the writing thread, which needs the GIL only between
        # calls, waits for the GIL once, not once per piece.
        while written < len(view):
            written += os.write(writer, view[written:])
    except OSError:  # EPIPE: the reader stopped (it sees a short model, or has gone)
        pass
    finally:
        os.close(writer)
