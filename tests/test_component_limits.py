"""What a component guest may hold and make the host do: rank, handle and byte limits,
graph unloading that survives cancellation, and the targets of graphs loaded by name.

Driven through the shim component of test_component_host (every wasi-nn function over
handle numbers) and, where no guest is needed, the service itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

import wasinn
from tests.component_guests import RecordingRuntime
from tests.test_component_host import CODES, CPU, FP32, ONNX, start_shim
from wasinn.configs import ConfigError
from wasinn.configs.loader import parse_config
from wasinn.errors import (
    MAX_QUOTED_CHARS,
    InvalidArgumentError,
    NotFoundError,
    TooLargeError,
    quoted,
)
from wasinn.host.component.scratch import ScratchDir
from wasinn.host.component.service import NNService
from wasinn.host.component.tables import (
    MAX_ERROR_MESSAGE_BYTES,
    ErrorEntry,
    ResourceExhausted,
    bounded_message,
)
from wasinn.host.limits import GuestLimits, limits_of
from wasinn.host.runner import GuestTrap
from wasinn.modelgen import affine_onnx

X = np.arange(8, dtype=np.float32).reshape(2, 4)
#: A rank whose dimension product (thousands of u32s) is far too big to print or to
#: multiply quickly: it must be refused before any arithmetic.
HUGE_RANK = 5000
NOTHING = {"tensor": 0, "graph": 0, "graph-execution-context": 0, "error": 0}


# -- rank before arithmetic -----------------------------------------------------------------
def test_the_tensor_constructor_refuses_a_huge_rank_before_multiplying() -> None:
    svc = NNService(None, None)  # type: ignore[arg-type]
    rep = svc.tensor_new([0xFFFF_FFFF] * HUGE_RANK, "FP32", b"")
    entry = svc.tables.tensors.get(rep)
    assert isinstance(entry.invalid, InvalidArgumentError)
    assert f"{HUGE_RANK} dimensions" in entry.invalid.message
    assert "at most 32" in entry.invalid.message
    assert len(entry.dims) == HUGE_RANK  # what the guest passed, for tensor.dimensions


@pytest.mark.parametrize("call", ["tensor_from_words", "tensor_from_scratch"])
def test_fallible_tensor_calls_refuse_a_huge_rank_before_multiplying(call: str,
                                                                     tmp_path: Path) -> None:
    svc = NNService(None, None, scratch=ScratchDir(tmp_path))  # type: ignore[arg-type]
    dims = [0xFFFF_FFFF] * HUGE_RANK
    with pytest.raises(InvalidArgumentError, match=f"{HUGE_RANK} dimensions: expected at most 32"):
        if call == "tensor_from_words":
            svc.tensor_from_words(dims, "FP32", b"")
        else:
            svc.tensor_from_scratch("x.bin", dims, "FP32")
    assert svc.tables.live()["tensor"] == 0


def test_an_invalid_tensor_is_not_written_to_scratch(tmp_path: Path) -> None:
    # It got the error compute gives; before, a file that looked like a tensor (5 bytes
    # for f32[2, 4]; an empty one for a tensor over the size limit).
    svc = NNService(None, None, scratch=ScratchDir(tmp_path))  # type: ignore[arg-type]
    short = svc.tensor_new([2, 4], "FP32", b"\0" * 5)
    with pytest.raises(InvalidArgumentError, match="5 bytes"):
        svc.tensor_to_scratch(short, "x.bin")
    # Dimensions that would need 4 TiB, with no data: the mismatch is the mistake (as in
    # the legacy ABI), not the size.
    mismatched = svc.tensor_new([2**20, 2**20], "FP32", b"")
    with pytest.raises(InvalidArgumentError, match="0 bytes but dimensions"):
        svc.tensor_to_scratch(mismatched, "y.bin")
    small = NNService(None, None, GuestLimits(max_tensor_bytes=16),  # type: ignore[arg-type]
                      scratch=ScratchDir(tmp_path))
    huge = small.tensor_new([2, 4], "FP32", b"\0" * 32)
    with pytest.raises(TooLargeError, match="32 bytes exceeds this guest's limit of 16"):
        small.tensor_to_scratch(huge, "z.bin")
    assert not any(path.name in ("x.bin", "y.bin", "z.bin") for path in tmp_path.rglob("*"))


async def test_a_guest_tensor_of_huge_rank_reports_invalid_argument(rt: RecordingRuntime
                                                                     ) -> None:
    guest, shim = await start_shim(rt)
    async with guest:
        _graph, ctx = await shim.context("affine")
        t = await shim("tensor-new", [0xFFFF_FFFF] * HUGE_RANK, FP32, b"")
        assert len(await shim("tensor-dims", t)) == HUGE_RANK
        code, message = await shim.err("compute", ctx, [("x", t)])
        assert code == "invalid-argument"
        assert f"{HUGE_RANK} dimensions" in message


# -- handle and byte limits -----------------------------------------------------------------
async def test_live_tensors_are_capped(rt: RecordingRuntime) -> None:
    guest, shim = await start_shim(rt, limits=GuestLimits(max_tensors=2))
    async with guest:
        first = await shim.tensor(X)
        await shim.ok("tensor-from-words", [2, 4], FP32, X.tobytes())
        code, message = await shim.err("tensor-from-words", [2, 4], FP32, X.tobytes())
        assert code == "too-large"
        assert "2 tensor handles" in message and "max_tensors" in message
        await shim("tensor-drop", first)
        await shim.tensor(X)  # room again after a drop
        # The constructor cannot report an error: the guest is stopped, saying why.
        with pytest.raises(GuestTrap, match="max_tensors"):
            await shim("tensor-new", [2, 4], FP32, X.tobytes())
    assert guest.live() == NOTHING


async def test_live_tensor_bytes_are_capped(rt: RecordingRuntime) -> None:
    guest, shim = await start_shim(rt, limits=GuestLimits(max_live_tensor_bytes=64))
    async with guest:
        _graph, ctx = await shim.context("affine")
        a = await shim.ok("tensor-from-words", [2, 4], FP32, X.tobytes())
        await shim.tensor(X)  # 64 of 64 bytes
        code, message = await shim.err("tensor-from-words", [2, 4], FP32, X.tobytes())
        assert code == "too-large"
        assert "max_live_tensor_bytes" in message and "64" in message
        # Past the budget the constructor keeps dims and type but no data, and the error
        # comes with the first use (tensor.data() traps: see below).
        over = await shim.tensor(X)
        assert await shim("tensor-dims", over) == [2, 4]
        code, message = await shim.err("compute", ctx, [("x", over)])
        assert code == "too-large" and "max_live_tensor_bytes" in message
        # Compute outputs count too: the input leaves the table, its output takes its place.
        ((_, y),) = await shim.ok("compute", ctx, [("x", a)])
        np.testing.assert_allclose(await shim.data(y), (X * 2 + 1).reshape(-1))
        await shim("tensor-drop", y)
        await shim.ok("tensor-from-words", [2, 4], FP32, X.tobytes())  # room again
    assert guest.live() == NOTHING


@pytest.mark.parametrize("call", ["tensor-data", "tensor-words"])
@pytest.mark.parametrize(("limits", "limit"), [
    (GuestLimits(max_tensor_bytes=16), "16 bytes per tensor ([guests] max_tensor_bytes)"),
    (GuestLimits(max_live_tensor_bytes=40), "over its limit of 40 ([guests] "
                                            "max_live_tensor_bytes)"),
], ids=["max_tensor_bytes", "max_live_tensor_bytes"])
async def test_reading_a_tensor_whose_constructor_kept_no_data_traps_naming_the_limit(
        rt: RecordingRuntime, call: str, limits: GuestLimits, limit: str) -> None:
    # Before, tensor.data() and tensor-words of such a tensor handed back an empty list,
    # no error, while its dimensions still said [2, 4] of FP32.
    guest, shim = await start_shim(rt, limits=limits)
    async with guest:
        if limits.max_live_tensor_bytes == 40:
            kept = await shim.tensor(X)  # 32 of 40 bytes
            np.testing.assert_array_equal(await shim.data(kept), X.reshape(-1))
        dropped = await shim("tensor-new", [2, 4], FP32, X.tobytes())
        assert await shim("tensor-dims", dropped) == [2, 4]
        with pytest.raises(GuestTrap) as trapped:
            await shim(call, dropped)
        message = str(trapped.value)
        what = "tensor-words" if call == "tensor-words" else "tensor.data()"
        assert f"{what} of a tensor whose data its constructor did not keep" in message
        assert limit in message
    assert guest.live() == NOTHING


async def test_live_errors_are_capped_and_the_guest_is_trapped_with_the_lost_error(
        rt: RecordingRuntime) -> None:
    guest, shim = await start_shim(rt, limits=GuestLimits(max_errors=2))
    async with guest:
        held = [(await shim("load-by-name", f"nope-{i}")).payload for i in range(2)]
        await shim("error-drop", held.pop())
        held.append((await shim("load-by-name", "nope-again")).payload)
        assert guest.live()["error"] == 2
        with pytest.raises(GuestTrap, match=r"max_errors.*not-found.*nope-lost"):
            await shim("load-by-name", "nope-lost")
    assert guest.live() == NOTHING


# -- error sizes ----------------------------------------------------------------------------
def test_bounded_message_keeps_a_short_message_whole() -> None:
    assert bounded_message("no input 'x'") == "no input 'x'"
    exact = "é" * (MAX_ERROR_MESSAGE_BYTES // 2)  # exactly the limit in UTF-8 bytes
    assert bounded_message(exact) == exact


def test_bounded_message_keeps_both_ends_of_a_long_message_in_whole_characters() -> None:
    message = "head " + "€" * 2000 + " expected one of 'x'"  # "€" is 3 bytes in UTF-8
    total = len(message.encode())
    cut = bounded_message(message)
    assert cut.startswith("head €") and cut.endswith("€ expected one of 'x'")
    head, rest = cut.split("… (", 1)
    note, tail = rest.split(") …", 1)
    assert len(head.encode()) <= MAX_ERROR_MESSAGE_BYTES // 2
    assert len(tail.encode()) <= MAX_ERROR_MESSAGE_BYTES // 2
    # no character was split, and the note counts exactly what is missing
    assert note == f"{total - len(head.encode()) - len(tail.encode())} bytes elided"
    assert message.startswith(head) and message.endswith(tail)


def test_quoted_shortens_a_long_guest_string_and_gives_its_length() -> None:
    assert quoted("x") == "'x'"
    shown = quoted("n" * 1_000_000)
    assert shown == f"{'n' * MAX_QUOTED_CHARS!r}… (1000000 characters in all)"


def test_an_error_keeps_its_code_and_a_bounded_message_not_the_exception() -> None:
    svc = NNService(None, None, limits=GuestLimits(max_errors=1))  # type: ignore[arg-type]
    huge = "x" * 10_000_000
    full = f"no model named {huge!r}: registered: affine"
    rep = svc.error_new(NotFoundError(full))
    assert isinstance(svc.tables.errors.get(rep), ErrorEntry)  # no traceback kept
    assert svc.error_code(rep) == "not-found"
    message = svc.error_data(rep)
    assert len(message.encode()) <= MAX_ERROR_MESSAGE_BYTES + 40
    assert message.startswith("no model named 'xxx") and message.endswith("registered: affine")
    assert f"({len(full) - MAX_ERROR_MESSAGE_BYTES} bytes elided)" in message
    # the trap for an error past max_errors repeats the lost error, cut the same way
    with pytest.raises(ResourceExhausted, match="max_errors") as trap:
        svc.error_new(InvalidArgumentError(huge))
    assert len(str(trap.value)) < 2 * MAX_ERROR_MESSAGE_BYTES
    assert "bytes elided" in str(trap.value)


async def test_a_component_guest_gets_the_legacy_abis_answers_to_the_same_mistakes(
        rt: RecordingRuntime) -> None:
    # Each answer as tests/test_core_fuzz.py checks it for a core-module guest.
    guest, shim = await start_shim(rt)
    async with guest:
        assert await shim.err("load-by-name", "") == (
            "invalid-argument", "model name is empty: expected the name of a registered model "
                                "or pipeline")
        _graph, ctx = await shim.context("affine")
        ones = np.ones((1, 4), np.float32)
        code, message = await shim.err("compute", ctx, [("x" * 1025, await shim.tensor(ones))])
        assert (code, message) == ("invalid-argument", "input name is 1025 bytes long: "
                                   "expected at most 1024 bytes of UTF-8 (no model, input or "
                                   "output has a longer name)")
        # A name that can be one, but is not: quoted and cut, in the backend's words too.
        code, message = await shim.err("compute", ctx, [("q" * 1000, await shim.tensor(ones))])
        assert code == "not-found" and "(1000 characters in all)" in message
        assert len(message) < 500
        # 16 bytes for dimensions that would need 4 PiB: the mismatch, not the size.
        wrong = await shim("tensor-new", [65536] * 3, FP32, b"\0" * 16)
        code, message = await shim.err("compute", ctx, [("x", wrong)])
        assert code == "invalid-argument"
        assert "tensor data is 16 bytes but dimensions [65536, 65536, 65536]" in message


async def test_errors_echoing_a_huge_guest_name_stay_small_on_the_host(
        rt: RecordingRuntime) -> None:
    guest, shim = await start_shim(rt)
    async with guest:
        name = "n" * 2_000_000
        held = []
        for _ in range(5):
            result = await shim("load-by-name", name)
            assert result.tag == "err"
            held.append(result.payload)  # the guest keeps every error
        messages = [entry.message for entry in guest.service.tables.errors]
        assert len(messages) == 5
        assert sum(len(m.encode()) for m in messages) <= 5 * (MAX_ERROR_MESSAGE_BYTES + 40)
        code, message = CODES[await shim("error-code", held[0])], await shim("error-data",
                                                                              held[0])
        # longer than any name: refused as the legacy ABI refuses it, not repeated
        assert code == "invalid-argument"
        assert message == ("model name is 2000000 bytes long: expected at most 1024 bytes of "
                           "UTF-8 (no model, input or output has a longer name)")
        result = await shim("load-by-name", "n" * 1000)  # a name that can be one: quoted, cut
        assert result.tag == "err"
        message = await shim("error-data", result.payload)
        assert message.startswith(f"no model or pipeline named '{'n' * 57}...': registered: ")
        await shim("error-drop", result.payload)
        for handle in held:
            await shim("error-drop", handle)
    assert guest.live() == NOTHING


def test_a_huge_scratch_name_is_refused_without_being_repeated(tmp_path: Path) -> None:
    scratch = ScratchDir(tmp_path)
    svc = NNService(None, None, scratch=scratch)  # type: ignore[arg-type]
    rep = svc.tensor_new([2, 4], "FP32", X.tobytes())
    for name in ("a/" * 500_000, "\0" * 1_000_000, "n" * 256):
        with pytest.raises(InvalidArgumentError, match="bytes long: expected at most 255") as exc:
            svc.tensor_to_scratch(rep, name)
        assert len(exc.value.message) < 200
    assert list(scratch.path.iterdir()) == []  # nothing was written


def test_the_guests_table_sets_the_component_limits() -> None:
    config = parse_config({"guests": {"max_tensors": 3, "max_errors": 2,
                                      "max_live_tensor_bytes": 100}}, None)
    limits = limits_of(wasinn.Runtime(config))
    assert (limits.max_tensors, limits.max_errors, limits.max_live_tensor_bytes) == (3, 2, 100)
    defaults = GuestLimits()
    assert (defaults.max_tensors, defaults.max_errors, defaults.max_live_tensor_bytes) == (
        4096, 1024, 4 * 1024**3)
    for key in ("max_tensors", "max_errors", "max_live_tensor_bytes"):
        with pytest.raises(ConfigError, match=f"guests.{key}"):
            parse_config({"guests": {key: 0}}, None)


async def test_max_graphs_counts_graphs_that_only_a_context_keeps_loaded(
        rt: RecordingRuntime) -> None:
    # Each graph may be a sandbox process: a guest that drops every graph handle but keeps
    # a context on it must not load more than max_graphs of them.
    guest, shim = await start_shim(rt, limits=GuestLimits(max_graphs=2))
    async with guest:
        contexts = []
        for _ in range(2):
            graph = await shim.ok("load", [affine_onnx()], ONNX, CPU)
            contexts.append(await shim.ok("init", graph))
            await shim("graph-drop", graph)
        assert guest.live()["graph"] == 0
        code, message = await shim.err("load", [affine_onnx()], ONNX, CPU)
        assert code == "too-large"
        assert "2 graphs loaded (0 graph handles)" in message
        assert "max_graphs" in message and "context" in message
        code, _ = await shim.err("load-by-name", "affine")
        assert code == "too-large"
        assert [graph.unloaded for graph in rt.graphs] == [False, False]
        await shim("ctx-drop", contexts.pop())  # its graph's last holder: room again
        assert [graph.unloaded for graph in rt.graphs] == [False, True]
        graph = await shim.ok("load", [affine_onnx(3.0, 0.0)], ONNX, CPU)
        ((_, y),) = await shim.ok("graph-compute", graph, [("x", await shim.tensor(X))], None)
        np.testing.assert_allclose(await shim.data(y), (X * 3).reshape(-1))
    assert guest.live() == NOTHING
    assert all(graph.unloaded for graph in rt.graphs)


# -- unloading survives cancellation ---------------------------------------------------------
class _FirstUnloadHangs:
    """Routing check: a real graph whose first unload waits at a checkpoint (until it is
    cancelled) before it reaches the real unload; later unloads go straight through."""

    def __init__(self, graph: Any) -> None:
        self.graph = graph
        self.unload_started = trio.Event()
        self.unload_calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.graph, name)

    async def unload(self, *, wait_for_runs: bool = True) -> None:
        self.unload_calls += 1
        if self.unload_calls == 1:
            self.unload_started.set()
            await trio.sleep_forever()
        await self.graph.unload(wait_for_runs=wait_for_runs)


class _HangingUnloads(RecordingRuntime):
    async def load_by_name(self, name: str) -> Any:
        graph = _FirstUnloadHangs(await self._rt.load_by_name(name))
        self.graphs.append(graph)
        return graph


@pytest.mark.parametrize("last_holder", ["graph", "ctx"])
async def test_a_graph_whose_unload_is_cancelled_is_unloaded_when_the_guest_closes(
        rt: RecordingRuntime, last_holder: str) -> None:
    hanging = _HangingUnloads(rt._rt)
    guest, shim = await start_shim(hanging)
    async with guest:
        graph, ctx = await shim.context("affine")
        first, last = (("ctx-drop", ctx), ("graph-drop", graph))
        if last_holder == "ctx":
            first, last = last, first
        await shim(*first)
        (held,) = hanging.graphs
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(shim, *last)
                await held.unload_started.wait()
                scope.cancel()
        assert scope.cancelled_caught
        assert not held.graph.unloaded  # the guest was stopped inside the unload
    assert held.graph.unloaded
    assert held.unload_calls == 2
    assert guest.live() == NOTHING


# -- targets of graphs loaded by name --------------------------------------------------------
async def test_load_by_name_refuses_a_registry_graph_on_a_target_the_guest_may_not_use(
        rt: RecordingRuntime) -> None:
    limits = GuestLimits(allowed_targets=frozenset({wasinn.ExecutionTarget.GPU}))
    guest, shim = await start_shim(rt, limits=limits)
    async with guest:
        code, message = await shim.err("load-by-name", "affine")  # the registry says cpu
        assert code == "security"
        assert "cpu" in message and "gpu" in message
        assert guest.live() == NOTHING
        assert len(rt.graphs) == 1 and rt.graphs[0].unloaded
        # and no other way in: an explicit cpu load is refused as before
        code, _ = await shim.err("load", [affine_onnx()], ONNX, CPU)
        assert code == "security"


async def test_load_by_name_on_an_allowed_target_still_works(rt: RecordingRuntime) -> None:
    limits = GuestLimits(allowed_targets=frozenset({wasinn.ExecutionTarget.CPU}))
    guest, shim = await start_shim(rt, limits=limits)
    async with guest:
        graph = await shim.ok("load-by-name", "affine")
        ((_, y),) = await shim.ok("graph-compute", graph, [("x", await shim.tensor(X))], None)
        np.testing.assert_allclose(await shim.data(y), (X * 2 + 1).reshape(-1))
