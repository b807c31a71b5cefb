"""KV cache: the estimate equals what a real ``generate`` leaves in transformers' cache."""

from __future__ import annotations

import pytest
import torch
from helpers import cache_bytes
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from vramcal.estimator.estimate import NEW_TOKENS, estimate


def _generate_cache(path: str, prompt: int, batch: int, quant: str = "auto", new_tokens: int = NEW_TOKENS, **gen):
    qc = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                            bnb_4bit_compute_dtype=torch.bfloat16) if quant == "nf4" else None
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=qc, device_map="cpu", dtype=torch.bfloat16)
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True,
                         pad_token_id=0, **gen)
    assert out.sequences.shape == (batch, prompt + new_tokens)
    return out.past_key_values


@pytest.mark.parametrize("arch", ["dense-gqa", "tied", "sliding", "moe", "mla"])
@pytest.mark.parametrize("ctx,batch", [(80, 1), (96, 3)])
def test_kv_cache_equals_generate(tiny_models, arch, ctx, batch):
    cache = _generate_cache(tiny_models[arch], ctx - NEW_TOKENS, batch)
    e = estimate(tiny_models[arch], "auto", ctx=ctx, batch=batch, device="cpu")
    assert e.components["kv_cache"] == cache_bytes(cache)


@pytest.mark.parametrize("arch", ["dense-gqa", "sliding", "mla"])
@pytest.mark.parametrize("prompt,new_tokens", [(40, 1), (40, 57), (8, 100)])
def test_kv_cache_equals_generate_with_new_tokens(tiny_models, arch, prompt, new_tokens):
    """--new-tokens N: the cache at the end holds prompt + N - 1 positions, to the byte (the sliding
    window of 24 is crossed by the longer answers)."""
    cache = _generate_cache(tiny_models[arch], prompt, 2, new_tokens=new_tokens)
    e = estimate(tiny_models[arch], "auto", prompt=prompt, new_tokens=new_tokens, batch=2, device="cpu")
    assert (e.ctx, e.prompt, e.new_tokens) == (prompt + new_tokens, prompt, new_tokens)
    assert e.components["kv_cache"] == cache_bytes(cache)


def test_sliding_window_caps_the_cache(tiny_models):
    """Window 24 on 3 of 4 layers: at ctx 96 the cache is far below the full-attention formula."""
    e = estimate(tiny_models["sliding"], "auto", ctx=96, batch=1, device="cpu")
    full = e.formula.kv_cache_bytes
    assert e.components["kv_cache"] < 0.5 * full
    assert e.kv_breakdown["DynamicSlidingWindowLayer"] > 0


def test_kv_with_quantized_weights_is_unchanged(tiny_models):
    cache = _generate_cache(tiny_models["dense-gqa"], 48, 2, quant="nf4")
    e = estimate(tiny_models["dense-gqa"], "nf4", ctx=64, batch=2, device="cpu")
    assert e.components["kv_cache"] == cache_bytes(cache)


def test_static_cache_preallocates(tiny_models):
    from transformers import StaticCache

    path = tiny_models["dense-gqa"]
    model = AutoModelForCausalLM.from_pretrained(path, device_map="cpu", dtype=torch.bfloat16)
    ctx = 64
    cache = StaticCache(config=model.config, max_cache_len=ctx)
    ids = torch.randint(3, 1000, (1, ctx - NEW_TOKENS))
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                   do_sample=False, cache=cache, pad_token_id=0)
    e = estimate(path, "auto", ctx=ctx, batch=1, cache="static", device="cpu")
    assert e.components["kv_cache"] == cache_bytes(cache)


def test_fp8_quantized_cache(tiny_models):
    from transformers import QuantizedCache

    path = tiny_models["dense-gqa"]
    model = AutoModelForCausalLM.from_pretrained(path, device_map="cpu", dtype=torch.bfloat16)
    ctx, batch = 80, 2
    cache = QuantizedCache(backend="fp8", config=model.config)
    ids = torch.randint(3, 1000, (batch, ctx - NEW_TOKENS))
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                   do_sample=False, cache=cache, pad_token_id=0)
    e = estimate(path, "auto", ctx=ctx, batch=batch, kv_dtype="fp8", device="cpu")
    bf16 = estimate(path, "auto", ctx=ctx, batch=batch, device="cpu")
    assert e.components["kv_cache"] == cache_bytes(cache)
    assert e.components["kv_cache"] != bf16.components["kv_cache"]
