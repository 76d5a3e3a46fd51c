"""The legacy ABI's numbering and the bounds-checked guest memory, without a guest."""

from __future__ import annotations

import struct
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from wasinn import (
    ErrorCode,
    ExecutionTarget,
    GraphEncoding,
    InvalidArgumentError,
    InvalidEncodingError,
    TensorType,
    UnsupportedOperationError,
)
from wasinn.backends import TensorSpec
from wasinn.errors import error_for_code
from wasinn.host.abi import (
    Errno,
    ModelNotFoundError,
    decode_encoding,
    decode_target,
    decode_tensor_type,
    errno_of,
)
from wasinn.host.guest_memory import (
    MAX_NAME_BYTES,
    GuestMemory,
    TensorRecord,
    check_apart,
    u32,
)
from wasinn.host.tensor_binding import check_against_spec, copy_bytes, static_nbytes


def test_witx_encoding_numbers_differ_from_wit() -> None:
    assert decode_encoding(5) is GraphEncoding.AUTODETECT
    assert decode_encoding(6) is GraphEncoding.GGML
    assert [decode_encoding(n) for n in range(5)] == [
        GraphEncoding.OPENVINO, GraphEncoding.ONNX, GraphEncoding.TENSORFLOW,
        GraphEncoding.PYTORCH, GraphEncoding.TENSORFLOWLITE]


def test_wasmedge_encodings_are_unsupported_and_unknown_ones_invalid() -> None:
    with pytest.raises(UnsupportedOperationError, match="whisper"):
        decode_encoding(9)
    with pytest.raises(InvalidEncodingError, match="unknown graph encoding 4294967295"):
        decode_encoding(-1)


def test_targets() -> None:
    assert decode_target(1) is ExecutionTarget.GPU
    with pytest.raises(InvalidArgumentError, match="expected one of 0=cpu, 1=gpu, 2=tpu"):
        decode_target(3)


@pytest.mark.parametrize(
    ("number", "dims", "data_len", "expected"),
    [
        (1, (1, 4), 16, TensorType.F32),
        (3, (2, 2), 4, TensorType.U8),
        (2, (2, 2), 32, TensorType.F64),
        (2, (2, 2), 4, TensorType.U8),       # Rust wasi-nn <= 0.5: u8 = 2
        (3, (3,), 12, TensorType.I32),       # Rust wasi-nn <= 0.5: i32 = 3
        (0x100301, (4,), 16, TensorType.F32),  # garbage in the padding bytes
        (0x101002, (4,), 32, TensorType.F64),
        (6, (2,), 4, TensorType.BF16),
    ],
)
def test_tensor_type_tables(number: int, dims: tuple[int, ...], data_len: int,
                            expected: TensorType) -> None:
    assert decode_tensor_type(number, dims, data_len) is expected


def test_tensor_type_mismatch_says_what_was_expected() -> None:
    with pytest.raises(InvalidArgumentError, match="need 16 bytes"):
        decode_tensor_type(1, (1, 4), 15)
    with pytest.raises(InvalidArgumentError, match="unknown tensor type 9"):
        decode_tensor_type(9, (1,), 1)


def test_every_error_code_has_an_errno() -> None:
    for code in ErrorCode:
        assert errno_of(error_for_code(code)("x")) != Errno.SUCCESS
    assert errno_of(ModelNotFoundError("gone")) == 103
    assert errno_of(error_for_code(ErrorCode.TOO_LARGE)("x")) == 7
    assert errno_of(error_for_code(ErrorCode.NOT_FOUND)("x")) == 8


def _memory(size: int = 256) -> GuestMemory:
    return GuestMemory(np.zeros(size, dtype=np.uint8))


def test_u32_masks_signed_arguments() -> None:
    assert u32(-1) == 0xFFFFFFFF
    assert u32(-2147483648) == 0x80000000


@pytest.mark.parametrize(("ptr", "length"), [(250, 8), (-4, 4), (0, -1), (256, 1),
                                              (0x7FFFFFFF, 2)])
