"""The classifier example, as a Python component guest (built with componentize-py).

Usage: ``classifier.wasm MODEL IMAGE [TARGET]``

``MODEL`` is a path to an ONNX file in a preopened directory, or ``name:NAME`` for a
model the host has registered (``load-by-name``). ``IMAGE`` is a file of raw
little-endian f32 values shaped 1x3x224x224. Prints the five best classes, one per
line as ``class<TAB>score``, and exits with 1 (printing the wasi-nn error code and
message, or the file error, to stderr) when anything fails.
"""

import sys

from componentize_py_types import Err
from wit_world import exports
from wit_world.imports import errors, graph, tensor

IMAGE_DIMS = [1, 3, 224, 224]


def _load(model: str, target: graph.ExecutionTarget) -> graph.Graph:
    if model.startswith("name:"):
        return graph.load_by_name(model[len("name:"):])
    with open(model, "rb") as f:
        return graph.load([f.read()], graph.GraphEncoding.ONNX, target)


def _top5(data: bytes) -> list[tuple[int, float]]:
    scores = memoryview(data).cast("f")  # wasm is little-endian, like tensor data
    best = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)[:5]
    return [(i, scores[i]) for i in best]


def classify(model: str, image_path: str, target_name: str) -> None:
    target = graph.ExecutionTarget[target_name.upper()]
    with open(image_path, "rb") as f:
        image = f.read()
    with _load(model, target) as g, g.init_execution_context() as ctx:
        # compute takes the input tensor over (own<tensor>): no drop on this side
        image_tensor = tensor.Tensor(IMAGE_DIMS, tensor.TensorType.FP32, image)
        outputs = ctx.compute([("input", image_tensor)])
        try:
            _name, out = outputs[0]
            for index, score in _top5(out.data()):
                print(f"{index}\t{score:.6f}")
        finally:
            for _, t_out in outputs:
                t_out.__exit__(None, None, None)


class Run(exports.Run):
    def run(self) -> None:
        args = sys.argv[1:]
        if len(args) not in (2, 3):
            print("usage: classifier MODEL IMAGE [cpu|gpu|tpu]", file=sys.stderr)
            raise Err(None)
        try:
            classify(args[0], args[1], args[2] if len(args) == 3 else "cpu")
        except Err as exc:
            err = exc.value
            if isinstance(err, errors.Error):
                print(f"wasi-nn error {err.code().name}: {err.data()}", file=sys.stderr)
                err.__exit__(None, None, None)
            raise Err(None) from None
        except Exception as exc:  # a file that cannot be read, a bad target name, ...
            print(f"classifier: {exc}", file=sys.stderr)
            raise Err(None) from None
