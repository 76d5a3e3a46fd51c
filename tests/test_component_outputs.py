"""Outputs a component guest is given: dimensions it can be told, and bytes it is charged.

- A ``tensor-dimensions`` value is a u32, and wasmtime-py stores a bigger int cut to its
  low 32 bits without a word: an output with a dimension past the u32 range is refused
  (too-large naming the output and the limit), never handed over wrapped.
- The older RCs keep a compute's outputs on the context until ``get-output``: they count
  against ``max_live_tensor_bytes`` like handles and staged inputs, each tensor once
  however many hold it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import wasinn
from tests.component_guests import LEGACY_VERSIONS, RecordingRuntime, shim_legacy
from tests.support import require_backend
from tests.test_component_host import CPU, FP32, ONNX, start_shim
from tests.test_component_legacy import context, err, ok, stage
from wasinn.configs.schema import RuntimeConfig
from wasinn.host.component import ComponentGuest
from wasinn.host.limits import GuestLimits
from wasinn.modelgen import onnx_model_bytes

X = np.arange(8, dtype=np.float32).reshape(2, 4)  # 32 bytes in, 32 bytes out of "affine"
#: An empty output (no byte to compute or hold) whose second dimension is past u32.
WIDE = [0, 2**32 + 5]
ONE = np.ones(1, np.float32).tobytes()


def expand_to_onnx(shape: list[int]) -> bytes:
    """``y = Expand(x[1], shape)``: an f32 output of ``shape``, its rank known only at run."""
    from onnx import TensorProto, helper, numpy_helper

    target = numpy_helper.from_array(np.array(shape, dtype=np.int64), "shape")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph([helper.make_node("Expand", ["x", "shape"], ["y"])], "expand",
                              [x], [y], initializer=[target])
    return onnx_model_bytes(graph)


# -- dimensions past u32 ---------------------------------------------------------------------
async def test_an_output_dimension_past_u32_is_refused_not_wrapped(rt: RecordingRuntime) -> None:
    guest, shim = await start_shim(rt, limits=GuestLimits(sandbox=False))
    async with guest:
        graph = await shim.ok("load", [expand_to_onnx(WIDE)], ONNX, CPU)
        ctx = await shim.ok("init", graph)
        x = await shim("tensor-new", [1], FP32, ONE)
        code, message = await shim.err("compute", ctx, [("x", x)])
        assert code == "too-large"
        assert message == ("output 'y' has dimensions [0, 4294967301]: a guest's "
                           "tensor-dimensions holds u32 values, at most 4294967295")
        assert guest.live()["tensor"] == 0  # the input was taken, no output handed out
        # the largest dimension a u32 holds is served as it is
        graph2 = await shim.ok("load", [expand_to_onnx([0, 2**32 - 1])], ONNX, CPU)
        ctx2 = await shim.ok("init", graph2)
        x = await shim("tensor-new", [1], FP32, ONE)
        ((_, y),) = await shim.ok("compute", ctx2, [("x", x)])
        assert await shim("tensor-dims", y) == [0, 2**32 - 1]


@pytest.mark.parametrize("version", LEGACY_VERSIONS)
async def test_get_output_refuses_a_dimension_past_u32(nn_config: RuntimeConfig,
                                                       version: str) -> None:
    require_backend("onnxruntime")
    async with wasinn.Runtime(nn_config) as runtime:
        guest = await ComponentGuest.start(runtime, shim_legacy(version),
                                           limits=GuestLimits(sandbox=False))
        async with guest:
            graph = await ok(guest, "load", [expand_to_onnx(WIDE)], ONNX, CPU)
            ctx = await ok(guest, "init", graph)
            await stage(guest, ctx, "x", ONE, [1])
            await ok(guest, "compute", ctx)
            code, message = await err(guest, "get-output", ctx, "y")
            assert code == "too-large"
            assert "output 'y' has dimensions [0, 4294967301]" in message
            assert "at most 4294967295" in message


# -- the older RCs' kept outputs are charged ---------------------------------------------------
@pytest.fixture(params=LEGACY_VERSIONS)
async def budgeted(request: pytest.FixtureRequest, nn_config: RuntimeConfig
                   ) -> Any:
    """A legacy shim whose live tensors may hold 96 bytes (three of X)."""
    require_backend("onnxruntime")
    async with wasinn.Runtime(nn_config) as runtime:
        guest = await ComponentGuest.start(runtime, shim_legacy(request.param),
                                           limits=GuestLimits(max_live_tensor_bytes=96))
        async with guest:
            yield guest


async def test_outputs_kept_for_get_output_count_against_the_budget(
        budgeted: ComponentGuest) -> None:
    guest = budgeted
    tensors = guest.service.tables.tensors
    graph, first = await context(guest)
    await stage(guest, first, "x", X)
    await ok(guest, "compute", first)
    assert tensors.nbytes == 64  # its staged input and its kept output
    # handles to a kept output hold the same tensor: it is charged once
    y = await ok(guest, "get-output", first, "y")
    y_again = await ok(guest, "get-output", first, "0")
    assert tensors.nbytes == 64 and guest.live()["tensor"] == 2
    second = await ok(guest, "init", graph)
    await stage(guest, second, "x", X)
    assert tensors.nbytes == 96
    # Its output does not fit: before, it was kept uncharged (each of max_contexts
    # contexts could keep a compute's outputs outside the budget).
    code, message = await err(guest, "compute", second)
    assert code == "too-large"
    assert message.startswith("keeping output 'y' for get-output: a tensor of 32 bytes")
    assert "max_live_tensor_bytes" in message
    assert tensors.nbytes == 96
    code, message = await err(guest, "get-output", second, "y")
    assert code == "invalid-argument" and "before a successful compute" in message
    # Dropping the first context frees its input; its output lives on in the handles.
    await guest.call("ctx-drop", first)
    assert tensors.nbytes == 64
    out = np.frombuffer(await guest.call("tensor-data", y_again), np.float32)
    np.testing.assert_allclose(out, (X * 2 + 1).reshape(-1))
    await ok(guest, "compute", second)  # now it fits
    assert tensors.nbytes == 96
    for handle in (y, y_again):
        await guest.call("tensor-drop", handle)
    assert tensors.nbytes == 64  # the second context's input and output
    # a new compute replaces the kept outputs: still one output's worth
    await ok(guest, "compute", second)
    assert tensors.nbytes == 64
    await guest.call("ctx-drop", second)
    await guest.call("graph-drop", graph)
    assert tensors.nbytes == 0
    assert guest.live() == {"tensor": 0, "graph": 0, "graph-execution-context": 0, "error": 0}
