"""GPU validation: a matrix of synthetic-weight probes, estimated vs measured per stage, to a CSV.

    python benchmarks/gpu_validate.py --device cuda:0 --out docs/validation/gpu-h200.csv \
        --summary docs/validation/gpu-h200.md

Models are catalog names or directories with a config.json; ``--layers N`` cuts each model to N
layers (widths stay real, so per-layer tensors, KV per token and activations are the real ones and
the run fits in minutes). Each model's random-weight checkpoint is written once and probed for every
quantization, context and batch. Runs on ``--device cpu`` too (the tests do, on a tiny model).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

DEFAULT_MODELS = ["llama-3.2-1b", "qwen2.5-0.5b", "llama-3.1-8b", "phi-3-mini-4k", "gemma-3-12b",
                  "qwen3-30b-a3b", "deepseek-v2-lite"]
STAGES = ("load_peak", "post_load", "first_token", "end")
FIELDS = ["when", "device", "gpu", "model", "architecture", "layers", "quant", "ctx", "batch", "attn", "status",
          "stage", "estimated_bytes", "measured_peak_bytes", "measured_used_bytes", "torch_max_allocated",
          "torch_max_reserved", "estimated_allocated_bytes", "error_bytes", "error_pct", "approximate",
          "torch", "transformers", "bitsandbytes", "command"]


def _config_for(model: str, layers: int | None) -> dict:
    from vramcal.estimator.resolve import resolve_model

    cfg = dict(resolve_model(model).config)
    if layers:
        # a vision-language config holds its language model's depth in text_config (the vision tower
        # keeps its own depth)
        text = cfg
        if isinstance(cfg.get("text_config"), dict):
            text = cfg["text_config"] = dict(cfg["text_config"])
        n = int(text.get("num_hidden_layers", layers))
        text["num_hidden_layers"] = min(n, layers)
        if isinstance(text.get("layer_types"), list):
            text["layer_types"] = text["layer_types"][: text["num_hidden_layers"]]
        for key in ("max_window_layers",):
            if key in text:
                text[key] = min(text[key], text["num_hidden_layers"])
    return cfg


def _write(cfg: dict, out_dir: str) -> None:
    path = out_dir + ".config.json"
    with open(path, "w") as fh:
        json.dump(cfg, fh)
    r = subprocess.run([sys.executable, "-m", "vramcal.probes.synthetic", path, out_dir], capture_output=True,
                       text=True)
    if r.returncode:
        raise RuntimeError(r.stderr.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--models", nargs="+", default=DEFAULT_MODELS)
    ap.add_argument("--layers", type=int, default=4, help="cut each model to this many layers (0: keep all)")
    ap.add_argument("--quants", nargs="+", default=["bf16", "int8", "nf4", "nf4-dq"])
    ap.add_argument("--ctx", nargs="+", type=int, default=[1024, 8192, 32768])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--out", required=True)
    ap.add_argument("--summary")
    ap.add_argument("--budget-s", type=float, default=0, help="stop starting new probes after this many seconds")
    args = ap.parse_args(argv)

    from vramcal.versions import software_versions
    from vramcal.estimator.resolve import resolve_model
    from vramcal.probes import nvml
    from vramcal.probes.probe import run_probe

    versions = software_versions()
    gpu = "cpu"
    if args.device.startswith("cuda"):
        from vramcal.workload import parse_device

        info = nvml.device_info(parse_device(args.device).index or 0)
        gpu = f"{info['name']} {info['total_bytes']}"
    started = time.monotonic()
    rows: list[dict] = []
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vramcal-validate-") as tmp, open(args.out, "w", newline="") as fh:
        writer = csv.DictWriter(fh, FIELDS)
        writer.writeheader()
        def left() -> float:
            return args.budget_s - (time.monotonic() - started) if args.budget_s else math.inf

        for model in args.models:
            if left() <= 0:
                break  # before writing the next checkpoint: at real widths that alone takes a minute
            cfg = _config_for(model, args.layers or None)
            ckpt = os.path.join(tmp, os.path.basename(model.rstrip("/")))
            try:
                _write(cfg, ckpt)
            except RuntimeError as exc:
                print(f"skip {model}: {exc}", file=sys.stderr)
                continue
            source = resolve_model(ckpt)
            for quant in args.quants:
                for ctx in args.ctx:
                    for batch in args.batch:
                        rem = left()
                        if rem <= 0:
                            break
                        t = time.monotonic()
                        r = run_probe(source, quant, ctx, batch, device=args.device, keep_samples=False,
                                      timeout_s=None if rem == math.inf else max(60.0, rem),
                                      command=f"gpu_validate {model} layers={args.layers} {quant} {ctx} {batch}")
                        est = r.estimate
                        measured = r.measured()  # the readings' one baseline rule (CPU: minus the baseline)
                        for stage in STAGES:
                            st = r.stages.get(stage)
                            e = est.stages.get(stage) if est else None
                            m = measured.get(stage)
                            peak = m.peak_bytes if m else None
                            used = m.used_bytes if m else None
                            err = None if (e is None or peak is None) else peak - e
                            row = {"when": time.strftime("%Y-%m-%dT%H:%M:%S"), "device": args.device, "gpu": gpu,
                                   "model": model, "architecture": est.architecture if est else None,
                                   "layers": cfg.get("num_hidden_layers"), "quant": quant, "ctx": ctx, "batch": batch,
                                   "attn": est.attn if est else None, "status": r.status, "stage": stage,
                                   "estimated_bytes": e, "measured_peak_bytes": peak, "measured_used_bytes": used,
                                   "torch_max_allocated": st.torch_max_allocated if st else None,
                                   "torch_max_reserved": st.torch_max_reserved if st else None,
                                   "estimated_allocated_bytes": est.allocated.get(stage) if est else None,
                                   "error_bytes": err,
                                   "error_pct": None if err is None or not peak else round(100 * err / peak, 3),
                                   "approximate": est.approximate if est else None, **{k: versions.get(k) for k in
                                                                            ("torch", "transformers", "bitsandbytes")},
                                   "command": r.command}
                            writer.writerow(row)
                            rows.append(row)
                        fh.flush()
                        print(f"{model} {quant} ctx={ctx} b={batch}: {r.status} in {time.monotonic() - t:.1f}s",
                              file=sys.stderr)
    if args.summary:
        with open(args.summary, "w") as fh:
            fh.write(summary(rows, gpu, platform.node(), versions))
    return 0


def summary(rows: list[dict], gpu: str, host: str, versions: dict) -> str:
    lines = [f"# Validation on {gpu}", "", f"host {host}; " + ", ".join(f"{k} {v}" for k, v in versions.items()),
             "", "| stage | rows | median abs error | p95 abs error | worst |", "| --- | ---: | ---: | ---: | ---: |"]
    for stage in STAGES:
        errs = sorted(abs(r["error_pct"]) for r in rows if r["stage"] == stage and r["error_pct"] is not None)
        if not errs:
            continue
        p95 = errs[min(len(errs) - 1, int(round(0.95 * (len(errs) - 1))))]
        lines.append(f"| {stage} | {len(errs)} | {statistics.median(errs):.2f} % | {p95:.2f} % | {errs[-1]:.2f} % |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
