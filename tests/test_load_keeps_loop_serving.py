"""Loading a big model leaves the event loop serving other requests.

ONNX Runtime's binding holds the GIL while it copies a model given as bytes (0.3 to 1.1 s
for 512 MB, during which no Python code of any thread runs, the trio loop's included),
and releases it while it parses and builds the session. wasinn has it read the model from
a pipe instead (:mod:`wasinn.backends._model_pipe`), with the GIL released.

No wall-time assertion: the stall of a copy can only be seen with a clock. The binding's
session constructor is wrapped instead, to see what it was given (a file's name, never
the bytes) and how far a trio heartbeat and another model's requests got between its
start and its end (they must have moved: the loop served while the model was read).

``torch.jit.load`` holds the GIL throughout, from bytes or from a file, but copies bytes
twice first: it is given a sealed private file in memory, which the loop is seen to serve
while it is written (its size seen between 0 and the model's). A sandboxed model's bytes
are copied into the memory its process maps, and that memory is given back after its
load, with the GIL released: the loop is seen to run while the copy is half done (the
arena's first quarter written, its last not yet), and while the pages are given back
(the file's blocks seen between full and none, more than once).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
import trio

import wasinn
from tests.backend_models import scripted
from tests.support import cpu_pool, require_backend
from wasinn import InvalidEncodingError, Tensor, TensorType
from wasinn.backends import Device, LoadOptions
from wasinn.backends._model_pipe import piped
from wasinn.backends._sandbox_wire import Arena, read_request, request
from wasinn.modelgen import affine_onnx, onnx_model_bytes

#: Big enough that reading it takes tens of milliseconds on a fast machine, small enough
#: for a shared CI machine's memory.
BIG_MB = 64
#: Loads of the big model tried before the test gives up on seeing the loop move: a
#: loaded machine may leave the loop's thread unscheduled through one build.
ATTEMPTS = 3
#: Where a pipe can be named by a path (``/proc/self/fd``); elsewhere the bytes go as before.
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="a pipe is named by /proc/self/fd on Linux only")


@pytest.fixture
def _ort() -> None:
    require_backend("onnxruntime")


def big_matmul_onnx(mb: int) -> bytes:
    """``y = x @ W``, x (1, 1024) f32, with W an initializer of ``mb`` MiB."""
    from onnx import TensorProto, helper, numpy_helper

    columns = mb * 2**20 // 4 // 1024
    weight = numpy_helper.from_array(np.full((1024, columns), 0.5, np.float32), "W")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1024])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, columns])
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "big",
                              [x], [y], initializer=[weight])
    return onnx_model_bytes(graph)


class Watch:
    """What a trio heartbeat and another model's requests did while ONNX Runtime's session
    constructor ran (``during``: one (beats, requests) pair per constructor call)."""

    def __init__(self) -> None:
        self.beats = 0
        self.requests = 0
        self.during: list[tuple[int, int]] = []
        #: Whether each call was given a file's name (else the model's bytes).
        self.from_file: list[bool] = []

    def wrap(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Wraps the binding's ``InferenceSession``, which takes the model and parses it
        (ONNX Runtime's Python ``InferenceSession`` looks it up as it builds a session)."""
        from onnxruntime.capi import _pybind_state

        constructor = _pybind_state.InferenceSession

        def watched(*args: Any) -> Any:
            self.from_file.append(args[2])  # (options, model, is_arg_file_name, ...)
            beats, requests = self.beats, self.requests
            try:
                return constructor(*args)
            finally:
                self.during.append((self.beats - beats, self.requests - requests))

        monkeypatch.setattr(_pybind_state, "InferenceSession", watched)

    async def heartbeat(self) -> None:
        while True:
            self.beats += 1
            await trio.sleep(0)

    async def serve(self, graph: wasinn.Graph) -> None:
        """Another model's requests, one after the other."""
        x = np.ones((1, 4), np.float32)
        while True:
            out = await graph.compute({"x": x})
            assert out["y"].numpy().tolist() == [[3.0] * 4]
            self.requests += 1


