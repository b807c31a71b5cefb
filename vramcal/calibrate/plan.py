"""``plan``: the best ways to run a model on the GPUs, RAM and disk a machine has.

The search, per weight quantization (the 16-bit load, int8, nf4, nf4-dq; a pre-quantized checkpoint
only as stored) and KV dtype (the model's own, then fp8 where the own does not reach the context):

1. the largest GPU alone, as a plain load (``device_map={"": N}``);
2. every GPU, split by transformers' own map, nothing offloaded;
3. the GPUs and the RAM (offload), then the disk too when one is given --

stopping at the first layout that reaches the context: nothing is offloaded when the GPUs hold it.
Each split is :meth:`Search.split`'s: a ``max_memory`` per GPU such that the GPU's *whole* peak
(weights, the cache of its layers, activations, the offloaded block copied in, the CUDA context),
corrected by this machine's runs where it has some, stays within its memory less the buffer. The
context asked is checked as asked; without one, the largest context (up to the model's limit) is
sought, and offloaded plans are split for :data:`OFFLOAD_CTX` tokens (llama.cpp's ``--fit`` keeps the
same floor before it moves layers to the host), then given the largest context that split holds.

Every listed plan is verified with the exact trace at its context (the search bisects on the
activation fit): a plan is never listed that the exact estimate calls over. fp4 holds the same bytes as
nf4 (the same packing and block constants) at a worse precision, so it never ranks above it; it is
said, not listed.

Ranking (``--goal``): ``quality`` (the documents' order) -- reaches the context, on the GPUs alone, the
highest weight precision, the model's own KV dtype; ``context`` -- the longest context first;
``speed`` -- reaches the context, the highest decode bound. Plans short of the context come after those
that reach it, the closest first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import UserError
from ..estimator.estimate import env_prefix, expandable_advice
from ..estimator.loading import hub_ref, python_code
from ..estimator.quant import config_dtype
from ..estimator.speed import DecodeBound, decode_bound, unread_embedding
from ..units import fmt_gib_gb
from ..workload import GOALS, NEW_TOKENS, Configuration, Workload, choice
from .search import (SEARCH_SECONDS, Budget, OutOfTime, Search, Split, bounded, context_limit,
                     offloaded_layers)

OFFLOAD_CTX = 4096  # the context an offloaded plan is split for when none is asked
SPLIT_FLOOR = 256  # the shortest power of two a split is sized for before the shortest context
PRECISION = ("fp32", "bf16", "fp16", "int8", "nf4", "nf4-dq", "fp4", "fp4-dq")  # best first
KV_ORDER = ("auto", "fp8")
UNBOUNDED = 1 << 60  # "as much RAM as it takes": for saying how much is missing


@dataclass
class Plan:
    """One configuration that fits, with everything needed to run it."""

    quant: str
    kv_dtype: str
    batch: int
    ctx: int
    new_tokens: int
    layout: str  # gpu | gpus | offload | disk
    reaches: bool  # the context asked (or, without one, the floor sought) is reached
    peak_bytes: dict[str, int]  # each GPU's corrected peak; cpu / disk: the weights held there
    device_map: dict[str, str]  # module -> device, as estimate --json writes it
    where: list[str]  # the map grouped for a person
    max_memory: dict[str, int] | None  # None: a plain load on one GPU
    speed: DecodeBound
    from_pretrained: dict
    command: str  # the vramcal check command that verifies it here
    model_ref: str = ""
    offloaded_layers: str | None = None  # an offloaded plan: "12 of 80 layers"
    auto_class: str = "AutoModelForCausalLM"
    # the environment the run needs: PYTORCH_ALLOC_CONF=expandable_segments:True where it saves >= 5 % of the
    # GPU's peak (the allocator replayed both ways; estimate.expandable_advice), with what it saves
    env: dict[str, str] = field(default_factory=dict)
    expandable_saved_bytes: int | None = None

    @property
    def offloaded(self) -> bool:
        return self.layout in ("offload", "disk")

    @property
    def tokens_per_s(self) -> float | None:
        return self.speed.tokens_per_s

    def python(self) -> str:
        return python_code(self.model_ref, self.from_pretrained, self.auto_class, self.kv_dtype)

    def to_dict(self) -> dict:
        return {"quant": self.quant, "kv_dtype": self.kv_dtype, "batch": self.batch, "ctx": self.ctx,
                "new_tokens": self.new_tokens, "layout": self.layout, "reaches_ctx": self.reaches,
                "max_memory": self.max_memory, "device_map": self.device_map, "peak_bytes": self.peak_bytes,
                "tokens_per_s": self.tokens_per_s, "tokens_per_s_terms": self.speed.terms,
                "bandwidths": self.speed.bandwidths, "tokens_per_s_unknown": self.speed.why_none,
                "from_pretrained": self.from_pretrained, "command": self.command, "env": self.env,
                "expandable_saved_bytes": self.expandable_saved_bytes}


@dataclass
class PlanResult:
    model: str
    hardware: object  # vramcal.probes.hardware.Hardware
    buffer: int
    goal: str
    target_ctx: int  # the context asked, or the floor sought without one
    asked: bool
    plans: list[Plan]
    why: list[str]  # why nothing better fits: one line per configuration that does not
    shortfall: str | None = None  # nothing fits: what is missing
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"model": self.model, "hardware": self.hardware.sizes(),
                "driver_reserve": self.hardware.reserves(), "hardware_source": self.hardware.source,
                "buffer_bytes": self.buffer, "goal": self.goal, "ctx": self.target_ctx, "ctx_asked": self.asked,
                "plans": [p.to_dict() for p in self.plans], "why_nothing_better": self.why,
                "shortfall": self.shortfall, "notes": self.notes}


def gpu_of(gpu) -> object | None:
    """The path-deciding target of a plan's GPU (a pre-quantized checkpoint kept or dequantized on it): the
    table's row of its name, None where the table does not know it."""
    from ..probes.hardware import find_gpu

    row = find_gpu(gpu.name, gpu.total_bytes) if gpu.name else None
    return row.target() if row is not None else None


