"""PyTorch: torch.jit.load does not check that a tensor's storage record holds the bytes
its storage declares: a short record gives the module a tensor over memory past the
record (other heap contents), and an empty one a tensor whose first read kills the process.

Uses only torch (and zipfile to shorten one record of an archive torch wrote). A scripted
module holds w = 4096 f32 sevens (16,384 bytes, record archive/data/0); the archive is
rewritten with that record cut to KEEP bytes, loaded with torch.jit.load, and w is read.
Each case runs in a child process (this script, run with --child KEEP).
"""

import io
import re
import signal
import subprocess
import sys
import zipfile

import torch


class Sevens(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((4096,), 7.0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w


def child(keep: int) -> None:
    saved = io.BytesIO()
    torch.jit.save(torch.jit.script(Sevens()), saved)
    cut = io.BytesIO()
    with zipfile.ZipFile(saved) as src, zipfile.ZipFile(cut, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info.filename)
            dst.writestr(info, data[:keep] if info.filename.endswith("/data/0") else data)
    module = torch.jit.load(io.BytesIO(cut.getvalue()))
    w = module.w
    print(f"loaded: w has {w.numel()} elements, storage {w.untyped_storage().nbytes()} bytes;",
          end=" ", flush=True)
    tail = w[keep // 4:]
    text = re.findall(rb"[ -~]{12,}", tail.numpy().tobytes())
    print(f"w[{keep // 4}:] holds {int((tail != 7).sum())} values other than 7; "
          f"text in those bytes: {[t.decode()[:60] for t in text[:2]]}")


def main() -> None:
    print(f"torch {torch.__version__}")
    for keep in (16384, 16, 0):
        done = subprocess.run([sys.executable, __file__, "--child", str(keep)],
                              capture_output=True, text=True, timeout=120, check=False)
        outcome = done.stdout.strip()
        if done.returncode < 0:
            outcome += f" then the process was killed by {signal.Signals(-done.returncode).name}"
        elif done.returncode:
            outcome += " exception: " + done.stderr.strip().splitlines()[-1][:90]
        print(f"record archive/data/0 cut to {keep} of 16384 bytes: {outcome}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(int(sys.argv[2]))
    else:
        main()
