"""The ``vramcal`` command. ``main() -> int``: parse, call the library, format with :mod:`vramcal.present`.

Exit codes: 0 done (and fits, for ``check``); 1 the run did not fit or did not finish; 2 bad input or
an environment that cannot serve the command (one line on stderr, nothing written); 130 Ctrl-C and
143 SIGTERM (the run is recorded with its last stage first); 70 a bug in vramcal (one line; ``--debug``
shows the traceback).

Start-up stays light: this module imports only the workload rules and the size parser; each command imports
what it needs.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from .errors import UserError, printable
from .estimator.capacity import FROM_FREE
from .units import size_option
from .workload import (ATTNS, CACHES, KV_DTYPES, NEW_TOKENS, POLICIES, QUANTS, Configuration, device_kind, parse_dtype,
                       workload)

EX_SOFTWARE = 70
MAX_MESSAGE = 600  # characters: a one-line error a person reads, whatever a library put in it


def one_line(text: str) -> str:
    """A message on one line, cut to :data:`MAX_MESSAGE` characters."""
    text = " ".join(text.split())
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE - 1] + "…"


class _Parser(argparse.ArgumentParser):
    """No abbreviated flags: ``plan --gpu-memory 0.5`` would be taken for ``--gpu-memory-utilization 0.5``."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # one line, exit 2, like every other bad input
        raise UserError(f"{message} (see `{self.prog} --help`)")


def _add_model_args(p, *, ctx_help: str) -> None:
    p.add_argument("--quant", default="auto", help=" | ".join(QUANTS))
    p.add_argument("--dtype", default=None, help="bf16 | fp16 | fp32: the tensors that stay unquantized "
                                                 "(default: the config's)")
    w = p.add_argument_group("workload")
    w.add_argument("--ctx", type=int, default=None, help=ctx_help)
    w.add_argument("--prompt", type=int, default=None, help="prompt tokens, instead of --ctx (ctx = prompt + new tokens)")
    w.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help=f"tokens generated (default {NEW_TOKENS})")
    w.add_argument("--batch", type=int, default=1)
    _add_image_args(w)
    p.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES, help="auto (model dtype) | fp8 "
                                                                        "(transformers' QuantizedCache)")
    p.add_argument("--attn", default="auto", choices=ATTNS)
    p.add_argument("--cache", default="dynamic", choices=CACHES, help="dynamic | static (pre-allocated to --ctx)")
    _add_gpu_arg(p)
    _add_placement_args(p)


def _add_gpu_arg(p) -> None:
    p.add_argument("--gpu", default=None, metavar="NAME",
                   help="the GPU it is for, e.g. \"RTX 3090\", H200 (default: this machine's, through NVML): a "
                        "pre-quantized checkpoint is priced on the path that GPU takes (fp8 kept from compute "
                        "capability 8.9, dequantized to bf16 below)")


def _gpu(args):
    """``--gpu NAME`` as the estimator's target; else this machine's GPU of ``--device``; else None."""
    from .probes.hardware import device_gpu_target, gpu_target

    if getattr(args, "gpu", None) is not None:
        return gpu_target(args.gpu)
    return device_gpu_target(getattr(args, "device", ""))


def _probe_gpu(args):
    """probe / check: the GPU the estimate prices must be the one the load runs on, since the real load
    follows the real GPU (fp8 kept or dequantized, MXFP4 kept or not) and a run compared with another GPU's
    path would teach this machine's corrections a difference that is not there. ``--gpu`` is taken where
    NVML cannot read this machine's GPU; where it can and the compute capability differs: one line, exit 2."""
    from .probes.hardware import device_gpu_target

    named = _gpu(args)
    if getattr(args, "gpu", None) is None:
        return named
    device = str(getattr(args, "device", "") or "cuda")
    if device_kind(device) == "cpu":
        raise UserError(f"--gpu {args.gpu!r} prices a GPU's path, but --device {device} loads on the CPU: drop "
                        "--gpu (or price that GPU with `vramcal estimate --gpu`)")
    real = device_gpu_target(device)
    if real is not None and real.compute_capability != named.compute_capability:
        cc = ".".join(map(str, real.compute_capability))
        want = ".".join(map(str, named.compute_capability)) if named.compute_capability else "unknown"
        raise UserError(f"--gpu {args.gpu!r} (compute capability {want}) is not this machine's {device} "
                        f"({real.name}, {cc}), which the load will run on: drop --gpu, or price that GPU with "
                        "`vramcal estimate --gpu`")
    return named


def _add_image_args(g) -> None:
    """``--images`` and ``--image-size``: images in every prompt of a vision-language model (docs/vision.md)."""
    g.add_argument("--images", type=int, default=0, metavar="N",
                   help="images in every prompt (a vision-language model); their tokens add to the prompt")
    g.add_argument("--image-size", default=None, metavar="WxH",
                   help="each image's width x height in pixels, e.g. 1024x768 (default: the model's processor's "
                        "size: 896x896 for Gemma 3, 336x336 for LLaVA-1.5 ...)")


