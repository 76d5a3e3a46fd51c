"""What the ``wasinn`` command does first, before it reads its command line: descriptors
0, 1 and 2 made usable, and numpy imported with Ctrl-C held back (:func:`wasinn.cli.main`).
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading


def import_holding_ctrl_c() -> bool:
    """Import numpy and ml_dtypes (:mod:`wasinn.tensor`) with Ctrl-C held back until they
    are in: whether one came meanwhile. numpy turns a KeyboardInterrupt during its import
    into an ImportError ("numpy._core.umath failed to import"), after printing its
    traceback, which looks like a broken install. (Nothing to do where ``import wasinn``
    imported them already, before :func:`wasinn.cli.main` ran; nor outside the main
    thread, which alone is told of signals.)"""
    if "wasinn.tensor" in sys.modules or threading.current_thread() is not threading.main_thread():
        return False
    came: list[int] = []
    held = signal.signal(signal.SIGINT, lambda signum, frame: came.append(signum))
    try:
        import wasinn.tensor  # noqa: F401
    finally:
        # (None: a handler not set from Python, which cannot be set back)
        signal.signal(signal.SIGINT, signal.default_int_handler if held is None else held)
    return bool(came)


def open_closed_standard_fds() -> None:
    """Open /dev/null on each of the descriptors 0, 1 and 2 that is closed (a command
    started with ``>&-`` or ``<&-``, or by a supervisor that closes them), and give
    Python a stream on each it started without (``sys.stdout`` is None then).

    Else the next descriptors the command opens take their numbers: trio's epoll and
    wakeup socket, which the guest inherits as its stdin and stdout: its read of the
    epoll descriptor never ends, and what it writes goes into trio's socket."""
    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        try:
            os.fstat(fd)
            continue
        except OSError as exc:
            if exc.errno != errno.EBADF:
                continue
        null = os.open(os.devnull, os.O_RDWR)  # (the lowest free number: fd itself)
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
        os.set_inheritable(fd, True)  # (a subprocess's too: os.open's are not)
        if getattr(sys, name) is None:
            stream = open(fd, "r" if fd == 0 else "w", encoding="utf-8",  # noqa: SIM115
                          errors="backslashreplace" if fd == 2 else "surrogateescape",
                          closefd=False)
            setattr(sys, name, stream)
