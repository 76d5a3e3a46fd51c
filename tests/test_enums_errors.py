from __future__ import annotations

import pytest

import wasinn
from wasinn import ErrorCode, ExecutionTarget, GraphEncoding, TensorType
from wasinn.errors import error_for_code


@pytest.mark.parametrize(
    ("enum", "name", "member"),
    [
        (GraphEncoding, "ONNX", GraphEncoding.ONNX),
        (GraphEncoding, "tensorflowlite", GraphEncoding.TENSORFLOWLITE),
        (ExecutionTarget, "gpu", ExecutionTarget.GPU),
        (ExecutionTarget, ExecutionTarget.TPU, ExecutionTarget.TPU),
        (TensorType, "BF16", TensorType.BF16),
    ],
)
def test_enums_accept_member_or_name(enum: type, name: object, member: object) -> None:
    assert enum.coerce(name) is member  # type: ignore[attr-defined]


def test_unknown_name_lists_expected_values() -> None:
    with pytest.raises(wasinn.InvalidArgumentError, match="expected one of cpu, gpu, tpu"):
        ExecutionTarget.coerce("fpga")


def test_every_error_code_has_exactly_one_leaf() -> None:
    leaves = {error_for_code(code) for code in ErrorCode}
    assert len(leaves) == len(ErrorCode)
    for code in ErrorCode:
        cls = error_for_code(code)
        assert issubclass(cls, wasinn.WasiNNError) and cls.code is code
        err = cls("what was wrong: expected something else")
        assert err.message == str(err)


def test_closed_is_not_found_but_distinguishable() -> None:
    assert issubclass(wasinn.ClosedResourceError, wasinn.NotFoundError)
    assert wasinn.ClosedResourceError.code is ErrorCode.NOT_FOUND


@pytest.mark.parametrize(("args", "message"), [
    ((0,), "Batching: max_batch must be an integer from 2 to 65536, got 0"),
    ((True,), "Batching: max_batch must be an integer from 2 to 65536, got True"),
    ((2.5,), "Batching: max_batch must be an integer from 2 to 65536, got 2.5"),
    ((65_537,), "Batching: max_batch must be an integer from 2 to 65536, got 65537"),
    ((4, -1.0), "Batching: max_delay must be between 0 and 10 seconds, got -1.0"),
    ((4, "1"), "Batching: max_delay must be between 0 and 10 seconds, got '1'"),
    ((4, float("nan")), "Batching: max_delay must be between 0 and 10 seconds, got nan"),
])
def test_bad_batching_bounds_are_invalid_arguments(args: tuple[object, ...],
                                                   message: str) -> None:
    with pytest.raises(wasinn.InvalidArgumentError) as caught:
        wasinn.Batching(*args)  # type: ignore[arg-type]
    assert caught.value.message == message
    assert caught.value.code is ErrorCode.INVALID_ARGUMENT
    assert isinstance(caught.value, ValueError)  # what it raised before: still caught
    assert type(caught.value) is wasinn.BatchingError  # a public type, not a private one


def test_batching_bounds_may_be_numpy_numbers() -> None:
    import numpy as np

    batching = wasinn.Batching(np.int64(4), np.float32(0.5))  # type: ignore[arg-type]
    assert (batching.max_batch, batching.max_delay) == (4, 0.5)
    assert type(batching.max_batch) is int and type(batching.max_delay) is float
    with pytest.raises(wasinn.BatchingError, match=r"got (np\.)?True"):
        wasinn.Batching(np.bool_(True))  # type: ignore[arg-type]


class _BackendsOwnError(wasinn.BackendRuntimeError):
    """A third-party backend's error whose constructor takes other arguments."""

    def __init__(self, op: str, status: int) -> None:
        super().__init__(f"{op} failed with status {status}")
        self.op, self.status = op, status


@pytest.mark.parametrize("error", [wasinn.TimeoutError_("cpu: too slow"),
                                   _BackendsOwnError("conv", 7)],
                         ids=["wasinn's", "a backend's own"])
def test_a_shared_failure_is_copied_for_each_caller(error: wasinn.WasiNNError) -> None:
    # One compile or batch failure reaches several callers: each raises its own copy.
    # Before, type(error)(error.message) raised TypeError for a different constructor.
    copy = error.for_another_caller()
    assert copy is not error and type(copy) is type(error)
    assert (str(copy), copy.message, copy.code) == (str(error), error.message, error.code)
    assert copy.__cause__ is error and vars(copy) == vars(error)
