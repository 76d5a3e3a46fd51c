"""A sandboxed graph's crash back-off is per caller: the runs of the caller whose runs
crashed its process are refused at once for that caller's delay (TooLargeError), other
callers' runs wait for nothing (see :mod:`wasinn.backends._sandbox_backoff`).

Every test here that waits on a back-off uses a clock that stands still until the test
moves it: a run waiting for a delay would wait for ever, so a run that completes, or is
refused, shows it did not wait, and one that must be stopped (cancelled, or past its
deadline) shows it did. Nothing is asserted on wall time. The crashes are real ones: the
fake library of ``tests/crashing_backend.py`` kills its sandbox process (SIGSEGV) on a
first input of 666, and, through the runtime, OpenVINO's CPU plugin kills it on a
``GatherND`` index of -2**31 or -2**30 (see tests/test_sandbox.py).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import wasinn
from tests.crashing_backend import CRASH, CrashingBackend
from tests.support import cpu_pool, no_spares, require_backend, sandbox_children
from tests.test_batching import device_busy
from tests.test_sandbox import spawns  # noqa: F401 - a fixture (the pids started)
from wasinn import BackendRuntimeError, GraphEncoding, Tensor, TooLargeError
from wasinn.actors import DeviceActor
from wasinn.backends import Device
from wasinn.backends._sandbox_backoff import (
    FIRST_DELAY_S,
    MAX_CALLERS,
    MAX_DELAY_S,
    QUIET_S,
    CrashBackoff,
    digest_of,
    shapes_of,
)
from wasinn.backends.base import Cancellation, current_caller, running_under
from wasinn.backends.sandbox import SandboxedGraph, load_sandboxed

CPU = Device.parse("cpu")
ONES = {"x": Tensor.from_numpy(np.ones((1, 4), np.float32))}
SEGV = "was killed by SIGSEGV"
#: The timeout of a run that must not be held: only a run waiting for a back-off (on a
#: clock standing still) ever reaches it.
HELD_S = 60.0


def _refusal(backend: str) -> str:
    """The refusal of a run of caller a's, after its 2 crashes (a pattern)."""
    return (rf"^{backend}: this caller's runs crashed the model's process 2 times less "
            r"than 60 s apart: its runs are refused for 0\.5 s more, without a process "
            r"taken or started; other callers' runs go on: retry after that$")


def _poison(variant: float = 0.0) -> dict[str, Tensor]:
    """Inputs that crash the fake library; each ``variant`` other bytes."""
    return {"x": Tensor.from_numpy(np.array([[CRASH, variant, 0, 0]], np.float32))}


