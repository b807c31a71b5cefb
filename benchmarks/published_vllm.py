"""Hold ``vramcal estimate --engine vllm`` against vLLM startup logs others published.

    python benchmarks/published_vllm.py [--corpus benchmarks/published/vllm/corpus.csv ...]
                                        [--out-dir docs/validation/published]

Without --corpus it reads ``corpus.csv`` and every other ``*.csv`` beside it (``hybrid.csv``: the hybrid
Mamba / Gated DeltaNet and gpt-oss MXFP4 startups of issue 23), one row set.

Every row of the corpus (benchmarks/published/vllm/sources.md) is one ``vllm serve`` startup: its
version, GPU, flags and the figures its log printed. vramcal predicts the same run from the model's
config and compares every term vLLM prints, on the same footing:

| term | vLLM's line |
| --- | --- |
| weights | "Model loading took X GiB" |
| activation | "torch peak memory increase" (DEBUG profile line) |
| non-torch | "non-torch forward increase memory" (DEBUG profile line) |
| KV memory | "Available KV cache memory: X GiB" |
| KV tokens | "GPU KV cache size: N tokens" |
| concurrency | "Maximum concurrency for L tokens per request: Cx" |
| graph estimate | "Estimated CUDA graph memory", "CUDA graph pool memory: ... (estimated)" or "is equivalent to --gpu-memory-utilization" (read from the row's log) |

Beside the end-to-end prediction, *KV rules*: the tokens vramcal's page and block rules give from
the *logged* available memory -- the KV arithmetic alone, without the memory budget's terms.

Writes ``published-vllm.csv`` and ``published-vllm.md`` into --out-dir; ``benchmarks/report.py``
puts the section first in docs/validation.md. Run by ``benchmarks/published.py`` as well.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GIB = 1024**3
TERMS = (("weights", "weights_gib", "weights_bytes"), ("activation", "activation_gib", "activation_bytes"),
         ("non-torch", "non_torch_gib", "non_torch_bytes"), ("KV memory", "kv_cache_gib", "kv_cache_bytes"),
         ("KV tokens", "kv_cache_tokens", "kv_cache_tokens"), ("concurrency", "max_concurrency", "max_concurrency"))
RANK_TERMS = ("activation_bytes", "non_torch_bytes", "kv_cache_bytes", "weights_bytes")
TARGETS = {"KV tokens": (2.0, 5.0), "weights": (1.0, None)}
# issue 27's blind collections, in the order they were collected: each reported apart from the rows read before
BLIND_COLLECTIONS = ("heldout-2026-12-03b.csv", "heldout-2026-12-03c.csv", "heldout-2026-12-03d.csv",
                     "heldout-2026-12-04.csv")


def _f(x: str) -> float | None:
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def model_ref(row: dict, corpus_dir: Path) -> str:
    cfg = corpus_dir / "configs" / f"{row['model']}.json"
    return str(cfg) if cfg.is_file() else row["model"]


def gpu_capability(row: dict) -> tuple[int, int] | None:
    """The row's GPU's compute capability from vramcal's table of GPUs (``table_capability``, the lookup
    ``--gpu`` makes), by the name the source gives with the corpus's note in brackets left off ("NVIDIA H100
    80GB (Kubernetes pod)"). None where the table does not say ("24 GB GPU (not named)", "RTX 3060 12GB"):
    the estimate then prices a named GPU it does not know as it says (fusion.py, mxfp4.py)."""
    from vramcal.probes.hardware import table_capability

    return table_capability(row["gpu"].split(" (")[0])


def args_of(row: dict):
    from vramcal.estimator.vllm.allreduce import Interconnect, parse
    from vramcal.estimator.vllm.engine import VllmArgs

    def i(key):
        v = _f(row.get(key, ""))
        return None if v is None else int(v)

    return VllmArgs(gpu_memory_utilization=float(row["gpu_memory_utilization"]), max_model_len=i("max_model_len"),
                    max_num_seqs=i("max_num_seqs"), max_num_batched_tokens=i("max_num_batched_tokens"),
                    block_size=i("block_size"),  # an optional column: --block-size where the run gave one
                    tensor_parallel_size=int(row["tp"]), pipeline_parallel_size=int(row["pp"]),
                    dtype=row["dtype"] or "auto", kv_cache_dtype=row["kv_cache_dtype"] or "auto",
                    quantization=row["quantization"] or None, enforce_eager=row["enforce_eager"] == "True",
                    gpu_memory_bytes=int(round(float(row["gpu_total_gib"]) * GIB)), gpu_name=row["gpu"],
                    gpu_capability=gpu_capability(row),
                    vllm_version=row["vllm_version"], usage=row.get("usage") or "serve",
                    allow_long_max_model_len=True,
                    flashinfer_sampler={"True": True, "False": False}.get(row.get("flashinfer_sampler") or ""),
                    # an optional column: cold | warm as the log shows the compile (blank: not known, cold)
                    compile_cache=row.get("compile_cache") or None,
                    mxfp4_backend=row.get("mxfp4_backend") or None,
                    enable_prefix_caching={"True": True, "False": False}.get(row.get("enable_prefix_caching") or ""),
                    # an optional column: nvlink | pcie as the source says (blank: the GPU's name, else nvlink)
                    interconnect=Interconnect(parse(row["interconnect"]), "the corpus row")
                    if row.get("interconnect") else None,
                    disable_custom_all_reduce=row.get("disable_custom_all_reduce") == "True")


def logs_peak_with_graphs(row: dict, est) -> bool:
    """A corpus activation read from 0.27's "... GiB for peak activation" (no DEBUG profile line) is the
    activation plus the CUDA-graph estimate (versions.usage_peak_includes_graphs): compare like with like."""
    from vramcal.estimator.vllm import versions as V

    return V.usage_peak_includes_graphs(V.parse_version(est.version)) and est.cuda_graph_subtracted


def kv_rules_tokens(est, row: dict) -> int | None:
    """Tokens from the logged available memory through vramcal's page and block rules (limiting rank)."""
    from vramcal.estimator.vllm import versions as V

    logged = _f(row["kv_cache_gib"])
    if logged is None or not est.block_bytes:
        return None
    if est.pipeline_parallel_size > 1:  # the log shows the first stage's memory; the blocks are the last's
        return None
    blocks = int(logged * GIB) // est.block_bytes
    if V.tokens_rule(V.parse_version(est.version)) == "concurrency":
        per_request = est.num_blocks / est.max_concurrency if est.max_concurrency else None
        return int(blocks / per_request * est.max_model_len) if per_request else None
    if est.hybrid_groups > 1:
        return blocks // est.hybrid_groups * est.block_size
    return blocks * est.block_size


