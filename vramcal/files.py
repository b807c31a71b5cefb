"""Writing a user's files: atomically (a temp file beside the target, then a rename), never onto the
records database, and with one-line errors when the place cannot be written."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from .errors import UserError


def check_writable(path: str | os.PathLike, flag: str, protect: tuple[str | os.PathLike, ...] = ()) -> Path:
    """Refuse, before any work, a target that is a directory, sits in a folder that does not exist or
    cannot be written, or is one of the ``protect`` files (the records database and its WAL files)."""
    p = Path(path).expanduser()
    for guarded in protect:
        g = Path(guarded).expanduser()
        for candidate in (g, Path(str(g) + "-wal"), Path(str(g) + "-shm"), Path(str(g) + "-journal")):
            with contextlib.suppress(OSError):
                if p.resolve() == candidate.resolve():
                    raise UserError(f"{flag} {p} is the records database: writing there would destroy it; "
                                    "choose another file")
    if p.is_dir():
        raise UserError(f"{flag} {p} is a directory: give a file name")
    if p.is_symlink() or (p.exists() and not p.is_file()):
        # a rename would replace the link or the device node itself (/dev/null, /dev/stdout), not write to it
        raise UserError(f"{flag} {p} is not a regular file (a link, a device or a pipe): give a plain file name")
    if p.is_file() and _is_sqlite(p):
        raise UserError(f"{flag} {p} is an SQLite database (records, perhaps): writing there would destroy it; "
                        "choose another file")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise UserError(f"{flag}: the folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{flag}: cannot write in {parent} (permission denied)")
    if p.exists() and not os.access(p, os.W_OK):
        raise UserError(f"{flag}: {p} is not writable")
    return p


def atomic_write(path: str | os.PathLike, data: bytes | str, flag: str = "--out",
                 protect: tuple[str | os.PathLike, ...] = ()) -> Path:
    """Write ``data`` to ``path`` so that a reader sees the old file or the whole new one, never half."""
    p = check_writable(path, flag, protect)
    mode = "wb" if isinstance(data, bytes) else "w"
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent if str(p.parent) else ".")
    except OSError as exc:
        raise UserError(f"{flag}: cannot write in {p.parent} ({exc.strerror})") from None
    try:
        with os.fdopen(fd, mode) as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if p.exists():
            with contextlib.suppress(OSError):
                os.chmod(tmp, p.stat().st_mode & 0o777)
        else:
            os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, p)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise UserError(f"{flag}: could not write {p} ({exc.strerror}); nothing was changed") from None
    return p


def _is_sqlite(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(16) == b"SQLite format 3\x00"
    except OSError:
        return False


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def read_regular(path: str | os.PathLike, limit: int, what: str, missing: str = "") -> bytes:
    """A user's file, read only if it is a regular file of at most ``limit`` bytes: a FIFO would block
    forever, a device never end, a huge file fill the memory. One-line UserError otherwise (``missing``
    is said after "no WHAT at PATH")."""
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise UserError(f"no {what} at {path}" + (f": {missing}" if missing else "")) from None
    except IsADirectoryError:
        raise UserError(f"{path} is a directory, not a {what}") from None
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise UserError(f"{path} is a directory, not a {what}")
        if not stat.S_ISREG(st.st_mode):
            raise UserError(f"{path} is not a regular file (a pipe, a socket or a device): give a {what}")
        if st.st_size > limit:
            raise UserError(f"{path} is {st.st_size:,} bytes, more than any {what} ({limit:,}): give a {what}")
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read(limit + 1)
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > limit:  # it grew while being read
        raise UserError(f"{path} is more than any {what} ({limit:,} bytes): give a {what}")
    return data
