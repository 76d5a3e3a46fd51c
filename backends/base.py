"""The backend contract: backend -> compiled graph -> run.

A :class:`Backend` is a library (ONNX Runtime, OpenVINO, PyTorch, ...) seen through
four questions: which encodings it reads, which devices it can run on here
(:meth:`Backend.devices`), how sure it is that some bytes are its format
(:meth:`Backend.sniff`: asked of a plugin when an autodetected model's bytes match no
built-in format), and how to compile model bytes for one device
(:meth:`Backend.load`). A :class:`CompiledGraph` reports its inputs and outputs and
runs named inputs to named outputs, synchronously.

Backends know nothing of trio or WebAssembly: they are called from worker threads
owned by device actors. Every failure leaves a backend as a :class:`wasinn.errors.WasiNNError`
leaf (never the library's own exception type), with a message that names the backend.
"""

from __future__ import annotations

import abc
import functools
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from wasinn.enums import ExecutionTarget, GraphEncoding, TensorType
from wasinn.errors import InvalidArgumentError, InvalidEncodingError
from wasinn.tensor import Tensor

#: Model bytes as the guest handed them over: one buffer per builder.
Builders = Sequence[bytes | bytearray | memoryview]

log = logging.getLogger("wasinn.backends")


@functools.total_ordering
@dataclass(frozen=True)
class Device:
    """One device a backend can run on: ``cpu``, ``gpu:0``, ``gpu:1``, ``tpu:0``...

    Devices sort by kind (cpu, gpu, tpu) then index.
    """

    kind: ExecutionTarget
    index: int = 0

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Device):
            return NotImplemented
        order = list(ExecutionTarget)
        return (order.index(self.kind), self.index) < (order.index(other.kind), other.index)

    @property
    def name(self) -> str:
        return "cpu" if self.kind is ExecutionTarget.CPU else f"{self.kind.value}:{self.index}"

    @classmethod
    def parse(cls, text: str) -> Device:
        """``"cpu"``, ``"gpu"`` (= ``gpu:0``), ``"gpu:1"``, ``"npu:0"`` (npu is tpu).

        Raises InvalidArgumentError for an unknown kind or an index that is not a
        non-negative decimal integer (``gpu:x``, ``gpu:-1``, ``gpu:``).
        """
        kind, colon, index = text.strip().lower().partition(":")
        if colon and not (index.isascii() and index.isdigit()):
            raise InvalidArgumentError(
                f"device {text!r} has index {index!r}: expected a non-negative integer "
                "after the colon (gpu:0, gpu:1, ...)")
        if kind == "npu":
            kind = "tpu"
        return cls(ExecutionTarget.coerce(kind), int(index) if index else 0)

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class TensorSpec:
    """A graph input or output: name, element type and shape (None = a dynamic dimension).

    ``shape == ()`` with ``rank_known`` (the default) is a scalar: rank 0. A model that
    does not say how many dimensions a tensor has (TorchScript records no shapes; an
    OpenVINO port of dynamic rank; an ONNX value declared without a shape) gives
    ``rank_known=False`` and ``shape == ()``: nothing about its shape is known.
    A model that does not declare a tensor's element type (TorchScript records none)
    gives ``type_known=False``: its ``type`` is then a placeholder (f32) that says nothing
    and that nothing checks, a tensor of any element type may be given or come out, and
    :meth:`describe` says ``any``.
    ``bounds`` are the sizes a model allows in its dynamic dimensions where it limits
    them (an OpenVINO interval dimension, ``[1..4, 3]``): ``(low, high)`` for every
    dimension (``high`` None: no upper bound; a fixed one ``(size, size)``), or ``()``,
    the default, where it limits none (then a dynamic dimension takes any size).
    Raises InvalidArgumentError for ``rank_known=False`` with dimensions, and for bounds
    that are not one ``(low, high)`` per dimension, each holding its fixed size.
    """

    name: str
    type: TensorType
    shape: tuple[int | None, ...]
    rank_known: bool = True
    type_known: bool = True
    bounds: tuple[tuple[int, int | None], ...] = ()

    def __post_init__(self) -> None:
        if not self.rank_known and self.shape:
            raise InvalidArgumentError(
                f"tensor spec {self.name!r} has shape {list(self.shape)} but says its rank "
                "is unknown: expected shape () with rank_known=False")
        if self.bounds and not _bounds_fit(self.shape, self.bounds):
            raise InvalidArgumentError(
                f"tensor spec {self.name!r} of shape {list(self.shape)} has bounds "
                f"{list(self.bounds)}: expected one (low, high) per dimension, "
                "0 <= low <= high (or high None), a fixed one (size, size)")

    def describe(self) -> str:
        """``name: type[dims]``, a dynamic dimension as ``?``, a bounded one as OpenVINO
        writes it (``1..4``, ``2..``, ``..8``); ``x: f32[]`` is a scalar, ``x: f32[...]``
        an input of unknown rank, ``x: any[...]`` one of undeclared element type and rank
        (TorchScript's)."""
        type_ = self.type.value if self.type_known else "any"
        if not self.rank_known:
            return f"{self.name}: {type_}[...]"
        if self.bounds:
            dims = ", ".join(str(d) if d is not None else _interval(low, high)
                             for d, (low, high) in zip(self.shape, self.bounds, strict=True))
        else:
            dims = ", ".join("?" if d is None else str(d) for d in self.shape)
        return f"{self.name}: {type_}[{dims}]"


