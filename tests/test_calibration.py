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
from vramcal.cli import config_of_command
from vramcal.probes.machine import machine_fingerprint
from vramcal.probes.probe import run_probe
from vramcal.records.store import RunContext, Store

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


@pytest.mark.alone  # a resident set against a tolerance: not beside another worker
def test_one_check_makes_the_next_estimate_closer(model, tmp_path):
    db = str(tmp_path / "cal.db")
    first = check(model, "bf16", ctx=256, batch=2, device="cpu", db=db)
    assert first.verdict.fits and first.memo_id and first.corrections["first_token"].n_runs == 1
    # CPU path: no CUDA context stage; the weights' delta is what loading added beyond the estimate's
    # post_load resident set (mapped pages, not the tensors: a bf16 load copies nothing)
    d = first.component_deltas
    assert d.context is None and d.weights is not None and d.generation is not None
    run = first.probe.stages
    assert d.weights == run["post_load"].used_bytes - run["baseline"].used_bytes - \
        first.probe.estimate.stages["post_load"]
    assert abs(d.weights) < 16 * 1024**2  # the tensors' bytes would be off by the whole model

    target_ctx = 1536
    corrected = _estimate_json(model, target_ctx, db)
    raw = _estimate_json(model, target_ctx, db, "--no-correction")
    assert corrected["correction"]["source_runs"] == [first.run_id]
    assert raw.get("correction") is None

    def closer(stage, ctx, corrected, raw):
        fresh = [run_probe(model, "bf16", ctx, 2, device="cpu", with_estimate=False) for _ in range(2)]
        assert all(f.status == "ok" for f in fresh)
        measured, again = (f.measured()[stage].peak_bytes for f in fresh)
        # closer, or already as close as runs of the same load agree: on this 100 MiB model the heap glibc
        # keeps after the prefill moves the resident set by up to 15 % from run to run (measured: `end` at
        # 1536 tokens 118, 124 and 143 MB; 2026-12-02, alone on a quiet machine, the corrected `end` came
        # 15.7 MB from a 121 MB run whose twin was 111 MB), and one run's delta cannot improve on that.
        # Two fresh runs can agree by chance, so their gap is added to that spread, not used in its place.
        noise = 0.15 * measured + abs(measured - again)
        assert abs(corrected["stages"][stage] - measured) <= max(abs(raw["stages"][stage] - measured), noise), \
            (stage, ctx, corrected["stages"][stage], raw["stages"][stage], measured, again)

    # the load and the prefill: one check's intercept carries to a 6x longer context
    for stage in ("post_load", "first_token"):
        closer(stage, target_ctx, corrected, raw)
    # the end of generation: not across contexts. The heap glibc keeps after the prefill grows with the context
    # faster than the estimate does (2026-12-06: `end` at 256 tokens 16 MB below the estimate, at 1536 20-40 MB
    # above it), so one run's intercept, from 256 tokens, moved the 1536 estimate the wrong way (95 MB against 111
    # raw and 129 / 151 measured). One check gives an intercept only (docs/calibration.md: a second check at
    # another token count fits the slope); at the check's own context it must hold.
    closer("end", 256, _estimate_json(model, 256, db), _estimate_json(model, 256, db, "--no-correction"))


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
    # the load that ran, as from_pretrained's arguments (what `vramcal plan` prints for a plan)
    assert memo["from_pretrained"] == {"dtype": "bfloat16", "device_map": "cpu", "quantization_config": {
        "load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": False,
        "bnb_4bit_compute_dtype": "bfloat16"}}
    md = subprocess.run([sys.executable, "-m", "vramcal", "memo", "--db", db], capture_output=True, text=True).stdout
    assert "**Quantization**: nf4" in md and "vramcal check" in md
    assert "from_pretrained(" in md and 'bnb_4bit_quant_type="nf4"' in md
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
        rid = s.begin_run(mid, RunContext(model, "bf16", 1024, 4, "cpu", result.command))
        record_probe(s, rid, result)
        run = s.run(rid)
        assert run.status == "crashed" and run.outcome.last_stage == "post_load"
        assert set(run.stages) >= {"baseline", "load_peak", "post_load"} and "end" not in run.stages
        assert run.sample_count > 0
        assert memo_for(run)["status"] == "crashed"


@pytest.mark.alone  # a resident set against a tolerance: not beside another worker
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
    assert d["proposals"], "a ladder with quantization, context and batch steps must offer something"
    for p in d["proposals"]:
        assert p["corrected_peak_bytes"] <= budget
        assert p["command"].startswith("vramcal check ")
        config = config_of_command(p["command"])  # every proposal is a command the parser accepts ...
        assert (config.quant, config.work.ctx, config.work.batch, config.kv_dtype) == \
            (p["quant"], p["ctx"], p["batch"], p["kv_dtype"])  # ... and it means what the proposal says
        assert config.synthetic is False and config.device == "cpu"
    for p in d["proposals"]:  # throughput: quantization first, then context, the batch last; on the CPU no
        assert p["quant"] == "bf16"  # bitsandbytes step lowers the resident set, so the precision stays
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


