"""Pre-quantized checkpoints (issue 23), priced as the installed transformers loads them.

Each test writes a tiny checkpoint in the format's own layout (fp8 blocks with their ``weight_scale_inv``,
MXFP4 ``*_blocks`` / ``*_scales``), then checks the estimate against the truth of each path:
- the path kept as stored (a GPU that runs the format): the checkpoint's safetensors headers, to the byte
  (the estimate adds only the model's non-persistent buffers, which no checkpoint stores);
- the dequantized path (a GPU below the format's compute capability, the CPU, ``--quant bf16``): the model
  ``from_pretrained`` really loads here on the CPU (transformers dequantizes both formats on a CPU), to the byte.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vramcal.errors import UserError

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 256,
         "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "tie_word_embeddings": False, "max_position_embeddings": 4096, "head_dim": 64}
GPT_OSS = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "vocab_size": 1000, "hidden_size": 256,
           "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 64, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 128,
           "layer_types": ["sliding_attention", "full_attention"], "tie_word_embeddings": False,
           "max_position_embeddings": 4096}
MXFP4_QC = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"]}


def _save(cfg_dict, path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(cfg_dict["model_type"], **{k: v for k, v in cfg_dict.items() if k != "model_type"})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(path)


def _rewrite(path, convert, quantization_config, drop_dtype=False):
    from safetensors.torch import load_file, save_file

    sd = load_file(f"{path}/model.safetensors")
    out = {}
    for k, v in sd.items():
        out.update(convert(k, v))
    save_file(out, f"{path}/model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    if drop_dtype:
        cfg.pop("dtype", None)
        cfg.pop("torch_dtype", None)
    cfg["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def fp8_block(tmp_path_factory):
    """Llama with every projection in block fp8 (128 x 128 blocks), its inverse scales stored in bf16 as
    Qwen3-8B-FP8 stores them (DeepSeek-V3 stores float32; transformers holds float32 either way)."""
    import torch

    path = tmp_path_factory.mktemp("fp8") / "m"
    _save(LLAMA, path)

    def convert(k, v):
        if not k.endswith("proj.weight"):
            return {k: v}
        o, i = v.shape
        w = v.float().reshape(o // 128, 128, i // 128, 128)
        scale = (w.abs().amax(dim=(1, 3)).clamp(min=1e-6) / 448.0)
        q = (w / scale[:, None, :, None]).reshape(o, i).to(torch.float8_e4m3fn)
        return {k: q, k + "_scale_inv": scale.to(torch.bfloat16).contiguous()}

    _rewrite(path, convert, {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                             "weight_block_size": [128, 128]})
    return path


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    """gpt-oss with MXFP4 experts (packed FP4 blocks, E8M0 scales) and no dtype in its config, as gpt-oss ships."""
    import torch

    path = tmp_path_factory.mktemp("mxfp4") / "m"
    _save(GPT_OSS, path)
    gen = torch.Generator().manual_seed(0)

    def convert(k, v):
        if not k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            return {k: v}
        rows = 2 * GPT_OSS["intermediate_size"] if "gate_up" in k else GPT_OSS["hidden_size"]
        cols = GPT_OSS["hidden_size"] if "gate_up" in k else GPT_OSS["intermediate_size"]
        e = v.shape[0]
        return {k + "_blocks": torch.randint(0, 256, (e, rows, cols // 32, 16), dtype=torch.uint8, generator=gen),
                k + "_scales": torch.full((e, rows, cols // 32), 124, dtype=torch.uint8)}

    _rewrite(path, convert, MXFP4_QC, drop_dtype=True)
    return path


def _headers(path) -> int:
    from vramcal.estimator.checkpoint import checkpoint_tensors, tensor_bytes

    return sum(tensor_bytes(d, s) for d, s in checkpoint_tensors((str(path / "model.safetensors"),)).values())


def _loaded(path) -> int:
    """Bytes of every tensor the model from_pretrained loads on this CPU holds."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path))
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def _buffers(est) -> int:
    return est.weights_breakdown["buffers"]


