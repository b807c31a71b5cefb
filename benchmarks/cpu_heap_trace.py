"""Per-weight glibc heap trace of a bitsandbytes load on the CPU (diagnostic for docs/cpu-memory.md).

    python benchmarks/cpu_heap_trace.py MODEL_DIR --quant nf4|int8 [--out trace.csv]

Wraps ``bitsandbytes.functional.quantize_4bit`` / ``int8_vectorwise_quant`` and, after each call, reads
glibc's ``mallinfo2`` (main arena size, bytes in use, bytes free, mmapped chunk bytes) and the resident
set. One row per quantized weight: its element count, and where the heap stands.
"""

from __future__ import annotations

import argparse
import ctypes
import sys


class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--quant", default="nf4")
    ap.add_argument("--out")
    args = ap.parse_args()
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Mallinfo2

    import torch
    import bitsandbytes.functional as F
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    rows = []

    def rss() -> int:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * 4096

    def wrap(fn):
        def inner(A, *a, **k):
            out = fn(A, *a, **k)
            mi = libc.mallinfo2()
            rows.append((A.numel(), A.dtype, mi.arena, mi.uordblks, mi.fordblks, mi.hblkhd, mi.keepcost, rss()))
            return out
        return inner

    F.quantize_4bit = wrap(F.quantize_4bit)
    F.int8_vectorwise_quant = wrap(F.int8_vectorwise_quant)
    mi = libc.mallinfo2()
    print(f"start arena={mi.arena >> 20} MiB in_use={mi.uordblks >> 20} rss={rss() >> 20}")
    if args.quant == "nf4":
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    else:
        q = BitsAndBytesConfig(load_in_8bit=True)
    AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16, device_map="cpu", quantization_config=q)
    lines = ["n,dtype,arena,in_use,free,mmapped,keepcost,rss"]
    for r in rows:
        lines.append(",".join(str(x) for x in r))
    text = "\n".join(lines) + "\n"
    if args.out:
        open(args.out, "w").write(text)
    for r in rows[:30]:
        print(f"n={r[0]:>10} arena={r[2] / 2**20:8.1f} in_use={r[3] / 2**20:8.1f} free={r[4] / 2**20:8.1f} "
              f"mmapped={r[5] / 2**20:6.1f} top={r[6] / 2**20:6.1f}")
    r = rows[-1]
    print(f"last: arena={r[2] / 2**20:.1f} in_use={r[3] / 2**20:.1f} free={r[4] / 2**20:.1f} ({len(rows)} weights)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
