"""The records store, one suite over both engines (an SQLite file; a real PostgreSQL server started for
the tests): concurrent writers, idempotent retries, append-only enforced by the database, NULL not 0,
filters, export; then what is engine-specific: foreign and future databases refused untouched, upgrades."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import sqlite3
import subprocess
import sys

import pytest
from helpers import context, outcome
from pg_server import pg_server, pg_url  # noqa: F401 (fixtures)

from vramcal.errors import UserError
from vramcal.records.export import export, runs_frame
from vramcal.records.store import APPLICATION_ID, MIGRATIONS, SCHEMA_VERSION, Store

FP = {"kind": "cpu", "torch": "2.13.0", "transformers": "5.24.0", "hostname": "h", "cpu_model": "x",
      "total_bytes": 1 << 34}


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request, tmp_path) -> str:
    """The same test against each engine."""
    if request.param == "sqlite":
        return str(tmp_path / "records.db")
    return request.getfixturevalue("pg_url")


def _writer(db: str, worker: int, n: int) -> None:
    with Store(db) as s:
        mid = s.machine_id(FP)
        for i in range(n):
            rid = s.begin_run(mid, context(model=f"m{worker}", config_hash="c", quant_impl="bnb", dtype="bfloat16",
                                           ctx=100 + i, kv_dtype="auto", attn="sdpa", command="x",
                                           estimate={"peak": i}))
            s.finish_run(rid, outcome("ok", [{"stage": "end", "estimated_bytes": 10, "measured_peak_bytes": 12}],
                                      [(0.1 * k, "rss", 1000 + k) for k in range(20)], series="rss"))


def _run(s: Store, fp=FP, uuid=None, **kw) -> int:
    return s.begin_run(s.machine_id(fp), context(**kw), uuid=uuid)


def test_eight_processes_write_at_once(db):
    """Eight processes open a fresh database at once (the first creates the schema under a lock) and
    append 25 runs each."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(db, w, 25)) for w in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
    assert [p.exitcode for p in procs] == [0] * 8
    with Store(db) as s:
        runs = s.runs()
        assert len(runs) == 200 and all(r["status"] == "ok" for r in runs)
        assert len({r["uuid"] for r in runs}) == 200
        assert len(s.machines()) == 1
        assert s.count("samples") == 200 * 20 and s.count("stages") == 200
        if s.kind == "sqlite":
            assert s.query("PRAGMA journal_mode")[0]["journal_mode"] == "wal"


def test_a_retried_run_appears_once(db):
    """A retry after a dropped connection sends the same run again: same uuid, one run, one outcome."""
    with Store(db) as s:
        first = _run(s, uuid="11111111-2222-3333-4444-555555555555")
        again = _run(s, uuid="11111111-2222-3333-4444-555555555555")
        assert first == again and s.count("runs") == 1
        stages = [{"stage": "load_peak", "estimated_bytes": 5, "measured_peak_bytes": 7},
                  {"stage": "end", "estimated_bytes": 6, "measured_peak_bytes": 9}]
        assert s.finish_run(first, outcome("ok", stages, [(0.0, "rss", 1), (0.1, "rss", 2)])) is True
        assert s.finish_run(first, outcome("ok", stages, [(0.0, "rss", 1), (0.1, "rss", 2)])) is False
        assert (s.count("results"), s.count("stages"), s.count("samples")) == (1, 2, 2)
        assert list(s.run(first).stages) == ["load_peak", "end"]  # in the order they were recorded
        whole = context(model="w", ctx=32)
        a = s.record_run(FP, whole, outcome("oom", stages[:1]), uuid="whole-run")
        b = s.record_run(FP, whole, outcome("oom", stages[:1]), uuid="whole-run")
        assert a == b and s.count("runs") == 2 and s.count("stages") == 3
        memo = s.add_memo(first, {"x": 1}, uuid="memo-1")
        assert s.add_memo(first, {"x": 1}, uuid="memo-1") == memo and len(s.memos()) == 1


@pytest.mark.parametrize("statement", ["UPDATE runs SET model = 'changed'", "DELETE FROM samples",
                                       "DELETE FROM results", "UPDATE machines SET hostname = 'x'"])
def test_history_cannot_be_changed(db, statement):
    """Append-only is the database's rule too, not only the code's: even the owner's UPDATE/DELETE fails."""
    with Store(db) as s:
        rid = _run(s)
        s.finish_run(rid, outcome("ok", [{"stage": "end", "estimated_bytes": 1}], [(0.0, "rss", 1)]))
        with pytest.raises((UserError, sqlite3.IntegrityError), match="append-only"):
            s.engine.write(lambda tx: tx.execute(statement))
        assert s.runs()[0]["model"] == "m" and s.count("samples") == 1 and s.count("results") == 1


