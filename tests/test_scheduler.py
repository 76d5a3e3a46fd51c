"""The async API on the real backends: load, contexts, compute, the staged form, errors,
unload, native tensors between computes, the loop never blocked, cancellation."""

from __future__ import annotations

import array
import ctypes
import functools
import re
import sys
import threading
import time
import tracemalloc
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import wasinn
from tests.backend_models import affine, two_outputs
from tests.loop_model import LONG_LOOP, loop_onnx
from tests.loopwatch import Heartbeat, heartbeat  # noqa: F401 - fixture
from tests.support import LibraryInputs, passed_as_is, require_backend
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
from wasinn.configs.schema import RuntimeConfig
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


async def test_a_bound_buffer_of_another_dtype_or_shape_is_refused_untouched(
        rt: wasinn.Runtime) -> None:
    # Before: a float64 buffer got the f32 output's raw bytes (garbage values) and a
    # (3, 4) buffer for a (2, 4) output was partly written, both without an error.
    builders, encoding = affine("onnxruntime", 2.0, 1.0)
    graph = await rt.load(builders, encoding)
    ctx = graph.init_execution_context()
    await ctx.compute({"x": np.zeros((2, 4), np.float32)})  # outputs 1.0, recorded
    x = {"x": np.ones((2, 4), np.float32)}
    for buffer, said in ((np.full((2, 4), -7.0), "is f32 but its bound buffer is float64"),
                         (np.full((3, 4), -7.0, np.float32),
                          r"has shape \[2, 4\] but its bound buffer has shape \[3, 4\]")):
        ctx.set_output("y", buffer)
        with pytest.raises(InvalidArgumentError, match=said):
            await ctx.compute(x)
        assert (buffer == -7).all()
        # A refused run keeps the last outputs recorded, as a run the backend refuses
        # does (before, the refused run's outputs replaced them).
        np.testing.assert_array_equal(ctx.get_output("y").numpy(), np.full((2, 4), 1.0))
    flat = np.zeros(8, np.float32)  # as many elements, in one dimension: accepted
    ctx.set_output("y", flat)
    await ctx.compute(x)
    assert flat.tolist() == [3.0] * 8
    with pytest.raises(InvalidArgumentError, match="complex64 has no wasi-nn element type"):
        ctx.set_output("y", np.zeros((2, 4), np.complex64))
    # Typed buffers that are not numpy arrays are checked the same way: before, an
    # array.array("i") got the f32 bytes as ints (1077936128), without an error.
    ints = array.array("i", [-7] * 8)
    ctx.set_output("y", ints)
    with pytest.raises(InvalidArgumentError, match="is f32 but its bound buffer is int32"):
        await ctx.compute(x)
    assert list(ints) == [-7] * 8
    floats = array.array("f", [0.0] * 8)
    ctx.set_output("y", memoryview(floats))
    await ctx.compute(x)
    assert list(floats) == [3.0] * 8


@pytest.mark.parametrize("make", [lambda n: (ctypes.c_ubyte * n)(),
                                  ctypes.create_string_buffer,
                                  lambda n: (ctypes.c_byte * n)()],
                         ids=["c_ubyte", "string_buffer", "c_byte"])
async def test_a_ctypes_byte_array_is_bound_as_bytes(
        rt: wasinn.Runtime, make: Callable[[int], Any]) -> None:
    # ctypes gives its byte arrays a byte order ("<B", "<c", "<b"), so they were taken
    # as typed arrays and refused (uint8 "expected a float32 array", |S1 and int8 "no
    # wasi-nn element type"), though embedders reach wasm memory through ctypes.
    builders, encoding = affine("onnxruntime", 2.0, 1.0)
    graph = await rt.load(builders, encoding)
    ctx = graph.init_execution_context()
    buffer = make(40)  # larger than the 32 bytes of the output, as a byte buffer may be
    ctx.set_output("y", buffer)
    await ctx.compute({"x": np.ones((2, 4), np.float32)})
    assert np.frombuffer(bytes(buffer)[:32], np.float32).tolist() == [3.0] * 8


