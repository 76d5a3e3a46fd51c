"""The confinement of the throw-away process that reads TensorFlow and TFLite models and
of sandbox processes (wasinn.backends._confine), in real child processes, with real
OpenVINO."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import wasinn.backends._confine as confine
import wasinn.backends._seccomp_filter as seccomp_filter
from tests.support import require_backend
from tests.tfmodels import SHAPE, relu_graphdef, relu_tflite
from wasinn import GraphEncoding, InvalidEncodingError, Tensor
from wasinn.backends import Device

LINUX = sys.platform.startswith("linux")
X86_64 = LINUX and platform.machine() in ("x86_64", "AMD64")
#: The kernel filters system calls (CONFIG_SECCOMP): then the filter must be applied.
HAS_SECCOMP = LINUX and "Seccomp:" in Path("/proc/self/status").read_text()


def landlock_abi() -> int:
    """The Landlock ABI this kernel offers (-1: none, or not Linux)."""
    if not LINUX:
        return -1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return int(libc.syscall(ctypes.c_long(444), None, ctypes.c_size_t(0), ctypes.c_uint32(1)))


HAS_LANDLOCK = landlock_abi() >= 1
CONFINE_FILE = str(Path(confine.__file__).resolve())
FSIZE = 1 << 20

#: A probe's ``attempt(name, action)``: records in ``results[name]`` "ok", or the OSError
#: it raised as "PermissionError:EACCES" (child scripts' code: needs ``errno``).
ATTEMPT = """
def attempt(name, action):
    try:
        action()
        results[name] = "ok"
    except OSError as exc:
        results[name] = type(exc).__name__ + ":" + errno.errorcode.get(exc.errno, "?")
"""

#: Confines itself as the reading process does (argv: _confine.py, fsize, a file outside
#: its directory, a directory outside it), then tries what it must not do and what it
#: must still do; prints the report and, per attempt, "ok" or the errno's name.
_PROBE = """
import ctypes, errno, importlib.util, json, os, socket, subprocess, sys, threading
spec = importlib.util.spec_from_file_location("_wasinn_confine", sys.argv[1])
confine = importlib.util.module_from_spec(spec)
spec.loader.exec_module(confine)
fsize = int(sys.argv[2])
report = confine.confine(fsize, os.getcwd())
import numpy as np
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
results = {}

def syscall(number, *args):
    if libc.syscall(ctypes.c_long(number), *map(ctypes.c_long, args)) < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))

""" + ATTEMPT + """
def fork():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)

