"""How much memory a value whose size a config, a command line or a file gives may take.

An allocation is no test of that. Where the kernel overcommits memory (Linux's
``vm.overcommit_memory = 1``, common on VMs), ``np.zeros`` of terabytes succeeds: numpy
maps zero pages that the kernel provides only once they are touched, and when a backend
then touches them the process is killed (by the OOM killer), not told. MemoryError comes
only where the kernel refuses the mapping up front. So such a size is checked against
:func:`available_memory` before anything is allocated, and MemoryError stays a backstop
(an address-space or data-size limit, ``RLIMIT_AS``/``RLIMIT_DATA``, still raises it).

The bound is for the value alone: a run on it needs more (its outputs, a backend's copy),
which only a sandboxed model's limits contain.

Both the machine's memory and the limit of the cgroup this process is in (a container's,
a systemd slice's, read by :mod:`wasinn._cgroup`) bound it: past the cgroup's limit the
process is killed however much the machine has free.
"""

from __future__ import annotations

from pathlib import Path

import psutil

from wasinn import _cgroup


def available_memory(root: Path = _cgroup.ROOT) -> int:
    """The bytes of memory that new allocations can have now without swapping: the
    machine's (psutil's ``virtual_memory().available``: free memory plus the caches the
    kernel can reclaim), or, where less, what this process's cgroup leaves under its
    limit (:func:`wasinn._cgroup.cgroup_memory`, read from ``root``; it reckons only the
    inactive file cache reclaimable, so it errs on the low side). It changes as other
    processes allocate: a size over it cannot be allocated here, one under it may still
    not be by the time it is touched."""
    machine = int(psutil.virtual_memory().available)
    cgroup = _cgroup.cgroup_memory(root)
    if cgroup is None:
        return machine
    # (where its usage cannot be read, no more than its limit)
    return min(machine, cgroup.limit if cgroup.available is None else cgroup.available)


def total_memory(root: Path = _cgroup.ROOT) -> int:
    """The bytes of memory this process and its children may hold together: the
    machine's (psutil's ``virtual_memory().total``), or, where less, the limit of this
    process's cgroup (:func:`wasinn._cgroup.cgroup_memory`, read from ``root``), which
    its children are in too."""
    machine = int(psutil.virtual_memory().total)
    cgroup = _cgroup.cgroup_memory(root)
    return machine if cgroup is None else min(machine, cgroup.limit)
