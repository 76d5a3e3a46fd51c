"""Shared by the core-guest and CLI tests: built example guests, models and a config.

Guests are built once per test session into a session folder; without a C compiler for
wasm32-wasi the tests that need one are skipped (failed where ``WASINN_REQUIRE=wasm``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tests.support import skip_unless
from wasinn import TensorType
from wasinn.configs.loader import parse_config
from wasinn.configs.schema import RuntimeConfig
from wasinn.host.guests import build_example, compiler
from wasinn.modelgen import ModelFiles, affine_onnx, identity_onnx, sample_image

WAT_DIR = Path(__file__).parent / "wat"


def load_by_name_guest(name: str, path: Path) -> Path:
    """A core-module guest at ``path`` (a ``.wat`` file, written here) whose exit code is
    the errno of its ``load_by_name(name)``."""
    path.write_text(f"""(module
  (import "wasi_ephemeral_nn" "load_by_name" (func $lbn (param i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
  (memory (export "memory") 1)
  (data (i32.const 0) "{name}")
  (func (export "_start")
    (call $exit (call $lbn (i32.const 0) (i32.const {len(name.encode())}) (i32.const 64)))))
""")
    return path


def example_guest(name: str, out_dir: Path) -> Path:
    """The example ``examples/<name>.c`` built to wasm (skipped without a compiler)."""
    skip_unless("wasm", compiler() is not None,
                "no C compiler for wasm32-wasi (install clang-19, lld-19, wasi-libc, "
                "libclang-rt-19-dev-wasm32)")
    return build_example(name, out_dir)


@dataclass(frozen=True)
class GuestModels:
    """Model files on disk, the sample image as the raw f32 file guests read, a config."""

    directory: Path
    image: np.ndarray[Any, Any]
    config: RuntimeConfig


def make_guest_models(directory: Path, mobilenet: ModelFiles) -> GuestModels:
    directory.mkdir(parents=True, exist_ok=True)
    image = sample_image(seed=3)
    (directory / "input.bin").write_bytes(image.tobytes())
    (directory / "model.onnx").write_bytes(mobilenet.onnx.read_bytes())
    small = {
        "identity": identity_onnx(TensorType.F32),
        "identity_static": identity_onnx(TensorType.F32, shape=(1, 4)),
        "identity_u8": identity_onnx(TensorType.U8),
        "identity_i32": identity_onnx(TensorType.I32),
        "affine": affine_onnx(scale=2.0, bias=1.0, size=1000, in_name="x", out_name="y"),
        "sub": sub_onnx(),
    }
    for name, data in small.items():
        (directory / f"{name}.onnx").write_bytes(data)
    models: dict[str, Any] = {
        name: {"files": [str(directory / f"{name}.onnx")], "encoding": "onnx"} for name in small
    }
    models["mobilenet"] = {"files": [str(directory / "model.onnx")], "encoding": "onnx"}
    models["missing"] = {"files": [str(directory / "no-such-file.onnx")], "encoding": "onnx"}
    config = parse_config({"models": models}, None, label="guest test config")
    return GuestModels(directory, image, config)


def sub_onnx() -> bytes:
    """``y = a - b`` over f32 (1, 4): two inputs."""
    from onnx import TensorProto, helper

    a, b, y = (helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 4]) for n in "aby")
    graph = helper.make_graph([helper.make_node("Sub", ["a", "b"], ["y"])], "sub", [a, b], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


def top1(scores: np.ndarray[Any, Any]) -> tuple[int, float]:
    flat = scores.reshape(-1)
    best = int(np.argmax(flat))
    return best, float(flat[best])