def candidate_quants(config: dict) -> list[str]:
    """The weight quantizations searched: a pre-quantized checkpoint as stored; else the 16-bit load
    (fp16 for a float16 checkpoint, else bf16), int8, nf4, nf4-dq."""
    if config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config"):
        return ["auto"]
    sixteen = "fp16" if config_dtype(config) == "float16" else "bf16"
    return [sixteen, "int8", "nf4", "nf4-dq"]


def _rank(goal: str):
    def precision(p: Plan) -> int:
        return PRECISION.index(p.quant) if p.quant in PRECISION else len(PRECISION)

    def short(p: Plan) -> tuple[bool, int]:  # plans short of the context come after, the closest first
        return (not p.reaches, 0 if p.reaches else -p.ctx)

    if goal == "context":
        return lambda p: (-p.ctx, p.offloaded, precision(p), KV_ORDER.index(p.kv_dtype))
    if goal == "speed":
        return lambda p: (*short(p), -(p.tokens_per_s or 0.0), precision(p), KV_ORDER.index(p.kv_dtype))
    return lambda p: (*short(p), p.offloaded, precision(p), KV_ORDER.index(p.kv_dtype), -p.ctx)


class Planner:
    """The search of the module's doc for one model on one machine."""

    def __init__(self, source, hardware, *, buffer: int, batch: int = 1, new_tokens: int = NEW_TOKENS,
                 ctx: int | None = None, goal: str = "quality", corrections=None, attn: str = "auto",
                 progress=None, images: int = 0, image_size=None):
        choice(goal, GOALS, "--goal")
        self.source, self.hw, self.buffer, self.batch, self.new_tokens = source, hardware, buffer, batch, new_tokens
        self.goal, self.attn, self.images, self.image_size = goal, attn, images, image_size
        self.progress, self._found = progress, []
        usable = {g.device: g.memory_bytes - buffer for g in hardware.gpus}
        short = [d for d, u in usable.items() if u <= 0]
        if short:
            raise UserError(f"--buffer {fmt_gib_gb(buffer)} leaves nothing of {', '.join(short)}: give a smaller "
                            "--buffer or more memory")
        self.usable = usable
        if hardware.disk_bytes and hardware.cpu_bytes - buffer <= 0:
            raise UserError("disk= needs RAM beside it (cpu=, above the --buffer): accelerate offloads to disk what "
                            "does not fit in RAM, and runs every offloaded layer through it")
        self.biggest = max(usable, key=lambda d: usable[d])
        self.search = Search(source, device=self.biggest, attn=attn, corrections=corrections, progress=progress,
                             images=images, image_size=image_size, gpu=gpu_of(hardware.gpu(self.biggest)))
        self.limit = context_limit(self.search.estimator(candidate_quants(source.config)[0]), new_tokens)
        self.asked = ctx is not None
        self.target = ctx if ctx is not None else min(self.limit, OFFLOAD_CTX)
        if goal == "context" and ctx is None:
            self.target = self.limit
        self.why: list[str] = []

    # ------------------------------------------------------------------ layouts
    @property
    def ram(self) -> int:
        """What offloaded weights may take: the RAM less the buffer (the process and the OS live there too)."""
        return max(self.hw.cpu_bytes - self.buffer, 0)

    def layouts(self) -> list[tuple[str, Budget]]:
        hw = self.hw
        out = [("gpu", Budget({self.biggest: self.usable[self.biggest]}))]
        if len(self.usable) > 1:
            out.append(("gpus", Budget(dict(self.usable))))
        ram = self.ram
        if ram > 0:
            out.append(("offload", Budget(dict(self.usable), ram)))
        if ram > 0 and hw.disk_bytes:
            out.append(("disk", Budget(dict(self.usable), ram, hw.disk_bytes)))
        return out

    def split_contexts(self) -> list[int]:
        """The contexts a split is sized for, longest first: the one sought, then the powers of two below it
        down to :data:`SPLIT_FLOOR`, then the shortest. The points are the same for every goal, so the search
        of ``--goal context`` (sought: the model's limit) passes through each split ``--goal quality`` (sought:
        :data:`OFFLOAD_CTX`) would take, and offers at least the context that one holds."""
        floor = self.new_tokens + 1
        out = [self.target]
        c = 1 << max(self.target - 1, 1).bit_length()
        while c // 2 >= max(SPLIT_FLOOR, floor):
            c //= 2
            if c < self.target:
                out.append(c)
        return out + ([floor] if floor < out[-1] else [])

    def work(self, ctx: int) -> Workload:
        return Workload(ctx - self.new_tokens, self.new_tokens, self.batch, self.images, self.image_size)

    def _ctx_for(self, est, budget: Budget, placement) -> int | None:
        """The context of a plan: the asked one when it fits, else the largest that does (None: none)."""
        if self.asked and self.search.fits(est, self.work(self.target), budget, placement)[0]:
            return self.target
        limit = self.target if self.asked else self.limit
        return self.search.largest_ctx(est, self.batch, self.new_tokens, budget, limit, placement=placement)[0]

    def try_layout(self, quant: str, kv: str, layout: str, budget: Budget) -> Plan | None:
        search = self.search
        est = search.estimator(quant, kv)
        split: Split | None = None
        if layout != "gpu":
            offload = layout in ("offload", "disk")
            # "auto" balances GPUs by transformers' own share, which can leave a GPU's budget unusable;
            # "sequential" fills them in order, to the budget the search gives each
            strategies = ("auto", "sequential") if len(budget.usable) > 1 else ("auto",)
            # not at the context sought: at the next shorter on the ladder, then as long a context as that
            # split holds (the same ladder for every goal: a goal's search passes where the others stop)
            tries = [(ctx, s) for ctx in self.split_contexts() for s in strategies]
            for ctx, strategy in tries:
                split = search.split(est, self.work(ctx), budget, offload, strategy)
                if split is not None:
                    break
            if split is None or (offload and not split.offloaded) or (layout == "disk"
                                                                      and "disk" not in split.placement.loads.weights):
                return None
        placement = None if split is None else split.placement
        ctx = self._ctx_for(est, budget, placement)
        if ctx is None:
            return None
        ctx = self._verified(est, budget, placement, ctx)
        if ctx is None:
            return None
        return self._plan(quant, kv, layout, est, budget, split, ctx)

    def _verified(self, est, budget: Budget, placement, ctx: int) -> int | None:
        """The context, checked and refined with the exact trace (:meth:`Search.verified_ctx`, as ``fit``
        refines its own). None: not even the shortest fits."""
        limit = self.target if self.asked else self.limit
        return self.search.verified_ctx(est, self.batch, self.new_tokens, budget, ctx, limit, placement)[0]

    def _plan(self, quant: str, kv: str, layout: str, est, budget: Budget, split: Split | None, ctx: int) -> Plan:
        work = self.work(ctx)
        placement = None if split is None else split.placement
        device = self.biggest if split is None else split.placement.loads.main_device
        e = est.estimate(batch=work.batch, prompt=work.prompt, new_tokens=work.new_tokens, exact=True,
                         placement=placement, device=device)
        peaks = self.search.peaks(est, work, placement, exact=True)
        if split is None:
            dmap, where, off = {"": device}, [f"{device}: the whole model"], None
        else:
            loads = placement.loads
            dmap, where = dict(loads.device_map), loads.grouped()
            off = offloaded_layers(placement) if split.offloaded else None
            peaks.update({d: b for d, b in loads.weights.items() if d in ("cpu", "disk")})
        hw = {g.device: g for g in self.hw.gpus}
        tied = est.text_config.get("tie_word_embeddings", est.config.get("tie_word_embeddings", True)) is not False
        speed = decode_bound(e, {d: g.memory_bandwidth for d, g in hw.items()},
                             {d: g.link_bandwidth for d, g in hw.items()}, device=device,
                             unread_embedding_bytes=unread_embedding(e, tied))
        mm = None if split is None else dict(split.max_memory)
        strategy = None if split is None or placement.strategy == "auto" else placement.strategy
        cfg = Configuration(self.source.ref, work, quant=quant, device=device, kv_dtype=kv, attn=self.attn,
                            max_memory=mm, device_map=strategy)  # work carries the images (their flags)
        advice = expandable_advice(est, work) if split is None else None
        env = advice["env"] if advice else {}
        return Plan(quant if quant != "auto" else est.quant.name, kv, self.batch, ctx, self.new_tokens, layout,
                    ctx >= self.target, peaks, dmap, where, mm, speed, e.from_pretrained,
                    env_prefix(env) + cfg.command("check"), hub_ref(self.source), off, e.auto_class, env,
                    advice["saved_bytes"] if advice else None)

    # ------------------------------------------------------------------ the search
    def run(self, seconds: float | None = None) -> PlanResult:
        """The search, bounded (default :data:`SEARCH_SECONDS`): once the time has passed no new fit is
        asked, and in the main thread a timer stops a trace under way too (a Mamba model's reference selective
        scan is a Python loop: minutes for one long trace); the plans found so far are the answer and a note
        says what was not searched."""
        seconds = SEARCH_SECONDS if seconds is None else seconds
        quants = candidate_quants(self.source.config)
        with bounded(self.search, seconds) as stop:
            self._stop = stop
            return self._run(quants, seconds)

    def _run(self, quants: list[str], seconds: float) -> PlanResult:
        by_quant: dict[str, list[Plan]] = {}
        stopped: list[str] = []
        for q in quants:
            if self.progress:
                self.progress(f"plan: searching {q} ({len(by_quant) + 1} of {len(quants)})")
            try:
                by_quant[q] = self._for_quant(q)
            except OutOfTime:
                self._stop()  # first: the timer repeats until stopped (search.bounded)
                by_quant[q] = list(self._found)
                stopped = quants[quants.index(q):]
                break
        self._stop()  # what follows prices only what was found
        plans = _distinct(sorted((p for found in by_quant.values() for p in found), key=_rank(self.goal)))
        result = PlanResult(self.source.name, self.hw, self.buffer, self.goal, self.target, self.asked, plans,
                            [], notes=[])
        if plans:
            result.why = self._why_not_better(plans[0], by_quant)
        else:
            result.shortfall = (f"no plan found within the search's {seconds:g} s" if stopped
                                else self.shortfall(quants[-1]))
        if stopped:
            result.notes.append(f"the search stopped after {seconds:g} s (its bound), in {stopped[0]}: "
                                f"{', '.join(stopped)} searched in part or not at all; give --ctx for a shorter "
                                "search, or check a plan with `vramcal check`")
        if "nf4" in quants:
            result.notes.append("fp4 is not listed: it holds the same bytes as nf4 at a worse precision")
        odd = {p.speed.implausible for p in plans if p.speed.implausible}
        result.notes += sorted(odd)
        if self.asked and self.target > self.limit:
            result.notes.append(f"ctx {self.target} is beyond the model's {self.limit} positions")
        return result

    def _for_quant(self, quant: str) -> list[Plan]:
        """This quantization's plans: per KV dtype, the layouts in order until one reaches the context on
        the GPUs alone (then no offload is tried) or with offload (then no further layout)."""
        out: list[Plan] = []
        self._found = out  # what the search has so far, should its time run out
        for kv in KV_ORDER:
            for layout, budget in self.layouts():
                if kv != "auto" and layout in ("offload", "disk"):
                    break  # an fp8 cache is tried to keep the GPUs alone, not to offload a little less
                try:
                    plan = self.try_layout(quant, kv, layout, budget)
                except UserError as exc:
                    self.why.append(f"{quant}{'' if kv == 'auto' else ' + fp8 KV'} ({layout}): {exc}")
                    plan = None
                if plan is None:
                    continue
                out.append(plan)
                if plan.reaches:
                    break
            on_gpus = [p for p in out if not p.offloaded]
            if not on_gpus or any(p.reaches for p in on_gpus):
                break  # the GPUs alone reach the context, or hold not even the shortest: fp8 changes neither
        return out

    # ------------------------------------------------------------------ what is said
    def _why_not_better(self, best: Plan, by_quant: dict[str, list[Plan]]) -> list[str]:
        """For each quantization of higher precision than the best plan's: why it is not the best."""
        lines = []
        total = sum(self.usable.values())
        for quant, found in by_quant.items():
            est = self.search.estimator(quant)
            name = est.quant.name
            if name == best.quant:
                break
            if found:
                p = found[-1] if found[-1].reaches else max(found, key=lambda x: x.ctx)
                speed = f"{p.tokens_per_s:,.2f} tokens/s at most" if p.tokens_per_s else "speed unknown"
                if not p.reaches:
                    lines.append(f"{name} reaches ctx {p.ctx} at most ({self.target} sought)")
                elif p.offloaded:
                    lines.append(f"{name} fits only with offload ({p.offloaded_layers} in RAM): {speed}")
                elif self.goal == "speed":
                    lines.append(f"{name} fits on the GPUs too, slower: {speed}")
                elif self.goal == "context":
                    lines.append(f"{name} fits on the GPUs too, with a shorter context: ctx {p.ctx:,} at most")
                continue
            w = est.inv.tensor_bytes
            room = total + self.ram + (self.hw.disk_bytes or 0)
            if w > total:
                lines.append(f"{name} needs {fmt_gib_gb(w)} of weights: more than the GPUs' {fmt_gib_gb(total)} "
                             "(after the buffer)" + (f" and the {fmt_gib_gb(room - total)} of RAM and disk together"
                                                     if room > total and w > room else
                                                     "" if room > total else ", and no RAM was given for offload"))
            else:
                lines.append(f"{name}: no split fits at ctx {self.target} x batch {self.batch} (the cache, the "
                             "activations and the offload copy come on top of the weights)")
        return lines

    def shortfall(self, quant: str) -> str:
        """What is missing for the smallest quantization at the shortest context: GPU memory for a plain load,
        or, with offload, RAM (the split with unbounded RAM) -- whichever the machine could add."""
        est = self.search.estimator(quant)
        work = self.work(min(self.target, max(self.new_tokens + 1, 1024)))
        one = self.search.peaks(est, work)[self.biggest]
        more_gpu = one - self.usable[self.biggest]
        parts = [f"{est.quant.name} at ctx {work.ctx} x batch {self.batch} needs {fmt_gib_gb(more_gpu)} more on "
                 f"{self.biggest} (its peak {fmt_gib_gb(one)} on one GPU)"]
        try:
            split = self.search.split(est, work, Budget(dict(self.usable), UNBOUNDED))
        except UserError:
            split = None
        if split is not None and split.offloaded:
            need = split.placement.loads.weights.get("cpu", 0)
            parts.append(f"or {fmt_gib_gb(max(need - self.ram, 0))} more RAM "
                         f"(offload holds {fmt_gib_gb(need)} there; {fmt_gib_gb(self.ram)} of the RAM given may "
                         "take it, after the buffer)")
        else:
            parts.append("offload does not help: not even the modules that must stay on a GPU fit it")
        return ", ".join(parts)


