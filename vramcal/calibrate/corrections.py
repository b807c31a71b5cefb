"""Corrections, in one module: what a machine measured beyond the estimate, fitted from its recorded
runs, recorded, looked up for the next estimate, and shared across the hosts of a machine class
(docs/calibration.md, docs/fleet.md). Applying one is arithmetic of the estimator
(:mod:`vramcal.estimator.correction`).

**The line.** Per stage, ``measured - estimated = intercept + slope x tokens`` (tokens = ctx x batch),
fitted by least squares (``statistics.linear_regression``) over the finished runs of a scope; one run,
or runs at a single token count, give an intercept only. The residuals' p50 and p95 say how far a
corrected estimate is likely to be off.

**What is comparable.** A correction belongs to one machine and one software stack
(:func:`vramcal.probes.machine.stack_key`), and to the estimator model that made the estimates it was
fitted against (``estimator_model``, recorded with every run and every correction): runs compared with
another model's figures are left out, and a correction recorded for another model is never applied.

**Scopes**, most specific first (:func:`scopes`): the same model and quantization (the source documents'
"reuse the difference when only the context or batch changes"), then the same quantization on any
model, then any run on the stack. An estimate takes the most specific scope that has runs.

**The fleet.** :func:`find_correction` looks, scope by scope, first for this machine's recorded
correction, then for its *machine class* (:func:`vramcal.records.machines.machine_class`): the finished
runs of every host of the class in that scope, fitted together, with the p95 band widened by the spread
between hosts (a new host is another draw from the class, not one of the runs). Scope before source: a
class correction for the same model and quant wins over this machine's correction fitted on other
models; within one scope this machine's own wins.

**Splits.** A run split across devices feeds a correction per device position (``cuda:1`` of a split is
not ``cuda:0`` of it), kept on the machine that measured it.

**Withdrawn runs.** A run named by a withdrawal (:func:`withdraw`, ``vramcal records withdraw``) feeds
no fit (the store's stage rows leave it out), and a correction fitted from it before the withdrawal --
here or on a host it was copied from -- is never applied (:meth:`~vramcal.records.store.Store.latest_corrections`).
Withdrawing refits the run's scopes on its machine at once, so the next estimate has a correction
fitted from what remains.
"""

from __future__ import annotations

import statistics
import uuid as _uuid
from dataclasses import asdict, dataclass, field

from ..errors import UserError
from ..estimator.correction import Correction, CorrectionSet
from ..estimator.stages import model_id
from ..records.machines import class_key, class_label
from ..records.store import Store, new_uuid, open_existing
from ..workload import STAGES, device_kind

SCOPE_NAMES = ("same model and quant", "same quant", "any run")
LOOKUP_TIMEOUT_S = 3.0  # an estimate is offline work: a records server that does not answer soon is skipped


# ------------------------------------------------------------------------------------ fitting

def scopes(stack: str, quant: str, config_hash: str | None) -> list[tuple[str, dict]]:
    """(scope key, row filter) from the most specific to the least."""
    out = []
    if config_hash:
        out.append((f"{stack}|quant={quant}|model={config_hash}", {"quant": quant, "config_hash": config_hash}))
    out.append((f"{stack}|quant={quant}", {"quant": quant}))
    out.append((stack, {}))
    return out


def scope_names(config_hash: str | None) -> tuple[str, ...]:
    return SCOPE_NAMES if config_hash else SCOPE_NAMES[1:]


def scope_label(key: str | None) -> str:
    """A scope key of :func:`scopes` in a word: ``model+quant``, ``quant``, ``machine`` (``none`` for None)."""
    if key is None:
        return "none"
    return "model+quant" if "|model=" in key else "quant" if "|quant=" in key else "machine"


def rows_in(rows: list[dict], where: dict) -> list[dict]:
    return [r for r in rows if all(r.get(k) == v for k, v in where.items())]


def comparable_estimate(row: dict) -> bool:
    """Whether a stage row's recorded estimate came from the estimator model this vramcal uses for its
    device kind (older arithmetic's differences would be added to a figure that no longer needs them)."""
    return row.get("estimator_model") == model_id(device_kind(row.get("device") or "cuda"))


def fit_line(stage: str, points: list[tuple[int, int, int]]) -> Correction:
    """``measured - estimated = intercept + slope x tokens`` by least squares over ``(tokens, delta,
    run id)`` points; one point, or points at one token count, give an intercept only."""
    xs = [float(p[0]) for p in points]
    ys = [float(p[1]) for p in points]
    try:
        slope, intercept = statistics.linear_regression(xs, ys)
    except statistics.StatisticsError:  # fewer than two points, or all at one token count
        slope, intercept = 0.0, statistics.fmean(ys)
    res = [abs(y - (intercept + slope * x)) for x, y in zip(xs, ys)]
    return Correction(stage, int(round(intercept)), slope, len(points), int(_percentile(res, 0.5)),
                      int(_percentile(res, 0.95)), sorted({p[2] for p in points}))


