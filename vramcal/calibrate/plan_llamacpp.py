"""``plan --engine llama.cpp``: the ``llama-server`` flags for a GGUF (or a folder of its quantizations) on a
machine's GPUs and RAM (docs/plan.md, docs/llamacpp.md).

For each GGUF file (the highest precision first: bits per weight as stored) and each KV cache type pair
(``-ctk/-ctv`` f16, q8_0, q4_0; a quantized V cache with ``-fa on``, as llama.cpp requires), the layout
search of :mod:`vramcal.estimator.llamacpp.fit` finds the most layers on the GPUs (``-ngl``; for a MoE
model ``--n-cpu-moe`` first), the ``-ts`` across several GPUs and the largest ``-c`` up to the model's
``context_length``, every GPU within its memory less the buffer (its buffers and the CUDA context) and the
host buffers within the RAM less the buffer. ``CPU_Mapped`` (the file's range the CPU's tensors span, under
mmap) is counted in RAM: llama.cpp unmaps the rest of the file after loading (llama-model-loader.cpp
``load_all_data``: ``unmap_fragment`` outside ``mmaps_used``), and the CPU reads that range at every
token, so a plan whose mapped range the page cache cannot keep reads it from disk at every token.

Each plan gets a decode bound (:func:`vramcal.estimator.speed.sequential_bound` of
:func:`vramcal.estimator.llamacpp.buffers.token_reads`): the bytes one token reads on each device -- the
weights placed there (a MoE layer's routed experts at ``expert_used_count / expert_count``) and the KV
cache at the planned context -- over each device's memory bandwidth, summed, because llama.cpp runs the
layers one after another.

Ranking (``--goal``): ``quality`` -- reaches the context; the highest bits per weight; the highest KV
precision; then the most on the GPUs; ``context`` -- the longest context, then as ``quality``;
``speed`` -- reaches the context; the highest decode bound; then precision. Layers are sized for the
context sought (``-c``; else 4,096, llama.cpp's own ``--fit`` floor; ``--goal context``: the model's
``context_length``) and then given the largest context they hold; where none holds it, for the powers of
two below, the same points for every goal, so a stronger goal never offers less than a weaker one.
"""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import UserError
from ..estimator.llamacpp.buffers import LlamaArgs, hparams_of, token_reads
from ..estimator.llamacpp.fit import (DEFAULT_BEYOND, MIN_CTX, Beyond, LayoutSearch, ctx_limit, gpu_totals, host_total,
                                      server_argv, split_list)
from ..estimator.llamacpp.gguf_file import GgufModel, gguf_models, read_gguf
from ..estimator.speed import DecodeBound, sequential_bound
from ..units import fmt_gib_gb
from ..workload import GOALS, choice
from .search import SEARCH_SECONDS, OutOfTime

KV_PAIRS = (("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"))  # the KV precision, best first
KV_RANK = {"f32": 0, "f16": 1, "bf16": 1, "q8_0": 2, "q5_1": 3, "q5_0": 3, "iq4_nl": 4, "q4_1": 4, "q4_0": 4}


def bits_per_weight(m: GgufModel) -> float:
    """Bits per stored value over every tensor of the file(s): the precision a GGUF quantization keeps."""
    values = 0
    for t in m.tensors:
        n = 1
        for d in t.shape:
            n *= d
        values += n
    return 8 * m.tensor_bytes / values if values else 0.0


