"""The one gate a record passes before it touches a store from outside: an imported file, a run pulled
or pushed from another database. Every field is checked against the schema's types and ranges, and the
whole run against physics (:func:`valid_physics`: no negative or impossible bytes, none above the
device's total where the machine says it, stages in the order a probe passes them, samples inside the
run's time); what fails is refused in one line that names the field, never stored (the store is
append-only: nonsense recorded once would stay forever and break every reader after it; a run that got
in before these checks is withdrawn with ``vramcal records withdraw``).

:func:`valid_context`, :func:`valid_outcome` and :func:`valid_fingerprint` take the plain JSON of a
record and return the typed :class:`~vramcal.records.store.RunContext` / :class:`~vramcal.records.store.Outcome`
(or the fingerprint dict), or raise :class:`InvalidRecord` (a :class:`~vramcal.errors.UserError`).
"""

from __future__ import annotations

import math
import re

from ..errors import UserError
from ..workload import MAX_BATCH, MAX_TOKENS, PROBE_STAGES
from .store import DeviceStageRow, Outcome, RunContext, StageRow

STATUSES = ("ok", "oom", "error", "crashed", "interrupted", "killed")
KINDS = ("cpu", "cuda")
MAX_TEXT = 64 * 1024  # a command, an error message: never near this
MAX_BYTES = 1 << 50  # one pebibyte: no device or host holds a hundredth of it
# How far below the child's baseline a CPU reading (its resident set minus the baseline's) can fall: at
# most the baseline itself -- imports of torch and transformers, a few GiB -- so never more than this
MAX_BELOW_BASELINE = 64 << 30
SAMPLE_SLACK_S = 1.0  # samples are stamped on the parent's clock, a little before the child or after its end
_DEVICE = re.compile(r"cpu|disk|cuda(:(0|[1-9][0-9]{0,2}))?")
_SERIES = re.compile(r"rss|gpu(0|[1-9][0-9]{0,2})(_proc)?")


class InvalidRecord(UserError):
    """A record that is not what vramcal writes: refused before the store sees it."""


def _fail(where: str, field: str, value, want: str):
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    raise InvalidRecord(f"{where}: {field} = {text} is not {want}; nothing of it was recorded")


def _text(where, field, value, optional=True, limit=MAX_TEXT):
    if value is None and optional:
        return None
    if not isinstance(value, str) or (not optional and not value) or len(value) > limit:
        _fail(where, field, value, "text" + ("" if optional else " (not empty)"))
    return value


def _int(where, field, value, lo=0, hi=MAX_BYTES, optional=True):
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        _fail(where, field, value, f"a whole number from {lo:,} to {hi:,}")
    return value


def _number(where, field, value, lo=0.0, optional=True):
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < lo:
        _fail(where, field, value, f"a finite number of at least {lo:g}")
    return float(value)


def _choice(where, field, value, choices, optional=True):
    if value is None and optional:
        return None
    if value not in choices:
        _fail(where, field, value, "one of " + ", ".join(choices))
    return value


def _device(where, field, value):
    if not isinstance(value, str) or not _DEVICE.fullmatch(value):
        _fail(where, field, value, "a device (cpu, cuda:N)")
    return value


def _mapping(where, field, value, optional=True):
    if value is None and optional:
        return None
    if not isinstance(value, dict):
        _fail(where, field, value, "an object")
    return value


def valid_fingerprint(fp, where: str = "record") -> dict:
    fp = _mapping(where, "fingerprint", fp, optional=False)
    _choice(where, "fingerprint.kind", fp.get("kind"), KINDS, optional=False)
    for key, value in fp.items():
        if not isinstance(key, str) or len(key) > 64:
            _fail(where, "a fingerprint field", key, "a field name")
        if key == "total_bytes":
            _int(where, "fingerprint.total_bytes", value, 1)
        elif value is not None and not isinstance(value, (str, int)) or isinstance(value, bool):
            _fail(where, f"fingerprint.{key}", value, "text or a number")
        elif isinstance(value, str) and len(value) > 1024:
            _fail(where, f"fingerprint.{key}", value, "short text")
    return fp


