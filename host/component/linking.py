"""Defining wasi-nn (every release candidate) and the wasinn extension in a component Linker.

Each guest gets its own :class:`wasmtime.component.Linker` whose host functions close
over that guest's :class:`NNService`. The same host resource types (one integer id per
kind) back every release candidate, so all versions share one set of tables.

Rules of wasmtime-py this module lives by (see ``shared/notes/wasmtime-py.md``):

* a Python exception escaping a host function kills the instance, so every function is
  wrapped: a :class:`~wasinn.errors.WasiNNError` becomes an ``error`` resource, anything
  else becomes ``unknown`` with the exception's text; functions whose WIT result has no
  error case log and return a neutral value instead;
* where the host cannot create the resource a call must return (the guest holds
  ``max_errors`` errors, or ``max_tensors`` tensors for the tensor constructor:
  :class:`~wasinn.host.component.tables.ResourceExhausted`), or hand over the data it
  must return (``tensor.data()`` / ``tensor-words`` past ``max_data_bytes``, checked
  before any list is built: wasmtime converts a returned list after the function has
  returned, at about 80 bytes of host memory per value), the guest is trapped with
  a message naming the limit, raised as ``WasmtimeError`` (never a Python exception,
  which would be recorded in wasmtime-py's process-wide "last exception");
* every borrowed handle is released (``to_host``) before the function returns;
* an owned handle passed in is taken over with ``to_host`` and its table entry freed by
  the host (wasmtime will not run the destructor for it);
* ``result<A, error>`` is returned as a ``Variant`` when A is a resource (wasmtime-py
  cannot tell the cases apart by Python type), as a bare value otherwise.

Cancellation: once the guest's :class:`~wasinn.host.interrupt.Interrupter` is asked to
stop (or a scheduler call is cancelled in trio), the host call aborts the guest with a
trap (raising ``WasmtimeError``, which is not recorded in wasmtime-py's process-wide
"last exception", so no other guest's error is misattributed). Every host function,
resource destructors included, checks that first, before touching the guest's
:class:`NNService`: a stopped guest whose thread was abandoned and wakes later
(:mod:`wasinn.host.guest_thread`) traps at its first wasi-nn call, its tables released.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import trio
from wasmtime import WasmtimeError
from wasmtime.component import Linker, LinkerInstance, ResourceHost, ResourceType, Variant

from wasinn.errors import UnknownError, WasiNNError
from wasinn.host.component import fastlist
from wasinn.host.component.service import NNService
from wasinn.host.component.tables import ResourceExhausted, TensorEntry
from wasinn.host.interrupt import INTERRUPTED, Interrupter

log = logging.getLogger("wasinn.host.component")

#: The wasi-nn release candidates served, newest first.
NN_VERSIONS = ("0.2.0-rc-2024-10-28", "0.2.0-rc-2024-08-19", "0.2.0-rc-2024-06-25")
#: The release candidate whose types the wasinn extension package uses.
EXT_NN_VERSION = NN_VERSIONS[0]
#: The wasinn extension package.
EXT_PACKAGE = "wasinn:nn@0.1.0"

#: Host resource type ids (ResourceType.host(N)); shared by every version.
TENSOR, GRAPH, CONTEXT, ERROR = 0x5A_11_00_01, 0x5A_11_00_02, 0x5A_11_00_03, 0x5A_11_00_04


def _rep(store: Any, handle: Any) -> int:
    """Release a borrowed (or take over an owned) host handle and return its rep."""
    host = handle if isinstance(handle, ResourceHost) else handle.to_host(store)
    return int(host.rep)


def _word_bytes(words: Any) -> bytes:
    """A ``list<u64>`` as little-endian bytes (already bytes on the fast path)."""
    if isinstance(words, bytes):
        return words
    return np.asarray(words, dtype=np.uint64).astype("<u8").tobytes()


class Binder:
    """Builds the host functions of one guest over its service."""

    def __init__(self, service: NNService, interrupter: Interrupter | None = None) -> None:
        self.service = service
        self.interrupter = interrupter

    # -- wrappers ---------------------------------------------------------------------
    def _check_cancel(self) -> None:
        if self.interrupter is not None and self.interrupter.requested:
            raise WasmtimeError(INTERRUPTED)

    def _abort(self) -> WasmtimeError:
        """The guest's scheduler call was cancelled: stop the guest."""
        if self.interrupter is not None:
            self.interrupter.request()
        return WasmtimeError(INTERRUPTED)

    @staticmethod
    def _trap(exc: Exception) -> WasmtimeError:
        """The guest must be stopped: a resource it must be given cannot be created."""
        log.warning("trapping a guest: %s", exc)
        return WasmtimeError(str(exc))

    def _error_handle(self, exc: BaseException) -> ResourceHost:
        """An owned ``error`` handle for ``exc``; raises the guest's trap (WasmtimeError)
        when it already holds every error it may."""
        if not isinstance(exc, WasiNNError):
            log.exception("host error in a wasi-nn call", exc_info=exc)
            exc = UnknownError(f"internal host error: {type(exc).__name__}: {exc}")
        try:
            rep = self.service.error_new(exc)
        except ResourceExhausted as full:
            raise self._trap(full) from None
        return ResourceHost.own(rep, ERROR)

    def fallible(self, fn: Callable[..., Any], *, tagged: bool) -> Callable[..., Any]:
        """A function whose WIT result is ``result<_, error>``; ``fn`` returns the ok value.

        ``fn(store, *args)`` must release its borrowed handles first (via ``_rep``).
        """

        def call(store: Any, *args: Any) -> Any:
            self._check_cancel()
            try:
                ok = fn(store, *args)
            except trio.Cancelled:
                raise self._abort() from None
            except ResourceExhausted as exc:
                raise self._trap(exc) from None
            except Exception as exc:
                err = self._error_handle(exc)
                return Variant("err", err) if tagged else err
            return Variant("ok", ok) if tagged else ok

        return call

    def infallible(self, fn: Callable[..., Any], default: Any) -> Callable[..., Any]:
        """A function whose WIT result has no error case: log and return ``default``."""

        def call(store: Any, *args: Any) -> Any:
            self._check_cancel()
            try:
                return fn(store, *args)
            except trio.Cancelled:
                raise self._abort() from None
            except ResourceExhausted as exc:
                raise self._trap(exc) from None
            except Exception:
                log.exception("host error in a wasi-nn call; returning a neutral value")
            try:
                return default() if callable(default) else default
            except ResourceExhausted as exc:
                raise self._trap(exc) from None
            except Exception as exc:  # not even a neutral value: stop the guest cleanly
                raise self._trap(exc) from None

        return call

    def dtor(self, fn: Callable[[int], None]) -> Callable[[Any, int], None]:
        def drop(_store: Any, rep: int) -> None:
            self._check_cancel()
            try:
                fn(rep)
            except trio.Cancelled:
                raise self._abort() from None
            except ResourceExhausted as exc:
                raise self._trap(exc) from None
            except Exception:
                log.exception("dropping a wasi-nn resource failed")

        return drop

    # -- value helpers ----------------------------------------------------------------
    def _take_named(self, store: Any, named: Sequence[Any]) -> list[tuple[str, TensorEntry]]:
        """Take over every owned tensor of a ``list<named-tensor>`` (all, even on error)."""
        reps = [(str(name), _rep(store, handle)) for name, handle in named]
        out: list[tuple[str, TensorEntry]] = []
        missing: WasiNNError | None = None
        for name, rep in reps:
            try:
                out.append((name, self.service.take_tensor(rep)))
            except WasiNNError as exc:
                missing = missing or exc
        if missing is not None:
            raise missing
        return out

    @staticmethod
    def _own_named(named: list[tuple[str, int]]) -> list[tuple[str, ResourceHost]]:
        return [(name, ResourceHost.own(rep, TENSOR)) for name, rep in named]

    @staticmethod
    def _bytes_out(data: np.ndarray[Any, Any] | bytes) -> Any:
        return data if fastlist.installed() else bytes(data)

    # -- interfaces -------------------------------------------------------------------
    def define_errors(self, inst: LinkerInstance, with_constructor: bool) -> None:
        svc = self.service
        inst.add_resource("error", ResourceType.host(ERROR), self.dtor(svc.error_drop))
        inst.add_func("[method]error.code", self.infallible(
            lambda store, h: svc.error_code(_rep(store, h)), "unknown"))
        inst.add_func("[method]error.data", self.infallible(
            lambda store, h: svc.error_data(_rep(store, h)), ""))
        if with_constructor:
            inst.add_func("[constructor]error", self.infallible(
                lambda store, code, data: ResourceHost.own(svc.error_from_parts(code, data), ERROR),
                lambda: ResourceHost.own(svc.error_new(UnknownError("error")), ERROR)))

    def define_tensor(self, inst: LinkerInstance) -> None:
        svc = self.service
        inst.add_resource("tensor", ResourceType.host(TENSOR), self.dtor(svc.tensor_drop))
        inst.add_func("[constructor]tensor", self.infallible(
            lambda store, dims, ty, data: ResourceHost.own(svc.tensor_new(dims, ty, data), TENSOR),
            lambda: ResourceHost.own(svc.tensor_new([0], "U8", b""), TENSOR)))
        inst.add_func("[method]tensor.dimensions", self.infallible(
            lambda store, h: svc.tensor_dims(_rep(store, h)), list))
        inst.add_func("[method]tensor.ty", self.infallible(
            lambda store, h: svc.tensor_type(_rep(store, h)), "U8"))
        inst.add_func("[method]tensor.data", self.infallible(
            lambda store, h: self._bytes_out(svc.tensor_data(_rep(store, h))), b""))

    def define_graph(self, inst: LinkerInstance) -> None:
        svc = self.service
        inst.add_resource("graph", ResourceType.host(GRAPH), self.dtor(svc.graph_drop))
        inst.add_func("[method]graph.init-execution-context", self.fallible(
            lambda store, h: ResourceHost.own(svc.init_context(_rep(store, h)), CONTEXT),
            tagged=True))
        inst.add_func("load", self.fallible(
            lambda store, builders, enc, target: ResourceHost.own(
                svc.load(list(builders), enc, target), GRAPH), tagged=True))
        inst.add_func("load-by-name", self.fallible(
            lambda store, name: ResourceHost.own(svc.load_by_name(name), GRAPH), tagged=True))

    def define_inference(self, inst: LinkerInstance, named_compute: bool) -> None:
        svc = self.service
        inst.add_resource(
            "graph-execution-context", ResourceType.host(CONTEXT), self.dtor(svc.context_drop))
        prefix = "[method]graph-execution-context."
        if named_compute:
            def compute(store: Any, h: Any, named: Any) -> Any:
                ctx = _rep(store, h)
                return self._own_named(svc.compute(ctx, self._take_named(store, named)))

            inst.add_func(prefix + "compute", self.fallible(compute, tagged=False))
            return

        def set_input(store: Any, h: Any, name: str, tensor: Any) -> None:
            ctx = _rep(store, h)
            ((_, entry),) = self._take_named(store, [(name, tensor)])
            svc.set_input(ctx, name, entry)

        inst.add_func(prefix + "set-input", self.fallible(set_input, tagged=False))
        inst.add_func(prefix + "compute", self.fallible(
            lambda store, h: svc.compute_staged(_rep(store, h)), tagged=False))
        inst.add_func(prefix + "get-output", self.fallible(
            lambda store, h, name: ResourceHost.own(svc.get_output(_rep(store, h), name), TENSOR),
            tagged=True))

    def define_targets(self, inst: LinkerInstance) -> None:
        svc = self.service
        inst.add_func("init-execution-context-on", self.fallible(
            lambda store, g, target: ResourceHost.own(
                svc.init_context(_rep(store, g), target), CONTEXT), tagged=True))

    def define_oneshot(self, inst: LinkerInstance) -> None:
        svc = self.service

        def compute(store: Any, g: Any, named: Any, target: str | None) -> Any:
            graph = _rep(store, g)
            return self._own_named(svc.graph_compute(graph, self._take_named(store, named), target))

        inst.add_func("compute", self.fallible(compute, tagged=False))

    def define_bulk(self, inst: LinkerInstance) -> None:
        svc = self.service

        def from_words(store: Any, dims: Any, ty: str, words: Any) -> ResourceHost:
            return ResourceHost.own(svc.tensor_from_words(dims, ty, _word_bytes(words)), TENSOR)

        def words_of(store: Any, h: Any) -> Any:
            data = svc.tensor_data(_rep(store, h), words=True)
            if fastlist.installed():
                return data
            raw = bytes(data)
            raw += b"\0" * (-len(raw) % 8)
            return np.frombuffer(raw, dtype="<u8").tolist()

        def load_words(store: Any, builders: Any, enc: str, target: str) -> ResourceHost:
            parts = [(int(size), _word_bytes(words)) for size, words in builders]
            return ResourceHost.own(svc.load_words(parts, enc, target), GRAPH)

        inst.add_func("tensor-from-words", self.fallible(from_words, tagged=True))
        inst.add_func("load-words", self.fallible(load_words, tagged=True))
        inst.add_func("tensor-words", self.infallible(words_of, list))

    def define_scratch(self, inst: LinkerInstance) -> None:
        svc = self.service
        inst.add_func("tensor-from-scratch", self.fallible(
            lambda store, name, dims, ty: ResourceHost.own(
                svc.tensor_from_scratch(name, dims, ty), TENSOR), tagged=True))
        inst.add_func("tensor-to-scratch", self.fallible(
            lambda store, h, name: svc.tensor_to_scratch(_rep(store, h), name), tagged=False))
        inst.add_func("load-from-scratch", self.fallible(
            lambda store, names, enc, target: ResourceHost.own(
                svc.load_from_scratch(list(names), enc, target), GRAPH), tagged=True))

    def define_all(self, linker: Linker) -> None:
        """Every wasi-nn release candidate plus the wasinn extension."""
        with linker.root() as root:
            for version in NN_VERSIONS:
                with root.add_instance(f"wasi:nn/errors@{version}") as inst:
                    self.define_errors(inst, with_constructor=version.endswith("06-25"))
                with root.add_instance(f"wasi:nn/tensor@{version}") as inst:
                    self.define_tensor(inst)
                with root.add_instance(f"wasi:nn/inference@{version}") as inst:
                    self.define_inference(inst, named_compute=version == EXT_NN_VERSION)
                with root.add_instance(f"wasi:nn/graph@{version}") as inst:
                    self.define_graph(inst)
            package, _, ver = EXT_PACKAGE.partition("@")
            with root.add_instance(f"{package}/targets@{ver}") as inst:
                self.define_targets(inst)
            with root.add_instance(f"{package}/oneshot@{ver}") as inst:
                self.define_oneshot(inst)
            with root.add_instance(f"{package}/bulk@{ver}") as inst:
                self.define_bulk(inst)
            with root.add_instance(f"{package}/scratch@{ver}") as inst:
                self.define_scratch(inst)


def nn_linker(engine: Any, service: NNService, interrupter: Interrupter | None = None,
              *, wasi: bool = True) -> Linker:
    """A Linker with WASI 0.2 (when ``wasi``) and every wasi-nn interface over ``service``."""
    linker = Linker(engine)
    if wasi:
        linker.add_wasip2()
    Binder(service, interrupter).define_all(linker)
    return linker
