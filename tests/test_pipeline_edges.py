"""Pipelines at their edges: wiring mistakes named where they are written, batching
refused where a middle step cannot carry the merged rows, a step failing or cancelled
mid-pipeline, several tasks loading one pipeline, contexts on another device, pipelines
feeding pipelines, and zero host copies between steps for every backend installed."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import wasinn
from tests.backend_models import affine
from tests.fake_backend import FakeBackend
from tests.support import cancelled_runs, recorded_runs, require_backend
from tests.test_batching import device_busy
from wasinn import InvalidArgumentError
from wasinn.backends import LoadOptions, TensorSpec
from wasinn.configs.loader import parse_config
from wasinn.configs.schema import RuntimeConfig
from wasinn.enums import GraphEncoding, TensorType
from wasinn.modelgen import affine_onnx, onnx_model_bytes
from wasinn.scheduler.model import LoadedModel
from wasinn.scheduler.pipeline import resolve_wiring

X = np.ones((1, 4), np.float32)


def three_steps(directory: Path, middle: bytes, *, batching: dict[str, Any] | None = None,
                last_wire: dict[str, str] | None = None, target: str = "cpu"
                ) -> RuntimeConfig:
    """Pipeline ``p`` = ``a`` (y = 2x + 1), ``m`` (``middle``, x -> y), ``c`` (y = 3x; fed
    along ``last_wire``), all ONNX Runtime, on one CPU worker; read as if from
    ``directory/wasinn.toml``."""
    files = {"a": affine_onnx(2.0, 1.0), "m": middle, "c": affine_onnx(3.0, 0.0)}
    for name, data in files.items():
        (directory / f"{name}.onnx").write_bytes(data)
    pipeline: dict[str, Any] = {"steps": [{"model": "a"}, {"model": "m", "wire": {"y": "x"}},
                                          {"model": "c", "wire": last_wire or {"y": "x"}}]}
    if batching is not None:
        pipeline["batching"] = batching
    pipeline["target"] = target
    return parse_config({
        "pools": {"cpu": {"kind": "cpu", "devices": ["cpu"], "workers": 1}},
        "models": {name: {"files": [f"{name}.onnx"]} for name in files},
        "pipelines": {"p": pipeline},
    }, directory / "wasinn.toml")


def fake_models(directory: Path, recipes: dict[str, str], pipeline: list[str], *,
                on_gpus: tuple[str, ...] | None = None) -> RuntimeConfig:
    """Fake-backend models (``recipes``: name -> ``add=N``, see tests.fake_backend) and
    pipeline ``p`` of ``pipeline``'s models, on the CPU; with ``on_gpus`` (the models
    whose own target is the GPU), on two GPUs too."""
    pools: dict[str, Any] = {"cpu": {"kind": "cpu", "backends": ["fake"]}}
    if on_gpus is not None:
        pools["gpu"] = {"kind": "gpu", "devices": "auto", "backends": ["fake"]}
    for name, recipe in recipes.items():
        (directory / f"{name}.bin").write_bytes(f"fake:{recipe}".encode())
    return parse_config({
        "pools": pools,
        "models": {name: {"files": [f"{name}.bin"], "encoding": "ggml",
                          "target": "gpu" if name in (on_gpus or ()) else "cpu"}
                   for name in recipes},
        "pipelines": {"p": {"steps": [{"model": name} for name in pipeline]}},
    }, directory / "wasinn.toml", backends=["fake"])


def neg_onnx(rows: int | str) -> bytes:
    """``y = -x`` over f32 ``(rows, 4)`` (``rows`` a number: a fixed first dimension)."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, 4])
    return onnx_model_bytes(helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "neg",
                                              [x], [y]))


