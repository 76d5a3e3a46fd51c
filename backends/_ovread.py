"""Reading model bytes into an OpenVINO ``Model``, one encoding at a time.

* ``openvino``: two builders, the IR XML and its weights (the weights may be empty for a
  model without constants). The weights are copied once into an immutable buffer that
  OpenVINO shares, so a guest that reuses its buffer cannot change a loaded model.
* ``onnx``: one builder, read from memory.
* ``tensorflowlite`` and ``tensorflow`` (a frozen ``GraphDef``, or a ``SavedModel``:
  ``saved_model.pb`` alone or with ``variables.index`` and ``variables.data-00000-of-00001``
  as second and third builders): OpenVINO's frontends for these read files only, so the
  bytes go to a private temporary directory that is removed after reading.

Every failure is an InvalidEncodingError that names the backend and the reason.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov

from wasinn.enums import GraphEncoding
from wasinn.errors import InvalidEncodingError

from ._graphio import expect_builders
from .base import Builders
from .formats import detect_encoding, protobuf_fields

NAME = "openvino"


def _check_content(builders: Builders, encoding: GraphEncoding) -> None:
    """Refuse bytes that are recognisably another format than the one declared."""
    try:
        seen = detect_encoding(builders[:1])
    except InvalidEncodingError:
        return  # unknown to the sniffer: let OpenVINO's frontend judge and explain
    if seen is not encoding:
        raise InvalidEncodingError(
            f"{NAME}: the model was declared {encoding.value} but its first builder is "
            f"{seen.value} bytes"
        )


def _is_saved_model(data: bytes | bytearray | memoryview) -> bool:
    try:
        fields = protobuf_fields(data)
    except ValueError:
        return False
    # SavedModel: 1 = schema version (varint), 2 = meta graphs. GraphDef: 1 = node (bytes).
    return fields.get(1) == 0 or (set(fields) == {2})


def read_model(core: Any, builders: Builders, encoding: GraphEncoding) -> tuple[Any, object]:
    """The ``ov.Model`` for ``builders``, and a value the caller must keep alive with it."""
    if encoding is GraphEncoding.OPENVINO:
        expect_builders(NAME, builders, 2, "two builders: the IR XML and its weights")
        _check_content(builders, encoding)
        weights = np.frombuffer(bytes(builders[1]), dtype=np.uint8)
        try:
            shared = ov.Tensor(weights, ov.Shape([weights.size]), ov.Type.u8)
            model = core.read_model(bytes(builders[0]), shared)
        except Exception as exc:
            raise InvalidEncodingError(f"{NAME}: cannot read the IR: {_short(exc)}") from exc
        return model, weights
    if encoding is GraphEncoding.ONNX:
        expect_builders(NAME, builders, 1, "one builder holding an ONNX model")
        _check_content(builders, encoding)
        return _read(lambda: core.read_model(bytes(builders[0])), "ONNX model"), None
    if encoding is GraphEncoding.TENSORFLOWLITE:
        expect_builders(NAME, builders, 1, "one builder holding a TensorFlow Lite flatbuffer")
        _check_content(builders, encoding)
        return _read_files(core, {"model.tflite": builders[0]}, "model.tflite"), None
    if encoding is GraphEncoding.TENSORFLOW:
        if len(builders) == 3:
            files = {"saved_model.pb": builders[0], "variables/variables.index": builders[1],
                     "variables/variables.data-00000-of-00001": builders[2]}
            return _read_files(core, files, "."), None
        expect_builders(NAME, builders, 1, "one builder holding a frozen GraphDef or a "
                        "SavedModel (or three: saved_model.pb, variables.index, variables.data)")
        _check_content(builders, encoding)
        if _is_saved_model(builders[0]):
            return _read_files(core, {"saved_model.pb": builders[0]}, "."), None
        return _read_files(core, {"model.pb": builders[0]}, "model.pb"), None
    raise InvalidEncodingError(
        f"{NAME}: cannot read {encoding.value} models: expected openvino, onnx, "
        "tensorflow or tensorflowlite"
    )


def _read(reader: Any, what: str) -> Any:
    try:
        return reader()
    except Exception as exc:
        raise InvalidEncodingError(f"{NAME}: cannot read the {what}: {_short(exc)}") from exc


def _read_files(core: Any, files: dict[str, bytes | bytearray | memoryview], main: str) -> Any:
    with tempfile.TemporaryDirectory(prefix="wasinn-ov-") as tmp:
        root = Path(tmp)
        for name, data in files.items():
            path = root / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(memoryview(data).cast("B"))
        what = "SavedModel" if main == "." else main
        # A frontend may memory-map constants from the file; on POSIX such a mapping
        # outlives the file's removal, so the directory can go as soon as reading is done.
        return _read(lambda: core.read_model(str(root / main)), what)


def _short(exc: BaseException) -> str:
    """OpenVINO's messages carry C++ source locations; keep the lines that explain."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    useful = [ln for ln in lines if not ln.startswith(("Exception from", "Check '"))]
    return " ".join(useful or lines)[:500]
