"""Dynamic batching: requests for one graph merged into one run on a device.

A model (or pipeline) loaded with :class:`Batching` lets its requests share runs: the
requests that wait for a worker slot on a device at the same time, for the same graph,
with inputs of the same element types and the same shapes but the first (batch) axis, are
concatenated along that axis, run once, and the outputs split back by rows. On a busy
device this turns a queue of single-row requests into a few large runs, as an inference
server's dynamic batcher does (Triton's ``dynamic_batching``); on an idle one it costs
nothing unless ``max_delay`` asks a batch to wait for company.

How a batch forms (all in trio, per device actor, see :class:`Batcher`):

* A request that finds no open batch it may join, and a free slot with nobody queued,
  runs at once as a plain request (``max_delay`` = 0: batching never delays an idle
  device). Otherwise it opens a batch: one entry in the device's queue, ordered by the
  queue policy with its members' highest priority, earliest deadline and tenant (the
  opener's, until members join or leave: a batch whose most urgent member left moves
  back in the queue to where its remaining members' terms place it).
* Until that entry is granted a slot (and, with ``max_delay``, until ``max_delay`` after
  the batch opened, until it is full, or until half the time left before its earliest
  member's deadline has passed, so that a short timeout is not spent waiting; or until
  another request waits for a slot on the device: an idle slot must not keep other work
  waiting, see :meth:`Slots.idle <wasinn.actors.slots.Slots.idle>`), later
  requests join it when they are for the
  same graph and input signature, of the same tenant, would not be served earlier on
  their own (priority no higher, deadline no earlier than the batch's), and their rows
  fit under ``max_batch`` beside those of the members still there (a member that leaves
  before its batch starts frees its rows: a batch closed for being full, still queued
  or waiting for company, is joinable again). Anything else opens a batch of its own.
* The batch then runs as one job in a worker thread. Each member still gets its own
  outcome, latency (queued: until the batch started running) and stats entry; the
  device's ``batches`` count merged runs, ``batched`` the requests they answered.

Correctness never rests on the merge:

* A model is loaded with batching only when it may be batch-major: every output's first
  dimension the inputs' batch dimension. What it declares is checked at load
  (:func:`check_batchable`, :mod:`~wasinn.actors._batch_axes`): a fixed first dimension,
  or ONNX dimension names that show an output has another first dimension, is refused.
  A model that bounds its first dimension (``x: f32[1..4, 3]``) has ``max_batch``
  lowered to that bound (:func:`fit_batching`): a merged run it would refuse is never
  made. Where its declarations do not show every output batch-major (no names, no shapes),
  the first merged run of each graph and input signature on a device is checked: its
  member of fewest rows runs alone too, and the merged outputs must be shaped as that
  run's but for their rows (a transposed output may have as many rows as the batch).
* A merged run that fails, whose outputs do not have the batch's row count as their
  first dimension, or that the check above finds shaped otherwise, is re-run request by
  request in the same job, so one bad request fails alone and a model whose outputs
  cannot be split still answers (with a warning).
  Such a model's later requests (for that graph and input signature) run alone, as
  plain requests: they no longer pay for a merged run that is thrown away, nor wait in
  one job for each other where other workers are free.
* A member cancelled or past its deadline leaves the batch (its part of the result is
  dropped); when every member has left, the batch leaves the queue, or its run is
  abandoned like any request's. A member whose execution context closes leaves a batch
  that has not started (queued or gathering) at once, unrun, its caller told so
  (:class:`~wasinn.actors.slots.RequestWithdrawn`); one whose batch started runs with it.
* A merged run keeps its outputs on the device when any member asked to
  (``keep_on_device``, the default on a GPU). Each such member gets its rows as a view on
  the device where the backend can cut its value without a copy (torch tensors, OpenVINO
  tensors); an ``OrtValue`` cannot be cut, so its rows are views of one host copy, as are
  those of every member that asked for host outputs.

Only requests whose inputs are host tensors that all share their first dimension are
batched; others (device-resident inputs, scalars) run as plain requests. Enable batching
only for models whose rows are independent of each other (no reduction across the batch
axis): the merged run computes each row as a run of its own would, up to the backend's
floating-point reassociation in larger matrix products.

The parts: this module holds what a model is loaded with (:class:`Batching`, checked by
:func:`check_batchable`, from :mod:`~wasinn.actors._batch_axes`);
:mod:`~wasinn.actors._batcher` forms the batches and runs them,
:mod:`~wasinn.actors._batch` is one batch and its members, :mod:`~wasinn.actors._batch_job`
the job a batch runs in a worker thread, and :mod:`~wasinn.actors._batch_rows` how rows
are merged for a run and split back.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from wasinn.backends.base import TensorSpec
from wasinn.errors import InvalidArgumentError
from wasinn.tensor import as_int

from ._batch_axes import check_batchable, row_limit
from ._batch_rows import BatchInputs, RunInputs, Signature, merge_rows, split_rows
from ._batcher import Batcher

__all__ = [
    "MAX_BATCH",
    "BatchInputs",
    "Batcher",
    "Batching",
    "BatchingError",
    "RunInputs",
    "Signature",
    "check_batchable",
    "fit_batching",
    "merge_rows",
    "split_rows",
]

#: The most rows a batch may be given (``Batching.max_batch``, the config's too).
MAX_BATCH = 65_536

log = logging.getLogger("wasinn.actors")


@dataclass(frozen=True, slots=True)
class Batching:
    """How one model's requests are merged on a device.

    ``max_batch``: the most rows one run takes (a request with more runs alone).
    ``max_delay``: seconds a batch that holds a slot waits for more requests before it
    runs, unless it fills up first or another request waits for a slot on the device;
    0 (the default) batches only what queued while the device was busy and never delays
    a request on an idle device. Other values raise
    :class:`BatchingError` (an InvalidArgumentError, and a ValueError).
    """

    max_batch: int
    max_delay: float = 0.0

    def __post_init__(self) -> None:
        # InvalidArgumentError like every bad value wasinn is given; also a ValueError,
        # which is what this raised before it joined the error tree.
        max_batch, max_delay = self.max_batch, self.max_delay
        count = as_int(max_batch)
        if count is None or not 2 <= count <= MAX_BATCH:
            raise BatchingError(f"Batching: max_batch must be an integer from 2 to "
                               f"{MAX_BATCH}, got {max_batch!r}")
        if not (isinstance(max_delay, int | float | np.integer | np.floating)
                and not isinstance(max_delay, bool | np.bool_) and 0 <= max_delay <= 10):
            raise BatchingError(f"Batching: max_delay must be between 0 and 10 seconds, got "
                               f"{max_delay!r}")
        # numpy numbers (np.int64(8)) are kept as Python ones.
        object.__setattr__(self, "max_batch", count)
        object.__setattr__(self, "max_delay", float(max_delay))


class BatchingError(InvalidArgumentError, ValueError):
    """A :class:`Batching` with bounds out of range (``wasinn.BatchingError``):
    invalid-argument, and a ValueError for callers that caught that before."""


def fit_batching(name: str, batching: Batching, inputs: Iterable[TensorSpec]) -> Batching:
    """``batching`` for a model (or pipeline step) ``name`` of ``inputs``: as given, or
    with ``max_batch`` lowered (with a warning) to the most rows an input's first
    dimension allows where the model bounds it below that (an OpenVINO interval
    ``x: f32[1..8, 3]``, a torch.export ``Dim(max=8)``), so that no merged run is larger
    than the model takes. Raises InvalidArgumentError where that is fewer than 2 rows:
    no two requests could ever share a run."""
    limit = row_limit(inputs)
    if limit is None or limit[0] >= batching.max_batch:
        return batching
    rows, spec = limit
    if rows < 2:
        raise InvalidArgumentError(
            f"{name}: batching merges requests along the first dimension, but input "
            f"{spec.describe()} allows at most {rows} row there: expected a first "
            "dimension that allows 2 rows or more, or load the model without batching")
    log.warning("%s: batching's max_batch %d lowered to %d: input %s allows at most %d "
                "rows", name, batching.max_batch, rows, spec.describe(), rows)
    return dataclasses.replace(batching, max_batch=rows)
