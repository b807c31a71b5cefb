"""What to change when a run does not fit: the ladder of adjustments, in the order of a policy.

Policies (the source documents disagree on the order, so each is offered):

- ``quality``    keep the weights' precision: smaller batch, then shorter context, then an fp8 KV
                 cache; lower the weight quantization only when nothing else fits (the weights alone
                 are over the budget).
- ``context``    keep the context: lower the weight quantization first, then an fp8 KV cache, then a
                 smaller batch, the context last.
- ``throughput`` keep the batch: lower the weight quantization first, then the context, the batch
                 last ("lower the quantization, then the context, then the batch").

Each proposal carries its corrected estimate (at the p95 of this machine's residuals) and the
``vramcal check`` command that tries it, built by :class:`vramcal.workload.Configuration`.
"""

from __future__ import annotations

from ..errors import UserError
from ..estimator.correction import apply
from ..estimator.estimate import Estimator
from ..estimator.quant import resolve_quant
from ..estimator.resolve import ModelSource
from ..workload import Configuration, Workload

POLICIES = ("quality", "context", "throughput")
# Weight quantizations from most to least memory: what "lower the quantization" steps through
QUANT_LADDER = ("fp32", "bf16", "int8", "nf4-dq", "nf4")


def lower_quants(quant: str) -> list[str]:
    q = "bf16" if quant in ("auto", "fp16") else quant
    if q not in QUANT_LADDER:
        return []
    return list(QUANT_LADDER[QUANT_LADDER.index(q) + 1:])


def _halves(n: int, floor: int) -> list[int]:
    out = []
    while n // 2 >= floor:
        n //= 2
        out.append(n)
    return out


def ladder(quant: str, work: Workload, prefer: str, requantize: bool = True) -> list[tuple[str, Workload, str, str]]:
    """The steps of a policy, in order: (quant, workload, kv dtype, what changed). Contexts halve down
    to 1024 (or to the new tokens + 1 for short runs); the new tokens stay what the user asked for. A
    pre-quantized checkpoint loads only as stored (``requantize=False``): no quantization steps."""
    if prefer not in POLICIES:
        raise UserError(f"unknown --prefer {prefer!r}: choose {', '.join(POLICIES)}")
    floor = work.new_tokens + 1 if work.ctx < 2048 else max(1024, work.new_tokens + 1)
    ctxs = _halves(work.ctx, floor)
    batches = _halves(work.batch, 1)
    quants = lower_quants(quant) if requantize else []
    low = quants[-1] if quants else quant

    def w(ctx: int = work.ctx, batch: int = work.batch) -> Workload:
        return Workload(ctx - work.new_tokens, work.new_tokens, batch)

    steps: list[tuple[str, Workload, str, str]] = []
    if prefer == "quality":
        steps += [(quant, w(batch=b), "auto", f"batch {work.batch} -> {b}") for b in batches]
        steps += [(quant, w(c, 1 if batches else work.batch), "auto", f"ctx {work.ctx} -> {c}") for c in ctxs]
        steps += [(quant, w(), "fp8", "fp8 KV cache")]
        steps += [(q, w(), "auto", f"quant {quant} -> {q}") for q in quants]
    elif prefer == "context":
        steps += [(q, w(), "auto", f"quant {quant} -> {q}") for q in quants]
        steps += [(low, w(), "fp8", "lowest quant + fp8 KV cache")]
        steps += [(low, w(batch=b), "auto", f"lowest quant, batch {work.batch} -> {b}") for b in batches]
        steps += [(low, w(c, 1), "auto", f"lowest quant, batch 1, ctx {work.ctx} -> {c}") for c in ctxs]
    else:  # throughput
        steps += [(q, w(), "auto", f"quant {quant} -> {q}") for q in quants]
        steps += [(low, w(c), "auto", f"lowest quant, ctx {work.ctx} -> {c}") for c in ctxs]
        steps += [(low, w(ctxs[-1] if ctxs else work.ctx, b), "auto", f"lowest quant and ctx, batch {work.batch} -> {b}")
                  for b in batches]
    return steps


def propose(source: ModelSource, quant: str, work: Workload, usable: int, corrections_for, prefer: str,
            device: str, attn: str = "auto", synthetic: bool = False, limit: int = 3,
            requantize: bool = True) -> list[dict]:
    """Concrete next configurations, in the policy's order, whose corrected estimate (p95 margin) fits
    ``usable`` bytes; ``corrections_for(quant)`` gives this machine's corrections for a quantization."""
    estimators: dict[tuple[str, str], Estimator] = {}
    kind = "cpu" if device.startswith("cpu") else "cuda"
    out = []
    for q, w, kv, what in ladder(quant, work, prefer, requantize):
        key = (q, kv)
        try:
            if key not in estimators:
                estimators[key] = Estimator(source, resolve_quant(q, source.config), attn=attn, kv_dtype=kv,
                                            device=kind)
            e = estimators[key].estimate(batch=w.batch, prompt=w.prompt, new_tokens=w.new_tokens, exact=False)
        except UserError:
            continue
        fixed = apply(e.stages, w.tokens, corrections_for(q).stages, margin="p95")
        peak = max(fixed.values())
        if peak <= usable:
            cfg = Configuration(source.name, w, quant=q, device=device, kv_dtype=kv, attn=attn, synthetic=synthetic)
            out.append({"quant": q, "ctx": w.ctx, "batch": w.batch, "new_tokens": w.new_tokens, "kv_dtype": kv,
                        "change": what, "corrected_peak_bytes": peak, "raw_peak_bytes": e.peak,
                        "command": cfg.command("check")})
            if len(out) >= limit:
                break
    return out
