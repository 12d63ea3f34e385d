"""Files inside a run folder are opened without following links; output paths are written where they point.

A run folder is untrusted input (downloaded, shared, or left by a run that was killed): a ``.lock``,
``metrics.jsonl`` or ``checkpoints/`` planted as a symbolic link must never make rollcorr write, truncate or
prune a file outside the folder. So everything the trainer reads or writes *inside* a run folder goes through

- ``open_inside(path, flags)``: ``O_NOFOLLOW`` (a link is refused, not followed), ``O_NONBLOCK`` while
  opening (a FIFO cannot hang us), then ``fstat``: anything but a regular file is refused; ``O_TRUNC`` is
  applied with ``ftruncate`` only after that check (a device is never truncated);
- ``check_inside_dir(path)``: ``lstat``: a link or a non-directory is refused;
- ``atomic_write_bytes(path, data)``: a new temp file (``O_EXCL``, never a planted link) in the same folder,
  fsynced, then renamed over ``path`` (which replaces a link, never writes through it).

Each refusal is an ``UnsafePathError`` with one line naming the path and what it is.

Paths the *user* names on the command line (``--json OUT``, ``--out``) are theirs to point anywhere:
``write_output`` writes a FIFO, a character device or ``/dev/stdout`` in place (a temp file + rename would
replace the FIFO by a regular file), and everything else atomically.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path


class UnsafePathError(RuntimeError):
    """A path inside a run folder that is a link or not a regular file / folder; one line for the user."""


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISREG(mode):
        return "a file"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def describe_os_error(err: OSError) -> str:
    """``err`` as a short phrase: "no space left on device", "read-only file system", ..."""
    if err.errno == errno.ENOSPC:
        return "no space left on device"
    if err.errno == errno.EFBIG:
        return "file too large (a file-size limit, ulimit -f)"
    if err.errno == errno.EDQUOT:
        return "disk quota exceeded"
    if err.errno == errno.EROFS:
        return "read-only file system"
    if err.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    return (err.strerror or str(err)).lower()


def open_inside(path: str | Path, flags: int, mode: int = 0o644) -> int:
    """An fd on the regular file ``path`` (``os.open`` flags), never following a link; ``UnsafePathError``
    if ``path`` is a link, a directory, a FIFO or a device. ``O_TRUNC`` is honoured after the check."""
    truncate = bool(flags & os.O_TRUNC)
    flags = (flags & ~os.O_TRUNC) | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, mode)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise UnsafePathError(f"{path}: is a symbolic link; refused (a run folder's files are never "
                                  "followed out of it)") from None
        if err.errno == errno.EISDIR:
            raise UnsafePathError(f"{path}: is a directory, expected a file") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafePathError(f"{path}: is {_kind(info.st_mode)}, expected a regular file; refused")
        os.set_blocking(fd, True)
        if truncate:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_text_inside(path: str | Path, mode: str = "r", encoding: str = "utf-8"):
    """``open(path, mode)`` for "r", "rb", "a", "ab", "w", "wb" through ``open_inside``."""
    flags = {
        "r": os.O_RDONLY,
        "a": os.O_WRONLY | os.O_APPEND | os.O_CREAT,
        "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
    }[mode[0]]
    fd = open_inside(path, flags)
    return os.fdopen(fd, mode, encoding=None if "b" in mode else encoding)


def read_bytes_inside(path: str | Path, limit: int | None = None) -> bytes:
    """The bytes of the regular file ``path`` (not followed if a link); ``UnsafePathError`` past ``limit``."""
    with os.fdopen(open_inside(path, os.O_RDONLY), "rb") as f:
        data = f.read() if limit is None else f.read(limit + 1)
    if limit is not None and len(data) > limit:
        raise UnsafePathError(f"{path}: larger than {limit:,} bytes; refused")
    return data


def check_inside_dir(path: str | Path, must_exist: bool = False) -> bool:
    """True if ``path`` is a real directory, False if it does not exist (``must_exist``: refused);
    ``UnsafePathError`` for a link or anything else."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        if must_exist:
            raise UnsafePathError(f"{path}: does not exist") from None
        return False
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafePathError(f"{path}: is not a directory ({_kind(info.st_mode)}); refused (a run folder's "
                              "entries are never followed out of it)")
    return True


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes, mode: int = 0o644) -> None:
    """Write ``data`` to a fresh temp file beside ``path``, fsync, rename over ``path``; nothing is left on
    any error (a full disk leaves the old ``path`` as it was). A link at ``path`` is replaced, not followed."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


_STREAMS = ("/dev/stdout", "/dev/stderr", "/dev/fd/", "/proc/self/fd/", "/dev/tty")


def writes_in_place(path: str | Path) -> bool:
    """Whether ``write_output`` writes ``path`` in place: an existing FIFO, device or socket (after links),
    or a name for a stream such as ``/dev/stdout``."""
    text = str(path)
    if text.startswith(_STREAMS):
        return True
    try:
        info = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    return not stat.S_ISREG(info.st_mode) and not stat.S_ISDIR(info.st_mode)


def write_output(path: str | Path, data: bytes) -> None:
    """Write a user-named output: in place for a FIFO, a device or ``/dev/stdout`` (appended, so what was
    already printed there stays), otherwise atomically at the link's target (a link the user made stays)."""
    if writes_in_place(path):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return
    target = Path(os.path.realpath(path))
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(target, data)
