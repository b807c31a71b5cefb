"""A GGUF file's header, read with the ``gguf`` package (llama.cpp's own ``gguf-py``): the metadata and
every tensor's name, type, shape, bytes as stored and offset in the file. The tensor data are never read
(the reader maps the file; only the header pages are touched).

Inputs: a ``.gguf`` file; the first (or any) part of a split GGUF, ``NAME-00001-of-0000N.gguf``, whose
parts are read together as llama.cpp loads them (``split.count`` in the first); a Hugging Face cache id
``owner/repo`` holding one GGUF, or ``owner/repo/FILE.gguf`` (the cache only, never the network).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import UserError

SPLIT = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class GgufTensor:
    name: str
    type_name: str  # ggml's name: F16, Q4_K, IQ4_XS ...
    type_id: int
    shape: tuple[int, ...]  # ggml order: ne0 (the row) first
    nbytes: int  # as stored: rows x blocks x the type's block bytes
    file_index: int  # which part of a split GGUF
    offset: int  # from the start of that part's file

    @property
    def layer(self) -> int | None:
        m = re.match(r"blk\.(\d+)\.", self.name)
        return int(m.group(1)) if m else None


@dataclass(frozen=True)
class GgufModel:
    path: str  # the first part
    files: tuple[str, ...]
    file_bytes: tuple[int, ...]
    arch: str
    metadata: dict = field(hash=False)  # scalar and short-array fields; tokenizer arrays by length only
    tensors: tuple[GgufTensor, ...] = field(hash=False, default=())

    def get(self, key: str, default=None):
        """``{arch}.key`` for a key starting with ``.``, else the key itself."""
        return self.metadata.get(f"{self.arch}{key}" if key.startswith(".") else key, default)

    @property
    def name(self) -> str:
        return str(self.metadata.get("general.name") or Path(self.path).name)

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def _parts(path: Path) -> list[Path]:
    m = SPLIT.match(path.name)
    if not m:
        return [path]
    count = int(m.group("count"))
    parts = [path.with_name(f"{m.group('prefix')}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise UserError(f"{path.name} is part of a split GGUF of {count} files; {', '.join(missing[:3])} "
                        f"{'is' if len(missing) == 1 else 'are'} not beside it: download every part")
    return parts


def locate(spec: str) -> Path:
    """The GGUF file ``spec`` names: a path, or a Hub id in the local Hugging Face cache."""
    p = Path(spec).expanduser()
    if p.is_dir():
        ggufs = sorted(q for q in p.glob("*.gguf") if not SPLIT.match(q.name) or SPLIT.match(q.name)["no"] == "00001")
        ggufs = [q for q in ggufs if "mmproj" not in q.name.lower()]
        if len(ggufs) == 1:
            return ggufs[0]
        if not ggufs:
            raise UserError(f"{spec} is a directory with no .gguf file: give the GGUF file itself")
        raise UserError(f"{spec} is a directory with {len(ggufs)} GGUF files ({', '.join(q.name for q in ggufs[:4])}"
                        f"{' ...' if len(ggufs) > 4 else ''}): give one of them")
    if p.is_file():
        return p
    if spec.count("/") >= 1 and not spec.startswith((".", "/", "~")):
        parts = spec.split("/")
        snap = _cached_snapshot("/".join(parts[:2]))
        if snap is not None:
            return locate(str(snap / "/".join(parts[2:])) if len(parts) > 2 else str(snap))
    raise UserError(f"no GGUF file {spec!r}: give a .gguf path, a split GGUF's first part, or a Hub id in the "
                    "local Hugging Face cache (owner/repo or owner/repo/FILE.gguf)")


def _cached_snapshot(repo_id: str) -> Path | None:
    """The local snapshot of a Hub repository, from the Hugging Face cache only (huggingface_hub finds it;
    a GGUF repository has no config.json, so :func:`..resolve.hf_snapshot` does not apply)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError, ValueError):
        return None


def _scalar(field_):
    """A reader field's value: scalars and strings as Python values, arrays as lists (short ones) or their
    length (the tokenizer's vocabulary: only its size matters here)."""
    from gguf import GGUFValueType

    kind = field_.types[0] if field_.types else None
    if kind == GGUFValueType.ARRAY:
        n = len(field_.data)
        if n > 4096:
            return ("array", n)
        sub = field_.types[1] if len(field_.types) > 1 else None
        if sub == GGUFValueType.STRING:
            return [bytes(field_.parts[i]).decode("utf-8", "replace") for i in field_.data]
        return [field_.parts[i].tolist()[0] for i in field_.data]
    if kind == GGUFValueType.STRING:
        return bytes(field_.parts[field_.data[0]]).decode("utf-8", "replace")
    return field_.parts[field_.data[0]].tolist()[0]


def read_gguf(spec: str) -> GgufModel:
    """The header of the GGUF ``spec`` names (every part of a split one). Bad input is one line."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

    first = locate(spec)
    paths = _parts(first)
    metadata: dict = {}
    tensors: list[GgufTensor] = []
    for idx, path in enumerate(paths):
        with open(path, "rb") as fh:
            magic = fh.read(4)
        if magic != GGUF_MAGIC:
            raise UserError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF'): give a .gguf model "
                            "file (a safetensors checkpoint goes without --engine llama.cpp)")
        try:
            reader = GGUFReader(str(path), "r")
        except (ValueError, IndexError, KeyError, OverflowError, MemoryError) as exc:
            raise UserError(f"{path} is truncated or damaged: its GGUF header does not read ({type(exc).__name__}: "
                            f"{str(exc)[:160]}); download it again, or wait for the download to end") from None
        for name, f in reader.fields.items():
            if name.startswith("GGUF."):
                continue
            if idx == 0 or name.startswith("split."):
                metadata.setdefault(name, _scalar(f))
        size = os.path.getsize(path)
        for t in reader.tensors:
            type_id = int(t.tensor_type)
            block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
            shape = tuple(int(x) for x in t.shape)
            rows = 1
            for d in shape[1:]:
                rows *= d
            nbytes = rows * (shape[0] // block) * type_bytes
            offset = int(t.data_offset)
            if offset + nbytes > size:
                raise UserError(f"{path} is truncated: tensor {t.name} ends at byte {offset + nbytes:,}, the file has "
                                f"{size:,} (still downloading?)")
            tensors.append(GgufTensor(t.name, GGMLQuantizationType(type_id).name, type_id, shape, nbytes, idx, offset))
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise UserError(f"{first} has no general.architecture: not a llama.cpp model file")
    count = metadata.get("split.count")
    if isinstance(count, int) and count > 1 and len(paths) != count:
        raise UserError(f"{first.name} says it is one of {count} parts (split.count) but is not named "
                        "NAME-00001-of-0000N.gguf: keep llama-gguf-split's names")
    return GgufModel(path=str(first), files=tuple(str(p) for p in paths),
                     file_bytes=tuple(os.path.getsize(p) for p in paths), arch=arch, metadata=metadata,
                     tensors=tuple(tensors))
