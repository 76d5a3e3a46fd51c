"""TOML configs: every packaged file loads and starts a runtime; bad configs give errors
naming the file, the key and what was expected; the model registry looks names up, loads
lazily once for concurrent callers, and never resolves outside the config directory."""

from __future__ import annotations

import importlib
import logging
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

import wasinn
from tests.example_configs import example_config, packaged_dir
from tests.fake_backend import FakeBackend
from tests.support import require_backend
from wasinn import ConfigError, InvalidArgumentError, NotFoundError, SecurityError
from wasinn.backends import LoadOptions
from wasinn.configs.loader import load_config, packaged_config, packaged_configs, parse_config
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


async def test_modelgen_writes_the_models_the_example_pipeline_names(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The README's steps for ``configs/pipeline.toml``: copy it, ``python -m
    wasinn.modelgen models``, run it."""
    from wasinn import modelgen

    shutil.copy(packaged_dir() / "pipeline.toml", tmp_path)
    assert modelgen.main([str(tmp_path / "models"), "--width", "0.35"]) == 0
    written = capsys.readouterr().out.split()
    assert written == [str(tmp_path / "models" / n) for n in ("scale.onnx", "mobilenet.onnx")]
    async with wasinn.Runtime.from_config(tmp_path / "pipeline.toml") as rt:
        classify = await rt.load_by_name("classify")
        out = await classify.compute({"x": sample_image(0)})
        assert out["output"].dims == (1, 1000)


def test_default_runtime_needs_no_files() -> None:
    rt = wasinn.Runtime()
    assert rt.model_names() == []
    assert rt.config.pools["cpu"].kind == "cpu"


@pytest.mark.parametrize(("text", "expected"), [
    ('[pools.cpu]\nkind = "cpu"\nworkerz = 2\n',
     r"pools\.cpu\.workerz: unknown key: did you mean workers\? expected one of kind, devices, "
     r"workers, compile_threads, queue_limit, backends, policy, inline_below_us, close_timeout, "
     r"pin_handoffs$"),
    ('[pool.cpu]\nkind = "cpu"\n', r"pool: unknown key: did you mean pools\? expected one of "
                                   r"runtime, pools, models, pipelines, guests, tenants$"),
    ('[models.m]\nfiles = ["m.onnx"]\nbatching = { max_batchs = 8 }\n',
     r"models\.m\.batching\.max_batchs: unknown key: did you mean max_batch\? expected one of "
     r"max_batch, max_delay_ms$"),
    ('[pipelines.p]\nsteps = [{ model = "m", wires = {} }]\n',
     r"pipelines\.p\.steps\[0\]\.wires: unknown key: did you mean wire\? expected one of "
     r"model, wire"),
    ('[guests]\nzzz = 1\n', r"guests\.zzz: unknown key: expected one of max_graphs, "),
    ('runtime = 3\n', r"^\S+: runtime: expected a table: a \[section\], or \{ key = value, "
                      r"\.\.\. \} \(got 3\)$"),
    ('[runtime]\nbackends = ["onnxruntime", "openvino", "onnxruntime"]\n',
     r"runtime\.backends\[2\]: backend 'onnxruntime' is listed twice: expected each once"),
    ('[pools.cpu]\ndevices = ["cpu"]\n',
     r"pools\.cpu\.kind: required, and missing: expected one of 'cpu', 'gpu', 'tpu'$"),
    # Numbers and booleans are not read from strings (a count never from a float).
    ('[models.m]\nfiles = ["m.onnx"]\npreload = "no"\n',
     r"models\.m\.preload: Input should be a valid boolean \(got 'no'\)$"),
    ('[models.m]\nfiles = ["m.onnx"]\nresident = "on"\n', r"models\.m\.resident: .*boolean"),
    ('[models.m]\nfiles = ["m.onnx"]\nbatching = { max_batch = 2, max_delay_ms = "2" }\n',
     r"models\.m\.batching\.max_delay_ms: Input should be a valid number \(got '2'\)$"),
    ('[pools.cpu]\nkind = "cpu"\nclose_timeout = "10"\n', r"pools\.cpu\.close_timeout: .*number"),
    ('[guests]\ncompute_timeout = "30"\n', r"guests\.compute_timeout: .*number"),
    ('[pools.cpu]\nkind = "cpu"\nworkers = "two"\n', r"pools\.cpu\.workers: .*integer"),
    ('[pools.cpu]\nkind = "cpu"\nworkers = 0\n', r"pools\.cpu\.workers: .*greater than"),
    ('[pools.g]\nkind = "gpu"\ndevices = ["cpu"]\n',
     r"pools\.g\.devices\[0\]: device 'cpu' is not a gpu device$"),
    ('[pools.g]\nkind = "gpu"\ndevices = ["gpu:x"]\n',
     r"pools\.g\.devices\[0\]: not a device: .*has index 'x': expected a non-negative integer"),
    ('[pools.g]\nkind = "gpu"\ndevices = ["gpu:-1"]\n', r"pools\.g\.devices\[0\]: not a device"),
    # One error for a value of neither form, not one per member of "auto" | list.
    ('[pools.g]\nkind = "gpu"\ndevices = "gpu:0"\n',
     r'^[^;]*: pools\.g\.devices: expected "auto" or a list of device names such as \["cpu"\] '
     r"or \[\"gpu:0\", \"gpu:1\"\] \(got 'gpu:0'\)$"),
    ('[pools.g]\nkind = "gpu"\ndevices = ["gpu:0", 3]\n',
     r"^[^;]*: pools\.g\.devices\[1\]: Input should be a valid string \(got 3\)$"),
    ('[pools.a]\nkind = "cpu"\n[pools.b]\nkind = "cpu"\n',
     r"pools\.b\.kind: pools 'a' and 'b' are both cpu pools: expected one pool per device kind$"),
    ('[pools.cpu]\nkind = "cpu"\ninline_below_us = -1\n',
     r"pools\.cpu\.inline_below_us: .*greater than or equal to 0"),
    ('[pools.cpu]\nkind = "cpu"\ninline_below_us = "fast"\n',
     r"pools\.cpu\.inline_below_us: .*number"),
    ('[models.m]\nfiles = ["m.onnx"]\ntarget = "quantum"\n',
     r"models\.m\.target: unknown execution target 'quantum'"),
    ('[models.m]\nfiles = ["m.onnx"]\nencoding = "keras"\n', r"models\.m\.encoding"),
    ('[models.m]\nfiles = []\n', r"models\.m\.files: .*at least 1"),
    ('[models."a/b"]\nfiles = ["m.onnx"]\n',
     r"models\.\"a/b\": name 'a/b' is not a plain identifier: expected at most 128 "
     r"letters, digits, '_', '\.' and '-', not starting with '\.' or '-' \(a name is looked "
     r"up, never used as a path\)$"),
    (f'[pipelines.{"p" * 129}]\nsteps = [{{ model = "m" }}]\n',
     rf"name '{'p' * 57}\.\.\.' is not a plain identifier"),  # cut, still quoted whole
    ('[pipelines.p]\nsteps = [{ model = "nope" }]\n',
     r"pipelines\.p\.steps\[0\]\.model: pipeline 'p' step 0 uses model 'nope', which is not "
     r"in \[models\] \(models: none\)$"),
    ('[models.a]\nfiles = ["a.onnx"]\n[pipelines.p]\nsteps = [{ model = "a" }]\n'
     '[pipelines.q]\nsteps = [{ model = "p" }]\n',
     r"pipelines\.q\.steps\[0\]\.model: .* uses model 'p', which is not in \[models\] but a "
     r"pipeline: a step is one model \(list the other pipeline's steps instead\) "
     r"\(models: a\)$"),
    ('[models.m]\nfiles = ["m.onnx"]\nwarmup = -1\n',
     r"models\.m\.warmup: .*greater than or equal to 0"),
    ('[models.m]\nfiles = ["m.onnx"]\nwarmup = 1000\n',
     r"models\.m\.warmup: .*less than or equal to 100"),
    ('[models.m]\nfiles = ["m.onnx"]\npreload = 2\n', r"models\.m\.preload: .*boolean"),
    ('[models.m]\nfiles = ["m.onnx"]\nwarmup = 1\nwarmup_inputs = { x = [true, 2] }\n',
     r"models\.m\.warmup_inputs\.x\[0\]: Input should be a valid integer \(got True\)"),
    # A warm-up input as a table of shape and type: each key named, once.
    ('[models.m]\nfiles = ["m.onnx"]\nwarmup = 1\n'
     'warmup_inputs = { ids = { shape = [1, 8], type = "int64" } }\n',
     r"^[^;]*: models\.m\.warmup_inputs\.ids\.type: unknown tensor type 'int64': expected one "
     r"of f16, f32, f64, bf16, u8, i32, i64$"),
    ('[models.m]\nfiles = ["m.onnx"]\nwarmup = 1\nwarmup_inputs = { ids = { type = "i64" } }\n',
     r"^[^;]*: models\.m\.warmup_inputs\.ids\.shape: required, and missing$"),
    ('[models.m]\nfiles = ["m.onnx"]\nwarmup = 1\n'
     'warmup_inputs = { ids = { shape = [1, 8], dtype = "i64" } }\n',
     r"^[^;]*: models\.m\.warmup_inputs\.ids\.dtype: unknown key: did you mean type\? "
     r"expected one of shape, type$"),
    ('[models.m]\nfiles = ["m.onnx"]\nwarmup = 1\n'
     'warmup_inputs = { ids = { shape = [1, 0], type = "i64" } }\n',
     r"^[^;]*: models\.m\.warmup_inputs\.ids\.shape\[1\]: .*greater than or equal to 1"),
    ('[models.m]\nfiles = ["m.onnx"]\nwarmup = 1\nwarmup_inputs = { ids = "1x8:i64" }\n',
     r'^[^;]*: models\.m\.warmup_inputs\.ids: expected a shape \(\[1, 8\]; \[\] for a '
     r'scalar\) or a table \{ shape = \[1, 8\], type = "i64" \} \(got \'1x8:i64\'\)$'),
    ('[models.m]\nfiles = ["m.onnx"]\n[pipelines.p]\nsteps = [{ model = "m" }]\nwarmup = 1\n'
     'warmup_inputs = { x = { shape = [2], type = 64 } }\n',
     r"^[^;]*: pipelines\.p\.warmup_inputs\.x\.type: Input should be a valid string "
     r"\(got 64\)$"),
    ('[models.m]\nfiles = ["m.onnx"]\n[pipelines.p]\nsteps = [{ model = "m" }]\n'
     'warmup = 1.5\n', r"pipelines\.p\.warmup: .*integer"),
    ('[runtime]\nfallback = "gpu:0:1"\n', r"runtime\.fallback"),
    ('[runtime]\nfallback = "cpu"\n[pools.gpu]\nkind = "gpu"\n',
     r"runtime\.fallback: 'cpu' names a device kind no pool serves \(pools: gpu \(gpu\)\)"),
    ('[runtime]\nfallback = "tpu"\n', r"runtime\.fallback: 'tpu' .*\(pools: cpu \(cpu\)\)"),
    ('[models.m]\nfiles = ["../outside.onnx"]\n',
     r"models\.m\.files\[0\]: .*outside the config directory"),
    ('[models.m]\nfiles = ["models/../../x.onnx"]\n', r"outside the config directory"),
    ('[models.m]\nfiles = ["a\\u0000b.onnx"]\n',
     r"models\.m\.files\[0\]: model file 'a\\x00b\.onnx' contains a NUL byte"),
    # Backend names are checked as the file is read (wasinn's own and entry points').
    ('[runtime]\nbackends = ["onnxrutnime"]\n',
     r"runtime\.backends\[0\]: unknown backend 'onnxrutnime': expected one of .*onnxruntime"),
    ('[pools.cpu]\nkind = "cpu"\nbackends = ["openvino", "tensorrt"]\n',
     r"pools\.cpu\.backends\[1\]: unknown backend 'tensorrt': expected one of "),
    ('[models.m]\nfiles = ["m.onnx"]\nbackend = "onnxrutnime"\n',
     r"models\.m\.backend: unknown backend 'onnxrutnime': expected one of .*openvino"),
    ('[models.m]\nfiles = ["m.onnx"]\nprecision = "f3"\n',
     r"models\.m\.precision: precision 'f3' .*expected one of f32, f16, bf16, default, tf32"),
    ('[models.m]\nfiles = ["m.onnx"]\nprecision = 16\n', r"models\.m\.precision: .*string"),
    # Accepted but ignored, before: refused now.
    ('[pools.cpu]\nkind = "cpu"\ndevices = ["cpu:1"]\n',
     r"pools\.cpu\.devices\[0\]: 'cpu:1': there is one CPU device, expected 'cpu'"),
    ('[pools.cpu]\nkind = "cpu"\ndevices = []\n',
     r'pools\.cpu\.devices: no device: expected "auto" or a list such as \["cpu"\]'),
    ('[pools.gpu]\nkind = "gpu"\ndevices = []\n',
     r'pools\.gpu\.devices: no device: expected "auto" or a list such as \["gpu:0"\]'),
    ('[pools.gpu]\nkind = "gpu"\ndevices = ["gpu:1", "gpu:0", "gpu:1"]\n',
     r"pools\.gpu\.devices\[2\]: device 'gpu:1' is listed twice"),
    ('[models.m]\nfiles = ["m.onnx"]\n[pipelines.p]\n'
     'steps = [{ model = "m", wire = { y = "x" } }]\n',
     r"pipelines\.p\.steps\[0\]\.wire: the first step takes the pipeline's own inputs: "
     r"expected no wire"),
    ('[models.m]\nfiles = ["m.onnx"]\noptions = { threads = 2 }\n',
     r"models\.m\.options\.threads: threads is a key of the model's own table"),
    ('[models.m]\nfiles = ["m.onnx"]\noptions = { extra = { NUM_STREAMS = 2 } }\n',
     r"models\.m\.options\.extra: options are already LoadOptions\.extra"),
    ('[models.m]\nfiles = ["m.onnx"]\noptions = { optimize = "false" }\n',
     r"models\.m\.options\.optimize: expected true or false, got 'false'"),
    ('[models.m]\nfiles = ["m.onnx"]\nbackend = "pytorch"\noptions = { interruptible = 1 }\n',
     r"models\.m\.options\.interruptible: expected true or false, got 1"),
    ('[models.m]\nfiles = ["m.onnx"]\nbackend = "openvino"\noptions = { performance_hint = 1 }\n',
     r"models\.m\.options\.performance_hint: backend 'openvino' does not read this option: "
     r"expected OpenVINO property names in capitals"),
    ('[models.m]\nfiles = ["m.onnx"]\nbackend = "onnxruntime"\n'
     'options = { "session.intra_op.allow_spinning" = "0", NUM_STREAMS = 2 }\n',
     r"models\.m\.options\.NUM_STREAMS: backend 'onnxruntime' does not read this option"),
    ('[models.m]\nfiles = ["m.onnx"]\noptions = { bogus = 1 }\n',
     r"models\.m\.options\.bogus: no backend here reads this option: expected a key one of "
     r"them reads \(onnxruntime: .*; openvino: .*; pytorch: .*\)"),
    ('[models.m]\nfiles = [""]\n', r"models\.m\.files\[0\]: an empty file name"),
    ('[models.m]\nfiles = ["m.onnx"]\nthreads = true\n',
     r"models\.m\.threads: Input should be a valid integer \(got True\)"),
    ('[models.m]\nfiles = ["m.onnx"]\nthreads = 100000000000\n',
     r"models\.m\.threads: Input should be less than or equal to 1024"),
    ('[pools.cpu]\nkind = "cpu"\nworkers = true\n',
     r"pools\.cpu\.workers: Input should be a valid integer \(got True\)"),
    ('[models.m]\nfiles = ["m.onnx", "."]\n',
     r"models\.m\.files\[1\]: model file '\.' names the config directory .* itself"),
    ('[models.m]\nfiles = ["m.onnx"]\n[pipelines.m]\nsteps = [{ model = "m" }]\n',
     r"pipelines\.m: 'm' names both a model and a pipeline: expected one$"),
    ('pools = {}\n', r"pools: no pool: .* expected at least one \[pools\.NAME\] table"),
    ('[models.m]\nfiles = ["m.onnx", "n.onnx"]\nencoding = "onnx"\n',
     r"models\.m\.files: 2 files for encoding 'onnx': expected one \.onnx file$"),
    ('[models.m]\nfiles = ["m.xml"]\nencoding = "openvino"\n',
     r"models\.m\.files: one file for encoding 'openvino': expected two: the IR's \.xml, "
     r"then its \.bin weights$"),
    ('[models.m]\nfiles = ["m.bin"]\nencoding = "ggml"\n',
     r"models\.m\.encoding: no backend here reads 'ggml' models: expected one of onnx, "
     r"openvino, pytorch, tensorflow, tensorflowlite \(or autodetect\)$"),
    ('[models.m]\nfiles = ["m.pt"]\nencoding = "pytorch"\nbackend = "onnxruntime"\n',
     r"models\.m\.encoding: backend 'onnxruntime' does not read 'pytorch' models: "
     r"expected onnx$"),
])
def test_bad_configs_name_the_file_the_key_and_the_expectation(
        tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=expected) as info:
        load_config(path)
    assert str(path) in info.value.message
    assert isinstance(info.value, InvalidArgumentError)
    assert "(top level)" not in info.value.message


def test_warmup_inputs_without_warmup_are_warned_about(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Not refused: a config may keep its warm-up shapes with warm-up off (as
    # benchmarks/first_request.py does), but not silently ignored either.
    path = write(tmp_path, '[models.m]\nfiles = ["m.onnx"]\npreload = true\n'
                           'warmup_inputs = { x = [1, 4] }\n[pipelines.p]\n'
                           'steps = [{ model = "m" }]\nwarmup = 1\n'
                           'warmup_inputs = { x = [2, 4] }\n')
    with caplog.at_level("WARNING", logger="wasinn.configs"):
        load_config(path)
    (record,) = caplog.records
    assert record.getMessage() == (
        f"{path}: models.m.warmup_inputs: given, but warmup = 0, so no warm-up run uses "
        "them (warmup >= 1 warms up on these shapes)")


def test_not_toml_and_missing_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[pools.cpu\n"))
    with pytest.raises(NotFoundError) as absent:
        load_config(tmp_path / "absent.toml")
    assert str(absent.value) == f"config file {tmp_path / 'absent.toml'} does not exist"


@pytest.mark.parametrize("name", ["pools.toml", "pipeline.toml", "default.toml"])
def test_a_missing_config_named_as_a_shipped_one_says_where_that_lies(
        tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The README's configs/pools.toml is a checkout's path: an installed wasinn keeps the
    # file in its package, which the error points at (a hint only: nothing is looked up).
    monkeypatch.chdir(tmp_path)
    shipped = packaged_dir() / name
    for given in (tmp_path / "configs" / name, Path(name)):
        with pytest.raises(NotFoundError) as missing:
            load_config(given)
        assert str(missing.value) == (
            f"config file {given.absolute()} does not exist: wasinn ships an example "
            f"{name} at {shipped}: copy it, or pass that path")
    assert load_config(shipped).pools  # the path it gives loads


def test_a_symlink_out_of_the_config_directory_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.onnx").write_bytes(b"x")
    config_dir = tmp_path / "cfg"
    config_dir.mkdir()
    (config_dir / "link.onnx").symlink_to(outside / "secret.onnx")
    with pytest.raises(ConfigError, match="outside the config directory"):
        load_config(write(config_dir, '[models.m]\nfiles = ["link.onnx"]\n'))
    # An absolute path is the config author's explicit choice (documented in the README
    # and the schema): used as given, wherever it points. Guests name no files.
    config = load_config(write(config_dir, f'[models.m]\nfiles = ["{outside / "secret.onnx"}"]\n'))
    assert config.models["m"].files == [str(outside / "secret.onnx")]


def test_an_unknown_backend_is_refused_as_the_config_is_read(tmp_path: Path) -> None:
    # Deliberate change: this was found only at start (then naming no file, and
    # pools.cpu.backends for a typo in [runtime] backends); now load_config refuses it.
    path = write(tmp_path, '[pools.cpu]\nkind = "cpu"\nbackends = ["tensorrt"]\n')
    with pytest.raises(ConfigError, match=r"pools\.cpu\.backends\[0\]: unknown backend "
                                          r"'tensorrt'") as info:
        wasinn.Runtime.from_config(path)
    assert info.value.message.startswith(f"{path}: ")


class NamedBackend(FakeBackend):
    """The fake routing backend under another name, recording the options it is given."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.options: list[LoadOptions | None] = []

    def load(self, builders: Any, encoding: Any, device: Any,
             options: LoadOptions | None = None) -> Any:
        self.options.append(options)
        return super().load(builders, encoding, device, options)


async def test_backends_given_in_code_may_be_named_by_the_config(tmp_path: Path) -> None:
    (tmp_path / "plus.bin").write_bytes(b"fake:add=1")
    text = ('[runtime]\nbackends = ["mine"]\n[models.plus]\nfiles = ["plus.bin"]\n'
            'encoding = "ggml"\nbackend = "mine"\noptions = { my_option = 3 }\n')
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=r"runtime\.backends\[0\]: unknown backend 'mine'"):
        load_config(path)
    assert load_config(path, backends=["mine"]).models["plus"].backend == "mine"
    mine = NamedBackend("mine")
    async with wasinn.Runtime.from_config(path, backends=[mine]) as rt:
        graph = await rt.load_by_name("plus")
        assert (await graph.compute({"x": np.ones((1, 4), np.float32)}))["y"].numpy()[0, 0] == 2
    (options,) = mine.options
    assert options is not None and dict(options.extra) == {"my_option": 3}
    # A config built in code is checked by the Runtime, which knows its backends.
    config = parse_config({"models": {"plus": {"files": ["plus.bin"], "backend": "mine"}}},
                          tmp_path / "code.toml")
    with pytest.raises(ConfigError, match=r"code\.toml: models\.plus\.backend: unknown backend "
                                          r"'mine': expected one of .*onnxruntime"):
        wasinn.Runtime(config)
    wasinn.Runtime(config, backends=[NamedBackend("mine")])


