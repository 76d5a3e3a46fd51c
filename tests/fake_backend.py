"""A fake device backend, for ROUTING tests only (placement, compile-once, unload, queue
order on devices this machine lacks). Every model-path test uses the real backends.

Model bytes are a tiny recipe: ``b"fake:add=1"`` makes a graph computing ``y = x + 1`` on
``x: f32[n, 4]``; ``b"fake:bad"`` fails to compile. A run whose input has a negative first
element raises a library-style RuntimeError (to test error containment); one of 710 on a
device other than the CPU raises torch's message for a CUDA device-side assert, and so
does every later run on that device (``backend.lost``), as a real lost GPU would; a graph
built
with ``b"fake:add=1:gate"`` blocks each run until ``backend.gate`` is set; one built with
``b"fake:add=1:slowload"`` blocks its compile on a device other than the CPU until
``backend.load_gate`` is set (``backend.loading`` is set when such a compile starts).
Each graph counts its runs in progress (``running``), sets ``backend.started`` when one
starts, and notes a close that came while one was still going on
(``closed_while_running``).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from wasinn.backends.base import Backend, Builders, CompiledGraph, Device, LoadOptions, TensorSpec
from wasinn.enums import GraphEncoding, TensorType
from wasinn.errors import InvalidEncodingError
from wasinn.tensor import Tensor, as_tensor

#: The first input value that makes a run on a GPU fail as a CUDA device-side assert.
DEVICE_ASSERT = 710
#: torch's message for a CUDA device-side assert (c10's CUDA check).
CUDA_ASSERT_MESSAGE = (
    "CUDA error: device-side assert triggered\nCUDA kernel errors might be asynchronously "
    "reported at some other API call, so the stacktrace below might be incorrect.\nFor "
    "debugging consider passing CUDA_LAUNCH_BLOCKING=1")


class FakeNative:
    """Stands for a device-resident value (an OrtValue on a GPU, say)."""

    def __init__(self, array: np.ndarray[Any, Any], device: str) -> None:
        self.array = array
        self.device = device


class FakeGraph(CompiledGraph):
    def __init__(self, backend: FakeBackend, device: Device, add: float, gated: bool) -> None:
        self.backend = backend
        self.device = device
        self.add = add
        self.gated = gated
        self.closed = False
        self.running = 0
        self.closed_while_running = False
        self.inputs = (TensorSpec("x", TensorType.F32, (None, 4)),)
        self.outputs = (TensorSpec("y", TensorType.F32, (None, 4)),)

    def run(self, inputs: Mapping[str, Tensor], *, outputs: Sequence[str] | None = None,
            keep_on_device: bool = False) -> dict[str, Tensor]:
        self.running += 1
        self.backend.started.set()
        try:
            return self._compute(inputs, keep_on_device)
        finally:
            self.running -= 1

    def _compute(self, inputs: Mapping[str, Tensor], keep_on_device: bool
                 ) -> dict[str, Tensor]:
        assert not self.closed, "ran a closed graph"
        tensor = as_tensor(inputs["x"])
        native = tensor.native
        if isinstance(native, FakeNative) and native.device == self.device.name:
            x = native.array  # same device: no copy
        else:
            x = tensor.numpy()
        self.backend.runs.append((self.device.name, float(x.reshape(-1)[0])))
        if self.gated and not self.backend.gate.wait(timeout=30):
            raise RuntimeError("gate never opened")
        if x.size and x.reshape(-1)[0] < 0:
            raise RuntimeError("fake library exploded on a negative input")
        device = self.device.name
        if device != "cpu" and (device in self.backend.lost or
                                (x.size and x.reshape(-1)[0] == DEVICE_ASSERT)):
            self.backend.lost.add(device)
            raise RuntimeError(CUDA_ASSERT_MESSAGE)
        y = (x + self.add).astype(np.float32)
        if keep_on_device:
            value = FakeNative(y, self.device.name)
            return {"y": Tensor.from_native(value, y.shape, TensorType.F32,
                                            device=self.device.name,
                                            materialize=lambda: value.array)}
        return {"y": Tensor.from_numpy(y)}

    def close(self) -> None:
        self.closed_while_running = self.closed_while_running or self.running > 0
        self.closed = True
        self.backend.closed.append(self.device.name)


class FakeBackend(Backend):
    name = "fake"
    encodings = frozenset({GraphEncoding.GGML})

    def __init__(self, devices: Sequence[str] = ("cpu", "gpu:0", "gpu:1")) -> None:
        self._devices = [Device.parse(d) for d in devices]
        self.loads: list[str] = []
        self.runs: list[tuple[str, float]] = []
        self.closed: list[str] = []
        self.lost: set[str] = set()  # devices whose runs all fail as a lost GPU's do
        self.gate = threading.Event()
        self.started = threading.Event()  # set when any graph's run starts
        self.load_gate = threading.Event()
        self.loading = threading.Event()  # set when a slowload compile starts

    def devices(self) -> list[Device]:
        return list(self._devices)

    def sniff(self, builders: Builders) -> float:
        return 1.0 if bytes(builders[0][:5]) == b"fake:" else 0.0

    def load(self, builders: Builders, encoding: GraphEncoding, device: Device,
             options: LoadOptions | None = None) -> FakeGraph:
        recipe = bytes(builders[0]).decode(errors="replace")
        if not recipe.startswith("fake:add="):
            raise InvalidEncodingError(f"fake: cannot read {recipe[:20]!r}: expected fake:add=N")
        parts = recipe.removeprefix("fake:add=").split(":")
        if "slowload" in parts[1:] and device.name != "cpu":
            self.loading.set()
            if not self.load_gate.wait(timeout=30):
                raise RuntimeError("load gate never opened")
        self.loads.append(device.name)
        return FakeGraph(self, device, float(parts[0]), "gate" in parts[1:])
