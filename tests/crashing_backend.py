"""A fake backend whose library "crashes", for the sandbox's containment tests only (the
real crash, OpenVINO's, is in tests/test_sandbox.py).

On :class:`~tests.fake_backend.FakeBackend`'s recipes: ``b"fake:add=1:loadcrash"`` kills
its process with SIGSEGV while loading; ``b"fake:add=1:slowload-if=PATH"`` takes a minute
to load while the file PATH exists; a run whose first input element is 666 kills it
with SIGSEGV, and one whose first element is 777 sleeps for a minute, deaf to
cancellation (as a TorchScript run between its loops is). A graph of
``b"fake:add=0:priorities"`` answers every run with the scheduling policy and nice value
of the thread that imported this module, then of the thread that runs it.

Outputs other than those the graph declares (``y: f32[?, 4]``), for the checks of a
run's outputs: a run whose first element is :data:`EXTRA_OUTPUT`, :data:`WRONG_TYPE`,
:data:`WRONG_DIM` or :data:`NO_OUTPUT` returns ``y`` and an undeclared ``z``, ``y`` as
i32, ``y`` of shape ``[n, 5]``, or nothing. The sandbox process checks its library's
outputs itself; loaded from ``b"fake:add=1:hostile"`` in one, the backend turns that
check off there first, as a compromised process would, so that only the host's check
is left.

For tests of spares still importing: imported at idle priority (as a spare imports),
this module waits while the file that the environment variable :data:`IMPORT_GATE`
names exists (30 s at most).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence

import numpy as np

from tests.fake_backend import FakeBackend, FakeGraph
from wasinn.backends.base import Builders, Device, LoadOptions, in_sandbox
from wasinn.enums import GraphEncoding
from wasinn.tensor import Tensor, as_tensor

CRASH = 666.0
DEAF = 777.0
EXTRA_OUTPUT = 801.0
WRONG_TYPE = 802.0
WRONG_DIM = 803.0
NO_OUTPUT = 804.0
IMPORT_GATE = "WASINN_TEST_IMPORT_GATE"


def _priority() -> tuple[int, int]:
    """The scheduling policy and nice value of the calling thread (Linux)."""
    tid = threading.get_native_id()
    return os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)


_gate = os.environ.get(IMPORT_GATE)
if _gate and sys.platform == "linux" and _priority()[0] == os.SCHED_IDLE:
    _until = time.monotonic() + 30  # a test that waits on it fails, not hangs
    while os.path.exists(_gate) and time.monotonic() < _until:
        time.sleep(0.02)

#: The scheduling policy and nice value of the thread that imported this module.
IMPORTED_AT = _priority() if sys.platform == "linux" else (0, 0)


class CrashingGraph(FakeGraph):
    priorities = False

    def run(self, inputs: Mapping[str, Tensor], *, outputs: Sequence[str] | None = None,
            keep_on_device: bool = False) -> dict[str, Tensor]:
        if self.priorities:
            return {"y": Tensor.from_numpy(np.array([[*IMPORTED_AT, *_priority()]],
                                                    np.float32))}
        first = float(as_tensor(inputs["x"]).numpy().reshape(-1)[0])
        if first == CRASH:
            os.kill(os.getpid(), signal.SIGSEGV)
        if first == DEAF:
            time.sleep(60)
        result = super().run(inputs, outputs=outputs, keep_on_device=keep_on_device)
        return _misanswered(first, result)


def _misanswered(first: float, result: dict[str, Tensor]) -> dict[str, Tensor]:
    """The outputs of a run whose first element is ``first``: ``result``, or other outputs
    than the graph declares (see the module docstring)."""
    if first == EXTRA_OUTPUT:
        return {**result, "z": result["y"]}
    if first == WRONG_TYPE:
        return {"y": Tensor.from_numpy(result["y"].numpy().astype(np.int32))}
    if first == WRONG_DIM:
        return {"y": Tensor.from_numpy(np.zeros((result["y"].dims[0], 5), np.float32))}
    if first == NO_OUTPUT:
        return {}
    return result


class _Unchecked:
    """Stands for :class:`wasinn.backends._sandbox_wire.DeclaredOutputs` in a sandbox
    process whose own check of its outputs is off (a hostile one)."""

    def __init__(self, backend: str, *args: object) -> None:
        self.backend = backend

    def problem(self, outputs: object, asked: object) -> None:
        return None


class CrashingBackend(FakeBackend):
    name = "crashing"

    def load(self, builders: Builders, encoding: GraphEncoding, device: Device,
             options: LoadOptions | None = None) -> CrashingGraph:
        graph = super().load(builders, encoding, device, options)
        recipe = bytes(builders[0]).decode()
        if recipe.endswith(":loadcrash"):
            os.kill(os.getpid(), signal.SIGSEGV)
        slow = [p.removeprefix("slowload-if=") for p in recipe.split(":")
                if p.startswith("slowload-if=")]
        if slow and os.path.exists(slow[0]):
            time.sleep(60)
        if recipe.endswith(":hostile") and in_sandbox():
            import wasinn.backends._sandbox_child as child

            vars(child)["DeclaredOutputs"] = _Unchecked
        crashing = CrashingGraph(self, device, graph.add, gated=False)
        crashing.priorities = recipe.endswith(":priorities")
        return crashing
