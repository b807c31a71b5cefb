"""Placement: which module goes to which device when a model is split across GPUs, CPU and disk, and
what each device then holds at every stage (docs/placement.md).

The module -> device map is the installed transformers' own: :func:`plan_placement` builds the same meta
model the inventory builds (:func:`~vramcal.estimator.meta.build_meta_model`) and calls the public
functions of ``transformers.integrations.accelerate`` in the order ``from_pretrained`` calls them for
``device_map="auto"|"balanced"|"balanced_low_0"|"sequential"`` with ``max_memory``: ``get_balanced_memory``
(or ``get_max_memory`` for ``sequential``), the quantizer's ``adjust_max_memory`` (bitsandbytes keeps
10 % back), ``infer_auto_device_map``, then the quantizer's ``validate_environment``, which refuses
bitsandbytes modules on cpu / disk. So balancing, no-split module classes, tied parameters and the
quantizer's 0.5 / 1 byte per quantized element are this version's.

Why this runs for GPUs the machine does not have: with an explicit ``max_memory``, accelerate's
``get_max_memory`` keeps the integer (GPU) keys it was given and only logs "Device N is not available";
transformers' ``get_max_memory`` adds the caching allocator's reserved-but-unused memory of each GPU,
which is 0 before the process has allocated anything (and 0 where CUDA is absent). Nothing else in the
computation asks the hardware. So the function is called as is, with the devices the user named; only
the "not available" log line is silenced.

Weights per device are the inventory's own tensor bytes
(:func:`~vramcal.estimator.inventory.count_meta_model` with ``per_tensor``), each tensor sent to a
device by transformers' ``expand_device_map``, the function the loader uses. What each device then
holds at every stage is :func:`vramcal.estimator.stages.placed_stages`.

Nothing here imports torch at import time; a plan is JSON and is cached on disk like the inventory.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict, dataclass, field, replace

from ..errors import UserError
from ..units import fmt_gib_gb, size_option
from ..versions import software_versions
from ..workload import device_name, parse_device
from .cache import load_cached, store_cached
from .dryrun import round_alloc
from .meta import build_meta_model
from .quant import QuantSpec
from .resolve import ModelSource

PLACEMENT_VERSION = 1
DEVICE_MAP_CHOICES = ("auto", "balanced", "balanced_low_0", "sequential")
OFFLOAD_FLAG = "llm_int8_enable_fp32_cpu_offload"
REFUSAL_START = "Some modules are dispatched on the CPU or the disk"


# ----------------------------------------------------------------------------------------- devices

def fmt_size(n: int) -> str:
    return fmt_gib_gb(n) if n >= 10 * 1024**2 else f"{n:,} bytes"


def _key(name) -> int | str:
    """accelerate's key of a device name: ``cuda:0`` -> 0, ``cpu``, ``disk``."""
    return parse_device(name, placement=True, flag="device in --max-memory").accelerate_key


def _device_order(name: str) -> tuple[int, int]:
    return parse_device(name, placement=True).order


def parse_max_memory(text: str) -> dict[str, int]:
    """``cuda:0=24GiB,cuda:1=24GiB,cpu=64GiB,disk=200GiB`` -> ``{"cuda:0": bytes, ...}``, GPUs first by
    index, then cpu, then disk (accelerate's order). One-line UserError for anything else."""
    if not isinstance(text, str) or not text.strip():
        raise UserError("--max-memory is empty: write it like cuda:0=24GiB,cuda:1=24GiB,cpu=64GiB")
    out: dict[str, int] = {}
    for item in text.split(","):
        name, sep, size = item.partition("=")
        if not item.strip() or not sep or not name.strip() or not size.strip():
            raise UserError(f"cannot read {item.strip()!r} in --max-memory: write DEVICE=SIZE, e.g. cuda:0=24GiB")
        dev = str(parse_device(name, placement=True, flag="device in --max-memory"))
        if dev in out:
            raise UserError(f"--max-memory names {dev} twice: give each device once")
        out[dev] = size_option(size, f"--max-memory {dev}")  # never negative: parse_size reads no sign
    return dict(sorted(out.items(), key=lambda kv: _device_order(kv[0])))