def _est(path, quant="auto", gpu=None, device="cuda"):
    from vramcal.estimator.estimate import estimate
    from vramcal.probes.hardware import gpu_target

    return estimate(str(path), quant, ctx=256, device=device, gpu=gpu_target(gpu) if gpu else None, use_cache=False)


def test_fp8_kept_on_hopper_is_what_transformers_holds(fp8_block, monkeypatch):
    """Kept, the model holds the fp8 weights and float32 scales (FP8Linear's own dtype: the bf16 scales of
    the checkpoint are cast up). The CPU would take the dequantized path, so the GPU check of
    validate_environment is skipped for the load: loading runs no kernel."""
    from transformers import AutoModelForCausalLM
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    e = _est(fp8_block, gpu="H200")
    assert e.quant == "fp8"
    assert any("kept as stored" in n for n in e.notes)
    monkeypatch.setattr(FineGrainedFP8HfQuantizer, "validate_environment", lambda self, *a, **k: None)
    model = AutoModelForCausalLM.from_pretrained(str(fp8_block))
    held = {str(p.dtype) for p in model.parameters()}
    assert "torch.float8_e4m3fn" in held
    assert e.components["weights"] - _buffers(e) == sum(p.numel() * p.element_size() for p in model.parameters())
    scales = sum(p.numel() for n, p in model.named_parameters() if n.endswith("scale_inv"))
    assert e.components["weights"] - _buffers(e) == _headers(fp8_block) + 2 * scales  # bf16 stored, f32 held


@pytest.mark.parametrize("how", [{"gpu": "RTX 3090"}, {"gpu": "A100 80GB PCIe"}, {"device": "cpu"},
                                 {"quant": "bf16", "gpu": "H200"}])
def test_fp8_dequantized_equals_what_transformers_loads(fp8_block, how):
    e = _est(fp8_block, **how)
    assert e.quant.endswith("-dequantized")
    assert e.components["weights"] == _loaded(fp8_block)  # transformers dequantizes fp8 on a CPU: the same path
    assert e.components["weights"] > 1.4 * _headers(fp8_block)


def test_mxfp4_load_dtype_is_the_checkpoints_not_float32(mxfp4):
    """gpt-oss's config names no dtype: from_pretrained(dtype="auto") takes the checkpoint's first floating
    tensor (bf16), not float32 (the estimate priced gpt-oss-20b at 83.7 GB against 13.8 GB stored). The
    experts' biases are the exception: Mxfp4GptOssExperts declares them float32 and the loader casts to the
    declared dtype (a kept load here, its swizzle skipped, holds them float32), so they cost twice their
    stored bf16 bytes."""
    e = _est(mxfp4, gpu="H200")
    assert e.dtype == "bfloat16"
    biases = GPT_OSS["num_hidden_layers"] * GPT_OSS["num_local_experts"] * (2 * GPT_OSS["intermediate_size"]
                                                                            + GPT_OSS["hidden_size"])
    assert e.components["weights"] - _buffers(e) == _headers(mxfp4) + 2 * biases


def test_mxfp4_dequantized_below_turing_and_on_the_cpu(mxfp4):
    loaded = _loaded(mxfp4)
    for how in ({"gpu": "V100-SXM2-32GB"}, {"device": "cpu"}):
        e = _est(mxfp4, **how)
        assert e.quant.endswith("-dequantized")
        assert e.components["weights"] == loaded
    # gpt-oss's sliding layers: the real cache layers, not a formula over the whole context
    kept = _est(mxfp4, gpu="H200")
    assert not any("formula" in n for n in kept.notes)


FBGEMM_QC = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]}


