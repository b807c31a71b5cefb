"""The fleet store on a real PostgreSQL server (tests/pg_server.py): many writers at once with refits
meanwhile, the server stopped mid-batch, push/pull without duplicates, corrections that travel to a new
host of a known class, roles that make history append-only, and failures that are one line without
the password."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
import uuid

import pytest
from helpers import context, outcome
from pg_server import pg_server, pg_url, wait_until  # noqa: F401 (fixtures)

from vramcal.errors import UserError
from vramcal.estimator.stages import MODEL_IDS
from vramcal.records.engines import redact
from vramcal.records.store import Store

MIB = 1024**2
NS = uuid.UUID("6f1c2a5e-0000-4000-8000-000000000000")
STAGES = ("load_peak", "post_load", "first_token", "end")


def _fp(host: str, *, driver: str = "550.54.15", gpu: str = "NVIDIA H100 80GB HBM3", torch: str = "2.13.0") -> dict:
    return {"kind": "cuda", "gpu_name": gpu, "gpu_uuid": f"GPU-{host}", "total_bytes": 85520809984,
            "driver": driver, "cuda_runtime": "12.8", "torch": torch, "transformers": "5.24.0",
            "bitsandbytes": "0.50.2", "accelerate": "1.15.0", "hostname": host, "cpu_model": "EPYC"}


def _stages(ctx: int, offset: int) -> list[dict]:
    """Estimated and measured bytes per stage: measured = estimated + offset + 1000 B per token."""
    out = []
    for k, stage in enumerate(STAGES):
        est = (k + 1) * 1_000 * MIB + ctx * 4096
        out.append({"stage": stage, "estimated_bytes": est, "measured_peak_bytes": est + offset + ctx * 1000,
                    "measured_used_bytes": est, "torch_max_allocated": est - MIB, "torch_max_reserved": est})
    return out


def _context(model: str = "m", ctx: int = 1024, quant: str = "nf4", **kw):
    """A GPU run compared with this vramcal's GPU estimator (its estimator model id)."""
    from vramcal.estimator.stages import model_id

    args = {"config_hash": f"cfg-{model}", "quant_impl": "bitsandbytes 4-bit", "dtype": "bfloat16",
            "kv_dtype": "auto", "attn": "sdpa", "device": "cuda:0", "command": f"vramcal check {model} --ctx {ctx}",
            "estimator_model": model_id("cuda"), **kw}
    return context(model=model, ctx=ctx, quant=quant, **args)


# ----------------------------------------------------------------------------------------- load

HOSTS = [f"node{i:02d}" for i in range(4)]


def _load_writer(url: str, w: int, n: int, start, out) -> None:
    fp = _fp(HOSTS[w % len(HOSTS)])
    offset = (w % len(HOSTS)) * 8 * MIB
    with Store(url) as s:
        mid = s.machine_id(fp)
        start.wait()
        for i in range(n):
            ctx = 256 * (1 + i % 8)
            run_id = s.begin_run(mid, _context(ctx=ctx, estimate={"w": w, "i": i}),
                                 uuid=str(uuid.uuid5(NS, f"load-{w}-{i}")))
            s.finish_run(run_id, outcome("ok", _stages(ctx, offset), [(0.005 * k, "gpu0", 1000 * k) for k in range(20)],
                                         series="gpu0"))
    out.put(("writer", w, n))


def _load_refitter(url: str, stop, out) -> None:
    from vramcal.calibrate.corrections import refit
    from vramcal.probes.machine import stack_key

    refits = 0
    with Store(url) as s:
        while not stop.is_set():
            for host in HOSTS:
                fp = _fp(host)
                mid = s.find_machine(fp)
                if mid is not None:
                    refit(s, mid, stack_key(fp), "nf4", "cfg-m", "cuda")
                    refits += 1
    out.put(("refitter", refits, 0))


