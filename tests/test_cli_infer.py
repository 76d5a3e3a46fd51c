"""``wasinn infer``: a registered model or pipeline run from the command line, no guest,
with real ONNX Runtime models; inputs from numpy files or zeros, a load of concurrent
callers, outputs printed and saved; every bad input an error that says what to give."""

from __future__ import annotations

import io
import os
import re
import stat
import subprocess
import sys
import threading
import types
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from tests.backend_models import scripted
from tests.example_configs import example_config
from tests.support import require_backend
from tests.test_pipeline import native_reference
from tests.test_warmup import memory_available, token_model
from wasinn._save import check_save_path, save_outputs
from wasinn.backends.base import TensorSpec
from wasinn.cli import main
from wasinn.enums import TensorType
from wasinn.errors import InvalidArgumentError
from wasinn.infer import Load, complete_inputs, describe_output, parse_shape, read_inputs
from wasinn.modelgen import (
    ModelFiles,
    affine_onnx,
    identity_onnx,
    onnx_model_bytes,
    sample_image,
)
from wasinn.scheduler.warmup import ZeroInput
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
    # (Through an archive: known once it is read. `x=A --input x=B`: a usage error.)
    (["--input", "{archive}", "--input", "x={x}"],
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
    # A type where the model declares another: refused before any run.
    (["--zeros", "--shape", "x=2,4:i64"],
     "--shape x=2,4:i64: type i64 given, but the model declares x: f32[?, 4]: expected f32, "
     "or no type (the model's)"),
    (["--zeros", "--shape", "0=2,4:U8"],
     "--shape 0=2,4:u8: type u8 given, but the model declares x: f32[?, 4]"),
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


def test_zeros_beyond_the_memory_available_are_refused_before_they_are_made(
        affine: list[str], monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    # Where the kernel overcommits (a VM), np.zeros of 16 TB succeeded and the run that
    # touched it got the process killed. 1.6 MB, which np.zeros allocates anywhere,
    # against 1 MiB:
    memory_available(monkeypatch, 2**20)
    code = main(["infer", *affine, "a", "--zeros", "--shape", "x=100000,4"])
    err = capfd.readouterr().err
    assert code == 1
    assert err == ("wasinn: error: input 'x': a zero-filled f32 value of shape [100000, 4] "
                   "takes 1,600,000 bytes, which cannot be allocated here (1,048,576 bytes of "
                   "memory are available now): expected a smaller shape\n")


@pytest.mark.parametrize("compressed", [False, True], ids=["npy", "compressed-npz"])
def test_an_input_file_beyond_the_memory_available_is_refused_before_it_is_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compressed: bool) -> None:
    # numpy fills what a header declares with what the file holds: a .npy's bytes, a
    # .npz member's uncompressed size (2 MB of zeros compress to a few KB: a small file
    # can take all the memory there is).
    array = np.zeros(500_000, np.float32)
    if compressed:
        path, spec = tmp_path / "big.npz", str(tmp_path / "big.npz")
        np.savez_compressed(path, x=array)
        assert path.stat().st_size < 2**20  # (a small file, a large array)
        holds = r"2,000,[0-9]{3} bytes of arrays \(uncompressed\)"
    else:
        path, spec = tmp_path / "big.npy", f"x={tmp_path / 'big.npy'}"
        np.save(path, array)
        holds = f"{path.stat().st_size:,} bytes"
    memory_available(monkeypatch, 2**20)
    with pytest.raises(InvalidArgumentError,
                       match=rf"^--input {re.escape(spec)}: {re.escape(str(path))} holds "
                             rf"{holds}, more than can be read here \(1,048,576 bytes of "
                             rf"memory are available now\): expected arrays that fit in "
                             rf"memory$"):
        read_inputs([spec])
    memory_available(monkeypatch, 4_000_000)
    assert read_inputs([spec])["x"].shape == (500_000,)


def test_an_input_given_twice_is_a_usage_error_unless_it_is_the_same(
        affine: list[str], tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # Before: status 1 without the usage line, for the same --input twice too. README:
    # two of a repeatable flag that give one thing different values are a usage error.
    np.save(tmp_path / "x.npy", np.array([[0, 1, 2, 3]], np.float32))
    np.save(tmp_path / "y.npy", np.array([[1, 1, 1, 1]], np.float32))
    x, y = f"x={tmp_path / 'x.npy'}", f"x={tmp_path / 'y.npy'}"
    with pytest.raises(SystemExit) as exc:
        main(["infer", *affine, "a", "--input", x, "--input", y])
    assert exc.value.code == 2
    err = capfd.readouterr().err
    assert err.startswith("usage: wasinn infer ")
    assert err.endswith(f"wasinn infer: error: --input {y!r}: x is already given by --input "
                        f"{x!r}: expected one value per input\n")
    assert main(["infer", *affine, "a", "--input", x, "--input", x]) == 0  # counts once
    assert "y: f32[1, 4] min 1 max 7" in capfd.readouterr().out
    # So does the same file by another path (it was refused: "already given by an
    # earlier --input"), and one shape given with and without its type.
    other_path = f"x={tmp_path}/./x.npy"
    assert main(["infer", *affine, "a", "--input", x, "--input", other_path]) == 0
    assert "y: f32[1, 4] min 1 max 7" in capfd.readouterr().out
    assert main(["infer", *affine, "a", "--zeros", "--shape", "x=2,4",
                 "--shape", "x=2,4:f32"]) == 0
    assert "y: f32[2, 4] min 1 max 1" in capfd.readouterr().out


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
    assert parse_shape("input=1,3,224,224") == ("input", ZeroInput((1, 3, 224, 224)))
    assert parse_shape("ids=1,8:i64") == ("ids", ZeroInput((1, 8), TensorType.I64))
    # The name is all before the first '=', the type all after the last ':'.
    assert parse_shape("in:0=2:BF16") == ("in:0", ZeroInput((2,), TensorType.BF16))
    # No dimensions: a scalar (shape ()), for an input that declares no shape.
    assert parse_shape("x=") == ("x", ZeroInput(()))
    assert parse_shape("x=:i64") == ("x", ZeroInput((), TensorType.I64))
    for bad in ("input", "=1,2", "input=1,x", "input=0,3", "ids=1:8:i64", "x=1,,2", "x=-1",
                "x=a", "x=,", "x=1,", "x= "):
        with pytest.raises(InvalidArgumentError, match=re.escape(
                f"--shape {bad!r}: expected NAME=D,D,... with dimensions >= 1 (NAME= for a "
                "scalar), or NAME=D,D,...:TYPE")):
            parse_shape(bad)
    for bad in ("ids=1,8:int64", "ids=1,8:"):
        with pytest.raises(InvalidArgumentError,
                           match=rf"^--shape '{bad}': unknown tensor type '.*': expected one of "
                                 "f16, f32, f64, bf16, u8, i32, i64$"):
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


def test_an_output_line_counts_nan_and_infinities_apart_from_the_range() -> None:
    # Before: one NaN made the range "min nan max nan mean nan" and ranked first among
    # the largest values; an infinity gave a numpy RuntimeWarning on stderr.
    values = np.array([[1.0, np.nan, np.inf, 3.0, -np.inf, 2.0]], np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        line = describe_output("y", Tensor.from_numpy(values))
    assert line == ("y: f64[1, 6] min 1 max 3 mean 2 (1 NaN, 2 infinite); largest along "
                    "the last axis: [2] inf, [3] 3, [5] 2, [0] 1, [4] -inf")
    assert describe_output("n", Tensor.from_numpy(np.full((1, 2), np.nan, np.float32))) == (
        "n: f32[1, 2] (no finite value: 2 NaN); largest along the last axis: [0] nan, [1] nan")
    # Finite values whose sum overflows f64 (before: "mean inf" and numpy's warning).
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        line = describe_output("big", Tensor.from_numpy(np.array([1e308, 1e308, 1.0])))
    assert line == ("big: f64[3] min 1 max 1e+308 mean 6.66667e+307; largest along the "
                    "last axis: [0] 1e+308, [1] 1e+308, [2] 1")


def test_an_integer_output_line_shows_its_values_exactly() -> None:
    # Before: read through f64, an i64 past 2**53 printed as 4.61169e+18.
    ids = np.array([[4611686018427387905, -3, 7, 7]], np.int64)
    assert describe_output("ids", Tensor.from_numpy(ids)) == (
        "ids: i64[1, 4] min -3 max 4611686018427387905 mean 1.15292e+18; largest along "
        "the last axis: [0] 4611686018427387905, [2] 7, [3] 7, [1] -3")
    assert describe_output("u", Tensor.from_numpy(np.array(5, np.uint8))) == (
        "u: u8[] min 5 max 5 mean 5")


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


#: Output names that numpy.savez's keywords would take (file, allow_pickle, args) or that
#: are odd in a zip member name, each with the op that makes it and numpy's equivalent.
_ODD_NAMES: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "file": ("Identity", lambda x: x),
    "allow_pickle": ("Neg", lambda x: -x),
    "args": ("Abs", np.abs),
    "logits/Softmax:0": ("Relu", lambda x: np.maximum(x, 0)),
    "ünï cödé": ("Sign", np.sign),
    "y.npy": ("Mul", lambda x: x * x),
}


def _odd_names_onnx() -> bytes:
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    nodes = [helper.make_node(op, ["x", "x"] if op == "Mul" else ["x"], [name])
             for name, (op, _) in _ODD_NAMES.items()]
    outs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, 4])
            for name in _ODD_NAMES]
    return onnx_model_bytes(helper.make_graph(nodes, "odd_names", [x], outs))


