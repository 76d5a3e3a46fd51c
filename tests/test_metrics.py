"""A runtime's figures as Prometheus metrics: the values are the stats' own, per device,
model and tenant, with valid names and labels, on a scrape from another thread, before
the runtime starts and after it is closed."""

from __future__ import annotations

import functools
import importlib
import logging
import re
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from prometheus_client import CollectorRegistry, Metric, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import wasinn
from tests.support import cpu_pool, require_backend
from wasinn import InvalidArgumentError
from wasinn.actors import DeviceStats, ModelStats, TenantStats
from wasinn.actors.stats import RequestFigures, RequestStats
from wasinn.modelgen import affine_onnx
from wasinn.scheduler import metrics
from wasinn.scheduler.metrics import RuntimeCollector, register_metrics

X = np.ones((1, 4), np.float32)
BAD = np.ones((1, 5), np.float32)
OUTCOMES = ("completed", "failed", "timed_out", "cancelled", "rejected")
PHASES = {"total": "latency", "queued": "queued", "running": "running",
          "delivering": "delivering"}
QUANTILES = {"0.5": "p50", "0.99": "p99"}
#: Every family a scrape has (the README lists them), by name and type.
FAMILIES = {
    **{f"wasinn_{scope}_{name}": kind for scope in ("device", "model", "tenant")
       for name, kind in [("requests", "counter"), ("requests_in_caller_thread", "counter"),
                          ("batches", "counter"), ("batched_requests", "counter"),
                          ("running_seconds", "counter"),
                          ("request_latency_seconds", "gauge"),
                          ("request_latency_window", "gauge")]},
    **{f"wasinn_device_{name}": "gauge" for name in (
        "workers", "running", "queued", "queue_limit", "graphs_held", "abandoned_running",
        "lost")},
    **{f"wasinn_device_{name}": "counter" for name in (
        "compiles", "warm_ups", "runs_passed_on")},
    "wasinn_tenant_weight": "gauge",
}


def registry_of(rt: object, **kwargs: str) -> CollectorRegistry:
    registry = CollectorRegistry()
    register_metrics(rt, registry, **kwargs)  # type: ignore[arg-type]
    return registry


def scrape(registry: CollectorRegistry) -> dict[str, Metric]:
    """The exposition text, parsed back: what Prometheus would read."""
    text = generate_latest(registry).decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def labels_of(family: Metric, label: str) -> set[str]:
    return {sample.labels[label] for sample in family.samples}


def assert_request_figures(registry: CollectorRegistry, scope: str, name: str,
                           figures: RequestFigures) -> None:
    """Every request figure of ``figures`` is exported, with its value, for ``scope``'s
    label ``name``; a percentile not known yet (None) has no series."""
    label = {scope: name}
    value = registry.get_sample_value
    for outcome in OUTCOMES:
        assert value(f"wasinn_{scope}_requests_total", {**label, "outcome": outcome}) == (
            getattr(figures, outcome)), (scope, name, outcome)
    assert value(f"wasinn_{scope}_requests_in_caller_thread_total", label) == (
        figures.in_caller_thread)
    assert value(f"wasinn_{scope}_batches_total", label) == figures.batches
    assert value(f"wasinn_{scope}_batched_requests_total", label) == figures.batched
    assert value(f"wasinn_{scope}_running_seconds_total", label) == figures.running_seconds
    assert value(f"wasinn_{scope}_request_latency_window", label) == figures.latency_window
    for phase, stem in PHASES.items():
        for quantile, suffix in QUANTILES.items():
            assert value(f"wasinn_{scope}_request_latency_seconds",
                         {**label, "phase": phase, "quantile": quantile}) == (
                getattr(figures, f"{stem}_{suffix}")), (scope, name, phase, quantile)


def registry_model(tmp_path: Path) -> Path:
    (tmp_path / "affine.onnx").write_bytes(affine_onnx(2.0, 1.0))
    path = tmp_path / "wasinn.toml"
    path.write_text('[pools.cpu]\nkind = "cpu"\ndevices = ["cpu"]\nworkers = 1\n\n'
                    '[models.affine]\nfiles = ["affine.onnx"]\nencoding = "onnx"\n')
    return path