def _add_alloc_conf(p) -> None:
    p.add_argument("--alloc-conf", default=None, metavar="SETTINGS",
                   help="the caching allocator's settings the run will have, as PYTORCH_ALLOC_CONF takes them "
                        "(e.g. expandable_segments:True); default: PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF "
                        "here, else torch's defaults")


def _add_placement_args(p) -> None:
    """``--max-memory`` and ``--device-map``, as ``from_pretrained`` means them (docs/placement.md)."""
    g = p.add_argument_group("placement: split across GPUs, offload to CPU or disk (docs/placement.md)")
    g.add_argument("--max-memory", default=None, metavar="DEV=SIZE,...",
                   help="memory per device for the weights, e.g. cuda:0=24GiB,cuda:1=24GiB,cpu=64GiB[,disk=200GiB]; "
                        "the GPUs need not be in this machine")
    g.add_argument("--device-map", default=None, metavar="STRATEGY",
                   help="auto | balanced | balanced_low_0 | sequential (auto when --max-memory is given; without "
                        "--max-memory, this machine's free memory per device is the budget)")


def _placement(args, device: str) -> tuple[str | dict | None, str | None]:
    """(max_memory, device_map) from the flags; ``--device-map`` alone reads this machine's free memory
    (NVML per GPU, available RAM for the CPU), as accelerate would. Validated by the library."""
    mm, dm = getattr(args, "max_memory", None), getattr(args, "device_map", None)
    if mm is None and dm is None:
        return None, None
    from .estimator.estimate import placement_request
    from .workload import parse_device

    if mm is None and device_kind(device) != "cpu":
        from .estimator.placement import DEVICE_MAP_CHOICES
        from .probes.machine import machine_max_memory
        from .workload import choice

        choice(dm, DEVICE_MAP_CHOICES, "--device-map")
        mm = machine_max_memory()
    placed = placement_request(mm, dm, device)
    asked = parse_device(device, default="cuda")
    if getattr(args, "device_given", False) and asked.index is not None and str(asked) not in placed[0]:
        raise UserError(f"--device {asked} is not among the GPUs of --max-memory "
                        f"({', '.join(d for d in placed[0] if d.startswith('cuda'))}): the placement decides where "
                        "the model runs; drop --device, or name that GPU in --max-memory")
    return mm, dm


def _work(args, default_ctx: int):
    ctx = args.ctx if (args.ctx is not None or args.prompt is not None) else default_ctx
    return workload(ctx, args.batch, args.new_tokens, args.prompt, getattr(args, "images", 0),
                    getattr(args, "image_size", None))


def _add_estimate(sub) -> None:
    p = sub.add_parser("estimate", help="predict peak memory per stage from a model's config alone",
                       description="Predict device memory per stage (load, after load, first token, end) "
                                   "as the installed transformers + quantizer will lay the model out. "
                                   "Without MODEL, --params-b and --bits give the source documents' formula.")
    p.add_argument("model", nargs="?", help="directory with config.json, a config.json, a catalog name (`vramcal "
                                            "models`), or a Hub id: from the local HF cache, else its config and "
                                            "weight headers read from the Hub (never the weights; docs/hub.md)")
    _add_model_args(p, ctx_help="whole context: prompt + new tokens (default 4096)")
    add_hub_args(p)
    p.add_argument("--device", default=None, help="cuda (NVML view, the default) or cpu (process memory)")
    p.add_argument("--fast", action="store_true", help="use the fitted activation model instead of tracing this point")
    p.add_argument("--allow-approximate", action="store_true",
                   help="accept an answer part of which comes from a formula (an architecture the installed "
                        "transformers cannot build or run): refused without it")
    _add_alloc_conf(p)
    p.add_argument("--no-disk-cache", action="store_true", help="recompute the inventory instead of reading the cache")
    p.add_argument("--json", action="store_true", help="one JSON object, integer bytes")
    p.add_argument("--db", help="records database (default $VRAMCAL_DB or ~/.local/share/vramcal/vramcal.db)")
    p.add_argument("--no-correction", action="store_true",
                   help="do not apply this machine's correction from the records database")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    from .engines import add_engine_flags

    add_engine_flags(p, "estimate")
    q = p.add_argument_group("quick mode (no config needed)")
    q.add_argument("--params-b", type=float, help="parameters, in billions")
    q.add_argument("--bits", type=float, help="bits per parameter")
    q.add_argument("--layers", type=int)
    q.add_argument("--kv-heads", type=int)
    q.add_argument("--head-dim", type=int)
    q.add_argument("--kv-bytes", type=int, default=2, help="bytes per cached value (2 = bf16/fp16, 1 = fp8)")
    p.set_defaults(func=cmd_estimate)


def add_hub_args(p) -> None:
    g = p.add_argument_group("a Hub id not on this machine (docs/hub.md)")
    g.add_argument("--revision", default=None, metavar="REV", help="branch, tag or commit to size (default main)")
    g.add_argument("--offline", action="store_true", help="never fetch (as HF_HUB_OFFLINE=1): only local copies")
    g.add_argument("--refresh", action="store_true",
                   help="ask the Hub again where --revision points (else the commit fetched first is reused)")
    g.add_argument("--file", default=None, metavar="NAME.gguf",
                   help="--engine llama.cpp: which GGUF of a Hub repository holding several quant files")


