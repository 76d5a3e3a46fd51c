"""``wasinn demo``: the main job end to end, on the embedded default config.

Generates the MobileNetV2-like model (:mod:`wasinn.modelgen`, fixed seed) and a sample
image, builds the C classifier guest (``examples/classify.c``) to wasm32-wasi, runs it
through the scheduler with the model's directory preopened, and checks its answer
against the same model run directly by the runtime.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np

from wasinn.host.engine import cache_dir

log = logging.getLogger("wasinn.demo")


async def run_demo(width: float = 0.35, workdir: Path | None = None) -> int:
    """Run the demo; returns the guest's exit status (non-zero also when answers differ).

    Raises UnsupportedOperationError when no C compiler or no model tooling
    (torch/onnx/openvino) is installed, naming what to install.
    """
    from wasinn.errors import UnsupportedOperationError
    from wasinn.host.guests import build_example
    from wasinn.scheduler import Runtime

    try:
        from wasinn.modelgen import export_mobilenet, sample_image
    except ImportError as exc:  # pragma: no cover - modelgen imports lazily
        raise UnsupportedOperationError(f"the demo needs wasinn[all]: {exc}") from None
    workdir = workdir or cache_dir() / "demo"
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        files = export_mobilenet(workdir, width=width, seed=0)
    except ImportError as exc:
        raise UnsupportedOperationError(
            f"generating the demo model needs torch, onnx and openvino: {exc}") from None
    image = sample_image(seed=0)
    (workdir / "input.bin").write_bytes(image.tobytes())
    wasm = build_example("classify")
    print(f"demo: model {files.onnx.name}, guest {wasm.name}, input {image.shape} f32",
          flush=True)
    async with Runtime() as rt:
        code = await rt.run_wasm(wasm, argv=[f"/demo/{files.onnx.name}", "/demo/input.bin"],
                                 dirs={"/demo": str(workdir)})
        sys.stdout.flush()
        graph = await rt.load([files.onnx.read_bytes()], encoding="onnx")
        out = await graph.compute({"input": image})
        scores = next(iter(out.values())).numpy().reshape(-1)
        await graph.unload()
    best = int(np.argmax(scores))
    print(f"demo: host check, the same model run by the runtime: class {best} "
          f"score {scores[best]:.4f}")
    return code