@linux_only
@pytest.mark.usefixtures("_ort")
async def test_onnx_runtime_reads_a_big_model_from_a_file_while_the_loop_serves_others(
        monkeypatch: pytest.MonkeyPatch) -> None:
    watch = Watch()
    big = big_matmul_onnx(BIG_MB)
    async with wasinn.Runtime(cpu_pool(workers=2)) as rt, trio.open_nursery() as nursery:
        small = await rt.load([affine_onnx()], encoding="onnx", target="cpu")
        nursery.start_soon(watch.heartbeat)
        nursery.start_soon(watch.serve, small)
        watch.wrap(monkeypatch)
        for attempt in range(ATTEMPTS):
            graph = await rt.load([big], encoding="onnx", target="cpu", name=f"big{attempt}")
            out = await graph.compute({"x": np.ones((1, 1024), np.float32)})
            assert out["y"].numpy()[0, :3].tolist() == [512.0] * 3
            await graph.unload()
            if any(beats and requests for beats, requests in watch.during):
                break
        nursery.cancel_scope.cancel()
    assert watch.from_file, "ONNX Runtime built no session"
    assert all(watch.from_file), (
        "ONNX Runtime's binding was given the model's bytes, which it copies holding the GIL")
    assert any(beats and requests for beats, requests in watch.during), (
        f"while ONNX Runtime read a {BIG_MB} MB model and built its session (each of "
        f"{len(watch.during)} times), the loop's heartbeat moved "
        f"{[b for b, _ in watch.during]} times and another model's requests "
        f"{[r for _, r in watch.during]}: the build held the GIL")


@linux_only
@pytest.mark.usefixtures("_ort")
def test_an_onnx_runtime_error_names_the_models_bytes_not_the_pipe() -> None:
    from wasinn.backends._ort_session import MODEL_BYTES
    from wasinn.backends.onnxruntime import OnnxRuntimeBackend

    no_graph = b"\x08\x07"  # ModelProto.ir_version = 7, and nothing more
    with pytest.raises(InvalidEncodingError) as caught:
        OnnxRuntimeBackend().load([no_graph], wasinn.GraphEncoding.ONNX, Device.parse("cpu"))
    assert "/proc/self/fd" not in caught.value.message
    assert MODEL_BYTES in caught.value.message


@pytest.mark.usefixtures("_ort")
def test_without_proc_self_fd_the_model_goes_as_bytes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Not Linux (no /proc/self/fd to name the pipe by): built as before, from the bytes.
    from wasinn.backends.onnxruntime import OnnxRuntimeBackend

    isdir = os.path.isdir
    monkeypatch.setattr(os.path, "isdir", lambda p: p != "/proc/self/fd" and isdir(p))
    watch = Watch()
    watch.wrap(monkeypatch)
    graph = OnnxRuntimeBackend().load([affine_onnx()], wasinn.GraphEncoding.ONNX,
                                      Device.parse("cpu"), LoadOptions())
    out = graph.run({"x": wasinn.Tensor.from_numpy(np.ones((1, 4), np.float32))})
    assert out["y"].numpy().tolist() == [[3.0] * 4]
    assert watch.from_file == [False]


@pytest.mark.usefixtures("_ort")
def test_a_sandbox_process_gives_onnx_runtime_the_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    # Its stall holds up only its own graph, and its confinement need not allow the path.
    from wasinn.backends import _ort_session
    from wasinn.backends.onnxruntime import OnnxRuntimeBackend

    monkeypatch.setattr(_ort_session, "in_sandbox", lambda: True)
    watch = Watch()
    watch.wrap(monkeypatch)
    graph = OnnxRuntimeBackend().load([affine_onnx()], wasinn.GraphEncoding.ONNX,
                                      Device.parse("cpu"), LoadOptions())
    out = graph.run({"x": wasinn.Tensor.from_numpy(np.ones((1, 4), np.float32))})
    assert out["y"].numpy().tolist() == [[3.0] * 4]
    assert watch.from_file == [False]