def hub_options(args, progress=None):
    """The Hub flags of a command as :class:`~vramcal.estimator.hub.HubOptions`."""
    from .estimator.hub import HubOptions

    revision = getattr(args, "revision", None)
    if revision is not None and (not revision.strip() or not revision.isprintable()):
        raise UserError(f"--revision {revision!r} is not a branch, tag or commit name")
    return HubOptions(revision=revision, offline=bool(getattr(args, "offline", False)),
                      refresh=bool(getattr(args, "refresh", False)), progress=progress)


def _progress(args):
    """Progress lines on stderr while the first estimate of a model works, when a person is watching."""
    if getattr(args, "quiet", False):
        return None
    if sys.stderr.isatty() or os.environ.get("VRAMCAL_PROGRESS") == "1":
        from .estimator.estimate import Progress

        return Progress(sys.stderr)
    return None


def refuse_formulas(e, allowed: bool) -> None:
    """An estimate a formula stood in for (the installed transformers cannot build or run the model) is
    refused unless the user accepts an approximate answer: it looks as exact as the others."""
    formula = [k for k, how in e.methods.items() if str(how).startswith("formula")]
    if not formula or allowed:
        return
    why = next((n for n in e.notes if "formula" in n), "transformers cannot build or run it here")
    raise UserError(f"{e.model}: the {' and '.join(formula)} would come from a formula ({why}); pass "
                    "--allow-approximate to accept an approximate answer")


def _run_engine(command: str, args) -> int:
    """The command as the engine of ``--engine`` runs it (:mod:`vramcal.engines`)."""
    from .engines import Io, engine_for

    return engine_for(args).run(command, args, Io(_out, lambda: _progress(args)))


def cmd_estimate(args) -> int:
    return _run_engine("estimate", args)


def estimate_transformers(args, io) -> int:
    from . import present

    if getattr(args, "file", None) is not None:
        raise UserError("--file picks a GGUF file of a Hub repository: add --engine llama.cpp")
    quick = args.params_b is not None or args.bits is not None
    if args.model is None and not quick:
        raise UserError("give a MODEL (directory, config.json, cached Hub id or catalog name) "
                        "or quick-mode figures: --params-b 27 --bits 4 [--layers --kv-heads --head-dim]")
    work = _work(args, 4096)
    q = None
    if quick and args.model is None:
        ignored = [flag for flag, used in (("--quant", args.quant != "auto"), ("--dtype", args.dtype is not None),
                                           ("--kv-dtype", args.kv_dtype != "auto"), ("--attn", args.attn != "auto"),
                                           ("--cache", args.cache != "dynamic"), ("--fast", args.fast),
                                           ("--max-memory", getattr(args, "max_memory", None) is not None),
                                           ("--device-map", getattr(args, "device_map", None) is not None),
                                           ("--images", bool(work.images)), ("--gpu", args.gpu is not None),
                                           ("--device cpu", device_kind(args.device) == "cpu")) if used]
        if ignored:
            raise UserError(f"quick mode (--params-b, --bits) does not use {', '.join(ignored)}: say the weights "
                            "with --bits and the cache with --kv-bytes (1 for fp8), or give a MODEL")
    if quick:
        from .estimator.quick import quick_estimate

        q = quick_estimate(args.params_b, args.bits, work.ctx, work.batch, args.layers, args.kv_heads,
                           args.head_dim, args.kv_bytes)
        if args.model is None:
            _out(json.dumps(present.quick_json(q)) if args.json else present.quick_table(q))
            return 0
    from .estimator.estimate import estimate
    from .estimator.resolve import resolve_model

    max_memory, device_map = _placement(args, args.device)
    progress = _progress(args)
    source = resolve_model(args.model, hub_options(args, progress))
    e = estimate(source, args.quant, batch=work.batch, prompt=work.prompt, new_tokens=work.new_tokens,
                 dtype=parse_dtype(args.dtype), kv_dtype=args.kv_dtype, attn=args.attn, cache=args.cache,
                 device=args.device, use_cache=not args.no_disk_cache, exact=not args.fast, progress=progress,
                 max_memory=max_memory, device_map=device_map, images=work.images, image_size=work.image_size,
                 alloc_conf=args.alloc_conf, gpu=_gpu(args))
    refuse_formulas(e, args.allow_approximate)
    if not args.no_correction:
        from .calibrate.corrections import with_machine_corrections

        e = with_machine_corrections(e, args.db, e.device)
    if args.json:
        out = e.to_dict()
        if q is not None:
            out["quick"] = present.quick_json(q)
        _out(json.dumps(out))
    else:
        _out(present.estimate_table(e) + ("\n\n" + present.quick_table(q) if q is not None else ""))
    return 0


