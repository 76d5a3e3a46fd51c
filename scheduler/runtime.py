"""``Runtime``: the front door of the scheduler.

::

    async with wasinn.Runtime.from_config("configs/pools.toml") as rt:   # or wasinn.Runtime()
        g = await rt.load([model_bytes], encoding="onnx", target="cpu")
        ctx = g.init_execution_context(target="gpu")
        out = await ctx.compute({"input": array})

Entering the runtime probes the devices its pools name (in a worker thread: probing may
import backend libraries), starts one :class:`~wasinn.actors.device.DeviceActor` per
device with ``nursery.start`` (each reports ready only once its device is usable), and
leaves them serving until the runtime is closed. Closing fails queued requests with
ClosedResourceError, cancels the jobs running in the actors' worker threads (abandoned
ones included) and waits for them, at most each pool's ``close_timeout`` seconds, joins
those threads, then frees every compiled graph (one still used by a job that outlived
the timeout is freed when that job ends; see :mod:`wasinn.actors.device`). A pool that
finds no device is logged as a warning (logger ``wasinn.scheduler``).

Besides its lifetime and the API here, the runtime's parts live beside it: its pools made
into device actors in :mod:`._pools`, the loading of models and registry entries in
:mod:`._loading`, and the checking of what callers hand it in :mod:`._arguments`.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import trio

from wasinn._utf8 import utf8_text
from wasinn.actors.batching import Batching
from wasinn.actors.device import DeviceActor
from wasinn.actors.stats import DeviceStats, ModelStats, TenantStats
from wasinn.backends.base import Backend, Device, LoadOptions
from wasinn.backends.sandbox import ProcessLimit, Spares
from wasinn.configs import shown_name
from wasinn.enums import ExecutionTarget, GraphEncoding
from wasinn.errors import ClosedResourceError, InvalidArgumentError, WasiNNError

from ._arguments import backend_instances, check_backend_options, checked_options, owned_builders
from ._loading import ModelLoading, pipeline_key
from ._pools import plan_pools
from .actorhost import ActorHost
from .graph import Graph
from .names import LoadedGraphs, NameRegistry, added, merged_figures
from .pipeline import Pipeline, PipelineModel
from .placement import Scheduler
from .tenants import TenantLedger
from .triorun import check_trio_run, yields_when_refused
from .warmup import WarmUp, ZeroInput, preload

if TYPE_CHECKING:
    from wasinn.configs.schema import RuntimeConfig

log = logging.getLogger("wasinn.scheduler")

#: What a call that would run or load is told once the runtime is closed by aclose.
_CLOSED = "the runtime is closed"


class Runtime(ModelLoading):
    """Device actors, placement, the model registry and the async API, for one config.

    ``Runtime()`` uses the embedded default (``wasinn/configs/default.toml``: every
    installed backend, the CPU pool); ``Runtime.from_config(path)`` (or ``Runtime(path)``)
    reads a TOML file; ``Runtime(config)`` takes a
    :class:`~wasinn.configs.schema.RuntimeConfig`. ``backends``
    adds backend instances (third-party or test backends) to every pool's registry; the
    config's backend names are checked against these and the installed ones (ConfigError).
    Use it with ``async with``; every method must be called from trio.

    Handles are not finalized: a :class:`Graph` dropped without ``unload()``, or a context
    without ``close()``, keeps its model's compiled graphs until the runtime closes. Unload
    and close them (``try``/``finally``, ``with ctx:``) when the runtime outlives them.
    """

    def __init__(self, config: RuntimeConfig | str | os.PathLike[str] | None = None, *,
                 backends: Iterable[Backend] = ()) -> None:
        from wasinn.configs.loader import check_backends, load_config, packaged_config
        from wasinn.configs.schema import RuntimeConfig

        self._extra = backend_instances(backends)
        if config is None:
            config = packaged_config()
        elif isinstance(config, str | os.PathLike):  # as from_config
            config = load_config(config, backends=[b.name for b in self._extra])
        elif not isinstance(config, RuntimeConfig):
            raise InvalidArgumentError(
                f"Runtime(config): expected a RuntimeConfig, a TOML file's path or None "
                f"(the embedded default), not {type(config).__name__}")
        self._config = config
        check_backends(config, str(config.source or "<config>"),
                       [backend.name for backend in self._extra])
        self._host: ActorHost | None = None
        self._scheduler: Scheduler | None = None
        self._spares: Spares | None = None
        self._tenants = TenantLedger(config.tenant_weights)
        self._started = False
        self._closed = False
        self._names = NameRegistry(
            [*config.models, *config.pipelines], self._load_named,
            resident=[name for name, entry in [*config.models.items(),
                                               *config.pipelines.items()] if entry.kept],
        )
        self._graphs = LoadedGraphs(kept=self._names.names())

    @classmethod
    def from_config(cls, path: str | os.PathLike[str], *, backends: Iterable[Backend] = ()
                    ) -> Runtime:
        """A runtime for the TOML config at ``path`` (NotFoundError, ConfigError); the
        config may name the ``backends`` given here besides the installed ones."""
        from wasinn.configs.loader import load_config

        extra = tuple(backends)
        return cls(load_config(path, backends=[b.name for b in extra]), backends=extra)

    # -- lifetime -------------------------------------------------------------------------
    async def __aenter__(self) -> Runtime:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Probe devices and start one actor per device; ready when this returns.

        Models and pipelines the config marks ``preload`` or ``warmup`` are loaded,
        compiled and warmed up before this returns (see :mod:`wasinn.scheduler.warmup`).

        Prefer ``async with runtime:``. Called directly, pair it with :meth:`aclose`,
        which any task may call, from within any cancel scope (the actors are served by
        a trio system task of their own: :mod:`wasinn.scheduler.actorhost`); a runtime
        never closed is stopped when ``trio.run`` ends.

        Raises UnsupportedOperationError for a configured device that is missing or
        cannot be opened, ConfigError for an unknown backend name in the config, and
        what loading a preloaded model raises (NotFoundError for a missing file...),
        its name in the message; the runtime is closed again then. An :meth:`aclose`
        while it starts stops what has started, and this raises ClosedResourceError.
        Awaited outside trio (asyncio), or in another trio run than a started runtime's,
        this and ``load``, ``load_by_name`` and ``aclose`` raise RuntimeError and change
        nothing: the runtime can still be started in trio.
        """
        self._check_trio("start")  # before anything changes: a wrong loop spoils nothing
        if self._closed and not self._started:
            raise ClosedResourceError("the runtime was closed before it started: make a new "
                                      "Runtime")
        if self._started:
            raise InvalidArgumentError("a Runtime can be started once")
        self._started = True
        actors, registries = await trio.to_thread.run_sync(plan_pools, self._config, self._extra)
        self._tenants.attach(actors)  # (weights set since the config's)
        self._check_not_closed_while_starting()
        fallback = self._config.runtime.fallback
        section = self._config.runtime
        # Unset: Spares' default, the bound this Python process shares (host_limit), so
        # that runtimes side by side run no more than the machine's bound together.
        most = section.max_sandbox_processes
        self._spares = Spares(section.sandbox_spares,
                              limit=None if most is None else ProcessLimit(most),
                              extra_env=section.sandbox_env,
                              extra_read=section.sandbox_read)
        scheduler = Scheduler(actors, registries,
                              fallback=ExecutionTarget.coerce(fallback) if fallback else None,
                              spares=self._spares, tenants=self._tenants)
        # Known before it starts, so that an aclose meanwhile stops it.
        self._host = host = ActorHost(actors)
        await host.start()  # a device that cannot be opened: raised, the others stopped
        self._check_not_closed_while_starting()
        self._scheduler = scheduler
        log.debug("runtime started: devices %s", [a.device.name for a in actors])
        await self._preload()

    def _check_trio(self, method: str) -> None:
        # Before anything changes: a call from outside trio, or from another trio run than
        # the one the runtime serves in, gets a RuntimeError saying so (see triorun); from
        # a later run, a ClosedResourceError: "closed" where aclose stopped the runtime
        # before its run ended (scheduler.stopped), else that the run's end stopped it.
        scheduler = self._scheduler
        token = None if scheduler is None else scheduler.trio_token
        closed = _CLOSED if scheduler is not None and scheduler.stopped else None
        check_trio_run(token, f"Runtime.{method}", closed)

    def _check_not_closed_while_starting(self) -> None:
        if self._closed:
            raise ClosedResourceError("the runtime was closed while it started")

    async def _preload(self) -> None:
        # The config's preload/warmup entries, readied before start returns; a failure
        # stops the runtime again (see wasinn.scheduler.warmup).
        config = self._config
        keys = {**{name: f"{config.model_key(name)}.warmup_inputs" for name in config.models},
                **{name: pipeline_key(config, name, "warmup_inputs")
                   for name in config.pipelines}}
        plan = {name: WarmUp(entry.warmup,
                             {k: ZeroInput(tuple(given.shape), given.tensor_type)
                              for k, given in entry.warmup_inputs.items()},
                             keys[name])
                for name, entry in [*config.models.items(), *config.pipelines.items()]
                if entry.at_start}
        if not plan:
            return
        began = trio.current_time()
        try:
            await preload(self._names, self._sched, plan)
        except BaseException:
            await self.aclose()
            raise
        log.info("preloaded %s in %.2f s", ", ".join(
            f"{name} ({warm.runs} warm-up run(s))" if warm.runs else name
            for name, warm in plan.items()
        ), trio.current_time() - began)

    async def aclose(self) -> None:
        """Stop every actor: queued requests fail with ClosedResourceError, running jobs
        are cancelled (their callers get ClosedResourceError; ONNX Runtime and OpenVINO
        runs stop within milliseconds); returns once every job running in a worker
        thread has finished (a thread left in native code at interpreter exit would
        abort the process), the threads are joined and the compiled graphs freed, or
        once a pool's ``close_timeout`` has passed for a job that ignores cancellation
        (an error is logged naming the device and the job). That wait is shielded:
        cancelling the caller does not cut it short, but it never lasts longer than the
        largest ``close_timeout``. Idempotent; any task may call it, and a call while
        another is closing returns once that close is done, as does a call from a later
        trio run once the runtime's own has ended (which stopped it). RuntimeError
        outside trio."""
        try:
            self._check_trio("aclose")
        except ClosedResourceError:  # stopped with the trio run it served
            self._closed = True
            return
        if not self._closed:
            self._closed = True
            if self._scheduler is not None:
                self._scheduler.stopped = True
                self._scheduler.stop_waiting()
            self._names.drop_all()
            self._graphs.close()
        try:
            if self._host is not None:
                await self._host.stop()  # idempotent: a later caller waits for the same stop
            else:
                await trio.lowlevel.checkpoint()
        finally:
            if self._spares is not None:
                # Shielded too (killing idle processes takes milliseconds): a runtime
                # left from a cancelled scope (a timeout, Ctrl-C) must not leave them.
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(self._spares.close)

    # -- what is here -------------------------------------------------------------------------
    @property
    def config(self) -> RuntimeConfig:
        return self._config

    @functools.cached_property
    def _backend_names(self) -> list[str]:
        # Every backend name known here: an entry-point scan (ms), so once per runtime.
        from wasinn.configs.loader import known_backends

        return known_backends(b.name for b in self._extra)

    @property
    def _sched(self) -> Scheduler:
        if self._closed:
            raise ClosedResourceError(_CLOSED)
        if self._scheduler is None:
            raise ClosedResourceError(
                "the runtime is not running: use `async with wasinn.Runtime() as rt:`"
            )
        return self._scheduler

    @property
    def devices(self) -> list[Device]:
        """The devices this runtime has an actor for."""
        return self._sched.devices

    @property
    def actors(self) -> list[DeviceActor]:
        """The device actors (for diagnostics and tests)."""
        return list(self._sched.actors)

    def stats(self) -> list[DeviceStats]:
        """Each device's queue, slots, graphs and request outcomes and latencies so far,
        one snapshot per device actor (see :class:`wasinn.actors.DeviceStats`); once the
        runtime is closed, the final figures. Raises ClosedResourceError before it starts."""
        scheduler = self._scheduler if self._closed else self._sched
        if scheduler is None:  # closed without having started
            return []
        return [actor.stats() for actor in scheduler.actors]

    def tenant_stats(self) -> list[TenantStats]:
        """Each tenant's requests so far, on every device and for every model (see
        :mod:`wasinn.scheduler.tenants`), the most recently active last: outcomes,
        latencies and the device time they took (``running_seconds``), with the tenant's
        weight. Tenants with no request yet are not listed; ``""`` stands for the
        requests that name no tenant. Also after the runtime is closed."""
        return self._tenants.stats()

    def tenant_weight(self, tenant: str) -> float:
        """``tenant``'s share of a ``fair`` pool's device time (the config's ``[tenants]``
        weight, or the latest :meth:`set_tenant_weight`; 1 for a tenant named in
        neither)."""
        return self._tenants.weight(tenant)

    def set_tenant_weight(self, tenant: str, weight: float) -> None:
        """Give ``tenant`` ``weight`` as its share of every ``fair`` pool's device time
        from now on, as ``[tenants.NAME] weight`` does at start-up: while other tenants
        have requests waiting too, a tenant of weight 2 gets twice the device time of one
        of weight 1. The device time it has had so far is not made up for. Raises
        InvalidArgumentError unless ``weight`` is a finite number > 0 (also a ValueError)
        and unless ``tenant`` is a str (also a TypeError) of valid UTF-8 (as a request's
        tenant must be: not a lone surrogate); pools of another policy ignore
        weights. From any thread, before the runtime starts too."""
        self._tenants.set_weight(tenant, weight)

    def model_stats(self) -> list[ModelStats]:
        """The requests of each model by name (see :meth:`Graph.stats`): of each registry
        model and pipeline loaded so far, since the runtime started, over all its loads
        (one released by every handle, as a guest's is when it exits, and loaded again
        goes on from the counts it had; its latency percentiles are its latest load's),
        in the registry's order; then of the graphs :meth:`load` loaded (a guest's
        ``load`` too) that are loaded still, under their ``name`` (``graph#N`` for one
        given none), in the order of their first loads. After the runtime is closed, the
        final figures.

        One name, one entry: graphs loaded under the same name, and a registry model of
        that name, are added up (counts and running seconds add; the latency
        percentiles are those of their windows of latest requests together, and
        ``latency_window`` their size). A graph from :meth:`load` that is unloaded while
        another of its name is loaded, or whose name the registry has, leaves its counts
        in the sum, so that they never go down; once no graph of a name from :meth:`load`
        is loaded (and the registry has no such name) the name is no longer listed. Only
        the graphs' figures are held here: a graph dropped or unloaded is freed as it
        would be without them."""
        loaded = {name: (parts, retired) for name, parts, retired in self._graphs.requests()}
        stats = []
        for name, requests, earlier in self._names.requests():
            parts, retired = loaded.pop(name, ([], None))
            stats.append(ModelStats(**merged_figures([requests, *parts], added(earlier, retired)),
                                    name=name))
        return stats + [ModelStats(**merged_figures(parts, retired), name=name)
                        for name, (parts, retired) in loaded.items()]

    def model_names(self) -> list[str]:
        """The registry's model and pipeline names, as ``load_by_name`` accepts them."""
        return self._names.names()

    @property
    def name_registry(self) -> NameRegistry:
        return self._names

    # -- loading --------------------------------------------------------------------------
    @yields_when_refused
    async def load(
        self,
        builders: Sequence[bytes | bytearray | memoryview],
        encoding: GraphEncoding | str = GraphEncoding.AUTODETECT,
        target: ExecutionTarget | str = ExecutionTarget.CPU,
        *,
        backend: str | None = None,
        options: LoadOptions | Mapping[str, Any] | None = None,
        name: str = "",
        batching: Batching | None = None,
    ) -> Graph:
        """Load a model from its bytes (one buffer per file; IR: xml then weights).

        ``target`` is the graph's default; the model is compiled there now so that bad
        bytes fail here. ``name`` names it in stats, logs and errors (default
        ``graph#N``); it is not entered in the registry, but :meth:`model_stats` (and so
        a Prometheus scrape) lists it under that name while it is loaded. ``batching``
        lets requests that wait for the same device at the same time run as one batch
        (see :class:`wasinn.Batching`). ``options``: a LoadOptions, or a mapping with
        ``precision`` (one of ``wasinn.configs.PRECISIONS``), ``threads``, and backend
        options (as keys, or under ``extra``). The graph keeps its compiled sessions until
        :meth:`Graph.unload` (or the runtime closes). Raises InvalidEncodingError (bytes
        no backend reads, an empty builder list), InvalidArgumentError (a ``name`` that is
        not valid UTF-8, unknown
        encoding/target/backend names, bad options, batching for a model whose first
        dimension is fixed or whose declared shapes show an output without the inputs'
        batch dimension first: see :func:`wasinn.actors.batching.check_batchable`),
        UnsupportedOperationError (no device or backend for the target).
        """
        self._check_trio("load")
        owned = owned_builders(builders)
        if batching is not None and not isinstance(batching, Batching):
            raise InvalidArgumentError(
                f"batching must be a wasinn.Batching, not {type(batching).__name__}")
        if not isinstance(name, str):
            raise InvalidArgumentError(
                f"name {name!r:.60} ({type(name).__name__}): expected a str naming the model "
                "in stats, logs and errors")
        utf8_text("name", name)
        load_options = checked_options(options)
        check_backend_options(load_options, backend, lambda: self._backend_names)
        try:
            model, kind = await self._load_model(
                owned, GraphEncoding.coerce(encoding), target, backend=backend,
                options=load_options, name=name, batching=batching,
            )
        except WasiNNError as exc:
            if not name:
                raise
            raise exc.prefixed(f"model {shown_name(name)}") from exc
        self._graphs.add(model)  # (for model_stats, until it is released)
        return Graph(model, self._sched, kind)

    @yields_when_refused
    async def load_by_name(self, name: str) -> Graph:
        """The registry's model or pipeline called ``name`` (a :class:`Pipeline` for a
        pipeline), loaded on first use and shared by every caller. The model stays loaded
        while any handle on it is not unloaded (or any context not closed), or for the
        runtime's lifetime when the config keeps it (``resident``, ``preload``).

        Raises NotFoundError for a name not in the registry or a registered file that is
        missing, SecurityError for a file outside the config's directory, and whatever
        loading the model raises.
        """
        self._check_trio("load_by_name")
        scheduler = self._sched
        executable, target = await self._names.get(name)
        try:  # (a model loaded first as a pipeline's step was compiled on its device)
            kind = scheduler.resolve_target(target)
        except WasiNNError as exc:
            raise exc.prefixed(f"{self._config.model_key(name)}.target"
                               if name in self._config.models
                               else pipeline_key(self._config, name, "target")) from exc
        if isinstance(executable, PipelineModel):
            return Pipeline(executable, scheduler, kind)
        return Graph(executable, scheduler, kind)

    # -- guests -----------------------------------------------------------------------------
    async def run_wasm(self, path: str | os.PathLike[str], *, argv: Sequence[str] = (),
                       dirs: Mapping[str, Any] | None = None,
                       env: Mapping[str, str] | None = None,
                       stdin: bytes | os.PathLike[str] | Literal["inherit"] | None = None,
                       tenant: str | None = None) -> int:
        """Run a WebAssembly guest against this runtime; its exit code (see
        wasinn.host.runner.run_wasm: ``stdin`` is empty unless given). Every request of
        the guest is made for ``tenant`` (a ``fair`` pool shares device time among
        tenants); None: the guest file's name, such as ``"classify.wasm"``."""
        import wasinn.host.runner

        self._sched  # noqa: B018 - raises when the runtime is not running
        return await wasinn.host.runner.run_wasm(self, path, argv=argv, dirs=dirs, env=env,
                                                 stdin=stdin, tenant=tenant)
