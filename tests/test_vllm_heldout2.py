"""--engine vllm on the blind collection of issue 27 (benchmarks/published/vllm/heldout-2026-12-03b.csv): the
startups collected after the rules of the earlier collections were settled and run once, with nothing changed
since, and the corpus's ``examined`` column, which says which held-out rows are no longer blind."""

from __future__ import annotations

import csv
import functools
import statistics
import sys
from pathlib import Path

import pytest

from vramcal.estimator.vllm.logparse import parse_log

ROOT = Path(__file__).parent.parent
CORPUS_DIR = ROOT / "benchmarks" / "published" / "vllm"
BLIND = CORPUS_DIR / "heldout-2026-12-03b.csv"
GIB = 1024**3


def _read(path: Path) -> list[dict]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


ROWS = _read(BLIND)
# the rows whose miss prompted a rule since the blind run (issue 27, round 5: non-torch at tp > 1 by version)
RULE_ROWS = {"h100x2_llama-3.3-70b-fp8-dynamic_tp2_v0.11.0": 0.42, "h100x2_qwen3-32b_tp2_v0.11.0": 0.37}


@functools.lru_cache(maxsize=1)
def _results() -> dict[str, dict]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from published_vllm import run_row

    return {r["id"]: run_row({**r, "collection": BLIND.name}, CORPUS_DIR) for r in ROWS}


