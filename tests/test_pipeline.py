"""Chained pipelines: graph-like, run on one device actor, each intermediate handed to the
next step's library as it is (the same native value, or ONNX Runtime's memory as
OpenVINO's tensor), never through host memory: a request's host copies are exactly the
final outputs it brings to the host."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import wasinn
from tests.backend_models import affine
from tests.example_configs import example_config
from tests.support import LibraryInputs, passed_as_is, require_backend
from wasinn import InvalidArgumentError
from wasinn.backends import TensorSpec
from wasinn.configs.loader import parse_config
from wasinn.configs.schema import RuntimeConfig
from wasinn.enums import TensorType
from wasinn.modelgen import ModelFiles, affine_onnx, onnx_model_bytes, sample_image, scale_onnx


def native_reference(image: np.ndarray, mobilenet: ModelFiles) -> np.ndarray:
    """Both steps run natively with ONNX Runtime, no wasinn involved."""
    import onnxruntime as ort

    scale = ort.InferenceSession(scale_onnx(), providers=["CPUExecutionProvider"])
    net = ort.InferenceSession(str(mobilenet.onnx), providers=["CPUExecutionProvider"])
    (scaled,) = scale.run(None, {"x": image})
    (logits,) = net.run(None, {"input": scaled})
    return np.asarray(logits)


async def test_a_pipeline_behaves_like_one_graph(tmp_path: Path,
                                                 small_mobilenet: ModelFiles) -> None:
    path = example_config("pipeline.toml", tmp_path, small_mobilenet)
    image = sample_image(4)
    async with wasinn.Runtime.from_config(path) as rt:
        assert "classify" in rt.model_names()
        pipeline = await rt.load_by_name("classify")
        assert isinstance(pipeline, wasinn.Pipeline)
        assert pipeline.steps == ("scale", "mobilenet")
        assert [s.name for s in pipeline.inputs] == ["x"]
        assert [s.name for s in pipeline.outputs] == ["output"]
        ctx = pipeline.init_execution_context()
        before = wasinn.host_copies()
        out = await ctx.compute({"x": image})
        assert out["output"].is_host
        # The one output brought to the host; the intermediate went through no host memory.
        assert wasinn.host_copies() == before + 1
        np.testing.assert_allclose(out["output"].numpy(),
                                   native_reference(image, small_mobilenet), atol=1e-4)
        # The staged form, with the output bound to a buffer.
        buffer = np.zeros((1, 1000), np.float32)
        ctx.set_input(0, image)
        ctx.set_output(0, buffer)
        await ctx.run()
        np.testing.assert_allclose(buffer, out["output"].numpy(), atol=1e-6)
        ctx.close()
        await pipeline.unload()


@dataclass
class StepRun:
    """One backend run of a pipeline step, as :func:`step_runs` saw it."""

    keep_on_device: bool
    outputs: dict[str, wasinn.Tensor]
    #: What the step's library itself was handed as inputs (:class:`LibraryInputs`).
    received: list[Any] = field(default_factory=list)


def step_runs(monkeypatch: pytest.MonkeyPatch) -> list[StepRun]:
    """Spy on every real backend run (``CheckedGraph.run``, whichever thread runs it): what
    it was asked to keep, what it returned and what its library was handed, in order."""
    from wasinn.backends._graphio import CheckedGraph

    runs: list[StepRun] = []
    run = CheckedGraph.run

    def spy(self: CheckedGraph, inputs: Any, **kwargs: Any) -> Any:
        with LibraryInputs(self._backend) as received:
            outputs = run(self, inputs, **kwargs)
        runs.append(StepRun(bool(kwargs.get("keep_on_device")), outputs, received))
        return outputs

    monkeypatch.setattr(CheckedGraph, "run", spy)
    return runs


def over_the_memory_of(received: list[Any], native: Any) -> bool:
    """Whether every ``ov.Tensor`` in ``received`` lies over ``native``'s memory (an
    ``OrtValue`` on the CPU, as OpenVINO is handed it over DLPack); False for none."""
    import openvino as ov

    return bool(received) and all(
        isinstance(r, ov.Tensor) and r.data.__array_interface__["data"][0] == native.data_ptr()
        for r in received)


#: Each step's backend: the same one twice, and ONNX Runtime into OpenVINO (DLPack).
CHAINS = [("onnxruntime", "onnxruntime"), ("openvino", "openvino"),
          ("pytorch", "pytorch"), ("onnxruntime", "openvino")]
LIBRARY = {"onnxruntime": "onnxruntime", "openvino": "openvino", "pytorch": "torch"}


def chain_config(directory: Path, first: str, second: str, target: str = "cpu"
                 ) -> RuntimeConfig:
    """Pipeline ``p`` on ``target`` = ``a`` (y = 2x + 1, run by ``first``) then ``b``
    (3y, run by ``second``), over f32 ``(n, 4)``."""
    for backend in (first, second):
        require_backend(LIBRARY[backend])
    models = {}
    for name, backend, model in (("a", first, affine(first, 2.0, 1.0)),
                                 ("b", second, affine(second, 3.0, 0.0))):
        ((data,), _) = model
        file = f"{name}.{'pt2' if backend == 'pytorch' else 'onnx'}"
        (directory / file).write_bytes(data)
        models[name] = {"files": [file], "backend": backend}
    wire = {"output" if first == "pytorch" else "y": "x"}
    return parse_config({
        "pools": {"cpu": {"kind": "cpu", "devices": ["cpu"], "workers": 1},
                  **({"gpu": {"kind": "gpu"}} if target == "gpu" else {})},
        "models": models,
        "pipelines": {"p": {"target": target,
                            "steps": [{"model": "a"}, {"model": "b", "wire": wire}]}},
    }, directory / "wasinn.toml")


async def check_intermediates_pass_as_they_are(
        rt: wasinn.Runtime, monkeypatch: pytest.MonkeyPatch, first: str, second: str,
        device: str) -> None:
    """Run pipeline ``p`` (:func:`chain_config`) keeping its outputs on ``device`` (the
    kind: "cpu", "gpu") and bringing them to the host: the host copies are exactly the
    final outputs brought there, and step 2's library is handed step 1's native output
    itself, on ``device``."""
    pipeline = await rt.load_by_name("p")
    ctx = pipeline.init_execution_context()
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    await ctx.compute({0: x})  # compiles both steps
    runs = step_runs(monkeypatch)
    default_keep = device != "cpu"  # outputs stay native off the CPU unless told
    for keep in (True, False, None):
        runs.clear()
        before = wasinn.host_copies()
        out = await ctx.compute({0: x}, keep_on_device=keep)
        copies = wasinn.host_copies() - before
        kept = default_keep if keep is None else keep
        (value,) = out.values()
        # Exactly the outputs brought to the host crossed into host memory: none between
        # the steps (a backend's own copy of an output to the host is counted too).
        assert copies == (0 if kept else len(out)), (keep, copies)
        assert value.is_host is not kept
        one, two = runs
        assert one.keep_on_device and two.keep_on_device is kept
        (mid,) = one.outputs.values()
        assert mid.native is not None and mid.device.split(":")[0] == device, mid
        # ...nor went round the count: step 2's library was handed step 1's value itself
        # (ONNX Runtime's OrtValue to OpenVINO as a tensor over its memory, no copy).
        if first == second:
            assert passed_as_is(two.received, mid.native), (two.received, mid.native)
        else:
            assert over_the_memory_of(two.received, mid.native), (two.received, mid.native)
        before = wasinn.host_copies()
        np.testing.assert_allclose(value.numpy(), 3 * (2 * x + 1))
        assert wasinn.host_copies() == before + kept  # reading a kept output: once


@pytest.mark.parametrize(("first", "second"), CHAINS, ids=lambda b: b)
async def test_a_pipeline_hands_each_intermediate_on_as_it_is(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first: str, second: str) -> None:
    async with wasinn.Runtime(chain_config(tmp_path, first, second)) as rt:
        await check_intermediates_pass_as_they_are(rt, monkeypatch, first, second, "cpu")


async def test_a_sandboxed_steps_intermediate_is_counted_as_a_host_copy(
        tmp_path: Path) -> None:
    # A sandboxed graph's outputs reach the host from its process whatever
    # keep_on_device. Before, they were not counted: a pipeline of sandboxed steps passed
    # its intermediate through host memory with host_copies() unchanged.
    config = chain_config(tmp_path, "onnxruntime", "onnxruntime")
    sandboxed = {name: model.model_copy(update={"sandbox": True})
                 for name, model in config.models.items()}
    async with wasinn.Runtime(config.model_copy(update={"models": sandboxed})) as rt:
        pipeline = await rt.load_by_name("p")
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        await pipeline.compute({0: x})  # compiles both steps
        before = wasinn.host_copies()
        (value,) = (await pipeline.compute({0: x}, keep_on_device=True)).values()
        assert value.is_host  # (from the process, kept or not)
        assert wasinn.host_copies() == before + 2  # the intermediate and the output
        np.testing.assert_allclose(value.numpy(), 3 * (2 * x + 1))


def mixed_config(directory: Path, mobilenet: ModelFiles, second_backend: str) -> Path:
    (directory / "models").mkdir()
    (directory / "models" / "scale.onnx").write_bytes(scale_onnx())
    (directory / "models" / "mobilenet.xml").write_bytes(mobilenet.ir_xml.read_bytes())
    (directory / "models" / "mobilenet.bin").write_bytes(mobilenet.ir_bin.read_bytes())
    path = directory / "mixed.toml"
    path.write_text(f'''
[models.scale]
files = ["models/scale.onnx"]
backend = "onnxruntime"

[models.net]
files = ["models/mobilenet.xml", "models/mobilenet.bin"]
backend = "{second_backend}"

[pipelines.mixed]
steps = [{{ model = "scale" }}, {{ model = "net", wire = {{ y = "input" }} }}]

[pipelines.miswired]
steps = [{{ model = "scale" }}, {{ model = "net", wire = {{ z = "input" }} }}]
''')
    return path


async def test_mixed_backends_share_the_intermediate(tmp_path: Path,
                                                      small_mobilenet: ModelFiles) -> None:
    require_backend("openvino")
    image = sample_image(5)
    async with wasinn.Runtime.from_config(mixed_config(tmp_path, small_mobilenet,
                                                       "openvino")) as rt:
        pipeline = await rt.load_by_name("mixed")
        before = wasinn.host_copies()
        out = await pipeline.compute({"x": image})
        # ORT's value handed to OpenVINO over DLPack; only the output came to the host.
        assert wasinn.host_copies() == before + 1
        np.testing.assert_allclose(out["output"].numpy(),
                                   native_reference(image, small_mobilenet), atol=1e-4)


async def test_bad_wiring_fails_at_load(tmp_path: Path, small_mobilenet: ModelFiles) -> None:
    require_backend("openvino")
    async with wasinn.Runtime.from_config(mixed_config(tmp_path, small_mobilenet,
                                                       "openvino")) as rt:
        with pytest.raises(InvalidArgumentError, match=r"wires 'z', which scale does not"):
            await rt.load_by_name("miswired")
        assert (await rt.load_by_name("mixed")).steps == ("scale", "net")


async def test_unloading_a_pipeline_frees_its_steps(tmp_path: Path,
                                                    small_mobilenet: ModelFiles) -> None:
    path = example_config("pipeline.toml", tmp_path, small_mobilenet)
    async with wasinn.Runtime.from_config(path) as rt:
        (actor,) = rt.actors
        pipeline = await rt.load_by_name("classify")
        assert len(actor.session_keys()) == 2
        ctx = pipeline.init_execution_context()
        await pipeline.unload()
        await ctx.compute({"x": sample_image(0)})
        ctx.close()
        # mobilenet is preloaded (so kept loaded) in pipeline.toml; the scale step is freed.
        assert len(actor.session_keys()) == 1
        again = await rt.load_by_name("classify")
        assert (await again.compute({"x": sample_image(0)}))["output"].dims == (1, 1000)


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
async def test_a_gpu_pipeline_keeps_intermediates_on_the_device(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with wasinn.Runtime(chain_config(tmp_path, "pytorch", "pytorch", "gpu")) as rt:
        await check_intermediates_pass_as_they_are(rt, monkeypatch, "pytorch", "pytorch",
                                                   "gpu")


def two_step_config(directory: Path, *, extra: str = "",
                    wire: str = "", second: bytes | None = None) -> Path:
    """Pipeline ``p`` = ``a`` (y = 2x + 1) then ``b`` (z = 3y), both ONNX Runtime."""
    (directory / "a.onnx").write_bytes(affine_onnx(2.0, 1.0))
    (directory / "b.onnx").write_bytes(
        second if second is not None else affine_onnx(3.0, 0.0, in_name="y", out_name="z"))
    path = directory / "wasinn.toml"
    path.write_text(f'''
[models.a]
files = ["a.onnx"]
[models.b]
files = ["b.onnx"]
[pipelines.p]
steps = [{{ model = "a" }}, {{ model = "b"{wire} }}]
{extra}''')
    return path


X = np.ones((1, 4), np.float32)


def neg_onnx(rows: int) -> bytes:
    """``z = -y`` over f32 ``(rows, 4)``: a second step whose first dimension is fixed."""
    from onnx import TensorProto, helper

    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, 4])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, [rows, 4])
    graph = helper.make_graph([helper.make_node("Neg", ["y"], ["z"])], "neg", [y], [z])
    return onnx_model_bytes(graph)


async def test_a_step_loaded_and_unloaded_meanwhile_does_not_break_the_pipeline_load(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The pipeline's load fetches a, then b. While it waits for b, another caller loads
    # and unloads a: a must stay held for the pipeline (not freed, not compiled again).
    async with wasinn.Runtime.from_config(two_step_config(tmp_path)) as rt:
        (actor,) = rt.actors
        registry = rt.name_registry
        fetching_b, go_on = trio.Event(), trio.Event()
        get = registry.get

        async def gated_get(name: str, **hints: Any) -> Any:
            if name == "b" and not go_on.is_set():
                fetching_b.set()
                await go_on.wait()
            return await get(name, **hints)

        monkeypatch.setattr(registry, "get", gated_get)
        pipelines: list[wasinn.Graph] = []
        async with trio.open_nursery() as nursery:
            async def load_pipeline() -> None:
                pipelines.append(await rt.load_by_name("p"))

            nursery.start_soon(load_pipeline)
            await fetching_b.wait()  # a is loaded for the pipeline, b not yet
            other = await rt.load_by_name("a")
            await other.unload()
            assert actor.cached(registry.loaded()[0].id)  # a is still held, still compiled
            go_on.set()
        (pipeline,) = pipelines
        assert (await pipeline.compute({"x": X}))["z"].numpy().tolist() == [[9.0] * 4]
        assert registry.loads == {"a": 1, "b": 1, "p": 1}
        assert actor.stats().compiles == 2
        await pipeline.unload()
        assert actor.stats().graphs == 0


async def test_a_step_is_compiled_on_the_pipelines_device_not_its_own_target(
        tmp_path: Path) -> None:
    # b's own default target (tpu) has no device here; the pipeline runs on the CPU: b is
    # compiled there only, and b loaded by itself still reports its target missing.
    path = two_step_config(tmp_path)
    path.write_text(path.read_text().replace('files = ["b.onnx"]',
                                             'files = ["b.onnx"]\ntarget = "tpu"'))
    async with wasinn.Runtime.from_config(path) as rt:
        (actor,) = rt.actors
        pipeline = await rt.load_by_name("p")
        assert (await pipeline.compute({"x": X}))["z"].numpy().tolist() == [[9.0] * 4]
        assert actor.stats().compiles == 2
        with pytest.raises(wasinn.UnsupportedOperationError, match="no tpu device"):
            await rt.load_by_name("b")
        await pipeline.unload()


async def test_a_failed_pipeline_load_leaves_nothing_compiled(tmp_path: Path) -> None:
    path = two_step_config(tmp_path, wire=', wire = { nope = "y" }')
    async with wasinn.Runtime.from_config(path) as rt:
        (actor,) = rt.actors
        for _ in range(2):
            with pytest.raises(InvalidArgumentError, match=r"step 1 \(b\): wires 'nope', "
                                                           r"which a does not output") as err:
                await rt.load_by_name("p")
            # Where the bad wire is written: the file and the key.
            assert str(err.value).startswith(f"{path}: pipelines.p.steps[1].wire: ")
            assert actor.stats().graphs == 0  # a and b were freed with the failure
            assert all(model.released for model in rt.name_registry.loaded())
        # A step someone else holds is theirs: the failure lets go of the pipeline's hold.
        a = await rt.load_by_name("a")
        with pytest.raises(InvalidArgumentError, match="wires 'nope'"):
            await rt.load_by_name("p")
        assert actor.stats().graphs == 1
        assert (await a.compute({"x": X}))["y"].numpy().tolist() == [[3.0] * 4]
        await a.unload()
        assert actor.stats().graphs == 0


async def test_a_step_that_fails_to_compile_frees_the_ones_before(tmp_path: Path) -> None:
    async with wasinn.Runtime.from_config(two_step_config(tmp_path, second=b"junk")) as rt:
        (actor,) = rt.actors
        with pytest.raises(wasinn.InvalidEncodingError):
            await rt.load_by_name("p")
        assert actor.stats().graphs == 0


async def test_a_pipeline_refused_for_batching_frees_its_steps(tmp_path: Path) -> None:
    # A last step whose outputs fix the batch dimension cannot batch.
    path = two_step_config(tmp_path, extra="batching = { max_batch = 4 }\n",
                           second=neg_onnx(rows=1))
    async with wasinn.Runtime.from_config(path) as rt:
        (actor,) = rt.actors
        with pytest.raises(InvalidArgumentError, match=r"pipeline 'p'.*batch"):
            await rt.load_by_name("p")
        assert actor.stats().graphs == 0


async def test_a_cancelled_pipeline_load_leaves_nothing_compiled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with wasinn.Runtime.from_config(two_step_config(tmp_path)) as rt:
        (actor,) = rt.actors
        registry = rt.name_registry
        get = registry.get
        fetching_b = trio.Event()

        async def stuck_get(name: str, **hints: Any) -> Any:
            if name == "b":
                fetching_b.set()
                await trio.sleep_forever()
            return await get(name, **hints)

        monkeypatch.setattr(registry, "get", stuck_get)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rt.load_by_name, "p")
            await fetching_b.wait()  # a loaded and compiled, b never comes
            await trio.testing.wait_all_tasks_blocked()
            assert actor.stats().graphs == 1
            nursery.cancel_scope.cancel()
        assert actor.stats().graphs == 0
        monkeypatch.setattr(registry, "get", get)
        pipeline = await rt.load_by_name("p")  # and a later load starts afresh
        assert (await pipeline.compute({"x": X}))["z"].numpy().tolist() == [[9.0] * 4]


def test_a_wire_on_the_first_step_is_refused() -> None:
    # The config refuses it too (pipelines.NAME.steps[0].wire); this is the load's check.
    from wasinn.backends import LoadOptions, TensorSpec
    from wasinn.enums import GraphEncoding, TensorType
    from wasinn.scheduler.model import LoadedModel
    from wasinn.scheduler.pipeline import resolve_wiring

    a, b = (LoadedModel((b"",), GraphEncoding.ONNX, LoadOptions(), name=n) for n in "ab")
    for model in (a, b):
        model.inputs = (TensorSpec("x", TensorType.F32, (None, 4)),)
        model.outputs = (TensorSpec("y", TensorType.F32, (None, 4)),)
    assert resolve_wiring("p", [a, b], [{}, {"y": "x"}]) == ((("y", "x"),),)
    with pytest.raises(InvalidArgumentError, match=r"pipeline 'p' step 0 \(a\): wired "
                                                   r"\{'x': 'x'\}, but the first step"):
        resolve_wiring("p", [a, b], [{"x": "x"}, {}])


@pytest.mark.parametrize(("second_input", "why"), [
    (TensorSpec("x", TensorType.I64, (None, 4)), r"their element types differ \(f32, i64\)"),
    (TensorSpec("x", TensorType.F32, (None, 8)), r"dimension 1 differs \(4, 8\)"),
    (TensorSpec("x", TensorType.F32, (None, 2, 2)), r"their ranks differ \(2, 3\)"),
    (TensorSpec("x", TensorType.F32, (None, None), bounds=((0, None), (5, 8))),
     r"dimension 1 is 4 and x takes 5 to 8 there"),
])
def test_a_wire_between_incompatible_tensors_is_refused_at_load(second_input: TensorSpec,
                                                               why: str) -> None:
    # Before: the load passed, and every compute failed in step 1's backend, blaming the
    # caller's (valid) input.
    from wasinn.backends import LoadOptions
    from wasinn.enums import GraphEncoding
    from wasinn.scheduler.model import LoadedModel
    from wasinn.scheduler.pipeline import resolve_wiring

    a, b = (LoadedModel((b"",), GraphEncoding.ONNX, LoadOptions(), name=n) for n in "ab")
    a.inputs = (TensorSpec("x", TensorType.F32, (None, 4)),)
    a.outputs = (TensorSpec("y", TensorType.F32, (None, 4)),)
    b.inputs, b.outputs = (second_input,), (TensorSpec("z", TensorType.F32, (None, 4)),)
    with pytest.raises(InvalidArgumentError, match=rf"pipeline 'p' step 1 \(b\): wires "
                                                   rf"y: f32\[\?, 4\] into x: .*, but {why}"):
        resolve_wiring("p", [a, b], [{}, {"y": "x"}])
    # Unknown ranks (TorchScript declares none) and dynamic dimensions are not compared.
    b.inputs = (TensorSpec("x", TensorType.F32, (), rank_known=False),)
    assert resolve_wiring("p", [a, b], [{}, {"y": "x"}]) == ((("y", "x"),),)


def test_a_wire_whose_sizes_fall_outside_the_inputs_bounds_is_refused_at_load() -> None:
    # Before: bounds were not compared, and every compute failed in step 1.
    from wasinn.backends import LoadOptions
    from wasinn.enums import GraphEncoding
    from wasinn.scheduler.model import LoadedModel
    from wasinn.scheduler.pipeline import resolve_wiring

    a, b = (LoadedModel((b"",), GraphEncoding.ONNX, LoadOptions(), name=n) for n in "ab")
    a.inputs = (TensorSpec("x", TensorType.F32, (None, 4)),)
    a.outputs = (TensorSpec("y", TensorType.F32, (None, 4), bounds=((5, 8), (4, 4))),)
    b.inputs = (TensorSpec("x", TensorType.F32, (None, 4), bounds=((1, 4), (4, 4))),)
    b.outputs = (TensorSpec("z", TensorType.F32, (None, 4)),)
    with pytest.raises(InvalidArgumentError) as caught:
        resolve_wiring("p", [a, b], [{}, {"y": "x"}])
    assert caught.value.message == (
        "pipeline 'p' step 1 (b): wires y: f32[5..8, 4] into x: f32[1..4, 4], but dimension "
        "0 is 5 to 8 and x takes 1 to 4 there: expected an output b can take")
    # Sizes that may fit are left to the run's check.
    for bounds in (((4, 9), (4, 4)), ((0, None), (4, 4))):
        a.outputs = (TensorSpec("y", TensorType.F32, (None, 4), bounds=bounds),)
        assert resolve_wiring("p", [a, b], [{}, {"y": "x"}]) == ((("y", "x"),),)
    a.outputs = (TensorSpec("y", TensorType.F32, (None, 4)),)
    assert resolve_wiring("p", [a, b], [{}, {"y": "x"}]) == ((("y", "x"),),)


async def test_a_later_step_failing_on_its_fed_input_says_which_step(tmp_path: Path) -> None:
    # A wire whose shapes agree on paper but not in a run (b fixes its first dimension).
    path = two_step_config(tmp_path, second=neg_onnx(rows=2))
    async with wasinn.Runtime.from_config(path) as rt:
        pipeline = await rt.load_by_name("p")
        with pytest.raises(InvalidArgumentError,
                           match=r"^pipeline 'p' step 1 \('b', fed by step 0\): onnxruntime: "
                                 r"input 'y' "
                                 r"has shape \[1, 4\]"):
            await pipeline.compute({"x": X})


async def test_a_wire_may_name_a_port_by_another_of_its_names(tmp_path: Path) -> None:
    """OpenVINO folds ``x * 1`` into the compiled model's input, whose port then carries
    the tensor names {x, t}: the input keeps the model's own name (x), and a wire into
    the other name (t) joins the same input, as ``compute`` accepts it."""
    require_backend("openvino")
    path = two_step_config(tmp_path, wire=', wire = { y = "t" }',
                           second=affine_onnx(1.0, 5.0, in_name="x", out_name="w"))
    path.write_text(path.read_text().replace('files = ["b.onnx"]',
                                             'files = ["b.onnx"]\nbackend = "openvino"'))
    async with wasinn.Runtime.from_config(path) as rt:
        second = await rt.load_by_name("b")
        assert [spec.name for spec in second.inputs] == ["x"]
        pipeline = await rt.load_by_name("p")
        out = await pipeline.compute({"x": X})
        np.testing.assert_array_equal(out["w"].numpy(), X * 2 + 1 + 5)
