"""Round three of the adversarial pass, the records / images / memo half: sizes in PiB, special files as
the records database, runs whose weights could not be written, poisoned imports and their withdrawal,
memos whose Python must run as printed, and image workloads that must be monotone and bounded."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from helpers import context, outcome

from vramcal.errors import UserError
from vramcal.records.store import Store

VRAMCAL = [sys.executable, "-m", "vramcal"]


def run(*args, env=None, timeout=120, **kw):
    return subprocess.run(VRAMCAL + list(args), capture_output=True, text=True, env={**os.environ, **(env or {})},
                          timeout=timeout, **kw)


def one_line(r, needle: str, code: int = 2) -> None:
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr


# ------------------------------------------------------------------------------------- sizes

def test_pib_is_read_as_1024_tib():
    from vramcal.units import parse_size, size_option

    assert parse_size("1PiB") == parse_size("1024TiB") == 1024**5
    assert parse_size("2 PB") == 2 * 1000**5
    assert parse_size("1P") == 1024**5
    assert size_option("1.5PiB", "--budget") == int(1.5 * 1024**5)
    with pytest.raises(UserError, match="bits"):
        size_option("1Pb", "--budget")


# ------------------------------------------------------------------- special files as the database

@pytest.mark.parametrize("args", [["records", "list"], ["records", "show", "1"],
                                  ["records", "push", "--to", "{other}"], ["records", "pull", "--from", "{other}"]])
def test_a_fifo_as_the_database_is_one_line_not_a_hang(tmp_path, args):
    fifo = tmp_path / "records.db"
    os.mkfifo(fifo)
    other = tmp_path / "other.db"
    Store(other).close()
    args = [a.replace("{other}", str(other)) for a in args]
    t0 = time.monotonic()
    r = run(*args, "--db", str(fifo), timeout=30)
    assert time.monotonic() - t0 < 15  # the same bound as any unreadable database (3 s here, more when loaded)
    one_line(r, "FIFO")


def test_a_fifo_as_the_source_of_a_pull_or_the_target_of_a_push(tmp_path):
    fifo = tmp_path / "pipe.db"
    os.mkfifo(fifo)
    db = tmp_path / "records.db"
    Store(db).close()
    one_line(run("records", "push", "--to", str(fifo), "--db", str(db), timeout=30), "FIFO")
    one_line(run("records", "pull", "--from", str(fifo), "--db", str(db), timeout=30), "FIFO")


def test_a_fifo_beside_the_database_as_its_wal(tmp_path):
    db = tmp_path / "records.db"
    Store(db).close()
    os.mkfifo(f"{db}-wal")
    one_line(run("records", "list", "--db", str(db), timeout=30), "-wal")


def test_dev_null_as_the_database_is_a_clear_line():
    for args in (["records", "list"], ["records", "push", "--to", "/tmp/never-made.db"]):
        r = run(*args, "--db", os.devnull, timeout=30)
        one_line(r, "device")
        assert "disk I/O" not in r.stderr
    with pytest.raises(UserError, match="device"):
        Store(os.devnull)


# --------------------------------------------------------- synthetic weights that cannot be written

def _tiny_config(**over) -> dict:
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
           "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
           "vocab_size": 256, "max_position_embeddings": 512, "torch_dtype": "float32"}
    cfg.update(over)
    return cfg


def test_synthetic_weights_without_room_change_no_database(tmp_path):
    """2 TiB of random weights: refused before the run is recorded, the database byte for byte as it was."""
    import hashlib
    import json

    d = tmp_path / "huge"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(_tiny_config(hidden_size=1 << 19, vocab_size=1 << 21,
                                                           num_hidden_layers=1, torch_dtype="bfloat16")))
    db = tmp_path / "r.db"
    with Store(db) as s:
        s.machine_id({"kind": "cpu", "hostname": "h"})
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    r = run("check", str(d), "--synthetic", "--device", "cpu", "--ctx", "64", "--db", str(db))
    one_line(r, "nothing was run or recorded")
    assert "TiB" in r.stderr or "GiB" in r.stderr
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before


def test_synthetic_room_counts_the_checkpoint_against_the_temp_disk(tmp_path, monkeypatch):
    import json
    import shutil

    from vramcal.estimator.quant import resolve_quant
    from vramcal.estimator.resolve import resolve_model
    from vramcal.probes import synthetic

    d = tmp_path / "tiny"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(_tiny_config()))
    source = resolve_model(str(d))
    spec = resolve_quant("auto", source.config, None)
    need = synthetic.checkpoint_bytes(source, spec)
    assert need == 4 * (256 * 64 * 2 + 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64) + 64)
    assert synthetic.check_room(source, spec, str(tmp_path)) == need
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=need - 1))
    with pytest.raises(UserError, match="TMPDIR"):
        synthetic.check_room(source, spec, str(tmp_path))


# ------------------------------------------------------------- physics: imported and copied runs

from pg_server import pg_server, pg_url  # noqa: E402,F401 (fixtures)
from test_fleet import MIB, _context, _fp, _stages  # noqa: E402

BAD = -10**15


def _saved(tmp_path, name="run.json", fp=None, stages=None, samples=(), **kw):
    import json

    from vramcal.records.unrecorded import run_payload

    o = outcome("ok", stages if stages is not None else _stages(1024, 64 * MIB), samples, series="gpu0", **kw)
    p = tmp_path / name
    p.write_text(json.dumps(run_payload(fp or _fp("a"), _context(), o)))
    return p


def _poisoned_stages():
    return [{**s, "measured_peak_bytes": BAD} for s in _stages(1024, 0)]


@pytest.mark.parametrize("case, needle", [
    ("negative", "cannot be negative"),
    ("above_device", "above the device's total"),
    ("above_pib", "to 1,125,899,906,842,624"),  # one PiB: the type check says it first
    ("cpu_far_below_baseline", "falls at most"),
    ("out_of_order", "in the order a probe passes them"),
    ("sample_after_end", "inside the run"),
    ("sample_above_device", "above the device's total"),
    ("torch_above_device", "above the device's total"),
])
def test_imported_runs_are_checked_by_physics(tmp_path, case, needle):
    from vramcal.records.unrecorded import load_saved
    from vramcal.records.validate import InvalidRecord

    fp, stages, samples, kw = _fp("a"), _stages(1024, 64 * MIB), [(0.0, "gpu0", 10), (1.0, "gpu0", 20)], {}
    if case == "negative":
        stages = _poisoned_stages()
    elif case == "above_device":
        stages[2]["measured_used_bytes"] = fp["total_bytes"] + 1
    elif case == "above_pib":
        fp = {k: v for k, v in fp.items() if k != "total_bytes"}
        stages[0]["measured_peak_bytes"] = (1 << 50) + 1
    elif case == "cpu_far_below_baseline":
        p = tmp_path / "cpu.json"
        import json

        from vramcal.records.unrecorded import run_payload

        o = outcome("ok", [{"stage": "baseline", "measured_used_bytes": 900 * MIB, "measured_peak_bytes": 900 * MIB},
                           {"stage": "end", "estimated_bytes": MIB, "measured_peak_bytes": BAD}], series="rss")
        cpu_fp = {"kind": "cpu", "hostname": "h", "torch": "2.13.0"}  # no total: the baseline bounds it
        p.write_text(json.dumps(run_payload(cpu_fp, context(device="cpu"), o)))
        with pytest.raises(InvalidRecord, match=needle):
            load_saved(p)
        return
    elif case == "out_of_order":
        stages = [stages[1], stages[0], *stages[2:]]
    elif case == "sample_after_end":
        kw["wall_s"] = 10.0
        samples = [(0.0, "gpu0", 10), (3600.0, "gpu0", 20)]
    elif case == "sample_above_device":
        samples = [(0.0, "gpu0", fp["total_bytes"] * 2)]
    elif case == "torch_above_device":
        stages[1]["torch_max_reserved"] = fp["total_bytes"] * 3
    p = _saved(tmp_path, fp=fp, stages=stages, samples=samples, **kw)
    with pytest.raises(InvalidRecord, match=needle):
        load_saved(p)


def test_a_poisoned_import_is_one_line_and_writes_nothing(tmp_path):
    import hashlib

    db = tmp_path / "r.db"
    good = _saved(tmp_path, "good.json")
    bad = _saved(tmp_path, "bad.json", stages=_poisoned_stages())
    Store(db).close()
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    one_line(run("records", "import", str(good), str(bad), "--db", str(db)), "cannot be negative")
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before
    assert good.exists() and bad.exists()
    r = run("records", "import", str(good), "--db", str(db))  # a sane one still goes in
    assert r.returncode == 0, r.stderr


def test_push_and_pull_leave_a_poisoned_run_out(tmp_path):
    from vramcal.records.sync import pull, push

    src, dst = tmp_path / "src.db", tmp_path / "dst.db"
    with Store(src) as s:  # a store poisoned before imports were checked by physics
        s.record_run(_fp("a"), _context(ctx=1024), outcome("ok", _stages(1024, 0)))
        s.record_run(_fp("a"), _context(ctx=2048), outcome("ok", _poisoned_stages()))
    report = push(src, str(dst))
    assert report.runs_added == 1 and len(report.skipped) == 1 and "cannot be negative" in report.skipped[0]
    back = tmp_path / "back.db"
    assert pull(str(dst), back).runs_added == 1


# ------------------------------------------------------------------------------- withdrawals

@pytest.fixture(params=["sqlite", "postgresql"])
def db(request, tmp_path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "records.db")
    return request.getfixturevalue("pg_url")


def _poisoned_history(db: str) -> tuple[dict, int]:
    """Three sane runs of host a (measured = estimated + 100 MiB + 1000 B/token), one poisoned run that
    got in before the physics checks, and the correction refitted after it: absurd."""
    from vramcal.calibrate.corrections import refit
    from vramcal.probes.machine import stack_key

    fp = _fp("a")
    with Store(db) as s:
        mid = s.machine_id(fp)
        for ctx in (1024, 2048, 4096):
            s.record_run(fp, _context(ctx=ctx), outcome("ok", _stages(ctx, 100 * MIB), series="gpu0"))
        bad = s.record_run(fp, _context(ctx=3072), outcome("ok", _poisoned_stages(), series="gpu0"))
        absurd = refit(s, mid, stack_key(fp), "nf4", "cfg-m", "cuda").stages["end"]
    assert abs(absurd.at(8192) - 100 * MIB - 8192 * 1000) > 10**14  # the issue saw "+2,709,302 GiB"
    return fp, bad


def _digest(db: str) -> str | None:
    import hashlib

    return None if "://" in db else hashlib.sha256(open(db, "rb").read()).hexdigest()


def _count(db: str, table: str) -> int:
    with Store(db, create=False, readonly=True) as s:
        return s.count(table)


def test_withdraw_takes_a_run_out_of_every_correction(db):
    from vramcal.calibrate.corrections import find_correction

    fp, bad = _poisoned_history(db)
    r = run("records", "withdraw", str(bad), "--why", "imported by mistake: peaks of -10^15 bytes", "--db", db)
    assert r.returncode == 0, r.stderr
    assert f"run {bad} withdrawn" in r.stdout and "refitted" in r.stdout
    with Store(db, create=False, readonly=True) as s:
        run_rec = s.run(bad)  # the run stays, as everything recorded does
        assert run_rec is not None and run_rec.withdrawn and run_rec.stages["end"].measured_peak_bytes == BAD
        assert run_rec.withdrawals[0]["why"] == "imported by mistake: peaks of -10^15 bytes"
        own = find_correction(s, fp, "nf4", "cfg-m")  # this machine: refitted from the three sane runs
        assert own.source == "machine" and bad not in own.runs and len(own.runs) == 3
        assert abs(own.corrections["end"].intercept_bytes - 100 * MIB) < 1024
        peer = find_correction(s, _fp("b", driver="550.9"), "nf4", "cfg-m")  # the fleet: the class's pooled fit
        assert peer.source == "class" and bad not in peer.runs
        assert abs(peer.corrections["end"].intercept_bytes - 100 * MIB) < 1024
    listed = run("records", "list", "--all-machines", "--db", db)
    line = next(ln for ln in listed.stdout.splitlines() if ln.split()[0] == str(bad))
    assert "(withdrawn)" in line
    assert sum("(withdrawn)" in ln for ln in listed.stdout.splitlines()) == 1
    shown = run("records", "show", str(bad), "--db", db)
    assert "WITHDRAWN" in shown.stdout and "imported by mistake" in shown.stdout
    again = run("records", "withdraw", str(bad), "--why", "twice", "--db", db)
    assert again.returncode == 0 and "withdrawn already" in again.stdout
    assert _count(db, "withdrawals") == 1


def test_a_correction_fitted_before_the_withdrawal_is_never_applied(tmp_path):
    """A correction recorded (or copied in) before the run was withdrawn, with no refit since."""
    from vramcal.calibrate.corrections import find_correction

    db = str(tmp_path / "r.db")
    fp, bad = _poisoned_history(db)
    with Store(db) as s:
        s.withdraw(bad, "poisoned")  # the store's own append, without the command's refit
        found = find_correction(s, fp, "nf4", "cfg-m")
        assert bad not in found.runs
        assert abs(found.corrections["end"].intercept_bytes - 100 * MIB) < 1024


def test_export_says_which_runs_are_withdrawn_and_why(db, tmp_path):
    """``records export`` carries ``withdrawn`` (bool) and ``withdrawn_why`` on every stage row of a run, in
    each format, on SQLite and PostgreSQL alike; a run withdrawn twice (two hosts of a fleet) keeps both reasons."""
    import json

    import pandas as pd

    from vramcal.records.export import export

    fp = _fp("a")
    with Store(db) as s:
        kept = s.record_run(fp, _context(ctx=1024), outcome("ok", _stages(1024, MIB), series="gpu0"))
        bad = s.record_run(fp, _context(ctx=2048), outcome("ok", _stages(2048, MIB), series="gpu0"))
        s.withdraw(bad, "probed the wrong checkpoint", "host-a")
        s.withdraw(bad, "impossible peaks", "host-b")
    with Store(db, create=False, readonly=True) as s:
        rows = json.loads(export(s, "json", None))
        assert {r["run_id"] for r in rows} == {kept, bad} and len(rows) == 2 * len(_stages(1024, MIB))
        for r in rows:
            assert r["withdrawn"] is (r["run_id"] == bad)
            assert r["withdrawn_why"] == ("probed the wrong checkpoint; impossible peaks" if r["run_id"] == bad
                                          else None)
        csv = pd.read_csv(__import__("io").StringIO(export(s, "csv", None)))
        assert csv["withdrawn"].dtype == bool and set(csv.loc[csv["withdrawn"], "run_id"]) == {bad}
        assert csv.loc[~csv["withdrawn"], "withdrawn_why"].isna().all()
        out = tmp_path / "runs.parquet"
        export(s, "parquet", str(out))
        pq = pd.read_parquet(out)
        assert pq["withdrawn"].dtype == bool and list(pq.columns) == list(csv.columns)
        assert set(pq.loc[pq["withdrawn"], "withdrawn_why"]) == {"probed the wrong checkpoint; impossible peaks"}


@pytest.mark.parametrize("args, needle", [
    (["withdraw", "99", "--why", "x"], "no run 99"),
    (["withdraw", "1", "--why", ""], "needs a reason"),
    (["withdraw", "1", "--why", "   "], "needs a reason"),
    (["withdraw", "1"], "needs a reason"),
    (["withdraw", "one", "--why", "x"], "one run id"),
    (["withdraw", "--why", "x"], "one run id"),
    (["list", "--why", "x"], "--why belongs to"),
])
def test_withdraw_bad_input_is_one_line_and_writes_nothing(tmp_path, args, needle):
    db = str(tmp_path / "r.db")
    _poisoned_history(db)
    before = _digest(db)
    one_line(run("records", *args, "--db", db), needle)
    assert _digest(db) == before


def test_withdrawals_travel_with_push_and_pull(tmp_path, pg_url):
    from vramcal.calibrate.corrections import find_correction
    from vramcal.records.sync import pull, push

    local = str(tmp_path / "local.db")
    _poisoned_history(local)
    # the poisoned run cannot travel (physics leaves it out); a sane one withdrawn goes with its withdrawal
    with Store(local) as s:
        keep = s.runs()[0]["id"]
    assert run("records", "withdraw", str(keep), "--why", "probed the wrong checkpoint", "--db", local).returncode == 0
    report = push(local, pg_url)
    assert report.runs_added == 3 and report.withdrawals_added == 1
    assert push(local, pg_url).nothing_new
    with Store(pg_url, create=False, readonly=True) as s:
        withdrawn = s.withdrawn_runs()
        assert len(withdrawn) == 1
        (fleet_id,) = withdrawn
        assert "(withdrawn)" in run("records", "list", "--all-machines", "--db", pg_url).stdout
        found = find_correction(s, _fp("b", driver="550.9"), "nf4", "cfg-m")
        assert found.source == "class" and fleet_id not in found.runs and len(found.runs) == 2
    back = str(tmp_path / "back.db")
    pulled = pull(pg_url, back)
    assert pulled.withdrawals_added == 1
    with Store(back, create=False, readonly=True) as s:
        assert len(s.withdrawn_runs()) == 1
    # a withdrawal made in the fleet after the run was copied reaches this machine on the next pull
    with Store(pg_url) as s:
        other = next(r["id"] for r in s.runs() if r["id"] != fleet_id)
        s.withdraw(other, "fleet-side withdrawal")
    assert pull(pg_url, back).withdrawals_added == 1
    with Store(back, create=False, readonly=True) as s:
        assert len(s.withdrawn_runs()) == 2


# ------------------------------------------------------------------ memos whose Python runs as printed

def _save_tiny(folder) -> None:
    """A real tiny checkpoint (config and weights), as a user's local folder holds one."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**{k: v for k, v in _tiny_config().items() if k not in ("architectures", "model_type",
                                                                            "torch_dtype")})
    LlamaForCausalLM(cfg).save_pretrained(folder)


