"""``vramcal plan``: every plan is one the estimator, transformers and the command line agree on.

Ground truth for a plan's map: the installed ``from_pretrained`` given the plan's own arguments, stopped
by the spy right after it computed its device map (tests/helpers.py). Ground truth for "fits": the
estimate of the plan's configuration, priced again from scratch with its own quant, KV dtype, context,
batch and ``max_memory`` in bytes. The machines are described (``--hardware``) in sizes made from the
model's own figures, so each case has a known answer.
"""

from __future__ import annotations

import json
import shlex
import os
import subprocess
import sys

import pytest
from helpers import from_pretrained_map

from vramcal import cli
from vramcal.calibrate.plan import plan_model
from vramcal.calibrate.search import Budget, Search
from vramcal.estimator.estimate import estimate
from vramcal.estimator.loading import materialize, python_code
from vramcal.estimator.placement import parse_max_memory, plan_placement
from vramcal.estimator.resolve import resolve_model
from vramcal.estimator.speed import decode_bound
from vramcal.probes.hardware import (Bandwidth, described, find_gpu, link_bandwidth, parse_bandwidth,
                                     parse_hardware, this_machine)
from vramcal.units import GB, GIB, MIB
from vramcal.workload import Workload

VRAMCAL = [sys.executable, "-m", "vramcal"]
BUFFER = 64 * MIB


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """8 layers of 6 MB each and a long position limit: memory, not the model, bounds the context."""
    from conftest import TINY, save_tiny

    return save_tiny("wide", {**TINY["dense-gqa"], "num_hidden_layers": 8, "vocab_size": 256, "hidden_size": 512,
                              "intermediate_size": 1536, "max_position_embeddings": 131072},
                     tmp_path_factory.mktemp("plan"))


def _plain(path, quant="bf16", ctx=256):
    return estimate(path, quant, ctx=ctx)


def _layer_bytes(path, quant="bf16") -> int:
    """One decoder layer's weights: all but the embeddings, norms and buffers, over the 8 layers."""
    e = _plain(path, quant)
    b = e.weights_breakdown
    return (e.components["weights"] - b.get("embeddings", 0) - b.get("norms", 0) - b.get("buffers", 0)) // 8


def _hw(**sizes) -> object:
    return described({k.replace("_", ":"): v for k, v in sizes.items()})


def _strategy(p):
    dm = p.from_pretrained.get("device_map")
    return dm if isinstance(dm, str) and dm != "auto" else None


def _again(path, p):
    """The plan's configuration priced from scratch, as `vramcal estimate` prices it."""
    return estimate(path, p.quant, ctx=p.ctx, batch=p.batch, kv_dtype=p.kv_dtype, new_tokens=p.new_tokens,
                    max_memory=p.max_memory, device_map=_strategy(p) if p.max_memory else None)


def _gpu_peaks(e) -> dict[str, int]:
    if e.devices:
        return {d: v.peak for d, v in e.devices.items() if d.startswith("cuda")}
    return {"cuda:0": e.peak}


# ------------------------------------------------------------------------------- plans hold

@pytest.fixture(scope="module")
def offload_case(wide):
    """One GPU that holds half the bf16 weights beside the rest of a 256-token run; RAM for the rest."""
    e = _plain(wide)
    gpu = e.peak - e.components["weights"] // 2 + BUFFER
    hw = _hw(cuda_0=gpu, cpu=8 * GIB)
    return hw, plan_model(wide, hw, buffer=BUFFER)


