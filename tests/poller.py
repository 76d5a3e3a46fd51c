"""wasinn's ``poll_oneoff`` called directly, in a store of its own, with subscription
records the test writes: what tests/test_guest_sleep.py and tests/test_wasi_poll_bounds.py
share."""

from __future__ import annotations

import struct
import time

import wasmtime

from wasinn.host.engine import shared_engine
from wasinn.host.interrupt import Interrupter
from wasinn.host.wasi_poll import define_interruptible_poll

#: The size of one subscription record and of one event, in bytes.
SUBSCRIPTION_BYTES, EVENT_BYTES = 48, 32


def subscription(userdata: int, tag: int, clock: int = 1, timeout: int = 0,
                 flags: int = 0) -> bytes:
    """One subscription record (``clock`` 1: the monotonic clock)."""
    return struct.pack("<QB7xIIQQH6x", userdata, tag, clock, 0, timeout, 0, flags)


def _module(pages: int) -> str:
    return f"""
(module
  (import "wasi_snapshot_preview1" "poll_oneoff"
    (func $poll (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") {pages})
  (func (export "poll") (param i32 i32 i32 i32) (result i32)
    (call $poll (local.get 0) (local.get 1) (local.get 2) (local.get 3))))
"""


class Poller:
    """A guest of ``pages`` of memory that calls poll_oneoff with the records written at
    ``at``, its events at ``events`` and their count at ``nevents``."""

    def __init__(self, pages: int = 1, *, at: int = 0x100, events: int = 0x800,
                 nevents: int = 0xF00) -> None:
        self.at, self.events, self.nevents = at, events, nevents
        engine = shared_engine()
        self.store = wasmtime.Store(engine)
        self.store.set_wasi(wasmtime.WasiConfig())
        Interrupter(engine).install(self.store)  # (else its epoch deadline has passed)
        linker = wasmtime.Linker(engine)
        linker.define_wasi()
        define_interruptible_poll(linker, Interrupter(engine), time.monotonic_ns())
        exports = linker.instantiate(
            self.store, wasmtime.Module(engine, _module(pages))).exports(self.store)
        memory, poll = exports["memory"], exports["poll"]
        assert isinstance(memory, wasmtime.Memory) and isinstance(poll, wasmtime.Func)
        self.memory, self.poll = memory, poll

    def __call__(self, *records: bytes, count: int | None = None, at: int | None = None
                 ) -> tuple[int, list[tuple[int, int, int]]]:
        """poll_oneoff's errno, and the events it reported: (userdata, errno, type);
        ``count`` subscriptions (by default, as many as ``records`` hold) at ``at``."""
        at = self.at if at is None else at
        written = b"".join(records)
        if written:
            self.memory.write(self.store, written, at)
        n = len(written) // SUBSCRIPTION_BYTES if count is None else count
        errno = self.poll(self.store, at, self.events, n, self.nevents)
        if errno != 0:
            return errno, []
        (got,) = struct.unpack("<I", self.memory.read(self.store, self.nevents,
                                                      self.nevents + 4))
        data = self.memory.read(self.store, self.events, self.events + EVENT_BYTES * got)
        return errno, [struct.unpack_from("<QHB", data, EVENT_BYTES * i) for i in range(got)]
