"""The source documents' formula, kept as they wrote it, to compare against.

weights = params x bits / 8;  KV = 2 x layers x kv_heads x head_dim x tokens x batch x bytes;
their planning total adds 18 % for activations and runtime.

:func:`compare_formula` sets it beside a full estimate and says why the two differ; the formula's
KV and activations are also what an estimate falls back to where the dry run is unavailable.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import UserError
from ..units import fmt_gib_gb
from .quant import DTYPE_BYTES
from .resolve import size_field

RUNTIME_RATIO = 0.18


@dataclass(frozen=True)
class QuickEstimate:
    params: int
    bits: float
    layers: int | None
    kv_heads: int | None
    head_dim: int | None
    ctx: int
    batch: int
    kv_bytes_per_value: int
    weights_bytes: int
    kv_bytes_per_token: int | None
    kv_cache_bytes: int | None
    total_bytes: int  # (weights + KV) x (1 + 18 %)

    def to_dict(self) -> dict:
        return asdict(self)


def quick_estimate(params_b: float, bits: float, ctx: int, batch: int = 1, layers: int | None = None,
                   kv_heads: int | None = None, head_dim: int | None = None, kv_bytes: int = 2) -> QuickEstimate:
    from ..workload import MAX_BATCH, MAX_TOKENS, count, positive_number

    params_b = positive_number(params_b, "--params-b", "27")
    bits = positive_number(bits, "--bits", "4")
    if params_b > 1e6 or bits > 64:
        raise UserError(f"--params-b {params_b:g} x --bits {bits:g} is beyond any model (at most 1e6 billion "
                        "parameters and 64 bits)")
    ctx = count(ctx, "--ctx", 1, MAX_TOKENS)
    batch = count(batch, "--batch", 1, MAX_BATCH)
    kv_bytes = count(kv_bytes, "--kv-bytes", 1, 8)
    given = [v is not None for v in (layers, kv_heads, head_dim)]
    if any(given) and not all(given):
        raise UserError("the KV cache needs all three of --layers, --kv-heads and --head-dim")
    if all(given):
        layers = count(layers, "--layers", 1, 1 << 20)
        kv_heads = count(kv_heads, "--kv-heads", 1, 1 << 20)
        head_dim = count(head_dim, "--head-dim", 1, 1 << 20)
    params = int(round(params_b * 1e9))
    weights = int(params * bits / 8)
    per_token = kv = None
    if layers and kv_heads and head_dim:
        per_token = 2 * layers * kv_heads * head_dim * kv_bytes
        kv = per_token * ctx * batch
    total = int((weights + (kv or 0)) * (1 + RUNTIME_RATIO))
    return QuickEstimate(params=params, bits=bits, layers=layers, kv_heads=kv_heads, head_dim=head_dim, ctx=ctx,
                         batch=batch, kv_bytes_per_value=kv_bytes, weights_bytes=weights, kv_bytes_per_token=per_token,
                         kv_cache_bytes=kv, total_bytes=total)


def kv_shape(tc: dict) -> tuple[int, int, int]:
    heads = int(size_field(tc, "num_attention_heads") or 1)
    kv = int(size_field(tc, "num_key_value_heads") or (1 if tc.get("multi_query") else heads))
    hd = int(tc.get("head_dim") or (int(size_field(tc, "hidden_size") or 0) // heads))
    return int(size_field(tc, "num_hidden_layers") or 0), kv, hd


def formula_kv(tc: dict, tokens: int, batch: int, dtype: str) -> int:
    layers, kv, hd = kv_shape(tc)
    return 2 * layers * kv * hd * tokens * batch * DTYPE_BYTES.get(dtype, 2)


def formula_activations(tc: dict, inv, batch: int, prompt: int) -> tuple[int, int]:
    h = int(size_field(tc, "hidden_size") or 0)
    inter = int(tc.get("intermediate_size") or 4 * h)
    el = DTYPE_BYTES.get(inv.dtype, 2)
    tokens = batch * prompt
    vocab = int(size_field(tc, "vocab_size") or 0)
    prefill = tokens * (4 * h + 3 * inter) * el + batch * vocab * 4 * 2 + inv.largest_source_bytes
    decode = batch * (4 * h + 3 * inter) * el + batch * vocab * 4 * 2
    return prefill, decode


def compare_formula(tc: dict, inv, quant, work,
                     components: dict[str, int]) -> tuple[QuickEstimate | None, list[str]]:
    layers, kv_heads, hd = kv_shape(tc)
    bits = quant.bits or DTYPE_BYTES.get(quant.dtype, 2) * 8
    try:
        q = quick_estimate(inv.params / 1e9, bits, work.ctx, work.batch, layers or None,
                                          kv_heads or None, hd or None, DTYPE_BYTES.get(inv.dtype, 2))
    except UserError:
        return None, []
    diffs = []
    dw = components["weights"] - q.weights_bytes
    g = inv.groups
    diffs.append(f"weights {fmt_gib_gb(components['weights'])} vs formula {fmt_gib_gb(q.weights_bytes)} "
                 f"({dw / max(q.weights_bytes, 1):+.1%})")
    if quant.method in ("bnb4", "bnb8", "gptq", "awq", "fp8"):
        for key, label in (("embeddings", "input embeddings stay"), ("lm_head", "lm_head stays"),
                           ("experts", "fused MoE experts stay")):
            if g.get(key):
                diffs.append(f"  {label} in {inv.dtype}: {fmt_gib_gb(g[key])}")
        if g.get("quant_state"):
            diffs.append(f"  quantization state (absmax / scales / code tables): {fmt_gib_gb(g['quant_state'])}")
        if g.get("dense"):
            diffs.append(f"  other layers the quantizer skips or cannot convert: {fmt_gib_gb(g['dense'])}")
    if q.kv_cache_bytes is not None:
        dk = components["kv_cache"] - q.kv_cache_bytes
        if abs(dk) > 0.005 * max(q.kv_cache_bytes, 1):
            diffs.append(f"kv cache {fmt_gib_gb(components['kv_cache'])} vs formula {fmt_gib_gb(q.kv_cache_bytes)} "
                         f"({dk / max(q.kv_cache_bytes, 1):+.1%}): the installed cache classes store "
                         "sliding-window / compressed (MLA) / state layers differently")
    diffs.append(f"activations and runtime: {fmt_gib_gb(components['activations'] + components['runtime'])} "
                 f"vs the formula's flat 18 % ({fmt_gib_gb(q.total_bytes - q.weights_bytes - (q.kv_cache_bytes or 0))})")
    return q, diffs