@dataclass
class LlamaPlan:
    file: str
    bits_per_weight: float
    cache_type_k: str
    cache_type_v: str
    ctx_size: int
    n_gpu_layers: int
    n_layer: int  # repeating layers; llama.cpp counts n_layer + 1 with the output layer
    n_cpu_moe: int
    tensor_split: list[int] | None
    reaches: bool
    gpu_bytes: dict[str, int]  # cuda:N -> its buffers + the CUDA context
    host_bytes: int  # every host buffer, CPU_Mapped included
    mapped_bytes: int  # of which the mapped file range (page cache)
    read_bytes: dict[str, int]  # bytes one token reads per device (cuda:N, cpu)
    speed: DecodeBound
    argv: list[str]  # llama-server -m FILE ...
    verify: str  # the vramcal estimate that shows its buffers as llama.cpp will log them

    @property
    def on_gpus(self) -> bool:
        return self.n_gpu_layers >= self.n_layer + 1 and not self.n_cpu_moe

    @property
    def tokens_per_s(self) -> float | None:
        return self.speed.tokens_per_s

    @property
    def command(self) -> str:
        return shlex.join(self.argv)

    def where(self) -> str:
        if self.on_gpus:
            return f"all {self.n_layer + 1} on GPU"
        if self.n_gpu_layers == 0:
            return "none on GPU"
        moe = "" if not self.n_cpu_moe else ", every expert in RAM" if self.n_cpu_moe >= self.n_layer else \
            f", experts of {self.n_cpu_moe} in RAM"
        return f"{self.n_gpu_layers}/{self.n_layer + 1} on GPU{moe}"

    def to_dict(self) -> dict:
        return {"file": self.file, "bits_per_weight": round(self.bits_per_weight, 3),
                "cache_type_k": self.cache_type_k, "cache_type_v": self.cache_type_v, "ctx_size": self.ctx_size,
                "n_gpu_layers": self.n_gpu_layers, "n_layer": self.n_layer, "n_cpu_moe": self.n_cpu_moe,
                "tensor_split": self.tensor_split, "reaches_ctx": self.reaches, "gpu_bytes": self.gpu_bytes,
                "host_bytes": self.host_bytes, "mapped_bytes": self.mapped_bytes,
                "read_bytes_per_token": self.read_bytes, "tokens_per_s": self.tokens_per_s,
                "tokens_per_s_terms": self.speed.terms, "bandwidths": self.speed.bandwidths,
                "tokens_per_s_unknown": self.speed.why_none, "command": self.command, "args": self.argv[1:],
                "estimate_command": self.verify}


@dataclass
class LlamaPlanResult:
    model: str
    hardware: object  # vramcal.probes.hardware.Hardware
    buffer: int
    goal: str
    target_ctx: int
    asked: bool
    files: list[tuple[str, float]]  # (path, bits per weight), the highest first
    plans: list[LlamaPlan]
    why: list[str] = field(default_factory=list)
    shortfall: str | None = None
    notes: list[str] = field(default_factory=list)
    searched_s: float = 0.0
    beyond: Beyond = DEFAULT_BEYOND  # what llama.cpp holds beyond its buffers, as priced in every plan

    def to_dict(self) -> dict:
        hw = self.hardware
        return {"engine": "llama.cpp", "model": self.model, "hardware": hw.sizes(),
                "driver_reserve": hw.reserves(), "hardware_source": hw.source,
                "cpu_bandwidth_bytes_per_s": hw.cpu_bandwidth.bytes_per_s,
                "cpu_bandwidth_source": hw.cpu_bandwidth.source,
                "buffer_bytes": self.buffer, "goal": self.goal, "ctx": self.target_ctx, "ctx_asked": self.asked,
                "files": [{"file": f, "bits_per_weight": round(b, 3)} for f, b in self.files],
                "plans": [p.to_dict() for p in self.plans], "why_nothing_better": self.why,
                "shortfall": self.shortfall, "notes": self.notes, "beyond_buffers": self.beyond.to_dict()}


def _rank(goal: str):
    def short(p: LlamaPlan):
        return (not p.reaches, 0 if p.reaches else -p.ctx_size)

    def precision(p: LlamaPlan):
        return (-p.bits_per_weight, KV_RANK.get(p.cache_type_k, 9) + KV_RANK.get(p.cache_type_v, 9))

    def placement(p: LlamaPlan):
        return (not p.on_gpus, -p.n_gpu_layers, p.n_cpu_moe)

    if goal == "context":
        return lambda p: (-p.ctx_size, *precision(p), *placement(p))
    if goal == "speed":
        return lambda p: (*short(p), -(p.tokens_per_s or 0.0), *precision(p), *placement(p))
    return lambda p: (*short(p), *precision(p), *placement(p), -p.ctx_size)


