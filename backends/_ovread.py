"""Reading model bytes into an OpenVINO ``Model``, one encoding at a time.

* ``openvino``: two builders, the IR XML and its weights (the weights may be empty for a
  model without constants). The weights are copied once into an immutable buffer that
  OpenVINO shares, so a guest that reuses its buffer cannot change a loaded model.
* ``onnx``: one builder, read from memory.
* ``tensorflowlite`` and ``tensorflow`` (a frozen ``GraphDef``, or a ``SavedModel``:
  ``saved_model.pb`` alone or with ``variables.index`` and ``variables.data-00000-of-00001``
  as second and third builders): OpenVINO's frontends for these read files only, so the
  bytes go to a private temporary directory that is removed after reading (named after
  the process, ``wasinn-ov-<pid>-<random>``: one left by a process killed meanwhile is
  removed by the next that makes one, see :mod:`._private_dirs`).

These two frontends run in a throw-away child process, never in the host: it reads the
files and writes the model back as IR, which the host then reads as above. In a
sandboxed graph's own process (:mod:`.sandbox`, see :func:`.base.in_sandbox`) they run
in that process instead: it is confined already, may start no process (its seccomp
filter refuses ``fork`` and ``execve``, and Landlock leaves ``/dev/null`` read-only),
and a crash there ends only it, which the host reports as it does any library crash on
a model; a frontend that hangs there is stopped by cancelling the load, which kills the
process (the child's :data:`CONVERT_TIMEOUT_S` does not apply). OpenVINO's
TFLite frontend follows the flatbuffer's offsets and indices unchecked, and one changed
byte of a valid model killed the host with SIGSEGV; a crash now kills only the child and
is an InvalidEncodingError. TFLite bytes are also checked before the child starts
(:mod:`._tflite_check`): clear errors, and malformed offsets never reach unchecked C++.
The TensorFlow frontend parses protobufs, but structure-aware fuzzing crashed it too
(SIGSEGV in about 1% of generated GraphDefs, e.g. a ``NextIteration`` node without its
loop). The child costs about 0.25 s per load (a Python start, ``import openvino``, the
IR written and read back): a one-op model took 12 ms before and 260 ms now, a 3,000-op
one 3.1 s and 3.4 s. The child confines itself before OpenVINO starts (:mod:`._confine`:
no processes, programs or sockets, files written only in its directory and at most
:data:`IR_SIZE_FACTOR` times the model plus :data:`IR_SIZE_MARGIN`); the host logs how,
and reads back only plain files. That costs about 1 ms, and leaving OpenVINO's telemetry
out of the child (it keeps a client ID file in the home directory) saves more.

Every failure is an InvalidEncodingError that names the backend and the reason, except
operators a frontend cannot convert in a well-formed model (UnsupportedOperationError:
another library may run it) and a child process that cannot be started at all
(BackendRuntimeError).
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov

from wasinn.enums import GraphEncoding
from wasinn.errors import (
    BackendRuntimeError,
    InvalidEncodingError,
    UnsupportedOperationError,
    WasiNNError,
)
from wasinn.files import read_regular

from . import _confine
from ._graphio import expect_builders
from ._onnx_check import (
    check_external_data,
    external_data_folder,
    given_external_data,
    read_external_data,
)
from ._private_dirs import PrivateDir
from ._tflite_check import check_tflite
from .base import Builders, in_sandbox
from .formats import check_declared, protobuf_fields

NAME = "openvino"
#: The private folders models are written to for OpenVINO to read them from:
#: ``wasinn-ov-<pid>-<random>``, in the system temporary folder.
PRIVATE_DIR_PREFIX = "wasinn-ov-"


def _xml(data: bytes | bytearray | memoryview) -> bool:
    """Whether ``data`` opens as XML does (``<``, after a byte order mark and blanks)."""
    head = bytes(data[:64]).removeprefix(b"\xef\xbb\xbf").lstrip()
    return head.startswith(b"<")


def _is_saved_model(data: bytes | bytearray | memoryview) -> bool:
    try:
        fields = protobuf_fields(data)
    except ValueError:
        return False
    # SavedModel: 1 = schema version (varint), 2 = meta graphs. GraphDef: 1 = node (bytes).
    return fields.get(1) == 0 or (set(fields) == {2})


def read_model(core: Any, builders: Builders, encoding: GraphEncoding,
               source: str = "", given: Mapping[str, bytes] | None = None
               ) -> tuple[Any, object]:
    """The ``ov.Model`` for ``builders``, and a value the caller must keep alive with it.

    ``source``: the file an ONNX model was read from by the host (``LoadOptions.source``),
    whose folder may hold its external data; ``given``: those files, read by the host
    already (``LoadOptions.external_data``, in a sandbox process). Raises
    InvalidEncodingError for bytes OpenVINO cannot read as ``encoding``, SecurityError
    for an ONNX model that names external data files where it may not (see
    :mod:`._onnx_check`).
    """
    if encoding is GraphEncoding.OPENVINO:
        check_declared(NAME, builders, encoding)  # first: ONNX bytes are one builder
        expect_builders(NAME, builders, 2, "two builders: the IR XML and its weights")
        if not _xml(builders[0]) and _xml(builders[1]):
            raise InvalidEncodingError(
                f"{NAME}: the IR's two builders are the wrong way round (the second is "
                "the XML): expected the .xml first, then the .bin")
        return _read_ir(core, builders[0], builders[1], "IR")
    if encoding is GraphEncoding.ONNX:
        expect_builders(NAME, builders, 1, "one builder holding an ONNX model")
        check_declared(NAME, builders, encoding)
        external = _external_data(builders[0], source, given)
        if external:
            return _read_onnx_beside(core, builders[0], external), None
        return _read(lambda: core.read_model(bytes(builders[0])), "ONNX model"), None
    if encoding is GraphEncoding.TENSORFLOWLITE:
        expect_builders(NAME, builders, 1, "one builder holding a TensorFlow Lite flatbuffer")
        check_declared(NAME, builders, encoding)
        try:
            check_tflite(builders[0])
        except ValueError as exc:
            raise InvalidEncodingError(f"{NAME}: cannot read the model.tflite: {exc}") from exc
        return _read_files(core, {"model.tflite": builders[0]}, "model.tflite")
    if encoding is GraphEncoding.TENSORFLOW:
        if len(builders) == 3:
            files = {"saved_model.pb": builders[0], "variables/variables.index": builders[1],
                     "variables/variables.data-00000-of-00001": builders[2]}
            return _read_files(core, files, ".")
        expect_builders(NAME, builders, 1, "one builder holding a frozen GraphDef or a "
                        "SavedModel (or three: saved_model.pb, variables.index, variables.data)")
        check_declared(NAME, builders, encoding)
        if _is_saved_model(builders[0]):
            return _read_files(core, {"saved_model.pb": builders[0]}, ".")
        return _read_files(core, {"model.pb": builders[0]}, "model.pb")
    raise InvalidEncodingError(
        f"{NAME}: cannot read {encoding.value} models: expected openvino, onnx, "
        "tensorflow or tensorflowlite"
    )


def _external_data(model: bytes | bytearray | memoryview, source: str,
                   given: Mapping[str, bytes] | None) -> dict[str, bytes]:
    """The external data files of the ONNX ``model`` (see :func:`read_model`), checked.
    OpenVINO reads any bytes as ONNX: bytes that carry ONNX Runtime's ORT-format
    identifier are walked all the same (they may be ONNX too, with file references)."""
    if given:  # in a sandbox process: read by the host
        return given_external_data(NAME, model, given, ort_format=False)
    folder = external_data_folder(source)
    locations = check_external_data(NAME, model, folder, ort_format=False)
    return (read_external_data(NAME, folder, locations)
            if locations and folder is not None else {})


def _read_onnx_beside(core: Any, model: bytes | bytearray | memoryview,
                      external: dict[str, bytes]) -> Any:
    """An ONNX model with external data files (location -> the bytes the host read and
    checked). OpenVINO reads external data only next to a model file, so both are
    written to a private directory and read from there: the model's own folder could
    hold other files by the time OpenVINO opened them. When ``read_model`` returns,
    OpenVINO has read the weights or mapped them (a mapping outlives the files, removed
    with the directory then). A location that leads out of the model's folder by its
    ``..`` (``../models/w.data``, which the checks let through: it ends inside once
    resolved) is InvalidEncodingError, before anything is written: OpenVINO refuses it,
    and it would be written outside the private directory."""
    taken = {os.path.normpath(location) for location in external}
    for location in sorted(external):
        if os.path.normpath(location).split(os.sep)[0] == os.pardir:
            raise InvalidEncodingError(
                f"{NAME}: cannot read the ONNX model: its external data {location!r} leads "
                "out of the model's folder through '..', which OpenVINO refuses: expected "
                "a path below the folder")
    name = "model.onnx"
    while name in taken:
        name = f"_{name}"
    with PrivateDir(PRIVATE_DIR_PREFIX) as tmp:
        root = Path(tmp)
        _write_into(root, {**external, name: model})  # (below root: checked above)
        return _read(lambda: core.read_model(str(root / name)), "ONNX model")


def _read_ir(core: Any, xml: bytes | bytearray | memoryview,
             weights: bytes | bytearray | memoryview, what: str) -> tuple[Any, object]:
    """An IR read from memory; the weights are copied once into an array OpenVINO shares,
    which is returned to be kept alive with the model."""
    shared = np.frombuffer(bytes(weights), dtype=np.uint8)
    try:
        tensor = ov.Tensor(shared, ov.Shape([shared.size]), ov.Type.u8)
        model = core.read_model(bytes(xml), tensor)
    except Exception as exc:
        raise refused(what, ov_message(exc)) from exc
    return model, shared


def _read(reader: Any, what: str) -> Any:
    try:
        return reader()
    except Exception as exc:
        raise refused(what, ov_message(exc)) from exc


#: What OpenVINO's frontends say of a well-formed model with operators they cannot
#: convert (an ONNX ``com.microsoft`` contrib op, an op of a newer opset).
_NOT_CONVERTED = ("OpConversionFailure", "No conversion rule found")


def refused(what: str, message: str) -> WasiNNError:
    """Why OpenVINO did not read the ``what``: UnsupportedOperationError for operators
    its frontend cannot convert (the model is well formed: another library may run it),
    else InvalidEncodingError."""
    if any(sign in message for sign in _NOT_CONVERTED):
        return UnsupportedOperationError(
            f"{NAME}: cannot convert the {what}: {message}: expected operators OpenVINO's "
            "frontend converts")
    return InvalidEncodingError(f"{NAME}: cannot read the {what}: {message}")


def _read_files(core: Any, files: dict[str, bytes | bytearray | memoryview],
                main: str) -> tuple[Any, object]:
    """Write ``files`` to a private directory, convert ``main`` (a file or the directory
    itself) to IR in a child process, and read that IR here; in a sandbox process, read
    ``main`` here (see the module docstring). What OpenVINO maps of the files outlives
    their removal with the directory."""
    what = "SavedModel" if main == "." else main
    with PrivateDir(PRIVATE_DIR_PREFIX) as tmp:
        root = Path(tmp)
        _write_into(root, files)
        if in_sandbox():
            return _read(lambda: core.read_model(str(root / main)), what), None
        size = sum(memoryview(data).nbytes for data in files.values())
        xml, weights = _convert_in_child(root, main, what, IR_SIZE_FACTOR * size + IR_SIZE_MARGIN)
        return _read_ir(core, _read_written(xml, what), _read_written(weights, what),
                        f"{what} (as IR)")


def _write_into(root: Path, files: Mapping[str, bytes | bytearray | memoryview]) -> None:
    """Write each of ``files`` (relative path -> bytes) under the private directory
    ``root``, making the folders on its way."""
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(memoryview(data).cast("B"))


def _read_written(path: Path, what: str) -> bytes:
    """A file the child wrote, if it is a plain file of its own: not a link (a symbolic
    one to a host file, or a hard one), not a FIFO that would block the read."""
    try:
        return read_regular(path, own=True)
    except OSError as exc:
        problem = (f"is not a plain file: {exc.strerror}" if exc.errno == errno.EINVAL
                   else f"cannot be opened: {exc.strerror}")
        raise InvalidEncodingError(
            f"{NAME}: cannot read the {what}: its IR {path.name} {problem}") from exc


#: Seconds a child may take to read a model; past them it is killed.
CONVERT_TIMEOUT_S = 120.0
#: The child's exit status for a model OpenVINO refused with an exception.
_REFUSED = 3
#: The IR the child writes may hold this many times the model's bytes, plus
#: :data:`IR_SIZE_MARGIN`, in each of its two files (``RLIMIT_FSIZE``).
IR_SIZE_FACTOR = _confine.FILE_SIZE_FACTOR
IR_SIZE_MARGIN = _confine.FILE_SIZE_MARGIN
#: Run by the child with ``python -I -c``: argv = source, IR xml, IR bin, the directory
#: that holds the ``openvino`` package (``-I`` leaves PYTHONPATH and the cwd out),
#: :mod:`._confine`'s file, the largest file it may write. It confines itself (its cwd,
#: the private directory, is the one place it may write) before OpenVINO starts; the
#: first line on stderr says how.
_CONVERT = f"""
import importlib.util, os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the host's to take
sys.path.insert(0, sys.argv[4])
spec = importlib.util.spec_from_file_location("_wasinn_confine", sys.argv[5])
confine = importlib.util.module_from_spec(spec)
spec.loader.exec_module(confine)
sys.stderr.write(confine.report_line(confine.confine(int(sys.argv[6]), os.getcwd(),
                                                     [sys.argv[4]])))
