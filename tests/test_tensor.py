from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

import wasinn
from tests.support import require_backend
from wasinn import InvalidArgumentError, Tensor, TensorType
from wasinn.tensor import as_tensor, c_contiguous, check_dims, numpy_dtype, tensor_type_of

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
    # (a negative dimension: test_dimensions_must_be_integers_not_truncated)
    with pytest.raises(InvalidArgumentError, match="rank 33"):
        check_dims([1] * 33)
    with pytest.raises(InvalidArgumentError, match="rank 33"):
        Tensor.from_numpy(np.zeros((1,) * 33, np.float32))
    # An empty tensor whose other dimensions numpy cannot index (it raised ValueError).
    for dims in ([2**64, 0], [2**32 - 1, 2**32 - 1, 0]):
        with pytest.raises(InvalidArgumentError, match=r"are too large: expected the product "
                                                       r"of the non-zero ones at most"):
            Tensor.from_bytes(dims, "u8", b"")
    assert Tensor.from_bytes([2**40, 0], "u8", b"").dims == (2**40, 0)
    # The bytes count, not the elements: numpy refuses [0, 2**61] of f64 too.
    with pytest.raises(InvalidArgumentError, match=r"non-zero ones times the element size "
                                                   r"\(8 bytes\) at most 9223372036854775807, "
                                                   r"even for an empty tensor"):
        Tensor.from_bytes([0, 2**61], "f64", b"")
    assert Tensor.from_bytes([0, 2**62], "u8", b"").dims == (0, 2**62)


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


@pytest.mark.parametrize("value", [
    np.array(3.0, np.float32),  # zero-copy
    np.float32(3),  # a numpy scalar
    np.array(3.0, ">f4"),  # the other byte order: converted
    np.broadcast_to(np.float32(3), ()),  # read-only
], ids=["0-d", "numpy-scalar", "big-endian", "read-only"])
def test_a_0d_array_or_numpy_scalar_is_a_rank_0_tensor(value: object) -> None:
    t = Tensor.from_numpy(value)  # type: ignore[arg-type]
    assert (t.dims, t.type) == ((), TensorType.F32)
    assert t.numpy().shape == () and t.numpy().flags.c_contiguous
    assert float(t.numpy()) == 3.0 and t.tobytes() == np.float32(3).tobytes()
    assert Tensor.from_bytes(t.dims, t.type, t.tobytes()).numpy().shape == ()


def test_a_native_scalar_materializes_as_a_0d_array() -> None:
    t = Tensor.from_native(object(), (), TensorType.F32, device="gpu:0",
                           materialize=lambda: np.array(3.0, np.float32))
    assert t.dims == () and t.numpy().shape == () and float(t.numpy()) == 3.0


def test_c_contiguous_keeps_rank_and_copies_only_when_needed() -> None:
    scalar = np.array(3.0, np.float32)
    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert c_contiguous(scalar) is scalar and c_contiguous(rows) is rows
    strided = c_contiguous(rows[:, ::2])
    assert strided.flags.c_contiguous and strided.shape == (3, 2)
    np.testing.assert_array_equal(strided, rows[:, ::2])


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


@pytest.mark.parametrize("order", [">", "<"])
def test_arrays_in_either_byte_order_hold_their_values(order: str) -> None:
    # A big-endian array (a .npy saved on a big-endian machine) is converted to native
    # order (a copy): the backends read raw native bytes, and tobytes is little-endian.
    values = np.arange(6, dtype=np.float32).reshape(2, 3)
    foreign = values.astype(f"{order}f4")
    for tensor in (Tensor.from_numpy(foreign), as_tensor(foreign),
                   Tensor.from_numpy(foreign.T.copy().T)):  # non-contiguous too
        assert tensor.type is TensorType.F32 and tensor.dims == (2, 3)
        array = tensor.numpy()
        assert array.dtype == np.float32 and array.dtype.isnative
        assert array.flags.c_contiguous
        np.testing.assert_array_equal(array, values)
        assert tensor.tobytes() == values.astype("<f4").tobytes()
    big = np.arange(3, dtype=">i8")
    assert Tensor.from_numpy(big).numpy().tolist() == [0, 1, 2]
    assert Tensor.from_numpy(big).tobytes() == np.arange(3, dtype="<i8").tobytes()
    native = np.ones(4, np.float32)
    assert Tensor.from_numpy(native).numpy() is native  # native and contiguous: no copy


