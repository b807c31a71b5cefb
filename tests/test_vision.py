"""Vision-language models, each part against an independent truth:

- image tokens: vramcal's pure rules (vramcal.estimator.vision) against the installed processors --
  the full processor class (image processor + a tokenizer holding the family's special tokens; the
  count of image-related ids does not depend on the text vocabulary) -- for several image sizes;
- weights: the estimate against every tensor a real ``from_pretrained`` with real bitsandbytes leaves
  loaded, for a tiny checkpoint of each family (vision tower, projector, language model);
- KV cache: the estimate against the cache a real multimodal ``generate`` (pixel values from the real
  image processor) leaves, to the byte, Mllama's cross-attention K/V included;
- the dry run: the multimodal forward on meta tensors allocates what the same forward on real CPU
  tensors allocates;
- a probe with images, and the config that leaves sizes to transformers' defaults.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import cache_bytes, held_tensors
from transformers import AutoModelForImageTextToText, BitsAndBytesConfig, DynamicCache
from vlm_models import TINY_VLM

from vramcal.estimator import vision
from vramcal.estimator.estimate import estimate
from vramcal.estimator.inventory import built_config_dict, inventory
from vramcal.estimator.meta import build_config
from vramcal.estimator.quant import resolve_quant
from vramcal.estimator.resolve import resolve_model

SIZES = [(224, 224), (640, 480), (480, 640), (1280, 720), (2000, 400), (56, 56)]


# ----------------------------------------------------------------------------- image tokens


def _filled(name: str) -> dict:
    """A catalog entry's config as transformers fills it."""
    return built_config_dict(build_config(resolve_model(name)))


def _tokenizer(specials: list[str], **kw):
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "describe": 1, "this": 2, "image": 3, ".": 4, "\n": 5}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    t = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", **kw)
    t.add_special_tokens({"additional_special_tokens": specials})
    return t


def _unchecked(cls):
    """The processor class without its check that the parts are the expected classes (the Qwen processor
    wants a video processor, which needs torchvision; a synthetic tokenizer is not the checkpoint's)."""
    return type(cls.__name__, (cls,), {"check_argument_for_proper_class": lambda self, *a, **k: None})


def _pil(name: str, settings: dict):
    from transformers.models.auto.image_processing_auto import get_image_processor_class_from_name

    kw = {k: v for k, v in settings.items() if k not in ("image_processor_type", "processor_class")}
    return get_image_processor_class_from_name(settings["image_processor_type"] + "Pil")(**kw)


def _count(processor, text: str, size, tokens: list[str], **call) -> int:
    from vramcal.probes.images import picture

    out = processor(images=[picture(*size)], text=text, return_tensors="pt", **call)
    ids = out["input_ids"][0].tolist()
    wanted = {processor.tokenizer.convert_tokens_to_ids(t) for t in tokens}
    return sum(1 for i in ids if i in wanted)


@pytest.mark.parametrize("pan_and_scan", [False, True])
def test_gemma3_image_tokens_equal_the_processor(pan_and_scan):
    """Pan-and-scan is the processor call's own argument: Gemma3Processor passes its default (off) to the
    image processor at every call, over the preprocessor file's setting (which says on, here)."""
    from transformers.models.gemma3.processing_gemma3 import Gemma3Processor

    source = resolve_model("gemma-3-27b")
    pre = {**source.processor[vision.PREPROCESSOR], "do_pan_and_scan": True}
    tok = _tokenizer(["<start_of_image>", "<end_of_image>", "<image_soft_token>"], extra_special_tokens={
        "image_token": "<image_soft_token>", "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"})
    proc = _unchecked(Gemma3Processor)(image_processor=_pil("Gemma3ImageProcessor", pre), tokenizer=tok,
                                       image_seq_length=256)
    config = _filled("gemma-3-27b")
    crops = 0
    call = {"do_pan_and_scan": True} if pan_and_scan else {}
    for size in SIZES:
        plan = vision.plan_images(config, {vision.PREPROCESSOR: pre, vision.CALL: call}, 1, size).plan
        real = _count(proc, "<start_of_image> describe this image .", size,
                      ["<image_soft_token>", "<start_of_image>", "<end_of_image>"], **call)
        assert plan.tokens == real, size
        crops += plan.encoder_images - 1
    assert (crops > 0) == pan_and_scan  # the wide and tall sizes are cropped when pan-and-scan is on


