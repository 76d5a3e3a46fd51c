"""How a sandboxed graph whose process keeps crashing is kept from a crash loop, without
failing or delaying the good runs of the other callers that share it.

A graph's process that dies is replaced for the next run (see :mod:`.sandbox`). A caller
that crashes it on purpose, run after run, would otherwise make the host start a process
and load the model again for every run (0.1-1.5 s of CPU each). Refusing every run for a
while, as the graph once did, stopped that but failed every caller of a shared graph (a
registered model many guests use) for one caller's inputs; delaying every caller's next
process, as it did next, still let one caller's varied poison delay everyone's runs, by
up to :data:`MAX_DELAY_S` per crash. So :class:`CrashBackoff` does three things instead:

* A crash is charged to the *caller* whose run was on the process when it died: the
  opaque key the run's job names (:func:`~.base.current_caller`; a device actor names
  the request's tenant, ``""`` for requests that name none). After that caller's second
  crash less than :data:`QUIET_S` apart, *its* runs are refused at once (the graph's
  TooLargeError, naming how long), without a process taken or started, for
  :data:`FIRST_DELAY_S`, then twice as long after each further crash, up to
  :data:`MAX_DELAY_S`, as an init system or Kubernetes' CrashLoopBackOff delays a
  restart; a good input of theirs is refused too meanwhile, and the caller retries it
  after. Refused, not kept waiting as they once were: a run waits in its device's
  worker thread, holding the worker slot it was granted, so a caller with several
  requests in flight held every slot of the device for up to :data:`MAX_DELAY_S`, and
  starved the very callers its back-off was to spare. Other callers' runs take an idle
  process, or start one at once where none is alive: they wait for nobody's crashes but
  their own. The refusal keeps a caller's runs off idle processes too: let onto one,
  its poison would crash the process another caller's run had just started, and the
  host would start a process for every good run of the others. A run that succeeds does
  not end the streak (a caller crashing the graph between good runs of its own would
  then be restarted at once each time); :data:`QUIET_S` without a crash does, and the
  caller is forgotten then.
  :data:`MAX_CALLERS` are remembered at most, the one whose last crash is the oldest
  forgotten first. A process killed because its run was cancelled, or ended to make room
  for another graph's, is no crash.
* The graph keeps a streak of its own, of the crashes that are nobody's: a crash while
  loading the model (the host's load, whoever's run it is for: the model crashes it, not
  a caller's inputs) and one of a run that names no caller (a backend used directly,
  which is then one caller, exactly as before callers were told apart). It delays the
  *start* of every new process in the same steps, for every caller's runs, which wait
  for it (it is everyone's: there is no other caller to let through); runs go meanwhile
  to the processes still alive.
* The inputs of a run that crashed the process are remembered (a digest: their names,
  types, dimensions and bytes), :data:`MAX_REMEMBERED` at most, for
  :data:`REMEMBERED_S` after their last crash, whoever sent them: poison is poison.
  Inputs that crashed it :data:`REFUSED_AFTER` times are refused at once, without a run
  and without a process started: the same poison sent again costs nothing. Once only,
  they still run: a crash may be another run's doing (an out-of-bounds write that
  corrupts the heap aborts a later run), and the next process is a clean one; but on
  one process at a time (the graph keeps them so, :meth:`CrashBackoff.suspect`), so that
  the same poison sent by several callers at once crashes it twice, not once for each
  of the graph's processes (but for the runs of it that were running already when it
  first crashed: each crashes its process). Inputs that run without a crash are
  forgotten. Only inputs whose names, types and dimensions match remembered ones are
  hashed, so a graph that never crashed hashes nothing.

So a caller varying its poison makes the host start one process per its own delay at
most once its streak is long (as many as the graph runs at once, ``processes``, where
its retries arrive together), and neither delays nor holds the worker slots of any
other caller's runs. Two limits remain: a run waiting for the graph's delay holds the
device's worker slot it was granted, as any run waiting for a process does (a request's
deadline bounds it); and a caller that may take a new name for each request starts a
new streak with each (a guest's tenant is the host's choice, its program's name by
default: see :mod:`wasinn.host.tenant`).

Each back-off is logged once, as a warning (logger ``wasinn.backends``), when it starts: a
caller's runs refused, the graph's next process delayed, inputs refused; the runs it
refuses or delays are not (their callers' errors say so).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import math
import time
from collections.abc import Callable, Mapping

import numpy as np

from wasinn.tensor import Tensor, numpy_dtype

log = logging.getLogger("wasinn.backends")

#: The delay after the second crash of a streak, in seconds (none after the first): the
#: wait for the graph's next process, or how long a caller's runs are refused.
FIRST_DELAY_S = 0.5
#: The longest delay, in seconds: runs wait this long at most for the graph's next
#: process, and a caller's runs are refused this long at most after its last crash.
MAX_DELAY_S = 10.0
#: Seconds without a crash that end a streak.
QUIET_S = 60.0
#: Crashes of the same inputs after which they are refused without a run.
REFUSED_AFTER = 2
#: Seconds after their last crash that inputs are remembered (and refused).
REMEMBERED_S = 600.0
#: The most inputs one graph remembers (the oldest forgotten first).
MAX_REMEMBERED = 64
#: The most callers one graph remembers a streak of (the one whose last crash is the
#: oldest forgotten first).
MAX_CALLERS = 1024

#: What identifies inputs cheaply: (name, type, dimensions) of each tensor, sorted.
Shapes = tuple[tuple[str, str, tuple[int, ...]], ...]


def shapes_of(inputs: Mapping[str, Tensor]) -> Shapes:
    """The names, element types and dimensions of ``inputs`` (no data read)."""
    return tuple(sorted((str(name), t.type.value, tuple(int(d) for d in t.dims))
                        for name, t in inputs.items()))


def digest_of(inputs: Mapping[str, Tensor]) -> bytes:
    """A digest of ``inputs``: their names, types, dimensions and bytes (BLAKE2b). Keys
    are read as str (a graph's run names each input; were one a position, sorting it
    beside names must not fail)."""
    digest = hashlib.blake2b(repr(shapes_of(inputs)).encode(), digest_size=32)
    for name in sorted(inputs, key=str):
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


class _Streak:
    """Crashes less than :data:`QUIET_S` apart (the graph's, or one caller's), and when
    the wait they impose ends."""

    __slots__ = ("crashes", "last_at", "resume_at")

    def __init__(self) -> None:
        self.crashes = 0
        self.last_at = -math.inf
        self.resume_at = 0.0

    def delay(self) -> float:
        """The wait after the crashes so far (0: none, after the first)."""
        if self.crashes < 2:
            return 0.0
        return min(FIRST_DELAY_S * 2.0 ** (self.crashes - 2), MAX_DELAY_S)

    def crashed(self, now: float) -> float:
        """One more crash, at ``now``: the wait it imposes."""
        if now - self.last_at >= QUIET_S:
            self.crashes = 0
        self.crashes += 1
        self.last_at = now
        delay = self.delay()
        self.resume_at = now + delay
        return delay

    def remaining(self, now: float) -> float:
        return max(0.0, self.resume_at - now)


class CrashBackoff:
    """One graph's crash streaks, the graph's and each caller's (see the module
    docstring), and the inputs that crashed it (not thread-safe: the graph holds its lock
    around every call). A caller is an opaque str (None: nobody named, whose crashes are
    the graph's own). A graph with several processes counts the crashes of all of them.
    ``name``: the graph's, which its refusals and log lines start with (its model's
    label and backend, ``"resnet (onnxruntime)"``, or its backend's alone)."""

    def __init__(self, name: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._name = name
        self._clock = clock
        #: The crashes that are nobody's: loads, and runs that name no caller.
        self._graph = _Streak()
        #: Each caller's, the one whose last crash is the oldest first.
        self._callers: collections.OrderedDict[str, _Streak] = collections.OrderedDict()
        self._inputs: collections.OrderedDict[bytes, _Crashed] = collections.OrderedDict()
        #: When a process ended by a signal from outside was last excused (excused_stop).
        self._excused_at: float | None = None

    def excused_stop(self) -> bool:
        """Whether a process that a signal from outside ended (SIGTERM, SIGHUP: an
        operator's kill, a service manager stopping the service) is excused, not counted
        as a crash: the graph's first such end in :data:`QUIET_S`. A process can send
        itself the signal (its library, or code a hostile model got to run), so a second
        one within :data:`QUIET_S` counts as a crash: nobody escapes the back-off by it."""
        now = self._clock()
        if self._excused_at is not None and now - self._excused_at < QUIET_S:
            return False
        self._excused_at = now
        return True

    @property
    def crashes(self) -> int:
        """The crashes of the streaks under way, the graph's and every caller's."""
        self._forget_quiet(self._clock())
        return self._graph.crashes + sum(s.crashes for s in self._callers.values())

    def crashes_of(self, caller: str | None = None) -> int:
        """The crashes of ``caller``'s streak (None: the graph's own)."""
        streak = self._streak(caller, self._clock())
        return 0 if streak is None else streak.crashes

    @property
    def callers(self) -> int:
        """The callers remembered: those with a crash less than :data:`QUIET_S` ago, of
        :data:`MAX_CALLERS` at most."""
        self._forget_quiet(self._clock())
        return len(self._callers)

    def delay(self, caller: str | None = None) -> float:
        """The seconds ``caller``'s streak (None: the graph's) imposes after the crashes
        so far (0: none)."""
        streak = self._streak(caller, self._clock())
        return 0.0 if streak is None else streak.delay()

    def crashed(self, how: str, inputs: tuple[Shapes, bytes] | None = None,
                caller: str | None = None) -> str:
        """A process died on its own (``how``: "was killed by SIGSEGV"), running
        ``inputs`` (their shapes and digest; None: loading the model, which is the
        graph's crash whoever's run it was for) of ``caller`` (None: nobody named: the
        graph's crash too); what happens next, for the run's error. A back-off that
        starts with it is logged (a warning: see the module docstring)."""
        now = self._clock()
        if inputs is None or caller is None:
            streak = self._graph
        else:
            self._forget_quiet(now)
            streak = self._callers.get(caller) or _Streak()
            self._callers[caller] = streak
            self._callers.move_to_end(caller)  # the most recent crash last
            while len(self._callers) > MAX_CALLERS:
                self._callers.popitem(last=False)
        delay = streak.crashed(now)
        if not delay:
            then = "the next run starts a new process"
        elif streak is self._graph:
            then = (f"the next process starts in {delay:g} s, after {streak.crashes} "
                    f"crashes less than {QUIET_S:g} s apart: runs wait for it")
            log.warning("%s: its sandbox process crashed %d times less than %g s apart "
                        "(loading the model, or runs that name no caller): its next "
                        "process starts in %g s, and runs wait for it", self._name,
                        streak.crashes, QUIET_S, delay)
        else:
            then = (f"this caller's runs are refused for {delay:g} s, after "
                    f"{streak.crashes} crashes of its runs less than {QUIET_S:g} s apart; "
                    "other callers' runs go on")
            # (a refused caller's runs crash nothing: each such crash starts a refusal)
            log.warning("%s: the runs of caller %r crashed its sandbox process %d times "
                        "less than %g s apart: its runs are refused for %g s; other "
                        "callers' runs go on", self._name, caller, streak.crashes, QUIET_S,
                        delay)
        if inputs is None:
            return then
        times = self._remember(*inputs, how, now)
        if times < REFUSED_AFTER:
            return then
        if times == REFUSED_AFTER:  # (more: runs of them that were under way already)
            log.warning("%s: inputs (%s) crashed its sandbox process %d times: they are "
                        "refused without a run until %g s after their last crash; other "
                        "inputs run as usual", self._name, _described(inputs[0]), times,
                        REMEMBERED_S)
        return (f"{then}; these inputs, which crashed it {times} times, are "
                f"refused for {REMEMBERED_S:g} s")

    def remaining(self, caller: str | None = None) -> float:
        """Seconds until a new process may start for a run of ``caller`` (0: now): the
        graph's streak's wait, or the caller's own where longer."""
        now = self._clock()
        wait = self._graph.remaining(now)
        if caller is None or not self._callers:
            return wait
        return max(wait, self.holding(caller, now))

    def holding(self, caller: str | None, now: float | None = None) -> float:
        """Seconds for which a run of ``caller`` is refused (0: it may take a process,
        idle or new): its own streak's delay (none for None: the graph's streak delays
        only the start of a process)."""
        if caller is None or not self._callers:  # (the common case: no clock read)
            return 0.0
        if now is None:
            now = self._clock()
        streak = self._streak(caller, now)
        return 0.0 if streak is None else streak.remaining(now)

    def waiting(self, caller: str | None = None) -> bool:
        """Whether no new process may start now for a run of ``caller``."""
        return self.remaining(caller) > 0.0

    def _streak(self, caller: str | None, now: float) -> _Streak | None:
        if caller is None:
            return self._graph
        self._forget_quiet(now)
        return self._callers.get(caller)

    def _forget_quiet(self, now: float) -> None:
        # The callers without a crash for QUIET_S: their streak is over (and their wait,
        # MAX_DELAY_S at most).
        callers = self._callers
        while callers:
            oldest = next(iter(callers.values()))
            if now - oldest.last_at < QUIET_S:
                return
            callers.popitem(last=False)

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
        return (f"{self._name}: these inputs crashed the model's process {crashed.times} "
                f"times (the last {ago:.1f} s ago: it {crashed.how}): they are refused "
                f"without a run until {REMEMBERED_S:g} s after their last crash; other "
                "inputs run as usual")

    def suspect(self, digest: bytes) -> bool:
        """Whether inputs of ``digest`` crashed the process, but too few times to be
        refused: the graph runs them on one process at a time (see :mod:`.sandbox`)."""
        crashed = self._inputs.get(digest)
        return crashed is not None and crashed.times < REFUSED_AFTER

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


def _described(shapes: Shapes) -> str:
    """``x: f32[1, 4], ...``: inputs' names, element types and dimensions, for a log."""
    return ", ".join(f"{name}: {kind}{list(dims)}" for name, kind, dims in shapes)
