"""Running a placed request: as a job on its device, merged into a batch, or as a lease.

:class:`Requests` is the part of :class:`~.placement.Scheduler` that runs requests, a
model's (:meth:`~Requests.run_model`) or a pipeline's (:meth:`~Requests.run_chain`), once
placement has picked their device: a request whose graph is not compiled there yet waits
for the compile (counted as the device's load meanwhile, and bounded by its deadline),
then runs as one job in a worker thread, or merged with others when its model batches
(:mod:`wasinn.actors.batching`). A lease (:meth:`~Requests.lease_model`, and
:meth:`~Requests.try_lease_model` from any thread) lets the caller's own thread run it
instead, the compiled graphs held until the lease is over (see :mod:`._jobs`).

A request carries its run's label (``"run of resnet (onnxruntime)"``, ``"run of pipeline
'p'"``), which its deadline's and a full queue's errors start with. Each request that
fails, times out, is refused or withdrawn is logged at DEBUG (logger ``wasinn.scheduler``:
its label, device and error; a lease's run in the holder's thread: ``wasinn.actors``),
from its error's path only: a completed request pays nothing for it.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import trio

from wasinn.actors.batching import Batching, BatchInputs, RunInputs
from wasinn.actors.device import DeviceActor
from wasinn.actors.inline import RunProfile
from wasinn.actors.lease import Lease, settled
from wasinn.actors.session import Session
from wasinn.actors.stats import Account, outcome_of
from wasinn.enums import ExecutionTarget
from wasinn.errors import ClosedResourceError, InvalidArgumentError, TimeoutError_, WasiNNError
from wasinn.tensor import Tensor

from ._jobs import Link, RunHeld, chain, held_by, hold, let_go, run_chain, run_first, run_session
from .model import Inputs, LoadedModel
from .tenants import TenantLedger
from .triorun import A_REQUEST, REQUESTS_CLOSED, check_trio_run

log = logging.getLogger("wasinn.scheduler")


class Requests:
    """Requests run on the devices placement picks (see the module docstring): the
    scheduler's ``__init__`` sets what follows, and it places and compiles."""

    tenants: TenantLedger
    trio_token: trio.lowlevel.TrioToken | None
    stopped: bool

    if TYPE_CHECKING:
        def pick(self, kind: ExecutionTarget, inputs: Inputs) -> DeviceActor: ...
        def _serving(self, actor: DeviceActor) -> DeviceActor: ...
        def _placed_here(self, target: ExecutionTarget, inputs: Inputs
                         ) -> DeviceActor | None: ...
        async def session(self, actor: DeviceActor, model: LoadedModel) -> Session: ...

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
                              account=account, profile=session.profile, reached=reached,
                              batch_major=model.batch_major)

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
                            account=account, sessions=(session,), run_held=run_first,
                            reached=reached, batch_major=model.batch_major)

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
            held = hold(sessions)  # until the lease is over
        except ClosedResourceError:
            return None  # unloaded meanwhile: lease_model says so
        job = functools.partial(run_first, held, inputs, _keep(actor, keep_on_device))
        # (labelled where a deadline's error may name it: every caller's thread's run
        # would pay for the label)
        label = "" if timeout is None else _label(model, session)
        return held_by(actor.try_lease(job, timeout=timeout, tenant=tenant,
                                       account=self.tenants.account(model.requests, tenant),
                                       label=label),
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
            held = hold(sessions)
        except ClosedResourceError:
            return None  # unloaded meanwhile: lease_chain says so
        job = functools.partial(chain, links, held, inputs, _keep(actor, keep_on_device),
                                named=(name, models), counted=True, leased=True)
        label = "" if timeout is None else f"run of pipeline {name!r}"  # (see above)
        return held_by(actor.try_lease(job, timeout=timeout, tenant=tenant,
                                       account=self.tenants.account(account, tenant),
                                       label=label),
                       sessions)

    async def _model_job(self, model: LoadedModel, target: ExecutionTarget, inputs: Inputs,
                         deadline: float, account: Account
                         ) -> tuple[DeviceActor, Session, RunInputs, float | None]:
        # The actor that runs it, its session there, how to run it on inputs, and when
        # (perf_counter) the request reached the device if it waited there for the
        # compile (None: it reaches it now, its graph compiled).
        check_trio_run(self.trio_token, A_REQUEST, REQUESTS_CLOSED if self.stopped else None)
        actor = self._serving(self.pick(target, inputs))
        if model.released:
            raise ClosedResourceError(f"{model.name} was unloaded")
        session = actor.cached_session(model.id)
        reached = None
        if session is None:
            reached = time.perf_counter()
            session = await self._placed_session(actor, model, deadline, account, reached)
        return actor, session, functools.partial(run_session, session), reached

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
            if isinstance(exc, WasiNNError):
                _log_ended(f"run of {model.name}", actor, exc,
                           " while its graph was compiled there")
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
                        batching: Batching | None = None, batch_major: bool = False
                        ) -> dict[str, Tensor]:
        """Run ``models`` one after another on ONE ``target`` device, as one job, feeding
        each step's native outputs to the next along ``links``; the last step's outputs
        follow ``keep_on_device`` as in :meth:`run_model`. ``account``: the pipeline's
        stats, where the request is counted too (and in its tenant's; each step's run is
        counted in its model's: see :func:`._jobs.chain`); ``batching``: the
        pipeline's, if any; ``batch_major``: whether its steps declare the outputs they
        pass on batch-major (see :func:`~.pipeline.check_chain_batchable`): if not, the
        first merged run of each input signature is checked against a run alone."""
        account = self.tenants.account(account, tenant)
        actor, sessions, reached = await self._chain_job(name, models, links, target, inputs,
                                                         deadline, account)
        run = functools.partial(run_chain, sessions, links, named=(name, models), counted=True)
        return await _execute(actor, chain_key(name, models, links), run,
                              _keep(actor, keep_on_device), batching, inputs,
                              priority=priority, deadline=deadline, tenant=tenant,
                              label=f"run of pipeline {name!r}", account=account,
                              reached=reached, batch_major=batch_major)

    async def lease_chain(self, name: str, models: Sequence[LoadedModel],
                          links: Sequence[Link], target: ExecutionTarget, inputs: Inputs, *,
                          priority: int = 0, deadline: float = float("inf"), tenant: str = "",
                          keep_on_device: bool | None = None,
                          account: Account | None = None,
                          batching: Batching | None = None, batch_major: bool = False
                          ) -> Lease[dict[str, Tensor]]:
        """:meth:`run_chain` for the caller's own thread (see :meth:`lease_model`)."""
        account = self.tenants.account(account, tenant)
        actor, sessions, reached = await self._chain_job(name, models, links, target, inputs,
                                                         deadline, account)
        named = (name, models)
        return await _lease(actor, chain_key(name, models, links),
                            functools.partial(run_chain, sessions, links, named=named,
                                              counted=True),
                            _keep(actor, keep_on_device), batching, inputs,
                            priority=priority, deadline=deadline, tenant=tenant,
                            label=f"run of pipeline {name!r}", account=account,
                            sessions=sessions,
                            run_held=functools.partial(chain, links, named=named,
                                                       counted=True, leased=True),
                            reached=reached, batch_major=batch_major)

    async def _chain_job(self, name: str, models: Sequence[LoadedModel], links: Sequence[Link],
                         target: ExecutionTarget, inputs: Inputs, deadline: float,
                         account: Account | None
                         ) -> tuple[DeviceActor, list[Session], float | None]:
        # The actor that runs the chain, each step's session there, and when the request
        # reached the device if it waited there for a step's compile (see _model_job).
        check_trio_run(self.trio_token, A_REQUEST, REQUESTS_CLOSED if self.stopped else None)
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
                   profile: RunProfile | None = None, reached: float | None = None,
                   batch_major: bool = False) -> dict[str, Tensor]:
    # ``run`` on ``actor``: merged with others when the model batches and ``inputs`` can;
    # else as one job (``profile``: the graph's run timings, for inline runs; ``reached``:
    # when the request reached the device, if it waited there for its graph's compile;
    # ``batch_major``: whether the model declares its outputs batch-major, else the first
    # merged run of each input signature is checked against a run alone).
    try:
        if batching is not None:
            batch = BatchInputs.of(inputs)
            if batch is not None:
                return await actor.execute_batched(
                    key, batch, run, batching, keep_on_device=keep, priority=priority,
                    deadline=deadline, tenant=tenant, label=label, account=account,
                    reached=reached, probe=not batch_major)
        return await actor.execute(functools.partial(run, inputs, keep), priority=priority,
                                   deadline=deadline, tenant=tenant, profile=profile,
                                   nbytes=None if profile is None else _input_bytes(inputs),
                                   label=label, account=account, reached=reached)
    except WasiNNError as exc:  # (a try costs nothing until something is raised)
        _log_ended(label, actor, exc)
        raise