def _memo_of(tmp_path, model: str, monkeypatch, env=None):
    """The memo ``check`` leaves for a run of ``model`` (resolved from ``tmp_path``, as a user typing a
    relative name there), made by the same code: estimate, record, memo_for."""
    from vramcal import present
    from vramcal.calibrate.memo import memo_for
    from vramcal.estimator.estimate import estimate
    from vramcal.estimator.resolve import resolve_model
    from vramcal.workload import Configuration, workload

    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    if env and "HF_HUB_CACHE" in env:  # huggingface_hub read the variable when it was imported
        from huggingface_hub import constants

        monkeypatch.setattr(constants, "HF_HUB_CACHE", env["HF_HUB_CACHE"])
    monkeypatch.chdir(tmp_path)
    source = resolve_model(model)
    work = workload(64, 1, 8)
    est = estimate(source, "auto", batch=1, prompt=work.prompt, new_tokens=work.new_tokens, device="cpu")
    cfg = Configuration(source.ref, work, quant="auto", device="cpu")
    with Store(tmp_path / "r.db") as s:
        rid = s.record_run({"kind": "cpu", "hostname": "h", "total_bytes": 1 << 34},
                           context(model=source.name, quant=est.quant, config_hash=source.config_hash,
                                   command=cfg.command("check"), estimate=est.to_dict(), ctx=64),
                           outcome("ok", [{"stage": "end", "estimated_bytes": 1, "measured_peak_bytes": 2}],
                                   series="rss"))
        memo = memo_for(s.run(rid))
    text = present.memo_markdown(memo)
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    return memo, code


