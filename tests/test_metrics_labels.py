"""Model names and tenants are label values, which a scrape writes as UTF-8: text with no
UTF-8 form (a lone surrogate, as Python keeps bytes that are not UTF-8, from a file name,
``sys.argv`` or ``os.environ``) is refused where it is given, with an error naming it;
and should one reach the exporter anyway, only its series is left out, never the scrape.
"""

from __future__ import annotations

import logging
import os
import shutil
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import wasinn
from tests.guest_support import WAT_DIR
from tests.support import cpu_pool, require_backend
from tests.test_metrics import Figures, made_up
from wasinn import InvalidArgumentError
from wasinn.actors import ModelStats, TenantStats
from wasinn.host.tenant import guest_tenant
from wasinn.modelgen import affine_onnx
from wasinn.scheduler.metrics import MetricsServer, register_metrics

X = np.ones((1, 4), np.float32)
#: What os.listdir gives for the Latin-1 file name b"mod\xe8le" (surrogateescape).
NOT_UTF8 = os.fsdecode(b"mod\xe8le")
SAID = (r"is not valid UTF-8 \('mod\\udce8le'\): expected UTF-8 text \(it names figures "
        r"that a Prometheus scrape writes as UTF-8\)$")


def series(registry: CollectorRegistry, family: str, label: str) -> set[str]:
    """The values of ``label`` in ``family``'s samples, as Prometheus would parse them."""
    text = generate_latest(registry).decode()
    return {sample.labels[label] for parsed in text_string_to_metric_families(text)
            if parsed.name == family for sample in parsed.samples}


async def test_a_name_or_tenant_that_is_not_utf8_is_refused_where_it_is_given() -> None:
    require_backend("onnxruntime")
    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        with pytest.raises(InvalidArgumentError, match=f"^name {SAID}"):
            await rt.load([affine_onnx()], "onnx", name=NOT_UTF8)
        graph = await rt.load([affine_onnx()], "onnx", name="modèle")  # UTF-8: fine
        ctx = graph.init_execution_context()
        requests = {
            "compute": lambda: graph.compute({"x": X}, tenant=NOT_UTF8),
            "lease": lambda: graph.lease({"x": X}, tenant=NOT_UTF8),
            "context compute": lambda: ctx.compute({"x": X}, tenant=NOT_UTF8),
            "context run": lambda: ctx.run(tenant=NOT_UTF8),
        }
        ctx.set_input("x", X)
        for what, request in requests.items():
            with pytest.raises(InvalidArgumentError, match=f"^tenant {SAID}"):
                await request()
            assert rt.tenant_stats() == [], what  # refused before it was counted
        with pytest.raises(InvalidArgumentError, match=f"^tenant {SAID}"):
            graph.try_lease({"x": X}, tenant=NOT_UTF8)
        with pytest.raises(InvalidArgumentError, match=f"^tenant {SAID}"):
            await trio.to_thread.run_sync(
                lambda: ctx.compute_in_caller_thread({"x": X}, tenant=NOT_UTF8))
        with pytest.raises(InvalidArgumentError, match=f"^tenant {SAID}"):
            rt.set_tenant_weight(NOT_UTF8, 2.0)
        await graph.compute({"x": X}, tenant="café")  # UTF-8: fine
        registry = CollectorRegistry()
        register_metrics(rt, registry)
        assert series(registry, "wasinn_model_requests", "model") == {"modèle"}
        assert series(registry, "wasinn_tenant_requests", "tenant") == {"café"}


async def test_a_guest_tenant_or_program_name_that_is_not_utf8_is_refused(
        tmp_path: Path) -> None:
    # The tenant a guest's requests are for: run_wasm's tenant=, else its file's name
    # (here a Latin-1 one, as a directory listing gives it).
    guest = tmp_path / os.fsdecode(b"caf\xe9.wat")
    shutil.copy(WAT_DIR / "affine_compute.wat", guest)
    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        with pytest.raises(InvalidArgumentError, match=r"^tenant is not valid UTF-8"):
            await rt.run_wasm(WAT_DIR / "affine_compute.wat", tenant=NOT_UTF8)
        with pytest.raises(InvalidArgumentError,
                           match=r"^the program name is not valid UTF-8 \('caf\\udce9.wat'\)"
                                 r": expected UTF-8 text \(it is the guest's tenant when "
                                 r"none is given, and it names figures"):
            await rt.run_wasm(guest)
        assert rt.tenant_stats() == []
    # The component ABI's guests take their tenant from the same check.
    assert guest_tenant(None, "café.wasm") == "café.wasm"
    with pytest.raises(InvalidArgumentError, match=r"^the program name is not valid UTF-8"):
        guest_tenant(None, guest.name)


def test_a_label_that_is_not_utf8_leaves_out_its_series_not_the_scrape(
        caplog: pytest.LogCaptureFixture) -> None:
    # Should such a name come by a way that does not check it, every other series is
    # still scraped; it is not written escaped either, which would make it the model
    # literally named with a backslash (next to it here): two identical series.
    figures = Figures()
    escaped = NOT_UTF8.encode("utf-8", "backslashreplace").decode()  # mod\udce8le
    figures.model_stats = lambda: [  # type: ignore[method-assign]
        figures.model, ModelStats(**made_up(60), name=NOT_UTF8),
        ModelStats(**made_up(70), name=escaped)]
    figures.tenant_stats = lambda: [  # type: ignore[method-assign]
        TenantStats(**made_up(80), name="caf\udce9", weight=2.0), figures.tenant]
    registry = CollectorRegistry()
    register_metrics(figures, registry)
    with caplog.at_level(logging.WARNING, logger="wasinn.scheduler"):
        for _ in range(2):
            assert series(registry, "wasinn_model_requests", "model") == {"resnet", escaped}
            assert series(registry, "wasinn_tenant_weight", "tenant") == {"alice"}
            assert series(registry, "wasinn_device_workers", "device") == {"gpu:0"}
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [  # once each, naming it
        "metrics: model 'mod\\udce8le' is left out of every scrape: it is not valid UTF-8 "
        "(a lone surrogate, as bytes that are not UTF-8 become), which the exposition "
        "cannot carry; its figures are in the runtime's stats",
        "metrics: tenant 'caf\\udce9' is left out of every scrape: it is not valid UTF-8 "
        "(a lone surrogate, as bytes that are not UTF-8 become), which the exposition "
        "cannot carry; its figures are in the runtime's stats"]


def test_a_metrics_server_answers_with_such_a_label_among_its_figures() -> None:
    figures = Figures()
    figures.tenant_stats = lambda: [  # type: ignore[method-assign]
        figures.tenant, TenantStats(**made_up(80), name=NOT_UTF8, weight=1.0)]
    with MetricsServer(figures, 0) as server, urllib.request.urlopen(server.url) as response:
        assert response.status == 200
        text = response.read().decode()
    tenants = {sample.labels["tenant"] for family in text_string_to_metric_families(text)
               if family.name == "wasinn_tenant_weight" for sample in family.samples}
    assert tenants == {"alice"}
