"""Ctrl-C and SIGTERM stop ``wasinn infer``, ``devices`` and ``demo`` alike: the command's
scope is cancelled, every close runs, and the command exits with 130 (143 after
SIGTERM); a second signal while it stops exits at once, also in ``wasinn run`` once
its guest is stopped and its runtime closes. A load test so stopped prints what it
measured.

Before: Ctrl-C reached those commands as trio's KeyboardInterrupt. ``wasinn infer`` on a
model whose run ignores cancellation (an OpenVINO Loop) then waited the pool's whole
``close_timeout`` in the graph's unload, and the runtime's close waited it again; a
second Ctrl-C did not exit at once. A load test stopped by either signal printed
nothing of what it had measured. ``wasinn run``, whose guest has a stop scope of its
own, took a second signal that came once the guest was stopped, while the runtime
closed, as the command scope's first: it merely cancelled that (shielded) close, and
the command waited the whole ``close_timeout`` (after Ctrl-C: a KeyboardInterrupt, with
the same wait).

Each test runs the real command in a subprocess, as a user at a terminal would.
"""

from __future__ import annotations

import logging
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.guest_support import WAT_DIR
from tests.loop_model import HUGE_LOOP, loop_inputs, loop_onnx
from tests.support import require_backend
from wasinn.modelgen import affine_onnx

#: Seconds the runtime's close waits for a run that ignores cancellation: small, so
#: that a test waits little, and far more than a cancelled unload takes.
CLOSE_TIMEOUT_S = 2.0
#: Seconds from the runtime's start to the signal: its model compiled (milliseconds)
#: and its requests running.
SETTLE_S = 2.0
#: Far more than any stop here takes (a stop that hangs fails the test, not the run).
GUARD_S = 60.0
#: What each signal's messages call it, and the exit status after it.
SIGNALS = {signal.SIGINT: ("Ctrl-C", 130), signal.SIGTERM: ("SIGTERM", 143)}
#: The unload's message once it waited its close_timeout for a run (a graph's unload
#: that was not cancelled), and the runtime close's, once it waited its own.
UNLOAD_WAITED = "(close_timeout) it still waits for a run"
CLOSE_WAITED = f"job(s) still running {CLOSE_TIMEOUT_S:g} s after the device closed"
#: ``run``'s -v line for the device, logged once its guest has ended, just before the
#: runtime closes: its first number, the runs still going, which the close waits for.
DEVICE_LINE = re.compile(r"wasinn\.cli: cpu: .*; (\d+)/\d+ running, ")


