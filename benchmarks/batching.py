"""Throughput with dynamic batching (``wasinn.Batching``) against the native backend,
measured in the same run.

    python benchmarks/batching.py [--seconds S] [--rounds R] [--max-batch M]
                                  [--callers 1,4,16] [--width W] [--backends LIST]

Two models: the tiny ONNX ``y = 2x + 1`` over f32[n, 4] (ONNX Runtime), where a run costs
little next to the scheduler's hand-off so merging requests saves per-request overhead,
and the MobileNetV2-like (width W, dynamic batch axis) on each backend of ``--backends``,
where the backend's own gain from larger batches is what counts. For each:

1. Native: the library's own call (ONNX Runtime's ``InferenceSession.run``, an OpenVINO
   ``InferRequest.infer``, as ``scheduler_overhead.py``'s ``library_step`` makes it: no
   wasinn code on the way) on the model the runtime compiled, in a plain loop, on one row
   (requests/s) and on a batch of M rows (rows/s): what the backend itself gains from
   batching on this machine.
2. wasinn: the same model loaded once without batching and once with
   ``Batching(max_batch=M)`` (``max_delay`` = 0: only requests that queued while the
   device was busy merge), 1, 4 and 16 concurrent trio callers each awaiting
   ``graph.compute`` in a loop on an input of its own for S seconds. Printed: requests/s,
   the ratio to native batch-1 requests/s, the callers' median latency and, with
   batching, the mean size of the merged runs (``stats.batched / stats.batches`` over
   the round) with the share of requests that ran merged. A rate above 1.1x what the
   library's own calls reached (batch 1 unbatched, the better of batch 1 and batch M
   batched, times the CPU workers that can run at once) reads "baseline disturbed: not a
   verdict": wasinn makes the same calls with more work around them, so only a slowed
   native measurement puts it there.

Every configuration runs once per round and rounds interleave them, each keeping its best
round, so that a burst of load from other processes does not decide a comparison. The
default config has one CPU worker: unbatched requests run one at a time, so concurrent
callers only queue; with batching, the queue becomes merged runs. With one caller
nothing merges, so its batched and unbatched figures do the same work: their gap is the
run's noise. Figures vary with the machine's load (printed first, with a warning when it
exceeds the CPU count): compare ratios, not absolutes. The tiny
model's per-request cost is mostly the cross-thread wake-up, which on an idle VM without
halt polling can exceed what it is under load (see ``scheduler_overhead.py``).

Before timing, each model checks once that batching is correct: M + 1 distinct inputs run
concurrently through the batched graph (so that they merge) give the outputs the
unbatched graph gives for each (``np.allclose``, atol 1e-4); the script exits with an error
if not, or if nothing merged.

The last line per model reads ``batched throughput, <model> on <backend>, N callers: X
req/s vs unbatched Y req/s (Z.ZZx), native batch-1 W req/s`` for the most callers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import trio

import wasinn
from wasinn.modelgen import affine_onnx, export_mobilenet, sample_image

sys.path.insert(0, str(Path(__file__).resolve().parent))
# A sibling script: the library's own call, and what a result no overhead gives reads as.
from scheduler_overhead import LIBRARY_CALLS, library_step, print_load, rate_verdict

#: Tolerance of the correctness check (merged runs against single-row runs).
ATOL = 1e-4


@dataclass(frozen=True)
class Model:
    """A model to measure: its bytes, input name and one distinct input per caller."""

    label: str
    builders: list[bytes]
    backend: str
    input_name: str
    make_input: Callable[[int], np.ndarray]  #: caller index -> a batch-1 input


@dataclass(frozen=True)
class Figures:
    """One timed round of concurrent callers."""

    rate: float  #: requests per second
    p50: float  #: callers' median latency, seconds
    batches: int  #: merged runs during the round
    batched: int  #: requests answered by merged runs
    completed: int  #: requests completed during the round

    def batch_note(self) -> str:
        """Mean merged batch size and the share of requests that ran merged."""
        if not self.batches:
            return ", no merged runs"
        return (f", mean batch {self.batched / self.batches:.2f} "
                f"({self.batched / max(1, self.completed) * 100:.0f} % merged)")


def compiled_of(rt: wasinn.Runtime) -> Any:
    """The compiled graph the runtime's (only) device compiled last."""
    (actor,) = rt.actors
    session = actor.cached_session(actor.session_keys()[-1])
    assert session is not None
    return session.compiled