def _runs(code: str, cwd, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code + "\nprint(type(model).__name__, model.num_parameters())"],
                          cwd=cwd, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})


@pytest.mark.slow  # a real load in a fresh interpreter
def test_a_memo_of_a_local_folder_loads_as_printed_from_anywhere(tmp_path, monkeypatch):
    _save_tiny(tmp_path / "tiny")
    memo, code = _memo_of(tmp_path, "tiny", monkeypatch)
    assert memo["pretrained_id"] == str(tmp_path / "tiny")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = _runs(code, elsewhere)
    assert r.returncode == 0, (code, r.stderr[-2000:])
    assert r.stdout.startswith("LlamaForCausalLM")


@pytest.mark.slow  # a real load in a fresh interpreter
def test_a_memo_of_a_config_file_names_its_folder(tmp_path, monkeypatch):
    _save_tiny(tmp_path / "tiny")
    memo, code = _memo_of(tmp_path, "tiny/config.json", monkeypatch)
    assert memo["pretrained_id"] == str(tmp_path / "tiny")
    r = _runs(code, tmp_path)
    assert r.returncode == 0, (code, r.stderr[-2000:])


def test_a_memo_of_a_catalog_entry_names_its_hub_id(tmp_path, monkeypatch):
    from vramcal.estimator.resolve import catalog_entry

    memo, code = _memo_of(tmp_path, "qwen2.5-0.5b", monkeypatch)
    hub = catalog_entry("qwen2.5-0.5b")["_vramcal_catalog"]["hub_id"]
    assert hub == "Qwen/Qwen2.5-0.5B-Instruct" and memo["pretrained_id"] == hub
    assert f'from_pretrained(\n    "{hub}",' in code and "qwen2.5-0.5b" not in code