class StillClock:
    """A clock that stands still until a test moves it (:attr:`now`), and the crash
    back-offs of the sandboxed graphs loaded while it is installed, which read it."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.backoffs: list[CrashBackoff] = []

    def __call__(self) -> float:
        return self.now

    def backoff(self, backend: str) -> CrashBackoff:
        made = CrashBackoff(backend, clock=self)
        self.backoffs.append(made)
        return made


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> StillClock:
    """The clock of every sandboxed graph loaded from now on."""
    from wasinn.backends import sandbox

    still = StillClock()
    monkeypatch.setattr(sandbox, "CrashBackoff", still.backoff)
    return still


def _as(caller: str | None, run: Callable[[], Any], *args: Any) -> Any:
    """``run(*args)`` under a job of ``caller``'s, as a device actor's worker thread runs
    it. A run that would wait for ever (on a clock standing still) is cancelled after
    :data:`HELD_S`, and fails."""
    job = Cancellation(caller)
    timer = threading.Timer(HELD_S, job.cancel)
    timer.start()
    try:
        with running_under(job):
            return run(*args)
    finally:
        timer.cancel()


def _crashing_graph(processes: int = 1) -> SandboxedGraph:
    return load_sandboxed(CrashingBackend(), [b"fake:add=1"], GraphEncoding.GGML, CPU,
                          processes=processes)


# -- the back-off itself -------------------------------------------------------------------
def test_a_callers_crashes_hold_its_own_runs_and_no_one_elses() -> None:
    now = [0.0]
    backoff = CrashBackoff("b", clock=lambda: now[0])
    assert backoff.crashed(SEGV, (shapes_of(ONES), b"1"), "a") == (
        "the next run starts a new process")
    said = backoff.crashed(SEGV, (shapes_of(ONES), b"2"), "a")
    assert said == ("this caller's runs are refused for 0.5 s, after 2 crashes of its "
                    "runs less than 60 s apart; other callers' runs go on")
    # Its runs may take no process, idle or new; another caller's take either at once.
    assert (backoff.holding("a"), backoff.remaining("a")) == (FIRST_DELAY_S, FIRST_DELAY_S)
    assert (backoff.holding("b"), backoff.remaining("b")) == (0.0, 0.0)
    assert (backoff.holding(None), backoff.remaining(None)) == (0.0, 0.0)
    assert (backoff.crashes_of("a"), backoff.crashes_of("b"), backoff.crashes_of()) == (2, 0, 0)
    delays = []
    for _ in range(6):
        now[0] += 1.0
        backoff.crashed(SEGV, (shapes_of(ONES), b"3"), "a")
        delays.append(backoff.delay("a"))
    assert delays == [1.0, 2.0, 4.0, 8.0, MAX_DELAY_S, MAX_DELAY_S]
    assert backoff.delay("b") == backoff.delay() == 0.0
    now[0] += 4.0
    assert backoff.holding("a") == MAX_DELAY_S - 4.0
    now[0] += QUIET_S  # a minute without a crash: its streak is over, and it forgotten
    assert (backoff.holding("a"), backoff.callers, backoff.crashes) == (0.0, 0, 0)


def test_a_crash_while_loading_or_of_no_caller_delays_every_callers_new_process() -> None:
    now = [0.0]
    backoff = CrashBackoff("b", clock=lambda: now[0])
    backoff.crashed(SEGV)  # a load: the host's, whoever's run it was for
    assert backoff.crashed(SEGV, (shapes_of(ONES), b"1"), None) == (
        "the next process starts in 0.5 s, after 2 crashes less than 60 s apart: runs "
        "wait for it")
    assert backoff.crashes_of() == 2 and backoff.callers == 0
    # No new process for anyone; runs may take the processes still alive meanwhile.
    for caller in ("a", "", None):
        assert (backoff.holding(caller), backoff.remaining(caller)) == (0.0, FIRST_DELAY_S)
    backoff.crashed(SEGV, (shapes_of(ONES), b"2"), "a")  # a caller's first: no wait of its own
    now[0] += FIRST_DELAY_S
    assert backoff.remaining("a") == backoff.remaining("b") == 0.0


def test_callers_are_remembered_up_to_a_bound_the_least_recently_crashed_forgotten() -> None:
    now = [0.0]
    backoff = CrashBackoff("b", clock=lambda: now[0])
    inputs = (shapes_of(ONES), b"1")
    for _ in range(2):
        backoff.crashed(SEGV, inputs, "first")
    for caller in range(MAX_CALLERS - 1):
        backoff.crashed(SEGV, inputs, str(caller))
    assert backoff.callers == MAX_CALLERS
    backoff.crashed(SEGV, inputs, "first")  # crashed again: now the most recent
    backoff.crashed(SEGV, inputs, "one more")  # past the bound: "0" is forgotten
    assert backoff.callers == MAX_CALLERS
    assert (backoff.crashes_of("0"), backoff.crashes_of("1")) == (0, 1)
    assert backoff.crashes_of("first") == 3 and backoff.holding("first") == 1.0
    now[0] += QUIET_S
    assert backoff.callers == 0 and backoff.crashes_of("first") == 0


def test_poison_is_refused_whoever_sent_it() -> None:
    backoff = CrashBackoff("b", clock=lambda: 0.0)
    poison = _poison()
    crashed = (shapes_of(poison), digest_of(poison))
    backoff.crashed(SEGV, crashed, "a")
    assert backoff.refusal(crashed[1]) is None
    said = backoff.crashed(SEGV, crashed, "b")
    assert said.endswith("these inputs, which crashed it 2 times, are refused for 600 s")
    refusal = backoff.refusal(crashed[1])
    assert refusal is not None and "crashed the model's process 2 times" in refusal


def test_the_caller_of_a_thread_is_its_jobs_and_nobody_without_one() -> None:
    assert current_caller() is None
    with running_under(Cancellation("a")):
        assert current_caller() == "a"
        with running_under(Cancellation()):
            assert current_caller() is None
        seen: list[str | None] = []
        thread = threading.Thread(target=lambda: seen.append(current_caller()))
        thread.start()
        thread.join()
        assert seen == [None]  # per thread
    assert current_caller() is None


# -- a sandboxed graph ---------------------------------------------------------------------
def test_another_caller_runs_at_once_while_the_crashing_callers_runs_are_refused(
        clock: StillClock, spawns: list[int]) -> None:  # noqa: F811 - the fixture
    # Before: after caller a's second crash, every caller's run waited for the graph's
    # next process (and for ever here, the clock standing still); then a's runs waited
    # for a's delay, holding the worker slot their job ran in.
    graph = _crashing_graph()
    try:
        for variant in (1.0, 2.0):  # other poison each time: none refused
            with pytest.raises(BackendRuntimeError, match=SEGV):
                _as("a", graph.run, _poison(variant))
        out = _as("b", graph.run, ONES)
        np.testing.assert_array_equal(out["y"].numpy(), np.full((1, 4), 2.0, np.float32))
        (backoff,) = clock.backoffs
        assert (backoff.crashes_of("a"), backoff.holding("a")) == (2, FIRST_DELAY_S)
        assert len(spawns) == 3 and graph.pids == [spawns[-1]]  # started for b, idle now
        # a's next run takes no process, not even the idle one, and waits for none: it
        # is refused at once (waiting, it would have been stopped after HELD_S).
        with pytest.raises(TooLargeError, match=_refusal("crashing")) as refused:
            _as("a", graph.run, ONES)
        assert refused.value.retry_after == FIRST_DELAY_S  # for a client's own back-off
        assert len(spawns) == 3 and graph.pids == [spawns[-1]]
        np.testing.assert_array_equal(_as("b", graph.run, ONES)["y"].numpy(),
                                      np.full((1, 4), 2.0, np.float32))
        # Once its delay is over it runs, in the process b's run left: none is started.
        clock.now += FIRST_DELAY_S
        out = _as("a", graph.run, ONES)
        np.testing.assert_array_equal(out["y"].numpy(), np.full((1, 4), 2.0, np.float32))
        assert len(spawns) == 3 and graph.pids == [spawns[-1]]
    finally:
        graph.close()


#: The refusal of inputs that crashed the process twice (a pattern).
POISON_REFUSED = (r"^crashing: these inputs crashed the model's process 2 times \(the last "
                  r"0\.0 s ago: it was killed by SIGSEGV\): they are refused without a run "
                  r"until 600 s after their last crash; other inputs run as usual$")


@pytest.mark.parametrize("caller", ["a", None], ids=["caller", "nobody"])
def test_known_poison_is_refused_as_poison_before_any_back_off_of_its_caller(
        clock: StillClock, spawns: list[int], caller: str | None) -> None:  # noqa: F811
    # The poison refusal comes first, and must: inputs refused for 600 s whoever sends
    # them are told so (runtime-error), not to retry in 0.5 s (too-large, retry_after),
    # which would invite a retry refused again, by the same poison refusal then. Nor
    # does a known poison wait for the graph's delayed process (for ever here, the clock
    # standing still), holding a worker slot for a run it will never make.
    graph = _crashing_graph()
    try:
        for _ in range(2):  # the same poison twice: refused from now on
            with pytest.raises(BackendRuntimeError, match=SEGV):
                _as(caller, graph.run, _poison())
        (backoff,) = clock.backoffs
        assert (backoff.holding(caller), backoff.remaining(caller)) == (
            (FIRST_DELAY_S, FIRST_DELAY_S) if caller else (0.0, FIRST_DELAY_S))
        for sender in (caller, "b"):  # whoever sends it
            with pytest.raises(BackendRuntimeError, match=POISON_REFUSED):
                _as(sender, graph.run, _poison())
        assert len(spawns) == 2 and graph.pids == []  # the load's, one after a crash
    finally:
        graph.close()


def test_poison_sent_at_once_by_several_callers_crashes_the_process_twice_at_most(
        spawns: list[int]) -> None:  # noqa: F811 - the fixture
    # Three callers send the same poison to a graph of one process at once: b's and c's
    # runs are checked (unknown inputs: they run), then wait for a's process. a's run
    # crashes it, then b's the next: the inputs are refused from then on, and c's run,
    # checked again once it has its process, is refused instead of crashing a third.
    graph = _crashing_graph()
    waiting = threading.Semaphore(0)
    go = threading.Event()
    real_wait, real_run_in = graph._cond.wait, graph._run_in

    def counted_wait(timeout: float | None = None) -> bool:
        waiting.release()
        return real_wait(timeout)

    def gated_run_in(*args: Any) -> Any:
        assert go.wait(HELD_S)  # a's run, until b's and c's wait for its process
        return real_run_in(*args)

    graph._cond.wait = counted_wait  # type: ignore[method-assign]
    graph._run_in = gated_run_in  # type: ignore[method-assign]
    said: dict[str, BaseException] = {}

    def send(caller: str) -> None:
        try:
            _as(caller, graph.run, _poison())
        except BaseException as exc:  # (each one's is asserted on below)
            said[caller] = exc

    senders = [threading.Thread(target=send, args=(c,), daemon=True) for c in "abc"]
    try:
        senders[0].start()
        for sender in senders[1:]:
            sender.start()
            assert waiting.acquire(timeout=HELD_S)  # checked, and waiting for a process
        go.set()
        for sender in senders:
            sender.join(HELD_S)
        crashed = [c for c, exc in said.items() if f"the model {SEGV}:" in str(exc)]
        refused = [c for c, exc in said.items() if "are refused without a run" in str(exc)]
        assert (len(crashed), len(refused)) == (2, 1), said
    finally:
        graph.close()


def _sending(graph: SandboxedGraph, inputs: dict[str, Tensor], caller: str,
             said: dict[str, Any], job: Cancellation | None = None) -> threading.Thread:
    """A thread, started, that runs ``inputs`` on ``graph`` as ``caller`` (under ``job``
    where given, else as :func:`_as` does): its outputs or what it raised in
    ``said[caller]``."""
    def send() -> None:
        try:
            if job is None:
                said[caller] = _as(caller, graph.run, inputs)
            else:
                with running_under(job):
                    said[caller] = graph.run(inputs)
        except BaseException as exc:  # (each one's is asserted on by the test)
            said[caller] = exc

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def _crashes_and_refusals(said: dict[str, Any]) -> tuple[int, int]:
    """How many of the runs ``said`` crashed the process, and how many were refused as
    poison."""
    told = [str(exc) for exc in said.values() if isinstance(exc, BaseException)]
    return (sum(f"the model {SEGV}:" in text for text in told),
            sum("are refused without a run" in text for text in told))


def test_poison_sent_at_once_to_a_graph_of_several_processes_crashes_it_twice_at_most(
        spawns: list[int]) -> None:  # noqa: F811 - the fixture
    # Four callers send the same new poison to a graph of four processes at once: one
    # run has the process the load started, the other three are checked (unknown inputs:
    # they run) and each starts a process beside it. The first run crashes its process;
    # then the three have their processes, and each, checked again, finds that the
    # inputs crashed it once only. Before, each ran them and crashed its own process (4
    # crashes). Now inputs that crashed it once run on one process at a time: one of the
    # three crashes its process, the second crash, and the two that waited for its
    # outcome (having given their processes back) are refused.
    graph = _crashing_graph(processes=4)
    starting, arrived = threading.Semaphore(0), threading.Semaphore(0)
    go, crashed_once, again = threading.Event(), threading.Event(), threading.Event()
    entries = itertools.count()
    real_start, real_run_in = graph._start, graph._run_in

    def gated_start(**kwargs: Any) -> Any:
        starting.release()
        assert crashed_once.wait(HELD_S)  # until the first run has crashed its process
        return real_start(**kwargs)

    def gated_run_in(*args: Any) -> Any:
        if next(entries):  # one of the three, on the process it started
            arrived.release()
            assert again.wait(HELD_S)  # until each runs, or waits for the one that does
            return real_run_in(*args)
        assert go.wait(HELD_S)  # the first, until the three others start processes
        try:
            return real_run_in(*args)
        finally:
            crashed_once.set()

    graph._start = gated_start  # type: ignore[method-assign]
    graph._run_in = gated_run_in  # type: ignore[method-assign]
    graph._settled = _CountedWaits(graph._settled, arrived)  # type: ignore[attr-defined]
    said: dict[str, Any] = {}
    try:
        senders = [_sending(graph, _poison(), "a", said)]
        for caller in "bcd":
            senders.append(_sending(graph, _poison(), caller, said))
            assert starting.acquire(timeout=HELD_S)  # checked, and starting a process
        go.set()
        for _ in range(3):
            assert arrived.acquire(timeout=HELD_S)
        again.set()
        for sender in senders:
            sender.join(HELD_S)
        assert _crashes_and_refusals(said) == (2, 2), said
        assert len(spawns) == 4  # the load's, and one for each of the three: no more
    finally:
        graph.close()


def test_inputs_that_crashed_the_process_once_run_one_at_a_time_until_they_run(
        spawns: list[int]) -> None:  # noqa: F811 - the fixture
    # Inputs that crashed the process once (another run's doing, say: a heap corrupted
    # earlier) are sent by three callers at once to a graph of three processes: one run
    # of them at a time, the others waiting for its outcome holding no process. It runs
    # without a crash: they are forgotten, and the two that waited run too (not
    # refused), as any inputs do.
    graph = _crashing_graph(processes=3)
    graph.backoff.crashed(SEGV, (shapes_of(ONES), digest_of(ONES)), "z")
    lock = threading.Lock()
    entered, waiting = threading.Event(), threading.Semaphore(0)
    go = threading.Event()
    runs = [0]  # the runs that reached their process, of these inputs
    real_run_in = graph._run_in

    def gated_run_in(*args: Any) -> Any:
        with lock:
            runs[0] += 1
            first = runs[0] == 1
        if first:
            entered.set()
        else:  # (a second run beside the first: it did not wait, as it must)
            waiting.release()
        assert go.wait(HELD_S)
        return real_run_in(*args)

    graph._run_in = gated_run_in  # type: ignore[method-assign]
    graph._settled = _CountedWaits(graph._settled, waiting)  # type: ignore[attr-defined]
    said: dict[str, Any] = {}
    try:
        senders = [_sending(graph, ONES, "a", said)]
        assert entered.wait(HELD_S)
        senders += [_sending(graph, ONES, caller, said) for caller in "bc"]
        for _ in range(2):
            assert waiting.acquire(timeout=HELD_S)
        assert runs[0] == 1 and len(spawns) == 1  # the others took no process
        go.set()
        for sender in senders:
            sender.join(HELD_S)
        assert sorted(said) == ["a", "b", "c"]
        for out in said.values():
            np.testing.assert_array_equal(out["y"].numpy(), np.full((1, 4), 2.0, np.float32))
        assert runs[0] == 3 and not graph.backoff.knows(shapes_of(ONES))  # forgotten
    finally:
        graph.close()


def test_a_run_waiting_for_another_run_of_the_same_inputs_may_be_cancelled(
        spawns: list[int]) -> None:  # noqa: F811 - the fixture
    # Its job cancelled (its caller gave up, or its deadline passed), a run waiting for
    # the outcome of another run of inputs that crashed the process once stops waiting;
    # it held no process, and the other run goes on.
    graph = _crashing_graph(processes=2)
    graph.backoff.crashed(SEGV, (shapes_of(ONES), digest_of(ONES)), "z")
    entered, waiting, go = threading.Event(), threading.Semaphore(0), threading.Event()
    real_run_in = graph._run_in

    def gated_run_in(*args: Any) -> Any:
        entered.set()
        assert go.wait(HELD_S)
        return real_run_in(*args)

    graph._run_in = gated_run_in  # type: ignore[method-assign]
    graph._settled = _CountedWaits(graph._settled, waiting)  # type: ignore[attr-defined]
    said: dict[str, Any] = {}
    job = Cancellation("b")
    try:
        first = _sending(graph, ONES, "a", said)
        assert entered.wait(HELD_S)
        second = _sending(graph, ONES, "b", said, job)
        assert waiting.acquire(timeout=HELD_S)
        job.cancel()
        second.join(HELD_S)
        assert isinstance(said["b"], BackendRuntimeError), said
        assert str(said["b"]) == (
            "crashing: cancelled while waiting for another run of these inputs, which "
            "crashed the model's process once: such inputs run on one process at a time "
            "until they run without a crash or are refused")
        go.set()
        first.join(HELD_S)
        np.testing.assert_array_equal(said["a"]["y"].numpy(),
                                      np.full((1, 4), 2.0, np.float32))
        assert len(spawns) == 1 and len(graph.pids) == 1  # none started for b
    finally:
        graph.close()


def test_the_crash_of_inputs_already_refused_says_how_often_they_crashed_it(
        spawns: list[int]) -> None:  # noqa: F811 - the fixture
    # Three runs of the same new poison have their processes before any crashes: none
    # can know it, and each crashes its process. Each crash says how often these inputs
    # have crashed it (before, the third said 2 times, the count from which they are
    # refused), and so does the refusal after.
    graph = _crashing_graph(processes=3)
    entered, go = threading.Semaphore(0), threading.Event()
    real_run_in = graph._run_in

    def gated_run_in(*args: Any) -> Any:
        entered.release()
        assert go.wait(HELD_S)  # until all three have their processes
        return real_run_in(*args)

    graph._run_in = gated_run_in  # type: ignore[method-assign]
    said: dict[str, Any] = {}
    try:
        senders = [_sending(graph, _poison(), caller, said) for caller in "abc"]
        for _ in senders:
            assert entered.acquire(timeout=HELD_S)
        go.set()
        for sender in senders:
            sender.join(HELD_S)
        assert _crashes_and_refusals(said) == (3, 0), said
        ends = sorted(str(exc).rsplit("(the host goes on; ", 1)[1] for exc in said.values())
        assert ends == [
            "the next run starts a new process)",
            "the next run starts a new process; these inputs, which crashed it 2 times, "
            "are refused for 600 s)",
            "the next run starts a new process; these inputs, which crashed it 3 times, "
            "are refused for 600 s)"]
        with pytest.raises(BackendRuntimeError,
                           match="these inputs crashed the model's process 3 times"):
            _as("d", graph.run, _poison())
    finally:
        graph.close()


class _CountedWaits:
    """A condition whose every wait releases ``waiting`` first (the rest as ``cond``)."""

    def __init__(self, cond: threading.Condition, waiting: threading.Semaphore) -> None:
        self._cond, self._waiting = cond, waiting

    def wait(self, timeout: float | None = None) -> bool:
        self._waiting.release()
        return self._cond.wait(timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cond, name)


def test_a_graph_used_directly_is_one_caller_as_before(
        clock: StillClock, spawns: list[int]) -> None:  # noqa: F811 - the fixture
    graph = _crashing_graph()
    try:
        for variant in (1.0, 2.0):
            with pytest.raises(BackendRuntimeError, match=SEGV):
                graph.run(_poison(variant))  # under no job: nobody named
        (backoff,) = clock.backoffs
        assert (backoff.crashes_of(), backoff.callers) == (2, 0)
        # The graph's own streak: a named caller's run starts no process either.
        cancellation = Cancellation("b")
        threading.Timer(0.3, cancellation.cancel).start()
        with running_under(cancellation), pytest.raises(BackendRuntimeError, match=(
                r"^crashing: cancelled while waiting for a process of the model \(after 2 "
                r"crashes, a new one starts in 0\.5 s\)$")):
            graph.run(ONES)
        assert len(spawns) == 2
    finally:
        graph.close()


# -- through the runtime, on every path that reaches a sandboxed graph --------------------
INT32_MIN = -(2**31)
#: GatherND indices that kill OpenVINO's CPU plugin (SIGSEGV).
POISONS = (INT32_MIN, -(2**30))


def _gathernd_rows_onnx() -> bytes:
    """``y[n] = x[n, i[n, 0]]``: a GatherND of batch_dims 1, whose rows are independent,
    so its requests may be batched."""
    from onnx import TensorProto, helper

    from wasinn.modelgen import onnx_model_bytes

    node = helper.make_node("GatherND", ["x", "i"], ["y"], batch_dims=1)
    graph = helper.make_graph(
        [node], "gathernd_rows",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 2, 3]),
         helper.make_tensor_value_info("i", TensorProto.INT64, ["n", 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])])
    return onnx_model_bytes(graph)


def _rows(index: int) -> dict[str, np.ndarray[Any, Any]]:
    return {"x": np.arange(6, dtype=np.float32).reshape(1, 2, 3),
            "i": np.array([[index]], np.int64)}


GOOD = np.array([[3.0, 4.0, 5.0]], np.float32)  # row 1 of x

#: One request of a tenant's, made on one path (runtime, graph, inputs, tenant, timeout):
#: its output ``y``.
Path = Callable[..., Awaitable[np.ndarray[Any, Any]]]


async def _computed(rt: wasinn.Runtime, graph: wasinn.Graph, inputs: dict[str, Any],
                    tenant: str, timeout: float | None) -> np.ndarray[Any, Any]:
    """In a device worker thread."""
    return (await graph.compute(inputs, tenant=tenant, timeout=timeout))["y"].numpy()


async def _leased(rt: wasinn.Runtime, graph: wasinn.Graph, inputs: dict[str, Any],
                  tenant: str, timeout: float | None) -> np.ndarray[Any, Any]:
    """In the caller's thread, on a slot taken through trio."""
    lease = await graph.lease(inputs, tenant=tenant, timeout=timeout)
    out = await trio.to_thread.run_sync(lease.run)
    return out["y"].numpy()


