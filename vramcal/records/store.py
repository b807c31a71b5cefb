"""The records database: machines, runs, their stage readings and samples, memos, corrections.

One interface, two engines (``vramcal.records.engines``): ``--db PATH`` (else ``$VRAMCAL_DB``, else
``$XDG_DATA_HOME/vramcal/vramcal.db``, i.e. ``~/.local/share/vramcal/vramcal.db``) is an SQLite file;
``--db postgresql://USER@HOST/DB`` is a PostgreSQL database shared by a fleet of machines.

Records are append-only. A run is written in two appends: its context (``runs``) before the probe
starts, its outcome (``results`` with its ``stages`` and ``samples``, in one transaction) when it
ends. A run with no result was interrupted; a result with a status other than ``ok`` is a partial
record of a run that stopped (``oom``, ``crashed``, ``error``). Nothing is ever updated or deleted, and
since schema 3 the database itself refuses it (triggers; on PostgreSQL also the writer role's grants).

Every write is idempotent, so a retry after a dropped connection adds nothing twice: a run carries a
client-generated ``uuid`` (the integer ``id`` users see is the database's own), a result belongs to its
run, a memo and a correction carry a ``uuid`` too, a machine is its fingerprint.

The schema version is SQLite's ``PRAGMA user_version`` (with vramcal's ``application_id``) or the
``vramcal.meta`` table on PostgreSQL. On open: a database that is not vramcal's, or one from a newer
vramcal, is refused and left untouched; an older schema is upgraded in one transaction, keeping every
row. A store opened ``readonly=True`` (listing, showing, exporting, memos) never takes the write lock.
"""

from __future__ import annotations

import json
import os
import time
import uuid as _uuid
from pathlib import Path
from typing import Any, Callable

from ..errors import UserError
from .engines import APPLICATION_ID, Engine, NoRecords, is_url, open_engine, redact  # noqa: F401 (re-exported)
from .machines import class_key

SCHEMA_VERSION = 4

RUN_FIELDS = ("model", "config_hash", "quant", "quant_impl", "dtype", "ctx", "batch", "kv_dtype", "attn", "device",
              "command")
MACHINE_FIELDS = ("kind", "gpu_name", "gpu_uuid", "total_bytes", "driver", "cuda_runtime", "torch", "transformers",
                  "bitsandbytes", "accelerate", "hostname", "cpu_model")
RESULT_FIELDS = ("finished_at", "status", "last_stage", "error", "oom_json", "series", "wall_s", "sampler_overhead",
                 "result_json")
STAGE_FIELDS = ("stage", "estimated_bytes", "measured_peak_bytes", "measured_used_bytes", "torch_max_allocated",
                "torch_max_reserved")
CORRECTION_FIELDS = ("stage", "intercept_bytes", "slope_bytes_per_token", "n_runs", "residual_p50_bytes",
                     "residual_p95_bytes")


def new_uuid() -> str:
    return str(_uuid.uuid4())


def _v3(tx, engine: Engine) -> None:
    """2 -> 3: client-generated ids (runs, memos, corrections), the machine class, the stages' order,
    and append-only enforced by the database."""
    for statement in ("ALTER TABLE runs ADD COLUMN uuid TEXT", "ALTER TABLE memos ADD COLUMN uuid TEXT",
                      "ALTER TABLE corrections ADD COLUMN uuid TEXT", "ALTER TABLE machines ADD COLUMN class_key TEXT",
                      "ALTER TABLE stages ADD COLUMN seq INTEGER"):
        tx.execute(engine.ddl(statement))
    for table in ("runs", "memos", "corrections"):
        ids = [r["id"] for r in tx.execute(f"SELECT id FROM {table} WHERE uuid IS NULL ORDER BY id")]
        tx.executemany(f"UPDATE {table} SET uuid = ? WHERE id = ?", [(new_uuid(), i) for i in ids])
    machines = tx.execute("SELECT * FROM machines WHERE class_key IS NULL ORDER BY id")
    tx.executemany("UPDATE machines SET class_key = ? WHERE id = ?", [(class_key(m), m["id"]) for m in machines])
    engine.backfill_stage_order(tx)
    for statement in ("CREATE UNIQUE INDEX runs_uuid ON runs(uuid)", "CREATE UNIQUE INDEX memos_uuid ON memos(uuid)",
                      "CREATE UNIQUE INDEX corrections_uuid ON corrections(uuid)",
                      "CREATE INDEX machines_class ON machines(class_key)",
                      *engine.append_only_ddl()):
        tx.execute(statement)


