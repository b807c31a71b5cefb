"""Pre-quantized checkpoint formats, one entry each: how the installed transformers loads a checkpoint of
that ``quant_method`` on a given GPU.

An entry answers three questions, the way transformers' own quantizer for the method does
(``transformers/quantizers/quantizer_*.py``):

- **which path** the GPU takes (:meth:`Format.path`): the format kept as stored, or dequantized to 16 bits
  at load. FP8 (``fp8``, compressed-tensors' fp8 kernels) is kept from compute capability 8.9 (Ada, Hopper,
  Blackwell) and dequantized to bf16 below (A100, RTX 3090: ``FineGrainedFP8HfQuantizer.validate_environment``);
  MXFP4 is kept from 7.5 where its Triton kernels load (``Mxfp4HfQuantizer.validate_environment``) and
  dequantized otherwise; ``--quant bf16`` asks for transformers' ``dequantize=True``.
- **which modules** it replaces, by running the quantizer's own ``preprocess_model`` on the meta model
  (:mod:`vramcal.estimator.meta`), so ``modules_to_not_convert``, ``ignore`` lists and fused experts are
  what this transformers does;
- **what each replaced tensor stores** beside what the module declares (:meth:`Format.state_tensors`: MXFP4's
  scales live outside the module's parameters).

Nothing here imports torch at module import. A ``quant_method`` transformers knows but vramcal does not model
yet is one line naming it, never a formula.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError


@dataclass(frozen=True)
class GpuTarget:
    """The GPU an estimate is for, as far as the format's path depends on it."""

    name: str | None
    compute_capability: tuple[int, int] | None
    architecture: str | None
    source: str  # vramcal's table of GPUs | this machine (NVML) | none named | the CPU
    is_cpu: bool = False  # the model runs on the CPU (--device cpu): no GPU kernels at all
    # this machine's GPU: its driver's reserve as read here (a capacity.DriverReserve); None: by the name's
    # table row (vramcal.estimator.capacity.reserve_for)
    driver_reserve: object | None = None

    def describe(self) -> str:
        if self.is_cpu:
            return "the CPU"
        if self.compute_capability is None:
            return self.name or "no GPU named"
        major, minor = self.compute_capability
        return f"{self.name or 'the GPU'} (compute capability {major}.{minor}, {self.source})"


NO_GPU = GpuTarget(None, None, None, "none named")
CPU = GpuTarget(None, None, None, "the CPU", is_cpu=True)


@dataclass(frozen=True)
class LoadPath:
    kept: bool  # the format stays as stored; False: dequantized to the load dtype at load
    why: str


class Format:
    """One ``quant_method``. Subclasses say when the format is kept and what it stores."""

    methods: tuple[str, ...] = ()
    label = ""
    kept_from: tuple[int, int] | None = None  # the compute capability from which the format is kept
    can_dequantize = False  # transformers has a dequantize=True load for it
    config_class = ""  # transformers' config class of the format (the dequantized load passes it)
    load_dtype: str | None = None  # the one dtype the quantizer's update_dtype loads the rest in (None: the config's)

    def check(self, qc: dict) -> None:
        """Refuse a contradictory quantization_config in one line (UserError)."""

    def path(self, qc: dict, target: GpuTarget, dequantize: bool) -> LoadPath:
        if dequantize:
            if not self.can_dequantize:
                raise UserError(f"a {self.label} checkpoint loads only as stored: transformers has no dequantized "
                                "load for it; use --quant auto")
            return LoadPath(False, "--quant asks for transformers' dequantize=True load")
        if self.kept_from is None:
            return LoadPath(True, f"{self.label} loads as stored on every GPU")
        if target.is_cpu:
            if not self.can_dequantize:
                raise UserError(f"{self.label} checkpoints load on a GPU only (transformers has no CPU path for them): "
                                "use a cuda device")
            return LoadPath(False, f"on the CPU transformers dequantizes {self.label} to bf16 at load (no GPU kernels)")
        cc = target.compute_capability
        need = ".".join(map(str, self.kept_from))
        if cc is None:
            return LoadPath(True, f"no GPU named: priced as stored, as on a GPU of compute capability >= {need}; "
                                  "give --gpu NAME for the path a given GPU takes")
        if tuple(cc) >= self.kept_from:
            return LoadPath(True, f"{target.describe()} is at or above {need}: kept as stored")
        if not self.can_dequantize:
            raise UserError(f"{target.describe()} cannot run {self.label} (it needs compute capability >= {need}) "
                            "and transformers has no dequantized load for it: choose another GPU or checkpoint")
        return LoadPath(False, f"{target.describe()} is below {need}: transformers dequantizes to bf16 at load")

    def quantization_config(self, qc: dict, kept: bool):
        """transformers' quantization config object for this checkpoint, set to the path taken."""
        from transformers.quantizers.auto import AutoQuantizationConfig

        try:
            cfg = AutoQuantizationConfig.from_dict(dict(qc))
        except (ValueError, TypeError, KeyError) as exc:
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(f"transformers rejects this {self.label} quantization_config ({text[:160]}): "
                            "fix the config.json") from None
        if not kept and hasattr(cfg, "dequantize"):
            cfg.dequantize = True
        return cfg

    def prepare(self, hf_quantizer, capability: tuple[int, int] | None) -> None:
        """Set on the quantizer what its validate_environment would set for the target GPU of compute
        ``capability`` (validate_environment reads this process's GPU, not the one the estimate is for)."""

    def replacement_patches(self):
        """Context managers the meta replacement runs under (none by default)."""
        return ()

    def state_tensors(self, module, pname: str, param) -> list[tuple[str, int]]:
        """(suffix, bytes) a loaded module keeps for ``param`` outside its declared parameters."""
        return []

    def first_forward(self, model, hf_quantizer) -> list[tuple[list[int], list[int]]]:
        """What the loaded model's first forward changes in its weights, module by module in the order it
        goes: (bytes of each tensor it allocates, bytes of each stored tensor it drops). Empty: the format
        runs as loaded."""
        return []