@linux_only
@pytest.mark.parametrize("read", [0, 10], ids=["never-opened", "read-in-part"])
def test_a_pipe_its_reader_left_ends_its_writer_even_where_sigpipe_kills(read: int) -> None:
    # ONNX Runtime stops reading a model it cannot parse, or never opens it (an error
    # before): the writing thread, in a process that leaves SIGPIPE at its default action
    # (which ends the process), must end with EPIPE, not take the process with it.
    code = f"""
        import signal, threading
        from wasinn.backends._model_pipe import piped
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        with piped(bytes(8 << 20), "feeder") as path:
            if {read}:
                with open(path, "rb") as f:
                    assert f.read({read}) == bytes({read})
        print(path.startswith("/proc/self/fd/"),
              [t.name for t in threading.enumerate() if t.name == "feeder"])
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert done.stdout.split() == ["True", "[]"]


@linux_only
@pytest.mark.parametrize("size", [100, 3 << 20], ids=["in-its-buffer", "past-its-buffer"])
def test_a_pipe_read_to_its_end_holds_the_bytes(size: int) -> None:
    data = np.random.default_rng(0).bytes(size)
    with piped(data, "feeder") as path:
        assert path is not None
        with open(path, "rb") as f:
            assert f.read() == data


# -- TorchScript: a sealed file in memory instead of a BytesIO ----------------------------------
@pytest.fixture
def _torch() -> None:
    require_backend("torch")


def big_matmul_torchscript(mb: int) -> bytes:
    """``x @ W`` as TorchScript, x (1, 1024) f32, with W a parameter of ``mb`` MiB."""
    import torch

    class MatMul(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            columns = mb * 2**20 // 4 // 1024
            self.w = torch.nn.Parameter(torch.full((1024, columns), 0.5), requires_grad=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.w

    return scripted(MatMul())


class TorchArchives:
    """What ``torch.jit.load`` gave torch's importer (``given``: ``("file", its content
    is the model's, it is sealed against writes)`` or ``("bytes", ...)``, one per load).
    torch.jit.load looks both importers up on ``torch._C`` as it runs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, data: bytes) -> None:
        import torch

        self.given: list[tuple[str, bool, bool]] = []
        from_file, from_buffer = torch._C.import_ir_module, torch._C.import_ir_module_from_buffer

        def file(cu: Any, path: str, *rest: Any) -> Any:
            with open(path, "rb") as f:
                same = f.read() == data
            seals = fcntl.fcntl(int(path.removeprefix("/proc/self/fd/")), fcntl.F_GET_SEALS)
            self.given.append(("file", same, bool(seals & fcntl.F_SEAL_WRITE)))
            return from_file(cu, path, *rest)

        def buffer(cu: Any, buffer: bytes, *rest: Any) -> Any:
            self.given.append(("bytes", buffer == data, False))
            return from_buffer(cu, buffer, *rest)

        monkeypatch.setattr(torch._C, "import_ir_module", file)
        monkeypatch.setattr(torch._C, "import_ir_module_from_buffer", buffer)


def _memory_file_sizes() -> list[int]:
    """The sizes of this process's open TorchScript files in memory."""
    sizes = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # (closed meanwhile)
            if "memfd:wasinn-torchscript" in os.readlink(f"/proc/self/fd/{fd}"):
                sizes.append(os.stat(f"/proc/self/fd/{fd}").st_size)
    return sizes


