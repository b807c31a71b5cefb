"""Reconcile a measurement with its estimate, fit per-machine corrections, apply them.

A correction belongs to one machine and one software stack (:func:`vramcal.probes.machine.stack_key`),
and within it to a *scope*, most specific first (:func:`scopes`): the same model and quantization
(the source documents' "reuse the difference when only the context or batch changes"), then the same
quantization on any model, then any run on the stack. An estimate takes the most specific scope that
has runs. Per stage it is ``measured - estimated = intercept + slope * tokens`` (tokens = ctx x
batch), fitted by least squares over the scope's finished runs; one run, or runs at a single token
count, give an intercept only. The residuals' p50 and p95 say how far a corrected estimate is likely
to be off.

On the CPU path the measured figure is the child's reading minus its baseline (docs/accounting.md).
"""

from __future__ import annotations

import statistics

from ..estimator.correction import Correction, apply
from ..workload import NEW_TOKENS, STAGES

__all__ = ["Correction", "apply", "stage_rows", "component_deltas", "fit_corrections", "fit_scoped", "scopes"]


def stage_rows(result) -> list[dict]:
    """Rows for the ``stages`` table: estimate beside measurement, per stage of a probe result. The
    measured figures follow the probe's one baseline rule (``ProbeResult.measured``); the baseline row
    itself is kept as read, so the absolute figure stays in the records."""
    est = (result.estimate or {}).get("stages", {})
    placed = ((result.estimate or {}).get("devices") or {}).get(result.device)
    if placed:  # a split run: the main device's series beside the main device's estimate, not the GPU sum
        est = placed["stages"]
    measured = result.measured()
    absolute = result.readings()
    rows = []
    for name, r in measured.items():
        if name == "baseline":
            r = absolute[name]
        rows.append({"stage": name, "estimated_bytes": est.get(name), "measured_peak_bytes": r.peak_bytes,
                     "measured_used_bytes": r.used_bytes, "torch_max_allocated": r.torch_max_allocated,
                     "torch_max_reserved": r.torch_max_reserved})
    return rows


def device_stage_rows(result) -> list[dict]:
    """Rows for the ``device_stages`` table of a split run: per device and stage, the estimate beside
    the measurement (GPUs: NVML; ``cpu``: the child's resident set above its baseline)."""
    est = (result.estimate or {}).get("devices") or {}
    rows = []
    for dev, stages in (getattr(result, "devices", None) or {}).items():
        e = est.get(dev, {}).get("stages", {})
        for name, st in stages.items():
            rows.append({"device": dev, "stage": name, "estimated_bytes": e.get(name),
                         "measured_peak_bytes": st.get("peak_bytes"), "measured_used_bytes": st.get("used_bytes")})
    return rows


def component_deltas(result) -> dict[str, int | None]:
    """Measured minus estimated where the stages separate the components: the context
    (``context - baseline``), the weights (``post_load`` minus where loading started) and generation
    (the prefill's peak above ``post_load``, minus the estimated activations and prompt cache). A CPU
    estimate's stages are the resident set, so there the weights are compared with its ``post_load``
    stage and generation with its ``first_token - post_load``. Each
    difference of two readings goes through the one delta rule (``StageReading.minus``)."""
    read = result.readings()
    est = (result.estimate or {}).get("components", {})
    out: dict[str, int | None] = {"context": None, "weights": None, "generation": None}
    start = read.get("context") or read.get("baseline")
    if "context" in read and "baseline" in read:
        out["context"] = read["context"].minus(read["baseline"]).used_bytes
    staged = (result.estimate or {}).get("stages", {})
    if "resident set" in (result.estimate or {}).get("methods", {}) and staged:
        # the CPU estimate's stages are the resident set (mapped pages, heap), not the tensors: compare
        # what loading added with its post_load stage, and the prefill with its first_token - post_load
        if start is not None and "post_load" in read:
            added = read["post_load"].minus(start).used_bytes
            out["weights"] = None if added is None else added - staged["post_load"]
        if "first_token" in read and "post_load" in read:
            above = read["first_token"].minus(read["post_load"]).peak_bytes
            out["generation"] = None if above is None else above - (staged["first_token"] - staged["post_load"])
        return out
    if start is not None and "post_load" in read and est.get("weights") is not None:
        added = read["post_load"].minus(start).used_bytes
        out["weights"] = None if added is None else added - est["weights"]
    if "first_token" in read and "post_load" in read and est:
        above = read["first_token"].minus(read["post_load"]).peak_bytes
        out["generation"] = None if above is None else above - est.get("activations", 0) - _kv_prompt(result)
    return out


