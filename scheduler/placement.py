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
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from types import FrameType

import numpy as np
import trio

from wasinn.actors.batching import Batching, BatchInputs, RunInputs
from wasinn.actors.device import DeviceActor
from wasinn.actors.inline import RunProfile
from wasinn.actors.lease import Lease, settled
from wasinn.actors.session import Session
from wasinn.actors.stats import Account
from wasinn.backends.base import (
    Builders,
    CompiledGraph,
    Device,
    LoadOptions,
    current_cancellation,
)
from wasinn.backends.formats import detect_encoding
from wasinn.backends.registry import BackendRegistry
from wasinn.backends.sandbox import Spares, load_sandboxed
from wasinn.configs import BACKEND_OPTIONS
from wasinn.enums import ExecutionTarget, GraphEncoding
from wasinn.errors import (
    BackendRuntimeError,
    ClosedResourceError,
    DeviceLostError,
    InvalidArgumentError,
    InvalidEncodingError,
    TimeoutError_,
    UnsupportedOperationError,
    WasiNNError,
)
from wasinn.tensor import Tensor

from .model import Inputs, LoadedModel
from .tenants import TenantLedger
from .triorun import A_REQUEST, check_trio_run

log = logging.getLogger("wasinn.scheduler")

#: How one pipeline step feeds the next: (previous output name, next input name) pairs.
Link = tuple[tuple[str, str], ...]
#: A lease's job on graphs held for it: (graphs, inputs, keep_on_device) -> outputs.
RunHeld = Callable[[Sequence[CompiledGraph], Inputs, bool], dict[str, Tensor]]
#: A pipeline's name and its steps' models, for its errors (see :func:`_step_label`).
Named = tuple[str, Sequence[LoadedModel]]


