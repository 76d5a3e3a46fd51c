"""The host side of a component guest's wasi-nn resources: one table per resource kind.

A component guest holds handles; wasmtime maps each handle to a *rep*, a u32 the host
chose when it created the resource. These tables map reps to host objects for one
guest instance. Reps are never reused within an instance, so a stale rep can never
alias a newer object. When the guest has dropped every handle, every table is empty
(:meth:`GuestTables.live`), which the tests check.

Every table is bounded (``[guests]`` limits), so a guest that never drops its handles
cannot grow the host without end: :meth:`HandleTable.add` raises TooLargeError naming
the limit, and the tensor table also keeps a byte budget (:class:`TensorTable`).
Where a call has no way to report that error (the tensor constructor, the error
resource itself, or ``tensor.data()`` past ``max_data_bytes``), the service raises
:class:`ResourceExhausted` instead, which the linker turns into a trap of the guest.

Errors are bounded in size too: an ``error`` keeps only its code and a message cut to
:data:`MAX_ERROR_MESSAGE_BYTES` (:func:`bounded_message`), never the exception (whose
traceback would keep the failed call's arguments alive), and messages the host builds
quote a guest's string only in part (:func:`quoted`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from wasinn.errors import (
    MAX_MESSAGE_BYTES,
    ClosedResourceError,
    ErrorCode,
    TooLargeError,
    WasiNNError,
    bounded_message,
)
from wasinn.host.limits import GuestLimits
from wasinn.tensor import Tensor

T = TypeVar("T")

#: Largest rep; wasmtime stores reps as u32.
_MAX_REP = 0xFFFF_FFFF
#: Host bytes one stored dimension of an invalid tensor costs (a Python int and its slot).
DIM_BYTES = 36
#: Most UTF-8 bytes of message an ``error`` resource keeps (:func:`bounded_message`).
MAX_ERROR_MESSAGE_BYTES = MAX_MESSAGE_BYTES


class ResourceExhausted(Exception):
    """The host cannot create a resource or hand over a value that a call must return
    (the tensor constructor, which has no error case, an ``error`` resource itself, or
    ``tensor.data()`` beyond the guest's limit). Not a WasiNNError on purpose: the
    linker traps the guest with this message instead of answering."""


class HandleTable(Generic[T]):
    """rep -> object for one resource kind of one guest.

    ``setting`` names the ``[guests]`` key that sets ``limit``, for the messages.
    """

    def __init__(self, kind: str, limit: int | None = None, setting: str = "") -> None:
        self.kind = kind
        self.limit = limit
        self.setting = setting
        self._items: dict[int, T] = {}
        self._next = 1

    @property
    def full(self) -> bool:
        return self.limit is not None and len(self._items) >= self.limit

    def full_message(self) -> str:
        where = f" ([guests] {self.setting})" if self.setting else ""
        return (f"this guest already holds {len(self._items)} {self.kind} handles, the most "
                f"it may hold at once{where}: drop some before creating more")

    def add(self, item: T) -> int:
        """Store ``item`` and return its new rep; TooLargeError beyond ``limit`` live items."""
        if self.full:
            raise TooLargeError(self.full_message())
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

    @property
    def nbytes(self) -> int:
        """What holding this entry costs the host: the data, or an invalid tensor's bytes
        and dimensions (which may be many: they were never validated)."""
        if self.tensor is not None:
            return self.tensor.nbytes
        return len(self.raw) + DIM_BYTES * len(self.dims)


@dataclass(eq=False)
class _Held:
    """A tensor charged to a guest's byte budget, and how many hold it."""

    tensor: Tensor
    nbytes: int
    holders: int = 1


class TensorTable(HandleTable[TensorEntry]):
    """The tensor table: at most ``limit`` handles and ``max_bytes`` bytes of live tensors.

    The byte budget counts each tensor once, whoever holds it: handles (two
    ``get-output`` calls for one output are two handles to one tensor), and what a
    context keeps for the guest outside this table with the older RCs (inputs staged by
    ``set-input``, outputs kept for ``get-output``): :meth:`hold` / :meth:`let_go`. An
    entry without data (an invalid tensor) is charged its own bytes.
    """

    def __init__(self, limit: int, max_bytes: int) -> None:
        super().__init__("tensor", limit, "max_tensors")
        self.max_bytes = max_bytes
        self.nbytes = 0
        #: rep -> bytes charged, for entries without a tensor.
        self._charged: dict[int, int] = {}
        #: id(tensor) -> the tensor (kept alive, so its id stays its own) and its holders.
        self._held: dict[int, _Held] = {}

    def check_room(self, nbytes: int) -> None:
        """TooLargeError when one more tensor of ``nbytes`` would not fit (count or bytes)."""
        if self.full:
            raise TooLargeError(self.full_message())
        self.check_bytes(nbytes)

    def check_bytes(self, nbytes: int) -> None:
        if self.nbytes + nbytes > self.max_bytes:
            raise TooLargeError(
                f"a tensor of {nbytes} bytes would bring this guest's live tensors to "
                f"{self.nbytes + nbytes} bytes, over its limit of {self.max_bytes} "
                f"([guests] max_live_tensor_bytes): drop tensors before creating more"
            )

    def hold(self, tensor: Tensor) -> None:
        """One more holder of ``tensor``; its first is charged its bytes (TooLargeError
        when they do not fit, and then nothing is held)."""
        held = self._held.get(id(tensor))
        if held is not None:
            held.holders += 1
            return
        nbytes = tensor.nbytes
        self.check_bytes(nbytes)
        self._held[id(tensor)] = _Held(tensor, nbytes)
        self.nbytes += nbytes

    def let_go(self, tensor: Tensor) -> None:
        """One holder fewer of ``tensor``; its bytes are credited with the last."""
        held = self._held.get(id(tensor))
        if held is None:
            return
        held.holders -= 1
        if held.holders == 0:
            del self._held[id(tensor)]
            self.nbytes -= held.nbytes

    def add(self, item: TensorEntry, *, placeholder: bool = False) -> int:
        """Store ``item``; TooLargeError beyond the handle limit or the byte budget.

        A ``placeholder`` (a data-less invalid tensor standing in for one that did not
        fit) skips the byte check: it costs at most a few dimensions.
        """
        tensor = item.tensor
        if tensor is not None:
            if self.full:
                raise TooLargeError(self.full_message())
            self.hold(tensor)
            try:
                return super().add(item)
            except BaseException:
                self.let_go(tensor)
                raise
        nbytes = item.nbytes
        if placeholder:
            assert not item.raw, "a placeholder holds no data"
        else:
            self.check_room(nbytes)
        rep = super().add(item)
        self._charged[rep] = nbytes
        self.nbytes += nbytes
        return rep

    def pop(self, rep: int) -> TensorEntry | None:
        item = super().pop(rep)
        if item is not None:
            if item.tensor is not None:
                self.let_go(item.tensor)
            else:
                self.nbytes -= self._charged.pop(rep, 0)
        return item

    def drain(self) -> list[TensorEntry]:
        self._charged.clear()
        self._held.clear()
        self.nbytes = 0
        return super().drain()


@dataclass(eq=False)
class GraphEntry:
    """A loaded graph and how many guest handles (graph + its contexts) still hold it.

    ``unloaded`` is set once ``unload`` has run (or failed for good), never before: a
    graph whose unload was cancelled is still to be unloaded.
    """

    graph: Any
    label: str
    holders: int = 1
    model_bytes: int = 0
    unloaded: bool = False


@dataclass
class ContextEntry:
    """An execution context, the graph it keeps alive, and the older RCs' staged inputs
    and kept outputs (each held in the guest's :class:`TensorTable` until it goes)."""

    context: Any
    graph: GraphEntry
    inputs: dict[str | int, Tensor] = field(default_factory=dict)
    outputs: dict[str, Tensor] | None = None
    closed: bool = False


@dataclass(frozen=True)
class ErrorEntry:
    """What an ``error`` resource holds: its code and a bounded message."""

    code: ErrorCode
    message: str

    @classmethod
    def of(cls, error: WasiNNError) -> ErrorEntry:
        return cls(error.code, bounded_message(error.message, MAX_ERROR_MESSAGE_BYTES))


@dataclass
class GuestTables:
    """Every wasi-nn resource table of one guest instance."""

    tensors: TensorTable
    graphs: HandleTable[GraphEntry]
    contexts: HandleTable[ContextEntry]
    errors: HandleTable[ErrorEntry]

    @classmethod
    def create(cls, limits: GuestLimits | None = None) -> GuestTables:
        limits = limits or GuestLimits()
        return cls(
            tensors=TensorTable(limits.max_tensors, limits.max_live_tensor_bytes),
            graphs=HandleTable("graph", limits.max_graphs, "max_graphs"),
            contexts=HandleTable("graph-execution-context", limits.max_contexts,
                                 "max_contexts"),
            errors=HandleTable("error", limits.max_errors, "max_errors"),
        )

    def live(self) -> dict[str, int]:
        """How many handles of each kind are live (all zero once the guest dropped all)."""
        return {
            "tensor": len(self.tensors),
            "graph": len(self.graphs),
            "graph-execution-context": len(self.contexts),
            "error": len(self.errors),
        }
