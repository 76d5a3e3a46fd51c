"""The folders and files an operator lets confined processes read (``[runtime]
sandbox_read``), as the host checks them and as the process opens them (see
:mod:`._sandbox_read` and :mod:`._confine`): what a path may not be, and opening a path
the host resolved through no symlink, so that the process's rule is for what was checked.

No import of wasinn: a confined child loads this module from its file, as it loads
:mod:`._confine`, before it may import anything that starts a thread.
"""

from __future__ import annotations

import errno
import os
import stat

#: The kernel's pseudo-file systems: what they show of the host no named path may open.
SYSTEM_VIEWS = ("/proc", "/sys", "/dev")


def read_refusal(resolved: str, temp: str) -> str | None:
    """Why letting a confined process read below ``resolved`` (a path with its symlinks
    followed) would undo its confinement (a sentence that says what was expected), or
    None. ``temp``: the folder the confined processes' private folders are in, resolved
    (the system temporary folder). The host checks each path an operator names with it
    (:mod:`._sandbox_read`), and the process does again as it adds the path's rule
    (:func:`_add_named_rule`)."""
    if resolved == os.path.abspath(os.sep):
        return ("the root folder would let a confined sandbox process read every file of "
                "the host, its keys and tokens included, which the confinement keeps from a "
                "process that a model may have compromised: expected the folders and files "
                "its library reads (or run a model that needs more with sandbox = false, "
                "in the host's process)")
    for system in SYSTEM_VIEWS:
        if _within(resolved, system):
            return (f"{resolved} is in {system}, the kernel's view of the host's processes "
                    "and devices (another process's environment, memory and open files "
                    "among them), which the confinement keeps from a process that a model "
                    "may have compromised: expected the folders and files its library reads")
    if _within(temp, resolved):
        what = ("is" if resolved == temp else "holds") + f" the system temporary folder {temp}"
        return (f"{resolved} {what}, where each confined sandbox process has its private "
                "folder: one could read another's, a guest's model with it; expected a "
                f"folder that does not hold it (such as a folder of its own in {temp})")
    return None


def _within(path: str, folder: str) -> bool:
    """Whether ``path`` is ``folder`` or below it (both absolute and normalised)."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def open_resolved(path: str) -> int:
    """An ``O_PATH`` descriptor of ``path``, an absolute path with its symlinks already
    followed (as the host resolved it), opened one component at a time from the root,
    following none: a path changed since it was resolved (a folder on its way, or itself,
    swapped for a symlink) is not opened. OSError: ELOOP where a component is a symlink
    now, EINVAL where ``path`` is not absolute and normalised (``.``, ``..``, ``//``), and
    the opens' own (FileNotFoundError where it is gone)."""
    if not os.path.isabs(path) or os.path.normpath(path) != path or path.startswith("//"):
        raise OSError(errno.EINVAL, f"{path!r} is not an absolute path with its symlinks "
                                    "resolved")
    fd = os.open(os.sep, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    reached = ""
    try:
        for name in filter(None, path.split(os.sep)):
            reached += os.sep + name
            step = _open_step(fd, name, reached)
            os.close(fd)
            fd = step
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_step(folder: int, name: str, reached: str) -> int:
    """``name`` in ``folder`` (a descriptor; ``reached``: its path with ``name``) opened
    with ``O_PATH``, not followed: OSError ELOOP where it is a symlink."""
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
    if stat.S_ISLNK(os.fstat(fd).st_mode):  # (O_NOFOLLOW opened the link itself)
        os.close(fd)
        raise OSError(errno.ELOOP, f"{reached} is a symlink now")
    return fd
