"""compressed-tensors checkpoints quantized for real on the CPU, then loaded (issue 23).

The checkpoints are made the way llm-compressor makes a calibration-free one, with the installed
compressed-tensors library itself: ``apply_quantization_config`` with a preset scheme (FP8_DYNAMIC, W4A16,
W8A8, NVFP4, W4A16_ASYM), each weight's scale and zero point from its own minimum and maximum per the
scheme's strategy (``calculate_qparams``; NVFP4's global scale from ``generate_gparam``: the memoryless
min-max observer of a weight-only or dynamic scheme, which needs no data), ``ModelCompressor.compress_model``
and ``save_pretrained`` + ``update_config``. llm-compressor itself is not used: its newest release (0.14.0.1)
pins transformers <= 5.17 and compressed-tensors == 0.19, and this project runs 5.24 and 0.20.

Each checkpoint is then checked three ways, to the byte: the estimate (weights, and tensor by tensor through
``count_meta_model``) against the saved safetensors headers, and against the model ``from_pretrained`` really
loads on the CPU (the probe's own arguments: ``device_map="cpu"``). transformers loads compressed-tensors
compressed (``dequantize=False``: the modules hold the stored tensors and decompress on the first forward),
so the two agree for a dense model; ``--quant bf16`` is its ``dequantize=True`` load. In a MoE the fused 3-D
experts are no ``nn.Linear`` for compressed-tensors to take, so the loader dequantizes the stored experts into
them: there the estimate is what transformers holds, not what the checkpoint stores.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from tiny_hf import CONFIGS, MORE_CONFIGS  # noqa: E402

from vramcal.errors import UserError  # noqa: E402

pytest.importorskip("compressed_tensors")

LLAMA = {**CONFIGS["llama"], "num_hidden_layers": 2}  # hidden 256, intermediate 256, GQA 8/2, 2 layers
QWEN3_MOE = {**CONFIGS["qwen3moe"], "num_hidden_layers": 2}  # 4 experts of 256 x 256, 2 layers
MIXTRAL = {**MORE_CONFIGS["mixtral"], "num_hidden_layers": 2, "num_local_experts": 4}  # experts of 256 x 256
DENSE_SCHEMES = ("FP8_DYNAMIC", "W4A16", "W8A8", "NVFP4")
FORMATS = {"FP8_DYNAMIC": "float-quantized", "W4A16": "pack-quantized", "W8A8": "int-quantized",
           "NVFP4": "nvfp4-pack-quantized", "W4A16_ASYM": "pack-quantized"}


def _build(config: dict):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)


def _calibrate_weights(model) -> None:
    """Each quantized weight's scale (and zero point) from its own range, by the scheme's strategy."""
    import torch
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None or scheme.weights is None:
            continue
        args, w = scheme.weights, module.weight.data.float()
        if args.strategy == "tensor":
            lo, hi = w.min().reshape(1), w.max().reshape(1)
        elif args.strategy == "channel":
            lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        else:  # group, tensor_group
            g = w.unflatten(-1, (-1, args.group_size))
            lo, hi = g.amin(-1), g.amax(-1)
        global_scale = None
        if args.strategy == "tensor_group":
            global_scale = generate_gparam(w.min(), w.max())
            module.weight_global_scale.data.copy_(global_scale)
        scale, zero = calculate_qparams(lo, hi, args, global_scale=global_scale)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
        if hasattr(module, "input_global_scale"):  # NVFP4's static activation global scale: no data, one
            module.input_global_scale.data.fill_(1.0)


def _quantize(model, scheme_name: str, ignore: list[str], path: Path, save_pretrained: bool = True) -> Path:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme

    qc = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(scheme_name, ["Linear"])}, ignore=ignore)
    apply_quantization_config(model, qc, show_progress=False)
    _calibrate_weights(model)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    if save_pretrained:
        model.save_pretrained(path)
    else:  # a model whose experts were unfused into Linear layers: transformers' save would refuse to re-fuse
        from safetensors.torch import save_file

        path.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"),
                  metadata={"format": "pt"})
        model.config.save_pretrained(path)
    compressor.update_config(str(path))
    return path


class _MixtralExpert(__import__("torch").nn.Module):
    """One Mixtral expert as its checkpoints name it: w1 (gate), w3 (up), w2 (down)."""

    def __init__(self, hidden: int, inter: int):
        import torch

        super().__init__()
        self.w1 = torch.nn.Linear(hidden, inter, bias=False)
        self.w3 = torch.nn.Linear(hidden, inter, bias=False)
        self.w2 = torch.nn.Linear(inter, hidden, bias=False)


def _moe_with_linear_experts(scheme_name: str, ignore: list[str], path: Path, arch: str = "qwen3_moe") -> Path:
    """A MoE with each layer's fused experts replaced by three nn.Linear per expert, as llm-compressor's
    calibration modules unfuse them: quantized and saved, it is the per-expert checkpoint layout published
    compressed-tensors MoEs have (Qwen3-MoE ``mlp.experts.{e}.gate_proj.weight_packed``; Mixtral
    ``block_sparse_moe.experts.{e}.w1.weight_packed``, which transformers renames and fuses on load)."""
    import torch
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeMLP

    config = QWEN3_MOE if arch == "qwen3_moe" else MIXTRAL
    model = _build(config)
    cfg = model.config
    for layer in model.model.layers:
        if arch == "qwen3_moe":
            experts = [Qwen3MoeMLP(cfg, cfg.moe_intermediate_size) for _ in range(cfg.num_experts)]
        else:
            experts = [_MixtralExpert(cfg.hidden_size, cfg.intermediate_size) for _ in range(cfg.num_local_experts)]
        layer.mlp.experts = torch.nn.ModuleList(experts).to(torch.bfloat16)
    path = _quantize(model, scheme_name, ignore, path, save_pretrained=False)
    if arch == "mixtral":
        from safetensors.torch import load_file, save_file

        sd = load_file(str(path / "model.safetensors"))
        save_file({k.replace(".mlp.", ".block_sparse_moe."): v for k, v in sd.items()},
                  str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


class _Checkpoints(dict):
    """Scheme -> the saved checkpoint, each quantized the first time a test asks for it."""

    def __init__(self, root: Path):
        super().__init__()
        self.root = root

    def __missing__(self, scheme: str) -> Path:
        self[scheme] = _quantize(_build(LLAMA), scheme, ["lm_head"], self.root / scheme)
        return self[scheme]


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return _Checkpoints(tmp_path_factory.mktemp("ct-dense"))


def _headers(path: Path) -> dict[str, int]:
    from vramcal.estimator.checkpoint import checkpoint_tensors, tensor_bytes

    return {k: tensor_bytes(d, s) for k, (d, s) in checkpoint_tensors((str(path / "model.safetensors"),)).items()}


def _est(path: Path, quant="auto", device="cpu", gpu=None):
    from vramcal.estimator.estimate import estimate
    from vramcal.probes.hardware import gpu_target

    return estimate(str(path), quant, ctx=256, device=device, gpu=gpu_target(gpu) if gpu else None, use_cache=False)


def _per_tensor(path: Path, quant="auto") -> dict[str, int]:
    """The estimate's tensors, each with its bytes (what placement sums per device)."""
    from vramcal.estimator.formats import CPU
    from vramcal.estimator.inventory import count_meta_model
    from vramcal.estimator.meta import build_meta_model
    from vramcal.estimator.quant import resolve_quant
    from vramcal.estimator.resolve import resolve_model

    source = resolve_model(str(path))
    spec = resolve_quant(quant, source, None, CPU)
    out: list[tuple[str, int]] = []
    count_meta_model(source, spec, *build_meta_model(source, spec), per_tensor=out)
    return dict(out)


