"""Reading a config file: TOML -> validated :class:`RuntimeConfig`.

Every problem is a :class:`~wasinn.configs.ConfigError` whose message names the file, the
key path (``models.mobilenet.files``) and what was expected.

Backend names depend on what is installed: :func:`load_config` checks them against the
backends this process knows (wasinn's own and those of the ``wasinn.backends`` entry
points) plus those the caller names; :func:`parse_config` checks them only when told
which extra backends there are (a config built in code is checked by ``Runtime``, which
knows the backends it is given; see :func:`check_backends`). So are the keys of a
model's ``options`` where no third-party backend could read them.
"""

from __future__ import annotations

import difflib
import importlib.resources
import logging
import os
import re
import tomllib
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from wasinn.errors import InvalidArgumentError, NotFoundError, SecurityError

from . import ConfigError, read_by_no_backend, shown_name
from ._values import FAULT, key_name
from .schema import RuntimeConfig, _Startup

DEFAULT_NAME = "default.toml"

log = logging.getLogger("wasinn.configs")


#: The most characters of a bad value an error message repeats.
GOT_LIMIT = 60


#: How pydantic names the member of a union in an error's location (``literal['auto']``,
#: ``list[function-after[_device(), str]]``): not a key the user wrote.
_UNION_MEMBER = re.compile(r"[a-z][a-z-]*\[.*\]")
#: Errors that only say the value is not of one union member's type.
_MISMATCH = re.compile(r".*_type|literal_error")


def _union_tags(loc: tuple[int | str, ...], data: object) -> list[bool]:
    """For each part of an error's ``loc``: whether it is pydantic's name for a union
    member rather than a key or index the user wrote. A key found in the data there is
    the user's, whatever it looks like (an input named ``out[0]``, ``list[x]``)."""
    node: Any = data
    tags = []
    for part in loc:
        if isinstance(node, dict):
            written = part in node
        else:
            written = isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        tag = not written and isinstance(part, str) and bool(_UNION_MEMBER.fullmatch(part))
        if written:
            node = node[part]
        elif not tag:
            node = None  # "[key]", or a key the data lacks: nothing to follow below
        tags.append(tag)
    return tags


def _user_loc(loc: tuple[int | str, ...], data: object) -> tuple[int | str, ...]:
    return tuple(p for p, tag in zip(loc, _union_tags(loc, data), strict=True) if not tag)


def _key_path(loc: tuple[int | str, ...], data: object, key: str = "") -> str:
    out = ""
    for part in _user_loc(loc, data):
        if part == "[key]":  # pydantic's mark for a table's name itself: the path says it
            continue
        name = f"[{part}]" if isinstance(part, int) else key_name(part)
        out += name if isinstance(part, int) or not out else f".{name}"
    if key:
        out += key if key.startswith("[") or not out else f".{key}"
    return out or "(top level)"


def _quoted_in(value: object, msg: str) -> bool:
    # Whether ``msg`` already quotes ``value`` (as _got does, or cut as a name is).
    return _got(value) in msg or (isinstance(value, str) and shown_name(value) in msg)


def _got(value: object) -> str:
    text = repr(value)
    return text if len(text) <= GOT_LIMIT else text[:GOT_LIMIT - 3] + "..."


def _union_members_that_matter(errors: list[Any], data: object) -> list[Any]:
    # A value no member of a union accepts gets one error per member. A member that
    # looked inside the value (an error below it, or one that is not about the value's
    # type) is the one the user meant: drop the other members' "not my type" errors for
    # the same key.
    def split(err: Any) -> tuple[tuple[int | str, ...], tuple[int | str, ...] | None]:
        # (the key, the location below the union member; None: no union member on it)
        loc = tuple(err["loc"])
        tags = _union_tags(loc, data)
        if True in tags:
            i = tags.index(True)
            return loc[:i], loc[i + 1:]
        return loc, None

    meant = set()
    for err in errors:
        key, below = split(err)
        if below is not None and (below or not _MISMATCH.fullmatch(err["type"])):
            meant.add(key)

    def noise(err: Any) -> bool:
        key, below = split(err)
        return below == () and key in meant and bool(_MISMATCH.fullmatch(err["type"]))

    return [err for err in errors if not noise(err)]


