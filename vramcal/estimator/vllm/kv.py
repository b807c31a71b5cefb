"""vLLM's KV cache as it sizes it: a spec per attention layer, blocks from the available memory, the
tokens and concurrency it logs, and whether ``max_model_len`` fits (pure arithmetic).

Specs (``v1/kv_cache_interface.py``), for one layer and one block of ``block`` tokens:

================  ===============================================  ===========================================
attention         page_size_bytes                                  max_memory_usage_bytes (one request, L tokens)
================  ===============================================  ===========================================
full              2 x block x kv_heads_per_rank x head_dim x B     cdiv(L, block) x page
sliding (window)  the same                                         (cdiv(min(window - 1 + mnbt, L), block) + 1) x page
chunked local     the same                                         cdiv(min(chunk + mnbt, L), block) x page
MLA               block x (kv_lora_rank + rope_dim) x B            cdiv(L, block) x page (not split by tp)
Mamba / GDN       the layer's state, padded to the attention page  1 page (mode none), 2 (align), cdiv(L, block)
                  (:mod:`.mamba`: the attention block is raised      (all): :func:`.mamba.pages_per_request`
                  until its page holds the state)
================  ===============================================  ===========================================

``kv_heads_per_rank = max(1, kv_heads // tp)``; B = 1 for an fp8 cache, else the model dtype's bytes.

Blocks (``v1/core/kv_cache_utils.py``): a rank whose layers share one spec has
``available // (page x layers)`` blocks; a hybrid rank (0.9.2 on: sliding and full layers) groups
layers by kind, ``group_size = min(layers of a kind)``, ``num_groups = sum cdiv(layers of kind,
group_size)``, ``available // page // group_size`` blocks; from 0.12 the group size is the largest count
instead when that is under 1.25 x the smallest (1.5 x from 0.18), padding the smaller kinds
(``_get_kv_cache_groups_uniform_page_size``). Up to 0.9.0 sliding layers are sized as full attention. Every
rank then takes the minimum over ranks (``unify_kv_cache_configs``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import UserError
from . import versions as V
from .arch import Arch
from .mamba import Unified, pages_per_request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class LayerSpec:
    kind: str  # full | sliding | chunked | mla | mamba
    page_bytes: int
    window: int | None = None  # sliding window or chunk size
    mode: str | None = None  # a Mamba layer's prefix-caching mode: none | align | all
    state_block: int | None = None  # a Mamba layer's block size (max_model_len in mode none, else the attention's)

    def max_memory(self, length: int, block: int, mnbt: int) -> int:
        if self.kind == "mamba":
            return pages_per_request(self.mode or "none", length, self.state_block or length) * self.page_bytes
        if self.kind == "sliding":
            return (cdiv(min(self.window - 1 + mnbt, length), block) + 1) * self.page_bytes
        if self.kind == "chunked":
            return cdiv(min(self.window + mnbt, length), block) * self.page_bytes
        return cdiv(length, block) * self.page_bytes


def layer_specs(arch: Arch, tp: int, kv_bytes: int, block: int, v: V.Version,
                hybrid: Unified | None = None) -> list[LayerSpec | None | tuple[LayerSpec, ...]]:
    """One spec per decoder layer (global index); None for a layer that holds no cache (Nemotron-H's MLP and
    MoE layers), a tuple for one that holds two (Falcon-H1's attention and Mamba side by side: :func:`flat`
    makes a rank's list). ``hybrid``: the unified page of a model with Mamba layers (:func:`.mamba.unify`)."""
    out: list[LayerSpec | None | tuple[LayerSpec, ...]] = []
    for kind in arch.layer_kinds:
        if kind == "none":
            out.append(None)
            continue
        if kind == "parallel":
            attn = LayerSpec("full", 2 * block * max(1, arch.kv_heads // tp) * arch.head_dim * kv_bytes)
            out.append((attn, LayerSpec("mamba", hybrid.page_bytes, mode=hybrid.mode,
                                        state_block=hybrid.mamba_block_size)))
            continue
        if kind == "mamba":
            if hybrid is None:
                raise UserError(f"{arch.architecture} has Mamba / linear-attention layers: their state needs the "
                                "hybrid page arithmetic (vramcal.estimator.vllm.mamba)")
            out.append(LayerSpec("mamba", hybrid.page_bytes, mode=hybrid.mode, state_block=hybrid.mamba_block_size))
            continue
        if kind == "mla":
            out.append(LayerSpec("mla", block * (arch.kv_lora_rank + arch.rope_head_dim) * kv_bytes))
            continue
        page = 2 * block * max(1, arch.kv_heads // tp) * arch.head_dim * kv_bytes
        if kind == "sliding" and V.hybrid_groups(v):
            out.append(LayerSpec("sliding", page, int(arch.sliding_window)))
        elif kind == "chunked" and V.hybrid_groups(v):
            out.append(LayerSpec("chunked", page, int(arch.chunk_size)))
        else:  # up to 0.9.0 sliding-window layers are sized as full attention
            out.append(LayerSpec("full", page))
    return out


def flat(specs: list) -> list[LayerSpec | None]:
    """The cache layers of some decoder layers of :func:`layer_specs`, one entry each."""
    out: list[LayerSpec | None] = []
    for s in specs:
        out.extend(s if isinstance(s, tuple) else (s,))
    return out


@dataclass(frozen=True)
class Grouping:
    """How a rank's layers share KV blocks."""

    uniform: bool
    group_size: int  # layers per group (= the rank's layers when uniform)
    groups: tuple[tuple[LayerSpec, int], ...]  # (spec of the group, how many groups of that spec)
    page_bytes: int

    @property
    def num_groups(self) -> int:
        return sum(n for _, n in self.groups)

    @property
    def bytes_per_block(self) -> int:
        return self.page_bytes * self.group_size


def grouping(specs: list[LayerSpec | None], v: V.Version | None = None) -> Grouping:
    specs = [s for s in specs if s is not None]
    kinds: dict[LayerSpec, int] = {}
    for s in specs:
        kinds[s] = kinds.get(s, 0) + 1
    if len(kinds) == 1:
        spec = specs[0]
        return Grouping(True, len(specs), ((spec, 1),), spec.page_bytes)
    size = min(kinds.values())
    factor = V.group_size_factor(v) if v is not None else None
    if factor is not None and max(kinds.values()) < size * factor:
        size = max(kinds.values())
    page = max(s.page_bytes for s in kinds)  # vLLM requires equal pages across groups (it pads the smaller)
    return Grouping(False, size, tuple((s, cdiv(n, size)) for s, n in kinds.items()), page)


def needed_bytes(specs: list[LayerSpec | None], length: int, block: int, mnbt: int) -> int:
    """``check_enough_kv_cache_memory``: one request of ``length`` tokens over the rank's layers."""
    return sum(s.max_memory(length, block, mnbt) for s in specs if s is not None)


def largest_length(specs: list[LayerSpec | None], available: int, upper: int, block: int, mnbt: int) -> int:
    """``estimate_max_model_len``: the largest length in [1, upper] whose request fits (binary search);
    0 when not even one token does."""
    lo, hi = 0, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if needed_bytes(specs, mid, block, mnbt) <= available:
            lo = mid
        else:
            hi = mid - 1
    return lo


def max_concurrency(g: Grouping, num_blocks: int, max_len: int, block: int, mnbt: int, v: V.Version,
                    tokens: int) -> float:
    rule = V.concurrency_rule(v)
    if rule == "tokens":
        return tokens / max_len
    per_request = sum(n * cdiv(s.max_memory(max_len, block, mnbt), g.page_bytes) for s, n in g.groups)
    return num_blocks / per_request if per_request else 0.0


def reported_tokens(g: Grouping, num_blocks: int, block: int, concurrency: float, max_len: int, v: V.Version) -> int:
    """"GPU KV cache size": up to 0.19 ``num_blocks // groups x`` the smallest block size of any group (a Mamba
    group's is ``max_model_len`` in mode none, the attention block otherwise); from 0.20 concurrency x length."""
    if V.tokens_rule(v) == "concurrency":
        return int(concurrency * max_len)
    if g.uniform:
        return num_blocks * block
    smallest = min([block] + [s.state_block or max_len for s, _ in g.groups if s.kind == "mamba"])
    return num_blocks // g.num_groups * smallest
