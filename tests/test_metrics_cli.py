"""``wasinn run --metrics-port``: the run's figures scraped over HTTP from localhost while
its guest runs, and what a port that cannot be served says; :class:`MetricsServer`."""

from __future__ import annotations

import importlib
import logging
import re
import socket
import struct
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

import wasinn.scheduler.metrics
from tests.guest_support import WAT_DIR
from tests.support import require_backend
from tests.test_metrics import Figures
from wasinn.cli import main
from wasinn.modelgen import affine_onnx
from wasinn.scheduler.metrics import MetricsServer

#: A guest that stays until its stdin ends: the wasi-nn calls run, then it waits.
WAITS = WAT_DIR / "read_stdin.wat"


def serving_guest(path: Path, model: bytes) -> Path:
    """A core-module guest (WAT, at ``path``) that loads the registry's "affine" by name
    and ``model`` from its own bytes, runs the one twice and the other once on
    x = [[1, 2, 3, 4]], writes "ready" to its stdout, then reads its stdin until it ends
    and exits 0 (1 to 5: the wasi-nn call that failed)."""
    builder = "".join(f"\\{b:02x}" for b in struct.pack("<2I", 4096, len(model)))
    model_escaped = "".join(f"\\{b:02x}" for b in model)
    path.write_text(f"""(module
  (import "wasi_ephemeral_nn" "load" (func $load (param i32 i32 i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "load_by_name" (func $lbn (param i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "init_execution_context" (func $init (param i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "set_input" (func $set (param i32 i32 i32) (result i32)))
  (import "wasi_ephemeral_nn" "compute" (func $compute (param i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_write" (func $write (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_read" (func $read (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
  (memory (export "memory") 2)
  ;; 0: the builder (the model at 4096); 16: the name; 32: dims [1, 4]; 48: the tensor
  ;; record (f32, data at 80); 96, 100: the graphs; 104: a context; 128: "ready\\n";
  ;; 144: an iovec; 160: a count; 256: what stdin sends
  (data (i32.const 0) "{builder}")
  (data (i32.const 16) "affine")
  (data (i32.const 32) "\\01\\00\\00\\00\\04\\00\\00\\00")
  (data (i32.const 48) "\\20\\00\\00\\00\\02\\00\\00\\00\\01\\00\\00\\00")
  (data (i32.const 60) "\\50\\00\\00\\00\\10\\00\\00\\00")
  (data (i32.const 80) "\\00\\00\\80\\3f\\00\\00\\00\\40\\00\\00\\40\\40\\00\\00\\80\\40")
  (data (i32.const 128) "ready\\n")
  (data (i32.const 4096) "{model_escaped}")
  (func $check (param $errno i32) (param $step i32)
    (if (local.get $errno) (then (call $exit (local.get $step)))))
  (func $run (param $graph i32)
    (call $check (call $init (local.get $graph) (i32.const 104)) (i32.const 3))
    (call $check (call $set (i32.load (i32.const 104)) (i32.const 0) (i32.const 48)) (i32.const 4))
    (call $check (call $compute (i32.load (i32.const 104))) (i32.const 5)))
  (func (export "_start")
    (call $check (call $lbn (i32.const 16) (i32.const 6) (i32.const 96)) (i32.const 1))
    (call $check (call $load (i32.const 0) (i32.const 1) (i32.const 1) (i32.const 0)
                             (i32.const 100)) (i32.const 2))
    (call $run (i32.load (i32.const 96)))
    (call $run (i32.load (i32.const 96)))
    (call $run (i32.load (i32.const 100)))
    (i32.store (i32.const 144) (i32.const 128))
    (i32.store (i32.const 148) (i32.const 6))
    (drop (call $write (i32.const 1) (i32.const 144) (i32.const 1) (i32.const 160)))
    (i32.store (i32.const 144) (i32.const 256))
    (i32.store (i32.const 148) (i32.const 16))
    (drop (call $read (i32.const 0) (i32.const 144) (i32.const 1) (i32.const 160)))
    (call $exit (i32.const 0))))
""")
    return path