def native_rate(backend: str, compiled: Any, inputs: dict[str, np.ndarray],
                seconds: float) -> float:
    """Runs per second of the library's own call (:func:`library_step`) on ``compiled``,
    a graph of ``backend``, with ``inputs`` (numpy arrays by name), in a plain loop."""
    run = library_step(backend, compiled, inputs)()
    for _ in range(3):  # warm: a new batch size may allocate on first use
        run()
    runs = 0
    start = time.perf_counter()
    stop = start + seconds
    while (now := time.perf_counter()) < stop or runs == 0:
        run()
        runs += 1
    return runs / (now - start)


def native_ceiling(batched: bool, callers: int, workers: int, native1: float,
                   native_m: float) -> float:
    """The most requests/s the library's own calls reached for a configuration: batch-1
    runs unbatched, the better of batch 1 and batch M batched, on as many CPU workers as
    can run at once (``callers``, at most ``workers``)."""
    best = max(native1, native_m) if batched else native1
    return best * min(callers, workers)


async def callers_round(graph: wasinn.Graph, inputs: list[dict[str, np.ndarray]],
                        callers: int, seconds: float) -> Figures:
    """``callers`` concurrent loops of ``await graph.compute(...)``, each on its own
    input, for ``seconds``; requests/s counts until the last in-flight request ends."""
    latencies: list[float] = []
    before = graph.stats()

    async def caller(i: int) -> None:
        feed = inputs[i % len(inputs)]
        while trio.current_time() < stop or not latencies:
            t0 = time.perf_counter()
            await graph.compute(feed)
            latencies.append(time.perf_counter() - t0)

    start = time.perf_counter()
    stop = trio.current_time() + seconds
    async with trio.open_nursery() as nursery:
        for i in range(callers):
            nursery.start_soon(caller, i)
    elapsed = time.perf_counter() - start
    after = graph.stats()
    return Figures(rate=len(latencies) / elapsed, p50=statistics.median(latencies),
                   batches=after.batches - before.batches,
                   batched=after.batched - before.batched,
                   completed=after.completed - before.completed)


async def check_outputs(plain: wasinn.Graph, batched: wasinn.Graph,
                        inputs: list[dict[str, np.ndarray]], label: str) -> str:
    """SystemExit unless ``batched`` answers every input, run concurrently so that the
    requests merge, as ``plain`` answers it run alone; returns a line for people."""
    expected = [{k: v.numpy() for k, v in (await plain.compute(feed)).items()}
                for feed in inputs]
    got: list[dict[str, np.ndarray]] = [{} for _ in inputs]
    before = batched.stats()

    async def one(i: int) -> None:
        got[i] = {k: v.numpy() for k, v in (await batched.compute(inputs[i])).items()}

    async with trio.open_nursery() as nursery:
        for i in range(len(inputs)):
            nursery.start_soon(one, i)
    after = batched.stats()
    merged = after.batches - before.batches
    if not merged:
        raise SystemExit(f"{label}: {len(inputs)} concurrent requests did not merge: "
                         "the correctness check checked nothing")
    worst = 0.0
    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
        for name, value in want.items():
            if have[name].shape != value.shape or not np.allclose(have[name], value,
                                                                   atol=ATOL):
                raise SystemExit(f"{label}: batched output {name!r} of request {i} "
                                 f"differs from the unbatched one (max abs diff "
                                 f"{np.max(np.abs(have[name] - value)):.3g})")
            worst = max(worst, float(np.max(np.abs(have[name] - value))))
    return (f"  correctness: {len(inputs)} concurrent requests in {merged} merged run(s) "
            f"match the unbatched outputs (max abs diff {worst:.2g}, atol {ATOL:g})")


def report(batched: bool, callers: int, figures: Figures, native: float,
           ceiling: float) -> None:
    """One configuration's line; ``ceiling`` is :func:`native_ceiling`'s for it."""
    kind = "batched  " if batched else "unbatched"
    note = figures.batch_note() if batched else ""
    if disturbed := rate_verdict(figures.rate, ceiling):
        note += f": {disturbed}"
    print(f"  {kind} {callers:2d} caller(s): {figures.rate:9.1f} req/s, "
          f"ratio to native batch-1 {figures.rate / native:.3f}, "
          f"p50 {figures.p50 * 1e3:.2f} ms{note}")


