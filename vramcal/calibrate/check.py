"""``check``: the one-shot job. Estimate -> probe -> reconcile -> record -> verdict, and when the run
does not fit, proposals (:mod:`vramcal.calibrate.proposals`).

Everything the user typed is validated before anything is written; once the run's row exists, every
way the probe can end (finished, out of memory, crashed, Ctrl-C, SIGTERM, bad input found late)
closes it with a result, and a SIGKILL of this process is recovered from the run's journal by the
next command that writes (:mod:`vramcal.calibrate.runs`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..errors import UserError
from ..estimator.correction import Correction
from ..estimator.estimate import estimate as _estimate
from ..estimator.estimate import placement_request
from ..estimator.formats import CPU
from ..estimator.quant import resolve_quant
from ..estimator.resolve import resolve_model
from ..estimator.vision import check_images
from ..probes.result import ProbeResult
from ..records.store import Store
from ..units import GIB, fmt_gib_gb
from ..workload import NEW_TOKENS, Configuration, choice, device_kind, parse_device, parse_dtype, workload
from . import reconcile
from .corrections import lookup, refit, refit_devices
from .memo import memo_for
from .proposals import POLICIES, Proposal, propose
from .runs import budget_for, measured_peak, probe_and_record

DEFAULT_BUFFER = 2 * GIB


@dataclass
class DeviceVerdict:
    budget_bytes: int
    peak_bytes: int | None
    peak_stage: str | None
    fits: bool


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
    held_by_others_bytes: int = 0  # with a budget read from free memory: what others held when it was read
    others: list[str] = field(default_factory=list)  # one line per device: free memory and who holds the rest
    devices: dict[str, DeviceVerdict] | None = None  # a split run: per GPU


@dataclass
class CheckResult:
    run_id: int
    machine_id: int
    verdict: Verdict
    probe: ProbeResult
    corrections: dict[str, Correction]  # the refitted correction per stage ("cuda:1 end" for a split)
    component_deltas: reconcile.ComponentDeltas = field(default_factory=reconcile.ComponentDeltas)
    proposals: list[Proposal] = field(default_factory=list)
    memo_id: int | None = None
    command: str = ""

    def to_dict(self) -> dict:
        return {"run_id": self.run_id, "machine_id": self.machine_id, "verdict": asdict(self.verdict),
                "probe": self.probe.to_dict(samples=False), "corrections": {k: asdict(c) for k, c in
                                                                             self.corrections.items()},
                "component_deltas": dict(self.component_deltas.items()),
                "proposals": [p.to_dict() for p in self.proposals], "memo_id": self.memo_id,
                "command": self.command}


def verdict_for(result: ProbeResult, total: int, buffer: int, held: int = 0) -> Verdict:
    """Fits when the measured peak, less what other processes ``held`` when the budget was read from
    free memory (NVML's memory.used counts them), stays ``buffer`` below the budget ``total``. ``held`` is
    total - free, the driver's reserve in it: the part of it the measured figures already left out
    (:meth:`ProbeResult.reserve_of`) is not taken off twice."""
    peak, stage = measured_peak(result)
    if peak is not None and held:
        peak -= others_held(held, result.reserve_of(result.series))
    if result.status == "oom":
        return Verdict(False, result.status, total, buffer, peak, stage, None, result.oom.stage,
                       f"out of memory at {result.oom.stage}")
    if result.status != "ok":
        return Verdict(False, result.status, total, buffer, peak, stage, None, None,
                       f"the probe did not finish: {result.error}")
    fits = peak is not None and peak <= total - buffer
    return Verdict(fits, result.status, total, buffer, peak, stage, None if peak is None else total - peak, None,
                   f"fits with {fmt_gib_gb(total - peak)} headroom" if fits else
                   f"runs, but the peak {fmt_gib_gb(peak)} leaves less than the {fmt_gib_gb(buffer)} buffer "
                   f"of {fmt_gib_gb(total)}")


def placed_verdict(result: ProbeResult, budgets: dict[str, int], buffer: int, held: dict[str, int]) -> Verdict:
    """A split run fits when every GPU of the map, on its own, fits its budget minus the buffer."""
    from ..probes.result import device_series

    per: dict[str, DeviceVerdict] = {}
    measured = result.measured_devices() or {}
    for dev, total in budgets.items():
        stages = measured.get(dev, {})
        peaks = [(r.peak_bytes, name) for name, r in stages.items()
                 if name not in ("baseline", "context") and r.peak_bytes is not None]
        peak, stage = max(peaks) if peaks else (None, None)
        if peak is not None and held.get(dev):
            peak -= others_held(held[dev], result.reserve_of(device_series(dev)))
        per[dev] = DeviceVerdict(total, peak, stage, peak is not None and peak <= total - buffer)
    main = verdict_for(result, budgets[result.device], buffer, held.get(result.device, 0))
    worst = max(per, key=lambda d: (per[d].peak_bytes or 0) - per[d].budget_bytes)
    if result.status == "ok":
        fits = all(v.fits for v in per.values())
        w = per[worst]
        main.fits = fits
        main.peak_bytes, main.peak_stage, main.budget_bytes = w.peak_bytes, w.peak_stage, w.budget_bytes
        main.headroom_bytes = None if w.peak_bytes is None else w.budget_bytes - w.peak_bytes
        main.reason = (f"every GPU fits; the tightest, {worst}, with {fmt_gib_gb(main.headroom_bytes)} headroom" if fits
                       else f"{worst} peaks at {fmt_gib_gb(w.peak_bytes)}, over its {fmt_gib_gb(w.budget_bytes)} "
                            f"less the {fmt_gib_gb(buffer)} buffer")
    main.devices = per
    return main


def others_held(held: int, reserve: int | None) -> int:
    """What other processes held of a device whose total - free was ``held``: less the driver's reserve
    where the probe's figures left it out (None: they include it, and so does this)."""
    return held - (reserve or 0)


def budgets_for(devices: list[str], budget: int | None, buffer: int) -> tuple[dict[str, int], dict, list]:
    """The budget of each GPU: ``budget`` when given (each GPU), else its free memory now (NVML, the one
    door), with what others held and one line per device saying who. Returns (budgets, held, lines)."""
    from ..probes.machine import budget_from_free

    if budget is not None:
        return {d: budget for d in devices}, {}, []
    budgets, held, lines = {}, {}, []
    for d in devices:
        free, fm = budget_from_free(d, buffer)
        budgets[d], held[d] = free, fm.held_bytes or 0
        lines.append(fm.describe())
    return budgets, held, lines


def check(model: str, quant: str = "auto", ctx: int | None = None, batch: int = 1, *, device: str = "cuda:0",
          db: str | None = None, budget: int | None = None, buffer: int = DEFAULT_BUFFER, prefer: str = "quality",
          synthetic: bool = False, attn: str = "auto", dtype: str | None = None, kv_dtype: str = "auto",
          cache: str = "dynamic", new_tokens: int = NEW_TOKENS, prompt: int | None = None,
          interval_ms: float = 5.0, on_event=None, max_memory: dict | str | None = None,
          device_map: str | None = None, images: int = 0, image_size=None, gpu=None) -> CheckResult:
    """``budget`` None: each GPU's free memory when the check starts (other processes' share named in the
    verdict). ``max_memory`` / ``device_map`` split the model (docs/placement.md): every GPU of the map
    is measured and must fit its own budget; corrections are refitted per device position."""
    from ..probes.machine import free_memory, machine_fingerprint, stack_key
    from ..probes.probe import preflight

    # ---- validate everything first: nothing is written for bad input
    work = workload(ctx, batch, new_tokens, prompt, images, image_size)
    dev = str(parse_device(device))
    choice(prefer, POLICIES, "--prefer")
    dtype = parse_dtype(dtype)
    source = resolve_model(model)
    check_images(source.config, work.images, source.name)
    spec = resolve_quant(quant, source, dtype, gpu or (CPU if device_kind(dev) == "cpu" else None))
    placed = placement_request(max_memory, device_map, dev)
    preflight(source, spec, dev, synthetic, interval_ms, kv_dtype, cache, max_memory, device_map)
    est = _estimate(source, quant, batch=work.batch, prompt=work.prompt, new_tokens=work.new_tokens, dtype=dtype,
                    attn=attn, kv_dtype=kv_dtype, cache=cache, device=device_kind(dev),
                    max_memory=max_memory, device_map=device_map, images=work.images, image_size=work.image_size,
                    gpu=gpu)
    gpus = [d for d in (est.devices or {}) if d.startswith("cuda")]
    if placed is not None:
        dev = est.main_device
    fp = machine_fingerprint(dev)
    if dev == "cpu" or budget is not None and placed is None:
        budgets, held, others = {dev: budget_for(dev, fp, budget)}, {}, []
    else:
        budgets, held, others = budgets_for(gpus or [dev], budget, buffer)
    total = budgets[dev]
    if buffer >= min(budgets.values()):
        raise UserError(f"--buffer {fmt_gib_gb(buffer)} leaves nothing of the {fmt_gib_gb(min(budgets.values()))} budget")
    config = Configuration(source.ref, work, quant=quant, device=dev, dtype=dtype, kv_dtype=kv_dtype, attn=attn,
                           cache=cache, synthetic=synthetic,
                           max_memory=None if placed is None else placed[0],
                           device_map=None if placed is None or device_map is None else placed[1])
    cmd = config.command("check")

    with Store(db) as store:
        run_id, machine_id, result = probe_and_record(store, fp, config, source, spec, est, command=cmd,
                                                      interval_ms=interval_ms, on_event=on_event)
        stack = stack_key(fp)
        if placed is None:
            corrections = refit(store, machine_id, stack, spec.name, source.config_hash, device_kind(dev)).stages
            verdict = verdict_for(result, total, buffer, held.get(dev, 0))
        else:  # a correction per device position
            per = refit_devices(store, machine_id, stack, spec.name, source.config_hash, gpus)
            verdict = placed_verdict(result, budgets, buffer, held)
            corrections = {f"{d} {k}": v for d, c in per.items() for k, v in c.stages.items()}
        verdict.others = others
        verdict.held_by_others_bytes = held.get(dev, 0)
        out = CheckResult(run_id, machine_id, verdict, result, corrections, reconcile.component_deltas(result),
                          command=cmd)
        if verdict.fits:
            out.memo_id = store.add_memo(run_id, memo_for(store.run(run_id)))
        elif placed is None:
            out.proposals = propose(source, "auto" if spec.pre_quantized else spec.name, work, total - buffer,
                                    lambda q: lookup(store, fp, q, source.config_hash), prefer, dev,
                                    attn=attn, synthetic=synthetic, requantize=not spec.pre_quantized,
                                    cpu_bytes=None if dev == "cpu" else free_memory("cpu").free_bytes)
    return out
