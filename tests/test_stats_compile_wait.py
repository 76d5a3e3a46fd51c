"""A request that reaches a device while its graph is still being compiled there waits for
that compile, and its latency counts the wait (README: "measured end to end from the
request reaching the device, queueing included"), whether it completes or fails: in the
device's, the model's (a pipeline's) and the tenant's figures, as time queued. The fake
device backend stands for a GPU whose compile is slow (routing only); the compile is held
by a gate, and the bound checked is the time the gate was held by trio's clock."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

import wasinn
from tests.fake_backend import FakeBackend
from wasinn import Batching
from wasinn.actors.stats import RequestFigures
from wasinn.configs.loader import parse_config

#: How long the compile is held once it has started (trio's clock): a lower bound on
#: the completed request's latency and time queued, never a wall-time assertion.
HELD = 0.2


def x(value: float) -> np.ndarray[Any, Any]:
    return np.full((1, 4), value, np.float32)


@pytest.fixture
def fake() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
async def rt(fake: FakeBackend, tmp_path: Path) -> AsyncIterator[wasinn.Runtime]:
    """A CPU and one GPU of fakes; registry entries for a two-step pipeline whose steps
    compile slowly on the GPU."""
    for name in ("first", "second"):
        (tmp_path / f"{name}.bin").write_bytes(b"fake:add=1:slowload")
    config = parse_config({
        "pools": {"cpu": {"kind": "cpu", "devices": ["cpu"], "backends": ["fake"]},
                  "gpu": {"kind": "gpu", "devices": ["gpu:0"], "backends": ["fake"]}},
        "models": {name: {"files": [str(tmp_path / f"{name}.bin")], "backend": "fake",
                          "encoding": "ggml", "target": "gpu"}
                   for name in ("first", "second")},
        "pipelines": {"twice": {"steps": [{"model": "first"},
                                          {"model": "second", "wire": {"y": "x"}}]}},
    }, None)
    async with wasinn.Runtime(config, backends=[fake]) as runtime:
        yield runtime
    fake.load_gate.set()


async def _compute(graph: wasinn.Graph | wasinn.Pipeline) -> np.ndarray[Any, Any]:
    out = await graph.compute({"x": x(1)}, target="gpu", tenant="t", keep_on_device=False)
    return out["y"].numpy()


async def _lease(graph: wasinn.Graph | wasinn.Pipeline) -> np.ndarray[Any, Any]:
    ctx = graph.init_execution_context(target="gpu")
    run = await ctx.lease({"x": x(1)}, tenant="t", keep_on_device=False)
    out = await trio.to_thread.run_sync(run.run)
    ctx.close()
    return out["y"].numpy()


async def _model(rt: wasinn.Runtime, batching: Batching | None = None) -> wasinn.Graph:
    return await rt.load([b"fake:add=1:slowload"], "ggml", "cpu", batching=batching)


async def _pipeline(rt: wasinn.Runtime) -> wasinn.Pipeline:
    pipeline = await rt.load_by_name("twice")
    assert isinstance(pipeline, wasinn.Pipeline)
    return pipeline


Loader = Callable[[wasinn.Runtime], Awaitable[Any]]
PATHS: dict[str, tuple[Loader, Callable[[Any], Awaitable[np.ndarray[Any, Any]]], float]] = {
    "execute": (_model, _compute, 2.0),
    "execute_batched": (functools.partial(_model, batching=Batching(max_batch=4)),
                        _compute, 2.0),
    "execute_batched_gathering": (
        functools.partial(_model, batching=Batching(max_batch=4, max_delay=0.01)),
        _compute, 2.0),
    "lease": (_model, _lease, 2.0),
    "pipeline": (_pipeline, _compute, 3.0),
    "pipeline_lease": (_pipeline, _lease, 3.0),
}


def _at_least_held(figures: RequestFigures, held: float, what: str) -> None:
    assert figures.completed == 1, (what, figures)
    assert figures.latency_p50 is not None and figures.queued_p50 is not None, what
    # Before: counted from the end of the compile, so a fraction of a millisecond.
    assert figures.latency_p50 >= held, (what, figures.latency_p50, held)
    assert figures.queued_p50 >= held, (what, figures.queued_p50, held)
    assert figures.running_p50 is not None and figures.running_p50 < figures.latency_p50


@pytest.mark.parametrize("path", PATHS)
async def test_a_completed_requests_latency_counts_its_wait_for_the_compile(
        rt: wasinn.Runtime, fake: FakeBackend, path: str) -> None:
    load, request, expected = PATHS[path]
    graph = await load(rt)
    results: list[np.ndarray[Any, Any]] = []

    async def run() -> None:
        results.append(await request(graph))

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            # The request has reached gpu:0 (it started the compile) by the time this
            # sees the compile start.
            await trio.to_thread.run_sync(fake.loading.wait)
            seen = trio.current_time()
            await trio.sleep(HELD)
            held = trio.current_time() - seen
            fake.load_gate.set()
    assert results[0].tolist() == [[expected] * 4]
    (gpu,) = [stats for stats in rt.stats() if stats.device == "gpu:0"]
    _at_least_held(gpu, held, "device")
    _at_least_held(graph.stats(), held, "model")
    (tenant,) = [stats for stats in rt.tenant_stats() if stats.name == "t"]
    _at_least_held(tenant, held, "tenant")