def _v4(tx, engine: Engine) -> None:
    """3 -> 4: stage readings per device of a run split across devices (--max-memory / --device-map),
    append-only like the rest. A single-device run has none: its rows stay in ``stages``, read as before."""
    tx.execute(engine.ddl("""
    CREATE TABLE device_stages (
        run_id INTEGER NOT NULL REFERENCES runs(id),
        device TEXT NOT NULL,
        stage TEXT NOT NULL,
        estimated_bytes INTEGER, measured_peak_bytes INTEGER, measured_used_bytes INTEGER,
        PRIMARY KEY (run_id, device, stage)
    )"""))
    for statement in engine.append_only_ddl(("device_stages",)):
        tx.execute(statement)


# Each entry upgrades the schema from version i to i + 1 (index i): SQL in SQLite's words (the
# PostgreSQL engine translates the types, ``Engine.ddl``) or a function of (transaction, engine).
# Never edit a shipped migration.
MIGRATIONS: list[str | Callable] = [
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
    # 2 -> 3
    _v3,
    # 3 -> 4
    _v4,
]
assert len(MIGRATIONS) == SCHEMA_VERSION


def default_path() -> Path:
    """The SQLite file used when neither ``--db`` nor ``$VRAMCAL_DB`` names a database."""
    if os.environ.get("VRAMCAL_DB") and not is_url(os.environ["VRAMCAL_DB"]):
        return Path(os.environ["VRAMCAL_DB"])
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "vramcal" / "vramcal.db"


def default_db() -> str:
    """``$VRAMCAL_DB`` (a path or a ``postgresql://`` URL), else :func:`default_path`."""
    return os.environ.get("VRAMCAL_DB") or str(default_path())


def exists(db: str | os.PathLike | None) -> bool:
    """Whether a lookup could find anything: an SQLite file exists; a URL is always worth asking."""
    target = str(db) if db else default_db()
    return is_url(target) or os.path.exists(target)


def open_existing(db: str | os.PathLike | None) -> "Store | None":
    """The records database opened read-only, or None when there is none yet (nothing is created):
    for lookups that are fine without records, like an estimate's correction."""
    target = str(db) if db else default_db()
    if not is_url(target) and not os.path.exists(target):
        return None
    try:
        return Store(target, create=False, readonly=True)
    except NoRecords:
        return None


def fingerprint_key(fingerprint: dict) -> str:
    return json.dumps({k: fingerprint.get(k) for k in sorted(fingerprint) if k != "created_at"}, sort_keys=True)


def _opt_json(value) -> str | None:
    return json.dumps(value) if value is not None else None


