"""What a sandboxed graph's process may do with the machine's devices: a GPU graph's may
use the GPUs' device files and read what their drivers read (wasinn.backends._confine's
``gpu``), a CPU graph's may not, and asks its library for no device list (which loads
the GPUs' drivers: under the lock-down they failed, crashed or hung).

No GPU here: the rules are checked as built (a fake /dev), as applied by the kernel's
Landlock (a fake device file that is /dev/null, /proc's files), and as a GPU graph's
process gets them (a fake backend's graph on gpu:0). A GPU graph's process has not run
a CUDA model under them yet (see the README's "Sandboxed graphs").
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

import wasinn.backends._confine as confine
from tests.backend_models import affine
from tests.crashing_backend import CrashingBackend
from tests.listing_traps import ENTRIES
from tests.support import require_backend, sandbox_children
from tests.test_confine import landlock_abi
from wasinn import BackendRuntimeError, GraphEncoding, Tensor
from wasinn.backends import BackendRef, Device, LoadOptions
from wasinn.backends.sandbox import ProcessLimit, Spares, load_sandboxed

CPU = Device.parse("cpu")
GPU0 = Device.parse("gpu:0")
LINUX = sys.platform.startswith("linux")


# -- the rules ------------------------------------------------------------------------------
@pytest.fixture
def fake_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """A /dev with two NVIDIA GPUs, unified memory, MIG capabilities (the configuration's,
    the monitor's and an instance's) and a render node beside a display's node, beside
    files of other names, and a driver's /proc folder (``read``) beside one that is
    missing, and no MIG minors' list; named in _confine for the test."""
    dev = tmp_path / "dev"
    (dev / "nvidia-caps").mkdir(parents=True)
    (dev / "dri" / "by-path").mkdir(parents=True)
    for name in ("nvidiactl", "nvidia0", "nvidia1", "nvidia-uvm", "nvidia-uvm-tools",
                 "nvidia-caps/nvidia-cap1", "nvidia-caps/nvidia-cap2",
                 "nvidia-caps/nvidia-cap3", "dri/renderD128", "dri/card0",
                 "dri/by-path/pci-0000:00:02.0-card", "nvidia-modeset", "nvidia0x",
                 "nvidiafoo", "null", "sda", "kvm"):
        (dev / name).touch()
    read = tmp_path / "proc-driver-nvidia"
    read.mkdir()
    monkeypatch.setattr(confine, "DEV", str(dev))
    monkeypatch.setattr(confine, "GPU_READ", (str(read), str(tmp_path / "missing")))
    monkeypatch.setattr(confine, "MIG_MINORS", str(tmp_path / "no-mig-minors"))
    return {"dev": str(dev), "read": str(read), "missing": str(tmp_path / "missing")}


def test_a_gpu_graphs_process_may_use_the_gpus_device_files_that_exist(
        fake_machine: dict[str, str], tmp_path: Path) -> None:
    # Before: all of /dev/dri (the display's card0, whose first opener becomes the DRM
    # master, too) and of /dev/nvidia-caps (the MIG configuration's and monitor's too).
    dev = fake_machine["dev"]
    devices = {f"{dev}/{name}" for name in ("nvidiactl", "nvidia0", "nvidia1", "nvidia-uvm",
                                            "nvidia-uvm-tools", "nvidia-caps/nvidia-cap3",
                                            "dri/renderD128")}
    assert set(confine.gpu_device_files()) == devices
    rules = dict(confine.landlock_rules(str(tmp_path), gpu=True))
    device_access = (confine._FS_READ_FILE | confine._FS_READ_DIR | confine._FS_WRITE_FILE
                     | confine._FS_IOCTL_DEV)
    assert {path for path, access in rules.items() if access & confine._FS_IOCTL_DEV} \
        == devices
    assert all(rules[path] == device_access for path in devices)
    assert rules[f"{dev}/dri"] == rules[f"{dev}/nvidia-caps"] == confine._FS_READ_DIR
    assert not [path for path in rules if path.startswith(
        (f"{dev}/dri/card0", f"{dev}/dri/by-path", f"{dev}/nvidia-caps/nvidia-cap1",
         f"{dev}/nvidia-caps/nvidia-cap2"))]
    assert rules[fake_machine["read"]] == confine._READ
    assert fake_machine["missing"] not in rules
    # a kernel whose Landlock predates the ioctl right is given the rest
    older = dict(confine.landlock_rules(str(tmp_path), gpu=True,
                                        handled=device_access & ~confine._FS_IOCTL_DEV))
    assert all(older[path] == device_access & ~confine._FS_IOCTL_DEV for path in devices)


