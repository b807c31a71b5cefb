"""The validation corpus: a matrix of real probes (synthetic weights), estimate beside measurement,
raw and leave-one-out calibrated, and the usual formulas on the same rows.

    python benchmarks/validate.py --device cpu --name cpu            # runs or resumes the CPU matrix
    python benchmarks/validate.py --device cuda:0 --name gpu-h200    # the same on a GPU
    python benchmarks/report.py                                      # docs/validation.md from the CSVs

Every probe is recorded in a records database (``--db``, default ``validation-<name>.db`` in the
working directory); a cell already recorded there with status ok is not run again, so an interrupted
matrix resumes. The CSV ``docs/validation/<name>.csv`` is rewritten from the database every time.

Architectures are real families at reduced widths (so the CPU matrix fits in 24 GiB and minutes),
each exercising one layout: dense GQA (Llama), tied embeddings (Qwen2), sliding window (Gemma 3,
window far below the longest context), mixture of experts (Mixtral), MLA (DeepSeek-V2).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import tempfile
import time

ARCHS = {
    "dense-gqa": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 16000,
                  "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4, "num_attention_heads": 8,
                  "num_key_value_heads": 2, "tie_word_embeddings": False, "max_position_embeddings": 8192,
                  "torch_dtype": "bfloat16"},
    "tied": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 24000, "hidden_size": 512,
             "intermediate_size": 1408, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
             "tie_word_embeddings": True, "max_position_embeddings": 8192, "torch_dtype": "bfloat16"},
    "sliding": {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "vocab_size": 16000,
                "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 6, "num_attention_heads": 8,
                "num_key_value_heads": 2, "head_dim": 64, "sliding_window": 256, "query_pre_attn_scalar": 64,
                "layer_types": ["sliding_attention"] * 5 + ["full_attention"], "max_position_embeddings": 8192,
                "torch_dtype": "bfloat16"},
    "moe": {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": 16000, "hidden_size": 512,
            "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
            "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 8192,
            "torch_dtype": "bfloat16"},
    "mla": {"model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 16000,
            "hidden_size": 512, "intermediate_size": 1408, "moe_intermediate_size": 256, "num_hidden_layers": 4,
            "num_attention_heads": 8, "num_key_value_heads": 8, "n_routed_experts": 8, "n_shared_experts": 1,
            "num_experts_per_tok": 2, "first_k_dense_replace": 1, "kv_lora_rank": 128, "q_lora_rank": None,
            "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64, "topk_method": "greedy",
            "n_group": 1, "topk_group": 1, "max_position_embeddings": 8192, "torch_dtype": "bfloat16"},
}
from vramcal.workload import STAGES  # noqa: E402
BYTES_PER_PARAM = {"bf16": 2, "fp16": 2, "fp32": 4, "int8": 1, "nf4": 0.5, "nf4-dq": 0.5, "fp4": 0.5, "fp4-dq": 0.5}
FIELDS = ["name", "device", "machine", "arch", "model", "quant", "ctx", "batch", "status", "error", "run_id", "stage",
          "estimated_bytes", "calibrated_bytes", "measured_bytes", "error_raw_pct", "error_calibrated_pct",
          "loo_runs", "loo_scope", "estimated_with", "peak_stage", "formula_total_bytes", "accelerate_bytes", "weights_estimated_bytes",
          "weights_measured_bytes", "kv_estimated_bytes", "kv_measured_bytes", "torch", "transformers",
          "bitsandbytes"]


def run_matrix(args) -> None:
    from vramcal.calibrate.runs import record_result
    from vramcal.probes.machine import machine_fingerprint
    from vramcal.probes.probe import run_probe
    from vramcal.records.store import Store

    fp = machine_fingerprint(args.device)
    with tempfile.TemporaryDirectory(prefix="vramcal-validate-") as tmp, Store(args.db) as store:
        mid = store.machine_id(fp)
        done = {(r["model"], r["quant"], r["ctx"], r["batch"]) for r in store.runs(machine_id=mid)
                if r["status"] == "ok" and r["device"] == args.device}
        started = time.monotonic()
        for arch in args.archs:
            d = os.path.join(tmp, arch)
            os.makedirs(d)
            with open(os.path.join(d, "config.json"), "w") as fh:
                json.dump(ARCHS[arch], fh)
            for quant in args.quants:
                for ctx in args.ctx:
                    for batch in args.batch:
                        key = (arch, quant, ctx, batch)
                        if key in done:
                            continue
                        if args.budget_s and time.monotonic() - started > args.budget_s:
                            print("time budget spent; run again to resume", file=sys.stderr)
                            return
                        t = time.monotonic()
                        from vramcal.estimator.resolve import resolve_model

                        source = resolve_model(d)
                        source = type(source)(name=arch, origin=source.origin, config=source.config,
                                              directory=source.directory, weight_files=())
                        r = run_probe(source, quant, ctx, batch, device=args.device, synthetic=True,
                                      command=f"benchmarks/validate.py {arch} {quant} ctx={ctx} batch={batch}")
                        record_result(store, fp, r, source.config_hash)
                        print(f"{arch:10s} {quant:7s} ctx={ctx:5d} b={batch}: {r.status} "
                              f"({time.monotonic() - t:.1f}s)", file=sys.stderr)


def write_csv(args) -> int:
    from vramcal.calibrate.corrections import fit_scoped
    from vramcal.estimator.correction import apply
    from vramcal.estimator.stages import model_id
    from vramcal.records.store import Store
    from vramcal.workload import device_kind

    rows_out = []
    with Store(args.db, create=False) as store:
        machines = {m["id"]: m for m in store.machines()}
        for mid, machine in machines.items():
            stage_rows = store.stage_rows(mid)
            runs = [r for r in store.runs(machine_id=mid) if r["status"] is not None and r["device"] == args.device]
            estimates = {r["id"]: _estimate_for(store, r, args.re_estimate, machine.get("gpu_name")) for r in runs}
            if args.re_estimate:  # the leave-one-out fits must see the same estimates as the rows
                stage_rows = [{**row, "estimated_bytes": (estimates[row["run_id"]].get("stages") or {}).get(
                    row["stage"], row["estimated_bytes"]), "estimator_model": model_id(device_kind(row["device"]))}
                    if row["run_id"] in estimates else row for row in stage_rows]
            for run in runs:
                full = store.run(run["id"])
                result = full.outcome.result
                est = estimates[run["id"]]
                # leave-one-out: this run's correction comes only from the machine's other runs, in the
                # most specific scope that has some (same model and quant, then same quant, then any)
                scope, loo = fit_scoped(stage_rows, "", run["quant"], run["config_hash"], exclude_run=run["id"])
                measured = {s: full.stages[s].measured_peak_bytes if s in full.stages else None for s in STAGES}
                peak_stage = max((s for s in STAGES if measured[s] is not None), key=lambda s: measured[s],
                                 default=None)
                st = result.get("stages", {})
                for s in STAGES:
                    e = (est.get("stages") or {}).get(s)
                    m = measured[s]
                    cal = None if e is None else apply({s: e}, run["ctx"] * run["batch"], loo)[s]
                    rows_out.append({
                        "name": args.name, "device": args.device,
                        "machine": machine.get("gpu_name") or machine.get("cpu_model"), "arch": run["model"],
                        "model": run["model"], "quant": run["quant"], "ctx": run["ctx"], "batch": run["batch"],
                        "status": run["status"], "error": run["error"], "run_id": run["id"], "stage": s,
                        "measured_bytes": m, **_estimate_columns(est, run["quant"], s, m, cal, scope, loo),
                        "estimated_with": "current code" if args.re_estimate else "recorded with the run",
                        "peak_stage": peak_stage,
                        "weights_measured_bytes": (st.get("load_peak") or {}).get("weights_bytes"),
                        "kv_measured_bytes": (st.get("end") or {}).get("kv_bytes"),
                        "torch": machine.get("torch"), "transformers": machine.get("transformers"),
                        "bitsandbytes": machine.get("bitsandbytes")})
    _write(args.out, rows_out)
    print(f"{len(rows_out)} rows -> {args.out}", file=sys.stderr)
    return len(rows_out)


def _estimate_columns(est: dict, quant: str, stage: str, measured: int | None, calibrated: int | None,
                      scope: str | None, loo: dict) -> dict:
    """The CSV columns that come from an estimate and its leave-one-out correction."""
    from vramcal.calibrate.corrections import scope_label

    e = (est.get("stages") or {}).get(stage)
    params = (est.get("formula") or {}).get("params")
    return {"estimated_bytes": e, "calibrated_bytes": calibrated, "error_raw_pct": _pct(e, measured),
            "error_calibrated_pct": _pct(calibrated, measured),
            "loo_runs": len({x for c in loo.values() for x in c.source_runs}),
            "loo_scope": scope_label(scope),
            "formula_total_bytes": (est.get("formula") or {}).get("total_bytes"),
            "accelerate_bytes": int(params * BYTES_PER_PARAM.get(quant, 2)) if params else None,
            "weights_estimated_bytes": (est.get("components") or {}).get("weights"),
            "kv_estimated_bytes": (est.get("components") or {}).get("kv_cache")}


def _write(path: str, rows: list[dict]) -> None:
    """The whole CSV or the old one, never half (an interrupted rewrite keeps the measurements)."""
    import io

    from vramcal.files import atomic_write

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, FIELDS)
    w.writeheader()
    w.writerows(rows)
    atomic_write(path, buf.getvalue(), "--out")


def _fail(message: str) -> None:
    """Bad input: one line, exit code 2, nothing written."""
    print(message, file=sys.stderr)
    raise SystemExit(2)


def re_estimate_csv(args) -> int:
    """``--from-csv``: the measurements of an existing CSV (its records database gone) against the current
    code's estimates, the leave-one-out corrections refitted by the same rule as :func:`write_csv`
    (scope by scope: same model and quant, same quant, any). Rewrites the CSV in place."""
    from vramcal.calibrate.corrections import fit_scoped
    from vramcal.estimator.correction import apply
    from vramcal.estimator.stages import model_id
    from vramcal.workload import device_kind

    try:
        with open(args.out, newline="") as fh:
            rows = list(csv.DictReader(fh))
        missing = {"run_id", "model", "quant", "ctx", "batch", "stage", "status", "measured_bytes"} - set(rows[0] if rows else ())
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        _fail(f"validate.py: cannot read {args.out} ({exc}); --from-csv re-estimates a CSV this script wrote")
    if not rows or missing:
        _fail(f"validate.py: {args.out} has no rows this script wrote (missing columns: "
              f"{', '.join(sorted(missing)) or 'none, but no rows'}); nothing rewritten")
    runs = {}
    for r in rows:
        runs.setdefault(int(r["run_id"]), r)
    estimates = {rid: _estimate_for(None, {"model": r["model"], "quant": r["quant"], "ctx": int(r["ctx"]),
                                           "batch": int(r["batch"]), "device": r["device"]}, True, r["machine"])
                 if r["status"] == "ok" else {} for rid, r in runs.items()}
    stage_rows = [{"run_id": int(r["run_id"]), "stage": r["stage"], "ctx": int(r["ctx"]), "batch": int(r["batch"]),
                   "status": r["status"], "quant": r["quant"], "config_hash": r["model"],
                   "measured_peak_bytes": int(r["measured_bytes"]) if r["measured_bytes"] else None,
                   "estimated_bytes": (estimates[int(r["run_id"])].get("stages") or {}).get(r["stage"]),
                   "device": r["device"], "estimator_model": model_id(device_kind(r["device"]))}
                  for r in rows]
    for r in rows:
        rid = int(r["run_id"])
        est = estimates[rid]
        e = (est.get("stages") or {}).get(r["stage"])
        m = int(r["measured_bytes"]) if r["measured_bytes"] else None
        scope, loo = fit_scoped(stage_rows, "", r["quant"], r["model"], exclude_run=rid)
        cal = None if e is None else apply({r["stage"]: e}, int(r["ctx"]) * int(r["batch"]), loo)[r["stage"]]
        r.update(_estimate_columns(est, r["quant"], r["stage"], m, cal, scope, loo), estimated_with="current code")
    _write(args.out, rows)
    print(f"{len(rows)} rows re-estimated -> {args.out}", file=sys.stderr)
    return len(rows)


def _estimate_for(store, run: dict, re_estimate: bool, gpu_name: str | None = None) -> dict:
    """The estimate recorded with the run, or (``--re-estimate``) the current code's estimate of the
    same configuration, priced for the GPU the run was on (``gpu_name``, the machine's; its context and
    kernels from vramcal's table): estimates are a function of the code, measurements are the data."""
    if not re_estimate:
        return store.run(run["id"]).context.estimate or {}
    from vramcal.errors import UserError
    from vramcal.estimator.estimate import estimate
    from vramcal.estimator.resolve import ModelSource
    from vramcal.probes.hardware import gpu_target
    from vramcal.workload import device_kind

    gpu = None
    if gpu_name and device_kind(run["device"]) != "cpu":
        try:
            gpu = gpu_target(gpu_name)
        except UserError:  # a GPU the table does not know: its defaults, as on that machine
            gpu = None
    source = ModelSource(name=run["model"], origin="config", config=ARCHS[run["model"]])
    return estimate(source, run["quant"], run["ctx"], run["batch"], device=run["device"], gpu=gpu).to_dict()


def _pct(est, measured):
    if est is None or not measured:
        return None
    return round(100.0 * (est - measured) / measured, 3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--name", default="cpu", help="names the CSV: docs/validation/<name>.csv")
    ap.add_argument("--db", help="records database (default ./validation-<name>.db)")
    ap.add_argument("--out", help="CSV path (default docs/validation/<name>.csv)")
    ap.add_argument("--archs", nargs="+", default=list(ARCHS), choices=list(ARCHS))
    ap.add_argument("--quants", nargs="+", default=["bf16", "int8", "nf4", "nf4-dq"])
    ap.add_argument("--ctx", nargs="+", type=int, default=[256, 1024, 4096])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--budget-s", type=float, default=0, help="stop starting probes after this long (resume later)")
    ap.add_argument("--csv-only", action="store_true", help="rewrite the CSV from the database, run nothing")
    ap.add_argument("--re-estimate", action="store_true",
                    help="compare the measurements with the current code's estimates, not the recorded ones")
    ap.add_argument("--from-csv", action="store_true",
                    help="no database: re-estimate the measurements already in the CSV with the current code")
    args = ap.parse_args(argv)
    args.db = args.db or f"validation-{args.name}.db"
    args.out = args.out or os.path.join("docs", "validation", f"{args.name}.csv")
    if args.from_csv:
        re_estimate_csv(args)
        return 0
    if not args.csv_only:
        try:
            run_matrix(args)
        except (KeyboardInterrupt, Exception):  # cut short (a session's timeout): the runs recorded so far
            if os.path.exists(args.db):        # still become rows, then it ends as it would have
                try:
                    write_csv(args)
                except Exception as exc:  # the interrupt is what the caller must see, not this
                    print(f"validate.py: the CSV was not rewritten ({type(exc).__name__}: {exc})", file=sys.stderr)
            raise
    write_csv(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
