"""Sanity-check every row of corpus.csv by arithmetic, independently of vramcal's estimator.

For each row it computes, from the row's config alone:

- weights: parameter count of the architecture (built on the meta device, no download), stored the way the
  row's quantization stores it (bitsandbytes / GPTQ / AWQ / FP8 layouts, lm_head and embeddings kept in the
  compute dtype);
- kv: the KV cache at prompt + new tokens;
- one_layer: one decoder layer's MLP intermediates during the prefill (batch x prompt x intermediate, twice for
  gated MLPs) -- the smallest activation a prefill must hold at once;
- floor = weights + kv + one_layer.

A peak-memory figure below the floor cannot contain the prefill; a footprint/weights figure is compared with
the weights alone. The verdict is printed and, with ``--write``, stored in the row's notes as ``[check] ...``
(replacing an earlier one), so the corpus records what each figure can contain.

    PYTHONPATH=$PWD python benchmarks/published/check_rows.py [--write]
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from functools import lru_cache
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
CATALOG = ROOT / "vramcal" / "estimator" / "catalog"
CORPUS = HERE / "corpus.csv"
GiB = 2**30
EL = {"bfloat16": 2, "float16": 2, "float32": 4}
CHECK_RE = re.compile(r"\s*\[check\][^\[]*$")


def config_path(model: str) -> Path:
    for p in (HERE / "configs" / f"{model}.json", CATALOG / f"{model}.json"):
        if p.is_file():
            return p
    raise SystemExit(f"no config for model {model!r}: add benchmarks/published/configs/{model}.json")


@lru_cache(maxsize=None)
def param_split(model: str) -> tuple[int, int, int, dict]:
    """(total params, params in quantizable Linear layers, their output rows, text config)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads(config_path(model).read_text())
    cfg.pop("_vramcal_catalog", None)
    cfg.pop("quantization_config", None)
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in m.parameters())
    lin = rows = 0
    out_emb = m.get_output_embeddings()
    for name, mod in m.named_modules():
        if isinstance(mod, torch.nn.Linear) and mod is not out_emb:
            lin += mod.weight.numel()
            rows += mod.out_features
    return total, lin, rows, cfg


def weight_bytes(model: str, quant: str, dtype: str) -> int:
    total, lin, rows, _ = param_split(model)
    other = total - lin
    el = EL.get(dtype, 2)
    if quant in ("bf16", "fp16", "fp32"):
        return total * {"bf16": 2, "fp16": 2, "fp32": 4}[quant]
    if quant == "int8":  # int8 data + one float32 scale per output row
        return lin + 4 * rows + other * el
    if quant in ("nf4", "fp4"):  # packed codes + float32 absmax per 64
        return lin // 2 + lin // 64 * 4 + other * el
    if quant in ("nf4-dq", "fp4-dq"):  # uint8 absmax per 64 + float32 per 256 blocks
        return lin // 2 + lin // 64 + lin // 64 // 256 * 4 + other * el
    if quant in ("gptq-int4", "awq-int4"):  # qweight + scales fp16 per 128 + qzeros int4 per 128 (+ g_idx ~ small)
        return lin // 2 + lin // 128 * 2 + lin // 256 + other * 2
    if quant == "fp8":  # 1 byte + float32 scale per 128x128 block
        return lin + lin // 16384 * 4 + other * el
    raise SystemExit(f"check_rows: unknown quant {quant!r}")


def kv_and_act(model: str, dtype: str, prompt: int, new: int, batch: int) -> tuple[int, int]:
    _, _, _, c = param_split(model)
    el = EL.get(dtype, 2)
    if c.get("n_embd") or c.get("n_layer"):  # gpt_bigcode / bloom naming
        hidden = c.get("n_embd") or c["hidden_size"]
        heads = c.get("n_head")
        layers = c["n_layer"]
        kv_heads = 1 if c.get("multi_query") else heads
        head_dim = hidden // heads
        inter, gated = (c.get("n_inner") or 4 * hidden), 1
    else:
        hidden = c["hidden_size"]
        heads = c["num_attention_heads"]
        layers = c["num_hidden_layers"]
        kv_heads = c.get("num_key_value_heads") or heads
        head_dim = c.get("head_dim") or hidden // heads
        inter = c.get("moe_intermediate_size") if c.get("num_experts") else c["intermediate_size"]
        gated = 2
    kv = 2 * layers * kv_heads * head_dim * (prompt + new) * batch * el
    act = batch * prompt * inter * gated * el
    return kv, act


def check(row: dict) -> str:
    w = weight_bytes(row["model"], row["quant"], row["dtype"])
    fig = int(row["figure_bytes"])
    if row["counter"] in ("memory_footprint", "weights_only"):
        return (f"[check] weights by arithmetic {w / GiB:.3f} GiB; figure/weights = {fig / w:.3f} "
                "(a weights figure: compare with weights only)")
    prompt, new, batch = int(row["prompt_tokens"]), int(row["new_tokens"]), int(row["batch"])
    kv, act = kv_and_act(row["model"], row["dtype"], prompt, new, batch)
    floor = w + kv + act
    head = (f"[check] weights {w / GiB:.3f} + kv {kv / GiB:.3f} + one-layer prefill {act / GiB:.3f} "
            f"= floor {floor / GiB:.3f} GiB; figure {fig / GiB:.3f} GiB = floor x {fig / floor:.3f}")
    if fig < w:
        return head + " -> BELOW THE WEIGHTS: the figure cannot hold the whole model (check the unit / offload)"
    if fig < floor:
        return head + (f" -> below the floor: cannot contain the prefill; figure - (weights + kv) = "
                       f"{(fig - w - kv) / GiB:+.3f} GiB, so compare it with weights + cache, not with a prefill peak")
    return head + " -> can contain the prefill"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="store each verdict in the row's notes")
    args = ap.parse_args(argv)
    with CORPUS.open(newline="") as fh:
        reader = csv.DictReader(fh)
        fields = reader.fieldnames
        rows = list(reader)
    below = 0
    for row in rows:
        verdict = check(row)
        below += "below" in verdict.lower()
        print(f"{row['id']:14s} {row['model']:22s} {row['quant']:9s} {verdict}")
        if args.write:
            row["notes"] = CHECK_RE.sub("", row["notes"]).rstrip("; ") + "; " + verdict
    print(f"{len(rows)} rows, {below} below the floor or the weights", file=sys.stderr)
    if args.write:
        with CORPUS.open("w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=fields)
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
