"""wasi:nn@0.2.0-rc-2024-10-28 and the wasinn extension, driven through a real component.

The hand-written shim component (tests/components/shim_1028.wat) exports every wasi-nn
function over handle numbers, so each test calls the host exactly as a guest would,
through wasmtime's canonical ABI, in any order it likes.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import trio
from wasmtime.component import Variant

import wasinn
from tests.component_guests import RecordingRuntime, shim_1028, shim_1028_starting
from tests.loop_model import GUARD_S, HUGE_LOOP, loop_inputs, loop_onnx
from tests.support import cancelled_runs, in_process_guests, recorded_runs, require_backend
from wasinn.configs.schema import RuntimeConfig
from wasinn.host.component import ComponentGuest
from wasinn.host.limits import GuestLimits
from wasinn.modelgen import ModelFiles, affine_onnx, sample_image

TYPES = ["FP16", "FP32", "FP64", "BF16", "U8", "I32", "I64"]
ENCODINGS = ["openvino", "onnx", "tensorflow", "pytorch", "tensorflowlite", "ggml", "autodetect"]
TARGETS = ["cpu", "gpu", "tpu"]
CODES = ["invalid-argument", "invalid-encoding", "timeout", "runtime-error",
         "unsupported-operation", "too-large", "not-found", "security", "unknown"]
FP32, ONNX, CPU = TYPES.index("FP32"), ENCODINGS.index("onnx"), TARGETS.index("cpu")


class Shim:
    """Calls into the shim component; ``ok``/``err`` unwrap its result values."""

    def __init__(self, guest: ComponentGuest) -> None:
        self.guest = guest

    async def __call__(self, name: str, *args: Any) -> Any:
        return await self.guest.call(name, *args)

    async def ok(self, name: str, *args: Any) -> Any:
        result = await self(name, *args)
        if isinstance(result, Variant):
            assert result.tag == "ok", await self.describe(result.payload)
            return result.payload
        assert not isinstance(result, int), await self.describe(result)
        return result

    async def err(self, name: str, *args: Any) -> tuple[str, str]:
        """The (code, message) of the error the call returns; the error is dropped."""
        result = await self(name, *args)
        handle = result.payload if isinstance(result, Variant) else result
        assert isinstance(handle, int), f"{name} succeeded: {result!r}"
        if isinstance(result, Variant):
            assert result.tag == "err"
        code = CODES[await self("error-code", handle)]
        message = await self("error-data", handle)
        await self("error-drop", handle)
        return code, message

    async def describe(self, handle: Any) -> str:
        if not isinstance(handle, int):
            return repr(handle)
        return f"{CODES[await self('error-code', handle)]}: {await self('error-data', handle)}"

    async def tensor(self, array: np.ndarray[Any, Any], ty: str = "FP32") -> int:
        handle: int = await self("tensor-new", list(array.shape), TYPES.index(ty), array.tobytes())
        return handle

    async def data(self, handle: int, dtype: Any = np.float32) -> np.ndarray[Any, Any]:
        return np.frombuffer(await self("tensor-data", handle), dtype=dtype)

    async def context(self, model: str) -> tuple[int, int]:
        graph = await self.ok("load-by-name", model)
        return graph, await self.ok("init", graph)


async def start_shim(rt: Any, **kwargs: Any) -> tuple[ComponentGuest, Shim]:
    guest = await ComponentGuest.start(rt, shim_1028(), program="shim_1028", **kwargs)
    return guest, Shim(guest)


@pytest.fixture
async def shim(rt: RecordingRuntime) -> AsyncIterator[Shim]:
    guest, wrapper = await start_shim(rt)
    async with guest:
        yield wrapper


X = np.arange(8, dtype=np.float32).reshape(2, 4)


# -- every function ----------------------------------------------------------------------
async def test_load_init_compute_data_and_drop_everything(shim: Shim,
                                                          rt: RecordingRuntime) -> None:
    graph = await shim.ok("load", [affine_onnx(2.0, 1.0)], ONNX, CPU)
    ctx = await shim.ok("init", graph)
    t = await shim.tensor(X)
    assert await shim("tensor-dims", t) == [2, 4]
    assert TYPES[await shim("tensor-ty", t)] == "FP32"
    assert (await shim.data(t) == X.reshape(-1)).all()
    outputs = await shim.ok("compute", ctx, [("x", t)])
    assert [name for name, _ in outputs] == ["y"]
    y = outputs[0][1]
    assert await shim("tensor-dims", y) == [2, 4]
    assert TYPES[await shim("tensor-ty", y)] == "FP32"
    np.testing.assert_allclose(await shim.data(y), (X * 2 + 1).reshape(-1))
    # the input tensor moved into compute: only the output, graph and context are live
    assert shim.guest.live() == {"tensor": 1, "graph": 1, "graph-execution-context": 1,
                                 "error": 0}
    for name, handle in (("tensor-drop", y), ("ctx-drop", ctx), ("graph-drop", graph)):
        await shim(name, handle)
    assert shim.guest.live() == {"tensor": 0, "graph": 0, "graph-execution-context": 0,
                                 "error": 0}
    assert all(g.unloaded for g in rt.graphs)


async def test_load_by_name_matches_native_inference(shim: Shim, rt: RecordingRuntime,
                                                     small_mobilenet: ModelFiles) -> None:
    import onnxruntime as ort

    image = sample_image(seed=5)
    _graph, ctx = await shim.context("mobilenet")
    outputs = await shim.ok("compute", ctx, [("input", await shim.tensor(image))])
    ((_name, out),) = outputs
    assert await shim("tensor-dims", out) == [1, 1000]
    session = ort.InferenceSession(str(small_mobilenet.onnx), providers=["CPUExecutionProvider"])
    (expected,) = session.run(None, {"input": image})
    np.testing.assert_allclose(await shim.data(out), expected.reshape(-1), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("ty", TYPES)
async def test_every_tensor_type_roundtrips(shim: Shim, ty: str) -> None:
    data = bytes(range(24))
    itemsize = {"FP16": 2, "BF16": 2, "FP32": 4, "I32": 4, "FP64": 8, "I64": 8, "U8": 1}[ty]
    dims = [24 // itemsize]
    t = await shim("tensor-new", dims, TYPES.index(ty), data)
    assert await shim("tensor-dims", t) == dims
    assert TYPES[await shim("tensor-ty", t)] == ty
    assert await shim("tensor-data", t) == data
    await shim("tensor-drop", t)


@pytest.mark.parametrize(("ty", "dtype", "model"), [
    ("FP32", np.float32, "identity_f32"), ("I32", np.int32, "identity_i32"),
    ("U8", np.uint8, "identity_u8"), ("I64", np.int64, "identity_i64"),
    ("FP64", np.float64, "identity_f64")])
async def test_compute_keeps_the_element_type(shim: Shim, ty: str, dtype: Any, model: str
                                              ) -> None:
    _graph, ctx = await shim.context(model)
    x = np.arange(8).astype(dtype).reshape(2, 4)
    ((_, y),) = await shim.ok("compute", ctx, [("x", await shim.tensor(x, ty))])
    assert TYPES[await shim("tensor-ty", y)] == ty
    assert (await shim.data(y, dtype) == x.reshape(-1)).all()


async def test_contexts_of_one_graph_are_independent(shim: Shim) -> None:
    graph = await shim.ok("load-by-name", "affine")
    first, second = await shim.ok("init", graph), await shim.ok("init", graph)
    ((_, a),) = await shim.ok("compute", first, [("x", await shim.tensor(X))])
    ((_, b),) = await shim.ok("compute", second, [("x", await shim.tensor(X + 1))])
    np.testing.assert_allclose(await shim.data(a), (X * 2 + 1).reshape(-1))
    np.testing.assert_allclose(await shim.data(b), ((X + 1) * 2 + 1).reshape(-1))


# -- the wasinn extension ---------------------------------------------------------------
async def test_context_bound_to_a_target(shim: Shim) -> None:
    graph = await shim.ok("load-by-name", "affine")
    ctx = await shim.ok("init-on", graph, CPU)
    ((_, y),) = await shim.ok("compute", ctx, [("x", await shim.tensor(X))])
    np.testing.assert_allclose(await shim.data(y), (X * 2 + 1).reshape(-1))
    code, message = await shim.err("init-on", graph, TARGETS.index("tpu"))
    assert code == "unsupported-operation"
    assert "tpu" in message


@pytest.mark.parametrize("target", [None, CPU])
async def test_compute_on_a_graph_without_a_context(shim: Shim, target: int | None) -> None:
    graph = await shim.ok("load-by-name", "affine3")
    ((name, y),) = await shim.ok("graph-compute", graph, [("x", await shim.tensor(X))], target)
    assert name == "y"
    np.testing.assert_allclose(await shim.data(y), (X * 3 + 0.5).reshape(-1))
    assert shim.guest.live()["graph-execution-context"] == 0


@pytest.mark.parametrize("shape", [(2, 4), (1, 3), (3, 3)])
async def test_tensor_words_roundtrip(shim: Shim, shape: tuple[int, int]) -> None:
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    padded = x.tobytes() + b"\0" * (-x.nbytes % 8)
    t = await shim.ok("tensor-from-words", list(shape), FP32, padded)
    assert await shim("tensor-dims", t) == list(shape)
    assert await shim("tensor-data", t) == x.tobytes()
    words = await shim("tensor-words", t)
    assert bytes(words) == padded


async def test_tensor_words_feed_compute(shim: Shim) -> None:
    _graph, ctx = await shim.context("affine")
    t = await shim.ok("tensor-from-words", [2, 4], FP32, X.tobytes())
    ((_, y),) = await shim.ok("compute", ctx, [("x", t)])
    out = np.frombuffer(bytes(await shim("tensor-words", y)), np.float32)
    np.testing.assert_allclose(out, (X * 2 + 1).reshape(-1))


async def test_tensor_from_words_with_the_wrong_count(shim: Shim) -> None:
    code, message = await shim.err("tensor-from-words", [2, 4], FP32, bytes(24))
    assert code == "invalid-argument"
    assert "3 words" in message and "need 4" in message


def _words(data: bytes) -> tuple[int, bytes]:
    return len(data), data + b"\0" * (-len(data) % 8)


async def test_load_words_lifts_the_per_call_copy_limit(rt: RecordingRuntime,
                                                        small_mobilenet: ModelFiles) -> None:
    """A 6.7 MB model: too big for one list<u8> call in wasmtime-py (the guest traps, the
    host survives), fine as words."""
    from wasinn.host.runner import GuestTrap

    model = small_mobilenet.onnx.read_bytes()
    assert len(model) > 3_000_000
    guest, shim = await start_shim(rt)
    async with guest:
        graph = await shim.ok("load-words", [_words(model)], ONNX, CPU)
        ctx = await shim.ok("init", graph)
        ((_, out),) = await shim.ok("compute", ctx, [("input", await shim.tensor(sample_image()))])
        assert await shim("tensor-dims", out) == [1, 1000]
    guest, shim = await start_shim(rt)
    async with guest:
        with pytest.raises(GuestTrap, match="too much data"):
            await shim("load", [model], ONNX, CPU)
    assert all(g.unloaded for g in rt.graphs)


async def test_load_words_with_a_wrong_length(shim: Shim) -> None:
    size, words = _words(affine_onnx())
    code, message = await shim.err("load-words", [(size + 8, words)], ONNX, CPU)
    assert code == "invalid-argument"
    assert f"{size + 8} bytes" in message


async def test_the_host_also_works_on_the_stock_conversion(shim: Shim) -> None:
    """Outside the checked wasmtime range the stock list conversion is used: same results."""
    from wasinn.host.component import fastlist

    fastlist.uninstall()
    try:
        _graph, ctx = await shim.context("affine")
        ((_, y),) = await shim.ok("compute", ctx, [("x", await shim.tensor(X))])
        np.testing.assert_allclose(await shim.data(y), (X * 2 + 1).reshape(-1))
        t = await shim.ok("tensor-from-words", [2, 4], FP32,
                          np.frombuffer(X.tobytes(), "<u8").tolist())
        words = await shim("tensor-words", t)
        assert isinstance(words, list)
        assert np.array(words, dtype="<u8").tobytes() == X.tobytes()
    finally:
        fastlist.install()


# -- every error code ---------------------------------------------------------------------
async def test_invalid_argument_for_an_inconsistent_tensor(shim: Shim) -> None:
    _graph, ctx = await shim.context("affine")
    bad = await shim("tensor-new", [2, 4], FP32, b"abc")
    # the constructor cannot fail in WIT: the tensor keeps what it was given
    assert await shim("tensor-dims", bad) == [2, 4]
    assert await shim("tensor-data", bad) == b"abc"
    code, message = await shim.err("compute", ctx, [("x", bad)])
    assert code == "invalid-argument"
    assert "'x'" in message and "3 bytes" in message and "32 bytes" in message


@pytest.mark.parametrize("compute_timeout", [None, 30.0])
async def test_not_found_for_a_wrong_input_name(rt: RecordingRuntime,
                                                compute_timeout: float | None) -> None:
    # As set-input and get-output of the older RCs, and the core ABI, say for an unknown
    # name; in the guest's own thread and in a device worker (a timeout) alike.
    guest, shim = await start_shim(rt, limits=GuestLimits(compute_timeout=compute_timeout))
    async with guest:
        graph, ctx = await shim.context("affine")
        code, message = await shim.err("compute", ctx, [("nope", await shim.tensor(X))])
        assert code == "not-found"
        assert "no input 'nope'" in message and "x: f32[?, 4]" in message
        code, message = await shim.err("graph-compute", graph,
                                       [("nope", await shim.tensor(X))], None)
        assert code == "not-found"
        assert "no input 'nope'" in message
        # The Python API calls the same mistake an invalid argument.
        with pytest.raises(wasinn.InvalidArgumentError, match="no input 'nope'"):
            await rt.graphs[-1].compute({"nope": X})


async def test_invalid_argument_for_a_repeated_input(shim: Shim) -> None:
    _graph, ctx = await shim.context("affine")
    code, message = await shim.err(
        "compute", ctx, [("x", await shim.tensor(X)), ("x", await shim.tensor(X))])
    assert code == "invalid-argument"
    assert "twice" in message
    assert shim.guest.live()["tensor"] == 0  # both inputs were taken over all the same


async def test_invalid_encoding(shim: Shim) -> None:
    code, message = await shim.err("load", [b"this is not a model"], ONNX, CPU)
    assert code == "invalid-encoding"
    assert message


async def test_load_without_builders(shim: Shim) -> None:
    code, message = await shim.err("load", [], ONNX, CPU)
    assert code == "invalid-argument"
    assert "graph-builder" in message


async def test_timeout(rt: RecordingRuntime) -> None:
    guest, shim = await start_shim(rt, limits=GuestLimits(compute_timeout=1e-9))
    async with guest:
        _graph, ctx = await shim.context("mobilenet")
        code, message = await shim.err("compute", ctx, [("input", await shim.tensor(
            sample_image()))])
        assert code == "timeout"
        assert "limit" in message


async def test_runtime_error(shim: Shim) -> None:
    _graph, ctx = await shim.context("bad_reshape")
    code, message = await shim.err("compute", ctx, [("x", await shim.tensor(
        np.ones(4, np.float32)))])
    assert code == "runtime-error"
    assert message


async def test_unsupported_operation(shim: Shim) -> None:
    code, message = await shim.err("load", [affine_onnx()], ONNX, TARGETS.index("tpu"))
    assert code == "unsupported-operation"
    assert "tpu" in message


@pytest.mark.parametrize("limits", [GuestLimits(max_tensor_bytes=16),
                                    GuestLimits(max_graphs=1),
                                    GuestLimits(max_model_bytes=64)])
async def test_too_large(rt: RecordingRuntime, limits: GuestLimits) -> None:
    guest, shim = await start_shim(rt, limits=limits)
    async with guest:
        if limits.max_tensor_bytes == 16:
            _graph, ctx = await shim.context("affine")
            code, message = await shim.err("compute", ctx, [("x", await shim.tensor(X))])
            assert "16 bytes" in message
        elif limits.max_graphs == 1:
            await shim.ok("load-by-name", "affine")
            code, message = await shim.err("load-by-name", "affine3")
            assert "graphs" in message
        else:
            code, message = await shim.err("load", [affine_onnx()], ONNX, CPU)
            assert "64" in message
        assert code == "too-large"


@pytest.mark.parametrize(("name", "says"), [
    ("nope", "no model or pipeline named 'nope'"),
    ("../etc/passwd", "no model or pipeline named '../etc/passwd'"),
])
async def test_not_found(shim: Shim, name: str, says: str) -> None:
    code, message = await shim.err("load-by-name", name)
    assert code == "not-found"
    assert says in message


@pytest.mark.parametrize(("name", "expected", "host_says"), [
    ("missing", "not-found", "is registered but its file '/"),
    ("garbage", "invalid-encoding", "models.garbage: onnxruntime: cannot read"),
])
async def test_a_registered_model_that_fails_to_load_tells_the_guest_no_host_path(
        shim: Shim, caplog: pytest.LogCaptureFixture,
        name: str, expected: str, host_says: str) -> None:
    code, message = await shim.err("load-by-name", name)
    assert code == expected
    assert message == (f"registered model {name!r} could not be loaded ({expected}): "
                       "the host's log says why")
    # The operator gets the whole reason: the config's key, the file's path on the host.
    logged = [r.getMessage() for r in caplog.records
              if r.getMessage().startswith(f"load-by-name {name!r}: ")]
    assert len(logged) == 1 and host_says in logged[0], logged


async def test_loads_are_logged_with_their_time(shim: Shim,
                                                caplog: pytest.LogCaptureFixture) -> None:
    # What `wasinn run -v` shows for a component guest, as for a core module.
    caplog.set_level("INFO", logger="wasinn.host.component")
    graph = await shim.ok("load-by-name", "affine")
    await shim.ok("load", [affine_onnx()], ONNX, CPU)
    lines = [r.getMessage() for r in caplog.records if r.name == "wasinn.host.component"]
    assert any(re.fullmatch(rf"graph {graph}: 'affine' loaded by name in [\d.]+ ms", line)
               for line in lines), lines
    size = len(affine_onnx())
    assert any(re.fullmatch(rf"graph \d+: {size} bytes of onnx loaded for cpu in [\d.]+ ms",
                            line) for line in lines), lines


async def test_not_found_for_an_empty_name(shim: Shim) -> None:
    code, _message = await shim.err("load-by-name", "")
    assert code == "invalid-argument"


async def test_security(rt: RecordingRuntime) -> None:
    limits = GuestLimits(allowed_targets=frozenset({wasinn.ExecutionTarget.CPU}))
    guest, shim = await start_shim(rt, limits=limits)
    async with guest:
        code, message = await shim.err("load", [affine_onnx()], ONNX, TARGETS.index("gpu"))
        assert code == "security"
        assert "gpu" in message and "cpu" in message
        graph = await shim.ok("load", [affine_onnx()], ONNX, CPU)
        assert (await shim.err("init-on", graph, TARGETS.index("tpu")))[0] == "security"


class _BrokenRuntime:
    """Routing check only: a runtime whose load fails with a non-wasinn exception."""

    async def load(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the backend exploded")

    async def load_by_name(self, name: str) -> Any:
        raise KeyError(name)


async def test_unknown_for_host_exceptions_and_the_guest_survives() -> None:
    guest, shim = await start_shim(_BrokenRuntime())
    async with guest:
        code, message = await shim.err("load", [b"x"], ONNX, CPU)
        assert code == "unknown"
        assert "RuntimeError" in message and "exploded" in message
        code, _ = await shim.err("load-by-name", "affine")
        assert code == "unknown"
        # the instance is still usable after host failures
        t = await shim.tensor(X)
        assert await shim("tensor-dims", t) == [2, 4]


# -- lifetimes ------------------------------------------------------------------------------
HANDLES = ("graph", "ctx", "input", "output", "error")


@pytest.mark.parametrize("order", list(itertools.permutations(HANDLES))[::7])
async def test_drops_in_any_order_leave_nothing(rt: RecordingRuntime,
                                                order: tuple[str, ...]) -> None:
    guest, shim = await start_shim(rt)
    async with guest:
        graph, ctx = await shim.context("affine")
        spare = await shim.tensor(X)
        ((_, output),) = await shim.ok("compute", ctx, [("x", await shim.tensor(X))])
        error = (await shim("load-by-name", "nope")).payload
        handles = {"graph": ("graph-drop", graph), "ctx": ("ctx-drop", ctx),
                   "input": ("tensor-drop", spare), "output": ("tensor-drop", output),
                   "error": ("error-drop", error)}
        for i, key in enumerate(order):
            await shim(*handles[key])
            held = {"graph", "ctx"} - set(order[: i + 1])
            assert rt.graphs[-1].unloaded is not bool(held), (order[: i + 1], held)
        assert guest.live() == {"tensor": 0, "graph": 0, "graph-execution-context": 0,
                                "error": 0}


async def test_a_context_keeps_its_graph_loaded(shim: Shim, rt: RecordingRuntime) -> None:
    graph, ctx = await shim.context("affine")
    await shim("graph-drop", graph)
    assert not rt.graphs[-1].unloaded
    ((_, y),) = await shim.ok("compute", ctx, [("x", await shim.tensor(X))])
    np.testing.assert_allclose(await shim.data(y), (X * 2 + 1).reshape(-1))
    await shim("ctx-drop", ctx)
    assert rt.graphs[-1].unloaded
    # an output outlives both
    np.testing.assert_allclose(await shim.data(y), (X * 2 + 1).reshape(-1))


async def test_closing_the_guest_releases_what_it_held(rt: RecordingRuntime) -> None:
    guest, shim = await start_shim(rt)
    _graph, ctx = await shim.context("affine")
    await shim.ok("compute", ctx, [("x", await shim.tensor(X))])
    await shim.ok("load-by-name", "affine3")
    await guest.aclose()
    assert guest.live() == {"tensor": 0, "graph": 0, "graph-execution-context": 0, "error": 0}
    assert len(rt.graphs) == 2 and all(g.unloaded for g in rt.graphs)
    await guest.aclose()  # idempotent


async def test_outputs_stay_native_until_data_is_called(shim: Shim) -> None:
    _graph, ctx = await shim.context("affine")
    before = wasinn.host_copies()
    ((_, y),) = await shim.ok("compute", ctx, [("x", await shim.tensor(X))])
    await shim("tensor-dims", y)
    await shim("tensor-ty", y)
    assert wasinn.host_copies() == before
    await shim("tensor-data", y)
    await shim("tensor-data", y)
    assert wasinn.host_copies() - before == 1  # materialized once, then cached


# -- traps and cancellation -----------------------------------------------------------------
async def assert_contained(guest: ComponentGuest, rt: RecordingRuntime) -> None:
    """``guest`` was stopped (trapped, cancelled) with handles live: it holds none now,
    every graph is unloaded, and the host survives: the next guest loads and computes."""
    assert guest.live() == {"tensor": 0, "graph": 0, "graph-execution-context": 0, "error": 0}
    assert all(g.unloaded for g in rt.graphs)
    guest2, shim2 = await start_shim(rt)
    async with guest2:
        _graph, ctx = await shim2.context("affine")
        ((_, y),) = await shim2.ok("compute", ctx, [("x", await shim2.tensor(X))])
        np.testing.assert_allclose(await shim2.data(y), (X * 2 + 1).reshape(-1))


async def test_a_trap_with_live_handles_is_contained(rt: RecordingRuntime) -> None:
    from wasinn.host.runner import GuestTrap

    guest, shim = await start_shim(rt)
    async with guest:
        _graph, ctx = await shim.context("affine")
        await shim.ok("compute", ctx, [("x", await shim.tensor(X))])
        with pytest.raises(GuestTrap, match="unreachable"):
            await shim("trap")
        # Its Store (the guest's memory) is let go at once, not at Python's next cyclic
        # collection; a later call says why the guest is dead.
        assert guest.store is None and guest.instance is None
        with pytest.raises(GuestTrap, match=r"shim_1028 cannot be called again: it trapped "
                                            r"\(shim_1028 trapped: (?s:.*)unreachable"):
            await shim("trap")
    await assert_contained(guest, rt)


async def test_cancelling_a_spinning_guest_interrupts_it(rt: RecordingRuntime) -> None:
    guest, shim = await start_shim(rt)
    async with guest:
        await shim.context("affine")
        with trio.move_on_after(0.2) as scope:
            await shim("spin")
        assert scope.cancelled_caught
    await assert_contained(guest, rt)  # other guests are unaffected by the interrupt


async def test_cancelling_during_compute_stops_the_guest(rt: RecordingRuntime) -> None:
    guest, shim = await start_shim(rt)
    async with guest:
        _graph, ctx = await shim.context("mobilenet")
        image = sample_image()
        with trio.move_on_after(0.3) as scope:
            while True:
                await shim.ok("compute", ctx, [("input", await shim.tensor(image))])
        assert scope.cancelled_caught
    await assert_contained(guest, rt)


async def test_a_start_function_may_use_wasi_nn(rt: RecordingRuntime) -> None:
    guest = await ComponentGuest.start(rt, shim_1028_starting(""), program="starter")
    async with guest:
        assert guest.live()["graph"] == 1  # the graph it loaded while starting
    assert rt.graphs and all(g.unloaded for g in rt.graphs)


async def test_a_start_function_that_traps_is_a_guest_trap(rt: RecordingRuntime) -> None:
    from wasinn.host.runner import GuestTrap

    # Before: InvalidArgumentError "cannot instantiate", as if the component did not link.
    with pytest.raises(GuestTrap, match=r"starter trapped while starting: (?s:.*)unreachable"):
        await ComponentGuest.start(rt, shim_1028_starting("unreachable"), program="starter")
    assert rt.graphs and all(g.unloaded for g in rt.graphs)  # what it loaded is released
    guest2, shim2 = await start_shim(rt)  # and the host goes on serving
    async with guest2:
        await shim2.context("affine")


async def test_cancelling_a_spinning_start_function_interrupts_it(rt: RecordingRuntime) -> None:
    # Before: the start ran in an uninterruptible thread, so this never returned.
    with trio.move_on_after(0.3) as scope:
        await ComponentGuest.start(rt, shim_1028_starting("(loop $l (br $l))"),
                                   program="starter")
    assert scope.cancelled_caught
    assert rt.graphs and all(g.unloaded for g in rt.graphs)


async def test_guests_in_parallel_get_their_own_errors(rt: RecordingRuntime) -> None:
    results: dict[str, tuple[str, str]] = {}

    async def one(model: str) -> None:
        guest, shim = await start_shim(rt)
        async with guest:
            for _ in range(5):
                results[model] = await shim.err("load-by-name", model)

    async with trio.open_nursery() as nursery:
        for model in ("nope-1", "nope-2", "nope-3"):
            nursery.start_soon(one, model)
    for model, (code, message) in results.items():
        assert code == "not-found"
        assert model in message
        assert all(other not in message for other in results if other != model)


async def test_an_export_that_does_not_exist(shim: Shim) -> None:
    with pytest.raises(wasinn.InvalidArgumentError, match="no-such-export"):
        await shim("no-such-export")



async def test_cancelling_a_call_interrupts_its_running_inference(
        nn_config: RuntimeConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    # The guest's thread runs the ONNX Runtime Loop itself (no compute timeout): cancelling
    # the call must stop that run, not wait the ~30 s it would take. In this process,
    # where its runs are watched (by default a guest's own model runs sandboxed).
    runs = recorded_runs(monkeypatch)
    require_backend("onnxruntime")
    async with wasinn.Runtime(in_process_guests(nn_config)) as runtime:
        rt = RecordingRuntime(runtime)
        guest, shim = await start_shim(rt)
        async with guest:
            graph = await shim.ok("load", [loop_onnx()], ONNX, CPU)
            ctx = await shim.ok("init", graph)
            m = await shim.tensor(np.array([HUGE_LOOP], np.int64), "I64")
            x = await shim.tensor(np.zeros((1, 4), np.float32))
            with trio.fail_after(GUARD_S), trio.move_on_after(0.5) as scope:
                await shim("compute", ctx, [("m", m), ("x", x)])
            assert scope.cancelled_caught
        with trio.fail_after(GUARD_S):  # every worker slot is free again
            for _ in range(4):
                loop = await rt.load([loop_onnx()], "onnx", "cpu")
                out = await loop.compute(loop_inputs(2))
                assert out["y"].numpy().tolist() == [[2.0] * 4]
    # The guest's run ended because it was cancelled, not because its Loop ran out.
    (interrupted,) = cancelled_runs(runs)
    assert runs[-5:] == [interrupted, None, None, None, None]
