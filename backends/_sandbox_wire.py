"""The messages between the host and a sandboxed graph's process (see :mod:`.sandbox`).

Bulk data (a model's bytes, a run's inputs and outputs) does not go through the socket:
it lies in an :class:`Arena`, a memory file both processes map. The socket carries
headers only, which place each tensor in the arena by its offset. The host writes a
request's tensors from the arena's start and says where the child may write its reply's
(``reply_at``, past them: an output may share memory with an input). A reply whose
tensors do not fit asks for a larger arena (``{"grow": N}``); the host grows it and asks
for the same reply again (:data:`AGAIN`).

The host trusts what it sends, so its requests are pickled. It does not trust the child:
a library bug that let a model run code in the child must not reach the host through
its replies, so the child answers in JSON (never unpickled), and the host checks every
tensor's description (:func:`read_reply`) against the arena and against what the
request may get back (:class:`Expected`: a run's outputs as the graph declared them when
it was loaded, :class:`DeclaredOutputs`, of the bytes the child may hold), all of them
before it copies any: a reply cannot make the host copy, or grow the arena, past what
the graph's outputs can take. On Linux the arena is a ``memfd`` sealed against
shrinking, so nothing the child does to it can make the host's mapping fault.

The host copies into the arena, and gives its pages back, with the GIL released (numpy's
copy; libc's ``fallocate``): the trio loop, which serves every other request, goes on
while a big model's bytes are copied for its process (measured on a 2-core machine, a
256 MB model's load stopped the host's every thread 0.2-0.5 s before, now 10-30 ms).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import itertools
import json
import math
import mmap
import os
import pickle
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from wasinn.enums import TensorType
from wasinn.errors import InvalidArgumentError, UnknownNameError, quoted
from wasinn.tensor import Tensor, check_dims, numpy_dtype

from ._graphio import OutputSelector
from .base import TensorSpec

#: The longest header, and the largest arena, a child may ask the host to believe (a
#: reply's request for a larger arena is bounded by what it may hold too: see
#: :meth:`Expected.largest_arena`).
MAX_HEADER = 16 * 1024 * 1024
MAX_ARENA = 1 << 40
#: Where tensors start in the arena: a multiple of this (a cache line, and SIMD loads).
ALIGN = 64
#: The verb of the request that asks again for a reply that did not fit.
AGAIN = "again"


def _aligned(offset: int, to: int = ALIGN) -> int:
    return -(-offset // to) * to


class Arena:
    """A memory file mapped by the host and one child: :meth:`create` in the host (which
    alone grows it), :meth:`attach` in the child (which follows the size the host's
    requests give)."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = 0
        self._map: mmap.mmap | None = None
        self._map_size(size)

    @classmethod
    def create(cls, size: int = 1 << 20) -> Arena:
        """A new arena of ``size`` bytes (more as :meth:`grow` asks): a ``memfd`` sealed
        against shrinking where the system has them, else an unlinked temporary file."""
        if hasattr(os, "memfd_create"):
            fd = os.memfd_create("wasinn-sandbox", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        else:  # pragma: no cover - not Linux
            with tempfile.TemporaryFile() as file:
                fd = os.dup(file.fileno())
        try:
            os.ftruncate(fd, size)
            import fcntl  # (not on Windows, where no sandbox runs)

            if hasattr(fcntl, "F_ADD_SEALS"):
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
            return cls(fd, size)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int) -> Arena:
        """The child's side of the arena whose descriptor it inherited."""
        return cls(fd, os.fstat(fd).st_size)

    def _map_size(self, size: int) -> None:
        old, self._map = self._map, mmap.mmap(self.fd, size) if size else None
        self.size = size
        if old is not None:  # a tensor still over it keeps it mapped until it goes
            with contextlib.suppress(BufferError):
                old.close()

    def grow(self, size: int) -> None:
        """Make the arena at least ``size`` bytes (the host only; at least doubling).
        OSError when it cannot: the system has not the memory, or a file or a mapping
        that large cannot be made (2**63 bytes: OverflowError, said as EFBIG)."""
        if size > self.size:
            size = _aligned(max(size, 2 * self.size), mmap.PAGESIZE)
            try:
                os.ftruncate(self.fd, size)
                self._map_size(size)
            except (OverflowError, ValueError) as exc:
                raise OSError(errno.EFBIG, f"{size} bytes: {exc}") from None

    def follow(self, size: int) -> None:
        """Map ``size`` bytes, the size the host gave the arena (the child only)."""
        if size != self.size:
            self._map_size(size)

    def release(self) -> None:
        """Give the memory of the arena's pages back (they read as zeros after); its size
        stays. Where the system cannot, nothing. By libc's ``fallocate`` (a hole punched
        over the whole file), which ctypes calls with the GIL released: mmap's
        ``madvise(MADV_REMOVE)``, the same operation in the kernel, holds it (60-110 ms
        for a 256 MB model's pages, every thread of the host stopped); ``madvise`` only
        where ``fallocate`` cannot."""
        if not self.size:
            return
        punch = _fallocate()
        if punch is not None and punch(self.fd, _PUNCH_HOLE, 0, self.size) == 0:
            return
        if self._map is not None and hasattr(mmap, "MADV_REMOVE"):
            self._map.madvise(mmap.MADV_REMOVE)

    def view(self, offset: int, nbytes: int) -> memoryview:
        """``nbytes`` of the arena at ``offset``, shared (no copy)."""
        if self._map is None:
            return memoryview(b"")
        return memoryview(self._map)[offset:offset + nbytes]

    def close(self) -> None:
        """Unmap the arena and close its descriptor (once)."""
        self._map_size(0)
        fd, self.fd = self.fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


