"""The async API on the real backends: load, contexts, compute, the staged form, errors,
unload, native tensors between computes, the loop never blocked, cancellation."""

from __future__ import annotations

import sys
import time
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import wasinn
from tests.backend_models import affine
from tests.loop_model import LONG_LOOP, loop_onnx
from tests.loopwatch import Heartbeat, heartbeat  # noqa: F401 - fixture
from tests.support import require_backend
from wasinn import (
    BackendRuntimeError,
    ClosedResourceError,
    ExecutionTarget,
    InvalidArgumentError,
    InvalidEncodingError,
    TooLargeError,
    UnsupportedOperationError,
)
from wasinn.configs.loader import parse_config
from wasinn.modelgen import ModelFiles, sample_image

LIBRARY = {"onnxruntime": "onnxruntime", "openvino": "openvino", "pytorch": "torch"}
BACKENDS = list(LIBRARY)


@pytest.fixture
async def rt() -> AsyncIterator[wasinn.Runtime]:
    async with wasinn.Runtime() as runtime:
        yield runtime


def one_worker_config(**runtime: Any) -> Any:
    return parse_config({"runtime": runtime,
                         "pools": {"cpu": {"kind": "cpu", "devices": ["cpu"], "workers": 1}}},
                        None)


def mobilenet_builders(files: ModelFiles, backend: str) -> tuple[list[bytes], str]:
    if backend == "openvino":
        return [files.ir_xml.read_bytes(), files.ir_bin.read_bytes()], "openvino"
    if backend == "pytorch":
        return [files.torchscript.read_bytes()], "pytorch"
    return [files.onnx.read_bytes()], "onnx"


