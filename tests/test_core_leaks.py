"""A finished core-module guest leaves nothing behind, whatever its calls returned."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import wasmtime

import wasinn
from wasinn.host.core_bindings import live_host_functions
from wasinn.host.runner import run_wasm

# Touches 10 MB of its memory, then makes a call that fails (an unknown model name).
FAILING_CALL = """
(module
  (import "wasi_ephemeral_nn" "load_by_name" (func $lbn (param i32 i32 i32) (result i32)))
  (memory (export "memory") 200)
  (data (i32.const 0) "nope")
  (func (export "_start")
    (memory.fill (i32.const 1024) (i32.const 1) (i32.const 10000000))
    (drop (call $lbn (i32.const 0) (i32.const 4) (i32.const 16)))))
"""


def _live_stores() -> int:
    gc.collect()
    # type(), not isinstance(): isinstance on some deprecated torch objects warns.
    return sum(type(o) is wasmtime.Store for o in gc.get_objects())


@pytest.mark.parametrize("rounds", [5])
async def test_guests_whose_calls_fail_free_their_store(tmp_path: Path, rounds: int) -> None:
    guest = tmp_path / "failing_call.wat"
    guest.write_text(FAILING_CALL)
    async with wasinn.Runtime() as rt:
        assert await run_wasm(rt, guest) == 0
        after_one = _live_stores()  # whatever earlier tests left has been collected here
        functions_after_one = live_host_functions()
        for _ in range(rounds):
            assert await run_wasm(rt, guest) == 0
        # An errno must not keep the guest's Store (and its linear memory) alive: more
        # guests must not mean more live Stores.
        assert _live_stores() <= after_one
        # Nor its host functions: Wasmtime drops them with the guest's linker, and each
        # one's guard (GuestNN and all) is forgotten then.
        assert live_host_functions() <= functions_after_one
