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
                out[name] = (torch_dtype(sl.get_dtype()), tuple(int(d) for d in sl.get_shape()))
            return out
    except SafetensorError as exc:
        raise UserError(f"{path} is not a complete safetensors file ({_first_line(exc)}): an interrupted download? "
                        "download it again") from None
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None


def torch_dtype(stored: str) -> str:
    """The torch name of a safetensors dtype ("BF16" -> "bfloat16"), for local files and Hub headers alike."""
    return SAFETENSORS_DTYPES.get(stored, stored.lower())


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


def has_checkpoint(source) -> bool:
    """Whether the model's stored tensors are known: safetensors files here, or their headers read from
    the Hub (:mod:`vramcal.estimator.hub`)."""
    return bool(source.weight_files or source.weight_headers)


def checkpoint_names(source) -> list[str]:
    """The checkpoint's file names (not paths): the same for a folder and for its Hub repository."""
    return sorted(source.weight_headers) if source.weight_headers else [os.path.basename(f) for f in source.weight_files]


def source_tensors(source) -> Header:
    """Every tensor of the model's checkpoint, from its files or from the headers read from the Hub, merged
    in the same order (by file name; later files win a name, as the loader's last write does)."""
    if source.weight_headers:
        merged: Header = {}
        for name in sorted(source.weight_headers):
            merged.update(source.weight_headers[name])
        return merged
    return checkpoint_tensors(source.weight_files)


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
    if source.weight_headers:
        return _layout(source_tensors(source))
    if not source.weight_files:
        return StoredLayout(None, False)
    return _stored_layout(tuple(source.weight_files))


@lru_cache(maxsize=8)
def _stored_layout(files: tuple[str, ...]) -> StoredLayout:
    """Read once per process: ``fit`` and ``sweep`` ask at every point of their search."""
    return _layout(checkpoint_tensors(files))


def _layout(tensors: Header) -> StoredLayout:
    elements: dict[str, int] = {}
    fused = False
    for name, (dtype, shape) in tensors.items():
        if dtype.startswith(("float", "bfloat")):
            elements[dtype] = elements.get(dtype, 0) + math.prod(shape)
        fused = fused or ("expert" in name and len(shape) == 3)
    return StoredLayout(max(elements, key=elements.get) if elements else None, fused)


def auto_dtype(source) -> str | None:
    """What ``from_pretrained(dtype="auto")`` reads from the checkpoint when the config names no dtype: the
    first floating tensor of the first file that is not fp8 (transformers' ``get_state_dict_dtype``), from the
    files or from the headers read from the Hub; None without either."""
    if source.weight_headers:  # read from the Hub: the same first file by name
        header = source.weight_headers[sorted(source.weight_headers)[0]]
    elif source.weight_files:
        header = read_header(sorted(source.weight_files)[0])
    else:
        return None
    floats = [dt for _, (dt, _) in sorted(header.items()) if dt.startswith(("float", "bfloat")) and not dt.startswith("float8")]
    return floats[0] if floats else None