class FineGrainedFP8(Format):
    methods = ("fp8", "mxfp8")
    label = "fp8"
    config_class = "FineGrainedFP8Config"
    kept_from = (8, 9)
    can_dequantize = True

    def check(self, qc: dict) -> None:
        block = qc.get("weight_block_size")
        if block is not None and (not isinstance(block, (list, tuple)) or len(block) != 2
                                  or not all(isinstance(b, int) and b > 0 for b in block)):
            raise UserError(f"fp8 quantization_config: weight_block_size {block!r} is not two positive integers "
                            "(e.g. [128, 128]): fix the config.json")


class FbgemmFP8(Format):
    """Meta's FBGEMM fp8 (``FbgemmFp8HfQuantizer``, e.g. Llama-3.1-405B-FP8): every Linear but
    ``modules_to_not_convert`` becomes ``FbgemmFp8Linear`` (fp8 ``weight`` [out, in], float32 ``weight_scale``
    [out, 1], a non-persistent float32 ``input_scale_ub``); Llama 4's fused experts become
    ``FbgemmFp8Llama4TextExperts`` (fp8 projections, float32 scales per output column). Kept from compute
    capability 9.0 (``validate_environment``); the config has no ``dequantize``, so below 9.0 and on the CPU
    it is refused. ``update_dtype`` loads everything else in bfloat16 whatever the config says."""

    methods = ("fbgemm_fp8",)
    label = "fbgemm_fp8"
    config_class = "FbgemmFp8Config"
    kept_from = (9, 0)
    load_dtype = "bfloat16"

    def replacement_patches(self):
        # replace_with_fbgemm_fp8_linear looks up fbgemm-gpu's quantize_fp8_per_row op (a CUDA library not
        # installed here) before it builds the modules; building them on meta calls no op, so the lookup is
        # answered with a placeholder while it runs, and the module global it sets is put back after
        from unittest import mock

        import transformers.integrations.fbgemm_fp8 as fbgemm

        return (mock.patch.object(fbgemm, "get_quantize_fp8_per_row", lambda: None),
                mock.patch.object(fbgemm, "quantize_fp8_per_row", None, create=True))


