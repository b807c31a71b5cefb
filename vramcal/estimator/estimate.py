"""Put the parts together: weights (inventory) + KV cache + activations (dry run) + runtime -> stages.

Stages are what a probe on the device will see (docs/accounting.md):

- ``load_peak``   highest memory while ``from_pretrained`` runs;
- ``post_load``   once loading is done;
- ``first_token`` highest memory up to the first new token (the prefill of the prompt);
- ``end``         highest memory up to the last new token (``new_tokens``, 16 by default).

On CUDA each is ``context + reserved``, and reserved is a running peak (the caching allocator keeps
freed blocks), so the stages never decrease; ``allocated`` gives the ``memory_allocated`` view of the
same moments. ``peak`` is the largest stage, and ``peak_breakdown`` says what the peak is made of.

``components`` are the sizes of the things that take memory: the weights, the KV cache at the end,
the largest transient (activations) and the runtime (CUDA context, cuBLAS workspace, allocator
rounding). They never go below zero, and they need not add up to the peak: the prefill's transient
and the end's full cache do not exist at the same moment. ``peak_breakdown`` adds up exactly.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace

from ..errors import UserError
from ..units import GB, fmt_gib_gb
from ..workload import ATTNS, CACHES, KV_DTYPES, NEW_TOKENS, STAGES, Workload, choice, parse_device, workload
from .correction import CorrectionSet, apply
from .cpu import CpuStages, cpu_inputs, cpu_resident_stages, out_features
from .dryrun import ActivationModel, KVLayer, Trace, fit_activations, round_alloc
from .inventory import CACHE_PROBLEMS, Inventory, inventory, load_cached, store_cached
from .quant import DTYPE_BYTES, QuantSpec, resolve_quant
from .quick import QuickEstimate, quick_estimate
from .resolve import ModelSource, resolve_model, size_field, text_config
from .runtime import RuntimeProfile, default_profile

FIT_TOKENS = (512, 2048, 8192)
LARGEST_GPU_BYTES = 288 * GB  # the largest memory on one GPU sold today (B300); beyond it, split the model

__all__ = ["Estimate", "Estimator", "estimate", "STAGES", "NEW_TOKENS"]


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
    formula: dict | None  # the source documents' formula on the same model
    differences: list[str] = field(default_factory=list)  # why the detailed figure differs from the formula
    notes: list[str] = field(default_factory=list)
    runtime_source: str = ""
    config_hash: str = ""
    prompt: int = 0
    new_tokens: int = NEW_TOKENS
    peak_stage: str = ""
    peak_breakdown: dict[str, int] = field(default_factory=dict)  # what the raw peak is made of; sums to it
    warnings: list[str] = field(default_factory=list)  # inputs beyond the model's or the device's limits
    correction: dict | None = None  # raw stages, the correction, its source (when one was applied)
    mode: str = "full"
    # Placement (``--max-memory`` / ``--device-map``; docs/placement.md). ``placement`` is the plan's dict
    # (``device_map`` {module: "cuda:0" | "cpu" | "disk"}, ``refused``, ``alternative`` ...); ``devices``
    # {device: {"stages", "allocated", "components"}} are the figures of the plan that loads (the
    # alternative when transformers refuses the asked one). With a placement, ``stages``, ``allocated``
    # and ``peak`` are summed over the GPUs; ``peak_device`` is the GPU with the highest peak.
    placement: dict | None = None
    devices: dict[str, dict] | None = None
    peak_device: str | None = None
    # --device cpu after an on-the-fly bitsandbytes load: {stage: [lower, upper]}, the resident set with
    # none and with all of the freed heap glibc may keep (run to run; docs/cpu-memory.md). Raw figures.
    ranges: dict[str, list[int]] | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.placement is not None:
            d["device_map"] = self.placement["device_map"]
        return d

    def device_peaks(self) -> dict[str, int]:
        """Each GPU's highest stage (placement), or {device: peak} for one device."""
        if not self.devices:
            return {self.device: self.peak}
        return {d: max(v["stages"].values()) for d, v in self.devices.items() if d.startswith("cuda")}

    @property
    def workload(self) -> Workload:
        return Workload(self.prompt, self.new_tokens, self.batch)

    def corrected(self, corrections: CorrectionSet) -> Estimate:
        """This estimate with a machine's corrections applied: ``stages`` and ``peak`` corrected, the raw
        figures and the correction's source kept in ``correction``."""
        if not corrections:
            return replace(self, correction=None)
        raw = dict(self.stages)
        fixed = apply(raw, self.ctx * self.batch, corrections.stages)
        info = {"raw": raw, "corrected": fixed, "delta": {k: fixed[k] - raw[k] for k in raw},
                "p95_residual": {k: c.residual_p95_bytes for k, c in corrections.stages.items()},
                "source_runs": corrections.source_runs, "scope": corrections.scope, "hosts": corrections.hosts}
        peak_stage = max(fixed, key=fixed.get)
        return replace(self, stages=fixed, peak=fixed[peak_stage], peak_stage=peak_stage, correction=info)

    def corrected_devices(self, by_device: dict[str, CorrectionSet]) -> Estimate:
        """A placed estimate with each device's own correction (a correction belongs to a machine, a
        stack and a device position: ``cuda:1`` of a split is not ``cuda:0`` of it). The GPU sums are
        recomputed; ``correction`` keeps the raw sums and, under ``devices``, each device's source."""
        if not self.devices or not any(by_device.values()):
            return replace(self, correction=None)
        tokens = self.ctx * self.batch
        devices = {d: dict(v) for d, v in self.devices.items()}
        per: dict[str, dict] = {}
        for d, c in by_device.items():
            if c and d in devices:
                fixed = apply(devices[d]["stages"], tokens, c.stages)
                per[d] = {"raw": devices[d]["stages"], "corrected": fixed, "source_runs": c.source_runs,
                          "scope": c.scope}
                devices[d]["stages"] = fixed
        gpus = [d for d in devices if d.startswith("cuda")]
        raw = dict(self.stages)
        fixed = {k: sum(devices[d]["stages"][k] for d in gpus) for k in raw}
        peak_stage = max(fixed, key=fixed.get)
        info = {"raw": raw, "corrected": fixed, "delta": {k: fixed[k] - raw[k] for k in raw},
                "p95_residual": {}, "source_runs": sorted({r for v in per.values() for r in v["source_runs"]}),
                "scope": "per device position: " + ", ".join(f"{d} ({v['scope']})" for d, v in per.items()),
                "hosts": [], "devices": per}
        peak_device = max(gpus, key=lambda d: max(devices[d]["stages"].values())) if gpus else None
        return replace(self, devices=devices, stages=fixed, peak=fixed[peak_stage], peak_stage=peak_stage,
                       peak_device=peak_device, correction=info)


