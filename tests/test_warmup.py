"""Preloading and warm-up at the runtime's start: registered models and pipelines marked
``preload``/``warmup`` are compiled on every device of their target and run on zero-filled
inputs before ``start`` returns; a failure fails the start, naming the model."""

from __future__ import annotations

import re
import shutil
import threading
from pathlib import Path

import numpy as np
import psutil
import pytest
from onnx import TensorProto, helper

import wasinn
from tests.backend_models import scalar_onnx, scripted
from tests.fake_backend import FakeBackend
from tests.support import require_backend, sandbox_children
from tests.test_batching import device_busy
from wasinn import (
    BackendRuntimeError,
    InvalidArgumentError,
    NotFoundError,
    TensorType,
    TooLargeError,
)
from wasinn.backends import TensorSpec
from wasinn.configs.loader import load_config
from wasinn.modelgen import ModelFiles, affine_onnx, sample_image
from wasinn.scheduler.warmup import ZeroInput, zero_inputs

X = np.ones((1, 4), np.float32)


def write_config(directory: Path, text: str) -> Path:
    models = directory / "models"
    models.mkdir(exist_ok=True)
    (models / "affine.onnx").write_bytes(affine_onnx(2.0, 1.0))
    (models / "then.onnx").write_bytes(affine_onnx(10.0, 0.0, in_name="y", out_name="z"))
    path = directory / "wasinn.toml"
    path.write_text(text)
    return path


def chain_config(directory: Path, pipeline: str, *, affine: str = "") -> Path:
    """Models ``affine`` (y = 2x + 1, with the ``affine`` lines) and ``then`` (z = 10y),
    and pipeline ``chain`` of both with the ``pipeline`` lines, on the default pools."""
    return write_config(directory, f'''
[models.affine]
files = ["models/affine.onnx"]
{affine}
[models.then]
files = ["models/then.onnx"]
[pipelines.chain]
steps = [{{ model = "affine" }}, {{ model = "then" }}]
{pipeline}''')


def memory_available(monkeypatch: pytest.MonkeyPatch, nbytes: int) -> None:
    """Make psutil read ``nbytes`` as the memory available now (the rest as it is)."""
    reading = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: reading._replace(available=nbytes))


def worker_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("wasinn ")]


async def refused_start(path: Path, error: type[Exception], match: str) -> None:
    """Starting the runtime of the config at ``path`` raises ``error`` matching ``match``,
    and closes the runtime again: no worker thread is left."""
    with pytest.raises(error, match=match):
        async with wasinn.Runtime.from_config(path):
            pytest.fail("the runtime started although its preloading failed")
    assert worker_threads() == []


async def test_a_preloaded_model_is_compiled_before_start_returns(tmp_path: Path) -> None:
    path = write_config(tmp_path, '[models.affine]\nfiles = ["models/affine.onnx"]\n'
                                  'preload = true\n')
    async with wasinn.Runtime.from_config(path) as rt:
        (actor,) = rt.actors
        assert rt.name_registry.loads == {"affine": 1}
        assert (actor.stats().graphs, actor.stats().compiles) == (1, 1)
        graph = await rt.load_by_name("affine")
        assert (await graph.compute({"x": X}))["y"].numpy().tolist() == [[3.0] * 4]
        await graph.unload()
        # Preloaded means resident: nothing is loaded or compiled again.
        again = await rt.load_by_name("affine")
        assert rt.name_registry.loads == {"affine": 1}
        assert actor.stats().compiles == 1
        await again.unload()
        assert actor.stats().graphs == 1


async def test_warm_up_runs_are_done_at_start_and_are_not_requests(tmp_path: Path) -> None:
    path = write_config(tmp_path, '[models.affine]\nfiles = ["models/affine.onnx"]\n'
                                  'warmup = 3\n')  # implies preload
    async with wasinn.Runtime.from_config(path) as rt:
        (actor,) = rt.actors
        stats = actor.stats()
        assert (stats.warm_ups, stats.compiles) == (3, 1)
        assert (stats.finished, stats.latency_window) == (0, 0)  # no request yet
        # The compile and the three runs, in its compile thread: none in a worker thread.
        assert (actor.compiler.finished, actor.threads.finished) == (4, 0)
        assert "3 warm-up run(s)" in stats.describe()
        graph = await rt.load_by_name("affine")
        assert (await graph.compute({"x": X}))["y"].numpy().tolist() == [[3.0] * 4]
        assert (actor.stats().completed, actor.stats().warm_ups) == (1, 3)