class MXFP4(Format):
    methods = ("mxfp4",)
    label = "mxfp4"
    config_class = "Mxfp4Config"
    kept_from = (7, 5)
    can_dequantize = True

    def replacement_patches(self):
        # replace_with_mxfp4_linear fetches the Triton kernels from the Hub before it builds the modules;
        # building them on meta needs none, so the fetch is answered with a placeholder while it runs
        import contextlib
        from unittest import mock

        import transformers.integrations.hub_kernels as hub_kernels

        return (mock.patch.object(hub_kernels, "get_kernel", lambda *a, **k: object()),) if hasattr(
            hub_kernels, "get_kernel") else (contextlib.nullcontext(),)

    def state_tensors(self, module, pname: str, param) -> list[tuple[str, int]]:
        # Mxfp4GptOssExperts declares the packed blocks (two FP4 codes a byte); their E8M0 scales, one byte
        # per 32 values, are loaded beside them (``{proj}_scales``, 1/16 of the blocks' bytes)
        if type(module).__name__ == "Mxfp4GptOssExperts" and pname in ("gate_up_proj", "down_proj"):
            return [(f"{pname}_scales", param.numel() // 16)]
        return []


class CompressedTensors(Format):
    methods = ("compressed-tensors",)
    label = "compressed-tensors"
    config_class = "CompressedTensorsConfig"
    kept_from = None  # int and fp8 schemes load compressed everywhere; the fp8 kernels need 8.9 (prepare)
    can_dequantize = True

    def check(self, qc: dict) -> None:
        groups = qc.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise UserError("compressed-tensors quantization_config has no config_groups: fix the config.json")

    def prepare(self, hf_quantizer, capability: tuple[int, int] | None) -> None:
        cc = capability
        hf_quantizer.use_fp8_kernel = bool(hf_quantizer.quantization_config.use_optimized_inference
                                           and cc is not None and tuple(cc) >= (8, 9))

    def first_forward(self, model, hf_quantizer) -> list[tuple[list[int], list[int]]]:
        # transformers loads compressed (dequantize=False) by compress_model, which also registers a forward
        # pre-hook that decompresses every quantized module on the first forward and then removes itself
        # (compressed_tensors ModelCompressor.add_decompress_hook / decompress_model): from generate's first
        # step on, the model holds 16-bit weights beside the scales the decompressed modules keep. The
        # library's own per-module decompress, run on the meta tensors without touching the module, says
        # which tensors each module drops and which it allocates. CompressedTensorsFP8Linear (the FP8 kernel
        # path) carries no scheme and is kept as loaded.
        if not hf_quantizer.quantization_config.is_quantization_compressed:
            return []
        import torch
        from compressed_tensors.compressors import BaseCompressor
        from compressed_tensors.compressors.format import infer_module_format
        from compressed_tensors.quantization.utils.helpers import is_module_quantized
        from compressed_tensors.utils import get_direct_state_dict

        def nbytes(t) -> int:
            return t.numel() * t.element_size()

        out = []
        with torch.device("meta"):
            for module in model.modules():
                if not is_module_quantized(module):
                    continue
                scheme = module.quantization_scheme
                fmt = scheme.format or infer_module_format(type(module), scheme)
                before = get_direct_state_dict(module)
                after = BaseCompressor.get_value_from_registry(getattr(fmt, "value", fmt)).decompress(before, scheme)
                kept = {id(t) for t in after.values()}
                new = [nbytes(t) for k, t in after.items() if before.get(k) is not t]
                freed = [nbytes(t) for t in before.values() if id(t) not in kept]
                out.append((new, freed))
        return out


class PackedInt(Format):
    """GPTQ and AWQ: int32-packed weights, zero points and scales (their kernels' layout)."""

    def __init__(self, method: str, bits_allowed: tuple[int, ...]):
        self.methods = (method,)
        self.label = method.upper()
        self.bits_allowed = bits_allowed

    def check(self, qc: dict) -> None:
        bits = qc.get("bits", qc.get("w_bit"))
        group = qc.get("group_size", qc.get("q_group_size"))
        if bits is None or group is None:
            raise UserError(f"{self.label} quantization_config must give bits and group_size "
                            f"(it gives {sorted(k for k in qc if k != 'quant_method')}): fix the config.json")
        if bits not in self.bits_allowed:
            raise UserError(f"{self.label} quantization_config: bits {bits!r} is not one of "
                            f"{', '.join(map(str, self.bits_allowed))}: fix the config.json")
        if not isinstance(group, int) or (group <= 0 and group != -1):
            raise UserError(f"{self.label} quantization_config: group_size {group!r} is not a positive integer "
                            "(or -1 for one group per row): fix the config.json")


class Bitsandbytes(Format):
    methods = ("bitsandbytes",)
    label = "bitsandbytes"


FORMATS: dict[str, Format] = {}
for _entry in (FineGrainedFP8(), FbgemmFP8(), MXFP4(), CompressedTensors(), PackedInt("gptq", (2, 3, 4, 8)),
               PackedInt("awq", (4,)), Bitsandbytes()):
    for _m in _entry.methods:
        FORMATS[_m] = _entry

# quant_methods the meta model is built through transformers' own quantizer (the others are counted by
# their layout formula: GPTQ/AWQ's kernels live in libraries that are not installed here)
REPLACED_ON_META = ("fp8", "mxfp8", "fbgemm_fp8", "mxfp4", "compressed-tensors")


# formats transformers does not load pre-quantized, and why (vLLM does: estimator/vllm/quant.py)
NOT_LOADED_BY_TRANSFORMERS = {
    "nvfp4": "transformers cannot load a pre-quantized NVFP4 checkpoint (NVFP4HfQuantizer refuses it)",
    "modelopt": "transformers has no loader for NVIDIA ModelOpt checkpoints",
}


def format_for(qc: dict) -> Format:
    """The entry of a checkpoint's ``quantization_config``; one line for a method vramcal does not model."""
    if not isinstance(qc, dict):
        raise UserError("the config's quantization_config is not an object: fix the config.json")
    if qc.get("load_in_4bit") or qc.get("load_in_8bit"):
        return FORMATS["bitsandbytes"]
    method = str(qc.get("quant_method") or "").lower()
    if not method:
        raise UserError("the config's quantization_config names no quant_method: fix the config.json")
    entry = FORMATS.get(method)
    if entry is None and method in NOT_LOADED_BY_TRANSFORMERS:
        raise UserError(f"quant_method {method!r}: {NOT_LOADED_BY_TRANSFORMERS[method]}; --engine vllm prices it")
    if entry is None:
        known = _transformers_methods()
        if method in known:
            raise UserError(f"quant_method {method!r}: transformers loads it, but vramcal does not model that format "
                            f"yet (modelled: {', '.join(sorted(FORMATS))})")
        raise UserError(f"quant_method {method!r} is not a format the installed transformers knows: fix the config.json")
    entry.check(qc)
    return entry


def _transformers_methods() -> set[str]:
    try:
        from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING
    except ImportError:
        return set()
    return {m.lower() for m in AUTO_QUANTIZER_MAPPING} | {"bitsandbytes"}