@pytest.fixture(scope="module")
def fbgemm(tmp_path_factory):
    """Llama (with attention biases) in FBGEMM's fp8 layout, as Llama-3.1-405B-FP8 stores it: each projection's
    weight fp8 [out, in] and its row scales ``weight_scale`` float32 [out, 1]; lm_head and the rest 16-bit.
    The config says float16: FbgemmFp8HfQuantizer.update_dtype loads bfloat16 whatever it says."""
    import torch

    path = tmp_path_factory.mktemp("fbgemm") / "m"
    _save({**LLAMA, "attention_bias": True}, path)

    def convert(k, v):
        if not k.endswith("proj.weight"):
            return {k: v.to(torch.float16)}
        scale = v.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-6) / 448.0
        return {k: (v.float() / scale).to(torch.float8_e4m3fn), k + "_scale": scale}

    _rewrite(path, convert, FBGEMM_QC)
    cfg = json.loads((path / "config.json").read_text())
    cfg["dtype"] = "float16"
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_fbgemm_fp8_kept_is_its_meta_model_its_headers_and_its_load(fbgemm, monkeypatch):
    """transformers' own replace_with_fbgemm_fp8_linear on the meta model (fbgemm-gpu's op lookup answered
    with a placeholder, formats.FbgemmFP8): the estimate is the meta model's tensors to the byte; beside the
    headers it adds only the biases, which FbgemmFp8Linear declares float32 (stored float16 here). A real
    from_pretrained here, the GPU check and the op lookup skipped (loading runs no kernel), holds the same."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.quantizers.quantizer_fbgemm_fp8 import FbgemmFp8HfQuantizer

    import transformers.integrations.fbgemm_fp8 as fb
    from vramcal.estimator.meta import build_meta_model
    from vramcal.estimator.quant import resolve_quant
    from vramcal.estimator.resolve import resolve_model
    from vramcal.probes.hardware import gpu_target

    e = _est(fbgemm, gpu="H200")
    assert (e.quant, e.dtype) == ("fbgemm_fp8", "bfloat16") and any("kept as stored" in n for n in e.notes)
    source = resolve_model(str(fbgemm))
    model, _, _ = build_meta_model(source, resolve_quant("auto", source, gpu=gpu_target("H200")))
    kinds = {type(m).__name__ for m in model.modules()}
    assert "FbgemmFp8Linear" in kinds and type(model.lm_head).__name__ == "Linear"
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert e.components["weights"] - _buffers(e) == held
    biases = 2 * (256 + 128 + 128 + 256)  # q, k, v, o biases of two layers: float16 stored, float32 held
    assert held == _headers(fbgemm) + 2 * biases
    monkeypatch.setattr(FbgemmFp8HfQuantizer, "validate_environment", lambda self, *a, **k: None)
    monkeypatch.setattr(fb, "get_quantize_fp8_per_row", lambda: None)
    loaded = AutoModelForCausalLM.from_pretrained(str(fbgemm))
    assert {p.dtype for p in loaded.parameters()} == {torch.float8_e4m3fn, torch.float32, torch.bfloat16}
    assert held == sum(p.numel() * p.element_size() for p in loaded.parameters())


def test_fbgemm_fp8_llama4_experts_on_meta(tmp_path):
    """Llama 4's fused experts become FbgemmFp8Llama4TextExperts: fp8 [E, H, 2I] / [E, I, H] and float32
    scales per output column ([E, 1, 2I] / [E, H, 1]); the routers stay 16-bit (modules_to_not_convert)."""
    path = tmp_path / "l4"
    path.mkdir()
    h, i, e, layers, vocab = 256, 256, 4, 2, 1000
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama4_text", "architectures": ["Llama4ForCausalLM"], "vocab_size": vocab, "hidden_size": h,
        "intermediate_size": i, "intermediate_size_mlp": 512, "num_hidden_layers": layers, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "num_local_experts": e, "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 1, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
        "max_position_embeddings": 4096, "quantization_config": {
            **FBGEMM_QC, "modules_to_not_convert": ["lm_head", "model.layers.*.feed_forward.router"]}}))
    est = _est(path, gpu="H200")
    experts = layers * (e * h * 2 * i + e * i * h + 4 * (e * 2 * i + e * h))
    linears = layers * sum(o * n + 4 * o for o, n in ((h, h), (128, h), (128, h), (h, h), (i, h), (i, h), (h, i)))
    sixteen = 2 * (2 * vocab * h + layers * e * h + (2 * layers + 1) * h)  # embeddings, lm_head, routers, norms
    assert est.components["weights"] - _buffers(est) == experts + linears + sixteen


def test_vllm_fbgemm_fp8_keeps_a_float32_scale_per_row():
    """vLLM's own fbgemm_fp8 method (layers/quantization/fbgemm_fp8.py): fp8 weight and a per-channel float32
    scale, not fp8's one scale a merged shard (vramcal priced it as plain fp8 before)."""
    from vramcal.estimator.vllm import quant as vq

    q = vq.resolve({**LLAMA, "quantization_config": FBGEMM_QC}, None)
    assert (q.scheme, q.method) == ("ct-channel", "fbgemm_fp8")
    assert q.linear_bytes(4096, 1024, 2) == 4096 * 1024 + 4096 * 4
    with pytest.raises(UserError, match="does not match"):
        vq.resolve({**LLAMA, "quantization_config": FBGEMM_QC}, "fp8")


