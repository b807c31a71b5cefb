"""Hold vramcal against GPU memory figures that others measured and published.

    python benchmarks/published.py [--corpus benchmarks/published/corpus.csv] [--out-dir docs/validation/published]

For every row of the corpus (benchmarks/published/sources.md says where each comes from), vramcal
estimates the row's own workload -- its prompt, new tokens, batch, quantization, dtype and attention --
and compares the SAME counter the source printed:

| counter in the corpus | what vramcal compares it with |
| --- | --- |
| ``torch_max_allocated`` | the largest ``allocated`` stage (torch's ``max_memory_allocated``) |
| ``torch_max_reserved`` | the largest stage minus the CUDA context |
| ``nvidia_smi_used`` | the largest stage (NVML ``memory.used``) |
| ``other:torch_peak_allocated+(nvidia_smi...)`` | the context plus the largest ``allocated`` stage |
| ``memory_footprint``, ``weights_only`` | the weights |
| ``other:unstated(...weights + final KV...)`` | what the figure contains by arithmetic: weights + the cache at the end |

Beside it, on the same rows: the source documents' formula ``(params x bits / 8 + KV) x 1.18`` (its
weights alone for weight counters) and ``params x bytes``. Per source with at least 3 rows, the
leave-one-out corrected error: a source is one machine and one stack, so each row is corrected by a
line fitted to the other rows of its source (``vramcal.calibrate.corrections.fit_line``).

Writes ``published.csv`` and ``published.md`` into --out-dir; ``benchmarks/report.py`` puts the
section first in docs/validation.md (and is run at the end, unless --no-report).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CORPUS = ROOT / "benchmarks" / "published" / "corpus.csv"
QUANT_OF_ROW = {"gptq-int4": "auto", "awq-int4": "auto", "fp8": "auto"}  # pre-quantized: loaded as stored
ATTN_OF_ROW = {"unknown": "auto", "": "auto"}


def _int(value: str) -> int | None:
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else int(f)


def model_ref(row: dict, corpus_dir: Path) -> str:
    cfg = corpus_dir / "configs" / f"{row['model']}.json"
    return str(cfg) if cfg.is_file() else row["model"]


def comparable(est, row: dict) -> tuple[int, str]:
    """The estimate's figure for the counter the source printed, and what that figure is."""
    counter = row["counter"]
    if counter in ("memory_footprint", "weights_only"):
        return est.components["weights"], "weights"
    if counter == "torch_max_allocated":
        return max(est.allocated.values()), "max allocated"
    if counter == "torch_max_reserved":
        return est.peak - _context(est), "max reserved"
    if counter == "nvidia_smi_used":
        return est.peak, "memory.used peak"
    if counter.startswith("other:torch_peak_allocated"):
        return _context(est) + max(est.allocated.values()), "context + max allocated"
    if counter.startswith("other:unstated"):
        return est.components["weights"] + est.components["kv_cache"], "weights + cache at the end (what it contains)"
    raise ValueError(f"row {row['id']}: unknown counter {counter!r}")


def _context(est) -> int:
    from vramcal.estimator.runtime import default_profile

    return default_profile(est.device).context_bytes


def formulas(est, row: dict) -> tuple[int | None, int | None]:
    """The documents' formula and params x bytes, on the same footing as the counter."""
    f = est.formula
    if not f:
        return None, None
    weights_only = row["counter"] in ("memory_footprint", "weights_only")
    documents = f.weights_bytes if weights_only else f.total_bytes
    return documents, f.weights_bytes