def test_the_mig_capabilities_left_out_are_those_the_driver_lists(
        fake_machine: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    minors = tmp_path / "mig-minors"
    minors.write_text("config 3\nmonitor 1\ngpu0/gi1/access 2\n")
    monkeypatch.setattr(confine, "MIG_MINORS", str(minors))
    caps = {path for path in confine.gpu_device_files() if "nvidia-caps" in path}
    assert caps == {f"{fake_machine['dev']}/nvidia-caps/nvidia-cap2"}


def test_a_gpu_graphs_process_may_read_the_unified_memorys_driver_files() -> None:
    assert "/proc/driver/nvidia-uvm" in confine.GPU_READ  # (its initialisation reads them)


def test_a_cpu_graphs_process_gets_none_of_it(fake_machine: dict[str, str],
                                              tmp_path: Path) -> None:
    rules = dict(confine.landlock_rules(str(tmp_path)))
    assert not [path for path in rules if path.startswith(fake_machine["dev"])]
    assert fake_machine["read"] not in rules
    assert not any(access & confine._FS_IOCTL_DEV for access in rules.values())
    assert not any(path.startswith(("/proc/driver", "/proc/devices", "/proc/modules"))
                   for path in rules)
    assert not any(access & confine._FS_WRITE_FILE for path, access in rules.items()
                   if path.startswith("/proc"))  # (not even its threads' names)


def test_no_device_file_where_dev_cannot_be_listed(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    monkeypatch.setattr(confine, "DEV", str(tmp_path / "none"))
    assert confine.gpu_device_files() == []


# -- as the kernel applies them ---------------------------------------------------------------
#: Locks itself down (argv: _confine.py, a fake /dev, "gpu" or "cpu"), then says, per
#: attempt, "ok" or the errno's name.
_PROBE = """
import errno, fcntl, importlib.util, json, os, sys, termios
spec = importlib.util.spec_from_file_location("_wasinn_confine", sys.argv[1])
confine = importlib.util.module_from_spec(spec)
spec.loader.exec_module(confine)
confine.DEV = sys.argv[2]
report = confine.lock_down(os.getcwd(), gpu=sys.argv[3] == "gpu")
results = {"report": report.as_dict()}

def attempt(name, action):
    try:
        action()
        results[name] = "ok"
    except OSError as exc:
        results[name] = errno.errorcode.get(exc.errno, "?")

def read(path):
    with open(path, "rb") as file:
        file.read(1)

def ioctl(path):  # TCGETS: /dev/null has no ioctl of its own (ENOTTY)
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.ioctl(fd, termios.TCGETS, bytes(64))
    finally:
        os.close(fd)

attempt("read_write_device", lambda: os.close(os.open(os.path.join(sys.argv[2], "nvidiactl"),
                                                      os.O_RDWR)))
attempt("ioctl_device", lambda: ioctl(os.path.join(sys.argv[2], "nvidia0")))
attempt("proc_devices", lambda: read("/proc/devices"))
attempt("proc_modules", lambda: read("/proc/modules"))
attempt("other_device_file", lambda: os.close(os.open(os.path.join(sys.argv[2], "kvm"),
                                                      os.O_RDWR)))

# What the NVIDIA driver does in cuInit: name a thread other than the caller (glibc writes
# its /proc/self/task/<tid>/comm); 0 or the errno's name.
import ctypes, threading
stop = threading.Event()
thread = threading.Thread(target=stop.wait)
thread.start()
failed = ctypes.CDLL(None).pthread_setname_np(ctypes.c_ulong(thread.ident), b"cuda-EvtHandlr")
results["name_another_thread"] = errno.errorcode.get(failed, "?") if failed else 0
stop.set()
thread.join()
print(json.dumps(results))
"""


@pytest.mark.skipif(not LINUX or landlock_abi() < 1, reason="no landlock here")
@pytest.mark.parametrize("kind", ["gpu", "cpu"])
def test_landlock_lets_a_gpu_graphs_process_reach_the_device_files_and_a_cpu_graphs_not(
        kind: str, tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidiactl").touch()
    (dev / "kvm").touch()
    (dev / "nvidia0").symlink_to("/dev/null")  # a character device, with no ioctl
    work = tmp_path / "work"
    work.mkdir()
    done = subprocess.run([sys.executable, "-I", "-c", _PROBE,
                           str(Path(confine.__file__).resolve()), str(dev), kind],
                          capture_output=True, text=True, cwd=work, timeout=60, check=True)
    results = json.loads(done.stdout)
    applied = results["report"]["applied"]
    assert any(a.startswith("landlock") for a in applied), results
    if kind == "gpu":
        assert f"gpu({dev}/nvidia0 {dev}/nvidiactl)" in applied, applied
        assert results["read_write_device"] == "ok"
        assert results["proc_devices"] == "ok"
        assert results["proc_modules"] == ("ok" if Path("/proc/modules").exists() else
                                           "ENOENT")
        # through to the device, which has no such ioctl (ABI 5: before, not checked)
        assert results["ioctl_device"] == "ENOTTY"
        # Before: EACCES, which the NVIDIA driver (570 and later) makes CUDA error 304.
        assert results["name_another_thread"] == 0
    else:
        assert not any(a.startswith("gpu") for a in applied), applied
        assert results["read_write_device"] == "EACCES"
        assert results["proc_devices"] == "EACCES"
        assert results["proc_modules"] == ("EACCES" if Path("/proc/modules").exists() else
                                           "ENOENT")
        assert results["ioctl_device"] == "EACCES"  # (it may not even open it)
        assert results["name_another_thread"] == "EACCES"
    assert results["other_device_file"] == "EACCES"


# -- as a graph's process gets them ------------------------------------------------------------
@pytest.fixture
def spares() -> Spares:
    return Spares(1, limit=ProcessLimit(8))


def test_a_gpu_graphs_process_is_confined_with_the_device_files_and_a_cpu_graphs_without(
        spares: Spares) -> None:
    # Before: a GPU graph's process was not confined at all. Each kind of process is a
    # spare of its own: a CPU graph's spare, confined without them, serves no GPU graph.
    with _closed_with_their_processes(spares) as graphs:
        for device in (CPU, GPU0, CPU, GPU0):
            graph = load_sandboxed(CrashingBackend(), [b"fake:add=1"], GraphEncoding.GGML,
                                   device, LoadOptions(sandbox=True), spares=spares)
            graphs.append(graph)
            out = graph.run({"x": Tensor.from_numpy(np.ones((1, 4), np.float32))})
            np.testing.assert_array_equal(out["y"].numpy(), np.full((1, 4), 2.0, np.float32))
            report = graph.confinement
            assert report is not None and "seccomp" in report["applied"], report
            gpu = [a for a in report["applied"] if a.startswith("gpu(")]
            nofile = psutil.Process(graph.pid).rlimit(psutil.RLIMIT_NOFILE)
            if device == GPU0:
                assert graph.max_bytes is None  # (its driver maps memory of its own)
                assert nofile == (confine.GPU_NOFILE,) * 2
                files = " ".join(confine.gpu_device_files()) or \
                    f"no device file in {confine.DEV}"
                if any(a.startswith("landlock") for a in report["applied"]):
                    assert gpu == [f"gpu({files})"], report
            else:
                assert graph.max_bytes is not None
                assert nofile == (confine.NOFILE,) * 2
                assert gpu == [], report
            _wait_for_a_spare(spares)


@contextlib.contextmanager
def _closed_with_their_processes(spares: Spares) -> Iterator[list[Any]]:
    """A list for the graphs a test loads, closed at its end with ``spares``; then no
    sandbox process is left."""
    graphs: list[Any] = []
    try:
        yield graphs
    finally:
        for graph in graphs:
            graph.close()
        spares.close()
    assert sandbox_children() == []


def _wait_for_a_spare(spares: Spares) -> None:
    until = time.monotonic() + 60
    while spares.ready() < spares.waiting() and time.monotonic() < until:
        time.sleep(0.02)


# -- a CPU graph's process lists no device ------------------------------------------------------
@pytest.mark.parametrize("backend_name", ["onnxruntime", "openvino", "pytorch"])
def test_a_cpu_graphs_process_asks_its_library_for_no_device_list(
        backend_name: str, spares: Spares) -> None:
    # Before: torch's load asked torch.cuda.is_available() (CUDA error 304 under the
    # lock-down, where the driver may not open its device files) and OpenVINO's listed
    # every plugin's devices (its GPU plugin and OpenCL's drivers: the process was killed
    # by SIGSEGV, or hung, on a machine with an NVIDIA GPU). Here every listing raises,
    # in the graph's process and in the spare that serves the next load.
    require_backend({"pytorch": "torch"}.get(backend_name, backend_name))
    ref = BackendRef(backend_name, ENTRIES[backend_name])
    builders, encoding = affine(backend_name, 2.0, 1.0)
    with _closed_with_their_processes(spares) as graphs:
        for _ in range(2):  # in a process started for it, then in a spare
            graph = load_sandboxed(ref, builders, encoding, CPU, LoadOptions(sandbox=True),
                                   spares=spares)
            graphs.append(graph)
            out = graph.run({graph.inputs[0].name: np.ones((1, 4), np.float32)})
            np.testing.assert_array_equal(out[graph.outputs[0].name].numpy(),
                                          np.full((1, 4), 3.0, np.float32))
            _wait_for_a_spare(spares)


@pytest.mark.parametrize("backend_name", ["openvino", "pytorch"])
def test_the_traps_are_set_a_gpu_graphs_process_lists_devices(
        backend_name: str) -> None:
    # (that the test above would see a listing: a GPU graph's load asks which there are)
    require_backend({"pytorch": "torch"}.get(backend_name, backend_name))
    builders, encoding = affine(backend_name, 2.0, 1.0)
    with pytest.raises(BackendRuntimeError, match=r"Listed: .* was asked for the devices"):
        load_sandboxed(BackendRef(backend_name, ENTRIES[backend_name]), builders, encoding,
                       GPU0, LoadOptions(sandbox=True), spares=Spares(0))
    assert sandbox_children() == []


def test_the_process_that_lists_no_device_still_names_only_the_cpu() -> None:
    # A CPU graph's backend answers devices() with the CPU alone, asking nothing.
    from wasinn.backends._sandbox_child import _list_the_cpu_only

    backend = CrashingBackend()
    assert Device.parse("gpu:0") in backend.devices()
    _list_the_cpu_only(backend)
    assert backend.devices() == [CPU]
    assert Device.parse("gpu:0") in CrashingBackend().devices()  # (that backend alone)


def test_an_openvino_cpu_load_lists_no_device() -> None:
    # OpenVINO's listing loads every plugin (the GPU's, with OpenCL's drivers): a CPU
    # load, in the host as in a sandbox process, compiles on "CPU" without it.
    require_backend("openvino")
    from wasinn.backends.openvino import OpenVinoBackend

    class Unlisted:  # the process's Core, refusing to list
        def __init__(self, core: Any) -> None:
            self._core = core

        @property
        def available_devices(self) -> list[str]:
            raise AssertionError("OpenVINO was asked which devices there are")

        def __getattr__(self, name: str) -> Any:
            return getattr(self._core, name)

    backend = OpenVinoBackend()
    backend._core = Unlisted(backend.core)
    builders, encoding = affine("openvino", 2.0, 1.0)
    graph = backend.load(builders, encoding, CPU)
    try:
        out = graph.run({graph.inputs[0].name: np.ones((1, 4), np.float32)})
        np.testing.assert_array_equal(out[graph.outputs[0].name].numpy(),
                                      np.full((1, 4), 3.0, np.float32))
    finally:
        graph.close()


@pytest.mark.skipif(not LINUX, reason="Linux's /proc/<pid>/maps")
def test_a_cpu_graphs_openvino_process_loads_no_other_plugin_than_the_cpus() -> None:
    # Before: listing loaded the GPU and NPU plugins (and, through the GPU's, OpenCL and
    # every driver /etc/OpenCL/vendors names), whatever the graph's device.
    require_backend("openvino")
    builders, encoding = affine("openvino", 2.0, 1.0)
    graph = load_sandboxed(BackendRef("openvino", "wasinn.backends.openvino:OpenVinoBackend"),
                           builders, encoding, CPU, LoadOptions(sandbox=True),
                           spares=Spares(0))
    try:
        graph.run({graph.inputs[0].name: np.ones((1, 4), np.float32)})
        mapped = {Path(line.split()[-1]).name
                  for line in Path(f"/proc/{graph.pid}/maps").read_text().splitlines()
                  if "/" in line}
        assert "libopenvino_intel_cpu_plugin.so" in mapped
        assert not {name for name in mapped if "gpu_plugin" in name or "npu_plugin" in name
                    or name.startswith("libOpenCL")}, sorted(mapped)
    finally:
        graph.close()
    assert sandbox_children() == []
