"""``wasinn.actors.wakeup.wake``: the byte a worker thread sends trio when a job ends,
written without letting go of the GIL. Real sockets; the cases that could kill or hang
the process (a SIGPIPE, a send that blocks holding the GIL) run in a child interpreter
under a time limit."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import pytest

from wasinn.actors import wakeup


def in_child(code: str) -> str:
    """Run ``code`` in a fresh interpreter (60 s at most); its stdout."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_byte_reaches_the_other_end() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        wakeup.wake(ours)
        wakeup.wake(ours)
        assert theirs.recv(8) == b"\0\0"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the GIL is kept on Linux")
def test_on_linux_the_send_keeps_the_gil() -> None:
    assert wakeup.HOLDS_GIL


def test_a_closed_socket_raises_oserror() -> None:
    ours, theirs = socket.socketpair()
    ours.close()
    with theirs, pytest.raises(OSError):
        wakeup.wake(ours)


def test_a_gone_peer_raises_oserror_without_a_sigpipe() -> None:
    # With SIGPIPE at its default action, a send to a closed peer that raised the signal
    # would kill the child: MSG_NOSIGNAL makes it an EPIPE.
    assert in_child("""
        import errno, signal, socket
        from wasinn.actors.wakeup import wake
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        ours, theirs = socket.socketpair()
        theirs.close()
        try:
            wake(ours)
        except OSError as exc:
            print(errno.errorcode[exc.errno])
    """) in {"EPIPE", "ECONNRESET"}


def test_a_full_socket_waits_without_holding_the_gil() -> None:
    # Trio not reading: the buffer fills. wake() must then wait in socket.send, which
    # lets go of the GIL: the main thread goes on running Python, drains the socket, and
    # the waiting wake() completes. Holding the GIL there would hang the child.
    assert in_child("""
        import socket, threading, time
        from wasinn.actors.wakeup import wake
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        filled = 0
        try:
            while True:
                filled += ours.send(b"\\0" * 4096)
        except BlockingIOError:
            pass
        ours.setblocking(True)
        woke = threading.Thread(target=wake, args=(ours,))
        woke.start()
        deadline = time.monotonic() + 0.2
        spins = 0
        while time.monotonic() < deadline:
            spins += 1
        assert woke.is_alive(), "wake() returned on a full socket"
        received = 0
        theirs.setblocking(False)
        while received < filled + 1:
            try:
                received += len(theirs.recv(65536))
            except BlockingIOError:
                time.sleep(0.001)
        woke.join(10)
        assert not woke.is_alive() and spins > 1000
        print(received - filled)
    """) == "1"
