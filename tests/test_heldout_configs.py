"""Full-size configs of real models that vramcal was never developed against (not in the catalog):
random weights at their real widths, a real nf4 load, a real generate. Weights must match to the
byte; the KV cache within 0.5 % (it matches exactly today).

Weights are counted before the first forward: on the CPU, bitsandbytes repacks 4-bit weights for its
CPU kernel at the first forward (``_convert_weight_packed_for_cpu``), which the CUDA path never does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import cache_bytes, held_tensors
from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

from vramcal.estimator.estimate import NEW_TOKENS, estimate

HELDOUT = Path(__file__).parent / "data" / "heldout"
pytestmark = pytest.mark.slow


def _checkpoint(name: str, root: Path, tie: bool) -> str:
    cfg_dict = json.loads((HELDOUT / f"{name}.json").read_text())
    cfg_dict.pop("_source")
    cfg = AutoConfig.for_model(cfg_dict.pop("model_type"), **cfg_dict)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model = model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    if tie:  # like a published tied checkpoint: lm_head is not stored
        model.tie_weights()
    path = root / name
    model.save_pretrained(path)
    return str(path)


# gemma-3-1b: ctx beyond its 512-token window. qwen3 is saved with both embedding tensors stored, as some
# fine-tunes publish them: transformers then leaves lm_head untied, and so must the estimate.
@pytest.mark.parametrize("name,ctx,tie", [("smollm2-360m", 160, True), ("qwen3-0.6b", 160, False),
                                          ("gemma-3-1b", 560, True)])
def test_full_size_config(tmp_path, name, ctx, tie):
    path = _checkpoint(name, tmp_path, tie)
    qc = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                            bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=qc, device_map="cpu", dtype=torch.bfloat16)
    truth_weights = sum(held_tensors(model).values())  # before the first forward: see the note below
    ids = torch.randint(3, 1000, (1, ctx - NEW_TOKENS))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                         min_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True, pad_token_id=0)
    truth_kv = cache_bytes(out.past_key_values)
    e = estimate(path, "nf4-dq", ctx=ctx, batch=1, device="cpu", exact=False)
    assert e.components["weights"] == truth_weights
    assert abs(e.components["kv_cache"] - truth_kv) <= 0.005 * truth_kv