@pytest.mark.parametrize("argv, words", [(["--gpu", "A100-SXM4-80GB"], "compute capability >= 9.0"),
                                         (["--gpu", "RTX 3090"], "compute capability >= 9.0"),
                                         (["--device", "cpu"], "use a cuda device")])
def test_fbgemm_fp8_below_hopper_and_on_the_cpu_is_one_line(fbgemm, argv, words):
    """FbgemmFp8HfQuantizer.validate_environment refuses compute capability < 9.0 and a machine without a GPU,
    and FbgemmFp8Config has no dequantize: no path to price."""
    r = _cli("estimate", str(fbgemm), "--ctx", "128", *argv)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and words in r.stderr, r.stderr


def test_no_misleading_num_experts_note(mxfp4):
    e = _est(mxfp4, gpu="H200")
    assert not any("num_experts" in n for n in e.notes), e.notes


def test_compressed_tensors_fp8_channel_on_meta(tmp_path):
    """compressed-tensors' own module replacement (the library transformers calls) on the meta model: fp8
    weights of every Linear but lm_head, one bf16 scale per output row."""
    path = tmp_path / "ct"
    path.mkdir()
    qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
          "quantization_status": "compressed",
          "config_groups": {"group_0": {"targets": ["Linear"],
                                        "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                                    "symmetric": True, "dynamic": False},
                                        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                              "dynamic": True, "symmetric": True}}}}
    (path / "config.json").write_text(json.dumps({**LLAMA, "torch_dtype": "bfloat16", "quantization_config": qc}))
    e = _est(path, gpu="H200")
    h, i, layers, vocab = 256, 512, 2, 1000
    outs = [h, 128, 128, h, i, i, h]
    ins = [h, h, h, h, h, h, i]
    fp8 = layers * sum(o * n for o, n in zip(outs, ins))
    scales = layers * sum(outs) * 2
    sixteen = 2 * (2 * vocab * h + (2 * layers + 1) * h)
    assert e.components["weights"] - _buffers(e) == fp8 + scales + sixteen


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "vramcal", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("qc, words", [
    ({"quant_method": "no-such-method"}, "not a format the installed transformers knows"),
    ({"quant_method": "hqq"}, "does not model that format"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "--engine vllm prices it"),
    ({"quant_method": "awq", "bits": 3, "group_size": 128}, "bits 3"),
    ({"quant_method": "gptq", "bits": 4}, "must give bits and group_size"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
])
def test_bad_quantization_configs_are_one_line(tmp_path, qc, words):
    path = tmp_path / "m"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**LLAMA, "torch_dtype": "bfloat16", "quantization_config": qc}))
    r = _cli("estimate", str(path), "--ctx", "128")
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and words in r.stderr, r.stderr