def _add_probe(sub) -> None:
    p = sub.add_parser("probe", help="load the real model, generate tokens, measure memory at every stage",
                       description="Load MODEL through from_pretrained in a child process, generate --new-tokens "
                                   "tokens after a prompt of ctx - new tokens per batch row, and sample device "
                                   "memory (NVML memory.used, or the process's resident set with --device cpu) "
                                   "every few milliseconds. Exit code 0 when the run finished, 1 when it "
                                   "ran out of memory or died, 2 for bad input, 130/143 when interrupted.")
    p.add_argument("model")
    _add_model_args(p, ctx_help="whole context: prompt + new tokens (default 512)")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default cuda:0)")
    p.add_argument("--synthetic", action="store_true",
                   help="random weights at the config's real widths, saved and loaded like a checkpoint")
    p.add_argument("--interval-ms", type=float, default=5.0, help="sampling interval (default 5 ms)")
    p.add_argument("--timeline", metavar="FILE.png", help="write a plot of memory over time")
    p.add_argument("--samples", action="store_true", help="include every sample in --json (default: the count)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--db", help="--engine vllm / llama.cpp: the records database the run goes into")
    from .engines import add_engine_flags

    add_engine_flags(p, "probe")
    p.set_defaults(func=cmd_probe)


def cmd_probe(args) -> int:
    return _run_engine("probe", args)


def probe_transformers(args, io) -> int:
    if args.db is not None:
        raise UserError("--db belongs to `vramcal probe --engine vllm` (a transformers probe records nothing)")
    from .probes.probe import run_probe

    if args.timeline and not args.timeline.lower().endswith(".png"):
        raise UserError(f"--timeline writes a PNG: give a file name ending in .png, not {args.timeline!r}")
    work = _work(args, 512)
    config = _config(args, work)
    if args.timeline:
        from .files import check_writable

        check_writable(args.timeline, "--timeline")
    from .probes.probe import ProbeInterrupted

    max_memory, device_map = _placement(args, args.device)
    try:
        r = run_probe(args.model, args.quant, work.ctx, work.batch, device=args.device, synthetic=args.synthetic,
                      interval_ms=args.interval_ms, dtype=config.dtype, attn=args.attn, new_tokens=work.new_tokens,
                      kv_dtype=args.kv_dtype, cache=args.cache, command=config.command("probe", _probe_extra(args)),
                      max_memory=max_memory, device_map=device_map, images=work.images, image_size=work.image_size,
                      gpu=_probe_gpu(args))
    except ProbeInterrupted as exc:  # show what was measured before the signal, then exit 130 / 143
        _show_probe(exc.result, args)
        raise
    _show_probe(r, args)
    return 0 if r.status == "ok" else 1


def _probe_extra(args) -> list[str]:
    """The probe's own options, so its recorded command reproduces the run as it was asked for."""
    extra = [] if args.interval_ms == 5.0 else ["--interval-ms", f"{args.interval_ms:g}"]
    return extra + (["--timeline", os.path.abspath(args.timeline)] if args.timeline else [])


def _show_probe(r, args) -> None:
    """The result first (it is what was measured), then the plot; a plot that cannot be drawn is said in
    one line after the result (exit 2)."""
    from . import present

    if args.json:
        out = r.to_dict(samples=args.samples)
        if not args.samples:
            out.pop("samples")
        _out(json.dumps(out))
    else:
        _out(present.probe_table(r))
    if args.timeline:
        from .probes.timeline import write_timeline

        write_timeline(r, args.timeline)


def _config(args, work) -> Configuration:
    model = args.model
    try:  # a path is recorded absolute, so the command runs again from anywhere
        if os.path.exists(model):
            model = os.path.abspath(model)
    except (OSError, ValueError):
        pass
    return Configuration(model, work, quant=args.quant, device=args.device, dtype=parse_dtype(args.dtype),
                         kv_dtype=args.kv_dtype, attn=args.attn, cache=args.cache,
                         synthetic=getattr(args, "synthetic", False), max_memory=getattr(args, "max_memory", None),
                         device_map=getattr(args, "device_map", None))


def cmd_check(args) -> int:
    return _run_engine("check", args)


def check_transformers(args, io) -> int:
    from . import present
    from .calibrate.check import DEFAULT_BUFFER, check

    work = _work(args, 4096)
    budget = None if args.budget in (None, "auto") else size_option(args.budget, "--budget")
    if budget == 0:
        raise UserError("--budget must be above zero, e.g. --budget 24GiB")
    buffer = DEFAULT_BUFFER if args.buffer is None else size_option(args.buffer, "--buffer")
    max_memory, device_map = _placement(args, args.device)
    r = check(args.model, args.quant, batch=work.batch, prompt=work.prompt, new_tokens=work.new_tokens,
              device=args.device, db=args.db, budget=budget, buffer=buffer, prefer=args.prefer,
              synthetic=args.synthetic, attn=args.attn, dtype=args.dtype, kv_dtype=args.kv_dtype, cache=args.cache,
              max_memory=max_memory, device_map=device_map, images=work.images, image_size=work.image_size,
              gpu=_probe_gpu(args))
    _out(json.dumps(r.to_dict()) if args.json else present.check_table(r))
    return 0 if r.verdict.fits else 1


