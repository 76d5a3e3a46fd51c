"""Every script in ``benchmarks/`` still runs, on small settings, and prints its figures.

The figures themselves are not asserted on (wall time on a shared machine is noise; the
scripts print ratios for people to read): this only keeps the scripts from rotting as the
code they measure changes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.component_guests import require_tool
from tests.support import has_module, require_backend, skip_unless
from wasinn.host.guests import compiler

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

#: script -> (small settings, a line every complete run prints)
RUNS: dict[str, tuple[list[str], str]] = {
    "batching.py": (["--seconds", "0.05", "--rounds", "1", "--width", "0.25", "--callers", "1,4"],
                    r"^batched throughput, MobileNetV2-like w0\.25 on openvino, 4 callers: "
                    r"[\d.]+ req/s vs unbatched [\d.]+ req/s \([\d.]+x\), "
                    r"native batch-1 [\d.]+ req/s$"),
    "backend_overhead.py": (["--iters", "5", "--warmup", "2", "--width", "0.25"],
                            r"^onnxruntime\s+[\d.]+\s+[\d.]+\s+[+-][\d.]+$"),
    "first_request.py": (["--rounds", "1", "--iters", "2", "--width", "0.25", "--warmup", "1"],
                         r"with warmup = 1: [\d.]+ ms \([\d.]+x\); then [\d.]+ ms"),
    "pipeline.py": (["--iters", "5", "--width", "0.25"],
                    r"pipeline through the scheduler: .* ratio [\d.]+ .* host copies between "
                    r"the steps in 20 runs: 0 \(besides the 20 outputs brought to the host\)"
                    r"\npipeline in the caller's thread .* ratio [\d.]+"),
    "scheduler_overhead.py": (
        ["--iters", "20", "--width", "0.25", "--seconds", "0.05", "--rounds", "1"],
        r"scheduler, queue and context on top: -?[\d.]+ us(.|\n)*"
        # The native best is the library's own call, not wasinn's backend layer.
        r"^throughput on onnxruntime: native best \(the library's own "
        r"InferenceSession\.run\) [\d.]+ inferences/s(.|\n)*"
        r"16 guest threads\s+: [\d.]+ inferences/s, ratio to native best [\d.]+ \(\d+ of "
        r"\d+ runs .*, \d+ in the guests' own threads\)(.|\n)*"
        r"^throughput on openvino: native best \(the library's own InferRequest\.infer\) "
        r"(.|\n)*^(tiny model round trip "
        r"\(worker thread, pinned hand-offs\): direct [\d.]+ us|pinned hand-offs "
        r"\(pin_handoffs = true\): not measured)"),
    "sandbox_overhead.py": (["--iters", "5", "--warmup", "2", "--width", "0.25", "--loads",
                             "1", "--spare-wait", "0.2"],
                            # Each row's columns load the same model files.
                            r"^onnxruntime\s+ONNX(\s+[\d.]+){3}\s+[+-][\d.]+%\s+[+-][\d.]+%\n"
                            r"openvino\s+IR(\s+[\d.]+){3}\s+[+-][\d.]+%\s+[+-][\d.]+%$"),
    "startup.py": (["--models", "2", "--rounds", "1", "--threads", "1,2", "--width", "0.25",
                    "--backends", "onnxruntime"],
                   r"^  compile_threads = 2: start-up [\d.]+ s \([\d.]+x the native compiles, "
                   r"[\d.]+x compile_threads = 1\)$"),
    "gpu.py": (["--device", "cpu", "--iters", "3", "--warmup", "1", "--width", "0.25",
                "--batch", "2"],
               r"^pytorch\s+1  wasinn pipeline, worker thread\s+[\d.]+ [mu]s\s+[\d.]+  "
               r"[\d.]+-[\d.]+$(.|\n)*^  onnxruntime batch 2: wasinn pipeline, worker thread "
               r"0 in \d+ runs; (.|\n)*^every section ran$"),
    "guest_core.py": (["--n", "3", "--rounds", "1", "--mb", "1"],
                      r"native\s+[\d.]+ ms/round"),
    "guest_component.py": (["--n", "2", "--rounds", "1"],
                           r"guest -> host: stock\s+[\d.]+ ms"),
}


def test_every_benchmark_is_covered() -> None:
    assert sorted(p.name for p in BENCHMARKS.glob("*.py")) == sorted(RUNS)


@pytest.mark.parametrize("script", sorted(RUNS))
def test_benchmark_runs(script: str, tmp_path: Path) -> None:
    if script.startswith("guest_"):
        skip_unless("wasm", compiler() is not None, "no C compiler for wasm32-wasi")
    if script == "guest_component.py":
        require_tool("componentize-py")
        require_tool("wasm-tools")
    args, expected = RUNS[script]
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), *args],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          check=False)
    assert done.returncode == 0, f"{script} failed:\n{done.stdout}\n{done.stderr}"
    assert re.search(expected, done.stdout, re.MULTILINE), (
        f"{script} did not print a line matching {expected!r}:\n{done.stdout}"
    )


def test_guest_core_without_a_compiler_says_so_and_lets_make_bench_go_on(
        tmp_path: Path) -> None:
    require_backend("onnxruntime")
    skip_unless("wasm", has_module("wasmtime"), "wasmtime is not installed")
    done = subprocess.run([sys.executable, str(BENCHMARKS / "guest_core.py"), "--n", "1",
                           "--rounds", "1", "--mb", "1"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          check=False, env={**os.environ, "WASINN_CC": "/nonexistent"})
    assert done.returncode == 0, f"guest_core.py failed:\n{done.stdout}\n{done.stderr}"
    assert done.stdout == (
        "core-module guests not measured: no C compiler for wasm32-wasi "
        "(WASINN_CC='/nonexistent' is not an executable): install clang-19, lld-19, "
        "libclang-rt-19-dev-wasm32 and wasi-libc, or set WASINN_CC; nothing was measured\n")
