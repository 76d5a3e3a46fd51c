"""Content sniffing: every format recognised from its bytes, without importing a backend."""

from __future__ import annotations

import io
import struct
import subprocess
import sys
import tracemalloc
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests import backend_models
from tests.support import require_backend
from tests.tfmodels import relu_chain, relu_graphdef, relu_saved_model, relu_tflite
from wasinn import GraphEncoding, InvalidEncodingError, TensorType
from wasinn.backends import detect_encoding, formats
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
    with pytest.raises(InvalidEncodingError, match=r"^autodetect: a zip archive that cannot be "
                       r"read \(central directory entry 0 needs zip version 25.5 to extract "
                       r"\(the newest read is 6.3\)\): expected a TorchScript or torch.export "
                       r"archive$"):
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


# -- what sniffing reads is bounded ---------------------------------------------------------
def _counted(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Counts, in its one item, what the generator ``formats.<name>`` yields from now on:
    the protobuf fields or zip entries sniffing reads."""
    read = [0]
    generator = getattr(formats, name)

    def counting(*args: object) -> Iterator[object]:
        for item in generator(*args):
            read[0] += 1
            yield item

    monkeypatch.setattr(formats, name, counting)
    return read


def _listing(entries: int) -> bytes:
    """A zip archive of one member whose central directory lists it ``entries`` times
    (48 bytes each), as a hostile guest's model may: zip64 end records give the count."""
    one = _zip_with("a")
    start, end = one.find(b"PK\x01\x02"), one.rfind(b"PK\x05\x06")
    directory = one[start:end] * entries
    record = struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, entries, entries,
                         len(directory), start)
    locator = struct.pack("<4sLQL", b"PK\x06\x07", 0, start + len(directory), 1)
    end_record = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF,
                             0xFFFFFFFF, 0)
    return one[:start] + directory + record + locator + end_record


def test_a_zip_listing_a_million_entries_is_sniffed_in_bounded_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: zipfile copied the whole archive and built a ZipInfo for every entry, in the
    # host, before any sandbox: a 94 MB archive listing 2 M entries took the host from
    # 270 MB to 1 GB (and 30 s), about 8 bytes of memory per byte a guest sent.
    data = _listing(1_000_000)
    read = _counted(monkeypatch, "central_directory_names")
    tracemalloc.start()
    try:
        with pytest.raises(InvalidEncodingError, match=(
                r"^autodetect: a zip archive of more than 65536 entries, none of the first "
                r"65536 a TorchScript archive's \(code/, constants.pkl\) or a torch.export "
                r"archive's \(archive_format\): to have the pytorch backend read it, declare "
                r"its encoding \(pytorch\) rather than autodetect$")):
            detect_encoding([data])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert read[0] == formats.SNIFF_ZIP_ENTRIES + 1  # one more: there are more
    assert peak < 1 << 20, f"{peak} bytes held sniffing {len(data)} bytes"


def test_a_listing_within_the_bound_is_read_to_its_end() -> None:
    # The same listing as zipfile reads it, and within the bound: a zip of no model.
    data = _listing(1000)
    assert zipfile.ZipFile(io.BytesIO(data)).namelist() == ["a"] * 1000
    with pytest.raises(InvalidEncodingError, match="neither a TorchScript archive"):
        detect_encoding([data])


@pytest.mark.parametrize(("field", "expected"), [
    (b"\x08\x00", None),  # field 1, varint 0: no model's
    (b"\x0a\x00", GraphEncoding.TENSORFLOW),  # field 1, empty: a GraphDef's nodes, as read
], ids=["varints", "empty-nodes"])
def test_millions_of_tiny_protobuf_fields_are_sniffed_a_bounded_number(
        monkeypatch: pytest.MonkeyPatch, field: bytes, expected: GraphEncoding | None) -> None:
    # Before: every top-level field was read, in Python, in the host: 80 MB of them cost
    # 62 s of its CPU, which no one could stop.
    data = field * 2_000_000
    read = _counted(monkeypatch, "protobuf_values")
    if expected is None:
        with pytest.raises(InvalidEncodingError, match=r"^autodetect: 4000000 bytes starting "
                           r"0800080008000800 match no known format"):
            detect_encoding([data])
    else:
        assert detect_encoding([data]) is expected
    assert read[0] == formats.SNIFF_FIELDS