def _check_corrections(s: Store) -> None:
    """Every correction's source runs are finished runs of its machine, and for each scope and stage the
    refits in the order they were recorded see ever more runs: none lost another's update."""
    for m in s.machines():
        ok = {r["id"] for r in s.runs(machine_id=m["id"], status="ok")}
        seen: dict[tuple[str, str], set[int]] = {}
        for c in s.corrections(machine_id=m["id"]):
            runs = set(c["source_runs"])
            assert runs <= ok, "a correction cites runs that are not there"
            assert c["n_runs"] == len(runs)
            before = seen.get((c["stack"], c["stage"]), set())
            assert before <= runs, f"lost update: correction {c['id']} misses runs {sorted(before - runs)[:5]}"
            seen[(c["stack"], c["stage"])] = runs


@pytest.mark.slow
def test_sixteen_writers_and_two_refitters(pg_url, capsys):
    writers, per_writer = 16, 50
    ctx = mp.get_context("spawn")
    start, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    Store(pg_url).close()  # the schema, before the clock starts
    procs = [ctx.Process(target=_load_writer, args=(pg_url, w, per_writer, start, out)) for w in range(writers)]
    refitters = [ctx.Process(target=_load_refitter, args=(pg_url, stop, out)) for _ in range(2)]
    for p in procs + refitters:
        p.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    start.set()
    for p in procs:
        p.join(600)
    wall = time.monotonic() - t0
    stop.set()
    for p in refitters:
        p.join(120)
    assert [p.exitcode for p in procs + refitters] == [0] * (writers + 2)
    reports = [out.get(timeout=10) for _ in range(writers + 2)]
    refits = sum(r[1] for r in reports if r[0] == "refitter")
    total = writers * per_writer
    with Store(pg_url, create=False, readonly=True) as s:
        runs = s.runs()
        assert len(runs) == total
        assert {r["uuid"] for r in runs} == {str(uuid.uuid5(NS, f"load-{w}-{i}"))
                                             for w in range(writers) for i in range(per_writer)}
        assert all(r["status"] == "ok" for r in runs)
        assert s.count("stages") == total * len(STAGES) and s.count("samples") == total * 20
        assert len(s.machines()) == len(HOSTS) and len({m["class_key"] for m in s.machines()}) == 1
        _check_corrections(s)
    with Store(pg_url) as s:  # one more refit after the last run: it sees every run of its machine
        from vramcal.calibrate.corrections import refit
        from vramcal.probes.machine import stack_key

        fp = _fp(HOSTS[0])
        mid = s.find_machine(fp)
        last = refit(s, mid, stack_key(fp), "nf4", "cfg-m", "cuda")
        assert last.stages["end"].source_runs == sorted(r["id"] for r in s.runs(machine_id=mid))
        _check_corrections(s)
    with capsys.disabled():
        print(f"\nfleet load: {writers} writers x {per_writer} runs = {total} runs in {wall:.1f} s = "
              f"{total / wall:.0f} runs/s ({len(STAGES)} stages + 20 samples each, two transactions per run); "
              f"{refits} refits by 2 refitters meanwhile")


# --------------------------------------------------------------------------------------- faults

def _batch_writer(url: str, w: int, n: int, out) -> None:
    """One host's batch: each run whole in one transaction, the same uuids on every attempt."""
    fp = _fp(f"batch{w}")
    try:
        with Store(url, timeout_s=5) as s:
            for i in range(n):
                ctx = 128 * (1 + i % 4)
                s.record_run(fp, _context(ctx=ctx, estimate={"i": i}),
                             outcome("ok", _stages(ctx, 0), [(0.01 * k, "gpu0", k) for k in range(30)], series="gpu0"),
                             uuid=str(uuid.uuid5(NS, f"batch-{w}-{i}")))
                time.sleep(0.01)
    except UserError as exc:
        out.put((w, str(exc)))
        return
    out.put((w, None))


