"""How soon a sandboxed graph whose process keeps crashing may start another.

A graph's process that dies is replaced for the next run (see :mod:`.sandbox`). A guest
that crashes it on purpose, run after run, would otherwise make the host start a
process and load the model again for every run (0.1-1.5 s of CPU each). So, as an init
system or Kubernetes' CrashLoopBackOff does, after the second crash in a row a graph
starts no process for :data:`FIRST_DELAY_S`, then twice as long after each further crash
in a row, up to :data:`MAX_DELAY_S`; a run asked meanwhile fails at once with
BackendRuntimeError, saying how many crashes and when runs resume, and starts nothing.
A run that succeeds ends the streak: the next crash is again restarted at once. A
process killed because its run was cancelled is not a crash.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from wasinn.errors import BackendRuntimeError

#: The wait after the second crash in a row, in seconds (none after the first).
FIRST_DELAY_S = 0.5
#: The longest wait, in seconds.
MAX_DELAY_S = 30.0


class CrashBackoff:
    """One graph's crash streak and the time its next process may start (not
    thread-safe: the graph holds its lock around every call). A graph with several
    processes counts the crashes of all of them; while it waits, runs go to those still
    alive."""

    def __init__(self, backend: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._backend = backend
        self._clock = clock
        self.crashes = 0
        self._last = ""
        self._resume_at = 0.0

    def delay(self) -> float:
        """The seconds a new process waits after the crashes so far (0: none)."""
        if self.crashes < 2:
            return 0.0
        return min(FIRST_DELAY_S * 2.0 ** (self.crashes - 2), MAX_DELAY_S)

    def crashed(self, how: str) -> str:
        """A process died on its own (``how``: "was killed by SIGSEGV"); what happens
        next, for the run's error: "the next run starts a new process", or when runs
        resume."""
        self.crashes += 1
        self._last = how
        delay = self.delay()
        self._resume_at = self._clock() + delay
        if not delay:
            return "the next run starts a new process"
        return f"runs resume in {delay:g} s, after {self.crashes} crashes in a row"

    def succeeded(self) -> None:
        """A run succeeded (or failed with an error its process reported): the streak
        ends."""
        self.crashes = 0

    def waiting(self) -> bool:
        """Whether no new process may start now."""
        return self.crashes >= 2 and self._resume_at > self._clock()

    def check(self) -> None:
        """BackendRuntimeError while no new process may start."""
        if self.waiting():
            left = self._resume_at - self._clock()
            raise BackendRuntimeError(
                f"{self._backend}: the model's process crashed {self.crashes} times in a row "
                f"(the last {self._last}): runs resume in {left:.1f} s, when a new process "
                f"is started, and fail at once until then (the wait doubles with each "
                f"crash in a row, up to {MAX_DELAY_S:g} s)")