async def test_a_bf16_output_fills_a_bf16_array_in_place(rt: wasinn.Runtime) -> None:
    # Before: binding an ml_dtypes bfloat16 array raised a bare ValueError ("cannot
    # include dtype 'E' in a buffer"): numpy arrays went through a memoryview, which has
    # no format for bf16.
    import ml_dtypes

    from tests.backend_models import identity
    from wasinn import TensorType

    builders, encoding = identity("onnxruntime", TensorType.BF16)
    graph = await rt.load(builders, encoding)
    ctx = graph.init_execution_context()
    values = np.arange(8, dtype=ml_dtypes.bfloat16).reshape(2, 4)
    buffer = np.zeros((2, 4), ml_dtypes.bfloat16)
    ctx.set_output(0, buffer)
    await ctx.compute({"x": values})
    np.testing.assert_array_equal(buffer, values)
    with pytest.raises(InvalidArgumentError, match="is bf16 but its bound buffer is float16"):
        ctx.set_output(0, np.zeros((2, 4), np.float16))
        await ctx.compute({"x": values})
    frozen = np.zeros((2, 4), ml_dtypes.bfloat16)
    frozen.flags.writeable = False
    with pytest.raises(InvalidArgumentError, match="the buffer is read-only"):
        ctx.set_output(0, frozen)
    with pytest.raises(InvalidArgumentError, match="the buffer is not contiguous"):
        ctx.set_output(0, np.zeros((4, 2), ml_dtypes.bfloat16).T)


async def test_a_run_whose_outputs_do_not_all_fit_writes_no_bound_buffer(
        rt: wasinn.Runtime) -> None:
    # Before: the first output was written, then the second's buffer was found too small.
    builders, encoding, (first, second) = two_outputs("onnxruntime")
    graph = await rt.load(builders, encoding)
    ctx = graph.init_execution_context()
    fits, small = bytearray(32), bytearray(16)
    ctx.set_output(first, fits)
    ctx.set_output(second, small)
    with pytest.raises(TooLargeError, match=f"output {second!r} is 32 bytes"):
        await ctx.compute({"x": np.full((2, 4), 5.0, np.float32)})
    assert fits == bytearray(32) and small == bytearray(16)


async def test_a_run_uses_what_was_staged_when_it_was_asked_for(rt: wasinn.Runtime) -> None:
    # Before: a run queued behind a busy device computed on inputs (and wrote into
    # buffers) staged after it was asked for, for the next run.
    builders, encoding = affine("onnxruntime", 2.0, 1.0)
    graph = await rt.load(builders, encoding)
    ctx = graph.init_execution_context()
    (actor,) = rt.actors
    gate = threading.Event()
    first, second = np.zeros((1, 4), np.float32), np.zeros((1, 4), np.float32)
    seen: list[list[list[float]]] = []

    async def run() -> None:
        await ctx.run()
        seen.append(ctx.get_output("y").numpy().tolist())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(functools.partial(actor.execute, lambda: gate.wait(30)))
        await trio.testing.wait_all_tasks_blocked()
        ctx.set_input("x", np.ones((1, 4), np.float32))
        ctx.set_output("y", first)
        nursery.start_soon(run)
        await trio.testing.wait_all_tasks_blocked()  # queued behind the busy device
        ctx.set_input("x", np.full((1, 4), 100, np.float32))  # for the next run
        ctx.set_output("y", second)
        gate.set()
    assert seen == [[[3.0] * 4]]
    assert first.tolist() == [[3.0] * 4] and second.tolist() == [[0.0] * 4]
    await ctx.run()  # the next run: the newly staged input, into the new buffer
    assert second.tolist() == [[201.0] * 4] and first.tolist() == [[3.0] * 4]