def test_a_run_serves_its_figures_while_the_guest_runs(tmp_path: Path) -> None:
    require_backend("onnxruntime")
    (tmp_path / "affine.onnx").write_bytes(affine_onnx(2.0, 1.0))
    guest = serving_guest(tmp_path / "serving.wat", affine_onnx(2.0, 1.0))
    child = subprocess.Popen(
        [sys.executable, "-m", "wasinn.cli", "run", "--no-sandbox", "--metrics-port", "0",
         "--nn-preload", f"affine:onnx:cpu:{tmp_path / 'affine.onnx'}", str(guest)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=tmp_path)
    assert child.stdin is not None and child.stdout is not None and child.stderr is not None
    try:
        said = child.stderr.readline()  # port 0: the port taken is printed
        found = re.fullmatch(r"wasinn: serving metrics at (http://127\.0\.0\.1:(\d+)/metrics)\n",
                             said)
        assert found is not None, said + child.stderr.read()
        url, port = found[1], int(found[2])
        assert port != 0
        ready = child.stdout.readline()
        assert ready == "ready\n", ready + child.stderr.read()
        with urllib.request.urlopen(url, timeout=60) as response:
            assert response.status == 200
            text = response.read().decode()
        child.stdin.close()  # the guest's read ends: it exits
        assert child.wait(timeout=120) == 0, child.stderr.read()
    finally:
        child.kill()
        child.stdin.close()
        child.stdout.close()
        child.stderr.close()
    samples = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
               for family in text_string_to_metric_families(text)
               for sample in family.samples}

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    # The device, the registry model, the model the guest loaded from its bytes (wasi-nn's
    # load names none: named after the guest's tenant, its file's name, and how many it
    # loaded before: serving.wat#0) and the guest's tenant, as they are now.
    assert value("wasinn_device_requests_total", device="cpu", outcome="completed") == 3
    assert value("wasinn_device_workers", device="cpu") >= 1
    assert value("wasinn_model_requests_total", model="affine", outcome="completed") == 2
    own = {labels for name, labels in samples if name == "wasinn_model_requests_total"
           and dict(labels)["model"] != "affine" and dict(labels)["outcome"] == "completed"}
    assert len(own) == 1, own
    (model,) = [dict(labels)["model"] for labels in own]
    assert model == "serving.wat#0", model
    assert value("wasinn_model_requests_total", model=model, outcome="completed") == 1
    assert value("wasinn_tenant_requests_total", tenant="serving.wat",
                 outcome="completed") == 3
    assert value("wasinn_model_request_latency_window", model="affine") == 2


def test_the_metrics_server_is_a_registry_of_its_own_on_localhost() -> None:
    with MetricsServer(Figures(), 0) as server:
        assert server.url == f"http://127.0.0.1:{server.port}/metrics"
        assert server._server.server_address[0] == "127.0.0.1"
        with urllib.request.urlopen(server.url, timeout=60) as response:
            text = response.read().decode()
        assert server.registry.get_sample_value("wasinn_device_lost", {"device": "gpu:0"}) == 1
    names = {family.name for family in text_string_to_metric_families(text)}
    assert "wasinn_device_lost" in names
    assert "python_info" not in names  # the global registry's collectors are not served
    assert REGISTRY.get_sample_value("wasinn_device_lost", {"device": "gpu:0"}) is None
    server.close()  # idempotent
    # Closed: the port is free again.
    with socket.create_server(("127.0.0.1", server.port)):
        pass


