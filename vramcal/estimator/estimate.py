"""Put the parts together: weights (inventory) + KV cache + activations (dry run) + runtime -> stages.

:class:`Estimator` keeps the expensive parts of one model and quantization (inventory, KV layout,
activation traces) and turns a workload into an :class:`~vramcal.estimator.result.Estimate` with the
stage rules of :mod:`vramcal.estimator.stages` -- on one device, or on each device of a placement.
:func:`estimate` is the one call most users need.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, fields, replace

from ..errors import UserError
from ..units import GB, fmt_gib_gb
from ..versions import VRAMCAL_VERSION
from ..workload import (ATTNS, CACHES, KV_DTYPES, NEW_TOKENS, STAGES, Workload, choice, device_kind, images_of,
                        parse_device, workload)
from .cache import CACHE_PROBLEMS, load_cached, store_cached
from .correction import CorrectionSet
from .cpu import CpuStages, cpu_inputs, cpu_resident_stages, out_features
from .dryrun import ActivationModel, KVLayer, Trace, fit_activations
from .allocator import AllocConf, AllocConfError, conf_from
from .reserve import load_events, loaded, slack_at, slack_nodes, trace_slack
from .inventory import Inventory, inventory
from .loading import from_pretrained_kwargs
from .formats import CPU, GpuTarget
from .quant import QuantSpec, resolve_quant
from .quick import compare_formula, formula_activations, formula_kv
from .resolve import ModelSource, resolve_model, size_field, text_config
from .result import DeviceEstimate, Estimate
from .runtime import CUDA_DEFAULT, RuntimeProfile, cuda_terms, default_profile
from .stages import DeviceLoad, device_stages, model_id, placed_stages, weights_alloc
from .vision import LABELS, Images, check_images, plan_images

FIT_TOKENS = (512, 2048, 8192)  # eager attention's quadratic fit; the interpolation's nodes below
PIECE_TOKENS = (512, 2048, 8192)
# with images every prompt holds their tokens: the fit's shortest point is the images and a few words,
# where the vision encoder's window often sets the prefill (text tokens, the image tokens come on top)
FIT_TOKENS_IMAGES = (16, 2048, 8192)
# KV layouts measured in this process, by what decides them (not the weights' quantization): a search
# over quantizations measures each model's layout once
_KV_LAYOUTS: dict[tuple, list[KVLayer]] = {}
COVER_LIMIT = 1 << 24  # the longest batch-1 trace made to cover a point (MAX_TOKENS); beyond, the last piece
LARGEST_GPU_BYTES = 288 * GB  # the largest memory on one GPU sold today (B300); beyond it, split the model
LARGEST_HOST_BYTES = 64 * 1024**4  # 64 TiB: beyond any single host's memory
# what a dry run raises for an op the meta device cannot run (the activations then come from formulas)
DRY_RUN_FAILURES = (RuntimeError, ValueError, TypeError, NotImplementedError, IndexError, KeyError, AttributeError,
                    AssertionError, ImportError, StopIteration)

__all__ = ["Estimate", "Estimator", "Point", "estimate", "placement_request", "STAGES", "NEW_TOKENS"]


@dataclass(frozen=True)
class Point:
    """One point of :meth:`Estimator.sweep`: the stages at (ctx, batch); with a placement the GPU sums,
    and each device's stages under ``devices``; on the CPU after an on-the-fly bitsandbytes load, the top
    of the run-to-run range under ``upper``."""

    ctx: int
    batch: int
    quant: str
    stages: dict[str, int]
    devices: dict[str, dict[str, int]] | None = None
    upper: dict[str, int] | None = None

    @property
    def peak(self) -> int:
        return max(self.stages.values())


def _act_cache_key(quant: QuantSpec, attn: str, cache: str, kv_dtype: str, target: str, images=None) -> QuantSpec:
    from dataclasses import replace

    shown = f"|{images.key()}" if images is not None else ""
    return replace(quant, name=f"{quant.name}|{attn}|{cache}|{kv_dtype}|{target}{shown}")


@dataclass(frozen=True)
class _Parts:
    """What the stage rules take from the inventory and the dry run at one workload."""

    kv_prompt: int
    kv_end: int
    prefill_extra: int
    decode_extra: int
    slack: tuple[int, int] | None = None  # the caching allocator's reserve above allocated (replayed)


class Estimator:
    """Estimates for one model and quantization; keeps the expensive parts (inventory, KV layout,
    activation traces) and reuses them across contexts and batches."""

    def __init__(self, source: ModelSource, quant: QuantSpec, attn: str = "auto", cache: str = "dynamic",
                 kv_dtype: str = "auto", use_cache: bool = True, device: str = "cuda", progress=None,
                 images: int = 0, image_size: tuple[int, int] | str | None = None,
                 alloc_conf: AllocConf | None = None):
        """``images`` images of ``image_size`` (None: the processor's default size) in every prompt
        (:mod:`vramcal.estimator.vision`): every estimate of this Estimator holds them. ``alloc_conf``: the
        caching allocator's settings the run will have (default: torch's defaults), which the load and the
        dry run are replayed through (:mod:`vramcal.estimator.reserve`); None: ``PYTORCH_ALLOC_CONF`` /
        ``PYTORCH_CUDA_ALLOC_CONF`` as set here, else torch's defaults (so plan and fit read them too)."""
        choice(attn, ATTNS, "--attn")
        choice(cache, CACHES, "--cache")
        choice(kv_dtype, KV_DTYPES, "--kv-dtype")
        images, image_size = images_of(images, image_size)
        check_images(source.config, images, source.name)
        self.source, self.quant = source, quant
        self.attn, self.cache, self.kv_dtype = attn, cache, kv_dtype
        self.use_cache = use_cache
        self.alloc_conf = alloc_conf or alloc_conf_option(None)  # the environment's, else torch's defaults
        self._load_replays: dict[str, tuple[int, int]] = {}
        # the replay is opt-in (VRAMCAL_ALLOC_REPLAY=1): plan's and fit's searches agree with its figures (issue
        # 26), but an offloaded split carries none of its slack (docs/accounting.md); off: segments rounding
        # only, as an offloaded placement's GPUs are priced (:meth:`unreplayed`)
        self.replay = alloc_replay_enabled()
        self._progress = progress or (lambda step: None)
        self._problems: list[str] = []
        start = len(CACHE_PROBLEMS)
        self.inv: Inventory = inventory(source, quant, use_cache=use_cache, progress=self._progress)
        self._w_alloc = weights_alloc(self.inv.alloc_sizes)
        # the config as transformers filled it: what the formulas, the warnings and the image rules read
        self.config = self.inv.config or source.config
        self.text_config = text_config(self.config)
        self.images: Images | None = plan_images(self.config, source.processor, images, image_size, source.name,
                                                 source_config=source.config)
        self.device = device_kind(device)
        self._act_key = _act_cache_key(quant, attn, cache, kv_dtype, self.device, self.images)
        self._runner = None
        self._kv: list[KVLayer] | None = None
        self._act: ActivationModel | None = None
        self._nodes: dict[int, Trace] = {}  # batch-1 traces made for the slack's ladder alone (:meth:`_slack`)
        self._slack_dirty = False
        self._dry_error: str | None = None
        self.attn_used = attn
        if use_cache:
            self._load_act_cache()
        self._problems += CACHE_PROBLEMS[start:]
        del CACHE_PROBLEMS[start:]

    def lm_workload(self, work: Workload) -> Workload:
        """``work`` as the language model runs it: every row's prompt holds this Estimator's images, whose
        tokens add to the text prompt."""
        if self.images is None:
            return work
        return Workload(work.prompt + self.images.tokens, work.new_tokens, work.batch)

    def _image_size(self) -> tuple[int, int] | None:
        return None if self.images is None else (self.images.plan.width, self.images.plan.height)

    def _images_method(self) -> str:
        im = self.images
        p = im.plan
        how = "; ".join(f"{k} {v} ({where})" for k, (v, where) in p.settings.items())
        return (f"{LABELS.get(p.family, p.family)} processor rules (docs/vision.md): {im.count} image(s) of "
                f"{p.width}x{p.height}{'' if im.size_given else ' (the processor default size)'}, {p.tokens} "
                f"tokens each ({p.placeholders} image features + {p.specials} special tokens); the vision "
                f"encoder runs {p.encoder_images} image(s) of {p.encoder_size[1]}x{p.encoder_size[0]} "
                f"({p.encoder_tokens} positions each); settings: {how}")

    @property
    def dry_run_error(self) -> str | None:
        """Why the dry run could not run this model (the activations then come from formulas), or None.
        Known once a dry run was tried: a sweep tries it first."""
        return self._dry_error

    @property
    def on_the_fly(self) -> bool:
        """bitsandbytes quantizes while loading (its 16-bit sources pass through memory)."""
        return self.quant.method in ("bnb4", "bnb8") and not self.quant.pre_quantized

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
                                        traces=[Trace(**t) for t in act["traces"]], pieces=bool(act.get("pieces")),
                                        vision=tuple(act["vision"]) if act.get("vision") else None,
                                        vision_own=tuple(act["vision_own"]) if act.get("vision_own") else None)
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
        try:
            nodes = {int(t["tokens"]): Trace(**t) for t in data.get("slack_nodes") or []}
        except (KeyError, TypeError, ValueError):
            nodes = {}  # only costs their traces again
        self._kv, self._act, self.attn_used, self._nodes = kv, model, attn_used, nodes

    def _store_act_cache(self) -> None:
        """Only successful dry runs are cached; a failure is retried by the next estimate."""
        if not self.use_cache or self._kv is None or self._act is None:
            return
        act = {"prefill": list(self._act.prefill) if self._act.prefill else None,
               "decode": list(self._act.decode) if self._act.decode else None,
               "traces": [{f.name: getattr(t, f.name) for f in fields(t) if f.name != "events"}
                          for t in self._act.traces], "pieces": self._act.pieces,
               "vision": list(self._act.vision) if self._act.vision else None,
               "vision_own": list(self._act.vision_own) if self._act.vision_own else None}
        nodes = [{f.name: getattr(t, f.name) for f in fields(t) if f.name != "events"} for t in self._nodes.values()]
        store_cached(self.source, self._act_key, {"kv": [asdict(k) for k in self._kv], "act": act,
                                                   "attn_used": self.attn_used, "slack_nodes": nodes},
                     kind="activations")

    def _dry_runner(self):
        if self._runner is None:
            from .dryrun import DryRunner

            self._runner = DryRunner(self.source, traced_quant(self.quant), attn=None if self.attn == "auto" else self.attn,
                                     cache=self.cache, kv_dtype=self.kv_dtype, target=self.device)
            self.attn_used = self._runner.attn_used
        return self._runner

    def _traced(self, batch: int, prompt: int) -> bool:
        return bool(self._act and any(t.batch == batch and t.tokens == prompt for t in self._act.traces))

    def _ensure_dry_run(self, batch: int, prompt: int, exact: bool, cover: int | None = None) -> None:
        """Make sure the KV layout exists and the activations at (batch, prompt) are known: traced
        there if ``exact``, else from a fit over a few traced points (traced once, then cached) that
        reach ``cover`` tokens (batch x prompt; default this point's): beyond the traced ones, one more
        trace at the next power of two (:class:`~vramcal.estimator.dryrun.ActivationModel`)."""
        if self._dry_error is not None or self.inv.method in ("checkpoint", "formula"):
            return  # formula: transformers cannot build this model here, so it cannot run it either
        need_kv = self._kv is None
        need_point = exact and not self._traced(batch, prompt)
        need_fit = not exact and (self._act is None or self._act.prefill is None)
        reach = min(cover if cover is not None else batch * prompt, COVER_LIMIT)
        need_cover = not exact and not need_fit and not self._act.covers(reach)
        if not (need_kv or need_point or need_fit or need_cover):
            return
        try:
            runner = self._dry_runner()
            if need_kv:
                key = (self.source.config_hash, self.quant.dtype, self.attn, self.cache, self.kv_dtype, self.device,
                       self.images.key() if self.images is not None else None)
                if key not in _KV_LAYOUTS or not self.use_cache:
                    self._progress("measuring the KV cache layout (two tiny prefills on meta tensors)")
                    _KV_LAYOUTS[key] = runner.kv_layers(images=self.images)
                self._kv = list(_KV_LAYOUTS[key])
            runner._kv_layout = list(self._kv)  # the runner's traces by layer kind read the same layout
            traces = list(self._act.traces) if self._act else []
            if need_point:
                self._progress(f"tracing the prefill of {prompt:,} tokens x {batch} and a decode step")
                traces.append(runner.trace(batch, prompt, self.images))
            pieces = self.attn_used != "eager"
            if need_fit or need_cover:
                if self.images is None:
                    points = PIECE_TOKENS if pieces else FIT_TOKENS
                else:
                    points = tuple(n + self.images.tokens for n in FIT_TOKENS_IMAGES)
                far = max(points[-1], 1 << max(reach - 1, 1).bit_length())
                for n in points + ((far,) if far > points[-1] else ()):
                    if not any(t.batch == 1 and t.tokens == n for t in traces):
                        self._progress(f"tracing {n:,} tokens for the activation fit")
                        traces.append(runner.trace(1, n, self.images))
            self._act = fit_activations(traces, pieces) if need_fit or need_cover or (self._act and self._act.prefill) \
                else ActivationModel(prefill=None, decode=None, traces=traces, pieces=pieces)
        except UserError:
            raise
        except DRY_RUN_FAILURES as exc:  # an op the meta device cannot run: formulas, said so
            self._dry_error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            return
        self._store_act_cache()

    # ---------------------------------------------------------------- the caching allocator replayed
    def _slack_keys(self) -> tuple[str, str]:
        """The settings replayed: the run's, and the same with expandable segments (plan and fit say when
        that would save memory). Kept once made: a sweep asks at every point (half its time in 10,000 points)."""
        conf = self.alloc_conf
        if getattr(self, "_keys", (None,))[0] is not conf:
            self._keys = (conf, (conf.key, conf.with_expandable().key))
        return self._keys[1]

    def _load_events(self) -> list:
        if getattr(self, "_load_ev", None) is None:
            self._load_ev = load_events(self.inv, self.quant, self.on_the_fly)
        return self._load_ev

    def _confs(self):
        return self.alloc_conf, self.alloc_conf.with_expandable()

    def _replayed(self, t: Trace) -> Trace:
        """``t`` with its slack for each replayed setting, from its events (then dropped): ``[]`` where the dry
        run could not give the whole model's events (several layer kinds, images). Made when a figure first
        asks for it, not as the trace is made: a placement's GPUs are not replayed (but for the plain load's,
        :attr:`~vramcal.estimator.placement.Placement.plain_load`), so a search that splits a model pays for
        no replay it does not read. A trace read from the disk cache
        without this setting's slack (cached by a run that never asked) is traced again for it: the trace
        returned is then a new one, with the same figures."""
        if all(k in t.slack for k in self._slack_keys()):
            return t
        if t.events is None:  # read from the disk cache, replayed there for other settings or none
            runner = self._dry_runner()
            runner._kv_layout = list(self._kv or [])
            with contextlib.suppress(*DRY_RUN_FAILURES):  # it traced before: failing now only loses the replay
                t = runner.trace(t.batch, t.tokens, self.images)
        for conf in self._confs():
            got = trace_slack(self._load_events(), t.events, CUDA_DEFAULT.workspace_bytes, conf) \
                if t.events is not None and self.device == "cuda" else None
            t.slack[conf.key] = got or []
        t.events = None
        self._slack_dirty = True
        return t

    def _slack_node(self, tokens: int) -> Trace | None:
        """The batch-1 trace at ``tokens`` the slack is interpolated from, replayed: the activation fit's own
        where it has one there, else one traced for the slack alone (kept apart, so that the activation fit
        never depends on which slack was asked). None where the dry run cannot trace it."""
        traces = self._act.traces
        for i, t in enumerate(traces):
            if t.batch == 1 and t.tokens == tokens:
                traces[i] = self._replayed(t)
                return traces[i]
        t = self._nodes.get(tokens)
        if t is None:
            runner = self._dry_runner()
            runner._kv_layout = list(self._kv or [])
            self._progress(f"tracing {tokens:,} tokens for the caching allocator's replay")
            try:
                t = runner.trace(1, tokens, self.images)
            except DRY_RUN_FAILURES:
                return None
        self._nodes[tokens] = self._replayed(t)
        return self._nodes[tokens]
    def load_reserved(self, conf: AllocConf | None = None) -> tuple[int, int]:
        """(reserved at the load's peak, after it) with ``conf`` (default: this Estimator's settings)."""
        conf = conf or self.alloc_conf
        if conf.key not in self._load_replays:
            self._load_replays[conf.key] = loaded(self._load_events(), conf)[1]
        return self._load_replays[conf.key]

    @contextlib.contextmanager
    def unreplayed(self):
        """One device's figures priced as a placement's GPUs are (allocated rounded to 2 MiB segments, no
        replay): what a split's search starts from, so that its first budgets and its priced GPUs agree."""
        saved, self.replay = self.replay, False
        try:
            yield self
        finally:
            self.replay = saved

    def _slack(self, work: Workload, conf: AllocConf) -> tuple[int, int] | None:
        """The slack at ``work`` with ``conf`` (None: no replay here). At a traced point, its own trace's;
        elsewhere interpolated between the two nodes of a fixed ladder around ``batch x prompt``
        (:func:`slack_nodes`), traced where missing -- never between whatever other traces this model
        has: the slack is not convex in the tokens, so an interpolation over the traces a disk cache
        happens to hold would move with them, and a search over contexts with it (issue 26)."""
        if self._act is None or self.device != "cuda" or not self.replay or self.images is not None:
            return None  # images: the vision encoder's events are not replayed yet (docs/accounting.md)
        self._slack_dirty = False
        try:
            own = self._act._trace(work.batch, work.prompt)
            if own is not None:
                i = self._act.traces.index(own)
                own = self._act.traces[i] = self._replayed(own)
                got = own.slack.get(conf.key)
                return (got[0], got[1]) if got else None
            nodes = []
            for n in slack_nodes(work.batch * work.prompt):
                t = self._slack_node(n)
                if t is None or not t.slack.get(conf.key):
                    return None
                nodes.append(t)
            return slack_at(nodes, work.batch, work.prompt, conf.key)
        finally:
            if self._slack_dirty:
                self._store_act_cache()

    def expandable_saving(self, ctx: int | None = None, batch: int = 1, new_tokens: int = NEW_TOKENS,
                          prompt: int | None = None, runtime: RuntimeProfile | None = None
                          ) -> tuple[int, int] | None:
        """(the peak with this Estimator's settings, the peak with ``expandable_segments:True`` added) on one
        GPU at this workload, both from the replay; None where no replay was possible (or it is already on)."""
        if self.device != "cuda" or self.alloc_conf.expandable_segments or not self.replay:
            return None
        work = self.lm_workload(workload(ctx, batch, new_tokens, prompt))
        # from the traces there are (the estimate or the search just made them): a new trace here would
        # change the activation fit under a search that is under way
        if self._act is None or not (self._traced(work.batch, work.prompt) or self._act.prefill is not None):
            return None
        parts, _, _ = self._parts(work)
        alt = self.alloc_conf.with_expandable()
        slack = self._slack(work, alt)
        if parts.slack is None or slack is None:
            return None
        rt = runtime or CUDA_DEFAULT
        base = device_stages("cuda", rt, self._load(parts)).peak
        other = replace(self._load(parts), load_reserved=self.load_reserved(alt), slack=slack)
        return base, device_stages("cuda", rt, other).peak

    # ---------------------------------------------------------------- the parts at a workload
    def _parts(self, work: Workload, placement=None) -> tuple[_Parts, dict[str, str], bool]:
        """KV and transients at ``work``, how each was obtained, and whether a formula stood in. The slack is
        replayed for one device or a ``placement`` that is the plain load, not for one no figure reads it in."""
        methods: dict[str, str] = {}
        approximate = False
        tc = self.text_config
        if self._kv is not None:
            kv_prompt, kv_end = self._kv_prompt(work), self._kv_end(work)
            methods["kv_cache"] = "cache layers of the installed transformers, measured on meta tensors"
        else:
            kv_end = formula_kv(tc, self._end_tokens(work), work.batch, self.inv.dtype)
            kv_prompt = formula_kv(tc, work.prompt, work.batch, self.inv.dtype)
            methods["kv_cache"] = "formula (2 x layers x kv_heads x head_dim x tokens x bytes)"
            approximate = True
        if self._act is not None and (self._traced(work.batch, work.prompt) or self._act.prefill is not None):
            prefill = self._act.prefill_extra(work.batch, work.prompt)
            decode = self._act.decode_extra(work.batch, work.prompt, work.new_tokens, self._cat_growth())
            methods["activations"] = ("dry run of the real forward on meta tensors"
                                      if self._traced(work.batch, work.prompt)
                                      else f"fit over {len(self._act.traces)} dry-run traces")
        else:
            prefill, decode = formula_activations(tc, self.inv, work.batch, work.prompt)
            methods["activations"] = "formula (dry run unavailable)"
            approximate = True
        read = placement is None or placement.loads.plain_load
        slack = self._slack(work, self.alloc_conf) if read and not methods["activations"].startswith("formula") \
            else None
        return _Parts(kv_prompt, kv_end, prefill, decode, slack), methods, approximate

    def _single(self, rt: RuntimeProfile, parts: _Parts, work: Workload) -> tuple[DeviceEstimate, CpuStages | None]:
        """The device's figures on one device: the stage rules on a GPU, the resident-set model on the CPU."""
        inv = self.inv
        if rt.device_kind == "cpu":
            cpu = cpu_resident_stages(cpu_inputs(inv, self.quant, self.source),
                                      kv_prompt=parts.kv_prompt, kv_end=parts.kv_end,
                                      prefill_extra=max(parts.prefill_extra, 0),
                                      decode_extra=max(parts.decode_extra, 0), prompt_tokens=work.prompt,
                                      batch=work.batch, out_features=out_features(inv))
            stages = {k: rt.context_bytes + cpu.stages[k] for k in STAGES}
            tensors = device_stages("cpu", rt, self._load(parts))  # torch's tensors, beside the resident set
            peak_stage = max(STAGES, key=lambda k: stages[k])
            breakdown = {**({"runtime": rt.context_bytes} if rt.context_bytes else {}), **cpu.terms[peak_stage]}
            return DeviceEstimate("cpu", stages, tensors.allocated, tensors.components, breakdown), cpu
        return device_stages(str(rt.device_kind), rt, self._load(parts)), None

    def _load(self, parts: _Parts) -> DeviceLoad:
        inv = self.inv
        return DeviceLoad(weights_bytes=inv.tensor_bytes, weights_alloc=self._w_alloc,
                          load_transient=inv.largest_source_bytes if self.on_the_fly else 0,
                          warmup=inv.warmup_bytes or 0, kv_prompt=parts.kv_prompt, kv_end=parts.kv_end,
                          prefill_extra=parts.prefill_extra, decode_extra=parts.decode_extra,
                          load_reserved=self.load_reserved() if parts.slack is not None else None,
                          slack=parts.slack, **self._run_weights())

    def _run_weights(self) -> dict:
        """DeviceLoad's weights from the first forward on, where the format's first forward rewrites them."""
        inv = self.inv
        if not inv.first_forward:
            return {}
        return {"run_weights_bytes": inv.run_tensor_bytes, "run_weights_alloc": weights_alloc(inv.run_alloc_sizes())}

    # ---------------------------------------------------------------- the estimate
    def estimate(self, ctx: int | None = None, batch: int = 1, device: str | None = None,
                 runtime: RuntimeProfile | None = None, exact: bool = True, new_tokens: int = NEW_TOKENS,
                 prompt: int | None = None, placement=None) -> Estimate:
        """``placement`` (a :class:`~vramcal.estimator.placement.Placement` of this model and quant) adds
        per-device figures: see :meth:`_place`. ``device`` may name the GPU (``cuda:1``): the figures are
        the kind's, the load (``from_pretrained``) that GPU's."""
        text = workload(ctx, batch, new_tokens, prompt)
        work = self.lm_workload(text)  # what the language model runs: the image tokens in the prompt
        load_device = device if device is not None and ":" in str(device) else None
        device = self._same_kind(device)
        self._ensure_dry_run(work.batch, work.prompt, exact)
        rt = runtime or default_profile(device)
        inv = self.inv
        notes = list(inv.notes) + self._problems
        methods = {"weights": {"meta": "meta-device model + quantizer (exact)",
                               "checkpoint": "checkpoint safetensors headers",
                               "formula": "formula from config fields"}[inv.method]}
        parts, how, approx = self._parts(work, placement)
        methods.update(how)
        if self._dry_error and methods["activations"].startswith("formula"):
            notes.append(f"dry run failed ({self._dry_error}); activations from a formula")
        elif traced_quant(self.quant) is not self.quant and inv.first_forward:
            notes.append(DECOMPRESSED_RUN_NOTE)
        elif traced_quant(self.quant) is not self.quant:
            notes.append(KERNEL_TRANSIENT_NOTE.format(fmt=self.quant.implementation))
        if self.quant.pre_quantized and self.quant.extra.get("path"):  # which path the GPU takes, and why
            notes.insert(0, f"{self.quant.implementation}: {self.quant.extra['path']}")
        if rt.keeps_freed and placement is None:
            conf = self.alloc_conf.text or "torch's defaults"
            methods["reserved"] = (f"the caching allocator replayed ({conf}; torch 2.13's rules, docs/accounting.md) "
                                   "over the load's and the dry run's allocations in order" if parts.slack is not None
                                   else "allocated rounded up to 2 MiB segments: the allocations' order is not known "
                                        "here (a formula, images, or several layer kinds), so no replay")
        kv_by_kind: dict[str, int] = {}
        if self._kv is not None:
            for layer, b in zip(self._kv, self._kv_end_layers(work)):
                kv_by_kind[layer.kind] = kv_by_kind.get(layer.kind, 0) + b
        else:
            kv_by_kind = {"formula": parts.kv_end}

        single, cpu = self._single(rt, parts, work)
        components = {k: single.components[k] for k in ("weights", "kv_cache", "activations", "runtime")}
        ranges = None
        if cpu is not None:  # the resident set: what it is made of is the CPU model's terms
            methods["resident set"] = ("docs/cpu-memory.md: the checkpoint's mapped pages, tensors the loader "
                                       "allocates, glibc heap kept after quantizing, KV and prefill blocks")
            notes += cpu.notes
            if cpu.lower != cpu.upper:
                ranges = {k: (rt.context_bytes + cpu.lower[k], rt.context_bytes + cpu.upper[k]) for k in STAGES}
        tc = self.text_config
        formula, diffs = compare_formula(tc, inv, self.quant, work, components)
        if self.attn_used == "eager":
            notes.append("eager attention materialises batch x heads x seq x seq scores: the prefill grows with ctx^2")
        vision_peak = None
        if self.images is not None:
            methods["images"] = self._images_method()
            notes += self.images.notes
            if self._act is not None and methods["activations"] != "formula (dry run unavailable)":
                vision_peak = self._act.vision_extra(work.batch, work.prompt)
            else:
                notes.append("the vision encoder was not traced (the dry run is unavailable): its activations are "
                             "not in the figures")
        out = Estimate(
            model=self.source.name, architecture=inv.architecture, quant=self.quant.name,
            quant_implementation=self.quant.implementation, dtype=inv.dtype, ctx=text.ctx, batch=work.batch,
            kv_dtype=self.kv_dtype, attn=self.attn_used, cache=self.cache, device=device,
            components=components, stages=dict(single.stages), allocated=dict(single.allocated),
            peak=single.peak, approximate=inv.approximate or approx, methods=methods,
            weights_breakdown={k: v for k, v in inv.groups.items() if v}, kv_breakdown=kv_by_kind,
            formula=formula, differences=diffs, notes=notes, runtime_source=rt.source,
            config_hash=self.source.config_hash, prompt=text.prompt, new_tokens=work.new_tokens,
            peak_stage=single.peak_stage, peak_breakdown=dict(single.breakdown),
            warnings=_warnings(tc, work, single.peak if placement is None else 0, device, self.quant),
            ranges=ranges, estimator_model=model_id(device_kind(device)), vramcal_version=VRAMCAL_VERSION,
            weights_parts=dict(inv.parts), images=self.images.count if self.images else 0,
            image_size=self._image_size(), image_tokens=work.prompt - text.prompt, vision_peak=vision_peak,
            revision=self.source.revision,
            reserved=dict(single.reserved), alloc_conf=self.alloc_conf.text, runtime_terms=dict(rt.terms or {}))
        if placement is not None:
            self._place(out, placement, work, parts, runtime)
            if self.inv.first_forward:
                out.notes.append("with a placement each device's stages hold its weights as loaded: the first "
                                 "forward's decompression is priced on one device only, not split by device")
        out.from_pretrained = from_pretrained_kwargs(self.quant, load_device or device, placement,
                                                     None if self.attn == "auto" else self.attn_used)
        out.auto_class = self.inv.auto_class
        return out

    def _kv_layers_or_split(self, work: Workload, parts: _Parts) -> tuple[list[int], list[int]]:
        """Per decoder layer: the cache after the prefill and at the end. Without the measured layer
        layout (formula path), the totals split evenly over the layers."""
        if self._kv is not None:
            if self.cache == "static":
                prompt = [layer.bytes_at(work.ctx, work.batch) for layer in self._kv]
            else:
                prompt = [work.batch * (layer.fixed_bytes + layer.bytes_per_token * work.prompt) for layer in self._kv]
            return prompt, self._kv_end_layers(work)
        n = max(int(size_field(self.text_config, "num_hidden_layers") or 1), 1)
        return [parts.kv_prompt // n] * n, [parts.kv_end // n] * n

    def _device_figures(self, plan, work: Workload, parts: _Parts,
                        runtime: RuntimeProfile | None) -> dict[str, DeviceEstimate]:
        """:func:`~vramcal.estimator.stages.placed_stages` of the plan that loads (a refused plan's
        alternative), fed with this estimator's per-layer cache and transients; a plan that is the one-GPU load
        (everything on one GPU) with the one-GPU replay, so that a split and the plain estimate agree there."""
        kvp, kve = self._kv_layers_or_split(work, parts)
        replayed = (self.load_reserved(), parts.slack) if parts.slack is not None else None
        return placed_stages(plan.loads, kv_prompt=kvp, kv_end=kve, prefill_extra=max(parts.prefill_extra, 0),
                             decode_extra=max(parts.decode_extra, 0), on_the_fly=self.on_the_fly,
                             runtime=(lambda d: runtime) if runtime is not None else default_profile,
                             replayed=replayed)

    def _place(self, out: Estimate, plan, work: Workload, parts: _Parts, runtime: RuntimeProfile | None) -> None:
        """Per-device stages of ``plan`` (docs/placement.md), into ``out``: ``devices``, ``placement``, and
        the GPU sums as ``stages`` / ``allocated`` / ``peak``. A plan the installed transformers refuses is
        figured as its alternative (the custom map + flag that loads), and said so in the warnings."""
        from .placement import OFFLOAD_FLAG, fmt_size

        loads = plan.loads
        per = self._device_figures(plan, work, parts, runtime)
        out.devices = per
        out.placement = plan
        gpus = [d for d in per if d.startswith("cuda")]
        out.stages = {k: sum(per[d].stages[k] for d in gpus) for k in STAGES}
        out.allocated = {k: sum(per[d].allocated[k] for d in gpus) for k in STAGES}
        out.reserved = {k: sum(per[d].reserved.get(k, 0) for d in gpus) for k in STAGES}
        out.methods["reserved"] = (
            f"the caching allocator replayed as for the plain load: the plan holds everything on {gpus[0]}"
            if parts.slack is not None and loads.plain_load else
            "each GPU's allocated rounded up to 2 MiB segments (a placement is not replayed)")
        out.peak_stage = max(STAGES, key=lambda k: out.stages[k])
        out.peak = out.stages[out.peak_stage]
        out.peak_device = max(gpus, key=lambda d: per[d].peak) if gpus else None
        out.peak_breakdown = dict(per[out.peak_device].breakdown) if gpus else {}
        out.methods["placement"] = (f"transformers' own device map ({plan.strategy}, max_memory as given) on the "
                                    "meta model; per-device stages by docs/placement.md")
        if plan.refused:
            custom = ", ".join(loads.grouped())
            out.warnings.append(f"transformers {plan.software.get('transformers')} refuses to load this with "
                                f"device_map={plan.strategy!r} (\"{plan.refused.split('. ')[0]}…\"). What loads "
                                "instead: the same map as a custom device_map "
                                f"({custom}) with {OFFLOAD_FLAG}=True; the offloaded modules then stay "
                                f"unquantized in {self.inv.dtype}. The per-device figures are for that.")
        if loads.pcie_bytes_per_token + loads.disk_bytes_per_token:
            out.warnings.append(f"{len(loads.offloaded)} module(s) are offloaded: every generated token copies "
                                f"{fmt_size(loads.pcie_bytes_per_token)} over PCIe to {loads.main_device}"
                                + (f" and reads {fmt_size(loads.disk_bytes_per_token)} from disk"
                                   if loads.disk_bytes_per_token else "") + ": decoding is bound by that copy")
        for dev, peak in out.device_peaks().items():
            if peak > LARGEST_GPU_BYTES:
                out.warnings.append(f"{dev}'s peak {fmt_gib_gb(peak)} is more than any single GPU holds")
            budget = plan.max_memory.get(dev)
            if budget is not None and peak > budget:
                out.warnings.append(f"{dev} peaks at {fmt_gib_gb(peak)}, above its max_memory {fmt_gib_gb(budget)}: "
                                    "max_memory bounds the weights transformers places there; the cache, the "
                                    "activations and the CUDA context come on top (`vramcal plan` finds a "
                                    "max_memory whose whole peak fits)")
        out.notes += [n for n in loads.notes if n not in out.notes]

    def _same_kind(self, device: str | None) -> str:
        if device is None:
            return self.device
        if device_kind(device) != self.device:
            raise ValueError(f"this Estimator traces for {self.device}; make another one for {device}")
        return device_kind(device)

    def sweep(self, points, device: str | None = None, runtime: RuntimeProfile | None = None,
              new_tokens: int = NEW_TOKENS, placement=None) -> list[Point]:
        """The stages at many ``(ctx, batch)`` points from the cached KV layout and activation fit:
        arithmetic only, once the fit's traces reach the longest point (a trace beyond the traced ones is
        made once, then cached). With a ``placement``, each point has each device's stages (the plan that
        loads)."""
        device = self._same_kind(device)
        rt = runtime or default_profile(device)
        points = list(points)
        works = [self.lm_workload(workload(ctx, batch, new_tokens)) for ctx, batch in points] \
            or [self.lm_workload(workload(4096, 1, new_tokens))]
        reach = max(w.batch * w.prompt for w in works)
        if self._kv is None or self._act is None or self._act.prefill is None or not self._act.covers(reach):
            self._ensure_dry_run(works[0].batch, works[0].prompt, exact=False, cover=reach)
        if self._kv is None or self._act is None or self._act.prefill is None:
            raise UserError(f"{self.source.name}: the dry run is unavailable ({self._dry_error}); "
                            "use `estimate` for formula-based figures")
        out = []
        for ctx, batch in points:
            text = workload(ctx, batch, new_tokens)
            work = self.lm_workload(text)
            parts, _, _ = self._parts(work, placement)
            if placement is not None:
                per = self._device_figures(placement, work, parts, runtime)
                devices = {d: dict(v.stages) for d, v in per.items()}
                stages = {k: sum(v[k] for d, v in devices.items() if d.startswith("cuda")) for k in STAGES}
                out.append(Point(text.ctx, work.batch, self.quant.name, stages, devices=devices))
                continue
            single, cpu = self._single(rt, parts, work)
            upper = None
            if cpu is not None and cpu.lower != cpu.upper:  # the run-to-run top (docs/cpu-memory.md)
                upper = {k: rt.context_bytes + v for k, v in cpu.upper.items()}
            out.append(Point(text.ctx, work.batch, self.quant.name, dict(single.stages), upper=upper))
        return out

    # ---------------------------------------------------------------- the cache's positions
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


def alloc_replay_enabled() -> bool:
    """Whether estimates replay the caching allocator (``VRAMCAL_ALLOC_REPLAY=1``): opt-in for now."""
    import os

    return os.environ.get("VRAMCAL_ALLOC_REPLAY") == "1"


def traced_quant(quant: QuantSpec) -> QuantSpec:
    """The quantization the dry run runs. A pre-quantized format kept as stored runs kernels that exist on a
    GPU only (Triton / DeepGEMM block fp8, MXFP4's matmul_ogs), never on meta tensors: the forward is traced
    on the same model dequantized, whose activations, cache and outputs have the same shapes and dtypes. What
    the kernels add beside (an fp8 copy of each matmul's input: one byte an element, freed after it) is left
    out and said (:data:`KERNEL_TRANSIENT_NOTE`)."""
    from dataclasses import replace

    from .formats import REPLACED_ON_META

    if quant.pre_quantized and quant.method in REPLACED_ON_META:
        return replace(quant, name=f"{quant.method}-dequantized", method="dequantized")
    return quant


KERNEL_TRANSIENT_NOTE = ("activations traced on the dequantized model: {fmt}'s kernels run on a GPU only; the "
                         "fp8/fp4 copy a kernel makes of each matmul's input (one byte an element or less, freed "
                         "after it) is not in the peak")

DECOMPRESSED_RUN_NOTE = ("activations traced on the dequantized model, which is what runs once the first forward has "
                         "decompressed it; the fake quantization compressed-tensors applies to the input of each "
                         "Linear whose scheme quantizes activations (a few copies of that input, freed after it) is "
                         "not in the peak")


def _warnings(tc: dict, work: Workload, peak: int, device: str, quant: QuantSpec | None = None) -> list[str]:
    out = []
    if quant is not None and quant.method == "other":
        out.append(f"quantization {quant.name!r} is not a format vramcal knows: its weights are counted as the "
                   "checkpoint stores them, or at the load dtype; treat the figures as a guess")
    limit = size_field(tc, "max_position_embeddings")
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
             device_map: str | None = None, images: int = 0, image_size: tuple[int, int] | str | None = None,
             gpu: GpuTarget | None = None, alloc_conf: AllocConf | str | None = None) -> Estimate:
    """Estimate peak memory per stage for ``model`` (anything ``vramcal estimate`` accepts).

    ``gpu`` (a :class:`~vramcal.estimator.formats.GpuTarget`: ``--gpu NAME``, or this machine's GPU) decides
    the path a pre-quantized checkpoint takes: its format kept, or dequantized at load
    (:mod:`vramcal.estimator.formats`); the result's ``quant`` says which, and why.

    ``images`` images of ``image_size`` (``(width, height)`` or ``"1024x768"``; default: the model's
    processor's size) in every prompt of a vision-language model (docs/vision.md): their tokens add to the
    prompt; the result's ``image_tokens`` and ``context`` say how many, ``vision_peak`` what the vision
    encoder adds while it runs.

    ``max_memory`` (``{"cuda:0": bytes, "cpu": bytes}`` or ``"cuda:0=24GiB,cpu=64GiB"``) and ``device_map``
    (``auto`` | ``balanced`` | ``balanced_low_0`` | ``sequential``; ``auto`` when only ``max_memory`` is
    given) split the model as ``from_pretrained`` would: the result's ``placement`` and ``devices`` hold
    the map and each device's stages (docs/placement.md). ``device_map`` needs ``max_memory`` here: the
    library does not read this machine's devices (the command line does).

    ``ctx`` is prompt + new tokens (default 4096), or give ``prompt`` instead. ``correction`` (a
    :class:`~vramcal.estimator.correction.CorrectionSet`, e.g. from
    :func:`vramcal.calibrate.corrections.machine_correction`) returns the corrected estimate.
    ``progress(step)`` is told each slow step as it starts.

    ``alloc_conf``: the caching allocator's settings (``"expandable_segments:True"`` or an
    :class:`~vramcal.estimator.allocator.AllocConf`); None: what ``PYTORCH_ALLOC_CONF`` /
    ``PYTORCH_CUDA_ALLOC_CONF`` say here, else torch's defaults."""
    conf = alloc_conf if isinstance(alloc_conf, AllocConf) else alloc_conf_option(alloc_conf)
    work = workload(ctx, batch, new_tokens, prompt, images, image_size)
    kind = device_kind(parse_device(device, default="cuda"))
    placed = placement_request(max_memory, device_map, kind)
    source = model if isinstance(model, ModelSource) else resolve_model(model)
    check_images(source.config, work.images, source.name)
    spec = resolve_quant(quant, source, dtype, gpu or (CPU if kind == "cpu" else None))
    plan = None
    if placed is not None:
        from .placement import plan_placement

        if progress:
            progress("planning the placement with transformers' device-map functions")
        plan = plan_placement(source, spec, placed[0], placed[1], use_cache=use_cache)
    est = Estimator(source, spec, attn=attn, cache=cache, kv_dtype=kv_dtype, use_cache=use_cache, device=kind,
                    progress=progress, images=work.images, image_size=work.image_size, alloc_conf=conf)
    if runtime is None and kind == "cuda":
        runtime = cuda_terms(gpu)  # each non-torch term by what it is, for this GPU where one is named
    out = est.estimate(batch=work.batch, runtime=runtime, exact=exact, new_tokens=work.new_tokens,
                       prompt=work.prompt, placement=plan, device=str(parse_device(device, default="cuda")))
    return out.corrected(correction) if correction is not None else out