async def test_every_device_of_the_target_is_compiled_and_warmed(tmp_path: Path) -> None:
    # Routing on GPUs this machine lacks: the fake backend records what ran where.
    (tmp_path / "fake.bin").write_bytes(b"fake:add=1")
    path = tmp_path / "wasinn.toml"
    path.write_text('''
[pools.cpu]
kind = "cpu"
backends = ["fake"]
[pools.gpu]
kind = "gpu"
devices = "auto"
backends = ["fake"]
[models.plus]
files = ["fake.bin"]
encoding = "ggml"
target = "gpu"
warmup = 2
''')
    fake = FakeBackend()
    # A config naming a backend given in code says so when read (deliberate change:
    # load_config refuses backend names it does not know).
    async with wasinn.Runtime(load_config(path, backends=["fake"]), backends=[fake]) as rt:
        assert sorted(fake.loads) == ["gpu:0", "gpu:1"]
        assert sorted(fake.runs) == [("gpu:0", 0.0)] * 2 + [("gpu:1", 0.0)] * 2
        warmed = {s.device: (s.warm_ups, s.compiles, s.finished) for s in rt.stats()}
        assert warmed == {"cpu": (0, 0, 0), "gpu:0": (2, 1, 0), "gpu:1": (2, 1, 0)}


async def test_a_preloaded_pipeline_compiles_its_steps_and_warms_the_chain(
        tmp_path: Path) -> None:
    path = chain_config(tmp_path, "warmup = 1")
    async with wasinn.Runtime.from_config(path) as rt:
        (actor,) = rt.actors
        assert rt.name_registry.loads == {"affine": 1, "then": 1, "chain": 1}
        stats = actor.stats()
        assert (stats.graphs, stats.compiles, stats.warm_ups, stats.finished) == (2, 2, 1, 0)
        chain = await rt.load_by_name("chain")
        assert (await chain.compute({"x": X}))["z"].numpy().tolist() == [[30.0] * 4]
        await chain.unload()
        assert actor.stats().graphs == 2  # kept for the runtime's lifetime


async def test_a_missing_preloaded_file_fails_the_start_naming_the_model(
        tmp_path: Path) -> None:
    path = write_config(tmp_path, '''
[models.affine]
files = ["models/affine.onnx"]
preload = true
[models.absent]
files = ["models/absent.onnx"]
preload = true
''')
    await refused_start(path, NotFoundError, r"preloading 'absent': .*absent\.onnx")


def reshape_to_three_rows() -> bytes:
    """``x: f32[n, 4]`` reshaped to ``[3, 4]``: valid for n = 3 only, so the warm-up's
    zero input (dynamic dimensions as 1) makes ONNX Runtime fail."""
    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [3, 4])
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])
    graph = helper.make_graph([helper.make_node("Reshape", ["x", "shape"], ["y"])],
                              "three_rows", [x], [y], initializer=[shape])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


async def test_a_failing_warm_up_fails_the_start_with_the_backend_message(
        tmp_path: Path) -> None:
    (tmp_path / "three.onnx").write_bytes(reshape_to_three_rows())
    path = tmp_path / "wasinn.toml"
    model = '[models.three]\nfiles = ["three.onnx"]\nwarmup = 1\n'
    path.write_text(model)
    await refused_start(path, BackendRuntimeError,
                        r"preloading 'three': cpu: the warm-up run on zero-filled inputs "
                        r"\(x: f32\[1, 4\]; dynamic dimensions as 1 unless warmup_inputs "
                        r"gives them\) failed: .*[Rr]eshape")
    # The shape the model needs, given in the config:
    path.write_text(model + "warmup_inputs = { x = [3, 4] }\n")
    async with wasinn.Runtime.from_config(path) as rt:
        assert rt.stats()[0].warm_ups == 1


@pytest.mark.parametrize("given", ["", "warmup_inputs = { x = [2, 4] }"],
                         ids=["model-shapes", "warmup_inputs"])