def test_spans_outside_memory_are_invalid_arguments(ptr: int, length: int) -> None:
    with pytest.raises(InvalidArgumentError, match="outside guest memory"):
        _memory().span(ptr, length)


def test_span_is_a_writable_view() -> None:
    mem = _memory()
    mem.span(10, 4)[:] = 7
    assert mem.read_u32(10) == 0x07070707
    mem.write_u32(20, 0xDEADBEEF)
    assert bytes(mem.data[20:24]) == struct.pack("<I", 0xDEADBEEF)
    assert mem.span(256, 0).size == 0  # an empty span at the very end is fine


def test_strings_must_be_utf8() -> None:
    mem = _memory()
    mem.data[0:4] = list(b"ab\xffc")
    mem.data[8:13] = list("héé".encode())
    assert mem.read_str(8, 5) == "héé"
    with pytest.raises(InvalidArgumentError, match="not valid UTF-8"):
        mem.read_str(0, 4, "model name")


def test_names_are_bounded_before_they_are_read() -> None:
    mem = GuestMemory(np.full(2 * MAX_NAME_BYTES, ord("n"), dtype=np.uint8))
    assert mem.read_str(0, MAX_NAME_BYTES) == "n" * MAX_NAME_BYTES
    with pytest.raises(InvalidArgumentError,
                       match=f"^input name is {MAX_NAME_BYTES + 1} bytes long: expected at "
                             f"most {MAX_NAME_BYTES} bytes of UTF-8"):
        mem.read_str(0, MAX_NAME_BYTES + 1, "input name")
    with pytest.raises(InvalidArgumentError, match="is 4294967295 bytes long"):
        mem.read_str(0, -1)


@pytest.mark.parametrize(("buffer", "length", "written", "apart"), [
    (0x100, 16, 0x110, True), (0x100, 16, 0xFC, True),     # right after, right before
    (0x100, 0, 0x100, True),                               # an empty buffer holds nothing
    (0x100, 16, 0x10C, False), (0x100, 16, 0xFD, False), (0x100, 16, 0x104, False),
    (-16, 16, -4, False),                                  # u32s as wasmtime passes them
])
def test_bytes_written_must_lie_outside_the_output_buffer(buffer: int, length: int,
                                                          written: int, apart: bool) -> None:
    if apart:
        check_apart(buffer, length, written, "output buffer")
    else:
        with pytest.raises(InvalidArgumentError, match="expected the 4-byte size outside"):
            check_apart(buffer, length, written, "output buffer")


def _record(mem: GuestMemory, at: int, dims_ptr: int, dims: list[int], type_field: int,
            data_ptr: int, data_len: int) -> None:
    mem.data[dims_ptr:dims_ptr + 4 * len(dims)] = np.frombuffer(
        struct.pack(f"<{len(dims)}I", *dims), np.uint8)
    mem.data[at:at + 20] = np.frombuffer(
        struct.pack("<5I", dims_ptr, len(dims), type_field, data_ptr, data_len), np.uint8)


def test_tensor_record_decoding() -> None:
    mem = _memory()
    _record(mem, 0, 40, [1, 2, 2], 0x00AB0303, 100, 4)  # u8 with garbage padding
    record = mem.tensor(0)
    assert record.dims == (1, 2, 2)
    assert record.type is TensorType.U8
    assert (record.data_ptr, record.data_len) == (100, 4)


