"""A runtime's figures for Prometheus, as an inference server's ``/metrics`` has them.

:class:`RuntimeCollector` is a ``prometheus_client`` custom collector: each scrape reads
:meth:`wasinn.Runtime.stats`, :meth:`~wasinn.Runtime.model_stats` and
:meth:`~wasinn.Runtime.tenant_stats` afresh and turns them into metric families, so the
figures are the runtime's own (nothing is counted twice, nothing drifts)::

    collector = register_metrics(rt)          # into prometheus_client.REGISTRY
    prometheus_client.start_http_server(8000)

or, in a registry of its own and for a while (what ``wasinn run --metrics-port`` does)::

    async with MetricsServer(rt, 8000):       # http://127.0.0.1:8000/metrics
        ...

Names follow Prometheus' conventions: ``{prefix}_{scope}_...`` with scope ``device``,
``model`` or ``tenant`` (and a label of that name), ``_total`` on counters, seconds as
the unit. Per scope: ``requests_total{outcome}`` (completed, failed, timed_out,
cancelled, rejected), ``requests_in_caller_thread_total``, ``batches_total`` and
``batched_requests_total`` (dynamic batching's merged runs and the requests they
answered), ``running_seconds_total`` (the device time of the completed requests), and
``request_latency_seconds{phase, quantile}``: the p50 and p99 (``quantile`` "0.5",
"0.99") of the latest completed requests, end to end (``phase="total"``), queued for a
worker slot (``"queued"``), running (``"running"``) and delivering (``"delivering"``:
from the run's end to its caller taking the result, the wait for a busy event loop), as
gauges: a series whose percentile has no request yet is left out.
``request_latency_window`` says over how many requests they are taken. Devices add
gauges (``workers``, ``running``, ``queued``, ``queue_limit``, ``graphs_held``,
``abandoned_running``, ``lost`` 1 or 0) and counters (``compiles_total``,
``warm_ups_total``, ``runs_passed_on_total``); tenants add ``tenant_weight``. The
tenant ``""`` stands for the requests that name none (Prometheus stores a label of empty
value as no label; ``{tenant=""}`` selects it all the same).

The ``model`` label is a model's name, once per name (see
:meth:`wasinn.Runtime.model_stats`): the registry's models and pipelines, from their
first load for the runtime's lifetime, and the graphs ``Runtime.load`` loaded (a guest's
``load`` from bytes too, named after its tenant and how many it loaded before:
``classify.wasm#0``) while they are loaded. Loads that share a name, with each other or
with a registry model, are one series: their counters add up, their latency percentiles
are those of their windows together; so a scrape never has one label set twice. A
series' counters never go down: a registry model released (by every handle, as each
guest's is when it exits) and loaded again goes on from its counts, and a graph unloaded
while its name's series lasts leaves its counts in it. The gauges are the figures now.
A pipeline's step model also counts, as requests of its own, the runs the pipeline's
requests make of it (as an inference server reports an ensemble's composing models: see
:class:`wasinn.scheduler.pipeline.StepsAccount`), so the model series do not add up to
the device's; the device and the tenant series count each request once.

A scrape never fails for the runtime's lifetime: before the runtime starts there are no
device series (models and tenants have none yet either), once it is closed the final
figures are reported. Scrapes run in the HTTP server's thread; the figures are read
under their own locks, or as snapshots the event loop cannot change halfway. The
exposition is UTF-8, so a label value with no UTF-8 form (a lone surrogate: bytes that
were not UTF-8, as in a file name) would fail the whole scrape: wasinn refuses such model
names and tenants where they are given (``Runtime.load``, ``tenant=``), and should one
come by another way its series are left out of every scrape (a warning, once per name).
They are not written escaped instead (``backslashreplace``): the escaped text may be
another name's, and two identical series make Prometheus reject the scrape whole.

``prometheus-client`` is an optional dependency (``pip install wasinn[metrics]``);
``import wasinn`` does not import it, importing this module does (ImportError naming
the extra when it is missing).
"""

from __future__ import annotations

import errno
import logging
import re
import socket
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import TracebackType
from typing import Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer
from wsgiref.types import ErrorStream

import trio

try:
    from prometheus_client.exposition import start_http_server
    from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
    from prometheus_client.registry import REGISTRY, Collector, CollectorRegistry
