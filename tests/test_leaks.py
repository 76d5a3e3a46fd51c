"""Loads repeated for a long time leave nothing behind in the libraries' own caches:
OpenVINO's Core, torch's ShapeEnvs and torch.fx's generated sources."""

from __future__ import annotations

import gc
import inspect
import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests import backend_models
from tests.support import require_backend
from wasinn import GraphEncoding, InvalidArgumentError, Tensor
from wasinn.backends import Device

ROOT = Path(__file__).resolve().parents[1]
CPU = Device.parse("cpu")

# Runtimes opened and closed, each compiling on OpenVINO; every fourth keeps its output on
# the device (an ov.Tensor) past its runtime's close, read afterwards. Prints the live
# Cores and the entries of the properties cache.
_RUNTIMES = """
import gc, json, sys
import numpy as np, openvino as ov, trio
import wasinn
from wasinn.backends import _ov_compile
from wasinn.modelgen import affine_onnx

X = np.arange(8, dtype=np.float32).reshape(2, 4)

async def main(cycles):
    kept = []
    for i in range(cycles):
        async with wasinn.Runtime() as rt:
            graph = await rt.load([affine_onnx(2.0, 1.0)], "onnx", "cpu", backend="openvino")
            out = (await graph.compute({"x": X}, keep_on_device=True))["y"]
            assert isinstance(out.native, ov.Tensor), type(out.native)
            if i % 4 == 0:
                kept.append(out)
        if len(kept) > 3:  # read some while later runtimes come and go
            np.testing.assert_array_equal(kept.pop(0).numpy(), X * 2 + 1)
    for out in kept:
        np.testing.assert_array_equal(out.numpy(), X * 2 + 1)
    gc.collect()
    print(json.dumps({"cores": sum(type(o) is ov.Core for o in gc.get_objects()),
                      "cached": _ov_compile._supported_properties.cache_info().currsize}))

trio.run(main, int(sys.argv[1]))
"""