def _inv(path: Path):
    from vramcal.estimator.formats import CPU
    from vramcal.estimator.inventory import inventory
    from vramcal.estimator.quant import resolve_quant
    from vramcal.estimator.resolve import resolve_model

    source = resolve_model(str(path))
    return inventory(source, resolve_quant("auto", source, None, CPU), use_cache=False)


def _forward(model) -> None:
    import torch

    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))


def _load(path: Path, est):
    """The model as the probe's child loads it, with the estimate's own from_pretrained arguments."""
    from transformers import AutoModelForCausalLM

    from vramcal.estimator.loading import materialize

    assert est.from_pretrained["device_map"] == "cpu"
    return AutoModelForCausalLM.from_pretrained(str(path), **materialize(est.from_pretrained))


def _held(model) -> dict[str, int]:
    named = [*model.named_parameters(), *model.named_buffers()]
    return {n: t.numel() * t.element_size() for n, t in named}


@pytest.mark.parametrize("scheme", DENSE_SCHEMES)
def test_dense_estimate_is_the_headers_and_the_load_tensor_by_tensor(dense, scheme):
    """Kept as stored (every GPU and the CPU: compressed-tensors has no compute-capability rule for these
    schemes), the estimate is the saved checkpoint plus the rotary inv_freq buffer no checkpoint stores, and
    the loaded model holds exactly those tensors."""
    from vramcal.probes.child import held_weight_bytes

    path = dense[scheme]
    assert json.loads((path / "config.json").read_text())["quantization_config"]["format"] == FORMATS[scheme]
    stored = _headers(path)
    for how in ({"device": "cuda", "gpu": "H200"}, {"device": "cpu"}):
        e = _est(path, **how)
        assert e.quant == "compressed-tensors"
        assert e.components["weights"] - e.weights_breakdown["buffers"] == sum(stored.values())
    per = _per_tensor(path)
    buffers = {n for n in per if n.endswith("inv_freq")}
    assert {n: b for n, b in per.items() if n not in buffers} == stored
    model = _load(path, e)
    assert _held(model) == per
    assert held_weight_bytes(model) == e.components["weights"]