except ImportError as exc:  # pragma: no cover - exercised with the module hidden
    raise ImportError(
        f"wasinn.scheduler.metrics needs prometheus-client (>= 0.20), which could not be "
        f"imported ({exc}): install it with `pip install wasinn[metrics]`") from exc

from wasinn._utf8 import has_utf8
from wasinn.actors.stats import (
    DeviceStats,
    ModelStats,
    Outcome,
    RequestFigures,
    TenantStats,
)
from wasinn.errors import ClosedResourceError

__all__ = ["MetricsServer", "RuntimeCollector", "RuntimeFigures", "register_metrics"]

log = logging.getLogger("wasinn.scheduler")

_PREFIX = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
#: (the ``quantile`` label, the RequestFigures field's suffix)
_QUANTILES = (("0.5", "p50"), ("0.99", "p99"))
#: (the ``phase`` label, the RequestFigures field's stem)
_PHASES = (("total", "latency"), ("queued", "queued"), ("running", "running"),
           ("delivering", "delivering"))

_Read = Callable[[DeviceStats], float]

_DEVICE_GAUGES: tuple[tuple[str, str, _Read], ...] = (
    ("workers", "Requests the device may run at once (its worker slots).",
     lambda s: s.workers),
    ("running", "Worker slots held now.", lambda s: s.running),
    ("queued", "Requests waiting for a worker slot now.", lambda s: s.queued),
    ("queue_limit", "Requests that may wait for a worker slot; more are rejected.",
     lambda s: s.queue_limit),
    ("graphs_held", "Compiled graphs held on the device.", lambda s: s.graphs),
    ("abandoned_running", "Abandoned runs (their caller gave up) still in a worker thread.",
     lambda s: s.abandoned_running),
    ("lost", "1 if the device can run nothing more in this process (DeviceLostError), "
             "else 0.", lambda s: 0 if s.lost is None else 1),
)
_DEVICE_COUNTERS: tuple[tuple[str, str, _Read], ...] = (
    ("compiles", "Graphs compiled on the device since its actor started.",
     lambda s: s.compiles),
    ("warm_ups", "Warm-up runs at the runtime's start (not counted as requests).",
     lambda s: s.warm_ups),
    ("runs_passed_on", "Runs a worker thread started on its own as the run before ended "
                       "(under load: the slot passed straight to the next queued request).",
     lambda s: s.passed_on),
)


class RuntimeFigures(Protocol):
    """What a :class:`RuntimeCollector` reads: a :class:`wasinn.Runtime`."""

    def stats(self) -> list[DeviceStats]:
        """Each device's figures (ClosedResourceError before the runtime starts)."""
        ...

    def model_stats(self) -> list[ModelStats]:
        """Each model's request figures, one entry per name."""
        ...

    def tenant_stats(self) -> list[TenantStats]:
        """Each tenant's request figures and weight."""
        ...


class RuntimeCollector(Collector):
    """A ``prometheus_client`` collector of ``runtime``'s figures (see the module
    docstring for the metrics), each family's name starting with ``prefix``. Register it
    with :func:`register_metrics`, or with ``registry.register(collector)``; ValueError
    for a ``prefix`` that is not a metric name. :meth:`collect` reads the runtime afresh
    each time, from any thread."""

    def __init__(self, runtime: RuntimeFigures, prefix: str = "wasinn") -> None:
        if not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix):
            raise ValueError(
                f"RuntimeCollector(prefix={prefix!r}): expected a metric name prefix: a "
                f"letter, '_' or ':', then letters, digits, '_' or ':'")
        self.runtime = runtime
        self.prefix = prefix
        self._unwritable = _Unwritable()

    def collect(self) -> Iterator[Metric]:
        """The families, with the runtime's figures now (less the series of a name with
        no UTF-8 form: see the module docstring)."""
        try:
            devices = self.runtime.stats()
        except ClosedResourceError:  # not started yet: no device actors to read
            devices = []
        keep = self._unwritable.keep
        yield from self._families([s for s in devices if keep("device", s.device)],
                                  [s for s in self.runtime.model_stats() if keep("model", s.name)],
                                  [s for s in self.runtime.tenant_stats()
                                   if keep("tenant", s.name)])

    def describe(self) -> Iterator[Metric]:
        """The families without samples: their names, for the registry to check for
        duplicates without reading the runtime."""
        yield from self._families([], [], [])

    def _families(self, devices: Sequence[DeviceStats], models: Sequence[ModelStats],
                  tenants: Sequence[TenantStats]) -> Iterator[Metric]:
        yield from _request_families(self.prefix, "device",
                                     [(s.device, s) for s in devices])
        for kind, table in ((GaugeMetricFamily, _DEVICE_GAUGES),
                            (CounterMetricFamily, _DEVICE_COUNTERS)):
            for suffix, help_text, read in table:
                family = kind(f"{self.prefix}_device_{suffix}", help_text, labels=["device"])
                for stats in devices:
                    family.add_metric([stats.device], read(stats))
                yield family
        yield from _request_families(self.prefix, "model", [(s.name, s) for s in models])
        yield from _request_families(self.prefix, "tenant", [(s.name, s) for s in tenants])
        weight = GaugeMetricFamily(
            f"{self.prefix}_tenant_weight",
            "The tenant's share of a fair pool's device time (1: the default).",
            labels=["tenant"])
        for tenant in tenants:
            weight.add_metric([tenant.name], tenant.weight)
        yield weight