def _percentile(values: list[float], q: float) -> float:
    """The q-quantile with linear interpolation between order statistics (numpy's default)."""
    if not values:
        return 0.0
    if len(values) == 1:
        return float(values[0])
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1] if 0 < q < 1 else \
        float(min(values) if q <= 0 else max(values))


def fit_corrections(rows: list[dict], exclude_run: int | None = None) -> dict[str, Correction]:
    """One correction per stage from ``stages`` rows of finished runs (``status == 'ok'``) whose estimate
    is comparable (:func:`comparable_estimate`)."""
    out = {}
    rows = [r for r in rows if _well_typed(r)]
    for stage in STAGES:
        pts = [(r["ctx"] * r["batch"], r["measured_peak_bytes"] - r["estimated_bytes"], r["run_id"]) for r in rows
               if r["stage"] == stage and r.get("status") == "ok" and r["run_id"] != exclude_run
               and r["measured_peak_bytes"] is not None and r["estimated_bytes"] is not None
               and comparable_estimate(r)]
        if pts:
            out[stage] = fit_line(stage, pts)
    return out


def _well_typed(row: dict) -> bool:
    """A stage row whose numbers are numbers: records a store took before imports were checked
    (docs/calibration.md, "Recovering") may hold text where a count belongs; they never feed a fit."""
    def whole(v, optional=False):
        return (v is None and optional) or (isinstance(v, int) and not isinstance(v, bool))

    return whole(row.get("ctx")) and whole(row.get("batch")) and whole(row.get("measured_peak_bytes"), True) \
        and whole(row.get("estimated_bytes"), True)


def fit_scoped(rows: list[dict], stack: str, quant: str, config_hash: str | None,
               exclude_run: int | None = None) -> tuple[str | None, dict[str, Correction]]:
    """The corrections of the most specific scope that has finished runs (other than ``exclude_run``)."""
    for key, where in scopes(stack, quant, config_hash):
        corr = fit_corrections(rows_in(rows, where), exclude_run=exclude_run)
        if corr:
            return key, corr
    return None, {}


def corrections_from_rows(rows: dict[str, dict]) -> dict[str, Correction]:
    return {stage: Correction(stage, r["intercept_bytes"], r["slope_bytes_per_token"], r["n_runs"],
                              r.get("residual_p50_bytes") or 0, r.get("residual_p95_bytes") or 0, r["source_runs"])
            for stage, r in rows.items()}


def _rows_with_ids(token: str, key: str, corr: dict[str, Correction]) -> list[dict]:
    """Correction rows with ids derived from a token made before the transaction: a retried transaction
    (a dropped connection) writes the same ids, so nothing is recorded twice."""
    base = _uuid.UUID(token)
    return [{**asdict(c), "uuid": str(_uuid.uuid5(base, f"{key}|{c.stage}"))} for c in corr.values()]


# ------------------------------------------------------------------------------------ this machine

def refit(store: Store, machine_id: int, stack: str, quant: str, config_hash: str | None,
          kind: str) -> CorrectionSet:
    """Refit every scope a run of (``quant``, ``config_hash``) belongs to, under the machine's refit
    lock, and record them; return the most specific scope's corrections. ``kind``: the device kind,
    whose current estimator model the corrections are fitted for."""
    pairs = list(zip(scopes(stack, quant, config_hash), scope_names(config_hash)))
    token = new_uuid()

    def fit(rows: list[dict]):
        writes, best = [], CorrectionSet({})
        for (key, where), name in pairs:
            corr = fit_corrections(rows_in(rows, where))
            if corr:
                writes.append((key, _rows_with_ids(token, key, corr)))
                best = best or CorrectionSet(corr, scope=f"this machine, {name}")
        return writes, best

    return store.refit(machine_id, fit, model_id(kind))


def device_stack(stack: str, position: str) -> str:
    """The stack key of one device position of a split: corrections of ``cuda:1`` of a split are its own."""
    return f"{stack}|device={position}"


