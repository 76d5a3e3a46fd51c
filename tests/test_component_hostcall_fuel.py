"""Wasmtime's per-call bound on what a component guest may copy into the host.

A call whose list arguments hold more than 2,796,202 values (128 MiB of hostcall fuel at
48 bytes a value; wasmtime-py cannot raise it) traps before the host sees it. The guest
gets a message naming the bound and the ways round (wasinn:nn/bulk, wasinn:nn/scratch,
load-by-name), and those ways carry real-size tensors and models.

Driven through the shim component (tests/components/shim_1028.wat), which forwards its
arguments to the import they name.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.component_guests import RecordingRuntime, shim_1028_starting
from tests.test_component_host import CPU, FP32, ONNX, TYPES, start_shim
from wasinn.host.component import ComponentGuest
from wasinn.host.component.hostcall_fuel import EXHAUSTED, MAX_VALUES_PER_CALL, exhausted
from wasinn.host.runner import GuestTrap
from wasinn.modelgen import onnx_model_bytes

U8 = TYPES.index("U8")
#: An f32 1x3x512x512 image: 3 MiB, past the bound as list<u8>.
IMAGE_512 = (1, 3, 512, 512)


def _assert_explains_the_bound(message: str, program: str = "shim_1028") -> None:
    assert message.startswith(f"{program} trapped: one of its calls passed the host more "
                              "list values than Wasmtime lets one call copy")
    assert "at most 2,796,202 values in all" in message
    assert "hostcall fuel of 128 MiB at 48 bytes a value" in message
    assert "a list<u8> of at most about 2.8 MB" in message
    assert "wasinn:nn/bulk's tensor-from-words (8 bytes a value: up to about 22.4 MB" in message
    assert "wasinn:nn/scratch's tensor-from-scratch (any size up to [guests] max_tensor_bytes" \
        in message
    assert ("models with wasinn:nn/scratch's load-from-scratch (any size up to [guests] "
            "max_model_bytes, through files)") in message
    assert "load-words (up to about 22.4 MB of builders a call) or load-by-name" in message
    assert message.rstrip().endswith(EXHAUSTED)  # wasmtime's own words, last


async def _affine_still_works(rt: RecordingRuntime) -> None:
    guest, shim = await start_shim(rt)
    async with guest:
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        _graph, ctx = await shim.context("affine")
        ((_, y),) = await shim.ok("compute", ctx, [("x", await shim.tensor(x))])
        np.testing.assert_allclose(await shim.data(y), (x * 2 + 1).reshape(-1))


async def test_a_spec_tensor_of_a_512x512_image_traps_naming_the_bound_and_the_ways_round(
        rt: RecordingRuntime) -> None:
    image = np.zeros(IMAGE_512, dtype=np.float32)
    guest, shim = await start_shim(rt)
    async with guest:
        with pytest.raises(GuestTrap) as trapped:
            await shim("tensor-new", list(IMAGE_512), FP32, image.tobytes())
        _assert_explains_the_bound(str(trapped.value))
        # the instance is dead, and says why
        with pytest.raises(GuestTrap, match=r"cannot be called again: it trapped .*2,796,202"):
            await shim("tensor-new", [1], U8, b"\0")
    await _affine_still_works(rt)


async def test_a_spec_load_of_a_3_mib_builder_traps_naming_the_bound(rt: RecordingRuntime
                                                                     ) -> None:
    guest, shim = await start_shim(rt)
    async with guest:
        with pytest.raises(GuestTrap) as trapped:
            await shim("load", [bytes(3 * 1024**2)], ONNX, CPU)
        _assert_explains_the_bound(str(trapped.value))
    assert all(g.unloaded for g in rt.graphs)


async def test_a_start_function_past_the_bound_traps_naming_it(rt: RecordingRuntime) -> None:
    size = 3 * 1024**2
    # grow the memory past 64 KiB + size, dims [size] at 0, the tensor's bytes at 64 KiB
    then = (f"(drop (memory.grow (i32.const {size // 65536 + 1})))"
            f" (i32.store (i32.const 0) (i32.const {size}))"
            f" (call $tensor.drop (call $tensor.new (i32.const 0) (i32.const 1)"
            f" (i32.const {U8}) (i32.const 65536) (i32.const {size})))")
    with pytest.raises(GuestTrap) as trapped:
        await ComponentGuest.start(rt, shim_1028_starting(then), program="starting")
    _assert_explains_the_bound(str(trapped.value), "starting")
    assert all(g.unloaded for g in rt.graphs)  # the graph its start loaded by name


async def test_the_bound_is_exact(rt: RecordingRuntime) -> None:
    """The figures the message gives hold for the installed Wasmtime: dims [n] take one
    value, so n bytes pass up to the bound and one more traps."""
    n = MAX_VALUES_PER_CALL - 1
    guest, shim = await start_shim(rt)
    async with guest:
        t = await shim("tensor-new", [n], U8, bytes(n))
        assert await shim("tensor-dims", t) == [n]
    guest, shim = await start_shim(rt)
    async with guest:
        with pytest.raises(GuestTrap, match="2,796,202 values"):
            await shim("tensor-new", [n + 1], U8, bytes(n + 1))


async def test_16_mib_of_tensor_data_pass_as_words(rt: RecordingRuntime) -> None:
    data = np.random.default_rng(0).integers(0, 256, 16 * 1024**2, dtype=np.uint8).tobytes()
    guest, shim = await start_shim(rt)
    async with guest:
        t = await shim.ok("tensor-from-words", [len(data)], U8, data)
        assert await shim("tensor-dims", t) == [len(data)]
        assert bytes(await shim("tensor-words", t)) == data


def _matmul_onnx(weights: np.ndarray[Any, Any]) -> bytes:
    """``y = x @ W``, with ``W`` as an initializer: a model as big as ``W``."""
    from onnx import TensorProto, helper, numpy_helper

    rows, cols = weights.shape
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, rows])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, cols])
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "matmul",
                              [x], [y], initializer=[numpy_helper.from_array(weights, "W")])
    return onnx_model_bytes(graph)


async def test_a_model_over_14_mb_loads_as_words_and_computes(rt: RecordingRuntime) -> None:
    rng = np.random.default_rng(1)
    weights = rng.standard_normal((1024, 4096)).astype(np.float32)  # 16 MiB
    model = _matmul_onnx(weights)
    assert len(model) > 14_000_000
    x = rng.standard_normal((1, 1024)).astype(np.float32)
    guest, shim = await start_shim(rt)
    async with guest:
        padded = model + b"\0" * (-len(model) % 8)
        graph = await shim.ok("load-words", [(len(model), padded)], ONNX, CPU)
        ctx = await shim.ok("init", graph)
        ((_, y),) = await shim.ok("compute", ctx, [("x", await shim.tensor(x))])
        np.testing.assert_allclose(await shim.data(y), (x @ weights).reshape(-1),
                                   rtol=1e-4, atol=1e-3)


def test_only_the_root_cause_counts() -> None:
    """A guest names its own functions: the text in its backtrace is not the trap."""
    trap = ("error while executing at wasm backtrace:\n    0:  0x1 - Main!{}\n\n"
            "Caused by:\n    {}")
    assert exhausted(trap.format("f", EXHAUSTED))
    assert not exhausted(trap.format(EXHAUSTED, "wasm trap: wasm `unreachable` instruction "
                                                "executed"))
    assert not exhausted("")
