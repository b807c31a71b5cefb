"""What a probe measured, as pure data: :class:`ProbeResult`, built from what a run gathered
(:func:`assemble`) or from a killed parent's journal (:func:`recover`). Nothing here starts a process,
so every piece can be built and tested without one. JSON is written and read here
(:meth:`ProbeResult.to_dict`, :meth:`ProbeResult.from_dict`).
"""

from __future__ import annotations

import signal
from collections.abc import Iterable
from dataclasses import dataclass, field, fields

from ..estimator.result import Estimate
from ..workload import NEW_TOKENS, PROBE_STAGES, parse_device
from .readings import StageReading, comparable
from .sampler import Sample, attribute

STAGE_ORDER = PROBE_STAGES


@dataclass(frozen=True)
class OutOfMemory:
    stage: str | None
    requested_bytes: int | None
    message: str | None


@dataclass(frozen=True)
class Unfinished:
    """The stage a stopped run was in, and the peak sampled there."""

    stage: str | None
    peak_bytes: int | None
    samples: int = 0


@dataclass(frozen=True)
class VisionReading:
    """The vision encoder's stretch of a multimodal prefill (from its first module to the language
    model), as the probe saw it: when (seconds since the child started), the sampled series' highest
    reading inside it (None when no sample fell inside: a short stretch between two samples), and on a
    GPU torch's allocated bytes when it started and the highest since the post-load marker when it ended."""

    t_start: float
    t_end: float
    peak_bytes: int | None
    samples: int
    allocated_start_bytes: int | None = None
    max_allocated_bytes: int | None = None

    @property
    def extra_allocated_bytes(self) -> int | None:
        """What the vision encoder added to torch's allocations above what was live when it started."""
        if self.allocated_start_bytes is None or self.max_allocated_bytes is None:
            return None
        return self.max_allocated_bytes - self.allocated_start_bytes


def vision_reading(ev: dict, samples: list[Sample], series: str | None, start: float,
                   baseline: StageReading | None = None, reserve: int | None = None) -> VisionReading:
    """A :class:`VisionReading` from the child's ``vision`` event and the samples taken during it; the
    resident set (``rss``) above the child's baseline, as every stage of a CPU run is compared."""
    t0, t1 = ev["t_start"] - start, ev["t_end"] - start
    inside = [s.values.get(series) for s in samples if series and t0 <= s.t - start <= t1]
    inside = [v for v in inside if v is not None]
    peak = max(inside) if inside else None
    if peak is not None:  # the readings' one baseline rule, as for every stage
        reading = StageReading("vision", series, peak_bytes=peak)
        peak = comparable({"vision": reading}, series, baseline, reserve)["vision"].peak_bytes
    return VisionReading(round(t0, 6), round(t1, 6), peak, len(inside), ev.get("allocated_start"),
                         ev.get("max_allocated"))


