"""Placement: the map is the one the installed transformers computes inside ``from_pretrained``, and the
per-device weights and cache are the bytes of the tensors a real load puts on each device.

Ground truth for the map: a real ``from_pretrained(path, device_map=..., max_memory=..., quantization_config=...)``
on this machine, with a spy on ``transformers.modeling_utils._get_device_map`` that records what the
installed function returned (or raised) and stops the load there (the GPUs named do not exist here, so
the load could not go on). The spy calls the real function; it changes no argument and no result.
For bf16, also ``_get_device_map`` on a model materialised on the CPU with real weights. (A bitsandbytes
model materialised on the CPU has packed 4-bit tensors, which transformers would size differently: the
map ``from_pretrained`` uses is computed before any weight exists, so the spy is the ground truth there.)

Ground truth for bytes: a real CPU load (``device_map="cpu"``, the same quantization); each held tensor
is sent to a device by the plan's map with transformers' ``expand_device_map`` and summed.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import device_key, from_pretrained_map, held_tensors, quantization_config
from transformers import AutoModelForCausalLM
from transformers.integrations.accelerate import _get_device_map, expand_device_map

from vramcal.errors import UserError
from vramcal.estimator.dryrun import DryRunner, cache_keyword, layer_bytes
from vramcal.estimator.inventory import count_meta_model, inventory
from vramcal.estimator.loading import from_pretrained_kwargs
from vramcal.estimator.meta import import_bitsandbytes
from vramcal.estimator.placement import OFFLOAD_FLAG, REFUSAL_START, Placement, parse_max_memory, plan_placement
from vramcal.estimator.quant import resolve_quant
from vramcal.estimator.resolve import resolve_model
from vramcal.estimator.runtime import CUDA_DEFAULT, default_profile
from vramcal.estimator.stages import kv_by_device, placed_stages


ARCHS = ["dense-gqa", "tied", "moe", "sliding"]
QUANTS = ["bf16", "nf4", "int8"]
# budgets as fractions of the model's weight bytes (the inventory's): each one splits the model
BUDGETS = {
    "2gpu-fit": {"cuda:0": 0.8, "cuda:1": 0.8, "cpu": 10.0},
    "2gpu-even": {"cuda:0": 0.45, "cuda:1": 0.45, "cpu": 10.0},
    "2gpu-uneven": {"cuda:0": 0.3, "cuda:1": 0.5, "cpu": 10.0},
    "gpu+cpu": {"cuda:0": 0.5, "cpu": 10.0},
    "gpu+cpu+disk": {"cuda:0": 0.5, "cpu": 0.3, "disk": 10.0},
}


def _deeper(cfg: dict) -> dict:
    """The TINY config with 8 layers and a 256-token vocabulary, so budgets split between layers (with two
    layers and the conftest vocabularies, the embeddings outweigh a layer and little can be split)."""
    cfg = {**cfg, "num_hidden_layers": 8, "vocab_size": 256}
    if "layer_types" in cfg:
        cfg["layer_types"] = (["sliding_attention"] * 3 + ["full_attention"]) * 2
    return cfg


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from conftest import TINY, save_tiny

    root = tmp_path_factory.mktemp("deep")
    return {name: save_tiny(name, _deeper(TINY[name]), root) for name in ARCHS}


def _budget(path: str, quant: str, name: str) -> dict[str, int]:
    source = resolve_model(path)
    total = inventory(source, resolve_quant(quant, source.config)).tensor_bytes
    return {dev: int(f * total) for dev, f in BUDGETS[name].items()}


def _edge(accel_map) -> dict[str, str]:
    return {k: (f"cuda:{v}" if isinstance(v, int) else str(v)) for k, v in accel_map.items()}


def _real_cpu_load(path, spec):
    return AutoModelForCausalLM.from_pretrained(path, device_map="cpu", quantization_config=quantization_config(spec),
                                                dtype=getattr(torch, spec.dtype))


def _bytes_by_device(model, device_map: dict[str, str], main: str | None = None) -> dict[str, int]:
    """Every tensor the loaded model holds (as the probe counts them), summed per device of the plan's map.
    Buffers of cpu / disk modules go to ``main``: accelerate's dispatch (offload_buffers=False) moves them."""
    owner: dict[int, str] = {}
    from vramcal.probes.child import param_tensors

    for name, p in model.named_parameters(remove_duplicate=True):
        for t in param_tensors(p):
            owner.setdefault(t.untyped_storage().data_ptr(), name)
    for name, b in model.named_buffers(remove_duplicate=True):
        owner.setdefault(b.untyped_storage().data_ptr(), name)
    sizes = held_tensors(model)  # {storage pointer: bytes}
    assert set(sizes) == set(owner)
    where = expand_device_map(device_map, sorted(set(owner.values())))
    out: dict[str, int] = {}
    buffers = {n for n, _ in model.named_buffers()}
    for ptr, b in sizes.items():
        dev = str(where[owner[ptr]])
        if main and dev in ("cpu", "disk") and owner[ptr] in buffers:
            dev = main
        out[dev] = out.get(dev, 0) + b
    return out


