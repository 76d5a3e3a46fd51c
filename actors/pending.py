"""Work in progress that several callers wait for (a compile, a registry load).

The first caller starts the work; callers arriving meanwhile wait on its :class:`Pending`
instead of starting it again. When it fails, every waiter gets an error of its own (a
copy of the same type and message, the original as its cause): one exception object
raised in several tasks would collect all their tracebacks.
"""

from __future__ import annotations

import trio

from wasinn.errors import WasiNNError


class Pending:
    """Work in progress: its worker sets ``error`` if it failed, then ``done``."""

    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.error: WasiNNError | None = None

    async def wait(self) -> None:
        """Return once the work is over; raise its error (a copy) if it failed."""
        await self.done.wait()
        if self.error is not None:
            raise self.error.for_another_caller()
