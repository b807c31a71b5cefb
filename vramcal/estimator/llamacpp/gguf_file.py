"""A GGUF file's header: the metadata and every tensor's name, type, shape, bytes as stored and offset in
the file, by the layout and types of the ``gguf`` package (llama.cpp's own ``gguf-py``: ``GGUFValueType``,
``GGMLQuantizationType``, ``GGML_QUANT_SIZES``). The tensor data are never read (the file is mapped; only
the header pages are touched).

Inputs: a ``.gguf`` file; the first (or any) part of a split GGUF, ``NAME-00001-of-0000N.gguf``, whose
parts are read together as llama.cpp loads them (``split.count`` in the first); a Hugging Face cache id
``owner/repo`` holding one GGUF, or ``owner/repo/FILE.gguf`` (the cache only, never the network).
"""

from __future__ import annotations

import importlib.util
import os
import re
import struct
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from ...errors import UserError

@lru_cache(maxsize=1)
def ggml_types():
    """gguf-py's ``constants`` module (``GGMLQuantizationType``, ``GGML_QUANT_SIZES``, ``GGUFValueType``):
    llama.cpp's own names and block sizes. The package's ``__init__`` also imports its reader, writer and
    lazy tensors, numpy with them, which was over half of a header estimate's time in a fresh process
    (docs/performance.md). The constants need only ``enum``, so unless ``gguf`` is imported already, the
    installed file is loaded by itself under a name of ours (its enums are ``IntEnum``: they equal, hash
    and index as the package's own)."""
    if "gguf" in sys.modules:
        return sys.modules["gguf"].constants
    spec = importlib.util.find_spec("gguf")  # finds the package without running it
    if spec is None or not spec.submodule_search_locations:
        raise UserError("--engine llama.cpp reads GGUF headers with the gguf package (llama.cpp's gguf-py), "
                        "which is not installed here: pip install gguf")
    path = Path(next(iter(spec.submodule_search_locations))) / "constants.py"
    const_spec = importlib.util.spec_from_file_location(f"{__name__}._gguf_constants", path)
    module = importlib.util.module_from_spec(const_spec)
    const_spec.loader.exec_module(module)
    return module


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
    revision: str | None = None  # owner/repo@commit of a GGUF read from the Hub by its header alone
    # a header derived from an HF config and a file type, not read from a file (.from_config.PricedFrom)
    priced_from: object | None = field(default=None, hash=False, compare=False)

    @property
    def spec(self) -> str:
        """How vramcal is given this model again: its path, or ``owner/repo/FILE.gguf`` for a Hub GGUF."""
        return f"{self.revision.split('@')[0]}/{self.path}" if self.revision else self.path

    def server_model_args(self) -> list[str]:
        """How llama-server is given it: ``-m FILE``, or for a Hub GGUF ``-hf REPO --hf-file FILE`` (llama.cpp's
        own download; common/arg.cpp)."""
        return ["-hf", self.revision.split("@")[0], "--hf-file", self.path] if self.revision else ["-m", self.path]

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


def models_in(folder: Path, depth: int = 0) -> list[Path]:
    """The GGUF models of a folder: each file, or a split GGUF's first part, not the multimodal projectors
    (``mmproj``); ``depth`` 1 looks into its sub-folders too (a Hub repository of quantizations often keeps
    a split one in a folder of its own, ``Q8_0/NAME-00001-of-00002.gguf``)."""
    globs = ["*.gguf"] + (["*/*.gguf"] if depth else [])
    found = sorted({q for g in globs for q in folder.glob(g)
                    if q.is_file() and (not SPLIT.match(q.name) or SPLIT.match(q.name)["no"] == "00001")})
    return [q for q in found if not is_projector(q.name)]


def is_projector(name: str) -> bool:
    """A multimodal projector's GGUF (``mmproj-*.gguf``), which a quantization search leaves out."""
    return "mmproj" in Path(name).name.lower()


