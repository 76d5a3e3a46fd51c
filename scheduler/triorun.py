"""Which trio run a call comes from.

A runtime's actors, queues and worker threads live in the trio run the runtime was
started in. Awaiting one of its methods anywhere else fails deep inside trio with a
message that names neither wasinn nor the cause (asyncio: "must be called from async
context"), or, from another trio run, may even appear to work while it mixes two runs'
task state: a request queued behind a busy slot would later be woken by the wrong run.
:func:`check_trio_run` turns both into a RuntimeError that says what happened. It costs
one thread-local read (well under a microsecond), so the request paths call it too. A
runtime whose trio run has ended was stopped with it (its actors were tasks of that
run): a call from a later run gets ClosedResourceError saying so, as a closed runtime's
callers do, and ``aclose`` has nothing left to do. One closed by ``aclose`` before its
run ended was not stopped by the run's end: a later run's call is told that it is
closed, in the words its own run's calls get.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

import trio

from wasinn.errors import ClosedResourceError, WasiNNError

P = ParamSpec("P")
T = TypeVar("T")


def yields_when_refused(call: Callable[P, Awaitable[T]]) -> Callable[P, Coroutine[Any, Any, T]]:
    """``call`` made to yield to trio before it raises a WasiNNError.

    A request refused at once (a full queue, a closed context or runtime, a bad
    argument) would otherwise raise without a checkpoint, and a caller that retries at
    once (a full queue says "retry later") would hold the event loop for ever: nothing
    else runs, the queue never drains, and not even ``trio.fail_after`` can end the loop.
    Trio's own functions checkpoint on every path for this reason. The checkpoint is a
    cancellation point too: a caller whose deadline has passed gets trio.Cancelled (the
    refusal as its context), so ``trio.fail_after`` ends a loop retrying a request that
    is refused for good (a closed context). Free when nothing is raised."""

    @functools.wraps(call)
    async def yielding(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await call(*args, **kwargs)
        except WasiNNError:
            if trio.lowlevel.in_trio_run():  # (else the caller's own error says more)
                await trio.lowlevel.checkpoint()
            raise

    return yielding


#: How :func:`check_trio_run` names a request (a compute, run or lease) in its message.
A_REQUEST = "a request (compute, run or lease)"
#: What a request to a runtime closed by ``aclose`` is told, in its run or a later one.
REQUESTS_CLOSED = "the runtime is closed: requests can no longer run"


def check_trio_run(token: trio.lowlevel.TrioToken | None, what: str,
                   closed: str | None = None) -> None:
    """RuntimeError unless the caller runs in trio and, where ``token`` is given, in the
    trio run that ``token`` belongs to; ClosedResourceError where that run has ended:
    with ``closed`` as its message where the caller gives one (the runtime was closed by
    ``aclose`` before the run ended: what the caller says of a closed runtime in its own
    run), else saying that the run's end stopped the runtime. ``what`` names the call in
    the message."""
    try:
        current = trio.lowlevel.current_trio_token()
    except RuntimeError:
        raise RuntimeError(
            f"{what} must be awaited in trio (inside trio.run): wasinn runs on trio, not "
            "on asyncio or any other event loop") from None
    if token is not None and current is not token:
        if run_ended(token):
            if closed is not None:
                raise ClosedResourceError(closed)
            raise ClosedResourceError(
                f"{what}: the trio run this runtime served has ended, and stopped the "
                "runtime with it: make a Runtime in this run")
        raise RuntimeError(
            f"{what}: this runtime was started in another trio run; it serves that run "
            "only: make a Runtime in this one, or reach that run with trio.from_thread")


def run_ended(token: trio.lowlevel.TrioToken) -> bool:
    """Whether the trio run ``token`` belongs to has ended (else: a no-op is queued
    there, harmless)."""
    try:
        token.run_sync_soon(_nothing)
    except trio.RunFinishedError:
        return True
    return False


def _nothing() -> None:
    pass