async def _lease(actor: DeviceActor, key: object, run: RunInputs, keep: bool,
                 batching: Batching | None, inputs: Inputs, *, priority: int,
                 deadline: float, tenant: str, label: str, account: Account | None,
                 sessions: Sequence[Session], run_held: RunHeld, reached: float | None,
                 batch_major: bool = False) -> Lease[dict[str, Tensor]]:
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
                                 account=account, reached=reached, batch_major=batch_major)
        return settled(str(actor.device), outputs)
    held = hold(sessions)
    try:
        lease = await actor.lease(functools.partial(run_held, held, inputs, keep),
                                  priority=priority, deadline=deadline, tenant=tenant,
                                  account=account, reached=reached, label=label)
    except BaseException as exc:
        let_go(sessions)
        if isinstance(exc, WasiNNError):
            _log_ended(label, actor, exc, " before its lease was granted")
        raise
    lease.then(functools.partial(let_go, sessions))
    return lease


def _gathers(batching: Batching | None) -> bool:
    """Whether batches wait for company: such requests must reach trio to join one."""
    return batching is not None and batching.max_delay > 0


def chain_key(name: str, models: Sequence[LoadedModel], links: Sequence[Link]
              ) -> tuple[object, ...]:
    """What a pipeline's batches are keyed by on a device: the pipeline, its steps'
    graphs and its wiring (two pipelines of the same models wired differently compute
    different things, so their requests must never share a run)."""
    return ("pipeline", name, tuple(model.id for model in models), tuple(links))


def _label(model: LoadedModel, session: Session) -> str:
    return f"run of {model.name} ({session.backend})"


def _log_ended(label: str, actor: DeviceActor, exc: WasiNNError, when: str = "") -> None:
    """Log at DEBUG a request (its run's ``label``) on ``actor`` that raised ``exc``
    (failed, timed out, refused, withdrawn: its outcome in the device's stats), ``when``
    it did, if not in the queue or its run."""
    log.debug("%s on %s: %s%s: %s: %s", label, actor.device, outcome_of(exc).value, when,
              type(exc).__name__, exc)


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

