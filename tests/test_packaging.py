"""The installed package: one import namespace, lazy backends, typed."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import wasinn


@pytest.mark.parametrize("bare", ["scheduler", "backends", "actors", "host", "core", "configs"])
def test_no_bare_top_level_module(bare: str) -> None:
    # Everything installs under `wasinn`; a bare `scheduler` in site-packages would shadow users'.
    # Asked of a fresh interpreter away from the checkout: under `python -m pytest` the
    # checkout's own folders are on this process's path (found, though nothing installed them).
    found = _fresh_python(f"import importlib.util; print(importlib.util.find_spec({bare!r}))")
    assert found.strip() == "None"


@pytest.mark.parametrize(
    "sub", ["wasinn.backends", "wasinn.actors", "wasinn.scheduler", "wasinn.host", "wasinn.configs"]
)
def test_subpackages_live_under_wasinn(sub: str) -> None:
    spec = importlib.util.find_spec(sub)
    assert spec is not None and spec.origin is not None


def test_version_and_py_typed() -> None:
    assert isinstance(wasinn.__version__, str) and wasinn.__version__.count(".") >= 2
    package_dir = Path(wasinn.__file__).parent
    assert (package_dir / "py.typed").exists()


def _fresh_python(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env,
        cwd=Path(wasinn.__file__).anchor,  # away from the checkout: only the installed package
    )
    return result.stdout.strip()


def test_import_wasinn_imports_no_backend_library() -> None:
    loaded = _fresh_python(
        "import sys, wasinn, wasinn.backends; "
        "print(','.join(m for m in ('onnxruntime', 'openvino', 'torch', 'pydantic') "
        "if m in sys.modules))"
    )
    assert loaded == ""


def test_import_wasinn_leaves_the_runtime_to_first_use() -> None:
    # What keeps `import wasinn` cheap for code that only needs the types (the import time
    # itself is the benchmark's to print): the scheduler, actors and hosts, and trio and
    # wasmtime under them, are imported on first access, not by the package.
    loaded = _fresh_python(
        "import sys, wasinn; "
        "print(','.join(m for m in ('trio', 'wasmtime', 'wasinn.scheduler', 'wasinn.actors', "
        "'wasinn.host', 'wasinn.backends') if m in sys.modules))"
    )
    assert loaded == ""
    # ...and first access does import it: the names are there, only later.
    assert _fresh_python("import sys, wasinn; wasinn.Runtime; print('trio' in sys.modules)"
                         ) == "True"


#: What a build leaves in a checkout: a wheel built from it would ship build/lib's copy of
#: a module deleted since (setuptools reuses build/lib), and nothing would tell.
_BUILD_LEFTOVERS = shutil.ignore_patterns("build", "*.egg-info", "__pycache__")


def _package_source(root: Path, into: Path) -> dict[str, Path]:
    """Copy what the wheel is built from (the root's files and the package folders of
    pyproject's ``package-dir``, as they are now: modules not yet committed included,
    build leftovers not) into ``into``; each folder by its package name."""
    into.mkdir()
    for file in root.iterdir():
        if file.is_file():
            shutil.copy2(file, into / file.name)
    mapping = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {}
    for package, folder in mapping["package-dir"].items():
        shutil.copytree(root / folder, into / folder, ignore=_BUILD_LEFTOVERS,
                        dirs_exist_ok=True)  # (a subpackage's folder may be mapped too)
        folders[package] = into / folder
    return folders


def _modules(folders: dict[str, Path]) -> set[str]:
    """The .py files under the package folders, as the wheel names them."""
    return {"/".join([*package.split("."), *py.relative_to(folder).parts])
            for package, folder in folders.items() for py in folder.rglob("*.py")}


@pytest.mark.slow
def test_wheel_installs_only_the_wasinn_namespace(tmp_path: Path) -> None:
    # Build the real wheel (no network: the build backend is already installed) and read its
    # file list: every module must sit under wasinn/, with the TOML configs and WIT files
    # shipped as package data. Built from a copy of the package's sources, not the
    # checkout, whose build/ may hold modules deleted since (and which a build writes in).
    import zipfile

    root = Path(__file__).resolve().parents[1]
    folders = _package_source(root, tmp_path / "src")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(tmp_path / "src")],
        check=True, capture_output=True,
    )
    (wheel,) = tmp_path.glob("wasinn-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    # Every module of the package folders, and no other (a deleted one left in build/lib).
    assert {n for n in names if n.endswith(".py")} == _modules(folders)
    tops = {n.split("/")[0] for n in names if not n.startswith("wasinn-")}
    assert tops == {"wasinn"}, tops
    assert "wasinn/py.typed" in names
    assert "wasinn/configs/default.toml" in names
    assert any(n.startswith("wasinn/wit/") and n.endswith((".wit", ".witx")) for n in names)
    assert "wasinn/examples/classify.c" in names and "wasinn/examples/wasi_nn.h" in names
    for sub in ("backends", "actors", "scheduler", "host"):
        assert f"wasinn/{sub}/__init__.py" in names