def _bounds_fit(shape: tuple[int | None, ...], bounds: tuple[tuple[int, int | None], ...]
                ) -> bool:
    """Whether ``bounds`` are one ``(low, high)`` per dimension of ``shape``, in order,
    holding each fixed size as ``(size, size)``."""
    if len(bounds) != len(shape):
        return False
    for size, (low, high) in zip(shape, bounds, strict=True):
        if not 0 <= low <= (low if high is None else high):
            return False
        if size is not None and not low == high == size:
            return False
    return True


def describe_range(low: int, high: int | None) -> str:
    """The sizes ``low`` to ``high`` (None: no upper bound) of a dimension, in words."""
    if high is None:
        return f"at least {low}"
    return f"at most {high}" if low == 0 else f"{low} to {high}"


def outside_bounds(spec: TensorSpec, axis: int, size: int, low: int, high: int | None,
                   allows: str = "allows") -> str:
    """What is wrong with input ``spec`` given ``size`` in dimension ``axis``, outside the
    ``low`` to ``high`` the model ``allows`` there (torch.export's ranges: ``"was
    exported for"``), and what it expects: the words of every such error."""
    return (f"input {spec.name!r} has size {size} in dimension {axis}, but the model "
            f"{allows} {describe_range(low, high)} there (expected {spec.describe()})")


def _interval(low: int, high: int | None) -> str:
    # A dynamic dimension's sizes as OpenVINO writes them: ?, 1..4, 2.., ..8.
    if high is None:
        return f"{low}.." if low else "?"
    return f"{low}..{high}" if low else f"..{high}"


#: The most intra-op threads a model may ask for (``LoadOptions.threads``, a config's
#: ``threads``): a count beyond any machine's cores is a mistake, and the libraries would
#: try to start that many threads.
MAX_THREADS = 1024