class Store:
    """One open records database. Use as a context manager or call :meth:`close`.

    ``db``: a path (SQLite) or a ``postgresql://`` URL; ``None`` means :func:`default_db`.
    ``create=False`` refuses a database that does not exist yet; ``readonly=True`` opens it for reading
    only (no write lock, no migration). ``timeout_s`` bounds every wait for a lock or a connection
    (default ``$VRAMCAL_DB_TIMEOUT`` or 60 s)."""

    def __init__(self, db: str | os.PathLike | None = None, create: bool = True, readonly: bool = False,
                 timeout_s: float | None = None, role: str | None = None):
        target = str(db) if db else default_db()
        self._open_args = (target, create, readonly, timeout_s)
        self.engine = open_engine(target, create=create, readonly=readonly, timeout_s=timeout_s, role=role)
        try:
            self._ensure_schema()
        except BaseException:
            self.engine.close()
            raise

    # ------------------------------------------------------------------------- opening
    @property
    def kind(self) -> str:
        return self.engine.kind

    @property
    def label(self) -> str:
        """The database as messages may show it (a URL without its password)."""
        return self.engine.label

    @property
    def display(self) -> str:
        return self.engine.label

    @property
    def path(self) -> Path | None:
        return getattr(self.engine, "path", None)

    @property
    def conn(self):
        return self.engine.conn

    def _ensure_schema(self) -> None:
        engine = self.engine
        version = engine.schema_version()
        if version > SCHEMA_VERSION:
            raise UserError(f"{engine.label} has schema {version}, newer than this vramcal's {SCHEMA_VERSION}; "
                            "it was left untouched: upgrade vramcal (pip install -U vramcal)")
        if version == SCHEMA_VERSION:
            return
        target, create, readonly, timeout_s = self._open_args
        if version == 0 and (readonly or (not create and engine.kind == "postgresql")):
            raise NoRecords(f"no vramcal records in {engine.label} yet: `vramcal check MODEL ...` (or `vramcal "
                            "records push --to URL`) records the first")
        if readonly:
            self._upgrade_then_reopen_readonly(version)
            return
        self._migrate()
        if engine.kind == "sqlite":
            engine.set_wal()

    def _upgrade_then_reopen_readonly(self, version: int) -> None:
        target, create, _, timeout_s = self._open_args
        self.engine.close()
        try:
            Store(target, create=False, timeout_s=timeout_s).close()
        except UserError as exc:
            raise UserError(f"{redact(target)} has schema {version} and this vramcal reads schema {SCHEMA_VERSION}; "
                            f"upgrading it failed ({exc}): open it once with write access (e.g. `vramcal check`), "
                            "or ask its owner") from None
        self.engine = open_engine(target, create=False, readonly=True, timeout_s=timeout_s)
        if self.engine.schema_version() != SCHEMA_VERSION:
            raise UserError(f"{self.engine.label} changed while it was being upgraded: try again")

    def _migrate(self) -> None:
        engine = self.engine

        def fn(tx):
            engine.lock_schema(tx)
            version = engine.schema_version()  # again, under the lock: another process may have upgraded it
            if version > SCHEMA_VERSION:
                raise UserError(f"{engine.label} has schema {version}, newer than this vramcal's {SCHEMA_VERSION}; "
                                "upgrade vramcal")
            for step in range(version, SCHEMA_VERSION):
                migration = MIGRATIONS[step]
                if callable(migration):
                    migration(tx, engine)
                    continue
                for statement in migration.split(";"):
                    if statement.strip():
                        tx.execute(engine.ddl(statement))
            if version < SCHEMA_VERSION:
                engine.set_schema_version(tx, SCHEMA_VERSION)

        engine.write(fn)

    def close(self) -> None:
        self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------------- small helpers
    def query(self, sql: str, args=()) -> list[dict]:
        """Rows of one read, as dicts (``?`` parameters on both engines)."""
        return self.engine.query(sql, args)

    def count(self, table: str) -> int:
        return int(self.query(f"SELECT count(*) AS n FROM {table}")[0]["n"])

    def _write(self, fn):
        return self.engine.write(fn)

    # ------------------------------------------------------------------------- writing
    @staticmethod
    def _fingerprint_key(fingerprint: dict) -> str:
        return fingerprint_key(fingerprint)

    def find_machine(self, fingerprint: dict) -> int | None:
        """The id of a recorded machine, without recording anything."""
        row = self.engine.query_one("SELECT id FROM machines WHERE fingerprint = ?", (fingerprint_key(fingerprint),))
        return row["id"] if row else None

    def machine_id(self, fingerprint: dict) -> int:
        return self._write(lambda tx: _insert_machine(tx, fingerprint))

    def begin_run(self, machine_id: int, *, model: str, config_hash: str | None, quant: str, quant_impl: str | None,
                  dtype: str | None, ctx: int, batch: int, kv_dtype: str | None, attn: str | None, device: str,
                  command: str, estimate: dict | None, uuid: str | None = None,
                  created_at: float | None = None) -> int:
        """Record a run's context before it starts; the same ``uuid`` twice records it once."""
        fields = dict(model=model, config_hash=config_hash, quant=quant, quant_impl=quant_impl, dtype=dtype, ctx=ctx,
                      batch=batch, kv_dtype=kv_dtype, attn=attn, device=device, command=command,
                      estimate_json=_opt_json(estimate))
        run_uuid = uuid or new_uuid()
        stamp = time.time() if created_at is None else created_at
        return self._write(lambda tx: _insert_run(tx, machine_id, fields, run_uuid, stamp)[0])

    def finish_run(self, run_id: int, result: dict, stage_rows: list[dict], samples: list[tuple[float, str, int]],
                   finished_at: float | None = None) -> bool:
        """Record a run's outcome, stages and samples in one transaction. False when the run already
        had its outcome (a retry): nothing is added then."""
        row = _result_row(result, time.time() if finished_at is None else finished_at)
        return self._write(lambda tx: _insert_outcome(tx, run_id, row, stage_rows, samples))

    def record_run(self, fingerprint: dict, run: dict, result: dict | None, stage_rows: list[dict] = (),
                   samples: list[tuple[float, str, int]] = (), uuid: str | None = None) -> int:
        """A whole run (machine, context, outcome, stages, samples) in one transaction, idempotent by
        ``uuid``. ``run`` holds :data:`RUN_FIELDS` and optionally ``estimate`` and ``created_at``."""
        fields = {k: run.get(k) for k in RUN_FIELDS}
        fields["estimate_json"] = _opt_json(run.get("estimate"))
        run_uuid = uuid or run.get("uuid") or new_uuid()
        created = run.get("created_at") or time.time()
        outcome = None if result is None else _result_row(result, run.get("finished_at") or time.time())

        def fn(tx):
            machine = _insert_machine(tx, fingerprint)
            run_id, _ = _insert_run(tx, machine, fields, run_uuid, created)
            if outcome is not None:
                _insert_outcome(tx, run_id, outcome, list(stage_rows), list(samples))
            return run_id

        return self._write(fn)

    def add_memo(self, run_id: int, memo: dict, uuid: str | None = None) -> int:
        memo_uuid = uuid or new_uuid()
        return self._write(lambda tx: _insert_memo(tx, run_id, json.dumps(memo), memo_uuid, time.time()))

    def add_device_stages(self, run_id: int, rows: list[dict]) -> None:
        """Per-device stage rows of a placed run: {device, stage, estimated_bytes, measured_peak_bytes,
        measured_used_bytes}. A retry that finds them recorded adds nothing."""
        if not rows:
            return

        def fn(tx):
            if tx.execute("SELECT 1 AS one FROM device_stages WHERE run_id = ? LIMIT 1", (run_id,)):
                return
            tx.executemany(
                "INSERT INTO device_stages (run_id, device, stage, estimated_bytes, measured_peak_bytes, "
                "measured_used_bytes) VALUES (?,?,?,?,?,?)",
                [(run_id, r["device"], r["stage"], r.get("estimated_bytes"), r.get("measured_peak_bytes"),
                  r.get("measured_used_bytes")) for r in rows])

        self._write(fn)

    def add_corrections(self, machine_id: int, stack: str, rows: list[dict]) -> None:
        rows = [{**r, "uuid": r.get("uuid") or new_uuid()} for r in rows]
        stamp = time.time()
        self._write(lambda tx: _insert_corrections(tx, machine_id, stack, rows, stamp))

    def refit(self, machine_id: int, fit: Callable[[list[dict]], tuple[list[tuple[str, list[dict]]], Any]]) -> Any:
        """Refit a machine's corrections without lost updates: in one transaction that holds the
        machine's refit lock, read its stage rows (every run committed before the lock was taken), call
        ``fit(rows) -> ([(scope key, correction rows), ...], answer)``, record the corrections, return
        ``answer``. Two hosts refitting at once run one after the other, the second seeing the first's
        runs."""
        stamp = time.time()

        def fn(tx):
            self.engine.lock_machine(tx, machine_id)
            rows = tx.execute(_STAGE_ROWS + " WHERE r.machine_id = ? ORDER BY st.run_id, st.seq", (machine_id,))
            writes, answer = fit(rows)
            for key, corr_rows in writes:
                _insert_corrections(tx, machine_id, key, [{**r, "uuid": r.get("uuid") or new_uuid()}
                                                          for r in corr_rows], stamp)
            return answer

        return self._write(fn)

    # ------------------------------------------------------------------------- reading
    def runs(self, machine_id: int | None = None, model: str | None = None, limit: int | None = None, *,
             quant: str | None = None, gpu: str | None = None, status: str | None = None,
             host: str | None = None) -> list[dict]:
        """Runs with their outcome and machine, oldest first. Filters: exact ``model`` and ``quant``;
        ``gpu`` matches part of the GPU's name (case-insensitive); ``status`` is ``ok``, ``oom``,
        ``crashed``, ``error`` or ``interrupted`` (no outcome recorded)."""
        q = ("SELECT r.*, s.status, s.last_stage, s.error, s.result_json, s.finished_at, m.hostname, m.gpu_name, "
             "m.class_key FROM runs r JOIN machines m ON m.id = r.machine_id "
             "LEFT JOIN results s ON s.run_id = r.id WHERE 1=1")
        args: list = []
        for column, value in (("r.machine_id", machine_id), ("r.model", model), ("r.quant", quant),
                              ("m.hostname", host)):
            if value is not None:
                q += f" AND {column} = ?"
                args.append(value)
        if gpu is not None:
            escaped = gpu.lower().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            q += " AND lower(m.gpu_name) LIKE ? ESCAPE '\\'"
            args.append(f"%{escaped}%")
        if status == "interrupted":
            q += " AND s.run_id IS NULL"
        elif status is not None:
            q += " AND s.status = ?"
            args.append(status)
        q += " ORDER BY r.id"
        if limit:
            q += f" LIMIT {int(limit)}"
        return self.query(q, args)

    def run(self, run_id: int) -> dict | None:
        row = self.engine.query_one(
            "SELECT r.*, s.status, s.last_stage, s.error, s.result_json, s.finished_at, m.gpu_name, m.total_bytes, "
            "m.kind AS machine_kind, m.hostname, m.cpu_model FROM runs r LEFT JOIN results s ON s.run_id = r.id "
            "JOIN machines m ON m.id = r.machine_id WHERE r.id = ?", (run_id,))
        if row is None:
            return None
        out = dict(row)
        out["stages"] = {s["stage"]: s for s in self.query(
            "SELECT * FROM stages WHERE run_id = ? ORDER BY seq", (run_id,))}
        out["device_stages"] = self.query("SELECT * FROM device_stages WHERE run_id = ? ORDER BY device, stage",
                                          (run_id,))
        out["sample_count"] = int(self.query("SELECT count(*) AS n FROM samples WHERE run_id = ?", (run_id,))[0]["n"])
        return out

    def stage_rows(self, machine_id: int | None = None, *, class_key: str | None = None) -> list[dict]:
        """Stage rows of finished runs with their run's context: one machine's, or a machine class's
        (every host of it; each row says its ``machine_id`` and ``hostname``)."""
        if (machine_id is None) == (class_key is None):
            raise TypeError("stage_rows needs exactly one of machine_id and class_key")
        where, arg = ("r.machine_id = ?", machine_id) if class_key is None else ("m.class_key = ?", class_key)
        return self.query(_STAGE_ROWS + f" WHERE {where} ORDER BY st.run_id, st.seq", (arg,))

    def device_stage_rows(self, machine_id: int) -> list[dict]:
        """:meth:`stage_rows` of placed runs, one row per device and stage (``device`` says which)."""
        return self.query(
            "SELECT st.*, r.ctx, r.batch, r.model, r.config_hash, r.quant, s.status, st.run_id AS run_id "
            "FROM device_stages st JOIN runs r ON r.id = st.run_id JOIN results s ON s.run_id = r.id "
            "WHERE r.machine_id = ? ORDER BY st.run_id", (machine_id,))

    def latest_corrections(self, machine_id: int, stack: str) -> dict[str, dict]:
        out = {}
        for d in self.query("SELECT * FROM corrections WHERE machine_id = ? AND stack = ? ORDER BY id",
                            (machine_id, stack)):
            d["source_runs"] = json.loads(d.pop("source_runs_json"))
            out[d["stage"]] = d
        return out

    def corrections(self, machine_id: int | None = None) -> list[dict]:
        q = "SELECT * FROM corrections" + (" WHERE machine_id = ?" if machine_id is not None else "") + " ORDER BY id"
        out = self.query(q, (machine_id,) if machine_id is not None else ())
        for d in out:
            d["source_runs"] = json.loads(d.pop("source_runs_json"))
        return out

    def memos(self) -> list[dict]:
        return [{**r, "memo": json.loads(r["memo_json"])} for r in self.query("SELECT * FROM memos ORDER BY id")]

    def machines(self, class_key: str | None = None) -> list[dict]:
        if class_key is None:
            return self.query("SELECT * FROM machines ORDER BY id")
        return self.query("SELECT * FROM machines WHERE class_key = ? ORDER BY id", (class_key,))

    def class_counts(self) -> list[dict]:
        """Per machine class: machines, hosts, runs, and runs by outcome."""
        return self.query(
            "SELECT m.class_key, COUNT(DISTINCT m.id) AS machines, COUNT(DISTINCT m.hostname) AS hosts, "
            "COUNT(r.id) AS runs, "
            "COALESCE(SUM(CASE WHEN s.status = 'ok' THEN 1 ELSE 0 END), 0) AS ok, "
            "COALESCE(SUM(CASE WHEN s.status = 'oom' THEN 1 ELSE 0 END), 0) AS ooms, "
            "COALESCE(SUM(CASE WHEN s.status IS NOT NULL AND s.status NOT IN ('ok', 'oom') THEN 1 ELSE 0 END), 0) "
            "AS failed, "
            "COALESCE(SUM(CASE WHEN r.id IS NOT NULL AND s.run_id IS NULL THEN 1 ELSE 0 END), 0) AS interrupted "
            "FROM machines m LEFT JOIN runs r ON r.machine_id = m.id LEFT JOIN results s ON s.run_id = r.id "
            "GROUP BY m.class_key ORDER BY m.class_key")


