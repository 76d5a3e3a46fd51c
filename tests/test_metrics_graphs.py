"""Graphs loaded with ``rt.load`` in ``rt.model_stats()`` and so in a scrape: by name
while they are loaded, loads that share a name (with each other or with a registry
model) as one series whose counters never go down, held weakly, final after the close;
and the registry's models and pipelines, whose counts go on across their loads (a host
running guest after guest, each releasing the model as it exits)."""

from __future__ import annotations

import contextlib
import functools
import gc
import threading
import weakref
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import wasinn
from tests.guest_support import WAT_DIR
from tests.loop_model import GUARD_S, HUGE_LOOP, loop_inputs, loop_onnx
from tests.support import affine_pipeline_config, cpu_pool, require_backend
from tests.test_batching import device_busy, first_row_onnx
from tests.test_pipeline_edges import gather_onnx, three_steps
from wasinn import InvalidArgumentError
from wasinn.actors.stats import ModelStats, Outcome, RequestStats
from wasinn.backends.base import LoadOptions
from wasinn.configs.loader import parse_config
from wasinn.enums import GraphEncoding
from wasinn.modelgen import affine_onnx, onnx_model_bytes
from wasinn.scheduler.metrics import register_metrics
from wasinn.scheduler.model import LoadedModel
from wasinn.scheduler.names import LoadedGraphs, added, merged_figures

X = np.ones((1, 4), np.float32)
BAD = np.ones((1, 5), np.float32)


def registry_of(rt: wasinn.Runtime) -> CollectorRegistry:
    registry = CollectorRegistry()
    register_metrics(rt, registry)
    return registry


def model_counts(rt: wasinn.Runtime) -> dict[str, int]:
    return {s.name: s.completed for s in rt.model_stats()}


def scraped(registry: CollectorRegistry) -> dict[str, float]:
    """Each model's completed requests in the exposition text, checking on the way that
    no family has a label set twice (which a scraper would reject)."""
    text = generate_latest(registry).decode()
    completed: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        seen = Counter((s.name, tuple(sorted(s.labels.items()))) for s in family.samples)
        assert [key for key, n in seen.items() if n > 1] == [], family.name
        for sample in family.samples:
            if (family.name == "wasinn_model_requests"
                    and sample.labels["outcome"] == "completed"):
                completed[sample.labels["model"]] = sample.value
    return completed


def config_with_affine(tmp_path: Path) -> Path:
    (tmp_path / "affine.onnx").write_bytes(affine_onnx(2.0, 1.0))
    path = tmp_path / "wasinn.toml"
    path.write_text('[pools.cpu]\nkind = "cpu"\ndevices = ["cpu"]\nworkers = 1\n\n'
                    '[models.affine]\nfiles = ["affine.onnx"]\nencoding = "onnx"\n')
    return path


async def test_a_loaded_graph_is_reported_under_its_name_while_it_is_loaded() -> None:
    require_backend("onnxruntime")
    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        registry = registry_of(rt)
        named = await rt.load([affine_onnx()], "onnx", name="scorer")
        unnamed = await rt.load([affine_onnx()], "onnx")
        assert unnamed.name.startswith("graph#")  # what its logs and errors call it
        for _ in range(2):
            await named.compute({"x": X}, tenant="alice")
        with pytest.raises(InvalidArgumentError, match="the model expects"):
            await named.compute({"x": BAD})
        await unnamed.compute({"x": X})
        by_name = {s.name: s for s in rt.model_stats()}
        assert list(by_name) == ["scorer", unnamed.name]  # in the order of their loads
        assert by_name["scorer"] == named.stats()  # one load: exactly its own figures
        assert by_name[unnamed.name] == unnamed.stats()
        assert registry.get_sample_value("wasinn_model_requests_total",
                                         {"model": "scorer", "outcome": "failed"}) == 1
        assert scraped(registry) == {"scorer": 2, unnamed.name: 1}
        await named.unload()
        # Gone: no other graph of its name is loaded, and the registry has no such name.
        assert scraped(registry) == {unnamed.name: 1}
        assert [s.name for s in rt.model_stats()] == [unnamed.name]


