"""What a sandboxed graph's process says of the model it loaded, checked by the host (see
:mod:`.sandbox`).

The process answers a load with the model's inputs and outputs (``[name, type, dims,
rank_known]`` each, the type null where the model declares none, and a fifth element,
``bounds``, where the model limits the sizes of its dynamic dimensions), their other names
(aliases, by position) and whether its output types hold, in JSON
(:func:`._sandbox_child._specs`). The host believes none of it unchecked: a library bug
that let a model run code in the process could make it answer anything, and what it
answers becomes the graph's :class:`~.base.TensorSpec` s, which size the arena
(:func:`reserve`) and check every run's inputs and outputs. So :func:`read_specs` takes
only what an in-process graph could declare: a name (a str, each input's and each
output's its own), one of wasi-nn's element types or null (none declared, as
TorchScript's: a spec with ``type_known=False``), at most
:data:`~wasinn.tensor.MAX_RANK` dimensions, each null (dynamic) or an integer from 0 to
:data:`MAX_DIM` (JSON's ``Infinity``, a float, a bool or a negative number is none), no
dimension for a spec of unknown rank, bounds (where given) that are one ``[low, high]``
per dimension, each an integer from 0 to :data:`MAX_DIM` or ``high`` null (no upper
bound), ``low <= high``, a fixed dimension's ``[size, size]``, aliases that name a
position there is, and a boolean flag; ValueError naming what is wrong otherwise.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from wasinn.enums import TensorType
from wasinn.errors import quoted
from wasinn.tensor import MAX_RANK

from .base import TensorSpec

#: The largest dimension a process may declare: ONNX's and OpenVINO's are int64.
MAX_DIM = 2**63 - 1


@dataclasses.dataclass(frozen=True)
class ModelSpecs:
    """What a process said of the model it loaded, checked (see the module docstring)."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    input_aliases: Mapping[str, int]
    output_aliases: Mapping[str, int]
    output_types_declared: bool


def read_specs(payload: Mapping[str, Any]) -> ModelSpecs:
    """The model's specs in a load's reply, checked (see the module docstring): ValueError
    naming the first thing that is wrong (a key missing included)."""
    inputs = _specs(payload, "inputs")
    outputs = _specs(payload, "outputs")
    flag = _field(payload, "output_types_declared")
    if not isinstance(flag, bool):
        raise ValueError(f"output_types_declared {flag!r:.40}: expected true or false")  # noqa: TRY004
    return ModelSpecs(inputs, outputs, _aliases(payload, "input_aliases", len(inputs)),
                      _aliases(payload, "output_aliases", len(outputs)), flag)


def reserve(specs: Sequence[TensorSpec], most: int, align: int) -> int:
    """The bytes to reserve in the arena for a run's outputs of ``specs``: those of the
    outputs whose shape is static, each placed at a multiple of ``align``, and ``most``
    at most (the memory the process may hold: an output declared larger cannot be
    computed, and would only have the host map a file that large)."""
    total = sum(nbytes + align for nbytes in map(static_nbytes, specs) if nbytes <= most)
    return min(total, most)


def static_nbytes(spec: TensorSpec) -> int:
    """The bytes a tensor of ``spec`` takes, where its shape is known (else 0)."""
    dims = [d for d in spec.shape if d is not None]
    if not (spec.rank_known and spec.type_known) or len(dims) != len(spec.shape):
        return 0
    return math.prod(dims) * spec.type.itemsize


def _field(payload: Mapping[str, Any], key: str) -> Any:
    if key not in payload:
        raise ValueError(f"no {key}")
    return payload[key]


def _specs(payload: Mapping[str, Any], key: str) -> tuple[TensorSpec, ...]:
    entries = _field(payload, key)
    if not isinstance(entries, list):
        raise ValueError(f"{key} {entries!r:.80}: expected a list")  # noqa: TRY004
    specs = tuple(_spec(entry, f"{key[:-1]} {i}") for i, entry in enumerate(entries))
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        twice = next(name for name in names if names.count(name) > 1)
        raise ValueError(f"{key[:-1]} {quoted(twice)} declared twice: expected each "
                         f"{key[:-1]} to have a name of its own")
    return specs


