"""What differs between vLLM versions, as data keyed by version ranges.

Every rule names the vLLM file it was read from and the released versions where it holds (the wheels
on PyPI were read for 0.8.0 ... 0.33.0; /work/research/vllm/model.md is the reading, docs/vllm.md the
summary). "From X" means the first released version among those read where the behaviour is present;
it may have landed in an unread patch release before it. Pure data and arithmetic: no torch, no vLLM.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ...errors import UserError

Version = tuple[int, int, int]

OLDEST: Version = (0, 8, 0)
NEWEST: Version = (0, 33, 0)  # the newest release read; the default without an installed vLLM

_VERSION = re.compile(r"v?(\d+)\.(\d+)(?:\.(\d+))?(?:[.+-].*)?$")


def parse_version(text: str, flag: str = "--vllm-version") -> Version:
    """``0.19``, ``0.19.1``, ``v0.19.0``, ``0.11.0+582e4e37.nv25.11`` -> (0, 19, 0) ...; outside the
    modelled range (0.8.0 ... the newest read) is refused in one line."""
    m = _VERSION.match(str(text).strip())
    if not m:
        raise UserError(f"{flag} {text!r} is not a version: write it like 0.19 or 0.19.1")
    v = (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))
    if not OLDEST <= v <= NEWEST:
        raise UserError(f"{flag} {fmt_version(v)} is outside the versions vramcal models "
                        f"({fmt_version(OLDEST)} to {fmt_version(NEWEST)}): docs/vllm.md says what each version does")
    return v


def fmt_version(v: Version) -> str:
    return ".".join(str(x) for x in v)


def installed_version() -> str | None:
    """The installed vLLM's version from its distribution metadata (vLLM itself is never imported here)."""
    from ...versions import dist_info_versions

    found = dist_info_versions(["vllm"]).get("vllm")
    if found:
        return found
    try:
        from importlib import metadata

        return metadata.version("vllm")
    except Exception:  # noqa: BLE001 -- not installed (PackageNotFoundError) or an unreadable install
        return None


def resolve_version(text: str | None) -> tuple[Version, str]:
    """The version asked for, else the installed vLLM's, else the newest modelled; and where it came from."""
    if text is not None:  # an empty one is bad input, not "the default"
        return parse_version(text), "--vllm-version"
    found = installed_version()
    if found:
        try:
            return parse_version(found, "the installed vLLM"), "the installed vLLM"
        except UserError:
            pass
    return NEWEST, "the newest version modelled (no vLLM installed here)"


# ------------------------------------------------------------------------------ the memory budget

def budget_family(v: Version) -> str:
    """How ``determine_available_memory`` (``v1/worker/gpu_worker.py``) turns the profile into KV memory.

    - ``peak`` 0.8.0-0.9.0: total x util - (torch peak incl. weights) - max(0, non-torch);
    - ``profile`` 0.9.2-0.26: total x util - weights - torch peak increase - non-torch increase
      (``memory_profiling`` in ``utils/__init__.py``, ``utils/mem_utils.py`` from 0.14);
    - ``consumed`` 0.27-0.33: total x util - (free at init - free after the profile) - (torch peak -
      torch allocated): the same terms counted at device level (``utils/mem_utils.py``).
    """
    if v < (0, 9, 2):
        return "peak"
    if v < (0, 27, 0):
        return "profile"
    return "consumed"


def cuda_graphs_subtracted(v: Version) -> bool:
    """Whether the CUDA-graph estimate comes off the KV budget by default: ``profile_cudagraph_memory``
    exists from 0.18.1 (``v1/worker/gpu_model_runner.py``); ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``
    defaults to 0 in 0.18.1 and 0.19.1 (logged only) and to 1 from the 0.20.2 wheel (``envs.py``)."""
    return v >= (0, 20, 0)


# the architectures that default to the V2 model runner (``config/vllm.py``, DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES)
_V2_DEFAULT_0_22 = frozenset({"Qwen3ForCausalLM"})
_V2_DEFAULT_0_24 = frozenset({"Qwen3ForCausalLM", "DeepseekV2ForCausalLM", "Qwen2MoeForCausalLM", "GraniteMoeForCausalLM",
                              "LlamaForCausalLM", "MistralForCausalLM"})