class Scheduler:
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
        warnings.warn(
            f"wasinn: no {kind.value} device here (devices: {here}): "
            f"target {kind.value} falls back to {fallback.value}",
            RuntimeWarning, stacklevel=_callers_level(),
        )
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
            warnings.warn(
                f"wasinn: every {kind.value} device here is lost ({lost.lost}): target "
                f"{kind.value} falls back to {fallback.value}",
                RuntimeWarning, stacklevel=_callers_level())
        return instead

    # -- compiling ----------------------------------------------------------------------
    async def backend_for(self, model: LoadedModel, kind: ExecutionTarget) -> str:
        """The name of the backend that runs ``model`` on ``kind`` (chosen once, in a
        worker thread, because choosing may import the backend's library)."""
        name = model.backends.get(kind)
        if name is None:
            name = await trio.to_thread.run_sync(self._choose, model, kind)
            model.backends[kind] = name
            _warn_unread_options(model, name)
        return name

    def _registry(self, kind: ExecutionTarget) -> BackendRegistry:
        registry = self._registries.get(kind)
        if registry is None:
            raise UnsupportedOperationError(f"no {kind.value} device in this runtime")
        return registry

    def _choose(self, model: LoadedModel, kind: ExecutionTarget) -> str:
        if model.encoding is GraphEncoding.AUTODETECT:
            model.encoding = detect_encoding(model.builders)
        registry = self._registry(kind)
        if model.backend_name is None:
            return registry.choose_name(model.encoding, kind)
        name = model.backend_name
        if not registry.reads(name, model.encoding):
            raise InvalidEncodingError(
                f"backend {name!r} does not read {model.encoding.value} models"
            )
        if not registry.has_device(name, kind):
            raise UnsupportedOperationError(f"backend {name!r} has no {kind.value} device here")
        return name

    async def session(self, actor: DeviceActor, model: LoadedModel) -> Session:
        """``model`` compiled on ``actor``'s device (compiled on first use, then cached).

        A model that names no backend, which the chosen one cannot run there
        (UnsupportedOperationError: a kernel its library lacks), is compiled by the next
        backend of the preference order that reads its encoding on that device, with a
        warning; where none can, the first backend's error is raised."""
        kind = actor.device.kind
        backend = await self.backend_for(model, kind)
        try:
            return await self._session_with(actor, model, backend)
        except UnsupportedOperationError as exc:
            if model.backend_name is not None or model.released:
                raise
            return await self._session_with_another(actor, model, backend, exc)

    async def _session_with_another(self, actor: DeviceActor, model: LoadedModel,
                                    failed: str, exc: UnsupportedOperationError) -> Session:
        # The backends after ``failed`` in the preference order that read the model's
        # encoding on ``actor``'s device (asking may import them: in a worker thread).
        kind = actor.device.kind
        others = await trio.to_thread.run_sync(self._others, model, kind, failed)
        tried = [failed]
        for other in others:
            try:
                session = await self._session_with(actor, model, other)
            except (ClosedResourceError, DeviceLostError):
                raise  # the runtime or the model closed, the device was lost: not a refusal
            except WasiNNError:  # (what the first backend said is what the caller hears)
                tried.append(other)
                continue
            log.warning("%s: backend %s cannot run it on %s (%s): it runs on %s instead",
                        model.name, failed, actor.device, exc.message, other)
            model.backends[kind] = other
            _warn_unread_options(model, other)
            return session
        if len(tried) == 1:
            raise exc
        raise exc.suffixed(f"(nor could {', '.join(tried[1:])})")

    def _others(self, model: LoadedModel, kind: ExecutionTarget, failed: str) -> list[str]:
        registry = self._registry(kind)
        names = registry.candidates(model.encoding)
        later = names[names.index(failed) + 1:] if failed in names else []
        return [name for name in later if registry.has_device(name, kind)]

    async def _session_with(self, actor: DeviceActor, model: LoadedModel, backend: str
                            ) -> Session:
        # ``model`` compiled on ``actor`` by ``backend`` (cached under the model's id).
        kind = actor.device.kind
        registry = self._registry(kind)
        options = model.options
        if actor.pins_handoffs:
            # The actor holds the event loop to one CPU while a run is out: a backend
            # pinning its threads would take that for the process's CPUs.
            options = dataclasses.replace(options, thread_pinning=False)
        # A sandboxed graph runs as many processes as its device runs jobs at once, and
        # its library is imported there only.
        load = (functools.partial(load_sandboxed, registry.ref(backend), spares=self.spares,
                                  processes=actor.workers)
                if options.sandboxed_on(actor.device)
                else functools.partial(_load_here, registry, backend))
        compile_graph = functools.partial(load, model.builders, model.encoding,
                                          actor.device, options)
        try:
            session = await actor.session(model.id, compile_graph, backend,
                                          wanted=lambda: not model.released)
        except ClosedResourceError:
            if model.released:
                raise ClosedResourceError(f"{model.name} was unloaded") from None
            raise
        if model.released:
            # Unloaded once it was cached: release() has evicted it from every device.
            raise ClosedResourceError(f"{model.name} was unloaded")
        return session

    async def compile(self, model: LoadedModel, kind: ExecutionTarget) -> CompiledGraph:
        """Compile ``model`` on the least-loaded ``kind`` device; its errors surface here."""
        session = await self.session(self.pick(kind, {}), model)
        return session.compiled

    async def chain_on(self, actor: DeviceActor, models: Sequence[LoadedModel],
                       links: Sequence[Link], inputs: Inputs
                       ) -> Callable[[], dict[str, Tensor]]:
        """``models`` (a model, or a pipeline's steps wired by ``links``) compiled on
        ``actor`` now, and a job that runs them there on ``inputs`` (host outputs), for
        work the scheduler does itself, such as warm-ups."""
        sessions = [await self.session(actor, model) for model in models]
        return functools.partial(_run_chain, sessions, links, inputs, False)

    def release(self, model: LoadedModel) -> None:
        """Free ``model``'s compiled graphs on every device (now or after running jobs).
        Marks it released first: a compile of it still under way is then cancelled (a
        sandboxed load's process is killed), and one that ends all the same is closed
        instead of being cached (see DeviceActor.session's ``wanted``)."""
        model.released = True
        for actor in self.actors:
            actor.evict(model.id)

    async def graphs_closed(self) -> None:
        """Wait until the graphs evicted so far on every device are closed, those whose
        close blocks (sandboxed ones), which close in a thread, included."""
        for actor in self.actors:
            await actor.graphs_closed()

    # -- running ------------------------------------------------------------------------
    async def run_model(self, model: LoadedModel, target: ExecutionTarget, inputs: Inputs,
                        *, priority: int = 0, deadline: float = float("inf"),
                        tenant: str = "", keep_on_device: bool | None = None
                        ) -> dict[str, Tensor]:
        """Run ``model`` on a ``target`` device.

        Outputs are backend-native values left on the device when ``keep_on_device`` is
        true, host tensors when false; None (the default) keeps them native on devices
        other than the CPU (where host memory *is* the device's, and where OpenVINO would
        otherwise have to retire an infer request per run to hand its outputs out). A
        model loaded with batching may run merged with other requests (see
        :mod:`wasinn.actors.batching`): such a run's outputs are host tensors.
        """
        account = self.tenants.account(model.requests, tenant)
        actor, session, run, reached = await self._model_job(model, target, inputs, deadline,
                                                             account)
        return await _execute(actor, model.id, run, _keep(actor, keep_on_device),
                              model.batching, inputs, priority=priority, deadline=deadline,
                              tenant=tenant, label=_label(model, session),
                              account=account, profile=session.profile, reached=reached)

    async def lease_model(self, model: LoadedModel, target: ExecutionTarget, inputs: Inputs,
                          *, priority: int = 0, deadline: float = float("inf"),
                          tenant: str = "", keep_on_device: bool | None = None
                          ) -> Lease[dict[str, Tensor]]:
        """Like :meth:`run_model`, but return once a device slot is held: the caller's own
        thread runs the model with :meth:`Lease.run` (see :mod:`wasinn.actors.lease`). On
        a busy device, or when it joins a batch, the request runs as :meth:`run_model`
        runs it and has run when this returns (a settled lease). The
        compiled graph is held until the lease is over: an unload meanwhile closes it
        after the run."""
        account = self.tenants.account(model.requests, tenant)
        actor, session, run, reached = await self._model_job(model, target, inputs, deadline,
                                                             account)
        return await _lease(actor, model.id, run, _keep(actor, keep_on_device),
                            model.batching, inputs, priority=priority, deadline=deadline,
                            tenant=tenant, label=_label(model, session),
                            account=account, sessions=(session,), run_held=_run_first,
                            reached=reached)

    def try_lease_model(self, model: LoadedModel, target: ExecutionTarget, inputs: Inputs,
                        *, timeout: float | None = None, tenant: str = "",
                        keep_on_device: bool | None = None
                        ) -> Lease[dict[str, Tensor]] | None:
        """From any thread, without trio: a lease to run ``model`` if it is already compiled
        on the device it would be placed on and that device has a free slot and no queue;
        otherwise None (use :meth:`lease_model` through trio, which compiles and queues).
        Only reads scheduler state; the actor's slots are taken under its lock. None, too,
        for a model whose batches wait for company (``max_delay``): they form in trio."""
        if _gathers(model.batching):
            return None
        actor = self._placed_here(target, inputs)
        if actor is None or model.released:
            return None
        session = actor.cached_session(model.id)
        if session is None:
            return None
        sessions = (session,)
        try:
            held = _hold(sessions)  # until the lease is over
        except ClosedResourceError:
            return None  # unloaded meanwhile: lease_model says so
        job = functools.partial(_run_first, held, inputs, _keep(actor, keep_on_device))
        return _held_by(actor.try_lease(job, timeout=timeout, tenant=tenant,
                                        account=self.tenants.account(model.requests, tenant)),
                        sessions)

    def try_lease_chain(self, name: str, models: Sequence[LoadedModel], links: Sequence[Link],
                        target: ExecutionTarget, inputs: Inputs, *,
                        timeout: float | None = None, tenant: str = "",
                        keep_on_device: bool | None = None,
                        account: Account | None = None,
                        batching: Batching | None = None
                        ) -> Lease[dict[str, Tensor]] | None:
        """:meth:`try_lease_model` for a pipeline (every step already compiled there)."""
        if _gathers(batching):
            return None
        actor = self._placed_here(target, inputs)
        if actor is None:
            return None
        sessions = []
        for model in models:
            session = actor.cached_session(model.id)
            if model.released or session is None:
                return None
            sessions.append(session)
        try:
            held = _hold(sessions)
        except ClosedResourceError:
            return None  # unloaded meanwhile: lease_chain says so
        job = functools.partial(_chain, links, held, inputs, _keep(actor, keep_on_device),
                                named=(name, models))
        return _held_by(actor.try_lease(job, timeout=timeout, tenant=tenant,
                                        account=self.tenants.account(account, tenant)),
                        sessions)

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

    async def _model_job(self, model: LoadedModel, target: ExecutionTarget, inputs: Inputs,
                         deadline: float, account: Account
                         ) -> tuple[DeviceActor, Session, RunInputs, float | None]:
        # The actor that runs it, its session there, how to run it on inputs, and when
        # (perf_counter) the request reached the device if it waited there for the
        # compile (None: it reaches it now, its graph compiled).
        check_trio_run(self.trio_token, A_REQUEST)
        actor = self._serving(self.pick(target, inputs))
        if model.released:
            raise ClosedResourceError(f"{model.name} was unloaded")
        session = actor.cached_session(model.id)
        reached = None
        if session is None:
            reached = time.perf_counter()
            session = await self._placed_session(actor, model, deadline, account, reached)
        return actor, session, functools.partial(_run, session), reached

    async def _placed_session(self, actor: DeviceActor, model: LoadedModel,
                              deadline: float, account: Account | None, reached: float
                              ) -> Session:
        # ``model``'s session on ``actor`` for a request that must start by ``deadline``
        # and reached the device at ``reached`` (perf_counter): the request counts as
        # the device's load meanwhile, and is counted in the device's stats (and
        # ``account``) if it ends here; one that goes on is counted from ``reached`` by
        # the actor (passed to execute, execute_batched or lease), the wait included.
        actor.placed += 1
        try:
            return await self._session_by(actor, model, deadline)
        except BaseException as exc:
            actor.record_unqueued(account, exc, time.perf_counter() - reached)
            raise
        finally:
            actor.placed -= 1

    async def _session_by(self, actor: DeviceActor, model: LoadedModel, deadline: float
                          ) -> Session:
        with trio.move_on_at(deadline):
            return await self.session(actor, model)
        raise TimeoutError_(
            f"{actor.device}: the request's deadline passed while {model.name} was being "
            "compiled there (the compile goes on: a later request uses it)")

    async def run_chain(self, name: str, models: Sequence[LoadedModel], links: Sequence[Link],
                        target: ExecutionTarget, inputs: Inputs, *, priority: int = 0,
                        deadline: float = float("inf"), tenant: str = "",
                        keep_on_device: bool | None = None,
                        account: Account | None = None,
                        batching: Batching | None = None) -> dict[str, Tensor]:
        """Run ``models`` one after another on ONE ``target`` device, as one job, feeding
        each step's native outputs to the next along ``links``; the last step's outputs
        follow ``keep_on_device`` as in :meth:`run_model`. ``account``: the pipeline's
        stats, where the request is counted too (and in its tenant's); ``batching``: the
        pipeline's, if any."""
        account = self.tenants.account(account, tenant)
        actor, sessions, reached = await self._chain_job(name, models, links, target, inputs,
                                                         deadline, account)
        run = functools.partial(_run_chain, sessions, links, named=(name, models))
        return await _execute(actor, _chain_key(name, models, links), run,
                              _keep(actor, keep_on_device), batching, inputs,
                              priority=priority, deadline=deadline, tenant=tenant,
                              label=f"run of pipeline {name!r}", account=account,
                              reached=reached)

    async def lease_chain(self, name: str, models: Sequence[LoadedModel],
                          links: Sequence[Link], target: ExecutionTarget, inputs: Inputs, *,
                          priority: int = 0, deadline: float = float("inf"), tenant: str = "",
                          keep_on_device: bool | None = None,
                          account: Account | None = None,
                          batching: Batching | None = None) -> Lease[dict[str, Tensor]]:
        """:meth:`run_chain` for the caller's own thread (see :meth:`lease_model`)."""
        account = self.tenants.account(account, tenant)
        actor, sessions, reached = await self._chain_job(name, models, links, target, inputs,
                                                         deadline, account)
        named = (name, models)
        return await _lease(actor, _chain_key(name, models, links),
                            functools.partial(_run_chain, sessions, links, named=named),
                            _keep(actor, keep_on_device), batching, inputs,
                            priority=priority, deadline=deadline, tenant=tenant,
                            label=f"run of pipeline {name!r}", account=account,
                            sessions=sessions,
                            run_held=functools.partial(_chain, links, named=named),
                            reached=reached)

    async def _chain_job(self, name: str, models: Sequence[LoadedModel], links: Sequence[Link],
                         target: ExecutionTarget, inputs: Inputs, deadline: float,
                         account: Account | None
                         ) -> tuple[DeviceActor, list[Session], float | None]:
        # The actor that runs the chain, each step's session there, and when the request
        # reached the device if it waited there for a step's compile (see _model_job).
        check_trio_run(self.trio_token, A_REQUEST)
        actor = self._serving(self.pick(target, inputs))
        sessions = []
        reached = None
        for model in models:
            if model.released:
                raise ClosedResourceError(f"pipeline {name!r}: {model.name} was unloaded")
            session = actor.cached_session(model.id)
            if session is None:
                if reached is None:
                    reached = time.perf_counter()
                session = await self._placed_session(actor, model, deadline, account,
                                                     reached)
            sessions.append(session)
        return actor, sessions, reached


