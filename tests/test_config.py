"""TOML configs: every packaged file loads and starts a runtime; bad configs give errors
naming the file, the key and what was expected; the model registry looks names up, loads
lazily once for concurrent callers, and never resolves outside the config directory."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import trio

import wasinn
from tests.example_configs import example_config, packaged_dir
from wasinn import ConfigError, InvalidArgumentError, NotFoundError, SecurityError
from wasinn.configs.loader import load_config, packaged_config, packaged_configs
from wasinn.modelgen import ModelFiles, affine_onnx, sample_image

SOURCE_CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def write(directory: Path, text: str, name: str = "wasinn.toml") -> Path:
    path = directory / name
    path.write_text(text)
    return path


def test_the_packaged_configs_are_the_source_tree_ones() -> None:
    names = packaged_configs()
    assert "default.toml" in names and "pools.toml" in names and "pipeline.toml" in names
    if SOURCE_CONFIGS.is_dir():
        assert names == sorted(p.name for p in SOURCE_CONFIGS.glob("*.toml"))


@pytest.mark.parametrize("name", packaged_configs())
def test_every_packaged_config_validates(name: str) -> None:
    config = packaged_config(name)
    assert config.pools
    assert load_config(packaged_dir() / name) == config


@pytest.mark.parametrize("name", packaged_configs())
async def test_every_packaged_config_starts_and_loads_its_models(
        name: str, tmp_path: Path, small_mobilenet: ModelFiles) -> None:
    path = example_config(name, tmp_path, small_mobilenet)
    async with wasinn.Runtime.from_config(path) as rt:
        assert wasinn.backends.Device.parse("cpu") in rt.devices
        for model in rt.model_names():
            graph = await rt.load_by_name(model)
            assert graph.inputs and graph.outputs
            if graph.inputs[0].shape[1:] == (3, 224, 224):
                out = await graph.compute({0: sample_image(0)})
                assert len(out) == len(graph.outputs)
            await graph.unload()


def test_default_runtime_needs_no_files() -> None:
    rt = wasinn.Runtime()
    assert rt.model_names() == []
    assert rt.config.pools["cpu"].kind == "cpu"


@pytest.mark.parametrize(("text", "expected"), [
    ('[pools.cpu]\nkind = "cpu"\nworkerz = 2\n', r"pools\.cpu\.workerz: Extra inputs"),
    ('[pools.cpu]\nkind = "cpu"\nworkers = "two"\n', r"pools\.cpu\.workers: .*integer"),
    ('[pools.cpu]\nkind = "cpu"\nworkers = 0\n', r"pools\.cpu\.workers: .*greater than"),
    ('[pools.g]\nkind = "gpu"\ndevices = ["cpu"]\n', r"pools\.g: .*not a gpu device"),
    ('[pools.g]\nkind = "gpu"\ndevices = ["gpu:x"]\n', r"pools\.g\.devices.*not a device"),
    ('[pools.a]\nkind = "cpu"\n[pools.b]\nkind = "cpu"\n', r"one pool per device kind"),
    ('[pools.cpu]\nkind = "cpu"\ninline_below_us = -1\n',
     r"pools\.cpu\.inline_below_us: .*greater than or equal to 0"),
    ('[pools.cpu]\nkind = "cpu"\ninline_below_us = "fast"\n',
     r"pools\.cpu\.inline_below_us: .*number"),
    ('[models.m]\nfiles = ["m.onnx"]\ntarget = "quantum"\n',
     r"models\.m\.target: unknown ExecutionTarget 'quantum'"),
    ('[models.m]\nfiles = ["m.onnx"]\nencoding = "keras"\n', r"models\.m\.encoding"),
    ('[models.m]\nfiles = []\n', r"models\.m\.files: .*at least 1"),
    ('[models."a/b"]\nfiles = ["m.onnx"]\n', r"models\.a/b.*pattern"),
    ('[pipelines.p]\nsteps = [{ model = "nope" }]\n', r"step 0 uses model 'nope'"),
    ('[models.m]\nfiles = ["m.onnx"]\nwarmup = -1\n',
     r"models\.m\.warmup: .*greater than or equal to 0"),
    ('[models.m]\nfiles = ["m.onnx"]\nwarmup = 1000\n',
     r"models\.m\.warmup: .*less than or equal to 100"),
    ('[models.m]\nfiles = ["m.onnx"]\npreload = 2\n', r"models\.m\.preload: .*boolean"),
    ('[models.m]\nfiles = ["m.onnx"]\n[pipelines.p]\nsteps = [{ model = "m" }]\n'
     'warmup = 1.5\n', r"pipelines\.p\.warmup: .*integer"),
    ('[runtime]\nfallback = "gpu:0:1"\n', r"runtime\.fallback"),
    ('[runtime]\nfallback = "cpu"\n[pools.gpu]\nkind = "gpu"\n',
     r"runtime\.fallback = 'cpu' names a device kind no pool serves \(pools: gpu \(gpu\)\)"),
    ('[runtime]\nfallback = "tpu"\n', r"runtime\.fallback = 'tpu' .*\(pools: cpu \(cpu\)\)"),
    ('[models.m]\nfiles = ["../outside.onnx"]\n',
     r"models\.m\.files\[0\]: .*outside the config directory"),
    ('[models.m]\nfiles = ["models/../../x.onnx"]\n', r"outside the config directory"),
])
def test_bad_configs_name_the_file_the_key_and_the_expectation(
        tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=expected) as info:
        load_config(path)
    assert str(path) in info.value.message
    assert isinstance(info.value, InvalidArgumentError)


def test_not_toml_and_missing_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[pools.cpu\n"))
    with pytest.raises(NotFoundError, match="does not exist"):
        load_config(tmp_path / "absent.toml")


def test_a_symlink_out_of_the_config_directory_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.onnx").write_bytes(b"x")
    config_dir = tmp_path / "cfg"
    config_dir.mkdir()
    (config_dir / "link.onnx").symlink_to(outside / "secret.onnx")
    with pytest.raises(ConfigError, match="outside the config directory"):
        load_config(write(config_dir, '[models.m]\nfiles = ["link.onnx"]\n'))
    # An absolute path is the config author's explicit choice.
    config = load_config(write(config_dir, f'[models.m]\nfiles = ["{outside / "secret.onnx"}"]\n'))
    assert config.models["m"].files == [str(outside / "secret.onnx")]


async def test_an_unknown_backend_in_a_pool_fails_the_start(tmp_path: Path) -> None:
    path = write(tmp_path, '[pools.cpu]\nkind = "cpu"\nbackends = ["tensorrt"]\n')
    with pytest.raises(ConfigError, match=r"pools\.cpu\.backends: .*unknown backend 'tensorrt'"):
        async with wasinn.Runtime.from_config(path):
            pass


def registry_config(directory: Path, *, resident: bool = False) -> Path:
    (directory / "models").mkdir(exist_ok=True)
    (directory / "models" / "affine.onnx").write_bytes(affine_onnx(2.0, 1.0))
    return write(directory, f'''
[models.affine]
files = ["models/affine.onnx"]
encoding = "onnx"
resident = {"true" if resident else "false"}

[models.absent]
files = ["models/absent.onnx"]
''')


async def test_names_are_looked_up_never_used_as_paths(tmp_path: Path) -> None:
    async with wasinn.Runtime.from_config(registry_config(tmp_path)) as rt:
        assert rt.model_names() == ["affine", "absent"]
        for name in ("../models/affine.onnx", "models/affine.onnx", "/etc/passwd", "nope", ""):
            with pytest.raises(NotFoundError, match="no model or pipeline named"):
                await rt.load_by_name(name)
        with pytest.raises(NotFoundError):
            await rt.load_by_name(3)  # type: ignore[arg-type]


async def test_a_missing_registered_file_is_not_found_until_it_appears(tmp_path: Path) -> None:
    async with wasinn.Runtime.from_config(registry_config(tmp_path)) as rt:
        with pytest.raises(NotFoundError, match=r"absent\.onnx"):
            await rt.load_by_name("absent")
        (tmp_path / "models" / "absent.onnx").write_bytes(affine_onnx(1.0, 0.0))
        graph = await rt.load_by_name("absent")
        assert graph.inputs[0].name == "x"


async def test_a_file_swapped_for_an_escaping_symlink_is_refused(tmp_path: Path) -> None:
    config_dir = tmp_path / "cfg"
    config_dir.mkdir()
    path = registry_config(config_dir)
    async with wasinn.Runtime.from_config(path) as rt:
        target = config_dir / "models" / "affine.onnx"
        (tmp_path / "elsewhere.onnx").write_bytes(target.read_bytes())
        target.unlink()
        os.symlink(tmp_path / "elsewhere.onnx", target)
        with pytest.raises(SecurityError, match="outside the config directory"):
            await rt.load_by_name("affine")


async def test_concurrent_callers_share_one_lazy_load(tmp_path: Path) -> None:
    async with wasinn.Runtime.from_config(registry_config(tmp_path)) as rt:
        (actor,) = rt.actors
        assert rt.name_registry.loads == {}  # nothing loaded before first use
        graphs: list[wasinn.Graph] = []

        async def caller() -> None:
            graphs.append(await rt.load_by_name("affine"))

        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(caller)
        assert rt.name_registry.loads == {"affine": 1}
        assert len(actor.session_keys()) == 1
        outs = [await g.compute({"x": np.ones((1, 4), np.float32)}) for g in graphs]
        assert all(o["y"].numpy().tolist() == [[3.0] * 4] for o in outs)
        # Unloading some handles keeps the shared model for the others.
        for g in graphs[:-1]:
            await g.unload()
        assert len(actor.session_keys()) == 1
        await graphs[-1].unload()
        assert actor.session_keys() == []
        again = await rt.load_by_name("affine")
        assert rt.name_registry.loads == {"affine": 2}
        assert (await again.compute({"x": np.ones((1, 4), np.float32)}))["y"].dims == (1, 4)


async def test_a_resident_model_stays_loaded(tmp_path: Path) -> None:
    async with wasinn.Runtime.from_config(registry_config(tmp_path, resident=True)) as rt:
        (actor,) = rt.actors
        graph = await rt.load_by_name("affine")
        await graph.unload()
        assert len(actor.session_keys()) == 1
        await rt.load_by_name("affine")
        assert rt.name_registry.loads == {"affine": 1}
