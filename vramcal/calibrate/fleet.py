"""Corrections that travel between the machines of a fleet.

:func:`find_correction` looks, scope by scope from the most specific (same model and quant, then same
quant, then any run; :func:`vramcal.calibrate.reconcile.scopes`), first for this exact machine's
recorded correction, then for its *machine class* (:func:`vramcal.records.machines.machine_class`:
same device model and memory, driver major, CUDA runtime, torch / transformers / bitsandbytes): the
finished runs of every host of the class in that scope, fitted together. A class correction says
which hosts and runs it came from, and its p95 band is widened by the spread between hosts (the
largest minus the smallest of the hosts' mean residuals, per stage), because a new host is another
draw from the class, not one of the runs.

Scope before source: a class correction for the same model and quant wins over this machine's
correction fitted on other models, since on the validation matrix the scope halved the error
(docs/calibration.md); within one scope this machine's own correction wins.

:func:`refit` records a machine's corrections without lost updates (``Store.refit`` holds the
machine's refit lock while it reads the runs and writes the fit).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..estimator.correction import CorrectionSet
from ..records.machines import class_key, class_label
from ..records.store import Store
from . import reconcile

SCOPE_NAMES = ("same model and quant", "same quant", "any run")


@dataclass
class FoundCorrection:
    corrections: dict[str, reconcile.Correction]
    source: str | None  # "machine", "class", or None (nothing recorded)
    scope: str | None  # one of SCOPE_NAMES
    scope_key: str | None
    machine_class: str
    hosts: list[str] = field(default_factory=list)
    runs: list[int] = field(default_factory=list)
    host_spread_bytes: dict[str, int] = field(default_factory=dict)  # per stage; class corrections only

    def label(self) -> str:
        if not self.source:
            return "no correction recorded for this machine or its class"
        hosts = ", ".join(self.hosts) or "?"
        runs = len(self.runs)
        if self.source == "machine":
            return f"this machine ({hosts}), {self.scope}, {runs} run{'s' * (runs != 1)}"
        return (f"machine class {class_label(self.machine_class)}: {len(self.hosts)} host"
                f"{'s' * (len(self.hosts) != 1)} ({hosts}), {self.scope}, {runs} run{'s' * (runs != 1)}, "
                "band widened by the spread between hosts")

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("corrections")
        d["label"] = self.label()
        return d

    def as_set(self) -> CorrectionSet:
        """What the estimator applies and shows: the stages, where they came from, the hosts."""
        if not self.source:
            return CorrectionSet({})
        if self.source == "machine":
            return CorrectionSet(self.corrections, scope=f"this machine, {self.scope}", hosts=list(self.hosts))
        widest = max(self.host_spread_bytes.values(), default=0)
        return CorrectionSet(self.corrections, hosts=list(self.hosts),
                             scope=f"machine class {class_label(self.machine_class)}, {self.scope}: "
                                   f"{len(self.hosts)} host{'s' * (len(self.hosts) != 1)}, p95 band widened by "
                                   f"their spread (up to {widest / 1024**2:.0f} MiB)")


def find_correction(store: Store, fingerprint: dict, quant: str, config_hash: str | None) -> FoundCorrection:
    """This machine's correction, else its class's, scope by scope (see the module's docstring)."""
    from ..probes.machine import stack_key

    ckey = class_key(fingerprint)
    mid = store.find_machine(fingerprint)
    class_rows: list[dict] | None = None
    scopes = reconcile.scopes(stack_key(fingerprint), quant, config_hash)
    for (key, where), scope in zip(scopes, SCOPE_NAMES[-len(scopes):]):
        if mid is not None:
            rows = store.latest_corrections(mid, key)
            if rows:
                corr = reconcile.corrections_from_rows(rows)
                return FoundCorrection(corr, "machine", scope, key, ckey, [fingerprint.get("hostname") or "?"],
                                       sorted({r for c in corr.values() for r in c.source_runs}))
        if class_rows is None:
            class_rows = [r for r in store.stage_rows(class_key=ckey) if "," not in (r.get("device") or "")]
        pooled = reconcile.rows_in(class_rows, where)
        corr = reconcile.fit_corrections(pooled)
        if corr:
            spread = widen_by_host_spread(corr, pooled)
            used = [r for r in pooled if r["run_id"] in {x for c in corr.values() for x in c.source_runs}]
            return FoundCorrection(corr, "class", scope, key, ckey, sorted({r["hostname"] or "?" for r in used}),
                                   sorted({r["run_id"] for r in used}), spread)
    return FoundCorrection({}, None, None, None, ckey)


def widen_by_host_spread(corr: dict[str, reconcile.Correction], rows: list[dict]) -> dict[str, int]:
    """Per stage, the spread between hosts (max - min of each host's mean residual against the pooled
    fit), added to the correction's p95 residual in place; returns the spreads."""
    spreads = {}
    for stage, c in corr.items():
        by_host: dict[str, list[float]] = {}
        for r in rows:
            if r["stage"] != stage or r.get("status") != "ok" or r["measured_peak_bytes"] is None \
                    or r["estimated_bytes"] is None:
                continue
            residual = r["measured_peak_bytes"] - r["estimated_bytes"] - c.at(r["ctx"] * r["batch"])
            by_host.setdefault(r["hostname"] or "?", []).append(residual)
        means = [sum(v) / len(v) for v in by_host.values()]
        spread = int(round(max(means) - min(means))) if len(means) > 1 else 0
        c.residual_p95_bytes += spread
        spreads[stage] = spread
    return spreads


def refit(store: Store, machine_id: int, stack: str, quant: str, config_hash: str | None) -> CorrectionSet:
    """Refit every scope a run of (``quant``, ``config_hash``) belongs to, under the machine's refit
    lock, and record them; return the most specific scope's corrections."""
    scopes = reconcile.scopes(stack, quant, config_hash)
    names = SCOPE_NAMES[-len(scopes):]

    def fit(rows: list[dict]):
        rows = [r for r in rows if "," not in (r.get("device") or "")]  # a split's corrections are per device
        writes, best = [], CorrectionSet({})
        for (key, where), name in zip(scopes, names):
            corr = reconcile.fit_corrections(reconcile.rows_in(rows, where))
            if corr:
                writes.append((key, [asdict(c) for c in corr.values()]))
                best = best or CorrectionSet(corr, scope=f"this machine, {name}")
        return writes, best

    return store.refit(machine_id, fit)


@dataclass
class ClassSummary:
    machine_class: str
    label: str
    hosts: list[str]
    machines: int
    runs: int
    ok: int
    ooms: int
    failed: int
    interrupted: int
    corrections: dict[str, dict]  # per stage: intercept, slope, n_runs, p50, p95 (widened), host spread

    def to_dict(self) -> dict:
        return asdict(self)


def class_summary(store: Store) -> list[ClassSummary]:
    """Per machine class: hosts, runs, OOMs, and the class-wide correction with its band per stage
    (every finished run of the class, any model: the least specific scope)."""
    out = []
    for row in store.class_counts():
        key = row["class_key"]
        rows = store.stage_rows(class_key=key)
        corr = reconcile.fit_corrections(rows)
        spread = widen_by_host_spread(corr, rows)
        hosts = sorted({m["hostname"] or "?" for m in store.machines(class_key=key)})
        out.append(ClassSummary(
            key, class_label(key), hosts, int(row["machines"]), int(row["runs"]), int(row["ok"]), int(row["ooms"]),
            int(row["failed"]), int(row["interrupted"]),
            {stage: {"intercept_bytes": c.intercept_bytes, "slope_bytes_per_token": c.slope_bytes_per_token,
                     "n_runs": c.n_runs, "residual_p50_bytes": c.residual_p50_bytes,
                     "residual_p95_bytes": c.residual_p95_bytes, "host_spread_bytes": spread[stage]}
             for stage, c in corr.items()}))
    return out


def save_probe_unrecorded(fingerprint: dict, result, estimate: dict | None, *, run_uuid: str, command: str,
                          error: str, config_hash: str | None = None, kv_dtype: str | None = None,
                          folder=None):
    """Keep a probe whose record could not be written (the server went away, the file is locked or
    read-only) as one JSON file, with the same rows :func:`vramcal.calibrate.runs.record_probe` would
    have written; returns its path. ``run_uuid`` is the one the run's context was (or was to be)
    recorded with, so ``vramcal records import`` completes that run rather than adding another."""
    from ..records.unrecorded import run_payload, save_unrecorded

    d = result.to_dict()
    samples = [(s["t"], result.series, s.get(result.series)) for s in d.pop("samples") if result.series]
    run = {"model": result.model, "config_hash": config_hash or (estimate or {}).get("config_hash"),
           "quant": result.quant, "quant_impl": result.quant_implementation, "dtype": result.dtype,
           "ctx": result.ctx, "batch": result.batch, "kv_dtype": kv_dtype or (estimate or {}).get("kv_dtype"),
           "attn": result.attn, "device": result.device, "command": command, "estimate": estimate}
    payload = run_payload(fingerprint, run, d, reconcile.stage_rows(result), samples, uuid=run_uuid, error=error)
    return save_unrecorded(payload, folder)
