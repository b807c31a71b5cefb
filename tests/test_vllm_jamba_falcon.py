"""vLLM's KV cache for Jamba (Mamba-1 layers among attention layers) and Falcon-H1 (a Mamba-2 mixer and an
attention layer side by side in every decoder layer), issue 23: the state pages, the unified page and the
blocks against vLLM's own arithmetic (``mamba_utils.py``, ``jamba.py``, ``falcon_h1.py``, the page rule of
``HybridAttentionMambaModelConfig``), worked by hand below.

Configs (tests/data/vllm/): ``jamba-1.5-mini.json`` is ai21labs/AI21-Jamba-1.5-Mini's config.json as a
public test file quotes it; ``falcon-h1-0.5b.json`` the Falcon-H1 0.5B config NVIDIA's Megatron-Bridge tests
quote, with ``mamba_d_ssm`` 1536 added: the quote leaves it out, and transformers' FalconH1Config requires
``mamba_n_heads x mamba_d_head`` (24 x 64) to equal it (its default, 1024, would be refused)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vramcal.errors import UserError
from vramcal.estimator.vllm import kv as K
from vramcal.estimator.vllm import mamba as H
from vramcal.estimator.vllm.arch import arch_of
from vramcal.estimator.vllm.engine import VllmArgs, estimate_vllm
from vramcal.estimator.vllm.shapes import role_of

DATA = Path(__file__).resolve().parent / "data" / "vllm"
JAMBA, FALCON = str(DATA / "jamba-1.5-mini.json"), str(DATA / "falcon-h1-0.5b.json")
GIB = 1024**3
H100 = int(79.19 * GIB)


def _cfg(path: str) -> dict:
    return json.loads(Path(path).read_text())


def _est(model, **kw):
    base = dict(gpu_memory_bytes=H100, max_model_len=16384, vllm_version="0.19.1")
    return estimate_vllm(model, VllmArgs(**{**base, **kw}))


def test_jamba_layers_and_mamba1_state_as_jamba_py_sizes_them():
    a = arch_of(_cfg(JAMBA))
    assert [i for i, k in enumerate(a.layer_kinds) if k == "full"] == [4, 12, 20, 28]  # i % 8 == 4
    assert a.layer_kinds.count("mamba") == 28 and a.ropes == ()  # Jamba's attention has no rotary embedding
    # mamba1_state_shape: intermediate = mamba_expand x hidden = 8192; conv (4 - 1) x 8192 / tp, SSM 8192 / tp x 16
    one = H.state_shape("JambaForCausalLM", _cfg(JAMBA), 1)
    assert (one.family, one.conv_elems, one.ssm_elems, one.chunk_size) == ("mamba1", 24_576, 131_072, 2048)
    two = H.state_shape("JambaForCausalLM", _cfg(JAMBA), 2)
    assert (two.conv_elems, two.ssm_elems) == (12_288, 65_536)
    # mamba_mixer.py: x_proj is row-parallel, dt_proj column-parallel, A [intermediate, state] split with it
    assert role_of("model.layers.0.mamba.x_proj.weight", 2, False, False) == ("row", True)
    assert role_of("model.layers.0.mamba.dt_proj.weight", 2, False, False) == ("col", True)
    assert role_of("model.layers.0.mamba.A_log", 2, False, False)[0] == "col"


def test_jamba_page_blocks_and_tokens_at_tp2_on_0_19():
    """State per rank (12,288 + 65,536) x 2 B = 155,648 B; attention 2 x 8/2 x 128 x 2 = 2,048 B a token, so the
    block is 16 x cdiv(155,648, 16 x 2,048) = 80 tokens and the page 163,840 B (+5.26 %); 4 attention + 28
    Mamba layers: group size 4 (28 > 1.5 x 4), 8 groups; num_blocks = available // (page x 4); up to 0.19 the
    tokens are num_blocks // 8 x 80."""
    e = _est(JAMBA, tensor_parallel_size=2)
    assert e.fits and (e.block_size, e.page_bytes, e.hybrid_groups) == (80, 163_840, 8)
    assert e.num_blocks == e.kv_cache_bytes // (163_840 * 4)
    assert e.kv_cache_tokens == e.num_blocks // 8 * 80
    assert "mamba1 state 12,288 conv + 65,536 state" in e.methods["kv_cache"]
    assert e.log_lines[0] == ("Setting attention block size to 80 tokens to ensure that attention page size is >= "
                              "mamba page size.")