@pytest.mark.slow
def test_server_stopped_mid_batch(pg_server):
    url = pg_server.url(pg_server.create_database("fault"))
    Store(url).close()
    writers, n = 4, 150
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_batch_writer, args=(url, w, n, out)) for w in range(writers)]
    for p in procs:
        p.start()
    with Store(url, create=False, readonly=True) as s:
        assert wait_until(lambda: s.count("runs") >= 60, 120)
    pg_server.stop("immediate")  # as if the server's host lost power
    try:
        for p in procs:
            p.join(120)
        reports = dict(out.get(timeout=10) for _ in range(writers))
    finally:
        pg_server.start()
    lost = {w: msg for w, msg in reports.items() if msg}
    assert lost, "no writer noticed the server going away"
    for msg in lost.values():  # one line each, saying what happened, no password
        assert "\n" not in msg and "connection" in msg and pg_server.password not in msg, msg
    with Store(url, create=False, readonly=True) as s:
        committed = {r["uuid"]: r["id"] for r in s.runs()}
        assert 60 <= len(committed) < writers * n
        for r in s.runs():  # none half-written
            run = s.run(r["id"])
            assert run.status == "ok" and list(run.stages) == list(STAGES) and run.sample_count == 30
    # the retry: the same batches again add exactly what was missing
    procs = [ctx.Process(target=_batch_writer, args=(url, w, n, out)) for w in range(writers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    assert [out.get(timeout=10)[1] for _ in range(writers)] == [None] * writers
    with Store(url, create=False, readonly=True) as s:
        after = {r["uuid"]: r["id"] for r in s.runs()}
        assert len(after) == writers * n and s.count("results") == writers * n
        assert s.count("samples") == writers * n * 30
        assert all(after[u] == i for u, i in committed.items())  # the committed ones kept their ids


# ------------------------------------------------------------------------------------ push / pull

def _history(path) -> None:
    """200 runs from two machines, with stages, samples, a few memos and each machine's corrections."""
    from vramcal.calibrate.corrections import refit
    from vramcal.probes.machine import stack_key

    with Store(path) as s:
        for host, offset in (("laptop", 0), ("airgap", 50 * MIB)):
            fp = _fp(host, driver="535.1" if host == "airgap" else "550.2")
            mid = s.machine_id(fp)
            for i in range(100):
                ctx = 512 * (1 + i % 5)
                rid = s.begin_run(mid, _context(model=f"m{i % 3}", ctx=ctx, estimate={"peak": i}))
                if i == 99:
                    continue  # still running when it was pushed
                status = "oom" if i % 17 == 0 else "ok"
                s.finish_run(rid, outcome(status, _stages(ctx, offset + i * 1000)[:3 if status == "oom" else 4],
                                          [(0.01 * k, "gpu0", 7 * k + i) for k in range(5 + i % 4)], series="gpu0",
                                          oom={"stage": "end"} if status == "oom" else None))
                if i % 25 == 0:
                    s.add_memo(rid, {"run_id": rid, "peak_bytes": i})
            refit(s, mid, stack_key(fp), "nf4", "cfg-m0", "cuda")


def _snapshot(s: Store) -> dict:
    """Everything a store holds, keyed by identity rather than by its own integer ids."""
    machines = {m["id"]: m["fingerprint"] for m in s.machines()}
    runs = {r["id"]: r["uuid"] for r in s.query("SELECT id, uuid FROM runs")}
    strip = lambda row, *keys: {k: v for k, v in row.items() if k not in keys}  # noqa: E731
    snap: dict = {"machines": sorted((strip(m, "id") for m in s.machines()), key=lambda m: m["fingerprint"])}
    snap["runs"] = {r["uuid"]: {**strip(r, "id", "machine_id"), "machine": machines[r["machine_id"]]}
                    for r in s.query("SELECT * FROM runs")}
    snap["results"] = {runs[r["run_id"]]: strip(r, "run_id") for r in s.query("SELECT * FROM results")}
    snap["stages"] = {}
    for st in s.query("SELECT * FROM stages ORDER BY run_id, seq"):
        snap["stages"].setdefault(runs[st["run_id"]], []).append(strip(st, "run_id"))
    snap["samples"] = {}
    for sm in s.query("SELECT run_id, t, series, bytes FROM samples"):
        snap["samples"].setdefault(runs[sm["run_id"]], []).append((sm["t"], sm["series"], sm["bytes"]))
    snap["samples"] = {k: sorted(v) for k, v in snap["samples"].items()}
    memos = {}
    for m in s.query("SELECT * FROM memos"):
        body = json.loads(m["memo_json"])
        body["run_id"] = runs[body["run_id"]]
        memos[m["uuid"]] = {**strip(m, "id", "run_id", "memo_json"), "run": runs[m["run_id"]], "body": body}
    snap["memos"] = memos
    snap["corrections"] = {c["uuid"]: {**strip(c, "id", "machine_id", "source_runs"),
                                       "machine": machines[c["machine_id"]],
                                       "source_runs": sorted(runs[r] for r in c["source_runs"])}
                           for c in s.corrections()}
    return snap


def test_push_twice_then_pull(pg_url, tmp_path):
    local = tmp_path / "laptop.db"
    _history(local)
    with Store(local, create=False, readonly=True) as src:
        want = _snapshot(src)
    assert len(want["runs"]) == 200 and len(want["results"]) == 198 and len(want["memos"]) == 8

    from vramcal.records.sync import pull, push

    first = push(local, pg_url)
    assert (first.machines_added, first.runs_added, first.outcomes_added, first.memos_added) == (2, 200, 198, 8)
    assert first.corrections_added == len(want["corrections"]) > 0
    second = push(local, pg_url)
    assert second.nothing_new and second.runs_in_source == 200, second
    with Store(pg_url, create=False, readonly=True) as fleet:
        assert fleet.count("runs") == 200
        assert _snapshot(fleet) == want  # machines, runs, outcomes, stages, samples, memos: field by field

    # the run that was still running finishes, and one more is recorded: the next push copies just that
    with Store(local) as s:
        unfinished = [r for r in s.runs() if r["status"] is None]
        assert len(unfinished) == 2
        s.finish_run(unfinished[0]["id"], outcome("ok", _stages(512, 0), [(0.0, "gpu0", 1)]))
        s.record_run(_fp("laptop", driver="550.2"), _context(ctx=64), outcome("ok", _stages(64, 0)))
    third = push(local, pg_url)
    assert (third.runs_added, third.outcomes_added, third.machines_added) == (1, 2, 0)

    back = tmp_path / "pulled.db"
    pulled = pull(pg_url, back)
    assert pulled.runs_added == 201
    with Store(local, create=False, readonly=True) as a, Store(back, create=False, readonly=True) as b:
        assert _snapshot(a) == _snapshot(b)
    assert pull(pg_url, back).nothing_new


# --------------------------------------------------------------------------- corrections that travel

@pytest.fixture(params=["sqlite", "postgresql"])
def db(request, tmp_path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "records.db")
    return request.getfixturevalue("pg_url")


def test_a_new_host_of_a_known_class_uses_the_class_correction(db):
    from vramcal.calibrate.corrections import find_correction, refit
    from vramcal.estimator.correction import apply
    from vramcal.probes.machine import stack_key

    with Store(db) as s:
        for host, offset in (("a", 100 * MIB), ("b", 120 * MIB)):
            fp = _fp(host, driver=f"550.{len(host)}")  # same driver major: same class
            mid = s.machine_id(fp)
            for ctx in (1024, 2048, 4096):
                s.record_run(fp, _context(ctx=ctx), outcome("ok", _stages(ctx, offset)))
            refit(s, mid, stack_key(fp), "nf4", "cfg-m", "cuda")
        s.record_run(_fp("z", driver="535.1"), _context(ctx=1024), outcome("ok", _stages(1024, 900 * MIB)))

    with Store(db, create=False, readonly=True) as s:
        new = _fp("c", driver="550.99")
        found = find_correction(s, new, "nf4", "cfg-m")
        assert found.source == "class" and found.scope == "same model and quant"
        assert found.hosts == ["a", "b"] and len(found.runs) == 6
        end = found.corrections["end"]
        # pooled: 110 MiB + 1000 B/token; each host 10 MiB off it; spread between hosts 20 MiB widens the band
        assert abs(end.intercept_bytes - 110 * MIB) < 1024 and abs(end.slope_bytes_per_token - 1000) < 1e-6
        assert found.host_spread_bytes["end"] == 20 * MIB
        assert abs(end.residual_p95_bytes - 30 * MIB) < 1024
        shown = found.as_set()  # what an estimate applies and prints
        assert shown.scope.startswith("machine class NVIDIA H100 80GB HBM3, 80 GiB, driver 550, CUDA 12.8")
        assert "2 hosts" in shown.scope and shown.hosts == ["a", "b"] and len(shown.source_runs) == 6
        fixed = apply({k: 5000 * MIB for k in STAGES}, 2048, shown.stages)
        assert fixed["end"] == 5000 * MIB + 110 * MIB + 2048 * 1000

        own = find_correction(s, _fp("a", driver="550.1"), "nf4", "cfg-m")
        assert own.source == "machine" and own.hosts == ["a"] and own.as_set().scope.startswith("this machine")
        assert abs(own.corrections["end"].intercept_bytes - 100 * MIB) < 1024
        other_class = find_correction(s, _fp("y", driver="560.1"), "nf4", "cfg-m")
        assert other_class.source is None and not other_class.corrections


def test_corrected_estimate_on_a_new_host_says_it_used_the_class(tmp_path, db):
    """The library's corrected estimate, on this (unrecorded) machine, when two other hosts of its class
    have measured the same model: the class's correction is applied and named, with its hosts."""
    from conftest import TINY

    from vramcal.calibrate.corrections import corrected_estimate, refit
    from vramcal.probes.machine import machine_fingerprint, stack_key

    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY["dense-gqa"]))
    raw = corrected_estimate(str(model), "bf16", 256, 1, device="cpu", db=db)
    assert raw.correction is None  # nothing recorded yet
    here = machine_fingerprint("cpu")
    with Store(db) as s:
        for host, extra in (("rack-1", 30 * MIB), ("rack-2", 34 * MIB)):
            fp = {**here, "hostname": host}
            for ctx in (128, 256, 512):
                stages = [{"stage": k, "estimated_bytes": v, "measured_peak_bytes": v + extra}
                          for k, v in raw.stages.items()]
                s.record_run(fp, _context(ctx=ctx, config_hash=raw.config_hash, quant=raw.quant, device="cpu",
                                          estimator_model=raw.estimator_model), outcome("ok", stages))
            refit(s, s.find_machine(fp), stack_key(fp), raw.quant, raw.config_hash, "cpu")
        assert s.find_machine(here) is None
    est = corrected_estimate(str(model), "bf16", 256, 1, device="cpu", db=db)
    c = est.correction
    assert c.scope.startswith("machine class ") and "same model and quant" in c.scope, c.scope
    assert c.hosts == ["rack-1", "rack-2"] and len(c.source_runs) == 6
    assert est.stages["end"] == raw.stages["end"] + 32 * MIB
    assert c.p95_residual["end"] >= 4 * MIB  # the two hosts differ by 4 MiB: the band says so