#: ``FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE`` (``linux/falloc.h``): a file's pages
#: freed, its size kept.
_PUNCH_HOLE = 0x01 | 0x02


@functools.cache
def _fallocate() -> Callable[[int, int, int, int], int] | None:
    """libc's ``fallocate`` (64-bit offsets), or None where there is none (not Linux)."""
    try:
        fallocate = ctypes.CDLL(None, use_errno=True).fallocate64
    except (OSError, AttributeError, TypeError):
        return None
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fallocate.restype = ctypes.c_int
    return fallocate


def _host_bytes(tensor: Tensor) -> np.ndarray[Any, Any]:
    """A tensor's host data in native byte order and C order (copied only where it is not
    already). Its bytes only: np.ascontiguousarray makes a 0-d array 1-d, so the
    dimensions sent are always the tensor's own."""
    return np.ascontiguousarray(tensor.numpy(), dtype=numpy_dtype(tensor.type))


def _place(arena: Arena, tensors: Mapping[str, Tensor], start: int, grow: bool
           ) -> tuple[list[list[Any]] | None, int]:
    """Write ``tensors`` to the arena from ``start``: their descriptions ``[name, type,
    dims, offset]`` (None when they do not fit and ``grow`` is false: nothing written),
    and where the last ends. Grows the arena to hold them when ``grow``."""
    arrays = [(name, tensor, _host_bytes(tensor)) for name, tensor in tensors.items()]
    offsets, end = [], start
    for _, _, array in arrays:
        offsets.append(_aligned(end))
        end = offsets[-1] + array.nbytes
    if end > arena.size:
        if not grow:
            return None, end
        arena.grow(end)
    described = []
    for (name, tensor, array), offset in zip(arrays, offsets, strict=True):
        if array.nbytes:
            # numpy copies with the GIL released (a memoryview's assignment holds it: the
            # host's every thread, its trio loop's included, stood still while a model's
            # bytes were copied, 0.2-0.5 s for 256 MB). The arena stays mapped while
            # the copy's views of it live (see Arena._map_size), whoever grows or closes it.
            np.copyto(np.frombuffer(arena.view(offset, array.nbytes), np.uint8),
                      array.reshape(-1).view(np.uint8))
        described.append([name, tensor.type.value, list(tensor.dims), offset])
    return described, end


def send(conn: Connection, header: bytes) -> None:
    conn.send_bytes(header)


def receive(conn: Connection) -> bytes:
    """One header. Raises EOFError when the other end is gone, OSError for one longer
    than :data:`MAX_HEADER`."""
    return conn.recv_bytes(MAX_HEADER)


