"""Tensor parallelism by interconnect (issue 27): vLLM's custom all-reduce, its buffers, what of them the
profile's non-torch figure sees, and the interconnect read through the NVML door or given."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from vramcal.estimator.vllm import allreduce as A
from vramcal.estimator.vllm import versions as V
from vramcal.estimator.vllm.engine import VllmArgs, estimate_vllm

ROOT = Path(__file__).parent.parent
CONFIGS = ROOT / "benchmarks" / "published" / "vllm" / "configs"
GIB, MIB = 1024**3, 1024**2
H100 = int(79.19 * GIB)
NVLINK = A.Interconnect("nvlink", "test")
PCIE = A.Interconnect("pcie", "test")


def _est(**kw):
    base = dict(gpu_memory_bytes=H100, gpu_memory_utilization=0.95, max_model_len=8192, vllm_version="0.19.0",
                tensor_parallel_size=2)
    return estimate_vllm("llama-3.1-8b", VllmArgs(**{**base, **kw}))


def _cli(*argv):
    from vramcal.cli import main

    return main(list(argv))


# ------------------------------------------------------------------ custom all-reduce, as its source says

def test_custom_all_reduce_buffers_per_rank_as_the_source_allocates_them():
    """custom_all_reduce.py: meta_size() + max_size, a registered buffer of max_size (0.27: max(max_size,
    2 MiB all-gather, 16 MiB reduce-scatter)), both cudaMalloc'd; rank_data 8 MiB by torch; max_size 8 MiB."""
    on = A.custom_all_reduce((0, 19, 1), 2, NVLINK)
    assert on.on and on.device_bytes == 8 * MIB + 8 * MIB and on.torch_bytes == 8 * MIB
    assert A.custom_all_reduce((0, 27, 1), 2, NVLINK).device_bytes == 8 * MIB + 16 * MIB
    assert A.custom_all_reduce((0, 19, 1), 8, NVLINK).device_bytes == 16 * MIB  # not by world size


@pytest.mark.parametrize("v, tp, ic, disabled, on, why", [
    ((0, 19, 1), 2, PCIE, False, True, "two PCIe GPUs"),  # two PCIe GPUs with P2P take it
    ((0, 19, 1), 4, PCIE, False, False, "more than two PCIe-only GPUs"),
    ((0, 19, 1), 4, NVLINK, False, True, "NVLink"),
    ((0, 19, 1), 2, A.Interconnect("pcie", "t", p2p=False), False, False, "no P2P"),
    ((0, 19, 1), 3, NVLINK, False, False, "world size 3"),
    ((0, 19, 1), 16, NVLINK, False, False, "world size 16"),  # _SUPPORTED_WORLD_SIZES [2, 4, 6, 8]
    ((0, 27, 1), 16, NVLINK, False, True, "NVLink"),  # ... [2, 4, 6, 8, 16]
    ((0, 19, 1), 2, NVLINK, True, False, "--disable-custom-all-reduce"),
    ((0, 19, 1), 1, NVLINK, False, False, "one GPU"),
])
def test_when_custom_all_reduce_turns_itself_on(v, tp, ic, disabled, on, why):
    car = A.custom_all_reduce(v, tp, ic, disabled)
    assert car.on is on and why in car.why
    assert (car.device_bytes > 0) is on


def test_its_buffers_are_non_torch_only_before_0_11():
    """gpu_worker.py: 0.10.2 takes the init snapshot before init_worker_distributed_environment, 0.11.0 after."""
    car = A.custom_all_reduce((0, 10, 2), 2, PCIE)
    assert car.non_torch_bytes((0, 10, 2)) == 16 * MIB and car.non_torch_bytes((0, 11, 0)) == 0
    base, _ = V.non_torch_default((0, 10, 2), 2, 1, "pcie")
    with_ar, why = V.non_torch_default((0, 10, 2), 2, 1, "pcie", car.non_torch_bytes((0, 10, 2)))
    assert with_ar - base == 16 * MIB and "custom all-reduce's buffers 16 MiB" in why


# ------------------------------------------------------------------ non-torch by interconnect