def test_the_blind_collection_is_eight_or_more_held_out_startups_with_sources_and_configs():
    """Each row: held out, a source, a fixture quoting what the source prints, and a model vramcal resolves (the
    catalog, or a config.json in configs/); blind, except the two tp 2 rows whose miss prompted round 5's
    non-torch rule (marked ``rule: ...``)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from published_vllm import model_ref
    from vramcal.estimator.resolve import resolve_model

    assert len(ROWS) >= 8
    for r in ROWS:
        assert r["split"] == "held-out", r["id"]
        assert not r["examined"] or (r["id"] in RULE_ROWS and r["examined"].startswith("rule: ")), r["id"]
        assert r["source_url"] and (CORPUS_DIR / r["fixture"]).is_file(), r["id"]
        assert resolve_model(model_ref(r, CORPUS_DIR)).config, r["id"]


@pytest.mark.parametrize("row", [r for r in ROWS if r["vllm_version"] == "0.11.0"], ids=lambda r: r["id"])
def test_the_0_11_figures_close_as_vllm_subtracts_them(row):
    """vLLM 0.11 (v1/worker/gpu_worker.py determine_available_memory): available = total x utilization - weights
    - torch peak increase - non-torch increase; the CUDA graphs are captured after the KV cache is sized and
    are not in it. Every row's printed terms must close to the printed available memory (two-decimal
    rounding: 0.025 GiB): that checks the transcription, and the one utilization inferred rather than stated
    (gpt-oss-120b's 0.95; at 0.9 its terms leave -0.63 GiB, not the 3.33 it printed)."""
    total, util = float(row["gpu_total_gib"]), float(row["gpu_memory_utilization"])
    rest = total * util - float(row["weights_gib"]) - float(row["activation_gib"]) - float(row["non_torch_gib"])
    assert abs(rest - float(row["kv_cache_gib"])) < 0.025, (row["id"], rest)


def test_the_0_27_accounting_line_closes_with_the_printed_peak():
    """vLLM 0.27 (gpu_worker.py): "Actual usage is C GiB for consumed memory (weights + non-torch), P GiB for
    peak activation" with P = transient peak + the applied graph estimate: requested - C - P is the available
    memory. The RTX 4090 (WSL2) row: 0.85 x 23.99 - 1.49 - 0.25 = 18.65 GiB, as logged; its non-torch figure is
    C - weights (0.56 GiB)."""
    row = next(r for r in ROWS if r["id"] == "rtx4090wsl_qwen2.5-0.5b_u0.85_v0.27.1")
    log = parse_log((CORPUS_DIR / row["fixture"]).read_text())
    assert log.total_bytes is not None and log.consumed_bytes is not None and log.peak_with_graphs_bytes is not None
    requested = log.gpu_memory_utilization * log.total_bytes
    assert abs(requested - log.consumed_bytes - log.peak_with_graphs_bytes - log.kv_cache_bytes) < 0.015 * GIB
    assert abs((log.consumed_bytes - log.weights_bytes) / GIB - float(row["non_torch_gib"])) < 0.006
    assert log.kv_cache_tokens == int(row["kv_cache_tokens"])


def test_blind_figures_are_the_reported_ones():
    """The blind collection's figures as docs/validation.md reports them. Run once before any change: KV memory
    (9 of the 10 rows print no token count) median 1.48 %, p90 11.25 %; the one row with tokens +0.16 %. Round 5's
    non-torch rule moved the two vLLM 0.11 tp 2 rows (-4.83 / -4.50 % then, the rows that prompted it, now marked
    ``rule``) and nothing else: the eight rows still blind kept their first-run figures (median 0.76 %, p90
    22.19 % of eight) until round 8's V2-runner sampler (``versions.v2_sampler_pass``, read from vLLM's
    source, prompted by another collection's row) moved the 0.27.1 RTX 4090 WSL row from +0.14 to +1.64 %: its
    activation is now 0.26 GiB against the 0.25 its log prints (0.54 before), so what moved is another term's
    compensation. Median 1.48 %, p90 22.19 % now. Pinned so that any rule change that moves them fails here and
    is reported -- and so that these rows stop being blind in the record if one is tuned to them."""
    res = _results()
    assert not any(r["error"] for r in res.values())
    blind = [abs(r["KV memory_err_pct"]) for rid, r in res.items() if rid not in RULE_ROWS]
    med, p90 = statistics.median(blind), statistics.quantiles(sorted(blind), n=10, method="inclusive")[8]
    assert len(blind) == 8, len(blind)
    assert med == pytest.approx(1.48, abs=0.02) and p90 == pytest.approx(22.19, abs=0.05), (med, p90)
    assert res["rtx4090wsl_qwen2.5-0.5b_u0.85_v0.27.1"]["KV memory_err_pct"] == pytest.approx(1.64, abs=0.02)
    for rid, now in RULE_ROWS.items():
        assert res[rid]["KV memory_err_pct"] == pytest.approx(now, abs=0.02), rid
    tokens = [r["KV tokens_err_pct"] for r in res.values() if r["KV tokens_err_pct"] is not None]
    assert len(tokens) == 1 and tokens[0] == pytest.approx(1.65, abs=0.02)  # the same row (0.16 % before round 8)


def test_examined_column_says_which_held_out_rows_are_not_blind():
    """Every collection's held-out rows carry ``examined``: blank (blind), "diagnosed ..." (the log read to find
    the term that misses, no rule changed) or "rule: ..." (the row prompted a source-derived rule). The rows of
    the KV-token misses above 3 % read for issue 27's fourth round are all marked; a fit row only where it was held
    out before and fitted to since ("fit: ...")."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from published_vllm import examined_kind

    rows = [r for p in sorted(CORPUS_DIR.glob("*.csv")) for r in _read(p)]
    assert all("examined" in r for r in rows)
    # a fit row carries none, but for a held-out row fitted to since (round 9's T4 sweep: "fit: ...", its history kept)
    assert all(r["examined"].startswith("fit:") for r in rows if r["split"] != "held-out" and r["examined"])
    kinds = {r["id"]: examined_kind(r) for r in rows if r["split"] == "held-out"}
    for rid in ("rtx3060_qwen3-0.6b_u0.75_v0.19.0", "rtx3090_qwen2.5-7b_u0.65_v0.17.1"):
        assert kinds[rid] == "diagnosed", rid
    # diagnosed in the fourth round; their activation gap prompted the cold compile's kernel benchmark since
    for rid in ("l40s_qwen3-14b_v0.28.0", "l4_qwen3-14b-awq_v0.28.0", "l4x2_qwen3-14b-awq_pp2_v0.28.0",
                "l40s_qwen3-14b-awq_v0.28.0"):
        assert kinds[rid] == "rule", rid
    assert kinds["l40s_qwen3-14b_v0.29.0"] == "rule" and kinds["rtx5090_qwen3-8b_v0.24.0"] == "rule"
    assert examined_kind({"examined": ""}) == "blind"


# ------------------------------------------------------------------- weights as the caching allocator counts them

MIB = 1024**2


def test_a_tensor_just_short_of_2_mib_holds_the_whole_segment():
    """torch's c10/cuda/CUDACachingAllocator.cpp: a large request (over 1 MiB) of 10 MiB or more gets a new
    segment of the request rounded up to 2 MiB (get_allocation_size, kRoundLarge), and the rest is split off
    only when more than 1 MiB (kSmallSize) remains (should_split); the allocated figure counts the block.
    Qwen2.5-7B's tensors on one rank (bf16): qkv 4608 x 3584 = 31.5 MiB holds 32; o_proj 3584 x 3584 = 24.5 MiB
    keeps 24.5 (1.5 MiB split off); gate_up 37888 x 3584 = 259 MiB holds 260 (exactly 1 MiB left: not split);
    down 3584 x 18944 = 129.5 MiB holds 130; a 8 MiB tensor takes 8 of a 20 MiB segment (kLargeBuffer)."""
    from vramcal.estimator.vllm.layout import allocated_bytes

    assert allocated_bytes([4608 * 3584 * 2]) == 32 * MIB
    assert allocated_bytes([3584 * 3584 * 2]) == 3584 * 3584 * 2
    assert allocated_bytes([37888 * 3584 * 2]) == 260 * MIB
    assert allocated_bytes([3584 * 18944 * 2]) == 130 * MIB
    assert allocated_bytes([8 * MIB]) == 8 * MIB
    assert allocated_bytes([1000]) == 1024  # 512-byte blocks (kMinBlockSize)


def test_vllm_fuses_qkv_and_gate_up_into_one_tensor_each():
    """model_executor/layers/linear.py: QKVParallelLinear and MergedColumnParallelLinear hold q/k/v and gate/up
    as one parameter (one allocation) each; the biases are tensors of their own."""
    from vramcal.estimator.vllm.layout import fused_name

    assert fused_name("model.layers.3.self_attn.k_proj.weight") == "model.layers.3.self_attn.qkv_proj.weight"
    assert fused_name("model.layers.3.self_attn.v_proj.bias") == "model.layers.3.self_attn.qkv_proj.bias"
    assert fused_name("model.layers.3.mlp.up_proj.weight") == "model.layers.3.mlp.gate_up_proj.weight"
    assert fused_name("model.layers.3.self_attn.o_proj.weight") == "model.layers.3.self_attn.o_proj.weight"
    assert fused_name("model.layers.3.mlp.experts.gate_up_proj") == "model.layers.3.mlp.experts.gate_up_proj"


@pytest.mark.parametrize("tp, logged", [(1, 14.25), (2, 7.12), (4, 3.55)])
def test_qwen2_weights_are_the_logged_figure_at_every_tp(tp, logged):
    """"Model loading took X GiB" is torch.cuda.max_memory_allocated after a reset (vLLM platforms/cuda.py
    get_current_memory_usage under DeviceMemoryProfiler, 0.10-0.29): block sizes. Qwen2.5-7B's projections sit
    0.5-1 MiB short of 2 MiB multiples, so it holds 57 MiB more than its tensors at tp 1, 21 at tp 2, under 1 at
    tp 4; every tp of the corpus's logs (0.10.1.1-0.19, A100 / H100 / RTX 3090 / V100) prints 14.25 / 7.12 /
    3.55 GiB, which the tensors alone (14.19 / 7.10 / 3.55) missed. Llama-3.1-8B's tensors are 2 MiB multiples:
    no change (14.99)."""
    from vramcal.estimator.vllm.engine import VllmArgs, estimate_vllm

    def w(model, tp):
        e = estimate_vllm(model, VllmArgs(gpu_memory_bytes=int(79.19 * GIB), tensor_parallel_size=tp,
                                          max_model_len=8192, vllm_version="0.19.0"))
        return e.weights_bytes / GIB

    assert round(w("qwen2.5-7b", tp), 2) == logged
    assert round(w("llama-3.1-8b", 1), 2) == 14.99
