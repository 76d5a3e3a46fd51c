"""OpenVINO CPU plugin: input values that fit their type kill the process at run time
(SIGFPE, SIGSEGV, SIGABRT) instead of raising an exception.

Uses only openvino and numpy; each model is one operator built with openvino.opset15,
with the offending operand a model input (so nothing can be checked at compile time).
Every case runs in a child process: first with a valid value, then with the bad one(s).
"""

import signal
import subprocess
import sys

import openvino as ov

CHILD = r"""
import sys
import numpy as np, openvino as ov, openvino.opset15 as ops

case, value = sys.argv[1], int(sys.argv[2])
params = []

def param(shape, t, name):
    p = ops.parameter(shape, t, name=name)
    params.append(p)
    return p

def const(values):
    return ops.constant(np.array(values, np.int32))

if case == "Range":  # start 0, stop 10, step = value
    y = ops.range(const(0), const(10), param([], ov.Type.i32, "step"), ov.Type.i32)
    feed = {"step": np.array(value, np.int32)}
elif case == "Slice":  # x[9:-11:step] of x f32[10]
    y = ops.slice(param([10], ov.Type.f32, "x"), const([9]), const([-11]),
                  param([1], ov.Type.i32, "step"))
    feed = {"x": np.arange(10, dtype=np.float32), "step": np.array([value], np.int32)}
elif case == "GatherND":  # data f32[2, 2, 3], indices [[value, 0], [1, 1]]
    y = ops.gather_nd(param([2, 2, 3], ov.Type.f32, "x"), param([2, 2], ov.Type.i32, "i"))
    feed = {"x": np.zeros((2, 2, 3), np.float32), "i": np.array([[value, 0], [1, 1]], np.int32)}
elif case == "DFT":  # complex data f32[1, 8, 2], axis 1, signal_size = [value]
    y = ops.dft(param([1, 8, 2], ov.Type.f32, "x"), const([1]), param([1], ov.Type.i32, "n"))
    feed = {"x": np.ones((1, 8, 2), np.float32), "n": np.array([value], np.int32)}
elif case == "Col2Im":  # data f32[1, 4, 9], output_size [4, 4], kernel_size [value, 2]
    y = ops.col2im(param([1, 4, 9], ov.Type.f32, "x"), const([4, 4]),
                   param([2], ov.Type.i32, "k"))
    feed = {"x": np.ones((1, 4, 9), np.float32), "k": np.array([value, 2], np.int32)}
elif case == "ScatterElementsUpdate":  # data f32[4], axis 0, one update at index value
    y = ops.scatter_elements_update(param([4], ov.Type.f32, "x"), param([1], ov.Type.i32, "i"),
                                    ops.constant(np.ones(1, np.float32)), const(0))
    feed = {"x": np.zeros(4, np.float32), "i": np.array([value], np.int32)}
compiled = ov.Core().compile_model(ov.Model([y], params, case), "CPU")
out = compiled(feed)[0]
print(f"shape {out.shape}, values {out.ravel()[:4].tolist()}")
"""

CASES = [
    ("Range", "step", [1, 0]),
    ("Slice", "step", [-1, -2**31]),
    ("GatherND", "index", [1, -2**30, -2**31]),
    ("DFT", "signal_size", [4, 0]),
    ("Col2Im", "kernel_size[0]", [2, 0, -1]),
    ("ScatterElementsUpdate", "index (data of 4)", [-4, -5, -100_000]),
]


def main() -> None:
    print("openvino", ov.get_version())
    for case, what, values in CASES:
        for value in values:
            done = subprocess.run([sys.executable, "-c", CHILD, case, str(value)],
                                  capture_output=True, text=True, timeout=120, check=False)
            if done.returncode < 0:
                outcome = f"process killed by {signal.Signals(-done.returncode).name}"
                if done.stdout.strip():
                    outcome += f" (after the run returned: {done.stdout.strip()})"
            elif done.returncode:
                outcome = "exception: " + done.stderr.strip().splitlines()[-1][:100]
            else:
                outcome = done.stdout.strip()
            print(f"{case:22s} {what} = {value}: {outcome}", flush=True)


if __name__ == "__main__":
    main()