def test_outputs_of_any_name_are_saved_under_that_name(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # Before: np.savez(file, **outputs) took "file" as its own argument (a TypeError after
    # truncating the target) and "allow_pickle" as its flag (an empty archive, status 0).
    require_backend("onnxruntime")
    (tmp_path / "odd.onnx").write_bytes(_odd_names_onnx())
    x = np.array([[-2, -1, 1, 2]], np.float32)
    np.save(tmp_path / "x.npy", x)
    saved = tmp_path / "out.npz"
    np.savez(saved, earlier=np.arange(5))  # replaced as a whole
    code = main(["infer", "--nn-preload", f"m:onnx:cpu:{tmp_path / 'odd.onnx'}", "m",
                 "--input", f"x={tmp_path / 'x.npy'}", "--save", str(saved)])
    assert code == 0, capfd.readouterr().err
    assert f"outputs written to {saved}" in capfd.readouterr().out
    with np.load(saved) as archive:
        assert sorted(archive.files) == sorted(_ODD_NAMES)
        for name, (_, reference) in _ODD_NAMES.items():
            np.testing.assert_array_equal(archive[name], reference(x), err_msg=name)
    assert sorted(read_inputs([str(saved)])) == sorted(_ODD_NAMES)  # --input reads it back
    assert sorted(p.name for p in tmp_path.iterdir()) == ["odd.onnx", "out.npz", "x.npy"]


@pytest.mark.parametrize(("linked", "said"), [
    (False, "cannot write {saved}: File too large: expected a writable folder with room "
            "for the archive"),
    # Written in place, to keep the link: its room reserved before a byte is written.
    (True, "cannot write into {saved}: File too large: expected room for the archive"),
], ids=["replaced", "hard-linked"])
def test_a_failed_save_leaves_the_earlier_file_as_it_was(
        affine: list[str], tmp_path: Path, linked: bool, said: str) -> None:
    # A real write failure: the archive (32 KiB) is past the process's file size limit,
    # as it would be past a full disk. Before: the target was truncated first.
    saved = tmp_path / "results.npz"
    np.savez(saved, important=np.arange(5))
    if linked:
        os.link(saved, tmp_path / "link.npz")
    before = saved.read_bytes()
    argv = ["infer", *affine, "a", "--zeros", "--shape", "x=2048,4", "--save", str(saved)]
    child = ("import resource, sys\n"
             "resource.setrlimit(resource.RLIMIT_FSIZE,"
             " (8192, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
             "from wasinn.cli import main\n"
             f"sys.exit(main({argv!r}))\n")
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 1, done.stderr
    assert saved.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["affine.onnx", "results.npz", *(["link.npz"] if linked else [])])
    assert f"wasinn: error: --save {saved}: {said.format(saved=saved)}" in done.stderr
    assert "Traceback" not in done.stderr
    if linked:
        assert (tmp_path / "link.npz").read_bytes() == before


