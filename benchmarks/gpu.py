"""wasinn on a GPU against each library's own calls, measured in the same run.

    python benchmarks/gpu.py [--device gpu:0] [--backends pytorch,onnxruntime]
                             [--iters N] [--width W] [--batch B]

For the MobileNetV2-like network (``wasinn.modelgen``, width W) at batch 1 and batch B,
for each backend that offers the device (skipped, with the reason, where one does not:
ONNX Runtime without its CUDA provider, a CPU build of torch):

1. One inference, host input to host output, on the compiled graph that the runtime's
   device actor holds, called four ways: *native*, the library's own call (torch: the
   module under ``inference_mode`` on the input copied to the device, its output copied
   back, as wasinn's run does, and also on an input already on the device, to show what
   the upload costs; ONNX Runtime: ``InferenceSession.run`` on host arrays, its CUDA
   provider copying in and out, the call wasinn makes); wasinn's backend layer
   (``CompiledGraph.run``); the scheduler from trio (``await ctx.compute``: the device's
   worker thread); the scheduler from a thread of the caller's own
   (``ctx.compute_in_caller_thread``: a guest's path). Between the backend layer and
   the scheduler, the backend layer's call again from a thread of our own, and (on a GPU)
   under the actor's device context (its stream, entered and synchronized around each
   job) in trio's thread and in one of our own: what a thread change costs, what the
   device context costs, and so what the scheduler itself adds. Ratios are to the
   native call on a host input (like for like).
2. A two-step pipeline on the device (``scale``, y = x * 0.5, then the network, as
   ``pipeline.py`` runs it on the CPU) through the scheduler, against the same two steps
   run natively with the intermediate kept on the device (a torch tensor; an
   ``OrtValue`` bound on the GPU with IOBinding) and through host memory; also wasinn's
   backend layer chained both ways (``keep_on_device`` True / False on the first step)
   and the two steps as two requests with the intermediate brought to the host: what
   keeping it on the device saves. The host copies between the steps are counted
   (``wasinn.host_copies`` over the timed runs, less the outputs brought to the host):
   0 expected for the pipeline and the chain kept on the device.

GPU work is asynchronous: every timed call, whatever its path, ends with
``torch.cuda.synchronize`` of the device (where torch sees it; an ONNX Runtime run with
host outputs has waited for the GPU already) before the clock is read. Each path is
warmed up first; then rounds of short blocks (up to 10 calls of one path, then the next
path's), the order of the paths rotated each round so that each goes first as often as
the others, and noise from elsewhere hits them all alike. Printed: medians, and ratios of
medians to the basis (wasinn / native) with a 95 % bootstrap interval over whole rounds.
TF32 is off on both sides (wasinn's default ``precision = "f32"``); the outputs of every
path are checked against the native call's before timing. A summary table comes last.

Each section catches its own failure, prints it with the exception's text and goes on
with the next; the exit status is 1 if any failed (or nothing could be measured), 2 if
``--device`` does not exist here (0, measuring nothing, where no ``--device`` is given and
there is no GPU). ``--device cpu`` runs it all on the CPU, to check the
script where there is no GPU.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import io
import operator
import os
import platform
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import trio

import wasinn
from wasinn.actors.devicectx import DeviceContext, torch_sees
from wasinn.backends import BackendRegistry, Device
from wasinn.backends.cuda import device_count as driver_device_count
from wasinn.configs.loader import parse_config
from wasinn.enums import ExecutionTarget
from wasinn.modelgen import export_mobilenet, mobilenet_v2, sample_image, scale_onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scheduler_overhead import Timings, interval  # a sibling script: times by round

#: The backends measured here, with the encoding of the files each reads.
ENCODINGS = {"pytorch": "pytorch", "onnxruntime": "onnx"}
#: Calls in a block of one path (fewer when --iters is small).
BLOCK = 10


def fmt(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us" if abs(seconds) < 1e-3 else f"{seconds * 1e3:.3f} ms"


# -- timing ---------------------------------------------------------------------------------
@dataclass
class Way:
    """One way of doing the same work, timed by :func:`measure`."""

    label: str
    call: Callable[[], Any]
    #: "loop": called in trio's thread; "await": awaited there; "thread": called in a
    #: thread of our own (``compute_in_caller_thread`` refuses trio's).
    how: str = "loop"
    times: Timings = field(default_factory=Timings)
    copies: int = 0  #: what ``wasinn.host_copies()`` counted over its timed calls
    calls: int = 0  #: its timed calls


def timed_block(call: Callable[[], Any], n: int, finish: Callable[[], Any]) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        finish()
        times.append(time.perf_counter() - t0)
    return times


async def run_block(way: Way, n: int, finish: Callable[[], Any]) -> list[float]:
    """``n`` calls of ``way``, each timed up to the end of ``finish()`` (the device's
    synchronization)."""
    if way.how == "thread":
        return await trio.to_thread.run_sync(timed_block, way.call, n, finish)
    if way.how == "loop":
        return timed_block(way.call, n, finish)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        await way.call()
        finish()
        times.append(time.perf_counter() - t0)
    return times


async def measure(ways: list[Way], iters: int, warmup: int, finish: Callable[[], Any]) -> None:
    """Warm each way up (one call of each in turn), then time about ``iters`` calls of
    each: rounds of one block of each way, in an order rotated every round."""
    for _ in range(warmup):
        for way in ways:
            await run_block(way, 1, finish)
    block = max(1, min(BLOCK, iters // 10))
    for round_ in range(max(1, iters // block)):
        shift = round_ % len(ways)
        for way in ways[shift:] + ways[:shift]:
            before = wasinn.host_copies()
            times = await run_block(way, block, finish)
            way.copies += wasinn.host_copies() - before
            way.calls += len(times)
            for seconds in times:
                way.times.add(round_, seconds)


async def output_of(way: Way) -> np.ndarray[Any, Any]:
    """One call's (first) output as a host array."""
    if way.how == "thread":
        result = await trio.to_thread.run_sync(way.call)
    elif way.how == "await":
        result = await way.call()
    else:
        result = way.call()
    if isinstance(result, dict):
        result = next(iter(result.values()))
    if isinstance(result, list | tuple):
        result = result[0]
    if isinstance(result, wasinn.Tensor):
        return result.numpy()
    return np.asarray(result)


