"""Which backend compiles a model on a device, and the model's compiled session there.

:class:`Sessions` is the part of :class:`~.placement.Scheduler` that compiles: a model's
backend is chosen once per kind of device (the one it names, else the first of the
pool's preference order that reads its encoding there), and its actor compiles it on
first use and caches the session (a sandboxed model in processes of its own). A model
that names no backend, which the chosen one cannot run on a device, is compiled by the
next backend that can, with a warning. :meth:`Sessions.release` frees a model's
sessions on every device when it is unloaded; those a run still uses are closed by the
run as it ends, and :meth:`Sessions.runs_over` waits for that (an unload does), at most
the ``close_timeout`` of the pools the model was compiled on (its ``placed_on``: noted
before each compile, so never on the path of a request whose graph is compiled), its
batches meanwhile waiting for no more company (nobody can join them).

Each compile is logged at DEBUG (logger ``wasinn.scheduler``) as it ends: the model, its
device, its backend and the seconds it took, or why it failed. A sandboxed model is
given its name (see :func:`~wasinn.backends.sandbox.load_sandboxed`'s ``label``), which
its crashes' and refusals' errors and warnings start with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Hashable, Sequence

import trio

from wasinn.actors.device import DeviceActor
from wasinn.actors.session import Session
from wasinn.backends.base import Builders, CompiledGraph, Device, LoadOptions
from wasinn.backends.formats import detect_encoding
from wasinn.backends.registry import BackendRegistry
from wasinn.backends.sandbox import Spares, load_sandboxed
from wasinn.configs import BACKEND_OPTIONS
from wasinn.enums import ExecutionTarget, GraphEncoding
from wasinn.errors import (
    ClosedResourceError,
    DeviceLostError,
    InvalidEncodingError,
    UnsupportedOperationError,
    WasiNNError,
)
from wasinn.tensor import Tensor

from ._jobs import Link, Named, run_chain
from ._requests import chain_key
from .model import Executable, Inputs, LoadedModel

log = logging.getLogger("wasinn.scheduler")


class Sessions:
    """Compiled sessions of models on the scheduler's actors (see the module docstring):
    the scheduler's ``__init__`` sets what follows."""

    actors: list[DeviceActor]
    #: Sandbox processes started ahead of sandboxed loads (None: each load starts its own).
    spares: Spares | None
    _registries: dict[ExecutionTarget, BackendRegistry]
    trio_token: trio.lowlevel.TrioToken | None
    #: Set when the runtime closes: its close then frees every graph, and an unload
    #: waits for no run (a lease not yet run never will be).
    stopped: bool
    #: Set (and dropped) when a run that an unload may be waiting for ends.
    _run_ended: trio.Event | None = None
    #: The unloads waiting in :meth:`runs_over` now.
    _unloads_waiting = 0

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
        registry = self._registry(kind)
        if model.encoding is GraphEncoding.AUTODETECT:
            claimed = _autodetect(model, registry, kind)
            if claimed is not None:
                return claimed
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
        (UnsupportedOperationError: a kernel its library lacks) or cannot read
        (InvalidEncodingError: a variant of its format, an operator domain or an opset
        that library does not know, which another may), is compiled by the next backend
        of the preference order that reads its encoding on that device, with a warning;
        where none can, the first backend's error is raised, followed by each other's."""
        kind = actor.device.kind
        model.placed_on.add(kind)  # (first: an unload from now on waits for this pool)
        backend = await self.backend_for(model, kind)
        try:
            return await self._session_with(actor, model, backend)
        except (UnsupportedOperationError, InvalidEncodingError) as exc:
            if model.backend_name is not None or model.released:
                raise
            return await self._session_with_another(actor, model, backend, exc)

    async def _session_with_another(self, actor: DeviceActor, model: LoadedModel,
                                    failed: str, exc: WasiNNError) -> Session:
        # The backends after ``failed`` in the preference order that read the model's
        # encoding on ``actor``'s device (asking may import them: in a worker thread).
        kind = actor.device.kind
        others = await trio.to_thread.run_sync(self._others, model, kind, failed)
        refusals, first = [], _reason(failed, exc)
        for other in others:
            try:
                session = await self._session_with(actor, model, other)
            except (ClosedResourceError, DeviceLostError):
                raise  # the runtime or the model closed, the device was lost: not a refusal
            except WasiNNError as refusal:  # (told after what the first backend said)
                refusals.append(_refusal(other, refusal, first))
                continue
            log.warning("%s: backend %s cannot run it on %s (%s): it runs on %s instead",
                        model.name, failed, actor.device, exc.message, other)
            model.backends[kind] = other
            _warn_unread_options(model, other)
            return session
        if not refusals:
            raise exc
        raise exc.suffixed(f"(nor could {'; nor '.join(refusals)})")

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
        sandboxed = options.sandboxed_on(actor.device)
        load = (functools.partial(load_sandboxed, registry.ref(backend), spares=self.spares,
                                  processes=actor.workers, label=_given_name(model))
                if sandboxed else functools.partial(_load_here, registry, backend))
        compile_graph = functools.partial(
            _compile_logged, f"{model.name} ({backend}{', sandboxed' if sandboxed else ''})",
            functools.partial(load, model.builders, model.encoding, actor.device, options),
            actor.device)
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

    async def chain_on(self, actor: DeviceActor, models: Sequence[LoadedModel],
                       links: Sequence[Link], inputs: Inputs, *, named: Named | None = None
                       ) -> Callable[[], dict[str, Tensor]]:
        """``models`` (a model, or a pipeline's steps wired by ``links``) compiled on
        ``actor`` now, and a job that runs them there on ``inputs`` (host outputs), for
        work the scheduler does itself, such as warm-ups. ``named``: a pipeline's name
        and steps, whose errors then name the step that failed as its requests' do (see
        :func:`~._jobs.step_label`)."""
        sessions = [await self.session(actor, model) for model in models]
        return functools.partial(run_chain, sessions, links, inputs, False, named=named)

    def release(self, model: LoadedModel) -> None:
        """Free ``model``'s compiled graphs on every device (now or after running jobs:
        each graph a run still uses is closed by the last one as it ends, and counted in
        ``model.in_flight`` until then). Marks it released first: a compile of it still
        under way is then cancelled (a sandboxed load's process is killed), and one that
        ends all the same is closed instead of being cached (see DeviceActor.session's
        ``wanted``)."""
        model.released = True
        in_flight = model.in_flight
        for actor in self.actors:
            session = actor.cached_session(model.id)
            actor.evict(model.id)
            if session is None:
                continue
            key = id(session)
            in_flight.graph_in_use(key, f"{session.backend} graph on {actor.device}")
            if not session.when_unused(functools.partial(in_flight.graph_unused, key)):
                in_flight.graph_unused(key)  # (closed already: no run used it)

    def runs_changed(self) -> None:
        """From any thread (a run's, as it ends): wake the :meth:`runs_over` waiting.

        On every request's path: nothing unless an unload waits (a wake-up of the event
        loop costs tens of microseconds on a virtual machine). No wake-up is lost: a
        waiter is counted before it first reads what it waits for (under that count's
        lock), and this is called after the count changed."""
        token = self.trio_token
        if self._unloads_waiting and token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(self._wake_runs_over)

    def _wake_runs_over(self) -> None:
        event, self._run_ended = self._run_ended, None
        if event is not None:
            event.set()

    def stop_waiting(self) -> None:
        """As the runtime closes (in trio, once ``stopped`` is set): the unloads waiting
        in :meth:`runs_over` return."""
        self._wake_runs_over()

    async def runs_over(self, executable: Executable) -> tuple[list[str], float]:
        """Wait until the runs an unload of ``executable`` waits for have ended (see
        :meth:`Executable.waited_for`: none while a handle or context keeps it loaded),
        the graphs they used closed; at most the largest ``close_timeout`` of the pools
        it is on (:attr:`Executable.placed_on`: its runs and graphs are on no other; on
        none yet, of all pools), and not once the runtime is closed (its close
        frees every graph, and a lease not yet run never will be: see
        :meth:`stop_waiting`). Returns what is still waited for then (empty: nothing)
        and that bound, in seconds. Cancellation: raised, whatever is left still ending
        on its own.

        Meanwhile its batches wait for no more company (see
        :meth:`DeviceActor.gathering_ended`): no request can join them, so those waiting
        for company (``max_delay``) run at once with the members they have, and the
        unload does not wait out ``max_delay`` for them."""
        placed = executable.placed_on
        timeout = max((actor.close_timeout for actor in self.actors
                       if actor.device.kind in placed), default=None)
        if timeout is None:  # compiled nowhere yet: a first request may be on its way
            timeout = max((actor.close_timeout for actor in self.actors), default=0.0)
        self._unloads_waiting += 1  # (first: see runs_changed)
        try:
            with contextlib.ExitStack() as gathering, trio.move_on_after(timeout):
                if executable.waited_for():  # (nothing keeps it: its requests are all)
                    key = _batch_key(executable)
                    for actor in self.actors:
                        gathering.enter_context(actor.gathering_ended(key))
                while True:
                    if self._run_ended is None:
                        self._run_ended = trio.Event()
                    ended = self._run_ended
                    if self.stopped or not executable.waited_for():
                        return [], timeout
                    await ended.wait()
            return executable.waited_for(), timeout
        finally:
            self._unloads_waiting -= 1

    async def graphs_closed(self) -> None:
        """Wait until the graphs evicted so far on every device are closed, those whose
        close blocks (sandboxed ones), which close in a thread, included."""
        for actor in self.actors:
            await actor.graphs_closed()


def _autodetect(model: LoadedModel, registry: BackendRegistry, kind: ExecutionTarget
                ) -> str | None:
    """Set ``model``'s encoding from its bytes: a built-in format's, else the one of the
    backend not built in (given in code, a plugin) whose sniff claims them (see
    :meth:`BackendRegistry.sniff`; only the backend the model names, if it names one),
    whose name is returned then (None: a built-in format's, the backend still to be
    chosen). Raises the built-in detection's InvalidEncodingError when no backend
    claims them, naming the backends asked."""
    try:
        model.encoding = detect_encoding(model.builders)
    except InvalidEncodingError as exc:
        found = registry.sniff(model.builders, kind, model.backend_name)
        if found.name is None or found.encoding is None:
            unclaimed = found.unclaimed()
            if unclaimed:
                raise exc.retold(f"{exc.message}; {unclaimed}") from None
            raise
        model.encoding = found.encoding
        return found.name
    return None


def _refusal(backend: str, exc: WasiNNError, first: str) -> str:
    """Why ``backend`` did not compile a model, after the first backend's reason
    ``first`` (see :func:`_reason`): its name and reason, or that it was the same."""
    reason = _reason(backend, exc)
    return f"{backend}, for the same reason" if reason == first else f"{backend}: {reason}"


def _reason(backend: str, exc: WasiNNError) -> str:
    """``exc``'s message without the name of ``backend``, which a backend's messages
    begin with."""
    message = exc.message
    return message.removeprefix(f"{backend}: ")


def _batch_key(executable: Executable) -> Hashable:
    """What ``executable``'s batches are keyed by on a device (as its requests give it,
    see :mod:`._requests`): a model's id, a pipeline's steps and wiring."""
    if isinstance(executable, LoadedModel):
        return executable.id
    from .pipeline import PipelineModel  # (which imports the scheduler)

    assert isinstance(executable, PipelineModel)
    return chain_key(executable.name, executable.steps, executable.links)


def _given_name(model: LoadedModel) -> str:
    """The name ``model`` was loaded under ("" for none: ``rt.load`` without ``name``,
    whose model is ``graph#N`` in stats and logs, but whose errors name no model, as
    before)."""
    return "" if model.name == f"graph#{model.id}" else model.name


def _compile_logged(what: str, load: Callable[[], CompiledGraph], device: Device
                    ) -> CompiledGraph:
    # ``load()`` in a compile thread, logged at DEBUG as it ends (``what``: the model and
    # its backend): a compile is seconds, a log line nothing beside it.
    start = time.perf_counter()
    try:
        graph = load()
    except BaseException as exc:
        log.debug("%s: compiling on %s failed after %.3f s: %s", what, device,
                  time.perf_counter() - start, exc)
        raise
    log.debug("%s: compiled on %s in %.3f s", what, device, time.perf_counter() - start)
    return graph


def _load_here(registry: BackendRegistry, backend: str, builders: Builders,
               encoding: GraphEncoding, device: Device, options: LoadOptions
               ) -> CompiledGraph:
    # In a worker thread: the first load of a backend imports its library.
    return registry.get(backend).load(builders, encoding, device, options)


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
