"""The one-shot job and its neighbours: ``check`` (estimate -> probe -> reconcile -> record -> verdict),
``corrected`` estimates, ``propose`` (what to change when it does not fit), ``fit`` and memos.

Policies for ``propose`` (the source documents disagree on the order, so both are offered):

- ``quality``    keep the weights' precision: smaller batch, then shorter context, then an fp8 KV
                 cache; lower the weight quantization only when nothing else fits (the weights alone
                 are over the budget).
- ``context``    keep the context: lower the weight quantization first, then an fp8 KV cache, then a
                 smaller batch, the context last.
- ``throughput`` keep the batch: lower the weight quantization first, then the context, the batch
                 last ("lower the quantization, then the context, then the batch").
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from ..errors import UserError
from ..estimator.estimate import Estimator
from ..estimator.quant import resolve_quant
from ..estimator.resolve import ModelSource, resolve_model
from ..records.store import Store
from ..units import GIB, fmt_gib_gb
from . import reconcile
from .policies import POLICIES

# Weight quantizations from most to least memory: what "lower the quantization" steps through
QUANT_LADDER = ("fp32", "bf16", "int8", "nf4-dq", "nf4")
DEFAULT_BUFFER = 2 * GIB


@dataclass
class Verdict:
    fits: bool
    status: str  # the probe's
    budget_bytes: int
    buffer_bytes: int
    peak_bytes: int | None
    peak_stage: str | None
    headroom_bytes: int | None  # budget - peak
    oom_stage: str | None
    reason: str


@dataclass
class CheckResult:
    run_id: int
    machine_id: int
    verdict: Verdict
    probe: dict
    corrections: dict[str, dict]
    component_deltas: dict[str, int | None] = field(default_factory=dict)  # measured - estimated
    proposals: list[dict] = field(default_factory=list)
    memo_id: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def budget_for(device: str, fingerprint: dict, budget: int | None) -> int:
    if budget is not None:
        return budget
    total = fingerprint.get("total_bytes")
    if not total:
        raise UserError(f"cannot read the total memory of {device}: pass --budget, e.g. --budget 24GiB")
    return int(total)


def measured_peak(result) -> tuple[int | None, str | None]:
    rows = reconcile.stage_rows(result)
    best = (None, None)
    for r in rows:
        if r["stage"] in reconcile.STAGES and r["measured_peak_bytes"] is not None:
            if best[0] is None or r["measured_peak_bytes"] > best[0]:
                best = (r["measured_peak_bytes"], r["stage"])
    if result.unfinished and result.unfinished.get("peak_bytes") is not None:
        base = result.stages.get("baseline", {}).get("used_bytes") if result.series == "rss" else 0
        p = result.unfinished["peak_bytes"] - (base or 0)
        if best[0] is None or p > best[0]:
            best = (p, result.unfinished.get("stage"))
    return best


def record_probe(store: Store, machine_id: int, result, estimate: dict | None, run_id: int | None = None) -> int:
    if run_id is None:
        run_id = store.begin_run(machine_id, model=result.model, config_hash=(estimate or {}).get("config_hash"),
                                 quant=result.quant, quant_impl=result.quant_implementation, dtype=result.dtype,
                                 ctx=result.ctx, batch=result.batch, kv_dtype=(estimate or {}).get("kv_dtype"),
                                 attn=result.attn, device=result.device, command=result.command, estimate=estimate)
    d = result.to_dict()
    samples = [(s["t"], result.series, s.get(result.series)) for s in d.pop("samples") if result.series]
    store.finish_run(run_id, d, reconcile.stage_rows(result), samples)
    return run_id


def refit(store: Store, machine_id: int, stack: str, quant: str, config_hash: str | None
          ) -> dict[str, reconcile.Correction]:
    """Refit every scope this run belongs to and record them, under the machine's refit lock (no lost
    updates when two hosts refit at once); return the most specific one."""
    from .fleet import refit as _refit

    return _refit(store, machine_id, stack, quant, config_hash)


def lookup(store: Store, machine_id: int | None, stack: str, quant: str, config_hash: str | None
           ) -> dict[str, reconcile.Correction]:
    """The recorded corrections of the most specific scope that has any."""
    if machine_id is None:
        return {}
    for key, _ in reconcile.scopes(stack, quant, config_hash):
        rows = store.latest_corrections(machine_id, key)
        if rows:
            return reconcile.corrections_from_rows(rows)
    return {}


def corrected(estimate: dict, corrections: dict[str, reconcile.Correction], found=None) -> dict:
    """The estimate's JSON with ``correction`` added: raw, correction, corrected, source runs, and with
    ``found`` (a :class:`~vramcal.calibrate.fleet.FoundCorrection`) where it came from: this machine or
    its class, which hosts and runs."""
    stages = estimate["stages"]
    fixed = reconcile.apply(stages, estimate["ctx"], estimate["batch"], corrections)
    out = dict(estimate)
    out["correction"] = {
        "raw": stages, "corrected": fixed,
        "delta": {k: fixed[k] - stages[k] for k in stages},
        "p95_residual": {k: c.residual_p95_bytes for k, c in corrections.items()},
        "source_runs": sorted({r for c in corrections.values() for r in c.source_runs}),
    }
    if found is not None:
        out["correction"]["source"] = found.to_dict()
    out["stages"] = fixed
    out["peak"] = max(fixed.values())
    return out


def check(model: str, quant: str = "auto", ctx: int = 4096, batch: int = 1, *, device: str = "cuda:0",
          db: str | None = None, budget: int | None = None, buffer: int = DEFAULT_BUFFER, prefer: str = "quality",
          synthetic: bool = False, attn: str = "auto", dtype: str | None = None, command: str | None = None,
          interval_ms: float = 5.0) -> CheckResult:
    from ..probes.machine import machine_fingerprint, stack_key
    from ..probes.probe import run_probe

    if prefer not in POLICIES:
        raise UserError(f"unknown --prefer {prefer!r}: choose quality, context or throughput")
    source = resolve_model(model)
    fp = machine_fingerprint(device)
    total = budget_for(device, fp, budget)
    with Store(db) as store:
        machine_id = store.machine_id(fp)
        spec = resolve_quant(quant, source.config, dtype)
        from ..estimator.estimate import estimate as _estimate

        est = _estimate(source, quant, ctx, batch, dtype=dtype, attn=attn,
                        device="cpu" if device == "cpu" else "cuda").to_dict()
        cmd = command or f"vramcal check {source.name} --quant {quant} --ctx {ctx} --batch {batch} --device {device}" \
            + (" --synthetic" if synthetic else "")
        run_id = store.begin_run(machine_id, model=source.name, config_hash=source.config_hash, quant=spec.name,
                                 quant_impl=spec.implementation, dtype=spec.dtype, ctx=ctx, batch=batch,
                                 kv_dtype="auto", attn=attn, device=device, command=cmd, estimate=est)
        result = run_probe(source, quant, ctx, batch, device=device, synthetic=synthetic, interval_ms=interval_ms,
                           dtype=dtype, attn=attn, command=cmd, with_estimate=False)
        result.estimate = est  # estimated once, above, and recorded with the run before the probe started
        record_probe(store, machine_id, result, est, run_id=run_id)
        corr = refit(store, machine_id, stack_key(fp), spec.name, source.config_hash)
        peak, stage = measured_peak(result)
        usable = total - buffer
        if result.status == "oom":
            verdict = Verdict(False, result.status, total, buffer, peak, stage, None, result.oom.get("stage"),
                              f"out of memory at {result.oom.get('stage')}")
        elif result.status != "ok":
            verdict = Verdict(False, result.status, total, buffer, peak, stage, None, None,
                              f"the probe did not finish: {result.error}")
        else:
            fits = peak is not None and peak <= usable
            verdict = Verdict(fits, result.status, total, buffer, peak, stage, total - peak if peak else None, None,
                              (f"fits with {fmt_gib_gb(total - peak)} headroom" if fits else
                               f"runs, but the peak {fmt_gib_gb(peak)} leaves less than the "
                               f"{fmt_gib_gb(buffer)} buffer of {fmt_gib_gb(total)}"))
        out = CheckResult(run_id, machine_id, verdict, result.to_dict(), {k: asdict(v) for k, v in corr.items()},
                          reconcile.component_deltas(result))
        out.probe.pop("samples", None)
        if verdict.fits:
            out.memo_id = store.add_memo(run_id, memo_for(store.run(run_id)))
        else:
            from .fleet import find_correction

            def corrections_for(q: str) -> dict[str, reconcile.Correction]:
                return find_correction(store, fp, q, source.config_hash).corrections

            out.proposals = propose(source, spec.name, ctx, batch, usable, corrections_for, prefer, device,
                                    attn=attn)
    return out


# ------------------------------------------------------------------------------------ proposals

def _lower(quant: str) -> list[str]:
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


def propose(source: ModelSource, quant: str, ctx: int, batch: int, usable: int,
            corrections_for, prefer: str, device: str, attn: str = "auto", limit: int = 3) -> list[dict]:
    """Concrete next configurations, in the policy's order, each with its corrected estimate
    (``corrections_for(quant)`` gives this machine's corrections for a quantization)."""
    ctxs = _halves(ctx, 17 if ctx < 2048 else 1024)
    batches = _halves(batch, 1)
    quants = _lower(quant)
    steps: list[tuple[str, int, int, str, str]] = []  # (quant, ctx, batch, kv_dtype, what changed)
    if prefer == "quality":
        steps += [(quant, ctx, b, "auto", f"batch {batch} -> {b}") for b in batches]
        steps += [(quant, c, 1 if batches else batch, "auto", f"ctx {ctx} -> {c}") for c in ctxs]
        steps += [(quant, ctx, batch, "fp8", "fp8 KV cache")]
        steps += [(q, ctx, batch, "auto", f"quant {quant} -> {q}") for q in quants]
    elif prefer == "context":
        steps += [(q, ctx, batch, "auto", f"quant {quant} -> {q}") for q in quants]
        steps += [(quants[-1] if quants else quant, ctx, batch, "fp8", "lowest quant + fp8 KV cache")]
        steps += [(quants[-1] if quants else quant, ctx, b, "auto", f"lowest quant, batch {batch} -> {b}")
                  for b in batches]
        steps += [(quants[-1] if quants else quant, c, 1, "auto", f"lowest quant, batch 1, ctx {ctx} -> {c}")
                  for c in ctxs]
    else:  # throughput
        steps += [(q, ctx, batch, "auto", f"quant {quant} -> {q}") for q in quants]
        steps += [(quants[-1] if quants else quant, c, batch, "auto", f"lowest quant, ctx {ctx} -> {c}")
                  for c in ctxs]
        steps += [(quants[-1] if quants else quant, ctxs[-1] if ctxs else ctx, b, "auto",
                   f"lowest quant and ctx, batch {batch} -> {b}") for b in batches]
    estimators: dict[tuple[str, str], Estimator] = {}
    out = []
    for q, c, b, kv, what in steps:
        key = (q, kv)
        try:
            if key not in estimators:
                estimators[key] = Estimator(source, resolve_quant(q, source.config), attn=attn, kv_dtype=kv,
                                            device=device)
            e = estimators[key].estimate(c, b, exact=False).to_dict()
        except UserError:
            continue
        fixed = reconcile.apply(e["stages"], c, b, corrections_for(q), margin="p95")
        peak = max(fixed.values())
        if peak <= usable:
            out.append({"quant": q, "ctx": c, "batch": b, "kv_dtype": kv, "change": what,
                        "corrected_peak_bytes": peak, "raw_peak_bytes": e["peak"],
                        "command": f"vramcal check {source.name} --quant {q} --ctx {c} --batch {b} --device {device}"
                                   + (" --kv-dtype fp8" if kv == "fp8" else "")})
            if len(out) >= limit:
                break
    return out


# ------------------------------------------------------------------------------------------ fit

def fit_contexts(model: str, budget: int, *, device: str, db: str | None, buffer: int = DEFAULT_BUFFER,
                 quants=("bf16", "int8", "nf4-dq", "nf4"), batches=(1, 2, 4, 8)) -> list[dict]:
    """The largest ctx per quant and batch whose corrected estimate, at the p95 of this machine's
    residuals, stays within ``budget - buffer``."""
    from ..probes.machine import machine_fingerprint

    source = resolve_model(model)
    fp = machine_fingerprint(device)
    from .fleet import find_correction

    with Store(db) as store:
        corr_by_quant = {q: find_correction(store, fp, q, source.config_hash).corrections for q in quants}
    usable = budget - buffer
    from .. estimator.resolve import text_config

    max_ctx = int(text_config(source.config).get("max_position_embeddings") or 131072)
    rows = []
    for q in quants:
        est = Estimator(source, resolve_quant(q, source.config), device=device)
        corr = corr_by_quant[q]

        def peak(c, b):
            pts = est.sweep([(c, b)])[0]
            stages = {k: pts[k] for k in reconcile.STAGES}
            return max(reconcile.apply(stages, c, b, corr, margin="p95").values())

        for b in batches:
            lo, hi = 17, max_ctx
            if peak(lo, b) > usable:
                rows.append({"quant": q, "batch": b, "max_ctx": None, "peak_bytes": peak(lo, b)})
                continue
            while lo < hi:  # largest ctx with peak <= usable
                mid_c = (lo + hi + 1) // 2
                if peak(mid_c, b) <= usable:
                    lo = mid_c
                else:
                    hi = mid_c - 1
            rows.append({"quant": q, "batch": b, "max_ctx": lo, "peak_bytes": peak(lo, b)})
    return rows


# ----------------------------------------------------------------------------------------- memos

def memo_for(run: dict) -> dict:
    """The known-good memo: every item of the documents' checklist, from one recorded run."""
    import json

    result = json.loads(run["result_json"]) if run.get("result_json") else {}
    stages = run["stages"]
    peak_stage, peak = None, None
    for name in reconcile.STAGES:
        v = (stages.get(name) or {}).get("measured_peak_bytes")
        if v is not None and (peak is None or v > peak):
            peak, peak_stage = v, name
    cpu = run["device"] == "cpu"
    torch_peak = max((s.get("torch_max_reserved") or 0 for s in stages.values()), default=0) or None
    return {
        "run_id": run["id"], "recorded_at": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run["created_at"])),
        "model": run["model"], "quantization": run["quant"], "implementation": run["quant_impl"],
        "context_length": run["ctx"], "batch_size": run["batch"],
        "peak_bytes": peak,
        "peak_read_from": ("process resident set, sampled every %g ms (above the process's baseline)"
                           if cpu else "NVML memory.used, sampled every %g ms") % (result.get("interval_ms") or 5),
        "torch_allocator_peak_reserved_bytes": torch_peak,
        "peak_stage": {"load_peak": "load", "post_load": "load", "first_token": "first inference (prefill)",
                       "end": "generation"}.get(peak_stage, peak_stage),
        "device": run["device"], "gpu_model": run.get("gpu_name") or (run.get("cpu_model") if cpu else None),
        "total_memory_bytes": run.get("total_bytes"), "host": run.get("hostname"),
        "command": run["command"], "status": run.get("status"),
    }