# --------------------------------------------------------------------------------------- the map

@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_map_is_the_one_from_pretrained_computes(tiny_models, monkeypatch, arch, quant, budget):
    path = tiny_models[arch]
    source = resolve_model(path)
    spec = resolve_quant(quant, source.config)
    mm = _budget(path, quant, budget)
    plan = plan_placement(source, spec, mm, "auto", use_cache=False)
    truth, error, _ = from_pretrained_map(monkeypatch, path, spec, mm)
    assert plan.device_map == _edge(truth)
    assert list(plan.device_map) == list(truth)  # same entries in the same order
    assert len(set(plan.device_map.values())) >= 2, "the budget must split the model"
    offloaded = {"cpu", "disk"} & set(plan.device_map.values())
    if spec.method in ("bnb4", "bnb8") and offloaded:
        assert error is not None and error.startswith(REFUSAL_START)
        assert plan.refused and plan.refused.startswith(REFUSAL_START)
        assert plan.alternative is not None
    else:
        assert error is None and plan.refused is None and plan.alternative is None


@pytest.mark.parametrize("strategy", ["balanced", "balanced_low_0", "sequential"])
@pytest.mark.parametrize("arch", ["dense-gqa", "moe"])
def test_other_strategies(tiny_models, monkeypatch, arch, strategy):
    path = tiny_models[arch]
    source = resolve_model(path)
    spec = resolve_quant("nf4", source.config)
    mm = _budget(path, "nf4", "2gpu-uneven")
    mm["cuda:2"] = mm["cuda:1"]
    plan = plan_placement(source, spec, mm, strategy, use_cache=False)
    truth, error, _ = from_pretrained_map(monkeypatch, path, spec, mm, strategy)
    assert plan.device_map == _edge(truth)
    assert (error is None) == (plan.refused is None)
    assert len(set(plan.device_map.values())) >= 2 and plan.strategy == strategy


@pytest.mark.parametrize("budget", ["2gpu-uneven", "gpu+cpu"])
@pytest.mark.parametrize("arch", ARCHS)
def test_map_equals_materialised_model_bf16(tiny_models, arch, budget):
    """bf16: the same function on a model whose weights are really in memory gives the same map."""
    path = tiny_models[arch]
    source = resolve_model(path)
    spec = resolve_quant("bf16", source.config)
    mm = _budget(path, "bf16", budget)
    plan = plan_placement(source, spec, mm, use_cache=False)
    real = _real_cpu_load(path, spec)
    assert all(p.device.type == "cpu" for p in real.parameters())
    truth = _get_device_map(real, "auto", {device_key(k): v for k, v in mm.items()}, None)
    assert plan.device_map == _edge(truth)


# ------------------------------------------------------------------------------------ the bytes

@pytest.mark.parametrize("budget", ["2gpu-uneven", "gpu+cpu+disk"])
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_weights_per_device_equal_loaded_tensors(tiny_models, arch, quant, budget):
    path = tiny_models[arch]
    source = resolve_model(path)
    spec = resolve_quant(quant, source.config)
    plan = plan_placement(source, spec, _budget(path, quant, budget), use_cache=False)
    real = _real_cpu_load(path, spec)
    truth = _bytes_by_device(real, plan.device_map, plan.main_device)
    assert plan.weights == truth
    assert sum(plan.weights.values()) == inventory(source, spec).tensor_bytes
    assert {d: sum(s * n for s, n in sizes.items()) for d, sizes in plan.alloc_sizes.items()} == plan.weights
    if plan.alternative is not None:
        # what loads instead: GPU modules quantized as before, cpu / disk modules in the load dtype
        alt = plan.alternative
        plain = _bytes_by_device(_real_cpu_load(path, resolve_quant("bf16", source.config)), plan.device_map,
                                 plan.main_device)
        expect = {d: (plain[d] if d in ("cpu", "disk") else truth[d]) for d in truth}
        assert alt.weights == expect
        assert alt.pcie_bytes_per_token == plain.get("cpu", 0)
        assert alt.disk_bytes_per_token == plain.get("disk", 0)


