"""What the scheduler runs: a loaded model (and, in pipeline.py, a chain of them).

A :class:`LoadedModel` is loaded once: its bytes are kept (owned copies, so a guest may
reuse its memory), its encoding is known (autodetected once), and its specs come from the
first compile. Graph handles and contexts hold references to it; when the last one goes,
``on_release`` frees its compiled graphs on every device. Its :class:`RunsInFlight` says
which of its runs have not ended yet: what ``Graph.unload`` waits for (at most the
``close_timeout`` of the pools it is ``placed_on``), and what the registry waits for
before it stops reading a replaced load's counts.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Set
from typing import Any, Protocol

import trio

from wasinn.actors.batching import Batching
from wasinn.actors.lease import Lease
from wasinn.actors.stats import RequestStats
from wasinn.backends.base import LoadOptions, TensorSpec
from wasinn.backends.onnx_dims import DeclaredDim, declared_dims
from wasinn.enums import ExecutionTarget, GraphEncoding
from wasinn.tensor import Tensor

#: Inputs as callers give them: names, aliases or positions -> tensors or
#: numpy-compatible values.
GivenInputs = Mapping[Any, object]
#: Inputs as a request carries them to a device, the given ones resolved by
#: :func:`~.context.tensor_inputs`: input names -> tensors, as ``CompiledGraph.run`` takes
#: them.
Inputs = Mapping[str, Tensor]

_ids = itertools.count(1)


class Executable(Protocol):
    """Something a graph handle or context runs: a model or a pipeline of models."""

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    #: Other names its inputs and outputs answer to, by position (see
    #: ``CompiledGraph.input_aliases``).
    input_aliases: Mapping[str, int]
    output_aliases: Mapping[str, int]
    released: bool
    #: Its requests on every device since it was loaded (see ``Graph.stats``).
    requests: RequestStats
    #: How its requests are merged on a device (None: they are not).
    batching: Batching | None
    #: Its runs that have not ended yet (see :class:`RunsInFlight`).
    in_flight: RunsInFlight

    @property
    def placed_on(self) -> Set[ExecutionTarget]:
        """The kinds of device (one pool each) it has been compiled on, or sent to
        compile on, so far: the pools its runs and compiled graphs may be on, whose
        ``close_timeout`` bounds an unload's wait for them."""

    def backend_for(self, target: ExecutionTarget) -> str:
        """The backend(s) chosen to run on ``target`` so far ("" before the first compile)."""

    @property
    def trio_token(self) -> trio.lowlevel.TrioToken | None:
        """The trio run its devices serve in: how a thread trio did not start queues."""

    def retain(self) -> None:
        """One more handle or context uses this."""

    def release(self) -> None:
        """One fewer; the last release frees the compiled graphs everywhere."""

    def waited_for(self) -> list[str]:
        """What freeing its compiled graphs still waits for, for people: its runs not
        ended yet (see :meth:`RunsInFlight.waiting`). Empty when nothing is waited for,
        and while a handle or a context, not only a run, keeps it loaded."""

    async def execute(self, target: ExecutionTarget, inputs: Inputs, *, priority: int,
                      deadline: float, tenant: str, keep_on_device: bool | None
                      ) -> dict[str, Tensor]:
        """Run on a device of kind ``target`` (see Scheduler.run_model for the outputs)."""

    async def lease(self, target: ExecutionTarget, inputs: Inputs, *, priority: int,
                    deadline: float, tenant: str, keep_on_device: bool | None
                    ) -> Lease[dict[str, Tensor]]:
        """Hold a slot on a device of kind ``target`` for a run by the caller's thread."""

    def try_lease(self, target: ExecutionTarget, inputs: Inputs, *, timeout: float | None,
                  tenant: str, keep_on_device: bool | None
                  ) -> Lease[dict[str, Tensor]] | None:
        """From any thread: a lease if a slot is free now and no compile is needed."""


