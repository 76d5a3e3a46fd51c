"""Ctrl-C reaches a library user's ``except KeyboardInterrupt`` as itself, wherever it
comes: while ``rt.run_wasm`` runs a core module or a component, or while a runtime
preloads its models.

wasinn opens nurseries of its own inside those calls (a guest's thread beside its
watcher, a component's scratch watcher, the preloads side by side). trio delivers
KeyboardInterrupt inside them, and a nursery wraps what leaves it in an exception group:
before :mod:`wasinn._groups`, the usual ``try: trio.run(main) except KeyboardInterrupt``
missed a Ctrl-C that came while a guest ran (exit 1 with a group's traceback), where one
during ``Graph.compute`` arrived as a plain KeyboardInterrupt. Also here: the helper's
own rules (one exception leaves as itself, several as their group, Cancelled never
swallowed), and a cancelled ``run_wasm`` raising a plain Cancelled.
"""

from __future__ import annotations

import selectors
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

import wasinn
import wasinn.scheduler.warmup
from tests.guest_support import WAT_DIR
from wasinn import TensorType
from wasinn._groups import collapsed_groups
from wasinn.configs.loader import parse_config
from wasinn.modelgen import identity_onnx

#: A component whose start function loops forever: its instantiation runs until stopped.
SPINNING_COMPONENT = """(component
  (core module $m
    (func $spin (loop $forever (br $forever)))
    (start $spin))
  (core instance (instantiate $m)))
"""

#: A library user's program: ``trio.run(main)`` inside ``except KeyboardInterrupt``.
#: ``main`` runs the guest at argv[2] (mode "guest") or starts a runtime that preloads
#: the model at argv[2] (mode "preload", its preload held until Ctrl-C: a slow one), and
#: says "running" on stdout once the guest's thread runs or the preload has begun.
USER_PROGRAM = """
import os, sys, threading, time
import trio
import wasinn
import wasinn.scheduler.warmup
from wasinn.configs.loader import parse_config

MODE, PATH = sys.argv[1], sys.argv[2]


def say_running_once_the_guest_runs():
    # A thread of its own, so that nothing of the user's (no nursery) wraps run_wasm.
    name = "guest " + os.path.basename(PATH)
    while not any(t.name == name for t in threading.enumerate()):
        time.sleep(0.005)
    print("running", flush=True)


async def held_preload(*args):
    print("running", flush=True)
    await trio.sleep_forever()


async def main():
    if MODE == "preload":
        wasinn.scheduler.warmup._prepare = held_preload
        config = parse_config(
            {"models": {"m": {"files": [PATH], "encoding": "onnx", "preload": True}}}, None)
        async with wasinn.Runtime(config):
            pass
        return
    async with wasinn.Runtime() as rt:
        threading.Thread(target=say_running_once_the_guest_runs, daemon=True).start()
        await rt.run_wasm(PATH)


try:
    trio.run(main)
except KeyboardInterrupt:
    print("caught", flush=True)
    sys.exit(130)
print("not interrupted", flush=True)
"""


def interrupted(tmp_path: Path, mode: str, path: Path) -> tuple[int, str, str]:
    """:data:`USER_PROGRAM` sent SIGINT once it says "running": its status, stdout and
    stderr."""
    child = subprocess.Popen(
        [sys.executable, "-c", USER_PROGRAM, mode, str(path)], cwd=tmp_path, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        # (a test run in the background ignores SIGINT, and its children would inherit that)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509
    assert child.stdout is not None
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(child.stdout, selectors.EVENT_READ)
            if selector.select(timeout=120):
                first = child.stdout.readline()
                if first == "running\n":
                    child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=60)
    finally:
        child.kill()
        child.wait()
    assert first == "running\n", (first, err)
    return child.returncode, first + out, err


@pytest.mark.parametrize("kind", ["core", "component"])
def test_ctrl_c_during_run_wasm_reaches_the_users_except_keyboard_interrupt(
        tmp_path: Path, kind: str) -> None:
    # Before: exit 1, "BaseExceptionGroup: Exceptions from Trio nursery (1 sub-exception)"
    # raised from GuestRun.run (the component's own nursery wrapped it once more).
    if kind == "core":
        guest = WAT_DIR / "spin.wat"
    else:
        guest = tmp_path / "spin_start.wat"
        guest.write_text(SPINNING_COMPONENT)
    code, out, err = interrupted(tmp_path, "guest", guest)
    assert (code, out) == (130, "running\ncaught\n"), err
    assert "ExceptionGroup" not in err and "Traceback" not in err, err


def test_ctrl_c_while_a_runtime_preloads_reaches_the_users_except_keyboard_interrupt(
        tmp_path: Path) -> None:
    model = tmp_path / "identity.onnx"
    model.write_bytes(identity_onnx(TensorType.F32))
    code, out, err = interrupted(tmp_path, "preload", model)
    assert (code, out) == (130, "running\ncaught\n"), err
    assert "ExceptionGroup" not in err and "Traceback" not in err, err


