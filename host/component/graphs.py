"""A component guest's graphs and execution contexts: loaded, held, let go of.

:class:`GraphOperations` is the part of :class:`~wasinn.host.component.service.NNService`
that implements wasi-nn's ``graph`` interface (``load``, ``load-by-name``,
``init-execution-context``), ``wasinn:nn/bulk.load-words`` and
``wasinn:nn/scratch.load-from-scratch`` (builders read from the guest's scratch files).
A graph is unloaded when its last holder, the graph handle or a context created from it,
is dropped; one whose unload was cancelled waits for
:meth:`~wasinn.host.component.service.NNService.close`, and one a guest's call obtains
after the close is released at once. A guest holds at most ``max_graphs`` graphs (the
loaded ones: a graph its contexts keep counts after its handle is dropped) and
``max_model_bytes`` of models, and only graphs whose default target it is allowed to use,
whichever way they were loaded.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from wasinn.enums import ExecutionTarget, GraphEncoding
from wasinn.errors import (
    InvalidArgumentError,
    TooLargeError,
    UnsupportedOperationError,
    WasiNNError,
)
from wasinn.host.component.scratch import ScratchDir
from wasinn.host.component.tables import ContextEntry, GraphEntry, GuestTables
from wasinn.host.guest_memory import MAX_BUILDERS, check_model_name
from wasinn.host.guest_thread import guest_stopped, shielded
from wasinn.host.limits import GuestLimits
from wasinn.host.registered import load_registered
from wasinn.host.scheduler_api import Portal
from wasinn.host.tenant import graph_name

log = logging.getLogger("wasinn.host.component")


class GraphOperations:
    """The graph and context operations of
    :class:`~wasinn.host.component.service.NNService`, which sets what follows."""

    runtime: Any
    portal: Portal
    limits: GuestLimits
    tables: GuestTables
    scratch: ScratchDir | None
    tenant: str
    _model_bytes: int
    _loaded: int
    _live_graphs: int
    _unloading: list[GraphEntry]
    _lock: threading.Lock
    _closed: bool

    def _check_target(self, target: ExecutionTarget | None) -> None:
        self.limits.check_target(target)

    def load(self, builders: Sequence[bytes | memoryview], encoding: str, target: str) -> int:
        enc, tgt = self._load_request(encoding, target)
        if not builders:
            raise InvalidArgumentError("load needs at least one graph-builder; got none")
        return self._load(builders, enc, tgt)

    def load_from_scratch(self, names: Sequence[str], encoding: str, target: str) -> int:
        """``wasinn:nn/scratch.load-from-scratch``: ``graph.load`` of the scratch files
        ``names``, one a builder, in order. Their sizes are checked against
        ``max_model_bytes`` before any byte is read (:meth:`ScratchDir.read_files`);
        then the bytes load exactly as ``graph.load``'s would."""
        enc, tgt = self._load_request(encoding, target)
        if not names:
            raise InvalidArgumentError(
                "load-from-scratch needs at least one scratch file name; got none")
        if len(names) > MAX_BUILDERS:
            raise InvalidArgumentError(
                f"load-from-scratch got {len(names)} scratch file names: expected at most "
                f"{MAX_BUILDERS}, one a graph builder (a model is one file, or a few for "
                "formats such as OpenVINO IR's xml + weights)")
        if self.scratch is None:
            raise UnsupportedOperationError(
                "this guest was started without a scratch directory: load the model with "
                "graph.load, wasinn:nn/bulk's load-words or load-by-name instead")
        self._check_graph_room()  # before reading what could not be kept
        builders = self.scratch.read_files(names, self._reserve_model_bytes)
        return self._load(builders, enc, tgt)

    def _load_request(self, encoding: str, target: str) -> tuple[GraphEncoding, ExecutionTarget]:
        """A load's encoding and target, the target checked against the guest's."""
        enc = GraphEncoding.coerce(encoding)
        tgt = ExecutionTarget.coerce(target)
        self._check_target(tgt)
        return enc, tgt

    def _load(self, builders: Sequence[bytes | memoryview], enc: GraphEncoding,
              tgt: ExecutionTarget) -> int:
        """Load a model from the guest's own bytes, within its model and graph limits."""
        size = sum(len(b) for b in builders)
        self._reserve_model_bytes(size)
        self._check_graph_room()
        start = time.perf_counter()
        name = graph_name(self.tenant, self._loaded)
        self._loaded += 1  # (a failed load too: each load's errors name it apart)
        graph = self.portal.run(
            functools.partial(self.runtime.load, list(builders), encoding=enc, target=tgt,
                              options=self.limits.load_options(), name=name))
        rep = self._add_graph(graph, f"{enc.value} graph", size)
        log.info("graph %d: %d bytes of %s loaded for %s in %.1f ms", rep, size, enc.value,
                 tgt.value, (time.perf_counter() - start) * 1e3)
        return rep

    def load_words(self, builders: Sequence[tuple[int, bytes]], encoding: str, target: str
                   ) -> int:
        """``wasinn:nn/bulk.load-words``: builders as (byte length, padded words)."""
        data: list[bytes | memoryview] = []
        for i, (size, words) in enumerate(builders):
            if not 0 <= size <= len(words) < size + 8 or len(words) % 8:
                raise InvalidArgumentError(
                    f"builder {i} claims {size} bytes but carries {len(words) // 8} words: "
                    f"expected {(size + 7) // 8}"
                )
            data.append(memoryview(words)[:size])
        return self.load(data, encoding, target)

    def load_by_name(self, name: str) -> int:
        check_model_name(name)
        self._check_graph_room()
        start = time.perf_counter()
        graph = load_registered(self.portal, self.runtime, name)
        # The registry chose this graph's default target, not the guest: check it as if
        # the guest had asked for it (_add_graph), or plain init-execution-context and
        # one-shot compute would run it on a target the guest may not use.
        rep = self._add_graph(graph, f"graph {name!r}", 0)
        log.info("graph %d: %r loaded by name in %.1f ms", rep, name,
                 (time.perf_counter() - start) * 1e3)
        return rep

    def _check_graph_room(self) -> None:
        """Raise TooLargeError when the guest has ``max_graphs`` graphs loaded. Counted are
        the graphs loaded for it, not its graph handles: a context keeps its graph loaded
        after the handle is dropped, and each graph may be a sandbox process."""
        if self._live_graphs >= self.limits.max_graphs:
            raise TooLargeError(
                f"this guest already has {self._live_graphs} graphs loaded "
                f"({len(self.tables.graphs)} graph handles), the most it may hold at once "
                f"([guests] max_graphs): a graph stays loaded while its handle or any context "
                f"created from it is live; drop them to free it before loading another"
            )

    def _reserve_model_bytes(self, size: int) -> None:
        if self._model_bytes + size > self.limits.max_model_bytes:
            raise TooLargeError(
                f"loading {size} bytes of model would bring this guest to "
                f"{self._model_bytes + size} bytes of loaded models, over its limit of "
                f"{self.limits.max_model_bytes} ([guests] max_model_bytes)"
            )

    def _add_graph(self, graph: Any, label: str, size: int) -> int:
        """Hand a loaded graph to the guest; unloaded again (and the error raised) when its
        default target is not allowed (SecurityError), the table is full or the guest was
        closed meanwhile (ClosedResourceError)."""
        entry = GraphEntry(graph, label, model_bytes=size)
        self._model_bytes += size
        self._live_graphs += 1
        try:
            self._check_target(getattr(graph, "default_target", None))
            with self._lock:
                self._check_open()
                return self.tables.graphs.add(entry)
        except WasiNNError:
            self._release_graph(entry)
            raise

    def _check_open(self) -> None:
        if self._closed:
            raise guest_stopped()

    def graph_drop(self, rep: int) -> None:
        entry = self.tables.graphs.pop(rep)
        if entry is not None:
            self._release_graph(entry)

    def _release_graph(self, entry: GraphEntry) -> None:
        entry.holders -= 1
        if entry.holders == 0:
            self._unloading.append(entry)
            self._unload(entry)

    def _unload(self, entry: GraphEntry) -> None:
        """Unload a graph nobody holds. When cancelled (trio.Cancelled propagates), the
        graph stays in ``_unloading``, still counted against the guest, for :meth:`close`."""
        if entry.unloaded:
            return
        # Not waiting for runs in flight: a compute the guest gave up on (its timeout) may
        # still run, and it frees the graph as it ends; the guest must not wait for it.
        unload = functools.partial(entry.graph.unload, wait_for_runs=False)
        try:
            if self._closed:  # after close(): nobody else would unload it
                self.portal.run(shielded, unload)
            else:
                self.portal.run(unload)
        except Exception:  # the guest has let go; a failed unload must not reach it
            log.exception("unloading %s failed", entry.label)
        entry.unloaded = True
        self._model_bytes -= entry.model_bytes
        self._live_graphs -= 1
        with contextlib.suppress(ValueError):  # (close() and an abandoned call, both)
            self._unloading.remove(entry)

    def init_context(self, graph_rep: int, target: str | None = None) -> int:
        graph = self.tables.graphs.get(graph_rep)
        tgt = None if target is None else ExecutionTarget.coerce(target)
        self._check_target(tgt)
        ctx = self.portal.run_sync(
            functools.partial(graph.graph.init_execution_context, target=tgt)
        )
        entry = ContextEntry(ctx, graph)
        try:
            with self._lock:
                self._check_open()
                rep = self.tables.contexts.add(entry)
                graph.holders += 1
        except WasiNNError:
            self._close_context(entry)
            raise
        return rep

    def context_drop(self, rep: int) -> None:
        entry = self.tables.contexts.pop(rep)
        if entry is not None:
            self._drop_context(entry)

    def _drop_context(self, entry: ContextEntry) -> None:
        try:
            self._close_context(entry)
        finally:  # even when cancelled: the graph then waits in _unloading for close()
            self._release_graph(entry.graph)

    def _close_context(self, entry: ContextEntry) -> None:
        if entry.closed:
            return
        entry.closed = True
        self._unstage(entry)
        try:
            self.portal.run_sync(entry.context.close)
        except Exception:
            log.exception("closing a context of %s failed", entry.graph.label)

    def _unstage(self, entry: ContextEntry) -> None:
        for tensor in entry.inputs.values():
            self.tables.tensors.let_go(tensor)
        entry.inputs.clear()
        self._forget_outputs(entry)

    def _forget_outputs(self, entry: ContextEntry) -> None:
        for tensor in (entry.outputs or {}).values():
            self.tables.tensors.let_go(tensor)
        entry.outputs = None
