"""The memory limit of the cgroup this process is in, and what is left under it.

A container, a Kubernetes pod or a systemd slice bounds the memory of its processes by
their cgroup, which ``/proc/meminfo`` (psutil's reading) does not show: inside a cgroup
limited to 2 GiB on a 64 GiB machine, the machine's memory says 10 GiB fit, and the
process that takes them is killed by the cgroup's OOM killer. :func:`cgroup_memory`
reads the bound that applies here, for :mod:`wasinn._memory`.

Where the cgroup is: ``/proc/self/cgroup`` names it, relative to the root of its
hierarchy (``N:memory:/path`` where cgroup v1's memory controller is mounted, else
cgroup v2's ``0::/path``); ``/proc/self/mountinfo`` says where that hierarchy, or the
part of it this process sees, is mounted (usually ``/sys/fs/cgroup``, or
``/sys/fs/cgroup/memory`` for v1). Inside a container with a cgroup namespace the
path reads ``/`` and the mount is the container's own cgroup, whose limit is there.

What bounds it: a cgroup's limit binds every process below it, so every cgroup from
this process's up to the mount is read (a child's ``memory.max`` is often ``max``
while its parent's is set), and the tightest gives the limit. What is left is the least
headroom over them: each limited cgroup's limit less its working set, which is what it
holds (``memory.current``; v1 ``memory.usage_in_bytes``) less its inactive file cache
(``memory.stat``'s ``inactive_file``; v1 ``total_inactive_file``), the cache the kernel
reclaims first. That is the working set by which the kubelet evicts a pod, and the
usage ``docker stats`` reports; it leaves out the active file cache, which the kernel can
also reclaim, but at the cost of files in use: the reading errs on the low side, as a
bound that refuses a size before it is allocated should. v1 adds the limit the kernel
reckons over every ancestor (``memory.stat``'s ``hierarchical_memory_limit``), which
covers ancestors outside the mount.

Every read is tolerant: a file that is missing, unreadable or not a number says
nothing (that cgroup sets no limit known here); no cgroup found, or no limit set,
reads as None, never as an exception. Every function takes the filesystem root, so that
tests read trees of their own.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

#: The filesystem root whose ``proc`` and ``sys`` are read.
ROOT = Path("/")
#: A cgroup v1 limit this large or larger is none: v1 writes "unlimited" as the largest
#: page count, 2**63 less a page.
V1_UNLIMITED = 1 << 62

_NUMBER = re.compile(r"[0-9]{1,20}")
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


@dataclasses.dataclass(frozen=True)
class CgroupMemory:
    """The memory bound of this process's cgroup (see the module docstring)."""

    #: The tightest limit, in bytes, over the cgroup and its ancestors.
    limit: int
    #: The bytes that may still be taken under every limit (their least headroom), or
    #: None where no limited cgroup's usage could be read.
    available: int | None


@dataclasses.dataclass(frozen=True)
class _Hierarchy:
    # The cgroup of this process in one hierarchy: its directory and the mount point
    # above which nothing can be read.
    v1: bool
    directory: Path
    mount: Path


def cgroup_memory(root: Path = ROOT) -> CgroupMemory | None:
    """The memory limit that binds this process's cgroup and what is left under it, read
    from ``root``'s ``/proc`` and ``/sys``; None where no cgroup or no limit is found
    (the machine's memory is the bound then). Raises nothing."""
    found = _memory_hierarchy(root)
    if found is None:
        return None
    limits: list[int] = []
    headrooms: list[int] = []
    for directory in _up_to_mount(found):
        stat = _read_stat(directory)
        bounds = [_read_limit(directory, found.v1)]
        if found.v1 and directory == found.directory:
            # The kernel's own reckoning over every ancestor, those unmounted included
            # (against this cgroup's usage: theirs, unseen, may be more).
            ancestors = stat.get("hierarchical_memory_limit")
            bounds.append(ancestors if ancestors is not None and ancestors < V1_UNLIMITED
                          else None)
        for bound in bounds:
            if bound is None:
                continue
            limits.append(bound)
            if (headroom := _headroom(bound, directory, stat, found.v1)) is not None:
                headrooms.append(headroom)
    if not limits:
        return None
    limit = min(limits)
    # (capped by the tightest limit: a limited cgroup whose usage cannot be read counts
    # with no headroom of its own, which must not let a looser parent's stand for it)
    return CgroupMemory(limit=limit, available=min(*headrooms, limit) if headrooms else None)


