"""What a wasinn config may say, validated with pydantic.

A config has five tables::

    [runtime]                      # backends = preference order; fallback = a target kind
    [pools.NAME]                   # one pool per device kind: kind, devices, workers,
                                   # queue_limit, backends (this pool's preference order),
                                   # policy, inline_below_us
    [models.NAME]                  # files (relative to the config file), encoding, target,
                                   # backend, precision, threads, options, resident,
                                   # preload, warmup, warmup_inputs, batching
    [pipelines.NAME]               # steps = [{ model = "...", wire = { out = "in" } }, ...],
                                   # target, preload, warmup, warmup_inputs, batching
    [guests]                       # per-guest limits: max_graphs, max_contexts,
                                   # max_model_bytes, max_tensor_bytes, allowed_targets,
                                   # compute_timeout

Unknown keys are errors (a typo must not be ignored silently). Names of models and
pipelines are looked up, never used as paths; model files must lie inside the config's
directory unless the config gives an absolute path (checked by the loader, which knows the
directory).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from wasinn.actors.batching import Batching
from wasinn.backends.base import Device
from wasinn.enums import ExecutionTarget, GraphEncoding
from wasinn.errors import InvalidArgumentError


def _target(value: str) -> str:
    try:
        return ExecutionTarget.coerce(value).value
    except InvalidArgumentError as exc:
        raise ValueError(exc.message) from None


def _encoding(value: str) -> str:
    try:
        return GraphEncoding.coerce(value).value
    except InvalidArgumentError as exc:
        raise ValueError(exc.message) from None


def _device(value: str) -> str:
    try:
        return Device.parse(value).name
    except (InvalidArgumentError, ValueError) as exc:
        raise ValueError(
            f"{value!r} is not a device: expected cpu, gpu, gpu:N, tpu:N or npu:N ({exc})"
        ) from None


TargetName = Annotated[str, AfterValidator(_target)]
EncodingName = Annotated[str, AfterValidator(_encoding)]
DeviceName = Annotated[str, AfterValidator(_device)]
#: Model and pipeline names: looked up as keys, so plain identifiers only.
Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$", max_length=128)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RuntimeSection(_Strict):
    """``[runtime]``: runtime-wide settings."""

    #: Backend preference order for every pool that names none (empty = wasinn's default).
    backends: list[str] = Field(default_factory=list)
    #: Where a target with no device here runs instead (with a warning); None = refuse.
    fallback: TargetName | None = None


class PoolConfig(_Strict):
    """``[pools.NAME]``: the devices of one kind and how each is driven."""

    kind: Literal["cpu", "gpu", "tpu"]
    #: "auto" = every device of this kind the installed backends report.
    devices: Literal["auto"] | list[DeviceName] = "auto"
    #: Worker threads per device (requests running at once on one device). Backends
    #: already use every core for one inference, so 1 is the default.
    workers: int = Field(default=1, ge=1, le=256)
    #: Requests allowed to wait per device before callers get too-large.
    queue_limit: int = Field(default=1024, ge=1)
    #: Backend preference order on this pool (empty = [runtime] backends).
    backends: list[str] = Field(default_factory=list)
    #: Which waiting request runs next: "priority" (priority, then deadline, then
    #: arrival) or "fair" (tenants in turn, priority order within each tenant).
    policy: Literal["priority", "fair"] = "priority"
    #: Opt-in (0, the default, = never inline). Graphs whose runs on this pool's devices
    #: took less than this many microseconds (moving average, after a few timed runs,
    #: for inputs no larger than those timed) run inline on the event loop when the
    #: device is idle and the request has no deadline, instead of through a worker
    #: thread: no thread hand-off, at the price of holding the loop for the whole run.
    #: The bound predicts from past runs, it does not limit: a run whose time depends on
    #: its input values (an ONNX Loop's trip count) can block the loop, and every other
    #: request, timeout and cancellation, for seconds. A run over 4x the bound sends the
    #: graph back to the worker threads. Enable only for graphs whose run time is
    #: bounded whatever their inputs.
    inline_below_us: float = Field(default=0.0, ge=0, le=10_000)
    #: Seconds closing the runtime waits for each device's running jobs once it has
    #: cancelled them. ONNX Runtime and OpenVINO runs stop within milliseconds; a call
    #: that ignores cancellation (torch, an OpenVINO Loop node) may not: past this, an
    #: error names the device and its jobs still running, and the close returns anyway,
    #: leaving those threads (daemons) and the graphs they use to end on their own.
    close_timeout: float = Field(default=10.0, ge=0)

    @model_validator(mode="after")
    def _devices_of_kind(self) -> PoolConfig:
        if self.devices != "auto":
            for name in self.devices:
                if Device.parse(name).kind.value != self.kind:
                    raise ValueError(f"device {name!r} is not a {self.kind} device")
        return self


class BatchingConfig(_Strict):
    """``batching = { max_batch = 8, max_delay_ms = 2 }`` in a model's or pipeline's
    table: its requests waiting for the same device at the same time run as one batch
    (see :mod:`wasinn.actors.batching`)."""

    #: The most rows one merged run takes.
    max_batch: int = Field(ge=2, le=65_536)
    #: How long a batch holding a slot waits for more requests before it runs (0: never
    #: waits; only requests that queued while the device was busy are merged).
    max_delay_ms: float = Field(default=0.0, ge=0, le=10_000)

    def spec(self) -> Batching:
        return Batching(self.max_batch, self.max_delay_ms / 1e3)


class _Startup(_Strict):
    """What models and pipelines share: whether the runtime readies them as it starts
    (see :mod:`wasinn.scheduler.warmup`), and how their requests are batched."""

    #: Load it when the runtime starts, compiled on every device of its target, and keep
    #: it loaded (as ``resident``): a bad file fails the start, not the first request.
    preload: bool = False
    #: Runs on zero-filled inputs (dynamic dimensions as 1) on each of those devices at
    #: start, so the first request finds the backend's first-run work done. Implies
    #: ``preload``.
    warmup: int = Field(default=0, ge=0, le=100)
    #: Shapes of the warm-up inputs by input name: needed for inputs whose shape the
    #: model does not declare (TorchScript declares none), or to warm up a given size.
    warmup_inputs: dict[str, list[Annotated[int, Field(ge=1)]]] = Field(default_factory=dict)
    #: Dynamic batching (None: every request runs on its own).
    batching: BatchingConfig | None = None

    def batching_spec(self) -> Batching | None:
        return None if self.batching is None else self.batching.spec()

    @property
    def at_start(self) -> bool:
        """Whether the runtime loads it as it starts."""
        return self.preload or self.warmup > 0

    @property
    def kept(self) -> bool:
        """Whether, once loaded, it stays loaded for the runtime's lifetime."""
        return self.at_start