@pytest.mark.parametrize("settings", ["published", "class defaults"])
def test_qwen2_5_vl_image_tokens_equal_the_processor(settings):
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor

    source = resolve_model("qwen2.5-vl-7b")
    pre = source.processor[vision.PREPROCESSOR] if settings == "published" else {
        "image_processor_type": "Qwen2VLImageProcessor"}
    tok = _tokenizer(["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"])
    proc = _unchecked(Qwen2_5_VLProcessor)(image_processor=_pil("Qwen2VLImageProcessor", pre), tokenizer=tok,
                                           video_processor=None)
    config = _filled("qwen2.5-vl-7b")
    for size in SIZES:
        plan = vision.plan_images(config, {vision.PREPROCESSOR: pre} if settings == "published" else {}, 1,
                                  size).plan
        real = _count(proc, "<|vision_start|><|image_pad|><|vision_end|> describe this image .", size,
                      ["<|image_pad|>", "<|vision_start|>", "<|vision_end|>"])
        assert plan.tokens == real, size


def test_llava_image_tokens_equal_the_processor():
    from transformers.models.llava.processing_llava import LlavaProcessor

    source = resolve_model("llava-1.5-7b")
    proc_cfg = source.processor[vision.PROCESSOR]
    tok = _tokenizer(["<image>"])
    proc = _unchecked(LlavaProcessor)(image_processor=_pil("CLIPImageProcessor", source.processor[vision.PREPROCESSOR]),
                                      tokenizer=tok, patch_size=proc_cfg["patch_size"],
                                      vision_feature_select_strategy=proc_cfg["vision_feature_select_strategy"],
                                      num_additional_image_tokens=proc_cfg["num_additional_image_tokens"],
                                      image_token="<image>")
    config = _filled("llava-1.5-7b")
    for size in SIZES:
        plan = vision.plan_images(config, source.processor, 1, size).plan
        assert plan.tokens == _count(proc, "<image> describe this image .", size, ["<image>"]) == 576, size