@pytest.mark.parametrize("quant", ["nf4", "int8"])
@pytest.mark.parametrize("arch", ["dense-gqa", "moe"])
def test_alternative_is_what_from_pretrained_builds(tiny_models, monkeypatch, arch, quant):
    """The custom map + flag: from_pretrained accepts it, and the model it builds (before loading weights)
    converts exactly the modules vramcal's alternative converts -- counted, it gives the same bytes."""
    path = tiny_models[arch]
    source = resolve_model(path)
    spec = resolve_quant(quant, source.config)
    plan = plan_placement(source, spec, _budget(path, quant, "gpu+cpu"), use_cache=False)
    assert plan.refused and plan.alternative is not None
    alt = plan.alternative
    kwargs = from_pretrained_kwargs(spec, "cuda:0", plan)  # what vramcal tells a user to load with
    assert kwargs["quantization_config"][OFFLOAD_FLAG] is True and "max_memory" not in kwargs
    custom = kwargs["device_map"]
    assert custom == {k: device_key(v) if v.startswith("cuda") else v for k, v in alt.device_map.items()}
    got_map, error, model = from_pretrained_map(monkeypatch, path, spec, None, device_map=custom,
                                                 **{OFFLOAD_FLAG: True})
    assert error is None and got_map == custom
    bnb = import_bitsandbytes()
    for name, module in model.named_modules():
        entry = expand_device_map(alt.device_map, [name + ".x"])[name + ".x"] if name else None
        if entry in ("cpu", "disk"):
            assert not isinstance(module, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)), name
    per_tensor: list[tuple[str, int]] = []
    count_meta_model(source, spec, model, model.hf_quantizer if hasattr(model, "hf_quantizer") else None,
                     getattr(torch, spec.dtype), per_tensor=per_tensor)
    where = expand_device_map(alt.device_map, [n for n, _ in per_tensor])
    buffers = {n for n, _ in model.named_buffers()}
    by_dev: dict[str, int] = {}
    for n, b in per_tensor:
        dev = str(where[n])
        dev = alt.main_device if dev in ("cpu", "disk") and n in buffers else dev
        by_dev[dev] = by_dev.get(dev, 0) + b
    assert by_dev == alt.weights


@pytest.mark.parametrize("arch", ARCHS)
def test_kv_per_device_equals_real_cache(tiny_models, arch):
    """The cache of layer i lives where layer i runs: the dry run's per-layer bytes, grouped by the plan,
    equal a real cache's per-layer bytes grouped the same way; the plan's layers are the cache's layers."""
    from transformers import DynamicCache

    path = tiny_models[arch]
    source = resolve_model(path)
    spec = resolve_quant("bf16", source.config)
    plan = plan_placement(source, spec, _budget(path, "bf16", "2gpu-uneven"), use_cache=False)
    assert len(set(plan.layer_exec)) == 2
    tokens = 12
    kv = DryRunner(source, spec).kv_layers()
    estimated = kv_by_device(plan, [layer.bytes_at(tokens, 1) for layer in kv])
    real = _real_cpu_load(path, spec)
    cache = DynamicCache(config=real.config)
    with torch.no_grad():
        real(input_ids=torch.zeros(1, tokens, dtype=torch.long), use_cache=True, **{cache_keyword(real): cache})
    assert len(cache.layers) == len(plan.layers) == len(kv)
    truth: dict[str, int] = {}
    for dev, layer in zip(plan.layer_exec, cache.layers):
        truth[dev] = truth.get(dev, 0) + layer_bytes(layer)
    assert estimated == truth


# ------------------------------------------------------------------------------- stages and cache

