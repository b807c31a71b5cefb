"""What an estimate says, as types: :class:`Estimate`, one :class:`DeviceEstimate` per device of a
placement, and the :class:`AppliedCorrection` a machine's runs added. Pure data; JSON is written and
read here and nowhere else (:meth:`Estimate.to_dict`, :meth:`Estimate.from_dict`).

Stages are what a probe on the device will see (docs/accounting.md): ``load_peak`` (highest memory
while ``from_pretrained`` runs), ``post_load``, ``first_token`` (the prefill of the prompt), ``end``
(the last of ``new_tokens`` generated tokens). The rules that compute them are in
:mod:`vramcal.estimator.stages`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

from ..workload import NEW_TOKENS, STAGES, Workload
from .correction import CorrectionSet, apply
from .quick import QuickEstimate
from .vllm.result import VllmEstimate


@dataclass
class DeviceEstimate:
    """One device's figures: memory in use per stage, live tensor bytes at the same moments, the sizes
    of what takes memory (``components``: weights, kv_cache, activations, offload_transient, runtime;
    each >= 0) and what the peak is made of (``breakdown``, which adds up to the peak)."""

    device: str
    stages: dict[str, int]
    allocated: dict[str, int]
    components: dict[str, int]
    breakdown: dict[str, int] = field(default_factory=dict)
    reserved: dict[str, int] = field(default_factory=dict)  # what the caching allocator holds (no context)

    @property
    def peak(self) -> int:
        return max(self.stages.values())

    @property
    def peak_stage(self) -> str:
        return max(STAGES, key=lambda k: self.stages[k])

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> DeviceEstimate:
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


@dataclass
class AppliedCorrection:
    """A correction as applied to an estimate: the raw and corrected stages, where it came from, and,
    for a placement, each device's own."""

    raw: dict[str, int]
    corrected: dict[str, int]
    source_runs: list[int]
    scope: str
    p95_residual: dict[str, int] = field(default_factory=dict)
    hosts: list[str] = field(default_factory=list)
    devices: dict[str, AppliedCorrection] = field(default_factory=dict)

    @property
    def delta(self) -> dict[str, int]:
        return {k: self.corrected[k] - self.raw[k] for k in self.raw}

    def to_dict(self) -> dict:
        d = asdict(self)
        d["delta"] = self.delta
        d["devices"] = {k: v.to_dict() for k, v in self.devices.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> AppliedCorrection:
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        kw["devices"] = {k: cls.from_dict(v) for k, v in (d.get("devices") or {}).items()}
        return cls(**kw)


@dataclass
class Estimate:
    model: str
    architecture: str
    quant: str
    quant_implementation: str
    dtype: str
    ctx: int  # prompt + new tokens
    batch: int
    kv_dtype: str
    attn: str
    cache: str
    device: str
    components: dict[str, int]  # weights, kv_cache, activations, runtime: sizes, each >= 0
    stages: dict[str, int]  # device memory in use (NVML view); corrected when ``correction`` is set
    allocated: dict[str, int]  # torch memory_allocated view of the same moments
    peak: int
    approximate: bool
    methods: dict[str, str]  # how each component was obtained
    weights_breakdown: dict[str, int]
    kv_breakdown: dict[str, int]
    formula: QuickEstimate | None  # the source documents' formula on the same model
    differences: list[str] = field(default_factory=list)  # why the detailed figure differs from the formula
    notes: list[str] = field(default_factory=list)
    runtime_source: str = ""
    config_hash: str = ""
    prompt: int = 0
    new_tokens: int = NEW_TOKENS
    peak_stage: str = ""
    peak_breakdown: dict[str, int] = field(default_factory=dict)  # what the raw peak is made of; sums to it
    warnings: list[str] = field(default_factory=list)  # inputs beyond the model's or the device's limits
    correction: AppliedCorrection | None = None  # raw stages, the correction, its source (when one was applied)
    mode: str = "full"
    # Placement (``--max-memory`` / ``--device-map``; docs/placement.md): the plan as asked, and each
    # device's figures for the plan that loads (the alternative when transformers refuses the asked one).
    # With a placement ``stages``, ``allocated`` and ``peak`` are summed over the GPUs; ``peak_device`` is
    # the GPU with the highest peak.
    placement: object | None = None  # vramcal.estimator.placement.Placement
    devices: dict[str, DeviceEstimate] | None = None
    peak_device: str | None = None
    # --device cpu after an on-the-fly bitsandbytes load: {stage: (lower, upper)}, the resident set with
    # none and with all of the freed heap glibc may keep (run to run; docs/cpu-memory.md). Raw figures.
    ranges: dict[str, tuple[int, int]] | None = None
    estimator_model: str = ""  # the stage arithmetic that made it (vramcal.estimator.stages.MODEL_IDS)
    vramcal_version: str = ""
    # --engine vllm: what `vllm serve` logs at startup, per rank (vramcal.estimator.vllm; docs/vllm.md)
    vllm: VllmEstimate | None = None
    # from_pretrained's keyword arguments for this load, as plain data (vramcal.estimator.loading), and
    # the auto class it is called on
    from_pretrained: dict | None = None
    auto_class: str = "AutoModelForCausalLM"
    # A vision-language model (docs/vision.md): the weights by part (model.vision_tower,
    # model.multi_modal_projector, model.language_model, lm_head); and with images, how many each prompt
    # holds and their size (width, height), the tokens they add to each prompt (over all its images: the
    # language model runs prompt + image_tokens), and the vision encoder's own activation peak (what it
    # adds above what was live when it started; part of first_token), None when not traced.
    weights_parts: dict[str, int] = field(default_factory=dict)
    images: int = 0
    image_size: tuple[int, int] | None = None
    image_tokens: int = 0
    vision_peak: int | None = None
    # the Hub commit whose config and weight headers were priced (a Hub id: from the local HF cache or
    # fetched, docs/hub.md); None for a folder, a config.json or a catalog name
    revision: str | None = None
    # what the caching allocator holds at each stage (stages = this + what is not torch's; placed: GPU
    # sums), and the allocator settings it was replayed with (PYTORCH_ALLOC_CONF text; "" the defaults)
    reserved: dict[str, int] = field(default_factory=dict)
    alloc_conf: str = ""
    # what is not torch's, each term by what it is: {term: {"bytes": int | None, "source": ...}} (the CUDA
    # context, kernels the first forward loads, the cuBLAS workspace, the driver's reserve; runtime.cuda_terms)
    runtime_terms: dict = field(default_factory=dict)

    # ------------------------------------------------------------------ views
    @property
    def workload(self) -> Workload:
        return Workload(self.prompt, self.new_tokens, self.batch, self.images,
                        tuple(self.image_size) if self.image_size else None)

    @property
    def context(self) -> int:
        """The whole context the language model holds: ctx (text prompt + new tokens) + image tokens."""
        return self.ctx + self.image_tokens

    @property
    def placed(self) -> bool:
        return self.devices is not None

    @property
    def main_device(self) -> str:
        """The device a single-device run uses, or the placement's main device (where offloaded modules
        run and where the probe's main series is read)."""
        if self.placement is None:
            return self.device
        return self.placement.loads.main_device

    def device_peaks(self) -> dict[str, int]:
        """Each GPU's highest stage (placement), or {device: peak} for one device."""
        if not self.devices:
            return {self.device: self.peak}
        return {d: v.peak for d, v in self.devices.items() if d.startswith("cuda")}

    def main_stages(self) -> dict[str, int]:
        """The stages the probe's main series is compared with: the main device's for a placement (not
        the sum over GPUs), else the stages."""
        if self.devices and self.main_device in self.devices:
            return self.devices[self.main_device].stages
        return self.stages

    # ------------------------------------------------------------------ corrections
    def corrected(self, corrections: CorrectionSet) -> Estimate:
        """This estimate with a machine's corrections applied: ``stages`` and ``peak`` corrected, the raw
        figures and the correction's source kept in ``correction``."""
        if not corrections:
            notes = self.notes + [corrections.note] if corrections.note else self.notes
            return replace(self, correction=None, notes=list(notes))
        raw = dict(self.stages)
        fixed = apply(raw, self.ctx * self.batch, corrections.stages)
        info = AppliedCorrection(raw, fixed, corrections.source_runs, corrections.scope,
                                 {k: c.residual_p95_bytes for k, c in corrections.stages.items()},
                                 list(corrections.hosts))
        peak_stage = max(fixed, key=fixed.get)
        return replace(self, stages=fixed, peak=fixed[peak_stage], peak_stage=peak_stage, correction=info)

    def corrected_devices(self, by_device: dict[str, CorrectionSet]) -> Estimate:
        """A placed estimate with each device's own correction (a correction belongs to a machine, a
        stack and a device position: ``cuda:1`` of a split is not ``cuda:0`` of it). The GPU sums are
        recomputed; ``correction`` keeps the raw sums and, under ``devices``, each device's source."""
        if not self.devices or not any(by_device.values()):
            return replace(self, correction=None)
        tokens = self.ctx * self.batch
        devices = dict(self.devices)
        per: dict[str, AppliedCorrection] = {}
        for d, c in by_device.items():
            if c and d in devices:
                fixed = apply(devices[d].stages, tokens, c.stages)
                per[d] = AppliedCorrection(devices[d].stages, fixed, c.source_runs, c.scope)
                devices[d] = replace(devices[d], stages=fixed)
        gpus = [d for d in devices if d.startswith("cuda")]
        raw = dict(self.stages)
        fixed = {k: sum(devices[d].stages[k] for d in gpus) for k in raw}
        peak_stage = max(fixed, key=fixed.get)
        info = AppliedCorrection(raw, fixed, sorted({r for v in per.values() for r in v.source_runs}),
                                 "per device position: " + ", ".join(f"{d} ({v.scope})" for d, v in per.items()),
                                 devices=per)
        peak_device = max(gpus, key=lambda d: devices[d].peak) if gpus else None
        return replace(self, devices=devices, stages=fixed, peak=fixed[peak_stage], peak_stage=peak_stage,
                       peak_device=peak_device, correction=info)

    # ------------------------------------------------------------------ JSON, the one place
    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["formula"] = None if self.formula is None else self.formula.to_dict()
        d["correction"] = None if self.correction is None else self.correction.to_dict()
        d["placement"] = None if self.placement is None else self.placement.to_dict()
        d["devices"] = None if self.devices is None else {k: v.to_dict() for k, v in self.devices.items()}
        d["ranges"] = None if self.ranges is None else {k: list(v) for k, v in self.ranges.items()}
        d["vllm"] = None if self.vllm is None else self.vllm.to_dict()
        if self.placement is not None:
            d["device_map"] = dict(self.placement.device_map)
        d["image_size"] = None if self.image_size is None else list(self.image_size)
        d["context"] = self.context
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Estimate:
        """The inverse of :meth:`to_dict` (a recorded or journalled estimate); unknown keys are ignored,
        missing optional ones take their defaults."""
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        if kw.get("formula") is not None:
            kw["formula"] = QuickEstimate(**kw["formula"])
        if kw.get("correction") is not None:
            kw["correction"] = AppliedCorrection.from_dict(kw["correction"])
        if kw.get("placement") is not None:
            from .placement import Placement

            kw["placement"] = Placement.from_dict(kw["placement"])
        if kw.get("devices") is not None:
            kw["devices"] = {k: DeviceEstimate.from_dict(v) for k, v in kw["devices"].items()}
        if kw.get("ranges") is not None:
            kw["ranges"] = {k: tuple(v) for k, v in kw["ranges"].items()}
        if kw.get("vllm") is not None:
            kw["vllm"] = VllmEstimate.from_dict(kw["vllm"])
        if kw.get("image_size") is not None:
            kw["image_size"] = tuple(kw["image_size"])
        return cls(**kw)