def test_requantizing_and_unknown_gpu_are_refused(fp8_block, tmp_path):
    r = _cli("estimate", str(fp8_block), "--quant", "nf4", "--ctx", "128")
    assert r.returncode == 2 and "already quantized" in r.stderr
    r = _cli("estimate", str(fp8_block), "--gpu", "Voodoo 5", "--ctx", "128")
    assert r.returncode == 2 and "--gpu" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    awq = tmp_path / "awq"
    awq.mkdir()
    (awq / "config.json").write_text(json.dumps({**LLAMA, "torch_dtype": "float16", "quantization_config": {
        "quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True}}))
    r = _cli("estimate", str(awq), "--quant", "nf4", "--ctx", "128")
    assert r.returncode == 2 and "already quantized (AWQ)" in r.stderr


def test_cli_says_which_path_it_priced(fp8_block):
    for gpu, method in (("H200", "fp8"), ("RTX 3090", "fp8-dequantized")):
        r = _cli("estimate", str(fp8_block), "--gpu", gpu, "--ctx", "128", "--json")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["quant"] == method
        assert "compute capability" in out["notes"][0]


def test_fit_searches_the_checkpoint_as_it_loads_and_dequantized(fp8_block):
    from vramcal.calibrate.fit import fit_contexts
    from vramcal.probes.hardware import gpu_target

    fit = fit_contexts(str(fp8_block), 64 * 2**20 * 16, device="cuda", db=None, buffer=2**20,
                       gpu=gpu_target("H200"))
    quants = {r.quant for r in fit.rows}
    assert quants == {"auto", "bf16"}


def test_gpu_table_has_each_compute_capability():
    from vramcal.probes.hardware import known_gpus

    assert all(g.compute_capability is not None and g.architecture for g in known_gpus())
    with pytest.raises(UserError):
        from vramcal.probes.hardware import gpu_target

        gpu_target("")


def test_vllm_prices_gpt_oss_mxfp4_experts_as_its_loader_lays_them(mxfp4):
    """vLLM's MXFP4 (layers/quantization/mxfp4.py): the experts only, packed FP4 and one uint8 scale per 32
    values, the intermediate size per rank padded to 64, biases float32; attention stays 16-bit. This is the
    Triton backend's layout (the default of a bare layout), which keeps the scales twice: the registered
    ``w13_weight_scale`` / ``w2_weight_scale`` and the swizzled copies of ``PrecisionConfig``
    (``process_weights_after_loading``; vramcal/estimator/vllm/mxfp4.py)."""
    from vramcal.estimator.resolve import resolve_model
    from vramcal.estimator.vllm import quant as vq
    from vramcal.estimator.vllm.arch import arch_of
    from vramcal.estimator.vllm.engine import VllmArgs, estimate_vllm
    from vramcal.estimator.vllm.layout import rank_weights
    from vramcal.estimator.vllm.shapes import model_params

    source = resolve_model(str(mxfp4))
    params, filled = model_params(source, "bfloat16")
    arch = arch_of(source.config, filled)
    scheme = vq.resolve(source.config, None)
    assert scheme.scheme == "mxfp4"
    h, experts, layers = 256, 4, 2
    for tp, inter in ((1, 256), (2, 128), (4, 64)):
        pad = -(-inter // 64) * 64
        w13 = experts * 2 * pad * h
        w2 = experts * h * pad
        per_layer = (w13 + w2) // 2 + 2 * ((w13 + w2) // 32) + experts * (2 * pad + h) * 4
        assert rank_weights(params, arch, tp, 1, 2, scheme)[0].groups["experts"] == layers * per_layer
    # attention stays 16-bit: the unquantized layout's bytes, less the experts' bf16 biases (float32, experts)
    plain = rank_weights(params, arch, 1, 1, 2, vq.NONE)[0].groups
    biases = layers * experts * (2 * 256 + h) * 2
    assert rank_weights(params, arch, 1, 1, 2, scheme)[0].groups["dense"] == plain["dense"] - biases
    v = estimate_vllm(str(mxfp4), VllmArgs(gpu_memory_bytes=80 * 2**30, max_model_len=4096))
    assert "mxfp4" in v.quantization and v.fits


@pytest.mark.parametrize("qc", [
    {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "ignore": ["lm_head"],
     "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float",
                                                                      "strategy": "tensor_group", "group_size": 16}}}},
    {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16},
])
def test_vllm_nvfp4_layout(qc):
    """NVFP4 as vLLM holds it: half a byte a value, an fp8 scale per 16 values swizzled into 128 x 4 tiles,
    four float32 scalars a shard (compressed_tensors_w4a4_nvfp4.py, modelopt.py)."""
    from vramcal.estimator.vllm import quant as vq

    q = vq.resolve({**LLAMA, "quantization_config": qc}, None)
    assert q.scheme == "nvfp4"
    assert q.linear_bytes(4096, 4096, 2) == 4096 * 4096 // 2 + 4096 * 256 + 16
    assert q.linear_bytes(100, 64, 2) == 100 * 32 + 128 * 4 + 16  # rows padded to 128, 4 scale columns


def _ct(path, fmt, weights, acts=None):
    group = {"targets": ["Linear"], "weights": weights, **({"input_activations": acts} if acts else {})}
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**LLAMA, "torch_dtype": "bfloat16", "quantization_config": {
        "quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
        "quantization_status": "compressed", "config_groups": {"group_0": group}}}))
    return _est(path, gpu="H200")


