"""A registered ONNX model's external data, sent to its sandboxed graph's process (see
:mod:`.sandbox`).

A confined process may not read the model's folder, so the host reads the external data
files for it, and checks them (:mod:`._onnx_check`), at each load, and sends them with the
model as tensors named :data:`~._sandbox_child.EXTERNAL` + their location
(:func:`external_files`); the process hands them to its backend
(``LoadOptions.external_data``).
"""

from __future__ import annotations

from wasinn.enums import GraphEncoding, TensorType
from wasinn.errors import InvalidEncodingError
from wasinn.tensor import Tensor

from ._onnx_check import check_external_data, external_data_folder, read_external_data
from ._sandbox_child import EXTERNAL
from .base import Builders, LoadOptions
from .formats import detect_encoding


def external_files(backend: str, builders: Builders, encoding: GraphEncoding,
                   options: LoadOptions) -> dict[str, Tensor]:
    """The external data files of a registered ONNX model, for its process, which may not
    read the model's folder: tensors named :data:`EXTERNAL` + their location, which the
    process hands its backend (``LoadOptions.external_data``). Those the caller gave in
    ``options.external_data``, else read and checked here (see :func:`_read_external`)."""
    files = options.external_data or _read_external(backend, builders, encoding,
                                                    options.source)
    return {EXTERNAL + location: Tensor.from_bytes([len(data)], TensorType.U8, data)
            for location, data in files.items()}


def _read_external(backend: str, builders: Builders, encoding: GraphEncoding, source: str
                   ) -> dict[str, bytes]:
    """The external data files of the ONNX model the host read from the file ``source``,
    read and checked (see :mod:`._onnx_check`); again for each load (as a load in this
    process reads them), so that the host keeps no copy. Empty for another model, and
    for bytes that are no ONNX model (the process's backend says what is wrong with
    them)."""
    folder = external_data_folder(source)
    if folder is None or len(builders) != 1 or not _onnx(builders, encoding):
        return {}
    try:
        locations = check_external_data(backend, builders[0], folder)
    except InvalidEncodingError:
        return {}
    return read_external_data(backend, folder, locations) if locations else {}


def _onnx(builders: Builders, encoding: GraphEncoding) -> bool:
    if encoding is GraphEncoding.AUTODETECT:
        try:
            encoding = detect_encoding(builders)
        except InvalidEncodingError:
            return False
    return encoding is GraphEncoding.ONNX
