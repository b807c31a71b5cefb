"""Every parameter of the model, with the role vLLM's parallel layers give it: the one torch step of the
vLLM engine (it builds the installed transformers' model on the ``meta`` device, like the inventory).

vLLM builds its own model classes (``model_executor/models/*.py``) from the same checkpoint tensors, so
the shapes are the checkpoint's; what differs is how each tensor is laid out on a rank, which follows
from the layer type vLLM uses for it (``model_executor/layers/linear.py``,
``vocab_parallel_embedding.py``, ``fused_moe/layer.py``):

==============  =====================================================================================
role            vLLM layer and what a rank of ``tp`` holds
==============  =====================================================================================
``embed``       ``VocabParallelEmbedding``: rows padded to a multiple of 64, split by tp
``lm_head``     ``ParallelLMHead``: the same (one tensor with ``embed`` when the config ties them)
``col``         ``ColumnParallelLinear`` / ``MergedColumnParallelLinear`` / the q part of
                ``QKVParallelLinear``: output rows split by tp (its bias too)
``kv``          the k and v parts of ``QKVParallelLinear``: kv heads split by tp, at least one whole
                head per rank (heads are replicated when tp exceeds them)
``row``         ``RowParallelLinear``: input columns split by tp; its bias whole on every rank
``rep``         ``ReplicatedLinear`` (MoE routers, MLA's ``q_a_proj`` / ``kv_a_proj_with_mqa``),
                norms, other small tensors: whole on every rank
``expert_col``  ``FusedMoE`` ``w13``: ``[experts, 2 x moe_intermediate / tp, hidden]``
``expert_row``  ``FusedMoE`` ``w2``: ``[experts, hidden, moe_intermediate / tp]``
==============  =====================================================================================

Names are transformers' (``model.layers.7.self_attn.k_proj.weight``); vLLM merges q/k/v and gate/up
into one tensor, which holds the same bytes. The list is cached on disk, so a later vLLM estimate of
the model needs no torch import.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..quant import QuantSpec
from ..resolve import ModelSource

SHAPES_VERSION = 4  # bump when the roles below change: the disk cache keys on it (2: the filled config too;
# 3: Mamba / Gated DeltaNet layers split by tp; 4: Mamba-1's x_proj and dt_proj)

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
COL = {"q_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj", "gate_up_proj", "fc1", "w1", "w3", "c_fc",
       "dense_h_to_4h", "query_key_value", "qkv_proj", "Wqkv", "c_attn", "in_proj", "wq", "wk", "wv",
       "in_proj_qkvz", "in_proj_ba", "conv1d", "dt_proj"}  # Mamba / Gated DeltaNet: split on their output
# (mamba_mixer2.py, mamba_mixer.py, qwen3_next.py: ColumnParallelLinear / MergedColumnParallelLinear; the conv weight
# as one)
STATE_PER_HEAD = {"A_log", "D", "dt_bias"}  # a Mamba / GDN layer's per-head tensors: split by tp with the heads
KV = {"k_proj", "v_proj"}
ROW = {"o_proj", "down_proj", "dense", "fc2", "w2", "c_proj", "out_proj", "dense_4h_to_h", "wo",
       "x_proj"}  # Mamba-1's x_proj: RowParallelLinear on the intermediate size (mamba_mixer.py)
REPLICATED_LINEAR = {"q_a_proj", "kv_a_proj_with_mqa"}  # quantized like every linear layer, not split
VISION = ("vision", "visual", "multi_modal_projector", "mm_projector", "image_newline")


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    role: str  # embed | lm_head | col | kv | row | rep | expert_col | expert_row
    layer: int | None  # decoder layer index (pipeline stages split by it); None outside the decoder
    linear: bool  # the weight of a linear layer (a quantization scheme converts it)
    floating: bool = True
    vision: bool = False

    def to_list(self) -> list:
        return [self.name, list(self.shape), self.role, self.layer, self.linear, self.floating, self.vision]

    @classmethod
    def from_list(cls, x: list) -> Param:
        return cls(str(x[0]), tuple(int(v) for v in x[1]), str(x[2]), None if x[3] is None else int(x[3]),
                   bool(x[4]), bool(x[5]), bool(x[6]))


def role_of(name: str, ndim: int, in_embed: bool, in_head: bool) -> tuple[str, bool]:
    """(role, is a linear layer's weight) of a parameter, from its name and rank."""
    if in_embed:
        return "embed", False
    if in_head:
        return "lm_head", False
    parts = name.split(".")
    leaf, module = parts[-1], (parts[-2] if len(parts) > 1 else "")
    vision = any(v in name for v in VISION)
    if ndim == 3 and leaf in ("gate_up_proj", "w13_weight", "w1", "w3", "up_proj"):  # up_proj: ungated (Nemotron-H)
        return "expert_col", True
    if ndim == 3 and leaf in ("down_proj", "w2_weight", "w2"):
        return "expert_row", True
    is_weight = leaf == "weight" and ndim == 2
    if leaf in STATE_PER_HEAD and module in ("mixer", "linear_attn", "mamba"):
        return "col", False
    if module == "norm" and len(parts) > 2 and parts[-3] in ("mixer", "mamba"):  # Mamba-2's gated norm, sharded
        return "col", False
    if module in KV:
        return ("col" if vision else "kv"), is_weight
    if module in COL:
        return "col", is_weight
    if module in ROW:
        return ("row" if is_weight else "rep"), is_weight  # a row-parallel bias is whole on every rank
    if module in REPLICATED_LINEAR:
        return "rep", is_weight
    return "rep", False


def model_params(source: ModelSource, dtype: str) -> tuple[list[Param], dict]:
    """The parameters of the installed transformers' model for ``source`` (built on ``meta``), and its
    config as transformers filled it (the fields a checkpoint leaves to the defaults, e.g. Gemma 3's
    vocabulary, given)."""
    from ..inventory import built_config_dict
    from ..meta import build_meta_model

    model, _, _ = build_meta_model(source, QuantSpec(name=f"vllm-{dtype}", method="none", dtype=dtype))
    in_emb = model.get_input_embeddings()
    out_emb = model.get_output_embeddings()
    embed_ids = {id(p) for p in (in_emb.parameters() if in_emb is not None else [])}
    head_ids = {id(p) for p in (out_emb.parameters() if out_emb is not None else [])}
    out: list[Param] = []
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:  # a tied lm_head is the embedding's tensor
            continue
        seen.add(id(p))
        role, linear = role_of(name, p.dim(), id(p) in embed_ids, id(p) in head_ids and id(p) not in embed_ids)
        m = _LAYER.search(name)
        vision = any(v in name for v in VISION)
        out.append(Param(name, tuple(p.shape), role, int(m.group(1)) if m and not vision else None, linear,
                         p.is_floating_point(), vision))
    return out, built_config_dict(model.config)


def cached_params(source: ModelSource, dtype: str, use_cache: bool = True, progress=None) -> tuple[list[Param], dict]:
    """:func:`model_params`, through the estimator's disk cache."""
    from ..cache import load_cached, store_cached

    key = QuantSpec(name=f"vllm-shapes/{SHAPES_VERSION}|{dtype}", method="none", dtype=dtype)
    if use_cache:
        data = load_cached(source, key, kind="vllm-shapes")
        if data is not None:
            try:
                return [Param.from_list(x) for x in data["params"]], dict(data["config"])
            except (KeyError, TypeError, ValueError, IndexError):
                pass
    if progress is not None:
        progress("building the model on the meta device for vLLM's layout (imports torch and transformers)")
    params, filled = model_params(source, dtype)
    if use_cache:
        store_cached(source, key, {"params": [p.to_list() for p in params], "config": filled}, kind="vllm-shapes")
    return params, filled
