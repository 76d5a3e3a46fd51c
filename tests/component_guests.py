"""Component guests for the tests, built at test time from tests/components/.

- ``shim_1028.wat`` / ``shim_legacy.wat``: hand-written components (component text
  format) that export every wasi-nn function over handle numbers; wasmtime compiles
  them directly, no tool needed.
- ``chain/``, ``read_stdin/``, ``sleep/``: WAT core modules turned into components with
  ``wasm-tools``.
- ``classifier/``: the Python classifier example, built with ``componentize-py``.

Built components are cached under the session's temporary directory and, keyed by the
SHA-256 of their sources and the tool's version, in wasinn's cache directory, so only
the first run pays for componentize-py (about 10 s). A missing tool skips the test
with the reason, or fails it where ``WASINN_REQUIRE=wasm``.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tests.support import skip_unless
from wasinn import TensorType, wit
from wasinn.configs.loader import parse_config
from wasinn.configs.schema import RuntimeConfig
from wasinn.host.engine import cache_dir
from wasinn.modelgen import affine_onnx, identity_onnx

COMPONENTS = Path(__file__).parent / "components"
WIT_DEPS = COMPONENTS / "wit-deps"
LEGACY_VERSIONS = ("0.2.0-rc-2024-08-19", "0.2.0-rc-2024-06-25")


def shim_1028() -> str:
    return (COMPONENTS / "shim_1028.wat").read_text()


def shim_1028_starting(then: str) -> str:
    """The shim with a start function: it loads the model named "affine" by name (the
    graph stays in the instance's table), then runs the instructions ``then``."""
    start = ('    (data (i32.const 512) "affine")\n'
             '    (func $starting\n'
             '      (call $graph.load-by-name (i32.const 512) (i32.const 6) (global.get $ret))\n'
             f'      {then})\n'
             '    (start $starting)\n')
    anchor = '    (func (export "trap") unreachable)\n'
    text = shim_1028()
    assert anchor in text
    return text.replace(anchor, start + anchor)


def shim_legacy(version: str) -> str:
    """The legacy shim for ``version`` (its error constructor only in 2024-06-25)."""
    text = (COMPONENTS / "shim_legacy.wat").read_text().replace("@VERSION@", version)
    if version.endswith("06-25"):
        return text
    return "\n".join(line for line in text.splitlines() if not line.rstrip().endswith(";;@0625"))


def tool(name: str) -> str | None:
    """A console script installed beside this Python, or on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    return shutil.which(name)


def require_tool(name: str) -> str:
    path = tool(name)
    skip_unless("wasm", path is not None,
                f"{name} is not installed (pip install {name}): cannot build this guest")
    assert path is not None
    return path


def _version(exe: str) -> str:
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, check=False)
    return out.stdout.strip()


def _digest(paths: list[Path], *extra: str) -> str:
    h = hashlib.sha256()
    for path in sorted(paths):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    for item in extra:
        h.update(item.encode())
    return h.hexdigest()[:24]


def _sources(folder: Path) -> list[Path]:
    files = [p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    for name in ("wasi-nn-2024-10-28", "wasinn-nn-0.1.0"):
        files += sorted(wit.package_dir(name).glob("*.wit"))
    return files + sorted(WIT_DEPS.rglob("*.wit"))


def _cached(key: str, build_dir: Path, build: Callable[[Path], bytes]) -> bytes:
    store = cache_dir() / "test-guests"
    path = store / f"{key}.wasm"
    if path.exists():
        return path.read_bytes()
    wasm = build(build_dir)
    try:
        store.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(wasm)
        tmp.replace(path)
    except OSError:
        pass
    return wasm


def build_chain(work: Path) -> bytes:
    """The chaining guest: chain/chain.wat + chain/world.wit through wasm-tools."""
    return _wat_component(work, "chain", "chain")


def build_read_stdin(work: Path) -> bytes:
    """A command reading its stdin: read_stdin/read_stdin.wat + world.wit (WASI 0.2)."""
    return _wat_component(work, "read_stdin", "read-stdin",
                          [WIT_DEPS / "wasi-cli-0.2.0", WIT_DEPS / "wasi-io-0.2.0"])


def build_sleep(work: Path) -> bytes:
    """A command sleeping 600 s in WASI 0.2: sleep/sleep.wat + world.wit."""
    return _wat_component(work, "sleep", "sleep",
                          [WIT_DEPS / "wasi-cli-0.2.0", WIT_DEPS / "wasi-io-0.2.0",
                           WIT_DEPS / "wasi-clocks-0.2.0"])


def _wat_component(work: Path, name: str, world: str, extra_deps: list[Path] | None = None
                   ) -> bytes:
    """``components/NAME/NAME.wat``, a core module, made a component of ``world`` (in
    ``NAME/world.wit``) with wasm-tools."""
    exe = require_tool("wasm-tools")
    folder = COMPONENTS / name

    def build(out: Path) -> bytes:
        witdir = wit.assemble(out / "wit", folder / "world.wit", extra_deps=extra_deps or [])
        core, embedded = out / f"{name}.core.wasm", out / f"{name}.embed.wasm"
        component = out / f"{name}.wasm"
        for args in (["parse", str(folder / f"{name}.wat"), "-o", str(core)],
                     ["component", "embed", str(witdir), "--world", world, str(core),
                      "-o", str(embedded)],
                     ["component", "new", str(embedded), "-o", str(component)]):
            subprocess.run([exe, *args], check=True, capture_output=True)
        return component.read_bytes()

    key = f"{name}-" + _digest(_sources(folder), _version(exe))
    return _cached(key, work / name, build)


def build_classifier(work: Path) -> bytes:
    """The Python classifier example through componentize-py."""
    exe = require_tool("componentize-py")
    folder = COMPONENTS / "classifier"

    def build(out: Path) -> bytes:
        witdir = wit.assemble(out / "wit", folder / "world.wit",
                              extra_deps=[WIT_DEPS / "wasi-cli-0.2.0", WIT_DEPS / "wasi-io-0.2.0"])
        app = out / "app"
        shutil.copytree(folder, app, ignore=shutil.ignore_patterns("__pycache__", "*.wit"))
        target = out / "classifier.wasm"
        subprocess.run([exe, "-q", "-d", str(witdir), "-w", "classifier", "componentize", "app",
                        "-o", str(target)], cwd=app, check=True, capture_output=True)
        return target.read_bytes()

    key = "classifier-" + _digest(_sources(folder), _version(exe))
    return _cached(key, work / "classifier", build)


def echo_bytes() -> str:
    """A component importing ``host.take(list<u8>) -> u32`` and ``host.give(u32) -> list<u8>``."""
    return (COMPONENTS / "echo_bytes.wat").read_text()


def runtime_error_onnx() -> bytes:
    """An f32 graph that loads but fails when run: it reshapes 4 values into 3."""
    from onnx import TensorProto, helper, numpy_helper

    shape = numpy_helper.from_array(np.array([3], dtype=np.int64), "shape")
    node = helper.make_node("Reshape", ["x", "shape"], ["y"])
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph([node], "bad_reshape", [x], [y], initializer=[shape])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


def component_models(directory: Path, mobilenet_onnx: Path) -> RuntimeConfig:
    """Model files for the component tests and a config naming them.

    ``affine`` is y = 2x + 1, ``affine3`` y = 3x + 0.5 (both x: f32[n, 4]);
    ``identity_<type>`` copies x to y for each element type; ``mobilenet`` the small
    MobileNet; ``missing`` names a file that does not exist, ``garbage`` one that holds
    no model.
    """
    directory.mkdir(parents=True, exist_ok=True)
    files: dict[str, bytes] = {
        "affine": affine_onnx(2.0, 1.0),
        "affine3": affine_onnx(3.0, 0.5),
        "bad_reshape": runtime_error_onnx(),
    }
    for ttype in (TensorType.F32, TensorType.I32, TensorType.U8, TensorType.I64, TensorType.F64):
        files[f"identity_{ttype.value}"] = identity_onnx(ttype)
    models: dict[str, Any] = {}
    for name, data in files.items():
        (directory / f"{name}.onnx").write_bytes(data)
        models[name] = {"files": [str(directory / f"{name}.onnx")], "encoding": "onnx"}
    models["mobilenet"] = {"files": [str(mobilenet_onnx)], "encoding": "onnx"}
    models["missing"] = {"files": [str(directory / "no-such-model.onnx")], "encoding": "onnx"}
    (directory / "garbage.onnx").write_bytes(b"not an ONNX model")
    models["garbage"] = {"files": [str(directory / "garbage.onnx")], "encoding": "onnx"}
    return parse_config({"models": models}, None, label="component test config")


class RecordingRuntime:
    """Passes everything to a runtime and keeps the graphs it hands out (to see unloads)."""

    def __init__(self, rt: Any) -> None:
        self._rt = rt
        self.graphs: list[Any] = []

    async def load(self, *args: Any, **kwargs: Any) -> Any:
        graph = await self._rt.load(*args, **kwargs)
        self.graphs.append(graph)
        return graph

    async def load_by_name(self, name: str) -> Any:
        graph = await self._rt.load_by_name(name)
        self.graphs.append(graph)
        return graph

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rt, name)


def pooling_classifier_onnx() -> bytes:
    """A tiny "classifier" (input f32[1,3,224,224] -> output f32[1,3], the channel means),
    small enough to pass to ``load`` as bytes (a guest's list<u8> is capped near 2.8 MB)."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("GlobalAveragePool", ["input"], ["pooled"]),
             helper.make_node("Flatten", ["pooled"], ["output"])]
    x = helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, 224, 224])
    y = helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 3])
    graph = helper.make_graph(nodes, "channel_means", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


def infer_loop() -> str:
    """The benchmark guest: inference in a loop on an image kept in guest memory."""
    return (COMPONENTS / "infer_loop.wat").read_text()
