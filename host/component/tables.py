"""The host side of a component guest's wasi-nn resources: one table per resource kind.

A component guest holds handles; wasmtime maps each handle to a *rep*, a u32 the host
chose when it created the resource. These tables map reps to host objects for one
guest instance. Reps are never reused within an instance, so a stale rep can never
alias a newer object. When the guest has dropped every handle, every table is empty
(:meth:`GuestTables.live`), which the tests check.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from wasinn.errors import ClosedResourceError, TooLargeError, WasiNNError
from wasinn.tensor import Tensor

T = TypeVar("T")

#: Largest rep; wasmtime stores reps as u32.
_MAX_REP = 0xFFFF_FFFF


class HandleTable(Generic[T]):
    """rep -> object for one resource kind of one guest."""

    def __init__(self, kind: str, limit: int | None = None) -> None:
        self.kind = kind
        self.limit = limit
        self._items: dict[int, T] = {}
        self._next = 1

    def add(self, item: T) -> int:
        """Store ``item`` and return its new rep; TooLargeError beyond ``limit`` live items."""
        if self.limit is not None and len(self._items) >= self.limit:
            raise TooLargeError(
                f"this guest already holds {len(self._items)} {self.kind} handles, the most "
                f"it may hold at once: drop some before creating more"
            )
        if self._next > _MAX_REP:
            raise TooLargeError(f"this guest has used up every {self.kind} handle number")
        rep = self._next
        self._next += 1
        self._items[rep] = item
        return rep

    def get(self, rep: int) -> T:
        try:
            return self._items[rep]
        except KeyError:
            raise ClosedResourceError(f"{self.kind} handle {rep} is no longer live") from None

    def pop(self, rep: int) -> T | None:
        return self._items.pop(rep, None)

    def drain(self) -> list[T]:
        items = list(self._items.values())
        self._items.clear()
        return items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[T]:
        return iter(list(self._items.values()))


@dataclass
class TensorEntry:
    """A tensor as the guest sees it: dims and type always; data valid or a deferred error.

    A constructor cannot return an error in WIT, so a tensor built from inconsistent
    arguments is kept with ``invalid`` set, and the first call that needs its data
    (compute, set-input) reports that error to the guest.
    """

    dims: tuple[int, ...]
    type_name: str
    tensor: Tensor | None
    invalid: WasiNNError | None = None
    raw: bytes = b""

    def require(self) -> Tensor:
        if self.tensor is None:
            raise self.invalid or ClosedResourceError("tensor has no data")
        return self.tensor


@dataclass
class GraphEntry:
    """A loaded graph and how many guest handles (graph + its contexts) still hold it."""

    graph: Any
    label: str
    holders: int = 1
    model_bytes: int = 0
    unloaded: bool = False


@dataclass
class ContextEntry:
    """An execution context, the graph it keeps alive, and the older RCs' staged tensors."""

    context: Any
    graph: GraphEntry
    inputs: dict[str | int, Tensor] = field(default_factory=dict)
    outputs: dict[str, Tensor] | None = None
    closed: bool = False


@dataclass
class GuestTables:
    """Every wasi-nn resource table of one guest instance."""

    tensors: HandleTable[TensorEntry]
    graphs: HandleTable[GraphEntry]
    contexts: HandleTable[ContextEntry]
    errors: HandleTable[WasiNNError]

    @classmethod
    def create(cls, max_graphs: int | None = None, max_contexts: int | None = None) -> GuestTables:
        return cls(
            tensors=HandleTable("tensor"),
            graphs=HandleTable("graph", max_graphs),
            contexts=HandleTable("graph-execution-context", max_contexts),
            errors=HandleTable("error"),
        )

    def live(self) -> dict[str, int]:
        """How many handles of each kind are live (all zero once the guest dropped all)."""
        return {
            "tensor": len(self.tensors),
            "graph": len(self.graphs),
            "graph-execution-context": len(self.contexts),
            "error": len(self.errors),
        }