def test_class_summary(db):
    from vramcal.calibrate.corrections import class_summary

    with Store(db) as s:
        for host in ("a", "b"):
            for i, ctx in enumerate((1024, 2048, 4096)):
                s.record_run(_fp(host), _context(ctx=ctx), outcome("oom" if i == 2 else "ok",
                                                                   _stages(ctx, 10 * MIB if host == "a" else 0)))
        s.record_run(_fp("cpu-box", gpu="NVIDIA L4", driver="535.1"), _context(), None)
        rows = {r.label.split(",")[0]: r for r in class_summary(s)}
    h100, l4 = rows["NVIDIA H100 80GB HBM3"], rows["NVIDIA L4"]
    assert (h100.runs, h100.ok, h100.ooms, h100.hosts) == (6, 4, 2, ["a", "b"])
    assert (l4.runs, l4.interrupted, l4.corrections) == (1, 1, {})
    assert h100.corrections["end"]["n_runs"] == 4 and h100.corrections["end"]["host_spread_bytes"] > 0


# -------------------------------------------------------------------------------------- security

def test_writer_role_cannot_change_history(pg_server):
    import psycopg

    from vramcal.records.roles import init_fleet

    admin = pg_server.url(pg_server.create_database("fleet"))
    made = init_fleet(admin, writer_password="writer-secret")
    assert made.roles_created == ["vramcal_owner", "vramcal_writer"] or made.roles_created == []
    assert "writer-secret" not in json.dumps(made.to_dict()) and pg_server.password not in json.dumps(made.to_dict())
    again = init_fleet(admin)  # idempotent
    assert again.roles_created == [] and again.schema_version == made.schema_version
    writer = admin.replace(f"postgres:{pg_server.password}@", "vramcal_writer:writer-secret@")

    with Store(writer) as s:  # hosts write and refit as the writer
        from vramcal.calibrate.corrections import refit
        from vramcal.probes.machine import stack_key

        rid = s.record_run(_fp("w"), _context(), outcome("ok", _stages(1024, 0), [(0.0, "gpu0", 1)]))
        refit(s, s.find_machine(_fp("w")), stack_key(_fp("w")), "nf4", "cfg-m", "cuda")
        s.add_memo(rid, {"run_id": rid})
        with pytest.raises(UserError, match="not allowed"):
            s.engine.write(lambda tx: tx.execute("UPDATE runs SET model = 'x'"))
    with psycopg.connect(writer, autocommit=True) as c:
        c.execute("SET search_path TO vramcal")
        for statement in ("UPDATE runs SET model = 'forged'", "DELETE FROM runs", "DELETE FROM samples",
                          "UPDATE corrections SET intercept_bytes = 0", "TRUNCATE results CASCADE",
                          "UPDATE meta SET value = '99'", "CREATE TABLE evil (x int)", "DROP TABLE memos CASCADE"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                c.execute(statement)
    with psycopg.connect(admin, autocommit=True) as c:  # the owner may not either: the triggers
        c.execute("SET ROLE vramcal_owner")
        c.execute("SET search_path TO vramcal")
        with pytest.raises(psycopg.errors.RaiseException, match="append-only"):
            c.execute("DELETE FROM runs")
        with pytest.raises(psycopg.errors.RaiseException, match="append-only"):
            c.execute("TRUNCATE samples")
        assert c.execute("SELECT count(*) FROM runs").fetchone()[0] == 1
        assert c.execute("SELECT model FROM runs").fetchone()[0] == "m"


# ------------------------------------------------------------------------------- operations

def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vramcal", *args], capture_output=True, text=True,
                          env={**os.environ, "VRAMCAL_DB_TIMEOUT": "5"})