def _kv_prompt(result) -> int:
    """The estimate's cache right after the prefill, scaled from its cache at the end."""
    est = result.estimate or {}
    kv_end = est.get("components", {}).get("kv_cache", 0)
    new = est.get("new_tokens") or getattr(result, "new_tokens", None) or NEW_TOKENS
    prompt = est.get("prompt") or (est.get("ctx") or result.ctx) - new
    return int(kv_end * prompt / max(prompt + new - 1, 1))


def _percentile(values: list[float], q: float) -> float:
    """The q-quantile with linear interpolation between order statistics (numpy's default)."""
    if not values:
        return 0.0
    if len(values) == 1:
        return float(values[0])
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1] if 0 < q < 1 else \
        float(min(values) if q <= 0 else max(values))


def scopes(stack: str, quant: str, config_hash: str | None) -> list[tuple[str, dict]]:
    """(scope key, row filter) from the most specific to the least."""
    out = []
    if config_hash:
        out.append((f"{stack}|quant={quant}|model={config_hash}", {"quant": quant, "config_hash": config_hash}))
    out.append((f"{stack}|quant={quant}", {"quant": quant}))
    out.append((stack, {}))
    return out


def scope_label(key: str | None) -> str:
    """A scope key of :func:`scopes` in a word: ``model+quant``, ``quant``, ``machine`` (``none`` for None)."""
    if key is None:
        return "none"
    return "model+quant" if "|model=" in key else "quant" if "|quant=" in key else "machine"


def rows_in(rows: list[dict], where: dict) -> list[dict]:
    return [r for r in rows if all(r.get(k) == v for k, v in where.items())]


def fit_scoped(rows: list[dict], stack: str, quant: str, config_hash: str | None,
               exclude_run: int | None = None) -> tuple[str | None, dict[str, "Correction"]]:
    """The corrections of the most specific scope that has finished runs (other than ``exclude_run``)."""
    for key, where in scopes(stack, quant, config_hash):
        corr = fit_corrections(rows_in(rows, where), exclude_run=exclude_run)
        if corr:
            return key, corr
    return None, {}


def fit_line(stage: str, points: list[tuple[int, int, int]]) -> Correction:
    """``measured - estimated = intercept + slope x tokens`` by least squares over ``(tokens, delta,
    run id)`` points; one point, or points at one token count, give an intercept only."""
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    n = len(points)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    intercept = my - slope * mx
    res = [abs(y - (intercept + slope * x)) for x, y in zip(xs, ys)]
    return Correction(stage, int(round(intercept)), slope, n, int(_percentile(res, 0.5)), int(_percentile(res, 0.95)),
                      sorted({p[2] for p in points}))


def comparable_estimate(row: dict) -> bool:
    """Whether a stage row's recorded estimate is one the current estimator would make: a CPU run
    estimated before the resident-set model (docs/cpu-memory.md) compared torch's tensors with a
    resident set, so its difference would be added to a figure that already holds it."""
    return not str(row.get("device") or "").startswith("cpu") or row.get("rss_estimate") in (None, True, 1)


def fit_corrections(rows: list[dict], exclude_run: int | None = None) -> dict[str, Correction]:
    """Fit one correction per stage from ``stages`` rows of finished runs (``status == 'ok'``) whose
    estimate is comparable (:func:`comparable_estimate`)."""
    out = {}
    for stage in STAGES:
        pts = [(r["ctx"] * r["batch"], r["measured_peak_bytes"] - r["estimated_bytes"], r["run_id"]) for r in rows
               if r["stage"] == stage and r.get("status") == "ok" and r["run_id"] != exclude_run
               and r["measured_peak_bytes"] is not None and r["estimated_bytes"] is not None
               and comparable_estimate(r)]
        if pts:
            out[stage] = fit_line(stage, pts)
    return out


def corrections_from_rows(rows: dict[str, dict]) -> dict[str, Correction]:
    return {stage: Correction(stage, r["intercept_bytes"], r["slope_bytes_per_token"], r["n_runs"],
                              r.get("residual_p50_bytes") or 0, r.get("residual_p95_bytes") or 0, r["source_runs"])
            for stage, r in rows.items()}
