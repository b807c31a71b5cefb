"""Formatting only: turns the library's dataclasses into tables, Markdown and JSON shapes. No
arithmetic of memory here."""

from __future__ import annotations

from .units import fmt_gib_gb, gb, gib
from .workload import PROBE_STAGES, STAGE_LABELS, STAGES


def _rows(lines: list[str]) -> str:
    """A table's lines, one per row: a line end inside a recorded field (an imported model name) is
    written as ``\\n``. Control characters are escaped where all output leaves (``cli._out``)."""
    return "\n".join(line.replace("\n", "\\n") for line in lines)


def _stage_label(stage: str, new_tokens: int) -> str:
    return f"end ({new_tokens} tokens)" if stage == "end" else STAGE_LABELS[stage]


def _row(label: str, n: int | None, width: int = 26) -> str:
    if n is None:
        return f"  {label:<{width}} {'n/a':>12}"
    return f"  {label:<{width}} {gib(n):>9.2f} GiB {gb(n):>9.2f} GB"


def estimate_table(e) -> str:
    lines = [f"{e.model}  [{e.architecture}]  quant={e.quant} ({e.quant_implementation})  dtype={e.dtype}",
             f"ctx={e.ctx} (prompt {e.prompt} + {e.new_tokens} new)  batch={e.batch}  attn={e.attn}  cache={e.cache}  "
             f"kv-dtype={e.kv_dtype}  device={e.device}" + ("   APPROXIMATE" if e.approximate else "")]
    lines += _revision_line(e)
    if e.images:
        lines.append(f"images: {e.images} of {e.image_size[0]}x{e.image_size[1]} per prompt = {e.image_tokens} image "
                     f"tokens; context {e.context} (ctx {e.ctx} + image tokens)"
                     + (f"; vision encoder peak {gib(e.vision_peak):.2f} GiB" if e.vision_peak is not None else ""))
    lines.append("")
    if e.warnings:
        lines += ["WARNING"] + ["  " + w for w in e.warnings] + [""]
    lines.append("components (sizes; the peak's own make-up is below)")
    for key in ("weights", "kv_cache", "activations", "runtime"):
        lines.append(_row(key.replace("_", " "), e.components[key]))
    corrected = " (corrected)" if e.correction else ""
    if e.devices:
        lines += [""] + placement_lines(e, corrected)
    else:
        what = ("resident set above the process's baseline; torch tensors in brackets" if e.device == "cpu"
                else "device memory in use; allocated in brackets")
        lines += ["", f"stages ({'corrected; ' if e.correction else ''}{what})"]
        for key in STAGES:
            spread = ""
            if e.ranges:
                lo, hi = e.ranges[key]
                spread = f"   {'raw ' if e.correction else ''}run to run {gib(lo):.2f}-{gib(hi):.2f} GiB"
            lines.append(_row(_stage_label(key, e.new_tokens), e.stages[key]) + f"   [{gib(e.allocated[key]):.2f} GiB]"
                         + spread)
        lines.append(_row("PEAK", e.peak) + f"   at {STAGE_LABELS.get(e.peak_stage, e.peak_stage)}")
        if e.ranges and not e.correction:
            hi = max(v[1] for v in e.ranges.values())
            lines.append(f"  plan for {gib(hi):.2f} GiB: glibc keeps a different share of bitsandbytes' freed "
                         "temporaries each run (docs/cpu-memory.md)")
        elif e.ranges:
            lines.append("  the run-to-run range is the raw estimate's; `fit` plans at the corrected figure plus "
                         "this machine's p95 residual")
    if e.peak_breakdown:
        lines += ["", "the raw peak is made of" if e.correction else "the peak is made of"]
        for key, value in e.peak_breakdown.items():
            lines.append(_row(key.replace("_", " "), value))
    lines += ["", "weights by group"]
    for key, value in e.weights_breakdown.items():
        lines.append(_row(key.replace("_", " "), value))
    if e.weights_parts:
        lines += ["", "weights by part (vision tower, projector, language model)"]
        for key, value in e.weights_parts.items():
            lines.append(_row(key, value, width=30))
    if e.formula:
        f = e.formula
        lines += ["", f"the usual formula (params x {f.bits:g} bits / 8 + KV, x 1.18)"]
        lines.append(_row("weights", f.weights_bytes))
        lines.append(_row("kv cache", f.kv_cache_bytes))
        lines.append(_row("total", f.total_bytes))
        lines += ["", "why vramcal differs"] + ["  " + d for d in e.differences]
    lines += ["", "how"] + [f"  {k}: {v}" for k, v in e.methods.items()] + [f"  runtime: {e.runtime_source}"]
    reserve = (getattr(e, "runtime_terms", None) or {}).get("driver_reserve")
    if reserve and reserve.get("bytes") is not None:
        lines.append(f"  driver's reserve: {reserve['bytes'] / 1024**2:,.0f} MiB ({reserve['kind']}), counted "
                     "against the device's total, not in the stages")
    if e.notes:
        lines += ["", "notes"] + ["  " + n for n in e.notes]
    if e.correction:
        lines += ["", correction_table(e.correction)]
    return "\n".join(lines)


def _cell(n: int | None, width: int = 12) -> str:
    return f"{'n/a':>{width}}" if n is None else f"{gib(n):>{width - 4}.2f} GiB"


def placement_lines(e, corrected: str = "") -> list[str]:
    """The grouped map, what loads if transformers refuses it, and one column per device."""
    from .estimator.placement import OFFLOAD_FLAG  # here: the commands that only list records need no estimator

    p = e.placement
    loads = p.loads
    mm = ", ".join(f"{d}={gib(b):.2f} GiB" for d, b in p.max_memory.items())
    lines = [f"placement: device_map={p.strategy!r}, max_memory {mm} (the installed transformers' own map)"]
    lines += ["  " + line for line in p.grouped()]
    if p.refused:
        lines += ["  REFUSED by transformers: " + p.refused.split(". ")[0] + ".",
                  "  what loads instead: this map as a custom device_map, with "
                  + f"{OFFLOAD_FLAG}=True (figures below are for it)"]
    devs = list(e.devices)
    gpus = [d for d in devs if d.startswith("cuda")]
    head = f"  {'':<26}" + "".join(f"{d:>14}" for d in devs) + (f"{'GPUs total':>14}" if len(gpus) > 1 else "")
    lines += ["", f"stages per device{corrected} (GPU: memory in use; cpu / disk: weights held there)", head]
    for key in STAGES:
        row = f"  {_stage_label(key, e.new_tokens):<26}" + "".join(f"{_cell(e.devices[d].stages[key], 14)}"
                                                                  for d in devs)
        lines.append(row + (_cell(e.stages[key], 14) if len(gpus) > 1 else ""))
    lines.append(f"  {'PEAK':<26}" + "".join(_cell(e.devices[d].peak, 14) for d in devs)
                 + (_cell(e.peak, 14) if len(gpus) > 1 else ""))
    lines += ["", "components per device"]
    for key in ("weights", "kv_cache", "activations", "offload_transient", "runtime"):
        lines.append(f"  {key.replace('_', ' '):<26}" + "".join(_cell(e.devices[d].components[key], 14)
                                                                for d in devs))
    if loads.pcie_bytes_per_token:
        lines.append(f"  PCIe per generated token: {fmt_gib_gb(loads.pcie_bytes_per_token)} copied from cpu "
                     f"to {loads.main_device}")
    if loads.disk_bytes_per_token:
        lines.append(f"  disk per generated token: {fmt_gib_gb(loads.disk_bytes_per_token)} read and copied")
    return lines


