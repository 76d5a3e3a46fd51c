"""A request's inputs as rows of a batch: merged with other requests' rows for one run,
and that run's outputs cut back into each request's rows.

A request may join a batch when its inputs are host tensors that all share their first
(batch) dimension (:class:`BatchInputs`); requests whose inputs have the same
:data:`Signature` (element types and dimensions after the first) can run together.
:func:`merge_rows` concatenates the members' inputs along that axis for the merged run;
:func:`split_rows` cuts its outputs back into each member's rows, or raises
:class:`Unsplittable` when they do not have one row per input row;
:func:`check_alone` compares them with one member's run alone, where the model does not
declare its outputs batch-major (see :mod:`wasinn.actors._batch_axes`). How batches form
and run: :mod:`wasinn.actors.batching`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from wasinn.errors import WasiNNError
from wasinn.tensor import Tensor, as_tensor

#: Runs a graph (or pipeline) on inputs; the flag is ``keep_on_device``.
RunInputs = Callable[[Mapping[Any, Any], bool], dict[str, Tensor]]
#: A request's input signature: (key, element type, dimensions after the first) per input.
Signature = tuple[tuple[Any, Any, tuple[int, ...]], ...]


class BatchInputs:
    """A request's inputs as a batch member: host tensors sharing their first dimension."""

    __slots__ = ("rows", "signature", "tensors")

    def __init__(self, tensors: dict[Any, Tensor], rows: int, signature: Signature) -> None:
        self.tensors = tensors
        self.rows = rows
        self.signature = signature

    @classmethod
    def of(cls, inputs: Mapping[Any, object]) -> BatchInputs | None:
        """``inputs`` ready to batch, or None when they cannot be (a device-resident or
        scalar input, first dimensions that differ, a value that is not a tensor: such
        a request runs as a plain one, which reports bad inputs as usual)."""
        tensors: dict[Any, Tensor] = {}
        signature = []
        rows = -1
        for key, value in inputs.items():
            try:
                tensor = value if type(value) is Tensor else as_tensor(value)  # type: ignore[arg-type]
            except (WasiNNError, TypeError, ValueError):
                return None
            dims = tensor.dims
            if not tensor.is_host or not dims or (rows >= 0 and dims[0] != rows):
                return None
            rows = dims[0]
            tensors[key] = tensor
            signature.append((key, tensor.type, dims[1:]))
        if rows < 1:
            return None
        return cls(tensors, rows, tuple(signature))


class Unsplittable(Exception):
    """A merged run's outputs do not have one row per input row, or a member's rows of
    them are not shaped as its run alone."""


def merge_rows(members: Sequence[BatchInputs]) -> dict[Any, Tensor]:
    """Every member's inputs concatenated along the first axis, in member order."""
    merged: dict[Any, Tensor] = {}
    for key, first in members[0].tensors.items():
        array = np.concatenate([m.tensors[key].numpy() for m in members])
        merged[key] = Tensor(tuple(array.shape), first.type, array=array)
    return merged


def split_rows(outputs: Mapping[str, Tensor], rows: Sequence[int], keeps: Sequence[bool]
               ) -> list[dict[str, Tensor]]:
    """``outputs`` of a merged run cut back into each member's rows, without a copy:
    views of host outputs; of a device-resident output, native views on the device for
    the members that keep theirs there (``keeps``) where the backend can cut its value,
    else views of one host copy.

    Raises Unsplittable when an output's first dimension is not the total row count.
    """
    total = sum(rows)
    parts: list[dict[str, Tensor]] = [{} for _ in rows]
    for name, tensor in outputs.items():
        if not tensor.dims or tensor.dims[0] != total:
            raise Unsplittable(
                f"output {name!r} has shape {list(tensor.dims)}, not {total} rows (one per "
                "input row): its requests run one by one, and alone from now on")
        start = 0
        for part, count, keep in zip(parts, rows, keeps, strict=True):
            stop = start + count
            piece = tensor.slice_rows(start, stop) if keep else None
            if piece is None:  # materialized once (if native), for the first that needs it
                host = tensor.numpy()[start:stop]
                piece = Tensor(tuple(host.shape), tensor.type, array=host)
            part[name] = piece
            start = stop
    return parts


def check_alone(outputs: Mapping[str, Tensor], alone: Mapping[str, Tensor], rows: int
                ) -> None:
    """Raises Unsplittable unless ``alone``, a member's outputs run alone on its ``rows``
    rows, are shaped as its rows of the merged run's ``outputs``: the same outputs, each
    ``rows`` long and otherwise as the merged one. An output whose other dimensions
    changed with the rows merged does not have the batch axis first (``z = x.T``: its
    first dimension may still happen to be the merged row count): the merged run's rows
    of it are not any member's result."""
    total = next((tensor.dims[0] for tensor in outputs.values()), 0)
    for name, tensor in outputs.items():
        got = alone.get(name)
        want = (rows, *tensor.dims[1:])
        if got is None or tuple(got.dims) != want:
            have = "no such output" if got is None else f"shape {list(got.dims)}"
            raise Unsplittable(
                f"output {name!r} of a merged run of {total} rows has shape "
                f"{list(tensor.dims)}, but one of its requests ({rows} rows) run alone "
                f"gives {have}, not {list(want)}: its first axis is not the inputs' batch "
                "axis, so its requests run one by one, and alone from now on")
    extra = sorted(set(alone) - set(outputs))
    if extra:
        raise Unsplittable(
            f"a request run alone gives outputs {extra} that its merged run (of {total} "
            "rows) does not: its requests run one by one, and alone from now on")
