"""Hold `vramcal estimate --device cpu` against CPU probes: the resident set each stage really held.

    python benchmarks/cpu_model_eval.py [--markdown OUT.md] PROBE.json ...

PROBE.json: what `vramcal probe MODEL --synthetic --device cpu --json` printed. For each probe and stage:
the measured peak above the child's baseline (vramcal.probes.readings' rule), the estimate the
installed vramcal makes now for the probe's own workload, its run-to-run range where it has one, and
the estimate the probe carried when it ran (the code of that day). Then, per row, the leave-one-out
corrected error: a line in tokens (vramcal.calibrate.corrections.fit_line, the rule `vramcal check`
uses) fitted to the other probes of the same quantization on this machine and stage -- the
calibration scope "same quant" -- is added to the estimate.

Rows are split as docs/validation.md shows them: models with at least 0.4 B parameters (where the
issue's targets apply: raw median <= 10 %, calibrated <= 5 %) and smaller ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from vramcal.calibrate import corrections
from vramcal.estimator.stages import model_id
from vramcal.errors import UserError
from vramcal.estimator.estimate import Estimator
from vramcal.files import atomic_write, check_writable
from vramcal.estimator.quant import resolve_quant
from vramcal.estimator.resolve import resolve_model
from vramcal.probes.readings import StageReading, comparable
from vramcal.workload import STAGES

MIB = 2**20
ROOT = Path(__file__).resolve().parent.parent
REAL_WIDTH_PARAMS = 400_000_000
# the probes that set constants of vramcal.estimator.cpu (bf16: LOAD_FIXED_BYTES, ACT_RETAINED; nf4 and
# int8, with five instrumented runs: RETENTION_TYPICAL, the int8 prefill scale): in sample for those
TUNED_ON = {f"qwen2.5-0.5b-{q}-{c}-b1.json" for q in ("bf16", "nf4", "int8") for c in (256, 1024)}


def rows_of(path: Path, estimators: dict) -> list[dict]:
    d = json.loads(path.read_text())
    if d.get("status") != "ok" or d.get("device") != "cpu":
        return []
    readings = {s: StageReading.from_stage(s, d["series"], f) for s, f in d["stages"].items()}
    measured = comparable(readings, d["series"])
    key = (d["model"], d["quant"])
    if key not in estimators:
        model = d["model"]  # a config folder kept in the repository is recorded relative to its root
        if not Path(model).exists() and (ROOT / model).exists():
            model = str(ROOT / model)
        src = resolve_model(model)
        estimators[key] = Estimator(src, resolve_quant(d["quant"], src.config), device="cpu")
    est = estimators[key]
    e = est.estimate(d["ctx"], d["batch"], new_tokens=d.get("new_tokens", 16))
    out = []
    for s in STAGES:
        m = measured[s].peak_bytes
        lo, hi = (e.ranges or {}).get(s, (e.stages[s], e.stages[s]))
        out.append({"file": path.name, "model": Path(d["model"]).name, "params": est.inv.params, "quant": d["quant"],
                    "ctx": d["ctx"], "batch": d["batch"], "tokens": d["ctx"] * d["batch"], "stage": s,
                    "measured": m, "estimate": e.stages[s], "lower": lo, "upper": hi,
                    "then": (d.get("estimate") or {}).get("stages", {}).get(s), "wall_s": d.get("wall_s")})
    return out


def leave_one_out(rows: list[dict]) -> None:
    """Each probe corrected by the others, scope by scope as `vramcal check` looks a correction up
    (:func:`vramcal.calibrate.corrections.fit_scoped`: the same model and quantization, else the same
    quantization, else any), never by its own rows."""
    run = {f: i for i, f in enumerate(sorted({r["file"] for r in rows}))}
    current = model_id("cpu")  # every row is estimated by the current code here
    stage_rows = [{"run_id": run[r["file"]], "stage": r["stage"], "ctx": r["ctx"], "batch": r["batch"],
                   "status": "ok", "quant": r["quant"], "config_hash": r["model"], "measured_peak_bytes": r["measured"],
                   "estimated_bytes": r["estimate"], "device": "cpu", "estimator_model": current} for r in rows]
    fits = {}
    for r in rows:
        if r["file"] not in fits:
            fits[r["file"]] = corrections.fit_scoped(stage_rows, "", r["quant"], r["model"], exclude_run=run[r["file"]])
        key, corr = fits[r["file"]]
        c = corr.get(r["stage"])
        r["calibrated"] = None if c is None else r["estimate"] + c.at(r["tokens"])
        r["scope"] = corrections.scope_label(key) if c is not None else None


def err(a: int | None, m: int) -> float | None:
    return None if a is None else (a - m) / m


def table(rows: list[dict]) -> list[str]:
    lines = ["| model | quant | ctx | stage | measured MiB | estimate MiB | error | run-to-run range MiB | "
             "calibrated (LOO) | estimate then |",
             "| --- | --- | ---: | --- | ---: | ---: | ---: | --- | ---: | ---: |"]
    for r in rows:
        m = r["measured"]
        inside = r["lower"] * 0.9 <= m <= r["upper"] * 1.1
        rng = "" if r["lower"] == r["upper"] else f"{r['lower'] / MIB:.0f}-{r['upper'] / MIB:.0f}" + ("" if inside else " (outside)")
        cal = "n/a" if r["calibrated"] is None else f"{err(r['calibrated'], m):+.0%} ({r['scope']})"
        then = "n/a" if r["then"] is None else f"{err(r['then'], m):+.0%}"
        lines.append(f"| {r['model']} | {r['quant']} | {r['ctx']} | {r['stage']} | {m / MIB:.0f} | "
                     f"{r['estimate'] / MIB:.0f} | {err(r['estimate'], m):+.0%} | {rng} | {cal} | {then} |")
    return lines


def summary(rows: list[dict], label: str) -> list[str]:
    if not rows:
        return [f"{label}: no rows"]
    raw = [abs(err(r["estimate"], r["measured"])) for r in rows]
    cal = [abs(err(r["calibrated"], r["measured"])) for r in rows if r["calibrated"] is not None]
    then = [abs(err(r["then"], r["measured"])) for r in rows if r["then"] is not None]
    inside = sum(r["lower"] * 0.9 <= r["measured"] <= r["upper"] * 1.1 for r in rows)
    out = [f"{label}: {len(rows)} rows ({len({r['file'] for r in rows})} probes); median |error| raw "
           f"{statistics.median(raw):.1%}, calibrated (leave-one-out) "
           + (f"{statistics.median(cal):.1%} over {len(cal)} rows" if cal else "n/a")
           + (f", the estimate the probes carried {statistics.median(then):.1%}" if then else "")
           + f"; measured inside [lower - 10 %, upper + 10 %]: {inside}/{len(rows)}"]
    for q in sorted({r["quant"] for r in rows}):
        sub = [r for r in rows if r["quant"] == q]
        raw_q = [abs(err(r["estimate"], r["measured"])) for r in sub]
        cal_q = [abs(err(r["calibrated"], r["measured"])) for r in sub if r["calibrated"] is not None]
        out.append(f"- {q}: {len(sub)} rows, median |error| raw {statistics.median(raw_q):.1%}"
                   + (f", calibrated {statistics.median(cal_q):.1%}" if cal_q else ""))
    return out


def peaks(rows: list[dict]) -> list[dict]:
    """Per probe, the stage with the highest measurement, as the whole run's peak."""
    by: dict[str, dict] = {}
    for r in rows:
        if r["file"] not in by or r["measured"] > by[r["file"]]["measured"]:
            by[r["file"]] = r
    return list(by.values())


