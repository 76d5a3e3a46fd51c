"""Preloading and warming up registered models and pipelines when a runtime starts.

``preload = true`` on a ``[models.NAME]`` or ``[pipelines.NAME]`` table loads it while the
runtime starts instead of on the first ``load_by_name``, compiles it on every device of
its target (a pipeline: every step), and keeps it loaded for the runtime's lifetime, as
``resident`` does. A missing or unreadable file then fails the start, naming the model,
instead of the first request that asks for it.

``warmup = N`` (implies ``preload``) then runs it N times on each of those devices on
zero-filled inputs, so that the first real request does not pay for what a backend does
on its first run (allocating its memory arena, choosing kernels; TorchScript profiles and
optimises the graph on its first calls). An input's shape is the model's, dynamic
dimensions as 1 (a scalar input gets a scalar), or the one ``warmup_inputs`` gives
(``[]`` for a scalar): it must give every input whose rank the model does not declare
(a TorchScript module declares none). An input's element type is the model's; where the
model declares none (TorchScript), it is f32 unless ``warmup_inputs`` gives one
(``ids = { shape = [1, 8], type = "i64" }``), and a warm-up that then fails says so. A
type given for an input the model declares another type for fails the start, as do
zeros that take more than the memory available (checked before they are made, see
:mod:`wasinn._memory`). Warm-ups run in the device's compile threads (no worker
thread, no request slot), and they are not requests: a device's stats count them only
in ``warm_ups``, so they do not skew its latency percentiles.

Everything is preloaded concurrently; when something fails, the start fails with the
first failure in config order (the others are logged), raised as the same error type
with the name in front of its message. A failed warm-up run's error says on which
device and on what zeros it ran, which of a pipeline's steps failed (as a request's
error does: ``pipeline 'p' step 1 ('m', fed by step 0): ...``) and, where
``warmup_inputs`` gave them, where that is written (``FILE: pipelines.p.warmup_inputs``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import trio

from wasinn._groups import collapsed_groups
from wasinn._memory import available_memory
from wasinn.backends.base import TensorSpec
from wasinn.enums import TensorType
from wasinn.errors import (
    BackendRuntimeError,
    InvalidArgumentError,
    TooLargeError,
    UnknownError,
    UnsupportedOperationError,
    WasiNNError,
)
from wasinn.tensor import Tensor, numpy_dtype

from ._jobs import Named
from .model import LoadedModel
from .names import NameRegistry
from .pipeline import PipelineModel
from .placement import Link, Scheduler

log = logging.getLogger("wasinn.scheduler")


@dataclasses.dataclass(frozen=True)
class ZeroInput:
    """How one input's zero-filled value is made: of this ``shape`` (None: the model's),
    and of this element ``type`` (None: the model's; f32 where the model declares none)."""

    shape: tuple[int, ...] | None = None
    type: TensorType | None = None


class WarmUp(NamedTuple):
    """What to do at start for one name: ``runs`` warm-up runs per device (0: only
    preload), on inputs of these ``shapes`` (and types) where given; ``key``: where they
    are written (``FILE: models.NAME.warmup_inputs``), for their errors."""

    runs: int = 0
    shapes: Mapping[str, ZeroInput | tuple[int, ...]] = {}
    key: str = ""


#: How a config gives the shape of an input that declares none (``{name}``: the input).
WARMUP_SHAPE_HINT = "give it in warmup_inputs (e.g. {name} = [1, 3, 224, 224])"
#: How a config gives the element type of an input that declares none (``{name}``: the
#: input, ``{shape}``: its shape as a list, ``{dims}``: as D,D,...).
WARMUP_TYPE_HINT = 'give it in warmup_inputs (e.g. {name} = {{ shape = {shape}, type = "i64" }})'
#: The failures of a run that an input of the wrong element type may cause.
_TYPE_FAILURES = (InvalidArgumentError, BackendRuntimeError, UnsupportedOperationError,
                  UnknownError)


def type_conflict(spec: TensorSpec, type_: TensorType) -> str | None:
    """Why input ``spec`` cannot be given element type ``type_`` (None: it can, the model
    declaring that type or none)."""
    if not spec.type_known or spec.type is type_:
        return None
    return (f"type {type_.value} given, but the model declares {spec.describe()}: expected "
            f"{spec.type.value}, or no type (the model's)")


def zero_inputs(specs: Sequence[TensorSpec],
                shapes: Mapping[str, ZeroInput | tuple[int, ...]],
                *, shape_hint: str = WARMUP_SHAPE_HINT) -> dict[str, Tensor]:
    """A zero-filled tensor for every input in ``specs``: of the shape ``shapes`` gives
    (a shape, or a :class:`ZeroInput` of shape and type), else of the input's own,
    dynamic dimensions as 1 or the least their bounds allow (rank 0 for a scalar input);
    of the type given, else of the input's (f32 for one of undeclared type,
    ``type_known=False``).

    Raises InvalidArgumentError for a name in ``shapes`` that is no input, for a type
    given where the model declares another, and for an input whose rank is unknown
    (``rank_known=False``) and whose shape is not given (``shape_hint`` says how to give
    it); TooLargeError for a value too large to allocate: beyond numpy's bounds, or
    taking, with those made before it, more than the memory available (checked before
    allocating, see :mod:`wasinn._memory`).
    """
    names = [spec.name for spec in specs]
    unknown = sorted(set(shapes) - set(names))
    if unknown:
        raise InvalidArgumentError(
            f"warmup_inputs names {', '.join(map(repr, unknown))}, which is not an "
            f"input: expected one of {', '.join(map(repr, names)) or 'none'}")
    inputs = {}
    available, taken = available_memory(), 0
    for spec in specs:
        given = _zero_input(shapes.get(spec.name))
        if given.type is not None and (problem := type_conflict(spec, given.type)):
            raise InvalidArgumentError(f"input {spec.name!r}: {problem}")
        shape = given.shape
        if shape is None:
            if not spec.rank_known:
                raise InvalidArgumentError(
                    f"input {spec.name!r} declares no shape, not even its rank, so no "
                    f"zero-filled value can be made for it: {shape_hint.format(name=spec.name)}")
            shape = _smallest_shape(spec)
        zeros = _zeros(spec, shape, given.type or spec.type, available, taken)
        taken += zeros.nbytes
        inputs[spec.name] = Tensor.from_numpy(zeros)
    return inputs


def _smallest_shape(spec: TensorSpec) -> tuple[int, ...]:
    """``spec``'s shape, a dynamic dimension as 1, or as the least its bounds allow where
    that is more (an OpenVINO ``[2..8, 3]`` gives ``(2, 3)``)."""
    if not spec.bounds:
        return tuple(1 if d is None else d for d in spec.shape)
    return tuple(max(1, low) if d is None else d
                 for d, (low, _) in zip(spec.shape, spec.bounds, strict=True))


def _zero_input(given: ZeroInput | tuple[int, ...] | None) -> ZeroInput:
    # A shape alone as a ZeroInput; nothing given: the model's shape and type.
    if isinstance(given, ZeroInput):
        return given
    return ZeroInput(None if given is None else tuple(given))


def untyped_hint(specs: Sequence[TensorSpec], inputs: Mapping[str, Tensor],
                 shapes: Mapping[str, ZeroInput | tuple[int, ...]],
                 type_hint: str = WARMUP_TYPE_HINT) -> str:
    """What to add to the error of a failed run on zero-filled ``inputs`` where an input
    of undeclared element type got f32 zeros, no type being given for it in ``shapes``:
    that the model declares none, and how to give one (``type_hint``); "" where none
    did."""
    untyped = [spec.name for spec in specs
               if not spec.type_known and spec.name in inputs
               and _zero_input(shapes.get(spec.name)).type is None]
    if not untyped:
        return ""
    first = inputs[untyped[0]]
    dims = list(first.dims)
    how = type_hint.format(name=untyped[0], shape=dims, dims=",".join(map(str, dims)))
    which = (f"input {untyped[0]!r}, so its zeros were" if len(untyped) == 1 else
             f"inputs {', '.join(map(repr, untyped))}, so their zeros were")
    return (f"; the model declares no element type for {which} {first.type.value}: "
            f"if it takes another type, {how}")


def hinted(exc: WasiNNError, hint: str) -> WasiNNError:
    """``exc`` with ``hint`` (see :func:`untyped_hint`) after its message where the
    failure may come from an input's element type (not a timeout, nor a cancellation)."""
    if not hint or not isinstance(exc, _TYPE_FAILURES):
        return exc
    return exc.retold(exc.message + hint)


def _zeros(spec: TensorSpec, shape: tuple[int, ...], type_: TensorType, available: int,
           taken: int) -> np.ndarray[Any, Any]:
    # Zeros for input ``spec`` where ``available`` bytes of memory are, ``taken`` of them
    # by the zeros made before. Checked first: where the kernel overcommits, np.zeros of
    # any size succeeds and the process dies once the pages are touched (wasinn._memory).
    dtype = numpy_dtype(type_)
    size = math.prod(shape) * dtype.itemsize

    def too_large(why: object) -> TooLargeError:
        return TooLargeError(
            f"input {spec.name!r}: a zero-filled {type_.value} value of shape "
            f"{list(shape)} takes {size:,} bytes, which cannot be allocated here ({why}): "
            f"expected a smaller shape")

    if size > available - taken:
        before = f", {taken:,} of them taken by the zero-filled inputs before it" if taken else ""
        raise too_large(f"{available:,} bytes of memory are available now{before}")
    try:
        return np.zeros(shape, dtype)
    except (ValueError, MemoryError) as exc:  # beyond numpy's bounds, or a memory limit
        raise too_large(exc) from exc


async def preload(registry: NameRegistry, scheduler: Scheduler,
                  plan: Mapping[str, WarmUp]) -> None:
    """Load every name in ``plan`` through ``registry``,
    compile it on every device of its target and warm it up there (see the module).

    Raises the first failure in ``plan``'s order, retyped with the name in its message;
    anything else (a KeyboardInterrupt meanwhile) as itself, not in an exception group,
    unless two such came together (:mod:`wasinn._groups`).
    """
    failures: dict[str, WasiNNError] = {}

    async def prepare(name: str, warm: WarmUp) -> None:
        try:
            await _prepare(registry, scheduler, name, warm)
        except WasiNNError as exc:
            failures[name] = exc

    with collapsed_groups():  # (a Ctrl-C meanwhile, or a bug's error, as itself)
        async with trio.open_nursery() as nursery:
            for name, warm in plan.items():
                nursery.start_soon(prepare, name, warm)
    failed = [(name, failures[name]) for name in plan if name in failures]
    if not failed:
        return
    for name, exc in failed[1:]:
        log.error("preloading %r failed too: %s", name, exc.message)
    name, exc = failed[0]
    raise exc.prefixed(f"preloading {name!r}")


async def _prepare(registry: NameRegistry, scheduler: Scheduler, name: str,
                   warm: WarmUp) -> None:
    executable, target = await registry.get(name)
    kind = scheduler.resolve_target(target)
    models: Sequence[LoadedModel]
    links: Sequence[Link]
    named: Named | None = None
    if isinstance(executable, PipelineModel):
        models, links = executable.steps, executable.links
        named = (name, models)  # (a step's failure names the step, as a request's does)
    else:
        assert isinstance(executable, LoadedModel)
        models, links = (executable,), ()
    try:
        inputs = zero_inputs(executable.inputs, warm.shapes) if warm.runs else {}
    except WasiNNError as exc:
        raise (exc.prefixed(warm.key) if warm.key else exc) from exc
    for actor in scheduler.actors_of(kind):
        job = await scheduler.chain_on(actor, models, links, inputs, named=named)
        for _ in range(warm.runs):
            try:
                await actor.warm_up(job, label=f"warm-up of {name}")
            except WasiNNError as exc:
                given = ", ".join(f"{k}: {v.type.value}{list(v.dims)}" for k, v in inputs.items())
                hint = untyped_hint(executable.inputs, inputs, warm.shapes)
                failed = hinted(exc, hint).prefixed(
                    f"{actor.device}: the warm-up run on zero-filled inputs ({given}; dynamic "
                    "dimensions as 1 unless warmup_inputs gives them) failed")
                # Shapes or types given in the config: say where, as its other errors do.
                raise (failed.prefixed(warm.key) if warm.key and warm.shapes
                       else failed) from exc