class RunsInFlight:
    """A model's (or a pipeline's) runs that have not ended yet, from any thread:

    * the ``compute`` and ``lease`` requests made through its graph handles, from the
      call until it returns (:meth:`request_began`, :meth:`request_ended`: in trio);
      each holds a reference to the model meanwhile;
    * its leases lent and not over (:meth:`lent`), by the trio task that asked for
      each (None: a thread, as ``try_lease``'s callers are); a settled lease (its
      request ran as a job) is not one;
    * once it is released, its compiled graphs evicted while a run still used them (a
      lease's, a job whose caller gave up on it, a merged batch's): each is closed by
      that run's thread as it ends (:meth:`graph_in_use`, :meth:`graph_unused`).

    ``changed`` (set by whoever runs the model: its scheduler) is called, from any
    thread, whenever one of them ends.
    """

    __slots__ = ("_graphs", "_leases", "_lock", "changed", "requests")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = 0
        self._leases: Counter[object] = Counter()
        self._graphs: dict[int, str] = {}
        self.changed: Callable[[], None] | None = None

    def request_began(self) -> None:
        self.requests += 1

    def request_ended(self) -> None:
        self.requests -= 1
        self._changed()

    def lent(self, lease: Lease[Any]) -> None:
        """``lease`` was lent for it (before its holder has it): counted until it is
        over, after its run is counted in the model's stats."""
        if not lease.lends_slot:
            return
        holder = trio.lowlevel.current_task() if trio.lowlevel.in_trio_run() else None
        with self._lock:
            self._leases[holder] += 1
        lease.then(lambda: self._lease_over(holder))

    def _lease_over(self, holder: object) -> None:
        with self._lock:
            self._leases[holder] -= 1
            if not self._leases[holder]:
                del self._leases[holder]
        self._changed()

    def lent_to(self, task: object) -> bool:
        """Whether a lease lent for it at ``task``'s request is not over yet."""
        with self._lock:
            return task in self._leases

    def graph_in_use(self, key: int, what: str) -> None:
        """A compiled graph (``key``: its session's id) was evicted while a run used it;
        ``what`` names it (its backend and device)."""
        with self._lock:
            self._graphs[key] = what

    def graph_unused(self, key: int) -> None:
        """The last run of that graph ended and closed it (in that run's thread)."""
        with self._lock:
            self._graphs.pop(key, None)
        self._changed()

    def waiting(self) -> list[str]:
        """What has not ended yet, for people (empty: nothing)."""
        with self._lock:
            leases = sum(self._leases.values())
            graphs = list(self._graphs.values())
        what = []
        if self.requests:
            what.append(f"{self.requests} compute or lease request(s) made on its graph "
                        "handle(s)")
        if leases:
            what.append(f"{leases} lease(s) not yet run or cancelled")
        return what + [f"a run on its {graph}" for graph in graphs]

    def _changed(self) -> None:
        changed = self.changed
        if changed is not None:
            with contextlib.suppress(Exception):  # (never into a run's thread)
                changed()


