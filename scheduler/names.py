"""The model registry behind ``load_by_name``: names looked up, loaded lazily, shared.

A name is only ever a key into the config's ``[models]`` and ``[pipelines]`` tables: it is
never joined to a path, so a guest cannot reach host files through it. The first caller
of a name loads it; callers arriving meanwhile wait for that same load (one load however
many ask) and share the result. The entry is kept while any handle or context uses it
(or for the runtime's lifetime when the model is ``resident``); after it is released the
next caller loads it again.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

from wasinn.actors.pending import Pending
from wasinn.actors.stats import RequestStats
from wasinn.configs import shown_name
from wasinn.enums import ExecutionTarget
from wasinn.errors import InvalidArgumentError, NotFoundError, WasiNNError

from .model import Executable

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
            self._loaded[name] = entry
            return entry
        except WasiNNError as exc:
            pending.error = exc
            raise
        finally:
            del self._loading[name]
            pending.done.set()

    def loaded(self) -> list[Executable]:
        """Every name's latest load so far, released since or not, in the registry's
        order."""
        entries = [self._loaded.get(name) for name in self._names]
        return [entry[0] for entry in entries if entry is not None]

    def requests(self) -> list[tuple[str, RequestStats]]:
        """Each name loaded so far and the requests of its latest load, released since or
        not, in the registry's order; after :meth:`drop_all` too."""
        # Snapshots, each one C call that holds the GIL: any thread may read this (a
        # metrics scrape) while the event loop loads a model.
        loaded, dropped = list(self._loaded.items()), dict(self._dropped)
        live = {name: entry[0].requests for name, entry in loaded}
        return [(name, live[name] if name in live else dropped[name])
                for name in self._names if name in live or name in dropped]

    def drop_all(self) -> None:
        """Forget every entry (the runtime is closing; device actors free the graphs), but
        keep what :meth:`requests` reports."""
        self._dropped.update({name: entry[0].requests for name, entry in self._loaded.items()})
        self._loaded.clear()
