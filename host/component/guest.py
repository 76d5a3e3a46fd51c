"""Running component guests: ``run_component`` (``wasi:cli/run``) and :class:`ComponentGuest`.

Each guest instance has its own Store and Linker; the Engine and the compiled
component are shared and cached on disk (:func:`wasinn.host.engine.compile_component`).
Guest code runs in a worker thread (wasm runs without the GIL, so guests run in
parallel) and reaches the scheduler through ``trio.from_thread``.

Cancellation: cancelling a call interrupts the guest wherever it is. A guest computing
in wasm traps at its next epoch check (:class:`~wasinn.host.interrupt.Interrupter`); a
guest waiting in a wasi-nn call has that call cancelled in trio, then traps. A guest
blocked in a host call that neither reaches (a WASI sleep in ``wasi:io/poll``, a read
of a FIFO) is waited for at most :data:`~wasinn.host.guest_thread.STOP_GRACE_S`
seconds, then its thread is abandoned (:mod:`wasinn.host.guest_thread`): the call
raises all the same, and the guest cannot be called again. Whatever way a guest ends,
every context it still holds is closed and every graph unloaded when it is closed.

Every guest gets a private scratch directory (:mod:`wasinn.host.component.scratch`),
preopened at ``/.wasinn-scratch`` for ``wasinn:nn/scratch``; it is removed, with whatever
the guest left in it, when the guest is closed (or fails to instantiate). While the guest
runs, the directory is measured every :data:`SCRATCH_POLL_SECONDS` and after each call,
and a guest over ``[guests] max_scratch_bytes``, ``max_scratch_files`` or
``max_scratch_open_files`` (descriptors it holds open there), or whose directory cannot
be measured, is stopped for good. A guest given other directories (``dirs``) may open
descriptors in them without such a bound (see :mod:`wasinn.host.wasi`).

A guest whose limits set ``max_fuel`` is compiled for and runs on the engine that counts
fuel; its fuel, set before its start functions run, is that of the instance's whole life
(:mod:`wasinn.host.fuel`). Its requests are made for its tenant (:mod:`wasinn.host.tenant`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import outcome
import trio
import wasmtime
import wasmtime.component as wc

from wasinn._abandoned import run_abandonable
from wasinn._groups import collapsed_groups
from wasinn.errors import InvalidArgumentError
from wasinn.host.component import fastlist, hostcall_fuel
from wasinn.host.component.linking import nn_linker
from wasinn.host.component.scratch import (
    GUEST_PATH,
    MeasureError,
    ScratchDir,
    descriptors_exceeded,
    quota_exceeded,
)
from wasinn.host.component.service import NNService
from wasinn.host.engine import compile_component, engine_for
from wasinn.host.fuel import out_of_fuel, ran_out_of_fuel
from wasinn.host.guest_stdin import GuestStdin, guest_stdin
from wasinn.host.guest_thread import GuestPortal, GuestRun, in_abandoned_thread
from wasinn.host.interrupt import INTERRUPTED, Interrupter
from wasinn.host.limits import GuestLimits, limit_store, limits_of
from wasinn.host.runner import (
    GuestTrap,
    forget_frames,
    stopped_after,
    trap_message,
)
from wasinn.host.tenant import guest_tenant
from wasinn.host.wasi import Dirs, wasi_config

log = logging.getLogger("wasinn.host.component")

T = TypeVar("T")

#: What wasmtime says when a store meets a component compiled by another engine.
_CROSS_ENGINE = "cross-`Engine` instantiation"

#: ``wasi:cli/run`` versions looked for, newest first.
_RUN_INTERFACES = tuple(f"wasi:cli/run@0.2.{minor}" for minor in range(9, -1, -1))


def _trap_message(exc: BaseException) -> str:
    return str(exc).strip() or type(exc).__name__


def _raised_in_wasm(exc: BaseException) -> bool:
    """Whether instantiating failed in the component's own code (a start function that
    trapped), not in linking. wasmtime-py's component API reports both as WasmtimeError;
    only an error raised while wasm ran carries a wasm backtrace or a trap code."""
    if isinstance(exc, wasmtime.Trap):
        return True
    text = str(exc)
    return "wasm backtrace" in text or "wasm trap:" in text


def compile_guest(wasm: bytes | str, program: str = "component", *, fuel: bool = False
                  ) -> wc.Component:
    """Compile (or fetch from the disk cache) a component in binary or text format, for
    ``engine_for(fuel=fuel)``: ``fuel`` for a guest whose limits set ``max_fuel``.

    Raises InvalidArgumentError naming ``program`` when it is not a valid component.
    """
    data = wasm.encode() if isinstance(wasm, str) else wasm
    try:
        return compile_component(data, fuel=fuel)
    except wasmtime.WasmtimeError as exc:
        raise InvalidArgumentError(f"{program} is not a valid component: {exc}") from None


class ComponentGuest:
    """One instantiated component guest with the wasi-nn host, driven from trio.

    ``await ComponentGuest.start(rt, wasm)`` instantiates it; :meth:`call` runs one of
    its exported functions in a worker thread; :meth:`aclose` releases everything it
    still holds (also on ``async with``). ``live()`` counts its live host handles.
    """

    def __init__(self, service: NNService, program: str) -> None:
        self.service = service
        self.program = program
        self.engine = engine_for(fuel=service.limits.counts_fuel)
        self.interrupter = Interrupter(self.engine)
        self.store: wasmtime.Store | None = None
        self.instance: wc.Instance | None = None
        self._closed = False
        self._busy = False
        #: Why the host stopped this guest for good (its scratch quota), if it did.
        self._stopped: str | None = None
        #: The trap that ended this guest, if one did.
        self._trapped: str | None = None

    @classmethod
    async def start(
        cls,
        rt: Any,
        wasm: bytes | str | wc.Component,
        *,
        limits: GuestLimits | None = None,
        wasi: wasmtime.WasiConfig | None = None,
        program: str = "component",
        scratch: bool = True,
        stop_also: Sequence[Callable[[], None]] = (),
        tenant: str | None = None,
    ) -> ComponentGuest:
        """Compile (cached) and instantiate ``wasm`` with WASI 0.2 and every wasi-nn version.

        A ``wasm`` already compiled must be compiled for the guest's engine:
        ``compile_guest(wasm, fuel=limits.counts_fuel)``. ``tenant``: whom the guest's
        requests are for; None: ``program`` (:mod:`wasinn.host.tenant`).

        With ``scratch`` (the default), a guest that imports ``wasinn:nn/scratch`` gets a
        fresh scratch directory, preopened
        into ``wasi`` at ``/.wasinn-scratch`` (``wasi`` is consumed by the guest in any
        case); when none can be created the guest runs without one and its
        ``wasinn:nn/scratch`` calls return ``unsupported-operation``.
        Raises InvalidArgumentError when it is not a component, imports something the
        host does not provide or was compiled for the other engine, or for a ``tenant``
        that is no str; GuestTrap when one of its start functions traps (or runs out of
        fuel).
        Cancellation interrupts a start function that is running, and abandons a compile
        (left to finish in its worker thread); whatever a failed start loaded is released.
        ``stop_also``: what else to call when the guest is interrupted (ending the stdin
        ``wasi`` reads: :mod:`wasinn.host.guest_stdin`).
        """
        tenant = guest_tenant(tenant, program)
        limits = limits or limits_of(rt)
        # A compile takes seconds for a large guest (a componentize-py one): cancellation
        # abandons it (wasinn._abandoned), which finishes in its thread and renames its
        # cache entry into place whole (wasinn.host.engine); nothing of the guest is made.
        component = wasm if isinstance(wasm, wc.Component) else await run_abandonable(
            functools.partial(compile_guest, wasm, program, fuel=limits.counts_fuel))
        config = wasi or wasi_config(program)
        # Only a guest that imports wasinn:nn/scratch gets a directory: the others never
        # see an extra preopen, and none can fill /dev/shm through it.
        wants_scratch = scratch and _imports_scratch(component, engine_for(
            fuel=limits.counts_fuel))
        scratch_dir = _scratch_dir(program) if wants_scratch else None
        guest = cls(NNService(rt, GuestPortal(), limits, scratch_dir, tenant=tenant), program)
        for action in stop_also:
            guest.interrupter.also_stop(action)
        try:
            if scratch_dir is not None:
                config.preopen_dir(str(scratch_dir.path), GUEST_PATH)
            # Instantiating runs the component's start functions, guest code that may
            # call wasi-nn, trap or loop: it is interruptible like any call.
            await guest._interruptible(guest._instantiate, component, config)
        except BaseException:
            # Releases what a start function loaded, and the scratch directory.
            await guest.aclose()
            raise
        return guest

    def _instantiate(self, component: wc.Component, config: wasmtime.WasiConfig) -> None:
        started = time.perf_counter()
        store = wasmtime.Store(self.engine)
        store.set_wasi(config)
        limit_store(store, self.service.limits)
        self.interrupter.install(store)
        linker = nn_linker(self.engine, self.service, self.interrupter)
        failure: Exception | None = None
        try:
            self.instance = linker.instantiate(store, component)
        except wasmtime.ExitTrap:
            raise
        except (wasmtime.Trap, wasmtime.WasmtimeError) as exc:
            limits = self.service.limits
            if self.interrupter.requested:
                failure = GuestTrap(INTERRUPTED)
            elif limits.counts_fuel and ran_out_of_fuel(exc, store):
                failure = GuestTrap(out_of_fuel(self.program, limits.max_fuel))
            elif hostcall_fuel.exhausted(_trap_message(exc)):
                failure = GuestTrap(hostcall_fuel.explained(self.program, _trap_message(exc)))
            elif _raised_in_wasm(exc):
                failure = GuestTrap(
                    f"{self.program} trapped while starting: {_trap_message(exc)}")
            elif _CROSS_ENGINE in str(exc):
                failure = InvalidArgumentError(
                    f"cannot instantiate {self.program}: it was compiled for the engine "
                    f"{'without' if limits.counts_fuel else 'with'} fuel, and its limits "
                    f"{'set' if limits.counts_fuel else 'do not set'} max_fuel (expected "
                    f"compile_guest(wasm, fuel={limits.counts_fuel}))")
            else:
                failure = InvalidArgumentError(f"cannot instantiate {self.program}: {exc}")
            forget_frames(exc)
        if failure is not None:
            del store, linker  # the guest's memory goes now (see forget_frames)
            raise failure
        if in_abandoned_thread():  # the start was given up on: the guest is closed
            return
        self.store = store
        log.info("instantiated %s in %.1f ms", self.program, (time.perf_counter() - started) * 1e3)

    def func(self, name: str | Sequence[str]) -> wc.Func | None:
        """The exported function ``name`` (or ``(interface, function)``), if any."""
        assert self.store is not None and self.instance is not None
        path = [name] if isinstance(name, str) else list(name)
        index = None
        for part in path:
            index = self.instance.get_export_index(self.store, part, index)
            if index is None:
                return None
        return self.instance.get_func(self.store, index) if index is not None else None

    def _invoke(self, func: wc.Func, args: Sequence[Any]) -> Any:
        # The store as it is now: an abandoned call (see _interruptible) goes on with it
        # after the guest has let it go.
        store = self.store
        assert store is not None
        trap: str | None = None
        with fastlist.words_as_bytes():
            try:
                result = func(store, *args)
                func.post_return(store)
            except wasmtime.ExitTrap:
                raise
            except (wasmtime.Trap, wasmtime.WasmtimeError) as exc:
                trap = self._describe_trap(exc, store)
                forget_frames(exc)
        if trap is not None:
            if not in_abandoned_thread():
                self._forget_store(trap)
            raise GuestTrap(trap)
        return result

    def _describe_trap(self, exc: BaseException, store: wasmtime.Store) -> str:
        """What GuestTrap says for ``exc``, a trap of one of this guest's calls."""
        if not self.interrupter.requested and hostcall_fuel.exhausted(_trap_message(exc)):
            return hostcall_fuel.explained(self.program, _trap_message(exc))
        return trap_message(exc, self.program, self.service.limits, self.interrupter, store)

    def _forget_store(self, trap: str) -> None:
        # A trapped instance cannot be entered again: its Store (the guest's memory) is
        # let go now, not at Python's next cyclic collection (see forget_frames); a
        # later call says why the guest is dead.
        self._trapped = trap
        self.instance = None
        self.store = None

    async def call(self, name: str | Sequence[str], *args: Any) -> Any:
        """Call an export in a worker thread and return its (converted) result.

        Raises InvalidArgumentError for an unknown export or a closed or busy guest, GuestTrap
        when the guest traps (the instance cannot be entered again afterwards).
        Cancellation interrupts the guest; it is dead afterwards.
        """
        if self._stopped is not None:
            raise GuestTrap(self._stopped)
        if self._trapped is not None:
            raise GuestTrap(f"{self.program} cannot be called again: it trapped ({self._trapped})")
        if self._closed or self.store is None:
            raise InvalidArgumentError(f"{self.program} is closed")
        if self._busy:
            raise InvalidArgumentError(f"{self.program} is already running a call")
        func = self.func(name)
        if func is None:
            raise InvalidArgumentError(f"{self.program} exports no function {name!r}")
        self._busy = True
        try:
            return await self._interruptible(self._invoke, func, args)
        finally:
            self._busy = False

    async def _interruptible(self, fn: Callable[..., T], *args: Any) -> T:
        over_quota: list[str] = []
        scratch = self.service.scratch

        def stop() -> None:
            self.interrupter.request()
            self.service.interrupt()  # an inference it runs stops now

        run = GuestRun(self.program, stop, self.interrupter.remind)

        async def watch_scratch(scratch: ScratchDir) -> None:
            # WASI has no quota: the guest's file writes go straight to the host's disk
            # (or /dev/shm), so the host measures while the guest runs and stops it (a
            # wasi-nn call it waits on in trio is cancelled at once, as when the caller
            # cancels).
            while True:
                reason = await self._scratch_over_quota(scratch)
                if reason is not None:
                    over_quota.append(reason)
                    run.stop()
                    return
                await trio.sleep(SCRATCH_POLL_SECONDS)

        try:
            with collapsed_groups():  # (a Ctrl-C meanwhile reaches the caller as itself)
                async with trio.open_nursery() as nursery:
                    if scratch is not None:
                        nursery.start_soon(watch_scratch, scratch)
                    try:
                        result = await run.run(fn, *args)
                    finally:
                        nursery.cancel_scope.cancel()
        finally:
            if run.abandoned:
                # Its thread goes on with the store: this guest can never be entered again.
                self._stopped = self._stopped or (
                    f"{self.program} cannot be called again: it was stopped while blocked in "
                    "a host call, and its thread was abandoned")
                self.instance = None
                self.store = None
        if scratch is not None and not over_quota:
            # A call shorter than the poll interval is measured here, once it returned.
            reason = await self._scratch_over_quota(scratch)
            if reason is not None:
                over_quota.append(reason)
        if over_quota:
            # The guest is stopped for good: this and every later call say why.
            self._stopped = f"{self.program} was stopped: {over_quota[0]}"
            self.interrupter.request()
            # Its Store goes now, and with it every descriptor it holds (one that took
            # all the process's must not keep them until the guest is closed): the
            # frames of the trap that stopping it caused hold the Store too.
            if isinstance(result, outcome.Error):
                forget_frames(result.error)
            self.instance = None
            self.store = None
            raise GuestTrap(self._stopped)
        assert result is not None  # (None: abandoned after a stop from within, over quota)
        if isinstance(result, outcome.Error) and self.interrupter.requested:
            await trio.lowlevel.checkpoint()  # let the cancellation be what the caller sees
        return result.unwrap()

    async def _scratch_over_quota(self, scratch: ScratchDir) -> str | None:
        """Why the guest's scratch directory is over its limits, or None. A measurement
        that fails counts as over them (:class:`MeasureError`)."""
        limits = self.service.limits
        try:
            measured = await trio.to_thread.run_sync(
                scratch.measure, limits.max_scratch_files, limits.max_scratch_open_files)
        except MeasureError as exc:
            return exc.message
        return (quota_exceeded(measured.usage, limits.max_scratch_bytes,
                               limits.max_scratch_files)
                or descriptors_exceeded(measured.descriptors, limits.max_scratch_open_files))

    @property
    def scratch(self) -> ScratchDir | None:
        """This guest's scratch directory on the host (None when it has none)."""
        return self.service.scratch

    def live(self) -> dict[str, int]:
        """Live host handles of each kind (all zero when the guest has dropped all)."""
        return self.service.tables.live()

    async def aclose(self) -> None:
        """Release every context and graph the guest still holds and remove its scratch
        directory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.interrupter.finish()
        with trio.CancelScope(shield=True):
            try:
                await trio.to_thread.run_sync(self.service.close)
            finally:
                if self.service.scratch is not None:
                    # (in a thread: it waits for a measurement under way, and deletes
                    # whatever the guest left)
                    await trio.to_thread.run_sync(self.service.scratch.remove)
        self.instance = None
        self.store = None

    async def __aenter__(self) -> ComponentGuest:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


#: How often a running guest's scratch directory is measured against its limit.
SCRATCH_POLL_SECONDS = 0.05

#: The extension interface whose importers get a scratch directory.
SCRATCH_INTERFACE = "wasinn:nn/scratch@"


def _imports_scratch(component: wc.Component, engine: wasmtime.Engine) -> bool:
    imports = component.type.imports(engine)
    return any(name.startswith(SCRATCH_INTERFACE) for name in imports)


def _scratch_dir(program: str) -> ScratchDir | None:
    try:
        return ScratchDir()
    except OSError as exc:
        log.warning("no scratch directory for %s (%s): wasinn:nn/scratch is unavailable to it",
                    program, exc)
        return None


def _find_run(guest: ComponentGuest) -> wc.Func:
    for interface in _RUN_INTERFACES:
        func = guest.func((interface, "run"))
        if func is not None:
            return func
    raise InvalidArgumentError(
        f"{guest.program} exports no wasi:cli/run: expected a WASI 0.2 command component"
    )


def _exit_code(result: Any) -> int:
    if isinstance(result, wc.Variant):
        return 0 if result.tag == "ok" else 1
    return 0


async def run_component(
    rt: Any,
    wasm: bytes,
    *,
    argv: Sequence[str] = (),
    dirs: Dirs | None = None,
    env: Mapping[str, str] | None = None,
    limits: GuestLimits | None = None,
    program: str = "component.wasm",
    stdin: GuestStdin = None,
    tenant: str | None = None,
) -> int:
    """Run a WASI 0.2 command component (its ``wasi:cli/run`` export); return its exit code.

    0 when ``run`` returns ok, 1 when it returns an error, the status given to
    ``wasi:cli/exit`` otherwise. ``argv``/``dirs``/``env`` are as in
    :mod:`wasinn.host.wasi`, ``stdin`` as in :mod:`wasinn.host.guest_stdin` (empty by
    default); ``tenant`` whom its requests are for (None: ``program``, see
    :mod:`wasinn.host.tenant`). Raises :class:`GuestTrap` when the guest traps, runs past
    ``limits.run_timeout`` or out of ``limits.max_fuel``, and InvalidArgumentError for
    bytes that are not a runnable component or a ``tenant`` that is no str. Cancellation
    interrupts the guest; every graph and context it held is released either way.
    """
    tenant = guest_tenant(tenant, program)
    config = wasi_config(program, argv, dirs, env)
    limits = limits or limits_of(rt)
    with guest_stdin(stdin, config) as end_stdin, stopped_after(limits.run_timeout, program):
        return await _run_command(rt, wasm, config, limits, program,
                                  [end_stdin] if end_stdin else [], tenant)


async def _run_command(rt: Any, wasm: bytes, config: wasmtime.WasiConfig,
                       limits: GuestLimits | None, program: str,
                       stop_also: Sequence[Callable[[], None]], tenant: str) -> int:
    try:
        guest = await ComponentGuest.start(rt, wasm, limits=limits, wasi=config,
                                           program=program, stop_also=stop_also,
                                           tenant=tenant)
    except wasmtime.ExitTrap as exc:  # a start function called wasi:cli/exit
        return int(exc.code)
    async with guest:
        run = _find_run(guest)
        try:
            result = await guest._interruptible(guest._invoke, run, ())
        except wasmtime.ExitTrap as exc:
            return int(exc.code)
        return _exit_code(result)
