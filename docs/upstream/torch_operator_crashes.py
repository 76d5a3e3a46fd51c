"""PyTorch (CPU): public operators given out-of-range index values, or a NaN, read or
write out of bounds and kill the process instead of raising.

Uses only torch. Each case runs in a child process, first with valid arguments, then with
the bad ones: embedding_bag with a negative offset, linalg.eigvals of a matrix holding a
NaN, ctc_loss with a target label beyond the classes, segment_reduce with offsets beyond
the data, and _pad_packed_sequence (what nn.utils.rnn.pad_packed_sequence calls) with a
negative batch size.
"""

import signal
import subprocess
import sys

import torch

F = "torch.nn.functional"
CASES = [
    ("embedding_bag, offsets [0, 2] / [0, -100000]",
     f"w = torch.ones(10, 3)\nprint({F}.embedding_bag(torch.tensor([1, 2, 3, 4]), w, "
     "torch.tensor([0, OFFSET]), mode='sum').tolist())", ("2", "-100000")),
    ("linalg.eigvals of [[X, 1], [1, 2]], X = 1.0 / nan",
     "print(torch.linalg.eigvals(torch.tensor([[X, 1.0], [1.0, 2.0]])).tolist())",
     ("1.0", "float('nan')")),
    ("ctc_loss, targets [[1, T]] of 4 classes, T = 2 / 2**30",
     "lp = torch.randn(5, 1, 4).log_softmax(2)\n"
     f"print({F}.ctc_loss(lp, torch.tensor([[1, T]]), torch.tensor([5]), torch.tensor([2])))",
     ("2", "2**30")),
    ("segment_reduce over 6 values, offsets [0, E], E = 6 / 2**40",
     "print(torch.segment_reduce(torch.arange(6.), 'sum', offsets=torch.tensor([0, E]),"
     " unsafe=False).tolist())", ("6", "2**40")),
    ("_pad_packed_sequence of 4 rows, batch_sizes [2, B], B = 2 / -100000",
     "print(torch._pad_packed_sequence(torch.arange(4.).reshape(4, 1), torch.tensor([2, B]),"
     " False, 0.0, 2)[0].shape)", ("2", "-100000")),
]


def main() -> None:
    print(f"torch {torch.__version__}")
    for label, template, values in CASES:
        placeholder = next(p for p in ("OFFSET", "X", "T", "E", "B") if p in template)
        outcomes = []
        for value in values:
            code = "import torch\n" + template.replace(placeholder, value)
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                  timeout=120, check=False)
            if done.returncode < 0:
                outcome = f"process killed by {signal.Signals(-done.returncode).name}"
                if done.stdout.strip():
                    outcome += f" (printed: {done.stdout.strip()[:70]})"
            elif done.returncode:
                outcome = "exception: " + done.stderr.strip().splitlines()[-1][:80]
            else:
                outcome = done.stdout.strip()[:80]
            outcomes.append(f"{placeholder} = {value}: {outcome}")
        print(f"{label}\n    " + "\n    ".join(outcomes), flush=True)


if __name__ == "__main__":
    main()
