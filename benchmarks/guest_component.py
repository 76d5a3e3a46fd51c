"""Component guests vs the core-module guest vs native ONNX Runtime, in one run.

1. Inference at batch 1 on the MobileNetV2-like network (width 1.0): the hand-written
   component ``tests/components/infer_loop.wat`` keeps the image in its memory and runs
   tensor constructor + compute + data() in a loop (timed from the host around one
   export call of N iterations). Measured three ways: wasi:nn's ``list<u8>`` with the
   fast conversion (``wasinn.host.component.fastlist``), the same with wasmtime-py's
   stock conversion, and wasinn's ``wasinn:nn/bulk`` extension (tensor data as ``list<u64>``).
   A fourth way, ``tests/components/scratch_loop.wat``, does the same work through
   ``wasinn:nn/scratch``: it writes the image to a file in its scratch directory with
   wasi:filesystem, makes the tensor from that file, has the output written to a file
   and reads it back, so no tensor byte passes through component value conversion.
   Against: the core-module guest ``examples/classify_named.c`` (times itself; needs
   clang for wasm32-wasi, else noted) and native ONNX Runtime on the same input.
2. ``list<u8>`` transfer of 602,112 bytes (one 224x224x3 f32 image) guest -> host and
   host -> guest, stock vs fast conversion, in ms and MB/s.

Usage: python benchmarks/guest_component.py [--n 30] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.component_guests import COMPONENTS, echo_bytes, infer_loop
from wasinn.backends.base import LoadOptions
from wasinn.backends.onnxruntime import session_options
from wasinn.configs.loader import parse_config
from wasinn.host.component import ComponentGuest, fastlist
from wasinn.host.engine import cache_dir, shared_engine
from wasinn.modelgen import IMAGE_SHAPE, export_mobilenet, sample_image
from wasinn.scheduler import Runtime

IMAGE_BYTES = 602_112


def native_ms(session: Any, feed: dict[str, np.ndarray[Any, Any]], n: int) -> float:
    session.run(None, feed)
    start = time.perf_counter()
    for _ in range(n):
        session.run(None, feed)
    return (time.perf_counter() - start) * 1e3 / n


async def component_ms(guest: ComponentGuest, n: int, words: bool) -> float:
    await guest.call("infer", 1, words, list(IMAGE_SHAPE))  # warm-up
    start = time.perf_counter()
    read = await guest.call("infer", n, words, list(IMAGE_SHAPE))
    elapsed = (time.perf_counter() - start) * 1e3 / n
    if read < 4000:
        raise SystemExit(f"the component's inference failed (returned {read})")
    return elapsed


async def scratch_ms(guest: ComponentGuest, n: int) -> float:
    await guest.call("infer", 1, list(IMAGE_SHAPE))  # warm-up
    start = time.perf_counter()
    read = await guest.call("infer", n, list(IMAGE_SHAPE))
    elapsed = (time.perf_counter() - start) * 1e3 / n
    if read < 4000:
        failure = await guest.call("last-failure")
        raise SystemExit(f"the scratch component's inference failed (step/code {failure})")
    return elapsed


def core_guest() -> Path | None:
    """The core-module guest ``classify_named``, or None (printing why) without a toolchain."""
    try:
        from wasinn.host.guests import build_example, compiler
    except ImportError as exc:
        print(f"  (core-module path unavailable: {exc})")
        return None
    if compiler() is None:
        print("  (core-module path not measured: no C compiler for wasm32-wasi)")
        return None
    return build_example("classify_named")


async def core_ms(rt: Runtime, wasm: Path, n: int, workdir: Path) -> float:
    """The core-module guest's own per-inference figure (it times itself)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from guest_core import guest_ms

    return await guest_ms(rt, wasm, ["--repeat", str(n), "mobilenet", "/d/input.bin"], workdir)


