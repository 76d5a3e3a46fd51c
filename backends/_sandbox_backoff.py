"""How a sandboxed graph whose process keeps crashing is kept from a crash loop, without
failing the good runs of the other callers that share it.

A graph's process that dies is replaced for the next run (see :mod:`.sandbox`). A caller
that crashes it on purpose, run after run, would otherwise make the host start a process
and load the model again for every run (0.1-1.5 s of CPU each). Refusing every run for a
while, as the graph once did, stopped that but failed every caller of a shared graph (a
registered model many guests use) for one caller's inputs. So :class:`CrashBackoff` does
two things instead:

* The crash streak delays the *start* of the next process, as an init system or
  Kubernetes' CrashLoopBackOff does: after the second crash less than :data:`QUIET_S`
  apart, the graph starts no process for :data:`FIRST_DELAY_S`, then twice as long after
  each further one, up to :data:`MAX_DELAY_S`. Runs asked meanwhile *wait* for that
  process (their cancellation, a request's deadline, honoured) and then run: a good
  input is late, never refused. A run that succeeds does not end the streak (a caller
  crashing the graph between good runs of its own would then be restarted at once each
  time); :data:`QUIET_S` without a crash does. A process killed because its run was
  cancelled, or ended to make room for another graph's, is no crash.
* The inputs of a run that crashed the process are remembered (a digest: their names,
  types, dimensions and bytes), :data:`MAX_REMEMBERED` at most, for
  :data:`REMEMBERED_S` after their last crash. Inputs that crashed it
  :data:`REFUSED_AFTER` times are refused at once, without a run and without a process
  started: the same poison sent again costs nothing. Once only, they still run: a crash
  may be another run's doing (an out-of-bounds write that corrupts the heap aborts a
  later run), and the next process is a clean one. Inputs that run without a crash are
  forgotten. Only inputs whose names, types and dimensions match remembered ones are
  hashed, so a graph that never crashed hashes nothing.

The backend layer knows no callers: one caller's varied poison still delays every
caller's runs, by at most :data:`MAX_DELAY_S` per crash, which bounds the processes it
can make the host start to one per :data:`MAX_DELAY_S` once its streak is long.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import time
from collections.abc import Callable, Mapping

import numpy as np

from wasinn.tensor import Tensor, numpy_dtype

#: The wait before the process after the second crash of a streak, in seconds (none after
#: the first).
FIRST_DELAY_S = 0.5
#: The longest wait, in seconds: runs wait this long at most for a process.
MAX_DELAY_S = 10.0
#: Seconds without a crash that end a streak.
QUIET_S = 60.0
#: Crashes of the same inputs after which they are refused without a run.
REFUSED_AFTER = 2
#: Seconds after their last crash that inputs are remembered (and refused).
REMEMBERED_S = 600.0
#: The most inputs one graph remembers (the oldest forgotten first).
MAX_REMEMBERED = 64

#: What identifies inputs cheaply: (name, type, dimensions) of each tensor, sorted.
Shapes = tuple[tuple[str, str, tuple[int, ...]], ...]


def shapes_of(inputs: Mapping[str, Tensor]) -> Shapes:
    """The names, element types and dimensions of ``inputs`` (no data read)."""
    return tuple(sorted((str(name), t.type.value, tuple(int(d) for d in t.dims))
                        for name, t in inputs.items()))


def digest_of(inputs: Mapping[str, Tensor]) -> bytes:
    """A digest of ``inputs``: their names, types, dimensions and bytes (BLAKE2b)."""
    digest = hashlib.blake2b(repr(shapes_of(inputs)).encode(), digest_size=32)
    for name in sorted(inputs):
        tensor = inputs[name]
        data = np.ascontiguousarray(tensor.numpy(), dtype=numpy_dtype(tensor.type))
        digest.update(data.reshape(-1).view(np.uint8).data)
    return digest.digest()


@dataclasses.dataclass
class _Crashed:
    """Inputs that crashed the process: how often, how last, and when."""

    shapes: Shapes
    times: int
    how: str
    at: float


class CrashBackoff:
    """One graph's crash streak, when its next process may start, and the inputs that
    crashed it (not thread-safe: the graph holds its lock around every call). A graph
    with several processes counts the crashes of all of them; while it waits, runs go to
    those still alive."""

    def __init__(self, backend: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._backend = backend
        self._clock = clock
        self.crashes = 0
        self._last_at = -QUIET_S
        self._resume_at = 0.0
        self._inputs: collections.OrderedDict[bytes, _Crashed] = collections.OrderedDict()

    def delay(self) -> float:
        """The seconds a new process waits after the crashes so far (0: none)."""
        if self.crashes < 2:
            return 0.0
        return min(FIRST_DELAY_S * 2.0 ** (self.crashes - 2), MAX_DELAY_S)

    def crashed(self, how: str, inputs: tuple[Shapes, bytes] | None = None) -> str:
        """A process died on its own (``how``: "was killed by SIGSEGV"), running
        ``inputs`` (their shapes and digest; None: loading the model); what happens
        next, for the run's error."""
        now = self._clock()
        if now - self._last_at >= QUIET_S:
            self.crashes = 0
        self.crashes += 1
        self._last_at = now
        delay = self.delay()
        self._resume_at = now + delay
        then = ("the next run starts a new process" if not delay else
                f"the next process starts in {delay:g} s, after {self.crashes} crashes less "
                f"than {QUIET_S:g} s apart: runs wait for it")
        if inputs is None:
            return then
        if self._remember(*inputs, how, now) < REFUSED_AFTER:
            return then
        return (f"{then}; these inputs, which crashed it {REFUSED_AFTER} times, are "
                f"refused for {REMEMBERED_S:g} s")

    def remaining(self) -> float:
        """Seconds until a new process may start (0: now)."""
        if self.crashes < 2:
            return 0.0
        return max(0.0, self._resume_at - self._clock())

    def waiting(self) -> bool:
        """Whether no new process may start now."""
        return self.remaining() > 0.0

    # -- the inputs that crashed it ---------------------------------------------------
    def knows(self, shapes: Shapes) -> bool:
        """Whether inputs of ``shapes`` crashed the process (then their digest tells
        whether these did): a cheap test before hashing a run's inputs."""
        self._expire()
        return any(c.shapes == shapes for c in self._inputs.values())

    def refusal(self, digest: bytes) -> str | None:
        """Why inputs of ``digest`` are refused without a run (None: they run)."""
        crashed = self._inputs.get(digest)
        if crashed is None or crashed.times < REFUSED_AFTER:
            return None
        ago = self._clock() - crashed.at
        return (f"{self._backend}: these inputs crashed the model's process {crashed.times} "
                f"times (the last {ago:.1f} s ago: it {crashed.how}): they are refused "
                f"without a run until {REMEMBERED_S:g} s after their last crash; other "
                "inputs run as usual")

    def ran(self, digest: bytes) -> None:
        """Inputs of ``digest`` ran without a crash: forget them."""
        self._inputs.pop(digest, None)

    def _remember(self, shapes: Shapes, digest: bytes, how: str, now: float) -> int:
        """Note a crash of the inputs of ``digest``: how many they have caused now."""
        crashed = self._inputs.pop(digest, None) or _Crashed(shapes, 0, how, now)
        crashed.times += 1
        crashed.how, crashed.at = how, now
        self._inputs[digest] = crashed  # the most recent last
        while len(self._inputs) > MAX_REMEMBERED:
            self._inputs.popitem(last=False)
        return crashed.times

    def _expire(self) -> None:
        now = self._clock()
        while self._inputs:
            oldest = next(iter(self._inputs.values()))
            if now - oldest.at < REMEMBERED_S:
                return
            self._inputs.popitem(last=False)