def _act_cache_key(quant: QuantSpec, attn: str, cache: str, kv_dtype: str, target: str) -> QuantSpec:
    return replace(quant, name=f"{quant.name}|{attn}|{cache}|{kv_dtype}|{target}")


def device_kind(device: str) -> str:
    return "cpu" if str(device).startswith("cpu") else "cuda"


class Estimator:
    """Estimates for one model and quantization; keeps the expensive parts (inventory, KV layout,
    activation traces) and reuses them across contexts and batches."""

    def __init__(self, source: ModelSource, quant: QuantSpec, attn: str = "auto", cache: str = "dynamic",
                 kv_dtype: str = "auto", use_cache: bool = True, device: str = "cuda", progress=None):
        choice(attn, ATTNS, "--attn")
        choice(cache, CACHES, "--cache")
        choice(kv_dtype, KV_DTYPES, "--kv-dtype")
        self.source, self.quant = source, quant
        self.attn, self.cache, self.kv_dtype = attn, cache, kv_dtype
        self.use_cache = use_cache
        self._progress = progress or (lambda step: None)
        self._problems: list[str] = []
        start = len(CACHE_PROBLEMS)
        self.inv: Inventory = inventory(source, quant, use_cache=use_cache, progress=self._progress)
        self._w_alloc = sum(round_alloc(size) * n for size, n in self.inv.alloc_sizes.items())
        self.device = device
        self._act_key = _act_cache_key(quant, attn, cache, kv_dtype, device_kind(device))
        self._runner = None
        self._kv: list[KVLayer] | None = None
        self._act: ActivationModel | None = None
        self._dry_error: str | None = None
        self.attn_used = attn
        if use_cache:
            self._load_act_cache()
        self._problems += CACHE_PROBLEMS[start:]
        del CACHE_PROBLEMS[start:]

    # ---------------------------------------------------------------- cached dry-run results
    def _load_act_cache(self) -> None:
        data = load_cached(self.source, self._act_key, kind="activations")
        if not data:
            return
        try:
            kv = [KVLayer(**d) for d in data["kv"]]
            act = data["act"]
            model = None
            if act is not None:
                model = ActivationModel(prefill=tuple(act["prefill"]) if act["prefill"] else None,
                                        decode=tuple(act["decode"]) if act["decode"] else None,
                                        traces=[Trace(**t) for t in act["traces"]])
            attn_used = str(data["attn_used"])
            sane = all(k.bytes_per_token >= 0 and k.fixed_bytes >= 0 for k in kv) and all(
                t.prefill_peak_bytes >= t.cache_bytes >= 0 and t.decode_peak_bytes >= 0
                for t in (model.traces if model else []))
        except (KeyError, TypeError, ValueError):
            CACHE_PROBLEMS.append("a cached dry run did not have the expected fields; recomputed")
            return
        if not sane:
            CACHE_PROBLEMS.append("a cached dry run held impossible figures (negative bytes); recomputed")
            return
        self._kv, self._act, self.attn_used = kv, model, attn_used

    def _store_act_cache(self) -> None:
        """Only successful dry runs are cached; a failure is retried by the next estimate."""
        if not self.use_cache or self._kv is None or self._act is None:
            return
        act = {"prefill": list(self._act.prefill) if self._act.prefill else None,
               "decode": list(self._act.decode) if self._act.decode else None,
               "traces": [asdict(t) for t in self._act.traces]}
        store_cached(self.source, self._act_key, {"kv": [asdict(k) for k in self._kv], "act": act,
                                                   "attn_used": self.attn_used}, kind="activations")

    def _dry_runner(self):
        if self._runner is None:
            from .dryrun import DryRunner

            self._runner = DryRunner(self.source, self.quant, attn=None if self.attn == "auto" else self.attn,
                                     cache=self.cache, kv_dtype=self.kv_dtype, target=device_kind(self.device))
            self.attn_used = self._runner.attn_used
        return self._runner

    def _traced(self, batch: int, prompt: int) -> bool:
        return bool(self._act and any(t.batch == batch and t.tokens == prompt for t in self._act.traces))

    def _ensure_dry_run(self, batch: int, prompt: int, exact: bool) -> None:
        """Make sure the KV layout exists and the activations at (batch, prompt) are known: traced
        there if ``exact``, else from a fit over a few traced points (traced once, then cached)."""
        if self._dry_error is not None or self.inv.method in ("checkpoint", "formula"):
            return  # formula: transformers cannot build this model here, so it cannot run it either
        need_kv = self._kv is None
        need_point = exact and not self._traced(batch, prompt)
        need_fit = not exact and (self._act is None or self._act.prefill is None)
        if not (need_kv or need_point or need_fit):
            return
        try:
            runner = self._dry_runner()
            if need_kv:
                self._progress("measuring the KV cache layout (two tiny prefills on meta tensors)")
                self._kv = runner.kv_layers()
            traces = list(self._act.traces) if self._act else []
            if need_point:
                self._progress(f"tracing the prefill of {prompt:,} tokens x {batch} and a decode step")
                traces.append(runner.trace(batch, prompt))
            if need_fit:
                for n in FIT_TOKENS:
                    if not any(t.batch == 1 and t.tokens == n for t in traces):
                        self._progress(f"tracing {n:,} tokens for the activation fit")
                        traces.append(runner.trace(1, n))
            self._act = fit_activations(traces) if need_fit or (self._act and self._act.prefill) else \
                ActivationModel(prefill=None, decode=None, traces=traces)
        except UserError:
            raise
        except (RuntimeError, ValueError, TypeError, NotImplementedError, IndexError, KeyError,
                AttributeError, AssertionError, ImportError) as exc:  # an op the meta device cannot run: formulas, said so
            self._dry_error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            return
        self._store_act_cache()

    # ---------------------------------------------------------------- the estimate
    def estimate(self, ctx: int | None = None, batch: int = 1, device: str | None = None,
                 runtime: RuntimeProfile | None = None, exact: bool = True, new_tokens: int = NEW_TOKENS,
                 prompt: int | None = None, placement=None) -> Estimate:
        """``placement`` (a :class:`~vramcal.estimator.placement.Placement` of this model and quant) adds
        per-device figures: see :meth:`_place`."""
        work = workload(ctx, batch, new_tokens, prompt)
        device = self._same_kind(device)
        self._ensure_dry_run(work.batch, work.prompt, exact)
        rt = runtime or default_profile(device)
        inv = self.inv
        notes = list(inv.notes) + self._problems
        methods = {"weights": {"meta": "meta-device model + quantizer (exact)",
                               "checkpoint": "checkpoint safetensors headers",
                               "formula": "formula from config fields"}[inv.method]}
        approximate = inv.approximate
        tc = text_config(self.source.config)
        batch, ctx = work.batch, work.ctx

        if self._kv is not None:
            kv_end = self._kv_end(work)
            kv_by_kind: dict[str, int] = {}
            for layer, b in zip(self._kv, self._kv_end_layers(work)):
                kv_by_kind[layer.kind] = kv_by_kind.get(layer.kind, 0) + b
            methods["kv_cache"] = "cache layers of the installed transformers, measured on meta tensors"
            kv_prompt = self._kv_prompt(work)
        else:
            kv_end = _formula_kv(tc, self._end_tokens(work), batch, inv.dtype)
            kv_by_kind = {"formula": kv_end}
            methods["kv_cache"] = "formula (2 x layers x kv_heads x head_dim x tokens x bytes)"
            kv_prompt = _formula_kv(tc, work.prompt, batch, inv.dtype)
            approximate = True

        if self._act is not None and (self._traced(batch, work.prompt) or self._act.prefill is not None):
            prefill_extra = self._act.prefill_extra(batch, work.prompt)
            decode_extra = self._act.decode_extra(batch, work.prompt, work.new_tokens, self._cat_growth())
            methods["activations"] = ("dry run of the real forward on meta tensors" if self._traced(batch, work.prompt)
                                      else f"fit over {len(self._act.traces)} dry-run traces")
        else:
            prefill_extra, decode_extra = _formula_activations(tc, inv, batch, work.prompt)
            methods["activations"] = "formula (dry run unavailable)"
            approximate = True
            if self._dry_error:
                notes.append(f"dry run failed ({self._dry_error}); activations from a formula")

        stages, allocated, moments, cpu = self._stages(rt, kv_prompt, kv_end, prefill_extra, decode_extra, work)
        peak_stage = max(STAGES, key=lambda k: stages[k])
        peak = stages[peak_stage]
        act = max(prefill_extra, decode_extra, 0)
        held = moments[peak_stage]
        runtime_bytes = rt.context_bytes + rt.workspace_bytes + (self._w_alloc - inv.tensor_bytes)
        components = {"weights": inv.tensor_bytes, "kv_cache": kv_end, "activations": act, "runtime": runtime_bytes}
        breakdown = {"weights": inv.tensor_bytes, "kv_cache": held["kv"], "activations": held["act"],
                     "runtime": peak - inv.tensor_bytes - held["kv"] - held["act"]}
        ranges = None
        if cpu is not None:  # the resident set: what it is made of is the CPU model's terms
            breakdown = {**({"runtime": rt.context_bytes} if rt.context_bytes else {}), **cpu.terms[peak_stage]}
            methods["resident set"] = ("docs/cpu-memory.md: the checkpoint's mapped pages, tensors the loader "
                                       "allocates, glibc heap kept after quantizing, KV and prefill blocks")
            notes += cpu.notes
            if cpu.lower != cpu.upper:
                ranges = {k: [rt.context_bytes + cpu.lower[k], rt.context_bytes + cpu.upper[k]] for k in STAGES}
        formula, diffs = _compare_formula(tc, inv, self.quant, work, components)
        if self.attn_used == "eager":
            notes.append("eager attention materialises batch x heads x seq x seq scores: the prefill grows with ctx^2")
        warnings = _warnings(tc, work, peak if placement is None else 0, device, self.quant)
        out = Estimate(
            model=self.source.name, architecture=inv.architecture, quant=self.quant.name,
            quant_implementation=self.quant.implementation, dtype=inv.dtype, ctx=ctx, batch=batch,
            kv_dtype=self.kv_dtype, attn=self.attn_used, cache=self.cache, device=device,
            components=components, stages=stages, allocated=allocated, peak=peak, approximate=approximate,
            methods=methods, weights_breakdown={k: v for k, v in inv.groups.items() if v},
            kv_breakdown=kv_by_kind, formula=formula, differences=diffs, notes=notes,
            runtime_source=rt.source, config_hash=self.source.config_hash, prompt=work.prompt,
            new_tokens=work.new_tokens, peak_stage=peak_stage, peak_breakdown=breakdown, warnings=warnings,
            ranges=ranges)
        if placement is not None:
            self._place(out, placement, work, kv_prompt, kv_end, prefill_extra, decode_extra, runtime)
        return out

    def _kv_layers_or_split(self, work: Workload, kv_prompt: int, kv_end: int) -> tuple[list[int], list[int]]:
        """Per decoder layer: the cache after the prefill and at the end. Without the measured layer
        layout (formula path), the totals split evenly over the layers."""
        if self._kv is not None:
            if self.cache == "static":
                prompt = [layer.bytes_at(work.ctx, work.batch) for layer in self._kv]
            else:
                prompt = [work.batch * (layer.fixed_bytes + layer.bytes_per_token * work.prompt) for layer in self._kv]
            return prompt, self._kv_end_layers(work)
        n = max(int(text_config(self.source.config).get("num_hidden_layers") or 1), 1)
        return [kv_prompt // n] * n, [kv_end // n] * n

    def _device_figures(self, loads, work: Workload, kv_prompt: int, kv_end: int, prefill_extra: int,
                        decode_extra: int, runtime: RuntimeProfile | None) -> dict:
        """:func:`~vramcal.estimator.placement.device_stages` of a plan that loads, fed with this
        estimator's per-layer cache and activation extras."""
        from .placement import device_stages

        on_the_fly = self.quant.method in ("bnb4", "bnb8") and not self.quant.pre_quantized
        kvp, kve = self._kv_layers_or_split(work, kv_prompt, kv_end)
        return device_stages(loads, kv_prompt=kvp, kv_end=kve, prefill_extra=max(prefill_extra, 0),
                             decode_extra=max(decode_extra, 0), on_the_fly=on_the_fly,
                             runtime=(lambda d: runtime) if runtime is not None else default_profile)

    def _place(self, out: Estimate, plan, work: Workload, kv_prompt: int, kv_end: int, prefill_extra: int,
               decode_extra: int, runtime: RuntimeProfile | None) -> None:
        """Per-device stages of ``plan`` (docs/placement.md), into ``out``: ``devices``, ``placement``, and
        the GPU sums as ``stages`` / ``allocated`` / ``peak``. A plan the installed transformers refuses is
        figured as its alternative (the custom map + flag that loads), and said so in the warnings."""
        from .placement import OFFLOAD_FLAG, _fmt

        loads = plan.alternative if plan.refused and plan.alternative is not None else plan
        per = self._device_figures(loads, work, kv_prompt, kv_end, prefill_extra, decode_extra, runtime)
        out.devices = {d: {"stages": s.stages, "allocated": s.allocated, "components": s.components}
                       for d, s in per.items()}
        out.placement = plan.to_dict()
        gpus = [d for d in per if d.startswith("cuda")]
        out.stages = {k: sum(per[d].stages[k] for d in gpus) for k in STAGES}
        out.allocated = {k: sum(per[d].allocated[k] for d in gpus) for k in STAGES}
        out.peak_stage = max(STAGES, key=lambda k: out.stages[k])
        out.peak = out.stages[out.peak_stage]
        out.peak_device = max(gpus, key=lambda d: max(per[d].stages.values())) if gpus else None
        out.peak_breakdown = {}
        out.methods["placement"] = (f"transformers' own device map ({plan.strategy}, max_memory as given) on the "
                                    "meta model; per-device stages by docs/placement.md")
        if plan.refused:
            custom = ", ".join(loads.grouped())
            out.warnings.append(f"transformers {plan.software.get('transformers')} refuses to load this with "
                                f"device_map={plan.strategy!r} (\"{plan.refused.split('. ')[0]}…\"). What loads "
                                "instead: the same map as a custom device_map "
                                f"({custom}) with {OFFLOAD_FLAG}=True; the offloaded modules then stay "
                                f"unquantized in {self.inv.dtype}. The per-device figures are for that.")
        cpu = loads.pcie_bytes_per_token + loads.disk_bytes_per_token
        if cpu:
            out.warnings.append(f"{len(loads.offloaded)} module(s) are offloaded: every generated token copies "
                                f"{_fmt(loads.pcie_bytes_per_token)} over PCIe to {loads.main_device}"
                                + (f" and reads {_fmt(loads.disk_bytes_per_token)} from disk"
                                   if loads.disk_bytes_per_token else "") + ": decoding is bound by that copy")
        for dev, peak in out.device_peaks().items():
            if peak > LARGEST_GPU_BYTES:
                out.warnings.append(f"{dev}'s peak {fmt_gib_gb(peak)} is more than any single GPU holds")
        out.notes += [n for n in loads.notes if n not in out.notes]

    def _stages(self, rt: RuntimeProfile, kv_prompt: int, kv_end: int, prefill_extra: int, decode_extra: int,
                work: Workload) -> tuple[dict[str, int], dict[str, int], dict[str, dict[str, int]], CpuStages | None]:
        """The stage rules of docs/accounting.md: device memory in use, and allocated, at each stage;
        for each stage, the KV and transient bytes of the moment that set it; on the CPU, the resident-set
        model's figures (docs/cpu-memory.md), whose typical figures are the stages."""
        inv = self.inv
        w_alloc = self._w_alloc
        on_the_fly = self.quant.method in ("bnb4", "bnb8") and not self.quant.pre_quantized
        load_extra = inv.largest_source_bytes if on_the_fly else 0
        load_alloc = w_alloc + load_extra
        warm = inv.warmup_bytes if (rt.device_kind == "cuda" and inv.warmup_bytes) else 0
        load_res = rt.reserve(max(load_alloc, warm))
        prefill_alloc = w_alloc + rt.workspace_bytes + kv_prompt + prefill_extra
        end_alloc = w_alloc + rt.workspace_bytes + kv_end + decode_extra
        allocated = {"load_peak": load_alloc, "post_load": w_alloc, "first_token": prefill_alloc, "end": end_alloc}
        at = {"load": {"kv": 0, "act": 0}, "post": {"kv": 0, "act": 0},
              "prefill": {"kv": kv_prompt, "act": max(prefill_extra, 0)},
              "decode": {"kv": kv_end, "act": max(decode_extra, 0)}}
        if rt.device_kind == "cpu":  # the resident set: mapped checkpoint pages, heap, tensors (docs/cpu-memory.md)
            cpu = cpu_resident_stages(cpu_inputs(inv, self.quant, self.source, work.batch * work.prompt),
                                      kv_prompt=kv_prompt, kv_end=kv_end, prefill_extra=max(prefill_extra, 0),
                                      decode_extra=max(decode_extra, 0), prompt_tokens=work.prompt,
                                      batch=work.batch, out_features=out_features(inv))
            stages = {k: rt.context_bytes + cpu.stages[k] for k in STAGES}
            return stages, allocated, {"load_peak": at["load"], "post_load": at["post"],
                                       "first_token": at["prefill"], "end": at["decode"]}, cpu
        prefill_res, end_res = rt.reserve(prefill_alloc), rt.reserve(end_alloc)
        stages = {"load_peak": rt.context_bytes + load_res, "post_load": rt.context_bytes + load_res}
        stages["first_token"] = rt.context_bytes + max(load_res, prefill_res)
        stages["end"] = max(stages["first_token"], rt.context_bytes + end_res)
        first = at["prefill"] if prefill_res > load_res else at["load"]
        end = at["decode"] if rt.context_bytes + end_res > stages["first_token"] else first
        return stages, allocated, {"load_peak": at["load"], "post_load": at["load"], "first_token": first,
                                   "end": end}, None

    def _same_kind(self, device: str | None) -> str:
        if device is None:
            return self.device
        if device_kind(device) != device_kind(self.device):
            raise ValueError(f"this Estimator traces for {self.device}; make another one for {device}")
        return device

    def sweep(self, points, device: str | None = None, runtime: RuntimeProfile | None = None,
              new_tokens: int = NEW_TOKENS, placement=None) -> list[dict]:
        """Peak per stage for many ``(ctx, batch)`` points from the cached KV layout and activation fit:
        arithmetic only, no tracing. Points outside the traced ones use the fit (see ``methods``).
        With a ``placement``, each row also has ``devices`` {device: {stage: bytes}} (the plan that
        loads: a refused plan's alternative), and its stages are the GPU sums. On the CPU after an
        on-the-fly bitsandbytes load, ``upper`` {stage: bytes} is the top of the run-to-run range."""
        device = self._same_kind(device)
        rt = runtime or default_profile(device)
        points = list(points)
        if self._kv is None or self._act is None or self._act.prefill is None:
            first = workload(*(points[0] if points else (4096, 1)), new_tokens)
            self._ensure_dry_run(first.batch, first.prompt, exact=False)
        if self._kv is None or self._act is None or self._act.prefill is None:
            raise UserError(f"{self.source.name}: the dry run is unavailable ({self._dry_error}); "
                            "use `estimate` for formula-based figures")
        out = []
        for ctx, batch in points:
            work = workload(ctx, batch, new_tokens)
            args = (self._kv_prompt(work), self._kv_end(work), self._act.prefill_extra(work.batch, work.prompt),
                    self._act.decode_extra(work.batch, work.prompt, work.new_tokens, self._cat_growth()))
            if placement is not None:
                loads = placement.alternative if placement.refused and placement.alternative else placement
                per = self._device_figures(loads, work, *args, runtime)
                devices = {d: dict(v.stages) for d, v in per.items()}
                stages = {k: sum(v[k] for d, v in devices.items() if d.startswith("cuda")) for k in STAGES}
                out.append({"ctx": work.ctx, "batch": work.batch, "quant": self.quant.name,
                            "peak": max(stages.values()), **stages, "devices": devices})
                continue
            stages, _, _, cpu = self._stages(rt, *args, work)
            row = {"ctx": work.ctx, "batch": work.batch, "quant": self.quant.name, "peak": max(stages.values()), **stages}
            if cpu is not None and cpu.lower != cpu.upper:  # the run-to-run top (docs/cpu-memory.md)
                row["upper"] = {k: rt.context_bytes + v for k, v in cpu.upper.items()}
            out.append(row)
        return out

    def _cat_growth(self) -> int:
        """Per batch row and generated token: the largest growing cache layer's bytes per token (the
        dynamic cache's concatenation; a static cache writes in place)."""
        if self.cache == "static" or not self._kv:
            return 0
        return max((layer.bytes_per_token for layer in self._kv if layer.max_tokens is None), default=0)

    def _end_tokens(self, work: Workload) -> int:
        """Positions in the cache at the end: prompt + new - 1 (the last token is never fed back); a
        static cache holds its whole max_cache_len (= ctx) from the start."""
        return work.ctx if self.cache == "static" else work.end_positions

    def _kv_end_layers(self, work: Workload) -> list[int]:
        """Each cache layer's bytes at the end. With one new token nothing is fed back after the
        prefill, so a dynamic sliding-window layer still holds the whole prompt's storage."""
        if self.cache == "dynamic" and work.new_tokens == 1:
            return [work.batch * (layer.fixed_bytes + layer.bytes_per_token * work.prompt) for layer in self._kv]
        return [layer.bytes_at(self._end_tokens(work), work.batch) for layer in self._kv]

    def _kv_end(self, work: Workload) -> int:
        return sum(self._kv_end_layers(work))

    def _kv_prompt(self, work: Workload) -> int:
        """The cache right after the prefill: as traced where this point was traced; otherwise from the
        layer layout, where a dynamic sliding-window layer still holds the whole prompt's storage (its
        window view is cut from it), so no window cap applies yet."""
        if self.cache == "static":  # allocated to max_cache_len = ctx before the prefill
            return sum(layer.bytes_at(work.ctx, work.batch) for layer in self._kv or [])
        for t in (self._act.traces if self._act else []):
            if t.batch == work.batch and t.tokens == work.prompt:
                return t.cache_bytes
        return sum(work.batch * (layer.fixed_bytes + layer.bytes_per_token * work.prompt) for layer in self._kv or [])


LARGEST_HOST_BYTES = 64 * 1024**4  # 64 TiB: beyond any single host's memory


def _warnings(tc: dict, work: Workload, peak: int, device: str, quant: QuantSpec | None = None) -> list[str]:
    out = []
    if quant is not None and quant.method == "other":
        out.append(f"quantization {quant.name!r} is not a format vramcal knows: its weights are counted as the "
                   "checkpoint stores them, or at the load dtype; treat the figures as a guess")
    limit = tc.get("max_position_embeddings")
    if isinstance(limit, int) and work.ctx > limit:
        out.append(f"ctx {work.ctx:,} is beyond the model's max_position_embeddings ({limit:,}): it was not "
                   "trained for that length (rope scaling may extend it; quality is not guaranteed)")
    if device_kind(device) == "cpu" and peak > LARGEST_HOST_BYTES:
        out.append(f"the peak {fmt_gib_gb(peak)} is more than any single host holds: lower the context or batch")
    if device_kind(device) == "cuda" and peak > LARGEST_GPU_BYTES:
        out.append(f"the peak {fmt_gib_gb(peak)} is more than any single GPU holds ({fmt_gib_gb(LARGEST_GPU_BYTES)}): "
                   "split the model across devices or lower the quantization, context or batch")
    return out


def estimate(model: str | ModelSource, quant: str = "auto", ctx: int | None = None, batch: int = 1, *,
             dtype: str | None = None, kv_dtype: str = "auto", attn: str = "auto", cache: str = "dynamic",
             device: str = "cuda", runtime: RuntimeProfile | None = None, use_cache: bool = True,
             exact: bool = True, new_tokens: int = NEW_TOKENS, prompt: int | None = None,
             correction: CorrectionSet | None = None, progress=None, max_memory: dict | str | None = None,
             device_map: str | None = None) -> Estimate:
    """Estimate peak memory per stage for ``model`` (anything ``vramcal estimate`` accepts).

    ``max_memory`` (``{"cuda:0": bytes, "cpu": bytes}`` or ``"cuda:0=24GiB,cpu=64GiB"``) and ``device_map``
    (``auto`` | ``balanced`` | ``balanced_low_0`` | ``sequential``; ``auto`` when only ``max_memory`` is
    given) split the model as ``from_pretrained`` would: the result's ``placement`` and ``devices`` hold
    the map and each device's stages (docs/placement.md). ``device_map`` needs ``max_memory`` here: the
    library does not read this machine's devices (the command line does).

    ``ctx`` is prompt + new tokens (default 4096), or give ``prompt`` instead. ``correction`` (a
    :class:`~vramcal.estimator.correction.CorrectionSet`, e.g. from
    :func:`vramcal.calibrate.corrections.machine_correction`) returns the corrected estimate.
    ``progress(step)`` is told each slow step as it starts."""
    work = workload(ctx, batch, new_tokens, prompt)
    device = "cpu" if device_kind(str(device)) == "cpu" else str(parse_device(device)).split(":")[0]
    placed = placement_request(max_memory, device_map, device)
    source = model if isinstance(model, ModelSource) else resolve_model(model)
    spec = resolve_quant(quant, source.config, dtype)
    if source.config.get("quantization_config") and (quant or "auto").lower() != "auto":
        qm = source.config["quantization_config"].get("quant_method", "?")
        raise UserError(f"{source.name} is already quantized ({qm}): it loads only as stored, use --quant auto")
    plan = None
    if placed is not None:
        from .placement import plan_placement

        if progress:
            progress("planning the placement with transformers' device-map function")
        plan = plan_placement(source, spec, placed[0], placed[1], use_cache=use_cache)
    est = Estimator(source, spec, attn=attn, cache=cache, kv_dtype=kv_dtype, use_cache=use_cache, device=device,
                    progress=progress)
    out = est.estimate(batch=work.batch, runtime=runtime, exact=exact, new_tokens=work.new_tokens,
                       prompt=work.prompt, placement=plan)
    return out.corrected(correction) if correction is not None else out


def placement_request(max_memory, device_map: str | None, device: str = "cuda"
                      ) -> tuple[dict[str, int], str] | None:
    """Validate the placement arguments of a call: None (one device), or (max_memory bytes per device,
    strategy). One-line UserErrors: ``--device-map`` without ``--max-memory``, placement on the CPU path,
    an unknown strategy, a memory figure that does not parse, an unknown device."""
    if max_memory is None and device_map is None:
        return None
    from .placement import DEVICE_MAP_CHOICES, _normalise

    if device_kind(str(device)) == "cpu":
        raise UserError("--max-memory and --device-map split a model across GPUs: they do not apply to --device cpu "
                        "(the CPU path loads everything in one process); drop them or use a cuda device")
    if device_map is not None and device_map not in DEVICE_MAP_CHOICES:
        raise UserError(f"unknown --device-map {device_map!r}: choose one of {', '.join(DEVICE_MAP_CHOICES)}")
    if max_memory is None:
        raise UserError("--device-map needs --max-memory here, e.g. --max-memory cuda:0=24GiB,cuda:1=24GiB,cpu=64GiB "
                        "(the command line reads this machine's free memory when it has GPUs)")
    mm = _normalise(max_memory)
    if not any(d.startswith("cuda") for d in mm):
        raise UserError("--max-memory names no GPU: give at least one cuda:N=SIZE (the CPU path runs unplaced)")
    return mm, device_map or "auto"


class Progress:
    """Tells stderr which slow step runs and how long the estimate has taken (the command line's)."""

    def __init__(self, stream):
        self.stream, self.start = stream, time.monotonic()

    def __call__(self, step: str) -> None:
        self.stream.write(f"vramcal: {time.monotonic() - self.start:5.1f} s  {step}\n")
        self.stream.flush()


# ------------------------------------------------------------------------------ formulas and comparison

def _kv_shape(tc: dict) -> tuple[int, int, int]:
    heads = int(size_field(tc, "num_attention_heads") or 1)
    kv = int(size_field(tc, "num_key_value_heads") or (1 if tc.get("multi_query") else heads))
    hd = int(tc.get("head_dim") or (int(size_field(tc, "hidden_size") or 0) // heads))
    return int(size_field(tc, "num_hidden_layers") or 0), kv, hd


def _formula_kv(tc: dict, tokens: int, batch: int, dtype: str) -> int:
    layers, kv, hd = _kv_shape(tc)
    return 2 * layers * kv * hd * tokens * batch * DTYPE_BYTES.get(dtype, 2)


def _formula_activations(tc: dict, inv: Inventory, batch: int, prompt: int) -> tuple[int, int]:
    h = int(tc.get("hidden_size") or 0)
    inter = int(tc.get("intermediate_size") or 4 * h)
    el = DTYPE_BYTES.get(inv.dtype, 2)
    tokens = batch * prompt
    vocab = int(tc.get("vocab_size") or 0)
    prefill = tokens * (4 * h + 3 * inter) * el + batch * vocab * 4 * 2 + inv.largest_source_bytes
    decode = batch * (4 * h + 3 * inter) * el + batch * vocab * 4 * 2
    return prefill, decode


def _compare_formula(tc: dict, inv: Inventory, quant: QuantSpec, work: Workload,
                     components: dict[str, int]) -> tuple[dict | None, list[str]]:
    layers, kv_heads, hd = _kv_shape(tc)
    bits = quant.bits or DTYPE_BYTES.get(quant.dtype, 2) * 8
    try:
        q: QuickEstimate = quick_estimate(inv.params / 1e9, bits, work.ctx, work.batch, layers or None,
                                          kv_heads or None, hd or None, DTYPE_BYTES.get(inv.dtype, 2))
    except UserError:
        return None, []
    diffs = []
    dw = components["weights"] - q.weights_bytes
    g = inv.groups
    diffs.append(f"weights {fmt_gib_gb(components['weights'])} vs formula {fmt_gib_gb(q.weights_bytes)} "
                 f"({dw / max(q.weights_bytes, 1):+.1%})")
    if quant.method in ("bnb4", "bnb8", "gptq", "awq", "fp8"):
        for key, label in (("embeddings", "input embeddings stay"), ("lm_head", "lm_head stays"),
                           ("experts", "fused MoE experts stay")):
            if g.get(key):
                diffs.append(f"  {label} in {inv.dtype}: {fmt_gib_gb(g[key])}")
        if g.get("quant_state"):
            diffs.append(f"  quantization state (absmax / scales / code tables): {fmt_gib_gb(g['quant_state'])}")
        if g.get("dense"):
            diffs.append(f"  other layers the quantizer skips or cannot convert: {fmt_gib_gb(g['dense'])}")
    if q.kv_cache_bytes is not None:
        dk = components["kv_cache"] - q.kv_cache_bytes
        if abs(dk) > 0.005 * max(q.kv_cache_bytes, 1):
            diffs.append(f"kv cache {fmt_gib_gb(components['kv_cache'])} vs formula {fmt_gib_gb(q.kv_cache_bytes)} "
                         f"({dk / max(q.kv_cache_bytes, 1):+.1%}): the installed cache classes store "
                         "sliding-window / compressed (MLA) / state layers differently")
    diffs.append(f"activations and runtime: {fmt_gib_gb(components['activations'] + components['runtime'])} "
                 f"vs the formula's flat 18 % ({fmt_gib_gb(q.total_bytes - q.weights_bytes - (q.kv_cache_bytes or 0))})")
    return q.to_dict(), diffs