def test_every_plan_fed_back_gives_the_same_map_and_fits(wide, offload_case, monkeypatch):
    hw, result = offload_case
    usable = hw.gpus[0].memory_bytes - BUFFER
    assert result.plans and any(p.offloaded for p in result.plans)
    for p in result.plans:
        e = _again(wide, p)
        peaks = _gpu_peaks(e)
        assert all(v <= usable for v in peaks.values()), (p.quant, p.layout, peaks, usable)
        if p.max_memory is not None:
            assert dict(e.placement.loads.device_map) == p.device_map
        # the installed from_pretrained, given the plan's own arguments, computes the plan's map
        got, error, _ = from_pretrained_map(monkeypatch, wide, kwargs=materialize(p.from_pretrained))
        assert error is None
        assert {k: f"cuda:{v}" if isinstance(v, int) else v for k, v in got.items()} == p.device_map
        # and the command that verifies it reads back to the same configuration
        args = cli.build_parser().parse_args(p.command.split()[1:])
        assert (args.quant, args.ctx, args.batch, args.kv_dtype) == (p.quant, p.ctx, p.batch, p.kv_dtype)
        if p.max_memory is not None:
            assert parse_max_memory(args.max_memory) == p.max_memory


def test_each_plan_leaves_nothing_on_the_table(wide, offload_case):
    """12.5 % more context does not fit with the same split; an offloaded plan with one more decoder layer's
    weights on the GPU does not fit either."""
    hw, result = offload_case
    usable = hw.gpus[0].memory_bytes - BUFFER
    source = resolve_model(wide)
    for p in result.plans:
        more = int(p.ctx * 1.125)
        e = estimate(wide, p.quant, ctx=more, kv_dtype=p.kv_dtype, new_tokens=p.new_tokens, max_memory=p.max_memory)
        assert max(_gpu_peaks(e).values()) > usable, (p.quant, p.layout, p.ctx)
        if p.offloaded:
            search = Search(source, device="cuda:0")
            est = search.estimator(p.quant, p.kv_dtype)
            mm = {**p.max_memory, "cuda:0": p.max_memory["cuda:0"] + _layer_bytes(wide, p.quant)}
            plan = plan_placement(source, est.quant, mm)
            layers = lambda pl: sum(d == "cuda:0" for d in pl.loads.layer_devices)  # noqa: E731
            before = plan_placement(source, est.quant, p.max_memory)
            # one more: or, where the map goes from offloading to holding the whole model, two -- while anything
            # is offloaded, accelerate's infer_auto_device_map keeps the largest remaining layer's room on the
            # main GPU, so the last layer in brings the one that room was kept for (a tiny nf4 model: 6 then 8)
            assert layers(plan) == layers(before) + 1 or layers(plan) == len(plan.loads.layers) == layers(before) + 2
            peak = search.peaks(est, Workload(p.ctx - p.new_tokens, p.new_tokens, p.batch), plan, exact=True)
            assert peak["cuda:0"] > usable, (p.quant, p.ctx)


def test_an_asked_context_is_kept_and_the_split_is_tight(wide, offload_case):
    hw, _ = offload_case
    result = plan_model(wide, hw, buffer=BUFFER, ctx=512)
    usable = hw.gpus[0].memory_bytes - BUFFER
    reach = [p for p in result.plans if p.reaches]
    assert reach and all(p.ctx == 512 for p in reach) and all(p.ctx < 512 for p in result.plans if not p.reaches)
    assert {p.quant for p in reach} == {p.quant for p in result.plans}  # each quantization gets there somehow
    assert result.plans[:len(reach)] == reach  # those that reach it come first
    source = resolve_model(wide)
    for p in (p for p in result.plans if p.offloaded):
        search = Search(source, device="cuda:0")
        est = search.estimator(p.quant, p.kv_dtype)
        mm = {**p.max_memory, "cuda:0": p.max_memory["cuda:0"] + _layer_bytes(wide, p.quant)}
        peak = search.peaks(est, Workload(512 - p.new_tokens, p.new_tokens, 1), plan_placement(source, est.quant, mm),
                            exact=True)
        assert peak["cuda:0"] > usable


