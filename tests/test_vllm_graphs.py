"""The CUDA graphs vLLM captures and the V2 model runner's dummy sampler, against the arithmetic of the vLLM
source each rule names (``config/vllm.py`` ``_set_cudagraph_sizes``, ``v1/cudagraph_dispatcher.py``,
``v1/worker/gpu/sample/sampler.py``; docs/vllm.md "CUDA graphs")."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from vramcal.estimator.resolve import resolve_model
from vramcal.estimator.vllm import budget as B
from vramcal.estimator.vllm import versions as V
from vramcal.estimator.vllm.arch import arch_of
from vramcal.estimator.vllm.engine import VllmArgs, estimate_vllm
from vramcal.estimator.vllm.layout import pad_vocab
from vramcal.estimator.vllm.logparse import parse_log
from vramcal.units import GIB, MIB

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "benchmarks" / "published" / "vllm" / "configs"


LOGS = Path(__file__).resolve().parent.parent / "benchmarks" / "published" / "vllm" / "logs"


def test_the_list_is_the_one_a_log_prints():
    """The 0.19.1 H200 log prints vLLM's own list (its config line): 51 sizes up to 512."""
    import re

    text = (LOGS / "h200_qwen2.5-1.5b_v0.19.1.log").read_text()
    printed = [int(x) for x in re.search(r"cudagraph_capture_sizes': \[([0-9, ]+)\]", text).group(1).split(",")]
    c = V.cudagraph_captures((0, 19, 1), 1024, 8192, (9, 0))  # an H200: 1,024 sequences, 8,192 batched tokens
    assert (c.piecewise, c.largest) == (len(printed), printed[-1]) == (51, 512)


@pytest.mark.parametrize("seqs, piecewise, full", [(1, 2, 1), (8, 5, 4), (32, 11, 7), (64, 19, 11), (96, 27, 15),
                                                   (128, 35, 19), (200, 44, 28), (256, 51, 35), (1024, 51, 51)])
def test_captures_by_max_num_seqs(seqs, piecewise, full):
    """0.29.0: sizes 1, 2, 4, 8, 16 ... 248, 256, 272 ... up to min(2 x seqs, 512); FULL up to seqs (200: 400 is
    the largest: 3 + 31 + 10, counted by hand from the source's ranges)."""
    c = V.cudagraph_captures((0, 29, 0), seqs, 8192)
    assert (c.piecewise, c.full) == (piecewise, full)


def test_capture_counts_of_the_published_starts():
    # 0.13.0's RTX 3090 log: "Capturing CUDA graphs (mixed prefill-decode) 51/51", "(decode, FULL) 35/35" at 256
    c = V.cudagraph_captures((0, 13, 0), 256, 2048)
    assert (c.piecewise, c.full) == (51, 35)
    # the 0.19 H100 rows the default was fitted to: 1,024 sequences, every size a FULL decode graph too
    assert (B.GRAPH_FIT_CAPTURES.piecewise, B.GRAPH_FIT_CAPTURES.full) == (51, 51)
    # the T4 sweep's smallest: sizes up to 64, FULL up to 32
    t4 = V.cudagraph_captures((0, 29, 0), 32, 8192)
    assert (t4.piecewise, t4.full, t4.largest) == (11, 7, 64)


def test_the_ceiling_is_1024_on_a_10x_gpu_from_0_28_only():
    wide = V.cudagraph_captures((0, 28, 0), 1024, 16384, (10, 0))
    assert wide.largest == 1024 and wide.piecewise == 3 + 31 + 49 == wide.full
    assert V.cudagraph_captures((0, 27, 1), 1024, 16384, (10, 0)).largest == 512
    assert V.cudagraph_captures((0, 29, 0), 1024, 16384, (9, 0)).largest == 512
    assert V.cudagraph_captures((0, 29, 0), 1024, 16384, None).largest == 512  # not known: the common ceiling


