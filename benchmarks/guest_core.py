"""Core-module guest vs native ONNX Runtime, measured in the same run.

1. Latency at batch 1: the C guest ``classify_named`` runs N inferences of the
   MobileNetV2-like network (width 1.0) through wasinn and times them itself (WASI
   monotonic clock, so the figure is set_input + compute + get_output as the guest sees
   them); native ONNX Runtime runs the same model, with the session options wasinn uses,
   on the same input. Goal: ratio <= 1.03. Both the legacy calls (set_input / compute /
   get_output by index) and wasinn's extensions (input by name, output buffer bound before
   compute) are measured. Each round gives two ratios, guest over native: of the mean
   times per inference, and of the median times (the median is less moved by the odd
   inference a busy host slows down); each is summarized by its median over the rounds.
2. Transfer: the ``transfer`` guest sends one big f32 tensor through an identity model
   and reads it back; MB/s counts the bytes moved in and out of the guest, against native
   ONNX Runtime running the same identity model on the same array.

Both are measured once more with the model sandboxed (``sandbox = true``), as a model a
guest loads from its own bytes runs on the CPU by default: the figure that guest sees.

Usage: python benchmarks/guest_core.py [--n 100] [--rounds 10] [--mb 16]

The guests are C, built here for wasm32-wasi: where there is no such compiler (or no
example sources), the script says what is missing and that it measured nothing, and exits
0, so that ``make bench`` runs the other scripts.

Rounds of 25 inferences were too short on a 2-core VM: each side's first runs after the
other's (its thread pool asleep, caches cold) weighed on the ratio; 100 per round keeps
that below the noise.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import trio

from wasinn.backends.base import LoadOptions
from wasinn.backends.onnxruntime import session_options
from wasinn.configs.loader import parse_config
from wasinn.host.engine import cache_dir
from wasinn.host.guests import build_example, compiler, examples_dir
from wasinn.modelgen import IMAGE_SHAPE, TensorType, export_mobilenet, identity_onnx, sample_image
from wasinn.scheduler import Runtime


def native_ms(session: Any, feed: dict[str, np.ndarray[Any, Any]], n: int) -> float:
    """Mean ms per inference (the transfer figures)."""
    return native_times(session, feed, n)[0]


def native_times(session: Any, feed: dict[str, np.ndarray[Any, Any]], n: int
                 ) -> tuple[float, float]:
    """Mean and median ms per inference, each inference timed as the guest times its."""
    session.run(None, feed)  # warm-up
    times = []
    start = time.perf_counter()
    for _ in range(n):
        begin = time.perf_counter()
        session.run(None, feed)
        times.append(time.perf_counter() - begin)
    mean = (time.perf_counter() - start) * 1e3 / n
    return mean, statistics.median(times) * 1e3


async def guest_ms(rt: Runtime, wasm: Path, argv: list[str], workdir: Path) -> float:
    """Run a guest with stdout captured to a file; the mean ms per iteration it printed."""
    return (await guest_times(rt, wasm, argv, workdir))[0]


async def guest_times(rt: Runtime, wasm: Path, argv: list[str], workdir: Path
                      ) -> tuple[float, float]:
    """Run a guest with stdout captured to a file; the mean ms per iteration it printed,
    and the median when it printed one (else the mean again)."""
    import os

    out = workdir / "guest-stdout.txt"
    saved = os.dup(1)
    with out.open("w") as sink:
        sys.stdout.flush()
        os.dup2(sink.fileno(), 1)
        try:
            code = await rt.run_wasm(wasm, argv=argv, dirs={"/d": str(workdir)})
        finally:
            os.dup2(saved, 1)
            os.close(saved)
    text = out.read_text()
    if code != 0:
        raise SystemExit(f"{wasm.name} exited with {code}: {text}")
    match = re.search(r"([\d.]+) ms each", text)
    if not match:
        raise SystemExit(f"{wasm.name} printed no timing: {text!r}")
    median = re.search(r"median ([\d.]+) ms", text)
    return float(match[1]), float(median[1]) if median else float(match[1])


def best_of(rounds: int, measure: Callable[[], float]) -> float:
    return min(measure() for _ in range(rounds))


def missing_guest_build() -> str | None:
    """What this machine lacks to build the C guests, or None when it has it all."""
    if compiler() is None:
        chosen = os.environ.get("WASINN_CC")
        why = (f"WASINN_CC={chosen!r} is not an executable" if chosen
               else "neither clang-19 nor clang is on PATH")
        return (f"no C compiler for wasm32-wasi ({why}): install clang-19, lld-19, "
                "libclang-rt-19-dev-wasm32 and wasi-libc, or set WASINN_CC")
    if examples_dir() is None:
        return "the example guests' C sources are not installed: run from a source checkout"
    return None


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100, help="inferences per measurement")
    parser.add_argument("--rounds", type=int, default=10,
                        help="interleaved guest/native measurements (short rounds, many of "
                        "them: the median ratio resists load from other processes)")
    parser.add_argument("--mb", type=float, default=16.0, help="transfer tensor size in MB")
    args = parser.parse_args()
    if (missing := missing_guest_build()) is not None:
        print(f"core-module guests not measured: {missing}; nothing was measured")
        return

    models = cache_dir() / "bench-models"
    files = export_mobilenet(models, width=1.0, seed=0)
    workdir = Path(tempfile.mkdtemp(prefix="wasinn-bench-"))
    image = sample_image(seed=0)
    (workdir / "input.bin").write_bytes(image.tobytes())
    (workdir / "identity.onnx").write_bytes(identity_onnx(TensorType.F32))
    config = parse_config({"models": {
        "mobilenet": {"files": [str(files.onnx)], "encoding": "onnx", "resident": True},
        "identity": {"files": [str(workdir / "identity.onnx")], "encoding": "onnx",
                     "resident": True},
        # A guest's own model runs so by default: the same graphs, sandboxed.
        "mobilenet-sandboxed": {"files": [str(files.onnx)], "encoding": "onnx",
                                "resident": True, "sandbox": True},
        "identity-sandboxed": {"files": [str(workdir / "identity.onnx")], "encoding": "onnx",
                               "resident": True, "sandbox": True},
    }}, None)
    classify = build_example("classify_named")
    transfer = build_example("transfer")
    native = ort.InferenceSession(str(files.onnx), session_options(LoadOptions()),
                                  providers=["CPUExecutionProvider"])
    count = int(args.mb * 1024 * 1024 / 16)
    big = np.arange(count * 4, dtype=np.float32).reshape(count, 4)
    identity = ort.InferenceSession(str(workdir / "identity.onnx"),
                                    session_options(LoadOptions()),
                                    providers=["CPUExecutionProvider"])
    print(f"MobileNetV2-like w1.0 {IMAGE_SHAPE}, batch 1, n={args.n} x {args.rounds} rounds; "
          f"{ort.get_device()} ONNX Runtime {ort.__version__}")
    async with Runtime(config) as rt:
        rows = []
        for label, flags, model in (("guest legacy ABI", ["--legacy"], "mobilenet"),
                                    ("guest wasinn ext", [], "mobilenet"),
                                    ("guest, sandboxed", ["--legacy"], "mobilenet-sandboxed")):
            wasinn_runs, native_runs = [], []
            for _ in range(args.rounds):  # interleaved, so drift hits both alike
                native_runs.append(native_times(native, {"input": image}, args.n))
                wasinn_runs.append(await guest_times(
                    rt, classify, [*flags, "--repeat", str(args.n), model,
                                   "/d/input.bin"], workdir))
            of_means = [w[0] / n[0] for w, n in zip(wasinn_runs, native_runs, strict=True)]
            of_medians = [w[1] / n[1] for w, n in zip(wasinn_runs, native_runs, strict=True)]
            rows.append((label, min(w[0] for w in wasinn_runs), min(n[0] for n in native_runs),
                         statistics.median(of_means), statistics.median(of_medians)))
        for label, w, n, means, medians in rows:
            print(f"  {label:18s} {w:8.3f} ms/inference   native ORT {n:8.3f} ms   "
                  f"ratio {w / n:.3f} best vs best; median over rounds of the ratio of "
                  f"means {means:.3f}, of medians {medians:.3f}")
        reps = max(3, args.n // 20)
        moved = 2 * big.nbytes
        t_guest = min([await guest_ms(rt, transfer, ["identity", str(count), str(reps)],
                                      workdir) for _ in range(args.rounds)])
        t_sandboxed = min([await guest_ms(rt, transfer, ["identity-sandboxed", str(count),
                                                         str(reps)], workdir)
                           for _ in range(args.rounds)])
        t_native = best_of(args.rounds, lambda: native_ms(identity, {"x": big}, reps))
        print(f"transfer {big.nbytes / 1e6:.1f} MB in + out per round ({reps} rounds):")
        print(f"  guest  {t_guest:8.3f} ms/round  {moved / t_guest / 1e3:9.1f} MB/s")
        print(f"  guest, sandboxed {t_sandboxed:8.3f} ms/round  "
              f"{moved / t_sandboxed / 1e3:9.1f} MB/s")
        print(f"  native {t_native:8.3f} ms/round  {moved / t_native / 1e3:9.1f} MB/s "
              f"(identity model only)   ratio {t_guest / t_native:.3f}")


if __name__ == "__main__":
    trio.run(main)