def reshape_onnx() -> bytes:
    """``y = Reshape(x, shape)``: fails at run time when ``shape`` does not fit ``x``."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    shape = helper.make_tensor_value_info("shape", TensorProto.INT64, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph([helper.make_node("Reshape", ["x", "shape"], ["y"])],
                              "reshape", [x, shape], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


@pytest.mark.parametrize("backend", BACKENDS)
async def test_every_backend_classifies_alike_through_the_scheduler(
        rt: wasinn.Runtime, small_mobilenet: ModelFiles, backend: str) -> None:
    require_backend(LIBRARY[backend])
    image = sample_image(3)
    reference = await rt.load([small_mobilenet.onnx.read_bytes()], "onnx",
                              backend="onnxruntime")
    expected = (await reference.compute({"input": image}))["output"].numpy()
    builders, encoding = mobilenet_builders(small_mobilenet, backend)
    graph = await rt.load(builders, encoding, "cpu", backend=backend)
    ctx = graph.init_execution_context()
    out = await ctx.compute({0: image})
    got = next(iter(out.values())).numpy()
    np.testing.assert_allclose(got, expected, atol=1e-4)
    assert got.argmax() == expected.argmax()
    ctx.close()
    await graph.unload()
    await reference.unload()


async def test_autodetect_and_specs(rt: wasinn.Runtime, small_mobilenet: ModelFiles) -> None:
    graph = await rt.load([small_mobilenet.onnx.read_bytes()])
    assert [s.name for s in graph.inputs] == ["input"]
    assert graph.inputs[0].shape == (None, 3, 224, 224)
    assert [s.name for s in graph.outputs] == ["output"]
    assert graph.default_target is ExecutionTarget.CPU
    assert rt.devices == [wasinn.backends.Device(ExecutionTarget.CPU)]


async def test_staged_run_fills_the_bound_buffer_in_place(rt: wasinn.Runtime) -> None:
    builders, encoding = affine("onnxruntime", 2.0, 1.0)
    graph = await rt.load(builders, encoding)
    ctx = graph.init_execution_context()
    buffer = np.zeros((3, 4), np.float32)
    ctx.set_input(0, np.arange(12, dtype=np.float32).reshape(3, 4))
    ctx.set_output("y", buffer)
    await ctx.run()
    expected = np.arange(12, dtype=np.float32).reshape(3, 4) * 2 + 1
    np.testing.assert_array_equal(buffer, expected)
    np.testing.assert_array_equal(ctx.get_output(0).numpy(), expected)
    np.testing.assert_array_equal(ctx.get_output("y").numpy(), expected)
    # Inputs stay set: a second run gives the same answer; a new input a new one.
    buffer[:] = 0
    await ctx.run()
    np.testing.assert_array_equal(buffer, expected)
    ctx.set_input("x", np.ones((3, 4), np.float32))
    await ctx.run()
    np.testing.assert_array_equal(buffer, np.full((3, 4), 3, np.float32))
    raw = bytearray(48)
    ctx.set_output(0, raw)
    await ctx.run()
    assert np.frombuffer(raw, np.float32).tolist() == [3.0] * 12


async def test_one_shot_compute_on_the_graph(rt: wasinn.Runtime) -> None:
    builders, encoding = affine("onnxruntime", 3.0, 0.0)
    graph = await rt.load(builders, encoding)
    out = await graph.compute({"x": np.ones((1, 4), np.float32)}, target="cpu")
    assert out["y"].numpy().tolist() == [[3.0] * 4]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_native_output_feeds_the_next_compute_without_a_host_copy(
        rt: wasinn.Runtime, backend: str) -> None:
    require_backend(LIBRARY[backend])
    builders, encoding = affine(backend, 2.0, 1.0)
    graph = await rt.load(builders, encoding, backend=backend)
    ctx = graph.init_execution_context()
    out_name = graph.outputs[0].name
    first = await ctx.compute({0: np.ones((2, 4), np.float32)}, keep_on_device=True)
    assert first[out_name].native is not None
    before = wasinn.host_copies()
    second = await ctx.compute({0: first[out_name]}, keep_on_device=True)
    third = await ctx.compute({0: second[out_name]})
    assert wasinn.host_copies() == before
    assert third[out_name].is_host
    np.testing.assert_allclose(third[out_name].numpy(), np.full((2, 4), 15, np.float32))


async def test_bad_inputs_are_invalid_arguments(rt: wasinn.Runtime) -> None:
    builders, encoding = affine("onnxruntime", 2.0, 1.0)
    graph = await rt.load(builders, encoding)
    ctx = graph.init_execution_context()
    with pytest.raises(InvalidArgumentError, match="no input 'nope'"):
        await ctx.compute({"nope": np.ones((1, 4), np.float32)})
    with pytest.raises(InvalidArgumentError, match="expects"):
        await ctx.compute({"x": np.ones((1, 4), np.int32)})
    with pytest.raises(InvalidArgumentError, match="mapping"):
        await ctx.compute([np.ones((1, 4), np.float32)])  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="no outputs yet"):
        ctx.get_output(0)
    with pytest.raises(InvalidArgumentError, match="no input 3"):
        ctx.set_input(3, np.ones((1, 4), np.float32))
    with pytest.raises(InvalidArgumentError, match="no output 'z'"):
        ctx.set_output("z", bytearray(16))
    with pytest.raises(InvalidArgumentError, match="read-only"):
        ctx.set_output("y", b"\0" * 16)
    with pytest.raises(InvalidArgumentError, match="no wasi-nn element type"):
        ctx.set_input("x", np.ones((1, 4), np.complex64))
    ctx.set_output("y", bytearray(8))
    with pytest.raises(TooLargeError, match="bound buffer holds 8"):
        await ctx.compute({"x": np.ones((1, 4), np.float32)})
    # Nothing is broken: the context still works once the buffer is right.
    ctx.set_output("y", bytearray(16))
    out = await ctx.compute({"x": np.ones((1, 4), np.float32)})
    assert out["y"].numpy().tolist() == [[3.0] * 4]


async def test_bad_model_bytes_fail_at_load(rt: wasinn.Runtime) -> None:
    with pytest.raises(InvalidEncodingError):
        await rt.load([b"\x08\x01garbage that is no model"], "onnx")
    with pytest.raises(InvalidEncodingError, match="autodetect"):
        await rt.load([bytes(range(256))])
    with pytest.raises(InvalidEncodingError, match="empty builder list"):
        await rt.load([])
    with pytest.raises(InvalidArgumentError, match="sequence of bytes-like"):
        await rt.load(affine_onnx_bytes())  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="unknown GraphEncoding"):
        await rt.load([affine_onnx_bytes()], "keras")
    with pytest.raises(InvalidArgumentError, match="unknown backend"):
        await rt.load([affine_onnx_bytes()], "onnx", backend="tensorrt")
    with pytest.raises(InvalidEncodingError, match="does not read"):
        await rt.load([affine_onnx_bytes()], "onnx", backend="pytorch")
    with pytest.raises(InvalidArgumentError, match="unknown ExecutionTarget"):
        await rt.load([affine_onnx_bytes()], "onnx", target="quantum")
    graph = await rt.load([affine_onnx_bytes()], "onnx")  # still serving
    assert graph.inputs[0].name == "x"


def affine_onnx_bytes() -> bytes:
    return affine("onnxruntime", 2.0, 1.0)[0][0]


async def test_a_backend_failure_fails_that_request_only(rt: wasinn.Runtime) -> None:
    graph = await rt.load([reshape_onnx()], "onnx")
    x = np.ones((2, 4), np.float32)
    with pytest.raises(BackendRuntimeError, match="onnxruntime"):
        await graph.compute({"x": x, "shape": np.array([3, 3], np.int64)})
    out = await graph.compute({"x": x, "shape": np.array([4, 2], np.int64)})
    assert out["y"].dims == (4, 2)


async def test_a_target_with_no_device_is_unsupported(rt: wasinn.Runtime) -> None:
    graph = await rt.load([affine_onnx_bytes()], "onnx")
    if rt.actors and any(a.device.kind is ExecutionTarget.TPU for a in rt.actors):
        pytest.skip("this machine has a tpu/npu device")
    with pytest.raises(UnsupportedOperationError, match="no tpu device"):
        graph.init_execution_context(target="tpu")
    with pytest.raises(UnsupportedOperationError, match="no tpu device"):
        await rt.load([affine_onnx_bytes()], "onnx", target="tpu")


async def test_fallback_warns_naming_both_targets() -> None:
    async with wasinn.Runtime(one_worker_config(fallback="cpu")) as rt:
        graph = await rt.load([affine_onnx_bytes()], "onnx")
        with pytest.warns(RuntimeWarning, match="target tpu falls back to cpu"):
            ctx = graph.init_execution_context(target="tpu")
        assert ctx.target is ExecutionTarget.CPU
        out = await ctx.compute({"x": np.ones((1, 4), np.float32)})
        assert out["y"].numpy().tolist() == [[3.0] * 4]


async def test_contexts_are_tickets(rt: wasinn.Runtime) -> None:
    graph = await rt.load([affine_onnx_bytes()], "onnx")
    (actor,) = rt.actors
    completed = actor.completed
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        contexts = [graph.init_execution_context() for _ in range(2000)]
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
    assert grown / len(contexts) <= 2048
    assert actor.completed == completed  # no backend work
    for ctx in contexts:
        ctx.close()


async def test_unload_frees_sessions_once_the_last_context_closes(rt: wasinn.Runtime) -> None:
    (actor,) = rt.actors
    graph = await rt.load([affine_onnx_bytes()], "onnx")
    key = actor.session_keys()[-1]
    compiled = actor.cached_session(key)
    assert compiled is not None
    ctx = graph.init_execution_context()
    await graph.unload()
    await graph.unload()  # idempotent
    with pytest.raises(ClosedResourceError):
        graph.init_execution_context()
    with pytest.raises(ClosedResourceError):
        await graph.compute({"x": np.ones((1, 4), np.float32)})
    assert actor.cached(key)  # a context still uses it
    out = await ctx.compute({"x": np.ones((1, 4), np.float32)})
    assert out["y"].numpy().tolist() == [[3.0] * 4]
    ctx.close()
    ctx.close()  # idempotent
    assert not actor.cached(key)
    assert compiled.evicted
    with pytest.raises(ClosedResourceError):
        await ctx.compute({"x": np.ones((1, 4), np.float32)})
    again = await rt.load([affine_onnx_bytes()], "onnx")
    out = await again.compute({"x": np.ones((1, 4), np.float32)})
    assert out["y"].numpy().tolist() == [[3.0] * 4]


@pytest.mark.parametrize("backend", ["onnxruntime", "pytorch"])
async def test_compute_never_blocks_the_event_loop(
        rt: wasinn.Runtime, mobilenet: ModelFiles,
        heartbeat: Heartbeat, backend: str) -> None:  # noqa: F811 - the imported fixture
    require_backend(LIBRARY[backend])
    builders, encoding = mobilenet_builders(mobilenet, backend)
    graph = await rt.load(builders, encoding, backend=backend)
    images = sample_image(0, batch=8)
    await graph.compute({0: images})  # warm up
    with heartbeat.watch():
        await graph.compute({0: images})


def test_the_heartbeat_catches_a_blocked_loop() -> None:
    async def blocker(beat: Heartbeat) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(beat.run)
            await trio.sleep(0.01)
            with pytest.raises(AssertionError, match="event loop was blocked"), beat.watch():
                time.sleep(0.2)  # holds the loop, as a compute on the trio thread would
                await trio.sleep(0.001)
            nursery.cancel_scope.cancel()

    trio.run(blocker, Heartbeat())


async def test_concurrent_callers_get_their_own_answers(rt: wasinn.Runtime) -> None:
    graph = await rt.load([affine_onnx_bytes()], "onnx")
    results: dict[int, float] = {}

    async def caller(i: int) -> None:
        ctx = graph.init_execution_context()
        with ctx:
            out = await ctx.compute({"x": np.full((1, 4), i, np.float32)})
            results[i] = float(out["y"].numpy()[0, 0])

    async with trio.open_nursery() as nursery:
        for i in range(16):
            nursery.start_soon(caller, i)
    assert results == {i: 2.0 * i + 1 for i in range(16)}


async def test_cancelling_callers_with_a_real_backend(mobilenet: ModelFiles) -> None:
    async with wasinn.Runtime(one_worker_config()) as rt:
        (actor,) = rt.actors
        graph = await rt.load([mobilenet.onnx.read_bytes()], "onnx")
        images = sample_image(0, batch=16)
        running = trio.CancelScope()
        finished: list[str] = []

        async def long_compute() -> None:
            with running:
                await graph.compute({"input": images})
                finished.append("running")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(long_compute)
            await trio.testing.wait_all_tasks_blocked()
            assert actor.load == 1
            with trio.CancelScope() as queued:
                nursery.start_soon(_cancel_after_blocked, queued)
                await graph.compute({"input": images})
                finished.append("queued")
            assert queued.cancelled_caught
            assert actor.load == 1  # the queued request left the queue without running
            running.cancel()
        assert running.cancelled_caught and finished == []
        # The abandoned run and the dropped queued one did not break the device.
        out = await graph.compute({"input": sample_image(1)})
        assert out["output"].dims == (1, 1000)


async def _cancel_after_blocked(scope: trio.CancelScope) -> None:
    await trio.testing.wait_all_tasks_blocked()
    scope.cancel()


async def test_a_cancelled_unload_still_frees_the_model(rt: wasinn.Runtime) -> None:
    (actor,) = rt.actors
    graph = await rt.load([affine_onnx_bytes()], "onnx")
    key = actor.session_keys()[-1]
    session = actor.cached_session(key)
    assert session is not None
    with trio.CancelScope() as scope:
        scope.cancel()  # e.g. a guest's timeout expiring while it unloads
        await graph.unload()
    assert scope.cancelled_caught
    assert graph.unloaded and not actor.cached(key) and session.evicted
    await graph.unload()  # idempotent


async def test_a_cancelled_unload_still_frees_a_pipelines_steps(tmp_path: Path) -> None:
    (tmp_path / "affine.onnx").write_bytes(affine_onnx_bytes())
    config = parse_config({
        "models": {"a": {"files": ["affine.onnx"]}, "b": {"files": ["affine.onnx"]}},
        "pipelines": {"twice": {"steps": [{"model": "a"}, {"model": "b"}]}},
    }, tmp_path / "wasinn.toml")
    async with wasinn.Runtime(config) as rt:
        (actor,) = rt.actors
        pipeline = await rt.load_by_name("twice")
        assert isinstance(pipeline, wasinn.Pipeline) and len(actor.session_keys()) == 2
        with trio.CancelScope() as scope:
            scope.cancel()
            await pipeline.unload()
        assert scope.cancelled_caught
        assert pipeline.unloaded and actor.session_keys() == []


#: Run by a subprocess: a compute times out while ONNX Runtime is deep in a long Loop, so
#: the run is abandoned and still going when the runtime closes and the process exits.
ABANDON_AND_EXIT = """
import sys