# ``rss_estimate``: the run's estimate is the CPU resident-set model's (vramcal.estimator.cpu), whose
# methods name "resident set"; CPU rows estimated before it compared tensors with a resident set
_STAGE_ROWS = ("SELECT st.*, r.ctx, r.batch, r.model, r.config_hash, r.quant, r.device, r.machine_id, s.status, "
               "m.hostname, (r.estimate_json LIKE '%\"resident set\"%') AS rss_estimate FROM stages st "
               "JOIN runs r ON r.id = st.run_id JOIN results s ON s.run_id = r.id JOIN machines m ON m.id = r.machine_id")


# ------------------------------------------------------------------------- one transaction's pieces
# Each takes an open transaction (``tx.execute``/``tx.executemany``); the store and ``sync`` compose them.

def _insert_machine(tx, fingerprint: dict, created_at: float | None = None) -> int:
    key = fingerprint_key(fingerprint)
    rows = tx.execute("SELECT id FROM machines WHERE fingerprint = ?", (key,))
    if rows:
        return rows[0]["id"]
    cols = ("fingerprint", "class_key", "created_at", *MACHINE_FIELDS)
    values = (key, class_key(fingerprint), time.time() if created_at is None else created_at,
              *[fingerprint.get(c) for c in MACHINE_FIELDS])
    rows = tx.execute(f"INSERT INTO machines ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))}) "
                      "ON CONFLICT (fingerprint) DO NOTHING RETURNING id", values)
    if rows:
        return rows[0]["id"]
    return tx.execute("SELECT id FROM machines WHERE fingerprint = ?", (key,))[0]["id"]