async def test_a_pipelines_failing_warm_up_names_its_step_and_where_the_shapes_were_given(
        tmp_path: Path, given: str) -> None:
    # Step 0 (affine) takes any rows; step 1 (three) only 3, fed by step 0: its failure
    # is told as a request's is, and where warmup_inputs gave the shapes, that key too.
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "three.onnx").write_bytes(reshape_to_three_rows())
    path = write_config(tmp_path, f'''
[models.affine]
files = ["models/affine.onnx"]
[models.three]
files = ["models/three.onnx"]
[pipelines.chain]
steps = [{{ model = "affine" }}, {{ model = "three" }}]
warmup = 1
{given}''')
    where = rf"{re.escape(str(path))}: pipelines\.chain\.warmup_inputs: " if given else ""
    rows = 2 if given else 1
    await refused_start(path, BackendRuntimeError,
                        rf"^preloading 'chain': {where}cpu: the warm-up run on zero-filled "
                        rf"inputs \(x: f32\[{rows}, 4\]; dynamic dimensions as 1 unless "
                        r"warmup_inputs gives them\) failed: pipeline 'chain' step 1 "
                        r"\('three', fed by step 0\): onnxruntime: .*[Rr]eshape")
    # The rows step 1 needs, given in the config:
    path.write_text(path.read_text().replace(given, "") + "warmup_inputs = { x = [3, 4] }\n")
    async with wasinn.Runtime.from_config(path) as rt:
        assert rt.stats()[0].warm_ups == 1


def warmed_on(directory: Path, shape: str) -> Path:
    """Model ``a`` (affine, x: f32[?, 4]) warmed up once on an x of ``shape`` (TOML)."""
    return write_config(directory, '[models.a]\nfiles = ["models/affine.onnx"]\nwarmup = 1\n'
                                   f"warmup_inputs = {{ x = {shape} }}\n")


@pytest.mark.parametrize("rows", [10**12, 10**20], ids=["beyond-memory", "beyond-numpy"])
async def test_a_warm_up_shape_too_large_to_allocate_fails_the_start_naming_it(
        tmp_path: Path, rows: int) -> None:
    await refused_start(warmed_on(tmp_path, f"[{rows}, 4]"), TooLargeError,
                        rf"preloading 'a': .*: models\.a\.warmup_inputs: input 'x': a "
                        rf"zero-filled f32 value of shape "
                        rf"\[{rows}, 4\] takes {rows * 16:,} bytes, which cannot be "
                        rf"allocated here \([0-9,]+ bytes of memory are available now\): "
                        rf"expected a smaller shape$")