@pytest.mark.slow  # a real load in a fresh interpreter
def test_a_memo_of_a_hub_id_loads_from_the_cache_as_printed(tmp_path, monkeypatch):
    import shutil

    repo = tmp_path / "hub" / "models--acme--tiny"
    snap = repo / "snapshots" / "abc"
    _save_tiny(snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc")
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    memo, code = _memo_of(tmp_path, "acme/tiny", monkeypatch, env)
    assert memo["pretrained_id"] == "acme/tiny" and '"acme/tiny"' in code
    r = _runs(code, tmp_path, env)
    assert r.returncode == 0, (code, r.stderr[-2000:])
    shutil.rmtree(tmp_path / "hub")


def test_an_older_memo_gets_its_pretrained_id_when_shown(tmp_path):
    from vramcal.calibrate.memo import with_pretrained_id

    memo = {"model": "qwen2.5-0.5b", "command": "vramcal check qwen2.5-0.5b --quant nf4 --ctx 4096 --device cuda:0"}
    assert with_pretrained_id(memo)["pretrained_id"] == "Qwen/Qwen2.5-0.5B-Instruct"


def test_recheck_says_when_the_config_the_software_or_the_machine_changed(tmp_path):
    from vramcal import present
    from vramcal.calibrate.memo import changes_since
    from vramcal.versions import VRAMCAL_VERSION

    fp = _fp("a")
    with Store(tmp_path / "r.db") as s:
        rid = s.record_run(fp, _context(vramcal_version=VRAMCAL_VERSION), outcome("ok", _stages(1024, 0)))
        old = s.run(rid)
    assert changes_since(old, "cfg-m", fp) == []
    moved = {**fp, "transformers": "5.99.0", "hostname": "b", "gpu_uuid": "GPU-b"}
    notes = changes_since(old, "cfg-other", moved)
    assert notes[0].startswith("the config changed since the memo (hash cfg-m -> cfg-other)")
    assert "another model" in notes[0]
    assert notes[1] == "the software changed since the memo: transformers 5.24.0 -> 5.99.0"
    assert notes[2].startswith("the machine changed since the memo: hostname a -> b")
    line = present.recheck_line({"memo_run": 1, "recheck_run": 2, "old_peak_bytes": 1 << 30, "new_peak_bytes": 1 << 30,
                                 "tolerance_bytes": 1 << 26, "consistent": False, "other_model": True,
                                 "changes": notes})
    assert "ANOTHER MODEL" in line and "CONSISTENT" not in line and line.count("note:") == 3


# -------------------------------------------------------------------------- images: monotone, bounded

@pytest.mark.parametrize("family", ["gemma3", "qwen2_5_vl", "llava", "idefics3", "mllama"])
def test_more_images_tokens_or_batch_never_lower_a_peak(tiny_vlms, family):
    """Over the families of tests/vlm_models.py: every estimate with images is traced (never the formula
    that leaves the vision encoder out), and more images, more text or a larger batch never lower a peak."""
    from vramcal.estimator.estimate import estimate

    def peak(images, prompt=20, batch=1):
        e = estimate(tiny_vlms[family], "auto", prompt=prompt, new_tokens=4, batch=batch, images=images,
                     image_size="100x80" if images else None, device="cuda")
        if images:
            assert "dry run" in e.methods["activations"], e.methods["activations"]
            assert e.vision_peak is not None and e.vision_peak > 0
        return e.peak, e.allocated["first_token"]

    by_images = [peak(n) for n in (0, 1, 2, 3)]
    assert by_images == sorted(by_images), by_images  # the peak (at this size the CUDA context and load lead)
    prefill = [p for _, p in by_images]
    assert len(set(prefill)) == 4, prefill  # and the prefill's allocated bytes, where the images are, grow
    assert peak(2, prompt=20) <= peak(2, prompt=60) and peak(2, batch=1) <= peak(2, batch=2)


@pytest.mark.slow  # the real SmolVLM-256M on meta tensors at 1, 2 and 3 images of its default 2048x2048
def test_smolvlm_at_its_real_size_stays_traced_and_monotone():
    """Before: from 2 images the dry run failed (``torch.nonzero`` on meta tensors: the padding-image
    filter of Idefics3 read pixels held without values above the shadow cap) and the formula dropped the
    vision encoder, so 2 images estimated below 1."""
    from vramcal.estimator.estimate import estimate

    peaks = []
    for n in (1, 2, 3):
        e = estimate("smolvlm-256m", "auto", ctx=4096, images=n, device="cuda", use_cache=False)
        assert "dry run" in e.methods["activations"] and e.vision_peak, (n, e.methods, e.notes)
        peaks.append(e.peak)
    assert peaks == sorted(peaks) and len(set(peaks)) == 3, peaks


def test_dry_run_pixels_take_no_memory_in_proportion_to_the_images():
    """The pixel tensors an estimate makes are one stored element each, however many images: 7 images of
    Qwen2.5-VL-7B at its processor's largest size would be 3.1 GB of float32 pixels."""
    from vramcal.estimator.inventory import built_config_dict
    from vramcal.estimator.meta import build_config
    from vramcal.estimator.resolve import resolve_model
    from vramcal.estimator.vision import pixel_inputs, plan_images

    for name, count in (("qwen2.5-vl-7b", 7), ("smolvlm-256m", 7), ("llava-1.5-7b", 7), ("gemma-3-4b", 40)):
        source = resolve_model(name)
        cfg = built_config_dict(build_config(source))
        imgs = plan_images(cfg, source.processor, count, None, name, source_config=source.config)
        import torch

        tensors = pixel_inputs(imgs, 2, torch.float32)
        logical = sum(t.numel() * t.element_size() for t in tensors.values())
        stored = sum(t.untyped_storage().nbytes() for t in tensors.values())
        assert logical > 10 * 1024**2 and stored < 64 * 1024, (name, logical, stored)


@pytest.mark.parametrize("args, needle", [
    (["qwen2.5-vl-7b", "--images", "40"], "more than the 128,000 positions"),
    (["qwen2.5-vl-7b", "--images", "256", "--image-size", "1024x1024"], "give at most 93 image(s)"),
    (["smolvlm-256m", "--images", "8"], "positions of smolvlm-256m"),
])
def test_images_beyond_the_models_positions_are_refused(args, needle):
    one_line(run("estimate", *args, "--no-correction", timeout=300), needle)


def test_a_qwen_vl_folder_without_its_processor_file_says_so(tmp_path):
    """transformers' class default (max_pixels 1,003,520: 1,225 tokens for 1024x1024) silently replaced
    the published processor's (12,845,056: 1,369 tokens). A folder that is the catalog's model takes the
    catalog's processor files, with a note; an unknown one keeps the class defaults, with a note."""
    import json

    from vramcal.estimator.resolve import catalog_entry
    from vramcal.estimator.vision import plan_images

    published = {k: v for k, v in catalog_entry("qwen2.5-vl-7b").items() if k != "_vramcal_catalog"}
    known = plan_images(published, {}, 1, (1024, 1024), "folder", source_config=published)
    assert known.plan.tokens == 1369 + 2 and "catalog's qwen2.5-vl-7b" in known.notes[0]
    changed = {**published, "vision_config": {**published["vision_config"], "depth": 2}}
    unknown = plan_images(changed, {}, 1, (1024, 1024), "folder", source_config=changed)
    assert unknown.plan.tokens == 1225 + 2 and "class defaults" in unknown.notes[0]
    own = plan_images(published, {"preprocessor_config.json": {"max_pixels": 1003520}}, 1, (1024, 1024), "folder")
    assert own.notes == () and own.plan.tokens == 1225 + 2
    d = tmp_path / "qwen-vl"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(published))
    r = run("estimate", str(d), "--images", "1", "--image-size", "1024x1024", "--ctx", "2048", "--no-correction",
            "--json", timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["image_tokens"] == 1371 and any("catalog's qwen2.5-vl-7b" in n for n in out["notes"])


def test_a_fifo_among_the_journals_is_not_read(tmp_path):
    from vramcal.calibrate.runs import journal_dir, recover_journals

    db = tmp_path / "r.db"
    with Store(db) as s:
        d = journal_dir(s)
        d.mkdir(parents=True)
        os.mkfifo(d / "1.999999.0.jsonl")
        assert recover_journals(s) == []  # returns at once, nothing recorded