async def _try_leased(rt: wasinn.Runtime, graph: wasinn.Graph, inputs: dict[str, Any],
                      tenant: str, timeout: float | None) -> np.ndarray[Any, Any]:
    """In the caller's thread, on a slot taken there, without trio."""
    def run() -> np.ndarray[Any, Any]:
        lease = graph.try_lease(inputs, tenant=tenant, timeout=timeout)
        assert lease is not None  # an idle device, the graph compiled there
        return lease.run()["y"].numpy()

    return await trio.to_thread.run_sync(run)


async def _batched(rt: wasinn.Runtime, graph: wasinn.Graph, inputs: dict[str, Any],
                   tenant: str, timeout: float | None) -> np.ndarray[Any, Any]:
    """As a batch's job: queued behind another request, it opens a batch."""
    out: list[Any] = []

    async def request() -> None:
        try:
            out.append(await _computed(rt, graph, inputs, tenant, timeout))
        except wasinn.WasiNNError as exc:
            out.append(exc)

    async with _device_busy(rt) as nursery:
        nursery.start_soon(request)
    if isinstance(out[0], Exception):
        raise out[0]
    result: np.ndarray[Any, Any] = out[0]
    return result


async def _merged(rt: wasinn.Runtime, graph: wasinn.Graph, tenant: str, count: int
                  ) -> list[Any]:
    """``count`` requests of ``tenant``'s, queued together: one batch's outputs."""
    out: list[Any] = [None] * count

    async def request(i: int) -> None:
        out[i] = (await _computed(rt, graph, _rows(1), tenant, HELD_S)).tolist()

    async with _device_busy(rt) as nursery:
        for i in range(count):
            nursery.start_soon(request, i)
    return out


