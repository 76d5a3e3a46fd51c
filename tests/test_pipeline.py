"""Chained pipelines: graph-like, run on one device actor, intermediates never copied
through host memory on the CPU (same backend), counted when backends differ."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import wasinn
from tests.example_configs import example_config, scale_onnx
from tests.support import require_backend
from wasinn import InvalidArgumentError
from wasinn.modelgen import ModelFiles, sample_image


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
        assert wasinn.host_copies() == before  # nothing went through host memory
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


async def test_intermediates_stay_native_between_steps(tmp_path: Path,
                                                       small_mobilenet: ModelFiles) -> None:
    path = example_config("pipeline.toml", tmp_path, small_mobilenet)
    async with wasinn.Runtime.from_config(path) as rt:
        pipeline = await rt.load_by_name("classify")
        before = wasinn.host_copies()
        out = await pipeline.compute({"x": sample_image(0)}, keep_on_device=True)
        assert out["output"].native is not None
        assert wasinn.host_copies() == before
        out["output"].numpy()
        assert wasinn.host_copies() == before + 1  # the count does see materializations


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


async def test_mixed_backends_materialize_and_count_it(tmp_path: Path,
                                                       small_mobilenet: ModelFiles) -> None:
    require_backend("openvino")
    image = sample_image(5)
    async with wasinn.Runtime.from_config(mixed_config(tmp_path, small_mobilenet,
                                                       "openvino")) as rt:
        pipeline = await rt.load_by_name("mixed")
        before = wasinn.host_copies()
        out = await pipeline.compute({"x": image})
        assert wasinn.host_copies() == before + 1  # ORT's value read for OpenVINO
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
async def test_a_gpu_pipeline_keeps_intermediates_on_the_device(tmp_path: Path) -> None:
    from tests.backend_models import affine

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "affine.pt2").write_bytes(affine("pytorch", 2.0, 1.0)[0][0])
    path = tmp_path / "gpu.toml"
    path.write_text("""
[pools.cpu]
kind = "cpu"
[pools.gpu]
kind = "gpu"
[models.a]
files = ["models/affine.pt2"]
encoding = "pytorch"
[models.b]
files = ["models/affine.pt2"]
encoding = "pytorch"
[pipelines.twice]
target = "gpu"
steps = [{ model = "a" }, { model = "b", wire = { output = "x" } }]
""")
    async with wasinn.Runtime.from_config(path) as rt:
        pipeline = await rt.load_by_name("twice")
        before = wasinn.host_copies()
        out = await pipeline.compute({0: np.ones((2, 4), np.float32)})
        assert wasinn.host_copies() == before  # the intermediate stayed on the GPU
        (value,) = out.values()
        assert value.device.startswith("gpu")
        np.testing.assert_allclose(value.numpy(), np.full((2, 4), 7, np.float32))
