"""The command line of ``--engine vllm`` (part of the command line, like :mod:`vramcal.cli`; nothing
else imports it): vLLM's own flag spellings, so the flags of a ``vllm serve`` command can be pasted,
turned into :class:`~vramcal.estimator.vllm.engine.VllmArgs`, and the estimate, fit and probe run."""

from __future__ import annotations

import json

from .errors import UserError
from .workload import device_kind

# dest -> (the flag, what it is); every one belongs to --engine vllm only
VLLM_FLAGS = {
    "gpu_memory_utilization": "--gpu-memory-utilization", "max_model_len": "--max-model-len",
    "max_num_seqs": "--max-num-seqs", "max_num_batched_tokens": "--max-num-batched-tokens",
    "tensor_parallel_size": "--tensor-parallel-size", "pipeline_parallel_size": "--pipeline-parallel-size",
    "kv_cache_dtype": "--kv-cache-dtype", "quantization": "--quantization", "block_size": "--block-size",
    "enforce_eager": "--enforce-eager", "kv_cache_memory": "--kv-cache-memory-bytes", "gpu_memory": "--gpu-memory",
    "vllm_version": "--vllm-version", "allow_long_max_model_len": "--allow-long-max-model-len",
    "vllm_entrypoint": "--vllm-entrypoint", "flashinfer_sampler": "--flashinfer-sampler",
    "compile_cache": "--compile-cache", "gpu_capability": "--gpu-capability",
    "mxfp4_backend": "--mxfp4-backend", "mamba_cache_dtype": "--mamba-cache-dtype",
    "mamba_ssm_cache_dtype": "--mamba-ssm-cache-dtype", "enable_prefix_caching": "--enable-prefix-caching",
    "interconnect": "--interconnect", "disable_custom_all_reduce": "--disable-custom-all-reduce",
}


def add_engine_arg(p) -> None:
    p.add_argument("--engine", default="transformers", help="transformers (default) | vllm: predict what `vllm serve` "
                                                             "logs at startup (docs/vllm.md)")


def add_vllm_args(p, *, fit: bool = False) -> None:
    """vLLM's own flags (``vllm serve --help``), for ``--engine vllm``."""
    g = p.add_argument_group("--engine vllm: the flags of your `vllm serve` command, in vLLM's spellings")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="share of each GPU vLLM may use (default the version's own: 0.9 up to 0.19, 0.92 from 0.20)")
    g.add_argument("--max-model-len", type=int, default=None, help="default: the model's own limit")
    g.add_argument("--max-num-seqs", type=int, default=None, help="default: vLLM's for the GPU (1024 or 256)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: vLLM's for the GPU")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=None)
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=None)
    g.add_argument("--kv-cache-dtype", default=None, help="auto | fp8 | fp8_e4m3 | fp8_e5m2 | bfloat16 | float16")
    g.add_argument("--quantization", "-q", default=None, help="fp8 (online), or the checkpoint's own: awq, gptq, "
                                                             "compressed-tensors, bitsandbytes (default: the checkpoint's)")
    g.add_argument("--block-size", type=int, default=None, help="KV block size in tokens (default 16)")
    g.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs")
    g.add_argument("--kv-cache-memory-bytes", "--kv-cache-memory", dest="kv_cache_memory", default=None,
                   metavar="SIZE", help="pin the KV memory per GPU (vLLM 0.10.2 on), e.g. 20GiB")
    g.add_argument("--gpu-memory", default=None, metavar="SIZE",
                   help="each GPU's total memory as the driver reports it (default: this machine's GPU 0); an H100 "
                        "80GB reports 79.19GiB to vLLM")
    g.add_argument("--gpu-capability", default=None, metavar="MAJOR.MINOR",
                   help="the GPUs' CUDA compute capability, e.g. 8.0 for an A100, where --gpu names no GPU of "
                        "vramcal's table (default: the named GPU's, else this machine's through NVML); the "
                        "all-reduce fusion and gpt-oss's MXFP4 kernel go by it")
    g.add_argument("--vllm-version", default=None, metavar="X.Y", help="default: the installed vLLM's, else the newest "
                                                                       "modelled (0.33)")
    g.add_argument("--allow-long-max-model-len", action="store_true", default=None,
                   help="vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN=1: a --max-model-len above the model's limit")
    g.add_argument("--vllm-entrypoint", default=None, choices=("serve", "llm"),
                   help="serve (default): the defaults of `vllm serve`; llm: of the LLM class")
    g.add_argument("--flashinfer-sampler", default=None, choices=("yes", "no"),
                   help="whether vLLM samples with FlashInfer (its log says \"Using FlashInfer for top-p & top-k "
                        "sampling\"): then its profile skips the top-k/top-p sort of vLLM before 0.17 (default: "
                        "not known, the sort is priced)")
    g.add_argument("--compile-cache", default=None, choices=("cold", "warm"),
                   help="whether vLLM's torch.compile caches hold this model, flags and version: warm (the log says "
                        "\"Directly load AOT compilation\") or cold (\"Compiling a graph for compile range\"), when "
                        "the profile also holds Inductor's kernel benchmark, about a copy of the embedding table "
                        "(0.12 on; default: not known, cold is priced). probe / check: cold starts vLLM with both "
                        "compile caches off; otherwise the state its log shows is the one compared")
    g.add_argument("--mxfp4-backend", default=None, choices=("triton", "marlin"),
                   help="gpt-oss: the MoE kernel holding the MXFP4 experts (its log says \"Using Triton backend\" or "
                        "\"... leveraging the Marlin kernel\"; default: Marlin before 0.13 or on a GPU outside "
                        "SM90/SM100 by its compute capability, else Triton)")
    g.add_argument("--mamba-cache-dtype", default=None, help="hybrid models: the conv state's dtype (auto | float16 | "
                                                             "bfloat16 | float32)")
    g.add_argument("--mamba-ssm-cache-dtype", default=None, help="hybrid models: the SSM / recurrent state's dtype")
    g.add_argument("--enable-prefix-caching", action="store_true", default=None, dest="enable_prefix_caching",
                   help="vLLM's flag (hybrid models: the Mamba cache mode follows it; default: vLLM's, on from 0.26)")
    g.add_argument("--no-enable-prefix-caching", action="store_false", dest="enable_prefix_caching")
    add_interconnect_arg(g)
    g.add_argument("--disable-custom-all-reduce", action="store_true", default=None,
                   help="vLLM's flag: NCCL does every all-reduce (tp > 1)")
    if fit:
        g.add_argument("--concurrency", type=float, default=None,
                       help="with --max-model-len: the requests of that length to hold at once; fit then says the "
                            "utilization (and --kv-cache-memory-bytes) it needs")