def plan_llamacpp(spec: str, hardware, *, buffer: int, goal: str = "quality", args: LlamaArgs | None = None,
                  pinned: frozenset[str] = frozenset(), kv_pinned: bool = False, progress=None,
                  seconds: float | None = None, beyond: Beyond = DEFAULT_BEYOND, hub=None) -> LlamaPlanResult:
    """The plans of the module's doc for ``spec`` (a GGUF, a split GGUF's first part, a folder of GGUF files
    or a cached Hub repository of them) on ``hardware`` (:mod:`vramcal.probes.hardware`). ``args``: the
    llama.cpp flags the user gave (kept); ``pinned``: which of them the search must not change (``ctx``,
    ``ngl``, ``moe``, ``split``; ``kv_pinned``: -ctk/-ctv). ``beyond``: what llama.cpp holds beyond its buffers
    on each GPU and in RAM (the defaults, or this machine's runs for a plan of this machine). ``hub``: the
    :class:`~vramcal.estimator.hub.HubOptions` a Hub repository not on this machine is read with (each
    quantization's header by range reads)."""
    choice(goal, GOALS, "--goal")
    base = args or LlamaArgs()
    started = time.monotonic()
    seconds = SEARCH_SECONDS if seconds is None else seconds
    deadline = started + seconds
    gpus = hardware.gpus
    budgets = [g.memory_bytes - buffer for g in gpus]
    short = [g.device for g, b in zip(gpus, budgets) if b <= 0]
    if short:
        raise UserError(f"--buffer {fmt_gib_gb(buffer)} leaves nothing of {', '.join(short)}: give a smaller --buffer "
                        "or more memory")
    if not hardware.cpu_bytes:
        raise UserError("--engine llama.cpp needs the RAM too (--hardware ...,cpu=SIZE): llama.cpp keeps the input "
                        "embeddings, the host buffers and any layer not on a GPU there")
    host_budget = hardware.cpu_bytes - buffer
    if host_budget <= 0:
        raise UserError(f"--buffer {fmt_gib_gb(buffer)} leaves nothing of the RAM ({fmt_gib_gb(hardware.cpu_bytes)})")
    if "split" in pinned and base.tensor_split and len(base.tensor_split) != len(gpus):
        raise UserError(f"-ts {','.join(f'{x:g}' for x in base.tensor_split)} gives {len(base.tensor_split)} shares "
                        f"for the {len(gpus)} GPU(s) of the machine: give one per GPU")

    beside = {str(Path(x.path).expanduser().resolve()): flag for x, flag in ((base.draft, "the draft model (-md)"),
                                                                           (base.mmproj, "the projector (--mmproj)"))
              if x is not None}
    files = [f for f in gguf_models(spec, hub) if str(Path(f).expanduser().resolve()) not in beside]
    if not files:
        raise UserError(f"{spec} holds no GGUF but {' and '.join(beside.values())}: give the model too")
    models = [read_gguf(f, hub=hub) for f in files]
    models.sort(key=lambda m: -bits_per_weight(m))
    name = models[0].name
    notes: list[str] = []
    if len({(m.arch, m.get(".block_count")) for m in models}) > 1:
        notes.append("the GGUF files are not all the same model (architecture or layer count differ): each is "
                     "planned as it is")
    bw = {g.device: g.memory_bandwidth for g in gpus}
    bw["cpu"] = hardware.cpu_bandwidth
    asked = "ctx" in pinned
    kv_pairs = [(base.cache_type_k, base.cache_type_v)] if kv_pinned else list(KV_PAIRS)

    def tick() -> None:
        if time.monotonic() > deadline:
            raise OutOfTime

    plans: list[LlamaPlan] = []
    why: list[str] = []
    by_file: dict[str, list[LlamaPlan]] = {}
    stopped: list[str] = []
    target = 0
    steps = [(m, kv) for m in models for kv in kv_pairs]
    for i, (m, (k, v)) in enumerate(steps, 1):
        limit = ctx_limit(m)
        t = (base.ctx_size or limit) if asked else (limit if goal == "context" else min(MIN_CTX, limit))
        target = max(target, t)
        label = f"{_short(m)} -ctk {k} -ctv {v}"
        if progress:
            progress(f"plan: searching {label} ({i} of {len(steps)})")
        a = replace(base, cache_type_k=k, cache_type_v=v)
        if v not in ("f32", "f16", "bf16") and a.flash_attn != "on":
            if a.flash_attn == "off":
                why.append(f"{label}: a quantized V cache needs flash attention, and -fa off was given")
                continue
            a = replace(a, flash_attn="on")
        try:
            s = LayoutSearch(m, a, budgets, host_budget, pinned=frozenset(pinned - {"ctx"}), tick=tick, beyond=beyond)
            found = s.run(t, t if asked else limit)
        except OutOfTime:
            stopped = [f"{_short(mm)} -ctk {kk}" for mm, (kk, _) in steps[i - 1:]]
            break
        except UserError as exc:
            why.append(f"{label}: {exc}")
            continue
        by_file.setdefault(m.spec, [])
        if found is None:
            continue
        plan = _plan(m, s, found, t, hardware, bw)
        plans.append(plan)
        by_file[m.spec].append(plan)
    plans.sort(key=_rank(goal))
    result = LlamaPlanResult(name, hardware, buffer, goal, target, asked,
                             [(m.spec, bits_per_weight(m)) for m in models], plans, notes=notes, beyond=beyond)
    if plans:
        result.why = _why_not_better(plans[0], models, by_file, goal, budgets, host_budget) + why
    else:
        result.why = why
        result.shortfall = (f"no plan found within the search's {seconds:g} s" if stopped else
                            _shortfall(models[-1], base, budgets, host_budget, gpus, beyond))
    if stopped:
        result.notes.append(f"the search stopped after {seconds:g} s (its bound): {', '.join(stopped)} searched in "
                            "part or not at all; give -c or fewer files for a shorter search")
    if asked and plans and base.ctx_size and base.ctx_size > ctx_limit(models[0]):
        result.notes.append(f"-c {base.ctx_size} is beyond the model's {ctx_limit(models[0])} (context_length): "
                            "llama.cpp runs it, but the model was not trained that long")
    if any(p.n_cpu_moe or p.n_gpu_layers < p.n_layer + 1 for p in plans):
        result.notes.append("RAM counts every host buffer llama.cpp logs, CPU_Mapped (the file's range the CPU's "
                            "tensors span, under mmap) included: the CPU reads it at every token, so it must stay "
                            "in the page cache")
    if base.draft is not None:
        result.notes.append("the draft model (-md) is on the same devices, priced in each plan's GPUs and RAM; the "
                            "decode bound is the target's alone (speculative decoding's speed rests on how many "
                            "drafted tokens are accepted)")
    if base.mmproj is not None:
        result.notes.append("the projector (--mmproj) is priced in each plan: its model buffer from its header on the "
                            "first GPU (the CPU with --no-mmproj-offload), its compute buffer where its warm-up graph "
                            "is replayed (the estimate's notes say where it is not)")
    if any("cpu's memory bandwidth" in (p.speed.why_none or "") for p in plans):
        result.notes.append("a plan with layers or experts in RAM has its decode bound unknown until the RAM's "
                            "bandwidth is given (--bandwidth cpu=RATE)")
    odd = [p.speed.implausible for p in plans if p.speed.implausible]
    if odd:
        result.notes.append(odd[0] + (f" (and {len(odd) - 1} more plan(s) alike)" if len(odd) > 1 else ""))
    result.notes = list(hardware.notes) + result.notes
    result.searched_s = time.monotonic() - started
    return result