@contextlib.asynccontextmanager
async def _device_busy(rt: wasinn.Runtime) -> AsyncIterator[trio.Nursery]:
    """The device's only slot held until the block ends: requests started in the nursery
    queue behind it (as batches, for a graph loaded with batching)."""
    async with device_busy(_only_actor(rt)) as nursery:
        yield nursery
        await trio.testing.wait_all_tasks_blocked()
        assert _only_actor(rt).stats().queued >= 1


def _only_actor(rt: wasinn.Runtime) -> DeviceActor:
    (actor,) = rt.actors
    return actor


@pytest.mark.parametrize(("path", "pool"), [
    (_computed, {}),
    # A sandboxed graph never runs inline (it may wait for a process), where the caller
    # would go unnamed: on such a pool too, its runs are a worker thread's jobs.
    (_computed, {"inline_below_us": 10_000}),
    (_batched, {}),
    (_leased, {}),
    (_try_leased, {})],
    ids=["worker-thread", "worker-thread-of-an-inline-pool", "batch", "lease", "try-lease"])
async def test_a_tenants_crashes_refuse_its_own_requests_not_another_tenants(
        path: Path, pool: dict[str, Any], clock: StillClock) -> None:
    # Before: after tenant a's second crash, tenant b's request waited for the graph's
    # next process (for ever here, the clock standing still); and the actor layer named
    # no tenant to the backend. Then a's next request waited for a's delay.
    require_backend("openvino")
    require_backend("onnx")
    batching = wasinn.Batching(max_batch=4) if path is _batched else None
    config = no_spares(cpu_pool(backends=["openvino"], workers=1, **pool))
    async with wasinn.Runtime(config) as rt:
        graph = await rt.load([_gathernd_rows_onnx()], "onnx", options={"sandbox": True},
                              batching=batching)
        for index in POISONS:
            with pytest.raises(BackendRuntimeError, match=SEGV):
                await path(rt, graph, _rows(index), "a", None)
        # (held, it would wait for ever: its deadline then fails it)
        np.testing.assert_array_equal(await path(rt, graph, _rows(1), "b", HELD_S), GOOD)
        if path is _batched:  # and two of b's merged into one run
            assert await _merged(rt, graph, "b", 2) == [GOOD.tolist()] * 2
            assert graph.stats().batches == 1
        (backoff,) = clock.backoffs
        assert (backoff.crashes_of("a"), backoff.crashes_of("b"), backoff.crashes_of()) == (
            2, 0, 0)
        (process,) = sandbox_children()  # started for b, idle now
        # a's next request takes no process, not even the idle one, and waits for none:
        # it is refused at once (waiting, it would fail at its deadline).
        with pytest.raises(TooLargeError, match=_refusal("openvino")) as refused:
            await path(rt, graph, _rows(1), "a", HELD_S)
        assert refused.value.retry_after == FIRST_DELAY_S  # kept through the actor
        assert [p.pid for p in sandbox_children()] == [process.pid]
        clock.now += FIRST_DELAY_S  # its delay is over: it runs, in the same process
        np.testing.assert_array_equal(await path(rt, graph, _rows(1), "a", None), GOOD)
        assert [p.pid for p in sandbox_children()] == [process.pid]
        assert backoff.crashes_of("a") == 2 and backoff.callers == 1
        assert graph.stats().in_caller_thread == (0 if path in (_computed, _batched) else 5)
        await graph.unload()


