"""The dry run's bookkeeping, and the meta-device trace against the same forward on real tensors.

What is checked here: the allocation tracker's arithmetic (512-byte rounding, views, in-place ops,
lifetimes), and that running the model on meta tensors allocates exactly what running it on real CPU
tensors allocates, op for op. What is *not* checkable without a GPU: that the CUDA kernels allocate
what the stand-ins say; the GPU validation script measures that (docs/accounting.md).
"""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, DynamicCache

from vramcal.estimator.dryrun import AllocationTracker, round_alloc, trace_model
from vramcal.estimator.estimate import Estimator
from vramcal.estimator.quant import resolve_quant
from vramcal.estimator.resolve import resolve_model


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_tracker_counts_storages_not_views(device):
    with AllocationTracker(device) as t:
        a = torch.empty(1000, device=device)  # 4000 B -> 4096
        b = a.view(10, 100)  # a view: nothing new
        a.add_(1)  # in place: nothing new
        c = a + 1  # new storage
        assert t.current == 2 * 4096
        del a
        gc.collect()
        assert t.current == 2 * 4096  # b still holds the storage
        del b
        gc.collect()
        assert t.current == 4096
        d = torch.empty(3, device=device)
        assert t.current == 4096 + 512  # the smallest block is 512 bytes
        del c, d
        gc.collect()
    assert t.current == 0 and t.peak == 2 * 4096


def test_tracker_ignores_other_devices():
    with AllocationTracker("meta") as t:
        host = torch.tensor(7)  # made on the CPU, as transformers makes window scalars
        dev = host.to("meta")
        assert t.current == 512
    del host, dev


def test_round_alloc():
    assert [round_alloc(n) for n in (0, 1, 512, 513, 4000)] == [0, 512, 512, 1024, 4096]


def _real(path, quant, attn):
    spec = resolve_quant(quant, resolve_model(path).config)
    kw = spec.bnb_config_kwargs()
    if kw and "bnb_4bit_compute_dtype" in kw:
        kw["bnb_4bit_compute_dtype"] = torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(path, device_map="cpu", dtype=torch.bfloat16,
                                                 quantization_config=BitsAndBytesConfig(**kw) if kw else None,
                                                 attn_implementation=attn)
    return model.eval(), spec


