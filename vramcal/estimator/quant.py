"""Quantization choices a user can ask for, and how each one stores a weight.

Pure data and arithmetic: no torch import. The storage layouts are what the libraries really
allocate (checked to the byte against real loads in ``tests/test_weights_exact.py``):

bitsandbytes 4-bit (``Params4bit`` after ``quantize_4bit``), for a weight of ``n`` elements and
blocksize ``B`` (64):

- packed data: ``ceil(n / 2)`` uint8 (two 4-bit codes per byte);
- ``absmax``: one float32 per block, ``ceil(n / B)`` -- or, with double quantization, one uint8
  per block plus ``state2.absmax`` (one float32 per 256 blocks), ``state2.code`` (256 float32)
  and ``offset`` (one float32);
- ``code``: the 16-entry NF4/FP4 table, float32, one copy per weight.

bitsandbytes LLM.int8 (``Int8Params``): int8 data ``out x in`` and ``SCB``, one float32 row scale
per output row.

GPTQ / AWQ (packed int32): ``qweight`` ``in*bits/32 x out`` (GPTQ) or ``in x out*bits/32`` (AWQ),
``qzeros`` int32 ``in/group x out*bits/32``, ``scales`` float16 ``in/group x out``, GPTQ's
``g_idx`` int32 ``in``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import UserError
from ..workload import DTYPE_SHORT, DTYPES, QUANTS

DTYPE_BYTES = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int8": 1, "uint8": 1, "int32": 4, "int64": 8, "int16": 2, "bool": 1, "float64": 8,
}
# safetensors header dtype names -> torch names
SAFETENSORS_DTYPES = {
    "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "I8": "int8", "U8": "uint8", "I32": "int32", "I64": "int64",
    "I16": "int16", "BOOL": "bool", "F64": "float64",
}

BNB_BLOCKSIZE_4BIT = 64
BNB_NESTED_BLOCKSIZE = 256
BNB_CODE_ENTRIES_4BIT = 16
BNB_CODE_ENTRIES_NESTED = 256

_DTYPE_QUANTS = {q: DTYPES[q] for q in ("bf16", "fp16", "fp32")}  # --quant names that are plain dtypes


@dataclass(frozen=True)
class QuantSpec:
    """What the user asked for, resolved against the checkpoint.

    ``method`` is ``none`` (plain ``dtype``), ``bnb4``, ``bnb8``, a pre-quantized checkpoint's own
    ``quant_method`` kept as stored (``gptq``, ``awq``, ``fp8``, ``mxfp4``, ``compressed-tensors``, ...: one
    entry each in :mod:`vramcal.estimator.formats`), or ``dequantized`` (such a checkpoint dequantized to
    ``dtype`` at load, as transformers does on a GPU that cannot run the format, or for ``--quant bf16``).
    """

    name: str
    method: str
    dtype: str  # dtype of every tensor that is not quantized
    quant_type: str | None = None  # nf4 / fp4 for bnb4
    double_quant: bool = False
    bits: int | None = None
    group_size: int | None = None
    pre_quantized: bool = False
    implementation: str = "torch"
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def key(self) -> str:
        return f"{self.name}|{self.method}|{self.dtype}|{self.quant_type}|{self.double_quant}|{self.bits}|{self.group_size}"

    def bnb_config_kwargs(self) -> dict | None:
        """Keyword arguments of ``transformers.BitsAndBytesConfig`` for this choice, or None. A serialized
        checkpoint's own ``llm_int8_skip_modules`` go with it: they replace the quantizer's default skips
        (and in transformers 5 match module names from the start, ``model.vision_tower`` not ``vision_tower``)."""
        skip = self.extra.get("llm_int8_skip_modules")
        skips = {"llm_int8_skip_modules": list(skip)} if skip is not None else {}
        if self.method == "bnb4":
            return {"load_in_4bit": True, "bnb_4bit_quant_type": self.quant_type,
                    "bnb_4bit_use_double_quant": self.double_quant, "bnb_4bit_compute_dtype": self.dtype, **skips}
        if self.method == "bnb8":
            return {"load_in_8bit": True, **skips}
        return None


def config_dtype(config: dict, stored: str | None = None) -> str:
    """The dtype ``from_pretrained(dtype="auto")`` (transformers 5's default) picks: the config's ``dtype`` /
    ``torch_dtype``; else the checkpoint's first floating tensor that is not fp8 (``stored``,
    :func:`vramcal.estimator.checkpoint.auto_dtype`); else float32, the class default."""
    for key in ("dtype", "torch_dtype"):
        value = config.get(key)
        if value is None and isinstance(config.get("text_config"), dict):
            value = config["text_config"].get(key)
        if isinstance(value, str) and value.removeprefix("torch.") in DTYPE_BYTES:
            return value.removeprefix("torch.")
    if stored in DTYPE_SHORT:
        return stored
    if config.get("quantization_config") and not _is_bnb(config["quantization_config"]):
        # a pre-quantized checkpoint keeps what it leaves unquantized in 16 bits: read from the headers
        # where they are present; without them (a config alone) bf16, what every such checkpoint stores
        return "bfloat16"
    return "float32"  # transformers' default when neither the config nor the checkpoint names one


def _names_dtype(config: dict) -> bool:
    tc = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return any(isinstance(c.get(k), str) for c in (config, tc) for k in ("dtype", "torch_dtype"))


def _is_bnb(qc) -> bool:
    return isinstance(qc, dict) and (qc.get("quant_method") == "bitsandbytes" or bool(qc.get("load_in_4bit"))
                                     or bool(qc.get("load_in_8bit")))


def resolve_quant(name: str, config, dtype: str | None = None, gpu=None) -> QuantSpec:
    """Turn ``--quant`` into a :class:`QuantSpec`. ``auto`` follows the checkpoint's own config; on a
    pre-quantized checkpoint the GPU (``gpu``, a :class:`~vramcal.estimator.formats.GpuTarget`) decides
    whether its format is kept or dequantized at load, and ``--quant bf16`` asks for the dequantized load.
    ``config`` is the config dict, or the :class:`~vramcal.estimator.resolve.ModelSource` (whose headers
    then give the load dtype when the config names none)."""
    stored = None
    if hasattr(config, "config"):
        source, config = config, config.config
        if dtype is None and not _names_dtype(config):
            from .checkpoint import auto_dtype

            stored = auto_dtype(source)  # read only when the config leaves the choice to the checkpoint
    name = (name or "auto").lower()
    if name not in QUANTS:
        raise UserError(f"unknown quant {name!r}: choose one of {', '.join(QUANTS)}")
    if dtype is not None and dtype not in DTYPE_SHORT:
        raise UserError(f"unknown dtype {dtype!r}: choose bfloat16, float16 or float32")
    base = dtype or config_dtype(config, stored)
    qc = config.get("quantization_config")
    if base not in DTYPE_SHORT and not qc and name in ("auto", "int8", "nf4", "nf4-dq", "fp4", "fp4-dq"):
        raise UserError(f"the config's dtype is {base} and it has no quantization_config: transformers loads no model "
                        "in that dtype as such; give --dtype bf16 (or fp16, fp32), or the checkpoint's own config")
    if qc:
        from .formats import NO_GPU, format_for

        fmt = format_for(qc)
        if fmt.label != "bitsandbytes":
            if name not in ("auto", *_DTYPE_QUANTS):
                raise UserError(f"the checkpoint is already quantized ({fmt.label}): --quant {name} would quantize it "
                                f"again, which transformers does not do; use --quant auto, or bf16 for the "
                                "dequantized load where the format has one")
            return _pre_quantized(qc, fmt, base if name == "auto" else _DTYPE_QUANTS[name], gpu or NO_GPU,
                                  dequantize=name != "auto")
        if name != "auto":
            raise UserError(f"the checkpoint is already quantized (bitsandbytes): it loads only as stored, "
                            "use --quant auto")
    if name in _DTYPE_QUANTS:
        return QuantSpec(name=name, method="none", dtype=_DTYPE_QUANTS[name])
    if name == "int8":
        return QuantSpec(name=name, method="bnb8", dtype=base,
                         bits=8, implementation="bitsandbytes LLM.int8")
    if name in ("nf4", "nf4-dq", "fp4", "fp4-dq"):
        qt = name.split("-")[0]
        return QuantSpec(name=name, method="bnb4", dtype=base, quant_type=qt, double_quant=name.endswith("-dq"),
                         bits=4, implementation=f"bitsandbytes 4-bit {qt.upper()}"
                         + (" + double quant" if name.endswith("-dq") else ""))
    if not qc:
        return QuantSpec(name=DTYPE_SHORT.get(base, base),
                         method="none", dtype=base)
    return _bnb_serialized(qc, base)


def _bnb_serialized(qc: dict, base: str) -> QuantSpec:
    skip = qc.get("llm_int8_skip_modules")
    extra = {"llm_int8_skip_modules": [str(s) for s in skip]} if isinstance(skip, list) else {}
    if qc.get("load_in_8bit"):
        return QuantSpec(name="int8", method="bnb8", dtype=base, bits=8, pre_quantized=True,
                         implementation="bitsandbytes LLM.int8 (serialized)", extra=extra)
    qt = qc.get("bnb_4bit_quant_type", "fp4")
    dq = bool(qc.get("bnb_4bit_use_double_quant", False))
    return QuantSpec(name=qt + ("-dq" if dq else ""), method="bnb4", dtype=base, quant_type=qt, double_quant=dq,
                     bits=4, pre_quantized=True, implementation=f"bitsandbytes 4-bit {qt.upper()} (serialized)",
                     extra=extra)


def _pre_quantized(qc: dict, fmt, base: str, gpu, dequantize: bool) -> QuantSpec:
    """A checkpoint stored in ``fmt``: kept as stored or dequantized to ``base``, as ``gpu`` loads it."""
    method = str(qc.get("quant_method")).lower()
    path = fmt.path(qc, gpu, dequantize)
    extra = {"quantization_config": qc, "path": path.why, "gpu": gpu.describe(),
             "capability": gpu.compute_capability}
    if not path.kept:
        return QuantSpec(name=f"{method}-dequantized", method="dequantized", dtype=base, pre_quantized=True,
                         implementation=f"{fmt.label} dequantized to {base} at load", extra=extra)
    if method in ("gptq", "awq"):
        bits = int(qc.get("bits", qc.get("w_bit")))
        group = int(qc.get("group_size", qc.get("q_group_size")))
        return QuantSpec(name=f"{method}-{bits}bit", method=method, dtype="float16", bits=bits, group_size=group,
                         pre_quantized=True, implementation=method.upper(),
                         extra={**extra, "desc_act": qc.get("desc_act")})
    block = qc.get("weight_block_size")
    base = fmt.load_dtype or base  # the quantizer's update_dtype overrides the config's dtype (fbgemm_fp8: bf16)
    return QuantSpec(name=method, method=method, dtype=base, bits=8 if "fp8" in method else None, pre_quantized=True,
                     implementation=f"{fmt.label} (block {block[0]}x{block[1]})" if block else fmt.label,
                     extra={**extra, "weight_block_size": block})


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def bnb4_tensors(n: int, double_quant: bool, blocksize: int = BNB_BLOCKSIZE_4BIT) -> list[tuple[str, int]]:
    """(suffix, bytes) of every tensor bitsandbytes keeps for one 4-bit weight of ``n`` elements."""
    blocks = ceil_div(n, blocksize)
    out = [("weight", ceil_div(n, 2)), ("code", BNB_CODE_ENTRIES_4BIT * 4)]
    if double_quant:
        out += [("absmax", blocks), ("state2.absmax", ceil_div(blocks, BNB_NESTED_BLOCKSIZE) * 4),
                ("state2.code", BNB_CODE_ENTRIES_NESTED * 4), ("offset", 4)]
    else:
        out += [("absmax", blocks * 4)]
    return out


def bnb8_tensors(out_features: int, in_features: int) -> list[tuple[str, int]]:
    """(suffix, bytes) of an LLM.int8 weight: int8 data (``CB`` shares its storage) and ``SCB``."""
    return [("weight", out_features * in_features), ("SCB", out_features * 4)]


def packed_int_tensors(method: str, out_features: int, in_features: int, bits: int, group: int) -> list[tuple[str, int]]:
    """(suffix, bytes) of a GPTQ or AWQ linear layer (the int32-packed layout of their kernels)."""
    group = in_features if group in (-1, 0) else group
    groups = ceil_div(in_features, group)
    per_int = 32 // bits
    scales = groups * out_features * 2
    if method == "gptq":
        return [("qweight", ceil_div(in_features, per_int) * out_features * 4),
                ("qzeros", groups * ceil_div(out_features, per_int) * 4), ("scales", scales), ("g_idx", in_features * 4)]
    return [("qweight", in_features * ceil_div(out_features, per_int) * 4),
            ("qzeros", groups * ceil_div(out_features, per_int) * 4), ("scales", scales)]
