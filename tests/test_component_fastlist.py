"""The bulk list<u8> / list<u64> conversion: its layout check, its version pin, and exactness.

``test_layout_unchanged`` is the tripwire: it fails when a wasmtime-py release changes
the value layout the fast path relies on (then widen nothing; re-check and update
``CHECKED_VERSIONS`` and the pin in pyproject.toml).
"""

from __future__ import annotations

import re
import tomllib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from wasmtime import Store
from wasmtime.component import Component, Linker

from tests.component_guests import echo_bytes
from wasinn.host.component import fastlist
from wasinn.host.engine import shared_engine


def test_layout_unchanged() -> None:
    assert fastlist.layout_problems() == []


def test_installed_wasmtime_is_in_the_checked_range() -> None:
    assert fastlist.version_supported()
    assert fastlist.installed(), "importing wasinn.host.component installs the fast path"


def test_version_range_matches_the_pyproject_pin() -> None:
    """pyproject.toml states the checked range beside the wasmtime dependency."""
    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert any(d.startswith("wasmtime") for d in tomllib.loads(text)["project"]["dependencies"])
    low, high = fastlist.CHECKED_VERSIONS
    stated = re.search(r"checked on\s*#?\s*wasmtime >=(\d+)\.(\d+),<(\d+)", text)
    assert stated is not None, "pyproject.toml must state the fast path's checked wasmtime range"
    assert (int(stated[1]), int(stated[2])) == low
    assert int(stated[3]) == high[0]


@pytest.mark.parametrize(("version", "ok"), [
    ((49, 9, 9), False), ((50, 0, 0), True), ((50, 0, 1), True), ((50, 9), True),
    ((51, 0, 0), False),
])
def test_version_range_bounds(version: tuple[int, ...], ok: bool) -> None:
    assert fastlist.version_supported(version) is ok


def test_outside_the_range_install_warns_and_keeps_the_stock_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fastlist.uninstall()
    try:
        monkeypatch.setattr(fastlist, "wasmtime_version", lambda: (99, 0, 0))
        with pytest.warns(fastlist.FastListUnavailable, match="outside the range"):
            assert fastlist.install() is False
        assert not fastlist.installed()
    finally:
        monkeypatch.undo()
        assert fastlist.install()


class Echo:
    """The echo component with a host that records what it took and serves ``payload``."""

    def __init__(self) -> None:
        engine = shared_engine()
        self.component = Component(engine, echo_bytes())
        self.taken: list[Any] = []
        self.payload: Any = b""
        linker = Linker(engine)
        with linker.root() as root, root.add_instance("host") as host:
            host.add_func("take", self._take)
            host.add_func("give", lambda store, n: self.payload)
        self.store = Store(engine)
        self.store.set_epoch_deadline(2**62)
        self.instance = linker.instantiate(self.store, self.component)

    def _take(self, store: Any, data: Any) -> int:
        self.taken.append(data)
        return len(data)

    def call(self, name: str, *args: Any) -> Any:
        func = self.instance.get_func(self.store, name)
        assert func is not None
        result = func(self.store, *args)
        func.post_return(self.store)
        return result


@pytest.fixture(params=["fast", "stock"])
def echo(request: pytest.FixtureRequest) -> Iterator[Echo]:
    if request.param == "stock":
        fastlist.uninstall()
    try:
        yield Echo()
    finally:
        fastlist.install()


SIZES = [0, 1, 7, 8, 9, 4096, 100_003]


@pytest.mark.parametrize("size", SIZES)
def test_guest_to_host_bytes_are_exact(echo: Echo, size: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    assert echo.call("fill", data) == size
    assert echo.call("run-in", size) == size
    assert echo.taken[-1] == data
    assert isinstance(echo.taken[-1], bytes)


@pytest.mark.parametrize("size", SIZES)
def test_host_to_guest_bytes_are_exact(echo: Echo, size: int) -> None:
    data = np.random.default_rng(size + 1).integers(0, 256, size, dtype=np.uint8).tobytes()
    echo.payload = data
    assert echo.call("run-out", size) == size
    probes = sorted({0, size // 2, size - 1} - {-1}) if size else []
    assert [echo.call("peek", i) for i in probes] == [data[i] for i in probes]


def test_fast_path_accepts_numpy_and_memoryview() -> None:
    echo = Echo()
    array = np.arange(12, dtype=np.float32)
    for payload in (array, memoryview(array.tobytes()), bytearray(array.tobytes())):
        echo.payload = payload
        assert echo.call("run-out", array.nbytes) == array.nbytes
        assert bytes(echo.call("peek", i) for i in range(8)) == array.tobytes()[:8]


def test_words_roundtrip_pads_and_keeps_bytes() -> None:
    import ctypes

    from wasmtime import _ffi as ffi

    for size in (0, 1, 8, 13, 4096 + 3):
        data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
        val = ffi.wasmtime_component_val_t()
        fastlist.words_to_vallist(data, ctypes.pointer(val))
        assert val.of.list.size == (size + 7) // 8
        if size:
            assert val.of.list.data[0].kind == ffi.WASMTIME_COMPONENT_U64.value
        back = fastlist.vallist_to_words(val)
        assert back[:size] == data
        assert back[size:] == b"\0" * (len(back) - size)


#: A component exporting ``words: func() -> list<u64>`` that returns [1, 2**63 + 255].
WORDS_COMPONENT = r"""(component
  (core module $m
    (memory (export "memory") 1)
    (data (i32.const 0) "\10\00\00\00\02\00\00\00")
    (data (i32.const 16) "\01\00\00\00\00\00\00\00\ff\00\00\00\00\00\00\80")
    (func (export "words") (result i32) (i32.const 0)))
  (core instance $i (instantiate $m))
  (func (export "words") (result (list u64))
    (canon lift (core func $i "words") (memory (core memory $i "memory")))))"""
WORDS = [1, 2**63 + 255]


def test_words_read_as_ints_outside_the_wasinn_scope() -> None:
    """Other wasmtime-py users in the process still see list<u64> as a list of ints."""
    assert fastlist.installed()
    engine = shared_engine()
    store = Store(engine)
    store.set_epoch_deadline(2**62)
    instance = Linker(engine).instantiate(store, Component(engine, WORDS_COMPONENT))
    func = instance.get_func(store, "words")
    assert func is not None

    def words() -> Any:
        result = func(store)
        func.post_return(store)
        return result

    as_bytes = np.array(WORDS, dtype="<u8").tobytes()
    outside = words()
    assert type(outside) is list and outside == WORDS
    with fastlist.words_as_bytes():
        with fastlist.words_as_bytes():
            pass
        inside = words()  # still inside once a nested scope has ended
        assert type(inside) is fastlist.WordBytes and inside == as_bytes
    after = words()
    assert type(after) is list and after == WORDS


def test_layout_change_is_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fastlist, "_PAYLOAD", 16)
    problems = fastlist.layout_problems()
    assert problems and any("offset" in p for p in problems)
    fastlist.uninstall()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert fastlist.install() is False
        assert any(issubclass(w.category, fastlist.FastListUnavailable) for w in caught)
    finally:
        monkeypatch.undo()
        assert fastlist.install()
