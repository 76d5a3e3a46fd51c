"""The runtime's device actors, served by a trio system task of their own.

Actors outlive the call that starts them and stop when the runtime closes. A trio
nursery belongs to the task and the nesting level that opened it, so hosting the actors
in the caller's task would tie ``Runtime.aclose`` to that task and level: a close from
another task, or from inside a cancel scope opened since (the usual shielded clean-up in
a ``finally``), would corrupt trio's state. Here the nursery lives in a system task, so
``stop`` works from any task and any scope. A runtime never closed is stopped when
``trio.run`` ends, which cancels system tasks.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import trio

from wasinn.actors.device import DeviceActor

log = logging.getLogger("wasinn.scheduler")


class ActorHost:
    """Starts ``actors`` (:meth:`start`) and stops them (:meth:`stop`), from any task."""

    def __init__(self, actors: Sequence[DeviceActor]) -> None:
        self._actors = tuple(actors)
        self._settled = trio.Event()  # every actor ready, or the start failed
        self._stop = trio.Event()
        self._stopped = trio.Event()
        self._failure: Exception | None = None

    async def start(self) -> None:
        """Start every actor; return once each reports ready.

        Raises what the first actor that fails to start raises (UnsupportedOperationError
        for a device that cannot be opened), with the others stopped again; cancelled,
        the actors are stopped before the cancellation goes on.
        """
        trio.lowlevel.spawn_system_task(self._serve, name="wasinn device actors")
        try:
            await self._settled.wait()
        except BaseException:
            await self.stop()
            raise
        if self._failure is not None:
            await self.stop()
            raise self._failure

    async def stop(self) -> None:
        """Close every actor and wait until they have stopped (shielded: see
        :meth:`DeviceActor.serve`, whose shutdown is bounded by ``close_timeout``).
        Idempotent."""
        for actor in self._actors:
            actor.close()
        self._stop.set()
        with trio.CancelScope(shield=True):
            await self._stopped.wait()

    async def _serve(self) -> None:
        # The system task. It must not raise (trio would crash the whole run): a failure
        # is kept for start, or logged once the actors were serving.
        try:
            async with trio.open_nursery() as nursery:
                try:
                    for actor in self._actors:
                        await nursery.start(actor.serve)
                except Exception as exc:
                    self._failure = exc
                    nursery.cancel_scope.cancel()
                    return
                finally:
                    self._settled.set()
                await self._stop.wait()
                nursery.cancel_scope.cancel()
        except Exception:
            log.exception("the device actors stopped unexpectedly; requests fail until "
                          "the runtime is closed")
        finally:
            for actor in self._actors:
                actor.close()
            self._stopped.set()