def _describe(errors: list[Any], data: object) -> str:
    """``errors`` of validating ``data``, each as ``key.path: what was expected``."""
    lines = []
    for err in _union_members_that_matter(errors, data):
        if err["type"] == FAULT:
            # A validator's own error: its key path is relative to where it ran.
            ctx = err["ctx"]
            lines.append(f"{_key_path(tuple(err['loc']), data, ctx['key'])}: "
                         f"{ctx['message']}")
            continue
        msg = str(err["msg"]).removeprefix("Value error, ")
        where = _key_path(tuple(err["loc"]), data)
        if err["type"] == "extra_forbidden":
            msg = _unknown_key(_user_loc(tuple(err["loc"]), data))
        elif err["type"] in ("model_type", "dict_type"):  # (not the schema's class names)
            msg = "expected a table: a [section], or { key = value, ... }"
        elif err["type"] == "missing":
            msg = _missing_key(_user_loc(tuple(err["loc"]), data))
        # The bad value, if short enough to help: never a whole table.
        if (err["type"] not in ("extra_forbidden", "missing") and "input" in err
                and not isinstance(err["input"], dict) and not _quoted_in(err["input"], msg)):
            msg += f" (got {_got(err['input'])})"
        lines.append(f"{where}: {msg}")
    return "; ".join(lines)


def _missing_key(loc: tuple[int | str, ...]) -> str:
    """The message for a required key left out (``loc``: the user's keys only), with
    the values it takes where they are few."""
    table = _table_at(RuntimeConfig, loc[:-1])
    field = None if table is None else table.model_fields.get(str(loc[-1]))
    if field is not None and typing.get_origin(field.annotation) is typing.Literal:
        choices = ", ".join(repr(c) for c in typing.get_args(field.annotation))
        return f"required, and missing: expected one of {choices}"
    return "required, and missing"


def _unknown_key(loc: tuple[int | str, ...]) -> str:
    """The message for a key its table does not have (``loc``: the user's keys only): the
    closest known key, and all."""
    table = _table_at(RuntimeConfig, loc[:-1])
    if table is None:
        return "unknown key"
    keys = list(table.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), keys, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    return f"unknown key: {hint}expected one of {', '.join(keys)}"


