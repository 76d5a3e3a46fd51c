"""``wasinn infer``: run a registered model or pipeline from the command line, no guest.

::

    wasinn infer [--config FILE] [--nn-preload ...] [--wasi nn-graph=...] NAME
                 [--input NAME=FILE.npy | --input FILE.npz]... [--zeros]
                 [--shape NAME=D,D,...[:TYPE]]...
                 [--target cpu|gpu|tpu] [--requests N] [--concurrency C] [--timeout S]
                 [--save FILE.npz]

``NAME`` is an entry of the config's registry (``[models.NAME]`` or ``[pipelines.NAME]``)
or a model registered on the command line as for ``wasinn run``. Inputs come from numpy
files: ``--input x=x.npy`` for one, ``--input inputs.npz`` for every array of the archive
by name (an input's position works as its name). ``--zeros`` fills the inputs not given
with zeros of the model's shapes (dynamic dimensions as 1, or as ``--shape`` gives:
``--shape x=``, no dimensions, for a scalar where the model declares no shape) and
types: an input whose type the model does not declare (TorchScript's) gets f32 unless its
``--shape`` ends in ``:TYPE`` (``--shape ids=1,8:i64``); a type where the model declares
another is refused, and a run that fails on f32 zeros of an undeclared type says how to
give one.

``--requests N`` runs N requests from ``--concurrency C`` callers, each with an execution
context of its own, as a load test would: the command then prints the requests per
second, the latency percentiles as the callers saw them, and the model's and each
device's stats (time queued and time running apart). The outputs of the last request
are printed (type, shape, range and, along the last axis, the five largest values) and,
with ``--save``, written to a numpy archive (see :mod:`wasinn._save`). Where the archive
goes to stdout (``--save /dev/stdout``), every line is printed to stderr instead, so that
stdout's reader gets the archive alone. A load test stopped by Ctrl-C or SIGTERM prints
``stopped by Ctrl-C after K of N requests`` and the same figures for the K requests
completed (no outputs: none is the last), and exits with 130 (143).

bf16 has no type in numpy's file format: numpy saves an ``ml_dtypes.bfloat16`` array as
2-byte raw values (``|V2``). ``--input`` reads such values as bf16 where the model's input
may be bf16, and ``--save`` writes bf16 outputs so (load them with
``numpy.load(FILE)[NAME].view(ml_dtypes.bfloat16)``). Values of another type for a bf16
input are refused, as any other type mismatch is, saying how to write a bf16 file.
"""

from __future__ import annotations

import math
import os
import re
import statistics
import time
import zipfile
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np
import trio

from wasinn._groups import collapsed_groups
from wasinn._memory import available_memory
from wasinn._save import RAW_2_BYTES
from wasinn.enums import TensorType
from wasinn.errors import InvalidArgumentError, WasiNNError
from wasinn.tensor import Tensor, numpy_dtype, tensor_type_of

if TYPE_CHECKING:
    from wasinn.actors.stats import ModelStats
    from wasinn.backends.base import TensorSpec
    from wasinn.scheduler import ExecutionContext, Graph, Runtime
    from wasinn.scheduler.warmup import ZeroInput


class Load:
    """How many requests to send, from how many callers at once, and their timeout."""

    __slots__ = ("concurrency", "requests", "timeout")

    def __init__(self, requests: int = 1, concurrency: int = 1,
                 timeout: float | None = None) -> None:
        if requests < 1:
            raise InvalidArgumentError(f"--requests {requests}: expected at least 1")
        if concurrency < 1:
            raise InvalidArgumentError(f"--concurrency {concurrency}: expected at least 1")
        if timeout is not None and not timeout > 0:
            raise InvalidArgumentError(f"--timeout {timeout}: expected seconds > 0")
        self.requests = requests
        self.concurrency = min(concurrency, requests)
        self.timeout = timeout