async def test_a_scrape_has_each_device_model_and_tenant_figure(tmp_path: Path) -> None:
    require_backend("onnxruntime")
    async with wasinn.Runtime.from_config(registry_model(tmp_path)) as rt:
        registry = registry_of(rt)
        graph = await rt.load_by_name("affine")
        for _ in range(3):
            await graph.compute({"x": X}, tenant="alice")
        with pytest.raises(InvalidArgumentError, match="the model expects"):
            await graph.compute({"x": BAD}, tenant="alice")
        await graph.compute({"x": X}, tenant="bob")
        # Bob's own thread runs the model too: a lease taken from a free slot.
        ctx = graph.init_execution_context()
        await trio.to_thread.run_sync(
            functools.partial(ctx.compute_in_caller_thread, {"x": X}, tenant="bob"))
        rt.set_tenant_weight("bob", 2.5)
        # As start_http_server's thread scrapes: from a thread of its own.
        text = await trio.to_thread.run_sync(generate_latest, registry)
        (device,), (model,) = rt.stats(), rt.model_stats()
        tenants = {t.name: t for t in rt.tenant_stats()}
        # What the device holds, read again by the registry now that nothing runs.
        for name, expected in [("workers", 1), ("running", 0), ("queued", 0),
                               ("queue_limit", device.queue_limit), ("graphs_held", 1),
                               ("abandoned_running", 0), ("lost", 0)]:
            assert registry.get_sample_value(f"wasinn_device_{name}",
                                             {"device": "cpu"}) == expected, name
    families = {f.name: f for f in text_string_to_metric_families(text.decode())}
    # The figures themselves, then that every one is what the stats say.
    sample = registry.get_sample_value
    assert sample("wasinn_device_requests_total", {"device": "cpu", "outcome": "completed"}) == 5
    assert sample("wasinn_device_requests_total", {"device": "cpu", "outcome": "failed"}) == 1
    assert sample("wasinn_model_requests_total", {"model": "affine", "outcome": "completed"}) == 5
    assert sample("wasinn_tenant_requests_total", {"tenant": "alice", "outcome": "failed"}) == 1
    assert sample("wasinn_tenant_requests_total", {"tenant": "bob", "outcome": "completed"}) == 2
    assert sample("wasinn_tenant_requests_in_caller_thread_total", {"tenant": "bob"}) == 1
    assert sample("wasinn_device_requests_in_caller_thread_total", {"device": "cpu"}) == 1
    assert sample("wasinn_tenant_weight", {"tenant": "bob"}) == 2.5
    assert sample("wasinn_tenant_weight", {"tenant": "alice"}) == 1.0
    assert sample("wasinn_device_running_seconds_total", {"device": "cpu"}) > 0  # type: ignore[operator]
    assert_request_figures(registry, "device", "cpu", device)
    assert_request_figures(registry, "model", "affine", model)
    for name, tenant in tenants.items():
        assert_request_figures(registry, "tenant", name, tenant)
    assert tenants["alice"].latency_p50 is not None  # so their series were compared
    assert sample("wasinn_device_compiles_total", {"device": "cpu"}) == device.compiles == 1
    # The text the other thread scraped: one series per label value and outcome.
    assert labels_of(families["wasinn_device_requests"], "device") == {"cpu"}
    assert labels_of(families["wasinn_model_requests"], "model") == {"affine"}
    assert labels_of(families["wasinn_tenant_requests"], "tenant") == {"alice", "bob"}
    assert labels_of(families["wasinn_tenant_requests"], "outcome") == set(OUTCOMES)
    assert {(s.labels["phase"], s.labels["quantile"])
            for s in families["wasinn_device_request_latency_seconds"].samples} == {
        (phase, quantile) for phase in PHASES for quantile in QUANTILES}
    completed = {s.labels["tenant"]: s.value for s in families["wasinn_tenant_requests"].samples
                 if s.labels["outcome"] == "completed"}
    assert completed == {"alice": 3, "bob": 2}


async def test_a_percentile_not_known_yet_has_no_series() -> None:
    require_backend("onnxruntime")
    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        registry = registry_of(rt)
        families = scrape(registry)  # started, no request yet
        assert families["wasinn_device_request_latency_seconds"].samples == []
        assert registry.get_sample_value("wasinn_device_request_latency_window",
                                         {"device": "cpu"}) == 0
        assert registry.get_sample_value("wasinn_device_queued", {"device": "cpu"}) == 0
        graph = await rt.load([affine_onnx()], "onnx", name="affine")
        with pytest.raises(InvalidArgumentError, match="the model expects"):
            await graph.compute({"x": BAD}, tenant="carol")  # failed: no latency
        families = scrape(registry)
        assert families["wasinn_tenant_request_latency_seconds"].samples == []
        assert families["wasinn_device_request_latency_seconds"].samples == []
        assert registry.get_sample_value("wasinn_tenant_requests_total",
                                         {"tenant": "carol", "outcome": "failed"}) == 1
        await graph.compute({"x": X}, tenant="carol")
        families = scrape(registry)
        (model,) = rt.model_stats()
    latency = families["wasinn_tenant_request_latency_seconds"].samples
    assert len(latency) == len(PHASES) * len(QUANTILES)
    assert all(s.value >= 0 for s in latency)
    # A graph from load() has model series too, under the name it was loaded with.
    assert labels_of(families["wasinn_model_requests"], "model") == {"affine"}
    assert_request_figures(registry, "model", "affine", model)
    assert (model.completed, model.failed) == (1, 1)


