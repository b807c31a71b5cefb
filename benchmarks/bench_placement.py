"""Placement speed, as ratios within one run on this machine (docs/placement.md, docs/performance.md).

    python benchmarks/bench_placement.py [--repeat 3] [--model llama-3.1-70b] [--quant nf4]
        [--max-memory cuda:0=24GiB,cuda:1=24GiB,cpu=64GiB]

Each timing is the median of --repeat fresh processes (interpreter start included):

- ``import_torch_transformers_s``: a bare ``import torch, transformers``;
- ``first_placement_s``: resolve the model and plan its placement with an empty cache (builds the meta
  model, runs transformers' device-map function, counts the tensors; a refused bitsandbytes plan also
  builds the alternative);
- ``repeated_placement_s``: the same plan again, from the on-disk cache; the child reports whether
  torch was imported (it must not be).
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

PLAN = """
import json, sys
from vramcal.estimator.resolve import resolve_model
from vramcal.estimator.quant import resolve_quant
from vramcal.estimator.placement import plan_placement
s = resolve_model({model!r})
p = plan_placement(s, resolve_quant({quant!r}, s.config), {max_memory!r})
print(json.dumps({{"torch": "torch" in sys.modules, "lines": p.grouped(), "refused": p.refused is not None}}))
"""


def run(cmd: list[str], env: dict) -> tuple[float, str]:
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    dt = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"benchmark command failed: {' '.join(cmd)}\n{r.stderr}")
    return dt, r.stdout


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--model", default="llama-3.1-70b")
    ap.add_argument("--quant", default="nf4")
    ap.add_argument("--max-memory", default="cuda:0=24GiB,cuda:1=24GiB,cpu=64GiB")
    args = ap.parse_args()
    code = PLAN.format(model=args.model, quant=args.quant, max_memory=args.max_memory)
    imports, firsts, repeats = [], [], []
    last = {}
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "VRAMCAL_CACHE": cache, "TRANSFORMERS_VERBOSITY": "error"}
            imports.append(run([PY, "-c", "import torch, transformers"], env)[0])
            dt, _ = run([PY, "-c", code], env)
            firsts.append(dt)
            dt, out = run([PY, "-c", code], env)
            repeats.append(dt)
            last = json.loads(out.strip().splitlines()[-1])
    imp, first, rep = (statistics.median(x) for x in (imports, firsts, repeats))
    print(json.dumps({
        "model": args.model, "quant": args.quant, "max_memory": args.max_memory, "repeat": args.repeat,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "import_torch_transformers_s": round(imp, 3), "first_placement_s": round(first, 3),
        "first_over_import": round(first / imp, 2), "repeated_placement_s": round(rep, 3),
        "repeated_imports_torch": last.get("torch"), "plan": last.get("lines"), "refused": last.get("refused"),
    }, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
