"""Inference for a component guest: compute on a context or on a graph, and the older
release candidates' staged ``set-input``, ``compute`` and ``get-output``.

:class:`InferenceOperations` is the part of
:class:`~wasinn.host.component.service.NNService` that implements wasi-nn's ``inference``
interface and the wasinn extension's compute on a graph. Inputs are tensors the guest
handed over (they have left its table); outputs are computed with ``keep_on_device=True``
and handed to the guest as new tensors. Without a ``compute_timeout`` the backend runs in
the guest's thread once it holds a device slot; with one, in a device worker thread that
is abandoned when the timeout passes. The older RCs' ``set-input`` stages only the
graph's own inputs, and staged inputs and kept outputs count against the guest's tensor
budget.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from wasinn.backends.base import TensorSpec
from wasinn.enums import ExecutionTarget
from wasinn.errors import (
    InvalidArgumentError,
    NotFoundError,
    TimeoutError_,
    TooLargeError,
    UnknownNameError,
    WasiNNError,
    quoted,
)
from wasinn.host.component.graphs import GraphOperations
from wasinn.host.component.tables import ContextEntry, TensorEntry
from wasinn.host.component.tensors import output_dims, wit_type_name
from wasinn.host.guest_memory import check_name_length
from wasinn.host.single_values import as_scalar
from wasinn.host.tensor_binding import InFlight
from wasinn.tensor import Tensor

T = TypeVar("T")


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


class InferenceOperations(GraphOperations):
    """The inference operations of :class:`~wasinn.host.component.service.NNService`,
    which sets what follows, on its graphs and contexts."""

    in_flight: InFlight

    def _inputs(self, named: Sequence[tuple[str, TensorEntry]],
                graph: Any) -> dict[str | int, Tensor]:
        # ``named``'s tensors for ``graph`` (a one-value [1] given for a scalar input read
        # as that scalar: see wasinn.host.single_values).
        specs: Sequence[TensorSpec] = graph.inputs
        aliases: Mapping[str, int] = getattr(graph, "input_aliases", {})  # (a fake's: none)
        inputs: dict[str | int, Tensor] = {}
        for name, entry in named:
            check_name_length(name, "input name")
            if name in inputs:
                raise InvalidArgumentError(
                    f"input {quoted(name)} is given twice: expected each input at most once")
            try:
                inputs[name] = as_scalar(entry.require(), specs, name, aliases)
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
        inputs = self._inputs(named, entry.graph.graph)
        outputs = self._context_compute(entry, inputs)
        return self._add_outputs(outputs)

    def graph_compute(
        self, graph_rep: int, named: Sequence[tuple[str, TensorEntry]], target: str | None
    ) -> list[tuple[str, int]]:
        """wasinn extension: compute on a graph without a context (seed 002)."""
        graph = self.tables.graphs.get(graph_rep)
        tgt = None if target is None else ExecutionTarget.coerce(target)
        self._check_target(tgt)
        inputs = self._inputs(named, graph.graph)
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
        (_, value), = self._inputs([(key, tensor)], entry.graph.graph).items()
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
