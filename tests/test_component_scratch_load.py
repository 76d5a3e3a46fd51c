"""``wasinn:nn/scratch.load-from-scratch``: a guest's own model loaded from its scratch files.

A model past Wasmtime's per-call bound (about 2.8 MB of ``list<u8>``, see
``tests/test_component_hostcall_fuel.py``) cannot pass to ``graph.load``; written to the
guest's scratch directory with wasi:filesystem calls, it loads, within ``[guests]
max_model_bytes``, through the same path as ``graph.load``. Driven through
``tests/components/scratch_loop.wat`` (see ``tests/test_component_scratch.py``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.component_guests import RecordingRuntime, runtime_error_onnx
from tests.support import require_backend
from tests.test_component_hostcall_fuel import _matmul_onnx
from tests.test_component_scratch import BAD_NAMES, Guest, X, start
from wasinn.host.component import scratch as scratch_module
from wasinn.host.component.hostcall_fuel import MAX_VALUES_PER_CALL
from wasinn.host.component.scratch import GUEST_PATH
from wasinn.host.limits import GuestLimits
from wasinn.modelgen import ModelFiles, affine_onnx, sample_image

ENCODINGS = ["openvino", "onnx", "tensorflow", "pytorch", "tensorflowlite", "ggml",
             "autodetect"]
TARGETS = ["cpu", "gpu", "tpu"]
LIVE_NONE = {"tensor": 0, "graph": 0, "graph-execution-context": 0, "error": 0}


async def load(g: Guest, names: list[str], encoding: str = "onnx") -> int:
    """The graph handle load-from-scratch gives for ``names`` on the CPU."""
    graph: int = await g.ok("load-from-scratch", names, ENCODINGS.index(encoding),
                            TARGETS.index("cpu"))
    return graph


async def load_error(g: Guest, names: list[str], encoding: str = "onnx") -> tuple[str, str]:
    return await g.err("load-from-scratch", names, ENCODINGS.index(encoding),
                       TARGETS.index("cpu"))


async def compute(g: Guest, graph: int, name: str, x: np.ndarray[Any, Any]) -> bytes:
    """Use ``graph`` (a context on it), compute with ``x`` (through a scratch file) as
    input ``name``; the first output's bytes. The graph and context stay the guest's
    (``release`` drops them)."""
    assert await g("use-graph", graph) == 0
    await g.write("x.bin", x.tobytes())
    t = await g.from_scratch("x.bin", list(x.shape))
    y = await g.ok("compute1", name, t)
    data: bytes = await g("tensor-data", y)
    await g("tensor-drop", y)
    return data


async def affine_still_works(g: Guest) -> None:
    """The guest's other calls: a model by name, computed on a scratch tensor."""
    assert await g("prepare", "affine") == 0
    await g.write("a.bin", X.tobytes())
    y = await g.ok("compute1", "x", await g.from_scratch("a.bin", [2, 4]))
    assert np.array_equal(np.frombuffer(await g("tensor-data", y), np.float32),
                          2 * X.reshape(-1) + 1)
    await g("tensor-drop", y)
    await g("release")


# -- loading ---------------------------------------------------------------------------------
@pytest.mark.parametrize("encoding", ["onnx", "autodetect"])
async def test_a_model_past_the_per_call_bound_loads_from_scratch_and_computes(
        rt: RecordingRuntime, encoding: str) -> None:
    rng = np.random.default_rng(7)
    weights = rng.standard_normal((1024, 1024)).astype(np.float32)  # 4 MiB
    model = _matmul_onnx(weights)
    assert len(model) > MAX_VALUES_PER_CALL  # graph.load could not take it in one call
    x = rng.standard_normal((1, 1024)).astype(np.float32)
    guest, g = await start(rt)
    async with guest:
        await g.write("matmul.onnx", model)
        graph = await load(g, ["matmul.onnx"], encoding)
        await g.write("matmul.onnx", b"rewritten")  # the graph keeps the bytes it loaded
        y = np.frombuffer(await compute(g, graph, "x", x), np.float32)
        np.testing.assert_allclose(y, (x @ weights).reshape(-1), rtol=1e-4, atol=1e-3)
        await g("release")
        assert guest.live() == LIVE_NONE
        await affine_still_works(g)
    assert all(loaded.unloaded for loaded in rt.graphs)