def test_options_are_open_to_a_third_party_backend(tmp_path: Path) -> None:
    # With only wasinn's backends, a key none of them reads is a typo; a third-party
    # backend may read any key.
    path = write(tmp_path, '[models.m]\nfiles = ["m.onnx"]\noptions = { my_option = 1 }\n')
    with pytest.raises(ConfigError, match=r"models\.m\.options\.my_option: no backend here"):
        load_config(path)
    assert load_config(path, backends=["mine"]).models["m"].options == {"my_option": 1}
    config = parse_config({"models": {"m": {"files": ["m.onnx"], "options": {"my_option": 1}}}},
                          None)
    with pytest.raises(ConfigError, match=r"<config>: models\.m\.options\.my_option"):
        wasinn.Runtime(config)
    wasinn.Runtime(config, backends=[NamedBackend("mine")])


def test_what_the_builtin_backends_read_is_accepted(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, '''
[models.a]
files = ["m.onnx"]
precision = " BF16 "
options = { "session.force_spinning_stop" = "0", PERFORMANCE_HINT = "LATENCY", optimize = false }
[models.b]
files = ["m.onnx"]
backend = "onnxruntime"
options = { "session.force_spinning_stop" = "0", provider_options = { gpu_mem_limit = "1" } }
[models.c]
files = ["m.onnx"]
backend = "pytorch"
precision = "default"
options = { optimize = false, interruptible = true }
[models.d]
files = ["m.onnx"]
backend = "onnxruntime"
precision = "TF32"
'''))
    assert [m.precision for m in config.models.values()] == ["bf16", "f32", "default", "tf32"]


