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
"""

from __future__ import annotations

import psutil


def available_memory() -> int:
    """The bytes of memory that new allocations can have now without swapping (psutil's
    ``virtual_memory().available``: free memory plus the caches the kernel can reclaim).
    It is the machine's (psutil reads ``/proc/meminfo``: a cgroup's limit, a container's,
    is not counted) and it changes as other processes allocate: a size over it cannot be
    allocated here, one under it may still not be by the time it is touched."""
    return int(psutil.virtual_memory().available)