def probe_table(r) -> str:
    cpu = r.series == "rss"
    head = [f"{r.model}  quant={r.quant} ({r.quant_implementation})  ctx={r.ctx} ({r.new_tokens} new)  "
            f"batch={r.batch}  device={r.device}"
            + (f"  images={r.images}" + (f" of {r.image_size[0]}x{r.image_size[1]}" if r.image_size else "")
               + f" ({r.image_tokens} image tokens per prompt)" if r.images else ""),
            f"status: {r.status.upper()}"
            + (f" at {r.oom.stage}, asked for {fmt_gib_gb(r.oom.requested_bytes)}" if r.oom else "")
            + (f" ({r.error})" if r.error else ""),
            f"{r.sample_count} samples every {r.interval_ms:g} ms on {r.series or 'no series'}"
            + (f"; sampler cost {r.sampler_overhead:.2%} of a core" if r.sampler_overhead is not None else ""),
            ""]
    what = "above baseline" if cpu else "memory.used"
    lines = [f"  {'stage':<12} {'measured ' + what:>26} {'peak in interval':>26} {'estimate':>26} {'diff':>10}"]
    # a split run's main series is set beside its main device's estimate, not the sum over GPUs
    est = r.estimate.main_stages() if r.estimate is not None else {}
    for name, m in r.measured().items():
        e = est.get(name)
        diff = f"{gib(m.peak_bytes - e):+8.3f} GiB" if (e is not None and m.peak_bytes is not None) else ""
        lines.append(f"  {name:<12} {_g(m.used_bytes):>26} {_g(m.peak_bytes):>26} {_g(e):>26} {diff:>10}")
    u = r.measured_unfinished()
    if u is not None:
        lines.append(f"  {u.stage + ' *':<12} {'':>26} {_g(u.peak_bytes):>26}   (* under way when the run stopped)")
    lines.append("  (estimate is the stage's peak" + (f" on {r.device}" if r.devices else "")
                 + "; diff = measured peak - estimate)")
    if r.devices:
        est_dev = (r.estimate.devices if r.estimate is not None else None) or {}
        lines += ["", "  per device (GPU: NVML memory.used peak; cpu: the child's resident set above its baseline)",
                  f"  {'stage':<12}" + "".join(f"{d + ' meas.':>18}{'est.':>12}" for d in r.devices)]
        for name in STAGES:
            row = f"  {name:<12}"
            for d, st in r.devices.items():
                e = est_dev[d].stages.get(name) if d in est_dev else None
                row += f"{_cell(st[name].peak_bytes if name in st else None, 18)}{_cell(e, 12)}"
            lines.append(row)
    if r.vision is not None:
        v = r.vision
        seen = [f"{v.t_end - v.t_start:.3f} s"]
        if v.peak_bytes is not None:
            seen.append(f"{r.series} peak {_g(v.peak_bytes)}")
        if v.extra_allocated_bytes is not None:
            seen.append(f"torch allocated +{_g(v.extra_allocated_bytes)} above its start")
        est_v = r.estimate.vision_peak if r.estimate is not None else None
        lines.append("  vision encoder: " + ", ".join(seen) + (f" (estimate +{_g(est_v)})" if est_v is not None else ""))
    for n in r.notes:
        lines.append("  note: " + n)
    lines.append(f"  reproduce: {r.command}")
    return "\n".join(head + lines)


def _g(n: int | None) -> str:
    return "n/a" if n is None else f"{gib(n):.3f} GiB / {gb(n):.3f} GB"


def quick_table(q) -> str:
    lines = [f"quick formula: {q.params / 1e9:g}B params x {q.bits:g} bits, ctx={q.ctx}, batch={q.batch}",
             _row("weights", q.weights_bytes)]
    if q.kv_cache_bytes is not None:
        lines.append(f"  {'kv bytes per token':<26} {q.kv_bytes_per_token:>13,d} B")
        lines.append(_row("kv cache", q.kv_cache_bytes))
    else:
        lines.append("  kv cache                   needs --layers, --kv-heads and --head-dim")
    lines.append(_row("total (x 1.18)", q.total_bytes))
    lines.append("  a lower bound: give a MODEL (config or catalog name) for what transformers really allocates")
    return "\n".join(lines)


def quick_json(q) -> dict:
    """Quick mode in the shape of a full estimate: the same ``components`` keys, ``peak``, and None with a
    reason for what the formula does not separate."""
    kv = q.kv_cache_bytes
    return {"mode": "quick", "ctx": q.ctx, "batch": q.batch, "peak": q.total_bytes,
            "components": {"weights": q.weights_bytes, "kv_cache": kv, "activations": None,
                           "runtime": q.total_bytes - q.weights_bytes - (kv or 0)},
            "stages": None, "approximate": True,
            "notes": ["the formula's flat 18 % covers activations and runtime together: shown as runtime, "
                      "activations None"] + ([] if kv is not None else
                                             ["kv_cache None: give --layers, --kv-heads and --head-dim"]),
            "formula": q.to_dict()}


def models_table(rows: list[dict]) -> str:
    wn = max([len("name")] + [len(r["name"]) for r in rows])
    wa = max([len("architecture")] + [len(r["architecture"]) for r in rows])
    lines = [f"{'name':<{wn}} {'architecture':<{wa}} {'params':>9}  hub id"]
    for r in rows:  # params: the published count (n/a where none was published)
        params = f"{'n/a':>9}" if r["params_b"] is None else f"{r['params_b']:>8.2f}B"
        lines.append(f"{r['name']:<{wn}} {r['architecture']:<{wa}} {params}  {r['hub_id']}")
    return "\n".join(lines)