async def test_a_warm_up_shape_beyond_the_memory_available_fails_the_start_unallocated(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Where the kernel overcommits (a VM), np.zeros of 16 TB succeeds, mapping pages it
    # has not got, and the backend touching them got the process killed: the size is
    # checked against the memory available first. 1.6 MB, which np.zeros allocates
    # anywhere, against 1 MiB:
    memory_available(monkeypatch, 2**20)
    await refused_start(warmed_on(tmp_path, "[100000, 4]"), TooLargeError,
                        r"preloading 'a': .*: models\.a\.warmup_inputs: input 'x': a "
                        r"zero-filled f32 value of shape \[100000, 4\] takes 1,600,000 "
                        r"bytes, which cannot be allocated here \(1,048,576 bytes of memory "
                        r"are available now\): expected a smaller shape$")
    memory_available(monkeypatch, 1_600_000)  # (as much as it takes will do)
    async with wasinn.Runtime.from_config(warmed_on(tmp_path, "[100000, 4]")) as rt:
        assert rt.stats()[0].warm_ups == 1


def test_zero_inputs_that_together_take_more_than_the_memory_available_are_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Zeros are mapped lazily: making one does not lower the reading, so the inputs
    # made before one count against it.
    specs = [TensorSpec("a", TensorType.F32, (None, 4)), TensorSpec("b", TensorType.I64, (None,))]
    memory_available(monkeypatch, 1_000_000)
    assert zero_inputs(specs, {"a": (50_000, 4), "b": (25_000,)})["b"].dims == (25_000,)
    with pytest.raises(TooLargeError,
                       match=r"^input 'b': a zero-filled i64 value of shape \[25001\] takes "
                             r"200,008 bytes, which cannot be allocated here \(1,000,000 "
                             r"bytes of memory are available now, 800,000 of them taken by "
                             r"the zero-filled inputs before it\): expected a smaller shape$"):
        zero_inputs(specs, {"a": (50_000, 4), "b": (25_001,)})


def test_a_zero_input_beyond_numpys_bounds_is_refused_whatever_the_memory_reads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The memory check comes first; numpy's own refusal stays as a backstop (as does
    # MemoryError, where a limit such as RLIMIT_AS refuses the mapping).
    memory_available(monkeypatch, 10**30)
    with pytest.raises(TooLargeError,
                       match=r"^input 'x': a zero-filled f32 value of shape \[10{20}, 4\] "
                             r"takes [0-9,]+ bytes, which cannot be allocated here "
                             r"\((?!.*memory are available).+\): expected a smaller shape$"):
        zero_inputs([TensorSpec("x", TensorType.F32, (None, 4))], {"x": (10**20, 4)})


async def test_an_undeclared_input_shape_is_given_in_warmup_inputs(
        tmp_path: Path, small_mobilenet: ModelFiles) -> None:
    require_backend("torch")
    shutil.copy(small_mobilenet.torchscript, tmp_path / "net.pt")
    path = tmp_path / "wasinn.toml"
    model = '[models.net]\nfiles = ["net.pt"]\nencoding = "pytorch"\nwarmup = 1\n'
    path.write_text(model)  # TorchScript declares no input shapes
    await refused_start(path, InvalidArgumentError,
                        r"preloading 'net': .*wasinn\.toml: models\.net\.warmup_inputs: "
                        r"input 'x' declares no shape, .*warmup_inputs")
    path.write_text(model + "warmup_inputs = { image = [1, 3, 224, 224] }\n")
    await refused_start(path, InvalidArgumentError,
                        r"preloading 'net': .*wasinn\.toml: models\.net\.warmup_inputs: "
                        r"warmup_inputs names 'image', which is not an input: .*'x'")
    path.write_text(model + "warmup_inputs = { x = [2, 3, 224, 224] }\n")
    async with wasinn.Runtime.from_config(path) as rt:
        (actor,) = rt.actors
        assert actor.stats().warm_ups == 1
        graph = await rt.load_by_name("net")
        out = await graph.compute({"x": sample_image(0)})
        assert out[graph.outputs[0].name].dims == (1, 1000)


@pytest.mark.parametrize("given", ["", "warmup_inputs = { x = [] }\n"],
                         ids=["declared", "warmup_inputs"])
async def test_a_scalar_input_is_warmed_up_on_a_scalar(tmp_path: Path, given: str) -> None:
    (tmp_path / "scalar.onnx").write_bytes(scalar_onnx(2.0))
    path = tmp_path / "wasinn.toml"
    path.write_text('[models.scalar]\nfiles = ["scalar.onnx"]\nwarmup = 1\n' + given)
    async with wasinn.Runtime.from_config(path) as rt:
        (actor,) = rt.actors
        assert actor.stats().warm_ups == 1
        graph = await rt.load_by_name("scalar")
        y = (await graph.compute({"x": np.array(3.0, np.float32)}))["y"]
        assert y.dims == () and float(y.numpy()) == 6.0


def test_zero_inputs_are_rank_0_for_a_scalar_and_refused_for_an_unknown_rank() -> None:
    specs = [TensorSpec("s", TensorType.I64, ()), TensorSpec("v", TensorType.F32, (None, 2))]
    zeros = zero_inputs(specs, {})
    assert (zeros["s"].dims, zeros["s"].type, zeros["s"].numpy().shape) == ((), TensorType.I64, ())
    assert zeros["v"].dims == (1, 2)
    unknown = [TensorSpec("u", TensorType.F32, (), rank_known=False)]
    with pytest.raises(InvalidArgumentError,
                       match=r"input 'u' declares no shape, not even its rank, .*warmup_inputs "
                             r"\(e\.g\. u = \[1, 3, 224, 224\]\)"):
        zero_inputs(unknown, {})
    assert zero_inputs(unknown, {"u": (2, 3)})["u"].dims == (2, 3)
    assert zero_inputs(unknown, {"u": ()})["u"].dims == ()


def test_a_zero_input_has_the_least_size_a_bounded_dimension_allows() -> None:
    bounded = TensorSpec("x", TensorType.F32, (None, None, 3), bounds=((2, 8), (0, 4), (3, 3)))
    assert zero_inputs([bounded], {})["x"].dims == (2, 1, 3)


@pytest.mark.parametrize("sandbox", [False, True])
async def test_a_model_whose_dimension_is_bounded_above_1_warms_up(
        tmp_path: Path, sandbox: bool) -> None:
    # Before: its zeros had 1 row, which the model's [2..8, 3] refuses: the start failed.
    # (And a sandboxed graph's process sent no bounds, so its spec said ? and it failed so.)
    require_backend("openvino")
    import openvino as ov

    from tests.test_openvino_edges import _relu_ir

    xml, weights = _relu_ir(ov.PartialShape([ov.Dimension(2, 8), 3]))
    (tmp_path / "relu.xml").write_bytes(xml)
    (tmp_path / "relu.bin").write_bytes(weights)
    path = tmp_path / "wasinn.toml"
    path.write_text('[models.relu]\nfiles = ["relu.xml", "relu.bin"]\nencoding = "openvino"\n'
                    f'warmup = 1\nsandbox = {str(sandbox).lower()}\n')
    async with wasinn.Runtime.from_config(path) as rt:
        graph = await rt.load_by_name("relu")
        assert graph.inputs[0].describe() == "x: f32[2..8, 3]"
        if sandbox:  # (its graph runs in a process of its own)
            assert sandbox_children()
        assert graph.stats().completed == 0  # (a warm-up is no request)
        out = await graph.compute({"x": -np.ones((2, 3), np.float32)})
        assert out["y"].numpy().tolist() == [[0.0] * 3] * 2


async def test_a_torch_export_model_warms_up_at_the_least_size_it_was_exported_for(
        tmp_path: Path) -> None:
    # Before: its zeros had 1 row, which Dim("n", min=4) refuses: the start failed.
    require_backend("torch")
    import torch

    class Double(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    n = torch.export.Dim("n", min=4, max=16)
    torch.export.save(torch.export.export(Double(), (torch.ones(5, 3),),
                                          dynamic_shapes={"x": {0: n}}), tmp_path / "m.pt2")
    path = tmp_path / "wasinn.toml"
    path.write_text('[models.m]\nfiles = ["m.pt2"]\nencoding = "pytorch"\nwarmup = 1\n')
    async with wasinn.Runtime.from_config(path) as rt:
        graph = await rt.load_by_name("m")
        assert graph.inputs[0].describe() == "x: f32[4..16, 3]"
        out = await graph.compute({"x": np.ones((4, 3), np.float32)})
        assert out["output"].numpy().tolist() == [[2.0] * 3] * 4


class _OwnError(BackendRuntimeError):
    """A backend's own error whose constructor takes other arguments."""

    def __init__(self, op: str, status: int) -> None:
        super().__init__(f"{op} failed with status {status}")
        self.status = status


class _FailingBackend(FakeBackend):
    def load(self, *args: object, **kwargs: object) -> object:  # type: ignore[override]
        raise _OwnError("load", 7)


def own_error_config(directory: Path, preload: bool) -> wasinn.configs.schema.RuntimeConfig:
    (directory / "fake.bin").write_bytes(b"fake:add=1")
    path = directory / "wasinn.toml"
    path.write_text(f'''
[pools.cpu]
kind = "cpu"
backends = ["fake"]
[models.m]
files = ["fake.bin"]
encoding = "ggml"
preload = {str(preload).lower()}
''')
    return load_config(path, backends=["fake"])


async def test_a_backends_own_error_reaches_every_caller_as_itself(tmp_path: Path) -> None:
    # Before: callers sharing the failed load, and a failed preload, got a TypeError from
    # type(error)(message) instead of the backend's error.
    import trio

    errors: list[BaseException] = []

    async def load() -> None:
        try:
            await rt.load_by_name("m")
        except BaseException as exc:
            errors.append(exc)

    async with wasinn.Runtime(own_error_config(tmp_path, False),
                              backends=[_FailingBackend()]) as rt, trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(load)
    assert len(errors) == 3 and all(type(e) is _OwnError for e in errors), errors
    assert {e.status for e in errors} == {7}  # type: ignore[attr-defined]
    with pytest.raises(_OwnError, match=r"^preloading 'm': .*wasinn\.toml: models\.m: load "
                                        r"failed with status 7$"):
        async with wasinn.Runtime(own_error_config(tmp_path, True),
                                  backends=[_FailingBackend()]):
            pass


async def test_warm_ups_of_batching_entries_run_alone_and_batching_works_after(
        tmp_path: Path) -> None:
    # Warm-ups are not requests: they never form or join a batch, whatever the rows
    # given in warmup_inputs, and the first requests batch as usual.
    path = chain_config(tmp_path, "warmup = 1\nwarmup_inputs = { x = [4, 4] }\n"
                                  "batching = { max_batch = 4, max_delay_ms = 1 }",
                        affine="warmup = 2\nbatching = { max_batch = 4 }")
    async with wasinn.Runtime.from_config(path) as rt:
        (actor,) = rt.actors
        stats = actor.stats()
        assert (stats.warm_ups, stats.finished, stats.batches, stats.running) == (3, 0, 0, 0)
        chain = await rt.load_by_name("chain")
        results: dict[int, np.ndarray] = {}

        async def call(i: int) -> None:
            results[i] = (await chain.compute({"x": i * X}))["z"].numpy()

        async with device_busy(actor) as nursery:
            for i in range(3):
                nursery.start_soon(call, i)
        for i in range(3):
            np.testing.assert_allclose(results[i], 10 * (2 * i * X + 1))
        assert (chain.stats().batches, chain.stats().batched) == (1, 3)
        assert actor.stats().warm_ups == 3


@pytest.mark.parametrize(("shape", "given"), [("[1, 5]", r"x: f32\[1, 5\]"),
                                              ("[4]", r"x: f32\[4\]")])
async def test_warmup_inputs_that_do_not_fit_the_model_fail_the_start_saying_so(
        tmp_path: Path, shape: str, given: str) -> None:
    path = warmed_on(tmp_path, shape)
    await refused_start(path, InvalidArgumentError,
                        rf"^preloading 'a': {re.escape(str(path))}: models\.a\.warmup_inputs: "
                        rf"cpu: the warm-up run on zero-filled inputs "
                        rf"\({given}; .*\) failed: onnxruntime: input 'x' has shape "
                        rf".* but the model expects x: f32\[\?, 4\]$")


async def test_a_pipelines_warmup_inputs_name_its_own_inputs_only(tmp_path: Path) -> None:
    # 'y' is an input of the second step, fed by the first: not the pipeline's.
    path = chain_config(tmp_path, "warmup = 1\nwarmup_inputs = { y = [2, 4] }")
    await refused_start(path, InvalidArgumentError,
                        r"^preloading 'chain': .*: pipelines\.chain\.warmup_inputs: "
                        r"warmup_inputs names 'y', which is not an "
                        r"input: expected one of 'x'$")


async def test_a_failed_warm_up_leaves_nothing_behind_and_names_the_first_failure(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Every entry is readied at once; the start fails with the first failure in config
    # order, the others are logged, and nothing is left running or registered.
    (tmp_path / "three.onnx").write_bytes(reshape_to_three_rows())
    path = write_config(tmp_path, '''
[models.fine]
files = ["models/affine.onnx"]
warmup = 1
[models.three]
files = ["../three.onnx"]
warmup = 1
[models.absent]
files = ["models/absent.onnx"]
preload = true
''')
    path.write_text(path.read_text().replace("../three.onnx", str(tmp_path / "three.onnx")))
    runtime = wasinn.Runtime.from_config(path)
    with pytest.raises(BackendRuntimeError, match=r"^preloading 'three': cpu: the warm-up"):
        await runtime.start()
    assert "preloading 'absent' failed too" in caplog.text
    assert worker_threads() == []
    assert runtime.name_registry.loaded() == []
    with pytest.raises(wasinn.ClosedResourceError, match="closed"):
        await runtime.load_by_name("fine")
    assert [s.warm_ups for s in runtime.stats()] == [1]  # the final figures: fine's run


def token_model(kind: str) -> bytes:
    """A TorchScript module (which declares no input types) that takes ``kind`` values
    only: "i64" token ids (an embedding lookup into 10 rows of 3) or "u8" bytes (their
    bitwise not); f32 zeros make either fail."""
    import torch

    class Embedding(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.nn.Embedding(10, 3)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.table(ids)

    class Invert(torch.nn.Module):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return torch.bitwise_not(ids)

    return scripted(Embedding() if kind == "i64" else Invert())


def token_config(directory: Path, kind: str, inputs: str) -> Path:
    """Model ``tokens`` (:func:`token_model`), warmed up once with these ``inputs``
    lines."""
    (directory / "tokens.pt").write_bytes(token_model(kind))
    path = directory / "wasinn.toml"
    path.write_text('[models.tokens]\nfiles = ["tokens.pt"]\nencoding = "pytorch"\n'
                    f"warmup = 1\n{inputs}")
    return path


@pytest.mark.parametrize("inputs", [
    'warmup_inputs = {{ ids = {{ shape = [2, 8], type = "{kind}" }} }}\n',
    '[models.tokens.warmup_inputs.ids]\nshape = [2, 8]\ntype = "{kind}"\n',  # as a table
    'warmup_inputs = {{ ids = {{ shape = [2, 8], type = "{upper}" }} }}\n',  # any case
], ids=["inline", "table", "upper-case"])
@pytest.mark.parametrize("kind", ["i64", "u8"])
async def test_a_torchscript_model_of_token_ids_is_warmed_up_on_the_type_given(
        tmp_path: Path, inputs: str, kind: str) -> None:
    require_backend("torch")
    path = token_config(tmp_path, kind, inputs.format(kind=kind, upper=kind.upper()))
    async with wasinn.Runtime.from_config(path) as rt:
        (actor,) = rt.actors
        assert actor.stats().warm_ups == 1
        graph = await rt.load_by_name("tokens")
        ids = np.array([[1, 2, 3]], np.int64 if kind == "i64" else np.uint8)
        out = (await graph.compute({"ids": ids}))[graph.outputs[0].name].numpy()
        assert out.shape == ((1, 3, 3) if kind == "i64" else (1, 3))


@pytest.mark.parametrize(("kind", "shape"), [("i64", "[2, 8]"), ("u8", "[5]")])
async def test_a_warm_up_failing_on_f32_zeros_of_an_undeclared_type_says_how_to_give_one(
        tmp_path: Path, kind: str, shape: str) -> None:
    require_backend("torch")
    path = token_config(tmp_path, kind, f"warmup_inputs = {{ ids = {shape} }}\n")
    await refused_start(
        path, InvalidArgumentError,
        rf"^preloading 'tokens': {re.escape(str(path))}: models\.tokens\.warmup_inputs: "
        rf"cpu: the warm-up run on zero-filled inputs "
        rf"\(ids: f32{re.escape(shape)}; .*\) failed: pytorch: the TorchScript model rejected "
        rf"its inputs .*; the model declares no element type for input 'ids', so its zeros "
        rf"were f32: if it takes another type, give it in warmup_inputs \(e\.g\. ids = "
        rf'\{{ shape = {re.escape(shape)}, type = "i64" \}}\)$')


async def test_a_type_the_model_declares_otherwise_fails_the_start_naming_both(
        tmp_path: Path) -> None:
    # The affine model declares x: f32[?, 4]: i64 zeros would only fail in the backend.
    path = warmed_on(tmp_path, '{ shape = [2, 4], type = "i64" }')
    await refused_start(path, InvalidArgumentError,
                        rf"^preloading 'a': {re.escape(str(path))}: models\.a\.warmup_inputs: "
                        r"input 'x': type i64 given, but the model declares x: f32\[\?, 4\]: "
                        r"expected f32, or no type \(the model's\)$")
    # The type it declares may be given (written as a table or not, the same warm-up).
    for given in ('{ shape = [2, 4], type = "f32" }', "{ shape = [2, 4] }", "[2, 4]"):
        async with wasinn.Runtime.from_config(warmed_on(tmp_path, given)) as rt:
            assert rt.stats()[0].warm_ups == 1


def test_zero_inputs_are_of_the_type_given_where_the_model_declares_none() -> None:
    specs = [TensorSpec("ids", TensorType.F32, (), rank_known=False, type_known=False),
             TensorSpec("mask", TensorType.U8, (None, 8))]
    zeros = zero_inputs(specs, {"ids": ZeroInput((2, 8), TensorType.I64),
                                "mask": ZeroInput(None, TensorType.U8)})
    assert [(t.type, t.dims) for t in zeros.values()] == [(TensorType.I64, (2, 8)),
                                                          (TensorType.U8, (1, 8))]
    assert zero_inputs(specs, {"ids": (3,)})["ids"].type is TensorType.F32  # (the default)
    with pytest.raises(InvalidArgumentError,
                       match=r"^input 'mask': type i32 given, but the model declares mask: "
                             r"u8\[\?, 8\]: expected u8, or no type \(the model's\)$"):
        zero_inputs(specs, {"ids": (3,), "mask": ZeroInput((1, 8), TensorType.I32)})
