"""A core-module guest's WASI ``poll_oneoff``, which its cancellation cuts short.

wasmtime's ``poll_oneoff`` blocks the guest's thread in Rust for as long as the guest
asked (a guest may ask for 2**64 ns), where the epoch interruption that stops a
cancelled guest (:mod:`wasinn.host.interrupt`, checked in wasm code) cannot reach it: a
guest could make itself impossible to stop. wasinn's own ``poll_oneoff`` replaces it:

- clock subscriptions (what wasi-libc's ``sleep``, ``nanosleep`` and ``poll``'s timeout
  ask for) sleep in :meth:`Interrupter.sleep`, until the earliest one is due; cancelled,
  the guest gets ``intr`` back and traps at the epoch check as it returns to wasm. An
  absolute time is read on the realtime clock, or on the guest's monotonic clock
  (wasmtime's counts from the guest's start: ``started`` here, within a millisecond);
  the CPU-time clocks, which wasmtime does not have either, are ``notsup``;
- a file descriptor subscription is ready at once (a guest's files are regular files,
  always ready, as POSIX has them; a read of its stdin then waits in ``fd_read``);
- as wasmtime's: no subscription is ``inval``, records outside the guest's memory
  ``fault``, a module without a ``memory`` export traps.
"""

from __future__ import annotations

import struct
import time

import wasmtime

from wasinn.host.interrupt import Interrupter

#: Sizes of WASI's ``subscription`` and ``event`` records.
_SUBSCRIPTION, _EVENT = 48, 32
#: A subscription: ``userdata`` (u64), tag (u8: 0 clock, 1 fd_read, 2 fd_write), then
#: for a clock its id (u32: 0 realtime, 1 monotonic), timeout (u64 ns), precision (u64)
#: and flags (u16: bit 0 "abstime"). (An fd subscription's fd is not needed here.)
_SUBSCRIPTION_FORM = struct.Struct("<QB7xIIQQH6x")
#: An event: ``userdata``, ``errno`` (u16), type (u8, the subscription's tag), then 21
#: bytes of fd_readwrite (nbytes, flags), all zero here.
_EVENT_FORM = struct.Struct("<QHB21x")
_SUCCESS, _FAULT, _INTR, _INVAL, _NOTSUP = 0, 21, 27, 28, 58
_CLOCK, _FD_WRITE = 0, 2  # subscription tags (1 is fd_read)
_REALTIME, _MONOTONIC, _CPU_TIME = 0, 1, (2, 3)  # clock ids (process, thread)
_ABSTIME = 1  # a clock subscription's flag


def define_interruptible_poll(linker: wasmtime.Linker, interrupter: Interrupter,
                              started: int) -> None:
    """Define ``poll_oneoff`` in ``linker`` (over WASI's) as the module docstring says.
    ``started``: ``time.monotonic_ns()`` when the guest's WASI context was made."""

    def poll_oneoff(caller: wasmtime.Caller, subscriptions: int, events: int, count: int,
                    nevents: int) -> int:
        memory = caller.get("memory")
        if not isinstance(memory, wasmtime.Memory):
            raise wasmtime.Trap("missing required memory export")
        # (i32 arguments come signed: pointers past 2 GiB as negative numbers)
        subscriptions, events, count, nevents = (
            p & 0xFFFFFFFF for p in (subscriptions, events, count, nevents))
        if count == 0:
            return _INVAL
        size = memory.data_len(caller)
        if (subscriptions + count * _SUBSCRIPTION > size or events + count * _EVENT > size
                or nevents + 4 > size):
            return _FAULT
        data = memory.read(caller, subscriptions, subscriptions + count * _SUBSCRIPTION)
        ready: list[tuple[int, int]] = []  # (userdata, tag) of the fds: ready now
        clocks: list[tuple[int, int]] = []  # (userdata, due: time.monotonic_ns())
        for offset in range(0, len(data), _SUBSCRIPTION):
            userdata, tag, clock, _, timeout, _, flags = _SUBSCRIPTION_FORM.unpack_from(
                data, offset)
            if tag != _CLOCK:
                if tag > _FD_WRITE:
                    return _INVAL
                ready.append((userdata, tag))
                continue
            due = _due(clock, timeout, flags, started)
            if due is None:
                return _NOTSUP if clock in _CPU_TIME else _INVAL
            clocks.append((userdata, due))
        if not ready and clocks:
            wait = min(due for _, due in clocks) - time.monotonic_ns()
            if wait > 0 and interrupter.sleep(wait / 1e9):
                return _INTR
        now = time.monotonic_ns()
        fired = ready + [(userdata, _CLOCK) for userdata, due in clocks if due <= now]
        memory.write(caller, b"".join(_EVENT_FORM.pack(u, _SUCCESS, tag) for u, tag in fired),
                     events)
        memory.write(caller, struct.pack("<I", len(fired)), nevents)
        return _SUCCESS

    i32 = wasmtime.ValType.i32()
    linker.allow_shadowing = True
    try:
        linker.define_func("wasi_snapshot_preview1", "poll_oneoff",
                           wasmtime.FuncType([i32] * 4, [i32]), poll_oneoff,
                           access_caller=True)
    finally:
        linker.allow_shadowing = False


def _due(clock: int, timeout: int, flags: int, started: int) -> int | None:
    """When a clock subscription is due, on ``time.monotonic_ns()``; None for a clock
    that has no such time (the CPU-time clocks, an unknown id)."""
    if not flags & _ABSTIME:
        return time.monotonic_ns() + timeout if clock <= _MONOTONIC else None
    if clock == _REALTIME:
        return time.monotonic_ns() + (timeout - time.time_ns())
    if clock == _MONOTONIC:
        return started + timeout
    return None
