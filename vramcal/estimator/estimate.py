"""Put the parts together: weights (inventory) + KV cache + activations (dry run) + runtime -> stages.

Stages are what a probe on the device will see (docs/accounting.md):

- ``load_peak``   highest memory while ``from_pretrained`` runs;
- ``post_load``   once loading is done;
- ``first_token`` highest memory up to the first new token (the prefill);
- ``end``         highest memory up to the 16th new token.

On CUDA each is ``context + reserved``, and reserved is a running peak (the caching allocator keeps
freed blocks), so the stages never decrease; ``allocated`` gives the ``memory_allocated`` view of the
same moments. ``peak`` is the largest stage.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from ..errors import UserError
from .dryrun import ActivationModel, KVLayer, Trace, fit_activations, round_alloc
from .inventory import Inventory, inventory, load_cached, store_cached
from .quant import DTYPE_BYTES, QuantSpec, resolve_quant
from .quick import QuickEstimate, quick_estimate
from .resolve import ModelSource, resolve_model, text_config
from .runtime import RuntimeProfile, default_profile

NEW_TOKENS = 16
FIT_TOKENS = (512, 2048, 8192)
ATTN_CHOICES = ("auto", "sdpa", "eager", "flash_attention_2")
CACHE_CHOICES = ("dynamic", "static")
KV_DTYPES = ("auto", "fp8")
STAGES = ("load_peak", "post_load", "first_token", "end")


@dataclass
class Estimate:
    model: str
    architecture: str
    quant: str
    quant_implementation: str
    dtype: str
    ctx: int
    batch: int
    kv_dtype: str
    attn: str
    cache: str
    device: str
    components: dict[str, int]  # weights, kv_cache, activations, runtime
    stages: dict[str, int]  # device memory in use (NVML view)
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

    def to_dict(self) -> dict:
        return asdict(self)


def _check_positive(ctx: int, batch: int) -> None:
    if not isinstance(ctx, int) or ctx <= NEW_TOKENS:
        raise UserError(f"--ctx must be an integer above {NEW_TOKENS} (prompt + {NEW_TOKENS} generated tokens), got {ctx}")
    if not isinstance(batch, int) or batch <= 0:
        raise UserError(f"--batch must be a positive integer, got {batch}")


def _act_cache_key(quant: QuantSpec, attn: str, cache: str, kv_dtype: str, target: str) -> QuantSpec:
    return replace(quant, name=f"{quant.name}|{attn}|{cache}|{kv_dtype}|{target}")


def device_kind(device: str) -> str:
    return "cpu" if device.startswith("cpu") else "cuda"


class Estimator:
    """Estimates for one model and quantization; keeps the expensive parts (inventory, KV layout,
    activation traces) and reuses them across contexts and batches."""

    def __init__(self, source: ModelSource, quant: QuantSpec, attn: str = "auto", cache: str = "dynamic",
                 kv_dtype: str = "auto", use_cache: bool = True, device: str = "cuda"):
        if attn not in ATTN_CHOICES:
            raise UserError(f"unknown --attn {attn!r}: choose one of {', '.join(ATTN_CHOICES)}")
        if cache not in CACHE_CHOICES:
            raise UserError(f"unknown --cache {cache!r}: choose dynamic or static")
        if kv_dtype not in KV_DTYPES:
            raise UserError(f"unknown --kv-dtype {kv_dtype!r}: choose auto (the model's dtype) or fp8 "
                            "(transformers' QuantizedCache fp8 backend)")
        self.source, self.quant = source, quant
        self.attn, self.cache, self.kv_dtype = attn, cache, kv_dtype
        self.use_cache = use_cache
        self.inv: Inventory = inventory(source, quant, use_cache=use_cache)
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

    # ---------------------------------------------------------------- cached dry-run results
    def _load_act_cache(self) -> None:
        data = load_cached(self.source, self._act_key, kind="activations")
        if not data:
            return
        self._kv = [KVLayer(**d) for d in data["kv"]] if data.get("kv") is not None else None
        if data.get("act"):
            a = data["act"]
            self._act = ActivationModel(prefill=tuple(a["prefill"]), decode=tuple(a["decode"]),
                                        traces=[Trace(**t) for t in a["traces"]])
        self._dry_error = data.get("error")
        self.attn_used = data.get("attn_used", self.attn)

    def _store_act_cache(self) -> None:
        if not self.use_cache:
            return
        act = None
        if self._act is not None:
            act = {"prefill": list(self._act.prefill), "decode": list(self._act.decode),
                   "traces": [asdict(t) for t in self._act.traces]}
        store_cached(self.source, self._act_key, {
            "kv": [asdict(k) for k in self._kv] if self._kv is not None else None, "act": act,
            "error": self._dry_error, "attn_used": self.attn_used}, kind="activations")

    def _dry_runner(self):
        if self._runner is None:
            from .dryrun import DryRunner

            self._runner = DryRunner(self.source, self.quant, attn=None if self.attn == "auto" else self.attn,
                                     cache=self.cache, kv_dtype=self.kv_dtype, target=device_kind(self.device))
            self.attn_used = self._runner.attn_used
        return self._runner

    def _ensure_dry_run(self, batch: int, prompt: int, exact: bool) -> None:
        """Make sure KV layout and an activation model exist; trace (batch, prompt) itself if ``exact``."""
        if self._dry_error is not None or self.inv.method == "checkpoint":
            return
        need_kv = self._kv is None
        need_fit = self._act is None
        need_point = exact and not (self._act and any(t.batch == batch and t.tokens == prompt
                                                      for t in self._act.traces))
        if not (need_kv or need_fit or need_point):
            return
        try:
            runner = self._dry_runner()
            if need_kv:
                self._kv = runner.kv_layers()
            traces = list(self._act.traces) if self._act else []
            if need_fit:
                traces += [runner.trace(1, n) for n in FIT_TOKENS]
            if need_point and not any(t.batch == batch and t.tokens == prompt for t in traces):
                traces.append(runner.trace(batch, prompt))
            self._act = fit_activations(traces)
        except UserError:
            raise
        except Exception as exc:  # an op the meta device cannot run: fall back to formulas, say so
            self._dry_error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        self._store_act_cache()

    # ---------------------------------------------------------------- the estimate
    def estimate(self, ctx: int, batch: int = 1, device: str | None = None, runtime: RuntimeProfile | None = None,
                 exact: bool = True) -> Estimate:
        _check_positive(ctx, batch)
        device = self._same_kind(device)
        prompt = ctx - NEW_TOKENS
        self._ensure_dry_run(batch, prompt, exact)
        rt = runtime or default_profile(device)
        inv = self.inv
        notes = list(inv.notes)
        methods = {"weights": {"meta": "meta-device model + quantizer (exact)",
                               "checkpoint": "checkpoint safetensors headers",
                               "formula": "formula from config fields"}[inv.method]}
        approximate = inv.approximate
        tc = text_config(self.source.config)

        end_tokens = self._end_tokens(ctx)
        if self._kv is not None:
            kv_end = self._kv_end(ctx, batch)
            kv_by_kind: dict[str, int] = {}
            for layer in self._kv:
                kv_by_kind[layer.kind] = kv_by_kind.get(layer.kind, 0) + layer.bytes_at(end_tokens, batch)
            methods["kv_cache"] = "cache layers of the installed transformers, measured on meta tensors"
        else:
            kv_end = _formula_kv(tc, end_tokens, batch, inv.dtype)
            kv_by_kind = {"formula": kv_end}
            methods["kv_cache"] = "formula (2 x layers x kv_heads x head_dim x tokens x bytes)"
            approximate = True

        # activations
        if self._act is not None:
            prefill_extra = self._act.prefill_extra(batch, prompt)
            decode_extra = self._act.decode_extra(batch, prompt)
            traced = any(t.batch == batch and t.tokens == prompt for t in self._act.traces)
            methods["activations"] = ("dry run of the real forward on meta tensors" if traced else
                                      f"fit over {len(self._act.traces)} dry-run traces")
            kv_prompt = self._kv_prompt(batch, prompt)
        else:
            prefill_extra, decode_extra = _formula_activations(tc, inv, batch, prompt)
            kv_prompt = _formula_kv(tc, prompt, batch, inv.dtype)
            methods["activations"] = "formula (dry run unavailable)"
            approximate = True
            if self._dry_error:
                notes.append(f"dry run failed ({self._dry_error}); activations from a formula")

        stages, allocated = self._stages(rt, kv_prompt, kv_end, prefill_extra, decode_extra)
        peak = max(stages.values())
        act = max(prefill_extra, decode_extra)
        components = {"weights": inv.tensor_bytes, "kv_cache": kv_end, "activations": act,
                      "runtime": peak - inv.tensor_bytes - kv_end - act}
        formula, diffs = _compare_formula(tc, inv, self.quant, ctx, batch, components)
        if self.attn_used == "eager":
            notes.append("eager attention materialises batch x heads x seq x seq scores: the prefill grows with ctx^2")
        return Estimate(
            model=self.source.name, architecture=inv.architecture, quant=self.quant.name,
            quant_implementation=self.quant.implementation, dtype=inv.dtype, ctx=ctx, batch=batch,
            kv_dtype=self.kv_dtype, attn=self.attn_used, cache=self.cache, device=device,
            components=components, stages=stages, allocated=allocated, peak=peak, approximate=approximate,
            methods=methods, weights_breakdown={k: v for k, v in inv.groups.items() if v},
            kv_breakdown=kv_by_kind, formula=formula, differences=diffs, notes=notes,
            runtime_source=rt.source, config_hash=self.source.config_hash)


    def _stages(self, rt: RuntimeProfile, kv_prompt: int, kv_end: int, prefill_extra: int,
                decode_extra: int) -> tuple[dict[str, int], dict[str, int]]:
        """The stage rules of docs/accounting.md: device memory in use, and allocated, at each stage."""
        inv = self.inv
        w_alloc = self._w_alloc
        on_the_fly = self.quant.method in ("bnb4", "bnb8") and not self.quant.pre_quantized
        load_alloc = w_alloc + (inv.largest_source_bytes if on_the_fly else 0)
        warm = inv.warmup_bytes if (rt.device_kind == "cuda" and inv.warmup_bytes) else 0
        load_res = rt.reserve(max(load_alloc, warm))
        prefill_alloc = w_alloc + rt.workspace_bytes + kv_prompt + prefill_extra
        end_alloc = w_alloc + rt.workspace_bytes + kv_end + decode_extra
        allocated = {"load_peak": load_alloc, "post_load": w_alloc, "first_token": prefill_alloc, "end": end_alloc}
        if not rt.keeps_freed:  # the CPU gives large freed blocks back: each stage stands on its own
            return {k: rt.context_bytes + v for k, v in allocated.items()}, allocated
        stages = {"load_peak": rt.context_bytes + load_res, "post_load": rt.context_bytes + load_res}
        stages["first_token"] = rt.context_bytes + max(load_res, rt.reserve(prefill_alloc))
        stages["end"] = max(stages["first_token"], rt.context_bytes + rt.reserve(end_alloc))
        return stages, allocated

    def _same_kind(self, device: str | None) -> str:
        if device is None:
            return self.device
        if device_kind(device) != device_kind(self.device):
            raise ValueError(f"this Estimator traces for {self.device}; make another one for {device}")
        return device

    def sweep(self, points, device: str | None = None, runtime: RuntimeProfile | None = None) -> list[dict]:
        """Peak per stage for many ``(ctx, batch)`` points from the cached KV layout and activation fit:
        arithmetic only, no tracing. Points outside the traced ones use the fit (see ``methods``)."""
        device = self._same_kind(device)
        rt = runtime or default_profile(device)
        if self._kv is None or self._act is None:
            first = next(iter(points), (4096, 1))
            self._ensure_dry_run(first[1], first[0] - NEW_TOKENS, exact=False)
        if self._kv is None or self._act is None:
            raise UserError(f"{self.source.name}: the dry run is unavailable ({self._dry_error}); "
                            "use `estimate` for formula-based figures")
        out = []
        for ctx, batch in points:
            _check_positive(ctx, batch)
            prompt = ctx - NEW_TOKENS
            stages, _ = self._stages(rt, self._kv_prompt(batch, prompt), self._kv_end(ctx, batch),
                                     self._act.prefill_extra(batch, prompt), self._act.decode_extra(batch, prompt))
            out.append({"ctx": ctx, "batch": batch, "quant": self.quant.name, "peak": max(stages.values()),
                        **stages})
        return out

    def _end_tokens(self, ctx: int) -> int:
        """Positions in the cache at the end: prompt + 15 (the 16th token is never fed back); a static
        cache holds its whole max_cache_len (= ctx) from the start."""
        return ctx if self.cache == "static" else ctx - 1

    def _kv_end(self, ctx: int, batch: int) -> int:
        return sum(layer.bytes_at(self._end_tokens(ctx), batch) for layer in self._kv)

    def _kv_prompt(self, batch: int, prompt: int) -> int:
        """The cache right after the prefill: as traced where this point was traced; otherwise from the
        layer layout, where a dynamic sliding-window layer still holds the whole prompt's storage (its
        window view is cut from it), so no window cap applies yet."""
        for t in self._act.traces:
            if t.batch == batch and t.tokens == prompt:
                return t.cache_bytes
        if self.cache == "static":
            return sum(layer.bytes_at(prompt, batch) for layer in self._kv or [])
        return sum(batch * (layer.fixed_bytes + layer.bytes_per_token * prompt) for layer in self._kv or [])


def estimate(model: str | ModelSource, quant: str = "auto", ctx: int = 4096, batch: int = 1, *, dtype: str | None = None,
             kv_dtype: str = "auto", attn: str = "auto", cache: str = "dynamic", device: str = "cuda",
             runtime: RuntimeProfile | None = None, use_cache: bool = True, exact: bool = True) -> Estimate:
    """Estimate peak memory per stage for ``model`` (anything ``vramcal estimate`` accepts)."""
    _check_positive(ctx, batch)
    source = model if isinstance(model, ModelSource) else resolve_model(model)
    spec = resolve_quant(quant, source.config, dtype)
    if spec.pre_quantized and quant not in ("auto",):
        raise UserError(f"{source.name} is already quantized ({spec.implementation}); use --quant auto")
    if source.config.get("quantization_config") and quant != "auto":
        qm = source.config["quantization_config"].get("quant_method", "?")
        raise UserError(f"{source.name} is already quantized ({qm}): it loads only as stored, use --quant auto")
    est = Estimator(source, spec, attn=attn, cache=cache, kv_dtype=kv_dtype, use_cache=use_cache, device=device)
    return est.estimate(ctx, batch, runtime=runtime, exact=exact)


# ------------------------------------------------------------------------------ formulas and comparison

def _kv_shape(tc: dict) -> tuple[int, int, int]:
    heads = int(tc.get("num_attention_heads") or 1)
    kv = int(tc.get("num_key_value_heads") or heads)
    hd = int(tc.get("head_dim") or (int(tc.get("hidden_size", 0)) // heads))
    return int(tc.get("num_hidden_layers") or 0), kv, hd


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


def _compare_formula(tc: dict, inv: Inventory, quant: QuantSpec, ctx: int, batch: int,
                     components: dict[str, int]) -> tuple[dict | None, list[str]]:
    layers, kv_heads, hd = _kv_shape(tc)
    bits = quant.bits or DTYPE_BYTES.get(quant.dtype, 2) * 8
    try:
        q: QuickEstimate = quick_estimate(inv.params / 1e9, bits, ctx, batch, layers or None, kv_heads or None,
                                          hd or None, DTYPE_BYTES.get(inv.dtype, 2))
    except UserError:
        return None, []
    diffs = []
    dw = components["weights"] - q.weights_bytes
    g = inv.groups
    from ..units import fmt_gib_gb

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