def targets(rows: list[dict]) -> list[str]:
    p = peaks(rows)
    raw = statistics.median(abs(err(r["estimate"], r["measured"])) for r in p)
    cal_v = [abs(err(r["calibrated"], r["measured"])) for r in p if r["calibrated"] is not None]
    cal = statistics.median(cal_v) if cal_v else None

    def met(x, goal):
        return "n/a" if x is None else ("met" if x <= goal else "**missed**")

    fresh = [abs(err(r["estimate"], r["measured"])) for r in p if r["file"] not in TUNED_ON]
    why = [] if cal is None or cal <= 0.05 else [
        "", "Where calibration does not help: a correction is the other runs' difference, and after an "
        "on-the-fly bitsandbytes load runs of one configuration land near none or near all of the heap "
        "range (see the repeated Qwen2.5-0.5B nf4 ctx 1024 probes below), so another run's difference does "
        "not say where this one lands; across models (scope *quant*) the heap share does not carry over."]
    return [
            "| target (the whole run's peak, per probe) | goal | measured | |", "| --- | ---: | ---: | --- |",
            f"| raw median | <= 10 % | {raw:.1%} over {len(p)} probes | {met(raw, 0.10)} |",
            "| raw median, probes not used to set any constant | <= 10 % | "
            + (f"{statistics.median(fresh):.1%} over {len(fresh)} probes" if fresh else "n/a")
            + f" | {met(statistics.median(fresh) if fresh else None, 0.10)} |",
            "| calibrated median (leave-one-out) | <= 5 % | "
            + ("n/a" if cal is None else f"{cal:.1%} over {len(cal_v)} probes") + f" | {met(cal, 0.05)} |"] + why