async def test_loads_that_share_a_name_are_one_series_whose_counters_never_go_down() -> None:
    require_backend("onnxruntime")
    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        registry = registry_of(rt)
        first = await rt.load([affine_onnx()], "onnx", name="m")
        second = await rt.load([affine_onnx(3.0)], "onnx", name="m")
        await first.compute({"x": X})
        for _ in range(3):
            await second.compute({"x": X})
        (merged,) = rt.model_stats()
        assert (merged.name, merged.completed, merged.latency_window) == ("m", 4, 4)
        assert merged.running_seconds == pytest.approx(
            first.stats().running_seconds + second.stats().running_seconds)
        assert scraped(registry) == {"m": 4}
        # One of the two unloaded: its counts stay in the sum (a counter that went down
        # would read as a reset to Prometheus); its latencies leave the window.
        await second.unload()
        (merged,) = rt.model_stats()
        assert (merged.completed, merged.latency_window) == (4, 1)
        third = await rt.load([affine_onnx()], "onnx", name="m")
        await third.compute({"x": X})
        assert scraped(registry) == {"m": 5}
        await first.unload()
        await third.unload()
        assert rt.model_stats() == []  # no graph of the name left: the series ends
        again = await rt.load([affine_onnx()], "onnx", name="m")
        await again.compute({"x": X})
        assert scraped(registry) == {"m": 1}  # a new series, as after a restart


async def test_a_load_named_as_a_registry_model_is_added_to_its_series(tmp_path: Path) -> None:
    require_backend("onnxruntime")
    async with wasinn.Runtime.from_config(config_with_affine(tmp_path)) as rt:
        registry = registry_of(rt)
        own = await rt.load([affine_onnx()], "onnx", name="affine")
        await own.compute({"x": X})
        assert model_counts(rt) == {"affine": 1}  # the registry's is not loaded yet
        by_name = await rt.load_by_name("affine")
        for _ in range(2):
            await by_name.compute({"x": X})
        assert model_counts(rt) == {"affine": 3}
        assert scraped(registry) == {"affine": 3}
        # The registry's series lasts the runtime's lifetime: so do the counts of a load
        # of its name, once unloaded.
        await own.unload()
        await by_name.unload()
        assert scraped(registry) == {"affine": 3}
    assert model_counts(rt) == {"affine": 3}


async def test_a_registry_model_loaded_again_goes_on_from_its_counts(tmp_path: Path) -> None:
    # Released by every handle, then loaded again: a counter back at 0 would read as a
    # reset to Prometheus (the requests since the last scrape lost from increase()).
    require_backend("onnxruntime")
    async with wasinn.Runtime.from_config(config_with_affine(tmp_path)) as rt:
        registry = registry_of(rt)
        first = await rt.load_by_name("affine")
        for _ in range(3):
            await first.compute({"x": X})
        with pytest.raises(InvalidArgumentError, match="the model expects"):
            await first.compute({"x": BAD})
        await first.unload()
        assert scraped(registry) == {"affine": 3}
        second = await rt.load_by_name("affine")
        assert rt.name_registry.loads["affine"] == 2  # (loaded again, not kept)
        assert scraped(registry) == {"affine": 3}
        await second.compute({"x": X})
        assert scraped(registry) == {"affine": 4}
        assert registry.get_sample_value("wasinn_model_requests_total",
                                         {"model": "affine", "outcome": "failed"}) == 1
        (stats,) = rt.model_stats()
        assert (stats.completed, stats.failed) == (4, 1)
        assert stats.running_seconds == pytest.approx(
            first.stats().running_seconds + second.stats().running_seconds)
        # The percentiles are the latest load's (gauges: the figures now), and a handle's
        # own figures that load's alone.
        assert stats.latency_window == 1
        assert (second.stats().completed, second.stats().failed) == (1, 0)
        # A graph of the name from rt.load in between, then the registry's loaded again.
        await second.unload()
        own = await rt.load([affine_onnx()], "onnx", name="affine")
        await own.compute({"x": X})
        await own.unload()
        assert scraped(registry) == {"affine": 5}
        third = await rt.load_by_name("affine")
        assert scraped(registry) == {"affine": 5}
        await third.compute({"x": X})
        assert scraped(registry) == {"affine": 6}
    assert model_counts(rt) == {"affine": 6}  # the final figures, after the close
    assert scraped(registry) == {"affine": 6}


