"""Host functions on wasmtime's "unchecked" C callback: i32 arguments in, one i32 out.

wasmtime-py's ``Linker.define_func`` routes every host call through a generic Python
trampoline that builds a ``Caller``, a ``Val`` per argument and a checked result, and
looks the guest's memory up through the export table: tens of microseconds per call on a
small VM, three or more calls per inference. Every wasi-nn function has only i32
parameters and one i32 result, so wasinn defines them with
``wasmtime_linker_define_func_unchecked`` instead: the callback reads the raw argument
slots, calls the host function with the raw caller pointer, and writes the errno back in
place. The guest's memory is found once per guest and re-read (base, size) per call by
:class:`RawMemory`.

The callback never raises (the functions it calls turn every exception into an errno; a
bug here would print and return no trap). Where this wasmtime-py lacks the raw symbols,
:data:`AVAILABLE` is false and callers use ``define_func``.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable
from typing import Any

import wasmtime

from wasinn.host.abi import MissingMemoryError
from wasinn.host.guest_memory import GuestMemory

try:
    from wasmtime import _bindings as _ffi

    _DEFINE: Any = _ffi.wasmtime_linker_define_func_unchecked
    _CALLBACK_TYPE: Any = _ffi.wasmtime_func_unchecked_callback_t
    _CALLER_PTR: Any = ctypes.POINTER(_ffi.wasmtime_caller_t)
    _EXTERN: Any = _ffi.wasmtime_extern_t
    _EXPORT_GET: Any = _ffi.wasmtime_caller_export_get
    _CONTEXT: Any = _ffi.wasmtime_caller_context
    _MEMORY_DATA: Any = _ffi.wasmtime_memory_data
    _MEMORY_SIZE: Any = _ffi.wasmtime_memory_data_size
    _MEMORY_KIND = 3  # WASMTIME_EXTERN_MEMORY
    # wasmtime calls it when the function is dropped; nothing to free (the callbacks are
    # kept alive by whoever defined them).
    _NO_FINALIZER: Any = _DEFINE.argtypes[8](lambda _env: None)
    AVAILABLE = True
except (ImportError, AttributeError):  # pragma: no cover - another wasmtime-py
    AVAILABLE = False

#: Our own prototype: addresses as plain ints (cheaper than ctypes pointer objects).
_RAW_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_size_t)
#: A wasmtime_val_raw_t slot is 16 bytes; an i32 argument sits in its first 4 (LE).
_SLOT = 16
_ARGS = [struct.Struct("<" + "i12x" * n) for n in range(8)]
_RESULT = struct.Struct("<i")


class RawMemory:
    """One guest's exported ``memory`` seen from raw caller pointers: looked up once,
    its view rebuilt only when its base or size changed (a grown memory may move)."""

    __slots__ = ("_address", "_memory", "_size", "_view")

    def __init__(self) -> None:
        self._memory: Any = None
        self._view: GuestMemory | None = None
        self._address = -1
        self._size = -1

    def get(self, caller: int) -> GuestMemory:
        """The memory for the host call whose ``wasmtime_caller_t*`` is ``caller``.

        Raises MissingMemoryError when the guest exports no memory named ``memory``.
        """
        pointer = ctypes.cast(caller, _CALLER_PTR)
        if self._memory is None:
            item = _EXTERN()
            name = b"memory"
            if not _EXPORT_GET(pointer, name, len(name), ctypes.byref(item)) \
                    or item.kind != _MEMORY_KIND:
                raise MissingMemoryError("the guest exports no linear memory named 'memory'")
            self._memory = item.of.memory
        context = _CONTEXT(pointer)
        memory = ctypes.byref(self._memory)
        address = ctypes.cast(_MEMORY_DATA(context, memory), ctypes.c_void_p).value or 0
        size = int(_MEMORY_SIZE(context, memory))
        view = self._view
        if view is None or address != self._address or size != self._size:
            view = self._view = GuestMemory.at(address, size)
            self._address, self._size = address, size
        return view


def define_raw(linker: wasmtime.Linker, module: str, name: str, nparams: int,
               call: Callable[[int, tuple[int, ...]], int]) -> tuple[Any, Any]:
    """Define ``module.name`` (``nparams`` i32 in, one i32 out) on ``linker``.

    ``call(caller_address, signed_i32_args)`` returns the i32 result and must not raise.
    Returns the ctypes callback objects, which must outlive every store instantiated
    from ``linker`` (keep them alive while the guest runs).
    """
    unpack = _ARGS[nparams].unpack_from
    pack_into = _RESULT.pack_into
    size = _SLOT * max(nparams, 1)

    def callback(_env: int, caller: int, slots: int, _count: int) -> int:
        buffer = (ctypes.c_char * size).from_address(slots)
        errno = call(caller, unpack(buffer))
        pack_into(buffer, 0, errno)
        return 0  # no trap

    raw = _RAW_CALLBACK(callback)
    typed = ctypes.cast(raw, _CALLBACK_TYPE)
    ty = wasmtime.FuncType([wasmtime.ValType.i32()] * nparams, [wasmtime.ValType.i32()])
    module_b, name_b = module.encode(), name.encode()
    error = _DEFINE(linker.ptr(), ctypes.create_string_buffer(module_b), len(module_b),
                    ctypes.create_string_buffer(name_b), len(name_b), ty.ptr(), typed,
                    None, _NO_FINALIZER)
    if error:
        raise wasmtime.WasmtimeError._from_ptr(error)
    return raw, typed
