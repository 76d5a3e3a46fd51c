"""The host's folders and files an operator lets confined sandbox processes read
(``[runtime] sandbox_read``, :mod:`wasinn.backends._sandbox_read`).

Landlock lets a confined process read only its Python installation, the system's
libraries and wasinn's and its backend's folders: a library that reads a file elsewhere
(a model hub's cache, a licence file) failed in the sandbox, with no way to let it. What
is checked here: a process locked down by the sandbox's own start-up code, with the
environment the host gives it, may read a named folder (everything below it) and a named
file, not an unnamed sibling folder nor the named file's neighbours, and may not write,
make, rename or remove anything there; a path removed after it was named is left out
and the process still starts, confined; a folder (or one on its way) swapped for a
symlink after the host checked it, before the process adds its rule, is left out, not
followed (to ``/``: every file of the host), and so is what the process is handed that
the host would refuse, the host warning of each from the process's report; a runtime's
graph and spare processes are handed the paths its config names (their
``/proc/<pid>/environ``), never the host's own value of that variable; and the config
refuses a relative path, ``/``, a folder that holds the system temporary folder, a
missing path and what is not a list of strings, naming the file and the key.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import wasinn.backends._confine as confine
from tests.support import require_backend, sandbox_children, sandboxed_affine_children, skip_unless
from tests.test_confine import ATTEMPT, landlock_abi
from wasinn import GraphEncoding, Tensor
from wasinn.backends import Device, LoadOptions
from wasinn.backends import _sandbox_process as sandbox_process
from wasinn.backends._sandbox_child import _LOCK_DOWN, READ_PATHS
from wasinn.backends._sandbox_process import _child_env
from wasinn.backends._sandbox_read import read_path_problem, readable_now
from wasinn.backends.base import BackendRef
from wasinn.backends.registry import BackendRegistry
from wasinn.backends.sandbox import ProcessLimit, Spares, load_sandboxed
from wasinn.configs import ConfigError
from wasinn.configs.loader import load_config, parse_config
from wasinn.modelgen import affine_onnx

LINUX = sys.platform.startswith("linux")
pytestmark = pytest.mark.skipif(not LINUX, reason="Linux's Landlock and /proc/<pid>/environ")

CPU = Device.parse("cpu")
ONES = {"x": Tensor.from_numpy(np.ones((1, 4), np.float32))}
ORT = BackendRef("onnxruntime", "wasinn.backends.onnxruntime:OnnxRuntimeBackend")


def _require_landlock() -> None:
    skip_unless("landlock", landlock_abi() >= 1,
                "the kernel has no Landlock (Linux 5.13 or later, enabled): a confined "
                "process's reads are not restricted, and sandbox_read changes nothing")


class Tree:
    """Folders and files in ``root``: ``named/`` (``inside.txt``, ``sub/deep.txt``) and
    ``files/site.lic``, which a process is let read; ``sibling/secret.txt`` and
    ``files/other.lic`` beside them, which it is not; ``private/``, its own folder."""

    def __init__(self, root: Path) -> None:
        self.named, self.sibling, self.files = root / "named", root / "sibling", root / "files"
        self.private = root / "private"
        for folder in (self.named / "sub", self.sibling, self.files, self.private):
            folder.mkdir(parents=True)
        for path in (self.named / "inside.txt", self.named / "sub" / "deep.txt",
                     self.sibling / "secret.txt", self.files / "site.lic",
                     self.files / "other.lic"):
            path.write_text(path.name)

    @property
    def read(self) -> tuple[str, ...]:
        return str(self.named), str(self.files / "site.lic")


#: After the sandbox's own lock-down (:data:`_LOCK_DOWN`, as a confined graph's process
#: runs it: argv[5] is its private folder), tries each access on the paths argv[6:]
#: name (a JSON object) and prints the lock-down's report and, per attempt, "ok" or the
#: errno's name.
_PROBE = _LOCK_DOWN + """
import errno, json
paths = json.loads(sys.argv[6])
results = {}

""" + ATTEMPT + """
def read(path):
    with open(path, "rb") as file:
        file.read()

def write(path, mode):
    with open(path, mode) as file:
        file.write(b"x")

