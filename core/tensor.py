"""``Tensor``: dimensions, element type and data, in host memory or on a device.

A tensor's data is either a numpy array (host memory, in the machine's byte order:
zero-copy for a C-contiguous array in that order, other arrays are copied, see
:meth:`Tensor.from_numpy`) or a *backend-native* value (an ``OrtValue``, a
``torch.Tensor``, an ``ov.Tensor``) that stays where the backend put it, on the CPU or
on a GPU. A native tensor is materialized into host memory only when someone asks for
``numpy()``. Every tensor that leaves backend-native form for a host array is counted
(:func:`host_copies`): a native tensor's first ``numpy()``, and each output a backend
copies to the host itself, run without ``keep_on_device`` (:func:`count_host_copies`), so
tests can prove that chained models never route their intermediate tensors through host
memory.

bf16 has no numpy dtype of its own: wasinn carries it as ``ml_dtypes.bfloat16``,
a real numpy dtype with the same 2-byte layout, so bf16 data is zero-copy as well.
"""

from __future__ import annotations

import math
import numbers
import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import ml_dtypes
import numpy as np
import numpy.typing as npt

from wasinn.enums import TensorType
from wasinn.errors import InvalidArgumentError

_DTYPES: dict[TensorType, np.dtype[Any]] = {
    TensorType.F16: np.dtype(np.float16),
    TensorType.F32: np.dtype(np.float32),
    TensorType.F64: np.dtype(np.float64),
    TensorType.BF16: np.dtype(ml_dtypes.bfloat16),
    TensorType.U8: np.dtype(np.uint8),
    TensorType.I32: np.dtype(np.int32),
    TensorType.I64: np.dtype(np.int64),
}
_TYPES: dict[np.dtype[Any], TensorType] = {dt: tt for tt, dt in _DTYPES.items()}

#: Upper bound on the rank of a tensor; wasi-nn guests never need more.
MAX_RANK = 32


class Buffer(Protocol):
    """What the buffer protocol reads (``bytes``, ``bytearray``, ``memoryview``,
    ``array.array``, ``mmap``...), as :meth:`Tensor.from_bytes` takes it: the type of
    ``collections.abc.Buffer`` (Python 3.12 on), for type checkers only (never checked
    with isinstance)."""

    def __buffer__(self, flags: int, /) -> memoryview: ...


def numpy_dtype(tensor_type: TensorType) -> np.dtype[Any]:
    """The numpy dtype that carries ``tensor_type`` (bf16: ``ml_dtypes.bfloat16``)."""
    return _DTYPES[tensor_type]


def tensor_type_of(dtype: npt.DTypeLike) -> TensorType:
    """The wasi-nn element type of a numpy dtype; InvalidArgumentError if it has none."""
    dt = np.dtype(dtype)
    try:
        return _TYPES[dt.newbyteorder("=")]
    except KeyError:
        expected = ", ".join(t.value for t in TensorType)
        raise InvalidArgumentError(
            f"numpy dtype {dt} has no wasi-nn element type: expected one of {expected}"
        ) from None


class _CopyCounter:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0

    def add(self) -> None:
        with self.lock:
            self.count += 1


_HOST_COPIES = _CopyCounter()


def host_copies() -> int:
    """How many tensors have left backend-native form for host memory in this process so
    far: native tensors materialized by ``Tensor.numpy()`` (once each: it caches) and
    outputs that a backend copied to host arrays itself, for a run without
    ``keep_on_device`` (ONNX Runtime's ``run`` returning numpy arrays, an OpenVINO output's
    data copied out, a torch output's ``.cpu().numpy()``). A host tensor read, or a native
    value shared with another library without a copy (DLPack, :meth:`Tensor.host_view`),
    is not counted. A sandboxed graph's outputs (:mod:`wasinn.backends.sandbox`) are
    counted whatever ``keep_on_device``: they reach the host from the graph's process."""
    return _HOST_COPIES.count


def count_host_copies(n: int) -> None:
    """Count ``n`` backend-native values a backend has just turned into host arrays (its
    outputs, for a run without ``keep_on_device``): see :func:`host_copies`. For
    backends; ``Tensor.numpy()`` counts its own materializations."""
    counter = _HOST_COPIES
    with counter.lock:  # (inlined, not counter.add: this runs on every host-output run)
        counter.count += n