def gguf_models(spec: str, hub=None) -> list[str]:
    """Every GGUF model ``spec`` names, for a search over quantizations: a folder's (and its sub-folders')
    GGUF files, a cached Hub repository's, a Hub repository's not on this machine (``owner/repo/FILE.gguf``
    each, read later by its header alone; ``hub``: :class:`vramcal.estimator.hub.HubOptions`), or the one
    file. Projectors (``mmproj``) are not models. One line when a folder holds none."""
    p = Path(spec).expanduser()
    folder = p if p.is_dir() else None
    repo = not p.exists() and spec.count("/") == 1 and not spec.startswith((".", "/", "~"))
    if folder is None and repo:
        folder = _cached_snapshot(spec)
        if folder is None:
            from ..hub import HubOptions, gguf_files

            names, _ = gguf_files(spec, hub or HubOptions())
            models = [f"{spec}/{n}" for n in names if not is_projector(n)]
            if not models:
                raise UserError(f"{spec} holds only multimodal projectors (mmproj), no GGUF model")
            return models
    if folder is None:
        return [spec]
    found = models_in(folder, depth=1)
    if not found:
        raise UserError(f"{spec} is a directory with no .gguf file (nor in its sub-folders): give a GGUF file, or "
                        "a folder of them")
    return [str(q) for q in found]


def locate(spec: str) -> Path:
    """The GGUF file ``spec`` names: a path, or a Hub id in the local Hugging Face cache."""
    p = Path(spec).expanduser()
    if p.is_dir():
        ggufs = models_in(p)
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


# GGUF value types (gguf.GGUFValueType): the struct format of each scalar
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
LONG_ARRAY = 4096  # arrays longer than this (a vocabulary, its merges) are kept as ("array", length)


