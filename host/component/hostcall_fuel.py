"""Wasmtime's bound on what one call of a component guest may copy into the host.

Before Wasmtime hands a guest's call to a host function it lifts the arguments into
values, and it charges each call's lifting against a *hostcall fuel* of
:data:`HOSTCALL_FUEL_BYTES`: :data:`BYTES_PER_VALUE` for every list element (what a
lifted value costs the host). A call whose list arguments hold more than
:data:`MAX_VALUES_PER_CALL` values in all traps before the host sees it, with a message
that names neither the bound nor a way round. Rust embedders raise the fuel with
``Store::set_hostcall_fuel``; Wasmtime's C API, and so wasmtime-py, has no such setter
(checked on wasmtime-py 50: none among the library's exported symbols), so wasinn cannot.

So a ``list<u8>`` argument holds at most about 2.8 MB: the spec's tensor constructor
cannot take an f32 1x3x512x512 image, nor ``graph.load`` a MobileNet-size model. The
``wasinn:nn`` extension's ways round are ``wasinn:nn/bulk`` (``tensor-from-words``,
``load-words``: eight bytes a value, about 22.4 MB a call) and ``wasinn:nn/scratch``
(``tensor-from-scratch``, and ``load-from-scratch`` for a model of any size up to
``[guests] max_model_bytes``: the bytes go through files, no list at all), and
``load-by-name`` for a model the host registered. :func:`explained` turns the trap into
a message that says all that. The figures were measured on wasmtime-py 50
(``tests/test_component_hostcall_fuel.py`` fails if they change).
"""

from __future__ import annotations

#: The root cause of the trap, as Wasmtime words it (``LiftContext::consume_fuel``).
EXHAUSTED = ("too much data is being copied between the host and the guest: "
             "fuel allocated for hostcalls has been exhausted")

#: Wasmtime's hostcall fuel for each call a guest makes into the host.
HOSTCALL_FUEL_BYTES = 128 * 1024**2

#: The fuel each lifted list element costs (a ``u8`` as much as a ``u64``).
BYTES_PER_VALUE = 48

#: The most list elements the arguments of one call may hold together (2,796,202).
MAX_VALUES_PER_CALL = HOSTCALL_FUEL_BYTES // BYTES_PER_VALUE


def exhausted(message: str) -> bool:
    """Whether ``message``, a guest's trap as wasmtime-py words it, is the hostcall fuel
    running out. Only its last line (the root cause, after the guest's backtrace, whose
    function names the guest chooses) counts."""
    lines = message.strip().splitlines()
    return bool(lines) and lines[-1].strip() == EXHAUSTED


def explained(program: str, message: str) -> str:
    """The trap message of ``program`` whose call ran out of hostcall fuel: what happened,
    the bound, and what to use instead; wasmtime's own ``message`` comes last."""
    byte_list = MAX_VALUES_PER_CALL - 1  # (a tensor's dimensions take one value at least)
    return (
        f"{program} trapped: one of its calls passed the host more list values than "
        f"Wasmtime lets one call copy (at most {MAX_VALUES_PER_CALL:,} values in all: its "
        f"hostcall fuel of {HOSTCALL_FUEL_BYTES // 1024**2} MiB at {BYTES_PER_VALUE} bytes "
        "a value, which wasmtime-py cannot raise), so a list<u8> of at most about "
        f"{byte_list / 1e6:.1f} MB, such as the data of the spec's tensor constructor or "
        "a graph.load builder. Pass tensor data with wasinn:nn/bulk's tensor-from-words "
        f"(8 bytes a value: up to about {8 * byte_list / 1e6:.1f} MB a call) or "
        "wasinn:nn/scratch's tensor-from-scratch (any size up to [guests] "
        "max_tensor_bytes, through a file), and models with wasinn:nn/scratch's "
        "load-from-scratch (any size up to [guests] max_model_bytes, through files), "
        "wasinn:nn/bulk's load-words "
        f"(up to about {8 * byte_list / 1e6:.1f} MB of builders a call) or load-by-name "
        f"(a model the host registered). Wasmtime's message: {message.strip()}"
    )