async def test_a_scrape_before_the_start_and_after_the_close_does_not_fail() -> None:
    require_backend("onnxruntime")
    rt = wasinn.Runtime(cpu_pool(workers=1))
    with pytest.raises(wasinn.ClosedResourceError):
        rt.stats()
    registry = registry_of(rt)
    before = scrape(registry)
    assert set(before) == set(FAMILIES)  # every family, each without a series yet
    assert all(family.samples == [] for family in before.values())
    async with rt:
        graph = await rt.load([affine_onnx()], "onnx", name="affine")
        await graph.compute({"x": X})
        await graph.compute({"x": X})
    after = scrape(registry)
    (device,) = rt.stats()  # the final figures
    assert device.completed == 2
    assert_request_figures(registry, "device", "cpu", device)
    assert labels_of(after["wasinn_device_workers"], "device") == {"cpu"}
    # The requests that name no tenant are the tenant "".
    (untagged,) = rt.tenant_stats()
    assert untagged.name == ""
    assert_request_figures(registry, "tenant", "", untagged)
    assert registry.get_sample_value("wasinn_tenant_requests_total",
                                     {"tenant": "", "outcome": "completed"}) == 2


def made_up(base: int) -> dict[str, Any]:
    """Request figures each of a value of its own (from ``base`` on), to tell them apart."""
    counts = ["completed", "failed", "timed_out", "cancelled", "rejected",
              "in_caller_thread", "batches", "batched", "latency_window"]
    times = ["latency_p50", "latency_p99", "queued_p50", "queued_p99", "running_p50",
             "running_p99", "delivering_p50", "delivering_p99", "running_seconds"]
    return {**RequestStats().figures(), **{name: base + i for i, name in enumerate(counts)},
            **{name: (base + i) / 1000 for i, name in enumerate(times)}}


class Figures:
    """A runtime's figures, made up: a device lost, a pool under load, a model and a
    tenant, each figure a value of its own."""

    def __init__(self) -> None:
        self.device = DeviceStats(
            **made_up(10), device="gpu:0", workers=2, running=2, queued=3, queue_limit=64,
            graphs=1, compiles=4, warm_ups=6, abandoned_running=7, passed_on=5,
            lost="CUDA error: an illegal memory access was encountered")
        self.model = ModelStats(**made_up(30), name="resnet")
        self.tenant = TenantStats(**made_up(50), name="alice", weight=0.5)

    def stats(self) -> list[DeviceStats]:
        return [self.device]

    def model_stats(self) -> list[ModelStats]:
        return [self.model]

    def tenant_stats(self) -> list[TenantStats]:
        return [self.tenant]


def test_each_figure_goes_to_its_own_metric() -> None:
    figures = Figures()
    registry = registry_of(figures)
    assert_request_figures(registry, "device", "gpu:0", figures.device)
    assert_request_figures(registry, "model", "resnet", figures.model)
    assert_request_figures(registry, "tenant", "alice", figures.tenant)
    assert registry.get_sample_value("wasinn_tenant_weight", {"tenant": "alice"}) == 0.5
    expected = {"wasinn_device_lost": 1, "wasinn_device_running": 2,
                "wasinn_device_queued": 3, "wasinn_device_workers": 2,
                "wasinn_device_queue_limit": 64, "wasinn_device_graphs_held": 1,
                "wasinn_device_abandoned_running": 7, "wasinn_device_compiles_total": 4,
                "wasinn_device_warm_ups_total": 6, "wasinn_device_runs_passed_on_total": 5}
    for name, value in expected.items():
        assert registry.get_sample_value(name, {"device": "gpu:0"}) == value, name


async def test_metric_names_types_and_help_follow_prometheus_conventions() -> None:
    registry = registry_of(Figures())
    families = scrape(registry)
    assert {name: f.type for name, f in families.items()} == FAMILIES
    for name, family in families.items():
        assert re.fullmatch(r"[a-z][a-z0-9_]*", name), name  # snake_case
        assert family.documentation.strip(), name
        for sample in family.samples:
            if family.type == "counter":
                assert sample.name == f"{name}_total"
            assert all(re.fullmatch(r"[a-z][a-z0-9_]*", label) for label in sample.labels)
    # describe() names the families collect() yields, so registering asks nothing of the
    # runtime; a second collector under the same names is refused, another prefix is not.
    collector = RuntimeCollector(Figures())
    assert [f.name for f in collector.describe()] == [f.name for f in collector.collect()]
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        register_metrics(Figures(), registry)
    register_metrics(Figures(), registry, prefix="other")
    assert registry.get_sample_value("other_device_lost", {"device": "gpu:0"}) == 1