sys.stderr.flush()
sys.modules["openvino_telemetry"] = None  # its client ID file is in the home directory
import openvino as ov
try:
    ov.serialize(ov.Core().read_model(sys.argv[1]), sys.argv[2], sys.argv[3])
except Exception as exc:
    sys.stdout.write(str(exc))
    sys.exit({_REFUSED})
"""
#: The environment variables the child keeps: none of the host's secrets are in reach of
#: a frontend that reads out of bounds.
_CHILD_ENV = ("PATH", "LD_LIBRARY_PATH", "SYSTEMROOT", "TMPDIR")


def _convert_in_child(root: Path, main: str, what: str, fsize: int) -> tuple[Path, Path]:
    """Have a throw-away, confined Python process (see :mod:`._confine`) read
    ``root / main`` with OpenVINO and save it as IR in ``root``, in files of at most
    ``fsize`` bytes; the IR's xml and weights files.

    Raises InvalidEncodingError when OpenVINO refuses the model, crashes on it or takes
    longer than :data:`CONVERT_TIMEOUT_S`; BackendRuntimeError when no child can start.
    """
    xml, weights = root / "converted.xml", root / "converted.bin"
    package_dir = str(Path(ov.__file__).resolve().parent.parent)
    command = [sys.executable, "-I", "-c", _CONVERT, str(root / main), str(xml), str(weights),
               package_dir, str(Path(_confine.__file__).resolve()), str(fsize)]
    env = {key: os.environ[key] for key in _CHILD_ENV if key in os.environ}
    try:
        # stdout: OpenVINO's message; stderr: the frontends' own logging, or a traceback.
        done = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True,
                              env=env, cwd=root, timeout=CONVERT_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        raise InvalidEncodingError(
            f"{NAME}: cannot read the {what}: reading it took over {CONVERT_TIMEOUT_S:g} s"
        ) from exc
    except OSError as exc:
        raise BackendRuntimeError(
            f"{NAME}: cannot start a process to read the {what} in: {exc}") from exc
    report, log = _confine.take_report(done.stderr)
    _confine.log_report(report, what)
    if done.returncode != 0:
        if any(_size(path) >= fsize for path in (xml, weights)):
            raise InvalidEncodingError(
                f"{NAME}: cannot read the {what}: as IR it takes over {fsize:,} bytes, the "
                "most a file written by the process that reads such models may hold")
        raise refused(what, _child_failure(done.returncode, done.stdout, log))
    return xml, weights


def _size(path: Path) -> int:
    try:
        return path.lstat().st_size
    except OSError:
        return 0


def _child_failure(returncode: int, message: bytes, log: bytes) -> str:
    """Why the child failed, for the error message."""
    if returncode == _REFUSED:
        return ov_message(message.decode("utf-8", "replace"))
    if _confine.stopped_from_outside(returncode):
        name = _confine.signal_name(-returncode)
        return (f"the throw-away process that reads such models was stopped by {name} "
                "(sent to it, or to the host's process group), not by these bytes")
    if returncode < 0:
        name = _confine.signal_name(-returncode)
        return (f"OpenVINO's frontend crashed on it ({name}) in the throw-away process "
                "that reads such models: the bytes are malformed")
    last = (log.decode("utf-8", "replace").strip().splitlines() or [""])[-1][-300:]
    return f"the process reading it exited with status {returncode}" + (
        f": {last}" if last else "")


def ov_message(exc: BaseException | str) -> str:
    """OpenVINO's messages carry C++ source locations; keep the lines that explain."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    useful = [ln for ln in lines if not ln.startswith(("Exception from", "Check '"))]
    return " ".join(useful or lines)[:500]