@dataclass
class ProbeResult:
    status: str  # ok | oom | error | crashed | interrupted
    device: str  # where the model runs (a placement's main device)
    model: str
    quant: str
    quant_implementation: str
    dtype: str
    ctx: int
    batch: int
    attn: str
    series: str | None  # the sampled series the stages are read from: rss, gpu0, ...
    stages: dict[str, StageReading]
    last_stage: str | None
    oom: OutOfMemory | None
    error: str | None
    sample_count: int
    samples: list[dict]  # {"t": seconds since the child started, SERIES: bytes or None, ...}
    interval_ms: float
    sampler_overhead: float | None  # CPU time of the sampler thread / its wall time
    wall_s: float
    command: str
    estimate: Estimate | None = None
    notes: list[str] = field(default_factory=list)
    exit_code: int | None = None
    unfinished: Unfinished | None = None
    new_tokens: int = NEW_TOKENS  # generated after a prompt of ctx - new_tokens
    kv_dtype: str = "auto"
    cache: str = "dynamic"
    # placement (--max-memory / --device-map): per device {stage: reading}, GPUs from NVML, "cpu" from the
    # child's resident set above its baseline; and the plan it loaded (a Placement)
    devices: dict[str, dict[str, StageReading]] | None = None
    placement: object | None = None
    # images in every prompt (docs/vision.md): how many, their size (width, height; None: the processor's
    # default), the tokens they added to each prompt, and the vision encoder's stretch of the prefill
    images: int = 0
    image_size: tuple[int, int] | None = None
    image_tokens: int = 0
    vision: VisionReading | None = None
    # the driver's reserve of each sampled GPU series ({"gpu0": bytes}), read when the probe started (NVML v2,
    # else the table): NVML v1 used counts it, the stages do not; a series not in it is compared as read
    driver_reserve: dict[str, int] | None = None

    @property
    def placed(self) -> bool:
        return self.devices is not None

    # ------------------------------------------------------------------ readings
    def readings(self) -> dict[str, StageReading]:
        """Each stage reached, as read, in stage order."""
        return dict(self.stages)

    def unfinished_reading(self) -> StageReading | None:
        """The stage a stopped run was in, with the peak sampled there (``used_bytes`` None), as read."""
        u = self.unfinished
        if not u or not u.stage:
            return None
        return StageReading(u.stage, self.series, None, u.peak_bytes)

    def measured(self) -> dict[str, StageReading]:
        """Each stage as compared with an estimate: on the CPU (``rss``) minus the child's baseline,
        on a GPU as read (:func:`vramcal.probes.readings.comparable` states the rule)."""
        return comparable(self.readings(), self.series, reserve=self.reserve_of(self.series))

    def reserve_of(self, series: str | None) -> int | None:
        """The driver's reserve taken off ``series``' readings: None for the CPU, for torch's mem_get_info
        (CUDA's total already leaves it out) and where the probe could not tell it."""
        return None if series is None or series == "rss" else (self.driver_reserve or {}).get(series)

    def measured_devices(self) -> dict[str, dict[str, StageReading]] | None:
        """A split run's stages per device as compared with its estimate: each GPU less its driver's
        reserve where known (the readings' rule), the CPU's already above the child's baseline."""
        if self.devices is None:
            return None
        return {dev: st if dev == "cpu" else comparable(st, device_series(dev),
                                                        reserve=self.reserve_of(device_series(dev)))
                for dev, st in self.devices.items()}

    def measured_unfinished(self) -> StageReading | None:
        """:meth:`unfinished_reading` by the same rule as :meth:`measured`."""
        u = self.unfinished_reading()
        if u is None:
            return None
        return comparable({u.stage: u}, self.series, baseline=self.stages.get("baseline"),
                          reserve=self.reserve_of(self.series))[u.stage]

    # ------------------------------------------------------------------ JSON, the one place
    def to_dict(self, samples: bool = True) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["stages"] = {k: r.to_dict() for k, r in self.stages.items()}
        d["oom"] = None if self.oom is None else vars(self.oom).copy()
        d["unfinished"] = None if self.unfinished is None else vars(self.unfinished).copy()
        d["estimate"] = None if self.estimate is None else self.estimate.to_dict()
        d["placement"] = None if self.placement is None else self.placement.to_dict()
        d["devices"] = None if self.devices is None else {
            dev: {k: r.to_dict() for k, r in st.items()} for dev, st in self.devices.items()}
        d["samples"] = list(self.samples) if samples else []
        d["image_size"] = None if self.image_size is None else list(self.image_size)
        d["vision"] = None if self.vision is None else {**vars(self.vision),
                                                        "extra_allocated_bytes": self.vision.extra_allocated_bytes}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ProbeResult:
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        series = kw.get("series")
        kw["stages"] = {k: StageReading.from_stage(k, series, v) for k, v in (d.get("stages") or {}).items()}
        kw["oom"] = OutOfMemory(**d["oom"]) if d.get("oom") else None
        kw["unfinished"] = Unfinished(**d["unfinished"]) if d.get("unfinished") else None
        kw["estimate"] = Estimate.from_dict(d["estimate"]) if d.get("estimate") else None
        if d.get("placement"):
            from ..estimator.placement import Placement

            kw["placement"] = Placement.from_dict(d["placement"])
        if d.get("devices") is not None:
            kw["devices"] = {dev: {k: StageReading.from_stage(k, device_series(dev), v) for k, v in st.items()}
                             for dev, st in d["devices"].items()}
        kw.setdefault("samples", [])
        if kw.get("image_size") is not None:
            kw["image_size"] = tuple(kw["image_size"])
        if kw.get("vision") is not None:
            kw["vision"] = VisionReading(**{f.name: kw["vision"][f.name] for f in fields(VisionReading)
                                            if f.name in kw["vision"]})
        return cls(**kw)


