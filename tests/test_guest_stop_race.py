"""A guest is stopped whenever its stop comes: before its store is armed for epoch
interruption, after, or while the store's epoch-deadline callback is deciding to carry
on (another guest's stop moved the epoch).

Each interleaving is forced, not waited for by luck: a hook in the guest's thread, at
the point in question, cancels the caller of ``run_wasm`` and waits until that
cancellation has asked the guest to stop, then lets the guest's thread go on. Before the
fix, a stop that came just before :meth:`Interrupter.install` was lost (the store was
armed one tick past the epoch the stop had moved), and so was one that came while the
callback decided to carry on (wasmtime sets the new deadline from the epoch as it is
once the callback has returned): the guest spun on a full core, ``run_wasm`` returned
only after the grace with a warning blaming a blocking host call, and the abandoned
thread spun on until some other guest was stopped.

Core modules and components (their start functions and their calls), on the plain
engine and on the one that counts fuel."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import wasmtime

import wasinn
from tests.guest_support import WAT_DIR
from wasinn.host.engine import engine_for
from wasinn.host.guest_thread import abandoned_guest_threads
from wasinn.host.interrupt import Interrupter
from wasinn.host.limits import GuestLimits
from wasinn.host.runner import run_wasm

#: As good as unbounded: only a stop ends a guest that loops forever.
UNBOUNDED_FUEL = 2**64 - 1

#: A component whose start function loops forever.
SPINNING_START = """(component
  (core module $m
    (func $spin (loop $forever (br $forever)))
    (start $spin))
  (core instance (instantiate $m)))
"""

#: A WASI 0.2 command component whose ``run`` loops forever.
SPINNING_RUN = """(component
  (core module $m
    (func (export "run") (result i32)
      (loop $forever (br $forever))
      (i32.const 0)))
  (core instance $i (instantiate $m))
  (func $run (result (result)) (canon lift (core func $i "run")))
  (instance $cli (export "run" (func $run)))
  (export "wasi:cli/run@0.2.0" (instance $cli)))
"""


class StopRace:
    """Stops the guest from inside its own thread, once, at the point a hook calls
    :meth:`stop_now`: the caller's scope is cancelled in trio, and the guest's thread
    waits until that cancellation has requested the guest's interrupter."""

    def __init__(self) -> None:
        self.scope = trio.CancelScope()
        self.fired = False
        #: The only program stopped (None: the first guest to reach the hook).
        self.program: str | None = None

    def stop_now(self, interrupter: Interrupter) -> None:
        if self.fired:
            return
        if self.program is not None and (
                threading.current_thread().name != f"guest {self.program}"):
            return
        self.fired = True
        trio.from_thread.run_sync(self.scope.cancel)
        waited_until = time.monotonic() + 30
        while not interrupter.requested:
            assert time.monotonic() < waited_until, "the cancellation never stopped the guest"
            time.sleep(0.001)


@pytest.fixture(params=[False, True], ids=["plain", "fuel"])
def fuel(request: pytest.FixtureRequest) -> bool:
    """Whether the guest runs on the engine that counts fuel."""
    return bool(request.param)


@pytest.fixture
def limits(fuel: bool) -> GuestLimits:
    return GuestLimits(max_fuel=UNBOUNDED_FUEL) if fuel else GuestLimits()


@pytest.fixture
async def rt() -> AsyncIterator[wasinn.Runtime]:
    async with wasinn.Runtime() as runtime:
        yield runtime


@pytest.fixture
def race() -> StopRace:
    return StopRace()


@pytest.fixture
def stop_before_arming(monkeypatch: pytest.MonkeyPatch, race: StopRace) -> StopRace:
    """The stop comes after the guest's thread made its store, before the store is armed.

    The run's reminders (which move the epoch again while a stopped guest goes on) are
    turned off: arming alone must see the stop."""
    install = Interrupter.install
    monkeypatch.setattr(Interrupter, "remind", lambda self: None)

    def stopped_then_install(self: Interrupter, store: wasmtime.Store) -> None:
        race.stop_now(self)
        install(self, store)

    monkeypatch.setattr(Interrupter, "install", stopped_then_install)
    return race


@pytest.fixture
def stop_while_carrying_on(monkeypatch: pytest.MonkeyPatch, race: StopRace) -> StopRace:
    """The stop comes once the store's epoch-deadline callback has decided to carry on,
    before wasmtime sets the store's next deadline."""
    on_deadline = Interrupter._on_deadline

    def carry_on_then_stopped(self: Interrupter, delta: Any, kind: Any) -> int:
        decided = on_deadline(self, delta, kind)
        if decided == 0:  # carry on
            race.stop_now(self)
        return decided

    monkeypatch.setattr(Interrupter, "_on_deadline", carry_on_then_stopped)
    return race


