"""The README's examples stay true: its config example is a valid config."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from wasinn.configs.loader import load_config

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
    over clang-19, and a ``CC`` given on the command line must."""
    examples = README.parent / "examples"
    assert "make -C examples" in README.read_text()

    def planned(*args: str) -> str:
        return subprocess.run(["make", "-n", "-B", "-C", str(examples), *args], check=True,
                              capture_output=True, text=True).stdout

    assert planned().count("clang-19 --target=wasm32-wasi") == 4
    assert "mycc --target=wasm32-wasi" in planned("CC=mycc")