def threads():
    out = []
    workers = [threading.Thread(target=lambda: out.append(float(
        (np.ones((64, 64)) @ np.ones((64, 64))).sum()))) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert out == [64.0 ** 3] * 4, out

def write(name, size):
    with open(name, "wb") as file:
        file.write(b"x" * size)

def read_outside():
    with open(sys.argv[3], "rb") as file:
        file.read()

attempt("execv", lambda: os.execv(sys.executable, [sys.executable, "-c", "pass"]))
attempt("fork", fork)
attempt("subprocess", lambda: subprocess.run([sys.executable, "-c", "pass"], check=True))
attempt("posix_spawn", lambda: os.waitpid(os.posix_spawn(
    sys.executable, [sys.executable, "-c", "pass"], {}), 0))
attempt("socket", socket.socket)
attempt("socketpair", socket.socketpair)
attempt("ptrace_attach", lambda: syscall(101, 16, os.getppid(), 0, 0))
attempt("process_vm_readv", lambda: syscall(310, os.getppid(), 0, 0, 0, 0, 0))
attempt("unshare", lambda: syscall(272, 0x10000000))
attempt("mount", lambda: syscall(165, 0, 0, 0, 0, 0))
attempt("bpf", lambda: syscall(321, 0, 0, 0))
attempt("io_uring_setup", lambda: syscall(425, 1, 0))
attempt("threads", threads)
attempt("numpy", lambda: np.linalg.inv(np.eye(8) * 2))
attempt("write_at_bound", lambda: write("small.bin", fsize))
attempt("write_past_bound", lambda: write("big.bin", fsize + 1))
attempt("read_outside", read_outside)
attempt("write_outside", lambda: write(os.path.join(sys.argv[4], "x"), 1))
attempt("symlink", lambda: os.symlink(sys.argv[3], "link"))
# Of /proc: its own folder and the machine's CPU and memory files, not the host's folder.
def read(path):
    with open(path, "rb") as file:
        file.read()
for name, path in (("proc_host_environ", f"/proc/{os.getppid()}/environ"),
                   ("proc_host_cmdline", f"/proc/{os.getppid()}/cmdline"),
                   ("proc_host_fds", f"/proc/{os.getppid()}/fd"),
                   ("proc_self_status", "/proc/self/status"),
                   ("proc_thread_self", "/proc/thread-self/stat"),
                   ("proc_cpuinfo", "/proc/cpuinfo"),
                   ("proc_meminfo", "/proc/meminfo")):
    attempt(name, (lambda p=path: os.listdir(p)) if name.endswith("fds") else
            (lambda p=path: read(p)))
# Acting on another process (the parent, with values that change nothing there) is
# refused; on itself it is not.
import resource
host = os.getppid()
attempt("prlimit_other", lambda: resource.prlimit(host, resource.RLIMIT_NOFILE))
attempt("prlimit_self", lambda: resource.prlimit(0, resource.RLIMIT_CORE, (0, 0)))
attempt("setpriority_other", lambda: os.setpriority(
    os.PRIO_PROCESS, host, os.getpriority(os.PRIO_PROCESS, host)))
attempt("setpriority_user", lambda: os.setpriority(
    os.PRIO_USER, 0, os.getpriority(os.PRIO_USER, 0)))
attempt("setpriority_self", lambda: os.setpriority(
    os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0)))
attempt("affinity_other", lambda: os.sched_setaffinity(host, os.sched_getaffinity(host)))
attempt("affinity_self", lambda: os.sched_setaffinity(0, os.sched_getaffinity(0)))
attempt("kill_other", lambda: os.kill(host, 0))
attempt("kill_self", lambda: os.kill(os.getpid(), 0))
attempt("reboot", lambda: syscall(169, 0, 0, 0, 0))  # bad magic numbers: EINVAL if let by
with open("/proc/self/status") as status:
    caps = {line.split(":")[0]: line.split()[1] for line in status if line.startswith("Cap")}
print(json.dumps({"report": report.as_dict(), "results": results, "caps": caps}))
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("confine")
    inside, outside = root / "inside", root / "outside"
    inside.mkdir()
    outside.mkdir()
    secret = outside / "secret.txt"
    secret.write_bytes(b"host secret")
    done = subprocess.run(
        [sys.executable, "-I", "-c", _PROBE, CONFINE_FILE, str(FSIZE), str(secret),
         str(outside)], capture_output=True, text=True, cwd=inside, timeout=120, check=False,
        env={"PATH": os.environ.get("PATH", "")})
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result["written"] = sorted(p.name for p in inside.iterdir())
    result["outside"] = sorted(p.name for p in outside.iterdir())
    return result


def test_limits_and_no_new_privs_are_applied(probe: dict[str, Any]) -> None:
    applied = probe["report"]["applied"]
    assert "core=0" in applied
    assert f"fsize={FSIZE}" in applied
    assert f"nofile={confine.NOFILE}" in applied or any(a.startswith("nofile=") for a in applied)
    if LINUX:
        assert "no_new_privs" in applied
    assert probe["report"]["failed"] == {}


def test_a_file_past_the_size_bound_cannot_be_written(probe: dict[str, Any]) -> None:
    assert probe["results"]["write_at_bound"] == "ok"
    assert probe["results"]["write_past_bound"] == "OSError:EFBIG"


@pytest.mark.skipif(not (X86_64 and HAS_SECCOMP), reason="seccomp filters on x86-64 Linux")
@pytest.mark.parametrize("call", [
    "execv", "fork", "subprocess", "posix_spawn", "socket", "socketpair", "ptrace_attach",
    "process_vm_readv", "unshare", "mount", "bpf", "io_uring_setup"])
