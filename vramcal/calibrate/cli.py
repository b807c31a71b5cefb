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
    if args.json:
        out = e.to_dict()
        if quick:
            out["quick"] = q.to_dict()
        print(json.dumps(out))
    else:
        print(present.estimate_table(e))
        if quick:
            print()
            print(present.quick_table(q))
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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="vramcal", description="Predict, measure and calibrate GPU memory for quantized LLMs.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    _add_estimate(sub)
    _add_probe(sub)
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