async def test_arguments_of_the_wrong_kind_are_refused_not_ignored(rt: wasinn.Runtime) -> None:
    # Before: each of these was accepted and did something else than asked.
    builders, encoding = affine("onnxruntime", 2.0, 1.0)
    graph = await rt.load(builders, encoding)
    x = np.ones((1, 4), np.float32)
    with pytest.raises(InvalidArgumentError,
                       match=r"keep_on_device='no' \(str\): expected True, False or None"):
        await graph.compute({"x": x}, keep_on_device="no")  # type: ignore[arg-type]
    for options, said in (({"optimize": True}, "backend 'onnxruntime' does not read this "
                           "option"),
                          ({"session.intra_op_num_threads": 1}, None)):
        if said is None:
            await rt.load(builders, encoding, backend="onnxruntime", options=options)
            continue
        with pytest.raises(InvalidArgumentError, match=rf"options 'optimize': {said}"):
            await rt.load(builders, encoding, backend="onnxruntime", options=options)
    with pytest.raises(InvalidArgumentError, match=r"options 'sesion.intra_op_num_threads': "
                                                   r"no backend here reads this option"):
        await rt.load(builders, encoding, options={"sesion.intra_op_num_threads": "1"})
    with pytest.raises(InvalidArgumentError, match=r"name 5 \(int\): expected a str"):
        await rt.load(builders, encoding, name=5)  # type: ignore[arg-type]
    ctx = graph.init_execution_context()
    for key in (0.0, True, b"x"):
        with pytest.raises(InvalidArgumentError, match=r"input key .*: expected an input name "
                                                       r"\(str\) or position \(int\)"):
            await ctx.compute({key: x})  # type: ignore[dict-item]
    # numpy integers are positions everywhere, not only in compute
    out = await ctx.compute({np.int64(0): x})  # type: ignore[dict-item]
    ctx.set_input(np.int64(0), x)  # type: ignore[arg-type]
    await ctx.run()
    assert out["y"].numpy().tolist() == ctx.get_output(np.int32(0)).numpy().tolist()  # type: ignore[arg-type]


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
    with LibraryInputs(backend) as into_second:
        second = await ctx.compute({0: first[out_name]}, keep_on_device=True)
    assert wasinn.host_copies() == before
    with LibraryInputs(backend) as into_third:
        third = await ctx.compute({0: second[out_name]})
    assert wasinn.host_copies() == before + 1  # the third's output, brought to the host
    # Nor round the count: the library was handed each previous native output itself.
    assert passed_as_is(into_second, first[out_name].native)
    assert passed_as_is(into_third, second[out_name].native)
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
    with pytest.raises(InvalidArgumentError, match="unknown graph encoding"):
        await rt.load([affine_onnx_bytes()], "keras")
    with pytest.raises(InvalidArgumentError, match="unknown backend"):
        await rt.load([affine_onnx_bytes()], "onnx", backend="tensorrt")
    with pytest.raises(InvalidEncodingError, match="does not read"):
        await rt.load([affine_onnx_bytes()], "onnx", backend="pytorch")
    with pytest.raises(InvalidArgumentError, match="unknown execution target"):
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


def twice_config(tmp_path: Path) -> RuntimeConfig:
    """Models ``a`` and ``b`` (both the affine graph) and the pipeline ``twice`` of them."""
    (tmp_path / "affine.onnx").write_bytes(affine_onnx_bytes())
    return parse_config({
        "models": {"a": {"files": ["affine.onnx"]}, "b": {"files": ["affine.onnx"]}},
        "pipelines": {"twice": {"steps": [{"model": "a"}, {"model": "b"}]}},
    }, tmp_path / "wasinn.toml")


