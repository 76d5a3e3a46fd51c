"""A guest's stdin: empty by default, given as bytes, a file or the host's own, and fed
through a pipe the host closes when the guest is cancelled (so a read that waits for
input cannot hold ``run_wasm``)."""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

import wasinn
from tests.component_guests import build_read_stdin
from tests.guest_support import WAT_DIR
from wasinn.configs.loader import parse_config
from wasinn.errors import InvalidArgumentError
from wasinn.host.guest_stdin import CHUNK_BYTES
from wasinn.host.runner import run_wasm

READ_16 = WAT_DIR / "read_stdin.wat"  # exits with the number of bytes read (<= 16)
SUM = WAT_DIR / "sum_stdin.wat"  # exits with the sum of all its stdin's bytes mod 113
COMPONENT_READ, COMPONENT_CLOSED = 0, 1  # what read_stdin/'s `run` returns


@pytest.fixture
async def rt() -> wasinn.Runtime:
    async with wasinn.Runtime(parse_config({}, None)) as runtime:
        yield runtime


@pytest.fixture(scope="module")
def component(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("stdin") / "read_stdin.wasm"
    path.write_bytes(build_read_stdin(path.parent))
    return path


class SilentPipe:
    """A pipe whose writer never writes: a stdin that sends nothing. The writer is closed
    after ``release_after_s`` in any case, so that a guest the host failed to stop ends
    (and the test fails) instead of hanging."""

    def __init__(self, release_after_s: float = 20.0) -> None:
        self.read_end, self._write_end = os.pipe()
        self.released_by_timer = False
        self._timer = threading.Timer(release_after_s, self._release)
        self._timer.start()

    @property
    def path(self) -> Path:
        return Path(f"/dev/fd/{self.read_end}")

    def _release(self) -> None:
        self.released_by_timer = True
        os.close(self._write_end)

    def close(self) -> None:
        self._timer.cancel()
        if not self.released_by_timer:
            os.close(self._write_end)
        os.close(self.read_end)


@pytest.fixture
def silent() -> Iterator[SilentPipe]:
    pipe = SilentPipe()
    yield pipe
    pipe.close()


def feed_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "wasinn guest stdin"]


async def test_a_guests_stdin_is_empty_by_default(rt: wasinn.Runtime) -> None:
    # Before: a library guest read the host process's own stdin.
    assert await run_wasm(rt, READ_16) == 0


async def test_a_guest_reads_the_bytes_it_is_given(rt: wasinn.Runtime) -> None:
    assert await run_wasm(rt, READ_16, stdin=b"hello") == 5
    assert await run_wasm(rt, READ_16, stdin=b"x" * 100) == 16
    assert await rt.run_wasm(READ_16, stdin=bytearray(b"abc")) == 3


async def test_a_guest_reads_all_of_a_large_stdin_in_order(rt: wasinn.Runtime,
                                                           tmp_path: Path) -> None:
    # Many chunks, more than a pipe holds: the feed waits for the guest to read.
    data = random.Random(7).randbytes(5 * CHUNK_BYTES + 12345)
    assert await run_wasm(rt, SUM, stdin=data) == sum(data) % 113
    file = tmp_path / "input.bin"
    file.write_bytes(data)
    assert await run_wasm(rt, SUM, stdin=file) == sum(data) % 113
    assert feed_threads() == []


async def test_cancelling_a_guest_that_waits_for_its_stdin_stops_it_at_once(
        rt: wasinn.Runtime, silent: SilentPipe) -> None:
    # Before: wasmtime's read of the host's stdin went on in Rust, where the cancellation
    # (an epoch interruption) cannot reach: run_wasm waited until input came.
    with trio.move_on_after(0.5) as scope:
        await run_wasm(rt, READ_16, stdin=silent.path)
    assert scope.cancelled_caught
    assert not silent.released_by_timer
    assert feed_threads() == []
    assert await run_wasm(rt, READ_16, stdin=b"ok") == 2  # the host serves on


async def test_a_guest_that_never_reads_its_stdin_ends_as_usual(
        rt: wasinn.Runtime, silent: SilentPipe) -> None:
    assert await run_wasm(rt, WAT_DIR / "exit_code.wat", stdin=silent.path) == 42
    assert feed_threads() == []
    assert await run_wasm(rt, WAT_DIR / "exit_code.wat", stdin=b"x" * 10**6) == 42
    assert feed_threads() == []


async def test_a_component_reads_its_stdin(rt: wasinn.Runtime, component: Path) -> None:
    assert await run_wasm(rt, component, stdin=b"hello") == COMPONENT_READ
    assert await run_wasm(rt, component) == COMPONENT_CLOSED  # empty: closed at once


async def test_cancelling_a_component_that_waits_for_its_stdin_stops_it_at_once(
        rt: wasinn.Runtime, component: Path, silent: SilentPipe) -> None:
    with trio.move_on_after(0.5) as scope:
        await run_wasm(rt, component, stdin=silent.path)
    assert scope.cancelled_caught
    assert not silent.released_by_timer
    assert await run_wasm(rt, component, stdin=b"x") == COMPONENT_READ


@pytest.mark.parametrize(("stdin", "said"), [
    ("input.txt", "the string 'input.txt' (a path must be a pathlib.Path)"),
    (42, "a int"),
])
async def test_a_stdin_of_another_kind_is_refused(rt: wasinn.Runtime, stdin: object,
                                                  said: str) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        await run_wasm(rt, READ_16, stdin=stdin)  # type: ignore[arg-type]
    assert caught.value.message == (
        f"a guest's stdin cannot be {said}: expected None (empty), bytes, a pathlib.Path "
        "of a file to read, or 'inherit' (the host's own stdin)")


async def test_a_stdin_file_that_cannot_be_read_is_refused(rt: wasinn.Runtime,
                                                           tmp_path: Path) -> None:
    missing = tmp_path / "missing.txt"
    with pytest.raises(InvalidArgumentError, match=(
            f"cannot open '{missing}' as a guest's stdin \\(No such file or directory\\): "
            "expected a readable file")):
        await run_wasm(rt, READ_16, stdin=missing)
    with pytest.raises(InvalidArgumentError, match=(
            f"'{tmp_path}' is a directory: expected a readable file for a guest's stdin")):
        await run_wasm(rt, READ_16, stdin=tmp_path)