async def test_a_registry_pipeline_loaded_again_goes_on_from_its_counts(
        tmp_path: Path) -> None:
    require_backend("onnxruntime")
    async with wasinn.Runtime.from_config(affine_pipeline_config(tmp_path)) as rt:
        registry = registry_of(rt)
        for round_ in range(1, 4):
            pipeline = await rt.load_by_name("p")
            out = await pipeline.compute({"x": X})
            assert out["y"].numpy().tolist() == [[9.0] * 4]  # 3 * (2x + 1)
            await pipeline.unload()  # the pipeline and its steps released
            # (its steps count its requests too, and go on from their counts as it does)
            assert [scraped(registry)[name] for name in ("p", "a", "b")] == [round_] * 3
        assert rt.name_registry.loads["p"] == 3
        by_name = {s.name: s for s in rt.model_stats()}
        assert (by_name["p"].completed, by_name["a"].completed) == (3, 3)


async def test_a_pipelines_steps_count_the_runs_its_requests_made_of_them(
        tmp_path: Path) -> None:
    # As an inference server reports an ensemble's composing models (Triton): each step
    # model counts its runs for the pipeline as its own requests, each with that run's
    # time; the pipeline has its requests end to end, and the device and the tenant
    # count each request once.
    require_backend("onnxruntime")
    async with wasinn.Runtime(three_steps(tmp_path, gather_onnx())) as rt:
        registry = registry_of(rt)
        pipeline = await rt.load_by_name("p")  # a (2x + 1), m (table[x]), c (3x)
        for _ in range(3):
            await pipeline.compute({"x": X}, tenant="t")
        by_name = {s.name: s for s in rt.model_stats()}
        (device,) = rt.stats()
        # The steps' device time is within the pipeline's, which is the device's.
        assert by_name["p"].running_seconds == device.running_seconds
        assert 0 < sum(by_name[step].running_seconds for step in "amc") <= (
            device.running_seconds)
        with pytest.raises(wasinn.BackendRuntimeError, match=r"^pipeline 'p' step 1 "):
            await pipeline.compute({"x": 5 * X}, tenant="t")  # m: 11 is past its table
        ctx = pipeline.init_execution_context()
        await trio.to_thread.run_sync(
            lambda: ctx.compute_in_caller_thread({"x": X}, tenant="t"))
        by_name = {s.name: s for s in rt.model_stats()}
        (device,) = rt.stats()
        (tenant,) = rt.tenant_stats()
        assert {name: scraped(registry)[name] for name in "pamc"} == {
            "p": 4, "a": 5, "m": 4, "c": 4}
    counts = {name: (s.completed, s.failed, s.in_caller_thread, s.latency_window)
              for name, s in by_name.items()}
    assert counts == {"a": (5, 0, 1, 5),  # its run for the failed request returned
                      "m": (4, 1, 1, 4),  # the run that failed
                      "c": (4, 0, 1, 4),  # never reached by the failed request
                      "p": (4, 1, 1, 4)}
    assert (device.completed, device.failed) == (tenant.completed, tenant.failed) == (4, 1)
    # A step's latency is its run's: the pipeline's request did the queueing.
    assert by_name["a"].queued_p99 == by_name["a"].delivering_p99 == 0.0
    assert by_name["a"].latency_p99 == by_name["a"].running_p99


async def test_a_step_run_stopped_as_its_request_timed_out_is_no_failure_of_its_model(
        tmp_path: Path) -> None:
    # The pipeline's request timed out; its step's run, interrupted for it, raised: that
    # is not the model failing.
    require_backend("onnxruntime")
    (tmp_path / "loop.onnx").write_bytes(loop_onnx())
    config = parse_config({
        "pools": {"cpu": {"kind": "cpu", "devices": ["cpu"], "workers": 1}},
        "models": {"loop": {"files": ["loop.onnx"]}},
        "pipelines": {"p": {"steps": [{"model": "loop"}]}}}, tmp_path / "wasinn.toml")
    async with wasinn.Runtime(config) as rt:
        pipeline = await rt.load_by_name("p")
        with pytest.raises(wasinn.TimeoutError_):
            await pipeline.compute(loop_inputs(HUGE_LOOP), timeout=0.2)
        with trio.fail_after(GUARD_S):  # (runs once the interrupted run has ended)
            await pipeline.compute(loop_inputs(3))
        by_name = {s.name: s for s in rt.model_stats()}
    assert (by_name["p"].completed, by_name["p"].timed_out) == (1, 1)
    assert (by_name["loop"].completed, by_name["loop"].finished) == (1, 1)


