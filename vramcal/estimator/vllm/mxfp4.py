"""gpt-oss's MXFP4 MoE experts under vLLM: which kernel backend holds them, and what it keeps per expert.

vLLM picks the backend when it builds the experts (``layers/quantization/mxfp4.py``: ``get_mxfp4_backend``
up to 0.15, ``layers/fused_moe/oracle/mxfp4.py`` from 0.19) and pads the expert widths for it in
``create_weights`` (``mxfp4_round_up_hidden_size_and_intermediate_size`` from 0.19). On CUDA:

==========  =========================================================================================
backend     what one rank keeps for the experts (read in 0.10.1.1, 0.10.2, 0.11.0, 0.13.0, 0.14.1,
            0.15.1, 0.19.1, 0.33.0)
==========  =========================================================================================
``triton``  OpenAI's ``triton_kernels`` (Hopper and Blackwell): the intermediate size per rank padded
            to a multiple of 64, the hidden size as it is; packed FP4 and one uint8 E8M0 scale per 32
            values; ``process_weights_after_loading`` swizzles weights and scales into new tensors and
            deletes the old weights but keeps ``w13_weight_scale`` / ``w2_weight_scale`` registered
            beside the swizzled copies held by ``PrecisionConfig``: the scales are held twice; biases
            float32
``marlin``  the Marlin MoE kernel (outside SM90/SM100, or when ``triton_kernels`` is missing): intermediate
            padded to 128, hidden to 256 (``n % 256 == 0 and k % 128 == 0``); ``prepare_moe_fp4_layer_
            for_marlin`` repacks weights and scales in place of the old ones (one copy); biases in the
            model dtype (``utils/marlin_utils_fp4.py``)
==========  =========================================================================================

Which one a machine takes depends on what is installed there (``has_triton_kernels()`` and torch >= 2.8,
``VLLM_MXFP4_USE_MARLIN``), so ``--mxfp4-backend`` says it; without it: Marlin on a GPU whose compute
capability (vramcal's table of GPUs, or NVML's reading of this machine's) is outside SM90 / SM100 (9.x, 10.x),
and on any GPU before 0.13 (0.10.1 pins torch 2.7.1, where Hopper takes Marlin; 0.10.2-0.12 need
``triton_kernels`` installed separately), Triton from 0.13 (the wheel bundles ``vllm/third_party/
triton_kernels``). FlashInfer's MXFP4 MoE (Blackwell, or ``VLLM_USE_FLASHINFER_MOE_MXFP4_BF16`` on
Hopper) and ROCm are not modelled. Pure arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import UserError

MXFP4_BLOCK = 32
BACKENDS = ("triton", "marlin")
# the compute capabilities where triton_kernels runs, 9.x and 10.x ("only confirmed to work on SM90 and SM100",
# 0.13.0): a GPU outside them (Ampere, Ada, SM120 such as the RTX 5090) takes Marlin
TRITON_CAPABILITIES = ((9, 0), (11, 0))  # from, up to (not including)


@dataclass(frozen=True)
class Mxfp4Backend:
    name: str
    intermediate_pad: int
    hidden_pad: int
    scale_copies: int
    bias_float32: bool  # else the model dtype
    why: str

    def padded(self, hidden: int, intermediate_per_rank: int) -> tuple[int, int]:
        return _round_up(hidden, self.hidden_pad), _round_up(intermediate_per_rank, self.intermediate_pad)

    def weight_bytes(self, rows: int, cols: int) -> int:
        """One expert's ``rows x cols`` weight: packed FP4 and its E8M0 scales (as many copies as held)."""
        n = rows * cols
        return n // 2 + self.scale_copies * (n // MXFP4_BLOCK)

    def bias_bytes(self, n: int, el: int) -> int:
        return n * (4 if self.bias_float32 else el)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _marlin_gpu(gpu_name: str | None, capability: tuple[int, int] | None) -> bool:
    """Whether the GPU is one triton_kernels does not run on, by its compute ``capability``. Not known (None): a
    GPU named but not in vramcal's table of GPUs is taken for one outside SM90 / SM100, as a name outside the
    listed Hopper / Blackwell parts was before the table decided (the table carries those parts, so an unknown
    name is most likely another kind); with no GPU named the version decides (:func:`backend`)."""
    if capability is None:
        return bool(gpu_name)
    lo, hi = TRITON_CAPABILITIES
    return not lo <= tuple(capability) < hi


def backend(v: tuple[int, int, int], gpu_name: str | None, capability: tuple[int, int] | None,
            asked: str | None) -> Mxfp4Backend:
    """The backend for ``--mxfp4-backend`` (``asked``), else the default for this version and the GPU's compute
    ``capability`` (vramcal's table of GPUs for a named one, NVML for this machine's)."""
    if asked is not None and asked not in BACKENDS:
        raise UserError(f"unknown --mxfp4-backend {asked!r}: choose triton or marlin (vLLM's log says "
                        "\"Using Triton backend\" or \"... leveraging the Marlin kernel\")")
    if asked is None:
        if _marlin_gpu(gpu_name, capability):
            cc = "compute capability not known" if capability is None else f"SM {capability[0]}.{capability[1]}"
            asked, why = "marlin", (f"{gpu_name or 'the GPU'} ({cc}) is not SM90/SM100, where triton_kernels runs: "
                                    "vLLM's Marlin MoE kernel")
        elif v < (0, 13, 0):
            asked, why = "marlin", ("before 0.13 the wheel has no triton_kernels (0.10.1 pins torch 2.7.1): "
                                    "Marlin unless triton_kernels is installed (--mxfp4-backend triton)")
        else:
            asked, why = "triton", ("from 0.13 the wheel bundles triton_kernels, which SM90/SM100 GPUs take "
                                    "(--mxfp4-backend marlin if the log says Marlin)")
    else:
        why = "--mxfp4-backend"
    if asked == "marlin":
        return Mxfp4Backend("marlin", 128, 256, 1, False, why)
    return Mxfp4Backend("triton", 64, 1, 2, True, why)
