"""A GGUF's header before download: the tensors llama.cpp's converter writes for a Hugging Face config, each
typed as llama.cpp's quantizer types it for a file type (``Q4_K_M``, ``Q8_0``, ``IQ4_XS`` ...), laid out as
the quantizer lays them out. The result is the :class:`~.gguf_file.GgufModel` a real file's header reads
as, so :mod:`.buffers`, :mod:`.compute` and :mod:`.fit` price it unchanged.

Two stages, each from the llama.cpp tree llama-cpp-python 0.3.36 vendors (``vendor/llama.cpp/``):

1. **The converter** (``convert_hf_to_gguf.py``, ``conversion/base.py`` ``TextModel.prepare_tensors`` and
   ``conversion/{llama,qwen,gemma}.py``): which GGUF tensors an architecture has, their ggml shapes (the
   PyTorch shape reversed: a Linear ``[out, in]`` is ``ne = (in, out)``; experts stacked into one
   ``(in, out, n_expert)`` tensor), and which it keeps in F32 -- every 1-D tensor, every ``*_norm.weight``,
   the MoE router ``ffn_gate_inp`` and anything not ending in ``.weight`` (biases). Names are gguf-py's
   (``gguf.TENSOR_NAMES``), metadata keys too (``gguf.Keys``).
2. **The quantizer** (``src/llama-quant.cpp``): ``tensor_allows_quantization`` (2-D and 3-D ``*weight``
   tensors that are no norm, router, ...), ``llama_tensor_get_type_impl`` (the mix of each file type:
   ``attn_v`` / ``ffn_down`` given more bits by layer index for the ``_M`` types, ``output.weight`` -- or a
   tied ``token_embd`` -- to Q6_K, the 8-expert and 70B rules ...), ``tensor_type_fallback`` (a row length
   not divisible by the type's block: Q4_K -> Q5_0, Q6_K -> Q8_0, IQ4_XS -> IQ4_NL, else F16) and
   ``tensor_requires_imatrix``. Tensors are visited in ``llama_model_loader::weights_map`` order (the
   non-layer tensors by name, then each layer's by name: ``weight_name_comparer``), the order the counters
   of ``attn_v`` / ``ffn_down`` advance in and the order the data is written in, each tensor padded to 32
   bytes (``GGUF_DEFAULT_ALIGNMENT``).

F16 / BF16 / F32 are the converter's own output types (``--outtype``); every other type is ``llama-quantize``
of that file. Offsets count from the start of the tensor data (the header's size -- mostly the vocabulary
strings -- is not known from a config and moves no buffer). docs/llamacpp.md lists what is modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import UserError
from .gguf_file import GgufModel, GgufTensor

ALIGNMENT = 32  # ggml/include/gguf.h GGUF_DEFAULT_ALIGNMENT: the quantizer pads each tensor's data to it
CONVERTER_TYPES = ("F32", "F16", "BF16")  # convert_hf_to_gguf.py --outtype f32 | f16 | bf16

# llama_ftype_get_default_type (src/llama-quant.cpp): the ggml type a file type starts each tensor from
DEFAULT_TYPE = {
    "F32": "F32", "F16": "F16", "BF16": "BF16", "Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q5_0": "Q5_0", "Q5_1": "Q5_1",
    "Q8_0": "Q8_0", "Q2_K": "Q2_K", "Q2_K_S": "Q2_K", "Q3_K_S": "Q3_K", "Q3_K_M": "Q3_K", "Q3_K_L": "Q3_K",
    "Q4_K_S": "Q4_K", "Q4_K_M": "Q4_K", "Q5_K_S": "Q5_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K", "IQ2_XXS": "IQ2_XXS",
    "IQ2_XS": "IQ2_XS", "IQ2_S": "IQ2_XS", "IQ2_M": "IQ2_S", "IQ3_XXS": "IQ3_XXS", "IQ3_XS": "IQ3_S",
    "IQ3_S": "IQ3_S", "IQ3_M": "IQ3_S", "IQ1_S": "IQ1_S", "IQ1_M": "IQ1_M", "IQ4_NL": "IQ4_NL", "IQ4_XS": "IQ4_XS",
}
FILE_TYPES = tuple(DEFAULT_TYPE)

# HF architectures -> the GGUF architecture their converter class writes (@ModelBase.register in
# conversion/llama.py: LlamaModel takes Llama, Mistral and Mixtral; qwen.py; gemma.py)
HF_ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "MixtralForCausalLM": "llama",
            "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3moe",
            "Qwen2MoeForCausalLM": "qwen2moe", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3",
            "Gemma3ForConditionalGeneration": "gemma3"}
MODEL_TYPES = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
               "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "gemma2": "gemma2", "gemma3": "gemma3",
               "gemma3_text": "gemma3"}


@dataclass(frozen=True)
class PricedFrom:
    """What a header derived from a config was derived from (carried by its :class:`GgufModel`)."""

    model: str  # the config's name (a catalog name, a folder, a Hub id)
    type_name: str  # the file type: Q4_K_M ...
    imatrix: bool  # quantized with an importance matrix (changes IQ4_XS/IQ4_NL, Q4_0/Q5_0, IQ3_XXS choices)
    file_bytes: int  # the tensor data as written, padding included (the header comes on top)
    fallbacks: tuple[str, ...] = ()  # tensors whose row did not divide the type's block, and what they became

    def to_dict(self) -> dict:
        return {"model": self.model, "type": self.type_name, "imatrix": self.imatrix, "file_bytes": self.file_bytes,
                "fallbacks": list(self.fallbacks),
                "rule": "convert_hf_to_gguf.py's tensors, typed by src/llama-quant.cpp llama_tensor_get_type"}


def type_names() -> str:
    return ", ".join(FILE_TYPES)


def file_type(text: str) -> str:
    """The file type ``text`` names (any case, with or without ``MOSTLY_``); one line naming the valid ones."""
    key = str(text).strip().upper().removeprefix("MOSTLY_").removeprefix("GGML_TYPE_")
    if key not in DEFAULT_TYPE:
        raise UserError(f"--type {text!r} is not a llama.cpp file type vramcal prices: one of {type_names()}")
    return key


def gguf_arch(config: dict) -> str:
    """The GGUF architecture convert_hf_to_gguf.py writes for ``config``; one line naming an unmodelled one."""
    archs = config.get("architectures") or []
    for a in archs if isinstance(archs, list) else []:
        if a in HF_ARCHS:
            return HF_ARCHS[a]
    mt = config.get("model_type")
    if not archs and mt in MODEL_TYPES:
        return MODEL_TYPES[mt]
    what = ", ".join(archs) if isinstance(archs, list) and archs else f"model_type {mt!r}"
    raise UserError(f"{what}: its conversion to GGUF is not modelled by vramcal (modelled: "
                    f"{', '.join(sorted(set(HF_ARCHS)))}); convert it and give the .gguf file instead")


# ------------------------------------------------------------------------------------------ the converter

@dataclass(frozen=True)
class _Spec:
    """One tensor the converter writes: its GGUF name, ggml shape, and whether it is kept F32."""

    name: str
    shape: tuple[int, ...]
    f32: bool


def _int(tc: dict, key: str, default=None) -> int:
    v = tc.get(key) if tc.get(key) is not None else default
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise UserError(f"the config's {key} is {v!r}: the GGUF layout needs a whole number")
    return v


def _rope_type(tc: dict) -> str:
    rp = tc.get("rope_parameters") or tc.get("rope_scaling") or {}
    rp = rp.get("full_attention", rp) if isinstance(rp, dict) else {}
    return str(rp.get("rope_type") or rp.get("type") or "").lower() if isinstance(rp, dict) else ""


def _layout(arch: str, tc: dict, n_vocab: int) -> tuple[list[_Spec], dict]:
    """The converter's tensors for ``arch`` and the metadata keys llama.cpp's loader reads back."""
    import gguf

    T = gguf.MODEL_TENSOR
    gt = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    allowed = set(gguf.MODEL_TENSORS[gt])
    gemma = arch in ("gemma2", "gemma3")
    E = _int(tc, "hidden_size")
    L = _int(tc, "num_hidden_layers")
    H = _int(tc, "num_attention_heads", 8 if arch == "gemma3" else None)
    KV = _int(tc, "num_key_value_heads", 4 if arch == "gemma3" else H)
    hd_given = tc.get("head_dim") if tc.get("head_dim") is not None else (256 if arch == "gemma3" else None)
    hd = _int({"head_dim": hd_given}, "head_dim") if hd_given is not None else E // H
    F = _int(tc, "intermediate_size")
    # TextModel.set_gguf_parameters: expert_count from num_local_experts (Mixtral) or num_experts (Qwen MoE)
    n_exp = int(tc.get("num_local_experts") or tc.get("num_experts") or 0)
    # tie_word_embeddings: the transformers config classes' defaults (LlamaConfig, MistralConfig, Qwen2/3Config:
    # False; Gemma2/3: True); gemma2's converter drops lm_head.weight whatever the config says
    tied = bool(tc.get("tie_word_embeddings", gemma)) or arch == "gemma2"
    specs: list[_Spec] = []

    def add(t, shape, bid=None, suffix="weight"):
        if t not in allowed:
            raise AssertionError(f"{arch} has no {t.name} in gguf.MODEL_TENSORS")
        name = gguf.TENSOR_NAMES[t].format(bid=bid) + "." + suffix
        shape = tuple(int(s) for s in shape)
        # TextModel.prepare_tensors: 1-D and *_norm.weight -> F32; the MoE routers; anything but .weight
        f32 = len(shape) <= 1 or name.endswith("_norm.weight") or suffix != "weight" or \
            t in (T.FFN_GATE_INP, T.FFN_GATE_INP_SHEXP)
        specs.append(_Spec(name, shape, f32))

    add(T.TOKEN_EMBD, (E, n_vocab))
    add(T.OUTPUT_NORM, (E,))
    if not tied:
        add(T.OUTPUT, (E, n_vocab))
    if arch == "llama" and _rope_type(tc) == "llama3":  # LlamaModel.generate_extra_tensors
        add(T.ROPE_FREQS, (hd // 2,))
    # q/k/v biases: Qwen2's attention always has them; the others' follow attention_bias (o_proj's too)
    qkv_bias = arch in ("qwen2", "qwen2moe") or bool(tc.get("attention_bias"))
    o_bias = arch not in ("qwen2", "qwen2moe") and bool(tc.get("attention_bias"))
    mlp_bias = arch == "llama" and bool(tc.get("mlp_bias"))
    sparse_step = int(tc.get("decoder_sparse_step", 1) or 1)
    dense_layers = set(tc.get("mlp_only_layers") or ())
    F_exp = int(tc.get("moe_intermediate_size") or F) if arch in ("qwen3moe", "qwen2moe") else F
    for i in range(L):
        add(T.ATTN_NORM, (E,), i)
        add(T.ATTN_Q, (E, H * hd), i)
        add(T.ATTN_K, (E, KV * hd), i)
        add(T.ATTN_V, (E, KV * hd), i)
        add(T.ATTN_OUT, (H * hd, E), i)
        if qkv_bias:
            add(T.ATTN_Q, (H * hd,), i, "bias")
            add(T.ATTN_K, (KV * hd,), i, "bias")
            add(T.ATTN_V, (KV * hd,), i, "bias")
        if o_bias:
            add(T.ATTN_OUT, (E,), i, "bias")
        if arch in ("qwen3", "qwen3moe", "gemma3"):
            add(T.ATTN_Q_NORM, (hd,), i)
            add(T.ATTN_K_NORM, (hd,), i)
        if gemma:
            add(T.ATTN_POST_NORM, (E,), i)
            add(T.FFN_POST_NORM, (E,), i)
        add(T.FFN_PRE_NORM if gemma else T.FFN_NORM, (E,), i)  # gemma's pre_feedforward_layernorm: ffn_norm too
        moe = n_exp > 0 and i not in dense_layers and (i + 1) % sparse_step == 0
        if moe:
            add(T.FFN_GATE_INP, (E, n_exp), i)
            add(T.FFN_GATE_EXP, (E, F_exp, n_exp), i)
            add(T.FFN_UP_EXP, (E, F_exp, n_exp), i)
            add(T.FFN_DOWN_EXP, (F_exp, E, n_exp), i)
            if arch == "qwen2moe" and tc.get("shared_expert_intermediate_size"):
                Fs = int(tc["shared_expert_intermediate_size"])
                add(T.FFN_GATE_INP_SHEXP, (E, 1), i)  # HF's [1, n_embd] gate
                add(T.FFN_GATE_SHEXP, (E, Fs), i)
                add(T.FFN_UP_SHEXP, (E, Fs), i)
                add(T.FFN_DOWN_SHEXP, (Fs, E), i)
        else:
            add(T.FFN_GATE, (E, F), i)
            add(T.FFN_UP, (E, F), i)
            add(T.FFN_DOWN, (F, E), i)
            if mlp_bias:
                add(T.FFN_GATE, (F,), i, "bias")
                add(T.FFN_UP, (F,), i, "bias")
                add(T.FFN_DOWN, (E,), i, "bias")

    K, A = gguf.Keys.LLM, gguf.Keys.Attention
    meta: dict = {K.BLOCK_COUNT: L, K.EMBEDDING_LENGTH: E, K.FEED_FORWARD_LENGTH: F, A.HEAD_COUNT: H}
    ctx = tc.get("max_position_embeddings", 131072 if arch == "gemma3" else None)
    if ctx is not None:
        meta[K.CONTEXT_LENGTH] = int(ctx)
    if "num_key_value_heads" in tc or gemma:
        meta[A.HEAD_COUNT_KV] = KV
    if hd_given is not None:
        meta[A.KEY_LENGTH] = meta[A.VALUE_LENGTH] = hd
    if n_exp:
        meta[K.EXPERT_COUNT] = n_exp
        if tc.get("num_experts_per_tok") is not None:
            meta[K.EXPERT_USED_COUNT] = int(tc["num_experts_per_tok"])
        if arch in ("qwen3moe", "qwen2moe") and tc.get("moe_intermediate_size") is not None:
            meta[K.EXPERT_FEED_FORWARD_LENGTH] = int(tc["moe_intermediate_size"])
    if arch == "llama":
        meta[K.VOCAB_SIZE] = n_vocab
    if arch == "gemma2":
        meta[K.ATTN_LOGIT_SOFTCAPPING] = tc.get("attn_logit_softcapping")
        meta[K.FINAL_LOGIT_SOFTCAPPING] = tc.get("final_logit_softcapping")
        meta[A.SLIDING_WINDOW] = tc.get("sliding_window")
    if arch == "gemma3":
        if tc.get("final_logit_softcapping"):
            meta[K.FINAL_LOGIT_SOFTCAPPING] = tc["final_logit_softcapping"]
        if tc.get("sliding_window_pattern") != 1:
            meta[A.SLIDING_WINDOW] = tc.get("sliding_window")
    return specs, {k.format(arch=arch): v for k, v in meta.items() if v is not None}


# ------------------------------------------------------------------------------------------ the quantizer

def _category(name: str) -> str:
    """tensor_get_category: the broad category each type rule keys on (first match wins, in this order)."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for needle, cat in (("attn_qkv.weight", "attn_qkv"), ("attn_kv_b.weight", "attn_kv_b"),
                        ("attn_v.weight", "attn_v"), ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"),
                        ("attn_output.weight", "attn_output"), ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"),
                        ("ffn_down", "ffn_down")):
        if needle in name:
            return cat
    return "other"


