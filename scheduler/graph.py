"""``Graph``: a handle on a loaded model (``Pipeline`` is one on a chain of models).

A graph's model is loaded once (bytes kept, backend chosen, compiled on its default
target's device at load so that bad bytes fail the load); contexts are tickets made from
it. Handles are refcounted against the model: ``unload`` ends this handle, and the
compiled sessions and device memory are freed once every handle is unloaded and every
context made from them is closed, and the runs still using them have ended, which the
unload that frees them waits for.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import trio

from wasinn.actors.batching import Batching
from wasinn.actors.lease import Lease
from wasinn.actors.stats import ModelStats
from wasinn.backends.base import TensorSpec
from wasinn.enums import ExecutionTarget
from wasinn.errors import ClosedResourceError, TimeoutError_
from wasinn.tensor import Tensor

from .context import (
    ExecutionContext,
    check_request,
    naming_timeout,
    request_deadline,
    tensor_inputs,
)
from .model import Executable, GivenInputs
from .placement import Scheduler
from .triorun import check_trio_run, yields_when_refused

log = logging.getLogger("wasinn.scheduler")


class Graph:
    """A loaded model. Not thread-safe: use it from the trio thread."""

    __slots__ = ("_executable", "_scheduler", "_unloaded", "default_target")

    def __init__(self, executable: Executable, scheduler: Scheduler,
                 default_target: ExecutionTarget) -> None:
        executable.retain()
        self._executable = executable
        self._scheduler = scheduler
        self.default_target = default_target
        self._unloaded = False

    def __repr__(self) -> str:
        state = "unloaded" if self._unloaded else self.default_target.value
        return f"<{type(self).__name__} {self._executable.name} {state}>"

    @property
    def name(self) -> str:
        return self._executable.name

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        return self._executable.inputs

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        return self._executable.outputs

    @property
    def input_aliases(self) -> Mapping[str, int]:
        """The other names inputs answer to (an OpenVINO port's further names: ``x:0``
        beside ``x``), each to its input's position; a run takes them as it takes the
        inputs' names."""
        return self._executable.input_aliases

    @property
    def backend(self) -> str:
        """The backend the host chose for the default target ("+"-joined for a pipeline of
        several; "" until the graph has been compiled for that target)."""
        return self._executable.backend_for(self.default_target)

    @property
    def unloaded(self) -> bool:
        return self._unloaded

    @property
    def batching(self) -> Batching | None:
        """How the model's requests are merged on a device, or None: it does not batch."""
        return self._executable.batching

    def stats(self) -> ModelStats:
        """The model's (a pipeline's: the whole pipeline's; a pipeline step's: with the
        runs pipelines made of it) requests on every device since it was loaded, by how
        they ended, with their latency percentiles, time queued and
        time running apart (see :class:`wasinn.actors.ModelStats`). Every handle on the
        same loaded model (``load_by_name``) sees the same figures; readable after
        ``unload`` too. These are this load's alone: :meth:`Runtime.model_stats` adds up
        the loads that share a name."""
        executable = self._executable
        return ModelStats.of(executable.name, executable.requests)

    def _check_loaded(self) -> None:
        if self._unloaded:
            raise ClosedResourceError(f"{self._executable.name} was unloaded")

    def _check_runtime(self) -> None:
        if self._scheduler.closed:
            raise ClosedResourceError(
                f"the runtime is closed: {self._executable.name} can no longer run")

    def init_execution_context(self, target: ExecutionTarget | str | None = None
                               ) -> ExecutionContext:
        """A new context running on ``target`` devices (None = the graph's default).

        No backend work happens here. Raises ClosedResourceError after ``unload`` or once
        the runtime is closed, InvalidArgumentError for an unknown target name,
        UnsupportedOperationError for a target no device here provides (unless the config
        allows a fallback: then a RuntimeWarning, pointing at the caller's line, names
        both targets).
        """
        self._check_loaded()
        self._check_runtime()
        kind = self.default_target if target is None else self._scheduler.resolve_target(target)
        return ExecutionContext(self._executable, kind)

    @yields_when_refused
    async def compute(
        self,
        inputs: GivenInputs,
        *,
        target: ExecutionTarget | str | None = None,
        priority: int = 0,
        timeout: float | None = None,
        tenant: str = "",
        keep_on_device: bool | None = None,
    ) -> dict[str, Tensor]:
        """One-shot run without a context (see ExecutionContext.compute for the contract).
        The model is kept loaded until the run ends: an unload meanwhile frees it after."""
        self._check_loaded()
        deadline = request_deadline(priority, timeout, tenant)
        inputs = tensor_inputs(inputs, self._executable)
        kind = self.default_target if target is None else self._scheduler.resolve_target(target)
        executable = self._executable
        executable.retain()  # an unload during the run frees after it, and waits for it
        executable.in_flight.request_began()
        try:
            return await executable.execute(kind, inputs, priority=priority, deadline=deadline,
                                            tenant=tenant, keep_on_device=keep_on_device)
        except TimeoutError_ as exc:
            raise naming_timeout(exc, timeout) from exc
        finally:
            executable.release()
            executable.in_flight.request_ended()

    @yields_when_refused
    async def lease(
        self,
        inputs: GivenInputs,
        *,
        target: ExecutionTarget | str | None = None,
        priority: int = 0,
        timeout: float | None = None,
        tenant: str = "",
        keep_on_device: bool | None = None,
    ) -> Lease[dict[str, Tensor]]:
        """One-shot :meth:`compute` run by the caller's own thread: queue in trio, return
        once a device slot is held; ``Lease.run()`` (in a thread that is not trio's) runs
        it and returns the outputs (see ExecutionContext.lease for the contract).

        Like :meth:`compute`, the lease keeps the model loaded until it is over (run or
        cancelled): an unload meanwhile frees the compiled graphs after it."""
        self._check_loaded()
        deadline = request_deadline(priority, timeout, tenant)
        inputs = tensor_inputs(inputs, self._executable)
        kind = self.default_target if target is None else self._scheduler.resolve_target(target)
        executable = self._executable
        executable.retain()  # until the lease holds its compiled graphs (see placement)
        executable.in_flight.request_began()
        try:
            lease = await executable.lease(kind, inputs, priority=priority, deadline=deadline,
                                           tenant=tenant, keep_on_device=keep_on_device)
        except TimeoutError_ as exc:
            raise naming_timeout(exc, timeout) from exc
        finally:
            executable.release()
            executable.in_flight.request_ended()
        lease.timeout = timeout  # named if it passes during the run
        return lease

    def try_lease(self, inputs: GivenInputs, *, timeout: float | None = None,
                  tenant: str = "",
                  keep_on_device: bool | None = None) -> Lease[dict[str, Tensor]] | None:
        """One-shot run on the graph's default target from the caller's own thread,
        without trio: a lease if the model is compiled there and a slot is free with
        nobody queued, else None (use :meth:`lease`). See ExecutionContext.try_lease; the
        lease keeps the model's compiled graphs as :meth:`lease` does; ``tenant`` is
        charged its run as in :meth:`lease`."""
        self._check_loaded()
        timeout = check_request(0, timeout, tenant)
        lease = self._executable.try_lease(self.default_target,
                                           tensor_inputs(inputs, self._executable),
                                           timeout=timeout, tenant=tenant,
                                           keep_on_device=keep_on_device)
        if lease is not None:
            lease.timeout = timeout  # named if it passes during the run
        return lease

    async def unload(self, *, wait_for_runs: bool = True) -> None:
        """End this handle; idempotent. Contexts already made keep working until closed.

        When no other handle or open context keeps the model loaded, this returns once
        its compiled graphs are closed and their device memory freed: after the runs
        still using them have ended (a ``compute`` or ``lease`` request made on a handle,
        queued or running; a lease not yet run or cancelled; a run whose caller gave up
        on it; a merged batch), as an inference server finishes the requests in flight
        before it unloads a model, and after a sandboxed graph's processes have ended
        (closed in a thread, the event loop serving on). New requests on this handle
        raise ClosedResourceError from the start. The wait lasts at most the largest
        ``close_timeout`` of the pools the graph was compiled on (those its runs and
        graphs are on; a pool it never used is no bound): past it, a warning names the
        graph, that bound and the runs it still waits for, and this returns; the last
        of them frees the graphs as it ends. An open context keeps them until it is
        closed: nothing is waited for then.

        An unload from a trio task that holds a lease of this graph not yet over (one
        its own ``lease`` call returned) waits for nothing: that lease may only run once
        this returns, and its run frees the graphs as it ends. Nor does one with
        ``wait_for_runs=False``, for a caller with nobody to tell (a stopped guest's
        cleanup, whose abandoned thread may still be running a lease of its own).

        Cancellation: the handle is ended and its reference released before the first
        checkpoint, so a cancelled unload has still unloaded (a model no other handle or
        context uses is freed on every device, by its last run if one is in flight); the
        cancellation is raised after. RuntimeError, with nothing unloaded, outside the
        runtime's trio run.
        """
        scheduler = self._scheduler
        check_trio_run(scheduler.trio_token, "Graph.unload")
        executable = self._executable
        if not self._unloaded:
            self._unloaded = True
            executable.release()
        if wait_for_runs and not executable.in_flight.lent_to(trio.lowlevel.current_task()):
            still, waited = await scheduler.runs_over(executable)
            if still:
                log.warning("%s: unloaded, but after %g s (close_timeout) it still waits "
                            "for %s: its compiled graphs are freed as they end",
                            executable.name, waited, "; ".join(still))
        await scheduler.graphs_closed()