@pytest.mark.parametrize(("names", "message"), [
    (["a", "a.npy"], "outputs 'a' and 'a.npy' cannot share an archive: numpy.load reads "
                     "its member 'a.npy' for both"),
    (["a\0b"], "output 'a\\x00b' has a NUL character, which a zip member name cannot hold"),
], ids=["x-and-x.npy", "nul"])
def test_names_no_archive_can_give_back_are_refused_leaving_the_file(
        tmp_path: Path, names: list[str], message: str) -> None:
    saved = tmp_path / "out.npz"
    np.savez(saved, important=np.arange(5))
    before = saved.read_bytes()
    tensor = Tensor.from_numpy(np.zeros((1, 4), np.float32))
    with pytest.raises(InvalidArgumentError, match=re.escape(f"--save {saved}: {message}")):
        save_outputs(saved, dict.fromkeys(names, tensor))
    assert saved.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["out.npz"]


def test_a_read_only_file_is_not_saved_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    # The archive replaces the file by a rename, which a read-only file does not stop
    # (its folder's permission decides): the file's own is checked, as open("wb") would
    # check it. os.access answers for the tests' user (root passes any check).
    import wasinn._save

    saved = tmp_path / "out.npz"
    np.savez(saved, important=np.arange(5))
    saved.chmod(0o444)
    before = saved.read_bytes()
    real_access = os.access
    monkeypatch.setattr(wasinn._save.os, "access", lambda path, mode: (
        False if Path(path) == saved and mode == os.W_OK else real_access(path, mode)))
    tensor = Tensor.from_numpy(np.zeros((1, 4), np.float32))
    with pytest.raises(InvalidArgumentError, match=re.escape(
            f"--save {saved}: {saved} is read-only: expected a file wasinn may write")):
        save_outputs(saved, {"y": tensor})
    assert saved.read_bytes() == before