def test_real_widths_one_more_layer_does_not_fit():
    """Llama-3.1-8B on a described 8 GiB card: every quantization offloads, and each split holds as many
    layers as fit: with one more layer's budget the map takes one more layer and the GPU goes over."""
    hw = _hw(cuda_0=8 * GIB, cpu=64 * GIB)
    result = plan_model("llama-3.1-8b", hw, buffer=GIB, ctx=4096)
    usable = 7 * GIB
    source = resolve_model("llama-3.1-8b")
    search = Search(source, device="cuda:0")
    offloaded = [p for p in result.plans if p.offloaded]
    assert {p.quant for p in offloaded} >= {"bf16", "int8"}
    for p in offloaded:
        est = search.estimator(p.quant, p.kv_dtype)
        e = est.estimate(batch=1, prompt=4096 - 16, new_tokens=16)
        layer = (e.components["weights"] - sum(v for k, v in e.weights_breakdown.items()
                                               if k in ("embeddings", "norms", "buffers"))) // 32
        before = plan_placement(source, est.quant, p.max_memory)
        more = plan_placement(source, est.quant, {**p.max_memory, "cuda:0": p.max_memory["cuda:0"] + layer})
        on_gpu = lambda pl: sum(d == "cuda:0" for d in pl.loads.layer_devices)  # noqa: E731
        assert on_gpu(more) > on_gpu(before)
        peak = search.peaks(est, Workload(4096 - 16, 16, 1), more, exact=True)["cuda:0"]
        assert p.peak_bytes["cuda:0"] <= usable < peak, p.quant


def test_a_model_that_fits_one_gpu_gets_no_offload(wide):
    result = plan_model(wide, _hw(cuda_0=4 * GIB, cpu=8 * GIB), buffer=BUFFER, ctx=1024)
    assert result.plans and not any(p.offloaded or p.max_memory for p in result.plans)
    first = result.plans[0]
    assert (first.quant, first.layout, first.device_map) == ("bf16", "gpu", {"": "cuda:0"})
    assert first.from_pretrained == {"dtype": "bfloat16", "device_map": {"": 0}}
    assert not result.why  # the best precision is the first plan: nothing better to explain


def test_two_gpus_are_both_used_before_any_cpu(wide):
    e = _plain(wide)
    each = e.peak - e.components["weights"] // 2 + e.components["weights"] // 8 + BUFFER
    result = plan_model(wide, _hw(cuda_0=each, cuda_1=each, cpu=8 * GIB), buffer=BUFFER, ctx=256)
    bf16 = [p for p in result.plans if p.quant == "bf16"]
    assert bf16 and not any(p.offloaded for p in bf16)
    assert {"cuda:0", "cuda:1"} <= set(bf16[0].device_map.values()) and "cpu" not in bf16[0].device_map.values()
    assert result.plans[0].quant == "bf16"  # quality: the GPUs alone at full precision come first


def test_nothing_fits_says_what_is_missing_and_exits_1(wide):
    r = subprocess.run(VRAMCAL + ["plan", wide, "--hardware", "cuda:0=300MiB,cpu=8GiB", "--buffer", "0"],
                       capture_output=True, text=True, env={**os.environ})
    assert r.returncode == 1, r.stderr
    assert "nothing fits:" in r.stdout and "more on cuda:0" in r.stdout and "offload does not help" in r.stdout
    source = resolve_model(wide)
    search = Search(source, device="cuda:0")
    assert search.split(search.estimator("nf4-dq"), Workload(241, 16, 1), Budget({"cuda:0": 300 * MIB}, 8 * GIB)) \
        is None


