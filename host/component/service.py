"""wasi-nn for one component guest, in host terms: reps in, reps out, wasinn errors raised.

:class:`NNService` implements every operation of the WIT interfaces (all release
candidates and the wasinn extension) over one guest's :class:`GuestTables`, reaching
the scheduler through a :class:`~wasinn.host.scheduler_api.Portal`. It knows nothing of
wasmtime: the linker (:mod:`wasinn.host.component.linking`) converts values and turns
every raised :class:`~wasinn.errors.WasiNNError` into an ``error`` resource.

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
dimensions by the u32 range of ``tensor-dimensions`` (:func:`output_dims`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from wasinn.enums import ExecutionTarget, GraphEncoding, TensorType
from wasinn.errors import (
    ErrorCode,
    InvalidArgumentError,
    NotFoundError,
    TimeoutError_,
    TooLargeError,
    UnknownError,
    UnknownNameError,
    UnsupportedOperationError,
    WasiNNError,
    error_for_code,
    quoted,
)
from wasinn.host.component.scratch import ScratchDir, Usage, check_name, quota_exceeded
from wasinn.host.component.tables import (
    ContextEntry,
    ErrorEntry,
    GraphEntry,
    GuestTables,
    ResourceExhausted,
    TensorEntry,
)
from wasinn.host.guest_memory import check_model_name, check_name_length
from wasinn.host.guest_thread import guest_stopped, shielded
from wasinn.host.limits import LOWERING_BYTES_PER_VALUE, GuestLimits
from wasinn.host.registered import load_registered
from wasinn.host.scheduler_api import Portal
from wasinn.host.tenant import graph_name
from wasinn.host.tensor_binding import InFlight
from wasinn.tensor import MAX_RANK, Tensor

log = logging.getLogger("wasinn.host.component")

T = TypeVar("T")

#: WIT ``tensor-type`` case names, in WIT order, onto wasinn's element types.
WIT_TENSOR_TYPES: dict[str, TensorType] = {
    "FP16": TensorType.F16,
    "FP32": TensorType.F32,
    "FP64": TensorType.F64,
    "BF16": TensorType.BF16,
    "U8": TensorType.U8,
    "I32": TensorType.I32,
    "I64": TensorType.I64,
}
_WIT_TYPE_NAME = {tt: name for name, tt in WIT_TENSOR_TYPES.items()}
#: The largest value of a WIT ``u32`` (each of ``tensor-dimensions``).
U32_MAX = 0xFFFF_FFFF


def wit_type_name(tensor_type: TensorType) -> str:
    return _WIT_TYPE_NAME[tensor_type]


def output_dims(name: str, tensor: Tensor) -> tuple[int, ...]:
    """An output's dimensions as a guest's ``tensor-dimensions`` (a ``list<u32>``) holds
    them; TooLargeError naming the output when one is above the u32 range (wasmtime-py
    would hand the guest that dimension silently cut to its low 32 bits)."""
    dims = tuple(int(d) for d in tensor.dims)
    if any(not 0 <= d <= U32_MAX for d in dims):
        raise TooLargeError(
            f"output {quoted(name)} has dimensions {list(dims)}: a guest's "
            f"tensor-dimensions holds u32 values, at most {U32_MAX}")
    return dims


def guest_shape(dims: Sequence[int]) -> tuple[int, ...]:
    """Dimensions a guest passed, as a shape; InvalidArgumentError beyond MAX_RANK.

    Checked before anything multiplies them: a product of thousands of u32 dimensions is
    a huge integer that takes seconds to compute while holding the GIL.
    """
    if len(dims) > MAX_RANK:
        raise InvalidArgumentError(
            f"tensor has {len(dims)} dimensions: expected at most {MAX_RANK}")
    return tuple(int(d) for d in dims)


def _try_graph_lease(graph: Any, inputs: Mapping[Any, Tensor],
                     target: ExecutionTarget | None, tenant: str) -> Any:
    # The no-trio path only runs on the graph's default target (another target name must
    # be resolved by the scheduler, in trio).
    if target is not None and target is not graph.default_target:
        return None
    return graph.try_lease(inputs, keep_on_device=True, tenant=tenant)


def _position(name: str, count: int) -> int | None:
    """The position ``name`` spells in decimal ASCII digits, if below ``count``."""
    # Only short ASCII: str.isdigit() also accepts digits int() refuses ("²"), and int()
    # refuses strings of more than 4300 digits.
    if len(name) <= 10 and name.isascii() and name.isdigit() and int(name) < count:
        return int(name)
    return None


class NNService:
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

    # -- tensors ----------------------------------------------------------------------
    def tensor_new(self, dims: Sequence[int], type_name: str, data: bytes) -> int:
        """The tensor constructor: never raises for bad arguments (WIT gives it no error).

        An inconsistent tensor is stored with its error (and its dimensions and bytes,
        charged to the guest's tensor budget); compute reports it. A tensor that does not
        fit the budget is stored without its data, as a too-large error for compute.
        Raises ResourceExhausted (the guest is trapped) when the guest already holds
        ``max_tensors`` tensors: the constructor cannot answer with an error.
        """
        table = self.tables.tensors
        if table.full:
            raise ResourceExhausted(
                f"{table.full_message()}; tensor constructor (which cannot return an error)")
        try:
            shape = guest_shape(dims)
            entry = TensorEntry(shape, type_name, self._make_tensor(shape, type_name, data))
        except WasiNNError as exc:
            # Over max_tensor_bytes the bytes are not worth keeping for data().
            raw = b"" if isinstance(exc, TooLargeError) else bytes(data)
            entry = TensorEntry(tuple(int(d) for d in dims), type_name, None, invalid=exc,
                                raw=raw)
        try:
            return table.add(entry)
        except TooLargeError as exc:  # over the byte budget: keep dims and type, no data
            dims_kept = entry.dims if len(entry.dims) <= MAX_RANK else ()
            return table.add(TensorEntry(dims_kept, type_name, None, invalid=exc),
                             placeholder=True)

    def tensor_from_words(self, dims: Sequence[int], type_name: str, words: bytes) -> int:
        """``wasinn:nn/bulk.tensor-from-words``: data as little-endian u64 words (padded)."""
        shape = guest_shape(dims)
        ttype = self._tensor_type(type_name)
        size = math.prod(shape) * ttype.itemsize
        need = (size + 7) // 8 * 8
        if len(words) != need:
            raise InvalidArgumentError(
                f"tensor-from-words got {len(words) // 8} words but dimensions {list(shape)} "
                f"of {type_name} need {need // 8} ({size} bytes, padded to whole words)"
            )
        tensor = self._make_tensor(shape, type_name, memoryview(words)[:size])
        return self.tables.tensors.add(TensorEntry(shape, type_name, tensor))

    def tensor_from_scratch(self, name: str, dims: Sequence[int], type_name: str) -> int:
        """``wasinn:nn/scratch.tensor-from-scratch``: data copied from a scratch file.

        The guest's tensor limits are checked before the file is read.
        """
        shape = guest_shape(dims)
        ttype = self._tensor_type(type_name)
        nbytes = math.prod(shape) * ttype.itemsize
        if nbytes <= self.limits.max_tensor_bytes:  # else read_tensor says why
            self.tables.tensors.check_room(nbytes)
        tensor = self._scratch().read_tensor(name, shape, ttype, self.limits.max_tensor_bytes)
        return self.tables.tensors.add(TensorEntry(shape, type_name, tensor))

    def tensor_to_scratch(self, rep: int, name: str) -> int:
        """``wasinn:nn/scratch.tensor-to-scratch``: the tensor's bytes into a scratch file;
        a tensor whose data does not fit its dimensions gets the error ``compute`` would
        give, not a file that looks like a tensor."""
        self.tables.tensors.get(rep).require()
        data = self.tensor_bytes(rep)
        scratch = self._scratch()
        check_name(name)  # before the name appears in a message
        limits = self.limits
        usage = scratch.usage(limits.max_scratch_files)
        grown = Usage(usage.nbytes + len(data), usage.entries + 1)
        reason = quota_exceeded(grown, limits.max_scratch_bytes, limits.max_scratch_files)
        if reason is not None:
            raise TooLargeError(f"writing {len(data)} bytes to {name!r}: {reason}")
        return scratch.write_tensor(name, data, limits.max_tensor_bytes)

    def _scratch(self) -> ScratchDir:
        if self.scratch is None:
            raise UnsupportedOperationError(
                "this guest was started without a scratch directory: pass tensor data "
                "through wasi:nn/tensor or wasinn:nn/bulk instead")
        return self.scratch

    def _tensor_type(self, type_name: str) -> TensorType:
        try:
            return WIT_TENSOR_TYPES[type_name]
        except KeyError:
            raise InvalidArgumentError(
                f"unknown tensor-type {type_name!r}: expected one of {', '.join(WIT_TENSOR_TYPES)}"
            ) from None

    def _make_tensor(self, shape: tuple[int, ...], type_name: str, data: Any) -> Tensor:
        ttype = self._tensor_type(type_name)
        if len(data) > self.limits.max_tensor_bytes:
            raise TooLargeError(
                f"tensor of {len(data)} bytes exceeds this guest's limit of "
                f"{self.limits.max_tensor_bytes} bytes per tensor"
            )
        # Data and dimensions that disagree are the mistake (invalid-argument, as in the
        # legacy ABI), whatever size the dimensions would need; once they agree, the size
        # is the data's, within the limit.
        return Tensor.from_bytes(shape, ttype, data)

    def tensor_dims(self, rep: int) -> list[int]:
        return list(self.tables.tensors.get(rep).dims)

    def tensor_type(self, rep: int) -> str:
        return self.tables.tensors.get(rep).type_name

    def tensor_bytes(self, rep: int) -> np.ndarray[Any, Any] | bytes:
        """The tensor's bytes; a device-resident output is materialized here, once."""
        entry = self.tables.tensors.get(rep)
        if entry.tensor is None:
            return entry.raw
        return entry.tensor.numpy().reshape(-1).view(np.uint8)

    def tensor_data(self, rep: int, *, words: bool = False) -> np.ndarray[Any, Any] | bytes:
        """The bytes ``tensor.data()`` (``words``: ``tensor-words``) hands the guest.

        Checked before anything is materialized or converted: wasmtime's C API spends
        about :data:`~wasinn.host.limits.LOWERING_BYTES_PER_VALUE` bytes of host memory
        per list value it lowers into the guest (80 per byte here, 10 as words), and an
        allocation it cannot make aborts the whole process. Raises ResourceExhausted
        (the call has no error case: the guest is trapped) for a tensor over
        ``max_tensor_bytes`` or over ``max_data_bytes`` (8 times that as words).
        """
        entry = self.tables.tensors.get(rep)
        nbytes = len(entry.raw) if entry.tensor is None else entry.tensor.nbytes
        call = "tensor-words" if words else "tensor.data()"
        limits = self.limits
        if nbytes > limits.max_tensor_bytes:
            raise ResourceExhausted(
                f"{call} of a tensor of {nbytes} bytes: over this guest's limit of "
                f"{limits.max_tensor_bytes} bytes per tensor ([guests] max_tensor_bytes)")
        limit = limits.max_data_bytes * (8 if words else 1)
        if nbytes > limit:
            raise ResourceExhausted(
                f"{call} of a tensor of {nbytes} bytes: over this guest's limit of {limit} "
                f"bytes a call ([guests] max_data_bytes{' x 8 for words' if words else ''}: "
                f"handing a list to a guest costs the host about {LOWERING_BYTES_PER_VALUE} "
                f"bytes of memory per value); {self._data_instead(nbytes, words)}")
        return self.tensor_bytes(rep)

    def _data_instead(self, nbytes: int, words: bool) -> str:
        """What a guest refused a ``tensor.data()`` of ``nbytes`` can use instead."""
        ways = ["wasinn:nn/scratch tensor-to-scratch, which has no such limit"
                + ("" if self.scratch is not None else
                   " (this guest has no scratch directory: a guest gets one when it "
                   "imports wasinn:nn/scratch)")]
        if not words and nbytes <= self.limits.max_data_bytes * 8:
            ways.append(f"wasinn:nn/bulk tensor-words, up to {self.limits.max_data_bytes * 8} "
                        f"bytes a call")
        return "read it with " + " or ".join(ways)

    def tensor_drop(self, rep: int) -> None:
        self.tables.tensors.pop(rep)

    def take_tensor(self, rep: int) -> TensorEntry:
        """Take over an owned tensor handle (it leaves the guest's table)."""
        entry = self.tables.tensors.pop(rep)
        if entry is None:
            raise NotFoundError(f"tensor handle {rep} is no longer live")
        return entry

    # -- graphs -----------------------------------------------------------------------
    def _check_target(self, target: ExecutionTarget | None) -> None:
        self.limits.check_target(target)

    def load(self, builders: Sequence[bytes | memoryview], encoding: str, target: str) -> int:
        enc = GraphEncoding.coerce(encoding)
        tgt = ExecutionTarget.coerce(target)
        self._check_target(tgt)
        if not builders:
            raise InvalidArgumentError("load needs at least one graph-builder; got none")
        size = sum(len(b) for b in builders)
        self._reserve_model_bytes(size)
        self._check_graph_room()
        start = time.perf_counter()
        graph = self.portal.run(
            functools.partial(self.runtime.load, list(builders), encoding=enc, target=tgt,
                              options=self.limits.load_options(),
                              name=graph_name(self.tenant, self._loaded))
        )
        self._loaded += 1
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
        if len(self.tables.graphs) >= self.limits.max_graphs:
            raise TooLargeError(
                f"this guest already holds {len(self.tables.graphs)} graphs, the most it may "
                f"hold at once: drop a graph before loading another"
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
        try:
            if self._closed:  # after close(): nobody else would unload it
                self.portal.run(shielded, entry.graph.unload)
            else:
                self.portal.run(entry.graph.unload)
        except Exception:  # the guest has let go; a failed unload must not reach it
            log.exception("unloading %s failed", entry.label)
        entry.unloaded = True
        self._model_bytes -= entry.model_bytes
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

    # -- inference --------------------------------------------------------------------
    def _inputs(self, named: Sequence[tuple[str, TensorEntry]]) -> dict[str | int, Tensor]:
        inputs: dict[str | int, Tensor] = {}
        for name, entry in named:
            check_name_length(name, "input name")
            if name in inputs:
                raise InvalidArgumentError(
                    f"input {quoted(name)} is given twice: expected each input at most once")
            try:
                inputs[name] = entry.require()
            except WasiNNError as exc:
                raise exc.prefixed(f"input {quoted(name)}") from None
        return inputs

    def _run(self, afn: Callable[[], Awaitable[T]], what: str) -> T:
        timeout = self.limits.compute_timeout
        if timeout is None:
            return self.portal.run(afn)

        async def bounded() -> T:
            import trio

            try:
                with trio.fail_after(timeout):
                    return await afn()
            except trio.TooSlowError:
                raise TimeoutError_(
                    f"{what} took longer than this guest's limit of {timeout:g} s"
                ) from None

        return self.portal.run(bounded)

    def _context_compute(self, entry: ContextEntry, inputs: Mapping[str | int, Tensor]
                         ) -> Mapping[Any, Tensor]:
        # A compute on ``entry``'s context, for the guest's tenant (see _compute).
        context, tenant = entry.context, self.tenant
        return self._compute(
            functools.partial(context.try_lease, inputs, keep_on_device=True, tenant=tenant),
            functools.partial(context.lease, inputs, keep_on_device=True, tenant=tenant),
            functools.partial(context.compute, inputs, keep_on_device=True, tenant=tenant),
            f"compute on {entry.graph.label}",
        )

    def _compute(self, try_lease: Callable[[], Any], lease: Callable[[], Awaitable[Any]],
                 compute: Callable[[], Awaitable[Mapping[Any, Tensor]]],
                 what: str) -> Mapping[Any, Tensor]:
        # Without a timeout the backend runs in this (the guest's) thread once it holds a
        # device slot: taken here when one is free and nobody is queued, else queued in
        # trio (one round trip). With a timeout the request runs in a device worker
        # thread, so that it can be abandoned when the timeout passes.
        # An unknown input name is not-found here, as for set-input and get-output.
        try:
            if self.limits.compute_timeout is None:
                run = try_lease()
                if run is None:
                    run = self.portal.run(lease)
                outputs: Mapping[Any, Tensor] = self.in_flight.run(run)
                return outputs
            return self._run(compute, what)
        except UnknownNameError as exc:
            raise NotFoundError(exc.message) from None

    def _add_outputs(self, outputs: Mapping[Any, Tensor]) -> list[tuple[str, int]]:
        shapes = [output_dims(str(name), tensor) for name, tensor in outputs.items()]
        out: list[tuple[str, int]] = []
        try:
            for (name, tensor), dims in zip(outputs.items(), shapes, strict=True):
                rep = self.tables.tensors.add(
                    TensorEntry(dims, wit_type_name(tensor.type), tensor)
                )
                out.append((str(name), rep))
        except WasiNNError:
            for _, rep in out:
                self.tables.tensors.pop(rep)
            raise
        return out

    def compute(
        self, ctx_rep: int, named: Sequence[tuple[str, TensorEntry]]
    ) -> list[tuple[str, int]]:
        """2024-10-28 ``compute(list<named-tensor>)``; the inputs were already taken over."""
        entry = self.tables.contexts.get(ctx_rep)
        inputs = self._inputs(named)
        outputs = self._context_compute(entry, inputs)
        return self._add_outputs(outputs)

    def graph_compute(
        self, graph_rep: int, named: Sequence[tuple[str, TensorEntry]], target: str | None
    ) -> list[tuple[str, int]]:
        """wasinn extension: compute on a graph without a context (seed 002)."""
        graph = self.tables.graphs.get(graph_rep)
        tgt = None if target is None else ExecutionTarget.coerce(target)
        self._check_target(tgt)
        inputs = self._inputs(named)
        outputs = self._compute(
            functools.partial(_try_graph_lease, graph.graph, inputs, tgt, self.tenant),
            functools.partial(graph.graph.lease, inputs, target=tgt, keep_on_device=True,
                              tenant=self.tenant),
            functools.partial(graph.graph.compute, inputs, target=tgt, keep_on_device=True,
                              tenant=self.tenant),
            f"compute on {graph.label}",
        )
        return self._add_outputs(outputs)

    def set_input(self, ctx_rep: int, name: str, tensor: TensorEntry) -> None:
        """Older RCs: stage an input by name until ``compute``.

        ``name`` must be one of the graph's inputs (NotFoundError naming them otherwise),
        or its position as a decimal string, as for ``get-output``: a context stages at
        most one tensor per graph input. Staged inputs stay held in the guest's tensor
        budget (TooLargeError past ``max_live_tensor_bytes``) until replaced or the
        context is dropped.
        """
        entry = self.tables.contexts.get(ctx_rep)
        check_name_length(name, "input name")
        key = self._input_name(entry, name)
        (_, value), = self._inputs([(key, tensor)]).items()
        old = entry.inputs.get(key)
        if old is not value:
            self.tables.tensors.hold(value)  # TooLargeError: the old input stays staged
            if old is not None:
                self.tables.tensors.let_go(old)
        entry.inputs[key] = value

    @staticmethod
    def _input_name(entry: ContextEntry, name: str) -> str:
        """The graph input ``name`` stands for: an input's name, or its position."""
        specs = entry.graph.graph.inputs
        for spec in specs:
            if spec.name == name:
                return str(spec.name)
        index = _position(name, len(specs))
        if index is not None:
            return str(specs[index].name)
        raise NotFoundError(
            f"{entry.graph.label} has no input {quoted(name)}: expected one of its inputs "
            f"{', '.join(repr(s.name) for s in specs) or '(none)'} or a position below "
            f"{len(specs)}"
        )

    def compute_staged(self, ctx_rep: int) -> None:
        """Older RCs: ``compute()`` on the staged inputs; outputs wait for ``get-output``.

        The outputs the context keeps are held in the guest's tensor budget until the
        next compute or the context is dropped: TooLargeError (and no outputs kept) when
        they do not fit in ``max_live_tensor_bytes``.
        """
        entry = self.tables.contexts.get(ctx_rep)
        if not entry.inputs:
            raise InvalidArgumentError(
                "compute called before any set-input on this context: expected the graph's "
                "inputs to be set first")
        staged = dict(entry.inputs)
        self._forget_outputs(entry)  # a failed compute leaves no outputs of an earlier one
        outputs = {str(k): v for k, v in self._context_compute(entry, staged).items()}
        held: list[Tensor] = []
        for name, tensor in outputs.items():
            try:
                self.tables.tensors.hold(tensor)
            except TooLargeError as exc:
                for kept in held:
                    self.tables.tensors.let_go(kept)
                raise exc.prefixed(f"keeping output {quoted(name)} for get-output") from None
            held.append(tensor)
        entry.outputs = outputs

    def get_output(self, ctx_rep: int, name: str) -> int:
        entry = self.tables.contexts.get(ctx_rep)
        check_name_length(name, "output name")
        if entry.outputs is None:
            raise InvalidArgumentError(
                f"get-output({quoted(name)}) called before a successful compute on this "
                f"context: expected set-input and compute first"
            )
        tensor = entry.outputs.get(name)
        index = None if tensor is not None else _position(name, len(entry.outputs))
        if index is not None:
            tensor = list(entry.outputs.values())[index]
        if tensor is None:
            raise NotFoundError(
                f"the graph has no output {quoted(name)}: expected one of its outputs "
                f"{', '.join(entry.outputs) or '(none)'} or a position below "
                f"{len(entry.outputs)}"
            )
        ((_, rep),) = self._add_outputs({name: tensor})
        return rep

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
