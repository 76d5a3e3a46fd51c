"""The README's examples stay true: its config example is a valid config."""

from __future__ import annotations

import re
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
