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
    assert set(session["parts"]) == {"validate", "widths", "offload", "plan", "vlm", "vllm", "allocator"}
    assert "allocator: skipped, it needs a GPU" in r.stderr
    assert "offload: skipped, it needs a GPU" in r.stderr and "vllm: skipped" in r.stderr
    assert "plan: skipped, it needs a GPU" in r.stderr and "vlm: skipped, it needs a GPU" in r.stderr
    gpu = list(csv.DictReader((out / "gpu.csv").open()))
    assert gpu and all(row["status"] == "ok" for row in gpu)
    widths = list(csv.DictReader((out / "gpu-widths.csv").open()))
    assert [row["stage"] for row in widths] == ["load_peak", "post_load", "first_token", "end"]


def test_the_allocator_part_replays_a_real_trace_stage_by_stage():
    """benchmarks/gpu_allocator.py's comparison, on a trace in the shape of torch's ``_snapshot()``: a 3 MiB
    and a 100 MiB block, the first freed, a 2 MiB one reusing it -- the replay says 20 + 100 MiB, as torch's
    allocator would, and names a stage whose recorded figure differs."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    import gpu_allocator

    mib = 1024**2
    trace = [{"action": "segment_alloc", "addr": 0, "size": 20 * mib}, {"action": "alloc", "addr": 0, "size": 3 * mib},
             {"action": "alloc", "addr": 1 << 30, "size": 100 * mib},
             {"action": "free_requested", "addr": 0, "size": 3 * mib}, {"action": "free_completed", "addr": 0, "size": 3 * mib},
             {"action": "alloc", "addr": 0, "size": 2 * mib}]
    stages = {"post_load": {"trace_len": 3, "reserved": 120 * mib, "segments": [{"total_size": 20 * mib}, {"total_size": 100 * mib}]},
              "first_token": {"trace_len": 6, "reserved": 122 * mib, "segments": []}}
    got = gpu_allocator.compare(trace, stages)
    assert got["post_load"]["reserved_replay"] == 120 * mib and got["post_load"]["same_segments"]
    assert got["first_token"]["reserved_replay"] == 120 * mib and got["first_token"]["error_bytes"] == -2 * mib
    diff = gpu_allocator.size_diff([(0, 1, 10), (0, 2, 20)], [(0, 1, 10), (0, 2, 30)])
    assert diff["differ"] == [{"op": "replace", "real": [20], "dry": [30], "at_real": 1, "at_dry": 1}]


def test_the_allocator_part_sets_the_order_of_frees_beside_the_dry_runs():
    """Two prefills of the same sizes, one freeing its first block before the second allocation and one
    after: the sizes agree, the order does not, and the diff says where."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    import gpu_allocator

    from vramcal.estimator.allocator import ALLOC, FREE

    real = [(ALLOC, "a", 512), (FREE, "a", 0), (ALLOC, "b", 256), (FREE, "b", 0)]
    dry = [(ALLOC, "a", 512), (ALLOC, "b", 256), (FREE, "a", 0), (FREE, "b", 0)]
    assert gpu_allocator.op_sequence(real) == ["+512", "-512", "+256", "-256"]
    assert gpu_allocator.size_diff(real, dry)["differ"] == []
    got = gpu_allocator.order_diff(real, dry)
    assert got["real_events"] == got["dry_events"] == 4
    assert got["differ"] and got["differ"][0]["at_real"] == 1


def test_validate_cut_short_still_writes_the_rows_it_recorded(tmp_path, monkeypatch):
    """A session's timeout (SIGTERM: ProbeInterrupted, a KeyboardInterrupt) in the middle of the matrix: the CSV
    is rewritten from the runs already recorded, then the interrupt goes on (the 2026-12-04 H200 session's third
    call left only its database)."""
    import pytest

    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    import validate

    db = tmp_path / "v.db"
    db.write_bytes(b"")
    written = []

    def cut(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(validate, "run_matrix", cut)
    monkeypatch.setattr(validate, "write_csv", lambda args: written.append(args.out))
    with pytest.raises(KeyboardInterrupt):
        validate.main(["--db", str(db), "--out", str(tmp_path / "v.csv")])
    assert written == [str(tmp_path / "v.csv")]


def test_the_offload_part_reads_the_childs_resident_set_by_kind():
    """gpu_session.py's offload part splits the child's resident set into file-backed and anonymous pages at each
    stage (the offloaded load's doubling, docs/validation/gpu-h200/2026-12-04.md): read on this process here."""
    import os

    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    import gpu_session

    got = gpu_session.rss_kinds(os.getpid())
    assert got is not None and got["RssAnon"] > 0 and set(got) >= {"RssAnon", "RssFile"}
    assert gpu_session.rss_kinds(2**22 + 12345) is None  # no such process: not read, not 0
    kinds = {}
    gpu_session.stage_rss_kinds(kinds)({"event": "stage", "name": "load_peak"}, os.getpid())
    gpu_session.stage_rss_kinds(kinds)({"event": "samples"}, os.getpid())
    assert list(kinds) == ["load_peak"] and kinds["load_peak"]["RssFile"] >= 0


def test_a_part_is_not_started_without_the_time_it_takes(tmp_path):
    """On a GPU, a part that cannot finish in what is left of the budget is skipped and says why (on the
    2026-12-04 H200 the outer timeout killed widths while it wrote its first checkpoint): nothing is started."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    import gpu_session

    assert gpu_session.main(["--device", "cuda:0", "--out", str(tmp_path), "--budget-s", "30",
                             "--parts", "widths", "validate"]) == 0
    session = json.loads((tmp_path / "session.json").read_text())
    assert set(session["parts"]) == {"widths", "validate"}
    for part in ("widths", "validate"):
        assert "s of the budget left" in session["parts"][part]["skipped"]
    assert not (tmp_path / "gpu.csv").exists() and not (tmp_path / "gpu-widths.csv").exists()