@pytest.mark.parametrize(("errno_", "said"), [
    # Before: both were told "expected room for the archive", which was no help.
    (13, "cannot write into {saved}: Permission denied: expected a file wasinn may write"),
    (30, "{saved} is on a file system mounted read-only, where no file may be written or "
         "created: expected FILE on a writable file system (save it elsewhere)"),
], ids=["permission", "read-only-fs"])
def test_a_file_written_in_place_that_cannot_be_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, errno_: int, said: str) -> None:
    # A hard-linked file is written in place; os.open fails on it as a write would.
    import wasinn._save

    saved = tmp_path / "out.npz"
    np.savez(saved, important=np.arange(5))
    os.link(saved, tmp_path / "link.npz")
    before = saved.read_bytes()
    real_open = os.open

    def refused(path: Any, flags: int, *args: Any) -> int:
        if flags & os.O_WRONLY and Path(path) == saved:
            raise OSError(errno_, os.strerror(errno_), str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(wasinn._save.os, "open", refused)
    with pytest.raises(InvalidArgumentError, match=re.escape(
            f"--save {saved}: {said.format(saved=saved)}")):
        save_outputs(saved, {"y": Tensor.from_numpy(np.zeros((1, 4), np.float32))})
    assert saved.read_bytes() == before


def test_a_save_onto_a_read_only_mount_says_so_and_leaves_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Mounted read-only during the run (os.statvfs says so: no test may mount one). Before:
    # "is read-only: expected a file wasinn may write, or a new name", and a new name
    # failed too. A FIFO there may still be written: the kernel allows it.
    import wasinn._save

    saved = tmp_path / "out.npz"
    np.savez(saved, important=np.arange(5))
    before = saved.read_bytes()
    monkeypatch.setattr(wasinn._save.os, "statvfs", _read_only_mount(tmp_path))
    tensor = Tensor.from_numpy(np.zeros((1, 4), np.float32))
    for name in ("out.npz", "new.npz"):
        with pytest.raises(InvalidArgumentError, match=re.escape(
                f"--save {tmp_path / name}: {tmp_path} is on a file system mounted read-only, "
                "where no file may be written or created: expected FILE on a writable file "
                "system (save it elsewhere)")):
            save_outputs(tmp_path / name, {"y": tensor})
    assert saved.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["out.npz"]
    os.mkfifo(tmp_path / "fifo")
    check_save_path(tmp_path / "fifo")  # passes, unopened


def test_a_fifo_is_written_into_not_replaced(tmp_path: Path) -> None:
    # Before: the archive was renamed onto the FIFO, which became a regular file, and its
    # reader waited for ever (a device, /dev/null as root, would have been replaced too).
    fifo = tmp_path / "out.npz"
    os.mkfifo(fifo)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()
    save_outputs(fifo, {"y": Tensor.from_numpy(np.arange(4, dtype=np.float32))})
    reader.join(timeout=60)
    assert not reader.is_alive() and stat.S_ISFIFO(os.stat(fifo).st_mode)
    with np.load(io.BytesIO(received[0])) as archive:
        assert archive["y"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert [p.name for p in tmp_path.iterdir()] == ["out.npz"]  # no temporary left


def test_an_archive_saved_to_stdout_is_all_that_its_pipe_carries(affine: list[str],
                                                                  tmp_path: Path) -> None:
    # Before: /dev/stdout on a pipe was resolved to /proc/PID/fd/pipe:[N], taken for a
    # regular file to rename onto, and the save failed (status 1); and the summary lines
    # were printed to the same stdout, ahead of the archive and after it.
    np.save(tmp_path / "x.npy", np.array([[0, 1, 2, 3]], np.float32))
    argv = ["infer", *affine, "a", "--input", f"x={tmp_path / 'x.npy'}", "--requests", "2",
            "--save", "/dev/stdout"]
    done = subprocess.run([sys.executable, "-c", f"import sys\nfrom wasinn.cli import main\n"
                           f"sys.exit(main({argv!r}))\n"], capture_output=True,
                          timeout=120, check=False)
    said = done.stderr.decode()
    assert done.returncode == 0, said
    with np.load(io.BytesIO(done.stdout)) as archive:
        assert archive.files == ["y"]
        np.testing.assert_array_equal(archive["y"], [[1, 3, 5, 7]])
    assert "y: f32[1, 4] min 1 max 7" in said and "2 requests from 1 concurrent" in said
    assert said.endswith("outputs written to /dev/stdout\n")


@pytest.mark.parametrize("name", ["/dev/fd/{fd}", "/proc/self/fd/{fd}"])
@pytest.mark.parametrize("kind", ["pipe", "socket"])
def test_a_pipe_or_socket_named_by_its_descriptor_is_written_into(name: str, kind: str
                                                                  ) -> None:
    # What a shell's >(...) passes: /dev/fd/63. Before, the pre-run check refused it
    # ("cannot write /proc/PID/fd/pipe:[N]"); a socket cannot be opened by such a name
    # at all (ENXIO), only written through its descriptor.
    if kind == "pipe":
        read_end, write_end = os.pipe()
        ends: tuple[Any, Any] = (os.fdopen(read_end, "rb"), os.fdopen(write_end, "wb"))
    else:
        import socket

        ends = socket.socketpair()
    received: list[bytes] = []

    def read_to_the_end() -> None:
        while chunk := os.read(reader.fileno(), 1 << 16):
            received.append(chunk)

    with ends[0] as reader, ends[1] as writer:
        path = Path(name.format(fd=writer.fileno()))
        check_save_path(path)
        thread = threading.Thread(target=read_to_the_end, daemon=True)
        thread.start()
        save_outputs(path, {"y": Tensor.from_numpy(np.arange(4, dtype=np.float32))})
        writer.close()  # (the reader's end of file; the save leaves the descriptor open)
        thread.join(timeout=60)
    assert not thread.is_alive()
    with np.load(io.BytesIO(b"".join(received))) as archive:
        assert archive["y"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_file_in_a_folder_closed_to_new_files_is_written_into(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The temporary file beside it cannot be created there (os.open answers as for a
    # user who may write the file but not its folder: root may write anywhere). Before,
    # the save failed where open("wb") had written the file.
    import wasinn._save

    saved = tmp_path / "out.npz"
    np.savez(saved, old=np.arange(2))
    real_open = os.open

    def no_new_files(path: Any, flags: int, *args: Any) -> int:
        if flags & os.O_CREAT and not os.path.exists(path):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(wasinn._save.os, "open", no_new_files)
    save_outputs(saved, {"y": Tensor.from_numpy(np.arange(4, dtype=np.float32))})
    monkeypatch.undo()
    with np.load(saved) as archive:
        assert list(archive) == ["y"] and archive["y"].tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(InvalidArgumentError, match="cannot write"):  # a new name: refused
        monkeypatch.setattr(wasinn._save.os, "open", no_new_files)
        save_outputs(tmp_path / "new.npz", {"y": Tensor.from_numpy(np.zeros(1, np.float32))})


def test_a_file_with_other_hard_links_is_written_in_place(tmp_path: Path) -> None:
    # Before: the archive was renamed onto it, a new file: the other link kept the old one.
    saved = tmp_path / "out.npz"
    np.savez(saved, old=np.arange(2000))  # longer than the new archive: cut at its end
    os.link(saved, tmp_path / "link.npz")
    inode = os.stat(saved).st_ino
    save_outputs(saved, {"y": Tensor.from_numpy(np.arange(4, dtype=np.float32))})
    for name in ("out.npz", "link.npz"):
        with np.load(tmp_path / name) as archive:
            assert list(archive) == ["y"] and archive["y"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert (os.stat(saved).st_ino, os.stat(saved).st_nlink) == (inode, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.npz", "out.npz"]


def _closed_to_new_files(folder: Path) -> Callable[..., int]:
    """``os.open`` as for a user who may not create files in ``folder`` (root may)."""
    real_open = os.open

    def no_new_files(path: Any, flags: int, *args: Any) -> int:
        if (flags & os.O_CREAT and Path(path).parent == folder
                and not os.path.exists(path)):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args)

    return no_new_files


def _read_only_fs(folder: Path) -> Callable[..., int]:
    """``os.open`` as on a read-only file system mounted at ``folder``."""
    real_open = os.open

    def read_only(path: Any, flags: int, *args: Any) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR) and Path(path).parent == folder:
            raise OSError(30, "Read-only file system", str(path))
        return real_open(path, flags, *args)

    return read_only


def _read_only_mount(folder: Path) -> Callable[..., Any]:
    """``os.statvfs`` as for a file system mounted read-only at ``folder``."""
    real_statvfs = os.statvfs

    def statvfs(path: Any) -> Any:
        if Path(path) == folder:
            return types.SimpleNamespace(f_flag=real_statvfs(path).f_flag | os.ST_RDONLY)
        return real_statvfs(path)

    return statvfs


_READ_ONLY_FS = ("--save {out}/{name}: {out} is on a file system mounted read-only, where no "
                 "file may be written or created: expected FILE on a writable file system "
                 "(save it elsewhere)")


@pytest.mark.parametrize(("case", "message"), [
    ("read-only", "--save {out}/a.npz: {out}/a.npz is read-only: expected a file wasinn may "
                  "write, or a new name"),
    ("read-only-closed", "--save {out}/a.npz: {out}/a.npz is read-only: expected a file "
                         "wasinn may write, or a name in a folder wasinn may write ({out} "
                         "takes no new file)"),
    ("closed", "--save {out}/new.npz: cannot write {out}/new.npz: Permission denied: "
               "expected a writable folder with room for the archive"),
    # A read-only mount, which stops root too: said as such, with no new name offered.
    ("read-only-fs", _READ_ONLY_FS),
    ("read-only-fs-new", _READ_ONLY_FS),
    ("read-only-fs-errno", _READ_ONLY_FS),  # (as the write itself finds it)
    ("dangling", "--save {out}/link.npz: cannot write {out}/gone/a.npz: No such file or "
                 "directory: expected a writable folder with room for the archive"),
], ids=["read-only", "read-only-closed", "closed", "read-only-fs", "read-only-fs-new",
        "read-only-fs-errno", "dangling"])
def test_a_save_that_cannot_be_written_fails_before_the_model_runs(
        affine: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str], case: str, message: str) -> None:
    # Before: only a missing folder or a folder for a file was found before the run; a
    # read-only file or folder failed the save once the model had run, its outputs lost.
    import wasinn._save
    import wasinn.infer

    out = tmp_path / "out"
    out.mkdir()
    np.savez(out / "a.npz", important=np.arange(5))
    target = {"closed": out / "new.npz", "dangling": out / "link.npz",
              "read-only-fs-new": out / "new.npz"}.get(case, out / "a.npz")
    if case.startswith("read-only") and case != "read-only-fs-errno":
        # (os.access answers for the tests' user: root may write; not on a read-only mount)
        real_access = os.access
        monkeypatch.setattr(wasinn._save.os, "access", lambda path, mode: (
            False if ((Path(path) == target and mode == os.W_OK)
                      or (Path(path) == out and case != "read-only"))
            else real_access(path, mode)))
    if case == "closed":
        monkeypatch.setattr(wasinn._save.os, "open", _closed_to_new_files(out))
    elif case.startswith("read-only-fs"):
        monkeypatch.setattr(wasinn._save.os, "open", _read_only_fs(out))
        if case != "read-only-fs-errno":
            monkeypatch.setattr(wasinn._save.os, "statvfs", _read_only_mount(out))
    elif case == "dangling":
        target.symlink_to(out / "gone" / "a.npz")
    before = sorted(p.name for p in out.iterdir())
    ran: list[str] = []
    real_infer = wasinn.infer.infer
    monkeypatch.setattr(wasinn.infer, "infer", lambda rt, name, *args, **kwargs: (
        ran.append(name), real_infer(rt, name, *args, **kwargs))[1])
    code = main(["infer", *affine, "a", "--zeros", "--shape", "x=1,4", "--save", str(target)])
    captured = capfd.readouterr()
    assert code == 1
    assert f"wasinn: error: {message.format(out=out, name=target.name)}\n" in captured.err
    assert (ran, captured.out) == ([], "")  # nothing run, no output printed
    assert sorted(p.name for p in out.iterdir()) == before  # no temporary left


def test_a_save_that_can_be_written_passes_the_check_before_the_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The check tries the save's own temporary file and removes it; a FIFO, which the
    # save writes into, it does not open (with no reader, that would wait for ever).
    import wasinn._save

    check_save_path(tmp_path / "new.npz")
    os.mkfifo(tmp_path / "fifo")
    checked = threading.Thread(target=check_save_path, args=(tmp_path / "fifo",), daemon=True)
    checked.start()
    checked.join(timeout=60)
    assert not checked.is_alive()
    np.savez(tmp_path / "a.npz", old=np.arange(2))
    monkeypatch.setattr(wasinn._save.os, "open", _closed_to_new_files(tmp_path))
    check_save_path(tmp_path / "a.npz")  # a file it may write, in a folder it may not
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npz", "fifo"]


def _cast_onnx(source: int, target: int, in_name: str, out_name: str) -> bytes:
    from onnx import helper

    x = helper.make_tensor_value_info(in_name, source, [1, 4])
    y = helper.make_tensor_value_info(out_name, target, [1, 4])
    node = helper.make_node("Cast", [in_name], [out_name], to=target)
    return onnx_model_bytes(helper.make_graph([node], "cast", [x], [y]))


def test_a_bf16_file_goes_in_and_a_saved_bf16_output_comes_back(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # numpy saves an ml_dtypes.bfloat16 array as 2-byte raw values (|V2). Before, --input
    # refused them and --save wrote bf16 outputs as such values that nothing read back.
    from onnx import TensorProto

    require_backend("onnxruntime")
    (tmp_path / "same.onnx").write_bytes(identity_onnx(TensorType.BF16))  # bf16 x -> y
    (tmp_path / "widen.onnx").write_bytes(
        _cast_onnx(TensorProto.BFLOAT16, TensorProto.FLOAT, "y", "z"))  # bf16 y -> f32 z
    preload = ["--nn-preload", f"same:onnx:cpu:{tmp_path / 'same.onnx'}",
               "--nn-preload", f"widen:onnx:cpu:{tmp_path / 'widen.onnx'}"]
    values = np.array([[1.5, 2.25, -3, 100]], ml_dtypes.bfloat16)
    np.save(tmp_path / "x.npy", values)
    assert np.load(tmp_path / "x.npy").dtype == np.dtype("V2")
    assert main(["infer", *preload, "same", "--input", f"x={tmp_path / 'x.npy'}",
                 "--save", str(tmp_path / "y.npz")]) == 0, capfd.readouterr().err
    assert "y: bf16[1, 4] min -3 max 100 mean 25.1875" in capfd.readouterr().out
    with np.load(tmp_path / "y.npz") as archive:  # as the README says to load it
        y = archive["y"].view(ml_dtypes.bfloat16)
    assert y.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(y, values)
    assert main(["infer", *preload, "widen", "--input", str(tmp_path / "y.npz"),
                 "--save", str(tmp_path / "z.npz")]) == 0, capfd.readouterr().err
    with np.load(tmp_path / "z.npz") as archive:
        np.testing.assert_array_equal(archive["z"], values.astype(np.float32))


def test_raw_2_byte_values_for_an_f32_input_declared_without_a_shape_are_refused(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # Before, an f32 input of unknown rank was taken for TorchScript's placeholder (a type
    # undeclared): the values went in as bf16 and the backend refused them, saying
    # nothing of the |V2 file.
    from tests.backend_models import scalar_onnx

    require_backend("onnxruntime")
    (tmp_path / "m.onnx").write_bytes(scalar_onnx(declared=False))  # x: f32[...]
    np.save(tmp_path / "x.npy", np.ones((1, 4), ml_dtypes.bfloat16))
    code = main(["infer", "--nn-preload", f"m:onnx:cpu:{tmp_path / 'm.onnx'}", "m",
                 "--input", f"x={tmp_path / 'x.npy'}"])
    err = capfd.readouterr().err
    assert code == 1
    assert ("--input x: 2-byte raw values (numpy dtype |V2, as numpy saves an "
            "ml_dtypes.bfloat16 array) but the model expects x: f32[...]: expected f32 "
            "values") in err, err


def test_a_scalar_zero_goes_to_an_input_declared_without_a_shape(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # x declares no shape, not even its rank: --shape x= (no dimensions) makes its zero a
    # scalar, and y, x * 3, is one too. Before, --shape needed a dimension: no scalar.
    from tests.backend_models import scalar_onnx

    require_backend("onnxruntime")
    (tmp_path / "m.onnx").write_bytes(scalar_onnx(3.0, declared=False))  # x: f32[...]
    preload = ["--nn-preload", f"m:onnx:cpu:{tmp_path / 'm.onnx'}", "m", "--zeros"]
    saved = tmp_path / "y.npz"
    assert main(["infer", *preload, "--shape", "x=", "--save", str(saved)]) == 0, (
        capfd.readouterr().err)
    assert capfd.readouterr().out.startswith("y: f32[] min 0 max 0 mean 0")
    with np.load(saved) as archive:
        assert (archive["y"].shape, archive["y"].dtype) == ((), np.float32)
    assert main(["infer", *preload]) == 1  # says how to give a shape, a scalar's included
    assert ("input 'x' declares no shape, not even its rank, so no zero-filled value can be "
            "made for it: give it with --shape x=D,D,... (x= for a scalar; and :TYPE where "
            "f32 will not do, e.g. x=1,8:i64)") in capfd.readouterr().err
    assert main(["infer", *preload, "--shape", "0=:i64"]) == 1  # the model declares f32
    assert ("--shape 0=:i64: type i64 given, but the model declares x: f32[...]: expected "
            "f32") in capfd.readouterr().err


def test_a_scalar_zero_of_the_type_given_goes_to_a_torchscript_model(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # TorchScript declares neither shapes nor types: --shape x=:i64 gives both, a scalar.
    require_backend("torch")
    import torch

    class Successor(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1

    (tmp_path / "next.pt").write_bytes(scripted(Successor()))
    code = main(["infer", "--nn-preload", f"n:pytorch:cpu:{tmp_path / 'next.pt'}", "n",
                 "--zeros", "--shape", "x=:i64"])
    captured = capfd.readouterr()
    assert code == 0, captured.err
    assert captured.out.startswith("output: i64[] min 1 max 1 mean 1")


@pytest.mark.parametrize(("model", "given", "message"), [
    ("bf16", np.float32, "--input x: f32 values but the model expects x: bf16[?, 4]: expected "
                         "bf16 values, saved from an ml_dtypes.bfloat16 array (numpy.save(FILE, "
                         "a.astype(ml_dtypes.bfloat16)), which numpy stores as |V2)"),
    ("bf16", np.int16, "--input x: numpy int16 values but the model expects x: bf16[?, 4]: "
                       "expected bf16 values"),
    ("f32", ml_dtypes.bfloat16,
     "--input x: 2-byte raw values (numpy dtype |V2, as numpy saves an ml_dtypes.bfloat16 "
     "array) but the model expects x: f32[?, 4]: expected f32 values (|V2 is read as bf16, "
     "for a bf16 input)"),
], ids=["f32-for-bf16", "i16-for-bf16", "v2-for-f32"])
def test_a_bf16_type_mismatch_says_what_the_input_takes(
        tmp_path: Path, capfd: pytest.CaptureFixture[str], model: str, given: Any,
        message: str) -> None:
    # An f32 file for a bf16 input is refused, as any other type mismatch is, not rounded.
    require_backend("onnxruntime")
    ttype = TensorType.BF16 if model == "bf16" else TensorType.F32
    (tmp_path / "m.onnx").write_bytes(identity_onnx(ttype))
    np.save(tmp_path / "x.npy", np.ones((1, 4), given))
    code = main(["infer", "--nn-preload", f"m:onnx:cpu:{tmp_path / 'm.onnx'}", "m",
                 "--input", f"x={tmp_path / 'x.npy'}"])
    err = capfd.readouterr().err
    assert code == 1
    assert err.startswith("wasinn: error: ") and message in err, err


def test_a_bf16_file_goes_to_a_torchscript_model_which_declares_no_types(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # TorchScript's inputs declare no type (x: any[...]): the file's 2-byte raw values go
    # to it as bf16, which the module widens.
    require_backend("torch")
    import torch

    class Widen(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.float() * 2

    (tmp_path / "widen.pt").write_bytes(scripted(Widen()))
    np.save(tmp_path / "x.npy", np.array([[1.5, -3]], ml_dtypes.bfloat16))
    code = main(["infer", "--nn-preload", f"w:pytorch:cpu:{tmp_path / 'widen.pt'}", "w",
                 "--input", f"0={tmp_path / 'x.npy'}"])
    captured = capfd.readouterr()
    assert code == 0, captured.err
    assert "f32[1, 2] min -6 max 3 mean -1.5" in captured.out


@pytest.fixture
def tokens(tmp_path: Path) -> list[str]:
    """``--nn-preload`` of a TorchScript embedding of i64 token ids (10 rows of 3, no
    declared input type) as model ``t``."""
    require_backend("torch")
    path = tmp_path / "tokens.pt"
    path.write_bytes(token_model("i64"))
    return ["--nn-preload", f"t:pytorch:cpu:{path}"]


@pytest.mark.parametrize("shape", ["ids=2,8:i64", "0=2,8:I64"], ids=["name", "position"])
def test_zeros_are_of_the_type_given_where_the_model_declares_none(
        tokens: list[str], capfd: pytest.CaptureFixture[str], shape: str) -> None:
    assert main(["infer", *tokens, "t", "--zeros", "--shape", shape]) == 0
    # Token 0's row, for every one of the 2 x 8 zero ids.
    assert capfd.readouterr().out.startswith("output: f32[2, 8, 3] min ")


def test_a_run_failing_on_f32_zeros_of_an_undeclared_type_says_how_to_give_one(
        tokens: list[str], tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    assert main(["infer", *tokens, "t", "--zeros", "--shape", "ids=2,8"]) == 1
    err = capfd.readouterr().err
    assert err.startswith("wasinn: error: pytorch: the TorchScript model rejected its inputs")
    assert err.rstrip().endswith(
        "; the model declares no element type for input 'ids', so its zeros were f32: if it "
        "takes another type, give it with --shape ids=2,8:TYPE (e.g. --shape ids=2,8:i64)"), err
    # Not for values from a file: their type is the file's, not a default of wasinn's.
    np.save(tmp_path / "ids.npy", np.zeros((1, 3), np.float32))
    assert main(["infer", *tokens, "t", "--input", f"ids={tmp_path / 'ids.npy'}"]) == 1
    err = capfd.readouterr().err
    assert "the TorchScript model rejected its inputs" in err
    assert "declares no element type" not in err


def test_a_type_that_does_not_parse_is_a_usage_error(
        tokens: list[str], capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["infer", *tokens, "t", "--zeros", "--shape", "ids=2,8:int64"])
    assert exc.value.code == 2
    assert ("wasinn infer: error: --shape 'ids=2,8:int64': unknown tensor type 'int64': "
            "expected one of f16, f32, f64, bf16, u8, i32, i64") in capfd.readouterr().err