def test_connection_failures_are_one_line_without_the_password(pg_server):
    name = pg_server.create_database("ops")
    Store(pg_server.url(name)).close()
    wrong = pg_server.url(name, user="postgres", password="not-the-password")
    closed = wrong.replace(f":{pg_server.port}/", ":1/")
    tls = pg_server.url(name).replace("sslmode=disable", "sslmode=require")  # the server speaks no TLS
    for url, needle in ((wrong, "password authentication failed"), (closed, "cannot connect"),
                        (tls, "SSL")):
        r = _cli("records", "list", "--db", url)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert needle in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert "not-the-password" not in r.stderr and pg_server.password not in r.stderr, r.stderr
    ok = _cli("records", "list", "--db", pg_server.url(name))
    assert ok.returncode == 0, ok.stderr


@pytest.mark.parametrize("text,want", [
    ("postgresql://u:s3cret@host:5432/db?sslmode=require", "postgresql://u:***@host:5432/db?sslmode=require"),
    ("postgres://u:p%40ss@h/db", "postgres://u:***@h/db"),
    ("postgresql://u@h/db?password=s3cret&sslmode=verify-full", "postgresql://u@h/db?password=***&sslmode=verify-full"),
    ("postgresql://h/db", "postgresql://h/db"),
    ("host=h password=s3cret dbname=x", "host=h password=*** dbname=x"),
])
def test_redact(text, want):
    assert redact(text) == want


