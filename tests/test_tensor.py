from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import wasinn
from wasinn import InvalidArgumentError, Tensor, TensorType
from wasinn.tensor import as_tensor, check_dims, numpy_dtype, tensor_type_of

ALL_TYPES = list(TensorType)


@pytest.mark.parametrize("ttype", ALL_TYPES)
def test_numpy_round_trip_is_zero_copy(ttype: TensorType) -> None:
    arr = np.arange(12).astype(numpy_dtype(ttype)).reshape(3, 4)
    t = Tensor.from_numpy(arr)
    assert t.type is ttype and t.dims == (3, 4) and t.nbytes == arr.nbytes
    assert np.shares_memory(t.numpy(), arr)


@pytest.mark.parametrize("ttype", ALL_TYPES)
def test_from_bytes_views_the_buffer(ttype: TensorType) -> None:
    src = np.arange(6).astype(numpy_dtype(ttype))
    buf = bytearray(src.tobytes())
    t = Tensor.from_bytes([2, 3], ttype.value, buf)
    np.testing.assert_array_equal(t.numpy().reshape(-1), src)
    buf[0:ttype.itemsize] = b"\x00" * ttype.itemsize  # a view, not a copy
    assert t.numpy().reshape(-1)[0] == 0


def test_bf16_carrier_is_ml_dtypes() -> None:
    assert numpy_dtype(TensorType.BF16) == np.dtype(ml_dtypes.bfloat16)
    assert tensor_type_of(ml_dtypes.bfloat16) is TensorType.BF16


def test_from_bytes_rejects_wrong_size_with_expected_size() -> None:
    with pytest.raises(InvalidArgumentError, match=r"10 bytes .* need 24 bytes"):
        Tensor.from_bytes([2, 3], "f32", bytes(10))


def test_unsupported_dtype_names_the_expected_types() -> None:
    with pytest.raises(InvalidArgumentError, match=r"complex128.*expected one of f16"):
        Tensor.from_numpy(np.zeros(2, np.complex128))


def test_dims_validation() -> None:
    with pytest.raises(InvalidArgumentError, match="non-negative"):
        check_dims([2, -1])
    with pytest.raises(InvalidArgumentError, match="rank 33"):
        check_dims([1] * 33)


def test_native_tensor_materializes_once_and_is_counted() -> None:
    calls = []

    def materialize() -> np.ndarray:
        calls.append(1)
        return np.ones((2, 2), np.float32)

    t = Tensor.from_native(
        object(), (2, 2), TensorType.F32, device="gpu:0", materialize=materialize
    )
    assert not t.is_host and t.device == "gpu:0"
    before = wasinn.host_copies()
    np.testing.assert_array_equal(t.numpy(), np.ones((2, 2)))
    t.numpy()
    assert calls == [1]
    assert wasinn.host_copies() == before + 1


def test_slice_rows_shares_data_or_says_it_cannot() -> None:
    host = Tensor.from_numpy(np.arange(12, dtype=np.float32).reshape(4, 3))
    piece = host.slice_rows(1, 3)
    assert piece is not None and piece.dims == (2, 3)
    assert np.shares_memory(piece.numpy(), host.numpy())
    np.testing.assert_array_equal(piece.numpy(), host.numpy()[1:3])

    uncuttable = Tensor.from_native(object(), (4, 3), TensorType.F32, device="gpu:0",
                                    materialize=lambda: np.zeros((4, 3), np.float32))
    assert uncuttable.slice_rows(0, 1) is None

    cut: list[tuple[int, int]] = []

    def rows(start: int, stop: int) -> Tensor:
        cut.append((start, stop))
        return Tensor.from_native(object(), (stop - start, 3), TensorType.F32,
                                  device="gpu:0", materialize=lambda: np.zeros((1, 3)))

    before = wasinn.host_copies()
    native = Tensor.from_native(object(), (4, 3), TensorType.F32, device="gpu:0",
                                materialize=lambda: np.zeros((4, 3), np.float32), rows=rows)
    native.numpy()  # materialized or not, its rows stay on the device
    kept = native.slice_rows(2, 4)
    assert kept is not None and kept.dims == (2, 3) and kept.device == "gpu:0"
    assert not kept.is_host and cut == [(2, 4)]
    assert wasinn.host_copies() == before + 1


def test_as_tensor_accepts_tensor_and_arrays() -> None:
    t = Tensor.from_numpy(np.zeros(3, np.int64))
    assert as_tensor(t) is t
    assert as_tensor([1.0, 2.0]).type is TensorType.F64