def test_idefics3_image_tokens_equal_the_processor():
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor

    source = resolve_model("smolvlm-256m")
    pre = source.processor[vision.PREPROCESSOR]
    row_col = [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    tok = _tokenizer(["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + row_col)
    proc = _unchecked(Idefics3Processor)(image_processor=_pil("Idefics3ImageProcessor", pre), tokenizer=tok,
                                         image_seq_len=source.processor[vision.PROCESSOR]["image_seq_len"])
    config = _filled("smolvlm-256m")
    tiles = set()
    for size in SIZES:
        plan = vision.plan_images(config, source.processor, 1, size).plan
        real = _count(proc, "<image> describe this image .", size,
                      ["<image>", "<fake_token_around_image>", "<global-img>"] + row_col)
        assert plan.tokens == real, size
        tiles.add(plan.tiles)
    assert len(tiles) > 1  # the sizes reach different tile grids


def test_mllama_image_tokens_and_tiles_equal_the_processor():
    from transformers.models.mllama.processing_mllama import MllamaProcessor

    from vramcal.probes.images import picture

    pre = {"image_processor_type": "MllamaImageProcessor", "size": {"height": 560, "width": 560},
           "max_image_tiles": 4}  # Llama-3.2-11B-Vision's published settings
    config = {"model_type": "mllama", "vision_config": {"image_size": 560, "patch_size": 14, "max_num_tiles": 4}}
    tok = _tokenizer(["<|image|>", "<|begin_of_text|>"], bos_token="<|begin_of_text|>")
    proc = _unchecked(MllamaProcessor)(image_processor=_pil("MllamaImageProcessor", pre), tokenizer=tok)
    for size in SIZES:
        plan = vision.plan_images(config, {vision.PREPROCESSOR: pre}, 1, size).plan
        out = proc(images=[picture(*size)], text="<|image|> describe this image .", return_tensors="pt")
        assert plan.tokens == out["input_ids"][0].tolist().count(proc.image_token_id) == 1
        assert plan.tiles[0] * plan.tiles[1] == int(out["aspect_ratio_mask"].sum()), size
        assert tuple(out["pixel_values"].shape[2:]) == (plan.encoder_images, 3, *plan.encoder_size)


def test_default_sizes_are_the_processors_own():
    assert vision.default_size(_filled("gemma-3-27b"), resolve_model("gemma-3-27b").processor) == (896, 896)
    assert vision.default_size(_filled("llava-1.5-7b"), resolve_model("llava-1.5-7b").processor) == (336, 336)
    # Qwen has no fixed size: the largest square its published max_pixels keeps whole (16384 tokens)
    qwen = vision.plan_images(_filled("qwen2.5-vl-7b"), resolve_model("qwen2.5-vl-7b").processor, 1, None).plan
    assert (qwen.width, qwen.tokens) == (3584, 16384 + 2)


# ----------------------------------------------------------------------------- weights and KV, real loads


def _quantization(quant: str):
    kw = resolve_quant(quant, {"dtype": "bfloat16"}).bnb_config_kwargs()
    if kw and "bnb_4bit_compute_dtype" in kw:
        kw["bnb_4bit_compute_dtype"] = torch.bfloat16
    return BitsAndBytesConfig(**kw) if kw else None


def _load(path: str, quant: str):
    return AutoModelForImageTextToText.from_pretrained(path, quantization_config=_quantization(quant),
                                                       device_map="cpu", dtype=torch.bfloat16).eval()


@pytest.mark.parametrize("family", sorted(TINY_VLM))
@pytest.mark.parametrize("quant", ["auto", "nf4", "int8"])
def test_vlm_weights_equal_loaded_tensors(tiny_vlms, family, quant):
    """Vision tower, projector and language model as transformers + bitsandbytes lay them out: which
    Linear layers the quantizer converts (in transformers 5 the vision tower's too) and which it keeps."""
    model = _load(tiny_vlms[family], quant)
    truth = held_tensors(model)
    source = resolve_model(tiny_vlms[family])
    inv = inventory(source, resolve_quant(quant, source.config), use_cache=False)
    assert inv.architecture == type(model).__name__
    assert inv.tensor_bytes == sum(truth.values())
    assert sorted(s for s, n in inv.alloc_sizes.items() for _ in range(n)) == sorted(truth.values())
    assert sum(inv.parts.values()) == inv.tensor_bytes and len(inv.parts) >= 2
    assert not inv.approximate and inv.method == "meta"


def test_vision_tower_is_quantized_and_skip_lists_are_the_checkpoints(tiny_vlms, tmp_path):
    """transformers 5 converts the vision tower's Linear layers by default; a serialized checkpoint's own
    llm_int8_skip_modules replace the defaults, matched from the start of the module name (the old
    ``vision_tower`` matches nothing; ``model.vision_tower`` keeps it)."""
    path = tiny_vlms["llava"]
    source = resolve_model(path)
    bf16 = inventory(source, resolve_quant("auto", source.config), use_cache=False)
    nf4 = inventory(source, resolve_quant("nf4", source.config), use_cache=False)
    assert nf4.parts["model.vision_tower"] < 0.6 * bf16.parts["model.vision_tower"]
    kept = {}
    for name, skip in (("old", ["vision_tower", "lm_head"]), ("new", ["model.vision_tower", "lm_head"])):
        qc = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
                                llm_int8_skip_modules=skip)
        AutoModelForImageTextToText.from_pretrained(path, quantization_config=qc, device_map="cpu",
                                                    dtype=torch.bfloat16).save_pretrained(tmp_path / name)
        loaded = AutoModelForImageTextToText.from_pretrained(tmp_path / name, device_map="cpu", dtype=torch.bfloat16)
        serialized = resolve_model(str(tmp_path / name))
        inv = inventory(serialized, resolve_quant("auto", serialized.config), use_cache=False)
        assert inv.tensor_bytes == sum(held_tensors(loaded).values()), name
        kept[name] = inv.parts["model.vision_tower"]
    assert kept["new"] == bf16.parts["model.vision_tower"] > kept["old"]


def _multimodal_generate(path: str, family: str, images: int, size, prompt: int, batch: int, new_tokens: int,
                         quant: str = "auto"):
    """A real generate with images: pixel values from the real image processor, the image tokens laid out
    as the family's processor lays them out. Returns the cache and the prompt's image tokens."""
    from vramcal.estimator.vision import plan_images, prompt_ids, text_side_inputs
    from vramcal.probes.images import real_image_inputs

    model = _load(path, quant)
    source = resolve_model(path)
    imgs = plan_images(built_config_dict(model.config), source.processor, images, size)
    gen = torch.Generator().manual_seed(0)
    ids = prompt_ids(model.config, imgs, batch, prompt,
                     lambda n: torch.randint(3, 250, (n,), generator=gen).tolist())
    extra = {**text_side_inputs(model.config, imgs, ids),
             **real_image_inputs(family, imgs, source.processor, batch, torch.bfloat16)}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True,
                             pad_token_id=0, **extra)
    assert out.sequences.shape == (batch, ids.shape[1] + new_tokens)
    return out.past_key_values, imgs.tokens


@pytest.mark.parametrize("family", sorted(TINY_VLM))
def test_vlm_kv_cache_equals_multimodal_generate(tiny_vlms, family):
    """Two images of 100x80 in each of two prompts: the cache holds the prompt with its image tokens (and
    for Mllama the cross-attention K/V of every tile, padded ones too), to the byte."""
    cache, image_tokens = _multimodal_generate(tiny_vlms[family], family, 2, (100, 80), 20, 2, 6)
    e = estimate(tiny_vlms[family], "auto", prompt=20, new_tokens=6, batch=2, images=2, image_size="100x80",
                 device="cpu")
    assert e.image_tokens == image_tokens and e.context == e.ctx + image_tokens
    assert e.components["kv_cache"] == cache_bytes(cache)


def test_vlm_kv_with_quantized_weights_and_default_size(tiny_vlms):
    cache, image_tokens = _multimodal_generate(tiny_vlms["qwen2_5_vl"], "qwen2_5_vl", 1, None, 12, 1, 4, "nf4")
    e = estimate(tiny_vlms["qwen2_5_vl"], "nf4", prompt=12, new_tokens=4, images=1, device="cpu")
    assert e.image_size == (112, 112)  # the largest square the checkpoint's max_pixels keeps whole
    assert (e.image_tokens, e.components["kv_cache"]) == (image_tokens, cache_bytes(cache))


# ----------------------------------------------------------------------------- the dry run


@pytest.mark.parametrize("family", sorted(TINY_VLM))
def test_multimodal_meta_trace_equals_real_tensor_trace(tiny_vlms, family):
    """The forward with images on meta tensors (small integer tensors carried with their values) against
    the same forward on real CPU tensors. Known differences, where meta behaves as CUDA and the CPU does
    not: a sliding-window layer moves its window scalar to the device (512 bytes, Gemma 3); Qwen-VL makes
    its window and rope indices on the CPU and moves them to the device, which on the CPU itself is
    computing them in place (a few 512-byte blocks either way)."""
    from vramcal.estimator.dryrun import DryRunner, trace_model

    path = tiny_vlms[family]
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.bfloat16, device_map="cpu",
                                                        attn_implementation="eager").eval()
    source = resolve_model(path)
    runner = DryRunner(source, resolve_quant("auto", source.config), attn="eager")
    imgs = vision.plan_images(built_config_dict(runner.model.config), source.processor, 2, (100, 80))
    seq = 10 + imgs.tokens
    meta = runner.trace(2, seq, imgs)
    real = trace_model(model, "none", torch.bfloat16, 2, seq, lambda: DynamicCache(config=model.config),
                       device="cpu", target="cpu", images=imgs)
    moved = 512 if family == "gemma3" else 0  # held from the prefill on: in the cache and the prefill's peak
    slack = 2048 if family == "qwen2_5_vl" else 0
    shift = {"prefill_peak_bytes": moved, "cache_bytes": moved, "vision_peak_bytes": 0, "decode_peak_bytes": 0}
    for field, expected in shift.items():
        assert abs(getattr(meta, field) - getattr(real, field) - expected) <= slack, field
    assert meta.vision_peak_bytes > meta.vision_extra_bytes > 0