async def test_a_bad_precision_given_to_load_is_an_invalid_argument() -> None:
    async with wasinn.Runtime() as rt:
        for options in ({"precision": "f3"}, LoadOptions(precision="fp16")):
            with pytest.raises(InvalidArgumentError, match=r"precision '(f3|fp16)' .*expected one "
                                                           r"of f32, f16, bf16, default, tf32"):
                await rt.load([affine_onnx()], "onnx", options=options)
        for threads in (-1, 100_000_000_000):
            for options in ({"threads": threads}, LoadOptions(threads=threads)):
                with pytest.raises(InvalidArgumentError,
                                   match=f"threads={threads}: expected a thread count from 0 "
                                         r"\(the backend's default\) to 1024"):
                    await rt.load([affine_onnx()], "onnx", options=options)


async def test_bad_load_options_name_the_option(tmp_path: Path) -> None:
    async with wasinn.Runtime() as rt:
        for backend in (None, "openvino"):
            with pytest.raises(InvalidArgumentError,
                               match=r"^options 1: expected an option's name \(a str\), not int"):
                await rt.load([affine_onnx()], "onnx", backend=backend, options={1: 2})
        for value in (None, {"a": 1}):
            with pytest.raises(InvalidArgumentError,
                               match=r"'session.intra_op.allow_spinning': expected a string, "
                                     r"number or boolean"):
                await rt.load([affine_onnx()], "onnx",
                              options={"session.intra_op.allow_spinning": value})
        # A misspelt entry is refused: ONNX Runtime would ignore it without a word.
        with pytest.raises(InvalidArgumentError,
                           match=r"^options 'session.intra_op.allow_spining': ONNX Runtime "
                                 r"reads no session config entry .* such as "
                                 r"'session.intra_op.allow_spinning'$"):
            await rt.load([affine_onnx()], "onnx",
                          options={"session.intra_op.allow_spining": "0"})
        # A boolean is ONNX Runtime's "0" or "1" (str(False) would be "False").
        graph = await rt.load([affine_onnx()], "onnx", backend="onnxruntime",
                              options={"session.intra_op.allow_spinning": False})
        out = await graph.compute({"x": np.ones((1, 4), np.float32)})
        assert out["y"].numpy().tolist() == [[3.0] * 4]
        # numpy integers count as integers
        graph = await rt.load([affine_onnx()], "onnx", options={"threads": np.int64(1)})
        assert graph.inputs[0].name == "x"
    with pytest.raises(ConfigError, match=r"models\.m\.options\.\"session\.force_spining_stop\": "
                                          r"ONNX Runtime reads no session config entry "
                                          r"'session\.force_spining_stop' \(it would ignore it\): "
                                          r"expected one it reads, such as "
                                          r"'session\.force_spinning_stop'"):
        load_config(write(tmp_path, '[models.m]\nfiles = ["m.onnx"]\n'
                                    'options = { "session.force_spining_stop" = "1" }\n'))
    with pytest.raises(ConfigError, match=r"models\.m\.options\.\"session\.x\": expected a "
                                          r"string, number or boolean"):
        load_config(write(tmp_path, '[models.m]\nfiles = ["m.onnx"]\n'
                                    'options = { "session.x" = [1] }\n'))