def test_the_goal_orders_the_plans(wide, offload_case):
    hw, quality = offload_case
    speed = plan_model(wide, hw, buffer=BUFFER, goal="speed")
    context = plan_model(wide, hw, buffer=BUFFER, goal="context")
    assert {(p.quant, p.layout) for p in speed.plans} >= {(p.quant, p.layout) for p in quality.plans
                                                          if p.reaches}
    fast = [p.tokens_per_s for p in speed.plans if p.reaches]
    assert fast == sorted(fast, reverse=True)
    assert [p.ctx for p in context.plans] == sorted((p.ctx for p in context.plans), reverse=True)
    # quality: on the GPUs alone where a plan reaches the context, before a better precision offloaded. Asked
    # on a GPU nf4 alone reaches 4,096 tokens on: with the allocator replayed, no plan of offload_case's GPU
    # reaches them, and a plan short of the context ranks by how close it comes, offloaded or not
    nf4 = estimate(wide, "nf4", ctx=4096)
    quality = plan_model(wide, _hw(cuda_0=nf4.peak + BUFFER, cpu=8 * GIB), buffer=BUFFER)
    first = quality.plans[0]
    assert first.reaches and not first.offloaded and first.quant.startswith("nf4"), first
    assert any(p.reaches and p.offloaded and p.quant == "bf16" for p in quality.plans)


# ------------------------------------------------------------------------------- speed bound

def test_decode_bound_is_bytes_over_bandwidth(wide):
    e = _plain(wide)
    bw = Bandwidth(100 * GB, "test")
    one = decode_bound(e, {"cuda:0": bw}, {})
    assert one.tokens_per_s == pytest.approx(100 * GB / (e.components["weights"] + e.components["kv_cache"]))
    source = resolve_model(wide)
    search = Search(source, device="cuda:0")
    est = search.estimator("bf16")
    mm = {"cuda:0": e.components["weights"] // 2, "cpu": 8 * GIB}
    placed = est.estimate(batch=1, prompt=240, new_tokens=16, placement=plan_placement(source, est.quant, mm))
    loads = placed.placement.loads
    link = Bandwidth(10 * GB, "test link")
    off = decode_bound(placed, {"cuda:0": bw}, {"cuda:0": link})
    gpu = placed.devices["cuda:0"].components
    want = (gpu["weights"] + gpu["kv_cache"] + loads.pcie_bytes_per_token) / (100 * GB) \
        + loads.pcie_bytes_per_token / (10 * GB)
    assert off.seconds_per_step == pytest.approx(want) and loads.pcie_bytes_per_token > 0
    unknown = decode_bound(placed, {"cuda:0": bw}, {"cuda:0": Bandwidth(None, "no link reading")})
    assert unknown.tokens_per_s is None and "no link reading" in unknown.why_none


def test_known_gpus_by_the_names_people_type():
    assert find_gpu("RTX 4090").name == "NVIDIA GeForce RTX 4090"
    assert find_gpu("NVIDIA GeForce RTX 4090").bandwidth_gbps == 1008
    assert find_gpu("L4").name == "NVIDIA L4" and find_gpu("L40").name != "NVIDIA L4"
    assert find_gpu("A100 SXM4", 80 * GB).bandwidth_gbps == 2039 and find_gpu("A100 SXM4", 40 * GB).memory_gb == 40
    assert find_gpu("H100", 94 * GB).name == "NVIDIA H100 NVL"  # the memory decides between models
    assert find_gpu("A100", 80 * GB) is None  # two 80 GB A100s (SXM4, PCIe): which one is not guessed
    assert find_gpu("RTX 9999") is None
    assert link_bandwidth(4, 16, "x").bytes_per_s == int(1.969 * 16 * GB)
    assert link_bandwidth(None, 16, "x").bytes_per_s is None


def test_this_machine_reads_free_memory_clocks_and_link(fake):
    fake({0: [10 * GIB]}, total=24 * GIB, gpu_name="NVIDIA GeForce RTX 4090", pcie=(4, 16), memory_clock=(10501, 384))
    hw = this_machine()
    g = hw.gpus[0]
    assert g.memory_bytes == 14 * GIB and g.name == "NVIDIA GeForce RTX 4090"
    assert g.memory_bandwidth.bytes_per_s == 2 * 10501 * 10**6 * 384 // 8 and "NVML" in g.memory_bandwidth.source
    assert g.link_bandwidth.bytes_per_s == int(1.969 * 16 * GB) and hw.cpu_bytes > 0
    fake({0: [0]}, total=24 * GIB, gpu_name="NVIDIA GeForce RTX 4090")  # no clocks, no link: the table's
    g = this_machine().gpus[0]
    assert g.memory_bandwidth.bytes_per_s == 1008 * GB and "specification" in g.memory_bandwidth.source
    fake({0: [0]}, total=24 * GIB, gpu_name="Some Future GPU")  # nowhere: None with the reason, never 0
    g = this_machine(parse_bandwidth("pcie=25GB")).gpus[0]
    assert g.memory_bandwidth.bytes_per_s is None and "not in vramcal's table" in g.memory_bandwidth.source
    assert g.link_bandwidth.bytes_per_s == 25 * GB


def test_json_has_the_documented_fields(wide):
    r = subprocess.run(VRAMCAL + ["plan", wide, "--hardware", "cuda:0=4GiB,cpu=8GiB", "--gpu", "RTX 4090",
                                  "--ctx", "512", "--json"], capture_output=True, text=True, env={**os.environ})
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["hardware"] == {"cuda:0": 4 * GIB, "cpu": 8 * GIB} and d["buffer_bytes"] == 2 * GIB
    p = d["plans"][0]
    for key in ("quant", "kv_dtype", "batch", "ctx", "max_memory", "device_map", "peak_bytes", "tokens_per_s",
                "from_pretrained", "command", "python"):
        assert key in p
    assert p["tokens_per_s"] > 0 and p["peak_bytes"]["cuda:0"] <= 2 * GIB
    assert d["gpus"][0]["memory_bandwidth_bytes_per_s"] == 1008 * GB
    compile(p["python"], "plan", "exec")  # the code a user pastes is Python


def test_python_code_for_an_offloaded_bnb_plan_is_the_custom_map_with_the_flag():
    kwargs = {"dtype": "bfloat16", "device_map": {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": "cpu",
                                                  "model.norm": "cpu", "lm_head": "cpu"},
              "quantization_config": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                                      "bnb_4bit_use_double_quant": False, "bnb_4bit_compute_dtype": "bfloat16",
                                      "llm_int8_enable_fp32_cpu_offload": True}}
    code = python_code("org/model", kwargs)
    assert "llm_int8_enable_fp32_cpu_offload=True" in code and "bnb_4bit_compute_dtype=torch.bfloat16" in code
    assert '"model.layers.1": "cpu",' in code and '"model.layers.0": 0,' in code
    compile(code, "plan", "exec")


