"""``python -m wasinn.modelgen DIR``, the README's step before the example configs run:
without a library it needs, one line that says which and how to install it, and nothing
written (as ``wasinn demo`` says it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize("library", ["torch", "onnx"])
def test_a_missing_library_is_named_and_nothing_is_written(tmp_path: Path, library: str
                                                           ) -> None:
    # Before, without torch (pip install ".[onnxruntime]"): an 18-line traceback ending in
    # ModuleNotFoundError, and a models/ folder holding scale.onnx only. None in
    # sys.modules stands for a library not installed: its import fails.
    models = tmp_path / "models"
    child = (f"import runpy, sys\nsys.modules[{library!r}] = None\n"
             f"sys.argv = ['python -m wasinn.modelgen', {str(models)!r}]\n"
             "runpy.run_module('wasinn.modelgen', run_name='__main__', alter_sys=True)\n")
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 1, done.stderr
    assert done.stderr == (
        "python -m wasinn.modelgen: error: generating the example models (scale.onnx, "
        f"mobilenet.onnx) needs torch and onnx, and cannot import {library} (import of "
        f"{library} halted; None in sys.modules): expected pip install \"wasinn[all]\" (or "
        "torch and onnx installed beside wasinn)\n")
    assert done.stdout == ""
    assert not models.exists()


def test_the_help_says_what_it_needs() -> None:
    done = subprocess.run([sys.executable, "-m", "wasinn.modelgen", "--help"],
                          capture_output=True, text=True, timeout=120, check=True)
    assert "Needs torch and onnx" in " ".join(done.stdout.split())
