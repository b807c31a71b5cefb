"""The records database's schema: each migration from one version to the next, in order.

The schema version is SQLite's ``PRAGMA user_version`` (with vramcal's ``application_id``) or the
``vramcal.meta`` table on PostgreSQL. On open an older schema is upgraded in one transaction, keeping
every row (:meth:`vramcal.records.store.Store`); a shipped migration is never edited.

==========  ===================================================================================
version     what it added
==========  ===================================================================================
1           machines, runs, results, stages, samples, memos
2           corrections, fitted per machine and software stack
3           client-generated ids (uuid), machine classes, the stages' order, append-only triggers
4           ``device_stages``: readings per device of a run split across devices
5           what derived each run and correction: ``vramcal_version`` and ``estimator_model`` on runs,
            ``estimator_model`` on corrections, and a split run's devices as ``split_devices`` (a
            list), its main device in ``device``
6           ``withdrawals``: a run taken out of every correction (``vramcal records withdraw RUN --why``),
            append-only like the rest; the run itself stays
==========  ===================================================================================
"""

from __future__ import annotations

import json
import uuid as _uuid
from typing import Callable

from .engines import Engine
from .machines import class_key
from ..workload import device_kind

SCHEMA_VERSION = 6

# The estimator models of runs recorded before schema 5 (vramcal.estimator.stages.MODEL_IDS then):
# GPU stages; the CPU resident-set model (its methods name "resident set"); CPU tensors before it.
LEGACY_MODELS = {"cuda": "gpu-stages/1", "cpu-rss": "cpu-rss/1", "cpu": "cpu-tensors/0"}


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




def _legacy_model(device: str, estimate: str | dict | None) -> str | None:
    if not estimate:
        return None
    if device_kind(device or "") != "cpu":
        return LEGACY_MODELS["cuda"]
    try:
        methods = (json.loads(estimate) if isinstance(estimate, str) else estimate).get("methods") or {}
    except (ValueError, AttributeError):
        return LEGACY_MODELS["cpu"]
    return LEGACY_MODELS["cpu-rss" if "resident set" in methods else "cpu"]


def legacy_run_fields(device, estimate: str | dict | None) -> dict:
    """What schema 5 made columns, for a run recorded before it (a row, or a saved file of the first
    format): its main device, a split run's devices (from the comma-joined device text), and the
    estimator model its estimate (JSON text or a dict) was made with."""
    devices = str(device or "").split(",")
    return {"device": devices[0], "split_devices": devices if len(devices) > 1 else None,
            "estimator_model": _legacy_model(device, estimate)}


def _v5(tx, engine: Engine) -> None:
    """4 -> 5: what derived each run (vramcal's version, the estimator's model id) and a split run's
    devices as their own column. Rows recorded before get their estimator model from the estimate they
    carry (the one time the stored JSON is read for it) and their split from the device text."""
    for statement in ("ALTER TABLE runs ADD COLUMN vramcal_version TEXT",
                      "ALTER TABLE runs ADD COLUMN estimator_model TEXT",
                      "ALTER TABLE runs ADD COLUMN split_devices TEXT",
                      "ALTER TABLE corrections ADD COLUMN estimator_model TEXT"):
        tx.execute(engine.ddl(statement))
    rows = tx.execute("SELECT id, device, estimate_json FROM runs ORDER BY id")
    with engine.updating(tx, ("runs", "corrections")):
        for r in rows:
            f = legacy_run_fields(r["device"], r["estimate_json"])
            split = None if f["split_devices"] is None else json.dumps(f["split_devices"])
            tx.execute("UPDATE runs SET estimator_model = ?, split_devices = ?, device = ? WHERE id = ?",
                       (f["estimator_model"], split, f["device"], r["id"]))
        for c in tx.execute("SELECT id, stack FROM corrections ORDER BY id"):
            stack = str(c["stack"])
            model = (LEGACY_MODELS["cpu-rss"] if "|estimate=rss-1" in stack else
                     LEGACY_MODELS["cpu"] if stack.startswith("kind=cpu") else LEGACY_MODELS["cuda"])
            tx.execute("UPDATE corrections SET estimator_model = ? WHERE id = ?", (model, c["id"]))
    tx.execute("CREATE INDEX runs_estimator ON runs(machine_id, estimator_model)")


def _v6(tx, engine: Engine) -> None:
    """5 -> 6: withdrawals. A run recorded by mistake (a poisoned import, a probe of the wrong thing)
    cannot be deleted from an append-only store; a withdrawal row, appended, takes it out of every
    correction fitted or applied after it, on this machine and across a fleet. ``uuid`` makes copying it
    (push, pull) idempotent; ``hostname`` says who withdrew it."""
    tx.execute(engine.ddl("""
    CREATE TABLE withdrawals (
        id INTEGER PRIMARY KEY,
        uuid TEXT NOT NULL UNIQUE,
        run_id INTEGER NOT NULL REFERENCES runs(id),
        created_at REAL NOT NULL,
        why TEXT NOT NULL,
        hostname TEXT
    )"""))
    tx.execute("CREATE INDEX withdrawals_run ON withdrawals(run_id)")
    for statement in engine.append_only_ddl(("withdrawals",)):
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
    # 4 -> 5
    _v5,
    # 5 -> 6
    _v6,
]
assert len(MIGRATIONS) == SCHEMA_VERSION