# ------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("args", [
    ["--hardware", "cuda:0"], ["--hardware", "cuda:0=24GiB,cuda:0=20GiB"], ["--hardware", "cuda:0=-1GiB"],
    ["--hardware", "cuda:0=0"], ["--hardware", "cpu=64GiB"], ["--hardware", "cuda:0=24XB"],
    ["--hardware", "cuda:0=24GiB", "--goal", "fastest"], ["--hardware", "cuda:0=24GiB", "--gpu", "RTX 9999"],
    ["--hardware", "cuda:0=24GiB", "--gpu", "A100", "--gpu", "H100", "--gpu", "L4"],
    ["--hardware", "cuda:0=24GiB", "--bandwidth", "cuda:0=fast"], ["--hardware", "cuda:0=24GiB", "--bandwidth", "cuda:3=1GB"],
    ["--hardware", "cuda:0=24GiB", "--bandwidth", "pcie=0"], ["--hardware", "cuda:0=1GiB", "--buffer", "1GiB"],
    ["--hardware", "cuda:0=24GiB", "--buffer", "2gb"], ["--hardware", "cuda:0=24GiB", "--ctx", "0"],
    ["--hardware", "cuda:0=24GiB", "--batch", "0"], ["--hardware", "cuda:0=24GiB", "--ctx", "99", "--prompt", "9"],
    ["--gpu", "RTX 4090"],
])
def test_bad_input_is_one_line_and_exit_2(wide, args, capsys):
    rc = cli.main(["plan", wide, *args])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.startswith("vramcal: ") and err.count("\n") == 1, err