def correction_table(c) -> str:
    """An :class:`~vramcal.estimator.result.AppliedCorrection`: raw, correction and corrected per stage."""
    lines = [f"correction ({c.scope or 'this machine'}; runs " + ", ".join(map(str, c.source_runs))
             + (f"; hosts {', '.join(c.hosts)}" if c.hosts else "") + ")",
             f"  {'stage':<14} {'raw':>22} {'correction':>14} {'corrected':>22}"]
    delta = c.delta
    for k, raw in c.raw.items():
        lines.append(f"  {k:<14} {fmt_gib_gb(raw):>22} {delta[k] / 1024**3:>+10.3f} GiB {fmt_gib_gb(c.corrected[k]):>22}")
    return "\n".join(lines)


def check_table(r) -> str:
    v = r.verdict
    lines = [("FITS" if v.fits else "DOES NOT FIT") + f": {v.reason}",
             f"  budget {fmt_gib_gb(v.budget_bytes)}, buffer {fmt_gib_gb(v.buffer_bytes)}, "
             f"measured peak {fmt_gib_gb(v.peak_bytes)} at {v.peak_stage}",
             f"  recorded as run {r.run_id} (machine {r.machine_id})" + (f", memo {r.memo_id}" if r.memo_id else "")]
    if v.others:
        lines += ["  budget read from free memory: " + line for line in v.others]
        if v.held_by_others_bytes:
            lines.append(f"  the measured peak above excludes the {fmt_gib_gb(v.held_by_others_bytes)} others held")
    for dev, d in (v.devices or {}).items():
        lines.append(f"  {dev}: peak {fmt_gib_gb(d.peak_bytes)} at {d.peak_stage}, budget "
                     f"{fmt_gib_gb(d.budget_bytes)}: " + ("fits" if d.fits else "DOES NOT FIT"))
    deltas = {k: v for k, v in r.component_deltas.items() if v is not None}
    if deltas:
        lines.append("  measured - estimated: " + ", ".join(f"{k} {v / 1024**3:+.3f} GiB" for k, v in deltas.items()))
    if r.corrections:
        lines.append("  correction now: " + ", ".join(
            f"{k} {c.intercept_bytes / 1024**3:+.3f} GiB from {c.n_runs} run(s)" for k, c in r.corrections.items()))
    if r.proposals:
        lines.append("")
        lines.append("next configurations to try (corrected estimate, p95 margin):")
        for p in r.proposals:
            lines.append(f"  {p.change:<40} peak {fmt_gib_gb(p.corrected_peak_bytes)}   {p.command}")
            if p.grouped:
                lines += [f"  {'':<40}   {g}" for g in p.grouped]
            if p.warning:
                lines.append(f"  {'':<40}   WARNING {p.warning}")
    elif not v.fits:
        lines.append("  no configuration within reach fits: a smaller model, or a larger device")
    return "\n".join(lines)


def fit_table(model: str, budget, buffer: int, rows, free: list[str] | None = None,
              notes: list[str] | None = None) -> str:
    within = (", ".join(f"{d} {fmt_gib_gb(b)}" for d, b in budget.items()) if isinstance(budget, dict)
              else fmt_gib_gb(budget))
    lines = [f"{model}: largest context within {within} minus a {fmt_gib_gb(buffer)} buffer"
             + (" on each GPU" if isinstance(budget, dict) else "")]
    lines += ["  free now: " + line for line in free or []]
    lines.append(f"  {'quant':<8} {'batch':>5} {'max ctx':>9} {'peak':>22}")
    for r in rows:
        ctx = "none" if r.max_ctx is None else f"{r.max_ctx:,}"
        peak = f"{fmt_gib_gb(r.peak_bytes):>22}"
        if r.device_peaks:
            peak += "   " + ", ".join(f"{d} {gib(b):.2f} GiB" for d, b in r.device_peaks.items())
        if r.error:
            peak += "   " + r.error
        lines.append(f"  {r.quant:<8} {r.batch:>5} {ctx:>9} {peak}")
    lines += ["  note: " + n for n in notes or []]
    return "\n".join(lines)


def runs_table(runs: list[dict]) -> str:
    lines = [f"{'id':>4} {'model':<30} {'quant':<8} {'ctx':>7} {'batch':>5} {'device':<8} status"]
    for r in runs:
        device = ",".join(r["split_devices"]) if r.get("split_devices") else r["device"]
        lines.append(f"{r['id']:>4} {str(r['model'])[-30:]:<30} {r['quant']:<8} {r['ctx']:>7} {r['batch']:>5} "
                     f"{device:<8} {r['status'] or 'interrupted'}" + _withdrawn_mark(r))
    return _rows(lines)


def fleet_runs_table(runs: list[dict]) -> str:
    lines = [f"{'id':>6} {'host':<14} {'gpu':<24} {'model':<28} {'quant':<8} {'ctx':>7} {'batch':>5} status"]
    for r in runs:
        gpu = r.get("gpu_name") or r["device"]
        lines.append(f"{r['id']:>6} {str(r.get('hostname'))[:14]:<14} {str(gpu)[:24]:<24} {str(r['model'])[-28:]:<28} "
                     f"{r['quant']:<8} {r['ctx']:>7} {r['batch']:>5} {r['status'] or 'interrupted'}"
                     + _withdrawn_mark(r))
    return _rows(lines)


def _withdrawn_mark(r: dict) -> str:
    return " (withdrawn)" if r.get("withdrawn") else ""


def class_summary_table(rows) -> str:
    """Per machine class: hosts and runs, then the class's correction per stage with its p95 band."""
    if not rows:
        return "no runs recorded"
    out = []
    for r in rows:
        out.append(f"{r.label}")
        out.append(f"  hosts {len(r.hosts)} ({', '.join(r.hosts)}); runs {r.runs}: {r.ok} ok, {r.ooms} OOM, "
                   f"{r.failed} failed, {r.interrupted} interrupted")
        if not r.corrections:
            out.append("  no finished run to correct from")
        for stage, c in r.corrections.items():
            out.append(f"  {stage:<12} {c['intercept_bytes'] / 1024**3:+8.3f} GiB {c['slope_bytes_per_token']:+10.1f} "
                       f"B/token   p95 band {c['residual_p95_bytes'] / 1024**3:.3f} GiB "
                       f"(host spread {c['host_spread_bytes'] / 1024**3:.3f} GiB)   {c['n_runs']} runs")
        out.append("")
    return "\n".join(out).rstrip()


def copy_report_line(r) -> str:
    skipped = "".join(f"\n  not copied: {why}" for why in r.skipped)
    if r.nothing_new:
        return f"{r.destination} already had all {r.runs_in_source} runs of {r.source}: nothing copied" + skipped
    return (f"copied {r.source} -> {r.destination}: {r.runs_added} runs, {r.outcomes_added} outcomes, "
            f"{r.machines_added} machines, {r.memos_added} memos, {r.corrections_added} corrections"
            + (f", {r.device_stages_added} per-device stage rows" if r.device_stages_added else "")
            + (f", {r.withdrawals_added} withdrawals" if r.withdrawals_added else "")
            + f" ({r.runs_in_source} runs in the source)" + skipped)