class ModelConfig(_Startup):
    """``[models.NAME]``: a model ``load_by_name`` can load."""

    #: Model files, one per builder (IR: xml then bin), relative to the config file.
    files: list[str] = Field(min_length=1)
    encoding: EncodingName = "autodetect"
    #: The default target of the loaded graph.
    target: TargetName = "cpu"
    #: Force a backend (None = the pool's preference order).
    backend: str | None = None
    precision: str = "f32"
    threads: int = Field(default=0, ge=0)
    #: Backend-specific options, passed through as LoadOptions.extra.
    options: dict[str, Any] = Field(default_factory=dict)
    #: Keep it loaded for the runtime's lifetime even when no caller holds it.
    resident: bool = False

    @property
    def kept(self) -> bool:
        return self.resident or self.at_start


class StepConfig(_Strict):
    """One step of a pipeline: a model, and how the previous step's outputs feed it."""

    model: Name
    #: previous step's output name -> this step's input name (may be omitted when both
    #: have exactly one).
    wire: dict[str, str] = Field(default_factory=dict)


class PipelineConfig(_Startup):
    """``[pipelines.NAME]``: models chained on one device."""

    steps: list[StepConfig] = Field(min_length=1)
    target: TargetName = "cpu"


class GuestsConfig(_Strict):
    """``[guests]``: what one WebAssembly guest instance may hold and do.

    Beyond a size limit the guest gets too-large. ``allowed_targets`` restricts the
    execution targets guests may ask for (None = every target); another target gives
    component guests ``security`` and core-module guests ``invalid_argument`` (the legacy
    ABI has no security errno); it applies to graphs loaded by name too.
    ``compute_timeout`` bounds one compute in seconds (None = no bound); past it the guest
    gets ``timeout`` (core modules: ``runtime_error``) and the request is cancelled.
    ``max_scratch_bytes``/``max_scratch_files`` bound a component guest's
    ``wasinn:nn/scratch`` directory (bytes, entries);
    ``max_tensors``/``max_errors`` a component guest's live tensor/error handles and
    ``max_live_tensor_bytes`` the tensor data it holds at once (see GuestLimits).
    """

    max_graphs: int = Field(default=64, ge=1)
    max_contexts: int = Field(default=1024, ge=1)
    max_model_bytes: int = Field(default=2 * 1024**3, ge=1)
    max_tensor_bytes: int = Field(default=1024**3, ge=1)
    allowed_targets: list[TargetName] | None = None
    compute_timeout: float | None = Field(default=None, gt=0)
    max_scratch_bytes: int = Field(default=2 * 1024**3, ge=0)
    max_scratch_files: int = Field(default=10_000, ge=1)
    max_tensors: int = Field(default=4096, ge=1)
    max_errors: int = Field(default=1024, ge=1)
    max_live_tensor_bytes: int = Field(default=4 * 1024**3, ge=1)


