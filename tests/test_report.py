"""The validation report is regenerated from CSVs by one command; its figures are computed, not typed."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
FIELDS = (ROOT / "benchmarks" / "validate.py").read_text().split("FIELDS = [", 1)[1].split("]", 1)[0]
FIELDS = [f.strip().strip('"') for f in FIELDS.replace("\n", " ").split(",") if f.strip()]


def _row(run, stage, est, cal, meas, **kw):
    base = dict.fromkeys(FIELDS, "")
    base.update(name="t", device="cpu", machine="cpu-x", arch=kw.get("arch", "dense-gqa"),
                model=kw.get("arch", "dense-gqa"), quant="nf4", ctx=256, batch=1, status="ok", run_id=run,
                stage=stage, estimated_bytes=est, calibrated_bytes=cal, measured_bytes=meas,
                error_raw_pct=round(100 * (est - meas) / meas, 3), error_calibrated_pct=round(100 * (cal - meas) / meas, 3),
                formula_total_bytes=kw.get("formula", 500), accelerate_bytes=kw.get("acc", 400),
                weights_estimated_bytes=300, weights_measured_bytes=kw.get("wm", 300), kv_estimated_bytes=10,
                kv_measured_bytes=10, torch="2.13.0", transformers="5.24.0", bitsandbytes="0.50.2")
    return base


def test_report_from_a_small_csv(tmp_path):
    d = tmp_path / "validation"
    d.mkdir()
    rows = []
    for run, (est, cal, meas) in enumerate([(900, 990, 1000), (1100, 1010, 1000), (950, 1000, 1000)], start=1):
        for stage in ("load_peak", "post_load", "first_token", "end"):
            rows.append(_row(run, stage, est if stage == "end" else est // 2, cal if stage == "end" else cal // 2,
                             meas if stage == "end" else meas // 2, arch="moe" if run == 3 else "dense-gqa",
                             wm=301 if run == 2 else 300))
    failed = _row(9, "load_peak", 1, 1, 1)
    failed.update(status="error", error="RuntimeError: size mismatch", measured_bytes="", error_raw_pct="",
                  error_calibrated_pct="", calibrated_bytes="")
    rows.append(failed)
    with open(d / "cpu.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, FIELDS)
        w.writeheader()
        w.writerows(rows)
    out = tmp_path / "validation.md"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report.py"), "--dir", str(d), "--out", str(out),
                        "--plot", str(d / "peak.png")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert "**No GPU data yet.**" in text
    assert "**1 run(s) did not finish**" in text and "RuntimeError: size mismatch" in text
    # peak errors per run: raw -10 %, +10 %, -5 % -> median 10 %; calibrated -1 %, +1 %, 0 % -> median 1 %
    assert "| vramcal raw | 3 | 10.0 % | 10.0 % | 10.0 % |" in text
    assert "| vramcal calibrated (leave-one-out) | 3 | 1.0 % |" in text
    assert "| documents' formula | 3 | 50.0 % |" in text  # 500 vs 1000
    assert "estimate equals the bytes the loaded model holds on **2 of 3** runs" in text
    assert "| weights exact | every run | 2 / 3 | missed |" in text
    assert "| raw median | ≤ 5 % | 10.0 % | **missed** |" in text
    assert "| calibrated median | ≤ 2 % | 1.0 % | met |" in text
    assert "| moe | 1 |" in text and "| dense-gqa | 2 |" in text
    assert (d / "peak.png").read_bytes()[:4] == b"\x89PNG"


def test_report_without_data(tmp_path):
    (tmp_path / "v").mkdir()
    out = tmp_path / "v.md"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report.py"), "--dir", str(tmp_path / "v"),
                        "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 0 and "No probe validation data yet." in out.read_text()


def _probe_json(path: Path, model: str, quant: str, ctx: int, measured: dict[str, int], base: int = 10**9) -> None:
    import json

    stages = {"baseline": {"used_bytes": base, "peak_bytes": base}}
    stages.update({s: {"used_bytes": base + v, "peak_bytes": base + v} for s, v in measured.items()})
    path.write_text(json.dumps({"status": "ok", "device": "cpu", "series": "rss", "model": model, "quant": quant,
                                "ctx": ctx, "batch": 1, "new_tokens": 16, "stages": stages, "wall_s": 1.0}))


def test_cpu_model_eval_and_its_place_in_the_report(tmp_path, tiny_models):
    """The CPU section is computed from probe JSON by the installed estimator, split by model size, with
    leave-one-out corrections from the other probes of the same model and quantization; the report puts
    it after the published GPU evidence and before the small-model probes."""
    from vramcal.estimator.estimate import estimate

    model = tiny_models["dense-gqa"]
    e = estimate(model, "bf16", ctx=256, device="cpu")
    probes = tmp_path / "probes"
    probes.mkdir()
    # two runs, each 10 % above the estimate at every stage: raw error -9.1 %; each corrected by the other's
    _probe_json(probes / "a.json", model, "bf16", 256, {s: v * 11 // 10 for s, v in e.stages.items()})
    _probe_json(probes / "b.json", model, "bf16", 256, {s: v * 11 // 10 for s, v in e.stages.items()})
    d = tmp_path / "validation"
    (d / "cpu-real").mkdir(parents=True)
    (d / "published").mkdir()
    (d / "published" / "published.md").write_text("## GPU evidence: figures others measured and published\n")
    md = d / "cpu-real" / "cpu-real.md"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_model_eval.py"), "--markdown", str(md),
                        str(probes / "a.json"), str(probes / "b.json")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    text = md.read_text()
    assert "### smaller models" in text  # a tiny model is not a real-width row
    assert text.count("| -9% |") == 8 and text.count("+0% (model+quant)") + text.count("-0% (model+quant)") == 8
    assert "smaller models: 8 rows (2 probes); median |error| raw 9.1%, calibrated (leave-one-out) 0.0%" in text
    out = tmp_path / "validation.md"
    _row_csv = d / "cpu.csv"
    with open(_row_csv, "w", newline="") as fh:
        w = csv.DictWriter(fh, FIELDS)
        w.writeheader()
        w.writerows([_row(1, s, 100, 100, 100) for s in ("load_peak", "post_load", "first_token", "end")])
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report.py"), "--dir", str(d), "--out", str(out),
                        "--plot", str(d / "peak.png")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    report = out.read_text()
    order = [report.index(h) for h in ("## GPU evidence", "## CPU at real widths", "## Our own probes of small models")]
    assert order == sorted(order)


def test_benchmark_scripts_refuse_bad_input_in_one_line(tmp_path):
    foreign = tmp_path / "foreign.csv"
    foreign.write_text("a,b\n1,2\n")
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{")
    cases = [
        ([str(ROOT / "benchmarks" / "validate.py"), "--from-csv", "--out", str(tmp_path / "missing.csv")], "cannot read"),
        ([str(ROOT / "benchmarks" / "validate.py"), "--from-csv", "--out", str(foreign)], "no rows this script wrote"),
        ([str(ROOT / "benchmarks" / "cpu_model_eval.py"), str(bad_json)], "not a readable probe JSON"),
        ([str(ROOT / "benchmarks" / "cpu_model_eval.py"), "--markdown", str(tmp_path / "no" / "x.md"), str(bad_json)],
         "does not exist"),
    ]
    for args, needle in cases:
        r = subprocess.run([sys.executable, *args], capture_output=True, text=True)
        assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
    assert foreign.read_text() == "a,b\n1,2\n" and not (tmp_path / "missing.csv").exists()