_NOT_QUANTIZED = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel",
                  "per_layer_model_proj", "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight",
                  "indexer.q_proj.weight", "attn_rel_b.weight", ".position_embd", ".patch_embd", ".patch_merger",
                  *(f"time_mix_{w}.weight" for w in ("first", "w0", "w1", "w2", "v0", "v1", "v2", "a0", "a1", "a2",
                                                     "g1", "g2", "decay_w1", "decay_w2", "lerp_fused")))


def _n_dims(shape: tuple[int, ...]) -> int:
    """ggml_n_dims: trailing dimensions of 1 do not count."""
    n = len(shape)
    while n > 1 and shape[n - 1] == 1:
        n -= 1
    return n


def allows_quantization(name: str, shape: tuple[int, ...]) -> bool:
    """tensor_allows_quantization (src/llama-quant.cpp) for the default parameters."""
    return _n_dims(shape) >= 2 and name.endswith("weight") and not any(s in name for s in _NOT_QUANTIZED) \
        and name not in ("position_embd.weight", "token_types.weight")


def _block(type_name: str) -> int:
    from .ggml_buffers import type_info

    return type_info(type_name)[0]


def _fallback(name: str, ncols: int, t: str, notes: list[str]) -> str:
    """tensor_type_fallback: a row that does not divide into the type's blocks."""
    if ncols % _block(t) == 0:
        return t
    to = {"IQ1_S": "IQ4_NL", "IQ1_M": "IQ4_NL", "IQ2_XXS": "IQ4_NL", "IQ2_XS": "IQ4_NL", "IQ2_S": "IQ4_NL",
          "IQ3_XXS": "IQ4_NL", "IQ3_S": "IQ4_NL", "IQ4_XS": "IQ4_NL", "Q2_K": "Q4_0", "Q3_K": "Q4_0",
          "TQ1_0": "Q4_0", "TQ2_0": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}.get(t, t)
    if ncols % _block(to):
        to = "F16"
    notes.append(f"{name}: {ncols} values a row do not divide into {t} blocks -> {to}")
    return to


