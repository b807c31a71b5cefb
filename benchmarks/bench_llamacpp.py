"""Time `vramcal estimate --engine llama.cpp` on a Llama-3.1-70B-shaped Q4_K_M GGUF header (docs/performance.md).

The file is written sparse: a real header (80 layers, a 128256-token vocabulary, 280147 merges, every tensor's
info) followed by a hole the size of the weights, so the estimate reads what it would read of the real 40 GiB
file and nothing else. Each run is a fresh process.

    python benchmarks/bench_llamacpp.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from tiny_gguf import write_sparse_header  # noqa: E402 -- the tests' writer of the same 70B-shaped header


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "llama-70b-Q4_K_M.gguf")
        write_sparse_header(path, n_merges=280147)
        cmd = [sys.executable, "-m", "vramcal", "estimate", "--engine", "llama.cpp", path, "-c", "8192", "-ngl", "99",
               "--gpu-count", "1", "--json"]
        for _ in range(args.repeat):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t = time.perf_counter()
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            wall = time.perf_counter() - t
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
            print(f"wall {wall:.2f} s  cpu {cpu:.2f} s  (header {os.path.getsize(path) / 1024**3:.1f} GiB sparse file)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
