"""What a wasinn config may say, validated with pydantic.

A config has six tables::

    [runtime]                      # backends = preference order; fallback = a target kind
    [pools.NAME]                   # one pool per device kind: kind, devices, workers,
                                   # compile_threads, queue_limit, backends (this pool's
                                   # preference order), policy, inline_below_us,
                                   # close_timeout, pin_handoffs
    [models.NAME]                  # files (relative to the config file), encoding, target,
                                   # backend, precision, threads, options, resident,
                                   # preload, warmup, warmup_inputs, batching
    [pipelines.NAME]               # steps = [{ model = "...", wire = { out = "in" } }, ...],
                                   # target, preload, warmup, warmup_inputs, batching
    [tenants.NAME]                 # weight: NAME's share of a fair pool's device time
    [guests]                       # per-guest limits: max_graphs, max_contexts,
                                   # max_model_bytes, max_tensor_bytes, allowed_targets,
                                   # compute_timeout, run_timeout, max_scratch_bytes,
                                   # max_scratch_files, max_scratch_open_files,
                                   # max_tensors, max_errors,
                                   # max_live_tensor_bytes, max_data_bytes

Unknown keys are errors (a typo must not be ignored silently), and so are settings that
would be accepted but have no effect: a CPU pool's ``devices`` other than ``["cpu"]`` (or
``"auto"``), a pool with ``devices = []``, a device listed twice, a ``wire`` on a
pipeline's first step (it takes the pipeline's inputs). ``warmup_inputs`` without
``warmup`` is only warned about, by the loader: a config may keep its warm-up shapes
while warm-up is off. ``precision`` is one of :data:`wasinn.configs.PRECISIONS`. Errors
found here name the key they concern (``pipelines.p.steps[0].model``), never only the
table.

``options`` is deliberately open: it is handed to the backend as ``LoadOptions.extra``,
and each backend reads its own keys and ignores the others (a model whose backend is
chosen by preference may end up on any of them, and a third-party backend may read any
key). What can be checked without a backend is: ``precision``/``threads`` (keys of the
model's own table, not options) and ``extra`` are refused; ``optimize`` and
``interruptible`` must be booleans and ``provider_options`` a table; and a model that names
a built-in ``backend`` may only give the keys that backend reads (onnxruntime:
session config entries (``session.``, ``optimization.``, ``mlas.``, ``ep.``; a misspelt
one, alike to an entry ONNX Runtime reads, is refused) and ``provider_options``; openvino: OpenVINO
property names in capitals, such as ``PERFORMANCE_HINT``; pytorch: ``optimize`` and
``interruptible``).

Backend names (``runtime.backends``, ``pools.*.backends``, ``models.*.backend``) depend on
what is installed, so the loader checks them (:func:`wasinn.configs.loader.load_config`),
and ``Runtime`` checks them again knowing the backends it is given.

Names of models and pipelines are looked up, never used as paths. Model ``files`` are
checked by the loader, which knows the directory: a relative path is taken from the
config file's directory and must stay inside it (no ``..`` or symlink escape); an
absolute path is the config author's explicit choice and is used as given (a guest
never names files: it can only ask for a model by name); an empty path, or one naming
the config directory itself, is refused.

Tenant names (``[tenants.NAME]``) are any string a request's ``tenant`` may be, quoted
where TOML needs it; ``[tenants.""]`` is the tenant of the requests that name none. A
tenant not listed has weight 1. Weights matter to pools with ``policy = "fair"`` only:
given while no pool is fair, they are only warned about, by the loader (a config may be
shared by hosts that set their pools apart).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PlainValidator,
    PrivateAttr,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from wasinn.actors.affinity import unsupported_reason
from wasinn.actors.batching import MAX_BATCH, Batching
from wasinn.actors.queue import check_weight
from wasinn.backends.base import MAX_THREADS, Device
from wasinn.backends.sandbox import MAX_SPARES, MIN_MAX_BYTES
from wasinn.enums import TensorType

from . import BACKEND_OPTIONS, option_problem
from ._values import (
    Backends,
    DeviceName,
    EncodingName,
    FileName,
    Name,
    PrecisionName,
    Sandbox,
    SandboxEnv,
    SandboxRead,
    TargetName,
    TensorTypeName,
    fault,
    key_name,
)


class _Strict(BaseModel):
    # strict: numbers and booleans are never read from strings, and an int field takes
    # neither a float nor a boolean (TOML's ``true`` is not 1 here).
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class RuntimeSection(_Strict):
    """``[runtime]``: runtime-wide settings."""

    #: Backend preference order for every pool that names none (empty = wasinn's default).
    backends: Backends = Field(default_factory=list)
    #: Where a target with no device here runs instead (with a warning); None = refuse.
    fallback: TargetName | None = None
    #: Sandbox processes kept started ahead, per backend, for the next sandboxed load
    #: (a guest's own model, a reload after a crash): it then loads the model only,
    #: instead of first importing the library (see wasinn.backends._sandbox_spares).
    sandbox_spares: int = Field(default=1, ge=0, le=MAX_SPARES)
    #: The most sandbox processes the host runs at once, spares included (None: from the
    #: machine, a bound shared by every runtime of this Python process that leaves it
    #: unset, see wasinn.backends._sandbox_limit.host_limit; set: this runtime's own): at
    #: the bound a new one ends a spare or the idle process that ran least recently, else
    #: waits for one.
    max_sandbox_processes: int | None = Field(default=None, ge=1)
    #: The host's environment variables a confined sandbox process is given besides the
    #: default ones (wasinn.backends._sandbox_process.CONFINED_ENV_NAMES and
    #: CONFINED_ENV_PREFIXES), which keep the host's keys and tokens from it: each a name
    #: ("HF_HOME") or a prefix ending in * ("MY_LICENSE_*"), which never gives a
    #: credential-looking name (HF_TOKEN); "*" alone is refused (see
    #: wasinn.backends._sandbox_env).
    sandbox_env: SandboxEnv = Field(default_factory=list)
    #: The host's folders (everything below each) and files a confined sandbox process may
    #: read besides the default ones (wasinn's and its backend's folders, the Python
    #: installation, the system's libraries), never write: each an absolute path, there
    #: as the config is read (relative paths are refused: unlike model files, these name
    #: the host's folders, not the config's); "/" and a folder that holds the system
    #: temporary folder are refused (see wasinn.backends._sandbox_read). Changes nothing
    #: where the kernel has no Landlock (reads are not restricted there).
    sandbox_read: SandboxRead = Field(default_factory=list)


class PoolConfig(_Strict):
    """``[pools.NAME]``: the devices of one kind and how each is driven."""

    kind: Literal["cpu", "gpu", "tpu"]
    #: "auto" = every device of this kind the installed backends report.
    devices: Literal["auto"] | list[DeviceName] = "auto"
    #: Worker threads per device (requests running at once on one device). Backends
    #: already use every core for one inference, so 1 is the default.
    workers: int = Field(default=1, ge=1, le=256)
    #: Threads per device for compiles and warm-ups, apart from the workers (compiles of
    #: different models at once on one device; one model compiles once, however many
    #: ask). 1, the default: a compile takes the CPU and memory running requests use.
    #: Raise it to preload many models faster as the runtime starts, before requests.
    compile_threads: int = Field(default=1, ge=1, le=64)
    #: Requests allowed to wait per device before callers get too-large.
    queue_limit: int = Field(default=1024, ge=1)
    #: Backend preference order on this pool (empty = [runtime] backends).
    backends: Backends = Field(default_factory=list)
    #: Which waiting request runs next: "priority" (priority, then deadline, then
    #: arrival) or "fair" (device time shared among the tenants with requests
    #: waiting, in proportion to their [tenants] weights, equal by default; priority
    #: order within each tenant).
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
    #: that ignores cancellation (TorchScript, an OpenVINO Loop node) may not: past this, an
    #: error names the device and its jobs still running, and the close returns anyway,
    #: leaving those threads (daemons) and the graphs they use to end on their own.
    close_timeout: float = Field(default=10.0, ge=0)
    #: Opt-in, Linux only. The event loop and this pool's worker threads hand jobs to
    #: each other on one CPU (the loop's), which saves the cross-CPU wake-ups of a
    #: request: tens of microseconds on a virtualised host. A job itself still runs on
    #: every CPU. The price: while a job is out, the loop thread is held to one CPU, and
    #: a thread the loop starts then (trio.to_thread's cached threads included) keeps
    #: that one-CPU mask for life. See wasinn.actors.affinity.
    pin_handoffs: bool = False

    @field_validator("pin_handoffs")
    @classmethod
    def _pinning_works_here(cls, pin: bool) -> bool:
        if pin and (reason := unsupported_reason()) is not None:
            raise fault("", f"pin_handoffs = true cannot work here: {reason}; expected "
                            "false on this platform")
        return pin

    @field_validator("devices", mode="before")
    @classmethod
    def _auto_or_a_list(cls, devices: object) -> object:
        # One clear error for a value of neither form (not one per union member).
        if devices == "auto" or isinstance(devices, list):
            return devices
        raise fault("", 'expected "auto" or a list of device names such as ["cpu"] or '
                        f'["gpu:0", "gpu:1"] (got {devices!r:.60})')

    @field_validator("devices")
    @classmethod
    def _devices_of_kind(cls, devices: Literal["auto"] | list[str], info: ValidationInfo
                         ) -> Literal["auto"] | list[str]:
        kind = info.data.get("kind")  # absent when kind itself is wrong (reported apart)
        if devices == "auto" or kind is None:
            return devices
        if not devices:
            one = '["cpu"]' if kind == "cpu" else f'["{kind}:0"]'
            raise fault("", f'no device: expected "auto" or a list such as {one} (a pool '
                            "that should have no device is left out of the config)")
        seen: set[str] = set()
        for i, name in enumerate(devices):
            if Device.parse(name).kind.value != kind:
                raise fault(f"[{i}]", f"device {name!r} is not a {kind} device")
            if name in seen:
                raise fault(f"[{i}]", f"device {name!r} is listed twice: expected each once")
            seen.add(name)
        return devices


class BatchingConfig(_Strict):
    """``batching = { max_batch = 8, max_delay_ms = 2 }`` in a model's or pipeline's
    table: its requests waiting for the same device at the same time run as one batch
    (see :mod:`wasinn.actors.batching`)."""

    #: The most rows one merged run takes.
    max_batch: int = Field(ge=2, le=MAX_BATCH)
    #: How long a batch holding a slot waits for more requests before it runs (0: never
    #: waits; only requests that queued while the device was busy are merged).
    max_delay_ms: float = Field(default=0.0, ge=0, le=10_000)

    def spec(self) -> Batching:
        return Batching(self.max_batch, self.max_delay_ms / 1e3)


class WarmupInput(_Strict):
    """One input's zero-filled warm-up value in ``warmup_inputs``: its ``shape``, and,
    written as a table (``ids = { shape = [1, 8], type = "i64" }``), its element ``type``
    where the model declares none (TorchScript's; f32 when not given). A plain list
    (``ids = [1, 8]``) is the shape alone."""

    shape: list[Annotated[int, Field(ge=1)]]
    #: The element type (None: the model's own; f32 where it declares none).
    type: TensorTypeName | None = None

    @property
    def tensor_type(self) -> TensorType | None:
        """``type`` as a :class:`~wasinn.enums.TensorType`."""
        return None if self.type is None else TensorType(self.type)


def _warmup_input_form(value: object) -> str | None:
    # Which form a warmup_inputs value is written in: its union member's tag, spelt as
    # pydantic names union members (``list[...]``) so that the loader leaves it out of
    # the key paths its errors name. None (neither form) gets one error saying both
    # forms, not one per form.
    if isinstance(value, list):
        return "list[shape]"
    if isinstance(value, dict | WarmupInput):
        return "table[shape, type]"
    return None


def _as_warmup_input(value: list[int] | WarmupInput) -> WarmupInput:
    return value if isinstance(value, WarmupInput) else WarmupInput(shape=value)


#: A ``warmup_inputs`` value: a shape, or a table of shape and type; read as the table
#: (its type, to the type checker).
if TYPE_CHECKING:
    WarmupInputValue = WarmupInput
else:
    WarmupInputValue = Annotated[
        Annotated[list[Annotated[int, Field(ge=1)]], Tag("list[shape]")]
        | Annotated[WarmupInput, Tag("table[shape, type]")],
        Discriminator(_warmup_input_form, custom_error_type="warmup_input_form",
                      custom_error_message='expected a shape ([1, 8]; [] for a scalar) or '
                                           'a table { shape = [1, 8], type = "i64" }'),
        AfterValidator(_as_warmup_input)]


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
    #: The warm-up inputs by input name, each its shape or a table of shape and element
    #: type (see :class:`WarmupInput`): needed for inputs whose shape the model does not
    #: declare (TorchScript declares none, nor types), or to warm up a given size.
    warmup_inputs: dict[str, WarmupInputValue] = Field(default_factory=dict)
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


#: The files a model of each encoding is made of, for wasinn's own backends (another
#: package's backend, named in ``backend``, may read other layouts; ggml and autodetect
#: are not checked).
MODEL_FILES: dict[str, tuple[tuple[int, ...], str]] = {
    "onnx": ((1,), "one .onnx file"),
    "openvino": ((2,), "two: the IR's .xml, then its .bin weights"),
    "pytorch": ((1,), "one TorchScript or .pt2 archive"),
    "tensorflowlite": ((1,), "one .tflite flatbuffer"),
    "tensorflow": ((1, 3), "one frozen GraphDef or saved_model.pb, or three: saved_model.pb, "
                           "variables.index, variables.data"),
}


def _check_sandbox_bound(max_bytes: int | None, sandbox: bool | str) -> None:
    """A table may set ``max_sandbox_bytes`` only with ``sandbox`` on."""
    if max_bytes is not None and not sandbox:
        raise fault("max_sandbox_bytes", "set without sandbox = true: it bounds the process "
                    "a sandboxed model runs in, and these run in the host's")


class ModelConfig(_Startup):
    """``[models.NAME]``: a model ``load_by_name`` can load."""

    #: Model files, one per builder (IR: xml then bin), relative to the config file (and
    #: inside its directory) or absolute (used as given: the config author's choice).
    files: list[FileName] = Field(min_length=1)
    encoding: EncodingName = "autodetect"
    #: The default target of the loaded graph.
    target: TargetName = "cpu"
    #: Force a backend (None = the pool's preference order).
    backend: str | None = None
    #: One of PRECISIONS (OpenVINO's inference precision; TF32 on or off on NVIDIA GPUs).
    precision: PrecisionName = "f32"
    #: Intra-op threads (0 = the backend's default).
    threads: int = Field(default=0, ge=0, le=MAX_THREADS)
    #: Backend-specific options, passed through as LoadOptions.extra (see the module).
    options: dict[str, Any] = Field(default_factory=dict)
    #: Keep it loaded for the runtime's lifetime even when no caller holds it.
    resident: bool = False
    #: Compile and run it in a process of its own (wasinn.backends.sandbox): a library
    #: crash on a guest's inputs then fails that run only. "cpu": on the CPU only.
    sandbox: Sandbox = False
    #: The memory that process may hold on the CPU, in bytes (None: half the machine's
    #: memory, or of this process's cgroup's limit where lower).
    max_sandbox_bytes: int | None = Field(default=None, ge=MIN_MAX_BYTES)

    @property
    def kept(self) -> bool:
        return self.resident or self.at_start

    @model_validator(mode="after")
    def _bound_needs_sandbox(self) -> ModelConfig:
        _check_sandbox_bound(self.max_sandbox_bytes, self.sandbox)
        return self

    @model_validator(mode="after")
    def _files_fit_encoding(self) -> ModelConfig:
        layout = MODEL_FILES.get(self.encoding)
        if layout is None or (self.backend is not None and self.backend not in BACKEND_OPTIONS):
            return self
        counts, what = layout
        if len(self.files) not in counts:
            given = "one file" if len(self.files) == 1 else f"{len(self.files)} files"
            raise fault("files", f"{given} for encoding {self.encoding!r}: expected {what}")
        return self

    @model_validator(mode="after")
    def _known_options(self) -> ModelConfig:
        for key, value in self.options.items():
            where = f"options.{key_name(key)}"
            if key in ("precision", "threads"):
                raise fault(where, f"{key} is a key of the model's own table, not an option: "
                                   f"expected {key} = ... next to files")
            if key == "extra":
                raise fault(where, "options are already LoadOptions.extra: expected the "
                                   "backend's keys directly in options")
            problem = option_problem(self.backend, key, value)
            if problem is not None:
                raise fault(where, problem)
        return self


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

    @model_validator(mode="after")
    def _first_step_unwired(self) -> PipelineConfig:
        if self.steps[0].wire:
            raise fault("steps[0].wire", "the first step takes the pipeline's own inputs: "
                                         "expected no wire (a wire maps the previous step's "
                                         "outputs)")
        return self


class GuestsConfig(_Strict):
    """``[guests]``: what one WebAssembly guest instance may hold and do.

    Beyond a size limit the guest gets too-large. ``allowed_targets`` restricts the
    execution targets guests may ask for (None = every target); another target gives
    component guests ``security`` and core-module guests ``invalid_argument`` (the legacy
    ABI has no security errno); it applies to graphs loaded by name too.
    ``compute_timeout`` bounds one compute in seconds (None = no bound); past it the guest
    gets ``timeout`` (core modules: ``runtime_error``) and the request is cancelled.
    ``run_timeout`` bounds a guest's whole run in seconds (None = no bound); past it the
    guest is stopped and ``run_wasm`` raises GuestTrap (``wasinn run`` exits with 134).
    ``max_scratch_bytes``/``max_scratch_files``/``max_scratch_open_files`` bound a
    component guest's ``wasinn:nn/scratch`` directory (bytes, entries, open descriptors);
    ``max_tensors``/``max_errors`` a component guest's live tensor/error handles and
    ``max_live_tensor_bytes`` the tensor data it holds at once, ``max_data_bytes`` what
    one ``tensor.data()`` call may return (see GuestLimits).
    ``sandbox`` runs the models a guest loads from its own bytes in a process of their
    own each (wasinn.backends.sandbox), which may hold ``max_sandbox_bytes`` of memory on
    the CPU (None: half the machine's, or of a lower cgroup limit): on the CPU by default
    (``"cpu"``), on every device (true) or nowhere (false). ``max_memory_bytes`` bounds
    each of a guest's linear memories (a ``memory.grow`` past it fails).
    """

    max_graphs: int = Field(default=64, ge=1)
    max_contexts: int = Field(default=1024, ge=1)
    max_model_bytes: int = Field(default=2 * 1024**3, ge=1)
    max_tensor_bytes: int = Field(default=1024**3, ge=1)
    allowed_targets: list[TargetName] | None = None
    compute_timeout: float | None = Field(default=None, gt=0)
    run_timeout: float | None = Field(default=None, gt=0)
    #: The wasm a guest may execute, in wasmtime fuel (about one unit an instruction), over
    #: its whole life (None = no bound); past it the guest traps. wasi-nn calls use none.
    max_fuel: int | None = Field(default=None, ge=1, le=2**64 - 1)
    max_scratch_bytes: int = Field(default=2 * 1024**3, ge=0)
    max_scratch_files: int = Field(default=10_000, ge=1)
    #: Descriptors a component guest may hold open on its scratch directory and in it
    #: (its preopen counts one); each is one of the host process's own.
    max_scratch_open_files: int = Field(default=64, ge=1)
    max_tensors: int = Field(default=4096, ge=1)
    max_errors: int = Field(default=1024, ge=1)
    max_live_tensor_bytes: int = Field(default=4 * 1024**3, ge=1)
    #: The most tensor bytes one component ``tensor.data()`` call returns (``tensor-words``:
    #: 8 times as many); lowering a list costs the host about 80 bytes per value.
    max_data_bytes: int = Field(default=16 * 1024**2, ge=1)
    sandbox: Sandbox = "cpu"
    max_sandbox_bytes: int | None = Field(default=None, ge=MIN_MAX_BYTES)
    #: Bytes each of a guest's linear memories may grow to (4 GiB: a 32-bit memory's all).
    max_memory_bytes: int = Field(default=4 * 1024**3, ge=64 * 1024, le=4 * 1024**3)

    @model_validator(mode="after")
    def _bound_needs_sandbox(self) -> GuestsConfig:
        _check_sandbox_bound(self.max_sandbox_bytes, self.sandbox)
        return self


def _weight(value: object) -> float:
    try:
        return check_weight(value)
    except ValueError as exc:
        raise fault("", str(exc)) from None


class TenantConfig(_Strict):
    """``[tenants.NAME]``: what tenant NAME (a request's ``tenant``; ``""``: the requests
    that name none) gets from a pool whose ``policy = "fair"``."""

    #: Its share of device time while other tenants have requests waiting too: a tenant
    #: of weight 2 gets twice the device time of one of weight 1 (a tenant not listed).
    weight: Annotated[float, PlainValidator(_weight)]


def _default_pools() -> dict[str, PoolConfig]:
    return {"cpu": PoolConfig(kind="cpu", devices=["cpu"])}


class RuntimeConfig(_Strict):
    """A whole config. Build it from TOML with :func:`wasinn.configs.loader.load_config`."""

    runtime: RuntimeSection = Field(default_factory=RuntimeSection)
    pools: dict[Name, PoolConfig] = Field(default_factory=_default_pools)
    models: dict[Name, ModelConfig] = Field(default_factory=dict)
    pipelines: dict[Name, PipelineConfig] = Field(default_factory=dict)
    guests: GuestsConfig = Field(default_factory=GuestsConfig)
    #: Tenants' weights in fair pools, by tenant name (any string; "": untagged requests).
    tenants: dict[str, TenantConfig] = Field(default_factory=dict)

    _source: Path | None = PrivateAttr(default=None)
    _given: dict[str, str] = PrivateAttr(default_factory=dict)

    @property
    def source(self) -> Path | None:
        """The file this config was read from (None when built in code)."""
        return self._source

    @property
    def tenant_weights(self) -> dict[str, float]:
        """``[tenants]``'s weights by tenant name, for the fair pools' policies."""
        return {name: tenant.weight for name, tenant in self.tenants.items()}

    def where(self, key: str) -> str:
        """``FILE: KEY``: where ``key`` (a dotted path) is written, for its errors."""
        return f"{self._source or 'the config'}: {key}"

    def model_key(self, name: str) -> str:
        """Where model ``name`` of the registry was written, for its errors:
        ``FILE: models.NAME``, or the command-line flag that gave it."""
        return self._given.get(name) or self.where(f"models.{key_name(name)}")

    def with_given(self, flags: dict[str, str]) -> RuntimeConfig:
        """This config, its models ``flags`` names given by those flags (see
        :meth:`model_key`), not by its file."""
        self._given = {**self._given, **flags}
        return self

    @property
    def base_dir(self) -> Path:
        """The directory model files are relative to (the config file's, else the cwd)."""
        return self._source.parent if self._source is not None else Path.cwd()

    def with_source(self, source: Path) -> RuntimeConfig:
        self._source = source
        return self

    @model_validator(mode="after")
    def _consistent(self) -> RuntimeConfig:
        if not self.pools:
            raise fault("pools", "no pool: a runtime with no device could run nothing; "
                                 "expected at least one [pools.NAME] table (or no pools "
                                 "key at all, for the default CPU pool)")
        kinds: dict[str, str] = {}
        # Cross-table checks: each error names the key path it is about (fault).
        for name, pool in self.pools.items():
            if pool.kind in kinds:
                raise fault(
                    f"pools.{key_name(name)}.kind",
                    f"pools {kinds[pool.kind]!r} and {name!r} are both {pool.kind} pools: "
                    "expected one pool per device kind"
                )
            kinds[pool.kind] = name
        fallback = self.runtime.fallback
        if fallback is not None and fallback not in kinds:
            present = ", ".join(f"{n} ({k})" for k, n in kinds.items()) or "none"
            raise fault(
                "runtime.fallback",
                f"{fallback!r} names a device kind no pool serves (pools: {present}): "
                "expected the kind of one of the pools, or no fallback"
            )
        for name, pipeline in self.pipelines.items():
            if name in self.models:
                raise fault(f"pipelines.{key_name(name)}",
                            f"{name!r} names both a model and a pipeline: expected one")
            for i, step in enumerate(pipeline.steps):
                if step.model not in self.models:
                    known = ", ".join(sorted(self.models)) or "none"
                    what = (" but a pipeline: a step is one model (list the other "
                            "pipeline's steps instead)" if step.model in self.pipelines
                            else "")
                    raise fault(
                        f"pipelines.{key_name(name)}.steps[{i}].model",
                        f"pipeline {name!r} step {i} uses model {step.model!r}, which is "
                        f"not in [models]{what} (models: {known})"
                    )
        return self
