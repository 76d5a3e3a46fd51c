"""``CompiledGraph.run`` is handed input names, as its contract types them, whatever keys
the caller used: a position (an int, or numpy's), an alias, a name. A third-party backend
written to the contract, whose ``run`` looks inputs up by name only, serves every request
form the README documents: compute, a context's compute, leases, the caller's thread, a
batching graph and a pipeline whose first step it runs. A position the graph does not
have is refused by the host, before any backend runs.

Before: positions reached ``run`` as they were given, and a plugin failed a valid
``compute({0: x})`` with "BackendRuntimeError: the backend failed: KeyError: 'x'".
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import pytest
import trio

import wasinn
from tests.support import cpu_pool
from tests.test_batching import device_busy, only_actor
from wasinn import (
    Batching,
    ExecutionTarget,
    GraphEncoding,
    InvalidArgumentError,
    Tensor,
    TensorType,
    UnknownNameError,
)
from wasinn.backends import Backend, Builders, CompiledGraph, Device, LoadOptions, TensorSpec

MODEL = b"STRICT"


class NamesOnlyGraph(CompiledGraph):
    """Doubles ``x``; its ``run`` takes names only (as typed) and records the keys of
    each run."""

    def __init__(self, backend: NamesOnlyBackend, device: Device) -> None:
        self.backend = backend
        self.device = device
        self.inputs = (TensorSpec("x", TensorType.F32, (None, 4)),)
        self.outputs = (TensorSpec("y", TensorType.F32, (None, 4)),)
        self.input_aliases = MappingProxyType({"image": 0})

    def run(self, inputs: Mapping[str, Tensor], *, outputs: Sequence[str] | None = None,
            keep_on_device: bool = False) -> dict[str, Tensor]:
        keys = list(inputs)
        with self.backend.lock:
            self.backend.keys.append(keys)
        assert all(type(key) is str for key in keys), keys
        x = inputs["x"].numpy()
        return {"y": Tensor.from_numpy((x * 2).astype(np.float32))}


class NamesOnlyBackend(Backend):
    name = "namesonly"
    encodings = frozenset({GraphEncoding.GGML})

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.keys: list[list[object]] = []  # each run's input keys, in order

    def devices(self) -> list[Device]:
        return [Device(ExecutionTarget.CPU)]

    def load(self, builders: Builders, encoding: GraphEncoding, device: Device,
             options: LoadOptions | None = None) -> CompiledGraph:
        return NamesOnlyGraph(self, device)


def x_rows(count: int = 1, value: float = 1.0) -> np.ndarray[Any, Any]:
    return np.full((count, 4), value, np.float32)


@pytest.fixture
def plugin() -> NamesOnlyBackend:
    return NamesOnlyBackend()


async def test_positions_and_aliases_reach_run_as_names(plugin: NamesOnlyBackend) -> None:
    async with wasinn.Runtime(backends=[plugin]) as rt:
        graph = await rt.load([MODEL], "ggml", backend="namesonly")
        ctx = graph.init_execution_context()
        plugin.keys.clear()
        for inputs in ({0: x_rows()}, {np.int64(0): x_rows()}, {"x": x_rows()},
                       {"image": x_rows()}, {np.uint8(0): Tensor.from_numpy(x_rows())}):
            out = await graph.compute(inputs)
            assert out["y"].numpy().tolist() == [[2.0] * 4], inputs
        out = await ctx.compute({0: x_rows(value=3)})
        assert out["y"].numpy().tolist() == [[6.0] * 4]
        ctx.set_input(np.int32(0), x_rows(value=4))
        await ctx.run()
        assert ctx.get_output(0).numpy().tolist() == [[8.0] * 4]
        assert plugin.keys == [["x"]] * 7


async def test_leases_and_the_callers_thread_hand_run_names(plugin: NamesOnlyBackend) -> None:
    async with wasinn.Runtime(backends=[plugin]) as rt:
        graph = await rt.load([MODEL], "ggml", backend="namesonly")
        ctx = graph.init_execution_context()
        plugin.keys.clear()
        lease = await graph.lease({0: x_rows()})
        assert (await trio.to_thread.run_sync(lease.run))["y"].numpy()[0, 0] == 2.0
        ctx_run = await ctx.lease({np.int64(0): x_rows()})
        assert (await trio.to_thread.run_sync(ctx_run.run))["y"].numpy()[0, 0] == 2.0

        def in_a_thread() -> list[float]:
            leased = graph.try_lease({0: x_rows()})
            assert leased is not None  # compiled, and the device is idle
            first = float(leased.run()["y"].numpy()[0, 0])
            ran = ctx.try_lease({"image": x_rows()})
            assert ran is not None
            return [first, float(ran.run()["y"].numpy()[0, 0]),
                    float(ctx.compute_in_caller_thread({np.int16(0): x_rows()})["y"]
                          .numpy()[0, 0])]

        assert await trio.to_thread.run_sync(in_a_thread) == [2.0, 2.0, 2.0]
        assert plugin.keys == [["x"]] * 5


async def test_a_bad_position_is_refused_by_the_host(plugin: NamesOnlyBackend) -> None:
    async with wasinn.Runtime(backends=[plugin]) as rt:
        graph = await rt.load([MODEL], "ggml", backend="namesonly", name="doubler")
        ctx = graph.init_execution_context()
        plugin.keys.clear()
        said = r"^doubler has no input 1: expected one of 0=x: f32\[\?, 4\]$"
        for attempt in (functools.partial(graph.compute, {1: x_rows()}),
                        functools.partial(ctx.compute, {np.int64(1): x_rows()}),
                        functools.partial(graph.lease, {-1: x_rows()})):
            with pytest.raises(UnknownNameError, match=said.replace("1", "-?1", 1)):
                await attempt()
        with pytest.raises(InvalidArgumentError, match=(
                r"^doubler: input 'x' is given twice \(as 'x' and 0\): expected each input "
                r"once, by its name or its position$")):
            await graph.compute({"x": x_rows(), 0: x_rows()})
        with pytest.raises(InvalidArgumentError, match=r"given twice \(as 'image' and 'x'\)"):
            await graph.compute({"image": x_rows(), "x": x_rows()})
        with pytest.raises(InvalidArgumentError, match=r"input key 0\.0 \(float\): expected"):
            await graph.compute({0.0: x_rows()})
        assert plugin.keys == []  # no request reached the backend
        assert rt.stats()[0].finished == 0


async def test_a_batching_graph_merges_positions_and_names_as_names(
        plugin: NamesOnlyBackend) -> None:
    async with wasinn.Runtime(cpu_pool(workers=1), backends=[plugin]) as rt:
        graph = await rt.load([MODEL], "ggml", backend="namesonly",
                              batching=Batching(max_batch=8))
        plugin.keys.clear()
        results: dict[int, Any] = {}

        async def compute(key: int, inputs: dict[Any, Any]) -> None:
            results[key] = (await graph.compute(inputs))["y"].numpy()

        async with device_busy(only_actor(rt)) as nursery:
            nursery.start_soon(compute, 1, {0: x_rows(2, 1.0)})
            nursery.start_soon(compute, 2, {"x": x_rows(1, 2.0)})
            nursery.start_soon(compute, 3, {np.int64(0): x_rows(3, 3.0)})
        for key, rows in ((1, 2), (2, 1), (3, 3)):
            np.testing.assert_array_equal(results[key], x_rows(rows, 2.0 * key))
        # One merged run of the three (and perhaps its check against a run alone).
        assert graph.stats().batched == 3
        assert plugin.keys and all(keys == ["x"] for keys in plugin.keys)


async def test_a_pipeline_whose_first_step_is_a_plugin_hands_it_names(
        plugin: NamesOnlyBackend, tmp_path: Path) -> None:
    (tmp_path / "double.bin").write_bytes(MODEL)
    config = tmp_path / "wasinn.toml"
    config.write_text(
        '[models.a]\nfiles = ["double.bin"]\nencoding = "ggml"\nbackend = "namesonly"\n'
        '[models.b]\nfiles = ["double.bin"]\nencoding = "ggml"\nbackend = "namesonly"\n'
        '[pipelines.quadruple]\nsteps = [{ model = "a" }, { model = "b", wire = { y = "x" } }]\n')
    async with wasinn.Runtime.from_config(config, backends=[plugin]) as rt:
        pipeline = await rt.load_by_name("quadruple")
        plugin.keys.clear()
        out = await pipeline.compute({0: x_rows()})
        assert out["y"].numpy().tolist() == [[4.0] * 4]
        lease = await pipeline.lease({np.int64(0): x_rows()})
        assert (await trio.to_thread.run_sync(lease.run))["y"].numpy()[0, 0] == 4.0
        with pytest.raises(UnknownNameError, match=r"^quadruple has no input 2: "):
            await pipeline.compute({2: x_rows()})
        assert plugin.keys == [["x"]] * 4
