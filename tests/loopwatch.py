"""A heartbeat that tells whether the trio event loop was blocked.

``heartbeat`` runs a task that wakes every millisecond and records the longest gap
between wake-ups. A compute that held the loop for T seconds shows up as a gap >= T, so
``with heartbeat.watch(): await ...`` fails when the longest gap is half the block's
duration or more (a ratio measured in the same run, not a wall-time constant).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import trio


class Heartbeat:
    def __init__(self) -> None:
        self.max_gap = 0.0
        self.beats = 0
        self._since = time.perf_counter()

    async def run(self) -> None:
        last = time.perf_counter()
        while True:
            await trio.sleep(0.001)
            now = time.perf_counter()
            # A gap is counted from the last beat or the last reset, whichever is later:
            # what held the loop before the section under watch is not the section's.
            self.max_gap = max(self.max_gap, now - max(last, self._since))
            self.beats += 1
            last = now

    def reset(self) -> None:
        self.max_gap = 0.0
        self.beats = 0
        self._since = time.perf_counter()

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        """Fail if the loop was held for half the block's duration or more.

        Use around awaits that take long (tens of milliseconds): a compute that blocked
        the loop for its whole duration shows up as one gap that long.
        """
        self.reset()
        start = time.perf_counter()
        yield
        elapsed = time.perf_counter() - start
        assert self.beats > 0, "the heartbeat never ran: the event loop was blocked"
        assert self.max_gap < elapsed / 2, (
            f"the event loop was blocked for {self.max_gap * 1e3:.1f} ms of a "
            f"{elapsed * 1e3:.1f} ms block"
        )


@pytest.fixture
async def heartbeat() -> AsyncIterator[Heartbeat]:
    """A running :class:`Heartbeat` (reset it right before the section under watch)."""
    beat = Heartbeat()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(beat.run)
        yield beat
        nursery.cancel_scope.cancel()
