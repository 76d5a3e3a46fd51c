"""PyTorch: integer division of the type's minimum by -1 kills the process with SIGFPE in
torch.div(..., rounding_mode="trunc") and in TorchScript's int //, % and divmod (and %
by zero); TorchScript's compiler does the same while it constant-folds such a division.

Uses only torch. Each case runs in a child process. For comparison, tensor floor
division (//) and torch.remainder of the same operands return the wrapped results.
"""

import signal
import subprocess
import sys

import torch

MIN64 = "-9223372036854775808"
CASES = {
    "a // b, int64 tensors (comparison)":
        f"print((torch.tensor([{MIN64}]) // torch.tensor([-1])).tolist())",
    "torch.remainder, int64 tensors (comparison)":
        f"print(torch.remainder(torch.tensor([{MIN64}]), torch.tensor([-1])).tolist())",
    "torch.div(rounding_mode='trunc'), int64 tensors":
        f"print(torch.div(torch.tensor([{MIN64}]), torch.tensor([-1]), rounding_mode='trunc'))",
    "torch.div(rounding_mode='trunc'), int32 tensors":
        "i32 = torch.int32\n"
        "print(torch.div(torch.tensor([-2**31], dtype=i32), torch.tensor([-1], dtype=i32),"
        " rounding_mode='trunc'))",
    "TorchScript int a // b":
        "cu = torch.jit.CompilationUnit('def f(a: int, b: int) -> int:\\n    return a // b\\n')\n"
        f"print(cu.f({MIN64}, -1))",
    "TorchScript int a % b":
        "cu = torch.jit.CompilationUnit('def f(a: int, b: int) -> int:\\n    return a % b\\n')\n"
        f"print(cu.f({MIN64}, -1))",
    "TorchScript divmod(a, b)":
        "cu = torch.jit.CompilationUnit("
        "'def f(a: int, b: int) -> Tuple[int, int]:\\n    return divmod(a, b)\\n')\n"
        f"print(cu.f({MIN64}, -1))",
    "TorchScript int 7 % b, b = 0 (Python raises ZeroDivisionError)":
        "cu = torch.jit.CompilationUnit('def f(a: int, b: int) -> int:\\n    return a % b\\n')\n"
        "print(cu.f(7, 0))",
    "compiling TorchScript that returns torch.remainder(7, 0) + x":
        "cu = torch.jit.CompilationUnit("
        "'def f(x: int) -> int:\\n    return torch.remainder(7, 0) + x\\n')\n"
        "print('compiled')",
}


def main() -> None:
    print(f"torch {torch.__version__}")
    for label, code in CASES.items():
        done = subprocess.run([sys.executable, "-c", "import torch\n" + code],
                              capture_output=True, text=True, timeout=120, check=False)
        if done.returncode < 0:
            outcome = f"process killed by {signal.Signals(-done.returncode).name}"
        elif done.returncode:
            outcome = "exception: " + done.stderr.strip().splitlines()[-1][:90]
        else:
            outcome = done.stdout.strip()
        print(f"{label}: {outcome}", flush=True)


if __name__ == "__main__":
    main()
