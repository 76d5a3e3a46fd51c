"""OpenVINO CPU: compile_model time grows about as N^2.3 on a chain of N eltwise ops.

Uses only openvino. Builds Parameter -> N x Relu -> Result and times
``Core.compile_model(model, "CPU")``, then the same with the CPU plugin's
``SNIPPETS_MODE=DISABLE``. Usage: python openvino_cpu_compile_chain.py [N,N,...]
(default 250,500,1000,1500; 2000 alone takes 20-55 s on a shared 2-vCPU machine).
"""

import sys
import time

import openvino as ov
import openvino.opset13 as ops


def chain(n: int) -> ov.Model:
    x = ops.parameter([1, 4], ov.Type.f32, name="x")
    y = x
    for _ in range(n):
        y = ops.relu(y)
    return ov.Model([y], [x], f"chain{n}")


def main() -> None:
    sizes = [int(n) for n in (sys.argv[1] if len(sys.argv) > 1 else "250,500,1000,1500")
             .split(",")]
    print("openvino", ov.get_version())
    core = ov.Core()
    configs = {"default": {}, "SNIPPETS_MODE=DISABLE": {"SNIPPETS_MODE": "DISABLE"}}
    for label, extra in configs.items():
        last = None
        for n in sizes:
            model = chain(n)
            start = time.perf_counter()
            core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32", **extra})
            took = time.perf_counter() - start
            growth = "" if last is None else f"  x{took / last[1]:.1f} for x{n / last[0]:g} nodes"
            print(f"{label:22s} N={n:5d}  compile_model {took:7.2f} s{growth}", flush=True)
            last = (n, took)


if __name__ == "__main__":
    main()
