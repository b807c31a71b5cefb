"""What to change when a run does not fit: the ladder of adjustments, in the order of a policy.

Policies (the source documents disagree on the order, so each is offered):

- ``quality``    keep the weights' precision: smaller batch, then shorter context, then an fp8 KV
                 cache; lower the weight quantization only when nothing else fits (the weights alone
                 are over the budget).
- ``context``    keep the context: lower the weight quantization first, then an fp8 KV cache, then a
                 smaller batch, the context last.
- ``throughput`` keep the batch: lower the weight quantization first, then the context, the batch
                 last ("lower the quantization, then the context, then the batch").

Offload is a rung of each ladder: "offload N layers to CPU" keeps the configuration as asked and
lets accelerate hold the layers that do not fit in RAM (docs/placement.md). It costs speed, not
memory: every generated token copies those weights over PCIe to the GPU (the proposal says how many
bytes). With bitsandbytes the offloaded layers stay unquantized (the installed transformers refuses
``device_map="auto"`` with a CPU spill; the proposal's command loads the custom map with
``llm_int8_enable_fp32_cpu_offload``, as ``vramcal probe`` does). Where it sits:

- ``quality``    after the fp8 KV cache, before any lower quantization (offload keeps the precision);
- ``context``    after the lowest quantization with an fp8 KV cache, before the batch and the context;
- ``throughput`` last of all: a PCIe copy of the offloaded weights at every token is the opposite of
                 throughput.

The offload rung is computed only for a GPU and when the available RAM is known: the GPU's share is
searched so that its corrected peak (p95) fits the budget, with the CPU given the RAM available now.

A quantization step is offered only where it lowers the estimate at the asked workload: on the CPU an
on-the-fly bitsandbytes load keeps the checkpoint's 16-bit pages mapped beside the quantized copies
and glibc keeps the quantizer's temporaries, so nf4 and int8 raise the resident set there
(docs/cpu-memory.md); the ladder then steps through context and batch at the asked precision.

Each proposal carries its corrected estimate (at the p95 of this machine's residuals) and the
``vramcal check`` command that tries it, built by :class:`vramcal.workload.Configuration`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import NamedTuple

from ..errors import UserError
from ..estimator.resolve import ModelSource
from ..units import fmt_gib_gb
from ..workload import POLICIES, Configuration, Workload, device_kind
from .search import Budget, Search, offloaded_layers

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


class Step(NamedTuple):
    quant: str
    work: Workload
    kv_dtype: str
    change: str
    offload: bool = False  # keep the rest, offload to CPU what does not fit on the GPU


def ladder(quant: str, work: Workload, prefer: str, requantize: bool = True,
           quants: list[str] | None = None) -> list[Step]:
    """The steps of a policy, in order: (quant, workload, kv dtype, what changed). Contexts halve down
    to 1024 (or to the new tokens + 1 for short runs); the new tokens stay what the user asked for. A
    pre-quantized checkpoint loads only as stored (``requantize=False``): no quantization steps.
    ``quants``: the lower quantizations to step through (default: every one below ``quant``)."""
    if prefer not in POLICIES:
        raise UserError(f"unknown --prefer {prefer!r}: choose {', '.join(POLICIES)}")
    floor = work.new_tokens + 1 if work.ctx < 2048 else max(1024, work.new_tokens + 1)
    ctxs = _halves(work.ctx, floor)
    batches = _halves(work.batch, 1)
    if not requantize:
        quants = []
    elif quants is None:
        quants = lower_quants(quant)
    low = quants[-1] if quants else quant
    lq = "lowest quant, " if low != quant else ""  # say a quantization changed only where one did

    def w(ctx: int = work.ctx, batch: int = work.batch) -> Workload:
        return Workload(ctx - work.new_tokens, work.new_tokens, batch, work.images, work.image_size)

    steps: list[tuple] = []
    if prefer == "quality":
        steps += [(quant, w(batch=b), "auto", f"batch {work.batch} -> {b}") for b in batches]
        steps += [(quant, w(c, 1 if batches else work.batch), "auto", f"ctx {work.ctx} -> {c}") for c in ctxs]
        steps += [(quant, w(), "fp8", "fp8 KV cache")]
        steps += [(quant, w(), "auto", "offload to CPU", True)]
        steps += [(q, w(), "auto", f"quant {quant} -> {q}") for q in quants]
    elif prefer == "context":
        steps += [(q, w(), "auto", f"quant {quant} -> {q}") for q in quants]
        steps += [(low, w(), "fp8", ("lowest quant + " if lq else "") + "fp8 KV cache")]
        steps += [(low, w(), "auto", f"{lq}offload to CPU", True)]
        steps += [(low, w(batch=b), "auto", f"{lq}batch {work.batch} -> {b}") for b in batches]
        steps += [(low, w(c, 1), "auto", f"{lq}batch 1, ctx {work.ctx} -> {c}") for c in ctxs]
    else:  # throughput
        steps += [(q, w(), "auto", f"quant {quant} -> {q}") for q in quants]
        steps += [(low, w(c), "auto", f"{lq}ctx {work.ctx} -> {c}") for c in ctxs]
        steps += [(low, w(ctxs[-1] if ctxs else work.ctx, b), "auto",
                   ("lowest quant and ctx, " if lq else "shortest ctx, ") + f"batch {work.batch} -> {b}")
                  for b in batches]
        steps += [(low, w(), "auto", f"{lq}offload to CPU", True)]
    return [Step(*s) for s in steps]


@dataclass
class Proposal:
    """One next configuration to try, with its corrected estimate (p95 margin) and the command that
    tries it; an offload proposal also has its weight budget per device, the map it gives and what each
    generated token copies over PCIe."""

    quant: str
    ctx: int
    batch: int
    new_tokens: int
    kv_dtype: str
    change: str
    corrected_peak_bytes: int
    raw_peak_bytes: int
    command: str
    max_memory: dict[str, int] | None = None
    device_map: dict[str, str] | None = None
    grouped: list[str] | None = None
    pcie_bytes_per_token: int | None = None
    warning: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def propose(source: ModelSource, quant: str, work: Workload, usable: int, corrections_for, prefer: str,
            device: str, attn: str = "auto", synthetic: bool = False, limit: int = 3,
            requantize: bool = True, cpu_bytes: int | None = None) -> list[Proposal]:
    """Concrete next configurations, in the policy's order, whose corrected estimate (p95 margin) fits
    ``usable`` bytes; ``corrections_for(quant)`` gives this machine's corrections for a quantization.
    ``cpu_bytes``: RAM available for offloaded layers (no offload rung when None or on the CPU). Each
    question is asked through :class:`~vramcal.calibrate.search.Search`, as ``fit`` and ``plan`` ask it."""
    kind = device_kind(device)
    search = Search(source, device=device, attn=attn, images=work.images, image_size=work.image_size,
                    corrections=lambda q, devices, placed: {d: corrections_for(q).stages for d in devices})
    budget = Budget({device: usable}, cpu_bytes or 0)

    def raw_peak(q: str) -> int:
        return search.peaks(search.estimator(q), work, corrected=False)[device]

    lower = None
    if requantize:  # a step down must save memory here: on the CPU a bitsandbytes load adds to the
        try:        # checkpoint's pages instead of replacing them (docs/cpu-memory.md)
            asked = raw_peak(quant)
            saves = {q: p for q in lower_quants(quant) if (p := raw_peak(q)) < asked}
            lower = sorted(saves, key=lambda q: -saves[q])  # the last is the smallest here ("lowest")
        except UserError:
            lower = None
    out = []
    for step in ladder(quant, work, prefer, requantize, lower):
        q, w, kv, what = step.quant, step.work, step.kv_dtype, step.change
        if step.offload and (kind == "cpu" or not cpu_bytes):
            continue
        split = None
        try:
            est = search.estimator(q, kv)
            if step.offload:
                split = search.split(est, w, budget)
                if split is None or not split.offloaded:
                    continue  # no share fits, or nothing spills: the plain rungs already cover this
                what = f"{what[:-len('offload to CPU')]}offload {offloaded_layers(split.placement)} to CPU"
            fits, peaks = search.fits(est, w, budget, None if split is None else split.placement)
            raw = search.peaks(est, w, None if split is None else split.placement, corrected=False)[device]
        except UserError:
            continue
        if fits:
            cfg = Configuration(source.name, w, quant=q, device=device, kv_dtype=kv, attn=attn, synthetic=synthetic,
                                max_memory=None if split is None else split.max_memory)
            row = Proposal(q, w.ctx, w.batch, w.new_tokens, kv, what, peaks[device], raw, cfg.command("check"))
            if split is not None:
                plan, loads = split.placement, split.placement.loads
                row.max_memory, row.device_map, row.grouped = split.max_memory, dict(loads.device_map), loads.grouped()
                row.pcie_bytes_per_token = loads.pcie_bytes_per_token
                row.warning = (f"slow: every generated token copies {fmt_gib_gb(loads.pcie_bytes_per_token)} of "
                               f"offloaded weights over PCIe to {loads.main_device}"
                               + (f"; they stay unquantized ({loads.weights.get('cpu', 0):,} bytes in RAM)"
                                  if plan.refused else ""))
            out.append(row)
            if len(out) >= limit:
                break
    return out