def normalise_max_memory(max_memory: dict | str) -> dict[str, int]:
    """``max_memory`` as text or a dict (``{"cuda:0": bytes or "24GiB", 0: ..., "cpu": ...}``) -> the
    canonical ``{"cuda:0": bytes, ...}`` in accelerate's order; one-line UserError otherwise."""
    if isinstance(max_memory, str):
        return parse_max_memory(max_memory)
    out: dict[str, int] = {}
    for k, v in max_memory.items():
        dev = str(parse_device(k, placement=True, flag="device in max_memory"))
        if dev in out:
            raise UserError(f"max_memory names {dev} twice: give each device once")
        if isinstance(v, str):
            v = size_option(v, f"max_memory {dev}")
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise UserError(f"max_memory {dev}: {v!r} is not a byte count")
        out[dev] = v
    return dict(sorted(out.items(), key=lambda kv: _device_order(kv[0])))


# ------------------------------------------------------------------------------------------ the plan

@dataclass
class Placement:
    model: str
    quant: str
    strategy: str  # auto | balanced | balanced_low_0 | sequential
    max_memory: dict[str, int]  # as asked
    effective_max_memory: dict[str, int]  # what infer_auto_device_map was given: balanced, minus the quantizer's share
    device_map: dict[str, str]  # module -> cuda:N | cpu | disk, as the installed transformers computes it
    weights: dict[str, int]  # tensor bytes per device
    alloc_sizes: dict[str, dict[int, int]]  # per device {tensor bytes: how many}, for allocator rounding
    warmup: dict[str, int] | None  # caching_allocator_warmup's per-GPU block; None if not known
    largest_source: dict[str, int]  # largest weight read in 16-bit before bnb quantizes it, per device
    main_device: str  # where cpu / disk modules run (accelerate's main device)
    layers: list[str]  # decoder layers; index = cache layer index
    layer_devices: list[str]  # where each layer's weights are stored
    layer_exec: list[str]  # where each layer runs (cpu / disk layers run on main_device)
    embed_device: str  # execution device of the input embeddings
    lm_head_device: str  # execution device of lm_head (the logits)
    offloaded: dict[str, int]  # map entries on cpu / disk -> tensor bytes, copied to main_device while they run
    offloaded_alloc: dict[str, int]  # the same, each tensor rounded as the caching allocator rounds it
    pcie_bytes_per_token: int  # cpu-held weights copied host -> GPU at every forward (each generated token)
    disk_bytes_per_token: int  # disk-held weights read and copied at every forward
    refused: str | None  # the installed stack's refusal, if from_pretrained would not load this
    alternative: Placement | None = None  # what loads instead of a refused plan
    notes: list[str] = field(default_factory=list)
    software: dict[str, str | None] = field(default_factory=dict)

    # ------------------------------------------------------------------ views
    @property
    def devices(self) -> list[str]:
        """Every device that holds weights or runs something, GPUs first."""
        names = set(self.weights) | set(self.layer_exec) | {self.main_device, self.lm_head_device, self.embed_device}
        return sorted(names, key=_device_order)

    @property
    def gpus(self) -> list[str]:
        return [d for d in self.devices if d.startswith("cuda")]

    @property
    def plain_load(self) -> bool:
        """Everything held and run on one GPU: the plain load (``device_map={"": N}``), the same tensors in the
        same order, so its GPU has the plain estimate's figures, the caching allocator's replay included."""
        return len(self.devices) == 1 and self.devices[0].startswith("cuda")

    @property
    def loads(self) -> Placement:
        """The plan that loads: this one, or the alternative that loads instead of a refused one."""
        return self.alternative if self.refused and self.alternative is not None else self

    def grouped(self) -> list[str]:
        """The map as lines: ``embed_tokens, layers 0–17 → cuda:0``, one line per device."""
        items: dict[str, list[str]] = {}
        for name, dev in self.device_map.items():
            items.setdefault(dev, []).append(name)
        lines = []
        for dev in sorted(items, key=_device_order):
            lines.append(f"{_compress(items[dev], self.layers)} → {dev}")
        return lines

    def to_dict(self) -> dict:
        d = asdict(self)
        d["alloc_sizes"] = {dev: {str(k): v for k, v in s.items()} for dev, s in self.alloc_sizes.items()}
        if self.alternative is not None:
            d["alternative"] = self.alternative.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Placement:
        d = dict(d)
        d["alloc_sizes"] = {dev: {int(k): v for k, v in s.items()} for dev, s in d["alloc_sizes"].items()}
        if d.get("alternative") is not None:
            d["alternative"] = cls.from_dict(d["alternative"])
        return cls(**d)


