"""Bounding the wasm a guest executes: ``[guests] max_fuel`` (``wasinn run --fuel N``).

Wasmtime counts *fuel*: each wasm instruction a guest executes uses some (about one
unit), and a store whose fuel runs out traps. The bound is deterministic, unlike
``run_timeout``'s wall time: the same guest on the same input uses the same fuel on
any machine and under any load. Counting needs ``Config.consume_fuel``, an engine
setting that slows every guest of that engine, so only guests whose limits set
``max_fuel`` run on the engine that counts (:func:`wasinn.host.engine.engine_for`).

A guest's fuel is set once, before its start functions run, and is what the instance may
use in its whole life: a core module's start function and ``_start``; a component's start
functions, its ``run`` and every later call of its exports. Host calls use none: fuel
bounds the guest's own wasm, not the inference it asks for (a wasi-nn compute runs in the
backend, however long; bound it with ``compute_timeout``, and a whole run's wall time
with ``run_timeout``).
"""

from __future__ import annotations

import wasmtime

#: What wasmtime's out-of-fuel trap says (a component's trap has no trap code).
_OUT_OF_FUEL_TEXT = "all fuel consumed by WebAssembly"


def ran_out_of_fuel(exc: BaseException, store: wasmtime.Store) -> bool:
    """Whether ``exc``, raised by a call of the guest of ``store`` (a store that counts
    fuel), is wasmtime's out-of-fuel trap.

    A core module's trap says so by its code. A component's has no code, only text, which
    a guest could also put in its backtrace (a function named so): the store's fuel must
    be spent as well."""
    if isinstance(exc, wasmtime.Trap) and exc.trap_code is not None:
        return exc.trap_code == wasmtime.TrapCode.OUT_OF_FUEL
    return _OUT_OF_FUEL_TEXT in str(exc) and store.get_fuel() == 0


def out_of_fuel(program: str, fuel: int | None) -> str:
    """The trap message of ``program`` stopped by its ``fuel`` bound."""
    return (f"{program} ran out of fuel: it executed more wasm than its {fuel} units allow "
            f"([guests] max_fuel = {fuel}, or wasinn run --fuel {fuel}); give it more fuel "
            "if its work needs it, or look for an endless loop in it (fuel counts the "
            "guest's own instructions, not the inference it asks for)")
