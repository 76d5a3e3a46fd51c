"""The model registry behind ``load_by_name``: names looked up, loaded lazily, shared.

A name is only ever a key into the config's ``[models]`` and ``[pipelines]`` tables: it is
never joined to a path, so a guest cannot reach host files through it. The first caller
of a name loads it; callers arriving meanwhile wait for that same load (one load however
many ask) and share the result. The entry is kept while any handle or context uses it
(or for the runtime's lifetime when the model is ``resident``); after it is released the
next caller loads it again. A name's request figures last the runtime's lifetime: each new
load of it takes up the counts of the loads before (:meth:`NameRegistry.requests`), so a
host that runs guest after guest, each loading the name and releasing it as it exits,
never sees its counters go down.

:class:`LoadedGraphs` keeps the names of the graphs ``Runtime.load`` loads from bytes,
which the registry never holds, so that ``Runtime.model_stats`` (and a Prometheus scrape)
reports them by name too; :func:`merged_figures` adds up the figures of loads that share
a name.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

from wasinn.actors.pending import Pending
from wasinn.actors.stats import Latencies, RequestStats
from wasinn.configs import shown_name
from wasinn.enums import ExecutionTarget
from wasinn.errors import InvalidArgumentError, NotFoundError, WasiNNError

from .model import Executable, LoadedModel

#: How many registered names a NotFoundError lists.
_LISTED = 20

#: A loaded name and its default target as configured (each caller resolves it: a
#: fallback is warned about at the caller's line, a missing device raised to the caller).
Entry = tuple[Executable, str]


class NameRegistry:
    """Named models and pipelines, each loaded on first use by ``load``."""

    def __init__(self, names: Iterable[str],
                 load: Callable[[str, ExecutionTarget | None], Awaitable[Entry]],
                 *, resident: Iterable[str] = ()) -> None:
        self._names = tuple(names)
        self._known = frozenset(self._names)
        self._load = load
        self._resident = frozenset(resident)
        self._loaded: dict[str, Entry] = {}
        #: Each name's request figures, kept by drop_all (the runtime is closed).
        self._dropped: dict[str, RequestStats] = {}
        #: Each name's SUMMED figures of its loads before the latest.
        self._earlier: dict[str, Tally] = {}
        #: Each name's loads before the latest that had runs in flight when it was
        #: loaded again (a lease not yet run): read live until those end, then summed
        #: into ``_earlier`` (see _settle).
        self._replaced: dict[str, list[Executable]] = {}
        #: Held to change or read the three above: a scrape (any thread) must never see
        #: a name's new load without the counts of the one it replaced.
        self._lock = threading.Lock()
        self._loading: dict[str, Pending] = {}
        #: How many loads actually ran, per name (for tests and metrics).
        self.loads: dict[str, int] = {}

    def names(self) -> list[str]:
        return list(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._known

    async def get(self, name: str, *, run_on: ExecutionTarget | None = None) -> Entry:
        """The loaded entry for ``name``, loading it if needed.

        ``run_on`` is the kind of device the caller will run it on (a pipeline's step):
        a load started now compiles it there first, not on its own default target.

        Raises NotFoundError for a name not in the registry, and the load's own error
        (InvalidEncodingError, NotFoundError for a missing file, ...) when loading fails;
        every caller waiting on that load gets an error of the same type and message.
        """
        if not isinstance(name, str):
            raise InvalidArgumentError(
                f"a model's or pipeline's name is a str, not {type(name).__name__}")
        if name not in self._known:
            known = ", ".join(self._names[:_LISTED]) or "none"
            if len(self._names) > _LISTED:
                known += f" and {len(self._names) - _LISTED} more (rt.model_names())"
            raise NotFoundError(
                f"no model or pipeline named {shown_name(name)}: registered: {known}")
        while True:
            entry = self._loaded.get(name)
            if entry is not None and not getattr(entry[0], "released", False):
                return entry
            pending = self._loading.get(name)
            if pending is None:
                break
            await pending.wait()
        pending = self._loading[name] = Pending()
        try:
            entry = await self._load(name, run_on)
            self.loads[name] = self.loads.get(name, 0) + 1
            if name in self._resident:
                entry[0].retain()  # the registry's own reference: never released
            with self._lock:
                previous = self._loaded.get(name)
                if previous is not None:  # (released: its counts go on in the new load's)
                    self._replaced.setdefault(name, []).append(previous[0])
                self._settle(name)
                self._loaded[name] = entry
            return entry
        except WasiNNError as exc:
            pending.error = exc
            raise
        finally:
            del self._loading[name]
            pending.done.set()

    def _settle(self, name: str) -> None:
        # Under the lock: sum the replaced loads of ``name`` whose runs have all ended
        # (each run is counted before it ends) into its earlier figures.
        replaced = self._replaced.get(name, [])
        for load in [load for load in replaced if not load.in_flight.waiting()]:
            _add(self._earlier.setdefault(name, _nothing()), load.requests.figures())
            replaced.remove(load)
        if not replaced:
            self._replaced.pop(name, None)

    def loaded(self) -> list[Executable]:
        """Every name's latest load so far, released since or not, in the registry's
        order."""
        entries = [self._loaded.get(name) for name in self._names]
        return [entry[0] for entry in entries if entry is not None]

    def requests(self) -> list[tuple[str, RequestStats, Tally | None]]:
        """Each name loaded so far, in the registry's order, with the requests of its
        latest load (released since or not) and the :data:`SUMMED` figures of its loads
        before that (None: it was loaded once): together, its figures since the runtime
        started. After :meth:`drop_all` too. Any thread may call this (a metrics scrape)
        while the event loop loads a model.

        A run that ends on a load after the next load replaced it (a lease lent before
        every handle was unloaded, run by its thread after the name was loaded again) is
        counted for the name too, as it ends."""
        with self._lock:
            live = {name: entry[0].requests for name, entry in self._loaded.items()}
            live = {**self._dropped, **live}
            earlier = {name: dict(tally) for name, tally in self._earlier.items()}
            for name, loads in self._replaced.items():
                tally = earlier.setdefault(name, _nothing())
                for load in loads:
                    _add(tally, load.requests.figures())
        return [(name, live[name], earlier.get(name)) for name in self._names if name in live]

    def drop_all(self) -> None:
        """Forget every entry (the runtime is closing; device actors free the graphs), but
        keep what :meth:`requests` reports."""
        with self._lock:
            self._dropped.update(
                {name: entry[0].requests for name, entry in self._loaded.items()})
            self._loaded.clear()


#: The request figures that add up over the loads of one name (the others, the latency
#: percentiles and window, are taken over their windows together).
SUMMED = ("completed", "failed", "timed_out", "cancelled", "rejected", "in_caller_thread",
          "batches", "batched", "running_seconds")

#: The summed figures of the graphs of one name that are gone (see LoadedGraphs).
Tally = dict[str, float]


def _nothing() -> Tally:
    # The SUMMED figures of no request.
    return {**dict.fromkeys(SUMMED, 0), "running_seconds": 0.0}


def _add(tally: Tally, figures: Mapping[str, Any]) -> None:
    # Add the SUMMED fields of ``figures`` (a tally, or RequestStats.figures()) to ``tally``.
    for field in SUMMED:
        tally[field] += figures[field]


def added(*tallies: Tally | None) -> Tally | None:
    """The :data:`SUMMED` figures of ``tallies`` taken together (None stands for none;
    all None: None), for :func:`merged_figures`."""
    given = [tally for tally in tallies if tally is not None]
    if not given:
        return None
    total = _nothing()
    for tally in given:
        _add(total, tally)
    return total


def merged_figures(parts: Sequence[RequestStats], retired: Tally | None = None
                   ) -> dict[str, Any]:
    """The :class:`~wasinn.actors.stats.RequestFigures` fields of ``parts`` (the request
    figures of loads that share a name) taken together, with ``retired`` (the
    :data:`SUMMED` figures of loads gone): counts and running seconds add up; the latency
    percentiles are those of the parts' windows of latest completed requests together,
    and ``latency_window`` is their size. One part alone: its own figures."""
    if len(parts) == 1 and not retired:
        return parts[0].figures()
    sums: Tally = {**_nothing(), **(retired or {})}
    together = Latencies([], [], [], [])
    for part in parts:
        figures = part.figures()
        for key in SUMMED:
            sums[key] += figures[key]
        _, _, window = part.snapshot()
        for ordered, more in zip(together, window, strict=True):
            ordered.extend(more)
    for ordered in together:
        ordered.sort()
    return {**sums, **together.figures()}


class LoadedGraphs:
    """The graphs ``Runtime.load`` loaded and that are loaded still, by name, for
    ``Runtime.model_stats``.

    Only a graph's request figures are held (its :class:`RequestStats`), never the graph:
    its model, bytes and compiled graphs go as they would without this. A graph leaves
    when it is released (its last handle unloaded and context closed), or when its model
    is collected without that. Its counts are then kept in its name's tally while another
    graph of that name is loaded, or for good when the name is one of ``kept`` (the
    registry's: its series is reported for the runtime's lifetime): so a name's counters
    never go down while its series lasts. Once no graph of a name is loaded, the name
    (not ``kept``) and its tally are forgotten: names given to ``load`` are free-form, and
    an unnamed graph's (``graph#N``) is new each time, so a long-running host that loads
    graph after graph keeps no figures of those gone. After :meth:`close`, nothing leaves.

    Every method may be called from any thread; nothing here is on a request's path.
    """

    def __init__(self, kept: Iterable[str] = ()) -> None:
        self._kept = frozenset(kept)
        self._lock = threading.Lock()
        #: Each loaded graph's name and figures, by its model's id, in load order.
        self._loaded: dict[int, tuple[str, RequestStats]] = {}
        #: How many graphs of each name are loaded.
        self._count: Counter[str] = Counter()
        self._retired: dict[str, Tally] = {}
        #: The ids of models collected without a release, left by their finalizers (which
        #: run wherever the collection happens, maybe under our lock: they take no lock).
        self._collected: deque[int] = deque()
        self._closed = False

    def add(self, model: LoadedModel) -> None:
        """Report ``model``, just loaded, until it is released or collected."""
        key, name, requests, then = model.id, model.name, model.requests, model.on_release

        def released(model: LoadedModel) -> None:
            if then is not None:
                then(model)
            self.retire(key)

        # Only the model holds ``released``: it is collected with the model.
        model.on_release = released
        weakref.finalize(released, self._collected.append, key).atexit = False
        with self._lock:
            self._drain()  # (so that the keys of models gone never pile up unread)
            self._loaded[key] = (name, requests)
            self._count[name] += 1

    def retire(self, key: int) -> None:
        """The model of id ``key`` was released: it leaves (see the class docstring)."""
        with self._lock:
            self._retire(key)

    def close(self) -> None:
        """The runtime is closing: what is reported now stays, as the final figures."""
        with self._lock:
            self._drain()
            self._closed = True

    def requests(self) -> list[tuple[str, list[RequestStats], Tally | None]]:
        """Each name with a graph loaded (or a tally kept), in the order of their first
        loads: the figures of its loaded graphs, and its tally of those gone (or None)."""
        with self._lock:
            self._drain()
            parts: dict[str, list[RequestStats]] = {}
            for name, requests in self._loaded.values():
                parts.setdefault(name, []).append(requests)
            for name in self._retired:
                parts.setdefault(name, [])
            retired = {name: dict(tally) for name, tally in self._retired.items()}
        return [(name, figures, retired.get(name)) for name, figures in parts.items()]

    def _drain(self) -> None:
        # Under the lock: retire the models collected since.
        while self._collected:
            self._retire(self._collected.popleft())

    def _retire(self, key: int) -> None:
        # Under the lock.
        if self._closed:
            return
        entry = self._loaded.pop(key, None)
        if entry is None:  # (released, then collected: gone already)
            return
        name, requests = entry
        self._count[name] -= 1
        if self._count[name] or name in self._kept:
            _add(self._retired.setdefault(name, _nothing()), requests.figures())
        else:
            del self._count[name]
            self._retired.pop(name, None)