async def stopped_cleanly(race: StopRace, run: Callable[[], Any], fuel: bool,
                          caplog: pytest.LogCaptureFixture, *,
                          move_epoch: bool = False) -> None:
    """``run()`` under ``race.scope``: it must end cancelled by the race's stop, the guest's
    thread within the grace (not abandoned, no warning). With ``move_epoch``, the engine's
    epoch is moved (as another guest's stop would) until the race has fired, so that the
    guest's callback runs."""
    before = abandoned_guest_threads()
    engine = engine_for(fuel=fuel)

    async def move_epoch_until_fired() -> None:
        while not race.fired:
            engine.increment_epoch()
            await trio.sleep(0.01)

    try:
        with caplog.at_level(logging.WARNING, logger="wasinn.host"), trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                if move_epoch:
                    nursery.start_soon(move_epoch_until_fired)
                with race.scope:
                    await run()
                    pytest.fail("the guest ended although it loops forever")
        assert race.fired  # (the interleaving was forced)
        assert race.scope.cancelled_caught
        assert abandoned_guest_threads() == before
        assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    finally:
        # Without the fix the guest spins on, abandoned: its stop is still requested, so
        # moving the epoch once more ends it (not to leave a core busy for other tests).
        engine.increment_epoch()
        with trio.fail_after(30):
            while abandoned_guest_threads() > before:
                await trio.sleep(0.01)



# -- core modules ------------------------------------------------------------------------
async def test_a_core_guest_stopped_before_its_store_is_armed_stops(
        rt: wasinn.Runtime, limits: GuestLimits, fuel: bool, stop_before_arming: StopRace,
        caplog: pytest.LogCaptureFixture) -> None:
    # Before: the stop was lost; run_wasm returned after the grace, the thread spinning.
    await stopped_cleanly(stop_before_arming,
                          lambda: run_wasm(rt, WAT_DIR / "spin.wat", limits=limits),
                          fuel, caplog)


async def test_a_core_guest_stopped_while_its_callback_carries_on_stops(
        rt: wasinn.Runtime, limits: GuestLimits, fuel: bool, stop_while_carrying_on: StopRace,
        caplog: pytest.LogCaptureFixture) -> None:
    await stopped_cleanly(stop_while_carrying_on,
                          lambda: run_wasm(rt, WAT_DIR / "spin.wat", limits=limits),
                          fuel, caplog, move_epoch=True)


# -- components --------------------------------------------------------------------------
async def test_a_component_stopped_before_its_store_is_armed_stops(
        rt: wasinn.Runtime, limits: GuestLimits, fuel: bool, stop_before_arming: StopRace,
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Its start function spins: the store is armed just before it runs.
    guest = tmp_path / "spin_start.wat"
    guest.write_text(SPINNING_START)
    await stopped_cleanly(stop_before_arming, lambda: run_wasm(rt, guest, limits=limits),
                          fuel, caplog)


async def test_a_component_stopped_while_its_callback_carries_on_stops(
        rt: wasinn.Runtime, limits: GuestLimits, fuel: bool, stop_while_carrying_on: StopRace,
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    guest = tmp_path / "spin_run.wat"
    guest.write_text(SPINNING_RUN)
    await stopped_cleanly(stop_while_carrying_on, lambda: run_wasm(rt, guest, limits=limits),
                          fuel, caplog, move_epoch=True)



async def test_a_guest_not_stopped_carries_on_through_the_reminders(
        rt: wasinn.Runtime, stop_while_carrying_on: StopRace, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    # The reminders move the epoch of the whole engine: every running guest's callback
    # runs, and only the stopped one traps.
    for name in ("stopped.wat", "bystander.wat"):
        (tmp_path / name).write_text((WAT_DIR / "spin.wat").read_text())
    stop_while_carrying_on.program = "stopped.wat"
    bystander = trio.CancelScope()
    bystander_ended = trio.Event()

    async def run_bystander() -> None:
        with bystander:
            await run_wasm(rt, tmp_path / "bystander.wat")
        bystander_ended.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_bystander)
        await stopped_cleanly(stop_while_carrying_on,
                              lambda: run_wasm(rt, tmp_path / "stopped.wat"), False, caplog,
                              move_epoch=True)
        assert not bystander_ended.is_set()  # still spinning
        bystander.cancel()
    assert bystander.cancelled_caught
