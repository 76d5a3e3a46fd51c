"""Edges of the config, the registry and the command line that a user or a guest can hit:
each bad value an error naming the file or flag, the key and what was expected, never a
traceback, a silently ignored value, or an error that blames a file the user did not
write."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.guest_support import WAT_DIR
from tests.support import require_backend
from wasinn import ConfigError, InvalidArgumentError
from wasinn.backends.base import TensorSpec
from wasinn.cli import main
from wasinn.configs.loader import load_config
from wasinn.enums import TensorType
from wasinn.infer import complete_inputs, read_inputs
from wasinn.modelgen import affine_onnx

GUEST = str(WAT_DIR / "exit_code.wat")  # exits with 42


def write(directory: Path, text: str, name: str = "wasinn.toml") -> Path:
    path = directory / name
    path.write_text(text)
    return path


# -- the config file ------------------------------------------------------------------------
def test_toml_nested_too_deeply_is_a_config_error_naming_the_file(tmp_path: Path) -> None:
    # tomllib recurses per level: a RecursionError, which named neither file nor problem.
    for value in ("[" * 5000 + "]" * 5000, "{ a = " * 5000 + "1" + " }" * 5000):
        path = write(tmp_path, f"[models.m]\nfiles = [\"m.onnx\"]\noptions = {{ x = {value} }}\n")
        with pytest.raises(ConfigError, match=r"wasinn\.toml: not valid TOML"):
            load_config(path)


def test_a_config_saved_with_a_byte_order_mark_reads_as_one_without(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # What Windows editors save as "UTF-8 with BOM": tomllib alone refused it at line 1,
    # column 1, pointing at a character nobody can see.
    text = '[pools.cpu]\nkind = "cpu"\n[models.m]\nfiles = ["m.onnx"]\nthreads = 2\n'
    plain = write(tmp_path, text, "plain.toml")
    bom = tmp_path / "bom.toml"
    bom.write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert load_config(bom).model_dump() == load_config(plain).model_dump()
    assert main(["models", "--config", str(bom)]) == 0
    assert capfd.readouterr().out.splitlines()[1].startswith("m ")
    # Only at the start: a BOM anywhere else is a character, which TOML refuses.
    bom.write_bytes(text.encode() + b"\xef\xbb\xbf")
    with pytest.raises(ConfigError, match=r"bom\.toml: not valid TOML: .*line 6"):
        load_config(bom)


def test_a_config_path_with_a_nul_byte_is_an_invalid_argument(tmp_path: Path) -> None:
    # Not a ValueError from the file system ("embedded null byte").
    with pytest.raises(InvalidArgumentError, match=r"config path .* contains a NUL byte"):
        load_config(f"{tmp_path}/a\0b.toml")


@pytest.mark.parametrize(("text", "key"), [
    # Keys the user writes that look like pydantic's names for union members
    # ("list[...]", "dict[...]") were dropped from the key path.
    ('[models.m]\nfiles = ["m.onnx"]\nwarmup = 1\nwarmup_inputs = { "list[x]" = [true] }\n',
     r'models\.m\.warmup_inputs\."list\[x\]"\[0\]: Input should be a valid integer'),
    ('[models.m]\nfiles = ["m.onnx"]\n[pipelines.p]\nsteps = [{ model = "m" }, '
     '{ model = "m", wire = { "out[0]" = 3 } }]\n',
     r'pipelines\.p\.steps\[1\]\.wire\."out\[0\]": Input should be a valid string'),
    ('[models."list[x]"]\nfiles = 3\n',
     r'models\."list\[x\]": name .* is not a plain identifier.*; '
     r'models\."list\[x\]"\.files: Input should be a valid list'),
    # (the tags of a warm-up input's forms look alike: "list[shape]")
    ('[models.m]\nfiles = ["m.onnx"]\nwarmup = 1\nwarmup_inputs = { "list[shape]" = [true] }\n',
     r'models\.m\.warmup_inputs\."list\[shape\]"\[0\]: Input should be a valid integer'),
    ('[models.m]\nfiles = ["m.onnx"]\nwarmup = 1\n'
     'warmup_inputs = { "table[shape, type]" = { shape = [1], type = "x" } }\n',
     r'models\.m\.warmup_inputs\."table\[shape, type\]"\.type: unknown tensor type'),
    # ... while pydantic's own union members still leave the path.
    ('[pools.g]\nkind = "gpu"\ndevices = ["gpu:0", 3]\n',
     r'pools\.g\.devices\[1\]: Input should be a valid string'),
])
def test_a_key_that_looks_like_a_union_member_stays_in_the_key_path(
        tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        load_config(write(tmp_path, text))


# -- wasinn infer -----------------------------------------------------------------------------
SPECS = [TensorSpec("x", TensorType.F32, (None, 4))]


@pytest.mark.parametrize("key", ["\u00b2", "1" * 5000])
def test_an_input_key_that_is_no_position_is_a_name(key: str) -> None:
    # '²'.isdigit() holds but int('²') fails, as int() does past 4300 digits: a
    # ValueError (a traceback from the command) instead of "no such input".
    given = {key: np.zeros((1, 4), np.float32)}
    with pytest.raises(InvalidArgumentError, match="the model has no such input"):
        complete_inputs(SPECS, given, zeros=False, shapes={})
    with pytest.raises(InvalidArgumentError, match="the model has no such input"):
        complete_inputs(SPECS, {}, zeros=True, shapes={key: (1, 4)})


@pytest.mark.parametrize("shape", [(10**15,), (10**30,)])
def test_a_npy_header_claiming_a_huge_array_is_an_invalid_argument(
        tmp_path: Path, shape: tuple[int, ...]) -> None:
    # 16 bytes of data under a header that claims petabytes: numpy tries to allocate
    # what the header says (MemoryError, or OverflowError past a C long).
    from numpy.lib import format as npy

    path = tmp_path / "huge.npy"
    with path.open("wb") as file:
        npy.write_array_header_1_0(file, {"descr": "<f4", "fortran_order": False,
                                          "shape": shape})
        file.write(bytes(16))
    with pytest.raises(InvalidArgumentError,
                       match=r"--input x=.*huge\.npy: .*huge\.npy declares an array too large "
                             r"to allocate here"):
        read_inputs([f"x={path}"])


def test_the_command_says_so_for_a_position_it_cannot_read(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    require_backend("onnxruntime")
    (tmp_path / "affine.onnx").write_bytes(affine_onnx())
    np.save(tmp_path / "x.npy", np.zeros((1, 4), np.float32))
    code = main(["infer", "--nn-preload", f"a:onnx:cpu:{tmp_path / 'affine.onnx'}", "a",
                 "--input", f"\u00b2={tmp_path / 'x.npy'}"])
    err = capfd.readouterr().err
    assert code == 1
    assert err.startswith("wasinn: error: --input \u00b2: the model has no such input")


# -- preloads on the command line -------------------------------------------------------------
def test_a_preload_name_given_twice_is_refused(tmp_path: Path,
                                               capfd: pytest.CaptureFixture[str]) -> None:
    # The second silently replaced the first: a guest asking for "a" got the other file.
    first, second = tmp_path / "first.onnx", tmp_path / "second.onnx"
    graph = tmp_path / "a"
    graph.mkdir()
    for argv, said in (
            (["--nn-preload", f"a:onnx:cpu:{first}", "--nn-preload", f"a:onnx:cpu:{second}"],
             f"--nn-preload 'a:onnx:cpu:{second}': the name 'a' is already given by "
             f"--nn-preload 'a:onnx:cpu:{first}': expected each name once"),
            (["--nn-preload", f"a:onnx:cpu:{first}", "--wasi", f"nn-graph=onnx::{graph}"],
             f"--wasi 'nn-graph=onnx::{graph}': the name 'a' is already given by "
             f"--nn-preload 'a:onnx:cpu:{first}'")):
        for command in (["models"], ["run"]):
            tail = [GUEST] if command == ["run"] else []
            with pytest.raises(SystemExit) as exc:  # a usage error, as for --dir
                main([*command, *argv, *tail])
            assert exc.value.code == 2
            err = capfd.readouterr().err
            assert f"wasinn {command[0]}: error: {said}" in err, err


def test_a_preload_no_backend_reads_names_the_flag_not_the_config(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # The runtime's backend check blamed the config file (or the installed package's
    # default.toml) for an encoding that only the command line gave.
    config = write(tmp_path, '[runtime]\nbackends = ["onnxruntime"]\n')
    spec = f"a:ggml:cpu:{tmp_path / 'm.bin'}"
    for argv in (["run", "--config", str(config), "--nn-preload", spec, GUEST],
                 ["run", "--nn-preload", spec, GUEST],
                 ["models", "--nn-preload", spec]):
        assert main(argv) == 1
        err = capfd.readouterr().err
        assert err.startswith(f"wasinn: error: --nn-preload {spec!r}: models.a.encoding: no "
                              "backend here reads 'ggml' models"), err
        assert str(config) not in err and "default.toml" not in err


# -- --dir --------------------------------------------------------------------------------------
def test_one_guest_path_for_two_host_directories_is_a_usage_error(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # The later one silently won: a guest reading /data saw only one of them.
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    with pytest.raises(SystemExit) as exc:
        main(["run", "--dir", f"{one}::/data", "--dir", f"/data:{two}", GUEST])
    assert exc.value.code == 2
    err = capfd.readouterr().err
    assert (f"wasinn run: error: --dir '/data:{two}': the guest path '/data' is already "
            f"{str(one)!r}: expected one host directory per guest path") in err
    # The same mapping twice, or one directory under two guest paths, is no conflict.
    assert main(["run", "--dir", f"{one}::/data", "--dir", f"/data:{one}",
                 "--dir", f"{one}::/other", GUEST]) == 42
