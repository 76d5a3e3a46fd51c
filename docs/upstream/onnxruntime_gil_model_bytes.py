"""ONNX Runtime Python binding: InferenceSession(model_bytes) holds the GIL while it copies
the model, so every other Python thread stops for that long.

Uses only onnxruntime, onnx (to build the model) and numpy. The model is y = x @ W with
W an f32 initializer of MODEL_MB (default 256) MB. A ticker thread sleeps 1 ms in a loop
and records its longest gap while another thread builds a session, once from the model's
bytes and once from its path. ``bytearray(data)``, one plain memcpy of the same size
made while holding the GIL, is timed the same way for scale.
Usage: python onnxruntime_gil_model_bytes.py [MODEL_MB]
"""

import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


def matmul_model(megabytes: int) -> bytes:
    cols = 1024
    weights = np.ones((megabytes * 2**20 // 4 // cols, cols), np.float32)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, weights.shape[0]])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, cols])
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "matmul",
                              [x], [y], [numpy_helper.from_array(weights, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def longest_pause(work: Callable[[], object]) -> tuple[float, float]:
    """Run ``work`` in a thread; return (its seconds, the ticker's longest gap in s)."""
    stop, gaps = threading.Event(), [0.0]

    def tick() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps[0] = max(gaps[0], now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.1)
    gaps[0] = 0.0
    start = time.perf_counter()
    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    took = time.perf_counter() - start
    stop.set()
    ticker.join()
    return took, gaps[0]


def main() -> None:
    megabytes = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    print(f"onnxruntime {ort.__version__}, onnx {onnx.__version__}, numpy {np.__version__}, "
          f"Python {sys.version.split()[0]}; model {megabytes} MB")
    data = matmul_model(megabytes)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "matmul.onnx"
        path.write_bytes(data)
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])  # warm-up
        cases: dict[str, Callable[[], object]] = {
            "InferenceSession(bytes)": lambda: ort.InferenceSession(
                data, options, providers=["CPUExecutionProvider"]),
            "InferenceSession(path)": lambda: ort.InferenceSession(
                str(path), options, providers=["CPUExecutionProvider"]),
            "bytearray(data) (one memcpy)": lambda: bytearray(data),
        }
        for round_ in range(2):
            for label, work in cases.items():
                took, gap = longest_pause(work)
                print(f"round {round_}  {label:34s} took {took * 1e3:7.1f} ms, "
                      f"longest pause of the other thread {gap * 1e3:7.1f} ms", flush=True)


if __name__ == "__main__":
    main()
