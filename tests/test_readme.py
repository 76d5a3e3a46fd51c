"""The README's examples stay true: its config example is a valid config, its Python
example runs, its tables, numbers and commands are the code's."""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

from tests.support import has_module, require_backend, skip_unless
from wasinn.backends.base import TensorSpec
from wasinn.configs.loader import load_config
from wasinn.enums import TensorType

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_config_example_validates(tmp_path: Path) -> None:
    blocks = re.findall(r"```toml\n(.*?)```", README.read_text(), re.S)
    assert blocks, "the README has no TOML example"
    for i, block in enumerate(blocks):
        path = tmp_path / f"example{i}.toml"
        path.write_text(block)
        config = load_config(path)
        assert config.pools, f"README TOML block {i} defines no pool"


def test_readme_opens_with_the_two_commands() -> None:
    first_block = README.read_text().split("```")[1]
    commands = [line.split("#")[0].strip() for line in first_block.splitlines()[1:] if line]
    assert commands == ["make demo", "make test"]
    ci = (README.parent / ".ci" / "run").read_text()
    assert "make test" in ci.splitlines()[-1]


def test_the_examples_makefile_builds_with_clang_unless_told_otherwise() -> None:
    """``make -C examples``, as the README says: make's built-in ``CC`` (cc) must not win
    over clang-19, nor a ``CC`` in the environment (the host's compiler: the GPU machine's
    image exports CC=/opt/gcc/bin/gcc, which planned gcc --target=wasm32-wasi), and a
    ``CC`` given on the command line must."""
    import os

    examples = README.parent / "examples"
    assert "make -C examples" in README.read_text()

    def planned(*args: str, cc: str | None = None, cflags: str | None = None) -> str:
        env = {k: v for k, v in os.environ.items() if k not in ("CC", "CFLAGS")}
        if cc is not None:
            env["CC"] = cc
        if cflags is not None:  # (the host's, which once replaced the wasm target)
            env["CFLAGS"] = cflags
        return subprocess.run(["make", "-n", "-B", "-C", str(examples), *args], check=True,
                              capture_output=True, text=True, env=env).stdout

    assert planned().count("clang-19 --target=wasm32-wasi") == 4
    assert planned(cc="/opt/gcc/bin/gcc").count("clang-19 --target=wasm32-wasi") == 4
    assert planned(cflags="-O3 -march=native").count(
        "clang-19 --target=wasm32-wasi -O3 -march=native") == 4
    assert "mycc --target=wasm32-wasi" in planned("CC=mycc")


