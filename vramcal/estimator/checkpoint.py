"""A checkpoint's safetensors files, read through the ``safetensors`` library: which tensors, of which
dtype and shape, without reading a tensor's data.

A file an interrupted download leaves behind -- empty, short, with a garbled header, a folder named
``*.safetensors``, or shorter than its header's offsets -- is refused in one line that says which
file and what to do (:class:`~vramcal.errors.UserError`, exit 2), never taken for a smaller model.
"""

from __future__ import annotations

import math
import os
import stat
from dataclasses import dataclass
from functools import lru_cache

from ..errors import UserError
from .quant import DTYPE_BYTES, SAFETENSORS_DTYPES

Header = dict[str, tuple[str, tuple[int, ...]]]  # tensor name -> (torch dtype name, shape)


def read_header(path: str) -> Header:
    """{tensor name: (torch dtype name, shape)} of one safetensors file; one-line UserError for a file
    that is not a complete safetensors file."""
    _regular(path)
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="numpy") as fh:
            out = {}
            for name in fh.keys():
                sl = fh.get_slice(name)
                dtype = sl.get_dtype()
                out[name] = (SAFETENSORS_DTYPES.get(dtype, dtype.lower()), tuple(int(d) for d in sl.get_shape()))
            return out
    except SafetensorError as exc:
        raise UserError(f"{path} is not a complete safetensors file ({_first_line(exc)}): an interrupted download? "
                        "download it again") from None
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None


def _regular(path: str) -> None:
    try:
        st = os.stat(path)
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise UserError(f"{path} is not a regular file (a folder, a pipe or a device): a safetensors checkpoint "
                        "is a file; remove it or download it again")


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:200] or type(exc).__name__


def checkpoint_tensors(files: tuple[str, ...]) -> Header:
    """Every tensor of a sharded checkpoint (later shards win a name, as the loader's last write does)."""
    merged: Header = {}
    for f in files:
        merged.update(read_header(f))
    return merged


def tensor_bytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * DTYPE_BYTES.get(dtype, 2)


@dataclass(frozen=True)
class StoredLayout:
    dtype: str | None  # the floating dtype holding most of the checkpoint's elements; None without files
    fused_experts: bool  # MoE expert weights stored as 3-D tensors (else one 2-D tensor per expert)


def stored_layout(source) -> StoredLayout:
    """How the checkpoint stores its tensors (no tensor is read). A source without files (a catalog
    config, a synthetic probe) is stored as the config says, per expert (how the Hub's MoE checkpoints
    and transformers' own save_pretrained write them)."""
    if not source.weight_files:
        return StoredLayout(None, False)
    return _stored_layout(tuple(source.weight_files))


@lru_cache(maxsize=8)
def _stored_layout(files: tuple[str, ...]) -> StoredLayout:
    """Read once per process: ``fit`` and ``sweep`` ask at every point of their search."""
    elements: dict[str, int] = {}
    fused = False
    for name, (dtype, shape) in checkpoint_tensors(files).items():
        if dtype.startswith(("float", "bfloat")):
            elements[dtype] = elements.get(dtype, 0) + math.prod(shape)
        fused = fused or ("expert" in name and len(shape) == 3)
    return StoredLayout(max(elements, key=elements.get) if elements else None, fused)


def auto_dtype(source) -> str | None:
    """What ``from_pretrained(dtype="auto")`` reads from the checkpoint when the config names no dtype: the
    first floating tensor of the first file that is not fp8 (transformers' ``get_state_dict_dtype``); None
    without files."""
    if not source.weight_files:
        return None
    header = read_header(sorted(source.weight_files)[0])
    floats = [dt for _, (dt, _) in sorted(header.items()) if dt.startswith(("float", "bfloat")) and not dt.startswith("float8")]
    return floats[0] if floats else None