def test_unrecorded_run_is_kept_and_recorded_once(tmp_path, db):
    from vramcal.records.unrecorded import record_saved, run_payload, save_unrecorded

    payload = run_payload(_fp("h"), _context(estimate={"peak": 1}), outcome("ok", _stages(1024, 0), [(0.0, "gpu0", 5)]),
                          error="the server was down")
    path = save_unrecorded(payload, tmp_path / "unrecorded")
    assert path.parent == tmp_path / "unrecorded" and path.name == f"run-{payload['uuid']}.json"
    with Store(db) as s:
        rid, added = record_saved(s, path)
        assert added and record_saved(s, path) == (rid, False) and s.count("runs") == 1
        run = s.run(rid)
        assert run.uuid == payload["uuid"] and list(run.stages) == list(STAGES) and run.sample_count == 1


# ------------------------------------------------------------------------------------ command line

def test_records_commands_on_a_fleet(pg_server, tmp_path):
    admin = pg_server.url(pg_server.create_database("cli"))
    r = subprocess.run([sys.executable, "-m", "vramcal", "records", "init-fleet", "--db", admin, "--json"],
                       capture_output=True, text=True, env={**os.environ, "VRAMCAL_WRITER_PASSWORD": "w-secret"})
    assert r.returncode == 0, r.stderr
    made = json.loads(r.stdout)
    assert made["writer"] == "vramcal_writer" and "w-secret" not in r.stdout + r.stderr
    assert pg_server.password not in r.stdout + r.stderr
    writer = admin.replace(f"postgres:{pg_server.password}@", "vramcal_writer:w-secret@")

    local = tmp_path / "laptop.db"
    _history(local)
    first = _cli("records", "push", "--db", str(local), "--to", writer)
    assert first.returncode == 0 and "200 runs" in first.stdout and "w-secret" not in first.stdout, first.stderr
    again = _cli("records", "push", "--db", str(local), "--to", writer)
    assert again.returncode == 0 and "nothing copied" in again.stdout, again.stdout

    listed = _cli("records", "list", "--db", writer, "--all-machines", "--json", "--status", "oom", "--model", "m0")
    runs = json.loads(listed.stdout)
    assert runs and all(r["status"] == "oom" and r["model"] == "m0" for r in runs)
    assert {r["hostname"] for r in runs} == {"laptop", "airgap"}
    mine = _cli("records", "list", "--db", writer, "--json")  # this host recorded nothing there
    assert mine.returncode == 0 and json.loads(mine.stdout) == []
    table = _cli("records", "list", "--db", writer, "--all-machines", "--gpu", "h100", "--host", "airgap")
    assert table.returncode == 0 and len(table.stdout.splitlines()) == 101 and "airgap" in table.stdout

    summary = _cli("records", "summary", "--db", writer, "--json")
    rows = json.loads(summary.stdout)
    assert len(rows) == 2 and sum(r["runs"] for r in rows) == 200  # two driver majors: two classes
    assert all(r["corrections"]["end"]["n_runs"] > 0 for r in rows)
    assert "p95 band" in _cli("records", "summary", "--db", writer).stdout

    back = tmp_path / "back.db"
    pulled = _cli("records", "pull", "--from", writer, "--db", str(back), "--json")
    assert pulled.returncode == 0 and json.loads(pulled.stdout)["runs_added"] == 200, pulled.stderr

    bad = _cli("records", "list", "--db", writer, "--to", "x")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_records_import_saved_runs(tmp_path):
    from vramcal.records.unrecorded import run_payload, save_unrecorded

    paths = [save_unrecorded(run_payload(_fp("h"), _context(ctx=64 * (i + 1)), outcome("ok", _stages(64, 0))),
                             tmp_path / "saved") for i in range(2)]
    db = tmp_path / "r.db"
    r = _cli("records", "import", *map(str, paths), "--db", str(db))
    assert r.returncode == 0 and r.stdout.count("recorded ") == 2, r.stderr
    assert not any(p.exists() for p in paths)
    with Store(db, create=False, readonly=True) as s:
        assert s.count("runs") == 2 and s.count("stages") == 8


