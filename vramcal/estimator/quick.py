"""The source documents' formula, kept as they wrote it, to compare against.

weights = params x bits / 8;  KV = 2 x layers x kv_heads x head_dim x tokens x batch x bytes;
their planning total adds 18 % for activations and runtime.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import UserError

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
