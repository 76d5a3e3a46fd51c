"""The host's folders and files an operator lets confined sandbox processes read besides
those every one may read (``[runtime] sandbox_read``; the defaults are
:func:`._confine.lock_down`'s: the Python installation, the system's libraries, wasinn's
and its backend's folders).

A library may read a file no default foresees (a model hub's cache, ``HF_HOME``; an
OpenVINO plug-in's configuration; a site's licence file): naming its variable in
``sandbox_env`` gives the process the path, and Landlock still keeps the file out of its
reach. The operator names such paths, each absolute: a folder (everything below it) or a
file (that file alone). The process may read them and no more: Landlock's read rights
(reading files, listing folders), not writing, making, renaming or removing anything
there, nor executing a program from there (which seccomp refuses anywhere). A shared
library there can still be loaded (``dlopen`` maps what may be read), as one in the
Python installation can.

Refused: a relative path (it would mean another file in each working directory), the
root ``/`` (every file of the host, its keys included: that undoes the confinement),
anything in ``/proc``, ``/sys`` or ``/dev`` (the host's processes and devices), a
folder that holds the system temporary folder, where every confined process's private
folder is (one process could read another's, a guest's model with it), and a path with
``os.pathsep`` (the list reaches the process as one variable, so separated) or a NUL
byte. The config also refuses a path that does not exist (a typo). Each is resolved
(its symlinks followed: Landlock binds a rule to the file it opens) when a process is
started (:func:`readable_now`): one not there then is left out, the process starting
without it, and one that resolves to what is refused here is left out with a warning.
The process adds each path's rule for what the host checked and nothing else
(:func:`._confine.lock_down`'s ``named``): it opens the resolved path one component at
a time following no symlink, and checks it again as the host did; one changed in
between (a folder swapped for a symlink to ``/`` while the process started) is left
out, with a warning the host logs from the process's report.

Where the kernel has no Landlock a confined process's reads are not restricted, and the
setting changes nothing.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterable

from ._confine_paths import read_refusal

log = logging.getLogger("wasinn.backends")


def _refusal(resolved: str) -> str | None:
    """Why ``resolved`` (a path with its symlinks followed) may not be read (a sentence),
    or None: it would undo the confinement (:func:`._confine_paths.read_refusal`, which
    the process itself checks again as it adds the path's rule), or it holds
    ``os.pathsep``, which separates the paths handed to a sandbox process."""
    if os.pathsep in resolved:
        return (f"{resolved!r} holds {os.pathsep!r}, which separates the paths handed to a "
                "sandbox process: expected a path without it")
    return read_refusal(resolved, os.path.realpath(tempfile.gettempdir()))


def read_path_problem(entry: object, *, must_exist: bool = True) -> str | None:
    """What is wrong with ``entry`` as a path confined processes may read (a sentence that
    says what was expected), or None: it is right. ``must_exist``: a path that is not
    there is wrong too (the config's check; a pool given one leaves it out while it is
    missing, see :func:`readable_now`)."""
    if not isinstance(entry, str):
        return (f"{entry!r:.60} is not a string: expected the absolute path of a folder or "
                'file, such as "/srv/hf-cache"')
    if "\0" in entry:
        return f"{entry!r} holds a NUL byte: expected a path"
    if os.pathsep in entry:
        return (f"{entry!r} holds {os.pathsep!r}, which separates the paths handed to a "
                "sandbox process: expected a path without it (a symlink to it, named "
                "otherwise, does not help: the path is resolved first)")
    if not os.path.isabs(entry):
        return (f"{entry!r} is relative: expected an absolute path, such as "
                '"/srv/hf-cache" (a relative one would name another file in each '
                "directory wasinn is run from)")
    try:
        resolved = os.path.realpath(entry, strict=must_exist)
    except FileNotFoundError:
        return f"{entry!r} does not exist: expected an existing folder or file"
    except OSError as exc:  # (a symlink loop, a folder this process may not search)
        return (f"{entry!r} cannot be resolved: {exc.strerror or exc}: expected an "
                "existing folder or file")
    problem = _refusal(resolved)
    if problem is not None and resolved != entry:
        problem = f"{entry!r} resolves to {resolved!r}: {problem}"
    return problem


def read_paths(entries: Iterable[str]) -> tuple[str, ...]:
    """``entries`` as a tuple, each checked but for being there (ValueError naming the
    first that is wrong, see :func:`read_path_problem`; TypeError for one string, not a
    list of them)."""
    if isinstance(entries, str):
        raise TypeError(f"extra_read={entries!r:.60}: expected a list of paths, not a string")
    paths = tuple(entries)
    for i, entry in enumerate(paths):
        problem = read_path_problem(entry, must_exist=False)
        if problem is not None:
            raise ValueError(f"extra_read[{i}]: {problem}")
    return paths


def readable_now(paths: Iterable[str]) -> list[str]:
    """``paths`` (checked by :func:`read_paths`) as a process started now may read them:
    resolved, those there, each once; one that now resolves to a path
    :func:`read_path_problem` refuses is left out with a warning."""
    readable: dict[str, None] = {}
    for path in paths:
        try:
            resolved = os.path.realpath(path, strict=True)
        except OSError:
            log.debug("a confined sandbox process is started without %s, which it may read "
                      "(sandbox_read) but is not there now", path)
            continue
        problem = _refusal(resolved)
        if problem is not None:
            log.warning("a confined sandbox process is started without reading %s "
                        "(sandbox_read): %s", path, problem)
            continue
        readable.setdefault(resolved)
    return list(readable)
