"""A bulk conversion of component ``list<u8>`` (and ``list<u64>``) values for wasmtime-py.

wasmtime-py converts a ``list<u8>`` one element at a time through ctypes (about
335 ms for a 602,112-byte image into the host and 370 ms back). Wasmtime's C API
represents the list as an array of ``wasmtime_component_val_t`` (32 bytes each:
the kind byte at offset 0, the payload union at offset 8); this module fills and
reads that array with two strided numpy views instead, which leaves only Wasmtime's
own per-element handling behind its C API.

The fast path depends on private layout, so:

* :data:`CHECKED_VERSIONS` pins the wasmtime versions it was checked on (the same
  range is in the ``wasmtime`` dependency comment of ``pyproject.toml``);
* :func:`layout_problems` checks the structure layout and round-trips a small list
  through the stock converters at import; ``tests/test_component_fastlist.py`` fails
  if either ever changes;
* outside the range, or when the layout check fails, :func:`install` leaves the stock
  converters in place and warns (:class:`FastListUnavailable`).

:func:`install` patches ``wasmtime.component.ListType`` for ``list<u8>`` and
``list<u64>`` only; every other list keeps the stock conversion. A ``list<u64>`` is
read as its little-endian bytes (a :class:`WordBytes`) and written from any bytes-like
value, so the ``wasinn:nn/bulk`` extension moves tensor data eight bytes per value.
Kind constants come from ``wasmtime._ffi``.
"""

from __future__ import annotations

import ctypes
import threading
import warnings
from collections.abc import Callable
from importlib.metadata import version as _dist_version
from typing import Any

import numpy as np
from wasmtime import _ffi as ffi
from wasmtime.component import _types as ctypes_mod

#: wasmtime-py releases whose value layout this module was checked against: [low, high).
CHECKED_VERSIONS = ((50, 0), (51, 0))

_VAL = ffi.wasmtime_component_val_t
_VAL_SIZE = 32
_PAYLOAD = 8
_U8 = int(ffi.WASMTIME_COMPONENT_U8.value)
_U64 = int(ffi.WASMTIME_COMPONENT_U64.value)

ByteSource = bytes | bytearray | memoryview | np.ndarray[Any, Any]


class FastListUnavailable(UserWarning):
    """The installed wasmtime-py is outside the checked range or its layout changed."""


def _version_tuple(text: str) -> tuple[int, ...]:
    parts: list[int] = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def wasmtime_version() -> tuple[int, ...]:
    return _version_tuple(_dist_version("wasmtime"))


def version_supported(ver: tuple[int, ...] | None = None) -> bool:
    """True when ``ver`` (default: the installed wasmtime) lies in :data:`CHECKED_VERSIONS`."""
    v = wasmtime_version() if ver is None else ver
    low, high = CHECKED_VERSIONS
    return low <= v < high


def _rows(data_ptr: Any, count: int) -> np.ndarray[Any, Any]:
    """A writable (count, 32) uint8 view over ``count`` values starting at ``data_ptr``."""
    address = ctypes.cast(data_ptr, ctypes.c_void_p).value
    if not address or count == 0:
        return np.zeros((0, _VAL_SIZE), dtype=np.uint8)
    raw = (ctypes.c_uint8 * (count * _VAL_SIZE)).from_address(address)
    rows: np.ndarray[Any, Any] = np.frombuffer(memoryview(raw), dtype=np.uint8)
    return rows.reshape(count, _VAL_SIZE)


def _field(struct: Any, name: str) -> tuple[int, int]:
    """(offset, size) of a ctypes field."""
    descriptor = getattr(struct, name)
    return int(descriptor.offset), int(descriptor.size)


