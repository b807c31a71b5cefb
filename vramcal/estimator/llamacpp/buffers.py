"""What llama.cpp allocates loading a GGUF, per buffer and device, for its flags (llama.cpp's source, the
tree llama-cpp-python 0.3.36 vendors; docs/llamacpp.md has each rule with its file):

- **n_ctx** (llama-context.cpp): ``-c`` (0: the model's ``context_length``) padded up to 256; without
  ``--kv-unified`` each of the ``-np`` sequences gets ``pad(n_ctx / np, 256)`` cells and n_ctx becomes
  that times np. ``n_batch = min(n_ctx, -b)``, ``n_ubatch = min(n_batch, -ub)``.
- **model buffers** (llama-model.cpp ``load_tensors``, llama-model-loader.cpp ``create_tensor``): the
  input layer (``token_embd``) always on the CPU; with ``-ngl N`` the last N of the ``n_layer + 1``
  layers (the output layer counts as one) on the GPUs, split at ``-ts``'s cumulative shares
  (``upper_bound``); ``-ot`` / ``--cpu-moe`` / ``--n-cpu-moe`` move matching tensors. A CPU buffer
  with mmap is the file's range that holds its tensors (``CPU_Mapped``: first offset to last end,
  gaps included); without mmap it is allocated (``CPU``, or ``CUDA_Host`` with a GPU), each tensor
  aligned to 32 bytes; a GPU buffer aligns to 128 and pads quantized rows to 512 values (ggml-cuda
  ``get_alloc_size``). A tied output (no ``output.weight``) is ``token_embd`` again in the output layer.
- **KV buffers** (llama-kv-cache.cpp, llama-kv-cache-iswa.cpp): per attention layer a K tensor of
  ``row(type_k, n_embd_k_gqa) x kv_size x n_stream`` and V alike, on the layer's device (``-nkvo``:
  the CPU); ``n_stream`` is np without ``--kv-unified``. Sliding-window layers get
  ``pad(min(kv_size, n_swa x (unified ? np : 1) + n_ubatch), 256)`` cells unless ``--swa-full``. Only the
  layers the architecture's memory gives an attention cache (:mod:`.memory`); MLA caches K alone.
- **RS buffers** (llama-memory-recurrent.cpp): per recurrent layer f32 R and S tensors of ``n_embd_r`` /
  ``n_embd_s`` values x ``max(1, np)`` cells, on the layer's device (``-nkvo``: the CPU).
- **output buffer** (llama-context.cpp ``output_reserve``): ``n_vocab x np`` floats of logits, in the
  output device's host buffer (``CUDA_Host``) or the CPU.
- **compute buffers**: :mod:`.compute` (the graph reservation).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from functools import lru_cache

from ...errors import UserError
from ...units import MIB
from .ggml_buffers import CPU_ALIGN, CUDA_ALIGN, cuda_alloc, pad, row_size
from .gguf_file import GgufModel, GgufTensor
from .memory import Memory, memory_of
from .mmproj import MmprojArgs, MmprojEstimate

MODEL_ID = "llamacpp-buffers/1"  # the arithmetic's id: runs record it, corrections are fitted per id
INPUT_TENSORS = ("token_embd.", "position_embd.", "token_types.", "per_layer_token_embd.")
EXPS = re.compile(r"\.ffn_(up|down|gate|gate_up)_(ch|)exps")  # common.h LLM_FFN_EXPS_REGEX

# ggml cache types llama.cpp accepts for -ctk / -ctv (common/arg.cpp kv_cache_types)
CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")

# architectures whose loader sets a sliding-window pattern (src/models/<arch>.cpp load_swa_pattern):
# (n_pattern, dense_first, default n_swa when the GGUF has none)
SWA_ARCHS = {"gemma2": (2, False, 4096), "gemma3": (6, False, 0), "gemma3n": (5, False, 0),
             "cohere2": (4, False, 0), "llama4": (4, False, 0), "olmo2": (4, False, 0),
             "gpt-oss": (2, False, 0), "exaone4": (4, False, 0), "smallthinker": (4, True, 0),
             "afmoe": (4, False, 0), "plamo3": (8, False, 0)}


def device_of(buffer: str) -> str:
    """The device a buffer llama.cpp logs lives on: a GPU's own (``CUDA0``, ``Vulkan1`` ...) or the host
    (``CPU``, ``CPU_Mapped``, ``CPU_REPACK``, ``CUDA_Host`` ...)."""
    return buffer if re.fullmatch(r"[A-Za-z]+\d+", buffer) and not buffer.startswith("CPU") else "CPU"


@dataclass(frozen=True)
class DraftArgs:
    """``-md FILE`` and the flags that are the draft model's own. llama-server loads the draft with a copy of
    the target's parameters -- its context (``-c``, ``-np``, ``-kvu``, ``-b``, ``-ub``, ``-fa``,
    ``--swa-full``), its split (``-ts``, ``-sm``, ``-mg``), mmap and ``-nkvo`` -- and replaces only the model,
    ``-ngl`` (``-ngld``), the tensor overrides (``-otd``, ``-cmoed``, ``-ncmoed``) and the KV types
    (``-ctkd/-ctvd``, default f16) (common/speculative.cpp ``common_base_params_to_speculative``, llama.cpp as
    llama-cpp-python 0.3.36 vendors it)."""

    path: str
    n_gpu_layers: int = -1  # -ngld; -1 auto, -2 all: every layer, as for the target
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    overrides: tuple[tuple[str, str], ...] = ()
    n_cpu_moe: int = 0
    cpu_moe: bool = False


@dataclass(frozen=True)
class LlamaArgs:
    """The flags of a llama-server / llama-cli command (llama.cpp's spellings; ``None``: its default)."""

    ctx_size: int = 0  # -c; 0: the model's context_length
    n_gpu_layers: int = -1  # -ngl; -1 auto, -2 all (treated as every layer: the --fit search is not modelled)
    tensor_split: tuple[float, ...] | None = None  # -ts
    split_mode: str = "layer"  # -sm none | layer | row
    main_gpu: int = 0  # -mg
    overrides: tuple[tuple[str, str], ...] = ()  # -ot pattern=buffer, in order (first match wins)
    n_cpu_moe: int = 0  # --n-cpu-moe
    cpu_moe: bool = False  # --cpu-moe
    use_mmap: bool = True  # --no-mmap clears it
    n_parallel: int = 1  # -np
    kv_unified: bool = False  # -kvu
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    flash_attn: str = "auto"  # on | off | auto
    n_batch: int = 2048  # -b
    n_ubatch: int = 512  # -ub
    swa_full: bool = False
    offload_kqv: bool = True  # -nkvo clears it
    embeddings: bool = False  # --embedding: the context keeps each output's embedding beside its logits
    n_gpus: int = 1  # GPUs llama.cpp sees (0: a CPU-only build)
    gpu_backend: str = "CUDA"
    # ggml types a CPU-only build repacks into CPU_REPACK (ggml-cpu/repack.cpp for x86 AVX2: Q4_0, Q4_K,
    # IQ4_NL, MXFP4 with rows a multiple of 8; AVX-512 adds Q2_K); with a GPU, CPU weights go CUDA_Host -> CPU
    cpu_repack: tuple[str, ...] = ("Q4_0", "Q4_K", "IQ4_NL", "MXFP4")
    draft: DraftArgs | None = None  # -md: a draft model for speculative decoding, loaded beside the target
    mmproj: MmprojArgs | None = None  # --mmproj: a multimodal projector, loaded by libmtmd beside the model

    def validated(self) -> LlamaArgs:
        for flag, v in (("-c/--ctx-size", self.ctx_size),):
            if v < 0:
                raise UserError(f"{flag} must be 0 (the model's) or more, got {v}")
        for flag, v in (("-np/--parallel", self.n_parallel), ("-b/--batch-size", self.n_batch),
                        ("-ub/--ubatch-size", self.n_ubatch)):
            if v < 1:
                raise UserError(f"{flag} must be 1 or more, got {v}")
        if self.n_cpu_moe < 0:
            raise UserError(f"--n-cpu-moe must be 0 or more, got {self.n_cpu_moe}")
        for flag, t in (("-ctk/--cache-type-k", self.cache_type_k), ("-ctv/--cache-type-v", self.cache_type_v)):
            if t.lower() not in CACHE_TYPES:
                raise UserError(f"{flag} {t!r} is not a cache type llama.cpp accepts: {', '.join(CACHE_TYPES)}")
        if self.flash_attn not in ("on", "off", "auto"):
            raise UserError(f"-fa/--flash-attn {self.flash_attn!r}: on, off or auto")
        if self.split_mode not in ("none", "layer", "row", "tensor"):
            raise UserError(f"-sm/--split-mode {self.split_mode!r}: none, layer, row or tensor")
        if self.split_mode == "row" and self.n_gpus and self.gpu_backend == "CUDA":
            raise UserError("-sm row: the llama.cpp modelled here stops loading with it ('device CUDA0 does not "
                            "support split buffers'): CUDA's split buffers were removed in b9890 "
                            "(ggml-org/llama.cpp#24216); use -sm layer (the default)")
        if self.split_mode == "tensor" and self.n_gpus:
            raise UserError("-sm tensor (llama.cpp's tensor parallelism, experimental) is not modelled yet by vramcal: "
                            "its weights and KV are split by the meta backend; price -sm layer instead")
        if self.tensor_split is not None and (any(x < 0 for x in self.tensor_split) or not any(self.tensor_split)):
            raise UserError("-ts/--tensor-split needs shares of 0 or more, not all 0, e.g. 3,1")
        if self.n_gpus < 0:
            raise UserError("--gpu-count must be 0 (a CPU-only llama.cpp) or more")
        if self.split_mode == "none" and self.n_gpus and not 0 <= self.main_gpu < self.n_gpus:
            raise UserError(f"-mg/--main-gpu {self.main_gpu}: there are {self.n_gpus} GPUs (0 to {self.n_gpus - 1})")
        d = self.draft
        if d is not None:
            for flag, t in (("-ctkd/--cache-type-k-draft", d.cache_type_k), ("-ctvd/--cache-type-v-draft",
                                                                             d.cache_type_v)):
                if t.lower() not in CACHE_TYPES:
                    raise UserError(f"{flag} {t!r} is not a cache type llama.cpp accepts: {', '.join(CACHE_TYPES)}")
            if d.n_cpu_moe < 0:
                raise UserError(f"--n-cpu-moe-draft must be 0 or more, got {d.n_cpu_moe}")
        return self

    def for_draft(self) -> LlamaArgs:
        """The draft model's flags: the target's, with the draft's own in place (:class:`DraftArgs`)."""
        d = self.draft
        return replace(self, draft=None, mmproj=None, n_gpu_layers=d.n_gpu_layers,
                       cache_type_k=d.cache_type_k.lower(), cache_type_v=d.cache_type_v.lower(),
                       overrides=d.overrides, n_cpu_moe=d.n_cpu_moe, cpu_moe=d.cpu_moe)


@dataclass(frozen=True)
class Hparams:
    arch: str
    n_layer: int
    n_ctx_train: int
    n_embd: int
    n_head: tuple[int, ...]
    n_head_kv: tuple[int, ...]
    n_embd_head_k: int
    n_embd_head_v: int
    n_vocab: int
    n_expert: int
    n_expert_used: int
    n_ff: tuple[int, ...]
    n_swa: int
    is_swa: tuple[bool, ...]
    n_ff_exp: int = 0  # expert_feed_forward_length: the experts' width where it differs from the dense one
    n_embd_out: int = 0  # embedding_length_out where the GGUF gives one (llama-hparams.cpp n_embd_out), else n_embd
    memory: Memory | None = None  # the caches llama.cpp creates (:mod:`.memory`): which layers hold KV, RS

    def n_embd_k_gqa(self, il: int) -> int:
        return self.n_embd_head_k * self.n_head_kv[il]

    def n_embd_v_gqa(self, il: int) -> int:
        return self.n_embd_head_v * self.n_head_kv[il]


def _per_layer(value, n: int, what: str) -> tuple[int, ...]:
    if isinstance(value, list):
        if len(value) != n:
            raise UserError(f"the GGUF's {what} has {len(value)} entries for {n} layers")
        return tuple(int(v) for v in value)
    return (int(value),) * n


def hparams_of(m: GgufModel) -> Hparams:
    """llama.cpp's hyper-parameters from the header (llama-model.cpp ``load_hparams``)."""
    n_layer = m.get(".block_count")
    n_embd = m.get(".embedding_length")
    if not isinstance(n_layer, int) or not isinstance(n_embd, int):
        raise UserError(f"{m.path}: {m.arch}.block_count / embedding_length are missing: not a model llama.cpp loads")
    head = m.get(".attention.head_count", 0)
    n_head = _per_layer(head, n_layer, "head_count")
    n_head_kv = _per_layer(m.get(".attention.head_count_kv", head), n_layer, "head_count_kv")
    h0 = max(n_head) if n_head else 0
    k_len = m.get(".attention.key_length", n_embd // h0 if h0 else 0)
    v_len = m.get(".attention.value_length", k_len)
    tokens = m.metadata.get("tokenizer.ggml.tokens")
    n_vocab = tokens[1] if isinstance(tokens, tuple) else len(tokens) if isinstance(tokens, list) else None
    if n_vocab is None:
        emb = next((t for t in m.tensors if t.name == "token_embd.weight"), None)
        n_vocab = emb.shape[1] if emb is not None else m.get(".vocab_size", 0)
    ff = m.get(".feed_forward_length", 0)
    n_swa = int(m.get(".attention.sliding_window", 0) or 0)
    is_swa = (False,) * n_layer
    if m.arch in SWA_ARCHS:
        n_pattern, dense_first, default = SWA_ARCHS[m.arch]
        n_swa = n_swa or default
        given = m.get(".attention.sliding_window_pattern")
        if isinstance(given, list):
            is_swa = tuple(bool(x) for x in given)
        elif n_swa > 0:
            n_pattern = int(given) if isinstance(given, int) else n_pattern
            is_swa = tuple((n_pattern == 0 or il % n_pattern != 0) if dense_first else
                           (n_pattern == 0 or il % n_pattern < n_pattern - 1) for il in range(n_layer))
    n_ff = _per_layer(ff if ff is not None else 0, n_layer, "feed_forward_length")
    return Hparams(arch=m.arch, n_layer=n_layer, n_ctx_train=int(m.get(".context_length", 0) or 0), n_embd=n_embd,
                   n_head=n_head, n_head_kv=n_head_kv, n_embd_head_k=int(k_len), n_embd_head_v=int(v_len),
                   n_vocab=int(n_vocab), n_expert=int(m.get(".expert_count", 0) or 0),
                   n_expert_used=int(m.get(".expert_used_count", 0) or 0),
                   n_ff=n_ff, n_swa=n_swa, is_swa=is_swa if any(is_swa) else (False,) * n_layer,
                   n_ff_exp=int(m.get(".expert_feed_forward_length", 0) or 0),
                   n_embd_out=int(m.get(".embedding_length_out", 0) or 0),
                   memory=memory_of(m, n_layer, n_head_kv, n_ff))


def quantized(cache_type: str) -> bool:
    """``ggml_is_quantized`` for a cache type (-ctk / -ctv)."""
    return cache_type.lower() not in ("f32", "f16", "bf16")


def attn_rotation(h: Hparams, a: LlamaArgs) -> tuple[int, int]:
    """The Hadamard rotations llama.cpp applies around a quantized cache (llama-kv-cache.cpp ``attn_rot_k``,
    ``attn_rot_v``; llama-graph.cpp ``build_attn``, ``llama_mul_mat_hadamard``): with a quantized K cache and a
    head size that is a multiple of 64, Q and K are multiplied by an ``n x n`` f32 matrix (a graph input) before
    the cache -- ``n`` the largest power of two from 64 up that divides the head size --, and with a quantized V
    cache V before it and the attention's output after it by a 64 x 64 one. (K, V) sizes, 0 where none;
    ``LLAMA_ATTN_ROT_DISABLE=1`` in llama.cpp's environment turns both off, which is not modelled."""
    k = 0
    if quantized(a.cache_type_k) and h.n_embd_head_k > 0 and h.n_embd_head_k % 64 == 0:
        k = 64
        while h.n_embd_head_k % (2 * k) == 0:
            k *= 2
    v = 64 if quantized(a.cache_type_v) and h.n_embd_head_v > 0 and h.n_embd_head_v % 64 == 0 else 0
    return k, v


@dataclass(frozen=True)
class Context:
    n_ctx: int
    n_ctx_seq: int
    n_seq_max: int
    n_stream: int
    n_batch: int
    n_ubatch: int
    flash_attn: bool
    notes: tuple[str, ...] = ()


def context_of(h: Hparams, a: LlamaArgs) -> Context:
    """n_ctx and the batches as llama-context.cpp sets them."""
    notes = []
    n_seq = max(1, a.n_parallel)
    n_ctx = a.ctx_size or h.n_ctx_train
    if not n_ctx:
        raise UserError("the GGUF gives no context_length: give -c/--ctx-size")
    n_ctx = pad(n_ctx, 256)
    if a.kv_unified:
        n_ctx_seq = n_ctx
    else:
        n_ctx_seq = pad(n_ctx // n_seq, 256)
        if n_ctx != n_ctx_seq * n_seq:
            notes.append(f"n_ctx is not divisible by n_seq_max: llama.cpp sets it to {n_ctx_seq * n_seq}")
            n_ctx = n_ctx_seq * n_seq
    n_batch = min(n_ctx, a.n_batch)
    n_ubatch = min(n_batch, a.n_ubatch)
    fa = a.flash_attn != "off"
    if a.flash_attn == "auto":
        notes.append("-fa auto: on (the CPU and CUDA backends both run FLASH_ATTN_EXT for these head sizes)")
    if quantized(a.cache_type_v) and not fa:
        raise UserError(f"-ctv {a.cache_type_v} without flash attention: llama.cpp refuses it (\"quantized V cache "
                        "was requested, but this requires Flash Attention\"); add -fa on, or keep -ctv f16")
    return Context(n_ctx=n_ctx, n_ctx_seq=n_ctx_seq, n_seq_max=n_seq, n_stream=1 if a.kv_unified else n_seq,
                   n_batch=n_batch, n_ubatch=n_ubatch, flash_attn=fa, notes=tuple(notes))


# ---------------------------------------------------------------------------------------------- placement

@dataclass(frozen=True)
class Placement:
    """Where each layer's weights live: ``None`` the CPU, else the GPU index."""

    layers: tuple[int | None, ...]
    output: int | None
    gpus: tuple[int, ...]  # the devices llama.cpp uses (split mode none: the main GPU only)

    def name(self, gpu: int | None, backend: str = "CUDA") -> str:
        return "CPU" if gpu is None else f"{backend}{gpu}"


def placement_of(h: Hparams, a: LlamaArgs) -> Placement:
    """llama-model.cpp ``load_tensors``: the split points and each layer's device."""
    gpus = tuple(range(a.n_gpus)) if a.split_mode != "none" else ((a.main_gpu,) if a.n_gpus else ())
    n_all = h.n_layer
    ngl = a.n_gpu_layers
    if ngl < 0:
        ngl = n_all + 1  # auto / all: every layer (llama.cpp's --fit may take fewer when memory is short)
    if not gpus:
        return Placement((None,) * n_all, None, ())
    shares = list(a.tensor_split[:len(gpus)]) if a.tensor_split else [1.0] * len(gpus)
    shares += [0.0] * (len(gpus) - len(shares))
    total, acc, splits = sum(shares), 0.0, []
    for s in shares:
        acc += s
        splits.append(acc / total)
    i_gpu_start = max(n_all + 1 - ngl, 0)
    act = min(ngl, n_all + 1)

    def dev(il: int) -> int | None:
        if il < i_gpu_start or il - i_gpu_start >= act:
            return None
        x = float(il - i_gpu_start) / act
        k = next((i for i, s in enumerate(splits) if s > x), len(splits) - 1)  # std::upper_bound
        return gpus[k]

    return Placement(tuple(dev(il) for il in range(n_all)), dev(n_all), gpus)


# ---------------------------------------------------------------------------------------------- estimate

@dataclass
class LlamaEstimate:
    model: str
    arch: str
    files: list[str]
    n_ctx: int
    n_ctx_seq: int
    n_seq_max: int
    n_batch: int
    n_ubatch: int
    flash_attn: bool
    n_gpu_layers: int  # layers on the GPUs, the output layer counted as one (llama.cpp's "offloaded N/M")
    n_layer: int
    model_buffer_bytes: dict[str, int]
    kv_buffer_bytes: dict[str, int]
    kv_caches: list[dict]  # per cache (a SWA model has two): cells, layers, buffer bytes
    compute_buffer_bytes: dict[str, int]
    output_buffer_bytes: int
    output_buffer: str
    compute_method: str
    weights_bytes: int  # every tensor as stored in the file(s)
    weight_types: dict[str, int]  # bytes per ggml type
    notes: list[str] = field(default_factory=list)
    estimator_model: str = MODEL_ID
    revision: str | None = None  # owner/repo@commit of a GGUF sized from its Hub header alone
    # a GGUF not read but derived from an HF config and a file type (.from_config.PricedFrom.to_dict())
    priced_from: dict | None = None
    draft: LlamaEstimate | None = None  # -md: the draft model's own buffers, on the same devices
    # the recurrent state (llama_memory_recurrent: a recurrent or hybrid model's R and S tensors) per device
    rs_buffer_bytes: dict[str, int] = field(default_factory=dict)
    rs_cache: dict | None = None  # its cells, layers, R and S bytes (None: the model has no recurrent layer)
    memory: str = "kv"  # kv | recurrent | hybrid (:mod:`.memory`)
    mmproj: MmprojEstimate | None = None  # --mmproj: the projector's buffers (its compute buffer may be None)

    def device_bytes(self) -> dict[str, int]:
        """Bytes per device (CUDA0 ..., "CPU" for host memory: CPU, CPU_Mapped, CUDA_Host, the output), a draft
        model's (-md) and a projector's (--mmproj: its model buffer, and its compute buffer where priced)
        included."""
        out: dict[str, int] = dict(self.draft.device_bytes()) if self.draft is not None else {}
        projector = ()
        if self.mmproj is not None:
            projector = (self.mmproj.model_buffer_bytes, self.mmproj.compute_buffer_bytes or {})
        for d in (self.model_buffer_bytes, self.kv_buffer_bytes, self.rs_buffer_bytes, self.compute_buffer_bytes,
                  {self.output_buffer: self.output_buffer_bytes}, *projector):
            for name, b in d.items():
                dev = device_of(name)
                out[dev] = out.get(dev, 0) + b
        return out

    def to_dict(self) -> dict:
        return {"model": self.model, "arch": self.arch, "files": self.files, "revision": self.revision,
                "n_ctx": self.n_ctx,
                "n_ctx_seq": self.n_ctx_seq, "n_seq_max": self.n_seq_max, "n_batch": self.n_batch,
                "n_ubatch": self.n_ubatch, "flash_attn": self.flash_attn, "n_gpu_layers": self.n_gpu_layers,
                "n_layer": self.n_layer, "model_buffer_bytes": dict(self.model_buffer_bytes),
                "kv_buffer_bytes": dict(self.kv_buffer_bytes), "kv_caches": list(self.kv_caches),
                "memory": self.memory, "rs_buffer_bytes": dict(self.rs_buffer_bytes), "rs_cache": self.rs_cache,
                "compute_buffer_bytes": dict(self.compute_buffer_bytes),
                "output_buffer_bytes": self.output_buffer_bytes, "output_buffer": self.output_buffer,
                "compute_method": self.compute_method, "weights_bytes": self.weights_bytes,
                "weight_types": dict(self.weight_types), "device_bytes": self.device_bytes(),
                "notes": list(self.notes), "estimator_model": self.estimator_model, "priced_from": self.priced_from,
                "draft": self.draft.to_dict() if self.draft is not None else None,
                "mmproj": self.mmproj.to_dict() if self.mmproj is not None else None}

    def log_lines(self) -> list[str]:
        """The buffer lines as llama.cpp prints them (MiB, two decimals)."""
        lines = [f"load_tensors: {name:>12} model buffer size = {b / MIB:8.2f} MiB"
                 for name, b in self.model_buffer_bytes.items()]
        lines.append(f"llama_context: {self.output_buffer:>10}  output buffer size = "
                     f"{self.output_buffer_bytes / MIB:8.2f} MiB")
        for c in self.kv_caches:
            for name, b in c["buffer_bytes"].items():
                lines.append(f"llama_kv_cache: {name:>10} KV buffer size = {b / MIB:8.2f} MiB")
        lines += [f"llama_memory_recurrent: {name:>10} RS buffer size = {b / MIB:8.2f} MiB"
                  for name, b in self.rs_buffer_bytes.items()]
        lines += [f"sched_reserve: {name:>10} compute buffer size = {b / MIB:8.2f} MiB"
                  for name, b in self.compute_buffer_bytes.items()]
        if self.draft is not None:
            lines += [f"(the draft model, -md {self.draft.model})"] + self.draft.log_lines()
        if self.mmproj is not None:
            lines += [f"(the projector, --mmproj {self.mmproj.name})"] + self.mmproj.log_lines()
        return lines


def _overrides(a: LlamaArgs, h: Hparams) -> list[tuple[re.Pattern, str]]:
    """-ot first, then --cpu-moe / --n-cpu-moe (common/arg.cpp appends them in the order given; -ot
    patterns a user writes usually come first)."""
    rules = [(re.compile(p), buf) for p, buf in a.overrides]
    if a.cpu_moe:
        rules.append((EXPS, "CPU"))
    for i in range(min(a.n_cpu_moe, h.n_layer)):
        rules.append((re.compile(rf"blk\.{i}{EXPS.pattern}"), "CPU"))
    return rules


def _repacked(t: GgufTensor, a: LlamaArgs) -> bool:
    """The CPU's extra buffer type takes a weight of a MUL_MAT (2-D) or MUL_MAT_ID (3-D experts) whose type
    it repacks and whose rows come in eights (ggml-cpu/repack.cpp ``ggml_repack_get_optimal_repack_type``)."""
    if t.type_name not in a.cpu_repack or len(t.shape) < 2:
        return False
    dims = len(t.shape) if t.shape[-1] != 1 else len(t.shape) - 1
    experts = bool(EXPS.search(t.name))
    return (dims == 3 if experts else dims == 2) and t.shape[1] % 8 == 0


def placed_tensors(m: GgufModel, h: Hparams, a: LlamaArgs, p: Placement) -> list[tuple[GgufTensor, str, str]]:
    """Every tensor llama.cpp creates, with the buffer it goes to and its role: ``"input"`` (the embedding
    lookups, which read their tokens' rows), ``"output"`` (a tied output's second copy of ``token_embd``,
    read whole by the output matmul), ``"weight"`` (the rest). llama-model.cpp ``load_tensors``: the input
    layer on the CPU, each layer on its device, the output layer on its own; ``-ot`` / ``--cpu-moe`` /
    ``--n-cpu-moe`` move what they match (first match wins)."""
    rules = _overrides(a, h)
    gpu_names = {f"{a.gpu_backend}{g}" for g in p.gpus}
    for pattern, target in rules:  # common/arg.cpp refuses an unknown buffer type name when it parses -ot
        if target.upper() != "CPU" and target not in gpu_names:
            raise UserError(f"-ot {pattern.pattern}={target}: llama.cpp has no buffer type {target!r} here "
                            f"(CPU{', ' + ', '.join(sorted(gpu_names)) if gpu_names else ''})")
    placed: list[tuple[GgufTensor, str, str]] = []
    tensors = list(m.tensors)
    names = {t.name for t in tensors}
    tied = "output.weight" not in names and "token_embd.weight" in names
    rope = [t for t in tensors if t.name.startswith("rope_freqs.")]
    for t in tensors:
        if t.name.startswith("rope_freqs."):
            continue  # a repeating tensor without a layer number: one copy per layer, below
        if t.name.startswith(INPUT_TENSORS):
            gpu = None
        elif t.layer is not None:
            gpu = p.layers[t.layer] if t.layer < len(p.layers) else p.output
        else:
            gpu = p.output
        buf = p.name(gpu, a.gpu_backend)
        for pattern, target in rules:
            if pattern.search(t.name):
                buf = "CPU" if target.upper() == "CPU" else target
                break
        placed.append((t, buf, "input" if t.name.startswith(INPUT_TENSORS) else "weight"))
    if tied:
        emb = next(t for t in tensors if t.name == "token_embd.weight")
        placed.append((emb, p.name(p.output, a.gpu_backend), "output"))  # TENSOR_DUPLICATED: the output's copy
    for t in rope:
        for il in range(h.n_layer):
            placed.append((t, p.name(p.layers[il], a.gpu_backend), "weight"))
    return placed


def model_buffers(m: GgufModel, h: Hparams, a: LlamaArgs, p: Placement) -> tuple[dict[str, int], list[str]]:
    """Each model buffer llama.cpp logs ("CPU_Mapped model buffer size = ..."), in bytes."""
    notes: list[str] = []
    host = "CPU" if not p.gpus else f"{a.gpu_backend}_Host"
    placed = [(t, buf, role != "input") for t, buf, role in placed_tensors(m, h, a, p)]  # (.., used by a MUL_MAT)
    out: dict[str, int] = {}
    mapped: dict[int, list[GgufTensor]] = {}
    seen: set[tuple[str, str]] = set()
    for t, buf, matmul in placed:
        if (t.name, buf) in seen and not t.name.startswith("rope_freqs."):
            continue  # a duplicated tensor (a tied output) in the buffer that holds it already: one copy
        seen.add((t.name, buf))
        if buf == "CPU" and not p.gpus and matmul and _repacked(t, a):
            out["CPU_REPACK"] = out.get("CPU_REPACK", 0) + pad(t.nbytes, CPU_ALIGN)
        elif buf == "CPU":
            if a.use_mmap:
                mapped.setdefault(t.file_index, []).append(t)
                continue
            out[host] = out.get(host, 0) + pad(t.nbytes, CPU_ALIGN)
        else:
            out[buf] = out.get(buf, 0) + cuda_alloc(t)
    if mapped:
        total = 0
        for idx, ts in sorted(mapped.items()):
            first = min(t.offset for t in ts)
            last = max(t.offset + t.nbytes for t in ts)
            total += last - first
        out = {"CPU_Mapped": total, **out}
    if a.split_mode == "row" and len(p.gpus) > 1:  # another backend than CUDA (validated() refuses CUDA's)
        notes.append(f"-sm row: the split buffers ({a.gpu_backend}_Split) are priced as -sm layer's; not modelled "
                     "apart")
    return out, notes


def swa_cells(h: Hparams, a: LlamaArgs, c: Context) -> int | None:
    """The sliding-window cache's cells (llama-kv-cache-iswa.cpp): ``pad(min(cells, n_swa x (unified ? np : 1)
    + n_ubatch), 256)``, every cell with ``--swa-full``; ``None`` for a model without sliding-window layers."""
    if not any(h.is_swa):
        return None
    if a.swa_full:
        return c.n_ctx_seq
    return pad(min(c.n_ctx_seq, h.n_swa * (c.n_seq_max if a.kv_unified else 1) + c.n_ubatch), 256)


def kv_buffers(h: Hparams, a: LlamaArgs, c: Context, p: Placement) -> tuple[dict[str, int], list[dict], list[str]]:
    """Each KV cache's buffers (llama_kv_cache per cache, one buffer per device), over the layers the
    architecture's memory gives an attention cache (:mod:`.memory`: a hybrid's attention layers; none for a
    recurrent model). With MLA a layer caches K only (V is a view of it); without flash attention V is
    transposed and every layer's V row is the widest one (llama-kv-cache.cpp ``[TAG_V_CACHE_VARIABLE]``)."""
    notes: list[str] = []
    mem = h.memory
    caches = []
    if not any(mem.attn_layers):
        return {}, caches, notes
    groups = [("base", [il for il in range(h.n_layer) if not h.is_swa[il]], c.n_ctx_seq)]
    size_swa = swa_cells(h, a, c)
    if size_swa is not None:
        groups.append(("swa", [il for il in range(h.n_layer) if h.is_swa[il]], size_swa))
    v_max = max(h.n_embd_v_gqa(il) for il in range(h.n_layer))
    total: dict[str, int] = {}
    for label, layers, cells in groups:
        bufs: dict[str, int] = {}
        n_layers = 0
        k_bytes = v_bytes = 0
        for il in layers:
            if not mem.attn_layers[il] or h.n_head_kv[il] == 0:
                continue
            n_layers += 1
            gpu = p.layers[il] if a.offload_kqv else None
            name = p.name(gpu, a.gpu_backend)
            align = CPU_ALIGN if gpu is None else CUDA_ALIGN
            k = row_size(a.cache_type_k, h.n_embd_k_gqa(il)) * cells * c.n_stream
            v = 0 if mem.mla else \
                row_size(a.cache_type_v, h.n_embd_v_gqa(il) if c.flash_attn else v_max) * cells * c.n_stream
            k_bytes += k
            v_bytes += v
            bufs[name] = bufs.get(name, 0) + pad(k, align) + pad(v, align)
        caches.append({"cache": label, "cells": cells, "layers": n_layers, "streams": c.n_stream,
                       "k_bytes": k_bytes, "v_bytes": v_bytes, "buffer_bytes": bufs})
        for name, b in bufs.items():
            total[name] = total.get(name, 0) + b
    if mem.mla:
        notes.append("MLA: the KV cache holds K only (kv_lora_rank + rope values per cell, one head); V is a view of "
                     "it (llama-kv-cache.cpp)")
    return total, caches, notes


RS_TYPE = "f32"  # create_memory: the recurrent state's R and S are GGML_TYPE_F32


def rs_buffers(h: Hparams, a: LlamaArgs, c: Context, p: Placement) -> tuple[dict[str, int], dict | None]:
    """The recurrent state's buffers (llama-memory-recurrent.cpp, one per device): per recurrent layer an R
    tensor of ``n_embd_r`` and an S tensor of ``n_embd_s`` f32 values per cell, ``max(1, np)`` cells (one per
    sequence; ``-kvu`` changes nothing), on the layer's device (``-nkvo``: the CPU), aligned per tensor."""
    mem = h.memory
    layers = [il for il in range(h.n_layer) if mem.recr_layers[il]]
    if not layers:
        return {}, None
    cells = max(1, c.n_seq_max)
    r = row_size(RS_TYPE, mem.n_embd_r) * cells
    s = row_size(RS_TYPE, mem.n_embd_s) * cells
    bufs: dict[str, int] = {}
    for il in layers:
        gpu = p.layers[il] if a.offload_kqv else None
        name = p.name(gpu, a.gpu_backend)
        align = CPU_ALIGN if gpu is None else CUDA_ALIGN
        bufs[name] = bufs.get(name, 0) + pad(r, align) + pad(s, align)
    return bufs, {"cache": "rs", "cells": cells, "layers": len(layers), "r_bytes": r * len(layers),
                  "s_bytes": s * len(layers), "n_embd_r": mem.n_embd_r, "n_embd_s": mem.n_embd_s,
                  "buffer_bytes": dict(bufs)}


def output_buffer(h: Hparams, a: LlamaArgs, c: Context, p: Placement) -> tuple[str, int]:
    """``output_reserve(n_seq_max)`` at context creation (llama-context.cpp): the logits of one output per
    sequence, and with ``--embedding`` its embedding too (``n_embd_out`` floats), in float32."""
    name = "CPU" if p.output is None else f"{a.gpu_backend}_Host"
    per_output = h.n_vocab + ((h.n_embd_out or h.n_embd) if a.embeddings else 0)
    return name, per_output * c.n_seq_max * 4


@dataclass(frozen=True)
class TokenReads:
    """The bytes one generated token reads, per device (``CPU``, ``CUDA0`` ...): the weights of the layers
    placed there and the KV cache at the context (:func:`token_reads`). What the decode bound divides by each
    device's memory bandwidth (:func:`vramcal.estimator.speed.sequential_bound`)."""

    weights_bytes: dict[str, int]
    kv_bytes: dict[str, int]
    n_ctx_seq: int  # the positions a full-attention layer reads: the context of one sequence
    expert_share: tuple[int, int] | None  # (expert_used_count, expert_count) of a MoE model

    def by_device(self) -> dict[str, int]:
        out = dict(self.weights_bytes)
        for dev, b in self.kv_bytes.items():
            out[dev] = out.get(dev, 0) + b
        return {d: b for d, b in out.items() if b > 0}


def token_reads(spec: str | GgufModel, args: LlamaArgs | None = None) -> TokenReads:
    """What one decode step of one sequence reads, at the end of a full context, for ``args``:

    - every weight once, where :func:`placed_tensors` puts it (``CPU_REPACK`` and the host buffers count as
      the CPU), except the embedding lookups, which read one row (not counted); a tied output's copy of
      ``token_embd`` is read whole by the output matmul;
    - of a MoE layer's routed experts (``ffn_*_exps``, :data:`EXPS`) only the ``expert_used_count`` of
      ``expert_count`` that each token is routed to (the router ``ffn_gate_inp`` and shared experts whole);
    - each attention layer's K and V rows at every position it attends to: the sequence's context
      (``n_ctx_seq`` cells) for a full-attention layer, ``min(n_ctx_seq, n_swa)`` for a sliding-window one,
      on the layer's device (``-nkvo``: the CPU); with MLA the K rows only;
    - each recurrent layer's state (one R and one S row of the sequence), whatever the context.
    """
    from .gguf_file import read_gguf

    a = (args or LlamaArgs()).validated()
    m = spec if isinstance(spec, GgufModel) else read_gguf(spec)
    h = hparams_of(m)
    c = context_of(h, a)
    p = placement_of(h, a)

    def device(buf: str) -> str:
        return buf if re.fullmatch(r"[A-Za-z]+\d+", buf) and not buf.startswith("CPU") else "CPU"

    weights: dict[str, int] = {}
    for t, buf, role in placed_tensors(m, h, a, p):
        if role == "input":
            continue  # get_rows: the tokens' rows, not the table
        n = t.nbytes
        if h.n_expert and EXPS.search(t.name):
            n = n * h.n_expert_used // h.n_expert
        weights[device(buf)] = weights.get(device(buf), 0) + n
    kv: dict[str, int] = {}
    mem = h.memory
    for il in range(h.n_layer):
        dev = p.name(p.layers[il] if a.offload_kqv else None, a.gpu_backend)
        if mem.recr_layers[il]:  # the sequence's R and S rows, read (and written) once per token
            kv[dev] = kv.get(dev, 0) + row_size(RS_TYPE, mem.n_embd_r) + row_size(RS_TYPE, mem.n_embd_s)
        if h.n_head_kv[il] == 0 or not mem.attn_layers[il]:
            continue
        cells = min(c.n_ctx_seq, h.n_swa) if h.is_swa[il] and h.n_swa > 0 else c.n_ctx_seq
        row = row_size(a.cache_type_k, h.n_embd_k_gqa(il))
        if not mem.mla:  # MLA: V is read from K's cells
            row += row_size(a.cache_type_v, h.n_embd_v_gqa(il))
        kv[dev] = kv.get(dev, 0) + row * cells
    share = (h.n_expert_used, h.n_expert) if h.n_expert else None
    return TokenReads(weights, kv, c.n_ctx_seq, share)


def estimate_llamacpp(spec: str | GgufModel, args: LlamaArgs | None = None) -> LlamaEstimate:
    """Every buffer llama.cpp logs loading ``spec`` with ``args``."""
    from .compute import compute_buffers
    from .gguf_file import read_gguf
    from .mmproj import estimate_mmproj

    a = (args or LlamaArgs()).validated()
    m = spec if isinstance(spec, GgufModel) else read_gguf(spec)
    h = hparams_of(m)
    c = context_of(h, a)
    p = placement_of(h, a)
    model, notes = model_buffers(m, h, a, p)
    kv, caches, kv_notes = kv_buffers(h, a, c, p)
    rs, rs_cache = rs_buffers(h, a, c, p)
    out_name, out_bytes = output_buffer(h, a, c, p)
    compute, method, c_notes = compute_buffers(m, h, a, c, p)
    types: dict[str, int] = {}
    for t in m.tensors:
        types[t.type_name] = types.get(t.type_name, 0) + t.nbytes
    n_gpu = sum(1 for d in p.layers if d is not None) + (p.output is not None)
    draft = None
    if a.draft is not None:
        try:
            draft = estimate_llamacpp(_draft_model(a.draft.path), a.for_draft())
        except UserError as exc:
            raise UserError(f"the draft model (-md {a.draft.path}): {exc}") from None
        notes.append("the draft model's buffers (-md) are on the same devices, added to each: llama-server loads it "
                     "with the target's -c, -np, -b, -ub, -fa and -ts and its own -ngld, -ctkd/-ctvd, -otd "
                     "(common/speculative.cpp); its vocabulary is not checked against the target's")
    projector = None
    if a.mmproj is not None:
        projector = estimate_mmproj(a.mmproj, a.n_gpus, a.gpu_backend, a.flash_attn != "off")
        notes += projector.notes
    return LlamaEstimate(model=m.name, arch=m.arch, files=list(m.files), n_ctx=c.n_ctx, n_ctx_seq=c.n_ctx_seq,
                         n_seq_max=c.n_seq_max, n_batch=c.n_batch, n_ubatch=c.n_ubatch, flash_attn=c.flash_attn,
                         n_gpu_layers=n_gpu, n_layer=h.n_layer, model_buffer_bytes=model, kv_buffer_bytes=kv,
                         kv_caches=caches, compute_buffer_bytes=compute, output_buffer_bytes=out_bytes,
                         output_buffer=out_name, compute_method=method, weights_bytes=m.tensor_bytes,
                         weight_types=types, notes=[*c.notes, *notes, *kv_notes, *c_notes], revision=m.revision,
                         priced_from=m.priced_from.to_dict() if m.priced_from is not None else None,
                         draft=draft, rs_buffer_bytes=rs, rs_cache=rs_cache, memory=h.memory.kind, mmproj=projector)


def _draft_model(path: str) -> GgufModel:
    """A draft model's header, read once per file as it is (a search prices it at every step)."""
    import os

    from .gguf_file import locate

    f = locate(path)
    st = os.stat(f)
    return _read_once(str(f), st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=8)
def _read_once(path: str, mtime_ns: int, size: int) -> GgufModel:
    from .gguf_file import read_gguf

    return read_gguf(path)
