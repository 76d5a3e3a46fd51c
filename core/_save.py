"""``wasinn infer --save``: a run's outputs written to a numpy archive, as
``numpy.savez`` writes one, and the check, before the run, that the archive can be written
where ``--save`` says (see :func:`check_save_path`, :func:`save_outputs`)."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import secrets
import stat
import sys
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO

import numpy as np

from wasinn.enums import TensorType
from wasinn.errors import InvalidArgumentError
from wasinn.tensor import Tensor

#: How numpy's format stores bf16, which it has no type for: 2-byte raw values.
RAW_2_BYTES = np.dtype("V2")

#: The errors of a write that found no room: a full disk, a quota, a file size limit.
_NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def check_save_path(path: Path) -> None:
    """Before any run: InvalidArgumentError, with the message :func:`save_outputs` would
    give after it, when ``--save`` names a file that the save could not write: its folder
    missing, a folder itself, a folder on a file system mounted read-only (said first, as
    such: there no name can be written), a read-only file (said to be another user's in a
    sticky folder where it is, since no rename may replace it either), or a new file in
    a folder where none may be created. The save's own rules decide: where it would write
    a new file beside the target, one is created and removed at once; a target it would
    write into (a FIFO, a device, a pipe or a socket as ``/dev/stdout`` or ``/dev/fd/N``
    reaches it, a file with other hard links, a file in a folder closed to new files,
    another user's file in a sticky folder) must be writable, and is not opened (a FIFO
    would wait for its reader). What changes during the run, the save itself still
    finds."""
    if not path.parent.is_dir():
        raise InvalidArgumentError(f"--save {path}: there is no folder {path.parent}: "
                                   "expected a file in an existing folder")
    if path.is_dir():
        raise InvalidArgumentError(f"--save {path}: a folder: expected a file name "
                                   "(FILE.npz)")
    _, opened = _destination(path)
    if opened is not None:
        temporary, fd = opened
        os.close(fd)
        temporary.unlink(missing_ok=True)


def save_outputs(path: Path, outputs: Mapping[str, Tensor]) -> None:
    """The outputs as a numpy archive, as ``numpy.savez`` writes one: a ``NAME.npy``
    member per output (numpy's own format), whatever the name (``file``, ``a/b:0``,
    non-ASCII), so ``numpy.load(path)[NAME]`` and ``--input path`` give each back by its
    name. A bf16 output is stored as numpy stores an ``ml_dtypes.bfloat16`` array: 2-byte
    raw values (``|V2``), which ``.view(ml_dtypes.bfloat16)`` (or ``--input``) reads as bf16.

    The archive is written to a new file beside the target (through a symbolic link, the
    file it names), then renamed onto it: a save that fails leaves what was there as it
    was. The new file keeps a replaced file's permissions. A target that is not a regular
    file (a pipe, a socket, a FIFO, a device) is written into, never replaced, as the path
    given reaches it: through this process's descriptor for ``/dev/stdout``,
    ``/dev/stderr``, ``/dev/fd/N`` or ``/proc/self/fd/N`` (a shell's ``>(...)``), else
    as ``open(path, "wb")`` would. So is, in place, a file with other hard links (a
    rename would leave them the old archive), a file in a folder where no new file may
    be created, and another user's file in a sticky folder (mode 1777, as /tmp), which
    the kernel lets only the file's owner, the folder's owner or root rename over: room
    for the archive is reserved first (``posix_fallocate``, where the file system has
    it), so that a full disk fails the save before the file changes.
    Where stdout's reader has gone, BrokenPipeError is raised as it is (the CLI then ends
    quietly, as SIGPIPE would end it). Raises InvalidArgumentError,
    naming the file, for names no archive can hold (with a NUL character, which zip member
    names cannot hold, or both ``X`` and ``X.npy``, which ``numpy.load`` cannot tell
    apart) and for a file that cannot be written (read-only, a full disk, a folder not
    writable, a read-only file system); :func:`check_save_path` finds the latter before a
    run.
    """
    _check_member_names(path, outputs)
    target, opened = _destination(path)
    if opened is None:
        if _special(target):
            _write_into(path, outputs)
        else:  # other hard links, a folder closed to new files, or a sticky folder's rule
            _overwrite(path, target, outputs)
        return
    temporary, fd = opened
    try:
        with os.fdopen(fd, "wb") as file:
            with contextlib.suppress(FileNotFoundError):  # (a new file: open()'s mode)
                os.fchmod(fd, stat.S_IMODE(os.stat(target).st_mode))
            _write_archive(file, outputs)
            file.flush()
            os.fsync(fd)  # the data on disk before the rename makes it the target
        os.replace(temporary, target)
    except OSError as exc:
        temporary.unlink(missing_ok=True)
        raise _cannot_write(path, target, exc) from exc
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def _destination(path: Path) -> tuple[Path, tuple[Path, int] | None]:
    """Where the save of ``path`` writes, by its rules (:func:`save_outputs`; the same
    for :func:`check_save_path`): the target (through a symbolic link, the file it
    names), and a new file opened beside it to be renamed onto it; None where the target
    is written into instead (not a regular file, a file with other hard links, a file in
    a folder closed to new files, a file a sticky folder keeps from a rename).
    InvalidArgumentError where nothing can be written."""
    if _special(path):
        # Taken as given, not resolved: /dev/stdout or /dev/fd/N on a pipe or a socket
        # resolves to a name that is none (/proc/PID/fd/pipe:[N]).
        _refuse_read_only(path, path)
        return path, None
    target = Path(os.path.realpath(path))
    _refuse_read_only_file_system(path, target)
    _refuse_read_only(path, target)
    if _special(target) or _linked(target) or _kept_by_sticky_folder(target) is not None:
        return target, None
    return target, _open_temporary(path, target)


def _refuse_read_only_file_system(path: Path, target: Path) -> None:
    # Checked first: on a file system mounted read-only every other check fails too (root
    # included), and would blame the file or the folder, or offer a new name that fails
    # as well. A FIFO or a device there may still be written (the kernel allows it).
    if _special(target):
        return
    try:
        read_only = os.statvfs(target.parent).f_flag & os.ST_RDONLY
    except OSError:  # (a folder missing, or gone: the checks after this one say so)
        return
    if read_only:
        raise _on_read_only_file_system(path, target.parent)


def _on_read_only_file_system(path: Path, place: Path) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"--save {path}: {place} is on a file system mounted read-only, where no file may "
        "be written or created: expected FILE on a writable file system (save it elsewhere)")


def _refuse_read_only(path: Path, target: Path) -> None:
    # The archive replaces the file by a rename, which a read-only file does not stop
    # (its folder's permission decides): the file's own is checked, as open("wb") would.
    # Permission bits stop no write of root's: for root this is an immutable file.
    if target.exists() and not os.access(target, os.W_OK):
        new_name = ("a new name" if os.access(target.parent, os.W_OK | os.X_OK)
                    else f"a name in a folder wasinn may write ({target.parent} takes no "
                         "new file)")
        owner = None if _special(target) else _kept_by_sticky_folder(target)
        if owner is not None:  # (said so: neither a rename nor a write can replace it)
            raise InvalidArgumentError(
                f"--save {path}: {target} is another user's (uid {owner}) in a sticky "
                f"folder, {target.parent} (mode {_mode(target.parent)}, as /tmp), where "
                "only the file's owner, the folder's owner or root may replace it, and it "
                "is read-only to wasinn, which cannot write into it instead: expected "
                f"{new_name}, or a file of your own")
        raise InvalidArgumentError(
            f"--save {path}: {target} is read-only: expected a file wasinn may write, or "
            f"{new_name}")


def _kept_by_sticky_folder(target: Path) -> int | None:
    """The owner (uid) of the file at ``target`` where its folder's sticky bit keeps this
    process from renaming over it; None where a rename may replace it (or there is no
    file)."""
    # The kernel's rule (man 7 inode, "The sticky bit"): in a folder with the sticky bit
    # (/tmp, mode 1777) only the file's owner, the folder's owner or a privileged process
    # may unlink or rename over a file; for anyone else os.replace fails (EPERM), after
    # the run. Root stands for the privileged (CAP_FOWNER alone is not looked for).
    try:
        file, folder = os.stat(target), os.stat(target.parent)
    except OSError:  # (none there; or the write names the error)
        return None
    if not folder.st_mode & stat.S_ISVTX:
        return None
    user = os.geteuid()
    if user == 0 or user in (file.st_uid, folder.st_uid):
        return None
    return file.st_uid


def _mode(place: Path) -> str:
    # A file's permission bits as chmod takes them: 1777.
    return f"{stat.S_IMODE(os.stat(place).st_mode):o}"


def _open_temporary(path: Path, target: Path) -> tuple[Path, int] | None:
    """A new file beside ``target``, opened for writing; None where the folder takes no
    new file but ``target`` exists (then it is written into). InvalidArgumentError where
    neither can be written (a folder not writable, missing, on a read-only file system)."""
    temporary = target.with_name(f".{target.name}.{secrets.token_hex(8)}.tmp")
    try:
        # O_EXCL: never someone else's file; 0o666 less the umask, as open() gives.
        return temporary, os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except PermissionError as exc:
        if target.exists():
            return None  # a file we may write, in a folder we may not
        raise _cannot_write(path, target, exc) from exc
    except OSError as exc:
        raise _cannot_write(path, target, exc) from exc


def _cannot_write(path: Path, target: Path, exc: OSError) -> InvalidArgumentError:
    if exc.errno == errno.EROFS:  # (mounted read-only since the check, or no statvfs)
        return _on_read_only_file_system(path, target.parent)
    return InvalidArgumentError(
        f"--save {path}: cannot write {target}: {exc.strerror or exc}: expected a writable "
        "folder with room for the archive")


def _special(target: Path) -> bool:
    # Whether target exists and is not a regular file: a pipe, a FIFO or a device, which
    # a rename would replace by a regular file (root's /dev/null included).
    try:
        return not stat.S_ISREG(os.stat(target).st_mode)
    except OSError:  # (none there; or the write below names the error)
        return False


def _linked(target: Path) -> bool:
    # Whether target is a file with other hard links: a rename would part it from them,
    # leaving them the earlier archive.
    try:
        return os.stat(target).st_nlink > 1
    except OSError:
        return False


def _overwrite(path: Path, target: Path, outputs: Mapping[str, Tensor]) -> None:
    # The archive, built in memory, written over the regular file at target in place
    # (its inode, and so every hard link to it, kept), its room reserved first.
    archive = io.BytesIO()
    _write_archive(archive, outputs)
    data = archive.getbuffer()
    try:
        with os.fdopen(os.open(target, os.O_WRONLY), "wb") as file:
            _reserve(file.fileno(), len(data))
            file.write(data)
            file.truncate()  # (an earlier, longer archive's end)
            file.flush()
            os.fsync(file.fileno())
    except OSError as exc:
        if exc.errno == errno.EROFS:
            raise _on_read_only_file_system(path, target) from exc
        expected = ("room for the archive" if exc.errno in _NO_ROOM
                    else "a file wasinn may write")
        raise InvalidArgumentError(
            f"--save {path}: cannot write into {target}: {exc.strerror or exc}: expected "
            f"{expected}") from exc


def _reserve(fd: int, size: int) -> None:
    # The disk blocks for size bytes of the file, so that a full disk (or a file size
    # limit) fails here, before a byte is written. A file system without the call, or
    # a platform, goes on unreserved.
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is None:
        return
    try:
        fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise


def _write_into(path: Path, outputs: Mapping[str, Tensor]) -> None:
    # The archive, built in memory (a pipe cannot seek), written into the file at path:
    # through this process's descriptor where path names one (a socket can be reached no
    # other way), else opened by its name. A reader of stdout gone is the CLI's to report
    # (quietly, as SIGPIPE would), so its BrokenPipeError passes as it is.
    archive = io.BytesIO()
    _write_archive(archive, outputs)
    fd = _descriptor(path)
    try:
        if fd is None:
            with open(path, "wb") as file:
                file.write(archive.getbuffer())
        else:
            if fd == _stdout_fd():
                sys.stdout.flush()  # (anything printed before the archive comes first)
            data = memoryview(archive.getbuffer())
            while data:
                data = data[os.write(fd, data):]
    except BrokenPipeError:
        if fd is not None and fd == _stdout_fd():
            raise
        raise InvalidArgumentError(
            f"--save {path}: cannot write into it: its reader has gone: expected a pipe "
            "that is read to its end") from None
    except OSError as exc:
        raise InvalidArgumentError(
            f"--save {path}: cannot write into it: {exc.strerror or exc}: expected a file, "
            "pipe or device wasinn may write") from exc


def goes_to_stdout(path: Path) -> bool:
    """Whether an archive saved to ``path`` goes where this process's stdout does
    (``--save /dev/stdout``, or the file stdout is redirected to): the command then prints
    its lines to stderr, so that the archive is all that stdout's reader gets."""
    fd = _stdout_fd()
    try:
        return fd is not None and os.path.samestat(os.fstat(fd), os.stat(path))
    except OSError:  # (nothing there, or stdout closed)
        return False