@pytest.mark.parametrize("scheme", DENSE_SCHEMES)
def test_dense_dequantized_is_what_the_dequantize_load_holds(dense, scheme):
    """--quant bf16: transformers' CompressedTensorsConfig(dequantize=True), every weight back in bf16
    (NVFP4's stored input_global_scale is dropped by that load, and by the estimate)."""
    e = _est(dense[scheme], quant="bf16")
    assert e.quant == "compressed-tensors-dequantized"
    assert e.from_pretrained["quantization_config"] == {"config_class": "CompressedTensorsConfig", "dequantize": True}
    model = _load(dense[scheme], e)
    assert sum(_held(model).values()) == e.components["weights"]
    assert _held(model) == _per_tensor(dense[scheme], "bf16")
    assert e.components["weights"] > sum(_headers(dense[scheme]).values())


def test_asymmetric_pack_quantized_is_refused_as_from_pretrained_refuses_it(dense):
    """W4A16_ASYM: compressed-tensors 0.20 saves the zero points packed eight to an int32 along the rows, but
    its meta compression (what transformers builds the modules with) keeps them one per row, so from_pretrained
    raises a size mismatch (llm-compressor issue #1618). The estimate says so in one line instead of pricing a
    load that cannot happen."""
    from transformers import AutoModelForCausalLM

    path = dense["W4A16_ASYM"]
    zp = {k: v for k, v in _headers(path).items() if k.endswith("weight_zero_point")}
    assert zp, "the asymmetric checkpoint stores its zero points"
    with pytest.raises(RuntimeError, match="mismatch"):
        AutoModelForCausalLM.from_pretrained(str(path), device_map="cpu")
    with pytest.raises(UserError, match=r"weight_zero_point is stored as \[\d+, \d+\].*size mismatch") as err:
        _est(path)
    assert len(str(err.value).splitlines()) == 1


def _expert_weights(config: dict) -> int:
    """Elements of every expert's gate, up and down projection."""
    e = config.get("num_experts") or config["num_local_experts"]
    i = config.get("moe_intermediate_size") or config["intermediate_size"]
    return config["num_hidden_layers"] * e * 3 * config["hidden_size"] * i


@pytest.mark.parametrize("arch, scheme", [("qwen3_moe", "W4A16"), ("qwen3_moe", "FP8_DYNAMIC"), ("mixtral", "W4A16")])
def test_moe_experts_quantized_load_dequantized_into_the_fused_experts(tmp_path, arch, scheme):
    """Experts quantized with everything else (router and lm_head ignored, as llm-compressor's MoE recipes do):
    transformers 5's fused experts (Qwen3MoeExperts, MixtralExperts) are 3-D parameters, not Linear layers, so
    compressed-tensors leaves them alone and the loader dequantizes the stored experts into them
    (CompressedTensorsDequantize; Mixtral's ``block_sparse_moe.experts.*.w1`` renamed and fused on the way): the
    attention stays compressed, the experts are held in bf16. The estimate is that load, tensor by tensor,
    and says so; the checkpoint's headers are smaller by exactly the experts' stored-versus-bf16 bytes. After
    one forward the attention is decompressed too; with --quant bf16 (dequantize=True) the load is the plain
    bf16 model's bytes."""
    config = QWEN3_MOE if arch == "qwen3_moe" else MIXTRAL
    path = _moe_with_linear_experts(scheme, ["lm_head", "re:.*mlp.gate$"], tmp_path / "moe", arch)
    stored = {k.replace(".block_sparse_moe.", ".mlp."): b for k, b in _headers(path).items()}
    assert any(".mlp.experts.0." in k and k.endswith("weight_scale") for k in stored)
    e = _est(path)
    assert any("fused MoE expert weights" in n and "dequantizes the stored experts" in n for n in e.notes), e.notes
    per = _per_tensor(path)
    model = _load(path, e)
    assert _held(model) == per
    assert sum(per.values()) == e.components["weights"]
    held_experts = sum(b for n, b in per.items() if ".mlp.experts." in n)
    assert held_experts == 2 * _expert_weights(config) == e.weights_breakdown["experts"]
    stored_experts = sum(b for n, b in stored.items() if ".mlp.experts." in n)
    rest = {n: b for n, b in per.items() if ".mlp.experts." not in n and not n.endswith("inv_freq")}
    assert rest == {n: b for n, b in stored.items() if ".mlp.experts." not in n}
    held_weights = e.components["weights"] - e.weights_breakdown["buffers"]
    assert held_weights == sum(stored.values()) - stored_experts + held_experts
    _forward(model)  # the attention's compressed modules decompress too; the experts are bf16 already
    assert sum(_held(model).values()) == _inv(path).run_tensor_bytes > e.components["weights"]
    dq = _est(path, quant="bf16")  # dequantize=True: the whole model in bf16 at load, experts included
    assert sum(_held(_load(path, dq)).values()) == dq.components["weights"] == sum(_held(_build(config)).values())