def _table_at(model: type[BaseModel], loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The schema class of the table at ``loc`` below ``model`` (None: not a table)."""
    kinds: list[Any] = [model]
    for part in loc:
        found: list[Any] = []
        for kind in kinds:
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                field = kind.model_fields.get(str(part))
                if field is not None:
                    found.append(field.annotation)
            elif typing.get_origin(kind) in (dict, list):
                found.append(typing.get_args(kind)[-1])  # a key or an index: the values
        kinds = [member for kind in found for member in _members(kind)]
    tables = [k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)]
    return tables[0] if len(tables) == 1 else None


def _members(kind: Any) -> tuple[Any, ...]:
    """The types a field's annotation admits: a union's members, Annotated unwrapped."""
    while typing.get_origin(kind) is typing.Annotated:
        kind = typing.get_args(kind)[0]
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        return tuple(m for member in typing.get_args(kind) for m in _members(member))
    return (kind,)


def known_backends(extra: Iterable[str] = ()) -> list[str]:
    """Every backend name this process knows (wasinn's, the entry points') and ``extra``,
    sorted; nothing is imported."""
    from wasinn.backends.registry import BackendRegistry

    return sorted({*BackendRegistry(()).names(), *extra})


def check_backends(config: RuntimeConfig, label: str, extra: Iterable[str] = ()) -> None:
    """Raise ConfigError (``label``: the file) for a backend name in ``config``'s
    ``runtime.backends``, ``pools.*.backends`` or ``models.*.backend`` that is neither
    known here (see :func:`known_backends`) nor in ``extra``, and for a model ``options``
    key that no backend reads when every backend here is one of wasinn's own (a
    third-party backend may read any key)."""
    named = [(f"runtime.backends[{i}]", b) for i, b in enumerate(config.runtime.backends)]
    for name, pool in config.pools.items():
        named += [(f"pools.{key_name(name)}.backends[{i}]", b)
                  for i, b in enumerate(pool.backends)]
    named += [(f"models.{key_name(name)}.backend", model.backend)
              for name, model in config.models.items() if model.backend is not None]
    open_options = [(name, model.options) for name, model in config.models.items()
                    if model.backend is None and model.options]
    encoded = [(name, model) for name, model in config.models.items()
               if model.encoding != "autodetect"]
    if not named and not open_options and not encoded:
        return
    known = known_backends(extra)
    for key, backend in named:
        if backend not in known:
            raise ConfigError(f"{label}: {key}: unknown backend {_got(backend)}: expected one "
                              f"of {', '.join(known)}")
    for name, options in open_options:
        for option in options:
            problem = read_by_no_backend(option, known)
            if problem is not None:
                raise ConfigError(
                    f"{label}: models.{key_name(name)}.options.{key_name(option)}: {problem}")
    for name, model in encoded:
        problem = _encoding_problem(model.encoding, model.backend, known)
        if problem is not None:
            raise ConfigError(f"{label}: models.{key_name(name)}.encoding: {problem}")


def _encoding_problem(encoding: str, backend: str | None, known: list[str]) -> str | None:
    """Why no backend could read a model of ``encoding`` (``backend``: the one the model
    names, else any of ``known``); None where one may (a backend of another package may
    read anything)."""
    from wasinn.backends.registry import BUILTIN

    reads = {spec.name: {e.value for e in spec.encodings or ()} for spec in BUILTIN}
    if backend is not None:
        if backend not in reads or encoding in reads[backend]:
            return None
        return (f"backend {backend!r} does not read {encoding!r} models: expected "
                f"{' or '.join(sorted(reads[backend]))}")
    if any(name not in reads or encoding in reads[name] for name in known):
        return None
    every = sorted(set().union(*reads.values()))
    return (f"no backend here reads {encoding!r} models: expected one of "
            f"{', '.join(every)} (or autodetect)")


def parse_config(data: dict[str, Any], source: Path | None, *, label: str | None = None,
                 backends: Iterable[str] | None = None, warn: bool = True) -> RuntimeConfig:
    """Validate already-parsed TOML; ConfigError names ``label`` (the file) and the keys.

    ``backends``: the names of backends the runtime will be given besides those known
    here (``Runtime(..., backends=...)``); backend names are then checked. None leaves
    that check to ``Runtime``. ``warn``: log the settings that do nothing as the config
    stands (False where they were logged already, when ``data`` was first read).

    A model file that leads out of the config directory (a ``..`` or a symlink), names
    the directory itself or holds a NUL byte is a ConfigError here. One that cannot be
    resolved (missing, a symlink loop) fails only its model, when it is loaded
    (NotFoundError naming the model and the file): the other models and the pools stay
    usable.
    """
    label = label or (str(source) if source else "<config>")
    try:
        config = RuntimeConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{label}: {_describe(exc.errors(), data)}") from None
    if source is not None:
        config.with_source(source)
    for name, model in config.models.items():
        for i, file in enumerate(model.files):
            try:
                model_file(config, file)
            except NotFoundError:
                continue  # as a missing file is: the load says so, naming the model
            except (SecurityError, InvalidArgumentError) as exc:
                raise ConfigError(
                    f"{label}: models.{key_name(name)}.files[{i}]: {exc.message}") from None
    if backends is not None:
        check_backends(config, label, backends)
    if warn:
        _warn_unused(config, label)
    return config


def _warn_unused(config: RuntimeConfig, label: str) -> None:
    # Settings that do nothing as the config stands, but that a config may well keep
    # (warm-up shapes while warm-up is off): not errors, but never silent either.
    entries: list[tuple[str, str, _Startup]] = [
        *(("models", name, model) for name, model in config.models.items()),
        *(("pipelines", name, pipeline) for name, pipeline in config.pipelines.items())]
    for table, name, entry in entries:
        if entry.warmup_inputs and not entry.warmup:
            log.warning("%s: %s.%s.warmup_inputs: given, but warmup = 0, so no warm-up run "
                        "uses them (warmup >= 1 warms up on these shapes)",
                        label, table, key_name(name))
    if config.tenants and all(pool.policy != "fair" for pool in config.pools.values()):
        # (a config shared by hosts may give weights for the pools some of them make fair)
        names = [key_name(name) for name in config.tenants]
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if names[5:] else "")
        pools = ", ".join(f"{key_name(name)} ({pool.policy})"
                          for name, pool in config.pools.items())
        log.warning('%s: tenants: weights given (%s), but no pool has policy = "fair" '
                    "(pools: %s), so none is used (weights share a fair pool's device time)",
                    label, shown, pools)


def load_config(path: str | os.PathLike[str], *, backends: Iterable[str] = ()
                ) -> RuntimeConfig:
    """Read and validate the TOML config at ``path``.

    ``backends`` names the backends the runtime will be given in code
    (``Runtime(..., backends=...)``), which a config may name besides the installed ones.
    The file is UTF-8, with or without a byte-order mark. Raises NotFoundError when the
    file does not exist (saying where the example of that file name lies, for the names of
    those wasinn ships: ``pools.toml``, ``pipeline.toml``), ConfigError when it is not
    TOML or does not validate (an unknown backend name included).
    """
    given = os.fspath(path) if isinstance(path, str | os.PathLike) else None
    if not isinstance(given, str):  # (an os.PathLike of bytes too)
        raise InvalidArgumentError(
            f"config path {path!r:.60} ({type(path).__name__}): expected a str or an "
            "os.PathLike of str (a Path)")
    if "\0" in given:  # else the file system's ValueError, naming no config
        raise InvalidArgumentError(
            f"config path {given!r:.60} contains a NUL byte: expected a file path")
    source = Path(given).absolute()
    try:
        # utf-8-sig: a byte-order mark at the start (what Windows editors save as "UTF-8
        # with BOM") is dropped, not taken for an invisible character the TOML parser
        # refuses at line 1, column 1 with no word of why.
        text = source.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise NotFoundError(
            f"config file {source} does not exist{_shipped_hint(source.name)}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{source}: cannot read the config: {exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    except RecursionError:  # tomllib recurses once per level of arrays and inline tables
        raise ConfigError(f"{source}: not valid TOML here: arrays or inline tables nested "
                          "too deeply for the parser: expected a config's few levels") from None
    return parse_config(data, source, backends=backends)


def _shipped_hint(name: str) -> str:
    """Where the example config ``name`` that wasinn ships lies, to add to a missing
    path's error (``configs/pools.toml`` of the README names a source tree's file, which
    an installed wasinn keeps in its package); "" for any other name. Only a hint: the
    path given is not resolved against the package."""
    if name not in packaged_configs():
        return ""
    shipped = importlib.resources.files("wasinn.configs") / name
    return f": wasinn ships an example {name} at {shipped}: copy it, or pass that path"


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
    return parse_config(data, source, label=f"wasinn.configs/{name}", backends=())


def model_file(config: RuntimeConfig, file: str) -> Path:
    """Where a model file named in ``config`` lies.

    A relative path is taken from the config's directory and must stay inside it (no
    ``..`` or symlink escapes): SecurityError otherwise; naming the directory itself
    (``"."``) is InvalidArgumentError. An absolute path is the config author's explicit
    choice and is used as given (guests never name files, only registered models). A
    name with a NUL byte is InvalidArgumentError; a path that cannot be resolved (a
    symlink loop) is NotFoundError.
    """
    if "\0" in file:
        raise InvalidArgumentError(
            f"model file {file!r} contains a NUL byte: expected a file path")
    path = Path(file)
    if path.is_absolute():
        return path
    base = config.base_dir.resolve()
    try:
        resolved = (base / path).resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop (RuntimeError before 3.13)
        raise NotFoundError(
            f"model file {file!r} cannot be resolved in the config directory {base}: "
            f"{exc}: expected a path to a model file") from None
    if not resolved.is_relative_to(base):
        raise SecurityError(
            f"model file {file!r} resolves to {resolved}, outside the config directory "
            f"{base}: expected a path inside it (or an absolute path)"
        )
    if resolved == base:
        raise InvalidArgumentError(
            f"model file {file!r} names the config directory {base} itself: expected the "
            "path of a model file in it"
        )
    return resolved
