"""``RunProfile``: whether one compiled graph's runs are small enough to run inline.

Handing a job to a worker thread and back costs two cross-thread wake-ups. On a quiet
machine that is a few tens of microseconds; on a busy or virtualised one each wake-up
can take 50 us or more, several times what a tiny model's run itself takes (an ONNX
``y = 2x + 1`` runs in ~7 us). For such graphs a device actor may run the job inline, on
the trio thread, when that cannot be noticed: the trade-off is that the event loop is
held for the run's duration (bounded below), in exchange for no thread hand-off at all.

Inline runs are opt-in: a pool's ``inline_below_us`` is the bound, and its default, 0,
turns them off. The rule, per compiled graph on one device:

* every successful run in a worker thread is timed, and so is every successful inline
  run (a failed run says nothing of the graph's run time: a bad input can fail at once);
* a graph qualifies after ``WARMUP`` runs in a row whose exponential moving average
  stays below the bound, and only for inputs no larger (in bytes) than the largest it
  was timed with (a graph with dynamic shapes is not trusted with a bigger input);
* any run longer than ``MULTIPLE`` times the bound disqualifies it: its next runs go to
  the worker threads again until it qualifies anew;
* the actor runs a qualified job inline only when the device is idle (no job in its
  worker threads, no request queued) and the request has no deadline (an inline run
  cannot be interrupted, so it could not time out), and yields to the other trio tasks
  right after, so a stream of tiny requests cannot starve them.

The risk, plainly: qualifying is a prediction from past runs, not a limit. A graph's run
time can depend on its input values, not only on their size (an ONNX ``Loop`` whose trip
count is an input: timed at 1 iteration, then asked for millions), and a run that is
usually tiny can be long once (a first run after a shape change, an allocator growing
its arena). Such a run holds the event loop for its whole duration, seconds if need be:
no other request, timeout or cancellation is served meanwhile. Only then is the graph
disqualified. Enable inline runs only for graphs whose run time is bounded whatever
their inputs.

An inline run has no job context: no :class:`~wasinn.backends.base.Cancellation`, so
no caller named to its backend either (:func:`~wasinn.backends.base.current_caller` is
None). No graph that needs one runs inline: only graphs that may run inline do
(``CompiledGraph.may_run_inline``), and a sandboxed graph, whose crash back-off is the
one thing that tells callers apart, never may. (Naming the caller there would cost
every inline run a job context, on the path whose point is to cost nothing.)
"""

from __future__ import annotations


class RunProfile:
    """Timings of one compiled graph's runs on one device (see the module docstring).

    Updated from worker threads and the trio thread without a lock: the fields are
    numbers whose updates are atomic under the GIL, and a lost update only delays the
    decision by one run.
    """

    #: Runs in a row (below the bound) before inline runs are allowed.
    WARMUP = 5
    #: Weight of the newest run in the moving average.
    ALPHA = 0.25
    #: A run longer than MULTIPLE x the bound disqualifies the graph.
    MULTIPLE = 4.0

    __slots__ = ("ema", "max_bytes", "runs")

    def __init__(self) -> None:
        self.ema = 0.0
        self.runs = 0
        self.max_bytes = 0

    def __repr__(self) -> str:
        return f"<RunProfile runs={self.runs} ema={self.ema * 1e6:.1f}us <= {self.max_bytes}B>"

    def observe(self, seconds: float, nbytes: int, bound: float) -> None:
        """Record one run of ``seconds`` on ``nbytes`` of input, against ``bound``."""
        if seconds > bound * self.MULTIPLE:
            self.runs, self.ema, self.max_bytes = 0, 0.0, 0
            return
        self.ema = seconds if self.runs == 0 else self.ema + self.ALPHA * (seconds - self.ema)
        self.runs += 1
        if seconds < bound and nbytes > self.max_bytes:
            self.max_bytes = nbytes

    def qualifies(self, nbytes: int, bound: float) -> bool:
        """Whether a run on ``nbytes`` of input may run inline under ``bound``."""
        return self.runs >= self.WARMUP and self.ema < bound and nbytes <= self.max_bytes