def withdrawn_line(w) -> str:
    if w.withdrawal_id is None:
        first = w.earlier[0]
        return f"run {w.run_id} was withdrawn already ({first['why']}): nothing added"
    refit = (f"; its scope refitted without it ({len(w.refitted)} stage{'s' * (len(w.refitted) != 1)})"
             if w.refitted else "; no other run of its scope remains to fit a correction from")
    return (f"run {w.run_id} withdrawn: it stays in the records, marked, and no correction uses it any more"
            + refit + " (push it to carry the withdrawal to a fleet)")


def fleet_init_lines(f) -> str:
    return "\n".join([
        f"{f.database}: schema {f.schema_version} in schema 'vramcal', owned by {f.owner}",
        f"roles created: {', '.join(f.roles_created) or 'none (they existed)'}; {f.writer} may insert and read, "
        "not update or delete",
        f"hosts record with: --db {f.writer_url} (password in ~/.pgpass or PGPASSWORD, not in the URL)",
    ])


def recheck_line(out: dict) -> str:
    verdict = ("ANOTHER MODEL" if out.get("other_model") else "CONSISTENT" if out["consistent"] else "CHANGED")
    return (f"run {out['memo_run']} rechecked as run {out['recheck_run']}: " + verdict
            + f"  old peak {fmt_gib_gb(out['old_peak_bytes'])}, new {fmt_gib_gb(out['new_peak_bytes'])}, "
            f"tolerance {fmt_gib_gb(out['tolerance_bytes'])}"
            + "".join(f"\n  note: {c}" for c in out.get("changes") or ()))


def memo_markdown(m: dict) -> str:
    from .estimator.loading import python_code

    return "\n".join([
        f"# Known-good configuration: {m['model']}",
        "",
        f"- **Quantization**: {m['quantization']} ({m['implementation']})",
        f"- **Context length**: {m['context_length']}"
        + (f" ({m['new_tokens']} generated)" if m.get("new_tokens") else ""),
        f"- **Batch size**: {m['batch_size']}",
        f"- **Peak memory**: {fmt_gib_gb(m['peak_bytes'])} — read from {m['peak_read_from']}"
        + (f"; torch allocator reserved {fmt_gib_gb(m['torch_allocator_peak_reserved_bytes'])}"
           if m.get("torch_allocator_peak_reserved_bytes") else ""),
        f"- **Peak stage**: {m['peak_stage']}",
        f"- **Device**: {m['gpu_model'] or m['device']}, {fmt_gib_gb(m['total_memory_bytes'])} total",
        f"- **Command**: `{m['command']}`",
        f"- Recorded {m['recorded_at']} on {m['host']}, run {m['run_id']}",
        *(["", "Load it in Python with the same arguments:", "", "```python",
           python_code(m.get("pretrained_id") or m["model"], m["from_pretrained"],
                       m.get("auto_class") or "AutoModelForCausalLM"), "```"]
          if m.get("from_pretrained") else []),
        "",
        "Recheck after a change: `vramcal memo --recheck` re-runs the command and compares the peak.",
    ]) + "\n"


_STAGE_ORDER = {s: i for i, s in enumerate(PROBE_STAGES)}


def run_table(run) -> str:
    """One recorded run (:class:`~vramcal.records.store.RunRecord`) for a person: what ran, where, how it
    ended, each stage estimated beside measured, per device for a split run, and the corrections it fed."""
    import time

    c, m = run.context, run.machine
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run.created_at))
    device = ",".join(c.split_devices) + f" (main {c.device})" if c.split_devices else c.device
    est = c.estimate or {}
    lines = [f"run {run.id}  {run.status.upper()}" + (f" after {run.outcome.last_stage}" if run.outcome and
                                                       run.outcome.last_stage and run.status != "ok" else "")
             + f"  recorded {when}" + ("  WITHDRAWN" if run.withdrawn else ""),
             *(f"  withdrawn   {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(w['created_at']))}"
               f"{' on ' + w['hostname'] if w.get('hostname') else ''}: {w['why']} (no correction uses this run)"
               for w in run.withdrawals),
             f"  model       {c.model}" + (f"  (config {c.config_hash})" if c.config_hash else ""),
             f"  quant       {c.quant}" + (f" ({c.quant_impl})" if c.quant_impl else "") + f"  dtype {c.dtype}",
             f"  workload    ctx {c.ctx}" + (f" (prompt {est['prompt']} + {est['new_tokens']} new)"
                                            if est.get("prompt") else "") + f"  batch {c.batch}"
             + f"  kv-dtype {c.kv_dtype}  attn {c.attn}" + (f"  cache {est['cache']}" if est.get("cache") else "")
             + (f"  images {est['images']} ({est.get('image_tokens')} tokens)" if est.get("images") else ""),
             f"  device      {device}",
             f"  command     {c.command}"]
    if m.get("kind") == "cpu":
        machine = f"{m.get('cpu_model') or 'CPU'}, {fmt_gib_gb(m.get('total_bytes'))} RAM"
    else:
        machine = (f"{m.get('gpu_name') or 'GPU'}, {fmt_gib_gb(m.get('total_bytes'))}, driver {m.get('driver')}, "
                   f"CUDA {m.get('cuda_runtime')}")
    lines += [f"  machine     {m.get('hostname')}: {machine}",
              f"  software    torch {m.get('torch')}, transformers {m.get('transformers')}, bitsandbytes "
              f"{m.get('bitsandbytes')}, accelerate {m.get('accelerate')}",
              f"  estimate    {c.estimator_model or 'none recorded'}"
              + (f" (vramcal {c.vramcal_version})" if c.vramcal_version else "")]
    o = run.outcome
    if o is not None and o.error:
        lines.append(f"  error       {o.error}")
    if o is not None and o.oom:
        lines.append(f"  out of memory at {o.oom.get('stage')}, asked for {fmt_gib_gb(o.oom.get('requested_bytes'))}")
    if o is None:
        lines.append("  no outcome recorded: the run was interrupted before its result was written")
        return _rows(lines)
    what = "above the process's baseline" if o.series == "rss" else "NVML memory.used"
    lines += ["", f"stages ({what}; {run.sample_count:,} samples on {o.series or 'no series'})",
              f"  {'stage':<14} {'estimated':>14} {'measured peak':>14} {'measured used':>14} {'peak - est.':>14}"]
    for s in o.stages:
        diff = (f"{gib(s.measured_peak_bytes - s.estimated_bytes):+10.3f} GiB"
                if s.measured_peak_bytes is not None and s.estimated_bytes is not None else f"{'':>14}")
        lines.append(f"  {s.stage:<14} {_cell(s.estimated_bytes, 14)} {_cell(s.measured_peak_bytes, 14)} "
                     f"{_cell(s.measured_used_bytes, 14)} {diff}")
    if o.devices:
        lines += ["", "per device (GPU: NVML memory.used peak; cpu: the child's resident set above its baseline)",
                  f"  {'device':<8} {'stage':<14} {'estimated':>14} {'measured peak':>14} {'peak - est.':>14}"]
        order = {d: i for i, d in enumerate(c.split_devices or ())}
        for d in sorted(o.devices, key=lambda d: (_STAGE_ORDER.get(d.stage, 99), order.get(d.device, 99), d.device)):
            diff = (f"{gib(d.measured_peak_bytes - d.estimated_bytes):+10.3f} GiB"
                    if d.measured_peak_bytes is not None and d.estimated_bytes is not None else "")
            lines.append(f"  {d.device:<8} {d.stage:<14} {_cell(d.estimated_bytes, 14)} "
                         f"{_cell(d.measured_peak_bytes, 14)} {diff:>14}")
    if run.corrections:
        lines += ["", "corrections this run fed (intercept + slope x tokens, per stage)"]
        for corr in run.corrections:
            scope = corr["stack"].split("|quant=", 1)
            label = ("quant=" + scope[1]) if len(scope) > 1 else "any run on this stack"
            lines.append(f"  {corr['stage']:<14} {corr['intercept_bytes'] / 1024**3:+8.3f} GiB "
                         f"{corr['slope_bytes_per_token']:+10.1f} B/token from {corr['n_runs']} run(s)   {label}")
    return _rows(lines)


