"""``wasinn infer``: a registered model or pipeline run from the command line, no guest,
with real ONNX Runtime models; inputs from numpy files or zeros, a load of concurrent
callers, outputs printed and saved; every bad input an error that says what to give."""

from __future__ import annotations

import re
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.example_configs import example_config
from tests.support import require_backend
from tests.test_pipeline import native_reference
from wasinn.backends.base import TensorSpec
from wasinn.cli import main
from wasinn.enums import TensorType
from wasinn.errors import InvalidArgumentError
from wasinn.infer import Load, complete_inputs, describe_output, parse_shape, read_inputs
from wasinn.modelgen import ModelFiles, affine_onnx, sample_image
from wasinn.tensor import Tensor


@pytest.fixture
def affine(tmp_path: Path) -> list[str]:
    """``--nn-preload`` of ``y = 2x + 1`` (x: f32[n, 4]) as model ``a``."""
    require_backend("onnxruntime")
    path = tmp_path / "affine.onnx"
    path.write_bytes(affine_onnx())
    return ["--nn-preload", f"a:onnx:cpu:{path}"]


def test_a_model_runs_on_an_input_file(affine: list[str], tmp_path: Path,
                                       capfd: pytest.CaptureFixture[str]) -> None:
    np.save(tmp_path / "x.npy", np.array([[0, 1, 2, 3]], np.float32))
    saved = tmp_path / "out.npz"
    code = main(["infer", *affine, "a", "--input", f"x={tmp_path / 'x.npy'}",
                 "--save", str(saved)])
    out = capfd.readouterr().out
    assert code == 0
    assert ("y: f32[1, 4] min 1 max 7 mean 4; largest along the last axis: [3] 7, [2] 5, "
            "[1] 3, [0] 1") in out
    with np.load(saved) as archive:
        assert archive.files == ["y"]
        np.testing.assert_array_equal(archive["y"], [[1, 3, 5, 7]])


def test_a_load_of_concurrent_callers_reports_throughput_and_device_stats(
        affine: list[str], capfd: pytest.CaptureFixture[str]) -> None:
    code = main(["infer", *affine, "a", "--zeros", "--shape", "x=3,4", "--requests", "40",
                 "--concurrency", "4", "--timeout", "30"])
    out = capfd.readouterr().out
    assert code == 0
    assert "y: f32[3, 4] min 1 max 1 mean 1" in out  # 2 * 0 + 1, of the shape given
    assert "40 requests from 4 concurrent caller(s) in " in out
    assert "\na: 40 completed, 0 failed" in out  # the model's stats
    assert "cpu: 40 completed, 0 failed" in out and "queued p50" in out


def test_a_pipeline_runs_on_an_archive_of_inputs(tmp_path: Path, small_mobilenet: ModelFiles,
                                                 capfd: pytest.CaptureFixture[str]) -> None:
    require_backend("onnxruntime")
    config = example_config("pipeline.toml", tmp_path, small_mobilenet)
    image = sample_image(3)
    np.savez(tmp_path / "inputs.npz", x=image)
    saved = tmp_path / "logits.npz"
    code = main(["infer", "--config", str(config), "classify",
                 "--input", str(tmp_path / "inputs.npz"), "--save", str(saved)])
    out = capfd.readouterr().out
    assert code == 0
    assert "output: f32[1, 1000]" in out
    with np.load(saved) as archive:
        np.testing.assert_allclose(archive["output"], native_reference(image, small_mobilenet),
                                   atol=1e-4)