def _probe_result(stages: dict, estimate, status: str = "ok", series: str = "rss"):
    """A probe result as run_probe returns it, from {stage: (used, peak)}."""
    from vramcal.probes.readings import StageReading
    from vramcal.probes.result import ProbeResult

    readings = {k: StageReading(k, series, u, p) for k, (u, p) in stages.items()}
    samples = [{"t": 0.1 * i, series: i} for i in range(3)]
    return ProbeResult(status, "cpu", "tiny", "bf16", "bf16", "bfloat16", 256, 1, "sdpa", series, readings,
                       list(stages)[-1], None, None, len(samples), samples, 5.0, 0.01, 1.5, "vramcal check tiny",
                       estimate=estimate)


def _cpu_estimate(stages: dict, model: str):
    from vramcal.estimator.result import Estimate

    return Estimate("tiny", "LlamaForCausalLM", "bf16", "torch", "bfloat16", 256, 1, "auto", "sdpa", "dynamic", "cpu",
                    {}, stages, stages, max(stages.values()), False, {"weights": "meta"}, {}, {}, None,
                    estimator_model=model)


def test_a_probe_that_could_not_be_recorded_is_kept_whole(tmp_path):
    """What check keeps when the database fails after the probe: imported later, it is the same record
    record_probe would have written, completing the run whose context was written first."""
    from vramcal.calibrate.runs import record_probe, save_probe_unrecorded
    from vramcal.records.store import new_uuid
    from vramcal.records.unrecorded import record_saved

    est = _cpu_estimate({"load_peak": 300 * MIB, "post_load": 300 * MIB, "first_token": 380 * MIB,
                         "end": 380 * MIB}, MODEL_IDS["cpu"])
    result = _probe_result({"baseline": (100 * MIB, 100 * MIB), "post_load": (400 * MIB, 450 * MIB),
                            "end": (420 * MIB, 500 * MIB)}, est)
    fp = _fp("h")
    ctx = context(model="tiny", quant="bf16", ctx=256, command="vramcal check tiny", estimate=est.to_dict())
    with Store(tmp_path / "a.db") as a:
        rid = a.begin_run(a.machine_id(fp), ctx)
        record_probe(a, rid, result)
        want = a.run(rid)
    run_uuid = new_uuid()
    with Store(tmp_path / "b.db") as b:  # the context was written, then the database failed
        first = b.begin_run(b.machine_id(fp), ctx, uuid=run_uuid)
    path = save_probe_unrecorded(fp, ctx, result, run_uuid=run_uuid, error="lost the connection",
                                 folder=tmp_path / "kept")
    with Store(tmp_path / "b.db") as b:
        assert record_saved(b, path) == (first, True) and b.count("runs") == 1
        got = b.run(first)
    assert (got.status, got.outcome.last_stage, got.sample_count) == (want.status, want.outcome.last_stage,
                                                                      want.sample_count)
    assert got.outcome.stages == want.outcome.stages and got.outcome.result == want.outcome.result