def device_series(device: str) -> str:
    """The sampled series of a device of a placed run: ``gpuN`` for ``cuda:N``, ``rss`` for the CPU."""
    dev = parse_device(device, placement=True)
    return "rss" if dev.kind == "cpu" else f"gpu{dev.index}"


def sample_dict(s: Sample, start: float) -> dict:
    return {"t": round(s.t - start, 6), **s.values, **({"missing": s.missing} if s.missing else {})}


def device_readings(samples: list[Sample], markers, reported: dict, gpus: list[int]) -> dict[str, dict[str, StageReading]]:
    """Stages per device of a placed run: each GPU's NVML series as read, and for ``cpu`` the child's
    resident set by the readings' rule (minus its baseline: what loading put in RAM, the offloaded
    weights), with the child's own reading at each marker."""
    out: dict[str, dict[str, StageReading]] = {}
    for i in gpus:
        st = attribute(samples, markers, f"gpu{i}")
        out[f"cuda:{i}"] = {k: StageReading.from_stage(k, f"gpu{i}", st[k]) for k in STAGE_ORDER if k in st}
    st = attribute(samples, markers, "rss")
    for name, info in reported.items():  # the child's own reading at the marker is exact
        if name in st and info.get("rss") is not None:
            st[name]["used_bytes"] = info["rss"]
            st[name]["peak_bytes"] = max(v for v in (st[name].get("peak_bytes"), info["rss"]) if v is not None)
    readings = {k: StageReading.from_stage(k, "rss", st[k]) for k in STAGE_ORDER if k in st}
    out["cpu"] = comparable(readings, "rss")
    return out


def assemble(series: str | None, markers: list[tuple[str, float]], reported: dict[str, dict], final: dict | None,
             samples: list[Sample], start: float, end_t: float, rc: int | None, log_tail: str,
             interrupted: str | None) -> dict:
    """The measured fields of a ProbeResult from what a run gathered; all times on one clock, ``start``
    its zero. ``interrupted``: the signal (or reason) that stopped the parent, if one did."""
    if final is not None:
        status = {"done": "ok", "oom": "oom", "error": "error"}[final["event"]]
    else:
        status = "interrupted" if interrupted else "crashed"
    # a run that stopped: attribute what was sampled after the last marker to the stage it was in
    markers_for_attr = markers + [("_unfinished", end_t)] if status != "ok" and samples else markers
    stages = attribute(samples, markers_for_attr, series) if series else {n: {} for n, _ in markers}
    for name, info in reported.items():
        st = stages.setdefault(name, {})
        st.update({k: v for k, v in info.items() if k != "t"})
        st["t"] = round(info["t"] - start, 6)
        if series == "rss" and info.get("rss") is not None:
            st["used_bytes"] = info["rss"]  # the child's own reading at the marker is exact
            st["peak_bytes"] = max(v for v in (st.get("peak_bytes"), info["rss"]) if v is not None)
        if series and series != "rss":
            st["process_used_bytes"] = _proc_at(samples, info["t"], series + "_proc")
        if series is None and info.get("mem_get_info_used") is not None:
            # no NVML: the child's torch.cuda.mem_get_info at the marker; no peak between markers
            st["used_bytes"] = info["mem_get_info_used"]
            st["peak_bytes"] = None
    unfinished = stages.pop("_unfinished", None)
    last = markers[-1][0] if markers else None
    oom = None
    error = None
    if status == "oom":
        oom = OutOfMemory(final.get("stage"), final.get("requested_bytes"), final.get("message"))
    elif status == "error":
        error = final.get("message")
    elif status == "crashed":
        error = f"child exited with {describe_rc(rc)} after stage {last or 'none'}" + (
            f" ({log_tail})" if log_tail else "")
    elif status == "interrupted":
        where = f"after stage {last}" if last else ("before the first stage" if samples or reported else
                                                    "before the child started")
        error = f"interrupted by {interrupted} {where}"
    in_flight = None
    if status != "ok" and (unfinished is not None or status == "interrupted"):
        in_flight = Unfinished((final or {}).get("stage") or next_stage(markers, gpu=series != "rss"),
                               (unfinished or {}).get("peak_bytes"), (unfinished or {}).get("samples", 0))
    return {
        "status": status, "series": series,
        "stages": {k: StageReading.from_stage(k, series, stages[k]) for k in STAGE_ORDER if k in stages},
        "last_stage": last, "oom": oom, "error": error,
        "sample_count": len(samples),
        "samples": [sample_dict(s, start) for s in samples],
        "sampler_overhead": None, "wall_s": round(end_t - start, 3), "notes": [], "exit_code": rc,
        "unfinished": in_flight,
    }


