"""What vLLM reads from a model's config: attention per layer, KV heads, head sizes, the rotary caches,
the largest length. Pure: the config dict only (the language model's part of a multimodal config)."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import UserError
from ..resolve import size_field, text_config


@dataclass(frozen=True)
class Arch:
    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    vocab: int
    tied: bool
    intermediate: int
    moe_intermediate: int  # 0 for a dense model
    shared_intermediate: int  # a MoE model's shared experts (or its dense layers' MLP); 0 if none
    experts: int  # 0 for a dense model
    experts_per_token: int
    layer_kinds: tuple[str, ...]  # per decoder layer: full | sliding | chunked | mla | mamba | parallel (attention
    # and Mamba side by side: Falcon-H1) | none (no cache)
    sliding_window: int | None
    chunk_size: int | None
    kv_lora_rank: int | None  # MLA
    rope_head_dim: int | None  # MLA's decoupled rotary part
    max_position: int
    derived_max_len: int  # vLLM's derived max_model_len
    ropes: tuple[tuple[int, int], ...]  # (positions, rotary dim) of each distinct rotary cache
    architecture: str = "?"


def _int(tc: dict, key: str, default=None):
    v = size_field(tc, key)
    return default if v is None else int(v)


def layer_kinds(tc: dict, layers: int) -> tuple[str, ...]:
    """Attention per layer as vLLM sizes its cache: ``layer_types`` where the config gives it (Gemma 2/3,
    gpt-oss, Qwen2 with use_sliding_window), else the older fields (Gemma 2 alternates from layer 0,
    Gemma 3 every ``sliding_window_pattern``-th layer is global), MLA when ``kv_lora_rank`` is set."""
    if tc.get("kv_lora_rank"):
        return ("mla",) * layers
    pattern = tc.get("hybrid_override_pattern")
    if isinstance(pattern, str) and len(pattern) == layers:
        # Nemotron-H (``nemotron_h.py``, ``ALL_DECODER_LAYER_TYPES``): M a Mamba-2 layer, * attention, - an MLP and
        # E a MoE layer, which hold no cache
        return tuple("mamba" if c == "M" else "full" if c == "*" else "none" for c in pattern)
    mt = str(tc.get("model_type", ""))
    if mt == "falcon_h1":
        # Falcon-H1 (``falcon_h1.py``, ``FalconH1ParallelHybrid``): every decoder layer runs a Mamba-2 mixer and an
        # attention layer side by side, each with its own cache
        return ("parallel",) * layers
    if mt == "jamba" and tc.get("attn_layer_period"):
        # Jamba (``jamba.py``: ``config.layers_block_type``, transformers' JambaConfig): attention where
        # i % attn_layer_period == attn_layer_offset, Mamba-1 elsewhere
        period, offset = int(tc["attn_layer_period"]), int(tc.get("attn_layer_offset") or 0)
        return tuple("full" if i % period == offset else "mamba" for i in range(layers))
    types = tc.get("layer_types") or (tc.get("layers_block_type") if mt == "jamba" else None)
    if isinstance(types, list) and len(types) == layers:
        out = []
        for t in types:
            t = str(t)
            out.append("sliding" if "sliding" in t else "chunked" if "chunk" in t else
                       "mamba" if ("linear" in t or "mamba" in t) else "full")
        return tuple(out)
    window = tc.get("sliding_window")
    if mt == "gemma2" and window:
        return tuple("sliding" if i % 2 == 0 else "full" for i in range(layers))
    if mt in ("gemma3", "gemma3_text") and window:
        pattern = int(tc.get("sliding_window_pattern") or 6)
        return tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(layers))
    if mt in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe") and not tc.get("use_sliding_window"):
        return ("full",) * layers
    if window and mt in ("mistral", "mixtral", "phi3", "starcoder2"):
        return ("sliding",) * layers
    if tc.get("attention_chunk_size") and mt.startswith("llama4"):
        step = int(tc.get("interleave_moe_layer_step") or 4)
        return tuple("full" if (i + 1) % step == 0 else "chunked" for i in range(layers))
    return ("full",) * layers


def arch_of(config: dict, filled: dict | None = None) -> Arch:
    """``config`` as the checkpoint gives it; ``filled``: the same as transformers filled it, whose
    fields stand in for those the checkpoint leaves out (what the checkpoint gives always wins)."""
    tc = text_config(config)
    if filled:
        tc = {**text_config(filled), **tc}
    layers = _int(tc, "num_hidden_layers")
    hidden = _int(tc, "hidden_size")
    heads = _int(tc, "num_attention_heads")
    kv = _int(tc, "num_key_value_heads", heads)
    head_dim = _int(tc, "head_dim") or hidden // heads
    kinds = layer_kinds(tc, layers)
    mla = "mla" in kinds
    kv_lora = _int(tc, "kv_lora_rank") if mla else None
    rope_dim = _int(tc, "qk_rope_head_dim") if mla else None
    experts = int(tc.get("num_local_experts") or tc.get("num_experts") or tc.get("n_routed_experts") or 0)
    max_pos = _int(tc, "max_position_embeddings", 2048)
    # rotary caches: get_rope caches one RotaryEmbedding per distinct set of arguments
    # (model_executor/layers/rotary_embedding/__init__.py); Gemma 3 has a local and a global one
    partial = float(tc.get("partial_rotary_factor") or 1.0)
    rot = rope_dim if mla else int(head_dim * partial)
    ropes = [(max_pos, rot)] if str(tc.get("model_type")) != "jamba" else []  # Jamba's attention has no rotary
    if tc.get("rope_local_base_freq") is not None:
        ropes.append((max_pos, rot))
    return Arch(model_type=str(tc.get("model_type", "?")), layers=layers, hidden=hidden, heads=heads, kv_heads=kv,
                head_dim=head_dim, v_head_dim=_int(tc, "v_head_dim", head_dim) or head_dim,
                vocab=_int(tc, "vocab_size"), tied=bool(tc.get("tie_word_embeddings", False)),
                intermediate=_int(tc, "intermediate_size", 4 * hidden),
                moe_intermediate=int(tc.get("moe_intermediate_size") or (tc.get("intermediate_size") if experts else 0) or 0),
                shared_intermediate=_shared(tc, experts),
                experts=experts, experts_per_token=int(tc.get("num_experts_per_tok") or 0),
                layer_kinds=kinds, sliding_window=tc.get("sliding_window") if "sliding" in kinds else None,
                chunk_size=tc.get("attention_chunk_size") if "chunked" in kinds else None,
                kv_lora_rank=kv_lora, rope_head_dim=rope_dim, max_position=max_pos,
                derived_max_len=derived_max_len(tc), ropes=tuple(ropes),
                architecture=str((config.get("architectures") or tc.get("architectures") or ["?"])[0]))


def _shared(tc: dict, experts: int) -> int:
    if not experts:
        return 0
    if tc.get("shared_expert_intermediate_size"):
        return int(tc["shared_expert_intermediate_size"])
    if tc.get("n_shared_experts") and tc.get("moe_intermediate_size"):
        return int(tc["n_shared_experts"]) * int(tc["moe_intermediate_size"])
    return 0


def derived_max_len(tc: dict) -> int:
    """vLLM's ``_get_and_verify_max_len`` (``config/model.py``): the smallest of the config's length
    fields; rope scaling of the ``yarn`` / ``dynamic`` / ``longrope`` kinds multiplies it by its factor
    (``llama3`` and ``linear`` do not: their max_position_embeddings is already the long one)."""
    keys = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
            "max_sequence_length", "max_seq_length", "seq_len")
    found = [int(tc[k]) for k in keys if isinstance(tc.get(k), int) and tc[k] > 0]
    length = min(found) if found else 2048
    rs = tc.get("rope_scaling") or {}
    kind = str(rs.get("rope_type") or rs.get("type") or "") if isinstance(rs, dict) else ""
    if kind in ("yarn", "dynamic", "longrope") and rs.get("factor") and "original_max_position_embeddings" in rs:
        length = int(int(rs["original_max_position_embeddings"]) * float(rs["factor"]))
    elif kind in ("yarn", "dynamic") and rs.get("factor"):
        length = int(length * float(rs["factor"]))
    return length


def check_tp(arch: Arch, tp: int, pp: int) -> None:
    """What vLLM asserts when it builds the model (``QKVParallelLinear``, the attention layers,
    ``make_layers``): heads divisible by tp; kv heads divisible by tp or tp by kv heads; at least one
    layer per pipeline stage."""
    if arch.heads % tp:
        raise UserError(f"--tensor-parallel-size {tp} does not divide the model's {arch.heads} attention heads: "
                        "vLLM refuses it; choose a divisor of the heads")
    if "mla" not in arch.layer_kinds and arch.kv_heads % tp and tp % arch.kv_heads:
        raise UserError(f"--tensor-parallel-size {tp} and the model's {arch.kv_heads} KV heads divide neither way: "
                        "vLLM refuses it; choose a tp that divides the KV heads or a multiple of them")
    if pp > arch.layers:
        raise UserError(f"--pipeline-parallel-size {pp} is more than the model's {arch.layers} layers")