def _insert_run(tx, machine_id: int, fields: dict, run_uuid: str, created_at: float) -> tuple[int, bool]:
    """(id, whether it was new)."""
    cols = ("uuid", "machine_id", "created_at", *RUN_FIELDS, "estimate_json")
    values = (run_uuid, machine_id, created_at, *[fields.get(c) for c in RUN_FIELDS], fields.get("estimate_json"))
    rows = tx.execute(f"INSERT INTO runs ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))}) "
                      "ON CONFLICT (uuid) DO NOTHING RETURNING id", values)
    if rows:
        return rows[0]["id"], True
    return tx.execute("SELECT id FROM runs WHERE uuid = ?", (run_uuid,))[0]["id"], False


def _result_row(result: dict, finished_at: float) -> dict:
    return {"finished_at": finished_at, "status": result["status"], "last_stage": result.get("last_stage"),
            "error": result.get("error"), "oom_json": json.dumps(result["oom"]) if result.get("oom") else None,
            "series": result.get("series"), "wall_s": result.get("wall_s"),
            "sampler_overhead": result.get("sampler_overhead"), "result_json": json.dumps(result)}


def _insert_outcome(tx, run_id: int, row: dict, stage_rows: list[dict], samples) -> bool:
    done = tx.execute(f"INSERT INTO results (run_id, {', '.join(RESULT_FIELDS)}) VALUES "
                      f"({', '.join('?' * (len(RESULT_FIELDS) + 1))}) ON CONFLICT (run_id) DO NOTHING RETURNING run_id",
                      (run_id, *[row.get(c) for c in RESULT_FIELDS]))
    if not done:
        return False  # recorded before (a retry): its stages and samples are there too
    tx.executemany(f"INSERT INTO stages (run_id, seq, {', '.join(STAGE_FIELDS)}) VALUES "
                   f"({', '.join('?' * (len(STAGE_FIELDS) + 2))})",
                   [(run_id, i, *[r.get(c) for c in STAGE_FIELDS]) for i, r in enumerate(stage_rows)])
    tx.executemany("INSERT INTO samples (run_id, t, series, bytes) VALUES (?,?,?,?)",
                   [(run_id, t, s, b) for t, s, b in samples])
    return True