def test_non_torch_over_pcie_is_the_one_gpu_figure_and_nvlink_the_fitted_one():
    nv = _est(interconnect=NVLINK)
    pc = _est(interconnect=PCIE)
    one, _ = V.non_torch_default((0, 19, 0), 1, 1)
    assert nv.non_torch_bytes == int(2.10 * GIB) and pc.non_torch_bytes == one == int(0.25 * GIB)
    # everything else is the same: the KV memory moves by the difference, on every rank
    assert pc.kv_cache_bytes - nv.kv_cache_bytes == nv.non_torch_bytes - pc.non_torch_bytes
    assert pc.weights_bytes == nv.weights_bytes and pc.kv_cache_tokens > nv.kv_cache_tokens
    assert nv.interconnect == "nvlink" and pc.interconnect == "pcie" and pc.custom_all_reduce is True
    assert "pcie (test)" in pc.methods["interconnect"] and "over PCIe" in pc.methods["non_torch"]


def test_the_nvlink_figure_against_the_published_h100_tp2_log():
    """llm-d-planner's 0.19.0 2x H100 SXM log of Llama-3.1-8B: "non-torch forward increase memory: 2.07GiB";
    the fitted NVLink default is 2.10 (the rows it was fitted to say 2.06-2.21)."""
    log = (ROOT / "benchmarks" / "published" / "vllm" / "logs" /
           "llmd_meta-llama-llama-3-1-8b_-h100-80gb_tp2pp1dp1_8192.log").read_text()
    assert "non-torch forward increase memory: 2.07GiB" in log
    e = _est(gpu_name="NVIDIA H100 80GB HBM3", gpu_capability=(9, 0))
    assert e.interconnect == "nvlink" and "guessed from the GPU's name" in e.methods["interconnect"]
    assert abs(e.non_torch_bytes - 2.07 * GIB) < 0.05 * GIB


def test_without_a_word_on_it_the_estimate_assumes_by_name_then_nvlink_and_says_so():
    assert A.from_name("NVIDIA RTX PRO 6000 Blackwell Workstation Edition").kind == "pcie"
    assert A.from_name("NVIDIA GeForce RTX 4090").kind == "pcie"
    assert A.from_name("NVIDIA H100 PCIe").kind == "pcie"
    assert A.from_name("NVIDIA A100-SXM4-80GB").kind == "nvlink"
    assert A.from_name("NVIDIA H100 NVL").kind == "nvlink"
    assert A.from_name("NVIDIA A100 80GB") is None and A.from_name(None) is None
    e = _est()
    assert e.interconnect == "nvlink" and "not known: NVLink assumed" in e.methods["interconnect"]
    assert _est(tensor_parallel_size=1).interconnect is None  # no all-reduce, nothing assumed
    assert _est(gpu_name="NVIDIA RTX PRO 6000 Blackwell Workstation Edition").non_torch_bytes == int(0.25 * GIB)


# ------------------------------------------------------------------ this machine, through the NVML door

def test_this_machines_interconnect_through_the_nvml_door(fake):
    from fake_nvml import NVMLError_NotSupported

    from vramcal.probes.hardware import interconnect_here

    fake({0: [0], 1: [0]}, p2p={2: 0})  # NVML_P2P_CAPS_INDEX_NVLINK: OK
    ic = interconnect_here([0, 1])
    assert ic.kind == "nvlink" and "GPUs 0,1" in ic.source
    fake({0: [0], 1: [0]}, p2p={2: 5, 0: 0})  # NVLink: NOT_SUPPORTED; READ: OK
    ic = interconnect_here([0, 1])
    assert ic.kind == "pcie" and ic.p2p is True and "P2P reads allowed" in ic.source
    fake({0: [0], 1: [0]}, p2p={2: NVMLError_NotSupported(), 0: 2})  # an NVML error, as vLLM reads it: no NVLink
    ic = interconnect_here([0, 1])
    assert ic.kind == "pcie" and ic.p2p is False and "vLLM reads that as none" in ic.source
    assert A.custom_all_reduce((0, 19, 1), 2, ic).on is False
    fake({0: [0], 1: [0]})  # NVML says nothing on either: not known
    assert interconnect_here([0, 1]) is None
    assert interconnect_here([0, 1, 2]) is None  # fewer GPUs than the group


