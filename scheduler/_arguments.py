"""What a caller hands the :class:`~.runtime.Runtime`, checked before anything is done
with it: a model's bytes and its load options (``Runtime.load``), and the backend
instances ``Runtime(backends=...)`` adds to every pool's registry.

Each bad argument is an InvalidArgumentError (InvalidEncodingError for an empty builder
list) that names it and says what was expected; a backend option the backend does not
read is refused by the rules a config's model options follow (:mod:`wasinn.configs`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, cast

from wasinn.backends.base import MAX_THREADS, Backend, LoadOptions, sandbox_setting
from wasinn.backends.sandbox import MIN_MAX_BYTES
from wasinn.configs import check_precision
from wasinn.errors import InvalidArgumentError, InvalidEncodingError
from wasinn.tensor import as_int


def owned_builders(builders: object) -> tuple[bytes, ...]:
    if isinstance(builders, bytes | bytearray | memoryview | str) or not isinstance(
        builders, Sequence
    ):
        raise InvalidArgumentError(
            f"builders must be a sequence of bytes-like objects (one per model file), "
            f"not {type(builders).__name__}"
        )
    owned = []
    for i, builder in enumerate(builders):
        if isinstance(builder, bytes):
            owned.append(builder)
        elif isinstance(builder, bytearray | memoryview):
            owned.append(bytes(builder))  # the caller may reuse its memory: keep our copy
        else:
            raise InvalidArgumentError(
                f"builder {i} is {type(builder).__name__}: expected bytes, bytearray or "
                "memoryview"
            )
    if not owned:
        raise InvalidEncodingError("empty builder list: expected the model's bytes")
    return tuple(owned)


def checked_options(options: LoadOptions | Mapping[str, Any] | None) -> LoadOptions:
    if options is None:
        return LoadOptions()
    if isinstance(options, LoadOptions):
        check_precision(options.precision)
        _check_max_sandbox_bytes(options.max_sandbox_bytes, _check_sandbox(options.sandbox))
        threads = _check_threads(options.threads)
        if threads is not options.threads:  # a numpy integer: kept as a Python int
            options = dataclasses.replace(options, threads=threads)
        return options
    if not isinstance(options, Mapping):
        raise InvalidArgumentError(
            f"options must be a mapping or LoadOptions, not {type(options).__name__}"
        )
    own = ("precision", "threads", "extra", "sandbox", "max_sandbox_bytes")
    extra = {k: v for k, v in options.items() if k not in own}
    nested = options.get("extra", {})
    if not isinstance(nested, Mapping):
        raise InvalidArgumentError(
            f"options extra={nested!r:.60}: expected a mapping of backend options")
    extra.update(nested)  # {"extra": {...}} is LoadOptions' own spelling: accept it too
    precision = options.get("precision", "f32")
    threads = _check_threads(options.get("threads", 0))
    sandbox = _check_sandbox(options.get("sandbox", False))
    max_bytes = options.get("max_sandbox_bytes")
    _check_max_sandbox_bytes(max_bytes, sandbox)
    return LoadOptions(precision=check_precision(precision), threads=threads, extra=extra,
                       sandbox=sandbox, max_sandbox_bytes=max_bytes)


def _check_sandbox(sandbox: object) -> bool | Literal["cpu"]:
    setting = sandbox_setting(sandbox)
    if setting is not None:
        return setting
    raise InvalidArgumentError(
        f"options sandbox={sandbox!r:.60}: expected True (the graph runs in a process of "
        "its own), 'cpu' (so on the CPU only) or False")


def _check_max_sandbox_bytes(max_bytes: object, sandbox: object) -> None:
    if max_bytes is None:
        return
    if type(max_bytes) is not int or max_bytes < MIN_MAX_BYTES:
        raise InvalidArgumentError(
            f"options max_sandbox_bytes={max_bytes!r:.60}: expected the bytes a sandboxed "
            f"graph's process may hold, an integer of at least {MIN_MAX_BYTES}")
    if not sandbox:
        raise InvalidArgumentError(
            f"options max_sandbox_bytes={max_bytes} without sandbox=True: it bounds the "
            "process a sandboxed graph runs in, and this graph runs in the host's")


def backend_instances(backends: object) -> tuple[Backend, ...]:
    # Runtime(backends=...): backend instances, checked before anything reads their name.
    expected = "expected an iterable of wasinn.backends.Backend instances"
    if isinstance(backends, Backend | str | bytes):
        raise InvalidArgumentError(f"backends={backends!r:.60}: {expected} (wrap one in a list)")
    try:
        given: tuple[object, ...] = tuple(backends)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgumentError(
            f"backends={backends!r:.60} ({type(backends).__name__}): {expected}") from None
    for i, backend in enumerate(given):
        if not isinstance(backend, Backend):
            raise InvalidArgumentError(
                f"backends[{i}] is {type(backend).__name__}: {expected}")
    return cast("tuple[Backend, ...]", given)


def _check_threads(threads: object) -> int:
    count = as_int(threads)
    if count is None or not 0 <= count <= MAX_THREADS:
        raise InvalidArgumentError(
            f"options threads={threads!r:.60}: expected a thread count from 0 (the "
            f"backend's default) to {MAX_THREADS}")
    return count


def check_backend_options(options: LoadOptions, backend: str | None,
                           known: Callable[[], list[str]]) -> None:
    """InvalidArgumentError for a backend option that the named backend (or, with none
    named, every backend here: ``known()``) does not read: the rules a config's model
    options follow (a misspelt key would otherwise be ignored without a word)."""
    from wasinn.configs import option_problem, read_by_no_backend

    for key, value in options.extra.items():
        problem = option_problem(backend, key, value)
        if problem is None and backend is None:
            problem = read_by_no_backend(key, known())
        if problem is not None:
            raise InvalidArgumentError(f"options {key!r}: {problem}")