def cmd_memo(args) -> int:
    from . import present
    from .records.store import Store

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
    from .calibrate.memo import with_pretrained_id

    memo = with_pretrained_id(memo)
    if args.recheck:
        from .calibrate.memo import recheck

        out = recheck(memo, config_of_command(memo["command"]), args.db)
        _out(json.dumps(out) if args.json else present.recheck_line(out))
        return 0 if out["consistent"] else 1
    _out(json.dumps(memo) if args.json else present.memo_markdown(memo).rstrip("\n"))
    return 0


def config_of_command(command: str) -> Configuration:
    """The configuration a recorded ``vramcal check``/``probe`` command describes, read by this parser."""
    try:
        words = shlex.split(command.split("  #", 1)[0])
    except ValueError as exc:
        raise UserError(f"the recorded command cannot be read ({exc}): {command!r}") from None
    if len(words) < 3 or words[0] != "vramcal" or words[1] not in ("check", "probe"):
        raise UserError(f"the recorded command is not a vramcal check or probe: {command!r}")
    args = build_parser().parse_args(words[1:])
    _fill_device(args)
    return _config(args, _work(args, 4096 if words[1] == "check" else 512))


def _fill_device(args) -> None:
    """``--device``'s default (cuda for an estimate, cuda:0 elsewhere), remembering whether it was given."""
    if not hasattr(args, "device"):
        return
    args.device_given = args.device is not None
    if args.device is None:
        args.device = "cuda" if args.command == "estimate" else "cuda:0"


def cmd_fit(args) -> int:
    return _run_engine("fit", args)


def fit_transformers(args, io) -> int:
    from . import present

    if args.dtype is not None:
        raise UserError("--dtype belongs to --engine vllm in `vramcal fit`")
    if args.budget is None:
        raise UserError("fit needs --budget (24GiB, 80GB, or auto), or --engine vllm")
    from .calibrate.check import DEFAULT_BUFFER
    from .calibrate.fit import fit_contexts
    from .workload import count, parse_device

    from .workload import images_of

    device = str(parse_device(args.device))
    new_tokens = count(args.new_tokens, "--new-tokens")
    images, image_size = images_of(args.images, args.image_size)
    buffer = DEFAULT_BUFFER if args.buffer is None else size_option(args.buffer, "--buffer")
    max_memory, device_map = _placement(args, device)
    others: list[str] = []
    if args.budget == "auto" and device == "cpu":
        from .calibrate.runs import budget_for
        from .probes.machine import machine_fingerprint

        budget = budget_for(device, machine_fingerprint(device), None)
    elif args.budget == "auto":  # what is free now, on each GPU the run would use
        from .estimator.estimate import placement_request
        from .probes.machine import budget_from_free

        placed = placement_request(max_memory, device_map, device)
        gpus = [d for d in placed[0] if d.startswith("cuda")] if placed else [device]
        budget = {}
        for d in gpus:
            budget[d], fm = budget_from_free(d, buffer)
            others.append(fm.describe())
        if placed is None:
            budget = budget[device]
    else:
        budget = size_option(args.budget, "--budget")
        if budget == 0:
            raise UserError("--budget must be above zero, e.g. --budget 24GiB")
    smallest = min(budget.values()) if isinstance(budget, dict) else budget
    if buffer >= smallest:
        raise UserError(f"--buffer ({buffer:,} B) must be below --budget ({smallest:,} B)")
    gpu = _gpu(args)
    fit = fit_contexts(args.model, budget, device=device, db=args.db, buffer=buffer, new_tokens=new_tokens,
                       max_memory=max_memory, device_map=device_map, images=images, image_size=image_size,
                       gpu=gpu, progress=_progress(args))
    reserves = _fit_reserves(args.budget == "auto", budget if isinstance(budget, dict) else {device: budget}, gpu)
    fit.notes += [line for line in (_reserve_line(d, r, args.budget == "auto") for d, r in reserves.items()) if line]
    _out(json.dumps({"budget_bytes": budget, "buffer_bytes": buffer, "new_tokens": new_tokens, "free": others,
                     "driver_reserve": {d: {**r.to_dict(), "taken_off": False, "why": _RESERVE_OUTSIDE[args.budget == "auto"]}
                                        for d, r in reserves.items()},
                     "rows": [r.to_dict() for r in fit.rows], "notes": fit.notes})
         if args.json else present.fit_table(args.model, budget, buffer, fit.rows, others, fit.notes))
    return 0


_RESERVE_OUTSIDE = {True: FROM_FREE,
                    False: "--budget is the run's own use, in nvidia-smi's memory.used sense: the reserve is "
                           "outside it"}


def _fit_reserves(auto: bool, budgets: dict, gpu) -> dict:
    """fit's GPUs' driver's reserve (vramcal.estimator.capacity): read here where the budget was free memory,
    else the estimate's GPU's (this machine's, or --gpu's table row). Nothing for the CPU."""
    from .estimator.capacity import reserve_of_target
    from .probes.machine import reserve_here

    gpus = [d for d in budgets if str(d).startswith("cuda")]
    return {d: reserve_here(d) if auto else reserve_of_target(gpu) for d in gpus}


