"""Calibration on measured numbers: real CPU probes of a small model, real SQLite."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from conftest import save_tiny
from test_probe_cpu import MID

from vramcal.calibrate.check import check
from vramcal.calibrate.memo import memo_for
from vramcal.calibrate.runs import record_probe
from vramcal.probes.machine import machine_fingerprint
from vramcal.probes.probe import run_probe
from vramcal.records.store import Store

CHECKLIST = ("quantization", "implementation", "context_length", "batch_size", "peak_bytes", "peak_read_from",
             "peak_stage", "gpu_model", "total_memory_bytes", "command")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny("mid", MID, tmp_path_factory.mktemp("cal"))


def _estimate_json(model, ctx, db, *extra):
    r = subprocess.run([sys.executable, "-m", "vramcal", "estimate", model, "--quant", "bf16", "--ctx", str(ctx),
                        "--batch", "2", "--device", "cpu", "--db", db, "--json", *extra], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_one_check_makes_the_next_estimate_closer(model, tmp_path):
    db = str(tmp_path / "cal.db")
    first = check(model, "bf16", ctx=256, batch=2, device="cpu", db=db)
    assert first.verdict.fits and first.memo_id and first.corrections["first_token"]["n_runs"] == 1
    # CPU path: no CUDA context stage; the weights' delta is what loading added beyond the tensors
    d = first.component_deltas
    assert d["context"] is None and d["weights"] is not None and d["generation"] is not None
    run = first.probe["stages"]
    assert d["weights"] == run["post_load"]["used_bytes"] - run["baseline"]["used_bytes"] - \
        first.probe["estimate"]["components"]["weights"]

    target_ctx = 1536
    corrected = _estimate_json(model, target_ctx, db)
    raw = _estimate_json(model, target_ctx, db, "--no-correction")
    assert corrected["correction"]["source_runs"] == [first.run_id]
    assert raw.get("correction") is None

    fresh = run_probe(model, "bf16", target_ctx, 2, device="cpu", with_estimate=False)
    assert fresh.status == "ok"
    for stage in ("post_load", "first_token", "end"):
        measured = fresh.above_baseline(stage, "peak_bytes")
        assert abs(corrected["stages"][stage] - measured) < abs(raw["stages"][stage] - measured), stage


def test_memo_has_the_whole_checklist(model, tmp_path):
    db = str(tmp_path / "memo.db")
    check(model, "nf4", ctx=128, batch=1, device="cpu", db=db)
    r = subprocess.run([sys.executable, "-m", "vramcal", "memo", "--db", db, "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    memo = json.loads(r.stdout)
    for key in CHECKLIST:
        assert memo.get(key) not in (None, ""), key
    assert memo["quantization"] == "nf4" and memo["implementation"].startswith("bitsandbytes 4-bit")
    assert memo["peak_stage"] in ("load", "first inference (prefill)", "generation")
    md = subprocess.run([sys.executable, "-m", "vramcal", "memo", "--db", db], capture_output=True, text=True).stdout
    assert "**Quantization**: nf4" in md and "vramcal check" in md
    again = subprocess.run([sys.executable, "-m", "vramcal", "memo", "--db", db, "--recheck", "--json"],
                           capture_output=True, text=True)
    out = json.loads(again.stdout)
    assert out["status"] == "ok" and out["recheck_run"] > out["memo_run"]
    assert again.returncode == (0 if out["consistent"] else 1)
    assert out["consistent"], out  # same machine, same command: within 5 % or 64 MiB


def test_a_killed_probe_leaves_a_partial_record(model, tmp_path):
    def kill(event, pid):
        if event.get("event") == "stage" and event.get("name") == "post_load":
            os.kill(pid, signal.SIGKILL)

    result = run_probe(model, "bf16", 1024, 4, device="cpu", on_event=kill)
    with Store(tmp_path / "k.db") as s:
        mid = s.machine_id(machine_fingerprint("cpu"))
        rid = record_probe(s, mid, result, result.estimate)
        run = s.run(rid)
        assert run["status"] == "crashed" and run["last_stage"] == "post_load"
        assert set(run["stages"]) >= {"baseline", "load_peak", "post_load"} and "end" not in run["stages"]
        assert run["sample_count"] > 0
        assert memo_for(run)["status"] == "crashed"


def test_when_it_does_not_fit_it_proposes(model, tmp_path):
    db = str(tmp_path / "p.db")
    small = check(model, "bf16", ctx=256, batch=1, device="cpu", db=db)  # a first correction for this machine
    budget = small.verdict.peak_bytes + 24 * 1024**2  # room for the small run, not for ctx 2048 x batch 8
    r = subprocess.run([sys.executable, "-m", "vramcal", "check", model, "--quant", "bf16", "--ctx", "2048",
                        "--batch", "8", "--device", "cpu", "--db", db, "--budget", str(budget), "--buffer", "0",
                        "--prefer", "throughput", "--json"], capture_output=True, text=True)
    d = json.loads(r.stdout)
    assert r.returncode == 1 and not d["verdict"]["fits"], d["verdict"]
    assert d["verdict"]["peak_bytes"] > budget
    for p in d["proposals"]:
        assert p["corrected_peak_bytes"] <= budget
        assert p["command"].startswith("vramcal check ")
    for p in d["proposals"]:  # throughput: quantization first, then context, the batch last
        assert p["quant"] != "bf16"
        if p["batch"] < 8:
            assert p["ctx"] == min(q["ctx"] for q in d["proposals"]) and "batch" in p["change"]


def test_fit_is_monotone_in_batch(model, tmp_path):
    db = str(tmp_path / "f.db")
    r = subprocess.run([sys.executable, "-m", "vramcal", "fit", model, "--budget", "600MiB", "--buffer", "0",
                        "--device", "cpu", "--db", db, "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["rows"]
    for q in {row["quant"] for row in rows}:
        ctxs = [row["max_ctx"] or 0 for row in rows if row["quant"] == q]
        assert ctxs == sorted(ctxs, reverse=True)
        assert all(row["peak_bytes"] <= 600 * 1024**2 for row in rows if row["max_ctx"])


@pytest.mark.parametrize("args,needle", [
    (["check", "x", "--prefer", "speed"], "--prefer"),
    (["check", "x", "--budget", "lots"], "--budget"),
    (["fit", "llama-3.1-8b", "--budget", "12 parsecs", "--device", "cpu"], "--budget"),
    (["memo", "--db", "/nonexistent-dir/none.db"], "no records database"),
    (["records", "list", "--db", "/nonexistent-dir/none.db"], "no records database"),
])
def test_calibration_bad_input(args, needle, tmp_path):
    r = subprocess.run([sys.executable, "-m", "vramcal", *args], capture_output=True, text=True,
                       env={**os.environ, "VRAMCAL_DB": str(tmp_path / "x.db")})
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr, r.stderr
    assert not os.path.exists("/nonexistent-dir")
