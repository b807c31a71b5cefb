"""Tiny GGUF files for the llama.cpp tests, written with the ``gguf`` package: random numpy weights at
small widths, a small SentencePiece-style vocabulary of our own (three control tokens, the 256 byte tokens,
then filler pieces), and the architecture keys llama.cpp's loader reads (src/models/<arch>.cpp)."""

from __future__ import annotations

import numpy as np


def _vocab(w, n_vocab: int) -> None:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tokens += [f"\u2581t{i}" for i in range(n_vocab - len(tokens))]
    types = [2, 3, 3] + [6] * 256 + [1] * (n_vocab - 259)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(n_vocab - 259)])
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)


def _hparams(w, *, n_layer: int, n_ctx_train: int, n_embd: int, n_ff: int, n_head: int, n_head_kv: int,
             norm_eps: float) -> None:
    """The architecture keys every writer here sets (llama.cpp's loader reads them as ``<arch>.*``)."""
    w.add_block_count(n_layer)
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(norm_eps)


def write_tiny(path, *, arch: str = "llama", n_layer: int = 2, n_embd: int = 256, n_head: int = 4,
               n_head_kv: int = 2, n_ff: int = 512, n_vocab: int = 1024, n_ctx_train: int = 4096,
               weight_type: str = "F16", embd_type: str | None = None, tied: bool = False, n_expert: int = 0,
               n_expert_used: int = 0, sliding_window: int = 0, head_dim: int | None = None, seed: int = 0) -> str:
    """Write a tiny model llama.cpp loads and runs; return its path."""
    import gguf

    rng = np.random.default_rng(seed)
    hd = head_dim or n_embd // n_head
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    _hparams(w, n_layer=n_layer, n_ctx_train=n_ctx_train, n_embd=n_embd, n_ff=n_ff, n_head=n_head,
             n_head_kv=n_head_kv, norm_eps=1e-6)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(hd)
    w.add_file_type(1)
    if n_expert:
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_expert_used)
    if sliding_window:
        w.add_sliding_window(sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(50.0)
        w.add_final_logit_softcapping(30.0)
    _vocab(w, n_vocab)

    def put(name: str, shape: tuple[int, ...], qtype: str | None = None) -> None:
        data = (rng.standard_normal(shape) * 0.02).astype(np.float32)
        if len(shape) == 1 or qtype is None:
            qtype = "F32" if len(shape) == 1 else weight_type
        t = gguf.GGMLQuantizationType[qtype]
        if t == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, data)
        elif t == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, data.astype(np.float16))
        else:
            q = gguf.quants.quantize(data, t)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=t)

    put("token_embd.weight", (n_vocab, n_embd), embd_type or weight_type)
    for i in range(n_layer):
        b = f"blk.{i}."
        put(b + "attn_norm.weight", (n_embd,))
        put(b + "attn_q.weight", (n_head * hd, n_embd), weight_type)
        put(b + "attn_k.weight", (n_head_kv * hd, n_embd), weight_type)
        put(b + "attn_v.weight", (n_head_kv * hd, n_embd), weight_type)
        put(b + "attn_output.weight", (n_embd, n_head * hd), weight_type)
        if arch in ("gemma2", "gemma3"):
            put(b + "post_attention_norm.weight", (n_embd,))
            put(b + "post_ffw_norm.weight", (n_embd,))
        if arch == "gemma3":
            put(b + "attn_q_norm.weight", (hd,))
            put(b + "attn_k_norm.weight", (hd,))
        put(b + "ffn_norm.weight", (n_embd,))
        if n_expert:
            put(b + "ffn_gate_inp.weight", (n_expert, n_embd), "F32")
            put(b + "ffn_gate_exps.weight", (n_expert, n_ff, n_embd), weight_type)
            put(b + "ffn_up_exps.weight", (n_expert, n_ff, n_embd), weight_type)
            put(b + "ffn_down_exps.weight", (n_expert, n_embd, n_ff), weight_type)
        else:
            put(b + "ffn_gate.weight", (n_ff, n_embd), weight_type)
            put(b + "ffn_up.weight", (n_ff, n_embd), weight_type)
            put(b + "ffn_down.weight", (n_embd, n_ff), weight_type)
    put("output_norm.weight", (n_embd,))
    if not tied:
        put("output.weight", (n_vocab, n_embd), weight_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def write_sparse_header(path, *, n_layer: int = 80, n_embd: int = 8192, n_ff: int = 28672, n_head: int = 64,
                        n_head_kv: int = 8, n_vocab: int = 128256, n_ctx_train: int = 131072, n_expert: int = 0,
                        n_expert_used: int = 0, n_merges: int = 0) -> str:
    """A big model's GGUF as its header alone, then a hole as long as its tensors (a sparse file): llama.cpp's
    Q4_K_M mix (Q4_K matrices, Q6_K for attn_v, ffn_down and the output, F32 norms), by default a
    Llama-3.1-70B shape. The vocabulary is counted, not spelt (filler tokens): the estimate reads its length
    only. ``n_merges``: BPE merges as well, with token types, for a header as long as a real one (Llama-3.1:
    280147; benchmarks/bench_llamacpp.py times the walk over them). Return its path."""
    import os

    import gguf

    Q = gguf.GGMLQuantizationType
    w = gguf.GGUFWriter(str(path), "llama")
    _hparams(w, n_layer=n_layer, n_ctx_train=n_ctx_train, n_embd=n_embd, n_ff=n_ff, n_head=n_head,
             n_head_kv=n_head_kv, norm_eps=1e-5)
    if n_expert:
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_expert_used)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(n_vocab)])
    if n_merges:
        w.add_token_types([1] * n_vocab)
        w.add_token_merges([f"a{i} b{i}" for i in range(n_merges)])
    data = 0
    hd = n_embd // n_head

    def info(name, shape, t):
        nonlocal data
        block, size = gguf.GGML_QUANT_SIZES[t]
        n = int(np.prod(shape)) // block * size
        byte_shape = shape if t == Q.F32 else (*shape[:-1], shape[-1] // block * size)
        w.add_tensor_info(name, byte_shape, np.dtype(np.float32 if t == Q.F32 else np.uint8), n, raw_dtype=t)
        data += (n + 31) // 32 * 32

    info("token_embd.weight", (n_vocab, n_embd), Q.Q4_K)
    for i in range(n_layer):
        b = f"blk.{i}."
        info(b + "attn_norm.weight", (n_embd,), Q.F32)
        info(b + "ffn_norm.weight", (n_embd,), Q.F32)
        info(b + "attn_q.weight", (n_head * hd, n_embd), Q.Q4_K)
        info(b + "attn_k.weight", (n_head_kv * hd, n_embd), Q.Q4_K)
        info(b + "attn_v.weight", (n_head_kv * hd, n_embd), Q.Q6_K)
        info(b + "attn_output.weight", (n_embd, n_head * hd), Q.Q4_K)
        if n_expert:
            info(b + "ffn_gate_inp.weight", (n_expert, n_embd), Q.F32)
            info(b + "ffn_gate_exps.weight", (n_expert, n_ff, n_embd), Q.Q4_K)
            info(b + "ffn_up_exps.weight", (n_expert, n_ff, n_embd), Q.Q4_K)
            info(b + "ffn_down_exps.weight", (n_expert, n_embd, n_ff), Q.Q6_K)
        else:
            info(b + "ffn_gate.weight", (n_ff, n_embd), Q.Q4_K)
            info(b + "ffn_up.weight", (n_ff, n_embd), Q.Q4_K)
            info(b + "ffn_down.weight", (n_embd, n_ff), Q.Q6_K)
    info("output_norm.weight", (n_embd,), Q.F32)
    info("output.weight", (n_vocab, n_embd), Q.Q6_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    size = os.path.getsize(path)
    os.truncate(path, (size + 31) // 32 * 32 + data)
    return str(path)


def write_tiny_mmproj(path, *, n_embd: int = 64, n_ff: int = 128, n_layer: int = 2, n_head: int = 4,
                      image_size: int = 64, patch_size: int = 8, n_embd_text: int = 256, n_merge: int = 2,
                      weight_type: str = "F16", seed: int = 0) -> str:
    """Write a tiny Gemma 3 style multimodal projector (``mmproj``: a SigLIP ViT and the ``gemma3`` projector,
    the keys and tensor names of llama.cpp's tools/mtmd/clip-impl.h) that libmtmd loads; return its path.
    Rows of a quantized ``weight_type`` must be a multiple of its block (Q8_0: 32 values)."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_name("tiny-mmproj")
    w.add_clip_has_vision_encoder(True)
    w.add_clip_projector_type("gemma3")
    w.add_vision_projection_dim(n_embd_text)
    w.add_vision_embedding_length(n_embd)
    w.add_vision_feed_forward_length(n_ff)
    w.add_vision_block_count(n_layer)
    w.add_vision_head_count(n_head)
    w.add_vision_attention_layernorm_eps(1e-6)
    w.add_vision_image_size(image_size)
    w.add_vision_patch_size(patch_size)
    w.add_vision_image_mean([0.5, 0.5, 0.5])
    w.add_vision_image_std([0.5, 0.5, 0.5])
    w.add_vision_use_gelu(True)
    w.add_vision_projector_scale_factor(n_merge)

    def put(name: str, shape: tuple[int, ...], qtype: str = "F32") -> None:  # shape in PyTorch order
        data = (rng.standard_normal(shape) * 0.02).astype(np.float32)
        t = gguf.GGMLQuantizationType[qtype]
        if t == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, data)
        elif t == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, data.astype(np.float16))
        else:
            q = gguf.quants.quantize(data, t)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=t)

    n_patches = (image_size // patch_size) ** 2
    put("v.patch_embd.weight", (n_embd, 3, patch_size, patch_size), "F16")
    put("v.patch_embd.bias", (n_embd,))
    put("v.position_embd.weight", (n_patches, n_embd), "F16")
    for i in range(n_layer):
        b = f"v.blk.{i}."
        for proj in ("attn_q", "attn_k", "attn_v", "attn_out"):
            put(b + proj + ".weight", (n_embd, n_embd), weight_type)
            put(b + proj + ".bias", (n_embd,))
        for norm in ("ln1", "ln2"):
            put(b + norm + ".weight", (n_embd,))
            put(b + norm + ".bias", (n_embd,))
        put(b + "ffn_up.weight", (n_ff, n_embd), weight_type)
        put(b + "ffn_up.bias", (n_ff,))
        put(b + "ffn_down.weight", (n_embd, n_ff), weight_type)
        put(b + "ffn_down.bias", (n_embd,))
    put("v.post_ln.weight", (n_embd,))
    put("v.post_ln.bias", (n_embd,))
    put("mm.soft_emb_norm.weight", (n_embd,))
    put("mm.input_projection.weight", (n_embd, n_embd_text), "F16")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)