class LoadedModel:
    """One model's bytes and what is known about them; refcounted by handles and contexts."""

    __slots__ = (
        "backend_name",
        "backends",
        "batch_major",
        "batching",
        "builders",
        "encoding",
        "id",
        "in_flight",
        "input_aliases",
        "inputs",
        "name",
        "on_release",
        "options",
        "output_aliases",
        "outputs",
        "placed_on",
        "refs",
        "released",
        "requests",
        "runner",
    )

    def __init__(
        self,
        builders: tuple[bytes, ...],
        encoding: GraphEncoding,
        options: LoadOptions,
        *,
        backend_name: str | None = None,
        name: str = "",
        batching: Batching | None = None,
    ) -> None:
        self.id = next(_ids)
        self.name = name or f"graph#{self.id}"
        self.builders = builders
        self.encoding = encoding
        self.options = options
        self.backend_name = backend_name
        #: The backend chosen per device kind (filled on first use of that kind).
        self.backends: dict[ExecutionTarget, str] = {}
        self.inputs: tuple[TensorSpec, ...] = ()
        self.outputs: tuple[TensorSpec, ...] = ()
        self.input_aliases: Mapping[str, int] = {}
        self.output_aliases: Mapping[str, int] = {}
        self.refs = 0
        self.released = False
        self.on_release: Callable[[LoadedModel], None] | None = None
        self.runner: ModelRunner | None = None
        self.requests = RequestStats()
        #: How its requests are merged on a device (None: never; see wasinn.actors.batching).
        self.batching = batching
        #: Whether its declared shapes show its outputs batch-major (set at load when it
        #: batches, see wasinn.actors.batching.check_batchable): if not, the first merged
        #: run of each input signature is checked against a run alone.
        self.batch_major = False
        self.in_flight = RunsInFlight()
        #: The kinds of device it was sent to compile on (see Executable.placed_on),
        #: filled by its scheduler before a compile there: not on the path of a request
        #: that finds its graph compiled (that graph's compile filled it).
        self.placed_on: set[ExecutionTarget] = set()

    def backend_for(self, target: ExecutionTarget) -> str:
        return self.backends.get(target, "")

    def declared_dims(self) -> dict[str, tuple[DeclaredDim, ...]]:
        """The dimensions its bytes declare for its inputs and outputs, by name, symbolic
        names included (see :mod:`wasinn.backends.onnx_dims`): an ONNX model's (read
        each time: only a load with batching asks), empty for other formats and once its
        bytes are gone."""
        if self.encoding is not GraphEncoding.ONNX or not self.builders:
            return {}
        return declared_dims(self.builders[0])

    @property
    def trio_token(self) -> trio.lowlevel.TrioToken | None:
        return None if self.runner is None else self.runner.trio_token

    def retain(self) -> None:
        self.refs += 1

    def release(self) -> None:
        self.refs -= 1
        if self.refs == 0 and not self.released:
            self.released = True
            if self.on_release is not None:
                self.on_release(self)
            # Nothing compiles it again (a compile under way holds its own reference):
            # its bytes go now, though the registry keeps the model for its stats.
            self.builders = ()

    def waited_for(self) -> list[str]:
        if self.refs > self.in_flight.requests:
            return []  # a handle or a context keeps it loaded
        return self.in_flight.waiting()

    async def execute(self, target: ExecutionTarget, inputs: Inputs, *, priority: int,
                      deadline: float, tenant: str, keep_on_device: bool | None
                      ) -> dict[str, Tensor]:
        assert self.runner is not None, "a model is bound to its scheduler when loaded"
        return await self.runner.run_model(self, target, inputs, priority=priority,
                                           deadline=deadline, tenant=tenant,
                                           keep_on_device=keep_on_device)

    async def lease(self, target: ExecutionTarget, inputs: Inputs, *, priority: int,
                    deadline: float, tenant: str, keep_on_device: bool | None
                    ) -> Lease[dict[str, Tensor]]:
        assert self.runner is not None, "a model is bound to its scheduler when loaded"
        lease = await self.runner.lease_model(self, target, inputs, priority=priority,
                                              deadline=deadline, tenant=tenant,
                                              keep_on_device=keep_on_device)
        self.in_flight.lent(lease)
        return lease

    def try_lease(self, target: ExecutionTarget, inputs: Inputs, *, timeout: float | None,
                  tenant: str, keep_on_device: bool | None
                  ) -> Lease[dict[str, Tensor]] | None:
        assert self.runner is not None, "a model is bound to its scheduler when loaded"
        lease = self.runner.try_lease_model(self, target, inputs, timeout=timeout,
                                            tenant=tenant, keep_on_device=keep_on_device)
        if lease is not None:
            self.in_flight.lent(lease)
        return lease

    def __repr__(self) -> str:
        return f"<LoadedModel {self.name} {self.encoding.value} refs={self.refs}>"


class ModelRunner(Protocol):
    """The scheduler as a model sees it (breaks the import cycle with placement.py)."""

    #: The trio run its devices serve in (None outside one).
    trio_token: trio.lowlevel.TrioToken | None

    async def run_model(self, model: LoadedModel, target: ExecutionTarget, inputs: Inputs,
                        *, priority: int, deadline: float, tenant: str,
                        keep_on_device: bool | None) -> dict[str, Tensor]:
        """Run ``model`` on the least-loaded device of kind ``target``."""

    async def lease_model(self, model: LoadedModel, target: ExecutionTarget, inputs: Inputs,
                          *, priority: int, deadline: float, tenant: str,
                          keep_on_device: bool | None) -> Lease[dict[str, Tensor]]:
        """Hold a slot for ``model`` on a ``target`` device; the caller's thread runs it."""

    def try_lease_model(self, model: LoadedModel, target: ExecutionTarget, inputs: Inputs,
                        *, timeout: float | None, tenant: str, keep_on_device: bool | None
                        ) -> Lease[dict[str, Tensor]] | None:
        """From any thread: a lease if ``model`` is compiled and a slot is free now."""
