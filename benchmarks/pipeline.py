"""A two-step pipeline through the scheduler against the sum of its steps run natively.

    python benchmarks/pipeline.py [--iters N] [--width W]

The pipeline is ``scale`` (``y = x * 0.5`` on the image) then the MobileNetV2-like network
(width W), both ONNX on ONNX Runtime, declared in a config written to a temporary
directory. It runs as one job on the CPU actor with the intermediate kept as an OrtValue.
Native: the two ``InferenceSession.run`` calls of the same compiled sessions, timed
separately; their medians are summed. The pipeline runs through the worker thread
(``await ctx.compute``) and in the caller's own thread (``compute_in_caller_thread``, the
path a guest's compute takes). Native and pipelined runs alternate in blocks of 10
so that noise from other processes hits both alike. Also printed: host copies made between
the steps (expected 0): what ``wasinn.host_copies`` counted over the pipelined runs, which
includes each output ONNX Runtime hands back as a host array, less those final outputs,
and the same two steps run natively on sessions made with ONNX
Runtime's stock options, whose intra-op threads go on spinning after each run and slow
the next model's run (wasinn's sessions stop them: ``session.force_spinning_stop``).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import trio

import wasinn
from wasinn.modelgen import export_mobilenet, sample_image


def scale_onnx(factor: float = 0.5) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    k = numpy_helper.from_array(np.array(factor, np.float32), "k")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 224, 224])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3, 224, 224])
    graph = helper.make_graph([helper.make_node("Mul", ["x", "k"], ["y"])], "scale", [x], [y],
                              initializer=[k])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


CONFIG = """
[pools.cpu]
kind = "cpu"
devices = ["cpu"]
workers = 1

[models.scale]
files = ["scale.onnx"]
backend = "onnxruntime"

[models.net]
files = ["net.onnx"]
backend = "onnxruntime"

[pipelines.classify]
steps = [{ model = "scale" }, { model = "net", wire = { y = "input" } }]
"""


def sessions(rt: wasinn.Runtime) -> list[Any]:
    (actor,) = rt.actors
    found = []
    for key in actor.session_keys():
        session = actor.cached_session(key)
        assert session is not None
        found.append(session.compiled.session)  # type: ignore[attr-defined]
    return found


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        files = export_mobilenet(directory / "gen", width=args.width, seed=0)
        (directory / "net.onnx").write_bytes(files.onnx.read_bytes())
        (directory / "scale.onnx").write_bytes(scale_onnx())
        (directory / "wasinn.toml").write_text(CONFIG)
        async with wasinn.Runtime.from_config(directory / "wasinn.toml") as rt:
            pipeline = await rt.load_by_name("classify")
            scale, net = sessions(rt)
            image = sample_image(0)
            ctx = pipeline.init_execution_context()
            for _ in range(10):
                await ctx.compute({"x": image})
            first, second, piped, in_caller = [], [], [], []

            def caller_thread_block(n: int) -> list[float]:  # a guest's path: no hand-off
                times = []
                for _ in range(n):
                    t0 = time.perf_counter()
                    ctx.compute_in_caller_thread({"x": image})
                    times.append(time.perf_counter() - t0)
                return times

            copies = wasinn.host_copies()
            block = 10
            for _ in range(max(1, args.iters // block)):
                for _ in range(block):
                    t0 = time.perf_counter()
                    (scaled,) = scale.run(["y"], {"x": image})
                    t1 = time.perf_counter()
                    net.run(["output"], {"input": scaled})
                    first.append(t1 - t0)
                    second.append(time.perf_counter() - t1)
                for _ in range(block):
                    t0 = time.perf_counter()
                    await ctx.compute({"x": image})
                    piped.append(time.perf_counter() - t0)
                in_caller += await trio.to_thread.run_sync(caller_thread_block, block)
            runs = len(piped) + len(in_caller)
            brought = runs * len(pipeline.outputs)  # each run's outputs, to the host
            between = wasinn.host_copies() - copies - brought
        stock = stock_sessions(directory, image, args.iters)
    native = statistics.median(first) + statistics.median(second)
    through = statistics.median(piped)
    caller = statistics.median(in_caller)
    print(f"native: scale {statistics.median(first) * 1e3:.3f} ms + net "
          f"{statistics.median(second) * 1e3:.2f} ms = {native * 1e3:.2f} ms")
    print(f"pipeline through the scheduler: {through * 1e3:.2f} ms, ratio {through / native:.3f}"
          f" ({(through / native - 1) * 100:+.1f} %); host copies between the steps in "
          f"{runs} runs: {between} (besides the {brought} outputs brought to the host)")
    print(f"pipeline in the caller's thread (a guest's path, no thread hand-off): "
          f"{caller * 1e3:.2f} ms, ratio {caller / native:.3f} "
          f"({(caller / native - 1) * 100:+.1f} %)")
    print(f"the same steps natively with ONNX Runtime's stock session options (threads left "
          f"spinning): scale {stock[0] * 1e3:.3f} ms + net {stock[1] * 1e3:.2f} ms; the net "
          f"step {stock[1] / statistics.median(second):.2f}x as long as on wasinn's sessions")


def stock_sessions(directory: Path, image: np.ndarray[Any, Any], iters: int
                   ) -> tuple[float, float]:
    """Medians (seconds) of the two steps run natively on stock-option sessions."""
    so = ort.SessionOptions()
    so.log_severity_level = 3
    scale, net = (ort.InferenceSession(str(directory / name), so,
                                       providers=["CPUExecutionProvider"])
                  for name in ("scale.onnx", "net.onnx"))
    first, second = [], []
    for i in range(iters + 10):
        t0 = time.perf_counter()
        (scaled,) = scale.run(["y"], {"x": image})
        t1 = time.perf_counter()
        net.run(["output"], {"input": scaled})
        if i >= 10:
            first.append(t1 - t0)
            second.append(time.perf_counter() - t1)
    return statistics.median(first), statistics.median(second)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--width", type=float, default=1.0)
    trio.run(main, parser.parse_args())
