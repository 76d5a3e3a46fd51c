"""The public surface of `wasinn`: declared once in __init__, every name resolvable."""

from __future__ import annotations

import wasinn
import wasinn.backends

PUBLIC = {
    # core types
    "Tensor", "TensorType", "GraphEncoding", "ExecutionTarget", "host_copies", "__version__",
    # the async API
    "Runtime", "Graph", "ExecutionContext", "Pipeline", "RuntimeConfig", "Batching",
    # the error tree
    "WasiNNError", "ErrorCode", "InvalidArgumentError", "InvalidEncodingError", "TimeoutError_",
    "BackendRuntimeError", "BatchingError", "UnsupportedOperationError", "TooLargeError",
    "NotFoundError", "ClosedResourceError", "SecurityError", "UnknownError", "ConfigError",
    "UnknownNameError", "DeviceLostError",
}


def test_all_is_the_declared_surface() -> None:
    assert set(wasinn.__all__) == PUBLIC
    assert len(wasinn.__all__) == len(set(wasinn.__all__))


def test_every_public_name_resolves() -> None:
    for name in wasinn.__all__:
        assert getattr(wasinn, name) is not None, name
    assert set(wasinn.__all__) <= set(dir(wasinn))


def test_public_classes_claim_wasinn_as_home() -> None:
    for name in ("Runtime", "Graph", "ExecutionContext", "Pipeline", "Tensor"):
        assert getattr(wasinn, name).__module__.startswith("wasinn."), name


def test_errors_are_one_tree() -> None:
    for name in wasinn.__all__:
        obj = getattr(wasinn, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, wasinn.WasiNNError), name


def test_backends_surface() -> None:
    for name in wasinn.backends.__all__:
        assert hasattr(wasinn.backends, name), name
    assert {"Backend", "CompiledGraph", "BackendRegistry", "Device", "TensorSpec"} <= set(
        wasinn.backends.__all__)


def test_unknown_attribute_is_an_attribute_error() -> None:
    try:
        wasinn.no_such_name  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("expected AttributeError")
