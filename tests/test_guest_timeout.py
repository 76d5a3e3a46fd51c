"""``[guests] run_timeout`` (``wasinn run --timeout``): a guest's whole run is bounded;
past it the guest is stopped wherever it is and ``run_wasm`` raises GuestTrap."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import trio

import wasinn
from tests.component_guests import build_sleep, shim_1028_starting
from tests.guest_support import WAT_DIR
from tests.test_guest_sleep import sleeper
from tests.test_guest_stdin import SilentPipe
from wasinn.configs import ConfigError
from wasinn.configs.loader import parse_config
from wasinn.host.runner import GuestTrap, run_wasm

TIMEOUT_S = 0.5


@pytest.fixture
async def rt() -> wasinn.Runtime:
    async with wasinn.Runtime(parse_config({"guests": {"run_timeout": TIMEOUT_S}}, None)
                              ) as runtime:
        yield runtime


def ran_out(program: str) -> str:
    return (f"{program} ran out of time: it ran for more than {TIMEOUT_S:g} s "
            "([guests] run_timeout)")


async def stopped(rt: wasinn.Runtime, guest: Path, **kwargs: object) -> str:
    with trio.fail_after(60):  # (a hang, not a timing: each guest would run for ever)
        with pytest.raises(GuestTrap) as caught:
            await run_wasm(rt, guest, **kwargs)  # type: ignore[arg-type]
    return caught.value.message


async def test_a_guest_computing_past_its_run_timeout_is_stopped(rt: wasinn.Runtime) -> None:
    assert await stopped(rt, WAT_DIR / "spin.wat") == ran_out("spin.wat")
    assert await run_wasm(rt, WAT_DIR / "exit_code.wat") == 42  # the host serves on


async def test_a_guest_waiting_past_its_run_timeout_is_stopped(rt: wasinn.Runtime,
                                                               tmp_path: Path) -> None:
    assert await stopped(rt, sleeper(tmp_path, 600 * 10**9)) == ran_out("sleep.wat")
    pipe = SilentPipe()
    try:
        said = await stopped(rt, WAT_DIR / "read_stdin.wat", stdin=pipe.path)
    finally:
        pipe.close()
    assert said == ran_out("read_stdin.wat")
    assert not pipe.released_by_timer


async def test_a_component_past_its_run_timeout_is_stopped(rt: wasinn.Runtime,
                                                           tmp_path: Path) -> None:
    # Its start function spins: the component never gets as far as its exports.
    guest = tmp_path / "spins.wat"
    guest.write_text(shim_1028_starting("(loop $forever (br $forever))"))
    assert await stopped(rt, guest) == ran_out("spins.wat")


async def test_a_guest_ending_within_its_run_timeout_is_not_stopped() -> None:
    config = parse_config({"guests": {"run_timeout": 60}}, None)
    async with wasinn.Runtime(config) as runtime:
        assert await run_wasm(runtime, WAT_DIR / "exit_code.wat") == 42


@pytest.mark.parametrize(("value", "said"), [
    (0, "Input should be greater than 0"),
    (-1, "Input should be greater than 0 (got -1)"),
    ("soon", "Input should be a valid number (got 'soon')"),
])
def test_a_run_timeout_that_is_no_positive_number_is_refused(value: object, said: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({"guests": {"run_timeout": value}}, None)
    assert str(caught.value) == f"<config>: guests.run_timeout: {said}"


def test_wasinn_run_timeout_stops_the_guest_with_the_trap_status() -> None:
    proc = subprocess.run([sys.executable, "-m", "wasinn.cli", "run", "--timeout", "0.5",
                           str(WAT_DIR / "spin.wat")],
                          capture_output=True, text=True, check=False, timeout=120)
    assert proc.returncode == 134, proc.stderr
    assert proc.stderr == ("wasinn: spin.wat ran out of time: it ran for more than 0.5 s "
                           "([guests] run_timeout)\n")


def test_wasinn_run_gives_up_on_a_guest_it_cannot_stop_at_its_timeout(tmp_path: Path) -> None:
    # A component's WASI sleep runs in wasmtime, out of the interruption's reach: run_wasm
    # abandons the guest's thread 2 s after the timeout (STOP_GRACE_S), saying so, and
    # raises the timeout's GuestTrap; the command ends with the trap's status. (Before:
    # the guest slept its 600 s, then the command left by exiting the process at once.)
    component = tmp_path / "sleep.wasm"
    component.write_bytes(build_sleep(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "wasinn.cli", "run", "--timeout", "0.5",
                           str(component)],
                          capture_output=True, text=True, check=False, timeout=120)
    assert proc.returncode == 134, proc.stderr
    assert proc.stderr.splitlines() == [
        "sleep.wasm was stopped but did not end within 2 s: its thread is abandoned, blocked "
        "in a host call that cannot be interrupted (such as a component's WASI sleep or a "
        "read of a FIFO); what the guest held is released now, and the thread traps as "
        "soon as that call returns (1 guest thread(s) abandoned)",
        "wasinn: sleep.wasm ran out of time: it ran for more than 0.5 s ([guests] run_timeout)"]


@pytest.mark.parametrize("value", ["0", "-2", "nan", "inf", "soon"])
def test_wasinn_run_timeout_must_be_a_positive_number(value: str,
                                                      capfd: pytest.CaptureFixture[str]
                                                      ) -> None:
    from wasinn.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["run", "--timeout", value, str(WAT_DIR / "exit_code.wat")])
    assert exc.value.code == 2
    assert (f"wasinn run: error: argument --timeout: {value!r}: expected a number of "
            "seconds > 0, such as 30 or 0.5") in capfd.readouterr().err