def test_device_stages_offload(tiny_models):
    path = tiny_models["dense-gqa"]
    source = resolve_model(path)
    spec = resolve_quant("bf16", source.config)
    plan = plan_placement(source, spec, _budget(path, "bf16", "gpu+cpu"), use_cache=False)
    assert "cpu" in plan.weights and plan.pcie_bytes_per_token == plan.weights["cpu"]
    n = len(plan.layers)
    st = placed_stages(plan, kv_prompt=[100] * n, kv_end=[200] * n, prefill_extra=1000, decode_extra=10,
                       on_the_fly=False, runtime=default_profile)
    gpu, cpu = st["cuda:0"], st["cpu"]
    assert gpu.components["kv_cache"] == 200 * n  # offloaded layers run, and keep their cache, on cuda:0
    assert gpu.components["offload_transient"] == max(plan.offloaded_alloc.values()) > 0
    assert gpu.stages["end"] >= gpu.stages["first_token"] >= gpu.stages["post_load"]
    assert cpu.stages["end"] == cpu.components["weights"] == plan.weights["cpu"]
    # what is physically there at the end: weights, the whole cache, the copied block and the CUDA context
    assert gpu.peak >= plan.weights["cuda:0"] + 200 * n + gpu.components["offload_transient"] + CUDA_DEFAULT.context_bytes
    # the runtime is the CUDA context, the workspace and at most 511 bytes of rounding per tensor held
    tensors = sum(plan.alloc_sizes["cuda:0"].values())
    assert 0 <= gpu.components["runtime"] - CUDA_DEFAULT.context_bytes - CUDA_DEFAULT.workspace_bytes <= 511 * tensors


def test_grouped_lines(tiny_models):
    path = tiny_models["sliding"]
    source = resolve_model(path)
    plan = plan_placement(source, resolve_quant("bf16", source.config), _budget(path, "bf16", "2gpu-even"),
                          use_cache=False)
    lines = plan.grouped()
    assert len(lines) == len(set(plan.device_map.values()))
    assert lines[0].endswith("→ cuda:0") and "layers 0–" in "".join(lines) or "layer 0" in "".join(lines)


def test_cached_plan_round_trips(tiny_models):
    path = tiny_models["moe"]
    source = resolve_model(path)
    spec = resolve_quant("nf4", source.config)
    mm = _budget(path, "nf4", "gpu+cpu")
    first = plan_placement(source, spec, mm)
    again = plan_placement(source, spec, mm)  # from disk
    assert again == first and again.alternative == first.alternative
    assert Placement.from_dict(first.to_dict()) == first


def test_cached_plan_needs_no_torch(tiny_models, tmp_path):
    import json
    import os
    import subprocess
    import sys

    path = tiny_models["dense-gqa"]
    source = resolve_model(path)
    spec = resolve_quant("nf4", source.config)
    mm = _budget(path, "nf4", "2gpu-even")
    plan_placement(source, spec, mm)
    code = ("import sys, json\nfrom vramcal.estimator.resolve import resolve_model\n"
            "from vramcal.estimator.quant import resolve_quant\nfrom vramcal.estimator.placement import plan_placement\n"
            f"s = resolve_model({path!r}); p = plan_placement(s, resolve_quant('nf4', s.config), {mm!r})\n"
            "print(json.dumps({'torch': 'torch' in sys.modules, 'map': p.device_map}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ),
                         check=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["torch"] is False and got["map"]


# ------------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("text", ["", "cuda:0", "gpu0=24GiB", "cuda:0=24GiB,cuda:0=20GiB", "cuda:0=24GiB,0=1GiB",
                                  "cuda:0=nan", "cuda:0=-1GiB", "cuda:0=24XB", "cuda:0=24GiB,,cpu=1GiB", "mps=8GiB",
                                  "cuda:0=inf", "cuda:x=1GiB"])
def test_bad_max_memory(text):
    with pytest.raises(UserError) as exc:
        parse_max_memory(text)
    assert "\n" not in str(exc.value)


def test_parse_max_memory_forms():
    assert parse_max_memory("cpu=64GiB, cuda:1=24GB,0=1GiB,disk=1TiB") == {
        "cuda:0": 1024**3, "cuda:1": 24 * 1000**3, "cpu": 64 * 1024**3, "disk": 1024**4}


def test_bad_plans(tiny_models):
    path = tiny_models["dense-gqa"]
    source = resolve_model(path)
    spec = resolve_quant("nf4", source.config)
    with pytest.raises(UserError, match="no GPU"):
        plan_placement(source, spec, {"cpu": 10**9}, use_cache=False)
    with pytest.raises(UserError, match="device-map"):
        plan_placement(source, spec, {"cuda:0": 10**9}, "fastest", use_cache=False)
    with pytest.raises(UserError, match="no decoder layer fits"):
        plan_placement(source, spec, {"cuda:0": 1000, "cpu": 10**9}, use_cache=False)
    mm = _budget(path, "nf4", "gpu+cpu")
    mm["cpu"] = mm["cuda:0"] // 10
    with pytest.raises(UserError, match="add disk=SIZE"):
        plan_placement(source, spec, mm, use_cache=False)
    with pytest.raises(UserError, match="not modelled"):
        plan_placement(source, replace(spec, method="gptq", implementation="GPTQ"), {"cuda:0": 10**9},
                       use_cache=False)