def parse_shapes(specs: Sequence[str]) -> dict[str, ZeroInput]:
    """Every ``--shape NAME=D,D,...[:TYPE]``; InvalidArgumentError for a name given two
    shapes (the same one twice counts once)."""
    shapes: dict[str, ZeroInput] = {}
    for spec in specs:
        name, zero = parse_shape(spec)
        known = shapes.setdefault(name, zero)
        types = {known.type, zero.type} - {None}
        if known.shape != zero.shape or len(types) > 1:
            raise InvalidArgumentError(
                f"--shape {spec!r}: {name} is already given as {name}={_shape_arg(known)}: "
                "expected one shape (and type) per input")
        if zero.type is not None:  # (the same shape, one with the type: the type counts)
            shapes[name] = zero
    return shapes


def parse_shape(spec: str) -> tuple[str, ZeroInput]:
    """``--shape NAME=D,D,...[:TYPE]`` as (name, dimensions and element type: None
    where not given). The name is everything before the first ``=`` (it may hold a
    ``:``), the type everything after the last ``:``. No dimensions (``x=``,
    ``x=:i64``) is a scalar, shape ``()``."""
    from wasinn.scheduler.warmup import ZeroInput

    name, sep, value = spec.partition("=")
    dims, colon, type_name = value.rpartition(":") if ":" in value else (value, "", "")
    try:
        shape = tuple(int(d) for d in dims.split(",")) if dims else ()
    except ValueError:
        shape = (0,)  # (refused below, as a dimension < 1 is)
    if not name or not sep or (shape and min(shape) < 1):
        raise InvalidArgumentError(
            f"--shape {spec!r}: expected NAME=D,D,... with dimensions >= 1 (NAME= for a "
            "scalar), or NAME=D,D,...:TYPE (e.g. input=1,3,224,224, or ids=1,8:i64 for an "
            "input whose type the model does not declare)")
    type_ = None
    if colon:
        try:
            type_ = TensorType.coerce(type_name)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"--shape {spec!r}: {exc.message}") from None
    return name, ZeroInput(shape, type_)


def _shape_arg(zero: ZeroInput | tuple[int, ...]) -> str:
    # A --shape's value as written: D,D,... or D,D,...:TYPE ("" or :TYPE for a scalar).
    from wasinn.scheduler.warmup import ZeroInput

    if not isinstance(zero, ZeroInput):
        return ",".join(map(str, zero))
    dims = ",".join(map(str, zero.shape or ()))
    return dims if zero.type is None else f"{dims}:{zero.type.value}"


#: How ``--shape`` gives the element type of an input that declares none (see
#: :data:`wasinn.scheduler.warmup.WARMUP_TYPE_HINT`).
SHAPE_TYPE_HINT = "give it with --shape {name}={dims}:TYPE (e.g. --shape {name}={dims}:i64)"


def check_input_specs(specs: Sequence[str]) -> None:
    """InvalidArgumentError for an ``--input`` that is neither ``NAME=FILE.npy`` nor a
    file name, and for two ``NAME=`` that give one name different files (the same one
    twice counts once); before their files are read (by :func:`read_inputs`)."""
    named: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if (sep and (not name or not path)) or not spec:
            raise InvalidArgumentError(f"--input {spec!r}: expected NAME=FILE.npy or FILE.npz")
        if sep and not _same_file(named.setdefault(name, spec), spec):
            raise InvalidArgumentError(
                f"--input {spec!r}: {name} is already given by --input {named[name]!r}: "
                "expected one value per input")


def _same_file(one: str, other: str) -> bool:
    """Whether two ``NAME=FILE`` specs name one file (``x.npy`` and ``./x.npy``)."""
    first, second = one.partition("=")[2], other.partition("=")[2]
    return first == second or os.path.realpath(first) == os.path.realpath(second)