async def test_openvino_properties_wasinn_sets_itself_are_refused_as_options(
        tmp_path: Path) -> None:
    # Before: INFERENCE_PRECISION_HINT = "bf16" overrode precision = "f16" without a word.
    for key, own in (("INFERENCE_PRECISION_HINT", "precision"),
                     ("INFERENCE_NUM_THREADS", "threads")):
        said = (rf"options\.{key}: wasinn sets this OpenVINO property from the model's "
                rf"'{own}': expected {own} = \.\.\. instead of the option")
        with pytest.raises(ConfigError, match=f"models\\.m\\.{said}"):
            load_config(write(tmp_path, f'[models.m]\nfiles = ["m.onnx"]\n'
                                        f'options = {{ {key} = "1" }}\n'))
        async with wasinn.Runtime() as rt:
            with pytest.raises(InvalidArgumentError, match=f"^options '{key}': "):
                await rt.load([affine_onnx()], "onnx", backend="openvino",
                              options={key: "bf16"})


async def test_load_options_take_backend_options_as_keys_or_under_extra() -> None:
    mine = NamedBackend("mine")
    async with wasinn.Runtime(backends=[mine]) as rt:
        await rt.load([b"fake:add=1"], "ggml", backend="mine",
                      options={"precision": "F16", "a": 1, "extra": {"b": 2}})
    (options,) = mine.options
    assert options is not None and options.precision == "f16"
    assert dict(options.extra) == {"a": 1, "b": 2}