def test_seccomp_refuses_processes_programs_sockets_and_tracing(
    probe: dict[str, Any], call: str
) -> None:
    assert "seccomp" in probe["report"]["applied"]
    assert probe["results"][call] == "PermissionError:EPERM"


@pytest.mark.skipif(not (X86_64 and HAS_SECCOMP), reason="seccomp filters on x86-64 Linux")
@pytest.mark.parametrize("call", [
    "prlimit_other", "setpriority_other", "setpriority_user", "affinity_other", "kill_other",
    "reboot"])
def test_seccomp_refuses_acting_on_another_process_or_the_machine(
    probe: dict[str, Any], call: str
) -> None:
    # Before: a confined process lowered the host's open-file and memory limits (the
    # host then failed with "Too many open files" and MemoryError), reniced it and
    # pinned it to one CPU; reboot(2) reached its argument check.
    assert probe["results"][call] == "PermissionError:EPERM"


@pytest.mark.parametrize("call", ["prlimit_self", "setpriority_self", "affinity_self",
                                  "kill_self"])
def test_the_process_may_still_act_on_itself(probe: dict[str, Any], call: str) -> None:
    assert probe["results"][call] == "ok"


@pytest.mark.skipif(not LINUX, reason="capabilities are Linux's")
def test_every_capability_is_dropped(probe: dict[str, Any]) -> None:
    # Before: a child of a root host kept root's capabilities (CapEff 000001fffeffffff).
    assert "capabilities" in probe["report"]["applied"]
    for kind in ("CapInh", "CapPrm", "CapEff", "CapAmb"):
        assert int(probe["caps"][kind], 16) == 0, probe["caps"]
    if os.geteuid() == 0:  # (without CAP_SETPCAP the bounding set cannot shrink)
        assert int(probe["caps"]["CapBnd"], 16) == 0, probe["caps"]


#: Starts a thread, then locks itself down (argv: _confine.py): the thread's attempt to
#: open a socket afterwards, and the lock-down's report.
_EARLY_THREAD = """
import importlib.util, json, os, socket, sys, threading
spec = importlib.util.spec_from_file_location("_wasinn_confine", sys.argv[1])
confine = importlib.util.module_from_spec(spec)
spec.loader.exec_module(confine)
go, said = threading.Event(), []

def early():
    go.wait()
    try:
        socket.socket()
        said.append("ok")
    except OSError as exc:
        said.append(type(exc).__name__)

thread = threading.Thread(target=early)
thread.start()
report = confine.lock_down(os.getcwd())
go.set()
thread.join()
print(json.dumps({"report": report.as_dict(), "socket": said[0]}))
"""


@pytest.mark.skipif(not (X86_64 and HAS_SECCOMP), reason="seccomp filters on x86-64 Linux")
def test_a_thread_started_before_the_lock_down_gets_the_filter_and_is_named(
        tmp_path: Path) -> None:
    # Before: the filter bound the calling thread only (prctl): threads a library had
    # started (ONNX Runtime's, OpenVINO's, OpenBLAS's) could open sockets, exec and
    # write the host's files.
    done = subprocess.run([sys.executable, "-I", "-c", _EARLY_THREAD, CONFINE_FILE],
                          capture_output=True, text=True, cwd=tmp_path, timeout=60,
                          check=False, env={"PATH": os.environ.get("PATH", "")})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["socket"] == "PermissionError"
    assert "seccomp" in result["report"]["applied"]
    if HAS_LANDLOCK:  # landlock cannot bind it: the report says so
        assert result["report"]["failed"]["landlock"].startswith(
            "1 thread(s) started before it are not bound by it (")


def test_threads_and_numpy_still_work(probe: dict[str, Any]) -> None:
    assert probe["results"]["threads"] == "ok"
    assert probe["results"]["numpy"] == "ok"


@pytest.mark.skipif(not HAS_LANDLOCK, reason="landlock (Linux 5.13 or later, enabled)")
def test_landlock_keeps_reads_and_writes_to_the_private_directory(
    probe: dict[str, Any]
) -> None:
    assert any(a.startswith("landlock(") for a in probe["report"]["applied"])
    assert probe["results"]["read_outside"] == "PermissionError:EACCES"
    assert probe["results"]["write_outside"] == "PermissionError:EACCES"
    assert probe["results"]["symlink"] == "PermissionError:EACCES"
    assert probe["outside"] == ["secret.txt"]
    assert probe["written"] == ["big.bin", "small.bin"]  # big.bin: truncated at the bound


