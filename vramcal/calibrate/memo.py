"""Known-good memos: every item of the source documents' checklist, from one recorded run that fit,
and ``recheck``: run the memo's configuration again and compare the peak."""

from __future__ import annotations

import json
import time

from ..errors import UserError
from ..records.store import Store
from ..workload import STAGES, Configuration
from .runs import measured_peak, record_probe

PEAK_STAGE_WORDS = {"load_peak": "load", "post_load": "load", "first_token": "first inference (prefill)",
                    "end": "generation"}
RECHECK_TOLERANCE = 0.05
RECHECK_FLOOR = 64 * 1024**2


def memo_for(run: dict) -> dict:
    """The known-good memo of one recorded run (``Store.run``)."""
    result = json.loads(run["result_json"]) if run.get("result_json") else {}
    stages = run["stages"]
    peak_stage, peak = None, None
    for name in STAGES:
        v = (stages.get(name) or {}).get("measured_peak_bytes")
        if v is not None and (peak is None or v > peak):
            peak, peak_stage = v, name
    cpu = run["device"] == "cpu"
    reserved = [s.get("torch_max_reserved") for s in stages.values() if s.get("torch_max_reserved") is not None]
    return {
        "run_id": run["id"], "recorded_at": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run["created_at"])),
        "model": run["model"], "quantization": run["quant"], "implementation": run["quant_impl"],
        "context_length": run["ctx"], "batch_size": run["batch"],
        "new_tokens": result.get("new_tokens") or (result.get("estimate") or {}).get("new_tokens"),
        "peak_bytes": peak,
        "peak_read_from": ("process resident set, sampled every %g ms (above the process's baseline)"
                           if cpu else "NVML memory.used, sampled every %g ms") % (result.get("interval_ms") or 5),
        "torch_allocator_peak_reserved_bytes": max(reserved) if reserved else None,
        "peak_stage": PEAK_STAGE_WORDS.get(peak_stage, peak_stage),
        "device": run["device"], "gpu_model": run.get("gpu_name") or (run.get("cpu_model") if cpu else None),
        "total_memory_bytes": run.get("total_bytes"), "host": run.get("hostname"),
        "command": run["command"], "status": run.get("status"),
    }


def recheck(memo: dict, config: Configuration, db: str | None, interval_ms: float = 5.0) -> dict:
    """Probe ``config`` (the memo's command, as parsed by the command line) again, record the run, and
    compare its peak with the memo's: consistent within 5 % or 64 MiB."""
    from ..probes.machine import machine_fingerprint
    from ..probes.probe import run_probe

    with Store(db, create=False, readonly=True) as store:
        if store.run(memo["run_id"]) is None:
            raise UserError(f"run {memo['run_id']} of this memo is not in the database")
    result = run_probe(config.model, config.quant, config.work.ctx, config.work.batch, device=config.device,
                       synthetic=config.synthetic, attn=config.attn, dtype=config.dtype, interval_ms=interval_ms,
                       new_tokens=config.work.new_tokens, command=config.command("check") + "  # recheck")
    with Store(db) as store:
        mid = store.machine_id(machine_fingerprint(config.device))
        new_id = record_probe(store, mid, result, result.estimate)
    peak, _ = measured_peak(result)
    old = memo["peak_bytes"]
    tol = max(RECHECK_TOLERANCE * (old or 0), RECHECK_FLOOR)
    same = result.status == "ok" and peak is not None and old is not None and abs(peak - old) <= tol
    return {"memo_run": memo["run_id"], "recheck_run": new_id, "status": result.status, "old_peak_bytes": old,
            "new_peak_bytes": peak, "difference_bytes": None if peak is None or old is None else peak - old,
            "tolerance_bytes": int(tol), "consistent": same}