@pytest.mark.parametrize(
    ("dims_ptr", "dims", "type_field", "data_ptr", "data_len", "message"),
    [
        (40, [1, 4], 1, 240, 32, "tensor data .* outside guest memory"),
        (248, [1, 4, 4], 1, 100, 64, "tensor dimensions .* outside guest memory"),
        (40, [1] * 33, 3, 100, 1, "rank 33 is too large"),
        (40, [65536, 65536, 65536], 3, 100, 4, "need 281474976710656 bytes"),
        # no element, but no numpy shape either
        (40, [0, 2**32 - 1, 2**32 - 1], 1, 100, 0, r"dimensions \[0, 4294967295, 4294967295\] "
                                                  "are too large: expected the product"),
    ],
)
def test_bad_tensor_records(dims_ptr: int, dims: list[int], type_field: int, data_ptr: int,
                            data_len: int, message: str) -> None:
    mem = GuestMemory(np.zeros(256 + 4 * 33, dtype=np.uint8))
    _record(mem, 0, dims_ptr, dims, type_field, data_ptr, data_len)
    with pytest.raises(InvalidArgumentError, match=message):
        GuestMemory(mem.data[:256]).tensor(0)


def test_builders_array() -> None:
    mem = _memory()
    mem.data[0:16] = np.frombuffer(struct.pack("<4I", 100, 3, 200, 5), np.uint8)
    views = mem.builders(0, 2)
    assert [v.nbytes for v in views] == [3, 5]
    mem.data[0:8] = np.frombuffer(struct.pack("<2I", 250, 10), np.uint8)
    with pytest.raises(InvalidArgumentError, match="graph builder 0"):
        mem.builders(0, 2)
    with pytest.raises(InvalidArgumentError, match="expected at most 16"):
        mem.builders(0, 0x40000000)


def test_builder_count_is_bounded_before_anything_is_read() -> None:
    # 4M empty builders fit in 32 MiB of guest memory; the host must refuse them up front
    # rather than build a view per pair.
    mem = GuestMemory(np.zeros(8 * 1024, dtype=np.uint8))
    assert len(mem.builders(0, 16)) == 16
    with pytest.raises(InvalidArgumentError, match="17 graph builders: expected at most 16"):
        mem.builders(0, 17)
    with pytest.raises(InvalidArgumentError, match="4194304 graph builders"):
        mem.builders(0, 4 * 1024 * 1024)


@pytest.mark.parametrize("source", [
    np.arange(12, dtype=np.float32).reshape(3, 4),
    np.arange(6, dtype=np.float32).reshape(2, 3).astype(ml_dtypes.bfloat16),
    np.array(1.5, dtype=np.float64),
    np.arange(10, dtype=np.int64)[::2],  # not contiguous
], ids=["f32", "bf16", "rank-0", "strided"])
def test_copy_bytes_writes_any_output_into_guest_bytes(source: np.ndarray[Any, Any]) -> None:
    target = np.full(np.ascontiguousarray(source).nbytes, 0xAA, dtype=np.uint8)
    copy_bytes(target, source)
    assert target.tobytes() == np.ascontiguousarray(source).tobytes()


@pytest.mark.parametrize(("shape", "limit", "written"), [
    ((1, 4), 8, 16),
    # 4 GiB + 4 bytes (no memory: a broadcast view), past any u32: the largest u32 is
    # written back (it was a struct.error inside the host: runtime_error, nothing written)
    ((2**30 + 1,), 1024**3, 0xFFFFFFFF),
], ids=["over-the-limit", "over-4-gib"])
def test_an_output_over_the_tensor_limit_still_reports_its_size(
        shape: tuple[int, ...], limit: int, written: int) -> None:
    # Like every too_large of get_output, the needed size is written to bytes_written.
    from wasinn.backends.base import TensorSpec
    from wasinn.errors import TooLargeError
    from wasinn.host.limits import GuestLimits
    from wasinn.host.nn_core import GuestNN, _GuestContext
    from wasinn.tensor import Tensor

    nn = GuestNN(runtime=None, portal=None,  # type: ignore[arg-type]
                 limits=GuestLimits(max_tensor_bytes=limit))
    entry = _GuestContext(ctx=None, graph_handle=0, inputs_spec=(),  # type: ignore[arg-type]
                          outputs_spec=(TensorSpec("y", TensorType.F32, shape),))
    ones = np.broadcast_to(np.float32(1), shape)
    entry.results = {"y": Tensor(shape, TensorType.F32, array=ones)}
    nn.contexts[0] = entry
    mem = _memory()
    with pytest.raises(TooLargeError, match=f"limit is {limit}"):
        nn.get_output(mem, 0, 0, 0x80, 64, 0x10)
    assert mem.read_u32(0x10) == written