@pytest.mark.parametrize("policy", ["fair", "priority"])
async def test_a_refused_tenant_holds_no_slot_of_the_device(policy: str, clock: StillClock
                                                            ) -> None:
    # Before: tenant a's requests waited for a's delay in the device's worker thread,
    # holding its only slot, and tenant b's request queued behind them (for ever here,
    # the clock standing still: until b's deadline). A tenant crashing a shared model
    # with requests in flight starved every other tenant of the device.
    require_backend("openvino")
    require_backend("onnx")
    config = no_spares(cpu_pool(backends=["openvino"], workers=1, policy=policy))
    async with wasinn.Runtime(config) as rt:
        graph = await rt.load([_gathernd_rows_onnx()], "onnx", options={"sandbox": True})
        for index in POISONS:
            with pytest.raises(BackendRuntimeError, match=SEGV):
                await _computed(rt, graph, _rows(index), "a", None)
        refused: list[Exception] = []

        async def a_request() -> None:
            try:
                await _computed(rt, graph, _rows(1), "a", HELD_S)
            except wasinn.WasiNNError as exc:
                refused.append(exc)

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(a_request)
            await trio.testing.wait_all_tasks_blocked()  # a's sent, the first granted
            np.testing.assert_array_equal(
                await _computed(rt, graph, _rows(1), "b", HELD_S), GOOD)
        assert [type(exc) for exc in refused] == [TooLargeError] * 3
        # Failed requests, counted once each as such (2 crashes, 3 refusals).
        stats = _only_actor(rt).stats()
        assert (stats.completed, stats.failed, stats.rejected) == (1, 5, 0)
        await graph.unload()