def test_no_gpu_here_asks_for_a_description(wide, fake, capsys):
    fake({}, fail_init=True)
    assert cli.main(["plan", wide]) == 2
    assert "describe the machine, e.g. --hardware" in capsys.readouterr().err


def test_hardware_sizes_parse():
    assert parse_hardware("cuda:0=24GiB,cuda:1=12GiB,cpu=64GiB,disk=500GiB") == {
        "cuda:0": 24 * GIB, "cuda:1": 12 * GIB, "cpu": 64 * GIB, "disk": 500 * GIB}
    assert parse_bandwidth("cuda:0=1008GB,pcie=25GB/s") == {"cuda:0": 1008 * GB, "pcie": 25 * GB}


def test_a_vision_language_model_is_planned_with_its_images():
    """SmolVLM-256M with one image in every prompt: the plan's context is the text (the image tokens come on
    top, as in `estimate --images`), it loads through the auto class that builds the checkpoint's class,
    and fed back with its images the estimate fits."""
    hw = _hw(cuda_0=2 * GIB, cpu=8 * GIB)
    result = plan_model("smolvlm-256m", hw, buffer=256 * MIB, ctx=2048, images=1)
    assert result.plans
    p = result.plans[0]
    assert p.auto_class == "AutoModelForImageTextToText" and "AutoModelForImageTextToText" in p.python()
    assert "--images 1" in p.command
    e = estimate("smolvlm-256m", p.quant, ctx=p.ctx, kv_dtype=p.kv_dtype, images=1, max_memory=p.max_memory)
    assert e.image_tokens > 0 and max(_gpu_peaks(e).values()) <= 2 * GIB - 256 * MIB


# ------------------------------------------------------------------------------- --engine vllm

def test_vllm_plans_start_as_the_vllm_engine_says(capsys):
    """plan --engine vllm on two 24 GiB cards: every plan, fed back to the vLLM engine with its own flags,
    starts with its --max-model-len; tensor parallelism only where it divides the heads; the longest
    length one GPU allows is its own largest (a longer one does not start)."""
    from vramcal.calibrate.plan_vllm import plan_vllm
    from vramcal.estimator.vllm.allreduce import Interconnect
    from vramcal.estimator.vllm.engine import VllmArgs, estimate_vllm

    hw = described(parse_hardware("cuda:0=24GiB,cuda:1=24GiB"), ["RTX 4090"])
    r = plan_vllm("llama-3.1-8b", hw)
    assert r.plans and {p.tensor_parallel_size for p in r.plans} == {1, 2}
    assert r.plans[0].reaches and r.plans[0].quantization is None and r.plans[0].kv_cache_dtype == "auto"
    for p in r.plans:
        args = VllmArgs(gpu_memory_utilization=r.utilization, gpu_memory_bytes=24 * GIB,
                        tensor_parallel_size=p.tensor_parallel_size,
                        quantization=p.quantization, kv_cache_dtype=p.kv_cache_dtype, max_model_len=p.max_model_len,
                        vllm_version=r.version,
                        interconnect=Interconnect(p.interconnect, "the plan") if p.interconnect else None)
        assert (p.interconnect == "pcie") is (p.tensor_parallel_size == 2)  # an RTX 4090 pair: PCIe, by its name
        e = estimate_vllm("llama-3.1-8b", args)
        assert e.fits and e.kv_cache_tokens == p.kv_cache_tokens, p
        if not p.reaches:
            longer = estimate_vllm("llama-3.1-8b", VllmArgs(**{**vars(args), "max_model_len": p.max_model_len + 16}))
            assert not longer.fits
        args_line = shlex.split(p.command)[1:]
        assert cli.main(args_line + ["--json"]) == 0
        assert json.loads(capsys.readouterr().out)["vllm"]["kv_cache_tokens"] == p.kv_cache_tokens
    tiny = plan_vllm("llama-3.1-70b", described(parse_hardware("cuda:0=24GiB")))
    assert not tiny.plans and tiny.why_not


