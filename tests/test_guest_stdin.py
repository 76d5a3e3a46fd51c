"""A guest's stdin: empty by default, given as bytes, a file or the host's own, and fed
through a pipe the host closes when the guest is cancelled (so a read that waits for
input cannot hold ``run_wasm``)."""

from __future__ import annotations

import array
import fcntl
import mmap
import os
import random
import subprocess
import sys
import termios
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
from wasinn.host.guest_stdin import CHUNK_BYTES, UNREAD_BYTES, _PipeWindow
from wasinn.host.runner import run_wasm

READ_16 = WAT_DIR / "read_stdin.wat"  # exits with the number of bytes read (<= 16)
SUM = WAT_DIR / "sum_stdin.wat"  # exits with the sum of all its stdin's bytes mod 113
CAT = WAT_DIR / "cat_stdin.wat"  # copies its stdin to its stdout
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


def bytes_in_pipe(fd: int) -> int:
    count = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, count)
    return count[0]


def wasinn_run(guest: Path, stdin: object) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "wasinn.cli", "run", str(guest)],
                          stdin=stdin, capture_output=True, check=False, timeout=120)


async def test_a_guest_that_never_reads_its_stdin_takes_at_most_three_pages_of_it(
        rt: wasinn.Runtime) -> None:
    # Before: the feed read 64 KiB chunks into a 64 KiB pipe, which Wasmtime drains of
    # its own accord (two 64 KiB reads): 256 KiB of the source were gone.
    read_end, write_end = os.pipe()
    try:
        size = fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 1 << 20)
        os.set_blocking(write_end, False)
        os.write(write_end, b"x" * size)
        assert await run_wasm(rt, WAT_DIR / "exit_code.wat",
                              stdin=Path(f"/dev/fd/{read_end}")) == 42
        assert size - bytes_in_pipe(read_end) <= UNREAD_BYTES
    finally:
        os.close(read_end)
        os.close(write_end)


def test_wasinn_run_leaves_the_rest_of_its_stdin_file_to_the_next_command(
        tmp_path: Path) -> None:
    # `while read line; do wasinn run guest.wasm; done < list`: each run shares the
    # file's offset with the loop. Before, a guest that never read took 128-256 KiB.
    data = tmp_path / "input.bin"
    data.write_bytes(random.Random(3).randbytes(1 << 20))
    with data.open("rb") as stdin:
        stdin.seek(100)  # as after the loop's first line
        proc = wasinn_run(WAT_DIR / "exit_code.wat", stdin)
        assert proc.returncode == 42, proc.stderr
        assert 100 <= os.lseek(stdin.fileno(), 0, os.SEEK_CUR) <= 100 + UNREAD_BYTES


@pytest.mark.parametrize("through", ["file", "pipe"])
def test_wasinn_run_gives_its_guest_all_of_a_large_stdin_byte_for_byte(
        tmp_path: Path, through: str) -> None:
    # Many chunks: the feed's reads widen from one page as the guest reads.
    data = random.Random(11).randbytes(4 * 1024 * 1024 + 4321)
    if through == "file":
        path = tmp_path / "input.bin"
        path.write_bytes(data)
        with path.open("rb") as stdin:
            proc = wasinn_run(CAT, stdin)
    else:
        proc = subprocess.run([sys.executable, "-m", "wasinn.cli", "run", str(CAT)],
                              input=data, capture_output=True, check=False, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout) == len(data)
    assert proc.stdout == data


def test_the_feeds_window_widens_only_once_the_guest_has_read() -> None:
    # Wasmtime holds two reads of the pipe by itself: until more has left the pipe, the
    # pipe stays one page and the source is read a page at a time.
    read_end, write_end = os.pipe()
    try:
        window = _PipeWindow(write_end)
        assert window.size == fcntl.fcntl(write_end, fcntl.F_GETPIPE_SZ) == mmap.PAGESIZE
        for _ in range(2):  # what Wasmtime reads with no guest reading
            window.wrote(os.write(write_end, b"x" * window.follow_guest()))
            os.read(read_end, window.size)
        window.wrote(os.write(write_end, b"x" * window.follow_guest()))
        assert window.follow_guest() == mmap.PAGESIZE  # (the third is still in the pipe)
        sizes = []
        while window.size < CHUNK_BYTES:  # a guest reading all it is given
            os.read(read_end, window.size)
            window.wrote(os.write(write_end, b"x" * window.follow_guest()))
            sizes.append(window.size)
        assert sizes == [mmap.PAGESIZE * 2**k for k in range(1, len(sizes) + 1)]
        assert fcntl.fcntl(write_end, fcntl.F_GETPIPE_SZ) == CHUNK_BYTES
    finally:
        os.close(read_end)
        os.close(write_end)