async def test_a_merged_run_of_a_batching_pipeline_counts_its_requests_in_each_step(
        tmp_path: Path) -> None:
    require_backend("onnxruntime")
    config = three_steps(tmp_path, affine_onnx(1.0, 0.0), batching={"max_batch": 4})
    async with wasinn.Runtime(config) as rt:
        (actor,) = rt.actors
        pipeline = await rt.load_by_name("p")
        async with device_busy(actor) as nursery:  # the three queue, then run as one
            for _ in range(3):
                nursery.start_soon(functools.partial(pipeline.compute, {"x": X}))
        by_name = {s.name: s for s in rt.model_stats()}
    for name in "pamc":
        stats = by_name[name]
        assert (stats.completed, stats.batches, stats.batched) == (3, 1, 3), name
    # The merged run's time is counted once in each step (one run: one latency), as
    # the device counts it.
    assert [by_name[name].latency_window for name in "amc"] == [1, 1, 1]


def unnamed_scale_onnx() -> bytes:
    """``y = x`` (times ones) over f32 ``(?, 4)`` whose first dimensions have no name:
    a step that does not declare its outputs batch-major, so its pipeline's first merged
    run of an input signature is checked against a run of one request alone."""
    from onnx import TensorProto, helper, numpy_helper

    scale = numpy_helper.from_array(np.ones(4, np.float32), "scale")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 4])
    return onnx_model_bytes(helper.make_graph([helper.make_node("Mul", ["x", "scale"], ["y"])],
                                              "unnamed", [x], [y], initializer=[scale]))


async def three_merged(tmp_path: Path, middle: bytes, inputs: list[np.ndarray[Any, Any]]
                       ) -> dict[str, ModelStats]:
    """The model stats after ``inputs`` went, queued together, to pipeline ``p`` of
    :func:`three_steps` with ``middle`` (batching up to 4 rows): one batch."""
    config = three_steps(tmp_path, middle, batching={"max_batch": 4})
    async with wasinn.Runtime(config) as rt:
        (actor,) = rt.actors
        pipeline = await rt.load_by_name("p")

        async def compute(x: np.ndarray[Any, Any]) -> None:
            with contextlib.suppress(wasinn.BackendRuntimeError):
                await pipeline.compute({"x": x})

        async with device_busy(actor) as nursery:  # they queue, then run as one batch
            for x in inputs:
                nursery.start_soon(compute, x)
        return {s.name: s for s in rt.model_stats()}


async def test_a_probed_merged_run_counts_each_request_once_in_each_step(
        tmp_path: Path) -> None:
    # The first merged run of a signature is checked against its smallest member's run
    # alone, which is that member's answer: two runs of each step, three requests. (It
    # counted four: the merged run as all three, and the run alone once more.)
    require_backend("onnxruntime")
    by_name = await three_merged(tmp_path, unnamed_scale_onnx(), [X, X, X])
    for name in "pamc":
        stats = by_name[name]
        assert (stats.completed, stats.batches, stats.batched) == (3, 1, 3), name
    # Each run's latency once: the merged run's and the run alone's.
    assert [by_name[name].latency_window for name in "amc"] == [2, 2, 2]


async def test_a_merged_run_thrown_away_counts_no_request_in_any_step(
        tmp_path: Path) -> None:
    # The middle step keeps one row of any number: the merged run's outputs cannot be
    # split, so each request runs alone and is answered there. (The merged run counted
    # as a fourth request of each step.)
    require_backend("onnxruntime")
    by_name = await three_merged(tmp_path, first_row_onnx(), [X, X, X])
    for name in "pamc":
        stats = by_name[name]
        assert (stats.completed, stats.batches, stats.latency_window) == (3, 0, 3), name
    # The thrown-away run's time is in (the device spent it): within the whole job's.
    assert 0 < sum(by_name[name].running_seconds for name in "amc") <= (
        by_name["p"].running_seconds)


