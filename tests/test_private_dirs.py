"""Private folders (a sandbox process's home, a guest's scratch directory, OpenVINO's
reading folder) left behind by a host that was killed: each is named after the process
that made it, and the next process that makes one of the same kind removes those whose
process has ended (``wasinn.backends._private_dirs``). ``wasinn`` itself stops on SIGTERM
as on Ctrl-C, removing its own, and exits with 143.

Before: SIGTERM (what systemd, ``docker stop`` and Kubernetes send) and SIGKILL left every
folder for good, ``/tmp/wasinn-sandbox-*`` piling up at each stop of a service, and
``wasinn run`` died of the signal.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.component_guests import build_sleep
from tests.guest_support import WAT_DIR
from tests.support import require_backend
from wasinn.modelgen import affine_onnx

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux: flock, landlock")

ROOT = Path(__file__).resolve().parents[1]

#: A host that makes a folder of one kind (``MAKE``, by its argv[1]), prints ``ready``
#: and waits to be killed; with argv[2] = "sweep" it instead makes one and waits (30 s at
#: most) until the folders named on its stdin are gone, printing those that are not.
HOST = textwrap.dedent("""
    import os, sys, time
    import numpy as np, trio

    KIND, MODE = sys.argv[1], sys.argv[2]

    async def sandboxed():
        import wasinn
        from wasinn.configs.loader import parse_config
        from wasinn.modelgen import affine_onnx
        pool = {"kind": "cpu", "devices": ["cpu"], "backends": ["onnxruntime"]}
        config = parse_config({"pools": {"cpu": pool}, "runtime": {"sandbox_spares": 0}},
                              None)
        async with wasinn.Runtime(config) as rt:
            graph = await rt.load([affine_onnx(2.0, 1.0)], "onnx", options={"sandbox": True})
            out = await graph.compute({"x": np.ones((1, 4), np.float32)})
            assert out["y"].numpy().tolist() == [[3.0] * 4]
            await trio.to_thread.run_sync(then)

    def scratch():
        from wasinn.host.component.scratch import ScratchDir
        directory = ScratchDir(os.environ["TMPDIR"])
        (directory.path / "input.bin").write_bytes(b"\\0" * 4096)
        then()

    class Core:
        def read_model(self, path):
            then()

    def openvino():
        from wasinn.backends._ovread import _read_onnx_beside
        _read_onnx_beside(Core(), b"onnx", {"w.data": b"\\0" * 4096})

    def then():
        if MODE == "wait":
            print("ready", flush=True)
            time.sleep(600)
        old = sys.stdin.read().split()
        deadline = time.monotonic() + 30
        while any(os.path.lexists(p) for p in old) and time.monotonic() < deadline:
            time.sleep(0.05)
        print("left:", *(p for p in old if os.path.lexists(p)), flush=True)

    if KIND == "sandbox":
        trio.run(sandboxed)
    elif KIND == "scratch":
        scratch()
    else:
        openvino()
""")

PREFIX = {"sandbox": "wasinn-sandbox-", "scratch": "wasinn-scratch-", "openvino": "wasinn-ov-"}


def _folders(tmp: Path, kind: str) -> list[Path]:
    return sorted(tmp.glob(f"{PREFIX[kind]}*"))


def _env(tmp: Path) -> dict[str, str]:
    return dict(os.environ, TMPDIR=str(tmp))


def _killed_host(tmp: Path, kind: str, how: signal.Signals) -> list[Path]:
    """Start a host that makes a folder of ``kind`` in ``tmp``, kill it by ``how``; the
    folders it left."""
    host = subprocess.Popen([sys.executable, "-c", HOST, kind, "wait"], env=_env(tmp),
                            cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert host.stdout is not None
        assert host.stdout.readline() == "ready\n"
        host.send_signal(how)
        assert host.wait(timeout=60) == -how
    finally:
        host.kill()
        host.wait()
        if host.stdout is not None:
            host.stdout.close()
    return _folders(tmp, kind)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
@pytest.mark.parametrize("kind", ["sandbox", "scratch", "openvino"])
def test_a_folder_left_by_a_killed_host_is_removed_by_the_next(
        tmp_path: Path, kind: str, how: signal.Signals) -> None:
    if kind != "scratch":
        require_backend("onnxruntime" if kind == "sandbox" else "openvino")
    left = _killed_host(tmp_path, kind, how)
    assert left, "the killed host left no folder: nothing to sweep"
    swept = subprocess.run([sys.executable, "-c", HOST, kind, "sweep"], env=_env(tmp_path),
                           cwd=ROOT, input="\n".join(map(str, left)), capture_output=True,
                           text=True, timeout=120, check=False)
    assert swept.returncode == 0, swept.stderr
    assert swept.stdout == "left:\n", swept.stdout
    # ... and that host, leaving normally, removed its own.
    assert _folders(tmp_path, kind) == []


# -- the sweep's rules --------------------------------------------------------------------
def _ended_pid() -> int:
    """The pid of a process that has ended (and been waited for)."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(done.stdout)


