"""``wasinn infer --save`` onto a file in a sticky folder (mode 1777, as /tmp), where the
kernel lets only the file's owner, the folder's owner or root replace a file (``man 7
inode``): run as user nobody, since root passes the rule, with a real model."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.support import require_backend
from wasinn.modelgen import affine_onnx

#: The user the saves run as (nobody), and another, whose files they meet.
NOBODY = 65534
OTHER = 1234

#: A child process that runs ``wasinn infer`` as user nobody. Its Python, under root's
#: home here, is out of nobody's reach, so it starts as root and runs the command once,
#: its output dropped, so that every module the run imports is loaded before it becomes
#: nobody (the first run's archive goes to WARM, then is removed).
_AS_NOBODY = """\
import contextlib, io, os, sys
from wasinn.cli import main
argv, warm, target, uid = sys.argv[1:-3], sys.argv[-3], sys.argv[-2], int(sys.argv[-1])
with contextlib.redirect_stdout(io.StringIO()):
    assert main([*argv, "--save", warm]) == 0
os.remove(warm)
os.setgroups([])
os.setgid(uid)
os.setuid(uid)
sys.exit(main([*argv, "--save", target]))
"""


@pytest.fixture
def sticky_folder() -> Iterator[Path]:
    """A folder of root's with mode 1777, as /tmp, that user nobody can reach: under the
    system's temporary folder (pytest's tmp_path is in a folder of mode 0700)."""
    if os.geteuid() != 0:
        pytest.skip("the sticky-folder rule is tested as user nobody (uid 65534) on files "
                    "of another user: switching user and giving files away needs root")
    require_backend("onnxruntime")
    with tempfile.TemporaryDirectory(prefix="wasinn-sticky-") as name:
        folder = Path(name)
        closed = [p for p in folder.parents if not os.stat(p).st_mode & stat.S_IXOTH]
        if closed:
            pytest.skip(f"{closed[0]} is closed to other users: user nobody cannot reach a "
                        "folder in it (set TMPDIR to a folder it can)")
        folder.chmod(0o1777)
        (folder / "affine.onnx").write_bytes(affine_onnx())  # y = 2x + 1
        yield folder


def _save_as_nobody(folder: Path, target: Path, warm: Path
                    ) -> subprocess.CompletedProcess[str]:
    argv = ["infer", "--nn-preload", f"a:onnx:cpu:{folder / 'affine.onnx'}", "a",
            "--zeros", "--shape", "x=1,4"]
    return subprocess.run([sys.executable, "-c", _AS_NOBODY, *argv, str(warm), str(target),
                           str(NOBODY)], capture_output=True, text=True, timeout=120,
                          check=False)


@pytest.mark.parametrize(("owner", "mode", "folder_owner", "outcome"), [
    # Another's file that nobody may write: no rename may replace it; refused before the
    # run. Before: "is read-only: expected a file wasinn may write, or a new name".
    (OTHER, 0o644, 0, "refused"),
    # Another's file that nobody may write, but not rename over: written in place. Before:
    # the check passed, the model ran, and the rename failed (Operation not permitted).
    (OTHER, 0o666, 0, "in place"),
    # Nobody's own file, or any file in nobody's own folder: replaced by a rename.
    (NOBODY, 0o644, 0, "renamed"),
    (OTHER, 0o666, NOBODY, "renamed"),
], ids=["others-read-only", "others-writable", "own-file", "own-folder"])
def test_a_file_a_sticky_folder_keeps_from_a_rename_is_written_in_place_or_refused(
        sticky_folder: Path, tmp_path: Path, owner: int, mode: int, folder_owner: int,
        outcome: str) -> None:
    os.chown(sticky_folder, folder_owner, folder_owner)
    saved = sticky_folder / "results.npz"
    np.savez(saved, important=np.arange(5))
    os.chown(saved, owner, owner)
    saved.chmod(mode)
    before, inode = saved.read_bytes(), os.stat(saved).st_ino
    done = _save_as_nobody(sticky_folder, saved, tmp_path / "warm.npz")
    assert sorted(p.name for p in sticky_folder.iterdir()) == ["affine.onnx", "results.npz"]
    if outcome == "refused":
        assert (done.returncode, done.stdout) == (1, ""), done.stderr  # nothing ran
        assert done.stderr == (
            f"wasinn: error: --save {saved}: {saved} is another user's (uid {OTHER}) in a "
            f"sticky folder, {sticky_folder} (mode 1777, as /tmp), where only the file's "
            "owner, the folder's owner or root may replace it, and it is read-only to "
            "wasinn, which cannot write into it instead: expected a new name, or a file of "
            "your own\n")
        assert saved.read_bytes() == before
        return
    assert done.returncode == 0, done.stderr
    assert f"outputs written to {saved}" in done.stdout
    with np.load(saved) as archive:
        assert archive.files == ["y"]
        np.testing.assert_array_equal(archive["y"], [[1, 1, 1, 1]])
    after = os.stat(saved)
    assert stat.S_IMODE(after.st_mode) == mode  # kept, either way
    if outcome == "in place":
        assert (after.st_ino, after.st_uid) == (inode, OTHER)
    else:
        assert (after.st_ino != inode, after.st_uid) == (True, NOBODY)
