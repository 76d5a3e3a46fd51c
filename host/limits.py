"""Per-guest resource limits, set by the config's ``[guests]`` table, enforced by both ABIs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import wasmtime

from wasinn.enums import ExecutionTarget
from wasinn.errors import SecurityError

#: The most a 32-bit linear memory can hold (65,536 pages of 64 KiB): the default bound.
WASM32_MEMORY_BYTES = 4 * 1024**3
#: How many linear memories and tables one guest's store may create (a component has a
#: few core instances, each with its own), and elements each table may hold.
MAX_MEMORIES, MAX_TABLES, MAX_TABLE_ELEMENTS = 16, 64, 10_000_000
#: Peak host memory, in bytes, that wasmtime's C API spends on each value of a list it
#: lowers into a component guest, measured with wasmtime-py 50 (the 32-byte C value that
#: :mod:`wasinn.host.component.fastlist` fills, the rest in wasmtime's own conversion):
#: 80 per byte for ``tensor.data()`` (``list<u8>``), 10 per byte for ``tensor-words``.
LOWERING_BYTES_PER_VALUE = 80


@dataclass(frozen=True)
class GuestLimits:
    """What one guest instance may hold and do. Beyond a size limit the guest gets too-large.

    ``max_graphs``: graphs loaded (a component guest's context keeps its graph loaded after
    the handle is dropped); ``max_contexts``: live handles; ``max_model_bytes``: total bytes of
    model builders loaded by this guest; ``max_tensor_bytes``: the size of one tensor.
    ``allowed_targets``: the execution targets the guest may ask for (None = all); another
    raises SecurityError (component guests see ``security``; the legacy ABI has no such
    errno, so core modules see ``invalid_argument``). ``compute_timeout``: seconds one
    compute may take (None = unbounded); past it the request is cancelled and the guest
    gets ``timeout`` (core modules: ``runtime_error``). ``max_scratch_bytes``: what a
    component guest may keep in its ``wasinn:nn/scratch`` directory (all entries' allocated
    blocks), ``max_scratch_files`` how many entries, ``max_scratch_open_files`` how many
    descriptors it may hold open on that directory and in it (its preopen counts one);
    the host checks all three while the guest runs and after each call, and stops a
    guest that goes over (a trap naming the limit).

    Component guests only: ``max_tensors``/``max_errors``: live ``tensor``/``error``
    handles; ``max_live_tensor_bytes``: the tensor data a guest holds at once (its live
    tensor handles plus, with the older RCs, the inputs a context stages with
    ``set-input`` and the outputs it keeps for ``get-output``; a tensor held several
    ways counts once). A call that can report an error gets too-large naming the limit;
    where the host cannot hand out the resource a call must return (the tensor
    constructor past ``max_tensors``, any error past ``max_errors``) it traps the guest
    with a message naming the limit. ``max_data_bytes``: the most tensor bytes one
    ``tensor.data()`` call hands the guest (``tensor-words``: 8 times as many, the same
    number of list values); wasmtime's C API costs the host about
    :data:`LOWERING_BYTES_PER_VALUE` bytes of memory per list value while it lowers a
    list into the guest, so a call costs 80 times its size (the default, 16 MiB: about
    1.25 GiB for a moment, at most; per call, not host-wide: the host cannot tell when
    wasmtime has finished lowering a list, so it keeps no budget of them). Past it, or past
    ``max_tensor_bytes``, the call (which has no error case) traps the guest with a
    message naming the limit and ``wasinn:nn/scratch``'s ``tensor-to-scratch``, which
    has no such cost.

    ``sandbox``: the models the guest loads from its own bytes are compiled and run in a
    process of their own each (:mod:`wasinn.backends.sandbox`), so that a library that
    crashes on them kills that process, not the host: on the CPU (``"cpu"``, the
    default: on a GPU a graph keeps its tensors on the device, which a process of its own
    cannot share), on every device (True) or nowhere (False). ``max_sandbox_bytes``
    bounds the memory each such process may hold (None: half the machine's memory, or
    half the limit of the host's cgroup where that is less, as a container's may be).

    ``run_timeout``: seconds a guest's whole run (``run_wasm``: its start functions and
    ``_start`` or ``wasi:cli/run``) may take (None = unbounded); past it the guest is
    stopped wherever it is, as a cancelled one is, and ``run_wasm`` raises GuestTrap
    naming the limit.

    ``max_fuel``: the wasm the guest may execute, in wasmtime's fuel (about one unit an
    instruction; None = unbounded), over its instance's whole life; past it the guest
    traps and ``run_wasm`` raises GuestTrap naming the limit. Host calls (wasi-nn
    inference) use none (:mod:`wasinn.host.fuel`). Such a guest runs on the engine that
    counts fuel (:func:`wasinn.host.engine.engine_for`).

    ``max_memory_bytes`` bounds each linear memory of the guest (a ``memory.grow`` beyond
    it fails, as when a machine has no more: the guest's allocator sees -1); a guest may
    have at most :data:`MAX_MEMORIES` memories and :data:`MAX_TABLES` tables of at most
    :data:`MAX_TABLE_ELEMENTS` elements each (a table's elements take host memory too).
    """

    max_graphs: int = 64
    max_contexts: int = 1024
    max_model_bytes: int = 2 * 1024**3
    max_tensor_bytes: int = 1024**3
    allowed_targets: frozenset[ExecutionTarget] | None = None
    compute_timeout: float | None = None
    run_timeout: float | None = None
    max_fuel: int | None = None
    max_scratch_bytes: int = 2 * 1024**3
    max_scratch_files: int = 10_000
    max_scratch_open_files: int = 64
    max_tensors: int = 4096
    max_errors: int = 1024
    max_live_tensor_bytes: int = 4 * 1024**3
    max_data_bytes: int = 16 * 1024**2
    sandbox: bool | Literal["cpu"] = "cpu"
    max_sandbox_bytes: int | None = None
    max_memory_bytes: int = WASM32_MEMORY_BYTES

    @property
    def counts_fuel(self) -> bool:
        """Whether the guest's fuel is counted (``max_fuel`` is set): it then runs on
        ``engine_for(fuel=True)``."""
        return self.max_fuel is not None

    def check_target(self, target: ExecutionTarget | None) -> None:
        """Raise SecurityError when ``target`` (None = the graph's default) is not allowed."""
        if target is None or self.allowed_targets is None or target in self.allowed_targets:
            return
        allowed = ", ".join(sorted(t.value for t in self.allowed_targets)) or "none"
        raise SecurityError(
            f"this guest may not use execution target {target.value}: the host allows "
            f"{allowed} ([guests] allowed_targets)"
        )

    def load_options(self) -> dict[str, object] | None:
        """The options a guest's ``load`` passes to the runtime."""
        if not self.sandbox:
            return None
        if self.max_sandbox_bytes is None:
            return {"sandbox": self.sandbox}
        return {"sandbox": self.sandbox, "max_sandbox_bytes": self.max_sandbox_bytes}


def limit_store(store: wasmtime.Store, limits: GuestLimits) -> None:
    """Bound what ``store``'s guest may allocate in wasm, and its fuel (see
    :class:`GuestLimits`). Before anything of the guest runs: its fuel is that of its
    whole life. A store with ``max_fuel`` must be of ``engine_for(fuel=True)``."""
    store.set_limits(memory_size=limits.max_memory_bytes, table_elements=MAX_TABLE_ELEMENTS,
                     memories=MAX_MEMORIES, tables=MAX_TABLES)
    if limits.max_fuel is not None:
        store.set_fuel(limits.max_fuel)


def limits_of(runtime: object) -> GuestLimits:
    """The guest limits a runtime's config sets (its ``[guests]`` table), else the defaults."""
    section = getattr(getattr(runtime, "config", None), "guests", None)
    if section is None:
        return GuestLimits()
    targets = getattr(section, "allowed_targets", None)
    return GuestLimits(
        max_graphs=section.max_graphs,
        max_contexts=section.max_contexts,
        max_model_bytes=section.max_model_bytes,
        max_tensor_bytes=section.max_tensor_bytes,
        allowed_targets=None if targets is None
        else frozenset(ExecutionTarget.coerce(t) for t in targets),
        compute_timeout=getattr(section, "compute_timeout", None),
        run_timeout=getattr(section, "run_timeout", None),
        max_fuel=getattr(section, "max_fuel", None),
        max_scratch_bytes=section.max_scratch_bytes,
        max_scratch_files=section.max_scratch_files,
        max_scratch_open_files=section.max_scratch_open_files,
        max_tensors=section.max_tensors,
        max_errors=section.max_errors,
        max_live_tensor_bytes=section.max_live_tensor_bytes,
        max_data_bytes=section.max_data_bytes,
        sandbox=section.sandbox,
        max_sandbox_bytes=section.max_sandbox_bytes,
        max_memory_bytes=section.max_memory_bytes,
    )
