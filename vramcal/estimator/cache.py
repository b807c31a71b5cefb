"""The estimator's disk cache: inventories, dry-run traces and placements, as JSON files.

A file's key holds everything that decides its figures: the config's hash, the quantization, the
kind of figure, the installed stack's versions, vramcal's version and a hash of the estimator's own
source files (:func:`vramcal.versions.estimator_source_hash`), so a change to the arithmetic can never
serve a stale figure. A file is trusted only if it parses, names this cache's schema, key and kind,
and its payload matches its sha256; anything else is ignored (recomputed by the caller) and the
reason kept in :data:`CACHE_PROBLEMS`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

from ..paths import cache_dir
from ..versions import VRAMCAL_VERSION, estimator_source_hash, software_versions
from .checkpoint import checkpoint_names
from .quant import QuantSpec
from .resolve import ModelSource

CACHE_SCHEMA = 4  # 2: payloads wrapped with key and sha256; 3: quantized_shapes; 4: versioned keys
MAX_CACHE_FILE = 64 * 1024**2  # no inventory, trace or plan is near this; a larger file is not ours

# Problems found in cache files during this process, reported as notes by whoever reads them.
CACHE_PROBLEMS: list[str] = []

__all__ = ["CACHE_PROBLEMS", "cache_dir", "load_cached", "store_cached"]


def _cache_key(source: ModelSource, quant: QuantSpec, kind: str) -> str:
    return json.dumps([CACHE_SCHEMA, kind, source.config_hash, quant.key(), software_versions(), VRAMCAL_VERSION,
                       estimator_source_hash(), checkpoint_names(source)], sort_keys=True)


def _cache_path(source: ModelSource, quant: QuantSpec, kind: str) -> Path:
    key = _cache_key(source, quant, kind)
    return cache_dir() / kind / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".json")


def _digest(payload) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def load_cached(source: ModelSource, quant: QuantSpec, kind: str = "inventory") -> dict | None:
    """The cached payload, or None (see the module's doc for what is trusted)."""
    path = _cache_path(source, quant, kind)
    try:
        raw = _read_small(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        CACHE_PROBLEMS.append(f"cache file {path} unreadable ({exc.strerror or exc}); recomputed")
        return None
    try:
        doc = json.loads(raw)
        ok = (isinstance(doc, dict) and doc.get("schema") == CACHE_SCHEMA and doc.get("kind") == kind
              and doc.get("key") == _cache_key(source, quant, kind) and doc.get("sha256") == _digest(doc.get("payload")))
    except (ValueError, UnicodeDecodeError, RecursionError):
        ok = False
    if not ok or not isinstance(doc.get("payload"), dict):
        CACHE_PROBLEMS.append(f"cache file {path} was damaged or altered (checksum or schema mismatch); recomputed")
        return None
    return doc["payload"]


def _read_small(path: Path) -> bytes:
    """A regular file's bytes, refusing anything else (a FIFO would block, a device never end)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0))
    try:
        import stat

        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_CACHE_FILE:
            raise OSError(0, "not a regular file of a sane size")
        with os.fdopen(fd, "rb", closefd=False) as fh:
            return fh.read(MAX_CACHE_FILE + 1)
    finally:
        os.close(fd)


def store_cached(source: ModelSource, quant: QuantSpec, data: dict, kind: str = "inventory") -> None:
    """Write a payload with its key and checksum, atomically (temp file + rename)."""
    path = _cache_path(source, quant, kind)
    doc = {"schema": CACHE_SCHEMA, "kind": kind, "key": _cache_key(source, quant, kind),
           "sha256": _digest(data), "payload": data}
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)
    except OSError:  # a cache that cannot be written only costs time
        with contextlib.suppress(OSError):
            tmp.unlink()
