"""The GPU validation script runs end to end on the CPU path (so it is not dead code without a GPU)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

from test_probe_cpu import MID

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "gpu_validate.py"


def test_validation_script_on_cpu(tmp_path):
    d = tmp_path / "mid"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(MID))
    out, summary = tmp_path / "v.csv", tmp_path / "v.md"
    r = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--models", str(d), "--layers", "2",
                        "--quants", "nf4", "--ctx", "64", "--batch", "1", "--out", str(out), "--summary", str(summary)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader(out.open()))
    assert [row["stage"] for row in rows] == ["load_peak", "post_load", "first_token", "end"]
    assert all(row["status"] == "ok" and row["layers"] == "2" for row in rows)
    assert all(int(row["measured_peak_bytes"]) > 0 and int(row["estimated_bytes"]) > 0 for row in rows)
    assert "| first_token | 1 |" in summary.read_text()


def test_gpu_session_runs_on_cpu_and_writes_every_part(tmp_path):
    """The one command a lent GPU runs: on the CPU with tiny models, the validate and widths parts write
    their CSVs; the offload and vlm parts say they need a GPU instead of failing."""
    d = tmp_path / "mid"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(MID))
    out = tmp_path / "out"
    script = Path(__file__).parent.parent / "benchmarks" / "gpu_session.py"
    r = subprocess.run([sys.executable, str(script), "--device", "cpu", "--quick", "--quick-models", str(d),
                        "--out", str(out), "--budget-s", "600"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    session = json.loads((out / "session.json").read_text())
    assert set(session["parts"]) == {"validate", "widths", "offload", "plan", "vlm", "vllm"}
    assert "offload: skipped, it needs a GPU" in r.stderr and "vllm: skipped" in r.stderr
    assert "plan: skipped, it needs a GPU" in r.stderr and "vlm: skipped, it needs a GPU" in r.stderr
    gpu = list(csv.DictReader((out / "gpu.csv").open()))
    assert gpu and all(row["status"] == "ok" for row in gpu)
    widths = list(csv.DictReader((out / "gpu-widths.csv").open()))
    assert [row["stage"] for row in widths] == ["load_peak", "post_load", "first_token", "end"]
