"""A stopped guest blocked in a host call that no cancellation reaches (a component's WASI
sleep, a core module opening a FIFO) is waited for a grace period, then its thread is
abandoned: the run ends, what the guest held is released, and the thread, when its call
returns, ends cleanly (its wasi-nn calls refused or trapped) without touching the host.

The grace is made 0.2 s here (``STOP_GRACE_S``). Abandoned threads of the long sleepers
outlive their test (daemon threads, sleeping their hour): counts are taken relative to
the count when each test starts."""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import trio

import wasinn
from tests.component_guests import RecordingRuntime
from tests.guest_support import WAT_DIR, load_by_name_guest
from tests.test_guest_sleep import sleeper
from wasinn.configs.loader import parse_config
from wasinn.host import guest_thread
from wasinn.host.abi import Errno
from wasinn.host.component import ComponentGuest
from wasinn.host.guest_thread import abandoned_guest_threads, guest_threads
from wasinn.host.interrupt import INTERRUPTED
from wasinn.host.runner import GuestTrap, run_wasm
from wasinn.modelgen import affine_onnx

GRACE_S = 0.2
HOUR_NS = 3600 * 10**9
#: The errno of a wasi-nn call of a stopped guest (its graphs released).
REFUSED = int(Errno.NOT_FOUND)
#: fifo_then_nn.wat's exit code when both of its late wasi-nn calls were refused.
BOTH_REFUSED = 10 * REFUSED + REFUSED
RUN = ("wasi:cli/run@0.2.0", "run")


@pytest.fixture(autouse=True)
def short_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(guest_thread, "STOP_GRACE_S", GRACE_S)


@pytest.fixture
def registry(tmp_path: Path) -> dict[str, object]:
    model = tmp_path / "affine.onnx"
    model.write_bytes(affine_onnx(scale=2.0, bias=1.0))
    return {"models": {"affine": {"files": [str(model)], "encoding": "onnx"}}}


@pytest.fixture
async def real(registry: dict[str, object]) -> AsyncIterator[wasinn.Runtime]:
    async with wasinn.Runtime(parse_config(registry, None)) as runtime:
        yield runtime


@pytest.fixture
def rt(real: wasinn.Runtime) -> RecordingRuntime:
    """The runtime for guests, keeping every graph it hands out (``rt.graphs``)."""
    return RecordingRuntime(real)


def nn_sleeper(tmp_path: Path, name: str, nanoseconds: int, *, scratch: bool = False) -> Path:
    """nn_sleep_component.wat.in sleeping ``nanoseconds``, as ``name`` (its program name);
    with ``scratch``, it also imports wasinn:nn/scratch (so it gets a scratch directory)."""
    text = (WAT_DIR / "nn_sleep_component.wat.in").read_text()
    text = text.replace("SLEEP_NS", str(nanoseconds))
    if scratch:
        text = text.replace("(component\n", '(component\n  (import "wasinn:nn/scratch@0.1.0" '
                            "(instance))\n", 1)
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.fixture
def fifo(tmp_path: Path) -> Iterator[Path]:
    """A directory holding a FIFO named ``fifo``; at the end, the FIFO is opened for
    writing and closed, so that a guest still blocked opening it goes on."""
    directory = tmp_path / "pipes"
    directory.mkdir()
    os.mkfifo(directory / "fifo")
    yield directory
    release_fifo(directory / "fifo")