def add_interconnect_arg(g) -> None:
    g.add_argument("--interconnect", default=None, metavar="nvlink|pcie",
                   help="tp > 1: how the GPUs reach each other, which sets the non-torch term (default: this "
                        "machine's, read through NVML; for a described one its GPU's name, else nvlink)")


def interconnect(args, tp: int, here: bool):
    """The tensor-parallel GPUs' interconnect: ``--interconnect``, else this machine's through NVML when the
    estimate is for it (``here``), else None (the estimate guesses from the GPU's name and says so)."""
    from .estimator.vllm.allreduce import Interconnect, parse

    given = getattr(args, "interconnect", None)
    if given is not None:
        return Interconnect(parse(given), "--interconnect")
    if tp < 2 or not here:
        return None
    from .probes import nvml
    from .probes.hardware import interconnect_here

    return interconnect_here(list(range(tp))) if nvml.available()[0] else None


def vllm_flags_used(args) -> list[str]:
    return [flag for dest, flag in VLLM_FLAGS.items() if getattr(args, dest, None) is not None] + \
        (["--concurrency"] if getattr(args, "concurrency", None) is not None else [])


def refuse_vllm_flags(args) -> None:
    used = vllm_flags_used(args)
    if used:
        raise UserError(f"{', '.join(used)} belong{'s' * (len(used) == 1)} to --engine vllm: add --engine vllm, "
                        "or drop them")


