"""OpenVINO CPU: a run that stops inside a dynamic-shape graph (a shape-inference failure,
or a cancel) leaves stale shape state in the CompiledModel; later runs, on new infer
requests too, return outputs of the wrong shape.

Uses only openvino and numpy; the models are built with openvino.opset13.

Part 1 (deterministic): y = Reshape(x, s) with x f32[?, 4] and s i64[2] an input. After a
good run with s = [4, 2], s = [3, 5] (15 elements for 8) fails as it should, but the same
inputs a second time "succeed" with the shape of the last good run, (4, 2).

Part 2 (a race: it depends on where the cancel lands): a dynamic chain of 100 x
(relu(x + 1), split, concat) over x f32[?, 64] (zeros give `steps` everywhere). A run on
`rows` rows is started and cancelled within 2 ms; then runs on 5, 5, 6, `rows`, 5 rows
(each on a new request) are checked.
"""

import random
import time

import numpy as np
import openvino as ov
import openvino.opset13 as ops

CONFIG = {"INFERENCE_PRECISION_HINT": "f32"}


def message(exc: Exception) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[-1][:110] if lines else repr(exc)


def part1(core: ov.Core) -> None:
    x = ops.parameter([-1, 4], ov.Type.f32, name="x")
    s = ops.parameter([2], ov.Type.i64, name="s")
    model = ov.Model([ops.reshape(x, s, special_zero=False)], [x, s], "reshape_to")
    compiled = core.compile_model(model, "CPU", CONFIG)
    data = np.arange(8, dtype=np.float32).reshape(2, 4)
    print("Part 1: y = Reshape(x, s), x of shape (2, 4)")
    for shape in ([4, 2], [3, 5], [3, 5], [3, 5], [8, 1], [3, 5]):
        request = compiled.create_infer_request()  # a new request each time
        try:
            (y,) = request.infer({"x": data, "s": np.array(shape, np.int64)}).values()
            print(f"  s = {shape}: output of shape {y.shape}")
        except RuntimeError as exc:
            print(f"  s = {shape}: RuntimeError: ...{message(exc)}")


def chain(steps: int) -> ov.Model:
    x = ops.parameter([-1, 64], ov.Type.f32, name="x")
    node = x
    for _ in range(steps):
        node = ops.relu(ops.add(node, ops.constant(np.ones(64, np.float32))))
        halves = [ops.slice(node, [0, lo], [2**31 - 1, lo + 32], [1, 1]) for lo in (0, 32)]
        node = ops.concat(halves, 1)
    return ov.Model([ops.result(node)], [x], "chain")


def part2(core: ov.Core, tries: int = 40) -> None:
    steps = 100
    compiled = core.compile_model(chain(steps), "CPU", CONFIG)
    rnd = random.Random(1)
    stopped, checked, wrong = 0, 0, []
    for _ in range(tries):
        rows = rnd.randint(1, 4)
        request = compiled.create_infer_request()
        request.start_async({"x": np.zeros((rows, 64), np.float32)})
        time.sleep(rnd.random() * 0.002)
        request.cancel()
        try:
            request.wait()
            continue  # it finished before the cancel
        except RuntimeError:
            stopped += 1
        for n in (5, 5, 6, rows, 5):
            (y,) = compiled.create_infer_request().infer(
                {"x": np.zeros((n, 64), np.float32)}).values()
            checked += 1
            if y.shape != (n, 64) or not np.all(y == steps):
                wrong.append(f"{n} rows after a cancelled run on {rows}: shape {y.shape}, "
                             f"values {np.unique(y)[:3].tolist()}")
    print(f"Part 2: {stopped} of {tries} runs cancelled midway; {len(wrong)} of the {checked} "
          "runs after them were wrong (expected shape (n, 64), every value 100)")
    for line in wrong[:6]:
        print("  " + line)


def main() -> None:
    print("openvino", ov.get_version())
    core = ov.Core()
    part1(core)
    part2(core)


if __name__ == "__main__":
    main()
