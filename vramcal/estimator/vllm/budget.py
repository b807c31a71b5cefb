"""The terms vLLM subtracts from ``total x gpu_memory_utilization`` before the KV cache: the activation
peak of its profiling run, non-torch memory and (from 0.20) the CUDA-graph estimate. Pure arithmetic.

**The profiling run** (``GPUModelRunner.profile_run``, ``v1/worker/gpu_model_runner.py``): one forward
over ``max_num_batched_tokens`` tokens (T) split into ``min(max_num_seqs, T)`` requests, before any KV
cache exists, then ``_dummy_sampler_run`` on the last token of each request (S = min(max_num_seqs, T)
rows of the full vocabulary, in float32, with top-k/top-p/penalties on). Its torch peak above the
weights is "torch peak memory increase" in the DEBUG profile line, and is the activation term.

The forward and the sampler do not overlap: the peak is the larger of the two, plus what stays
allocated through both. Terms, per rank (``el`` = the model dtype's bytes, H = hidden size, I = the
rank's dense MLP width, V = the padded vocabulary):

- sampler: ``(SAMPLER_BYTES + el) x S x V + HIDDEN_KEPT x T x H x el`` -- the logits in the model
  dtype, their float32 copy and the sampler's temporaries; up to 0.16 top-k/top-p sort the vocabulary
  in PyTorch (``v1/sample/ops/topk_topp_sampler.py``), ``SORT_BYTES`` more per logit, unless
  FlashInfer's sampler runs (:func:`.versions.sampler_sorts`). On the V2 model runner (0.22 on, by
  architecture: :func:`.versions.v2_runner_default`; :func:`.versions.v2_sampler_pass`): the logits alone
  from 0.27 (``el`` bytes per logit), with their float32 copy up to 0.26 (``el + 4``), and from 0.33 a
  second pass with every sampling parameter on, priced with V1's term (an assumption, untested). At tp > 1 the
  logits are all-gathered first (``LogitsProcessor._gather_logits``; ``CudaCommunicator.all_gather``: the
  rank's shard, the gathered buffer and its ``movedim`` copy at once), ``(2 + 1 / tp) x el`` per logit at the
  moment; the V2 term is the larger of the two, nothing fitted;
- forward: ``T x el x (MLP_WIDTHS x I + FORWARD_HIDDEN x H)`` -- gate/up and the activation's output
  at once, and the hidden states around them;
- fused MoE: its workspaces, cached across calls so present during the sampler too:
  ``T x top_k x (max(2 x I_moe, H) + I_moe) x el`` (``fused_moe/modular_kernel.py``);
- pipeline stages: a stage that is not the last sends hidden states and residual (``2 x T x H x el``),
  a stage that is not the first receives them; only the last stage runs the sampler;
- a cold compile (:func:`.versions.compile_benchmarks_kernels`): the first forward compiles the model,
  and Inductor's combo-kernel benchmark (torch 2.13 ``_inductor/scheduler.py``
  ``speedup_by_combo_kernel`` -> ``codegen/triton.py`` ``benchmark_fused_nodes``) runs each candidate
  kernel on ``get_args()``, fresh ``rand_strided`` tensors the size of every argument
  (``codegen_kernel_benchmark``), graph inputs included. The largest is the first stage's embedding
  kernel, whose nodes depend on graph inputs only (``_topological_sort_nodes`` puts them in the first
  group, with the rotary ``cos_sin_cache.index_select``): a random copy of the rank's embedding table,
  ``V / tp x H x el`` (``VocabParallelEmbedding.num_embeddings_per_partition``), and its outputs --
  ``COMPILE_OUTPUTS`` ``T x H x el`` at tp 1 (the embedding kept as layer 0's residual and the fused
  RMSNorm's output), one at tp > 1 (the all-reduce between them ends the kernel). It is freed before the
  forward runs, so the peak is the larger of it and the rest.

The coefficients are fitted to the 0.17-0.19 DEBUG logs in benchmarks/published/vllm/ (H100, T=8192,
S=1024; docs/vllm.md shows the residuals); the multimodal encoder's profile is not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...units import GIB, MIB
from . import versions as V
from .arch import Arch
from .layout import pad_vocab

SAMPLER_BYTES = 12.8  # per logit, besides the logits themselves (fitted: 14.7-15.0 B per logit in bf16)
SORT_BYTES = 23.5  # per logit, up to 0.16 (Qwen3-14B on H100: 5.64 GiB at 0.15/0.16 vs 2.23 at 0.17/0.18)
HIDDEN_KEPT = 1.13  # T x H x el alive through the sampler (Llama-3.1-8B vs -70B, Qwen2.5-7B vs -72B)
MLP_WIDTHS = 3.0  # gate/up (2 I) and the activation's output (I) at once (CodeLlama-7B, Granite-8B)
FORWARD_HIDDEN = 4.25  # hidden states, residual and attention outputs around them
COMPILE_OUTPUTS = 2  # T x H outputs of the benchmarked embedding kernel at tp 1 (residual and normed)
GRAPH_BASE = int(0.45 * GIB)  # CUDA graphs: 0.45 GiB + 14.9 MiB per layer on the rank (0.19 H100 logs,
GRAPH_PER_LAYER = int(14.9 * MIB)  # 1,024 sequences: 51 PIECEWISE + 51 FULL captures; 0.51-1.85 GiB observed)
# the captures of the rows the default was fitted to (0.19, H100: 1,024 sequences, 8,192 batched tokens)
GRAPH_FIT_CAPTURES = V.cudagraph_captures((0, 19, 0), 1024, 8192, (9, 0))
# The V2 model runner's estimate (0.29 on: v1/worker/gpu/cudagraph_utils.py profile_cudagraph_memory) measures a
# throwaway capture of every PIECEWISE graph and two FULL ones and extrapolates the other FULL graphs from the
# second (at least 1 MiB each): no byte formula, so a base plus a cost per graph and layer on the rank, fitted by
# benchmarks/fit_vllm_graphs.py to the Tesla T4 0.29.0 sweep's logged estimates (Qwen2.5-1.5B, 28 layers, 18-86
# graphs; split = fit) and checked there on the held-out 0.29 L40S rows (Qwen3-14B, 40 layers).
V2_GRAPH_BASE = int(0.0438 * GIB)
V2_GRAPH_PER_GRAPH_LAYER = int(0.1318 * MIB)
V2_GRAPH_METHOD = "the V2 model runner's estimate (0.29 on)"  # how an estimate's methods name it


@dataclass(frozen=True)
class Activation:
    total: int
    sampler: int
    forward: int
    moe_workspace: int
    pipeline: int
    compile_bench: int  # the cold compile's kernel benchmark (0 where none runs)
    which: str  # sampler | forward | compile


def compile_bench_bytes(arch: Arch, tp: int, el: int, mnbt: int) -> int:
    """What a cold compile's benchmark of the embedding kernel allocates on the first stage (the module's doc)."""
    outputs = COMPILE_OUTPUTS if tp == 1 else 1
    return (pad_vocab(arch.vocab) // tp + outputs * mnbt) * arch.hidden * el


def activation(arch: Arch, tp: int, stage: int, pp: int, el: int, mnbt: int, seqs: int,
               v: V.Version, flashinfer: bool | None = None, cold_compile: bool = False,
               v2_runner: bool = False) -> Activation:
    """The activation peak of one rank's profiling run (the module's doc). ``cold_compile``: the profile
    compiles with nothing cached (:func:`.versions.compile_benchmarks_kernels`); ``v2_runner``: the model runs
    on the V2 model runner, whose dummy sampler holds less (:func:`.versions.v2_sampler_pass`)."""
    t = mnbt
    s = min(seqs, mnbt)
    h = arch.hidden
    dense_i = (arch.shared_intermediate if arch.experts else arch.intermediate) // tp
    moe = 0
    if arch.experts:
        mi = arch.moe_intermediate // tp
        moe = int(t * arch.experts_per_token * (max(2 * mi, h) + mi) * el)
    fwd = int(t * el * (MLP_WIDTHS * dense_i + FORWARD_HIDDEN * h))
    last, first = stage == pp - 1, stage == 0
    v2_pass = V.v2_sampler_pass(v) if v2_runner else None
    if v2_pass is None or v2_pass == V.V2_SAMPLER_WARMUP:
        per_logit = SAMPLER_BYTES + el + (SORT_BYTES if V.sampler_sorts(v, flashinfer) else 0.0)
    else:
        per_logit = el + (4.0 if v2_pass == V.V2_SAMPLER_FP32 else 0.0)
        if tp > 1:
            per_logit = max(per_logit, (2 + 1 / tp) * el)
    samp = int(per_logit * s * pad_vocab(arch.vocab) + HIDDEN_KEPT * t * h * el) if last else 0
    pipe = (0 if last else 2 * t * h * el) + (0 if first else 2 * t * h * el)
    bench = compile_bench_bytes(arch, tp, el, mnbt) if cold_compile and first else 0
    run = max(fwd, samp) + moe + pipe
    which = "compile" if bench > run else "sampler" if samp >= fwd else "forward"
    return Activation(max(run, bench), samp, fwd, moe, pipe, bench, which)


def cuda_graph_bytes(layers_on_rank: int, enforce_eager: bool, captures: V.Captures | None = None,
                     v2_estimate: bool = False) -> int:
    """A default for the CUDA-graph pool (what ``profile_cudagraph_memory`` estimates and the capture
    takes), fitted to 0.19 H100 logs; calibration replaces it. vLLM's estimate and its capture are sums over
    the graphs it captures (each its own kernels' nodes and pool blocks; ``profile_cudagraph_memory`` measures
    every capture, or extrapolates the later ones from the second, at least 1 MiB each), so the default scales
    with the number of graphs: ``captures`` (:func:`.versions.cudagraph_captures`) against the fitted rows'.
    None (before 0.11): the default as fitted. ``v2_estimate``: the V2 model runner's own estimate
    (:func:`.versions.v2_runner_estimates_graphs`), :data:`V2_GRAPH_BASE` + :data:`V2_GRAPH_PER_GRAPH_LAYER` x
    graphs x layers, about half the V1 default's cost per graph."""
    if enforce_eager:
        return 0
    if v2_estimate and captures is not None:
        return V2_GRAPH_BASE + V2_GRAPH_PER_GRAPH_LAYER * captures.graphs * layers_on_rank
    fitted = GRAPH_BASE + GRAPH_PER_LAYER * layers_on_rank
    if captures is None:
        return fitted
    return fitted * captures.graphs // GRAPH_FIT_CAPTURES.graphs