# -- cancellation still works, and arrives as a plain Cancelled ----------------------------
@pytest.fixture
async def rt() -> AsyncIterator[wasinn.Runtime]:
    async with wasinn.Runtime() as runtime:
        yield runtime


async def guest_thread_started(program: str) -> None:
    name = f"guest {program}"
    with trio.fail_after(60):
        while not any(t.name == name for t in threading.enumerate()):
            await trio.sleep(0.005)


@pytest.mark.parametrize("kind", ["core", "component"])
async def test_cancelling_the_scope_around_run_wasm_stops_the_guest(
        rt: wasinn.Runtime, tmp_path: Path, kind: str) -> None:
    guest = tmp_path / "spinning.wat"
    guest.write_text((WAT_DIR / "spin.wat").read_text() if kind == "core"
                     else SPINNING_COMPONENT)
    scope = trio.CancelScope()
    raised: list[BaseException] = []

    async def cancel_once_running() -> None:
        await guest_thread_started(guest.name)
        scope.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(cancel_once_running)
        with scope:
            try:
                await rt.run_wasm(guest)
            except BaseException as exc:
                raised.append(exc)
                raise
    assert scope.cancelled_caught
    # Before: a BaseExceptionGroup holding the Cancelled (the scope caught it all the same).
    assert [type(exc) for exc in raised] == [trio.Cancelled]


# -- the helper ----------------------------------------------------------------------------
async def raise_(exc: BaseException) -> None:
    raise exc


async def raise_while_handling_a_value_error(exc: BaseException) -> None:
    try:
        int("not a number")
    except ValueError:
        raise exc  # noqa: B904 - its context is the point


async def test_a_lone_exception_leaves_the_nursery_as_itself() -> None:
    error = RuntimeError("the guest's watcher broke")
    with pytest.raises(RuntimeError) as caught, collapsed_groups():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(raise_while_handling_a_value_error, error)
    assert caught.value is error
    # Its own context, not the group that held it.
    assert type(caught.value.__context__) is ValueError


async def test_two_exceptions_leave_as_their_group_unchanged() -> None:
    seen: list[BaseExceptionGroup[Any]] = []
    with pytest.RaisesGroup(ValueError, KeyError) as caught, collapsed_groups():
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(raise_, ValueError("one"))
                nursery.start_soon(raise_, KeyError("two"))
        except BaseExceptionGroup as group:
            seen.append(group)
            raise
    assert caught.value is seen[0]


def test_a_group_inside_the_group_is_not_opened() -> None:
    # Someone else's nursery's group, the lone member of ours: it leaves as it is.
    theirs = ExceptionGroup("theirs", [ValueError("a"), KeyError("b")])
    with pytest.raises(ExceptionGroup) as caught, collapsed_groups():
        raise ExceptionGroup("ours", [theirs])
    assert caught.value is theirs


async def test_a_group_of_cancelled_leaves_as_cancelled_which_its_scope_catches() -> None:
    inner: list[BaseException] = []
    outer: list[BaseException] = []
    with trio.CancelScope() as scope:
        scope.cancel()
        try:
            with collapsed_groups():
                try:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(trio.sleep_forever)
                        await trio.sleep_forever()
                except BaseException as exc:
                    inner.append(exc)
                    raise
        except BaseException as exc:
            outer.append(exc)
            raise
    assert scope.cancelled_caught
    assert isinstance(inner[0], BaseExceptionGroup)
    assert inner[0].split(trio.Cancelled)[1] is None  # (Cancelled alone in it)
    assert [type(exc) for exc in outer] == [trio.Cancelled]


async def test_an_error_beside_cancelled_leaves_as_itself_and_the_cancellation_holds(
        ) -> None:
    inner: list[BaseExceptionGroup[Any]] = []
    with trio.CancelScope() as scope:
        scope.cancel()
        with pytest.raises(KeyboardInterrupt), collapsed_groups():
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(trio.sleep_forever)
                    raise KeyboardInterrupt
            except BaseExceptionGroup as group:
                inner.append(group)
                raise
        # The scope is still cancelled: its next checkpoint raises Cancelled again.
        await trio.lowlevel.checkpoint()
        pytest.fail("the cancellation was lost")
    assert scope.cancelled_caught
    cancelled, rest = inner[0].split(trio.Cancelled)
    assert cancelled is not None and rest is not None  # (both were in the group)


async def test_a_preloads_unexpected_error_fails_the_start_as_itself(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Not a WasiNNError (which preload retypes with the name): a bug's error, say.
    async def broken(*_args: object) -> None:
        raise RuntimeError("a bug in the warm-up")

    monkeypatch.setattr(wasinn.scheduler.warmup, "_prepare", broken)
    model = tmp_path / "identity.onnx"
    model.write_bytes(identity_onnx(TensorType.F32))
    config = parse_config(
        {"models": {"m": {"files": [str(model)], "encoding": "onnx", "preload": True}}},
        None)
    with pytest.raises(RuntimeError, match="a bug in the warm-up"):
        async with wasinn.Runtime(config):
            pytest.fail("the runtime started although its preload failed")
