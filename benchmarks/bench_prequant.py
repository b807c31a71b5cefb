"""The first estimate of a pre-quantized checkpoint against a bare ``import torch, transformers`` (issue 23's
speed target: <= 2x), as ratios of alternating pairs of whole processes in one run (docs/performance.md).

    python benchmarks/bench_prequant.py [--repeat 4] [--model gpt-oss-20b --model qwen3-next-80b-a3b-fp8]

Each pair runs the bare import, then the estimate with a fresh cache (the meta model with the format's own
module replacement, the KV layout and the point's dry run); the median pair ratio is reported. Run it on a
quiet machine.
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
    ap.add_argument("--model", action="append", default=None)
    args = ap.parse_args()
    models = args.model or ["gpt-oss-20b", "deepseek-v3"]
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error"}
    bare = [PY, "-c", "import torch, transformers; transformers.AutoConfig; transformers.AutoModelForCausalLM"]
    out = {}
    for model in models:
        pairs = []
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory() as fresh:
                cmd = [PY, "-m", "vramcal", "estimate", model, "--gpu", "H200", "--ctx", "8192", "--json",
                       "--no-correction"]
                pairs.append((wall(bare, env), wall(cmd, {**env, "VRAMCAL_CACHE": fresh})))
        out[model] = {"bare_import_s": round(statistics.median(b for b, _ in pairs), 3),
                      "first_estimate_s": round(statistics.median(c for _, c in pairs), 3),
                      "ratio_median_of_pairs": round(statistics.median(c / b for b, c in pairs), 3)}
    print(json.dumps({"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                                 f"Python {platform.python_version()}", "target": "ratio <= 2", "models": out},
                     indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