# ---------------------------------------------------------------------------------------- --engine vllm

def _gib_cell(n: int | None) -> str:
    return "n/a" if n is None else f"{gib(n):.2f} GiB"


def _revision_line(e) -> list[str]:
    """Which commit of a Hub model was priced (docs/hub.md); nothing for a folder or a catalog name."""
    return [f"revision {e.revision} (the Hub commit whose config and weight headers were priced)"] if e.revision else []


def vllm_table(e) -> str:
    """``estimate --engine vllm``: the terms vLLM prints, per rank when there are several, then the lines."""
    v = e.vllm
    head = (f"{e.model}  [{e.architecture}]  vLLM {v.version} ({v.version_source})  dtype={v.dtype}  "
            f"kv-cache-dtype={v.kv_cache_dtype}  quantization={v.quantization}")
    link = f" over {v.interconnect}" if getattr(v, "interconnect", None) else ""
    setup = (f"tp={v.tensor_parallel_size}{link} pp={v.pipeline_parallel_size}  gpu memory {gib(v.gpu_memory_bytes):.2f} GiB "
             f"x {v.gpu_memory_utilization:g} = {gib(v.requested_bytes):.2f} GiB  max-model-len={v.max_model_len:,}  "
             f"max-num-seqs={v.max_num_seqs}  max-num-batched-tokens={v.max_num_batched_tokens}  block={v.block_size}"
             + ("  enforce-eager" if v.enforce_eager else ""))
    lines = [head, setup, *_revision_line(e), ""]
    if not v.fits:
        lines += ["WOULD NOT START", "  " + (v.error or ""), ""]
    graphs = "subtracted" if v.cuda_graph_subtracted else "outside the budget"
    rows = [("weights (Model loading took)", v.weights_bytes), ("activation peak (profile run)", v.activation_bytes),
            ("non-torch", v.non_torch_bytes), (f"CUDA graphs ({graphs})", v.cuda_graph_bytes),
            ("available KV cache memory", v.kv_cache_bytes)]
    what = "per GPU, the limiting rank's" if v.ranks else "per GPU"
    lines.append(f"startup terms ({what})")
    lines += [_row(label, n, 32) for label, n in rows]
    if v.fits:
        lines += [f"  {'GPU KV cache size':<32} {v.kv_cache_tokens:>12,} tokens ({v.num_blocks:,} blocks of "
                  f"{v.block_size})", f"  {'maximum concurrency':<32} {v.max_concurrency:>12.2f}x at {v.max_model_len:,} "
                  "tokens per request"]
    lines.append(f"  {'longest max-model-len that fits':<32} {v.max_model_len_fit:>12,} tokens")
    if v.ranks:
        lines += ["", "per rank (tp, pp)       layers      weights   activation    non-torch  available KV       blocks"]
        for r in v.ranks:
            mark = " <" if r.rank == v.limiting_rank else ""
            lines.append(f"  {r.rank:>3} ({r.tp_rank}, {r.pp_rank})   {r.layers[0]:>4}-{r.layers[1] - 1:<4} "
                         f"{_gib_cell(r.weights_bytes):>12} {_gib_cell(r.activation_bytes):>12} "
                         f"{_gib_cell(r.non_torch_bytes):>12} {_gib_cell(r.available_bytes):>12} {r.num_blocks:>12,}{mark}")
    lines += ["", "what vLLM will print"] + ["  " + ln for ln in v.log_lines]
    lines += ["", "device memory (NVML view of the limiting GPU)"]
    for key in ("load_peak", "post_load"):
        lines.append(_row({"load_peak": "after loading", "post_load": "after startup"}[key], e.stages[key], 32))
    lines += ["", "how"] + [f"  {k}: {m}" for k, m in v.methods.items()]
    if v.correction:
        lines += ["", "corrected by this machine's vLLM runs: " + v.correction.get("scope", "")]
        lines += [f"  {k}: {gib(d):+.2f} GiB" for k, d in v.correction.get("delta_bytes", {}).items()]
    if v.notes:
        lines += ["", "notes"] + ["  " + n for n in v.notes]
    return "\n".join(lines)


def vllm_fit_table(model: str, f, notes: list[str] = ()) -> str:
    """``fit --engine vllm``: the answer, then the estimate's notes (what it assumed, a flag that changed nothing)."""
    tail = (["", "notes"] + ["  " + n for n in notes]) if notes else []
    if f.question == "longest":
        lines = [f"{model}  vLLM {f.version}  gpu memory {gib(f.gpu_memory_bytes):.2f} GiB x {f.gpu_memory_utilization:g}"]
        if not f.fits:
            return "\n".join(lines + ["  nothing fits: " + f.note] + tail)
        lines += [f"  longest --max-model-len      {f.max_model_len:,} tokens",
                  f"  GPU KV cache size            {f.kv_cache_tokens:,} tokens ({gib(f.kv_cache_memory_bytes):.2f} GiB)",
                  f"  maximum concurrency          {f.max_concurrency:.2f}x at that length"]
        return "\n".join(lines + tail)
    lines = [f"{model}  vLLM {f.version}  gpu memory {gib(f.gpu_memory_bytes):.2f} GiB  --max-model-len {f.max_model_len:,}"]
    if f.gpu_memory_utilization is None:
        return "\n".join(lines + ["  nothing fits: " + f.note] + tail)
    lines.append(f"  --gpu-memory-utilization     {f.gpu_memory_utilization:.4f}")
    if f.kv_cache_memory_bytes is not None:
        lines.append(f"  or --kv-cache-memory-bytes   {f.kv_cache_memory_bytes} ({gib(f.kv_cache_memory_bytes):.2f} GiB)")
    lines.append(f"  maximum concurrency          {f.max_concurrency:.2f}x, GPU KV cache size {f.kv_cache_tokens:,} tokens")
    if f.note:
        lines.append("  " + f.note)
    return "\n".join(lines + tail)


