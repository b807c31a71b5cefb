"""A records database in a bad state, or a bad place to write to: one line, exit 2, and the database
file byte-for-byte as it was (sha256). Read-only commands open it read-only and need no write lock.

Permissions mean nothing to root, so the permission cases run their command without the
``CAP_DAC_OVERRIDE`` capability (``setpriv``) when the tests run as root."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import context, outcome

from vramcal.errors import UserError
from vramcal.records.store import Store

FP = {"kind": "cpu", "torch": "2.13.0", "transformers": "5.24.0", "hostname": "h", "cpu_model": "x",
      "total_bytes": 1 << 34}
_DROP = "-dac_override,-dac_read_search,-fowner"


def _digest(p) -> str:
    return hashlib.sha256(Path(p).read_bytes()).hexdigest()


def _unprivileged(cmd: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return cmd
    if not shutil.which("setpriv"):
        pytest.skip("running as root without setpriv: file permissions cannot be tested")
    return ["setpriv", f"--inh-caps={_DROP}", f"--bounding-set={_DROP}", "--", *cmd]


def _cli(*args: str, unprivileged: bool = False, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "vramcal", *args]
    return subprocess.run(_unprivileged(cmd) if unprivileged else cmd, capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


_WRITE = ("import sys\nfrom vramcal.errors import UserError\nfrom vramcal.records.store import Store\n"
          "try:\n    Store(sys.argv[1], timeout_s=float(sys.argv[2])).machine_id({'kind': 'cpu', 'hostname': 'w'})\n"
          "except UserError as exc:\n    print(f'vramcal: {exc}', file=sys.stderr)\n    sys.exit(2)\n")


def _write_attempt(db, unprivileged: bool = False, timeout_s: float = 5) -> subprocess.CompletedProcess:
    """What a recording command does first (record this machine), in a process of its own."""
    cmd = [sys.executable, "-c", _WRITE, str(db), str(timeout_s)]
    return subprocess.run(_unprivileged(cmd) if unprivileged else cmd, capture_output=True, text=True)


def _one_line(r: subprocess.CompletedProcess, needle: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr and needle in r.stderr, r.stderr


@pytest.fixture
def filled(tmp_path) -> Path:
    """A closed database with 60 runs and their samples: many pages, no -wal or -shm left."""
    p = tmp_path / "records.db"
    with Store(p) as s:
        mid = s.machine_id(FP)
        for i in range(60):
            rid = s.begin_run(mid, context(model=f"m{i}", config_hash="c", estimate={"i": i}))
            s.finish_run(rid, outcome("ok", [{"stage": "end", "estimated_bytes": 1, "measured_peak_bytes": 2}],
                                      [(0.01 * k, "rss", k) for k in range(40)]))
    assert not Path(f"{p}-wal").exists()
    return p


def test_corrupt_database(filled):
    size = filled.stat().st_size
    with open(filled, "r+b") as fh:  # garbage over the middle pages; the header is intact
        fh.seek(size // 3)
        fh.write(os.urandom(size // 3))
    before = _digest(filled)
    _one_line(_cli("records", "list", "--db", str(filled)), "damaged")
    _one_line(_cli("records", "export", "--db", str(filled), "--format", "csv"), "damaged")
    _one_line(_write_attempt(filled), "damaged")
    assert _digest(filled) == before


def test_truncated_database(filled):
    with open(filled, "r+b") as fh:
        fh.truncate(filled.stat().st_size // 2 + 100)
    before = _digest(filled)
    _one_line(_cli("records", "list", "--db", str(filled)), "truncated")
    _one_line(_write_attempt(filled), "truncated")
    assert _digest(filled) == before


def test_a_directory_as_db(tmp_path):
    _one_line(_cli("records", "list", "--db", str(tmp_path)), "is a directory")
    _one_line(_write_attempt(tmp_path), "is a directory")
    assert list(tmp_path.iterdir()) == []


def test_locked_past_a_bounded_wait(filled):
    """Another process holds the write lock: a writer gives up after its bounded wait with one line;
    reading needs no write lock and goes on meanwhile."""
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sqlite3, sys, time\n"
        "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
        "c.execute('BEGIN IMMEDIATE')\nprint('locked', flush=True)\ntime.sleep(60)\n"), str(filled)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = _digest(filled)
        start = time.monotonic()
        r = _write_attempt(filled, timeout_s=1.5)
        waited = time.monotonic() - start
        _one_line(r, "stayed locked")
        assert waited < 15, waited  # bounded: 1.5 s of waiting plus a Python start-up
        listed = _cli("records", "list", "--db", str(filled), env={"VRAMCAL_DB_TIMEOUT": "1"})
        assert listed.returncode == 0 and len(listed.stdout.splitlines()) == 61, listed.stderr
        with pytest.raises(UserError, match="stayed locked"):
            with Store(filled, timeout_s=0.5) as s:
                s.machine_id(FP)
        assert _digest(filled) == before
    finally:
        holder.kill()
        holder.wait()


def test_read_only_file(filled):
    filled.chmod(0o444)
    before = _digest(filled)
    listed = _cli("records", "list", "--db", str(filled), unprivileged=True)
    assert listed.returncode == 0 and len(listed.stdout.splitlines()) == 61, listed.stderr
    _one_line(_write_attempt(filled, unprivileged=True), "read-only")
    assert _digest(filled) == before


def test_read_only_folder(filled, tmp_path):
    """WAL needs a -shm file beside the database; in a folder nobody may write, a reader reads the
    (fully checkpointed) file as immutable, and a writer is told in one line."""
    out = tmp_path / "out"
    out.mkdir()
    before = _digest(filled)
    filled.parent.chmod(0o555)
    try:
        listed = _cli("records", "list", "--db", str(filled), unprivileged=True)
        assert listed.returncode == 0 and len(listed.stdout.splitlines()) == 61, listed.stderr
        memo = _cli("memo", "--db", str(filled), unprivileged=True)
        _one_line(memo, "no memo recorded yet")  # read, and said so: not a failure to open
        _one_line(_write_attempt(filled, unprivileged=True), "and its folder")
        assert sorted(p.name for p in filled.parent.iterdir()) == ["out", "records.db"]
    finally:
        filled.parent.chmod(0o755)
    assert _digest(filled) == before


# ------------------------------------------------------------------------------------------ export

def test_export_refuses_the_database_itself(filled):
    before = _digest(filled)
    for target in (filled, Path(f"{filled}-wal"), Path(f"{filled}-shm")):
        _one_line(_cli("records", "export", "--format", "csv", "--out", str(target), "--db", str(filled)),
                  "records database")
    link = filled.parent / "link.csv"
    link.symlink_to(filled)
    _one_line(_cli("records", "export", "--format", "csv", "--out", str(link), "--db", str(filled)),
              "records database")
    wal = Path(f"{filled}-wal")  # a reader may leave an empty one; nothing was written into it
    assert _digest(filled) == before and (not wal.exists() or wal.stat().st_size == 0)


def test_export_to_a_directory_or_nowhere(filled, tmp_path):
    _one_line(_cli("records", "export", "--format", "csv", "--out", str(tmp_path), "--db", str(filled)),
              "is a directory")
    _one_line(_cli("records", "export", "--format", "json", "--out", str(tmp_path / "no" / "such" / "x.json"),
                   "--db", str(filled)), "does not exist")


def test_export_unwritable_place_keeps_the_old_file(filled, tmp_path):
    folder = tmp_path / "exports"
    folder.mkdir()
    old = folder / "runs.csv"
    old.write_text("the previous export\n")
    folder.chmod(0o555)
    try:
        r = _cli("records", "export", "--format", "csv", "--out", str(old), "--db", str(filled), unprivileged=True)
        _one_line(r, "cannot write")
    finally:
        folder.chmod(0o755)
    assert old.read_text() == "the previous export\n" and sorted(os.listdir(folder)) == ["runs.csv"]


def test_export_replaces_atomically(filled, tmp_path):
    out = tmp_path / "runs.csv"
    out.write_text("old\n")
    out.chmod(0o640)
    r = _cli("records", "export", "--format", "csv", "--out", str(out), "--db", str(filled))
    assert r.returncode == 0, r.stderr
    assert len(out.read_text().splitlines()) == 61 and (out.stat().st_mode & 0o777) == 0o640
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file left


def test_export_never_replaces_a_device_a_link_or_another_database(tmp_path):
    import os
    import subprocess
    import sys

    from vramcal.records.store import Store

    db = tmp_path / "r.db"
    Store(db).close()
    other = tmp_path / "other.db"
    Store(other).close()
    link = tmp_path / "link.csv"
    link.symlink_to(tmp_path / "target.csv")
    for out, needle in (("/dev/null", "not a regular file"), (str(link), "not a regular file"),
                        (str(other), "is an SQLite database")):
        before = os.stat(out, follow_symlinks=False)
        r = subprocess.run([sys.executable, "-m", "vramcal", "records", "export", "--db", str(db), "--out", out],
                           capture_output=True, text=True)
        assert r.returncode == 2 and needle in r.stderr, (out, r.stderr)
        after = os.stat(out, follow_symlinks=False)
        assert (before.st_mode, before.st_ino, before.st_size) == (after.st_mode, after.st_ino, after.st_size)


def test_pull_from_a_source_damaged_inside_creates_nothing(tmp_path):
    """The source is read whole before the destination is opened: a damaged page gives one line, exit 2,
    and no empty destination database is left behind."""
    import sqlite3
    import subprocess
    import sys

    from vramcal.records.store import Store

    src, dst = tmp_path / "src.db", tmp_path / "new.db"
    fp = {"kind": "cpu", "torch": "t", "hostname": "h", "total_bytes": 1 << 34}
    with Store(src) as s:
        mid = s.machine_id(fp)
        for i in range(5):
            rid = s.begin_run(mid, context(model=f"m{i}", config_hash="c", ctx=100, command="x"))
            s.finish_run(rid, outcome("ok", samples=[(0.1, "rss", 1000)], series="rss"))
    c = sqlite3.connect(src)
    c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    machines_page = dict(c.execute("SELECT name, rootpage FROM sqlite_master WHERE type = 'table'"))["machines"]
    c.close()
    with open(src, "r+b") as fh:  # the machines table's page, damaged past its header
        fh.seek((machines_page - 1) * 4096 + 8)
        fh.write(b"\xff" * 40)
    r = subprocess.run([sys.executable, "-m", "vramcal", "records", "pull", "--from", str(src), "--db", str(dst)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "damaged" in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    assert not dst.exists()
