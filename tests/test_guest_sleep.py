"""A core-module guest's WASI sleep: timed by the host, cut short by its cancellation."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import trio

import wasinn
from tests.guest_support import WAT_DIR
from tests.poller import Poller, subscription
from wasinn.configs.loader import parse_config
from wasinn.host.runner import run_wasm

SUCCESS, ONE_EVENT = 0, 100


def sleeper(tmp_path: Path, nanoseconds: int, flags: int = 0) -> Path:
    text = (WAT_DIR / "sleep.wat").read_text()
    guest = tmp_path / "sleep.wat"
    guest.write_text(text.replace("NS", str(nanoseconds)).replace("FLAGS", str(flags)))
    return guest


@pytest.fixture
async def rt() -> wasinn.Runtime:
    async with wasinn.Runtime(parse_config({}, None)) as runtime:
        yield runtime


async def test_a_sleep_lasts_as_long_as_asked_and_reports_its_clock(
        rt: wasinn.Runtime, tmp_path: Path) -> None:
    started = trio.current_time()
    assert await run_wasm(rt, sleeper(tmp_path, 50_000_000)) == SUCCESS + ONE_EVENT
    assert trio.current_time() - started >= 0.05


async def test_an_absolute_time_goes_to_wasmtimes_own_poll(
        rt: wasinn.Runtime, tmp_path: Path) -> None:
    # Monotonic time 0 has passed: wasmtime reports the clock at once.
    assert await run_wasm(rt, sleeper(tmp_path, 0, flags=1)) == SUCCESS + ONE_EVENT


async def test_cancelling_a_sleeping_guest_stops_it_at_once(
        rt: wasinn.Runtime, tmp_path: Path) -> None:
    # Before: the sleep went on in wasmtime's poll_oneoff for as long as the guest asked
    # (here 600 s), where the epoch interruption that stops a guest cannot reach.
    guest = sleeper(tmp_path, 600 * 10**9)
    with trio.fail_after(30):  # (a hang, not a timing: the guest asked for 600 s)
        with trio.move_on_after(0.5) as scope:
            await run_wasm(rt, guest)
    assert scope.cancelled_caught
    assert await run_wasm(rt, sleeper(tmp_path, 1000)) == SUCCESS + ONE_EVENT  # serves on


# -- poll_oneoff's answers, called directly ---------------------------------------------------
#: WASI errno values.
FAULT, INVAL, NOTSUP = 21, 28, 58


def test_bad_subscriptions_get_wasis_errors() -> None:
    poll = Poller()
    assert poll(count=0)[0] == INVAL  # no subscription
    assert poll(count=1, at=65536 - 40)[0] == FAULT  # a record past the memory's end
    assert poll(subscription(1, 0), count=2000)[0] == FAULT  # the events would be too
    assert poll(subscription(1, 5))[0] == INVAL  # no such tag
    assert poll(subscription(1, 0, clock=9))[0] == INVAL  # no such clock
    for cpu_time in (2, 3):  # wasmtime has no CPU-time clocks either
        assert poll(subscription(1, 0, clock=cpu_time, timeout=10))[0] == NOTSUP


def test_a_file_descriptor_is_ready_at_once_and_only_due_clocks_fire() -> None:
    poll = Poller()
    hour = 3600 * 10**9
    started = time.monotonic()
    errno, events = poll(subscription(7, 1), subscription(8, 0, timeout=hour),
                         subscription(9, 2))
    assert time.monotonic() - started < 60  # (not the hour)
    assert (errno, events) == (SUCCESS, [(7, 0, 1), (9, 0, 2)])
    errno, events = poll(subscription(5, 0, timeout=hour), subscription(6, 0, timeout=0))
    assert (errno, events) == (SUCCESS, [(6, 0, 0)])
    # An absolute realtime in the past is due at once.
    errno, events = poll(subscription(4, 0, clock=0, timeout=1, flags=1))
    assert (errno, events) == (SUCCESS, [(4, 0, 0)])
