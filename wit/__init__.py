"""The WIT and WITX interface files wasinn serves, shipped as package data.

WIT packages (one folder each):

- ``wasi-nn-2024-10-28``: ``wasi:nn@0.2.0-rc-2024-10-28`` (tensor, graph, inference,
  errors; world ``ml``), the release candidate new guests target;
- ``wasi-nn-2024-08-19`` and ``wasi-nn-2024-06-25``: the earlier release candidates
  (set-input / compute / get-output by name on the context);
- ``wasinn-nn-0.1.0``: ``wasinn:nn@0.1.0``, wasinn's extensions (a context bound to a
  target, compute without a context, tensor data as 64-bit words); it uses the types
  of ``wasi:nn@0.2.0-rc-2024-10-28``.

:func:`assemble` lays out a guest's WIT folder (its world plus these packages under
``deps/``) as ``componentize-py``, ``wit-bindgen`` and ``wasm-tools`` expect it.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from importlib import resources
from pathlib import Path

#: The WIT package folders shipped here.
WIT_PACKAGES = ("wasi-nn-2024-10-28", "wasi-nn-2024-08-19", "wasi-nn-2024-06-25", "wasinn-nn-0.1.0")


def package_dir(name: str) -> Path:
    """The folder of the shipped WIT package ``name`` (one of :data:`WIT_PACKAGES`)."""
    if name not in WIT_PACKAGES:
        raise ValueError(f"unknown WIT package {name!r}: expected one of {', '.join(WIT_PACKAGES)}")
    return Path(str(resources.files(__name__).joinpath(name)))


def assemble(dest: Path, world: Path | str, packages: Iterable[str] = ("wasi-nn-2024-10-28",),
             extra_deps: Iterable[Path] = ()) -> Path:
    """Write a WIT folder at ``dest``: ``world`` (a file or WIT text) plus ``deps/``.

    ``packages`` are shipped package folders, ``extra_deps`` other package folders.
    Returns ``dest``. Existing contents of ``dest`` are replaced.
    """
    if dest.exists():
        shutil.rmtree(dest)
    (dest / "deps").mkdir(parents=True)
    if isinstance(world, Path):
        shutil.copy(world, dest / world.name)
    else:
        (dest / "world.wit").write_text(world)
    for name in packages:
        shutil.copytree(package_dir(name), dest / "deps" / name)
    for path in extra_deps:
        shutil.copytree(path, dest / "deps" / path.name)
    return dest