def memo_markdown(m: dict) -> str:
    return "\n".join([
        f"# Known-good configuration: {m['model']}",
        "",
        f"- **Quantization**: {m['quantization']} ({m['implementation']})",
        f"- **Context length**: {m['context_length']}",
        f"- **Batch size**: {m['batch_size']}",
        f"- **Peak memory**: {fmt_gib_gb(m['peak_bytes'])} — read from {m['peak_read_from']}"
        + (f"; torch allocator reserved {fmt_gib_gb(m['torch_allocator_peak_reserved_bytes'])}"
           if m.get("torch_allocator_peak_reserved_bytes") else ""),
        f"- **Peak stage**: {m['peak_stage']}",
        f"- **Device**: {m['gpu_model'] or m['device']}, {fmt_gib_gb(m['total_memory_bytes'])} total",
        f"- **Command**: `{m['command']}`",
        f"- Recorded {m['recorded_at']} on {m['host']}, run {m['run_id']}",
        "",
        "Recheck after a change: `vramcal memo --recheck` re-runs the command and compares the peak.",
    ]) + "\n"


RECHECK_TOLERANCE = 0.05
RECHECK_FLOOR = 64 * 1024**2


def recheck(memo: dict, db: str | None) -> dict:
    """Re-run a memo's probe with the same settings and compare its peak with the recorded one."""
    from ..probes.machine import machine_fingerprint
    from ..probes.probe import run_probe

    with Store(db) as store:
        run = store.run(memo["run_id"])
    if run is None:
        raise UserError(f"run {memo['run_id']} of this memo is not in the database")
    synthetic = "--synthetic" in run["command"]
    result = run_probe(run["model"], run["quant"], run["ctx"], run["batch"], device=run["device"],
                       synthetic=synthetic, attn=run["attn"] or "auto", command=run["command"] + "  # recheck")
    with Store(db) as store:
        mid = store.machine_id(machine_fingerprint(run["device"]))
        new_id = record_probe(store, mid, result, result.estimate)
    peak, stage = measured_peak(result)
    old = memo["peak_bytes"]
    tol = max(RECHECK_TOLERANCE * (old or 0), RECHECK_FLOOR)
    same = result.status == "ok" and peak is not None and old is not None and abs(peak - old) <= tol
    return {"memo_run": memo["run_id"], "recheck_run": new_id, "status": result.status, "old_peak_bytes": old,
            "new_peak_bytes": peak, "difference_bytes": None if peak is None or old is None else peak - old,
            "tolerance_bytes": int(tol), "consistent": same}
