"""The ``RunOptions`` of a cancellable ONNX Runtime run (for
:mod:`wasinn.backends.onnxruntime`, whose docstring describes cancellation in full).

A run under a cancellation passes its thread's own ``RunOptions`` (:func:`_run_options`),
whose ``terminate`` flag the cancellation sets (:func:`_terminate`); a thread keeps them
for its next run unless a cancellation reached it (the graph then drops them from
:data:`_spare`, as a late cancel could otherwise stop a later run).
"""

from __future__ import annotations

import threading
from typing import Any

import onnxruntime as ort

_spare = threading.local()
_GPU_GRAPH_ID = "gpu_graph_id"  # ORT's run config key for a captured CUDA graph's id


def _run_options() -> Any:
    """This thread's ``RunOptions`` for a cancellable run (see the module docstring)."""
    options = getattr(_spare, "options", None)
    if options is None:
        options = ort.RunOptions()
        # A terminated run is expected here: keep ORT's own error log off stderr.
        options.log_severity_level = 4
        # run_with_iobinding looks this entry up on every run, and a missing entry costs
        # a C++ exception turned into a Python one: 25-50 us a run. "0" is the value an
        # unset entry stands for (and only matters with CUDA graph capture, off here).
        options.add_run_config_entry(_GPU_GRAPH_ID, "0")
        _spare.options = options
    return options


def _terminate(options: Any) -> None:
    # Called from the cancelling thread: ORT reads the flag from its own threads.
    options.terminate = True
