"""Models the command line adds to a config's registry (``--nn-preload``, ``-S
nn-graph=``), and a registry model whose file cannot be resolved: each does what the
README says, with real ONNX Runtime models."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import wasinn
from tests.support import require_backend
from wasinn import NotFoundError
from wasinn.cli import main
from wasinn.configs.loader import load_config
from wasinn.host.preload import parse_nn_graph, parse_nn_preload, with_preloads
from wasinn.modelgen import affine_onnx

ONES = {"x": np.ones((1, 4), np.float32)}


def write(directory: Path, text: str, name: str = "wasinn.toml") -> Path:
    path = directory / name
    path.write_text(text)
    return path


# -- -S nn-graph=ENCODING::DIR ------------------------------------------------------------
def test_a_graph_folder_reached_through_a_link_is_named_as_given(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # README and Wasmtime: the name is DIR's last part. A "current version" link was
    # named after its target (mobilenet-v3), so load_by_name("mobilenet") found nothing.
    require_backend("onnxruntime")
    real = tmp_path / "models" / "mobilenet-v3"
    real.mkdir(parents=True)
    (real / "model.onnx").write_bytes(affine_onnx(3.0, 0.0))
    link = tmp_path / "models" / "mobilenet"
    link.symlink_to("mobilenet-v3")
    graph = parse_nn_graph(f"nn-graph=onnx::{link}")
    assert graph.name == "mobilenet"
    assert graph.paths == (link / "model.onnx",)  # the files are still read through it
    for spelt in (f"{link}/", f"{link}/.", f"{real}/../mobilenet"):
        assert parse_nn_graph(f"nn-graph=onnx::{spelt}").name == "mobilenet"
    np.save(tmp_path / "x.npy", ONES["x"])
    assert main(["infer", "-S", f"nn-graph=onnx::{link}", "mobilenet",
                 "--input", f"x={tmp_path / 'x.npy'}"]) == 0
    assert capfd.readouterr().out.startswith("y: f32[1, 4] min 3 max 3 ")  # 3x: the model


# -- --nn-preload of a name the config registers ------------------------------------------
def pipeline_config(directory: Path) -> Path:
    (directory / "models").mkdir()
    (directory / "models" / "double.onnx").write_bytes(affine_onnx(2.0, 0.0))
    (directory / "models" / "triple.onnx").write_bytes(affine_onnx(3.0, 0.0))
    return write(directory, '''
[models.double]
files = ["models/double.onnx"]
[models.triple]
files = ["models/triple.onnx"]
[pipelines.classify]
steps = [{ model = "double" }, { model = "triple", wire = { y = "x" } }]
''')


async def test_a_preload_replaces_a_config_pipeline_of_its_name(tmp_path: Path) -> None:
    # README: "a name the config already registers ... is replaced by the command line's".
    # A pipeline's name was refused instead, the error blaming the config's [pipelines].
    require_backend("onnxruntime")
    path = pipeline_config(tmp_path)
    (tmp_path / "plus.onnx").write_bytes(affine_onnx(1.0, 1.0))
    spec = f"classify:onnx:cpu:{tmp_path / 'plus.onnx'}"
    config = with_preloads(load_config(path), [parse_nn_preload(spec)])
    assert "classify" not in config.pipelines
    assert config.models["classify"].files == [str(tmp_path / "plus.onnx")]
    assert config.model_key("classify") == f"--nn-preload {spec!r}"
    async with wasinn.Runtime(config) as rt:
        assert sorted(rt.model_names()) == ["classify", "double", "triple"]
        out = await (await rt.load_by_name("classify")).compute(ONES)
        assert out["y"].numpy().tolist() == [[2.0] * 4]  # x + 1: the preload, not 6x
        # The config's other models, the pipeline's steps, are untouched.
        out = await (await rt.load_by_name("triple")).compute(ONES)
        assert out["y"].numpy().tolist() == [[3.0] * 4]


def test_the_command_line_lists_the_preload_in_the_pipelines_place(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    path = pipeline_config(tmp_path)
    spec = f"classify:onnx:cpu:{tmp_path / 'plus.onnx'}"
    assert main(["models", "--config", str(path), "--nn-preload", spec]) == 0
    rows = {line.split()[0]: line.split()[1] for line in capfd.readouterr().out.splitlines()[1:]}
    assert rows == {"double": "model", "triple": "model", "classify": "model"}


# -- the config's warnings ------------------------------------------------------------------
def test_each_config_warning_is_given_once_with_preloads(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # with_preloads validated the merged config again: each warning came twice, the
    # second time as "FILE + preloads".
    (tmp_path / "m.onnx").write_bytes(affine_onnx())
    path = write(tmp_path, '''
[models.m]
files = ["m.onnx"]
warmup_inputs = { x = [1, 4] }
[tenants.alice]
weight = 2.0
''')
    spec = f"p:onnx:cpu:{tmp_path / 'm.onnx'}"
    for argv in (["models", "--config", str(path), "--nn-preload", spec],
                 ["models", "--config", str(path), "-S", f"nn-graph=onnx::{tmp_path}"]):
        caplog.clear()
        with caplog.at_level("WARNING", logger="wasinn.configs"):
            assert main(argv) == 0
        said = [r.getMessage() for r in caplog.records if r.name == "wasinn.configs"]
        assert [m.split(": ", 2)[:2] for m in said] == [
            [str(path), "models.m.warmup_inputs"], [str(path), "tenants"]], said


# -- a model file that cannot be resolved ---------------------------------------------------
LOOPS = ["models/loop.onnx", "loop/m.onnx"]


def looping_config(directory: Path, file: str) -> Path:
    """Model ``good`` (2x + 1), and model ``bad`` whose ``file`` lies in a symlink loop."""
    (directory / "models").mkdir()
    (directory / "models" / "good.onnx").write_bytes(affine_onnx(2.0, 1.0))
    (directory / "models" / "loop.onnx").symlink_to("loop.onnx")  # a file that loops
    (directory / "loop").symlink_to(directory / "loop")  # a folder that loops
    return write(directory, f'[models.good]\nfiles = ["models/good.onnx"]\n'
                            f'[models.bad]\nfiles = ["{file}"]\n')


@pytest.mark.parametrize("file", LOOPS)
def test_a_model_file_in_a_symlink_loop_does_not_hide_the_devices(
        tmp_path: Path, capfd: pytest.CaptureFixture[str], file: str) -> None:
    # README: `devices --config FILE` lists FILE's devices "so a model that cannot load
    # (yet) does not hide them". A looping link made the whole config a ConfigError.
    path = looping_config(tmp_path, file)
    assert main(["devices", "--config", str(path)]) == 0
    assert re.search(r"^DEVICE +KIND +BACKENDS\ncpu +cpu ", capfd.readouterr().out, re.M)


@pytest.mark.parametrize("file", LOOPS)
async def test_a_model_file_in_a_symlink_loop_fails_only_its_model(
        tmp_path: Path, file: str) -> None:
    # As a missing file does: every other model of the config still serves.
    require_backend("onnxruntime")
    path = looping_config(tmp_path, file)
    async with wasinn.Runtime.from_config(path) as rt:
        out = await (await rt.load_by_name("good")).compute(ONES)
        assert out["y"].numpy().tolist() == [[3.0] * 4]
        with pytest.raises(NotFoundError) as exc:
            await rt.load_by_name("bad")
    # (Python 3.11 and 3.12 find the loop when the path is resolved; 3.13 when the file
    # is opened: either way, the model and its file are named, and why.)
    assert re.match(rf"{re.escape(str(path))}: models\.bad: .*{re.escape(Path(file).name)}"
                    r".*(Symlink loop|Too many levels of symbolic links)", str(exc.value)
                    ), str(exc.value)