def valid_context(run, where: str = "record") -> RunContext:
    run = _mapping(where, "run", run, optional=False)
    split = run.get("split_devices")
    if split is not None:
        if not isinstance(split, list) or not split:
            _fail(where, "run.split_devices", split, "a list of devices")
        split = [_device(where, "run.split_devices[]", d) for d in split]
    return RunContext(
        model=_text(where, "run.model", run.get("model"), optional=False, limit=4096),
        quant=_text(where, "run.quant", run.get("quant"), optional=False, limit=64),
        ctx=_int(where, "run.ctx", run.get("ctx"), 1, MAX_TOKENS, optional=False),
        batch=_int(where, "run.batch", run.get("batch"), 1, MAX_BATCH, optional=False),
        device=_device(where, "run.device", run.get("device")),
        command=_text(where, "run.command", run.get("command"), optional=False),
        config_hash=_text(where, "run.config_hash", run.get("config_hash"), limit=128),
        quant_impl=_text(where, "run.quant_impl", run.get("quant_impl"), limit=256),
        dtype=_text(where, "run.dtype", run.get("dtype"), limit=32),
        kv_dtype=_text(where, "run.kv_dtype", run.get("kv_dtype"), limit=32),
        attn=_text(where, "run.attn", run.get("attn"), limit=64),
        estimate=_mapping(where, "run.estimate", run.get("estimate")),
        estimator_model=_text(where, "run.estimator_model", run.get("estimator_model"), limit=64),
        vramcal_version=_text(where, "run.vramcal_version", run.get("vramcal_version"), limit=64),
        split_devices=split,
        created_at=_number(where, "run.created_at", run.get("created_at")))


def _once(where: str, field: str, keys: list[str]) -> None:
    """A run has one row per stage (per device and stage): a repeated one is refused, not half-stored."""
    seen = set()
    for k in keys:
        if k in seen:
            _fail(where, field, k, "given once (it is repeated)")
        seen.add(k)


def _stage_fields(where: str, s: dict) -> dict:
    """The fields a stage row and a device's stage row share, checked (measured figures may be negative:
    on the CPU they are above the child's baseline)."""
    return {"stage": _choice(where, "stage", s.get("stage"), PROBE_STAGES, optional=False),
            "estimated_bytes": _int(where, "estimated_bytes", s.get("estimated_bytes")),
            "measured_peak_bytes": _int(where, "measured_peak_bytes", s.get("measured_peak_bytes"), -MAX_BYTES),
            "measured_used_bytes": _int(where, "measured_used_bytes", s.get("measured_used_bytes"), -MAX_BYTES)}


def _objects(where: str, o: dict, key: str) -> list[dict]:
    """``o[key]``: a list of objects (absent: none)."""
    items = o.get(key) or []
    if not isinstance(items, list):
        _fail(where, f"outcome.{key}", items, "a list")
    return [_mapping(where, f"outcome.{key}[]", x, optional=False) for x in items]


def valid_outcome(outcome, where: str = "record") -> Outcome:
    o = _mapping(where, "outcome", outcome, optional=False)
    rows = [StageRow(**_stage_fields(where, s),
                     torch_max_allocated=_int(where, "torch_max_allocated", s.get("torch_max_allocated")),
                     torch_max_reserved=_int(where, "torch_max_reserved", s.get("torch_max_reserved")))
            for s in _objects(where, o, "stages")]
    device_rows = [DeviceStageRow(device=_device(where, "device", d.get("device")), **_stage_fields(where, d))
                   for d in _objects(where, o, "devices")]
    _once(where, "outcome.stages[]", [r.stage for r in rows])
    _once(where, "outcome.devices[]", [f"{r.device} {r.stage}" for r in device_rows])
    samples = o.get("samples") or []
    if not isinstance(samples, list):
        _fail(where, "outcome.samples", samples, "a list")
    clean = []
    for x in samples:
        if not isinstance(x, (list, tuple)) or len(x) != 3:
            _fail(where, "a sample", x, "[seconds, series, bytes]")
        t, series, b = x
        if not isinstance(series, str) or not _SERIES.fullmatch(series):
            _fail(where, "a sample's series", series, "rss or gpuN")
        clean.append((_number(where, "a sample's time", t, -1e9), series, _int(where, "a sample's bytes", b)))
    return Outcome(
        status=_choice(where, "outcome.status", o.get("status"), STATUSES, optional=False),
        last_stage=_choice(where, "outcome.last_stage", o.get("last_stage"), PROBE_STAGES),
        error=_text(where, "outcome.error", o.get("error")),
        oom=_mapping(where, "outcome.oom", o.get("oom")),
        series=_text(where, "outcome.series", o.get("series"), limit=32),
        wall_s=_number(where, "outcome.wall_s", o.get("wall_s")),
        sampler_overhead=_number(where, "outcome.sampler_overhead", o.get("sampler_overhead")),
        result=_mapping(where, "outcome.result", o.get("result")) or {},
        stages=rows, devices=device_rows, samples=clean,
        finished_at=_number(where, "outcome.finished_at", o.get("finished_at")))


