"""Placement through the tool: the command line's --max-memory / --device-map, per-device figures in the
Estimate, budgets from free memory (the scripted fake at the one NVML door), the offload rung, records
per device, and bad input (one line, exit 2). Everything but NVML is real: tiny models saved to disk,
transformers' own device-map function, real SQLite."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from fake_nvml import NVMLError_NotSupported

from vramcal import cli
from vramcal.calibrate import corrections, reconcile
from vramcal.calibrate.proposals import ladder
from vramcal.calibrate.runs import record_probe
from vramcal.calibrate.search import Budget, Search
from vramcal.errors import UserError
from vramcal.estimator.correction import CorrectionSet
from vramcal.estimator.estimate import Estimator, estimate
from vramcal.estimator.inventory import inventory
from vramcal.estimator.loading import load_kwargs
from vramcal.estimator.placement import parse_max_memory, plan_placement
from vramcal.estimator.quant import resolve_quant
from vramcal.estimator.resolve import resolve_model
from vramcal.probes import nvml
from vramcal.probes.machine import free_memory
from vramcal.probes.readings import StageReading
from vramcal.probes.result import ProbeResult, device_readings
from vramcal.probes.sampler import Sample
from vramcal.records.store import RunContext, Store
from vramcal.workload import STAGES, Configuration, Workload

VRAMCAL = [sys.executable, "-m", "vramcal"]
GIB = 1024**3


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """An 8-layer Llama with a 256-token vocabulary: budgets split it between layers."""
    from conftest import TINY, save_tiny

    return save_tiny("deep", {**TINY["dense-gqa"], "num_hidden_layers": 8, "vocab_size": 256},
                     tmp_path_factory.mktemp("place"))


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """8 layers of 6 MB each: wide enough that the allocator's 2 MiB segments do not hide an offload."""
    from conftest import TINY, save_tiny

    return save_tiny("wide", {**TINY["dense-gqa"], "num_hidden_layers": 8, "vocab_size": 256, "hidden_size": 512,
                              "intermediate_size": 1536}, tmp_path_factory.mktemp("wide"))


def _weights(path, quant="bf16") -> int:
    s = resolve_model(path)
    return inventory(s, resolve_quant(quant, s.config)).tensor_bytes


def _mm(path, quant, **fractions) -> str:
    total = _weights(path, quant)
    return ",".join(f"{k.replace('_', ':')}={int(f * total)}" for k, f in fractions.items())


def run(*args):
    return subprocess.run(VRAMCAL + list(args), capture_output=True, text=True, env={**os.environ})


# ------------------------------------------------------------------------------------ estimate

def test_estimate_json_has_the_map_and_one_entry_per_device(deep):
    mm = _mm(deep, "bf16", cuda_0=0.3, cuda_1=0.3, cpu=10.0)
    r = run("estimate", deep, "--quant", "bf16", "--ctx", "256", "--max-memory", mm, "--json", "--no-correction")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    s = resolve_model(deep)
    plan = plan_placement(s, resolve_quant("bf16", s.config), mm)
    assert d["device_map"] == plan.device_map and set(d["device_map"].values()) == {"cuda:0", "cuda:1", "cpu"}
    assert set(d["devices"]) == {"cuda:0", "cuda:1", "cpu"}
    for dev, v in d["devices"].items():
        assert set(v) == {"device", "stages", "allocated", "reserved", "components", "breakdown"} and set(v["stages"]) == set(STAGES)
        if dev.startswith("cuda"):  # what the device's peak is made of, from the moment that set it
            assert sum(v["breakdown"].values()) == max(v["stages"].values())
            assert min(v["components"].values()) >= 0 and min(v["breakdown"].values()) >= 0
        assert v["components"]["weights"] == plan.weights.get(dev, 0)
    gpus = ("cuda:0", "cuda:1")
    assert d["stages"] == {k: sum(d["devices"][g]["stages"][k] for g in gpus) for k in STAGES}
    # the KV of the layers each device runs: all of it, split between the GPUs (offloaded layers run on cuda:0)
    assert sum(d["devices"][g]["components"]["kv_cache"] for g in gpus) == d["components"]["kv_cache"]
    assert d["devices"]["cpu"]["stages"]["end"] == plan.weights["cpu"] == plan.pcie_bytes_per_token
    assert any("PCIe" in w for w in d["warnings"])


