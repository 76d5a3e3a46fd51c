"""Whether torch may compute f32 in TensorFloat-32 on CUDA (for :mod:`._torch_graph`).

TF32 keeps 10 bits of an f32's mantissa: on Ampere and later GPUs torch computes cuDNN
convolutions in it by default, which moves a MobileNetV2's logits by about 4e-2 (seen on
an H100: 4.35e-02 from a float64 reference, against 2.8e-05 in f32). The settings are
process-wide in torch, so a graph's run sets its own before it starts.

torch (2.9 and later) keeps them at three levels: the kernel kind's
(``torch.backends.cudnn.conv.fp32_precision``, ``cudnn.rnn``, ``cuda.matmul``), the
library's (``cudnn.fp32_precision``) and the process's (``torch.backends.fp32_precision``),
a kind's ``"none"`` deferring to the level above. The older ``allow_tf32`` flags are read
from and written to the library's level, so where an application set a finer level, the
flags may read False while convolutions still run in TF32. Here each kind's own effective
setting is what is checked; the flags are written first (which keeps both APIs readable);
a kind they did not reach is then set by itself.

Being process-wide, one run's setting would hold for another's kernels launched at the
same time: :func:`tf32_runs` lets runs of one setting launch side by side, and has a run
of the other wait until they are done (and runs of the first that come after it wait
for it, so that neither starves).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import torch

_ALL_LEVELS = "none"  # a kind's setting that defers to the level above


@functools.cache  # (the same objects for the life of the process)
def _kinds() -> list[tuple[Any, Any]]:
    """Each kernel kind's settings with its library's: none where torch predates them."""
    cudnn: Any = torch.backends.cudnn
    kinds = [(getattr(cudnn, "conv", None), cudnn), (getattr(cudnn, "rnn", None), cudnn),
             (torch.backends.cuda.matmul, None)]
    if not all(hasattr(kind, "fp32_precision") for kind, _ in kinds):
        return []
    return kinds


def _effective(kind: Any, library: Any) -> str:
    for level in (kind, library, torch.backends):
        value = str(getattr(level, "fp32_precision", _ALL_LEVELS)) if level is not None \
            else _ALL_LEVELS
        if value != _ALL_LEVELS:
            return value
    return _ALL_LEVELS


def _agrees(allow: bool) -> bool:
    kinds = _kinds()
    if not kinds:  # torch before 2.9: the flags alone
        flags: Any
        for flags in (torch.backends.cudnn, torch.backends.cuda.matmul):
            try:
                if flags.allow_tf32 != allow:
                    return False
            except RuntimeError:  # (read as mixed: set it right)
                return False
        return True
    return all((_effective(kind, library) == "tf32") == allow for kind, library in kinds)


def cuda_allow_tf32(allow: bool) -> None:
    """Let torch compute f32 cuDNN convolutions and RNNs and CUDA matrix products in
    TF32, or not, whatever level an application set before (a write only where a kind's
    effective setting differs)."""
    if _agrees(allow):
        return
    flags: Any
    for flags in (torch.backends.cudnn, torch.backends.cuda.matmul):
        flags.allow_tf32 = allow
    if not _agrees(allow):
        for kind, _ in _kinds():
            kind.fp32_precision = "tf32" if allow else "ieee"


class _Runs:
    """The runs launching under one TF32 setting now, and those waiting for the other."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.allow = False
        self.running = 0
        self.waiting = {False: 0, True: 0}


_RUNS = _Runs()


def _held_back(runs: _Runs, allow: bool) -> bool:
    # Behind runs of the other setting; and behind a run of the other setting that waits,
    # whether runs of this one are still going or have just ended (the setting then
    # alternates: neither starves).
    if runs.running and runs.allow != allow:
        return True
    return runs.allow == allow and runs.waiting[not allow] > 0


@contextlib.contextmanager
def tf32_runs(allow: bool | None) -> Iterator[None]:
    """Launch a CUDA run's kernels with TF32 allowed or not (``allow``; None: whatever torch
    is set to, untouched and unwaited) while no run of the other setting launches: a run
    of the other setting, or one waiting already, holds this one back until it is done."""
    if allow is None:
        yield
        return
    runs = _RUNS
    with runs.changed:
        runs.waiting[allow] += 1
        try:
            while _held_back(runs, allow):
                runs.changed.wait()
        finally:
            runs.waiting[allow] -= 1
        cuda_allow_tf32(allow)  # (an application may have changed it since the last run)
        runs.allow = allow
        runs.running += 1
    try:
        yield
    finally:
        with runs.changed:
            runs.running -= 1
            if not runs.running:
                runs.changed.notify_all()
