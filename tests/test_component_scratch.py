"""``wasinn:nn/scratch``: tensor bytes handed over as files in a guest's scratch directory.

Driven through ``tests/components/scratch_loop.wat``, a component that writes and reads
its files with real wasi:filesystem calls (Wasmtime's own WASI host) and calls
``tensor-from-scratch`` / ``tensor-to-scratch`` through the canonical ABI.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from wasmtime.component import Variant

from tests.component_guests import COMPONENTS, RecordingRuntime
from wasinn.errors import InvalidArgumentError, NotFoundError, TooLargeError
from wasinn.host.component import ComponentGuest
from wasinn.host.component import guest as guest_module
from wasinn.host.component import scratch as scratch_module
from wasinn.host.component.scratch import GUEST_PATH, SHM, ScratchDir, Usage, default_base
from wasinn.host.limits import GuestLimits
from wasinn.host.runner import GuestTrap
from wasinn.modelgen import IMAGE_SHAPE, ModelFiles, sample_image

TYPES = ["FP16", "FP32", "FP64", "BF16", "U8", "I32", "I64"]
CODES = ["invalid-argument", "invalid-encoding", "timeout", "runtime-error",
         "unsupported-operation", "too-large", "not-found", "security", "unknown"]
FP32 = TYPES.index("FP32")
X = np.arange(8, dtype=np.float32).reshape(2, 4)


def scratch_loop() -> str:
    return (COMPONENTS / "scratch_loop.wat").read_text()


class Guest:
    """Calls into scratch_loop; ``ok``/``err`` unwrap its result<_, u32> values."""

    def __init__(self, guest: ComponentGuest) -> None:
        self.guest = guest

    async def __call__(self, name: str, *args: Any) -> Any:
        return await self.guest.call(name, *args)

    async def ok(self, name: str, *args: Any) -> Any:
        result = await self(name, *args)
        assert isinstance(result, Variant)
        if result.tag != "ok":
            assert isinstance(result.payload, int)
            code, message = await self.describe(result.payload)
            raise AssertionError(f"{name} failed: {code}: {message}")
        return result.payload

    async def err(self, name: str, *args: Any) -> tuple[str, str]:
        """The (code, message) of the error ``name`` returns; the error is dropped."""
        result = await self(name, *args)
        assert isinstance(result, Variant)
        assert result.tag == "err", f"{name} succeeded: {result!r}"
        assert isinstance(result.payload, int)
        return await self.describe(result.payload)

    async def describe(self, error: int) -> tuple[str, str]:
        code = CODES[await self("error-code", error)]
        message = await self("error-data", error)
        await self("error-drop", error)
        return code, message

    async def write(self, name: str, data: bytes) -> None:
        assert await self("write-file", name, data) == 0

    async def from_scratch(self, name: str, dims: list[int], ty: str = "FP32") -> int:
        handle: int = await self.ok("from-scratch", name, dims, TYPES.index(ty))
        return handle


async def start(rt: Any, **kwargs: Any) -> tuple[ComponentGuest, Guest]:
    guest = await ComponentGuest.start(rt, scratch_loop(), program="scratch_loop", **kwargs)
    return guest, Guest(guest)


@pytest.fixture
async def g(rt: RecordingRuntime) -> AsyncIterator[Guest]:
    guest, wrapper = await start(rt)
    async with guest:
        yield wrapper


# -- the two functions ---------------------------------------------------------------------
async def test_a_file_written_by_the_guest_becomes_a_tensor_and_back(
        g: Guest, rt: RecordingRuntime) -> None:
    await g.write("x.bin", X.tobytes())
    t = await g.from_scratch("x.bin", [2, 4])
    assert np.array_equal(np.frombuffer(await g("tensor-data", t), np.float32), X.reshape(-1))
    assert await g("prepare", "affine") == 0
    y = await g.ok("compute1", "x", t)
    assert await g.ok("to-scratch", y, "y.bin") == X.nbytes
    got = np.frombuffer(await g("read-file", "y.bin", X.nbytes), np.float32)
    assert np.array_equal(got, 2 * X.reshape(-1) + 1)
    await g("tensor-drop", y)
    await g("release")
    assert g.guest.live() == {"tensor": 0, "graph": 0, "graph-execution-context": 0, "error": 0}
    assert all(graph.unloaded for graph in rt.graphs)


async def test_the_infer_loop_through_scratch_files_matches_native(
        g: Guest, small_mobilenet: ModelFiles) -> None:
    import onnxruntime as ort

    image = sample_image(seed=3)
    assert await g("fill", image.tobytes()) == image.nbytes
    assert await g("prepare", "mobilenet") == 0
    assert await g("infer", 3, list(IMAGE_SHAPE)) == 4000, await g("last-failure")
    assert await g("last-failure") == 0
    # The loop left its last files behind: the input as the guest wrote it, the output
    # as the host wrote it.
    scratch = g.guest.scratch
    assert scratch is not None
    assert (scratch.path / "in.bin").read_bytes() == image.tobytes()
    session = ort.InferenceSession(str(small_mobilenet.onnx), providers=["CPUExecutionProvider"])
    (expected,) = session.run(None, {"input": image})
    got = np.frombuffer((scratch.path / "out.bin").read_bytes(), np.float32)
    np.testing.assert_allclose(got, expected.reshape(-1), rtol=1e-4, atol=1e-5)
    await g("release")
    assert g.guest.live() == {"tensor": 0, "graph": 0, "graph-execution-context": 0, "error": 0}


@pytest.mark.parametrize("ty", TYPES)
async def test_every_tensor_type_comes_from_scratch(g: Guest, ty: str) -> None:
    data = bytes(range(24))
    itemsize = {"FP16": 2, "BF16": 2, "FP32": 4, "I32": 4, "FP64": 8, "I64": 8, "U8": 1}[ty]
    await g.write("t.bin", data)
    t = await g.from_scratch("t.bin", [24 // itemsize], ty)
    assert await g("tensor-data", t) == data
    assert await g.ok("to-scratch", t, "copy.bin") == 24
    assert await g("read-file", "copy.bin", 24) == data
    await g("tensor-drop", t)


async def test_a_tensor_is_a_copy_of_the_file(g: Guest) -> None:
    await g.write("x.bin", X.tobytes())
    t = await g.from_scratch("x.bin", [2, 4])
    await g.write("x.bin", (X + 100).tobytes())
    assert np.array_equal(np.frombuffer(await g("tensor-data", t), np.float32), X.reshape(-1))
    await g("tensor-drop", t)


async def test_an_empty_tensor_comes_from_an_empty_file(g: Guest) -> None:
    await g.write("empty", b"")
    t = await g.from_scratch("empty", [0, 4])
    assert await g("tensor-data", t) == b""
    assert await g.ok("to-scratch", t, "empty2") == 0
    await g("tensor-drop", t)


# -- errors ----------------------------------------------------------------------------------
#: Names that are not one plain file name of the scratch directory, and why not.
BAD_NAMES = [
    ("", "is empty"),
    (".", "names a directory"),
    ("..", "names a directory"),
    ("../escape.bin", "path separator"),
    ("sub/x.bin", "path separator"),
    ("/etc/passwd", "path separator"),
    ("..\\x", "path separator"),
    ("nul\0x", "NUL byte"),
    ("n" * 256, "at most 255"),
]


@pytest.mark.parametrize(("name", "why"), BAD_NAMES)
async def test_a_name_that_is_not_a_plain_file_name_is_invalid(
        g: Guest, name: str, why: str) -> None:
    await g.write("x.bin", X.tobytes())
    code, message = await g.err("from-scratch", name, [2, 4], FP32)
    assert (code, why in message) == ("invalid-argument", True), message
    t = await g.from_scratch("x.bin", [2, 4])
    code, message = await g.err("to-scratch", t, name)
    assert (code, why in message) == ("invalid-argument", True)
    await g("tensor-drop", t)
    assert g.guest.live()["error"] == 0


async def test_a_missing_file_is_not_found(g: Guest) -> None:
    code, message = await g.err("from-scratch", "never-written.bin", [2, 4], FP32)
    assert code == "not-found"
    assert "'never-written.bin' does not exist" in message and GUEST_PATH in message


async def test_a_file_of_the_wrong_size_is_invalid(g: Guest) -> None:
    await g.write("short.bin", X.tobytes()[:-4])
    code, message = await g.err("from-scratch", "short.bin", [2, 4], FP32)
    assert code == "invalid-argument"
    assert "is 28 bytes but the tensor needs exactly 32" in message


async def test_a_tensor_over_the_guest_limit_is_too_large(rt: RecordingRuntime) -> None:
    guest, g = await start(rt, limits=GuestLimits(max_tensor_bytes=64))
    async with guest:
        await g.write("big.bin", bytes(68))
        code, message = await g.err("from-scratch", "big.bin", [17], FP32)
        assert code == "too-large"
        assert "68 bytes exceeds this guest's limit of 64" in message
        # A dimension product far beyond any file is refused before the file is looked at.
        code, _ = await g.err("from-scratch", "absent.bin", [1 << 31, 1 << 31], FP32)
        assert code == "too-large"


async def test_scratch_tensors_count_against_the_live_tensor_budget(rt: RecordingRuntime
                                                                    ) -> None:
    guest, g = await start(rt, limits=GuestLimits(max_live_tensor_bytes=48))
    async with guest:
        await g.write("x.bin", X.tobytes())
        t = await g.from_scratch("x.bin", [2, 4])
        code, message = await g.err("from-scratch", "x.bin", [2, 4], FP32)
        assert code == "too-large"
        assert "max_live_tensor_bytes" in message and "48" in message
        await g("tensor-drop", t)
        await g("tensor-drop", await g.from_scratch("x.bin", [2, 4]))  # room again
        # a rank past 32 is refused before the dimensions are multiplied or the file read
        code, message = await g.err("from-scratch", "x.bin", [0xFFFF_FFFF] * 5000, FP32)
        assert code == "invalid-argument"
        assert "5000 dimensions" in message
    assert guest.live()["tensor"] == 0


async def test_links_and_directories_are_refused(g: Guest, tmp_path: Path) -> None:
    scratch = g.guest.scratch
    assert scratch is not None
    outside = tmp_path / "secret.bin"
    outside.write_bytes(X.tobytes())
    os.symlink(outside, scratch.path / "link.bin")
    (scratch.path / "dir").mkdir()
    code, message = await g.err("from-scratch", "link.bin", [2, 4], FP32)
    assert (code, "symbolic link" in message) == ("invalid-argument", True)
    code, message = await g.err("from-scratch", "dir", [2, 4], FP32)
    assert (code, "directory" in message) == ("invalid-argument", True)
    await g.write("x.bin", X.tobytes())
    t = await g.from_scratch("x.bin", [2, 4])
    code, message = await g.err("to-scratch", t, "link.bin")
    assert (code, "symbolic link" in message) == ("invalid-argument", True)
    assert outside.read_bytes() == X.tobytes()  # not written through the link
    code, message = await g.err("to-scratch", t, "dir")
    assert (code, "directory" in message) == ("invalid-argument", True)
    await g("tensor-drop", t)


async def test_guests_do_not_see_each_others_files(rt: RecordingRuntime) -> None:
    first, a = await start(rt)
    second, b = await start(rt)
    async with first, second:
        assert first.scratch is not None and second.scratch is not None
        assert first.scratch.path != second.scratch.path
        await a.write("mine.bin", X.tobytes())
        code, _ = await b.err("from-scratch", "mine.bin", [2, 4], FP32)
        assert code == "not-found"
        assert await b("read-file", "mine.bin", 32) == b""


async def test_a_guest_without_scratch_gets_unsupported_operation(rt: RecordingRuntime) -> None:
    guest, g = await start(rt, scratch=False)
    async with guest:
        assert guest.scratch is None
        assert await g("write-file", "x.bin", b"abc") == 1000  # no /.wasinn-scratch preopen
        code, message = await g.err("from-scratch", "x.bin", [3], TYPES.index("U8"))
        assert (code, "without a scratch directory" in message) == ("unsupported-operation", True)


# -- lifetime --------------------------------------------------------------------------------
async def test_the_directory_is_removed_when_the_guest_ends(rt: RecordingRuntime) -> None:
    guest, g = await start(rt)
    scratch = guest.scratch
    assert scratch is not None
    assert scratch.path.parent == default_base()
    assert scratch.path.stat().st_mode & 0o777 == 0o700
    async with guest:
        await g.write("left-behind.bin", X.tobytes())
        (scratch.path / "sub").mkdir()
        (scratch.path / "sub" / "deeper.bin").write_bytes(b"x")
    assert not scratch.path.exists()
    assert scratch.removed


async def test_the_directory_is_removed_after_a_trap(rt: RecordingRuntime) -> None:
    guest, g = await start(rt)
    scratch = guest.scratch
    assert scratch is not None
    async with guest:
        await g.write("x.bin", X.tobytes())
        with pytest.raises(GuestTrap):
            await g("from-scratch", "x.bin", [2, 4], 99)  # no tensor-type has case 99
    assert not scratch.path.exists()


async def nesting_guest(rt: RecordingRuntime) -> tuple[ComponentGuest, ScratchDir]:
    """A started ``scratch_nest`` guest (its ``nest(n)`` makes n folders, each in the
    last) and its scratch directory."""
    guest = await ComponentGuest.start(rt, (COMPONENTS / "scratch_nest.wat").read_text(),
                                       program="scratch_nest")
    assert guest.scratch is not None
    return guest, guest.scratch


async def test_a_guest_that_nests_folders_deeply_is_closed_cleanly_and_its_directory_removed(
        rt: RecordingRuntime) -> None:
    # 1,200 folders, each in the last: 1,200 entries, well within max_scratch_files.
    # Before, closing the guest raised RecursionError (shutil.rmtree recursed once per
    # level) and left the directory behind, and every later process's sweep died on it.
    guest, scratch = await nesting_guest(rt)
    async with guest:
        assert await guest.call("nest", 1200) == 0
        assert scratch.usage() == Usage(scratch.usage().nbytes, 1200)
        assert (scratch.path / "/".join(["d"] * 1200)).is_dir()
    assert scratch.removed and not scratch.path.exists()


async def test_a_guest_that_nests_folders_past_the_longest_path_is_stopped_saying_so(
        rt: RecordingRuntime) -> None:
    # Its directory cannot be measured past PATH_MAX (4,096 bytes: 2,048 levels of "d/"),
    # which stops it; before, the reason given was only "File name too long".
    guest, scratch = await nesting_guest(rt)
    async with guest:
        with pytest.raises(GuestTrap, match=r"nests folders too deep to be measured \(a "
                                            r"path of \d+ bytes from its top"):
            await guest.call("nest", 2500)
    assert scratch.removed and not scratch.path.exists()


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> list[ScratchDir]:
    """Every ScratchDir the component host makes from now on, in order: a guest that
    never starts leaves no handle to its directory to check."""
    made: list[ScratchDir] = []

    class Recording(ScratchDir):
        def __init__(self) -> None:
            super().__init__()
            made.append(self)

    monkeypatch.setattr(guest_module, "ScratchDir", Recording)
    return made


async def test_the_directory_is_removed_when_instantiation_fails(
        rt: RecordingRuntime, made: list[ScratchDir]) -> None:
    # It asks for the scratch interface (so it gets a directory) and for something the
    # host does not provide (so instantiation fails after the directory exists).
    needs = ('(component (import "wasinn:nn/scratch@0.1.0" (instance))'
             ' (import "no:such/thing" (instance (export "f" (func)))))')
    with pytest.raises(InvalidArgumentError, match="cannot instantiate"):
        await ComponentGuest.start(rt, needs, program="needs-more")
    assert len(made) == 1 and not made[0].path.exists()


async def test_run_component_removes_its_directory(
        rt: RecordingRuntime, made: list[ScratchDir]) -> None:
    with pytest.raises(InvalidArgumentError, match="no wasi:cli/run"):
        await guest_module.run_component(rt, scratch_loop().encode(), program="no-run")
    assert len(made) == 1 and not made[0].path.exists()


# -- ScratchDir on its own -------------------------------------------------------------------
def test_default_base_is_dev_shm_when_present() -> None:
    if SHM.is_dir() and os.access(SHM, os.W_OK | os.X_OK):
        assert default_base() == SHM
    else:
        assert default_base() != SHM


def test_a_scratch_dir_elsewhere_works_and_is_removed_when_collected(tmp_path: Path) -> None:
    scratch = ScratchDir(tmp_path)
    path = scratch.path
    assert path.parent == tmp_path
    assert scratch.write("a", np.arange(3, dtype=np.int32)) == 12
    assert scratch.read("a", 12).view(np.int32).tolist() == [0, 1, 2]
    del scratch
    gc.collect()
    assert not path.exists()


def test_write_tensor_respects_the_limit_and_use_after_remove_fails(tmp_path: Path) -> None:
    scratch = ScratchDir(tmp_path)
    with pytest.raises(TooLargeError, match="100 bytes exceeds this guest's limit of 99"):
        scratch.write_tensor("t", bytes(100), 99)
    assert not (scratch.path / "t").exists()
    scratch.remove()
    scratch.remove()  # idempotent
    with pytest.raises(NotFoundError, match="already removed"):
        scratch.read("t", 0)


def test_read_files_checks_the_total_before_reading_and_copies_in_order(tmp_path: Path) -> None:
    scratch = ScratchDir(tmp_path)
    try:
        scratch.write("a", b"first")
        scratch.write("b", b"second!")
        totals: list[int] = []
        assert scratch.read_files(["b", "a", "b"], totals.append) == [b"second!", b"first",
                                                                      b"second!"]
        assert totals == [19]

        def refuse(total: int) -> None:
            raise TooLargeError(f"{total} bytes: too many")

        with pytest.raises(TooLargeError, match="12 bytes: too many"):
            scratch.read_files(["a", "b"], refuse)
        # A file that changes between its measurement and its reading is refused.
        with pytest.raises(InvalidArgumentError, match="'a' changed from 5 to 6 bytes"):
            scratch.read_files(["a"], lambda total: scratch.write("a", b"longer"))
        with pytest.raises(NotFoundError, match="'absent' does not exist"):
            scratch.read_files(["a", "absent"], totals.append)
        assert totals == [19]  # nothing read past a missing name
    finally:
        scratch.remove()


# -- the WIT ---------------------------------------------------------------------------------
def test_the_scratch_interface_is_declared_and_served(tmp_path: Path) -> None:
    from tests.test_component_wit import declared, served
    from wasinn import wit

    ext = wit.package_dir("wasinn-nn-0.1.0")
    functions = declared(ext, [wit.package_dir("wasi-nn-2024-10-28")], tmp_path)
    assert functions["wasinn:nn/scratch@0.1.0"] == {"tensor-from-scratch", "tensor-to-scratch",
                                                    "load-from-scratch"}
    assert served()["wasinn:nn/scratch@0.1.0"] == functions["wasinn:nn/scratch@0.1.0"]


async def test_guest_without_the_scratch_import_gets_no_directory(rt: Any) -> None:
    from tests.component_guests import shim_1028

    guest = await ComponentGuest.start(rt, shim_1028(), program="shim_1028")
    async with guest:
        assert guest.scratch is None


@contextlib.asynccontextmanager
async def every_slot_held(rt: RecordingRuntime) -> AsyncIterator[Any]:
    """Hold every worker slot of the (one) device until the block ends; yields its actor."""
    graph = await rt.load_by_name("affine")
    ctx = graph.init_execution_context()
    x = np.ones((1, 4), np.float32)
    await ctx.compute({"x": x})  # compiled on the device, so try_lease can hold a slot
    held = []
    while (run := ctx.try_lease({"x": x})) is not None:
        held.append(run)
    (actor,) = rt.actors
    assert held and not actor.slot_free()
    try:
        yield actor
    finally:
        for run in held:
            run.cancel()
    assert actor.slot_free()
    assert (await ctx.compute({"x": x}))["y"].numpy().tolist() == [[3.0] * 4]
    ctx.close()
    await graph.unload()


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
async def test_a_guest_over_its_scratch_quota_is_stopped(rt: RecordingRuntime,
                                                         busy: bool) -> None:
    import trio

    # Each round of `infer` writes the 602,112-byte image to in.bin: over the 100,000-byte
    # limit from the first round, so the host's watcher must stop the (otherwise very long)
    # loop; the test would time out if it did not. On a busy device (every slot held
    # here), the guest's first compute waits in trio, queued: the watcher must stop the
    # guest there while the slots are still held, not once one frees (none would).
    async with contextlib.AsyncExitStack() as stack:
        actor = await stack.enter_async_context(every_slot_held(rt)) if busy else None
        guest, g = await start(rt, limits=GuestLimits(max_scratch_bytes=100_000))
        async with guest:
            image = sample_image(seed=4)
            assert await g("fill", image.tobytes()) == image.nbytes
            assert await g("prepare", "mobilenet") == 0
            with trio.fail_after(30), pytest.raises(GuestTrap, match=r"over the limit of 100000"):
                await g("infer", 1 if busy else 1_000_000, list(IMAGE_SHAPE))
        if actor is not None:
            assert actor.queued == 0  # its request left the queue
            assert not actor.slot_free()  # stopped while every slot was still held
    assert guest.scratch is not None and guest.scratch.removed
    assert guest.live() == {"tensor": 0, "graph": 0, "graph-execution-context": 0, "error": 0}


def test_usage_counts_every_entry_at_any_depth(tmp_path: Path) -> None:
    scratch = ScratchDir(tmp_path)
    try:
        (scratch.path / "a.bin").write_bytes(bytes(10_000))
        (scratch.path / "sub").mkdir()
        (scratch.path / "sub" / "b.bin").write_bytes(bytes(20_000))
        os.symlink("/etc/hostname", scratch.path / "link")  # counted, not followed
        usage = scratch.usage()
        assert usage.entries == 4
        assert 30_000 <= usage.nbytes < 60_000
        # The scan stops early past a bound, so measuring cannot be made slow.
        assert scratch.usage(max_entries=2).entries == 3
    finally:
        scratch.remove()


async def test_short_calls_over_the_quota_are_caught_when_they_return(
        rt: RecordingRuntime) -> None:
    # Each write-file call is shorter than the watcher's poll interval: the check at the
    # end of every call must catch the first one that goes over.
    guest, g = await start(rt, limits=GuestLimits(max_scratch_bytes=200_000))
    async with guest:
        await g.write("a.bin", bytes(90_000))
        await g.write("b.bin", bytes(90_000))
        with pytest.raises(GuestTrap, match=r"over the limit of 200000"):
            await g.write("c.bin", bytes(90_000))
        # The guest stays stopped, and says why, on every later call.
        with pytest.raises(GuestTrap, match=r"max_scratch_bytes"):
            await g.write("d.bin", b"x")


async def test_many_small_files_hit_the_entry_limit(rt: RecordingRuntime) -> None:
    guest, g = await start(rt, limits=GuestLimits(max_scratch_files=3))
    async with guest:
        for name in ("a", "b", "c"):
            await g.write(name, b"x")
        with pytest.raises(GuestTrap, match=r"more than 3 entries"):
            await g.write("d", b"x")


async def test_tensor_to_scratch_refuses_to_grow_past_the_quota(rt: RecordingRuntime) -> None:
    image = sample_image(seed=5)  # 602,112 bytes: a whole number of 4 KiB blocks
    guest, g = await start(rt, limits=GuestLimits(max_scratch_bytes=1_000_000))
    async with guest:
        await g.write("in.bin", image.tobytes())
        t = await g.from_scratch("in.bin", list(IMAGE_SHAPE))
        # A second copy would bring the directory to 1,204,224 bytes: refused up front.
        code, message = await g.err("to-scratch", t, "copy.bin")
        assert code == "too-large" and "max_scratch_bytes" in message
        assert not (guest.scratch.path / "copy.bin").exists()  # type: ignore[union-attr]
        await g("tensor-drop", t)


@pytest.mark.parametrize(("limits", "refused"), [
    (GuestLimits(max_scratch_bytes=64 * 1024),
     r"would hold \d+ bytes, over the limit of 65536 \(\[guests\] max_scratch_bytes\)"),
    (GuestLimits(max_scratch_files=2),
     r"would hold more than 2 entries \(\[guests\] max_scratch_files\)"),
], ids=["bytes", "entries"])
async def test_tensor_to_scratch_over_a_file_counts_the_file_as_replaced(
        rt: RecordingRuntime, limits: GuestLimits, refused: str) -> None:
    # Before, the file written over was counted as if it stayed, and the write as one
    # entry more: a guest writing each output to the same file was refused once its
    # directory passed half its bytes (or reached its entries), told of a size never held.
    data = np.arange(6144, dtype=np.float32)  # 24 KiB: a whole number of 4 KiB blocks
    guest, g = await start(rt, limits=limits)
    async with guest:
        scratch = guest.scratch
        assert scratch is not None
        await g.write("in.bin", data.tobytes())
        t = await g.from_scratch("in.bin", [6144])
        for _ in range(3):  # 48 KiB of 64 KiB, 2 entries of 2, each time
            assert await g.ok("to-scratch", t, "out.bin") == data.nbytes
            usage = scratch.usage()
            assert usage.entries == 2 and usage.nbytes <= 64 * 1024
        code, message = await g.err("to-scratch", t, "third.bin")  # a new file does not fit
        assert code == "too-large"
        assert re.search(f"writing 24576 bytes to 'third.bin': its scratch directory {refused}",
                         message), message
        assert not (scratch.path / "third.bin").exists()
        await g("tensor-drop", t)


def test_replaced_says_what_a_write_over_a_name_replaces(tmp_path: Path) -> None:
    scratch = ScratchDir(tmp_path)
    try:
        assert scratch.replaced("absent.bin") == (Usage(0, 0), 0)  # a new file
        scratch.write("a.bin", bytes(8192))
        old, names = scratch.replaced("a.bin")
        assert (old.entries, names) == (1, 1) and old.nbytes == scratch.usage().nbytes
        # A hard link's bytes are counted under each of its names, and a write over one
        # changes both: the caller counts them for each name.
        os.link(scratch.path / "a.bin", scratch.path / "b.bin")
        assert scratch.replaced("a.bin") == (old, 2)
        (scratch.path / "dir").mkdir()
        os.symlink("a.bin", scratch.path / "link.bin")
        with pytest.raises(InvalidArgumentError, match="'dir' is a directory"):
            scratch.replaced("dir")
        with pytest.raises(InvalidArgumentError, match=r"'link\.bin' is a symbolic link"):
            scratch.replaced("link.bin")
        with pytest.raises(InvalidArgumentError, match="path separator"):
            scratch.replaced("dir/a.bin")
    finally:
        scratch.remove()


def test_tensor_to_scratch_over_a_hard_link_counts_the_new_bytes_under_each_name(
        tmp_path: Path) -> None:
    from wasinn.host.component.service import NNService

    scratch = ScratchDir(tmp_path)
    svc = NNService(None, None, GuestLimits(max_scratch_bytes=22 * 1024),  # type: ignore[arg-type]
                    scratch=scratch)
    ones = b"\x5a" * 12288  # (not zeros, which a file system may store as holes)
    try:
        scratch.write("a.bin", ones[:8192])
        os.link(scratch.path / "a.bin", scratch.path / "b.bin")  # 16 KiB as measured
        same = svc.tensor_new([8192], "U8", ones[:8192])
        assert svc.tensor_to_scratch(same, "a.bin") == 8192
        # 12 KiB under each name: 24 KiB (counted once, it would seem to fit in 20 KiB).
        bigger = svc.tensor_new([12288], "U8", ones)
        with pytest.raises(TooLargeError, match=r"would hold \d+ bytes, over the limit of "
                                                r"22528"):
            svc.tensor_to_scratch(bigger, "a.bin")
        assert scratch.usage().entries == 2
    finally:
        scratch.remove()


# -- files unlinked but kept open ----------------------------------------------------------
class Unlinker:
    """scratch_unlink: a guest that unlinks its scratch file and writes on through the
    descriptor it kept open; every call must return 0 (success)."""

    def __init__(self, guest: ComponentGuest) -> None:
        self.guest = guest

    async def __call__(self, name: str, *args: Any) -> None:
        code = await self.guest.call(name, *args)
        assert code == 0, f"{name}{args} failed with {code} (1 + wasi:filesystem error-code)"

    async def hidden_file(self, name: str, size: int, rounds: int = 1) -> None:
        """Create scratch file ``name``, unlink it, then write ``rounds`` x ``size`` bytes."""
        await self("create", name)
        await self("unlink", name)
        await self("append", size, rounds)


async def start_unlinker(rt: Any, max_scratch_bytes: int) -> tuple[ComponentGuest, Unlinker]:
    guest = await ComponentGuest.start(
        rt, (COMPONENTS / "scratch_unlink.wat").read_text(), program="scratch_unlink",
        limits=GuestLimits(max_scratch_bytes=max_scratch_bytes))
    return guest, Unlinker(guest)


async def test_a_file_unlinked_but_kept_open_counts_against_the_quota(
        rt: RecordingRuntime) -> None:
    guest, u = await start_unlinker(rt, max_scratch_bytes=1_000_000)
    async with guest:
        scratch = guest.scratch
        assert scratch is not None
        await u.hidden_file("hidden.bin", 262_144, rounds=3)
        assert list(scratch.path.iterdir()) == []  # nothing a directory listing can see
        assert scratch.usage().nbytes >= 3 * 262_144
        # A fourth write through the kept descriptor brings it to 1,048,576 bytes.
        with pytest.raises(GuestTrap, match=r"holds \d+ bytes, over the limit of 1000000"):
            await u("append", 262_144, 1)
        with pytest.raises(GuestTrap, match=r"max_scratch_bytes"):
            await u("close")
    assert scratch.removed


async def test_a_file_unlinked_and_closed_is_not_counted(rt: RecordingRuntime) -> None:
    guest, u = await start_unlinker(rt, max_scratch_bytes=1_000_000)
    async with guest:
        scratch = guest.scratch
        assert scratch is not None
        await u.hidden_file("a.bin", 262_144, rounds=3)
        await u("close")
        assert scratch.usage() == Usage(0, 0)
        # Both files together would be over the limit: only the open one counts.
        await u.hidden_file("b.bin", 262_144, rounds=3)
        assert scratch.usage().nbytes >= 3 * 262_144
        await u("close")


def _hidden(directory: Path, name: str, nbytes: int) -> int:
    """A descriptor of a file of ``nbytes`` written in ``directory`` and then unlinked."""
    fd = os.open(directory / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.unlink(directory / name)
    os.write(fd, bytes(nbytes))
    return fd


def test_usage_counts_unlinked_open_files_of_this_directory_only(tmp_path: Path) -> None:
    scratch, other = ScratchDir(tmp_path), ScratchDir(tmp_path)
    sibling = Path(f"{scratch.path}-sibling")  # the same prefix, another directory
    sibling.mkdir()
    (scratch.path / "sub").mkdir()
    fds = [_hidden(scratch.path / "sub", "mine.bin", 40_000),
           _hidden(other.path, "theirs.bin", 80_000),
           _hidden(sibling, "beside.bin", 80_000)]
    fds.append(os.open(f"/proc/self/fd/{fds[0]}", os.O_RDONLY))  # the same file twice
    try:
        usage = scratch.usage()
        assert usage.entries == 2  # sub/ and the unlinked file, once
        assert 40_000 <= usage.nbytes < 80_000
        for fd in fds:
            os.close(fd)
        assert scratch.usage().entries == 1
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        scratch.remove()
        other.remove()


def test_usage_without_proc_counts_what_it_sees_and_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(scratch_module, "PROC_FD", str(tmp_path / "no-proc"))  # new: not warned yet
    scratch = ScratchDir(tmp_path)
    fd = _hidden(scratch.path, "unseen.bin", 40_000)
    try:
        (scratch.path / "seen.bin").write_bytes(bytes(10_000))
        with caplog.at_level(logging.WARNING, logger="wasinn.host.component"):
            usage = scratch.usage()
            scratch.usage()
        assert usage.entries == 1 and 10_000 <= usage.nbytes < 40_000
        (warning,) = caplog.messages  # said once, not on every measurement
        assert "no-proc" in warning and "unlinked" in warning and "not counted" in warning
    finally:
        os.close(fd)
        scratch.remove()
