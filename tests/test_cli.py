"""The ``wasinn`` command: run (WasmEdge and Wasmtime flags), devices, models, demo."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.component_guests import build_sleep
from tests.guest_support import WAT_DIR, GuestModels, example_guest, make_guest_models
from tests.support import require_backend
from wasinn._cli_parser import build_parser
from wasinn.cli import main, parse_dir, parse_env, parse_envs
from wasinn.enums import ExecutionTarget
from wasinn.errors import InvalidArgumentError
from wasinn.host.preload import parse_nn_graph, parse_nn_preload
from wasinn.infer import parse_shapes
from wasinn.modelgen import ModelFiles
from wasinn.scheduler.warmup import ZeroInput


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, small_mobilenet: ModelFiles) -> GuestModels:
    require_backend("onnxruntime")
    return make_guest_models(tmp_path_factory.mktemp("cli-models"), small_mobilenet)


@pytest.fixture(scope="module")
def classify_named(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return example_guest("classify_named", tmp_path_factory.mktemp("cli-guests"))


def test_dir_syntaxes() -> None:
    assert parse_dir("/srv/m::/models") == ("/models", "/srv/m")   # Wasmtime HOST::GUEST
    assert parse_dir("data") == ("data", "data")                   # HOST alone
    assert parse_dir("/models:/srv/m") == ("/models", "/srv/m")    # WasmEdge GUEST:HOST


def test_a_flag_given_twice_does_what_the_readme_says() -> None:
    # Before, the README said a flag "given twice" was a usage error, while --timeout,
    # --fuel, --requests and --env given twice were silently accepted, the last winning.
    readme = " ".join((Path(__file__).parents[1] / "README.md").read_text().split())
    assert ("Of a flag that takes one value (`--timeout`, `--fuel`, `--requests`, "
            "`--concurrency`, `--target`, `--save`, `--config`, ...), the last one given "
            "counts") in readme
    assert "the same one given twice counts once" in readme
    parser = build_parser()
    run = parser.parse_args(["run", "--timeout", "5", "--timeout", "50", "--fuel", "7",
                             "--fuel", "9", "--config", "a", "--config", "b", "g.wasm"])
    assert (run.timeout, run.fuel, run.config) == (50.0, 9, "b")
    infer = parser.parse_args(["infer", "m", "--requests", "2", "--requests", "3",
                               "--concurrency", "4", "--concurrency", "1", "--target", "gpu",
                               "--target", "cpu", "--save", "a", "--save", "b"])
    assert (infer.requests, infer.concurrency, infer.target, infer.save) == (3, 1, "cpu", "b")
    assert parse_envs(["A=1", "B=2", "A=1"]) == {"A": "1", "B": "2"}
    assert parse_shapes(["x=1,4", "x=1,4"]) == {"x": ZeroInput((1, 4))}


def test_env_syntaxes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WASINN_TEST_VALUE", "from-host")
    assert parse_env("A=b=c") == ("A", "b=c")
    assert parse_env("WASINN_TEST_VALUE") == ("WASINN_TEST_VALUE", "from-host")


def test_preload_syntaxes(tmp_path: Path) -> None:
    p = parse_nn_preload("mobilenet:OpenVINO:AUTO:/m/x.xml:/m/x.bin")
    assert (p.name, p.encoding.value, p.target, [str(x) for x in p.paths]) == (
        "mobilenet", "openvino", None, ["/m/x.xml", "/m/x.bin"])
    assert parse_nn_preload("m:onnx:GPU:/m.onnx").target is ExecutionTarget.GPU
    with pytest.raises(InvalidArgumentError, match="NAME:ENCODING:TARGET:PATH"):
        parse_nn_preload("m:onnx:/m.onnx")
    # An unknown enum value names the flag it came with.
    for parse, spec, said in (
            (parse_nn_preload, "m:caffe:cpu:/m", "graph encoding 'caffe'"),
            (parse_nn_preload, "m:onnx:xpu:/m", "execution target 'xpu'"),
            (parse_nn_graph, "nn-graph=caffe::/m", "graph encoding 'caffe'")):
        flag = "--nn-preload" if parse is parse_nn_preload else "--wasi"
        with pytest.raises(InvalidArgumentError,
                           match=f"^{flag} '{spec}': unknown {said}: expected one of "):
            parse(spec)
    graph = parse_nn_graph(f"nn-graph=openvino::{tmp_path / 'fixture'}")
    assert graph.name == "fixture"
    assert [p.name for p in graph.paths] == ["model.xml", "model.bin"]
    with pytest.raises(InvalidArgumentError, match="nn-graph=ENCODING::DIR"):
        parse_nn_graph("nn-graph=onnx:/x")
    # A name is checked where it is given, not later as a config key:
    with pytest.raises(InvalidArgumentError,
                       match=r"^--nn-preload 'a/b:onnx:cpu:/m.onnx': name 'a/b' is not a plain "
                             r"identifier: expected at most 128 letters, digits"):
        parse_nn_preload("a/b:onnx:cpu:/m.onnx")
    with pytest.raises(InvalidArgumentError,
                       match=r"the folder's name is the model's: name 'my model' is not a plain"):
        parse_nn_graph(f"nn-graph=onnx::{tmp_path / 'my model'}")


def test_run_with_wasmedge_preload(models: GuestModels, classify_named: Path,
                                   capfd: pytest.CaptureFixture[str]) -> None:
    code = main(["run", "--nn-preload", f"net:ONNX:CPU:{models.directory / 'model.onnx'}",
                 "--dir", f"/data:{models.directory}", str(classify_named),
                 "net", "/data/input.bin"])
    assert code == 0
    assert re.search(r"top-1: class \d+ score", capfd.readouterr().out)


@pytest.mark.parametrize("flag", [None, "--sandbox", "--no-sandbox"])
def test_a_guests_own_model_runs_sandboxed_on_the_cpu_unless_told_not_to(
        models: GuestModels, tmp_path: Path, capfd: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture, flag: str | None) -> None:
    classify = example_guest("classify", tmp_path)
    argv = ["run", "--dir", f"/data:{models.directory}", str(classify), "/data/model.onnx",
            "/data/input.bin"]
    with caplog.at_level("DEBUG", logger="wasinn.backends"):
        assert main([argv[0], *([flag] if flag else []), *argv[1:]]) == 0
    out = capfd.readouterr().out
    assert re.search(r"top-1: class \d+ score", out)
    sandboxed = re.search(r"onnxruntime\)?: sandbox process \d+ on cpu loaded the model",
                          caplog.text)
    assert bool(sandboxed) is (flag != "--no-sandbox")


def test_sandbox_and_no_sandbox_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--sandbox", "--no-sandbox", "guest.wasm"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_run_with_wasmtime_graph_dir(models: GuestModels, classify_named: Path,
                                     tmp_path: Path, capfd: pytest.CaptureFixture[str],
                                     caplog: pytest.LogCaptureFixture) -> None:
    graph_dir = tmp_path / "mobile"
    graph_dir.mkdir()
    (graph_dir / "model.onnx").write_bytes((models.directory / "model.onnx").read_bytes())
    code = main(["-v", "run", "-S", "nn", "--wasi", f"nn-graph=onnx::{graph_dir}", "--dir",
                 f"{models.directory}::/data", str(classify_named), "--legacy", "mobile",
                 "/data/input.bin"])
    captured = capfd.readouterr()
    assert code == 0
    assert "top-1: class" in captured.out
    # -v: load and run times (pytest's log capture stands in for stderr here)
    assert re.search(r"graph 0: 'mobile' loaded by name in [\d.]+ ms", caplog.text)
    assert re.search(r"classify_named.wasm ran for [\d.]+ ms", caplog.text)
    # ... and at the end what the model (released by the guest at exit) and the device did
    assert re.search(r"mobile: 1 completed, 0 failed, .*\(1 in the caller's thread\), "
                     r"latency p50 [\d.]+ ms", caplog.text)
    # (the guest's tenant: its file's name)
    assert re.search(r"tenant 'classify_named.wasm' \(weight 1, [\d.]+ s running\): 1 "
                     r"completed, 0 failed", caplog.text)
    assert re.search(r"cpu: 1 completed, 0 failed, .*\(1 in the caller's thread\), "
                     r"latency p50 [\d.]+ ms p99 [\d.]+ ms: queued p50 [\d.]+ ms p99 [\d.]+ "
                     r"ms, running p50 [\d.]+ ms p99 [\d.]+ ms, delivering p50 0\.00 ms p99 "
                     r"0\.00 ms \(last 1\); 0/\d+ running, "
                     r"0 queued, 0 graph\(s\) held, 1 compiled", caplog.text)


def test_wasmtime_s_flags_may_be_comma_separated_and_a_preload_repeated_in_any_case(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # Before: Wasmtime's own "-S nn,nn-graph=openvino::DIR" was a usage error (status 2),
    # and the same --nn-preload written in other letter case was a name given twice.
    from wasinn.modelgen import affine_onnx

    graph_dir = tmp_path / "mobile"
    graph_dir.mkdir()
    (graph_dir / "model.onnx").write_bytes(affine_onnx())
    model = tmp_path / "a.onnx"
    model.write_bytes(affine_onnx())
    assert main(["models", "-S", f"common,nn,nn-graph=onnx::{graph_dir}",
                 "--nn-preload", f"a:onnx:cpu:{model}",
                 "--nn-preload", f"a:ONNX:CPU:{model}"]) == 0
    rows = [line.split()[:4] for line in capfd.readouterr().out.splitlines()[1:]]
    assert ["a", "model", "onnx", "cpu"] in rows and ["mobile", "model", "onnx"] in [
        row[:3] for row in rows]
    with pytest.raises(SystemExit) as exc:
        main(["models", "-S", f"nn,nn-graph=onnx::{graph_dir},foo=1"])
    assert exc.value.code == 2
    said = capfd.readouterr().err
    assert "--wasi 'foo=1': expected nn-graph=ENCODING::DIR" in said
    assert "whose commas separate items, as Wasmtime's -S does" in said
    with pytest.raises(SystemExit):
        main(["models", "--nn-preload", f"a:onnx:cpu:{model}",
              "--nn-preload", f"a:openvino:cpu:{model}"])
    assert "the name 'a' is already given by --nn-preload" in capfd.readouterr().err


def test_missing_preloaded_file_is_model_not_found(models: GuestModels, classify_named: Path,
                                                   tmp_path: Path,
                                                   capfd: pytest.CaptureFixture[str]) -> None:
    code = main(["run", "--nn-preload", f"gone:onnx:cpu:{tmp_path / 'gone.onnx'}", "--dir",
                 f"{models.directory}::/data", str(classify_named), "gone", "/data/input.bin"])
    assert code == 10 + 103 - 90  # classify_named's exit status for errno 103
    assert "load_by_name failed: wasi-nn errno 103" in capfd.readouterr().err


def test_run_passes_args_env_and_exit_code(capfd: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--env", "A=1", str(WAT_DIR / "exit_code.wat")]) == 42


def test_trap_prints_message_and_exits_nonzero(capfd: pytest.CaptureFixture[str]) -> None:
    code = main(["run", str(WAT_DIR / "trap.wat")])
    assert code == 134
    assert "unreachable" in capfd.readouterr().err


def test_bad_command_lines(capfd: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["run", str(tmp_path / "absent.wasm")]) == 1
    assert capfd.readouterr().err == (
        f"wasinn: error: {tmp_path / 'absent.wasm'}: no such file: expected a guest module "
        "(.wasm, or .wat text)\n")
    assert main(["run", "--dir", str(tmp_path / "nope"), str(WAT_DIR / "exit_code.wat")]) == 1
    assert "expected an existing host directory" in capfd.readouterr().err
    # A value with a syntax of its own that does not parse is a usage error (2), with the
    # subcommand's usage line, whichever option it came with.
    guest = str(WAT_DIR / "exit_code.wat")
    for argv, said in (
            (["run", "--nn-preload", "x:onnx:/y", guest],
             "wasinn run: error: --nn-preload 'x:onnx:/y': expected NAME:ENCODING:TARGET:PATH"),
            (["run", "-S", "foo=1", guest],
             "wasinn run: error: --wasi 'foo=1': expected nn-graph=ENCODING::DIR (or nn"),
            (["models", "--nn-preload", "a:b"],
             "wasinn models: error: --nn-preload 'a:b': expected NAME:ENCODING"),
            (["infer", "m", "--shape", "x=2,x"], "wasinn infer: error: --shape 'x=2,x': expected"),
            (["infer", "m", "--shape", "x=1,4", "--shape", "x=2,4"],
             "--shape 'x=2,4': x is already given as x=1,4: expected one shape (and type) "
             "per input"),
            (["infer", "m", "--shape", "x=1,4:f32", "--shape", "x=1,4:i64"],
             "--shape 'x=1,4:i64': x is already given as x=1,4:f32: expected one shape"),
            (["infer", "m", "--input", "x=a.npy", "--input", "x=b.npy"],
             "wasinn infer: error: --input 'x=b.npy': x is already given by --input "
             "'x=a.npy': expected one value per input"),
            (["run", "--env", "A=1", "--env", "A=2", guest],
             "wasinn run: error: --env 'A=2': A is already '1': expected one value per "
             "variable"),
            (["infer", "m", "--requests", "0"], "wasinn infer: error: --requests 0: expected"),
            (["infer", "m", "--timeout", "-1"], "wasinn infer: error: --timeout -1.0: expected"),
            (["infer", "m", "--input", "=x.npy"],
             "wasinn infer: error: --input '=x.npy': expected NAME=FILE.npy or FILE.npz")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2, argv
        err = capfd.readouterr().err
        assert err.startswith(f"usage: wasinn {argv[0]}") and said in err, err
    with pytest.raises(SystemExit) as exc:
        main(["run", "--env", "=x", str(WAT_DIR / "exit_code.wat")])
    assert exc.value.code == 2
    # With run's usage line, not the top-level one:
    assert capfd.readouterr().err.startswith(
        "usage: wasinn run [options] GUEST.wasm [ARGS ...]\nwasinn run: error: --env '=x': "
        "expected KEY=VALUE or KEY")
    # Usage errors name only what is wrong (ARGS is optional; a width must be finite).
    for argv, said in ((["run"], "the following arguments are required: GUEST.wasm\n"),
                       (["demo", "--width", "nan"], "--width: nan: expected a width multiplier"),
                       (["demo", "--width", "0"], "--width: 0: expected a width multiplier")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        err = capfd.readouterr().err
        assert said in err and "ARGS" not in err.splitlines()[-1]


@pytest.mark.parametrize(("start", "said"), [
    ("(param i32)", "guest.wat's _start has type (i32) -> (): expected () -> ()"),
    ("(result i32) i32.const 5", "guest.wat's _start has type () -> (i32): expected () -> ()"),
])
def test_a_start_function_of_another_type_is_refused(
        capfd: pytest.CaptureFixture[str], tmp_path: Path, start: str, said: str) -> None:
    # Not a trap (exit 134), nor a run that ignores the result: a bad module (exit 1).
    guest = tmp_path / "guest.wat"
    guest.write_text(f'(module (memory (export "memory") 1) (func (export "_start") {start}))')
    assert main(["run", str(guest)]) == 1
    assert said in capfd.readouterr().err


def test_guest_text_that_is_not_utf8_is_refused(capfd: pytest.CaptureFixture[str],
                                                tmp_path: Path) -> None:
    # What a shell passes for the bytes b"\xff" (Python keeps them as a lone surrogate).
    guest = str(WAT_DIR / "exit_code.wat")
    for argv, said in (
            (["run", guest, "ok", "\udcff"], "argument 2 is not valid UTF-8 ('\\udcff')"),
            (["run", "--env", "K=\udcff", guest],
             "the value of environment variable 'K' is not valid UTF-8"),
            (["run", "--dir", f"{tmp_path}::/\udcff", guest],
             "a preopened directory's guest path is not valid UTF-8")):
        assert main(argv) == 1
        err = capfd.readouterr().err
        assert said in err and "expected UTF-8 text" in err and "Traceback" not in err


@pytest.mark.parametrize("guest", [WAT_DIR / "start_trap.wat",
                                   WAT_DIR.parent / "components" / "start_trap.wat"],
                         ids=["core-module", "component"])
def test_a_trap_in_the_start_function_prints_its_message(
        capfd: pytest.CaptureFixture[str], guest: Path) -> None:
    code = main(["run", str(guest)])
    assert code == 134
    assert "unreachable" in capfd.readouterr().err


def test_devices_table(capfd: pytest.CaptureFixture[str]) -> None:
    assert main(["devices"]) == 0
    out = capfd.readouterr().out
    assert re.search(r"^BACKEND\s+STATUS\s+DEVICES\s+ENCODINGS", out, re.M)
    assert re.search(r"^onnxruntime\s+installed\s+cpu", out, re.M)
    assert re.search(r"^cpu\s+cpu\s+.*onnxruntime", out, re.M)


def test_devices_of_a_config_whose_models_cannot_load(tmp_path: Path,
                                                     capfd: pytest.CaptureFixture[str]) -> None:
    # What an operator asks when a start has just failed: the devices do not depend on
    # the models, which are neither loaded nor warmed up to list them.
    config = tmp_path / "c.toml"
    config.write_text('[models.d]\nfiles = ["not_there_yet.onnx"]\npreload = true\nwarmup = 2\n')
    assert main(["devices", "--config", str(config)]) == 0
    out = capfd.readouterr().out
    assert re.search(r"^DEVICE\s+KIND\s+BACKENDS\ncpu\s+cpu\s+\w", out, re.M), out
    assert main(["run", "--config", str(config), str(WAT_DIR / "exit_code.wat")]) == 1
    assert "not_there_yet.onnx' cannot be read" in capfd.readouterr().err  # (as a start does)


@pytest.mark.parametrize("command", ["devices", "models"])
def test_a_command_whose_stdout_is_closed_stops_quietly(command: str) -> None:
    # `wasinn devices | head -1`: the reader has gone, which is no error of wasinn's;
    # status 141, as a shell reports a command that SIGPIPE ended.
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "wasinn", command], stdout=write,
                              stderr=subprocess.PIPE, text=True, check=False, timeout=120)
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (141, "")


def test_a_broken_pipe_that_is_not_stdout_stays_an_error(
        monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    import wasinn._cli_listings

    def broken(*args: object) -> None:  # a pipe to another process, say
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(wasinn._cli_listings, "print_models", broken)
    assert main(["models"]) == 1
    assert capfd.readouterr().err == "wasinn: error: [Errno 32] Broken pipe\n"


def test_models_table(models: GuestModels, tmp_path: Path,
                      capfd: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "c.toml"
    model = models.directory / "model.onnx"
    config.write_text(f'[models.net]\nfiles = ["{model}"]\nencoding = "onnx"\n'
                      f'[models.warm]\nfiles = ["{model}"]\nwarmup = 2\n'
                      f'[models.kept]\nfiles = ["{model}"]\nresident = true\n'
                      'batching = { max_batch = 4, max_delay_ms = 2 }\n'
                      '[pipelines.both]\nsteps = [{ model = "net" }]\npreload = true\n'
                      'batching = { max_batch = 8 }\n')
    assert main(["models", "--config", str(config)]) == 0
    out = capfd.readouterr().out
    assert re.search(r"^net\s+model\s+onnx\s+cpu\s+first use\s+-\s+/", out, re.M)
    assert re.search(r"^warm\s+model\s+autodetect\s+cpu\s+at start, 2 warm-up run\(s\)\s+-\s+/",
                     out, re.M)
    assert re.search(r"^kept\s+model\s+autodetect\s+cpu\s+first use, kept\s+"
                     r"up to 4, waits 2 ms\s+/", out, re.M)
    assert re.search(r"^both\s+pipeline\s+-\s+cpu\s+at start\s+up to 8\s+net$", out, re.M)
    assert main(["models"]) == 0
    # Not the path of the installed package's default.toml, which nobody should edit:
    assert capfd.readouterr().out.startswith(
        "no models registered in the embedded default config: add a [models] table")


def test_demo_workdir_that_cannot_be_a_folder(tmp_path: Path,
                                              capfd: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "afile").write_text("")
    for workdir, said in ((tmp_path / "afile" / "sub", "cannot be created (Not a directory)"),
                          (tmp_path / "afile", "not a folder")):
        assert main(["demo", "--workdir", str(workdir)]) == 1
        assert capfd.readouterr().err == (
            f"wasinn: error: --workdir {workdir}: {said}: expected a folder wasinn can "
            "create or write in\n")


def test_demo_with_no_backend_installed_runs_nothing_and_says_so(
        tmp_path: Path, capfd: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # (Before: every format was skipped, the table was empty and the status 0.)
    import importlib.util

    from wasinn.host import demo

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: (
        None if name in demo.LIBRARIES else find_spec(name, *args)))
    assert main(["demo", "--workdir", str(tmp_path)]) == 1
    assert capfd.readouterr().err == (
        "wasinn: error: the demo runs nothing: no backend is installed (none of "
        "onnxruntime, openvino, torch): pip install 'wasinn[all]'\n")


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from wasinn import __version__

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"wasinn {__version__}\n"
    run = subprocess.run([sys.executable, "-m", "wasinn", "--version"], capture_output=True,
                         text=True, check=False, timeout=120)
    assert (run.returncode, run.stdout) == (0, f"wasinn {__version__}\n"), run.stderr


@pytest.mark.slow
def test_demo_classifies_end_to_end(tmp_path: Path) -> None:
    example_guest("classify", tmp_path)  # skips without a compiler
    workdir = tmp_path / "demo's files"  # (printed quoted)
    wasinn = [sys.executable, "-m", "wasinn"]
    proc = subprocess.run([*wasinn, "demo", "--workdir", str(workdir)],
                          capture_output=True, text=True, check=False, timeout=600)
    assert proc.returncode == 0, proc.stderr
    # The command it shows for each format runs as shown (the guest by its full path).
    [shown, *_] = re.findall(r"^\$ (wasinn run .*)$", proc.stdout, re.M)
    again = subprocess.run([*wasinn, *shlex.split(shown)[1:]], capture_output=True,
                           text=True, check=False, timeout=600)
    assert again.returncode == 0, (shown, again.stderr)
    assert re.findall(r"^top-1: .*", again.stdout, re.M) == re.findall(
        r"^top-1: .*", proc.stdout, re.M)[:1]
    # One guest run per format, the host picking the backend from the bytes.
    guests = re.findall(r"^top-1: class (\d+) score (\S+)", proc.stdout, re.M)
    table = dict(re.findall(r"^(ONNX|OpenVINO IR|TorchScript)\s+(\w+)\s+\d+", proc.stdout, re.M))
    assert table == {"ONNX": "onnxruntime", "OpenVINO IR": "openvino",
                     "TorchScript": "pytorch"}, proc.stdout
    assert len(guests) == 3 and len(set(guests)) == 1, proc.stdout
    rows = re.findall(r"^(?:ONNX|OpenVINO IR|TorchScript)\s+\w+\s+(\d+)\s+(\S+)", proc.stdout,
                      re.M)
    assert {c for c, _ in rows} == {guests[0][0]}  # host checks agree with the guests


def interrupted_run(tmp_path: Path, guest: str | Path, settle_s: float = 0.0
                    ) -> tuple[int, str]:
    """``wasinn run -v guest`` (a .wat of tests/wat, or a path) sent SIGINT ``settle_s``
    after the guest started, its stdin a pipe that stays open and sends nothing: its
    status and what it said."""
    import signal
    import time

    path = WAT_DIR / guest if isinstance(guest, str) else guest
    child = subprocess.Popen(
        [sys.executable, "-m", "wasinn.cli", "run", "-v", str(path)],
        stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509
    assert child.stderr is not None and child.stdin is not None
    said = []
    try:
        for line in child.stderr:  # until the guest runs
            said.append(line)
            if f"instantiated {path.name}" in line:
                break
        time.sleep(settle_s)
        child.send_signal(signal.SIGINT)
        child.wait(timeout=60)  # (not communicate(), which would close the guest's stdin)
        said.append(child.stderr.read())
    finally:
        child.kill()
        child.stdin.close()
        child.stderr.close()
    return child.returncode, "".join(said)


def test_ctrl_c_ends_a_run_with_status_130(tmp_path: Path) -> None:
    # SIGINT reaches trio as a KeyboardInterrupt that its nurseries wrap in an exception
    # group: the command still ends quietly with the shell's status for it, 128 + 2.
    code, said = interrupted_run(tmp_path, "spin.wat")
    assert code == 130, said
    assert "Traceback" not in said and "KeyboardInterrupt" not in said, said
    assert "did not stop" not in said  # a spinning guest stops at once


def test_ctrl_c_ends_a_run_whose_guest_waits_for_its_stdin(tmp_path: Path) -> None:
    # The guest reads a pipe the host fills from its stdin, which Ctrl-C closes. Before
    # the pipe: its read went on in wasmtime, which the cancellation cannot reach, and
    # the command left after a grace of 2 s; before the grace, it waited for input.
    code, said = interrupted_run(tmp_path, "read_stdin.wat", settle_s=1.0)
    assert code == 130, said
    assert "did not stop" not in said and "Traceback" not in said, said


def test_ctrl_c_ends_a_run_whose_guest_is_blocked_in_a_host_call(tmp_path: Path) -> None:
    # A component's WASI sleep runs in wasmtime, which the cancellation cannot reach:
    # the command exits 2 s after Ctrl-C, saying why. (Ctrl-C comes 1 s after the start:
    # one that came before the guest called its sleep would stop it at once.)
    component = tmp_path / "sleep.wasm"
    component.write_bytes(build_sleep(tmp_path))
    code, said = interrupted_run(tmp_path, component, settle_s=1.0)
    assert code == 130, said
    assert ("wasinn: the guest did not stop within 2 s of Ctrl-C (it is blocked in a host "
            "call, such as a component's WASI sleep): exiting") in said
    assert "Traceback" not in said


def test_run_gives_the_guest_the_commands_stdin() -> None:
    proc = subprocess.run([sys.executable, "-m", "wasinn.cli", "run",
                           str(WAT_DIR / "read_stdin.wat")],
                          input=b"hello\n", capture_output=True, check=False, timeout=120)
    assert proc.returncode == 6, proc.stderr  # the number of bytes it read


@pytest.mark.parametrize("step", ["build_parser", "parse_args", "_configure_logging"])
def test_ctrl_c_while_the_command_line_is_read_exits_quietly_with_130(
        step: str, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    # Before: these ran outside main's try, and a Ctrl-C there printed a traceback.
    import argparse

    import wasinn.cli

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    where = argparse.ArgumentParser if step == "parse_args" else wasinn.cli
    monkeypatch.setattr(where, step, interrupted)
    try:
        status = main(["-v", "models"])
    except KeyboardInterrupt:  # (which would end pytest's session)
        pytest.fail("the KeyboardInterrupt went through main")
    assert status == 130
    assert capfd.readouterr() == ("", "")


@pytest.mark.parametrize(("closed", "argv", "status"), [
    (1, ["run", str(WAT_DIR / "exit_code.wat")], 42),
    (1, ["devices"], 0),
    (0, ["run", str(WAT_DIR / "read_stdin.wat")], 0),  # (it read nothing: end of file)
], ids=["stdout-run", "stdout-devices", "stdin-run"])
def test_a_command_started_with_stdin_or_stdout_closed(closed: int, argv: list[str],
                                                       status: int) -> None:
    # `wasinn run guest.wasm >&-` (or `<&-`). Before: with stdout closed, every command
    # ended with an AttributeError traceback and status 1; with stdin closed, the guest's
    # stdin was trio's epoll descriptor, which the guest's read waited on for ever.
    proc = subprocess.run(
        [sys.executable, "-m", "wasinn", *argv],
        stdin=subprocess.DEVNULL if closed != 0 else None, stderr=subprocess.PIPE,
        text=True, check=False, timeout=120,
        preexec_fn=lambda: os.close(closed))
    assert (proc.returncode, proc.stderr) == (status, "")
