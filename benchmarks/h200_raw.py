"""The H200 rows of docs/validation re-estimated raw: no correction, the caching allocator replayed, the
H200's own terms (``--gpu H200``), against what the GPU showed.

    python benchmarks/h200_raw.py [--out docs/validation/gpu-h200/raw.csv]

For each measured row (gpu-h200.csv's first_token rows, gpu-h200/widths.csv's stages, gpu-h200-2.csv's rows) it writes the estimate's
stage and reserved figures beside nvidia-smi's memory.used (NVML used less the driver's reserve: 648,347,648
bytes taken off the first session's files here; the second session's were recorded less its NVML v2 reserve) and torch's max_memory_reserved, and the reserve above allocated both ways. Nothing is fitted to
these rows: the allocator's rules are torch's, and the only H200 figures used are the terms measured in that
session (the context after loading and what the first forward added; docs/accounting.md) -- which come from
these same runs, so the context term is in-sample. benchmarks/report.py puts the CSV into docs/validation.md.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

os.environ["VRAMCAL_ALLOC_REPLAY"] = "1"  # the replay is opt-in elsewhere; these rows are its check, always with it

from vramcal.estimator.capacity import DRIVER_RESERVE as _TABLE  # noqa: E402

DRIVER_RESERVE = _TABLE["NVIDIA H200"][0]  # NVML used with no process on that H200: vramcal's table, one home
# the first session's files (widths.csv, gpu-h200.csv) hold NVML v1 used, the reserve included: it comes off here;
# a run recorded from gpu-stages/4 on was compared less its reserve already (ProbeResult.driver_reserve)
FIELDS = ["source", "model", "quant", "ctx", "batch", "stage", "estimated_bytes", "nvidia_smi_bytes", "error_pct",
          "calibrated_bytes", "calibrated_error_pct", "estimated_reserved_bytes", "measured_reserved_bytes",
          "reserved_error_pct", "estimated_slack_bytes", "measured_slack_bytes"]


def _rows(path) -> list[dict]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def pct(a, b):
    return "" if a in (None, "") or not b else f"{100 * (int(a) - int(b)) / int(b):+.2f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=str(ROOT / "docs" / "validation"))
    ap.add_argument("--out", default=str(ROOT / "docs" / "validation" / "gpu-h200" / "raw.csv"))
    args = ap.parse_args(argv)
    import gpu_validate
    import validate

    from vramcal.estimator.estimate import estimate
    from vramcal.estimator.resolve import ModelSource
    from vramcal.probes.hardware import gpu_target

    h200 = gpu_target("H200")
    rows = []
    tmp = Path(tempfile.mkdtemp())
    for r in _rows(Path(args.dir) / "gpu-h200" / "widths.csv"):
        d = tmp / f"{r['model']}-{r['layers']}"
        if not d.exists():
            d.mkdir()
            (d / "config.json").write_text(json.dumps(gpu_validate._config_for(r["model"], int(r["layers"]))))
        e = estimate(str(d), r["quant"], ctx=int(r["ctx"]), batch=int(r["batch"]), use_cache=False, gpu=h200)
        st = r["stage"]
        smi = int(r["measured_used_bytes"]) - DRIVER_RESERVE
        res, alloc = int(r["torch_max_reserved"]), int(r["torch_max_allocated"])
        rows.append({"source": "widths.csv", "model": f"{r['model']} ({r['layers']} layers)", "quant": r["quant"],
                     "ctx": r["ctx"], "batch": r["batch"], "stage": st, "estimated_bytes": e.stages[st],
                     "nvidia_smi_bytes": smi, "error_pct": pct(e.stages[st], smi), "calibrated_bytes": "",
                     "calibrated_error_pct": "", "estimated_reserved_bytes": e.reserved[st],
                     "measured_reserved_bytes": res, "reserved_error_pct": pct(e.reserved[st], res),
                     "estimated_slack_bytes": e.reserved[st] - e.allocated[st], "measured_slack_bytes": res - alloc})
    # the validate rows of each session: the first's measured is absolute NVML used, so the driver's reserve comes
    # off here; the second's (2026-12-04, gpu-stages/4 on) was recorded less the reserve already, and five of its
    # six configurations repeat the first session's (the same NVML bytes); the second file is optional
    for name, reserve in (("gpu-h200.csv", DRIVER_RESERVE), ("gpu-h200-2.csv", 0)):
        path = Path(args.dir) / name
        if reserve == 0 and not path.exists():
            continue
        for r in _rows(path):
            if r["status"] != "ok":
                continue
            source = ModelSource(name=r["model"], origin="config", config=validate.ARCHS[r["arch"]])
            e = estimate(source, r["quant"], ctx=int(r["ctx"]), batch=int(r["batch"]), use_cache=False, gpu=h200)
            st = r["stage"]
            smi = int(r["measured_bytes"]) - reserve
            cal = int(r["calibrated_bytes"]) - reserve if r["calibrated_bytes"] else ""
            rows.append({"source": name, "model": r["model"], "quant": r["quant"], "ctx": r["ctx"],
                         "batch": r["batch"], "stage": st, "estimated_bytes": e.stages[st], "nvidia_smi_bytes": smi,
                         "error_pct": pct(e.stages[st], smi), "calibrated_bytes": cal,
                         "calibrated_error_pct": pct(cal, smi) if cal != "" else "",
                         "estimated_reserved_bytes": e.reserved[st], "measured_reserved_bytes": "",
                         "reserved_error_pct": "", "estimated_slack_bytes": e.reserved[st] - e.allocated[st],
                         "measured_slack_bytes": ""})
    with open(args.out, "w", newline="") as fh:
        w = csv.DictWriter(fh, FIELDS)
        w.writeheader()
        w.writerows(rows)
    print(f"{len(rows)} rows -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
