"""``fit``: the largest context per quantization and batch that stays within a budget."""

from __future__ import annotations

from ..estimator.correction import apply
from ..estimator.estimate import Estimator
from ..estimator.quant import resolve_quant
from ..estimator.resolve import resolve_model, text_config
from ..workload import MAX_TOKENS, NEW_TOKENS, Workload
from .corrections import existing_store, lookup

FIT_QUANTS = ("bf16", "int8", "nf4-dq", "nf4")
FIT_BATCHES = (1, 2, 4, 8)


def fit_contexts(model: str, budget: int, *, device: str, db: str | None, buffer: int,
                 quants=FIT_QUANTS, batches=FIT_BATCHES, new_tokens: int = NEW_TOKENS) -> list[dict]:
    """The largest ctx (prompt + ``new_tokens``) per quant and batch whose corrected estimate, at the p95
    of this machine's residuals, stays within ``budget - buffer``; searched up to the model's
    ``max_position_embeddings``."""
    from ..probes.machine import machine_fingerprint

    source = resolve_model(model)
    fp = machine_fingerprint(device)
    corr_by_quant = {}
    store = existing_store(db)
    if store is not None:
        with store:
            corr_by_quant = {q: lookup(store, fp, q, source.config_hash).stages for q in quants}
    usable = budget - buffer
    max_ctx = min(int(text_config(source.config).get("max_position_embeddings") or 131072), MAX_TOKENS)
    kind = "cpu" if device.startswith("cpu") else "cuda"
    rows = []
    for q in quants:
        est = Estimator(source, resolve_quant(q, source.config), device=kind)
        corr = corr_by_quant.get(q, {})

        def peak(c: int, b: int) -> int:
            pt = est.sweep([(c, b)], new_tokens=new_tokens)[0]
            stages = {k: pt[k] for k in ("load_peak", "post_load", "first_token", "end")}
            return max(apply(stages, c * b, corr, margin="p95").values())

        for b in batches:
            lo, hi = new_tokens + 1, max(max_ctx, new_tokens + 1)
            if peak(lo, b) > usable:
                rows.append({"quant": q, "batch": b, "max_ctx": None, "new_tokens": new_tokens,
                             "peak_bytes": peak(lo, b)})
                continue
            while lo < hi:  # largest ctx with peak <= usable
                mid_c = (lo + hi + 1) // 2
                if peak(mid_c, b) <= usable:
                    lo = mid_c
                else:
                    hi = mid_c - 1
            rows.append({"quant": q, "batch": b, "max_ctx": lo, "new_tokens": new_tokens, "peak_bytes": peak(lo, b),
                         "workload": Workload(lo - new_tokens, new_tokens, b).args()})
    return rows