async def measure(rt: wasinn.Runtime, model: Model, args: argparse.Namespace,
                  workers: int) -> None:
    """Every figure for one model on one backend (``workers``: the CPU pool's), then its
    summary line."""
    max_batch: int = args.max_batch
    callers_list: list[int] = args.callers
    inputs = [{model.input_name: model.make_input(i)}
              for i in range(max(max_batch + 1, *callers_list))]
    plain = await rt.load(model.builders, "onnx", backend=model.backend)
    compiled = compiled_of(rt)
    batched = await rt.load(model.builders, "onnx", backend=model.backend,
                            batching=wasinn.Batching(max_batch=max_batch))
    print(f"{model.label} on {model.backend}, Batching(max_batch={max_batch}):")
    # One more than a batch: the first request finds the device idle and runs alone.
    print(await check_outputs(plain, batched, inputs[:max_batch + 1], model.label))

    one = {model.input_name: inputs[0][model.input_name]}
    many = {model.input_name: np.concatenate([inputs[i % len(inputs)][model.input_name]
                                              for i in range(max_batch)])}
    native1 = native_m = 0.0
    best: dict[tuple[bool, int], Figures] = {}
    for _ in range(args.rounds):
        native1 = max(native1, native_rate(model.backend, compiled, one, args.seconds))
        native_m = max(native_m, native_rate(model.backend, compiled, many, args.seconds)
                       * max_batch)
        for callers in callers_list:
            for is_batched, graph in ((False, plain), (True, batched)):
                got = await callers_round(graph, inputs, callers, args.seconds)
                key = (is_batched, callers)
                if key not in best or got.rate > best[key].rate:
                    best[key] = got
    print(f"  native (the library's own {LIBRARY_CALLS[model.backend]}) batch 1: "
          f"{native1:9.1f} req/s; batch {max_batch}: {native_m:9.1f} rows/s "
          f"({native_m / native1:.2f}x)")
    for callers in callers_list:
        for is_batched in (False, True):
            ceiling = native_ceiling(is_batched, callers, workers, native1, native_m)
            report(is_batched, callers, best[(is_batched, callers)], native1, ceiling)
    most = max(callers_list)
    on, off = best[(True, most)].rate, best[(False, most)].rate
    print(f"batched throughput, {model.label} on {model.backend}, {most} callers: "
          f"{on:.1f} req/s vs unbatched {off:.1f} req/s ({on / off:.2f}x), "
          f"native batch-1 {native1:.1f} req/s")
    await plain.unload()
    await batched.unload()


def tiny_input(i: int) -> np.ndarray:
    """A distinct f32[1, 4] row per caller."""
    return np.random.default_rng(i).standard_normal((1, 4)).astype(np.float32)


def models(args: argparse.Namespace) -> list[Model]:
    """The models to measure, ONNX Runtime first: OpenVINO's thread pool outlives its
    graphs and was seen to slow ONNX Runtime figures measured after it."""
    with tempfile.TemporaryDirectory() as tmp:
        mobilenet = [export_mobilenet(Path(tmp), width=args.width, seed=0).onnx.read_bytes()]
    backends = [b for b in args.backends.split(",") if b]
    backends.sort(key=lambda b: b != "onnxruntime")
    found = [Model("tiny model", [affine_onnx()], "onnxruntime", "x", tiny_input)]
    found += [Model(f"MobileNetV2-like w{args.width:g}", mobilenet, backend, "input",
                    lambda i: sample_image(i, batch=1)) for backend in backends]
    return found


async def main(args: argparse.Namespace) -> None:
    print_load()
    async with wasinn.Runtime() as rt:
        workers = rt.config.pools["cpu"].workers
        print(f"devices: {[d.name for d in rt.devices]}, cpu workers: {workers}, "
              f"{args.seconds:g} s per configuration, best of {args.rounds} round(s)")
        for model in models(args):
            await measure(rt, model, args, workers)


def callers_flag(text: str) -> list[int]:
    """``1,4,16`` -> [1, 4, 16]."""
    values = [int(part) for part in text.split(",") if part]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("expected positive integers, e.g. 1,4,16")
    return values


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0,
                        help="seconds per configuration and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--callers", type=callers_flag, default=[1, 4, 16],
                        help="numbers of concurrent callers, comma-separated")
    parser.add_argument("--width", type=float, default=1.0,
                        help="MobileNetV2-like width multiplier")
    parser.add_argument("--backends", default="onnxruntime,openvino",
                        help="backends for the MobileNetV2-like model")
    trio.run(main, parser.parse_args())