def _default_pools() -> dict[str, PoolConfig]:
    return {"cpu": PoolConfig(kind="cpu", devices=["cpu"])}


class RuntimeConfig(_Strict):
    """A whole config. Build it from TOML with :func:`wasinn.configs.loader.load_config`."""

    runtime: RuntimeSection = Field(default_factory=RuntimeSection)
    pools: dict[Name, PoolConfig] = Field(default_factory=_default_pools)
    models: dict[Name, ModelConfig] = Field(default_factory=dict)
    pipelines: dict[Name, PipelineConfig] = Field(default_factory=dict)
    guests: GuestsConfig = Field(default_factory=GuestsConfig)

    _source: Path | None = PrivateAttr(default=None)

    @property
    def source(self) -> Path | None:
        """The file this config was read from (None when built in code)."""
        return self._source

    @property
    def base_dir(self) -> Path:
        """The directory model files are relative to (the config file's, else the cwd)."""
        return self._source.parent if self._source is not None else Path.cwd()

    def with_source(self, source: Path) -> RuntimeConfig:
        self._source = source
        return self

    @model_validator(mode="after")
    def _consistent(self) -> RuntimeConfig:
        kinds: dict[str, str] = {}
        for name, pool in self.pools.items():
            if pool.kind in kinds:
                raise ValueError(
                    f"pools {kinds[pool.kind]!r} and {name!r} are both {pool.kind} pools: "
                    "expected one pool per device kind"
                )
            kinds[pool.kind] = name
        fallback = self.runtime.fallback
        if fallback is not None and fallback not in kinds:
            present = ", ".join(f"{n} ({k})" for k, n in kinds.items()) or "none"
            raise ValueError(
                f"runtime.fallback = {fallback!r} names a device kind no pool serves "
                f"(pools: {present}): expected the kind of one of the pools, or no fallback"
            )
        for name, pipeline in self.pipelines.items():
            if name in self.models:
                raise ValueError(f"{name!r} names both a model and a pipeline: expected one")
            for i, step in enumerate(pipeline.steps):
                if step.model not in self.models:
                    known = ", ".join(sorted(self.models)) or "none"
                    raise ValueError(
                        f"pipeline {name!r} step {i} uses model {step.model!r}, which is not "
                        f"in [models] (models: {known})"
                    )
        return self