@pytest.mark.parametrize(("args", "message"), [
    ([], "no value for x: f32[?, 4]: give --input NAME=FILE.npy, or --zeros"),
    (["--input", "y={x}"], "--input y: the model has no such input: expected one of x: f32[?, 4]"),
    (["--input", "x={wide}"], "input 'x' has shape [1, 5] but the model expects x: f32[?, 4]"),
    (["--input", "x={missing}"], "--input x={missing}: cannot read {missing}: No such file or "
                                 "directory: expected a readable .npy or .npz file"),
    (["--input", "x={folder}"], "--input x={folder}: cannot read {folder}: Is a directory"),
    (["--input", "x={x}", "--input", "x={x}"],
     "--input x={x}: x is already given by an earlier --input: expected one value per input"),
    (["--input", "x={x}", "--input", "0={x}"],
     "--input 0: x is given twice (by name and by position): expected one value per input"),
    (["--zeros", "--shape", "x=1,4", "--shape", "0=2,4"],
     "--shape 0: x is given a shape twice (by name and by position): expected one"),
    (["--zeros", "--shape", "x=1000000000000,4"],
     "input 'x': a zero-filled f32 value of shape [1000000000000, 4] takes "
     "16,000,000,000,000 bytes, which cannot be allocated here"),
    (["--zeros", "--save", "{folder}/no/out.npz"],
     "--save {folder}/no/out.npz: there is no folder {folder}/no: expected a file in an "
     "existing folder"),
    (["--zeros", "--save", "{folder}"], "--save {folder}: a folder: expected a file name"),
    (["--input", "x={notnumpy}"],
     "model.txt is not a .npy or .npz file: expected one written by numpy.save or numpy.savez"),
    (["--input", "x={archive}"], "is a .npz archive: give it as --input"),
    (["--input", "{x}"], "a single array: give it as --input NAME="),
    (["--zeros", "--shape", "z=1,4"], "--shape z: the model has no such input"),
    (["--zeros", "--target", "gpu"], "no gpu device in this runtime"),
])
def test_bad_inputs_say_what_was_expected(affine: list[str], tmp_path: Path,
                                          capfd: pytest.CaptureFixture[str],
                                          args: list[str], message: str) -> None:
    files = {"x": tmp_path / "x.npy", "wide": tmp_path / "wide.npy",
             "missing": tmp_path / "missing.npy", "notnumpy": tmp_path / "model.txt",
             "archive": tmp_path / "inputs.npz", "folder": tmp_path}
    np.save(files["x"], np.zeros((1, 4), np.float32))
    np.save(files["wide"], np.zeros((1, 5), np.float32))
    files["notnumpy"].write_text("not numpy")
    np.savez(files["archive"], x=np.zeros((1, 4), np.float32))
    argv = [arg.format(**files) for arg in args]
    code = main(["infer", *affine, "a", *argv])
    err = capfd.readouterr().err
    assert code == 1
    assert err.startswith("wasinn: error: ") and message.format(**files) in err
    assert "Traceback" not in err


