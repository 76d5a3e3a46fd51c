"""The cost of the TFLite flatbuffer check (:mod:`wasinn.backends._tflite_check`), which
the host runs on a guest's bytes before OpenVINO's frontend (in a child) reads them:
bounded by the model's size however often its vectors refer to one table."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest

from tests.tfmodels import _int_vector, _offset_vector, relu_tflite

flatbuffers = pytest.importorskip("flatbuffers")

#: References in the vectors made to repeat one table: 0.8 MB of offsets.
REFERENCES = 200_000


def _peak(call: Callable[[], Any]) -> tuple[Any, int]:
    """What ``call`` returns or raises (its message), and the most memory it held."""
    tracemalloc.start()
    try:
        try:
            result: Any = call()
        except ValueError as exc:
            result = str(exc)
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _check(data: bytes) -> None:
    from wasinn.backends._tflite_check import check_tflite

    check_tflite(data)


def _model(build: Callable[[Any], tuple[int, int, int]]) -> bytes:
    """A Model whose operator codes, subgraphs and buffers vectors ``build`` writes
    (it returns their offsets)."""
    b = flatbuffers.Builder(1 << 20)
    codes, subgraphs, buffers = build(b)
    b.StartObject(5)
    b.PrependUint32Slot(0, 3, 0)
    b.PrependUOffsetTRelativeSlot(1, codes, 0)
    b.PrependUOffsetTRelativeSlot(2, subgraphs, 0)
    b.PrependUOffsetTRelativeSlot(4, buffers, 0)
    b.Finish(b.EndObject(), file_identifier=b"TFL3")
    return bytes(b.Output())


def _subgraph(b: Any, operators: list[int], tensors: int = 2) -> int:
    """A subgraph of ``tensors`` f32 tensors (buffer 0), input 0, output 1."""
    names = [b.CreateString(f"t{i}") for i in range(tensors)]
    made = []
    for name in names:
        b.StartObject(4)
        b.PrependUOffsetTRelativeSlot(3, name, 0)
        made.append(b.EndObject())
    vectors = (_offset_vector(b, made), _int_vector(b, (0,)), _int_vector(b, (1,)),
               _offset_vector(b, operators))
    b.StartObject(5)
    for field, vector in enumerate(vectors):
        b.PrependUOffsetTRelativeSlot(field, vector, 0)
    return int(b.EndObject())


def _operator(b: Any, inputs: int, outputs: int) -> int:
    b.StartObject(5)
    b.PrependUOffsetTRelativeSlot(1, inputs, 0)
    b.PrependUOffsetTRelativeSlot(2, outputs, 0)
    return int(b.EndObject())


def _one_code_one_buffer(b: Any) -> tuple[int, int]:
    b.StartObject(4)
    b.PrependInt8Slot(0, 19, 0)  # RELU
    codes = _offset_vector(b, [b.EndObject()])
    b.StartObject(1)
    return codes, _offset_vector(b, [b.EndObject()])


def _buffers_all_one_table() -> bytes:
    def build(b: Any) -> tuple[int, int, int]:
        codes, _ = _one_code_one_buffer(b)
        b.StartObject(1)
        buffers = _offset_vector(b, [b.EndObject()] * REFERENCES)
        return codes, _offset_vector(b, []), buffers
    return _model(build)


def _operators_all_one_table(outputs: tuple[int, ...]) -> bytes:
    def build(b: Any) -> tuple[int, int, int]:
        codes, buffers = _one_code_one_buffer(b)
        op = _operator(b, _int_vector(b, (0,)), _int_vector(b, outputs))
        return codes, _offset_vector(b, [_subgraph(b, [op] * REFERENCES)]), buffers
    return _model(build)


def test_a_vector_of_references_to_one_table_costs_no_object_per_reference() -> None:
    # Before: a _Table and an f-string per reference, 8 s and 509 MB for 9.5 MB of
    # offsets; here about 40 MB for 0.8 MB.
    data = _buffers_all_one_table()
    result, peak = _peak(lambda: _check(data))
    assert result == "the model has no subgraph"
    assert peak < 8 * 2**20


@pytest.mark.parametrize(("outputs", "expected"), [
    ((), None),
    ((1,), "Model.subgraphs[0]: tensor 1 is written by more than one operator (or is a "
           "subgraph input written by an operator)"),
])
def test_an_operator_listed_again_is_checked_once_and_counted_again(
        outputs: tuple[int, ...], expected: str | None) -> None:
    # Listed twice, an operator that writes a tensor writes it twice, as before; one that
    # writes none is no fault. Before: both held 1.4 GB and took 30 s at 2.4 M listings.
    data = _operators_all_one_table(outputs)
    result, peak = _peak(lambda: _check(data))
    assert result == expected
    assert peak < 8 * 2**20


def test_vectors_read_more_often_than_the_model_could_hold_are_refused() -> None:
    # 2,000 operators sharing one 1,000-index inputs vector: 2 M indices checked for a
    # 56 KB model. Before: checked every time (quadratic in the model's size).
    def build(b: Any) -> tuple[int, int, int]:
        codes, buffers = _one_code_one_buffer(b)
        inputs, outputs = _int_vector(b, (0,) * 1000), _int_vector(b, ())
        ops = [_operator(b, inputs, outputs) for _ in range(2000)]
        return codes, _offset_vector(b, [_subgraph(b, ops)]), buffers

    data = _model(build)
    with pytest.raises(ValueError, match=(
            r"^Model\.subgraphs\[0\]\.operators\[\d+\]\.inputs: the model's vectors, counted "
            r"each time one is referred to, hold more elements than its \d+ bytes could "
            r"\(expected each vector referred to once\)$")):
        _check(data)


def test_a_model_whose_vectors_are_each_read_once_passes() -> None:
    _check(relu_tflite())
