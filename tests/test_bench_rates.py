"""The throughput rates and the native baseline of ``benchmarks/scheduler_overhead.py``
and ``benchmarks/batching.py``.

A rate counts the requests still running when its time is up, so it must also count the
time they take (else many concurrent callers would gain their last requests for free),
and its native baseline must be the library's own call, not wasinn's backend layer.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import trio

from tests.support import require_backend
from wasinn import GraphEncoding
from wasinn.backends import BackendRegistry, Device
from wasinn.modelgen import affine_onnx

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPT = BENCHMARKS / "scheduler_overhead.py"


def script() -> ModuleType:
    """The benchmark script as a module (``benchmarks/`` is not a package)."""
    spec = importlib.util.spec_from_file_location("scheduler_overhead_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def batching(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """``benchmarks/batching.py`` as a module; the sibling script it imports, and the
    folder it puts on ``sys.path`` for that, are gone again afterwards."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    imported_before = "scheduler_overhead" in sys.modules
    spec = importlib.util.spec_from_file_location("batching_under_test",
                                                  BENCHMARKS / "batching.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Its dataclasses look their module up by name.
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    yield module
    if not imported_before:
        sys.modules.pop("scheduler_overhead", None)


async def test_trio_callers_rate_counts_until_the_last_request_ends(
        autojump_clock: trio.abc.Clock) -> None:
    # 16 callers of 0.3 s requests for 1 s: each starts its 4th at 0.9 s, which ends at
    # 1.2 s. 64 requests in 1.2 s, not in the nominal 1 s (64/s).
    async def step() -> None:
        await trio.sleep(0.3)

    rate = await script().rate_in_tasks(16, 1.0, lambda: step)
    assert rate == pytest.approx(64 / 1.2)


async def test_trio_callers_each_complete_one_request_past_a_spent_deadline(
        autojump_clock: trio.abc.Clock) -> None:
    async def step() -> None:
        await trio.sleep(0.25)

    assert await script().rate_in_tasks(4, 0.0, lambda: step) == pytest.approx(4 / 0.25)


def test_threads_rate_pays_for_the_calls_running_at_the_deadline() -> None:
    # Each of 4 threads makes one 0.2 s call (the deadline, 0.02 s, has passed when it
    # ends): at most 4 calls in at least 0.2 s, whatever the machine's load. Divided by
    # the nominal 0.02 s, the same calls would read 200/s.
    calls = []
    lock = threading.Lock()

    def step() -> None:
        time.sleep(0.2)
        with lock:
            calls.append(1)

    rate = script().rate_in_threads(4, 0.02, lambda: step)
    assert len(calls) == 4
    assert 0 < rate <= 4 / 0.2


@pytest.mark.parametrize(("backend", "library_call"), [
    ("onnxruntime", "onnxruntime.InferenceSession"),
    ("openvino", "openvino.InferRequest"),
])
def test_the_native_baseline_is_the_librarys_own_call(backend: str, library_call: str) -> None:
    require_backend(backend)
    module_name, class_name = library_call.split(".")
    library = importlib.import_module(module_name)
    graph = BackendRegistry().get(backend).load([affine_onnx()], GraphEncoding.ONNX,
                                                Device.parse("cpu"))
    try:
        x = np.arange(4, dtype=np.float32).reshape(1, 4)
        bench = script()
        make = bench.library_step(backend, graph, {"x": x})
        first, second = make(), make()
        # The call is the library's own bound method, on an object of the library's.
        assert isinstance(first.func.__self__, getattr(library, class_name))
        assert first.func.__func__ is getattr(getattr(library, class_name),
                                              first.func.__name__)
        if backend == "openvino":  # a request per thread: one runs one inference at a time
            assert first.func.__self__ is not second.func.__self__
        result: Any = first()
        (y,) = list(result.values()) if backend == "openvino" else result
        np.testing.assert_allclose(y, 2 * x + 1)
        assert bench.LIBRARY_CALLS[backend] == f"{class_name}.{first.func.__name__}"
    finally:
        graph.close()


@pytest.mark.parametrize(("backend", "library_call"), [
    ("onnxruntime", "onnxruntime.InferenceSession.run"),
    ("openvino", "openvino.InferRequest.infer"),
])
def test_batchings_native_rate_is_the_librarys_own_call(
        backend: str, library_call: str, batching: ModuleType,
        monkeypatch: pytest.MonkeyPatch) -> None:
    require_backend(backend)
    module_name, class_name, method = library_call.split(".")
    library_class = getattr(importlib.import_module(module_name), class_name)
    graph = BackendRegistry().get(backend).load([affine_onnx()], GraphEncoding.ONNX,
                                                Device.parse("cpu"))
    try:
        def layer_run(*args: object, **kwargs: object) -> Any:
            raise AssertionError("the native rate went through wasinn's backend layer")

        monkeypatch.setattr(type(graph), "run", layer_run)
        calls: list[tuple[Any, ...]] = []
        library_method = getattr(library_class, method)

        def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append(args)
            return library_method(self, *args, **kwargs)

        monkeypatch.setattr(library_class, method, counted)
        feed = {"x": np.arange(8, dtype=np.float32).reshape(2, 4)}  # a batch of 2 rows
        rate = batching.native_rate(backend, graph, feed, 0.0)
        # 3 warm-up calls, then one timed (the time is up at once, and a rate needs one),
        # each the library's own on the numpy inputs as given.
        assert len(calls) == 4
        assert all(any(arg is feed for arg in args) for args in calls)
        assert rate > 0
    finally:
        graph.close()


def test_batchings_ratio_far_above_the_native_rate_is_not_a_verdict(
        batching: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    figures = batching.Figures(rate=290.0, p50=0.004, batches=0, batched=0, completed=580)
    # Unbatched, one worker: at most what the library's own batch-1 calls reached.
    ceiling = batching.native_ceiling(False, 4, 1, 100.0, 130.0)
    assert ceiling == 100.0
    batching.report(False, 4, figures, 100.0, ceiling)
    line = capsys.readouterr().out
    assert "ratio to native batch-1 2.900" in line
    assert line.rstrip().endswith("baseline disturbed: not a verdict (above 1.1x the "
                                  "library's own best on the same model)")


def test_batchings_ratio_within_reach_of_the_native_calls_is_reported_plainly(
        batching: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    figures = batching.Figures(rate=240.0, p50=0.004, batches=10, batched=40, completed=48)
    # Batched on two workers: the better of batch 1 and batch M, twice.
    ceiling = batching.native_ceiling(True, 4, 2, 100.0, 130.0)
    assert ceiling == 260.0
    batching.report(True, 4, figures, 100.0, ceiling)
    line = capsys.readouterr().out
    assert "ratio to native batch-1 2.400" in line
    assert "disturbed" not in line
    assert line.rstrip().endswith("mean batch 4.00 (83 % merged)")


def test_a_backend_without_a_native_call_is_refused_by_name() -> None:
    with pytest.raises(SystemExit, match=r"no native throughput baseline for 'pytorch'; "
                                         r"expected one of onnxruntime, openvino"):
        script().library_step("pytorch", object(), {})