def refuse_transformers_flags(args, command: str, engine: str = "vllm", allowed: tuple[str, ...] = (),
                              instead: str = "--max-model-len, --quantization, --kv-cache-dtype, "
                                             "--tensor-parallel-size ...") -> None:
    """The transformers engine's flags mean nothing to vLLM's startup (or llama.cpp's): refused, not
    ignored; ``allowed`` are those the engine's command takes after all (``fit``'s --budget)."""
    checks = (("--quant", getattr(args, "quant", "auto") not in (None, "auto")),
              ("--ctx", getattr(args, "ctx", None) is not None), ("--prompt", getattr(args, "prompt", None) is not None),
              ("--batch", getattr(args, "batch", 1) not in (None, 1)),
              ("--new-tokens", command != "probe" and getattr(args, "new_tokens", 16) != 16),
              ("--kv-dtype", getattr(args, "kv_dtype", "auto") != "auto"),
              ("--attn", getattr(args, "attn", "auto") != "auto"), ("--cache", getattr(args, "cache", "dynamic") != "dynamic"),
              ("--max-memory", getattr(args, "max_memory", None) is not None),
              ("--device-map", getattr(args, "device_map", None) is not None),
              ("--fast", bool(getattr(args, "fast", False))),
              ("--params-b", getattr(args, "params_b", None) is not None), ("--bits", getattr(args, "bits", None) is not None),
              ("--budget", getattr(args, "budget", None) is not None), ("--buffer", getattr(args, "buffer", None) is not None),
              ("--device cpu", device_kind(getattr(args, "device", "cuda")) == "cpu"),
              ("--synthetic", command in ("estimate", "fit") and bool(getattr(args, "synthetic", False))),
              ("--images", bool(getattr(args, "images", 0))),
              ("--image-size", getattr(args, "image_size", None) is not None))
    used = [flag for flag, on in checks if on and flag not in allowed]
    if used:
        raise UserError(f"--engine {engine} does not use {', '.join(used)}: give its own flags instead ({instead}; "
                        f"`vramcal {command} --help`)")


def this_gpu() -> tuple[int | None, str | None, tuple[int, int] | None]:
    """GPU 0's total memory as CUDA reports it (vLLM's "total": NVML's total less the driver's reserve, where
    the reserve is known: :mod:`vramcal.estimator.capacity`), its name and its compute capability, through the
    one NVML door (the capability: NVML's, else the table's for that name where NVML cannot read it, an old
    driver); (None, None, None) without one."""
    from .estimator.capacity import capacity
    from .probes import nvml
    from .probes.hardware import capability_here
    from .probes.machine import reserve_here

    ok, _ = nvml.available()
    if not ok:
        return None, None, None
    info = nvml.device_info(0)
    total = None if isinstance(info["total_bytes"], nvml.NA) else int(info["total_bytes"])
    name = None if isinstance(info["name"], nvml.NA) else str(info["name"])
    if total is not None:
        total = capacity(total, reserve_here("cuda:0"))
    return total, name, capability_here(0)


def parse_capability(text: str) -> tuple[int, int]:
    """``--gpu-capability 8.0`` as (8, 0); one line on anything else."""
    import re

    m = re.fullmatch(r"\s*([1-9][0-9]?)\.([0-9])\s*", str(text))
    if m is None:
        raise UserError(f"--gpu-capability must be MAJOR.MINOR, e.g. 8.0 (A100), 9.0 (H100), 12.0 (RTX 5090); "
                        f"got {text!r}")
    return int(m.group(1)), int(m.group(2))


def vllm_args(args):
    """The command line's flags as :class:`VllmArgs` (validated there, one line on bad input)."""
    from .estimator.vllm.engine import VllmArgs
    from .units import size_option

    total = size_option(args.gpu_memory, "--gpu-memory", above_zero=True)
    name = capability = None
    if getattr(args, "gpu", None) is not None:  # a described GPU: vLLM's defaults depend on its name and size
        from .probes.hardware import find_gpu, gpu_target

        target = gpu_target(args.gpu)
        name, capability = target.name, target.compute_capability
        if total is None:  # vLLM's total is CUDA's: the table's size less the driver's reserve (estimator/capacity.py)
            from .estimator.capacity import capacity, reserve_for

            total = capacity(int(find_gpu(name).memory_gb * 1024**3), reserve_for(name))
    elif total is None:
        total, name, capability = this_gpu()
    if getattr(args, "gpu_capability", None) is not None:
        capability = parse_capability(args.gpu_capability)
    dtype = "auto" if args.dtype is None else args.dtype
    tp = 1 if args.tensor_parallel_size is None else args.tensor_parallel_size
    return VllmArgs(
        gpu_memory_utilization=args.gpu_memory_utilization,  # None: the version's default
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        tensor_parallel_size=tp,
        pipeline_parallel_size=1 if args.pipeline_parallel_size is None else args.pipeline_parallel_size,
        dtype=dtype, kv_cache_dtype="auto" if args.kv_cache_dtype is None else args.kv_cache_dtype,
        quantization=args.quantization,
        block_size=args.block_size, enforce_eager=bool(args.enforce_eager),
        kv_cache_memory_bytes=size_option(args.kv_cache_memory, "--kv-cache-memory-bytes", above_zero=True),
        gpu_memory_bytes=total,
        gpu_name=name, gpu_capability=capability, vllm_version=args.vllm_version,
        allow_long_max_model_len=bool(args.allow_long_max_model_len),
        usage=args.vllm_entrypoint or "serve",
        flashinfer_sampler=None if args.flashinfer_sampler is None else args.flashinfer_sampler == "yes",
        compile_cache=getattr(args, "compile_cache", None),
        mxfp4_backend=getattr(args, "mxfp4_backend", None),
        mamba_cache_dtype=getattr(args, "mamba_cache_dtype", None) or "auto",
        mamba_ssm_cache_dtype=getattr(args, "mamba_ssm_cache_dtype", None) or "auto",
        enable_prefix_caching=getattr(args, "enable_prefix_caching", None),
        interconnect=interconnect(args, tp, here=getattr(args, "gpu", None) is None),
        disable_custom_all_reduce=bool(getattr(args, "disable_custom_all_reduce", None)))


