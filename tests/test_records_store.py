"""The records database: concurrent writers, foreign and future files refused untouched, upgrades."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import sqlite3
import subprocess
import sys

import pytest

from vramcal.errors import UserError
from vramcal.records.export import export, runs_frame
from vramcal.records.store import APPLICATION_ID, MIGRATIONS, SCHEMA_VERSION, Store

FP = {"kind": "cpu", "torch": "2.13.0", "transformers": "5.24.0", "hostname": "h", "cpu_model": "x",
      "total_bytes": 1 << 34}


def _writer(path: str, worker: int, n: int) -> None:
    with Store(path) as s:
        mid = s.machine_id(FP)
        for i in range(n):
            rid = s.begin_run(mid, model=f"m{worker}", config_hash="c", quant="nf4", quant_impl="bnb", dtype="bfloat16",
                              ctx=100 + i, batch=1, kv_dtype="auto", attn="sdpa", device="cpu", command="x",
                              estimate={"peak": i})
            s.finish_run(rid, {"status": "ok", "series": "rss"},
                         [{"stage": "end", "estimated_bytes": 10, "measured_peak_bytes": 12}],
                         [(0.1 * k, "rss", 1000 + k) for k in range(20)])


def test_eight_processes_write_at_once(tmp_path):
    path = str(tmp_path / "db.sqlite")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(path, w, 25)) for w in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * 8
    with Store(path) as s:
        runs = s.runs()
        assert len(runs) == 200 and all(r["status"] == "ok" for r in runs)
        assert len(s.machines()) == 1
        assert s.conn.execute("SELECT count(*) FROM samples").fetchone()[0] == 200 * 20
        assert s.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def _digest(p) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_not_a_database_is_refused_untouched(tmp_path):
    p = tmp_path / "notes.db"
    p.write_text("my notes, not a database\n")
    before = _digest(p)
    with pytest.raises(UserError, match="not a vramcal database"):
        Store(p)
    assert _digest(p) == before
    r = subprocess.run([sys.executable, "-m", "vramcal", "records", "list", "--db", str(p)], capture_output=True,
                       text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and _digest(p) == before


def _sql(path, *statements: str) -> None:
    c = sqlite3.connect(path)
    for statement in statements:
        c.execute(statement)
    c.commit()
    c.close()


def _refused_untouched(path, match: str) -> None:
    before = _digest(path)
    with pytest.raises(UserError, match=match):
        Store(path)
    assert _digest(path) == before


def test_other_programs_sqlite_is_refused_untouched(tmp_path):
    p = tmp_path / "other.db"
    _sql(p, "CREATE TABLE t (x)", "INSERT INTO t VALUES (1)")
    _refused_untouched(p, "another program")


def test_newer_schema_is_refused_untouched(tmp_path):
    p = tmp_path / "new.db"
    Store(p).close()
    _sql(p, f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    _refused_untouched(p, "newer than this vramcal")


def test_older_schema_is_upgraded_keeping_rows(tmp_path):
    p = tmp_path / "old.db"
    c = sqlite3.connect(p)
    for statement in MIGRATIONS[0].split(";"):
        if statement.strip():
            c.execute(statement)
    c.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    c.execute("PRAGMA user_version = 1")
    c.execute("INSERT INTO machines (fingerprint, kind, created_at) VALUES ('fp', 'cpu', 0)")
    c.execute("INSERT INTO runs (machine_id, created_at, model, quant, ctx, batch, device, command) "
              "VALUES (1, 0, 'old-model', 'nf4', 512, 1, 'cpu', 'vramcal probe old-model')")
    c.commit()
    c.close()
    with Store(p) as s:
        assert s.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        runs = s.runs()
        assert [(r["model"], r["status"]) for r in runs] == [("old-model", None)]
        s.add_corrections(1, "stack", [{"stage": "end", "intercept_bytes": 5, "slope_bytes_per_token": 0.0,
                                        "n_runs": 1, "source_runs": [1]}])
        assert s.latest_corrections(1, "stack")["end"]["intercept_bytes"] == 5


def test_missing_values_stay_null_not_zero(tmp_path):
    with Store(tmp_path / "n.db") as s:
        mid = s.machine_id({"kind": "cuda", "gpu_name": None, "total_bytes": None})
        rid = s.begin_run(mid, model="m", config_hash=None, quant="bf16", quant_impl=None, dtype=None, ctx=64,
                          batch=1, kv_dtype=None, attn=None, device="cuda:0", command="c", estimate=None)
        s.finish_run(rid, {"status": "crashed"}, [{"stage": "load_peak", "estimated_bytes": 5,
                                                   "measured_peak_bytes": None}], [])
        row = s.conn.execute("SELECT measured_peak_bytes, torch_max_allocated FROM stages").fetchone()
        assert tuple(row) == (None, None)
        assert s.conn.execute("SELECT total_bytes FROM machines").fetchone()[0] is None
        frame = runs_frame(s)
        assert frame["measured_peak_bytes"].isna().all()
        out = json.loads(export(s, "json", None))
        assert out[0]["measured_peak_bytes"] is None and out[0]["status"] == "crashed"


def test_interrupted_run_is_listed(tmp_path):
    with Store(tmp_path / "i.db") as s:
        mid = s.machine_id(FP)
        s.begin_run(mid, model="m", config_hash=None, quant="nf4", quant_impl=None, dtype=None, ctx=64, batch=1,
                    kv_dtype=None, attn=None, device="cpu", command="c", estimate=None)
        assert export(s, "csv", None).splitlines()[1].count("interrupted") == 1


@pytest.mark.parametrize("fmt", ["csv", "json", "parquet"])
def test_export_cli(tmp_path, fmt):
    db = tmp_path / "e.db"
    _writer(str(db), 0, 3)
    out = tmp_path / f"runs.{fmt}"
    r = subprocess.run([sys.executable, "-m", "vramcal", "records", "export", "--format", fmt, "--out", str(out),
                        "--db", str(db)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    import pandas as pd

    frame = {"csv": pd.read_csv, "json": pd.read_json, "parquet": pd.read_parquet}[fmt](out)
    assert len(frame) == 3 and set(frame["model"]) == {"m0"} and list(frame["measured_peak_bytes"]) == [12] * 3
