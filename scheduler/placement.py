"""Placement: which device actor runs a request, and which backend compiles a model there.

The :class:`Scheduler` knows the runtime's actors by kind. A request for kind ``gpu`` goes
to the actor that already holds one of its native input tensors (so chained computes stay
on one device without a copy), otherwise to the least-loaded actor of that kind (running
plus queued requests). The actor compiles the model on first use and caches it.

A target no actor provides raises UnsupportedOperationError, unless the runtime allows a
fallback: then a RuntimeWarning names both targets, once per runtime and target.

A lost device (see :class:`~wasinn.errors.DeviceLostError`) is placed on last: requests
go to the kind's other devices. Once every device of a kind is lost, its requests get
DeviceLostError, or, where the runtime allows a fallback, run there (a RuntimeWarning
names the lost device and the fallback, once per runtime and kind). A request whose
native input lives on a lost device gets its DeviceLostError: that tensor is gone.

Once the runtime is closed (its actors closed), every request placed here raises
ClosedResourceError saying so. A lease (a request run by the caller's own thread) holds
the compiled graphs its job runs until it is over, run or cancelled: unloading the model
meanwhile frees them after it, as it does for a running job.

The :class:`Scheduler` is assembled from its parts: placement here, compiling (the
backend choice and the compiled sessions) in :mod:`._sessions`, the running of a placed
request (a job, a batch or a lease) in :mod:`._requests`, and the jobs a device runs on
compiled graphs (a pipeline's chain of steps among them) in :mod:`._jobs`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import trio

from wasinn._requester import warn_requester
from wasinn.actors.device import DeviceActor
from wasinn.backends.base import CompiledGraph, Device
from wasinn.backends.registry import BackendRegistry
from wasinn.backends.sandbox import Spares
from wasinn.enums import ExecutionTarget
from wasinn.errors import ClosedResourceError, UnsupportedOperationError, WasiNNError
from wasinn.tensor import Tensor

from ._jobs import Link
from ._requests import Requests
from ._sessions import Sessions
from .model import Inputs, LoadedModel
from .tenants import TenantLedger

__all__ = ["Link", "Scheduler"]


class Scheduler(Requests, Sessions):
    """Routes models and requests onto device actors."""

    def __init__(
        self,
        actors: Sequence[DeviceActor],
        registries: Mapping[ExecutionTarget, BackendRegistry],
        *,
        fallback: ExecutionTarget | None = None,
        spares: Spares | None = None,
        tenants: TenantLedger | None = None,
    ) -> None:
        self.actors = list(actors)
        #: Each tenant's requests (counted beside its model's) and weight.
        self.tenants = TenantLedger() if tenants is None else tenants
        #: Sandbox processes started ahead of sandboxed loads (None: each load starts its
        #: own); the runtime closes them.
        self.spares = spares
        #: The trio run the actors serve in (None when made outside one, as by tests):
        #: how a thread trio did not start reaches it.
        self.trio_token = (trio.lowlevel.current_trio_token() if trio.lowlevel.in_trio_run()
                           else None)
        self._by_kind: dict[ExecutionTarget, list[DeviceActor]] = {}
        for actor in self.actors:
            self._by_kind.setdefault(actor.device.kind, []).append(actor)
        self._by_name = {a.device.name: a for a in self.actors}
        self._registries = dict(registries)
        self.fallback = fallback
        self._resolved: dict[ExecutionTarget, ExecutionTarget] = {
            kind: kind for kind in self._by_kind
        }
        self._lost_warned: set[ExecutionTarget] = set()
        #: Set when the runtime closes (before its actors have all stopped, and when
        #: every one of them was lost already).
        self.stopped = False

    @property
    def devices(self) -> list[Device]:
        return [a.device for a in self.actors]

    @property
    def closed(self) -> bool:
        """Whether the runtime is closed: its device actors stopped serving (a lost
        device's actor stops on its own: that does not close the runtime)."""
        return self.stopped or any(not actor.ready and actor.lost is None
                                   for actor in self.actors)

    def actors_of(self, kind: ExecutionTarget) -> list[DeviceActor]:
        return list(self._by_kind.get(kind, ()))

    # -- targets --------------------------------------------------------------------------
    def resolve_target(self, target: ExecutionTarget | str) -> ExecutionTarget:
        """The kind of device that will serve ``target`` (no backend work).

        Raises UnsupportedOperationError when no device of that kind is here and the config
        allows no fallback; warns (RuntimeWarning, once per target) when it falls back.
        """
        kind = target if isinstance(target, ExecutionTarget) else ExecutionTarget.coerce(target)
        resolved = self._resolved.get(kind)
        if resolved is not None:
            return resolved
        here = ", ".join(a.device.name for a in self.actors) or "none"
        fallback = self.fallback
        if fallback is None:
            raise UnsupportedOperationError(
                f"no {kind.value} device in this runtime (devices here: {here}); "
                "set [runtime] fallback in the config to run such requests elsewhere"
            )
        if fallback is kind:
            kinds = ", ".join(sorted(k.value for k in self._by_kind)) or "none"
            raise UnsupportedOperationError(
                f"no {kind.value} device in this runtime (devices here: {here}), and "
                f"[runtime] fallback = {fallback.value!r} is that same kind: expected a "
                f"fallback this runtime has a device for ({kinds})"
            )
        if fallback not in self._by_kind:
            raise UnsupportedOperationError(
                f"no {kind.value} device in this runtime (devices here: {here}), and none "
                f"for its fallback either: [runtime] fallback = {fallback.value!r}, but the "
                f"{fallback.value} pool found no device: expected a {kind.value} or "
                f"{fallback.value} device"
            )
        warn_requester(
            f"wasinn: no {kind.value} device here (devices: {here}): "
            f"target {kind.value} falls back to {fallback.value}")
        self._resolved[kind] = fallback
        return fallback

    def pick(self, kind: ExecutionTarget, inputs: Inputs) -> DeviceActor:
        """The actor of ``kind`` that should run a request with ``inputs``.

        A request with a native input on a lost device goes to that device, whatever
        ``kind``, so it gets its DeviceLostError: the tensor is gone, and reading it from
        another device's job would only raise the lost context's error there (and have
        that device taken for lost too)."""
        actors = self._by_kind.get(kind)
        if not actors:
            raise UnsupportedOperationError(f"no {kind.value} device in this runtime")
        home = None  # the first native input's device of ``kind``: no copy there
        for value in inputs.values():  # (one loop: this runs on every request)
            if isinstance(value, Tensor) and value.native is not None:
                holder = self._by_name.get(value.device)
                if holder is None:
                    continue
                if holder.lost is not None:
                    return holder
                if home is None and holder.device.kind is kind:
                    home = holder
        actor = actors[0] if len(actors) == 1 else home or min(actors, key=_rank)
        if actor.lost is not None:
            return self._instead_of_lost(kind, actor, inputs)
        return actor

    def _instead_of_lost(self, kind: ExecutionTarget, lost: DeviceActor, inputs: Inputs
                         ) -> DeviceActor:
        # Every ``kind`` device is lost: the fallback's device where the runtime allows
        # one and has one serving, else ``lost`` (whose requests get its DeviceLostError).
        fallback = self.fallback
        if fallback is None or fallback is kind or fallback not in self._by_kind:
            return lost
        instead = self.pick(fallback, inputs)
        if instead.lost is not None:
            return lost
        if kind not in self._lost_warned:
            self._lost_warned.add(kind)
            warn_requester(
                f"wasinn: every {kind.value} device here is lost ({lost.lost}): target "
                f"{kind.value} falls back to {fallback.value}")
        return instead

    # -- compiling (the rest in Sessions) ----------------------------------------------
    async def compile(self, model: LoadedModel, kind: ExecutionTarget) -> CompiledGraph:
        """Compile ``model`` on the least-loaded ``kind`` device; its errors surface here."""
        session = await self.session(self.pick(kind, {}), model)
        return session.compiled

    # -- requests (run by Requests) ----------------------------------------------------
    def _serving(self, actor: DeviceActor) -> DeviceActor:
        # ``actor``, a request was placed on, if it serves; else why it cannot run there:
        # the runtime closed, or the device was lost (even before trio has closed it).
        if actor.ready and actor.lost is None:
            return actor
        lost = actor.lost
        if lost is not None and not self.stopped:
            raise lost.for_another_caller()
        raise ClosedResourceError("the runtime is closed: requests can no longer run")

    def _placed_here(self, target: ExecutionTarget, inputs: Inputs) -> DeviceActor | None:
        if target not in self._by_kind:
            return None
        try:
            actor = self.pick(target, inputs)
        except WasiNNError:
            return None
        return self._serving(actor)


def _rank(actor: DeviceActor) -> tuple[bool, int]:
    # Least loaded first, a lost device last.
    return actor.lost is not None, actor.load
