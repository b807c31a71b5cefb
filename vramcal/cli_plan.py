"""The command line of ``vramcal plan`` (part of the command line, like :mod:`vramcal.cli`; nothing else
imports it): read the machine -- this one through NVML, or one described with ``--hardware`` -- and the
workload, search (:mod:`vramcal.calibrate.plan`), say the plans. Every input is validated before the
search starts; bad input is one line and exit 2; nothing fits is exit 1 with what is missing."""

from __future__ import annotations

import argparse
import json

from .errors import UserError
from .workload import ATTNS, GOALS, NEW_TOKENS


def add_plan(sub, func) -> None:
    p = sub.add_parser(
        "plan", help="the best ways to run a model on the GPUs and RAM a machine has (quant, split, offload, ctx)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Searches weight quantizations, KV dtypes, the split across GPUs (transformers' own device "
                    "map, with a\nmax_memory chosen so that each GPU's whole peak fits its memory less --buffer) and "
                    "offload to RAM\n(and disk), and proves each plan fits with the estimator's exact trace. Each plan "
                    "says how fast it\ncan decode at most (bytes read per token over each bandwidth), the "
                    "from_pretrained(...) call that\nloads it, and the `vramcal check` command that verifies it here.\n\n"
                    "  --goal quality  reaches the context, on the GPUs alone if possible, highest precision (default)\n"
                    "  --goal context  the longest context\n"
                    "  --goal speed    reaches the context, the highest decode bound\n\n"
                    "--engine vllm / --engine llama.cpp: the `vllm serve` / `llama-server` flags instead (for llama.cpp: "
                    "which GGUF of a\nfolder, -ngl, --n-cpu-moe, -ts, -ctk/-ctv and -c; the RAM's bandwidth from "
                    "--bandwidth cpu=RATE).\n\n"
                    "Exit code 0 with plans, 1 when nothing fits (what is missing is said), 2 for bad input.")
    p.add_argument("model")
    p.add_argument("--hardware", default=None, metavar="DEV=SIZE,...",
                   help="a machine to plan for: each device's size, e.g. cuda:0=24GiB,cuda:1=12GiB,cpu=64GiB"
                        "[,disk=500GiB] (default: this machine, each GPU's free memory and the available RAM)")
    p.add_argument("--gpu", action="append", default=None, metavar="NAME",
                   help="with --hardware: the GPU model, for its bandwidths (e.g. \"RTX 4090\"); once for all, or "
                        "once per GPU in order")
    p.add_argument("--bandwidth", default=None, metavar="DEV=RATE,...",
                   help="bandwidths per second over the table's and NVML's, e.g. cuda:0=1008GB,pcie=25GB")
    w = p.add_argument_group("workload")
    w.add_argument("--ctx", type=int, default=None, help="whole context: prompt + new tokens (default: the largest "
                                                         "that fits, up to the model's limit)")
    w.add_argument("--prompt", type=int, default=None, help="prompt tokens, instead of --ctx")
    w.add_argument("--new-tokens", type=int, default=None, help=f"tokens generated (default {NEW_TOKENS})")
    w.add_argument("--batch", type=int, default=1)
    p.add_argument("--attn", default="auto", choices=ATTNS)
    p.add_argument("--buffer", default=None, help="headroom to keep free on each GPU (default 2GiB)")
    p.add_argument("--goal", default="quality", help=" | ".join(GOALS) + " (see above)")
    p.add_argument("--db", help="the records database whose corrections apply (this machine only)")
    p.add_argument("--json", action="store_true")
    v = p.add_argument_group("--engine vllm: the `vllm serve` flags for these GPUs (docs/vllm.md)")
    v.add_argument("--engine", default="transformers", help="transformers (default) | vllm: search tensor "
                                                             "parallelism, fp8 weights and KV dtype for `vllm serve` | "
                                                             "llama.cpp: the llama-server flags for a GGUF (or a "
                                                             "folder of them): file, -ngl, --n-cpu-moe, -ts, "
                                                             "-ctk/-ctv, -c (any of them given is kept)")
    v.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="vLLM's share of each GPU (default the version's: 0.9 up to 0.19, 0.92 from 0.20)")
    v.add_argument("--vllm-version", default=None, metavar="X.Y", help="default: the installed vLLM's, else the newest "
                                                                       "modelled")
    v.add_argument("--compile-cache", default=None, choices=("cold", "warm"),
                   help="whether vLLM's torch.compile caches already hold this model and flags (as `estimate "
                        "--engine vllm --compile-cache`; default: not known, a cold start is priced)")
    from .cli_vllm import add_interconnect_arg

    add_interconnect_arg(v)
    from .cli_llamacpp import add_flags

    add_flags(p, "plan")
    p.set_defaults(func=func)
    return p


def cmd_plan(args, out) -> int:
    from .engines import Io, engine_for

    return engine_for(args).run("plan", args, Io(out))