async def _execute(actor: DeviceActor, key: object, run: RunInputs, keep: bool,
                   batching: Batching | None, inputs: Inputs, *, priority: int,
                   deadline: float, tenant: str, label: str, account: Account | None,
                   profile: RunProfile | None = None, reached: float | None = None
                   ) -> dict[str, Tensor]:
    # ``run`` on ``actor``: merged with others when the model batches and ``inputs`` can;
    # else as one job (``profile``: the graph's run timings, for inline runs; ``reached``:
    # when the request reached the device, if it waited there for its graph's compile).
    if batching is not None:
        batch = BatchInputs.of(inputs)
        if batch is not None:
            return await actor.execute_batched(
                key, batch, run, batching, keep_on_device=keep, priority=priority,
                deadline=deadline, tenant=tenant, label=label, account=account,
                reached=reached)
    return await actor.execute(functools.partial(run, inputs, keep), priority=priority,
                               deadline=deadline, tenant=tenant, profile=profile,
                               nbytes=None if profile is None else _input_bytes(inputs),
                               label=label, account=account, reached=reached)


async def _lease(actor: DeviceActor, key: object, run: RunInputs, keep: bool,
                 batching: Batching | None, inputs: Inputs, *, priority: int,
                 deadline: float, tenant: str, label: str, account: Account | None,
                 sessions: Sequence[Session], run_held: RunHeld, reached: float | None
                 ) -> Lease[dict[str, Tensor]]:
    # A lease for the caller's thread, whose job runs ``sessions``' graphs held from now
    # until the lease is over (run or cancelled), so that an unload meanwhile closes them
    # only after it. On a busy device, or when the request may join a batch that waits
    # for company, the request runs as a job instead (batched, or in a worker thread,
    # started by the thread that frees a slot: see wasinn.actors.slots) and its outputs
    # come back as a settled lease: a caller's thread that waited for trio to grant it a
    # slot would leave the device idle for two thread wake-ups and a trio round trip
    # between runs.
    if not actor.slot_free() or (_gathers(batching) and BatchInputs.of(inputs) is not None):
        outputs = await _execute(actor, key, run, keep, batching, inputs, priority=priority,
                                 deadline=deadline, tenant=tenant, label=label,
                                 account=account, reached=reached)
        return settled(str(actor.device), outputs)
    held = _hold(sessions)
    try:
        lease = await actor.lease(functools.partial(run_held, held, inputs, keep),
                                  priority=priority, deadline=deadline, tenant=tenant,
                                  account=account, reached=reached)
    except BaseException:
        _let_go(sessions)
        raise
    lease.then(functools.partial(_let_go, sessions))
    return lease