async def test_openvino_ir_loads_from_two_files_in_builder_order(
        rt: RecordingRuntime, small_mobilenet: ModelFiles) -> None:
    require_backend("openvino")
    import onnxruntime as ort

    image = sample_image(seed=8)
    session = ort.InferenceSession(str(small_mobilenet.onnx), providers=["CPUExecutionProvider"])
    (expected,) = session.run(None, {"input": image})
    guest, g = await start(rt)
    async with guest:
        await g.write("model.xml", small_mobilenet.ir_xml.read_bytes())
        await g.write("model.bin", small_mobilenet.ir_bin.read_bytes())
        # The weights first is not an IR: the names are the builders, in their order.
        code, message = await load_error(g, ["model.bin", "model.xml"], "openvino")
        assert (code, "wrong way round" in message) == ("invalid-encoding", True)
        graph = await load(g, ["model.xml", "model.bin"], "openvino")
        got = np.frombuffer(await compute(g, graph, "input", image), np.float32)
        np.testing.assert_allclose(got, expected.reshape(-1), rtol=1e-3, atol=1e-4)
        await g("release")
        assert guest.live() == LIVE_NONE


class LoadRecorder(RecordingRuntime):
    """Keeps the keyword arguments of every ``load`` too."""

    def __init__(self, rt: Any) -> None:
        super().__init__(rt)
        self.loads: list[dict[str, Any]] = []

    async def load(self, *args: Any, **kwargs: Any) -> Any:
        self.loads.append(kwargs)
        return await super().load(*args, **kwargs)


async def test_it_loads_as_graph_load_does(rt: RecordingRuntime) -> None:
    """The guest's own model: sandboxed as its limits say, named for the guest's tenant."""
    recorder = LoadRecorder(rt)
    limits = GuestLimits(max_sandbox_bytes=1 << 30)
    guest, g = await start(recorder, limits=limits, tenant="team-a")
    async with guest:
        await g.write("affine3.onnx", affine_onnx(3.0, 0.5))
        graph = await load(g, ["affine3.onnx"])
        y = np.frombuffer(await compute(g, graph, "x", X), np.float32)
        assert np.array_equal(y, 3 * X.reshape(-1) + 0.5)
        await g("release")
    (kwargs,) = recorder.loads
    assert kwargs["options"] == limits.load_options() == {"sandbox": "cpu",
                                                           "max_sandbox_bytes": 1 << 30}
    assert kwargs["name"] == "team-a#0"


async def test_each_load_has_a_name_of_its_own_failed_or_not(rt: RecordingRuntime) -> None:
    # Before: the count moved on a load that succeeded only, so every failed load before
    # it was named team-a#0 too, in its error and in the logs.
    recorder = LoadRecorder(rt)
    guest, g = await start(recorder, limits=GuestLimits(sandbox=False), tenant="team-a")
    async with guest:
        await g.write("garbage.onnx", b"not a model at all")
        await g.write("affine3.onnx", affine_onnx(3.0, 0.5))
        failures = [await load_error(g, ["garbage.onnx"]) for _ in range(2)]
        await load(g, ["affine3.onnx"])
        await g("release")
    assert [kwargs["name"] for kwargs in recorder.loads] == ["team-a#0", "team-a#1",
                                                             "team-a#2"]
    assert [(code, "team-a#" + str(i) in message) for i, (code, message)
            in enumerate(failures)] == [("invalid-encoding", True)] * 2, failures


# -- errors ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "why"), BAD_NAMES)
async def test_a_name_that_is_not_a_plain_file_name_is_invalid(
        rt: RecordingRuntime, name: str, why: str) -> None:
    guest, g = await start(rt)
    async with guest:
        await g.write("good.onnx", affine_onnx(2.0, 1.0))
        for names in ([name], ["good.onnx", name]):
            code, message = await load_error(g, names)
            assert (code, why in message) == ("invalid-argument", True), message
        assert guest.live() == LIVE_NONE
        await affine_still_works(g)
    assert len(rt.graphs) == 1  # "affine" by name only


