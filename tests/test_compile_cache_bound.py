"""The compiled-guest disk cache is bounded ($WASINN_CACHE_MAX_BYTES): the entries used
least recently go first, a hit renews an entry, and eviction only ever unlinks."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest
import wasmtime

from wasinn.errors import InvalidArgumentError
from wasinn.host import engine
from wasinn.host.engine import (
    CACHE_MAX_BYTES_VAR,
    DEFAULT_CACHE_MAX_BYTES,
    STALE_TEMP_SECONDS,
    compile_module,
)


def module(n: int) -> bytes:
    """A distinct small core module for each ``n`` (its compiled artifacts differ)."""
    return f'(module (func (export "f") (result i32) (i32.const {n})))'.encode()


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("WASINN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(CACHE_MAX_BYTES_VAR, raising=False)
    return tmp_path


def entries(cache: Path) -> dict[str, Path]:
    """The compiled entries in the cache, by the number of the module each holds."""
    found = {}
    for path in cache.glob("wasmtime-*/*.cwasm-module"):
        for n in range(100):
            if path.name.startswith(hashlib.sha256(module(n)).hexdigest()):
                found[str(n)] = path
    return found


def entry_bytes(cache: Path) -> int:
    """The size of one entry (all these modules compile to the same size, or nearly)."""
    compile_module(module(99))
    (path,) = entries(cache).values()
    size = path.stat().st_size
    path.unlink()
    return size


def age(paths: list[Path]) -> None:
    """Give ``paths`` modification times in this order, oldest first, a minute apart, in
    the past (file times may be coarser than the time between two compiles)."""
    now = time.time()
    for i, path in enumerate(paths):
        when = now - 60 * (len(paths) - i)
        os.utime(path, (when, when))


def test_the_cache_is_bounded_and_the_least_recently_used_go_first(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: one entry per distinct guest binary, never removed (the review's 100
    # guests left 100 files).
    size = entry_bytes(cache)
    monkeypatch.setenv(CACHE_MAX_BYTES_VAR, str(int(size * 3.5)))
    for n in range(3):
        compile_module(module(n))
    age([entries(cache)[n] for n in "012"])
    compile_module(module(0))  # a hit: 0 is now the most recently used
    compile_module(module(3))  # over the bound: the least recently used, 1, goes
    assert sorted(entries(cache)) == ["0", "2", "3"]
    for n in range(4, 10):
        compile_module(module(n))
        total = sum(p.stat().st_size for p in cache.glob("wasmtime-*/*"))
        assert total <= size * 3.5
        assert str(n) in entries(cache)  # the entry just written stays


def test_a_module_loaded_from_an_entry_outlives_its_eviction(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    size = entry_bytes(cache)
    monkeypatch.setenv(CACHE_MAX_BYTES_VAR, str(int(size * 1.5)))
    compile_module(module(1))
    loaded = compile_module(module(1))  # deserialized from the entry's file
    compile_module(module(2))
    assert sorted(entries(cache)) == ["2"]  # 1's file is gone: unlinked, not truncated
    store = wasmtime.Store(engine.shared_engine())
    store.set_epoch_deadline(1)
    instance = wasmtime.Instance(store, loaded, [])
    f = instance.exports(store)["f"]
    assert isinstance(f, wasmtime.Func)
    assert f(store) == 1


def test_other_versions_and_stale_temporary_files_are_evicted_but_fresh_ones_kept(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    size = entry_bytes(cache)
    monkeypatch.setenv(CACHE_MAX_BYTES_VAR, str(int(size * 2.5)))
    older = cache / "wasmtime-1.0.0"
    older.mkdir()
    other_version = older / f"{'a' * 64}.cwasm-module"
    other_version.write_bytes(bytes(size))
    stale = older / f"{'b' * 64}.111.222.tmp"  # left by a process that died writing it
    fresh = older / f"{'c' * 64}.333.444.tmp"  # another process writing now
    stale.write_bytes(b"x")
    fresh.write_bytes(b"x" * (3 * size))  # (not counted: it is not an entry yet)
    age([other_version])
    long_ago = time.time() - STALE_TEMP_SECONDS - 60
    os.utime(stale, (long_ago, long_ago))
    compile_module(module(1))
    compile_module(module(2))
    assert not other_version.exists() and not stale.exists()
    assert fresh.exists()
    assert sorted(entries(cache)) == ["1", "2"]


def test_an_artifact_over_the_bound_is_not_written(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    size = entry_bytes(cache)
    compile_module(module(1))
    monkeypatch.setenv(CACHE_MAX_BYTES_VAR, str(size - 1))
    compile_module(module(2))
    assert sorted(entries(cache)) == ["1"]  # and 1 stays: nothing was added


def test_zero_keeps_no_compiled_guest_on_disk(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    compile_module(module(1))
    (path,) = entries(cache).values()
    path.write_bytes(b"not a compiled module")  # would be read (and discarded) if looked at
    monkeypatch.setenv(CACHE_MAX_BYTES_VAR, "0")
    compile_module(module(1))
    compile_module(module(2))
    assert sorted(entries(cache)) == ["1"]
    assert path.read_bytes() == b"not a compiled module"  # neither rewritten nor evicted


@pytest.mark.parametrize("value", ["-1", "1.5", "2GiB", "lots"])
def test_a_bad_bound_names_the_variable_and_what_is_expected(
        cache: Path, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(CACHE_MAX_BYTES_VAR, value)
    with pytest.raises(InvalidArgumentError) as info:
        compile_module(module(1))
    assert info.value.message == (
        f"$WASINN_CACHE_MAX_BYTES={value!r}: expected a whole number of bytes >= 0 that "
        f"bounds the compiled-guest cache, such as {DEFAULT_CACHE_MAX_BYTES} (0: no disk "
        "cache)")