def run_row(row: dict, corpus_dir: Path) -> dict:
    from vramcal.errors import UserError
    from vramcal.estimator.estimate import estimate

    prompt, new, batch = _int(row["prompt_tokens"]), _int(row["new_tokens"]), _int(row["batch"])
    weights_only = prompt is None
    out = {"id": row["id"], "source_id": row["source_id"], "model": row["model"], "quant": row["quant"],
           "dtype": row["dtype"], "prompt": prompt, "new_tokens": new, "batch": batch, "counter": row["counter"],
           "figure_bytes": int(row["figure_bytes"]), "gpu": row["gpu"], "software": row["software"],
           "old_stack": "old stack" in row["notes"].lower(), "check": _check_note(row["notes"])}
    try:
        est = estimate(model_ref(row, corpus_dir), QUANT_OF_ROW.get(row["quant"], row["quant"]),
                       prompt=prompt or 1, new_tokens=new or 1, batch=batch or 1,
                       dtype=row["dtype"] or None, attn=ATTN_OF_ROW.get(row["attn"], row["attn"]), device="cuda")
    except UserError as exc:
        return {**out, "error": str(exc)}
    value, what = comparable(est, row)
    documents, params_bytes = formulas(est, row)
    meas = out["figure_bytes"]
    return {**out, "compared": what, "vramcal_bytes": value, "formula_bytes": documents,
            "params_bytes": params_bytes, "tokens": ((prompt or 1) + (new or 1)) * (batch or 1) if not weights_only else 0,
            "err_pct": 100.0 * (value - meas) / meas,
            "formula_err_pct": None if documents is None else 100.0 * (documents - meas) / meas,
            "params_err_pct": None if params_bytes is None else 100.0 * (params_bytes - meas) / meas,
            "approximate": est.approximate, "error": ""}


def _check_note(notes: str) -> str:
    if "[check]" not in notes:
        return ""
    text = notes.split("[check]", 1)[1].strip()
    return text.split("->", 1)[1].strip() if "->" in text else text


def leave_one_out(rows: list[dict]) -> None:
    """Per source with >= 3 rows: each row corrected by a line fitted to the other rows of its source."""
    from vramcal.calibrate.corrections import fit_line

    by_source: dict[str, list[dict]] = {}
    for r in rows:
        if not r.get("error"):
            by_source.setdefault(r["source_id"], []).append(r)
    for group in by_source.values():
        for r in group:
            r["calibrated_err_pct"] = None
        if len(group) < 3:
            continue
        for i, r in enumerate(group):
            others = [(o["tokens"], o["figure_bytes"] - o["vramcal_bytes"], j) for j, o in enumerate(group) if j != i]
            line = fit_line("peak", others)
            fixed = r["vramcal_bytes"] + line.at(r["tokens"])
            r["calibrated_err_pct"] = 100.0 * (fixed - r["figure_bytes"]) / r["figure_bytes"]


def _stats(values) -> tuple[float | None, float | None, int]:
    v = sorted(abs(x) for x in values if x is not None)
    if not v:
        return None, None, 0
    p95 = v[0] if len(v) == 1 else statistics.quantiles(v, n=100, method="inclusive")[94]
    return statistics.median(v), p95, len(v)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f} %"


def _signed(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1f} %"