_V2_DEFAULT_MOE_0_26 = frozenset({"DeepseekV2ForCausalLM", "GraniteMoeForCausalLM", "Qwen2MoeForCausalLM"})


def v2_runner_default(v: Version, architectures, moe: bool, hybrid: bool) -> bool:
    """Whether vLLM runs the model on its V2 model runner by default (``VllmConfig.use_v2_model_runner``,
    ``config/vllm.py``): opt-in only up to 0.20 (``VLLM_USE_V2_MODEL_RUNNER`` defaults to 0; 0.20.2 read);
    Qwen3ForCausalLM from 0.22 (0.22.0 read; 0.21 not read); six architectures, Llama, Mistral and Qwen3
    among them, in 0.24 (0.24.0 read; 0.25 not read, taken as 0.24); every dense, non-hybrid generating
    model and three MoE families from 0.26 (0.26.0, 0.27.1, 0.28.0 read); every model from 0.29, MoE and hybrid
    ones included: ``use_v2_model_runner`` no longer asks ``_is_default_v2_model_runner_model`` (0.29.0, 0.30.0,
    0.31.0, 0.32.0, 0.33.0 read). vLLM falls back to V1 for features the V2 runner lacks
    (``_get_v2_model_runner_unsupported_features``: speculative methods, custom logits processors, dual batch
    overlap, ...) and on ROCm in 0.29-0.31 for a few DeepSeek / GLM architectures
    (``ROCM_DEFAULT_MRV1_ARCHITECTURES``), neither of which this models."""
    arch = set(architectures or ())
    if v < (0, 22, 0):
        return False
    if v >= (0, 29, 0):
        return True
    if v < (0, 24, 0):
        return bool(arch & _V2_DEFAULT_0_22)
    if v < (0, 26, 0):
        return bool(arch & _V2_DEFAULT_0_24)
    if hybrid:
        return False
    return not moe or bool(arch & _V2_DEFAULT_MOE_0_26)


def v2_runner_estimates_graphs(v: Version) -> bool:
    """The V2 model runner's ``profile_cudagraph_memory`` returns 0 up to 0.28 (``v1/worker/gpu/model_runner.py``,
    0.20.2-0.28.0 read: "It is TBD whether we keep this API or not"), so nothing comes off the KV budget for
    CUDA graphs there; from 0.29 it estimates as the V1 runner does (0.29.0, 0.30.0, 0.31.0 read)."""
    return v >= (0, 29, 0)


V2_SAMPLER_LOGITS = "the logits alone"
V2_SAMPLER_FP32 = "the logits and their float32 copy"
V2_SAMPLER_WARMUP = "a second pass with every sampling parameter on"


def v2_sampler_pass(v: Version) -> str:
    """What the V2 model runner's dummy sampler run (``_dummy_sampler_run``, ``v1/worker/gpu/model_runner.py``)
    holds. It computes the logits (``compute_logits``, the model dtype) and samples with a Gumbel-max Triton kernel
    (a value per vocabulary block): none of the V1 sampler's temporaries. ``Sampler.apply_sampling_params``
    (``v1/worker/gpu/sample/sampler.py``) copies the logits to float32 first up to 0.26, for every request (0.22.1,
    0.24.0 read); from 0.27 only for requests that need logits processing, which no dummy request does: their
    states are the defaults (0.27.1, 0.28.0, 0.29.0, 0.30.0, 0.32.0 read). 0.33.0
    runs the sampler a second time after registering ``SamplingParams.for_sampler_warmup()`` for every dummy
    request -- temperature, top-k / top-p (Triton), min-p, three penalties, min_tokens, logit bias, bad words,
    logprobs and prompt logprobs, watermarking -- so that pass holds the float32 logits and its temporaries. It is
    priced with V1's fitted term, an assumption: V1's dummy run has no logprobs, penalties or bad words and its
    kernels differ, so the 0.33 figure may be high or low; no published 0.33 log tests it."""
    if v < (0, 27, 0):
        return V2_SAMPLER_FP32
    if v < (0, 33, 0):
        return V2_SAMPLER_LOGITS
    return V2_SAMPLER_WARMUP