@dataclass
class _State:
    """quantize_state_impl: what the type rules read (the model's hyper-parameters) and advance (counters)."""

    ftype: str
    n_layer: int
    n_expert: int
    n_gqa: int
    is_70b: bool
    imatrix: bool
    tied: bool
    n_attention_wv: int
    i_attention_wv: int = 0
    i_ffn_down: int = 0
    i_ffn_gate: int = 0
    i_ffn_up: int = 0


def _more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _layer(qs: _State, counter: int, name: str) -> int:
    """layer_info: the counter, or (with experts) the layer number in the name."""
    if qs.n_expert > 1:
        return int(name.split(".")[1])
    return counter


def _impl(qs: _State, t: str, name: str, ncols: int, cat: str) -> str:  # noqa: C901 - one branch per rule, as there
    """llama_tensor_get_type_impl, branch for branch (src/llama-quant.cpp)."""
    f = qs.ftype
    iq12 = ("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ2_S", "IQ2_M", "IQ1_M")
    if cat == "output" or (qs.tied and cat == "token_embd"):
        if ncols % _block(t):
            return "Q8_0"
        if f in ("IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ2_S", "IQ2_M", "IQ1_M"):
            return "Q5_K"
        return t if t == "Q8_0" else "Q6_K"
    if cat == "token_embd":
        if f in ("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ1_M"):
            return "Q2_K"
        if f in ("IQ2_S", "IQ2_M", "IQ3_XXS"):
            return "IQ3_S"
        return t
    attn_v = cat in ("attn_v", "attn_qkv", "attn_kv_b")
    if f in iq12:
        if attn_v:
            t = "Q4_K" if qs.n_gqa >= 4 or qs.n_expert >= 4 else ("IQ3_S" if f in ("IQ2_S", "IQ2_M") else "Q2_K")
            qs.i_attention_wv += 1
        elif qs.n_expert == 8 and cat == "attn_k":
            t = "Q4_K"
        elif cat == "ffn_down":
            if qs.i_ffn_down < qs.n_layer // 8:
                t = "IQ3_S" if f in ("IQ2_S", "IQ2_M") else "Q2_K"
            qs.i_ffn_down += 1
        elif cat == "attn_output":
            if qs.n_expert == 8:
                t = "Q5_K"
            elif f in ("IQ1_S", "IQ1_M"):
                t = "IQ2_XXS"
            elif f in ("IQ2_S", "IQ2_M"):
                t = "IQ3_S"
        return t
    if attn_v:
        if f == "Q2_K":
            t = "Q4_K" if qs.n_gqa >= 4 else "Q3_K"
        elif f == "Q2_K_S" and qs.n_gqa >= 4:
            t = "Q4_K"
        elif f == "IQ3_XXS":
            t = "Q4_K" if qs.n_gqa >= 4 else ("IQ3_S" if not qs.imatrix else "IQ3_XXS")
        elif f in ("IQ3_XS", "IQ3_S") and qs.n_gqa >= 4:
            t = "Q4_K"
        elif f == "IQ3_M":
            t = "Q4_K"
        elif f == "Q3_K_M":
            t = "Q5_K" if qs.i_attention_wv < 2 else "Q4_K"
        elif f == "Q3_K_L":
            t = "Q5_K"
        elif f in ("IQ4_NL", "IQ4_XS") and qs.n_gqa >= 4:
            t = "Q5_K"
        elif f in ("Q4_K_M", "Q5_K_M") and _more_bits(qs.i_attention_wv, qs.n_attention_wv):
            t = "Q6_K"
        elif f == "Q4_K_S" and qs.i_attention_wv < 4:
            t = "Q5_K"
        if qs.is_70b and t in ("Q3_K", "Q4_K"):
            t = "Q5_K"
        if qs.n_expert == 8:
            t = "Q8_0"
        qs.i_attention_wv += 1
        return t
    if cat == "attn_k":
        if qs.n_expert == 8:
            return "Q8_0"
        return {"IQ3_XS": "IQ3_XXS", "IQ3_XXS": "IQ2_S"}.get(f, t)
    if cat == "attn_q":
        return {"IQ3_XS": "IQ3_XXS", "IQ3_XXS": "IQ2_S"}.get(f, t)
    if cat == "ffn_down":
        i, n = _layer(qs, qs.i_ffn_down, name), qs.n_layer
        if f == "Q2_K":
            t = "Q3_K"
        elif f == "Q2_K_S":
            if i < n // 8:
                t = "Q4_K"
        elif f == "IQ3_XXS" and not qs.imatrix:
            t = "Q4_K" if i < n // 8 else "Q3_K"
        elif f == "Q3_K_M":
            t = "Q5_K" if i < n // 16 else "Q4_K"  # the Q3_K branch is falcon's (arch != FALCON is always true here)
        elif f == "IQ3_M" and (i < n // 8 or (qs.n_expert == 8 and _more_bits(i, n))):
            t = "Q4_K"
        elif f == "Q3_K_L":
            t = "Q5_K"
        elif f == "Q4_K_M":
            if _more_bits(i, n):
                t = "Q6_K"
        elif i < n // 8 and f in ("IQ4_NL", "IQ4_XS") and not qs.imatrix:
            t = "Q5_K"
        elif f == "Q5_K_M" and _more_bits(i, n):
            t = "Q6_K"
        elif f == "Q4_K_S" and i < n // 8:
            t = "Q5_K"
        elif f in ("Q4_0", "Q5_0") and qs.imatrix and i < n // 8:
            t = "Q4_1" if f == "Q4_0" else "Q5_1"
        qs.i_ffn_down += 1
        return t
    if cat == "attn_output":
        if qs.n_expert == 8:
            if f in ("Q2_K", "IQ3_XS", "IQ3_XXS", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S", "Q4_K_M", "IQ3_S",
                     "IQ3_M", "IQ4_XS"):
                t = "Q5_K"
        else:
            t = {"Q2_K": "Q3_K", "IQ3_XXS": "IQ3_S", "Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K", "IQ3_M": "Q4_K"}.get(f, t)
        return t
    if cat in ("ffn_gate", "ffn_up"):
        counter = qs.i_ffn_gate if cat == "ffn_gate" else qs.i_ffn_up
        i, n = _layer(qs, counter, name), qs.n_layer
        if f == "IQ3_XS" and n // 8 <= i < 7 * n // 8:
            t = "IQ3_XXS"
        if cat == "ffn_gate":
            qs.i_ffn_gate += 1
        else:
            qs.i_ffn_up += 1
    return t


def _requires_imatrix(name: str, t: str, ftype: str) -> bool:
    """tensor_requires_imatrix."""
    if name in ("token_embd.weight", "per_layer_token_embd.weight", "output.weight"):
        return False
    if t in ("IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_M", "IQ1_S"):
        return True
    return t == "Q2_K" and ftype == "Q2_K_S"


def _is_quantized(t: str) -> bool:
    return _block(t) > 1


def tensor_types(specs: list[_Spec], arch: str, meta: dict, ftype: str, imatrix: bool) \
        -> tuple[dict[str, str], list[str]]:
    """Each tensor's ggml type in a ``ftype`` file (the quantizer's preliminary loop), and the fallbacks."""
    notes: list[str] = []
    if ftype in CONVERTER_TYPES:
        return {s.name: ("F32" if s.f32 else ftype) for s in specs}, notes
    n_layer = int(meta[f"{arch}.block_count"])
    n_head = int(meta[f"{arch}.attention.head_count"])
    n_head_kv = int(meta.get(f"{arch}.attention.head_count_kv", n_head))
    n_expert = int(meta.get(f"{arch}.expert_count", 0) or 0)
    names = {s.name for s in specs}
    # src/models/llama.cpp, qwen2.cpp load_arch_hparams: 80 layers is LLM_TYPE_70B (llama: unless MHA or 8 experts)
    is_70b = n_layer == 80 and ((arch == "llama" and n_head != n_head_kv and n_expert != 8) or arch == "qwen2")
    qs = _State(ftype=ftype, n_layer=n_layer, n_expert=n_expert, n_gqa=n_head // n_head_kv if n_head_kv else 0,
                is_70b=is_70b, imatrix=imatrix, tied="output.weight" not in names,
                n_attention_wv=sum(_category(n) in ("attn_v", "attn_qkv", "attn_kv_b") for n in names))
    default = DEFAULT_TYPE[ftype]
    out: dict[str, str] = {}
    needs_imatrix = []
    for s in _quantizer_order(specs):
        source = "F32" if s.f32 else "F16"
        if not allows_quantization(s.name, s.shape):
            out[s.name] = source
            continue
        t = default
        if _is_quantized(default):
            t = _impl(qs, t, s.name, s.shape[0], _category(s.name))
            t = _fallback(s.name, s.shape[0], t, notes)
        out[s.name] = t
        if _requires_imatrix(s.name, t, ftype):
            needs_imatrix.append(s.name)
    if needs_imatrix and not imatrix:
        raise UserError(f"llama-quantize refuses {ftype} without an importance matrix ({needs_imatrix[0]} would be "
                        f"{out[needs_imatrix[0]]}): add --imatrix to price it as made with one")
    return out, notes


def _quantizer_order(specs):
    """llama_model_loader::weights_map's order (weight_name_comparer): layer -1 first, then by layer; by name."""
    def key(s):
        parts = s.name.split(".")
        layer = int(parts[1]) if parts[0] == "blk" and len(parts) > 1 and parts[1].isdigit() else -1
        return layer, s.name

    return sorted(specs, key=key)


# ------------------------------------------------------------------------------------------------ the API

def header_for(config: dict, type_name: str, *, name: str | None = None, imatrix: bool = False,
               revision: str | None = None) -> GgufModel:
    """The header of the GGUF that ``convert_hf_to_gguf.py`` and then ``llama-quantize ... TYPE`` would write
    for a Hugging Face ``config`` (a config.json's dict; a multimodal one's ``text_config`` is the model),
    as :func:`.gguf_file.read_gguf` would read it: every tensor's name, ggml type, shape, bytes and offset
    (from the start of the tensor data), and the metadata llama.cpp's loader reads. ``type_name``: a llama.cpp
    file type (``Q4_K_M``, ``Q8_0``, ``IQ4_XS``, ``F16`` ...: :data:`FILE_TYPES`). ``imatrix``: quantized
    with an importance matrix. Bad input (an unknown type, an architecture whose conversion is not
    modelled, a type llama-quantize refuses without an imatrix) is one line (:class:`UserError`)."""
    from .ggml_buffers import row_size

    ftype = file_type(type_name)
    if not isinstance(config, dict):
        raise UserError("header_for needs a config.json's contents (a dict)")
    arch = gguf_arch(config)
    tc = {**config, **config["text_config"]} if isinstance(config.get("text_config"), dict) else config
    n_vocab = _int(tc, "vocab_size", 262208 if arch == "gemma3" else None)
    specs, meta = _layout(arch, tc, n_vocab)
    types, notes = tensor_types(specs, arch, meta, ftype, imatrix)
    import gguf

    tensors: list[GgufTensor] = []
    offset = 0
    for s in _quantizer_order(specs):
        t = types[s.name]
        rows = 1
        for d in s.shape[1:]:
            rows *= d
        nbytes = rows * row_size(t, s.shape[0])
        # llama-quantize writes each tensor with ggml_n_dims dimensions (a trailing 1 dropped); the converter
        # keeps the PyTorch shape
        shape = s.shape if ftype in CONVERTER_TYPES else s.shape[:_n_dims(s.shape)]
        tensors.append(GgufTensor(s.name, t, int(gguf.GGMLQuantizationType[t]), shape, nbytes, 0, offset))
        offset += (nbytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
    label = name or str(config.get("_name_or_path") or arch)
    ft = gguf.LlamaFileType["ALL_F32" if ftype == "F32" else f"MOSTLY_{ftype}"]
    metadata = {"general.architecture": arch, "general.name": label, "general.file_type": int(ft),
                "general.alignment": ALIGNMENT, **meta, "tokenizer.ggml.tokens": ("array", n_vocab)}
    origin = PricedFrom(model=label, type_name=ftype, imatrix=imatrix, file_bytes=offset, fallbacks=tuple(notes))
    stem = label.rstrip("/").rsplit("/", 1)[-1]
    return GgufModel(path=f"{stem}-{ftype}.gguf", files=(), file_bytes=(offset,), arch=arch, metadata=metadata,
                     tensors=tuple(tensors), revision=revision, priced_from=origin)