attempt("read_named", lambda: read(paths["inside"]))
attempt("read_below_named", lambda: read(paths["deep"]))
attempt("list_named", lambda: os.listdir(paths["named"]))
attempt("read_named_file", lambda: read(paths["site"]))
attempt("read_beside_named_file", lambda: read(paths["other"]))
attempt("list_named_files_folder", lambda: os.listdir(paths["files"]))
attempt("read_sibling", lambda: read(paths["secret"]))
attempt("write_named", lambda: write(paths["inside"], "r+b"))
attempt("append_named_file", lambda: write(paths["site"], "ab"))
attempt("make_in_named", lambda: write(os.path.join(paths["named"], "new.txt"), "xb"))
attempt("mkdir_in_named", lambda: os.mkdir(os.path.join(paths["named"], "new")))
attempt("remove_in_named", lambda: os.unlink(paths["inside"]))
attempt("rename_in_named", lambda: os.rename(paths["inside"],
                                             os.path.join(paths["named"], "moved.txt")))
attempt("write_private", lambda: write(os.path.join(sys.argv[5], "mine.txt"), "wb"))
print(json.dumps({"report": locked, "results": results}))
"""


def _probe(tree: Tree, read: tuple[str, ...], *, between: Callable[[], object] | None = None,
           handed: str | None = None) -> dict[str, Any]:
    """What a process started with the environment the host gives a confined graph's
    process whose pool may read ``read`` can do with ``tree`` after its lock-down;
    ``between``: done after the host made that environment (and checked the paths),
    before the process starts; ``handed``: the paths the process is handed instead of
    those the host checked (as if another program had started it)."""
    env = _child_env(ORT, True, (), read)
    if between is not None:
        between()
    if handed is not None:
        env[READ_PATHS] = handed
    paths = {"named": tree.named, "inside": tree.named / "inside.txt",
             "deep": tree.named / "sub" / "deep.txt", "files": tree.files,
             "site": tree.files / "site.lic", "other": tree.files / "other.lic",
             "secret": tree.sibling / "secret.txt"}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, "-", "-", "-", ORT.entry, str(tree.private),
         json.dumps({key: str(path) for key, path in paths.items()})],
        capture_output=True, text=True, cwd=tree.private, env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert any(a.startswith("landlock(") for a in result["report"]["applied"]), result
    assert "landlock" not in result["report"]["failed"], result
    return result


# -- what a confined process may do with the paths ----------------------------------------
def test_a_named_folder_and_file_may_be_read_and_nothing_beside_them(tmp_path: Path) -> None:
    # Before: neither could be read (see the next test); now both can, and only they.
    _require_landlock()
    tree = Tree(tmp_path)
    results = _probe(tree, tree.read)["results"]
    for name in ("read_named", "read_below_named", "list_named", "read_named_file"):
        assert results[name] == "ok", name
    for name in ("read_beside_named_file", "list_named_files_folder", "read_sibling"):
        assert results[name] == "PermissionError:EACCES", name


def test_without_the_setting_the_same_paths_cannot_be_read(tmp_path: Path) -> None:
    _require_landlock()
    tree = Tree(tmp_path)
    results = _probe(tree, ())["results"]
    for name in ("read_named", "read_below_named", "list_named", "read_named_file",
                 "read_sibling"):
        assert results[name] == "PermissionError:EACCES", name


def test_a_named_path_is_read_only(tmp_path: Path) -> None:
    _require_landlock()
    tree = Tree(tmp_path)
    results = _probe(tree, tree.read)["results"]
    for name in ("write_named", "append_named_file", "make_in_named", "mkdir_in_named",
                 "remove_in_named", "rename_in_named"):
        assert results[name] == "PermissionError:EACCES", name
    assert results["write_private"] == "ok"  # (its own folder, as before)
    assert sorted(p.name for p in tree.named.iterdir()) == ["inside.txt", "sub"]
    assert (tree.named / "inside.txt").read_text() == "inside.txt"
    assert (tree.files / "site.lic").read_text() == "site.lic"


def test_a_symlink_is_followed_to_what_it_names(tmp_path: Path) -> None:
    # Landlock binds a rule to the file it opens: the link's target is what is readable.
    _require_landlock()
    tree = Tree(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(tree.named)
    env = _child_env(ORT, True, (), (str(link),))
    assert env[READ_PATHS] == str(tree.named.resolve())
    results = _probe(tree, (str(link), str(tree.files / "site.lic")))["results"]
    assert results["read_named"] == "ok"
    assert results["read_sibling"] == "PermissionError:EACCES"


def test_a_path_removed_since_it_was_named_is_left_out_and_the_process_starts(
        tmp_path: Path) -> None:
    # Removed after the host made the process's environment, before its lock-down: the
    # process starts, confined, and reads what is still there (the probe checks that
    # Landlock was applied and did not fail).
    _require_landlock()
    tree = Tree(tmp_path)
    gone = tmp_path / "gone"
    gone.mkdir()
    results = _probe(tree, (str(gone), *tree.read), between=gone.rmdir)["results"]
    assert results["read_named"] == "ok"
    assert results["read_sibling"] == "PermissionError:EACCES"


def test_a_named_path_whose_rule_the_kernel_refuses_is_left_out_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: the OSError reached the ruleset's whole setup, and the process went on
    # without Landlock (its report said "failed"): one path could unconfine it.
    def refused(*args: object) -> None:
        raise OSError(77, "File descriptor in bad state")

    monkeypatch.setattr(confine, "_add_rule_at", refused)
    why = confine._add_named_rule(ctypes.CDLL(None), -1, str(tmp_path),
                                  os.path.realpath(tempfile.gettempdir()))
    assert why == "the kernel refused its rule: File descriptor in bad state"


def _swap_for_symlink(folder: Path, target: Path | str) -> None:
    """``folder`` replaced by a symlink to ``target`` (what a user who may write in its
    parent could do at any time), the folder itself kept beside it."""
    folder.rename(folder.with_name(f"{folder.name}.held"))
    folder.symlink_to(target)


def test_a_folder_swapped_for_a_symlink_to_the_root_after_the_hosts_check_is_left_out(
        tmp_path: Path) -> None:
    # Before: the host checked the folder as it started the process, the process resolved
    # it again and added its rule for what it resolved to then, unchecked: "/", every file
    # of the host (the sibling's secret read "ok").
    _require_landlock()
    tree = Tree(tmp_path)
    result = _probe(tree, tree.read, between=lambda: _swap_for_symlink(tree.named, "/"))
    assert result["results"]["read_sibling"] == "PermissionError:EACCES"
    assert result["results"]["read_named_file"] == "ok"  # (the other path, untouched)
    why = result["report"]["left_out"][str(tree.named)]
    assert why.startswith(f"it is not the path the host checked as it started this process "
                          f"({tree.named} is a symlink now; changed since)"), why


def test_a_parent_folder_swapped_for_a_symlink_after_the_hosts_check_is_left_out(
        tmp_path: Path) -> None:
    # The named folder itself is a real folder still; a folder on its way leads elsewhere
    # now (another folder of the same name below the symlink's target).
    _require_landlock()
    tree = Tree(tmp_path / "host")
    decoy = Tree(tmp_path / "decoy")
    result = _probe(tree, (str(tree.named),),
                    between=lambda: _swap_for_symlink(tmp_path / "host", tmp_path / "decoy"))
    assert (tree.named / "inside.txt").resolve() == decoy.named / "inside.txt"
    for name in ("read_named", "read_below_named", "list_named"):
        assert result["results"][name] == "PermissionError:EACCES", name
    assert f"({tmp_path / 'host'} is a symlink now" in result["report"]["left_out"][
        str(tree.named)]


@pytest.mark.parametrize(("handed", "expected"), [
    ("/", "the root folder would let a confined sandbox process read every file"),
    ("{tmp}", "{tmp} is the system temporary folder {tmp}, where each confined sandbox "
              "process has its private folder"),
    ("/proc/1", "/proc/1 is in /proc, the kernel's view of the host's processes"),
    ("{tmp}/named/../sibling", "it is not the path the host checked as it started this "
                               "process ('{tmp}/named/../sibling' is not an absolute path "
                               "with its symlinks resolved"),
])
def test_a_process_checks_the_paths_it_is_handed_as_the_host_does(
        tmp_path: Path, handed: str, expected: str) -> None:
    # Whatever it is handed: what the host refuses, it refuses too ("{tmp}": the folder
    # that holds the private folders, here the probe's own folder's parent).
    _require_landlock()
    tree = Tree(tmp_path)
    handed, expected = (text.replace("{tmp}", str(tmp_path)) for text in (handed, expected))
    result = _probe(tree, (), handed=handed)
    assert result["results"]["read_sibling"] == "PermissionError:EACCES"
    assert result["report"]["left_out"][handed].startswith(expected), result["report"]


def test_a_graphs_process_that_left_a_path_out_says_so_and_the_host_warns(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # A real sandbox process: the folder is swapped for a symlink to "/" once the host
    # has checked it (as the host hands the process its paths), before the process
    # starts. The process loads and runs the model without it, and its report, which
    # the host logs, says why.
    _require_landlock()
    require_backend("onnxruntime")
    tree = Tree(tmp_path)
    checked = sandbox_process.readable_now

    def check_then_swap(paths: Any) -> list[str]:
        now = checked(paths)
        if tree.named.is_dir() and not tree.named.is_symlink():
            _swap_for_symlink(tree.named, "/")
        return now

    monkeypatch.setattr(sandbox_process, "readable_now", check_then_swap)
    backend = BackendRegistry().get("onnxruntime")
    spares = Spares(0, extra_read=list(tree.read))
    with caplog.at_level(logging.WARNING, logger="wasinn.backends"):
        graph = load_sandboxed(backend, [affine_onnx(2.0, 1.0)], GraphEncoding.ONNX, CPU,
                               LoadOptions(sandbox=True), spares=spares)
    try:
        out = graph.run(ONES)
        np.testing.assert_array_equal(out["y"].numpy(), np.full((1, 4), 3.0, np.float32))
        assert graph.confinement is not None
        assert "landlock" not in graph.confinement["failed"], graph.confinement
        assert list(graph.confinement["left_out"]) == [str(tree.named)]
    finally:
        graph.close()
        spares.close()
    warnings = [r.getMessage() for r in caplog.records
                if f"without reading {tree.named}, which it may read" in r.getMessage()]
    assert warnings == [f"the process that read the sandboxed model was started without "
                        f"reading {tree.named}, which it may read (sandbox_read): it is not "
                        f"the path the host checked as it started this process "
                        f"({tree.named} is a symlink now; changed since): expected the "
                        "folder or file it resolved, with no symlink on its way"]


_VANISHED = """
import importlib.util, json, os, sys
spec = importlib.util.spec_from_file_location("_wasinn_confine", sys.argv[1])
confine = importlib.util.module_from_spec(spec)
spec.loader.exec_module(confine)
listed = confine._readable
# As if the path had been removed between its listing and its rule:
confine._readable = lambda extra: [*listed(extra), sys.argv[2]]
report = confine.lock_down(os.getcwd(), [])
try:
    open(sys.argv[3], "rb").close()
    outside = "ok"