def _distinct(specs: Sequence[str]) -> list[str]:
    """``specs`` less those that repeat an earlier one: the same spec, or ``NAME=`` the
    same file (checked by :func:`check_input_specs`)."""
    kept: list[str] = []
    named: set[str] = set()
    for spec in dict.fromkeys(specs):
        name, sep, _ = spec.partition("=")
        if sep:
            if name in named:
                continue  # (the same file: check_input_specs refused another)
            named.add(name)
        kept.append(spec)
    return kept


def read_inputs(specs: Sequence[str]) -> dict[str, np.ndarray[Any, Any]]:
    """The arrays ``--input`` names: ``NAME=FILE.npy`` or a whole ``FILE.npz`` (a spec
    given twice is read once).

    Raises InvalidArgumentError for a malformed spec or two that give one name (see
    :func:`check_input_specs`; an archive's names are known once it is read), a file of
    the other kind or one that is not numpy's (not numpy's format, object arrays, a
    corrupt or truncated archive, an archive member that is no array), for one that
    cannot be read, for one whose arrays take more than the memory available (a .npy:
    its size; a .npz: its members' uncompressed sizes; checked before reading) and for
    one whose header declares an array too large to allocate, naming the file.
    """
    check_input_specs(specs)
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    for spec in _distinct(specs):
        name, sep, path = spec.partition("=")
        file = Path(path if sep else spec)
        # Opened here, not by np.load: it leaves the file open when an archive is corrupt.
        try:
            stream = file.open("rb")
        except OSError as exc:
            raise InvalidArgumentError(
                f"--input {spec}: cannot read {file}: {exc.strerror or exc}: expected a "
                f"readable .npy or .npz file") from exc
        with stream:
            if not stream.read(len(_NPY_MAGIC)).startswith((_NPY_MAGIC, *_ZIP_MAGIC)):
                raise InvalidArgumentError(
                    f"--input {spec}: {file} is not a .npy or .npz file: expected one "
                    "written by numpy.save or numpy.savez")
            stream.seek(0)
            try:
                _check_fits(stream, spec, file)
                read = _read_arrays(stream, spec, name if sep else None)
            except _UNREADABLE as exc:  # not numpy's format, object arrays, a bad archive
                raise InvalidArgumentError(
                    f"--input {spec}: {file} is not a .npy or .npz file of plain arrays: "
                    f"{type(exc).__name__}: {exc}") from exc
            except (MemoryError, OverflowError) as exc:
                # numpy allocates what a header declares before reading the data: a few
                # bytes can claim petabytes (past a C long: OverflowError).
                raise InvalidArgumentError(
                    f"--input {spec}: {file} declares an array too large to allocate here: "
                    f"{type(exc).__name__}: {exc}: expected an array that fits in "
                    "memory") from exc
        again = sorted(set(read) & set(arrays))
        if again:
            raise InvalidArgumentError(f"--input {spec}: {again[0]} is already given by an "
                                       "earlier --input: expected one value per input")
        arrays.update(read)
    return arrays


def _check_fits(stream: BinaryIO, spec: str, file: Path) -> None:
    """Raise InvalidArgumentError where the arrays of ``stream`` (a .npy or .npz file,
    left at its start) take more than the memory available now. numpy allocates what a
    header declares and fills it with what the file holds (a .npy's bytes, a .npz
    member's uncompressed size, which its archive's directory declares and zipfile holds
    it to), so that is what it touches; where the kernel overcommits, MemoryError never
    comes and the process is killed instead (see :mod:`wasinn._memory`). A header that
    declares more than the file holds fails the read (MemoryError, or ValueError)."""
    if stream.read(len(_NPY_MAGIC)) == _NPY_MAGIC:
        size = os.fstat(stream.fileno()).st_size
        what = f"{size:,} bytes"
    else:
        with zipfile.ZipFile(stream) as archive:  # (leaves the stream open)
            size = sum(member.file_size for member in archive.infolist())
        what = f"{size:,} bytes of arrays (uncompressed)"
    stream.seek(0)
    available = available_memory()
    if size > available:
        raise InvalidArgumentError(
            f"--input {spec}: {file} holds {what}, more than can be read here "
            f"({available:,} bytes of memory are available now): expected arrays that fit "
            "in memory")