async def test_a_merged_run_that_failed_counts_no_request_in_any_step(
        tmp_path: Path) -> None:
    # m fails the merged run on 5's row; its requests then run alone, where only that one
    # fails. (The merged run counted as one more request of a, and one more failure of m.)
    require_backend("onnxruntime")
    by_name = await three_merged(tmp_path, gather_onnx(), [X, X, 5 * X])
    counts = {name: (by_name[name].completed, by_name[name].failed) for name in "pamc"}
    assert counts == {"p": (2, 1), "a": (3, 0), "m": (2, 1), "c": (2, 0)}


async def test_guest_after_guest_counts_all_their_requests(tmp_path: Path) -> None:
    # Each guest loads "affine" by name, runs it once and exits, which releases it: the
    # next guest loads it again.
    require_backend("onnxruntime")
    async with wasinn.Runtime.from_config(config_with_affine(tmp_path)) as rt:
        registry = registry_of(rt)
        seen = []
        for _ in range(3):
            assert await rt.run_wasm(WAT_DIR / "affine_compute.wat", tenant="guest") == 0
            seen.append(scraped(registry)["affine"])
        assert rt.name_registry.loads["affine"] == 3
        assert seen == [1, 2, 3]
        (tenant,) = rt.tenant_stats()
        assert (tenant.name, tenant.completed) == ("guest", 3)


async def test_scrapes_from_another_thread_while_a_registry_model_is_loaded_again(
        tmp_path: Path) -> None:
    # Each scrape sees the name's counts never lower than the scrape before's, also while
    # the registry swaps a released load for a new one.
    require_backend("onnxruntime")
    async with wasinn.Runtime.from_config(config_with_affine(tmp_path)) as rt:
        registry = registry_of(rt)
        stop = threading.Event()
        seen: list[float] = []

        def scrape_until_stopped() -> None:
            while not stop.is_set() or not seen:
                seen.append(scraped(registry).get("affine", 0))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, scrape_until_stopped)
            for _ in range(20):
                graph = await rt.load_by_name("affine")
                await graph.compute({"x": X})
                await graph.unload()
            stop.set()
        assert rt.name_registry.loads["affine"] == 20
        assert seen == sorted(seen)
        assert scraped(registry) == {"affine": 20}


async def test_the_figures_are_held_not_the_graph() -> None:
    # (Checked once the runtime is closed: until then the device's compile of a model may
    # be held a while by the thread that ran it.)
    require_backend("onnxruntime")
    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        graph = await rt.load([affine_onnx()], "onnx", name="unloaded")
        await graph.compute({"x": X})
        figures = weakref.ref(graph._executable.requests)  # held by the model alone
        await graph.unload()
        del graph
        # A graph dropped without unload() is reported while its model lives; once the
        # model is collected, its series ends as an unloaded graph's does.
        dropped = await rt.load([affine_onnx()], "onnx", name="dropped")
        await dropped.compute({"x": X})
        assert model_counts(rt) == {"dropped": 1}
        # The model alone holds its on_release: gone with the model.
        model = weakref.ref(dropped._executable.on_release)  # type: ignore[attr-defined]
        del dropped
        gc.collect()
        assert model() is None  # the table held neither the model...
        assert model_counts(rt) == {}
    gc.collect()
    assert figures() is None  # ...nor the unloaded graph's figures
    assert model_counts(rt) == {}


async def test_a_closed_runtime_reports_the_final_figures_of_its_loads() -> None:
    require_backend("onnxruntime")
    rt = wasinn.Runtime(cpu_pool(workers=1))
    registry = registry_of(rt)
    async with rt:
        graph = await rt.load([affine_onnx()], "onnx", name="m")
        await graph.compute({"x": X})
        await graph.compute({"x": X})
        during = rt.model_stats()
    await graph.unload()  # after the close: what it did stays reported
    assert rt.model_stats() == during
    assert scraped(registry) == {"m": 2}


