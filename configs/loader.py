"""Reading a config file: TOML -> validated :class:`RuntimeConfig`.

Every problem is a :class:`~wasinn.configs.ConfigError` whose message names the file, the
key path (``models.mobilenet.files``) and what was expected.
"""

from __future__ import annotations

import importlib.resources
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from wasinn.errors import NotFoundError, SecurityError

from . import ConfigError
from .schema import RuntimeConfig

DEFAULT_NAME = "default.toml"


def _key_path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _describe(errors: list[Any]) -> str:
    lines = []
    for err in errors:
        msg = str(err["msg"]).removeprefix("Value error, ")
        where = _key_path(tuple(err["loc"]))
        if err["type"] not in ("extra_forbidden", "missing") and "input" in err:
            msg += f" (got {err['input']!r})"
        lines.append(f"{where}: {msg}")
    return "; ".join(lines)


def parse_config(data: dict[str, Any], source: Path | None, *, label: str | None = None
                 ) -> RuntimeConfig:
    """Validate already-parsed TOML; ConfigError names ``label`` (the file) and the keys."""
    label = label or (str(source) if source else "<config>")
    try:
        config = RuntimeConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{label}: {_describe(exc.errors())}") from None
    if source is not None:
        config.with_source(source)
    for name, model in config.models.items():
        for i, file in enumerate(model.files):
            try:
                model_file(config, file)
            except SecurityError as exc:
                raise ConfigError(f"{label}: models.{name}.files[{i}]: {exc.message}") from None
    return config


def load_config(path: str | Path) -> RuntimeConfig:
    """Read and validate the TOML config at ``path``.

    Raises NotFoundError when the file does not exist, ConfigError when it is not TOML
    or does not validate.
    """
    source = Path(path).absolute()
    try:
        text = source.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise NotFoundError(f"config file {source} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{source}: cannot read the config: {exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    return parse_config(data, source)


def packaged_configs() -> list[str]:
    """The names of the TOML files shipped in this package (default and examples)."""
    root = importlib.resources.files("wasinn.configs")
    return sorted(p.name for p in root.iterdir() if p.name.endswith(".toml"))


def packaged_config(name: str = DEFAULT_NAME) -> RuntimeConfig:
    """A config shipped in this package, ``default.toml`` (the embedded default) if unnamed."""
    if name not in packaged_configs():
        raise NotFoundError(
            f"no packaged config {name!r}: expected one of {', '.join(packaged_configs())}"
        )
    resource = importlib.resources.files("wasinn.configs") / name
    data = tomllib.loads(resource.read_text(encoding="utf-8"))
    source = Path(str(resource)) if isinstance(resource, Path) else None
    return parse_config(data, source, label=f"wasinn.configs/{name}")


def model_file(config: RuntimeConfig, file: str) -> Path:
    """Where a model file named in ``config`` lies.

    A relative path is taken from the config's directory and must stay inside it (no
    ``..`` or symlink escapes): SecurityError otherwise. An absolute path is the config
    author's explicit choice and is used as given.
    """
    path = Path(file)
    if path.is_absolute():
        return path
    base = config.base_dir.resolve()
    resolved = (base / path).resolve()
    if not resolved.is_relative_to(base):
        raise SecurityError(
            f"model file {file!r} resolves to {resolved}, outside the config directory "
            f"{base}: expected a path inside it (or an absolute path)"
        )
    return resolved
