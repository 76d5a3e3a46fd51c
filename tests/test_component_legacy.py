"""The earlier release candidates (2024-08-19, 2024-06-25), served by the same host.

Their context has ``set-input`` / ``compute`` / ``get-output`` by name; 2024-06-25 also
lets a guest construct an ``error``. The hand-written shim_legacy.wat component is
instantiated once per version.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from wasmtime.component import Variant

import wasinn
from tests.component_guests import LEGACY_VERSIONS, RecordingRuntime, shim_legacy
from tests.support import require_backend
from wasinn.configs.schema import RuntimeConfig
from wasinn.host.component import ComponentGuest
from wasinn.host.component.tables import MAX_ERROR_MESSAGE_BYTES, ContextEntry
from wasinn.host.limits import GuestLimits
from wasinn.host.runner import GuestTrap

CODES = ["invalid-argument", "invalid-encoding", "timeout", "runtime-error",
         "unsupported-operation", "too-large", "not-found", "security", "unknown"]
FP32 = 1
X = np.arange(8, dtype=np.float32).reshape(2, 4)


@pytest.fixture(params=LEGACY_VERSIONS)
async def legacy(request: pytest.FixtureRequest, nn_config: RuntimeConfig
                 ) -> AsyncIterator[tuple[ComponentGuest, RecordingRuntime, str]]:
    require_backend("onnxruntime")
    async with wasinn.Runtime(nn_config) as runtime:
        rt = RecordingRuntime(runtime)
        guest = await ComponentGuest.start(rt, shim_legacy(request.param),
                                           program=f"shim@{request.param}")
        async with guest:
            yield guest, rt, request.param


#: Shim exports whose WIT result is ``result<_, error>``: None, or an error handle.
UNTAGGED = {"set-input", "compute"}


async def ok(guest: ComponentGuest, name: str, *args: Any) -> Any:
    result = await guest.call(name, *args)
    if isinstance(result, Variant):
        assert result.tag == "ok", (result, await error_of(guest, result.payload))
        return result.payload
    if name in UNTAGGED:
        assert result is None, await error_of(guest, result)
    return result


async def error_of(guest: ComponentGuest, handle: int) -> tuple[str, str]:
    code = CODES[await guest.call("error-code", handle)]
    message = await guest.call("error-data", handle)
    await guest.call("error-drop", handle)
    return code, message


async def err(guest: ComponentGuest, name: str, *args: Any) -> tuple[str, str]:
    result = await guest.call(name, *args)
    if isinstance(result, Variant):  # result<handle, error>
        assert result.tag == "err", result
        result = result.payload
    assert isinstance(result, int), f"{name} succeeded: {result!r}"  # result<_, error>
    return await error_of(guest, result)


async def stage(guest: ComponentGuest, ctx: int, name: str, values: np.ndarray | bytes,
                dims: list[int] | None = None) -> None:
    """``set-input(ctx, name, tensor)`` of f32 ``values`` (bytes: of shape ``dims``)."""
    if isinstance(values, np.ndarray):
        dims, values = list(values.shape), values.astype(np.float32).tobytes()
    await ok(guest, "set-input", ctx, name, await guest.call("tensor-new", dims, FP32, values))


async def context(guest: ComponentGuest, model: str = "affine") -> tuple[int, int]:
    graph = await ok(guest, "load-by-name", model)
    return graph, await ok(guest, "init", graph)


async def test_set_input_compute_get_output(legacy: tuple[ComponentGuest, Any, str]) -> None:
    guest, rt, _ = legacy
    graph, ctx = await context(guest)
    t = await guest.call("tensor-new", [2, 4], FP32, X.tobytes())
    assert await ok(guest, "set-input", ctx, "x", t) is None
    assert await ok(guest, "compute", ctx) is None
    y = await ok(guest, "get-output", ctx, "y")
    assert await guest.call("tensor-dims", y) == [2, 4]
    out = np.frombuffer(await guest.call("tensor-data", y), np.float32)
    np.testing.assert_allclose(out, (X * 2 + 1).reshape(-1))
    # an output by index, as some guests of these versions ask for it
    y0 = await ok(guest, "get-output", ctx, "0")
    assert await guest.call("tensor-data", y0) == await guest.call("tensor-data", y)
    for name, handle in (("tensor-drop", y), ("tensor-drop", y0), ("graph-drop", graph),
                         ("ctx-drop", ctx)):
        await guest.call(name, handle)
    assert guest.live() == {"tensor": 0, "graph": 0, "graph-execution-context": 0, "error": 0}
    assert all(g.unloaded for g in rt.graphs)


async def test_recompute_with_new_inputs(legacy: tuple[ComponentGuest, Any, str]) -> None:
    guest, _, _ = legacy
    _graph, ctx = await context(guest)
    for scale in (1.0, 5.0):
        t = await guest.call("tensor-new", [2, 4], FP32, (X * scale).tobytes())
        await ok(guest, "set-input", ctx, "x", t)
        await ok(guest, "compute", ctx)
        y = await ok(guest, "get-output", ctx, "y")
        out = np.frombuffer(await guest.call("tensor-data", y), np.float32)
        np.testing.assert_allclose(out, (X * scale * 2 + 1).reshape(-1))


async def test_get_output_before_compute(legacy: tuple[ComponentGuest, Any, str]) -> None:
    guest, _, _ = legacy
    _graph, ctx = await context(guest)
    code, message = await err(guest, "get-output", ctx, "y")
    assert code == "invalid-argument"
    assert "before a successful compute" in message


async def test_a_failed_compute_leaves_no_outputs_of_an_earlier_one(
        legacy: tuple[ComponentGuest, Any, str]) -> None:
    # Before: get-output after the failed compute returned the first run's outputs.
    guest, _, _ = legacy
    _graph, ctx = await context(guest)
    await stage(guest, ctx, "x", X)
    await ok(guest, "compute", ctx)
    await stage(guest, ctx, "x", bytes(36), [3, 3])
    code, _ = await err(guest, "compute", ctx)
    assert code == "invalid-argument"
    code, message = await err(guest, "get-output", ctx, "y")
    assert code == "invalid-argument" and "before a successful compute" in message


async def test_compute_without_inputs(legacy: tuple[ComponentGuest, Any, str]) -> None:
    guest, _, _ = legacy
    _graph, ctx = await context(guest)
    code, message = await err(guest, "compute", ctx)
    assert code == "invalid-argument"
    assert "set-input" in message


async def test_unknown_output_name(legacy: tuple[ComponentGuest, Any, str]) -> None:
    guest, _, _ = legacy
    _graph, ctx = await context(guest)
    await stage(guest, ctx, "x", X)
    await ok(guest, "compute", ctx)
    code, message = await err(guest, "get-output", ctx, "nope")
    assert code == "not-found"
    assert "nope" in message and "'y'" not in message and "y" in message


async def test_bad_input_is_reported_by_set_input(legacy: tuple[ComponentGuest, Any, str]
                                                  ) -> None:
    guest, _, _ = legacy
    _graph, ctx = await context(guest)
    bad = await guest.call("tensor-new", [2, 4], FP32, b"\0" * 5)
    code, message = await err(guest, "set-input", ctx, "x", bad)
    assert code == "invalid-argument"
    assert "5 bytes" in message
    assert guest.live()["tensor"] == 0


async def test_set_input_refuses_a_name_that_is_not_an_input(
        legacy: tuple[ComponentGuest, Any, str]) -> None:
    guest, _, _ = legacy
    _graph, ctx = await context(guest)
    code, message = await err(guest, "set-input", ctx, "nope",
                              await guest.call("tensor-new", [2, 4], FP32, X.tobytes()))
    assert code == "not-found"
    assert "'nope'" in message and "expected one of its inputs 'x'" in message
    # the tensor was handed over and is gone: the host stages nothing under any name
    assert guest.live()["tensor"] == 0
    assert only_context(guest).inputs == {}
    assert guest.service.tables.tensors.nbytes == 0
    code, message = await err(guest, "compute", ctx)
    assert code == "invalid-argument" and "before any set-input" in message


def only_context(guest: ComponentGuest) -> ContextEntry:
    (entry,) = guest.service.tables.contexts
    return entry


async def test_staging_unknown_names_holds_nothing_on_the_host(
        legacy: tuple[ComponentGuest, Any, str]) -> None:
    """Every name that is not an input is refused, however many and however long, so a
    guest cannot grow the host's staged inputs past the graph's input count."""
    guest, _, _ = legacy
    _graph, ctx = await context(guest)
    long_name = "n" * 1_000
    for i in range(50):
        empty = await guest.call("tensor-new", [0], FP32, b"")  # charged 0 bytes
        code, message = await err(guest, "set-input", ctx, f"{i:03d}{long_name}", empty)
        assert code == "not-found"
        # the name is quoted in part, its length given; the graph's inputs are listed
        assert f"'{i:03d}nnn" in message and "(1003 characters in all)" in message
        assert len(message) < 1000 and "'x'" in message
    # longer than any name: refused before it is looked up, as in the legacy ABI
    code, message = await err(guest, "set-input", ctx, "n" * 100_000,
                              await guest.call("tensor-new", [0], FP32, b""))
    assert code == "invalid-argument"
    assert message.startswith("input name is 100000 bytes long: expected at most 1024")
    # positions beyond the graph's inputs are unknown names too
    for name in ("1", "4294967296", "9" * 1000, "²"):
        code, message = await err(guest, "set-input", ctx, name,
                                  await guest.call("tensor-new", [0], FP32, b""))
        assert code == "not-found", message
        assert "a position below 1" in message
    assert only_context(guest).inputs == {}
    assert guest.service.tables.tensors.nbytes == 0
    assert guest.live() == {"tensor": 0, "graph": 1, "graph-execution-context": 1, "error": 0}


async def test_set_input_by_position_stages_that_input(
        legacy: tuple[ComponentGuest, Any, str]) -> None:
    guest, _, _ = legacy
    _graph, ctx = await context(guest)
    await stage(guest, ctx, "x", X)
    # "0" names input 0, "x": it replaces what was staged, it does not add an entry
    await stage(guest, ctx, "0", X * 5)
    assert list(only_context(guest).inputs) == ["x"]
    assert guest.service.tables.tensors.nbytes == X.nbytes
    await ok(guest, "compute", ctx)
    y = await ok(guest, "get-output", ctx, "y")
    out = np.frombuffer(await guest.call("tensor-data", y), np.float32)
    np.testing.assert_allclose(out, (X * 5 * 2 + 1).reshape(-1))


async def test_load_errors(legacy: tuple[ComponentGuest, Any, str]) -> None:
    guest, _, _ = legacy
    assert (await err(guest, "load-by-name", "nope"))[0] == "not-found"
    assert (await err(guest, "load", [b"garbage"], 1, 0))[0] == "invalid-encoding"
    assert (await err(guest, "load", [b"garbage"], 1, 2))[0] == "unsupported-operation"


async def test_error_constructor_of_2024_06_25(legacy: tuple[ComponentGuest, Any, str]) -> None:
    guest, _, version = legacy
    if not version.endswith("06-25"):
        assert guest.func("error-new") is None  # 2024-08-19 has no error constructor
        return
    for index, code in enumerate(CODES):
        handle = await guest.call("error-new", index, f"made by the guest: {code}")
        assert await error_of(guest, handle) == (code, f"made by the guest: {code}")
    assert guest.live()["error"] == 0


def sub_onnx() -> bytes:
    """``y = a - b`` over f32 ``(n, 4)``: a graph with two inputs."""
    from onnx import TensorProto, helper

    a, b, y = (helper.make_tensor_value_info(name, TensorProto.FLOAT, ["n", 4])
               for name in ("a", "b", "y"))
    graph = helper.make_graph([helper.make_node("Sub", ["a", "b"], ["y"])], "sub", [a, b], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


async def test_the_error_constructor_of_2024_06_25_cuts_a_long_message(
        nn_config: RuntimeConfig) -> None:
    require_backend("onnxruntime")
    version = LEGACY_VERSIONS[-1]
    assert version.endswith("06-25")
    async with wasinn.Runtime(nn_config) as runtime:
        guest = await ComponentGuest.start(runtime, shim_legacy(version))
        async with guest:
            data = "h" * 10 + "é" * 1_000_000 + "tail"  # 2 MB of UTF-8
            handle = await guest.call("error-new", CODES.index("not-found"), data)
            (entry,) = guest.service.tables.errors
            assert len(entry.message.encode()) <= MAX_ERROR_MESSAGE_BYTES + 40
            code, message = await error_of(guest, handle)
            assert code == "not-found"
            # the first and last 2 KiB (2048 = 10 + 2 x 1019 and 4 + 2 x 1022 bytes)
            assert message == ("h" * 10 + "é" * 1019 + "… (1995918 bytes elided) …"
                               + "é" * 1022 + "tail")
        assert guest.live()["error"] == 0


async def test_staged_inputs_count_against_the_live_tensor_budget(nn_config: RuntimeConfig
                                                                  ) -> None:
    require_backend("onnxruntime")
    async with wasinn.Runtime(nn_config) as runtime:
        guest = await ComponentGuest.start(runtime, shim_legacy(LEGACY_VERSIONS[0]),
                                           limits=GuestLimits(max_live_tensor_bytes=96))
        async with guest:
            tensors = guest.service.tables.tensors
            graph = await ok(guest, "load", [sub_onnx()], 1, 0)
            ctx = await ok(guest, "init", graph)
            await stage(guest, ctx, "a", X * 2)
            await stage(guest, ctx, "1", X)  # input 1, "b", by position
            assert sorted(only_context(guest).inputs) == ["a", "b"]
            assert tensors.nbytes == 64 and guest.live()["tensor"] == 0  # staged, charged
            new_a = await guest.call("tensor-new", [2, 4], FP32, (X * 5).tobytes())
            assert tensors.nbytes == 96  # the whole budget
            # one more does not fit: its constructor keeps a too-large error for set-input
            code, message = await err(guest, "set-input", ctx, "b",
                                      await guest.call("tensor-new", [2, 4], FP32, X.tobytes()))
            assert code == "too-large" and "max_live_tensor_bytes" in message
            # replacing a staged input of the same size fits, and frees the old one
            await ok(guest, "set-input", ctx, "a", new_a)
            assert tensors.nbytes == 64
            await ok(guest, "compute", ctx)
            y = await ok(guest, "get-output", ctx, "y")
            out = np.frombuffer(await guest.call("tensor-data", y), np.float32)
            np.testing.assert_allclose(out, (X * 5 - X).reshape(-1))
            await guest.call("tensor-drop", y)
            await guest.call("ctx-drop", ctx)  # dropping the context frees what it staged
            assert tensors.nbytes == 0
            for _ in range(3):
                await guest.call("tensor-new", [2, 4], FP32, X.tobytes())
            assert tensors.nbytes == 96
            assert guest.live()["tensor"] == 3


async def test_the_error_constructor_traps_a_guest_holding_every_error(nn_config: RuntimeConfig
                                                                        ) -> None:
    require_backend("onnxruntime")
    version = LEGACY_VERSIONS[-1]
    assert version.endswith("06-25")
    async with wasinn.Runtime(nn_config) as runtime:
        guest = await ComponentGuest.start(runtime, shim_legacy(version),
                                           limits=GuestLimits(max_errors=2))
        async with guest:
            for i in range(2):
                await guest.call("error-new", 0, f"kept {i}")
            with pytest.raises(GuestTrap, match=r"max_errors.*made too many"):
                await guest.call("error-new", 0, "made too many")
        assert guest.live()["error"] == 0