def test_moe_experts_ignored_stay_bf16_as_stored(tmp_path):
    """Experts left out by the recipe's ignore list (FP8 attention only): the checkpoint keeps them bf16 per
    expert, transformers merges them into its fused experts, and the estimate is the headers to the byte."""
    path = _moe_with_linear_experts("FP8_DYNAMIC", ["lm_head", "re:.*mlp.gate$", "re:.*mlp.experts.*"],
                                    tmp_path / "moe")
    stored = _headers(path)
    assert not any(".mlp.experts." in k and "scale" in k for k in stored)
    e = _est(path)
    model = _load(path, e)
    assert sum(_held(model).values()) == e.components["weights"]
    assert e.components["weights"] - e.weights_breakdown["buffers"] == sum(stored.values())


def _sizes(model) -> dict[int, int]:
    from collections import Counter

    return dict(Counter(_held(model).values()))


@pytest.mark.parametrize("scheme", DENSE_SCHEMES)
def test_the_first_forward_decompresses_and_the_stages_hold_it(dense, scheme):
    """transformers' compressed load registers compressed-tensors' decompress hook: the first forward turns
    every quantized module back into a bf16 weight (keeping its scales). The estimate's weights from
    first_token on are those tensors, size by size (``run_alloc_sizes``) and in total, and the tensors the
    stages add up (allocated) and the CPU's resident set hold them."""
    path = dense[scheme]
    e = _est(path)
    inv = _inv(path)
    assert inv.tensor_bytes == e.components["weights"] < inv.run_tensor_bytes
    assert any("first forward decompresses" in n for n in e.notes), e.notes
    assert any("once the first forward has decompressed it" in n for n in e.notes), e.notes
    model = _load(path, e)
    assert _sizes(model) == dict(inv.alloc_sizes)
    _forward(model)
    assert sum(_held(model).values()) == inv.run_tensor_bytes
    assert _sizes(model) == inv.run_alloc_sizes()
    assert e.allocated["first_token"] - e.allocated["post_load"] >= inv.run_tensor_bytes - inv.tensor_bytes
    assert e.peak_breakdown["decompressed_weights"] == sum(sum(new) for new, _ in inv.first_forward)


def test_a_dequantized_load_has_no_first_forward_to_price(dense):
    e = _est(dense["W4A16"], quant="bf16")
    assert not any("first forward decompresses" in n for n in e.notes)
    assert "decompressed_weights" not in e.peak_breakdown


def test_the_allocator_replay_frees_what_the_decompression_drops(dense):
    """The replayed load is the compressed model (its figures at the load's mark), and after the first
    forward's events the allocator holds exactly the decompressed tensors, each rounded as it rounds them."""
    from vramcal.estimator.allocator import DEFAULT_CONF, replay, round_size
    from vramcal.estimator.reserve import load_events, loaded

    inv = _inv(dense["W4A16"])
    events = load_events(inv, None, False)
    r = replay(events, DEFAULT_CONF)
    rounded = lambda sizes: sum(round_size(b) * n for b, n in sizes.items())  # noqa: E731
    assert r.marks["load"].allocated == rounded(inv.alloc_sizes)
    assert r.marks["first_forward"].allocated == rounded(inv.run_alloc_sizes()) > r.marks["load"].allocated
    assert loaded(events, DEFAULT_CONF)[1] == (r.marks["load"].peak_reserved, r.marks["load"].reserved)