def graphs_off_budget(v: Version, architectures, moe: bool, hybrid: bool, enforce_eager: bool) -> bool:
    """Whether the CUDA-graph estimate comes off the KV budget for this model: from 0.20, unless eager, and
    not on a V2 model runner that estimates nothing (:func:`v2_runner_default`, :func:`v2_runner_estimates_graphs`)."""
    if enforce_eager or not cuda_graphs_subtracted(v):
        return False
    return v2_runner_estimates_graphs(v) or not v2_runner_default(v, architectures, moe, hybrid)


def cuda_graph_estimate_logged(v: Version) -> bool:
    return v >= (0, 18, 0)


def kv_memory_override(v: Version) -> bool:
    """``--kv-cache-memory`` (``cache_config.kv_cache_memory_bytes``) exists from 0.10.2."""
    return v >= (0, 10, 2)


def hybrid_groups(v: Version) -> bool:
    """From 0.9.2 the hybrid KV-cache manager keeps sliding-window layers as their own groups
    (``v1/core/kv_cache_utils.py``); before, every sliding-window layer is sized as full attention
    (``unify_hybrid_kv_cache_specs``)."""
    return v >= (0, 9, 2)


def group_size_factor(v: Version) -> float | None:
    """``_get_kv_cache_groups_uniform_page_size`` (``v1/core/kv_cache_utils.py``; ``kv_cache_planning.py`` in
    0.33): the group size is the smallest kind's layer count, or the largest's when that is under this factor
    times it (1.25 in 0.12-0.17, 1.5 from 0.18; 0.11.0 has no such rule)."""
    if v < (0, 12, 0):
        return None
    return 1.25 if v < (0, 18, 0) else 1.5


def in_flight_tokens(v: Version, max_num_batched_tokens: int, pp: int) -> int:
    """The batched tokens a sliding-window or chunked-local layer is sized for beyond its window
    (``SlidingWindowSpec`` / ``ChunkedLocalAttentionSpec.max_admission_blocks_per_request``,
    ``v1/kv_cache_interface.py``): ``max_num_batched_tokens`` up to 0.25; from 0.26
    ``VllmConfig.max_in_flight_tokens`` = ``max_concurrent_batches x max_num_batched_tokens``
    (``config/vllm.py``), with async scheduling on by default: 2 batches on one pipeline stage (V1 and V2
    model runners alike), ``pp`` with the V1 runner across stages (the V2 runner's ``pp + 1`` is not
    modelled; async scheduling is off with some speculative methods, not modelled either)."""
    if v < (0, 26, 0):
        return max_num_batched_tokens
    return max_num_batched_tokens * (2 if pp <= 1 else pp)


def tokens_rule(v: Version) -> str:
    """How "GPU KV cache size: N tokens" is computed (``v1/core/kv_cache_utils.py``):
    ``blocks`` num_blocks x block_size (up to 0.9.0, and uniform models up to 0.19); ``groups``
    num_blocks // num_groups x block_size (hybrid models 0.9.2-0.19); ``concurrency``
    int(max_concurrency x max_model_len) (0.20 on)."""
    if v < (0, 20, 0):
        return "blocks"
    return "concurrency"


def concurrency_rule(v: Version) -> str:
    """"Maximum concurrency": ``tokens`` tokens / max_model_len (up to 0.9.0); ``layers``
    num_blocks / cdiv(L x sum_groups max_memory_usage, L x page) (0.9.2-0.26,
    ``get_max_concurrency_for_kv_cache_config``); ``groups`` num_blocks / sum_groups
    cdiv(max_memory_usage, page) (0.27 on)."""
    if v < (0, 9, 2):
        return "tokens"
    if v < (0, 27, 0):
        return "layers"
    return "groups"


