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


def _written(w, path) -> str:
    """Write a GGUFWriter's header, key-values and tensors to ``path`` and close it; return the path."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


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
    return _written(w, path)


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


def write_gguf(path, arch: str, kv: dict, tensors: list[tuple[str, tuple[int, ...]]], *, n_vocab: int = 512,
               weight_type: str = "F32", seed: int = 0) -> str:
    """A tiny GGUF of any architecture: ``kv`` are its ``<arch>.*`` keys (int: u32, float: f32, list: an array,
    bool), ``tensors`` each tensor's name and ggml shape (``ne``, innermost first, as llama.cpp's
    ``create_tensor`` writes it). 1-D tensors are F32, the rest ``weight_type``. Return its path."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    for key, v in kv.items():
        k = f"{arch}.{key}"
        if isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        else:
            w.add_array(k, list(v))
    w.add_file_type(0 if weight_type == "F32" else 1)
    _vocab(w, n_vocab)
    for name, ne in tensors:
        data = (rng.standard_normal(tuple(reversed(ne))) * 0.02).astype(np.float32)
        w.add_tensor(name, data if len(ne) == 1 or weight_type == "F32" else data.astype(np.float16))
    return _written(w, path)


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
    return _written(w, path)


def _common(E: int, V: int, tied: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    out = [("token_embd.weight", (E, V)), ("output_norm.weight", (E,))]
    return out if tied else out + [("output.weight", (E, V))]


def _attn(b: str, E: int, n_head: int, n_kv: int, hd: int) -> list[tuple[str, tuple[int, ...]]]:
    return [(b + "attn_q.weight", (E, n_head * hd)), (b + "attn_k.weight", (E, n_kv * hd)),
            (b + "attn_v.weight", (E, n_kv * hd)), (b + "attn_output.weight", (n_head * hd, E))]


def _ffn(b: str, E: int, F: int) -> list[tuple[str, tuple[int, ...]]]:
    return [(b + "ffn_norm.weight", (E,)), (b + "ffn_gate.weight", (E, F)), (b + "ffn_up.weight", (E, F)),
            (b + "ffn_down.weight", (F, E))]


def _mamba2_mixer(b: str, E: int, d_inner: int, d_state: int, n_group: int, n_head: int, d_conv: int,
                  d_in_proj: int) -> list[tuple[str, tuple[int, ...]]]:
    conv = d_inner + 2 * n_group * d_state
    return [(b + "ssm_in.weight", (E, d_in_proj)), (b + "ssm_conv1d.weight", (d_conv, conv)),
            (b + "ssm_conv1d.bias", (conv,)), (b + "ssm_dt.bias", (n_head,)), (b + "ssm_a", (1, n_head)),
            (b + "ssm_d", (1, n_head)), (b + "ssm_norm.weight", (d_inner // n_group, n_group)),
            (b + "ssm_out.weight", (d_inner, E))]


def write_mamba(path, *, n_layer: int = 2, E: int = 128, d_state: int = 16, d_conv: int = 4, V: int = 512,
                n_ctx_train: int = 2048) -> str:
    """src/models/mamba.cpp: an expansion of 2 (d_inner = 2 n_embd), dt_rank = n_embd / 16."""
    d_inner, dt_rank = 2 * E, E // 16
    t = _common(E, V)
    for i in range(n_layer):
        b = f"blk.{i}."
        t += [(b + "attn_norm.weight", (E,)), (b + "ssm_in.weight", (E, 2 * d_inner)),
              (b + "ssm_conv1d.weight", (d_conv, d_inner)), (b + "ssm_conv1d.bias", (d_inner,)),
              (b + "ssm_x.weight", (d_inner, dt_rank + 2 * d_state)), (b + "ssm_dt.weight", (dt_rank, d_inner)),
              (b + "ssm_dt.bias", (d_inner,)), (b + "ssm_a", (d_state, d_inner)), (b + "ssm_d", (d_inner,)),
              (b + "ssm_out.weight", (d_inner, E))]
    kv = {"context_length": n_ctx_train, "embedding_length": E, "block_count": n_layer, "feed_forward_length": 0,
          "attention.head_count": 0, "ssm.conv_kernel": d_conv, "ssm.inner_size": d_inner,
          "ssm.state_size": d_state, "ssm.time_step_rank": dt_rank, "attention.layer_norm_rms_epsilon": 1e-5}
    return write_gguf(path, "mamba", kv, t, n_vocab=V)


def write_mamba2(path, *, n_layer: int = 2, E: int = 128, d_state: int = 16, d_conv: int = 4, n_group: int = 2,
                 head_dim: int = 32, V: int = 512, n_ctx_train: int = 2048) -> str:
    """src/models/mamba2.cpp: in_proj of d_inner + conv_dim + n_head, n_group groups."""
    d_inner = 2 * E
    n_head = d_inner // head_dim
    conv = d_inner + 2 * n_group * d_state
    t = _common(E, V)
    for i in range(n_layer):
        b = f"blk.{i}."
        t += [(b + "attn_norm.weight", (E,))] + _mamba2_mixer(b, E, d_inner, d_state, n_group, n_head, d_conv,
                                                               d_inner + conv + n_head)
    kv = {"context_length": n_ctx_train, "embedding_length": E, "block_count": n_layer, "feed_forward_length": 0,
          "attention.head_count": 0, "ssm.conv_kernel": d_conv, "ssm.inner_size": d_inner,
          "ssm.state_size": d_state, "ssm.time_step_rank": n_head, "ssm.group_count": n_group,
          "attention.layer_norm_rms_epsilon": 1e-5}
    return write_gguf(path, "mamba2", kv, t, n_vocab=V)


def _mamba2_or_attn(b: str, kind: str, E: int, n_head: int, n_head_kv: int, d_state: int, d_conv: int,
                    n_group: int, head_dim: int) -> list[tuple[str, tuple[int, ...]]]:
    """A hybrid layer's norm and mixer: M a Mamba-2 mixer (expansion 2, ``head_dim`` per SSM head), A
    attention; any other letter the norm alone (an MLP layer's feed-forward is the caller's)."""
    d_inner = 2 * E
    n_ssm_head = d_inner // head_dim
    t = [(b + "attn_norm.weight", (E,))]
    if kind == "M":
        t += _mamba2_mixer(b, E, d_inner, d_state, n_group, n_ssm_head, d_conv,
                           2 * d_inner + 2 * n_group * d_state + n_ssm_head)
    elif kind == "A":
        t += _attn(b, E, n_head, n_head_kv, E // n_head)
    return t


def write_granitehybrid(path, *, kinds: str = "MAMA", E: int = 128, n_head: int = 4, n_head_kv: int = 2,
                        F: int = 256, d_state: int = 16, d_conv: int = 4, n_group: int = 1, head_dim: int = 32,
                        V: int = 512, n_ctx_train: int = 2048) -> str:
    """src/models/granite-hybrid.cpp: ``kinds`` one letter per layer, M a Mamba2 mixer (head_count_kv 0), A
    attention; every layer a dense feed-forward."""
    d_inner, hd = 2 * E, E // n_head
    n_ssm_head = d_inner // head_dim
    t = _common(E, V)
    for i, k in enumerate(kinds):
        b = f"blk.{i}."
        t += _mamba2_or_attn(b, "M" if k == "M" else "A", E, n_head, n_head_kv, d_state, d_conv, n_group, head_dim)
        t += _ffn(b, E, F)
    kv = {"context_length": n_ctx_train, "embedding_length": E, "block_count": len(kinds),
          "feed_forward_length": F, "attention.head_count": n_head,
          "attention.head_count_kv": [0 if k == "M" else n_head_kv for k in kinds],
          "rope.dimension_count": hd, "ssm.conv_kernel": d_conv, "ssm.inner_size": d_inner,
          "ssm.state_size": d_state, "ssm.time_step_rank": n_ssm_head, "ssm.group_count": n_group,
          "attention.layer_norm_rms_epsilon": 1e-5}
    return write_gguf(path, "granitehybrid", kv, t, n_vocab=V)


def write_jamba(path, *, kinds: str = "MAMM", E: int = 128, n_head: int = 4, n_head_kv: int = 2, F: int = 256,
                d_state: int = 16, d_conv: int = 4, V: int = 512, n_ctx_train: int = 2048) -> str:
    """src/models/jamba.cpp: Mamba (1) mixers with dt / B / C norms where head_count_kv is 0, attention
    elsewhere; dense feed-forwards."""
    d_inner, dt_rank = 2 * E, E // 16
    hd = E // n_head
    t = _common(E, V)
    for i, k in enumerate(kinds):
        b = f"blk.{i}."
        t.append((b + "attn_norm.weight", (E,)))
        if k == "M":
            t += [(b + "ssm_in.weight", (E, 2 * d_inner)), (b + "ssm_conv1d.weight", (d_conv, d_inner)),
                  (b + "ssm_conv1d.bias", (d_inner,)), (b + "ssm_x.weight", (d_inner, dt_rank + 2 * d_state)),
                  (b + "ssm_dt_norm.weight", (dt_rank,)), (b + "ssm_dt.weight", (dt_rank, d_inner)),
                  (b + "ssm_dt.bias", (d_inner,)), (b + "ssm_b_norm.weight", (d_state,)),
                  (b + "ssm_c_norm.weight", (d_state,)), (b + "ssm_a", (d_state, d_inner)), (b + "ssm_d", (d_inner,)),
                  (b + "ssm_out.weight", (d_inner, E))]
        else:
            t += _attn(b, E, n_head, n_head_kv, hd)
        t += _ffn(b, E, F)
    kv = {"context_length": n_ctx_train, "embedding_length": E, "block_count": len(kinds),
          "feed_forward_length": F, "attention.head_count": n_head,
          "attention.head_count_kv": [0 if k == "M" else n_head_kv for k in kinds],
          "ssm.conv_kernel": d_conv, "ssm.inner_size": d_inner, "ssm.state_size": d_state,
          "ssm.time_step_rank": dt_rank, "attention.layer_norm_rms_epsilon": 1e-5}
    return write_gguf(path, "jamba", kv, t, n_vocab=V)


def write_lfm2(path, *, kinds: str = "CCAC", E: int = 128, n_head: int = 4, n_head_kv: int = 2, F: int = 256,
               l_cache: int = 3, V: int = 512, n_ctx_train: int = 2048) -> str:
    """src/models/lfm2.cpp: C a short-convolution layer (head_count_kv 0), A attention with q/k norms; the
    output norm is named ``token_embd_norm`` (llama-arch.cpp LLM_TENSOR_OUTPUT_NORM_LFM2)."""
    hd = E // n_head
    t = [("token_embd.weight", (E, V)), ("token_embd_norm.weight", (E,))]
    for i, k in enumerate(kinds):
        b = f"blk.{i}."
        t += _ffn(b, E, F) + [(b + "attn_norm.weight", (E,))]
        if k == "C":
            t += [(b + "shortconv.conv.weight", (l_cache, E)), (b + "shortconv.in_proj.weight", (E, 3 * E)),
                  (b + "shortconv.out_proj.weight", (E, E))]
        else:
            t += [(b + "attn_q_norm.weight", (hd,)), (b + "attn_k_norm.weight", (hd,))] + \
                _attn(b, E, n_head, n_head_kv, hd)
    kv = {"context_length": n_ctx_train, "embedding_length": E, "block_count": len(kinds),
          "feed_forward_length": F, "attention.head_count": n_head,
          "attention.head_count_kv": [0 if k == "C" else n_head_kv for k in kinds],
          "rope.dimension_count": hd, "shortconv.l_cache": l_cache, "attention.layer_norm_rms_epsilon": 1e-5}
    return write_gguf(path, "lfm2", kv, t, n_vocab=V)


def write_rwkv6(path, *, n_layer: int = 2, E: int = 128, head_size: int = 32, F: int = 256, V: int = 512,
                mix_dim: int = 8, decay_dim: int = 16, n_ctx_train: int = 2048) -> str:
    """src/models/rwkv6.cpp: time mix (the WKV state) and channel mix per layer, layer norms with biases."""
    t = [("token_embd.weight", (E, V)), ("token_embd_norm.weight", (E,)), ("token_embd_norm.bias", (E,)),
         ("output_norm.weight", (E,)), ("output_norm.bias", (E,)), ("output.weight", (E, V))]
    for i in range(n_layer):
        b = f"blk.{i}."
        t += [(b + "attn_norm.weight", (E,)), (b + "attn_norm.bias", (E,)), (b + "attn_norm_2.weight", (E,)),
              (b + "attn_norm_2.bias", (E,)), (b + "time_mix_w1.weight", (E, mix_dim * 5)),
              (b + "time_mix_w2.weight", (mix_dim, E, 5)), (b + "time_mix_lerp_x.weight", (E, 1, 1)),
              (b + "time_mix_lerp_fused.weight", (E, 1, 1, 5)),
              (b + "time_mix_first.weight", (head_size, E // head_size)),
              (b + "time_mix_decay.weight", (E,)), (b + "time_mix_decay_w1.weight", (E, decay_dim)),
              (b + "time_mix_decay_w2.weight", (decay_dim, E)), (b + "time_mix_key.weight", (E, E)),
              (b + "time_mix_value.weight", (E, E)), (b + "time_mix_receptance.weight", (E, E)),
              (b + "time_mix_gate.weight", (E, E)), (b + "time_mix_ln.weight", (E,)), (b + "time_mix_ln.bias", (E,)),
              (b + "time_mix_output.weight", (E, E)), (b + "channel_mix_lerp_k.weight", (E, 1, 1)),
              (b + "channel_mix_lerp_r.weight", (E, 1, 1)), (b + "channel_mix_key.weight", (E, F)),
              (b + "channel_mix_value.weight", (F, E)), (b + "channel_mix_receptance.weight", (E, E))]
    kv = {"context_length": n_ctx_train, "embedding_length": E, "block_count": n_layer, "feed_forward_length": F,
          "attention.head_count": 0, "wkv.head_size": head_size, "time_mix_extra_dim": mix_dim,
          "time_decay_extra_dim": decay_dim, "rescale_every_n_layers": 6, "attention.layer_norm_epsilon": 1e-5}
    return write_gguf(path, "rwkv6", kv, t, n_vocab=V)


def write_deepseek2(path, *, n_layer: int = 2, E: int = 128, n_head: int = 4, q_lora: int = 64, kv_lora: int = 64,
                    nope: int = 32, rope: int = 16, v_head: int = 32, n_expert: int = 4, n_expert_used: int = 2,
                    F: int = 256, F_exp: int = 64, V: int = 512, n_ctx_train: int = 2048, nextn: int = 0) -> str:
    """src/models/deepseek2.cpp as convert_hf_to_gguf.py writes it today: MLA with the decompression split into
    ``attn_k_b`` / ``attn_v_b``, one KV head of ``kv_lora_rank + rope`` values (key_length), ``key_length_mla`` /
    ``value_length_mla`` the per-head widths; the first layer dense, the rest MoE with a shared expert."""
    t = _common(E, V)
    for i in range(n_layer):
        b = f"blk.{i}."
        t += [(b + "attn_norm.weight", (E,)), (b + "attn_q_a_norm.weight", (q_lora,)),
              (b + "attn_kv_a_norm.weight", (kv_lora,)), (b + "attn_q_a.weight", (E, q_lora)),
              (b + "attn_q_b.weight", (q_lora, n_head * (nope + rope))),
              (b + "attn_kv_a_mqa.weight", (E, kv_lora + rope)), (b + "attn_k_b.weight", (nope, kv_lora, n_head)),
              (b + "attn_v_b.weight", (kv_lora, v_head, n_head)), (b + "attn_output.weight", (n_head * v_head, E))]
        if i == 0:
            t += _ffn(b, E, F)
        else:
            t += [(b + "ffn_norm.weight", (E,)), (b + "ffn_gate_inp.weight", (E, n_expert)),
                  (b + "ffn_down_exps.weight", (F_exp, E, n_expert)),
                  (b + "ffn_gate_exps.weight", (E, F_exp, n_expert)),
                  (b + "ffn_up_exps.weight", (E, F_exp, n_expert)), (b + "ffn_gate_shexp.weight", (E, F_exp)),
                  (b + "ffn_down_shexp.weight", (F_exp, E)), (b + "ffn_up_shexp.weight", (E, F_exp))]
    kv = {"context_length": n_ctx_train, "embedding_length": E, "block_count": n_layer, "feed_forward_length": F,
          "attention.head_count": n_head, "attention.head_count_kv": 1, "attention.key_length": kv_lora + rope,
          "attention.value_length": kv_lora, "attention.key_length_mla": nope + rope,
          "attention.value_length_mla": v_head, "attention.q_lora_rank": q_lora, "attention.kv_lora_rank": kv_lora,
          "rope.dimension_count": rope, "leading_dense_block_count": 1, "expert_count": n_expert,
          "expert_used_count": n_expert_used, "expert_feed_forward_length": F_exp, "expert_shared_count": 1,
          "expert_weights_scale": 1.0, "attention.layer_norm_rms_epsilon": 1e-6}
    if nextn:  # MTP layers counted in block_count, their tensors left out (a trunk-only file: llama.cpp skips them)
        kv.update(block_count=n_layer + nextn, nextn_predict_layers=nextn)
    return write_gguf(path, "deepseek2", kv, t, n_vocab=V)


def write_falcon_h1(path, *, n_layer: int = 2, E: int = 128, n_head: int = 4, n_head_kv: int = 2, F: int = 256,
                    d_state: int = 16, d_conv: int = 4, n_group: int = 1, head_dim: int = 32, V: int = 512,
                    n_ctx_train: int = 2048) -> str:
    """src/models/falcon-h1.cpp: every layer runs attention and a Mamba2 mixer side by side, then a dense
    feed-forward (its norm is named ``blk.N.ffn_norm``, without ``.weight``)."""
    d_inner = 2 * E
    n_ssm_head = d_inner // head_dim
    conv = d_inner + 2 * n_group * d_state
    hd = E // n_head
    t = _common(E, V)
    for i in range(n_layer):
        b = f"blk.{i}."
        t += _mamba2_mixer(b, E, d_inner, d_state, n_group, n_ssm_head, d_conv, d_inner + conv + n_ssm_head)
        t += _attn(b, E, n_head, n_head_kv, hd) + [(b + "attn_norm.weight", (E,)), (b + "ffn_norm", (E,))]
        t += _ffn(b, E, F)[1:]
    kv = {"context_length": n_ctx_train, "embedding_length": E, "block_count": n_layer, "feed_forward_length": F,
          "attention.head_count": n_head, "attention.head_count_kv": n_head_kv, "rope.dimension_count": hd,
          "ssm.conv_kernel": d_conv, "ssm.inner_size": d_inner, "ssm.state_size": d_state,
          "ssm.time_step_rank": n_ssm_head, "ssm.group_count": n_group, "attention.layer_norm_rms_epsilon": 1e-5}
    return write_gguf(path, "falcon-h1", kv, t, n_vocab=V)


def write_qwen3next(path, *, n_layer: int = 4, E: int = 128, n_head: int = 4, n_head_kv: int = 2, hd: int = 32,
                    d_state: int = 32, n_k_heads: int = 2, n_v_heads: int = 4, d_conv: int = 4, n_expert: int = 4,
                    n_expert_used: int = 2, F_exp: int = 64, V: int = 512, n_ctx_train: int = 2048) -> str:
    """src/models/qwen3next.cpp: gated delta-net layers (recurrent) with a full-attention layer every
    ``full_attention_interval`` (default 4), MoE with a gated shared expert in every layer."""
    key_dim, value_dim = d_state * n_k_heads, d_state * n_v_heads
    t = _common(E, V)
    for i in range(n_layer):
        b = f"blk.{i}."
        t += [(b + "attn_norm.weight", (E,)), (b + "post_attention_norm.weight", (E,))]
        if (i + 1) % 4 == 0:
            t += [(b + "attn_q.weight", (E, n_head * hd * 2)), (b + "attn_k.weight", (E, n_head_kv * hd)),
                  (b + "attn_v.weight", (E, n_head_kv * hd)), (b + "attn_output.weight", (n_head * hd, E)),
                  (b + "attn_q_norm.weight", (hd,)), (b + "attn_k_norm.weight", (hd,))]
        else:
            t += [(b + "ssm_in.weight", (E, 2 * key_dim + 2 * value_dim)),
                  (b + "ssm_conv1d.weight", (d_conv, 2 * key_dim + value_dim)), (b + "ssm_dt.bias", (n_v_heads,)),
                  (b + "ssm_a", (n_v_heads,)), (b + "ssm_ba.weight", (E, 2 * n_v_heads)),
                  (b + "ssm_norm.weight", (d_state,)), (b + "ssm_out.weight", (value_dim, E))]
        t += [(b + "ffn_gate_inp.weight", (E, n_expert)), (b + "ffn_down_exps.weight", (F_exp, E, n_expert)),
              (b + "ffn_gate_exps.weight", (E, F_exp, n_expert)), (b + "ffn_up_exps.weight", (E, F_exp, n_expert)),
              (b + "ffn_gate_inp_shexp.weight", (E,)), (b + "ffn_gate_shexp.weight", (E, F_exp)),
              (b + "ffn_up_shexp.weight", (E, F_exp)), (b + "ffn_down_shexp.weight", (F_exp, E))]
    kv = {"context_length": n_ctx_train, "embedding_length": E, "block_count": n_layer, "feed_forward_length": F_exp,
          "attention.head_count": n_head, "attention.head_count_kv": n_head_kv, "attention.key_length": hd,
          "attention.value_length": hd, "rope.dimension_count": hd // 4, "expert_count": n_expert,
          "expert_used_count": n_expert_used, "expert_feed_forward_length": F_exp,
          "expert_shared_feed_forward_length": F_exp, "ssm.conv_kernel": d_conv, "ssm.inner_size": value_dim,
          "ssm.state_size": d_state, "ssm.time_step_rank": n_v_heads, "ssm.group_count": n_k_heads,
          "attention.layer_norm_rms_epsilon": 1e-6}
    return write_gguf(path, "qwen3next", kv, t, n_vocab=V)


def write_nemotron_h(path, *, kinds: str = "MFAF", E: int = 128, n_head: int = 4, n_head_kv: int = 2, F: int = 256,
                     d_state: int = 16, d_conv: int = 4, n_group: int = 2, head_dim: int = 32, V: int = 512,
                     n_ctx_train: int = 2048) -> str:
    """src/models/nemotron-h.cpp: M a Mamba2 mixer (no KV heads, no feed-forward), A attention (KV heads, no
    feed-forward), F an MLP (a feed-forward, no KV heads): per-layer head_count_kv and feed_forward_length."""
    d_inner, hd = 2 * E, E // n_head
    n_ssm_head = d_inner // head_dim
    t = _common(E, V)
    for i, k in enumerate(kinds):
        b = f"blk.{i}."
        t += _mamba2_or_attn(b, k, E, n_head, n_head_kv, d_state, d_conv, n_group, head_dim)
        if k == "F":
            t += [(b + "ffn_down.weight", (F, E)), (b + "ffn_up.weight", (E, F))]
    kv = {"context_length": n_ctx_train, "embedding_length": E, "block_count": len(kinds),
          "feed_forward_length": [F if k == "F" else 0 for k in kinds], "attention.head_count": n_head,
          "attention.head_count_kv": [n_head_kv if k == "A" else 0 for k in kinds], "attention.key_length": hd,
          "attention.value_length": hd, "ssm.conv_kernel": d_conv, "ssm.inner_size": d_inner,
          "ssm.state_size": d_state, "ssm.time_step_rank": n_ssm_head, "ssm.group_count": n_group,
          "attention.layer_norm_epsilon": 1e-5, "attention.layer_norm_rms_epsilon": 1e-5}
    return write_gguf(path, "nemotron_h", kv, t, n_vocab=V)


def write_rwkv7(path, *, n_layer: int = 2, E: int = 128, head_size: int = 32, F: int = 256, V: int = 512,
                lora: int = 16, n_ctx_train: int = 2048) -> str:
    """src/models/rwkv7.cpp: the time mix's low-rank decay, in-context learning rate, value-residual and gate
    projections, the six-way fused lerp; the first layer has no value-residual mix of its own."""
    t = [("token_embd.weight", (E, V)), ("token_embd_norm.weight", (E,)), ("token_embd_norm.bias", (E,)),
         ("output_norm.weight", (E,)), ("output_norm.bias", (E,)), ("output.weight", (E, V))]
    for i in range(n_layer):
        b = f"blk.{i}."
        t += [(b + "attn_norm.weight", (E,)), (b + "attn_norm.bias", (E,)), (b + "attn_norm_2.weight", (E,)),
              (b + "attn_norm_2.bias", (E,))]
        for x in ("w", "a", "v"):
            t += [(b + f"time_mix_{x}0.weight", (E,)), (b + f"time_mix_{x}1.weight", (E, lora)),
                  (b + f"time_mix_{x}2.weight", (lora, E))]
        t += [(b + "time_mix_g1.weight", (E, lora)), (b + "time_mix_g2.weight", (lora, E)),
              (b + "time_mix_lerp_fused.weight", (E, 1, 1, 6)), (b + "time_mix_k_k.weight", (E,)),
              (b + "time_mix_k_a.weight", (E,)), (b + "time_mix_r_k.weight", (E,)), (b + "time_mix_key.weight", (E, E)),
              (b + "time_mix_value.weight", (E, E)), (b + "time_mix_receptance.weight", (E, E)),
              (b + "time_mix_ln.weight", (E,)), (b + "time_mix_ln.bias", (E,)), (b + "time_mix_output.weight", (E, E)),
              (b + "channel_mix_lerp_k.weight", (E, 1, 1)), (b + "channel_mix_key.weight", (E, F)),
              (b + "channel_mix_value.weight", (F, E))]
    kv = {"context_length": n_ctx_train, "embedding_length": E, "block_count": n_layer, "feed_forward_length": F,
          "attention.head_count": 0, "wkv.head_size": head_size, "attention.decay_lora_rank": lora,
          "attention.iclr_lora_rank": lora, "attention.value_residual_mix_lora_rank": lora,
          "attention.gate_lora_rank": lora, "attention.layer_norm_epsilon": 1e-5}
    return write_gguf(path, "rwkv7", kv, t, n_vocab=V)
