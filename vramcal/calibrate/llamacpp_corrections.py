"""What llama.cpp holds beyond its buffers, learned from this machine's llama.cpp runs.

llama.cpp logs every buffer it allocates, and vramcal prices those from the GGUF header and the flags
(:mod:`vramcal.estimator.llamacpp.buffers`). What a probe measures beyond them belongs to the process, not
to the model: on a GPU the CUDA context, cuBLAS's handles and the ggml-cuda kernels loaded (NVML's
``memory.used`` above the run's baseline, less the buffers logged on that GPU); on a CPU-only run what the
resident set grows by beyond the host buffers logged (the vocabulary, the graph's metadata, the thread
pool, pages of the mapped file touched or not). Measured against the *logged* buffers, not the predicted
ones, the term says nothing about how well the buffers were priced, so it carries over from one model to
another on the same machine.

Per machine -- else its machine class -- and per kind (GPU runs for the GPUs, CPU-only runs for the host),
the learned term is the mean over its finished, not withdrawn llama.cpp runs; it replaces the default of
:class:`~vramcal.estimator.llamacpp.fit.Beyond` in estimate, fit, plan (of this machine) and check.
"""

from __future__ import annotations

import json
import statistics

from ..estimator.llamacpp.buffers import device_of
from ..estimator.llamacpp.fit import DEFAULT_BEYOND, Beyond
from ..records.store import NOT_WITHDRAWN
from ..units import MIB

LLAMACPP_RUNS = ("SELECT r.id AS run_id, s.result_json FROM runs r JOIN results s ON s.run_id = r.id "
                 "JOIN machines m ON m.id = r.machine_id WHERE r.estimator_model LIKE 'llamacpp%' AND s.status = 'ok' "
                 "AND " + NOT_WITHDRAWN + " AND ")
AFTER_LOAD = ("post_load", "context", "first_token", "end")


def beyond_of(result: dict) -> tuple[str, int] | None:
    """(``"gpu"`` or ``"host"``, bytes) that one recorded llama.cpp run measured beyond its logged buffers: the
    highest reading after loading, less the baseline, less the buffers logged on the sampled device. None for
    a run with no buffer lines or no readings."""
    logged = result.get("llama_cpp_logged") or {}
    stages = result.get("stages") or {}
    series = result.get("series") or ""
    base = (stages.get("baseline") or {}).get("used_bytes")
    peaks = [(stages.get(s) or {}).get("peak_bytes") for s in AFTER_LOAD]
    peaks = [p for p in peaks if p is not None]
    if not logged.get("lines") or base is None or not peaks:
        return None
    if series == "rss":
        kind, device = "host", "CPU"
    elif series.startswith("gpu"):
        kind, device = "gpu", "CUDA0"  # the sampled GPU is the run's first, llama.cpp's device 0
    else:
        return None
    held = 0
    for part in ("model_buffer_bytes", "kv_buffer_bytes", "rs_buffer_bytes", "compute_buffer_bytes"):
        held += sum(b for name, b in (logged.get(part) or {}).items() if device_of(name) == device)
    if logged.get("output_buffer") and device_of(logged["output_buffer"]) == device:
        held += logged.get("output_buffer_bytes") or 0
    return kind, max(peaks) - base - held


def learned_beyond(rows: list[dict], scope: str) -> Beyond:
    """The :class:`Beyond` of recorded rows (``run_id``, ``result_json``): each kind's mean where runs measured
    it, else the default."""
    found: dict[str, list[tuple[int, int]]] = {"gpu": [], "host": []}
    for row in rows:
        try:
            got = beyond_of(json.loads(row["result_json"] or "{}"))
        except (ValueError, TypeError, AttributeError):
            continue
        if got is not None:
            found[got[0]].append((got[1], row["run_id"]))
    gpu, host = found["gpu"], found["host"]
    b = DEFAULT_BEYOND
    out = {}
    if gpu:
        mean = int(round(statistics.fmean(v for v, _ in gpu)))
        out.update(gpu_bytes=mean, gpu_source=_said(gpu, mean, scope, "NVML memory.used above the baseline"))
    if host:
        mean = int(round(statistics.fmean(v for v, _ in host)))
        out.update(host_bytes=mean, host_source=_said(host, mean, scope, "the resident set above the baseline"))
    if not out:
        return b
    return Beyond(**{**b.__dict__, **out, "source_runs": tuple(sorted(i for _, i in gpu + host))})


def _said(found: list[tuple[int, int]], mean: int, scope: str, what: str) -> str:
    lo, hi = min(v for v, _ in found), max(v for v, _ in found)
    spread = "" if len(found) == 1 else f", from {lo / MIB:,.2f} to {hi / MIB:,.2f} MiB"
    return (f"{scope}: {what} less the buffers llama.cpp logged, {mean / MIB:,.2f} MiB (the mean of {len(found)} "
            f"llama.cpp run(s){spread})")


def machine_beyond(db: str | None) -> tuple[Beyond, str | None]:
    """This machine's learned :class:`Beyond` (GPU runs under its GPU's fingerprint, CPU-only runs under its
    CPU's), else its machine class's; the default and why where the records hold none or cannot be read."""
    from ..probes import nvml
    from ..probes.machine import machine_fingerprint
    from ..records.machines import class_key
    from .corrections import lookup_store

    store, why = lookup_store(db)
    if store is None:
        return DEFAULT_BEYOND, why
    devices = ["cpu"] + (["cuda:0"] if nvml.available()[0] else [])
    rows: list[dict] = []
    scopes: list[str] = []
    try:
        with store:
            for device in devices:
                fp = machine_fingerprint(device)
                mid = store.find_machine(fp)
                got = store.query(LLAMACPP_RUNS + "r.machine_id = ? ORDER BY r.id", (mid,)) if mid is not None else []
                scope = "this machine"
                if not got:
                    got = store.query(LLAMACPP_RUNS + "m.class_key = ? ORDER BY r.id", (class_key(fp),))
                    scope = "this machine's class"
                if got:
                    rows += got
                    scopes.append(scope)
    except Exception as exc:  # noqa: BLE001 -- a lookup never fails an estimate; it says why
        why = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        return DEFAULT_BEYOND, f"no llama.cpp correction applied: {why}"
    scope = scopes[0] if len(set(scopes)) == 1 else "this machine and its class"
    return learned_beyond(rows, scope), None