OUTS = [256, 128, 128, 256, 512, 512, 256]
INS = [256, 256, 256, 256, 256, 256, 512]
SIXTEEN = 2 * (2 * 1000 * 256 + 5 * 256)  # embeddings, lm_head and the norms stay bf16


def test_compressed_tensors_w4a16_and_w8a8_and_nvfp4_layouts(tmp_path):
    """The compressed-tensors library's own compressed modules on meta, per scheme (2 layers)."""
    n = 2 * sum(o * i for o, i in zip(OUTS, INS))
    shapes = 2 * len(OUTS) * 16  # each packed module keeps its weight_shape (two int64)
    w4 = _ct(tmp_path / "w4a16", "pack-quantized", {"num_bits": 4, "type": "int", "strategy": "group",
                                                    "group_size": 128, "symmetric": True, "dynamic": False})
    groups = 2 * sum(o * (i // 128) for o, i in zip(OUTS, INS))
    assert w4.components["weights"] - _buffers(w4) == n // 2 + 2 * groups + shapes + SIXTEEN
    w8 = _ct(tmp_path / "w8a8", "int-quantized",
             {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True, "dynamic": False},
             {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True})
    assert w8.components["weights"] - _buffers(w8) == n + 2 * 2 * sum(OUTS) + SIXTEEN
    nv = _ct(tmp_path / "nvfp4", "nvfp4-pack-quantized",
             {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
              "dynamic": False},
             {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "dynamic": "local",
              "symmetric": True})
    # packed FP4, one fp8 scale per 16 values, float32 global scales (weight and input) per module
    assert nv.components["weights"] - _buffers(nv) == n // 2 + n // 16 + 2 * len(OUTS) * 2 * 4 + SIXTEEN


@pytest.mark.parametrize("argv,words", [
    (["--gpu", "A100-SXM4-80GB"], ["compute capability 8.0", "NVIDIA H100 80GB HBM3", "9.0", "drop --gpu"]),
    (["--gpu", "H100 PCIe", "--device", "cpu"], ["loads on the CPU", "drop"]),
])
@pytest.mark.parametrize("verb", ["probe", "check"])
def test_a_probe_refuses_a_gpu_that_is_not_the_one_it_loads_on(fake, capsys, tmp_path, verb, argv, words):
    """probe / check price the path of the GPU the load really runs on: a --gpu of another compute
    capability (here an A100's 8.0 on an H100, where fp8 would be kept by the load and dequantized by the
    estimate) is one line, exit 2, before anything runs or is recorded."""
    from vramcal.cli import main

    fake({0: [1 << 30]}, gpu_name="NVIDIA H100 80GB HBM3", compute_capability=(9, 0))
    db = tmp_path / "r.db"
    rc = main([verb, "qwen2.5-0.5b", *argv, "--db", str(db)] if verb == "check" else [verb, "qwen2.5-0.5b", *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and all(w in err for w in words), err
    assert not db.exists()


def test_a_probe_takes_gpu_as_given_where_nvml_cannot_read_the_capability(fake):
    """An old driver without the capability query: --gpu is the only word on the path, and it stands."""
    import argparse

    from vramcal.cli import _probe_gpu

    fake({0: [1 << 30]}, gpu_name="NVIDIA H100 80GB HBM3", compute_capability=None)
    target = _probe_gpu(argparse.Namespace(gpu="A100-SXM4-80GB", device="cuda:0"))
    assert target.compute_capability == (8, 0)
    fake({0: [1 << 30]}, gpu_name="NVIDIA H100 80GB HBM3", compute_capability=(9, 0))
    assert _probe_gpu(argparse.Namespace(gpu="NVIDIA H100 80GB HBM3", device="cuda:0")).compute_capability == (9, 0)


@pytest.mark.parametrize("qc, label", [
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}, "fp8"),
    (MXFP4_QC, "mxfp4"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
      "quantization_status": "compressed", "config_groups": {"group_0": {
          "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                                             "dynamic": False}}}}, "compressed-tensors"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True}, "AWQ"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, "bitsandbytes"),
])
@pytest.mark.parametrize("verb", ["probe", "check"])
def test_synthetic_refuses_a_pre_quantized_config(tmp_path, capsys, qc, label, verb):
    """--synthetic writes 16-bit random weights without the quantization_config: on this CPU the fp8 load
    would have measured a plain bf16 model against the estimate's dequantizing load, compressed-tensors a
    bf16 model against its fp8 layout (both ran and recorded before). Now one line, exit 2, nothing run
    or recorded, for a kept and a dequantized path alike."""
    from vramcal.cli import main

    path = tmp_path / "m"
    path.mkdir()
    base = GPT_OSS if qc is MXFP4_QC else LLAMA
    (path / "config.json").write_text(json.dumps({**base, "torch_dtype": "bfloat16", "quantization_config": qc}))
    db = tmp_path / "r.db"
    argv = [verb, str(path), "--synthetic", "--device", "cpu", "--ctx", "64"]
    rc = main(argv + ["--db", str(db)] if verb == "check" else argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"not this checkpoint's {label} layout" in err and "download its weights" in err
    assert not db.exists()


@pytest.mark.parametrize("quant", ["auto", "bf16"])
def test_a_placement_of_a_pre_quantized_checkpoint_is_refused_for_what_it_is(fp8_block, quant):
    """--max-memory with fp8, kept or dequantized: one line that says placement is what is not modelled, and
    what to do (the quantizer is transformers' own, installed; it used to say its library was missing)."""
    r = _cli("estimate", str(fp8_block), "--gpu", "H200", "--ctx", "128", "--quant", quant,
             "--max-memory", "cuda:0=1GiB,cpu=8GiB")
    err = r.stderr.strip()
    assert r.returncode == 2 and "\n" not in err, err
    assert "placement" in err and "not modelled yet for fp8" in err and "drop --max-memory" in err, err


def test_a_probe_from_the_library_prices_the_gpu_it_runs_on(fake, monkeypatch):
    """run_probe without ``gpu`` (benchmarks/validate.py, gpu_session.py) prices this machine's GPU, as
    `vramcal probe` does: the second H200 session's probes were priced with the default context (512 MiB)
    instead of the H200's measured one, 16-25 % low on small models. The CPU stays without a GPU."""
    import vramcal.probes.probe as probe
    from vramcal.probes.hardware import device_gpu_target

    fake({0: [1 << 30]}, gpu_name="NVIDIA H200", compute_capability=(9, 0))
    assert device_gpu_target("cuda").architecture == "hopper"
    assert device_gpu_target("cuda:0").name == "NVIDIA H200"
    assert device_gpu_target("cpu") is None and device_gpu_target("CPU") is None
    assert device_gpu_target("cuda:x") is None  # preflight refuses it in one line; no ValueError from here
    seen = []

    class Stop(Exception):
        pass

    def resolve(quant, source, dtype, gpu):
        seen.append(gpu)
        raise Stop

    monkeypatch.setattr(probe, "resolve_quant", resolve)
    for device in ("cuda:0", "cpu"):
        with pytest.raises(Stop):
            probe.run_probe("qwen2.5-0.5b", "bf16", 64, device=device)
    assert seen[0].architecture == "hopper" and seen[0].compute_capability == (9, 0)
    assert seen[1].is_cpu
