"""A real PostgreSQL server for the tests: ``initdb`` + ``pg_ctl`` into a temporary folder, on a free
port of 127.0.0.1 (password login, scram-sha-256) and a unix socket in that folder; stopped and removed
at the end of the session. Run as the ``postgres`` user when the tests run as root (the server refuses
root). No mock anywhere: the store talks to this server through psycopg like it would to a fleet's.

Import the fixtures into a test module: ``from pg_server import pg_server, pg_url  # noqa: F401``.
"""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time

import pytest


def pg_bindir() -> str | None:
    env = os.environ.get("VRAMCAL_PG_BIN")
    candidates = [env] if env else []
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]), reverse=True)
    if shutil.which("pg_config"):
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True).stdout.strip()
        if out:
            candidates.append(out)
    for c in candidates:
        if c and os.path.exists(os.path.join(c, "initdb")) and os.path.exists(os.path.join(c, "pg_ctl")):
            return c
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgServer:
    def __init__(self, bindir: str):
        self.bindir = bindir
        self.root = tempfile.mkdtemp(prefix="vramcal-pg-")
        self.data = os.path.join(self.root, "data")
        self.log = os.path.join(self.root, "server.log")
        self.port = _free_port()
        self.password = "pw-" + secrets.token_hex(8)
        self.as_root = os.geteuid() == 0
        os.chmod(self.root, 0o755)
        if self.as_root:
            shutil.chown(self.root, "postgres", "postgres")
        pwfile = os.path.join(self.root, "pwfile")
        with open(pwfile, "w") as fh:
            fh.write(self.password + "\n")
        if self.as_root:
            shutil.chown(pwfile, "postgres", "postgres")
        self._run("initdb", "-D", self.data, "-U", "postgres", "--auth-local=trust", "--auth-host=scram-sha-256",
                  f"--pwfile={pwfile}", "-E", "UTF8", "--no-sync", "--no-instructions")
        self._counter = 0

    def _run(self, tool: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        cmd = [os.path.join(self.bindir, tool), *args]
        if self.as_root:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=self.root)
        if check and r.returncode != 0:
            raise RuntimeError(f"{tool} failed: {r.stdout}\n{r.stderr}")
        return r

    def start(self) -> None:
        opts = (f"-k {self.root} -p {self.port} -c listen_addresses=127.0.0.1 -c fsync=off "
                "-c full_page_writes=off -c max_connections=120 -c shared_buffers=64MB")
        self._run("pg_ctl", "-D", self.data, "-l", self.log, "-w", "-t", "60", "-o", opts, "start")

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", self.data, "-m", mode, "-w", "-t", "60", "stop", check=False)

    def running(self) -> bool:
        return self._run("pg_ctl", "-D", self.data, "status", check=False).returncode == 0

    def url(self, dbname: str = "postgres", user: str = "postgres", password: str | None = None) -> str:
        pw = self.password if password is None and user == "postgres" else password
        auth = f"{user}:{pw}" if pw else user
        return f"postgresql://{auth}@127.0.0.1:{self.port}/{dbname}?sslmode=disable"

    def create_database(self, prefix: str = "t") -> str:
        import psycopg

        self._counter += 1
        name = f"{prefix}_{os.getpid()}_{self._counter}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return name

    def cleanup(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_server():
    bindir = pg_bindir()
    if bindir is None:
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) not found: apt-get install postgresql, "
                    "or set VRAMCAL_PG_BIN")
    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.skip("psycopg is not installed: pip install 'vramcal[postgres]'")
    server = PgServer(bindir)
    server.start()
    yield server
    server.cleanup()


@pytest.fixture
def pg_url(pg_server) -> str:
    """A fresh, empty database on the test server, as a URL with the superuser's password."""
    if not pg_server.running():
        pg_server.start()
    return pg_server.url(pg_server.create_database())


def wait_until(predicate, timeout: float = 30.0, step: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(step)
    return predicate()
