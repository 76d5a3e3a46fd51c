"""Content sniffing: every format recognised from its bytes, without importing a backend."""

from __future__ import annotations

import io
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from tests import backend_models
from tests.support import require_backend
from tests.tfmodels import relu_graphdef, relu_saved_model, relu_tflite
from wasinn import GraphEncoding, InvalidEncodingError, TensorType
from wasinn.backends import detect_encoding
from wasinn.backends.formats import protobuf_fields
from wasinn.modelgen import ModelFiles, affine_onnx, identity_onnx


@pytest.mark.parametrize(
    ("builders", "expected"),
    [
        (lambda: [affine_onnx()], GraphEncoding.ONNX),
        (lambda: [identity_onnx(TensorType.BF16)], GraphEncoding.ONNX),
        (lambda: [relu_graphdef()], GraphEncoding.TENSORFLOW),
        (lambda: [relu_saved_model()], GraphEncoding.TENSORFLOW),
        (lambda: [relu_tflite()], GraphEncoding.TENSORFLOWLITE),
        (lambda: [b"GGUF\x03\x00\x00\x00" + bytes(32)], GraphEncoding.GGML),
        (lambda: [b'<?xml version="1.0"?>\n<net name="m" version="11"></net>', b""],
         GraphEncoding.OPENVINO),
    ],
    ids=["onnx", "onnx-bf16", "graphdef", "savedmodel", "tflite", "gguf", "ir"],
)
def test_formats_are_detected(builders: object, expected: GraphEncoding) -> None:
    assert detect_encoding(builders()) is expected  # type: ignore[operator]


def test_generated_model_files_are_detected(small_mobilenet: ModelFiles) -> None:
    assert detect_encoding([small_mobilenet.onnx.read_bytes()]) is GraphEncoding.ONNX
    assert detect_encoding([small_mobilenet.torchscript.read_bytes()]) is GraphEncoding.PYTORCH
    ir = [small_mobilenet.ir_xml.read_bytes(), small_mobilenet.ir_bin.read_bytes()]
    assert detect_encoding(ir) is GraphEncoding.OPENVINO


def test_torch_export_archive_is_detected() -> None:
    require_backend("torch")
    builders, _ = backend_models.identity("pytorch", TensorType.F32)
    assert detect_encoding(builders) is GraphEncoding.PYTORCH


def test_memoryview_and_bytearray_builders() -> None:
    data = affine_onnx()
    assert detect_encoding([memoryview(data)]) is GraphEncoding.ONNX
    assert detect_encoding([bytearray(data)]) is GraphEncoding.ONNX


def _zip_with(name: str) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        archive.writestr(name, b"hello")
    return buf.getvalue()


@pytest.mark.parametrize(
    ("data", "what"),
    [
        (np.random.default_rng(3).integers(0, 256, 1000, dtype=np.uint8).tobytes(), "match no"),
        (b"", "match no"),
        (b"\xff\xff\xff\xff", "match no"),
        (_zip_with("readme.txt"), "neither a TorchScript archive"),
        (affine_onnx()[:40], "match no"),
    ],
    ids=["random", "empty", "bad-varint", "plain-zip", "truncated-onnx"],
)
def test_unknown_bytes_say_what_was_expected(data: bytes, what: str) -> None:
    with pytest.raises(InvalidEncodingError, match="autodetect") as info:
        detect_encoding([data])
    assert what in str(info.value)


def test_no_builders_is_invalid_encoding() -> None:
    with pytest.raises(InvalidEncodingError, match="empty builder list"):
        detect_encoding([])


def test_protobuf_fields_reads_top_level_fields() -> None:
    fields = protobuf_fields(affine_onnx())
    assert fields[7] == 2 and fields[8] == 2  # graph, opset_import: length-delimited
    with pytest.raises(ValueError, match="past the end"):
        protobuf_fields(b"\x0a\x10abc")


def test_sniffing_imports_no_backend_library() -> None:
    code = (
        "import sys; from wasinn.backends import detect_encoding;"
        "from wasinn.modelgen import affine_onnx; detect_encoding([affine_onnx()]);"
        "print(sorted(m for m in ('onnxruntime', 'openvino', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"