def test_a_scalar_input_takes_only_a_scalar_and_an_unknown_rank_takes_any() -> None:
    scalar = TensorSpec("x", TensorType.F32, ())
    unknown = TensorSpec("x", TensorType.F32, (), rank_known=False)
    check_against_spec(TensorRecord((), TensorType.F32, 0, 4), scalar)
    with pytest.raises(InvalidArgumentError,
                       match=r"input 'x' got f32\[1\]: the model expects x: f32\[\]"):
        check_against_spec(TensorRecord((1,), TensorType.F32, 0, 4), scalar)
    for dims in [(), (1,), (2, 3)]:
        check_against_spec(TensorRecord(dims, TensorType.F32, 0, 4), unknown)


def test_an_undeclared_type_takes_any_type_and_a_declared_one_of_unknown_rank_only_its_own(
        ) -> None:
    # TorchScript's specs: f32 is a placeholder (type_known=False). Before, set_input
    # refused an i64 tensor for it ("the model expects x: f32[...]").
    undeclared = TensorSpec("x", TensorType.F32, (), rank_known=False, type_known=False)
    assert undeclared.describe() == "x: any[...]"
    for ttype in [TensorType.I64, TensorType.U8, TensorType.BF16, TensorType.F32]:
        check_against_spec(TensorRecord((1, 4), ttype, 0, 4), undeclared)
    # An ONNX value declared without a shape still declares its type.
    shapeless = TensorSpec("x", TensorType.F32, (), rank_known=False)
    with pytest.raises(InvalidArgumentError,
                       match=r"^input 'x' got i64\[1, 4\]: the model expects x: f32\[\.\.\.\]$"):
        check_against_spec(TensorRecord((1, 4), TensorType.I64, 0, 32), shapeless)


def test_only_a_known_shape_has_a_static_output_size() -> None:
    assert static_nbytes(TensorSpec("y", TensorType.F32, ())) == 4  # a scalar
    assert static_nbytes(TensorSpec("y", TensorType.F32, (2, 3))) == 24
    assert static_nbytes(TensorSpec("y", TensorType.F32, (None, 3))) is None
    assert static_nbytes(TensorSpec("y", TensorType.F32, (), rank_known=False)) is None
    # ...and a declared type: an undeclared one's itemsize says nothing.
    assert static_nbytes(TensorSpec("y", TensorType.F32, (2, 3), type_known=False)) is None


def test_a_guest_request_on_a_busy_device_is_handed_copies_of_guest_memory() -> None:
    # On a busy device the request runs in a device worker thread, which a cancelled
    # guest leaves at once while the run may still read its inputs: the run must not read
    # guest memory. On a free slot the guest's own thread runs it on views (no copy).
    import trio

    from wasinn.host.tensor_binding import InFlight, run_context_in_thread
    from wasinn.tensor import Tensor

    guest_memory = np.arange(4, dtype=np.float32).reshape(1, 4)
    y = Tensor.from_numpy(guest_memory * 2)
    handed: dict[str, Any] = {}

    class Settled:
        def run(self) -> dict[str, Tensor]:
            return {"y": y}

    class Context:  # routing only: which inputs reach which path
        def __init__(self, busy: bool) -> None:
            self.busy = busy

        def set_output(self, key: str | int, buffer: Any) -> None:
            raise AssertionError("no output is bound here")

        def try_lease(self, inputs: Any, *, tenant: str = "") -> Settled | None:
            handed["try_lease"] = inputs["x"].numpy()
            return None if self.busy else Settled()

        async def lease(self, inputs: Any, *, tenant: str = "") -> Settled:
            handed["lease"] = inputs["x"].numpy()
            return Settled()

    class Portal:
        def run(self, afn: Any, *args: Any) -> Any:
            return trio.run(afn, *args)

    inputs = {"x": Tensor.from_numpy(guest_memory)}
    for busy in (False, True):
        handed.clear()
        out = run_context_in_thread(Portal(), Context(busy), dict(inputs),  # type: ignore[arg-type]
                                    {}, InFlight())
        assert out["y"] is y
        assert np.shares_memory(handed["try_lease"], guest_memory)
        if busy:
            assert not np.shares_memory(handed["lease"], guest_memory)
            np.testing.assert_array_equal(handed["lease"], guest_memory)
        else:
            assert "lease" not in handed


