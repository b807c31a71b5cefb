"""The estimate's contract: JSON shape, stage order, catalog, the torch-free cached path."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vramcal.estimator.catalog import PARAMS, catalog_rows
from vramcal.estimator.estimate import estimate
from vramcal.estimator.inventory import inventory
from vramcal.estimator.quant import resolve_quant
from vramcal.estimator.resolve import catalog_names, resolve_model


def test_catalog_has_the_popular_families():
    names = catalog_names()
    assert len(names) >= 15
    for family in ("llama-3.1", "qwen2.5", "qwen3", "qwen3-30b-a3b", "mistral", "mixtral", "gemma-2", "gemma-3",
                   "phi-3", "phi-4", "deepseek-v2-lite"):
        assert any(n.startswith(family) for n in names), family
    assert {r["name"] for r in catalog_rows()} == set(names)


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_catalog_configs_build_with_published_parameter_counts(name):
    source = resolve_model(name)
    inv = inventory(source, resolve_quant("bf16", source.config), use_cache=False)
    assert inv.params == PARAMS[name]
    assert inv.tensor_bytes >= 2 * inv.params  # bf16, plus float32 rotary buffers


def test_json_contract(tiny_models):
    r = subprocess.run([sys.executable, "-m", "vramcal", "estimate", tiny_models["dense-gqa"], "--quant", "nf4",
                        "--ctx", "128", "--batch", "2", "--json"], capture_output=True, text=True, env=os.environ)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    for key in ("model", "quant", "ctx", "batch", "components", "stages", "peak", "approximate"):
        assert key in d
    assert set(d["components"]) == {"weights", "kv_cache", "activations", "runtime"}
    assert set(d["stages"]) == {"load_peak", "post_load", "first_token", "end"}
    assert all(isinstance(v, int) for v in list(d["components"].values()) + list(d["stages"].values()))
    s = d["stages"]  # on CUDA the caching allocator keeps what it reserved: running peaks
    assert s["load_peak"] <= s["post_load"] <= s["first_token"] <= s["end"] == d["peak"]
    assert d["approximate"] is False
    assert d["quant"] == "nf4" and d["ctx"] == 128 and d["batch"] == 2


def test_kv_and_activations_grow_with_context(tiny_models):
    small = estimate(tiny_models["dense-gqa"], "nf4", ctx=128)
    large = estimate(tiny_models["dense-gqa"], "nf4", ctx=1024)
    assert large.components["kv_cache"] == pytest.approx(small.components["kv_cache"] * 1023 / 127, rel=1e-9)
    assert large.components["activations"] > small.components["activations"]
    assert large.components["weights"] == small.components["weights"]


def test_eager_attention_scores_grow_quadratically(tiny_models):
    sdpa = estimate(tiny_models["dense-gqa"], "auto", ctx=2064, attn="sdpa")
    eager = estimate(tiny_models["dense-gqa"], "auto", ctx=2064, attn="eager")
    scores = 1 * 4 * 2048 * 2048 * 2  # batch x heads x seq x seq, bf16
    assert eager.components["activations"] - sdpa.components["activations"] >= scores


def test_cached_estimate_does_not_import_torch(tiny_models, tmp_path):
    from vramcal.records.store import Store

    Store(tmp_path / "records.db").close()  # a records database exists: the correction lookup must stay torch-free
    env = {**os.environ, "VRAMCAL_CACHE": str(tmp_path / "c"), "VRAMCAL_DB": str(tmp_path / "records.db")}
    args = [sys.executable, "-c",
            "import sys, json; from vramcal.cli import main; rc = main(sys.argv[1:]); "
            "print('TORCH' if 'torch' in sys.modules else 'NOTORCH', file=sys.stderr); sys.exit(rc)",
            "estimate", tiny_models["dense-gqa"], "--quant", "nf4", "--ctx", "300", "--json"]
    first = subprocess.run(args, capture_output=True, text=True, env=env)
    assert first.returncode == 0 and "TORCH" in first.stderr.split()
    again = subprocess.run(args, capture_output=True, text=True, env=env)
    assert again.returncode == 0 and again.stderr.split()[-1] == "NOTORCH", again.stderr
    assert json.loads(again.stdout)["stages"] == json.loads(first.stdout)["stages"]
    # the first --fast traces the fit points once (an exact first estimate traces only its own point) ...
    fit = subprocess.run(args[:-3] + ["--ctx", "700", "--fast", "--json"], capture_output=True, text=True, env=env)
    assert fit.returncode == 0 and fit.stderr.split()[-1] == "TORCH", fit.stderr
    # ... and every later --fast point of the same model is arithmetic on the cached fit
    for ctx in ("1500", "3000"):
        other = subprocess.run(args[:-3] + ["--ctx", ctx, "--fast", "--json"], capture_output=True, text=True, env=env)
        assert other.returncode == 0 and other.stderr.split()[-1] == "NOTORCH", other.stderr


def test_already_quantized_checkpoint_refuses_other_quant(tmp_path):
    d = tmp_path / "gptq"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "torch_dtype": "float16",
        "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}}))
    from vramcal.errors import UserError

    with pytest.raises(UserError, match="already quantized"):
        estimate(str(d), "nf4", ctx=64)
    e = estimate(str(d), "auto", ctx=64)
    assert e.quant == "gptq-4bit" and e.approximate
    # the load stage is the packed weights, not the 16-bit size of a model built without the GPTQ library
    # (transformers' pre-load reservation was once sized from it: 2.7x too high on Qwen2.5-7B-GPTQ)
    from vramcal.estimator.runtime import CUDA_DEFAULT

    assert e.stages["load_peak"] - CUDA_DEFAULT.context_bytes <= CUDA_DEFAULT.reserve(e.allocated["load_peak"])
    # qweight of q_proj: in 256 * 4 bits / 32 -> 32 int32 rows x 256 columns
    assert e.weights_breakdown["quantized"] > 0


def test_sweep_agrees_with_estimate_at_traced_points(tiny_models):
    from vramcal.estimator.estimate import Estimator

    source = resolve_model(tiny_models["dense-gqa"])
    est = Estimator(source, resolve_quant("nf4", source.config))
    single = est.estimate(528, 1)  # traced exactly (prompt 512 is also a fit point)
    rows = est.sweep([(528, 1), (2064, 1), (8208, 1)])
    assert rows[0].peak == single.peak
    assert rows[0].stages["first_token"] == single.stages["first_token"]
    assert [r.peak for r in rows] == sorted(r.peak for r in rows)


def test_estimating_leaves_the_config_untouched():
    source = resolve_model("llama-3.1-8b")
    before = source.config_hash
    inventory(source, resolve_quant("nf4", source.config), use_cache=False)
    assert source.config_hash == before


def test_sweep_agrees_with_estimate_for_sliding_windows(tiny_models):
    """Right after the prefill a dynamic sliding-window layer still holds the whole prompt's storage;
    the sweep must count it as the traced estimate does (window 24, prompt 512)."""
    from vramcal.estimator.estimate import Estimator

    source = resolve_model(tiny_models["sliding"])
    est = Estimator(source, resolve_quant("auto", source.config), device="cpu")
    single = est.estimate(528, 1)
    assert est.sweep([(528, 1)])[0].stages["first_token"] == single.stages["first_token"]