def neg_and_total_onnx() -> bytes:
    """``y = -x`` over f32 ``(n, 4)``, and ``total``: the sum of every element, a scalar
    (an output with no rows, which a pipeline may leave unwired)."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])
    total = helper.make_tensor_value_info("total", TensorProto.FLOAT, [])
    nodes = [helper.make_node("Neg", ["x"], ["y"]),
             helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0)]
    return onnx_model_bytes(helper.make_graph(nodes, "neg_total", [x], [y, total]))


def gather_onnx() -> bytes:
    """``y = table[int(x)]`` over f32 ``(n, 4)``, table = [0, 1, 2, 3]: a value of 4 or
    more makes ONNX Runtime fail the run."""
    from onnx import TensorProto, helper

    table = helper.make_tensor("table", TensorProto.FLOAT, [4], [0, 1, 2, 3])
    nodes = [helper.make_node("Cast", ["x"], ["i"], to=TensorProto.INT64),
             helper.make_node("Gather", ["table", "i"], ["y"], axis=0)]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])
    return onnx_model_bytes(helper.make_graph(nodes, "gather", [x], [y], initializer=[table]))


# -- wiring -------------------------------------------------------------------------------
def specs_model(name: str, inputs: list[str], outputs: list[str],
                output_aliases: dict[str, int] | None = None) -> LoadedModel:
    model = LoadedModel((b"",), GraphEncoding.ONNX, LoadOptions(), name=name)
    model.inputs = tuple(TensorSpec(n, TensorType.F32, (None, 4)) for n in inputs)
    model.outputs = tuple(TensorSpec(n, TensorType.F32, (None, 4)) for n in outputs)
    model.output_aliases = output_aliases or {}
    return model


def test_a_step_input_left_unwired_is_named() -> None:
    # Before: "every input must be wired exactly once: got {'y': 'x'}, inputs ['x', 'w']",
    # which left the reader to work out which input was missing.
    a, b = specs_model("a", ["x"], ["y", "z"]), specs_model("b", ["x", "w"], ["out"])
    with pytest.raises(InvalidArgumentError,
                       match=r"^pipeline 'p' step 1 \(b\): input 'w' of b is not wired: "
                             r"expected every input wired exactly once"):
        resolve_wiring("p", [a, b], [{}, {"y": "x"}])


def test_an_input_wired_twice_names_both_outputs() -> None:
    a, b = specs_model("a", ["x"], ["y", "z"]), specs_model("b", ["x"], ["out"])
    with pytest.raises(InvalidArgumentError,
                       match=r"^pipeline 'p' step 1 \(b\): input 'x' of b is wired from 'y' "
                             r"and 'z': expected every input wired exactly once"):
        resolve_wiring("p", [a, b], [{}, {"y": "x", "z": "x"}])


def test_two_names_of_one_output_wired_to_two_inputs_are_refused_not_dropped() -> None:
    # 't' is another name of a's output 'y' (an OpenVINO port's other tensor name). Before:
    # the two wires collapsed into one, silently dropping {'y': 'x'}, and the error blamed
    # an unwired 'x' that the config did wire.
    a = specs_model("a", ["x"], ["y"], output_aliases={"t": 0})
    b = specs_model("b", ["x", "w"], ["out"])
    with pytest.raises(InvalidArgumentError,
                       match=r"^pipeline 'p' step 1 \(b\): wires 'y' and 't', which are both "
                             r"a's output 'y': expected each output wired into one input"):
        resolve_wiring("p", [a, b], [{}, {"y": "x", "t": "w"}])
    # The same wire written twice, once by each name, is only redundant.
    c = specs_model("c", ["x"], ["out"])
    assert resolve_wiring("p", [a, c], [{}, {"y": "x", "t": "x"}]) == ((("y", "x"),),)


async def test_wiring_errors_in_a_config_name_the_file_and_key(tmp_path: Path) -> None:
    config = three_steps(tmp_path, neg_and_total_onnx(), last_wire={"total": "x"})
    async with wasinn.Runtime(config) as rt:
        (actor,) = rt.actors
        with pytest.raises(InvalidArgumentError) as err:
            await rt.load_by_name("p")
        assert str(err.value).startswith(
            f"{tmp_path / 'wasinn.toml'}: pipelines.p.steps[2].wire: pipeline 'p' step 2 "
            "(c): wires total: f32[] into x: f32[?, 4], but their ranks differ")
        assert actor.stats().graphs == 0


async def test_a_pipeline_target_no_device_serves_names_the_file_and_key(
        tmp_path: Path) -> None:
    config = three_steps(tmp_path, affine_onnx(), target="gpu")
    async with wasinn.Runtime(config) as rt:
        with pytest.raises(wasinn.UnsupportedOperationError) as err:
            await rt.load_by_name("p")
        assert str(err.value).startswith(
            f"{tmp_path / 'wasinn.toml'}: pipelines.p.target: no gpu device in this runtime")


# -- batching across steps -----------------------------------------------------------------
async def test_batching_is_refused_when_a_middle_step_fixes_the_batch_dimension(
        tmp_path: Path) -> None:
    # Before: only the first step's inputs and the last step's outputs were checked, so
    # this loaded, and every batch ran merged (failing in m), then request by request,
    # without a word above debug level.
    async with wasinn.Runtime(three_steps(tmp_path, neg_onnx(1),
                                          batching={"max_batch": 4})) as rt:
        (actor,) = rt.actors
        with pytest.raises(InvalidArgumentError) as err:
            await rt.load_by_name("p")
        assert str(err.value).startswith(  # the file, the key, the step
            f"{tmp_path / 'wasinn.toml'}: pipelines.p.batching: pipeline 'p' step 1 (m): "
            "batching merges requests along the first dimension, but input x: f32[1, 4] "
            "fixes it")
        assert actor.stats().graphs == 0  # the steps compiled for the check are freed


async def test_a_middle_steps_unwired_outputs_do_not_stop_batching(tmp_path: Path) -> None:
    # m's scalar 'total' is not wired on: it is dropped, so it does not have to have rows.
    config = three_steps(tmp_path, neg_and_total_onnx(), batching={"max_batch": 4})
    async with wasinn.Runtime(config) as rt:
        (actor,) = rt.actors
        pipeline = await rt.load_by_name("p")
        results: dict[int, np.ndarray[Any, Any]] = {}

        async def call(i: int) -> None:
            results[i] = (await pipeline.compute({"x": np.full((1, 4), i, np.float32)})
                          )["y"].numpy()

        async with device_busy(actor) as nursery:
            for i in range(3):
                nursery.start_soon(call, i)
        for i in range(3):
            np.testing.assert_allclose(results[i], -3 * (2 * np.full((1, 4), i) + 1))
        assert (pipeline.stats().batches, pipeline.stats().batched) == (1, 3)


# -- failures and cancellation mid-pipeline --------------------------------------------------
async def test_a_step_failing_mid_pipeline_names_it_and_leaks_nothing(tmp_path: Path) -> None:
    async with wasinn.Runtime(three_steps(tmp_path, gather_onnx())) as rt:
        (actor,) = rt.actors
        pipeline = await rt.load_by_name("p")
        out = await pipeline.compute({"x": X})  # 2 * 1 + 1 = 3: table[3] = 3, then 9
        np.testing.assert_allclose(out["y"].numpy(), 9 * X)
        with pytest.raises(wasinn.BackendRuntimeError,
                           match=r"^pipeline 'p' step 1 \('m', fed by step 0\): "
                                 r"onnxruntime: .*Gather"):
            await pipeline.compute({"x": 5 * X})  # 11: past the table's end
        # The device goes on serving, and the pipeline with it.
        out = await pipeline.compute({"x": 0 * X})
        np.testing.assert_allclose(out["y"].numpy(), 3 * X)
        stats = actor.stats()
        assert (stats.completed, stats.failed, stats.running, stats.queued) == (2, 1, 0, 0)
        await pipeline.unload()
        assert actor.stats().graphs == 0


async def test_a_later_steps_plain_exception_names_the_step(tmp_path: Path) -> None:
    # A backend given in code may raise its library's own exception (the fake backend
    # raises RuntimeError on a negative input): step 1 gets -0.5 from step 0.
    config = fake_models(tmp_path, {"minus": "add=-2"}, ["minus", "minus"])
    async with wasinn.Runtime(config, backends=[FakeBackend()]) as rt:
        pipeline = await rt.load_by_name("p")
        with pytest.raises(wasinn.BackendRuntimeError,
                           match=r"^pipeline 'p' step 1 \('minus', fed by step 0\): the "
                                 r"backend failed: RuntimeError: "):
            await pipeline.compute({"x": np.full((1, 4), 1.5, np.float32)})
        # The first step is named too: the error is a pipeline's, not a lone model's.
        for run in (pipeline.compute, lambda inputs: lease_run(pipeline, inputs)):
            with pytest.raises(wasinn.BackendRuntimeError,
                               match=r"^pipeline 'p' step 0 \('minus'\): the backend failed: "
                                     r"RuntimeError: "):
                await run({"x": np.full((1, 4), -1.0, np.float32)})


async def test_a_step_whose_own_target_has_no_device_names_its_key_either_way(
        tmp_path: Path) -> None:
    # 'g' wants a GPU this runtime lacks; pipeline 'p' runs it on the CPU. Loaded first
    # as a step, its later load on its own still says which key asks for the GPU.
    config = fake_models(tmp_path, {"c": "add=1", "g": "add=2"}, ["c", "g"], on_gpus=("g",))
    config.pools.pop("gpu")
    async with wasinn.Runtime(config, backends=[FakeBackend()]) as rt:
        await rt.load_by_name("p")
        with pytest.raises(wasinn.UnsupportedOperationError,
                           match=r"^.*wasinn\.toml: models\.g\.target: no gpu device in this "
                                 r"runtime"):
            await rt.load_by_name("g")


async def lease_run(graph: Any, inputs: dict[str, Any]) -> Any:
    # The same request through a lease, as a guest's thread makes it.
    lease = await graph.lease(inputs)
    return await trio.to_thread.run_sync(lease.run)


async def test_a_pipeline_cancelled_during_a_step_runs_no_later_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    outcomes = recorded_runs(monkeypatch)  # every backend run, as it ends
    async with wasinn.Runtime(three_steps(tmp_path, neg_onnx("n"))) as rt:
        (actor,) = rt.actors
        pipeline = await rt.load_by_name("p")
        first_step = rt.name_registry.loaded()[0]
        assert isinstance(first_step, LoadedModel)
        first = actor.cached_session(first_step.id)
        assert first is not None
        real = first.compiled.run
        in_run, go_on = threading.Event(), threading.Event()

        def held_run(inputs: Any, **kwargs: Any) -> dict[str, wasinn.Tensor]:
            in_run.set()
            go_on.wait(30)  # a step that ignores cancellation (as TorchScript does)
            return real(inputs, **kwargs)

        first.compiled.run = held_run  # type: ignore[method-assign]
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pipeline.compute, {"x": X})
                await trio.to_thread.run_sync(in_run.wait)
                nursery.cancel_scope.cancel()
            go_on.set()
            while actor.busy:  # the abandoned job ends in its worker thread
                await trio.sleep(0.01)
        # The first step's run, stopped by the cancellation once it reached the library
        # (ONNX Runtime's terminate flag); no later step ran.
        assert len(outcomes) == 1 and cancelled_runs(outcomes) == outcomes, outcomes
        stats = actor.stats()
        assert (stats.cancelled, stats.running, stats.abandoned_running) == (1, 0, 0)


# -- loading from several tasks --------------------------------------------------------------
async def test_many_tasks_load_one_pipeline_while_its_first_loader_is_cancelled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with wasinn.Runtime(three_steps(tmp_path, neg_onnx("n"))) as rt:
        (actor,) = rt.actors
        registry = rt.name_registry
        get = registry.get
        reached, never = trio.Event(), trio.Event()

        async def held_get(name: str, **hints: Any) -> Any:
            if name == "m" and not reached.is_set():  # only the first loader's
                reached.set()
                await never.wait()
            return await get(name, **hints)

        monkeypatch.setattr(registry, "get", held_get)
        loaded: list[wasinn.Graph] = []
        first = trio.CancelScope()

        async def load(scope: trio.CancelScope | None = None) -> None:
            with scope or trio.CancelScope():
                loaded.append(await rt.load_by_name("p"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(load, first)
            await reached.wait()  # a loaded for the pipeline; m held back
            for _ in range(4):
                nursery.start_soon(load)
            await trio.testing.wait_all_tasks_blocked()
            assert loaded == []  # they wait for the first load
            first.cancel()  # ...which lets a go: the next one loads afresh
        assert len(loaded) == 4
        assert registry.loads == {"a": 2, "m": 1, "c": 1, "p": 1}
        assert len({id(p._executable) for p in loaded}) == 1
        for pipeline in loaded:
            out = await pipeline.compute({"x": X})
            np.testing.assert_allclose(out["y"].numpy(), -9 * X)
        assert actor.stats().graphs == 3
        for pipeline in loaded:
            await pipeline.unload()
        assert actor.stats().graphs == 0


# -- devices -------------------------------------------------------------------------------
async def test_a_context_on_another_target_runs_every_step_there(tmp_path: Path) -> None:
    # Routing on GPUs this machine lacks: the fake backend records what ran where. The
    # second step's own target (gpu) does not matter: the pipeline's (cpu) does.
    config = fake_models(tmp_path, {"one": "add=1", "two": "add=2"}, ["one", "two"],
                         on_gpus=("two",))
    fake = FakeBackend()
    async with wasinn.Runtime(config, backends=[fake]) as rt:
        pipeline = await rt.load_by_name("p")
        assert fake.loads == ["cpu", "cpu"]  # both steps on the pipeline's own device
        ctx = pipeline.init_execution_context("gpu")
        out = await ctx.compute({"x": X})
        (device,) = {d for d, _ in fake.runs}
        assert device.startswith("gpu:") and fake.loads == ["cpu", "cpu", device, device]
        assert out["y"].device == device and not out["y"].is_host  # native off the CPU
        # Chained on that device without leaving it: no host copy.
        before = wasinn.host_copies()
        again = await ctx.compute({"x": out["y"]})
        assert wasinn.host_copies() == before
        assert [d for d, _ in fake.runs] == [device] * 4
        np.testing.assert_allclose(again["y"].numpy(), 7 * X)
        ctx.close()
        await pipeline.unload()
        assert sorted(fake.closed) == sorted(["cpu", "cpu", device, device])


# -- host copies -------------------------------------------------------------------------------
def same_backend_pipeline(directory: Path, backend: str) -> RuntimeConfig:
    """Pipelines ``p`` = ``a`` (2x + 1) then ``b`` (3x), and ``q`` = ``b`` then ``a``, every
    step run by ``backend``."""
    require_backend({"onnxruntime": "onnxruntime", "openvino": "openvino",
                     "pytorch": "torch"}[backend])
    (first,), _ = affine(backend, 2.0, 1.0)
    (second,), _ = affine(backend, 3.0, 0.0)
    suffix = "pt2" if backend == "pytorch" else "onnx"
    (directory / f"a.{suffix}").write_bytes(first)
    (directory / f"b.{suffix}").write_bytes(second)
    out = "output" if backend == "pytorch" else "y"
    return parse_config({
        "pools": {"cpu": {"kind": "cpu", "devices": ["cpu"], "workers": 1}},
        "models": {name: {"files": [f"{name}.{suffix}"], "backend": backend}
                   for name in ("a", "b")},
        "pipelines": {"p": {"steps": [{"model": "a"}, {"model": "b", "wire": {out: "x"}}]},
                      "q": {"steps": [{"model": "b"}, {"model": "a", "wire": {out: "x"}}]}},
    }, directory / "wasinn.toml")


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino", "pytorch"])
async def test_no_host_copy_between_steps_nor_between_pipelines(tmp_path: Path,
                                                                backend: str) -> None:
    async with wasinn.Runtime(same_backend_pipeline(tmp_path, backend)) as rt:
        pipeline = await rt.load_by_name("p")
        other = await rt.load_by_name("q")  # fed by the first one
        before = wasinn.host_copies()
        (first,) = (await pipeline.compute({"x": X}, keep_on_device=True)).values()
        assert first.native is not None
        (second,) = (await other.compute({0: first}, keep_on_device=True)).values()
        assert wasinn.host_copies() == before, backend
        np.testing.assert_allclose(second.numpy(), 2 * (3 * (3 * (2 * X + 1))) + 1)
        assert wasinn.host_copies() == before + 1  # reading the last output, once


async def test_a_pipelines_host_outputs_batch_into_another(tmp_path: Path) -> None:
    # Host outputs of one pipeline are host inputs of the next: they may share a run.
    async with wasinn.Runtime(same_backend_pipeline(tmp_path, "onnxruntime")) as rt:
        first = await rt.load_by_name("p")
        second = await rt.load([affine_onnx(1.0, 1.0)], "onnx",
                               batching=wasinn.Batching(max_batch=8))
        (actor,) = rt.actors
        outs = [(await first.compute({"x": i * X}))["y"] for i in range(3)]
        assert all(out.is_host for out in outs)
        results: dict[int, np.ndarray[Any, Any]] = {}

        async def call(i: int) -> None:
            results[i] = (await second.compute({"x": outs[i]}))["y"].numpy()

        async with device_busy(actor) as nursery:
            for i in range(3):
                nursery.start_soon(call, i)
        for i in range(3):
            np.testing.assert_allclose(results[i], 3 * (2 * i * X + 1) + 1)
        assert second.stats().batches == 1