async def test_tf32_is_a_precision_a_load_may_ask_for() -> None:
    mine = NamedBackend("mine")
    async with wasinn.Runtime(backends=[mine]) as rt:
        await rt.load([b"fake:add=1"], "ggml", backend="mine", options={"precision": " TF32 "})
        await rt.load([b"fake:add=1"], "ggml", backend="mine",
                      options=LoadOptions(precision="tf32"))
    assert [o.precision for o in mine.options if o is not None] == ["tf32", "tf32"]


def test_errors_never_dump_a_whole_table(tmp_path: Path) -> None:
    blob = "x" * 5000
    for text in (f'[runtime]\nfallback = "tpu"\n[models.m]\nfiles = ["m.onnx"]\n'
                 f'options = {{ NUM_STREAMS = "{blob}" }}\n',
                 f'[models.m]\nfiles = ["m.onnx"]\noptions = {{ NUM_STREAMS = "{blob}" }}\n'
                 '[pipelines.p]\nsteps = [{ model = "q" }]\n',
                 f'[models.m]\nfiles = ["m.onnx"]\nthreads = "{blob}"\n',
                 '[pools.g]\nkind = "gpu"\ndevices = ["cpu"]\nqueue_limit = 4\n'):
        with pytest.raises(ConfigError) as info:
            load_config(write(tmp_path, text))
        message = info.value.message
        assert "(top level)" not in message and "{" not in message, message
        assert len(message) < len(str(tmp_path)) + 300, message


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
        for wrong in (3, None, b"affine"):
            with pytest.raises(InvalidArgumentError,
                               match=r"^a model's or pipeline's name is a str, not "):
                await rt.load_by_name(wrong)  # type: ignore[arg-type]
        with pytest.raises(NotFoundError) as long:  # quoted, escaped, cut
            await rt.load_by_name("y" * 5_000_000 + "\n")
        assert str(long.value) == (f"no model or pipeline named {'y' * 57 + '...'!r}: "
                                   "registered: affine, absent")


