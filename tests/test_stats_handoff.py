"""A request's time queued, running and delivering, and the device time its model and
tenant are charged, when a worker thread grants the slot or trio takes a result late.

Under load the thread that ends a run passes its slot straight to the next queued request
and starts that request's run; trio learns of both only once it takes the ended run's
result, maybe several runs later (a busy event loop, a run that holds the GIL). The
figures must be each run's own whenever trio gets round to them: they come from the
thread's stamps, and the wait for trio to take a result is each request's time
delivering, neither queued nor running. Here the clock is a fake one (the actors'
perf_counter), advanced only by the runs, each by its own cost, or by the test while the
event loop is kept busy (blocked, as a long callback would block it) after a run ended.
"""

from __future__ import annotations

import functools
import threading
import time
import types
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import wasinn
from tests.fake_backend import FakeBackend, FakeGraph
from tests.support import cpu_pool, gate_job, serving_actor
from wasinn.actors import _batcher as batcher_module
from wasinn.actors import runner as runner_module
from wasinn.actors import workers as workers_module
from wasinn.actors.batching import Batching, BatchInputs
from wasinn.actors.stats import ModelStats, RequestFigures, RequestStats
from wasinn.tensor import Tensor, as_tensor

#: The requests queued behind a gated one, in order: (model, tenant, the run's seconds).
LOAD = (("cheap", "a", 1.0), ("costly", "b", 4.0), ("cheap", "b", 2.0), ("costly", "a", 8.0))
#: Every run's seconds: the fake clock once the queue has run down.
TOTAL = sum(cost for _, _, cost in LOAD)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The perf_counter of the worker threads and of the actor's request paths, advanced
    only by the runs themselves."""
    now = [0.0]
    fake = types.SimpleNamespace(perf_counter=lambda: now[0], monotonic=time.monotonic)
    for module in (workers_module, runner_module, batcher_module):
        monkeypatch.setattr(module, "time", fake)
    return now


def costing(seconds: float) -> np.ndarray[Any, Any]:
    """An input whose run takes ``seconds`` of the fake clock (see ``costed_runs``)."""
    return np.full((1, 4), seconds, np.float32)


def costed_runs(monkeypatch: pytest.MonkeyPatch, clock: list[float], runs: int
                ) -> threading.Event:
    """Each fake graph's run advances ``clock`` by its input's first value, once it has
    run (after its gate, for a gated graph); the event is set once ``runs`` runs that
    cost something have ended."""
    compute = FakeGraph._compute
    ended = threading.Event()
    costly = [0]

    def costed(graph: FakeGraph, inputs: Mapping[str, Tensor], keep: bool
               ) -> dict[str, Tensor]:
        result = compute(graph, inputs, keep)
        cost = float(as_tensor(inputs["x"]).numpy().reshape(-1)[0])
        clock[0] += cost
        if cost:
            costly[0] += 1
            if costly[0] == runs:
                ended.set()
        return result

    monkeypatch.setattr(FakeGraph, "_compute", costed)
    return ended


def split(figures: RequestFigures) -> tuple[Any, ...]:
    """(running p50, p99, queued p50, p99, delivering p50, p99, latency p50, p99, device
    seconds)."""
    return (figures.running_p50, figures.running_p99, figures.queued_p50,
            figures.queued_p99, figures.delivering_p50, figures.delivering_p99,
            figures.latency_p50, figures.latency_p99, figures.running_seconds)


async def test_runs_a_worker_thread_started_are_each_timed_and_charged_as_their_own(
        clock: list[float], monkeypatch: pytest.MonkeyPatch) -> None:
    ended = costed_runs(monkeypatch, clock, len(LOAD))
    fake = FakeBackend(devices=("cpu",))
    async with wasinn.Runtime(cpu_pool(workers=1, backends=["fake"]), backends=[fake]) as rt:
        gated = await rt.load([b"fake:add=0:gate"], "ggml", name="gated")
        models = {name: await rt.load([recipe], "ggml", name=name)
                  for name, recipe in (("cheap", b"fake:add=1"), ("costly", b"fake:add=2"))}
        async with trio.open_nursery() as nursery:
            try:
                nursery.start_soon(functools.partial(gated.compute, {"x": costing(0)},
                                                     tenant="gated"))
                await trio.testing.wait_all_tasks_blocked()
                for model, tenant, cost in LOAD:
                    nursery.start_soon(functools.partial(
                        models[model].compute, {"x": costing(cost)}, tenant=tenant))
                    await trio.testing.wait_all_tasks_blocked()
                assert rt.stats()[0].queued == len(LOAD)
                fake.gate.set()
                # The event loop busy while the worker thread goes from each run to the
                # next on its own: trio takes every result, and learns every grant, at
                # the end, the clock at TOTAL.
                assert ended.wait(10)
            finally:
                fake.gate.set()
        (device,) = rt.stats()
        by_model = {stats.name: stats for stats in rt.model_stats()}
        by_tenant = {stats.name: stats for stats in rt.tenant_stats()}
    assert device.passed_on == len(LOAD)
    # Running: each run's own seconds (the last one's slot freed by trio as it took the
    # result); queued: the runs before it (1, 4, 2, 8: 0, 1, 5, 7); delivering: the
    # wait for the busy loop, from the run's end to the clock at TOTAL (14, 10, 8, 0).
    # With two requests each, p50 is the smaller figure and p99 the larger.
    assert split(by_model["cheap"]) == (1.0, 2.0, 0.0, 5.0, 8.0, 14.0, TOTAL, TOTAL, 3.0)
    assert split(by_model["costly"]) == (4.0, 8.0, 1.0, 7.0, 0.0, 10.0, TOTAL, TOTAL, 12.0)
    assert split(by_tenant["a"]) == (1.0, 8.0, 0.0, 7.0, 0.0, 14.0, TOTAL, TOTAL, 9.0)
    assert split(by_tenant["b"]) == (2.0, 4.0, 1.0, 5.0, 8.0, 10.0, TOTAL, TOTAL, 6.0)
    # The device's running times tile its one slot's time: never more than the clock.
    assert device.running_seconds == TOTAL


async def test_a_merged_batch_is_timed_to_its_run_when_its_thread_starts_the_next(
        clock: list[float]) -> None:
    batch_running, batch_gate, plain_ended = (threading.Event() for _ in range(3))

    def run(inputs: Mapping[str, Tensor], keep: bool) -> dict[str, Tensor]:
        batch_running.set()
        assert batch_gate.wait(10)
        clock[0] += 2.0
        return {"y": Tensor.from_numpy(as_tensor(inputs["x"]).numpy() + 1)}

    def plain() -> None:
        clock[0] += 4.0
        plain_ended.set()

    inputs = BatchInputs.of({"x": costing(0)})
    assert inputs is not None
    members, alone = RequestStats(), RequestStats()
    gate = threading.Event()
    async with serving_actor(workers=1) as actor, trio.open_nursery() as nursery:
        try:
            nursery.start_soon(actor.execute, gate_job(gate))
            await trio.testing.wait_all_tasks_blocked()
            for _ in range(2):  # a full batch, queued for the slot
                nursery.start_soon(functools.partial(
                    actor.execute_batched, "g", inputs, run, Batching(max_batch=2),
                    account=members))
                await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(functools.partial(actor.execute, plain, account=alone))
            await trio.testing.wait_all_tasks_blocked()
            assert actor.stats().queued == 3  # the batch's two members, then the plain one
            gate.set()  # its thread passes the slot to the batch, which trio starts
            await trio.to_thread.run_sync(batch_running.wait, 10)
            # The event loop busy from before the batch's run ends until after the run
            # its thread started next (the plain request's) has ended too.
            batch_gate.set()
            assert plain_ended.wait(10)
        finally:
            gate.set()
            batch_gate.set()
    assert actor.stats().passed_on == 1
    # Each member: the batch's 2 s, half of it its own device time, then 4 s delivering
    # (trio took its result only once the plain run had ended); the plain request: its
    # 4 s, from the moment the batch's thread granted it the slot, queued 2 s before.
    assert split(ModelStats.of("members", members)) == (
        2.0, 2.0, 0.0, 0.0, 4.0, 4.0, 6.0, 6.0, 2.0)
    assert split(ModelStats.of("alone", alone)) == (4.0, 4.0, 2.0, 2.0, 0.0, 0.0, 6.0, 6.0, 4.0)


async def test_a_result_taken_late_by_a_busy_event_loop_counts_as_delivering(
        clock: list[float], monkeypatch: pytest.MonkeyPatch) -> None:
    # The device idle, its slot freed by trio as it takes the result: the thread's stamp
    # of the run's end still splits the run from the wait for the loop.
    woke = threading.Event()
    wake = workers_module.wake

    def waking(writer: Any) -> None:  # after the run's end is stamped
        wake(writer)
        woke.set()

    monkeypatch.setattr(workers_module, "wake", waking)

    go = threading.Event()

    def run() -> str:
        assert go.wait(10)
        clock[0] += 1.0
        return "ran"

    requests = RequestStats()
    async with serving_actor(workers=1) as actor, trio.open_nursery() as nursery:
        nursery.start_soon(functools.partial(actor.execute, run, account=requests))
        await trio.testing.wait_all_tasks_blocked()  # its caller waits for the result
        # The event loop busy (blocked here, as a long callback would block it) from
        # before the run ends until 5 s after, its result waiting to be taken.
        go.set()
        assert woke.wait(10)
        clock[0] += 5.0
    device = actor.stats()
    for figures in (ModelStats.of("model", requests), device):
        # Queued: nothing (the slot was free); running: the run's 1 s; delivering: 5 s.
        assert split(figures) == (1.0, 1.0, 0.0, 0.0, 5.0, 5.0, 6.0, 6.0, 1.0)
    assert "delivering p50 5000.00 ms p99 5000.00 ms" in device.describe()
