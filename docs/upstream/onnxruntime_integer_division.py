"""ONNX Runtime CPU: integer Div and Mod of the type's minimum by -1 kill the process with
SIGFPE, at run time from input values, and while the session is built where both operands
are constants (constant folding).

Uses only onnxruntime, onnx (to build the models) and numpy. Each case runs in a child
process. A zero divisor, for comparison, raises an exception as it should.
"""

import signal
import subprocess
import sys

import onnx
import onnxruntime as ort

CHILD = r"""
import sys
import numpy as np, onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

op, dtype, a, b, where = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
np_type = {"int32": np.int32, "int64": np.int64}[dtype]
onnx_type = {"int32": TensorProto.INT32, "int64": TensorProto.INT64}[dtype]
vi = helper.make_tensor_value_info
if where == "inputs":  # y = a op b, both graph inputs
    nodes = [helper.make_node(op, ["a", "b"], ["y"])]
    inputs, inits = [vi("a", onnx_type, [1]), vi("b", onnx_type, [1])], []
    feed = {"a": np.array([a], np_type), "b": np.array([b], np_type)}
else:  # y = (A op B) + x, A and B initializers: folded when the session is built
    nodes = [helper.make_node(op, ["A", "B"], ["q"]), helper.make_node("Add", ["q", "x"], ["y"])]
    inputs = [vi("x", onnx_type, [1])]
    inits = [numpy_helper.from_array(np.array([a], np_type), "A"),
             numpy_helper.from_array(np.array([b], np_type), "B")]
    feed = {"x": np.zeros(1, np_type)}
graph = helper.make_graph(nodes, "division", inputs, [vi("y", onnx_type, [1])], inits)
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
print("session built; ", end="", flush=True)
print("y =", session.run(None, feed)[0].tolist())
"""

CASES = [
    ("Div", "int32", -2**31, -2, "inputs"),
    ("Div", "int32", -2**31, -1, "inputs"),
    ("Div", "int64", -2**63, -1, "inputs"),
    ("Mod", "int32", -2**31, -1, "inputs"),
    ("Mod", "int64", -2**63, -1, "inputs"),
    ("Div", "int32", 7, 0, "inputs"),
    ("Div", "int64", -2**63, -1, "initializers"),
    ("Mod", "int64", -2**63, -1, "initializers"),
]


def main() -> None:
    print(f"onnxruntime {ort.__version__}, onnx {onnx.__version__}")
    for op, dtype, a, b, where in CASES:
        done = subprocess.run([sys.executable, "-c", CHILD, op, dtype, str(a), str(b), where],
                              capture_output=True, text=True, timeout=120, check=False)
        outcome = done.stdout.strip()
        if done.returncode < 0:
            outcome += f" process killed by {signal.Signals(-done.returncode).name}"
        elif done.returncode:
            outcome += " exception: " + done.stderr.strip().splitlines()[-1][-90:]
        print(f"{dtype} {op}({a}, {b}), operands {where}: {outcome.strip()}", flush=True)


if __name__ == "__main__":
    main()