# -- declared bounds and dimension names ----------------------------------------------------
def test_a_spec_describes_its_bounds_and_refuses_bounds_that_do_not_fit() -> None:
    def spec(shape: tuple[int | None, ...], bounds: Any) -> TensorSpec:
        return TensorSpec("x", TensorType.F32, shape, bounds=bounds)

    assert spec((None, 3), ((1, 4), (3, 3))).describe() == "x: f32[1..4, 3]"
    assert spec((None, None, None), ((2, None), (0, 8), (0, None))).describe() == \
        "x: f32[2.., ..8, ?]"
    # Bounds take part in equality: a model that limits a dimension is another model.
    assert spec((None, 3), ((1, 4), (3, 3))) != TensorSpec("x", TensorType.F32, (None, 3))
    for shape, bounds in [((None, 3), ((1, 4),)),            # not one per dimension
                          ((None, 3), ((1, 4), (2, 2))),     # not the fixed size
                          ((None,), ((5, 4),)),              # low above high
                          ((None,), ((-1, None),))]:
        with pytest.raises(InvalidArgumentError, match=r"expected one \(low, high\) per"):
            spec(shape, bounds)


def test_set_input_refuses_a_size_outside_a_declared_bound() -> None:
    # Before: set_input took 5 rows for x: [1..4, 3] (the spec kept no bounds), and the
    # guest's compute failed inside OpenVINO as runtime_error.
    bounded = TensorSpec("x", TensorType.F32, (None, 3), bounds=((1, 4), (3, 3)))
    check_against_spec(TensorRecord((4, 3), TensorType.F32, 0, 48), bounded)
    for rows in (0, 5):
        with pytest.raises(InvalidArgumentError) as caught:
            check_against_spec(TensorRecord((rows, 3), TensorType.F32, 0, 12 * rows), bounded)
        assert caught.value.message == (
            f"input 'x' has size {rows} in dimension 0, but the model allows 1 to 4 there "
            "(expected x: f32[1..4, 3])")
        assert errno_of(caught.value) is Errno.INVALID_ARGUMENT


def _nn_guest(load: str, data: bytes, tensors: list[tuple[tuple[int, ...], bytes]]) -> str:
    """A core-module guest that loads a graph (``load``: WAT that leaves load's errno and
    writes the graph's handle to 64), sets ``tensors`` (f32, of dims and bytes) as its
    inputs 0, 1, ... and computes; its exit code is the first failure's errno plus 10 for
    a load, 20 for the context, 30 + 10 i for input i's set_input, 90 for compute (0 if
    none fails). ``data`` lies at 4096."""
    mem, records, at, calls = bytearray(1024), 128, 256, []
    for i, (dims, values) in enumerate(tensors):
        data_at = 512 + 64 * i
        struct.pack_into("<2IB3xII", mem, records + 20 * i, at, len(dims), 1, data_at,
                         len(values))
        struct.pack_into(f"<{len(dims)}I", mem, at, *dims)
        mem[data_at:data_at + len(values)] = values
        at += 4 * len(dims)
        calls.append((30 + 10 * i, f"(call $set (i32.load (i32.const 68)) (i32.const {i}) "
                                   f"(i32.const {records + 20 * i}))"))
    calls = [(10, load), (20, "(call $init (i32.load (i32.const 64)) (i32.const 68))"),
             *calls, (90, "(call $compute (i32.load (i32.const 68)))")]
    body = "".join(f"""
    (local.set $e {call})
    (if (local.get $e) (then (call $exit (i32.add (i32.const {fail}) (local.get $e)))))"""
                   for fail, call in calls)

    def escaped(b: bytes) -> str:
        return "".join(f"\\{c:02x}" for c in b)

    from tests.support import CORE_NN_IMPORTS

    return f"""(module{CORE_NN_IMPORTS}
  (import "wasi_ephemeral_nn" "load_by_name" (func $lbn (param i32 i32 i32) (result i32)))
  (memory (export "memory") 2)
  (data (i32.const 0) "{escaped(bytes(mem))}")
  (data (i32.const 4096) "{escaped(data)}")
  (func (export "_start") (local $e i32){body}
    (call $exit (i32.const 0))))"""


