"""Calls a typed application makes, as it would write them: the Makefile's mypy step
checks this file with mypy --strict (``make lint``), and ``tests/test_typed_usage.py``
runs it. A parameter annotated narrower than what the call accepts at run time fails the
lint; one annotated wider than what runs fails the test.

It imports wasinn only (no test helper), so that its lint checks nothing but these calls.
"""

from __future__ import annotations

import array
import os
from pathlib import Path

import numpy as np
import trio

import wasinn
from wasinn.configs.loader import load_config

#: A module-level constant after a bare ``import wasinn`` (the README's spelling).
OPTIONS = wasinn.backends.LoadOptions(threads=1)

EXIT_7 = """(module
  (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
  (memory (export "memory") 1)
  (func (export "_start") (call $exit (i32.const 7))))
"""
TRAP = '(module (memory (export "memory") 1) (func (export "_start") unreachable))\n'


class AppPath(os.PathLike[str]):
    """A path type of the application's own (a config-management library's)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __fspath__(self) -> str:
        return str(self.path)


def tensors_from_buffers() -> list[wasinn.Tensor]:
    """``Tensor.from_bytes`` over each kind of buffer a caller may hold."""
    data = array.array("f", [1.0, 2.0, 3.0, 4.0])
    raw = data.tobytes()
    return [wasinn.Tensor.from_bytes([4], "f32", buffer)
            for buffer in (data, raw, bytearray(raw), memoryview(raw),
                           np.frombuffer(raw, np.float32))]


def write_files(folder: Path, model: bytes) -> tuple[Path, Path, Path]:
    """``model`` as ``folder/model.onnx``, a config that registers it as ``m``, and a
    guest that exits 7 and one that traps: (model, config, guest) paths."""
    (folder / "model.onnx").write_bytes(model)
    config = folder / "wasinn.toml"
    config.write_text('[models.m]\nfiles = ["model.onnx"]\n', encoding="utf-8")
    (folder / "exit7.wat").write_text(EXIT_7, encoding="utf-8")
    (folder / "trap.wat").write_text(TRAP, encoding="utf-8")
    return folder / "model.onnx", config, folder / "exit7.wat"


async def typed_calls(folder: Path, model: bytes) -> dict[str, object]:
    """Every call here, made on the files of :func:`write_files` (``model``: an ONNX
    model ``y = 2 x + 1`` of input ``x``, f32[N, 4]); what each returned, by call."""
    model_path, config, guest = write_files(folder, model)
    said: dict[str, object] = {}
    said["load_config(os.PathLike)"] = sorted(load_config(AppPath(config)).models)
    runtimes = {
        "Runtime(os.PathLike)": wasinn.Runtime(AppPath(config)),
        "Runtime(trio.Path)": wasinn.Runtime(trio.Path(config)),
        "Runtime.from_config(os.PathLike)": wasinn.Runtime.from_config(AppPath(config)),
        "Runtime.from_config(trio.Path)": wasinn.Runtime.from_config(trio.Path(config)),
    }
    x = np.ones((1, 4), np.float32)
    for call, made in runtimes.items():
        async with made as rt:
            graph = await rt.load_by_name("m")
            said[call] = (await graph.compute({"x": x}))["y"].numpy().tolist()
    async with wasinn.Runtime() as rt:
        options = wasinn.backends.LoadOptions(source=model_path, threads=OPTIONS.threads)
        graph = await rt.load([model_path.read_bytes()], options=options)
        said["LoadOptions(source=Path)"] = options.source
        said["compute({np.int64(0): x})"] = (
            await graph.compute({np.int64(0): x}))["y"].numpy().tolist()
        said["run_wasm(trio.Path)"] = await rt.run_wasm(trio.Path(guest))
        said["run_wasm(os.PathLike)"] = await rt.run_wasm(AppPath(guest))
        try:
            await rt.run_wasm(folder / "trap.wat")
        except wasinn.GuestTrap as trap:
            said["except wasinn.GuestTrap"] = type(trap).__name__
    return said