def _read_arrays(stream: BinaryIO, spec: str, name: str | None
                 ) -> dict[str, np.ndarray[Any, Any]]:
    # The arrays of one --input: ``name``'s for NAME=FILE.npy, an archive's (name None).
    loaded = np.load(stream, allow_pickle=False)
    if isinstance(loaded, np.ndarray):
        if name is None:
            raise InvalidArgumentError(
                f"--input {spec}: a single array: give it as --input NAME={spec}")
        return {name: loaded}
    with loaded:
        if name is not None:
            path = spec.partition("=")[2]
            raise InvalidArgumentError(
                f"--input {spec}: {path} is a .npz archive: give it as --input {path} "
                "(every array by its input's name), or NAME=FILE.npy")
        arrays: dict[str, np.ndarray[Any, Any]] = {}
        for key in loaded.files:
            member = loaded[key]  # read now, while the file is open: a bad one fails here
            if not isinstance(member, np.ndarray):
                raise InvalidArgumentError(
                    f"--input {spec}: {spec}: member {key!r} is not a .npy array: expected "
                    "an archive of arrays only (numpy.savez)")
            arrays[key] = member
        return arrays


#: What numpy raises for a file that is not (or no longer) a .npy/.npz of plain arrays:
#: not numpy's format or object arrays (ValueError), a corrupt or truncated zip archive
#: (BadZipFile; EOFError, zlib.error inside a member), an empty file (EOFError).
_UNREADABLE = (ValueError, zipfile.BadZipFile, EOFError, zlib.error)
#: How a .npy file and a zip archive (a .npz) begin.
_NPY_MAGIC = b"\x93NUMPY"
_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")  # (the second: an empty archive)


def complete_inputs(specs: Sequence[TensorSpec], given: Mapping[str, np.ndarray[Any, Any]],
                    *, zeros: bool, shapes: Mapping[str, ZeroInput | tuple[int, ...]]
                    ) -> dict[str, Tensor]:
    """``given`` by input name (a position counts as a name), the rest zero-filled when
    ``zeros``, of the shapes (and types) ``shapes`` gives; 2-byte raw values (``|V2``)
    as bf16, see :func:`_as_declared`. Raises InvalidArgumentError naming the model's
    inputs for a name that is no input, and for inputs left without a value; naming what
    the input expects for a bf16 mismatch, and for a ``--shape`` type where the model
    declares another."""
    return _complete_inputs(specs, given, zeros=zeros, shapes=shapes)[0]