def test_table_shows_grouped_map_and_a_column_per_device(deep):
    mm = _mm(deep, "bf16", cuda_0=0.45, cuda_1=0.8)
    r = run("estimate", deep, "--quant", "bf16", "--ctx", "256", "--max-memory", mm, "--device-map", "sequential",
            "--no-correction")
    assert r.returncode == 0, r.stderr
    assert "device_map='sequential'" in r.stdout and "→ cuda:0" in r.stdout and "→ cuda:1" in r.stdout
    head = next(line for line in r.stdout.splitlines() if "cuda:0" in line and "cuda:1" in line and "GPUs total" in line)
    assert head.split() == ["cuda:0", "cuda:1", "GPUs", "total"]


def test_single_device_output_unchanged(deep):
    plain = run("estimate", deep, "--quant", "bf16", "--ctx", "256", "--no-correction", "--json")
    d = json.loads(plain.stdout)
    assert "device_map" not in d and d["devices"] is None and d["placement"] is None
    table = run("estimate", deep, "--quant", "bf16", "--ctx", "256", "--no-correction").stdout
    assert "placement" not in table and "per device" not in table


def test_refusal_is_said_with_what_loads_instead(deep):
    mm = _mm(deep, "nf4", cuda_0=0.5, cpu=10.0)
    r = run("estimate", deep, "--quant", "nf4", "--ctx", "256", "--max-memory", mm, "--no-correction")
    assert r.returncode == 0, r.stderr
    assert "REFUSED by transformers: Some modules are dispatched on the CPU or the disk" in r.stdout
    assert "llm_int8_enable_fp32_cpu_offload=True" in r.stdout
    e = estimate(deep, "nf4", ctx=256, max_memory=mm)
    alt = e.placement.alternative
    assert e.placement.refused and e.from_pretrained["quantization_config"]["llm_int8_enable_fp32_cpu_offload"]
    assert e.from_pretrained["device_map"] == {k: 0 if v == "cuda:0" else v for k, v in alt.device_map.items()}
    # the figures are the alternative's: offloaded modules unquantized
    assert e.devices["cpu"].components["weights"] == alt.weights["cpu"] > e.placement.weights["cpu"]


def test_library_and_sweep_agree(deep):
    s = resolve_model(deep)
    spec = resolve_quant("bf16", s.config)
    plan = plan_placement(s, spec, _mm(deep, "bf16", cuda_0=0.5, cpu=10.0))
    est = Estimator(s, spec)
    e = est.estimate(ctx=512, exact=False, placement=plan)
    row = est.sweep([(512, 1)], placement=plan)[0]
    assert row.devices == {d: v.stages for d, v in e.devices.items()}
    assert e.device_peaks() == {"cuda:0": max(e.devices["cuda:0"].stages.values())}


# ------------------------------------------------------------------------------------- bad input

BAD = [
    (["--max-memory", "gpu0=1GiB"], "unknown device"),
    (["--max-memory", "cuda:0=lots"], "--max-memory cuda:0"),
    (["--max-memory", "cuda:0=1KiB,cpu=1GiB"], "no decoder layer fits"),
    (["--max-memory", "cuda:0=1GiB", "--device", "cpu"], "do not apply to --device cpu"),
    (["--max-memory", "cpu=1GiB"], "names no GPU"),
    (["--max-memory", "cuda:0=1GiB", "--device-map", "fastest"], "unknown --device-map"),
]


@pytest.mark.parametrize("verb,extra,needle", [("estimate", *b) for b in BAD]
                         + [(v, *b) for v in ("fit", "check", "probe") for b in (BAD[0], BAD[1], BAD[3])]
                         + [(v, *BAD[2]) for v in ("check", "probe")])
