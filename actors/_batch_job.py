"""``BatchJob``: what a batch runs in a worker thread.

One merged run, split back by rows; when that run fails, or its outputs cannot be split
(a warning, once per label), one run per member in the same job, so that one bad request
fails alone. An exception that loses the device ends the job (see
:mod:`wasinn.actors.batching`, "Correctness never rests on the merge").

A job told to ``probe`` (the first merged run of an input signature, for a model that
does not declare its outputs batch-major: :mod:`wasinn.actors._batch_axes`) also runs
its member of fewest rows alone, which gets that run's outputs, and compares their
shapes with its rows of the merged run (:func:`~wasinn.actors._batch_rows.check_alone`):
when they differ, the merged run is unsplittable, as above.

What the merged run records as it runs (a pipeline's steps, each run counted in its
model's figures) is held (:class:`~wasinn.actors.stats.MergedRun`) and counted once the
job knows how many requests it answered: those given its rows, not the probe's member
(its run alone answered it, and counted itself), none when it failed or could not be
split (each request's run alone answers it). Its time is counted either way: the device
spent it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import outcome

from wasinn.backends.base import current_cancellation
from wasinn.errors import ClosedResourceError
from wasinn.tensor import Tensor

from ._batch import Member
from ._batch_rows import RunInputs, Unsplittable, check_alone, merge_rows, split_rows
from .stats import MergedRun

log = logging.getLogger("wasinn.actors")


class BatchJob:
    """The job a batch runs in a worker thread: one merged run, split by rows, or (when
    that fails or cannot be split) one run per member. ``merged`` says which happened;
    ``unsplittable``, why the merged run's outputs could not be split by rows (None:
    they could), which the batcher warns of once;
    ``checked``, that ``probe`` found them shaped as a member's run alone."""

    __slots__ = ("checked", "fatal", "label", "members", "merged", "probe", "run",
                 "unsplittable")

    def __init__(self, run: RunInputs, members: Sequence[Member], label: str,
                 fatal: Callable[[BaseException], bool], *, probe: bool = False) -> None:
        self.run = run
        self.fatal = fatal
        self.members = members
        self.label = label
        self.probe = probe
        self.merged = False
        self.unsplittable: str | None = None
        self.checked = False

    def __call__(self) -> list[outcome.Outcome[dict[str, Tensor]]]:
        # Members that left since the batch was granted its slot (their flag is set in
        # trio; reading a stale False only costs a wasted row) are not run.
        results: list[outcome.Outcome[dict[str, Tensor]]] = [self._left] * len(self.members)
        alive = [i for i, m in enumerate(self.members) if not m.abandoned]
        members = [self.members[i] for i in alive]
        if len(members) == 1:
            only = members[0]
            results[alive[0]] = self._alone(only)
            return results
        if not members:
            return results
        keeps = [m.keep for m in members]
        ran = -1  # the member already run alone (by the probe), if any
        merged_run = MergedRun()
        answered = 0  # the requests given the merged run's rows
        try:
            with merged_run.running():
                outputs = self.run(merge_rows([m.inputs for m in members]), any(keeps))
            parts = split_rows(outputs, [m.inputs.rows for m in members], keeps)
            if self.probe and not _cancelled():
                # Its member of fewest rows runs alone too (that run is its result), and
                # checks the merged outputs' shapes: Unsplittable when they differ.
                ran = min(range(len(members)), key=lambda k: members[k].inputs.rows)
                alone = results[alive[ran]] = self._alone(members[ran])
                if isinstance(alone, outcome.Value):  # (an error: the next one probes)
                    check_alone(outputs, alone.value, members[ran].inputs.rows)
                    self.checked = True
        except Unsplittable as exc:
            self.unsplittable = str(exc)
        except Exception as exc:  # each request is re-run alone below, and fails alone
            if self.fatal(exc):
                raise  # the device is lost: no run more there
            log.debug("%s: a merged run failed; its requests run one by one", self.label,
                      exc_info=True)
        else:
            self.merged = True
            for k, (i, part) in enumerate(zip(alive, parts, strict=True)):
                if k != ran:
                    results[i] = outcome.Value(part)
                    answered += 1
            return results
        finally:
            merged_run.answered(answered)
        cancellation = current_cancellation()
        for k, (i, member) in enumerate(zip(alive, members, strict=True)):
            if member.abandoned or k == ran:
                continue
            if cancellation is not None and cancellation.cancelled:
                results[i] = outcome.Error(ClosedResourceError(
                    f"{self.label}: the batch was cancelled (its device is closing) before "
                    "this request ran"))
                continue
            results[i] = self._alone(member)
        return results

    def _alone(self, member: Member) -> outcome.Outcome[dict[str, Tensor]]:
        # One member's run; an exception the device cannot survive ends the batch.
        try:
            return outcome.Value(self.run(member.inputs.tensors, member.keep))
        except BaseException as exc:
            if self.fatal(exc):
                raise
            return outcome.Error(exc)

    @property
    def _left(self) -> outcome.Outcome[dict[str, Tensor]]:
        # The outcome of a member that left: never handed to anyone.
        return outcome.Error(ClosedResourceError(f"{self.label}: the request left its batch"))


def _cancelled() -> bool:
    cancellation = current_cancellation()
    return cancellation is not None and cancellation.cancelled
