"""The exception groups of wasinn's own nurseries, collapsed before they reach a caller.

A trio nursery raises what its tasks raise wrapped in a :exc:`BaseExceptionGroup`, even
one exception alone. Where wasinn opens a nursery inside a call of its own (a guest's
thread beside its watcher in ``run_wasm``, a component's scratch watcher, the preloads
of a runtime's start), that nursery is an implementation detail: an exception leaving it
must reach the caller as itself, so that a library user's ``except KeyboardInterrupt``
around ``trio.run`` catches a Ctrl-C that came while a guest ran, as it does one that came
during ``Graph.compute`` (an error keeps its type across boundaries).

:func:`collapsed_groups` wraps such a nursery. A group leaving it that holds one
exception raises that exception instead, with its own context and traceback (plus the
frames it crossed since). :class:`trio.Cancelled` is never swallowed: a group of
Cancelled alone raises its first Cancelled, which the cancelled scope catches as it
would the group. A Cancelled beside one other exception is dropped, as trio's own
collapse drops it: cancellation is level-triggered, so the cancelled scope's next
checkpoint raises Cancelled again. A group of two or more other exceptions (two real
failures side by side) leaves unchanged. A group inside the group is not opened: it came
from someone else's nursery.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from types import TracebackType

import trio


def collapsed_groups() -> AbstractContextManager[None]:
    """A context manager around an internal nursery: a group of one exception (not
    counting Cancelled beside it) leaves as that exception; see the module docstring."""
    return _Collapsing()


def lone_exception(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The exception ``group`` stands for, or None when it holds two or more that are
    not :class:`trio.Cancelled`: its one exception besides any Cancelled, else (only
    Cancelled) its first."""
    others = [exc for exc in group.exceptions if not isinstance(exc, trio.Cancelled)]
    if len(others) == 1:
        return others[0]
    if not others:
        return group.exceptions[0]
    return None


class _Collapsing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not isinstance(exc, BaseExceptionGroup):
            return
        lone = lone_exception(exc)
        if lone is None:
            return  # real errors side by side: the group goes on as it is
        # Raised here, it would get the group (which holds it) as its context: it keeps
        # its own instead, as it would have had raised alone.
        context = lone.__context__
        try:
            raise lone
        finally:
            lone.__context__ = context
            del lone, context