def test_runtimes_share_one_openvino_core() -> None:
    # Before: each Runtime's backend made its own Core, which the properties cache kept
    # for good: 400 runtimes, 400 Cores, RSS from 115 to 160 MiB. Dropping them instead
    # aborted the process now and then ("Owner died"): hence a child process here.
    require_backend("openvino")
    done = subprocess.run([sys.executable, "-c", _RUNTIMES, "24"], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {"cores": 1, "cached": 1}


def _shape_envs() -> int:
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    gc.collect()
    return sum(type(o) is ShapeEnv for o in gc.get_objects())


def _sources() -> int:
    from torch.fx import graph_module

    return len(graph_module._loader.eval_cache)


def _graph_modules() -> list[Any]:
    import torch

    gc.collect()
    # issubclass on the type: isinstance on some deprecated torch objects warns.
    return [o for o in gc.get_objects() if issubclass(type(o), torch.fx.GraphModule)]


def _ranged() -> bytes:
    """``y = x * 2 + 1`` over f32 ``(n, 4)`` with ``3 <= n <= 8``."""
    import io

    import torch

    class Affine(torch.nn.Module):
        def forward(self, x: Any) -> Any:
            return x * 2.0 + 1.0

    program = torch.export.export(Affine(), (torch.zeros(4, 4),),
                                  dynamic_shapes={"x": {0: torch.export.Dim("n", min=3, max=8)}})
    buf = io.BytesIO()
    torch.export.save(program, buf)
    return buf.getvalue()


def test_torch_export_loads_leave_no_shape_envs_or_sources() -> None:
    # Before: each load left its ShapeEnv (and fake tensors) in an unbounded lru_cache
    # of torch's, and 7 generated sources in torch.fx's: about 14 KB a load, for good.
    require_backend("torch")
    from wasinn.backends.pytorch import TorchBackend

    backend = TorchBackend()
    (data,), encoding = backend_models.affine("pytorch", 2.0, 1.0)
    x = Tensor.from_numpy(np.ones((2, 4), np.float32))

    def loads(count: int) -> None:
        for _ in range(count):
            graph = backend.load([data], encoding, CPU)
            assert graph.run({"x": x})["output"].numpy()[0, 0] == 3.0
            graph.close()

    # torch's bounded caches (256 entries each) keep a few dozen ShapeEnvs, however many
    # loads there are: how many of them are this test's depends on what ran before it in
    # the process, so the bound is on the total, far below one a load.
    envs = _shape_envs()
    loads(80)
    sources = _settled_sources(loads)
    loads(220)
    assert _shape_envs() - envs <= 100  # (before: one a load, 300)
    assert _settled_sources(loads) - sources <= 8  # (before: 7 a load)


def _unbounded_shape_env_caches() -> dict[str, int]:
    """The entries in each unbounded cache of ShapeEnv's methods."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    infos = {name: method.cache_info() for name, method in vars(ShapeEnv).items()
             if callable(getattr(method, "cache_info", None))}
    return {name: info.currsize for name, info in infos.items() if info.maxsize is None}


def test_forgetting_shape_envs_empties_every_unbounded_cache_of_theirs() -> None:
    # Exporting a program fills several (replace's, _find's, simplify's, ...). Before,
    # only constrain_symbol_range's was emptied.
    require_backend("torch")
    from wasinn.backends._torch_export_caches import forget_shape_envs

    _ranged()
    caches = _unbounded_shape_env_caches()
    assert {"constrain_symbol_range", "replace", "_find"} <= set(caches)
    assert any(caches.values())
    forget_shape_envs()
    assert {name: n for name, n in _unbounded_shape_env_caches().items() if n} == {}


def test_torch_export_loads_grow_no_unbounded_shape_env_cache() -> None:
    # On torch 2.11 each load adds to replace's and _find's caches (11 and 1 entries for
    # this program, each holding the load's ShapeEnv), which torch never empties: 300
    # loads kept 300 ShapeEnvs. (torch 2.13's loads leave those caches alone.)
    require_backend("torch")
    from wasinn.backends.pytorch import TorchBackend

    backend = TorchBackend()
    (data,), encoding = backend_models.affine("pytorch", 2.0, 1.0)

    def load() -> dict[str, int]:
        backend.load([data], encoding, CPU).close()
        return _unbounded_shape_env_caches()

    first = load()
    assert [load() for _ in range(4)] == [first] * 4


def _settled_sources(loads: Any) -> int:
    # A load drops the sources of modules gone by then: collected first (modules in
    # reference cycles live until a collection), then one more load.
    gc.collect()
    loads(1)
    return _sources()


def test_a_live_program_keeps_running_and_its_source_while_others_load() -> None:
    # What the loads clear must not be what a loaded program uses: one runs on another
    # thread, its dims' range checked, while others load and close.
    require_backend("torch")
    from wasinn.backends.pytorch import TorchBackend

    backend = TorchBackend()
    before = {id(m) for m in _graph_modules()}
    kept = backend.load([_ranged()], GraphEncoding.PYTORCH, CPU)
    modules = [m for m in _graph_modules() if id(m) not in before]
    assert modules
    sources = [inspect.getsource(type(m).forward) for m in modules]
    (data,), encoding = backend_models.affine("pytorch", 3.0, 0.0)
    stop, failures, runs = threading.Event(), [], [0]

    def keep_running() -> None:
        try:
            while not stop.is_set():
                n = 3 + runs[0] % 6
                x = np.arange(n * 4, dtype=np.float32).reshape(n, 4)
                y = kept.run({"x": Tensor.from_numpy(x)})["output"].numpy()
                np.testing.assert_array_equal(y, x * 2 + 1)
                with pytest.raises(InvalidArgumentError, match="size 9 in dimension 0, but the "
                                   "model was exported for 3 to 8"):
                    kept.run({"x": Tensor.from_numpy(np.ones((9, 4), np.float32))})
                runs[0] += 1
        except BaseException as exc:  # reported by the test's thread
            failures.append(exc)

    runner = threading.Thread(target=keep_running)
    runner.start()
    try:
        for _ in range(30):
            other = backend.load([data], encoding, CPU)
            other.close()
    finally:
        stop.set()
        runner.join()
    assert not failures, failures
    assert runs[0] > 0
    assert [inspect.getsource(type(m).forward) for m in modules] == sources
    kept.close()
