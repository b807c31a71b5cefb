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
    """Llama with every projection in block fp8 (128 x 128 blocks, float32 inverse scales), as DeepSeek-V3 and
    Qwen3-*-FP8 store theirs."""
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
        return {k: q, k + "_scale_inv": scale.contiguous()}

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


def test_fp8_kept_on_hopper_is_the_checkpoint_as_stored(fp8_block):
    e = _est(fp8_block, gpu="H200")
    assert e.quant == "fp8"
    assert e.components["weights"] - _buffers(e) == _headers(fp8_block)
    assert any("kept as stored" in n for n in e.notes)


@pytest.mark.parametrize("how", [{"gpu": "RTX 3090"}, {"gpu": "A100 80GB PCIe"}, {"device": "cpu"},
                                 {"quant": "bf16", "gpu": "H200"}])
def test_fp8_dequantized_equals_what_transformers_loads(fp8_block, how):
    e = _est(fp8_block, **how)
    assert e.quant.endswith("-dequantized")
    assert e.components["weights"] == _loaded(fp8_block)  # transformers dequantizes fp8 on a CPU: the same path
    assert e.components["weights"] > 1.4 * _headers(fp8_block)


def test_mxfp4_load_dtype_is_the_checkpoints_not_float32(mxfp4):
    """gpt-oss's config names no dtype: from_pretrained(dtype="auto") takes the checkpoint's first floating
    tensor (bf16), not float32 (the estimate priced gpt-oss-20b at 83.7 GB against 13.8 GB stored)."""
    e = _est(mxfp4, gpu="H200")
    assert e.dtype == "bfloat16"
    assert e.components["weights"] - _buffers(e) == _headers(mxfp4)


def test_mxfp4_dequantized_below_turing_and_on_the_cpu(mxfp4):
    loaded = _loaded(mxfp4)
    for how in ({"gpu": "V100-SXM2-32GB"}, {"device": "cpu"}):
        e = _est(mxfp4, **how)
        assert e.quant.endswith("-dequantized")
        assert e.components["weights"] == loaded
    # gpt-oss's sliding layers: the real cache layers, not a formula over the whole context
    kept = _est(mxfp4, gpu="H200")
    assert not any("formula" in n for n in kept.notes)


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
