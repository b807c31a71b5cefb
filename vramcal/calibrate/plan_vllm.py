"""``plan --engine vllm``: the best ``vllm serve`` flags for a machine's GPUs.

vLLM does not offload by default and takes ``--gpu-memory-utilization`` of every GPU of a tensor-parallel
group, so the search is over what changes its memory: the tensor-parallel size (1, 2, 4, ... up to the
GPUs there are, where it divides the attention heads, as vLLM requires), the weights (as stored, or fp8
online for a 16-bit checkpoint) and the KV cache dtype (auto, fp8). Each is priced with the vLLM engine
(:mod:`vramcal.estimator.vllm`, docs/vllm.md): the longest ``--max-model-len`` vLLM starts with at the
utilization, the KV tokens and the concurrency at that length -- what vLLM would log.

A plan reaches the context when vLLM starts with ``--max-model-len`` of the context asked (default: the
model's own limit). Ranking (``--goal``) as for transformers' plans: ``quality`` -- reaches the context,
weights as stored before fp8, the model's own KV dtype, fewer GPUs; ``context`` -- the longest length;
``speed`` -- reaches the context, the highest decode bound (one sequence at that length: each rank reads
its weights and its share of the sequence's cache per token, in parallel; all-reduce not counted).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..errors import UserError
from ..estimator.speed import DecodeBound
from ..units import fmt_gib_gb
from ..workload import GOALS, choice

KV_CHOICES = ("auto", "fp8")


@dataclass
class VllmPlan:
    tensor_parallel_size: int
    quantization: str | None  # None: as stored
    kv_cache_dtype: str
    max_model_len: int  # the longest vLLM starts with (the asked one when that fits)
    reaches: bool
    kv_cache_tokens: int
    max_concurrency: float
    weights_bytes: int  # the limiting rank's
    kv_cache_bytes: int
    tokens_per_s: float | None
    serve: str  # the vllm serve command (with CUDA_VISIBLE_DEVICES where the group is not the first GPUs)
    command: str  # the vramcal estimate that shows its startup
    gpus: list[str] = field(default_factory=list)  # the GPUs it runs on
    gpu_memory_bytes: int = 0  # each GPU's total it is priced at: the smallest of ``gpus``
    interconnect: str | None = None  # tp > 1: nvlink | pcie, as priced (the estimate's methods say why)

    def to_dict(self) -> dict:
        return dict(vars(self))


@dataclass
class VllmPlanResult:
    model: str
    hardware: object
    version: str
    utilization: float
    target_len: int
    asked: bool
    goal: str
    plans: list[VllmPlan]
    why_not: list[str] = field(default_factory=list)  # configurations vLLM would not start
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"engine": "vllm", "model": self.model, "hardware": self.hardware.sizes(),
                "driver_reserve": self.hardware.reserves(), "vllm_version": self.version,
                "gpu_memory_utilization": self.utilization, "max_model_len": self.target_len,
                "max_model_len_asked": self.asked, "goal": self.goal, "plans": [p.to_dict() for p in self.plans],
                "why_not": self.why_not, "notes": self.notes}


def _tp_sizes(gpus: int, heads: int) -> list[int]:
    out, tp = [], 1
    while tp <= gpus:
        if heads % tp == 0:
            out.append(tp)
        tp *= 2
    return out


def _group(gpus: list, tp: int) -> list:
    """The ``tp`` GPUs a tensor-parallel group runs on: the largest (vLLM takes the same share of each, so
    the smallest of the group limits it), in device order. One GPU: the largest there is."""
    ranked = sorted(range(len(gpus)), key=lambda i: (-gpus[i].capacity_bytes, i))
    return [gpus[i] for i in sorted(ranked[:tp])]


def _visible(group: list, gpus: list) -> list[str]:
    """``CUDA_VISIBLE_DEVICES=...`` where the group is not the first GPUs vLLM would take by itself."""
    if [g.device for g in group] == [g.device for g in gpus[:len(group)]]:
        return []
    return ["CUDA_VISIBLE_DEVICES=" + ",".join(g.device.split(":")[1] for g in group)]


def plan_vllm(model: str, hardware, *, ctx: int | None = None, goal: str = "quality", utilization: float | None = None,
              vllm_version: str | None = None, interconnect=None, this_machine: bool = False,
              compile_cache: str | None = None) -> VllmPlanResult:
    """The plans of the module's doc for ``hardware`` (:mod:`vramcal.probes.hardware`). Each tensor-parallel
    size runs on the largest GPUs there are (:func:`_group`), priced on the smallest of them, over
    ``interconnect`` (:class:`~vramcal.estimator.vllm.allreduce.Interconnect`; None: this machine's group
    as NVML says when ``this_machine``, else the GPU name's guess, as the estimate makes it). ``compile_cache``:
    cold | warm, as ``--compile-cache`` (None: not known, a cold start priced)."""
    import shlex

    from ..estimator.resolve import resolve_model
    from ..estimator.vllm.arch import arch_of
    from ..estimator.vllm import versions as V
    from ..estimator.vllm.engine import VllmArgs, estimate_vllm
    from ..probes.hardware import find_gpu
    from ..estimator.vllm.fit import longest
    from ..estimator.vllm.shapes import cached_params

    choice(goal, GOALS, "--goal")
    source = resolve_model(model)
    util = V.default_utilization(V.resolve_version(vllm_version)[0]) if utilization is None else utilization
    gpus = hardware.gpus
    # vLLM's "total" is CUDA's (cudaMemGetInfo): the device's total less the driver's reserve, where known
    size = lambda g: g.capacity_bytes  # noqa: E731
    base = VllmArgs(gpu_memory_utilization=util, gpu_memory_bytes=max(size(g) for g in gpus),
                    vllm_version=vllm_version, compile_cache=compile_cache).validated()
    # the model's limit and heads as vLLM derives them: the config with transformers' defaults filled in
    # (Gemma 3's text config names no max_position_embeddings; its model class says 131072)
    first = estimate_vllm(source, base)
    arch = arch_of(source.config, cached_params(source, first.dtype)[1])
    limit, heads = first.max_model_len, arch.heads
    quants: list[str | None] = [None] if source.config.get("quantization_config") else [None, "fp8"]
    target = ctx if ctx is not None else limit
    notes: list[str] = [n for n in first.notes if n.startswith("--compile-cache")]  # a flag that changed nothing
    plans, why_not, version = [], [], first.version
    for tp in _tp_sizes(len(gpus), heads):
        group = _group(gpus, tp)
        memory = min(size(g) for g in group)
        bandwidth = min(g.memory_bandwidth.bytes_per_s for g in group) \
            if all(g.memory_bandwidth.bytes_per_s for g in group) else None
        env = _visible(group, gpus)
        caps = {g.compute_capability for g in group}  # the fusion and the MXFP4 backend go by it
        capability = caps.pop() if len(caps) == 1 else None
        names = {g.name for g in group}  # vLLM's scheduler defaults and an NVL board's fusion go by it
        name = names.pop() if len(names) == 1 else None
        row = find_gpu(name) if name else None
        name = name if row is not None else None  # one `--gpu` takes: the command prices it so
        # the command carries what it prices: the name, and the capability where the name does not give it
        named = (["--gpu", name] if name else []) + (
            ["--gpu-capability", "%d.%d" % capability]
            if capability is not None and (row is None or row.compute_capability != capability) else [])
        link = interconnect
        if link is None and this_machine and tp > 1:
            from ..probes.hardware import interconnect_here

            link = interconnect_here([int(g.device.split(":")[1]) for g in group])
        if link is None and tp > 1:
            from ..estimator.vllm.allreduce import from_name

            link = from_name(group[0].name)
        if len({size(g) for g in gpus}) > 1:
            notes.append(f"tp {tp}: on {', '.join(g.device for g in group)}, priced at "
                         f"{fmt_gib_gb(memory)} each (vLLM takes {util:g} of every GPU of the group"
                         + (f"; the command sets {env[0]})" if env else ")"))
        for q in quants:
            for kv in KV_CHOICES:
                args = replace(base, tensor_parallel_size=tp, quantization=q, kv_cache_dtype=kv,
                               gpu_memory_bytes=memory, interconnect=link, gpu_capability=capability,
                               gpu_name=name)
                label = f"tp {tp}, weights {q or 'as stored'}, KV {kv}"
                try:
                    fit, est = longest(source, args)
                except UserError as exc:
                    why_not.append(f"{label}: {exc}")
                    continue
                version = est.version
                if not fit.fits or fit.max_model_len <= 0:
                    why_not.append(f"{label}: {fit.note or 'vLLM would not start: no memory is left for the KV cache'}")
                    continue
                length = min(fit.max_model_len, target)
                at = estimate_vllm(source, replace(args, max_model_len=length))
                per_token = at.block_bytes / at.block_size if at.block_size else 0
                speed = bandwidth / (at.weights_bytes + per_token * length) if bandwidth else None
                odd = DecodeBound(speed, None).implausible
                if odd and odd not in notes:
                    notes.append(odd)
                flags = ["--tensor-parallel-size", str(tp), "--max-model-len", str(length),
                         "--gpu-memory-utilization", f"{util:g}"]
                flags += (["--quantization", q] if q else []) + (["--kv-cache-dtype", kv] if kv != "auto" else [])
                hub = (source.config.get("_vramcal_catalog") or {}).get("hub_id") or source.ref
                serve = " ".join(env + [shlex.join(["vllm", "serve", hub, *flags])])
                verify = shlex.join(["vramcal", "estimate", source.ref, "--engine", "vllm", *flags,
                                     *named, "--gpu-memory", str(memory), "--vllm-version", est.version,
                                     *(["--interconnect", est.interconnect] if est.interconnect else []),
                                     *(["--compile-cache", compile_cache] if compile_cache else [])])
                plans.append(VllmPlan(tp, q, kv, length, fit.max_model_len >= target,
                                      at.kv_cache_tokens, at.max_concurrency, at.weights_bytes, at.kv_cache_bytes,
                                      speed, serve, verify, [g.device for g in group], memory, est.interconnect))
    rank = {"quality": lambda p: (not p.reaches, p.quantization is not None, KV_CHOICES.index(p.kv_cache_dtype),
                                  p.tensor_parallel_size, -p.max_model_len),
            "context": lambda p: (-p.max_model_len, p.quantization is not None, KV_CHOICES.index(p.kv_cache_dtype),
                                  p.tensor_parallel_size),
            "speed": lambda p: (not p.reaches, -(p.tokens_per_s or 0.0), p.quantization is not None)}[goal]
    plans.sort(key=rank)
    if not all(g.memory_bandwidth.bytes_per_s for g in gpus):
        notes.append("no memory bandwidth for these GPUs (give --gpu or --bandwidth): the decode bound is unknown")
    notes.append(_total_note(gpus))
    return VllmPlanResult(source.name, hardware, version, util, target, ctx is not None, goal, plans, why_not, notes)


def _total_note(gpus: list) -> str:
    """One line: vLLM's total per GPU is CUDA's, the device's total less the driver's reserve (or not known)."""
    said = []
    for g in gpus:
        r = g.reserve
        if r is None or r.bytes is None:
            said.append(f"{g.device} the total as given (its reserve is not known)")
        else:
            said.append(f"{g.device} less {r.short()}")
    return "vLLM's total is CUDA's, the device's less the driver's reserve: " + ", ".join(said)
