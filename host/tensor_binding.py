"""How guest tensors bind to a graph's inputs and outputs (legacy ABI).

An :class:`InputBinding` records where a guest's input tensor lies in its memory; the
data is read (as a view) only when ``compute`` runs. An :class:`OutputBinding` is a
guest buffer bound to an output before compute. :func:`run_context_in_thread` binds
inputs and outputs, takes a device slot (through trio only when it must queue) and runs
the backend in the guest's own thread; :func:`run_context` (used when a compute timeout
must be able to abandon a running request) runs it all in trio, one round trip.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import trio

from wasinn.backends.base import TensorSpec, outside_bounds
from wasinn.errors import (
    InvalidArgumentError,
    NotFoundError,
    TimeoutError_,
)
from wasinn.host.guest_memory import TensorRecord
from wasinn.host.scheduler_api import CallerRunLike, ContextLike, Portal
from wasinn.tensor import Tensor


@dataclass
class InputBinding:
    record: TensorRecord
    #: The record's bytes and its dimensions' (GuestMemory.tensor_key): the same key at
    #: the next set_input means the same tensor, already checked.
    key: bytes = b""


@dataclass
class OutputBinding:
    ptr: int
    max_len: int
    written_ptr: int
    #: The output's size when its shape is fully known before running (static_nbytes).
    needed: int | None = None



async def run_context(ctx: ContextLike, inputs: dict[str, Tensor],
                       bound: dict[str, np.ndarray[Any, Any]],
                       names: list[str], timeout: float | None = None,
                       tenant: str = "") -> dict[str, Tensor]:
    """One trio round trip per compute: bind, run (for ``tenant``), collect every output
    (in trio).

    The context copies the outputs into the bound buffers once the run ends, all or none:
    a TooLargeError for one that does not fit carries what each needed
    (``bound_sizes``). Past ``timeout`` seconds the run is cancelled (its queued request
    dropped, a running one abandoned) and TimeoutError_ is raised.
    """
    for name, tensor in inputs.items():
        ctx.set_input(name, tensor)
    for name, buffer in bound.items():
        ctx.set_output(name, buffer)
    try:
        with trio.fail_after(math.inf if timeout is None else timeout):
            await ctx.run(tenant=tenant)
    except trio.TooSlowError:
        raise TimeoutError_(
            f"compute took longer than this guest's limit of {timeout:g} s "
            "([guests] compute_timeout)"
        ) from None
    return {name: ctx.get_output(name) for name in names}


class InFlight:
    """The request a guest's thread is running, so that another thread (the one stopping
    the guest) can interrupt it instead of waiting for a long inference to end.

    Once interrupted, every later request of the guest is interrupted as it starts: the
    guest is being stopped. Either order of :meth:`run` and :meth:`interrupt` from the
    two threads ends with the run interrupted (each writes its field, then reads the
    other's).
    """

    __slots__ = ("_interrupted", "_run")

    def __init__(self) -> None:
        self._run: CallerRunLike | None = None
        self._interrupted = False

    def run(self, run: CallerRunLike) -> dict[str, Tensor]:
        """``run.run()`` in this (the guest's) thread, interruptible meanwhile."""
        self._run = run
        if self._interrupted:
            run.interrupt()
        try:
            return run.run()
        finally:
            self._run = None

    def interrupt(self) -> None:
        self._interrupted = True
        run = self._run
        if run is not None:
            run.interrupt()


def run_context_in_thread(portal: Portal, ctx: ContextLike, inputs: dict[str, Tensor],
                          bound: dict[str, np.ndarray[Any, Any]],
                          in_flight: InFlight, tenant: str = "") -> dict[str, Tensor]:
    """In the guest's thread: bind inputs and outputs (the context is this guest's
    alone), take a free device slot (no trio when one is free and nobody is queued) and
    run the backend here, giving the slot back without waiting for trio; or else queue
    the request for ``tenant`` through ``portal`` (one trio round trip), which on a busy
    device runs it in a device worker thread.

    Cancelling the guest's trio task while the request is queued drops it (the portal
    raises trio.Cancelled here), and while it runs in a worker thread abandons it; a
    request running here is registered with ``in_flight``, whose ``interrupt`` stops it
    where the backend can (ONNX Runtime, OpenVINO).

    ``inputs`` may be views of guest memory. On a busy device the request runs in a
    device worker thread instead (started by the thread that frees a slot, or merged
    into a batch), and a cancelled guest leaves it at once: its memory may be gone while
    that run still reads it, so such a request is handed copies (one copy of each input,
    only when the device is busy, made while another request runs).

    The outputs are copied into the ``bound`` buffers (views of guest memory) in this
    thread once the run ends, all or none, as :func:`run_context` says.
    """
    for name, buffer in bound.items():
        ctx.set_output(name, buffer)
    run = ctx.try_lease(inputs, tenant=tenant)
    if run is None:
        run = portal.run(functools.partial(ctx.lease, owned_copies(inputs), tenant=tenant))
    return in_flight.run(run)


def owned_copies(inputs: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Host copies of ``inputs`` (views of guest memory), for a run that may outlive the
    guest's wait for it: one abandoned when the guest is cancelled or times out."""
    return {name: Tensor.from_numpy(t.numpy().copy()) for name, t in inputs.items()}


def copy_bytes(target: np.ndarray[Any, Any], source: np.ndarray[Any, Any]) -> None:
    """Copy ``source``'s bytes (any dtype, any shape, C order) into the uint8 array
    ``target`` of exactly that many bytes."""
    src: Any = np.ascontiguousarray(source)
    dst: Any = target  # (numpy declares the buffer protocol only for Python 3.12+)
    try:  # one memcpy through the buffer protocol: the cheapest copy from Python
        memoryview(dst)[:] = memoryview(src).cast("B")
    except (TypeError, ValueError):  # a dtype with no buffer format (bf16)
        np.copyto(target, src.reshape(-1).view(np.uint8))


def static_nbytes(spec: TensorSpec) -> int | None:
    """The byte size of an output whose shape is fully known before running, else None."""
    if not (spec.rank_known and spec.type_known) or any(d is None for d in spec.shape):
        return None
    return math.prod(d for d in spec.shape if d is not None) * spec.type.itemsize


def spec_at(specs: tuple[TensorSpec, ...], index: int, kind: str) -> TensorSpec:
    if 0 <= index < len(specs):
        return specs[index]
    raise NotFoundError(
        f"{kind} index {index} does not exist: the graph has {len(specs)} {kind}s "
        f"({', '.join(s.describe() for s in specs)})"
    )


def spec_named(specs: tuple[TensorSpec, ...], name: str, kind: str) -> TensorSpec:
    for spec in specs:
        if spec.name == name:
            return spec
    raise NotFoundError(
        f"the graph has no {kind} named {name!r}: expected one of "
        f"{', '.join(repr(s.name) for s in specs)}"
    )


def check_against_spec(record: TensorRecord, spec: TensorSpec) -> None:
    """Reject at set_input what compute would reject anyway, naming what the model wants."""
    # A spec of unknown rank (TorchScript, a dynamic-rank port) takes any shape, one of
    # undeclared type (TorchScript: type_known=False) any type: the model decides.
    shape_ok = not spec.rank_known or (len(record.dims) == len(spec.shape) and all(
        want is None or want == got for want, got in zip(spec.shape, record.dims, strict=True)))
    type_ok = record.type is spec.type or not spec.type_known
    if not (type_ok and shape_ok):
        raise InvalidArgumentError(
            f"input {spec.name!r} got {record.type.value}{list(record.dims)}: the model "
            f"expects {spec.describe()}"
        )
    if spec.bounds:  # (a model's interval dimensions: [1..4, 3])
        for axis, (size, (low, high)) in enumerate(zip(record.dims, spec.bounds, strict=True)):
            if size < low or (high is not None and size > high):
                raise InvalidArgumentError(outside_bounds(spec, axis, size, low, high))