def _compress(names: list[str], layers: list[str]) -> str:
    """``model.layers.0 … model.layers.17, model.norm`` -> ``layers 0–17, norm``."""
    index = {n: i for i, n in enumerate(layers)}
    parts: list[str] = []
    run: list[int] = []

    def flush():
        if run:
            parts.append(f"layer {run[0]}" if len(run) == 1 else f"layers {run[0]}–{run[-1]}")
            run.clear()

    for name in names:
        i = index.get(name)
        if i is not None and (not run or i == run[-1] + 1):
            run.append(i)
            continue
        flush()
        if i is not None:
            run.append(i)
            continue
        parent = next((j for n, j in index.items() if name.startswith(n + ".")), None)
        label = f"layer {parent} {name.split('.', len(layers[parent].split('.')))[-1]}" if parent is not None \
            else _short(name)
        parts.append(label)
    flush()
    return ", ".join(parts)


def _short(name: str) -> str:
    if name == "":
        return "everything"
    for prefix in ("model.language_model.", "model.", "transformer."):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def plan_placement(source: ModelSource, quant: QuantSpec, max_memory: dict | str, device_map: str = "auto", *,
                   use_cache: bool = True) -> Placement:
    """The placement ``from_pretrained(source, device_map=device_map, max_memory=max_memory,
    quantization_config=quant)`` computes with the installed transformers, with per-device weights.

    ``max_memory``: ``{"cuda:0": bytes, "cpu": bytes, "disk": bytes}`` (or the ``--max-memory`` text).
    UserError: unknown strategy, a quantization placement cannot model, no GPU named, a budget in which
    no decoder layer fits on any GPU, or modules that would spill to a disk the user did not name."""
    if device_map not in DEVICE_MAP_CHOICES:
        raise UserError(f"unknown --device-map {device_map!r}: choose one of {', '.join(DEVICE_MAP_CHOICES)}")
    mm = normalise_max_memory(max_memory)
    if not any(d.startswith("cuda") for d in mm):
        raise UserError("--max-memory names no GPU: give at least one cuda:N=SIZE (the CPU path runs unplaced)")
    if quant.method not in ("none", "bnb4", "bnb8"):
        raise UserError(f"placement (--max-memory / --device-map) is not modelled yet for {quant.implementation}: "
                        "vramcal places 16/32-bit and bitsandbytes models; drop --max-memory to price it on one GPU")
    key = replace(quant, name=f"{quant.name}|placement|{device_map}|"
                              + ",".join(f"{k}={v}" for k, v in mm.items()))
    if use_cache:
        cached = load_cached(source, key, kind="placement")
        if cached is not None and cached.get("version") == PLACEMENT_VERSION:
            return Placement.from_dict(cached["placement"])
    plan = _compute(source, quant, mm, device_map)
    if use_cache:
        store_cached(source, key, {"version": PLACEMENT_VERSION, "placement": plan.to_dict()}, kind="placement")
    return plan


