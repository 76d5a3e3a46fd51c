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
