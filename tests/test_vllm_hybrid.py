"""vLLM's KV cache for hybrid models (Qwen3-Next's Gated DeltaNet, Nemotron-H's Mamba-2) and gpt-oss's
MXFP4 experts: the page arithmetic against figures worked by hand from vLLM's source, the log parser on
the real excerpts in benchmarks/published/vllm/logs/, and the published rows of hybrid.csv (held out:
nothing was fitted to them)."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

from vramcal.errors import UserError
from vramcal.estimator.vllm import kv as K
from vramcal.estimator.vllm import mamba as H
from vramcal.estimator.vllm import mxfp4 as X
from vramcal.estimator.vllm import versions as V
from vramcal.estimator.vllm.logparse import parse_log

ROOT = Path(__file__).resolve().parent.parent
CORPUS_DIR = ROOT / "benchmarks" / "published" / "vllm"
GIB = 1024**3
QWEN3_NEXT = {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
              "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}  # Qwen/Qwen3-Next-80B-A3B config.json
NEMOTRON_NANO = {"mamba_num_heads": 64, "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4,
                 "chunk_size": 128, "mamba_ssm_cache_dtype": "float32"}  # the catalog's nemotron-3-nano-30b-a3b


def test_gated_deltanet_page_padded_to_a_544_token_attention_block_at_tp2():
    # vLLM 0.10.2 layers/mamba/mamba_utils.py gated_delta_net_state_shape, per rank of tp 2:
    #   conv  (4 - 1) x (2 x 16 x 128 + 32 x 128) / 2 = 3 x 4096 = 12,288 elements
    #   state 32 / 2 x 128 x 128                      = 262,144 elements; both bf16 -> 548,864 B
    # models/config.py HybridAttentionMambaModelConfig.verify_and_update_config: one attention token is
    #   2 x (2 kv heads / 2) x 256 x 2 B = 1,024 B; block = 16 x cdiv(548,864, 16 x 1,024) = 16 x 34 = 544;
    #   page 544 x 1,024 = 557,056 B, the state padded by 1.49 % (the H200 log prints 544 and 1.49 %)
    s = H.state_shape("Qwen3NextForCausalLM", QWEN3_NEXT, 2)
    assert (s.conv_elems, s.ssm_elems) == (12_288, 262_144)
    conv_b, ssm_b, _ = H.state_dtype_bytes("Qwen3NextForCausalLM", QWEN3_NEXT, (0, 10, 2), 2)
    state = s.conv_elems * conv_b + s.ssm_elems * ssm_b
    assert state == 548_864
    u = H.unify(state, 1_024, "none", s.chunk_size, 262_144, None, (0, 10, 2))
    assert (u.block_size, u.page_bytes, u.mamba_block_size) == (544, 557_056, 262_144)
    assert f"{u.padding_pct:.2f}" == "1.49"
    # tp 4: half the state, kv heads stay one per rank -> half the block
    s4 = H.state_shape("Qwen3NextForCausalLM", QWEN3_NEXT, 4)
    assert H.unify(s4.conv_elems * 2 + s4.ssm_elems * 2, 1_024, "none", 2048, 4096, None, (0, 11, 0)).block_size == 272


def test_tokens_and_concurrency_from_the_logged_memory_of_the_h200_run():
    # v1/core/kv_cache_utils.py (0.10.2): 12 full + 36 linear layers per rank -> group size 12, 4 groups;
    # num_blocks = 44.59 GiB // 557,056 // 12 = 7,162 (the log's num_gpu_blocks); tokens = 7,162 // 4 x
    # min(544, 262,144) = 973,760; concurrency = 7,162 / (cdiv(262,144, 544) + 3 x 1 state page) = 14.77
    u = H.Unified(544, 557_056, 548_864, 262_144, "none")
    full = K.LayerSpec("full", 557_056)
    state = K.LayerSpec("mamba", 557_056, mode="none")
    specs = ([state] * 3 + [full]) * 12
    g = K.grouping(specs, (0, 10, 2))
    assert (g.group_size, g.num_groups, g.bytes_per_block) == (12, 4, 12 * 557_056)
    blocks = int(44.59 * GIB) // g.bytes_per_block
    assert blocks == 7_162
    v = (0, 10, 2)
    conc = K.max_concurrency(g, blocks, 262_144, u.block_size, 8192, v, 0)
    assert K.reported_tokens(g, blocks, u.block_size, conc, 262_144, v) == 973_760
    assert f"{conc:.2f}" == "14.77"
    # check_enough_kv_cache_memory: 12 x 482 attention pages + 36 state pages for one 262,144-token request
    assert K.needed_bytes(specs, 262_144, 544, 8192) == (12 * 482 + 36) * 557_056


def test_nemotron_h_ssm_state_in_float32_and_the_4176_token_block_with_an_fp8_cache():
    # mamba2_state_shape (tp 1): conv 3 x (64 x 64 + 2 x 8 x 128) = 18,432; state 64 x 64 x 128 = 524,288.
    # NemotronHForCausalLMConfig (0.13 on) takes the checkpoint's mamba_ssm_cache_dtype, float32:
    #   18,432 x 2 + 524,288 x 4 = 2,134,016 B. With --kv-cache-dtype fp8 an attention token is
    #   2 x 2 x 128 x 1 = 512 B: block 16 x cdiv(2,134,016, 8,192) = 4,176, padded 0.19 % -- the figures a
    #   published Nemotron-Cascade-2-30B-A3B (same hybrid widths) log prints (search-index file 51961570119)
    s = H.state_shape("NemotronHForCausalLM", NEMOTRON_NANO, 1)
    assert (s.conv_elems, s.ssm_elems, s.chunk_size) == (18_432, 524_288, 128)
    conv_b, ssm_b, why = H.state_dtype_bytes("NemotronHForCausalLM", NEMOTRON_NANO, (0, 19, 0), 2)
    assert (conv_b, ssm_b) == (2, 4) and "float32" in why
    u = H.unify(s.conv_elems * conv_b + s.ssm_elems * ssm_b, 512, "none", s.chunk_size, 131_072, None, (0, 19, 0))
    assert u.block_size == 4_176 and f"{u.padding_pct:.2f}" == "0.19"
    # before 0.13 (0.12.0 has no NemotronH hook) the SSM state follows the conv's bf16
    assert H.state_dtype_bytes("NemotronHForCausalLM", NEMOTRON_NANO, (0, 12, 0), 2)[:2] == (2, 2)
    # without the checkpoint's field: float16 up to 0.19, float32 from 0.20 (DEFAULT_MAMBA_SSM_CACHE_DTYPE)
    bare = {k: v for k, v in NEMOTRON_NANO.items() if k != "mamba_ssm_cache_dtype"}
    assert [H.state_dtype_bytes("NemotronHForCausalLM", bare, v, 2)[1] for v in ((0, 19, 0), (0, 20, 0))] == [2, 4]


def test_gated_deltanet_ignores_mamba_ssm_cache_dtype_before_0_17():
    assert H.state_dtype_bytes("Qwen3NextForCausalLM", QWEN3_NEXT, (0, 15, 1), 2, "auto", "float32")[:2] == (2, 2)
    assert H.state_dtype_bytes("Qwen3NextForCausalLM", QWEN3_NEXT, (0, 17, 1), 2, "auto", "float32")[:2] == (2, 4)


def test_prefix_caching_modes_by_version_and_what_a_request_holds():
    assert H.cache_mode((0, 11, 0), "Qwen3NextForCausalLM", True) == "none"  # 0.10-0.11 force it off
    assert H.cache_mode((0, 25, 1), "Qwen3NextForCausalLM", None) == "none"  # off by default up to 0.25
    assert H.cache_mode((0, 26, 0), "Qwen3NextForCausalLM", None) == "align"  # on from 0.26
    assert H.cache_mode((0, 27, 1), "NemotronHForCausalLM", None) == "all"  # SupportsMambaPrefixCaching
    assert H.cache_mode((0, 33, 0), "NemotronHForCausalLM", False) == "none"
    assert H.cache_mode((0, 31, 0), "NemotronHForCausalLM", None) == "all"
    assert H.cache_mode((0, 32, 0), "NemotronHForCausalLM", None) == "align+checkpoint"  # "all" dropped in 0.32
    assert H.cache_mode((0, 32, 0), "Qwen3NextForCausalLM", None) == "align"
    with pytest.raises(UserError, match="--no-enable-prefix-caching"):
        H.cache_mode((0, 33, 0), "Qwen3NextForCausalLM", None)
    with pytest.raises(UserError, match="before vLLM 0.15"):
        H.cache_mode((0, 13, 0), "Qwen3NextForCausalLM", True)
    # MambaSpec.max_memory_usage_bytes: 1 page, 2 in align, cdiv(L, block) in all
    assert [H.pages_per_request(m, 10_000, 2_048) for m in ("none", "align", "align+checkpoint", "all")] == [1, 2, 3, 5]
    # mode "all": the block is a multiple of lcm(chunk, 16): cdiv(2,134,016 / 1,024) = 2,084 -> 2,176 (17 x 128)
    assert H.unify(2_134_016, 1_024, "all", 128, 8_192, None, (0, 27, 1)).block_size == 2_176


def test_group_size_takes_the_largest_count_when_close_from_0_12():
    # _get_kv_cache_groups_uniform_page_size: 12 sliding + 13 full -> group 13 (0.12-0.17: under 1.25 x;
    # 0.18 on: 1.5 x); 0.11.0 keeps the smallest
    specs = [K.LayerSpec("sliding", 1024, 128)] * 12 + [K.LayerSpec("full", 1024)] * 13
    assert K.grouping(specs, (0, 11, 0)).group_size == 12
    assert K.grouping(specs, (0, 12, 0)).group_size == 13
    assert K.grouping(specs[:12] + specs[12:] * 2, (0, 17, 1)).group_size == 12  # 26 >= 1.25 x 12
    assert K.grouping(specs[:12] + specs[12:25] + specs[12:16], (0, 18, 1)).group_size == 17  # 17 < 1.5 x 12
    assert K.grouping(specs[:12] + specs[12:25] + specs[12:17], (0, 18, 1)).group_size == 12  # 18 is not


def test_sliding_windows_hold_every_batch_in_flight_from_0_26():
    assert V.in_flight_tokens((0, 25, 1), 8192, 1) == 8192
    assert V.in_flight_tokens((0, 26, 0), 8192, 1) == 16384  # async scheduling: 2 concurrent batches
    assert V.in_flight_tokens((0, 27, 1), 8192, 4) == 32768
    sliding = K.LayerSpec("sliding", 65_536, 128)  # gpt-oss: window 128
    assert sliding.max_memory(131_072, 16, 16384) == (-(-(127 + 16384) // 16) + 1) * 65_536


def test_mxfp4_experts_by_backend_match_the_two_h100_logs_by_hand():
    # gpt-oss-120b: 36 layers x 128 experts, hidden 2880, intermediate 2880 (both already multiples of 64)
    # Triton (0.14.1 "Using Triton backend"): w13 2 x 2880 x 2880 + w2 2880 x 2880 values, packed 4 bits,
    #   the E8M0 scales (1 / 32) held twice (layer.w13_weight_scale kept beside PrecisionConfig's swizzled copy)
    # Marlin (0.10.1 "leveraging the Marlin kernel"): hidden padded to 3072, intermediate to 2944, scales once
    t, m = X.backend((0, 14, 1), "NVIDIA H100 80GB", (9, 0), None), X.backend((0, 10, 1), None, None, None)
    assert (t.name, m.name) == ("triton", "marlin")
    assert t.padded(2880, 2880) == (2880, 2880) and m.padded(2880, 2880) == (3072, 2944)
    per_expert_t = t.weight_bytes(2 * 2880, 2880) + t.weight_bytes(2880, 2880)
    per_expert_m = m.weight_bytes(2 * 2944, 3072) + m.weight_bytes(3072, 2944)
    assert per_expert_t == 3 * 2880 * 2880 // 2 + 2 * 3 * 2880 * 2880 // 32
    assert per_expert_m == 3 * 2944 * 3072 // 2 + 3 * 2944 * 3072 // 32
    # the difference between the two logs' "Model loading took" (65.97 - 64.38 = 1.59 GiB) is the two
    # backends' experts and biases (float32 under Triton, bf16 under Marlin): 1.72 GiB by this arithmetic;
    # the 0.13 GiB left is the Triton row's own 0.18 GiB shortfall (triton_kernels' swizzled layout, not read)
    bias_t = t.bias_bytes(2 * 2880, 2) + t.bias_bytes(2880, 2)
    bias_m = m.bias_bytes(2 * 2944, 2) + m.bias_bytes(3072, 2)
    diff = 36 * 128 * ((per_expert_m + bias_m) - (per_expert_t + bias_t))
    assert abs(diff / GIB - (65.9651 - 64.38)) < 0.15
    assert X.backend((0, 19, 1), "NVIDIA RTX PRO 6000 Blackwell", (12, 0), None).name == "marlin"  # SM120
    with pytest.raises(UserError, match="--mxfp4-backend"):
        X.backend((0, 19, 1), None, None, "cutlass")


def test_an_unmodelled_hybrid_architecture_is_named():
    with pytest.raises(UserError, match="Zamba2ForCausalLM"):
        H.state_shape("Zamba2ForCausalLM", {}, 1)


def test_parser_reads_the_hybrid_and_mxfp4_lines_of_the_real_excerpts():
    q = parse_log((CORPUS_DIR / "logs" / "h200x2_qwen3-next-80b-a3b_tp2_v0.10.2.log").read_text())
    assert (q.version, q.block_size, q.mamba_padding_pct, q.num_blocks) == ("0.10.2", 544, 1.49, 7162)
    assert (q.kv_cache_tokens, q.max_concurrency, q.total_bytes) == (973_760, 14.77, int(round(139.81 * GIB)))
    assert q.kv_cache_bytes == int(round(44.59 * GIB)) and q.weights_bytes == int(round(74.2812 * GIB))
    m = parse_log((CORPUS_DIR / "logs" / "h100_gpt-oss-120b_marlin_v0.10.1.log").read_text())
    assert (m.mxfp4_backend, m.kv_cache_bytes, m.weights_bytes) == ("marlin", int(round(-2.14 * GIB)),
                                                                    int(round(65.9651 * GIB)))
    t = parse_log((CORPUS_DIR / "logs" / "h100_gpt-oss-120b_triton_v0.14.1.log").read_text())
    assert (t.mxfp4_backend, t.weights_bytes) == ("triton", int(round(64.38 * GIB)))


def _rows() -> list[dict]:
    with open(CORPUS_DIR / "hybrid.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def test_every_hybrid_row_is_held_out_and_sourced():
    rows = _rows()
    assert rows and all(r["split"] == "held-out" and r["source_url"] and (CORPUS_DIR / r["fixture"]).is_file()
                        for r in rows)


@pytest.mark.parametrize("row", _rows(), ids=lambda r: r["id"])
def test_published_rows_within_tolerance(row):
    """Weights within 0.5 % (gpt-oss: the swizzle's own padding in triton_kernels is not modelled, -0.29 %);
    Qwen3-Next's tokens within 2.5 % end to end (its non-torch default, 0.20 GiB for 0.10 at tp 2, is 1.18 GiB
    under the 1.38 logged, the activation 0.36 over) and exact from the logged memory."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from published_vllm import run_row

    got = run_row(row, CORPUS_DIR)
    assert not got["error"]
    assert abs(got["weights_err_pct"]) < 0.5
    if row["kv_cache_tokens"]:
        assert abs(got["KV tokens_err_pct"]) < 2.5
        assert got["kv_rules_err_pct"] == 0
    if row["kv_cache_gib"] and float(row["kv_cache_gib"]) < 0:  # vLLM refused to start: so does the estimate
        assert got["KV tokens_vramcal"] == 0 and got["KV memory_vramcal"] < 0