def vllm_probe_table(r, run_id) -> str:
    """``probe --engine vllm``: vLLM's logged terms beside the prediction, then the sampled stages."""
    lines = [f"{r.model}  vLLM {r.version or '?'}  GPUs {r.gpus}  status {r.status}"
             + (f"  (recorded as run {run_id})" if run_id is not None else "")]
    if r.error:
        lines.append("  " + r.error)
    lines += ["", f"  {'term':<22} {'predicted':>14} {'vLLM logged':>14}"]
    for term, (pred, got) in r.comparison().items():
        fmt = (lambda n: "n/a" if n is None else f"{n:,}") if term == "kv_cache_tokens" else _gib_cell
        lines.append(f"  {term.replace('_bytes', ''):<22} {fmt(pred):>14} {fmt(got):>14}")
    priced = r.estimate.vllm.compile_cache if r.estimate is not None and r.estimate.vllm is not None else None
    if priced is not None or r.logged.compile_cache is not None:
        lines.append(f"  {'compile cache':<22} {priced or 'n/a':>14} {r.logged.compile_cache or 'not logged':>14}")
    lines += ["", "sampled (NVML memory.used of the first GPU)"]
    est = r.estimate.stages if r.estimate is not None else {}
    for name, s in r.stages.items():
        lines.append(f"  {name:<14} peak {_gib_cell(s.get('peak_bytes')):>12}   predicted {_gib_cell(est.get(name)):>12}")
    notes = [*(r.estimate.notes if r.estimate is not None else []), *r.notes]  # the prediction's, then the run's
    if notes:
        lines += ["", "notes"] + ["  " + n for n in notes]
    return "\n".join(lines)


def plan_text(r) -> str:
    """``vramcal plan``: the machine, the ranked plans, why nothing better, the first plan's load and the
    command that verifies it; or, when nothing fits, what is missing."""
    hw = r.hardware
    gpus = ", ".join(f"{g.device} {fmt_gib_gb(g.memory_bytes)}" + (f" ({g.name})" if g.name else "")
                     + (f" [{g.held_by}]" if g.held_by else "") for g in hw.gpus)
    ram = f"RAM {fmt_gib_gb(hw.cpu_bytes)}" if hw.cpu_bytes else "no RAM for offload"
    disk = f", disk {fmt_gib_gb(hw.disk_bytes)}" if hw.disk_bytes else ""
    ctx = f"ctx {r.target_ctx:,}" if r.asked else f"the largest ctx (at least {r.target_ctx:,} sought)"
    lines = [f"plan for {r.model} on {gpus}; {ram}{disk} -- {hw.source}",
             f"  buffer {fmt_gib_gb(r.buffer)} per GPU, goal {r.goal}, {ctx}"]
    if not r.plans:
        lines += ["", "nothing fits: " + (r.shortfall or "no configuration fits")]
        lines += (["", "notes"] + ["  " + n for n in r.notes]) if r.notes else []
        return "\n".join(lines)
    devs = [g.device for g in hw.gpus] + [d for d in ("cpu", "disk") if any(d in p.peak_bytes for p in r.plans)]
    head = f"  {'#':>2}  {'quant':<7} {'KV':<5} {'ctx':>9}  {'layers':<24}" + "".join(f"{d:>12}" for d in devs) \
        + f"{'tokens/s <=':>13}"
    lines += ["", "plans (GPU: whole corrected peak; cpu / disk: the weights held there)", head]
    for i, p in enumerate(r.plans, 1):
        where = ("on " + "+".join(d for d in devs if d in p.peak_bytes and d.startswith("cuda"))
                 if not p.offloaded else f"{p.offloaded_layers} offloaded")
        if p.max_memory is not None and p.from_pretrained.get("device_map") == "sequential":
            where += " (sequential)"
        speed = f"{p.tokens_per_s:,.2f}" if p.tokens_per_s is not None else "unknown"
        mark = "" if p.reaches else " *"
        lines.append(f"  {i:>2}  {p.quant:<7} {p.kv_dtype:<5} {p.ctx:>9,}{mark:<2}{where:<24}"
                     + "".join(f"{gib(p.peak_bytes[d]):>8.2f} GiB" if d in p.peak_bytes else f"{'':>12}" for d in devs)
                     + f"{speed:>13}")
    if any(not p.reaches for p in r.plans):
        lines.append(f"  * short of the {r.target_ctx:,} tokens sought")
    if r.why:
        lines += ["", "why nothing better"] + ["  " + w for w in r.why]
    first = r.plans[0]
    lines += ["", "plan 1 in detail"] + ["  " + w for w in first.where]
    if first.speed.bandwidths:
        lines += ["  decode bound: " + "; ".join(f"{k} {v}" for k, v in first.speed.bandwidths.items())]
    elif first.speed.why_none:
        lines += [f"  decode bound {first.speed.why_none}"]
    if first.env:
        lines += ["  the caching allocator: " + ", ".join(f"{k}={v}" for k, v in first.env.items())
                  + f" saves {fmt_gib_gb(first.expandable_saved_bytes)} of the GPU's peak (replayed both ways); "
                  "set it in the run's environment, as the command below does"]
    lines += ["", "load it with", *(("  " + ln).rstrip() for ln in first.python().splitlines()),
              "", "verify it on this machine", "  " + first.command]
    if r.notes:
        lines += ["", "notes"] + ["  " + n for n in r.notes]
    return "\n".join(lines)


