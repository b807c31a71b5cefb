"""Where a CPU probe's resident set goes: load + generate one model, reading /proc/self/smaps at each stage.

    python benchmarks/cpu_rss_instrument.py MODEL_DIR --quant bf16|nf4|int8 --ctx 1024 [--batch 1] [--json OUT]

Same steps as ``vramcal.probes.child`` (pre-import, baseline, ``from_pretrained``, gc, generate 16 tokens,
the first token marked by a streamer / logits processor), and at each stage the process's
``smaps_rollup`` (Rss, Anonymous, file-backed = Rss - Anonymous) plus the per-mapping resident bytes
grouped into: the checkpoint's safetensors mapping, [heap], anonymous mappings (by size band), shared
libraries, everything else. Also glibc's ``mallinfo2`` (arena bytes in use / free) where available.
Diagnostic only: nothing in vramcal imports it.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import sys
import time


def rollup(pid: int | str = "self") -> dict[str, int]:
    """``/proc/PID/smaps_rollup`` in bytes, with ``File`` = Rss - Anonymous (this process by default)."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as fh:
        for line in fh:
            parts = line.split()
            if len(parts) >= 3 and parts[-1] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    out["File"] = out.get("Rss", 0) - out.get("Anonymous", 0)
    return out


def mappings() -> list[dict]:
    maps = []
    cur = None
    with open("/proc/self/smaps") as fh:
        for line in fh:
            first = line.split(None, 1)[0]
            if "-" in first and not first.endswith(":"):
                parts = line.split(None, 5)
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                cur = {"start": lo, "size": hi - lo, "perms": parts[1],
                       "name": parts[5].strip() if len(parts) > 5 else ""}
                maps.append(cur)
            elif cur is not None and line.endswith("kB\n"):
                k, v = line.split()[:2]
                cur[k.rstrip(":")] = int(v) * 1024
    return maps


def grouped(model_dir: str) -> dict[str, int]:
    g: dict[str, int] = {}
    big: list[tuple[int, str]] = []
    for m in mappings():
        rss = m.get("Rss", 0)
        name = m["name"]
        if name.endswith(".safetensors"):
            key = "safetensors"
        elif name == "[heap]":
            key = "heap"
        elif name == "":
            key = "anon>=64MiB" if m["size"] >= 64 << 20 else ("anon>=1MiB" if m["size"] >= 1 << 20 else "anon<1MiB")
        elif ".so" in name:
            key = "libs"
        else:
            key = "other:" + os.path.basename(name)[:30] if rss > 8 << 20 else "other"
        g[key] = g.get(key, 0) + rss
        if rss >= 32 << 20:
            big.append((rss, f"{name or 'anon'} size={m['size'] >> 20}MiB"))
    big.sort(reverse=True)
    g["_big"] = [f"{r >> 20} MiB {n}" for r, n in big[:8]]
    return g


class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]


def mallinfo() -> dict[str, int]:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = Mallinfo2
        mi = libc.mallinfo2()
        return {"arena": mi.arena, "mmapped": mi.hblkhd, "mmapped_n": mi.hblks, "in_use": mi.uordblks,
                "free": mi.fordblks}
    except Exception as exc:  # pragma: no cover
        return {"error": str(exc)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--quant", default="bf16")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--json")
    ap.add_argument("--trim", action="store_true", help="malloc_trim(0) after gc (diagnostic)")
    ap.add_argument("--drop-mmap", action="store_true", help="madvise the checkpoint away after load (diagnostic)")
    args = ap.parse_args()

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig
    from transformers.models.auto.auto_factory import _get_model_class

    config = AutoConfig.from_pretrained(args.model_dir)
    _get_model_class(config, AutoModelForCausalLM._model_mapping)
    if args.quant != "bf16":
        import bitsandbytes  # noqa: F401
    gc.collect()
    stages: dict[str, dict] = {}

    def mark(name: str) -> None:
        stages[name] = {"t": time.monotonic(), "rollup": rollup(), "groups": grouped(args.model_dir),
                        "mallinfo": mallinfo()}
        r = stages[name]["rollup"]
        base = stages.get("baseline", stages[name])["rollup"]
        print(f"{name:12s} rss={r['Rss'] / 2**20:8.1f} MiB  +{(r['Rss'] - base['Rss']) / 2**20:8.1f}  "
              f"anon +{(r['Anonymous'] - base['Anonymous']) / 2**20:8.1f}  file +{(r['File'] - base['File']) / 2**20:8.1f}"
              f"  groups={ {k: round(v / 2**20, 1) for k, v in stages[name]['groups'].items() if k != '_big'} }",
              flush=True)
        print("   ", stages[name]["groups"]["_big"], stages[name]["mallinfo"], flush=True)

    mark("baseline")
    kwargs = {"dtype": torch.bfloat16, "device_map": "cpu"}
    if args.quant == "nf4":
        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                           bnb_4bit_compute_dtype=torch.bfloat16)
    elif args.quant == "int8":
        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, **kwargs)
    model.eval()
    mark("load_peak")
    gc.collect()
    if args.trim:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    mark("post_load")

    new = 16
    prompt = args.ctx - new
    gen = torch.Generator().manual_seed(0)
    vocab = int(model.config.get_text_config().vocab_size)
    ids = torch.randint(3, vocab - 1, (args.batch, prompt), generator=gen)
    from transformers import LogitsProcessor, LogitsProcessorList

    state = {"n": 0}

    class Mark(LogitsProcessor):
        def __call__(self, input_ids, scores):
            state["n"] += 1
            if state["n"] == 1:
                mark("first_token")
            return scores

    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, logits_processor=LogitsProcessorList([Mark()]), pad_token_id=0,
                             return_dict_in_generate=True)
    mark("end")
    del out
    gc.collect()
    mark("after_gen_gc")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "stages": stages}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
