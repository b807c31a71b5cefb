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
SIZES = ROOT / "benchmarks" / "published" / "prequant_sizes.csv"  # checkpoints whose size alone is published
OUT = ROOT / "docs" / "validation" / "published"
# how far a published size may sit from the stored tensors, by how it was published: exact file bytes hold
# the tensors plus each shard's safetensors header (about 100 bytes a tensor: under 0.01 % here); a size
# rounded to 0.1 GB holds them within half that
TOLERANCE = {"exact": (0.0, 1e-4), "0.1 GB": (-0.05e9, 0.05e9)}


def config_path(ref: str) -> str:
    if ref.startswith("configs/"):
        return str(ROOT / "benchmarks" / "published" / f"{ref}.json")
    return ref  # a catalog entry


def stored_estimate(row: dict) -> int:
    """The bytes of what the checkpoint stores, as the row's engine holds it, from its config alone:
    transformers' loaded weights less the non-persistent buffers (kept as stored, ``--gpu H200``); vLLM's
    per-rank weights (estimator/vllm/layout.py) less the rotary cos/sin cache it builds, which no checkpoint
    stores. vLLM's NVFP4 layers keep 16 bytes of scalars a merged shard where the checkpoint stores 8 a
    module (global weight and input scales): 1,792 bytes more for a Llama-3.1-8B, within the tolerance."""
    if row["engine"] == "vllm":
        from vramcal.estimator.resolve import resolve_model
        from vramcal.estimator.vllm import quant as vq
        from vramcal.estimator.vllm.arch import arch_of
        from vramcal.estimator.vllm.layout import rank_weights
        from vramcal.estimator.vllm.shapes import model_params

        source = resolve_model(config_path(row["config"]))
        params, filled = model_params(source, "bfloat16")
        scheme = vq.resolve(source.config, None)
        groups = rank_weights(params, arch_of(source.config, filled), 1, 1, 2, scheme)[0].groups
        return sum(b for g, b in groups.items() if g != "rotary_cache")
    from vramcal.estimator.estimate import estimate
    from vramcal.probes.hardware import gpu_target

    e = estimate(config_path(row["config"]), ctx=1024, gpu=gpu_target("H200"))
    return e.components["weights"] - e.weights_breakdown.get("buffers", 0)


def sizes_table() -> list[dict]:
    out = []
    for r in csv.DictReader(SIZES.open()):
        published, est = int(r["published_bytes"]), stored_estimate(r)
        lo, hi = TOLERANCE[r["precision"]]
        bound = (published * lo, published * hi) if r["precision"] == "exact" else (lo, hi)
        out.append({**r, "estimated_bytes": est, "gap_bytes": published - est,
                    "within": bound[0] <= published - est <= bound[1]})
    return out


def sizes_lines(rows: list[dict]) -> list[str]:
    lines = ["", "Checkpoints whose size alone is published (`benchmarks/published/prequant_sizes.csv`: no tensor "
             "table, so each is compared with what it stores at the precision the size was published with; "
             "`stored_estimate` in the script says which bytes; where each config comes from, and what in it was "
             "not read from the checkpoint, in benchmarks/published/sources.md):", "",
             "| checkpoint | engine | method | published | stored, estimated | published − estimated | within |",
             "| --- | --- | --- | ---: | ---: | ---: | --- |"]
    for r in rows:
        lines.append(f"| {r['hub_id']} | {r['engine']} | {r['quant_method']} | {int(r['published_bytes']):,} B "
                     f"({r['what_is_published']}) | {r['estimated_bytes']:,} B | {r['gap_bytes']:+,} B | "
                     f"{'yes' if r['within'] else 'NO'} |")
    return lines


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
    sizes = sizes_table()
    for r in sizes:
        print(json.dumps(r))
    (OUT / "prequant.md").write_text("\n".join(lines + sizes_lines(sizes)) + "\n")
    (OUT / "published-prequant.md").write_text(section(out, errs, sizes))
    return 0


def section(out: list[dict], errs: list[float], sizes: list[dict]) -> str:
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
    return "\n".join(lines + sizes_lines(sizes)) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
