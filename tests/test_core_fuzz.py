"""Hostile guests on the legacy ABI (``wasi_ephemeral_nn``), through real wasm.

One WAT harness (``tests/wat/nn_harness.wat``) exports a thin wrapper around each import,
so that a test calls the ABI from Python with any arguments, in a trio worker thread as
a guest's own thread would. A seeded fuzz runs a few hundred random call sequences with
hostile arguments (pointers and lengths at and past the end of memory, u32 wrap-around,
closed and made-up handles, malformed tensor records and builder arrays, memory grown
between calls) and checks after every call that the guest got an errno of the documented
set, that the host logged no bug and no runaway message, and that the guest's handle
tables match what it was told; after each sequence, that unload / finalize leave the
tables empty; at the end, that the runtime holds no graph and no extra thread. The tests
after it pin each defect the fuzz (or a review of its inputs) found.
"""

from __future__ import annotations

import functools
import logging
import random
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import wasmtime

import wasinn
from tests.backend_models import two_outputs
from tests.guest_support import WAT_DIR, sub_onnx
from tests.support import require_backend
from wasinn import TensorType
from wasinn.configs.loader import parse_config
from wasinn.host.core_bindings import check_imports, define_nn
from wasinn.host.engine import shared_engine
from wasinn.host.guest_memory import MAX_NAME_BYTES
from wasinn.host.guest_thread import GuestPortal
from wasinn.host.interrupt import Interrupter
from wasinn.host.limits import GuestLimits
from wasinn.host.nn_core import GuestNN
from wasinn.modelgen import identity_onnx

SUCCESS, INVALID_ARGUMENT, INVALID_ENCODING, TOO_LARGE, NOT_FOUND = 0, 1, 2, 7, 8
END_OF_SEQUENCE = 100
#: wit/wasinn_ephemeral_nn.witx: the enum, end_of_sequence and model_not_found.
DOCUMENTED = frozenset({*range(9), 100, 103})
U32 = 0xFFFFFFFF
PAGE = 0x10000

MODELS = {
    "identity": lambda: identity_onnx(TensorType.F32),                      # f32 (n, 4)
    "identity_static": lambda: identity_onnx(TensorType.F32, shape=(1, 4)),
    "dyn3": lambda: identity_onnx(TensorType.F32, shape=("a", "b", "c")),
    "big": lambda: identity_onnx(TensorType.F32, shape=(65536, 65536)),   # 16 GiB output
    "sub": sub_onnx,                                                        # y = a - b
    "pair": lambda: two_outputs("onnxruntime")[0][0],                       # a = x, b = -x
}
#: Per model: the record (lay_out's) that fits its inputs, and how many inputs it has.
GOOD_INPUTS = {"identity": (0, 1), "identity_static": (0, 1), "dyn3": (2, 1), "big": (0, 0),
               "sub": (0, 2), "pair": (0, 1)}


