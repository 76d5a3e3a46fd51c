"""PyTorch specifics: TorchScript naming, torch.export specs, torch natives, CUDA."""

from __future__ import annotations

import io
import threading
from typing import Any

import numpy as np
import pytest

import wasinn
from tests import backend_models
from tests.backend_models import scripted
from tests.support import require_backend, require_gpu
from wasinn import (
    GraphEncoding,
    InvalidArgumentError,
    Tensor,
    TensorType,
    UnsupportedOperationError,
)
from wasinn.backends import Device, LoadOptions
from wasinn.modelgen import ModelFiles, sample_image

pytestmark = pytest.mark.usefixtures("_torch")

CPU = Device.parse("cpu")
PT = GraphEncoding.PYTORCH


@pytest.fixture
def _torch() -> None:
    require_backend("torch")


@pytest.fixture
def backend() -> Any:
    from wasinn.backends.pytorch import TorchBackend

    return TorchBackend()


def _pair_module() -> Any:
    import torch

    class Pair(torch.nn.Module):
        def forward(self, image: torch.Tensor, offset: torch.Tensor, scale: float = 2.0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
            return image * scale + offset, image.sum(dim=1)

    return Pair()


def test_torchscript_names_come_from_forward(backend: Any) -> None:
    graph = backend.load([scripted(_pair_module())], PT, CPU)
    assert [s.name for s in graph.inputs] == ["image", "offset"]  # self and scale skipped
    assert [s.name for s in graph.outputs] == ["output_0", "output_1"]
    image = Tensor.from_numpy(np.ones((2, 3), np.float32))
    offset = Tensor.from_numpy(np.full((2, 3), 0.5, np.float32))
    by_name = graph.run({"image": image, "offset": offset})
    np.testing.assert_allclose(by_name["output_0"].numpy(), np.full((2, 3), 2.5))
    np.testing.assert_allclose(by_name["output_1"].numpy(), [3.0, 3.0])
    by_index = graph.run({0: image, 1: offset}, outputs=["output_1"])
    assert list(by_index) == ["output_1"]


def test_torchscript_specs_have_an_unknown_rank_not_rank_0(backend: Any) -> None:
    graph = backend.load([scripted(_pair_module())], PT, CPU)
    specs = (*graph.inputs, *graph.outputs)
    assert [(s.shape, s.rank_known) for s in specs] == [((), False)] * 4
    # ...and no element type: their f32 is a placeholder (before, described as f32[...]).
    assert [s.type_known for s in specs] == [False] * 4
    assert [s.describe() for s in graph.inputs] == ["image: any[...]", "offset: any[...]"]
    scalar = Tensor.from_numpy(np.float32(1))  # any rank goes through: here, rank 0
    out = graph.run({"image": Tensor.from_numpy(np.ones((2, 3), np.float32)), "offset": scalar})
    assert out["output_0"].dims == (2, 3)


def _argmax_module() -> Any:
    import torch

    class Argmax(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.argmax(dim=1)

    return Argmax()


async def test_a_torchscript_output_declares_no_type_and_a_typed_buffer_is_checked_at_the_run(
        ) -> None:
    # Before, g.outputs said output: f32[...] for this i64 output, and a caller sizing a
    # typed buffer from it had it refused at the run. A typed buffer is taken at
    # set_output whatever its dtype; the run fills one of the output's type and refuses
    # another, leaving it as it was.
    async with wasinn.Runtime() as rt:
        graph = await rt.load([scripted(_argmax_module())], "pytorch")
        assert [s.describe() for s in graph.outputs] == ["output: any[...]"]
        x = np.array([[1.0, 5.0, 2.0], [7.0, 0.0, 1.0]], np.float32)
        with graph.init_execution_context() as ctx:
            ctx.set_input("x", x)
            ids = np.full(2, -1, np.int64)
            ctx.set_output("output", ids)
            await ctx.run()
            np.testing.assert_array_equal(ids, [1, 0])
            wrong = np.full(2, -1.0, np.float32)
            ctx.set_output("output", wrong)
            with pytest.raises(InvalidArgumentError, match=(
                    r"^output 'output' is i64 but its bound buffer is float32: expected a "
                    r"int64 array, or a byte buffer$")):
                await ctx.run()
            np.testing.assert_array_equal(wrong, [-1.0, -1.0])


def test_a_torch_save_checkpoint_is_refused_saying_how_to_save_a_model(
        backend: Any, tmp_path: Any) -> None:
    # Before: "cannot load the TorchScript archive: PytorchStreamReader failed locating
    # file constants.pkl: file not found ... your checkpoint file is corrupted".
    import torch

    module = torch.nn.Linear(2, 2)
    said = (r"^pytorch: the model is a torch.save checkpoint \(pickled weights or a pickled "
            r"module\), not a TorchScript or torch.export archive, and is not unpickled .*"
            r"expected a model saved with torch\.jit\.save\(torch\.jit\.script\(model\), "
            r"f\) or torch\.export\.save\(torch\.export\.export\(model, args\), f\)$")
    for saved, legacy in [(module.state_dict(), False), (module, False),
                          (module.state_dict(), True)]:
        buffer = io.BytesIO()
        torch.save(saved, buffer, _use_new_zipfile_serialization=not legacy)
        with pytest.raises(wasinn.InvalidEncodingError, match=said):
            backend.load([buffer.getvalue()], PT, CPU)


def test_single_output_is_named_output(backend: Any, small_mobilenet: ModelFiles) -> None:
    graph = backend.load([small_mobilenet.torchscript.read_bytes()], PT, CPU)
    assert [s.name for s in graph.inputs] == ["x"]
    assert [s.name for s in graph.outputs] == ["output"]
    (out,) = graph.run({"x": Tensor.from_numpy(sample_image())}).values()
    assert out.dims == (1, 1000)


def test_torchscript_rejecting_its_inputs_is_invalid_argument(
    backend: Any, small_mobilenet: ModelFiles
) -> None:
    graph = backend.load([small_mobilenet.torchscript.read_bytes()], PT, CPU)
    with pytest.raises(InvalidArgumentError, match=r"rejected its inputs .*f32\[1, 3, 4\]"):
        graph.run({"x": Tensor.from_numpy(np.zeros((1, 3, 4), np.float32))})
    with pytest.raises(InvalidArgumentError, match="no input 'image'"):
        graph.run({"image": Tensor.from_numpy(sample_image())})


def test_optimization_can_be_turned_off(backend: Any, small_mobilenet: ModelFiles) -> None:
    data = small_mobilenet.torchscript.read_bytes()
    image = Tensor.from_numpy(sample_image())
    plain = backend.load([data], PT, CPU, LoadOptions(extra={"optimize": False}))
    optimized = backend.load([data], PT, CPU)
    a, b = (g.run({"x": image})["output"].numpy() for g in (plain, optimized))
    assert np.abs(a - b).max() <= 1e-4


def test_without_optimization_the_outputs_are_the_librarys_own_bit_for_bit(
        backend: Any, small_mobilenet: ModelFiles) -> None:
    # What the README promises for options = { optimize = false }: the model as saved,
    # the numbers torch.jit.load(f)(x) gives (with optimize on, BatchNorm folding and
    # oneDNN rewrites change the last bits).
    import io

    import torch

    data = small_mobilenet.torchscript.read_bytes()
    image = sample_image()
    plain = backend.load([data], PT, CPU, LoadOptions(extra={"optimize": False}))
    got = plain.run({"x": Tensor.from_numpy(image)})["output"].numpy()
    module = torch.jit.load(io.BytesIO(data), map_location="cpu").eval()
    with torch.inference_mode():
        expected = module(torch.from_numpy(image)).numpy()
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("optimize", [True, False])
def test_torchscript_stop_checks_change_no_output_and_call_no_new_operator(
        backend: Any, small_mobilenet: ModelFiles, optimize: bool) -> None:
    # The forward that runs (with the loop checks that make a cancelled run stop, see
    # test_cancel_runs) computes what the module loaded computes, bit for bit, and
    # calls no operator that neither the module nor the check itself calls.
    import torch

    from tests.test_cancel_runs import matmul_loop_torchscript
    from wasinn.backends._torch_ops import graph_nodes, script_graphs
    from wasinn.backends.base import Cancellation, running_under

    graph = backend.load([matmul_loop_torchscript(4)], PT, CPU,
                         LoadOptions(extra={"optimize": optimize}))
    checked = graph._stop_checked._function.graph
    kinds = {node.kind() for node in graph_nodes(checked)}
    loaded = {node.kind() for g in script_graphs(graph.module) for node in graph_nodes(g)}
    assert kinds - loaded <= {"aten::Bool", "aten::fill_", "prim::If", "prim::RaiseException"}
    assert sum(node.kind() == "aten::Bool" for node in graph_nodes(checked)) == 1  # the loop
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    with torch.inference_mode():
        expected = graph.module(torch.from_numpy(x), torch.tensor(3)).numpy()
    for cancellation in (None, Cancellation()):
        with running_under(cancellation):
            out = graph.run({"x": Tensor.from_numpy(x),
                             "steps": Tensor.from_numpy(np.array(3, np.int64))})
        assert out["output"].numpy().tobytes() == expected.tobytes()
    # A forward without loops runs as loaded: its run is as long as its code.
    assert backend.load([small_mobilenet.torchscript.read_bytes()], PT, CPU)._stop_checked \
        is None


@pytest.mark.parametrize("optimize", [True, False])
def test_a_torchscript_loop_that_freezing_unrolls_keeps_a_stop_check_at_each_iteration(
        backend: Any, optimize: bool) -> None:
    # range(63): torch.jit.freeze (optimize) unrolls it into 63 products and no loop; each
    # product still gets the check its iteration had (that a cancelled run stops at, see
    # test_cancel_runs), and the outputs do not change.
    import torch

    from tests.test_cancel_runs import UNROLLED_STEPS, matmul_loop_torchscript
    from wasinn.backends._torch_ops import graph_nodes, script_graphs
    from wasinn.backends.base import Cancellation, running_under

    graph = backend.load([matmul_loop_torchscript(4, constant=True)], PT, CPU,
                         LoadOptions(extra={"optimize": optimize}))
    checked = graph._stop_checked._function.graph
    kinds = [node.kind() for node in graph_nodes(checked)]
    assert kinds.count("prim::Loop") == (0 if optimize else 1)
    assert kinds.count("aten::Bool") == (UNROLLED_STEPS if optimize else 1)
    loaded = {node.kind() for g in script_graphs(graph.module) for node in graph_nodes(g)}
    assert set(kinds) - loaded <= {"aten::Bool", "aten::fill_", "prim::If",
                                   "prim::RaiseException"}
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    with torch.inference_mode():
        expected = graph.module(torch.from_numpy(x)).numpy()
    for cancellation in (None, Cancellation()):
        with running_under(cancellation):
            out = graph.run({"x": Tensor.from_numpy(x)})
        assert out["output"].numpy().tobytes() == expected.tobytes()


def test_an_unrolled_torchscript_loop_whose_iterations_cannot_be_told_is_logged(
        backend: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Code without source ranges (as if the archive carried none): freezing unrolls the
    # loop and nothing tells its iterations apart, so no check can be put between them.
    import logging

    from tests.test_cancel_runs import matmul_loop_torchscript
    from wasinn.backends import _torch_cancel

    monkeypatch.setattr(_torch_cancel, "_origin", lambda node: "", raising=False)
    with caplog.at_level(logging.WARNING, logger="wasinn.backends"):
        graph = backend.load([matmul_loop_torchscript(4, constant=True)], PT, CPU)
    assert graph._stop_checked is None
    (record,) = caplog.records
    assert record.getMessage() == (
        "pytorch: freezing unrolled 1 loop(s) of this TorchScript model ((no source)) and "
        "no stop check could be put between their iterations: a cancelled run of it goes "
        "on through them (options = { optimize = false } keeps its loops)")


def test_a_loop_that_freezing_drops_as_dead_code_needs_no_check_and_is_not_logged(
        backend: Any, caplog: pytest.LogCaptureFixture) -> None:
    # A scripted BatchNorm's forward holds a loop (the batch size check of its
    # training-mode branch); freezing drops that branch and its loop with it.
    import logging

    import torch

    from wasinn.backends._torch_ops import graph_nodes

    model = scripted(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)))
    module = torch.jit.load(io.BytesIO(model)).eval()  # type: ignore[no-untyped-call]
    assert any(node.kind() == "prim::Loop"
               for node in graph_nodes(module._c._get_method("forward").inlined_graph))
    with caplog.at_level(logging.WARNING, logger="wasinn.backends"):
        graph = backend.load([model], PT, CPU)
    assert graph._stop_checked is None and not caplog.records


def test_dict_outputs_are_unsupported(backend: Any) -> None:
    import torch

    class Named(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"y": x}

    with pytest.raises(UnsupportedOperationError, match="expected a Tensor or a tuple"):
        backend.load([scripted(Named())], PT, CPU)


def test_exported_program_reports_types_and_dynamic_dims(backend: Any) -> None:
    builders, encoding = backend_models.identity("pytorch", TensorType.I32)
    graph = backend.load(builders, encoding, CPU)
    assert [s.describe() for s in graph.inputs] == ["x: i32[?, 4]"]
    assert [s.describe() for s in graph.outputs] == ["output: i32[?, 4]"]


def test_torch_export_archives_load_in_several_threads_at_once(backend: Any) -> None:
    """Devices' worker threads compile at the same time (and a runtime preloads its models
    at once): torch.export.load keeps the archive it reads in a module global."""
    import threading

    builders, encoding = backend_models.affine("pytorch", 2.0, 1.0)
    start = threading.Barrier(4)
    failures: list[BaseException] = []

    def load() -> None:
        for _ in range(5):
            start.wait()
            try:
                graph = backend.load(builders, encoding, CPU)
                (out,) = graph.run({0: wasinn.Tensor.from_numpy(np.ones((1, 4), np.float32))}
                                   ).values()
                np.testing.assert_array_equal(out.numpy(), 3.0)
            except BaseException as exc:
                failures.append(exc)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


def test_identity_output_does_not_alias_the_input(backend: Any) -> None:
    builders, encoding = backend_models.identity("pytorch", TensorType.F32)
    graph = backend.load(builders, encoding, CPU)
    arr = np.ones((2, 4), np.float32)
    (out,) = graph.run({"x": Tensor.from_numpy(arr)}).values()
    assert not np.shares_memory(out.numpy(), arr)


def test_read_only_input_memory_is_accepted(backend: Any) -> None:
    builders, encoding = backend_models.affine("pytorch", 2.0, 1.0)
    graph = backend.load(builders, encoding, CPU)
    x = Tensor.from_bytes([1, 4], "f32", np.ones(4, np.float32).tobytes())  # read-only view
    (out,) = graph.run({"x": x}).values()
    np.testing.assert_allclose(out.numpy(), [[3, 3, 3, 3]])


def test_keep_on_device_returns_torch_tensors(backend: Any) -> None:
    import torch

    builders, encoding = backend_models.affine("pytorch", 2.0, 1.0)
    graph = backend.load(builders, encoding, CPU)
    (out,) = graph.run({"x": Tensor.from_numpy(np.ones((1, 4), np.float32))},
                       keep_on_device=True).values()
    assert isinstance(out.native, torch.Tensor) and out.device == "cpu"


@pytest.mark.gpu
def test_cuda_runs_and_chains_on_the_gpu(backend: Any, small_mobilenet: ModelFiles) -> None:
    require_gpu()
    gpu = Device.parse("gpu:0")
    assert gpu in backend.devices()
    first_b, enc = backend_models.affine("pytorch", 2.0, 1.0)
    second_b, _ = backend_models.affine("pytorch", 3.0, 0.0)
    first, second = backend.load(first_b, enc, gpu), backend.load(second_b, enc, gpu)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    before = wasinn.host_copies()
    (mid,) = first.run({"x": Tensor.from_numpy(x)}, keep_on_device=True).values()
    (out,) = second.run({"x": mid}, keep_on_device=True).values()
    assert mid.device == "gpu:0" and out.native.is_cuda
    assert wasinn.host_copies() == before
    np.testing.assert_allclose(out.numpy(), (x * 2 + 1) * 3)
    net = backend.load([small_mobilenet.torchscript.read_bytes()], PT, gpu)
    cpu_net = backend.load([small_mobilenet.torchscript.read_bytes()], PT, CPU)
    image = Tensor.from_numpy(sample_image())
    diff = np.abs(net.run({"x": image})["output"].numpy()
                  - cpu_net.run({"x": image})["output"].numpy()).max()
    assert diff <= 1e-3


@pytest.mark.gpu
def test_gpu_outputs_kept_on_the_device_are_complete_when_read_from_another_thread(
        backend: Any) -> None:
    # A long chain of large products, left on the GPU: the run returns while its kernels
    # still run on the actor's stream. Read at once from another thread (the default
    # stream, as a guest's get-output is), the output must be the finished one.
    import threading

    import torch

    require_gpu()
    gpu = Device.parse("gpu:0")

    class Chain(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(64):
                x = torch.tanh(x @ x) + 1
            return x

    data = _exported(Chain(), (torch.ones(2048, 2048),))
    on_gpu, on_cpu = backend.load([data], PT, gpu), backend.load([data], PT, CPU)
    x = Tensor.from_numpy(np.random.default_rng(3).random((2048, 2048), np.float32) / 2048)
    want = on_cpu.run({"x": x})["output"].numpy()
    stream = torch.cuda.Stream()
    for _ in range(3):
        with torch.cuda.stream(stream):  # as the device's actor runs its jobs
            (out,) = on_gpu.run({"x": x}, keep_on_device=True).values()
        read: list[Any] = []
        reader = threading.Thread(target=lambda out=out, read=read: read.append(out.numpy()))
        reader.start()
        reader.join()
        np.testing.assert_allclose(read[0], want, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_a_run_over_onnx_runtime_cuda_memory_ends_before_that_memory_can_be_reused(
        backend: Any) -> None:
    # torch reads an OrtValue on the GPU over DLPack, late in a long run (its kernels are
    # queued when run() returns). The OrtValue is dropped at once, and ONNX Runtime's
    # next run (on its own stream) takes the freed memory for its output: had the torch
    # run not waited for its kernels, that write would race its read.
    import torch

    from tests.backend_models import affine
    from tests.support import require_ort_gpu
    from wasinn.backends.onnxruntime import OnnxRuntimeBackend

    require_gpu()
    ort = OnnxRuntimeBackend()
    require_ort_gpu(ort)
    gpu = Device.parse("gpu:0")

    class ReadsLate(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            square = x.reshape(2048, 2048)
            busy = square
            for _ in range(64):
                busy = torch.tanh(busy @ busy)
            return square * 2 + busy * 0  # x is read after the 64 products

    rows = 2048 * 2048 // 4
    builders, encoding = affine("onnxruntime", 1.0, 0.0)
    producer = ort.load(builders, encoding, gpu)
    consumer = backend.load([_exported(ReadsLate(), (torch.ones(rows, 4),))], PT, gpu)
    first = np.random.default_rng(4).random((rows, 4), np.float32)
    other = Tensor.from_numpy(np.full((rows, 4), 1000, np.float32))
    stream = torch.cuda.Stream()
    for _ in range(3):
        (middle,) = producer.run({"x": Tensor.from_numpy(first)}, keep_on_device=True).values()
        with torch.cuda.stream(stream):  # as the device's actor runs its jobs
            (out,) = consumer.run({"x": middle}, keep_on_device=True).values()
        del middle
        producer.run({"x": other}, keep_on_device=True)  # may take the freed memory
        np.testing.assert_allclose(out.numpy(), first.reshape(2048, 2048) * 2, rtol=1e-6)


_TF32_SWEEP = """
import itertools, torch
from wasinn.backends._torch_tf32 import cuda_allow_tf32

cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
levels = (torch.backends, cudnn, cudnn.conv, cudnn.rnn, matmul)  # coarse to fine

def effective(*chain):
    return next((v for v in (level.fp32_precision for level in chain) if v != "none"), "none")

def readable():
    try:
        return (cudnn.allow_tf32, matmul.allow_tf32) is not None
    except RuntimeError:  # torch's "you mixed the two APIs"
        return False

for allow, state in itertools.product((False, True),
                                      itertools.product(("none", "ieee", "tf32"), repeat=5)):
    cudnn.allow_tf32, matmul.allow_tf32 = True, False  # (torch keeps these apart too)
    for level, value in zip(levels, state, strict=True):
        level.fp32_precision = value
    was_readable = readable()
    cuda_allow_tf32(allow)
    kinds = [effective(cudnn.conv, cudnn, torch.backends),
             effective(cudnn.rnn, cudnn, torch.backends), effective(matmul, torch.backends)]
    assert [kind == "tf32" for kind in kinds] == [allow] * 3, (allow, state, kinds)
    assert readable() or not was_readable, (allow, state)
print("ok")
"""


def test_f32_precision_turns_tf32_off_for_every_cuda_f32_kernel_kind() -> None:
    # torch computes f32 cuDNN convolutions in TF32 by default on Ampere and later GPUs
    # (on an H100, small_mobilenet's logits 4.35e-2 from a float64 reference, 2.8e-5 in
    # f32), whatever precision says, unless told otherwise. These settings exist, and are
    # process-wide, in every torch build, so they are checked here without a GPU, from
    # every state an application may have left them in (each of the five settings none,
    # ieee or tf32), in a process of its own (the states it goes through would stay with
    # the tests after it). Before: the run wrote the allow_tf32 flags only where they read
    # otherwise, and with the process's or cuDNN's level set to tf32 they read False
    # while convolutions stayed in TF32 (96 of the 243 states). torch's older flags stay
    # readable where they were (an application reading them, torch.export among them, is
    # not told the two APIs were mixed).
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _TF32_SWEEP], capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_runs_of_the_other_tf32_setting_wait_for_each_other() -> None:
    # torch's setting is process-wide: before, a tf32 graph's run starting while an f32
    # graph's was launching its kernels turned TF32 on under the rest of them.
    import torch

    from wasinn.backends._torch_tf32 import tf32_runs

    cudnn: Any = torch.backends.cudnn
    legacy = (cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    order: list[str] = []
    release = {name: threading.Event() for name in ("f32", "tf32", "f32 again")}
    inside = {name: threading.Event() for name in release}

    def run(name: str, allow: bool) -> None:
        with tf32_runs(allow):
            order.append(name)
            assert (cudnn.conv.fp32_precision == "tf32") == allow  # set, and kept
            inside[name].set()
            assert release[name].wait(30)

    def start(name: str, allow: bool) -> threading.Thread:
        thread = threading.Thread(target=run, args=(name, allow))
        thread.start()
        return thread

    try:
        threads = [start("f32", False)]
        assert inside["f32"].wait(30)
        threads.append(start("tf32", True))  # the other setting: waits for the f32 run
        assert not inside["tf32"].wait(0.3)
        threads.append(start("f32 again", False))  # same as the running one, but one of
        assert not inside["f32 again"].wait(0.3)  # the other waits first: after it
        release["f32"].set()
        assert inside["tf32"].wait(30)
        assert not inside["f32 again"].is_set()
        release["tf32"].set()
        assert inside["f32 again"].wait(30)
        release["f32 again"].set()
        for thread in threads:
            thread.join(30)
        assert order == ["f32", "tf32", "f32 again"]
        with tf32_runs(None):  # a graph that leaves torch's setting alone is not held
            pass
    finally:
        for event in release.values():
            event.set()
        cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = legacy


def test_an_exported_program_moves_its_constants_and_devices_with_it(backend: Any) -> None:
    # The module's .to() leaves a program's lifted tensor constants and the devices its
    # graph records (torch.arange(n) says device=cpu) behind, so every GPU run would fail
    # with tensors on two devices. Checked with the meta device, which no CPU tensor may
    # meet either.
    import torch

    from wasinn.backends._torch_export import _program_on

    class Positions(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            offsets = torch.tensor([1.0, 2.0, 3.0, 4.0])  # a lifted constant
            return x * self.scale + offsets + torch.arange(x.shape[1])

    program = torch.export.export(Positions(), (torch.ones(2, 4),))
    meta = torch.device("meta")
    x = torch.ones(2, 4, device=meta)
    with pytest.raises(RuntimeError, match="device"):
        program.module().to(meta)(x)  # what a GPU load did before
    out = _program_on(program, meta).module()(x)
    assert out.device == meta and out.shape == (2, 4)
    assert _program_on(program, torch.device("cpu")) is program


# -- Guests' models are untrusted (each test fails on the code before its fix) ------------


def _exported(module: Any, example: tuple[Any, ...], dynamic: Any = None) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.export.save(torch.export.export(module, example, dynamic_shapes=dynamic), buf)
    return buf.getvalue()


def _rewritten(data: bytes, edit: Any, add: dict[str, bytes] | None = None) -> bytes:
    """The zip ``data`` with each entry's bytes passed through ``edit(name, bytes)``
    (names as stored: ``archive/models/model.json``) and the ``add`` entries added."""
    import zipfile

    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        for name in src.namelist():
            dst.writestr(name, edit(name, src.read(name)))
        for name, extra in (add or {}).items():
            dst.writestr(name, extra)
    return out.getvalue()


def _evil_pickle(marker: Any, plain: bool = False) -> bytes:
    """A torch.save file (``plain``: a pickle) whose unpickling creates ``marker``."""
    import pickle

    import torch

    class Evil:
        def __reduce__(self) -> Any:
            return (eval, (f"open({str(marker)!r}, 'w').close()",))

    if plain:
        return pickle.dumps(Evil())
    buf = io.BytesIO()
    torch.save(Evil(), buf)
    return buf.getvalue()


def _weighted() -> Any:
    import torch

    class Weighted(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x * self.w + torch.tensor([0.0, 1.0, 2.0, 3.0])).sin()  # and a constant

    return Weighted()


def _weighted_pt2() -> bytes:
    import torch

    return _exported(_weighted(), (torch.zeros(4, 4),), {"x": {0: torch.export.Dim("n")}})


def _edit_program(edit: Any) -> Any:
    """An ``edit`` for :func:`_rewritten` that passes the program's JSON text to ``edit``."""
    def program(name: str, data: bytes) -> bytes:
        if not name.endswith("models/model.json"):
            return data
        edited: str = edit(data.decode())
        assert edited != data.decode(), "the edit found nothing to change"
        return edited.encode()
    return program


def test_pt2_pickled_weight_is_refused_before_torch_reads_it(backend: Any, tmp_path: Any) -> None:
    # Before: torch.export.load unpickled the weight (torch.load weights_only=False),
    # which created the marker.
    marker = tmp_path / "ran"
    evil = _evil_pickle(marker)

    def pickled(name: str, data: bytes) -> bytes:
        if name.endswith("model_weights_config.json"):
            return data.replace(b'"use_pickle": false', b'"use_pickle": true')
        return evil if name.endswith("weights/weight_0") else data

    with pytest.raises(wasinn.SecurityError, match=r"stores 'w' as a pickle.*use_pickle: false"):
        backend.load([_rewritten(_weighted_pt2(), pickled)], PT, CPU)
    assert not marker.exists()


def test_pt2_sample_inputs_must_load_without_pickle_code(backend: Any, tmp_path: Any) -> None:
    # Before: torch's sample-input load fell back to weights_only=False and ran the pickle.
    marker = tmp_path / "ran"
    evil = _evil_pickle(marker)
    data = _rewritten(_weighted_pt2(),
                      lambda name, d: evil if name.endswith("sample_inputs/model.pt") else d)
    with pytest.raises(wasinn.SecurityError, match="sample inputs are not plain tensors"):
        backend.load([data], PT, CPU)
    assert not marker.exists()


@pytest.mark.parametrize("layout", ["legacy weights", "aotinductor", "opaque object",
                                    "2.7 format"])
def test_pt2_records_that_reach_pickle_or_native_code_are_refused(
    backend: Any, tmp_path: Any, layout: str
) -> None:
    # Before: legacy weights (a torch.load that falls back to weights_only=False), an
    # opaque-object constant (pickle.loads) and an archive that also holds the 2.7 format
    # (read once the .pt2 fails, its constants unpickled unrestricted) created the marker;
    # an AOTInductor library went to the loader that dlopen()s it.
    import zipfile

    from torch._export.serde.schema import SCHEMA_VERSION

    evil = _evil_pickle(tmp_path / "ran")
    keep = lambda name, data: data  # noqa: E731
    base = _weighted_pt2()
    program = zipfile.ZipFile(io.BytesIO(base)).read("archive/models/model.json")
    data, expected = {
        "legacy weights": (_rewritten(base, keep, {"archive/data/weights/model.pt": evil}),
                           "model.pt"),
        "aotinductor": (_rewritten(base, keep,
                                   {"archive/data/aotinductor/model/m.so": b"\x7fELF"}),
                        "aotinductor"),
        "opaque object": (_rewritten(base, lambda name, d: d.replace(
            b'"path_name": "tensor_0"', b'"path_name": "opaque_obj_0"'),
            {"archive/data/constants/opaque_obj_0": _evil_pickle(tmp_path / "ran", True)}),
            "opaque_obj_0"),
        "2.7 format": (_rewritten(base, keep, {
            "version": ".".join(map(str, SCHEMA_VERSION)).encode(),
            "serialized_exported_program.json": program, "serialized_state_dict.pt": evil,
            "serialized_constants.pt": evil, "serialized_example_inputs.pt": evil}),
            "outside one top-level folder"),
    }[layout]
    with pytest.raises(wasinn.SecurityError, match=expected):
        backend.load([data], PT, CPU)
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("where", ["a symbolic expression", "an input guard", "a name"])
def test_pt2_expressions_guards_and_names_cannot_run_code(
    backend: Any, tmp_path: Any, where: str
) -> None:
    # Before: each created the marker: torch evaluated the symbolic expression with
    # sympy.sympify (an eval) as the archive loaded, exec'd the guard in the first run,
    # and exec'd the fx code generated with the input's name in it.
    import json

    marker = tmp_path / "ran"
    code = f"__import__('os').system('touch {marker}')"
    symbol = "Symbol('s77', positive=True, integer=True)"
    edit, expected = {
        "a symbolic expression": (lambda s: s.replace(symbol, f"{code} or {symbol}", 1),
                                  "a symbolic expression"),
        "an input guard": (lambda s: s.replace('"guards_code": []',
                                               f'"guards_code": ["{code}"]'), "an input guard"),
        "a name": (lambda s: s.replace('"x"', json.dumps(f"x={code}")), "expected an identifier"),
    }[where]
    data = _rewritten(_weighted_pt2(), _edit_program(edit))
    with pytest.raises(wasinn.SecurityError, match=expected):
        graph = backend.load([data], PT, CPU)
        graph.run({"x": Tensor.from_numpy(np.ones((4, 4), np.float32))})
    assert not marker.exists()


@pytest.mark.parametrize("where", ["an input guard", "a symbolic expression",
                                   "a symbolic call"])
def test_pt2_expressions_nested_too_deep_are_refused_not_a_recursion_error(
    backend: Any, where: str
) -> None:
    # Before: the checks recursed once per level: RecursionError (not a WasiNNError) past
    # Python's recursion limit; below it, any depth went on to torch's own recursion.
    symbol = "Symbol('s77', positive=True, integer=True)"
    edit = {
        "an input guard": lambda s: s.replace('"guards_code": []',
                                              '"guards_code": ["' + "+".join("1" * 1000) + '"]'),
        "a symbolic expression": lambda s: s.replace(symbol, "-" * 1000 + symbol, 1),
        # (Python's parser allows 200 nested parentheses: 120 calls, 240 levels)
        "a symbolic call": lambda s: s.replace(symbol, "Abs(-" * 120 + symbol + ")" * 120, 1),
    }[where]
    data = _rewritten(_weighted_pt2(), _edit_program(edit))
    with pytest.raises(wasinn.SecurityError, match=(
            rf"^pytorch: the \.pt2 program has {where.replace('call', 'expression')} .* nested "
            r"more than 200 levels deep, beyond the forms torch\.export writes: refused, "
            r"since torch evaluates it as Python code$")):
        backend.load([data], PT, CPU)


def test_pt2_a_long_sum_within_the_depth_bound_is_checked_as_before() -> None:
    from wasinn.backends._pt2_check import _check_expression, _guard_node

    term = "L['x'].size()[0]"
    _check_expression("pytorch", " + ".join([term] * 150) + " <= 4096", _guard_node, "a guard")
    with pytest.raises(wasinn.SecurityError, match=r"outside the forms torch\.export writes"):
        _check_expression("pytorch", " + ".join([term] * 150 + ["x"]), _guard_node, "a guard")


def test_pt2_treespec_cannot_import_modules(backend: Any) -> None:
    # Before: the input spec's dict keys went through pytree's enum hook, which imports
    # the module the archive names (here one nothing had imported) and indexes it.
    import json
    import sys

    def enum_key(text: str) -> str:
        program = json.loads(text)
        signature = program["graph_module"]["module_call_graph"][0]["signature"]
        protocol, spec = json.loads(signature["in_spec"])
        kwargs = spec["children_spec"][1]  # (args, kwargs): kwargs is a dict
        kwargs["context"] = json.dumps([{"__enum__": True, "fqn": "wave:Error", "name": "x"}])
        signature["in_spec"] = json.dumps([protocol, spec])
        return json.dumps(program)

    assert "wave" not in sys.modules
    data = _rewritten(_weighted_pt2(), _edit_program(enum_key))
    with pytest.raises(wasinn.SecurityError, match=r"in_spec .* keyed by identifiers"):
        backend.load([data], PT, CPU)
    assert "wave" not in sys.modules


def test_pt2_checks_were_written_for_this_torch() -> None:
    # The .pt2 checks follow torch 2.13's loader: another release must be audited again.
    import torch

    from wasinn.backends._pt2_check import AUDITED_TORCH

    assert torch.__version__.startswith(AUDITED_TORCH)


def test_ordinary_exported_programs_still_load(backend: Any) -> None:
    import torch

    from wasinn.modelgen import mobilenet_v2

    class Branchy(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cond(x.sum() > 0, lambda t: t.sin(), lambda t: t.cos(), (x,))

    net = mobilenet_v2(0.35, seed=1).eval()
    batch = {"x": {0: torch.export.Dim("batch", max=8)}}
    for module, example in ((net, torch.zeros(2, 3, 224, 224)), (Branchy(), torch.ones(3))):
        graph = backend.load([_exported(module, (example,), batch if module is net else None)],
                             PT, CPU)
        (out,) = graph.run({"x": Tensor.from_numpy(example.numpy())}).values()
        with torch.no_grad():
            np.testing.assert_allclose(out.numpy(), module(example).numpy(), atol=1e-5)


def test_torchscript_cannot_read_host_files(backend: Any, tmp_path: Any) -> None:
    # Before: the run returned the host file's bytes (aten::from_file).
    import torch

    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"host-only secret")

    class Leak(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.path = str(secret)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.from_file(self.path, False, 16, dtype=torch.uint8) + x.to(torch.uint8)

    with pytest.raises(wasinn.SecurityError, match="mentions from_file"):
        backend.load([scripted(Leak())], PT, CPU)
    # The walk of the loaded graphs names the operator, inside blocks too.
    from wasinn.backends._torch_ops import check_torchscript_module

    class Hidden(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if bool(x.sum() > 0):
                for _ in range(2):
                    x = x + torch.from_file("f", False, 1).sum()
            return x

    with pytest.raises(wasinn.SecurityError, match="aten::from_file"):
        check_torchscript_module("pytorch", torch.jit.script(Hidden()))


def test_torchscript_setstate_cannot_write_host_files_at_load(
    backend: Any, tmp_path: Any
) -> None:
    # Before: torch.jit.load ran __setstate__, which wrote the marker with aten::save.
    import torch

    marker = tmp_path / "written"

    class Restorer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.ones(2)
            self.path = str(marker)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.w

        @torch.jit.export
        def __getstate__(self) -> tuple[torch.Tensor, bool, str]:
            return self.w, self.training, self.path

        @torch.jit.export
        def __setstate__(self, state: tuple[torch.Tensor, bool, str]) -> None:
            self.w = state[0]
            self.training = state[1]
            self.path = state[2]
            torch.save(self.w, self.path)

    with pytest.raises(wasinn.SecurityError, match="mentions save"):
        backend.load([scripted(Restorer())], PT, CPU)
    assert not marker.exists()


def test_torchscript_graph_walk_refuses_host_output(backend: Any) -> None:
    # Before: the model loaded and printed to the host's stdout (prim::Print) every run.
    import torch

    class Chatty(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            print("guest says", x)
            return x

    with pytest.raises(wasinn.SecurityError, match="prim::Print"):
        backend.load([scripted(Chatty())], PT, CPU)


def test_pt2_cannot_read_host_files(backend: Any, tmp_path: Any) -> None:
    # Before: the program's from_file node returned the host file's bytes.
    import json

    import torch

    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"host-only secret")

    class Sine(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.sin()

    def read_file(text: str) -> str:
        program = json.loads(text)
        node = program["graph_module"]["graph"]["nodes"][0]
        node["target"] = "torch.ops.aten.from_file.default"
        node["inputs"] = [{"name": "filename", "arg": {"as_string": str(secret)}, "kind": 1},
                          {"name": "shared", "arg": {"as_bool": False}, "kind": 1},
                          {"name": "size", "arg": {"as_int": 4}, "kind": 1}]
        return json.dumps(program)

    data = _rewritten(_exported(Sine(), (torch.zeros(4),)), _edit_program(read_file))
    with pytest.raises(wasinn.SecurityError, match="aten::from_file"):
        backend.load([data], PT, CPU)


def _both_formats(module: Any, example: Any) -> list[bytes]:
    return [_exported(module, (example,)), scripted(module)]


def test_outputs_never_share_the_callers_input(backend: Any) -> None:
    # Before: x[1:] came back as a view of the caller's array (guest memory), since only
    # an output at the input's very address was cloned.
    import torch

    class Tail(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x[1:], x.t()

    for data in _both_formats(Tail(), torch.zeros(3, 4)):
        x = np.arange(12, dtype=np.float32).reshape(3, 4)
        out = backend.load([data], PT, CPU).run({"x": Tensor.from_numpy(x)})
        for value in out.values():
            assert not np.shares_memory(value.numpy(), x)


def test_outputs_never_share_the_models_weights(backend: Any) -> None:
    # Before: an output that is a parameter came back as a numpy view of it: a caller's
    # in-place edit changed what every later run returned.
    import torch

    class Table(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.nn.Parameter(torch.arange(4.0))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x + 1, self.table

    for data in _both_formats(Table(), torch.zeros(2, 4)):
        graph = backend.load([data], PT, CPU)
        x = Tensor.from_numpy(np.zeros((2, 4), np.float32))
        graph.run({"x": x})["output_1"].numpy()[:] *= 100
        np.testing.assert_array_equal(graph.run({"x": x})["output_1"].numpy(), [0, 1, 2, 3])


def test_a_model_writing_its_input_gets_a_copy(backend: Any, small_mobilenet: ModelFiles) -> None:
    # Before: x.sub_(0.5) wrote into the caller's array: two runs on one input differed.
    import torch

    class Normalize(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.sub_(0.5)
            return x * 2

    for data in _both_formats(Normalize(), torch.zeros(2, 4)):
        graph = backend.load([data], PT, CPU)
        x = np.ones((2, 4), np.float32)
        first, second = (graph.run({"x": Tensor.from_numpy(x)})["output"].numpy()
                         for _ in range(2))
        np.testing.assert_array_equal(x, np.ones((2, 4)))
        np.testing.assert_array_equal(first, second)
    # A model that writes only to its intermediates keeps sharing its input (no copy).
    net = backend.load([small_mobilenet.torchscript.read_bytes()], PT, CPU)
    assert net._private == frozenset()


def test_dim_outside_its_exported_range_is_invalid_argument(backend: Any) -> None:
    # Before: the spec said x: f32[?, 4], so the input check let batch 16 through and
    # torch's guard failed inside the run: BackendRuntimeError "Guard failed".
    import torch

    class Square(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    n = torch.export.Dim("n", min=3, max=8)
    graph = backend.load([_exported(Square(), (torch.zeros(4, 4),), {"x": {0: n}})], PT, CPU)
    # The spec carries the range (before: f32[?, 4]): warm-ups start there.
    assert graph.inputs[0].describe() == "x: f32[3..8, 4]"
    graph.run({"x": Tensor.from_numpy(np.ones((8, 4), np.float32))})
    for batch in (16, 2):
        with pytest.raises(InvalidArgumentError,
                           match=r"^pytorch: input 'x' has size .* in dimension 0, but the "
                                 r"model was exported for 3 to 8 there"):
            graph.run({"x": Tensor.from_numpy(np.ones((batch, 4), np.float32))})
    # A relation between dims (both sizes of a square) is torch's guard: also the caller's.
    square = backend.load([_exported(Square(), (torch.zeros(4, 4),),
                                     {"x": {0: n, 1: n}})], PT, CPU)
    with pytest.raises(InvalidArgumentError, match="shape constraints"):
        square.run({"x": Tensor.from_numpy(np.ones((4, 5), np.float32))})


def test_an_unreadable_zip_is_invalid_encoding(backend: Any) -> None:
    # Before: zipfile's NotImplementedError (a "version needed to extract" it lacks)
    # escaped from the backend raw.
    import struct

    data = bytearray(scripted(_pair_module()))
    at = data.find(b"PK\x01\x02")  # the first central directory header
    data[at + 6:at + 8] = struct.pack("<H", 255)
    with pytest.raises(wasinn.InvalidEncodingError, match="pytorch: cannot read the model's zip"):
        backend.load([bytes(data)], PT, CPU)


def test_a_torch_error_without_a_reason_is_said_to_have_none() -> None:
    # TorchScript's interpreter (a graph loaded interruptible) can end its message with a
    # bare "RuntimeError:": not to be shown as if the message were cut short.
    from wasinn.backends._torch_graph import _first_line

    assert _first_line(RuntimeError(
        "The following operation failed in the TorchScript interpreter.\n"
        "Traceback of TorchScript (most recent call last):\nRuntimeError: \n")) == (
        "RuntimeError, with no message from torch")
    assert _first_line(RuntimeError("a\nValueError: bad thing\n")) == "ValueError: bad thing"


@pytest.mark.parametrize("precision", ["f16", "bf16"])
def test_a_precision_torch_cannot_apply_is_said_so(
        backend: Any, precision: str, caplog: pytest.LogCaptureFixture) -> None:
    # Before: the model loaded and computed in f32 without a word.
    import logging

    import torch

    module = scripted(torch.nn.Linear(4, 2))
    with caplog.at_level(logging.WARNING, logger="wasinn.backends"):
        backend.load([module], GraphEncoding.PYTORCH, CPU, LoadOptions(precision=precision))
    assert [r.getMessage() for r in caplog.records] == [
        f"pytorch: precision {precision!r} is not applied: torch computes in the model's own "
        f"types (save the model in {precision} to compute in it)"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="wasinn.backends"):
        backend.load([module], GraphEncoding.PYTORCH, CPU, LoadOptions(precision="f32"))
    assert not caplog.records