def _short(m: GgufModel) -> str:
    return Path(m.path).name


def _plan(m: GgufModel, s: LayoutSearch, found, target: int, hardware, bw) -> LlamaPlan:
    a, e = found.args, found.estimate
    gpus = hardware.gpus
    names = {f"{a.gpu_backend}{i}": g.device for i, g in enumerate(gpus)}
    totals = {names.get(k, k): b for k, b in gpu_totals(e, len(gpus), a.gpu_backend, s.beyond).items()}
    reads = token_reads(m, a)
    read = {("cpu" if d == "CPU" else names.get(d, d)): b for d, b in reads.by_device().items()}
    speed = sequential_bound(read, bw, 1)
    ts = split_list(a)
    argv = server_argv(m, a, s.n_layer)
    rest = argv[1 + len(m.server_model_args()):]
    verify = shlex.join(["vramcal", "estimate", "--engine", "llama.cpp", m.spec, *rest, "--gpu-count", str(len(gpus))])
    return LlamaPlan(m.spec, bits_per_weight(m), a.cache_type_k, a.cache_type_v, a.ctx_size, a.n_gpu_layers,
                     s.n_layer, a.n_cpu_moe, ts, a.ctx_size >= target, totals, host_total(e, s.beyond),
                     e.model_buffer_bytes.get("CPU_Mapped", 0), read, speed, argv, verify)


