"""The records database: machines, runs, their stage readings and samples, memos, corrections.

One interface, two engines (``vramcal.records.engines``): ``--db PATH`` (else ``$VRAMCAL_DB``, else
``$XDG_DATA_HOME/vramcal/vramcal.db``, i.e. ``~/.local/share/vramcal/vramcal.db``) is an SQLite file;
``--db postgresql://USER@HOST/DB`` is a PostgreSQL database shared by a fleet of machines. The schema
and its migrations are :mod:`vramcal.records.schema`.

Records are append-only. A run is written in two appends: its context (:class:`RunContext`, table
``runs``) before the probe starts, its outcome (:class:`Outcome`: ``results`` with its ``stages``, its
per-device ``device_stages`` and its ``samples``, in one transaction) when it ends. A run with no
result was interrupted; a result with a status other than ``ok`` is a partial record of a run that
stopped (``oom``, ``crashed``, ``error``, ``killed``). Nothing is ever updated or deleted, and since
schema 3 the database itself refuses it (triggers; on PostgreSQL also the writer role's grants).

Every write is idempotent, so a retry after a dropped connection adds nothing twice: a run carries a
client-generated ``uuid`` (the integer ``id`` users see is the database's own), a result belongs to its
run, a memo and a correction carry a ``uuid`` too, a machine is its fingerprint.

What crosses into this unit is typed (:class:`RunContext`, :class:`Outcome`, :class:`StageRow`,
:class:`DeviceStageRow`) and what comes out of :meth:`Store.run` is a :class:`RunRecord`; the rows of
bulk reads (lists, corrections' inputs) are plain mappings of column to value.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

from ..errors import UserError
from ..paths import data_dir
from .engines import APPLICATION_ID, NoRecords, is_url, open_engine, redact  # noqa: F401 (re-exported)
from .machines import class_key
from .schema import MIGRATIONS, SCHEMA_VERSION, new_uuid  # noqa: F401 (re-exported)

RUN_FIELDS = ("model", "config_hash", "quant", "quant_impl", "dtype", "ctx", "batch", "kv_dtype", "attn", "device",
              "command", "vramcal_version", "estimator_model")
MACHINE_FIELDS = ("kind", "gpu_name", "gpu_uuid", "total_bytes", "driver", "cuda_runtime", "torch", "transformers",
                  "bitsandbytes", "accelerate", "hostname", "cpu_model")
RESULT_FIELDS = ("finished_at", "status", "last_stage", "error", "oom_json", "series", "wall_s", "sampler_overhead",
                 "result_json")
STAGE_FIELDS = ("stage", "estimated_bytes", "measured_peak_bytes", "measured_used_bytes", "torch_max_allocated",
                "torch_max_reserved")
DEVICE_STAGE_FIELDS = ("device", "stage", "estimated_bytes", "measured_peak_bytes", "measured_used_bytes")


# ------------------------------------------------------------------------------------ the types

@dataclass
class RunContext:
    """What runs, recorded before it starts. ``estimate`` is the estimate's JSON
    (:meth:`vramcal.estimator.result.Estimate.to_dict`); ``estimator_model`` and ``vramcal_version`` name
    what made it; a run split across devices has its main device in ``device`` and all of them in
    ``split_devices``."""

    model: str
    quant: str
    ctx: int
    batch: int
    device: str
    command: str
    config_hash: str | None = None
    quant_impl: str | None = None
    dtype: str | None = None
    kv_dtype: str | None = None
    attn: str | None = None
    estimate: dict | None = None
    estimator_model: str | None = None
    vramcal_version: str | None = None
    split_devices: list[str] | None = None
    created_at: float | None = None

    @property
    def placed(self) -> bool:
        return bool(self.split_devices)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RunContext:
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


@dataclass
class StageRow:
    stage: str
    estimated_bytes: int | None = None
    measured_peak_bytes: int | None = None
    measured_used_bytes: int | None = None
    torch_max_allocated: int | None = None
    torch_max_reserved: int | None = None


@dataclass
class DeviceStageRow:
    device: str
    stage: str
    estimated_bytes: int | None = None
    measured_peak_bytes: int | None = None
    measured_used_bytes: int | None = None


@dataclass
class Outcome:
    """How a run ended, with everything measured, recorded in one transaction. ``result`` is the
    probe result's JSON (:meth:`vramcal.probes.result.ProbeResult.to_dict`, samples left out: they are
    ``samples`` here, one ``(t, series, bytes)`` per reading of every sampled series)."""

    status: str
    last_stage: str | None = None
    error: str | None = None
    oom: dict | None = None
    series: str | None = None
    wall_s: float | None = None
    sampler_overhead: float | None = None
    result: dict = field(default_factory=dict)
    stages: list[StageRow] = field(default_factory=list)
    devices: list[DeviceStageRow] = field(default_factory=list)
    samples: list[tuple[float, str, int | None]] = field(default_factory=list)
    finished_at: float | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["samples"] = [list(s) for s in self.samples]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Outcome:
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        kw["stages"] = [StageRow(**r) for r in d.get("stages") or []]
        kw["devices"] = [DeviceStageRow(**r) for r in d.get("devices") or []]
        kw["samples"] = [tuple(s) for s in d.get("samples") or []]
        return cls(**kw)


@dataclass
class RunRecord:
    """One recorded run as :meth:`Store.run` reads it: the context, the machine, the outcome (None while
    interrupted), stages in recorded order, per-device stages of a split run, and the corrections its
    stages fed."""

    id: int
    uuid: str
    created_at: float
    context: RunContext
    machine: dict
    outcome: Outcome | None
    sample_count: int
    corrections: list[dict] = field(default_factory=list)
    withdrawals: list[dict] = field(default_factory=list)  # why and when it was withdrawn, oldest first

    @property
    def withdrawn(self) -> bool:
        return bool(self.withdrawals)

    @property
    def status(self) -> str:
        return self.outcome.status if self.outcome else "interrupted"

    @property
    def stages(self) -> dict[str, StageRow]:
        return {r.stage: r for r in (self.outcome.stages if self.outcome else [])}

    def to_dict(self) -> dict:
        """Nested objects, never JSON documents inside strings."""
        return {"id": self.id, "uuid": self.uuid, "created_at": self.created_at, "status": self.status,
                "context": self.context.to_dict(), "machine": dict(self.machine),
                "outcome": None if self.outcome is None else self.outcome.to_dict(),
                "sample_count": self.sample_count, "corrections": self.corrections,
                "withdrawals": self.withdrawals}


def default_path() -> Path:
    """The SQLite file used when neither ``--db`` nor ``$VRAMCAL_DB`` names a database."""
    if os.environ.get("VRAMCAL_DB") and not is_url(os.environ["VRAMCAL_DB"]):
        return Path(os.environ["VRAMCAL_DB"])
    return data_dir() / "vramcal.db"


def default_db() -> str:
    """``$VRAMCAL_DB`` (a path or a ``postgresql://`` URL), else :func:`default_path`."""
    return os.environ.get("VRAMCAL_DB") or str(default_path())


def open_existing(db: str | os.PathLike | None, timeout_s: float | None = None) -> "Store | None":
    """The records database opened read-only, or None when there is none yet (nothing is created):
    for lookups that are fine without records, like an estimate's correction."""
    target = str(db) if db else default_db()
    if not is_url(target) and not os.path.exists(target):
        return None
    try:
        return Store(target, create=False, readonly=True, timeout_s=timeout_s)
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
    def find_machine(self, fingerprint: dict) -> int | None:
        """The id of a recorded machine, without recording anything."""
        row = self.engine.query_one("SELECT id FROM machines WHERE fingerprint = ?", (fingerprint_key(fingerprint),))
        return row["id"] if row else None

    def machine_id(self, fingerprint: dict) -> int:
        return self._write(lambda tx: _insert_machine(tx, fingerprint))

    def begin_run(self, machine_id: int, context: RunContext, uuid: str | None = None) -> int:
        """Record a run's context before it starts; the same ``uuid`` twice records it once."""
        run_uuid = uuid or new_uuid()
        stamp = time.time() if context.created_at is None else context.created_at
        return self._write(lambda tx: _insert_run(tx, machine_id, context, run_uuid, stamp)[0])

    def finish_run(self, run_id: int, outcome: Outcome) -> bool:
        """Record a run's outcome -- result, stages, per-device stages, samples -- in one transaction.
        False when the run already had its outcome (a retry): nothing is added then."""
        return self._write(lambda tx: _insert_outcome(tx, run_id, outcome))

    def record_run(self, fingerprint: dict, context: RunContext, outcome: Outcome | None,
                   uuid: str | None = None) -> int:
        """A whole run (machine, context, outcome) in one transaction, idempotent by ``uuid``."""
        run_uuid = uuid or new_uuid()
        created = context.created_at or time.time()

        def fn(tx):
            machine = _insert_machine(tx, fingerprint)
            run_id, _ = _insert_run(tx, machine, context, run_uuid, created)
            if outcome is not None:
                _insert_outcome(tx, run_id, outcome)
            return run_id

        return self._write(fn)

    def add_memo(self, run_id: int, memo: dict, uuid: str | None = None) -> int:
        memo_uuid = uuid or new_uuid()
        return self._write(lambda tx: _insert_memo(tx, run_id, json.dumps(memo), memo_uuid, time.time()))

    def withdraw(self, run_id: int, why: str, hostname: str | None = None, uuid: str | None = None) -> int:
        """Append a withdrawal of run ``run_id`` (which stays, as everything recorded does): from now on no
        correction is fitted from it, and no correction fitted from it is applied. Returns the
        withdrawal's id; the same ``uuid`` twice records it once."""
        w_uuid = uuid or new_uuid()
        return self._write(lambda tx: _insert_withdrawal(tx, run_id, why, hostname, w_uuid, time.time())[0])

    def withdrawals(self, run_id: int | None = None) -> list[dict]:
        q = "SELECT * FROM withdrawals" + (" WHERE run_id = ?" if run_id is not None else "") + " ORDER BY id"
        return self.query(q, (run_id,) if run_id is not None else ())

    def withdrawn_runs(self) -> set[int]:
        return {r["run_id"] for r in self.query("SELECT DISTINCT run_id FROM withdrawals")}

    def add_corrections(self, machine_id: int, stack: str, rows: list[dict], estimator_model: str | None) -> None:
        """``rows`` carry their ``uuid`` (made before the transaction: a retried one adds nothing twice)."""
        stamp = time.time()
        self._write(lambda tx: _insert_corrections(tx, machine_id, stack, rows, stamp, estimator_model))

    def refit(self, machine_id: int, fit: Callable[[list[dict]], tuple[list[tuple[str, list[dict]]], Any]],
              estimator_model: str | None) -> Any:
        """Refit a machine's corrections without lost updates: in one transaction that holds the
        machine's refit lock, read its stage rows (every run committed before the lock was taken), call
        ``fit(rows) -> ([(scope key, correction rows with their uuid), ...], answer)``, record the
        corrections, return ``answer``. Two hosts refitting at once run one after the other, the second
        seeing the first's runs."""
        stamp = time.time()

        def fn(tx):
            self.engine.lock_machine(tx, machine_id)
            rows = tx.execute(_STAGE_ROWS + " AND r.machine_id = ? ORDER BY st.run_id, st.seq", (machine_id,))
            writes, answer = fit(rows)
            for key, corr_rows in writes:
                _insert_corrections(tx, machine_id, key, corr_rows, stamp, estimator_model)
            return answer

        return self._write(fn)

    # ------------------------------------------------------------------------- reading
    def runs(self, machine_id: int | None = None, model: str | None = None, limit: int | None = None, *,
             quant: str | None = None, gpu: str | None = None, status: str | None = None,
             host: str | None = None) -> list[dict]:
        """Runs with their outcome and machine, oldest first. Filters: exact ``model`` and ``quant``;
        ``gpu`` matches part of the GPU's name (case-insensitive); ``status`` is ``ok``, ``oom``,
        ``crashed``, ``error``, ``killed`` or ``interrupted`` (no outcome recorded)."""
        q = ("SELECT r.id, r.uuid, r.created_at, r.machine_id, r.model, r.config_hash, r.quant, r.quant_impl, "
             "r.dtype, r.ctx, r.batch, r.kv_dtype, r.attn, r.device, r.split_devices, r.command, "
             "r.vramcal_version, r.estimator_model, s.status, s.last_stage, s.error, s.finished_at, m.hostname, "
             "m.gpu_name, m.class_key, (SELECT count(*) FROM withdrawals w WHERE w.run_id = r.id) AS withdrawn "
             "FROM runs r JOIN machines m ON m.id = r.machine_id "
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
        out = self.query(q, args)
        for r in out:
            r["split_devices"] = json.loads(r["split_devices"]) if r.get("split_devices") else None
            r["withdrawn"] = bool(r["withdrawn"])
        return out

    def run(self, run_id: int) -> RunRecord | None:
        row = self.engine.query_one(
            "SELECT r.*, s.run_id AS has_outcome, s.finished_at, s.status, s.last_stage, s.error, s.oom_json, "
            "s.series, s.wall_s, s.sampler_overhead, s.result_json, m.kind, m.gpu_name, m.gpu_uuid, m.total_bytes, "
            "m.driver, m.cuda_runtime, m.torch, m.transformers, m.bitsandbytes, m.accelerate, m.hostname, "
            "m.cpu_model, m.class_key FROM runs r LEFT JOIN results s ON s.run_id = r.id "
            "JOIN machines m ON m.id = r.machine_id WHERE r.id = ?", (run_id,))
        if row is None:
            return None
        context = _context_of(row)
        machine = {k: row[k] for k in ("machine_id", *MACHINE_FIELDS, "class_key")}
        outcome = None
        if row["has_outcome"] is not None:
            outcome = _outcome_of(row, self.query(f"SELECT {', '.join(STAGE_FIELDS)} FROM stages WHERE run_id = ? "
                                                  "ORDER BY seq", (run_id,)),
                                  self.query(f"SELECT {', '.join(DEVICE_STAGE_FIELDS)} FROM device_stages "
                                             "WHERE run_id = ? ORDER BY device, stage", (run_id,)))
        n = int(self.query("SELECT count(*) AS n FROM samples WHERE run_id = ?", (run_id,))[0]["n"])
        fed = [c for c in self.corrections(row["machine_id"]) if run_id in c["source_runs"]]
        return RunRecord(row["id"], row["uuid"], row["created_at"], context, machine, outcome, n, fed,
                         self.withdrawals(run_id))

    def run_id_of(self, uuid: str) -> int | None:
        row = self.engine.query_one("SELECT id FROM runs WHERE uuid = ?", (uuid,))
        return row["id"] if row else None

    def stage_rows(self, machine_id: int | None = None, *, class_key: str | None = None) -> list[dict]:
        """Stage rows of finished single-device runs with their run's context: one machine's, or a
        machine class's (every host of it; each row says its ``machine_id`` and ``hostname``)."""
        if (machine_id is None) == (class_key is None):
            raise TypeError("stage_rows needs exactly one of machine_id and class_key")
        where, arg = ("r.machine_id = ?", machine_id) if class_key is None else ("m.class_key = ?", class_key)
        return self.query(_STAGE_ROWS + f" AND {where} ORDER BY st.run_id, st.seq", (arg,))

    def device_stage_rows(self, machine_id: int) -> list[dict]:
        """:meth:`stage_rows` of split runs, one row per device and stage (``device`` says which)."""
        return self.query(
            "SELECT st.*, r.ctx, r.batch, r.model, r.config_hash, r.quant, r.estimator_model, s.status, "
            "st.run_id AS run_id FROM device_stages st JOIN runs r ON r.id = st.run_id "
            "JOIN results s ON s.run_id = r.id WHERE r.machine_id = ? AND " + NOT_WITHDRAWN + " ORDER BY st.run_id",
            (machine_id,))

    def latest_corrections(self, machine_id: int, stack: str, estimator_model: str | None) -> dict[str, dict]:
        """The newest correction per stage of one scope, fitted from runs of ``estimator_model``, none of
        them withdrawn (a correction fitted before a withdrawal reached this store is left out)."""
        out = {}
        withdrawn = self.withdrawn_runs()
        for d in self.query("SELECT * FROM corrections WHERE machine_id = ? AND stack = ? AND estimator_model = ? "
                            "ORDER BY id", (machine_id, stack, estimator_model)):
            d["source_runs"] = json.loads(d.pop("source_runs_json"))
            if not withdrawn.intersection(d["source_runs"]):
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


# A run ``r`` that no withdrawal names: what every correction is fitted from
NOT_WITHDRAWN = "NOT EXISTS (SELECT 1 FROM withdrawals w WHERE w.run_id = r.id)"

# Stage rows of finished single-device runs not withdrawn, with what a correction needs: the workload, the
# scope's fields and the estimator model the run was compared with
_STAGE_ROWS = ("SELECT st.*, r.ctx, r.batch, r.model, r.config_hash, r.quant, r.device, r.machine_id, "
               "r.estimator_model, s.status, m.hostname FROM stages st JOIN runs r ON r.id = st.run_id "
               "JOIN results s ON s.run_id = r.id JOIN machines m ON m.id = r.machine_id "
               "WHERE r.split_devices IS NULL AND " + NOT_WITHDRAWN)  # a split run's: per device (device_stages)


def _context_of(row: dict) -> RunContext:
    kw = {k: row.get(k) for k in RUN_FIELDS}
    kw["estimate"] = json.loads(row["estimate_json"]) if row.get("estimate_json") else None
    kw["split_devices"] = json.loads(row["split_devices"]) if row.get("split_devices") else None
    kw["created_at"] = row.get("created_at")
    return RunContext(**kw)


def _outcome_of(row: dict, stages: list[dict], devices: list[dict]) -> Outcome:
    return Outcome(status=row["status"], last_stage=row.get("last_stage"), error=row.get("error"),
                   oom=json.loads(row["oom_json"]) if row.get("oom_json") else None, series=row.get("series"),
                   wall_s=row.get("wall_s"), sampler_overhead=row.get("sampler_overhead"),
                   result=json.loads(row["result_json"]) if row.get("result_json") else {},
                   stages=[StageRow(**s) for s in stages], devices=[DeviceStageRow(**d) for d in devices],
                   finished_at=row.get("finished_at"))


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


def _insert_run(tx, machine_id: int, context: RunContext, run_uuid: str, created_at: float) -> tuple[int, bool]:
    """(id, whether it was new)."""
    cols = ("uuid", "machine_id", "created_at", *RUN_FIELDS, "estimate_json", "split_devices")
    values = (run_uuid, machine_id, created_at, *[getattr(context, c) for c in RUN_FIELDS],
              _opt_json(context.estimate), _opt_json(context.split_devices or None))
    rows = tx.execute(f"INSERT INTO runs ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))}) "
                      "ON CONFLICT (uuid) DO NOTHING RETURNING id", values)
    if rows:
        return rows[0]["id"], True
    return tx.execute("SELECT id FROM runs WHERE uuid = ?", (run_uuid,))[0]["id"], False


def _insert_outcome(tx, run_id: int, outcome: Outcome) -> bool:
    row = {"finished_at": outcome.finished_at or time.time(), "status": outcome.status,
           "last_stage": outcome.last_stage, "error": outcome.error, "oom_json": _opt_json(outcome.oom),
           "series": outcome.series, "wall_s": outcome.wall_s, "sampler_overhead": outcome.sampler_overhead,
           "result_json": json.dumps(outcome.result)}
    done = tx.execute(f"INSERT INTO results (run_id, {', '.join(RESULT_FIELDS)}) VALUES "
                      f"({', '.join('?' * (len(RESULT_FIELDS) + 1))}) ON CONFLICT (run_id) DO NOTHING RETURNING run_id",
                      (run_id, *[row[c] for c in RESULT_FIELDS]))
    if not done:
        return False  # recorded before (a retry): its stages and samples are there too
    tx.executemany(f"INSERT INTO stages (run_id, seq, {', '.join(STAGE_FIELDS)}) VALUES "
                   f"({', '.join('?' * (len(STAGE_FIELDS) + 2))})",
                   [(run_id, i, *[getattr(r, c) for c in STAGE_FIELDS]) for i, r in enumerate(outcome.stages)])
    _insert_device_stages(tx, run_id, outcome.devices)
    tx.executemany("INSERT INTO samples (run_id, t, series, bytes) VALUES (?,?,?,?)",
                   [(run_id, t, s, b) for t, s, b in outcome.samples])
    return True


def _insert_device_stages(tx, run_id: int, rows: list[DeviceStageRow]) -> int:
    """A split run's per-device rows, unless the run has some already; returns how many were added."""
    if not rows or tx.execute("SELECT 1 AS one FROM device_stages WHERE run_id = ? LIMIT 1", (run_id,)):
        return 0
    tx.executemany(f"INSERT INTO device_stages (run_id, {', '.join(DEVICE_STAGE_FIELDS)}) VALUES "
                   f"({', '.join('?' * (len(DEVICE_STAGE_FIELDS) + 1))})",
                   [(run_id, *[getattr(r, c) for c in DEVICE_STAGE_FIELDS]) for r in rows])
    return len(rows)


def _insert_memo(tx, run_id: int, memo_json: str, memo_uuid: str, created_at: float) -> int:
    rows = tx.execute("INSERT INTO memos (uuid, run_id, created_at, memo_json) VALUES (?,?,?,?) "
                      "ON CONFLICT (uuid) DO NOTHING RETURNING id", (memo_uuid, run_id, created_at, memo_json))
    if rows:
        return rows[0]["id"]
    return tx.execute("SELECT id FROM memos WHERE uuid = ?", (memo_uuid,))[0]["id"]


def _insert_withdrawal(tx, run_id: int, why: str, hostname: str | None, w_uuid: str, created_at: float
                       ) -> tuple[int, bool]:
    """(id, whether it was new)."""
    rows = tx.execute("INSERT INTO withdrawals (uuid, run_id, created_at, why, hostname) VALUES (?,?,?,?,?) "
                      "ON CONFLICT (uuid) DO NOTHING RETURNING id", (w_uuid, run_id, created_at, why, hostname))
    if rows:
        return rows[0]["id"], True
    return tx.execute("SELECT id FROM withdrawals WHERE uuid = ?", (w_uuid,))[0]["id"], False


def _insert_corrections(tx, machine_id: int, stack: str, rows: list[dict], created_at: float,
                        estimator_model: str | None) -> int:
    """Rows carry a ``uuid``; one already recorded is skipped. Returns how many were added."""
    added = 0
    for r in rows:
        done = tx.execute(
            "INSERT INTO corrections (uuid, machine_id, created_at, stack, stage, intercept_bytes, "
            "slope_bytes_per_token, n_runs, residual_p50_bytes, residual_p95_bytes, source_runs_json, "
            "estimator_model) VALUES (?,?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT (uuid) DO NOTHING RETURNING id",
            (r["uuid"], machine_id, r.get("created_at") or created_at, stack, r["stage"], int(r["intercept_bytes"]),
             float(r["slope_bytes_per_token"]), r["n_runs"], r.get("residual_p50_bytes"),
             r.get("residual_p95_bytes"), json.dumps(r["source_runs"]), r.get("estimator_model", estimator_model)))
        added += bool(done)
    return added
