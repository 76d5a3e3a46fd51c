"""What the benchmark scripts conclude from their figures.

A goal is judged on the estimator the script states (``backend_overhead.py``: the ratio of
the medians), and a figure no overhead can give (the scheduled call faster than the
direct call it wraps, a rate far above the library's own best) is a disturbed baseline,
never "goal met". The figures here are made up: no timing is taken.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
DISTURBED = "baseline disturbed: not a verdict"


def script(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module (``benchmarks/`` is not a package)."""
    spec = importlib.util.spec_from_file_location(f"{name}_under_test",
                                                  BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def scheduler() -> ModuleType:
    return script("scheduler_overhead")


@pytest.fixture(scope="module")
def backend() -> ModuleType:
    return script("backend_overhead")


@pytest.mark.parametrize(("ratio", "paired", "flag"), [
    # The ratio of medians is over the goal: flagged, whatever the paired median says.
    (0.05, 0.01, "  (> 2% goal)"),
    (0.0342, 0.0143, "  (> 2% goal)"),
    (0.05, 0.05, "  (> 2% goal)"),
    # Within the goal on the judged estimator: the other one beyond it is said.
    (0.01, 0.05, "  (within the 2% goal on ratio-1; paired exceeds it)"),
    (0.02, 0.0, ""),
    (-0.01, 0.003, ""),
])
def test_backend_overhead_judges_the_goal_on_the_ratio_of_medians(
        backend: ModuleType, ratio: float, paired: float, flag: str) -> None:
    assert backend.goal_flag(ratio, paired) == flag


@pytest.mark.parametrize(("low", "high", "goal", "no_overhead"), [
    (0.40, 0.95, 1.03, 1.0),  # scheduled 5-60 % faster than the call it wraps
    (0.539, 0.999, 1.03, 1.0),
    (-50e-6, -1e-6, 60e-6, 0.0),  # a tiny round trip that gains time
])
def test_an_interval_wholly_below_no_overhead_is_not_a_verdict(
        scheduler: ModuleType, low: float, high: float, goal: float,
        no_overhead: float) -> None:
    said = scheduler.verdict(low, high, goal, no_overhead=no_overhead)
    assert said.startswith(DISTURBED)
    assert "met" not in said and "missed" not in said


@pytest.mark.parametrize(("low", "high", "goal", "no_overhead", "said"), [
    (0.99, 1.02, 1.03, 1.0, "goal met"),  # reaches no overhead: noise around it, met
    (1.0, 1.0, 1.03, 1.0, "goal met"),
    (1.04, 1.09, 1.03, 1.0, "goal missed"),
    (1.02, 1.05, 1.03, 1.0, "the interval spans the goal: this machine's noise cannot tell"),
    (-5e-6, 20e-6, 60e-6, 0.0, "goal met"),
    (130e-6, 140e-6, 60e-6, 0.0, "goal missed"),
])
def test_an_interval_that_can_be_a_result_gets_its_verdict(
        scheduler: ModuleType, low: float, high: float, goal: float, no_overhead: float,
        said: str) -> None:
    assert scheduler.verdict(low, high, goal, no_overhead=no_overhead) == said


@pytest.mark.parametrize(("rate", "best", "disturbed"), [
    (159.3, 48.5, True),  # 3.3x the library's own best on the same model
    (111.0, 100.0, True),
    (110.0, 100.0, False),  # noise above 1 is still a figure
    (95.0, 100.0, False),
])
def test_a_rate_far_above_the_native_best_is_not_a_verdict(
        scheduler: ModuleType, rate: float, best: float, disturbed: bool) -> None:
    said = scheduler.rate_verdict(rate, best)
    assert said.startswith(DISTURBED) if disturbed else said == ""


def test_a_load_above_the_cpu_count_is_warned_of(scheduler: ModuleType) -> None:
    line = scheduler.load_report((5.5, 4.25, 3.0), 2)
    assert line.startswith("load average 5.50 / 4.25 / 3.00 (1 / 5 / 15 min) on 2 CPU(s): "
                           "WARNING: more runnable work than CPUs")


def test_a_load_within_the_cpu_count_is_only_printed(scheduler: ModuleType) -> None:
    assert scheduler.load_report((1.5, 2.0, 2.5), 2) == (
        "load average 1.50 / 2.00 / 2.50 (1 / 5 / 15 min) on 2 CPU(s)")


def test_no_load_average_is_said(scheduler: ModuleType) -> None:
    assert scheduler.load_report(None, 2) == "load average: not available on this platform"