def test_missing_values_stay_null_not_zero(db):
    with Store(db) as s:
        rid = _run(s, fp={"kind": "cuda", "gpu_name": None, "total_bytes": None}, quant="bf16", device="cuda:0")
        s.finish_run(rid, outcome("crashed", [{"stage": "load_peak", "estimated_bytes": 5,
                                               "measured_peak_bytes": None}]))
        row = s.query("SELECT measured_peak_bytes, torch_max_allocated FROM stages")[0]
        assert (row["measured_peak_bytes"], row["torch_max_allocated"]) == (None, None)
        assert s.query("SELECT total_bytes FROM machines")[0]["total_bytes"] is None
        frame = runs_frame(s)
        assert frame["measured_peak_bytes"].isna().all()
        out = json.loads(export(s, "json", None))
        assert out[0]["measured_peak_bytes"] is None and out[0]["status"] == "crashed"


def test_interrupted_run_is_listed(db):
    with Store(db) as s:
        _run(s)
        assert export(s, "csv", None).splitlines()[1].count("interrupted") == 1


def test_list_filters_across_machines(db):
    a100 = {**FP, "kind": "cuda", "gpu_name": "NVIDIA A100-SXM4-80GB", "hostname": "a"}
    h100 = {**FP, "kind": "cuda", "gpu_name": "NVIDIA H100 80GB HBM3", "hostname": "b"}
    with Store(db) as s:
        for fp, model, quant, status in ((a100, "llama", "nf4", "ok"), (a100, "qwen", "int8", "oom"),
                                         (h100, "llama", "nf4", "ok"), (h100, "llama", "int8", None)):
            rid = _run(s, fp=fp, model=model, quant=quant, device="cuda:0")
            if status:
                s.finish_run(rid, outcome(status))
    with Store(db, create=False, readonly=True) as s:
        assert len(s.runs()) == 4
        assert [r["hostname"] for r in s.runs(model="llama")] == ["a", "b", "b"]
        assert [r["model"] for r in s.runs(gpu="h100")] == ["llama", "llama"]
        assert [r["quant"] for r in s.runs(gpu="a100", quant="int8")] == ["int8"]
        assert [r["model"] for r in s.runs(status="oom")] == ["qwen"]
        assert [(r["hostname"], r["quant"]) for r in s.runs(status="interrupted")] == [("b", "int8")]
        assert s.runs(gpu="100%") == []  # a LIKE wildcard in the filter is taken literally
        classes = s.class_counts()
        assert sorted((c["runs"], c["ooms"], c["interrupted"]) for c in classes) == [(2, 0, 1), (2, 1, 0)]


def test_read_only_store_cannot_write(db):
    with Store(db) as s:
        _run(s)
    with Store(db, create=False, readonly=True) as s:
        assert len(s.runs()) == 1
        with pytest.raises(RuntimeError, match="read-only"):
            s.machine_id(FP)


# -------------------------------------------------------------------------------------- SQLite

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


def _schema_v2(path) -> None:
    c = sqlite3.connect(path)
    for migration in MIGRATIONS[:2]:
        for statement in migration.split(";"):
            if statement.strip():
                c.execute(statement)
    c.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    c.execute("PRAGMA user_version = 2")
    c.commit()
    c.close()