def sampler_sorts(v: Version, flashinfer: bool | None = None) -> bool:
    """Up to 0.16 top-k/top-p sort the whole vocabulary in PyTorch for the dummy sampler run; from
    0.17.0 a Triton kernel does it for batches of 8 and more (``v1/sample/ops/topk_topp_sampler.py``).
    ``TopKTopPSampler`` takes FlashInfer's sampling kernel instead when FlashInfer is installed and
    usable on the GPU (``flashinfer_sampler_supported``: "Using FlashInfer for top-p & top-k sampling."
    in the log; "FlashInfer is not available. Falling back to the PyTorch-native implementation" when it
    is not); that kernel samples without sorting. ``flashinfer`` None: not known, the sort is priced
    (the larger activation, so the smaller KV cache)."""
    return v < (0, 17, 0) and not flashinfer


def compile_benchmarks_kernels(v: Version, enforce_eager: bool = False, compile_cache: str | None = None) -> bool:
    """Whether the profiled region holds Inductor's compile-time kernel benchmarks, which run on random
    copies of each kernel's inputs (:func:`.budget.activation` prices them). From 0.12.0
    ``CompilationConfig.__post_init__`` (``config/compilation.py``; 0.12.0, 0.13.0, 0.15.0, 0.17.1, 0.19.0,
    0.24.0, 0.28.0, 0.29.0, 0.31.0 and 0.33.0 read) sets Inductor's ``combo_kernels`` and
    ``benchmark_combo_kernel`` whenever torch is 2.9 or newer, which 0.12.0 pins (0.11.0 pins
    torch 2.8 and sets neither; 0.11.1 and 0.11.2, which may already pin torch 2.9, are not read and are priced
    as 0.11.0; 0.33.0 leaves the benchmark off under Inductor's ``deterministic``, which
    is off by default). No version read resets the peak after the compile. The compile runs in the first forward, inside ``profile_run`` under ``memory_profiling``, and
    only when nothing is cached: a warm start loads the compiled artifact ("Directly load AOT compilation"
    in 0.28's ``compilation/decorators.py``) and Inductor's ``.kernel_perf`` files skip the benchmark.
    ``--enforce-eager`` compiles nothing. ``compile_cache`` None: not known, the cold start is priced (the
    larger activation, so the smaller KV cache: every new shape or flag is a cold start)."""
    return v >= (0, 12, 0) and not enforce_eager and compile_cache != "warm"


def default_utilization(v: Version) -> float:
    """``CacheConfig.gpu_memory_utilization``'s default (``config/cache.py``): 0.9 up to 0.19 (0.17.1 and
    0.19.1 read), 0.92 from 0.20.0 (0.20.0, 0.20.2, 0.24.0, 0.27.1 and 0.31.0 read)."""
    return 0.92 if v >= (0, 20, 0) else 0.9


def usage_peak_includes_graphs(v: Version) -> bool:
    """Whether the "Actual usage is ... GiB for peak activation" figure (``gpu_worker.py``, the line after
    the graph capture) includes the CUDA-graph estimate: from 0.27 ``peak_activation_memory`` is
    ``transient_peak_headroom + cudagraph_memory_estimate_applied`` (0.27.1 and 0.31.0 read); up to 0.26
    it is ``torch_peak_increase`` alone (0.20.2, 0.24.0, 0.25.0 and 0.26.0 read). The same versions
    change the line's wording from "for weight" to "for consumed memory (weights + non-torch)"."""
    return v >= (0, 27, 0)


# ------------------------------------------------------------------------------ CUDA-graph captures

@dataclass(frozen=True)
class Captures:
    """The CUDA graphs vLLM captures at startup: one PIECEWISE graph set per capture size (mixed batches) and one
    FULL graph per size a decode batch of ``max_num_seqs`` reaches (``FULL_AND_PIECEWISE``, the default)."""
    piecewise: int
    full: int
    largest: int  # the largest capture size, tokens
    why: str

    @property
    def graphs(self) -> int:
        return self.piecewise + self.full