def test_the_batched_tokens_bound_the_list_and_join_it_from_0_20():
    assert V.cudagraph_captures((0, 20, 0), 256, 100).piecewise == 3 + 12 + 1  # 1, 2, 4, 8 ... 96, then 100
    assert V.cudagraph_captures((0, 12, 0), 256, 100).piecewise == 3 + 12  # 0.12.0 does not append it
    assert V.cudagraph_captures((0, 29, 0), 256, 48).largest == 48


def test_max_num_seqs_joins_the_list_from_0_31():
    """0.31.0 (config/vllm.py): ``uniform_decode_sizes = [max_num_seqs]`` when it is at most the ceiling, appended
    to the sizes; 0.30.0 has not. Off the grid it adds one PIECEWISE and one FULL graph."""
    before = V.cudagraph_captures((0, 30, 0), 100, 8192)
    assert (before.piecewise, before.full) == (28, 15)
    c = V.cudagraph_captures((0, 31, 0), 100, 8192)
    assert (c.piecewise, c.full) == (29, 16)
    on_grid = V.cudagraph_captures((0, 31, 0), 96, 8192)
    assert (on_grid.piecewise, on_grid.full) == (27, 15)  # 96 is on the grid already
    assert V.cudagraph_captures((0, 33, 0), 1000, 8192).piecewise == 51  # above the 512 ceiling: not added
    assert V.cudagraph_captures((0, 33, 0), 300, 8192).piecewise == 52


def test_0_11_steps_by_8_and_older_lists_are_not_modelled():
    c = V.cudagraph_captures((0, 11, 0), 256, 8192)
    assert c.piecewise == 3 + 64 and c.largest == 512
    assert V.cudagraph_captures((0, 11, 0), 1, 8192).piecewise == 3  # 1, 2, 4 whatever the largest (0.12: 1, 2)
    assert V.cudagraph_captures((0, 12, 0), 1, 8192).piecewise == 2
    assert V.cudagraph_captures((0, 10, 2), 256, 8192) is None


def test_the_graph_default_scales_with_the_graphs_captured():
    fitted = B.GRAPH_BASE + B.GRAPH_PER_LAYER * 28
    assert B.cuda_graph_bytes(28, False, B.GRAPH_FIT_CAPTURES) == fitted == B.cuda_graph_bytes(28, False, None)
    small = V.cudagraph_captures((0, 29, 0), 32, 8192)
    assert B.cuda_graph_bytes(28, False, small) == fitted * 18 // 102
    assert B.cuda_graph_bytes(28, True, small) == 0


def _args(**kw) -> VllmArgs:
    return VllmArgs(**{**dict(gpu_memory_bytes=int(14.74 * GIB), gpu_memory_utilization=0.9, vllm_version="0.29.0",
                              max_model_len=4096, max_num_batched_tokens=8192, dtype="float16"), **kw})


def test_fewer_sequences_capture_fewer_graphs_and_leave_more_kv():
    src = resolve_model(str(CONFIGS / "qwen2.5-1.5b.json"))
    few, many = estimate_vllm(src, _args(max_num_seqs=32)), estimate_vllm(src, _args(max_num_seqs=256))
    assert few.cuda_graph_subtracted and many.cuda_graph_subtracted
    # 0.29's V2 runner (Qwen2 is on it from 0.26): its own estimate, a base + a cost per graph and layer (28 here)
    assert few.cuda_graph_bytes == B.V2_GRAPH_BASE + B.V2_GRAPH_PER_GRAPH_LAYER * 18 * 28
    assert many.cuda_graph_bytes == B.V2_GRAPH_BASE + B.V2_GRAPH_PER_GRAPH_LAYER * 86 * 28
    assert "11 PIECEWISE + 7 FULL captures" in few.methods["cuda_graphs"]
    assert few.methods["cuda_graphs"].startswith(B.V2_GRAPH_METHOD)
    assert few.kv_cache_bytes > many.kv_cache_bytes
    eager = estimate_vllm(src, _args(max_num_seqs=32, enforce_eager=True))
    assert eager.cuda_graph_bytes == 0 and "not captured" in eager.methods["cuda_graphs"]


