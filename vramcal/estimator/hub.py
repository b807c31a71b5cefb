"""A model on the Hub sized without downloading it: its JSON files and its weights' headers, read through
huggingface_hub, kept in vramcal's cache under the commit they came from (docs/hub.md).

What is fetched, for a Hub id that is in neither the local Hugging Face cache nor this cache:

- the repository's listing at the revision (``model_info``: the commit hash and the file names and sizes);
- ``config.json`` and, where the repository has them, ``generation_config.json``,
  ``preprocessor_config.json``, ``processor_config.json`` and ``model.safetensors.index.json``
  (``hf_hub_download`` into a temporary folder, then read);
- the header of every top-level ``*.safetensors`` file (``parse_safetensors_file_metadata``: a range
  read of the first 100 kB, and a second one only for a longer header); never a tensor's data;
- for a GGUF file, only its header: :func:`gguf_header` reads the first bytes through ``HfFileSystem``
  and reads more until the header is whole.

Everything is read into memory first and written to ``$VRAMCAL_CACHE/hub/<host>/<repo>/`` only once the
whole set has arrived (one JSON document per commit, written to a temporary file and renamed), so an
interrupted or failed fetch leaves nothing behind to be mistaken for a model. The revision the user asked
for (``main`` by default) is remembered beside it, so the next estimate of the same id makes no request
at all; ``refresh=True`` asks the Hub again where that revision now points.

The user's token is huggingface_hub's own (``hf auth login`` or ``HF_TOKEN``), sent by the library and
never printed; ``HF_ENDPOINT`` points at a mirror; ``HF_HUB_OFFLINE=1`` (or ``offline=True``) refuses to
fetch. Every failure is a one-line :class:`~vramcal.errors.UserError` (exit 2) saying what to do.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

from ..errors import UserError
from ..paths import cache_dir
from ..units import gib

HUB_SCHEMA = 1
JSON_FILES = ("config.json", "generation_config.json", "preprocessor_config.json", "processor_config.json",
              "model.safetensors.index.json")
MAX_JSON_BYTES = 16 * 1024**2  # as resolve.MAX_CONFIG_BYTES: the largest published config is a few hundred KB
MAX_CACHED_DOC = 256 * 1024**2  # a document of headers: ~100 bytes a tensor; the largest models have ~100k tensors
GGUF_FIRST_READ = 1024**2  # most GGUF headers (vocabulary included) are a few MB; read more as needed
MAX_GGUF_HEADER = 512 * 1024**2  # no real GGUF header is near this; a file that claims more is refused
COMMIT = re.compile(r"^[0-9a-f]{40}$")
NOT_CACHED = "not in the local Hugging Face cache"


@dataclass(frozen=True)
class HubOptions:
    """How a Hub id not on this machine may be fetched: which revision (branch, tag or commit; ``main``
    when None), whether fetching is refused (``offline``; also ``HF_HUB_OFFLINE=1``), whether to ask the
    Hub again where a remembered revision points (``refresh``), and who is told each step (``progress``)."""

    revision: str | None = None
    offline: bool = False
    refresh: bool = False
    progress: Callable[[str], None] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class HubMetadata:
    """What vramcal knows of one commit of a Hub repository: the parsed JSON files it has (by name) and,
    for each top-level safetensors file, its size and its tensors as ``{name: (dtype, shape)}``."""

    repo_id: str
    commit: str
    endpoint: str
    files: dict[str, dict]
    weight_sizes: dict[str, int]
    headers: dict[str, dict[str, tuple[str, tuple[int, ...]]]]
    from_cache: bool = False


@dataclass(frozen=True)
class GgufHeader:
    """The header of one GGUF file of a Hub repository, read without its tensor data: ``path`` is a
    local file holding the file's first ``header_bytes`` bytes (the whole header: magic, key-values and
    tensor infos), ``size_bytes`` the remote file's full size (the header's tensor offsets point past
    ``header_bytes``: the data is not there)."""

    repo_id: str
    commit: str
    filename: str
    path: Path
    header_bytes: int
    size_bytes: int


# ----------------------------------------------------------------------------------------------- ids

def check_repo_id(spec: str) -> None:
    """Refuse, in one line, a Hub id huggingface_hub would refuse (non-ASCII letters, spaces, ``--``,
    a name too long ...), before anything is looked up."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(spec)
    except HFValidationError as exc:
        why = " ".join(str(exc).split())[:160]
        raise UserError(f"{spec!r} is not a Hub id nor a path nor a catalog name ({why}): a Hub id is "
                        "OWNER/NAME in ASCII letters, digits, '-', '_' and '.'") from None


