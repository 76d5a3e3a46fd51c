"""``wasinn infer``: run a registered model or pipeline from the command line, no guest.

::

    wasinn infer [--config FILE] [--nn-preload ...] [--wasi nn-graph=...] NAME
                 [--input NAME=FILE.npy | --input FILE.npz]... [--zeros] [--shape NAME=D,D,...]...
                 [--target cpu|gpu|tpu] [--requests N] [--concurrency C] [--timeout S]
                 [--save FILE.npz]

``NAME`` is an entry of the config's registry (``[models.NAME]`` or ``[pipelines.NAME]``)
or a model registered on the command line as for ``wasinn run``. Inputs come from numpy
files: ``--input x=x.npy`` for one, ``--input inputs.npz`` for every array of the archive
by name (an input's position works as its name). ``--zeros`` fills the inputs not given
with zeros of the model's shapes (dynamic dimensions as 1, or as ``--shape`` gives).

``--requests N`` runs N requests from ``--concurrency C`` callers, each with an execution
context of its own, as a load test would: the command then prints the requests per
second, the latency percentiles as the callers saw them, and the model's and each
device's stats (time queued and time running apart). The outputs of the last request
are printed (type, shape, range and, along the last axis, the five largest values) and,
with ``--save``, written to a numpy archive (see :func:`save_outputs`).

bf16 has no type in numpy's file format: numpy saves an ``ml_dtypes.bfloat16`` array as
2-byte raw values (``|V2``). ``--input`` reads such values as bf16 where the model's input
may be bf16, and ``--save`` writes bf16 outputs so (load them with
``numpy.load(FILE)[NAME].view(ml_dtypes.bfloat16)``). Values of another type for a bf16
input are refused, as any other type mismatch is, saying how to write a bf16 file.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
import secrets
import stat
import statistics
import time
import zipfile
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np
import trio

from wasinn.enums import TensorType
from wasinn.errors import InvalidArgumentError, WasiNNError
from wasinn.tensor import Tensor, numpy_dtype, tensor_type_of

if TYPE_CHECKING:
    from wasinn.actors.stats import ModelStats
    from wasinn.backends.base import TensorSpec
    from wasinn.scheduler import ExecutionContext, Graph, Runtime


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


def parse_shapes(specs: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """Every ``--shape NAME=D,D,...``; InvalidArgumentError for a name given twice."""
    shapes: dict[str, tuple[int, ...]] = {}
    for spec in specs:
        name, shape = parse_shape(spec)
        if name in shapes:
            raise InvalidArgumentError(
                f"--shape {spec!r}: {name} already has the shape "
                f"{','.join(map(str, shapes[name]))}: expected one --shape per input")
        shapes[name] = shape
    return shapes


def parse_shape(spec: str) -> tuple[str, tuple[int, ...]]:
    """``--shape NAME=D,D,...`` as (name, dimensions)."""
    name, sep, dims = spec.partition("=")
    try:
        shape = tuple(int(d) for d in dims.split(","))
    except ValueError:
        shape = ()
    if not name or not sep or not shape or min(shape) < 1:
        raise InvalidArgumentError(
            f"--shape {spec!r}: expected NAME=D,D,... with dimensions >= 1 "
            "(e.g. input=1,3,224,224)")
    return name, shape


def check_input_specs(specs: Sequence[str]) -> None:
    """InvalidArgumentError for an ``--input`` that is neither ``NAME=FILE.npy`` nor a
    file name (its files are read by :func:`read_inputs`)."""
    for spec in specs:
        name, sep, path = spec.partition("=")
        if (sep and (not name or not path)) or not spec:
            raise InvalidArgumentError(f"--input {spec!r}: expected NAME=FILE.npy or FILE.npz")


def read_inputs(specs: Sequence[str]) -> dict[str, np.ndarray[Any, Any]]:
    """The arrays ``--input`` names: ``NAME=FILE.npy`` or a whole ``FILE.npz``.

    Raises InvalidArgumentError for a malformed spec, a file of the other kind or one that
    is not numpy's (not numpy's format, object arrays, a corrupt or truncated archive,
    an archive member that is no array), for one that cannot be read and for one whose
    header declares an array too large to allocate, naming the file.
    """
    check_input_specs(specs)
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    for spec in specs:
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
                    *, zeros: bool, shapes: Mapping[str, tuple[int, ...]]
                    ) -> dict[str, Tensor]:
    """``given`` by input name (a position counts as a name), the rest zero-filled when
    ``zeros``; 2-byte raw values (``|V2``) as bf16, see :func:`_as_declared`. Raises
    InvalidArgumentError naming the model's inputs for a name that is no input, and for
    inputs left without a value; naming what the input expects for a bf16 mismatch."""
    from wasinn.scheduler.warmup import zero_inputs

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
    by_name: dict[str, tuple[int, ...]] = {}
    for key, shape in shapes.items():
        name = named(key)
        if name in by_name:
            raise InvalidArgumentError(f"--shape {key}: {name} is given a shape twice "
                                       "(by name and by position): expected one")
        by_name[name] = shape
    shapes = by_name
    unknown = sorted(set(shapes) - set(names))
    if unknown:
        raise InvalidArgumentError(f"--shape {unknown[0]}: the model has no such input: "
                                   f"expected one of {_described(specs)}")
    missing = [spec for spec in specs if spec.name not in inputs]
    if missing and not zeros:
        raise InvalidArgumentError(
            f"no value for {_described(missing)}: give --input NAME=FILE.npy, or --zeros")
    if missing:
        inputs.update(zero_inputs(
            missing, {k: v for k, v in shapes.items() if k in {s.name for s in missing}},
            shape_hint="give it with --shape {name}=D,D,..."))
    return inputs


def _as_declared(array: np.ndarray[Any, Any], spec: TensorSpec) -> np.ndarray[Any, Any]:
    """``array``, read from a file, as input ``spec``'s values: 2-byte raw values
    (``|V2``, how numpy saves an ``ml_dtypes.bfloat16`` array) as bf16 where the input may
    be bf16. Raises InvalidArgumentError for raw values where the model declares another
    type, and for values of another type where it declares bf16 (the backend would refuse
    them too; this says how to write a bf16 file)."""
    bf16 = numpy_dtype(TensorType.BF16)
    if array.dtype == _RAW_2_BYTES:
        if spec.type is TensorType.BF16 or _type_undeclared(spec):
            return array.view(bf16)
        raise InvalidArgumentError(
            "2-byte raw values (numpy dtype |V2, as numpy saves an ml_dtypes.bfloat16 "
            f"array) but the model expects {spec.describe()}: expected {spec.type.value} "
            "values (|V2 is read as bf16, for a bf16 input)")
    if spec.type is TensorType.BF16 and array.dtype != bf16:
        try:
            given = tensor_type_of(array.dtype).value
        except InvalidArgumentError:
            given = f"numpy {array.dtype}"
        raise InvalidArgumentError(
            f"{given} values but the model expects {spec.describe()}: "
            "expected bf16 values, saved from an ml_dtypes.bfloat16 array (numpy.save(FILE, "
            "a.astype(ml_dtypes.bfloat16)), which numpy stores as |V2)")
    return array


def _type_undeclared(spec: TensorSpec) -> bool:
    # A TorchScript model declares no types: its inputs say f32 of unknown rank, a
    # placeholder its backend does not check. Raw values go to it as bf16 and the backend
    # decides (one that does declare f32 of unknown rank refuses bf16, naming both).
    return spec.type is TensorType.F32 and not spec.rank_known


#: How numpy's format stores bf16, which it has no type for: 2-byte raw values.
_RAW_2_BYTES = np.dtype("V2")


def _described(specs: Sequence[TensorSpec]) -> str:
    return ", ".join(spec.describe() for spec in specs) or "none"


async def infer(rt: Runtime, name: str, given: Mapping[str, np.ndarray[Any, Any]], *,
                zeros: bool = False, shapes: Mapping[str, tuple[int, ...]] | None = None,
                target: str | None = None, load: Load | None = None) -> InferReport:
    """Run ``name`` as the module docstring says; the outputs of the last request and
    the callers' latencies."""
    load = load or Load()
    graph = await rt.load_by_name(name)
    try:
        inputs = complete_inputs(graph.inputs, given, zeros=zeros, shapes=shapes or {})
        outputs, latencies, seconds = await _drive(graph, inputs, target, load)
        return InferReport(outputs, latencies, seconds, load.concurrency, graph.stats())
    finally:
        await graph.unload()


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
                 load: Load) -> tuple[dict[str, Tensor], list[float], float]:
    # The last request's outputs, every request's latency and the whole run's seconds.
    # Every caller's context is made first: a target no device provides fails here.
    contexts = [graph.init_execution_context(target) for _ in range(load.concurrency)]
    latencies: list[float] = []
    last: dict[str, Tensor] = {}
    remaining = load.requests
    failure: WasiNNError | None = None

    async def caller(ctx: ExecutionContext, scope: trio.CancelScope) -> None:
        nonlocal remaining, last, failure
        while remaining > 0:
            remaining -= 1
            began = time.perf_counter()
            try:
                outputs = await ctx.compute(inputs, timeout=load.timeout)
            except WasiNNError as exc:  # the first one ends the run, raised as it is
                failure = failure or exc
                scope.cancel()
                return
            latencies.append(time.perf_counter() - began)
            last = outputs

    began = time.perf_counter()
    try:
        async with trio.open_nursery() as nursery:
            for ctx in contexts:
                nursery.start_soon(caller, ctx, nursery.cancel_scope)
    finally:
        for ctx in contexts:
            ctx.close()
    if failure is not None:
        raise failure
    return last, latencies, time.perf_counter() - began


