"""What running a graph in a process of its own (``sandbox = true``) costs.

    python benchmarks/sandbox_overhead.py [--iters N] [--width W]

Each installed backend loads the same model twice on the CPU: in this process
(``Backend.load``) and sandboxed (``wasinn.backends.sandbox.load_sandboxed``); the native
figure is the library's own call, as in ``backend_overhead.py``. Calls are timed in
alternating blocks (see :func:`measure`). Printed: the sandboxed load's time; the
MobileNetV2-like run (ratio to native, and to the graph in this process); the tiny
affine graph's run in microseconds, where only the per-run cost shows (the copies into
and out of the shared arena, the two messages and the two process wake-ups).
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

import numpy as np

from wasinn import GraphEncoding, Tensor
from wasinn.backends import BackendRegistry, Device, LoadOptions
from wasinn.backends.sandbox import load_sandboxed
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

CPU = Device.parse("cpu")
FILES = {"onnxruntime": ("onnx", GraphEncoding.ONNX), "openvino": ("onnx", GraphEncoding.ONNX),
         "pytorch": ("torchscript", GraphEncoding.PYTORCH)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200, help="timed calls per side")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--width", type=float, default=1.0, help="MobileNetV2 width multiplier")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    registry = BackendRegistry()
    x = sample_image()
    print(f"MobileNetV2-like width {args.width:g}, batch 1, CPU; median of {args.iters} "
          "calls a side, in alternating blocks")
    print(f"{'backend':<12} {'load s':>7} {'native ms':>10} {'in-proc ms':>11} "
          f"{'sandbox ms':>11} {'vs native':>10} {'vs in-proc':>11}")
    with tempfile.TemporaryDirectory(prefix="wasinn-bench-") as tmp:
        files = export_mobilenet(Path(tmp), width=args.width)
        for name, setup in SETUPS.items():
            if not registry.is_installed(name):
                print(f"{name}: not installed, skipped")
                continue
            attr, encoding = FILES[name]
            native, in_process = setup(registry, files, x, LoadOptions())
            start = time.perf_counter()
            graph = load_sandboxed(registry.get(name), [getattr(files, attr).read_bytes()],
                                   encoding, CPU)
            load_s = time.perf_counter() - start
            tensor = {graph.inputs[0].name: Tensor.from_numpy(x)}
            try:
                native_ms, sandbox_ms, _ = measure(native, functools.partial(graph.run, tensor),
                                                   args.iters, args.warmup)
                _, in_ms, _ = measure(native, in_process, args.iters, args.warmup)
            finally:
                graph.close()
            print(f"{name:<12} {load_s:>7.2f} {native_ms:>10.3f} {in_ms:>11.3f} "
                  f"{sandbox_ms:>11.3f} {sandbox_ms / native_ms - 1:>+10.2%} "
                  f"{sandbox_ms / in_ms - 1:>+11.2%}")

    print("\nTiny affine ONNX graph (f32[1, 4]): run in microseconds")
    print(f"{'backend':<12} {'in-proc us':>11} {'sandbox us':>11} {'extra us':>9}")
    for name in ("onnxruntime", "openvino"):
        if not registry.is_installed(name):
            continue
        backend = registry.get(name)
        inside = backend.load([affine_onnx()], GraphEncoding.ONNX, CPU)
        graph = load_sandboxed(backend, [affine_onnx()], GraphEncoding.ONNX, CPU)
        tensor = {"x": Tensor.from_numpy(np.ones((1, 4), np.float32))}
        try:
            in_ms, sandbox_ms, paired = measure(functools.partial(inside.run, tensor),
                                                functools.partial(graph.run, tensor),
                                                args.iters * 5, args.warmup)
        finally:
            graph.close()
            inside.close()
        print(f"{name:<12} {in_ms * 1e3:>11.1f} {sandbox_ms * 1e3:>11.1f} {paired * 1e3:>+9.1f}")


if __name__ == "__main__":
    main()
