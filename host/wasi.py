"""WASI settings of a guest: arguments, environment, preopened directories, stdio.

Shared by the core-module runner and the component runner so both see the same
``argv`` / ``dirs`` / ``env`` conventions:

- ``argv`` holds the guest's arguments; ``argv[0]`` (the program name) is the wasm
  file's name, as Wasmtime and WasmEdge set it.
- ``dirs`` maps a *guest* path to the *host* directory it opens
  (``{"/models": "/srv/models"}``); a host directory that does not exist is an
  InvalidArgumentError before the guest starts.
- ``env`` is the guest's whole environment: nothing of the host's is inherited.
- stdout and stderr are the host process's own; stdin is empty unless the caller gives
  one (:mod:`wasinn.host.guest_stdin`, which sets it).

Descriptors are not bounded in ``dirs``: each file or directory a guest opens there is a
file descriptor of the host process, and Wasmtime's WASI limits neither how many a guest
holds nor for how long (until it closes them or ends). A guest given ``dirs`` can
therefore take every descriptor the process may have (``RLIMIT_NOFILE``), after which
the host cannot open a model or a temporary file until that guest ends. The host cannot
count them per guest either: several guests may be given one directory, and a
descriptor does not say which guest opened it. So give ``dirs`` only to guests trusted
that far, or raise the process's ``RLIMIT_NOFILE``. (A component's private scratch
directory is the exception: it is one guest's alone, so its descriptors are counted and
bounded by ``[guests] max_scratch_open_files``, see :mod:`wasinn.host.component.scratch`.)
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import wasmtime

from wasinn._utf8 import utf8_text
from wasinn.errors import InvalidArgumentError

Dirs = Mapping[str, "str | os.PathLike[str]"]


def wasi_config(program: str, argv: Sequence[str] = (), dirs: Dirs | None = None,
                env: Mapping[str, str] | None = None) -> wasmtime.WasiConfig:
    """A WasiConfig for one guest instance (see the module docstring)."""
    config = wasmtime.WasiConfig()
    config.argv = [_utf8("the program name", program),
                   *(_utf8(f"argument {i}", str(a)) for i, a in enumerate(argv, 1))]
    config.env = [(_utf8("an environment variable's name", str(k)),
                   _utf8(f"the value of environment variable {str(k)!r}", str(v)))
                  for k, v in (env or {}).items()]
    for guest, host in (dirs or {}).items():
        path = Path(host)
        if not path.is_dir():
            raise InvalidArgumentError(
                f"cannot preopen {str(path)!r} as {guest!r}: expected an existing host directory"
            )
        config.preopen_dir(_utf8("a preopened host directory", str(path)),
                           _utf8("a preopened directory's guest path", str(guest)))
    config.inherit_stdout()
    config.inherit_stderr()
    return config


def _utf8(what: str, text: str) -> str:
    """``text``, which WASI hands the guest as UTF-8; InvalidArgumentError if it has no
    UTF-8 form (see :func:`wasinn._utf8.utf8_text`)."""
    return utf8_text(what, text, "UTF-8 text (WASI passes arguments, environment and "
                                 "paths to the guest as UTF-8)")