def test_estimate_on_this_machine_reads_nvml_and_the_flag_wins(fake, capsys):
    fake({0: [0], 1: [0]}, p2p={2: 5, 0: 0}, gpu_name="NVIDIA H100 80GB HBM3")
    args = ("estimate", "llama-3.1-8b", "--engine", "vllm", "--gpu-memory", "79.19GiB", "-tp", "2",
            "--max-model-len", "8192", "--vllm-version", "0.19", "--json", "--no-correction")
    assert _cli(*args) == 0
    v = json.loads(capsys.readouterr().out)["vllm"]
    assert v["interconnect"] == "pcie" and "this machine's GPUs 0,1" in v["methods"]["interconnect"]
    assert v["non_torch_bytes"] == int(0.25 * GIB)
    assert _cli(*args, "--interconnect", "NVLink") == 0
    v = json.loads(capsys.readouterr().out)["vllm"]
    assert v["interconnect"] == "nvlink" and "--interconnect" in v["methods"]["interconnect"]
    assert v["non_torch_bytes"] == int(2.10 * GIB)


@pytest.mark.parametrize("command", [
    ("estimate", "qwen2.5-7b", "--engine", "vllm", "--gpu-memory", "80GiB", "--no-correction", "-tp", "2"),
    ("fit", "qwen2.5-7b", "--engine", "vllm", "--gpu-memory", "80GiB", "--no-correction", "-tp", "2"),
    ("plan", "qwen2.5-7b", "--engine", "vllm", "--hardware", "cuda:0=80GiB,cuda:1=80GiB"),
], ids=lambda c: c[0])
def test_an_unknown_interconnect_is_one_line_and_exit_2(command, capsys):
    rc = _cli(*command, "--interconnect", "infiniband")
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("vramcal: ") and "\n" not in err and "nvlink" in err, err


def test_plan_prices_each_group_over_the_interconnect_given(capsys):
    hw = ("plan", "llama-3.1-8b", "--engine", "vllm", "--hardware", "cuda:0=79.19GiB,cuda:1=79.19GiB",
          "--vllm-version", "0.19", "--ctx", "8192", "--json")
    out = {}
    for link in ("nvlink", "pcie"):
        assert _cli(*hw, "--interconnect", link) == 0
        plans = json.loads(capsys.readouterr().out)["plans"]
        two = next(p for p in plans if p["tensor_parallel_size"] == 2 and p["quantization"] is None
                   and p["kv_cache_dtype"] == "auto")
        assert f"--interconnect {link}" in two["command"]
        out[link] = two["kv_cache_bytes"]
    assert out["pcie"] - out["nvlink"] == int(2.10 * GIB) - int(0.25 * GIB)


def test_plan_prices_the_described_gpus_as_their_estimate_command_does(capsys):
    """plan's described GPUs carry the table's capability and name: two A100s (SM 8.0) over NVLink get no
    fusion workspace and vLLM's A100 scheduler defaults (256 sequences), two H100s (SM 9.0) the 1.5 GiB
    workspace and 1024 sequences, where plan used to assume an SM 9.0 GPU without a name for both. The
    estimate command each plan prints names the GPU and gives the same KV memory."""
    from vramcal.estimator.vllm.engine import VllmArgs, estimate_vllm

    out = {}
    for gpu in ("A100-SXM4-80GB", "H100 80GB HBM3"):
        assert _cli("plan", "llama-3.1-8b", "--engine", "vllm", "--hardware", "cuda:0=80GiB,cuda:1=80GiB", "--gpu",
                    gpu, "--interconnect", "nvlink", "--vllm-version", "0.19", "--ctx", "8192", "--json") == 0
        plans = json.loads(capsys.readouterr().out)["plans"]
        two = next(p for p in plans if p["tensor_parallel_size"] == 2 and p["quantization"] is None
                   and p["kv_cache_dtype"] == "auto")
        out[gpu] = two["kv_cache_bytes"]
        cmd = shlex.split(two["command"])
        assert "--gpu" in cmd and gpu in cmd[cmd.index("--gpu") + 1]
        assert _cli(*cmd[1:], "--json", "--no-correction") == 0
        assert json.loads(capsys.readouterr().out)["vllm"]["kv_cache_bytes"] == two["kv_cache_bytes"]
    # the A100's difference is the workspace it lacks plus its smaller profile (256 sequences, 2048 tokens)
    base = dict(gpu_memory_bytes=80 * GIB, gpu_memory_utilization=0.9, max_model_len=8192, vllm_version="0.19",
                tensor_parallel_size=2, interconnect=NVLINK)
    a100 = estimate_vllm("llama-3.1-8b", VllmArgs(**base, gpu_name="NVIDIA A100-SXM4-80GB", gpu_capability=(8, 0)))
    h100 = estimate_vllm("llama-3.1-8b", VllmArgs(**base, gpu_name="NVIDIA H100 80GB HBM3", gpu_capability=(9, 0)))
    assert (a100.max_num_seqs, h100.max_num_seqs) == (256, 1024)
    assert out["A100-SXM4-80GB"] - out["H100 80GB HBM3"] == a100.kv_cache_bytes - h100.kv_cache_bytes
    assert a100.kv_cache_bytes - h100.kv_cache_bytes - 1536 * MIB == h100.activation_bytes - a100.activation_bytes > 0


