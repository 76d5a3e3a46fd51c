"""``GraphCloser``: evicted graphs whose close blocks, closed in threads.

Closing some compiled graphs blocks (a sandboxed one's close waits for its processes to
end: see ``CompiledGraph.close_blocks``). When a device actor evicts such a graph and
nothing runs it any more, the close runs in a thread, from a task of the actor's,
shielded: the event loop never waits for it, and a closing actor's nursery waits for it
before the device context closes. Once the actor has no nursery left, the graph is
closed there and then. :meth:`GraphCloser.wait` (the actor's ``graphs_closed``) waits
for the closes under way.
"""

from __future__ import annotations

import logging

import trio

from wasinn.backends.base import CompiledGraph, Device
from wasinn.errors import ClosedResourceError

from .sessioncache import StartTask

log = logging.getLogger("wasinn.actors")


class GraphCloser:
    """The closes of one device actor's evicted graphs (see the module docstring);
    ``start_task`` runs a task as long as the actor serves (ClosedResourceError once it
    does not)."""

    def __init__(self, device: Device, start_task: StartTask) -> None:
        self.device = device
        self._start_task = start_task
        #: Evicted graphs being closed in a thread (see close_later): each one's event,
        #: set once it is closed.
        self._closing: set[trio.Event] = set()

    async def wait(self) -> None:
        """Wait until the graphs evicted so far whose close blocks are closed (at once
        when none is being closed); not for those evicted meanwhile."""
        for closed in list(self._closing):
            await closed.wait()
        await trio.lowlevel.checkpoint()

    def close_later(self, compiled: CompiledGraph) -> None:
        # In trio: close ``compiled`` (its close blocks) in a thread, from a task of the
        # actor's, shielded (a closing actor's nursery waits for it, before the device
        # context closes); here and now once the actor has no nursery left.
        closed = trio.Event()
        self._closing.add(closed)
        try:
            self._start_task(self._close_in_thread, (compiled, closed))
        except ClosedResourceError:
            self._closing.discard(closed)
            closed.set()
            compiled.close()

    async def _close_in_thread(self, job: tuple[CompiledGraph, trio.Event]) -> None:
        compiled, closed = job
        try:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(compiled.close)
        except Exception:
            log.exception("%s: closing an evicted graph failed", self.device)
        finally:
            self._closing.discard(closed)
            closed.set()