def _load_here(registry: BackendRegistry, backend: str, builders: Builders,
               encoding: GraphEncoding, device: Device, options: LoadOptions
               ) -> CompiledGraph:
    # In a worker thread: the first load of a backend imports its library.
    return registry.get(backend).load(builders, encoding, device, options)


def _gathers(batching: Batching | None) -> bool:
    """Whether batches wait for company: such requests must reach trio to join one."""
    return batching is not None and batching.max_delay > 0


def _chain_key(name: str, models: Sequence[LoadedModel], links: Sequence[Link]
               ) -> tuple[object, ...]:
    """What a pipeline's batches are keyed by on a device: the pipeline, its steps'
    graphs and its wiring (two pipelines of the same models wired differently compute
    different things, so their requests must never share a run)."""
    return ("pipeline", name, tuple(model.id for model in models), tuple(links))


def _label(model: LoadedModel, session: Session) -> str:
    return f"run of {model.name} ({session.backend})"


def _rank(actor: DeviceActor) -> tuple[bool, int]:
    # Least loaded first, a lost device last.
    return actor.lost is not None, actor.load


def _input_bytes(inputs: Inputs) -> int | None:
    """The inputs' total size, or None when one has no known size (never run inline)."""
    total = 0
    for value in inputs.values():
        nbytes = getattr(value, "nbytes", None)
        if not isinstance(nbytes, int):
            return None
        total += nbytes
    return total


