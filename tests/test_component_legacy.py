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


async def ok(guest: ComponentGuest, name: str, *args: Any) -> Any:
    result = await guest.call(name, *args)
    if isinstance(result, Variant):
        assert result.tag == "ok", (result, await error_of(guest, result.payload))
        return result.payload
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


async def test_compute_without_inputs(legacy: tuple[ComponentGuest, Any, str]) -> None:
    guest, _, _ = legacy
    _graph, ctx = await context(guest)
    code, message = await err(guest, "compute", ctx)
    assert code == "invalid-argument"
    assert "set-input" in message


async def test_unknown_output_name(legacy: tuple[ComponentGuest, Any, str]) -> None:
    guest, _, _ = legacy
    _graph, ctx = await context(guest)
    await ok(guest, "set-input", ctx, "x",
             await guest.call("tensor-new", [2, 4], FP32, X.tobytes()))
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


async def test_wrong_input_name_is_reported_by_compute(legacy: tuple[ComponentGuest, Any, str]
                                                       ) -> None:
    guest, _, _ = legacy
    _graph, ctx = await context(guest)
    await ok(guest, "set-input", ctx, "nope",
             await guest.call("tensor-new", [2, 4], FP32, X.tobytes()))
    code, message = await err(guest, "compute", ctx)
    assert code in ("invalid-argument", "not-found")
    assert "nope" in message


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


async def test_staged_inputs_count_against_the_live_tensor_budget(nn_config: RuntimeConfig
                                                                  ) -> None:
    require_backend("onnxruntime")
    async with wasinn.Runtime(nn_config) as runtime:
        guest = await ComponentGuest.start(runtime, shim_legacy(LEGACY_VERSIONS[0]),
                                           limits=GuestLimits(max_live_tensor_bytes=64))
        async with guest:
            _graph, ctx = await context(guest)
            for name in ("x", "y"):  # 2 x 32 bytes staged: the whole budget
                await ok(guest, "set-input", ctx, name,
                         await guest.call("tensor-new", [2, 4], FP32, X.tobytes()))
            code, message = await err(guest, "set-input", ctx, "z",
                                      await guest.call("tensor-new", [2, 4], FP32, X.tobytes()))
            assert code == "too-large" and "max_live_tensor_bytes" in message
            # replacing a staged input of the same size fits
            await ok(guest, "set-input", ctx, "x",
                     await guest.call("tensor-new", [2, 4], FP32, (X * 5).tobytes()))
            code, _ = await err(guest, "compute", ctx)  # the graph has no input "y"
            assert code in ("invalid-argument", "not-found")
            await guest.call("ctx-drop", ctx)  # dropping the context frees what it staged
            for _ in range(2):
                await guest.call("tensor-new", [2, 4], FP32, X.tobytes())
            assert guest.service.tables.tensors.nbytes == 64
            assert guest.live()["tensor"] == 2


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
