"""Estimator speed, measured as ratios within one run on this machine (docs/performance.md).

    python benchmarks/bench_estimator.py [--repeat 4]

The ratios against a bare ``import torch, transformers`` are taken in alternating pairs of whole
processes (bare import, then the measured command, --repeat times), so both sides of each ratio run on
the same machine in the same minute; the median pair ratio is reported. The other rows are medians of
--repeat fresh processes, except the sweep, which is timed in-process after the model's traces are
cached. Run it on a quiet machine: a ratio is only a ratio when nothing else runs beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

PY = sys.executable


def wall(cmd: list[str], env: dict) -> float:
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"benchmark command failed: {' '.join(cmd)}\n{r.stderr}")
    return time.perf_counter() - t


def median_of(n: int, fn) -> float:
    return statistics.median(fn() for _ in range(n))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--model", default="llama-3.1-70b")
    args = ap.parse_args()
    n = args.repeat
    results: dict[str, float] = {}

    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "VRAMCAL_CACHE": cache, "TRANSFORMERS_VERBOSITY": "error"}
        quick = [PY, "-m", "vramcal", "estimate", "--params-b", "27", "--bits", "4", "--layers", "60",
                 "--kv-heads", "8", "--head-dim", "128", "--ctx", "32768", "--json"]
        results["quick_mode_s"] = median_of(n, lambda: wall(quick, env))
        bare = [PY, "-c", "import torch, transformers; transformers.AutoConfig; transformers.AutoModelForCausalLM"]
        inv_code = ("import sys; from vramcal.estimator.resolve import resolve_model; "
                    "from vramcal.estimator.quant import resolve_quant; "
                    "from vramcal.estimator.inventory import inventory; "
                    f"s = resolve_model('{args.model}'); inventory(s, resolve_quant('nf4', s.config), use_cache=False)")

        def first_8b() -> float:  # the case: a first answer for a popular model at a long context
            with tempfile.TemporaryDirectory() as fresh:
                return wall([PY, "-m", "vramcal", "estimate", "llama-3.1-8b", "--quant", "nf4", "--ctx", "32768",
                             "--json", "--no-correction"], {**env, "VRAMCAL_CACHE": fresh})

        pairs: dict[str, list[tuple[float, float]]] = {"first_estimate_8b_32k": [], "meta_inventory_70b": []}
        for _ in range(n):  # alternating: bare import, the command, bare import, the other command
            pairs["first_estimate_8b_32k"].append((wall(bare, env), first_8b()))
            pairs["meta_inventory_70b"].append((wall(bare, env), wall([PY, "-c", inv_code], env)))
        results["import_torch_transformers_s"] = statistics.median(b for v in pairs.values() for b, _ in v)
        for name, v in pairs.items():
            results[f"{name}_s"] = statistics.median(c for _, c in v)
            results[f"{name}_ratio"] = statistics.median(c / b for b, c in v)
        first = [PY, "-m", "vramcal", "estimate", args.model, "--quant", "nf4", "--ctx", "8192", "--json"]
        results["first_estimate_s"] = wall(first, env)  # inventory + KV layout + the point's trace, then cached
        again = [PY, "-m", "vramcal", "estimate", args.model, "--quant", "nf4", "--ctx", "8192", "--json"]
        results["cached_estimate_same_point_s"] = median_of(n, lambda: wall(again, env))
        other = [PY, "-m", "vramcal", "estimate", args.model, "--quant", "nf4", "--ctx", "30000", "--batch", "3",
                 "--fast", "--json"]
        wall(other, env)  # the first --fast traces the fit points once
        results["cached_estimate_new_point_fast_s"] = median_of(n, lambda: wall(other, env))

        os.environ["VRAMCAL_CACHE"] = cache
        from vramcal.estimator.estimate import Estimator
        from vramcal.estimator.quant import resolve_quant
        from vramcal.estimator.resolve import resolve_model

        source = resolve_model(args.model)
        estimators = [Estimator(source, resolve_quant(q, source.config)) for q in ("nf4",)]
        points = [(ctx, batch) for ctx in range(1024, 1024 + 2500 * 40, 40) for batch in (1, 2, 4, 8)][:10_000]
        # the longest point is beyond the traced ones: the first sweep there traces it once (then cached)
        t = time.perf_counter()
        estimators[0].sweep(points[-1:])
        results["sweep_cover_trace_s"] = time.perf_counter() - t
        t = time.perf_counter()
        rows = [r for e in estimators for r in e.sweep(points)]
        results["sweep_10000_points_s"] = time.perf_counter() - t
        assert len(rows) == 10_000

    r = results
    report = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "results_s": {k: round(v, 4) for k, v in r.items()},
        "ratios": {
            "quick_mode_s (target < 0.3 s)": round(r["quick_mode_s"], 3),
            "meta_inventory_70b / import torch+transformers, median of alternating pairs (target < 1.5)":
                round(r["meta_inventory_70b_ratio"], 3),
            "first estimate Llama-3.1-8B nf4 ctx 32768 / import torch+transformers, median of pairs (target <= 2)":
                round(r["first_estimate_8b_32k_ratio"], 3),
            "cached estimate, same point (target < 0.3 s)": round(r["cached_estimate_same_point_s"], 3),
            "cached estimate, new point --fast (target < 0.3 s)": round(r["cached_estimate_new_point_fast_s"], 3),
            "sweep of 10,000 points (target < 1 s)": round(r["sweep_10000_points_s"], 3),
            "the trace a sweep beyond the traced points makes first (once per model and range)":
                round(r["sweep_cover_trace_s"], 3),
        },
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
