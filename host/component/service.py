"""wasi-nn for one component guest, in host terms: reps in, reps out, wasinn errors raised.

:class:`NNService` implements every operation of the WIT interfaces (all release
candidates and the wasinn extension) over one guest's :class:`GuestTables`, reaching
the scheduler through a :class:`~wasinn.host.scheduler_api.Portal`. It knows nothing of
wasmtime: the linker (:mod:`wasinn.host.component.linking`) converts values and turns
every raised :class:`~wasinn.errors.WasiNNError` into an ``error`` resource.

Its operations are grouped by interface, a module each: tensors
(:mod:`~wasinn.host.component.tensors`, with the WIT tensor types and dimensions), graphs
and execution contexts (:mod:`~wasinn.host.component.graphs`) and inference
(:mod:`~wasinn.host.component.inference`); this module joins them with the guest's
``error`` resources and its lifetime (:meth:`NNService.close`).

Outputs are computed with ``keep_on_device=True``: they stay backend-native values
(on the CPU too) until the guest calls ``data()``, so a guest that passes one model's
output to another model's compute never moves it through host or guest memory.

Tensor data can also pass through files in the guest's scratch directory
(``wasinn:nn/scratch``, :mod:`wasinn.host.component.scratch`), which keeps it out of
wasmtime-py's per-value conversion; without a directory those calls raise
UnsupportedOperationError.

Ownership: an owned tensor handed to the host (compute inputs, ``set-input``) leaves
the guest's table at once, whatever happens next. A graph is unloaded when its last
holder, the graph handle or a context created from it, is dropped. :meth:`close`
releases whatever a guest left behind (it trapped, exited or was cancelled), including
a graph whose unload was cancelled half-way. The guest's thread may outlive the close (a
stopped guest blocked in a host call is abandoned: :mod:`wasinn.host.guest_thread`); a
graph or context that one of its calls obtains after the close is released at once,
never added to the tables the close emptied.

Limits (:class:`~wasinn.host.limits.GuestLimits`): dimensions from the guest are
checked for rank (at most :data:`~wasinn.tensor.MAX_RANK`) before any arithmetic on
them; live tensors are bounded in count and bytes (the older RCs' staged inputs and
kept outputs included), errors in count and each error's message in size (see
:mod:`~wasinn.host.component.tables`); the older RCs' ``set-input`` stages only the
graph's own inputs, so a context holds at most one staged tensor per input; a guest may
hold only graphs whose default target it is allowed to use, whichever way they were
loaded. What goes back to the guest is bounded too: ``tensor.data()`` and
``tensor-words`` by ``max_data_bytes`` (:meth:`NNService.tensor_data`), an output's
dimensions by the u32 range of ``tensor-dimensions``
(:func:`~wasinn.host.component.tensors.output_dims`).
"""

from __future__ import annotations

import threading
from typing import Any

from wasinn.errors import ErrorCode, TooLargeError, UnknownError, WasiNNError, error_for_code
from wasinn.host.component.inference import InferenceOperations
from wasinn.host.component.scratch import ScratchDir
from wasinn.host.component.tables import ErrorEntry, GraphEntry, GuestTables, ResourceExhausted
from wasinn.host.component.tensors import (
    U32_MAX,
    WIT_TENSOR_TYPES,
    TensorOperations,
    guest_shape,
    output_dims,
    wit_type_name,
)
from wasinn.host.limits import GuestLimits
from wasinn.host.scheduler_api import Portal
from wasinn.host.tensor_binding import InFlight

__all__ = ["U32_MAX", "WIT_TENSOR_TYPES", "NNService", "guest_shape", "output_dims",
           "wit_type_name"]


class NNService(InferenceOperations, TensorOperations):
    """The wasi-nn operations of one guest instance. Not thread-safe: one guest thread.
    Its requests are made for ``tenant`` (:mod:`wasinn.host.tenant`)."""

    def __init__(
        self,
        runtime: Any,
        portal: Portal,
        limits: GuestLimits | None = None,
        scratch: ScratchDir | None = None,
        *,
        tenant: str = "",
    ) -> None:
        self.runtime = runtime
        self.scratch = scratch
        #: Whom every request of this guest is for (:mod:`wasinn.host.tenant`).
        self.tenant = tenant
        self.portal = portal
        self.limits = limits or GuestLimits()
        self.tables = GuestTables.create(self.limits)
        self._model_bytes = 0
        #: Graphs loaded for this guest until their unload has run: those it holds a
        #: handle to and those only its contexts (or a cancelled unload) keep.
        self._live_graphs = 0
        #: Models this guest loaded from its bytes so far (their names: graph_name).
        self._loaded = 0
        #: Graphs the guest let go of whose unload has not run yet (it was cancelled);
        #: :meth:`close` unloads them.
        self._unloading: list[GraphEntry] = []
        #: The request this guest's thread is running (see :meth:`interrupt`).
        self.in_flight = InFlight()
        # Set when close() begins, with additions of graphs and contexts under the lock
        # (close runs in a thread of its own, maybe while the guest's still runs).
        self._lock = threading.Lock()
        self._closed = False

    def interrupt(self) -> None:
        """Stop the inference this guest is running, from another thread, where the
        backend can; later ones stop as they start (the guest is being stopped)."""
        self.in_flight.interrupt()

    # -- errors -----------------------------------------------------------------------
    def error_new(self, error: WasiNNError) -> int:
        """An ``error`` resource for ``error``: its code and its message, cut to
        :data:`~wasinn.host.component.tables.MAX_ERROR_MESSAGE_BYTES` (a message may
        repeat a guest's string of any length, and ``max_errors`` bounds only the count).

        Raises ResourceExhausted (the guest is trapped) when the guest already holds
        ``max_errors`` errors: the host cannot answer with an error then, and handing out
        handles it does not count would let a guest that never drops errors grow
        wasmtime's handle table without bound. The message keeps the error it could not
        report.
        """
        entry = ErrorEntry.of(error)
        try:
            return self.tables.errors.add(entry)
        except TooLargeError as exc:
            raise ResourceExhausted(
                f"{exc.message}; the error that could not be reported: "
                f"{entry.code.value}: {entry.message}") from None

    def error_from_parts(self, code: str, data: str) -> int:
        """The 2024-06-25 ``error`` constructor: ``data`` is kept cut as any error message
        (ResourceExhausted as :meth:`error_new`)."""
        try:
            cls = error_for_code(ErrorCode(code))
        except ValueError:
            cls = UnknownError
        return self.error_new(cls(data))

    def error_code(self, rep: int) -> str:
        return self.tables.errors.get(rep).code.value

    def error_data(self, rep: int) -> str:
        return self.tables.errors.get(rep).message

    def error_drop(self, rep: int) -> None:
        self.tables.errors.pop(rep)

    # -- lifetime ---------------------------------------------------------------------
    def close(self) -> None:
        """Release everything the guest still holds (contexts, then graphs, then any graph
        whose unload was cancelled earlier). Idempotent. From then on, a graph or context
        the guest's thread obtains (abandoned, see the module docstring) is released at
        once."""
        with self._lock:
            self._closed = True
        for ctx in self.tables.contexts.drain():
            self._drop_context(ctx)
        for graph in self.tables.graphs.drain():
            self._release_graph(graph)
        for graph in list(self._unloading):
            self._unload(graph)
        self.tables.tensors.drain()
        self.tables.errors.drain()