def _compute(source: ModelSource, quant: QuantSpec, mm: dict[str, int], strategy: str) -> Placement:
    import logging

    model, hf_quantizer, dtype = build_meta_model(source, quant)
    accel_mm = {_key(k): v for k, v in mm.items()}
    quiet = logging.getLogger("accelerate.utils.modeling")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # "Device N is not available": the point of planning for absent GPUs
    try:
        effective, accel_map = _device_map(model, strategy, accel_mm, hf_quantizer)
    finally:
        quiet.setLevel(level)
    refused = None
    if hf_quantizer is not None:
        try:
            hf_quantizer.validate_environment(device_map=dict(accel_map))
        except ValueError as exc:
            if not str(exc).startswith(REFUSAL_START):
                raise UserError(f"transformers cannot place {source.name}: {str(exc).splitlines()[0]}") from None
            refused = " ".join(str(exc).split(" Check ")[0].split())
    edge_map = {name: device_name(dev) for name, dev in accel_map.items()}
    _check_budget(source, mm, edge_map, model, hf_quantizer)

    plan = _describe(source, quant, model, hf_quantizer, dtype, strategy, mm, effective, accel_map, edge_map)
    if refused is not None:
        plan.refused = refused
        plan.alternative = _alternative(source, quant, strategy, mm, effective, accel_map, edge_map)
    return plan


def _device_map(model, strategy: str, max_memory: dict, hf_quantizer) -> tuple[dict, dict]:
    """(the budgets the map was inferred with, the map), by transformers' public device-map functions in
    the order ``from_pretrained`` calls them for a strategy name."""
    from transformers.integrations.accelerate import get_balanced_memory, get_max_memory, infer_auto_device_map

    no_split = model._no_split_modules
    if strategy != "sequential":
        budgets = get_balanced_memory(model, max_memory=dict(max_memory), no_split_module_classes=no_split,
                                      hf_quantizer=hf_quantizer, low_zero=strategy == "balanced_low_0")
    else:
        budgets = get_max_memory(dict(max_memory))
    if hf_quantizer is not None:
        budgets = hf_quantizer.adjust_max_memory(budgets)
    device_map = infer_auto_device_map(model, max_memory=budgets, no_split_module_classes=no_split,
                                       hf_quantizer=hf_quantizer,
                                       no_placement_params=getattr(model, "_no_placement_params", None))
    return dict(budgets), dict(device_map)


def _check_budget(source: ModelSource, mm: dict[str, int], edge_map: dict[str, str], model, hf_quantizer) -> None:
    layers = decoder_layers(model)
    values = set(edge_map.values())
    gpu_layers = [n for n in layers if _entry_device(n, edge_map).startswith("cuda")]
    if layers and not gpu_layers:
        from transformers.integrations.accelerate import compute_module_sizes

        sizes, _ = compute_module_sizes(model, hf_quantizer)
        one = int(max(sizes.get(n, 0) for n in layers))
        raise UserError(f"{source.name}: no decoder layer fits on {', '.join(d for d in mm if d.startswith('cuda'))} "
                        f"({', '.join(f'{d}={fmt_size(v)}' for d, v in mm.items() if d.startswith('cuda'))}); "
                        f"one layer counts {fmt_size(one)} to transformers, and accelerate keeps room for the largest "
                        "layer free on the first GPU" + (", after bitsandbytes keeps 10 % back" if hf_quantizer else "")
                        + ": give the GPUs more memory")
    if "disk" in values and "disk" not in mm:
        spilled = [n for n, d in edge_map.items() if d == "disk"]
        raise UserError(f"{source.name}: {len(spilled)} module(s) ({_compress(spilled, layers)}) fit in none of "
                        f"{', '.join(mm)}: raise cpu=, or add disk=SIZE to offload them to disk")


def _entry_device(name: str, edge_map: dict[str, str]) -> str:
    """Device of module ``name``: the map entry that is it or its closest parent."""
    probe = name
    while True:
        if probe in edge_map:
            return edge_map[probe]
        if not probe:
            return "cpu"
        probe = probe.rsplit(".", 1)[0] if "." in probe else ""