# -- the host's requests -----------------------------------------------------------------
def request(arena: Arena, payload: object, tensors: Mapping[str, Tensor] | None = None,
            *, reserve: int = 0) -> bytes:
    """A request from the host: ``tensors`` written to the arena (grown to hold them and
    ``reserve`` bytes past them for the reply), and the header describing them."""
    described, end = _place(arena, tensors or {}, 0, grow=True)
    reply_at = _aligned(end)
    arena.grow(reply_at + reserve)
    return pickle.dumps((payload, described, arena.size, reply_at),
                        protocol=pickle.HIGHEST_PROTOCOL)


def read_request(arena: Arena, header: bytes) -> tuple[Any, dict[str, Tensor], int]:
    """A request as the child reads it: the payload, its tensors over the arena (no
    copy), and where the reply's tensors may start."""
    payload, described, size, reply_at = pickle.loads(header)  # from the host: trusted
    arena.follow(size)
    tensors = {}
    for name, type_, dims, offset in described:
        ttype = TensorType(type_)
        tensors[name] = Tensor.from_bytes(
            dims, ttype, arena.view(offset, math.prod(dims) * ttype.itemsize))
    return payload, tensors, reply_at


# -- the child's replies -------------------------------------------------------------------
def reply(arena: Arena, payload: dict[str, Any], tensors: Mapping[str, Tensor] | None = None,
          *, at: int = 0) -> tuple[bytes, bool]:
    """A reply from the child: ``tensors`` written to the arena from ``at``, and the
    header (JSON) describing them; or, when they do not fit, ``{"grow": N}`` (an arena
    of N bytes would hold them) and False."""
    described, end = _place(arena, tensors or {}, at, grow=False)
    if described is None:
        return json.dumps({"grow": end}).encode(), False
    return json.dumps({**payload, "tensors": described}).encode(), True


