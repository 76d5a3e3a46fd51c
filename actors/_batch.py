"""A batch while it forms: its members, the terms it queues on, and who may join it.

Each request in a batch is a :class:`Member` (its inputs, its terms, and its outcome once
the batch has run); a :class:`Batch` holds them and the terms of its entry in the device's
queue, recomputed from its live members when one leaves. The
:class:`~wasinn.actors._batcher.Batcher` opens, fills, closes and runs them (see
:mod:`wasinn.actors.batching`).
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import TYPE_CHECKING

import outcome
import trio

from wasinn.tensor import Tensor

from ._batch_rows import BatchInputs, RunInputs
from .queue import Request
from .stats import Account

if TYPE_CHECKING:
    from .batching import Batching


class Member:
    """One request in a batch: its inputs and terms, and its outcome once the batch has
    run."""

    __slots__ = ("abandoned", "deadline", "done", "granted", "inputs", "keep", "priority",
                 "released", "result", "share")

    def __init__(self, inputs: BatchInputs, keep: bool, priority: int, deadline: float
                 ) -> None:
        self.inputs = inputs
        self.keep = keep
        self.priority = priority
        self.deadline = deadline
        self.done = trio.Event()
        self.result: outcome.Outcome[dict[str, Tensor]] | None = None
        self.granted = math.inf  # perf_counter when its batch started running
        #: perf_counter when the batch's worker thread passed its slot on (inf: it did not)
        self.released = math.inf
        self.share = 1.0  # its rows' share of the batch's run (its device time)
        self.abandoned = False


class Batch:
    """Requests that will run together; open (joinable) until it starts or fills up
    (open again if a member leaves it full before it starts: ``rows`` counts its live
    members' rows until then).
    ``priority`` and ``deadline``: its live members' highest and earliest; ``request``:
    its entry in the device's queue until it is granted a slot; ``probe``: whether the
    first merged run of its key is checked against a run alone (see
    :meth:`Batcher.submit <wasinn.actors._batcher.Batcher.submit>`)."""

    __slots__ = ("account", "batching", "deadline", "full", "key", "label", "live",
                 "members", "open", "opened", "priority", "probe", "request", "rows", "run",
                 "scope", "tenant")

    def __init__(self, key: Hashable, run: RunInputs, batching: Batching, priority: int,
                 deadline: float, tenant: str, label: str,
                 account: Account | None, *, probe: bool = False) -> None:
        self.key = key
        self.run = run
        self.batching = batching
        self.probe = probe
        self.priority = priority
        self.deadline = deadline
        self.tenant = tenant
        self.label = label
        self.account = account
        self.members: list[Member] = []
        self.rows = 0
        self.live = 0  # members still waiting for their result
        self.open = True
        self.opened = trio.current_time()
        self.full = trio.Event()
        self.scope = trio.CancelScope()  # its runner's: cancelled once every member left
        self.request: Request | None = None

    def left(self) -> bool:
        """A member left: recompute the terms from those still live; whether they
        changed."""
        live = [m for m in self.members if not m.abandoned]
        if not live:
            return False
        priority = max(m.priority for m in live)
        deadline = min(m.deadline for m in live)
        if (priority, deadline) == (self.priority, self.deadline):
            return False
        self.priority, self.deadline = priority, deadline
        return True

    def admits(self, inputs: BatchInputs, priority: int, deadline: float,
               tenant: str) -> bool:
        return (self.open and tenant == self.tenant and priority <= self.priority
                and deadline >= self.deadline
                and self.rows + inputs.rows <= self.batching.max_batch)