@pytest.mark.parametrize("arch", ["dense-gqa", "tied", "sliding", "mla"])
@pytest.mark.parametrize("quant", ["auto", "nf4"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_meta_trace_equals_real_tensor_trace(tiny_models, arch, quant, attn):
    path = tiny_models[arch]
    model, spec = _real(path, quant, attn)
    batch, seq = 2, 96
    real = trace_model(model, spec.method, torch.bfloat16, batch, seq, lambda: DynamicCache(config=model.config),
                       device="cpu")
    est = Estimator(resolve_model(path), spec, attn=attn, use_cache=False)
    est._ensure_dry_run(batch, seq, exact=True)
    meta = next(t for t in est._act.traces if t.batch == batch and t.tokens == seq)
    # One known difference, where meta behaves like CUDA and the CPU does not: each sliding-window cache
    # layer moves its window-length scalar to the device (`_sliding_window_tensor.to(device)`); on the
    # CPU that is a no-op, on CUDA and meta it is a new 512-byte block.
    moved = 512 * sum(1 for layer in getattr(model.config, "layer_types", None) or [] if layer == "sliding_attention")
    assert (meta.prefill_peak_bytes, meta.cache_bytes, meta.decode_peak_bytes) == \
        (real.prefill_peak_bytes + moved, real.cache_bytes + moved, real.decode_peak_bytes)
    assert meta.prefill_peak_bytes > meta.cache_bytes > 0


def test_cpu_target_traces_the_math_attention_mla_falls_back_to(tiny_models):
    """DeepSeek-V2's MLA has query and value head sizes of 24 and 16 here: the CPU's fused kernel cannot
    take that, torch runs the math kernel, and the CPU-target dry run must show its seq x seq scores,
    exactly as the same forward on real CPU tensors does."""
    path = tiny_models["mla"]
    model, spec = _real(path, "auto", "sdpa")
    batch, seq = 2, 96
    real = trace_model(model, spec.method, torch.bfloat16, batch, seq, lambda: DynamicCache(config=model.config),
                       device="cpu", target="cpu")
    cpu = Estimator(resolve_model(path), spec, attn="sdpa", use_cache=False, device="cpu")
    cpu._ensure_dry_run(batch, seq, exact=True)
    meta = next(t for t in cpu._act.traces if t.batch == batch and t.tokens == seq)
    assert (meta.prefill_peak_bytes, meta.decode_peak_bytes) == (real.prefill_peak_bytes, real.decode_peak_bytes)
    cuda = Estimator(resolve_model(path), spec, attn="sdpa", use_cache=False, device="cuda")
    cuda._ensure_dry_run(batch, seq, exact=True)
    fused = next(t for t in cuda._act.traces if t.batch == batch and t.tokens == seq)
    scores = batch * 4 * seq * seq * 2  # batch x heads x seq x seq, bf16
    assert meta.prefill_peak_bytes - fused.prefill_peak_bytes >= scores


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    """The conftest architectures with four layers (the sliding one eight, its Gemma 3 pattern twice)."""
    from conftest import TINY, save_tiny

    root = tmp_path_factory.mktemp("four")
    out = {}
    for name, cfg in TINY.items():
        if name == "sliding":
            cfg = {**cfg, "num_hidden_layers": 8, "layer_types": (["sliding_attention"] * 3 + ["full_attention"]) * 2}
        out[name] = save_tiny(name, {**cfg, "num_hidden_layers": max(cfg["num_hidden_layers"], 4)}, root)
    return out


@pytest.mark.parametrize("arch", ["dense-gqa", "tied", "moe", "mla", "sliding"])
@pytest.mark.parametrize("quant", ["bf16", "nf4", "int8"])
def test_a_trace_by_layer_kinds_equals_the_whole_models(four_layers, arch, quant):
    """One pair of layers per kind, the rest from the KV layout: the same prefill peak, held cache and decode
    peak as tracing every layer (MLA's keys and values differ in size, so the halves of a token's growth
    are rounded apart: within the allocator's rounding there). A sliding window is traced whole."""
    from vramcal.estimator.dryrun import DryRunner

    s = resolve_model(four_layers[arch])
    r = DryRunner(s, resolve_quant(quant, s.config))
    assert bool(r.kinds()) == (arch != "sliding")
    assert r.kinds() == ([0, 3] if arch == "mla" else [3] if arch != "sliding" else [])
    for batch, seq in ((1, 64), (2, 300), (1, 4096)):
        whole = trace_model(r.model, r.quant.method, r.dtype, batch, seq, lambda: r._new_cache(seq + 16))
        kinds = r.trace(batch, seq)
        got = (kinds.prefill_peak_bytes, kinds.cache_bytes, kinds.decode_peak_bytes)
        want = (whole.prefill_peak_bytes, whole.cache_bytes, whole.decode_peak_bytes)
        if arch == "mla":
            assert all(abs(g - w) <= 2 * 512 * 4 for g, w in zip(got, want)), (batch, seq, got, want)
        else:
            assert got == want, (batch, seq)
        assert kinds.layers == (len(r.kinds()) or None)


@pytest.mark.parametrize("arch", ["dense-gqa", "tied", "moe", "mla", "sliding"])
def test_the_kv_layout_by_layer_kinds_equals_the_whole_models(four_layers, arch):
    from vramcal.estimator.dryrun import DryRunner

    s = resolve_model(four_layers[arch])
    r = DryRunner(s, resolve_quant("nf4", s.config))
    assert r.kv_layers() == r._measure_kv(1)
