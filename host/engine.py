"""The one wasmtime Engine of the process, and an on-disk cache of compiled guests.

Engine and compiled modules/components are thread-safe and shared by every guest;
each guest instance has its own Store (see the guest runners). Epoch interruption is
always on so that cancelling a guest can stop it mid-computation: the runner sets a
store's deadline and bumps the epoch with :func:`interrupt_all` / a ticker.

Compiled artifacts are cached under ``$WASINN_CACHE_DIR`` (default
``$XDG_CACHE_HOME/wasinn`` or ``~/.cache/wasinn``), keyed by the SHA-256 of the wasm
bytes and the wasmtime version, so a second start skips compilation.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from importlib.metadata import version
from pathlib import Path

import wasmtime
import wasmtime.component

log = logging.getLogger("wasinn.host")

_lock = threading.Lock()
_engine: wasmtime.Engine | None = None

#: Artifacts whose magic says "component" (layer 1) rather than "core module" (layer 0).
_COMPONENT_LAYER = b"\x0d\x00\x01\x00"
_MODULE_LAYER = b"\x01\x00\x00\x00"


def shared_engine() -> wasmtime.Engine:
    """The process-wide Engine: epoch interruption and the component model enabled."""
    global _engine  # noqa: PLW0603 - one Engine per process, created on first use
    with _lock:
        if _engine is None:
            config = wasmtime.Config()
            config.epoch_interruption = True
            config.wasm_component_model = True
            _engine = wasmtime.Engine(config)
        return _engine


def is_component(wasm: bytes) -> bool:
    """True for a binary component, False for a core module (text formats: by keyword)."""
    if wasm[:4] == b"\0asm":
        return wasm[4:8] == _COMPONENT_LAYER
    head = wasm[:4096].lstrip()
    return head.startswith(b"(component")


def cache_dir() -> Path:
    env = os.environ.get("WASINN_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "wasinn"


def _cache_path(wasm: bytes, kind: str) -> Path:
    key = hashlib.sha256(wasm).hexdigest()
    return cache_dir() / f"wasmtime-{version('wasmtime')}" / f"{key}.{kind}"


def _compile(
    wasm: bytes, kind: str, engine: wasmtime.Engine
) -> wasmtime.Module | wasmtime.component.Component:
    path = _cache_path(wasm, kind)
    cls: type[wasmtime.Module] | type[wasmtime.component.Component] = (
        wasmtime.component.Component if kind == "cwasm-component" else wasmtime.Module
    )
    if path.exists():
        start = time.perf_counter()
        try:
            cached = cls.deserialize_file(engine, str(path))
        except wasmtime.WasmtimeError as exc:  # stale or corrupt cache entry: recompile
            log.debug("discarding cached %s: %s", path, exc)
        else:
            log.info("loaded compiled %s guest from the cache in %.1f ms",
                     kind.removeprefix("cwasm-"), (time.perf_counter() - start) * 1e3)
            return cached
    start = time.perf_counter()
    compiled = cls(engine, wasm)
    log.info("compiled %s guest in %.1f ms", kind.removeprefix("cwasm-"),
             (time.perf_counter() - start) * 1e3)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_bytes(compiled.serialize())
        tmp.replace(path)
    except OSError as exc:  # a read-only cache directory only costs the next start time
        log.debug("cannot cache compiled guest at %s: %s", path, exc)
    return compiled


def compile_module(wasm: bytes, engine: wasmtime.Engine | None = None) -> wasmtime.Module:
    """Compile (or load from the disk cache) a core module."""
    compiled = _compile(wasm, "cwasm-module", engine or shared_engine())
    assert isinstance(compiled, wasmtime.Module)
    return compiled


def compile_component(
    wasm: bytes, engine: wasmtime.Engine | None = None
) -> wasmtime.component.Component:
    """Compile (or load from the disk cache) a component."""
    compiled = _compile(wasm, "cwasm-component", engine or shared_engine())
    assert isinstance(compiled, wasmtime.component.Component)
    return compiled