async def test_a_cancelled_unload_still_frees_a_pipelines_steps(tmp_path: Path) -> None:
    config = twice_config(tmp_path)
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


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
async def test_a_gpu_run_ends_when_the_gpu_has_computed_it() -> None:
    # A long chain of large products: torch queues it in well under the time the GPU
    # takes. The compute returns (and frees its slot) only once the actor's stream has
    # run it, so the output's completion event has fired already.
    import io

    import torch

    from wasinn.configs.loader import packaged_config

    class Chain(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(64):
                x = torch.tanh(x @ x) + 1
            return x

    buf = io.BytesIO()
    torch.export.save(torch.export.export(Chain(), (torch.ones(2048, 2048),)), buf)
    x = np.random.default_rng(3).random((2048, 2048), np.float32) / 2048
    async with wasinn.Runtime(packaged_config("pools.toml")) as rt:
        graph = await rt.load([buf.getvalue()], "pytorch", target="gpu")
        ctx = graph.init_execution_context(target="gpu")
        for _ in range(3):
            (out,) = (await ctx.compute({"x": x}, keep_on_device=True)).values()
            ready = out.native._wasinn_ready  # recorded after the run's last kernel
            assert ready.query(), "the compute returned before the GPU had computed it"


def test_the_scheduler_names_are_public() -> None:
    for name in ("Runtime", "Graph", "ExecutionContext", "Pipeline", "RuntimeConfig",
                 "ConfigError"):
        assert name in wasinn.__all__
        assert getattr(wasinn, name).__name__ == name
    assert issubclass(wasinn.Pipeline, wasinn.Graph)
    assert issubclass(wasinn.ConfigError, wasinn.InvalidArgumentError)


async def test_big_endian_inputs_give_the_right_results(rt: wasinn.Runtime) -> None:
    # A ">f4" array (a .npy saved on a big-endian machine) is converted to native order
    # before the backend reads its bytes: y = 2x + 1 of [0, 1, 2, 3] is [1, 3, 5, 7].
    graph = await rt.load([affine_onnx_bytes()], "onnx", backend="onnxruntime")
    x = np.arange(4, dtype=">f4").reshape(1, 4)
    expected = [[1.0, 3.0, 5.0, 7.0]]
    assert (await graph.compute({"x": x}))["y"].numpy().tolist() == expected
    ctx = graph.init_execution_context()
    assert (await ctx.compute({0: x}))["y"].numpy().tolist() == expected
    ctx.set_input("x", x)
    await ctx.run()
    assert ctx.get_output("y").numpy().tolist() == expected
    assert x.dtype == np.dtype(">f4")  # the caller's array is left as it was
    run = await ctx.lease({"x": x})
    assert (await trio.to_thread.run_sync(run.run))["y"].numpy().tolist() == expected


async def test_a_value_with_no_tensor_form_is_an_invalid_argument(rt: wasinn.Runtime) -> None:
    # Converted before the request reaches the device: invalid-argument naming the input,
    # not a runtime-error of the backend's run, and nothing counted as a failed run.
    graph = await rt.load([affine_onnx_bytes()], "onnx")
    ctx = graph.init_execution_context()
    ragged = [[1.0], [1.0, 2.0]]
    for attempt in (graph.compute({"x": ragged}), ctx.compute({"x": ragged}),
                    graph.lease({"x": ragged}), ctx.lease({"x": ragged})):
        with pytest.raises(InvalidArgumentError, match="input 'x': cannot make a tensor"):
            await attempt
    with pytest.raises(InvalidArgumentError, match="input 'x': cannot make a tensor"):
        ctx.set_input("x", ragged)
    with pytest.raises(InvalidArgumentError, match="input 'x': numpy dtype object"):
        graph.try_lease({0: object()})  # (a position is named by its name)
    with pytest.raises(InvalidArgumentError, match="input 'x': numpy dtype <U3"):
        await trio.to_thread.run_sync(ctx.compute_in_caller_thread, {"x": "abc"})
    assert rt.stats()[0].finished == 0  # refused before reaching the device


async def test_numpy_integers_and_floats_are_good_request_terms(rt: wasinn.Runtime) -> None:
    graph = await rt.load([affine_onnx_bytes()], "onnx")
    out = await graph.compute({"x": np.ones((1, 4), np.float32)}, priority=np.int64(3),
                              timeout=np.float32(30))
    assert out["y"].numpy().tolist() == [[3.0] * 4]


@pytest.mark.parametrize(("terms", "message"), [
    ({"priority": "high"}, "priority 'high' (str): expected an integer"),
    ({"priority": True}, "priority True (bool): expected an integer"),
    ({"priority": 2.5}, "priority 2.5 (float): expected an integer"),
    ({"priority": None}, "priority None (NoneType): expected an integer"),
    ({"timeout": "1"}, "timeout '1' (str): expected a number of seconds >= 0, or None"),
    ({"timeout": True}, "timeout True (bool): expected a number of seconds"),
    ({"timeout": -1}, "timeout -1: expected a number of seconds >= 0"),
    ({"timeout": float("nan")}, "timeout nan: expected a number of seconds >= 0"),
    ({"timeout": -10**400}, "timeout -inf: expected a number of seconds >= 0"),
    ({"tenant": 7}, "tenant 7 (int): expected a str"),
    ({"tenant": None}, "tenant None (NoneType): expected a str"),
])
async def test_bad_request_terms_are_invalid_arguments_on_an_idle_device(
        rt: wasinn.Runtime, terms: dict[str, Any], message: str) -> None:
    # Checked at the front door, not only when a request has to queue (the queue's
    # ordering used to raise a raw TypeError then, and only then).
    graph = await rt.load([affine_onnx_bytes()], "onnx")
    ctx = graph.init_execution_context()
    x = {"x": np.ones((1, 4), np.float32)}
    ctx.set_input("x", x["x"])
    for attempt in (graph.compute(x, **terms), ctx.compute(x, **terms), ctx.run(**terms),
                    graph.lease(x, **terms), ctx.lease(x, **terms)):
        with pytest.raises(InvalidArgumentError, match=re.escape(message)):
            await attempt
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        await trio.to_thread.run_sync(functools.partial(ctx.compute_in_caller_thread, x,
                                                        **terms))
    if "priority" not in terms:  # (a lease on a free slot never queues: no priority)
        with pytest.raises(InvalidArgumentError, match=re.escape(message)):
            ctx.try_lease(x, **terms)
        with pytest.raises(InvalidArgumentError, match=re.escape(message)):
            graph.try_lease(x, **terms)
    assert rt.stats()[0].finished == 0
    # Numbers of other kinds are fine: an int timeout, a numpy float.
    out = await ctx.compute(x, priority=3, timeout=np.float32(30), tenant="t")
    assert out["y"].numpy().tolist() == [[3.0] * 4]
    assert (await graph.compute(x, timeout=30))["y"].dims == (1, 4)
    # An integer too large for a float is as good as no timeout (not an OverflowError).
    assert (await graph.compute(x, timeout=10**400))["y"].dims == (1, 4)
    run = ctx.try_lease(x, timeout=10**400)
    assert run is not None
    assert (await trio.to_thread.run_sync(run.run))["y"].dims == (1, 4)


async def test_a_graph_lease_keeps_the_model_until_it_is_over(
        rt: wasinn.Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    # As Graph.compute does: an unload while a lease is held frees after the lease.
    (actor,) = rt.actors
    x = {"x": np.ones((1, 4), np.float32)}
    for how in ("lease", "try_lease", "cancel"):
        graph = await rt.load([affine_onnx_bytes()], "onnx")
        key = actor.session_keys()[-1]
        session = actor.cached_session(key)
        assert session is not None
        closed: list[str] = []
        monkeypatch.setattr(session.compiled, "close",
                            functools.partial(closed.append, how))
        if how == "try_lease":
            lease = await trio.to_thread.run_sync(graph.try_lease, x)
        else:
            lease = await graph.lease(x)
        assert lease is not None
        await graph.unload()
        assert not actor.cached(key) and session.evicted  # no new run may start on it...
        assert closed == []  # ...but the one the lease holds is not closed under it
        if how == "cancel":
            lease.cancel()
        else:
            out = await trio.to_thread.run_sync(lease.run)
            assert out["y"].numpy().tolist() == [[3.0] * 4]
        assert closed == [how]  # freed once the lease is over
    stats = rt.stats()[0]
    assert (stats.completed, stats.failed, stats.cancelled) == (2, 0, 1)


async def test_a_pipeline_lease_keeps_its_steps_until_it_is_over(tmp_path: Path) -> None:
    config = twice_config(tmp_path)
    async with wasinn.Runtime(config) as rt:
        (actor,) = rt.actors
        x = {"x": np.ones((1, 4), np.float32)}
        for how in ("lease", "try_lease"):
            pipeline = await rt.load_by_name("twice")
            if how == "lease":
                lease = await pipeline.lease(x)
            else:
                lease = await trio.to_thread.run_sync(pipeline.try_lease, x)
            assert lease is not None
            await pipeline.unload()
            assert actor.session_keys() == []  # evicted; the lease holds what it runs
            out = await trio.to_thread.run_sync(lease.run)
            assert out["y"].numpy().tolist() == [[7.0] * 4]  # 2 * (2 * 1 + 1) + 1
        assert rt.stats()[0].completed == 2


async def test_a_context_closed_during_its_compute_records_nothing() -> None:
    # The run ends after the close: the compute raises ClosedResourceError, and neither
    # get_output nor the bound buffer sees the outputs.
    require_backend("onnxruntime")
    async with wasinn.Runtime(one_worker_config()) as rt:
        (actor,) = rt.actors
        graph = await rt.load([loop_onnx()], "onnx")
        ctx = graph.init_execution_context()
        buffer = np.zeros((1, 4), np.float32)
        ctx.set_output("y", buffer)
        failures: list[str] = []

        async def compute() -> None:
            try:
                await ctx.compute({"m": np.array([LONG_LOOP // 4], np.int64),
                                   "x": np.zeros((1, 4), np.float32)})
            except ClosedResourceError as exc:
                failures.append(exc.message)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(compute)
            with trio.fail_after(10):
                while actor.busy == 0:  # not running in the worker thread yet
                    await trio.sleep(0.001)
            ctx.close()
        assert failures == [f"the execution context of {graph.name} was closed while its "
                            "request ran: the outputs were dropped"]
        assert not buffer.any()
        with pytest.raises(ClosedResourceError, match="is closed"):
            ctx.get_output("y")
        # A lease of a context closed before its run gives the slot back unrun.
        ctx = graph.init_execution_context()
        run = await ctx.lease({"m": np.array([1], np.int64), "x": np.zeros((1, 4), np.float32)})
        ctx.close()
        with pytest.raises(ClosedResourceError, match="is closed: the request was not run"):
            await trio.to_thread.run_sync(run.run)
        assert actor.stats().running == 0


async def test_requests_after_the_runtime_closed_say_so() -> None:
    async with wasinn.Runtime() as rt:
        graph = await rt.load([affine_onnx_bytes()], "onnx")
        ctx = graph.init_execution_context()
    x = {"x": np.ones((1, 4), np.float32)}
    for attempt in (graph.compute(x), ctx.compute(x), ctx.run(), graph.lease(x),
                    ctx.lease(x)):
        with pytest.raises(ClosedResourceError, match="the runtime is closed"):
            await attempt
    for call in (graph.init_execution_context, functools.partial(ctx.try_lease, x),
                 functools.partial(graph.try_lease, x)):
        with pytest.raises(ClosedResourceError, match="the runtime is closed"):
            call()


async def test_a_fallback_whose_pool_found_no_device_is_named() -> None:
    config = parse_config({
        "runtime": {"fallback": "gpu"},
        "pools": {"cpu": {"kind": "cpu", "devices": ["cpu"]},
                  "gpu": {"kind": "gpu", "devices": "auto"}},
    }, None)
    async with wasinn.Runtime(config) as rt:
        if any(d.kind is not ExecutionTarget.CPU for d in rt.devices):
            pytest.skip("this machine has a gpu or tpu device")
        graph = await rt.load([affine_onnx_bytes()], "onnx")
        with pytest.raises(UnsupportedOperationError) as caught:
            graph.init_execution_context("tpu")
    assert caught.value.message == (
        "no tpu device in this runtime (devices here: cpu), and none for its fallback "
        "either: [runtime] fallback = 'gpu', but the gpu pool found no device: expected a "
        "tpu or gpu device")


async def test_the_fallback_warning_points_at_the_callers_line() -> None:
    async with wasinn.Runtime(one_worker_config(fallback="cpu")) as rt:
        if any(d.kind is not ExecutionTarget.CPU for d in rt.devices):
            pytest.skip("this machine has a gpu or tpu device")
        with pytest.warns(RuntimeWarning, match="target tpu falls back to cpu") as loaded:
            graph = await rt.load([affine_onnx_bytes()], "onnx", target="tpu")
        with pytest.warns(RuntimeWarning, match="target gpu falls back to cpu") as made:
            graph.init_execution_context("gpu")
    for record in (*loaded, *made):
        assert record.filename == __file__, record.filename


async def test_an_alias_names_the_same_input_and_output_in_every_form(
        rt: wasinn.Runtime) -> None:
    # Before: compute({"x": ...}) took OpenVINO's alias of the TensorFlow input x:0, but
    # set_input("x") and get_output("y") said the graph had no such input or output.
    require_backend("openvino")
    from tests.tfmodels import relu_graphdef

    graph = await rt.load([relu_graphdef()], backend="openvino")
    assert [s.name for s in graph.inputs] == ["x:0"] and [s.name for s in graph.outputs] == ["y:0"]
    ctx = graph.init_execution_context()
    x = np.array([[-1, 2, -3, 4]], np.float32)
    out = await ctx.compute({"x": x})
    ctx.set_input("x", x)
    buffer = np.zeros((1, 4), np.float32)
    ctx.set_output("y", buffer)
    await ctx.run()
    for key in ("y", "y:0", 0):
        assert ctx.get_output(key).numpy().tolist() == out["y:0"].numpy().tolist() == [[0, 2, 0, 4]]
    assert buffer.tolist() == [[0, 2, 0, 4]]
    with pytest.raises(InvalidArgumentError, match="has no input 'z'"):
        ctx.set_input("z", x)


def _bf16_add_onnx() -> bytes:
    # ONNX Runtime 1.31 has no bf16 Add kernel on the CPU; OpenVINO runs it.
    from onnx import TensorProto, helper

    from wasinn.modelgen import onnx_model_bytes

    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [3])],
        [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [3])])
    return onnx_model_bytes(graph)