def describe_output(name: str, tensor: Tensor, top: int = 5) -> str:
    """One line: type, shape, range and the ``top`` largest values along the last axis
    (of its first row)."""
    array = tensor.numpy()
    dims = ", ".join(map(str, tensor.dims))
    line = f"{name}: {tensor.type.value}[{dims}]"
    if array.size == 0:
        return line + " (empty)"
    values = array.astype(np.float64)
    line += (f" min {values.min():.6g} max {values.max():.6g} "
             f"mean {values.mean():.6g}")
    row = values.reshape(-1, values.shape[-1])[0] if values.ndim else values.reshape(1)
    if row.size > 1:
        best = np.argsort(row, kind="stable")[::-1][:top]
        line += "; largest along the last axis: " + ", ".join(
            f"[{i}] {row[i]:.6g}" for i in best)
    return line


def check_save_path(path: Path) -> None:
    """Before any run: InvalidArgumentError when ``--save`` names a file that cannot be
    written (its folder missing, or a folder itself)."""
    if not path.parent.is_dir():
        raise InvalidArgumentError(f"--save {path}: there is no folder {path.parent}: "
                                   "expected a file in an existing folder")
    if path.is_dir():
        raise InvalidArgumentError(f"--save {path}: a folder: expected a file name "
                                   "(FILE.npz)")