def vllm_plan_text(r) -> str:
    """``plan --engine vllm``: the `vllm serve` configurations for these GPUs, ranked."""
    hw = r.hardware
    gpus = ", ".join(f"{g.device} {fmt_gib_gb(g.total_bytes or g.memory_bytes)}" + (f" ({g.name})" if g.name else "")
                     for g in hw.gpus)
    lines = [f"vLLM {r.version or '?'} plan for {r.model} on {gpus}; --gpu-memory-utilization {r.utilization:g}",
             f"  goal {r.goal}, --max-model-len {r.target_len:,}" + (" (asked)" if r.asked else " (the model's limit)")]
    if not r.plans:
        lines += ["", "vLLM would start with none of these:"] + ["  " + w for w in r.why_not]
        lines += (["", "notes"] + ["  " + n for n in r.notes]) if r.notes else []
        return "\n".join(lines)
    lines += ["", f"  {'#':>2}  {'tp':>2}  {'weights':<9} {'KV':<5} {'max len':>9}  {'KV tokens':>11} {'concurrency':>11}"
                  f" {'weights/GPU':>12} {'tokens/s <=':>12}"]
    for i, p in enumerate(r.plans, 1):
        speed = f"{p.tokens_per_s:,.1f}" if p.tokens_per_s is not None else "unknown"
        lines.append(f"  {i:>2}  {p.tensor_parallel_size:>2}  {(p.quantization or 'stored'):<9} {p.kv_cache_dtype:<5} "
                     f"{p.max_model_len:>9,}{'' if p.reaches else '*':<1} {p.kv_cache_tokens:>11,} "
                     f"{p.max_concurrency:>10.2f}x {gib(p.weights_bytes):>8.2f} GiB {speed:>12}")
    if any(not p.reaches for p in r.plans):
        lines.append(f"  * short of --max-model-len {r.target_len:,}")
    first = r.plans[0]
    lines += ["", "serve it with", "  " + first.serve, "", "see its startup as vLLM will log it", "  " + first.command]
    if r.why_not:
        lines += ["", "would not start"] + ["  " + w for w in r.why_not]
    if r.notes:
        lines += ["", "notes"] + ["  " + n for n in r.notes]
    return "\n".join(lines)


def llamacpp_plan_text(r) -> str:
    """``plan --engine llama.cpp``: the machine, the ranked llama-server configurations, why nothing better,
    the first plan's decode bound and command; or, when nothing fits, what is missing."""
    from pathlib import Path

    hw = r.hardware
    gpus = ", ".join(f"{g.device} {fmt_gib_gb(g.memory_bytes)}" + (f" ({g.name})" if g.name else "")
                     + (f" [{g.held_by}]" if g.held_by else "") for g in hw.gpus)
    ctx = f"-c {r.target_ctx:,}" if r.asked else f"the largest -c (at least {r.target_ctx:,} sought)"
    files = f" ({len(r.files)} GGUF files)" if len(r.files) > 1 else \
        "" if Path(r.files[0][0]).name == r.model else f" ({Path(r.files[0][0]).name})"
    lines = [f"llama.cpp plan for {r.model}{files} on {gpus}; RAM {fmt_gib_gb(hw.cpu_bytes)} -- {hw.source}",
             f"  buffer {fmt_gib_gb(r.buffer)} per GPU and of the RAM, goal {r.goal}, {ctx}"]
    if not r.plans:
        lines += ["", "nothing fits: " + (r.shortfall or "no configuration fits")]
        lines += (["", "why"] + ["  " + w for w in r.why]) if r.why else []
        lines += (["", "notes"] + ["  " + n for n in r.notes]) if r.notes else []
        return "\n".join(lines)
    devs = [g.device for g in hw.gpus]
    width = max(12, *(len(Path(p.file).name) for p in r.plans)) + 1
    head = (f"  {'#':>2}  {'file':<{width}}{'bits':>5}  {'KV':<9}{'-c':>9}  {'layers':<31}"
            + "".join(f"{d:>12}" for d in devs) + f"{'RAM':>12}{'tokens/s <=':>13}")
    lines += ["", "plans (GPU: its buffers + what llama.cpp holds beyond them; RAM: every host buffer, CPU_Mapped "
              "included, + the process beyond them where measured)", head]
    for i, p in enumerate(r.plans, 1):
        kv = p.cache_type_k if p.cache_type_k == p.cache_type_v else f"{p.cache_type_k}/{p.cache_type_v}"
        speed = f"{p.tokens_per_s:,.2f}" if p.tokens_per_s is not None else "unknown"
        lines.append(f"  {i:>2}  {Path(p.file).name:<{width}}{p.bits_per_weight:>5.2f}  {kv:<9}{p.ctx_size:>9,}"
                     f"{'' if p.reaches else '*':<2}{p.where():<31}"
                     + "".join(f"{gib(p.gpu_bytes.get(d, 0)):>8.2f} GiB" for d in devs)
                     + f"{gib(p.host_bytes):>8.2f} GiB{speed:>13}")
    if any(not p.reaches for p in r.plans):
        lines.append(f"  * short of the -c {r.target_ctx:,} sought")
    if r.why:
        lines += ["", "why nothing better"] + ["  " + w for w in r.why]
    first = r.plans[0]
    reads = ", ".join(f"{d} {fmt_gib_gb(b)}" for d, b in first.read_bytes.items())
    lines += ["", "plan 1 in detail", f"  read per generated token (the weights, of a MoE layer's experts the routed "
              f"share, and the KV at -c {first.ctx_size:,}): {reads}"]
    if first.speed.bandwidths:
        lines.append("  decode bound: " + "; ".join(f"{k} {v}" for k, v in first.speed.bandwidths.items()))
    if first.speed.why_none:
        lines.append(f"  decode bound {first.speed.why_none}")
    lines += [f"  beyond the buffers, on each GPU: {r.beyond.gpu_source}",
              f"  beyond the buffers, in RAM: {r.beyond.host_source}"]
    lines += ["", "run it with", "  " + first.command, "", "see its buffers as llama.cpp will log them",
              "  " + first.verify]
    if r.notes:
        lines += ["", "notes"] + ["  " + n for n in r.notes]
    return "\n".join(lines)


def llamacpp_json(e, beyond=None) -> dict:
    """``estimate --engine llama.cpp --json``: llama.cpp's buffers under ``llama_cpp``, integer bytes; each
    device's total with what llama.cpp holds beyond its buffers (``beyond_buffers``, with where it came from)."""
    from .estimator.llamacpp.fit import DEFAULT_BEYOND, gpu_totals, host_total

    beyond = beyond or DEFAULT_BEYOND
    return {"engine": "llama.cpp", "model": e.model, "device_bytes": e.device_bytes(),
            "device_totals": {**gpu_totals(e, beyond=beyond), "CPU": host_total(e, beyond)},
            "beyond_buffers": beyond.to_dict(), "llama_cpp": e.to_dict()}