def read_reply(arena: Arena, header: bytes, expected: Expected
               ) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A child's reply, checked, its tensors copied out of the arena: ValueError for
    anything that is not one (an ``error`` that is not ``[class, message]`` included).
    Every tensor's description is checked against ``expected`` (what the request may
    get back) and the arena before any is copied: the outputs asked for, each once, as
    the graph declared them, their bytes within the arena, apart and
    ``expected.most`` at most together; so a reply cannot make the host copy more than
    that. A reply ``{"grow": N}`` comes back as it is, N checked: more than the arena's
    size, and no more than what ``expected`` can need."""
    try:
        payload = json.loads(header)
    except RecursionError:  # ("[" * 100_000: json nests by recursion)
        raise ValueError("a reply nested too deeply") from None
    if not isinstance(payload, dict):
        raise ValueError("a reply that is no JSON object")  # noqa: TRY004 - one kind
    error = payload.get("error")
    if "error" in payload and not (isinstance(error, list) and len(error) == 2
                                   and all(isinstance(part, str) for part in error)):
        raise ValueError(f"an error reported as {error!r:.80}: expected [class, message]")
    if "grow" in payload:
        size, most = payload["grow"], expected.largest_arena(arena.size)
        if type(size) is not int or not arena.size < size <= most:
            raise ValueError(f"a reply asking for an arena of {size!r:.40} bytes: expected "
                             f"more than its {arena.size} and at most {most}")
        return payload, {}
    described = payload.pop("tensors", [])
    if not isinstance(described, list):
        raise ValueError("a reply whose tensors are no list")  # noqa: TRY004 - one kind
    if "error" in payload:
        if described:
            raise ValueError("a reply with an error and tensors")
        return payload, {}
    placed = _placed(arena, described, expected)
    return payload, {name: Tensor.from_bytes(shape, ttype,
                                             bytearray(arena.view(offset, nbytes)))
                     for name, ttype, shape, offset, nbytes in placed}


#: A tensor of a reply, as its description places it in the arena: its name, element
#: type, dimensions, offset and bytes.
_Placed = tuple[str, TensorType, tuple[int, ...], int, int]


def _placed(arena: Arena, described: list[Any], expected: Expected) -> list[_Placed]:
    """The tensors ``described`` places in ``arena``, checked (see :func:`read_reply`);
    ValueError at the first that is not one ``expected``, or not in the arena. Nothing
    copied."""
    placed: list[_Placed] = []
    seen: set[str] = set()
    total = 0
    for entry in described:  # (one past those expected at most: that one is refused)
        name, ttype, shape, offset, nbytes = _place_of(arena, entry)
        if name in seen:
            raise ValueError(f"tensor {quoted(name)} described twice")
        problem = expected.problem(name, ttype, shape)
        if problem is not None:
            raise ValueError(problem)
        seen.add(name)
        total += nbytes
        placed.append((name, ttype, shape, offset, nbytes))
    problem = expected.missing(seen)
    if problem is not None:
        raise ValueError(problem)
    if total > expected.most:
        raise ValueError(f"outputs of {total} bytes together: expected at most "
                         f"{expected.most}, what the sandbox process may hold")
    spans = sorted((offset, offset + nbytes, name)
                   for name, _, _, offset, nbytes in placed if nbytes)
    for (_, end, before), (start, _, name) in itertools.pairwise(spans):
        if start < end:
            raise ValueError(f"tensors {quoted(before)} and {quoted(name)} share bytes of "
                             "the arena: expected each output in bytes of its own")
    return placed


def _place_of(arena: Arena, entry: object) -> _Placed:
    """``[name, type, dims, offset]``, checked against the arena: ValueError for anything
    else, or bytes outside it."""
    if not (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], str)
            and isinstance(entry[1], str) and isinstance(entry[2], list)
            and type(entry[3]) is int):
        raise ValueError(f"a tensor described as {entry!r:.80}")
    name, type_, dims, offset = entry
    try:
        ttype = TensorType(type_)
        shape = check_dims(dims, ttype.itemsize)
    except (ValueError, InvalidArgumentError) as exc:
        raise ValueError(f"tensor {name!r:.80}: {exc}") from None
    nbytes = math.prod(shape) * ttype.itemsize
    if not 0 <= offset <= arena.size - nbytes:
        raise ValueError(f"tensor {name!r:.80}: {nbytes} bytes at offset {offset}, outside "
                         f"the arena's {arena.size}")
    return name, ttype, shape, offset, nbytes


class Expected:
    """What a reply may hold (see :func:`read_reply`): the outputs a run asked for
    (``wanted``: each under its declared name, with its spec), of a graph whose outputs
    ``declared`` describes, taking ``most`` bytes at most together (the memory the
    sandbox process may hold: it cannot have computed more). ``Expected()`` is a reply
    that holds no tensor (a load's, an error's) and may not ask for a larger arena."""

    __slots__ = ("_declared", "most", "wanted")

    def __init__(self, declared: DeclaredOutputs | None = None,
                 wanted: Mapping[str, TensorSpec] | None = None, most: int = 0) -> None:
        self._declared = declared
        self.wanted: Mapping[str, TensorSpec] = wanted or {}
        self.most = most

    def largest_arena(self, size: int) -> int:
        """The largest arena a reply may ask for, beside one of ``size`` bytes (which
        holds the request's tensors, before the reply's place): room for the wanted
        outputs' bytes, at most :data:`MAX_ARENA`."""
        if not self.wanted:
            return size
        return min(MAX_ARENA, size + self.most + ALIGN * len(self.wanted))

    def problem(self, name: str, ttype: TensorType, dims: tuple[int, ...]) -> str | None:
        """What is wrong with an output ``name`` of ``ttype[dims]`` in the reply (None:
        it is one of those wanted, as declared)."""
        if self._declared is None:
            return f"tensor {quoted(name)} in a reply that has none"
        return self._declared.problem_with(name, ttype, dims, self.wanted)

    def missing(self, names: Iterable[str]) -> str | None:
        """What is missing from a reply of outputs ``names`` (None: nothing)."""
        if self._declared is None:
            return None
        return self._declared.missing(names, self.wanted)


