"""What every way of running a job on a device shares: the device context's wrapper and
how a backend's own exception reaches the caller.

A job may run in a device worker thread, in a guest's own thread (a lease) or inline on
the event loop; in each case it runs inside the device context (a CUDA stream, say) and a
library exception that is not already a :class:`~wasinn.errors.WasiNNError` becomes the
request's runtime-error, naming the device and keeping the original as its cause.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from wasinn.errors import BackendRuntimeError

T = TypeVar("T")

#: A device context's wrapper: returns the job to run inside that context.
Wrap = Callable[[Callable[[], Any]], Callable[[], Any]]


def in_context(job: Callable[[], T], wrap: Wrap | None) -> Callable[[], T]:
    """``job`` as it must run on the device (wrapped by its context, if it has one)."""
    return job if wrap is None else wrap(job)


def backend_failure(device: object, exc: Exception) -> BackendRuntimeError:
    """The runtime-error a caller sees for a backend's own exception ``exc``."""
    return BackendRuntimeError(f"{device}: the backend failed: {type(exc).__name__}: {exc}")