def transfer_ms(direction: str, fast: bool, rounds: int) -> float:
    """Best time of one list<u8> transfer of IMAGE_BYTES in ``direction`` ("in"/"out")."""
    from wasmtime import Store
    from wasmtime.component import Component, Linker

    if fast:
        fastlist.install()
    else:
        fastlist.uninstall()
    try:
        engine = shared_engine()
        payload = np.random.default_rng(0).integers(0, 256, IMAGE_BYTES, np.uint8).tobytes()
        linker = Linker(engine)
        with linker.root() as root, root.add_instance("host") as host:
            host.add_func("take", lambda store, data: len(data))
            host.add_func("give", lambda store, n: payload[:n])
        store = Store(engine)
        store.set_epoch_deadline(2**62)
        instance = linker.instantiate(store, Component(engine, echo_bytes()))

        def call(name: str, *args: Any) -> Any:
            func = instance.get_func(store, name)
            assert func is not None
            result = func(store, *args)
            func.post_return(store)
            return result

        call("fill", payload)
        name = "run-in" if direction == "in" else "run-out"
        return best_of(rounds, lambda: timed(lambda: call(name, IMAGE_BYTES)))
    finally:
        fastlist.install()


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def best_of(rounds: int, measure: Callable[[], float]) -> float:
    return min(measure() for _ in range(rounds))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=30, help="inferences per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="measurements (best is kept)")
    args = parser.parse_args()

    files = export_mobilenet(cache_dir() / "bench-models", width=1.0, seed=0)
    workdir = Path(cache_dir() / "bench-component")
    workdir.mkdir(parents=True, exist_ok=True)
    image = sample_image(seed=0)
    (workdir / "input.bin").write_bytes(image.tobytes())
    config = parse_config({"models": {
        "mobilenet": {"files": [str(files.onnx)], "encoding": "onnx", "resident": True},
    }}, None)
    native = ort.InferenceSession(str(files.onnx), session_options(LoadOptions()),
                                  providers=["CPUExecutionProvider"])
    print(f"MobileNetV2-like w1.0 {IMAGE_SHAPE}, batch 1, n={args.n}, best of {args.rounds}; "
          f"ONNX Runtime {ort.__version__}")
    classify = core_guest()
    async with Runtime(config) as rt:
        guest = await ComponentGuest.start(rt, infer_loop(), program="infer_loop")
        scratch = await ComponentGuest.start(
            rt, (COMPONENTS / "scratch_loop.wat").read_text(), program="scratch_loop")
        async with guest, scratch:
            for g in (guest, scratch):
                assert await g.call("fill", image.tobytes()) == IMAGE_BYTES
                assert await g.call("prepare", "mobilenet") == 0
            rows: dict[str, float] = {}
            for _ in range(args.rounds):  # interleaved, so drift hits every path alike
                rows["native ORT"] = min(rows.get("native ORT", 1e9),
                                         native_ms(native, {"input": image}, args.n))
                for label, words in (("component list<u8> (fast)", False),
                                     ("component wasinn:nn/bulk words", True)):
                    ms = await component_ms(guest, args.n, words)
                    rows[label] = min(rows.get(label, 1e9), ms)
                label = "component wasinn:nn/scratch files"
                rows[label] = min(rows.get(label, 1e9), await scratch_ms(scratch, args.n))
                if classify is not None:
                    ms = await core_ms(rt, classify, args.n, workdir)
                    rows["core module (classify_named)"] = min(
                        rows.get("core module (classify_named)", 1e9), ms)
            fastlist.uninstall()
            try:
                rows["component list<u8> (stock)"] = await component_ms(
                    guest, max(2, args.n // 10), False)
            finally:
                fastlist.install()
            await guest.call("release")
            await scratch.call("release")
    core = rows.get("core module (classify_named)")
    nat = rows["native ORT"]
    print(f"{'path':34s} {'ms/inference':>13s} {'x native':>9s} {'x core':>8s}")
    for label, ms in rows.items():
        vs_core = f"{ms / core:8.2f}" if core else "     n/a"
        print(f"  {label:32s} {ms:13.2f} {ms / nat:9.2f} {vs_core}")

    print(f"list<u8> transfer of {IMAGE_BYTES} bytes (best of {args.rounds}):")
    for direction, label in (("in", "guest -> host"), ("out", "host -> guest")):
        stock = transfer_ms(direction, False, args.rounds)
        fast = transfer_ms(direction, True, args.rounds)
        print(f"  {label}: stock {stock:7.1f} ms ({IMAGE_BYTES / stock / 1e3:6.1f} MB/s)   "
              f"fast {fast:6.1f} ms ({IMAGE_BYTES / fast / 1e3:6.1f} MB/s)   "
              f"speed-up {stock / fast:5.1f}x")


if __name__ == "__main__":
    trio.run(main)