@pytest.mark.parametrize(("value", "message"), [
    ([[1.0], [1.0, 2.0]], "cannot make a tensor of a list: expected a wasinn.Tensor, a "
                          "numpy array or a nested list of numbers of one shape"),
    ([1.0, [2.0]], "cannot make a tensor of a list"),
    (object(), "numpy dtype object has no wasi-nn element type"),
    ("abc", "numpy dtype <U3 has no wasi-nn element type"),
    (np.array([1, "a"], dtype=object), "numpy dtype object has no wasi-nn element type"),
])
def test_values_with_no_tensor_form_are_invalid_arguments(value: object, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        Tensor.from_numpy(value)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        as_tensor(value)  # type: ignore[arg-type]


@pytest.mark.parametrize(("dims", "message"), [
    ([2, 2.7], "tensor dimensions [2, 2.7]: 2.7 (float) is not an integer"),
    ([2.0], "2.0 (float) is not an integer"),
    ([2, "a"], "'a' (str) is not an integer"),
    ([None], "None (NoneType) is not an integer"),
    ([2, -1], "-1 (int) is negative"),
    ([True, 8], "tensor dimensions [True, 8]: True (bool) is a boolean"),
    ([2, np.True_], "np.True_ (bool) is not an integer"),
    (4, "tensor dimensions 4 (int): expected a sequence"),
    ("22", "tensor dimensions '22' (str): expected a sequence"),
    (None, "tensor dimensions None (NoneType): expected a sequence"),
])
def test_dimensions_must_be_integers_not_truncated(dims: object, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=re.escape(message)) as caught:
        check_dims(dims)  # type: ignore[arg-type]
    assert "expected a sequence of at most 32 non-negative integers" in caught.value.message
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        Tensor.from_bytes(dims, "f32", bytes(16))  # type: ignore[arg-type]
    assert check_dims([np.int64(2), np.uint8(3), 0]) == (2, 3, 0)
    assert all(type(d) is int for d in check_dims(np.array([2, 3])))


@pytest.mark.parametrize(("data", "message"), [
    ("abcdabcdabcdabcd", "tensor data is str: expected a bytes-like object"),
    (16, "tensor data is int: expected a bytes-like object"),
    (None, "tensor data is NoneType: expected a bytes-like object"),
    (np.array([b"x"] * 16, dtype=object), "numpy array of object: expected bytes"),
])
def test_from_bytes_refuses_data_that_is_no_bytes(data: object, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        Tensor.from_bytes([4], "f32", data)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="unknown tensor type"):
        Tensor.from_bytes([4], "f33", bytes(16))


def test_from_bytes_reads_strided_buffers_through_their_strides() -> None:
    values = np.arange(8, dtype=np.float32)
    strided = memoryview(values)[::2]  # not contiguous: read (copied) element by element
    assert Tensor.from_bytes([4], "f32", strided).numpy().tolist() == [0, 2, 4, 6]
    column = values.reshape(4, 2)[:, 0]  # a non-contiguous array: copied
    assert Tensor.from_bytes([4], "f32", column).numpy().tolist() == [0, 2, 4, 6]
    raw = bytearray(values.tobytes())
    viewed = Tensor.from_bytes([2, 4], "f32", raw)  # contiguous: a view, no copy
    raw[:4] = np.float32(9).tobytes()
    assert viewed.numpy()[0, 0] == 9


def test_a_value_whose_conversion_raises_a_library_error_is_invalid_argument() -> None:
    require_backend("torch")
    import torch

    # Before: "cannot make a tensor of a Tensor", which read as wasinn's Tensor refused,
    # with no word of how to give it.
    hint = ("; give a torch tensor as tensor.detach().cpu().numpy(), a bf16 one as "
            "tensor.detach().cpu().view(torch.int16).numpy().view(ml_dtypes.bfloat16) (")
    for tensor in (torch.ones(2, requires_grad=True),  # numpy() refuses: a RuntimeError
                   torch.ones(2, dtype=torch.bfloat16)):  # numpy has no bf16
        with pytest.raises(InvalidArgumentError) as caught:
            as_tensor(tensor)
        assert caught.value.message.startswith(
            "cannot make a tensor of a torch.Tensor: expected a wasinn.Tensor, a numpy "
            "array or a nested list of numbers of one shape" + hint), caught.value.message
    bf16 = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    given = as_tensor(bf16.detach().cpu().view(torch.int16).numpy().view(ml_dtypes.bfloat16))
    assert (given.type, given.numpy().astype(np.float32).tolist()) == (TensorType.BF16,
                                                                        [1.5, -2.0])


def test_the_constructor_refuses_an_array_of_another_element_type_or_shape() -> None:
    # Before, Tensor((2, 4), F64, array=<f32 array>) was built as it was told: OpenVINO
    # then read the f32 array's 32 bytes as 64 (past its end), and a shape that was not
    # the array's reached the scheduler's input checks as if it were.
    small = np.ones((2, 4), np.float32)
    with pytest.raises(InvalidArgumentError, match=r"^tensor of f64 over an array of float32: "
                       r"expected an array of float64 \(or Tensor.from_numpy"):
        Tensor((2, 4), TensorType.F64, array=small)
    with pytest.raises(InvalidArgumentError, match=r"^tensor dimensions \[8\] over an array "
                       r"of shape \[2, 4\]: expected the array's own shape$"):
        Tensor((8,), TensorType.F32, array=small)
    with pytest.raises(InvalidArgumentError, match=r"^tensor element type 'f32' \(str\): "
                       r"expected a wasinn.TensorType$"):
        Tensor((2, 4), "f32", array=small)  # type: ignore[arg-type]


def test_the_constructor_takes_any_strides_or_byte_order_and_a_list_of_dims() -> None:
    # Kept as from_numpy keeps them: C-contiguous, in native order. Before, the array was
    # kept as given: ONNX Runtime read a big-endian one's bytes as native (2.0 became
    # 9.2e-41) and torch refused it, and tobytes() was big-endian.
    strided = np.arange(16, dtype=np.float32).reshape(2, 8)[:, ::2]
    swapped = np.arange(8, dtype=">f4").reshape(2, 4)
    fortran = np.asfortranarray(np.arange(8, dtype=np.float32).reshape(2, 4))
    for array in (strided, swapped, fortran):
        tensor = Tensor((2, 4), TensorType.F32, array=array)
        kept = tensor.numpy()
        assert kept.flags.c_contiguous and kept.dtype.isnative
        np.testing.assert_array_equal(kept, array)
        assert tensor.tobytes() == array.astype("<f4").tobytes()
    scalar = Tensor((), TensorType.F32, array=np.array(2.5, ">f4"))
    assert scalar.numpy().shape == () and scalar.numpy() == 2.5
    listed = Tensor([2, 4], TensorType.F32, array=swapped)  # type: ignore[arg-type]
    assert listed.dims == (2, 4) and type(listed.dims) is tuple
    native = np.ones((2, 4), np.float32)
    assert Tensor((2, 4), TensorType.F32, array=native).numpy() is native  # no copy


def test_int64_arrays_numpy_counts_equal_are_kept_as_int64() -> None:
    # numpy counts longlong ('q', what ONNX Runtime returns for int64) equal to int64
    # ('l'); OpenVINO refused it ("Unsupported data type: int64"). Relabelled, not copied.
    values = np.array([1, -2, 3], np.longlong)
    for tensor in (Tensor((3,), TensorType.I64, array=values), Tensor.from_numpy(values)):
        kept = tensor.numpy()
        assert kept.dtype is np.dtype(np.int64) and kept.dtype.char == "l"
        assert np.shares_memory(kept, values) and kept.tolist() == [1, -2, 3]
    native = Tensor.from_native(object(), (3,), TensorType.I64, device="cpu",
                                materialize=lambda: values)
    assert native.numpy().dtype is np.dtype(np.int64)


def test_dims_given_as_equal_floats_are_kept_as_the_arrays_ints() -> None:
    tensor = Tensor((1.0, 4.0), TensorType.F32,  # type: ignore[arg-type]
                    array=np.ones((1, 4), np.float32))
    assert tensor.dims == (1, 4) and all(type(d) is int for d in tensor.dims)


def test_the_constructor_takes_dims_as_a_numpy_array_as_from_bytes_does() -> None:
    # Before, ``array.shape != dims`` compared elementwise and numpy raised its bare
    # "truth value of an array ... is ambiguous" ValueError, or a broadcast error.
    values = np.ones((2, 4), np.float32)
    dims: object = np.array([2, 4])
    assert Tensor(dims, TensorType.F32, array=values).dims == (2, 4)  # type: ignore[arg-type]
    for dims in (np.array([4, 2]), np.array([2, 4, 1])):
        with pytest.raises(InvalidArgumentError, match=r"^tensor dimensions \[(4, 2|2, 4, 1)\] "
                           r"over an array of shape \[2, 4\]: expected the array's own shape"):
            Tensor(dims, TensorType.F32, array=values)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="is negative"):
        Tensor([2, -4], TensorType.F32, array=values)  # type: ignore[arg-type]