@pytest.fixture(scope="module")
def nn_config(tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp("fuzz-models")
    models = {}
    for name, make in MODELS.items():
        (folder / f"{name}.onnx").write_bytes(make())
        models[name] = {"files": [str(folder / f"{name}.onnx")], "encoding": "onnx"}
    return parse_config({"models": models}, None, label="fuzz config")


@pytest.fixture
async def rt(nn_config: Any):  # type: ignore[no-untyped-def]
    require_backend("onnxruntime")
    async with wasinn.Runtime(nn_config) as runtime:
        yield runtime


@functools.cache
def _harness() -> wasmtime.Module:
    module = wasmtime.Module(shared_engine(), (WAT_DIR / "nn_harness.wat").read_text())
    check_imports(module, "nn_harness.wat")  # every import as wasinn defines it
    return module


class Guest:
    """One instance of the harness with its own GuestNN (see the module docstring)."""

    def __init__(self, nn: GuestNN) -> None:
        engine = shared_engine()
        self.nn = nn
        self.store = wasmtime.Store(engine)
        Interrupter(engine).install(self.store)
        linker = wasmtime.Linker(engine)
        define_nn(linker, nn, lambda: None)
        exports = linker.instantiate(self.store, _harness()).exports(self.store)
        self._exports = exports
        memory = exports["memory"]
        assert isinstance(memory, wasmtime.Memory)
        self.memory = memory

    def call(self, name: str, *args: int) -> int:
        """The export ``name`` with ``args`` read as u32 (wasm takes them as i32)."""
        func = self._exports[name]
        assert isinstance(func, wasmtime.Func)
        result = func(self.store, *[((a & U32) ^ 0x80000000) - 0x80000000 for a in args])
        assert isinstance(result, int)
        return result & U32

    @property
    def size(self) -> int:
        return self.memory.data_len(self.store)

    def write(self, at: int, data: bytes) -> None:
        self.memory.write(self.store, data, at)

    def read(self, at: int, length: int) -> bytes:
        return bytes(self.memory.read(self.store, at, at + length))

    def u32(self, at: int) -> int:
        return int(struct.unpack("<I", self.read(at, 4))[0])

    def name(self, at: int, text: str | bytes) -> tuple[int, int]:
        raw = text.encode() if isinstance(text, str) else text
        self.write(at, raw)
        return at, len(raw)

    def record(self, at: int, dims: list[int], type_field: int, data_ptr: int,
               data_len: int) -> int:
        """A tensor record at ``at``, its dimensions right after it."""
        dims_ptr = at + 20
        self.write(dims_ptr, struct.pack(f"<{len(dims)}I", *dims))
        self.write(at, struct.pack("<5I", dims_ptr, len(dims), type_field, data_ptr, data_len))
        return at

    def load_by_name(self, name: str, out: int = 0x10) -> int:
        assert self.call("load_by_name", *self.name(0x100, name), out) == SUCCESS
        return self.u32(out)

    def context(self, graph: int, out: int = 0x14) -> int:
        assert self.call("init_execution_context", graph, out) == SUCCESS
        return self.u32(out)


class HostLog(logging.Handler):
    """Every record of wasinn's loggers while a test runs (DEBUG and up)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, level: int = logging.DEBUG) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= level]

    def said(self, text: str) -> bool:
        """Whether some message contains ``text``."""
        return any(text in m for m in self.messages())

    def bugs(self) -> list[str]:
        """What was logged as an error: a host bug (turned into runtime_error), or worse."""
        return self.messages(logging.ERROR)


@pytest.fixture
def host_log() -> Iterator[HostLog]:
    logger = logging.getLogger("wasinn")
    handler, level = HostLog(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


async def in_guest(rt: wasinn.Runtime, body: Callable[[Guest], None],
                   limits: GuestLimits | None = None) -> None:
    """``body`` on a fresh harness instance, in a worker thread; its graphs and contexts
    are released afterwards as the runner does."""
    nn = GuestNN(rt, GuestPortal(), limits)
    try:
        await trio.to_thread.run_sync(lambda: body(Guest(nn)))
    finally:
        await nn.release()


def wasinn_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("wasinn "))


# -- the fuzz ---------------------------------------------------------------------------
SEED = 20240917
SEQUENCES = 300
CALLS = 14
LIMITS = GuestLimits(max_graphs=4, max_contexts=6)
# Where lay_out puts things: u32 result slots, names, tensor records (0x400-0x8a0), graph
# builder arrays, input data, a model's bytes, output buffers, a long name.
SCRATCH = 0x10  # 16 u32 result slots from here
BUILDERS_AT = 0xC00
DATA_AT = 0x1000
MODEL_AT = 0x2000
LONG_NAME = 0x6000


@dataclass
class Fixtures:
    """What the fuzz writes into a fresh harness: addresses of good and bad arguments."""

    names: list[tuple[int, int]] = field(default_factory=list)
    records: list[int] = field(default_factory=list)
    builders: list[tuple[int, int]] = field(default_factory=list)
    buffers: list[int] = field(default_factory=list)


def lay_out(guest: Guest) -> Fixtures:
    fx = Fixtures()
    at = 0x100
    for text in [*MODELS, "x", "y", "a", "b", "nope", b"\xff\xfe", b"identity\0"]:
        fx.names.append(guest.name(at, text))
        at += 0x10
    guest.write(LONG_NAME, b"n" * 0x8000)
    fx.names += [(LONG_NAME, MAX_NAME_BYTES), (LONG_NAME, 0x8000)]
    guest.write(DATA_AT, np.arange(16, dtype=np.float32).tobytes())
    f32, at = 1, 0x400
    for dims, type_field, data_ptr, data_len in [
        ([1, 4], f32, DATA_AT, 16),                     # identity, identity_static, sub
        ([2, 4], f32, DATA_AT, 32),                     # identity only
        ([1, 1, 4], 0x00100301, DATA_AT, 16),           # dyn3, garbage in the padding
        ([0, 4], f32, DATA_AT, 0),                      # empty
        ([0, U32, U32], f32, 0, 0),                     # empty, unindexable
        ([1, 4], 2, DATA_AT, 4),                        # u8 in the Rust crate's table
        ([1, 4], 6, DATA_AT, 8),                        # bf16
        ([1, 4], 9, DATA_AT, 16),                       # no such type
        ([1, 4], f32, DATA_AT, 12),                     # length disagrees with dims
        ([1] * 33, f32, DATA_AT, 4),                    # rank 33
        ([65536] * 4, f32, DATA_AT, 16),                # 2**64 elements
        ([], f32, DATA_AT, 4),                          # a scalar
        ([1, 4], f32, 0xFFFFFFF0, 16),                  # data past the end
        ([1, 8], f32, 0xFFFFFFF0, 0x20),                # data_ptr + data_len wraps
        ([1, 4], f32, at + 0x1C0, 16),                  # data inside a record
    ]:
        fx.records.append(guest.record(at, dims, type_field, data_ptr, data_len))
        at += 0xA0 if len(dims) > 8 else 0x40
    # Dimensions past the end of memory; dimensions that are the record itself (rank 5).
    for dims_ptr, rank in [(0xFFFFFFFC, 2), (at + 0x40, 5)]:
        guest.write(at, struct.pack("<5I", dims_ptr, rank, f32, DATA_AT, 16))
        fx.records.append(at)
        at += 0x40
    assert at <= BUILDERS_AT
    model = MODELS["identity"]()
    guest.write(MODEL_AT, model)
    pairs: list[list[tuple[int, int]]] = [
        [(MODEL_AT, len(model))],                       # a real model
        [(BUILDERS_AT + 0x20, 16)],                     # the builder array itself
        [(0xFFFFFFF0, 0x20)],                           # wraps
        [(MODEL_AT, len(model))] * 2,                   # two builders for ONNX
        [(MODEL_AT, 0)],                                # empty bytes
    ]
    at = BUILDERS_AT
    for entries in pairs:
        guest.write(at, b"".join(struct.pack("<2I", p, n) for p, n in entries))
        fx.builders.append((at, len(entries)))
        at += 0x20
    fx.buffers = [0x5000, 0x5001, 0x5100, DATA_AT, SCRATCH]
    return fx


@dataclass
class Model:
    """What the guest was told: its live handles (context -> its graph), its closed ones,
    the contexts whose last compute succeeded."""

    graphs: set[int] = field(default_factory=set)
    contexts: dict[int, int] = field(default_factory=dict)
    computed: set[int] = field(default_factory=set)
    closed_graphs: set[int] = field(default_factory=set)
    closed_contexts: set[int] = field(default_factory=set)

    def unloaded(self, graph: int) -> None:
        self.graphs.discard(graph)
        self.closed_graphs.add(graph)
        for ctx in [c for c, g in self.contexts.items() if g == graph]:
            self.finalized(ctx)

    def finalized(self, ctx: int) -> None:
        del self.contexts[ctx]
        self.computed.discard(ctx)
        self.closed_contexts.add(ctx)


class Fuzzer:
    """Random calls with hostile arguments on one guest (see the module docstring)."""

    def __init__(self, guest: Guest, rng: random.Random) -> None:
        self.guest = guest
        self.rng = rng
        self.fx = lay_out(guest)
        self.model = Model()
        self.calls: list[tuple[str, tuple[int, ...], int]] = []

    # -- arguments ------------------------------------------------------------------
    def edge(self) -> int:
        """A pointer or length at or past the end of memory, or one that wraps."""
        size = self.guest.size
        return self.rng.choice([0, 1, 4, size - 4, size - 1, size, size + 1, 0x7FFFFFFF,
                                0x80000000, 0xFFFFFFF0, 0xFFFFFFFC, U32,
                                self.rng.getrandbits(32)]) & U32

    def out(self) -> int:
        if self.rng.random() < 0.8:
            return SCRATCH + 4 * self.rng.randrange(16)
        return self.edge()

    def name(self, kind: str = "tensor") -> tuple[int, int]:
        """Mostly a model's (``kind`` "model") or a tensor's name, else any of the names
        laid out (unknown, not UTF-8, too long), else anything."""
        roll = self.rng.random()
        if roll < 0.6:
            models = len(MODELS)
            return self.rng.choice(self.fx.names[:models] if kind == "model"
                                   else self.fx.names[models:models + 4])
        if roll < 0.85:
            return self.rng.choice(self.fx.names)
        return self.edge(), self.rng.choice([0, 1, 8, MAX_NAME_BYTES + 1, self.edge()])

    def record(self) -> int:
        """Mostly one that some model takes, else any laid out, else anything."""
        roll = self.rng.random()
        if roll < 0.5:
            return self.rng.choice(self.fx.records[:3])
        return self.rng.choice(self.fx.records) if roll < 0.85 else self.edge()

    def builders(self) -> tuple[int, int]:
        if self.rng.random() < 0.8:
            return self.rng.choice(self.fx.builders)
        return self.edge(), self.rng.choice([0, 1, 2, 17, 0x40000000, U32])

    def buffer(self) -> tuple[int, int]:
        if self.rng.random() < 0.7:
            return self.rng.choice(self.fx.buffers), self.rng.choice([0, 4, 8, 16, 31, 32, 64])
        return self.edge(), self.edge()

    def handle(self, live: list[int], closed: set[int]) -> int:
        roll = self.rng.random()
        if live and roll < 0.85:
            return self.rng.choice(live)
        if closed and roll < 0.93:
            return self.rng.choice(sorted(closed))
        return self.rng.choice([0, 1, 99, 0x80000000, U32])

    def graph(self) -> int:
        return self.handle(sorted(self.model.graphs), self.model.closed_graphs)

    def ctx(self) -> int:
        return self.handle(sorted(self.model.contexts), self.model.closed_contexts)

    def encoding(self) -> int:
        if self.rng.random() < 0.6:
            return 1
        return self.rng.choice([*range(13), 0xFF, 0x101, U32])

    def target(self) -> int:
        return 0 if self.rng.random() < 0.7 else self.rng.choice([1, 2, 3, 0x100, U32])

    def index(self) -> int:
        return self.rng.choice([0] * 6 + [1, 2, U32])

    # -- calls --------------------------------------------------------------------------
    def start(self) -> None:
        """A good start, so that the random calls reach live handles and computes: a
        model loaded by name, two contexts on it, each with its inputs set and perhaps
        its output bound."""
        model = self.rng.choice(list(MODELS))
        self.call("load_by_name", (*self.fx.names[list(MODELS).index(model)], SCRATCH))
        record, inputs = GOOD_INPUTS[model]
        for _ in range(2):
            self.call("init_execution_context", (self.guest.u32(SCRATCH), SCRATCH + 4))
            for index in range(inputs):
                self.call("set_input", (self.guest.u32(SCRATCH + 4), index,
                                        self.fx.records[record]))
            if self.rng.random() < 0.5:
                y = self.fx.names[len(MODELS) + 1]
                self.call("set_output_by_name", (self.guest.u32(SCRATCH + 4), *y, 0x5100,
                                                 self.rng.choice([8, 16, 64]), SCRATCH + 8))

    def step(self) -> None:
        ops: list[tuple[int, Callable[[], tuple[str, tuple[int, ...]]]]] = [
            (1, lambda: ("load", (*self.builders(), self.encoding(), self.target(),
                                  self.out()))),
            (4, lambda: ("load_by_name", (*self.name("model"), self.out()))),
            (1, lambda: ("load_by_name_with_config", (*self.name("model"), *self.buffer(),
                                                      self.out()))),
            (4, lambda: ("init_execution_context", (self.graph(), self.out()))),
            (1, lambda: ("init_execution_context_on", (self.graph(), self.target(),
                                                       self.out()))),
            (5, lambda: ("set_input", (self.ctx(), self.index(), self.record()))),
            (2, lambda: ("set_input_by_name", (self.ctx(), *self.name(), self.record()))),
            (2, lambda: ("set_output_by_name", (self.ctx(), *self.name(), *self.buffer(),
                                                self.out()))),
            (4, lambda: ("compute", (self.ctx(),))),
            (1, lambda: ("compute_single", (self.ctx(),))),
            (3, lambda: ("get_output", (self.ctx(), self.index(), *self.buffer(),
                                        self.out()))),
            (1, lambda: ("get_output_single", (self.ctx(), self.index(), *self.buffer(),
                                               self.out()))),
            (2, lambda: ("get_output_by_name", (self.ctx(), *self.name(), *self.buffer(),
                                                self.out()))),
            (1, lambda: ("unload", (self.graph(),))),
            (1, lambda: ("finalize_execution_context", (self.ctx(),))),
            (1, lambda: ("fini_single", (self.ctx(),))),
            (1, lambda: ("grow", (self.rng.choice([0, 1, 2]) if self.guest.size < 16 * PAGE
                                  else 0,))),
        ]
        weights, makers = zip(*ops, strict=True)
        self.call(*self.rng.choices(makers, weights)[0]())

    def call(self, name: str, args: tuple[int, ...]) -> None:
        errno = self.guest.call(name, *args)
        self.calls.append((name, args, errno))
        if name != "grow":
            assert errno in DOCUMENTED, self.trail()
            self.follow(name, args, errno)
        self.check()

    def follow(self, name: str, args: tuple[int, ...], errno: int) -> None:
        """Update the model from a call's outcome, checking what it must have been."""
        model, nn = self.model, self.guest.nn
        handle = args[0]
        if name == "unload" and handle not in model.graphs:
            assert errno == NOT_FOUND, self.trail()
        if name in ("compute", "compute_single", "finalize_execution_context",
                    "fini_single") and handle not in model.contexts:
            assert errno == NOT_FOUND, self.trail()
        if name in ("compute", "compute_single") and errno not in (SUCCESS, END_OF_SEQUENCE):
            model.computed.discard(handle)  # no outputs until the next compute succeeds
        if errno != SUCCESS:
            return
        if name.startswith("get_output"):
            # Only after a compute that succeeded; the size written back is the output's,
            # which fits the buffer (not output bytes written over the size).
            assert handle in model.computed, self.trail()
            assert self.guest.u32(args[-1]) <= args[-2], self.trail()
        elif name.startswith("compute"):
            model.computed.add(handle)
        elif name.startswith("load"):
            graph = self.guest.u32(args[-1])
            assert graph == nn._next_graph - 1 and graph not in model.graphs, self.trail()
            model.graphs.add(graph)
        elif name.startswith("init_execution_context"):
            ctx = self.guest.u32(args[-1])
            assert ctx == nn._next_context - 1 and ctx not in model.contexts, self.trail()
            model.contexts[ctx] = handle
        elif name == "unload":
            model.unloaded(handle)
        elif name == "finalize_execution_context":
            model.finalized(handle)

    def check(self) -> None:
        nn, model = self.guest.nn, self.model
        assert set(nn.graphs) == model.graphs, self.trail()
        assert {c: e.graph_handle for c, e in nn.contexts.items()} == model.contexts, \
            self.trail()
        for handle, graph in nn.graphs.items():
            assert graph.contexts == {c for c, g in model.contexts.items() if g == handle}
        assert nn.model_bytes == sum(g.model_bytes for g in nn.graphs.values())

    def close_all(self) -> None:
        """Finalize some contexts, unload every graph: the tables must end up empty."""
        for ctx in sorted(self.model.contexts):
            if self.rng.random() < 0.5:
                assert self.guest.call("finalize_execution_context", ctx) == SUCCESS
                self.model.finalized(ctx)
        for graph in sorted(self.model.graphs):
            assert self.guest.call("unload", graph) == SUCCESS
            self.model.unloaded(graph)
        nn = self.guest.nn
        assert (nn.graphs, nn.contexts, nn.model_bytes) == ({}, {}, 0), self.trail()

    def trail(self) -> str:
        return "calls so far:\n" + "\n".join(
            f"  {name}{tuple(hex(a) for a in args)} -> {errno}"
            for name, args, errno in self.calls)


async def test_random_call_sequences_keep_the_host_sound(rt: wasinn.Runtime,
                                                         host_log: HostLog) -> None:
    # The guests' loads by name share these (no compile per sequence); released at the end.
    held = [await rt.load_by_name(name) for name in MODELS]
    threads = wasinn_threads()
    rng = random.Random(SEED)
    errnos: dict[int, int] = {}

    def sequence(guest: Guest) -> None:
        fuzzer = Fuzzer(guest, rng)
        fuzzer.start()
        for _ in range(CALLS):
            fuzzer.step()
        fuzzer.close_all()
        for *_, errno in fuzzer.calls:
            errnos[errno] = errnos.get(errno, 0) + 1

    for _ in range(SEQUENCES):
        await in_guest(rt, sequence, LIMITS)
    # No host bug (an exception turned into runtime_error), no runaway log line.
    assert host_log.bugs() == []
    assert max(len(m) for m in host_log.messages()) < 8192
    # The fuzz reached the calls' success and many errors, not one errno over and over.
    assert errnos.get(SUCCESS, 0) > SEQUENCES
    assert {INVALID_ARGUMENT, INVALID_ENCODING, TOO_LARGE, NOT_FOUND} <= set(errnos)
    for graph in held:
        await graph.unload()
    assert wasinn_threads() == threads
    assert all(executable.released for executable in rt.name_registry.loaded())
    for device in rt.stats():
        assert (device.graphs, device.running, device.queued, device.abandoned_running) == \
            (0, 0, 0, 0), device


# -- one test per defect found ----------------------------------------------------------
def ready(guest: Guest, model: str = "identity_static",
          dims: tuple[int, ...] = (1, 4)) -> int:
    """A context on ``model`` (loaded by name) with input 0 set to 1, 2, 3 ... of ``dims``."""
    ctx = guest.context(guest.load_by_name(model))
    data = np.arange(1, int(np.prod(dims)) + 1, dtype=np.float32)
    guest.write(DATA_AT, data.tobytes())
    record = guest.record(0x400, list(dims), 1, DATA_AT, data.nbytes)
    assert guest.call("set_input", ctx, 0, record) == SUCCESS
    return ctx


def output(guest: Guest, ctx: int, at: int = 0x5000) -> np.ndarray[Any, Any]:
    assert guest.call("get_output", ctx, 0, at, 0x100, 0x40) == SUCCESS
    return np.frombuffer(guest.read(at, guest.u32(0x40)), np.float32)


async def test_an_empty_tensor_with_dimensions_numpy_cannot_shape_is_refused(
        rt: wasinn.Runtime, host_log: HostLog) -> None:
    # Was: set_input took [0, 2**32-1, 2**32-1] (no elements, no bytes), and compute
    # raised numpy's "array is too big" inside the host: a host bug, runtime_error.
    def body(guest: Guest) -> None:
        ctx = ready(guest, "dyn3", (1, 1, 4))
        empty = guest.record(0x600, [0, U32, U32], 1, 0, 0)
        assert guest.call("set_input", ctx, 0, empty) == INVALID_ARGUMENT
        assert guest.call("compute", ctx) == SUCCESS  # on the input set before
        assert output(guest, ctx).tolist() == [1, 2, 3, 4]

    await in_guest(rt, body)
    assert host_log.bugs() == []
    assert host_log.said("tensor dimensions [0, 4294967295, 4294967295] are too large: "
                         "expected the product of the non-zero ones times the element size "
                         "(4 bytes) at most")


async def test_a_size_of_4_gib_or_more_is_written_back_as_the_largest_u32(
        rt: wasinn.Runtime, host_log: HostLog) -> None:
    # Was: a bound output of a model whose static output is 16 GiB made compute write
    # 2**34 as a u32 (struct.error inside the host: runtime_error, nothing written).
    def body(guest: Guest) -> None:
        ctx = guest.context(guest.load_by_name("big"))
        y = guest.name(0x100, "y")
        assert guest.call("set_output_by_name", ctx, *y, 0x5000, 16, 0x40) == SUCCESS
        assert guest.call("compute", ctx) == TOO_LARGE
        assert guest.u32(0x40) == U32

    await in_guest(rt, body)
    assert host_log.bugs() == []
    assert host_log.said("output 'y' needs 17179869184 bytes but its bound buffer holds 16")


@pytest.mark.parametrize("limits", [None, GuestLimits(compute_timeout=60)],
                         ids=["guest thread", "compute timeout"])
async def test_a_dynamic_output_too_large_for_its_bound_buffer_writes_what_it_needs(
        rt: wasinn.Runtime, host_log: HostLog, limits: GuestLimits | None) -> None:
    # Was: the size was looked up in the context's last recorded run, which a refused run
    # is not: a first compute wrote no size (the guest read what it had left there), a
    # later one the last success's (16 bytes, which fit: a guest growing its buffer to
    # bytes_written and computing again got too_large for ever).
    def body(guest: Guest) -> None:
        ctx = ready(guest, "identity", (2, 4))  # y = x: 32 bytes, known after the run
        small = guest.record(0x480, [1, 4], 1, DATA_AT, 16)
        y = guest.name(0x100, "y")
        guest.write(0x40, struct.pack("<I", 0xDEADBEEF))
        guest.write(0x6000, b"\xaa" * 16)
        assert guest.call("set_output_by_name", ctx, *y, 0x6000, 16, 0x40) == SUCCESS
        assert guest.call("compute", ctx) == TOO_LARGE
        assert guest.u32(0x40) == 32
        assert guest.read(0x6000, 16) == b"\xaa" * 16
        assert guest.call("set_input", ctx, 0, small) == SUCCESS
        assert guest.call("compute", ctx) == SUCCESS
        assert guest.u32(0x40) == 16
        assert guest.call("set_input", ctx, 0, 0x400) == SUCCESS  # 32 bytes again
        assert guest.call("compute", ctx) == TOO_LARGE
        assert guest.u32(0x40) == 32
        assert guest.call("set_output_by_name", ctx, *y, 0x6000, guest.u32(0x40),
                          0x40) == SUCCESS
        assert guest.call("compute", ctx) == SUCCESS
        assert guest.u32(0x40) == 32
        assert np.frombuffer(guest.read(0x6000, 32), np.float32).tolist() == [
            1, 2, 3, 4, 5, 6, 7, 8]

    await in_guest(rt, body, limits)
    assert host_log.bugs() == []
    assert host_log.said("output 'y' is 32 bytes ([2, 4] of f32) but its bound buffer holds "
                         "16 (the needed size was written to bytes_written)")


async def test_names_longer_than_any_name_are_refused_before_they_are_read(
        rt: wasinn.Runtime, host_log: HostLog) -> None:
    # Was: a name of any length was decoded, looked up and quoted whole in the host's log
    # (a megabyte name: a megabyte log line per call).
    long = 1_000_000

    def body(guest: Guest) -> None:
        ctx = ready(guest)
        assert guest.call("grow", 16) == 1
        guest.write(PAGE, b"n" * long)
        assert guest.call("load_by_name", PAGE, MAX_NAME_BYTES, 0x40) == NOT_FOUND
        for name, args in [("load_by_name", (0x40,)),
                           ("load_by_name_with_config", (0, 0, 0x40)),
                           ("set_input_by_name", (0x400,)),
                           ("set_output_by_name", (0x5000, 16, 0x40)),
                           ("get_output_by_name", (0x5000, 16, 0x40))]:
            before = () if name.startswith("load") else (ctx,)
            assert guest.call(name, *before, PAGE, long, *args) == INVALID_ARGUMENT, name

    await in_guest(rt, body)
    assert host_log.bugs() == []
    messages = host_log.messages()
    assert max(len(m) for m in messages) < 8192
    assert sum(f"is {long} bytes long: expected at most {MAX_NAME_BYTES} bytes" in m
               for m in messages) == 5


async def test_bytes_written_inside_the_output_buffer_is_refused(
        rt: wasinn.Runtime, host_log: HostLog) -> None:
    # Was: accepted; get_output wrote the size, then the output over it (the guest read
    # float bits as its size), and a bound output's size overwrote its data at compute.
    def body(guest: Guest) -> None:
        ctx = ready(guest)
        y = guest.name(0x100, "y")
        assert guest.call("set_output_by_name", ctx, *y, 0x6000, 16, 0x6010) == SUCCESS
        assert guest.call("compute", ctx) == SUCCESS
        for written in (0x5000, 0x500C, 0x4FFD):
            assert guest.call("get_output", ctx, 0, 0x5000, 16, written) == INVALID_ARGUMENT
            assert guest.call("set_output_by_name", ctx, *y, 0x5000, 16, written) == \
                INVALID_ARGUMENT
        assert guest.read(0x4FF0, 0x20) == bytes(0x20)  # nothing written
        # Right next to the buffer is fine; the binding made before the refused ones holds.
        assert guest.call("get_output", ctx, 0, 0x5000, 16, 0x5010) == SUCCESS
        assert guest.u32(0x5010) == 16
        guest.write(0x6000, bytes(16))
        assert guest.call("compute", ctx) == SUCCESS
        assert np.frombuffer(guest.read(0x6000, 16), np.float32).tolist() == [1, 2, 3, 4]
        assert guest.u32(0x6010) == 16

    await in_guest(rt, body)
    assert host_log.bugs() == []
    assert host_log.said("bytes_written at guest address 0x500c overlaps the output buffer "
                         "at 0x5000 of 16 bytes: expected the 4-byte size outside the buffer")


async def test_an_empty_model_name_is_invalid_as_for_a_component_guest(
        rt: wasinn.Runtime, host_log: HostLog) -> None:
    def body(guest: Guest) -> None:
        assert guest.call("load_by_name", 0x100, 0, 0x40) == INVALID_ARGUMENT

    await in_guest(rt, body)
    assert host_log.said("model name is empty: expected the name of a registered model or "
                         "pipeline")


async def test_bound_outputs_that_overlap_each_other_are_refused(
        rt: wasinn.Runtime, host_log: HostLog) -> None:
    # Was: accepted; compute wrote one output's size into another's data, or one output
    # over another, and said success.
    def body(guest: Guest) -> None:
        ctx = ready(guest, "pair")
        a, b = guest.name(0x100, "a"), guest.name(0x120, "b")
        assert guest.call("set_output_by_name", ctx, *a, 0x6000, 16, 0x40) == SUCCESS
        for buffer, written in ((0x6100, 0x6004),   # b's size inside a's buffer
                                (0x6008, 0x44),     # the buffers overlap
                                (0x6000, 0x44),     # one buffer for both
                                (0x38, 0x48),       # b's buffer over a's size
                                (0x6100, 0x42)):    # the sizes overlap
            assert guest.call("set_output_by_name", ctx, *b, buffer, 16, written) == \
                INVALID_ARGUMENT, (hex(buffer), hex(written))
        assert guest.call("set_output_by_name", ctx, *b, 0x6010, 16, 0x44) == SUCCESS
        assert guest.call("set_output_by_name", ctx, *a, 0x6000, 16, 0x40) == SUCCESS  # again
        assert guest.call("compute", ctx) == SUCCESS
        assert np.frombuffer(guest.read(0x6000, 32), np.float32).tolist() == [
            1, 2, 3, 4, -1, -2, -3, -4]
        assert (guest.u32(0x40), guest.u32(0x44)) == (16, 16)

    await in_guest(rt, body)
    assert host_log.bugs() == []
    assert host_log.said("the bytes_written for 'b' at guest address 0x6004 (4 bytes) "
                         "overlaps the buffer bound to output 'a' at 0x6000 (16 bytes); "
                         "compute writes both: expected separate ranges")


async def test_a_compute_that_fails_early_leaves_no_outputs_of_an_earlier_one(
        rt: wasinn.Runtime, host_log: HostLog) -> None:
    # Was: a compute refused for a bound buffer too small for a static output kept the
    # previous compute's outputs, which get_output then handed out as a success.
    def body(guest: Guest) -> None:
        ctx = ready(guest)
        assert guest.call("get_output", ctx, 0, 0x5000, 16, 0x40) == INVALID_ARGUMENT
        assert guest.call("compute", ctx) == SUCCESS
        assert output(guest, ctx).tolist() == [1, 2, 3, 4]
        y = guest.name(0x100, "y")
        assert guest.call("set_output_by_name", ctx, *y, 0x6000, 8, 0x44) == SUCCESS
        assert guest.call("compute", ctx) == TOO_LARGE
        assert guest.call("get_output", ctx, 0, 0x5000, 16, 0x40) == INVALID_ARGUMENT
        assert guest.call("set_output_by_name", ctx, *y, 0x6000, 16, 0x44) == SUCCESS
        assert guest.call("compute", ctx) == SUCCESS
        assert output(guest, ctx).tolist() == [1, 2, 3, 4]

    await in_guest(rt, body)
    messages = host_log.messages()
    assert any(m.endswith("no outputs yet: call compute before get_output") for m in messages)
    assert any(m.endswith("no outputs: the last compute on this context failed (expected a "
                          "successful compute before get_output)") for m in messages)


async def test_a_guest_that_used_every_u32_handle_gets_too_large_and_loses_nothing(
        rt: wasinn.Runtime, host_log: HostLog) -> None:
    # Was: handle 2**32 made the host fail writing it back (struct.error: runtime_error)
    # after making the context or loading the graph, which then sat in the guest's table
    # under a handle no u32 names: never finalized or unloaded while the guest ran.
    def body(guest: Guest) -> None:
        graph = guest.load_by_name("identity")
        guest.nn._next_context = U32  # as after 4294967295 contexts opened and closed
        last = guest.context(graph)
        assert last == U32
        assert guest.call("init_execution_context", graph, 0x40) == TOO_LARGE
        assert list(guest.nn.contexts) == [last]
        assert guest.call("finalize_execution_context", last) == SUCCESS
        guest.nn._next_graph = U32 + 1
        assert guest.call("load_by_name", *guest.name(0x100, "identity"), 0x40) == TOO_LARGE
        assert list(guest.nn.graphs) == [graph]
        assert guest.call("unload", graph) == SUCCESS

    await in_guest(rt, body)
    assert host_log.bugs() == []
    assert host_log.said("has opened all 4294967296 execution context handles a u32 can name")


@pytest.mark.parametrize(("imported", "message"), [
    ('"load" (func (param i32) (result i32))',
     r"^guest.wat imports wasi_ephemeral_nn::load as a function \(i32\) -> \(i32\): expected a "
     r"function \(builders_ptr: i32, builders_len: i32, encoding: i32, target: i32, "
     r"graph_out: i32\) -> i32 \(the errno\)$"),
    ('"compute" (func (param i64) (result i32))', r"as a function \(i64\) -> \(i32\): "),
    ('"compute" (func (param i32))', r"as a function \(i32\) -> \(\): expected a function "
                                     r"\(ctx: i32\) -> i32"),
    ('"compute" (global i32)', r"as a global: expected a function \(ctx: i32\)"),
    ('"bogus" (func (param i32) (result i32))',
     r"imports wasi_ephemeral_nn::bogus, which wasinn does not define: expected one of "
     r"load, load_by_name, .*, fini_single$"),
    ('"memory" (memory 1)', r"wasi_ephemeral_nn::memory, which wasinn does not define"),
])
async def test_imports_of_the_wrong_type_are_refused_naming_what_is_expected(
        imported: str, message: str, tmp_path: Path) -> None:
    # Wasmtime's own link error reads the other way round ("expected" is the guest's
    # type): check_imports says what the guest imported and what wasinn defines.
    text = f'(module (import "wasi_ephemeral_nn" {imported}) (memory (export "memory") 1) ' \
           '(func (export "_start")))'
    module = wasmtime.Module(shared_engine(), text)
    with pytest.raises(wasinn.InvalidArgumentError, match=message):
        check_imports(module, "guest.wat")
    # And running it is refused with that message, before any of it runs.
    (tmp_path / "guest.wat").write_text(text)
    async with wasinn.Runtime() as rt:
        with pytest.raises(wasinn.InvalidArgumentError, match=message):
            await rt.run_wasm(tmp_path / "guest.wat")


async def test_the_last_bytes_of_a_4_gib_memory_and_no_byte_past_them(
        rt: wasinn.Runtime, host_log: HostLog) -> None:
    # Memory grown to the whole u32 address space: buffers ending exactly at 2**32 work,
    # and one byte more, or a pointer plus length that wraps past 2**32, is refused.
    def body(guest: Guest) -> None:
        ctx = guest.context(guest.load_by_name("identity_static"))
        assert guest.call("grow", 0x10000 - 1) == 1
        assert guest.size == 2**32
        top = 2**32 - 16
        guest.write(top, np.arange(4, dtype=np.float32).tobytes())
        record = guest.record(top - 0x40, [1, 4], 1, top, 16)
        assert guest.call("set_input", ctx, 0, record) == SUCCESS
        assert guest.call("compute", ctx) == SUCCESS
        assert guest.call("get_output", ctx, 0, top - 0x20, 16, 2**32 - 4) == SUCCESS
        assert guest.u32(2**32 - 4) == 16
        for ptr, length in [(top + 1, 16), (top, 0xFFFFFFF0 + 0x30), (2**32 - 1, 2)]:
            assert guest.call("get_output", ctx, 0, ptr, length, 0x40) == INVALID_ARGUMENT
        assert guest.call("get_output", ctx, 0, 0x100, 16, 2**32 - 3) == INVALID_ARGUMENT
        over = guest.record(top - 0x80, [1, 4], 1, 0xFFFFFFF8, 16)
        assert guest.call("set_input", ctx, 0, over) == INVALID_ARGUMENT
        assert guest.call("grow", 1) == U32  # wasm's own -1: no more memory

    await in_guest(rt, body)
    assert host_log.bugs() == []


async def test_contexts_interleaved_on_one_graph_keep_their_own_inputs_and_outputs(
        rt: wasinn.Runtime, host_log: HostLog) -> None:
    # Three contexts on one graph, set, computed and read in different orders, the
    # guest's memory grown (and the inputs moved up into the new pages) between calls.
    def body(guest: Guest) -> None:
        graph = guest.load_by_name("identity")
        contexts = [guest.context(graph, 0x40 + 4 * i) for i in range(3)]
        for i, ctx in enumerate(contexts):
            data = np.full((i + 1, 4), i + 1, np.float32)
            guest.write(DATA_AT + 0x100 * i, data.tobytes())
            record = guest.record(0x400 + 0x40 * i, [i + 1, 4], 1, DATA_AT + 0x100 * i,
                                  data.nbytes)
            assert guest.call("set_input", ctx, 0, record) == SUCCESS
        assert guest.call("compute", contexts[2]) == SUCCESS
        assert guest.call("grow", 2) == 1
        moved = guest.record(PAGE + 0x400, [1, 4], 1, PAGE + 0x1000, 16)
        guest.write(PAGE + 0x1000, np.full(4, 7, np.float32).tobytes())
        assert guest.call("set_input", contexts[0], 0, moved) == SUCCESS
        assert guest.call("compute", contexts[0]) == SUCCESS
        assert output(guest, contexts[0], PAGE + 0x5000).tolist() == [7] * 4
        assert guest.call("compute", contexts[1]) == SUCCESS
        assert output(guest, contexts[1]).tolist() == [2] * 8
        assert output(guest, contexts[2]).tolist() == [3] * 12
        assert guest.call("finalize_execution_context", contexts[1]) == SUCCESS
        assert guest.call("compute", contexts[1]) == NOT_FOUND
        assert guest.call("compute", contexts[0]) == SUCCESS
        assert guest.call("unload", graph) == SUCCESS  # closes contexts 0 and 2 too
        for ctx in contexts:
            assert guest.call("compute", ctx) == NOT_FOUND
            assert guest.call("finalize_execution_context", ctx) == NOT_FOUND
        assert guest.call("unload", graph) == NOT_FOUND
        assert (guest.nn.graphs, guest.nn.contexts) == ({}, {})

    await in_guest(rt, body)
    assert host_log.bugs() == []


async def test_a_guests_unload_does_not_wait_for_a_run_still_going_on_its_graph(
        rt: wasinn.Runtime, caplog: pytest.LogCaptureFixture) -> None:
    # A run may still be going on the guest's graph when the guest unloads it: one its
    # thread started in its own slot (try_lease) before it was stopped, or a compute it
    # gave up on (compute_timeout). The guest's unload (and its release at exit) returns
    # at once, and that run frees the graph as it ends. Before, the guest's call waited
    # for it, shielded, up to close_timeout, and a warning said so.
    nn = GuestNN(rt, GuestPortal())
    try:
        guest = await trio.to_thread.run_sync(Guest, nn)
        model = identity_onnx(TensorType.F32)  # its own bytes: no registry name keeps it
        guest.write(0x1000, model)
        guest.write(0x200, struct.pack("<II", 0x1000, len(model)))
        assert await trio.to_thread.run_sync(guest.call, "load", 0x200, 1, 1, 0, 0x10) == \
            SUCCESS  # (ONNX, on the CPU)
        handle = guest.u32(0x10)
        graph = nn.graphs[handle].graph
        inputs = {graph.inputs[0].name: np.ones((1, 4), np.float32)}
        lease = await trio.to_thread.run_sync(graph.try_lease, inputs)  # (from a thread)
        assert lease is not None
        with caplog.at_level(logging.WARNING, logger="wasinn.scheduler"):
            assert await trio.to_thread.run_sync(guest.call, "unload", handle) == SUCCESS
        assert not [r for r in caplog.records if "still waits for" in r.getMessage()]
        assert graph.unloaded
        out = await trio.to_thread.run_sync(lease.run)  # the run goes on, then frees it
        np.testing.assert_array_equal(next(iter(out.values())).numpy(), np.ones((1, 4)))
    finally:
        await nn.release()


async def test_each_load_has_a_name_of_its_own_failed_or_not(rt: wasinn.Runtime) -> None:
    # Before: the count moved on a load that succeeded only, so every failed load before
    # it was named team-a#0 too, in its error and in the logs.
    names: list[str] = []

    class Recorder:
        async def load(self, *args: Any, **kwargs: Any) -> Any:
            names.append(kwargs["name"])
            return await rt.load(*args, **kwargs)

        def __getattr__(self, name: str) -> Any:
            return getattr(rt, name)

    nn = GuestNN(Recorder(), GuestPortal(), tenant="team-a")  # type: ignore[arg-type]
    try:
        guest = await trio.to_thread.run_sync(Guest, nn)
        garbage, model = b"not a model at all", identity_onnx(TensorType.F32)
        guest.write(0x1000, garbage)
        guest.write(0x2000, model)
        guest.write(0x200, struct.pack("<II", 0x1000, len(garbage)))
        guest.write(0x208, struct.pack("<II", 0x2000, len(model)))
        codes = [await trio.to_thread.run_sync(guest.call, "load", at, 1, 1, 0, 0x10)
                 for at in (0x200, 0x200, 0x208)]  # (ONNX, on the CPU)
    finally:
        await nn.release()
    assert codes == [INVALID_ENCODING, INVALID_ENCODING, SUCCESS]
    assert names == ["team-a#0", "team-a#1", "team-a#2"]
