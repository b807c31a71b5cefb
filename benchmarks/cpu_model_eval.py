"""Compare CPU probe results with the current estimate and with benchmarks/cpu_runtime_model.py.

    python benchmarks/cpu_model_eval.py PROBE.json ...   (files written by `vramcal probe ... --device cpu --json`)

Prints one row per probe and stage: measured peak above the baseline, the estimate the probe carried,
the CPU model's typical prediction and its [lower, upper] range, in MiB, with errors against the
measurement. The dry-run quantities come from the estimate the probe carried (its ``allocated`` view).
"""

from __future__ import annotations

import json
import statistics
import sys

from cpu_runtime_model import CpuInputs, cpu_resident_stages, decoder_linear_elements, loaded_tensor_bytes
from vramcal.estimator.inventory import inventory
from vramcal.estimator.quant import DTYPE_BYTES, resolve_quant
from vramcal.estimator.resolve import resolve_model, text_config

STAGES = ("load_peak", "post_load", "first_token", "end")


def predict(d: dict):
    src = resolve_model(d["model"])
    tc = text_config(src.config)
    q = resolve_quant(d["quant"], src.config, None)
    inv = inventory(src, q)
    inv_plain = inventory(src, resolve_quant(q.dtype.replace("bfloat16", "bf16").replace("float16", "fp16"),
                                             src.config, None))
    e = d["estimate"]["allocated"]
    w = e["post_load"]
    ctx, batch = d["ctx"], d["batch"]
    prompt = ctx - 16
    kv_end = d["estimate"]["components"]["kv_cache"]
    kv_prompt = kv_end * prompt // (ctx - 1)
    elems = decoder_linear_elements(tc) if q.method in ("bnb4", "bnb8") else ()
    h, inter = int(tc["hidden_size"]), int(tc["intermediate_size"])
    heads = int(tc["num_attention_heads"]); kvh = int(tc.get("num_key_value_heads") or heads)
    hd = int(tc.get("head_dim") or h // heads)
    outs = (heads * hd, kvh * hd, kvh * hd, h, inter, inter, h) * int(tc["num_hidden_layers"]) if elems else ()
    inp = CpuInputs(method=q.method, checkpoint_bytes=inv_plain.tensor_bytes,
                    checkpoint_elem_bytes=DTYPE_BYTES[q.dtype], load_elem_bytes=DTYPE_BYTES[q.dtype],
                    loaded_tensor_bytes=loaded_tensor_bytes(q.method, inv.groups, inv.tensor_bytes, False),
                    quantized_elements=elems)
    return cpu_resident_stages(inp, kv_prompt=kv_prompt, kv_end=kv_end,
                               prefill_extra=e["first_token"] - w - kv_prompt, decode_extra=e["end"] - w - kv_end,
                               prompt_tokens=prompt, batch=batch, out_features=outs)


def main(paths: list[str]) -> int:
    M = 2**20
    errs_cur, errs_new, inside = [], [], 0
    print("| model | quant | ctx | batch | stage | measured MiB | estimate now | err | CPU model | err | range |")
    print("| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for p in paths:
        d = json.load(open(p))
        if d["status"] != "ok":
            continue
        pred = predict(d)
        base = d["stages"]["baseline"]["used_bytes"]
        for s in STAGES:
            meas = d["stages"][s]["peak_bytes"] - base
            cur = d["estimate"]["stages"][s]
            new = pred.stages[s]
            ec, en = (cur - meas) / meas, (new - meas) / meas
            errs_cur.append(abs(ec)); errs_new.append(abs(en))
            ok = pred.lower[s] * 0.9 <= meas <= pred.upper[s] * 1.1
            inside += ok
            print(f"| {d['model']} | {d['quant']} | {d['ctx']} | {d['batch']} | {s} | {meas / M:.0f} | {cur / M:.0f} | "
                  f"{ec:+.0%} | {new / M:.0f} | {en:+.0%} | {pred.lower[s] / M:.0f}-{pred.upper[s] / M:.0f}{'' if ok else ' (outside)'} |")
    if errs_new:
        print(f"\nrows {len(errs_new)}: median |error| estimate now {statistics.median(errs_cur):.1%}, "
              f"CPU model {statistics.median(errs_new):.1%}; measured inside [lower-10 %, upper+10 %]: {inside}/{len(errs_new)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