import numpy as np
import trio

import wasinn


async def main(path: str, m: int) -> None:
    async with wasinn.Runtime() as rt:
        (actor,) = rt.actors
        threads = actor.threads.threads
        graph = await rt.load([open(path, "rb").read()], "onnx")
        inputs = {"m": np.array([m], np.int64), "x": np.zeros((1, 4), np.float32)}
        try:
            await graph.compute(inputs, timeout=0.05)
            sys.exit("the run ended before its timeout: the loop is too short")
        except wasinn.TimeoutError_:
            pass
        assert actor.busy == 1, "the run is not running any more"
    assert actor.busy == 0, "the close did not wait"
    assert not any(t.is_alive() for t in threads), "the worker threads were not joined"
    print("closed cleanly")


trio.run(main, sys.argv[1], int(sys.argv[2]))
"""


async def test_closing_with_an_abandoned_real_run_does_not_abort_the_process(
        tmp_path: Path) -> None:
    # Before the close waited for abandoned runs, the interpreter exited with a worker
    # thread inside ONNX Runtime: "terminate called without an active exception", 134.
    require_backend("onnxruntime")
    model = tmp_path / "loop.onnx"
    model.write_bytes(loop_onnx())
    script = tmp_path / "abandon.py"
    script.write_text(ABANDON_AND_EXIT)
    done = await trio.run_process(
        [sys.executable, str(script), str(model), str(LONG_LOOP)],
        capture_stdout=True, capture_stderr=True, check=False)
    stderr = done.stderr.decode(errors="replace")
    assert "terminate called" not in stderr
    assert done.returncode == 0, stderr
    assert done.stdout.decode().strip() == "closed cleanly"


async def test_runtime_must_be_entered_and_closes_cleanly() -> None:
    runtime = wasinn.Runtime()
    with pytest.raises(ClosedResourceError, match="not running"):
        await runtime.load([affine_onnx_bytes()], "onnx")
    async with runtime as rt:
        graph = await rt.load([affine_onnx_bytes()], "onnx")
        ctx = graph.init_execution_context()
    with pytest.raises(ClosedResourceError):
        await ctx.compute({"x": np.ones((1, 4), np.float32)})
    with pytest.raises(ClosedResourceError, match="closed"):
        await runtime.load([affine_onnx_bytes()], "onnx")
    await runtime.aclose()  # idempotent


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
async def test_gpu_compute_keeps_outputs_on_the_device(small_mobilenet: ModelFiles) -> None:
    from wasinn.configs.loader import packaged_config

    async with wasinn.Runtime(packaged_config("pools.toml")) as rt:
        assert any(d.kind is ExecutionTarget.GPU for d in rt.devices)
        image = sample_image(2)
        model = [small_mobilenet.torchscript.read_bytes()]
        expected = (await (await rt.load(model, "pytorch")).compute({0: image}))
        graph = await rt.load(model, "pytorch", target="gpu")
        out = await graph.init_execution_context().compute({0: image})
        (value,) = out.values()
        assert value.native is not None and value.device.startswith("gpu")
        np.testing.assert_allclose(value.numpy(), next(iter(expected.values())).numpy(),
                                   atol=1e-3)
        builders, encoding = affine("pytorch", 2.0, 1.0)
        chain = await rt.load(builders, encoding, target="gpu")
        first = await chain.compute({0: np.ones((2, 4), np.float32)})
        before = wasinn.host_copies()
        second = await chain.compute({0: first["output"]})
        assert wasinn.host_copies() == before
        assert second["output"].device == first["output"].device
        np.testing.assert_allclose(second["output"].numpy(), np.full((2, 4), 7, np.float32))


def test_the_scheduler_names_are_public() -> None:
    for name in ("Runtime", "Graph", "ExecutionContext", "Pipeline", "RuntimeConfig",
                 "ConfigError"):
        assert name in wasinn.__all__
        assert getattr(wasinn, name).__name__ == name
    assert issubclass(wasinn.Pipeline, wasinn.Graph)
    assert issubclass(wasinn.ConfigError, wasinn.InvalidArgumentError)
