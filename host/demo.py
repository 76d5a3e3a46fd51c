"""``wasinn demo``: the main job end to end, on the embedded default config.

Generates the MobileNetV2-like model (:mod:`wasinn.modelgen`, fixed seed) in three formats
(ONNX, OpenVINO IR, TorchScript) and a sample image, builds the C classifier guest
(``examples/classify.c``) to wasm32-wasi, and runs it through the scheduler once per
format with ``autodetect``, so the host picks the backend (ONNX Runtime, OpenVINO,
PyTorch) from the model's bytes. It then runs the same models from the host and prints
the answers side by side; the exit status is non-zero when a guest fails, the backends
disagree on the class, or no backend library is installed (nothing would run). A format
whose library is not installed is skipped.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from wasinn._abandoned import run_abandonable
from wasinn.host.engine import cache_dir

#: The backend library each of the demo's formats runs on: ONNX, OpenVINO IR, TorchScript.
LIBRARIES = ("onnxruntime", "openvino", "torch")


@dataclass(frozen=True)
class _Format:
    label: str
    files: tuple[Path, ...]
    library: str


async def run_demo(width: float = 0.35, workdir: Path | None = None) -> int:
    """Run the demo; returns 0 when every guest ran and every backend gave the same class.

    ``workdir`` (``--workdir``) is where the model and input go, created if need be;
    default: ``demo`` in wasinn's cache. Raises InvalidArgumentError naming it when it
    cannot be created or written, UnsupportedOperationError when no C compiler or no model
    tooling (torch/onnx/openvino) is installed, naming what to install, and when no backend
    library is installed at all (every format would be skipped, nothing would run).
    Cancellation stops it at once, also while the model is exported or the guest built
    (their worker threads are abandoned).
    """
    from wasinn.errors import UnsupportedOperationError
    from wasinn.host.guests import build_example
    from wasinn.scheduler import Runtime

    workdir = (_folder(workdir, "--workdir") if workdir is not None
               else _folder(cache_dir() / "demo", "the demo's folder in wasinn's cache"))
    if not any(importlib.util.find_spec(library) is not None for library in LIBRARIES):
        # Every format would be skipped: a run that classifies nothing is not a success.
        raise UnsupportedOperationError(
            f"the demo runs nothing: no backend is installed (none of "
            f"{', '.join(LIBRARIES)}): pip install 'wasinn[all]'")
    # The export (torch, onnx, OpenVINO: seconds) and the guest's build (a compiler run)
    # go to worker threads, abandoned on cancellation (wasinn._abandoned), so that Ctrl-C
    # stops the demo at once: each writes its files under temporary names and renames
    # them into place, so an abandoned one leaves nothing a later demo would take for
    # finished.
    try:
        from wasinn.modelgen import export_mobilenet, sample_image

        files = await run_abandonable(
            functools.partial(export_mobilenet, workdir, width=width, seed=0))
    except ImportError as exc:
        raise UnsupportedOperationError(
            f"generating the demo model needs wasinn[all] (torch, onnx, openvino): {exc}"
        ) from None
    image = sample_image(seed=0)
    (workdir / "input.bin").write_bytes(image.tobytes())
    wasm = await run_abandonable(build_example, "classify")
    formats = [
        _Format("ONNX", (files.onnx,), "onnxruntime"),
        _Format("OpenVINO IR", (files.ir_xml, files.ir_bin), "openvino"),
        _Format("TorchScript", (files.torchscript,), "torch"),
    ]
    print(f"demo: guest {wasm.name}, MobileNetV2-like width {width:g}, "
          f"input {image.shape} f32, embedded default config", flush=True)
    status = 0
    rows: list[tuple[str, str, int, float, float]] = []
    async with Runtime() as rt:
        for fmt in formats:
            if importlib.util.find_spec(fmt.library) is None:
                print(f"\ndemo: skipping {fmt.label}: {fmt.library} is not installed")
                continue
            model_arg = "+".join(f"/demo/{p.name}" for p in fmt.files)
            # (what a user can copy and run: the guest by its full path, in the cache)
            command = ["wasinn", "run", "--dir", f"{workdir}::/demo", str(wasm.absolute()),
                       model_arg, "/demo/input.bin"]
            print(f"\n$ {shlex.join(command)}", flush=True)
            start = time.perf_counter()
            code = await rt.run_wasm(wasm, argv=[model_arg, "/demo/input.bin"],
                                     dirs={"/demo": str(workdir)})
            sys.stdout.flush()
            guest_ms = (time.perf_counter() - start) * 1e3
            if code != 0:
                print(f"demo: the guest exited with {code} on {fmt.label}")
                status = status or code
                continue
            graph = await rt.load([p.read_bytes() for p in fmt.files])
            out = await graph.compute({0: image})
            scores = next(iter(out.values())).numpy().reshape(-1)
            await graph.unload()
            best = int(np.argmax(scores))
            rows.append((fmt.label, graph.backend, best, float(scores[best]), guest_ms))
    _print_table(rows)
    classes = {row[2] for row in rows}
    if len(classes) > 1:
        print("demo: the backends disagree on the class")
        status = status or 1
    return status


def _folder(path: Path, what: str) -> Path:
    """``path`` as an absolute folder that exists and can be written, created if need be;
    InvalidArgumentError naming ``what`` (the flag that gave it) and what is wrong."""
    from wasinn.errors import InvalidArgumentError

    given, path = path, path.absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        why = "not a folder"
    except OSError as exc:
        why = f"cannot be created ({exc.strerror or exc})"
    else:
        if os.access(path, os.W_OK | os.X_OK):
            return path
        why = "not writable"
    raise InvalidArgumentError(
        f"{what} {given}: {why}: expected a folder wasinn can create or write in")


def _print_table(rows: list[tuple[str, str, int, float, float]]) -> None:
    print("\nformat        backend (host's choice)  top-1  score     guest run (load+infer)")
    for label, backend, best, score, ms in rows:
        print(f"{label:<13} {backend:<24} {best:<6} {score:<9.4f} {ms:8.1f} ms")