def decoder_layers(model) -> list[str]:
    """Names of the decoder layers, in order: the ModuleList of no-split blocks with the most entries,
    inside the language model where the model says which it is (a vision tower can have more blocks than
    the decoder: Qwen2.5-VL-7B's 32 against 28)."""
    import torch

    no_split = set(getattr(model, "_no_split_modules", None) or [])
    best: list[str] = []
    within = ""
    if getattr(model.config, "vision_config", None) is not None and hasattr(model, "get_decoder"):
        try:
            decoder = model.get_decoder()
            within = next((n + "." for n, m in model.named_modules() if m is decoder and n), "")
        except (AttributeError, NotImplementedError, TypeError):
            within = ""
    for name, module in model.named_modules():
        if within and not name.startswith(within):
            continue
        if isinstance(module, torch.nn.ModuleList) and len(module) > len(best):
            kids = list(module)
            if not no_split or any(type(k).__name__ in no_split for k in kids):
                best = [f"{name}.{i}" for i in range(len(kids))]
    return best


def _describe(source, quant, model, hf_quantizer, dtype, strategy, mm, effective, accel_map, edge_map) -> Placement:
    from transformers.integrations.accelerate import expand_device_map

    from .inventory import count_meta_model

    per_tensor: list[tuple[str, int]] = []
    inv = count_meta_model(source, quant, model, hf_quantizer, dtype, per_tensor=per_tensor)
    names = [n for n, _ in per_tensor]
    where = expand_device_map(edge_map, names)  # the loader's own rule: tensor -> device
    entry = expand_device_map({k: k for k in edge_map}, names)  # and the map entry it belongs to
    gpus = [k for k in dict.fromkeys(accel_map.values()) if k not in ("cpu", "disk")]
    # accelerate's dispatch_model: main_device = list(set(map values) - {"cpu", "disk"})[0]
    main = device_name(list(set(accel_map.values()) - {"cpu", "disk"})[0]) if gpus else "cpu"
    # dispatch_model(offload_buffers=False), as transformers calls it: an offloaded module's buffers are
    # moved to its execution device for good; only parameters stay on cpu / disk
    buffers = {n for n, _ in model.named_buffers()} if len(set(accel_map.values())) > 1 else set()
    weights: Counter[str] = Counter()
    sizes: dict[str, Counter[int]] = {}
    block: Counter[str] = Counter()
    block_alloc: Counter[str] = Counter()
    for name, b in per_tensor:
        dev = str(where[name])
        if dev in ("cpu", "disk") and name in buffers:
            dev = main
        weights[dev] += b
        sizes.setdefault(dev, Counter())[b] += 1
        if dev in ("cpu", "disk"):
            block[entry[name]] += b
            block_alloc[entry[name]] += round_alloc(b)

    def exec_dev(dev: str) -> str:
        return main if dev in ("cpu", "disk") else dev

    layers = decoder_layers(model)
    layer_devices = [_layer_device(n, names, where) for n in layers]
    module_name = {id(m): n for n, m in model.named_modules()}
    out_emb, in_emb = model.get_output_embeddings(), model.get_input_embeddings()
    lm_head = module_name.get(id(out_emb), "lm_head") if out_emb is not None else ""
    embed = module_name.get(id(in_emb), "") if in_emb is not None else ""

    notes = list(inv.notes)
    for dev, b in weights.items():
        if dev in mm and dev.startswith("cuda") and b > mm[dev]:
            notes.append(f"{dev} holds {fmt_gib_gb(b)} of weights, more than its max_memory {fmt_gib_gb(mm[dev])}: "
                         "transformers sizes quantized weights at 0.5 / 1 byte per element and leaves out their "
                         "quantization state")
    if block:
        notes.append(f"{len(block)} module(s) offloaded: accelerate copies each to {main} while it runs and drops "
                     "the copy after, at every forward pass")
    return Placement(
        model=source.name, quant=quant.name, strategy=strategy, max_memory=dict(mm),
        effective_max_memory={device_name(k): int(v) for k, v in effective.items()},
        device_map=edge_map, weights=dict(weights), alloc_sizes={d: dict(s) for d, s in sizes.items()},
        warmup=_warmup(model, hf_quantizer, edge_map),
        largest_source=_largest_source(model, quant, dtype, edge_map),
        main_device=main, layers=layers, layer_devices=layer_devices,
        layer_exec=[exec_dev(d) for d in layer_devices],
        embed_device=exec_dev(_entry_device(embed, edge_map)), lm_head_device=exec_dev(_entry_device(lm_head, edge_map)),
        offloaded=dict(block), offloaded_alloc=dict(block_alloc),
        pcie_bytes_per_token=sum(b for e, b in block.items() if edge_map[e] == "cpu"),
        disk_bytes_per_token=sum(b for e, b in block.items() if edge_map[e] == "disk"),
        refused=None, notes=notes, software=software_versions())