def _memory_hierarchy(root: Path) -> _Hierarchy | None:
    """Where this process's cgroup is that holds its memory controller: v1's memory
    hierarchy where ``/proc/self/cgroup`` lists one (a controller is in one hierarchy
    only), else v2's."""
    listing = _read(root / "proc/self/cgroup")
    if listing is None:
        return None
    v1_path = v2_path = None
    for line in listing.splitlines():
        number, _, rest = line.partition(":")
        controllers, colon, path = rest.partition(":")
        if not colon or not path.startswith("/"):
            continue
        if number == "0" and not controllers:
            v2_path = path
        elif "memory" in controllers.split(","):
            v1_path = path
    v1 = v1_path is not None
    cgroup = v1_path if v1_path is not None else v2_path
    if cgroup is None:
        return None
    for mount_root, mount_point in _mounts(root, v1):
        directory = _below(mount_point, mount_root, cgroup)
        if directory is not None:
            return _Hierarchy(v1, directory, mount_point)
    if _read(root / "proc/self/mountinfo") is not None:
        return None  # mounts listed, none of this hierarchy that shows the cgroup
    # No mountinfo to say where: the usual place, where it is a cgroup hierarchy.
    mount_point = root / ("sys/fs/cgroup/memory" if v1 else "sys/fs/cgroup")
    marker = "memory.limit_in_bytes" if v1 else "cgroup.controllers"
    directory = _below(mount_point, "/", cgroup)
    if directory is None or not (mount_point / marker).is_file():
        return None
    return _Hierarchy(v1, directory, mount_point)


def _mounts(root: Path, v1: bool) -> list[tuple[str, Path]]:
    """The mounts of the hierarchy (v1: the memory controller's; else cgroup v2) in
    ``/proc/self/mountinfo``, each as (the hierarchy's path mounted, the mount point
    under ``root``); none where it cannot be read."""
    table = _read(root / "proc/self/mountinfo")
    found = []
    for line in (table or "").splitlines():
        mount, separator, source = line.partition(" - ")
        fields, described = mount.split(), source.split()
        if not separator or len(fields) < 5 or len(described) < 3:
            continue
        kind, options = described[0], described[2].split(",")
        if (v1 and kind == "cgroup" and "memory" in options) or (
                not v1 and kind == "cgroup2"):
            point = _unescape(fields[4]).lstrip("/")
            found.append((_unescape(fields[3]), root / point))
    return found


def _below(mount_point: Path, mount_root: str, path: str) -> Path | None:
    """The directory of the cgroup at ``path`` in a mount of the hierarchy's
    ``mount_root`` at ``mount_point``; None where the mount does not show it (a mount of
    a cgroup beside or below it, or, ``/..``, from outside this cgroup namespace). Inside
    a container's namespace both read ``/``: the mount is the container's cgroup."""
    parts = [part for part in path.split("/") if part]
    above = [part for part in mount_root.split("/") if part]
    if ".." in parts or parts[:len(above)] != above:
        return None  # outside the namespace, or beside the mounted part
    return mount_point.joinpath(*parts[len(above):])


def _up_to_mount(found: _Hierarchy) -> list[Path]:
    # The cgroup's directory and each parent up to the mount point, the mount included.
    directories = [found.directory]
    while directories[-1] != found.mount and directories[-1] != directories[-1].parent:
        directories.append(directories[-1].parent)
    return directories


def _read_limit(directory: Path, v1: bool) -> int | None:
    """The memory limit set on one cgroup; None where none is (``max``, v1's
    unlimited) or it cannot be read."""
    if v1:
        bound = _number(_read(directory / "memory.limit_in_bytes"))
        return bound if bound is not None and bound < V1_UNLIMITED else None
    return _number(_read(directory / "memory.max"))  # ("max" is no number)


def _headroom(bound: int, directory: Path, stat: dict[str, int], v1: bool) -> int | None:
    """What may be taken under ``bound``: it less the cgroup's working set (its usage
    less its inactive file cache); None where its usage cannot be read."""
    usage = _number(_read(directory / ("memory.usage_in_bytes" if v1 else "memory.current")))
    if usage is None:
        return None
    inactive = (stat.get("total_inactive_file", stat.get("inactive_file", 0)) if v1
                else stat.get("inactive_file", 0))
    return max(0, bound - (usage - min(inactive, usage)))


def _read_stat(directory: Path) -> dict[str, int]:
    # memory.stat's "key value" lines, those whose value is a number.
    stat = {}
    for line in (_read(directory / "memory.stat") or "").splitlines():
        key, _, value = line.partition(" ")
        if (number := _number(value)) is not None:
            stat[key] = number
    return stat


def _number(text: str | None) -> int | None:
    # A non-negative decimal integer, else None.
    if text is None or not _NUMBER.fullmatch(text := text.strip()):
        return None
    return int(text)


def _unescape(field: str) -> str:
    # mountinfo writes a space, tab, newline or backslash in a path as \ooo.
    return _OCTAL_ESCAPE.sub(lambda match: chr(int(match.group(1), 8)), field)


def _read(path: Path) -> str | None:
    # A file's text, or None where it is missing, unreadable or no text.
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError, ValueError):
        return None