# -- the run's setting ----------------------------------------------------------------------
@dataclass
class Row:
    """One line of the summary."""

    section: str
    backend: str
    batch: int
    label: str
    median: float
    ratio: float
    low: float
    high: float
    basis: bool


@dataclass
class Bench:
    """What every section shares: the arguments, the device and how to wait for it, the
    model files, and what has been measured and what failed so far."""

    args: argparse.Namespace
    device: Device
    finish: Callable[[], Any]
    directory: Path
    models: dict[str, Path]
    rows: list[Row] = field(default_factory=list)
    copies: list[str] = field(default_factory=list)
    savings: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    @property
    def target(self) -> str:
        return self.device.kind.value

    @property
    def on_gpu(self) -> bool:
        return self.device.kind is ExecutionTarget.GPU

    def fail(self, title: str, why: str) -> None:
        self.failed.append(f"{title}: {why}")
        print(f"  FAILED: {why}", flush=True)

    async def section(self, title: str, body: Callable[[], Awaitable[None]]) -> None:
        """Run ``body``; a failure is printed, with its traceback, and recorded."""
        print(f"\n== {title}", flush=True)
        try:
            await body()
        except Exception as exc:
            self.fail(title, f"{type(exc).__name__}: {exc}")
            print("  " + traceback.format_exc(limit=-8).replace("\n", "\n  "), flush=True)

    def pools(self, backend: str) -> dict[str, Any]:
        """One worker on the device, for ``backend`` alone (and the CPU pool beside it)."""
        pools: dict[str, Any] = {
            "cpu": {"kind": "cpu", "devices": ["cpu"], "workers": 1, "backends": [backend]}}
        if self.device.kind is not ExecutionTarget.CPU:
            pools["device"] = {"kind": self.target, "devices": [self.device.name],
                               "workers": 1, "backends": [backend]}
        return pools

    def actor(self, rt: wasinn.Runtime) -> Any:
        for actor in rt.actors:
            if actor.device == self.device:
                return actor
        raise RuntimeError(f"the runtime serves {[d.name for d in rt.devices]}, not "
                           f"{self.device}")

    async def check_outputs(self, title: str, ways: list[Way]) -> None:
        """Each way's output against the first's (the basis): the same work, or the
        comparison means nothing. Also each way's first call, before the warm-up."""
        reference = await output_of(ways[0])
        worst = 0.0
        for way in ways[1:]:
            got = await output_of(way)
            if got.shape != reference.shape:
                self.fail(title, f"{way.label}: output of shape {got.shape}, the basis's "
                                 f"{reference.shape}")
                return
            worst = max(worst, float(np.abs(got.astype(np.float64) - reference).max()))
        size = float(np.abs(reference).max())
        print(f"  outputs checked against the basis's: max |difference| {worst:.2e} "
              f"(outputs up to {size:.2f} in magnitude)", flush=True)
        if worst > 1e-3 * max(1.0, size):
            self.fail(title, f"outputs differ from the basis's by up to {worst:.2e}")

    def record(self, section: str, backend: str, batch: int, ways: list[Way]) -> None:
        """Print each way's median and ratio to the first way's, and keep them."""
        base = ways[0].times
        for way in ways:
            ratio = way.times.median / base.median
            low, high = ((ratio, ratio) if way is ways[0]
                         else interval(operator.truediv, way.times, base))
            self.rows.append(Row(section, backend, batch, way.label, way.times.median,
                                 ratio, low, high, way is ways[0]))
            span = "(basis)" if way is ways[0] else f"(95 % {low:.3f} to {high:.3f})"
            print(f"  {way.label:<34} {fmt(way.times.median):>11}  ratio {ratio:.3f} "
                  f"{span}", flush=True)


