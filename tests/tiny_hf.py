"""Tiny Hugging Face checkpoints turned into GGUFs by llama.cpp's own tools: transformers builds each model
from a tiny config and saves it (safetensors + config.json), the vendored ``convert_hf_to_gguf.py`` converts
it to F16, and llama.cpp's quantizer (``llama_cpp.llama_model_quantize``) makes each file type of it.

Run as a child (``python tiny_hf.py OUT LLAMA_CPP_SRC ARCH:TYPE,TYPE ...``): the converter puts the vendored gguf-py
first on ``sys.path``, which must not replace the installed ``gguf`` of the test process.

The vocabulary: the converter reads a tokenizer for the GGUF's vocabulary, and each architecture's own
path wants either sentencepiece (not installed here) or a BPE tokenizer whose pre-tokenizer hash it knows
(``get_vocab_base_pre``), which no tiny tokenizer has. So every model gets a Llama-style BPE
``tokenizer.json`` (byte fallback; built with ``tokenizers``) of exactly ``vocab_size`` entries, and the
converter's ``set_vocab`` is pointed at its Llama-HF reader (``_set_vocab_llama_hf``, gguf-py's
``LlamaHfVocab``) for every architecture. That step only writes the ``tokenizer.*`` keys; every tensor --
its name, shape and type -- comes from the converter's own code for the architecture.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# one tiny config per architecture, each chosen to reach a different branch of llama.cpp's type rules
CONFIGS = {
    # GQA 8/2 (n_gqa 4: IQ4_XS's attn_v bump), 8 layers (use_more_bits picks 0, 3, 6, 7), llama3 rope
    # (the converter's rope_freqs tensor), an untied output
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
              "intermediate_size": 256, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2,
              "head_dim": 32, "vocab_size": 512, "max_position_embeddings": 4096, "tie_word_embeddings": False,
              "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                       "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 1024}},
    # rows of 320 (no K-quant block divides them: the fallbacks), a tied output (token_embd typed as the
    # output), q/k/v biases
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 320,
              "intermediate_size": 320, "num_hidden_layers": 4, "num_attention_heads": 5, "num_key_value_heads": 1,
              "vocab_size": 512, "max_position_embeddings": 4096, "tie_word_embeddings": True},
    # experts (3-D tensors, the layer read from the name), the router kept F32, q/k norms
    "qwen3moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 256,
                 "intermediate_size": 256, "moe_intermediate_size": 256, "num_hidden_layers": 4,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "num_experts": 4,
                 "num_experts_per_tok": 2, "vocab_size": 512, "max_position_embeddings": 4096,
                 "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": []},
}

# the other modelled architectures, converted and compared only on request (VRAMCAL_HF2GGUF_ALL=1): each
# was checked once this way (docs/llamacpp.md), the suite's time allows three
MORE_CONFIGS = {
    "gemma2": {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 256,
               "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 64, "vocab_size": 512, "max_position_embeddings": 4096, "sliding_window": 256,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 64},
    "gemma3": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 256,
               "intermediate_size": 512, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 1,
               "head_dim": 64, "vocab_size": 512, "max_position_embeddings": 4096, "sliding_window": 256,
               "query_pre_attn_scalar": 64},
    "mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 256,
                "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
                "vocab_size": 512, "max_position_embeddings": 4096, "sliding_window": None},
    "mixtral": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 256,
                "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
                "vocab_size": 512, "max_position_embeddings": 4096, "num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256,
              "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 64, "vocab_size": 512, "max_position_embeddings": 4096, "tie_word_embeddings": True},
    "qwen2moe": {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 256,
                 "intermediate_size": 512, "moe_intermediate_size": 256, "shared_expert_intermediate_size": 512,
                 "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4,
                 "num_experts_per_tok": 2, "vocab_size": 512, "max_position_embeddings": 4096,
                 "tie_word_embeddings": False},
}
MORE_JOBS = ("gemma2:Q4_K_M,IQ4_XS", "gemma3:Q4_K_M,Q5_K_S", "mistral:Q4_K_M,Q6_K", "mixtral:Q4_K_M,Q3_K_M",
             "qwen3:Q4_K_M,Q5_K_M", "qwen2moe:Q4_K_M,Q4_K_S")


def write_tokenizer(folder: Path, n_vocab: int) -> None:
    """A Llama-style BPE tokenizer.json (byte fallback, the Sequence decoder LlamaHfVocab looks for)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    specials = ["<unk>", "<s>", "</s>"]
    pieces = specials + [f"<0x{i:02X}>" for i in range(256)]
    pieces += [f"\u2581t{i}" for i in range(n_vocab - len(pieces))]
    tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], unk_token="<unk>",
                               byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(specials)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
         "pad_token": "</s>"}))  # every special token named: a class default (Qwen2's <|endoftext|>) would add one


def save_model(folder: Path, config: dict) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(**config)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float16)
    model.save_pretrained(folder)
    write_tokenizer(folder, config["vocab_size"])


def convert(folder: Path, out: Path, src: Path) -> None:
    """convert_hf_to_gguf.py FOLDER --outtype f16 --outfile OUT, its vocabulary step as the docstring says."""
    sys.path.insert(0, str(src))
    import convert_hf_to_gguf
    from conversion.base import TextModel

    config = json.loads((folder / "config.json").read_text())
    cls = convert_hf_to_gguf.get_model_class(config["architectures"][0])
    cls.set_vocab = TextModel._set_vocab_llama_hf
    argv = sys.argv
    sys.argv = ["convert_hf_to_gguf.py", str(folder), "--outtype", "f16", "--outfile", str(out)]
    try:
        convert_hf_to_gguf.main()
    finally:
        sys.argv = argv


def quantize(src: Path, dst: Path, ftype: str) -> None:
    import ctypes

    import llama_cpp

    global _quiet
    if "_quiet" not in globals():  # llama.cpp's log off: printing each tensor's line costs more than the work
        _quiet = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(lambda *_: None)
        llama_cpp.llama_log_set(_quiet, None)
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    p.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), p)
    if rc != 0:
        raise SystemExit(f"llama_model_quantize {ftype} of {src} failed ({rc})")


def main(out: str, src: str, *jobs: str) -> None:
    """``jobs``: ``ARCH:TYPE,TYPE`` each (the F16 conversion of each ARCH is always made)."""
    import logging

    logging.disable(logging.WARNING)
    root = Path(out)
    for job in jobs:
        arch, _, types = job.partition(":")
        folder = root / arch
        folder.mkdir(parents=True, exist_ok=True)
        save_model(folder, {**CONFIGS, **MORE_CONFIGS}[arch])
        f16 = root / f"{arch}-F16.gguf"
        convert(folder, f16, Path(src))
        for t in filter(None, types.split(",")):
            quantize(f16, root / f"{arch}-{t}.gguf", t)


if __name__ == "__main__":
    main(*sys.argv[1:])