def test_a_big_endian_input_file_gives_the_right_results(
        affine: list[str], tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # A .npy saved as ">f4" (on a big-endian machine, or by a tool that writes it so).
    np.save(tmp_path / "x.npy", np.array([[0, 1, 2, 3]], ">f4"))
    np.savez(tmp_path / "inputs.npz", x=np.array([[0, 1, 2, 3]], ">f4"))
    for given in (f"x={tmp_path / 'x.npy'}", str(tmp_path / "inputs.npz")):
        assert main(["infer", *affine, "a", "--input", given]) == 0
        assert "y: f32[1, 4] min 1 max 7 mean 4" in capfd.readouterr().out


def _zip_of(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


@pytest.mark.parametrize(("make", "message"), [
    (lambda d: np.savez(d / "bad.npz", x=np.array([1, "a"], dtype=object)),
     "is not a .npy or .npz file of plain arrays: ValueError: Object arrays cannot be loaded"),
    (lambda d: (d / "bad.npz").write_bytes(b"PK\x03\x04 but no zip archive after all"),
     "is not a .npy or .npz file of plain arrays: BadZipFile: "),
    (lambda d: (d / "bad.npz").write_bytes(b""),
     "is not a .npy or .npz file: expected one written by numpy.save or numpy.savez"),
    (lambda d: (d / "bad.npz").write_bytes(b"\x93NUMPY"),
     "is not a .npy or .npz file of plain arrays: "),
    (lambda d: _zip_of(d / "bad.npz", {"x.npy": b"\x93NUMPY truncated"}),
     "is not a .npy or .npz file of plain arrays: "),
    (lambda d: _zip_of(d / "bad.npz", {"notes.txt": b"hello"}),
     "member 'notes.txt' is not a .npy array: expected an archive of arrays only"),
])
def test_a_bad_archive_is_an_invalid_argument_naming_the_file(
        affine: list[str], tmp_path: Path, capfd: pytest.CaptureFixture[str],
        make: Callable[[Path], object], message: str) -> None:
    make(tmp_path)
    path = tmp_path / "bad.npz"
    with pytest.raises(InvalidArgumentError, match=re.escape(message)) as caught:
        read_inputs([str(path)])
    assert f"--input {path}: {path}" in caught.value.message
    assert main(["infer", *affine, "a", "--input", str(path)]) == 1
    err = capfd.readouterr().err
    assert err.startswith("wasinn: error: ") and message in err and str(path) in err
    assert "Traceback" not in err


def test_an_unregistered_name_lists_the_registered_ones(
        affine: list[str], capfd: pytest.CaptureFixture[str]) -> None:
    assert main(["infer", *affine, "b", "--zeros"]) == 1
    assert "no model or pipeline named 'b': registered: a" in capfd.readouterr().err


def test_inputs_by_position_and_zero_filled_shapes() -> None:
    specs = [TensorSpec("image", TensorType.F32, (None, 3)),
             TensorSpec("tokens", TensorType.I64, (), rank_known=False)]
    given = {"0": np.ones((2, 3), np.float32)}
    inputs = complete_inputs(specs, given, zeros=True, shapes={"tokens": (5,)})
    assert inputs["image"].dims == (2, 3)
    assert (inputs["tokens"].type, inputs["tokens"].dims) == (TensorType.I64, (5,))
    inputs = complete_inputs(specs, {}, zeros=True, shapes={"0": (7, 3), "1": (2,)})
    assert (inputs["image"].dims, inputs["tokens"].dims) == ((7, 3), (2,))  # by position
    assert not inputs["tokens"].numpy().any()
    with pytest.raises(InvalidArgumentError,
                       match=r"input 'tokens' declares no shape.*--shape tokens=D,D"):
        complete_inputs(specs, given, zeros=True, shapes={})


def test_shapes_and_loads_are_checked() -> None:
    assert parse_shape("input=1,3,224,224") == ("input", (1, 3, 224, 224))
    for bad in ("input", "input=", "=1,2", "input=1,x", "input=0,3"):
        with pytest.raises(InvalidArgumentError, match="expected NAME=D,D,"):
            parse_shape(bad)
    assert Load(requests=2, concurrency=8).concurrency == 2  # no idle callers
    with pytest.raises(InvalidArgumentError, match="--concurrency 0"):
        Load(concurrency=0)
    with pytest.raises(InvalidArgumentError, match="--timeout 0"):
        Load(timeout=0)


def test_an_output_line_tells_type_shape_range_and_largest_values() -> None:
    line = describe_output("p", Tensor.from_numpy(np.array([[0.5, 2.0, -1.0]], np.float32)))
    assert line == ("p: f32[1, 3] min -1 max 2 mean 0.5; largest along the last axis: "
                    "[1] 2, [0] 0.5, [2] -1")
    assert describe_output("e", Tensor.from_numpy(np.zeros((0, 3), np.float32))) == (
        "e: f32[0, 3] (empty)")


def test_models_lists_what_the_command_line_registers(
        affine: list[str], capfd: pytest.CaptureFixture[str]) -> None:
    assert main(["models", *affine]) == 0
    rows = capfd.readouterr().out.splitlines()
    assert rows[0].split()[:4] == ["NAME", "KIND", "ENCODING", "TARGET"]
    assert rows[1].split()[:4] == ["a", "model", "onnx", "cpu"]


def test_an_unknown_target_is_a_usage_error(affine: list[str],
                                            capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["infer", *affine, "a", "--zeros", "--target", "xpu"])
    assert exc.value.code == 2
    assert ("argument --target: unknown execution target 'xpu': expected one of cpu, gpu, tpu"
            in capfd.readouterr().err)


def test_a_command_line_models_errors_name_its_flag_not_a_config_file(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # The model came from --nn-preload: the embedded default.toml (or --config's file),
    # where it is merged, is not where the user can fix it.
    require_backend("onnxruntime")
    path = tmp_path / "affine.onnx"
    path.write_bytes(affine_onnx())
    spec = f"a:onnx:gpu:{path}"
    assert main(["infer", "--nn-preload", spec, "a", "--zeros", "--shape", "x=1,4"]) == 1
    err = capfd.readouterr().err
    assert f"--nn-preload {spec!r}: no gpu device in this runtime" in err, err
    assert "default.toml" not in err