def _keep(actor: DeviceActor, keep_on_device: bool | None) -> bool:
    if keep_on_device is None:
        return actor.device.kind is not ExecutionTarget.CPU
    if keep_on_device is True or keep_on_device is False:
        return keep_on_device
    if isinstance(keep_on_device, np.bool_):
        return bool(keep_on_device)
    raise InvalidArgumentError(
        f"keep_on_device={keep_on_device!r:.60} ({type(keep_on_device).__name__}): expected "
        "True, False or None (native outputs off the CPU, host outputs on it)")


def _run(session: Session, inputs: Inputs, keep: bool) -> dict[str, Tensor]:
    # Runs in the actor's worker thread; the in-use count defers an unload's close.
    compiled = session.acquire()
    try:
        return compiled.run(inputs, keep_on_device=keep)  # type: ignore[arg-type]
    finally:
        session.release()


def _run_first(held: Sequence[CompiledGraph], inputs: Inputs, keep: bool
               ) -> dict[str, Tensor]:
    # A model lease's job (a RunHeld): the one graph held for it.
    return held[0].run(inputs, keep_on_device=keep)  # type: ignore[arg-type]


def _run_chain(sessions: Sequence[Session], links: Sequence[Link], inputs: Inputs,
               keep: bool, *, named: Named | None = None) -> dict[str, Tensor]:
    # Runs in the actor's worker thread; the in-use counts defer an unload's close.
    held = _hold(sessions)  # raises before any run if one was unloaded
    try:
        return _chain(links, held, inputs, keep, named=named)
    finally:
        _let_go(sessions)