def _why_not_better(best: LlamaPlan, models: list[GgufModel], by_file: dict[str, list[LlamaPlan]], goal: str,
                    budgets: list[int], host_budget: int) -> list[str]:
    """One line for each file of higher precision than the best plan's: why it is not first."""
    lines = []
    for m in models:
        if m.spec == best.file:
            break
        name = f"{_short(m)} ({bits_per_weight(m):.2f} bits/weight)"
        found = by_file.get(m.spec)
        if found is None:
            continue  # not searched (the time bound)
        if found:
            p = max(found, key=lambda x: (x.reaches, x.tokens_per_s or 0.0, x.ctx_size))
            speed = f"{p.tokens_per_s:,.2f} tokens/s at most" if p.tokens_per_s else "speed unknown"
            if not p.reaches:
                lines.append(f"{name} reaches -c {max(x.ctx_size for x in found):,} at most")
            elif goal == "speed":
                lines.append(f"{name} fits too, slower: {speed} ({p.where()})")
            elif goal == "context":
                lines.append(f"{name} fits too, with a shorter context: -c {max(x.ctx_size for x in found):,} at most")
            continue
        room = sum(budgets) + host_budget
        lines.append(f"{name}: no layout fits at -c 256 -- its {fmt_gib_gb(m.tensor_bytes)} of weights"
                     + (f" are more than the GPUs and the RAM hold together ({fmt_gib_gb(room)}, after the buffer)"
                        if m.tensor_bytes > room else
                        ", the KV, compute and host buffers and the CUDA context do not fit the GPUs and the RAM"))
    return lines


def _shortfall(m: GgufModel, base: LlamaArgs, budgets: list[int], host_budget: int, gpus,
               beyond: Beyond = DEFAULT_BEYOND) -> str:
    """Nothing fits: what the smallest file at the shortest context needs, every layer on the GPUs (GPU memory)
    and every layer in RAM (RAM)."""
    from ..estimator.llamacpp.buffers import estimate_llamacpp

    n_all = hparams_of(m).n_layer + 1
    a = replace(base, n_gpus=len(budgets), ctx_size=256)
    total = sum(budgets)
    shares = tuple(float(b) for b in budgets) if len(budgets) > 1 else None
    on = estimate_llamacpp(m, replace(a, n_gpu_layers=n_all, n_cpu_moe=0, cpu_moe=False, tensor_split=shares))
    off = estimate_llamacpp(m, replace(a, n_gpu_layers=0))
    gpu_need = sum(gpu_totals(on, len(budgets), base.gpu_backend, beyond).values())
    ram_off = host_total(off, beyond)
    parts = [f"{_short(m)} at -c 256 needs {fmt_gib_gb(gpu_need)} on the GPUs with every layer there "
             f"({fmt_gib_gb(max(gpu_need - total, 0))} more than the {fmt_gib_gb(total)} they have after the buffer)"]
    off_totals = gpu_totals(off, len(budgets), base.gpu_backend, beyond)
    over_off = max(off_totals[f"{base.gpu_backend}{i}"] - b for i, b in enumerate(budgets))
    if over_off > 0:
        parts.append(f"and even with -ngl 0 its compute buffer and the CUDA context need {fmt_gib_gb(over_off)} more "
                     f"on {gpus[0].device}")
    else:
        parts.append(f"or {fmt_gib_gb(max(ram_off - host_budget, 0))} more RAM with -ngl 0 (the host buffers "
                     f"{fmt_gib_gb(ram_off)}; {fmt_gib_gb(host_budget)} of the RAM after the buffer)")
    if host_total(on, beyond) > host_budget:
        parts.append(f"(even every layer on the GPUs leaves {fmt_gib_gb(host_total(on, beyond))} in RAM, more than the "
                     f"{fmt_gib_gb(host_budget)} usable)")
    return ", ".join(parts)