def logged_compile_state(row: dict, corpus_dir: Path) -> str | None:
    """The compile cache's state a row's fixture log shows, as the vLLM probe reads its own log
    (``logparse.parse_log``: a "Compiling a graph" or "Directly load ..." line before the KV line); None where
    the excerpt prints neither, and the row is priced cold."""
    from vramcal.estimator.vllm.logparse import parse_log

    path = corpus_dir / row["fixture"] if row.get("fixture") else None
    return parse_log(path.read_text()).compile_cache if path is not None and path.is_file() else None


def logged_graph_estimate(row: dict, corpus_dir: Path) -> float | None:
    """The CUDA-graph estimate a row's fixture log prints, GiB: "Estimated CUDA graph memory" or "CUDA graph pool
    memory: ... (estimated)", else the "is equivalent to --gpu-memory-utilization" line's share of the device
    total (the log's own total, or the row's where the excerpt prints none). None where the log prints neither."""
    from vramcal.estimator.vllm.logparse import parse_log

    path = corpus_dir / row["fixture"] if row.get("fixture") else None
    if path is None or not path.is_file():
        return None
    log = parse_log(path.read_text())
    if log.cuda_graph_estimate_bytes is not None:
        return log.cuda_graph_estimate_bytes / GIB
    total = _f(row.get("gpu_total_gib") or "")
    return log.cuda_graph_estimate_fraction * total if log.cuda_graph_estimate_fraction and total else None