IDENTITY = ("device", "model", "quant", "quant_implementation", "dtype", "ctx", "batch", "attn", "new_tokens",
            "series", "interval_ms", "command", "kv_dtype", "cache", "images", "image_size", "driver_reserve")


def identity_from(ev: dict) -> dict:
    """A result's identity from a journal's ``start`` event: plain fields, the estimate and the plan."""
    out = {k: ev.get(k) for k in IDENTITY if k in ev}
    if out.get("image_size") is not None:
        out["image_size"] = tuple(out["image_size"])
    out["estimate"] = Estimate.from_dict(ev["estimate"]) if ev.get("estimate") else None
    if ev.get("placement"):
        from ..estimator.placement import Placement

        out["placement"] = Placement.from_dict(ev["placement"])
    return out


def recover(events: Iterable[dict]) -> ProbeResult | None:
    """A result rebuilt from a probe's ``journal`` events (see :func:`vramcal.probes.probe.run_probe`),
    for a parent that was killed before its result was recorded: status ``interrupted`` (or the child's
    own, if it said how it ended), the last stage, the stages and samples so far. None when the journal
    has no ``start`` event (the child never started: nothing was measured)."""
    identity = None
    markers: list[tuple[str, float]] = []
    reported: dict[str, dict] = {}
    final = None
    samples: list[Sample] = []
    last_t = 0.0
    gpus = None
    for ev in events:
        kind = ev.get("event")
        if kind == "start":
            identity = identity_from(ev)
            gpus = ev.get("gpus")
        elif kind == "samples":
            for s in ev["samples"]:
                values = {k: v for k, v in s.items() if k not in ("t", "missing")}
                samples.append(Sample(s["t"], values, s.get("missing") or {}))
                last_t = max(last_t, s["t"])
        elif kind == "stage":
            markers.append((ev["name"], ev["t"]))
            reported[ev["name"]] = {k: v for k, v in ev.items() if k not in ("event", "name")}
            last_t = max(last_t, ev["t"])
        elif kind in ("oom", "error", "done"):
            final = ev
            last_t = max(last_t, ev.get("t", last_t))
    if identity is None:
        return None
    d = assemble(identity["series"], markers, reported, final, samples, 0.0, last_t, None, "",
                 "the end of the parent process")
    if d["status"] == "interrupted":
        d["error"] = (f"the probe's parent ended after stage {d['last_stage'] or 'none'}: "
                      "rebuilt from its journal")
    d["notes"].append("rebuilt from the journal of a parent that ended before finishing its record")
    if gpus and identity["series"]:
        d["devices"] = device_readings(samples, markers, reported, gpus)
    return ProbeResult(**{**identity, **d})


def next_stage(markers, gpu: bool) -> str | None:
    done = {m for m, _ in markers}
    for name in STAGE_ORDER:
        if name not in done and (gpu or name != "context"):
            return name
    return None


def _proc_at(samples, t: float, key: str) -> int | None:
    best = None
    for s in samples:
        if s.t <= t and s.values.get(key) is not None:
            best = s.values[key]
    return best


def describe_rc(rc: int | None) -> str:
    if rc is None:
        return "no exit code"
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"exit code {rc}"
