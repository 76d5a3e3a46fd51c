"""What torch's process-wide caches keep of each ``torch.export`` load, given back once the
load is done (for :mod:`._torch_export`).

torch keeps something of every load for good, about 14 KB on torch 2.13 (1,200 loads of
a two-operator program took 17 MB): a process that loads ``.pt2`` programs over and over
(each guest's ``load_by_name`` of a registered model that is not resident) grows
without limit. Two caches hold it:

- ``ShapeEnv``'s methods keep their results in process-wide ``functools.lru_cache``
  caches, keyed by the ``ShapeEnv``: each unbounded one keeps every load's ``ShapeEnv``
  that reaches it, and with it the load's fake tensors (about 60 objects). On torch 2.13
  that is ``constrain_symbol_range``'s; on 2.11 also ``replace``'s, ``_find``'s,
  ``simplify``'s and ``_maybe_evaluate_static``'s, which a 2.11 load calls (``replace``
  243 times for a two-operator program; torch empties them itself when a call meets a
  ``ShapeEnv`` that has learnt something, by its version count, since the last call:
  a load's never does, so 300 loads kept 300). A cache only spares repeating a call whose
  result or effect (narrowing a symbol's range) is already had, so emptying it changes
  no result: :func:`forget_shape_envs` empties every unbounded one after each load,
  found by what it says of itself (``cache_info().maxsize is None``), not by name. The
  bounded ones (256 entries) still keep a few dozen ``ShapeEnv`` objects, whatever the
  number of loads.
- ``torch.fx`` keeps the source of every ``GraphModule`` it generates
  (``torch.fx.graph_module._loader.eval_cache`` and a lazy ``linecache`` entry, named
  ``<eval_with_key>.N``), for tracebacks and ``inspect.getsource``: 7 for one load of
  a small program, most of them of modules the load made and dropped. Sources made
  while wasinn loads (:func:`sources_mark`, :func:`drop_dead_sources`) are dropped at a
  later load, once no live ``GraphModule`` runs them: a loaded program keeps its
  source while it is alive, and so does a module another thread generated meanwhile.

Both caches are torch's internals: where torch lays them out otherwise, nothing is
cleared (and nothing fails).
"""

from __future__ import annotations

import linecache
import re
import threading
from typing import Any

import torch
import torch.fx.graph_module as fx_graph_module
from torch.fx.experimental.symbolic_shapes import ShapeEnv

#: The number in the name of a source torch.fx generated.
_SOURCE_NUMBER = re.compile(r"<eval_with_key>\.(\d+)")

_LOCK = threading.Lock()
#: Sources made while wasinn loaded, not yet dropped (a live module runs each, or it was
#: made by the last load: see :func:`drop_dead_sources`).
_pending: set[str] = set()


def forget_shape_envs() -> None:
    """Clear the unbounded caches of ``ShapeEnv``'s methods, which keep every
    ``ShapeEnv`` alive (call it after a load: it only costs a repeated call to a
    ``ShapeEnv`` still in use). A method whose cache says nothing of its size, or that
    has none, is left alone."""
    for method in vars(ShapeEnv).values():
        info = getattr(method, "cache_info", None)
        clear = getattr(method, "cache_clear", None)
        if callable(info) and callable(clear) and getattr(info(), "maxsize", 0) is None:
            clear()


def sources_mark() -> int | None:
    """torch.fx's next source number, taken before a load; None where torch numbers its
    sources otherwise."""
    number = getattr(getattr(fx_graph_module, "_loader", None), "next_id", None)
    return number if isinstance(number, int) else None


def drop_dead_sources(mark: int | None) -> None:
    """Drop the sources made since ``mark`` (:func:`sources_mark`) and those of earlier
    loads once no live ``GraphModule`` runs them.

    The sources made since ``mark`` are only dropped at the next call, not this one: one
    that another thread is generating now may not have its module yet.
    """
    loader = getattr(fx_graph_module, "_loader", None)
    cache = getattr(loader, "eval_cache", None)
    if mark is None or not isinstance(cache, dict):
        return
    with _LOCK:
        live = _live_sources()
        for key in _pending - live:
            cache.pop(key, None)
            linecache.cache.pop(key, None)
        _pending.intersection_update(live)
        end = getattr(loader, "next_id", mark)
        for key in list(cache):  # a copy: other threads may add to it meanwhile
            found = _SOURCE_NUMBER.match(key) if isinstance(key, str) else None
            if found and mark <= int(found[1]) < end:
                _pending.add(key)


def _live_sources() -> set[str]:
    """The source name of each live ``GraphModule``'s forward (each module has a class
    of its own, which holds it)."""
    live: set[str] = set()
    seen: set[type[Any]] = set()
    todo: list[type[Any]] = [torch.fx.GraphModule]
    while todo:
        cls = todo.pop()
        code = getattr(vars(cls).get("forward"), "__code__", None)
        if code is not None:
            live.add(code.co_filename)
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.add(sub)
                todo.append(sub)
    return live