@pytest.mark.parametrize("log, tp, ic, logged, why", [
    # 8x L40S, 0.10.2: "Custom allreduce is disabled because it's not supported on more than two PCIe-only GPUs"
    (ROOT / "tests" / "data" / "vllm" / "r001.log", 8, PCIE, "more than two PCIe-only GPUs",
     "more than two PCIe-only GPUs"),
    # 2x A100 80GB without P2P, 0.10.1.1: "... your platform lacks GPU P2P capability or P2P test failed"
    (ROOT / "benchmarks" / "published" / "vllm" / "logs" / "dl22_qwen2-7b_a100-80gb_tp2_u0.5.log", 2,
     A.Interconnect("pcie", "the log", p2p=False), "lacks GPU P2P capability", "no P2P access"),
])
def test_custom_all_reduce_is_off_where_the_published_logs_say_it_is(log, tp, ic, logged, why):
    text = log.read_text()
    assert "Custom allreduce is disabled" in text and logged in text
    car = A.custom_all_reduce((0, 10, 2), tp, ic)
    assert not car.on and why in car.why and car.non_torch_bytes((0, 10, 2)) == 0


def test_the_0_10_pcie_figure_against_the_8x_l40s_log():
    """r001.log (0.10.2, tp 8 over PCIe, custom all-reduce off): "0.21 / 0.18 / 0.17 GiB for non-torch memory"
    per worker; the 0.10 default is 0.20 GiB (no custom all-reduce buffers: off at tp 8 over PCIe)."""
    text = (ROOT / "tests" / "data" / "vllm" / "r001.log").read_text()
    for logged in ("0.21 GiB f", "0.18 GiB f", "0.17 GiB f"):
        assert logged in text
    car = A.custom_all_reduce((0, 10, 2), 8, PCIE)
    got, _ = V.non_torch_default((0, 10, 2), 8, 1, "pcie", car.non_torch_bytes((0, 10, 2)))
    assert 0.17 * GIB <= got <= 0.21 * GIB


def test_interconnect_belongs_to_the_vllm_engine(capsys):
    assert _cli("estimate", "qwen2.5-7b", "--interconnect", "pcie") == 2
    assert _cli("plan", "qwen2.5-7b", "--hardware", "cuda:0=80GiB", "--interconnect", "pcie") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("--interconnect belongs to --engine vllm" in e for e in err)


# ------------------------------------------------------------------ FlashInfer's all-reduce + RMSNorm fusion workspace

def test_the_fusion_workspace_is_flashinfers_three_buffers_at_the_multicast_granularity(monkeypatch):
    """flashinfer 0.6.6 comm/trtllm_ar.py (trtllm_create_ipc_workspace_for_all_reduce_fusion): tp x T x hidden x 2,
    tp x 256 x 4 flags, 3 x tp x T x hidden x 2 Lamport bytes, each 2 MiB-aligned; comm/mnnvl.py SymmDeviceMemory:
    + 2 KiB signal pad, to the allocation then the multicast granularity. vLLM 0.19.1 allreduce_rms_fusion.py:
    T = min(max_size // (hidden x itemsize), max_num_batched_tokens), SM 9.0 max_size 64 / 2 / 0.5 MiB at tp
    2 / 4 / 8."""
    from vramcal.estimator.vllm import fusion as F

    # Llama-3.1-8B at tp 2 on H100, 8192 batched tokens: T = 64 MiB / 8 KiB = 8192; 128 MiB, 2 KiB and 384 MiB
    assert F.workspace_bytes(2, 64 * MIB, 4096, 2, 8192) == 3 * 512 * MIB
    # at the 2 MiB minimum granularity the same buffers would be 130 + 4 + 386 MiB
    monkeypatch.setattr(F, "MULTICAST_GRANULARITY", 2 * MIB)
    assert F.workspace_bytes(2, 64 * MIB, 4096, 2, 8192) == (130 + 4 + 386) * MIB
    # T is capped by max_num_batched_tokens: Qwen2.5-7B (hidden 3584) -> 8192, not 9362
    assert F.workspace_bytes(2, 64 * MIB, 3584, 2, 8192) == (112 + 2 + 336 + 3 * 2) * MIB
    # float32 Lamport buffers take 4 bytes a value; the data buffer stays 2
    assert F.workspace_bytes(2, 64 * MIB, 4096, 4, 8192) == (64 + 2 + 2 + 2 + 384 + 2) * MIB
    monkeypatch.undo()
    # SM 10.3 at tp 4 (64 MiB, hidden 8192: T = 4096): 256 MiB, 2 KiB and 768 MiB -> 512 + 512 + 1024 MiB
    assert F.workspace_bytes(4, 64 * MIB, 8192, 2, 8192) == 2048 * MIB


