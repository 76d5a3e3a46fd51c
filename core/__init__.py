"""wasinn: an async, actor-based, multi-device wasi-nn host.

The public surface is declared here and guarded by ``tests/test_exports.py``.
Importing wasinn imports no backend library; each is imported on first use.
"""

from typing import TYPE_CHECKING, Any

from wasinn._version import __version__
from wasinn.configs import ConfigError
from wasinn.enums import ExecutionTarget, GraphEncoding, TensorType
from wasinn.errors import (
    BackendRuntimeError,
    ClosedResourceError,
    DeviceLostError,
    ErrorCode,
    InvalidArgumentError,
    InvalidEncodingError,
    NotFoundError,
    QueueFullError,
    SecurityError,
    TimeoutError_,
    TooLargeError,
    UnknownError,
    UnknownNameError,
    UnsupportedOperationError,
    WasiNNError,
)
from wasinn.tensor import Tensor, host_copies

if TYPE_CHECKING:
    # (The aliases mark re-exports, which mypy --strict would refuse to see otherwise.)
    from wasinn import actors as actors
    from wasinn import backends as backends
    from wasinn import host as host
    from wasinn import modelgen as modelgen
    from wasinn import scheduler as scheduler
    from wasinn.actors.batching import Batching, BatchingError
    from wasinn.configs.schema import RuntimeConfig
    from wasinn.host.runner import GuestTrap
    from wasinn.scheduler import ExecutionContext, Graph, Pipeline, Runtime

# The scheduler (which imports trio), the config schema (pydantic) and the guest runner
# (wasmtime) are resolved on first access, so that `import wasinn` stays cheap for code
# that only needs the types.
_LAZY = {
    "Batching": "wasinn.actors.batching",
    "BatchingError": "wasinn.actors.batching",
    "ExecutionContext": "wasinn.scheduler",
    "Graph": "wasinn.scheduler",
    "GuestTrap": "wasinn.host.runner",
    "Pipeline": "wasinn.scheduler",
    "Runtime": "wasinn.scheduler",
    "RuntimeConfig": "wasinn.configs.schema",
}

#: The subpackages and modules ``wasinn.X`` reaches after a bare ``import wasinn``
#: (``wasinn.backends.LoadOptions``), each imported on first access: none imports a
#: backend's library.
_SUBMODULES = frozenset({"actors", "backends", "configs", "enums", "errors", "host",
                         "modelgen", "scheduler", "tensor"})


if not TYPE_CHECKING:
    # Hidden from type checkers, which see the imports above instead: a module
    # ``__getattr__`` would make them type every misspelt ``wasinn.X`` as Any.

    def __getattr__(name: str) -> Any:
        import importlib

        if name in _SUBMODULES:  # (importing it sets it here, as any submodule import)
            return importlib.import_module(f"wasinn.{name}")
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module 'wasinn' has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(globals()) | set(_LAZY) | _SUBMODULES)


__all__ = [
    "BackendRuntimeError",
    "Batching",
    "BatchingError",
    "ClosedResourceError",
    "ConfigError",
    "DeviceLostError",
    "ErrorCode",
    "ExecutionContext",
    "ExecutionTarget",
    "Graph",
    "GraphEncoding",
    "GuestTrap",
    "InvalidArgumentError",
    "InvalidEncodingError",
    "NotFoundError",
    "Pipeline",
    "QueueFullError",
    "Runtime",
    "RuntimeConfig",
    "SecurityError",
    "Tensor",
    "TensorType",
    "TimeoutError_",
    "TooLargeError",
    "UnknownError",
    "UnknownNameError",
    "UnsupportedOperationError",
    "WasiNNError",
    "__version__",
    "host_copies",
]