# -- a run's outputs against the graph's declaration ------------------------------------------
class DeclaredOutputs:
    """What a graph declared of its outputs when it was loaded (``specs``, ``aliases``, and
    whether its element types hold: ``typed``), which every run's outputs must match: the
    host checks a child's replies against it before copying anything (a compromised child
    could answer anything that fits the arena: see :class:`Expected`), and the child its
    library's outputs before it answers (a model that declares a shape it does not
    compute then fails its run, instead of its process being retired for answering
    badly)."""

    def __init__(self, backend: str, specs: Sequence[TensorSpec], aliases: Mapping[str, int],
                 typed: bool) -> None:
        self.backend = backend
        self._specs = tuple(specs)
        self._selector = OutputSelector(backend, self._specs, aliases=aliases)
        self._typed = typed
        #: What a run that names no outputs gets: every one (once per run: made once).
        self._every = {spec.name: spec for spec in self._specs}

    def wanted(self, asked: Sequence[str] | None) -> dict[str, TensorSpec]:
        """The outputs a run that asked for ``asked`` (names, aliases or positions; None:
        every output) gets, by their declared names. UnknownNameError for an output the
        graph lacks."""
        if asked is None:
            return self._every
        return {self._specs[i].name: self._specs[i] for i in self._selector.select(asked)}

    def expect(self, asked: Sequence[str] | None, most: int) -> Expected:
        """What the reply to a run that asked for ``asked`` may hold (see
        :class:`Expected`); UnknownNameError as :meth:`wanted`."""
        return Expected(self, self.wanted(asked), most)

    def problem(self, outputs: Mapping[str, Tensor], asked: Sequence[str] | None
                ) -> str | None:
        """What is wrong with ``outputs``, a run's, for a run that asked for ``asked``
        (names, aliases or positions; None: every output), or None: they must be the
        outputs asked for, each once under its declared name, each of its declared element
        type (where the graph's types hold) and rank, each static dimension of its
        declared size (a dynamic one may take any size; a spec of unknown rank, any
        shape)."""
        try:
            wanted = self.wanted(asked)
        except UnknownNameError as exc:
            return f"outputs for a run that asked for one the model lacks ({exc.message})"
        for name, tensor in outputs.items():
            problem = self.problem_with(name, tensor.type, tensor.dims, wanted)
            if problem is not None:
                return problem
        return self.missing(outputs, wanted)

    def problem_with(self, name: str, ttype: TensorType, dims: tuple[int, ...],
                     wanted: Mapping[str, TensorSpec]) -> str | None:
        """What is wrong with an output ``name`` of ``ttype[dims]`` among the ``wanted``
        ones (see :meth:`problem`), or None."""
        spec = wanted.get(name)
        if spec is None:
            why = ("the run did not ask for" if self._declared(name)
                   else "the model does not declare")
            return (f"output {quoted(name)}, which {why}: expected outputs "
                    f"{_describe(wanted.values())}")
        if not self._fits(ttype, dims, spec):
            return (f"output {quoted(name)} is {ttype.value}{list(dims)}: "
                    f"expected {spec.describe()}, as the model declares")
        return None

    def missing(self, names: Iterable[str], wanted: Mapping[str, TensorSpec]) -> str | None:
        """The outputs of ``wanted`` that ``names`` (each one of them) lacks, or None."""
        names = set(names)
        if len(names) == len(wanted):  # (each of them is one it wanted: checked before)
            return None
        absent = [spec for name, spec in wanted.items() if name not in names]
        return f"no output {_describe(absent)}: expected outputs {_describe(wanted.values())}"

    def _declared(self, name: str) -> bool:
        return any(spec.name == name for spec in self._specs)

    def _fits(self, ttype: TensorType, dims: tuple[int, ...], spec: TensorSpec) -> bool:
        if self._typed and spec.type_known and ttype is not spec.type:
            return False
        if not spec.rank_known:
            return True
        if len(dims) != len(spec.shape):
            return False
        for want, got in zip(spec.shape, dims, strict=True):  # (a loop: once per run)
            if want is not None and want != got:
                return False
        return True


def _describe(specs: Iterable[TensorSpec]) -> str:
    return ", ".join(spec.describe() for spec in specs) or "none"
