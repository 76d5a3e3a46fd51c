"""The process's wasmtime Engines, and an on-disk cache of compiled guests.

Engine and compiled modules/components are thread-safe and shared by every guest;
each guest instance has its own Store (see the guest runners). Epoch interruption is
always on so that cancelling a guest can stop it mid-computation: each store gets an
epoch deadline and an epoch-deadline callback, and the epoch moves only when a guest is
interrupted (:class:`wasinn.host.interrupt.Interrupter`).

There are two engines, made on first use: :func:`shared_engine`, and a second one that
also counts fuel (``Config.consume_fuel``) for the guests whose limits set
``max_fuel`` (:mod:`wasinn.host.fuel`). Fuel is an engine setting compiled into every
function, and it slows all of that engine's wasm, so guests without a fuel bound keep
the plain engine. :func:`engine_for` picks one.

Compiled artifacts are cached under ``$WASINN_CACHE_DIR`` (default
``$XDG_CACHE_HOME/wasinn`` or ``~/.cache/wasinn``), keyed by the SHA-256 of the wasm
bytes, the wasmtime version and the engine (with or without fuel: code compiled for one
cannot be loaded into the other), so a second start skips compilation.

The cache is bounded: a host serving guests would otherwise keep one compiled artifact
(tens of MB for a componentize-py guest) for every distinct binary it was ever given.
``$WASINN_CACHE_MAX_BYTES`` (default :data:`DEFAULT_CACHE_MAX_BYTES`; 0: no disk cache
at all) bounds the bytes of every compiled entry under ``wasmtime-*/`` (other wasmtime
versions' included: this one never loads them), checked after each new entry is
written; the entries used least recently go first, by modification time, which a cache
hit renews. Several processes may share the directory: an entry is written to a file of
its own and renamed into place, and eviction only ever unlinks, so a process that has
an entry open (wasmtime maps it) keeps reading the file it opened. An artifact larger
than the bound is not written. A compile that its caller abandoned (a run cancelled while
its guest compiles, whose worker thread goes on) writes its entry the same way: a
process that exits before the rename leaves at most a temporary file, which a later
eviction removes once it is :data:`STALE_TEMP_SECONDS` old.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import threading
import time
from importlib.metadata import version
from pathlib import Path

import wasmtime
import wasmtime.component

from wasinn.errors import InvalidArgumentError

log = logging.getLogger("wasinn.host")

#: The environment variable that bounds the compiled-guest cache, in bytes.
CACHE_MAX_BYTES_VAR = "WASINN_CACHE_MAX_BYTES"
#: The bound when the variable is not set.
DEFAULT_CACHE_MAX_BYTES = 2 * 1024**3
#: How old a temporary file of a cache write must be to count as left by a process that
#: died while writing it (a write takes well under a second): it is then removed.
STALE_TEMP_SECONDS = 3600.0
#: How cache entries end (compiled artifacts, and temporary files being written).
_ENTRY_SUFFIXES, _TEMP_SUFFIX = (".cwasm-module", ".cwasm-component"), ".tmp"

_lock = threading.Lock()
#: The engines made so far, by whether they count fuel.
_engines: dict[bool, wasmtime.Engine] = {}

#: The version and layer bytes after ``\0asm`` of a component (a core module has
#: ``01 00 00 00``: version 1, layer 0).
_COMPONENT_LAYER = b"\x0d\x00\x01\x00"
#: Where a (nested) ``(; ... ;)`` block comment of WebAssembly text opens or closes.
_BLOCK_COMMENT_MARK = re.compile(rb"\(;|;\)")


def shared_engine() -> wasmtime.Engine:
    """The process-wide Engine: epoch interruption and the component model enabled,
    64-bit memories not, no fuel."""
    return engine_for(fuel=False)


def engine_for(*, fuel: bool) -> wasmtime.Engine:
    """The process-wide Engine for guests with a fuel bound (``fuel``: it counts each
    store's fuel, which then starts at zero: set it with ``Store.set_fuel``) or without
    one (:func:`shared_engine`). Each is made on first use."""
    with _lock:
        engine = _engines.get(fuel)
        if engine is None:
            config = wasmtime.Config()
            config.epoch_interruption = True
            config.wasm_component_model = True
            # Guests' ABIs are 32-bit (wasi_ephemeral_nn's pointers are i32, the component
            # model's lists too): a 64-bit memory could only grow past every bound.
            config.wasm_memory64 = False
            config.consume_fuel = fuel
            engine = _engines[fuel] = wasmtime.Engine(config)
        return engine


def is_component(wasm: bytes) -> bool:
    """True for a component, False for a core module, in binary or text format.

    Text is converted with :func:`wasmtime.wat2wasm` and the binary's version and layer
    bytes decide, so comments and annotations before ``(component`` are no trouble. Text
    that does not convert is judged by its first keyword after whitespace and comments
    (:func:`_first_keyword`), so that the compiler that reports its error is the one
    meant; anything else (not wasm at all) counts as a core module. The conversion takes
    seconds for a large text: from an event loop, call it in a worker thread.
    """
    if wasm[:4] == b"\0asm":
        return wasm[4:8] == _COMPONENT_LAYER
    try:
        binary = wasmtime.wat2wasm(wasm)
    except (wasmtime.WasmtimeError, ValueError, TypeError):
        return _first_keyword(wasm) == b"component"
    return bytes(binary[4:8]) == _COMPONENT_LAYER


def _first_keyword(text: bytes) -> bytes:
    """The keyword after the first ``(`` of WebAssembly text, skipping whitespace, ``;;``
    line comments and (nested) ``(; ;)`` block comments; b"" when there is none."""
    i, n = 0, len(text)
    while i < n:
        if text[i:i + 1] in b" \t\r\n":
            i += 1
        elif text.startswith(b";;", i):
            end = text.find(b"\n", i)
            i = n if end < 0 else end + 1
        elif text.startswith(b"(;", i):
            depth, i = 1, i + 2
            while depth:
                found = _BLOCK_COMMENT_MARK.search(text, i)
                if found is None:
                    return b""  # an unterminated comment
                depth += 1 if found.group() == b"(;" else -1
                i = found.end()
        elif text.startswith(b"(", i):
            end = i + 1
            while end < n and text[end:end + 1] not in b" \t\r\n();":
                end += 1
            return text[i + 1:end]
        else:
            return b""
    return b""


def cache_dir() -> Path:
    env = os.environ.get("WASINN_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "wasinn"


def cache_max_bytes() -> int:
    """The bound on the compiled-guest cache, from ``$WASINN_CACHE_MAX_BYTES`` (see the
    module docstring); InvalidArgumentError naming the variable for a value that is not
    a whole number of bytes >= 0."""
    raw = os.environ.get(CACHE_MAX_BYTES_VAR, "").strip()
    if not raw:
        return DEFAULT_CACHE_MAX_BYTES
    try:
        bound = int(raw)
    except ValueError:
        bound = -1
    if bound < 0:
        raise InvalidArgumentError(
            f"${CACHE_MAX_BYTES_VAR}={raw!r}: expected a whole number of bytes >= 0 that "
            f"bounds the compiled-guest cache, such as {DEFAULT_CACHE_MAX_BYTES} (0: no "
            "disk cache)")
    return bound


def _cache_path(wasm: bytes, kind: str, fuel: bool) -> Path:
    # Code compiled with fuel counting differs from code without (wasmtime refuses to
    # load one into the other's engine): each has its own entry.
    key = hashlib.sha256(wasm).hexdigest() + ("-fuel" if fuel else "")
    return cache_dir() / f"wasmtime-{version('wasmtime')}" / f"{key}.{kind}"


def _compile(
    wasm: bytes, kind: str, fuel: bool
) -> wasmtime.Module | wasmtime.component.Component:
    engine = engine_for(fuel=fuel)
    bound = cache_max_bytes()
    path = _cache_path(wasm, kind, fuel)
    cls: type[wasmtime.Module] | type[wasmtime.component.Component] = (
        wasmtime.component.Component if kind == "cwasm-component" else wasmtime.Module
    )
    if bound and path.exists():
        start = time.perf_counter()
        try:
            cached = cls.deserialize_file(engine, str(path))
        except wasmtime.WasmtimeError as exc:  # stale or corrupt cache entry: recompile
            log.debug("discarding cached %s: %s", path, exc)
        else:
            log.info("loaded compiled %s guest from the cache in %.1f ms",
                     kind.removeprefix("cwasm-"), (time.perf_counter() - start) * 1e3)
            _touch(path)
            return cached
    start = time.perf_counter()
    compiled = cls(engine, wasm)
    log.info("compiled %s guest in %.1f ms", kind.removeprefix("cwasm-"),
             (time.perf_counter() - start) * 1e3)
    if bound:
        _store(path, compiled.serialize(), bound)
    return compiled


def _store(path: Path, artifact: bytes | bytearray, bound: int) -> None:
    """Write ``artifact`` as cache entry ``path``, then evict down to ``bound`` bytes."""
    if len(artifact) > bound:
        log.debug("not caching a compiled guest of %d bytes: over $%s (%d)", len(artifact),
                  CACHE_MAX_BYTES_VAR, bound)
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}{_TEMP_SUFFIX}")
        tmp.write_bytes(artifact)
        tmp.replace(path)  # atomic: a reader sees the old file or the new, never half
    except OSError as exc:  # a read-only cache directory only costs the next start time
        log.debug("cannot cache compiled guest at %s: %s", path, exc)
        return
    _evict(path, bound)


def _touch(path: Path) -> None:
    """Mark cache entry ``path`` as just used (its modification time: see _evict)."""
    with contextlib.suppress(OSError):  # evicted meanwhile by another process, or read-only
        os.utime(path)


def _evict(keep: Path, bound: int) -> None:
    """Unlink the least recently used cache entries (oldest modification time first), other
    than ``keep``, until all of them together hold at most ``bound`` bytes; and temporary
    files older than STALE_TEMP_SECONDS. Only ever unlinks: a process reading an entry
    keeps the file it opened."""
    entries: list[tuple[int, int, Path]] = []  # (mtime in ns, bytes, path)
    stale = time.time() - STALE_TEMP_SECONDS
    for folder in keep.parent.parent.glob("wasmtime-*"):
        try:
            listing = list(os.scandir(folder))
        except OSError:
            continue
        for entry in listing:
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:  # removed meanwhile
                continue
            if entry.name.endswith(_TEMP_SUFFIX):
                if info.st_mtime < stale:
                    _unlink(Path(entry.path))
            elif entry.name.endswith(_ENTRY_SUFFIXES) and entry.is_file(follow_symlinks=False):
                entries.append((info.st_mtime_ns, info.st_size, Path(entry.path)))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= bound:
            break
        if path != keep:
            _unlink(path)
            total -= size


def _unlink(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.debug("cannot evict %s from the compiled-guest cache: %s", path, exc)


def compile_module(wasm: bytes, *, fuel: bool = False) -> wasmtime.Module:
    """Compile (or load from the disk cache) a core module for ``engine_for(fuel=fuel)``."""
    compiled = _compile(wasm, "cwasm-module", fuel)
    assert isinstance(compiled, wasmtime.Module)
    return compiled


def compile_component(wasm: bytes, *, fuel: bool = False) -> wasmtime.component.Component:
    """Compile (or load from the disk cache) a component for ``engine_for(fuel=fuel)``."""
    compiled = _compile(wasm, "cwasm-component", fuel)
    assert isinstance(compiled, wasmtime.component.Component)
    return compiled
