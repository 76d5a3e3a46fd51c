"""A sandboxed graph's run takes what an in-process graph's takes (inputs by name, alias
or position, numpy arrays among them; ``outputs`` a str for one name), keyed by name
before the process gets them, so that a crash is counted whatever the keys; an error
whose words name a CUDA error retires no CPU process, nor a GPU one where the words are
the model's or its CUDA driver finds the context fine; and an output declared larger
than any machine neither breaks every run nor has the host map a file that large.
Real backends (ONNX Runtime, and OpenVINO for a real crash).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import wasinn
from tests.support import require_backend
from tests.test_sandbox import INT32_MIN, _gathernd_inputs, _gathernd_onnx
from wasinn import BackendRuntimeError, GraphEncoding, Tensor
from wasinn.backends import Device
from wasinn.backends.registry import BackendRegistry
from wasinn.backends.sandbox import load_sandboxed
from wasinn.modelgen import affine_onnx, onnx_model_bytes

CPU = Device.parse("cpu")


def _backend(name: str) -> Any:
    require_backend(name)
    return BackendRegistry().get(name)


def _tensors(arrays: dict[str, Any]) -> dict[str, Tensor]:
    return {name: Tensor.from_numpy(array) for name, array in arrays.items()}


def test_a_crash_of_inputs_keyed_by_position_and_name_is_counted() -> None:
    # Before: a TypeError (sorting a position beside a name) replaced the run's error in
    # the crash handler, and the crash was not counted: no back-off, no poison refused.
    require_backend("onnx")
    graph = load_sandboxed(_backend("openvino"), [_gathernd_onnx()], GraphEncoding.ONNX, CPU)
    try:
        poison = _tensors(_gathernd_inputs(INT32_MIN))
        for _ in range(2):
            with pytest.raises(BackendRuntimeError, match=r"^openvino: the process running "
                                                          r"the model was killed by SIGSEGV"):
                graph.run({0: poison["x"], "i": poison["i"]})  # type: ignore[dict-item]
        assert graph.backoff.crashes == 2
        for keys in ((0, "i"), ("x", 1), ("x", "i")):  # the same inputs, however keyed
            with pytest.raises(BackendRuntimeError, match=r"^openvino: these inputs crashed "
                                                          r"the model's process 2 times"):
                graph.run(dict(zip(keys, poison.values(), strict=True)))  # type: ignore[arg-type]
        good = _gathernd_inputs(1)  # (numpy arrays, as in-process graphs take)
        out = graph.run({0: good["x"], "i": good["i"]})  # type: ignore[dict-item]
        x, i = good["x"], good["i"]
        np.testing.assert_array_equal(out["y"].numpy(), np.stack([x[tuple(r)] for r in i]))
    finally:
        graph.close()


def test_outputs_may_be_one_name_and_inputs_numpy_as_in_process() -> None:
    # Before: "prob" was sent as the names 'p', 'r', 'o', 'b', and a numpy input was an
    # AttributeError.
    backend = _backend("onnxruntime")
    model = affine_onnx(2.0, 1.0, out_name="prob")
    x = np.ones((1, 4), np.float32)
    in_process = backend.load([model], GraphEncoding.ONNX, CPU)
    sandboxed = load_sandboxed(backend, [model], GraphEncoding.ONNX, CPU)
    try:
        for inputs in ({"x": Tensor.from_numpy(x)}, {"x": x}, {0: x}):
            want = in_process.run(inputs, outputs="prob")
            got = sandboxed.run(inputs, outputs="prob")  # type: ignore[arg-type]
            assert list(got) == list(want) == ["prob"]
            np.testing.assert_array_equal(got["prob"].numpy(), want["prob"].numpy())
        with pytest.raises(wasinn.UnknownNameError, match=r"^onnxruntime: the model has no "
                                                          r"output 'pro'"):
            sandboxed.run({"x": x}, outputs="pro")  # type: ignore[dict-item]
        with pytest.raises(wasinn.InvalidArgumentError, match=r"^onnxruntime: input 'x' is "
                                                              r"given twice"):
            sandboxed.run({"x": x, 0: x})  # type: ignore[dict-item]
    finally:
        sandboxed.close()
        in_process.close()


def _named_node_onnx(node_name: str) -> bytes:
    from onnx import TensorProto, helper

    node = helper.make_node("Reshape", ["x", "s"], ["y"], name=node_name)
    return onnx_model_bytes(helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"]),
                      helper.make_tensor_value_info("s", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]))


def test_a_cpu_process_is_not_retired_for_an_error_naming_a_cuda_error() -> None:
    # Before: ONNX Runtime's message quotes the node's name, which the host took for a
    # lost CUDA context: each such run retired the process (a new one and a reload for
    # the next run, no back-off), saying a CPU process had lost its CUDA context.
    require_backend("onnx")
    graph = load_sandboxed(_backend("onnxruntime"), [_named_node_onnx("misaligned address")],
                           GraphEncoding.ONNX, CPU)
    try:
        pid = graph.pid
        bad = _tensors({"x": np.ones(8, np.float32), "s": np.array([3, 3], np.int64)})
        for _ in range(2):
            with pytest.raises(BackendRuntimeError, match="misaligned address") as caught:
                graph.run(bad)
            assert "CUDA" not in caught.value.message
            assert graph.pid == pid
        assert graph.backoff.crashes == 0
    finally:
        graph.close()


class _OnGpu:
    """A CPU graph of a real backend, as a sandbox process sees it where it runs on
    ``device`` (a GPU, which this machine lacks: only ``device`` differs)."""

    def __init__(self, graph: Any, device: str) -> None:
        self.graph = graph
        self.device = Device.parse(device)
        self.outputs = graph.outputs

    def run(self, inputs: Any, outputs: Any = None) -> Any:
        return self.graph.run(inputs, outputs=outputs)


def _child_reply(graph: Any, inputs: dict[str, Tensor]) -> dict[str, Any]:
    """What a sandbox process answers to a run of ``graph`` (in this process)."""
    from wasinn.backends._sandbox_child import _run
    from wasinn.backends._sandbox_wire import DeclaredOutputs

    declared = DeclaredOutputs("test", graph.outputs, {}, True)
    payload, _ = _run(graph, inputs, None, declared, None)
    return payload


def test_a_gpu_process_is_not_retired_for_a_node_named_after_a_sticky_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: ONNX Runtime's message quotes the node's name, which the process took for
    # the library's words for a lost CUDA context: its every ordinary error on such a
    # node retired it and counted a crash of those inputs.
    from wasinn.backends import cuda

    require_backend("onnx")
    monkeypatch.setattr(cuda, "_driver", lambda: None)  # a driver that cannot tell
    model = _named_node_onnx("n ; CUDA failure 710: device-side assert triggered ; GPU=0")
    graph = _OnGpu(_backend("onnxruntime").load([model], GraphEncoding.ONNX, CPU), "gpu:0")
    reply = _child_reply(graph, _tensors(
        {"x": np.ones(8, np.float32), "s": np.array([3, 3], np.int64)}))
    assert reply["error"][0] == "BackendRuntimeError"
    assert "cannot be reshaped" in reply["error"][1]
    assert "lost_context" not in reply


def test_a_gpu_process_says_it_lost_its_context_only_if_the_driver_agrees(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: the library's words alone decided; the host asks the driver, the process
    # did not. The fake library raises torch's words for a device-side assert on gpu:1.
    from tests.fake_backend import DEVICE_ASSERT, FakeBackend
    from wasinn.backends import _sandbox_child

    graph = FakeBackend().load([b"fake:add=1"], GraphEncoding.GGML, Device.parse("gpu:1"))
    asked: list[int] = []
    for says, lost in ((0, False), (710, True), (None, True)):  # None: cannot tell
        monkeypatch.setattr(_sandbox_child, "context_failure",
                            lambda index, says=says: asked.append(index) or says)
        reply = _child_reply(graph, _tensors({"x": np.full((1, 4), DEVICE_ASSERT,
                                                            np.float32)}))
        assert "device-side assert triggered" in reply["error"][1]
        assert reply.get("lost_context", False) is lost, (says, reply)
    assert asked == [1, 1, 1]  # the graph's own device
    reply = _child_reply(graph, _tensors({"x": np.full((1, 4), -1, np.float32)}))
    assert "lost_context" not in reply and asked == [1, 1, 1]  # (asked on those only)


def _declaring_onnx(dim0: int) -> bytes:
    """A model declaring its output ``y: f32[dim0, 4]``, which it computes of the shape
    its input ``s`` gives."""
    from onnx import TensorProto, helper

    return onnx_model_bytes(helper.make_graph(
        [helper.make_node("Reshape", ["x", "s"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"]),
         helper.make_tensor_value_info("s", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [dim0, 4])]))


@pytest.mark.parametrize("dim0", [2**61, 2**36])
def test_an_output_declared_larger_than_any_machine_fails_runs_as_any_other(
        dim0: int) -> None:
    # Before: 2**61 made every run an OverflowError (the arena reserved for it), 2**36
    # had the host make and map an arena of 1 TiB.
    require_backend("onnx")
    graph = load_sandboxed(_backend("onnxruntime"), [_declaring_onnx(dim0)],
                           GraphEncoding.ONNX, CPU)
    try:
        pid = graph.pid
        inputs = _tensors({"x": np.ones(8, np.float32), "s": np.array([2, 4], np.int64)})
        with pytest.raises(BackendRuntimeError, match=(
                rf"^onnxruntime: the run's outputs are not those the model declares: output "
                rf"'y' is f32\[2, 4\]: expected y: f32\[{dim0}, 4\], as the model declares$")):
            graph.run(inputs)
        assert graph.pid == pid
        assert graph.max_bytes is not None
        assert all(c.arena.size < graph.max_bytes for c in graph._idle)
    finally:
        graph.close()
