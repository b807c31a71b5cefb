"""``vramcal plan`` speed, as ratios within one run on this machine (docs/performance.md).

    python benchmarks/bench_plan.py [--repeat 4]

The issue's case: ``vramcal plan llama-3.1-70b --hardware cuda:0=24GiB,cpu=128GiB`` -- four quantizations,
each split between the GPU and RAM by transformers' own map until every whole peak fits, each verified
with the exact trace. "First" runs with an empty disk cache, in alternating pairs with a bare
``import torch, transformers`` (so both sides of each ratio run in the same minute); "cached" repeats
the same command with the cache the first run left. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_estimator import PY, wall  # noqa: E402 -- the same timer and interpreter as the estimator's bench


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--model", default="llama-3.1-70b")
    ap.add_argument("--hardware", default="cuda:0=24GiB,cpu=128GiB")
    args = ap.parse_args()
    bare = [PY, "-c", "import torch, transformers; transformers.AutoConfig; transformers.AutoModelForCausalLM"]
    plan = [PY, "-m", "vramcal", "plan", args.model, "--hardware", args.hardware, "--gpu", "RTX 4090", "--json"]
    pairs, cached = [], []
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "VRAMCAL_CACHE": cache, "TRANSFORMERS_VERBOSITY": "error"}
            pairs.append((wall(bare, env), wall(plan, env)))
            cached.append(wall(plan, env))
    results = {
        "import_torch_transformers_s": statistics.median(b for b, _ in pairs),
        "first_plan_s": statistics.median(p for _, p in pairs),
        "first_plan_ratio": statistics.median(p / b for b, p in pairs),
        "cached_plan_s": statistics.median(cached),
        "pairs": pairs, "repeat": args.repeat, "python": platform.python_version(),
    }
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
