"""OpenVINO CPU: InferRequest.cancel() is not honoured inside a Loop node; a cancelled
request runs the loop to its end.

Uses only openvino, onnx (to build the models) and numpy. Two models that run for a few
seconds each: an ONNX Loop (y = x + m by m iterations of Add, m an input) and, for
contrast, a chain of 40 MatMul nodes of 1024 x 1024. Each is started with start_async(),
cancelled 0.2 s later, and timed until wait() returns.
Usage: python openvino_cancel_inside_loop.py [SECONDS]  (the uncancelled run's length, 4 s)
"""

import itertools
import sys
import time

import numpy as np
import onnx
import openvino as ov
from onnx import TensorProto, helper, numpy_helper


def loop_onnx() -> bytes:
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
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                             ir_version=8).SerializeToString()


def matmul_chain_onnx(nodes: int) -> bytes:
    w = numpy_helper.from_array(np.full((1024, 1024), 1 / 1024, np.float32), "w")
    names = ["x"] + [f"h{i}" for i in range(nodes - 1)] + ["y"]
    graph = helper.make_graph(
        [helper.make_node("MatMul", [a, "w"], [b]) for a, b in itertools.pairwise(names)],
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1024, 1024])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1024, 1024])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                             ir_version=8).SerializeToString()


def cancelled_after(compiled: ov.CompiledModel, inputs: dict[str, np.ndarray],
                    after: float) -> tuple[float, str]:
    request = compiled.create_infer_request()
    start = time.perf_counter()
    request.start_async(inputs)
    time.sleep(after)
    request.cancel()
    cancelled = time.perf_counter()
    try:
        request.wait()
        outcome = f"completed, y[0, 0] = {request.get_output_tensor(0).data.flat[0]:g}"
    except RuntimeError as exc:
        outcome = "raised: " + [line for line in str(exc).splitlines() if line.strip()][-1][:80]
    return time.perf_counter() - cancelled, f"{outcome} ({time.perf_counter() - start:.2f} s)"


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 4.0
    print(f"openvino {ov.get_version()}, onnx {onnx.__version__}")
    core = ov.Core()
    config = {"INFERENCE_NUM_THREADS": 1, "INFERENCE_PRECISION_HINT": "f32"}
    loop = core.compile_model(core.read_model(loop_onnx()), "CPU", config)
    x = np.zeros((1, 4), np.float32)
    start = time.perf_counter()
    loop({"m": np.array([200_000], np.int64), "x": x})
    iterations = int(200_000 * seconds / (time.perf_counter() - start))
    inputs = {"m": np.array([iterations], np.int64), "x": x}
    start = time.perf_counter()
    loop(inputs)
    print(f"Loop of {iterations:,} iterations, not cancelled: {time.perf_counter() - start:.2f} s")
    took, outcome = cancelled_after(loop, inputs, 0.2)
    print(f"Loop, cancel() at 0.2 s: wait() returned {took:.2f} s after cancel(): {outcome}")

    chain = core.compile_model(core.read_model(matmul_chain_onnx(40)), "CPU", config)
    inputs = {"x": np.ones((1024, 1024), np.float32)}
    start = time.perf_counter()
    chain(inputs)
    print(f"40 MatMul nodes, not cancelled: {time.perf_counter() - start:.2f} s")
    took, outcome = cancelled_after(chain, inputs, 0.2)
    print(f"40 MatMul nodes, cancel() at 0.2 s: wait() returned {took:.2f} s after cancel(): "
          f"{outcome}")


if __name__ == "__main__":
    main()