def test_the_v2_runner_sampler_by_version_and_the_gather_at_tp():
    src = resolve_model(str(CONFIGS / "qwen2.5-1.5b.json"))
    arch = arch_of(src.config, None)
    s, t, el = 256, 8192, 2
    logits = s * pad_vocab(arch.vocab)
    hidden = int(B.HIDDEN_KEPT * t * arch.hidden * el)
    v1 = B.activation(arch, 1, 0, 1, el, t, s, (0, 27, 1))
    assert v1.sampler == int((B.SAMPLER_BYTES + el) * logits + hidden)
    assert B.activation(arch, 1, 0, 1, el, t, s, (0, 27, 1), v2_runner=True).sampler == int(el * logits + hidden)
    assert B.activation(arch, 1, 0, 1, el, t, s, (0, 32, 0), v2_runner=True).sampler == int(el * logits + hidden)
    assert B.activation(arch, 1, 0, 1, el, t, s, (0, 26, 0), v2_runner=True).sampler == int((el + 4) * logits + hidden)
    # 0.33's warm-up pass with every sampling parameter on: priced with V1's term (an assumption, pinned here)
    assert B.activation(arch, 1, 0, 1, el, t, s, (0, 33, 0), v2_runner=True).sampler == v1.sampler
    # tp 2: the all-gather holds the shard, the gathered buffer and its copy at once, 2.5 x el a logit
    assert B.activation(arch, 2, 0, 1, el, t, s, (0, 29, 0), v2_runner=True).sampler == int(2.5 * el * logits + hidden)
    assert B.activation(arch, 2, 0, 1, el, t, s, (0, 26, 0), v2_runner=True).sampler == int((el + 4) * logits + hidden)
    assert [V.v2_sampler_pass(v) for v in ((0, 24, 0), (0, 29, 0), (0, 33, 0))] == [
        V.V2_SAMPLER_FP32, V.V2_SAMPLER_LOGITS, V.V2_SAMPLER_WARMUP]


def test_a_10x_gpu_captures_up_to_1024_in_the_estimate():
    src = resolve_model(str(CONFIGS / "qwen2.5-1.5b.json"))
    args = dict(gpu_memory_bytes=int(178 * GIB), max_num_seqs=1024, max_num_batched_tokens=16384, max_model_len=4096)
    b200 = estimate_vllm(src, VllmArgs(**args, gpu_capability=(10, 0), vllm_version="0.29.0"))
    h200 = estimate_vllm(src, VllmArgs(**args, gpu_capability=(9, 0), vllm_version="0.29.0"))
    assert "83 PIECEWISE + 83 FULL" in b200.methods["cuda_graphs"] and "51 PIECEWISE + 51 FULL" in h200.methods["cuda_graphs"]
    per = B.V2_GRAPH_PER_GRAPH_LAYER * 28
    assert (b200.cuda_graph_bytes, h200.cuda_graph_bytes) == (B.V2_GRAPH_BASE + 166 * per, B.V2_GRAPH_BASE + 102 * per)


def test_the_v2_estimate_is_0_29s_and_the_v2_runners_only():
    """The V2 runner estimates nothing up to 0.28 (nothing subtracted); from 0.29 its own estimate is priced. A model
    0.28 keeps on the V1 runner (a MoE family outside its V2 list) keeps the V1 default scaled by its graphs; from
    0.29 every model is on the V2 runner (config/vllm.py ``use_v2_model_runner``), MoE included."""
    dense = resolve_model(str(CONFIGS / "qwen2.5-1.5b.json"))
    e28, e29 = estimate_vllm(dense, _args(vllm_version="0.28.0")), estimate_vllm(dense, _args(vllm_version="0.29.0"))
    assert not e28.cuda_graph_subtracted and "estimates none" in e28.methods["cuda_graphs"]
    assert e29.cuda_graph_subtracted and e29.methods["cuda_graphs"].startswith(B.V2_GRAPH_METHOD)
    moe = resolve_model(str(CONFIGS / "qwen3-coder-30b-a3b.json"))  # Qwen3MoeForCausalLM: V1 runner in 0.28
    layers = moe.config["num_hidden_layers"]
    captures = V.cudagraph_captures((0, 28, 0), 256, 8192, None)
    v1 = estimate_vllm(moe, _args(vllm_version="0.28.0", max_num_seqs=256))
    assert v1.cuda_graph_subtracted and v1.methods["cuda_graphs"].startswith("default fitted to 0.19 H100 logs")
    assert v1.cuda_graph_bytes == B.cuda_graph_bytes(layers, False, captures)
    v2 = estimate_vllm(moe, _args(vllm_version="0.29.0", max_num_seqs=256))
    assert v2.methods["cuda_graphs"].startswith(B.V2_GRAPH_METHOD) and "V2 model runner" in v2.methods["activation"]
    assert v2.cuda_graph_bytes == B.cuda_graph_bytes(layers, False, captures, v2_estimate=True) < v1.cuda_graph_bytes


