"""An ONNX model whose run time depends on an input's VALUE, not its size: a Loop whose
trip count is an input. Used to keep ONNX Runtime busy for a controlled while (abandoned
runs at close, inline runs that must not ignore a deadline)."""

from __future__ import annotations

from typing import Any

import numpy as np


def loop_onnx() -> bytes:
    """``y = x + m`` computed by an ONNX Loop of ``m`` iterations (``m: i64[1]``,
    ``x: f32[1, 4]``): the run time grows with the VALUE of ``m``, not its size."""
    from onnx import TensorProto, helper

    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Add", ["v_in", "one"], ["v_out"])],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_in", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_out", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])],
    )
    graph = helper.make_graph(
        [helper.make_node("Loop", ["m", "", "x"], ["y"], body=body)], "loop",
        [helper.make_tensor_value_info("m", TensorProto.INT64, [1]),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


def loop_inputs(m: int) -> dict[str, np.ndarray[Any, Any]]:
    return {"m": np.array([m], np.int64), "x": np.zeros((1, 4), np.float32)}


#: Loop iterations that keep ONNX Runtime busy for about half a second or more.
LONG_LOOP = 1_000_000
#: Loop iterations: ~30 s of ONNX Runtime work on a 2-core VM (0.66 us each).
HUGE_LOOP = 50_000_000
#: Far less than such a run would take, far more than a cancelled one needs.
GUARD_S = 10.0
