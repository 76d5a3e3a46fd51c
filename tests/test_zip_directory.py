"""Zip member names read in place from the central directory, as zipfile reads them."""

from __future__ import annotations

import io
import struct
import zipfile
from collections.abc import Callable

import pytest

from tests.support import require_backend
from wasinn.backends._zip_directory import central_directory_names


def _zip(names: list[str], comment: bytes = b"",
         compression: int = zipfile.ZIP_STORED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression) as archive:
        for name in names:
            archive.writestr(name, name.encode() * 3)
        archive.comment = comment
    return buf.getvalue()


def _torchscript() -> bytes:
    require_backend("torch")
    import torch

    buf = io.BytesIO()
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), buf)
    return buf.getvalue()


def _torch_export() -> bytes:
    require_backend("torch")
    import torch

    buf = io.BytesIO()
    torch.export.save(torch.export.export(torch.nn.Linear(2, 2), (torch.zeros(1, 2),)), buf)
    return buf.getvalue()


def _as_zip64(data: bytes) -> bytes:
    """``data`` (a zip of no comment) with zip64 end records before its end record, whose
    counts, size and offset then say "see zip64" (0xffff...), as large archives are."""
    at = len(data) - 22
    _, _, _, _, count, size, offset, _ = struct.unpack("<4s4H2LH", data[at:])
    record = struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count,
                         size, offset)
    locator = struct.pack("<4sLQL", b"PK\x06\x07", 0, at, 1)
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF,
                      0xFFFFFFFF, 0)
    return data[:at] + record + locator + end


_NAMES = ["archive/data/0", "archive/data.pkl", "archive/code/__torch__/m.py",
          "archive/constants.pkl", "archive/version"]


@pytest.mark.parametrize("make", [
    lambda: _zip(_NAMES),
    lambda: _zip(_NAMES, compression=zipfile.ZIP_DEFLATED),
    lambda: _zip(_NAMES, comment=b"an archive comment of 4 KiB. " * 140),
    lambda: _as_zip64(_zip(_NAMES)),
    lambda: b"#!/bin/sh\nexit 0\n" + _zip(_NAMES),  # bytes before: a self-extractor's
    lambda: _zip(["modèle/données.pkl", "plain"]),  # UTF-8 names (flag bit 11)
    lambda: _zip([]),
    _torchscript,
    _torch_export,
], ids=["stored", "deflated", "comment", "zip64", "prefixed", "utf8", "empty",
        "torchscript", "torch-export"])
def test_names_are_zipfiles(make: Callable[[], bytes]) -> None:
    data = make()
    expected = [n.encode() for n in zipfile.ZipFile(io.BytesIO(data)).namelist()]
    assert list(central_directory_names(data)) == expected
    assert list(central_directory_names(memoryview(bytearray(data)))) == expected


def test_a_name_ends_at_a_nul_as_zipfile_cuts_it() -> None:
    data = bytearray(_zip(["archive/data.pkl"]))
    at = data.find(b"archive/data.pkl", data.find(b"PK\x01\x02"))
    data[at + 7] = 0  # archive\0data.pkl
    assert zipfile.ZipFile(io.BytesIO(data)).namelist() == ["archive"]
    assert list(central_directory_names(data)) == [b"archive"]


def _cut_in_the_directory() -> bytes:
    """An archive whose end record says its central directory is larger than the bytes
    between the archive's start and the end record leave."""
    data = bytearray(_zip(_NAMES))
    data[-10:-6] = struct.pack("<L", len(data))
    return bytes(data)


def _bad_entry_signature() -> bytes:
    data = bytearray(_zip(_NAMES))
    data[data.rfind(b"PK\x01\x02")] = ord("Q")  # the last entry
    return bytes(data)


def _entry_cut_short() -> bytes:
    """The directory's size, one byte short, cuts its last entry in two."""
    data = bytearray(_zip(["a"]))
    size, = struct.unpack("<L", data[-10:-6])
    data[-10:-6] = struct.pack("<L", size - (46 + 1) + 45)
    return bytes(data)


def _two_disks() -> bytes:
    data = bytearray(_as_zip64(_zip(_NAMES)))
    data[-22 - 4:-22] = struct.pack("<L", 2)  # the locator's number of disks
    return bytes(data)


def _newer_version() -> bytes:
    data = bytearray(_zip(_NAMES))
    at = data.find(b"PK\x01\x02")
    data[at + 6:at + 8] = struct.pack("<H", 255)  # the first entry needs zip 25.5
    return bytes(data)


@pytest.mark.parametrize(("data", "reason"), [
    (b"PK\x03\x04" + bytes(100), "no end of central directory record in its last 64 KiB"),
    (_cut_in_the_directory(), r"its central directory of \d+ bytes does not fit before "
                              r"its end record \(at \d+\)"),
    (_bad_entry_signature(), "central directory entry 4 has no entry signature"),
    (_entry_cut_short(), "the central directory is cut short in entry 0"),
    (_two_disks(), "the archive spans several disks"),
    (_newer_version(), r"central directory entry 0 needs zip version 25.5 to extract \(the "
                       r"newest read is 6.3\)"),
], ids=["no-end-record", "directory-too-large", "entry-signature", "entry-cut-short",
        "disks", "version"])
def test_damage_is_a_value_error_saying_what(data: bytes, reason: str) -> None:
    with pytest.raises(zipfile.BadZipFile if "version" not in reason else NotImplementedError):
        zipfile.ZipFile(io.BytesIO(data)).namelist()  # which zipfile refuses too
    with pytest.raises(ValueError, match=f"^{reason}$"):
        list(central_directory_names(data))


def test_names_come_one_at_a_time() -> None:
    # A caller stops reading where it has what it wants: the damage after is not reached.
    names = central_directory_names(_bad_entry_signature())
    assert [next(names) for _ in range(4)] == [n.encode() for n in _NAMES[:4]]
    with pytest.raises(ValueError, match="entry 4"):
        next(names)