async def test_a_released_registry_model_keeps_its_stats_not_its_bytes(tmp_path: Path) -> None:
    # The registry keeps a released model for model_stats(); its file's bytes (a 200 MB
    # model stayed until the runtime closed) go with the last handle.
    async with wasinn.Runtime.from_config(registry_config(tmp_path)) as rt:
        graph = await rt.load_by_name("affine")
        await graph.compute({"x": np.ones((1, 4), np.float32)})
        (model,) = rt.name_registry.loaded()
        assert sum(len(b) for b in model.builders) > 0  # type: ignore[attr-defined]
        await graph.unload()
        assert model.builders == ()  # type: ignore[attr-defined]
        (stats,) = rt.model_stats()
        assert (stats.name, stats.completed) == ("affine", 1)
        again = await rt.load_by_name("affine")  # a later load reads the file again
        out = await again.compute({"x": np.ones((1, 4), np.float32)})
        assert out["y"].numpy().shape == (1, 4)


@pytest.mark.parametrize(("name", "where"), [
    ("a\n", 'models."a\\n": name \'a\\n\' '),
    ("a\x00b", 'models."a\\u0000b": name \'a\\x00b\' '),
    ("x" * 129, f'models."{"x" * 57}...": name \'{"x" * 57}...\' '),
])
def test_a_bad_name_is_shown_escaped_and_cut_once(name: str, where: str) -> None:
    with pytest.raises(ConfigError) as bad:
        parse_config({"models": {name: {"files": ["m.onnx"]}}}, None)
    message = str(bad.value)
    assert message.startswith(f"<config>: {where}is not a plain identifier")
    assert "\n" not in message and "\0" not in message and "(got" not in message


async def test_a_missing_registered_file_is_not_found_until_it_appears(tmp_path: Path) -> None:
    config = registry_config(tmp_path)
    async with wasinn.Runtime.from_config(config) as rt:
        with pytest.raises(NotFoundError) as missing:
            await rt.load_by_name("absent")
        assert str(missing.value).startswith(  # the file and key that name it
            f"{config}: models.absent: model 'absent' is registered but its file ")
        (tmp_path / "models" / "absent.onnx").mkdir()
        with pytest.raises(NotFoundError, match=r"absent\.onnx' cannot be read: Is a "
                                                r"directory: expected a model file"):
            await rt.load_by_name("absent")
        (tmp_path / "models" / "absent.onnx").rmdir()
        (tmp_path / "models" / "absent.onnx").write_bytes(affine_onnx(1.0, 0.0))
        graph = await rt.load_by_name("absent")
        assert graph.inputs[0].name == "x"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
async def test_a_registered_file_that_is_no_regular_file_is_refused_at_once(
        tmp_path: Path) -> None:
    # Before: a FIFO in a model file's place blocked the load's thread in open() until a
    # writer came (cancellation could not reach it, and the runtime could not close);
    # /dev/zero named by absolute path was read for ever.
    path = registry_config(tmp_path)
    os.mkfifo(tmp_path / "models" / "absent.onnx")
    (tmp_path / "zero.toml").write_text('[models.zero]\nfiles = ["/dev/zero"]\n'
                                        'encoding = "onnx"\n')
    async with wasinn.Runtime.from_config(path) as rt:
        with trio.fail_after(10):
            with pytest.raises(NotFoundError, match=r"absent\.onnx' cannot be read: not a "
                               r"regular file \(a FIFO\): expected a model file"):
                await rt.load_by_name("absent")
    if Path("/dev/zero").exists():
        async with wasinn.Runtime.from_config(tmp_path / "zero.toml") as rt:
            with trio.fail_after(10):
                with pytest.raises(NotFoundError, match=r"not a regular file \(a character "
                                   r"device\)"):
                    await rt.load_by_name("zero")


async def test_a_registered_model_that_will_not_load_is_named_in_the_error(
        tmp_path: Path) -> None:
    # Loaded on first use, long after the config was read: the error says which entry.
    path = registry_config(tmp_path)
    (tmp_path / "models" / "absent.onnx").write_bytes(b"not an onnx model")
    async with wasinn.Runtime.from_config(path) as rt:
        with pytest.raises(wasinn.InvalidEncodingError,
                           match=f"^{re.escape(str(path))}: models.absent: autodetect: 17 bytes "):
            await rt.load_by_name("absent")


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


