"""A backend standing in for a compromised sandbox process (a library bug that let a model
run code in the process that loaded it), for the host's checks of what such a process
answers (:mod:`wasinn.backends._sandbox_wire`, :mod:`wasinn.backends._sandbox_specs`).
Loaded in a sandbox process, its load replaces that process's answers with what the
model's bytes (a recipe) say; its graph declares ``x: f32[2]`` in and ``y: f32[2]`` out,
and computes ``y = x``.

* ``b"specs:" + JSON``: the load's answer has these keys replaced (the model's inputs,
  outputs, aliases, flag), as the JSON object gives them (``Infinity`` included).
* ``b"reply:" + JSON``: ``{"grow": N, "tensors": [...]}``: each run is answered with a
  request for an arena of N bytes (where the arena is smaller and N is given), then,
  asked again, with these tensor descriptions (``[name, type, dims, offset]``) over
  whatever the arena holds.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from wasinn.backends.base import (
    Backend,
    Builders,
    CompiledGraph,
    Device,
    LoadOptions,
    TensorSpec,
    in_sandbox,
)
from wasinn.enums import ExecutionTarget, GraphEncoding, TensorType
from wasinn.tensor import Tensor, as_tensor


class CompromisedGraph(CompiledGraph):
    def __init__(self, device: Device) -> None:
        self.device = device
        self.inputs = (TensorSpec("x", TensorType.F32, (2,)),)
        self.outputs = (TensorSpec("y", TensorType.F32, (2,)),)

    def run(self, inputs: Mapping[str, Tensor], *, outputs: Sequence[str] | None = None,
            keep_on_device: bool = False) -> dict[str, Tensor]:
        return {"y": Tensor.from_numpy(as_tensor(inputs["x"]).numpy().copy())}


class CompromisedBackend(Backend):
    name = "compromised"
    encodings = frozenset({GraphEncoding.GGML})

    def devices(self) -> list[Device]:
        return [Device(ExecutionTarget.CPU)]

    def sniff(self, builders: Builders) -> float:
        return 0.0

    def load(self, builders: Builders, encoding: GraphEncoding, device: Device,
             options: LoadOptions | None = None) -> CompromisedGraph:
        assert in_sandbox(), "only for a sandbox process"
        recipe = bytes(builders[0]).decode()
        kind, _, text = recipe.partition(":")
        import wasinn.backends._sandbox_child as child

        if kind == "specs":
            specs = child._specs

            def replaced(graph: CompiledGraph) -> dict[str, Any]:
                return {**specs(graph), **json.loads(text)}

            vars(child)["_specs"] = replaced
        elif kind == "reply":
            vars(child)["reply"] = _replies(child.reply, json.loads(text))
        return CompromisedGraph(device)


def _replies(real: Any, said: dict[str, Any]) -> Any:
    """The process's reply function, answering the load as ``real`` does and every run
    as ``said`` (see the module docstring)."""
    def reply(arena: Any, payload: dict[str, Any], tensors: Any = None, *, at: int = 0
              ) -> tuple[bytes, bool]:
        if "inputs" in payload:  # the load's answer, which describes the model
            return real(arena, payload, tensors, at=at)  # type: ignore[no-any-return]
        grow = said.get("grow")
        if grow and arena.size < grow:
            return json.dumps({"grow": grow}).encode(), False
        return json.dumps({"ok": True, "tensors": said["tensors"]}).encode(), True

    return reply


def ones() -> dict[str, Tensor]:
    """The inputs of a run."""
    return {"x": Tensor.from_numpy(np.ones(2, np.float32))}