def refit_devices(store: Store, machine_id: int, stack: str, quant: str, config_hash: str | None,
                  devices: list[str]) -> dict[str, CorrectionSet]:
    """Per device position of a split run: refit from the split runs' per-device rows, record, return."""
    rows = store.device_stage_rows(machine_id)
    estimator = model_id("cuda")
    out = {}
    token = new_uuid()
    for d in devices:
        mine = [r for r in rows if r["device"] == d]
        best = CorrectionSet({})
        for (key, where), label in zip(scopes(device_stack(stack, d), quant, config_hash), scope_names(config_hash)):
            corr = fit_corrections(rows_in(mine, where))
            if corr:
                store.add_corrections(machine_id, key, _rows_with_ids(token, key, corr), estimator)
                best = best or CorrectionSet(corr, scope=f"this machine, {d} of a split, {label}")
        out[d] = best
    return out


def lookup_device(store: Store, fingerprint: dict, position: str, quant: str, config_hash: str | None
                  ) -> CorrectionSet:
    """This machine's correction for one device position of a split (empty when none)."""
    from ..probes.machine import stack_key

    mid = store.find_machine(fingerprint)
    if mid is None:
        return CorrectionSet({})
    for key, _ in scopes(device_stack(stack_key(fingerprint), position), quant, config_hash):
        rows = store.latest_corrections(mid, key, model_id("cuda"))
        if rows:
            return CorrectionSet(corrections_from_rows(rows), scope=f"this machine, {position} of a split")
    return CorrectionSet({})


# ------------------------------------------------------------------------------------ the fleet

@dataclass
class FoundCorrection:
    corrections: dict[str, Correction]
    source: str | None  # "machine", "class", or None (nothing recorded)
    scope: str | None  # one of SCOPE_NAMES
    machine_class: str
    hosts: list[str] = field(default_factory=list)
    runs: list[int] = field(default_factory=list)
    host_spread_bytes: dict[str, int] = field(default_factory=dict)  # per stage; class corrections only

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
    estimator = model_id(device_kind(fingerprint.get("kind") or "cuda"))
    class_rows: list[dict] | None = None
    for (key, where), scope in zip(scopes(stack_key(fingerprint), quant, config_hash), scope_names(config_hash)):
        if mid is not None:
            rows = store.latest_corrections(mid, key, estimator)
            if rows:
                corr = corrections_from_rows(rows)
                return FoundCorrection(corr, "machine", scope, ckey, [fingerprint.get("hostname") or "?"],
                                       sorted({r for c in corr.values() for r in c.source_runs}))
        if class_rows is None:
            class_rows = [r for r in store.stage_rows(class_key=ckey) if comparable_estimate(r)]
        pooled = rows_in(class_rows, where)
        corr = fit_corrections(pooled)
        if corr:
            spread = widen_by_host_spread(corr, pooled)
            used = [r for r in pooled if r["run_id"] in {x for c in corr.values() for x in c.source_runs}]
            return FoundCorrection(corr, "class", scope, ckey, sorted({r["hostname"] or "?" for r in used}),
                                   sorted({r["run_id"] for r in used}), spread)
    return FoundCorrection({}, None, None, ckey)


def widen_by_host_spread(corr: dict[str, Correction], rows: list[dict]) -> dict[str, int]:
    """Per stage, the spread between hosts (max - min of each host's mean residual against the pooled
    fit), added to the correction's p95 residual in place; returns the spreads."""
    spreads = {}
    for stage, c in corr.items():
        by_host: dict[str, list[float]] = {}
        for r in rows:
            if r["stage"] != stage or r.get("status") != "ok" or not _well_typed(r) \
                    or r["measured_peak_bytes"] is None or r["estimated_bytes"] is None or not comparable_estimate(r):
                continue
            residual = r["measured_peak_bytes"] - r["estimated_bytes"] - c.at(r["ctx"] * r["batch"])
            by_host.setdefault(r["hostname"] or "?", []).append(residual)
        means = [sum(v) / len(v) for v in by_host.values()]
        spread = int(round(max(means) - min(means))) if len(means) > 1 else 0
        c.residual_p95_bytes += spread
        spreads[stage] = spread
    return spreads


def lookup(store: Store, fingerprint: dict, quant: str, config_hash: str | None) -> CorrectionSet:
    """The recorded corrections of the most specific scope that has any: this machine's, else its
    machine class's across hosts; empty when none."""
    return find_correction(store, fingerprint, quant, config_hash).as_set()


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
        corr = fit_corrections(rows)
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


# ------------------------------------------------------------------------------------ for an estimate

def lookup_store(db: str | None) -> tuple[Store | None, str | None]:
    """The records database for a lookup, read-only and quickly: (store or None, why not)."""
    try:
        return open_existing(db, timeout_s=LOOKUP_TIMEOUT_S), None
    except UserError as exc:
        return None, f"no correction applied: {exc}"