def test_eager_vision_attention_shows_its_scores(tiny_vlms):
    """sdpa runs fused on CUDA (no seq x seq scores); eager materialises heads x seq x seq per image in the
    vision encoder too, and the vision peak says so. Mllama's encoder runs all 4 tiles as one sequence,
    each tile's 16 patches + CLS padded to 24: seq 96, 2 heads, scores softmaxed in float32."""
    path = tiny_vlms["mllama"]
    fused = estimate(path, "auto", prompt=16, images=1, image_size="112x112", device="cuda")
    eager = estimate(path, "auto", prompt=16, images=1, image_size="112x112", device="cuda", attn="eager")
    assert eager.vision_peak - fused.vision_peak >= 2 * 96 * 96 * 4
    assert eager.image_tokens == fused.image_tokens == 1


# ----------------------------------------------------------------------------- configs left to defaults


def test_fields_left_to_defaults_give_the_same_answer(tmp_path):
    """gemma-3-4b-it's config leaves the head counts, head_dim and vocab_size to Gemma3TextConfig; the
    same config with them written out (the class's defaults) gives the same figures."""
    from transformers import Gemma3TextConfig

    base = resolve_model("gemma-3-4b").config
    spelled = json.loads(json.dumps(base))
    defaults = Gemma3TextConfig()
    for key in ("vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
        assert key not in base["text_config"]
        spelled["text_config"][key] = getattr(defaults, key)
    out = {}
    for name, cfg in (("left", base), ("spelled", spelled)):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "_vramcal_catalog"}))
        (d / "preprocessor_config.json").write_text(json.dumps(resolve_model("gemma-3-4b").processor[vision.PREPROCESSOR]))
        e = estimate(str(d), "nf4", prompt=2048, images=1)
        out[name] = {k: getattr(e, k) for k in ("stages", "allocated", "components", "weights_breakdown",
                                                "kv_breakdown", "image_tokens", "vision_peak", "weights_parts",
                                                "peak", "approximate", "warnings")}
        out[name]["formula"] = e.formula.to_dict()
    assert out["left"] == out["spelled"]
    assert out["left"]["image_tokens"] == 258 and not out["left"]["approximate"]