def _distinct(plans: list[Plan]) -> list[Plan]:
    seen, out = set(), []
    for p in plans:
        key = (p.quant, p.kv_dtype, p.layout, p.ctx, tuple(sorted((p.max_memory or {}).items())))
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def plan_model(model: str, hardware, *, buffer: int, batch: int = 1, new_tokens: int = NEW_TOKENS,
               ctx: int | None = None, goal: str = "quality", db: str | None = None, attn: str = "auto",
               this_machine: bool = False, progress=None, images: int = 0, image_size=None) -> PlanResult:
    """The plans for ``model`` on ``hardware`` (:mod:`vramcal.probes.hardware`). On this machine, its
    recorded corrections (else its class's) per device are applied; a described machine has none."""
    from ..estimator.resolve import resolve_model
    from .search import stored_corrections

    source = resolve_model(model)
    notes: list[str] = []
    corrections = None
    if this_machine:
        from ..probes.machine import machine_fingerprint

        gpus = [g.device for g in hardware.gpus]
        biggest = max(hardware.gpus, key=lambda g: g.memory_bytes).device  # the plain load's GPU (Planner's)
        corrections, notes = stored_corrections(db, machine_fingerprint(biggest), source,
                                                candidate_quants(source.config), biggest, gpus)
    else:
        notes.append("no correction applied: a described machine (--hardware) has no runs of its own")
    planner = Planner(source, hardware, buffer=buffer, batch=batch, new_tokens=new_tokens, ctx=ctx, goal=goal,
                      corrections=corrections, attn=attn, progress=progress, images=images, image_size=image_size)
    out = planner.run()
    out.notes = notes + list(hardware.notes) + out.notes + planner.search.notes + [w for w in planner.why
                                                                               if w not in out.why]
    return out
