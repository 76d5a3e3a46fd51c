"""An idle worker or compile thread holds nothing of the last job it ran.

A device's threads live as long as its actor and may stay idle for a long time (a
device's one busy hour a day, a compile thread after the start-up preloads). Whatever the
last job referenced (its inputs, its outputs, a compile's model and its bytes) must be
freed when its caller lets go of it, not when that thread's next job comes.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import trio

import wasinn
from wasinn.modelgen import affine_onnx


async def _settled() -> None:
    # The thread has signalled its job's end; let it get back to its inbox, then collect.
    for _ in range(20):
        await trio.sleep(0.01)
    gc.collect()


async def test_a_runs_inputs_and_outputs_are_freed_once_its_caller_lets_go() -> None:
    async with wasinn.Runtime() as rt:
        graph = await rt.load([affine_onnx()], encoding="onnx", target="cpu")
        inputs = np.ones((1, 4), np.float32)
        out = await graph.compute({"x": inputs})
        outputs = out["y"].numpy()
        assert outputs.tolist() == [[3.0] * 4]  # (the default affine: 2x + 1)
        inputs_ref, outputs_ref = weakref.ref(inputs), weakref.ref(outputs)
        del inputs, outputs, out
        await _settled()
        assert inputs_ref() is None, "a thread still holds the last run's inputs"
        assert outputs_ref() is None, "a thread still holds the last run's outputs"
        # The device still serves.
        again = await graph.compute({"x": np.zeros((1, 4), np.float32)})
        assert again["y"].numpy().tolist() == [[1.0] * 4]


async def test_an_unloaded_model_is_freed_while_the_runtime_serves() -> None:
    async with wasinn.Runtime() as rt:
        graph = await rt.load([affine_onnx()], encoding="onnx", target="cpu", name="gone")
        await graph.compute({"x": np.ones((1, 4), np.float32)})
        # (A LoadedModel takes no weak reference: its release hook, which only the
        # model holds, goes with it.)
        model = weakref.ref(graph._executable.on_release)  # type: ignore[attr-defined]
        await graph.unload()
        del graph
        await _settled()
        assert model() is None, "the compile thread still holds the unloaded model"
        # The runtime still loads and serves.
        other = await rt.load([affine_onnx(scale=3.0)], encoding="onnx", target="cpu")
        out = await other.compute({"x": np.ones((1, 4), np.float32)})
        assert out["y"].numpy().tolist() == [[4.0] * 4]
