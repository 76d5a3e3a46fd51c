"""wasinn's exception tree.

Every failure of the wasi-nn API (loading, running and unloading models, configs,
the registry, a guest's wasi-nn calls) is a :class:`WasiNNError`. Its leaves map one to
one onto wasi-nn's ``error-code`` values, so any layer (backend, actor, scheduler, guest
bindings) can raise the precise leaf and the guest ABIs translate it without guessing::

    WasiNNError
    ├── InvalidArgumentError      invalid-argument      a caller passed something malformed
    │   └── ConfigError                                 a config file that cannot be used
    ├── InvalidEncodingError      invalid-encoding      model bytes a backend cannot read
    ├── TimeoutError_             timeout               a deadline passed
    ├── BackendRuntimeError       runtime-error         the backend failed while running
    │   └── DeviceLostError                             the device can run nothing more here
    ├── UnsupportedOperationError unsupported-operation no backend/device can do this here
    ├── TooLargeError             too-large             a tensor, buffer or quota is exceeded
    │   └── QueueFullError                              a device's queue is full: retry later
    ├── NotFoundError             not-found             unknown name, handle or index
    │   └── ClosedResourceError                         the handle was closed/unloaded by its owner
    ├── SecurityError             security              refused for safety (e.g. path escape)
    └── UnknownError              unknown               anything else

What is not a WasiNNError, because it is not the API failing: a guest that traps
(``unreachable``, a memory fault, its ``run_timeout`` or fuel spent) raises
``wasinn.GuestTrap`` (:class:`wasinn.host.runner.GuestTrap`, an Exception) from
``Runtime.run_wasm``; misuse from the wrong thread or event loop (a caller-thread method
called in the trio thread, a runtime used outside its trio run) raises RuntimeError, as
trio's own misuse does; ``MetricsServer`` raises ValueError for a bad port or address
and OSError for one it cannot listen on.

Messages say what was wrong and what was expected. An error that crosses an actor
or thread boundary keeps its type and message. ``ConfigError`` is defined beside the
config it checks (:mod:`wasinn.configs`, which imports this module) and is this module's
too, resolved on first use.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    # (The alias marks a re-export, which mypy --strict would refuse to see otherwise.)
    from wasinn.configs import ConfigError as ConfigError  # noqa: PLC0414
else:
    # Hidden from type checkers, which see the import above instead (a module
    # __getattr__ would make them type every misspelt wasinn.errors.X as Any). Resolved
    # at first use, not imported here: wasinn.configs imports this module.

    def __getattr__(name: str) -> Any:
        if name != "ConfigError":
            raise AttributeError(f"module 'wasinn.errors' has no attribute {name!r}")
        from wasinn.configs import ConfigError

        globals()[name] = ConfigError
        return ConfigError


class ErrorCode(enum.Enum):
    """wasi-nn ``error-code`` (WIT names)."""

    INVALID_ARGUMENT = "invalid-argument"
    INVALID_ENCODING = "invalid-encoding"
    TIMEOUT = "timeout"
    RUNTIME_ERROR = "runtime-error"
    UNSUPPORTED_OPERATION = "unsupported-operation"
    TOO_LARGE = "too-large"
    NOT_FOUND = "not-found"
    SECURITY = "security"
    UNKNOWN = "unknown"


class WasiNNError(Exception):
    """Base of every wasinn error; ``code`` is the wasi-nn error code it maps to."""

    code: ErrorCode = ErrorCode.UNKNOWN

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def for_another_caller(self) -> WasiNNError:
        """A new error of this type, message and attributes, caused by this one: for each
        caller that shares one failure (one exception object raised in several tasks
        would collect all their tracebacks). The subclass's constructor is not called,
        so one that takes other arguments (a backend's own error) is copied too."""
        return self._copy(self.message)

    def prefixed(self, context: str) -> WasiNNError:
        """A new error of this type and attributes whose message is ``context: message``
        (where the failure happened, for a caller that would not know), caused by this
        one; copied as :meth:`for_another_caller` copies."""
        return self._copy(f"{context}: {self.message}")

    def suffixed(self, detail: str) -> WasiNNError:
        """A new error of this type and attributes whose message is ``message detail``
        (what the caller knows and the raiser did not), caused by this one; copied as
        :meth:`for_another_caller` copies."""
        return self._copy(f"{self.message} {detail}")

    def retold(self, message: str) -> WasiNNError:
        """A new error of this type and attributes whose message is ``message`` (what a
        caller who may not see the original is told), caused by this one; copied as
        :meth:`for_another_caller` copies."""
        return self._copy(message)

    def _copy(self, message: str) -> WasiNNError:
        error: WasiNNError = type(self).__new__(type(self), message)
        Exception.__init__(error, message)
        error.__dict__.update(self.__dict__)
        error.message = message
        error.__cause__ = self
        return error


class InvalidArgumentError(WasiNNError):
    code = ErrorCode.INVALID_ARGUMENT


class UnknownNameError(InvalidArgumentError):
    """A tensor name or position that the graph does not have: an invalid argument in the
    Python API. The guest ABIs report every unknown name, index or handle as not-found,
    so their bindings raise a NotFoundError with its message."""


class InvalidEncodingError(WasiNNError):
    code = ErrorCode.INVALID_ENCODING


class TimeoutError_(WasiNNError):
    code = ErrorCode.TIMEOUT


class BackendRuntimeError(WasiNNError):
    code = ErrorCode.RUNTIME_ERROR


class DeviceLostError(BackendRuntimeError):
    """A device this process can no longer use (a CUDA error that poisons the process's
    context, such as a device-side assert): the request that hit it failed, and so does
    every later request placed on that device until the process restarts."""


class UnsupportedOperationError(WasiNNError):
    code = ErrorCode.UNSUPPORTED_OPERATION


class TooLargeError(WasiNNError):
    """A tensor, buffer, queue or quota exceeded. ``retry_after`` is the number of seconds
    after which the same request may be accepted, where wasinn knows it (a caller held by
    a sandboxed model's crash back-off), as HTTP's ``Retry-After`` tells a client; None
    where it does not (a full queue drains as fast as the device runs, a tensor too large
    stays too large).

    ``bound_sizes`` is set when a run's outputs did not fit the buffers bound to them
    (``ExecutionContext.set_output``): for every bound output the run produced, by name,
    the bytes it needed and the bytes its buffer holds (:class:`BoundSize`), measured on
    that run (an output of dynamic shape may need more than the last one did), so that
    a caller can grow its buffers and run again; None for every other too-large."""

    code = ErrorCode.TOO_LARGE
    retry_after: float | None = None
    bound_sizes: Mapping[str, BoundSize] | None = None


class QueueFullError(TooLargeError):
    """A request refused because its device's queue holds ``queue_limit`` requests (or,
    on a fair pool, pushed out of it by another tenant's): unlike a tensor or buffer too
    large, the same request may be accepted once the queue drains, which it does as fast
    as the device runs (so ``retry_after`` is None)."""


class BoundSize(NamedTuple):
    """One bound output in a run refused as too large (``TooLargeError.bound_sizes``)."""

    needed: int  #: the output's bytes in that run
    held: int  #: the bytes of the buffer bound to it


class NotFoundError(WasiNNError):
    code = ErrorCode.NOT_FOUND


class ClosedResourceError(NotFoundError):
    """A graph, context or actor was used after it was closed, unloaded or finalized."""


class SecurityError(WasiNNError):
    code = ErrorCode.SECURITY


class UnknownError(WasiNNError):
    code = ErrorCode.UNKNOWN


_BY_CODE: dict[ErrorCode, type[WasiNNError]] = {
    ErrorCode.INVALID_ARGUMENT: InvalidArgumentError,
    ErrorCode.INVALID_ENCODING: InvalidEncodingError,
    ErrorCode.TIMEOUT: TimeoutError_,
    ErrorCode.RUNTIME_ERROR: BackendRuntimeError,
    ErrorCode.UNSUPPORTED_OPERATION: UnsupportedOperationError,
    ErrorCode.TOO_LARGE: TooLargeError,
    ErrorCode.NOT_FOUND: NotFoundError,
    ErrorCode.SECURITY: SecurityError,
    ErrorCode.UNKNOWN: UnknownError,
}


def error_for_code(code: ErrorCode) -> type[WasiNNError]:
    """The exception class that stands for ``code``."""
    return _BY_CODE[code]


#: Most characters of a caller's or guest's string that a message repeats (:func:`quoted`).
MAX_QUOTED_CHARS = 200


def quoted(text: str, limit: int = MAX_QUOTED_CHARS) -> str:
    """``text`` quoted (``repr``) for a message, cut after ``limit`` characters with a
    note of its full length: a guest's string can be as long as its memory."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}… ({len(text)} characters in all)"


#: The UTF-8 bytes of message :func:`bounded_message` keeps unless told otherwise (a
#: component guest's ``error`` resource keeps this many).
MAX_MESSAGE_BYTES = 4096


def bounded_message(message: str, limit: int = MAX_MESSAGE_BYTES) -> str:
    """``message`` when it is at most ``limit`` UTF-8 bytes; else its first and last
    ``limit // 2`` bytes (whole characters only) around a note of how many were elided.

    The end is kept because host messages put what was expected last ("... expected one
    of ...") while a long guest string sits in the middle.
    """
    if len(message) * 4 <= limit:  # no character is longer than 4 bytes in UTF-8
        return message
    data = message.encode("utf-8", "surrogatepass")
    if len(data) <= limit:
        return message
    half = limit // 2
    head = data[:half].decode("utf-8", "ignore")
    tail = data[-half:].decode("utf-8", "ignore")
    elided = len(data) - len(head.encode("utf-8", "surrogatepass")) - len(
        tail.encode("utf-8", "surrogatepass"))
    return f"{head}… ({elided} bytes elided) …{tail}"
