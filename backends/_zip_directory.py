"""The member names of a zip archive, read from its central directory where they lie.

:mod:`zipfile` reads the same names, but copies the whole central directory and builds a
``ZipInfo`` for each entry before the first can be looked at: hundreds of bytes of
memory for each 47-byte entry, for as many entries as an archive lists (a hostile one:
millions). Here the names come one at a time, each read in place, so that a caller
looking for a few of them stops when it has seen them, or when it has read as many
entries as it will, having held one name at a time.

The archive is read as :mod:`zipfile` reads it (the end record in the last 64 KiB, a
zip64 end record just before its locator, the central directory ending where the end
records begin), so that both find the same names in the same order, with one
difference: zipfile takes the last end record signature in the last 64 KiB, and here a
record is taken only where it is the archive's (:func:`_end_record`). In bytes cut short
the last signature left is that of a zip archive stored inside them (a ``.pt2``
archive's sample inputs, themselves a ``torch.save`` archive), whose names are not
theirs: such bytes have no end record (:class:`NoEndRecordError`).
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


class NoEndRecordError(ValueError):
    """The bytes have no end of central directory record of their own: they are cut
    short (or no zip archive at all)."""


def central_directory_names(data: bytes | bytearray | memoryview) -> Iterator[bytes]:
    """Each member name of the zip archive ``data``, in the central directory's order,
    as its raw bytes up to any NUL (as zipfile cuts them): cp437 or UTF-8, both of which
    read ASCII as ASCII. Each is a copy of at most 64 KiB; besides, only the last 64 KiB
    (where the end record is looked for) are copied.

    Raises ValueError, saying what is wrong, as it gets there: NoEndRecordError for
    bytes with no end of central directory record of their own; ValueError for a
    directory that spans disks or does not fit before its end record, a damaged entry,
    or an entry that needs a newer zip version than Python's zipfile reads.
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
        raise NoEndRecordError("no end of central directory record in its last 64 KiB")
    start, ends, _ = _bounds(view, at)
    return start, ends


def _bounds(view: memoryview, at: int) -> tuple[int, int, int]:
    """For the end record at ``at``: where the central directory begins and ends in
    ``view``, and where the records say it begins (its offset from the archive's first
    byte). ValueError when the archive spans disks or its directory does not fit."""
    _, _, _, _, _, size, offset, _ = _END.unpack_from(view, at)
    ends = at
    locator = at - _LOCATOR.size
    if locator >= 0 and bytes(view[locator:locator + 4]) == _LOCATOR_SIGNATURE:
        _, disk, _, disks = _LOCATOR.unpack_from(view, locator)
        if disk != 0 or disks > 1:
            raise ValueError("the archive spans several disks")
        record = locator - _END64.size
        if record >= 0 and bytes(view[record:record + 4]) == _END64_SIGNATURE:
            size, offset = _END64.unpack_from(view, record)[8:10]
            ends = record
    if size > ends:
        raise ValueError(f"its central directory of {size} bytes does not fit before its "
                         f"end record (at {ends})")
    return ends - size, ends, offset


def _end_record(view: memoryview) -> int:
    """The offset of the archive's end of central directory record, or -1. It is looked
    for as zipfile looks (at the very end when the archive has no comment, else the last
    signature in the last 64 KiB + 22 bytes), but a signature is taken only when its
    record's comment ends where the bytes end, or its central directory lies where the
    record says with no bytes before the archive (a whole archive with bytes after it,
    which zipfile and torch read). Others, such as the record of an archive stored
    uncompressed inside the bytes, are passed over for the one before."""
    first = max(len(view) - _END.size - _MAX_COMMENT, 0)
    tail = bytes(view[first:])
    last = len(tail) - _END.size  # where an end record of no comment begins
    if last < 0:
        return -1
    if tail.startswith(_END_SIGNATURE, last) and tail.endswith(b"\x00\x00"):
        return first + last
    before = last + len(_END_SIGNATURE)  # a whole record begins at `last` at the latest
    while (found := tail.rfind(_END_SIGNATURE, 0, before)) >= 0:
        if found + _END.size + _END.unpack_from(tail, found)[-1] == len(tail):
            return first + found
        try:
            start, _, offset = _bounds(view, first + found)
        except ValueError:
            pass
        else:
            if start == offset:
                return first + found
        before = found
    return -1