HEADER = """## CPU at real widths: the resident set a CPU user sees

`vramcal estimate --device cpu` against `vramcal probe MODEL --quant Q --synthetic --device cpu --ctx N
--json` (random weights at the model's real widths, saved and loaded as a checkpoint), on one 2-core
machine: the measured figure is the child's peak resident set in each stage above its baseline (torch,
transformers and bitsandbytes imported); the estimate is the current code's for the probe's own
workload; *range* is the run-to-run range the estimate gives after an on-the-fly bitsandbytes load
(glibc keeps between none and all of the quantizer's freed temporaries, docs/cpu-memory.md);
*calibrated* adds a line in tokens fitted to the other probes of the same model and quantization (else
of the same quantization) at that stage, leaving the row's own probe out: the scopes `vramcal check`
looks corrections up in. Regenerate:

    python benchmarks/cpu_model_eval.py --markdown docs/validation/cpu-real/cpu-real.md docs/cpu-memory/probes/*.json
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("probes", nargs="+", type=Path)
    ap.add_argument("--markdown", type=Path, help="also write the tables and summaries here")
    args = ap.parse_args(argv)
    if args.markdown:
        check_writable(args.markdown, "--markdown")
    estimators: dict = {}
    rows = []
    for p in sorted(args.probes):
        try:
            rows += rows_of(p, estimators)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"cpu_model_eval: {p} is not a readable probe JSON ({type(exc).__name__}: {exc}); pass the files "
                  "`vramcal probe ... --device cpu --json` wrote", file=sys.stderr)
            return 2
    real = [r for r in rows if r["params"] >= REAL_WIDTH_PARAMS]
    tiny = [r for r in rows if r["params"] < REAL_WIDTH_PARAMS]
    leave_one_out(real)
    leave_one_out(tiny)
    text = [HEADER]
    if real:
        text += targets(real) + [""] + summary(real, "every stage") + [""] + table(real) + [""]
    if tiny:
        text += ["### smaller models", ""] + table(tiny) + [""] + summary(tiny, "smaller models") + [""]
    print("\n".join(text))
    if args.markdown:
        atomic_write(args.markdown, "\n".join(text) + "\n", "--markdown")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as exc:  # an unwritable --markdown, a model that does not resolve: one line
        print(f"cpu_model_eval: {exc}", file=sys.stderr)
        sys.exit(2)