def _spec(entry: object, what: str) -> TensorSpec:
    if not (isinstance(entry, list) and len(entry) in (4, 5) and isinstance(entry[0], str)
            and isinstance(entry[2], list) and isinstance(entry[3], bool)):
        raise ValueError(f"{what} {entry!r:.80}: expected [name, type, dims, rank_known] "
                         "or [name, type, dims, rank_known, bounds]")
    name, type_, dims, rank_known, *said = entry
    what = f"{what} {quoted(name)}"
    try:
        # null: the model declares no type (the spec's f32 is a placeholder)
        ttype = TensorType.F32 if type_ is None else TensorType(type_)
    except ValueError:
        raise ValueError(f"{what} of type {type_!r:.40}: expected one of "
                         f"{', '.join(t.value for t in TensorType)} or null "
                         "(undeclared)") from None
    if len(dims) > MAX_RANK:
        raise ValueError(f"{what} of {len(dims)} dimensions: expected at most {MAX_RANK}")
    for d in dims:
        if d is not None and not _is_dim(d):
            raise ValueError(f"{what} of dimension {d!r:.40}: expected null (dynamic) or "
                             f"an integer from 0 to {MAX_DIM}")
    if not rank_known and dims:
        raise ValueError(f"{what} of dimensions {dims!r:.80} but of unknown rank: expected "
                         "no dimension")
    bounds = _bounds(said[0], dims, what) if said else ()
    return TensorSpec(name, ttype, tuple(dims), rank_known, type_known=type_ is not None,
                      bounds=bounds)


def _bounds(said: object, dims: list[int | None], what: str
            ) -> tuple[tuple[int, int | None], ...]:
    """The bounds ``said`` of a spec of ``dims`` (checked: see the module docstring)."""
    if not (isinstance(said, list) and len(said) == len(dims)):
        raise ValueError(f"{what} of bounds {said!r:.80}: expected a list of {len(dims)} "
                         "[low, high], one per dimension")
    bounds: list[tuple[int, int | None]] = []
    for axis, (size, pair) in enumerate(zip(dims, said, strict=True)):
        if not (isinstance(pair, list) and len(pair) == 2 and _is_dim(pair[0])
                and (pair[1] is None or (_is_dim(pair[1]) and pair[0] <= pair[1]))):
            raise ValueError(f"{what} of bound {pair!r:.40} in dimension {axis}: expected "
                             f"[low, high], integers from 0 to {MAX_DIM}, low <= high, or "
                             "[low, null] (no upper bound)")
        if size is not None and pair != [size, size]:
            raise ValueError(f"{what} of bound {pair!r:.40} in dimension {axis}, of fixed "
                             f"size {size}: expected [{size}, {size}]")
        bounds.append((pair[0], pair[1]))
    return tuple(bounds)


def _is_dim(value: object) -> bool:
    """Whether ``value`` is a size a dimension may have (not a bool, a float, ...)."""
    return type(value) is int and 0 <= value <= MAX_DIM


def _aliases(payload: Mapping[str, Any], key: str, count: int) -> Mapping[str, int]:
    aliases = _field(payload, key)
    if not isinstance(aliases, dict):
        raise ValueError(f"{key} {aliases!r:.80}: expected an object")  # noqa: TRY004
    for name, index in aliases.items():
        if not (type(index) is int and 0 <= index < count):
            raise ValueError(f"{key[:-8]} alias {quoted(name)} of position {index!r:.40}: "
                             f"expected one from 0 to {count - 1}" if count else
                             f"{key[:-8]} alias {quoted(name)}: expected none, the model "
                             f"has no {key[:-8]}")
    return MappingProxyType(dict(aliases))
