"""The ``vramcal`` command. ``main() -> int``; every subcommand formats what a library call returns."""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import UserError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, like every other bad input
        raise UserError(f"{message} (see `{self.prog} --help`)")


def _add_estimate(sub) -> None:
    p = sub.add_parser("estimate", help="predict peak memory per stage from a model's config alone",
                       description="Predict device memory per stage (load, after load, first token, end) "
                                   "as the installed transformers + quantizer will lay the model out. "
                                   "Without MODEL, --params-b and --bits give the source documents' formula.")
    p.add_argument("model", nargs="?", help="directory with config.json, a config.json, a Hub id in the local cache, "
                                            "or a catalog name (`vramcal models`)")
    p.add_argument("--quant", default="auto", help="auto | bf16 | fp16 | fp32 | int8 | nf4 | nf4-dq | fp4 | fp4-dq")
    p.add_argument("--dtype", default=None, help="dtype of the tensors that stay unquantized (default: the config's)")
    p.add_argument("--ctx", type=int, default=4096, help="prompt + 16 generated tokens (default 4096)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--kv-dtype", default="auto", help="auto (model dtype) | fp8 (transformers' QuantizedCache)")
    p.add_argument("--attn", default="auto", help="auto | sdpa | eager | flash_attention_2")
    p.add_argument("--cache", default="dynamic", help="dynamic | static (pre-allocated to --ctx)")
    p.add_argument("--device", default="cuda", help="cuda (NVML view, the default) or cpu (process memory)")
    p.add_argument("--fast", action="store_true", help="use the fitted activation model instead of tracing this point")
    p.add_argument("--no-disk-cache", action="store_true", help="recompute the inventory instead of reading the cache")
    p.add_argument("--json", action="store_true", help="one JSON object, integer bytes")
    p.add_argument("--db", help="records database (default $VRAMCAL_DB or ~/.local/share/vramcal/vramcal.db)")
    p.add_argument("--no-correction", action="store_true",
                   help="do not apply this machine's correction from the records database")
    q = p.add_argument_group("quick mode (no config needed)")
    q.add_argument("--params-b", type=float, help="parameters, in billions")
    q.add_argument("--bits", type=float, help="bits per parameter")
    q.add_argument("--layers", type=int)
    q.add_argument("--kv-heads", type=int)
    q.add_argument("--head-dim", type=int)
    q.add_argument("--kv-bytes", type=int, default=2, help="bytes per cached value (2 = bf16/fp16)")
    p.set_defaults(func=cmd_estimate)


def cmd_estimate(args) -> int:
    from . import present

    quick = args.params_b is not None or args.bits is not None
    if args.model is None and not quick:
        raise UserError("give a MODEL (directory, config.json, cached Hub id or catalog name) "
                        "or quick-mode figures: --params-b 27 --bits 4 [--layers --kv-heads --head-dim]")
    if quick:
        from ..estimator.quick import quick_estimate

        q = quick_estimate(args.params_b, args.bits, args.ctx, args.batch, args.layers, args.kv_heads,
                           args.head_dim, args.kv_bytes)
        if args.model is None:
            print(json.dumps({"quick": q.to_dict()}) if args.json else present.quick_table(q))
            return 0
    from ..estimator.estimate import estimate

    e = estimate(args.model, args.quant, args.ctx, args.batch, dtype=args.dtype, kv_dtype=args.kv_dtype,
                 attn=args.attn, cache=args.cache, device=args.device, use_cache=not args.no_disk_cache,
                 exact=not args.fast)
    out = e.to_dict()
    if not args.no_correction:
        out = _apply_machine_correction(out, args.device, args.db)
    if args.json:
        if quick:
            out["quick"] = q.to_dict()
        print(json.dumps(out))
    else:
        print(present.estimate_table(e))
        if out.get("correction"):
            print()
            print(present.correction_table(out))
        if quick:
            print()
            print(present.quick_table(q))
    return 0


def _apply_machine_correction(est: dict, device: str, db: str | None) -> dict:
    """The matching correction of this machine, if the database has one (docs/calibration.md)."""
    from ..records.store import Store, default_path

    path = db or default_path()
    import os

    if not os.path.exists(path):
        est["correction"] = None
        return est
    from ..probes.machine import machine_fingerprint, stack_key
    from .check import corrected, lookup

    fp = machine_fingerprint("cpu" if device == "cpu" else (device if ":" in device else "cuda:0"))
    with Store(path, create=False, readonly=True) as store:
        corr = lookup(store, store.find_machine(fp), stack_key(fp), est["quant"], est.get("config_hash"))
    if not corr:
        est["correction"] = None
        return est
    return corrected(est, corr)


