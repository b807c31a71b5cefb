"""Published pre-quantized checkpoints beside the estimate of their weights (issue 23).

Each row of ``benchmarks/published/prequant.csv`` is a checkpoint whose stored tensors someone published
(safetensors tensor table: shapes and dtypes, an exact element total). Its config (with its
``quantization_config``) is estimated as it loads, kept as stored (``--gpu H200``), and the weights are
compared with the stored bytes. Nothing was fitted to these rows.

The two figures need not be equal, and the table says why where they differ: transformers holds some
tensors in another dtype than stored (fp8's bf16 ``weight_scale_inv`` held float32), builds no multi-token
prediction layers a checkpoint may store (DeepSeek-V3's layer 61), and keeps non-persistent buffers (rotary
tables) no checkpoint stores.

    python benchmarks/published_prequant.py            # writes docs/validation/published/prequant.md and .csv
"""

from __future__ import annotations

import csv
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CORPUS = ROOT / "benchmarks" / "published" / "prequant.csv"
OUT = ROOT / "docs" / "validation" / "published"


def config_path(ref: str) -> str:
    if ref.startswith("configs/"):
        return str(ROOT / "benchmarks" / "published" / f"{ref}.json")
    return ref  # a catalog entry


def main() -> int:
    from vramcal.errors import UserError
    from vramcal.estimator.estimate import estimate
    from vramcal.probes.hardware import gpu_target

    rows = list(csv.DictReader(CORPUS.open()))
    out = []
    for r in rows:
        stored = int(r["tensor_bytes"])
        try:
            e = estimate(config_path(r["config"]), ctx=1024, gpu=gpu_target("H200"))
            weights = e.components["weights"] - e.weights_breakdown.get("buffers", 0)
            note = next((n for n in e.notes if "kept" in n or "dequant" in n), "")
            err = (weights - stored) / stored
            out.append({"id": r["id"], "hub_id": r["hub_id"], "quant_method": r["quant_method"],
                        "stored_bytes": stored, "estimated_bytes": weights, "error_pct": round(100 * err, 3),
                        "quant": e.quant, "note": note, "why": r.get("why_they_differ", "")})
        except UserError as exc:
            out.append({"id": r["id"], "hub_id": r["hub_id"], "quant_method": r["quant_method"],
                        "stored_bytes": stored, "estimated_bytes": None, "error_pct": None, "quant": None,
                        "note": f"refused: {exc}", "why": r.get("why_they_differ", "")})
        print(json.dumps(out[-1]))
    OUT.mkdir(parents=True, exist_ok=True)
    with (OUT / "prequant.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, list(out[0]))
        w.writeheader()
        w.writerows(out)
    errs = [abs(o["error_pct"]) for o in out if o["error_pct"] is not None]
    lines = ["# Published pre-quantized checkpoints: stored tensors beside the estimate", "",
             "`python benchmarks/published_prequant.py` (kept as stored: `--gpu H200`). Nothing was fitted to "
             "these rows. Stored: the checkpoint's safetensors tensors as published "
             "(benchmarks/published/prequant.csv, sources in benchmarks/published/sources.md); estimated: the "
             "weights the loaded model holds, less the non-persistent buffers no checkpoint stores.", "",
             f"{len(errs)} of {len(out)} rows estimated; |error| median {statistics.median(errs):.2f} %, "
             f"max {max(errs):.2f} %." if errs else "no row estimated", "",
             "| id | checkpoint | method | stored GiB | estimated GiB | error | path |",
             "| --- | --- | --- | ---: | ---: | ---: | --- |"]
    for o in out:
        est = "—" if o["estimated_bytes"] is None else f"{o['estimated_bytes'] / 2**30:.2f}"
        pct = "—" if o["error_pct"] is None else f"{o['error_pct']:+.2f} %"
        lines.append(f"| {o['id']} | {o['hub_id']} | {o['quant_method']} | {o['stored_bytes'] / 2**30:.2f} | {est} "
                     f"| {pct} | {o['note'][:140]} |")
    (OUT / "prequant.md").write_text("\n".join(lines) + "\n")
    (OUT / "published-prequant.md").write_text(section(out, errs))
    return 0


def section(out: list[dict], errs: list[float]) -> str:
    """docs/validation.md's section (benchmarks/report.py takes it as it is): each checkpoint, its error,
    and why the loaded model and the stored file differ where they do (the corpus' ``why_they_differ``)."""
    lines = ["## Pre-quantized checkpoints: stored tensors beside the estimate", "",
             f"{len(out)} published checkpoints (`benchmarks/published/prequant.csv`, each with its tensor table and "
             "source), estimated from their configs alone as they load kept as stored (`python "
             "benchmarks/published_prequant.py`, `--gpu H200`; table with the path each took in "
             "[validation/published/prequant.md](validation/published/prequant.md)). Nothing was fitted to them.",
             "", f"|error| median {statistics.median(errs):.2f} %, max {max(errs):.2f} %." if errs else "", "",
             "| checkpoint | method | stored GiB | estimated GiB | error | why they differ |",
             "| --- | --- | ---: | ---: | ---: | --- |"]
    for o in out:
        est = "—" if o["estimated_bytes"] is None else f"{o['estimated_bytes'] / 2**30:.2f}"
        pct = "—" if o["error_pct"] is None else f"{o['error_pct']:+.2f} %"
        lines.append(f"| {o['hub_id']} | {o['quant_method']} | {o['stored_bytes'] / 2**30:.2f} | {est} | {pct} | "
                     f"{o['why'] or '—'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
