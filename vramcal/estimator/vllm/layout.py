"""The weights one rank of ``tp x pp`` holds, in vLLM's layout: what "Model loading took X GiB" counts
(the torch allocated delta around ``get_model``, ``v1/worker/gpu_model_runner.py``).

- Each parameter by its role (:mod:`.shapes`): column-parallel outputs and row-parallel inputs split by
  tp, kv heads never below one per rank, routers and norms whole, experts split on their intermediate
  dimension, the vocabulary padded to a multiple of 64 and split by tp
  (``vocab_parallel_embedding.py``: ``DEFAULT_VOCAB_PADDING_SIZE = 64``).
- Pipeline stages: decoder layers split by ``get_pp_indices`` (``distributed/utils.py``: equal shares,
  the remainder one each to the stages before the last, from the second-to-last backwards); the
  embedding and the vision tower on the first stage, the final norm and ``lm_head`` on the last (a tied
  ``lm_head`` is a second copy of the embedding there).
- Quantized linear layers and experts take the scheme's bytes (:mod:`.quant`).
- Each rank holds the rotary caches its layers use: ``cos_sin_cache`` of max_position x rotary_dim in
  the model dtype (``rotary_embedding/base.py``), one per distinct rope (``get_rope`` caches them).
- What the figure counts is the caching allocator's blocks, not the tensors' bytes: vLLM reads it as
  ``torch.cuda.max_memory_allocated`` after a reset (``platforms/cuda.py`` ``get_current_memory_usage``,
  through ``DeviceMemoryProfiler``), i.e. the sizes of the live blocks, and every parameter is its own
  allocation, made on the device as the model is built (q/k/v and gate/up fused into one tensor each,
  ``QKVParallelLinear`` / ``MergedColumnParallelLinear``). A tensor over 10 MiB gets a segment rounded up
  to 2 MiB, and torch splits the rest off only when more than 1 MiB remains (``should_split``,
  ``c10/cuda/CUDACachingAllocator.cpp``), so a tensor 0-1 MiB short of a 2 MiB multiple holds the whole
  segment: Qwen2.5-7B's 31.5 / 259 / 129.5 MiB projections hold 32 / 260 / 130 MiB, 56 MiB over 28
  layers. :func:`allocated_bytes` replays the build through :class:`vramcal.estimator.allocator.CachingAllocator`
  (torch's defaults: vLLM sets no ``PYTORCH_CUDA_ALLOC_CONF``); quantized linear layers and experts,
  whose tensors the scheme's arithmetic does not list one by one, are counted as their bytes.

Pure arithmetic over the parameter list.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..allocator import DEFAULT_CONF, AllocConf, CachingAllocator
from .arch import Arch
from .quant import VllmQuant
from .shapes import Param

VOCAB_PADDING = 64
ALLOCATOR_GROUP = "allocator_blocks"  # the blocks' bytes above the tensors' (the module's doc)
UNLISTED = ("quantized", "experts")  # groups whose bytes are a scheme's sum, not one tensor each
_FUSED = ((re.compile(r"\.self_attn\.[qkv]_proj\."), ".self_attn.qkv_proj."),
          (re.compile(r"\.mlp\.(?:gate|up)_proj\."), ".mlp.gate_up_proj."))


def pad_vocab(n: int, to: int = VOCAB_PADDING) -> int:
    return -(-n // to) * to


def pp_partition(layers: int, pp: int) -> list[tuple[int, int]]:
    """[start, end) of each pipeline stage (``get_pp_indices``, without VLLM_PP_LAYER_PARTITION)."""
    parts = [layers // pp] * pp
    for i in range(2, layers % pp + 2):
        parts[-i] += 1
    out, start = [], 0
    for n in parts:
        out.append((start, start + n))
        start += n
    return out


@dataclass
class RankWeights:
    tp_rank: int
    pp_rank: int
    layers: tuple[int, int]
    bytes: int = 0
    groups: dict[str, int] = field(default_factory=dict)

    def add(self, group: str, n: int) -> None:
        self.bytes += n
        self.groups[group] = self.groups.get(group, 0) + n


def _kv_rows(rows: int, kv_heads: int, tp: int) -> int:
    """Output rows of a k or v projection on one rank: whole heads, at least one."""
    head = rows // kv_heads if kv_heads else rows
    return max(1, kv_heads // tp) * head


def param_bytes(p: Param, arch: Arch, tp: int, el: int, quant: VllmQuant) -> tuple[str, int]:
    """(group, bytes) of one parameter on one tensor-parallel rank."""
    shape = p.shape
    n = 1
    for d in shape:
        n *= d
    if p.role in ("embed", "lm_head"):
        rows = pad_vocab(shape[0]) // tp if len(shape) == 2 else pad_vocab(shape[0]) // tp
        return ("embeddings" if p.role == "embed" else "lm_head"), rows * (shape[1] if len(shape) == 2 else 1) * el
    if not p.floating:
        return "buffers", n * 4
    if p.role in ("expert_col", "expert_row"):
        e, a, b = shape
        if quant.scheme == "mxfp4":
            return "experts", e * _backend(quant).weight_bytes(*_mxfp4_expert(p.role, arch, tp, quant))
        out, inp = (a // tp, b) if p.role == "expert_col" else (a, b // tp)
        q = quant if not p.vision else None
        return "experts", e * (q.linear_bytes(out, inp, el) if q else out * inp * el)
    if quant.scheme == "mxfp4" and len(shape) == 2 and ".experts." in f".{p.name}" and p.name.endswith("_bias"):
        # the experts' biases, padded with the widths they follow: float32 after Triton's loading, the model
        # dtype after Marlin's
        e, rows = shape
        hidden, inter = _mxfp4_dims(arch, tp, quant)
        rows = 2 * inter if "gate_up" in p.name else hidden
        return "experts", e * _backend(quant).bias_bytes(rows, el)
    quantized = p.linear and not p.vision and quant.scheme != "none" and not quant.experts_only
    if len(shape) == 2:
        out, inp = shape
        if p.role == "col":
            out //= tp
        elif p.role == "kv":
            out = _kv_rows(out, arch.kv_heads, tp)
        elif p.role == "row":
            inp //= tp
        if quantized:
            return "quantized", quant.linear_bytes(out, inp, el)
        return ("vision" if p.vision else "dense"), out * inp * el
    if len(shape) == 3 and p.role == "col":  # a Mamba / GDN conv1d weight [channels, 1, kernel]: channels split
        return "dense", shape[0] // tp * shape[1] * shape[2] * el
    if len(shape) == 1:  # a bias follows its layer's output split; norms are whole
        if p.role == "col":
            return "dense", shape[0] // tp * el
        if p.role == "kv":
            return "dense", _kv_rows(shape[0], arch.kv_heads, tp) * el
        return ("vision" if p.vision else "norms"), n * el
    return ("vision" if p.vision else "dense"), n * el


def _backend(quant: VllmQuant):
    from .mxfp4 import backend

    return quant.mxfp4 or backend((0, 13, 0), None, None, None)  # an estimate sets it; a bare layout takes Triton's


def _mxfp4_dims(arch: Arch, tp: int, quant: VllmQuant) -> tuple[int, int]:
    """(hidden, intermediate per rank) of the experts as the backend pads them (``create_weights``)."""
    return _backend(quant).padded(arch.hidden, (arch.moe_intermediate or arch.intermediate) // tp)


def _mxfp4_expert(role: str, arch: Arch, tp: int, quant: VllmQuant) -> tuple[int, int]:
    """(rows, columns) of one expert's MXFP4 weight on a rank: ``w13`` is 2 x the padded intermediate size by
    the padded hidden size, ``w2`` the reverse, whichever way the checkpoint orders them."""
    hidden, inter = _mxfp4_dims(arch, tp, quant)
    return (2 * inter, hidden) if role == "expert_col" else (hidden, inter)


def fused_name(name: str) -> str:
    """The vLLM tensor a transformers parameter lands in: q/k/v projections in ``qkv_proj``, gate/up in
    ``gate_up_proj`` (weights and biases apart); any other parameter is a tensor of its own."""
    for pattern, into in _FUSED:
        name = pattern.sub(into, name)
    return name


def allocated_bytes(tensors: list[int], conf: AllocConf = DEFAULT_CONF) -> int:
    """The caching allocator's allocated bytes after allocating ``tensors`` (bytes each) in order on a fresh
    device: what ``torch.cuda.memory_allocated`` counts (the module's doc)."""
    alloc = CachingAllocator(conf)
    for i, n in enumerate(tensors):
        if n > 0:
            alloc.malloc(i, n)
    return alloc.allocated


def rank_weights(params: list[Param], arch: Arch, tp: int, pp: int, el: int, quant: VllmQuant) -> list[RankWeights]:
    """The weights of every rank, ordered pp-major (rank = pp_rank x tp + tp_rank). All tp ranks of a
    stage hold the same bytes (the splits are even), so one figure per stage is repeated."""
    stages = pp_partition(arch.layers, pp)
    out = []
    for s, (lo, hi) in enumerate(stages):
        first, last = s == 0, s == pp - 1
        rw = RankWeights(0, s, (lo, hi))
        tensors: dict[str, int] = {}  # vLLM's tensors of this rank in the order the model builds them
        for p in params:
            if p.layer is not None:
                if not lo <= p.layer < hi:
                    continue
            elif p.role == "embed":
                if not (first or (last and arch.tied)):
                    continue
            elif p.role == "lm_head" or (not p.vision and _final(p)):
                if not last:
                    continue
            elif not first:  # vision tower and projector: the first stage
                continue
            group, b = param_bytes(p, arch, tp, el, quant)
            rw.add(group, b)
            if group not in UNLISTED:
                key = fused_name(p.name)
                tensors[key] = tensors.get(key, 0) + b
        for i, (positions, rot) in enumerate(arch.ropes):
            rw.add("rotary_cache", positions * rot * el)
            tensors[f"rotary_cache.{i}"] = positions * rot * el
        listed = sum(tensors.values())
        rw.add(ALLOCATOR_GROUP, allocated_bytes(list(tensors.values())) - listed)
        for t in range(tp):
            out.append(RankWeights(t, s, (lo, hi), rw.bytes, dict(rw.groups)))
    return out


def _final(p: Param) -> bool:
    """The final norm and other parameters after the decoder (the last stage's)."""
    return "norm" in p.name.rsplit(".", 2)[-2] if "." in p.name else False
