"""Stopping one running guest without stopping the others.

Epoch interruption is engine-wide: ``engine.increment_epoch()`` reaches every store. To
stop only the guest being cancelled, each store gets an epoch deadline of one tick and
an *epoch-deadline callback*: when any guest is interrupted the epoch moves on, every
running store calls its callback once at its next check, and the callback traps only
if its own guest was asked to stop; the others carry on with a new one-tick deadline.
Epochs move only when a guest is interrupted, so the callbacks cost nothing otherwise.

No request is lost to timing. One made before the store is armed (while the guest's
thread starts) arms it to trap at its first check. One made while the store's callback
decides to carry on may fall before wasmtime sets the new deadline, which then counts the
request's tick already: the guest's run moves the epoch again every
:data:`~wasinn.host.guest_thread.REMIND_S` while the stopped guest goes on
(:meth:`Interrupter.remind`).

wasmtime-py exposes the callback only in its raw C bindings
(``wasmtime_store_epoch_deadline_callback``, present since wasmtime 14); their presence
is checked at import. Without them a guest is still stopped at its next host call.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import wasmtime

log = logging.getLogger("wasinn.host")

try:
    from wasmtime import _bindings as _raw

    _SET_CALLBACK: Any = _raw._wasmtime_store_epoch_deadline_callback
    _CALLBACK_TYPE: Any = _SET_CALLBACK.argtypes[1]
    _FINALIZER_TYPE: Any = _SET_CALLBACK.argtypes[3]
    _ERROR_NEW: Any = _raw.wasmtime_error_new
except (ImportError, AttributeError, IndexError):  # pragma: no cover - other wasmtime-py
    _SET_CALLBACK = None

#: wasmtime_update_deadline_kind_t: keep running with the new deadline.
_CONTINUE = 0

#: The message of the trap an interrupted guest stops with.
INTERRUPTED = "wasm guest interrupted: its run_wasm call was cancelled"


class Interrupter:
    """The stop switch of one guest's store (see the module docstring). Thread-safe."""

    def __init__(self, engine: wasmtime.Engine) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self._requested = False
        self._finished = False
        self._stop = threading.Event()  # set with _requested: wakes a guest's sleep
        self._callback: Any = None  # kept alive as long as the store may call it
        self._also: list[Callable[[], None]] = []

    @property
    def requested(self) -> bool:
        return self._requested

    def install(self, store: wasmtime.Store) -> None:
        """Arm ``store``: it traps at its next epoch check after :meth:`request`, and at
        its first one if the request came before (while the guest's thread was starting).
        """
        if _SET_CALLBACK is None:
            log.warning("this wasmtime-py has no epoch-deadline callback: a cancelled guest "
                        "stops only at its next wasi-nn call")
            store.set_epoch_deadline(2**62)
        else:

            def on_deadline(_ctx: Any, _env: Any, delta: Any, kind: Any) -> int:
                return self._on_deadline(delta, kind)

            self._callback = _CALLBACK_TYPE(on_deadline)
            _SET_CALLBACK(store.ptr(), self._callback, None, _FINALIZER_TYPE())
            store.set_epoch_deadline(1)
        # The deadline is one tick past the epoch as it is now: a request made before
        # has moved the epoch already, and its tick is not awaited. request() sets the flag
        # before it moves the epoch, so a request this check misses moves it after the
        # deadline was set, and reaches it.
        if self._requested:
            store.set_epoch_deadline(0)  # the first check traps (the callback sees the flag)

    def _on_deadline(self, delta: Any, kind: Any) -> int:
        """The store's epoch-deadline callback: trap if the guest was asked to stop,
        else carry on with a deadline one tick on.

        wasmtime sets that deadline once this has returned, from the epoch as it is then:
        a request made in between has moved the epoch already and is not awaited. The
        guest's run moves the epoch again while the stopped guest goes on
        (:meth:`remind`), which reaches it."""
        if self._requested:
            err = _ERROR_NEW(INTERRUPTED.encode())
            return ctypes.cast(err, ctypes.c_void_p).value or 0
        delta[0] = 1
        kind[0] = _CONTINUE
        return 0

    def request(self) -> None:
        """Ask the guest to stop (no effect once it has finished)."""
        with self._lock:
            if self._finished or self._requested:
                return
            self._requested = True
            also = list(self._also)
        self._stop.set()
        self._engine.increment_epoch()
        for action in also:
            action()

    def remind(self) -> None:
        """Move the epoch again if the guest was asked to stop and has not finished: for
        a request that the store's callback missed (see :meth:`_on_deadline`). Called
        while a stopped guest's thread has not ended
        (:class:`~wasinn.host.guest_thread.GuestRun`); every running guest's callback then
        runs once, and only this one traps."""
        with self._lock:
            if not self._requested or self._finished:
                return
        self._engine.increment_epoch()

    def also_stop(self, action: Callable[[], None]) -> None:
        """Call ``action`` (once) when the guest is asked to stop, at once if it already
        was: how a host call that blocks outside wasm, such as a read of the guest's
        stdin (:mod:`wasinn.host.guest_stdin`), is ended."""
        with self._lock:
            if not self._requested:
                self._also.append(action)
                return
        action()

    def sleep(self, seconds: float) -> bool:
        """Block the guest's thread for ``seconds`` (a WASI sleep), or until the guest is
        asked to stop; True when it was (the caller then traps the guest)."""
        stop = self._stop
        end = time.monotonic() + seconds
        while not stop.is_set():
            left = end - time.monotonic()
            if left <= 0:
                return False
            stop.wait(min(left, threading.TIMEOUT_MAX))
        return True

    def finish(self) -> None:
        """The guest has stopped: later requests are no-ops."""
        with self._lock:
            self._finished = True
