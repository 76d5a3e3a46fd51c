"""Dynamic batching of models that bound their batch dimension (an OpenVINO interval
``x: f32[1..4, 3]``): merged runs never hold more rows than the model takes, for a model
and for a pipeline whose later step bounds them, and a bound that leaves no room for two
requests' rows is refused at load."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import wasinn
from tests.support import cpu_pool, require_backend
from tests.test_batching import device_busy, only_actor, run_sizes
from tests.test_openvino_edges import _relu_ir
from wasinn import Batching, InvalidArgumentError
from wasinn.modelgen import affine_onnx

pytestmark = pytest.mark.usefixtures("needs_openvino")


@pytest.fixture
def needs_openvino() -> None:
    require_backend("openvino")


def bounded_relu(low: int, high: int, width: int = 3) -> list[bytes]:
    """IR of ``y = relu(x)`` over x: f32[low..high, width]."""
    import openvino as ov

    return _relu_ir(ov.PartialShape([ov.Dimension(low, high), width]))


async def test_merged_runs_hold_no_more_rows_than_the_model_allows(
        caplog: pytest.LogCaptureFixture) -> None:
    # Before: max_batch 8 merged the six requests into one run of 6 rows, which the
    # model's x: f32[1..4, 3] refused; each request then ran alone (7 runs, no batch).
    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        with caplog.at_level(logging.WARNING, logger="wasinn.actors"):
            graph = await rt.load(bounded_relu(1, 4), "openvino",
                                  batching=Batching(max_batch=8))
        assert graph.batching == Batching(max_batch=4)
        assert ("batching's max_batch 8 lowered to 4: input x: f32[1..4, 3] allows at "
                "most 4 rows") in caplog.text
        sizes = run_sizes(rt, graph)
        results: dict[int, Any] = {}

        async def compute(i: int) -> None:
            results[i] = (await graph.compute({"x": np.full((1, 3), i - 2.5, np.float32)})
                          )["y"].numpy()

        async with device_busy(only_actor(rt)) as nursery:
            for i in range(6):
                nursery.start_soon(compute, i)
        # Two merged runs, and one request of the first alone: OpenVINO IR names no
        # dimensions, so the first merged run is checked against a run alone.
        assert sorted(sizes) == [1, 2, 4]
        for i in range(6):
            assert results[i].tolist() == [[max(i - 2.5, 0.0)] * 3]
        stats = graph.stats()
        assert (stats.completed, stats.batches, stats.batched) == (6, 2, 6)


async def test_max_batch_within_the_bound_is_kept(caplog: pytest.LogCaptureFixture) -> None:
    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        with caplog.at_level(logging.WARNING, logger="wasinn.actors"):
            graph = await rt.load(bounded_relu(1, 4), "openvino",
                                  batching=Batching(max_batch=3, max_delay=0.5))
        assert graph.batching == Batching(max_batch=3, max_delay=0.5)
        assert "lowered" not in caplog.text


async def test_a_bound_that_leaves_no_room_for_two_requests_is_refused() -> None:
    async with wasinn.Runtime(cpu_pool(workers=1)) as rt:
        with pytest.raises(InvalidArgumentError) as caught:
            await rt.load(bounded_relu(0, 1), "openvino", name="one_row",
                          batching=Batching(max_batch=4))
        assert caught.value.message == (
            "model 'one_row': one_row: batching merges requests along the first dimension, "
            "but input x: f32[..1, 3] allows at most 1 row there: expected a first dimension that "
            "allows 2 rows or more, or load the model without batching")
        # Without batching it loads.
        graph = await rt.load(bounded_relu(0, 1), "openvino")
        assert (await graph.compute({"x": -np.ones((1, 3), np.float32)}))["y"].numpy(
            ).tolist() == [[0.0] * 3]


def pipeline_config(directory: Path) -> Path:
    """Pipeline ``p``: ``a`` (ONNX, y = 2x + 1 over [n, 3]) then ``b`` (OpenVINO IR,
    relu over x: f32[1..3, 3]), batched with max_batch 8."""
    (directory / "a.onnx").write_bytes(affine_onnx(2.0, 1.0, size=3))
    xml, weights = bounded_relu(1, 3)
    (directory / "b.xml").write_bytes(xml)
    (directory / "b.bin").write_bytes(weights)
    path = directory / "wasinn.toml"
    path.write_text(
        '[pools.cpu]\nkind = "cpu"\ndevices = ["cpu"]\nworkers = 1\n'
        '[models.a]\nfiles = ["a.onnx"]\n'
        '[models.b]\nfiles = ["b.xml", "b.bin"]\n'
        '[pipelines.p]\nbatching = { max_batch = 8 }\n'
        'steps = [{ model = "a" }, { model = "b", wire = { y = "x" } }]\n')
    return path


async def test_a_later_steps_bound_lowers_a_pipelines_max_batch(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async with wasinn.Runtime.from_config(pipeline_config(tmp_path)) as rt:
        with caplog.at_level(logging.WARNING, logger="wasinn.actors"):
            pipeline = await rt.load_by_name("p")
        assert pipeline.batching == Batching(max_batch=3)
        assert "pipeline 'p' step 1 (b): batching's max_batch 8 lowered to 3" in caplog.text
        step = await rt.load_by_name("b")
        sizes = run_sizes(rt, step)
        results: dict[int, Any] = {}

        async def compute(i: int) -> None:
            results[i] = (await pipeline.compute({"x": np.full((1, 3), i - 2.0, np.float32)})
                          )["y"].numpy()

        async with device_busy(only_actor(rt)) as nursery:
            for i in range(5):
                nursery.start_soon(compute, i)
        assert sorted(sizes) == [1, 2, 3]  # (and the first merged run's check alone)
        for i in range(5):
            assert results[i].tolist() == [[max(2 * (i - 2.0) + 1, 0.0)] * 3]
        assert pipeline.stats().batches == 2
