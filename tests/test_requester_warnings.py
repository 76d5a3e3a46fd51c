"""A fallback warning caused by a guest points at the guest, not at a line of trio's.

(A Python caller's warning points at its own line: test_scheduler's
test_the_fallback_warning_points_at_the_callers_line.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import wasinn
from tests.support import core_nn_guest_wat
from tests.test_scheduler import one_worker_config
from wasinn.enums import ExecutionTarget
from wasinn.modelgen import affine_onnx

_LOAD_ON_CPU = "(i32.const 1) (i32.const 1) (i32.const 0)\n"
_LOAD_ON_GPU = "(i32.const 1) (i32.const 1) (i32.const 1)\n"


def _gpu_guest(path: Path) -> Path:
    """A core guest that loads an ONNX model for the GPU (legacy ABI: the target binds at
    load), makes a context and exits with 0."""
    wat = core_nn_guest_wat(bytes(128), affine_onnx(2.0, 1.0), "(call $exit (i32.const 0))")
    assert _LOAD_ON_CPU in wat
    path.write_text(wat.replace(_LOAD_ON_CPU, _LOAD_ON_GPU))
    return path


async def test_a_guests_fallback_warning_points_at_the_guest(tmp_path: Path) -> None:
    # Before: outcome/_impl.py:103: RuntimeWarning: ..., the first frame outside wasinn of
    # a guest's thread, whose source line was printed under it.
    guest = _gpu_guest(tmp_path / "classify.wat")
    async with wasinn.Runtime(one_worker_config(fallback="cpu")) as rt:
        if any(d.kind is not ExecutionTarget.CPU for d in rt.devices):
            pytest.skip("this machine has a gpu or tpu device: nothing falls back")
        with pytest.warns(RuntimeWarning, match="target gpu falls back to cpu") as caught:
            assert await rt.run_wasm(guest) == 0
    assert [(r.filename, r.lineno) for r in caught] == [("classify.wat", 0)]


def test_the_command_prints_a_guests_warning_as_one_of_its_lines(tmp_path: Path) -> None:
    guest = _gpu_guest(tmp_path / "classify.wat")
    config = tmp_path / "fallback.toml"
    config.write_text('[runtime]\nfallback = "cpu"\n[pools.cpu]\nkind = "cpu"\n')
    done = subprocess.run(
        [sys.executable, "-m", "wasinn", "run", "--no-sandbox", "--config", str(config),
         str(guest)], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    if "no gpu device here" not in done.stderr:
        pytest.skip("this machine has a gpu device: nothing falls back")
    assert done.stderr.splitlines() == [
        "wasinn: warning: classify.wat: no gpu device here (devices: cpu): target gpu "
        "falls back to cpu"]
