"""A sandbox process that cannot be started (no file descriptor left for its sockets, no
room on the disk for its private folder, ...) fails the load or the run that wanted it
with BackendRuntimeError naming what failed, and frees everything made for it, its
place under the host's bound on sandbox processes included: a moment's shortage must
not leave the bound used up, every later sandboxed load then waiting for ever. A spare
that cannot be started after a load does not fail that load, and a load whose process
has loaded the model but cannot be kept ends that process.

The failures are injected (the system calls that fail in them are not the test's to
exhaust); the backend is :mod:`tests.crashing_backend`'s fake, quick to start.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import wasinn.backends._sandbox_process as sandbox_process
from tests.crashing_backend import CrashingBackend
from tests.support import sandbox_children
from wasinn import BackendRuntimeError, GraphEncoding, Tensor
from wasinn.backends import Device
from wasinn.backends.base import Cancellation, running_under
from wasinn.backends.sandbox import ProcessLimit, SandboxedGraph, Spares, load_sandboxed

CPU = Device.parse("cpu")
RECIPE = [b"fake:add=1"]


def _descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def _failing(real: Callable[..., Any], failing: set[int], error: int) -> Callable[..., Any]:
    """``real``, but its calls numbered in ``failing`` (from 1) raise OSError ``error``."""
    calls = 0

    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls in failing:
            raise OSError(error, os.strerror(error))
        return real(*args, **kwargs)

    return call


@pytest.fixture
def spares() -> Iterator[Spares]:
    """A pool that keeps no spares, under a bound of 2 of its own: every process it
    counted has ended by the test's end."""
    pool = Spares(0, limit=ProcessLimit(2))
    yield pool
    pool.close()
    assert pool.limit.live == 0
    assert sandbox_children() == []


def _load(spares: Spares) -> SandboxedGraph:
    """A sandboxed load that gives up, rather than hang, should it wait for room for ever
    (a cancel after 30 s)."""
    cancellation = Cancellation()
    timer = threading.Timer(30, cancellation.cancel)
    timer.start()
    try:
        with running_under(cancellation):
            return load_sandboxed(CrashingBackend(), RECIPE, GraphEncoding.GGML, CPU,
                                  spares=spares)
    finally:
        timer.cancel()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="Linux's /proc")
@pytest.mark.parametrize(("target", "name", "error", "said"), [
    # Before: a bare OSError, the memfd and a socket pair left open, the slot counted.
    (socket, "socketpair", errno.EMFILE,
     r"cannot open the sockets to a sandbox process: \[Errno 24\] Too many open files"),
    (sandbox_process, "PrivateDir", errno.ENOSPC,
     r"cannot make the private folder of a sandbox process: \[Errno 28\] No space left on "
     r"device"),
    (sandbox_process.subprocess, "Popen", errno.EAGAIN,
     r"cannot start a process to run the model in: \[Errno 11\] Resource temporarily "
     r"unavailable"),
])
def test_a_start_that_fails_frees_what_it_took_and_the_next_loads_go_on(
        monkeypatch: pytest.MonkeyPatch, spares: Spares, target: Any, name: str, error: int,
        said: str) -> None:
    before = _descriptors()
    with monkeypatch.context() as patch:
        patch.setattr(target, name, _failing(getattr(target, name), {1, 2, 3}, error))
        for _ in range(3):  # more than the bound's 2
            with pytest.raises(BackendRuntimeError, match=rf"^crashing: {said}$"):
                _load(spares)
            assert spares.limit.live == 0
    assert _descriptors() == before
    graph = _load(spares)
    try:
        out = graph.run({"x": Tensor.from_numpy(np.ones((1, 4), np.float32))})
        assert out["y"].numpy().tolist() == [[2.0] * 4]
    finally:
        graph.close()


def test_a_spare_that_cannot_start_after_a_load_does_not_fail_it(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Before: the load raised a bare OSError, and its process, which had loaded the
    # model, was left running, counted under the bound.
    pool = Spares(1, limit=ProcessLimit(4))
    # (the 1st and 2nd socket pairs are the loading process's, the 3rd the spare's)
    monkeypatch.setattr(socket, "socketpair", _failing(socket.socketpair, {3}, errno.EMFILE))
    try:
        with caplog.at_level(logging.WARNING, logger="wasinn.backends"):
            graph = load_sandboxed(CrashingBackend(), RECIPE, GraphEncoding.GGML, CPU,
                                   spares=pool)
        try:
            assert [r.getMessage() for r in caplog.records] == [
                "no spare sandbox process started for tests.crashing_backend:CrashingBackend: "
                "crashing: cannot open the sockets to a sandbox process: [Errno 24] Too many "
                "open files"]
            assert pool.limit.live == 1 and pool.waiting() == 0
            assert [p.pid for p in sandbox_children()] == graph.pids
            out = graph.run({"x": Tensor.from_numpy(np.ones((1, 4), np.float32))})
            assert out["y"].numpy().tolist() == [[2.0] * 4]
        finally:
            graph.close()
    finally:
        pool.close()
    assert pool.limit.live == 0 and sandbox_children() == []


def test_a_load_that_fails_after_its_process_loaded_the_model_ends_that_process(
        monkeypatch: pytest.MonkeyPatch, spares: Spares) -> None:
    # Before: the process that had loaded the model was neither kept nor closed.
    def fails(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(Spares, "replenish", fails)
    with pytest.raises(KeyboardInterrupt):
        _load(spares)
    assert spares.limit.live == 0  # (and no process left: see the fixture)
