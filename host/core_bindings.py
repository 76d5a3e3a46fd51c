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

import ctypes
import logging
import time
from collections.abc import Callable
from typing import Any

import trio
import wasmtime

from wasinn.errors import WasiNNError
from wasinn.host.abi import MODULE, Errno, MissingMemoryError, errno_of
from wasinn.host.guest_memory import GuestMemory
from wasinn.host.nn_core import GuestNN

log = logging.getLogger("wasinn.host.nn")

_I32 = wasmtime.ValType.i32()


def guest_memory(caller: wasmtime.Caller) -> GuestMemory:
    """The calling guest's exported ``memory`` for the duration of this call."""
    return MemoryCache().get(caller)


class MemoryCache:
    """One guest's exported ``memory``: looked up once, its view rebuilt only when the
    memory's base or size changed since the last host call.

    A wasi-nn call costs a few microseconds of ctypes and numpy work to find and view the
    memory; a guest makes three or more per inference, so they are kept. The view is only
    ever used during a host call, after checking that base and size are unchanged (a
    grown memory may have moved).
    """

    __slots__ = ("_address", "_memory", "_size", "_view")

    def __init__(self) -> None:
        self._memory: wasmtime.Memory | None = None
        self._view: GuestMemory | None = None
        self._address = -1
        self._size = -1

    def get(self, caller: wasmtime.Caller) -> GuestMemory:
        memory = self._memory
        if memory is None:
            found = caller.get("memory")
            if not isinstance(found, wasmtime.Memory):
                raise MissingMemoryError("the guest exports no linear memory named 'memory'")
            memory = self._memory = found
        address = ctypes.cast(memory.data_ptr(caller), ctypes.c_void_p).value or 0
        size = memory.data_len(caller)
        view = self._view
        if view is None or address != self._address or size != self._size:
            view = self._view = GuestMemory.at(address, size)
            self._address, self._size = address, size
        return view


#: name -> (parameter count, whether the GuestNN method takes the guest memory first,
#: the GuestNN method). Methods without memory take handles only.
def _table(nn: GuestNN) -> dict[str, tuple[int, bool, Callable[..., None]]]:
    def init_on(mem: GuestMemory, graph: int, target: int, ctx_out: int) -> None:
        nn.init_execution_context(mem, graph, ctx_out, target=target)

    def init(mem: GuestMemory, graph: int, ctx_out: int) -> None:
        nn.init_execution_context(mem, graph, ctx_out)

    return {
        "load": (5, True, nn.load),
        "load_by_name": (3, True, nn.load_by_name),
        "load_by_name_with_config": (5, True, nn.load_by_name_with_config),
        "init_execution_context": (2, True, init),
        "init_execution_context_on": (3, True, init_on),
        "set_input": (3, True, nn.set_input),
        "set_input_by_name": (4, True, nn.set_input_by_name),
        "set_output_by_name": (6, True, nn.set_output_by_name),
        "compute": (1, True, nn.compute),
        "compute_single": (1, True, nn.compute_single),
        "get_output": (5, True, nn.get_output),
        "get_output_single": (5, True, nn.get_output),
        "get_output_by_name": (6, True, nn.get_output_by_name),
        "unload": (1, False, nn.unload),
        "finalize_execution_context": (1, False, nn.finalize_execution_context),
        "fini_single": (1, False, nn.fini_single),
    }


#: The functions and their parameter counts, for documentation and tests.
FUNCTIONS: dict[str, int] = {
    "load": 5, "load_by_name": 3, "load_by_name_with_config": 5,
    "init_execution_context": 2, "init_execution_context_on": 3,
    "set_input": 3, "set_input_by_name": 4, "set_output_by_name": 6,
    "compute": 1, "compute_single": 1,
    "get_output": 5, "get_output_single": 5, "get_output_by_name": 6,
    "unload": 1, "finalize_execution_context": 1, "fini_single": 1,
}


class CallGuard:
    """Turns one ABI method into a host function that always returns an errno."""

    def __init__(self, name: str, method: Callable[..., None], with_memory: bool,
                 on_cancel: Callable[[], None], timed: bool,
                 memory_of: Callable[[Any], GuestMemory] | None = None) -> None:
        self.name = name
        #: The guest's memory from the wasmtime.Caller the host call receives.
        self.memory_of = memory_of if memory_of is not None else MemoryCache().get
        self.method = method
        self.with_memory = with_memory
        self.on_cancel = on_cancel
        self.timed = timed

    def __call__(self, caller: Any, *raw: int) -> int:
        start = time.perf_counter() if self.timed else 0.0
        try:
            args = [a & 0xFFFFFFFF for a in raw]
            if self.with_memory:
                self.method(self.memory_of(caller), *args)
            else:
                self.method(*args)
            errno = Errno.SUCCESS
        except WasiNNError as exc:
            errno = errno_of(exc)
            log.debug("%s%s -> %s: %s", self.name, tuple(raw), errno.name.lower(), exc.message)
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
        return int(errno)


def define_nn(linker: wasmtime.Linker, nn: GuestNN, on_cancel: Callable[[], None]) -> None:
    """Define every ``wasi_ephemeral_nn`` function of :mod:`this module <.>` on ``linker``.

    The guards keep no reference to what a call raised: an exception's traceback reaches
    the frames that hold the guest's Store, and wasmtime-py keeps host functions alive
    for the process, so a kept exception would keep every failed guest's memory alive.
    """
    timed = log.isEnabledFor(logging.DEBUG)
    cache = MemoryCache()
    for name, (nparams, with_memory, method) in _table(nn).items():
        guard = CallGuard(name, method, with_memory, on_cancel, timed, cache.get)
        ty = wasmtime.FuncType([_I32] * nparams, [_I32])
        linker.define_func(MODULE, name, ty, _host_func(guard), access_caller=True)


def _host_func(guard: CallGuard) -> Callable[..., Any]:
    # wasmtime-py passes parameters positionally; a plain function keeps the call cheap.
    def host(caller: wasmtime.Caller, *raw: int) -> int:
        return guard(caller, *raw)

    return host
