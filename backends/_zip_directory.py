"""The member names of a zip archive, read from its central directory where they lie.

:mod:`zipfile` reads the same names, but copies the whole central directory and builds a
``ZipInfo`` for each entry before the first can be looked at: hundreds of bytes of
memory for each 47-byte entry, for as many entries as an archive lists (a hostile one:
millions). Here the names come one at a time, each read in place, so that a caller
looking for a few of them stops when it has seen them, or when it has read as many
entries as it will, having held one name at a time.

The archive is read as :mod:`zipfile` reads it (the end record in the last 64 KiB, a
zip64 end record just before its locator, the central directory ending where the end
records begin), so that both find the same names in the same order.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

#: End of central directory record: signature, disk numbers (2), entries on this disk
#: and in all, directory size and offset, comment length.
_END = struct.Struct("<4s4H2LH")
_END_SIGNATURE = b"PK\x05\x06"
#: Zip64 end of central directory locator: signature, disk of the zip64 record, its
#: offset, number of disks.
_LOCATOR = struct.Struct("<4sLQL")
_LOCATOR_SIGNATURE = b"PK\x06\x07"
#: Zip64 end of central directory record (no extensible data, as zipfile assumes):
#: signature, record size, versions (2), disk numbers (2), entry counts (2), directory
#: size and offset.
_END64 = struct.Struct("<4sQ2H2L4Q")
_END64_SIGNATURE = b"PK\x06\x06"
#: Central directory file header (46 bytes), the fields read here: signature, version
#: needed to extract, name, extra field and comment lengths.
_ENTRY = struct.Struct("<4s2xH20x3H12x")
_ENTRY_SIGNATURE = b"PK\x01\x02"
#: An archive comment is at most this long, so the end record lies in the last 64 KiB.
_MAX_COMMENT = 0xFFFF
#: The newest "version needed to extract" Python's zipfile reads (6.3); the torch.export
#: reader (:mod:`._pt2_check`, :mod:`._torch_export`) reads archives with zipfile.
_MAX_EXTRACT_VERSION = 63


def central_directory_names(data: bytes | bytearray | memoryview) -> Iterator[bytes]:
    """Each member name of the zip archive ``data``, in the central directory's order,
    as its raw bytes up to any NUL (as zipfile cuts them): cp437 or UTF-8, both of which
    read ASCII as ASCII. Each is a copy of at most 64 KiB; besides, only the last 64 KiB
    (where the end record is looked for) are copied.

    Raises ValueError, saying what is wrong, as it gets there: for bytes with no end of
    central directory record, a directory that spans disks or does not fit before its
    end record, a damaged entry, or an entry that needs a newer zip version than
    Python's zipfile reads.
    """
    view = memoryview(data).cast("B")
    start, end = _directory(view)
    pos = start
    index = 0
    last = end - _ENTRY.size  # where the last whole header may begin
    while pos < end:
        if pos > last:
            raise ValueError(f"the central directory is cut short in entry {index}")
        signature, version, name_length, extra_length, comment_length = \
            _ENTRY.unpack_from(view, pos)
        if signature != _ENTRY_SIGNATURE:
            raise ValueError(f"central directory entry {index} has no entry signature")
        if version > _MAX_EXTRACT_VERSION:
            raise ValueError(f"central directory entry {index} needs zip version "
                             f"{version / 10:.1f} to extract (the newest read is "
                             f"{_MAX_EXTRACT_VERSION / 10:.1f})")
        pos += _ENTRY.size
        name = bytes(view[pos:pos + name_length])
        yield name.partition(b"\x00")[0]
        pos += name_length + extra_length + comment_length
        index += 1


def _directory(view: memoryview) -> tuple[int, int]:
    """Where the central directory of the archive ``view`` begins, and where it ends: by
    its size, just before the end records (so that bytes before the archive, a
    self-extractor's, move it as they move them)."""
    at = _end_record(view)
    if at < 0:
        raise ValueError("no end of central directory record in its last 64 KiB")
    _, _, _, _, _, size, _, _ = _END.unpack_from(view, at)
    ends = at
    locator = at - _LOCATOR.size
    if locator >= 0 and bytes(view[locator:locator + 4]) == _LOCATOR_SIGNATURE:
        _, disk, _, disks = _LOCATOR.unpack_from(view, locator)
        if disk != 0 or disks > 1:
            raise ValueError("the archive spans several disks")
        record = locator - _END64.size
        if record >= 0 and bytes(view[record:record + 4]) == _END64_SIGNATURE:
            size = _END64.unpack_from(view, record)[8]
            ends = record
    if size > ends:
        raise ValueError(f"its central directory of {size} bytes does not fit before its "
                         f"end record (at {ends})")
    return ends - size, ends


def _end_record(view: memoryview) -> int:
    """The offset of the end of central directory record, found as zipfile finds it (at
    the very end when the archive has no comment, else the last signature in the last
    64 KiB + 22 bytes), or -1."""
    first = max(len(view) - _END.size - _MAX_COMMENT, 0)
    tail = bytes(view[first:])
    last = len(tail) - _END.size  # where an end record of no comment begins
    if last >= 0 and tail.startswith(_END_SIGNATURE, last) and tail.endswith(b"\x00\x00"):
        return first + last
    found = tail.rfind(_END_SIGNATURE)
    return -1 if found < 0 or found > last else first + found
