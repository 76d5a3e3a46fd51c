"""wasinn.configs: the runtime's TOML configuration.

The TOML files in this package are package data: ``default.toml`` is the embedded default
(``wasinn.Runtime()``), the others are examples. :mod:`wasinn.configs.schema` declares
what a config may say (validated with pydantic); :mod:`wasinn.configs.loader` reads a file
and raises :class:`ConfigError` naming the file, the key and what was expected.

Importing this package is cheap: pydantic is imported only when a config is loaded.
"""

import re
from collections.abc import Callable, Iterable

from wasinn.errors import InvalidArgumentError


class ConfigError(InvalidArgumentError):
    """A config file that cannot be used: unreadable TOML, an unknown key, a bad value."""


#: The inference precisions a model may ask for (``precision`` in ``[models.NAME]``, or
#: ``options={"precision": ...}`` in ``Runtime.load``): OpenVINO's inference precision
#: hint; ``"default"`` leaves the backend's own choice (OpenVINO: bf16 on CPUs with AMX).
#: On the CPU, ONNX Runtime and PyTorch compute in the model's own types and ignore it. On
#: NVIDIA GPUs, ``"f32"`` turns TensorFloat-32 off for f32 convolutions and matrix products
#: (ONNX Runtime's CUDA provider and torch use it by default on Ampere and later) and
#: ``"tf32"`` turns it on; OpenVINO, which has no TF32, reads ``"tf32"`` as f32.
PRECISIONS: tuple[str, ...] = ("f32", "f16", "bf16", "default", "tf32")


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


#: The form of a model's or pipeline's name: looked up as a key, never used as a path.
NAME_FORM = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")


def cut_name(name: str) -> str:
    """``name`` as a message shows it: whole up to 60 characters, else its first 57 and
    ``...`` (quote the result, so that a cut name is still quoted whole)."""
    return name if len(name) <= 60 else f"{name[:57]}..."


def shown_name(name: str) -> str:
    """``name`` quoted for a message (``repr``: control characters escaped), cut as
    :func:`cut_name` cuts it."""
    return repr(cut_name(name))


def name_problem(name: str) -> str | None:
    """What is wrong with ``name`` as a model's or pipeline's name, or None."""
    if NAME_FORM.fullmatch(name):
        return None
    return (f"name {shown_name(name)} is not a plain identifier: expected at most 128 letters, "
            "digits, '_', '.' and '-', not starting with '.' or '-' (a name is looked up, "
            "never used as a path)")


def _ort_entry(key: str) -> bool:
    from wasinn.backends._ort_config_keys import is_config_key  # (`import wasinn` stays light)

    return is_config_key(key)


#: What each built-in backend reads from a model's ``options``: a description, and a key
#: test.
BACKEND_OPTIONS: dict[str, tuple[str, Callable[[str], bool]]] = {
    "onnxruntime": ("session config entries (\"session.NAME\", \"optimization.NAME\", "
                    "\"mlas.NAME\", \"ep.NAME\") or provider_options",
                    lambda key: _ort_entry(key) or key == "provider_options"),
    "openvino": ("OpenVINO property names in capitals (PERFORMANCE_HINT, NUM_STREAMS...)",
                 lambda key: re.fullmatch(r"[A-Z][A-Z0-9_]*", key) is not None),
    "pytorch": ("optimize or interruptible = true or false",
                lambda key: key in ("optimize", "interruptible")),
}


def option_problem(backend: str | None, key: str, value: object) -> str | None:
    """What is wrong with the backend option ``key = value`` for a model that names
    ``backend`` (None: names none), or None: the same rules for a config's
    ``[models.NAME] options`` and for ``Runtime.load(options=...)``. A backend that is not
    built in may read any key."""
    if not isinstance(key, str):
        return f"expected an option's name (a str), not {type(key).__name__}"
    if _ort_entry(key):
        from wasinn.backends._ort_config_keys import unknown

        if not isinstance(value, str | int | float):
            return (f"expected a string, number or boolean (an ONNX Runtime session config "
                    f"entry), got {value!r:.40}")
        for _, alike in unknown([key]):
            if alike:  # (a key alike to none may be newer: the backend warns at load)
                return (f"ONNX Runtime reads no session config entry {key!r} (it would "
                        f"ignore it): expected one it reads, such as {alike[0]!r}")
    from wasinn.backends._ov_options import SET_FROM_OPTIONS  # (`import wasinn` stays light)

    own = SET_FROM_OPTIONS.get(key)
    if own is not None:
        return (f"wasinn sets this OpenVINO property from the model's {own!r}: expected "
                f"{own} = ... instead of the option (two settings could contradict)")
    if key in ("optimize", "interruptible") and not isinstance(value, bool):
        return f"expected true or false, got {value!r:.40}"
    if key == "provider_options" and not isinstance(value, dict):
        return "expected a table of CUDA provider options"
    reads = BACKEND_OPTIONS.get(backend or "")
    if reads is not None and not reads[1](key):
        return f"backend {backend!r} does not read this option: expected {reads[0]}"
    return None


def read_by_no_backend(key: str, backends: Iterable[str]) -> str | None:
    """For a model that names no backend: why none of ``backends`` reads ``key``, or
    None (also when one of them is not built in: it may read anything)."""
    backends = list(backends)
    if any(b not in BACKEND_OPTIONS for b in backends):
        return None
    if any(BACKEND_OPTIONS[b][1](key) for b in backends):
        return None
    expected = "; ".join(f"{b}: {BACKEND_OPTIONS[b][0]}" for b in backends)
    return f"no backend here reads this option: expected a key one of them reads ({expected})"


__all__ = ["BACKEND_OPTIONS", "NAME_FORM", "PRECISIONS", "ConfigError", "check_precision",
           "cut_name", "name_problem", "option_problem", "read_by_no_backend",
           "shown_name"]
