"""The records database: machines, runs, their stage readings and samples, memos, corrections.

SQLite (stdlib), one file: ``--db PATH``, else ``$VRAMCAL_DB``, else ``$XDG_DATA_HOME/vramcal/vramcal.db``
(``~/.local/share/vramcal/vramcal.db``). WAL mode, a busy timeout and ``BEGIN IMMEDIATE`` writes, so
many processes can append at once.

Records are append-only. A run is written in two appends: its context (``runs``) before the probe
starts, its outcome (``results``) when it ends. A run with no result was interrupted; a result with a
status other than ``ok`` is a partial record of a run that stopped (``oom``, ``crashed``, ``error``).
Nothing is ever updated or deleted.

The file carries ``PRAGMA application_id`` (vramcal's) and ``PRAGMA user_version`` (the schema).
On open: a file that is not a vramcal database, or one from a newer vramcal, is refused and left
untouched; an older schema is upgraded in one transaction, keeping every row.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from pathlib import Path

from ..errors import UserError

APPLICATION_ID = 0x5652_4D43  # "VRMC"
SCHEMA_VERSION = 3

# Each entry upgrades the schema from version i to i + 1 (index i). Never edit a shipped migration.
MIGRATIONS: list[str] = [
    # 0 -> 1: the first schema
    """
    CREATE TABLE machines (
        id INTEGER PRIMARY KEY,
        fingerprint TEXT NOT NULL UNIQUE,
        kind TEXT NOT NULL,
        gpu_name TEXT, gpu_uuid TEXT, total_bytes INTEGER, driver TEXT, cuda_runtime TEXT,
        torch TEXT, transformers TEXT, bitsandbytes TEXT, accelerate TEXT,
        hostname TEXT, cpu_model TEXT,
        created_at REAL NOT NULL
    );
    CREATE TABLE runs (
        id INTEGER PRIMARY KEY,
        machine_id INTEGER NOT NULL REFERENCES machines(id),
        created_at REAL NOT NULL,
        model TEXT NOT NULL, config_hash TEXT, quant TEXT NOT NULL, quant_impl TEXT, dtype TEXT,
        ctx INTEGER NOT NULL, batch INTEGER NOT NULL, kv_dtype TEXT, attn TEXT, device TEXT NOT NULL,
        command TEXT NOT NULL,
        estimate_json TEXT
    );
    CREATE TABLE results (
        run_id INTEGER PRIMARY KEY REFERENCES runs(id),
        finished_at REAL NOT NULL,
        status TEXT NOT NULL,
        last_stage TEXT, error TEXT, oom_json TEXT,
        series TEXT, wall_s REAL, sampler_overhead REAL,
        result_json TEXT NOT NULL
    );
    CREATE TABLE stages (
        run_id INTEGER NOT NULL REFERENCES runs(id),
        stage TEXT NOT NULL,
        estimated_bytes INTEGER, measured_peak_bytes INTEGER, measured_used_bytes INTEGER,
        torch_max_allocated INTEGER, torch_max_reserved INTEGER,
        PRIMARY KEY (run_id, stage)
    );
    CREATE TABLE samples (
        run_id INTEGER NOT NULL REFERENCES runs(id),
        t REAL NOT NULL,
        series TEXT NOT NULL,
        bytes INTEGER
    );
    CREATE TABLE memos (
        id INTEGER PRIMARY KEY,
        run_id INTEGER NOT NULL REFERENCES runs(id),
        created_at REAL NOT NULL,
        memo_json TEXT NOT NULL
    );
    CREATE INDEX runs_machine ON runs(machine_id, model, quant);
    CREATE INDEX samples_run ON samples(run_id);
    """,
    # 1 -> 2: corrections fitted per machine and software stack
    """
    CREATE TABLE corrections (
        id INTEGER PRIMARY KEY,
        machine_id INTEGER NOT NULL REFERENCES machines(id),
        created_at REAL NOT NULL,
        stack TEXT NOT NULL,
        stage TEXT NOT NULL,
        intercept_bytes INTEGER NOT NULL,
        slope_bytes_per_token REAL NOT NULL,
        n_runs INTEGER NOT NULL,
        residual_p50_bytes INTEGER, residual_p95_bytes INTEGER,
        source_runs_json TEXT NOT NULL
    );
    CREATE INDEX corrections_lookup ON corrections(machine_id, stack, stage, id);
    """,
    # 2 -> 3: stage readings per device of a run split across devices (--max-memory / --device-map). A
    # single-device run has none: its rows stay in ``stages``, read as before.
    """
    CREATE TABLE device_stages (
        run_id INTEGER NOT NULL REFERENCES runs(id),
        device TEXT NOT NULL,
        stage TEXT NOT NULL,
        estimated_bytes INTEGER, measured_peak_bytes INTEGER, measured_used_bytes INTEGER,
        PRIMARY KEY (run_id, device, stage)
    );
    """,
]
assert len(MIGRATIONS) == SCHEMA_VERSION


def default_path() -> Path:
    if os.environ.get("VRAMCAL_DB"):
        return Path(os.environ["VRAMCAL_DB"])
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "vramcal" / "vramcal.db"


class Store:
    """One open database. Use as a context manager or call :meth:`close`."""

    def __init__(self, path: str | os.PathLike | None = None, create: bool = True, readonly: bool = False):
        self.path = Path(path) if path else default_path()
        if not create and not self.path.exists():
            raise UserError(f"no records database at {self.path}: `vramcal check MODEL ...` records the first run "
                            "(or pass --db / set VRAMCAL_DB)")
        self._refuse_foreign_file()
        self.readonly = readonly
        if readonly:
            self.conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=60.0, isolation_level=None)
            self.conn.row_factory = sqlite3.Row
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.conn = sqlite3.connect(self.path, timeout=60.0, isolation_level=None)
        self.conn.row_factory = sqlite3.Row
        self.conn.execute("PRAGMA busy_timeout = 60000")
        try:
            self._check_and_migrate()
        except Exception:
            self.conn.close()
            raise
        self.conn.execute("PRAGMA journal_mode = WAL")
        self.conn.execute("PRAGMA foreign_keys = ON")

    # ------------------------------------------------------------------------- opening
    def _refuse_foreign_file(self) -> None:
        if not self.path.exists() or self.path.stat().st_size == 0:
            return
        with open(self.path, "rb") as fh:
            head = fh.read(100)
        if not head.startswith(b"SQLite format 3\x00"):
            raise UserError(f"{self.path} is not a vramcal database (not SQLite); it was left untouched: "
                            "pass another --db or set VRAMCAL_DB")
        app_id = int.from_bytes(head[68:72], "big")
        user_version = int.from_bytes(head[60:64], "big")
        if app_id != APPLICATION_ID and not (app_id == 0 and user_version == 0 and self._empty_sqlite()):
            raise UserError(f"{self.path} is an SQLite file of another program; it was left untouched: "
                            "pass another --db or set VRAMCAL_DB")
        if user_version > SCHEMA_VERSION:
            raise UserError(f"{self.path} has schema {user_version}, newer than this vramcal's {SCHEMA_VERSION}; "
                            "it was left untouched: upgrade vramcal (pip install -U vramcal)")

    def _empty_sqlite(self) -> bool:
        conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True)
        try:
            return conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] == 0
        finally:
            conn.close()

    def _check_and_migrate(self) -> None:
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            version = self.conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:  # raced with a newer vramcal
                raise UserError(f"{self.path} has schema {version}, newer than this vramcal's {SCHEMA_VERSION}; "
                                "upgrade vramcal")
            for step in range(version, SCHEMA_VERSION):
                for statement in MIGRATIONS[step].split(";"):
                    if statement.strip():
                        self.conn.execute(statement)
            if version < SCHEMA_VERSION:
                self.conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
                self.conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            self.conn.execute("COMMIT")
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise

    def close(self) -> None:
        self.conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------------- writing
    def _write(self, fn):
        """Run ``fn(conn)`` in one immediate transaction, retrying while another writer holds the lock."""
        delay = 0.01
        for attempt in range(200):
            try:
                self.conn.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as exc:
                if "locked" in str(exc) or "busy" in str(exc):
                    time.sleep(delay)
                    delay = min(delay * 2, 0.5)
                    continue
                raise
            try:
                out = fn(self.conn)
                self.conn.execute("COMMIT")
                return out
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise
        raise UserError(f"{self.path} stayed locked by other writers: try again, or use another --db")

    @staticmethod
    def _fingerprint_key(fingerprint: dict) -> str:
        return json.dumps({k: fingerprint.get(k) for k in sorted(fingerprint) if k != "created_at"}, sort_keys=True)

    def find_machine(self, fingerprint: dict) -> int | None:
        """The id of a recorded machine, without recording anything."""
        row = self.conn.execute("SELECT id FROM machines WHERE fingerprint = ?",
                                (self._fingerprint_key(fingerprint),)).fetchone()
        return row[0] if row else None

    def machine_id(self, fingerprint: dict) -> int:
        key = self._fingerprint_key(fingerprint)
        cols = ("kind", "gpu_name", "gpu_uuid", "total_bytes", "driver", "cuda_runtime", "torch", "transformers",
                "bitsandbytes", "accelerate", "hostname", "cpu_model")

        def fn(conn):
            row = conn.execute("SELECT id FROM machines WHERE fingerprint = ?", (key,)).fetchone()
            if row:
                return row[0]
            cur = conn.execute(
                f"INSERT INTO machines (fingerprint, created_at, {', '.join(cols)}) VALUES (?, ?, {', '.join('?' * len(cols))})",
                (key, time.time(), *[fingerprint.get(c) for c in cols]))
            return cur.lastrowid

        return self._write(fn)

    def begin_run(self, machine_id: int, *, model: str, config_hash: str | None, quant: str, quant_impl: str | None,
                  dtype: str | None, ctx: int, batch: int, kv_dtype: str | None, attn: str | None, device: str,
                  command: str, estimate: dict | None) -> int:
        def fn(conn):
            return conn.execute(
                "INSERT INTO runs (machine_id, created_at, model, config_hash, quant, quant_impl, dtype, ctx, batch, "
                "kv_dtype, attn, device, command, estimate_json) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (machine_id, time.time(), model, config_hash, quant, quant_impl, dtype, ctx, batch, kv_dtype, attn,
                 device, command, json.dumps(estimate) if estimate is not None else None)).lastrowid

        return self._write(fn)

    def finish_run(self, run_id: int, result: dict, stage_rows: list[dict], samples: list[tuple[float, str, int]]):
        def fn(conn):
            conn.execute(
                "INSERT INTO results (run_id, finished_at, status, last_stage, error, oom_json, series, wall_s, "
                "sampler_overhead, result_json) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (run_id, time.time(), result["status"], result.get("last_stage"), result.get("error"),
                 json.dumps(result.get("oom")) if result.get("oom") else None, result.get("series"),
                 result.get("wall_s"), result.get("sampler_overhead"), json.dumps(result)))
            conn.executemany(
                "INSERT INTO stages (run_id, stage, estimated_bytes, measured_peak_bytes, measured_used_bytes, "
                "torch_max_allocated, torch_max_reserved) VALUES (?,?,?,?,?,?,?)",
                [(run_id, r["stage"], r.get("estimated_bytes"), r.get("measured_peak_bytes"),
                  r.get("measured_used_bytes"), r.get("torch_max_allocated"), r.get("torch_max_reserved"))
                 for r in stage_rows])
            conn.executemany("INSERT INTO samples (run_id, t, series, bytes) VALUES (?,?,?,?)",
                             [(run_id, t, s, b) for t, s, b in samples])

        self._write(fn)

    def add_device_stages(self, run_id: int, rows: list[dict]) -> None:
        """Per-device stage rows of a placed run: {device, stage, estimated_bytes, measured_peak_bytes,
        measured_used_bytes}."""
        if not rows:
            return
        self._write(lambda conn: conn.executemany(
            "INSERT INTO device_stages (run_id, device, stage, estimated_bytes, measured_peak_bytes, "
            "measured_used_bytes) VALUES (?,?,?,?,?,?)",
            [(run_id, r["device"], r["stage"], r.get("estimated_bytes"), r.get("measured_peak_bytes"),
              r.get("measured_used_bytes")) for r in rows]))

    def add_memo(self, run_id: int, memo: dict) -> int:
        return self._write(lambda conn: conn.execute(
            "INSERT INTO memos (run_id, created_at, memo_json) VALUES (?,?,?)",
            (run_id, time.time(), json.dumps(memo))).lastrowid)

    def add_corrections(self, machine_id: int, stack: str, rows: list[dict]) -> None:
        def fn(conn):
            conn.executemany(
                "INSERT INTO corrections (machine_id, created_at, stack, stage, intercept_bytes, slope_bytes_per_token,"
                " n_runs, residual_p50_bytes, residual_p95_bytes, source_runs_json) VALUES (?,?,?,?,?,?,?,?,?,?)",
                [(machine_id, time.time(), stack, r["stage"], int(r["intercept_bytes"]),
                  float(r["slope_bytes_per_token"]), r["n_runs"], r.get("residual_p50_bytes"),
                  r.get("residual_p95_bytes"), json.dumps(r["source_runs"])) for r in rows])

        self._write(fn)

    # ------------------------------------------------------------------------- reading
    def runs(self, machine_id: int | None = None, model: str | None = None, limit: int | None = None) -> list[dict]:
        q = ("SELECT r.*, s.status, s.last_stage, s.error, s.result_json, s.finished_at FROM runs r "
             "LEFT JOIN results s ON s.run_id = r.id WHERE 1=1")
        args: list = []
        if machine_id is not None:
            q += " AND r.machine_id = ?"
            args.append(machine_id)
        if model is not None:
            q += " AND r.model = ?"
            args.append(model)
        q += " ORDER BY r.id"
        if limit:
            q += f" LIMIT {int(limit)}"
        return [dict(row) for row in self.conn.execute(q, args)]

    def run(self, run_id: int) -> dict | None:
        row = self.conn.execute(
            "SELECT r.*, s.status, s.last_stage, s.error, s.result_json, s.finished_at, m.gpu_name, m.total_bytes, "
            "m.kind AS machine_kind, m.hostname, m.cpu_model FROM runs r LEFT JOIN results s ON s.run_id = r.id "
            "JOIN machines m ON m.id = r.machine_id WHERE r.id = ?", (run_id,)).fetchone()
        if row is None:
            return None
        out = dict(row)
        out["stages"] = {s["stage"]: dict(s) for s in self.conn.execute(
            "SELECT * FROM stages WHERE run_id = ? ORDER BY rowid", (run_id,))}
        out["device_stages"] = [dict(s) for s in self.conn.execute(
            "SELECT * FROM device_stages WHERE run_id = ? ORDER BY rowid", (run_id,))]
        out["sample_count"] = self.conn.execute("SELECT count(*) FROM samples WHERE run_id = ?",
                                                (run_id,)).fetchone()[0]
        return out

    def stage_rows(self, machine_id: int) -> list[dict]:
        return [dict(r) for r in self.conn.execute(
            "SELECT st.*, r.ctx, r.batch, r.model, r.config_hash, r.quant, r.device, s.status FROM stages st "
            "JOIN runs r ON r.id = st.run_id JOIN results s ON s.run_id = r.id WHERE r.machine_id = ? "
            "ORDER BY st.run_id", (machine_id,))]

    def device_stage_rows(self, machine_id: int) -> list[dict]:
        """:meth:`stage_rows` of placed runs, one row per device and stage (``device`` says which)."""
        return [dict(r) for r in self.conn.execute(
            "SELECT st.*, r.ctx, r.batch, r.model, r.config_hash, r.quant, s.status FROM device_stages st "
            "JOIN runs r ON r.id = st.run_id JOIN results s ON s.run_id = r.id WHERE r.machine_id = ? "
            "ORDER BY st.run_id", (machine_id,))]

    def latest_corrections(self, machine_id: int, stack: str) -> dict[str, dict]:
        out = {}
        for row in self.conn.execute(
                "SELECT * FROM corrections WHERE machine_id = ? AND stack = ? ORDER BY id", (machine_id, stack)):
            d = dict(row)
            d["source_runs"] = json.loads(d.pop("source_runs_json"))
            out[d["stage"]] = d
        return out

    def memos(self) -> list[dict]:
        return [{**dict(r), "memo": json.loads(r["memo_json"])} for r in
                self.conn.execute("SELECT * FROM memos ORDER BY id")]

    def machines(self) -> list[dict]:
        return [dict(r) for r in self.conn.execute("SELECT * FROM machines ORDER BY id")]
