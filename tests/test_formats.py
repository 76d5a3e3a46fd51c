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


_CHECKPOINT = (r"^autodetect: the model is a torch.save checkpoint \(pickled weights or a "
               r"pickled module\), not a TorchScript or torch.export archive, and is not "
               r"unpickled \(that would run any code it holds\): expected a model saved with "
               r"torch\.jit\.save\(torch\.jit\.script\(model\), f\) or "
               r"torch\.export\.save\(torch\.export\.export\(model, args\), f\)$")


async def test_a_torch_save_checkpoint_is_told_apart_from_a_model() -> None:
    # Before: taken for TorchScript (it holds a data.pkl too), and torch's reader then
    # called it corrupted ("PytorchStreamReader failed locating file constants.pkl").
    require_backend("torch")
    import torch

    import wasinn

    module = torch.nn.Linear(2, 2)
    saved = []
    for obj, legacy in [(module.state_dict(), False), (module, False),
                        (module.state_dict(), True)]:
        buffer = io.BytesIO()
        torch.save(obj, buffer, _use_new_zipfile_serialization=not legacy)
        saved.append(buffer.getvalue())
    async with wasinn.Runtime() as rt:
        for data in saved:
            with pytest.raises(InvalidEncodingError, match=_CHECKPOINT):
                detect_encoding([data])
            with pytest.raises(InvalidEncodingError, match=_CHECKPOINT):
                await rt.load([data], "autodetect")
    # A TorchScript archive holds code/ and constants.pkl besides its data.pkl.
    scripted = io.BytesIO()
    torch.jit.save(torch.jit.script(module), scripted)
    assert detect_encoding([scripted.getvalue()]) is GraphEncoding.PYTORCH


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


def _unreadable_zip() -> bytes:
    """A TorchScript-looking archive whose central directory says "version needed to
    extract: 25.5", which zipfile refuses with NotImplementedError."""
    data = bytearray(_zip_with("archive/data.pkl"))
    header = data.find(b"PK\x01\x02")  # the first central directory entry
    data[header + 6:header + 8] = (255).to_bytes(2, "little")
    return bytes(data)


def test_a_zip_that_zipfile_cannot_read_is_an_invalid_encoding() -> None:
    # Before: zipfile's NotImplementedError escaped detect_encoding (and Runtime.load).
    with pytest.raises(InvalidEncodingError, match=r"autodetect: a zip archive that cannot be "
                       r"read \(NotImplementedError: zip file version 25.5\)"):
        detect_encoding([_unreadable_zip()])


_IR = b'<?xml version="1.0"?>\n<net name="m" version="11"></net>'
_LICENCE = b"<!-- " + b"Copyright (C) Example Corp. Licensed under the Apache License 2.0. " * 40


@pytest.mark.parametrize("xml", [
    b"\xef\xbb\xbf" + _IR,
    _IR.replace(b"?>", b"?>\n" + _LICENCE + b"-->", 1),
    b"\xef\xbb\xbf" + _LICENCE + b"-->\n<?xml-stylesheet href='a'?><!DOCTYPE net>\n" + _IR[22:],
], ids=["bom", "long-comment", "bom-comment-pi-doctype"])
def test_ir_after_a_bom_or_a_long_prolog_is_detected(xml: bytes) -> None:
    # Before: only the first 512 bytes were looked at, and a byte-order mark hid "<?xml".
    assert detect_encoding([xml, b""]) is GraphEncoding.OPENVINO


@pytest.mark.parametrize("xml", [
    b'<?xml version="1.0"?>\n<html><net/></html>',
    b"<network/>",
    b"<!-- never closed <net>",
], ids=["net-not-root", "other-root", "open-comment"])
def test_xml_whose_root_is_not_net_is_not_ir(xml: bytes) -> None:
    with pytest.raises(InvalidEncodingError, match="match no"):
        detect_encoding([xml, b""])


def test_a_real_ir_with_a_bom_loads_through_autodetect() -> None:
    require_backend("openvino")
    from wasinn.backends import Device
    from wasinn.backends.openvino import OpenVinoBackend

    (xml, weights), _ = backend_models.affine_ir(2.0, 1.0)
    builders = [b"\xef\xbb\xbf" + xml, weights]
    encoding = detect_encoding(builders)
    graph = OpenVinoBackend().load(builders, encoding, Device.parse("cpu"))
    assert [s.describe() for s in graph.inputs] == ["x: f32[?, 4]"]


def test_protobuf_values_carry_varints() -> None:
    from wasinn.backends.formats import protobuf_records, protobuf_values

    message = b"\x08\x96\x01\x12\x02hi\x1d\x00\x00\x80\x3f"  # 1: 150, 2: "hi", 3: 1.0f
    assert [(n, w, bytes(v) if isinstance(v, memoryview) else v)
            for n, w, v in protobuf_values(message)] == [(1, 0, 150), (2, 2, b"hi"), (3, 5, None)]
    assert [(n, v is None) for n, _, v in protobuf_records(message)] == [
        (1, True), (2, False), (3, True)]
