"""What one ``tensor.data()`` / ``tensor-words`` call may hand a component guest.

Wasmtime's C API spends about 80 bytes of host memory per byte of a ``list<u8>`` it
lowers into a guest (10 per byte as ``list<u64>`` words), and an allocation it cannot
make aborts the whole host process. So the host bounds one call (``[guests]
max_data_bytes``, 8 times that as words) before any list is built; the calls have no
error case, so past the bound the guest is trapped with a message naming the limit and
``tensor-to-scratch``, and every other guest goes on.

The limits here are a few bytes, so the tests need no memory to speak of.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import wasinn
from tests.component_guests import RecordingRuntime
from tests.test_component_host import CPU, FP32, ONNX, start_shim
from tests.test_component_scratch import start as start_scratch_guest
from wasinn.configs import ConfigError
from wasinn.configs.loader import parse_config
from wasinn.host.component import fastlist
from wasinn.host.limits import GuestLimits, limits_of
from wasinn.host.runner import GuestTrap
from wasinn.modelgen import onnx_model_bytes

X = np.arange(8, dtype=np.float32).reshape(2, 4)  # 32 bytes
ROW = X[:1]  # 16 bytes


def expand_onnx(n: int) -> bytes:
    """``y = Expand(x[1], [n])``: a model of a few hundred bytes with an n-float output."""
    from onnx import TensorProto, helper, numpy_helper

    shape = numpy_helper.from_array(np.array([n], dtype=np.int64), "shape")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [n])
    graph = helper.make_graph([helper.make_node("Expand", ["x", "shape"], ["y"])], "expand",
                              [x], [y], initializer=[shape])
    return onnx_model_bytes(graph)


@pytest.fixture
def lowered(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every list<u8> the host builds for wasmtime to lower into a guest."""
    sizes: list[int] = []
    build = fastlist.bytes_to_vallist

    def spy(data: Any, ptr: Any) -> None:
        sizes.append(len(memoryview(data).cast("B")) if not isinstance(data, np.ndarray)
                     else int(data.nbytes))
        build(data, ptr)

    monkeypatch.setattr(fastlist, "bytes_to_vallist", spy)
    return sizes


async def test_data_over_the_bound_traps_only_that_guest(rt: RecordingRuntime,
                                                         lowered: list[int]) -> None:
    limits = GuestLimits(max_data_bytes=16)
    bystander, other = await start_shim(rt, limits=limits)
    async with bystander:
        graph, ctx = await other.context("affine")  # live in another guest throughout
        guest, shim = await start_shim(rt, limits=limits)
        async with guest:
            t = await shim.tensor(X)
            lowered.clear()
            with pytest.raises(GuestTrap) as trapped:
                await shim("tensor-data", t)
            message = str(trapped.value)
            assert "tensor.data() of a tensor of 32 bytes" in message
            assert "limit of 16 bytes a call ([guests] max_data_bytes" in message
            assert "about 80 bytes of memory per value" in message
            # what to use instead: this shim imports no wasinn:nn/scratch
            assert "tensor-to-scratch" in message and "has no scratch directory" in message
            assert "tensor-words, up to 128 bytes a call" in message
            assert lowered == []  # refused before any list was built
            with pytest.raises(GuestTrap, match="cannot be called again"):
                await shim("tensor-dims", t)
        # The host and the other guest go on: a call at the bound is served.
        ((_, y),) = await other.ok("compute", ctx, [("x", await other.tensor(ROW))])
        lowered.clear()
        np.testing.assert_array_equal(await other.data(y), (ROW * 2 + 1).reshape(-1))
        assert lowered == [16]  # the output, lowered into the guest
        for name, handle in (("tensor-drop", y), ("ctx-drop", ctx), ("graph-drop", graph)):
            await other(name, handle)
        assert bystander.live() == {"tensor": 0, "graph": 0, "graph-execution-context": 0,
                                    "error": 0}


async def test_tensor_words_carry_eight_times_the_bound(rt: RecordingRuntime) -> None:
    guest, shim = await start_shim(rt, limits=GuestLimits(max_data_bytes=16))
    async with guest:
        values = np.arange(32, dtype=np.float32)  # 128 bytes: 16 words
        t = await shim.tensor(values)
        words = await shim("tensor-words", t)
        assert np.array_equal(np.frombuffer(bytes(words), np.float32), values)
        more = await shim.tensor(np.arange(33, dtype=np.float32))  # 132 bytes
        with pytest.raises(GuestTrap) as trapped:
            await shim("tensor-words", more)
        message = str(trapped.value)
        assert "tensor-words of a tensor of 132 bytes" in message
        assert "limit of 128 bytes a call ([guests] max_data_bytes x 8 for words" in message
        assert "tensor-to-scratch" in message and "tensor-words, up to" not in message


async def test_an_output_over_max_tensor_bytes_traps_data(rt: RecordingRuntime) -> None:
    """Outputs are bounded by ``max_tensor_bytes`` when the guest reads them, as the core
    ABI's get_output and tensor-to-scratch bound them."""
    guest, shim = await start_shim(rt, limits=GuestLimits(max_tensor_bytes=64, sandbox=False))
    async with guest:
        graph = await shim.ok("load", [expand_onnx(32)], ONNX, CPU)
        ctx = await shim.ok("init", graph)
        x = await shim("tensor-new", [1], FP32, np.ones(1, np.float32).tobytes())
        ((_, y),) = await shim.ok("compute", ctx, [("x", x)])
        assert await shim("tensor-dims", y) == [32]  # the output itself is served
        with pytest.raises(GuestTrap, match=r"tensor.data\(\) of a tensor of 128 bytes: over "
                                            r"this guest's limit of 64 bytes per tensor "
                                            r"\(\[guests\] max_tensor_bytes\)"):
            await shim("tensor-data", y)


async def test_tensor_to_scratch_reads_what_data_may_not(rt: RecordingRuntime) -> None:
    limits = GuestLimits(max_data_bytes=16)
    guest, g = await start_scratch_guest(rt, limits=limits)
    async with guest:
        await g.write("x.bin", X.tobytes())
        t = await g.from_scratch("x.bin", [2, 4])
        with pytest.raises(GuestTrap) as trapped:
            await g("tensor-data", t)
        message = str(trapped.value)
        assert "max_data_bytes" in message
        assert "tensor-to-scratch, which has no such limit" in message
        assert "scratch directory" not in message  # this guest has one
    guest, g = await start_scratch_guest(rt, limits=limits)
    async with guest:
        await g.write("x.bin", X.tobytes())
        t = await g.from_scratch("x.bin", [2, 4])
        assert await g.ok("to-scratch", t, "y.bin") == X.nbytes
        got = await g("read-file", "y.bin", X.nbytes)
        assert np.array_equal(np.frombuffer(bytes(got), np.float32), X.reshape(-1))


def test_max_data_bytes_comes_from_the_guests_table() -> None:
    config = parse_config({"guests": {"max_data_bytes": 4096}}, None)
    assert limits_of(wasinn.Runtime(config)).max_data_bytes == 4096
    assert GuestLimits().max_data_bytes == 16 * 1024**2
    assert limits_of(wasinn.Runtime(parse_config({}, None))).max_data_bytes == 16 * 1024**2
    for bad in (0, -1, "big"):
        with pytest.raises(ConfigError, match=r"guests\.max_data_bytes"):
            parse_config({"guests": {"max_data_bytes": bad}}, None)
