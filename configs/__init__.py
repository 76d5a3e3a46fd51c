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


__all__ = ["ConfigError"]
