"""ONNX Runtime CPU: Conv with an empty kernel dimension (W of shape (1, 1, 0, 2)) never
returns, spinning a core, and RunOptions.terminate does not stop it.

Uses only onnxruntime, onnx (to build the models) and numpy. The Conv model declares its
inputs without shapes, so W's shape comes from the caller. For contrast, a Loop of many
iterations is stopped by the same terminate flag within milliseconds. The hung run is
left in a daemon thread and the script ends with os._exit.
"""

import os
import resource
import threading
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

F = TensorProto.FLOAT


def conv_model() -> bytes:
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"])], "conv",
                              [helper.make_tensor_value_info("x", F, None),
                               helper.make_tensor_value_info("w", F, None)],
                              [helper.make_tensor_value_info("y", F, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                             ir_version=8).SerializeToString()


def loop_model() -> bytes:
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Add", ["v_in", "one"], ["v_out"])],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_in", F, [1, 4])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_out", F, [1, 4])],
        [helper.make_tensor("one", F, [1], [1.0])])
    graph = helper.make_graph(
        [helper.make_node("Loop", ["m", "", "x"], ["y"], body=body)], "loop",
        [helper.make_tensor_value_info("m", TensorProto.INT64, [1]),
         helper.make_tensor_value_info("x", F, [1, 4])],
        [helper.make_tensor_value_info("y", F, [1, 4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                             ir_version=8).SerializeToString()


def terminated_after(session: ort.InferenceSession, feed: dict[str, np.ndarray],
                     wait: float) -> str:
    """Run in a thread, set terminate 0.5 s later, and say what happened ``wait`` s on."""
    options, result = ort.RunOptions(), []

    def run() -> None:
        try:
            result.append(f"returned {[o.shape for o in session.run(None, feed, options)]}")
        except Exception as exc:  # the terminate error
            result.append("raised: " + str(exc).splitlines()[-1][-70:])

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(0.5)
    if not thread.is_alive():
        return f"{result[0]} within 0.5 s (before terminate)"
    cpu = resource.getrusage(resource.RUSAGE_SELF)
    options.terminate = True
    start = time.perf_counter()
    thread.join(wait)
    took = time.perf_counter() - start
    used = resource.getrusage(resource.RUSAGE_SELF)
    busy = (used.ru_utime + used.ru_stime) - (cpu.ru_utime + cpu.ru_stime)
    if thread.is_alive():
        return f"still running {took:.1f} s after terminate (CPU time meanwhile {busy:.1f} s)"
    return f"{result[0]} {took * 1e3:.0f} ms after terminate"


def main() -> None:
    print(f"onnxruntime {ort.__version__}, onnx {onnx.__version__}")
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    cpu = ["CPUExecutionProvider"]
    loop = ort.InferenceSession(loop_model(), options, providers=cpu)
    print("Loop of 10**9 iterations:", terminated_after(
        loop, {"m": np.array([10**9], np.int64), "x": np.zeros((1, 4), np.float32)}, 10))
    conv = ort.InferenceSession(conv_model(), options, providers=cpu)
    x = np.zeros((1, 1, 4, 4), np.float32)
    print("Conv, W of shape (1, 1, 2, 2):",
          terminated_after(conv, {"x": x, "w": np.zeros((1, 1, 2, 2), np.float32)}, 10))
    print("Conv, W of shape (1, 1, 0, 2):",
          terminated_after(conv, {"x": x, "w": np.zeros((1, 1, 0, 2), np.float32)}, 10),
          flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