def _base_and_outside(tmp_path: Path) -> tuple[Path, Path]:
    """A folder to sweep, and one outside it holding keep.txt, which no sweep may reach."""
    base, outside = tmp_path / "tmp", tmp_path / "outside"
    base.mkdir()
    outside.mkdir()
    (outside / "keep.txt").write_text("not the sweep's")
    return base, outside


def test_the_sweep_removes_only_this_users_folders_of_its_kind_whose_process_ended(
        tmp_path: Path) -> None:
    from wasinn.backends import _private_dirs

    base, outside = _base_and_outside(tmp_path)
    ended = _ended_pid()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        stale = base / f"wasinn-sandbox-{ended}-abcd_123"
        (stale / "deep" / "er").mkdir(parents=True)
        (stale / "deep" / "er" / "f").write_bytes(b"x" * 100)
        (stale / "out").symlink_to(outside)  # a link inside: removed, not followed
        (stale / "deep" / "out").symlink_to(outside / "keep.txt")
        kept = [
            base / f"wasinn-sandbox-{alive.pid}-abcd_123",  # its process lives
            base / f"wasinn-sandbox-{os.getpid()}-abcd_123",  # this one's
            base / "wasinn-sandbox-abcd_123",  # named as before: whose, nobody can tell
            base / f"wasinn-scratch-{ended}-abcd_123",  # another kind
            base / f"wasinn-sandbox-{ended}-",  # not the pattern
            base / f"wasinn-sandbox-0{ended}-abcd_123",
            base / f"xwasinn-sandbox-{ended}-abcd_123",
            base / f"wasinn-sandbox-{ended}-abcd.123",
        ]
        for folder in kept:
            folder.mkdir()
            (folder / "f").write_bytes(b"x")
        link = base / f"wasinn-sandbox-{ended}-linked00"
        link.symlink_to(outside)  # a link named like one: not followed, not removed
        plain = base / f"wasinn-sandbox-{ended}-afile000"
        plain.write_bytes(b"x")  # a file named like one
        locked = base / f"wasinn-sandbox-{ended}-locked00"
        locked.mkdir()
        # Locked: its owner lives in another pid namespace (its pid means nothing here).
        held = os.open(locked, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            assert _private_dirs.sweep("wasinn-sandbox-", base) == 1
        finally:
            os.close(held)
        assert not stale.exists()
        assert all((folder / "f").is_file() for folder in kept)
        assert link.is_symlink() and plain.is_file() and locked.is_dir()
        assert (outside / "keep.txt").read_text() == "not the sweep's"
        assert _private_dirs.sweep("wasinn-sandbox-", base) == 1  # unlocked now
        assert not locked.exists()
    finally:
        alive.kill()
        alive.wait()


def _nest(folder: Path, depth: int, outside: Path) -> None:
    """Make ``depth`` folders, each in the last, under ``folder`` (relative to their
    parent: the path soon passes PATH_MAX), each holding a file and a link to ``outside``."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
            os.symlink(outside, "out", dir_fd=fd)
            deeper = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = deeper
    finally:
        os.close(fd)


def _highest_open_descriptor() -> int:
    return max(int(name) for name in os.listdir("/proc/self/fd"))


def test_a_stale_folder_nested_deeper_than_recursion_or_descriptors_reach_is_swept(
        tmp_path: Path) -> None:
    # A guest may nest thousands of folders in its scratch directory (one entry each).
    # Before, the sweep died of RecursionError on such a folder left behind (and so did
    # every later process's), leaving it and the stale folders listed after it.
    import resource

    from wasinn.backends import _private_dirs

    base, outside = _base_and_outside(tmp_path)
    stale = base / f"wasinn-scratch-{_ended_pid()}-deep0000"
    stale.mkdir()
    _nest(stale, 3000, outside)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # A few descriptors above those open now, whatever the depth (one a level would need
    # 3,000).
    resource.setrlimit(resource.RLIMIT_NOFILE, (_highest_open_descriptor() + 8, hard))
    try:
        removed = _private_dirs.sweep("wasinn-scratch-", base)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert removed == 1
    assert list(base.iterdir()) == []
    assert (outside / "keep.txt").read_text() == "not the sweep's"


def test_a_removal_does_not_climb_out_of_a_folder_moved_from_under_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The way back up from a folder is its "..": it must be the folder it was opened from.
    from wasinn.backends import _private_dirs

    top, elsewhere = tmp_path / "top", tmp_path / "elsewhere"
    (top / "a" / "b" / "c").mkdir(parents=True)
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("not the removal's")
    deepest = (top / "a" / "b" / "c").stat().st_ino
    remove_files = _private_dirs._remove_files

    def moving(fd: int) -> list[str]:
        if os.fstat(fd).st_ino == deepest:  # b moves out while c is being emptied
            os.rename(top / "a" / "b", elsewhere / "b")
        return remove_files(fd)

    monkeypatch.setattr(_private_dirs, "_remove_files", moving)
    with pytest.raises(OSError, match="'b' was moved while it was being removed"):
        _private_dirs.remove_tree(str(top))
    assert sorted(path.name for path in elsewhere.iterdir()) == ["b", "keep.txt"]
    assert (top / "a").is_dir()


def test_neither_a_sweep_nor_an_owners_removal_ever_raises(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # An error no removal expects (a bug, or RecursionError as before): logged, and the
    # sweep goes on with the next folder; an owner's removal leaves the folder for a
    # later sweep. Before, it escaped both (only OSError was caught).
    import logging

    from wasinn.backends import _private_dirs

    ended = _ended_pid()
    for n in "ab":
        (tmp_path / f"wasinn-scratch-{ended}-{n}0000000").mkdir()
    remove_stale = _private_dirs._remove_stale
    broken: list[str] = []

    def broken_once(base_fd: int, name: str, pid: int) -> bool:
        if not broken:
            broken.append(name)
            raise RecursionError("maximum recursion depth exceeded")
        return remove_stale(base_fd, name, pid)

    monkeypatch.setattr(_private_dirs, "_remove_stale", broken_once)
    with caplog.at_level(logging.WARNING, logger="wasinn.backends"):
        assert _private_dirs.sweep("wasinn-scratch-", tmp_path) == 1
    assert [path.name for path in tmp_path.iterdir()] == broken  # stays, for later
    assert any(broken[0] in message and "failed" in message for message in caplog.messages)

    caplog.clear()
    path, fd = _private_dirs.create("wasinn-sandbox-", tmp_path)
    assert fd is not None
    rmdir = os.rmdir

    def broken_rmdir(target: str, *args: object, **kwargs: object) -> None:
        if target == path:
            raise RecursionError("maximum recursion depth exceeded")
        rmdir(target, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "rmdir", broken_rmdir)
    with caplog.at_level(logging.WARNING, logger="wasinn.backends"):
        _private_dirs.remove(path, fd)
    monkeypatch.setattr(os, "rmdir", rmdir)
    assert Path(path).is_dir()
    with pytest.raises(OSError):
        os.fstat(fd)  # closed all the same
    assert any(path in message and "failed" in message for message in caplog.messages)
    _private_dirs.remove(path, None)
    assert not Path(path).exists()


def test_a_folder_is_named_after_its_process_and_locked_while_it_is_used(
        tmp_path: Path) -> None:
    from wasinn.backends._private_dirs import PrivateDir, pattern

    folder = PrivateDir("wasinn-sandbox-", tmp_path)
    path = Path(folder.path)
    found = pattern("wasinn-sandbox-").fullmatch(path.name)
    assert found is not None and int(found[1]) == os.getpid(), path.name
    assert path.parent == tmp_path and path.stat().st_mode & 0o777 == 0o700
    other = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        folder.remove()
        folder.remove()  # idempotent
        assert not path.exists()
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the lock went with it
    finally:
        os.close(other)


# -- the wasinn command -------------------------------------------------------------------
def _sandboxed_config(tmp_path: Path) -> Path:
    """A config registering ``affine``, sandboxed and preloaded."""
    require_backend("onnxruntime")
    (tmp_path / "affine.onnx").write_bytes(affine_onnx(2.0, 1.0))
    config = tmp_path / "wasinn.toml"
    config.write_text('[models.affine]\nfiles = ["affine.onnx"]\nsandbox = true\n'
                      'preload = true\n')
    return config


def _terminated(tmp_path: Path, command: list[str], started: str | None,
                settle_s: float = 0.0) -> tuple[int, str, list[Path]]:
    """Run ``wasinn COMMAND`` with its TMPDIR in ``tmp_path``, and send it SIGTERM
    ``settle_s`` after it said ``started`` on stderr (None: once it made a sandbox
    process's folder); its status, what it said, and the folders there were before the
    signal."""
    import time

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    child = subprocess.Popen([sys.executable, "-m", "wasinn.cli", *command],
                             stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             cwd=tmp_path, env=_env(tmp))
    assert child.stderr is not None
    said = []
    try:
        if started is None:
            while not _folders(tmp, "sandbox") and child.poll() is None:
                time.sleep(0.05)
            time.sleep(0.5)  # (on to its requests)
        else:
            for line in child.stderr:
                said.append(line)
                if started in line:
                    break
        time.sleep(settle_s)
        running = _folders(tmp, "sandbox")
        child.send_signal(signal.SIGTERM)
        child.wait(timeout=60)
        said.append(child.stderr.read())
    finally:
        child.kill()
        child.wait()
        child.stderr.close()
    return child.returncode, "".join(said), running


def _nothing_left(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "tmp").iterdir())


def test_a_file_system_that_locks_no_folder_still_gets_private_folders(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # NFS without local locks refuses flock (ENOLCK): every sandboxed load, guest scratch
    # folder and OpenVINO read failed with "No locks available", where mkdtemp had worked.
    import errno

    from wasinn.backends import _private_dirs
    from wasinn.backends._private_dirs import PrivateDir

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    swept: list[str] = []
    monkeypatch.setattr(fcntl, "flock", no_locks)
    monkeypatch.setattr(_private_dirs, "_sweep_once", lambda prefix, base: swept.append(base))
    folder = PrivateDir("wasinn-scratch-", tmp_path)
    path = Path(folder.path)
    assert path.is_dir() and path.parent == tmp_path
    assert swept == []  # (nothing there can be told live: no sweep)
    folder.remove()
    assert not path.exists() and list(tmp_path.iterdir()) == []


def test_sigterm_stops_wasinn_run_like_ctrl_c_with_status_143_leaving_no_folder(
        tmp_path: Path) -> None:
    config = _sandboxed_config(tmp_path)
    code, said, running = _terminated(
        tmp_path, ["run", "-v", "--config", str(config), str(WAT_DIR / "spin.wat")],
        "instantiated spin.wat")
    assert running, said  # the preloaded model's sandbox process, and a spare
    assert code == 143, said
    assert "Traceback" not in said and "did not stop" not in said, said
    assert _nothing_left(tmp_path) == []


def test_sigterm_stops_wasinn_infer_with_status_143_leaving_no_folder(tmp_path: Path
                                                                      ) -> None:
    config = _sandboxed_config(tmp_path)
    code, said, running = _terminated(
        tmp_path, ["infer", "--config", str(config), "affine", "--zeros",
                   "--requests", "100000000"], None)
    assert running, said
    assert code == 143, said
    assert "Traceback" not in said, said
    assert _nothing_left(tmp_path) == []


def test_sigterm_ends_a_run_whose_guest_is_blocked_in_a_host_call_saying_so(
        tmp_path: Path) -> None:
    # As after Ctrl-C (test_cli.py): the guest's thread is given up on after 2 s. (The
    # signal comes 1 s after the start: one before the guest's sleep stops it at once.)
    component = tmp_path / "sleep.wasm"
    component.write_bytes(build_sleep(tmp_path))
    code, said, _ = _terminated(tmp_path, ["run", "-v", str(component)],
                                f"instantiated {component.name}", settle_s=1.0)
    assert code == 143, said
    assert ("wasinn: the guest did not stop within 2 s of SIGTERM (it is blocked in a host "
            "call, such as a component's WASI sleep): exiting") in said
    assert "Traceback" not in said