@pytest.mark.parametrize("v, tp, pp, ic, gpu, cap, eager, on, why", [
    ((0, 19, 1), 2, 1, "nvlink", "NVIDIA H100 80GB HBM3", (9, 0), False, True, "SM 9.0, tp 2"),
    ((0, 17, 1), 4, 1, "nvlink", "NVIDIA H200", (9, 0), False, True, "SM 9.0, tp 4"),
    ((0, 15, 1), 2, 1, "nvlink", "NVIDIA H100 80GB HBM3", (9, 0), False, False, "before 0.17"),
    ((0, 11, 0), 2, 1, "nvlink", "NVIDIA H100 80GB HBM3", (9, 0), False, False, "before 0.17"),
    ((0, 19, 1), 2, 1, "nvlink", "NVIDIA H100 80GB HBM3", (9, 0), True, False, "--enforce-eager"),
    ((0, 19, 1), 2, 2, "nvlink", "NVIDIA H100 80GB HBM3", (9, 0), False, False, "pp > 1"),
    ((0, 19, 1), 2, 1, "pcie", "NVIDIA H100 PCIe", (9, 0), False, False, "over PCIe"),
    ((0, 19, 1), 2, 1, "nvlink", "NVIDIA A100-SXM4-80GB", (8, 0), False, False, "not compute capability 9.0"),
    ((0, 19, 1), 2, 1, "nvlink", "NVIDIA H100 NVL", (9, 0), False, False, "no NVSwitch multicast"),
    ((0, 18, 0), 2, 1, "nvlink", "NVIDIA B300", (10, 3), False, False, "10.3 is not one"),  # 0.18: capability 100
    ((0, 19, 1), 2, 1, "nvlink", "NVIDIA B300", (10, 3), False, True, "SM 10.3"),  # 0.19: the 10.x family
    ((0, 19, 1), 2, 1, "nvlink", "NVIDIA B100", (10, 0), False, True, "SM 10.0, tp 2"),  # no name list had it
    ((0, 19, 1), 2, 1, "nvlink", None, (10, 0), False, True, "SM 10.0, tp 2"),  # the capability decides, not a name
    ((0, 19, 1), 16, 1, "nvlink", "NVIDIA H100 80GB HBM3", (9, 0), False, False, "world size 16"),
    ((0, 19, 1), 1, 1, "nvlink", "NVIDIA H100 80GB HBM3", (9, 0), False, False, "one GPU"),
    ((0, 19, 1), 2, 1, "nvlink", None, None, False, True, "SM 9.0 GPU on NVSwitch assumed"),
    ((0, 19, 1), 2, 1, "nvlink", "Some Future GPU", None, False, False, "not known"),  # named, not in the table
])
def test_when_vllm_makes_the_fusion_workspace(v, tp, pp, ic, gpu, cap, eager, on, why):
    """vLLM config/vllm.py enable_allreduce_rms_fusion (0.17.1, 0.18.0, 0.19.1; 0.15.1 sets it False at every
    level), enforce_eager -> compilation mode NONE (0.19.1), FI_ALLREDUCE_FUSION_MAX_SIZE_MB's world sizes, and
    flashinfer's SymmDeviceMemory refusing a GPU without multicast; by the GPU's compute capability."""
    from vramcal.estimator.vllm import fusion as F

    got = F.fusion_workspace(v, tp, pp, ic, gpu, cap, 4096, 2, 8192, eager)
    assert got.on is on and why in got.why, got.why
    assert (got.device_bytes > 0) is on