class _PathText:
    """A dataclass field holding a file's path as a str: set to a str or any
    ``os.PathLike`` of str (a ``pathlib.Path``, a ``trio.Path``), read as its
    ``os.fspath``; ``""`` by default. Anything else is an InvalidArgumentError naming the
    field."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._owner, self._name, self._slot = owner.__name__, name, f"_{name}"

    def __get__(self, instance: object | None, owner: type | None = None) -> str:
        if instance is None:  # (the dataclass's default)
            return ""
        text: str = getattr(instance, self._slot)
        return text

    def __set__(self, instance: object, value: str | os.PathLike[str]) -> None:
        try:
            text = value if type(value) is str else os.fspath(value)
        except TypeError:
            text = None
        if not isinstance(text, str):
            raise InvalidArgumentError(
                f"{self._owner} {self._name}={value!r:.60} ({type(value).__name__}): "
                "expected a file's path, a str or an os.PathLike of str (a Path)")
        setattr(instance, self._slot, text)


@dataclass
class LoadOptions:
    """Options a backend may honour when compiling; unknown keys are ignored.

    ``precision`` is the inference precision (``"f32"`` by default so that outputs
    agree across CPUs; OpenVINO otherwise picks bf16 on CPUs with AMX);
    ``threads`` the intra-op thread count (0 = the library's default; at most
    :data:`MAX_THREADS`);
    ``extra`` backend-specific settings passed through as given;
    ``source`` the path of the model's (first) file where it was read from the host's
    files by the host's own choice (a model registry entry), else ``""`` (bytes from a
    guest or a caller): only such a model may keep ONNX weights in external data files,
    each inside that file's folder (see :mod:`._onnx_check`); given as a str or any
    ``os.PathLike`` of str (a ``pathlib.Path``), kept as its str (``os.fspath``);
    ``thread_pinning`` whether the backend may pin its own threads to CPUs as it sees fit
    (OpenVINO's ``ENABLE_CPU_PINNING``, unless ``extra`` names it): False where the
    caller manages the affinity of the threads that call it (a pool with pinned
    hand-offs, whose event loop OpenVINO takes for the process's CPUs);
    ``sandbox`` whether the graph is compiled and run in a process of its own
    (:mod:`wasinn.backends.sandbox`), so that a library crash on it does not end the
    host's: True on every device, ``"cpu"`` on the CPU only (see :meth:`sandboxed_on`);
    honoured by the scheduler, which then calls ``load_sandboxed`` instead of ``load``;
    backends ignore it. ``max_sandbox_bytes`` bounds the memory such a
    process may hold on the CPU (None: half the machine's memory, or of a lower cgroup
    limit: see :mod:`.sandbox`).
    ``external_data``: the external data files of the ONNX model of ``source`` (location
    -> bytes), read and checked by the host and handed over in memory, in a sandboxed
    graph's process (set there only, see :mod:`.sandbox`), which may not read the model's
    folder: ONNX Runtime and OpenVINO then take these instead of reading that folder.
    """

    precision: str = "f32"
    threads: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict)
    source: _PathText = _PathText()
    thread_pinning: bool = True
    sandbox: bool | Literal["cpu"] = False
    max_sandbox_bytes: int | None = None
    external_data: Mapping[str, bytes] = field(default_factory=dict, repr=False)

    def sandboxed_on(self, device: Device) -> bool:
        """Whether a graph with these options runs in a process of its own on ``device``."""
        return self.sandbox is True or (
            self.sandbox == "cpu" and device.kind is ExecutionTarget.CPU)


def warn_precision_not_applied(backend: str, options: LoadOptions, library: str) -> None:
    """Log that ``options.precision`` is f16 or bf16 where ``backend``'s library has no
    switch for it and computes in the model's own element types (ONNX Runtime, torch):
    the model loads, and a warning says why its outputs are f32's."""
    precision = options.precision.strip().lower()
    if precision in ("f16", "bf16"):
        log.warning("%s: precision %r is not applied: %s computes in the model's own "
                    "types (save the model in %s to compute in it)",
                    backend, precision, library, precision)


#: Holds True once this process is a sandbox process (see :mod:`.sandbox`); set by its
#: main only.
_sandbox_process: list[bool] = []


def in_sandbox() -> bool:
    """Whether this process is a sandboxed graph's own process: a library crash here ends
    only it, so a backend may accept a model whose crash it would otherwise refuse to
    risk in the host's process (a division it cannot guard)."""
    return bool(_sandbox_process)


#: The way out a refusal that only the host's process needs (a division a backend cannot
#: guard) ends with: in a sandbox process the same model is accepted unguarded.
RUN_IT_SANDBOXED = (
    "load it sandboxed to run it unguarded, in a process of its own that a crash ends "
    "instead of the host's (sandbox = true in its [models.NAME] table or "
    "options={'sandbox': True} in rt.load; [guests] sandbox for the models guests load "
    "from their own bytes, sandboxed on the CPU by default)")


def mark_sandbox_process() -> None:
    """Called once by a sandbox process's main (:mod:`._sandbox_child`), never elsewhere."""
    _sandbox_process.append(True)


def sandbox_setting(value: object) -> bool | Literal["cpu"] | None:
    """``value`` as :attr:`LoadOptions.sandbox` takes it (True, False or ``"cpu"``); None
    for anything else (each caller says what was wrong in its own terms)."""
    if isinstance(value, bool):
        return value
    return "cpu" if value == "cpu" else None


class CompiledGraph(abc.ABC):
    """A model compiled for one device. Thread-safe for concurrent ``run`` calls."""

    device: Device
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    #: Other names ``run`` accepts for inputs and outputs, by position (TensorFlow's ``x``
    #: for ``x:0``, an OpenVINO port's other names); read-only.
    input_aliases: Mapping[str, int] = MappingProxyType({})
    output_aliases: Mapping[str, int] = MappingProxyType({})
    #: Whether a run's outputs have the element types :attr:`outputs` declare: False
    #: where those are placeholders (a TorchScript module records no types: its specs
    #: say ``any`` of unknown rank, ``type_known=False``, whatever it returns).
    output_types_declared: bool = True
    #: Whether a run may be made on the caller's event loop (a device's opt-in inline
    #: runs): False where a run can wait on something other than the computation (a
    #: sandboxed graph's run may wait for a process, its crash back-off or room under
    #: the host's process cap). An inline run has no job: no cancellation, no caller.
    may_run_inline: bool = True
    #: Whether :meth:`close` may block for a while on something other than freeing memory
    #: (a sandboxed graph's waits for its processes to end, ~25 ms each): its owner then
    #: closes it off an event loop.
    close_blocks: bool = False

    @abc.abstractmethod
    def run(
        self,
        inputs: Mapping[str, Tensor],
        *,
        outputs: Sequence[str] | None = None,
        keep_on_device: bool = False,
    ) -> dict[str, Tensor]:
        """Run the graph on named inputs and return the named outputs.

        The scheduler hands it input names only: the positions and aliases a caller may
        use are resolved to the names of :attr:`inputs` before a request reaches a
        device, and a position the graph does not have is refused there. A str it does
        not list may still come, for the backend to refuse (it can say what that name
        is). ``outputs`` limits which outputs are produced (all when None).
        ``keep_on_device`` returns backend-native tensors that stay on this graph's
        device (ready to be fed to another graph of the same backend and device)
        instead of host numpy tensors. Inputs may be host tensors or native tensors
        produced by this backend on this device; they are not copied where the library
        allows. Raises InvalidArgumentError for a wrong input name, element type or shape
        (naming what the model expects) and BackendRuntimeError when the library fails.
        """

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the compiled session and its device memory. Idempotent."""


class Backend(abc.ABC):
    """A neural-network library behind the wasinn contract."""

    #: Short name used in configs and logs ("onnxruntime", "openvino", "pytorch").
    name: str
    #: The encodings this backend reads.
    encodings: frozenset[GraphEncoding]

    @abc.abstractmethod
    def devices(self) -> list[Device]:
        """The devices this backend can run on in this process (probed, cached)."""

    def sniff(self, builders: Builders) -> float:
        """How sure (0.0-1.0) this backend is that ``builders`` are a model it reads.

        Asked when a model's encoding is autodetected and its bytes match no built-in
        format (see :func:`wasinn.backends.formats.detect_encoding`), of the backends
        that are not built in (given to the runtime in code, or entry-point plugins)
        with a device of the kind the model runs on: the highest score above 0 wins,
        and the model is read by that backend, in its encoding. Only a backend that
        reads exactly one encoding is asked (a score cannot say which of several the
        bytes are in): the models of one that reads several need their encoding
        declared. Called in a worker thread; should be quick and read little. This
        default claims the bytes the built-in detection finds in one of
        :attr:`encodings`, which a plugin overrides to recognise its own format."""
        from wasinn.backends.formats import detect_encoding

        try:
            encoding = detect_encoding(builders)
        except InvalidEncodingError:
            return 0.0
        return 1.0 if encoding in self.encodings else 0.0

    @abc.abstractmethod
    def load(
        self,
        builders: Builders,
        encoding: GraphEncoding,
        device: Device,
        options: LoadOptions | None = None,
    ) -> CompiledGraph:
        """Compile ``builders`` for ``device``.

        Raises InvalidEncodingError (naming this backend and the reason) for bytes it
        cannot read, UnsupportedOperationError for a device it does not have.
        """


@dataclass(frozen=True)
class BackendRef:
    """A backend named by where its class lives (``module:Class``), without importing
    it: what a process of its own needs to make the backend there (see
    :mod:`wasinn.backends.sandbox`), so that the host never imports a library only to
    have a sandboxed graph run by it elsewhere."""

    name: str
    entry: str

    @classmethod
    def of(cls, backend: Backend) -> BackendRef:
        kind = type(backend)
        return cls(backend.name, f"{kind.__module__}:{kind.__qualname__}")

    @property
    def module(self) -> str:
        return self.entry.partition(":")[0]


class Cancellation:
    """A request to stop one run early, and the hooks that carry it into a library.

    The owner of a job (a device actor) creates one per job and calls :meth:`cancel`
    from any thread when nobody wants the result any more (the caller timed out or was
    cancelled, or the device is closing). A backend running under it
    (:func:`current_cancellation`) registers with :meth:`on_cancel` whatever interrupts
    its library (ONNX Runtime's ``RunOptions.terminate``, OpenVINO's
    ``InferRequest.cancel``); a run so interrupted raises BackendRuntimeError, and its
    result is dropped anyway. Thread-safe; every callback runs at most once, and an
    exception it raises is logged (logger ``wasinn.backends``), never propagated.

    Being the job's own, it also says whom the job runs for: ``caller``, an opaque key
    its owner chooses (a device actor: the request's tenant, ``""`` for requests that
    name none), which a backend reads with :func:`current_caller` where it keeps one
    caller's doings apart from another's (a sandboxed graph's crash back-off, see
    :mod:`._sandbox_backoff`); None: nobody named (a backend used directly), one caller.
    It rides on the cancellation, which every job has and every run is made under, so
    that naming it costs a job one attribute, nothing per run.
    """

    __slots__ = ("_callbacks", "_cancelled", "_lock", "caller")

    def __init__(self, caller: str | None = None) -> None:
        self._lock = threading.Lock()
        self._cancelled = False
        self._callbacks: list[Callable[[], object]] = []
        #: Whom the job runs for (see the class docstring); None: nobody named.
        self.caller = caller

    def __repr__(self) -> str:
        return f"<Cancellation {'cancelled' if self._cancelled else 'pending'}>"

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        """Cancel (idempotent): run every registered callback, in this thread."""
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            _call(callback)

    def on_cancel(self, callback: Callable[[], object]) -> Callable[[], None]:
        """Call ``callback`` on :meth:`cancel` (at once, here, if already cancelled).

        Returns a function that unregisters it (a no-op once it has run): call it when
        what the callback interrupts is no longer this run's, e.g. an infer request
        going back to a pool. After unregistering, :attr:`cancelled` tells whether the
        callback ran or may still be running.
        """
        with self._lock:
            if not self._cancelled:
                self._callbacks.append(callback)
                return functools.partial(self._forget, callback)
        _call(callback)
        return _nothing

    def _forget(self, callback: Callable[[], object]) -> None:
        # Once per cancellable run: no contextlib.suppress (three Python calls more).
        with self._lock:
            callbacks = self._callbacks
            if callback in callbacks:  # else already run (cancelled) and cleared
                callbacks.remove(callback)


def _call(callback: Callable[[], object]) -> None:
    try:
        callback()
    except Exception:
        log.exception("a cancellation callback (%r) failed", callback)


def _nothing() -> None:
    pass


_current = threading.local()


def current_cancellation() -> Cancellation | None:
    """The cancellation the current thread's job runs under, or None (a run that cannot
    be cancelled)."""
    cancellation: Cancellation | None = getattr(_current, "cancellation", None)
    return cancellation


def current_caller() -> str | None:
    """Whom the current thread's job runs for (its :attr:`Cancellation.caller`); None for
    a run under no job, or under one that names nobody."""
    cancellation: Cancellation | None = getattr(_current, "cancellation", None)
    return None if cancellation is None else cancellation.caller


def on_current_cancel(callback: Callable[[], object]) -> Callable[[], None]:
    """``callback`` registered (:meth:`Cancellation.on_cancel`) with the cancellation
    the current thread's job runs under; the function that unregisters it, a no-op
    where the job has none."""
    cancellation = current_cancellation()
    return _nothing if cancellation is None else cancellation.on_cancel(callback)


class Cancelled(Exception):
    """Raised by :func:`stop_if_cancelled` in a run whose job was cancelled."""


def stop_if_cancelled() -> None:
    """Raise :class:`Cancelled` if the current thread's job was cancelled: a checkpoint
    for a backend to put between the steps of a run its library cannot interrupt. About
    50 ns (the flag is read without the lock)."""
    cancellation = getattr(_current, "cancellation", None)
    if cancellation is not None and cancellation._cancelled:
        raise Cancelled


class running_under:  # lower case: used like a function, ``with running_under(c):``
    """Make ``cancellation`` this thread's current one for the block (then restore the
    previous one). A class, not a generator: it wraps every run of a worker thread."""

    __slots__ = ("_cancellation", "_previous")

    def __init__(self, cancellation: Cancellation | None) -> None:
        self._cancellation = cancellation
        self._previous: Cancellation | None = None

    def __enter__(self) -> Cancellation | None:
        self._previous = getattr(_current, "cancellation", None)
        _current.cancellation = self._cancellation
        return self._cancellation

    def __exit__(self, *exc_info: object) -> None:
        _current.cancellation = self._previous
