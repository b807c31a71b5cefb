"""Placement speed, as ratios within one run on this machine (docs/placement.md, docs/performance.md).

    python benchmarks/bench_placement.py [--repeat 3] [--model llama-3.1-70b] [--quant nf4]
        [--max-memory cuda:0=24GiB,cuda:1=24GiB,cpu=64GiB]

Each timing is the median of --repeat fresh processes (interpreter start included):

- ``import_torch_transformers_s``: a bare ``import torch, transformers``;
- ``first_placement_s``: resolve the model and plan its placement with an empty cache (builds the meta
  model, runs transformers' device-map function, counts the tensors; a refused bitsandbytes plan also
  builds the alternative);
- ``repeated_placement_s``: the same plan again, from the on-disk cache; the child reports whether
  torch was imported (it must not be), and ``repeated_in_process_s`` is the plan call alone inside it
  (resolve + plan from the cache: what remains once the interpreter and vramcal are imported);
- ``repeated_estimate_cli_s``: ``vramcal estimate MODEL --max-memory ... --json`` with everything cached
  (inventory, dry run and plan: the command a user repeats), after one run that fills the caches.

``--profile`` prints the slowest functions of one in-process cached plan (cProfile, cumulative).
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
import json, sys, time
from vramcal.estimator.resolve import resolve_model
from vramcal.estimator.quant import resolve_quant
from vramcal.estimator.placement import plan_placement
t = time.perf_counter()
s = resolve_model({model!r})
p = plan_placement(s, resolve_quant({quant!r}, s.config), {max_memory!r})
dt = time.perf_counter() - t
print(json.dumps({{"torch": "torch" in sys.modules, "lines": p.grouped(), "refused": p.refused is not None,
                  "in_process_s": dt}}))
"""

PROFILE = """
import cProfile, pstats
from vramcal.estimator.resolve import resolve_model
from vramcal.estimator.quant import resolve_quant
from vramcal.estimator.placement import plan_placement
pr = cProfile.Profile()
pr.enable()
s = resolve_model({model!r})
p = plan_placement(s, resolve_quant({quant!r}, s.config), {max_memory!r})
pr.disable()
pstats.Stats(pr).sort_stats("cumulative").print_stats(12)
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
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    code = PLAN.format(model=args.model, quant=args.quant, max_memory=args.max_memory)
    estimate_cli = [PY, "-m", "vramcal", "estimate", args.model, "--quant", args.quant, "--max-memory", args.max_memory,
                    "--json", "--no-correction", "--fast"]
    imports, firsts, repeats, inproc, clis = [], [], [], [], []
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
            inproc.append(last["in_process_s"])
            run(estimate_cli, env)  # fills the inventory and dry-run caches
            clis.append(run(estimate_cli, env)[0])
            if args.profile and len(repeats) == 1:
                print(run([PY, "-c", PROFILE.format(model=args.model, quant=args.quant,
                                                    max_memory=args.max_memory)], env)[1])
    imp, first, rep, rep_in, cli = (statistics.median(x) for x in (imports, firsts, repeats, inproc, clis))
    print(json.dumps({
        "model": args.model, "quant": args.quant, "max_memory": args.max_memory, "repeat": args.repeat,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "import_torch_transformers_s": round(imp, 3), "first_placement_s": round(first, 3),
        "first_over_import": round(first / imp, 2), "repeated_placement_s": round(rep, 3),
        "repeated_in_process_s": round(rep_in, 4), "repeated_estimate_cli_s": round(cli, 3),
        "repeated_imports_torch": last.get("torch"), "plan": last.get("lines"), "refused": last.get("refused"),
    }, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