def looks_like_hub_id(spec: str) -> bool:
    return "/" in spec and not spec.startswith((".", "/", "~")) and spec.count("/") == 1


# ----------------------------------------------------------------------------------------------- cache

def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _repo_dir(repo_id: str, endpoint: str) -> Path:
    host = urlsplit(endpoint).netloc or "hub"
    return cache_dir() / "hub" / quote(host, safe="") / ("models--" + repo_id.replace("/", "--"))


def _ref_path(repo_dir: Path, revision: str) -> Path:
    """refs/<revision>, one file a name: "/" of refs/pr/1 and a leading "." (".", "..") are escaped."""
    name = quote(revision, safe="")
    return repo_dir / "refs" / (name.replace(".", "%2E", 1) if name.startswith(".") else name)


def _doc_path(repo_dir: Path, commit: str) -> Path:
    return repo_dir / f"{commit}.json"


def _digest(payload) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    """A reader sees the old file or the whole new one (temp file beside it, fsync, rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _read_cached(path: Path, limit: int) -> bytes | None:
    from ..files import read_regular

    if not path.is_file():
        return None
    try:
        return read_regular(path, limit, "cached Hub metadata")
    except UserError:
        return None


def _cached_commit(repo_dir: Path, revision: str) -> str | None:
    if COMMIT.match(revision):
        return revision
    raw = _read_cached(_ref_path(repo_dir, revision), 100)
    text = raw.decode("ascii", "replace").strip() if raw else ""
    return text if COMMIT.match(text) else None


def load_metadata(repo_id: str, commit: str, endpoint: str) -> HubMetadata | None:
    """The cached metadata of one commit, or None when absent, damaged or altered (it is fetched again)."""
    raw = _read_cached(_doc_path(_repo_dir(repo_id, endpoint), commit), MAX_CACHED_DOC)
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
        ok = (isinstance(doc, dict) and doc.get("schema") == HUB_SCHEMA and doc.get("repo_id") == repo_id
              and doc.get("commit") == commit and doc.get("sha256") == _digest(doc.get("payload")))
        p = doc["payload"] if ok else None
        if not ok or not isinstance(p.get("files"), dict) or "config.json" not in p["files"]:
            return None
        return HubMetadata(repo_id, commit, endpoint, p["files"], {k: int(v) for k, v in p["weight_sizes"].items()},
                           {f: {n: (d, tuple(s)) for n, (d, s) in h.items()} for f, h in p["headers"].items()},
                           from_cache=True)
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError, RecursionError):
        return None


def _store_metadata(meta: HubMetadata, revision: str, progress=None) -> None:
    """The document first, then the ref that points to it: a ref never names a commit that is not there."""
    payload = {"files": meta.files, "weight_sizes": meta.weight_sizes,
               "headers": {f: {n: [d, list(s)] for n, (d, s) in h.items()} for f, h in meta.headers.items()}}
    doc = {"schema": HUB_SCHEMA, "repo_id": meta.repo_id, "commit": meta.commit, "endpoint": meta.endpoint,
           "sha256": _digest(payload), "payload": payload}
    repo_dir = _repo_dir(meta.repo_id, meta.endpoint)
    try:
        if not meta.from_cache:
            _write_atomic(_doc_path(repo_dir, meta.commit), json.dumps(doc).encode())
        if revision != meta.commit:
            _write_atomic(_ref_path(repo_dir, revision), meta.commit.encode())
    except OSError as exc:  # a cache that cannot be written costs a fetch next time, nothing else
        _say(progress, f"could not keep the Hub metadata in {repo_dir} ({exc.strerror or exc}); the next "
                       "estimate fetches it again")


# ----------------------------------------------------------------------------------------------- fetch

def offline_requested(options: HubOptions) -> bool:
    from huggingface_hub import constants

    return options.offline or constants.is_offline_mode()


def hub_metadata(repo_id: str, options: HubOptions = HubOptions()) -> HubMetadata:
    """The metadata of ``repo_id`` at ``options.revision``: from vramcal's cache when this revision was
    fetched before (no request), else from the Hub (see the module's doc). One-line UserError for every
    way it can fail; nothing is cached unless everything arrived."""
    check_repo_id(repo_id)
    endpoint = _endpoint()
    revision = options.revision or "main"
    repo_dir = _repo_dir(repo_id, endpoint)
    commit = None if options.refresh and not COMMIT.match(revision) else _cached_commit(repo_dir, revision)
    if commit is not None:
        cached = load_metadata(repo_id, commit, endpoint)
        if cached is not None:
            return cached
    if offline_requested(options):
        from huggingface_hub import constants

        raise UserError(f"{repo_id} is {NOT_CACHED} ({constants.HF_HUB_CACHE}) nor in vramcal's "
                        f"({repo_dir.parent.parent}), and fetching is off (--offline or HF_HUB_OFFLINE=1): drop it to "
                        f"read the model's config and weight headers from the Hub, run `hf download {repo_id}` on a "
                        "machine with a network, or pass a config.json path")
    with _hub_errors(repo_id, endpoint, revision):
        meta = _fetch(repo_id, revision, endpoint, options.progress)
    _store_metadata(meta, revision, options.progress)
    return meta


def _repo_at(repo_id: str, revision: str, endpoint: str, progress):
    """The client, the repository's file list at ``revision`` (``model_info`` with file sizes) and the commit
    it is at."""
    from huggingface_hub import HfApi, constants

    api = HfApi(endpoint=endpoint)
    _say(progress, f"asking {endpoint} for {repo_id} at {revision}")
    info = api.model_info(repo_id, revision=revision, files_metadata=True, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    commit = info.sha
    if not isinstance(commit, str) or not COMMIT.match(commit):
        raise UserError(f"{endpoint} gave no commit for {repo_id} at {revision}: is HF_ENDPOINT a Hugging Face "
                        "Hub or a mirror of one?")
    return api, info, commit


def _fetch(repo_id: str, revision: str, endpoint: str, progress) -> HubMetadata:
    from huggingface_hub import constants

    from .checkpoint import torch_dtype

    api, info, commit = _repo_at(repo_id, revision, endpoint, progress)
    cached = load_metadata(repo_id, commit, endpoint)
    if cached is not None:  # the revision points where it did (or to a commit fetched before)
        return cached
    sizes = {s.rfilename: s.size for s in (info.siblings or [])}
    if "config.json" not in sizes:
        ggufs = sorted(n for n in sizes if n.endswith(".gguf"))
        hint = (f"it holds GGUF files ({', '.join(ggufs[:4])}{' ...' if len(ggufs) > 4 else ''}), sized by their "
                "headers with --engine llama.cpp" if ggufs else "pass a repository of a transformers model")
        raise UserError(f"{repo_id} has no config.json at {revision} (commit {commit[:12]}): {hint}")
    files: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="vramcal-hub-") as tmp:
        for name in JSON_FILES:
            if name not in sizes:
                continue
            if (sizes[name] or 0) > MAX_JSON_BYTES:
                raise UserError(f"{repo_id}: {name} is {sizes[name]:,} bytes, more than any model's {name} "
                                f"({MAX_JSON_BYTES:,}): not a model repository vramcal can size")
            _say(progress, f"fetching {name}" + (f" ({sizes[name]:,} bytes)" if sizes[name] is not None else ""))
            path = api.hf_hub_download(repo_id, name, revision=commit, local_dir=tmp,
                                       etag_timeout=constants.HF_HUB_ETAG_TIMEOUT)
            files[name] = _parse_json(Path(path), repo_id, name)
    weights = sorted(n for n in sizes if n.endswith(".safetensors") and "/" not in n)
    headers = {}
    for i, name in enumerate(weights, 1):
        size = sizes[name]
        _say(progress, f"reading the header of {name} ({i}/{len(weights)}"
                       + (f"; of its {size:,} bytes ({gib(size):.2f} GiB) only the first ~100 kB)" if size else ")"))
        meta = api.parse_safetensors_file_metadata(repo_id, name, revision=commit,
                                                   timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT)
        headers[name] = {t: (torch_dtype(info.dtype), tuple(int(d) for d in info.shape))
                         for t, info in meta.tensors.items()}
    return HubMetadata(repo_id, commit, endpoint, files, {n: int(sizes[n] or 0) for n in weights}, headers)


def _parse_json(path: Path, repo_id: str, name: str) -> dict:
    from ..files import read_regular

    raw = read_regular(path, MAX_JSON_BYTES, name)
    try:
        from .resolve import _no_constant

        data = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise UserError(f"{repo_id}: its {name} is not valid JSON ({str(exc).splitlines()[0][:100]}): "
                        "the answer was cut short or the file is broken; retry") from None
    if not isinstance(data, dict):
        raise UserError(f"{repo_id}: its {name} is not a JSON object: not a model vramcal can size")
    return data


def _say(progress, text: str) -> None:
    if progress is not None:
        progress(text)


# ----------------------------------------------------------------------------------------------- GGUF

def gguf_header(repo_id: str, filename: str | None = None, options: HubOptions = HubOptions()) -> GgufHeader:
    """The header of one GGUF file of ``repo_id`` (``filename``; may be left out when the repository
    holds a single ``.gguf``), read by range reads through ``HfFileSystem`` and cached like the
    safetensors headers. A repository of several quant files without ``filename`` is refused with their
    names; the first split of a ``-00001-of-0000N`` model is the one whose header holds the key-values."""
    check_repo_id(repo_id)
    endpoint = _endpoint()
    revision = options.revision or "main"
    repo_dir = _repo_dir(repo_id, endpoint)
    commit = None if options.refresh and not COMMIT.match(revision) else _cached_commit(repo_dir, revision)
    if commit is not None and filename is not None:
        found = _cached_gguf(repo_id, repo_dir, commit, filename)
        if found is not None:
            return found
    if offline_requested(options):
        raise UserError(f"{repo_id} ({filename or 'a GGUF file'}) is not in vramcal's cache and fetching is off "
                        "(--offline or HF_HUB_OFFLINE=1): drop it to read the GGUF header from the Hub, or "
                        f"download the file (`hf download {repo_id} FILE.gguf`) and pass its path")
    with _hub_errors(repo_id, endpoint, revision):
        return _fetch_gguf(repo_id, filename, revision, endpoint, repo_dir, options.progress)


def gguf_files(repo_id: str, options: HubOptions = HubOptions()) -> tuple[list[str], str]:
    """Every GGUF model of ``repo_id`` at the revision (the first part of a split one; names sorted) and the
    commit, for a search over its quantizations: the Hub's file list (``model_info``), or -- offline -- the
    files whose headers vramcal's cache keeps for the cached commit. Nothing is downloaded here; each header
    is then read by :func:`gguf_header`."""
    check_repo_id(repo_id)
    endpoint = _endpoint()
    revision = options.revision or "main"
    repo_dir = _repo_dir(repo_id, endpoint)
    if offline_requested(options):
        commit = _cached_commit(repo_dir, revision)
        kept = sorted(unquote(p.name[:-len(".json")]) for p in (repo_dir / "gguf" / commit).glob("*.json")) \
            if commit else []
        if not kept:
            raise UserError(f"{repo_id}: no GGUF header of it is in vramcal's cache and fetching is off (--offline or "
                            "HF_HUB_OFFLINE=1): drop it to list the repository's GGUF files on the Hub")
        return _first_parts(kept), commit
    with _hub_errors(repo_id, endpoint, revision):
        _, info, commit = _repo_at(repo_id, revision, endpoint, options.progress)
    names = _first_parts(sorted(s.rfilename for s in (info.siblings or []) if s.rfilename.endswith(".gguf")))
    if not names:
        raise UserError(f"{repo_id} holds no GGUF file at {revision}: give a repository of .gguf files")
    return names, commit


def _first_parts(names: list[str]) -> list[str]:
    """The GGUF models among file names: each file, and of a split model (``-0000K-of-0000N``) its first part."""
    return [n for n in names if not re.search(r"-(?!00001)\d{5}-of-\d{5}\.gguf$", n)]


def _gguf_paths(repo_dir: Path, commit: str, filename: str) -> tuple[Path, Path]:
    stem = repo_dir / "gguf" / commit / quote(filename, safe="")
    return stem.with_name(stem.name + ".header"), stem.with_name(stem.name + ".json")


def _cached_gguf(repo_id: str, repo_dir: Path, commit: str, filename: str) -> GgufHeader | None:
    header, sidecar = _gguf_paths(repo_dir, commit, filename)
    raw = _read_cached(sidecar, 4096)
    data = _read_cached(header, MAX_GGUF_HEADER)
    try:
        doc = json.loads(raw) if raw else None
        if not (isinstance(doc, dict) and doc.get("schema") == HUB_SCHEMA and data is not None
                and doc.get("sha256") == hashlib.sha256(data).hexdigest() and doc.get("header_bytes") == len(data)):
            return None
        return GgufHeader(repo_id, commit, filename, header, len(data), int(doc["size_bytes"]))
    except (ValueError, KeyError, TypeError):
        return None


def _fetch_gguf(repo_id, filename, revision, endpoint, repo_dir, progress) -> GgufHeader:
    from huggingface_hub import HfFileSystem

    _, info, commit = _repo_at(repo_id, revision, endpoint, progress)
    sizes = {s.rfilename: s.size for s in (info.siblings or [])}
    ggufs = sorted(n for n in sizes if n.endswith(".gguf"))
    if filename is None:
        firsts = _first_parts(ggufs)
        if len(firsts) != 1:
            raise UserError(f"{repo_id} holds " + (f"{len(firsts)} GGUF files ({', '.join(firsts[:6])}"
                                                   f"{' ...' if len(firsts) > 6 else ''}): pick one with --file"
                                                   if firsts else "no GGUF file: give a repository of .gguf files"))
        filename = firsts[0]
    elif filename not in sizes:
        raise UserError(f"{repo_id} has no file {filename!r} at {revision}"
                        + (f": its GGUF files are {', '.join(ggufs[:6])}" if ggufs else ": it holds no GGUF file"))
    cached = _cached_gguf(repo_id, repo_dir, commit, filename)
    if cached is not None:
        with contextlib.suppress(OSError):
            _write_atomic(_ref_path(repo_dir, revision), commit.encode())
        return cached
    fs = HfFileSystem(endpoint=endpoint)
    want = GGUF_FIRST_READ
    with fs.open(f"{repo_id}/{filename}", "rb", revision=commit, block_size=GGUF_FIRST_READ, cache_type="none") as fh:
        size = int(fh.size)
        data = b""
        while True:
            _say(progress, f"reading the header of {filename}: bytes {len(data):,} to {min(want, size):,} of "
                           f"{size:,} ({gib(size):.2f} GiB)")
            fh.seek(len(data))
            data += fh.read(min(want, size) - len(data))
            end = gguf_header_length(data)
            if end is not None:
                data = data[:end]
                break
            if len(data) >= size or want >= MAX_GGUF_HEADER:
                raise UserError(f"{repo_id}/{filename}: no whole GGUF header in its first {len(data):,} bytes "
                                f"(the file is {size:,}): not a GGUF file, or a broken one")
            want *= 4
    header, sidecar = _gguf_paths(repo_dir, commit, filename)
    try:
        _write_atomic(header, data)
        _write_atomic(sidecar, json.dumps({"schema": HUB_SCHEMA, "size_bytes": size, "header_bytes": len(data),
                                           "sha256": hashlib.sha256(data).hexdigest()}).encode())
        _write_atomic(_ref_path(repo_dir, revision), commit.encode())
    except OSError as exc:
        raise UserError(f"cannot keep the GGUF header in {repo_dir} ({exc.strerror or exc}): free space or set "
                        "VRAMCAL_CACHE to a writable folder") from None
    return GgufHeader(repo_id, commit, filename, header, len(data), size)


# GGUF value types (ggml's gguf.h: GGUF_TYPE_*): fixed sizes; 8 = string, 9 = array
_GGUF_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_header_length(data: bytes) -> int | None:
    """Where the tensor infos of a GGUF header end (the data section starts after alignment padding), or
    None when ``data`` stops before that. Only walks the layout (gguf.h: magic, version, tensor count,
    key-value count, the key-values, then name / dims / type / offset per tensor); the values themselves
    are the ``gguf`` package's to read. UserError for bytes that are not a GGUF header."""
    import struct

    if len(data) < 24:
        return None
    if data[:4] != b"GGUF":
        raise UserError("not a GGUF file (its first bytes are not the GGUF magic)")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
    if version not in (2, 3) or n_tensors > 1 << 24 or n_kv > 1 << 24:
        raise UserError(f"not a GGUF header vramcal can read (version {version}, {n_tensors} tensors, {n_kv} keys)")
    pos = 24

    def take(n: int) -> int:
        nonlocal pos
        if pos + n > len(data):
            raise _Short
        pos += n
        return pos - n

    def string() -> None:
        (length,) = struct.unpack_from("<Q", data, take(8))
        if length > MAX_GGUF_HEADER:
            raise UserError(f"a GGUF string of {length:,} bytes: not a GGUF header")
        take(length)

    def value(kind: int) -> None:
        if kind in _GGUF_FIXED:
            take(_GGUF_FIXED[kind])
        elif kind == 8:
            string()
        elif kind == 9:
            (inner,) = struct.unpack_from("<I", data, take(4))
            (count,) = struct.unpack_from("<Q", data, take(8))
            if inner in _GGUF_FIXED:
                take(_GGUF_FIXED[inner] * count)
            else:
                for _ in range(count):
                    value(inner)
        else:
            raise UserError(f"a GGUF value of unknown type {kind}: not a GGUF header vramcal can read")

    try:
        for _ in range(n_kv):
            string()
            (kind,) = struct.unpack_from("<I", data, take(4))
            value(kind)
        for _ in range(n_tensors):
            string()
            (dims,) = struct.unpack_from("<I", data, take(4))
            take(8 * dims + 4 + 8)
    except _Short:
        return None
    return pos


class _Short(Exception):
    """The bytes read so far stop inside the header."""


# ----------------------------------------------------------------------------------------------- errors

@contextlib.contextmanager
def _hub_errors(repo_id: str, endpoint: str, revision: str):
    """Every failure of a fetch as one line with what to do (the token never appears: no message
    repeats a request's headers). An error that is not the Hub's or the network's goes on as it is."""
    try:
        yield
    except UserError:
        raise
    except Exception as exc:
        message = _one_line(_cause(exc), repo_id, endpoint, revision)
        if message is None:
            raise
        raise UserError(message) from None


def _cause(exc: BaseException) -> BaseException:
    """The Hub's or the network's error under huggingface_hub's wrapping (hf_hub_download reports a failed
    HEAD as "cannot find the requested files in the local cache", the real reason chained below it)."""
    httpx = _http_client()
    seen: BaseException | None = exc
    while seen is not None:
        if httpx is not None and isinstance(seen, httpx.HTTPError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return exc


def _http_client():
    """huggingface_hub's HTTP client module: httpx2 (huggingface_hub 2), httpx (1.x); None before (requests,
    whose errors are OSErrors and end in the last branch of :func:`_one_line`)."""
    import importlib

    for name in ("httpx2", "httpx"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def _one_line(exc: BaseException, repo_id: str, endpoint: str, revision: str) -> str | None:
    from huggingface_hub import constants, errors

    httpx = _http_client()

    page = f"{endpoint}/{repo_id}"
    login = "`hf auth login`, or set HF_TOKEN"
    if isinstance(exc, errors.GatedRepoError):
        return f"{repo_id} is gated: accept its licence at {page} and log in ({login}), then retry"
    if isinstance(exc, errors.RevisionNotFoundError):
        return (f"{repo_id} has no revision {revision!r} on {endpoint}: give a branch, tag or commit that exists "
                "with --revision")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return (f"{repo_id} was not found on {endpoint}: check the spelling; if it is private, log in with an "
                f"account that can read it ({login})")
    if isinstance(exc, errors.RemoteEntryNotFoundError):
        return f"{repo_id}: a file its listing names is missing on {endpoint} ({_status(exc)}): retry later"
    if isinstance(exc, errors.OfflineModeIsEnabled):
        return f"{repo_id} is not cached and huggingface_hub is offline (HF_HUB_OFFLINE=1): unset it to fetch it"
    if isinstance(exc, errors.HfHubHTTPError):
        code = exc.response.status_code if exc.response is not None else None
        if code == 429:
            return (f"{endpoint} refused {repo_id} for now: rate limited (HTTP 429); wait a few minutes and retry, "
                    "or log in (`hf auth login`) for a higher limit")
        if code in (401, 403):
            return (f"{endpoint} denied access to {repo_id} (HTTP {code}): log in with an account that can read it "
                    f"({login}); a gated model's licence is accepted at {page}")
        return f"{endpoint} answered {_status(exc)} for {repo_id}: retry later, or check HF_ENDPOINT"
    if isinstance(exc, (errors.SafetensorsParsingError, errors.NotASafetensorsRepoError)):
        return (f"{repo_id}: a safetensors header could not be read ({' '.join(str(exc).split())[:160]}): the "
                "answer was cut short or the file is broken; retry")
    if httpx is not None and isinstance(exc, httpx.TimeoutException):
        wait = max(constants.HF_HUB_ETAG_TIMEOUT, constants.HF_HUB_DOWNLOAD_TIMEOUT)
        return (f"{endpoint} did not answer within {wait} s for {repo_id}: retry, or allow longer with "
                "HF_HUB_ETAG_TIMEOUT / HF_HUB_DOWNLOAD_TIMEOUT")
    if httpx is not None and isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError)):
        return f"the answer from {endpoint} for {repo_id} was cut short ({type(exc).__name__}): retry; nothing was kept"
    if isinstance(exc, ConnectionError) or httpx is not None and isinstance(exc, httpx.TransportError):
        return (f"cannot reach {endpoint} for {repo_id} ({_reason(exc)}): check the network (or HF_ENDPOINT for a "
                "mirror); --offline uses only what is on this machine")
    if isinstance(exc, OSError):  # a short download hf_hub_download noticed, a full disk for the temp folder
        return f"fetching {repo_id} from {endpoint} failed ({_reason(exc)}): retry; nothing was kept"
    return None


def _status(exc) -> str:
    response = getattr(exc, "response", None)
    return f"HTTP {response.status_code}" if response is not None else type(exc).__name__


def _reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return (text[:120] or type(exc).__name__).replace(os.environ.get("HF_TOKEN") or "\0", "***")
