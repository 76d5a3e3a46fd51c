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
  ``fault``; of several bad subscriptions, the first one's errno is returned;
- more than :data:`MAX_SUBSCRIPTIONS` subscriptions is ``inval`` (as Linux's ``poll``
  refuses more descriptors than the process may open): the call holds the guest's thread
  outside wasm, where a stop cannot reach it, and a guest could otherwise pass its
  whole memory (4 GiB: 89 million subscriptions) in one call. The records are read as
  one numpy array and handled column by column, never one Python object each;
- a module without a ``memory`` export gets ``fault`` (wasmtime's own traps). Nothing
  raises out of this host function: wasmtime-py keeps an exception raised there in a
  process-wide "last exception" until a wasm call that ends in error picks it up, and
  that may be another guest's, running at the same time in another thread, which would
  then be reported as trapped with this guest's message. A failure of the host itself
  is logged and the guest gets ``io``.
"""

from __future__ import annotations

import contextlib
import logging
import struct
import time

import numpy as np
import numpy.typing as npt
import wasmtime

from wasinn.host.interrupt import Interrupter

log = logging.getLogger("wasinn.host")

#: The most subscriptions one ``poll_oneoff`` call may pass; beyond it the guest gets
#: ``inval``. wasi-libc's ``poll()`` passes at most ``2 * nfds + 1`` (a read and a write
#: subscription per descriptor, one clock for the timeout), its ``select()`` at most
#: ``2 * FD_SETSIZE + 1`` (2,049): this bound lets ``poll()`` watch 4,096 descriptors,
#: each both ways, with a timeout. It costs the host at most about 0.7 MB a call.
MAX_SUBSCRIPTIONS = 2 * 4096 + 1

#: Sizes of WASI's ``subscription`` and ``event`` records.
_SUBSCRIPTION, _EVENT = 48, 32
#: A subscription: ``userdata`` (u64), tag (u8: 0 clock, 1 fd_read, 2 fd_write), then
#: for a clock its id (u32: 0 realtime, 1 monotonic), timeout (u64 ns), precision (u64,
#: not needed) and flags (u16: bit 0 "abstime"). (An fd subscription's fd is not needed.)
_SUBSCRIPTION_RECORD = np.dtype({
    "names": ["userdata", "tag", "clock", "timeout", "flags"],
    "formats": ["<u8", "u1", "<u4", "<u8", "<u2"],
    "offsets": [0, 8, 16, 24, 40],
    "itemsize": _SUBSCRIPTION,
})
#: An event: ``userdata``, ``errno`` (u16), type (u8, the subscription's tag), then the
#: fd_readwrite fields (nbytes, flags), all zero here.
_EVENT_RECORD = np.dtype({
    "names": ["userdata", "errno", "type"],
    "formats": ["<u8", "<u2", "u1"],
    "offsets": [0, 8, 10],
    "itemsize": _EVENT,
})
_SUCCESS, _FAULT, _INTR, _INVAL, _IO, _NOTSUP = 0, 21, 27, 28, 29, 58
_CLOCK, _FD_WRITE = 0, 2  # subscription tags (1 is fd_read)
_REALTIME, _MONOTONIC, _CPU_TIME = 0, 1, (2, 3)  # clock ids (process, thread)
_ABSTIME = 1  # a clock subscription's flag
_U64_MAX = 2**64 - 1

Records = npt.NDArray[np.void]


def define_interruptible_poll(linker: wasmtime.Linker, interrupter: Interrupter,
                              started: int) -> None:
    """Define ``poll_oneoff`` in ``linker`` (over WASI's) as the module docstring says.
    ``started``: ``time.monotonic_ns()`` when the guest's WASI context was made."""

    def poll_oneoff(caller: wasmtime.Caller, subscriptions: int, events: int, count: int,
                    nevents: int) -> int:
        try:
            return _poll_oneoff(caller, interrupter, started, subscriptions, events, count,
                                nevents)
        except BaseException:  # never into wasmtime-py: see the module docstring
            with contextlib.suppress(BaseException):
                log.exception("poll_oneoff failed inside the host (a wasinn bug); the guest "
                              "gets io")
            return _IO

    i32 = wasmtime.ValType.i32()
    linker.allow_shadowing = True
    try:
        linker.define_func("wasi_snapshot_preview1", "poll_oneoff",
                           wasmtime.FuncType([i32] * 4, [i32]), poll_oneoff,
                           access_caller=True)
    finally:
        linker.allow_shadowing = False


def _poll_oneoff(caller: wasmtime.Caller, interrupter: Interrupter, started: int,
                 subscriptions: int, events: int, count: int, nevents: int) -> int:
    memory = caller.get("memory")
    if not isinstance(memory, wasmtime.Memory):
        return _FAULT
    # (i32 arguments come signed: pointers past 2 GiB as negative numbers)
    subscriptions, events, count, nevents = (
        p & 0xFFFFFFFF for p in (subscriptions, events, count, nevents))
    if count == 0 or count > MAX_SUBSCRIPTIONS:
        return _INVAL
    size = memory.data_len(caller)
    if (subscriptions + count * _SUBSCRIPTION > size or events + count * _EVENT > size
            or nevents + 4 > size):
        return _FAULT
    records = np.frombuffer(
        memory.read(caller, subscriptions, subscriptions + count * _SUBSCRIPTION),
        dtype=_SUBSCRIPTION_RECORD)
    refused = _first_refusal(records)
    if refused:
        return refused
    tags = records["tag"]
    clocks = np.flatnonzero(tags == _CLOCK)
    ready = np.flatnonzero(tags != _CLOCK)  # the fds: ready now
    due = _ClockDue(records[clocks], started)
    if not ready.size and clocks.size:
        wait = due.earliest() - time.monotonic_ns()
        if wait > 0 and interrupter.sleep(wait / 1e9):
            return _INTR
    fired = np.concatenate([ready, clocks[due.fired(time.monotonic_ns())]])
    if fired.size:
        # Straight into the guest's memory (in bounds: fired.size <= count), not through
        # Memory.write's two intermediate copies.
        reported = np.frombuffer(
            memoryview(memory.get_buffer_ptr(caller, fired.size * _EVENT, events)),
            dtype=_EVENT_RECORD)
        reported[:] = np.zeros(1, dtype=_EVENT_RECORD)
        reported["userdata"] = records["userdata"][fired]
        reported["type"] = tags[fired]
    memory.write(caller, struct.pack("<I", fired.size), nevents)
    return _SUCCESS


def _first_refusal(records: Records) -> int:
    """The errno of the first subscription that cannot be served (0 when none): ``inval``
    for an unknown tag or clock, ``notsup`` for a CPU-time clock."""
    tags, ids = records["tag"], records["clock"]
    refused = (tags > _FD_WRITE) | ((tags == _CLOCK) & (ids > _MONOTONIC))
    if not refused.any():
        return 0
    first = int(refused.argmax())
    return _NOTSUP if tags[first] == _CLOCK and ids[first] in _CPU_TIME else _INVAL


class _ClockDue:
    """When each clock subscription is due, on ``time.monotonic_ns()``.

    A clock is due at ``base + timeout``, where the base is ``time.monotonic_ns()`` now
    for a relative time, ``now - time.time_ns()`` for an absolute realtime, and the
    guest's start for an absolute monotonic time: three groups, each compared by its
    timeouts alone (u64, never added to in numpy, where they could overflow)."""

    def __init__(self, clocks: Records, started: int) -> None:
        now = time.monotonic_ns()
        absolute = (clocks["flags"] & _ABSTIME) != 0
        ids = clocks["clock"]
        self._timeouts = clocks["timeout"]
        self._groups = [
            (~absolute, now),
            (absolute & (ids == _REALTIME), now - time.time_ns()),
            (absolute & (ids == _MONOTONIC), started),
        ]

    def earliest(self) -> int:
        """When the first clock is due (the clocks are not none)."""
        return min(base + int(self._timeouts[group].min())
                   for group, base in self._groups if group.any())

    def fired(self, at: int) -> npt.NDArray[np.bool_]:
        """Which clocks are due by ``at``."""
        fired = np.zeros(self._timeouts.size, dtype=bool)
        for group, base in self._groups:
            if at - base >= 0:
                fired |= group & (self._timeouts <= np.uint64(min(at - base, _U64_MAX)))
        return fired
