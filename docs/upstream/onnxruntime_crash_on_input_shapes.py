"""ONNX Runtime CPU: inputs of an unexpected shape abort the process (std::terminate,
SIGABRT) instead of failing the run, and a DepthToSpace blocksize of 2**32 kills the
session build with SIGFPE.

Uses only onnxruntime, onnx (to build the models) and numpy. Each model is one standard
ONNX node. Unique aborts on an empty dimension; Einsum, ReverseSequence and RoiAlign declare
their inputs without a shape (legal ONNX: the rank is then not checked before the kernel
runs), and a run with an input of another rank than the operator needs aborts. Each case
runs in a child process, first with a valid input.
"""

import signal
import subprocess
import sys

import onnx
import onnxruntime as ort

CHILD = r"""
import sys
import numpy as np, onnxruntime as ort
from onnx import TensorProto, helper

case, good = sys.argv[1], sys.argv[2] == "good"
vi = helper.make_tensor_value_info
F, I = TensorProto.FLOAT, TensorProto.INT64
zeros = lambda *shape: np.zeros(shape, np.float32)
outputs = [vi("y", F, None)]
if case == "Unique":  # x declared f32[a, b]; axis 0 of x f32[3, 0] (another axis empty)
    node = helper.make_node("Unique", ["x"], ["y"], axis=0)
    inputs, feed = [vi("x", F, ["a", "b"])], {"x": zeros(3, 2) if good else zeros(3, 0)}
elif case == "Einsum":  # "ij->ji" given a rank-1 tensor
    node = helper.make_node("Einsum", ["x"], ["y"], equation="ij->ji")
    inputs, feed = [vi("x", F, None)], {"x": zeros(3, 2) if good else zeros(3)}
elif case == "ReverseSequence":  # x of rank 1 (the operator needs rank >= 2)
    node = helper.make_node("ReverseSequence", ["x", "l"], ["y"])
    inputs = [vi("x", F, None), vi("l", I, None)]
    feed = {"x": zeros(2, 1) if good else zeros(3), "l": np.array([1], np.int64)}
elif case == "RoiAlign":  # rois of rank 1 (the operator needs [num_rois, 4])
    node = helper.make_node("RoiAlign", ["x", "rois", "batch"], ["y"])
    inputs = [vi("x", F, None), vi("rois", F, None), vi("batch", I, None)]
    feed = {"x": zeros(1, 1, 4, 4), "rois": zeros(1, 4) if good else zeros(4),
            "batch": np.zeros(1, np.int64)}
elif case == "DepthToSpace":  # blocksize 2**32 (attribute), x f32[1, 4, 2, 2]
    node = helper.make_node("DepthToSpace", ["x"], ["y"], blocksize=2 if good else 2**32)
    inputs, feed = [vi("x", F, [1, 4, 2, 2])], {"x": zeros(1, 4, 2, 2)}
graph = helper.make_graph([node], case, inputs, outputs)
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
print("session built; ", end="", flush=True)
print("output shape", session.run(None, feed)[0].shape)
"""

CASES = {
    "Unique": "x of shape (3, 0), axis=0",
    "Einsum": "'ij->ji' given x of shape (3,)",
    "ReverseSequence": "x of shape (3,)",
    "RoiAlign": "rois of shape (4,)",
    "DepthToSpace": "blocksize=2**32",
}


def main() -> None:
    print(f"onnxruntime {ort.__version__}, onnx {onnx.__version__}")
    for case, bad in CASES.items():
        for good in (True, False):
            done = subprocess.run([sys.executable, "-c", CHILD, case, "good" if good else "bad"],
                                  capture_output=True, text=True, timeout=120, check=False)
            outcome = done.stdout.strip()
            if done.returncode < 0:
                stderr = [line for line in done.stderr.splitlines() if line.strip()]
                outcome += f" process killed by {signal.Signals(-done.returncode).name}"
                outcome += f" ({stderr[-1].strip()})" if stderr else ""
            elif done.returncode:
                outcome += " exception: " + done.stderr.strip().splitlines()[-1][-90:]
            print(f"{case:16s} {'valid input' if good else bad}: {outcome.strip()}", flush=True)


if __name__ == "__main__":
    main()