EXPANDABLE_MIN_SHARE = 0.05  # plan and fit suggest expandable segments when they save this share of a GPU's peak


def expandable_advice(est: Estimator, work: Workload) -> dict | None:
    """``{"env": {...}, "saved_bytes": n, "share": x}`` when ``expandable_segments:True`` would save at
    least :data:`EXPANDABLE_MIN_SHARE` of the GPU's peak at ``work`` (the replay's two figures), else None."""
    got = est.expandable_saving(prompt=work.prompt, new_tokens=work.new_tokens, batch=work.batch)
    if not got:
        return None
    base, other = got
    saved = base - other
    if saved < EXPANDABLE_MIN_SHARE * base:
        return None
    return {"env": {"PYTORCH_ALLOC_CONF": est.alloc_conf.with_expandable().text}, "saved_bytes": saved,
            "share": saved / base}


def env_prefix(env: dict | None) -> str:
    """``PYTORCH_ALLOC_CONF=expandable_segments:True `` before a printed command (nothing without env)."""
    import shlex

    return "".join(f"{k}={shlex.quote(v)} " for k, v in (env or {}).items())


def alloc_conf_option(text: str | None) -> AllocConf:
    """The allocator settings of ``--alloc-conf`` (or, without it, the environment's), as a one-line
    :class:`UserError` when they do not parse."""
    try:
        return conf_from(text)
    except AllocConfError as exc:
        raise UserError(f"{exc} (see docs/accounting.md, the caching allocator)") from None


def placement_request(max_memory, device_map: str | None, device: str = "cuda"
                      ) -> tuple[dict[str, int], str] | None:
    """Validate the placement arguments of a call: None (one device), or (max_memory bytes per device,
    strategy). One-line UserErrors: ``--device-map`` without ``--max-memory``, placement on the CPU path,
    an unknown strategy, a memory figure that does not parse, an unknown device."""
    if max_memory is None and device_map is None:
        return None
    from .placement import DEVICE_MAP_CHOICES, normalise_max_memory

    if device_kind(device) == "cpu":
        raise UserError("--max-memory and --device-map split a model across GPUs: they do not apply to --device cpu "
                        "(the CPU path loads everything in one process); drop them or use a cuda device")
    if device_map is not None and device_map not in DEVICE_MAP_CHOICES:
        raise UserError(f"unknown --device-map {device_map!r}: choose one of {', '.join(DEVICE_MAP_CHOICES)}")
    if max_memory is None:
        raise UserError("--device-map needs --max-memory here, e.g. --max-memory cuda:0=24GiB,cuda:1=24GiB,cpu=64GiB "
                        "(the command line reads this machine's free memory when it has GPUs)")
    mm = normalise_max_memory(max_memory)
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
