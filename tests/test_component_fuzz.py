"""A seeded fuzz of the component guest ABI: random call sequences through the shims.

Each sequence starts a fresh shim guest (the 2024-10-28 one, or the 2024-06-25 one with
``set-input`` / ``get-output`` and the error constructor), under the default limits or
small ones, and makes random calls with hostile arguments: tensors of any rank, of
dimensions whose product overflows u32 or u64, of data lengths that disagree with them;
loads of real tiny models and of garbage with any encoding and target; names registered,
unknown, empty and very long; computes with unknown, repeated and consumed inputs; drops
in any order. A model of the guest's handle table (guest index -> kind) says what each
call may do. After every call:

* the call returned ok or an ``error`` whose code is one of the WIT's ``error-code``
  cases and whose message is not empty;
* it trapped only where the host says it traps (the tensor constructor past
  ``max_tensors``, an error past ``max_errors``) or where the canonical ABI traps (a
  handle the guest does not hold, of the wrong kind, or given twice as owned); the guest
  is then discarded and the next sequence starts a fresh one;
* nothing of ``wasinn`` logged at ERROR level (a host bug);
* the service's tables hold exactly the handles the guest holds.

At the end of a sequence the guest drops everything it holds (or was discarded):
its tables are empty, every graph it loaded is unloaded, no device has requests queued
or running, and no ``wasinn`` thread was started or lost.

The focused tests after the fuzz pin each defect it found.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from wasmtime.component import Component, Variant

from tests.component_guests import RecordingRuntime, shim_1028, shim_legacy
from tests.test_core_fuzz import wasinn_threads
from wasinn.enums import ExecutionTarget, TensorType
from wasinn.host.component import ComponentGuest
from wasinn.host.component.guest import compile_guest
from wasinn.host.limits import GuestLimits
from wasinn.host.runner import GuestTrap
from wasinn.modelgen import affine_onnx, identity_onnx

#: The WIT ``error-code`` cases, in WIT order (the shims return the discriminant).
CODES = ["invalid-argument", "invalid-encoding", "timeout", "runtime-error",
         "unsupported-operation", "too-large", "not-found", "security", "unknown"]
TYPES = ["FP16", "FP32", "FP64", "BF16", "U8", "I32", "I64"]
ITEMSIZE = {"FP16": 2, "FP32": 4, "FP64": 8, "BF16": 2, "U8": 1, "I32": 4, "I64": 8}
ENCODINGS = 7  # openvino, onnx, tensorflow, pytorch, tensorflowlite, ggml, autodetect
ONNX = 1
TARGETS = 3  # cpu, gpu, tpu
LEGACY = "0.2.0-rc-2024-06-25"

SEED = 0x5EED_1028
SEQUENCES = 160
LEGACY_SEQUENCES = 100
CALLS = 14

U32 = 0xFFFF_FFFF
KINDS = ("tensor", "graph", "graph-execution-context", "error")
#: Names a guest may load by: registered ones (good and broken), unknown, empty, long.
NAMES = ["affine", "affine3", "bad_reshape", "identity_f32", "identity_i64", "missing",
         "garbage", "nope", "", "n" * 100_000, "affine\0", "éé", "0"]
#: Input and output names: the graphs' own, positions, unknown, empty, long.
TENSOR_NAMES = ["x", "x", "x", "y", "0", "1", "", "nope", "x" * 5000, "4294967296"]
LIMITS = [
    None,
    None,
    GuestLimits(max_tensors=3),
    GuestLimits(max_errors=2),
    GuestLimits(max_live_tensor_bytes=64),
    GuestLimits(max_graphs=1, max_contexts=1),
    GuestLimits(max_tensors=4, max_errors=3, max_live_tensor_bytes=100, max_graphs=2),
    GuestLimits(max_tensor_bytes=40, max_model_bytes=400),
    GuestLimits(compute_timeout=30.0, allowed_targets=frozenset({ExecutionTarget.CPU})),
    GuestLimits(allowed_targets=frozenset()),
]


def _models() -> list[list[bytes]]:
    affine = affine_onnx(2.0, 1.0)
    return [
        [affine], [affine], [identity_onnx(TensorType.F32)], [affine_onnx(3.0, 0.5)],
        [b"garbage"], [b""], [], [affine, affine], [affine[: len(affine) // 2]],
        [bytes(range(256)) * 4],
    ]


MODELS = _models()


def host_bugs(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What ``wasinn`` logged at ERROR level or worse: a host bug."""
    return [f"{r.name}: {r.getMessage()}" for r in caplog.records
            if r.name.startswith("wasinn") and r.levelno >= logging.ERROR]