def cudagraph_captures(v: Version, max_num_seqs: int, max_num_batched_tokens: int,
                       capability: tuple[int, int] | None = None) -> Captures | None:
    """The capture sizes vLLM picks when none are given (``VllmConfig._set_cudagraph_sizes``, ``config/vllm.py``;
    ``config/__init__.py`` in 0.11) and how many graphs of each mode it captures (``CudagraphDispatcher
    .initialize_cudagraph_keys``, ``v1/cudagraph_dispatcher.py``; the V2 runner's ``CudaGraphManager
    ._init_candidates``, ``v1/worker/gpu/cudagraph_utils.py``, the same counts): the largest size is
    ``min(2 x max_num_seqs, 512)`` -- 1024 on a compute capability 10.x GPU from 0.28 -- and at most
    ``max_num_batched_tokens``; sizes 1, 2, 4, then every 8 up to 256 and every 16 above (every 8 throughout in
    0.11), ``max_num_batched_tokens`` added when it is the bound (0.20 on; 0.12.0 has not), and
    ``max_num_seqs`` itself, the widest uniform decode batch, when it is at most the ceiling (0.31 on: 0.30.0 has
    not; a reviewer's find); FULL decode graphs for the sizes up to ``max_num_seqs``. 0.11.0, 0.12.0, 0.20.2,
    0.22.1, 0.24.0, 0.27.1, 0.28.0, 0.29.0, 0.30.0, 0.31.0, 0.32.0 and 0.33.0 read; 0.13.0's log prints 51 and 35 at 256 sequences. None before 0.11 (other lists, not
    modelled)."""
    if v < (0, 11, 0):
        return None
    wide = v >= (0, 28, 0) and capability is not None and capability[0] == 10
    ceiling = 1024 if wide else 512
    largest = min(2 * max_num_seqs, ceiling, max_num_batched_tokens)
    if v < (0, 12, 0):  # 0.11 keeps 1, 2, 4 whatever the largest size (config/__init__.py)
        sizes = [i for i in (1, 2, 4) if i <= max_num_batched_tokens] + list(range(8, largest + 1, 8))
    else:
        sizes = ([i for i in (1, 2, 4) if i <= largest] + list(range(8, min(largest + 1, 256), 8))
                 + list(range(256, largest + 1, 16)))
    if v >= (0, 20, 0) and max_num_batched_tokens <= largest:
        sizes.append(max_num_batched_tokens)
    if v >= (0, 31, 0) and max_num_seqs <= ceiling and max_num_seqs <= max_num_batched_tokens:
        sizes.append(max_num_seqs)  # the widest uniform decode batch, on the 8 / 16 grid or not
    sizes = sorted(set(sizes))
    full = sum(1 for s in sizes if s <= max_num_seqs)
    why = (f"{len(sizes)} PIECEWISE + {full} FULL captures (sizes up to {sizes[-1]}: min(2 x {max_num_seqs} "
           f"sequences, {ceiling}{', a 10.x GPU' if wide else ''}, {max_num_batched_tokens} batched tokens))")
    return Captures(len(sizes), full, sizes[-1], why)


# ------------------------------------------------------------------------------ scheduler defaults

@dataclass(frozen=True)
class Defaults:
    max_num_batched_tokens: int
    max_num_seqs: int
    why: str


def scheduler_defaults(v: Version, total_bytes: int, gpu_name: str | None, usage: str = "serve") -> Defaults:
    """``max_num_batched_tokens`` / ``max_num_seqs`` when not given (``engine/arg_utils.py``,
    ``_set_default_args``): by the device's total memory and name, and whether ``vllm serve`` (the
    OpenAI server) or the ``LLM`` class starts the engine."""
    gib = total_bytes / 1024**3
    name = (gpu_name or "").lower()
    big = gib >= 70 and (v < (0, 9, 0) or "a100" not in name)
    if v >= (0, 28, 0) and "gb10" in name:
        big = False
    if v >= (0, 28, 0) and gib >= 160:
        return Defaults(16384, 1024, "a device of 160 GiB or more (engine/arg_utils.py, 0.28+)")
    if big:
        tokens = 8192 if usage == "serve" else 16384
        return Defaults(tokens, 1024, f"a device of 70 GiB or more{', not an A100' if v >= (0, 9, 0) else ''} "
                                      f"({'vllm serve' if usage == 'serve' else 'the LLM class'}; engine/arg_utils.py)")
    tokens = 2048 if usage == "serve" else 8192
    return Defaults(tokens, 256, f"a device under 70 GiB{' or an A100' if v >= (0, 9, 0) else ''} "
                                 f"({'vllm serve' if usage == 'serve' else 'the LLM class'}; engine/arg_utils.py)")


