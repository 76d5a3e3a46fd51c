"""wasinn: an async, actor-based, multi-device wasi-nn host.

The public surface is declared here and guarded by ``tests/test_exports.py``.
Importing wasinn imports no backend library; each is imported on first use.
"""

from wasinn._version import __version__
from wasinn.enums import ExecutionTarget, GraphEncoding, TensorType
from wasinn.errors import (
    BackendRuntimeError,
    ClosedResourceError,
    ErrorCode,
    InvalidArgumentError,
    InvalidEncodingError,
    NotFoundError,
    SecurityError,
    TimeoutError_,
    TooLargeError,
    UnknownError,
    UnsupportedOperationError,
    WasiNNError,
)
from wasinn.tensor import Tensor, host_copies

__all__ = [
    "BackendRuntimeError",
    "ClosedResourceError",
    "ErrorCode",
    "ExecutionTarget",
    "GraphEncoding",
    "InvalidArgumentError",
    "InvalidEncodingError",
    "NotFoundError",
    "SecurityError",
    "Tensor",
    "TensorType",
    "TimeoutError_",
    "TooLargeError",
    "UnknownError",
    "UnsupportedOperationError",
    "WasiNNError",
    "__version__",
    "host_copies",
]