@pytest.mark.parametrize("args", [["--engine", "vllm", "--images", "1"], ["--engine", "vllm", "--buffer", "1GiB"],
                                  ["--engine", "vllm", "--gpu-memory-utilization", "1.5"], ["--engine", "tgi"],
                                  ["--gpu-memory-utilization", "0.8"]])
def test_vllm_plan_bad_input(args, capsys):
    rc = cli.main(["plan", "llama-3.1-8b", "--hardware", "cuda:0=24GiB", *args])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1, err


# ------------------------------------------------------------------------------- what review found

def test_a_plain_load_on_another_gpu_loads_there_at_its_bandwidth():
    hw = described(parse_hardware("cuda:0=12GiB,cuda:1=24GiB,cpu=64GiB"), ["RTX 3060", "RTX 4090"])
    p = plan_model("qwen2.5-7b", hw, buffer=2 * GIB, ctx=4096).plans[0]
    assert p.device_map == {"": "cuda:1"} and p.from_pretrained["device_map"] == {"": 1}
    assert "--device cuda:1" in p.command and "cuda:1 memory" in p.speed.bandwidths
    # an untied input embedding is read a row at a time: the bound leaves the table out
    e = estimate("qwen2.5-7b", p.quant, ctx=4096, device="cuda:1")
    read = e.components["weights"] + e.components["kv_cache"] - e.weights_breakdown["embeddings"] // 2
    assert p.tokens_per_s == pytest.approx(1008 * GB / read)


def test_bitsandbytes_offload_to_disk_is_found():
    """transformers sizes offloaded bitsandbytes modules quantized, they load 16-bit: the search gives it
    less cpu= until RAM holds, so the rest goes to disk."""
    hw = _hw(cuda_0=6 * GIB, cpu=8 * GIB, disk=200 * GIB)
    result = plan_model("llama-3.1-8b", hw, buffer=2 * GIB, ctx=4096)
    by = {p.quant: p for p in result.plans}
    assert {"int8", "nf4"} <= set(by)
    for q in ("int8", "nf4"):
        p = by[q]
        assert "disk" in p.device_map.values() and p.peak_bytes["cpu"] <= 6 * GIB and p.peak_bytes["cuda:0"] <= 4 * GIB
        e = estimate("llama-3.1-8b", q, ctx=4096, max_memory=p.max_memory)
        assert e.devices["cuda:0"].peak <= 4 * GIB and e.placement.loads.weights["cpu"] <= 6 * GIB


def test_ram_over_gives_the_gpu_its_room_before_giving_up():
    """70B on 24 GiB and 68 GiB of RAM: the first split leaves GPU room while RAM is over; moving layers
    onto the GPU makes it fit (once it said 0.00 GiB more RAM were missing)."""
    r = plan_model("llama-3.1-70b", _hw(cuda_0=24 * GIB, cpu=68 * GIB), buffer=2 * GIB)
    assert r.plans and r.plans[0].peak_bytes["cpu"] <= 66 * GIB and r.plans[0].peak_bytes["cuda:0"] <= 22 * GIB