def _layer_device(layer: str, names: list[str], where: dict) -> str:
    """Where a layer's weights are; for a layer split across devices, where its attention's key
    projection is (the cache is written on the device that computes the keys)."""
    own = [n for n in names if n.startswith(layer + ".")]
    devs = {str(where[n]) for n in own}
    if len(devs) == 1:
        return devs.pop()
    for n in own:
        if re.search(r"\.(k_proj|kv_a_proj\w*|qkv_proj|key)\.", n + "."):
            return str(where[n])
    return str(where[own[0]]) if own else "cpu"


def _warmup(model, hf_quantizer, edge_map) -> dict[str, int] | None:
    """``caching_allocator_warmup``'s block per GPU: ``get_total_byte_count`` over the expanded map."""
    try:
        import torch
        from transformers.integrations.accelerate import expand_device_map
        from transformers.modeling_utils import get_total_byte_count

        expanded = expand_device_map(edge_map, list(model.state_dict().keys()))
        accel = {n: torch.device(d) for n, d in expanded.items() if str(d).startswith("cuda")}
        return {str(dev): int(b) for dev, b in get_total_byte_count(model, accel, hf_quantizer).items()}
    except Exception:  # private API of transformers: its absence only loses this figure
        return None


def _largest_source(model, quant: QuantSpec, dtype, edge_map) -> dict[str, int]:
    """The largest weight bitsandbytes reads in 16-bit before quantizing it, per device (0 without bnb)."""
    out: dict[str, int] = {}
    if quant.method not in ("bnb4", "bnb8") or quant.pre_quantized:
        return out
    from .meta import import_bitsandbytes

    bnb = import_bitsandbytes()
    for name, module in model.named_modules():
        if isinstance(module, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)):
            dev = _entry_device(name, edge_map)
            out[dev] = max(out.get(dev, 0), module.in_features * module.out_features * dtype.itemsize)
    return out


def _alternative(source, quant, strategy, mm, effective, accel_map, edge_map) -> Placement:
    """What loads instead: the same map passed as a custom ``device_map`` with
    ``llm_int8_enable_fp32_cpu_offload=True``. bitsandbytes then leaves every module on cpu / disk
    unconverted (the quantizer adds the map's cpu / disk entries to ``modules_to_not_convert``), so
    they hold the load dtype -- not float32 unless the load dtype is float32."""
    model, hf_quantizer, dtype = build_meta_model(source, quant, device_map=dict(accel_map),
                                                       bnb_extra={OFFLOAD_FLAG: True})
    hf_quantizer.validate_environment(device_map=dict(accel_map))  # as get_hf_quantizer does: must pass now
    plan = _describe(source, quant, model, hf_quantizer, dtype, strategy, mm, effective, accel_map, edge_map)
    plan.strategy = "custom"
    plan.notes.append(f"modules on cpu / disk stay unquantized in {str(dtype).removeprefix('torch.')} "
                      f"({OFFLOAD_FLAG} keeps them out of bitsandbytes' conversion)")
    cpu = plan.weights.get("cpu", 0)
    if "cpu" in mm and cpu > mm["cpu"]:
        plan.notes.append(f"cpu holds {fmt_gib_gb(cpu)} unquantized, more than cpu={fmt_gib_gb(mm['cpu'])}")
    return plan