async def test_missing_files_links_and_directories_are_refused(
        rt: RecordingRuntime, tmp_path: Path) -> None:
    guest, g = await start(rt)
    async with guest:
        scratch = guest.scratch
        assert scratch is not None
        outside = tmp_path / "affine.onnx"
        outside.write_bytes(affine_onnx(2.0, 1.0))
        os.symlink(outside, scratch.path / "link.onnx")
        (scratch.path / "dir").mkdir()
        code, message = await load_error(g, ["never-written.onnx"])
        assert code == "not-found"
        assert "'never-written.onnx' does not exist" in message and GUEST_PATH in message
        code, message = await load_error(g, ["link.onnx"])
        assert (code, "'link.onnx' is a symbolic link" in message) == ("invalid-argument", True)
        code, message = await load_error(g, ["dir"])
        assert (code, "'dir' is a directory" in message) == ("invalid-argument", True)
        await affine_still_works(g)
    assert len(rt.graphs) == 1  # "affine" by name only


async def test_no_names_or_too_many_are_invalid(rt: RecordingRuntime) -> None:
    guest, g = await start(rt)
    async with guest:
        await g.write("m.onnx", affine_onnx(2.0, 1.0))
        code, message = await load_error(g, [])
        assert (code, "at least one scratch file name" in message) == ("invalid-argument", True)
        code, message = await load_error(g, ["m.onnx"] * 17)
        assert code == "invalid-argument"
        assert "17 scratch file names: expected at most 16" in message
        await affine_still_works(g)


async def test_bad_model_bytes_give_graph_load_errors(rt: RecordingRuntime) -> None:
    guest, g = await start(rt, limits=GuestLimits(sandbox=False))
    async with guest:
        await g.write("garbage.onnx", b"not a model at all")
        code, _ = await load_error(g, ["garbage.onnx"])
        assert code == "invalid-encoding"
        code, _ = await load_error(g, ["garbage.onnx"], "autodetect")
        assert code == "invalid-encoding"
        # It loads; running it fails, as the same bytes loaded by graph.load would.
        await g.write("bad.onnx", runtime_error_onnx())
        graph = await load(g, ["bad.onnx"])
        assert await g("use-graph", graph) == 0
        await g.write("x.bin", np.zeros(4, np.float32).tobytes())
        code, _ = await g.err("compute1", "x", await g.from_scratch("x.bin", [4]))
        assert code == "runtime-error"
        await g("release")
        await affine_still_works(g)


async def test_models_past_max_model_bytes_are_too_large_before_they_are_read(
        rt: RecordingRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    model = affine_onnx(2.0, 1.0)
    guest, g = await start(rt, limits=GuestLimits(max_model_bytes=len(model) + 10))
    async with guest:
        scratch = guest.scratch
        assert scratch is not None
        await g.write("a.onnx", model)
        await g.write("b.onnx", model)
        reads: list[str] = []
        read_exactly = scratch_module._read_exactly

        def recording(fd: int, name: str, nbytes: int) -> bytes:
            reads.append(name)
            return read_exactly(fd, name, nbytes)

        monkeypatch.setattr(scratch_module, "_read_exactly", recording)
        code, message = await load_error(g, ["a.onnx", "b.onnx"])
        assert code == "too-large"
        assert (f"loading {2 * len(model)} bytes of model would bring this guest to "
                f"{2 * len(model)} bytes of loaded models, over its limit of "
                f"{len(model) + 10} ([guests] max_model_bytes)") in message
        assert reads == []  # refused on the files' sizes
        first = await load(g, ["a.onnx"])
        assert reads == ["a.onnx"]
        # The limit is on all the guest's models at once: a second must wait for the first.
        code, message = await load_error(g, ["b.onnx"])
        assert (code, "max_model_bytes" in message) == ("too-large", True)
        assert await g("use-graph", first) == 0
        await g("release")  # drops the first graph (and the context use-graph made)
        second = await load(g, ["b.onnx"])
        y = np.frombuffer(await compute(g, second, "x", X), np.float32)
        assert np.array_equal(y, 2 * X.reshape(-1) + 1)
        await g("release")
        assert guest.live() == LIVE_NONE


async def test_a_guest_without_scratch_gets_unsupported_operation(rt: RecordingRuntime) -> None:
    guest, g = await start(rt, scratch=False)
    async with guest:
        code, message = await load_error(g, ["m.onnx"])
        assert code == "unsupported-operation"
        assert "without a scratch directory" in message and "load-words" in message
