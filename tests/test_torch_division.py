"""Integer divisions in guests' PyTorch models that crashed the host (SIGFPE) on values a
guest chooses: a zero divisor for TorchScript's ``int`` ``%``, and the minimum by -1 for
its ``%``, ``//``, ``divmod``, ``math.gcd`` and for ``torch.div(..., rounding_mode=
"trunc")`` of int32/int64 tensors (TorchScript and torch.export alike), plus freezing a
model whose divisor is an attribute set to 0. The cases that crashed run in a child
process, so that a regression fails the test instead of killing the test run."""

from __future__ import annotations

import functools
import importlib.util
import io
import json
import logging
import random
import re
import signal
import struct
import subprocess
import sys
import tempfile
import textwrap
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import wasinn
from tests.backend_models import scripted
from tests.support import CORE_NN_IMPORTS, cpu_pool, in_process_guests, require_backend

MIN64 = -(2**63)
MIN32 = -(2**31)

#: Models as TorchScript source: forward(x, y) on int64 scalars (0-dim tensors).
MODELS = {
    "mod": "return torch.tensor(a % b)",
    "floordiv": "return torch.tensor(a // b)",
    "divmod": "q, r = divmod(a, b)\n        return torch.tensor([q, r])",
    "gcd": "return torch.tensor(math.gcd(a, b))",
    "gcd_swapped": "return torch.tensor(math.gcd(b, a))",
    "scalar_mod": "return torch.tensor(int(x.item() % y.item()))",
    "trunc": "return torch.div(x, y, rounding_mode='trunc')",
    "trunc_int32": "return torch.div(x.int(), y.int(), rounding_mode='trunc')",
    "trunc_by_int": "return torch.div(x, b, rounding_mode='trunc')",
    "trunc_by_scalar": "return torch.div(x, y.item(), rounding_mode='trunc')",
    "trunc_in_place": "return x.clone().div_(y, rounding_mode='trunc')",
    "tensor_floordiv": "return x // y",
    "tensor_mod": "return x % y",
}

#: What a run whose integer tensor division had a zero divisor gives.
TENSOR_ZERO_DIVISION = {
    "error": "BackendRuntimeError",
    "message": "pytorch: the model divided by zero: an integer division or remainder of "
               "tensors had a zero divisor (torch raised ZeroDivisionError)"}

#: A module defining ``M``, whose forward on int64 scalars x, y runs ``body``.
MODULE = """import math
import torch

class M(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a = int(x.item())
        b = int(y.item())
        {body}
"""
#: A model whose divisor is an attribute: freezing makes it a constant.
ATTRIBUTE_MODEL = """import torch

class M(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.d = d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (7 % self.d) + (-9223372036854775807 - 1) // self.d
"""

_CHILD_PRELUDE = f"MODULE = {MODULE!r}\n" + '''
import io, json, math, sys, tempfile, importlib.util
import numpy as np
import torch
from wasinn import Tensor
from wasinn.backends import Device
from wasinn.backends.pytorch import TorchBackend
from wasinn.enums import GraphEncoding

backend = TorchBackend()

def from_source(source):
    """The Python module ``source`` (TorchScript compiles only code it can read back)."""
    path = tempfile.mkdtemp() + "/model.py"
    open(path, "w").write(source)
    spec = importlib.util.spec_from_file_location("model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

def load_scripted(module, optimize=True):
    from wasinn.backends import LoadOptions
    buf = io.BytesIO()
    torch.jit.save(torch.jit.script(module), buf)
    return backend.load([buf.getvalue()], GraphEncoding.PYTORCH, Device.parse("cpu"),
                        LoadOptions(extra={"optimize": optimize}))

def scripted(body, optimize):
    return load_scripted(from_source(MODULE.format(body=body)).M(), optimize)

def run(graph, a, b, dtype=np.int64):
    feeds = {"x": Tensor.from_numpy(np.array(a, dtype)), "y": Tensor.from_numpy(np.array(b, dtype))}
    try:
        out = graph.run(feeds)
        return {"value": next(iter(out.values())).numpy().tolist()}
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}

def report(key, result):
    print(json.dumps([key, result]), flush=True)

'''