def _step_label(named: Named | None, step: int) -> str | None:
    """How a pipeline's errors name its step ``step``: the pipeline, the step's number and
    model, and, after the first, the step that fed it (its inputs came from there, not
    from the caller). None for a chain with no name (a warm-up's). Made only for an
    error: nothing is formatted on a request's way."""
    if named is None:
        return None
    name, models = named
    fed = f", fed by step {step - 1}" if step else ""
    return f"pipeline {name!r} step {step} ({models[step].name!r}{fed})"


def _chain(links: Sequence[Link], compiled: Sequence[CompiledGraph], inputs: Inputs,
           keep: bool, *, named: Named | None = None) -> dict[str, Tensor]:
    # Every step on this device, natives passed along. A cancelled job (abandoned, or its
    # device closing) stops between steps, whatever its backends can interrupt. A step's
    # error is prefixed with its label (_step_label).
    cancellation = current_cancellation()
    last = len(compiled) - 1
    current: dict[str, Tensor] = {}
    for step, graph in enumerate(compiled):
        if step and cancellation is not None and cancellation.cancelled:
            raise BackendRuntimeError(
                f"pipeline cancelled after step {step} of {len(compiled)}")
        fed = inputs if step == 0 else {inp: current[out] for out, inp in links[step - 1]}
        try:
            current = graph.run(fed, keep_on_device=keep or step < last)  # type: ignore[arg-type]
        except WasiNNError as exc:
            label = _step_label(named, step)
            if label is None:
                raise
            raise exc.prefixed(label) from exc
        except Exception as exc:  # the backend's library's own, as backend_failure says
            label = _step_label(named, step)
            if label is None:
                raise
            raise BackendRuntimeError(
                f"{label}: the backend failed: {type(exc).__name__}: {exc}") from exc
    return current


