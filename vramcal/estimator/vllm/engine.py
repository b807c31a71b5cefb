"""The vLLM engine: what ``vllm serve`` will log at startup, per GPU of ``tp x pp``, before launching it.

Per rank (docs/vllm.md has the formulas with their vLLM files, and a worked example from a real log):

    requested  = total x gpu_memory_utilization
    available  = requested - weights - activation peak - non-torch [- CUDA-graph estimate, 0.20 on]
    num_blocks = available // (page x layers) (hybrid: // page // group_size), then the minimum over ranks
    tokens     = num_blocks x block_size   (hybrid up to 0.19: // groups; 0.20 on: int(concurrency x len))

``weights`` from :mod:`.layout` (vLLM's layout of the installed transformers' model, built on ``meta``),
``activation`` and the CUDA-graph default from :mod:`.budget`, non-torch from
:func:`.versions.non_torch_default` (a machine's calibration replaces the two measured terms).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ...errors import UserError
from ...units import GIB, MIB
from ...workload import count
from ..quant import DTYPE_BYTES
from ..resolve import ModelSource, resolve_model, text_config
from . import allreduce as A
from . import fusion as F
from . import kv as K
from . import messages as M
from . import versions as V
from . import mamba as H
from . import mxfp4 as X
from .arch import arch_of, check_tp
from .budget import V2_GRAPH_METHOD, activation, cuda_graph_bytes
from .layout import rank_weights
from .quant import VllmQuant, resolve as resolve_quant
from .result import VllmEstimate, VllmRank

# the arithmetic's id: runs record it, corrections are fitted per id (2: the cold compile's kernel benchmark is
# priced, so a run of /1 would carry it in its correction a second time; 3: a probe compares with the price for
# the compile cache's state its log shows, where a run of /2 compared a warm start with the cold price)
MODEL_ID = "vllm-startup/3"
DTYPES = {"auto": "auto", "half": "float16", "float16": "float16", "fp16": "float16", "bfloat16": "bfloat16",
          "bf16": "bfloat16", "float": "float32", "float32": "float32", "fp32": "float32"}
KV_DTYPES = {"auto": None, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1, "bfloat16": 2, "float16": 2, "half": 2}
BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)
DEFAULT_UTILIZATION = 0.9  # CacheConfig.gpu_memory_utilization up to 0.19; versions.default_utilization has each
CONTEXT_BYTES = 512 * MIB  # used before vLLM's first snapshot: the CUDA context (0.19 H100 logs: 0.51 GiB)
NCCL_INIT_BYTES = 1024 * MIB  # ... and NCCL communicators with tp x pp > 1 (0.19 H100 logs: 1.02 GiB more)


@dataclass(frozen=True)
class VllmArgs:
    """The flags of a ``vllm serve`` command, in vLLM's own spellings (``None``: vLLM's default)."""

    gpu_memory_utilization: float | None = None  # None: the version's default (versions.default_utilization)
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    block_size: int | None = None
    enforce_eager: bool = False
    kv_cache_memory_bytes: int | None = None
    gpu_memory_bytes: int | None = None  # each GPU's total as CUDA reports it (vLLM's "total")
    gpu_name: str | None = None
    # CUDA's (major, minor) of that GPU: vramcal's table of GPUs for a named one, NVML for this machine's
    # (:mod:`vramcal.probes.hardware`); it decides the fusion workspace, the MXFP4 backend and the largest CUDA-graph
    # capture size (1024 on a 10.x GPU from 0.28). None: not known
    gpu_capability: tuple[int, int] | None = None
    vllm_version: str | None = None
    allow_long_max_model_len: bool = False  # VLLM_ALLOW_LONG_MAX_MODEL_LEN=1
    usage: str = "serve"  # serve | llm: the defaults of `vllm serve` or of the LLM class
    flashinfer_sampler: bool | None = None  # FlashInfer's top-k/top-p sampler in use (None: not known)
    compile_cache: str | None = None  # cold | warm: whether torch.compile's caches miss (None: not known, cold)
    mxfp4_backend: str | None = None  # triton | marlin: the MoE kernel holding MXFP4 experts (None: by GPU, version)
    mamba_cache_dtype: str = "auto"  # a hybrid model's conv state dtype (vLLM's --mamba-cache-dtype)
    mamba_ssm_cache_dtype: str = "auto"  # ... and its SSM / recurrent state's (--mamba-ssm-cache-dtype)
    enable_prefix_caching: bool | None = None  # --enable-prefix-caching / --no-enable-prefix-caching (None: vLLM's)
    interconnect: A.Interconnect | None = None  # how the tp GPUs connect (None: not known; allreduce.resolve)
    disable_custom_all_reduce: bool = False  # vLLM's --disable-custom-all-reduce

    def validated(self) -> VllmArgs:
        u = self.gpu_memory_utilization
        if u is not None and (isinstance(u, bool) or not isinstance(u, (int, float)) or not math.isfinite(u)
                              or not 0 < u <= 1):
            raise UserError(f"--gpu-memory-utilization must be in (0, 1], got {u!r}: it is the share of each GPU's "
                            "total memory vLLM may use, e.g. 0.9")
        count(self.tensor_parallel_size, "--tensor-parallel-size", 1, 1024)
        count(self.pipeline_parallel_size, "--pipeline-parallel-size", 1, 1024)
        for value, flag in ((self.max_model_len, "--max-model-len"), (self.max_num_seqs, "--max-num-seqs"),
                            (self.max_num_batched_tokens, "--max-num-batched-tokens")):
            if value is not None:
                count(value, flag, 1, 1 << 26)
        if self.max_num_seqs is not None and self.max_num_batched_tokens is not None \
                and self.max_num_batched_tokens < self.max_num_seqs:
            raise UserError(f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be at least "
                            f"--max-num-seqs ({self.max_num_seqs}), as vLLM's scheduler config requires")
        if str(self.dtype).lower() not in DTYPES:
            raise UserError(f"unknown --dtype {self.dtype!r}: choose auto, bfloat16, float16 (half) or float32")
        if str(self.kv_cache_dtype).lower() not in KV_DTYPES:
            raise UserError(f"unknown --kv-cache-dtype {self.kv_cache_dtype!r}: choose {', '.join(KV_DTYPES)}")
        if self.block_size is not None and self.block_size not in BLOCK_SIZES:
            raise UserError(f"--block-size must be one of {', '.join(map(str, BLOCK_SIZES))}, got {self.block_size}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise UserError("--kv-cache-memory must be above zero, e.g. --kv-cache-memory 20GiB")
        if self.gpu_memory_bytes is not None and not 0 < self.gpu_memory_bytes <= 4 * 1024**4:
            raise UserError(f"--gpu-memory must be a GPU's total memory, e.g. 80GiB; got {self.gpu_memory_bytes}")
        if self.flashinfer_sampler not in (None, True, False):
            raise UserError(f"flashinfer_sampler must be yes or no, got {self.flashinfer_sampler!r}")
        if self.compile_cache not in (None, "cold", "warm"):
            raise UserError(f"--compile-cache must be cold or warm, got {self.compile_cache!r}")
        if self.interconnect is not None:
            A.parse(self.interconnect.kind)
        cc = self.gpu_capability
        if cc is not None and (not isinstance(cc, tuple) or len(cc) != 2
                               or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in cc)):
            raise UserError(f"gpu_capability must be CUDA's (major, minor), e.g. (9, 0), or None; got {cc!r}")
        if self.usage not in ("serve", "llm"):
            raise UserError(f"unknown usage {self.usage!r}: serve or llm")
        return self


def model_dtype(config: dict, asked: str, quant: VllmQuant) -> tuple[str, str | None]:
    """vLLM's dtype (``config/model.py``, ``_get_and_verify_dtype``): ``auto`` is the config's dtype, a
    float32 checkpoint runs in bfloat16 (0.9 on: the first of bfloat16 / float16 the GPU supports),
    GPTQ / AWQ in float16. Returns (dtype, a note)."""
    from ..quant import config_dtype

    asked = DTYPES[str(asked).lower()]
    if asked != "auto":
        return asked, None
    if quant.dtype_forced:
        return quant.dtype_forced, f"{quant.method} runs in {quant.dtype_forced} (vLLM's default for it)"
    own = config_dtype(config)
    if own == "float32":
        return "bfloat16", "the checkpoint is float32: vLLM's dtype auto runs it in bfloat16"
    return own, None


def estimate_vllm(model: str | ModelSource, args: VllmArgs | None = None, *, use_cache: bool = True,
                  progress=None, offsets: dict[str, int] | None = None) -> VllmEstimate:
    """Predict what ``vllm serve MODEL <args>`` logs at startup (the module's doc). ``offsets``
    ({"activation_bytes", "non_torch_bytes"}) move those terms on every rank: a machine's learned
    correction (:mod:`vramcal.calibrate.vllm_corrections`)."""
    offsets = offsets or {}
    args = (args or VllmArgs()).validated()
    source = model if isinstance(model, ModelSource) else resolve_model(model)
    v, v_source = V.resolve_version(args.vllm_version)
    if args.gpu_memory_bytes is None:
        raise UserError("no GPU here to read the total memory from: give --gpu-memory, e.g. --gpu-memory 80GiB "
                        "(each GPU's total as the driver reports it; an H100 80GB reports 79.19 GiB)")
    if args.kv_cache_memory_bytes is not None and not V.kv_memory_override(v):
        raise UserError(f"--kv-cache-memory exists from vLLM 0.10.2 on, not in {V.fmt_version(v)}")
    quant = resolve_quant(source.config, args.quantization)
    if quant.scheme == "mxfp4":
        quant = replace(quant, mxfp4=X.backend(v, args.gpu_name, args.gpu_capability, args.mxfp4_backend))
    elif args.mxfp4_backend is not None:
        raise UserError("--mxfp4-backend is for an MXFP4 checkpoint (gpt-oss); this one is not: drop it")
    dtype, dtype_note = model_dtype(source.config, args.dtype, quant)
    from .shapes import cached_params

    # the installed transformers' model: its parameters, and its config with the defaults a checkpoint
    # leaves out filled in (Gemma 3's vocabulary): what vLLM's own config class fills as well
    params, filled = cached_params(source, dtype, use_cache=use_cache, progress=progress)
    arch = arch_of(source.config, filled)
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    check_tp(arch, tp, pp)
    el = DTYPE_BYTES[dtype]
    kv_bytes = KV_DTYPES[str(args.kv_cache_dtype).lower()] or el
    max_len = args.max_model_len or arch.derived_max_len
    if args.max_model_len is not None and args.max_model_len > arch.derived_max_len and not args.allow_long_max_model_len:
        raise UserError(M.too_long_config_error(args.max_model_len, arch.derived_max_len)
                        + " (vLLM refuses it; --allow-long-max-model-len is its VLLM_ALLOW_LONG_MAX_MODEL_LEN=1)")
    total = args.gpu_memory_bytes
    d = V.scheduler_defaults(v, total, args.gpu_name, args.usage)
    # an unset max_num_seqs is the default, at most max_num_batched_tokens (engine/arg_utils.py,
    # _set_default_args); a given one below it is refused by VllmArgs, as vLLM's scheduler config does
    seqs = args.max_num_seqs or min(d.max_num_seqs, args.max_num_batched_tokens or d.max_num_seqs)
    mnbt = args.max_num_batched_tokens or min(d.max_num_batched_tokens, seqs * max_len)
    if args.max_num_batched_tokens is None and mnbt < seqs:
        mnbt = max(mnbt, seqs)
    block = args.block_size or 16
    # the tokens a sliding-window / chunked layer keeps beyond its window: one batch, or every batch in flight
    inflight = V.in_flight_tokens(v, mnbt, pp)
    hybrid, hybrid_why = _hybrid(arch, text_config(source.config), filled, tp, v, el, kv_bytes, max_len, args)
    if hybrid is not None:
        block = hybrid.block_size

    weights = rank_weights(params, arch, tp, pp, el, quant)
    specs = K.layer_specs(arch, tp, kv_bytes, block, v, hybrid)
    util = V.default_utilization(v) if args.gpu_memory_utilization is None else float(args.gpu_memory_utilization)
    requested = int(total * util)
    ic = A.resolve(args.interconnect, args.gpu_name) if tp > 1 else None
    car = A.custom_all_reduce(v, tp, ic, args.disable_custom_all_reduce) if ic else None
    fusion = F.fusion_workspace(v, tp, pp, ic.kind, args.gpu_name, args.gpu_capability, arch.hidden, el, mnbt,
                                args.enforce_eager) if ic else None
    non_torch, non_torch_why = V.non_torch_default(v, tp, pp, ic.kind if ic else "nvlink",
                                                   car.non_torch_bytes(v) if car else 0,
                                                   fusion.device_bytes if fusion else 0)
    non_torch = max(non_torch + offsets.get("non_torch_bytes", 0), 0)
    subtract_graphs = V.graphs_off_budget(v, source.config.get("architectures"), bool(arch.experts),
                                          hybrid is not None, args.enforce_eager)
    v2_runner = V.v2_runner_default(v, source.config.get("architectures"), bool(arch.experts), hybrid is not None)
    captures = None if args.enforce_eager else V.cudagraph_captures(v, seqs, mnbt, args.gpu_capability)
    v2_graphs = v2_runner and V.v2_runner_estimates_graphs(v)  # the V2 runner's own estimate (0.29 on)
    cold = V.compile_benchmarks_kernels(v, args.enforce_eager, args.compile_cache)
    compiles = V.compile_benchmarks_kernels(v, args.enforce_eager)  # whether the cache's state matters at all
    ranks: list[VllmRank] = []
    rank_specs: list[list[K.LayerSpec]] = []
    peaks: list[str] = []  # which part of each rank's profile peaks
    for i, w in enumerate(weights):
        lo, hi = w.layers
        act = activation(arch, tp, w.pp_rank, pp, el, mnbt, seqs, v, args.flashinfer_sampler, cold, v2_runner)
        peaks.append(act.which)
        act_bytes = max(act.total + offsets.get("activation_bytes", 0), 0)
        graphs = cuda_graph_bytes(hi - lo, args.enforce_eager, captures, v2_graphs)
        if args.kv_cache_memory_bytes is not None:
            avail = args.kv_cache_memory_bytes
        else:
            avail = requested - w.bytes - act_bytes - non_torch - (graphs if subtract_graphs else 0)
        mine = K.flat(specs[lo:hi])
        g = K.grouping(mine, v)
        blocks = max(avail, 0) // g.bytes_per_block if any(s is not None for s in mine) else 0
        rank_specs.append(mine)
        ranks.append(VllmRank(i, w.tp_rank, w.pp_rank, [lo, hi], w.bytes, act_bytes, non_torch, graphs, avail, blocks,
                              0, dict(w.groups)))
    limiting = min(ranks, key=lambda r: (r.num_blocks, r.available_bytes))
    num_blocks = limiting.num_blocks
    for r, mine in zip(ranks, rank_specs):
        r.kv_cache_bytes = num_blocks * K.grouping(mine, v).bytes_per_block
    g = K.grouping(rank_specs[limiting.rank], v)
    upper = max(max_len, arch.derived_max_len)
    startup_used = CONTEXT_BYTES + (NCCL_INIT_BYTES if tp * pp > 1 else 0)
    # a pinned KV size skips vLLM's profiling check: what the rank holds is its context, weights, activation
    # peak, non-torch memory, graphs and the pinned cache, and vLLM runs out of memory where that is more
    # than the GPU (it does not fall back on the utilization)
    over = pinned_over(ranks, total, startup_used) if args.kv_cache_memory_bytes is not None else None
    fit_len = 0 if over else min(K.largest_length(s, r.available_bytes, upper, block, inflight)
                                 if r.available_bytes > 0 else 0 for r, s in zip(ranks, rank_specs))
    error = over
    failing = [(r, s) for r, s in zip(ranks, rank_specs)
               if r.available_bytes <= 0 or K.needed_bytes(s, max_len, block, inflight) > r.available_bytes]
    if failing and error is None:
        r, s = failing[0]
        if r.available_bytes <= 0:
            error = M.no_memory_error(v)
        else:
            error = M.too_long_error(v, max_len, K.needed_bytes(s, max_len, block, inflight), r.available_bytes,
                                     K.largest_length(s, r.available_bytes, max_len, block, inflight))
    fits = error is None
    tokens_blocks = num_blocks * block
    conc = K.max_concurrency(g, num_blocks, max_len, block, inflight, v, tokens_blocks) if fits else 0.0
    tokens = K.reported_tokens(g, num_blocks, block, conc, max_len, v) if fits else 0
    notes = [n for n in (dtype_note,) if n]
    if args.compile_cache is not None and not compiles:
        notes.append(f"--compile-cache {args.compile_cache} changes nothing here: "
                     + ("--enforce-eager compiles nothing" if args.enforce_eager else
                        f"vLLM {V.fmt_version(v)} runs no compile-time kernel benchmark (from 0.12.0)"))
    if any(k == "sliding" for k in arch.layer_kinds) and not V.hybrid_groups(v):
        notes.append(f"vLLM {V.fmt_version(v)} sizes sliding-window layers as full attention (no hybrid manager)")
    if hybrid is not None:
        notes.append(f"hybrid model: attention block {hybrid.block_size} tokens so one attention page "
                     f"({hybrid.page_bytes:,} B) holds a state page ({hybrid.state_bytes:,} B, padded "
                     f"{hybrid.padding_pct:.2f}%); Mamba prefix-caching mode {hybrid.mode}")
    if "mla" in arch.layer_kinds and args.block_size is None:
        notes.append("MLA with block size 16 (0.19 on Hopper); FlashMLA (0.11-era default on Hopper) forces 64: "
                     "pass --block-size 64 for it")
    if source.config.get("vision_config") is not None:
        notes.append("the multimodal encoder's profiling run is not modelled: the activation term is the text model's")
    if requested > total - startup_used and args.kv_cache_memory_bytes is None:
        notes.append(f"gpu_memory_utilization {util} asks for {requested / GIB:.2f} GiB of "
                     f"{total / GIB:.2f} GiB: about {startup_used / GIB:.2f} GiB is in use before vLLM starts, so its "
                     "startup check (free memory below the requested) would likely refuse it")
    lines = _log_lines(v, limiting, tokens, max_len, conc, fits, error, subtract_graphs, v2_runner, total, util)
    if hybrid is not None and hybrid.block_size != (args.block_size or 16):
        lines.insert(0, f"Setting attention block size to {hybrid.block_size} tokens to ensure that attention page "
                        "size is >= mamba page size.")
        if hybrid.page_bytes != hybrid.state_bytes:
            lines.insert(1, f"Padding mamba page size by {hybrid.padding_pct:.2f}% to ensure that mamba page size and "
                            "attention page size are exactly equal.")
    sampler_words = f"the V2 model runner, whose sampler pass is {V.v2_sampler_pass(v)}; " if v2_runner else ""
    graph_scale = (f"scaled to {captures.why}, " if captures
                   else "as fitted (capture sizes before 0.11 not modelled), ")
    methods = {
        "weights": "vLLM's layout of the installed transformers' model on the meta device (docs/vllm.md)",
        "activation": f"profile-run model fitted to 0.15-0.19 logs ({peaks[limiting.rank]} peak; "
                      f"{sampler_words}"
                      f"{_compile_method(cold, compiles, limiting.pp_rank)}; "
                      f"max_num_batched_tokens {mnbt}, max_num_seqs {seqs}: "
                      f"{d.why if args.max_num_seqs is None and args.max_num_batched_tokens is None else 'as given'})",
        "non_torch": f"default per setup: {non_torch_why}",
        "cuda_graphs": ("not captured (--enforce-eager)" if args.enforce_eager else
                        (f"{V2_GRAPH_METHOD}, fitted to 0.29 T4 logs: a base + a cost per graph and "
                         "layer, " if v2_graphs else "default fitted to 0.19 H100 logs, ")
                        + graph_scale
                        + (
                            "subtracted from the KV budget (0.20 on)" if subtract_graphs
                            else "outside the KV budget (before 0.20)" if not V.cuda_graphs_subtracted(v)
                            else "outside the KV budget: the V2 model runner of 0.22-0.28 estimates none")),
        "budget": f"vLLM {V.fmt_version(v)} ({v_source}): {V.budget_family(v)} accounting",
    }
    if hybrid is not None:
        methods["kv_cache"] = f"hybrid pages (docs/vllm.md): {hybrid_why}"
    if ic is not None:
        methods["interconnect"] = (f"{ic.kind} ({ic.source}); custom all-reduce {car.why}; all-reduce + RMSNorm "
                                   f"fusion {'on: ' if fusion.on else 'off: '}{fusion.why}")
    if quant.mxfp4 is not None:
        methods["mxfp4"] = f"MXFP4 experts on the {quant.mxfp4.name} backend: {quant.mxfp4.why}"
    return VllmEstimate(
        version=V.fmt_version(v), version_source=v_source, gpu_memory_bytes=total,
        gpu_memory_utilization=util, requested_bytes=requested,
        weights_bytes=limiting.weights_bytes, activation_bytes=limiting.activation_bytes,
        non_torch_bytes=limiting.non_torch_bytes, cuda_graph_bytes=limiting.cuda_graph_bytes,
        cuda_graph_subtracted=subtract_graphs, kv_cache_bytes=limiting.available_bytes, kv_cache_tokens=tokens,
        block_size=block, num_blocks=num_blocks, max_concurrency=round(conc, 4), max_model_len=max_len,
        max_model_len_fit=fit_len, fits=fits, tensor_parallel_size=tp, pipeline_parallel_size=pp,
        max_num_seqs=seqs, max_num_batched_tokens=mnbt, dtype=dtype,
        kv_cache_dtype=str(args.kv_cache_dtype).lower(), quantization=quant.label, enforce_eager=args.enforce_eager,
        page_bytes=g.page_bytes, block_bytes=g.bytes_per_block, hybrid_groups=g.num_groups, limiting_rank=limiting.rank, error=error,
        log_lines=lines, methods=methods, notes=notes, ranks=ranks if len(ranks) > 1 else None,
        interconnect=ic.kind if ic else None, custom_all_reduce=car.on if car else None,
        compile_cache=("cold" if cold else "warm") if compiles else None,
        cuda_graph_piecewise=captures.piecewise if captures else None,
        cuda_graph_full=captures.full if captures else None)


def _compile_method(cold: bool, compiles: bool, pp_rank: int) -> str:
    """The activation method's words for the compile benchmark (only the first stage runs it)."""
    if not compiles:
        return "no compile benchmark"
    if not cold:
        return "a warm start: the compiled graphs load from the cache, no benchmark"
    if pp_rank:
        return "a cold compile, whose benchmark is on the first stage, not this limiting one"
    return "priced for a cold compile"


def _hybrid(arch, tc: dict, filled: dict | None, tp: int, v, el: int, kv_bytes: int, max_len: int,
            args: VllmArgs) -> tuple[H.Unified | None, str]:
    """The unified page of a model with Mamba / linear-attention layers (:mod:`.mamba`), or None."""
    if "mamba" not in arch.layer_kinds and "parallel" not in arch.layer_kinds:
        for value, flag in ((args.mamba_cache_dtype, "--mamba-cache-dtype"),
                            (args.mamba_ssm_cache_dtype, "--mamba-ssm-cache-dtype")):
            if value != "auto":
                raise UserError(f"{flag} is for a hybrid Mamba / linear-attention model; this one has none: drop it")
        return None, ""
    if v < (0, 10, 1):
        raise UserError(f"vLLM {V.fmt_version(v)} runs hybrid Mamba models on its V0 engine, which vramcal does not "
                        "model: give --vllm-version 0.10.1 or newer")
    if arch.architecture == "Qwen3NextForCausalLM" and v < (0, 10, 2):
        raise UserError(f"Qwen3-Next needs vLLM 0.10.2 or newer (qwen3_next.py), not {V.fmt_version(v)}")
    if arch.architecture in ("JambaForCausalLM", "FalconH1ForCausalLM") and v < (0, 10, 2):
        raise UserError(f"{arch.architecture} on the V1 engine is modelled from vLLM 0.10.2 (the oldest read with it), "
                        f"not {V.fmt_version(v)}: give --vllm-version 0.10.2 or newer")
    if "mla" in arch.layer_kinds or any(k in ("sliding", "chunked") for k in arch.layer_kinds):
        raise UserError(f"{arch.architecture} mixes Mamba layers with MLA or windowed attention: not modelled")
    if tc is not None and filled:
        tc = {**text_config(filled), **tc}
    shape = H.state_shape(arch.architecture, tc, tp)
    conv_b, ssm_b, why = H.state_dtype_bytes(arch.architecture, tc, v, el, args.mamba_cache_dtype,
                                             args.mamba_ssm_cache_dtype)
    state = shape.conv_elems * conv_b + shape.ssm_elems * ssm_b
    attn_1 = 2 * max(1, arch.kv_heads // tp) * arch.head_dim * kv_bytes
    mode = H.cache_mode(v, arch.architecture, args.enable_prefix_caching)
    u = H.unify(state, attn_1, mode, shape.chunk_size, max_len, args.block_size, v)
    return u, (f"{shape.family} state {shape.conv_elems:,} conv + {shape.ssm_elems:,} state elements per rank "
               f"({why}) = {state:,} B, padded to the attention page of {u.block_size} tokens x {attn_1:,} B")


def pinned_over(ranks: list[VllmRank], total: int, startup_used: int) -> str | None:
    """With ``--kv-cache-memory-bytes``: why the first rank whose whole holding (the CUDA context, weights,
    activation peak, non-torch memory, CUDA graphs and the pinned cache) is more than the GPU's total
    cannot start, or None when every rank's holding fits."""
    for r in ranks:
        held = startup_used + r.weights_bytes + r.activation_bytes + r.non_torch_bytes + r.cuda_graph_bytes
        if held + r.available_bytes > total:
            return (f"--kv-cache-memory-bytes {r.available_bytes / GIB:.2f} GiB does not fit beside the rest: the "
                    f"weights ({r.weights_bytes / GIB:.2f} GiB), the activation peak, CUDA graphs, non-torch memory "
                    f"and the CUDA context take {held / GIB:.2f} GiB of the GPU's {total / GIB:.2f} GiB, so at most "
                    f"{max(total - held, 0) / GIB:.2f} GiB is left for the cache; vLLM skips its profiling check "
                    "for this flag and runs out of memory allocating it")
    return None


def _log_lines(v, r: VllmRank, tokens: int, max_len: int, conc: float, fits: bool, error: str | None,
               subtract_graphs: bool, v2_runner: bool, total: int, util: float) -> list[str]:
    out = [M.loading_line(v, r.weights_bytes)]
    if V.cuda_graph_estimate_logged(v) and r.cuda_graph_bytes and not v2_runner:
        out.append(M.graph_estimate_line(v, r.cuda_graph_bytes))
    non_kv = r.weights_bytes + r.activation_bytes + r.non_torch_bytes
    prof = M.profile_line(v, non_kv, r.activation_bytes, r.non_torch_bytes, r.weights_bytes)
    if prof:
        out.append("(DEBUG) " + prof)
    avail = M.available_line(v, r.available_bytes)
    if avail:
        out.append(avail)
    share = M.graph_utilization_line(v, r.cuda_graph_bytes, total, util) if subtract_graphs else None
    if share:
        out.append(share)
    if fits:
        out += M.kv_lines(v, tokens, max_len, conc)
    elif error:
        out.append("ValueError: " + error)
    return out


def as_estimate(source: ModelSource, v: VllmEstimate, version_hash: str = ""):
    """The vLLM estimate as an :class:`~vramcal.estimator.result.Estimate` (what ``--json`` writes and
    runs record): the limiting rank's GPU as stages, the terms under ``vllm``.

    Stages of that GPU as NVML will show them: ``load_peak`` the CUDA context (and NCCL's communicators
    with tp x pp > 1, made before vLLM's first snapshot) plus the weights; from ``post_load`` on, the
    context plus ``total x utilization`` -- the KV cache fills what the profile left, the sampler warm-up
    takes the activation's share back -- plus the CUDA graphs where they are outside the budget (before
    0.20). A run that does not start has only ``load_peak`` as the figure it reaches."""
    from ...versions import VRAMCAL_VERSION
    from ...workload import NEW_TOKENS, STAGES
    from ..result import Estimate

    r = v.ranks[v.limiting_rank] if v.ranks else None
    kv_bytes = r.kv_cache_bytes if r else v.num_blocks * v.block_bytes
    groups = dict(r.weights_groups) if r else {}
    context = CONTEXT_BYTES + (NCCL_INIT_BYTES if v.tensor_parallel_size * v.pipeline_parallel_size > 1 else 0)
    held = v.requested_bytes + (0 if v.cuda_graph_subtracted else v.cuda_graph_bytes)
    if not v.fits:
        held = v.weights_bytes + v.activation_bytes + v.non_torch_bytes
    stages = {"load_peak": context + v.weights_bytes}
    stages.update({k: max(context + held, stages["load_peak"]) for k in STAGES[1:]})
    allocated = {"load_peak": v.weights_bytes}
    allocated.update({k: v.weights_bytes + kv_bytes for k in STAGES[1:]})
    peak_stage = max(STAGES, key=lambda k: stages[k])
    components = {"weights": v.weights_bytes, "kv_cache": kv_bytes, "activations": v.activation_bytes,
                  "runtime": context + v.non_torch_bytes + v.cuda_graph_bytes}
    breakdown = {"weights": v.weights_bytes, "kv_cache": kv_bytes if v.fits else 0}
    breakdown["runtime"] = stages[peak_stage] - sum(breakdown.values())
    tc = source.config.get("text_config") if isinstance(source.config.get("text_config"), dict) else source.config
    prompt = max(v.max_model_len - NEW_TOKENS, 1)
    warnings = [] if v.fits else [v.error or "vLLM would not start"]
    return Estimate(
        model=source.name, architecture=(source.config.get("architectures") or tc.get("architectures") or ["?"])[0],
        quant=v.quantization, quant_implementation=f"vLLM {v.quantization}", dtype=v.dtype, ctx=prompt + NEW_TOKENS,
        batch=1, kv_dtype=v.kv_cache_dtype, attn="vllm", cache="paged", device="cuda", components=components,
        stages=stages, allocated=allocated, peak=stages[peak_stage], approximate=False, methods=dict(v.methods),
        weights_breakdown=groups, kv_breakdown={"paged": kv_bytes}, formula=None, notes=list(v.notes),
        runtime_source=f"vLLM {v.version} startup (docs/vllm.md)", config_hash=source.config_hash, prompt=prompt,
        new_tokens=NEW_TOKENS, peak_stage=peak_stage, peak_breakdown=breakdown, warnings=warnings,
        mode="vllm", estimator_model=MODEL_ID, vramcal_version=VRAMCAL_VERSION, vllm=v, revision=source.revision)
