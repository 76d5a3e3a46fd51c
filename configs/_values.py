"""The value types of config keys: each a pydantic annotation that checks one kind of
value (a target, an encoding, a device, a precision, a tensor element type, a model file,
a name, a sandbox setting, a backend preference order, the environment variables given
to confined sandbox processes and the paths they may read), and :func:`fault`, the error that
names the key. The tables that use them are :mod:`wasinn.configs.schema`'s."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Annotated, Literal

from pydantic import AfterValidator, PlainValidator
from pydantic_core import PydanticCustomError

from wasinn.backends.base import Device, sandbox_setting
from wasinn.backends.sandbox import env_pattern_problem, read_path_problem
from wasinn.enums import ExecutionTarget, GraphEncoding, TensorType
from wasinn.errors import InvalidArgumentError

from . import check_precision, cut_name, name_problem

#: The error type of :func:`fault`: the loader joins its ``key`` to the error's location.
FAULT = "wasinn_config"


def fault(key: str, message: str) -> PydanticCustomError:
    """An error about ``key``, a path relative to where the validator runs (``""``: the
    field itself, ``"[0]"``, ``"steps[0].wire"``; from the top-level validator, the whole
    path), so that the message names the key the user wrote."""
    return PydanticCustomError(FAULT, "{key}: {message}", {"key": key, "message": message})


def key_name(name: str) -> str:
    """``name`` as one part of a key path: as it is where it is a plain identifier of at
    most 60 characters, else quoted as TOML writes it (control characters escaped), its
    first 57 characters and ``...`` where it is longer."""
    shown = cut_name(name)
    if shown == name and re.fullmatch(r"[A-Za-z0-9_\-]+", name):
        return name
    return json.dumps(shown, ensure_ascii=False)


def _target(value: str) -> str:
    try:
        return ExecutionTarget.coerce(value).value
    except InvalidArgumentError as exc:
        raise ValueError(exc.message) from None


def _encoding(value: str) -> str:
    try:
        return GraphEncoding.coerce(value).value
    except InvalidArgumentError as exc:
        raise ValueError(exc.message) from None


def _tensor_type(value: str) -> str:
    try:
        return TensorType.coerce(value).value
    except InvalidArgumentError as exc:
        raise ValueError(exc.message) from None


def _device(value: str) -> str:
    try:
        device = Device.parse(value)
    except (InvalidArgumentError, ValueError) as exc:
        raise ValueError(
            f"not a device: expected cpu, gpu, gpu:N, tpu:N or npu:N ({exc})"
        ) from None
    if device.kind is ExecutionTarget.CPU and device.index != 0:
        raise ValueError(f"{value!r}: there is one CPU device, expected 'cpu'")
    return device.name


def _precision(value: str) -> str:
    try:
        return check_precision(value)
    except InvalidArgumentError as exc:
        raise ValueError(exc.message) from None


def _sandbox(value: object) -> bool | Literal["cpu"]:
    setting = sandbox_setting(value)
    if setting is not None:
        return setting
    raise fault("", f"{value!r:.60}: expected true (a process of its own on every device), "
                "\"cpu\" (on the CPU only) or false")


def _file(value: str) -> str:
    if not value.strip():
        raise ValueError("an empty file name: expected the path of a model file, relative "
                         "to the config file's directory")
    return value


def _name(value: str) -> str:
    problem = name_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


def _once_each(backends: list[str]) -> list[str]:
    # A preference order names each backend once: a second mention would mean nothing.
    for i, name in enumerate(backends):
        if name in backends[:i]:
            raise fault(f"[{i}]", f"backend {name!r} is listed twice: expected each once "
                                  "(the list is a preference order)")
    return backends


def _entries(expected: str, problem_of: Callable[[object], str | None]
             ) -> Callable[[object], list[str]]:
    """A validator of a list whose entries ``problem_of`` checks, each here (not by a
    list[str] annotation): one message that says what an entry may be, whatever is wrong
    with it; ``expected`` says what the list is, for a value that is none."""
    def check(entries: object) -> list[str]:
        if not isinstance(entries, list):
            raise fault("", f"{entries!r:.60}: expected {expected}")
        for i, entry in enumerate(entries):
            problem = problem_of(entry)
            if problem is not None:
                raise fault(f"[{i}]", problem)
        return entries

    return check


_env_list = _entries(
    "a list of the host's environment variables to give confined sandbox processes, such "
    'as ["HF_HOME", "MY_LICENSE_*"] (a name, or a prefix ending in *)', env_pattern_problem)
# (a path must be there as the config is read: a typo is found then, not as each sandbox
# process starts without it)
_read_list = _entries(
    "a list of the absolute paths of folders and files confined sandbox processes may "
    'read, such as ["/srv/hf-cache", "/opt/licenses/site.lic"]', read_path_problem)


TargetName = Annotated[str, AfterValidator(_target)]
EncodingName = Annotated[str, AfterValidator(_encoding)]
#: A tensor element type as wasinn names them (f32, i64, ...), any case.
TensorTypeName = Annotated[str, AfterValidator(_tensor_type)]
DeviceName = Annotated[str, AfterValidator(_device)]
PrecisionName = Annotated[str, AfterValidator(_precision)]
FileName = Annotated[str, AfterValidator(_file)]
Sandbox = Annotated[bool | Literal["cpu"], PlainValidator(_sandbox)]
#: Model and pipeline names: looked up as keys, so plain identifiers only.
Name = Annotated[str, AfterValidator(_name)]
#: A backend preference order.
Backends = Annotated[list[str], AfterValidator(_once_each)]
#: The host's environment variables given to confined sandbox processes besides the
#: default ones: names, and prefixes ending in ``*`` (see wasinn.backends._sandbox_env).
SandboxEnv = Annotated[list[str], PlainValidator(_env_list)]
#: The folders and files confined sandbox processes may read besides the default ones:
#: absolute paths, there as the config is read (see wasinn.backends._sandbox_read).
SandboxRead = Annotated[list[str], PlainValidator(_read_list)]
