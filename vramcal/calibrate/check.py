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
from ..estimator.estimate import estimate as _estimate
from ..estimator.quant import resolve_quant
from ..estimator.resolve import resolve_model
from ..records.store import Store, new_uuid
from ..units import GIB, fmt_gib_gb
from ..workload import NEW_TOKENS, Configuration, choice, parse_device, parse_dtype, workload
from . import reconcile
from .corrections import lookup, refit
from .fleet import save_probe_unrecorded
from .memo import memo_for
from .proposals import POLICIES, propose
from .runs import Journal, begin_run, budget_for, measured_peak, record_failure, record_probe, recover_journals

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
    command: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def verdict_for(result, total: int, buffer: int) -> Verdict:
    peak, stage = measured_peak(result)
    if result.status == "oom":
        return Verdict(False, result.status, total, buffer, peak, stage, None, result.oom.get("stage"),
                       f"out of memory at {result.oom.get('stage')}")
    if result.status != "ok":
        return Verdict(False, result.status, total, buffer, peak, stage, None, None,
                       f"the probe did not finish: {result.error}")
    fits = peak is not None and peak <= total - buffer
    return Verdict(fits, result.status, total, buffer, peak, stage, None if peak is None else total - peak, None,
                   f"fits with {fmt_gib_gb(total - peak)} headroom" if fits else
                   f"runs, but the peak {fmt_gib_gb(peak)} leaves less than the {fmt_gib_gb(buffer)} buffer "
                   f"of {fmt_gib_gb(total)}")


def check(model: str, quant: str = "auto", ctx: int | None = None, batch: int = 1, *, device: str = "cuda:0",
          db: str | None = None, budget: int | None = None, buffer: int = DEFAULT_BUFFER, prefer: str = "quality",
          synthetic: bool = False, attn: str = "auto", dtype: str | None = None, kv_dtype: str = "auto",
          cache: str = "dynamic", new_tokens: int = NEW_TOKENS, prompt: int | None = None,
          interval_ms: float = 5.0, on_event=None) -> CheckResult:
    from ..probes.machine import machine_fingerprint, stack_key
    from ..probes.probe import ProbeInterrupted, preflight, run_probe

    # ---- validate everything first: nothing is written for bad input
    work = workload(ctx, batch, new_tokens, prompt)
    dev = str(parse_device(device))
    choice(prefer, POLICIES, "--prefer")
    dtype = parse_dtype(dtype)
    source = resolve_model(model)
    spec = resolve_quant(quant, source.config, dtype)
    preflight(source, spec, dev, synthetic, interval_ms)
    fp = machine_fingerprint(dev)
    total = budget_for(dev, fp, budget)
    if buffer >= total:
        raise UserError(f"--buffer {fmt_gib_gb(buffer)} leaves nothing of the {fmt_gib_gb(total)} budget")
    est = _estimate(source, quant, batch=work.batch, prompt=work.prompt, new_tokens=work.new_tokens, dtype=dtype,
                    attn=attn, kv_dtype=kv_dtype, cache=cache, device="cpu" if dev == "cpu" else "cuda").to_dict()
    config = Configuration(source.ref, work, quant=quant, device=dev, dtype=dtype, kv_dtype=kv_dtype, attn=attn,
                           cache=cache, synthetic=synthetic)
    cmd = config.command("check")

    with Store(db) as store:
        recover_journals(store)
        machine_id = store.machine_id(fp)
        run_uuid = new_uuid()
        run_id = begin_run(store, machine_id, {"model": source.name, "config_hash": source.config_hash,
                                               "quant": spec.name, "quant_implementation": spec.implementation,
                                               "dtype": spec.dtype, "ctx": work.ctx, "batch": work.batch,
                                               "attn": attn, "device": dev, "kv_dtype": kv_dtype}, est, cmd,
                           uuid=run_uuid)
        journal = Journal(store, run_id)

        def keep(result) -> None:
            """Record the result; if the store cannot take it, keep it in a file and say where."""
            result.estimate = est  # estimated once, above, and recorded with the run before the probe started
            try:
                record_probe(store, machine_id, result, est, run_id=run_id)
            except UserError as exc:
                path = save_probe_unrecorded(fp, result, est, run_uuid=run_uuid, command=cmd, error=str(exc),
                                             config_hash=source.config_hash, kv_dtype=kv_dtype)
                raise UserError(f"{exc}; the measurement is kept in {path}: `vramcal records import {path}` "
                                "records it once the database is back") from None
            journal.close()

        try:
            result = run_probe(source, quant, work.ctx, work.batch, device=dev, synthetic=synthetic,
                               interval_ms=interval_ms, dtype=dtype, attn=attn, command=cmd, with_estimate=False,
                               new_tokens=work.new_tokens, kv_dtype=kv_dtype, cache=cache, journal=journal,
                               on_event=on_event)
        except ProbeInterrupted as exc:  # Ctrl-C or SIGTERM: the record keeps what was measured
            keep(exc.result)
            raise
        except UserError as exc:
            record_failure(store, run_id, "error", str(exc))
            journal.close()
            raise
        keep(result)
        stack = stack_key(fp)
        corr = refit(store, machine_id, stack, spec.name, source.config_hash)
        verdict = verdict_for(result, total, buffer)
        out = CheckResult(run_id, machine_id, verdict, result.to_dict(),
                          {k: asdict(v) for k, v in corr.stages.items()}, reconcile.component_deltas(result),
                          command=cmd)
        out.probe.pop("samples", None)
        if verdict.fits:
            out.memo_id = store.add_memo(run_id, memo_for(store.run(run_id)))
        else:
            out.proposals = propose(source, "auto" if spec.pre_quantized else spec.name, work, total - buffer,
                                    lambda q: lookup(store, fp, q, source.config_hash), prefer, dev,
                                    attn=attn, synthetic=synthetic, requantize=not spec.pre_quantized)
    return out