class _Header:
    """The GGUF header as llama.cpp's ``gguf.c`` lays it out (version 2 and 3: little-endian, 64-bit counts),
    read straight from the mapped file with ``struct``. ``gguf.GGUFReader`` parses every vocabulary and merge
    string into numpy views (about 20 s of CPU for a 128k-token vocabulary with 280k merges); this walks past
    the long arrays and keeps their length, which is all the buffers need. The layout and the value types
    are the ``gguf`` package's (``GGUFValueType``, ``GGML_QUANT_SIZES``)."""

    def __init__(self, buf) -> None:
        import struct

        self.buf, self.pos, self.struct = buf, 0, struct

    def take(self, fmt: str):
        v = self.struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += self.struct.calcsize("<" + fmt)
        return v[0] if len(v) == 1 else v

    def string(self) -> str:
        n = self.take("Q")
        if self.pos + n > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", "replace")
        self.pos += n
        return s

    def value(self, kind: int):
        if kind == 8:
            return self.string()
        if kind == 9:
            sub, n = self.take("I"), self.take("Q")
            if n > LONG_ARRAY:
                self.skip(sub, n)
                return ("array", n)
            return [self.value(sub) for _ in range(n)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self.take(_SCALARS[kind])

    def skip(self, kind: int, n: int) -> None:
        if kind == 8:
            unpack, buf = self.struct.unpack_from, self.buf
            pos = self.pos
            for _ in range(n):
                pos += 8 + unpack("<Q", buf, pos)[0]
            self.pos = pos
        elif kind in _SCALARS:
            self.pos += self.struct.calcsize("<" + _SCALARS[kind]) * n
        else:
            for _ in range(n):
                self.value(kind)
        if self.pos > len(self.buf):
            raise ValueError("an array runs past the end of the file")


def read_header(path: Path) -> tuple[dict, list[tuple[str, int, tuple[int, ...], int]]]:
    """(metadata, [(tensor name, ggml type id, shape, offset from the file's start)]) of one GGUF file."""
    import mmap

    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        h = _Header(mm)
        magic, version = h.take("4s"), h.take("I")
        if magic != GGUF_MAGIC:
            raise ValueError("no GGUF magic")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (llama.cpp reads 2 and 3)")
        n_tensors, n_kv = h.take("Q"), h.take("Q")
        meta: dict = {}
        for _ in range(n_kv):
            key = h.string()
            meta[key] = h.value(h.take("I"))
        infos = []
        for _ in range(n_tensors):
            name = h.string()
            dims = tuple(h.take("Q") for _ in range(h.take("I")))
            infos.append((name, h.take("I"), dims, h.take("Q")))
        align = meta.get("general.alignment", 32)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise ValueError(f"general.alignment {align!r} is not a power of two")
        data = (h.pos + align - 1) // align * align
    return meta, [(n, t, d, data + off) for n, t, d, off in infos]


def _looks_like_hub_id(spec: str) -> bool:
    p = Path(spec).expanduser()
    return spec.count("/") >= 1 and not spec.startswith((".", "/", "~")) and not p.exists()


def _remote_parts(spec: str, file: str | None, hub) -> tuple[Path, list[tuple[Path, int]], str]:
    """A GGUF of a Hub repository not on this machine: each part's header read by range reads
    (:func:`vramcal.estimator.hub.gguf_header`, cached under the commit), with the remote file's size."""
    from ..hub import HubOptions, gguf_header

    parts = spec.split("/")
    repo, name = "/".join(parts[:2]), ("/".join(parts[2:]) or file)
    if file is not None and len(parts) > 2 and name != file:
        raise UserError(f"{spec} names its file already; drop --file {file!r} (or give the repository alone)")
    options = hub or HubOptions()
    head = gguf_header(repo, name, options)
    out = [(head.path, head.size_bytes)]
    m = SPLIT.match(Path(head.filename).name)
    if m:  # every part's tensor infos, each from its own header
        count = int(m.group("count"))
        folder = head.filename.rsplit("/", 1)[0] + "/" if "/" in head.filename else ""
        for i in range(2, count + 1):
            part = gguf_header(repo, f"{folder}{m.group('prefix')}-{i:05d}-of-{count:05d}.gguf", options)
            out.append((part.path, part.size_bytes))
    return Path(head.filename), out, f"{repo}@{head.commit}"


def read_gguf(spec: str, file: str | None = None, hub=None) -> GgufModel:
    """The header of the GGUF ``spec`` names (every part of a split one). Bad input is one line. A Hub id
    not in the local cache (``owner/repo`` with ``file``, or ``owner/repo/FILE.gguf``) is read from the
    Hub, headers only (``hub``: :class:`vramcal.estimator.hub.HubOptions`)."""
    t = ggml_types()
    GGML_QUANT_SIZES, GGMLQuantizationType = t.GGML_QUANT_SIZES, t.GGMLQuantizationType
    revision = None
    if file is not None and not _looks_like_hub_id(spec):
        raise UserError(f"--file picks one GGUF of a Hub repository; {spec} is not one: give the file itself")
    try:
        first = locate(spec)
        sized = [(p, os.path.getsize(p)) for p in _parts(first)]
    except UserError:
        if not _looks_like_hub_id(spec):
            raise
        first, sized, revision = _remote_parts(spec, file, hub)
    paths = [p for p, _ in sized]
    metadata: dict = {}
    tensors: list[GgufTensor] = []
    for idx, (path, size) in enumerate(sized):
        with open(path, "rb") as fh:
            magic = fh.read(4)
        if magic != GGUF_MAGIC:
            raise UserError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF'): give a .gguf model "
                            "file (a safetensors checkpoint goes without --engine llama.cpp)")
        try:
            meta, infos = read_header(path)
        except (struct.error, ValueError, OverflowError, MemoryError, IndexError) as exc:  # cut inside the header
            raise UserError(f"{path} is truncated or damaged: its GGUF header does not read ({type(exc).__name__}: "
                            f"{str(exc)[:160]}); download it again, or wait for the download to end") from None
        for name, value in meta.items():
            if idx == 0 or name.startswith("split."):
                metadata.setdefault(name, value)
        for name, type_id, shape, offset in infos:
            try:
                qtype = GGMLQuantizationType(type_id)
            except ValueError:
                raise UserError(f"{path}: tensor {name} has ggml type {type_id}, which this gguf package does not "
                                "know (a newer llama.cpp type): upgrade gguf") from None
            block, type_bytes = GGML_QUANT_SIZES[qtype]
            rows = 1
            for d in shape[1:]:
                rows *= d
            nbytes = rows * (shape[0] // block) * type_bytes
            if offset + nbytes > size:
                raise UserError(f"{path} is truncated: tensor {name} ends at byte {offset + nbytes:,}, the file has "
                                f"{size:,} (still downloading?)")
            tensors.append(GgufTensor(name, qtype.name, type_id, shape, nbytes, idx, offset))
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise UserError(f"{first} has no general.architecture: not a llama.cpp model file")
    count = metadata.get("split.count")
    if isinstance(count, int) and count > 1 and len(paths) != count:
        raise UserError(f"{first.name} says it is one of {count} parts (split.count) but is not named "
                        "NAME-00001-of-0000N.gguf: keep llama-gguf-split's names")
    return GgufModel(path=str(first), files=tuple(str(p) for p in paths),
                     file_bytes=tuple(size for _, size in sized), arch=arch, metadata=metadata,
                     tensors=tuple(tensors), revision=revision)
