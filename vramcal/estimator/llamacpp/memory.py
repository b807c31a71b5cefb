"""Which memory llama.cpp gives an architecture, and which layers each part holds (llama.cpp's source, the
tree llama-cpp-python 0.3.36 vendors; docs/llamacpp.md has each rule with its file):

- **kind** (src/llama-model.cpp ``create_memory``, src/llama-arch.cpp ``llm_arch_is_recurrent`` /
  ``llm_arch_is_hybrid``): ``"kv"`` an attention cache (``llama_kv_cache``, or the SWA pair); ``"recurrent"``
  a recurrent-state cache only (``llama_memory_recurrent``: mamba, mamba2, the rwkv family);
  ``"hybrid"`` both (``llama_memory_hybrid``), the attention cache over the layers ``filter_attn`` keeps and
  the recurrent one over those ``filter_recr`` keeps.
- **recurrent layers** (src/models/<arch>.cpp ``load_arch_hparams``, ``is_recr_impl``): a layer without KV
  heads (jamba, granitehybrid, lfm2); without KV heads and without a feed-forward (nemotron_h: a layer with
  neither is a Mamba2 mixer, one with a feed-forward an MLP); every layer (falcon-h1, whose layers run
  attention and a Mamba2 mixer side by side); the GGUF's ``attention.recurrent_layers``, else all but
  every ``full_attention_interval``-th (default 4; qwen3next, qwen35, qwen35moe).
- **state widths** (src/llama-hparams.cpp ``n_embd_r`` / ``n_embd_s``): per recurrent layer an R row of
  ``token_shift_count x n_embd`` (rwkv), ``(l_cache - 1) x n_embd`` (lfm2's short convolution), else
  ``(d_conv - 1) x (d_inner + 2 n_group d_state)`` (the convolution's state: mamba, mamba2 and the
  hybrids); an S row of ``n_embd x wkv_head_size`` (rwkv), else ``d_state x d_inner`` (the SSM state).
- **MLA** (src/llama-hparams.cpp ``is_mla``, src/llama-kv-cache.cpp): a GGUF with ``key_length_mla`` and
  ``value_length_mla`` (deepseek2 as the converter writes it today: one KV head of ``kv_lora_rank +
  rope`` values) caches K only -- V is a view of it; an older GGUF without them caches K and V per head.
- **MTP layers** (``nextn_predict_layers``): the main context's caches leave them out.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import UserError
from .gguf_file import GgufModel

RECURRENT_ARCHS = ("mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7")
# hybrid architectures modelled, by how each marks its recurrent layers (see the module docstring)
HYBRID_ARCHS = {"jamba": "no_kv_heads", "granitehybrid": "no_kv_heads", "lfm2": "no_kv_heads",
                "lfm2moe": "no_kv_heads", "falcon-h1": "every_layer", "nemotron_h": "nemotron",
                "nemotron_h_moe": "nemotron", "qwen3next": "interval", "qwen35": "interval", "qwen35moe": "interval"}
_OWN_CACHE = ("llama.cpp gives it a cache of its own (a sparse-attention indexer cache: src/llama-kv-cache-dsa*.cpp, "
              "-msa, -dsv4, llama-memory-hybrid-idx.cpp)")
_OTHER_STATE = "its recurrent state's widths come from keys vramcal does not read (KDA heads, linear attention)"
NOT_MODELLED = {**dict.fromkeys(("deepseek32", "glm-dsa", "glm5-next", "deepseek4", "minimax-m3", "hy-v4", "dots3note",
                                 "qwen4exp"), _OWN_CACHE),
                **dict.fromkeys(("kimi-linear", "kimi-k3", "minimax-01", "bailingmoe3"), _OTHER_STATE),
                "plamo2": "a hybrid (Mamba2 and attention) not yet loaded in a test against llama.cpp"}


@dataclass(frozen=True)
class Memory:
    kind: str  # kv | recurrent | hybrid
    attn_layers: tuple[bool, ...]  # per layer: it has K/V tensors in the attention cache
    recr_layers: tuple[bool, ...]  # per layer: it has R/S tensors in the recurrent cache
    n_embd_r: int = 0  # values per R row (a layer's convolution / token-shift state)
    n_embd_s: int = 0  # values per S row (a layer's SSM / WKV state)
    mla: bool = False  # K only: V is a view of K
    n_layer_nextn: int = 0


def _int(m: GgufModel, key: str, default: int = 0) -> int:
    v = m.get(key, default)
    return int(v) if isinstance(v, (int, float)) else default


def memory_of(m: GgufModel, n_layer: int, n_head_kv: tuple[int, ...], n_ff: tuple[int, ...]) -> Memory:
    """The memory llama.cpp creates for this GGUF's architecture (``create_memory``)."""
    arch = m.arch
    if arch in NOT_MODELLED:
        raise UserError(f"{arch}: not modelled yet by vramcal's llama.cpp engine -- {NOT_MODELLED[arch]}; modelled: "
                        f"attention caches, MLA (deepseek2), {', '.join(RECURRENT_ARCHS)}, {', '.join(HYBRID_ARCHS)}")
    nextn = _int(m, ".nextn_predict_layers")
    n_main = n_layer - nextn
    main = tuple(il < n_main for il in range(n_layer))
    mla = bool(_int(m, ".attention.key_length_mla") and _int(m, ".attention.value_length_mla"))
    if arch not in RECURRENT_ARCHS and arch not in HYBRID_ARCHS:
        attn = main if nextn and n_main > 0 else (True,) * n_layer
        return Memory("kv", attn, (False,) * n_layer, mla=mla, n_layer_nextn=nextn)
    rule = "every_layer" if arch in RECURRENT_ARCHS else HYBRID_ARCHS[arch]
    if rule == "no_kv_heads":
        recr = tuple(main[il] and n_head_kv[il] == 0 for il in range(n_layer))
    elif rule == "nemotron":
        recr = tuple(main[il] and n_head_kv[il] == 0 and n_ff[il] == 0 for il in range(n_layer))
    elif rule == "interval":
        given = m.get(".attention.recurrent_layers")
        if isinstance(given, list):
            if len(given) != n_layer:
                raise UserError(f"the GGUF's attention.recurrent_layers has {len(given)} entries for {n_layer} layers")
            recr = tuple(bool(x) for x in given)
        else:
            every = _int(m, ".full_attention_interval", 4) or 4
            recr = tuple(main[il] and (il + 1) % every != 0 for il in range(n_layer))
    else:
        recr = main
    if arch in RECURRENT_ARCHS:
        attn = (False,) * n_layer
    elif arch == "falcon-h1":  # filter_attn and filter_recr both keep every layer
        attn = (True,) * n_layer
    elif rule == "nemotron":
        attn = tuple(not recr[il] and n_ff[il] == 0 for il in range(n_layer))
    elif rule == "interval":
        attn = tuple(main[il] and not recr[il] for il in range(n_layer))
    else:
        attn = tuple(not r for r in recr)
    if arch in ("lfm2", "lfm2moe") and _int(m, ".attention.sliding_window"):
        raise UserError(f"{arch} with a sliding window: llama.cpp's hybrid SWA cache (llama-memory-hybrid-iswa.cpp) "
                        "is not modelled yet by vramcal's llama.cpp engine")
    n_embd = _int(m, ".embedding_length")
    wkv = _int(m, ".wkv.head_size")
    l_cache = _int(m, ".shortconv.l_cache")
    d_conv, d_inner = _int(m, ".ssm.conv_kernel"), _int(m, ".ssm.inner_size")
    d_state, n_group = _int(m, ".ssm.state_size"), _int(m, ".ssm.group_count")
    if wkv:
        r, s = _int(m, ".token_shift_count", 2) * n_embd, n_embd * wkv
    else:
        r = n_embd * (l_cache - 1) if l_cache else max(d_conv - 1, 0) * (d_inner + 2 * n_group * d_state)
        s = d_state * d_inner
    return Memory("recurrent" if arch in RECURRENT_ARCHS else "hybrid", attn, recr, n_embd_r=r, n_embd_s=s,
                  mla=mla, n_layer_nextn=nextn)