def test_a_tensor_without_data_is_refused_when_made() -> None:
    # Before, it was made (its repr said native@cpu) and every backend failed the compute
    # with "tensor has neither host data nor a materializer", naming no input.
    with pytest.raises(InvalidArgumentError, match=r"^a tensor of f32 \[2, 4\] needs its data: "
                       r"expected array=\.\.\. \(or Tensor.from_numpy / Tensor.from_bytes\)$"):
        Tensor((2, 4), TensorType.F32)


def test_the_array_of_a_native_value_is_read_only() -> None:
    # Some libraries' values numpy() copies, others it shows over their memory: an edit
    # reached some graphs the tensor was passed to and not others (see below).
    made = np.arange(4, dtype=np.float32)
    native = Tensor.from_native(object(), (4,), TensorType.F32, device="cpu",
                                materialize=lambda: made)
    array = native.numpy()
    assert not array.flags.writeable and array.tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="read-only"):
        array[0] = 100
    assert made.flags.writeable  # (the library's own array is left as it was)
    editable = array.copy()
    editable[0] = 100
    assert native.numpy().tolist() == [0, 1, 2, 3]
    assert Tensor.from_numpy(made).numpy().flags.writeable  # the caller's own array


async def test_an_edit_cannot_make_a_kept_openvino_output_feed_graphs_different_values(
        ) -> None:
    # An OpenVINO output kept on the CPU: numpy() is a copy. Edited, ONNX Runtime was
    # given the edited copy (the tensor's host data) while OpenVINO read the ov.Tensor's
    # memory, unedited: the result depended on the consuming library.
    require_backend("openvino")
    require_backend("onnxruntime")
    from wasinn.modelgen import affine_onnx

    async with wasinn.Runtime() as rt:
        producer = await rt.load([affine_onnx(2.0, 1.0)], "onnx", backend="openvino")
        consumers = [await rt.load([affine_onnx(1.0, 0.0)], "onnx", backend=name)
                     for name in ("onnxruntime", "openvino")]
        out = await producer.compute({"x": np.ones((1, 4), np.float32)}, keep_on_device=True)
        kept = out["y"]
        assert kept.native is not None
        with pytest.raises(ValueError, match="read-only"):
            kept.numpy()[:] = 100.0
        for consumer in consumers:
            result = await consumer.compute({"x": kept}, keep_on_device=False)
            assert result["y"].numpy().tolist() == [[3.0] * 4]


def test_whole_number_float_dims_are_taken_whatever_holds_them() -> None:
    # A tuple of floats passed the quick check while a list of them, or the same tuple
    # over a strided array, went to check_dims, which refuses floats.
    strided = np.ones((2, 6), np.float32)[:, ::2]
    for dims in ((2.0, 3), [2.0, 3], np.array([2.0, 3.0])):
        for array in (np.ones((2, 3), np.float32), strided):
            tensor = Tensor(dims, TensorType.F32, array=array)  # type: ignore[arg-type]
            assert tensor.dims == (2, 3) and all(type(d) is int for d in tensor.dims)
    with pytest.raises(InvalidArgumentError, match=r"2.5 \(float\) is not an integer"):
        Tensor([2.5, 3], TensorType.F32, array=np.ones((2, 3), np.float32))  # type: ignore[arg-type]
