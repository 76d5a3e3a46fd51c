"""wasinn.configs: the runtime's TOML configuration.

The TOML files in this package are package data: ``default.toml`` is the embedded default
(``wasinn.Runtime()``), the others are examples. :mod:`wasinn.configs.schema` declares
what a config may say (validated with pydantic); :mod:`wasinn.configs.loader` reads a file
and raises :class:`ConfigError` naming the file, the key and what was expected.

Importing this package is cheap: pydantic is imported only when a config is loaded.
"""

from wasinn.errors import InvalidArgumentError


class ConfigError(InvalidArgumentError):
    """A config file that cannot be used: unreadable TOML, an unknown key, a bad value."""


#: The inference precisions a model may ask for (``precision`` in ``[models.NAME]``, or
#: ``options={"precision": ...}`` in ``Runtime.load``): OpenVINO's inference precision
#: hint; ``"default"`` leaves the backend's own choice (OpenVINO: bf16 on CPUs with AMX).
#: ONNX Runtime and PyTorch compute in the model's own types and ignore it.
PRECISIONS: tuple[str, ...] = ("f32", "f16", "bf16", "default")


def check_precision(value: object) -> str:
    """``value`` as a precision name (case and surrounding blanks ignored); raises
    InvalidArgumentError naming the values expected."""
    name = value.strip().lower() if isinstance(value, str) else None
    if name is None or name not in PRECISIONS:
        raise InvalidArgumentError(
            f"precision {value!r} is not one wasinn knows: expected one of "
            f"{', '.join(PRECISIONS)}"
        )
    return name


__all__ = ["PRECISIONS", "ConfigError", "check_precision"]