def machine_correction(device: str, quant: str, config_hash: str | None, db: str | None = None) -> CorrectionSet:
    """This machine's correction for an estimate on ``device``, read without writing anything. A
    records database that cannot be read (a server that does not answer within
    :data:`LOOKUP_TIMEOUT_S`, a damaged file) gives no correction and says why (``CorrectionSet.note``)."""
    from ..probes.machine import machine_fingerprint

    store, why = lookup_store(db)
    if store is None:
        return CorrectionSet({}, note=why)
    fp = machine_fingerprint("cpu" if device_kind(device) == "cpu" else (device if ":" in device else "cuda:0"))
    try:
        with store:
            return lookup(store, fp, quant, config_hash)
    except UserError as exc:
        return CorrectionSet({}, note=f"no correction applied: {exc}")


def machine_device_corrections(e, db: str | None = None) -> tuple[dict[str, CorrectionSet], str | None]:
    """This machine's per-device-position corrections for a placed estimate (empty when none), and why
    none could be read, if so."""
    from ..probes.machine import machine_fingerprint

    gpus = [d for d in (e.devices or {}) if d.startswith("cuda")]
    if not gpus:
        return {}, None
    store, why = lookup_store(db)
    if store is None:
        return {}, why
    fp = machine_fingerprint(e.main_device)
    try:
        with store:
            return {d: lookup_device(store, fp, d, e.quant, e.config_hash) for d in gpus}, None
    except UserError as exc:
        return {}, f"no correction applied: {exc}"


def corrected_estimate(model, quant: str = "auto", ctx: int | None = None, batch: int = 1, *, db: str | None = None,
                       device: str = "cuda", **kwargs):
    """:func:`vramcal.estimator.estimate.estimate`, corrected by this machine's recorded runs when it has
    any (``estimate.correction`` says which runs and which scope)."""
    from ..estimator.estimate import estimate

    return with_machine_corrections(estimate(model, quant, ctx, batch, device=device, **kwargs), db, device)


def with_machine_corrections(e, db: str | None, device: str):
    """``e`` corrected by this machine's recorded runs for ``device`` (per device position for a split
    estimate), with a note where a records database could not be read."""
    if e.devices:
        per, why = machine_device_corrections(e, db)
        out = e.corrected_devices(per)
        if why:
            out.notes.append(why)
        return out
    return e.corrected(machine_correction(device, e.quant, e.config_hash, db))


# ------------------------------------------------------------------------------------ withdrawals

MAX_WHY = 4096


@dataclass
class Withdrawn:
    run_id: int
    withdrawal_id: int | None  # None: it was withdrawn already and nothing was added
    why: str
    earlier: list[dict] = field(default_factory=list)  # withdrawals recorded before this one
    refitted: dict[str, dict] = field(default_factory=dict)  # the run's scope refitted without it, per stage

    def to_dict(self) -> dict:
        return asdict(self)


def valid_why(why) -> str:
    """``--why``: the reason, one line of text, not empty."""
    text = " ".join(str(why or "").split())
    if not text:
        raise UserError('records withdraw needs a reason: --why "imported by mistake: impossible peaks"')
    if len(text) > MAX_WHY or not text.isprintable():
        raise UserError(f"--why must be printable text of at most {MAX_WHY} characters")
    return text


def withdraw(store: Store, run_id: int, why: str, hostname: str | None = None) -> Withdrawn:
    """Append a withdrawal of ``run_id`` (the run stays; the store is append-only), then refit its
    scopes on its machine without it. A run withdrawn already gets no second row."""
    why = valid_why(why)
    run = store.run(run_id)
    if run is None:
        raise UserError(f"no run {run_id} in {store.label}: `vramcal records list` shows the runs")
    if run.withdrawals:
        return Withdrawn(run_id, None, why, run.withdrawals)
    wid = store.withdraw(run_id, why, hostname)
    out = Withdrawn(run_id, wid, why)
    c, m = run.context, run.machine
    if c.estimator_model and c.estimator_model.startswith("vllm"):
        return out  # vLLM terms are learned from the runs at each lookup, which leaves withdrawn ones out
    from ..probes.machine import stack_key

    stack = stack_key(m)
    if c.split_devices:
        per = refit_devices(store, m["machine_id"], stack, c.quant, c.config_hash,
                            [d for d in c.split_devices if d.startswith("cuda")])
        out.refitted = {f"{d} {k}": asdict(v) for d, cs in per.items() for k, v in cs.stages.items()}
    else:
        kind = device_kind(c.device)
        out.refitted = {k: asdict(v) for k, v in refit(store, m["machine_id"], stack, c.quant, c.config_hash,
                                                        kind).stages.items()}
    return out
