"""A tensor whose element type the model does not declare (``TensorSpec.type_known``
False: TorchScript's, whose f32 is a placeholder) as the readers of specs other than the
backends and the guest ABI see it: a sandbox process's description of its model, and a
pipeline's wiring check. (The guest ABI's: tests/test_core_abi.py and
tests/test_core_guests.py; the backend's: tests/test_backend_pytorch.py.)"""

from __future__ import annotations

import pytest

from wasinn.backends import LoadOptions, TensorSpec
from wasinn.backends._sandbox_specs import read_specs, reserve
from wasinn.enums import GraphEncoding, TensorType
from wasinn.errors import InvalidArgumentError


def _described(inputs: list[list[object]], outputs: list[list[object]]) -> dict[str, object]:
    return {"inputs": inputs, "outputs": outputs, "input_aliases": {}, "output_aliases": {},
            "output_types_declared": False}


def test_a_sandbox_process_says_a_type_is_undeclared_with_null() -> None:
    # Before, the process sent the placeholder as the type, and the host's specs said
    # f32 where the model declares none.
    specs = read_specs(_described([["x", None, [], False]], [["y", None, [], False],
                                                            ["z", "i64", [2], True]]))
    assert [(s.type_known, s.describe()) for s in (*specs.inputs, *specs.outputs)] == [
        (False, "x: any[...]"), (False, "y: any[...]"), (True, "z: i64[2]")]
    with pytest.raises(ValueError, match=r"^output 0 'y' of type 'f128': expected one of "
                                         r"f16, .* or null \(undeclared\)$"):
        read_specs(_described([], [["y", "f128", [], False]]))


def test_the_arena_reserves_no_room_for_an_output_of_undeclared_type() -> None:
    # Its size is unknown even where its shape is: its itemsize is a placeholder's.
    # (Each output gets its alignment's room besides.)
    undeclared = TensorSpec("y", TensorType.F32, (1000,), type_known=False)
    assert reserve([undeclared], 1 << 20, 64) == 64
    assert reserve([TensorSpec("y", TensorType.F32, (1000,))], 1 << 20, 64) == 4000 + 64


def _wire(out: TensorSpec, inp: TensorSpec) -> object:
    from wasinn.scheduler.model import LoadedModel
    from wasinn.scheduler.pipeline import resolve_wiring

    a, b = (LoadedModel((b"",), GraphEncoding.ONNX, LoadOptions(), name=n) for n in "ab")
    a.inputs, a.outputs = (TensorSpec("x", TensorType.F32, (None, 4)),), (out,)
    b.inputs, b.outputs = (inp,), (TensorSpec("z", TensorType.F32, (None, 4)),)
    return resolve_wiring("p", [a, b], [{}, {out.name: inp.name}])


def test_a_wire_compares_the_types_both_ends_declare_whatever_their_ranks() -> None:
    shapeless_f32 = TensorSpec("y", TensorType.F32, (), rank_known=False)
    shapeless_i64 = TensorSpec("x", TensorType.I64, (), rank_known=False)
    # Before: never compared where a rank is unknown (taken for TorchScript's specs), so
    # every compute failed in step b instead.
    with pytest.raises(InvalidArgumentError, match=r"wires y: f32\[\.\.\.\] into "
                       r"x: i64\[\.\.\.\], but their element types differ \(f32, i64\)"):
        _wire(shapeless_f32, shapeless_i64)
    with pytest.raises(InvalidArgumentError, match=r"element types differ \(f32, i64\)"):
        _wire(TensorSpec("y", TensorType.F32, (None, 4)), shapeless_i64)
    # A TorchScript end declares no type: any wire to or from it may hold.
    torchscript_out = TensorSpec("y", TensorType.F32, (), rank_known=False, type_known=False)
    torchscript_in = TensorSpec("x", TensorType.F32, (), rank_known=False, type_known=False)
    assert _wire(torchscript_out, shapeless_i64) == ((("y", "x"),),)
    assert _wire(TensorSpec("y", TensorType.I64, (None, 4)), torchscript_in) == (
        (("y", "x"),),)