def cmd_estimate_vllm(args, out, progress) -> int:
    from . import present
    from .estimator.resolve import resolve_model
    from .estimator.vllm.engine import as_estimate, estimate_vllm

    if args.model is None:
        raise UserError("--engine vllm needs a MODEL (directory, config.json, cached Hub id or catalog name)")
    refuse_transformers_flags(args, "estimate")
    vargs = vllm_args(args)
    from .cli import hub_options

    source = resolve_model(args.model, hub_options(args, progress))
    est = estimate_vllm(source, vargs, use_cache=not args.no_disk_cache, progress=progress)
    if not args.no_correction:
        from .calibrate.vllm_corrections import corrected

        est = corrected(est, source, vargs, args.db)
    e = as_estimate(source, est)
    out(json.dumps(e.to_dict()) if args.json else present.vllm_table(e))
    return 0


def cmd_fit_vllm(args, out) -> int:
    from . import present
    from .estimator.resolve import resolve_model
    from .estimator.vllm.fit import longest, utilization

    refuse_transformers_flags(args, "fit")
    vargs = vllm_args(args)
    source = resolve_model(args.model)
    offsets = None
    if not args.no_correction:
        from .calibrate.vllm_corrections import learned_offsets

        offsets = learned_offsets(vargs, args.db)
    if args.concurrency is not None or (args.max_model_len is not None and args.gpu_memory_utilization is None):
        if args.max_model_len is None:
            raise UserError("--concurrency needs --max-model-len: the length of the requests to hold at once")
        if args.gpu_memory_utilization is not None:
            raise UserError("give --gpu-memory-utilization (fit says the longest length) or --max-model-len with "
                            "--concurrency (fit says the utilization), not both")
        fit, est = utilization(source, vargs, args.max_model_len, 1.0 if args.concurrency is None else args.concurrency,
                               offsets=offsets)
    else:
        fit, est = longest(source, vargs, offsets=offsets)
    out(json.dumps({**fit.to_dict(), "vllm": est.to_dict()}) if args.json else present.vllm_fit_table(source.name, fit, est.notes))
    return 0 if fit.fits else 1