def _onnx_with_metadata(entries: int) -> bytes:
    """:func:`affine_onnx` with ``entries`` metadata_props (field 14, one top-level field
    each, after the graph and opset_import), checked by onnx."""
    import onnx
    from onnx import helper

    model = onnx.load_from_string(affine_onnx())
    helper.set_model_props(model, {f"key{i}": str(i) for i in range(entries)})
    onnx.checker.check_model(model)
    return model.SerializeToString()


def test_real_models_of_more_top_level_fields_than_are_read_are_detected() -> None:
    graphdef, onnx_model = relu_chain(formats.SNIFF_FIELDS + 10), _onnx_with_metadata(
        formats.SNIFF_FIELDS + 10)
    for data in (graphdef, onnx_model):
        assert len(protobuf_fields(data)) < formats.SNIFF_FIELDS < sum(
            1 for _ in formats.protobuf_values(data))
    assert detect_encoding([graphdef]) is GraphEncoding.TENSORFLOW
    assert detect_encoding([onnx_model]) is GraphEncoding.ONNX


async def test_models_past_the_bound_load_through_autodetect(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The answer taken from the fields read is the library's: shown with a bound of 8
    # fields (a long GraphDef takes OpenVINO minutes to convert).
    require_backend("openvino")
    require_backend("onnxruntime")
    import wasinn

    monkeypatch.setattr(formats, "SNIFF_FIELDS", 8)
    x = np.array([[-1, 2, -3, 4]], np.float32)
    async with wasinn.Runtime() as rt:
        graph = await rt.load([relu_chain(12)], "autodetect")
        assert (await graph.compute({"x": x}))["y:0"].numpy().tolist() == [[0, 2, 0, 4]]
        graph = await rt.load([_onnx_with_metadata(12)], "autodetect")
        assert (await graph.compute({"x": x}))["y"].numpy().tolist() == [[-1, 5, -5, 9]]


def _scripted(tensors: int) -> bytes:
    """A TorchScript archive of ``tensors`` parameters, written as torch writes one: an
    entry for each tensor first, then data.pkl, code/, constants.pkl."""
    require_backend("torch")
    import torch

    class Sum(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weights = torch.nn.ParameterList(
                [torch.nn.Parameter(torch.full((1,), float(i))) for i in range(tensors)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for weight in self.weights:
                x = x + weight
            return x

    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(Sum()), buffer)
    return buffer.getvalue()


def test_a_torchscript_archive_is_told_by_an_entry_past_its_tensors(
        monkeypatch: pytest.MonkeyPatch) -> None:
    data = _scripted(20)
    names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    first = next(i for i, n in enumerate(names) if "/code/" in n)
    assert first == 21 and names[20] == "archive/data.pkl"  # data/0..19 before them
    read = _counted(monkeypatch, "central_directory_names")
    monkeypatch.setattr(formats, "SNIFF_ZIP_ENTRIES", first + 1)
    assert detect_encoding([data]) is GraphEncoding.PYTORCH
    assert read[0] == first + 1  # it stops at the first name of a model's
    monkeypatch.setattr(formats, "SNIFF_ZIP_ENTRIES", first)
    with pytest.raises(InvalidEncodingError, match="more than 21 entries, none of the first "
                                                   "21 a TorchScript archive's"):
        detect_encoding([data])


def test_a_torchscript_archive_past_the_bound_loads_declared(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # What the refusal says to do works: the backend, told the encoding, reads it.
    require_backend("torch")
    from wasinn import Tensor
    from wasinn.backends import Device
    from wasinn.backends.pytorch import TorchBackend

    monkeypatch.setattr(formats, "SNIFF_ZIP_ENTRIES", 4)
    data = _scripted(20)
    with pytest.raises(InvalidEncodingError, match="more than 4 entries"):
        detect_encoding([data])
    graph = TorchBackend().load([data], GraphEncoding.PYTORCH, Device.parse("cpu"))
    out = graph.run({"x": Tensor.from_numpy(np.zeros(1, np.float32))})
    assert next(iter(out.values())).numpy().tolist() == [190.0]  # 0 + 1 + ... + 19


def test_a_checkpoint_past_the_bound_is_still_refused_by_the_backend(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The backend's check reads every entry (its library reads them all next).
    require_backend("torch")
    import torch

    monkeypatch.setattr(formats, "SNIFF_ZIP_ENTRIES", 4)
    buffer = io.BytesIO()
    torch.save({f"w{i}": torch.zeros(1) for i in range(20)}, buffer)
    with pytest.raises(InvalidEncodingError, match=r"^pytorch: the model is a torch\.save "
                                                   r"checkpoint"):
        formats.check_not_torch_save("pytorch", buffer.getvalue())


def _ort_format(model: bytes, folder: Path) -> bytes:
    """``model`` saved by ONNX Runtime in its ORT (flatbuffers) format."""
    require_backend("onnxruntime")
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.optimized_model_filepath = str(folder / "model.ort")
    options.add_session_config_entry("session.save_model_format", "ORT")
    ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    return (folder / "model.ort").read_bytes()


async def test_an_ort_format_model_is_detected_as_onnx_and_loads(tmp_path: Path) -> None:
    # Before: "match no known format" (ONNX Runtime's ORTM identifier was not looked
    # for), although the same bytes declared onnx load.
    import wasinn

    data = _ort_format(affine_onnx(2.0, 1.0), tmp_path)
    assert data[4:8] == b"ORTM"
    assert detect_encoding([data]) is GraphEncoding.ONNX
    async with wasinn.Runtime() as rt:
        graph = await rt.load([data], "autodetect")
        assert graph.backend == "onnxruntime"
        out = await graph.compute({"x": np.ones((1, 4), np.float32)})
    assert out["y"].numpy().tolist() == [[3.0, 3.0, 3.0, 3.0]]


def test_a_graphdef_whose_bytes_4_to_8_read_ortm_stays_tensorflow() -> None:
    # node { name: "ORTMnode" }: the identifier is looked for only in bytes no protobuf
    # format claims.
    graphdef = b"\x0a\x0a\x0a\x08ORTMnode"
    assert graphdef[4:8] == b"ORTM"
    assert detect_encoding([graphdef]) is GraphEncoding.TENSORFLOW


def test_unknown_bytes_name_the_ort_format_among_those_expected() -> None:
    with pytest.raises(InvalidEncodingError, match=r"match no known format: expected ONNX "
                       r"\(protobuf, or ONNX Runtime's ORT format\), OpenVINO IR"):
        detect_encoding([b"\x14\x00\x00\x00ORTX" + bytes(16)])


def _affine_pt2() -> bytes:
    require_backend("torch")
    (data,), _ = backend_models.affine("pytorch", 2.0, 1.0)
    return bytes(data)


_CUT_SHORT = (r"^{}: a zip archive that cannot be read \(no end of central directory record "
              r"in its last 64 KiB: the file may be cut short\): expected a TorchScript or "
              r"torch\.export archive$")


@pytest.mark.parametrize("missing", [100, 1000])
async def test_a_torch_export_archive_cut_short_is_not_called_a_checkpoint(
        missing: int) -> None:
    # Before: the end record found was that of the torch.save archive the .pt2 stores
    # its sample inputs in, and the model was called a torch.save checkpoint.
    import wasinn

    data = _affine_pt2()[:-missing]
    assert b"PK\x05\x06" in data[-64 * 1024:]  # the stored archive's end record is left
    with pytest.raises(InvalidEncodingError, match=_CUT_SHORT.format("autodetect")):
        detect_encoding([data])
    async with wasinn.Runtime() as rt:
        for encoding in ("autodetect", "pytorch"):
            with pytest.raises(InvalidEncodingError,
                               match=_CUT_SHORT.format(encoding)) as info:
                await rt.load([data], encoding)
            assert "torch.save" not in str(info.value)


async def test_archives_followed_by_other_bytes_still_load_through_autodetect() -> None:
    # An end record that does not end the bytes is still the archive's when its central
    # directory lies where it says (torch reads such files too).
    require_backend("torch")
    import torch

    import wasinn

    class Affine(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2.0 + 1.0

    scripted = io.BytesIO()
    torch.jit.save(torch.jit.script(Affine()), scripted)
    x = np.ones((1, 4), np.float32)
    async with wasinn.Runtime() as rt:
        for data in (_affine_pt2(), scripted.getvalue()):
            padded = data + bytes(1000)
            assert detect_encoding([padded]) is GraphEncoding.PYTORCH
            graph = await rt.load([padded], "autodetect")
            (y,) = (await graph.compute({"x": x})).values()
            assert y.numpy().tolist() == [[3.0] * 4]
