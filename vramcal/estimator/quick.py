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
    if params_b is None or params_b <= 0:
        raise UserError("--params-b must be a positive number of billions of parameters, e.g. --params-b 27")
    if bits is None or bits <= 0:
        raise UserError("--bits must be positive, e.g. --bits 4 (or 4.5 to include group scales)")
    if ctx <= 0 or batch <= 0:
        raise UserError("--ctx and --batch must be positive integers")
    params = int(round(params_b * 1e9))
    weights = int(params * bits / 8)
    per_token = kv = None
    if layers and kv_heads and head_dim:
        if min(layers, kv_heads, head_dim) <= 0:
            raise UserError("--layers, --kv-heads and --head-dim must be positive")
        per_token = 2 * layers * kv_heads * head_dim * kv_bytes
        kv = per_token * ctx * batch
    total = int((weights + (kv or 0)) * (1 + RUNTIME_RATIO))
    return QuickEstimate(params=params, bits=bits, layers=layers, kv_heads=kv_heads, head_dim=head_dim, ctx=ctx,
                         batch=batch, kv_bytes_per_value=kv_bytes, weights_bytes=weights, kv_bytes_per_token=per_token,
                         kv_cache_bytes=kv, total_bytes=total)