def _inputs(args):
    """The workload, the buffer and the machine, each validated: nothing is searched for bad input."""
    from .calibrate.check import DEFAULT_BUFFER
    from .units import size_option
    from .workload import workload

    given = args.ctx is not None or args.prompt is not None
    new_tokens = NEW_TOKENS if args.new_tokens is None else args.new_tokens
    work = workload(args.ctx if given else None, args.batch, new_tokens, args.prompt, args.images,
                    args.image_size)
    asked = work.ctx if given else None
    buffer = DEFAULT_BUFFER if args.buffer is None else size_option(args.buffer, "--buffer")
    return work, asked, buffer, machine(args)


def machine(args, *, cpu_bandwidth: bool = False):
    """The machine to plan for: the one ``--hardware`` describes (``--gpu`` names its GPUs, ``--bandwidth`` sets
    any bandwidth), or this one through NVML. ``cpu_bandwidth``: the engine reads ``--bandwidth cpu=`` (llama.cpp
    computes layers on the CPU; the others refuse it rather than ignore it)."""
    from .probes.hardware import described, parse_bandwidth, parse_hardware, this_machine

    bandwidths = parse_bandwidth(args.bandwidth)
    if "cpu" in bandwidths and not cpu_bandwidth:
        raise UserError("--bandwidth cpu= is the RAM's bandwidth, which only --engine llama.cpp reads (it computes "
                        "layers on the CPU); this engine streams offloaded weights over the host link: give pcie=")
    if args.hardware is not None:
        if args.db is not None:
            raise UserError("--db gives this machine's corrections; a described machine (--hardware) has no runs "
                            "of its own: drop --db, or plan this machine without --hardware")
        hardware = described(parse_hardware(args.hardware), args.gpu, bandwidths)
    elif args.gpu:
        raise UserError("--gpu names the GPUs of --hardware; this machine's are read through NVML "
                        "(give --hardware to plan for another)")
    else:
        hardware = this_machine(bandwidths)
    return hardware


def plan_vllm_cmd(args, io) -> int:
    """``plan --engine vllm``: tensor parallelism, fp8 weights and the KV dtype for `vllm serve`."""
    from . import present
    from .calibrate.plan_vllm import plan_vllm
    from .workload import choice

    choice(args.goal, GOALS, "--goal")
    transformers_only = [f for f, given in (("--images", args.images), ("--image-size", args.image_size),
                                            ("--prompt", args.prompt), ("--buffer", args.buffer),
                                            ("--new-tokens", args.new_tokens is not None),
                                            ("--batch", args.batch != 1), ("--attn", args.attn != "auto"),
                                            ("--db", args.db)) if given]
    if transformers_only:
        raise UserError(f"{', '.join(transformers_only)} belong to transformers' plans, not to --engine vllm "
                        "(vLLM takes --gpu-memory-utilization of each GPU and batches requests itself; its "
                        "--max-model-len, from --ctx, is prompt and generated tokens together)")
    _, _, _, hardware = _inputs(args)
    from .estimator.vllm.allreduce import Interconnect, parse

    given = None if args.interconnect is None else Interconnect(parse(args.interconnect), "--interconnect")
    vres = plan_vllm(args.model, hardware, ctx=args.ctx, goal=args.goal,
                     utilization=args.gpu_memory_utilization, vllm_version=args.vllm_version,
                     interconnect=given, this_machine=args.hardware is None, compile_cache=args.compile_cache)
    io.out(json.dumps(vres.to_dict()) if args.json else present.vllm_plan_text(vres))
    return 0 if vres.plans else 1


def plan_transformers(args, io) -> int:
    from . import present
    from .calibrate.plan import plan_model
    from .cli import _progress
    from .estimator.resolve import resolve_model
    from .estimator.vision import check_images
    from .workload import choice

    out = io.out
    choice(args.goal, GOALS, "--goal")
    if args.gpu_memory_utilization is not None or args.vllm_version is not None or args.compile_cache is not None:
        raise UserError("--gpu-memory-utilization, --vllm-version and --compile-cache belong to --engine vllm")
    work, asked, buffer, hardware = _inputs(args)
    check_images(resolve_model(args.model).config, work.images, args.model)  # bad input, before the search

    result = plan_model(args.model, hardware, buffer=buffer, batch=work.batch, new_tokens=work.new_tokens,
                        ctx=asked, goal=args.goal, db=args.db, attn=args.attn, this_machine=args.hardware is None,
                        images=work.images, image_size=work.image_size, progress=_progress(args))
    if args.json:
        doc = result.to_dict()
        doc["gpus"] = [{"device": g.device, "name": g.name, "memory_bytes": g.memory_bytes, "total_bytes": g.total_bytes,
                        "driver_reserve": g.reserve_json(),
                        "memory_bandwidth_bytes_per_s": g.memory_bandwidth.bytes_per_s,
                        "memory_bandwidth_source": g.memory_bandwidth.source,
                        "link_bandwidth_bytes_per_s": g.link_bandwidth.bytes_per_s,
                        "link_bandwidth_source": g.link_bandwidth.source, "held_by": g.held_by}
                       for g in hardware.gpus]
        for d, p in zip(doc["plans"], result.plans):
            d["python"] = p.python()
        out(json.dumps(doc))
    else:
        out(present.plan_text(result))
    return 0 if result.plans else 1
