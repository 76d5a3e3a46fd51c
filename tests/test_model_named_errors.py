"""Errors and log lines that name the model: an operator running many models must tell
from a crash's warning, a refusal's, a timeout's or a full queue's error which model it
was, and which pool setting to raise.

* A sandboxed model's process that dies during a run is logged (a warning naming the
  model, its backend, the process, the device and the signal), and the caller's error
  starts with the model's name and backend; a back-off that starts (a caller's runs, or
  inputs, refused) is logged once, and the runs it refuses are not. A graph loaded
  without a name keeps the backend's name alone. The crashes are real ones: OpenVINO's
  CPU plugin on a ``GatherND`` index of -2**31 or -2**30 (see tests/test_sandbox.py).
* A request's deadline and a full queue name the request's run (its model and backend)
  and device; a full queue names its pool's ``queue_limit`` and its value.
* ``wasinn.scheduler`` at DEBUG logs each compile and each request that fails, times out
  or is refused.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import wasinn
from tests.loop_model import GUARD_S, HUGE_LOOP, loop_inputs, loop_onnx
from tests.support import cpu_pool, no_spares, require_backend, serving_actor
from tests.test_sandbox_caller_backoff import (  # noqa: F401 - clock is a fixture
    GOOD,
    POISONS,
    StillClock,
    _gathernd_rows_onnx,
    _rows,
    clock,
)
from wasinn import BackendRuntimeError, QueueFullError, TimeoutError_, TooLargeError
from wasinn.actors import DeviceActor
from wasinn.backends._sandbox_backoff import CrashBackoff, digest_of, shapes_of
from wasinn.configs.loader import parse_config
from wasinn.modelgen import affine_onnx

SEGV = "was killed by SIGSEGV"


def _warnings(caplog: pytest.LogCaptureFixture, graph: str = "m (b)") -> list[str]:
    """The warnings logged about ``graph`` (what its lines start with): not those of a
    platform where some confinement cannot be applied, say."""
    return [r.getMessage() for r in caplog.records
            if r.name == "wasinn.backends" and r.levelno == logging.WARNING
            and r.getMessage().startswith(f"{graph}: ")]


async def _sandboxed(rt: wasinn.Runtime, name: str = "") -> wasinn.Graph:
    return await rt.load([_gathernd_rows_onnx()], "onnx", options={"sandbox": True},
                         name=name)


# -- a sandboxed model's crash ----------------------------------------------------------
async def test_a_crash_is_logged_and_its_error_names_the_model(
        caplog: pytest.LogCaptureFixture) -> None:
    # Before: no log record at any level, and the error began "openvino: ...", whichever
    # of the host's models crashed.
    require_backend("openvino")
    require_backend("onnx")
    caplog.set_level(logging.WARNING, logger="wasinn.backends")
    async with wasinn.Runtime(no_spares(cpu_pool(backends=["openvino"], workers=1))) as rt:
        graph = await _sandboxed(rt, "resnet-prod")
        with pytest.raises(BackendRuntimeError) as crashed:
            await graph.compute(_rows(POISONS[0]), tenant="a")
        assert crashed.value.message.startswith(
            f"resnet-prod (openvino): the process running the model {SEGV}: the library "
            "crashed on this model or these inputs (the host goes on; ")
        (warning,) = _warnings(caplog, "resnet-prod (openvino)")
        assert warning.startswith("resnet-prod (openvino): sandbox process ")
        assert warning.endswith(f" on cpu {SEGV} during a run of caller 'a'")
        np.testing.assert_array_equal((await graph.compute(_rows(1)))["y"].numpy(), GOOD)
        # A graph loaded without a name: the backend's name alone, as before.
        unnamed = await _sandboxed(rt)
        with pytest.raises(BackendRuntimeError,
                           match=rf"^openvino: the process running the model {SEGV}: "):
            await unnamed.compute(_rows(POISONS[0]))
        (warning,) = _warnings(caplog, "openvino")
        assert warning.startswith("openvino: sandbox process ")
        await unnamed.unload()
        await graph.unload()


async def test_a_refusal_is_logged_once_as_it_starts_not_for_each_refused_run(
        caplog: pytest.LogCaptureFixture, clock: StillClock) -> None:  # noqa: F811
    # Before: neither the crashes nor the refusals that followed (a caller's runs, the
    # inputs) were logged. The clock stands still: the refusals last until the end.
    require_backend("openvino")
    require_backend("onnx")
    caplog.set_level(logging.WARNING, logger="wasinn.backends")
    async with wasinn.Runtime(no_spares(cpu_pool(backends=["openvino"], workers=1))) as rt:
        graph = await _sandboxed(rt, "shared")
        for _ in range(2):  # the same poison twice: its caller's and its own refusal
            with pytest.raises(BackendRuntimeError, match=SEGV):
                await graph.compute(_rows(POISONS[0]), tenant="a")
        crash, crash_again, caller, inputs = _warnings(caplog, "shared (openvino)")
        assert crash.startswith("shared (openvino): sandbox process ") and SEGV in crash
        assert crash_again.startswith("shared (openvino): sandbox process ")
        assert caller == ("shared (openvino): the runs of caller 'a' crashed its sandbox "
                          "process 2 times less than 60 s apart: its runs are refused for "
                          "0.5 s; other callers' runs go on")
        assert inputs == ("shared (openvino): inputs (i: i64[1, 1], x: f32[1, 2, 3]) "
                          "crashed its sandbox process 2 times: they are refused without a "
                          "run until 600 s after their last crash; other inputs run as "
                          "usual")
        for _ in range(3):
            with pytest.raises(TooLargeError, match=r"^shared \(openvino\): this caller's "
                                                    r"runs crashed the model's process 2 "
                                                    r"times"):
                await graph.compute(_rows(1), tenant="a")
            with pytest.raises(BackendRuntimeError, match=r"^shared \(openvino\): these "
                                                          r"inputs crashed the model's "
                                                          r"process 2 times"):
                await graph.compute(_rows(POISONS[0]), tenant="b")
        np.testing.assert_array_equal(
            (await graph.compute(_rows(1), tenant="b"))["y"].numpy(), GOOD)
        assert len(_warnings(caplog, "shared (openvino)")) == 4  # six refused runs, a good one
        await graph.unload()


def test_each_back_off_is_logged_once_as_it_starts(caplog: pytest.LogCaptureFixture
                                                   ) -> None:
    # The back-off alone (no process): a caller's refusal starts with each crash that
    # imposes a delay; inputs' refusal when they crash it the second time, not the third
    # (a run of them under way already); the graph's own delay of its next process too.
    caplog.set_level(logging.WARNING, logger="wasinn.backends")
    now = [1000.0]
    backoff = CrashBackoff("m (b)", clock=lambda: now[0])
    poison = {"x": wasinn.Tensor.from_numpy(np.ones((1, 4), np.float32))}
    inputs = (shapes_of(poison), digest_of(poison))
    backoff.crashed(SEGV, inputs, "a")
    assert _warnings(caplog) == []  # a first crash: the next run runs
    backoff.crashed(SEGV, inputs, "a")
    assert _warnings(caplog) == [
        "m (b): the runs of caller 'a' crashed its sandbox process 2 times less than 60 s "
        "apart: its runs are refused for 0.5 s; other callers' runs go on",
        "m (b): inputs (x: f32[1, 4]) crashed its sandbox process 2 times: they are "
        "refused without a run until 600 s after their last crash; other inputs run as "
        "usual"]
    for _ in range(5):
        assert backoff.refusal(inputs[1]) is not None
        assert backoff.holding("a") > 0
    assert len(_warnings(caplog)) == 2  # refused, not logged again
    now[0] += 1.0  # a's refusal over; a run of the poison already under way crashes it
    backoff.crashed(SEGV, inputs, "a")
    assert _warnings(caplog)[2:] == [
        "m (b): the runs of caller 'a' crashed its sandbox process 3 times less than 60 s "
        "apart: its runs are refused for 1 s; other callers' runs go on"]
    backoff.crashed(SEGV)
    backoff.crashed(SEGV)  # loading the model, twice
    assert _warnings(caplog)[3:] == [
        "m (b): its sandbox process crashed 2 times less than 60 s apart (loading the "
        "model, or runs that name no caller): its next process starts in 0.5 s, and runs "
        "wait for it"]


# -- a request's deadline and a full queue ------------------------------------------------
@pytest.fixture
async def busy_affine() -> AsyncIterator[tuple[wasinn.Runtime, wasinn.Graph, DeviceActor]]:
    """A runtime whose one CPU pool, ``edge`` (one worker, ``queue_limit = 1``), runs the
    model ``affine`` (ONNX Runtime), its only slot held by a gated job until the end."""
    require_backend("onnxruntime")
    config = parse_config({"pools": {"edge": {"kind": "cpu", "devices": ["cpu"],
                                              "workers": 1, "queue_limit": 1,
                                              "backends": ["onnxruntime"]}}}, None)
    gate = threading.Event()
    async with wasinn.Runtime(config) as rt:
        graph = await rt.load([affine_onnx()], "onnx", name="affine")
        (actor,) = rt.actors
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(actor.execute, lambda: gate.wait(GUARD_S)))
            await trio.testing.wait_all_tasks_blocked()
            try:
                yield rt, graph, actor
            finally:
                gate.set()


X = {"x": np.ones((1, 4), np.float32)}


async def test_a_timeout_names_the_model(busy_affine: Any) -> None:
    # Before: "cpu: the request's deadline passed before it finished (timeout=0.05 s)".
    _, graph, _ = busy_affine
    said = (r"^run of affine \(onnxruntime\) on cpu: the request's deadline passed before "
            r"it finished \(timeout=0\.05 s\)$")
    with pytest.raises(TimeoutError_, match=said):
        await graph.compute(X, timeout=0.05)
    with pytest.raises(TimeoutError_, match=said):  # a lease on a busy device, run there
        await graph.lease(X, timeout=0.05)


async def test_a_full_queue_names_the_model_the_pool_and_its_limit(busy_affine: Any
                                                                   ) -> None:
    # Before: "cpu: the request queue is full (1 waiting): retry later or raise the
    # pool's queue_limit": neither the model, nor the pool, nor the limit.
    _, graph, _ = busy_affine
    said = (r"^run of affine \(onnxruntime\) on cpu: the request queue is full \(1 "
            r"waiting\): retry later or raise \[pools\.edge\] queue_limit \(now 1\)$")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(graph.compute, X)  # queued, until cancelled
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(QueueFullError, match=said):
            await graph.compute(X)
        with pytest.raises(QueueFullError, match=said):
            await graph.lease(X)
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("max_delay", [0.0, 0.002])
async def test_a_batched_models_full_queue_names_the_model(busy_affine: Any,
                                                           max_delay: float) -> None:
    # Before: a request of a model with batching that opened a batch (or ran alone)
    # and found the queue full was told "cpu: the request queue is full ...".
    from wasinn.actors.batching import Batching

    rt, _, _ = busy_affine
    graph = await rt.load([affine_onnx()], "onnx", name="batched",
                          batching=Batching(max_batch=8, max_delay=max_delay))
    said = r"^run of batched \(onnxruntime\) on cpu: the request queue is full"
    rows8 = {"x": np.ones((8, 4), np.float32)}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(graph.compute, rows8)  # a full batch, queued until cancelled
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(QueueFullError, match=said):
            await graph.compute(X)  # opens a batch of its own
        with pytest.raises(QueueFullError, match=said):
            await graph.compute(rows8)  # too many rows to join: runs alone
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("path", ["queued through trio", "free slot taken in the thread"])
async def test_a_lease_run_past_its_deadline_names_the_model(path: str) -> None:
    # Before: "cpu: the request's deadline passed while it ran; the run was stopped".
    require_backend("onnxruntime")
    async with wasinn.Runtime(cpu_pool(workers=1, backends=["onnxruntime"])) as rt:
        graph = await rt.load([loop_onnx()], "onnx", name="loopy")
        with trio.fail_after(GUARD_S):
            if path == "queued through trio":
                lease = await graph.lease(loop_inputs(HUGE_LOOP), timeout=0.2)
            else:
                taken = graph.try_lease(loop_inputs(HUGE_LOOP), timeout=0.2)
                assert taken is not None  # compiled at load, the slot free
                lease = taken
            with pytest.raises(TimeoutError_, match=r"^run of loopy \(onnxruntime\) on cpu: "
                                                    r"the request's deadline passed while "
                                                    r"it ran; the run was stopped "
                                                    r"\(timeout=0\.2 s\)$"):
                await trio.to_thread.run_sync(lease.run)


async def test_a_lease_queued_past_its_deadline_names_its_run() -> None:
    # The slot of a lease requested through trio, waited for in the queue.
    gate = threading.Event()
    async with serving_actor(workers=1) as actor, trio.open_nursery() as nursery:
        nursery.start_soon(functools.partial(actor.execute, lambda: gate.wait(GUARD_S)))
        await trio.testing.wait_all_tasks_blocked()
        try:
            with pytest.raises(TimeoutError_, match=r"^run of m \(b\) on cpu: the "
                                                    r"request's deadline passed before "
                                                    r"it started$"):
                await actor.lease(lambda: None, deadline=trio.current_time() + 0.05,
                                  label="run of m (b)")
        finally:
            gate.set()


# -- wasinn.scheduler at DEBUG ------------------------------------------------------------
async def test_compiles_and_failed_requests_are_logged_at_debug(
        caplog: pytest.LogCaptureFixture) -> None:
    # Before: nothing of either; only "runtime started".
    require_backend("onnxruntime")
    caplog.set_level(logging.DEBUG, logger="wasinn.scheduler")
    async with wasinn.Runtime(cpu_pool(workers=1, backends=["onnxruntime"])) as rt:
        graph = await rt.load([affine_onnx()], "onnx", name="affine")
        await graph.compute(X)
        with pytest.raises(wasinn.InvalidArgumentError):
            await graph.compute({"x": np.ones((1, 5), np.float32)})
        await graph.unload()
    lines = [r.getMessage() for r in caplog.records
             if r.name == "wasinn.scheduler" and r.levelno == logging.DEBUG]
    compiled = [line for line in lines if "compiled" in line]
    assert len(compiled) == 1
    assert compiled[0].startswith("affine (onnxruntime): compiled on cpu in ")
    assert compiled[0].endswith(" s")
    failed = [line for line in lines if line.startswith("run of affine")]
    assert failed == [
        "run of affine (onnxruntime) on cpu: failed: InvalidArgumentError: onnxruntime: "
        "input 'x' has shape [1, 5] but the model expects x: f32[?, 4]"]
