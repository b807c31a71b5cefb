"""The cost of ``estimate --engine vllm`` beside the transformers estimate of the same model.

    python benchmarks/bench_vllm.py [--model llama-3.1-8b] [--repeat 4]

Whole processes (``python -m vramcal estimate ...``), measured in **alternation** (transformers, then vLLM,
``--repeat`` times) so both sides of the ratio ran in the same minutes; each cold run has a fresh disk
cache (``VRAMCAL_CACHE``), each warm run the cache its cold run left. Prints medians and the ratio
vLLM / transformers; docs/performance.md keeps the figures with the command.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(argv: list[str], cache: str) -> float:
    env = {**os.environ, "VRAMCAL_CACHE": cache, "PYTHONPATH": str(ROOT)}
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "vramcal", "estimate", *argv, "--json", "--no-correction", "--quiet"],
                   env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--repeat", type=int, default=4)
    args = ap.parse_args(argv)
    tf = [args.model, "--ctx", "8192"]
    vl = [args.model, "--engine", "vllm", "--gpu-memory", "80GiB", "--max-model-len", "8192"]
    times: dict[str, list[float]] = {k: [] for k in ("tf cold", "vllm cold", "tf warm", "vllm warm")}
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
            times["tf cold"].append(run(tf, a))
            times["vllm cold"].append(run(vl, b))
            times["tf warm"].append(run(tf, a))
            times["vllm warm"].append(run(vl, b))
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        print(f"{k:10s} {v:6.2f} s   ({', '.join(f'{x:.2f}' for x in times[k])})")
    for kind in ("cold", "warm"):
        ratios = [v / t for v, t in zip(times[f"vllm {kind}"], times[f"tf {kind}"])]
        print(f"ratio vllm / transformers, {kind}: median of pairs {statistics.median(ratios):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
