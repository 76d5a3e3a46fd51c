"""The descriptors a component guest holds in its scratch directory are bounded, and the
directory's measurement holds, or counts as over quota, when the process is out of them.

Driven through ``tests/components/scratch_fdleak.wat``, whose ``leak(name, n)`` opens a
scratch file ``n`` times and keeps every descriptor (each one of the host process's own).
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

import wasinn
from tests.component_guests import COMPONENTS
from wasinn import ConfigError
from wasinn.configs.loader import parse_config
from wasinn.errors import TooLargeError
from wasinn.host.component import ComponentGuest, dirents
from wasinn.host.component.scratch import MeasureError, ScratchDir
from wasinn.host.limits import GuestLimits, limits_of
from wasinn.host.runner import GuestTrap


@pytest.fixture
async def rt() -> AsyncIterator[wasinn.Runtime]:
    async with wasinn.Runtime(parse_config({}, None)) as runtime:
        yield runtime


async def start_leaker(rt: wasinn.Runtime, max_open: int) -> ComponentGuest:
    return await ComponentGuest.start(
        rt, (COMPONENTS / "scratch_fdleak.wat").read_text(), program="scratch_fdleak",
        limits=GuestLimits(max_scratch_open_files=max_open))


def descriptors_under(path: Path) -> int:
    """This process's descriptors open on ``path`` or anything in it, as procfs shows."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{name}").removesuffix(" (deleted)")
            count += target == str(path) or target.startswith(f"{path}/")
    return count


# -- the guest's bound ---------------------------------------------------------------------
async def test_descriptors_within_the_bound_are_counted_and_allowed(rt: wasinn.Runtime) -> None:
    async with await start_leaker(rt, max_open=16) as guest:
        assert guest.scratch is not None
        assert await guest.call("create", "f.bin") == 0
        assert await guest.call("leak", "f.bin", 10) == 10
        # The preopened directory, the file `create` keeps open and the ten: the host's
        # own descriptor of the directory is not the guest's.
        assert guest.scratch.measure().descriptors == 12
        assert await guest.call("close") == 0  # it runs on


async def test_a_guest_holding_too_many_descriptors_is_stopped_and_they_are_freed(
        rt: wasinn.Runtime) -> None:
    # Before: no bound at all; one guest could hold every descriptor of the process
    # (the review's guest held 19,979), and the host could then open no file.
    guest = await start_leaker(rt, max_open=16)
    async with guest:
        scratch = guest.scratch
        assert scratch is not None
        assert await guest.call("create", "f.bin") == 0
        with pytest.raises(GuestTrap, match=r"scratch_fdleak was stopped: it holds more than "
                                            r"16 descriptors open in its scratch directory "
                                            r"\(\[guests\] max_scratch_open_files\)"):
            await guest.call("leak", "f.bin", 40)
        # Stopped for good, and its descriptors went with its Store, not at aclose.
        assert descriptors_under(scratch.path) == 1  # the host's own
        with pytest.raises(GuestTrap, match="max_scratch_open_files"):
            await guest.call("close")
    assert scratch.removed


async def test_a_guest_stopped_while_opening_frees_its_descriptors_at_once(
        rt: wasinn.Runtime) -> None:
    # Opening thousands takes longer than the poll interval: the watcher stops it
    # mid-call (or, should the call end first, the measurement after it does). Its
    # descriptors must go with the stop, not at the next garbage collection.
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    many = min(5000, soft - len(os.listdir("/proc/self/fd")) - 200)
    guest = await start_leaker(rt, max_open=16)
    async with guest:
        scratch = guest.scratch
        assert scratch is not None
        assert await guest.call("create", "f.bin") == 0
        with pytest.raises(GuestTrap, match="max_scratch_open_files"):
            await guest.call("leak", "f.bin", many)
        assert descriptors_under(scratch.path) == 1  # the host's own


def test_the_bound_comes_from_the_config_and_is_checked() -> None:
    config = parse_config({"guests": {"max_scratch_open_files": 8}}, None)
    assert limits_of(type("Rt", (), {"config": config})()).max_scratch_open_files == 8
    assert GuestLimits().max_scratch_open_files == 64
    with pytest.raises(ConfigError, match=r"guests\.max_scratch_open_files"):
        parse_config({"guests": {"max_scratch_open_files": 0}}, None)


