"""The ``wasi_ephemeral_nn`` import module: one guest's :class:`GuestNN` behind a Linker.

Every host function takes i32 arguments and returns an i32 errno. Each is wrapped so
that nothing a guest sends can raise out of it: arguments are masked to u32 (wasmtime
hands them over signed), a :class:`~wasinn.errors.WasiNNError` becomes its errno (the
reason is logged at debug level), a cancellation of the guest's run interrupts the
guest, and any other exception is logged as a host bug and reported as runtime_error.
No exception ever unwinds into wasmtime, whose "last host exception" is a process-wide
global shared by every guest thread.

Signatures (the wasinn extensions are written down in ``wit/wasinn_ephemeral_nn.witx``)::

    load(builders_ptr, builders_len, encoding, target, graph_out)
    load_by_name(name_ptr, name_len, graph_out)
    load_by_name_with_config(name_ptr, name_len, config_ptr, config_len, graph_out)
    init_execution_context(graph, ctx_out)
    init_execution_context_on(graph, target, ctx_out)                      wasinn
    set_input(ctx, index, tensor_ptr)
    set_input_by_name(ctx, name_ptr, name_len, tensor_ptr)                 wasinn
    set_output_by_name(ctx, name_ptr, name_len, buf_ptr, buf_len, written_ptr)  wasinn
    compute(ctx) / compute_single(ctx)
    get_output(ctx, index, buf_ptr, buf_len, written_ptr) / get_output_single(...)
    get_output_by_name(ctx, name_ptr, name_len, buf_ptr, buf_len, written_ptr)  wasinn
    unload(graph) / finalize_execution_context(ctx) / fini_single(ctx)
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any, cast

import trio
import wasmtime
from wasmtime import _ffi as ffi

from wasinn.errors import InvalidArgumentError, WasiNNError
from wasinn.host.abi import MODULE, Errno, MissingMemoryError, errno_of
from wasinn.host.guest_memory import GuestMemory
from wasinn.host.nn_core import GuestNN

log = logging.getLogger("wasinn.host.nn")

_I32 = wasmtime.ValType.i32()

# The host functions are defined through Wasmtime's C API directly ("unchecked" host
# functions: raw argument slots, no per-call Caller or Val objects), not through
# wasmtime-py's generic trampoline. Measured on a 2-core VM: 3.7 us per host call against
# 11.5 us for ``define_func(..., access_caller=True)`` plus ``caller["memory"]``; a guest
# makes three such calls per inference. The layout these depend on is checked here, at
# import: a wasmtime-py whose C API moved fails loudly instead of misreading arguments.
_VAL_RAW_SIZE = ctypes.sizeof(ffi.wasmtime_val_raw_t)
if _VAL_RAW_SIZE % 4 or _VAL_RAW_SIZE < 8:  # pragma: no cover - a changed C API
    raise ImportError(f"wasmtime_val_raw_t is {_VAL_RAW_SIZE} bytes: wasinn expects 16")
_SLOT_U32S = _VAL_RAW_SIZE // 4
_EXTERN_MEMORY = int(getattr(ffi.WASMTIME_EXTERN_MEMORY, "value", ffi.WASMTIME_EXTERN_MEMORY))
_MEMORY_P = ctypes.POINTER(ffi.wasmtime_memory_t)
# Own prototypes (not wasmtime-py's function objects, whose restype must stay theirs):
# the memory's base as a plain address.
_memory_data = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, _MEMORY_P)(
    ("wasmtime_memory_data", ffi.dll))
_memory_data_size = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_void_p, _MEMORY_P)(
    ("wasmtime_memory_data_size", ffi.dll))
_caller_context = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(
    ("wasmtime_caller_context", ffi.dll))
_caller_export_get = ctypes.CFUNCTYPE(
    ctypes.c_bool, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t,
    ctypes.POINTER(ffi.wasmtime_extern_t))(("wasmtime_caller_export_get", ffi.dll))
#: wasmtime_func_unchecked_callback_t, with plain addresses for its pointers.
_Callback = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_void_p, ctypes.c_size_t)
_Finalizer = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_define_unchecked = ctypes.CFUNCTYPE(
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p,
    ctypes.c_size_t, ctypes.c_void_p, _Callback, ctypes.c_void_p, _Finalizer,
)(("wasmtime_linker_define_func_unchecked", ffi.dll))


class MemoryCache:
    """One guest's exported ``memory``: looked up once, its view rebuilt only when the
    memory's base or size changed since the last host call.

    A wasi-nn call would otherwise spend several microseconds finding and viewing the
    memory; a guest makes three or more per inference. The view is only ever used during
    a host call, after checking that the size is unchanged: a memory moves only when it
    grows, so an unchanged size means an unchanged base.
    """

    __slots__ = ("_context", "_extern", "_memory", "_size", "_view")

    def __init__(self) -> None:
        self._extern = ffi.wasmtime_extern_t()
        self._memory: Any = None  # a pointer to the extern's wasmtime_memory_t, once found
        # The store's wasmtime_context_t *: one guest, one store, whose context lives (at
        # one address) as long as the store does.
        self._context: int | None = None
        self._view: GuestMemory | None = None
        self._size = -1

    def get(self, caller: int) -> GuestMemory:
        """The memory of the guest behind ``caller`` (a ``wasmtime_caller_t *``)."""
        memory = self._memory
        if memory is None:
            found = _caller_export_get(caller, b"memory", 6, ctypes.byref(self._extern))
            if not found or cast(int, self._extern.kind) != _EXTERN_MEMORY:
                raise MissingMemoryError("the guest exports no linear memory named 'memory'")
            memory = self._memory = ctypes.pointer(self._extern.of.memory)
            self._context = _caller_context(caller)
        context = self._context
        size = _memory_data_size(context, memory)
        view = self._view
        if view is None or size != self._size:
            address = _memory_data(context, memory) or 0
            view = self._view = GuestMemory.at(address, size)
            self._size = size
        return view


_OUTPUT = ("buf_ptr", "buf_len", "written_ptr")
#: Every function's parameters (each an i32; each function returns an i32 errno).
PARAMS: dict[str, tuple[str, ...]] = {
    "load": ("builders_ptr", "builders_len", "encoding", "target", "graph_out"),
    "load_by_name": ("name_ptr", "name_len", "graph_out"),
    "load_by_name_with_config": ("name_ptr", "name_len", "config_ptr", "config_len",
                                 "graph_out"),
    "init_execution_context": ("graph", "ctx_out"),
    "init_execution_context_on": ("graph", "target", "ctx_out"),
    "set_input": ("ctx", "index", "tensor_ptr"),
    "set_input_by_name": ("ctx", "name_ptr", "name_len", "tensor_ptr"),
    "set_output_by_name": ("ctx", "name_ptr", "name_len", *_OUTPUT),
    "compute": ("ctx",),
    "compute_single": ("ctx",),
    "get_output": ("ctx", "index", *_OUTPUT),
    "get_output_single": ("ctx", "index", *_OUTPUT),
    "get_output_by_name": ("ctx", "name_ptr", "name_len", *_OUTPUT),
    "unload": ("graph",),
    "finalize_execution_context": ("ctx",),
    "fini_single": ("ctx",),
}


#: name -> (parameter count, whether the GuestNN method takes the guest memory first,
#: the GuestNN method), for each of PARAMS. Methods without memory take handles only.
def _table(nn: GuestNN) -> dict[str, tuple[int, bool, Callable[..., None]]]:
    def init_on(mem: GuestMemory, graph: int, target: int, ctx_out: int) -> None:
        nn.init_execution_context(mem, graph, ctx_out, target=target)

    def init(mem: GuestMemory, graph: int, ctx_out: int) -> None:
        nn.init_execution_context(mem, graph, ctx_out)

    methods: dict[str, tuple[bool, Callable[..., None]]] = {
        "load": (True, nn.load),
        "load_by_name": (True, nn.load_by_name),
        "load_by_name_with_config": (True, nn.load_by_name_with_config),
        "init_execution_context": (True, init),
        "init_execution_context_on": (True, init_on),
        "set_input": (True, nn.set_input),
        "set_input_by_name": (True, nn.set_input_by_name),
        "set_output_by_name": (True, nn.set_output_by_name),
        "compute": (True, nn.compute),
        "compute_single": (True, nn.compute_single),
        "get_output": (True, nn.get_output),
        "get_output_single": (True, nn.get_output),
        "get_output_by_name": (True, nn.get_output_by_name),
        "unload": (False, nn.unload),
        "finalize_execution_context": (False, nn.finalize_execution_context),
        "fini_single": (False, nn.fini_single),
    }
    return {name: (len(PARAMS[name]), *entry) for name, entry in methods.items()}


def check_imports(module: wasmtime.Module, program: str) -> None:
    """InvalidArgumentError naming the first ``wasi_ephemeral_nn`` import of ``module``
    that is not defined here, or is imported with another type, and what is expected.

    For the instantiation of a guest to call first: Wasmtime's own link error says
    "expected" of the guest's import type and "found" of the host's, the reverse of what
    the guest's author needs to read, and names no parameter.
    """
    for imp in module.imports:
        if imp.module != MODULE:
            continue
        name = imp.name or ""
        params = PARAMS.get(name)
        if params is None:
            raise InvalidArgumentError(
                f"{program} imports {MODULE}::{name}, which wasinn does not define: "
                f"expected one of {', '.join(PARAMS)}"
            )
        ty = imp.type
        if not (isinstance(ty, wasmtime.FuncType)
                and [str(t) for t in ty.params] == ["i32"] * len(params)
                and [str(t) for t in ty.results] == ["i32"]):
            raise InvalidArgumentError(
                f"{program} imports {MODULE}::{name} as {_import_kind(ty)}: expected a "
                f"function ({', '.join(f'{p}: i32' for p in params)}) -> i32 (the errno)"
            )


def _import_kind(ty: object) -> str:
    if isinstance(ty, wasmtime.FuncType):
        params = ", ".join(str(t) for t in ty.params)
        return f"a function ({params}) -> ({', '.join(str(t) for t in ty.results)})"
    kinds = {wasmtime.GlobalType: "a global", wasmtime.MemoryType: "a memory",
             wasmtime.TableType: "a table"}
    return kinds.get(type(ty), type(ty).__name__)


class CallGuard:
    """Turns one ABI method into a host function that always returns an errno."""

    __slots__ = ("_slots", "memory_of", "method", "name", "on_cancel", "timed", "with_memory")

    def __init__(self, name: str, method: Callable[..., None], with_memory: bool,
                 on_cancel: Callable[[], None], timed: bool, nparams: int,
                 memory_of: Callable[[int], GuestMemory] | None = None) -> None:
        self.name = name
        #: The guest's memory from the ``wasmtime_caller_t *`` of the host call.
        self.memory_of = memory_of if memory_of is not None else MemoryCache().get
        self.method = method
        self.with_memory = with_memory
        self.on_cancel = on_cancel
        self.timed = timed
        # The raw value slots as u32 words: each i32 parameter is the first word of its
        # slot, read as the u32 the guest meant (wasmtime's are signed); the i32 result
        # goes to the first slot.
        self._slots = ctypes.c_uint32 * (_SLOT_U32S * max(nparams, 1))

    def __call__(self, caller: int, values: int) -> None:
        """Run the method for the raw call (``values``: the argument slots) and write its
        errno into the result slot."""
        start = time.perf_counter() if self.timed else 0.0
        slots = self._slots.from_address(values)
        args = slots[::_SLOT_U32S]
        try:
            if self.with_memory:
                self.method(self.memory_of(caller), *args)
            else:
                self.method(*args)
            errno = Errno.SUCCESS
        except WasiNNError as exc:
            errno = errno_of(exc)
            log.debug("%s%s -> %s: %s", self.name, tuple(args), errno.name.lower(),
                      exc.message)
        except trio.Cancelled:
            # The run_wasm call was cancelled while this call waited in trio: stop the
            # guest at its next epoch check instead of letting it see a result.
            self.on_cancel()
            errno = Errno.RUNTIME_ERROR
        except BaseException:
            log.exception("wasi-nn %s failed inside the host (a wasinn bug); the guest gets "
                          "runtime_error", self.name)
            errno = Errno.RUNTIME_ERROR
        if self.timed:
            log.debug("%s took %.3f ms", self.name, (time.perf_counter() - start) * 1e3)
        slots[0] = errno


#: The guards of every defined host function, by the id Wasmtime hands back as ``env``.
_GUARDS: dict[int, CallGuard] = {}
_next_id = itertools.count(1)


def live_host_functions() -> int:
    """Host functions defined and not yet dropped by Wasmtime, every guest's (16 each):
    for leak checks."""
    return len(_GUARDS)


def _host_call(env: int | None, caller: int | None, values: int | None, count: int) -> int:
    # Entered from wasm with the GIL taken by ctypes. Nothing may raise out of here: a
    # ctypes callback's exception is printed and its result slot left as it was.
    try:
        _GUARDS[env or 0](caller or 0, values or 0)
    except BaseException:  # only if the guard itself is broken
        _broken(values or 0)
    return 0  # no trap: a cancelled guest is stopped by its epoch deadline


def _broken(values: int) -> None:
    with contextlib.suppress(BaseException):  # only while the interpreter shuts down
        log.exception("wasi-nn host call failed before reaching its guard")
        ctypes.c_uint32.from_address(values).value = int(Errno.RUNTIME_ERROR)


def _forget_guard(env: int | None) -> None:
    # Wasmtime dropped the function (its linker and every store using it are gone).
    with contextlib.suppress(BaseException):  # only while the interpreter shuts down
        _GUARDS.pop(env or 0, None)


# Module-level, so that the C function pointers live as long as the process.
_HOST_CALL = _Callback(_host_call)
_FORGET_GUARD = _Finalizer(_forget_guard)


def define_nn(linker: wasmtime.Linker, nn: GuestNN, on_cancel: Callable[[], None]) -> None:
    """Define every ``wasi_ephemeral_nn`` function of :mod:`this module <.>` on ``linker``.

    The guards keep no reference to what a call raised: an exception's traceback reaches
    the frames that hold the guest's Store, so a kept exception would keep every failed
    guest's memory alive. A guard is forgotten when Wasmtime drops its function.
    """
    timed = log.isEnabledFor(logging.DEBUG)
    cache = MemoryCache()
    module = MODULE.encode()
    for name, (nparams, with_memory, method) in _table(nn).items():
        guard = CallGuard(name, method, with_memory, on_cancel, timed, nparams, cache.get)
        ty = wasmtime.FuncType([_I32] * nparams, [_I32])
        key = next(_next_id)
        _GUARDS[key] = guard
        encoded = name.encode()
        error = _define_unchecked(
            ctypes.addressof(linker.ptr().contents), module, len(module), encoded,
            len(encoded), ctypes.addressof(ty.ptr().contents), _HOST_CALL, key, _FORGET_GUARD)
        if error:
            _GUARDS.pop(key, None)
            raise wasmtime.WasmtimeError._from_ptr(
                ctypes.cast(error, ctypes.POINTER(ffi.wasmtime_error_t)))
