"""Known-good memos: every item of the source documents' checklist, from one recorded run that fit,
and ``recheck``: run the memo's configuration again, exactly, and compare the peak."""

from __future__ import annotations

import time

from ..errors import UserError
from ..records.store import RunRecord, Store
from ..workload import STAGES, Configuration

PEAK_STAGE_WORDS = {"load_peak": "load", "post_load": "load", "first_token": "first inference (prefill)",
                    "end": "generation"}
RECHECK_TOLERANCE = 0.05
RECHECK_FLOOR = 64 * 1024**2


def memo_for(run: RunRecord) -> dict:
    """The known-good memo of one recorded run (:meth:`Store.run`)."""
    ctx = run.context
    result = run.outcome.result if run.outcome else {}
    peak_stage, peak = None, None
    for name in STAGES:
        row = run.stages.get(name)
        v = row.measured_peak_bytes if row else None
        if v is not None and (peak is None or v > peak):
            peak, peak_stage = v, name
    cpu = ctx.device == "cpu"
    reserved = [s.torch_max_reserved for s in run.stages.values() if s.torch_max_reserved is not None]
    return {
        "run_id": run.id, "recorded_at": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run.created_at)),
        "model": ctx.model, "quantization": ctx.quant, "implementation": ctx.quant_impl,
        "context_length": ctx.ctx, "batch_size": ctx.batch,
        "new_tokens": result.get("new_tokens") or (ctx.estimate or {}).get("new_tokens"),
        "peak_bytes": peak,
        "peak_read_from": ("process resident set, sampled every %g ms (above the process's baseline)"
                           if cpu else "NVML memory.used, sampled every %g ms") % (result.get("interval_ms") or 5),
        "torch_allocator_peak_reserved_bytes": max(reserved) if reserved else None,
        "peak_stage": PEAK_STAGE_WORDS.get(peak_stage, peak_stage),
        "device": ctx.device, "split_devices": ctx.split_devices,
        "gpu_model": run.machine.get("gpu_name") or (run.machine.get("cpu_model") if cpu else None),
        "total_memory_bytes": run.machine.get("total_bytes"), "host": run.machine.get("hostname"),
        "command": ctx.command, "status": run.status,
        # the load that ran, as from_pretrained's arguments (vramcal.estimator.loading); None for a run
        # recorded without an estimate
        "from_pretrained": (ctx.estimate or {}).get("from_pretrained"),
        "auto_class": (ctx.estimate or {}).get("auto_class") or "AutoModelForCausalLM",
    }


def recheck(memo: dict, config: Configuration, db: str | None, interval_ms: float = 5.0) -> dict:
    """Probe ``config`` (the memo's command, as parsed by the command line) again -- every flag of it:
    KV dtype, cache, placement -- record the run however it ends (as ``check`` does), and compare its
    peak with the memo's: consistent within 5 % or 64 MiB."""
    from ..estimator.estimate import estimate
    from ..estimator.quant import resolve_quant
    from ..estimator.resolve import resolve_model
    from ..probes.machine import machine_fingerprint
    from ..probes.probe import preflight
    from ..workload import device_kind
    from .runs import measured_peak, probe_and_record

    with Store(db, create=False, readonly=True) as store:
        if store.run(memo["run_id"]) is None:
            raise UserError(f"run {memo['run_id']} of this memo is not in the database")
    source = resolve_model(config.model)
    spec = resolve_quant(config.quant, source, config.dtype)
    work = config.work
    preflight(source, spec, config.device, config.synthetic, interval_ms, config.kv_dtype, config.cache,
              config.max_memory, config.device_map)
    est = estimate(source, config.quant, batch=work.batch, prompt=work.prompt, new_tokens=work.new_tokens,
                   dtype=config.dtype, attn=config.attn, kv_dtype=config.kv_dtype, cache=config.cache,
                   device=device_kind(config.device), max_memory=config.max_memory, device_map=config.device_map,
                   images=work.images, image_size=work.image_size)
    device = est.main_device if est.devices else config.device
    with Store(db) as store:
        new_id, _, result = probe_and_record(store, machine_fingerprint(device), config, source, spec, est,
                                             command=config.command("check") + "  # recheck",
                                             interval_ms=interval_ms)
    peak, _ = measured_peak(result)
    old = memo["peak_bytes"]
    tol = max(RECHECK_TOLERANCE * (old or 0), RECHECK_FLOOR)
    same = result.status == "ok" and peak is not None and old is not None and abs(peak - old) <= tol
    return {"memo_run": memo["run_id"], "recheck_run": new_id, "status": result.status, "old_peak_bytes": old,
            "new_peak_bytes": peak, "difference_bytes": None if peak is None or old is None else peak - old,
            "tolerance_bytes": int(tol), "consistent": same}