def _stdout_fd() -> int | None:
    # The descriptor under sys.stdout; None where it has none (replaced, or closed).
    try:
        return sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return None


#: The names of a descriptor of this process: /dev/stdout, /dev/stderr, /dev/fd/N,
#: /proc/self/fd/N (or thread-self, or this process's id in place of self).
_DESCRIPTOR_NAME = re.compile(r"/dev/(?P<std>stdout|stderr)"
                              r"|(?:/dev|/proc/(?P<process>self|thread-self|[0-9]+))"
                              r"/fd/(?P<fd>[0-9]{1,9})")


def _descriptor(path: Path) -> int | None:
    """The descriptor of this process that ``path`` names (see :data:`_DESCRIPTOR_NAME`)
    where it is open on the file that ``path`` reaches; None for any other path."""
    name = _DESCRIPTOR_NAME.fullmatch(os.path.abspath(path))
    if name is None or name["process"] not in (None, "self", "thread-self", str(os.getpid())):
        return None
    fd = {"stdout": 1, "stderr": 2}[name["std"]] if name["std"] else int(name["fd"])
    try:
        return fd if os.path.samestat(os.fstat(fd), os.stat(path)) else None
    except OSError:
        return None


def _check_member_names(path: Path, outputs: Mapping[str, Tensor]) -> None:
    # InvalidArgumentError for an output name that the archive would not give back.
    for name in outputs:
        if "\0" in name:
            raise InvalidArgumentError(
                f"--save {path}: output {name!r} has a NUL character, which a zip member "
                "name cannot hold: expected names without one")
        if name.endswith(".npy") and name.removesuffix(".npy") in outputs:
            raise InvalidArgumentError(
                f"--save {path}: outputs {name.removesuffix('.npy')!r} and {name!r} cannot "
                f"share an archive: numpy.load reads its member {name!r} for both: expected "
                "names that differ by more than a '.npy' ending")
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidArgumentError(
                f"--save {path}: output {name!r} is not valid Unicode: expected a name "
                "that UTF-8 can write, as a zip member name is") from None


def _write_archive(file: BinaryIO, outputs: Mapping[str, Tensor]) -> None:
    # What numpy.savez writes, without its keyword arguments, which output names can
    # collide with (an output named "file" or "allow_pickle"): stored, zip64 members.
    with zipfile.ZipFile(file, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, tensor in outputs.items():
            array = tensor.numpy()
            if tensor.type is TensorType.BF16:
                array = array.view(RAW_2_BYTES)  # what numpy.save makes of bfloat16
            with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, array, allow_pickle=False)