def test_the_links_in_the_code_folders_are_read_where_they_lead(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A site-packages whose packages are links (Nix, Bazel): landlock checks the file a
    # link leads to, so their targets are readable too (the import itself, confined:
    # test_sandbox's test_a_confined_process_imports_a_package_whose_folder_is_a_symlink);
    # one level only, and never a target that would undo the confinement.
    tmp_path = tmp_path.resolve()  # (the rules' paths are resolved)
    store, site, temp = tmp_path / "store", tmp_path / "site", tmp_path / "temp"
    for folder in (store / "pkg" / "sub", store / "deep", site, temp / "private"):
        folder.mkdir(parents=True)
    (store / "module.py").write_text("")
    (site / "pkg").symlink_to(store / "pkg")
    (site / "module.py").symlink_to(store / "module.py")
    (site / "real").mkdir()
    (site / "real" / "deep").symlink_to(store / "deep")  # (deeper: not followed)
    (site / "root").symlink_to("/")
    (site / "temps").symlink_to(temp)  # (holds the private folders)
    (site / "gone").symlink_to(tmp_path / "nowhere")
    (temp / "private" / "link").symlink_to(store / "deep")  # (not a code folder)
    monkeypatch.setattr(sys, "path", ["", str(tmp_path / "absent.zip"), str(site)])
    rules = dict(confine.landlock_rules(str(temp / "private")))
    linked = {path for path in rules if path.startswith(str(store))}
    assert linked == {str(store / "pkg"), str(store / "module.py")}
    assert rules[str(store / "pkg")] == rules[str(site)]  # (read only, as the folder)
    assert "/" not in rules and str(temp) not in rules
    # A folder the caller names is a code folder too.
    rules = dict(confine.landlock_rules(str(temp / "private"), [str(site / "real")]))
    assert str(store / "deep") in rules


@pytest.mark.skipif(not HAS_LANDLOCK, reason="landlock (Linux 5.13 or later, enabled)")
def test_landlock_keeps_the_host_out_of_procs_reach(probe: dict[str, Any]) -> None:
    # Before: all of /proc was readable, the host's environment and command line too.
    results = probe["results"]
    for name in ("proc_host_environ", "proc_host_cmdline", "proc_host_fds"):
        assert results[name] == "PermissionError:EACCES", name
    for name in ("proc_self_status", "proc_thread_self", "proc_cpuinfo", "proc_meminfo"):
        assert results[name] == "ok", name


def test_seccomp_program_is_a_whole_number_of_instructions() -> None:
    program = seccomp_filter.seccomp_program()
    assert len(program) % 8 == 0
    on_itself = sum(2 + sum(2 + len(values) for _, values in checks)
                    for _, checks in seccomp_filter.ON_ITSELF_X86_64.values())
    assert len(program) // 8 == 15 + 2 * len(seccomp_filter.DENIED_X86_64) + on_itself


# -- through the backend ------------------------------------------------------------------
X = np.array([[-1.0, 0.5, -2.0, 3.0]], dtype=np.float32)
assert X.shape == SHAPE
CPU = Device.parse("cpu")


@pytest.fixture
def backend() -> Any:
    require_backend("openvino")
    from wasinn.backends.openvino import OpenVinoBackend

    return OpenVinoBackend()


@pytest.mark.parametrize(("encoding", "model", "what"), [
    (GraphEncoding.TENSORFLOWLITE, relu_tflite, "model.tflite"),
    (GraphEncoding.TENSORFLOW, relu_graphdef, "model.pb"),
], ids=["tflite", "tensorflow"])
def test_models_load_and_run_under_confinement_and_the_host_logs_it(
    backend: Any, caplog: pytest.LogCaptureFixture, encoding: GraphEncoding, model: Any,
    what: str
) -> None:
    with caplog.at_level(logging.DEBUG, logger="wasinn.backends"):
        graph = backend.load([model()], encoding, CPU)
    (y,) = graph.run({graph.inputs[0].name: Tensor.from_numpy(X)}).values()
    np.testing.assert_array_equal(y.numpy(), np.maximum(X, 0))
    lines = [r.getMessage() for r in caplog.records
             if r.getMessage().startswith(f"the process that read the {what} was confined: ")]
    assert len(lines) == 1, caplog.text
    assert "core=0" in lines[0] and "fsize=" in lines[0]
    if X86_64 and HAS_SECCOMP:
        assert "seccomp" in lines[0]
    if HAS_LANDLOCK:
        assert "landlock(abi=" in lines[0]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_an_ir_past_the_size_bound_is_an_invalid_encoding(
    backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The one-op model is 344 bytes; its IR's XML about 1 kB.
    import wasinn.backends._ovread as ovread

    monkeypatch.setattr(ovread, "IR_SIZE_FACTOR", 1)
    monkeypatch.setattr(ovread, "IR_SIZE_MARGIN", 0)
    with pytest.raises(InvalidEncodingError, match=r"^openvino: cannot read the model.tflite: "
                       r"as IR it takes over 344 bytes"):
        backend.load([relu_tflite()], GraphEncoding.TENSORFLOWLITE, CPU)


def test_a_report_is_taken_out_of_the_log_and_failures_warn_once_a_process(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(confine, "_warned", set())
    report = confine.Report()
    report.applied.append("core=0")
    report.failed["seccomp"] = "prctl: Invalid argument"
    report.unsupported["landlock"] = "landlock is disabled in this kernel"
    stderr = b"frontend says hi\n" + confine.report_line(report).encode() + b"last words\n"
    taken, log = confine.take_report(stderr)
    assert taken == report.as_dict()
    assert log == b"frontend says hi\nlast words\n"
    with caplog.at_level(logging.DEBUG, logger="wasinn.backends"):
        confine.log_report(taken, "model.pb")
        confine.log_report(taken, "model.pb")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["the processes that read TensorFlow and TensorFlow Lite models are not "
                        "confined by seccomp, which could not be applied: prctl: Invalid "
                        "argument"]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 1 and "landlock is disabled" in infos[0]
    debugs = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert debugs == ["the process that read the model.pb was confined: core=0"] * 2


def test_the_host_reads_back_only_plain_files_of_the_childs_own(tmp_path: Path) -> None:
    require_backend("openvino")
    import wasinn.backends._ovread as ovread

    # A child that runs code could leave a link to a host file where the IR should be,
    # for the host to read as the model's weights and a guest to read back by inference.
    secret = tmp_path / "secret"
    secret.write_bytes(b"host secret")
    (tmp_path / "symlink.bin").symlink_to(secret)
    os.link(secret, tmp_path / "hardlink.bin")
    os.mkfifo(tmp_path / "fifo.bin")
    (tmp_path / "plain.bin").write_bytes(b"IR")
    assert ovread._read_written(tmp_path / "plain.bin", "model.pb") == b"IR"
    for name in ("symlink.bin", "hardlink.bin", "fifo.bin"):
        with pytest.raises(InvalidEncodingError, match=f"its IR {name} "):
            ovread._read_written(tmp_path / name, "model.pb")


def test_a_reading_process_stopped_by_a_signal_is_not_said_to_have_crashed_on_the_bytes(
        ) -> None:
    # Before: a SIGTERM to the host's process group (systemd) failed a valid model's load
    # with "crashed on it (SIGTERM) ...: the bytes are malformed".
    require_backend("openvino")
    import signal

    import wasinn.backends._ovread as ovread

    stopped = ovread._child_failure(-signal.SIGTERM, b"", b"")
    assert stopped == ("the throw-away process that reads such models was stopped by "
                       "SIGTERM (sent to it, or to the host's process group), not by these "
                       "bytes")
    assert ovread._child_failure(-signal.SIGSEGV, b"", b"") == (
        "OpenVINO's frontend crashed on it (SIGSEGV) in the throw-away process that reads "
        "such models: the bytes are malformed")
    assert "signal.signal(signal.SIGINT, signal.SIG_IGN)" in ovread._CONVERT
