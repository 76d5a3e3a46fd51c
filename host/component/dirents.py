"""Listing a directory through a descriptor already open, without opening another.

``os.listdir(fd)`` and ``os.scandir(fd)`` duplicate the descriptor first (``closedir``
closes what it was given), so a process that has run out of file descriptors cannot list
anything, even a directory it holds open. The scratch directories' measurement
(:mod:`wasinn.host.component.scratch`) must not fail that way: a guest holding every
descriptor of the process is exactly what it has to see. :func:`names` reads the entries
with ``getdents64`` on the descriptor itself (glibc 2.30 and later) and needs none of its
own; where the C library has no ``getdents64`` it falls back to ``os.listdir``.

A directory descriptor has one read offset: two threads listing through the same one at
once would each see part of the entries. Callers serialize (a lock per descriptor).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import struct
from typing import Any

#: Bytes asked of each ``getdents64`` call (a /proc/self/fd entry takes about 24).
_BUFFER_BYTES = 64 * 1024
#: ``struct linux_dirent64``: d_ino (u64), d_off (s64), d_reclen (u16), d_type (u8), then
#: d_name, NUL-terminated; in the machine's byte order.
_RECLEN = struct.Struct("=H")
_RECLEN_AT, _NAME_AT = 16, 19


def _load_getdents64() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        function = libc.getdents64
    except (OSError, AttributeError):  # not glibc >= 2.30 (or not Linux)
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t)
    function.restype = ctypes.c_ssize_t
    return function


_getdents64 = _load_getdents64()


def needs_no_descriptor() -> bool:
    """Whether :func:`names` lists without a descriptor of its own here."""
    return _getdents64 is not None


def names(fd: int) -> list[str]:
    """The names in the directory open as ``fd``, from its first entry (``.`` and ``..``
    left out). Raises OSError when the directory cannot be read. Moves ``fd``'s read
    offset: not for two threads at once on one descriptor."""
    if _getdents64 is None:
        return os.listdir(fd)
    os.lseek(fd, 0, os.SEEK_SET)
    buffer = ctypes.create_string_buffer(_BUFFER_BYTES)
    found: list[str] = []
    while True:
        got = _getdents64(fd, buffer, _BUFFER_BYTES)
        if got < 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
        if got == 0:
            return found
        raw = buffer.raw[:got]
        at = 0
        while at < got:
            (length,) = _RECLEN.unpack_from(raw, at + _RECLEN_AT)
            name = raw[at + _NAME_AT:raw.index(b"\0", at + _NAME_AT)]
            if name not in (b".", b".."):
                found.append(os.fsdecode(name))
            at += length