def test_bad_placement_input(deep, verb, extra, needle, tmp_path):
    import vramcal.probes.probe as probe_module

    if verb in ("check", "probe") and not hasattr(probe_module, "ProbeInterrupted"):
        pytest.skip("check and probe need the probe lifecycle (branch `probe`: ProbeInterrupted, new_tokens)")
    args = [verb, deep, *extra] + ([] if verb == "probe" else ["--db", str(tmp_path / "x.db")])
    if verb == "fit":
        args += ["--budget", "1GiB"]
    elif verb == "estimate":
        args += ["--no-correction"]
    else:
        args += ["--synthetic"]
    r = run(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr, r.stderr
    assert not (tmp_path / "x.db").exists()  # nothing written for bad input


# ------------------------------------------------------------------------ budgets from free memory

def test_free_memory_through_the_door(fake):
    fake({0: [30 * GIB], 1: [NVMLError_NotSupported()]}, total=80 * GIB,
         procs={0: {4242: 18 * GIB, 777: None}}, names={4242: "python3"})
    fm = free_memory("cuda:0")
    assert fm.free_bytes == 50 * GIB and fm.held_bytes == 30 * GIB
    assert (4242, "python3", 18 * GIB) in fm.others and any(p[0] == 777 and p[2] is None for p in fm.others)
    assert "pid 4242 python3 (18.00 GiB" in fm.describe()
    assert nvml.processes(nvml.device_handle(0))[0][0] == 4242
    gone = free_memory("cuda:1")
    assert gone.free_bytes is None and "Not Supported" in gone.describe()


def test_fit_budget_auto_reads_free_memory(deep, fake, capsys, tmp_path):
    fake({0: [80 * GIB - 3 * GIB]}, total=80 * GIB, procs={0: {4242: 2 * GIB}}, names={4242: "ollama"})
    rc = cli.main(["fit", deep, "--budget", "auto", "--buffer", "512MiB", "--db", str(tmp_path / "f.db"), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["budget_bytes"] == 3 * GIB
    assert "ollama" in out["free"][0] and "3.00 GiB (3.22 GB) free" in out["free"][0]
    assert all(r["peak_bytes"] <= 3 * GIB - 512 * 1024**2 for r in out["rows"] if r["max_ctx"])
    # placement: each GPU's own free memory
    fake({0: [79 * GIB], 1: [78 * GIB]}, total=80 * GIB, procs={0: {}, 1: {}})
    mm = _mm(deep, "bf16", cuda_0=0.8, cuda_1=0.8)
    rc = cli.main(["fit", deep, "--budget", "auto", "--buffer", "100MiB", "--max-memory", mm, "--json",
                   "--db", str(tmp_path / "f.db")])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["budget_bytes"] == {"cuda:0": 1 * GIB, "cuda:1": 2 * GIB}
    bf16 = [r for r in out["rows"] if r["quant"] == "bf16"]
    assert all(set(r["device_peaks"]) == {"cuda:0", "cuda:1"} for r in bf16)
    assert all(r["device_peaks"]["cuda:0"] <= GIB - 100 * 1024**2 for r in bf16 if r["max_ctx"])


def test_budget_auto_unreadable_is_one_line(deep, fake, capsys):
    fake({0: [NVMLError_NotSupported()]})
    assert cli.main(["fit", deep, "--budget", "auto"]) == 2
    err = capsys.readouterr().err
    assert "cannot read the free memory of cuda:0" in err and len(err.strip().splitlines()) == 1
    fake({0: [80 * GIB - 100]}, total=80 * GIB, procs={0: {1: 80 * GIB - 100}})
    assert cli.main(["fit", deep, "--budget", "auto"]) == 2
    assert "nothing is left above" in capsys.readouterr().err


def test_device_map_alone_reads_this_machines_free_memory(deep, fake, capsys):
    fake({0: [79 * GIB], 1: [79 * GIB]}, total=80 * GIB, procs={0: {}, 1: {}})
    assert cli.main(["estimate", deep, "--quant", "bf16", "--ctx", "256", "--device-map", "balanced", "--json",
                     "--no-correction"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["placement"]["max_memory"]["cuda:0"] == GIB and set(d["device_map"].values()) <= {"cuda:0", "cuda:1"}


# ------------------------------------------------------------------------------- the offload rung

def test_offload_rung_position_in_each_policy():
    w = Workload(4096 - 16, 16, 4)
    for prefer in ("quality", "context", "throughput"):
        steps = ladder("bf16", w, prefer)
        i = next(i for i, s in enumerate(steps) if s.offload)
        assert sum(s.offload for s in steps) == 1
        before = [s.change for s in steps[:i]]
        if prefer == "quality":
            assert before[-1] == "fp8 KV cache" and all("quant" not in c for c in before)
        elif prefer == "context":
            assert before[-1] == "lowest quant + fp8 KV cache" and steps[i].quant == "nf4"
            assert all("ctx" not in c and "batch" not in c for c in before)
        else:
            assert i == len(steps) - 1


@pytest.mark.parametrize("quant", ["bf16", "nf4"])
def test_the_offload_split_fits_the_gpu_and_says_the_pcie_cost(wide, quant):
    s = resolve_model(wide)
    search = Search(s, device="cuda:0")
    est = search.estimator(quant)
    w = Workload(240, 16, 1)
    plain = est.estimate(batch=1, prompt=240, new_tokens=16, exact=False)
    # nf4: an offloaded layer stays bf16 and is copied whole to the GPU while it runs, so less can be saved
    usable = plain.peak - plain.components["weights"] // (2 if quant == "bf16" else 4)
    split = search.split(est, w, Budget({"cuda:0": usable}, 8 * GIB))
    assert split is not None and split.offloaded
    peak, mm, plan = split.peaks["cuda:0"], split.max_memory, split.placement
    loads = plan.loads
    assert peak <= usable < plain.peak
    assert "cpu" in loads.layer_devices and loads.pcie_bytes_per_token == loads.weights["cpu"] > 0
    assert (plan.refused is not None) == (quant == "nf4")
    # the split is what the estimator says of the map it gives: priced again from scratch, it fits
    again = est.estimate(batch=1, prompt=240, new_tokens=16, exact=False,
                         placement=plan_placement(s, est.quant, mm, "auto"))
    assert max(again.devices["cuda:0"].stages.values()) == peak
    cfg = Configuration(wide, w, quant=quant, max_memory=mm)
    args = cli.build_parser().parse_args(cfg.command("check").split()[1:])
    assert parse_max_memory(args.max_memory) == mm  # the proposal's command reads back to the byte


# --------------------------------------------------------------------------- probe and records

def test_child_load_arguments():
    assert load_kwargs("bfloat16", "cuda:0", None, {"device_map": "auto",
                       "max_memory": {"cuda:0": 5, "cpu": 9, "disk": 20}}, None, "/t/off") == {
        "dtype": "bfloat16", "device_map": "auto", "max_memory": {0: 5, "cpu": 9, "disk": 20}, "offload_folder": "/t/off"}
    assert load_kwargs("bfloat16", "cuda:0", {"load_in_8bit": True}, {"device_map": {"model.layers.0": "cuda:1",
                       "lm_head": "cpu"}, "bnb_extra": {"llm_int8_enable_fp32_cpu_offload": True}}, "sdpa", "/t/off") == {
        "dtype": "bfloat16", "device_map": {"model.layers.0": 1, "lm_head": "cpu"},
        "quantization_config": {"load_in_8bit": True, "llm_int8_enable_fp32_cpu_offload": True},
        "attn_implementation": "sdpa"}
    assert load_kwargs("float16", "cuda:1")["device_map"] == {"": 1}
    assert load_kwargs("float16", "cpu")["device_map"] == "cpu"


def test_device_stages_from_samples():
    samples = [Sample(t, {"gpu0": g0, "gpu1": g1, "rss": rss}) for t, g0, g1, rss in
               [(0.5, 10, 20, 1000), (1.5, 500, 300, 5000), (2.5, 400, 600, 4000)]]
    markers = [("baseline", 1.0), ("load_peak", 2.0), ("end", 3.0)]
    reported = {"baseline": {"rss": 1100}, "load_peak": {"rss": 5100}, "end": {"rss": 3900}}
    out = device_readings(samples, markers, reported, [0, 1])
    assert out["cuda:0"]["load_peak"].peak_bytes == 500 and out["cuda:1"]["end"].peak_bytes == 600
    cpu = out["cpu"]["load_peak"]
    assert (cpu.used_bytes, cpu.peak_bytes, cpu.samples) == (4000, 4000, 1)
    assert out["cpu"]["end"].peak_bytes == 2900  # above the child's own baseline reading


def _placed_result(est, peak0: int, peak1: int) -> ProbeResult:
    stages = {k: StageReading(k, "gpu0", 1, peak0) for k in ("baseline",) + STAGES}
    devices = {"cuda:0": {k: StageReading(k, "gpu0", peak0, peak0) for k in STAGES},
               "cuda:1": {k: StageReading(k, "gpu1", peak1, peak1) for k in STAGES},
               "cpu": {k: StageReading(k, "rss", 7, 7) for k in STAGES}}
    return ProbeResult("ok", "cuda:0", "m", "bf16", "none", "bfloat16", 256, 1, "sdpa", "gpu0", stages, "end", None,
                       None, 2, [{"t": 0.1, "gpu0": 5, "gpu1": 6, "rss": 7}, {"t": 0.2, "gpu0": 5, "gpu1": 6, "rss": 8}],
                       5.0, None, 1.0, "vramcal probe m", estimate=est, devices=devices)


def test_records_per_device_and_corrections_per_position(deep, tmp_path):
    from vramcal.probes.machine import stack_key

    e = estimate(deep, "bf16", ctx=256, max_memory=_mm(deep, "bf16", cuda_0=0.4, cuda_1=0.4, cpu=10.0))
    fp = {"kind": "cuda", "gpu_uuid": "GPU-x", "torch": "t"}
    db = str(tmp_path / "r.db")
    with Store(db) as store:
        mid = store.machine_id(fp)
        for extra in (100, 300):
            run_id = store.begin_run(mid, RunContext(e.model, "bf16", 256, 1, "cuda:0", "vramcal check",
                                                     config_hash=e.config_hash, estimate=e.to_dict(),
                                                     estimator_model=e.estimator_model,
                                                     split_devices=list(e.devices)))
            peak0 = e.devices["cuda:0"].stages["end"] + extra
            peak1 = e.devices["cuda:1"].stages["end"] + 2 * extra
            record_probe(store, run_id, _placed_result(e, peak0, peak1))
        rows = store.device_stage_rows(mid)
        assert {r["device"] for r in rows} == {"cuda:0", "cuda:1", "cpu"}
        got = store.run(run_id)
        assert len(got.outcome.devices) == 12 and got.sample_count == 6  # three series, two samples
        assert got.stages["end"].estimated_bytes == e.devices["cuda:0"].stages["end"]
        stack = stack_key(fp)
        per = corrections.refit_devices(store, mid, stack, "bf16", e.config_hash, ["cuda:0", "cuda:1"])
        assert per["cuda:0"].stages["end"].intercept_bytes == 200 and per["cuda:1"].stages["end"].intercept_bytes == 400
        # a split run does not feed the single-device corrections
        assert not corrections.refit(store, mid, stack, "bf16", e.config_hash, "cuda")
        found = corrections.lookup_device(store, fp, "cuda:1", "bf16", e.config_hash)
    fixed = e.corrected_devices({"cuda:0": per["cuda:0"], "cuda:1": found})
    assert fixed.devices["cuda:1"].stages["end"] == e.devices["cuda:1"].stages["end"] + 400
    assert fixed.stages["end"] == e.stages["end"] + 600 and fixed.correction.devices["cuda:1"].source_runs
    assert reconcile.device_stage_rows(_placed_result(e, 1, 2))[0].device == "cuda:0"


def test_schema_2_records_stay_readable(tmp_path):
    """A database written before per-device rows is upgraded in place, its runs read as before."""
    import sqlite3

    from vramcal.records.store import APPLICATION_ID, MIGRATIONS

    path = tmp_path / "old.db"
    c = sqlite3.connect(path)
    for step in MIGRATIONS[:2]:
        c.executescript(step)
    c.execute("INSERT INTO machines (fingerprint, kind, created_at) VALUES ('{}', 'cuda', 0)")
    c.execute("INSERT INTO runs (machine_id, created_at, model, quant, ctx, batch, device, command) "
              "VALUES (1, 0, 'm', 'nf4', 512, 1, 'cuda:0', 'vramcal check m')")
    c.execute("INSERT INTO results (run_id, finished_at, status, result_json) VALUES (1, 0, 'ok', '{}')")
    c.execute("INSERT INTO stages (run_id, stage, estimated_bytes, measured_peak_bytes) VALUES (1, 'end', 5, 7)")
    c.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    c.execute("PRAGMA user_version = 2")
    c.commit()
    c.close()
    with Store(path) as s:
        run = s.run(1)
        assert run.stages["end"].measured_peak_bytes == 7 and run.outcome.devices == []
        assert s.stage_rows(1)[0]["estimated_bytes"] == 5 and s.device_stage_rows(1) == []


def test_configuration_command_round_trips_placement(deep):
    mm = {"cuda:0": 24 * GIB, "cuda:1": 1536 * 1024**2, "cpu": 12345}
    cmd = Configuration(deep, Workload(496, 16, 1), max_memory=mm, device_map="balanced").command("check")
    cfg = cli.config_of_command(cmd)
    assert parse_max_memory(cfg.max_memory) == mm and cfg.device_map == "balanced"
    with pytest.raises(UserError):
        parse_max_memory("cuda:0=24GiB,cuda:0=1GiB")