def _gib(n: int) -> str:
    return f"{n / (1 << 30):,.2f} GiB"


def valid_physics(fingerprint: dict, context: RunContext, outcome: Outcome | None, where: str = "record") -> None:
    """What the types cannot say, checked on a typed run: every byte count a device could hold.

    - A GPU run's readings are as read (NVML): from 0 to the device's total (the fingerprint's
      ``total_bytes``, else :data:`MAX_BYTES`); a CPU run's are the child's resident set above its
      baseline: from minus the baseline (at most :data:`MAX_BELOW_BASELINE`) to the host's RAM.
    - torch's counters and the main series' samples: from 0 to the device's total.
    - Stages in the order a probe passes them (``baseline``, ``context``, ``load_peak``, ...).
    - Samples inside the run: from 0 to its wall time (with :data:`SAMPLE_SLACK_S`), and a result that
      ends after the run began."""
    if outcome is None:
        return
    total = fingerprint.get("total_bytes") or MAX_BYTES
    on_gpu = str(context.device).startswith("cuda") and fingerprint.get("kind") == "cuda"
    cap = f"the device's total ({_gib(total)})" if fingerprint.get("total_bytes") else "one PiB"
    baseline = next((r for r in outcome.stages if r.stage == "baseline"), None)
    floor = MAX_BELOW_BASELINE
    if not on_gpu:
        for v in (baseline and (baseline.measured_used_bytes or baseline.measured_peak_bytes), total):
            floor = min(floor, v) if v is not None else floor

    def bound(field, value, lo, hi, why_hi=cap):
        if value is None:
            return
        if value < lo:
            _fail(where, field, value, "possible: a reading cannot be negative" if lo == 0 else
                  f"possible: a CPU reading falls at most its baseline ({_gib(-lo)}) below it")
        if value > hi:
            _fail(where, field, value, f"possible: above {why_hi}")

    order = []
    for r in outcome.stages:
        lo = 0 if on_gpu or r.stage == "baseline" else -floor
        for name in ("measured_peak_bytes", "measured_used_bytes"):
            bound(f"stage {r.stage}'s {name}", getattr(r, name), lo, total)
        for name in ("torch_max_allocated", "torch_max_reserved"):
            bound(f"stage {r.stage}'s {name}", getattr(r, name), 0, total)
        order.append(PROBE_STAGES.index(r.stage))
    if order != sorted(order):
        _fail(where, "outcome.stages", [r.stage for r in outcome.stages],
              "in the order a probe passes them (" + ", ".join(PROBE_STAGES) + ")")
    for d in outcome.devices:
        lo = 0 if d.device.startswith("cuda") else -MAX_BELOW_BASELINE
        for name in ("measured_peak_bytes", "measured_used_bytes"):
            bound(f"{d.device} {d.stage}'s {name}", getattr(d, name), lo, MAX_BYTES, "one PiB")
    end = None if outcome.wall_s is None else outcome.wall_s + SAMPLE_SLACK_S
    for t, series, b in outcome.samples:
        if t < -SAMPLE_SLACK_S or (end is not None and t > end):
            _fail(where, "a sample's time", t, f"inside the run (0 to its {outcome.wall_s or 0:g} s)")
        bound(f"a {series} sample's bytes", b, 0, total if series == outcome.series else MAX_BYTES)
    if outcome.finished_at is not None and context.created_at is not None \
            and outcome.finished_at < context.created_at - SAMPLE_SLACK_S:
        _fail(where, "outcome.finished_at", outcome.finished_at, "after the run began (run.created_at)")
