"""Hybrid models' recurrent state in vLLM's KV cache (V1 engine): Qwen3-Next's Gated DeltaNet layers, the
Mamba-2 layers of Nemotron-H, Granite-4.0-H and Falcon-H1 and the Mamba-1 layers of Jamba, beside their
full-attention layers (Falcon-H1's run side by side with one in every decoder layer). Pure arithmetic.

**One state page** (``v1/kv_cache_interface.py``, ``MambaSpec.page_size_bytes``): the sum over the
layer's state tensors of elements x dtype bytes, per rank (``layers/mamba/mamba_utils.py``,
``MambaStateShapeCalculator``; element counts the same in every version read, 0.10.1.1-0.33.0):

- Gated DeltaNet (``gated_delta_net_state_shape``): conv ``(kernel - 1) x (2 x k_heads x k_dim +
  v_heads x v_dim) / tp`` and the recurrent state ``v_heads / tp x k_dim x v_dim``;
- Mamba-2 (``mamba2_state_shape``): conv ``(kernel - 1) x (intermediate + 2 x groups' x state) / tp``
  (``groups'`` is the groups padded to tp when tp does not divide them) and the SSM state
  ``heads / tp x head_dim x state``; Falcon-H1's intermediate is ``mamba_d_ssm``, else ``mamba_expand x
  hidden`` (``falcon_h1.py``, ``get_mamba_state_shape_from_config``; transformers' config fills
  ``mamba_d_ssm`` with 1024 when the checkpoint leaves it out);
- Mamba-1 (``mamba1_state_shape``, Jamba's ``get_mamba_state_shape_from_config`` in ``jamba.py``): conv
  ``(kernel - 1) x intermediate / tp`` and the SSM state ``intermediate / tp x state``, with intermediate
  ``mamba_expand x hidden`` (0.10.2, 0.19.1 and 0.33.0 read; 0.10.2 orients the conv state the other way, the
  same elements). Dtypes as Mamba-2's (``mamba1_state_dtype``).

Dtypes (``MambaStateDtypeCalculator``): the conv state in ``mamba_cache_dtype`` (``auto``: the model
dtype, never the KV cache's fp8); the SSM state in ``mamba_ssm_cache_dtype`` when it is set, else the
conv's. Gated DeltaNet ignores ``mamba_ssm_cache_dtype`` before 0.17 (read: 0.15.1 ignores it, 0.17.1
takes it). Nemotron-H (``NemotronHForCausalLMConfig``, from 0.13; 0.12.0 has not) turns ``auto`` into the
checkpoint's own ``mamba_ssm_cache_dtype``, else float16 (0.13-0.19) or float32 (0.20 on).

**Page unification** (``HybridAttentionMambaModelConfig.verify_and_update_config``:
``model_executor/models/config.py`` up to 0.19, ``platforms/interface.py`` from 0.20): vLLM needs one page
size for every layer, so it raises the attention block size until an attention page (``block x 2 x
kv_heads/tp x head_dim x B``) is at least the state page, then pads the state page up to it
(``mamba_page_size_padded``):

    block = align x cdiv(state_page, align x attention_bytes_per_token)          (align = 16)

``align`` is 16 (FlashAttention's multiple; from 0.20 the larger of the backend's smallest kernel block
and ``--block-size``). With Mamba prefix caching in mode ``all`` the block is instead a multiple of
``lcm(chunk_size, align)``. A ``--block-size`` below the result is raised to it.

**What a request holds** (``MambaSpec.max_memory_usage_bytes``): one state page in mode ``none``, two in
``align`` plus its ``num_prefill_checkpoint_blocks`` (0.29 on; set to 1 by Mamba-2 layers from 0.32,
``mamba_mixer2.py``; Gated DeltaNet's from 0.33 only when the model can export checkpoints, not modelled),
``cdiv(L, block)`` in ``all`` (up to 0.31: 0.32 drops the mode). The mode follows prefix caching
(``MambaModelConfig``): off for hybrid models up to 0.25 (0.10-0.11 force it off; 0.12-0.25
``is_prefix_caching_supported`` is False for them), on by default from 0.26 ("Generative hybrid models
support prefix caching"), where the mode is ``all`` up to 0.31 for architectures that implement
``SupportsMambaPrefixCaching`` (Nemotron-H, Granite-4.0-H, Jamba and Falcon-H1: 0.15.1, 0.19.1 and 0.27.1
read) and ``align`` otherwise (Qwen3-Next; every architecture from 0.32, where only Mamba-2 layers add a
checkpoint page).
The state layers' block size is ``max_model_len`` in mode ``none`` (one block a request), the attention
block otherwise; "GPU KV cache size" up to 0.19 counts ``num_blocks // groups x`` the smaller of the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import lcm

from ...errors import UserError

MAMBA_ARCHS = {"Qwen3NextForCausalLM": "gdn", "NemotronHForCausalLM": "mamba2",
               "GraniteMoeHybridForCausalLM": "mamba2", "FalconH1ForCausalLM": "mamba2", "JambaForCausalLM": "mamba1"}
# architectures whose Mamba layers take prefix caching mode "all" (SupportsMambaPrefixCaching, 0.12-0.32)
ALL_MODE_ARCHS = ("NemotronHForCausalLM", "GraniteMoeHybridForCausalLM", "FalconH1ForCausalLM", "JambaForCausalLM")
STATE_DTYPES = {"auto": None, "float32": 4, "float16": 2, "half": 2, "bfloat16": 2}
ALIGN = 16


@dataclass(frozen=True)
class StateShape:
    """One state layer's tensors per rank, as element counts (conv state, recurrent / SSM state)."""

    family: str  # gdn | mamba2 | mamba1
    conv_elems: int
    ssm_elems: int
    chunk_size: int  # the Mamba-2 kernel's chunk (prefix caching mode "all"); 2048 when the config has none