def layout_problems() -> list[str]:
    """Every mismatch between this module's layout assumptions and the installed wasmtime."""
    problems: list[str] = []
    union = ffi.wasmtime_component_valunion_t
    vallist = ffi.wasmtime_component_vallist_t
    checks = {
        "sizeof(wasmtime_component_val_t)": (ctypes.sizeof(_VAL), _VAL_SIZE),
        "offsetof(val, kind)": (_field(_VAL, "kind")[0], 0),
        "sizeof(val.kind)": (_field(_VAL, "kind")[1], 1),
        "offsetof(val, of)": (_field(_VAL, "of")[0], _PAYLOAD),
        "offsetof(union, u8)": (_field(union, "u8")[0], 0),
        "offsetof(union, u64)": (_field(union, "u64")[0], 0),
        "offsetof(vallist, size)": (_field(vallist, "size")[0], 0),
        "offsetof(vallist, data)": (_field(vallist, "data")[0], 8),
    }
    for what, (got, want) in checks.items():
        if got != want:
            problems.append(f"{what} is {got}, expected {want}")
    if problems:
        return problems
    # Round trip: values written by the stock U8 converter must read back through the
    # strided view, and values written through the view must read back through ctypes.
    sample = bytes([0, 1, 127, 128, 255])
    raw = ffi.wasmtime_component_vallist_t()
    ffi.wasmtime_component_vallist_new_uninit(raw, len(sample))
    try:
        u8 = ctypes_mod.U8()
        for i, b in enumerate(sample):
            u8.convert_to_c(None, b, ctypes.pointer(raw.data[i]))  # type: ignore[arg-type]
        rows = _rows(raw.data, len(sample))
        if bytes(rows[:, 0]) != bytes([_U8]) * len(sample):
            problems.append("the kind byte of a u8 value is not at offset 0")
        if bytes(rows[:, _PAYLOAD]) != sample:
            problems.append(f"the payload of a u8 value is not at offset {_PAYLOAD}")
        rows[:, _PAYLOAD] = np.frombuffer(sample[::-1], dtype=np.uint8)
        if bytes(int(raw.data[i].of.u8) for i in range(len(sample))) != sample[::-1]:
            problems.append("a payload written through the view does not read back via ctypes")
    finally:
        ffi.wasmtime_component_vallist_delete(ctypes.byref(raw))
    return problems


def _flat_bytes(data: ByteSource) -> np.ndarray[Any, Any]:
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return np.frombuffer(data, dtype=np.uint8)


def bytes_to_vallist(data: ByteSource, ptr: Any) -> None:
    """Store ``data`` as a ``list<u8>`` value at ``ptr`` (a ``wasmtime_component_val_t *``)."""
    src = _flat_bytes(data)
    raw = ffi.wasmtime_component_vallist_t()
    ffi.wasmtime_component_vallist_new_uninit(raw, src.size)
    rows = _rows(raw.data, src.size)
    rows[:, 0] = _U8
    rows[:, _PAYLOAD] = src
    ptr.contents.kind = ffi.WASMTIME_COMPONENT_LIST
    ptr.contents.of.list = raw


def words_to_vallist(data: ByteSource, ptr: Any) -> None:
    """Store ``data`` as a ``list<u64>`` of little-endian words, zero-padding the last one."""
    src = _flat_bytes(data)
    count = (src.size + 7) // 8
    raw = ffi.wasmtime_component_vallist_t()
    ffi.wasmtime_component_vallist_new_uninit(raw, count)
    rows = _rows(raw.data, count)
    rows[:, 0] = _U64
    whole = src.size // 8
    rows[:whole, _PAYLOAD:_PAYLOAD + 8] = src[: whole * 8].reshape(whole, 8)
    if whole != count:
        tail = np.zeros(8, dtype=np.uint8)
        tail[: src.size - whole * 8] = src[whole * 8:]
        rows[whole, _PAYLOAD:_PAYLOAD + 8] = tail
    ptr.contents.kind = ffi.WASMTIME_COMPONENT_LIST
    ptr.contents.of.list = raw


