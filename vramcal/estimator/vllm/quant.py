"""vLLM's quantization methods as storage layouts of one linear layer (per rank, after
``process_weights_after_loading``). Pure arithmetic.

========================  ===========================================================================
scheme                    what a linear layer of ``out x in`` keeps (vLLM file)
========================  ===========================================================================
``none``                  ``out x in`` in the model dtype
``fp8``                   ``--quantization fp8`` on a 16-bit checkpoint: fp8 weight and one float32
                          scale per merged shard (``layers/quantization/fp8.py``, dynamic scheme)
``fp8-block``             a block-fp8 checkpoint (``weight_block_size``): fp8 weight and a float32 scale
                          per block (``fp8.py``)
``ct-channel``            compressed-tensors W8A8 (int8 or fp8) with per-channel weight scales: 1-byte
                          weight and one float32 scale per output row (``compressed_tensors_w8a8_*.py``)
``ct-tensor``             the same with a per-tensor scale (one float32 per merged shard)
``ct-channel`` (fbgemm)   an ``fbgemm_fp8`` checkpoint (Llama-3.1-405B-FP8): the same per-row layout
                          (``fbgemm_fp8.py``: fp8 weight, ``ChannelQuantScaleParameter`` float32
                          [out, 1]; its one-float ``input_scale_ub`` a layer is left out)
``wNa16``                 4/8-bit integer weights packed into int32, one scale per group and output row in
                          the activation dtype (compressed-tensors ``pack-quantized``, GPTQ, AWQ; Marlin
                          repacks into tensors of the same size, ``gptq_marlin.py``, ``awq_marlin.py``);
                          AWQ and asymmetric GPTQ also keep packed zero points per group
``bnb4``                  bitsandbytes 4-bit: packed uint8 and a float32 absmax per 64 values
``mxfp4``                 gpt-oss: the MoE experts only (``Mxfp4Config.get_quant_method`` leaves every
                          ``LinearBase`` unquantized): packed FP4 (``n / 2`` uint8) and one uint8 E8M0
                          scale per 32 values, padded and held as the kernel backend keeps them
                          (:mod:`.mxfp4`: Triton keeps the scales twice, Marlin pads hidden to 256)
``nvfp4``                 NVFP4 (compressed-tensors ``nvfp4-pack-quantized``, ModelOpt ``NVFP4``): packed
                          FP4 (``n / 2`` uint8) and one fp8 scale per 16 values, the scales swizzled into
                          128 x 4 tiles (rows padded to 128, scale columns to 4: ``swizzle_blockscale``),
                          and four float32 scalars per merged shard (global weight and input scales,
                          alpha, the input scale's inverse) (``compressed_tensors_w4a4_nvfp4.py``,
                          ``modelopt.py``)
========================  ===========================================================================

Embeddings, ``lm_head`` and MoE routers stay in the model dtype in every scheme; MoE experts follow
the linear layers' scheme.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import UserError
from .mxfp4 import Mxfp4Backend

CHECKPOINT_METHODS = ("awq", "awq_marlin", "gptq", "gptq_marlin", "compressed-tensors", "bitsandbytes", "fp8",
                      "fbgemm_fp8", "mxfp4", "modelopt")
QUANT_CHOICES = ("fp8", "fbgemm_fp8", "awq", "awq_marlin", "gptq", "gptq_marlin", "compressed-tensors", "bitsandbytes",
                 "mxfp4", "modelopt")
NVFP4_GROUP = 16
MXFP4_BLOCK = 32
# vLLM accepts these spellings of a checkpoint's own method (config/model.py's _verify_quantization:
# the Marlin kernels override the plain names)
COMPATIBLE = {"gptq": {"gptq", "gptq_marlin"}, "awq": {"awq", "awq_marlin"},
              "compressed-tensors": {"compressed-tensors"}, "bitsandbytes": {"bitsandbytes"},
              "fp8": {"fp8"}, "fbgemm_fp8": {"fbgemm_fp8"}, "mxfp4": {"mxfp4"},
              "modelopt": {"modelopt", "modelopt_fp4"}}


@dataclass(frozen=True)
class VllmQuant:
    scheme: str  # none | fp8 | fp8-block | ct-channel | ct-tensor | wNa16 | bnb4
    method: str  # what vLLM calls it (None -> "none")
    bits: int = 16
    group_size: int | None = None
    block: tuple[int, int] | None = None
    zero_points: bool = False
    act_order: bool = False
    dtype_forced: str | None = None  # GPTQ / AWQ run in float16
    mxfp4: Mxfp4Backend | None = None  # the MoE kernel that holds MXFP4 experts (set by the engine)

    @property
    def experts_only(self) -> bool:
        """Only the MoE experts are quantized (MXFP4: every other linear layer stays 16-bit)."""
        return self.scheme == "mxfp4"

    def linear_bytes(self, out: int, inp: int, el: int, shards: int = 1) -> int:
        """Bytes one rank keeps for a linear layer whose rank-local weight is ``out x inp``."""
        n = out * inp
        s = self.scheme
        if s == "none":
            return n * el
        if s == "fp8":
            return n + 4 * shards
        if s == "fp8-block":
            bo, bi = self.block or (128, 128)
            return n + -(-out // bo) * -(-inp // bi) * 4
        if s == "ct-channel":
            return n + out * 4
        if s == "ct-tensor":
            return n + 4 * shards
        if s == "wNa16":
            groups = -(-inp // (self.group_size or inp))
            b = n * self.bits // 8 + groups * out * el
            if self.zero_points:
                b += groups * out * self.bits // 8
            if self.act_order:
                b += inp * 4 * 2  # g_idx and its sort indices
            return b
        if s == "bnb4":
            return -(-n // 2) + -(-n // 64) * 4
        if s == "mxfp4":
            return n // 2 + n // MXFP4_BLOCK
        if s == "nvfp4":
            scale_cols = -(-(inp // NVFP4_GROUP) // 4) * 4
            return n // 2 + -(-out // 128) * 128 * scale_cols + 16 * shards
        raise ValueError(f"unknown scheme {s!r}")

    @property
    def label(self) -> str:
        return self.method if self.scheme == "none" else f"{self.method} ({self.scheme})"


NONE = VllmQuant("none", "none")


def checkpoint_method(config: dict) -> str | None:
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        tc = config.get("text_config")
        qc = tc.get("quantization_config") if isinstance(tc, dict) else None
    if not isinstance(qc, dict):
        return None
    return str(qc.get("quant_method", "")).lower()


def resolve(config: dict, quantization: str | None) -> VllmQuant:
    """vLLM's quantization for this checkpoint and ``--quantization`` (config/model.py: a checkpoint's
    own method wins; asking for another is refused, as vLLM does)."""
    own = checkpoint_method(config)
    asked = quantization.lower() if quantization is not None else None  # "" is refused below, not "none"
    if asked is not None and asked not in QUANT_CHOICES:
        raise UserError(f"unknown --quantization {quantization!r}: vramcal models {', '.join(QUANT_CHOICES)} "
                        "(or leave it out for the checkpoint's own)")
    if own is None:
        if asked is None:
            return NONE
        if asked == "fp8":
            return VllmQuant("fp8", "fp8")
        raise UserError(f"--quantization {asked} needs a checkpoint quantized that way; this one is not quantized "
                        "(vLLM quantizes a 16-bit checkpoint on the fly only with --quantization fp8)")
    if asked is not None and asked not in COMPATIBLE.get(own, {own}):
        raise UserError(f"the checkpoint is quantized with {own}, which --quantization {asked} does not match: "
                        f"vLLM refuses it; leave --quantization out or give {own}")
    qc = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config") or {}
    return _checkpoint_scheme(own, qc, asked)


def _checkpoint_scheme(own: str, qc: dict, asked: str | None) -> VllmQuant:
    if own == "fp8":
        block = qc.get("weight_block_size")
        if block:
            return VllmQuant("fp8-block", "fp8", 8, block=(int(block[0]), int(block[1])))
        return VllmQuant("fp8", "fp8", 8)
    if own == "fbgemm_fp8":  # per-row float32 scales, not fp8's one scale a shard
        return VllmQuant("ct-channel", "fbgemm_fp8", 8)
    if own in ("gptq", "awq"):
        bits = int(qc.get("bits", qc.get("w_bit", 4)))
        group = int(qc.get("group_size", qc.get("q_group_size", 128)))
        method = asked or f"{own}_marlin"
        zero = own == "awq" or not qc.get("sym", True)
        return VllmQuant("wNa16", method, bits, group if group > 0 else None, zero_points=zero,
                         act_order=bool(qc.get("desc_act")), dtype_forced="float16")
    if own == "mxfp4":
        return VllmQuant("mxfp4", "mxfp4", 4, group_size=MXFP4_BLOCK)
    if own == "modelopt":
        algo = str(qc.get("quant_algo") or (qc.get("quantization") or {}).get("quant_algo") or "").upper()
        if algo == "NVFP4":
            return VllmQuant("nvfp4", "modelopt", 4, group_size=NVFP4_GROUP)
        if algo == "FP8":
            return VllmQuant("fp8", "modelopt", 8)
        raise UserError(f"ModelOpt quant_algo {algo or '(none)'!r} is not modelled for vLLM: NVFP4 and FP8 are")
    if own == "bitsandbytes":
        if qc.get("load_in_8bit"):
            raise UserError("a pre-quantized bitsandbytes 8-bit checkpoint is not modelled for vLLM")
        return VllmQuant("bnb4", "bitsandbytes", 4)
    if own == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        first = next(iter(groups.values()), {}) if isinstance(groups, dict) else {}
        w = first.get("weights") or {}
        a = first.get("input_activations")
        bits = int(w.get("num_bits", 8))
        strategy = str(w.get("strategy", "channel"))
        if bits == 4 and str(w.get("type", "int")) == "float":  # nvfp4-pack-quantized: FP4 in groups of 16
            return VllmQuant("nvfp4", "compressed-tensors", 4, group_size=int(w.get("group_size") or NVFP4_GROUP))
        if bits == 8 and a:
            return VllmQuant("ct-channel" if strategy == "channel" else "ct-tensor", "compressed-tensors", 8)
        if bits in (4, 8) and not a:
            group = w.get("group_size")
            return VllmQuant("wNa16", "compressed-tensors", bits, int(group) if group else None,
                             zero_points=not w.get("symmetric", True),
                             act_order=str(w.get("actorder") or "") == "group")
        if strategy == "block" and w.get("block_structure"):
            b = w["block_structure"]
            return VllmQuant("fp8-block", "compressed-tensors", 8, block=(int(b[0]), int(b[1])))
        raise UserError(f"this compressed-tensors scheme ({bits}-bit weights, strategy {strategy}, activations "
                        f"{'quantized' if a else 'not quantized'}) is not modelled for vLLM")
    raise UserError(f"the checkpoint's quantization {own!r} is not modelled for vLLM: vramcal models "
                    f"{', '.join(CHECKPOINT_METHODS)}")
