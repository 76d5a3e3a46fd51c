"""How long a runtime takes to start when it preloads several models, by compile threads.

    python benchmarks/startup.py [--models M] [--rounds R] [--threads 1,2,4]
                                 [--backends onnxruntime,openvino,pytorch] [--width W]

A pool's ``compile_threads`` sets how many compiles (and warm-ups) its device runs at once
beside its workers. For each backend: M registry entries of the MobileNetV2-like network
(width W), each its own model (its own file, weights seeded apart), all ``preload = true``
on the CPU pool; R rounds, each starting a fresh runtime once per ``compile_threads`` value
(alternated, so the machine's drift spreads over all). Printed: the median start-up time
for each value, and its ratio to M native compiles run one after another in the same
round (wasinn's backend layer called directly, without a runtime) and to the start-up with
one compile thread. Start-up includes probing devices and starting actors and threads,
which the native compiles do not; a first start-up and compile, not counted, import what
they need.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import trio

import wasinn
from wasinn.backends.base import Device, LoadOptions
from wasinn.backends.registry import BackendRegistry
from wasinn.enums import ExecutionTarget, GraphEncoding
from wasinn.modelgen import ModelFiles, export_mobilenet

#: backend -> (encoding, the model files it reads)
MODELS = {
    "onnxruntime": ("onnx", ("onnx",)),
    "openvino": ("openvino", ("ir_xml", "ir_bin")),
    "pytorch": ("pytorch", ("torchscript",)),
}


def config_text(backend: str, directory: Path, models: list[ModelFiles], threads: int) -> str:
    encoding, kinds = MODELS[backend]
    lines = ["[pools.cpu]", 'kind = "cpu"', 'devices = ["cpu"]',
             f"compile_threads = {threads}", ""]
    for i, files in enumerate(models):
        names = ", ".join(f'"{getattr(files, kind).relative_to(directory)}"' for kind in kinds)
        lines += [f"[models.net{i}]", f"files = [{names}]", f'encoding = "{encoding}"',
                  f'backend = "{backend}"', "preload = true", ""]
    return "\n".join(lines)


async def start_up(config: Path) -> float:
    """Seconds until a fresh runtime for ``config`` is started (its preloads compiled)."""
    begin = time.perf_counter()
    async with wasinn.Runtime.from_config(config):
        return time.perf_counter() - begin


def native_compiles(backend: str, models: list[ModelFiles]) -> float:
    """Seconds to compile every model, one after another, through the backend layer."""
    encoding, kinds = MODELS[backend]
    registry = BackendRegistry([backend])
    impl = registry.get(backend)
    device = Device(ExecutionTarget.CPU)
    begin = time.perf_counter()
    for files in models:
        builders = [getattr(files, kind).read_bytes() for kind in kinds]
        impl.load(builders, GraphEncoding(encoding), device, LoadOptions()).close()
    return time.perf_counter() - begin


async def main(args: argparse.Namespace) -> None:
    thread_counts = [int(t) for t in args.threads.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        models = [export_mobilenet(directory / f"net{i}", width=args.width, seed=i)
                  for i in range(args.models)]
        print(f"{args.models} MobileNetV2-like models (width {args.width}) preloaded on the "
              f"CPU, {args.rounds} round(s), medians over rounds")
        for backend in args.backends.split(","):
            configs = {}
            for threads in thread_counts:
                configs[threads] = directory / f"{backend}-{threads}.toml"
                configs[threads].write_text(config_text(backend, directory, models, threads))
            starts: dict[int, list[float]] = {threads: [] for threads in thread_counts}
            # Once, not counted: the first start imports what a runtime needs.
            await trio.to_thread.run_sync(native_compiles, backend, models[:1])
            await start_up(configs[thread_counts[0]])
            natives = []
            for _ in range(args.rounds):
                natives.append(await trio.to_thread.run_sync(native_compiles, backend, models))
                for threads in thread_counts:
                    starts[threads].append(await start_up(configs[threads]))
            native = statistics.median(natives)
            one = statistics.median(starts[thread_counts[0]])
            print(f"{backend}: {args.models} native compiles one after another "
                  f"{native:.2f} s")
            for threads in thread_counts:
                took = statistics.median(starts[threads])
                print(f"  compile_threads = {threads}: start-up {took:.2f} s "
                      f"({took / native:.2f}x the native compiles, {took / one:.2f}x "
                      f"compile_threads = {thread_counts[0]})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", default="1,2,4")
    parser.add_argument("--width", type=float, default=1.0)
    parser.add_argument("--backends", default="onnxruntime,openvino,pytorch")
    trio.run(main, parser.parse_args())