class Skip(Exception):
    """Nothing to call the operation on."""


class AbiTrap(Exception):
    """The call was expected to trap in the canonical ABI (a stale or repeated handle)."""


@dataclass
class Model:
    """The guest's handle table as the fuzz sees it: guest index -> kind."""

    held: dict[int, str] = field(default_factory=dict)
    #: Indices the guest held once and dropped (or gave away), for use after drop.
    gone: set[int] = field(default_factory=set)
    #: What each constructed tensor was given: (dims, data).
    made: dict[int, tuple[list[int], bytes | None]] = field(default_factory=dict)

    def add(self, index: int, kind: str) -> None:
        assert index not in self.held, f"index {index} handed out twice"
        self.held[index] = kind
        self.gone.discard(index)

    def remove(self, index: int) -> None:
        del self.held[index]
        self.made.pop(index, None)
        self.gone.add(index)

    def of(self, kind: str) -> list[int]:
        return sorted(i for i, k in self.held.items() if k == kind)

    def counts(self) -> dict[str, int]:
        return {kind: len(self.of(kind)) for kind in KINDS}


class Sequence:
    """One random call sequence on one fresh guest."""

    def __init__(self, guest: ComponentGuest, rng: random.Random, limits: GuestLimits,
                 log: pytest.LogCaptureFixture, legacy: bool) -> None:
        self.guest = guest
        self.rng = rng
        self.limits = limits
        self.log = log
        self.legacy = legacy
        self.model = Model()
        self.trace: list[str] = []
        self.dead = False
        self.ops: list[str] = []
        self.errors: list[str] = []

    # -- checking one call ------------------------------------------------------------
    async def call(self, name: str, *args: Any, abi_trap: bool = False,
                   host_trap: str | None = None) -> Any:
        """Call the shim; GuestTrap is re-raised only where a trap was allowed."""
        self.trace.append(f"{name}{_short(args)}")
        try:
            result = await self.guest.call(name, *args)
        except GuestTrap as trap:
            self.dead = True
            message = str(trap)
            if abi_trap:
                assert "handle" in message or "resource" in message, message
                raise AbiTrap(message) from None
            if "max_errors" in message:
                assert self.model.counts()["error"] == self.limits.max_errors, self.where(message)
                raise
            if host_trap is not None and host_trap in message:
                raise
            raise AssertionError(self.where(f"unexpected trap: {message}")) from None
        assert not abi_trap, self.where(f"{name} should have trapped: {result!r}")
        assert not host_bugs(self.log), self.where(f"host logged errors: {host_bugs(self.log)}")
        return result

    def where(self, message: str) -> str:
        return f"{message}\n  calls: {' ; '.join(self.trace[-8:])}"

    async def check_error(self, index: int) -> None:
        """A fresh error handle: a WIT code and a message; sometimes dropped at once."""
        self.model.add(index, "error")
        if self.rng.random() < 0.5:
            code = await self.call("error-code", index)
            assert 0 <= code < len(CODES), code
            message = await self.call("error-data", index)
            assert isinstance(message, str) and message.strip(), self.where("empty message")
        if self.rng.random() < 0.6:
            await self.call("error-drop", index)
            self.model.remove(index)

    async def result(self, value: Any, kind: str | None) -> Any:
        """A ``result<handle|list|_, error>``: record what it hands out; None on error."""
        if isinstance(value, Variant):
            if value.tag == "err":
                self.errors.append(self.ops[-1] if self.ops else "?")
                await self.check_error(value.payload)
                return None
            value = value.payload
        elif isinstance(value, int) and kind is None:  # result<_, error> as a bare error
            self.errors.append(self.ops[-1] if self.ops else "?")
            await self.check_error(value)
            return None
        if kind is not None and isinstance(value, int):
            self.model.add(value, kind)
        elif isinstance(value, list):  # named outputs
            for _, index in value:
                self.model.add(index, "tensor")
        return value if value is not None else True

    def agree(self) -> None:
        assert self.guest.live() == self.model.counts(), self.where("tables disagree")

    # -- arguments --------------------------------------------------------------------
    def pick(self, kind: str) -> tuple[int, bool]:
        """A held handle of ``kind``; else (rarely) a stale or other-kind index, which
        the canonical ABI refuses with a trap (the second item says so)."""
        held = self.model.of(kind)
        roll = self.rng.random()
        if held and roll < 0.98:
            return self.rng.choice(held), False
        if not held and roll < 0.93:
            raise Skip
        stale = sorted(self.model.gone - set(self.model.held))
        if stale and roll < 0.985:
            return self.rng.choice(stale), True
        others = [i for i, k in self.model.held.items() if k != kind]
        if others and self.rng.random() < 0.5:
            return self.rng.choice(others), True
        return max([*self.model.held, *self.model.gone, 0]) + 1 + self.rng.randrange(3), True

    def dims_and_data(self) -> tuple[list[int], int, bytes]:
        rng = self.rng
        roll = rng.random()
        ty = rng.randrange(len(TYPES))
        if roll < 0.45:  # what the affine/identity graphs take
            ty = TYPES.index("FP32") if rng.random() < 0.8 else ty
            dims = [rng.choice([1, 2, 3]), 4]
        elif roll < 0.6:
            dims = [rng.choice([0, 1, 2, 3, 4, 7]) for _ in range(rng.randrange(0, 5))]
        elif roll < 0.7:  # products that overflow u32 / u64
            dims = [U32] * rng.choice([1, 2, 3]) + [rng.choice([0, 1, 2])]
            rng.shuffle(dims)
        elif roll < 0.8:  # ranks around and past 32
            dims = [rng.choice([0, 1, 2, U32, 0x10000])
                    for _ in range(rng.choice([31, 32, 33, 40, 64]))]
        elif roll < 0.83:
            dims = [U32] * rng.choice([1000, 5000])
        else:
            dims = [rng.choice([0, 1, 5, 0x7FFF_FFFF, 0x8000_0000, U32, rng.getrandbits(32)])
                    for _ in range(rng.randrange(1, 6))]
        count = 1
        for d in dims:
            count *= d
        size = count * ITEMSIZE[TYPES[ty]]
        if size <= 4096 and rng.random() < 0.7:
            length = size + rng.choice([0, 0, 0, -1, 1, -size])
        else:
            length = rng.choice([0, 1, 4, 16, 32, 100, 4096])
        length = max(0, length)
        data = np.arange(length, dtype=np.uint8).tobytes()
        return dims, ty, data

    def tensor_name(self) -> str:
        return self.rng.choice(TENSOR_NAMES)

    # -- operations -------------------------------------------------------------------
    async def tensor_new(self) -> None:
        dims, ty, data = self.dims_and_data()
        full = self.model.counts()["tensor"] >= self.limits.max_tensors
        index = await self.call("tensor-new", dims, ty, data,
                                host_trap="max_tensors" if full else None)
        assert not full, self.where("tensor-new past max_tensors did not trap")
        self.model.add(index, "tensor")
        self.model.made[index] = (dims, data)

    async def tensor_read(self) -> None:
        index, stale = self.pick("tensor")
        what = self.rng.choice(["tensor-dims", "tensor-ty", "tensor-data"])
        value = await self.call(what, index, abi_trap=stale, host_trap=(
            "its constructor did not keep" if what == "tensor-data" else None))
        made = self.model.made.get(index)
        if made is None:
            return
        dims, data = made
        if what == "tensor-dims" and len(dims) <= 32:
            assert value == dims, self.where(f"dims {value} for {dims}")
        if what == "tensor-data" and value and data is not None:
            assert bytes(value) == data, self.where("data changed")

    async def drop(self) -> None:
        if not self.model.held:
            return
        index = self.rng.choice(sorted(self.model.held))
        kind = self.model.held[index]
        stale = False
        if self.rng.random() < 0.03:  # maybe a double drop, or a drop of the wrong kind
            kind = self.rng.choice(KINDS)
            index, stale = self.pick(kind)
        name = {"tensor": "tensor-drop", "graph": "graph-drop",
                "graph-execution-context": "ctx-drop", "error": "error-drop"}[kind]
        await self.call(name, index, abi_trap=stale)
        self.model.remove(index)

    async def load(self) -> None:
        builders = self.rng.choice(MODELS)
        encoding = ONNX if self.rng.random() < 0.6 else self.rng.randrange(ENCODINGS)
        target = 0 if self.rng.random() < 0.7 else self.rng.randrange(TARGETS)
        await self.result(await self.call("load", builders, encoding, target), "graph")

    async def load_by_name(self) -> None:
        name = self.rng.choice(NAMES)
        await self.result(await self.call("load-by-name", name), "graph")

    async def init(self) -> None:
        graph, stale = self.pick("graph")
        if not self.legacy and self.rng.random() < 0.3:
            target = self.rng.randrange(TARGETS)
            value = await self.call("init-on", graph, target, abi_trap=stale)
        else:
            value = await self.call("init", graph, abi_trap=stale)
        await self.result(value, "graph-execution-context")

    def named(self) -> tuple[list[tuple[str, int]], bool]:
        tensors = self.model.of("tensor")
        self.rng.shuffle(tensors)
        count = self.rng.choice([0, 1, 1, 1, 2, 3])
        named = [(self.tensor_name(), t) for t in tensors[:count]]
        stale = False
        if named and self.rng.random() < 0.04:  # the same owned handle twice
            named.append((self.tensor_name(), named[0][1]))
            stale = True
        return named, stale

    async def compute(self) -> None:
        named, twice = self.named()
        if self.rng.random() < 0.8 or not self.model.of("graph"):
            ctx, stale = self.pick("graph-execution-context")
            call: tuple[Any, ...] = ("compute", ctx, named)
        else:
            graph, stale = self.pick("graph")
            target = None if self.rng.random() < 0.7 else self.rng.randrange(TARGETS)
            call = ("graph-compute", graph, named, target)
        value = await self.call(*call, abi_trap=stale or twice)
        for _, t in named:  # owned: they left the guest, whatever the result
            if t in self.model.held:
                self.model.remove(t)
        await self.result(value, None)

    async def set_input(self) -> None:
        ctx, stale = self.pick("graph-execution-context")
        tensor, stale_t = self.pick("tensor")
        value = await self.call("set-input", ctx, self.tensor_name(), tensor,
                                abi_trap=stale or stale_t)
        self.model.remove(tensor)
        await self.result(value, None)

    async def compute_staged(self) -> None:
        ctx, stale = self.pick("graph-execution-context")
        await self.result(await self.call("compute", ctx, abi_trap=stale), None)

    async def get_output(self) -> None:
        ctx, stale = self.pick("graph-execution-context")
        value = await self.call("get-output", ctx, self.tensor_name(), abi_trap=stale)
        await self.result(value, "tensor")

    async def error_new(self) -> None:
        full = self.model.counts()["error"] >= self.limits.max_errors
        code = self.rng.randrange(len(CODES))
        data = self.rng.choice(["", "made by the guest", "é" * 3000, "d" * 100_000])
        index = await self.call("error-new", code, data,
                                host_trap="max_errors" if full else None)
        assert not full, self.where("error-new past max_errors did not trap")
        self.model.add(index, "error")
        if self.rng.random() < 0.5:
            assert CODES[await self.call("error-code", index)] == CODES[code]
            kept = await self.call("error-data", index)
            assert kept == data or "bytes elided" in kept, self.where("error data lost")

    async def tensor_from_words(self) -> None:
        dims, ty, data = self.dims_and_data()
        if self.rng.random() < 0.7:
            data += b"\0" * (-len(data) % 8)
        else:
            data = data[: len(data) // 8 * 8]
        value = await self.call("tensor-from-words", dims, ty, data)
        if await self.result(value, "tensor") is not None:
            self.model.made[value.payload] = (dims, None)

    async def tensor_words(self) -> None:
        index, stale = self.pick("tensor")
        await self.call("tensor-words", index, abi_trap=stale,
                        host_trap="its constructor did not keep")

    async def load_words(self) -> None:
        builders = []
        for builder in self.rng.choice(MODELS):
            words = builder + b"\0" * (-len(builder) % 8)
            size = len(builder) + self.rng.choice([0, 0, 0, 1, -1, 8, 2**63])
            builders.append((max(0, size), words))
        encoding = ONNX if self.rng.random() < 0.6 else self.rng.randrange(ENCODINGS)
        target = 0 if self.rng.random() < 0.7 else self.rng.randrange(TARGETS)
        await self.result(await self.call("load-words", builders, encoding, target), "graph")

    async def error_read(self) -> None:
        index, stale = self.pick("error")
        what = self.rng.choice(["error-code", "error-data"])
        await self.call(what, index, abi_trap=stale)

    async def step(self) -> None:
        ops: list[tuple[float, Any]] = [
            (4, self.tensor_new), (1, self.tensor_read), (3, self.drop), (2, self.load),
            (2, self.load_by_name), (2, self.init), (0.5, self.error_read),
        ]
        if self.legacy:
            ops += [(3, self.set_input), (1.5, self.compute_staged), (1.5, self.get_output)]
            if LEGACY.endswith("06-25"):
                ops.append((0.7, self.error_new))
        else:
            ops += [(3.5, self.compute), (0.7, self.tensor_from_words),
                    (0.3, self.tensor_words), (0.5, self.load_words)]
        weights = [w for w, _ in ops]
        (op,) = self.rng.choices([fn for _, fn in ops], weights)
        self.ops.append(op.__name__)
        try:
            await op()
        except Skip:
            return
        self.agree()

    async def drop_everything(self) -> None:
        names = {"tensor": "tensor-drop", "graph": "graph-drop",
                 "graph-execution-context": "ctx-drop", "error": "error-drop"}
        order = sorted(self.model.held)
        self.rng.shuffle(order)
        for index in order:
            await self.call(names[self.model.held[index]], index)
            self.model.remove(index)
        self.agree()


def _short(args: tuple[Any, ...]) -> str:
    text = repr(args)
    return text if len(text) <= 80 else text[:77] + "..."


async def fuzz(rt: RecordingRuntime, caplog: pytest.LogCaptureFixture, component: Component, *,
               legacy: bool, sequences: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    outcomes = {"clean": 0, "host-trap": 0, "abi-trap": 0, "calls": 0}
    threads: list[str] | None = None
    for number in range(sequences):
        limits = rng.choice(LIMITS) or GuestLimits()
        guest = await ComponentGuest.start(rt, component, limits=limits,
                                           program=f"fuzz-{number}")
        seq = Sequence(guest, rng, limits, caplog, legacy)
        try:
            for _ in range(rng.randrange(4, CALLS + 1)):
                await seq.step()
                outcomes["calls"] += 1
            await seq.drop_everything()
            assert guest.live() == dict.fromkeys(KINDS, 0)
            outcomes["clean"] += 1
        except AbiTrap:
            outcomes["abi-trap"] += 1
        except GuestTrap:
            outcomes["host-trap"] += 1
        finally:
            await guest.aclose()
            for op in seq.ops:
                outcomes[op] = outcomes.get(op, 0) + 1
            for op in seq.errors:
                outcomes["error from " + op] = outcomes.get("error from " + op, 0) + 1
        assert guest.live() == dict.fromkeys(KINDS, 0), f"sequence {number} left handles"
        assert all(g.unloaded for g in rt.graphs), f"sequence {number} left a graph loaded"
        rt.graphs.clear()
        busy = [s for s in rt.stats() if s.running or s.queued]
        assert not busy, f"sequence {number}: devices still busy: {busy}"
        assert not host_bugs(caplog), host_bugs(caplog)
        now = wasinn_threads()
        if threads is None or number < 3:  # worker threads start on first use
            threads = now
        assert now == threads, f"sequence {number}: wasinn threads {threads} -> {now}"
    return outcomes


@pytest.fixture(scope="module")
def shim_component() -> Component:
    return compile_guest(shim_1028(), "shim_1028")


@pytest.fixture(scope="module")
def legacy_component() -> Component:
    return compile_guest(shim_legacy(LEGACY), f"shim@{LEGACY}")


async def test_fuzz_the_2024_10_28_abi(rt: RecordingRuntime, caplog: pytest.LogCaptureFixture,
                                       shim_component: Component) -> None:
    outcomes = await fuzz(rt, caplog, shim_component, legacy=False,
                          sequences=SEQUENCES, seed=SEED)
    # the fuzz reaches every ending (clean, trapped by a limit, trapped by the ABI) and
    # every operation, and the operations answer with errors as well as results
    assert all(outcomes[k] > 0 for k in ("clean", "host-trap", "abi-trap")), outcomes
    for op in ("compute", "load", "load_words", "tensor_from_words", "init"):
        assert outcomes.get(op, 0) > outcomes.get("error from " + op, 0) > 0, outcomes


async def test_fuzz_the_2024_06_25_abi(rt: RecordingRuntime, caplog: pytest.LogCaptureFixture,
                                       legacy_component: Component) -> None:
    outcomes = await fuzz(rt, caplog, legacy_component, legacy=True,
                          sequences=LEGACY_SEQUENCES, seed=SEED + 1)
    assert all(outcomes[k] > 0 for k in ("clean", "host-trap", "abi-trap")), outcomes
    for op in ("set_input", "compute_staged", "get_output", "error_new", "load"):
        assert outcomes.get(op, 0) > 0, outcomes


# -- defects the fuzz found -----------------------------------------------------------------
#: Dimensions with no elements (a zero) whose other dimensions span more bytes than any
#: array may: numpy refused the shape with a bare ValueError, which the constructor
#: logged as a host error and answered with a neutral ``U8[0]`` tensor (losing the
#: guest's dimensions and type), and which the fallible calls reported as ``unknown``.
EMPTY_BUT_HUGE = [1, 0, U32, 0, 0x7FFF_FFFF]


def test_an_empty_tensor_too_wide_for_an_array_is_invalid_not_a_host_error(
        caplog: pytest.LogCaptureFixture) -> None:
    from wasinn.errors import InvalidArgumentError
    from wasinn.host.component.service import NNService

    svc = NNService(None, None)  # type: ignore[arg-type]
    rep = svc.tensor_new(EMPTY_BUT_HUGE, "BF16", b"")
    entry = svc.tables.tensors.get(rep)
    assert isinstance(entry.invalid, InvalidArgumentError)
    assert "even for an empty tensor" in entry.invalid.message
    assert "times the element size (2 bytes) at most" in entry.invalid.message
    assert svc.tensor_dims(rep) == EMPTY_BUT_HUGE and svc.tensor_type(rep) == "BF16"
    with pytest.raises(InvalidArgumentError, match="even for an empty tensor"):
        svc.tensor_from_words(EMPTY_BUT_HUGE, "FP32", b"")
    # an empty tensor that numpy can hold is still fine
    fine = svc.tensor_new([0, U32, U32 // 8], "FP32", b"")
    assert svc.tables.tensors.get(fine).tensor is not None
    assert not host_bugs(caplog)


async def test_a_guest_gets_invalid_argument_for_an_empty_tensor_too_wide_for_an_array(
        rt: RecordingRuntime, caplog: pytest.LogCaptureFixture, shim_component: Component) -> None:
    guest = await ComponentGuest.start(rt, shim_component, program="shim_1028")
    async with guest:
        t = await guest.call("tensor-new", EMPTY_BUT_HUGE, TYPES.index("BF16"), b"")
        assert await guest.call("tensor-dims", t) == EMPTY_BUT_HUGE
        assert TYPES[await guest.call("tensor-ty", t)] == "BF16"
        graph = (await guest.call("load-by-name", "affine")).payload
        ctx = (await guest.call("init", graph)).payload
        error = await guest.call("compute", ctx, [("x", t)])
        assert isinstance(error, int)  # result<list<named-tensor>, error>: the error handle
        assert CODES[await guest.call("error-code", error)] == "invalid-argument"
        message = await guest.call("error-data", error)
        assert "input 'x'" in message and "even for an empty tensor" in message
        words = await guest.call("tensor-from-words", EMPTY_BUT_HUGE, TYPES.index("FP32"), b"")
        assert words.tag == "err"
        assert CODES[await guest.call("error-code", words.payload)] == "invalid-argument"
        for name, handle in [("error-drop", words.payload), ("error-drop", error),
                             ("ctx-drop", ctx), ("graph-drop", graph)]:
            await guest.call(name, handle)
        assert guest.live() == dict.fromkeys(KINDS, 0)
    assert not host_bugs(caplog)