def test_runs_of_another_estimator_model_do_not_correct_it(db):
    """A run compared with an older estimator's figures (here the first CPU resident-set model) would add
    its difference again to the current estimate, which already holds what that one missed: only runs of
    the current estimator model are fitted, and old runs stay in the records."""
    from vramcal.calibrate import corrections
    from vramcal.calibrate.runs import record_probe

    measured = {"baseline": (100 * MIB, 100 * MIB), **{st: (1100 * MIB, 1100 * MIB) for st in STAGES}}
    fp = {**_fp("cpu-host"), "kind": "cpu", "gpu_name": None, "gpu_uuid": None}
    ids = {}
    with Store(db) as s:
        mid = s.machine_id(fp)
        for name, model, est_bytes in (("old", "cpu-rss/1", 200 * MIB), ("new", MODEL_IDS["cpu"], 900 * MIB)):
            est = _cpu_estimate(dict.fromkeys(STAGES, est_bytes), model)
            ids[name] = s.begin_run(mid, context(model="tiny", device="cpu", estimate=est.to_dict(),
                                                 estimator_model=model))
            record_probe(s, ids[name], _probe_result(measured, est))
        rows = s.stage_rows(mid)
        corr = corrections.fit_corrections(rows)
    assert {r["run_id"] for r in rows} == set(ids.values())  # both kept, ...
    assert corr["end"].source_runs == [ids["new"]] and corr["end"].intercept_bytes == 100 * MIB  # ... one corrects