async def test_a_model_its_first_backend_cannot_run_runs_on_the_next_with_a_warning(
        rt: wasinn.Runtime, caplog: pytest.LogCaptureFixture) -> None:
    # Before: the load failed as invalid-encoding (ONNX Runtime's NOT_IMPLEMENTED), though
    # the model is well formed and OpenVINO, next in the preference order, runs it.
    import logging

    import ml_dtypes

    require_backend("onnxruntime")
    require_backend("openvino")
    model = _bf16_add_onnx()
    with pytest.raises(UnsupportedOperationError,
                       match=r"^model 'adder': onnxruntime: ONNX Runtime cannot run the model "
                             r"on cpu: .*NOT_IMPLEMENTED.*Add.*: expected operators and "
                             r"element types it implements there$"):
        await rt.load([model], backend="onnxruntime", name="adder")  # named: no other
    x = np.array([1, 2, 3], ml_dtypes.bfloat16)
    for options in ({}, {"sandbox": True}):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="wasinn.scheduler"):
            graph = await rt.load([model], options=options, name="adder")
        assert graph.backend == "openvino"
        (said,) = [r.getMessage() for r in caplog.records]
        assert said.startswith("adder: backend onnxruntime cannot run it on cpu (onnxruntime: "
                               "ONNX Runtime cannot run the model on cpu: ")
        assert said.endswith("): it runs on openvino instead")
        out = await graph.compute({"x": x})
        assert out["y"].numpy().tolist() == [2, 4, 6]