def _read_list(c: Any, kind: int, width: int) -> bytes:
    try:
        rows = _rows(c.of.list.data, c.of.list.size)
        # Wasmtime types every element of a typed list alike; a sparse check (every
        # 4096th kind byte and the last) catches a layout surprise without a full pass.
        kinds = np.concatenate((rows[::4096, 0], rows[-1:, 0]))
        if kinds.size and int(np.count_nonzero(kinds != kind)):
            raise TypeError("a bulk list value holds an element of another type")
        return np.ascontiguousarray(rows[:, _PAYLOAD:_PAYLOAD + width]).tobytes()
    finally:
        ffi.wasmtime_component_vallist_delete(ctypes.byref(c.of.list))


def vallist_to_bytes(c: Any) -> bytes:
    """Read (and free, as the stock converter does) a ``list<u8>`` value."""
    return _read_list(c, _U8, 1)


def vallist_to_words(c: Any) -> bytes:
    """Read (and free) a ``list<u64>`` value as its little-endian bytes (8 per element)."""
    return _read_list(c, _U64, 8)


class WordBytes(bytes):
    """Bytes to be passed as a ``list<u64>`` (zero-padded to whole words), not a list of ints."""


_stock_to_c: Callable[..., None] = ctypes_mod.ListType.convert_to_c
_stock_from_c: Callable[..., Any] = ctypes_mod.ListType.convert_from_c
class _InstallState:
    lock = threading.Lock()
    installed = False




def _fast_to_c(self: Any, store: Any, val: Any, ptr: Any) -> None:
    if isinstance(val, bytes | bytearray | memoryview | np.ndarray):
        element = self.element
        if isinstance(element, ctypes_mod.U8):
            bytes_to_vallist(val, ptr)
            return
        if isinstance(element, ctypes_mod.U64):
            words_to_vallist(val, ptr)
            return
    _stock_to_c(self, store, val, ptr)


def _fast_from_c(self: Any, c: Any) -> Any:
    element = self.element
    if isinstance(element, ctypes_mod.U8):
        return vallist_to_bytes(c)
    if isinstance(element, ctypes_mod.U64) and getattr(_words_scope, "active", False):
        return WordBytes(vallist_to_words(c))
    return _stock_from_c(self, c)


_words_scope = threading.local()


class words_as_bytes:
    """In this thread, read ``list<u64>`` values as bytes (wasinn guests only).

    Outside the scope a ``list<u64>`` still reads as a list of ints, as stock
    wasmtime-py does, so other users of wasmtime-py in the process see no change.
    """

    def __enter__(self) -> None:
        self._previous = getattr(_words_scope, "active", False)
        _words_scope.active = True

    def __exit__(self, *exc: object) -> None:
        _words_scope.active = self._previous


def install() -> bool:
    """Use the bulk conversion for every ``list<u8>``; idempotent.

    Returns False (after a :class:`FastListUnavailable` warning) and keeps the stock
    conversion when the wasmtime version is outside :data:`CHECKED_VERSIONS` or the
    layout check fails.
    """
    with _InstallState.lock:
        if _InstallState.installed:
            return True
        if not version_supported():
            warnings.warn(FastListUnavailable(
                f"wasmtime {_dist_version('wasmtime')} is outside the range the fast list<u8> "
                f"path was checked on ({CHECKED_VERSIONS}): using the slow stock conversion"),
                stacklevel=2)
            return False
        problems = layout_problems()
        if problems:
            warnings.warn(FastListUnavailable(
                "wasmtime's component value layout changed (" + "; ".join(problems)
                + "): using the slow stock conversion"), stacklevel=2)
            return False
        ctypes_mod.ListType.convert_to_c = _fast_to_c  # type: ignore[method-assign]
        ctypes_mod.ListType.convert_from_c = _fast_from_c  # type: ignore[method-assign]
        _InstallState.installed = True
        return True


def uninstall() -> None:
    """Restore the stock conversion (benchmarks compare the two)."""
    with _InstallState.lock:
        ctypes_mod.ListType.convert_to_c = _stock_to_c  # type: ignore[method-assign]
        ctypes_mod.ListType.convert_from_c = _stock_from_c  # type: ignore[method-assign]
        _InstallState.installed = False


def installed() -> bool:
    return _InstallState.installed