def cmd_probe_vllm(args, out, *, check: bool) -> int:
    """``probe`` / ``check --engine vllm``: vLLM started in a child, NVML sampled, its startup terms read
    back and recorded beside the prediction (docs/vllm.md)."""
    import os
    from dataclasses import replace

    from . import present
    from .estimator.resolve import resolve_model
    from .estimator.vllm.engine import as_estimate, estimate_vllm
    from .probes.vllm_probe import preflight, priced_as_started, run_vllm_probe

    verb = "check" if check else "probe"
    refuse_transformers_flags(args, verb)
    vargs = vllm_args(args)
    preflight(vargs.tensor_parallel_size * vargs.pipeline_parallel_size)
    source = resolve_model(args.model)
    synthetic = bool(getattr(args, "synthetic", False))
    if not source.weight_files and not synthetic:
        raise UserError(f"{source.name} has no *.safetensors weights here: give its directory or a cached Hub id, or "
                        "add --synthetic (vLLM's --load-format dummy: random weights at the real widths)")
    est = estimate_vllm(source, vargs)
    estimate = as_estimate(source, est)
    child_args = {"gpu_memory_utilization": vargs.gpu_memory_utilization, "max_model_len": vargs.max_model_len,
                  "max_num_seqs": vargs.max_num_seqs, "max_num_batched_tokens": vargs.max_num_batched_tokens,
                  "tensor_parallel_size": vargs.tensor_parallel_size,
                  "pipeline_parallel_size": vargs.pipeline_parallel_size, "dtype": vargs.dtype,
                  "kv_cache_dtype": vargs.kv_cache_dtype, "quantization": vargs.quantization,
                  "block_size": vargs.block_size, "enforce_eager": vargs.enforce_eager or None,
                  "kv_cache_memory_bytes": vargs.kv_cache_memory_bytes,
                  "mamba_cache_dtype": None if vargs.mamba_cache_dtype == "auto" else vargs.mamba_cache_dtype,
                  "mamba_ssm_cache_dtype": None if vargs.mamba_ssm_cache_dtype == "auto" else vargs.mamba_ssm_cache_dtype,
                  "enable_prefix_caching": vargs.enable_prefix_caching,
                  "disable_custom_all_reduce": vargs.disable_custom_all_reduce or None}
    if synthetic:
        child_args.update(load_format="dummy", skip_tokenizer_init=True)
    gpus = list(range(vargs.tensor_parallel_size * vargs.pipeline_parallel_size))
    model_dir = source.directory
    if synthetic or model_dir is None:  # a catalog config: vLLM reads config.json from a folder
        import tempfile

        model_dir = tempfile.mkdtemp(prefix="vramcal-vllm-")
        with open(os.path.join(model_dir, "config.json"), "w") as fh:
            json.dump({k: v for k, v in source.config.items() if not k.startswith("_vramcal")}, fh)
    from .calibrate.runs import end_engine_probe, recorded_engine_probe

    run_id, result = recorded_engine_probe(
        args.db, "cuda:0", vllm_run_context(source, estimate, command_of(args, verb)),
        lambda: priced_as_started(
            run_vllm_probe(model_dir, source.name, child_args, estimate, gpus=gpus,
                           interval_ms=getattr(args, "interval_ms", 5.0) or 5.0,
                           new_tokens=getattr(args, "new_tokens", 16) or 16,
                           cold_compile=vargs.compile_cache == "cold"),
            lambda state: as_estimate(source, estimate_vllm(source, replace(vargs, compile_cache=state)))),
        lambda result: vllm_outcome(estimate, result))
    out(json.dumps({**result.to_dict(), "run_id": run_id}) if args.json
        else present.vllm_probe_table(result, run_id))
    end_engine_probe(result)
    shown = result.estimate.vllm if result.estimate is not None else est  # priced for the state the log showed
    ok = result.status == "ok" and (not check or shown.fits)
    return 0 if ok else 1


def command_of(args, verb: str) -> str:
    import shlex
    import sys

    return shlex.join(["vramcal", verb, *sys.argv[2:]]) if len(sys.argv) > 2 else f"vramcal {verb} {args.model}"


def vllm_run_context(source, estimate, command: str):
    """The run as recorded before vLLM starts: the prediction as the run's estimate."""
    from .records.store import RunContext
    from .versions import VRAMCAL_VERSION

    v = estimate.vllm
    return RunContext(model=source.name, quant=v.quantization, ctx=v.max_model_len, batch=1, device="cuda:0",
                      command=command, config_hash=source.config_hash, quant_impl=f"vLLM {v.version}",
                      dtype=v.dtype, kv_dtype=v.kv_cache_dtype, attn="vllm", estimate=estimate.to_dict(),
                      estimator_model=estimate.estimator_model, vramcal_version=VRAMCAL_VERSION)


def vllm_outcome(estimate, result):
    """The probe's outcome: the sampled stages beside the prediction, the logged terms in its result (where
    :mod:`vramcal.calibrate.vllm_corrections` learns them)."""
    from .records.store import Outcome, StageRow

    estimate = result.estimate or estimate  # the price for the compile state the log shows (priced_as_started)
    rows = [StageRow(name, estimate.stages.get(name), r.get("peak_bytes"), r.get("used_bytes"))
            for name, r in result.stages.items()]
    return Outcome(status=result.status, last_stage=result.last_stage, error=result.error,
                   series=f"gpu{result.gpus[0]}", wall_s=result.wall_s, sampler_overhead=result.sampler_overhead,
                   result=result.to_dict(), stages=rows, samples=result.sample_rows())