def test_three_unequal_gpus_hold_a_70b_nf4_without_offload():
    r = plan_model("llama-3.1-70b", _hw(cuda_0=24 * GIB, cuda_1=24 * GIB, cuda_2=12 * GIB, cpu=160 * GIB),
                   buffer=2 * GIB)
    gpu_only = [p for p in r.plans if p.quant == "nf4" and not p.offloaded and p.kv_dtype == "auto"]
    assert gpu_only and gpu_only[0].reaches
    assert all(v <= 3 * (24 * GIB) // 2 for p in r.plans for d, v in (p.max_memory or {}).items() if d != "cpu")


def test_the_answer_does_not_depend_on_what_the_cache_held(tmp_path, monkeypatch):
    """The largest context is the exact trace's, on a fixed grid (16 tokens below 1024, 64 above): a cold
    cache and one warmed by other estimates give the same plans."""
    hw = _hw(cuda_0=12 * GIB, cpu=32 * GIB)
    monkeypatch.setenv("VRAMCAL_CACHE", str(tmp_path / "cold"))
    cold = [(p.quant, p.kv_dtype, p.layout, p.ctx) for p in plan_model("llama-3.1-8b", hw, buffer=2 * GIB).plans]
    monkeypatch.setenv("VRAMCAL_CACHE", str(tmp_path / "warm"))
    for q in ("int8", "nf4"):
        for ctx in (3000, 6000, 12000, 20000):
            estimate("llama-3.1-8b", q, ctx=ctx)
            estimate("llama-3.1-8b", q, ctx=ctx, kv_dtype="fp8")
    warm = [(p.quant, p.kv_dtype, p.layout, p.ctx) for p in plan_model("llama-3.1-8b", hw, buffer=2 * GIB).plans]
    assert cold == warm


def test_a_model_the_dry_run_cannot_run_is_planned_by_formulas_and_says_so(wide, monkeypatch):
    from vramcal.estimator.dryrun import DryRunner

    def cannot(self, *a, **k):
        raise NotImplementedError("an op the meta device cannot run")

    monkeypatch.setattr(DryRunner, "trace", cannot)
    r = plan_model(wide, _hw(cuda_0=4 * GIB, cpu=8 * GIB), buffer=BUFFER, ctx=512)
    assert r.plans and any("approximate: the dry run cannot run this model here" in n for n in r.notes)


def test_goal_speed_says_why_the_more_precise_are_not_first():
    hw = described(parse_hardware("cuda:0=24GiB,cpu=64GiB"), ["RTX 4090"])
    r = plan_model("qwen2.5-7b", hw, buffer=2 * GIB, goal="speed")
    assert r.plans[0].quant == "nf4-dq"
    assert [w.split()[0] for w in r.why] == ["bf16", "int8", "nf4"] and all("slower" in w for w in r.why)


@pytest.mark.parametrize("args", [["--hardware", "cuda:0=24GiB,disk=500GiB"],
                                  ["--hardware", "cuda:0=24GiB,cpu=1GiB,disk=500GiB"],
                                  ["--hardware", "cuda:0=99999999999999TiB"],
                                  ["--hardware", "cuda:0=24GiB", "--db", "/nonexistent/x.db"]])
def test_more_bad_input(args, capsys):
    rc = cli.main(["plan", "llama-3.2-1b", *args])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1, err


def test_fit_with_offload_finds_contexts_and_says_when_ram_is_short():
    """fit shares plan's search: a map that puts layers in RAM fits when the RAM given holds them (a
    regression once made every offloaded row "none"), and says which device is short when it does not --
    the offloaded nf4 layers stay bf16 in RAM, 4.9 GiB for Llama-3.2-3B beside 1 GiB of GPU."""
    from vramcal.calibrate.fit import fit_contexts

    roomy = fit_contexts("llama-3.2-1b", 24 * GIB, device="cuda", db=None, buffer=2 * GIB, quants=("bf16",),
                         batches=(1,), max_memory="cuda:0=1GiB,cpu=64GiB")
    row = roomy.rows[0]
    assert row.max_ctx is not None and row.error is None
    placed = plan_placement(resolve_model("llama-3.2-1b"), Search(resolve_model("llama-3.2-1b"),
                            device="cuda").estimator("bf16").quant, parse_max_memory("cuda:0=1GiB,cpu=64GiB"))
    assert placed.loads.weights.get("cpu", 0) > 0  # it is an offloaded map indeed
    short = fit_contexts("llama-3.2-3b", 24 * GIB, device="cuda", db=None, buffer=2 * GIB, quants=("nf4",),
                         batches=(1,), max_memory="cuda:0=1GiB,cpu=2GiB")
    assert short.rows[0].max_ctx is None and "cpu holds" in short.rows[0].error
