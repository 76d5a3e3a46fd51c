"""What the guest bindings need from the scheduler, as structural types.

The bindings depend on the scheduler's public API (``wasinn.Runtime``, its graphs and
execution contexts) only through these protocols, so host/ imports nothing from the
scheduler package and a fake can stand in where a test checks routing only.

:class:`Portal` is how a guest's worker thread reaches trio: in the runners it is
:class:`wasinn.host.guest_thread.GuestPortal` (``trio.from_thread.run`` / ``run_sync``,
cancelled when the guest is stopped). Graph and context objects are not thread-safe,
so every call on them goes through the portal. The exception is a compute: the guest's
thread binds the inputs of its own context (used by that thread only), takes a device
slot with ``try_lease`` (thread-safe; no trio when a slot is free and nobody is queued)
and then runs the backend itself (``CallerRunLike.run``), or else ``lease`` through the
portal, which on a busy device runs the request in a device worker thread and returns
its outputs as a settled ``CallerRunLike``.

Every request a guest makes in trio (``run``, ``lease``, a one-shot graph compute) names
the guest's tenant (:mod:`wasinn.host.tenant`), whom a fair pool charges its device time.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from wasinn.backends.base import Device, TensorSpec
from wasinn.enums import ExecutionTarget, GraphEncoding
from wasinn.tensor import Tensor

T = TypeVar("T")

Builders = Sequence[bytes | bytearray | memoryview]


class CallerRunLike(Protocol):
    """A request holding a device slot, run by the guest's own thread (ContextRun)."""

    def run(self) -> dict[str, Tensor]: ...
    def cancel(self) -> None: ...
    def interrupt(self) -> None: ...


class ContextLike(Protocol):
    def set_input(self, key: str | int, value: Any) -> None: ...
    def set_output(self, key: str | int, buffer: Any) -> None: ...
    async def run(self, *, tenant: str = ...) -> None: ...
    async def lease(self, inputs: Mapping[str, Tensor] | None = None, *,
                    tenant: str = ...) -> CallerRunLike: ...
    def try_lease(self, inputs: Mapping[str, Tensor] | None = None, *,
                  tenant: str = ...) -> CallerRunLike | None: ...
    def get_output(self, key: str | int) -> Tensor: ...
    def close(self) -> None: ...


class GraphLike(Protocol):
    @property
    def default_target(self) -> ExecutionTarget: ...
    @property
    def inputs(self) -> tuple[TensorSpec, ...]: ...
    @property
    def outputs(self) -> tuple[TensorSpec, ...]: ...
    def init_execution_context(self, target: Any = None) -> Any: ...
    async def unload(self, *, wait_for_runs: bool = ...) -> None: ...


class RuntimeLike(Protocol):
    async def load(
        self,
        builders: Builders,
        encoding: GraphEncoding | str = ...,
        target: ExecutionTarget | str = ...,
        *,
        options: Any = ...,
        name: str = ...,
    ) -> Any: ...
    async def load_by_name(self, name: str) -> Any: ...
    def model_names(self) -> Any: ...
    @property
    def devices(self) -> list[Device]: ...


class Portal(Protocol):
    """Runs scheduler calls in trio from a guest's worker thread."""

    def run(self, afn: Callable[..., Awaitable[T]], *args: Any) -> T: ...
    def run_sync(self, fn: Callable[..., T], *args: Any) -> T: ...