# -- a measurement in a process out of descriptors -----------------------------------------
@contextlib.contextmanager
def no_descriptor_left() -> Iterator[None]:
    """While inside, this process can open no descriptor (its soft RLIMIT_NOFILE is 0)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (0, hard))
    try:
        with pytest.raises(OSError) as info:
            os.close(os.open(os.devnull, os.O_RDONLY))
        assert info.value.errno == errno.EMFILE
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _hidden(directory: Path, name: str, nbytes: int) -> int:
    """A descriptor of a file of ``nbytes`` written in ``directory`` and then unlinked."""
    fd = os.open(directory / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.unlink(directory / name)
    os.write(fd, bytes(nbytes))
    return fd


def test_a_process_out_of_descriptors_still_measures_who_holds_them(tmp_path: Path) -> None:
    # Before: listing the directory and /proc/self/fd each needed a new descriptor; out
    # of them, the measurement saw nothing and counted the unlinked file as 0 bytes.
    if not dirents.needs_no_descriptor():
        pytest.skip("this C library has no getdents64: listing needs a descriptor here")
    scratch = ScratchDir(tmp_path)
    (scratch.path / "seen.bin").write_bytes(bytes(10_000))
    fds = [_hidden(scratch.path, "hidden.bin", 40_000),
           *(os.open(scratch.path / "seen.bin", os.O_RDONLY) for _ in range(3))]
    try:
        with no_descriptor_left():
            measured = scratch.measure()
            usage = scratch.usage()
        assert measured.descriptors == 4
        assert usage == measured.usage
        assert usage.entries == 2 and 50_000 <= usage.nbytes < 80_000
    finally:
        for fd in fds:
            os.close(fd)
        scratch.remove()


def test_a_measurement_that_fails_counts_as_over_quota(tmp_path: Path) -> None:
    # A subdirectory the guest made needs a descriptor to be listed: out of them, the
    # measurement fails, and says so, instead of counting what it could not see as 0.
    scratch = ScratchDir(tmp_path)
    (scratch.path / "sub").mkdir()
    (scratch.path / "sub" / "inner.bin").write_bytes(bytes(10_000))
    try:
        with no_descriptor_left(), pytest.raises(MeasureError) as info:
            scratch.measure()
        assert isinstance(info.value, TooLargeError)  # tensor-to-scratch: too-large
        assert info.value.message == (
            "its scratch directory could not be measured (Too many open files), which "
            "counts as over its limits")
        assert scratch.usage().entries == 2  # and once there are descriptors again
    finally:
        scratch.remove()


async def test_a_guest_whose_directory_cannot_be_measured_is_stopped(
        rt: wasinn.Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: an unreadable /proc/self/fd listing counted the unlinked files as 0 and
    # the guest ran on, writing uncounted.
    async with await start_leaker(rt, max_open=16) as guest:
        assert await guest.call("create", "f.bin") == 0
        readlink = os.readlink

        def failing(path: str, *, dir_fd: int | None = None) -> str:
            if dir_fd is not None:  # the measurement's reads of /proc/self/fd
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return readlink(path)

        monkeypatch.setattr(os, "readlink", failing)
        with pytest.raises(GuestTrap, match=r"scratch_fdleak was stopped: its scratch "
                                            r"directory could not be measured"):
            await guest.call("unlink", "f.bin")


def test_a_descriptor_closed_or_reused_after_the_listing_is_skipped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scratch = ScratchDir(tmp_path)
    fd = _hidden(scratch.path, "hidden.bin", 40_000)
    other = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)  # open, but not in scratch
    names = dirents.names
    closed = str(max(int(n) for n in os.listdir("/proc/self/fd")) + 1000)  # open by nobody
    fstat = os.fstat
    calls: dict[int, int] = {}

    def reused(target: int) -> os.stat_result:
        # `fd` as if its number were reused for `other` between its two fstat calls
        calls[target] = calls.get(target, 0) + 1
        return fstat(other if target == fd and calls[target] == 2 else target)

    try:
        monkeypatch.setattr(dirents, "names", lambda d: [closed, *names(d)])
        usage = scratch.usage()
        assert usage.entries == 1 and usage.nbytes >= 40_000
        monkeypatch.setattr(os, "fstat", reused)
        assert scratch.measure().descriptors == 0  # not taken for `other`'s target
    finally:
        os.close(fd)
        os.close(other)
        scratch.remove()


def test_the_listing_matches_os_listdir(tmp_path: Path) -> None:
    for i in range(3000):  # more than one getdents64 buffer
        (tmp_path / f"entry-{i:04d}-{'x' * (i % 40)}").touch()
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert sorted(dirents.names(fd)) == sorted(os.listdir(tmp_path))
        assert sorted(dirents.names(fd)) == sorted(os.listdir(tmp_path))  # from the start
    finally:
        os.close(fd)