def test_the_v2_graph_constants_are_what_the_fit_script_fits():
    """budget.V2_GRAPH_* are benchmarks/fit_vllm_graphs.py's least squares over the corpus's fit rows (the T4 0.29.0
    sweep), to the digits written; its held-out check, the 0.29 L40S rows, stays within 10 %."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import fit_vllm_graphs as F

    pts = F.points()
    base, per = F.fit(pts)
    assert sorted(p["id"] for p in pts if p["split"] == "fit") == sorted(
        f"t4_qwen2.5-1.5b_fp16_mns{n}_v0.29.0" for n in ("32", "64", "96", "128", "256", "256_repeat"))
    assert round(base / GIB, 4) * GIB == pytest.approx(B.V2_GRAPH_BASE, abs=1)
    assert round(per / MIB, 4) * MIB == pytest.approx(B.V2_GRAPH_PER_GRAPH_LAYER, abs=1)
    held = [p for p in pts if p["split"] == "held-out"]
    assert len(held) >= 3 and all(abs(p["vramcal"] / p["logged"] - 1) < 0.10 for p in held), held


def test_the_estimate_uses_the_v2_sampler_where_the_model_runs_on_it():
    src = resolve_model(str(CONFIGS / "qwen2.5-1.5b.json"))  # Qwen2ForCausalLM: V2 by default from 0.26, V1 in 0.24
    e26 = estimate_vllm(src, _args(vllm_version="0.26.0", compile_cache="warm"))
    e24 = estimate_vllm(src, _args(vllm_version="0.24.0", compile_cache="warm"))
    assert "the V2 model runner, whose sampler pass is the logits and their float32 copy" in e26.methods["activation"]
    assert "V2" not in e24.methods["activation"]
    assert e26.activation_bytes < e24.activation_bytes


def test_json_carries_the_captures(capsys):
    """``--json`` gives the graph counts beside the bytes; --enforce-eager and versions before 0.11 give None."""
    import json

    from vramcal.cli import main

    cfg = str(CONFIGS / "qwen2.5-1.5b.json")
    base = ["estimate", cfg, "--engine", "vllm", "--gpu-memory", "14.74GiB", "--max-model-len", "4096", "--json",
            "--no-correction"]
    assert main(base + ["--max-num-seqs", "32", "--vllm-version", "0.29"]) == 0
    v = json.loads(capsys.readouterr().out)["vllm"]
    assert (v["cuda_graph_piecewise"], v["cuda_graph_full"]) == (11, 7)
    assert main(base + ["--enforce-eager", "--vllm-version", "0.29"]) == 0
    v = json.loads(capsys.readouterr().out)["vllm"]
    assert (v["cuda_graph_piecewise"], v["cuda_graph_full"], v["cuda_graph_bytes"]) == (None, None, 0)
    assert main(base + ["--vllm-version", "0.10.2"]) == 0
    assert json.loads(capsys.readouterr().out)["vllm"]["cuda_graph_piecewise"] is None


def test_the_log_parser_reads_the_estimate_from_the_equivalent_utilization_line():
    """0.21 on, the estimate is printed as a utilization: ``current - equivalent`` of the device total (gpu_worker.py
    rounds the second to 4 decimals). The T4 excerpt prints no total, the L40S log does (its own estimate line too)."""
    t4 = parse_log((LOGS / "t4_qwen2.5-1.5b_fp16_mns32_v0.29.0.log").read_text())
    assert t4.cuda_graph_estimate_fraction == pytest.approx(0.0071) and t4.cuda_graph_estimate_bytes is None
    line = ("(EngineCore pid=6668) INFO 09-12 17:10:24 [gpu_worker.py:640] Free memory on device (43.97/44.39 GiB) on "
            "startup. Desired GPU memory utilization is (0.92, 40.84 GiB).\n(EngineCore pid=6668) INFO 09-12 17:10:24 "
            "[gpu_worker.py:640] CUDA graph memory profiling is enabled (default since v0.21.0). The current "
            "--gpu-memory-utilization=0.9200 is equivalent to --gpu-memory-utilization=0.9086 without CUDA graph memory "
            "profiling. To maintain the same effective KV cache size as before, increase --gpu-memory-utilization to 0.9314.")
    log = parse_log(line)
    assert log.cuda_graph_estimate_fraction == pytest.approx(0.0114)
    assert log.cuda_graph_estimate_bytes == int(round(0.0114 * int(round(44.39 * GIB))))
    l40s = parse_log((LOGS / "l40s_qwen3-14b_v0.29.0.log").read_text())
    assert abs(l40s.cuda_graph_estimate_bytes / GIB - 0.51) < 0.006  # its "(estimated)" figure stands


def test_the_predicted_lines_are_the_runner_s_own():
    """The V1 runner prints "Estimated CUDA graph memory"; the V2 runner prints none (0.22-0.28 estimate nothing);
    where the estimate comes off the budget the worker prints it as a utilization (0.28 on read), to 4 decimals."""
    src = resolve_model(str(CONFIGS / "qwen2.5-1.5b.json"))  # Qwen2: V1 runner in 0.24, V2 from 0.26
    e24, e26, e29 = (estimate_vllm(src, _args(vllm_version=v, max_num_seqs=32)) for v in ("0.24.0", "0.26.0", "0.29.0"))
    assert any(line.startswith("Estimated CUDA graph memory") for line in e24.log_lines)
    assert not any("CUDA graph memory" in line for line in e26.log_lines)
    share = next(line for line in e29.log_lines if "is equivalent to" in line)
    assert not any(line.startswith("Estimated CUDA graph memory") for line in e29.log_lines)
    assert f"--gpu-memory-utilization={round(0.9 - e29.cuda_graph_bytes / int(14.74 * GIB), 4):.4f} without" in share
    back = parse_log(share + f"\nFree memory on device (14.6/{14.74} GiB) on startup.")
    assert back.cuda_graph_estimate_fraction == pytest.approx(e29.cuda_graph_bytes / int(14.74 * GIB), abs=5e-5)
    lines = e29.log_lines
    assert lines.index(share) == next(i for i, x in enumerate(lines) if x.startswith("Available KV cache memory")) + 1


def test_a_probe_holds_the_predicted_estimate_against_the_logged_estimate():
    """From 0.20 the graph term is vLLM's estimate, so a probe compares it with the logged estimate, not the
    smaller capture that follows (0.29 L40S: 0.27 actual, 0.51 estimated); before, with the capture."""
    from vramcal.estimator.vllm.engine import as_estimate
    from vramcal.probes.vllm_probe import VllmProbeResult

    src = resolve_model(str(CONFIGS / "qwen2.5-1.5b.json"))
    log = parse_log((LOGS / "l40s_qwen3-14b_v0.29.0.log").read_text())
    for version, expect in (("0.29.0", log.cuda_graph_estimate_bytes), ("0.19.1", log.cuda_graph_bytes)):
        est = as_estimate(src, estimate_vllm(src, _args(vllm_version=version)))
        r = VllmProbeResult("ok", "m", version, [0], {}, log, est, last_stage="end")
        assert r.comparison()["cuda_graph_bytes"] == (est.vllm.cuda_graph_bytes, expect), version
