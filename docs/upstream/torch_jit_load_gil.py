"""PyTorch: torch.jit.load holds the GIL for the whole load, so every other Python thread
stops until it returns.

Uses only torch. A TorchScript module y = x @ W with W an f32 parameter of MODEL_MB
(default 256) MB is saved to a file; a ticker thread sleeps 1 ms in a loop and records its
longest gap while another thread runs torch.jit.load (from the path, then from a BytesIO),
and, for comparison, torch.load of the same weights saved as a state dict.
Usage: python torch_jit_load_gil.py [MODEL_MB]
"""

import io
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch


class MatMul(torch.nn.Module):
    def __init__(self, weights: torch.Tensor) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(weights, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


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
    print(f"torch {torch.__version__}, Python {sys.version.split()[0]}; model {megabytes} MB")
    torch.set_num_threads(1)
    weights = torch.ones(1024, megabytes * 2**20 // 4 // 1024)
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "matmul.pt"
        torch.jit.script(MatMul(weights)).save(str(script))
        state = Path(tmp) / "state.pt"
        torch.save({"w": weights}, str(state))
        del weights
        data = script.read_bytes()
        torch.jit.load(str(script))  # warm-up
        cases: dict[str, Callable[[], object]] = {
            "torch.jit.load(path)": lambda: torch.jit.load(str(script)),
            "torch.jit.load(BytesIO)": lambda: torch.jit.load(io.BytesIO(data)),
            "torch.load(state dict path)": lambda: torch.load(str(state)),
        }
        for round_ in range(2):
            for label, work in cases.items():
                took, gap = longest_pause(work)
                print(f"round {round_}  {label:28s} took {took * 1e3:7.1f} ms, "
                      f"longest pause of the other thread {gap * 1e3:7.1f} ms", flush=True)


if __name__ == "__main__":
    main()