async def test_scrapes_from_another_thread_while_graphs_come_and_go() -> None:
    # A resident graph of the name and another loaded, run and unloaded again and again:
    # each scrape sees one series, its count never lower than the scrape before's.
    require_backend("onnxruntime")
    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        registry = registry_of(rt)
        resident = await rt.load([affine_onnx()], "onnx", name="m")
        stop = threading.Event()
        seen: list[float] = []

        def scrape_until_stopped() -> None:
            while not stop.is_set() or not seen:
                seen.append(scraped(registry)["m"])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, scrape_until_stopped)
            for _ in range(20):
                passing = await rt.load([affine_onnx()], "onnx", name="m")
                await passing.compute({"x": X})
                await resident.compute({"x": X})
                await passing.unload()
            stop.set()
        assert seen == sorted(seen)
        assert scraped(registry) == {"m": 40}


def test_merged_percentiles_are_those_of_the_windows_together() -> None:
    a, b = RequestStats(), RequestStats()
    for seconds in (0.001, 0.002, 0.003):
        a.record(Outcome.COMPLETED, seconds, queued=0.0005, delivering=0.0002)
    a.record(Outcome.FAILED, 0.5)
    b.record(Outcome.COMPLETED, 0.010, queued=0.004, delivering=0.001, leased=True)
    b.record_batch(2)
    retired = {**dict.fromkeys(("completed", "failed", "timed_out", "cancelled", "rejected",
                                "in_caller_thread", "batches", "batched"), 1),
               "running_seconds": 1.0}
    merged = merged_figures([a, b], retired)
    assert (merged["completed"], merged["failed"], merged["timed_out"]) == (5, 2, 1)
    assert (merged["in_caller_thread"], merged["batches"], merged["batched"]) == (2, 2, 3)
    assert merged["running_seconds"] == pytest.approx(1.0 + 0.0039 + 0.005)
    # [1, 2, 3, 10] ms: the nearest-rank p50 is the 2nd, the p99 the 4th.
    assert merged["latency_window"] == 4
    assert (merged["latency_p50"], merged["latency_p99"]) == (0.002, 0.010)
    assert (merged["queued_p50"], merged["queued_p99"]) == (0.0005, 0.004)
    assert (merged["delivering_p50"], merged["delivering_p99"]) == (0.0002, 0.001)
    assert merged["running_p99"] == pytest.approx(0.005)
    assert merged_figures([a]) == a.figures()  # one part: its own figures
    nothing = merged_figures([], retired)  # only graphs gone: no latency
    assert nothing["latency_p50"] is None and nothing["latency_window"] == 0
    # Tallies of one name from two places (the registry's earlier loads, graphs gone).
    assert added(None, None) is None
    assert added(retired, None) == retired
    assert added(retired, retired) == {key: 2 * value for key, value in retired.items()}


def test_a_graph_collected_without_a_release_leaves_as_an_unloaded_one() -> None:
    graphs = LoadedGraphs()
    stays, goes = (LoadedModel((b"model",), GraphEncoding.ONNX, LoadOptions(), name="m")
                   for _ in range(2))
    graphs.add(stays)
    graphs.add(goes)
    goes.requests.record(Outcome.COMPLETED, 0.001)
    figures = weakref.ref(goes.requests)
    del goes
    gc.collect()
    ((name, parts, retired),) = graphs.requests()
    assert (name, parts) == ("m", [stays.requests])
    assert figures() is None  # its counts were kept, not its figures
    assert retired is not None and retired["completed"] == 1  # kept: "m" is loaded still
    stays.retain()
    stays.release()  # its on_release: it leaves, and with it the name
    assert graphs.requests() == []


async def test_graphs_loaded_and_gone_leave_nothing_behind_unread() -> None:
    # Before, each model collected left its key in the table until a scrape read it: a
    # host without metrics that loads graph after graph kept one per load for ever.
    require_backend("onnxruntime")
    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        for _ in range(20):
            graph = await rt.load([affine_onnx()], "onnx")
            await graph.unload()
            del graph
            gc.collect()
        assert len(rt._graphs._collected) <= 1  # (the last one's, until the next load)
        assert model_counts(rt) == {}