def read_corpus(corpus: Path) -> list[dict]:
    """``corpus.csv`` and the other collections beside it (``hybrid.csv``, ``heldout-*.csv``: later
    collections, kept in files of their own so that each collection's rows and sources stay together), in
    that order."""
    rows: list[dict] = []
    for path in [corpus, *sorted(p for p in corpus.parent.glob("*.csv") if p != corpus)]:
        with open(path, newline="") as fh:
            rows += [{**r, "collection": path.name} for r in csv.DictReader(fh)]
    ids = [r["id"] for r in rows]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise SystemExit(f"corpus ids repeated across files: {', '.join(dup)}")
    return rows


def run_row(row: dict, corpus_dir: Path) -> dict:
    from vramcal.errors import UserError
    from vramcal.estimator.vllm.engine import estimate_vllm

    out = {k: row[k] for k in ("id", "source_id", "model", "vllm_version", "gpu", "tp", "pp", "dtype", "kv_cache_dtype",
                               "quantization", "max_model_len")}
    out["collection"] = row.get("collection") or "corpus.csv"
    out["split"] = row.get("split") or "fit"
    out["examined"] = row.get("examined") or ""
    row = {**row, "compile_cache": row.get("compile_cache") or logged_compile_state(row, corpus_dir)}
    try:
        est = estimate_vllm(model_ref(row, corpus_dir), args_of(row))
    except UserError as exc:
        return {**out, "error": str(exc)}
    first = est.ranks[0] if est.ranks else None  # a log's per-rank lines are its first rank's (the corpus's)
    for term, col, attr in TERMS:
        logged = _f(row[col])
        pred = getattr(first, {"kv_cache_bytes": "available_bytes"}.get(attr, attr)) \
            if first is not None and attr in RANK_TERMS else getattr(est, attr)
        if attr == "activation_bytes" and logs_peak_with_graphs(row, est):
            pred += (first or est).cuda_graph_bytes  # the printed figure is the activation plus the graph estimate
        if attr.endswith("_bytes"):
            pred = pred / GIB
        out[f"{term}_logged"] = logged
        out[f"{term}_vramcal"] = pred
        out[f"{term}_err_pct"] = None if not logged else 100.0 * (pred - logged) / logged
        out[f"{term}_err_gib"] = None if logged is None or not attr.endswith("_bytes") else pred - logged
    # the estimate is what vramcal's graph term stands for only where it comes off the KV budget (0.20 on; before,
    # the term is the capture itself, which the log's "Graph capturing finished" line gives)
    graph_logged = logged_graph_estimate(row, corpus_dir) if est.cuda_graph_subtracted else None
    graph_pred = (first or est).cuda_graph_bytes / GIB
    out["graph estimate_logged"] = graph_logged
    out["graph estimate_vramcal"] = graph_pred
    out["graph estimate_err_pct"] = None if not graph_logged else 100.0 * (graph_pred - graph_logged) / graph_logged
    out["graph estimate_err_gib"] = None if graph_logged is None else graph_pred - graph_logged
    rules = kv_rules_tokens(est, row)
    logged_tokens = _f(row["kv_cache_tokens"])
    out["kv_rules_tokens"] = rules
    out["kv_rules_err_pct"] = None if rules is None or not logged_tokens else 100.0 * (rules - logged_tokens) / logged_tokens
    out["error"] = ""
    return out


def examined_kind(row: dict) -> str:
    """blind | diagnosed | rule: what the corpus's ``examined`` column says was done with a held-out row."""
    e = (row.get("examined") or "").strip()
    return "rule" if e.startswith("rule") else "diagnosed" if e.startswith("diagnosed") else "blind"


def _stats(values) -> tuple[float | None, float | None, int]:
    v = sorted(abs(x) for x in values if x is not None)
    if not v:
        return None, None, 0
    p90 = v[0] if len(v) == 1 else statistics.quantiles(v, n=10, method="inclusive")[8]
    return statistics.median(v), p90, len(v)


def _pct(x) -> str:
    return "n/a" if x is None else f"{x:.2f} %"