def _signalled(tmp_path: Path, command: list[str], signums: list[signal.Signals],
               between_s: float = 0.3) -> tuple[int, str, str]:
    """``wasinn -vv COMMAND`` in ``tmp_path``, sent ``signums`` one after another
    (``between_s`` apart), the first :data:`SETTLE_S` after its runtime started: its
    status, stdout and stderr."""
    child = subprocess.Popen([sys.executable, "-m", "wasinn.cli", *command, "-vv"],
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    assert child.stderr is not None
    said = []
    try:
        for line in child.stderr:
            said.append(line)
            if "runtime started" in line:
                break
        time.sleep(SETTLE_S)
        for i, signum in enumerate(signums):
            if i:
                time.sleep(between_s)
            child.send_signal(signum)
        out, err = child.communicate(timeout=GUARD_S)
    finally:
        child.kill()
        child.wait()
    return child.returncode, out, "".join(said) + err


def _loop_config(tmp_path: Path, more: str = "") -> Path:
    """A config registering the OpenVINO Loop as "loop", on a pool whose close_timeout
    is :data:`CLOSE_TIMEOUT_S`, then ``more``."""
    require_backend("openvino")
    (tmp_path / "loop.onnx").write_bytes(loop_onnx())
    config = tmp_path / "wasinn.toml"
    config.write_text(textwrap.dedent(f"""\
        [pools.cpu]
        kind = "cpu"
        close_timeout = {CLOSE_TIMEOUT_S}

        [models.loop]
        files = ["loop.onnx"]
        backend = "openvino"
        """) + more)
    return config


def _loop_infer(tmp_path: Path) -> list[str]:
    """``infer`` of an OpenVINO Loop whose run takes minutes and ignores cancellation,
    on a pool whose close_timeout is :data:`CLOSE_TIMEOUT_S`."""
    config = _loop_config(tmp_path)
    inputs = loop_inputs(10 * HUGE_LOOP)
    for name, array in inputs.items():
        np.save(tmp_path / f"{name}.npy", array)
    return ["infer", "--config", str(config), "loop",
            *(f"--input={name}={name}.npy" for name in inputs)]


@pytest.mark.parametrize("signum", list(SIGNALS), ids=[s.name for s in SIGNALS])
def test_a_signal_stops_infer_of_a_run_that_ignores_cancellation_in_one_close_timeout(
        tmp_path: Path, signum: signal.Signals) -> None:
    # The unload is cancelled ("a cancelled unload has still unloaded"): only the
    # runtime's close waits for the run. Before, Ctrl-C waited in the unload first.
    code, out, err = _signalled(tmp_path, _loop_infer(tmp_path), [signum])
    assert code == SIGNALS[signum][1], err
    assert CLOSE_WAITED in err, err  # (the run was running, and ignored cancellation)
    assert UNLOAD_WAITED not in err, err
    assert "Traceback" not in err and out == "", err


@pytest.mark.parametrize("signum", list(SIGNALS), ids=[s.name for s in SIGNALS])
def test_a_second_signal_stops_infer_at_once(tmp_path: Path, signum: signal.Signals
                                             ) -> None:
    # The second one comes while the runtime's close waits for the run: the command
    # exits before that wait ends, saying why.
    name, status = SIGNALS[signum]
    code, _, err = _signalled(tmp_path, _loop_infer(tmp_path), [signum, signum])
    assert code == status, err
    assert f"wasinn: a second {name}: exiting" in err, err
    assert CLOSE_WAITED not in err and UNLOAD_WAITED not in err, err


def _said_until(child: subprocess.Popen[str], said: list[str], pattern: str | re.Pattern[str],
                times: int = 1) -> re.Match[str] | None:
    """Read ``child``'s stderr into ``said`` until a line matched ``pattern`` ``times``
    times: the last match (None: the stream ended first)."""
    assert child.stderr is not None
    for line in child.stderr:
        said.append(line)
        found = re.search(pattern, line)
        if found is not None:
            times -= 1
            if not times:
                return found
    return None


@pytest.mark.parametrize(("first", "second"), [
    (signal.SIGTERM, signal.SIGTERM), (signal.SIGINT, signal.SIGINT),
    (signal.SIGINT, signal.SIGTERM), (signal.SIGTERM, signal.SIGINT)],
    ids=["SIGTERM-SIGTERM", "SIGINT-SIGINT", "SIGINT-SIGTERM", "SIGTERM-SIGINT"])
def test_a_second_signal_exits_run_at_once_while_its_runtime_closes(
        tmp_path: Path, first: signal.Signals, second: signal.Signals) -> None:
    # The guest's compute of the Loop runs in a device worker thread (a guest with a
    # compute_timeout computes there, not in its own thread), where it goes on once the
    # first signal has stopped the guest: the runtime's close waits for it. The second
    # signal comes once the guest's scope has ended (its device line is logged).
    config = _loop_config(tmp_path, "\n[guests]\ncompute_timeout = 3600\n")
    child = subprocess.Popen(
        [sys.executable, "-m", "wasinn.cli", "run", "--config", str(config), "-vv",
         str(WAT_DIR / "loop_compute.wat")],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, cwd=tmp_path)
    said: list[str] = []
    running = None
    try:
        if _said_until(child, said, "set_input took", times=2) is not None:
            time.sleep(SETTLE_S)  # (the guest's compute has started)
            child.send_signal(first)
            running = _said_until(child, said, DEVICE_LINE)
            if running is not None:
                child.send_signal(second)
        out, err = child.communicate(timeout=GUARD_S)
    finally:
        child.kill()
        child.wait()
    err = "".join(said) + err
    assert running is not None and running[1] == "1", err  # (a run for the close to wait for)
    name, status = SIGNALS[second]
    why = f"a second {name}" if first is second else f"{name} after {SIGNALS[first][0]}"
    assert child.returncode == status, err
    assert f"wasinn: {why}: exiting\n" in err, err
    assert CLOSE_WAITED not in err, err  # (it exited before the close's wait ended)
    assert "Traceback" not in err and out == "", err


@pytest.mark.parametrize("signum", list(SIGNALS), ids=[s.name for s in SIGNALS])
def test_a_stopped_load_test_prints_what_it_measured(tmp_path: Path, signum: signal.Signals
                                                     ) -> None:
    require_backend("onnxruntime")
    (tmp_path / "affine.onnx").write_bytes(affine_onnx(2.0, 1.0))
    config = tmp_path / "wasinn.toml"
    config.write_text('[models.affine]\nfiles = ["affine.onnx"]\n')
    name, status = SIGNALS[signum]
    requests = 10**9
    code, out, err = _signalled(
        tmp_path, ["infer", "--config", str(config), "affine", "--zeros", "--requests",
                   str(requests), "--concurrency", "2", "--save", "out.npz"], [signum])
    assert code == status, err
    stopped = re.search(rf"^stopped by {name} after (\d+) of {requests} requests$", out,
                        re.M)
    assert stopped is not None, out
    done = int(stopped[1])
    assert 0 < done < requests, out
    assert re.search(rf"^{done} requests from 2 concurrent caller\(s\) in \S+ s: \S+ "
                     r"requests/s, latency p50 ", out, re.M), out
    assert re.search(rf"^affine: {done} completed, 0 failed, ", out, re.M), out
    assert re.search(rf"^cpu: {done} completed, ", out, re.M), out
    # The run did not end: no outputs of a last request, printed or saved.
    assert "largest along the last axis" not in out
    assert not (tmp_path / "out.npz").exists()
    assert "Traceback" not in err, err


#: A child running ``wasinn COMMAND`` (argv[1]) through the real ``main``, whose command
#: is replaced by one that sends itself Ctrl-C, then, once stopped, a second one while
#: its close takes a while (shielded, as a runtime's close is: a run to wait for).
_STOPPED_COMMAND = textwrap.dedent("""\
    import os, signal, sys
    import trio
    from wasinn import cli

    async def command(args):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            await trio.sleep(60)
        except trio.Cancelled:
            print("cancelled", flush=True)
            raise
        finally:
            with trio.CancelScope(shield=True):
                if sys.argv[2] == "twice":
                    os.kill(os.getpid(), signal.SIGINT)
                await trio.sleep(1 if sys.argv[2] == "once" else 60)
                print("closed", flush=True)

    setattr(cli, "_" + sys.argv[1], command)
    sys.exit(cli.main([sys.argv[1]]))
""")


@pytest.mark.parametrize("command", ["devices", "demo"])
@pytest.mark.parametrize("times", ["once", "twice"])
def test_ctrl_c_cancels_the_command_and_a_second_one_exits_at_once(command: str, times: str
                                                                   ) -> None:
    # Before: the command met a KeyboardInterrupt, not a cancellation, and a second
    # Ctrl-C did not end its close at once.
    child = subprocess.run([sys.executable, "-c", _STOPPED_COMMAND, command, times],
                           capture_output=True, text=True, timeout=GUARD_S, check=False)
    assert child.returncode == 130, child.stderr
    assert "Traceback" not in child.stderr, child.stderr
    if times == "once":
        assert child.stdout == "cancelled\nclosed\n", child.stdout
        assert child.stderr == ""
    else:
        assert child.stdout == "cancelled\n", child.stdout
        assert child.stderr == "wasinn: a second Ctrl-C: exiting\n"


#: A child running ``wasinn ARGS...`` (argv[3:]) through the real ``main``, whose blocking
#: step MODULE.NAME (argv[1]) says "busy" on stdout when called, then, in the worker
#: thread it is called in, sleeps far longer than any test waits (argv[2] "sleep") or does
#: its real work (argv[2] "real").
_BLOCKED_STEP = textwrap.dedent("""\
    import importlib, sys, time
    from wasinn import cli

    where, name = sys.argv[1].rsplit(".", 1)
    module = importlib.import_module(where)
    real = getattr(module, name)

    def step(*args, **kwargs):
        print("busy", flush=True)
        if sys.argv[2] == "real":
            return real(*args, **kwargs)
        time.sleep(600)

    setattr(module, name, step)
    sys.exit(cli.main(sys.argv[3:]))
""")


def _stopped_in_step(tmp_path: Path, step: str, how: str, argv: list[str],
                     signum: signal.Signals, settle_s: float = 0.0
                     ) -> subprocess.CompletedProcess[str]:
    """``wasinn ARGV`` (in :data:`_BLOCKED_STEP`) sent ``signum`` ``settle_s`` after its
    ``step`` was called; it must end well within :data:`GUARD_S`, far less than the
    step's sleep."""
    child = subprocess.Popen(
        [sys.executable, "-c", _BLOCKED_STEP, step, how, *argv], stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509
    assert child.stdout is not None
    try:
        busy = child.stdout.readline()
        time.sleep(settle_s)
        child.send_signal(signum)
        out, err = child.communicate(timeout=GUARD_S)
    finally:
        child.kill()
        child.wait()
    return subprocess.CompletedProcess(child.args, child.returncode, busy + out, err)


def _demo_models_there(workdir: Path) -> list[str]:
    """``demo --workdir workdir`` with the demo's model files already there (empty), so
    that its export, which reuses them, returns at once."""
    from wasinn.modelgen import GENERATION

    workdir.mkdir()
    for suffix in ("onnx", "pt", "xml", "bin"):
        (workdir / f"mobilenet_{GENERATION}_w0.35_s0.{suffix}").write_bytes(b"")
    return ["demo", "--workdir", str(workdir)]


@pytest.mark.parametrize(("step", "command", "signum"), [
    ("wasinn._cli_listings._probe_backends", "devices", signal.SIGINT),
    ("wasinn._cli_listings._probe_backends", "devices", signal.SIGTERM),
    ("wasinn.modelgen.export_mobilenet", "demo", signal.SIGINT),
    ("wasinn.host.guests.build_example", "demo with models", signal.SIGINT),
    ("wasinn.host.runner.is_component", "run", signal.SIGINT),
    ("wasinn.host.runner._compile", "run", signal.SIGTERM),
    ("wasinn.host.component.guest.compile_guest", "run component", signal.SIGINT),
], ids=["devices-probe-SIGINT", "devices-probe-SIGTERM", "demo-export", "demo-build",
        "run-wat-conversion", "run-compile-SIGTERM", "run-component-compile"])
def test_one_signal_stops_a_command_in_blocking_work_at_once(
        tmp_path: Path, step: str, command: str, signum: signal.Signals) -> None:
    # Before: the backends' probe, the demo's export and build and a .wat guest's
    # conversion ran in the event loop, where no signal is seen until they end, and a
    # guest's compile was waited for in its thread: the command went on for as long.
    (tmp_path / "empty.wat").write_text("(component)\n")
    argv = {"devices": ["devices"],
            "demo": ["demo", "--workdir", str(tmp_path / "demo")],
            "demo with models": _demo_models_there(tmp_path / "demo"),
            "run": ["run", str(WAT_DIR / "exit_code.wat")],
            "run component": ["run", str(tmp_path / "empty.wat")]}[command]
    done = _stopped_in_step(tmp_path, step, "sleep", argv, signum)
    assert (done.returncode, done.stdout, done.stderr) == (SIGNALS[signum][1], "busy\n", "")


def test_a_demo_stopped_while_torch_exports_its_model_exits_with_130(tmp_path: Path) -> None:
    # The export goes on in its abandoned thread, in torch or OpenVINO: the command exits
    # past it (os._exit). Before, the interpreter's exit destroyed torch's thread pool
    # under it, and the process aborted: "terminate called without an active exception".
    for library in ("torch", "onnx", "openvino"):
        require_backend(library)
    done = _stopped_in_step(tmp_path, "wasinn.modelgen.export_mobilenet", "real",
                            ["-v", "demo", "--workdir", str(tmp_path / "demo")],
                            signal.SIGINT, settle_s=1.5)
    assert done.returncode == 130, done.stderr
    assert "terminate called" not in done.stderr and "Traceback" not in done.stderr
    assert done.stdout == "busy\n"


#: A child that imports the ``wasinn`` command, says so, then runs ``wasinn run`` of a
#: guest that spins until it is stopped.
_IMPORTED_THEN_RUN = textwrap.dedent("""\
    import sys
    from wasinn import cli

    argv = ["run", sys.argv[1]]
    print("imported", flush=True)
    sys.exit(cli.main(argv))
""")


@pytest.mark.parametrize("delay_s", [0.005, 0.02, 0.05, 0.1, 0.2, 0.4])
def test_ctrl_c_as_the_command_starts_exits_quietly_with_130(delay_s: float) -> None:
    # From main's first line on: the command line's parse, the logging's set-up, the
    # imports and trio's start. (Before: a Ctrl-C while the command line was parsed
    # printed a traceback. One while `import wasinn` imports numpy still may: see the
    # README.)
    child = subprocess.Popen(
        [sys.executable, "-c", _IMPORTED_THEN_RUN, str(WAT_DIR / "spin.wat")],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509
    assert child.stdout is not None
    try:
        assert child.stdout.readline() == "imported\n"
        time.sleep(delay_s)
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=GUARD_S)
    finally:
        child.kill()
        child.wait()
    assert (child.returncode, out, err) == (130, "", "")


#: A child running ``wasinn models`` through the real ``main`` as if ``import wasinn``
#: had not imported numpy yet: its ``wasinn.tensor`` is one whose import gets a Ctrl-C
#: and, as numpy's does, turns the KeyboardInterrupt into an ImportError.
_CTRL_C_IN_NUMPYS_IMPORT = textwrap.dedent("""\
    import importlib.abc, importlib.machinery, os, signal, sys, time
    from wasinn import cli

    class Tensor(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):
            return importlib.machinery.ModuleSpec(name, self) if name == "wasinn.tensor" else None

        def create_module(self, spec):
            return None

        def exec_module(self, module):
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.2)
            except KeyboardInterrupt:
                raise ImportError("numpy._core.umath failed to import") from None

    del sys.modules["wasinn.tensor"]
    sys.meta_path.insert(0, Tensor())
    sys.exit(cli.main(["models"]))
""")


def test_ctrl_c_while_main_imports_numpy_exits_quietly_with_130() -> None:
    # main imports numpy (wasinn.tensor) with Ctrl-C held back, where `import wasinn`
    # has not (a lighter `import wasinn`). Without: an ImportError's traceback, status 1.
    child = subprocess.run(
        [sys.executable, "-c", _CTRL_C_IN_NUMPYS_IMPORT], capture_output=True, text=True,
        timeout=GUARD_S, check=False,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert (child.returncode, child.stdout, child.stderr) == (130, "", "")


async def test_a_run_cancelled_while_its_guest_compiles_lets_the_compile_fill_the_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # What Ctrl-C does to `wasinn run` during a compile, in a process that lives on: the
    # run ends at once, and its compile, left to its thread, writes its cache entry whole
    # (renamed into place) when it is done.
    import threading

    import trio

    from wasinn._abandoned import unfinished_work
    from wasinn.host import runner
    from wasinn.host.engine import compile_module
    from wasinn.scheduler import Runtime

    monkeypatch.setenv("WASINN_CACHE_DIR", str(tmp_path))
    compiling, go_on = threading.Event(), threading.Event()
    real = runner._compile

    def held_compile(*args: Any) -> Any:
        compiling.set()
        go_on.wait(GUARD_S)
        return real(*args)

    monkeypatch.setattr(runner, "_compile", held_compile)
    before = unfinished_work()
    guest = WAT_DIR / "exit_code.wat"
    async with Runtime() as rt:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rt.run_wasm, guest)
            await trio.to_thread.run_sync(compiling.wait, GUARD_S)
            nursery.cancel_scope.cancel()
        assert unfinished_work() == before + 1  # (the run ended: its compile still waits)
        assert not list(tmp_path.glob("wasmtime-*/*"))
        go_on.set()
        with trio.fail_after(GUARD_S):
            while unfinished_work() > before:
                await trio.sleep(0.01)
    (entry,) = tmp_path.glob("wasmtime-*/*")
    assert entry.name.endswith(".cwasm-module")
    with caplog.at_level(logging.INFO, logger="wasinn.host"):
        compile_module(guest.read_bytes())
    assert "loaded compiled module guest from the cache" in caplog.text
