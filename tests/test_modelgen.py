"""wasinn.modelgen: exports that a later run may reuse are whole or absent."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support import require_backend
from wasinn.modelgen import export_mobilenet, sample_image


@pytest.mark.slow
def test_an_interrupted_ir_export_leaves_nothing_a_later_export_reuses(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A Ctrl-C while OpenVINO writes the IR: before, the .xml and a truncated .bin stood
    # under their final names, and the next export (the next `wasinn demo`), finding all
    # four files, reused them.
    for library in ("torch", "onnxruntime", "openvino"):
        require_backend(library)
    import onnxruntime as ort
    import openvino as ov

    save_model = ov.save_model

    def interrupted(model: Any, path: str, **options: Any) -> None:
        save_model(model, path, **options)
        weights = Path(path).with_suffix(".bin")
        weights.write_bytes(weights.read_bytes()[:100])
        raise KeyboardInterrupt

    monkeypatch.setattr(ov, "save_model", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_mobilenet(tmp_path, width=0.1, seed=3)
    left = sorted(p.suffix for p in tmp_path.iterdir())
    assert left == [".onnx", ".pt"]  # whole, and no partial file behind

    monkeypatch.undo()
    files = export_mobilenet(tmp_path, width=0.1, seed=3)
    image = sample_image(seed=1)
    # (f32: OpenVINO's CPU plugin computes in bf16 where the CPU has it)
    ir = ov.Core().compile_model(str(files.ir_xml), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    [want] = ort.InferenceSession(str(files.onnx)).run(None, {"input": image})
    np.testing.assert_allclose(ir(image)[0], want, rtol=1e-4, atol=1e-4)