def _f32(rows: int, columns: int = 3) -> tuple[tuple[int, ...], bytes]:
    return (rows, columns), np.ones((rows, columns), np.float32).tobytes()


@pytest.mark.parametrize(("rows", "code"), [(4, 0), (5, 30 + Errno.INVALID_ARGUMENT)])
async def test_a_guest_gets_invalid_argument_for_a_size_outside_a_declared_bound(
        tmp_path: Any, rows: int, code: int) -> None:
    # Before: 5 rows for x: [1..4, 3] passed set_input, and compute failed inside
    # OpenVINO: runtime_error (90 + 5).
    from tests.support import require_backend
    from tests.test_openvino_edges import _bounded_ir

    require_backend("openvino")
    import wasinn

    xml, weights = _bounded_ir()
    (tmp_path / "bounded.xml").write_bytes(xml)
    (tmp_path / "bounded.bin").write_bytes(weights)
    config = tmp_path / "wasinn.toml"
    config.write_text('[pools.cpu]\nkind = "cpu"\ndevices = ["cpu"]\n'
                      '[models.bounded]\nfiles = ["bounded.xml", "bounded.bin"]\n'
                      'encoding = "openvino"\n')
    guest = tmp_path / "bounded.wat"
    guest.write_text(_nn_guest("(call $lbn (i32.const 4096) (i32.const 7) (i32.const 64))",
                               b"bounded", [_f32(rows)]))
    async with wasinn.Runtime.from_config(config) as rt:
        assert await rt.run_wasm(guest) == code


@pytest.mark.parametrize(("rows", "code"), [(2, 0), (4, 90 + Errno.INVALID_ARGUMENT)])
async def test_a_guest_gets_invalid_argument_for_inputs_whose_named_dimensions_differ(
        tmp_path: Any, rows: int, code: int) -> None:
    # a: [n, 3], b: [n, 3], from the guest's own bytes (so in a sandbox process, by
    # default). Before: b of 4 rows reached ONNX Runtime's Add: runtime_error (90 + 5).
    from onnx import TensorProto, helper

    from tests.support import cpu_pool, no_spares, require_backend
    from wasinn.modelgen import onnx_model_bytes

    require_backend("onnxruntime")
    import wasinn

    a, b, y = (helper.make_tensor_value_info(n, TensorProto.FLOAT, ["n", 3]) for n in "aby")
    model = onnx_model_bytes(helper.make_graph([helper.make_node("Add", ["a", "b"], ["y"])],
                                               "add", [a, b], [y]))
    struct_at = struct.pack("<2I", 4096 + 8, len(model))  # the builder array, at 4096
    guest = tmp_path / "named.wat"
    guest.write_text(_nn_guest(
        "(call $load (i32.const 4096) (i32.const 1) (i32.const 1) (i32.const 0) "
        "(i32.const 64))", struct_at + model, [_f32(2), _f32(rows)]))
    async with wasinn.Runtime(no_spares(cpu_pool(backends=["onnxruntime"]))) as rt:
        assert await rt.run_wasm(guest) == code