def llamacpp_table(e, beyond=None) -> str:
    """``estimate --engine llama.cpp``: the buffer lines llama.cpp will print, then the total per device."""
    from .units import MIB

    head = (f"{e.model}  [{e.arch}]  n_ctx={e.n_ctx:,} (n_ctx_seq {e.n_ctx_seq:,} x {e.n_seq_max} seq)  "
            f"n_batch={e.n_batch} n_ubatch={e.n_ubatch}  flash_attn={'on' if e.flash_attn else 'off'}  "
            f"offloaded {e.n_gpu_layers}/{e.n_layer + 1} layers")
    rev = [f"revision {e.revision} (the Hub commit whose GGUF header was priced; no tensor data was read)"] \
        if e.revision and not e.priced_from else []
    lines = [head, *rev, *priced_from_lines(e.priced_from, e.revision), "", "what llama.cpp will print"]
    lines += ["  " + ln for ln in e.log_lines()]
    if e.kv_caches:
        lines += [f"  llama_kv_cache: {c['cache']}: {c['cells']:,} cells, {c['layers']} layers, "
                  f"{c['streams']} stream(s), K {c['k_bytes'] / MIB:.2f} MiB, V {c['v_bytes'] / MIB:.2f} MiB"
                  for c in e.kv_caches]
    if e.rs_cache:
        r = e.rs_cache
        lines.append(f"  llama_memory_recurrent: {r['cells']:,} cells, {r['layers']} layers, R (f32) "
                     f"{r['r_bytes'] / MIB:.2f} MiB, S (f32) {r['s_bytes'] / MIB:.2f} MiB")
    lines += ["", "per device: llama.cpp's buffers, then the total with what it holds beyond them"]
    lines += _beyond_rows(e, beyond)
    weights = ", ".join(f"{t} {n / MIB:,.1f} MiB" for t, n in sorted(e.weight_types.items(), key=lambda x: -x[1]))
    lines += ["", f"weights as stored: {_g(e.weights_bytes)} ({weights})", f"compute: {e.compute_method}"]
    if e.notes:
        lines += ["", "notes"] + ["  " + n for n in e.notes]
    return "\n".join(lines)


def _beyond_rows(e, beyond=None) -> list[str]:
    """Each device's buffers, what llama.cpp holds there beyond them and the total, then where that came from."""
    from .estimator.llamacpp.fit import DEFAULT_BEYOND, gpu_totals, host_total
    from .units import MIB

    beyond = beyond or DEFAULT_BEYOND
    totals = {**gpu_totals(e, beyond=beyond), "CPU": host_total(e, beyond)}

    def row(label: str, n: int | None) -> str:  # MiB, as llama.cpp prints its buffers
        return f"  {label:<26} {'not known':>14}" if n is None else f"  {label:<26} {n / MIB:>14,.2f} MiB"

    lines = []
    for dev, b in e.device_bytes().items():
        lines += [row(f"{dev} buffers", b), row(f"{dev} beyond them", beyond.host_bytes if dev == "CPU" else
                                                                     beyond.gpu_bytes),
                  row(f"{dev} total", totals.get(dev, b))]
    lines.append(f"  beyond the buffers, on a GPU: {beyond.gpu_source}")
    lines.append(f"  beyond the buffers, on the host: {beyond.host_source}")
    return lines


def priced_from_lines(p: dict | None, revision: str | None = None) -> list[str]:
    """A GGUF priced from its HF config: what it was derived from, and the file's size."""
    if not p:
        return []
    lines = [f"priced from its config, before download: the GGUF convert_hf_to_gguf.py + llama-quantize {p['type']}"
             f"{' (with an importance matrix)' if p['imatrix'] else ''} would write, each tensor typed by llama.cpp's "
             f"own per-tensor choice (src/llama-quant.cpp); file {_g(p['file_bytes'])} of tensor data (the header "
             "adds the vocabulary)"]
    if revision:
        lines.append(f"config of {revision} (the Hub commit read)")
    if p["fallbacks"]:
        lines.append(f"{len(p['fallbacks'])} tensor(s) fell back to another type (a row not divisible by the "
                     f"block): {p['fallbacks'][0]}{' ...' if len(p['fallbacks']) > 1 else ''}")
    return lines


def llamacpp_fit_table(f, budget: int, buffer: int) -> str:
    lines = [f"{f.model}  budget {_g(budget)} per GPU, {_g(buffer)} kept free", *priced_from_lines(f.priced_from)]
    if not f.fits:
        lines.append("  nothing fits: " + (f.note or ""))
    else:
        moe = f"  --n-cpu-moe {f.n_cpu_moe}" if f.n_cpu_moe else ""
        ts = f"  -ts {','.join(str(x) for x in f.tensor_split)}" if f.tensor_split else ""
        lines += [f"  -ngl {f.n_gpu_layers}{moe}{ts}  -c {f.ctx_size:,}   ({f.gpu_layers}/{f.n_layer + 1} layers on "
                  "the GPUs)",
                  f"  largest GPU total {_g(f.peak_bytes)} (buffers + what llama.cpp holds beyond them: "
                  f"{(f.beyond.gpu_source if f.beyond else 'the default CUDA context')})",
                  "", "  " + f.command]
    if f.notes:
        lines += ["", "notes"] + ["  " + n for n in f.notes]
    return "\n".join(lines)


def llamacpp_probe_table(r, run_id) -> str:
    """``probe --engine llama.cpp``: each buffer llama.cpp logged beside the prediction, then the samples."""
    from .units import MIB

    lines = [f"{r.model}  llama.cpp  status {r.status}" + (f"  (recorded as run {run_id})" if run_id is not None
                                                            else "")]
    if r.error:
        lines.append("  " + r.error)
    lines += ["", f"  {'buffer':<30} {'predicted MiB':>14} {'logged MiB':>12}"]
    e, g = r.estimate, r.logged
    for kind in ("model", "kv", "rs", "compute"):
        pred, got = getattr(e, f"{kind}_buffer_bytes", {}) or {}, getattr(g, f"{kind}_buffer_bytes", {}) or {}
        for name in list(dict.fromkeys([*pred, *got])):
            p, q = pred.get(name), got.get(name)
            lines.append(f"  {name + ' ' + kind:<30} {'n/a' if p is None else f'{p / MIB:.2f}':>14} "
                         f"{'n/a' if q is None else f'{q / MIB:.2f}':>12}")
    po, go = e.output_buffer_bytes if e else None, g.output_buffer_bytes
    lines.append(f"  {'output':<30} {'n/a' if po is None else f'{po / MIB:.2f}':>14} "
                 f"{'n/a' if go is None else f'{go / MIB:.2f}':>12}")
    lines.append(f"  {'n_ctx':<30} {e.n_ctx if e else 'n/a':>14} {g.n_ctx if g.n_ctx is not None else 'n/a':>12}")
    what = "the child's resident set" if r.series == "rss" else f"NVML memory.used of {r.series}"
    lines += ["", f"sampled ({what})"]
    for name, s in r.stages.items():
        lines.append(f"  {name:<14} peak {_gib_cell(s.get('peak_bytes')):>12}   at the marker "
                     f"{_gib_cell(s.get('used_bytes')):>12}")
    if r.notes:
        lines += ["", "notes"] + ["  " + n for n in r.notes]
    return "\n".join(lines)