def cmd_check(args) -> int:
    from . import present
    from .check import check

    budget = None if args.budget in (None, "auto") else _size(args.budget, "--budget")
    r = check(args.model, args.quant, args.ctx, args.batch, device=args.device, db=args.db, budget=budget,
              buffer=_size(args.buffer, "--buffer"), prefer=args.prefer, synthetic=args.synthetic, attn=args.attn,
              dtype=args.dtype, command=_argv_command())
    print(json.dumps(r.to_dict()) if args.json else present.check_table(r))
    return 0 if r.verdict.fits else 1


def _size(text: str, flag: str) -> int:
    from ..units import parse_size

    try:
        n = parse_size(text)
    except ValueError as exc:
        raise UserError(f"{flag}: {exc}") from None
    if n < 0:
        raise UserError(f"{flag} must not be negative")
    return n


def cmd_memo(args) -> int:
    from ..records.store import Store
    from .check import memo_markdown, recheck

    with Store(args.db, create=False, readonly=True) as store:
        memos = store.memos()
    if not memos:
        raise UserError("no memo recorded yet: run `vramcal check MODEL ...` once; a run that fits leaves one")
    if args.run is not None:
        chosen = [m for m in memos if m["run_id"] == args.run]
        if not chosen:
            raise UserError(f"no memo for run {args.run}: `vramcal records list` shows the runs")
        memo = chosen[-1]["memo"]
    else:
        memo = memos[-1]["memo"]
    if args.recheck:
        out = recheck(memo, args.db)
        if args.json:
            print(json.dumps(out))
        else:
            print(f"run {out['memo_run']} rechecked as run {out['recheck_run']}: "
                  + ("CONSISTENT" if out["consistent"] else "CHANGED")
                  + f"  old peak {out['old_peak_bytes']} B, new {out['new_peak_bytes']} B, "
                  f"tolerance {out['tolerance_bytes']} B")
        return 0 if out["consistent"] else 1
    print(json.dumps(memo) if args.json else memo_markdown(memo), end="" if not args.json else "\n")
    return 0


def cmd_fit(args) -> int:
    from . import present
    from .check import DEFAULT_BUFFER, budget_for, fit_contexts

    if args.budget == "auto":
        from ..probes.machine import machine_fingerprint

        budget = budget_for(args.device, machine_fingerprint(args.device), None)
    else:
        budget = _size(args.budget, "--budget")
    buffer = DEFAULT_BUFFER if args.buffer is None else _size(args.buffer, "--buffer")
    rows = fit_contexts(args.model, budget, device=args.device, db=args.db, buffer=buffer)
    print(json.dumps({"budget_bytes": budget, "buffer_bytes": buffer, "rows": rows}) if args.json
          else present.fit_table(args.model, budget, buffer, rows))
    return 0


def cmd_records(args) -> int:
    from ..records.export import export
    from ..records.store import Store
    from . import present

    with Store(args.db, create=False, readonly=True) as store:
        if args.action == "list":
            runs = store.runs()
            print(json.dumps(runs, default=str) if args.json else present.runs_table(runs))
        elif args.action == "show":
            if args.id is None:
                raise UserError("records show needs a run id: `vramcal records show 3`")
            run = store.run(args.id)
            if run is None:
                raise UserError(f"no run {args.id}: `vramcal records list` shows the runs")
            print(json.dumps(run, default=str, indent=1))
        else:
            text = export(store, args.format, args.out)
            if text is not None:
                print(text, end="")
    return 0


def cmd_models(args) -> int:
    from ..estimator.catalog import catalog_rows
    from . import present

    rows = catalog_rows()
    print(json.dumps(rows) if args.json else present.models_table(rows))
    return 0