@pytest.mark.parametrize("extra", [["--vllm-version", "0.33"], ["--vllm-version", "0.10.1"],
                                   ["--vllm-version", "0.20", "--mamba-ssm-cache-dtype", "int4"],
                                   ["--vllm-version", "0.20", "--mxfp4-backend", "triton"]],
                         ids=lambda x: " ".join(x))
def test_cli_bad_hybrid_input_is_one_line_and_exit_2(extra, capsys):
    """Qwen3-Next on 0.33 with prefix caching (on by default), before 0.10.2, an unknown state dtype, an
    MXFP4 backend for a checkpoint that is not MXFP4: one line each, exit 2."""
    from vramcal.cli import main

    rc = main(["estimate", "qwen3-next-80b-a3b", "--engine", "vllm", "--gpu-memory", "79.19GiB", "-tp", "4",
               "--no-correction", *extra])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("vramcal: ") and "\n" not in err, err


def test_cli_prints_the_hybrid_prediction_with_prefix_caching_off(capsys):
    from vramcal.cli import main

    rc = main(["estimate", "qwen3-next-80b-a3b", "--engine", "vllm", "--gpu-memory", "79.19GiB", "-tp", "4",
               "--vllm-version", "0.33", "--no-enable-prefix-caching", "--max-model-len", "32768", "--no-correction"])
    out = capsys.readouterr().out
    assert rc == 0 and "Setting attention block size to 272 tokens" in out and "GPU KV cache size:" in out