def render(rows: list[dict], sources_md: str) -> str:
    ok = [r for r in rows if not r.get("error")]
    lines = ["## GPU evidence: figures others measured and published", "",
             f"{len(rows)} figures from {len({r['source_id'] for r in rows})} sources "
             f"(`benchmarks/published/corpus.csv`, sources and caveats in `{sources_md}`), each estimated with "
             "its own workload and compared on the counter the source printed. Generated by "
             "`python benchmarks/published.py`; *calibrated* is leave-one-out within a source "
             "(a source is one machine and one stack).", "",
             "| source | rows | vramcal median | p95 | calibrated median | calibrated p95 | formula (×1.18) median | "
             "params × bytes median |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    groups: dict[str, list[dict]] = {}
    for r in ok:
        groups.setdefault(r["source_id"], []).append(r)
    for src, g in sorted(groups.items()) + [("**all**", ok)]:
        v = _stats(r["err_pct"] for r in g)
        c = _stats(r.get("calibrated_err_pct") for r in g)
        f = _stats(r["formula_err_pct"] for r in g)
        p = _stats(r["params_err_pct"] for r in g)
        lines.append(f"| {src} | {v[2]} | {_pct(v[0])} | {_pct(v[1])} | {_pct(c[0])} | {_pct(c[1])} | "
                     f"{_pct(f[0])} | {_pct(p[0])} |")
    modern = [r for r in ok if not r["old_stack"]]
    v = _stats(r["err_pct"] for r in modern)
    lines += ["", f"On the {v[2]} rows measured on current stacks (not labelled *old stack*), vramcal's median error "
              f"is {_pct(v[0])} (p95 {_pct(v[1])}).", ""]
    failed = [r for r in rows if r.get("error")]
    if failed:
        lines += ["Rows vramcal could not estimate:", ""] + [f"- {r['id']}: {r['error']}" for r in failed] + [""]
    lines += ["### Every row", "",
              "Error = (vramcal − published) / published. *Check*: the arithmetic test of the figure "
              "(weights + cache + one layer's prefill), from `benchmarks/published/check_rows.py`.", "",
              "| id | model | quant | prompt + new × batch | counter → compared with | published | vramcal | error | "
              "formula | calibrated | note |",
              "| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        if r.get("error"):
            continue
        wl = "weights" if r["prompt"] is None else f"{r['prompt']} + {r['new_tokens']} × {r['batch']}"
        note = "; ".join(x for x in ("old stack" if r["old_stack"] else "", r["check"][:80]) if x)
        lines.append(f"| {r['id']} | {r['model']} | {r['quant']} | {wl} | {r['counter'].split('(')[0]} → "
                     f"{r['compared']} | {r['figure_bytes'] / 1024**3:.2f} GiB | {r['vramcal_bytes'] / 1024**3:.2f} GiB | "
                     f"{r['err_pct']:+.1f} % | {_signed(r['formula_err_pct'])} | "
                     f"{_signed(r.get('calibrated_err_pct'))} | {note} |")
    return "\n".join(lines) + "\n"


FIELDS = ["id", "source_id", "model", "quant", "dtype", "prompt", "new_tokens", "batch", "counter", "compared",
          "figure_bytes", "vramcal_bytes", "formula_bytes", "params_bytes", "err_pct", "formula_err_pct",
          "params_err_pct", "calibrated_err_pct", "approximate", "old_stack", "check", "gpu", "software", "error"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default=str(DEFAULT_CORPUS))
    ap.add_argument("--out-dir", default=str(ROOT / "docs" / "validation" / "published"))
    ap.add_argument("--no-report", action="store_true", help="do not regenerate docs/validation.md")
    args = ap.parse_args(argv)
    corpus = Path(args.corpus)
    with open(corpus, newline="") as fh:
        rows_in = list(csv.DictReader(fh))
    for r in rows_in:
        missing = [k for k in ("source_id", "counter", "source_url_or_repo_path") if not r.get(k)]
        if missing:
            raise SystemExit(f"row {r.get('id')}: no {', '.join(missing)}: every figure needs a source and a counter")
    rows = []
    for i, r in enumerate(rows_in, 1):
        print(f"[{i}/{len(rows_in)}] {r['id']} {r['model']} {r['quant']}", file=sys.stderr, flush=True)
        rows.append(run_row(r, corpus.parent))
    leave_one_out(rows)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "published.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    sources_md = os.path.relpath(corpus.parent / "sources.md", ROOT)
    (out / "published.md").write_text(render(rows, sources_md))
    ok = [r for r in rows if not r.get("error")]
    v = _stats(r["err_pct"] for r in ok)
    f = _stats(r["formula_err_pct"] for r in ok)
    print(f"{len(ok)} of {len(rows)} rows: vramcal median {_pct(v[0])}, p95 {_pct(v[1])}; "
          f"formula median {_pct(f[0])}", file=sys.stderr)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    if corpus.resolve() == DEFAULT_CORPUS.resolve():  # a full regeneration: the vLLM and llama.cpp corpora too
        import published_llamacpp
        import published_vllm

        published_vllm.main(["--out-dir", str(out)])
        published_llamacpp.main(["--out-dir", str(out)])
    if not args.no_report:
        import report

        return report.main([])
    return 0


if __name__ == "__main__":
    sys.exit(main())