def test_an_sm100_gpu_the_name_words_missed_gets_the_workspace_as_an_h100_does(capsys):
    """The B100 (SM 10.0) was in no list of names fusion.py kept, so `--gpu B100` was priced without the
    1.5 GiB workspace at tp 2 over NVSwitch; its capability now comes from vramcal's table of GPUs, and at tp 2
    SM 10.0's 64 MiB makes the same three 512 MiB buffers as SM 9.0's."""
    got = {}
    for gpu in ("NVIDIA B100", "NVIDIA H100 80GB HBM3"):
        assert _cli("estimate", "llama-3.1-8b", "--engine", "vllm", "--gpu", gpu, "--gpu-memory", "79.19GiB", "-tp",
                    "2", "--interconnect", "nvlink", "--max-model-len", "8192", "--vllm-version", "0.19", "--json",
                    "--no-correction") == 0
        got[gpu] = json.loads(capsys.readouterr().out)["vllm"]
    b100, h100 = got["NVIDIA B100"], got["NVIDIA H100 80GB HBM3"]
    assert "fusion on" in b100["methods"]["interconnect"] and "SM 10.0, tp 2" in b100["methods"]["interconnect"]
    assert b100["non_torch_bytes"] == h100["non_torch_bytes"] == int(2.10 * GIB)


def test_the_capability_has_one_home_the_table_of_gpus(monkeypatch, capsys):
    """fusion.py and mxfp4.py keep no GPU names; `--gpu NAME` gives VllmArgs the table's capability, the
    published benchmark looks its rows' GPUs up the same way, and a change to the table's row is what the
    estimate follows."""
    import argparse
    import dataclasses
    import sys

    from vramcal.cli_vllm import vllm_args
    from vramcal.estimator.vllm import fusion as F
    from vramcal.estimator.vllm import mxfp4 as X
    from vramcal.probes import hardware as HW

    assert not hasattr(F, "_CAPABILITY_WORDS") and not hasattr(X, "TRITON_GPUS") and not hasattr(F, "capability")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from published_vllm import gpu_capability
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert gpu_capability({"gpu": "NVIDIA H100 80GB (Kubernetes pod)"}) == HW.find_gpu("H100 80GB").compute_capability
    assert gpu_capability({"gpu": "NVIDIA A100 80GB"}) == (8, 0)  # SXM4 or PCIe: 8.0 either way
    assert gpu_capability({"gpu": "24 GB GPU (not named)"}) is None
    flags = {k: None for k in ("gpu_memory", "gpu_memory_utilization", "max_model_len", "max_num_seqs",
                               "max_num_batched_tokens", "tensor_parallel_size", "pipeline_parallel_size", "dtype",
                               "kv_cache_dtype", "quantization", "block_size", "enforce_eager", "kv_cache_memory",
                               "vllm_version", "allow_long_max_model_len", "vllm_entrypoint", "flashinfer_sampler")}
    assert vllm_args(argparse.Namespace(**flags, gpu="B100")).gpu_capability == (10, 0)
    # the table's row says otherwise: the estimate follows it (no second list of names decides)
    rows = tuple(dataclasses.replace(g, compute_capability=(8, 0)) if g.name == "NVIDIA B100" else g
                 for g in HW.known_gpus())
    monkeypatch.setattr(HW, "known_gpus", lambda: rows)
    assert vllm_args(argparse.Namespace(**flags, gpu="B100")).gpu_capability == (8, 0)
    assert _cli("estimate", "llama-3.1-8b", "--engine", "vllm", "--gpu", "B100", "--gpu-memory", "79.19GiB", "-tp",
                "2", "--interconnect", "nvlink", "--vllm-version", "0.19", "--json", "--no-correction") == 0
    v = json.loads(capsys.readouterr().out)["vllm"]
    why = v["methods"]["interconnect"]
    assert "fusion off" in why and "(8.0) is not compute capability" in why, why