# -- devices and libraries ------------------------------------------------------------------
def checked_device(text: str) -> Device:
    """``--device``, parsed; exits with status 2 where it is no CPU or GPU here."""
    try:
        device = Device.parse(text)
    except Exception as exc:
        print(f"--device {text!r}: {exc}", file=sys.stderr)
        sys.exit(2)
    if device.kind is ExecutionTarget.CPU:
        return device
    if device.kind is not ExecutionTarget.GPU:
        print(f"--device {text!r}: only cpu and gpu:N are measured here", file=sys.stderr)
        sys.exit(2)
    if not torch_sees(device) and device.index >= driver_device_count():
        seen = "torch is not installed"
        if importlib.util.find_spec("torch") is not None:
            import torch

            seen = f"torch {torch.__version__} sees {torch.cuda.device_count()}"
        count = driver_device_count()
        expected = f"cpu or gpu:0 to gpu:{count - 1}" if count else "cpu (there is no GPU here)"
        print(f"--device {text!r}: there is no {device} here: the CUDA driver reports "
              f"{count} GPU(s), {seen}; expected {expected}", file=sys.stderr)
        sys.exit(2)
    return device


def synchronizer(device: Device) -> tuple[Callable[[], Any], str]:
    """What ends every timed call on ``device``, and its name for the report."""
    if device.kind is ExecutionTarget.CPU:
        return (lambda: None), "nothing (the CPU)"
    if not torch_sees(device):
        return (lambda: None), ("nothing: torch does not see the GPU (an ONNX Runtime run "
                                "with host outputs has waited for it)")
    import torch

    cuda = torch.device("cuda", device.index)
    return functools.partial(torch.cuda.synchronize, cuda), f"torch.cuda.synchronize({cuda})"


