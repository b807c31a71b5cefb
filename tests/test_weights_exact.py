"""Weights: the estimate equals, to the byte, every tensor a real ``from_pretrained`` leaves loaded."""

from __future__ import annotations

import pytest
import torch
from helpers import held_tensors
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from vramcal.estimator.estimate import estimate
from vramcal.estimator.inventory import inventory
from vramcal.estimator.quant import resolve_quant
from vramcal.estimator.resolve import resolve_model

QUANTS = ["auto", "nf4", "nf4-dq", "fp4", "fp4-dq", "int8"]


def _load(path: str, quant: str):
    spec = resolve_quant(quant, resolve_model(path).config)
    kwargs = spec.bnb_config_kwargs()
    if kwargs and "bnb_4bit_compute_dtype" in kwargs:
        kwargs["bnb_4bit_compute_dtype"] = getattr(torch, kwargs["bnb_4bit_compute_dtype"])
    qc = BitsAndBytesConfig(**kwargs) if kwargs else None
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=qc, device_map="cpu",
                                                dtype=getattr(torch, spec.dtype))


@pytest.mark.parametrize("arch", ["dense-gqa", "tied", "sliding", "moe", "mla"])
@pytest.mark.parametrize("quant", QUANTS)
def test_weights_equal_loaded_tensors(tiny_models, arch, quant):
    path = tiny_models[arch]
    model = _load(path, quant)
    truth = held_tensors(model)
    source = resolve_model(path)
    inv = inventory(source, resolve_quant(quant, source.config), use_cache=False)
    assert inv.tensor_bytes == sum(truth.values())
    assert sum(inv.alloc_sizes.values()) == len(truth)  # same number of allocations, for allocator rounding
    assert sorted(s for s, n in inv.alloc_sizes.items() for _ in range(n)) == sorted(truth.values())
    assert not inv.approximate and inv.method == "meta"


def test_quantization_really_happened(tiny_models):
    """Guard against a silent no-op: nf4 must hold far fewer bytes than bf16 for a dense model."""
    bf16 = sum(held_tensors(_load(tiny_models["dense-gqa"], "auto")).values())
    nf4 = sum(held_tensors(_load(tiny_models["dense-gqa"], "nf4")).values())
    assert nf4 < 0.8 * bf16


def test_moe_experts_stay_16bit_and_are_explained(tiny_models):
    e = estimate(tiny_models["moe"], "nf4", ctx=64)
    assert e.weights_breakdown["experts"] > 0
    assert any("fused MoE experts" in d for d in e.differences)
    assert any("stay in bfloat16" in n for n in e.notes)


def test_tied_embeddings_counted_once(tiny_models):
    e = estimate(tiny_models["tied"], "nf4", ctx=64)
    assert "lm_head" not in e.weights_breakdown  # the tied head is the embedding, counted once
    assert e.weights_breakdown["embeddings"] == 1200 * 128 * 2


def test_inventory_cache_roundtrip(tiny_models):
    source = resolve_model(tiny_models["dense-gqa"])
    spec = resolve_quant("nf4-dq", source.config)
    first = inventory(source, spec)
    again = inventory(source, spec)  # from disk now
    assert again == first