def save_outputs(path: Path, outputs: Mapping[str, Tensor]) -> None:
    """The outputs as a numpy archive, as ``numpy.savez`` writes one: a ``NAME.npy``
    member per output (numpy's own format), whatever the name (``file``, ``a/b:0``,
    non-ASCII), so ``numpy.load(path)[NAME]`` and ``--input path`` give each back by its
    name. A bf16 output is stored as numpy stores an ``ml_dtypes.bfloat16`` array: 2-byte
    raw values (``|V2``), which ``.view(ml_dtypes.bfloat16)`` (or ``--input``) reads as bf16.

    The archive is written to a new file beside the target (through a symbolic link, the
    file it names), then renamed onto it: a save that fails leaves what was there as it
    was. The new file keeps a replaced file's permissions. A target that is not a regular
    file (``/dev/stdout``, a pipe, a FIFO, a device) is written into as ``open(path,
    "wb")`` would, never replaced; so is a file in a folder where no new file may be
    created. Raises InvalidArgumentError,
    naming the file, for names no archive can hold (with a NUL character, which zip member
    names cannot hold, or both ``X`` and ``X.npy``, which ``numpy.load`` cannot tell
    apart) and for a file that cannot be written (read-only, a full disk, a folder not
    writable).
    """
    _check_member_names(path, outputs)
    target = Path(os.path.realpath(path))
    if target.exists() and not os.access(target, os.W_OK):  # as open("wb") would refuse
        raise InvalidArgumentError(
            f"--save {path}: {target} is read-only: expected a file wasinn may write, or a "
            "new name")
    if _special(target):
        _write_into(path, outputs)
        return
    temporary = target.with_name(f".{target.name}.{secrets.token_hex(8)}.tmp")
    created = False
    try:
        try:
            # O_EXCL: never someone else's file; 0o666 less the umask, as open() gives.
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except PermissionError:
            if not target.exists():
                raise
            _write_into(path, outputs)  # a file we may write, in a folder we may not
            return
        created = True
        with os.fdopen(fd, "wb") as file:
            with contextlib.suppress(FileNotFoundError):  # (a new file: open()'s mode)
                os.fchmod(fd, stat.S_IMODE(os.stat(target).st_mode))
            _write_archive(file, outputs)
            file.flush()
            os.fsync(fd)  # the data on disk before the rename makes it the target
        os.replace(temporary, target)
    except OSError as exc:
        if created:
            temporary.unlink(missing_ok=True)
        raise InvalidArgumentError(
            f"--save {path}: cannot write {target}: {exc.strerror or exc}: expected a "
            "writable folder with room for the archive") from exc
    except BaseException:
        if created:
            temporary.unlink(missing_ok=True)
        raise


