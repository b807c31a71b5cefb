"""--engine vllm on the fourth blind collection of issue 27 (benchmarks/published/vllm/heldout-2026-12-04.csv):
two startups collected and committed (b036b1a) before vramcal was run on either, run once, with nothing changed
from what the run showed."""

from __future__ import annotations

import sys

import pytest

from helpers import BlindCollection

BLIND_SET = BlindCollection("heldout-2026-12-04.csv")
ROOT, CORPUS_DIR, BLIND, ROWS = BLIND_SET.root, BLIND_SET.corpus_dir, BLIND_SET.path, BLIND_SET.rows
_results = BLIND_SET.results


def test_the_rows_are_blind_held_out_startups_with_sources_fixtures_and_configs():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from published_vllm import BLIND_COLLECTIONS, model_ref
    from vramcal.estimator.resolve import resolve_model

    assert BLIND.name in BLIND_COLLECTIONS
    assert len(ROWS) == 2
    for r in ROWS:
        assert r["split"] == "held-out" and not r["examined"], r["id"]
        assert r["source_url"] and (CORPUS_DIR / r["fixture"]).is_file(), r["id"]
        assert int(r["kv_cache_tokens"]) > 0, r["id"]
        assert resolve_model(model_ref(r, CORPUS_DIR)).config, r["id"]


def test_kv_bytes_per_token_of_the_configs_match_their_logs():
    """The logged KV memory over the logged tokens is what each row's config gives: layers x KV heads (per tp rank)
    x head size x 2 x 2 B, read from the config vramcal resolves (the catalog's Qwen2.5-7B-AWQ: 28 x 4 x 128; the new
    configs/qwen3-coder-30b-a3b.json: 48 x 4 x 128, one KV head a rank at tp 4), within the GiB figure's rounding."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from published_vllm import model_ref
    from vramcal.estimator.resolve import resolve_model

    for r in ROWS:
        cfg = resolve_model(model_ref(r, CORPUS_DIR)).config
        head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        per_token = cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head * 2 * 2 // int(r["tp"])
        implied = float(r["kv_cache_gib"]) * 1024**3 / int(r["kv_cache_tokens"])
        rounding = 0.05 if len(r["kv_cache_gib"].split(".")[-1]) == 1 else 0.005
        assert abs(implied / per_token - 1) < rounding / float(r["kv_cache_gib"]) + 1e-3, r["id"]


def test_blind_figures_are_the_reported_ones():
    """Run once after the file was committed (docs/validation.md, docs/vllm.md "Eighth round"): KV tokens -1.18 %
    (RTX 4080, 0.26: the cold compile's benchmark, 1.04 GiB, is the activation the notes print, 1.04; weights 1.8 %
    short, the AWQ gap, and non-torch 0.25 priced against the notes' 0.06) and +0.35 % (4x L40S, 0.24, Qwen3 MoE at
    tp 4; -0.41 % with the CUDA-graph default unscaled, before this round). The KV rules from the logged memory:
    within 0.06 %. Pinned so that a later change that moves them shows here."""
    res = _results()
    assert not any(r["error"] for r in res.values())
    want = {"rtx4080_qwen2.5-7b-awq_u0.90_len32768_v0.26.0": -1.18, "4xl40s_qwen3-coder-30b-a3b_tp4_len32768_v0.24.0": 0.35}
    for rid, pct in want.items():
        assert res[rid]["KV tokens_err_pct"] == pytest.approx(pct, abs=0.02), rid
        assert abs(res[rid]["kv_rules_err_pct"]) < 0.06, rid
    assert res["rtx4080_qwen2.5-7b-awq_u0.90_len32768_v0.26.0"]["activation_err_gib"] == pytest.approx(0.0, abs=0.01)
