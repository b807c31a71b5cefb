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

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType


def write_header(path: str) -> None:
    E, L, F, V, KV = 8192, 80, 28672, 128256, 8
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(L)
    w.add_context_length(131072)
    w.add_embedding_length(E)
    w.add_feed_forward_length(F)
    w.add_head_count(64)
    w.add_head_count_kv(KV)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"tok{i}" for i in range(V)])
    w.add_token_types([1] * V)
    w.add_token_merges([f"a{i} b{i}" for i in range(280147)])
    data = 0

    def info(name, shape, t):
        nonlocal data
        block, size = gguf.GGML_QUANT_SIZES[t]
        n = int(np.prod(shape)) // block * size
        byte_shape = shape if t == Q.F32 else (*shape[:-1], shape[-1] // block * size)
        w.add_tensor_info(name, byte_shape, np.dtype(np.float32 if t == Q.F32 else np.uint8), n, raw_dtype=t)
        data += (n + 31) // 32 * 32

    info("token_embd.weight", (V, E), Q.Q4_K)
    for i in range(L):
        b = f"blk.{i}."
        for name in ("attn_norm", "ffn_norm"):
            info(b + name + ".weight", (E,), Q.F32)
        info(b + "attn_q.weight", (E, E), Q.Q4_K)
        info(b + "attn_k.weight", (KV * 128, E), Q.Q4_K)
        info(b + "attn_v.weight", (KV * 128, E), Q.Q6_K)
        info(b + "attn_output.weight", (E, E), Q.Q4_K)
        info(b + "ffn_gate.weight", (F, E), Q.Q4_K)
        info(b + "ffn_up.weight", (F, E), Q.Q4_K)
        info(b + "ffn_down.weight", (E, F), Q.Q6_K)
    info("output_norm.weight", (E,), Q.F32)
    info("output.weight", (V, E), Q.Q6_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    size = os.path.getsize(path)
    os.truncate(path, (size + 31) // 32 * 32 + data)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "llama-70b-Q4_K_M.gguf")
        write_header(path)
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