# ------------------------------------------------------------------------------ non-torch defaults

def comms_before_snapshot(v: Version) -> bool:
    """Whether ``Worker.init_device`` (``v1/worker/gpu_worker.py``) sets up the distributed environment -- NCCL's
    communicators, custom all-reduce's buffers -- before its init memory snapshot (0.11.0 on: outside the
    profile's non-torch figure) or after it (0.10.2 and before: inside)."""
    return v >= (0, 11, 0)


NCCL_NVLINK = int(0.35 * 1024**3)  # NCCL over NVLink from 0.11, per rank: fitted (non_torch_default's doc)


def non_torch_default(v: Version, tp: int, pp: int, interconnect: str = "nvlink",
                      custom_ar_bytes: int = 0, fusion_bytes: int = 0) -> tuple[int, str]:
    """Non-torch memory the profile adds (cuBLAS / attention workspaces, and with tp > 1 NCCL's buffers
    connected at the first collectives): a default per setup, taken from the logs in
    benchmarks/published/vllm/ (calibration replaces it with what a machine measured). With tp > 1 it
    depends on the ``interconnect`` (:mod:`.allreduce`); ``custom_ar_bytes`` is what custom all-reduce
    allocates inside the figure (before 0.11 only: :meth:`.allreduce.CustomAllReduce.non_torch_bytes`);
    ``fusion_bytes`` FlashInfer's all-reduce + RMSNorm fusion workspace, made inside it (0.17 on, SM 9.0 / 10.x
    over NVSwitch: :func:`.fusion.fusion_workspace`).

    Over NVLink from 0.11 it is the one-GPU figure of the version, plus NCCL's buffers connected during the
    profile (:data:`NCCL_NVLINK`, 0.35 GiB: vLLM's source gives no formula for them; fitted as the median
    of the 11 in-sample 0.19 H100 SXM tp 2 / tp 4 logs, 2.10 GiB, less their one-GPU 0.25 GiB and their
    1.5 GiB fusion workspace), plus the fusion workspace."""
    gib = 1024**3
    if tp > 1:
        if not comms_before_snapshot(v):
            ar = f" + custom all-reduce's buffers {custom_ar_bytes / 1024**2:.0f} MiB" if custom_ar_bytes else ""
            return (int(0.20 * gib) + custom_ar_bytes,
                    f"TP > 1 before 0.11, 0.10 logs: 0.17-0.21 GiB per rank (PCIe, custom all-reduce off){ar}; NCCL's "
                    "communicators are made after vLLM's snapshot and counted in it (an NVLink figure is not fitted)")
        if interconnect == "nvlink":
            one, _ = non_torch_default(v, 1, pp)
            fused = (f" + FlashInfer's all-reduce fusion workspace {fusion_bytes / gib:.2f} GiB" if fusion_bytes
                     else " (no all-reduce fusion workspace)")
            return (one + NCCL_NVLINK + fusion_bytes,
                    f"TP > 1 over NVLink: the one-GPU {one / gib:.2f} GiB + NCCL's buffers connected during the "
                    f"profile {NCCL_NVLINK / gib:.2f} GiB (fitted to the 0.19 H100 SXM logs){fused}; custom "
                    "all-reduce's buffers are made before vLLM's snapshot, outside it")
        one, why = non_torch_default(v, 1, pp)
        return one, (f"TP > 1 over PCIe: as without TP ({why}); custom all-reduce's buffers and NCCL's communicators "
                     "are made before vLLM's snapshot (0.11 on), and NCCL's PCIe channel buffers are not counted "
                     "(no PCIe TP log with the profile line to fit them to)")
    if pp > 1:
        return int(0.07 * gib), "PP only, 0.19 logs: 0.07 GiB per rank"
    if v >= (0, 18, 0):
        return int(0.25 * gib), "one GPU, 0.18-0.19 logs: 0.24-0.27 GiB (0.46 for Granite)"
    if v >= (0, 15, 0):
        return int(0.13 * gib), "one GPU, 0.15-0.17 logs: 0.13 GiB"
    return int(0.07 * gib), "one GPU, 0.10 logs: 0.06-0.07 GiB"
