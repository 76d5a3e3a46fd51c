"""The spec's single value: "To represent a tensor containing a single value, use [1] for
the tensor dimensions" (wasi-nn's ``tensor-dimensions``, seed 003).

A model's scalar input is rank 0 (ONNX ``f32[]``), so a guest that follows the spec and
gives its one value with dimensions ``[1]`` would be refused by the backend's shape
check (``input 'x' has shape [1] but the model expects x: f32[]``). Both guest ABIs
therefore read a one-value ``[1]`` tensor given for an input the model declares of rank
0 as that scalar; ``[]`` is taken as well. Nothing else is reshaped: an input of another
rank, or of a rank the model does not declare (TorchScript's), gets the dimensions the
guest gave. Outputs keep the model's shape: a scalar output has dimensions ``[]``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from wasinn.backends.base import TensorSpec
from wasinn.tensor import Tensor


def reads_as_scalar(dims: Sequence[int], spec: TensorSpec) -> bool:
    """Whether a tensor of ``dims`` given for ``spec`` is the spec's single value for a
    declared scalar (rank 0) input."""
    return spec.rank_known and not spec.shape and tuple(dims) == (1,)


def as_scalar(tensor: Tensor, specs: Sequence[TensorSpec], name: str,
              aliases: Mapping[str, int]) -> Tensor:
    """``tensor``, given for input ``name`` of ``specs`` (its name, or one of its
    ``aliases``: another name it answers to, to its position), as a rank-0 tensor where
    it is the spec's single value for a scalar input (:func:`reads_as_scalar`), else
    itself."""
    spec = next((spec for spec in specs if spec.name == name), None)
    if spec is None and 0 <= (position := aliases.get(name, -1)) < len(specs):
        spec = specs[position]
    if spec is not None and reads_as_scalar(tensor.dims, spec):
        return Tensor((), tensor.type, array=tensor.numpy().reshape(()))
    return tensor