class _Unwritable:
    """Which label values a scrape leaves out, as they have no UTF-8 form, and the
    warning for each (once per scope and value; the first :data:`_MAX_WARNED`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._warned: set[tuple[str, str]] = set()

    def keep(self, scope: str, value: str) -> bool:
        """Whether the series of ``scope`` (device, model, tenant) ``value`` can be
        written (one C call for an ASCII value: every series' is checked)."""
        if has_utf8(value):
            return True
        self._warn(scope, value)
        return False

    def _warn(self, scope: str, value: str) -> None:
        with self._lock:
            if (scope, value) in self._warned or len(self._warned) >= _MAX_WARNED:
                return
            self._warned.add((scope, value))
        log.warning("metrics: %s %s is left out of every scrape: it is not valid UTF-8 "
                    "(a lone surrogate, as bytes that are not UTF-8 become), which the "
                    "exposition cannot carry; its figures are in the runtime's stats",
                    scope, ascii(value))


#: The most names an exporter warns of (a warning each); the others are left out quietly.
_MAX_WARNED = 64


def register_metrics(runtime: RuntimeFigures, registry: CollectorRegistry | None = None, *,
                     prefix: str = "wasinn") -> RuntimeCollector:
    """Register a :class:`RuntimeCollector` of ``runtime`` with ``registry``
    (``prometheus_client.REGISTRY`` by default) and return it, for
    ``registry.unregister`` later. ValueError (``prometheus_client``'s) when the registry
    already has metrics of these names: another runtime's under the same ``prefix``."""
    collector = RuntimeCollector(runtime, prefix)
    (REGISTRY if registry is None else registry).register(collector)
    return collector


def _request_families(prefix: str, scope: str,
                      rows: Sequence[tuple[str, RequestFigures]]) -> Iterable[Metric]:
    """The request figures' families of one scope (``device``, ``model`` or ``tenant``,
    also the label's name), a row per label value."""
    name = f"{prefix}_{scope}"
    requests = CounterMetricFamily(
        f"{name}_requests", f"Requests by how they ended (outcome), per {scope}.",
        labels=[scope, "outcome"])
    in_caller_thread = CounterMetricFamily(
        f"{name}_requests_in_caller_thread",
        f"Requests (any outcome) a lease holder's own thread ran, per {scope}.",
        labels=[scope])
    batches = CounterMetricFamily(
        f"{name}_batches", f"Merged runs (dynamic batching: two requests or more run as "
                           f"one), per {scope}.", labels=[scope])
    batched = CounterMetricFamily(
        f"{name}_batched_requests", f"Requests answered by merged runs, per {scope}.",
        labels=[scope])
    running_seconds = CounterMetricFamily(
        f"{name}_running_seconds", f"Seconds running (from the grant of a worker slot to "
                                   f"the run's end), summed over the completed requests: "
                                   f"their device time, per {scope}.",
        labels=[scope])
    latency = GaugeMetricFamily(
        f"{name}_request_latency_seconds",
        f"Latency percentile (quantile) of the latest completed requests, per {scope}: end "
        f"to end (phase total), waiting for a worker slot (queued), from its grant to the "
        f"run's end (running), from there to the caller taking the result (delivering: "
        f"a busy event loop).", labels=[scope, "phase", "quantile"])
    window = GaugeMetricFamily(
        f"{name}_request_latency_window",
        f"Completed requests the latency percentiles are taken over, per {scope}.",
        labels=[scope])
    for label, figures in rows:
        for outcome in Outcome:
            requests.add_metric([label, outcome.value], getattr(figures, outcome.value))
        in_caller_thread.add_metric([label], figures.in_caller_thread)
        batches.add_metric([label], figures.batches)
        batched.add_metric([label], figures.batched)
        running_seconds.add_metric([label], figures.running_seconds)
        for phase, stem in _PHASES:
            for quantile, suffix in _QUANTILES:
                value: float | None = getattr(figures, f"{stem}_{suffix}")
                if value is not None:
                    latency.add_metric([label, phase, quantile], value)
        window.add_metric([label], figures.latency_window)
    return (requests, in_caller_thread, batches, batched, running_seconds, latency, window)


#: What an OSError of binding the server's socket means, for its message.
_BIND_ERRORS = {
    errno.EADDRINUSE: "the address is in use (another server listens there): choose "
                      "another port, or 0 for a free one",
    errno.EADDRNOTAVAIL: "the address is not one of this machine's",
    errno.EACCES: "permission denied (a port below 1024 needs privileges)",
}


#: How long the metrics server waits for a connection's next bytes (a request's, or the
#: room to send a reply) before it closes it.
CONNECTION_TIMEOUT_S = 10.0


class MetricsServer:
    """``runtime``'s figures served at ``http://addr:port/metrics`` by
    ``prometheus_client``'s own HTTP server (``start_http_server``: a daemon thread, a
    thread per scrape), from a :class:`CollectorRegistry` of its own that holds only a
    :class:`RuntimeCollector` of ``runtime`` (nothing of ``prometheus_client.REGISTRY``),
    until :meth:`close`. A connection that sends nothing, or stops sending or reading, for
    :data:`CONNECTION_TIMEOUT_S` is closed (it would hold a server thread). The server
    writes nothing on stderr: a connection that timed out, or that its client reset or
    aborted, is logged at DEBUG on the ``wasinn.scheduler`` logger, and a request that
    failed otherwise at ERROR, with its traceback (see :class:`_LoggingHandler`).

    ``addr`` is 127.0.0.1 unless given: only this machine may scrape (give an address of
    another interface, or 0.0.0.0, to be scraped from elsewhere: the figures name models
    and tenants). ``port`` 0 takes a free one: :attr:`port` says which. The server
    starts when this is made, blocking for the bind (and for resolving ``addr``: make it
    in a worker thread from an event loop). Raises ValueError for a ``port`` that is not
    0 to 65535 or an ``addr`` that is not a str, and OSError naming the address and port
    when the server cannot listen there (in use, not this machine's, a name that does
    not resolve or is no host name at all, such as one with a label over 63 characters).
    """

    def __init__(self, runtime: RuntimeFigures, port: int, addr: str = "127.0.0.1", *,
                 prefix: str = "wasinn") -> None:
        if type(port) is not int or not 0 <= port <= 65535:
            raise ValueError(f"MetricsServer(port={port!r}): expected a TCP port from 0 to "
                             f"65535 (0: a free one)")
        if not isinstance(addr, str) or not addr:
            raise ValueError(f"MetricsServer(addr={addr!r}): expected an address to listen "
                             f"on, such as 127.0.0.1")
        self.addr = addr
        self.registry = CollectorRegistry()
        register_metrics(runtime, self.registry, prefix=prefix)
        try:
            server, thread = start_http_server(port, addr, self.registry)
        except OSError as exc:
            if isinstance(exc, socket.gaierror):
                why = f"the address does not resolve ({exc.strerror})"
            else:
                why = _BIND_ERRORS.get(exc.errno or 0) or exc.strerror or str(exc)
            error = OSError(f"cannot serve metrics at {_host(addr)}:{port}: {why}")
            error.errno = exc.errno
            raise error from exc
        except UnicodeError as exc:
            # The resolver's IDNA encoding refuses the name before any lookup: a label
            # over 63 characters, an empty one, bytes that are not UTF-8.
            raise OSError(f"cannot serve metrics at {_host(addr)}:{port}: not a valid host "
                          f"name ({exc.__cause__ or exc})") from exc
        # Each connection's reads and writes time out: else a client that connects and
        # sends nothing (or stops halfway) holds a server thread for ever, and enough of
        # them hold as many threads. (prometheus_client's handler sets no timeout; a
        # subclass of it, for this server only, that logs what fails instead of printing
        # it: _LoggingHandler.)
        handler = server.RequestHandlerClass
        assert isinstance(handler, type)  # (typeshed: any callable making a handler)
        server.RequestHandlerClass = type(
            "TimedHandler", (_LoggingHandler, handler), {"timeout": CONNECTION_TIMEOUT_S})
        self._server: WSGIServer = server
        self._thread: threading.Thread = thread
        self._lock = threading.Lock()
        self._closed = False

    @property
    def port(self) -> int:
        """The port it listens on (the one chosen for port 0)."""
        return int(self._server.server_port)

    @property
    def url(self) -> str:
        """Where the figures are: ``http://ADDR:PORT/metrics``."""
        return f"http://{_host(self.addr)}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and free the port; returns once the server's thread has ended
        (up to half a second: its poll interval). Idempotent, from any thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    async def aclose(self) -> None:
        """:meth:`close` in a worker thread (the event loop does not wait on the server's
        poll); shielded from cancellation: once this returns, the port is free."""
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(self.close)

    async def __aenter__(self) -> MetricsServer:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _host(addr: str) -> str:
    # An IPv6 address in brackets, as a URL (and "ADDR:PORT") writes it.
    return f"[{addr}]" if ":" in addr else addr


class _LoggingHandler(WSGIRequestHandler):
    """What :class:`MetricsServer`'s request handler adds to ``prometheus_client``'s (its
    next base): a request that fails goes to the log, not to stderr, where the standard
    library prints its traceback (socketserver for a request that could not be read,
    wsgiref for a reply that could not be made or sent), which under ``wasinn run
    --metrics-port`` lands amid the guest's own stderr. A connection that timed out
    (:data:`CONNECTION_TIMEOUT_S`) or that its client reset or aborted is logged at DEBUG:
    any port scanner or TCP health check does that, and the connection is closed as it
    should be. Any other failure is logged at ERROR with its traceback."""

    def handle(self) -> None:
        try:
            super().handle()
        except Exception as exc:  # (else socketserver's handle_error prints it)
            _log_failure(self.client_address, exc)

    def get_stderr(self) -> ErrorStream:
        # The request's wsgi.errors, where wsgiref prints the traceback of a reply that
        # failed (and the application its own errors: prometheus_client's writes none).
        return _RequestErrors(self.client_address)


class _RequestErrors:
    """The ``wsgi.errors`` stream of one metrics request. wsgiref prints there the
    traceback of a reply that failed (the application raised, or sending it timed out),
    then flushes, as it handles that exception: the printed text is dropped and the
    exception logged instead (:func:`_log_failure`). Text flushed with no exception being
    handled is logged as it is, at ERROR."""

    def __init__(self, client: object) -> None:
        self._client = client
        self._text: list[str] = []

    def write(self, text: str, /) -> int:
        self._text.append(text)
        return len(text)

    def writelines(self, lines: Iterable[str], /) -> None:
        self._text.extend(lines)

    def flush(self) -> None:
        text = "".join(self._text).strip()
        self._text.clear()
        exc = sys.exception()
        if exc is not None:
            _log_failure(self._client, exc)
        elif text:
            log.error("metrics server, a request from %s: %s", _peer(self._client), text)


def _log_failure(client: object, exc: BaseException) -> None:
    """Log the failure ``exc`` of a request from ``client`` (its address): at DEBUG for a
    connection that timed out or was reset or aborted (the client's doing), else at ERROR
    with the traceback."""
    if isinstance(exc, TimeoutError | ConnectionError):
        log.debug("metrics server: the connection from %s ended (%s: %s)", _peer(client),
                  type(exc).__name__, exc)
    else:
        log.error("metrics server: a request from %s failed", _peer(client), exc_info=exc)


def _peer(client: object) -> str:
    # A client's address as "HOST:PORT" (an IPv6 one's host in brackets).
    if isinstance(client, tuple) and len(client) >= 2:
        return f"{_host(str(client[0]))}:{client[1]}"
    return str(client)