def _complete_inputs(specs: Sequence[TensorSpec], given: Mapping[str, np.ndarray[Any, Any]],
                     *, zeros: bool, shapes: Mapping[str, ZeroInput | tuple[int, ...]]
                     ) -> tuple[dict[str, Tensor], str]:
    # complete_inputs, and what a failed run's error adds where an input of undeclared
    # type was zero-filled as f32 (see wasinn.scheduler.warmup.untyped_hint).
    from wasinn.scheduler.warmup import ZeroInput, type_conflict, untyped_hint, zero_inputs

    names = [spec.name for spec in specs]
    declared = {spec.name: spec for spec in specs}

    def named(key: str) -> str:  # a position, as the input's name
        # ASCII digits only, and few: str.isdigit() holds for '²', which int() refuses,
        # as it does a string of thousands of digits. Such keys are names.
        if re.fullmatch(r"[0-9]{1,9}", key) and int(key) < len(names):
            return names[int(key)]
        return key

    inputs: dict[str, Tensor] = {}
    for key, array in given.items():
        name = named(key)
        if name not in names:
            raise InvalidArgumentError(
                f"--input {key}: the model has no such input: expected one of "
                f"{_described(specs)}")
        if name in inputs:
            raise InvalidArgumentError(f"--input {key}: {name} is given twice (by name and "
                                       "by position): expected one value per input")
        try:
            inputs[name] = Tensor.from_numpy(_as_declared(array, declared[name]))
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"--input {key}: {exc.message}") from None
    by_name: dict[str, ZeroInput | tuple[int, ...]] = {}
    for key, shape in shapes.items():
        name = named(key)
        if name in by_name:
            raise InvalidArgumentError(f"--shape {key}: {name} is given a shape twice "
                                       "(by name and by position): expected one")
        by_name[name] = shape
        spec = declared.get(name)
        type_ = shape.type if isinstance(shape, ZeroInput) else None
        if spec is not None and type_ is not None and (problem := type_conflict(spec, type_)):
            raise InvalidArgumentError(f"--shape {key}={_shape_arg(shape)}: {problem}")
    shapes = by_name
    unknown = sorted(set(shapes) - set(names))
    if unknown:
        raise InvalidArgumentError(f"--shape {unknown[0]}: the model has no such input: "
                                   f"expected one of {_described(specs)}")
    missing = [spec for spec in specs if spec.name not in inputs]
    if missing and not zeros:
        raise InvalidArgumentError(
            f"no value for {_described(missing)}: give --input NAME=FILE.npy, or --zeros")
    if not missing:
        return inputs, ""
    zeroed = {k: v for k, v in shapes.items() if k in {s.name for s in missing}}
    filled = zero_inputs(missing, zeroed, shape_hint="give it with --shape {name}=D,D,... "
                         "({name}= for a scalar; and :TYPE where f32 will not do, e.g. "
                         "{name}=1,8:i64)")
    inputs.update(filled)
    return inputs, untyped_hint(missing, filled, zeroed, SHAPE_TYPE_HINT)


def _as_declared(array: np.ndarray[Any, Any], spec: TensorSpec) -> np.ndarray[Any, Any]:
    """``array``, read from a file, as input ``spec``'s values: 2-byte raw values
    (``|V2``, how numpy saves an ``ml_dtypes.bfloat16`` array) as bf16 where the input may
    be bf16. Raises InvalidArgumentError for raw values where the model declares another
    type, and for values of another type where it declares bf16 (the backend would refuse
    them too; this says how to write a bf16 file)."""
    bf16 = numpy_dtype(TensorType.BF16)
    if array.dtype == RAW_2_BYTES:
        # A model that declares no type (TorchScript) gets them as bf16 and decides.
        if spec.type is TensorType.BF16 or not spec.type_known:
            return array.view(bf16)
        raise InvalidArgumentError(
            "2-byte raw values (numpy dtype |V2, as numpy saves an ml_dtypes.bfloat16 "
            f"array) but the model expects {spec.describe()}: expected {spec.type.value} "
            "values (|V2 is read as bf16, for a bf16 input)")
    if spec.type_known and spec.type is TensorType.BF16 and array.dtype != bf16:
        try:
            given = tensor_type_of(array.dtype).value
        except InvalidArgumentError:
            given = f"numpy {array.dtype}"
        raise InvalidArgumentError(
            f"{given} values but the model expects {spec.describe()}: "
            "expected bf16 values, saved from an ml_dtypes.bfloat16 array (numpy.save(FILE, "
            "a.astype(ml_dtypes.bfloat16)), which numpy stores as |V2)")
    return array


def _described(specs: Sequence[TensorSpec]) -> str:
    return ", ".join(spec.describe() for spec in specs) or "none"


async def infer(rt: Runtime, name: str, given: Mapping[str, np.ndarray[Any, Any]], *,
                zeros: bool = False,
                shapes: Mapping[str, ZeroInput | tuple[int, ...]] | None = None,
                target: str | None = None, load: Load | None = None,
                tally: LoadTally | None = None) -> InferReport:
    """Run ``name`` as the module docstring says; the outputs of the last request and
    the callers' latencies. ``tally`` (a fresh one), where given, is filled in as the
    requests complete: where ``infer`` is cancelled (a load test stopped by Ctrl-C) or
    fails, what it had measured until then stays there. Cancelled, the requests running
    are cancelled and the graph's unload too (a cancelled unload has still unloaded)."""
    load = load or Load()
    tally = LoadTally() if tally is None else tally
    graph = await rt.load_by_name(name)
    tally.graph = graph
    try:
        inputs, hint = _complete_inputs(graph.inputs, given, zeros=zeros, shapes=shapes or {})
        await _drive(graph, inputs, target, load, tally, hint)
        return tally.report()
    finally:
        await graph.unload()


