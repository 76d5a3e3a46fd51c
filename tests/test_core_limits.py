"""Guest limits come from the config's ``[guests]`` table and bind core-module guests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import wasinn
from tests.guest_support import load_by_name_guest
from tests.support import require_backend
from wasinn.configs import ConfigError
from wasinn.configs.loader import parse_config
from wasinn.errors import InvalidArgumentError
from wasinn.host.limits import GuestLimits, limits_of
from wasinn.host.runner import run_wasm
from wasinn.host.tensor_binding import run_context
from wasinn.modelgen import affine_onnx

# A guest whose exit code is the errno of `load(BUILDERS builders, onnx, TARGET)`: the
# builder at 0x10 is 4 bytes of junk at 0x20.
LOAD_ON_TARGET = """
(module
  (import "wasi_ephemeral_nn" "load" (func $load (param i32 i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
  (memory (export "memory") 1)
  (data (i32.const 0x10) "\\20\\00\\00\\00\\04\\00\\00\\00")
  (data (i32.const 0x20) "junk")
  (func (export "_start")
    (call $exit (call $load (i32.const 0x10) (i32.const BUILDERS) (i32.const 1)
                            (i32.const TARGET) (i32.const 64)))))
"""
INVALID_ARGUMENT, INVALID_ENCODING = 1, 2


def test_defaults_without_a_guests_table() -> None:
    rt = wasinn.Runtime(parse_config({}, None))
    assert limits_of(rt) == GuestLimits()
    assert limits_of(object()) == GuestLimits()


def test_guests_table_sets_every_limit() -> None:
    config = parse_config({"guests": {"max_graphs": 2, "max_tensor_bytes": 1024,
                                      "allowed_targets": ["CPU"], "compute_timeout": 2.5}}, None)
    assert limits_of(wasinn.Runtime(config)) == GuestLimits(
        max_graphs=2, max_tensor_bytes=1024,
        allowed_targets=frozenset({wasinn.ExecutionTarget.CPU}), compute_timeout=2.5)


@pytest.mark.parametrize(
    ("table", "message"),
    [({"allowed_targets": ["fpga"]}, "guests.allowed_targets"),
     ({"max_graphs": 0}, "guests.max_graphs"),
     ({"compute_timeout": -1}, "guests.compute_timeout"),
     ({"max_graph": 3}, "guests.max_graph")],
)
def test_bad_guests_table_names_the_key(table: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"guests": table}, None)


def test_check_target_names_what_is_allowed() -> None:
    limits = GuestLimits(allowed_targets=frozenset({wasinn.ExecutionTarget.CPU}))
    limits.check_target(wasinn.ExecutionTarget.CPU)
    limits.check_target(None)
    with pytest.raises(wasinn.SecurityError, match=r"may not use execution target gpu.*cpu"):
        limits.check_target(wasinn.ExecutionTarget.GPU)


@pytest.mark.parametrize(("target", "allowed", "builders", "errno"), [
    (1, None, 1, None),                   # gpu, unrestricted: reaches the loader
    (1, ["cpu"], 1, INVALID_ARGUMENT),    # gpu refused before anything is read
    (0, ["cpu"], 1, INVALID_ENCODING),    # cpu allowed: the junk bytes are the error
    (0, ["cpu"], 0, INVALID_ARGUMENT),    # no builder at all: a bad argument
])
async def test_core_guest_targets_follow_allowed_targets(
    tmp_path: Path, target: int, allowed: list[str] | None, builders: int, errno: int | None
) -> None:
    guest = tmp_path / "load_on_target.wat"
    guest.write_text(LOAD_ON_TARGET.replace("TARGET", str(target))
                     .replace("BUILDERS", str(builders)))
    config = parse_config({"guests": {"allowed_targets": allowed}} if allowed else {}, None)
    async with wasinn.Runtime(config) as rt:
        code = await run_wasm(rt, guest)
    if errno is None:
        assert code not in (0, INVALID_ARGUMENT)
    else:
        assert code == errno


async def test_compute_timeout_cancels_the_run() -> None:
    require_backend("onnxruntime")
    async with wasinn.Runtime() as rt:
        graph = await rt.load([affine_onnx()], encoding="onnx")
        ctx = graph.init_execution_context()
        x = wasinn.Tensor.from_numpy(np.ones((1, 4), np.float32))
        with pytest.raises(wasinn.TimeoutError_, match="compute_timeout"):
            await run_context(ctx, {"x": x}, {}, ["y"], timeout=1e-9)
        # The context still serves a compute within its limit.
        out = await run_context(ctx, {"x": x}, {}, ["y"], timeout=60)
        np.testing.assert_allclose(out["y"].numpy(), np.full((1, 4), 3.0))


@pytest.mark.parametrize(("allowed", "errno"), [(None, 0), (["gpu"], INVALID_ARGUMENT)])
async def test_load_by_name_respects_allowed_targets(
    tmp_path: Path, allowed: list[str] | None, errno: int
) -> None:
    # The registry, not the guest, picks a named model's target (cpu here): a guest
    # limited to gpu must not get it through load_by_name either.
    require_backend("onnxruntime")
    (tmp_path / "net.onnx").write_bytes(affine_onnx())
    guest = load_by_name_guest("net", tmp_path / "load_by_name.wat")
    table: dict[str, object] = {"models": {"net": {"files": ["net.onnx"], "target": "cpu"}}}
    if allowed:
        table["guests"] = {"allowed_targets": allowed}
    async with wasinn.Runtime(parse_config(table, tmp_path / "wasinn.toml")) as rt:
        assert await run_wasm(rt, guest) == errno


# A guest whose exit code is 1 when growing its memory by GROW pages fails (-1), else 0.
GROW = """
(module
  (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
  (memory (export "memory") 1)
  (func (export "_start")
    (call $exit (i32.eq (memory.grow (i32.const PAGES)) (i32.const -1)))))
"""


async def test_memory_grows_up_to_max_memory_bytes(tmp_path: Path) -> None:
    # Before: nothing bounded a guest's memory (one grew to 4 GiB and touched it all).
    guest = tmp_path / "grow.wat"
    async with wasinn.Runtime(parse_config({}, None)) as rt:
        limits = GuestLimits(max_memory_bytes=16 * 65536)
        for pages, code in ((15, 0), (16, 1), (1000, 1)):
            guest.write_text(GROW.replace("PAGES", str(pages)))
            assert await run_wasm(rt, guest, limits=limits) == code
        guest.write_text(GROW.replace("PAGES", "1000"))
        assert await run_wasm(rt, guest) == 0  # the default: 4 GiB, reserved, not touched
    config = parse_config({"guests": {"max_memory_bytes": 1048576}}, None)
    assert limits_of(wasinn.Runtime(config)).max_memory_bytes == 1048576
    with pytest.raises(ConfigError, match=r"guests\.max_memory_bytes"):
        parse_config({"guests": {"max_memory_bytes": 2**33}}, None)


async def test_a_64_bit_memory_is_refused(tmp_path: Path) -> None:
    # Before: a memory64 guest grew to 64 GiB (more than this machine has).
    guest = tmp_path / "mem64.wat"
    guest.write_text('(module (memory i64 1) (func (export "_start")))')
    async with wasinn.Runtime(parse_config({}, None)) as rt:
        with pytest.raises(InvalidArgumentError,
                           match=r"(?s)mem64\.wat is not a valid WebAssembly module: "
                                 r".*memory64 must be enabled"):
            await run_wasm(rt, guest)


async def test_a_trapped_guests_memory_is_freed_when_run_wasm_raises(tmp_path: Path) -> None:
    # Before: the trap's traceback held the frames that held the Store, so a trapped
    # guest's whole memory stayed allocated until Python's next cyclic collection.
    import gc

    import wasmtime

    from wasinn.host.runner import GuestTrap

    guest = tmp_path / "trap.wat"
    guest.write_text('(module (memory 2) (func (export "_start") unreachable))')
    async with wasinn.Runtime(parse_config({}, None)) as rt:
        gc.collect()
        gc.disable()
        try:
            # (other tests' stores may still be alive: only this guest's is looked for;
            # type(), not isinstance(), which would ask deprecated modules for __class__)
            before = {id(o) for o in gc.get_objects() if type(o) is wasmtime.Store}
            with pytest.raises(GuestTrap, match=r"trap\.wat trapped"):
                await run_wasm(rt, guest)
            stores = [o for o in gc.get_objects()
                      if type(o) is wasmtime.Store and id(o) not in before]
        finally:
            gc.enable()
    assert stores == []


async def test_tables_and_memories_are_bounded_in_number_and_size(tmp_path: Path) -> None:
    # A table's elements take host memory (a guest grew one without bound before), and
    # each memory may grow to max_memory_bytes: their number is bounded too.
    from wasinn.host.limits import MAX_MEMORIES, MAX_TABLE_ELEMENTS

    guest = tmp_path / "table.wat"
    grow = ('(module (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32))) '
            '(memory (export "memory") 1) (table 0 funcref) (func (export "_start") '
            '(call $exit (i32.eq (i32.const -1) (table.grow (ref.null func) (i32.const N))))))')
    memories = tmp_path / "memories.wat"
    async with wasinn.Runtime(parse_config({}, None)) as rt:
        for elements, code in ((MAX_TABLE_ELEMENTS, 0), (MAX_TABLE_ELEMENTS + 1, 1)):
            guest.write_text(grow.replace("N", str(elements)))
            assert await run_wasm(rt, guest) == code
        for count, fits in ((MAX_MEMORIES, True), (MAX_MEMORIES + 1, False)):
            memories.write_text("(module " + "(memory 0) " * count
                                + '(func (export "_start")))')
            if fits:
                assert await run_wasm(rt, memories) == 0
            else:
                with pytest.raises(InvalidArgumentError,
                                   match=r"^cannot instantiate memories\.wat: .*memor"):
                    await run_wasm(rt, memories)