def _special(target: Path) -> bool:
    # Whether target exists and is not a regular file: a pipe, a FIFO or a device, which
    # a rename would replace by a regular file (root's /dev/null included).
    try:
        return not stat.S_ISREG(os.stat(target).st_mode)
    except OSError:  # (none there; or the write below names the error)
        return False


def _write_into(path: Path, outputs: Mapping[str, Tensor]) -> None:
    # The archive, built in memory (a pipe cannot seek), written into the file at path.
    archive = io.BytesIO()
    _write_archive(archive, outputs)
    try:
        with open(path, "wb") as file:
            file.write(archive.getbuffer())
    except OSError as exc:
        raise InvalidArgumentError(
            f"--save {path}: cannot write into it: {exc.strerror or exc}: expected a file, "
            "pipe or device wasinn may write") from exc


def _check_member_names(path: Path, outputs: Mapping[str, Tensor]) -> None:
    # InvalidArgumentError for an output name that the archive would not give back.
    for name in outputs:
        if "\0" in name:
            raise InvalidArgumentError(
                f"--save {path}: output {name!r} has a NUL character, which a zip member "
                "name cannot hold: expected names without one")
        if name.endswith(".npy") and name.removesuffix(".npy") in outputs:
            raise InvalidArgumentError(
                f"--save {path}: outputs {name.removesuffix('.npy')!r} and {name!r} cannot "
                f"share an archive: numpy.load reads its member {name!r} for both: expected "
                "names that differ by more than a '.npy' ending")
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidArgumentError(
                f"--save {path}: output {name!r} is not valid Unicode: expected a name "
                "that UTF-8 can write, as a zip member name is") from None


def _write_archive(file: BinaryIO, outputs: Mapping[str, Tensor]) -> None:
    # What numpy.savez writes, without its keyword arguments, which output names can
    # collide with (an output named "file" or "allow_pickle"): stored, zip64 members.
    with zipfile.ZipFile(file, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, tensor in outputs.items():
            array = tensor.numpy()
            if tensor.type is TensorType.BF16:
                array = array.view(_RAW_2_BYTES)  # what numpy.save makes of bfloat16
            with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, array, allow_pickle=False)