def _reserve_line(device: str, reserve, auto: bool) -> str | None:
    """One short line where the reserve is known: why nothing comes off the budget for it."""
    if reserve.bytes is None:
        return None
    mib = reserve.short()
    return (f"{device}: free memory already leaves the driver's reserve ({mib}) out" if auto else
            f"{device}: --budget is the run's own use; the driver's reserve ({mib}) is outside it")


def cmd_plan(args) -> int:
    from .cli_plan import cmd_plan as plan

    return plan(args, _out)


RECORDS_ACTIONS = ("list", "show", "export", "summary", "push", "pull", "import", "init-fleet", "withdraw")
RUN_STATUSES = ("ok", "oom", "crashed", "error", "killed", "interrupted")


def cmd_records(args) -> int:
    from . import present

    action = args.action
    if action != "export" and (args.out or args.format != "csv"):
        raise UserError("--out and --format belong to `vramcal records export`")
    filters = {"model": args.model, "quant": args.quant, "gpu": args.gpu, "status": args.status, "host": args.host}
    if action != "list" and (args.all_machines or any(v is not None for v in filters.values())):
        raise UserError("--all-machines, --model, --quant, --gpu, --status and --host filter `vramcal records list`")
    if action not in ("push", "pull") and (args.to or args.source):
        raise UserError("--to belongs to `vramcal records push`, --from to `vramcal records pull`")
    if action not in ("show", "import", "withdraw") and args.target:
        raise UserError(f"`vramcal records {action}` takes no positional argument ({args.target[0]!r})")
    if action != "withdraw" and args.why is not None:
        raise UserError("--why belongs to `vramcal records withdraw RUN --why \"...\"`")
    if action == "withdraw":
        return _records_withdraw(args, present)
    if action in ("push", "pull", "import", "init-fleet"):
        return _records_copy(args, present)

    from .records.export import export
    from .records.store import Store

    with Store(args.db, create=False, readonly=True) as store:
        if action == "list":
            if store.kind == "postgresql" and not args.all_machines and args.host is None:
                import socket

                filters["host"] = socket.gethostname()  # a fleet store: this host's runs unless asked
            runs = store.runs(**filters)
            many = args.all_machines or store.kind == "postgresql"
            _out(json.dumps(runs, default=str) if args.json else
                 present.fleet_runs_table(runs) if many else present.runs_table(runs))
        elif action == "show":
            run = store.run(_run_id(args.target, "show"))
            if run is None:
                raise UserError(f"no run {args.target[0]}: `vramcal records list` shows the runs")
            _out(json.dumps(run.to_dict(), default=str, indent=1) if args.json else present.run_table(run))
        elif action == "summary":
            from .calibrate.corrections import class_summary

            rows = class_summary(store)
            _out(json.dumps([r.to_dict() for r in rows]) if args.json else present.class_summary_table(rows))
        else:
            text = export(store, args.format, args.out)
            if text is not None:
                _out(text.rstrip("\n"))
    return 0


def _run_id(target: list[str], action: str) -> int:
    if len(target) != 1 or not target[0].isdigit() or int(target[0]) >= 1 << 63:
        raise UserError(f"records {action} needs one run id: `vramcal records {action} 3`")
    return int(target[0])


def _records_withdraw(args, present) -> int:
    """``records withdraw RUN --why TEXT``: append a withdrawal; the run stays, corrections leave it out."""
    import socket

    from .calibrate.corrections import valid_why, withdraw
    from .records.store import Store

    run_id = _run_id(args.target, "withdraw")
    why = valid_why(args.why)  # all input checked before the store is opened for writing
    with Store(args.db, create=False, readonly=True) as store:
        if store.run(run_id) is None:
            raise UserError(f"no run {run_id} in {store.label}: `vramcal records list` shows the runs")
    with Store(args.db, create=False) as store:
        done = withdraw(store, run_id, why, socket.gethostname())
    _out(json.dumps(done.to_dict()) if args.json else present.withdrawn_line(done))
    return 0


def _fold_journals(db: str | None) -> None:
    from .calibrate.runs import recover_journals
    from .records.store import Store, open_existing

    existing = open_existing(db)
    if existing is None:
        return
    existing.close()
    with Store(db) as store:
        recover_journals(store)


