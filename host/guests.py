"""Building the example C guests to wasm32-wasi core modules, cached by content.

Used by the tests, the benchmark and ``wasinn demo``. The compiler is ``$WASINN_CC``,
else the first of ``clang-19`` / ``clang`` found on PATH (Debian: ``clang-19 lld-19
libclang-rt-19-dev-wasm32 wasi-libc``). Built modules are cached under
``<cache>/guests/<sha256 of sources and flags>/<name>.wasm`` so that a second build is free.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from wasinn.errors import UnsupportedOperationError
from wasinn.host.engine import cache_dir

CFLAGS = ("--target=wasm32-wasi", "-O2", "-Wall", "-Wextra")


def examples_dir() -> Path | None:
    """The example C guests: ``examples/`` of a source checkout, or the copy an installed
    wheel ships as ``wasinn/examples`` (None if neither is there)."""
    here = Path(__file__).resolve().parent.parent / "examples"
    return here if (here / "wasi_nn.h").is_file() else None


def compiler() -> str | None:
    """The C compiler used for guests, or None when none is installed."""
    env = os.environ.get("WASINN_CC")
    if env:
        return env if shutil.which(env) else None
    for name in ("clang-19", "clang"):
        path = shutil.which(name)
        if path:
            return path
    return None


def build_example(name: str, out_dir: Path | None = None) -> Path:
    """Build ``examples/<name>.c`` and return the path of the ``.wasm``.

    Raises UnsupportedOperationError when there is no compiler or no examples folder,
    and RuntimeError with the compiler's output when the build fails.
    """
    examples = examples_dir()
    if examples is None:
        raise UnsupportedOperationError(
            "the example guests' C sources are not installed: run from a source checkout"
        )
    return build_c_guest(examples / f"{name}.c", out_dir)


def build_c_guest(source: Path, out_dir: Path | None = None) -> Path:
    """Compile one C file (with the headers beside it) to a wasm32-wasi command module."""
    cc = compiler()
    if cc is None:
        raise UnsupportedOperationError(
            "no C compiler for wasm32-wasi: install clang-19, lld-19, "
            "libclang-rt-19-dev-wasm32 and wasi-libc, or set WASINN_CC"
        )
    digest = hashlib.sha256()
    digest.update(" ".join((cc, *CFLAGS)).encode())
    for dep in [*sorted(source.parent.glob("*.h")), source]:
        digest.update(dep.name.encode() + b"\0" + dep.read_bytes())
    out_dir = out_dir or cache_dir() / "guests"
    # One folder per content hash, so the module keeps its plain name (the guest's argv[0]).
    out = out_dir / digest.hexdigest()[:16] / f"{source.stem}.wasm"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    proc = subprocess.run([cc, *CFLAGS, "-o", str(tmp), str(source)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"building {source.name} failed:\n{proc.stderr.strip()}")
    tmp.replace(out)
    return out