class LoadTally:
    """What :func:`infer` has measured so far, kept as its requests complete: the
    requests completed, each one's latency as its caller saw it, the last one's outputs,
    and the seconds from the first request's start to the end of the last (or to the
    cancellation that stopped them; until then, to now). Read it where ``infer`` did not
    return (a load test stopped by Ctrl-C): :meth:`report`."""

    __slots__ = ("_began", "_ended", "concurrency", "graph", "latencies", "outputs")

    def __init__(self) -> None:
        #: The graph whose requests these are (None until it is loaded).
        self.graph: Graph | None = None
        #: How many callers sent them.
        self.concurrency = 0
        self.latencies: list[float] = []
        self.outputs: dict[str, Tensor] = {}
        self._began: float | None = None
        self._ended: float | None = None

    @property
    def completed(self) -> int:
        """The requests completed so far."""
        return len(self.latencies)

    @property
    def seconds(self) -> float:
        """Seconds from the first request's start to the last one's end (0 before)."""
        if self._began is None:
            return 0.0
        ended = time.perf_counter() if self._ended is None else self._ended
        return ended - self._began

    def report(self) -> InferReport:
        """What was measured so far, as :func:`infer` reports it (the model's stats as
        they are now: its cancelled requests counted too). RuntimeError before a request
        has completed: there is nothing to report."""
        if self.graph is None or not self.latencies:
            raise RuntimeError("no request has completed: nothing to report")
        return InferReport(self.outputs, self.latencies, self.seconds, self.concurrency,
                           self.graph.stats())

    def _start(self, concurrency: int) -> None:
        self.concurrency = concurrency
        self._began = time.perf_counter()

    def _completed(self, latency: float, outputs: dict[str, Tensor]) -> None:
        self.latencies.append(latency)
        self.outputs = outputs

    def _stop(self) -> None:
        self._ended = time.perf_counter()


class InferReport:
    """What ``infer`` measured: the last outputs, every request's latency as its caller
    saw it and the model's stats (queued and running apart)."""

    __slots__ = ("concurrency", "latencies", "model", "outputs", "seconds")

    def __init__(self, outputs: dict[str, Tensor], latencies: list[float], seconds: float,
                 concurrency: int, model: ModelStats) -> None:
        self.outputs = outputs
        self.latencies = sorted(latencies)
        self.seconds = seconds
        self.concurrency = concurrency
        self.model = model

    @property
    def rate(self) -> float:
        """Requests per second over the whole run."""
        return len(self.latencies) / self.seconds if self.seconds > 0 else math.inf

    def describe_load(self) -> str:
        from wasinn.actors.stats import percentile

        ms = [1e3 * (percentile(self.latencies, f) or 0.0) for f in (0.5, 0.99)]
        return (f"{len(self.latencies)} requests from {self.concurrency} concurrent "
                f"caller(s) in {self.seconds:.2f} s: {self.rate:.1f} requests/s, latency "
                f"p50 {ms[0]:.2f} ms p99 {ms[1]:.2f} ms, mean "
                f"{1e3 * statistics.fmean(self.latencies):.2f} ms")