@linux_only
@pytest.mark.usefixtures("_torch")
async def test_torchscript_is_read_from_a_sealed_file_in_memory_written_while_the_loop_serves(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: torch.jit.load was given a BytesIO, whose bytes it copies twice holding the
    # GIL (a 64 MB model stopped the loop 140-240 ms, against 45-65 ms from a file).
    big = big_matmul_torchscript(BIG_MB)
    archives = TorchArchives(monkeypatch, big)
    sizes: set[int] = set()

    async def watch() -> None:
        while True:
            sizes.update(_memory_file_sizes())
            await trio.sleep(0)

    def half_written() -> bool:
        return any(0 < size < len(big) for size in sizes)

    async with wasinn.Runtime(cpu_pool(workers=2)) as rt, trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        for attempt in range(ATTEMPTS):
            graph = await rt.load([big], encoding="pytorch", target="cpu", name=f"big{attempt}")
            out = await graph.compute({"x": np.ones((1, 1024), np.float32)})
            assert out["output"].numpy()[0, :3].tolist() == [512.0] * 3
            await graph.unload()
            if half_written():
                break
        nursery.cancel_scope.cancel()
    assert archives.given, "torch.jit.load imported nothing"
    assert set(archives.given) == {("file", True, True)}, (
        f"torch was given {archives.given} (what, the model's bytes, sealed): expected a "
        "sealed file holding the model's bytes, never the bytes, which it copies holding "
        "the GIL")
    assert half_written(), (
        f"the loop saw the TorchScript file only at sizes {sorted(sizes)} (the model: "
        f"{len(big)} bytes): it did not run while the file was written")
    assert _memory_file_sizes() == [], "a TorchScript file in memory outlived its load"


def _memfd_refused(*args: Any) -> int:
    raise PermissionError(errno.EPERM, "Operation not permitted")  # (a seccomp filter's)


def _memfd_full(*args: Any) -> None:
    raise OSError(errno.ENOMEM, "Cannot allocate memory")


@pytest.mark.usefixtures("_torch")
@pytest.mark.parametrize("why", ["in-a-sandbox-process", "no-memfd", "memfd-refused",
                                 "memfd-full"])
def test_torchscript_goes_as_bytes_where_no_file_in_memory_is_wanted_or_had(
        monkeypatch: pytest.MonkeyPatch, why: str) -> None:
    # A sandbox process's stall holds up only its own graph, and its confinement need not
    # allow the file's path; elsewhere than on Linux, or where the system refuses a
    # memfd, torch gets the bytes as before.
    import torch

    from wasinn.backends import _model_pipe, _torch_script
    from wasinn.backends.pytorch import TorchBackend

    if why == "in-a-sandbox-process":
        monkeypatch.setattr(_torch_script, "in_sandbox", lambda: True)
    elif why == "no-memfd":
        monkeypatch.delattr(os, "memfd_create", raising=False)
    elif why == "memfd-refused":
        monkeypatch.setattr(os, "memfd_create", _memfd_refused)
    else:
        monkeypatch.setattr(_model_pipe, "_write", _memfd_full)

    class Twice(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    data = scripted(Twice())
    archives = TorchArchives(monkeypatch, data)
    graph = TorchBackend().load([data], wasinn.GraphEncoding.PYTORCH, Device.parse("cpu"))
    try:
        out = graph.run({"x": wasinn.Tensor.from_numpy(np.ones((1, 4), np.float32))})
        assert out["output"].numpy().tolist() == [[2.0] * 4]
    finally:
        graph.close()
    assert archives.given == [("bytes", True, False)]


# -- a sandboxed model's bytes: copied into its process's memory, which is given back -----------
def _arena_of(size: int) -> tuple[Arena, mmap.mmap]:
    """An arena of ``size`` bytes, and a mapping of it of the test's own to watch it by."""
    arena = Arena.create(size)
    return arena, mmap.mmap(arena.fd, size, prot=mmap.PROT_READ)


async def test_a_sandboxed_models_bytes_are_copied_for_its_process_while_the_loop_runs() -> None:
    # Before: the host copied them by a memoryview's assignment, which holds the GIL: the
    # loop never ran while a copy was under way (a 256 MB model stopped it 0.2-0.5 s).
    size = BIG_MB << 20
    arena, watched = _arena_of(size)
    half_done = []
    try:
        for attempt in range(ATTEMPTS):
            fill = attempt + 1  # (each attempt writes other bytes over the last one's)
            model = Tensor.from_bytes([size], TensorType.U8, bytes([fill]) * size)

            async def watch(fill: int = fill) -> None:
                while True:
                    if watched[size // 4] == fill and watched[size - size // 4] != fill:
                        half_done.append(fill)  # (its first quarter written, not its last)
                    await trio.sleep(0)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch)
                header = await trio.to_thread.run_sync(request, arena, "load", {"0": model})
                nursery.cancel_scope.cancel()
            # The process reads the model's bytes as they were given.
            child = Arena.attach(os.dup(arena.fd))
            _, tensors, _ = read_request(child, header)
            assert tensors["0"].dims == (size,) and (tensors["0"].numpy() == fill).all()
            del tensors
            child.close()
            if half_done:
                break
    finally:
        watched.close()
        arena.close()
    assert half_done, (
        f"in {ATTEMPTS} copies of a {BIG_MB} MB model into a sandbox arena, the loop never "
        "ran while one was under way: the copy held the GIL")


@linux_only
async def test_a_sandbox_arena_gives_its_pages_back_while_the_loop_runs() -> None:
    # Before: by mmap's madvise(MADV_REMOVE), which holds the GIL (a 256 MB model's pages,
    # given back after its load, stopped the loop 60-110 ms): the loop never saw the file
    # part-freed, but for one fstat begun before the madvise.
    size = BIG_MB << 20
    arena, watched = _arena_of(size)
    part_freed: set[int] = set()
    try:
        for _ in range(ATTEMPTS):
            np.frombuffer(arena.view(0, size), np.uint8)[:] = 1
            full = os.fstat(arena.fd).st_blocks

            async def watch(full: int = full) -> None:
                while True:
                    blocks = os.fstat(arena.fd).st_blocks
                    if 0 < blocks < full:
                        part_freed.add(blocks)
                    await trio.sleep(0)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch)
                await trio.to_thread.run_sync(arena.release)
                nursery.cancel_scope.cancel()
            assert os.fstat(arena.fd).st_blocks == 0
            assert (watched[0], watched[size // 2], watched[size - 1]) == (0, 0, 0)
            assert os.fstat(arena.fd).st_size == arena.size == size
            if len(part_freed) >= 2:
                break
    finally:
        watched.close()
        arena.close()
    assert len(part_freed) >= 2, (
        f"while a {BIG_MB} MB arena gave its pages back ({ATTEMPTS} times), the loop saw "
        f"its file part-freed {len(part_freed)} times: the release held the GIL")