def _hold(sessions: Sequence[Session]) -> list[CompiledGraph]:
    """Every session's graph, each acquired (in use until :func:`_let_go`). Raises
    ClosedResourceError, holding none, when one was unloaded."""
    held: list[CompiledGraph] = []
    try:
        for session in sessions:
            held.append(session.acquire())
    except ClosedResourceError:
        _let_go(sessions[: len(held)])
        raise
    return held


def _let_go(sessions: Sequence[Session]) -> None:
    """Release what :func:`_hold` acquired (in any thread)."""
    for session in sessions:
        session.release()


def _held_by(lease: Lease[dict[str, Tensor]] | None, sessions: Sequence[Session]
             ) -> Lease[dict[str, Tensor]] | None:
    # A lease taken for a job on held graphs lets go of them once over; no lease: now.
    if lease is None:
        _let_go(sessions)
    else:
        lease.then(functools.partial(_let_go, sessions))
    return lease


def _warn_unread_options(model: LoadedModel, backend: str) -> None:
    # A model that names no backend may carry options for another (the config accepts a
    # key some backend here reads): say which ones the chosen backend leaves unread.
    reads = BACKEND_OPTIONS.get(backend)
    if reads is None:
        return  # not built in: it may read anything
    unread = sorted(key for key in model.options.extra if not reads[1](key))
    if unread:
        log.warning("%s runs on %s, which does not read option(s) %s: they are ignored "
                    "(%s reads %s)", model.name, backend, ", ".join(unread), backend,
                    reads[0])


def _callers_level() -> int:
    """The ``stacklevel`` at which a warning raised by the caller of this function points
    to the first frame outside wasinn: the user's code that asked for it."""
    level = 1
    frame: FrameType | None = sys._getframe(1)  # the caller: level 1
    while frame is not None and _in_wasinn(frame.f_globals.get("__name__")):
        frame = frame.f_back
        level += 1
    return level


def _in_wasinn(module: object) -> bool:
    return isinstance(module, str) and (module == "wasinn" or module.startswith("wasinn."))
