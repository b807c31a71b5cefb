"""Fit the V2 model runner's CUDA-graph estimate (vLLM 0.29 on) to the published logs, and hold it against the
rows it was not fitted to.

    python benchmarks/fit_vllm_graphs.py

vLLM 0.29's V2 runner sizes the CUDA-graph headroom it takes off the KV budget by capturing the graphs once into a
throwaway pool and measuring the device's free memory (``v1/worker/gpu/cudagraph_utils.py``
``profile_cudagraph_memory``: every PIECEWISE graph, two FULL ones, the other FULL graphs extrapolated from the
second, at least 1 MiB each). No byte formula comes out of that, so vramcal prices it as a base plus a cost per
graph and decoder layer on the rank, graphs = the PIECEWISE and FULL captures ``versions.cudagraph_captures``
gives for the run's ``max_num_seqs``, ``max_num_batched_tokens`` and GPU (``budget.V2_GRAPH_BASE``,
``budget.V2_GRAPH_PER_GRAPH_LAYER``).

The fit rows are the corpus's ``split`` = fit rows on the V2 runner from 0.29 whose logs print the estimate (the
Tesla T4 0.29.0 sweep of ``max_num_seqs``, ``heldout-2026-12-03d.csv``); every held-out row of that kind is the
check. Least squares on the estimate in bytes; the figures print in GiB / MiB.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

GIB, MIB = 1024**3, 1024**2


def points(corpus: Path | None = None) -> list[dict]:
    """One point per corpus row on the V2 runner's own estimate with a logged one: id, split, graphs x layers,
    the logged estimate and vramcal's (bytes)."""
    from published_vllm import args_of, logged_graph_estimate, model_ref, read_corpus
    from vramcal.errors import UserError
    from vramcal.estimator.vllm.budget import V2_GRAPH_METHOD
    from vramcal.estimator.resolve import resolve_model
    from vramcal.estimator.vllm.engine import estimate_vllm

    corpus = corpus or ROOT / "benchmarks" / "published" / "vllm" / "corpus.csv"
    out = []
    for row in read_corpus(corpus):
        logged = logged_graph_estimate(row, corpus.parent)
        if logged is None:
            continue
        try:
            est = estimate_vllm(model_ref(row, corpus.parent), args_of(row))
        except UserError:
            continue
        if not est.methods.get("cuda_graphs", "").startswith(V2_GRAPH_METHOD):
            continue
        if est.ranks:  # the log's lines are its first rank's
            layers, priced = est.ranks[0].layers[1] - est.ranks[0].layers[0], est.ranks[0].cuda_graph_bytes
        else:
            config = resolve_model(model_ref(row, corpus.parent)).config
            layers, priced = config.get("text_config", config)["num_hidden_layers"], est.cuda_graph_bytes
        graphs = (est.cuda_graph_piecewise or 0) + (est.cuda_graph_full or 0)
        out.append({"id": row["id"], "split": row.get("split") or "fit", "gpu": row["gpu"],
                    "version": row["vllm_version"], "x": graphs * layers, "graphs": graphs,
                    "logged": int(round(logged * GIB)), "vramcal": priced})
    return out


def fit(pts: list[dict]) -> tuple[float, float]:
    """Least-squares base (bytes) and cost per graph x layer (bytes) over the fit rows."""
    fit_pts = [p for p in pts if p["split"] == "fit"]
    if len(fit_pts) < 2:
        raise SystemExit("fewer than two fit rows with a logged V2 graph estimate")
    n = len(fit_pts)
    mx = sum(p["x"] for p in fit_pts) / n
    my = sum(p["logged"] for p in fit_pts) / n
    sxx = sum((p["x"] - mx) ** 2 for p in fit_pts)
    slope = sum((p["x"] - mx) * (p["logged"] - my) for p in fit_pts) / sxx
    return my - slope * mx, slope


def main() -> int:
    pts = points()
    base, per = fit(pts)
    print(f"V2 CUDA-graph estimate: {base / GIB:.4f} GiB + {per / MIB:.4f} MiB per graph x layer "
          f"(fitted to {sum(p['split'] == 'fit' for p in pts)} rows)")
    print("| split | id | GPU | vLLM | graphs | logged GiB | fitted GiB | error | vramcal now GiB |")
    print("| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for p in sorted(pts, key=lambda p: (p["split"] != "fit", p["id"])):
        pred = base + per * p["x"]
        print(f"| {p['split']} | {p['id']} | {p['gpu']} | {p['version']} | {p['graphs']} | {p['logged'] / GIB:.3f} | "
              f"{pred / GIB:.3f} | {100 * (pred - p['logged']) / p['logged']:+.1f} % | {p['vramcal'] / GIB:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