def _in_child(script: str) -> dict[str, Any]:
    """Run ``script`` (after the prelude) in a fresh interpreter; what it reported."""
    script = textwrap.dedent(script)
    assert not script.strip() or not script.lstrip("\n").startswith(" "), "not dedented"
    done = subprocess.run(
        [sys.executable, "-c", _CHILD_PRELUDE + script],
        capture_output=True, text=True, timeout=300, check=False,
    )
    results = dict(json.loads(line) for line in done.stdout.splitlines() if line.startswith("["))
    if done.returncode < 0:
        pytest.fail(f"the child was killed by {signal.Signals(-done.returncode).name} after "
                    f"{list(results)}: {done.stderr[-2000:]}")
    assert done.returncode == 0, f"the child failed after {list(results)}: {done.stderr[-2000:]}"
    return results


@pytest.fixture
def torch_backend() -> Any:
    require_backend("torch")
    from wasinn.backends.pytorch import TorchBackend

    return TorchBackend()


def test_torchscript_divisions_that_trapped_now_give_values_or_errors() -> None:
    require_backend("torch")
    script = f"""
    models = {MODELS!r}
    for optimize in (True, False):
        for name, body in models.items():
            graph = scripted(body, optimize)
            report(f"{{name}}/{{optimize}}/min", run(graph, {MIN64}, -1))
            if name == "trunc_int32":
                report(f"{{name}}/{{optimize}}/min32", run(graph, {MIN32}, -1))
            report(f"{{name}}/{{optimize}}/zero", run(graph, 7, 0))
    """
    results = _in_child(script)
    for optimize in (True, False):
        got = {name: results[f"{name}/{optimize}/min"] for name in MODELS}
        # The minimum by -1: the two's-complement wrap for a quotient, 0 for a remainder.
        assert got["mod"] == {"value": 0}
        assert got["floordiv"] == {"value": MIN64}
        assert got["divmod"] == {"value": [MIN64, 0]}
        assert got["gcd"] == got["gcd_swapped"] == {"value": 1}
        assert got["scalar_mod"] == {"value": 0}
        for name in ("trunc", "trunc_by_int", "trunc_by_scalar", "trunc_in_place",
                     "tensor_floordiv"):
            assert got[name] == {"value": MIN64}, name
        assert got["tensor_mod"] == {"value": 0}
        assert results[f"trunc_int32/{optimize}/min32"] == {"value": MIN32}
        # A zero divisor: the guard's ZeroDivisionError (the model raised it) or, for
        # tensors, torch's own: a runtime-error either way, never a crash.
        for name in ("mod", "floordiv", "divmod", "scalar_mod"):
            assert results[f"{name}/{optimize}/zero"] == {
                "error": "BackendRuntimeError",
                "message": "pytorch: the model raised builtins.ZeroDivisionError: integer "
                           "division or modulo by zero"}, name
        # Before: InvalidArgumentError, "the TorchScript model rejected its inputs (it
        # declares no types or shapes ...)", though the inputs were fine.
        for name in ("trunc", "trunc_int32", "trunc_by_int", "trunc_by_scalar",
                     "trunc_in_place", "tensor_floordiv", "tensor_mod"):
            assert results[f"{name}/{optimize}/zero"] == TENSOR_ZERO_DIVISION, name
        assert results[f"gcd/{optimize}/zero"] == {"value": 7}


def test_an_interruptible_torchscript_models_tensor_division_by_zero_is_a_runtime_error(
        ) -> None:
    # Before: TorchScript's interpreter passed on the checkpoints' operator error without
    # its message, and the run read as inputs the model rejected (invalid-argument).
    require_backend("torch")
    script = f"""
    from wasinn.backends import LoadOptions
    for name in ("tensor_floordiv", "tensor_mod", "trunc"):
        buf = io.BytesIO()
        module = from_source(MODULE.format(body={MODELS!r}[name])).M()
        torch.jit.save(torch.jit.script(module), buf)
        graph = backend.load([buf.getvalue()], GraphEncoding.PYTORCH, Device.parse("cpu"),
                             LoadOptions(extra={{"interruptible": True}}))
        report(name, run(graph, 7, 0))
        report(name + "/ok", run(graph, 7, 2))
    """
    results = _in_child(script)
    for name in ("tensor_floordiv", "tensor_mod", "trunc"):
        assert results[name] == TENSOR_ZERO_DIVISION, name
    assert results["tensor_floordiv/ok"] == results["trunc/ok"] == {"value": 3}
    assert results["tensor_mod/ok"] == {"value": 1}