def test_falcon_h1_every_layer_holds_attention_and_a_mamba2_state():
    """falcon_h1.py: FalconH1ParallelHybrid has both a self-attention and a Mamba-2 layer. State per rank:
    conv 3 x (1,536 + 2 x 1 x 128) = 5,376, SSM 24 x 64 x 128 = 196,608; x 2 B = 403,968 B; attention 2 x 2 x 64
    x 2 = 512 B a token: block 16 x cdiv(403,968, 8,192) = 800, page 409,600 B; 36 + 36 layers: 2 groups of 36."""
    a = arch_of(_cfg(FALCON))
    assert a.layer_kinds == ("parallel",) * 36
    e = _est(FALCON)
    assert e.fits and (e.block_size, e.page_bytes, e.hybrid_groups) == (800, 409_600, 2)
    assert e.num_blocks == e.kv_cache_bytes // (409_600 * 36) and e.kv_cache_tokens == e.num_blocks // 2 * 800
    # at tp 2 the one group is replicated to two (extra_groups_for_head_shards): conv 3 x (1,536 + 2 x 2 x 128) / 2
    s = H.state_shape("FalconH1ForCausalLM", _cfg(FALCON), 2)
    assert (s.conv_elems, s.ssm_elems, s.chunk_size) == (3_072, 98_304, 128)
    # two pipeline stages: 18 decoder layers, 36 cache layers each
    specs = K.layer_specs(a, 1, 2, 800, (0, 19, 1), H.unify(403_968, 512, "none", 128, 16384, None, (0, 19, 1)))
    assert len(K.flat(specs[:18])) == 36 and {s.kind for s in K.flat(specs)} == {"full", "mamba"}
    pp = _est(FALCON, pipeline_parallel_size=2)
    assert pp.fits and pp.hybrid_groups == 2 and pp.block_bytes == 409_600 * 18


def test_prefix_caching_modes_of_the_two_by_version():
    # SupportsMambaPrefixCaching (jamba.py, falcon_h1.py: 0.15.1, 0.19.1, 0.27.1): mode "all" when on, 0.26-0.31
    assert H.cache_mode((0, 27, 1), "JambaForCausalLM", None) == "all"
    assert H.cache_mode((0, 27, 1), "FalconH1ForCausalLM", None) == "all"
    # 0.32 on: align; only Mamba-2 layers add a prefill checkpoint page (mamba_mixer2.py)
    assert H.cache_mode((0, 33, 0), "JambaForCausalLM", None) == "align"
    assert H.cache_mode((0, 33, 0), "FalconH1ForCausalLM", None) == "align+checkpoint"
    # "all" at tp 2 on 0.27: the block a multiple of lcm(mamba_chunk_size 128, 16): cdiv(202,752 / 256) = 792 -> 896
    f = _est(FALCON, tensor_parallel_size=2, vllm_version="0.27.1")
    assert (f.block_size, f.page_bytes) == (896, 896 * 256)
    # Jamba names no chunk: vLLM's get_mamba_chunk_size gives 2048, so the block is 2048 tokens
    assert _est(JAMBA, tensor_parallel_size=4, vllm_version="0.27.1").block_size == 2048


def test_a_dense_hybrid_stays_on_the_v1_runner_and_its_graphs_come_off_the_budget_on_0_26():
    """config/vllm.py (0.26): the V2 model runner by default for dense non-hybrid models only; Falcon-H1 is a
    dense hybrid, so the V1 runner's CUDA-graph estimate comes off its budget."""
    assert _est(FALCON, vllm_version="0.26.0").cuda_graph_subtracted
    assert not estimate_vllm("llama-3.1-8b", VllmArgs(gpu_memory_bytes=H100, max_model_len=8192,
                                                      vllm_version="0.26.0")).cuda_graph_subtracted


@pytest.mark.parametrize("model", [JAMBA, FALCON], ids=["jamba", "falcon-h1"])
def test_before_0_10_2_they_are_refused_in_one_line(model):
    with pytest.raises(UserError, match="0.10.2") as info:
        _est(model, vllm_version="0.10.1", tensor_parallel_size=2 if model == JAMBA else 1)
    assert "\n" not in str(info.value)