def test_this_machines_capability_is_nvmls(fake):
    """Measured here, the capability is NVML's (nvmlDeviceGetCudaComputeCapability through the one door), even
    for a GPU the table does not know; where NVML cannot read it (an old driver), the table's for NVML's name."""
    from vramcal.cli_vllm import this_gpu

    fake({0: [0]}, gpu_name="Some Future GPU", compute_capability=(10, 0))
    assert this_gpu()[1:] == ("Some Future GPU", (10, 0))
    fake({0: [0]}, gpu_name="NVIDIA H100 80GB HBM3", compute_capability=None)
    assert this_gpu()[1:] == ("NVIDIA H100 80GB HBM3", (9, 0))
    fake({0: [0]}, gpu_name="Some Future GPU", compute_capability=None)
    assert this_gpu()[1:] == ("Some Future GPU", None)


def test_non_torch_over_nvlink_by_version():
    """versions.non_torch_default over NVLink from 0.11: the version's one-GPU figure + NCCL's 0.35 GiB + the fusion
    workspace. 0.19 on H100: 0.25 + 0.35 + 1.5 = 2.10 GiB, the in-sample figure; 0.11 (no fusion before 0.17, graph
    profiling outside the window before 0.18): 0.07 + 0.35 = 0.42, where the blind llm-d-benchmark 0.11.0 H100 tp 2
    rows log 0.55 / 0.54 (they prompted the rule and are marked ``rule`` since); 0.15: 0.13 + 0.35."""
    h100 = "NVIDIA H100 80GB HBM3"
    e19 = _est(gpu_name=h100, gpu_capability=(9, 0), interconnect=NVLINK)
    e11 = _est(gpu_name=h100, gpu_capability=(9, 0), interconnect=NVLINK, vllm_version="0.11.0")
    e15 = _est(gpu_name=h100, gpu_capability=(9, 0), interconnect=NVLINK, vllm_version="0.15.1")
    eager = _est(gpu_name=h100, gpu_capability=(9, 0), interconnect=NVLINK, enforce_eager=True)
    assert e19.non_torch_bytes == int(0.25 * GIB) + V.NCCL_NVLINK + 1536 * MIB
    assert abs(e19.non_torch_bytes - 2.10 * GIB) < 0.005 * GIB
    assert e11.non_torch_bytes == int(0.07 * GIB) + V.NCCL_NVLINK
    assert e15.non_torch_bytes == int(0.13 * GIB) + V.NCCL_NVLINK
    assert eager.non_torch_bytes == int(0.25 * GIB) + V.NCCL_NVLINK
    assert "fusion on: FlashInfer" in e19.methods["interconnect"] and "1536 MiB" in e19.methods["interconnect"]
    assert "fusion off: before 0.17" in e11.methods["interconnect"]
    assert "no all-reduce fusion workspace" in e11.methods["non_torch"]


def test_a_plans_estimate_command_carries_the_capability_where_no_one_name_gives_it(capsys):
    """Two A100s of different sizes share SM 8.0 but no name: plan prices them without the fusion workspace,
    and its estimate command now says --gpu-capability 8.0, so running it prints the same figures (before, the
    command priced an SM 9.0 GPU: 1.5 GiB less KV at tp 2)."""
    assert _cli("plan", "llama-3.1-8b", "--engine", "vllm", "--hardware", "cuda:0=80GiB,cuda:1=40GiB", "--gpu",
                "A100-SXM4-80GB", "--gpu", "A100-SXM4-40GB", "--interconnect", "nvlink", "--vllm-version", "0.19.1",
                "--json") == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert {p["tensor_parallel_size"] for p in plans} == {1, 2}
    for p in plans:
        cmd = shlex.split(p["command"])
        assert ("--gpu-capability" in cmd) is (p["tensor_parallel_size"] == 2), p["command"]  # tp 1: the 80GB, named
        assert _cli(*cmd[1:], "--json", "--no-correction") == 0
        v = json.loads(capsys.readouterr().out)["vllm"]
        assert (v["kv_cache_tokens"], v["kv_cache_bytes"]) == (p["kv_cache_tokens"], p["kv_cache_bytes"]), p["command"]


@pytest.mark.parametrize("value", ["9", "x.y", "0.5", "9.0.1", ""])
def test_a_gpu_capability_that_is_not_major_dot_minor_is_one_line_and_exit_2(value, capsys):
    rc = _cli("estimate", "llama-3.1-8b", "--engine", "vllm", "--gpu-memory", "80GiB", "--gpu-capability", value)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "MAJOR.MINOR" in err, err