def environment(device: Device) -> tuple[list[str], str]:
    """Lines naming the software and the device, and the device's name."""
    lines = [f"python {platform.python_version()} ({platform.platform()}), "
             f"wasinn {wasinn.__version__}"]
    try:
        import torch

        lines.append(f"torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN "
                     f"{torch.backends.cudnn.version()})")
    except ImportError:
        lines.append("torch: not installed")
    try:
        import onnxruntime as ort

        lines.append(f"onnxruntime {ort.__version__}, providers "
                     f"{', '.join(ort.get_available_providers())}")
    except ImportError:
        lines.append("onnxruntime: not installed")
    if device.kind is ExecutionTarget.CPU:
        name = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"
    elif torch_sees(device):
        import torch

        props = torch.cuda.get_device_properties(device.index)
        name = (f"{torch.cuda.get_device_name(device.index)}, "
                f"{props.total_memory / 2**30:.0f} GiB")
    else:
        name = "(torch does not see it: name unknown)"
    lines.append(f"device {device}: {name}; the CUDA driver reports "
                 f"{driver_device_count()} GPU(s)")
    return lines, name


def unavailable(registry: BackendRegistry, backend: str, device: Device) -> str | None:
    """Why ``backend`` cannot run on ``device`` here, or None where it can."""
    if not registry.is_installed(backend):
        return f"{backend} is not installed"
    devices = registry.get(backend).devices()
    if device in devices:
        return None
    offered = ", ".join(d.name for d in devices)
    if backend == "onnxruntime":
        import onnxruntime as ort

        if "CUDAExecutionProvider" not in ort.get_available_providers():
            return (f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (providers: "
                    f"{', '.join(ort.get_available_providers())}; onnxruntime-gpu has it)")
    if backend == "pytorch":
        import torch

        build = "a CPU build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        return (f"torch {torch.__version__} ({build}) sees {torch.cuda.device_count()} "
                f"CUDA device(s): it offers {offered}, not {device}")
    return f"{backend} offers {offered} here, not {device}"


def torch_device(device: Device) -> Any:
    import torch

    return torch.device("cpu" if device.kind is ExecutionTarget.CPU else f"cuda:{device.index}")


def match_tf32(compiled: Any) -> None:
    """torch's process-wide TF32 switches as wasinn's graph sets them before each of its
    runs (off for the default precision, f32), so the native calls compute the same."""
    allow = getattr(compiled, "allow_tf32", None)
    if allow is not None:  # (each kind's own setting: the flags alone may leave convolutions
        # in TF32 where torch's finer levels were set; see wasinn.backends._torch_tf32)
        from wasinn.backends._torch_tf32 import cuda_allow_tf32

        cuda_allow_tf32(allow)


# -- the models -----------------------------------------------------------------------------
def export_models(directory: Path, width: float) -> dict[str, Path]:
    """The MobileNetV2-like network, by backend: TorchScript and ONNX files."""
    if importlib.util.find_spec("openvino") is None:  # export_mobilenet's IR needs it
        print("(OpenVINO is not installed: the network is exported to ONNX and TorchScript "
              "only)")
        return export_without_openvino(directory, width)
    files = export_mobilenet(directory, width=width, seed=0)
    return {"onnxruntime": files.onnx, "pytorch": files.torchscript}


def export_without_openvino(directory: Path, width: float) -> dict[str, Path]:
    """The same network (:func:`wasinn.modelgen.mobilenet_v2`, the same seed) exported
    as :func:`~wasinn.modelgen.export_mobilenet` does, without its OpenVINO IR."""
    import torch

    model = mobilenet_v2(width, 0)
    example = torch.zeros(1, 3, 224, 224)
    paths = {"onnxruntime": directory / "net.onnx", "pytorch": directory / "net.pt"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (example,), str(paths["onnxruntime"]), opset_version=17,
                          input_names=["input"], output_names=["output"],
                          dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}},
                          dynamo=False)
        with torch.no_grad():
            torch.jit.trace(model, example).save(str(paths["pytorch"]))
    return paths


