"""A guest's standard input, fed through a pipe so that stopping the guest ends a read.

wasmtime reads a guest's stdin in Rust, where the epoch interruption cannot reach: a
guest reading the host's own stdin, which may send nothing for ever, could not be
cancelled. So a guest never reads its source directly. It reads a pipe that a host
thread (:class:`StdinFeed`) fills from the source, and stopping the feed closes the
pipe: the guest's read returns end-of-file, and the guest traps at its next epoch
check.

What ``stdin=`` of ``run_wasm`` accepts (:data:`GuestStdin`):

- ``None``, the default: an empty stdin (a read returns end-of-file at once), as
  Wasmtime's embedding API gives a guest. A host serving guests does not hand them its
  own input by accident.
- ``bytes``: those bytes, then end-of-file.
- a path (``os.PathLike``): that file's contents (a pipe or a device is read as it
  sends, and its read ends when the guest is stopped).
- ``"inherit"``: the host process's stdin, as ``wasinn run`` gives its guest.

Read-ahead. What the host reads from a source ahead of the guest is lost to whoever
reads the source next (the next command of a shell loop, say), so the feed keeps it
small. It cannot wait for the guest's first read: Wasmtime reads the pipe as soon as the
guest is set up, whether or not the guest ever reads, and holds up to two reads of it
(measured with wasmtime 50). So the feed starts with a pipe of one page (Linux's least)
and reads a source a page at a time, only when the pipe has room, which a one-page pipe
has only when empty: a guest that never reads its stdin costs the source at most
:data:`UNREAD_BYTES` (three pages, 12 KiB with 4 KiB pages). Once Wasmtime has taken more
than its two reads could hold, the guest is reading, and the pipe and the reads double
with what it takes, up to :data:`CHUNK_BYTES`, so that a large input flows at full speed:
the host is then at most :data:`READ_AHEAD_BYTES` (320 KiB) ahead of the guest (a guest
that read 16 bytes cost 20 KiB). The guest's first reads so return a page at most, as
reads of a pipe may. Where a pipe cannot be resized (not Linux) it starts at full size.
A source that must stay whole is given to no guest (``None``; in a shell, ``< /dev/null``).
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import logging
import mmap
import os
import select
import stat
import termios
import threading
from collections.abc import Callable, Iterator
from typing import Literal, Union

import wasmtime

from wasinn.errors import InvalidArgumentError

log = logging.getLogger("wasinn.host")

#: What a guest's stdin may be given as (see the module docstring).
GuestStdin = Union[bytes, "os.PathLike[str]", Literal["inherit"], None]

#: The most the feed reads from its source at a time, and the pipe's largest capacity.
CHUNK_BYTES = 65536

#: The most of its source a guest that never reads its stdin costs: the pipe's page and
#: the two reads Wasmtime holds (see the module docstring).
UNREAD_BYTES = 3 * mmap.PAGESIZE

#: The most the host reads of a source ahead of a guest that reads it: a full pipe, a
#: chunk, Wasmtime's two reads, and what is left of the read the guest is part way through.
READ_AHEAD_BYTES = 5 * CHUNK_BYTES

#: How long closing a feed waits for its thread (which wakes at once when stopped).
_JOIN_TIMEOUT_S = 5.0


class StdinFeed:
    """A thread that copies a source into a pipe whose read end is a guest's stdin.

    Create it with :func:`open_feed`, give it to a guest's WASI config with
    :meth:`attach` (before the guest starts), call :meth:`stop` from any thread to end
    the guest's reads, and :meth:`close` once the guest has finished.
    """

    def __init__(self, source_fd: int | None, data: bytes, owns_source: bool) -> None:
        self._source_fd = source_fd  # None: only ``data``, then end-of-file
        self._owns_source = owns_source
        self._pending = memoryview(data)
        self._read_end, self._write_end = os.pipe()
        os.set_blocking(self._write_end, False)
        # (bytes given are the guest's alone: reading them ahead takes nothing from anyone)
        self._window = None if source_fd is None else _PipeWindow(self._write_end)
        self._room = True  # the source may be read (False: once the pipe has room)
        self._wake_read, self._wake_write = os.pipe()
        self._stopped = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._pump, name="wasinn guest stdin",
                                        daemon=True)

    def attach(self, config: wasmtime.WasiConfig) -> None:
        """Make the pipe ``config``'s stdin and start copying into it."""
        # wasmtime opens the path now, so the guest holds a read end of its own.
        config.stdin_file = f"/dev/fd/{self._read_end}"
        os.close(self._read_end)
        self._read_end = -1
        self._thread.start()

    def stop(self) -> None:
        """End the guest's stdin: a read under way or to come returns end-of-file.
        Thread-safe; later calls do nothing."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            os.write(self._wake_write, b"!")

    def close(self) -> None:
        """Stop the feed, wait for its thread and release its descriptors."""
        self.stop()
        if self._thread.is_alive():
            self._thread.join(_JOIN_TIMEOUT_S)
        if self._thread.is_alive():  # pragma: no cover - the thread never blocks elsewhere
            log.warning("the guest's stdin thread did not stop: its descriptors are kept")
            return
        for fd in (self._read_end, self._write_end, self._wake_read, self._wake_write):
            if fd >= 0:
                os.close(fd)
        if self._owns_source and self._source_fd is not None:
            os.close(self._source_fd)
        self._read_end = self._write_end = self._wake_read = self._wake_write = -1

    def _pump(self) -> None:
        # Never blocks anywhere but in select(), which the wake pipe interrupts.
        try:
            while self._copy_once():
                pass
        except OSError as exc:
            if exc.errno != errno.EPIPE:  # (EPIPE: the guest has gone, nothing to say)
                log.warning("the guest's stdin ends early: %s", exc)
        finally:
            # End-of-file for the guest. The write end is closed here, by the only
            # thread that writes it; close() closes it when the thread never ran.
            os.close(self._write_end)
            self._write_end = -1

    def _copy_once(self) -> bool:
        """Move one chunk from the source to the pipe, or wait for the pipe to have room
        before reading the next; False at the end of the source or of the pipe."""
        poller = select.poll()  # (not select(): descriptors past 1023 are common here)
        poller.register(self._wake_read, select.POLLIN)
        if self._pending or not self._room:
            poller.register(self._write_end, select.POLLOUT)
        elif self._source_fd is None:
            return False
        else:
            poller.register(self._source_fd, select.POLLIN)
        ready = dict(poller.poll())
        if self._wake_read in ready:
            return False
        if self._write_end in ready:
            if ready[self._write_end] & select.POLLERR:  # the guest's end has closed
                return False
            if not self._pending:
                self._room = True
                return True
            written = os.write(self._write_end, self._pending)  # (as much as fits)
            self._pending = self._pending[written:]  # (a view: no copy)
            if self._window is not None:
                self._window.wrote(written)
                # While the window is narrow the source is read only once the pipe has
                # room again, which a one-page pipe has only when empty.
                self._room = self._window.size >= CHUNK_BYTES
            return True
        if self._pending:  # pragma: no cover - poll() without a timeout
            return True
        assert self._source_fd is not None and self._window is not None
        try:
            chunk = os.read(self._source_fd, self._window.follow_guest())
        except BlockingIOError:  # (a non-blocking source woke without data)
            return True
        self._pending = memoryview(chunk)
        return bool(chunk)


def open_feed(source: GuestStdin) -> StdinFeed | None:
    """A feed for ``source`` (None for an empty stdin: wasmtime's own default).

    Raises InvalidArgumentError for a source of another kind, or a path that cannot be
    opened as a readable file.
    """
    if source is None:
        return None
    if isinstance(source, (bytes, bytearray, memoryview)):
        return StdinFeed(None, bytes(source), owns_source=False)
    if source == "inherit":
        try:
            os.fstat(0)
        except OSError:  # this process has no stdin at all: the guest's is empty
            log.info("the host has no stdin: the guest's stdin is empty")
            return StdinFeed(None, b"", owns_source=False)
        return StdinFeed(0, b"", owns_source=False)
    if isinstance(source, os.PathLike) and isinstance(os.fspath(source), str):
        return StdinFeed(_open_readable(os.fspath(source)), b"", owns_source=True)
    raise InvalidArgumentError(
        f"a guest's stdin cannot be {_describe(source)}: expected None (empty), bytes, a "
        "pathlib.Path of a file to read, or 'inherit' (the host's own stdin)")


class _PipeWindow:
    """How far ahead of the guest the feed may read a source: the pipe's capacity, one
    page at first, doubled as the guest shows it reads (see the module docstring)."""

    def __init__(self, write_end: int) -> None:
        self._write_end = write_end
        self._written = 0  # all that went into the pipe
        self.size = _resize_pipe(write_end, mmap.PAGESIZE)

    def wrote(self, count: int) -> None:
        self._written += count

    def follow_guest(self) -> int:
        """How much to read from the source now: the pipe's capacity, after doubling it
        if Wasmtime has taken more from the pipe than its two reads could hold."""
        if self.size < CHUNK_BYTES:
            taken = self._written - _bytes_in_pipe(self._write_end)
            if taken > 2 * self.size:  # (not before the guest's own first read)
                self.size = _resize_pipe(self._write_end, 2 * self.size)
        return self.size


def _resize_pipe(write_end: int, size: int) -> int:
    """Set the pipe's capacity to ``size``; returns the capacity it has, CHUNK_BYTES
    where it cannot be resized (the feed then reads further ahead, and works the same)."""
    set_size = getattr(fcntl, "F_SETPIPE_SZ", None)
    if set_size is None:  # pragma: no cover - not Linux
        return CHUNK_BYTES
    try:
        return min(fcntl.fcntl(write_end, set_size, size), CHUNK_BYTES)
    except OSError as exc:  # pragma: no cover - only past the user's pipe quota
        log.debug("the guest's stdin pipe cannot be resized: %s", exc)
        return CHUNK_BYTES


def _bytes_in_pipe(write_end: int) -> int:
    count = array.array("i", [0])
    fcntl.ioctl(write_end, termios.FIONREAD, count)
    return count[0]


def _open_readable(path: str) -> int:
    # O_NONBLOCK: opening a FIFO with no writer must not hang the caller.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise InvalidArgumentError(
            f"cannot open {path!r} as a guest's stdin ({exc.strerror}): expected a "
            "readable file") from None
    if stat.S_ISDIR(os.fstat(fd).st_mode):
        os.close(fd)
        raise InvalidArgumentError(
            f"{path!r} is a directory: expected a readable file for a guest's stdin")
    return fd


def _describe(source: object) -> str:
    if isinstance(source, str):
        return f"the string {source[:80]!r} (a path must be a pathlib.Path)"
    return f"a {type(source).__name__}"


@contextlib.contextmanager
def guest_stdin(source: GuestStdin, config: wasmtime.WasiConfig
                ) -> Iterator[Callable[[], None] | None]:
    """Give ``config``'s guest ``source`` as its stdin while the block runs.

    Yields the function that ends the guest's stdin (for its interrupter: see
    :meth:`wasinn.host.interrupt.Interrupter.also_stop`), or None for an empty stdin,
    which needs none. The feed is closed when the block ends.
    """
    feed = open_feed(source)
    if feed is None:
        yield None
        return
    try:
        feed.attach(config)
        yield feed.stop
    finally:
        feed.close()
