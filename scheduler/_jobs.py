"""The jobs a device runs on compiled graphs: one model's run, or a pipeline's steps run
one after another on one device (a chain), with the graphs held while they run.

A job runs in an actor's worker thread, or in the caller's own thread under a lease (see
:mod:`wasinn.actors.lease`). Each graph it runs is held (its session's in-use count) from
before its first run until it is over, so that an unload meanwhile closes it only after
the job: :func:`hold` and :func:`let_go`. A chain feeds each step's native outputs to the
next along its links, stops between steps once its job is cancelled, and prefixes a
step's error with the pipeline's name and the step (:func:`step_label`). A request's
chain (``counted``; not a warm-up's) times each step's run in its thread and counts it
in the step model's figures (:meth:`~wasinn.actors.stats.RequestStats.record_run`; a
merged run's, once its batch job knows the requests it answered:
:class:`~wasinn.actors.stats.MergedRun`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence

from wasinn.actors.lease import Lease
from wasinn.actors.session import Session
from wasinn.backends.base import CompiledGraph, current_cancellation
from wasinn.errors import BackendRuntimeError, ClosedResourceError, WasiNNError
from wasinn.tensor import Tensor

from .model import Inputs, LoadedModel

#: How one pipeline step feeds the next: (previous output name, next input name) pairs.
Link = tuple[tuple[str, str], ...]
#: A lease's job on graphs held for it: (graphs, inputs, keep_on_device) -> outputs.
RunHeld = Callable[[Sequence[CompiledGraph], Inputs, bool], dict[str, Tensor]]
#: A pipeline's name and its steps' models, for its errors (see :func:`step_label`).
Named = tuple[str, Sequence[LoadedModel]]


def run_session(session: Session, inputs: Inputs, keep: bool) -> dict[str, Tensor]:
    # Runs in the actor's worker thread; the in-use count defers an unload's close.
    compiled = session.acquire()
    try:
        return compiled.run(inputs, keep_on_device=keep)
    finally:
        session.release()


def run_first(held: Sequence[CompiledGraph], inputs: Inputs, keep: bool
              ) -> dict[str, Tensor]:
    # A model lease's job (a RunHeld): the one graph held for it.
    return held[0].run(inputs, keep_on_device=keep)


def run_chain(sessions: Sequence[Session], links: Sequence[Link], inputs: Inputs,
              keep: bool, *, named: Named | None = None, counted: bool = False
              ) -> dict[str, Tensor]:
    # Runs in the actor's worker thread; the in-use counts defer an unload's close.
    held = hold(sessions)  # raises before any run if one was unloaded
    try:
        return chain(links, held, inputs, keep, named=named, counted=counted)
    finally:
        let_go(sessions)


def step_label(named: Named | None, step: int) -> str | None:
    """How a pipeline's errors name its step ``step``: the pipeline, the step's number and
    model, and, after the first, the step that fed it (its inputs came from there, not
    from the caller). None for a chain with no name (a warm-up's). Made only for an
    error: nothing is formatted on a request's way."""
    if named is None:
        return None
    name, models = named
    fed = f", fed by step {step - 1}" if step else ""
    return f"pipeline {name!r} step {step} ({models[step].name!r}{fed})"


def chain(links: Sequence[Link], compiled: Sequence[CompiledGraph], inputs: Inputs,
          keep: bool, *, named: Named | None = None, counted: bool = False,
          leased: bool = False) -> dict[str, Tensor]:
    # Every step on this device, natives passed along. A cancelled job (abandoned, or its
    # device closing) stops between steps, whatever its backends can interrupt. A step's
    # error is prefixed with its label (step_label). ``counted`` (a request's chain,
    # ``named``): each step's run is counted in its model's figures (``leased``: in a
    # lease holder's thread), but a run that raised as its job was cancelled
    # (interrupted) is no failure of its model's.
    cancellation = current_cancellation()
    last = len(compiled) - 1
    current: dict[str, Tensor] = {}
    models = named[1] if counted and named is not None else None
    for step, graph in enumerate(compiled):
        if step and cancellation is not None and cancellation.cancelled:
            raise BackendRuntimeError(
                f"pipeline cancelled after step {step} of {len(compiled)}")
        fed = inputs if step == 0 else {inp: current[out] for out, inp in links[step - 1]}
        start = time.perf_counter()
        try:
            current = graph.run(fed, keep_on_device=keep or step < last)
        except Exception as exc:  # (a WasiNNError, or the backend's library's own)
            if models is not None and not (cancellation is not None
                                           and cancellation.cancelled):
                models[step].requests.record_run(time.perf_counter() - start, failed=True,
                                                 leased=leased)
            label = step_label(named, step)
            if label is None:
                raise
            if isinstance(exc, WasiNNError):
                raise exc.prefixed(label) from exc
            raise BackendRuntimeError(  # as backend_failure says it
                f"{label}: the backend failed: {type(exc).__name__}: {exc}") from exc
        if models is not None:
            models[step].requests.record_run(time.perf_counter() - start, leased=leased)
    return current


def hold(sessions: Sequence[Session]) -> list[CompiledGraph]:
    """Every session's graph, each acquired (in use until :func:`let_go`). Raises
    ClosedResourceError, holding none, when one was unloaded."""
    held: list[CompiledGraph] = []
    try:
        for session in sessions:
            held.append(session.acquire())
    except ClosedResourceError:
        let_go(sessions[: len(held)])
        raise
    return held


def let_go(sessions: Sequence[Session]) -> None:
    """Release what :func:`hold` acquired (in any thread)."""
    for session in sessions:
        session.release()


def held_by(lease: Lease[dict[str, Tensor]] | None, sessions: Sequence[Session]
            ) -> Lease[dict[str, Tensor]] | None:
    # A lease taken for a job on held graphs lets go of them once over; no lease: now.
    if lease is None:
        let_go(sessions)
    else:
        lease.then(functools.partial(let_go, sessions))
    return lease