def _insert_memo(tx, run_id: int, memo_json: str, memo_uuid: str, created_at: float) -> int:
    rows = tx.execute("INSERT INTO memos (uuid, run_id, created_at, memo_json) VALUES (?,?,?,?) "
                      "ON CONFLICT (uuid) DO NOTHING RETURNING id", (memo_uuid, run_id, created_at, memo_json))
    if rows:
        return rows[0]["id"]
    return tx.execute("SELECT id FROM memos WHERE uuid = ?", (memo_uuid,))[0]["id"]


def _insert_corrections(tx, machine_id: int, stack: str, rows: list[dict], created_at: float) -> int:
    """Rows carry a ``uuid``; one already recorded is skipped. Returns how many were added."""
    added = 0
    for r in rows:
        done = tx.execute(
            "INSERT INTO corrections (uuid, machine_id, created_at, stack, stage, intercept_bytes, "
            "slope_bytes_per_token, n_runs, residual_p50_bytes, residual_p95_bytes, source_runs_json) "
            "VALUES (?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT (uuid) DO NOTHING RETURNING id",
            (r["uuid"], machine_id, r.get("created_at") or created_at, stack, r["stage"], int(r["intercept_bytes"]),
             float(r["slope_bytes_per_token"]), r["n_runs"], r.get("residual_p50_bytes"),
             r.get("residual_p95_bytes"), json.dumps(r["source_runs"])))
        added += bool(done)
    return added