except OSError as exc:
    outside = type(exc).__name__
print(json.dumps({"report": report.as_dict(), "outside": outside}))
"""


def test_a_path_removed_while_the_rules_are_made_leaves_landlock_applied(
        tmp_path: Path) -> None:
    # Before: its rule's open failed, and with it the whole of Landlock (the process ran
    # with the file system unrestricted, a warning logged).
    _require_landlock()
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    private = tmp_path / "private"
    private.mkdir()
    done = subprocess.run(
        [sys.executable, "-I", "-c", _VANISHED, str(Path(confine.__file__).resolve()),
         str(tmp_path / "gone"), str(secret)],
        capture_output=True, text=True, cwd=private, timeout=120, check=False,
        env={"PATH": os.environ.get("PATH", "")})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert "landlock" not in result["report"]["failed"], result
    assert any(a.startswith("landlock(") for a in result["report"]["applied"])
    assert result["outside"] == "PermissionError"


# -- what the host hands its processes ----------------------------------------------------
def test_the_paths_a_process_is_handed_are_resolved_and_there(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture
                                                              ) -> None:
    tree = Tree(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(tree.named)
    missing = tmp_path / "missing"
    to_root = tmp_path / "to-root"
    to_root.symlink_to("/")  # (made after it was named: the pool's check is past)
    with caplog.at_level(logging.WARNING, logger="wasinn.backends"):
        now = readable_now([str(link), str(tree.named), str(missing), str(to_root),
                            str(tree.files / "site.lic")])
    assert now == [str(tree.named.resolve()), str((tree.files / "site.lic").resolve())]
    (warning,) = [r.getMessage() for r in caplog.records]
    assert f"without reading {to_root} (sandbox_read): the root folder" in warning


def test_a_process_not_confined_is_handed_no_paths(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    # The host's own WASINN_SANDBOX_READ (WASINN_* variables reach confined processes) is
    # never what a process is handed.
    monkeypatch.setenv(READ_PATHS, "/")
    assert _child_env(ORT, True, (), ())[READ_PATHS] == ""
    assert _child_env(ORT, False, (), (str(tmp_path),))[READ_PATHS] == ""


def test_a_spare_and_a_graphs_process_are_handed_the_pools_paths(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require_backend("onnxruntime")
    monkeypatch.setenv(READ_PATHS, "/")
    tree = Tree(tmp_path)
    gone = tmp_path / "gone"
    gone.mkdir()
    spares = Spares(1, limit=ProcessLimit(4), extra_read=[*tree.read, str(gone)])
    gone.rmdir()  # (removed since the pool was made: left out, the loads go on)
    backend = BackendRegistry().get("onnxruntime")
    expected = os.pathsep.join(str(Path(p).resolve()) for p in tree.read)
    graphs = []
    try:
        graphs.append(load_sandboxed(backend, [affine_onnx(2.0, 1.0)], GraphEncoding.ONNX,
                                     CPU, LoadOptions(sandbox=True), spares=spares))
        out = graphs[0].run(ONES)
        np.testing.assert_array_equal(out["y"].numpy(), np.full((1, 4), 3.0, np.float32))
        children = sandbox_children()
        assert len(children) == 2  # the graph's process and the spare started after it
        for child in children:
            assert _environ(child.pid)[READ_PATHS] == expected
        confinement = graphs[0].confinement
        assert confinement is not None
        if landlock_abi() >= 1:
            assert "landlock" not in confinement["failed"], confinement
    finally:
        for graph in graphs:
            graph.close()
        spares.close()
    assert sandbox_children() == []


@pytest.mark.parametrize(("extra_read", "error", "expected"), [
    (["srv/hf-cache"], ValueError, r"^extra_read\[0\]: 'srv/hf-cache' is relative: "
                                   r"expected an absolute path"),
    (["/srv/missing", "/"], ValueError, r"^extra_read\[1\]: the root folder would let a "
                                        r"confined sandbox process read every file"),
    ("/srv/hf-cache", TypeError, r"^extra_read='/srv/hf-cache': expected a list of paths, "
                                 r"not a string"),
    ([1], ValueError, r"^extra_read\[0\]: 1 is not a string: expected the absolute path"),
    (["/proc/1"], ValueError, r"^extra_read\[0\]: /proc/1 is in /proc, the kernel's view "
                              r"of the host's processes and devices"),
    (["/sys"], ValueError, r"^extra_read\[0\]: /sys is in /sys, the kernel's view"),
])
def test_a_pool_refuses_what_is_no_path_it_may_read(extra_read: object,
                                                    error: type[Exception],
                                                    expected: str) -> None:
    with pytest.raises(error, match=expected):
        Spares(0, extra_read=extra_read)  # type: ignore[arg-type]


def _environ(pid: int | None) -> dict[str, str]:
    """The environment process ``pid`` was started with."""
    assert pid is not None, "no process"
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode().split("=", 1) for entry in entries if entry)


# -- a runtime ----------------------------------------------------------------------------
async def test_a_runtimes_processes_may_read_what_its_config_names(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: [runtime] sandbox_read was an unknown key; a variable sandbox_env gave a
    # process named a folder it could not read.
    tree = Tree(tmp_path / "host")
    monkeypatch.setenv("HF_HOME", str(tree.named))
    keys = f'sandbox_env = ["HF_HOME"]\nsandbox_read = {json.dumps(list(tree.read))}\n'
    expected = os.pathsep.join(str(Path(p).resolve()) for p in tree.read)
    async with sandboxed_affine_children(tmp_path, keys) as children:
        for child in children:
            environ = _environ(child.pid)
            assert environ[READ_PATHS] == expected
            assert environ["HF_HOME"] == str(tree.named)


# -- the config ---------------------------------------------------------------------------
def test_the_config_takes_existing_absolute_paths(tmp_path: Path) -> None:
    assert parse_config({}, None).runtime.sandbox_read == []
    tree = Tree(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(tree.named)
    paths = [*tree.read, str(link)]
    config = parse_config({"runtime": {"sandbox_read": paths}}, None)
    assert config.runtime.sandbox_read == paths  # (as written: resolved as processes start)


def _refused(tmp_path: Path) -> list[tuple[str, str]]:
    """Values of sandbox_read and the error each gets, for paths made in ``tmp_path``."""
    temp = os.path.realpath(tempfile.gettempdir())
    to_root = tmp_path / "to-root"
    to_root.symlink_to("/")
    colon = tmp_path / "a:b"
    colon.mkdir()
    to_colon = tmp_path / "to-colon"
    to_colon.symlink_to(colon)
    return [
        ('["srv/hf-cache"]', r"runtime\.sandbox_read\[0\]: 'srv/hf-cache' is relative: "
                             r"expected an absolute path, such as \"/srv/hf-cache\""),
        ('["./licenses"]', r"runtime\.sandbox_read\[0\]: '\./licenses' is relative"),
        ('["/"]', r"runtime\.sandbox_read\[0\]: the root folder would let a confined "
                  r"sandbox process read every file of the host, its keys and tokens "
                  r"included, .*: expected the folders and files its library reads"),
        ('["/usr/.."]', r"runtime\.sandbox_read\[0\]: '/usr/\.\.' resolves to '/': the "
                        r"root folder would let"),
        (json.dumps([str(to_root)]), r"runtime\.sandbox_read\[0\]: '.*to-root' resolves "
                                     r"to '/': the root folder"),
        (json.dumps([temp]), rf"runtime\.sandbox_read\[0\]: {temp} is the system temporary "
                             rf"folder {temp}, where each confined sandbox process has its "
                             r"private folder: one could read another's"),
        (json.dumps([str(tmp_path / "missing")]),
         r"runtime\.sandbox_read\[0\]: '.*missing' does not exist: expected an existing "
         r"folder or file"),
        (json.dumps([str(colon)]), r"runtime\.sandbox_read\[0\]: '.*a:b' holds ':', which "
                                   r"separates the paths handed to a sandbox process"),
        # (before: "'...to-colon' resolves to '...a:b': '...to-colon' resolves to ...",
        # said twice)
        (json.dumps([str(to_colon)]), r"runtime\.sandbox_read\[0\]: '[^']*to-colon' resolves "
                                      r"to '[^']*a:b': '[^']*a:b' holds ':', which separates "
                                      r"the paths handed to a sandbox process: expected a "
                                      r"path without it$"),
        ("[1]", r"runtime\.sandbox_read\[0\]: 1 is not a string: expected the absolute "
                r"path of a folder or file"),
        (json.dumps(["/usr", ["/srv"]]), r"runtime\.sandbox_read\[1\]: \['/srv'\] is not a "
                                         r"string"),
        ('"/srv/hf-cache"', r"runtime\.sandbox_read: '/srv/hf-cache': expected a list of "
                            r"the absolute paths of folders and files confined sandbox "
                            r"processes may read"),
        ("{ path = \"/usr\" }", r"runtime\.sandbox_read: \{'path': '/usr'\}: expected a list"),
    ]


def test_the_config_refuses_what_is_no_path_a_process_may_read(tmp_path: Path) -> None:
    path = tmp_path / "wasinn.toml"
    for value, expected in _refused(tmp_path):
        path.write_text(f"[runtime]\nsandbox_read = {value}\n")
        with pytest.raises(ConfigError, match=expected) as raised:
            load_config(path)
        assert str(raised.value).startswith(f"{path}: runtime.sandbox_read"), value


def test_a_folder_that_holds_the_temporary_folder_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Its parent, as a sandbox process's private folder is made in it.
    base = tmp_path / "base"
    (base / "tmp").mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(base / "tmp"))
    problem = read_path_problem(str(base))
    assert problem is not None
    assert problem.startswith(f"{base.resolve()} holds the system temporary folder "
                              f"{(base / 'tmp').resolve()}, where each confined sandbox "
                              "process has its private folder")
    beside, own = tmp_path / "beside", base / "tmp" / "own"
    beside.mkdir()
    own.mkdir()
    assert read_path_problem(str(beside)) is None
    assert read_path_problem(str(own)) is None  # (a folder of its own in it)
