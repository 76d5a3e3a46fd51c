"""Chained pipelines: models run one after another on one device, intermediates kept there.

A pipeline (``[pipelines.NAME]`` in a config) behaves like a graph: its inputs are the
first step's, its outputs the last step's. A request runs as ONE job on one device actor:
every step is compiled on that actor and each step's outputs are produced with
``keep_on_device=True`` and fed as they are (OrtValue, torch tensor, ov.Tensor) into the
next step, so intermediates never pass through host memory when consecutive steps use the
same backend (on a GPU they stay in device memory). :func:`wasinn.host_copies` counts
every tensor that leaves native form for a host array, a backend's own copy of an output
included: a pipeline's request adds exactly its final outputs brought to the host (none
with ``keep_on_device=True``), none between the steps. When consecutive steps use
different backends, the next library takes the other's value over the same memory where
it can (DLPack; an OpenVINO tensor on the CPU as a view of its memory); where it cannot
(a strided value, device memory it cannot read), the value is materialized through
``Tensor.numpy()``, which is allowed and counted in :func:`wasinn.host_copies`.

Wiring: each step after the first maps the previous step's output names to its own input
names (``wire = { y = "input" }``); it may be omitted when the previous step has exactly
one output and this step exactly one input. Outputs not wired are dropped; an output
feeds one input, and every input is fed exactly once (a mistake names the input). The
first step takes the pipeline's inputs and has no wire.

Batching (``batching`` on the pipeline) merges requests' rows before the first step, so
every step must carry them: a load is refused when any step's inputs, or the outputs it
passes on (the last step's: all of them), fix their first dimension or are scalars.

Loading (``Runtime.load_by_name``) holds each step model as soon as the registry hands it
over and checks the wiring before compiling the steps on the pipeline's device; a load
that fails or is cancelled lets the steps go again, freeing those nobody else holds.

Figures: a request is counted in the pipeline's figures (end to end) and, as an inference
server counts an ensemble's composing models, in each step model's
(:class:`StepsAccount`), so that ``Runtime.model_stats`` and a Prometheus scrape show the
steps at work; its device and its tenant count it once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import trio

from wasinn.actors.batching import Batching, check_batchable
from wasinn.actors.lease import Lease
from wasinn.actors.stats import Outcome, RequestStats
from wasinn.backends.base import TensorSpec, describe_range
from wasinn.enums import ExecutionTarget
from wasinn.errors import InvalidArgumentError
from wasinn.tensor import Tensor

from .graph import Graph
from .model import Inputs, LoadedModel, RunsInFlight
from .placement import Link, Scheduler


def resolve_wiring(name: str, steps: Sequence[LoadedModel],
                   wires: Sequence[Mapping[str, str]],
                   written: Callable[[int], str] | None = None) -> tuple[Link, ...]:
    """For each step after the first, the (previous output, this input) pairs.

    Raises InvalidArgumentError naming the pipeline, the step and what the models have
    (a wire on the first step included: it would be ignored), after ``written(i)``
    where given: where step ``i``'s wire was written (a config file and key).
    """
    def where(i: int) -> str:
        step = f"pipeline {name!r} step {i} ({steps[i].name})"
        return step if written is None else f"{written(i)}: {step}"

    if steps and wires and wires[0]:
        raise InvalidArgumentError(
            f"{where(0)}: wired {dict(wires[0])}, but the first step takes the pipeline's "
            "own inputs: expected no wire")
    links: list[Link] = []
    for i in range(1, len(steps)):
        prev, step = steps[i - 1], steps[i]
        wire = dict(wires[i]) if i < len(wires) else {}
        prev_out = [s.name for s in prev.outputs]
        step_in = [s.name for s in step.inputs]
        here = where(i)
        if not wire:
            if len(prev_out) != 1 or len(step_in) != 1:
                raise InvalidArgumentError(
                    f"{here}: no wiring given and {prev.name} has outputs {prev_out}, "
                    f"{step.name} inputs {step_in}: expected wire = {{ output = \"input\" }}"
                )
            wire = {prev_out[0]: step_in[0]}
        wire = _by_primary_names(here, prev, step, wire)
        for out, inp in wire.items():
            if out not in prev_out:
                raise InvalidArgumentError(
                    f"{here}: wires {out!r}, which {prev.name} does not output: "
                    f"expected one of {prev_out}"
                )
            if inp not in step_in:
                raise InvalidArgumentError(
                    f"{here}: wires into {inp!r}, which {step.name} does not take: "
                    f"expected one of {step_in}"
                )
        outs = {spec.name: spec for spec in prev.outputs}
        ins = {spec.name: spec for spec in step.inputs}
        for out, inp in wire.items():
            why = _incompatible(outs[out], ins[inp])
            if why is not None:
                raise InvalidArgumentError(
                    f"{here}: wires {outs[out].describe()} into {ins[inp].describe()}, "
                    f"but {why}: expected an output {step.name} can take")
        _check_fed_once(here, step, wire)
        links.append(tuple(wire.items()))
    return tuple(links)


def _by_primary_names(here: str, prev: LoadedModel, step: LoadedModel,
                      wire: Mapping[str, str]) -> dict[str, str]:
    """``wire`` with every port under its own name: another name a port answers to
    (TensorFlow's x for x:0, an OpenVINO port's other tensor names) is its own name here.
    InvalidArgumentError for two names of one output wired into different inputs (an
    output feeds one input; one of the wires would otherwise be dropped unsaid)."""
    resolved: dict[str, str] = {}
    written: dict[str, str] = {}
    for out, inp in wire.items():
        primary = _primary(prev.outputs, prev.output_aliases, out)
        target = _primary(step.inputs, step.input_aliases, inp)
        if primary in resolved and resolved[primary] != target:
            raise InvalidArgumentError(
                f"{here}: wires {written[primary]!r} and {out!r}, which are both "
                f"{prev.name}'s output {primary!r}: expected each output wired into one "
                "input")
        resolved[primary] = target
        written.setdefault(primary, out)
    return resolved


def _check_fed_once(here: str, step: LoadedModel, wire: Mapping[str, str]) -> None:
    """InvalidArgumentError naming the inputs of ``step`` that ``wire`` (outputs to
    inputs, by their own names) leaves unfed or feeds more than once."""
    feeders: dict[str, list[str]] = {spec.name: [] for spec in step.inputs}
    for out, inp in wire.items():
        feeders[inp].append(out)
    expected = "expected every input wired exactly once"
    for inp, outs in feeders.items():
        if not outs:
            raise InvalidArgumentError(
                f"{here}: input {inp!r} of {step.name} is not wired: {expected} (wired: "
                f"{dict(wire)}; inputs: {list(feeders)})")
        if len(outs) > 1:
            fed_by = " and ".join(map(repr, outs))
            raise InvalidArgumentError(
                f"{here}: input {inp!r} of {step.name} is wired from {fed_by}: {expected}")


def _primary(specs: Sequence[TensorSpec], aliases: Mapping[str, int], name: str) -> str:
    """The name of the port ``name`` stands for: itself, or the one it is an alias of."""
    position = aliases.get(name)
    return specs[position].name if position is not None else name


def _incompatible(out: TensorSpec, inp: TensorSpec) -> str | None:
    """Why ``out`` can never feed ``inp`` (element types, ranks, fixed dimensions that
    differ, or sizes outside the input's bounds: ``x: f32[1..4, 3]``), or None. Only what
    both declare is compared: a TorchScript model declares neither types nor shapes (its
    specs say ``any`` of unknown rank); an ONNX value declared without a shape still
    declares its type."""
    if out.type_known and inp.type_known and out.type is not inp.type:
        return f"their element types differ ({out.type.value}, {inp.type.value})"
    if not (out.rank_known and inp.rank_known):
        return None
    if len(out.shape) != len(inp.shape):
        return f"their ranks differ ({len(out.shape)}, {len(inp.shape)})"
    for axis, (have, want) in enumerate(zip(out.shape, inp.shape, strict=True)):
        if have is not None and want is not None:
            if have != want:
                return f"dimension {axis} differs ({have}, {want})"
            continue
        (out_low, out_high), (in_low, in_high) = _sizes(out, axis), _sizes(inp, axis)
        if ((out_high is not None and out_high < in_low)
                or (in_high is not None and in_high < out_low)):
            made = str(have) if have is not None else describe_range(out_low, out_high)
            return (f"dimension {axis} is {made} and {inp.name} takes "
                    f"{describe_range(in_low, in_high)} there")
    return None


def _sizes(spec: TensorSpec, axis: int) -> tuple[int, int | None]:
    """The least and most (None: no most) sizes ``spec`` allows in dimension ``axis``."""
    size = spec.shape[axis]
    if size is not None:
        return size, size
    return spec.bounds[axis] if spec.bounds else (0, None)


def check_chain_batchable(name: str, steps: Sequence[LoadedModel],
                          links: Sequence[Link]) -> bool:
    """InvalidArgumentError unless a merged run's rows can pass through every step (see
    :func:`~wasinn.actors.batching.check_batchable`): each step's inputs, and the outputs
    it passes on (the last step's: all of them), must have a variable first dimension,
    the inputs' batch axis. Outputs a step does not wire on are dropped, so they may be
    anything. Whether every step's declared shapes show those outputs batch-major."""
    declared = True
    for i, step in enumerate(steps):
        outputs = step.outputs
        if i < len(links):  # links[i] feeds step i + 1 from step i
            passed = {out for out, _ in links[i]}
            outputs = tuple(spec for spec in outputs if spec.name in passed)
        declared = check_batchable(f"pipeline {name!r} step {i} ({step.name})",
                                   step.inputs, outputs, step.declared_dims()) and declared
    return declared


class StepsAccount:
    """Where a pipeline's requests are counted (an :class:`~wasinn.actors.stats.Account`):
    in ``pipeline``, the pipeline's figures, end to end; and, as an inference server
    counts an ensemble's composing models, each step's run as a request of the step's
    model, in ``steps`` (its step models' figures; a model that is two of its steps
    counts both runs). The chain's job counts those runs as it makes them
    (:meth:`~wasinn.actors.stats.RequestStats.record_run`): a run that returned as
    completed, its latency that run's (none queued: the pipeline's request did) and its
    time in ``running_seconds`` (the device's time); a run that raised as failed.
    Each request is counted once in each step it reached, by the run that answered it
    (:class:`~wasinn.actors.stats.MergedRun`): a merged run counts as the requests given
    its rows, with one latency (one run) and its time once. The probe's run of one member
    alone (the first merged run of an input signature, for a pipeline whose steps do not
    declare their outputs batch-major) answers that member, and counts it, as does each
    run alone after a merged run failed or could not be split, while such a merged run
    counts no request (neither completed nor failed: it answered nobody) but its time,
    which the device spent: so the steps' ``running_seconds`` stays within the
    pipeline's, the device's, which has the whole job, and their latencies are those of
    runs that answered requests. The merged run is a batch of the requests its batch
    answered, as for the pipeline and the device (this account's :meth:`record_batch`).
    A step its pipeline's request never reached (rejected, timed out or cancelled before
    it, or after an earlier step failed) counts nothing; the device and the tenant count
    the request once."""

    __slots__ = ("pipeline", "steps")

    def __init__(self, pipeline: RequestStats, steps: Sequence[RequestStats]) -> None:
        self.pipeline = pipeline
        self.steps = tuple(steps)

    def record(self, outcome: Outcome, seconds: float, *, queued: float = 0.0,
               delivering: float = 0.0, leased: bool = False, share: float = 1.0) -> None:
        self.pipeline.record(outcome, seconds, queued=queued, delivering=delivering,
                             leased=leased, share=share)

    def record_batch(self, requests: int) -> None:
        self.pipeline.record_batch(requests)
        for step in self.steps:
            step.record_batch(requests)


class PipelineModel:
    """The executable behind a :class:`Pipeline`: step models plus their wiring."""

    __slots__ = ("account", "batch_major", "batching", "in_flight", "input_aliases", "inputs",
                 "links", "name", "output_aliases", "outputs", "refs", "released",
                 "requests", "scheduler", "steps")

    def __init__(self, name: str, steps: Sequence[LoadedModel], links: Sequence[Link],
                 scheduler: Scheduler, *, batching: Batching | None = None) -> None:
        if not steps:
            raise InvalidArgumentError(f"pipeline {name!r} has no steps: expected at least one")
        #: Whether its steps declare the outputs they pass on batch-major (see LoadedModel).
        self.batch_major = batching is not None and check_chain_batchable(name, steps, links)
        self.name = name
        self.steps = tuple(steps)
        self.links = tuple(links)  # resolve_wiring's
        self.inputs = self.steps[0].inputs
        self.outputs = self.steps[-1].outputs
        self.input_aliases = self.steps[0].input_aliases
        self.output_aliases = self.steps[-1].output_aliases
        self.scheduler = scheduler
        self.refs = 0
        self.released = False
        #: The pipeline's requests (each runs every step as one job).
        self.requests = RequestStats()
        #: Where they are counted: there, and in each step model's (see StepsAccount).
        self.account = StepsAccount(self.requests, [step.requests for step in self.steps])
        #: How its requests are merged on a device (None: never), whatever its steps'.
        self.batching = batching
        self.in_flight = RunsInFlight()
        self.in_flight.changed = scheduler.runs_changed
        for step in self.steps:
            step.retain()

    def backend_for(self, target: ExecutionTarget) -> str:
        return "+".join(dict.fromkeys(step.backend_for(target) for step in self.steps))

    @property
    def placed_on(self) -> set[ExecutionTarget]:
        # Its requests compile every step where they run (those of a step shared with
        # another graph count, though the pipeline may never have run there).
        return set().union(*(step.placed_on for step in self.steps))

    def retain(self) -> None:
        self.refs += 1

    def release(self) -> None:
        self.refs -= 1
        if self.refs == 0 and not self.released:
            self.released = True
            for step in self.steps:
                step.release()

    def waited_for(self) -> list[str]:
        if self.refs > self.in_flight.requests:
            return []  # a handle or a context keeps it loaded
        what = self.in_flight.waiting()
        if self.released:  # (its steps that nobody else holds are freed too)
            what += [f"step {step.name!r}: {each}" for step in self.steps
                     for each in step.waited_for()]
        return what

    async def execute(self, target: ExecutionTarget, inputs: Inputs, *, priority: int,
                      deadline: float, tenant: str, keep_on_device: bool | None
                      ) -> dict[str, Tensor]:
        return await self.scheduler.run_chain(self.name, self.steps, self.links, target,
                                              inputs, priority=priority, deadline=deadline,
                                              tenant=tenant, keep_on_device=keep_on_device,
                                              account=self.account, batching=self.batching,
                                              batch_major=self.batch_major)

    async def lease(self, target: ExecutionTarget, inputs: Inputs, *, priority: int,
                    deadline: float, tenant: str, keep_on_device: bool | None
                    ) -> Lease[dict[str, Tensor]]:
        lease = await self.scheduler.lease_chain(
            self.name, self.steps, self.links, target, inputs, priority=priority,
            deadline=deadline, tenant=tenant, keep_on_device=keep_on_device,
            account=self.account, batching=self.batching, batch_major=self.batch_major)
        self.in_flight.lent(lease)
        return lease

    @property
    def trio_token(self) -> trio.lowlevel.TrioToken | None:
        return self.scheduler.trio_token

    def try_lease(self, target: ExecutionTarget, inputs: Inputs, *, timeout: float | None,
                  tenant: str, keep_on_device: bool | None
                  ) -> Lease[dict[str, Tensor]] | None:
        if self.released:
            return None
        lease = self.scheduler.try_lease_chain(self.name, self.steps, self.links, target,
                                               inputs, timeout=timeout, tenant=tenant,
                                               keep_on_device=keep_on_device,
                                               account=self.account, batching=self.batching)
        if lease is not None:
            self.in_flight.lent(lease)
        return lease


class Pipeline(Graph):
    """A graph-like handle on a pipeline: ``inputs`` of the first step, ``outputs`` of the
    last; ``init_execution_context``, ``compute`` and ``unload`` work as on a Graph."""

    __slots__ = ()

    @property
    def steps(self) -> tuple[str, ...]:
        """The names of the step models, in order."""
        executable = self._executable
        assert isinstance(executable, PipelineModel)
        return tuple(step.name for step in executable.steps)
