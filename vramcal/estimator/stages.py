"""The stage rules: what one device holds at each stage, from what it stores and runs.

One home for the accounting of docs/accounting.md, used alike by a model on one device and by each
device of a placement (docs/placement.md):

- ``load_peak``   weights (each tensor rounded as the caching allocator rounds it) plus the load's
                  transient -- the largest 16-bit source bitsandbytes reads before quantizing it --
                  or transformers' ``caching_allocator_warmup`` block, whichever is larger;
- ``post_load``   the same reservation: the caching allocator keeps what it reserved;
- ``first_token`` weights as the first forward leaves them (compressed-tensors decompresses its modules
                  then: ``DeviceLoad.run_weights_bytes``) + the cuBLAS workspace + the cache after the
                  prefill + the prefill's transient (+ the largest offloaded block while it runs, on the
                  main device);
- ``end``         the same at the last decode step, with the cache at the end.

On a device with a caching allocator (``RuntimeProfile.keeps_freed``) each stage is the CUDA context
plus the reservation, and reserved is a running peak, so the stages never decrease; elsewhere a stage
is what is allocated at that moment. On the CPU path the resident set has its own model
(:mod:`vramcal.estimator.cpu`).

Three views of the same figures, each with its own rule and none derived from another's remainder:

- ``stages`` / ``allocated``: memory in use and live tensor bytes at each stage;
- ``components``: sizes of the things that take memory -- weights, the cache at the end, the largest
  transient (activations), the offloaded block, and the runtime (CUDA context, the workspace where
  something runs, the allocator's rounding of the weights). Each is never below zero, and they need not
  add up to the peak: the prefill's transient and the end's full cache do not exist at the same moment;
- ``breakdown``: what the peak is made of, from the moment that set it; it adds up to the peak exactly.

``MODEL_IDS`` names the arithmetic per device kind. Bump the id of a kind whenever its figures change:
runs record the id of the estimate they were compared with, and corrections are fitted only from runs
with the current id (docs/calibration.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..workload import STAGES
from .dryrun import round_alloc
from .result import DeviceEstimate
from .runtime import RuntimeProfile

# cuda: stages of the caching allocator, 2 = the allocator replayed (reserved = allocated + the replay's
# slack) where the dry run's events are known; cpu: the resident-set model of docs/cpu-memory.md,
# 2 = dtype conversions found by name (bf16 <-> fp16)
# 3 = weights rewritten by the first forward (compressed-tensors' decompression) held from first_token on
# cuda 4 = the probe's GPU readings compared less the driver's reserve (estimator/capacity.py); runs of 3
# were compared with it included, so their corrections would carry it (about 618 MiB on an H200)
MODEL_IDS = {"cuda": "gpu-stages/4", "cpu": "cpu-rss/3"}


def model_id(device_kind: str) -> str:
    return MODEL_IDS["cpu" if device_kind == "cpu" else "cuda"]


@dataclass(frozen=True)
class DeviceLoad:
    """What one device stores and runs, as the stage rules need it (bytes)."""

    weights_bytes: int  # tensor bytes of the weights stored there
    weights_alloc: int  # the same, each tensor rounded as the caching allocator rounds it
    load_transient: int = 0  # the largest 16-bit source bitsandbytes reads before quantizing it
    warmup: int = 0  # transformers' caching_allocator_warmup block for this device
    runs: bool = True  # a decoder layer or lm_head runs here: workspace and activations
    kv_prompt: int = 0  # the cache of the layers that run here, right after the prefill
    kv_end: int = 0  # ... and at the end
    prefill_extra: int = 0  # the prefill's transient above weights and cache
    decode_extra: int = 0  # the largest decode step's transient
    offload_transient: int = 0  # the largest offloaded block, copied in while it runs (main device)
    # the caching allocator replayed (vramcal.estimator.reserve): reserved at the load's peak and after it,
    # and the slack above allocated at the prefill's and the decode step's peaks; None: segments rounding only
    load_reserved: tuple[int, int] | None = None
    slack: tuple[int, int] | None = None
    # the weights from the first forward on, where it rewrites them (tensor bytes, and rounded); None: as loaded
    run_weights_bytes: int | None = None
    run_weights_alloc: int | None = None


def weights_alloc(alloc_sizes: dict[int, int]) -> int:
    """Weights as the caching allocator holds them: ``{tensor bytes: how many}``, each rounded."""
    return sum(round_alloc(size) * n for size, n in alloc_sizes.items())


def device_stages(device: str, rt: RuntimeProfile, load: DeviceLoad) -> DeviceEstimate:
    """The stage rules for one device (the module's doc)."""
    ws = rt.workspace_bytes if load.runs else 0
    act_p = max(load.prefill_extra, 0) if load.runs else 0
    act_d = max(load.decode_extra, 0) if load.runs else 0
    tr = load.offload_transient
    w = load.weights_alloc
    run_b = load.weights_bytes if load.run_weights_bytes is None else load.run_weights_bytes
    run_w = w if load.run_weights_alloc is None else load.run_weights_alloc
    moments = {  # live bytes at the moment that can set each stage, by part
        "load": {"weights": load.weights_bytes, "load_transient": load.load_transient},
        "prefill": {"weights": run_b, "kv_cache": load.kv_prompt, "activations": act_p,
                    "offload_transient": tr},
        "decode": {"weights": run_b, "kv_cache": load.kv_end, "activations": act_d,
                   "offload_transient": tr},
    }
    allocated = {"load_peak": w + load.load_transient, "post_load": w,
                 "first_token": run_w + ws + load.kv_prompt + act_p + tr,
                 "end": run_w + ws + load.kv_end + act_d + tr}
    reserved = dict(allocated)
    if rt.keeps_freed:
        warm = load.warmup if rt.device_kind == "cuda" else 0
        if load.load_reserved is not None and load.slack is not None:  # the allocator replayed
            load_res = load.load_reserved[0]
            prefill_res = rt.reserve(allocated["first_token"] + load.slack[0])  # segments: whole 2 MiB
            end_res = rt.reserve(allocated["end"] + load.slack[1])
        else:
            load_res = rt.reserve(max(allocated["load_peak"], warm))
            prefill_res, end_res = rt.reserve(allocated["first_token"]), rt.reserve(allocated["end"])
        reserved = {"load_peak": load_res, "post_load": load_res, "first_token": max(load_res, prefill_res)}
        reserved["end"] = max(reserved["first_token"], end_res)
        stages = {"load_peak": rt.context_bytes + load_res, "post_load": rt.context_bytes + load_res}
        ran = rt.context_bytes + (rt.kernels_bytes if load.runs else 0)  # the first forward loads kernels
        stages["first_token"] = ran + max(load_res, prefill_res)
        stages["end"] = max(stages["first_token"], ran + end_res)
        first = "prefill" if prefill_res > load_res else "load"
        setter = {"load_peak": "load", "post_load": "load", "first_token": first,
                  "end": "decode" if ran + end_res > stages["first_token"] else first}
    else:
        stages = {k: rt.context_bytes + v for k, v in allocated.items()}
        setter = {"load_peak": "load", "post_load": "load", "first_token": "prefill", "end": "decode"}
    peak_stage = max(STAGES, key=lambda k: stages[k])
    held = {k: v for k, v in moments[setter[peak_stage]].items() if v}
    breakdown = {"weights": held.get("weights", load.weights_bytes), "kv_cache": 0, "activations": 0, **held}
    breakdown["runtime"] = stages[peak_stage] - sum(breakdown.values())
    components = {"weights": load.weights_bytes, "kv_cache": load.kv_end,
                  "activations": max(act_p, act_d), "offload_transient": tr,
                  "runtime": rt.context_bytes + (rt.kernels_bytes if load.runs else 0) + ws + (w - load.weights_bytes)}
    return DeviceEstimate(device, stages, allocated, components, breakdown, reserved)


def held_only(device: str, weights_bytes: int) -> DeviceEstimate:
    """A device that only holds offloaded weights (``cpu``, ``disk``): the same bytes at every stage."""
    stages = dict.fromkeys(STAGES, weights_bytes)
    return DeviceEstimate(device, stages, dict(stages),
                          {"weights": weights_bytes, "kv_cache": 0, "activations": 0, "offload_transient": 0,
                           "runtime": 0}, {"weights": weights_bytes}, dict(stages))


def kv_by_device(plan, per_layer: list[int]) -> dict[str, int]:
    """Cache bytes per device: layer i's cache lives where layer i runs. A cache whose layer count differs
    from the decoder's is put on the device of lm_head's input (stated in docs/placement.md)."""
    out: dict[str, int] = {}
    if len(per_layer) != len(plan.layer_exec):
        out[plan.lm_head_device] = sum(per_layer)
        return out
    for dev, b in zip(plan.layer_exec, per_layer):
        out[dev] = out.get(dev, 0) + b
    return out


def placed_stages(plan, *, kv_prompt: list[int], kv_end: list[int], prefill_extra: int, decode_extra: int,
                  on_the_fly: bool, runtime, replayed: tuple[tuple[int, int], tuple[int, int]] | None = None
                  ) -> dict[str, DeviceEstimate]:
    """Per-device stages of a placement (a :class:`~vramcal.estimator.placement.Placement` that loads).

    ``kv_prompt`` / ``kv_end``: each cache layer's bytes after the prefill and at the end (list index =
    decoder layer index); ``prefill_extra`` / ``decode_extra``: the dry run's transient peaks, seen on
    every GPU where a decoder layer or lm_head runs (the peak is reached inside one layer); ``on_the_fly``:
    bitsandbytes quantizes while loading; ``runtime(device) -> RuntimeProfile``. The main device also
    holds the largest offloaded block while it runs. cpu and disk hold their offloaded weights.

    ``replayed``: the one-device load's (reserved at the load's peak and after it, slack at the prefill's and
    the decode step's peaks) from the caching allocator's replay, taken by a plan that is that load
    (``plan.plain_load``); any other plan's GPUs are rounded to segments only (a placement is not replayed)."""
    out: dict[str, DeviceEstimate] = {}
    whole = replayed if replayed is not None and plan.plain_load else None
    kvp, kve = kv_by_device(plan, kv_prompt), kv_by_device(plan, kv_end)
    transient = max(plan.offloaded_alloc.values(), default=0)
    runs = set(plan.layer_exec) | {plan.lm_head_device}
    for dev in plan.devices:
        if dev in ("cpu", "disk"):
            out[dev] = held_only(dev, plan.weights.get(dev, 0))
            continue
        load = DeviceLoad(weights_bytes=plan.weights.get(dev, 0),
                          weights_alloc=weights_alloc(plan.alloc_sizes.get(dev, {})),
                          load_transient=plan.largest_source.get(dev, 0) if on_the_fly else 0,
                          warmup=(plan.warmup or {}).get(dev, 0), runs=dev in runs,
                          kv_prompt=kvp.get(dev, 0), kv_end=kve.get(dev, 0),
                          prefill_extra=prefill_extra, decode_extra=decode_extra,
                          offload_transient=transient if dev == plan.main_device else 0,
                          load_reserved=whole[0] if whole else None, slack=whole[1] if whole else None)
        out[dev] = device_stages(dev, runtime(dev), load)
    return out