def scale_model(backend: str) -> tuple[str, bytes]:
    """The pipeline's first step, y = x * 0.5 on images: its file name and bytes."""
    if backend == "onnxruntime":
        return "scale.onnx", scale_onnx(0.5)
    import torch

    class Scale(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 0.5

    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.save(torch.jit.trace(Scale(), torch.zeros(1, 3, 224, 224)), buf)
    return "scale.pt", buf.getvalue()


def new_graph(actor: Any, before: set[Any]) -> Any:
    """The graph the actor compiled since its sessions were ``before``."""
    keys = [k for k in actor.session_keys() if k not in before]
    if len(keys) != 1:
        raise RuntimeError(f"expected one graph compiled on {actor.device}, found {len(keys)}")
    return actor.cached_session(keys[0]).compiled


# -- 1. one inference -----------------------------------------------------------------------
def native_ways(backend: str, compiled: Any, x: np.ndarray[Any, Any], device: Device
                ) -> list[Way]:
    """The library's own call on ``compiled``, host input to host output (the basis),
    and for torch on a GPU also on an input already there."""
    if backend == "onnxruntime":
        session = compiled.session
        feed, names = {compiled.inputs[0].name: x}, [s.name for s in compiled.outputs]
        return [Way("native: InferenceSession.run", functools.partial(session.run, names, feed))]
    import torch

    module, where = compiled.module, torch_device(device)
    match_tf32(compiled)

    def host_input() -> Any:
        with torch.inference_mode():
            return module(torch.from_numpy(x).to(where)).cpu().numpy()

    ways = [Way("native: input from the host", host_input)]
    if device.kind is not ExecutionTarget.CPU:
        on_device = torch.from_numpy(x).to(where)

        def device_input() -> Any:
            with torch.inference_mode():
                return module(on_device).cpu().numpy()

        ways.append(Way("native: input already on the device", device_input))
    return ways


def context_ways(actor: Any, compiled: Any, tensors: dict[str, wasinn.Tensor]) -> list[Way]:
    """The backend layer's call as the scheduler's paths make it, less the scheduler: in a
    thread of our own (what a thread change alone costs), and also under the actor's
    device context (its CUDA stream, entered around each job and synchronized at its end,
    and the watch for lost devices), in trio's thread and in one of our own. Where the
    scheduler's rows differ from the backend layer's, these say how much of it is the
    thread, how much the device context and how much the scheduler itself."""
    run = functools.partial(compiled.run, tensors)
    ways = [Way("backend layer, a thread of our own", run, "thread")]
    context = actor.context
    if context is not None and type(context).wrap is not DeviceContext.wrap:
        wrapped = context.wrap(run)
        ways += [Way("backend layer, device context", wrapped),
                 Way("  the same, a thread of our own", wrapped, "thread")]
    return ways


async def latency(bench: Bench, backend: str, batch: int) -> None:
    x = sample_image(0, batch)
    async with wasinn.Runtime(parse_config({"pools": bench.pools(backend)}, None)) as rt:
        actor = bench.actor(rt)
        before = set(actor.session_keys())
        graph = await rt.load([bench.models[backend].read_bytes()], ENCODINGS[backend],
                              target=bench.target, backend=backend)
        compiled = new_graph(actor, before)
        ctx = graph.init_execution_context(bench.target)
        tensors = {compiled.inputs[0].name: wasinn.Tensor.from_numpy(x)}
        ways = [
            *native_ways(backend, compiled, x, bench.device),
            Way("wasinn backend layer", functools.partial(compiled.run, tensors)),
            *context_ways(actor, compiled, tensors),
            Way("scheduler, worker thread",
                functools.partial(ctx.compute, {0: x}, keep_on_device=False), "await"),
            Way("scheduler, caller's thread",
                functools.partial(ctx.compute_in_caller_thread, {0: x}, keep_on_device=False),
                "thread"),
        ]
        title = f"latency: {backend}, batch {batch}"
        await bench.check_outputs(title, ways)
        await measure(ways, bench.args.iters, bench.args.warmup, bench.finish)
        ctx.close()
        await graph.unload()
    bench.record("latency", backend, batch, ways)


# -- 2. a pipeline kept on the device ---------------------------------------------------------
def native_chains(backend: str, scale: Any, net: Any, x: np.ndarray[Any, Any],
                  device: Device) -> list[Way]:
    """The two steps run natively, the intermediate kept on the device (the basis) and
    brought through host memory."""
    if backend == "onnxruntime":
        return ort_chains(scale.session, net.session, x, device)
    import torch

    first, second, where = scale.module, net.module, torch_device(device)
    match_tf32(net)

    def on_device() -> Any:
        with torch.inference_mode():
            return second(first(torch.from_numpy(x).to(where))).cpu().numpy()

    def through_host() -> Any:
        with torch.inference_mode():
            mid = first(torch.from_numpy(x).to(where)).cpu()
            return second(mid.to(where)).cpu().numpy()

    return [Way("native chain, on the device", on_device),
            Way("native chain, through the host", through_host)]


def ort_chains(scale: Any, net: Any, x: np.ndarray[Any, Any], device: Device) -> list[Way]:
    """:func:`native_chains` for ONNX Runtime: the intermediate bound on the device
    (IOBinding), as wasinn binds it, or handed back as a numpy array."""
    where = ("cuda", device.index) if device.kind is ExecutionTarget.GPU else ("cpu", 0)
    scale_in, scale_out = scale.get_inputs()[0].name, scale.get_outputs()[0].name
    net_in, net_out = net.get_inputs()[0].name, net.get_outputs()[0].name

    def on_device() -> Any:
        first = scale.io_binding()
        first.bind_cpu_input(scale_in, x)
        first.bind_output(scale_out, *where)
        scale.run_with_iobinding(first)
        second = net.io_binding()
        second.bind_ortvalue_input(net_in, first.get_outputs()[0])
        second.bind_output(net_out, "cpu")
        net.run_with_iobinding(second)
        return second.get_outputs()[0].numpy()

    def through_host() -> Any:
        (mid,) = scale.run([scale_out], {scale_in: x})
        return net.run([net_out], {net_in: mid})[0]

    return [Way("native chain, on the device", on_device),
            Way("native chain, through the host", through_host)]


def pipeline_config(bench: Bench, backend: str) -> Any:
    """``scale`` then ``net`` as pipeline ``p`` on the device, in a config written beside
    their files."""
    directory = bench.directory / f"pipeline-{backend}"
    directory.mkdir(exist_ok=True)
    scale_name, scale_bytes = scale_model(backend)
    net_name = f"net{bench.models[backend].suffix}"
    (directory / scale_name).write_bytes(scale_bytes)
    (directory / net_name).write_bytes(bench.models[backend].read_bytes())
    model = {"backend": backend, "encoding": ENCODINGS[backend], "target": bench.target}
    return parse_config({
        "pools": bench.pools(backend),
        "models": {"scale": {"files": [scale_name], **model},
                   "net": {"files": [net_name], **model}},
        "pipelines": {"p": {"target": bench.target,
                            "steps": [{"model": "scale"}, {"model": "net"}]}},
    }, directory / "wasinn.toml")


def layer_chain(scale: Any, net: Any, x: np.ndarray[Any, Any], keep: bool) -> Callable[[], Any]:
    """The two steps through wasinn's backend layer, the first's output kept on the
    device or brought to the host."""
    tensors = {scale.inputs[0].name: wasinn.Tensor.from_numpy(x)}
    mid_name, net_in = scale.outputs[0].name, net.inputs[0].name

    def chain() -> Any:
        mid = scale.run(tensors, keep_on_device=keep)[mid_name]
        return net.run({net_in: mid})

    return chain


async def chaining(bench: Bench, backend: str, batch: int) -> None:
    x = sample_image(0, batch)
    async with wasinn.Runtime(pipeline_config(bench, backend)) as rt:
        actor = bench.actor(rt)
        compiled, contexts = [], []
        for name in ("scale", "net"):
            before = set(actor.session_keys())
            ctx = (await rt.load_by_name(name)).init_execution_context(bench.target)
            await ctx.compute({0: x}, keep_on_device=False)  # compiled there by now
            compiled.append(new_graph(actor, before))
            contexts.append(ctx)
        scale, net = compiled
        pipeline = await rt.load_by_name("p")
        ctx = pipeline.init_execution_context(bench.target)

        async def two_requests() -> Any:
            (mid,) = (await contexts[0].compute({0: x}, keep_on_device=False)).values()
            return await contexts[1].compute({0: mid}, keep_on_device=False)

        ways = [
            *native_chains(backend, scale, net, x, bench.device),
            Way("wasinn pipeline, worker thread",
                functools.partial(ctx.compute, {0: x}, keep_on_device=False), "await"),
            Way("wasinn pipeline, caller's thread",
                functools.partial(ctx.compute_in_caller_thread, {0: x}, keep_on_device=False),
                "thread"),
            Way("backend layer chain, on the device", layer_chain(scale, net, x, True)),
            Way("backend layer chain, through host", layer_chain(scale, net, x, False)),
            Way("two requests, through the host", two_requests, "await"),
        ]
        title = f"pipeline: {backend}, batch {batch}"
        await bench.check_outputs(title, ways)
        await measure(ways, bench.args.iters, bench.args.warmup, bench.finish)
        outputs = len(pipeline.outputs)
        for context in (ctx, *contexts):
            context.close()
    bench.record("pipeline", backend, batch, ways)
    # Host copies a run makes between the steps: none where the intermediate stays put.
    between = [(ways[2], 0), (ways[3], 0), (ways[4], 0), (ways[5], 1), (ways[6], 1)]
    report_copies(bench, title, between, outputs, backend, batch)
    # What keeping the intermediate on the device saves, natively and in wasinn (the
    # pipeline against two requests: that also saves a request's round trip).
    saved = "; ".join(
        f"{what} {fmt(ways[slow].times.median - ways[fast].times.median)}"
        for what, slow, fast in (("native", 1, 0), ("backend layer", 5, 4),
                                 ("pipeline against two requests", 6, 2)))
    where = "" if bench.on_gpu else " (on the CPU the intermediate is host memory either way)"
    print(f"  time saved by keeping the intermediate on the device{where}: {saved}",
          flush=True)
    bench.savings.append(f"{backend} batch {batch}: {saved}")


def report_copies(bench: Bench, title: str, ways: list[tuple[Way, int]], outputs: int,
                  backend: str, batch: int) -> None:
    """Host copies between the steps of each wasinn way (the outputs brought to the host
    apart), each against the copies it should make a run."""
    parts = []
    for way, per_run in ways:
        between = way.copies - way.calls * outputs
        expected = per_run * way.calls
        parts.append(f"{way.label} {between} in {way.calls} runs")
        if between != expected:
            bench.fail(title, f"{way.label}: {between} host copies between the steps in "
                              f"{way.calls} runs, expected {expected}")
    line = "; ".join(parts)
    print(f"  host copies between the steps (besides the {outputs} output a run brought to "
          f"the host): {line}", flush=True)
    bench.copies.append(f"{backend} batch {batch}: {line}")


# -- the run --------------------------------------------------------------------------------
def summary(bench: Bench, header: list[str], sync: str) -> None:
    args = bench.args
    print(f"\n==== Summary: {bench.device} ({header[-1]})")
    for line in header[:-1]:
        print(f"  {line}")
    print(f"MobileNetV2-like width {args.width:g}; about {args.iters} timed calls a path after "
          f"{args.warmup} warm-up calls; every call ended by {sync}; ratio: median / the "
          f"basis's median (wasinn / native), 95 % bootstrap interval over rounds")
    for section, heading in (("latency", "one inference, host input to host output"),
                             ("pipeline", "scale -> MobileNetV2-like, two steps")):
        rows = [r for r in bench.rows if r.section == section]
        if not rows:
            continue
        print(f"\n{heading}")
        print(f"{'backend':<12} {'batch':>5}  {'path':<36} {'median':>11} {'ratio':>7}  "
              "95 % interval")
        for r in rows:
            span = "basis" if r.basis else f"{r.low:.3f}-{r.high:.3f}"
            print(f"{r.backend:<12} {r.batch:>5}  {r.label:<36} {fmt(r.median):>11} "
                  f"{r.ratio:>7.3f}  {span}")
    for title, lines in (("host copies between the pipeline's steps", bench.copies),
                         ("time saved by keeping the intermediate on the device",
                          bench.savings)):
        if lines:
            print(f"\n{title}:")
            for line in lines:
                print(f"  {line}")
    for line in bench.skipped:
        print(f"skipped: {line}")
    if bench.failed:
        print(f"\nFAILED ({len(bench.failed)}):")
        for line in bench.failed:
            print(f"  {line}")
    elif bench.rows:
        print("\nevery section ran")


async def run(args: argparse.Namespace, device: Device) -> int:
    header, name = environment(device)
    finish, sync = synchronizer(device)
    for line in header:
        print(line)
    print(f"every timed call ends with {sync}", flush=True)
    registry = BackendRegistry()
    with tempfile.TemporaryDirectory(prefix="wasinn-gpu-bench-") as tmp:
        try:
            models = export_models(Path(tmp), args.width)
        except Exception as exc:
            print(f"FAILED: exporting the MobileNetV2-like network: {type(exc).__name__}: "
                  f"{exc}")
            return 1
        bench = Bench(args, device, finish, Path(tmp), models)
        for backend in args.backends:
            try:
                reason = unavailable(registry, backend, device)
            except Exception as exc:
                bench.fail(f"{backend} on {device}", f"{type(exc).__name__}: {exc}")
                continue
            if reason is not None:
                print(f"\n{backend}: skipped: {reason}", flush=True)
                bench.skipped.append(f"{backend}: {reason}")
                continue
            for body, what in ((latency, "latency"), (chaining, "pipeline")):
                for batch in sorted({1, args.batch}):
                    await bench.section(f"{what}: {backend}, batch {batch} on {device}",
                                        functools.partial(body, bench, backend, batch))
    summary(bench, [*header, name], sync)
    if not bench.rows:
        print("nothing was measured")
        return 1
    return 1 if bench.failed else 0


def positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a number > 0")
        return value

    return parse


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None,
                        help="cpu or gpu:N (default gpu:0; where there is no GPU and no "
                             "--device is given, nothing is measured and the exit status "
                             "is 0, so that `make bench` runs everywhere)")
    parser.add_argument("--backends", default=",".join(ENCODINGS),
                        help="comma-separated, of " + ", ".join(ENCODINGS))
    parser.add_argument("--iters", type=positive(int), default=200,
                        help="timed calls of each path (default 200)")
    parser.add_argument("--warmup", type=positive(int), default=20,
                        help="untimed calls of each path first (default 20)")
    parser.add_argument("--width", type=positive(float), default=1.0,
                        help="MobileNetV2 width multiplier (default 1.0)")
    parser.add_argument("--batch", type=positive(int), default=8,
                        help="the batch measured besides 1 (default 8)")
    args = parser.parse_args()
    names = list(dict.fromkeys(n.strip() for n in args.backends.split(",") if n.strip()))
    unknown = [n for n in names if n not in ENCODINGS]
    if unknown or not names:
        parser.error(f"--backends {args.backends!r}: expected some of "
                     f"{', '.join(ENCODINGS)}, comma-separated")
    args.backends = names
    return args


def main() -> int:
    args = arguments()
    if args.device is None:
        gpu = Device.parse("gpu:0")
        if not torch_sees(gpu) and driver_device_count() == 0:
            print("no GPU here (the CUDA driver reports none): nothing measured; "
                  "--device cpu runs the same paths on the CPU")
            return 0
        args.device = "gpu:0"
    device = checked_device(args.device)
    warnings.filterwarnings("ignore", category=DeprecationWarning)  # torch.jit's deprecation
    return trio.run(run, args, device)


if __name__ == "__main__":
    sys.exit(main())