def test_a_model_file_in_a_symlink_loop_is_read_as_a_missing_one(tmp_path: Path) -> None:
    # Not a ConfigError hiding the whole file: only its model fails, when it loads
    # (tests/test_preloads.py), as for a missing file.
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    config = load_config(write(tmp_path, '[models.m]\nfiles = ["loop/m.onnx"]\n'))
    assert config.models["m"].files == ["loop/m.onnx"]


async def test_a_file_swapped_for_a_symlink_loop_is_not_found(tmp_path: Path) -> None:
    # After the config was read: the load fails as for a missing file (a guest gets
    # model_not_found), not with a raw RuntimeError.
    config_dir = tmp_path / "cfg"
    config_dir.mkdir()
    path = registry_config(config_dir)
    async with wasinn.Runtime.from_config(path) as rt:
        models = config_dir / "models"
        shutil.rmtree(models)
        models.symlink_to(models)
        with pytest.raises(NotFoundError, match="cannot be resolved"):
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


def external_weights_model(folder: Path, location: str = "w.data") -> Path:
    """``y = x @ w`` (x: f32[n, 4], w: f32[4, 8] of 2s) saved as ``folder/ext.onnx`` with
    ``w`` in the external data file ``location`` (relative to ``folder``)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.full((4, 8), 2.0, np.float32), "w")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "ext", [x], [y],
                              initializer=[w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = folder / "ext.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="w.data",
              size_threshold=0)
    if location != "w.data":  # onnx.save refuses some: moved and renamed by hand
        (folder / "w.data").rename(folder / location)
        saved = onnx.load(str(path), load_external_data=False)
        (entry,) = [e for e in saved.graph.initializer[0].external_data if e.key == "location"]
        entry.value = location
        path.write_bytes(saved.SerializeToString())
    return path


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
async def test_a_registered_onnx_model_may_keep_its_weights_in_external_data(
        tmp_path: Path, backend: str) -> None:
    """As a model beyond protobuf's 2 GB must: the config author's files, read from the
    model's own folder; the same bytes from a caller or guest are still refused."""
    from tests.support import require_backend

    require_backend(backend)
    models = tmp_path / "models"
    models.mkdir()
    path = external_weights_model(models)
    write(tmp_path, f'[models.ext]\nfiles = ["models/ext.onnx"]\nbackend = "{backend}"\n')
    async with wasinn.Runtime.from_config(tmp_path / "wasinn.toml") as rt:
        graph = await rt.load_by_name("ext")
        out = await graph.compute({"x": np.ones((1, 4), np.float32)})
        np.testing.assert_array_equal(out["y"].numpy(), np.full((1, 8), 8.0))
        with pytest.raises(SecurityError, match=r"tensor 'w' refers to external data "
                                                r"\(location 'w.data'\).*must embed its weights"):
            await rt.load([path.read_bytes()], "onnx", backend=backend)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="landlock is Linux's")
@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
async def test_a_sandboxed_registered_model_gets_its_external_data_from_the_host(
        tmp_path: Path, backend: str) -> None:
    # Before: UnsupportedOperationError "external data 'w.data': a sandboxed model's
    # process may not read its folder": the confined process read the files itself. The
    # host reads them now and hands their bytes over; the process still may not read
    # the model's folder (landlock).
    from tests.support import no_spares, sandbox_children
    from tests.test_confine import HAS_LANDLOCK

    require_backend(backend)
    if not HAS_LANDLOCK:
        pytest.skip("landlock (Linux 5.13 or later, enabled)")
    models = tmp_path / "models"
    models.mkdir()
    external_weights_model(models)
    entry = f'files = ["models/ext.onnx"]\nbackend = "{backend}"\n'
    config = write(tmp_path, f"[models.ext]\n{entry}sandbox = true\n[models.plain]\n{entry}")
    x = np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)
    async with wasinn.Runtime(no_spares(load_config(config))) as rt:
        plain = await (await rt.load_by_name("plain")).compute({"x": x})
        assert sandbox_children() == []
        sandboxed = await (await rt.load_by_name("ext")).compute({"x": x})
        assert len(sandbox_children()) == 1
        np.testing.assert_array_equal(sandboxed["y"].numpy(), plain["y"].numpy())
        np.testing.assert_allclose(plain["y"].numpy(), x @ np.full((4, 8), 2.0, np.float32),
                                   rtol=1e-6)


@pytest.mark.parametrize(("location", "error", "message"), [
    ("../outside.data", SecurityError, r"keeps its data in '\.\./outside\.data', outside the "
                                       r"model's folder .*: expected a relative path"),
    ("escape.data", SecurityError, r"keeps its data in 'escape\.data', outside the model's"),
    ("missing.data", NotFoundError, r"keeps its data in 'missing\.data', which is no file"),
])
async def test_registered_external_data_stays_in_the_models_folder(
        tmp_path: Path, location: str, error: type[Exception], message: str) -> None:
    from tests.support import require_backend

    require_backend("onnxruntime")
    models = tmp_path / "models"
    models.mkdir()
    path = external_weights_model(models, location)
    data = (models / location).resolve()
    if location == "escape.data":  # a symlink in the folder, leading out of it
        outside = tmp_path / "secret.data"
        data.rename(outside)
        (models / location).symlink_to(outside)
    elif location == "missing.data":
        data.unlink()
    assert path.exists()
    write(tmp_path, '[models.ext]\nfiles = ["models/ext.onnx"]\n')
    async with wasinn.Runtime.from_config(tmp_path / "wasinn.toml") as rt:
        with pytest.raises(error, match=message):
            await rt.load_by_name("ext")


