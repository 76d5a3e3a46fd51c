"""OpenVINO CPU: a model whose ports are i64 or f64 computes in i32 or f32, silently: i64
inputs beyond the i32 range are truncated (2**40 + 0 gives 0), i64 results wrap, and
f64 values lose digits or saturate, while the CompiledModel still reports i64 / f64 ports.

Uses only openvino and numpy; each model is y = a op b over two parameters of one type,
built with openvino.opset13 and compiled for "CPU" with an f32 inference precision hint.
"""

import numpy as np
import openvino as ov
import openvino.opset13 as ops


def compute(core: ov.Core, element: ov.Type, op: str, a: np.ndarray,
            b: np.ndarray) -> tuple[np.ndarray, str]:
    params = [ops.parameter([1], element, name=name) for name in ("a", "b")]
    model = ov.Model([getattr(ops, op)(*params)], params, op)
    compiled = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    ports = (f"ports {[p.get_element_type().get_type_name() for p in compiled.inputs]} -> "
             f"{compiled.outputs[0].get_element_type().get_type_name()}")
    return compiled([a, b])[0], ports


def main() -> None:
    print("openvino", ov.get_version())
    core = ov.Core()
    i64 = np.int64
    cases = [
        (ov.Type.i64, "add", np.array([2**40], i64), np.array([0], i64)),
        (ov.Type.i64, "add", np.array([2**31], i64), np.array([0], i64)),
        (ov.Type.i64, "multiply", np.array([3_000_000], i64), np.array([1000], i64)),
        (ov.Type.f64, "add", np.array([123456789.123]), np.array([0.0])),
        (ov.Type.f64, "add", np.array([1e300]), np.array([0.0])),
        (ov.Type.f64, "add", np.array([1e-300]), np.array([0.0])),
        (ov.Type.f64, "add", np.array([0.1]), np.array([0.2])),
    ]
    for element, op, a, b in cases:
        got, ports = compute(core, element, op, a, b)
        expected = {"add": np.add, "multiply": np.multiply}[op](a, b)
        print(f"{element.get_type_name()} {op}({a[0].item()!r}, {b[0].item()!r}): "
              f"got {got[0].item()!r}, expected {expected[0].item()!r}  ({ports})")


if __name__ == "__main__":
    main()
