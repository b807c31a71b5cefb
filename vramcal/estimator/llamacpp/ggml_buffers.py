"""ggml's buffer types as vramcal prices them: each backend's alignment, the CUDA backend's padding of quantized
rows, and a ggml type's block and row sizes (from the ``gguf`` package's table). The one home of these rules
for the text model's buffers, the compute replay and the multimodal projector."""

from __future__ import annotations

from ...errors import UserError

CPU_ALIGN = 32  # ggml-impl.h TENSOR_ALIGNMENT: the CPU buffer type's alignment
CUDA_ALIGN = 128  # ggml-cuda.cu: the CUDA buffer type's alignment
MATRIX_ROW_PADDING = 512  # ggml-cuda/common.cuh: quantized rows padded to this many values on CUDA


def type_info(name: str) -> tuple[int, int]:
    """(values per block, bytes per block) of a ggml type by its name (F16, Q4_K, q8_0 ...)."""
    from .gguf_file import ggml_types

    t = ggml_types()
    try:
        return t.GGML_QUANT_SIZES[t.GGMLQuantizationType[name.upper()]]
    except KeyError:
        raise UserError(f"unknown ggml type {name!r}: not one the installed gguf package knows (a GGUF of a newer "
                        "llama.cpp? upgrade gguf)") from None


def row_size(type_name: str, n: int) -> int:
    """``ggml_row_size``: bytes of ``n`` values of a type (n a multiple of its block)."""
    block, size = type_info(type_name)
    return n // block * size


def pad(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def cuda_alloc(t) -> int:
    """ggml-cuda ``get_alloc_size`` of a tensor (a :class:`~.gguf_file.GgufTensor`): a quantized row padded to
    512 values, then the 128-byte alignment."""
    size = t.nbytes
    block, _ = type_info(t.type_name)
    if block > 1 and t.shape[0] % MATRIX_ROW_PADDING:
        size += row_size(t.type_name, MATRIX_ROW_PADDING - t.shape[0] % MATRIX_ROW_PADDING)
    return pad(size, CUDA_ALIGN)
