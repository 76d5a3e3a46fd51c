"""OpenVINO ONNX frontend: Core.read_model kills the process (SIGSEGV) on a Pad node that
lacks its required ``pads`` input; other operators missing a required input raise.

Uses only openvino and onnx (to build the models). Each model is one node with the single
input x (f32[2, 2]); each read runs in a child process.
"""

import signal
import subprocess
import sys

import onnx
import openvino as ov

CHILD = r"""
import sys
import openvino as ov
from onnx import TensorProto, helper

op, opset = sys.argv[1], int(sys.argv[2])
inputs = ["x", "pads"] if op == "Pad+pads" else ["x"]
node = helper.make_node(op.split("+")[0], inputs, ["y"])
graph = helper.make_graph(
    [node], "one_node", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    [helper.make_tensor("pads", TensorProto.INT64, [4], [1, 1, 1, 1])] if "+" in op else [])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
print("read:", ov.Core().read_model(model.SerializeToString()).get_friendly_name())
"""


def main() -> None:
    print(f"openvino {ov.get_version()}, onnx {onnx.__version__}")
    for op, opset in (("Pad+pads", 18), ("Pad", 11), ("Pad", 18), ("Reshape", 18),
                      ("Slice", 18), ("Tile", 18)):
        done = subprocess.run([sys.executable, "-c", CHILD, op, str(opset)],
                              capture_output=True, text=True, timeout=120, check=False)
        if done.returncode < 0:
            outcome = f"process killed by {signal.Signals(-done.returncode).name}"
        elif done.returncode:
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            outcome = "exception: ..." + lines[-1].strip()[:90]
        else:
            outcome = done.stdout.strip()
        label = "Pad with its pads input" if op == "Pad+pads" else f"{op} with only its data input"
        print(f"{label} (opset {opset}): {outcome}")


if __name__ == "__main__":
    main()