async def _drive(graph: Graph, inputs: dict[str, Tensor], target: str | None,
                 load: Load, tally: LoadTally, hint: str = "") -> None:
    # ``load``'s requests, each one's latency and outputs kept in ``tally`` as it
    # completes (cancelled, the callers stop and it keeps what they did until then).
    # Every caller's context is made first: a target no device provides fails here. A
    # failed request's error gets the hint on an input of undeclared type (untyped_hint).
    contexts = [graph.init_execution_context(target) for _ in range(load.concurrency)]
    remaining = load.requests
    failure: WasiNNError | None = None

    async def caller(ctx: ExecutionContext, scope: trio.CancelScope) -> None:
        nonlocal remaining, failure
        while remaining > 0:
            remaining -= 1
            began = time.perf_counter()
            try:
                outputs = await ctx.compute(inputs, timeout=load.timeout)
            except WasiNNError as exc:  # the first one ends the run, raised as it is
                failure = failure or exc
                scope.cancel()
                return
            tally._completed(time.perf_counter() - began, outputs)

    tally._start(load.concurrency)
    try:
        with collapsed_groups():  # (a Ctrl-C meanwhile reaches the caller as itself)
            async with trio.open_nursery() as nursery:
                for ctx in contexts:
                    nursery.start_soon(caller, ctx, nursery.cancel_scope)
    finally:
        tally._stop()
        for ctx in contexts:
            ctx.close()
    if failure is not None:
        from wasinn.scheduler.warmup import hinted

        raise hinted(failure, hint)


def _finite_mean(values: np.ndarray[Any, Any]) -> float:
    """The mean of finite f64 ``values``, also where their sum would overflow (values near
    f64's maximum): then computed on the values scaled by the largest magnitude."""
    with np.errstate(over="ignore"):
        mean = float(values.mean())
    if math.isfinite(mean):
        return mean
    scale = float(np.abs(values).max())
    return float((values / scale).mean()) * scale


def describe_output(name: str, tensor: Tensor, top: int = 5) -> str:
    """One line: type, shape, range and the ``top`` largest values along the last axis
    (of its first row). The range and the mean are of the finite values, the NaNs and
    infinities counted apart (one NaN would make them all NaN); NaN ranks last among the
    largest values, an infinity where its sign puts it."""
    array = tensor.numpy()
    dims = ", ".join(map(str, tensor.dims))
    line = f"{name}: {tensor.type.value}[{dims}]"
    if array.size == 0:
        return line + " (empty)"
    if array.dtype.kind in "iu":  # exact: an i64 beyond 2**53 is no float's
        return line + _integer_summary(array, top)
    values = array.astype(np.float64)
    finite = values[np.isfinite(values)]
    if finite.size:
        line += (f" min {finite.min():.6g} max {finite.max():.6g} "
                 f"mean {_finite_mean(finite):.6g}")
    nans = int(np.isnan(values).sum())
    infinite = values.size - finite.size - nans
    apart = [f"{count} {what}" for count, what in ((nans, "NaN"), (infinite, "infinite"))
             if count]
    if apart:
        line += (" (" if finite.size else " (no finite value: ") + ", ".join(apart) + ")"
    row = values.reshape(-1, values.shape[-1])[0] if values.ndim else values.reshape(1)
    if row.size > 1:
        order = np.lexsort((-np.arange(row.size), np.where(np.isnan(row), -np.inf, row),
                            ~np.isnan(row)))
        best = order[::-1][:top]
        line += "; largest along the last axis: " + ", ".join(
            f"[{i}] {row[i]:.6g}" for i in best)
    return line


def _integer_summary(array: np.ndarray[Any, Any], top: int) -> str:
    # describe_output's range, mean and largest values of an integer tensor, the values
    # exact (the mean as a float).
    line = (f" min {int(array.min())} max {int(array.max())} "
            f"mean {_finite_mean(array.astype(np.float64)):.6g}")
    row = array.reshape(-1, array.shape[-1])[0] if array.ndim else array.reshape(1)
    if row.size > 1:
        best = np.lexsort((-np.arange(row.size), row))[::-1][:top]
        line += "; largest along the last axis: " + ", ".join(
            f"[{i}] {int(row[i])}" for i in best)
    return line
