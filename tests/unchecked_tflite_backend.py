"""OpenVINO without its TFLite check (:mod:`wasinn.backends._tflite_check`), for the test
that a crash of OpenVINO's TFLite frontend in a sandbox process ends only that process.
Loaded in one, it turns the check off there first, so that bytes the check refuses (one
changed byte of :func:`tests.tfmodels.relu_tflite`, which crashes the frontend with
SIGSEGV) reach the frontend, as bytes the check misses would.
"""

from __future__ import annotations

from wasinn.backends import _ovread
from wasinn.backends.base import Builders, Device, LoadOptions, in_sandbox
from wasinn.backends.openvino import OpenVinoBackend, OvGraph
from wasinn.enums import GraphEncoding


class UncheckedTfliteBackend(OpenVinoBackend):
    def load(self, builders: Builders, encoding: GraphEncoding, device: Device,
             options: LoadOptions | None = None) -> OvGraph:
        assert in_sandbox(), "only for a sandbox process"
        vars(_ovread)["check_tflite"] = lambda data: None
        return super().load(builders, encoding, device, options)