def release_fifo(path: Path) -> bool:
    """Open ``path`` for writing and close it: a reader blocked opening it goes on. False
    when nobody has it open for reading."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # no reader
            return False
        raise
    return True


async def cancelled_after(seconds: float, run: Callable[[], Awaitable[object]]) -> None:
    """Await ``run()``, cancelled after ``seconds``; it must end cancelled."""
    with trio.fail_after(30):  # (a hang, not a timing: each guest would wait far longer)
        with trio.move_on_after(seconds) as scope:
            await run()
            pytest.fail("the guest ended although it blocks for much longer")
    assert scope.cancelled_caught


async def until(condition: Callable[[], bool]) -> None:
    with trio.fail_after(30):
        while not condition():
            await trio.sleep(0.02)


def guest_thread_named(program: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"guest {program}"]


def ended_lines(caplog: pytest.LogCaptureFixture, program: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.getMessage().startswith(f"the abandoned thread of {program} ended")]


async def serves_on(rt: wasinn.Runtime) -> None:
    """The runtime still runs guests and computes."""
    assert await run_wasm(rt, WAT_DIR / "exit_code.wat") == 42
    graph = await rt.load_by_name("affine")
    try:
        x = np.arange(4, dtype=np.float32).reshape(1, 4)
        out = await graph.compute({"x": x})
        np.testing.assert_allclose(out["y"].numpy(), x * 2.0 + 1.0)
    finally:
        await graph.unload()


async def test_a_component_sleeping_an_hour_is_abandoned_when_cancelled(
        real: wasinn.Runtime, rt: RecordingRuntime, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    # Before: run_wasm waited for wasmtime's sleep to end, an hour, whatever the caller.
    before = abandoned_guest_threads()
    guest = nn_sleeper(tmp_path, "hour_cancelled.wat", HOUR_NS)
    with caplog.at_level(logging.WARNING, logger="wasinn.host"):
        await cancelled_after(0.5, lambda: run_wasm(rt, guest))
    assert abandoned_guest_threads() == before + 1
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
            and r.getMessage().startswith("hour_cancelled.wat was stopped but did not end "
                                          "within 0.2 s: its thread is abandoned")]
    assert len(rt.graphs) == 1 and rt.graphs[0].unloaded  # what it loaded is released
    # Its thread sleeps on, a daemon thread (the interpreter's exit does not wait for it),
    # no longer counted by the guest threads' limiter.
    (thread,) = guest_thread_named("hour_cancelled.wat")
    assert thread.daemon and thread.is_alive()
    assert guest_threads().borrowed_tokens == 0
    await serves_on(real)


async def test_run_timeout_gives_up_on_a_component_sleeping_an_hour(
        registry: dict[str, object], tmp_path: Path) -> None:
    before = abandoned_guest_threads()
    guest = nn_sleeper(tmp_path, "hour_timed_out.wat", HOUR_NS)
    config = parse_config({**registry, "guests": {"run_timeout": 0.5}}, None)
    async with wasinn.Runtime(config) as runtime:
        rt = RecordingRuntime(runtime)
        with trio.fail_after(30), pytest.raises(GuestTrap) as caught:
            await run_wasm(rt, guest)
        assert caught.value.message == ("hour_timed_out.wat ran out of time: it ran for more "
                                        "than 0.5 s ([guests] run_timeout)")
        assert abandoned_guest_threads() == before + 1
        assert len(rt.graphs) == 1 and rt.graphs[0].unloaded
        await serves_on(runtime)


async def test_an_abandoned_component_ends_cleanly_when_its_sleep_ends(
        real: wasinn.Runtime, rt: RecordingRuntime, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    before = abandoned_guest_threads()
    guest = nn_sleeper(tmp_path, "short_sleep.wat", 2 * 10**9)
    with caplog.at_level(logging.INFO, logger="wasinn.host"):
        await cancelled_after(0.5, lambda: run_wasm(rt, guest))
        assert abandoned_guest_threads() == before + 1
        assert rt.graphs[0].unloaded
        await until(lambda: abandoned_guest_threads() == before)  # its 2 s are over
    # Awake, it went straight on to load a graph again: that call trapped it (its
    # graphs are gone), and nothing more was loaded.
    assert ended_lines(caplog, "short_sleep.wat") == [
        f"the abandoned thread of short_sleep.wat ended (GuestTrap: {INTERRUPTED}); "
        f"{before} guest thread(s) still abandoned"]
    assert len(rt.graphs) == 1
    assert guest_thread_named("short_sleep.wat") == []
    await serves_on(real)


async def test_a_core_module_blocked_opening_a_fifo_is_abandoned_and_ends_cleanly(
        real: wasinn.Runtime, rt: RecordingRuntime, fifo: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    before = abandoned_guest_threads()
    guest = WAT_DIR / "fifo_then_nn.wat"
    with caplog.at_level(logging.INFO, logger="wasinn.host"):
        await cancelled_after(0.5, lambda: run_wasm(rt, guest, dirs={"/pipes": fifo}))
        assert abandoned_guest_threads() == before + 1
        assert len(rt.graphs) == 1 and rt.graphs[0].unloaded
        assert release_fifo(fifo / "fifo")  # the guest still waits in its path_open
        await until(lambda: abandoned_guest_threads() == before)
    # Its two wasi-nn calls after the open (no epoch check between them) were refused:
    # its graphs are released, and it loaded none again.
    assert ended_lines(caplog, "fifo_then_nn.wat") == [
        f"the abandoned thread of fifo_then_nn.wat ended (it returned {BOTH_REFUSED}); "
        f"{before} guest thread(s) still abandoned"]
    assert len(rt.graphs) == 1
    await serves_on(real)


async def test_the_fifo_guest_runs_through_when_not_stopped(
        rt: RecordingRuntime, fifo: Path) -> None:
    # (What the test above relies on: the open waits for a writer, then both calls work.)
    async with trio.open_nursery() as nursery:
        async def write_when_opened() -> None:
            while not release_fifo(fifo / "fifo"):
                await trio.sleep(0.02)

        nursery.start_soon(write_when_opened)
        with trio.fail_after(30):
            assert await run_wasm(rt, WAT_DIR / "fifo_then_nn.wat", dirs={"/p": fifo}) == 0
    assert len(rt.graphs) == 2 and all(g.unloaded for g in rt.graphs)


async def test_a_guest_that_stops_within_the_grace_is_not_abandoned(
        rt: RecordingRuntime, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    before = abandoned_guest_threads()
    with caplog.at_level(logging.WARNING, logger="wasinn.host"):
        await cancelled_after(0.3, lambda: run_wasm(rt, WAT_DIR / "spin.wat"))
        await cancelled_after(0.3, lambda: run_wasm(rt, sleeper(tmp_path, HOUR_NS)))
    assert abandoned_guest_threads() == before
    assert not [r for r in caplog.records if "abandoned" in r.getMessage()]
    assert guest_threads().borrowed_tokens == 0


async def test_a_guest_ending_within_the_grace_is_waited_for(
        rt: RecordingRuntime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A grace longer than the rest of its sleep: the cancelled run waits for the thread,
    # which then traps at its late wasi-nn call, as a cancelled guest always did.
    monkeypatch.setattr(guest_thread, "STOP_GRACE_S", 30.0)
    before = abandoned_guest_threads()
    guest = nn_sleeper(tmp_path, "one_second.wat", 10**9)
    await cancelled_after(0.3, lambda: run_wasm(rt, guest))
    assert abandoned_guest_threads() == before
    assert guest_thread_named("one_second.wat") == []  # it ended before run_wasm did
    assert len(rt.graphs) == 1 and rt.graphs[0].unloaded


async def test_an_abandoned_component_call_releases_everything_at_close(
        rt: RecordingRuntime, tmp_path: Path) -> None:
    before = abandoned_guest_threads()
    text = nn_sleeper(tmp_path, "called.wat", HOUR_NS, scratch=True).read_text()
    guest = await ComponentGuest.start(rt, text, program="called.wat")
    assert guest.scratch is not None
    scratch = guest.scratch.path
    await cancelled_after(0.5, lambda: guest.call(RUN))
    assert abandoned_guest_threads() == before + 1
    # Its thread still holds the store: the guest cannot be entered again.
    with pytest.raises(GuestTrap) as caught:
        await guest.call(RUN)
    assert caught.value.message == ("called.wat cannot be called again: it was stopped while "
                                    "blocked in a host call, and its thread was abandoned")
    assert guest.live()["graph"] == 1 and not rt.graphs[0].unloaded
    await guest.aclose()
    assert guest.live()["graph"] == 0 and rt.graphs[0].unloaded
    assert not scratch.exists()


class SlowLoads(RecordingRuntime):
    """Its ``load_by_name`` takes 1 s whatever happens: a load that ignores cancellation
    (as a compile in progress may), so that it lands after the guest was abandoned."""

    async def load_by_name(self, name: str) -> object:
        with trio.CancelScope(shield=True):
            await trio.sleep(1.0)
            return await super().load_by_name(name)


@pytest.mark.parametrize("abi", ["core", "component"])
async def test_a_graph_that_lands_after_the_guest_was_abandoned_is_unloaded(
        real: wasinn.Runtime, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        abi: str) -> None:
    # The guest's thread waits in a load that ignores the stop: it is abandoned, the
    # guest released, and then the graph arrives. Nobody would ever unload it.
    rt = SlowLoads(real)
    before = abandoned_guest_threads()
    if abi == "core":
        guest = load_by_name_guest("affine", tmp_path / "late_graph.wat")
        said = f"it returned {REFUSED}"
    else:
        guest = nn_sleeper(tmp_path, "late_graph.wat", 0)
        said = f"GuestTrap: {INTERRUPTED}"  # at its next wasi-nn call
    with caplog.at_level(logging.INFO, logger="wasinn.host"):
        await cancelled_after(0.3, lambda: run_wasm(rt, guest))
        assert abandoned_guest_threads() == before + 1
        assert rt.graphs == []  # (still loading)
        await until(lambda: abandoned_guest_threads() == before)
    assert ended_lines(caplog, "late_graph.wat") == [
        f"the abandoned thread of late_graph.wat ended ({said}); "
        f"{before} guest thread(s) still abandoned"]
    assert len(rt.graphs) == 1 and rt.graphs[0].unloaded
