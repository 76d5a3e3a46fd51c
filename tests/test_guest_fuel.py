"""``[guests] max_fuel`` (``wasinn run --fuel N``): the wasm a guest executes is bounded
in wasmtime's fuel; past it the guest traps and ``run_wasm`` raises GuestTrap naming the
limit. Guests with a bound run on an engine of their own (it counts fuel), which epoch
interruption (cancellation, ``run_timeout``) still stops, and whose compiled code the
disk cache keeps apart from the plain engine's."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import trio

import wasinn
from tests.component_guests import WIT_DEPS, _wat_component, shim_1028, shim_1028_starting
from tests.guest_support import WAT_DIR
from wasinn.configs import ConfigError
from wasinn.configs.loader import parse_config
from wasinn.host.component import ComponentGuest, compile_guest
from wasinn.host.limits import GuestLimits
from wasinn.host.runner import GuestTrap, run_wasm
from wasinn.modelgen import affine_onnx

#: Fuel that countdown.wat (1000 turns of a loop) finishes well within, and too little.
ENOUGH, TOO_LITTLE = 1_000_000, 100
#: As good as unbounded: only time or cancellation stops a guest that loops forever.
UNBOUNDED = 2**64 - 1


def ran_out(program: str, fuel: int) -> str:
    return (f"{program} ran out of fuel: it executed more wasm than its {fuel} units allow "
            f"([guests] max_fuel = {fuel}, or wasinn run --fuel {fuel}); give it more fuel "
            "if its work needs it, or look for an endless loop in it (fuel counts the "
            "guest's own instructions, not the inference it asks for)")


def fuel_config(fuel: int, **guests: object) -> wasinn.RuntimeConfig:
    return parse_config({"guests": {"max_fuel": fuel, **guests}}, None)


async def trapped(rt: wasinn.Runtime, guest: Path, **kwargs: object) -> str:
    with trio.fail_after(60):  # (a hang, not a timing)
        with pytest.raises(GuestTrap) as caught:
            await run_wasm(rt, guest, **kwargs)  # type: ignore[arg-type]
    return caught.value.message


@pytest.fixture
def affine_config(tmp_path: Path) -> wasinn.RuntimeConfig:
    """The model "affine" (y = 2x + 1 over f32[n, 4]) that the computing guests load."""
    (tmp_path / "affine.onnx").write_bytes(affine_onnx(2.0, 1.0))
    return parse_config({"models": {"affine": {"files": [str(tmp_path / "affine.onnx")],
                                               "encoding": "onnx"}}}, None)


def affine_run(work: Path) -> Path:
    """The command component that runs "affine" once (built with wasm-tools)."""
    guest = work / "affine_run.wasm"
    guest.write_bytes(_wat_component(work, "affine_run", "affine-run",
                                     [WIT_DEPS / "wasi-cli-0.2.0", WIT_DEPS / "wasi-io-0.2.0"]))
    return guest


# -- core modules ------------------------------------------------------------------------
async def test_a_guest_looping_forever_runs_out_of_fuel() -> None:
    async with wasinn.Runtime(fuel_config(ENOUGH)) as rt:
        assert await trapped(rt, WAT_DIR / "spin.wat") == ran_out("spin.wat", ENOUGH)
        assert await run_wasm(rt, WAT_DIR / "exit_code.wat") == 42  # the host serves on


async def test_a_guest_finishing_within_its_fuel_exits_normally_and_with_too_little_traps(
        ) -> None:
    async with wasinn.Runtime(fuel_config(ENOUGH)) as rt:
        assert await run_wasm(rt, WAT_DIR / "countdown.wat") == 0
        # The same guest, the same runtime, less fuel (the limits run_wasm is given).
        assert await trapped(rt, WAT_DIR / "countdown.wat",
                             limits=GuestLimits(max_fuel=TOO_LITTLE)
                             ) == ran_out("countdown.wat", TOO_LITTLE)


async def test_inference_uses_none_of_a_guests_fuel(affine_config: wasinn.RuntimeConfig
                                                    ) -> None:
    # A compute runs a model in the backend: far more instructions than 200, but none
    # of them the guest's own wasm.
    async with wasinn.Runtime(affine_config) as rt:
        assert await run_wasm(rt, WAT_DIR / "affine_compute.wat",
                              limits=GuestLimits(max_fuel=200)) == 0


# -- components --------------------------------------------------------------------------
async def test_a_component_start_function_looping_forever_runs_out_of_fuel(
        tmp_path: Path) -> None:
    guest = tmp_path / "spins.wat"
    guest.write_text(shim_1028_starting("(loop $forever (br $forever))"))
    async with wasinn.Runtime(fuel_config(ENOUGH)) as rt:
        assert await trapped(rt, guest) == ran_out("spins.wat", ENOUGH)


async def test_a_component_has_the_fuel_of_its_whole_life() -> None:
    # Fuel is set once, before its start functions: each call of its exports uses some,
    # and an export that loops forever uses the rest; the instance is dead after.
    async with wasinn.Runtime() as rt:
        guest = await ComponentGuest.start(rt, shim_1028(), program="shim_1028",
                                           limits=GuestLimits(max_fuel=ENOUGH))
        async with guest:
            assert guest.store is not None
            before = guest.store.get_fuel()
            assert 0 < before <= ENOUGH
            assert await guest.call("tensor-new", [1], 1, b"\0\0\0\0") == 1
            assert 0 < guest.store.get_fuel() < before
            with pytest.raises(GuestTrap) as caught:
                await guest.call("spin")
            assert caught.value.message == ran_out("shim_1028", ENOUGH)
            with pytest.raises(GuestTrap, match="cannot be called again: it trapped"):
                await guest.call("tensor-new", [1], 1, b"\0\0\0\0")


async def test_a_command_component_finishing_within_its_fuel_exits_normally(
        affine_config: wasinn.RuntimeConfig, tmp_path: Path) -> None:
    guest = affine_run(tmp_path)
    async with wasinn.Runtime(affine_config) as rt:
        assert await run_wasm(rt, guest, limits=GuestLimits(max_fuel=ENOUGH)) == 0
        assert await trapped(rt, guest, limits=GuestLimits(max_fuel=20)
                             ) == ran_out("affine_run.wasm", 20)


async def test_a_component_compiled_for_the_plain_engine_is_refused_with_fuel() -> None:
    component = compile_guest(shim_1028(), "shim_1028")
    async with wasinn.Runtime() as rt:
        with pytest.raises(wasinn.InvalidArgumentError) as caught:
            await ComponentGuest.start(rt, component, program="shim_1028",
                                       limits=GuestLimits(max_fuel=ENOUGH))
    assert caught.value.message == (
        "cannot instantiate shim_1028: it was compiled for the engine without fuel, and "
        "its limits set max_fuel (expected compile_guest(wasm, fuel=True))")


# -- the fuel engine is still interruptible ----------------------------------------------
async def test_run_timeout_stops_a_guest_with_fuel_to_spare(tmp_path: Path) -> None:
    spins = tmp_path / "spins.wat"
    spins.write_text(shim_1028_starting("(loop $forever (br $forever))"))
    async with wasinn.Runtime(fuel_config(UNBOUNDED, run_timeout=0.5)) as rt:
        for guest in (WAT_DIR / "spin.wat", spins):
            assert await trapped(rt, guest) == (
                f"{guest.name} ran out of time: it ran for more than 0.5 s "
                "([guests] run_timeout)")


async def test_cancelling_a_guest_with_fuel_to_spare_stops_it(tmp_path: Path) -> None:
    spins = tmp_path / "spins.wat"
    spins.write_text(shim_1028_starting("(loop $forever (br $forever))"))
    async with wasinn.Runtime(fuel_config(UNBOUNDED)) as rt:
        for guest in (WAT_DIR / "spin.wat", spins):
            with trio.fail_after(60):  # (a hang, not a timing)
                with trio.move_on_after(0.2) as scope:
                    await run_wasm(rt, guest)
            assert scope.cancelled_caught
        assert await run_wasm(rt, WAT_DIR / "exit_code.wat") == 42  # the host serves on


# -- the compiled-code cache ------------------------------------------------------------
async def test_the_cache_keeps_code_for_either_engine_apart(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
        ) -> None:
    # The same wasm run with and without fuel, twice each: each engine's code is
    # compiled once, then loaded from the cache (before, one overwrote the other's
    # entry, which the other could not load: every switch recompiled).
    monkeypatch.setenv("WASINN_CACHE_DIR", str(tmp_path / "cache"))
    caplog.set_level(logging.INFO, logger="wasinn.host")
    spins = tmp_path / "spins.wat"
    spins.write_text(shim_1028_starting("(loop $forever (br $forever))"))
    async with wasinn.Runtime() as rt:
        for _ in range(2):
            assert await run_wasm(rt, WAT_DIR / "countdown.wat") == 0
            assert await run_wasm(rt, WAT_DIR / "countdown.wat",
                                  limits=GuestLimits(max_fuel=ENOUGH)) == 0
            assert await trapped(rt, spins, limits=GuestLimits(max_fuel=ENOUGH)
                                 ) == ran_out("spins.wat", ENOUGH)
            with trio.move_on_after(0.2):
                await run_wasm(rt, spins)
    said = [r.getMessage().split(" in ")[0] for r in caplog.records
            if "compiled" in r.getMessage()]
    assert said == ["compiled module guest", "compiled module guest",
                    "compiled component guest", "compiled component guest",
                    "loaded compiled module guest from the cache",
                    "loaded compiled module guest from the cache",
                    "loaded compiled component guest from the cache",
                    "loaded compiled component guest from the cache"]
    assert len(list((tmp_path / "cache").rglob("*.cwasm-*"))) == 4


# -- configuration and command line ------------------------------------------------------
@pytest.mark.parametrize(("value", "said"), [
    (0, "Input should be greater than or equal to 1 (got 0)"),
    (-1, "Input should be greater than or equal to 1 (got -1)"),
    ("x", "Input should be a valid integer (got 'x')"),
    (1.5, "Input should be a valid integer (got 1.5)"),
    (2**64, "Input should be less than or equal to 18446744073709551615 "
            "(got 18446744073709551616)"),
])
def test_a_max_fuel_that_is_no_positive_whole_number_is_refused(value: object, said: str
                                                                ) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({"guests": {"max_fuel": value}}, None)
    assert str(caught.value) == f"<config>: guests.max_fuel: {said}"


def test_max_fuel_reaches_the_guest_limits() -> None:
    from wasinn.host.limits import limits_of

    class Configured:
        config = fuel_config(12345)

    assert limits_of(Configured()).max_fuel == 12345
    assert GuestLimits().max_fuel is None
    assert parse_config({}, None).guests.max_fuel is None


def wasinn_run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "wasinn.cli", "run", *args],
                          capture_output=True, text=True, check=False, timeout=120)


def test_wasinn_run_fuel_stops_the_guest_with_the_trap_status() -> None:
    proc = wasinn_run("--fuel", "1000", str(WAT_DIR / "spin.wat"))
    assert proc.returncode == 134, proc.stderr
    assert proc.stderr == f"wasinn: {ran_out('spin.wat', 1000)}\n"
    proc = wasinn_run("--fuel", str(ENOUGH), str(WAT_DIR / "countdown.wat"))
    assert (proc.returncode, proc.stderr) == (0, "")


def test_wasinn_run_fuel_overrides_the_config(tmp_path: Path) -> None:
    config = tmp_path / "little.toml"
    config.write_text(f"[guests]\nmax_fuel = {TOO_LITTLE}\n")
    countdown = str(WAT_DIR / "countdown.wat")
    proc = wasinn_run("--config", str(config), countdown)
    assert proc.returncode == 134, proc.stderr
    assert proc.stderr == f"wasinn: {ran_out('countdown.wat', TOO_LITTLE)}\n"
    proc = wasinn_run("--config", str(config), "--fuel", str(ENOUGH), countdown)
    assert (proc.returncode, proc.stderr) == (0, "")


@pytest.mark.parametrize("value", ["0", "-5", "1.5", "lots", str(2**64)])
def test_wasinn_run_fuel_must_be_a_positive_whole_number(value: str,
                                                         capfd: pytest.CaptureFixture[str]
                                                         ) -> None:
    from wasinn.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["run", "--fuel", value, str(WAT_DIR / "exit_code.wat")])
    assert exc.value.code == 2
    assert (f"wasinn run: error: argument --fuel: {value!r}: expected a whole number of "
            "fuel units from 1 to 18446744073709551615, such as 1000000000"
            ) in capfd.readouterr().err


async def test_a_trap_that_only_says_fuel_ran_out_is_reported_as_what_it_is(
        tmp_path: Path) -> None:
    # A guest may name a function after wasmtime's out-of-fuel text, which its backtrace
    # then carries: its `unreachable` is still a trap of its own, not the fuel bound.
    guest = tmp_path / "spoof.wat"
    guest.write_text("""(module
      (memory (export "memory") 1)
      (func $"all fuel consumed by WebAssembly" unreachable)
      (func (export "_start") call $"all fuel consumed by WebAssembly"))""")
    async with wasinn.Runtime(fuel_config(ENOUGH)) as rt:
        message = await trapped(rt, guest)
    assert message.startswith("spoof.wat trapped: ")
    assert "unreachable" in message
    assert "ran out of fuel" not in message
