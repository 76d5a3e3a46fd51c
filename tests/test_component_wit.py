"""The shipped WIT packages: they parse, and the host serves every function they declare.

The function inventory comes from ``wasm-tools component wit --json`` (skipped without
wasm-tools; failed where WASINN_REQUIRE=wasm); what the host serves is recorded from
the Binder, so a function added to a WIT file but not to the host fails here.
"""

from __future__ import annotations

import json
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from tests.component_guests import require_tool
from wasinn import wit
from wasinn.host.component import EXT_PACKAGE, NN_VERSIONS
from wasinn.host.component.linking import Binder
from wasinn.host.component.service import WIT_TENSOR_TYPES, NNService
from wasinn.host.guest_thread import GuestPortal


class _RecordingInstance:
    def __init__(self, name: str, served: dict[str, set[str]]) -> None:
        self.name, self.served = name, served

    def __enter__(self) -> _RecordingInstance:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def add_instance(self, name: str) -> _RecordingInstance:
        return _RecordingInstance(name, self.served)

    def add_func(self, name: str, fn: Any) -> None:
        self.served[self.name].add(name)

    def add_resource(self, name: str, ty: Any, dtor: Any) -> None:
        self.served[self.name].add(f"[resource]{name}")


class _RecordingLinker:
    def __init__(self) -> None:
        self.served: dict[str, set[str]] = defaultdict(set)

    def root(self) -> _RecordingInstance:
        return _RecordingInstance("", self.served)


def served() -> dict[str, set[str]]:
    linker = _RecordingLinker()
    Binder(NNService(object(), GuestPortal())).define_all(linker)  # type: ignore[arg-type]
    return dict(linker.served)


def declared(folder: Path, deps: list[Path], tmp_path: Path) -> dict[str, set[str]]:
    exe = require_tool("wasm-tools")
    root = wit.assemble(tmp_path / folder.name, next(folder.glob("*.wit")).read_text(),
                        packages=(), extra_deps=deps)
    out = subprocess.run([exe, "component", "wit", "--json", str(root)], check=True,
                         capture_output=True, text=True).stdout
    resolve = json.loads(out)
    packages = resolve["packages"]
    functions: dict[str, set[str]] = defaultdict(set)
    for iface in resolve["interfaces"]:
        if iface.get("name") is None or iface.get("package") is None:
            continue
        package = packages[iface["package"]]["name"]
        name, _, version = package.partition("@")
        key = f"{name}/{iface['name']}@{version}"
        functions[key] |= set(iface["functions"])
        for type_id in iface["types"].values():
            ty = resolve["types"][type_id]
            if ty["kind"] == "resource" and ty.get("owner", {}).get("interface") is not None:
                functions[key].add(f"[resource]{ty['name']}")
    return dict(functions)


@pytest.mark.parametrize("folder", [f for f in wit.WIT_PACKAGES if f.startswith("wasi-nn")])
def test_every_wasi_nn_function_is_served(folder: str, tmp_path: Path) -> None:
    wit_functions = declared(wit.package_dir(folder), [], tmp_path)
    host = served()
    version = "0.2.0-rc-" + folder.removeprefix("wasi-nn-")
    assert version in NN_VERSIONS
    assert {k for k in wit_functions if k.startswith("wasi:nn/")} == {
        f"wasi:nn/{i}@{version}" for i in ("tensor", "graph", "inference", "errors")}
    for interface, functions in wit_functions.items():
        assert functions <= host[interface], (interface, functions - host[interface])
        assert host[interface] <= functions, (interface, host[interface] - functions)


def test_every_extension_function_is_served(tmp_path: Path) -> None:
    ext = wit.package_dir("wasinn-nn-0.1.0")
    wit_functions = declared(ext, [wit.package_dir("wasi-nn-2024-10-28")], tmp_path)
    host = served()
    ext_interfaces = {k for k in wit_functions if k.startswith(EXT_PACKAGE.split("@")[0])}
    assert ext_interfaces == {"wasinn:nn/targets@0.1.0", "wasinn:nn/oneshot@0.1.0",
                              "wasinn:nn/bulk@0.1.0", "wasinn:nn/scratch@0.1.0"}
    for interface in ext_interfaces:
        assert wit_functions[interface] == host[interface], interface


def test_tensor_types_follow_the_wit_enum() -> None:
    text = (wit.package_dir("wasi-nn-2024-10-28") / "wasi-nn.wit").read_text()
    body = text[text.index("enum tensor-type"):]
    cases = [c.strip() for c in body[body.index("{") + 1: body.index("}")].split(",")]
    assert [c for c in cases if c] == list(WIT_TENSOR_TYPES)


def test_assemble_lays_out_deps(tmp_path: Path) -> None:
    world = "package a:b;\nworld w { import wasi:nn/graph@0.2.0-rc-2024-10-28; }\n"
    root = wit.assemble(tmp_path / "w", world, packages=("wasi-nn-2024-10-28", "wasinn-nn-0.1.0"))
    assert (root / "world.wit").exists()
    assert sorted(p.name for p in (root / "deps").iterdir()) == ["wasi-nn-2024-10-28",
                                                                 "wasinn-nn-0.1.0"]
    with pytest.raises(ValueError, match="unknown WIT package"):
        wit.package_dir("nope")
