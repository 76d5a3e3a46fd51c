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
(a TorchScript module declares none). Warm-ups run in the device's compile threads (no
worker thread, no request slot), and they are not requests: a device's stats count them
only in ``warm_ups``, so they do not skew its latency percentiles.

Everything is preloaded concurrently; when something fails, the start fails with the
first failure in config order (the others are logged), raised as the same error type
with the name in front of its message.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import trio

from wasinn.backends.base import TensorSpec
from wasinn.errors import InvalidArgumentError, TooLargeError, WasiNNError
from wasinn.tensor import Tensor, numpy_dtype

from .model import LoadedModel
from .names import NameRegistry
from .pipeline import PipelineModel
from .placement import Link, Scheduler

log = logging.getLogger("wasinn.scheduler")


class WarmUp(NamedTuple):
    """What to do at start for one name: ``runs`` warm-up runs per device (0: only
    preload), on inputs of these ``shapes`` where given; ``key``: where the shapes are
    written (``FILE: models.NAME.warmup_inputs``), for their errors."""

    runs: int = 0
    shapes: Mapping[str, tuple[int, ...]] = {}
    key: str = ""


#: How a config gives the shape of an input that declares none (``{name}``: the input).
WARMUP_SHAPE_HINT = "give it in warmup_inputs (e.g. {name} = [1, 3, 224, 224])"


def zero_inputs(specs: Sequence[TensorSpec], shapes: Mapping[str, tuple[int, ...]],
                *, shape_hint: str = WARMUP_SHAPE_HINT) -> dict[str, Tensor]:
    """A zero-filled tensor for every input in ``specs``: of the shape ``shapes`` gives,
    else of the input's own, dynamic dimensions as 1 (rank 0 for a scalar input).

    Raises InvalidArgumentError for a name in ``shapes`` that is no input, and for an
    input whose rank is unknown (``rank_known=False``) and whose shape is not given
    (``shape_hint`` says how to give it).
    """
    names = [spec.name for spec in specs]
    unknown = sorted(set(shapes) - set(names))
    if unknown:
        raise InvalidArgumentError(
            f"warmup_inputs names {', '.join(map(repr, unknown))}, which is not an "
            f"input: expected one of {', '.join(map(repr, names)) or 'none'}")
    inputs = {}
    for spec in specs:
        shape = shapes.get(spec.name)
        if shape is None:
            if not spec.rank_known:
                raise InvalidArgumentError(
                    f"input {spec.name!r} declares no shape, not even its rank, so no "
                    f"zero-filled value can be made for it: {shape_hint.format(name=spec.name)}")
            shape = tuple(1 if d is None else d for d in spec.shape)
        inputs[spec.name] = Tensor.from_numpy(_zeros(spec, shape))
    return inputs


def _zeros(spec: TensorSpec, shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
    dtype = numpy_dtype(spec.type)
    try:
        return np.zeros(shape, dtype)
    except (ValueError, MemoryError) as exc:  # beyond numpy's bounds, or this host's memory
        size = math.prod(shape) * dtype.itemsize
        raise TooLargeError(
            f"input {spec.name!r}: a zero-filled {spec.type.value} value of shape "
            f"{list(shape)} takes {size:,} bytes, which cannot be allocated here ({exc}): "
            f"expected a smaller shape") from exc


async def preload(registry: NameRegistry, scheduler: Scheduler,
                  plan: Mapping[str, WarmUp]) -> None:
    """Load every name in ``plan`` through ``registry``,
    compile it on every device of its target and warm it up there (see the module).

    Raises the first failure in ``plan``'s order, retyped with the name in its message.
    """
    failures: dict[str, WasiNNError] = {}

    async def prepare(name: str, warm: WarmUp) -> None:
        try:
            await _prepare(registry, scheduler, name, warm)
        except WasiNNError as exc:
            failures[name] = exc

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
    if isinstance(executable, PipelineModel):
        models, links = executable.steps, executable.links
    else:
        assert isinstance(executable, LoadedModel)
        models, links = (executable,), ()
    try:
        inputs = zero_inputs(executable.inputs, warm.shapes) if warm.runs else {}
    except WasiNNError as exc:
        raise (exc.prefixed(warm.key) if warm.key else exc) from exc
    for actor in scheduler.actors_of(kind):
        job = await scheduler.chain_on(actor, models, links, inputs)
        for _ in range(warm.runs):
            try:
                await actor.warm_up(job, label=f"warm-up of {name}")
            except WasiNNError as exc:
                given = ", ".join(f"{k}: {v.type.value}{list(v.dims)}" for k, v in inputs.items())
                raise exc.prefixed(
                    f"{actor.device}: the warm-up run on zero-filled inputs ({given}; dynamic "
                    "dimensions as 1 unless warmup_inputs gives them) failed") from exc
