"""One guest's view of wasi-nn through the legacy ABI: its handles, limits and calls.

A :class:`GuestNN` belongs to one guest instance and is used only from that guest's
worker thread. Each method implements one ABI function over a :class:`GuestMemory`
and the raw (already u32-masked) arguments; it returns normally on success and raises
a :class:`~wasinn.errors.WasiNNError` leaf otherwise, which the bindings turn into the
guest's errno. Scheduler objects are reached only through the :class:`Portal`; a
compute reserves a device slot through it and then runs the backend in the guest's own
thread (:func:`~wasinn.host.tensor_binding.run_context_in_thread`), unless a compute
timeout is configured (then the request runs in a device worker thread, so that it can be
abandoned at the timeout).

Handles are small integers, never reused within a guest, so a handle used after
``unload`` / ``finalize_execution_context`` is reported as closed, not confused with a
newer one.

Once :meth:`GuestNN.release` has begun (the guest ended, or was stopped and its thread
abandoned: :mod:`wasinn.host.guest_thread`), every call is refused with
ClosedResourceError, and a graph or context that a call in flight obtains afterwards (a
load that ignored the cancellation) is released at once instead of being handed out:
the thread of an abandoned guest may wake later and carry on with its host calls.

Data movement (why each copy is or is not made):

- Model builders are copied out of guest memory at ``load``: the scheduler may keep them
  to compile the graph for another device later, and guests free them right after.
- Inputs are *not* copied at ``set_input``: the call records where the tensor lies and
  ``compute`` hands the scheduler numpy views over guest memory, made during the compute
  call itself, when the guest cannot run and so cannot grow (move) its memory. Like
  WasmEdge, a guest therefore must keep the input buffer intact until ``compute``: the
  inputs are the bytes its buffers hold then. A guest written for a host that copies at
  ``set_input`` (Wasmtime) may refill one buffer for each input in turn; every input
  would then read the last data. That cannot be told apart from two inputs meant to read
  the same bytes, so it is not refused, but logged (a warning, once per guest) when a
  compute finds two inputs' bytes overlapping. A compute whose request may run in a
  device worker thread that outlives the call (a compute timeout, a batching graph on a
  busy device) hands it copies instead of views.
- Outputs are copied into the guest's buffer: at ``get_output``, or, for a buffer bound
  before compute (``set_output_by_name``), as the run ends (the backend returns outputs
  of its own; with a compute timeout they go through a host buffer first, as inputs go
  through copies). A bound output of dynamic shape that proves too large for its buffer
  has its size in that run written to ``bytes_written`` (``TooLargeError.bound_sizes``).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from wasinn.backends.base import TensorSpec
from wasinn.errors import (
    ClosedResourceError,
    InvalidArgumentError,
    NotFoundError,
    TooLargeError,
    WasiNNError,
)
from wasinn.host.abi import (
    EndOfSequenceError,
    decode_encoding,
    decode_target,
)
from wasinn.host.guest_memory import (
    GuestMemory,
    check_apart,
    check_disjoint,
    check_model_name,
    u32,
)
from wasinn.host.guest_thread import guest_stopped, shielded
from wasinn.host.limits import GuestLimits
from wasinn.host.registered import load_registered
from wasinn.host.scheduler_api import ContextLike, GraphLike, Portal, RuntimeLike
from wasinn.host.single_values import reads_as_scalar
from wasinn.host.tenant import graph_name
from wasinn.host.tensor_binding import (
    InFlight,
    InputBinding,
    OutputBinding,
    check_against_spec,
    copy_bytes,
    owned_copies,
    run_context,
    run_context_in_thread,
    spec_at,
    spec_named,
    static_nbytes,
)
from wasinn.tensor import Tensor, numpy_dtype

log = logging.getLogger("wasinn.host.nn")


@dataclass
class _GuestGraph:
    graph: GraphLike
    model_bytes: int
    contexts: set[int] = field(default_factory=set)


@dataclass
class _GuestContext:
    ctx: ContextLike
    graph_handle: int
    inputs_spec: tuple[TensorSpec, ...]
    outputs_spec: tuple[TensorSpec, ...]
    inputs: dict[str, InputBinding] = field(default_factory=dict)
    #: Two of ``inputs`` lie in overlapping guest bytes (see the module docstring).
    overlapping: bool = False
    bound_outputs: dict[str, OutputBinding] = field(default_factory=dict)
    results: dict[str, Tensor] | None = None
    #: A compute has been called on it (so no results means that the last one failed).
    computed: bool = False
    stream_done: bool = False


class GuestNN:
    """The wasi-nn state of one guest instance (see the module docstring). Its requests
    are made for ``tenant`` (:mod:`wasinn.host.tenant`)."""

    def __init__(
        self,
        runtime: RuntimeLike,
        portal: Portal,
        limits: GuestLimits | None = None,
        *,
        tenant: str = "",
    ) -> None:
        self.runtime = runtime
        self.portal = portal
        self.limits = limits or GuestLimits()
        #: Whom every request of this guest is for (:mod:`wasinn.host.tenant`).
        self.tenant = tenant
        self.graphs: dict[int, _GuestGraph] = {}
        self.contexts: dict[int, _GuestContext] = {}
        self._next_graph = 0
        self._next_context = 0
        #: Models this guest loaded from its bytes so far (their names: graph_name).
        self._loaded = 0
        self.model_bytes = 0
        #: The request this guest's thread is running (see :meth:`interrupt`).
        self.in_flight = InFlight()
        self._warned_overlap = False
        # Set when release() begins, with the tables' additions under the lock: a graph or
        # context added from the guest's thread is either released by release() or, after
        # it, by the thread itself (see the module docstring).
        self._lock = threading.Lock()
        self._released = False

    def interrupt(self) -> None:
        """Stop the inference this guest is running, from another thread, where the
        backend can; later ones stop as they start. For a guest being stopped: it then
        need not wait for a long inference to end."""
        self.in_flight.interrupt()

    # -- handles ------------------------------------------------------------------
    def _check_live(self) -> None:
        if self._released:
            raise guest_stopped()

    def _graph(self, handle: int) -> _GuestGraph:
        self._check_live()
        try:
            return self.graphs[handle]
        except KeyError:
            if handle < self._next_graph:  # handles are never reused
                raise ClosedResourceError(f"graph {handle} was unloaded") from None
            raise NotFoundError(f"unknown graph handle {handle}") from None

    def _context(self, handle: int) -> _GuestContext:
        self._check_live()
        try:
            return self.contexts[handle]
        except KeyError:
            if handle < self._next_context:
                raise ClosedResourceError(
                    f"execution context {handle} was finalized (or its graph unloaded)"
                ) from None
            raise NotFoundError(f"unknown execution context handle {handle}") from None

    def _add_graph(self, graph: GraphLike, model_bytes: int) -> int:
        with self._lock:
            if not self._released:
                handle = self._next_graph
                self._next_graph += 1
                self.graphs[handle] = _GuestGraph(graph, model_bytes)
                self.model_bytes += model_bytes
                return handle
        # Loaded after release() (the guest was abandoned meanwhile): nobody else would
        # ever unload it. Shielded: the guest's calls into trio are cancelled by now.
        self.portal.run(shielded, graph.unload)
        raise guest_stopped()

    def _check_graph_quota(self, model_bytes: int = 0) -> None:
        self._check_live()
        _check_handle_left(self._next_graph, "graph")
        if len(self.graphs) >= self.limits.max_graphs:
            raise TooLargeError(
                f"guest already holds {len(self.graphs)} graphs: the limit is "
                f"{self.limits.max_graphs} (unload one first)"
            )
        if self.model_bytes + model_bytes > self.limits.max_model_bytes:
            raise TooLargeError(
                f"loading {model_bytes} bytes of model would bring this guest to "
                f"{self.model_bytes + model_bytes} bytes: the limit is "
                f"{self.limits.max_model_bytes} ([guests] max_model_bytes)"
            )

    # -- graphs -------------------------------------------------------------------
    def load(self, mem: GuestMemory, builders_ptr: int, builders_len: int, encoding: int,
             target: int, graph_out: int) -> None:
        mem.check_writable_u32(graph_out, "graph handle result")
        enc = decode_encoding(encoding)
        tgt = decode_target(target)
        self.limits.check_target(tgt)
        views = mem.builders(builders_ptr, builders_len)
        if not views:
            raise InvalidArgumentError("load got an empty builder list: expected at least "
                                       "one graph builder (the model's bytes)")
        total = sum(int(v.nbytes) for v in views)
        self._check_graph_quota(total)
        builders = [v.tobytes() for v in views]  # the scheduler keeps them: copy once
        start = time.perf_counter()
        name = graph_name(self.tenant, self._loaded)
        self._loaded += 1  # (a failed load too: each load's errors name it apart)
        graph = self.portal.run(
            functools.partial(self.runtime.load, builders, encoding=enc, target=tgt,
                              options=self.limits.load_options(), name=name))
        handle = self._add_graph(graph, total)
        log.info("graph %d: %d bytes of %s loaded for %s in %.1f ms", handle, total,
                 enc.value, tgt.value, (time.perf_counter() - start) * 1e3)
        mem.write_u32(graph_out, handle)

    def load_by_name(self, mem: GuestMemory, name_ptr: int, name_len: int,
                     graph_out: int) -> None:
        mem.check_writable_u32(graph_out, "graph handle result")
        name = mem.read_str(name_ptr, name_len, "model name")
        check_model_name(name)
        self._check_graph_quota()
        start = time.perf_counter()
        graph = load_registered(self.portal, self.runtime, name)
        try:  # the registry chose its target: the guest may not be allowed there
            self.limits.check_target(graph.default_target)
        except WasiNNError:
            self.portal.run(shielded, graph.unload)  # (even in a guest being stopped)
            raise
        handle = self._add_graph(graph, 0)
        log.info("graph %d: %r loaded by name in %.1f ms", handle, name,
                 (time.perf_counter() - start) * 1e3)
        mem.write_u32(graph_out, handle)

    def load_by_name_with_config(self, mem: GuestMemory, name_ptr: int, name_len: int,
                                 config_ptr: int, config_len: int, graph_out: int) -> None:
        # The config is opaque to wasi-nn (WasmEdge's GGML options in JSON); no backend
        # wasinn runs reads it, so it is only checked to be readable guest memory.
        mem.span(config_ptr, config_len, "load config")
        self.load_by_name(mem, name_ptr, name_len, graph_out)

    def unload(self, graph_handle: int) -> None:
        entry = self._graph(graph_handle)
        for ctx_handle in sorted(entry.contexts):
            self._close_context(ctx_handle)
        if self.graphs.pop(graph_handle, None) is None:
            return  # release() took it meanwhile (an abandoned guest): it unloads it
        self.model_bytes -= entry.model_bytes
        # Shielded: out of the table, nobody else would unload it (were the guest stopped
        # while this call waits in trio, release() would not see the graph). Not waiting
        # for runs in flight: a compute the guest gave up on (compute_timeout) may still
        # run, and it frees the graph as it ends; the guest must not wait for it here.
        self.portal.run(shielded, functools.partial(entry.graph.unload, wait_for_runs=False))

    # -- contexts -----------------------------------------------------------------
    def init_execution_context(self, mem: GuestMemory, graph_handle: int, ctx_out: int,
                               target: int | None = None) -> None:
        mem.check_writable_u32(ctx_out, "context handle result")
        entry = self._graph(graph_handle)
        tgt = None if target is None else decode_target(target)
        self.limits.check_target(tgt)
        if len(self.contexts) >= self.limits.max_contexts:
            raise TooLargeError(
                f"guest already holds {len(self.contexts)} execution contexts: the limit "
                f"is {self.limits.max_contexts} (finalize one first)"
            )
        _check_handle_left(self._next_context, "execution context")
        ctx = self.portal.run_sync(functools.partial(
            entry.graph.init_execution_context, target=tgt))
        handle: int | None = None
        with self._lock:
            if not self._released:
                handle = self._next_context
                self._next_context += 1
                self.contexts[handle] = _GuestContext(
                    ctx, graph_handle, tuple(entry.graph.inputs), tuple(entry.graph.outputs))
                entry.contexts.add(handle)
        if handle is None:  # after release() (see _add_graph): nobody else would close it
            self.portal.run_sync(ctx.close)
            raise guest_stopped()
        mem.write_u32(ctx_out, handle)

    def finalize_execution_context(self, ctx_handle: int) -> None:
        self._context(ctx_handle)
        self._close_context(ctx_handle)

    def _close_context(self, ctx_handle: int) -> None:
        entry = self.contexts.pop(ctx_handle, None)
        if entry is None:
            return  # release() took it meanwhile (an abandoned guest): it closes it
        graph = self.graphs.get(entry.graph_handle)
        if graph is not None:
            graph.contexts.discard(ctx_handle)
        self.portal.run_sync(entry.ctx.close)

    # -- inputs -------------------------------------------------------------------
    def set_input(self, mem: GuestMemory, ctx_handle: int, index: int, tensor_ptr: int) -> None:
        entry = self._context(ctx_handle)
        self._bind_input(mem, entry, spec_at(entry.inputs_spec, index, "input"), tensor_ptr)

    def set_input_by_name(self, mem: GuestMemory, ctx_handle: int, name_ptr: int,
                          name_len: int, tensor_ptr: int) -> None:
        entry = self._context(ctx_handle)
        name = mem.read_str(name_ptr, name_len, "input name")
        self._bind_input(mem, entry, spec_named(entry.inputs_spec, name, "input"), tensor_ptr)

    def _bind_input(self, mem: GuestMemory, entry: _GuestContext, spec: TensorSpec,
                    tensor_ptr: int) -> None:
        key = mem.tensor_key(tensor_ptr)
        current = entry.inputs.get(spec.name)
        if current is not None and current.key == key:
            # The tensor bound last time, again (a guest's inference loop): it was checked
            # then, and the bindings have not changed, so there is nothing to redo.
            entry.stream_done = False
            return
        record = mem.tensor(tensor_ptr)
        if record.data_len > self.limits.max_tensor_bytes:
            raise TooLargeError(
                f"input {spec.name!r} is {record.data_len} bytes: the limit is "
                f"{self.limits.max_tensor_bytes}"
            )
        if reads_as_scalar(record.dims, spec):  # the spec's [1] for one value
            record = replace(record, dims=())
        check_against_spec(record, spec)
        entry.inputs[spec.name] = InputBinding(record, key)
        entry.overlapping = _any_overlap(entry.inputs)
        entry.stream_done = False

    # -- outputs bound before compute -------------------------------------------------
    def set_output_by_name(self, mem: GuestMemory, ctx_handle: int, name_ptr: int,
                           name_len: int, out_ptr: int, out_max_len: int,
                           written_ptr: int) -> None:
        entry = self._context(ctx_handle)
        name = mem.read_str(name_ptr, name_len, "output name")
        spec = spec_named(entry.outputs_spec, name, "output")
        mem.span(out_ptr, out_max_len, f"output buffer for {name!r}")
        mem.check_writable_u32(written_ptr, "bytes-written result")
        check_apart(out_ptr, out_max_len, written_ptr, f"output buffer for {name!r}")
        check_disjoint(  # every bound output is written by one compute
            [(f"output buffer for {name!r}", out_ptr, out_max_len),
             (f"bytes_written for {name!r}", written_ptr, 4)],
            [span for other, bound in entry.bound_outputs.items() if other != spec.name
             for span in ((f"the buffer bound to output {other!r}", bound.ptr, bound.max_len),
                          (f"the bytes_written of output {other!r}", bound.written_ptr, 4))])
        entry.bound_outputs[spec.name] = OutputBinding(out_ptr, u32(out_max_len), written_ptr,
                                                       static_nbytes(spec))

    # -- compute ------------------------------------------------------------------
    def compute(self, mem: GuestMemory, ctx_handle: int) -> None:
        entry = self._context(ctx_handle)
        # A compute that fails, here or in the backend, leaves no outputs of an earlier one
        # for get_output to hand out as if they were this one's.
        entry.results = None
        entry.computed = True
        if entry.overlapping and not self._warned_overlap:
            self._warned_overlap = True
            log.warning("compute reads inputs %s from overlapping guest bytes: inputs are "
                        "read at compute, not copied at set_input, so a buffer refilled "
                        "for each input gives them all its last data (expected one buffer "
                        "per input; this is logged once per guest)",
                        ", ".join(repr(n) for n in entry.inputs))
        # Views over guest memory, made now (the guest cannot run, so cannot move its
        # memory, until this call returns). set_input checked each record against the
        # graph and its byte length against its dimensions: no need to check again.
        inputs = {}
        for name, b in entry.inputs.items():
            record = b.record
            raw = mem.span(record.data_ptr, record.data_len)
            inputs[name] = Tensor(record.dims, record.type,
                                  array=raw.view(numpy_dtype(record.type)).reshape(record.dims))
        bound: dict[str, np.ndarray[Any, Any]] = {}
        for name, binding in entry.bound_outputs.items():
            needed = binding.needed
            if needed is not None and needed > binding.max_len:
                mem.write_size(binding.written_ptr, needed)
                raise TooLargeError(
                    f"output {name!r} needs {needed} bytes but its bound buffer holds "
                    f"{binding.max_len} (the needed size was written to bytes_written)"
                )
            bound[name] = mem.span(binding.ptr, binding.max_len, f"output buffer for {name!r}")
        timeout = self.limits.compute_timeout
        try:
            if timeout is None:
                # The backend runs in this (the guest's) thread when the device is free,
                # else in a device worker thread (one trio round trip either way).
                entry.results = run_context_in_thread(self.portal, entry.ctx, inputs, bound,
                                                      self.in_flight, self.tenant)
            else:
                # A running request must be abandonable at the timeout: run it in trio.
                # An abandoned run goes on after the guest resumes (and perhaps after its
                # memory is gone), so it must not hold views of guest memory: inputs are
                # copied and outputs land in host buffers, copied in once it returns.
                owned = owned_copies(inputs)
                staging = {name: np.empty_like(view) for name, view in bound.items()}
                names = [spec.name for spec in entry.outputs_spec]
                entry.results = self.portal.run(run_context, entry.ctx, owned, staging, names,
                                                timeout, self.tenant)
                for name, view in bound.items():
                    size = entry.results[name].nbytes
                    view[:size] = staging[name][:size]
        except TooLargeError as exc:
            sizes = exc.bound_sizes  # a bound buffer too small for this run's output
            if sizes is None:
                raise
            for name, bound_size in sizes.items():
                mem.write_size(entry.bound_outputs[name].written_ptr, bound_size.needed)
            raise TooLargeError(f"{exc.message} (the needed size was written to "
                                "bytes_written)") from None
        for name, binding in entry.bound_outputs.items():
            mem.write_size(binding.written_ptr, entry.results[name].nbytes)

    def compute_single(self, mem: GuestMemory, ctx_handle: int) -> None:
        # Streaming (LLM token by token) is a WasmEdge extension. wasinn's graphs produce
        # their whole output at once: the first call computes it, the next ones report
        # end_of_sequence until new inputs are set, so a token loop terminates.
        entry = self._context(ctx_handle)
        if entry.stream_done:
            raise EndOfSequenceError("no more output: the whole sequence has been computed")
        self.compute(mem, ctx_handle)
        entry.stream_done = True

    def fini_single(self, ctx_handle: int) -> None:
        self._context(ctx_handle).stream_done = False

    # -- get_output -------------------------------------------------------------------
    def get_output(self, mem: GuestMemory, ctx_handle: int, index: int, out_ptr: int,
                   out_max_len: int, written_ptr: int) -> None:
        entry = self._context(ctx_handle)
        spec = spec_at(entry.outputs_spec, index, "output")
        self._copy_result(mem, entry, spec.name, out_ptr, out_max_len, written_ptr)

    def get_output_by_name(self, mem: GuestMemory, ctx_handle: int, name_ptr: int,
                           name_len: int, out_ptr: int, out_max_len: int,
                           written_ptr: int) -> None:
        entry = self._context(ctx_handle)
        name = mem.read_str(name_ptr, name_len, "output name")
        spec = spec_named(entry.outputs_spec, name, "output")
        self._copy_result(mem, entry, spec.name, out_ptr, out_max_len, written_ptr)

    def _copy_result(self, mem: GuestMemory, entry: _GuestContext, name: str, out_ptr: int,
                     max_len: int, written_ptr: int) -> None:
        # Once per inference: one function, each check once (cold caches after a run make
        # every Python call here cost several times its warm price).
        buffer = mem.span(out_ptr, max_len, "output buffer")
        mem.check_writable_u32(written_ptr, "bytes-written result")
        check_apart(out_ptr, max_len, written_ptr, "output buffer")
        results = entry.results
        if results is None:
            if entry.computed:
                raise InvalidArgumentError("no outputs: the last compute on this context "
                                           "failed (expected a successful compute before "
                                           "get_output)")
            raise InvalidArgumentError("no outputs yet: call compute before get_output")
        tensor = results.get(name)
        if tensor is None:
            raise NotFoundError(f"output {name!r} was not produced by the last compute")
        source = tensor.numpy()
        needed = int(source.nbytes)
        mem.write_size(written_ptr, needed)
        if needed > self.limits.max_tensor_bytes:
            raise TooLargeError(
                f"output {name!r} is {needed} bytes: the limit is "
                f"{self.limits.max_tensor_bytes} (its size was written to bytes_written)"
            )
        if needed > buffer.shape[0]:
            raise TooLargeError(
                f"output {name!r} needs {needed} bytes but the guest buffer holds "
                f"{buffer.shape[0]} (the needed size was written to bytes_written)"
            )
        target = buffer[:needed]
        # A bound output may already lie in this very buffer (__array_interface__: cheaper
        # than ndarray.ctypes; only asked for bound outputs).
        if name in entry.bound_outputs and source.__array_interface__["data"][0] == \
                target.__array_interface__["data"][0]:
            return
        copy_bytes(target, source)

    # -- end of the guest ---------------------------------------------------------------
    async def release(self) -> None:
        """Close every context and unload every graph this guest still holds (in trio).

        Called by the runner once the guest has stopped, however it stopped (its thread
        may still run: abandoned, see :mod:`wasinn.host.guest_thread`); every call made
        from then on is refused. Never raises for one failing handle: the rest are still
        released.
        """
        with self._lock:
            self._released = True
        for handle in list(self.contexts):
            entry = self.contexts.pop(handle, None)
            if entry is None:  # the guest's thread closed it meanwhile (abandoned)
                continue
            try:
                entry.ctx.close()
            except Exception:
                log.exception("closing execution context %d failed", handle)
        for handle in list(self.graphs):
            graph = self.graphs.pop(handle, None)
            if graph is None:  # the guest's thread unloaded it meanwhile (abandoned)
                continue
            try:
                # (Its runs are not waited for: the guest is gone, and its abandoned
                # thread may still run a lease, which frees the graph as it ends.)
                await graph.graph.unload(wait_for_runs=False)
            except Exception:
                log.exception("unloading graph %d failed", handle)
        self.model_bytes = 0


def _check_handle_left(next_handle: int, kind: str) -> None:
    """TooLargeError once a guest has had 2**32 handles of ``kind``: handles are u32s,
    never reused, so there is none left to give (and none may be made, then lost)."""
    if next_handle > 0xFFFFFFFF:
        raise TooLargeError(
            f"this guest has opened all 4294967296 {kind} handles a u32 can name (they "
            f"are never reused): expected fewer {kind}s over one guest's life"
        )


def _any_overlap(bindings: dict[str, InputBinding]) -> bool:
    spans = sorted(b.record.span for b in bindings.values() if b.record.data_len)
    return any(spans[i][1] > spans[i + 1][0] for i in range(len(spans) - 1))