def test_make_reinstalls_when_a_module_is_added_or_removed(tmp_path: Path) -> None:
    """``make demo`` / ``make test`` redo the strict editable install, which links each
    file of the package folders once, when a folder gains or loses a module (a git pull
    of a split module), and only then: neither an edit nor a ``__pycache__`` plans one."""
    import os
    import shutil
    import time
    import tomllib

    root = README.parent
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    folders = sorted(set(pyproject["tool"]["setuptools"]["package-dir"].values()))
    [listed] = re.findall(r"^PACKAGE_DIRS := (.*)$", (root / "Makefile").read_text(), re.M)
    assert sorted(listed.split()) == folders  # every folder the install links
    copy = tmp_path / "checkout"
    shutil.copytree(root / ".ci", copy / ".ci")
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(root / name, copy / name)
    for folder in folders:
        shutil.copytree(root / folder, copy / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.wasm"))

    def plans_install() -> bool:
        planned = subprocess.run(["make", "-n", "-C", str(copy), "demo", "VENV=v"],
                                 check=True, capture_output=True, text=True).stdout
        assert "v/bin/wasinn demo" in planned
        return "VENV=v bash .ci/bootstrap" in planned

    def installed() -> None:
        # As .ci/bootstrap leaves it: the stamp newer than all it depends on.
        then = time.time() - 100
        for path in (copy / "pyproject.toml", copy / ".ci" / "bootstrap",
                     copy / "v" / ".package-files"):
            os.utime(path, (then, then))
        (copy / "v" / ".installed").touch()
        os.utime(copy / "v" / ".installed", (then + 50, then + 50))

    assert plans_install()  # a fresh checkout
    installed()
    assert not plans_install()
    (copy / "core" / "cli.py").write_text((copy / "core" / "cli.py").read_text() + "\n")
    (copy / "backends" / "__pycache__").mkdir()
    (copy / "backends" / "__pycache__" / "base.cpython-311.pyc").write_bytes(b"")
    assert not plans_install()
    (copy / "backends" / "_added_by_a_pull.py").write_text("")
    assert plans_install()
    installed()
    assert not plans_install()
    (copy / "backends" / "_added_by_a_pull.py").unlink()
    assert plans_install()


def _section(title: str) -> str:
    """The README's text from the heading ``title`` to the next heading of any level (a
    ``#`` line outside code blocks)."""
    lines = README.read_text().splitlines()
    start = lines.index(title)
    fenced = False
    for end in range(start + 1, len(lines)):
        fenced ^= lines[end].startswith("```")
        if not fenced and lines[end].startswith("#"):
            break
    else:
        end = len(lines)
    return "\n".join(lines[start:end])


def test_readme_python_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The library's example, as written, against a tiny ONNX model with its input and
    output names (``input: f32[?, 3, 224, 224]`` -> ``output``), a guest that exits at
    once and the ``data`` folder it preopens; the example leaves ``image`` and ``buf``
    to the reader, so they are given here."""
    require_backend("onnxruntime")
    skip_unless("onnx", has_module("onnx"), "onnx is not installed")
    from onnx import TensorProto, helper

    from wasinn.modelgen import onnx_model_bytes

    x = helper.make_tensor_value_info("input", TensorProto.FLOAT, ["n", 3, 224, 224])
    y = helper.make_tensor_value_info("output", TensorProto.FLOAT, ["n", 3])
    mean = helper.make_node("ReduceMean", ["input"], ["output"], axes=[2, 3], keepdims=0)
    (tmp_path / "mobilenet.onnx").write_bytes(
        onnx_model_bytes(helper.make_graph([mean], "tiny", [x], [y]), opset=17))
    (tmp_path / "guest.wasm").write_text(
        '(module (memory (export "memory") 1) (func (export "_start")))')
    (tmp_path / "data").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WASINN_CACHE_DIR", str(tmp_path / "cache"))

    [example] = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    buf = bytearray(3 * 4)
    exec(compile(example, "README.md", "exec"),
         {"image": np.full((1, 3, 224, 224), 2.0, np.float32), "buf": buf})

    assert capsys.readouterr().out.split() == ["onnxruntime", "0"]  # print(g.backend, ...)
    assert np.frombuffer(buf, np.float32).tolist() == [2.0, 2.0, 2.0]  # filled in place


def test_readme_describes_an_input_as_describe_does() -> None:
    quoted = re.search(r"`g\.inputs\[0\]\.describe\(\)` gives\s+`([^`]+)`", README.read_text())
    assert quoted is not None
    spec = TensorSpec("input", TensorType.F32, (None, 3, 224, 224))
    assert spec.describe() == quoted.group(1)


def _abi_rows() -> dict[str, int]:
    """The README's ABI table: each function with its number of core parameters."""
    rows: dict[str, int] = {}
    for names, signature in re.findall(r"^\| (`[^|]+) \| (`[^|]+|as [^|]+) \|",
                                       _section("### The ABI"), re.M):
        if names == "`function`":
            continue
        functions = re.findall(r"`(\w+)`", names)
        if signature.startswith("as "):  # as compute / get_output / `(ctx)`
            counts = {"compute": 1, "get_output": 5}
            parts = [p.strip(" `") for p in signature.removeprefix("as ").split("/")]
            arities = [counts[p] if p in counts else len(p.strip("()").split(","))
                       for p in parts]
        else:
            params = re.match(r"`\(([^)]*)\)`", signature)
            assert params is not None, signature
            arities = [len(params.group(1).split(","))] * len(functions)
        rows.update(zip(functions, arities, strict=True))
    return rows


def test_readme_abi_table_matches_the_host_functions() -> None:
    """Every ``wasi_ephemeral_nn`` function the host defines is in the table, with as many
    parameters as the host takes, and nothing else is."""
    from wasinn.host.core_bindings import _table

    defined = {name: count for name, (count, _, _) in _table(mock.Mock()).items()}
    assert _abi_rows() == defined


def test_readme_abi_numbering_matches_the_host() -> None:
    from wasinn.host.abi import ENCODINGS, TARGETS, TENSOR_TYPES, Errno

    section = _section("### The ABI")
    numbering = re.search(r"Numbering is WITX's.*?\n(?=- )", section, re.S)
    assert numbering is not None
    text = numbering.group(0).replace("**", "")
    pairs = {(name, int(n)) for name, n in re.findall(r"(\w+)=(\d+)", text)}
    expected = {(m.value, n) for table in (ENCODINGS, TARGETS, TENSOR_TYPES)
                for n, m in table.items()}
    assert pairs == expected
    errnos = re.search(r"errno: (success 0,.*?model_not_found \d+)", section, re.S)
    assert errnos is not None
    listed = {name: int(n) for name, n in re.findall(r"(\w+) (\d+)", errnos.group(1))}
    assert listed == {e.name.lower(): e.value for e in Errno if e.name.lower() in listed}
    assert set(listed) >= {e.name.lower() for e in Errno if e.value < 100}


def test_readme_guest_limit_defaults_match_the_schema() -> None:
    """``max_graphs`` graphs (64) ... in the Limits section are the config's defaults."""
    from wasinn.configs.schema import GuestsConfig

    units = {"": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}
    stated = {key: int(n) * units[unit] for key, n, unit in re.findall(
        r"`(max_\w+)`[^(`]*\((\d+)\s*(\w*)\)", _section("### Limits"))}
    assert set(stated) >= {"max_graphs", "max_contexts", "max_model_bytes", "max_tensor_bytes"}
    defaults = GuestsConfig()
    assert stated == {key: getattr(defaults, key) for key in stated}


def _command_lines() -> list[str]:
    """Every ``wasinn ...`` command of the README's shell blocks, continuation lines
    joined and comments dropped."""
    commands = []
    for block in re.findall(r"```(?:sh|console)\n(.*?)```", README.read_text(), re.S):
        for text in block.replace("\\\n", " ").splitlines():
            line = text.removeprefix("$ ").split("#")[0].strip()
            if line.startswith("wasinn "):
                commands.append(line)
    return commands


def test_readme_commands_use_the_parsers_commands_and_options() -> None:
    from wasinn._cli_parser import build_parser

    parser = build_parser()
    [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    top = {s for a in parser._actions for s in a.option_strings}
    lines = _command_lines()
    assert {line.split()[1] for line in lines} - top >= {"run", "infer", "devices", "models",
                                                         "demo"}
    for line in lines:
        words = line.split()[1:]
        while words and words[0] in top:  # -v before the command
            words.pop(0)
        if not words:  # (wasinn --version: no command)
            continue
        sub = commands.choices.get(words[0])
        assert sub is not None, f"README: {line}: no command {words[0]!r}"
        options = {s for a in sub._actions for s in a.option_strings}
        for option in re.findall(r"(?<![\w.-])(--?[a-zA-Z][\w-]*)", " ".join(words[1:])):
            if option in options:
                continue
            assert words[0] == "run" and option in _guest_options(words), \
                f"README: {line}: `wasinn {words[0]}` has no option {option}"


def _guest_options(words: list[str]) -> list[str]:
    # `wasinn run ... GUEST.wasm --legacy`: what follows the guest is the guest's.
    guest = next((i for i, w in enumerate(words) if w.endswith((".wasm", ".wat"))), len(words))
    return words[guest + 1:]


def test_readme_exit_statuses_are_the_commands() -> None:
    from wasinn.cli import EXIT_ERROR
    from wasinn.host.runner import TRAP_EXIT_STATUS

    text = " ".join(_section("## Core-module guests (`wasi_ephemeral_nn`)").split())
    assert f"a trap prints its message and exits with {TRAP_EXIT_STATUS}" in text
    assert f"`wasinn` exits with {EXIT_ERROR} for an error of its own" in text
