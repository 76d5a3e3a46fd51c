"""What running a graph in a process of its own (``sandbox = true``) costs.

    python benchmarks/sandbox_overhead.py [--iters N] [--width W] [--loads N]

Each installed backend loads the same model files twice on the CPU: in this process
(``Backend.load``) and sandboxed (``wasinn.backends.sandbox.load_sandboxed``); the native
figure is the library's own call on the graph loaded in this process, as in
``backend_overhead.py``. Every column of a row, and its loads, use the model files
``backend_overhead.py``'s ``SETUPS`` load (ONNX for ONNX Runtime, OpenVINO IR for
OpenVINO, TorchScript for PyTorch; the row names them), so that a row compares where the
graph runs and nothing else. Calls are timed in alternating blocks (see :func:`measure`).
Printed: the model's load in seconds (median of ``--loads``), in this process, sandboxed
in a process started for it, and sandboxed in a spare that had imported the library ahead
(:class:`~wasinn.backends.sandbox.Spares`, the runtime's default); the MobileNetV2-like
run (ratio to native, and to the graph in this process); the tiny affine graph's run in
microseconds, where only the per-run cost shows (the copies into and out of the shared
arena, the two messages and the two process wake-ups).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from wasinn import GraphEncoding, Tensor
from wasinn.backends import BackendRef, BackendRegistry, Device, LoadOptions
from wasinn.backends.sandbox import Spares, load_sandboxed
from wasinn.modelgen import affine_onnx, export_mobilenet, sample_image

sys.path.insert(0, str(Path(__file__).parent))
from backend_overhead import SETUPS, _time

Call = Callable[[], object]


def measure(native: Call, layer: Call, iters: int, warmup: int, block: int = 20
            ) -> tuple[float, float, float]:
    """Median latency (ms) of each, timed in alternating blocks of ``block`` calls (the
    first of each block untimed), and the difference of the medians (ms).

    Not interleaved call by call as in ``backend_overhead.py``: a library's threads spin
    for a while after a native call (OpenMP, ONNX Runtime's pool, TBB) and on a machine
    with few cores would slow the sandbox's process that runs next, which no sandboxed
    graph meets when the host is not running that same model itself."""
    for _ in range(warmup):
        native()
        layer()
    a: list[float] = []
    b: list[float] = []
    block = max(1, min(block, iters))
    while len(a) < iters:
        for call, times in ((native, a), (layer, b)) if len(a) % (2 * block) else (
                (layer, b), (native, a)):
            call()
            times.extend(_time(call) for _ in range(block))
    native_ms, layer_ms = statistics.median(a), statistics.median(b)
    return native_ms, layer_ms, layer_ms - native_ms


def time_loads(backend: Any, model: list[bytes], encoding: GraphEncoding, count: int,
               spare_wait: float) -> tuple[float, float, float]:
    """Median seconds of ``count`` loads of ``model`` (its builders): in this process,
    sandboxed in a new process, sandboxed in a spare given up to ``spare_wait`` seconds to
    import the library."""
    inside: list[float] = []
    cold: list[float] = []
    warm: list[float] = []
    for _ in range(count):
        inside.append(_seconds(lambda: backend.load(model, encoding, CPU)))
        cold.append(_seconds(lambda: load_sandboxed(backend, model, encoding, CPU)))
        spares = Spares(1)
        try:
            spares.replenish(BackendRef.of(backend), True)
            until = time.monotonic() + spare_wait
            while spares.ready() < 1 and time.monotonic() < until:
                time.sleep(0.01)  # a load takes a spare only once it has imported
            warm.append(_seconds(functools.partial(load_sandboxed, backend, model,
                                                   encoding, CPU, spares=spares)))
        finally:
            spares.close()
    return statistics.median(inside), statistics.median(cold), statistics.median(warm)


def _seconds(load: Callable[[], Any]) -> float:
    start = time.perf_counter()
    graph = load()
    seconds = time.perf_counter() - start
    graph.close()
    return seconds


CPU = Device.parse("cpu")
#: Backend -> (the ModelFiles fields of its builders, their encoding, the row's label):
#: the files ``SETUPS[backend]`` loads for the native and in-process columns.
FILES = {"onnxruntime": (("onnx",), GraphEncoding.ONNX, "ONNX"),
         "openvino": (("ir_xml", "ir_bin"), GraphEncoding.OPENVINO, "IR"),
         "pytorch": (("torchscript",), GraphEncoding.PYTORCH, "TorchScript")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200, help="timed calls per side")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--width", type=float, default=1.0, help="MobileNetV2 width multiplier")
    parser.add_argument("--loads", type=int, default=3, help="timed loads of each kind")
    parser.add_argument("--spare-wait", type=float, default=5.0,
                        help="the most seconds a spare may take to import its library "
                             "before a load is timed (torch takes about 1.5 here)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    registry = BackendRegistry()
    x = sample_image()
    print(f"MobileNetV2-like width {args.width:g}, batch 1, CPU; median of {args.iters} "
          "calls a side, in alternating blocks")
    print(f"{'backend':<12} {'model':<11} {'native ms':>10} {'in-proc ms':>11} "
          f"{'sandbox ms':>11} {'vs native':>10} {'vs in-proc':>11}")
    loads: dict[str, tuple[float, float, float]] = {}
    with tempfile.TemporaryDirectory(prefix="wasinn-bench-") as tmp:
        files = export_mobilenet(Path(tmp), width=args.width)
        for name, setup in SETUPS.items():
            if not registry.is_installed(name):
                print(f"{name}: not installed, skipped")
                continue
            fields, encoding, label = FILES[name]
            model = [getattr(files, field).read_bytes() for field in fields]
            loads[name] = time_loads(registry.get(name), model, encoding, args.loads,
                                     args.spare_wait)
            native, in_process = setup(registry, files, x, LoadOptions())
            graph = load_sandboxed(registry.get(name), model, encoding, CPU)
            tensor = {graph.inputs[0].name: Tensor.from_numpy(x)}
            try:
                native_ms, sandbox_ms, _ = measure(native, functools.partial(graph.run, tensor),
                                                   args.iters, args.warmup)
                _, in_ms, _ = measure(native, in_process, args.iters, args.warmup)
            finally:
                graph.close()
            print(f"{name:<12} {label:<11} {native_ms:>10.3f} {in_ms:>11.3f} "
                  f"{sandbox_ms:>11.3f} {sandbox_ms / native_ms - 1:>+10.2%} "
                  f"{sandbox_ms / in_ms - 1:>+11.2%}")

    print(f"\nLoading the model, seconds (median of {args.loads})")
    print(f"{'backend':<12} {'in-proc':>8} {'new process':>12} {'spare':>8} {'spare / new':>12}")
    for name, (inside, cold, warm) in loads.items():
        print(f"{name:<12} {inside:>8.3f} {cold:>12.3f} {warm:>8.3f} {warm / cold:>12.2f}")

    print("\nTiny affine ONNX graph (f32[1, 4]): run in microseconds")
    print(f"{'backend':<12} {'in-proc us':>11} {'sandbox us':>11} {'extra us':>9}")
    for name in ("onnxruntime", "openvino"):
        if not registry.is_installed(name):
            continue
        backend = registry.get(name)
        here = backend.load([affine_onnx()], GraphEncoding.ONNX, CPU)
        graph = load_sandboxed(backend, [affine_onnx()], GraphEncoding.ONNX, CPU)
        tensor = {"x": Tensor.from_numpy(np.ones((1, 4), np.float32))}
        try:
            in_ms, sandbox_ms, paired = measure(functools.partial(here.run, tensor),
                                                functools.partial(graph.run, tensor),
                                                args.iters * 5, args.warmup)
        finally:
            graph.close()
            here.close()
        print(f"{name:<12} {in_ms * 1e3:>11.1f} {sandbox_ms * 1e3:>11.1f} {paired * 1e3:>+9.1f}")


if __name__ == "__main__":
    main()
