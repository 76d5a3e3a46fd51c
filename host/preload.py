"""Graphs preloaded by name from the command line, for ``load_by_name``.

``wasinn run --nn-preload NAME:ENCODING:TARGET:PATH[:PATH...]`` (WasmEdge) and
``--wasi nn-graph=ENCODING::DIR`` (Wasmtime) name model files on the host. A guest only
ever chooses among registered names: its string is looked up, never turned into a path.

Preloads become entries of the config's ``[models]`` table (:func:`with_preloads`), so
the runtime's registry loads each on first ``load_by_name`` (as WasmEdge does) and shares
it between guests; a missing file is reported to the guest that asks as
``model_not_found`` (errno 103) rather than failing the command at start.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from wasinn.configs import name_problem
from wasinn.enums import ExecutionTarget, GraphEncoding
from wasinn.errors import InvalidArgumentError

if TYPE_CHECKING:
    from wasinn.configs.schema import RuntimeConfig


@dataclass(frozen=True)
class Preload:
    """One named model: its encoding, the target it loads on, its files in builder order."""

    name: str
    encoding: GraphEncoding
    target: ExecutionTarget | None  # None = "auto": the model's default (cpu)
    paths: tuple[Path, ...]
    #: How the command line gave it (``--nn-preload 'SPEC'``), named in its errors.
    flag: str = field(default="", compare=False)


def parse_nn_preload(spec: str) -> Preload:
    """``NAME:ENCODING:TARGET:PATH[:PATH...]`` (WasmEdge's syntax; case-insensitive enums)."""
    parts = spec.split(":")
    if len(parts) < 4 or not parts[0] or not all(parts[3:]):
        raise InvalidArgumentError(
            f"--nn-preload {spec!r}: expected NAME:ENCODING:TARGET:PATH[:PATH...]"
        )
    name, encoding, target, *paths = parts
    problem = name_problem(name)
    if problem is not None:
        raise InvalidArgumentError(f"--nn-preload {spec!r}: {problem}")
    try:
        tgt = None if target.strip().lower() == "auto" else ExecutionTarget.coerce(target)
        enc = GraphEncoding.coerce(encoding)
    except InvalidArgumentError as exc:
        raise exc.prefixed(f"--nn-preload {spec!r}") from None
    return Preload(name, enc, tgt, tuple(Path(p) for p in paths), f"--nn-preload {spec!r}")


#: Files a Wasmtime-style graph directory may hold, by encoding.
_DIR_FILES: dict[GraphEncoding, tuple[str, ...]] = {
    GraphEncoding.OPENVINO: ("model.xml", "model.bin"),
    GraphEncoding.ONNX: ("model.onnx",),
    GraphEncoding.PYTORCH: ("model.pt",),
    GraphEncoding.TENSORFLOWLITE: ("model.tflite",),
}


def parse_nn_graph(spec: str) -> Preload:
    """``nn-graph=ENCODING::DIR`` (Wasmtime's syntax); the name is DIR's last component."""
    key, sep, value = spec.partition("=")
    encoding, sep2, directory = value.partition("::")
    if key.strip() != "nn-graph" or not sep or not sep2 or not directory:
        raise InvalidArgumentError(f"--wasi {spec!r}: expected nn-graph=ENCODING::DIR "
                                   "(or nn, or common: both always on)")
    try:
        enc = GraphEncoding.coerce(encoding)
    except InvalidArgumentError as exc:
        raise exc.prefixed(f"--wasi {spec!r}") from None
    files = _DIR_FILES.get(enc)
    if files is None:
        raise InvalidArgumentError(
            f"--wasi {spec!r}: encoding {enc.value} has no graph-directory layout: expected "
            f"one of {', '.join(e.value for e in _DIR_FILES)}"
        )
    path = Path(directory)
    # DIR's own last part, as Wasmtime names it: a "current version" link
    # (models/mobilenet -> mobilenet-v3) registers the name the operator typed, not its
    # target's. abspath settles ".", ".." and a trailing "/" without following links.
    name = Path(os.path.abspath(path)).name
    problem = name_problem(name)
    if problem is not None:
        raise InvalidArgumentError(f"--wasi {spec!r}: the folder's name is the model's: {problem}")
    return Preload(name, enc, None, tuple(path / f for f in files), f"--wasi {spec!r}")


def with_preloads(config: RuntimeConfig, preloads: Sequence[Preload]) -> RuntimeConfig:
    """``config`` with each preload added to its ``[models]`` table (absolute paths).

    The runtime's model registry then serves them like any configured model: loaded on
    first ``load_by_name``, shared by every guest. A name already in the config, a
    model's or a pipeline's, is replaced by the command line's (nothing else in a config
    names a pipeline: steps are models). The config's warnings are not given again: they
    were when it was read. Raises ConfigError for a name the config would refuse (names
    are identifiers, never paths).
    """
    from wasinn.configs.loader import parse_config

    if not preloads:
        return config
    data = config.model_dump()
    for preload in preloads:
        model: dict[str, object] = {
            "files": [str(p.absolute()) for p in preload.paths],
            "encoding": preload.encoding.value,
        }
        if preload.target is not None:
            model["target"] = preload.target.value
        data["pipelines"].pop(preload.name, None)
        data["models"][preload.name] = model
    label = str(config.source) if config.source else "<command line>"
    merged = parse_config(data, config.source, label=f"{label} + preloads", warn=False)
    return merged.with_given({p.name: p.flag for p in preloads if p.flag})