def test_older_schema_is_upgraded_keeping_rows(tmp_path):
    """A schema-2 file (before uuids): every row kept, every run and memo gets its own uuid, machines
    their class, stages keep their order, and from then on the database refuses UPDATE/DELETE."""
    p = tmp_path / "old.db"
    _schema_v2(p)
    fp = json.dumps({"kind": "cpu", "cpu_model": "x", "total_bytes": 1 << 34, "torch": "2.13.0"}, sort_keys=True)
    _sql(p, f"INSERT INTO machines (fingerprint, kind, cpu_model, total_bytes, torch, created_at) "
            f"VALUES ('{fp}', 'cpu', 'x', {1 << 34}, '2.13.0', 0)",
         "INSERT INTO runs (machine_id, created_at, model, quant, ctx, batch, device, command) "
         "VALUES (1, 0, 'old-model', 'nf4', 512, 1, 'cpu', 'vramcal probe old-model')",
         "INSERT INTO runs (machine_id, created_at, model, quant, ctx, batch, device, command) "
         "VALUES (1, 1, 'old-model', 'nf4', 1024, 1, 'cpu', 'vramcal probe old-model')",
         "INSERT INTO results (run_id, finished_at, status, result_json) VALUES (2, 2, 'ok', '{}')",
         "INSERT INTO stages (run_id, stage, estimated_bytes, measured_peak_bytes) VALUES (2, 'post_load', 1, 2)",
         "INSERT INTO stages (run_id, stage, estimated_bytes, measured_peak_bytes) VALUES (2, 'end', 3, 4)",
         "INSERT INTO memos (run_id, created_at, memo_json) VALUES (2, 3, '{\"run_id\": 2}')",
         "INSERT INTO corrections (machine_id, created_at, stack, stage, intercept_bytes, slope_bytes_per_token, "
         "n_runs, source_runs_json) VALUES (1, 4, 'stack', 'end', 1, 0.0, 1, '[2]')")
    with Store(p) as s:
        assert s.query("PRAGMA user_version")[0]["user_version"] == SCHEMA_VERSION
        runs = s.runs()
        assert [(r["model"], r["status"]) for r in runs] == [("old-model", None), ("old-model", "ok")]
        assert len({r["uuid"] for r in runs}) == 2 and all(r["uuid"] for r in runs)
        assert s.memos()[0]["uuid"] and s.corrections()[0]["uuid"]
        assert s.machines()[0]["class_key"].startswith("kind=cpu|device_model=x|memory_gib=16|")
        assert list(s.run(2).stages) == ["post_load", "end"]
        # runs without an estimate name no estimator; the old correction is the GPU stages' (its stack says
        # nothing of a CPU resident-set model)
        assert [r["estimator_model"] for r in runs] == [None, None]
        assert s.corrections()[0]["estimator_model"] == "gpu-stages/1"
        s.add_corrections(1, "stack", [{"stage": "end", "intercept_bytes": 5, "slope_bytes_per_token": 0.0,
                                        "n_runs": 1, "source_runs": [1], "uuid": "c-1"}], "cpu-rss/2")
        assert s.latest_corrections(1, "stack", "cpu-rss/2")["end"]["intercept_bytes"] == 5
        assert s.latest_corrections(1, "stack", "gpu-stages/1")["end"]["intercept_bytes"] == 1
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            s.engine.write(lambda tx: tx.execute("DELETE FROM runs WHERE id = 1"))


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
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp file left


# ---------------------------------------------------------------------------------- PostgreSQL

def _catalog(url: str) -> list:
    import psycopg

    with psycopg.connect(url) as c:
        return c.execute("SELECT n.nspname, c.relname, c.relkind FROM pg_class c JOIN pg_namespace n "
                         "ON n.oid = c.relnamespace WHERE n.nspname NOT IN ('pg_catalog', 'information_schema', "
                         "'pg_toast') ORDER BY 1, 2").fetchall()


def test_pg_newer_schema_is_refused_untouched(pg_url):
    import psycopg

    Store(pg_url).close()
    with psycopg.connect(pg_url, autocommit=True) as c:
        c.execute("UPDATE vramcal.meta SET value = %s WHERE key = 'schema_version'", (str(SCHEMA_VERSION + 1),))
    before = _catalog(pg_url)
    with pytest.raises(UserError, match="newer than this vramcal"):
        Store(pg_url)
    assert _catalog(pg_url) == before


def test_pg_foreign_schema_is_refused_untouched(pg_url):
    import psycopg

    with psycopg.connect(pg_url, autocommit=True) as c:
        c.execute("CREATE SCHEMA vramcal")
        c.execute("CREATE TABLE vramcal.runs (x int)")
    before = _catalog(pg_url)
    with pytest.raises(UserError, match="did not create"):
        Store(pg_url)
    assert _catalog(pg_url) == before


def test_pg_empty_database_read_only_says_so(pg_url):
    with pytest.raises(UserError, match="no vramcal records"):
        Store(pg_url, create=False, readonly=True)


def test_a_reading_command_upgrades_an_older_file_first(tmp_path):
    p = tmp_path / "old.db"
    _schema_v2(p)
    _sql(p, "INSERT INTO machines (fingerprint, kind, created_at) VALUES ('{}', 'cpu', 0)",
         "INSERT INTO runs (machine_id, created_at, model, quant, ctx, batch, device, command) "
         "VALUES (1, 0, 'old-model', 'nf4', 512, 1, 'cpu', 'c')")
    r = subprocess.run([sys.executable, "-m", "vramcal", "records", "list", "--db", str(p), "--json"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert [run["model"] for run in json.loads(r.stdout)] == ["old-model"]
    with Store(p, create=False, readonly=True) as s:
        assert s.query("PRAGMA user_version")[0]["user_version"] == SCHEMA_VERSION
