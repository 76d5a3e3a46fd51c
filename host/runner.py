"""Running a WebAssembly guest against a runtime: ``run_wasm``.

A core module (WASI preview1, importing ``wasi_ephemeral_nn``) runs here; a component
is handed to :func:`wasinn.host.component.run_component`. Each guest instance gets its
own Store and Linker in its own worker thread (wasm runs without the GIL, so guests run
in parallel); the Engine and compiled modules are shared and cached on disk
(:mod:`wasinn.host.engine`). The guest's wasi-nn calls reach the scheduler through
``trio.from_thread``.

Cancellation: cancelling ``run_wasm`` interrupts the guest wherever it is, and stops
one that has not started yet at once: its compile is left to finish in its worker thread
(which then writes the compile cache as usual). A guest computing in wasm traps at its
next epoch check (:mod:`wasinn.host.interrupt`); a guest waiting in a wasi-nn call has
that call cancelled in trio (which drops its queued tickets), then traps; a guest
sleeping in WASI's ``poll_oneoff`` wakes and traps
(:mod:`wasinn.host.wasi_poll`). Whatever way the guest ends, every context it still
holds is closed and every graph unloaded before ``run_wasm`` returns or raises. A guest
reading its stdin reads a pipe the host fills (:mod:`wasinn.host.guest_stdin`): its
cancellation closes the pipe, so a read that waits for input returns and the guest traps.
A guest blocked in a host call that none of these reach (a read of a FIFO in a directory
it was given) is waited for at most :data:`~wasinn.host.guest_thread.STOP_GRACE_S`
seconds, then its thread is abandoned (:mod:`wasinn.host.guest_thread`): ``run_wasm``
raises all the same and releases what the guest held.

A guest whose limits set ``max_fuel`` runs on the engine that counts fuel, and traps
when its fuel runs out (:mod:`wasinn.host.fuel`); cancellation and ``run_timeout`` stop
it as any other. Its requests are made for its tenant (:mod:`wasinn.host.tenant`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import outcome
import trio
import wasmtime

from wasinn._abandoned import run_abandonable
from wasinn.errors import InvalidArgumentError
from wasinn.host.core_bindings import check_imports, define_nn
from wasinn.host.engine import compile_module, engine_for, is_component
from wasinn.host.fuel import out_of_fuel, ran_out_of_fuel
from wasinn.host.guest_stdin import GuestStdin, guest_stdin
from wasinn.host.guest_thread import GuestPortal, GuestRun
from wasinn.host.interrupt import INTERRUPTED, Interrupter
from wasinn.host.limits import GuestLimits, limit_store, limits_of
from wasinn.host.nn_core import GuestNN
from wasinn.host.scheduler_api import RuntimeLike
from wasinn.host.tenant import guest_tenant
from wasinn.host.wasi import Dirs, wasi_config
from wasinn.host.wasi_poll import define_interruptible_poll

log = logging.getLogger("wasinn.host")

#: Exit status reported for a guest that trapped (as Wasmtime's CLI does: 128 + SIGABRT).
TRAP_EXIT_STATUS = 134

@contextlib.contextmanager
def stopped_after(timeout: float | None, program: str) -> Iterator[None]:
    """Cancel the block (a guest's run) after ``timeout`` seconds (None: never); a block
    so cancelled raises :class:`GuestTrap` naming ``[guests] run_timeout``."""
    if timeout is None:
        yield
        return
    with trio.move_on_after(timeout) as scope:
        yield
    if scope.cancelled_caught:
        raise GuestTrap(f"{program} ran out of time: it ran for more than {timeout:g} s "
                        "([guests] run_timeout)")


class GuestTrap(Exception):
    """The guest trapped (``unreachable``, out-of-bounds access, stack overflow ...).

    ``message`` is wasmtime's trap message including the guest backtrace.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


async def run_wasm(
    rt: RuntimeLike,
    path: str | os.PathLike[str],
    *,
    argv: Sequence[str] = (),
    dirs: Dirs | None = None,
    env: Mapping[str, str] | None = None,
    limits: GuestLimits | None = None,
    stdin: GuestStdin = None,
    tenant: str | None = None,
) -> int:
    """Run the guest at ``path`` (``.wasm`` binary or ``.wat`` text) and return its exit code.

    ``argv``, ``dirs`` and ``env`` are as in :mod:`wasinn.host.wasi`; ``stdin`` is the
    guest's standard input, empty by default (:mod:`wasinn.host.guest_stdin`: bytes, a
    file's path, or ``"inherit"`` for the host's own). ``limits`` defaults
    to the runtime's ``guest_limits`` (from its config) or :class:`GuestLimits`' defaults.
    ``tenant``: whom the guest's requests are for (a fair pool shares device time among
    tenants); None: the file's name, such as ``classify.wasm`` (:mod:`wasinn.host.tenant`).
    Returns the code the guest passed to ``proc_exit`` (0 when ``_start`` returns).
    Raises :class:`GuestTrap` when the guest traps, runs past ``limits.run_timeout`` or
    out of ``limits.max_fuel``, InvalidArgumentError for a file that is not a runnable
    guest (naming what is wrong) or a ``tenant`` that is no str, and OSError if it cannot
    be read.
    Cancellation interrupts the guest and releases its graphs and contexts.
    """
    program = Path(path).name
    tenant = guest_tenant(tenant, program)
    wasm = await trio.Path(path).read_bytes()
    limits = limits or limits_of(rt)
    # Telling text apart converts it (seconds for a large .wat), and compiling takes
    # seconds for a large guest: both in worker threads that cancellation abandons
    # (wasinn._abandoned), so that Ctrl-C stops the run at once. An abandoned compile
    # finishes in its thread and renames its cache entry into place whole
    # (wasinn.host.engine); its module is dropped.
    if await run_abandonable(is_component, wasm):
        from wasinn.host.component import run_component

        return await run_component(rt, wasm, argv=argv, dirs=dirs, env=env, limits=limits,
                                   program=program, stdin=stdin, tenant=tenant)
    module = await run_abandonable(_compile, wasm, program, limits.counts_fuel)
    config = wasi_config(program, argv, dirs, env)
    nn = GuestNN(rt, GuestPortal(), limits, tenant=tenant)
    with guest_stdin(stdin, config) as end_stdin, stopped_after(limits.run_timeout, program):
        return await run_core_module(module, config, nn, program,
                                     stop_also=[end_stdin] if end_stdin else [])


def _compile(wasm: bytes, program: str, fuel: bool) -> wasmtime.Module:
    try:
        return compile_module(wasm, fuel=fuel)
    except wasmtime.WasmtimeError as exc:
        try:  # a binary, or text: wasmtime's own message says what is wrong in it
            readable = wasm.startswith(b"\0asm") or bool(wasm.decode())
        except UnicodeDecodeError:
            readable = False
        if readable:
            reason = f"{exc}"
        else:  # neither a binary nor text: something else altogether
            reason = (f"expected a .wasm binary (starting with \\0asm; this starts with "
                      f"{wasm[:4]!r}) or WebAssembly text (.wat)")
        raise InvalidArgumentError(f"{program} is not a valid WebAssembly module: {reason}"
                                   ) from None


async def run_core_module(module: wasmtime.Module, config: wasmtime.WasiConfig, nn: GuestNN,
                          program: str, *, stop_also: Sequence[Callable[[], None]] = ()
                          ) -> int:
    """Instantiate ``module`` with WASI ``config`` and wasi-nn ``nn``; run ``_start``.

    ``module`` must be compiled for ``engine_for(fuel=nn.limits.counts_fuel)``.
    ``stop_also``: what else to call when the guest is interrupted (ending its stdin).
    Cancellation stops the guest and waits for its thread at most
    :data:`~wasinn.host.guest_thread.STOP_GRACE_S` seconds before abandoning it
    (:mod:`wasinn.host.guest_thread`); ``nn`` is released either way.
    """
    engine = engine_for(fuel=nn.limits.counts_fuel)
    interrupter = Interrupter(engine)
    for action in stop_also:
        interrupter.also_stop(action)

    def stop() -> None:
        interrupter.request()  # a no-op once the guest has finished
        nn.interrupt()  # and an inference it is running stops now, not when done

    run = GuestRun(program, stop, interrupter.remind)
    try:
        result = await run.run(_run_start, engine, module, config, nn, interrupter, program)
    finally:
        interrupter.finish()
        with trio.CancelScope(shield=True):
            await nn.release()
    assert result is not None  # (only a stop from within returns None; none is made here)
    if isinstance(result, outcome.Error) and interrupter.requested:
        # The guest was stopped because this call was cancelled: let the cancellation,
        # not the resulting trap, be what the caller sees.
        await trio.lowlevel.checkpoint()
    return result.unwrap()


def _run_start(engine: wasmtime.Engine, module: wasmtime.Module, config: wasmtime.WasiConfig,
               nn: GuestNN, interrupter: Interrupter, program: str) -> int:
    """The guest's worker thread: its own Store and Linker, then ``_start``."""
    start_time = time.perf_counter()
    store = wasmtime.Store(engine)
    wasi_started = time.monotonic_ns()  # (the guest's monotonic clock counts from here)
    store.set_wasi(config)
    limit_store(store, nn.limits)
    interrupter.install(store)
    linker = wasmtime.Linker(engine)
    linker.define_wasi()
    define_interruptible_poll(linker, interrupter, wasi_started)
    define_nn(linker, nn, interrupter.request)
    trap: str | None = None
    try:
        _instantiate_and_start(linker, store, module, program, start_time)
        code = 0
    except wasmtime.ExitTrap as exc:
        code = exc.code
    except (wasmtime.Trap, wasmtime.WasmtimeError) as exc:
        trap = trap_message(exc, program, nn.limits, interrupter, store)
        forget_frames(exc)
    finally:
        log.info("%s ran for %.1f ms", program, (time.perf_counter() - start_time) * 1e3)
    if trap is not None:
        del store, linker  # the guest's memory goes now (see forget_frames)
        raise GuestTrap(trap)
    return code


def trap_message(exc: BaseException, program: str, limits: GuestLimits,
                 interrupter: Interrupter, store: wasmtime.Store) -> str:
    """What :class:`GuestTrap` says for ``exc``, a trap of ``program``: that it was
    interrupted (cancelled), that it ran out of fuel (naming the limit), or wasmtime's
    own message with the guest's backtrace."""
    if interrupter.requested:
        return INTERRUPTED
    if limits.counts_fuel and ran_out_of_fuel(exc, store):
        log.info("%s ran out of fuel: %s", program, _trap_message(exc))  # (its backtrace)
        return out_of_fuel(program, limits.max_fuel)
    return f"{program} trapped: {_trap_message(exc)}"


def forget_frames(exc: BaseException) -> None:
    """Clear the finished frames of ``exc``'s traceback (and of the exceptions it was
    raised from or during). A trap's frames hold the guest's Store, its whole memory,
    and wasmtime-py's own frames hold the trap in a reference cycle: without this, a
    trapped guest's memory stays allocated until Python's next cyclic collection, and
    guests trapping in a loop pile it up."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        pending += (current.__cause__, current.__context__)


def _instantiate_and_start(linker: wasmtime.Linker, store: wasmtime.Store,
                           module: wasmtime.Module, program: str, start_time: float) -> None:
    _check_start(module, program)
    check_imports(module, program)
    # Instantiating runs the module's (start) function, if it has one: a trap or an exit
    # there is the guest's own, as in _start; a failure to link is a bad module.
    try:
        instance = linker.instantiate(store, module)
    except (wasmtime.Trap, wasmtime.ExitTrap):
        raise
    except wasmtime.WasmtimeError as exc:
        raise InvalidArgumentError(f"cannot instantiate {program}: {exc}") from None
    start = instance.exports(store)["_start"]
    assert isinstance(start, wasmtime.Func)  # _check_start
    log.info("instantiated %s in %.1f ms", program, (time.perf_counter() - start_time) * 1e3)
    start(store)


def _check_start(module: wasmtime.Module, program: str) -> None:
    """InvalidArgumentError unless ``module`` exports ``_start: () -> ()`` (a WASI
    command's entry point) and no ``_initialize`` (a reactor's: a module is one or the
    other, and Wasmtime refuses one that exports both, whose constructors ``_start`` and
    ``_initialize`` would each run); checked before anything of it runs."""
    exported = {e.name: e.type for e in module.exports}
    start = exported.get("_start")
    if not isinstance(start, wasmtime.FuncType):
        reactor = " (it exports _initialize: a reactor)" if "_initialize" in exported else ""
        raise InvalidArgumentError(
            f"{program} exports no _start function{reactor}: expected a WASI command module"
        )
    if "_initialize" in exported:
        raise InvalidArgumentError(
            f"{program} exports both _start and _initialize: expected a WASI command "
            "(_start) or a reactor (_initialize), not both, as Wasmtime does (each runs "
            "the module's constructors)")
    if start.params or start.results:
        params = ", ".join(str(t) for t in start.params)
        results = ", ".join(str(t) for t in start.results)
        raise InvalidArgumentError(
            f"{program}'s _start has type ({params}) -> ({results}): expected () -> () "
            "(a WASI command's entry point takes and returns nothing)"
        )


def _trap_message(exc: Any) -> str:
    text = str(exc).strip()
    return text or type(exc).__name__
