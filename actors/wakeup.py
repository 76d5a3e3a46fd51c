"""Waking trio from a worker thread without letting go of the GIL.

A worker thread tells trio that a job has ended by writing one byte to a socket that
trio waits on (see :mod:`wasinn.actors.workers`). ``socket.send`` releases the GIL
around its system call, as every blocking call in CPython does. The byte wakes trio's
thread, which takes the GIL at once to handle the result; the worker thread, back from
the call, then waits for the GIL until trio's thread next blocks: 100-300 µs of event-loop
work under load. When the worker thread has the next job to start (it passed its slot
on), the device idles all that time. Measured on a 2-vCPU VM with four guest threads
sharing one slot (ONNX Runtime, MobileNetV2-like): 243 µs of a 265 µs gap between runs.

:func:`wake` sends the byte through :class:`ctypes.PyDLL`, which keeps the GIL for the
call, and without waiting, so that holding it never blocks the other threads. The send
then costs only its system call (13-40 µs, most of it the wake-up IPI to a halted vCPU),
and trio's thread gets the GIL microseconds later, when the next backend call releases
it (or the worker thread goes back to waiting for a job): the gap fell to 34-44 µs.
Where the C library's ``send`` cannot be found, or the platform has no MSG_DONTWAIT,
it uses ``socket.send``.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
from collections.abc import Callable

_Send = Callable[[int, bytes, int, int], int]

#: Never block (a full buffer falls back to socket.send), never raise SIGPIPE.
_FLAGS = getattr(socket, "MSG_DONTWAIT", 0) | getattr(socket, "MSG_NOSIGNAL", 0)


def _gil_holding_send() -> _Send | None:
    """The C library's ``send(2)``, called with the GIL held; None where there is none."""
    if not getattr(socket, "MSG_DONTWAIT", 0):
        return None  # a send that could block must not hold the GIL
    try:
        send = ctypes.PyDLL(None, use_errno=True).send
    except (OSError, AttributeError, TypeError):  # no process-wide C library symbols
        return None
    send.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int)
    send.restype = ctypes.c_ssize_t
    sent: _Send = send
    return sent


_SEND = _gil_holding_send()

#: Whether :func:`wake` keeps the GIL (False: it always uses ``socket.send``).
HOLDS_GIL = _SEND is not None


def wake(sock: socket.socket) -> None:
    """Write one byte to the blocking socket ``sock``, keeping the GIL where possible.

    The byte is sent without waiting (MSG_DONTWAIT): should the socket's buffer ever be
    full (trio not reading), this falls back to ``socket.send``, which waits without the
    GIL. Raises OSError as ``socket.send`` would: the socket closed (EBADF), or its peer
    gone (EPIPE, ECONNRESET), without a SIGPIPE. Retries a send interrupted by a signal.
    """
    if _SEND is None:
        sock.send(b"\0")
        return
    fd = sock.fileno()  # -1 once closed: EBADF below
    while _SEND(fd, b"\0", 1, _FLAGS) != 1:
        code = ctypes.get_errno()
        if code in (errno.EAGAIN, errno.EWOULDBLOCK):
            sock.send(b"\0")
            return
        if code != errno.EINTR:
            raise OSError(code, os.strerror(code))