def as_int(value: object) -> int | None:
    """``value`` as a Python int when it is an integer (numpy's too), else None; a bool
    is not one here (``operator.index(True)`` is 1)."""
    if isinstance(value, bool | np.bool_):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def check_dims(dims: Sequence[int], itemsize: int = 1) -> tuple[int, ...]:
    """Validate tensor dimensions: a sequence of at most MAX_RANK non-negative integers
    (Python or numpy integers; a float such as 2.7 is refused, not truncated) that an
    array of ``itemsize``-byte elements can have.

    Raises InvalidArgumentError saying which dimension is wrong and what was expected.
    """
    try:
        rank = len(dims)
        if rank > MAX_RANK:  # before converting anything: dims may come from a guest
            raise InvalidArgumentError(
                f"tensor rank {rank} is too large: expected <= {MAX_RANK}")
        out = tuple([operator.index(d) for d in dims])
    except TypeError:
        raise _bad_dims(dims) from None
    for d, given in zip(out, dims, strict=True):
        if d < 0 or isinstance(given, bool | np.bool_):  # operator.index(True) is 1
            raise _bad_dims(dims)
    # numpy needs the bytes the non-zero dimensions span to fit its index type, even
    # for an empty tensor ([2**64, 0] holds no element but has no numpy shape).
    if math.prod(d for d in out if d) * itemsize > _MAX_INDEX:
        raise InvalidArgumentError(
            f"tensor dimensions {list(out)} are too large: expected the product of the "
            f"non-zero ones{_times(itemsize)} at most {_MAX_INDEX}, even for an empty tensor")
    return out


def _times(itemsize: int) -> str:
    return "" if itemsize == 1 else f" times the element size ({itemsize} bytes)"


_MAX_INDEX = int(np.iinfo(np.intp).max)