def render(rows: list[dict], sources_md: str) -> str:
    ok = [r for r in rows if not r.get("error")]
    versions = sorted({r["vllm_version"] for r in ok}, key=lambda s: tuple(int(x) for x in s.split(".")))
    lines = ["## vLLM: startup figures others published", "",
             f"{len(rows)} `vllm serve` / `LLM` startups from {len({r['source_id'] for r in rows})} sources, vLLM "
             f"{', '.join(versions)} (`benchmarks/published/vllm/corpus.csv` and the later collections beside it, "
             f"`hybrid.csv` and `heldout-*.csv`; sources in `{sources_md}` and `hybrid_sources.md`): "
             "`vramcal estimate MODEL --engine vllm` with each run's own flags, GPU total and version, every term "
             "compared with the line vLLM printed. Generated by `python benchmarks/published_vllm.py`. "
             "*KV rules* is the tokens vramcal's page and block rules give from the *logged* available memory "
             "(the KV arithmetic alone).", "",
             "How to read it: the weights and the KV page and block rules are arithmetic from vLLM's source, with "
             "nothing fitted. The activation model's six coefficients, the non-torch defaults and the CUDA-graph "
             "default were fitted to the llm-d-planner rows (0.15-0.19, H100), and the V2 model runner's CUDA-graph "
             "estimate (0.29 on) to the Tesla T4 0.29.0 sweep (`benchmarks/fit_vllm_graphs.py`); those rows are "
             "`split` = fit in the corpus, so their errors are in-sample. *graph estimate* is vLLM's own CUDA-graph "
             "estimate, compared where it comes off the KV budget (0.20 on). The *held-out* rows (`split` = held-out: other GPUs, versions and "
             "people, nothing fitted to them) are summarised apart first. The public planners publish no "
             "per-term predictions for these runs, so there is no column for them.",
             ""]
    for split, title in (("held-out", "Held-out rows (nothing was fitted to them)"),
                         ("fit", "In-sample rows (the coefficients were fitted to them)")):
        g = [r for r in ok if r.get("split", "fit") == split]
        if not g:
            continue
        lines += [f"### {title}", "", "| term | rows | median abs error | p90 | worst | target |",
                  "| --- | ---: | ---: | ---: | ---: | --- |"]
        for term in ("KV tokens", "weights", "KV memory", "graph estimate"):
            med, p90, n = _stats(r.get(f"{term}_err_pct") for r in g)
            if not n:
                continue
            worst = max(abs(r[f"{term}_err_pct"]) for r in g if r.get(f"{term}_err_pct") is not None)
            target = ""
            if term in TARGETS:
                tm, tp = TARGETS[term]
                met = med <= tm and (tp is None or p90 <= tp)
                target = f"median ≤ {tm:g} %" + (f", p90 ≤ {tp:g} %" if tp else "") + (": met" if met else ": **missed**")
            lines.append(f"| {term} | {n} | {_pct(med)} | {_pct(p90)} | {_pct(worst)} | {target} |")
        lines.append("")
        blind = [f for f in BLIND_COLLECTIONS if any(r.get("collection") == f for r in g)]
        if split == "held-out" and blind:
            names = " and ".join(f"`{f}`" for f in blind)
            lines += [f"The earlier held-out collections against the blind ones ({names}: each run once before any "
                      "change; their rows still blind apart from those read since: a diagnosis (`examined` = "
                      "diagnosed) or a rule their miss prompted (`examined` = rule). A file's *all* line is its rows "
                      "under today's rules -- its first-run figure only while no rule has moved them (each file's "
                      "first run is in docs/vllm.md and its test) -- and *still blind* what is left once rows that "
                      "missed were read; most rows of the first print no token count, so KV memory is its figure):", "",
                      "| rows | term | rows with it | median | p90 | worst |", "| --- | --- | ---: | ---: | ---: | ---: |"]
            groups = [("earlier", [r for r in g if r.get("collection") not in BLIND_COLLECTIONS])]
            for f in blind:
                mine = [r for r in g if r.get("collection") == f]
                groups += [(f"{f}, all", mine),
                           (f"{f}, still blind", [r for r in mine if examined_kind(r) == "blind"]),
                           (f"{f}, diagnosed since", [r for r in mine if examined_kind(r) == "diagnosed"]),
                           (f"{f}, rule since", [r for r in mine if examined_kind(r) == "rule"])]
            for label, gs in groups:
                for term in ("KV tokens", "KV memory", "weights"):
                    med, p90, n = _stats(r.get(f"{term}_err_pct") for r in gs)
                    if not n:
                        continue
                    worst = max(abs(r[f"{term}_err_pct"]) for r in gs if r.get(f"{term}_err_pct") is not None)
                    lines.append(f"| {label} | {term} | {n} | {_pct(med)} | {_pct(p90)} | {_pct(worst)} |")
            lines.append("")
        files = sorted({r.get("collection", "corpus.csv") for r in g})
        if split == "held-out" and len(files) > 1:
            lines += ["Held-out rows by the file they were collected in:", "",
                      "| file | rows | KV tokens median | p90 | KV memory median | p90 | weights median |",
                      "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
            for f in files:
                gf = [r for r in g if r.get("collection", "corpus.csv") == f]
                km, kp, kn = _stats(r.get("KV tokens_err_pct") for r in gf)
                mm, mp, _ = _stats(r.get("KV memory_err_pct") for r in gf)
                wm, _, _ = _stats(r.get("weights_err_pct") for r in gf)
                lines.append(f"| {f} | {len(gf)} ({kn} with tokens) | {_pct(km)} | {_pct(kp)} | {_pct(mm)} | "
                             f"{_pct(mp)} | {_pct(wm)} |")
            lines.append("")
        if split == "held-out":
            lines += ["Held-out rows by what was done with them (column `examined`): *blind* -- collected and run, "
                      "nothing read into a rule or a diagnosis; *diagnosed* -- the log read to find which term misses, "
                      "no rule changed; *rule* -- the row's miss prompted a rule read from vLLM's source (nothing "
                      "fitted), so it no longer tests that rule blind. Rows are read because they missed, so the "
                      "*blind* line is the better for it: the whole held-out set, and each blind file's *all* line "
                      "above, are the figures nothing was chosen from:", "",
                      "| examined | rows | KV tokens median | p90 | KV memory median | p90 | weights median |",
                      "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
            for kind in ("blind", "diagnosed", "rule"):
                gk = [r for r in g if examined_kind(r) == kind]
                if not gk:
                    continue
                km, kp, kn = _stats(r.get("KV tokens_err_pct") for r in gk)
                mm, mp, _ = _stats(r.get("KV memory_err_pct") for r in gk)
                wm, _, _ = _stats(r.get("weights_err_pct") for r in gk)
                lines.append(f"| {kind} | {len(gk)} ({kn} with tokens) | {_pct(km)} | {_pct(kp)} | {_pct(mm)} | "
                             f"{_pct(mp)} | {_pct(wm)} |")
            lines.append("")
    lines += ["### All rows, by version", "",
              "| term | vLLM version | rows | median abs error | p90 | worst | target |",
              "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for term in [t for t, _, _ in TERMS] + ["graph estimate"]:
        for ver in versions + ["all"]:
            g = [r for r in ok if ver == "all" or r["vllm_version"] == ver]
            med, p90, n = _stats(r.get(f"{term}_err_pct") for r in g)
            if not n:
                continue
            worst = max(abs(r[f"{term}_err_pct"]) for r in g if r.get(f"{term}_err_pct") is not None)
            target = ""
            if ver == "all" and term in TARGETS:
                tm, tp = TARGETS[term]
                met = med <= tm and (tp is None or p90 <= tp)
                target = f"median ≤ {tm:g} %" + (f", p90 ≤ {tp:g} %" if tp else "") + (": met" if met else ": **missed**")
            lines.append(f"| {term} | {ver} | {n} | {_pct(med)} | {_pct(p90)} | {_pct(worst)} | {target} |")
    med, p90, n = _stats(r.get("kv_rules_err_pct") for r in ok)
    lines.append(f"| KV rules (from the logged memory) | all | {n} | {_pct(med)} | {_pct(p90)} | | |")
    gib_terms = [t for t, _, a in TERMS if a.endswith("_bytes")] + ["graph estimate"]
    lines += ["", "Absolute errors in GiB (the activation and non-torch terms are small, so their percentages are "
              "large for small offsets):", "", "| term | median abs GiB | p90 abs GiB |", "| --- | ---: | ---: |"]
    for term in gib_terms:
        med, p90, n = _stats(r.get(f"{term}_err_gib") for r in ok)
        if n:
            lines.append(f"| {term} | {med:.3f} | {p90:.3f} |")
    failed = [r for r in rows if r.get("error")]
    if failed:
        lines += ["", "Rows vramcal could not estimate:", ""] + [f"- {r['id']}: {r['error']}" for r in failed]
    lines += ["", "### Every row", "",
              "Logged → vramcal, GiB unless said; error of the KV tokens in brackets.", "",
              "| id | split | model | vLLM | tp×pp | dtype / kv / quant | weights | activation | non-torch | KV memory | "
              "KV tokens | KV rules |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def pair(r, term, fmt="{:.2f}"):
        lo, pr = r.get(f"{term}_logged"), r.get(f"{term}_vramcal")
        return "n/a" if lo is None else f"{fmt.format(lo)} → {fmt.format(pr)}"

    for r in ok:
        tok = "n/a" if r.get("KV tokens_logged") is None else (
            f"{int(r['KV tokens_logged']):,} → {int(r['KV tokens_vramcal']):,} ({r['KV tokens_err_pct']:+.2f} %)")
        rules = "n/a" if r.get("kv_rules_err_pct") is None else f"{r['kv_rules_err_pct']:+.2f} %"
        q = "/".join(x or "-" for x in (r["dtype"], r["kv_cache_dtype"], r["quantization"]))
        lines.append(f"| {r['id'].replace('_h100-80gb', '').replace('llmd_', '')[:48]} | {r.get('split', 'fit')} | "
                     f"{r['model']} | {r['vllm_version']} | "
                     f"{r['tp']}×{r['pp']} | {q} | {pair(r, 'weights')} | {pair(r, 'activation')} | "
                     f"{pair(r, 'non-torch')} | {pair(r, 'KV memory')} | {tok} | {rules} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default=str(ROOT / "benchmarks" / "published" / "vllm" / "corpus.csv"),
                    help="the first collection; every other CSV beside it is read too")
    ap.add_argument("--out-dir", default=str(ROOT / "docs" / "validation" / "published"))
    args = ap.parse_args(argv)
    corpus = Path(args.corpus)
    rows_in = read_corpus(corpus)
    for r in rows_in:
        if not r.get("source_url") or not r.get("source_id"):
            raise SystemExit(f"row {r.get('id')}: no source: every figure needs one")
    rows = [run_row(r, corpus.parent) for r in rows_in]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fields = sorted({k for r in rows for k in r}, key=lambda k: (k not in rows_in[0], k))
    with open(out / "published-vllm.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    try:
        sources_md = str((corpus.parent / "sources.md").resolve().relative_to(ROOT))
    except ValueError:
        sources_md = str(corpus.parent / "sources.md")
    (out / "published-vllm.md").write_text(render(rows, sources_md))
    ok = [r for r in rows if not r.get("error")]
    med, p90, n = _stats(r.get("KV tokens_err_pct") for r in ok)
    wm, wp, _ = _stats(r.get("weights_err_pct") for r in ok)
    print(f"{len(ok)} of {len(rows)} vLLM rows: KV tokens median {_pct(med)}, p90 {_pct(p90)}; weights median "
          f"{_pct(wm)}, p90 {_pct(wp)}", file=sys.stderr)
    held = [r for r in ok if r.get("split") == "held-out"]
    if held:
        med, p90, n = _stats(r.get("KV tokens_err_pct") for r in held)
        wm, _, _ = _stats(r.get("weights_err_pct") for r in held)
        print(f"held-out ({n} rows): KV tokens median {_pct(med)}, p90 {_pct(p90)}; weights median {_pct(wm)}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