def test_a_model_dividing_by_an_attribute_set_to_zero_loads_and_its_runs_fail() -> None:
    # Before: freezing folded 7 % self.d with d == 0 and the host died inside the load.
    require_backend("torch")
    script = f"""
    M = from_source({ATTRIBUTE_MODEL!r}).M
    for d in (0, -1, 3):
        graph = load_scripted(M(d))
        try:
            out = graph.run({{"x": Tensor.from_numpy(np.array([1]))}})["output"]
            report(str(d), {{"value": out.numpy().tolist()}})
        except Exception as exc:
            report(str(d), {{"error": type(exc).__name__, "message": str(exc)}})
    """
    results = _in_child(script)
    assert results["0"] == {"error": "BackendRuntimeError", "message": "pytorch: the model "
                            "raised builtins.ZeroDivisionError: integer division or modulo by zero"}
    assert results["-1"] == {"value": [1 + 0 + MIN64]}  # 7 % -1 == 0; MIN // -1 wraps
    assert results["3"] == {"value": [1 + 1 + MIN64 // 3]}


def test_exported_truncating_divisions_give_the_wrapped_quotient() -> None:
    require_backend("torch")
    script = """
    class ByTensor(torch.nn.Module):
        def forward(self, x, y):
            return torch.div(x, y, rounding_mode="trunc")
    class ByScalar(torch.nn.Module):
        def forward(self, x):
            return torch.div(x, -1, rounding_mode="trunc")
    class InPlace(torch.nn.Module):
        def forward(self, x, y):
            z = x.clone()
            z.div_(y, rounding_mode="trunc")
            return z
    def exported(module, args):
        buf = io.BytesIO()
        torch.export.save(torch.export.export(module, args), buf)
        return backend.load([buf.getvalue()], GraphEncoding.PYTORCH, Device.parse("cpu"))
    for dtype in (np.int64, np.int32):
        example = torch.tensor([5, -7, 1], dtype=getattr(torch, np.dtype(dtype).name))
        pair = (example, example.clone())  # one tensor twice would be one input
        low = np.iinfo(dtype).min
        feeds = {"x": Tensor.from_numpy(np.array([low, -7, 7], dtype)),
                 "y": Tensor.from_numpy(np.array([-1, 2, -1], dtype))}
        for name, module in (("tensor", ByTensor()), ("in_place", InPlace())):
            graph = exported(module, pair)
            out = graph.run(feeds)["output"]
            report(f"{name}/{np.dtype(dtype).name}", {"value": out.numpy().tolist()})
            report(f"{name}/{np.dtype(dtype).name}/zero", run(graph, [7, 1, 2], [2, 0, 1], dtype))
    graph = exported(ByScalar(), (torch.tensor([5, -7]),))
    feeds = {"x": Tensor.from_numpy(np.array([-9223372036854775807 - 1, 7]))}
    report("scalar", {"value": graph.run(feeds)["output"].numpy().tolist()})
    """
    results = _in_child(script)
    for name in ("tensor", "in_place"):
        assert results[f"{name}/int64"] == {"value": [MIN64, -3, -7]}
        assert results[f"{name}/int32"] == {"value": [MIN32, -3, -7]}
        for dtype in ("int64", "int32"):
            assert results[f"{name}/{dtype}/zero"] == TENSOR_ZERO_DIVISION, (name, dtype)
    assert results["scalar"] == {"value": [MIN64, -7]}


async def test_a_legacy_guest_dividing_a_tensor_by_zero_gets_runtime_error(
        tmp_path: Path) -> None:
    # Before: invalid_argument (1), from "the TorchScript model rejected its inputs".
    require_backend("torch")
    import torch

    from wasinn.host.abi import Errno

    class FloorDivide(torch.nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return x // y

    model = scripted(FloorDivide())
    memory = bytearray(4096)
    struct.pack_into("<2I", memory, 0, 4096, len(model))  # the graph builder
    for record, values in ((128, 512), (160, 528)):  # x, y: i64[2] (WITX type 5)
        struct.pack_into("<2IB3xII", memory, record, 256, 1, 5, values, 16)
    struct.pack_into("<I", memory, 256, 2)
    struct.pack_into("<4q", memory, 512, 7, 1, 0, 1)  # x = [7, 1], y = [0, 1]
    data = "".join(f"\\{b:02x}" for b in memory + model)
    guest = tmp_path / "divide_by_zero.wat"
    guest.write_text(f"""(module{CORE_NN_IMPORTS}
  (memory (export "memory") {(len(memory) + len(model)) // 65536 + 1})
  (data (i32.const 0) "{data}")
  (func (export "_start") (local $e i32) (local $ctx i32)
    (local.set $e (call $load (i32.const 0) (i32.const 1) (i32.const 3) (i32.const 0)
                              (i32.const 64)))  ;; pytorch, cpu
    (if (local.get $e) (then (call $exit (i32.add (i32.const 100) (local.get $e)))))
    (local.set $e (call $init (i32.load (i32.const 64)) (i32.const 68)))
    (if (local.get $e) (then (call $exit (i32.add (i32.const 200) (local.get $e)))))
    (local.set $ctx (i32.load (i32.const 68)))
    (local.set $e (i32.or (call $set (local.get $ctx) (i32.const 0) (i32.const 128))
                          (call $set (local.get $ctx) (i32.const 1) (i32.const 160))))
    (if (local.get $e) (then (call $exit (i32.add (i32.const 300) (local.get $e)))))
    (call $exit (call $compute (local.get $ctx)))))""")
    async with wasinn.Runtime(in_process_guests(cpu_pool())) as rt:
        assert await rt.run_wasm(guest) == Errno.RUNTIME_ERROR


# -- no change where nothing traps (in process: none of these values can crash) ------------


@pytest.mark.parametrize("name", sorted(MODELS))
def test_guarded_models_agree_with_unguarded_ones_where_nothing_traps(
    name: str, torch_backend: Any, tmp_path: Any
) -> None:
    import importlib.util
    import io

    import torch

    from wasinn import GraphEncoding, Tensor
    from wasinn.backends import Device, LoadOptions

    path = tmp_path / f"{name}.py"
    path.write_text(MODULE.format(body=MODELS[name]))
    spec = importlib.util.spec_from_file_location(f"division_{name}", path)
    assert spec is not None and spec.loader is not None
    source = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(source)
    reference = torch.jit.script(source.M())
    buf = io.BytesIO()
    torch.jit.save(reference, buf)
    graphs = [torch_backend.load([buf.getvalue()], GraphEncoding.PYTORCH, Device.parse("cpu"),
                                 LoadOptions(extra={"optimize": optimize}))
              for optimize in (True, False)]
    rng = random.Random(name)
    pairs = [(-7, 2), (7, -2), (-7, -2), (MIN64, 2), (MIN64, 1), (2**63 - 1, -1), (5, -1)]
    pairs += [(rng.randrange(-10**6, 10**6), rng.choice([-1, 1]) * rng.randrange(1, 1000))
              for _ in range(20)]
    for a, b in pairs:
        if name == "trunc_int32" and not (MIN32 < a < 2**31 and MIN32 < b < 2**31):
            continue
        expected = reference(torch.tensor(a), torch.tensor(b)).numpy()
        for graph in graphs:
            got = graph.run({"x": Tensor.from_numpy(np.array(a)),
                             "y": Tensor.from_numpy(np.array(b))})["output"].numpy()
            np.testing.assert_array_equal(got, expected, err_msg=f"{name}({a}, {b})")


def test_divisions_by_safe_constants_and_float_divisions_get_no_guard(
    torch_backend: Any, tmp_path: Any
) -> None:
    import importlib.util

    import torch

    from wasinn.backends._torch_division import guard_torchscript_divisions

    path = tmp_path / "shapes.py"
    path.write_text(SHAPE_MODELS)
    spec = importlib.util.spec_from_file_location("division_shapes", path)
    assert spec is not None and spec.loader is not None
    models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(models)
    assert guard_torchscript_divisions(torch.jit.script(models.Shapes())) == 0
    assert guard_torchscript_divisions(torch.jit.script(models.Divides())) == 3


#: Divisions by constants other than 0 and -1 and float divisions (Shapes: no guard), and
#: three by values known at run time only (Divides).
SHAPE_MODELS = """import torch

class Shapes(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.size(0)
        return torch.div(x, 2, rounding_mode="trunc") + n // 2 + n % 3 + (x / 5.0).int()

class Divides(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        n = x.size(0)
        m = y.size(0)
        return torch.div(x, y, rounding_mode="trunc") + n // m + n % m
"""


# -- archives whose code torch.jit.load would fold into a division by zero -------------------

#: The model whose archive the crafted ones are made from: its code's forward is
#: ``return torch.add(x, 1)``.
PLAIN_MODEL = """import torch

class M(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.add(x, 1)
"""
#: Bodies of a crafted forward(self, x): the serialized code's own indentation (4 spaces).
CRAFTED = {
    "literal": "    return torch.add(x, torch.remainder(7, 0))",
    "computed": "    d = torch.sub(1, 1)\n    return torch.add(x, torch.remainder(7, d))",
    "operator": "    return torch.add(x, (-9223372036854775807 - 1) // -1)",
    "gcd": "    return torch.add(x, torch.gcd(-9223372036854775807 - 1, -1))",
    "branch": ("    d = 0\n    if bool(torch.gt(torch.sum(x), 0)):\n"
               "      d = torch.size(x, 0)\n    else:\n      pass\n"
               "    return torch.add(x, torch.remainder(7, d))"),
}
#: Divisions whose divisor comes at run time: loaded, and guarded as they run.
RUN_TIME = {
    "carried": ("    i = 0\n    r = 0\n    for _0 in range(2):\n      r = torch.remainder(7, i)\n"
                "      i = torch.add(i, 1)\n    return torch.add(x, r)"),
    "argument": "    return torch.add(x, torch.remainder(7, torch.size(x, 0)))",
    "reassigned": ("    d = 0\n    d = torch.size(x, 0)\n"
                   "    return torch.add(x, torch.remainder(7, d))"),
}


@functools.cache
def _plain_archive() -> bytes:
    """PLAIN_MODEL as a TorchScript archive (scripting reads the class from its file)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, "plain_model.py")
        path.write_text(PLAIN_MODEL)
        spec = importlib.util.spec_from_file_location("plain_model", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return scripted(module.M())


def crafted_archive(body: str) -> bytes:
    """PLAIN_MODEL's archive with ``body`` (one of CRAFTED's, RUN_TIME's) as its forward's
    serialized code: code torch itself would not write."""
    source = zipfile.ZipFile(io.BytesIO(_plain_archive()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for info in source.infolist():
            data = source.read(info.filename)
            if info.filename.endswith(".py"):
                data = data.replace(b"    return torch.add(x, 1)", body.encode())
            archive.writestr(info, data)
    return out.getvalue()


def test_archives_whose_code_folds_a_division_are_refused_before_torch_compiles_it() -> None:
    # Before: torch.jit.load folded torch.remainder(7, 0) as it compiled the code, and the
    # host died (SIGFPE) inside the load.
    require_backend("torch")
    script = f"""
    from tests.test_torch_division import crafted_archive
    for name, body in {{**{CRAFTED!r}, **{RUN_TIME!r}}}.items():
        try:
            graph = backend.load([crafted_archive(body)], GraphEncoding.PYTORCH,
                                 Device.parse("cpu"))
        except Exception as exc:
            report(name, {{"error": type(exc).__name__, "message": str(exc)}})
            continue
        try:
            out = graph.run({{"x": Tensor.from_numpy(np.array([1.0, 2.0], np.float32))}})
            report(name, {{"value": out["output"].numpy().tolist()}})
        except Exception as exc:
            report(name, {{"error": type(exc).__name__, "message": str(exc)}})
    """
    results = _in_child(script)
    for name in CRAFTED:
        assert results[name]["error"] == "SecurityError", (name, results[name])
        assert "divides constants in forward()" in results[name]["message"]
        assert "torch.jit.load would compute that division" in results[name]["message"]
        assert re.search(WAY_OUT, results[name]["message"]), results[name]["message"]
    assert results["carried"]["error"] == "BackendRuntimeError"  # 7 % 0 in the first pass
    assert "integer division or modulo by zero" in results["carried"]["message"]
    assert results["argument"] == results["reassigned"] == {"value": [2.0, 3.0]}  # 7 % 2


# -- archives whose code folds a division, in a sandbox process ----------------------------------

#: How a refusal in the host's process ends.
WAY_OUT = (r"; or load it sandboxed to run it unguarded, in a process of its own that a crash "
           r"ends instead of the host's \(sandbox = true in its \[models\.NAME\] table or "
           r"options=\{'sandbox': True\} in rt\.load; \[guests\] sandbox .*\)$")
#: Code folding a division that cannot trap: refused all the same in the host's process.
FOLDS_SAFELY = "    return torch.add(x, torch.remainder(7, 6))"


def test_refusal_off_logs_a_folded_division_instead(caplog: pytest.LogCaptureFixture) -> None:
    require_backend("torch")
    from wasinn.backends._torch_division import check_folded_divisions
    from wasinn.errors import SecurityError

    sources = [("code/__torch__/model.py",
                f"def forward(self, x):\n{CRAFTED['literal']}\n")]
    with pytest.raises(SecurityError, match=(
            r"^pytorch: the TorchScript code code/__torch__/model\.py divides constants in "
            r"forward\(\) \(line 2: torch\.remainder\(7, 0\)\): torch\.jit\.load would "
            r"compute that division as it compiles the code, where a zero divisor, or the "
            r"minimum by -1, kills the process, so the archive is refused in the host's "
            r"process: expected the divisions of a model torch saved, whose constants it has "
            r"folded already" + WAY_OUT)):
        check_folded_divisions("pytorch", sources, refuse_unguardable=True)
    with caplog.at_level(logging.DEBUG, logger="wasinn.backends"):
        check_folded_divisions("pytorch", sources, refuse_unguardable=False)
    assert caplog.messages == [
        "pytorch: the TorchScript code code/__torch__/model.py divides constants in forward() "
        "(line 2: torch.remainder(7, 0)): torch.jit.load would compute that division as it "
        "compiles the code, where a zero divisor, or the minimum by -1, kills the process: "
        "loaded all the same in this sandbox process (a crash there ends only it, which the "
        "host reports as an error)"]


async def test_a_folded_division_loads_sandboxed_and_a_trapping_fold_fails_that_load_only(
) -> None:
    # In the host's process both archives are refused before torch.jit.load runs.
    require_backend("torch")
    from wasinn import InvalidEncodingError, SecurityError

    x = np.array([1.0, 2.0], np.float32)
    sandboxed = {"sandbox": True}
    async with wasinn.Runtime(cpu_pool(backends=["pytorch"])) as rt:
        for body in (FOLDS_SAFELY, CRAFTED["literal"]):
            with pytest.raises(SecurityError, match=WAY_OUT):
                await rt.load([crafted_archive(body)], "pytorch")
        graph = await rt.load([crafted_archive(FOLDS_SAFELY)], "pytorch", options=sandboxed)
        np.testing.assert_array_equal((await graph.compute({"x": x}))["output"].numpy(),
                                      [2.0, 3.0])  # x + 7 % 6
        with pytest.raises(InvalidEncodingError, match=(
                r"^pytorch: the process loading the model was killed by SIGFPE: the library "
                r"crashed on it \(the host goes on\)$")):
            await rt.load([crafted_archive(CRAFTED["literal"])], "pytorch", options=sandboxed)
        np.testing.assert_array_equal((await graph.compute({"x": x}))["output"].numpy(),
                                      [2.0, 3.0])
        await graph.unload()