def c_contiguous(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``array`` itself when it is C-contiguous, else a C-contiguous copy of it.

    Unlike ``np.ascontiguousarray``, which returns at least one dimension, this keeps a
    0-d array (a scalar) 0-d: every 0-d array is C-contiguous, so it is returned as it is.
    """
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)


def _bad_dims(dims: object) -> InvalidArgumentError:
    # Which of ``dims`` is wrong (or that they are no sequence), for check_dims.
    expected = f"expected a sequence of at most {MAX_RANK} non-negative integers"
    if isinstance(dims, (str, bytes)) or not isinstance(dims, Sequence | np.ndarray):
        return InvalidArgumentError(
            f"tensor dimensions {dims!r} ({type(dims).__name__}): {expected}")
    for d in dims:
        try:
            ok = operator.index(d) >= 0 and not isinstance(d, bool | np.bool_)
            what = "a boolean" if isinstance(d, bool | np.bool_) else "negative"
        except TypeError:
            ok = False
            what = "not an integer"
        if not ok:
            return InvalidArgumentError(
                f"tensor dimensions {list(dims)}: {d!r} ({type(d).__name__}) is {what}: "
                f"{expected}")
    return InvalidArgumentError(f"tensor dimensions {dims!r}: {expected}")


def _checked_dims(array: np.ndarray[Any, Any], dims: Sequence[int], ttype: TensorType
                  ) -> tuple[int, ...]:
    # The slow half of Tensor's check that its array holds what it says, for an array in
    # the other byte order (which each backend reads as native) or dims given as a list.
    if not isinstance(ttype, TensorType):
        raise InvalidArgumentError(
            f"tensor element type {ttype!r} ({type(ttype).__name__}): expected a "
            "wasinn.TensorType")
    dtype = array.dtype
    if dtype.newbyteorder("=") != _DTYPES[ttype]:
        raise InvalidArgumentError(
            f"tensor of {ttype.value} over an array of {dtype}: expected an array of "
            f"{_DTYPES[ttype]} (or Tensor.from_numpy, which takes the element type from "
            "the array)")
    shape: tuple[int, ...] = array.shape
    try:
        given = check_dims(dims)  # (a list or a numpy array of them, as from_bytes takes)
    except InvalidArgumentError:
        if not _equal_numbers(dims, shape):
            raise
        given = shape  # whole numbers given as floats, equal to the array's: ints kept
    if given != shape:
        raise InvalidArgumentError(
            f"tensor dimensions {list(given)} over an array of shape {list(shape)}: "
            "expected the array's own shape")
    return shape


def _equal_numbers(dims: object, shape: tuple[int, ...]) -> bool:
    # Whether ``dims`` is a sequence of numbers equal to ``shape`` (2.0 for 2), as the
    # constructor's quick check of a tuple takes them.
    if isinstance(dims, (str, bytes)) or not isinstance(dims, Sequence | np.ndarray):
        return False
    try:
        return len(dims) == len(shape) and all(
            isinstance(d, numbers.Real) and not isinstance(d, bool | np.bool_) and d == n
            for d, n in zip(dims, shape, strict=True))
    except TypeError:
        return False


def _canonical(array: np.ndarray[Any, Any], ttype: TensorType) -> np.ndarray[Any, Any]:
    """``array`` (whose elements are of ``ttype``) as a Tensor keeps it: C-contiguous, in
    native byte order, of the one dtype object that carries ``ttype``. The values are
    kept: the other byte order is converted (a copy, which every backend needs: each
    reads the bytes as native), a strided array copied, and a dtype numpy counts as equal
    but libraries tell apart (``np.longlong``, what ONNX Runtime returns for int64, which
    OpenVINO refuses) only relabelled (a view)."""
    dtype = _DTYPES[ttype]
    if not array.dtype.isnative:
        array = array.astype(dtype)
    elif array.dtype is not dtype:
        array = array.view(dtype)
    return c_contiguous(array)


class Tensor:
    """An n-dimensional tensor of one wasi-nn element type.

    Build one with :meth:`from_numpy`, :meth:`from_bytes` or (backends only)
    :meth:`from_native`. The constructor itself takes an array of any strides or byte
    order whose shape is ``dims`` and whose elements are of ``type`` (InvalidArgumentError
    otherwise), and keeps it as :meth:`from_numpy` does: zero-copy when C-contiguous and
    in native byte order, else a C-contiguous copy in native order. ``numpy()`` returns
    host data, materializing a device-resident value once and caching it.
    """

    __slots__ = ("_array", "_host_view", "_materialize", "_native", "_rows", "_synchronize",
                 "device", "dims", "type")

    def __init__(
        self,
        dims: tuple[int, ...],
        type: TensorType,
        *,
        array: np.ndarray[Any, Any] | None = None,
        native: object = None,
        materialize: Callable[[], np.ndarray[Any, Any]] | None = None,
        device: str = "cpu",
        rows: Callable[[int, int], Tensor] | None = None,
        synchronize: Callable[[], None] | None = None,
        host_view: Callable[[], np.ndarray[Any, Any] | None] | None = None,
    ) -> None:
        if array is not None:
            if (dims.__class__ is not tuple or array.shape != dims
                    or array.dtype is not _DTYPES.get(type)
                    or not array.flags.c_contiguous):
                dims = _checked_dims(array, dims, type)
                array = _canonical(array, type)
            else:
                dims = array.shape  # ints, even where equal floats were given
        elif native is None:
            raise InvalidArgumentError(
                f"a tensor of {getattr(type, 'value', type)} {list(dims)} needs its data: "
                "expected array=... (or Tensor.from_numpy / Tensor.from_bytes)")
        self.dims = dims
        self.type = type
        self.device = device
        self._array = array
        self._native = native
        self._materialize = materialize
        self._rows = rows
        self._synchronize = synchronize
        self._host_view = host_view

    # -- construction ---------------------------------------------------------------
    @classmethod
    def from_numpy(cls, array: npt.ArrayLike) -> Tensor:
        """Wrap a numpy array, or anything numpy turns into an array of a wasi-nn element
        type (a nested list of numbers).

        Zero-copy for a C-contiguous array in the machine's byte order. Anything else is
        copied: a list, a non-contiguous array, and an array in the other byte order (a
        ``>f4`` array from a big-endian file), which is converted to native order so the
        backends read the values it holds. A 0-d array or a numpy scalar
        (``np.float32(3)``) makes a rank-0 tensor: dims ``()``, not ``(1,)``. Raises
        InvalidArgumentError for a value numpy cannot turn into an array (a ragged list,
        an object), a dtype with no wasi-nn element type, or more than MAX_RANK dimensions.
        """
        if type(array) is np.ndarray:
            arr = array
        else:
            try:
                arr = np.asarray(array)
            except Exception as exc:  # ValueError (ragged), TypeError, a library's own
                raise InvalidArgumentError(
                    f"cannot make a tensor of a {_type_name(array)}: expected a "
                    "wasinn.Tensor, a numpy array or a nested list of numbers of one shape"
                    f"{_hint(array)} ({exc})") from None
        dtype = arr.dtype
        ttype = _TYPES.get(dtype)  # a native dtype of a wasi-nn type: the usual case
        if ttype is not None:
            # c_contiguous() inlined (this runs on every request): np.ascontiguousarray
            # alone would turn a 0-d array into shape (1,); a 0-d array is C-contiguous.
            if not arr.flags.c_contiguous:
                arr = np.ascontiguousarray(arr)
        else:
            ttype = tensor_type_of(dtype)  # the other byte order, or InvalidArgumentError
            arr = np.asarray(arr, dtype=dtype.newbyteorder("="), order="C")  # keeps rank 0
        if arr.ndim > MAX_RANK:  # numpy allows 64 dimensions
            raise InvalidArgumentError(
                f"tensor rank {arr.ndim} is too large: expected <= {MAX_RANK}")
        return cls(tuple(arr.shape), ttype, array=arr)

    @classmethod
    def from_bytes(
        cls,
        dims: Sequence[int],
        type: TensorType | str,
        data: Buffer | np.ndarray[Any, Any],
    ) -> Tensor:
        """A tensor over raw little-endian bytes, without copying them (a contiguous
        buffer: ``bytes``, ``bytearray``, ``memoryview``, ``array.array``, ``mmap``...,
        or a C-contiguous numpy array whose bytes are taken as they are; a non-contiguous
        one is copied).

        Raises InvalidArgumentError for dimensions that are not non-negative integers, an
        unknown element type, ``data`` that is no bytes-like object, and when its size is
        not ``prod(dims) * itemsize``.
        """
        ttype = TensorType.coerce(type)
        shape = check_dims(dims, ttype.itemsize)
        expected = math.prod(shape) * ttype.itemsize
        if isinstance(data, np.ndarray):
            buf: np.ndarray[Any, Any] | memoryview = data
            if data.dtype.hasobject:
                raise InvalidArgumentError(
                    f"tensor data is a numpy array of {data.dtype}: expected bytes, not "
                    "Python objects")
        else:
            try:
                buf = memoryview(data)
            except TypeError:
                raise InvalidArgumentError(
                    f"tensor data is {data.__class__.__name__}: expected a bytes-like object "
                    "(bytes, bytearray, memoryview or a numpy array)") from None
        size = buf.nbytes
        if size != expected:
            raise InvalidArgumentError(
                f"tensor data is {size} bytes but dimensions {list(shape)} of {ttype.value} "
                f"need {expected} bytes"
            )
        if isinstance(buf, np.ndarray):
            flat = np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
        elif buf.c_contiguous:
            flat = np.frombuffer(buf, dtype=np.uint8)
        else:  # a strided memoryview: numpy reads it through its strides (a copy)
            flat = np.ascontiguousarray(np.asarray(buf)).reshape(-1).view(np.uint8)
        arr = flat.view(_DTYPES[ttype]).reshape(shape)
        return cls(shape, ttype, array=arr)

    @classmethod
    def from_native(
        cls,
        value: object,
        dims: Sequence[int],
        type: TensorType,
        *,
        device: str,
        materialize: Callable[[], np.ndarray[Any, Any]],
        rows: Callable[[int, int], Tensor] | None = None,
        synchronize: Callable[[], None] | None = None,
        host_view: Callable[[], np.ndarray[Any, Any] | None] | None = None,
    ) -> Tensor:
        """A tensor whose data stays in a backend-native value on ``device``.

        ``rows(start, stop)``, where the backend can cut its value along the first axis
        without a copy (a view on the same device), returns those rows as a tensor.
        ``synchronize()`` waits until the value is computed, for a value that may still
        be being written when the run that made it returns (see :meth:`synchronize`).
        ``host_view()``, for a value in host memory that has no DLPack form, returns it as
        a numpy array over that memory (see :meth:`host_view`).
        """
        return cls(tuple(int(d) for d in dims), type, native=value, materialize=materialize,
                   device=device, rows=rows, synchronize=synchronize, host_view=host_view)

    # -- access ---------------------------------------------------------------------
    @property
    def native(self) -> object:
        """The backend-native value, or None for a host tensor."""
        return self._native

    @property
    def is_host(self) -> bool:
        """True when the data is already in host memory (no copy needed to read it)."""
        return self._array is not None

    @property
    def nbytes(self) -> int:
        array = self._array
        if array is not None:
            return int(array.nbytes)
        return math.prod(self.dims) * self.type.itemsize

    def numpy(self) -> np.ndarray[Any, Any]:
        """The data as a numpy array (C-contiguous, of shape ``dims``: 0-d for a rank-0
        tensor), materializing a device-resident value once (counted by
        :func:`host_copies`).

        The array of a backend-native value (an output kept on its device) is read-only:
        some libraries' values it copies (OpenVINO's, any GPU's), others it shows over
        their memory, and an edit would reach some of the graphs it is passed to and not
        others. Edit a copy (``t.numpy().copy()``)."""
        if self._array is None:
            if self._materialize is None:
                raise InvalidArgumentError(
                    f"a tensor of {self.type.value} {list(self.dims)} has no data to read")
            _HOST_COPIES.add()
            array = _canonical(self._materialize(), self.type).view()
            array.flags.writeable = False
            self._array = array
        return self._array

    def synchronize(self) -> None:
        """Wait until the native value is computed. A GPU value (torch's) may still be
        being written on its producer's stream when the run that made it returns; a
        reader on another stream (another library sharing its memory through DLPack)
        waits here first. A no-op for host tensors and for natives that are complete
        when their run returns (ONNX Runtime's, OpenVINO's)."""
        if self._synchronize is not None:
            self._synchronize()

    def host_view(self) -> np.ndarray[Any, Any] | None:
        """The native value's data as a numpy array over its own memory, where that memory
        is the host's and its backend can show it without a copy (an OpenVINO tensor on
        the CPU): for another library to read while this tensor lives, not counted as a
        host copy. None otherwise (use :meth:`numpy`)."""
        return None if self._host_view is None else self._host_view()

    def slice_rows(self, start: int, stop: int) -> Tensor | None:
        """Rows ``start:stop`` of the first axis, sharing this tensor's data: a
        backend-native view on its device, or a view of its host data. None when its
        native value cannot be cut without a copy (an ``OrtValue``): then use
        ``numpy()``."""
        if self._rows is not None:
            return self._rows(start, stop)
        array = self._array
        if array is None:
            return None
        piece = array[start:stop]
        return Tensor(tuple(piece.shape), self.type, array=piece)

    def tobytes(self) -> bytes:
        """The data as raw bytes, as :meth:`from_bytes` takes them: little-endian (host
        data is kept in native order, which :meth:`from_numpy` converts to, and the
        machines wasinn runs on are little-endian)."""
        return self.numpy().tobytes()

    def __repr__(self) -> str:
        where = "host" if self.is_host else f"native@{self.device}"
        return f"Tensor(dims={list(self.dims)}, type={self.type.value}, {where})"


def as_tensor(value: Tensor | npt.ArrayLike) -> Tensor:
    """A Tensor as it is, or anything else through :meth:`Tensor.from_numpy` (zero-copy
    for a C-contiguous array in native byte order, else a copy; InvalidArgumentError for
    a value with no wasi-nn tensor form)."""
    if isinstance(value, Tensor):
        return value
    return Tensor.from_numpy(value)


def _type_name(value: object) -> str:
    """``value``'s type as a user knows it: ``list``, ``torch.Tensor`` (never a bare
    ``Tensor``, which would read as wasinn's)."""
    kind = type(value)
    module = kind.__module__.split(".")[0]
    return kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"


def _hint(value: object) -> str:
    # How to give a library's tensor that numpy cannot take as it is (a torch tensor that
    # needs its gradient, is on a GPU, or is bf16, which numpy has no type for).
    if type(value).__module__.split(".")[0] != "torch":
        return ""
    return ("; give a torch tensor as tensor.detach().cpu().numpy(), a bf16 one as "
            "tensor.detach().cpu().view(torch.int16).numpy().view(ml_dtypes.bfloat16)")