def test_a_connection_that_sends_nothing_is_closed_after_the_timeout(
        monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    # Before: it held a server thread for ever (prometheus_client's handler has no
    # timeout), and a client opening many such connections held as many threads. Then:
    # each such close printed socketserver's traceback of the TimeoutError on stderr.
    from wasinn.scheduler import metrics

    monkeypatch.setattr(metrics, "CONNECTION_TIMEOUT_S", 0.5)
    caplog.set_level(logging.DEBUG, logger="wasinn.scheduler")
    with MetricsServer(Figures(), 0) as server, socket.create_connection(
            ("127.0.0.1", server.port), timeout=30) as idle:
        idle.sendall(b"GET /metr")  # and no more
        assert idle.recv(1) == b""  # the server closed it (a hang fails at 30 s)
        with urllib.request.urlopen(server.url, timeout=60) as response:
            assert response.status == 200  # and serves the next scrape
    assert "Traceback" not in capfd.readouterr().err
    # Logged at DEBUG (before the close: the recv above saw it).
    (record,) = caplog.records
    assert record.levelno == logging.DEBUG
    assert re.fullmatch(r"metrics server: the connection from 127\.0\.0\.1:\d+ ended "
                        r"\(TimeoutError: timed out\)", record.getMessage())


@pytest.mark.parametrize("port", [-1, 65536, True, "9100", 80.0])
def test_a_bad_port_is_refused(port: object) -> None:
    with pytest.raises(ValueError, match=r"port=.*expected a TCP port from 0 to 65535"):
        MetricsServer(Figures(), port)  # type: ignore[arg-type]


def test_a_port_in_use_names_the_address_and_port(capfd: pytest.CaptureFixture[str]) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=rf"^cannot serve metrics at 127\.0\.0\.1:{port}: "
                                          r"the address is in use"):
            MetricsServer(Figures(), port)
        assert main(["run", "--metrics-port", str(port), str(WAITS)]) == 1
    err = capfd.readouterr().err
    assert err == (f"wasinn: error: cannot serve metrics at 127.0.0.1:{port}: the address "
                   "is in use (another server listens there): choose another port, or 0 "
                   "for a free one\n")


def test_an_address_not_of_this_machine_is_named(capfd: pytest.CaptureFixture[str]) -> None:
    # 192.0.2.1: TEST-NET-1 (RFC 5737), no machine's; the bind fails with no traffic.
    assert main(["run", "--metrics-port", "0", "--metrics-addr", "192.0.2.1",
                 str(WAITS)]) == 1
    assert capfd.readouterr().err == ("wasinn: error: cannot serve metrics at 192.0.2.1:0: "
                                      "the address is not one of this machine's\n")


@pytest.mark.parametrize(("addr", "why"), [
    ("a" * 64, "label too long"),
    ("\udcff", "Invalid character '\\udcff'"),  # (the byte 0xff, not UTF-8, from argv)
])
def test_an_address_that_is_no_host_name_is_named(
        addr: str, why: str, capfd: pytest.CaptureFixture[str]) -> None:
    # The resolver's IDNA encoding refuses these (UnicodeError): before, a traceback.
    with pytest.raises(OSError, match=r"^cannot serve metrics at .*:0: not a valid host "
                                      rf"name \({re.escape(why)}\)$"):
        MetricsServer(Figures(), 0, addr)
    assert main(["run", "--metrics-port", "0", "--metrics-addr", addr, str(WAITS)]) == 1
    err = capfd.readouterr().err
    assert err.startswith("wasinn: error: cannot serve metrics at "), err
    assert err.endswith(f":0: not a valid host name ({why})\n"), err
    assert "Traceback" not in err


@pytest.mark.parametrize(("argv", "said"), [
    (["--metrics-port", "65536"], "argument --metrics-port: '65536': expected a TCP port "
                                  "from 0 to 65535 (0: a free one), such as 9100"),
    (["--metrics-port", "-1"], "argument --metrics-port: '-1': expected a TCP port"),
    (["--metrics-port", "http"], "argument --metrics-port: 'http': expected a TCP port"),
    (["--metrics-addr", "0.0.0.0"], "--metrics-addr 0.0.0.0: expected --metrics-port PORT "
                                    "too (the port to serve the metrics on)"),
])
def test_bad_metrics_options_are_usage_errors(argv: list[str], said: str,
                                              capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["run", *argv, str(WAITS)])
    assert exited.value.code == 2
    err = capfd.readouterr().err
    assert err.startswith("usage: wasinn run") and f"wasinn run: error: {said}" in err, err


def test_without_prometheus_client_the_run_names_the_extra(
        monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    for name in [name for name in sys.modules if name.split(".")[0] == "prometheus_client"]:
        monkeypatch.setitem(sys.modules, name, None)  # (None: "not installed" to import)
    monkeypatch.delitem(sys.modules, wasinn.scheduler.metrics.__name__)
    with pytest.raises(ImportError):
        importlib.import_module(wasinn.scheduler.metrics.__name__)
    assert main(["run", "--metrics-port", "0", str(WAITS)]) == 1
    err = capfd.readouterr().err
    assert err.startswith("wasinn: error: --metrics-port: wasinn.scheduler.metrics needs "
                          "prometheus-client"), err
    assert "install it with `pip install wasinn[metrics]`" in err