def _divide(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise UserError(f"--tensor-parallel-size {tp} does not divide the model's {what} ({n}): vLLM refuses it; "
                        "choose a divisor")
    return n // tp


def state_shape(architecture: str, tc: dict, tp: int) -> StateShape:
    """The state of one Mamba / linear-attention layer of ``architecture`` on one rank of ``tp``."""
    family = MAMBA_ARCHS.get(architecture)
    if family is None:
        raise UserError(f"{architecture} has linear-attention / Mamba layers whose state vLLM sizes in a way vramcal "
                        f"does not model yet (modelled: {', '.join(MAMBA_ARCHS)})")
    chunk = int(tc.get("mamba_chunk_size") or tc.get("chunk_size") or 2048)
    if family == "gdn":
        k_heads, v_heads = int(tc["linear_num_key_heads"]), int(tc["linear_num_value_heads"])
        k_dim, v_dim = int(tc["linear_key_head_dim"]), int(tc["linear_value_head_dim"])
        kernel = int(tc["linear_conv_kernel_dim"])
        conv = (kernel - 1) * _divide(2 * k_heads * k_dim + v_heads * v_dim, tp, "Gated DeltaNet conv width")
        ssm = _divide(v_heads, tp, "linear-attention value heads") * k_dim * v_dim
        return StateShape(family, conv, ssm, chunk)
    if family == "mamba1":
        inter = int(tc.get("mamba_expand", 2)) * int(tc["hidden_size"])
        state, kernel = int(tc["mamba_d_state"]), int(tc["mamba_d_conv"])
        per_rank = _divide(inter, tp, "Mamba intermediate size")
        return StateShape(family, (kernel - 1) * per_rank, per_rank * state, chunk)
    if architecture == "NemotronHForCausalLM":
        heads, head_dim = int(tc["mamba_num_heads"]), int(tc["mamba_head_dim"])
        inter, groups = heads * head_dim, int(tc["n_groups"])
        state, kernel = int(tc["ssm_state_size"]), int(tc["conv_kernel"])
    else:  # GraniteMoeHybrid, FalconH1
        heads, head_dim = int(tc["mamba_n_heads"]), int(tc["mamba_d_head"])
        inter, groups = int(tc.get("mamba_expand", 2)) * int(tc["hidden_size"]), int(tc.get("mamba_n_groups", 1))
        if architecture == "FalconH1ForCausalLM" and tc.get("mamba_d_ssm") is not None:
            inter = int(tc["mamba_d_ssm"])
        state, kernel = int(tc["mamba_d_state"]), int(tc["mamba_d_conv"])
    if groups % tp:  # extra_groups_for_head_shards: the groups are replicated up to tp
        groups = tp
    conv = (kernel - 1) * _divide(inter + 2 * groups * state, tp, "Mamba conv width")
    ssm = _divide(heads, tp, "Mamba heads") * head_dim * state
    return StateShape(family, conv, ssm, chunk)


def state_dtype_bytes(architecture: str, tc: dict, v: tuple[int, int, int], model_el: int,
                      mamba_cache_dtype: str = "auto", mamba_ssm_cache_dtype: str = "auto") -> tuple[int, int, str]:
    """(conv bytes, SSM bytes per element, why) for the state tensors."""
    for value, flag in ((mamba_cache_dtype, "--mamba-cache-dtype"), (mamba_ssm_cache_dtype, "--mamba-ssm-cache-dtype")):
        if value not in STATE_DTYPES:
            raise UserError(f"unknown {flag} {value!r}: choose {', '.join(STATE_DTYPES)}")
    conv = STATE_DTYPES[mamba_cache_dtype] or model_el
    ssm_name = mamba_ssm_cache_dtype
    why = f"mamba_cache_dtype {mamba_cache_dtype}"
    if architecture == "NemotronHForCausalLM" and ssm_name == "auto" and v >= (0, 13, 0):
        ssm_name = str(tc.get("mamba_ssm_cache_dtype") or ("float32" if v >= (0, 20, 0) else "float16"))
        why += f", mamba_ssm_cache_dtype {ssm_name} (NemotronH: the checkpoint's, else vLLM's default)"
        if ssm_name not in STATE_DTYPES:
            raise UserError(f"the checkpoint's mamba_ssm_cache_dtype {ssm_name!r} is not one vramcal knows")
    if MAMBA_ARCHS.get(architecture) == "gdn" and v < (0, 17, 0):
        ssm_name = "auto"  # gated_delta_net_state_dtype takes mamba_cache_dtype only
    ssm = STATE_DTYPES[ssm_name] or conv
    if ssm_name != "auto" and "mamba_ssm_cache_dtype" not in why:
        why += f", mamba_ssm_cache_dtype {ssm_name}"
    return conv, ssm, why


def cache_mode(v: tuple[int, int, int], architecture: str, prefix_caching: bool | None) -> str:
    """Mamba prefix-caching mode: ``none`` | ``align`` | ``align+checkpoint`` (align with one prefill
    checkpoint page) | ``all`` (``MambaModelConfig``). ``prefix_caching`` None: vLLM's default for a hybrid
    model (off up to 0.25, on from 0.26)."""
    on = v >= (0, 26, 0) if prefix_caching is None else prefix_caching
    if not on or v < (0, 12, 0):  # 0.10-0.11 turn prefix caching off for hybrid models whatever is asked
        return "none"
    if v < (0, 15, 0):
        raise UserError("--enable-prefix-caching on a hybrid Mamba model before vLLM 0.15 (no mamba_cache_mode yet) "
                        "is not modelled: drop it, or give --vllm-version 0.15 or newer")
    if v < (0, 32, 0):
        return "all" if architecture in ALL_MODE_ARCHS else "align"
    if MAMBA_ARCHS.get(architecture) == "mamba2":
        return "align+checkpoint"  # mamba_mixer2.get_kv_cache_spec: num_prefill_checkpoint_blocks=1 (0.32 on)
    if v >= (0, 33, 0) and MAMBA_ARCHS.get(architecture) == "gdn":
        raise UserError("vLLM 0.33 gives Gated DeltaNet layers prefill checkpoint state pages under Mamba prefix "
                        "caching (on by default for hybrid models) when the model can export them, which vramcal "
                        "does not model: give --no-enable-prefix-caching, or --vllm-version 0.32 or older")
    return "align"


@dataclass(frozen=True)
class Unified:
    """The attention block and state page after ``verify_and_update_config``."""

    block_size: int  # the attention block, in tokens
    page_bytes: int  # every layer's page: the attention page; the state page padded to it
    state_bytes: int  # the state page before padding
    mamba_block_size: int  # the state layers' block (max_model_len in mode "none")
    mode: str

    @property
    def padding_pct(self) -> float:
        return 100 * (self.page_bytes - self.state_bytes) / self.state_bytes


def unify(state_bytes: int, attn_bytes_per_token: int, mode: str, chunk_size: int, max_model_len: int,
          block_given: int | None, v: tuple[int, int, int]) -> Unified:
    """The attention block size and the one page size (the module's doc, with its vLLM files)."""
    align = ALIGN
    if v >= (0, 20, 0) and block_given:
        align = max(ALIGN, block_given)
    if mode == "all":
        step = lcm(chunk_size, align)
        block = step * -(-(-(-state_bytes // attn_bytes_per_token)) // step)
    else:
        block = align * -(-state_bytes // (align * attn_bytes_per_token))
    if block_given and block_given > block:
        block = block_given
    page = block * attn_bytes_per_token
    return Unified(block, page, state_bytes, max_model_len if mode == "none" else block, mode)


def pages_per_request(mode: str, length: int, mamba_block: int) -> int:
    """``MambaSpec.max_memory_usage_bytes`` in pages, for one request of ``length`` tokens."""
    if mode == "all":
        return -(-length // mamba_block)
    return {"align": 2, "align+checkpoint": 3}.get(mode, 1)
