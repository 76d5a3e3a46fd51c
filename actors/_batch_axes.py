"""Whether a model's outputs are batch-major, from the shapes it declares: checked when
it is loaded with batching.

Dynamic batching concatenates requests along the first axis of every input and cuts
each output back along its first axis, which is right only for an output whose first
axis is the inputs' batch axis. What a model declares (its specs, and an ONNX model's
symbolic dimension names: :mod:`wasinn.backends.onnx_dims`) tells three cases apart:

* not batch-major: refused at load (:func:`check_batchable` raises). An input or output
  without a first axis (a scalar) or with a fixed one; inputs whose first axes are named
  apart (``x: [n, 4]``, ``y: [m, 4]``: a request's queries and its own memory rows,
  which a merge would mix between requests of the same row counts); an output whose first axis is
  named as one of the inputs' other axes (``z = x.T`` declares ``x: [n, m]`` and
  ``z: [m, n]``); an input or output that has the batch axis's name on another axis too
  (its size would change with the rows merged: ``x @ x.T`` is ``[n, n]``).
* batch-major: every output's first axis is named as an input's first axis, and its
  other axes are fixed or named as the inputs' other axes (so the input signature fixes
  them). Its merged runs are split as they come.
* not known: dimensions without names (OpenVINO IR, torch.export, ONNX declared with
  ``None``), undeclared shapes (TorchScript), an output's axis named after nothing the
  inputs have (``torch.onnx.export`` with ``dynamic_axes`` given as lists names each
  tensor's axis apart: ``x_dynamic_axes_1``, as tf2onnx's ``unk__7`` do, names that say
  nothing and are taken for none). The first merged run of each input signature is then
  checked against a run of one of its requests alone
  (:class:`~wasinn.actors._batch_job.BatchJob`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

from wasinn.backends.base import TensorSpec
from wasinn.backends.onnx_dims import DeclaredDim
from wasinn.errors import InvalidArgumentError

#: Tensor name -> the dimensions its model declares (see :mod:`wasinn.backends.onnx_dims`).
Declared = Mapping[str, tuple[DeclaredDim, ...]]

_MERGES = "batching merges requests along the first dimension"
_NO_BATCHING = "or load the model without batching"
#: Dimension names an exporter makes up for each tensor apart, which say nothing of which
#: dimensions are the same: ``torch.onnx.export``'s for ``dynamic_axes`` given as lists
#: (``x_dynamic_axes_1``), tf2onnx's unknowns (``unk__7``).
_MADE_UP = re.compile(r".+_dynamic_axes_[0-9]+|unk__[0-9]+")


def check_batchable(name: str, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec],
                    declared: Declared | None = None) -> bool:
    """Whether ``outputs`` are declared batch-major (see the module docstring): True when
    every output's first axis is shown to be the inputs' batch axis, False when that is
    not known. Raises InvalidArgumentError, naming the tensor, its declared shape and
    what was expected, when an input or output shows that it is not batch-major.

    ``declared``: the dimension names a model's format keeps (an ONNX model's), by tensor
    name; a tensor's are used where they have its spec's rank."""
    in_dims = [_dims(spec, declared) for spec in inputs]
    batch = {dims[0] for dims in in_dims if dims and isinstance(dims[0], str)}
    if len(batch) > 1:
        firsts = ", ".join(f"{spec.name}: {_shape(dims)}" for spec, dims
                           in zip(inputs, in_dims, strict=True) if dims)
        raise InvalidArgumentError(
            f"{name}: {_MERGES} of every input, but the inputs name their first dimensions "
            f"apart ({firsts}): two requests of the same row counts would have their rows "
            "mixed: expected every input's first dimension to be the batch dimension, "
            f"named alike, {_NO_BATCHING}")
    other: dict[str, str] = {}  # a name on an input's other axis -> which axis
    for spec, dims in zip(inputs, in_dims, strict=True):
        if dims is None:
            continue
        _check_first(name, "input", spec, dims)
        for axis, dim in enumerate(dims[1:], 1):
            _check_not_batch(name, "input", spec, dims, axis, batch)
            if isinstance(dim, str):
                other.setdefault(dim, f"input {spec.name}'s dimension {axis}")
    known = True
    for spec in outputs:
        dims = _dims(spec, declared)
        if dims is None:
            known = False
            continue
        _check_first(name, "output", spec, dims)
        first = dims[0]
        if isinstance(first, str) and first not in batch and first in other:
            raise InvalidArgumentError(
                f"{name}: {_MERGES}, but output {spec.name} is declared {_shape(dims)}: its "
                f"first dimension is {first} ({other[first]}), not {_batch_dim(batch)}: "
                "expected every output to have the batch dimension first, "
                f"{_NO_BATCHING}")
        for axis in range(1, len(dims)):
            _check_not_batch(name, "output", spec, dims, axis, batch)
        known = known and first in batch and all(
            isinstance(dim, int) or dim in other for dim in dims[1:])
    return known


def row_limit(inputs: Iterable[TensorSpec]) -> tuple[int, TensorSpec] | None:
    """The fewest rows that one of ``inputs`` allows at most in its first dimension, and
    that input, where any bounds it (None where none does)."""
    least: tuple[int, TensorSpec] | None = None
    for spec in inputs:
        high = spec.bounds[0][1] if spec.bounds else None
        if high is not None and (least is None or high < least[0]):
            least = (high, spec)
    return least


def _dims(spec: TensorSpec, declared: Declared | None) -> tuple[DeclaredDim, ...] | None:
    # The spec's dimensions, a dynamic one named where ``declared`` names it; None for an
    # unknown rank.
    if not spec.rank_known:
        return None
    names = None if declared is None else declared.get(spec.name)
    if names is None or len(names) != len(spec.shape):
        return spec.shape
    return tuple(size if size is not None else named if isinstance(named, str)
                 and not _MADE_UP.fullmatch(named) else None
                 for size, named in zip(spec.shape, names, strict=True))


def _check_first(name: str, role: str, spec: TensorSpec, dims: tuple[DeclaredDim, ...]
                 ) -> None:
    if not dims:
        raise InvalidArgumentError(
            f"{name}: {_MERGES}, but {role} {spec.describe()} is a scalar: expected a "
            f"variable batch dimension first, {_NO_BATCHING}")
    if isinstance(dims[0], int):
        raise InvalidArgumentError(
            f"{name}: {_MERGES}, but {role} {spec.describe()} fixes it: expected a "
            "variable batch dimension (export the model with a dynamic first axis), "
            f"{_NO_BATCHING}")


def _check_not_batch(name: str, role: str, spec: TensorSpec, dims: tuple[DeclaredDim, ...],
                     axis: int, batch: set[str]) -> None:
    dim = dims[axis]
    if isinstance(dim, str) and dim in batch:
        raise InvalidArgumentError(
            f"{name}: {_MERGES}, but {role} {spec.name} is declared {_shape(dims)}: its "
            f"dimension {axis} is {dim} too, the inputs' batch dimension, so its size would "
            "change with the rows merged: expected the batch dimension first and nowhere "
            f"else, {_NO_BATCHING}")


def _shape(dims: tuple[DeclaredDim, ...]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"


def _batch_dim(batch: set[str]) -> str:
    names = " / ".join(sorted(batch))
    return f"the inputs' batch dimension {names}" if names else "the inputs' batch dimension"
