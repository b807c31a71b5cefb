"""Writing a file the user owns: atomically, and never onto the records database."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable, Iterable

from ..errors import UserError

SQLITE_COMPANIONS = ("", "-wal", "-shm", "-journal")


def protected_paths(db_path: str | os.PathLike | None) -> list[Path]:
    """The records database file and the files SQLite keeps beside it."""
    if db_path is None:
        return []
    return [Path(f"{db_path}{suffix}") for suffix in SQLITE_COMPANIONS]


def _same_file(a: Path, b: Path) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def check_target(out: str | os.PathLike, *, protect: Iterable[Path] = (), what: str = "file") -> Path:
    """Refuse to write onto the records database or a directory (before any work is done)."""
    target = Path(out)
    for p in protect:
        if _same_file(target, p):
            raise UserError(f"{target} is the records database (or one of its files): refusing to write the "
                            f"{what} over it; choose another --out")
    if target.is_dir():
        raise UserError(f"{target} is a directory: give a file name for the {what}, e.g. {target / 'runs.csv'}")
    return target


def write_atomic(out: str | os.PathLike, write: Callable[[str], None], *, protect: Iterable[Path] = (),
                 what: str = "file") -> Path:
    """Write ``out`` through ``write(temp_path)``: a temporary file in the same folder, flushed to disk,
    then renamed over ``out`` in one step (a reader sees the old file or the new one, never half of
    one). Refuses a directory and any of ``protect`` (the records database); an unwritable place is one
    line of UserError and leaves ``out`` as it was."""
    target = check_target(out, protect=protect, what=what)
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.is_dir():
        raise UserError(f"cannot write {target}: the folder {parent} does not exist; create it or choose another "
                        "--out")
    try:
        fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as exc:
        raise UserError(f"cannot write {target}: {exc.strerror or exc} in {parent}; choose another --out") from None
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        try:
            mode = target.stat().st_mode & 0o7777
        except FileNotFoundError:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except OSError as exc:
        raise UserError(f"cannot write {target}: {exc.strerror or exc}; it was left as it was: choose another "
                        "--out") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