async def test_openvino_refuses_external_data_leading_out_through_dotdot_writing_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # '../models/w.data' ends inside the model's folder once resolved, so the checks let
    # it through (ONNX Runtime, handed the bytes, loads it). Before: OpenVINO's private
    # copy wrote it beside its private directory, into the system's temporary folder
    # (../models/w.data there, left behind), and then refused it.
    import tempfile

    from wasinn import InvalidEncodingError

    require_backend("openvino")
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    models = tmp_path / "models"
    models.mkdir()
    external_weights_model(models, "../models/w.data")
    write(tmp_path, '[models.ext]\nfiles = ["models/ext.onnx"]\nbackend = "openvino"\n')
    async with wasinn.Runtime.from_config(tmp_path / "wasinn.toml") as rt:
        with pytest.raises(InvalidEncodingError, match=(
                r"models\.ext: openvino: cannot read the ONNX model: its external data "
                r"'\.\./models/w\.data' leads out of the model's folder through '\.\.', "
                r"which OpenVINO refuses: expected a path below the folder$")):
            await rt.load_by_name("ext")
    assert list(temporary.iterdir()) == []


def swap_for_a_link_out(path: Path, outside: Path) -> None:
    """Put a symbolic link to ``outside`` where ``path`` is, as another process could
    between a check of the path and its open."""
    os.replace(path, outside)
    path.symlink_to(outside)


async def test_a_model_file_swapped_after_its_check_is_refused_not_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The path is checked, then opened in a thread: what was opened is checked again.
    from wasinn.configs import loader

    require_backend("onnxruntime")
    models = tmp_path / "config" / "models"
    models.mkdir(parents=True)
    (models / "m.onnx").write_bytes(affine_onnx())
    secret = tmp_path / "secret.onnx"
    checked = loader.model_file

    def checked_then_swapped(config: Any, file: str) -> Path:
        path = checked(config, file)
        swap_for_a_link_out(path, secret)
        return path

    config = write(tmp_path / "config", '[models.m]\nfiles = ["models/m.onnx"]\n')
    async with wasinn.Runtime.from_config(config) as rt:
        monkeypatch.setattr(loader, "model_file", checked_then_swapped)
        with pytest.raises(SecurityError, match=r"wasinn\.toml: models\.m: model 'm': its file "
                                                r".*m\.onnx': the file opened is not the one "
                                                r"inside .*config that the path named"):
            await rt.load_by_name("m")


def test_a_file_replaced_between_its_open_and_the_check_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The path then names a file inside, but not the one that was opened.
    from wasinn import files

    (tmp_path / "m.onnx").write_bytes(b"opened")
    (tmp_path / "other.onnx").write_bytes(b"other")
    assert files.read_regular(tmp_path / "m.onnx", inside=tmp_path) == b"opened"
    real_open = os.open

    def open_then_replaced(path: Any, flags: int) -> int:
        fd = real_open(path, flags)
        os.replace(tmp_path / "other.onnx", path)
        return fd

    monkeypatch.setattr(files.os, "open", open_then_replaced)
    with pytest.raises(files.OutsideError, match="the file opened is not the one inside"):
        files.read_regular(tmp_path / "m.onnx", inside=tmp_path)


@pytest.mark.parametrize(("backend", "sandbox"), [("onnxruntime", False), ("openvino", False),
                                                 ("onnxruntime", True), ("openvino", True)])
async def test_external_data_swapped_after_its_check_is_refused_not_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str, sandbox: bool) -> None:
    # The library is handed the bytes the host read, never the path to open itself; a
    # sandboxed model's are read by the host's side of the sandbox.
    require_backend(backend)
    module = importlib.import_module("wasinn.backends." + (
        "_sandbox_external" if sandbox else "onnxruntime" if backend == "onnxruntime"
        else "_ovread"))
    models = tmp_path / "models"
    models.mkdir()
    external_weights_model(models)
    checked = module.check_external_data

    def checked_then_swapped(*args: Any, **kwargs: Any) -> frozenset[str]:
        locations = checked(*args, **kwargs)
        swap_for_a_link_out(models / "w.data", tmp_path / "secret.data")
        return locations

    write(tmp_path, f'[models.ext]\nfiles = ["models/ext.onnx"]\nbackend = "{backend}"\n'
                    f'sandbox = {str(sandbox).lower()}\n')
    async with wasinn.Runtime.from_config(tmp_path / "wasinn.toml") as rt:
        graph = await rt.load_by_name("ext")  # unswapped: read from the model's folder
        out = await graph.compute({"x": np.ones((1, 4), np.float32)})
        np.testing.assert_array_equal(out["y"].numpy(), np.full((1, 8), 8.0))
        await graph.unload()
        monkeypatch.setattr(module, "check_external_data", checked_then_swapped)
        with pytest.raises(SecurityError, match=rf"models\.ext: {backend}: external data "
                                                r"'w\.data': the file opened is not the one "
                                                r"inside .*models that the path named"):
            await rt.load_by_name("ext")


async def test_options_the_chosen_backend_does_not_read_are_said_to_be_ignored(
        caplog: pytest.LogCaptureFixture) -> None:
    # A model that names no backend may carry another backend's options (the config
    # takes a key some backend here reads); the one chosen leaves them unread: say so.
    require_backend("onnxruntime")
    require_backend("openvino")
    async with wasinn.Runtime() as rt:
        with caplog.at_level(logging.WARNING, logger="wasinn.scheduler"):
            await rt.load([affine_onnx()], "onnx", name="aff",
                          options={"PERFORMANCE_HNT": "LATENCY", "session.use_env_allocators": "0"})
    assert [r.getMessage() for r in caplog.records] == [
        "aff runs on onnxruntime, which does not read option(s) PERFORMANCE_HNT: they are "
        "ignored (onnxruntime reads session config entries (\"session.NAME\", "
        "\"optimization.NAME\", \"mlas.NAME\", \"ep.NAME\") or provider_options)"]
