"""A fake backend whose library "crashes", for the sandbox's containment tests only (the
real crash, OpenVINO's, is in tests/test_sandbox.py).

On :class:`~tests.fake_backend.FakeBackend`'s recipes: ``b"fake:add=1:loadcrash"`` kills
its process with SIGSEGV while loading; ``b"fake:add=1:slowload-if=PATH"`` takes a minute
to load while the file PATH exists; a run whose first input element is 666 kills it
with SIGSEGV, and one whose first element is 777 sleeps for a minute, deaf to
cancellation (as a TorchScript run between its loops is). A graph of
``b"fake:add=0:priorities"`` answers every run with the scheduling policy and nice value
of the thread that imported this module, then of the thread that runs it.

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
from wasinn.backends.base import Builders, Device, LoadOptions
from wasinn.enums import GraphEncoding
from wasinn.tensor import Tensor, as_tensor

CRASH = 666.0
DEAF = 777.0
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
        return super().run(inputs, outputs=outputs, keep_on_device=keep_on_device)


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
        crashing = CrashingGraph(self, device, graph.add, gated=False)
        crashing.priorities = recipe.endswith(":priorities")
        return crashing