def _records_copy(args, present) -> int:
    """push, pull, import, init-fleet: the commands that write into a (possibly shared) store. Like every
    command that writes, they first fold in the journals of runs whose process was killed."""
    from .records.engines import redact

    if args.action in ("push", "pull", "import"):
        _fold_journals(args.db)

    if args.action == "push":
        from .records.sync import push

        if not args.to:
            raise UserError("records push needs --to: `vramcal records push --to postgresql://USER@HOST/DB`")
        report = push(args.db, args.to)
    elif args.action == "pull":
        from .records.sync import pull

        if not args.source:
            raise UserError("records pull needs --from: `vramcal records pull --from postgresql://USER@HOST/DB`")
        report = pull(args.source, args.db)
    elif args.action == "import":
        from .records.store import Store
        from .records.unrecorded import load_saved, record_saved

        if not args.target:
            raise UserError("records import needs the saved run files: `vramcal records import run-*.json`")
        for path in args.target:  # every file checked before the store is opened: a bad one writes nothing
            load_saved(path)
        done = []
        with Store(args.db) as store:
            for path in args.target:
                run_id, added = record_saved(store, path)
                removed = True
                try:
                    os.unlink(path)
                except OSError:
                    removed = False
                done.append({"file": path, "run_id": run_id, "added": added, "file_removed": removed})
        _out(json.dumps(done) if args.json else "\n".join(
            (f"recorded {d['file']} as run {d['run_id']}" if d["added"] else
             f"{d['file']} was recorded already, as run {d['run_id']}") + f" in {redact(str(store.display))}"
            + (" (file removed)" if d["file_removed"] else " (the file could not be removed)") for d in done))
        return 0
    else:  # init-fleet
        from .records.engines import is_url
        from .records.roles import init_fleet

        if not args.db or not is_url(args.db):
            raise UserError("records init-fleet needs --db postgresql://ADMIN@HOST/DATABASE (an administrator)")
        password = os.environ.get("VRAMCAL_WRITER_PASSWORD")
        if password is not None and not password:  # roles are cluster-wide: an empty one locks every host out
            raise UserError("VRAMCAL_WRITER_PASSWORD is set but empty: that would clear the writer role's password "
                            "for every host of the fleet; unset it to keep the password, or give the new one")
        made = init_fleet(args.db, writer_password=password)
        _out(json.dumps(made.to_dict()) if args.json else present.fleet_init_lines(made))
        return 0
    _out(json.dumps(report.to_dict()) if args.json else present.copy_report_line(report))
    return 0


def cmd_models(args) -> int:
    from . import present
    from .estimator.catalog import catalog_rows

    rows = catalog_rows()
    _out(json.dumps(rows) if args.json else present.models_table(rows))
    return 0


def _add_calibration(sub) -> None:
    c = sub.add_parser("check", help="estimate, probe, record, verdict: does it fit, and if not what to change",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="The one-shot job: estimate -> probe (load + generate) -> reconcile -> record "
                                   "-> verdict. Fits when the measured peak plus --buffer stays within the budget "
                                   "(what is free on the device when the check starts -- other processes are "
                                   "named --, or --budget; with --max-memory, each GPU of the split on its own). "
                                   "When it does not, proposes next configurations with this machine's corrected "
                                   "estimates, in the order of --prefer:\n\n"
                                   "  quality     keep the weights' precision: smaller batch, then shorter context, "
                                   "then an fp8 KV cache,\n              then offload layers to CPU; lower the "
                                   "weight quantization only when nothing else fits\n"
                                   "  context     keep the context: lower quantization, then fp8 KV, then offload to "
                                   "CPU, then batch,\n              the context last\n"
                                   "  throughput  keep the batch: lower quantization, then context, then batch; "
                                   "offload to CPU last\n"
                                   "\nOffload (\"offload N layers to CPU\") keeps the configuration and moves what "
                                   "does not fit to RAM: every\ngenerated token then copies those weights over "
                                   "PCIe (the proposal says how many bytes), and with\nbitsandbytes they load "
                                   "unquantized (docs/placement.md).\n"
                                   "\nExit code 0 when it fits, 1 when it does not, 2 for bad input, 130/143 when "
                                   "interrupted (the run is recorded with its last stage).")
    c.add_argument("model")
    _add_model_args(c, ctx_help="whole context: prompt + new tokens (default 4096)")
    c.add_argument("--device", default=None, help="cuda:N or cpu (default cuda:0)")
    c.add_argument("--synthetic", action="store_true")
    c.add_argument("--budget", default=None, help="memory to fit in, per GPU (24GiB, 80GB; default auto = what is "
                                                  "free on each GPU when the check starts)")
    c.add_argument("--buffer", default=None, help="headroom to keep free (default 2GiB, as the documents advise)")
    c.add_argument("--prefer", default="quality", choices=POLICIES, help="order of adjustments (see above)")
    c.add_argument("--db")
    c.add_argument("--json", action="store_true")
    from .engines import add_engine_flags

    add_engine_flags(c, "check")
    c.set_defaults(func=cmd_check)

    m = sub.add_parser("memo", help="the known-good memo of the last run that fit (Markdown or JSON)")
    m.add_argument("--run", type=int, help="the memo of this run id (default: the latest)")
    m.add_argument("--recheck", action="store_true", help="re-run the memo's command and compare the peak")
    m.add_argument("--db")
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=cmd_memo)

    f = sub.add_parser("fit", help="the largest context per quant and batch that fits a budget")
    f.add_argument("model")
    f.add_argument("--budget", default=None, help="24GiB, 80GB (each GPU of a split), or auto (what is free on "
                                                   "each GPU now; the processes holding the rest are named)")
    f.add_argument("--buffer", default=None, help="headroom to keep free (default 2GiB)")
    f.add_argument("--new-tokens", type=int, default=NEW_TOKENS,
                   help=f"tokens each answer generates (default {NEW_TOKENS}); max ctx includes them")
    f.add_argument("--device", default=None, help="cuda:N or cpu (default cuda:0)")
    _add_image_args(f.add_argument_group("images"))
    _add_gpu_arg(f)
    _add_placement_args(f)
    from .engines import add_engine_flags

    add_engine_flags(f, "fit")
    f.add_argument("--no-disk-cache", action="store_true", help=argparse.SUPPRESS)
    f.add_argument("--no-correction", action="store_true", help="--engine vllm / llama.cpp: do not apply the "
                                                                 "terms learned from this machine's runs")
    f.add_argument("--db")
    f.add_argument("--json", action="store_true")
    f.set_defaults(func=cmd_fit)

    r = sub.add_parser("records", help="list, show, export, summarise or copy the recorded runs",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="The records database: --db PATH (SQLite), or --db postgresql://USER@HOST/DB "
                                   "for a fleet's shared store (TLS settings go in the URL, e.g. ?sslmode=verify-full)."
                                   "\n\n"
                                   "  list        runs (a fleet store: this host's unless --all-machines); filters\n"
                                   "  show ID     one run with its stages\n"
                                   "  export      one table of runs and stages (--format, --out)\n"
                                   "  summary     per machine class: hosts, runs, OOMs, correction and band per stage\n"
                                   "  push        copy these records --to another store, without duplicates\n"
                                   "  pull        copy the records of another store (--from) into --db\n"
                                   "  import F..  record runs saved while the database could not be written\n"
                                   "  init-fleet  create the schema, an owner and a writer role (--db as an admin;\n"
                                   "              the writer's password from $VRAMCAL_WRITER_PASSWORD)\n"
                                   "  withdraw ID --why TEXT\n"
                                   "              take a run out of every correction (it stays recorded, marked)")
    r.add_argument("action", choices=RECORDS_ACTIONS)
    r.add_argument("target", nargs="*", help="a run id (show, withdraw), saved run files (import)")
    r.add_argument("--why", help="withdraw: why the run is withdrawn (recorded with it)")
    r.add_argument("--format", default="csv", help="csv | json | parquet (export)")
    r.add_argument("--out", help="file to write (export); never the records database itself")
    r.add_argument("--to", help="the store to copy into (push): a postgresql:// URL or a path")
    r.add_argument("--from", dest="source", help="the store to copy from (pull): a postgresql:// URL or a path")
    r.add_argument("--all-machines", action="store_true", help="list the runs of every machine (list)")
    r.add_argument("--model", help="only this model (list)")
    r.add_argument("--quant", help="only this quantization (list)")
    r.add_argument("--gpu", help="only GPUs whose name contains this, e.g. H100 (list)")
    r.add_argument("--status", choices=RUN_STATUSES, help="only runs that ended so (list)")
    r.add_argument("--host", help="only this host's runs (list)")
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
    from .cli_plan import add_plan

    _add_image_args(add_plan(sub, cmd_plan).add_argument_group("images"))
    m = sub.add_parser("models", help="list the built-in catalog of model configs")
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=cmd_models)
    return parser