# ----------------------------------------------------------------------------- the probe


def test_probe_runs_a_multimodal_generate(tiny_vlms):
    from vramcal.probes.probe import run_probe

    r = run_probe(tiny_vlms["llava"], "nf4", 40, 1, device="cpu", new_tokens=4, images=2, image_size=(100, 80))
    assert r.status == "ok", r.error
    assert r.image_tokens == r.estimate.image_tokens == 32
    assert r.vision is not None and r.vision.t_end > r.vision.t_start
    assert "--images 2 --image-size 100x80" in r.command
    d = r.to_dict(samples=False)
    assert d["vision"]["t_end"] == r.vision.t_end and d["images"] == 2


def test_json_reports_image_tokens_and_context(tiny_vlms):
    import subprocess
    import sys

    from vramcal.estimator.result import Estimate

    r = subprocess.run([sys.executable, "-m", "vramcal", "estimate", tiny_vlms["gemma3"], "--images", "2",
                        "--image-size", "100x80", "--prompt", "20", "--json", "--no-correction"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert (d["images"], d["image_size"], d["image_tokens"]) == (2, [100, 80], 2 * (4 + 2))
    assert d["context"] == d["ctx"] + d["image_tokens"] == 20 + 16 + 12
    assert set(d["weights_parts"]) == {"model.vision_tower", "model.multi_modal_projector", "model.language_model"}
    assert d["vision_peak"] > 0 and "Gemma 3 processor rules" in d["methods"]["images"]
    assert Estimate.from_dict(d).to_dict() == d


def test_cached_estimate_with_images_does_not_import_torch(tiny_vlms, tmp_path):
    """The image rules are pure: a second estimate of the same images reads the cached inventory (with the
    config transformers filled) and the cached traces, and imports no torch; other images are traced."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "VRAMCAL_CACHE": str(tmp_path / "c"), "VRAMCAL_DB": str(tmp_path / "none.db")}
    args = [sys.executable, "-c",
            "import sys; from vramcal.cli import main; rc = main(sys.argv[1:]); "
            "print('TORCH' if 'torch' in sys.modules else 'NOTORCH', file=sys.stderr); sys.exit(rc)",
            "estimate", tiny_vlms["qwen2_5_vl"], "--quant", "nf4", "--prompt", "40", "--images", "2", "--json"]
    first = subprocess.run(args, capture_output=True, text=True, env=env)
    assert first.returncode == 0 and first.stderr.split()[-1] == "TORCH", first.stderr
    again = subprocess.run(args, capture_output=True, text=True, env=env)
    assert again.returncode == 0 and again.stderr.split()[-1] == "NOTORCH", again.stderr
    assert json.loads(again.stdout)["stages"] == json.loads(first.stdout)["stages"]
    other = subprocess.run(args + ["--image-size", "56x56"], capture_output=True, text=True, env=env)
    assert other.returncode == 0 and other.stderr.split()[-1] == "TORCH", other.stderr
    assert json.loads(other.stdout)["image_tokens"] < json.loads(first.stdout)["image_tokens"]


def test_fit_keeps_the_vision_encoder_apart(tiny_vlms):
    """Between traced points (--fast, fit, proposals) the prefill is the larger of the vision encoder's
    window and the fitted rest, and the fit's shortest point is the images and a few words: for Mllama
    with two images (8 tiles) under a short prompt the fit stays within 10 % of the traced figure, where
    the rest of the prefill alone is 20 % short; the fit read back from the disk cache is the same."""
    from vramcal.estimator.estimate import Estimator

    source = resolve_model(tiny_vlms["mllama"])
    spec = resolve_quant("auto", source.config)
    exact = Estimator(source, spec, images=2, image_size=(112, 112), use_cache=False).estimate(prompt=40)
    est = Estimator(source, spec, images=2, image_size=(112, 112))
    fitted = est.estimate(prompt=40, exact=False)
    assert fitted.methods["activations"].startswith("fit over")
    assert abs(fitted.components["activations"] - exact.components["activations"]) <= 0.1 * exact.components["activations"]
    assert abs(fitted.vision_peak - exact.vision_peak) <= 0.1 * exact.vision_peak
    est._act.vision = None  # the rest of the prefill alone
    assert est.estimate(prompt=40, exact=False).components["activations"] < 0.9 * exact.components["activations"]
    again = Estimator(source, spec, images=2, image_size=(112, 112)).estimate(prompt=40, exact=False)
    assert again.components == fitted.components and again.vision_peak == fitted.vision_peak