def test_every_ladder_step_is_a_command_the_parser_accepts():
    """All policies, with fp8 KV, halved contexts and batches, new tokens and a pre-quantized model."""
    from vramcal.calibrate.proposals import POLICIES, ladder
    from vramcal.workload import Configuration, Workload

    steps = 0
    for prefer in POLICIES:
        for quant, requantize, work in (("bf16", True, Workload(8000, 192, 4)), ("auto", False, Workload(8000, 192, 4)),
                                        ("nf4", True, Workload(8000, 192, 4, 2, (1024, 768)))):
            for q, w, kv, *_ in ladder(quant, work, prefer, requantize):
                assert (w.images, w.image_size) == (work.images, work.image_size)
                cmd = Configuration("llama-3.1-8b", w, quant=q, device="cuda:1", kv_dtype=kv, attn="eager",
                                    synthetic=True).command("check")
                c = config_of_command(cmd)
                assert (c.quant, c.work, c.kv_dtype, c.device, c.attn, c.synthetic) == \
                    (q, w, kv, "cuda:1", "eager", True), cmd
                steps += 1
    assert steps > 20


def test_memo_recheck_replays_a_prequantized_runs_command(model, tmp_path):
    """The memo's command names --quant as the user gave it, so a run that loaded a checkpoint as stored
    (--quant auto) is rechecked the same way, not with the resolved name the parser would refuse."""
    db = str(tmp_path / "pq.db")
    r = check(model, "auto", ctx=128, device="cpu", db=db)
    assert r.verdict.fits
    cfg = config_of_command(r.command)
    assert cfg.quant == "auto" and cfg.model == os.path.abspath(model)


def test_bad_input_to_check_writes_nothing(model, tmp_path):
    db = tmp_path / "never.db"
    for extra in (["--device", "cuda:3"], ["--ctx", "8"], ["--dtype", "int4"], ["--buffer", "1TiB"],
                  ["--images", "1"], ["--images", "1", "--image-size", "1x"], ["--image-size", "64x64"]):
        r = subprocess.run([sys.executable, "-m", "vramcal", "check", model, "--quant", "bf16", "--device", "cpu",
                            "--db", str(db), *extra], capture_output=True, text=True)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, (extra, r.stderr)
    empty = tmp_path / "noweights"
    empty.mkdir()
    (empty / "config.json").write_text(open(os.path.join(model, "config.json")).read())
    r = subprocess.run([sys.executable, "-m", "vramcal", "check", str(empty), "--device", "cpu", "--db", str(db)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--synthetic" in r.stderr
    assert not db.exists(), "validation must come before the records database is touched"


def _check_until(model, db, stage, tmp_path):
    """Start `vramcal check` in its own process and return it once its probe has reached ``stage``."""
    import time

    env = {**os.environ, "TMPDIR": str(tmp_path)}
    # SIGINT's default disposition first: a suite started in the background of a non-interactive shell has
    # it ignored, and a Python that starts with SIGINT ignored never raises KeyboardInterrupt
    proc = subprocess.Popen([sys.executable, "-m", "vramcal", "check", model, "--quant", "bf16", "--ctx", "2048",
                             "--batch", "4", "--new-tokens", "200", "--device", "cpu", "--db", db],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 240
    journal = db + "-journal.d"
    while time.monotonic() < deadline:
        for f in (os.listdir(journal) if os.path.isdir(journal) else []):
            if f'"name": "{stage}"' in open(os.path.join(journal, f)).read():
                return proc
        if proc.poll() is not None:
            raise AssertionError(proc.stderr.read())
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"never reached {stage}")


@pytest.mark.slow
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_check_interrupted_is_recorded_with_its_last_stage(model, tmp_path, sig, code):
    db = str(tmp_path / "i.db")
    proc = _check_until(model, db, "first_token", tmp_path)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert "Traceback" not in err
    with Store(db, create=False, readonly=True) as s:
        [run] = s.runs()
        full = s.run(run["id"])
    assert full.status == "interrupted" and full.outcome.last_stage == "first_token", full
    assert full.sample_count > 0
    assert not [p for p in os.listdir(tmp_path) if p.startswith("vramcal-probe-")]


@pytest.mark.slow
def test_check_killed_outright_is_recovered_by_the_next_write(model, tmp_path):
    import psutil

    db = str(tmp_path / "k9.db")
    proc = _check_until(model, db, "post_load", tmp_path)
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.kill()
    proc.wait()
    psutil.wait_procs(children, timeout=30)
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    with Store(db, create=False, readonly=True) as s:
        assert s.runs()[0]["status"] is None  # the row exists, the result does not yet
    check(model, "bf16", ctx=128, device="cpu", db=db)  # any command that writes folds the journal in
    with Store(db, create=False, readonly=True) as s:
        first = s.run(s.runs()[0]["id"])
    assert first.status == "interrupted" and first.outcome.last_stage in ("post_load", "first_token"), first
    assert first.sample_count > 0 and "journal" in first.outcome.error
