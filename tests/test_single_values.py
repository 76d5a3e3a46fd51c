"""The spec's single value (seed 003: "To represent a tensor containing a single value, use
[1]"): a guest's one-value ``[1]`` tensor for a model's scalar (rank 0) input is read as
that scalar, in both guest ABIs; ``[]`` works as well; other shapes are still refused
(see wasinn.host.single_values)."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

import wasinn
from tests.backend_models import scalar_onnx
from tests.component_guests import RecordingRuntime
from tests.support import require_backend
from tests.test_component_host import CPU, ENCODINGS, FP32, ONNX, start_shim
from tests.test_core_fuzz import Guest, in_guest
from wasinn.backends.base import TensorSpec
from wasinn.enums import TensorType
from wasinn.host.abi import Errno
from wasinn.host.single_values import reads_as_scalar

CODES = ["invalid-argument", "invalid-encoding", "timeout", "runtime-error",
         "unsupported-operation", "too-large", "not-found", "security", "unknown"]


def test_only_one_value_in_one_dimension_reads_as_a_declared_scalar() -> None:
    scalar = TensorSpec("x", TensorType.F32, ())
    assert reads_as_scalar((1,), scalar)
    assert not reads_as_scalar((), scalar)  # (a scalar already)
    for dims in [(1, 1), (2,), (0,)]:
        assert not reads_as_scalar(dims, scalar)
    assert not reads_as_scalar((1,), TensorSpec("x", TensorType.F32, (1,)))
    assert not reads_as_scalar((1,), TensorSpec("x", TensorType.F32, (), rank_known=False))


async def test_a_component_gives_a_scalar_input_as_one_value_in_dimensions_1() -> None:
    # Before: [1] got invalid-argument "input 'x' has shape [1] but the model expects
    # x: f32[]", though the spec says to write a single value so.
    require_backend("onnxruntime")
    async with wasinn.Runtime() as inner:
        guest, shim = await start_shim(RecordingRuntime(inner))
        async with guest:
            graph = (await shim("load", [scalar_onnx(2.0)], ONNX, CPU)).payload
            ctx = (await shim("init", graph)).payload
            for dims in ([], [1]):
                tensor = await shim("tensor-new", dims, FP32, np.float32([3]).tobytes())
                result = await shim("compute", ctx, [("x", tensor)])
                assert not isinstance(result, int), (dims, CODES[await shim("error-code",
                                                                            result)])
                (name, y), = result
                assert name == "y"
                assert await shim("tensor-dims", y) == []  # a scalar output: []
                assert np.frombuffer(await shim("tensor-data", y), np.float32).tolist() == [6]
            tensor = await shim("tensor-new", [1, 1], FP32, np.float32([3]).tobytes())
            refused = await shim("compute", ctx, [("x", tensor)])
            assert isinstance(refused, int)
            assert CODES[await shim("error-code", refused)] == "invalid-argument"


async def test_a_core_guest_gives_a_scalar_input_as_one_value_in_dimensions_1() -> None:
    require_backend("onnxruntime")
    model = scalar_onnx(2.0)
    got: dict[str, object] = {}

    def body(guest: Guest) -> None:
        guest.write(0x8000, model)
        guest.write(0x7000, struct.pack("<II", 0x8000, len(model)))
        assert guest.call("load", 0x7000, 1, 1, 0, 0x10) == Errno.SUCCESS
        ctx = guest.context(guest.u32(0x10))
        guest.write(0x1000, np.float32([3]).tobytes())
        for dims in ([], [1], [1, 1]):
            record = guest.record(0x2000, dims, 1, 0x1000, 4)
            errno = guest.call("set_input", ctx, 0, record)
            if errno == Errno.SUCCESS:
                assert guest.call("compute", ctx) == Errno.SUCCESS
                assert guest.call("get_output", ctx, 0, 0x3000, 4, 0x20) == Errno.SUCCESS
                errno = int(np.frombuffer(guest.read(0x3000, 4), np.float32)[0])
            got[str(dims)] = errno

    async with wasinn.Runtime() as rt:
        await in_guest(rt, body)
    # [] and [1] compute 2 * 3; [1, 1] is refused (invalid_argument)
    assert got == {"[]": 6, "[1]": 6, "[1, 1]": Errno.INVALID_ARGUMENT}


def _scalar_ir_named_twice(tmp: str) -> list[bytes]:
    """An OpenVINO IR, y = 2x over f32 scalars, whose input answers to 'x' and 'x:0' (as
    a TensorFlow model's read by OpenVINO does)."""
    import os

    import openvino as ov
    import openvino.opset13 as ops

    x = ops.parameter([], np.float32, name="x")
    x.output(0).get_tensor().set_names({"x", "x:0"})
    y = ops.multiply(x, ops.constant(np.float32(2.0)))
    y.output(0).get_tensor().set_names({"y"})
    xml, weights = os.path.join(tmp, "m.xml"), os.path.join(tmp, "m.bin")
    ov.serialize(ov.Model([y], [x], "scalar"), xml, weights)
    with open(xml, "rb") as a, open(weights, "rb") as b:
        return [a.read(), b.read()]


async def test_a_scalar_input_named_by_another_of_its_names_takes_one_value_in_1(
        tmp_path: Path) -> None:
    # Before: [1] given as 'x:0' (an alias the backend takes) was refused, as 'x' not.
    require_backend("openvino")
    model = _scalar_ir_named_twice(str(tmp_path))
    async with wasinn.Runtime() as inner:
        guest, shim = await start_shim(RecordingRuntime(inner))
        async with guest:
            graph = (await shim("load", model, ENCODINGS.index("openvino"), CPU)).payload
            ctx = (await shim("init", graph)).payload
            for name in ("x", "x:0"):
                tensor = await shim("tensor-new", [1], FP32, np.float32([3]).tobytes())
                result = await shim("compute", ctx, [(name, tensor)])
                assert not isinstance(result, int), (name, await shim("error-data", result))
                (_, y), = result
                assert np.frombuffer(await shim("tensor-data", y), np.float32).tolist() == [6]