def _add_probe(sub) -> None:
    p = sub.add_parser("probe", help="load the real model, generate 16 tokens, measure memory at every stage",
                       description="Load MODEL through from_pretrained in a child process, generate 16 tokens "
                                   "from a prompt of ctx-16 tokens per batch row, and sample device memory "
                                   "(NVML memory.used, or the process's resident set with --device cpu) "
                                   "every few milliseconds. Exit code 0 when the run finished, 1 when it "
                                   "ran out of memory or died, 2 for bad input.")
    p.add_argument("model")
    p.add_argument("--quant", default="auto", help="auto | bf16 | fp16 | fp32 | int8 | nf4 | nf4-dq | fp4 | fp4-dq")
    p.add_argument("--dtype", default=None)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--attn", default="auto")
    p.add_argument("--device", default="cuda:0", help="cuda, cuda:N or cpu")
    p.add_argument("--synthetic", action="store_true",
                   help="random weights at the config's real widths, saved and loaded like a checkpoint")
    p.add_argument("--interval-ms", type=float, default=5.0, help="sampling interval (default 5 ms)")
    p.add_argument("--timeline", metavar="FILE.png", help="write a plot of memory over time")
    p.add_argument("--samples", action="store_true", help="include every sample in --json (default: the count)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_probe)


def cmd_probe(args) -> int:
    from ..probes.probe import run_probe
    from . import present

    if args.timeline and not args.timeline.lower().endswith(".png"):
        raise UserError(f"--timeline writes a PNG: give a file name ending in .png, not {args.timeline!r}")
    r = run_probe(args.model, args.quant, args.ctx, args.batch, device=args.device, synthetic=args.synthetic,
                  interval_ms=args.interval_ms, dtype=args.dtype, attn=args.attn,
                  command=_argv_command())
    if args.timeline:
        from ..probes.timeline import write_timeline

        write_timeline(r, args.timeline)
    if args.json:
        out = r.to_dict()
        if not args.samples:
            out.pop("samples")
        print(json.dumps(out))
    else:
        print(present.probe_table(r))
    return 0 if r.status == "ok" else 1


def _argv_command() -> str:
    import shlex

    return shlex.join(["vramcal"] + [a for a in sys.argv[1:] if a != "--debug"])


def _add_calibration(sub) -> None:
    from .policies import POLICIES

    c = sub.add_parser("check", help="estimate, probe, record, verdict: does it fit, and if not what to change",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="The one-shot job: estimate -> probe (load + 16 tokens) -> reconcile -> record "
                                   "-> verdict. Fits when the measured peak plus --buffer stays within the budget "
                                   "(the device's total memory, or --budget). When it does not, proposes next "
                                   "configurations with this machine's corrected estimates, in the order of "
                                   "--prefer:\n\n"
                                   "  quality     keep the weights' precision: smaller batch, then shorter context, "
                                   "then an fp8 KV cache;\n              lower the weight quantization only when "
                                   "the weights alone are over the budget\n"
                                   "  context     keep the context: lower quantization, then fp8 KV, then batch, "
                                   "the context last\n"
                                   "  throughput  keep the batch: lower quantization, then context, the batch last\n"
                                   "\nExit code 0 when it fits, 1 when it does not, 2 for bad input.")
    c.add_argument("model")
    c.add_argument("--quant", default="auto")
    c.add_argument("--dtype", default=None)
    c.add_argument("--ctx", type=int, default=4096)
    c.add_argument("--batch", type=int, default=1)
    c.add_argument("--attn", default="auto")
    c.add_argument("--device", default="cuda:0")
    c.add_argument("--synthetic", action="store_true")
    c.add_argument("--budget", default=None, help="memory to fit in (24GiB, 80GB, auto = the device's total)")
    c.add_argument("--buffer", default="2GiB", help="headroom to keep free (default 2GiB, as the documents advise)")
    c.add_argument("--prefer", default="quality", choices=POLICIES, help="order of adjustments (see above)")
    c.add_argument("--db")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_check)

    m = sub.add_parser("memo", help="the known-good memo of the last run that fit (Markdown or JSON)")
    m.add_argument("--run", type=int, help="the memo of this run id (default: the latest)")
    m.add_argument("--recheck", action="store_true", help="re-run the memo's command and compare the peak")
    m.add_argument("--db")
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=cmd_memo)

    f = sub.add_parser("fit", help="the largest context per quant and batch that fits a budget")
    f.add_argument("model")
    f.add_argument("--budget", required=True, help="24GiB, 80GB, or auto (the device's total memory)")
    f.add_argument("--buffer", default=None, help="headroom to keep free (default 2GiB)")
    f.add_argument("--device", default="cuda:0")
    f.add_argument("--db")
    f.add_argument("--json", action="store_true")
    f.set_defaults(func=cmd_fit)

    r = sub.add_parser("records", help="list, show or export the recorded runs")
    r.add_argument("action", choices=("list", "show", "export"))
    r.add_argument("id", nargs="?", type=int)
    r.add_argument("--format", default="csv", help="csv | json | parquet (export)")
    r.add_argument("--out", help="file to write (export)")
    r.add_argument("--db")
    r.add_argument("--json", action="store_true")
    r.set_defaults(func=cmd_records)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="vramcal", description="Predict, measure and calibrate GPU memory for quantized LLMs.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    _add_estimate(sub)
    _add_probe(sub)
    _add_calibration(sub)
    m = sub.add_parser("models", help="list the built-in catalog of model configs")
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=cmd_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        return args.func(args)
    except UserError as exc:
        if debug:
            raise
        print(f"vramcal: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("vramcal: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