def server_record(caplog: pytest.LogCaptureFixture, text: str) -> logging.LogRecord:
    """The first record of the metrics server (its thread's) whose message has ``text``,
    once it is logged (a failure after 60 s)."""
    for _ in range(6000):
        found = [r for r in caplog.records if text in r.getMessage()]
        if found:
            return found[0]
        time.sleep(0.01)
    raise AssertionError(f"no record with {text!r}: {caplog.text}")


def test_connections_that_time_out_or_are_reset_are_logged_at_debug_not_printed(
        monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    # Before: socketserver (a request that could not be read) and wsgiref (a reply that
    # could not be sent) printed a traceback on stderr for each: wasinn run
    # --metrics-port's stderr, amid the guest's own, at every port scan or health check.
    monkeypatch.setattr(metrics, "CONNECTION_TIMEOUT_S", 0.5)
    caplog.set_level(logging.DEBUG, logger="wasinn.scheduler")
    many = Figures()
    many.model_stats = lambda: [ModelStats(**made_up(30), name=f"model{i}")  # type: ignore[method-assign]
                                for i in range(200)]  # a reply of some 280 KB
    with metrics.MetricsServer(many, 0) as server:
        # A reset halfway through the request line.
        reset = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        reset.sendall(b"GET /metr")
        reset.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        reset.close()
        said = server_record(caplog, "ended (ConnectionResetError").getMessage()
        assert re.fullmatch(r"metrics server: the connection from 127\.0\.0\.1:\d+ ended "
                            r"\(ConnectionResetError: .*\)", said)
        # A reply its client never reads: sending it times out (small buffers each side).
        server._server.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        with socket.socket() as stalled:
            stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            stalled.settimeout(30)
            stalled.connect(("127.0.0.1", server.port))
            stalled.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")  # and reads nothing
            server_record(caplog, "ended (TimeoutError: timed out)")
    assert [r.levelno for r in caplog.records] == [logging.DEBUG] * len(caplog.records)
    assert capfd.readouterr().err == ""


def test_a_scrape_that_fails_is_logged_with_its_traceback_not_printed(
        capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    class Broken(Figures):
        def model_stats(self) -> list[ModelStats]:
            raise RuntimeError("a collector bug")

    with metrics.MetricsServer(Broken(), 0) as server:
        with pytest.raises(urllib.error.HTTPError, match="500"):
            urllib.request.urlopen(server.url, timeout=60)
        record = server_record(caplog, "failed")
    assert record.levelno == logging.ERROR
    assert re.fullmatch(r"metrics server: a request from 127\.0\.0\.1:\d+ failed",
                        record.getMessage())
    assert record.exc_info is not None and str(record.exc_info[1]) == "a collector bug"
    assert capfd.readouterr().err == ""


@pytest.mark.parametrize("prefix", ["", "9lives", "wasinn-prod", "a b"])
def test_a_bad_prefix_is_refused(prefix: str) -> None:
    with pytest.raises(ValueError, match=rf"prefix={prefix!r}\): expected a metric name"):
        RuntimeCollector(Figures(), prefix)


def test_without_prometheus_client_the_import_names_the_extra(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [name for name in sys.modules if name.split(".")[0] == "prometheus_client"]:
        monkeypatch.setitem(sys.modules, name, None)  # (None: "not installed" to import)
    monkeypatch.delitem(sys.modules, "wasinn.scheduler.metrics")
    with pytest.raises(ImportError, match=r"pip install wasinn\[metrics\]"):
        importlib.import_module("wasinn.scheduler.metrics")


def test_import_wasinn_does_not_import_prometheus_client() -> None:
    code = ("import sys, wasinn, wasinn.scheduler; wasinn.Runtime; "
            "print('prometheus_client' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, cwd=Path(wasinn.__file__).anchor)
    assert result.stdout.strip() == "False"


def test_the_readme_names_every_device_metric() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("### Metrics (Prometheus)\n", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`(wasinn_\w+?)(?:_total)?`", section))
    devices = {name for name in FAMILIES if name.startswith("wasinn_device_")}
    assert named == devices | {"wasinn_tenant_weight"}
    # Counters are named with their _total, as a scrape has them.
    for name in devices:
        total = f"`{name}_total`" in section
        assert total == (FAMILIES[name] == "counter"), name
