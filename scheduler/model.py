"""What the scheduler runs: a loaded model (and, in pipeline.py, a chain of them).

A :class:`LoadedModel` is loaded once: its bytes are kept (owned copies, so a guest may
reuse its memory), its encoding is known (autodetected once), and its specs come from the
first compile. Graph handles and contexts hold references to it; when the last one goes,
``on_release`` frees its compiled graphs on every device.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import trio

from wasinn.actors.batching import Batching
from wasinn.actors.lease import Lease
from wasinn.actors.stats import RequestStats
from wasinn.backends.base import LoadOptions, TensorSpec
from wasinn.enums import ExecutionTarget, GraphEncoding
from wasinn.tensor import Tensor

#: Inputs as callers give them: names or positions -> tensors or numpy-compatible values.
Inputs = Mapping[Any, object]

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

    def backend_for(self, target: ExecutionTarget) -> str:
        """The backend(s) chosen to run on ``target`` so far ("" before the first compile)."""

    @property
    def trio_token(self) -> trio.lowlevel.TrioToken | None:
        """The trio run its devices serve in: how a thread trio did not start queues."""

    def retain(self) -> None:
        """One more handle or context uses this."""

    def release(self) -> None:
        """One fewer; the last release frees the compiled graphs everywhere."""

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


class LoadedModel:
    """One model's bytes and what is known about them; refcounted by handles and contexts."""

    __slots__ = (
        "backend_name",
        "backends",
        "batching",
        "builders",
        "encoding",
        "id",
        "input_aliases",
        "inputs",
        "name",
        "on_release",
        "options",
        "output_aliases",
        "outputs",
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

    def backend_for(self, target: ExecutionTarget) -> str:
        return self.backends.get(target, "")

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
        return await self.runner.lease_model(self, target, inputs, priority=priority,
                                             deadline=deadline, tenant=tenant,
                                             keep_on_device=keep_on_device)

    def try_lease(self, target: ExecutionTarget, inputs: Inputs, *, timeout: float | None,
                  tenant: str, keep_on_device: bool | None
                  ) -> Lease[dict[str, Tensor]] | None:
        assert self.runner is not None, "a model is bound to its scheduler when loaded"
        return self.runner.try_lease_model(self, target, inputs, timeout=timeout,
                                           tenant=tenant, keep_on_device=keep_on_device)

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
