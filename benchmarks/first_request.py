"""The first request a freshly started runtime serves, with and without warm-up.

    python benchmarks/first_request.py [--rounds R] [--iters N] [--width W] [--warmup K]
                                       [--backends onnxruntime,openvino,pytorch]

A backend's first run on a new session costs more than the next ones (ONNX Runtime and
OpenVINO allocate their memory and choose kernels, torch's TorchScript profiles and
optimises the graph on its first calls). ``preload = true`` compiles a registered model
while the runtime starts; ``warmup = 1`` also runs it once there on zero-filled inputs.

For each backend, R rounds, each with fresh sessions: natively (the library's session,
compiled by wasinn's backend layer, called directly), its first run and the median of
the N next; then through wasinn with a runtime whose config preloads the MobileNetV2-like
network (width W), the first ``compute`` after ``load_by_name`` (and, with warm-up, the
median of the N next), with ``warmup = 0`` and
with ``warmup = K`` (``--warmup``, 2 by default: TorchScript optimises the graph over its
first two calls), and how long the runtime took to start in each case. First runs are
printed as ratios to the native steady run measured in the same round (medians over the
rounds).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import trio

import wasinn
from wasinn.backends.base import LoadOptions
from wasinn.backends.registry import BackendRegistry
from wasinn.modelgen import ModelFiles, export_mobilenet, sample_image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from backend_overhead import SETUPS  # a sibling script: the native calls

#: backend -> (encoding, the model files it reads, the input's name)
MODELS = {
    "onnxruntime": ("onnx", ("onnx",), "input"),
    "openvino": ("openvino", ("ir_xml", "ir_bin"), "input"),
    "pytorch": ("pytorch", ("torchscript",), "x"),
}

CONFIG = """
[pools.cpu]
kind = "cpu"
devices = ["cpu"]

[models.net]
files = [{files}]
encoding = "{encoding}"
backend = "{backend}"
preload = true
warmup = {warmup}
warmup_inputs = {{ {input_name} = [1, 3, 224, 224] }}
"""


class Round(NamedTuple):
    """One round's figures (seconds)."""

    native_first: float
    native_steady: float
    cold_first: float  #: wasinn's first request, preload only
    warm_first: float  #: wasinn's first request after the warm-up runs
    cold_start: float  #: how long the runtime took to start, preload only
    warm_start: float  #: the same with the warm-up runs
    steady: float  #: wasinn's requests after the first (median), warm-up runtime


def timed(call: Any) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def native(backend: str, files: ModelFiles, image: np.ndarray[Any, Any], iters: int
           ) -> tuple[float, float]:
    """A fresh native session: its first run and the median of the next ``iters``."""
    call, _ = SETUPS[backend](BackendRegistry([backend]), files, image, LoadOptions())
    first = timed(call)
    return first, statistics.median(timed(call) for _ in range(iters))


async def first_request(config: Path, image: np.ndarray[Any, Any], input_name: str,
                        iters: int) -> tuple[float, float, float]:
    """A fresh runtime for ``config``: how long it took to start, its first request, and
    the median of the ``iters`` next."""
    start = time.perf_counter()
    async with wasinn.Runtime.from_config(config) as rt:
        started = time.perf_counter() - start
        graph = await rt.load_by_name("net")
        inputs = {input_name: image}
        times = []
        for _ in range(iters + 1):
            begin = time.perf_counter()
            await graph.compute(inputs)
            times.append(time.perf_counter() - begin)
        return started, times[0], statistics.median(times[1:])


async def one_round(backend: str, directory: Path, files: ModelFiles,
                    image: np.ndarray[Any, Any], iters: int, runs: int) -> Round:
    encoding, kinds, input_name = MODELS[backend]
    names = ", ".join(f'"{getattr(files, kind).relative_to(directory)}"' for kind in kinds)
    figures = []
    for warmup in (0, runs):
        config = directory / f"{backend}-{warmup}.toml"
        config.write_text(CONFIG.format(files=names, encoding=encoding, backend=backend,
                                        warmup=warmup, input_name=input_name))
        figures.append(await first_request(config, image, input_name, iters))
    (cold_start, cold_first, _), (warm_start, warm_first, steady) = figures
    native_first, native_steady = await trio.to_thread.run_sync(native, backend, files, image,
                                                                iters)
    return Round(native_first, native_steady, cold_first, warm_first, cold_start, warm_start,
                 steady)


def report(backend: str, rounds: list[Round], runs: int) -> None:
    median = Round(*(statistics.median(values) for values in zip(*rounds, strict=True)))
    steady = median.native_steady
    print(f"{backend}: native first run {median.native_first * 1e3:.2f} ms, then "
          f"{steady * 1e3:.2f} ms ({median.native_first / steady:.2f}x)")
    print(f"  wasinn first request, preload only: {median.cold_first * 1e3:.2f} ms "
          f"({median.cold_first / steady:.2f}x the native steady run); with warmup = {runs}: "
          f"{median.warm_first * 1e3:.2f} ms ({median.warm_first / steady:.2f}x); then "
          f"{median.steady * 1e3:.2f} ms ({median.steady / steady:.2f}x); runtime start "
          f"{median.cold_start:.2f} s / {median.warm_start:.2f} s")


async def main(args: argparse.Namespace) -> None:
    image = sample_image(0)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        files = export_mobilenet(directory / "gen", width=args.width, seed=0)
        print(f"MobileNetV2-like width {args.width}, batch 1, {args.rounds} round(s), "
              "medians over rounds")
        for backend in args.backends.split(","):
            rounds = [await one_round(backend, directory, files, image, args.iters,
                                      args.warmup) for _ in range(args.rounds)]
            report(backend, rounds, args.warmup)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--width", type=float, default=1.0)
    parser.add_argument("--warmup", type=int, default=2, help="warm-up runs (TorchScript "
                        "optimises the graph over its first two calls)")
    parser.add_argument("--backends", default="onnxruntime,openvino,pytorch")
    trio.run(main, parser.parse_args())