def _out(text: str) -> None:
    try:
        print(printable(text), flush=True)
    except BrokenPipeError:
        raise
    except OSError as exc:  # stdout on a full disk, a closed terminal ...
        raise UserError(f"cannot write the output ({exc.strerror or exc}): free space or redirect it elsewhere") \
            from None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    if not debug:  # third-party chatter is not the user's business (--debug shows it)
        from .quiet import quiet_third_party

        quiet_third_party()
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        _fill_device(args)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        from .interrupts import sigint_noted

        with sigint_noted():  # a Ctrl-C that something swallowed still ends the command (vramcal/interrupts.py)
            return args.func(args)
    except BrokenPipeError:  # `vramcal ... | head`: the reader left; end quietly
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except OSError:
            pass
        return 0
    except UserError as exc:
        if debug:
            raise
        print(f"vramcal: {one_line(printable(str(exc)))}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:  # Ctrl-C, or a probe's ProbeInterrupted (SIGINT / SIGTERM), recorded first
        print(f"vramcal: {str(exc) or 'interrupted'}", file=sys.stderr)
        return getattr(exc, "exit_code", 130)
    except Exception as exc:  # noqa: BLE001 -- the last line of defence: one line, a distinct exit code
        if debug:
            raise
        first = str(exc).splitlines()[0][:300] if str(exc) else ""
        print(f"vramcal: internal error, {type(exc).__name__}: {first} (run with --debug for the traceback "
              "and report it)", file=sys.stderr)
        return EX_SOFTWARE


def run() -> None:
    """The console command: :func:`main`, then leave without tearing the interpreter down. Everything
    the command writes is flushed and closed by then, and the exit handlers run (logging, temporary
    files); what is skipped is Python's module-by-module teardown of torch and transformers, which takes
    longer than a cached estimate itself (0.7 s after an estimate of Llama-3.1-8B; docs/performance.md)."""
    import atexit

    rc = main()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said there
            pass
    os._exit(rc)


if __name__ == "__main__":
    run()
