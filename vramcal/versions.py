"""What derived a figure: the installed stack's versions, vramcal's own, and the estimator's source.

Read without importing torch (a cached estimate must stay torch-free) and once per process: every
cache key and every record carries them (docs/performance.md).
"""

from __future__ import annotations

import hashlib
import os
import sys
from functools import lru_cache
from pathlib import Path

from . import __version__ as VRAMCAL_VERSION

STACK = ("torch", "transformers", "bitsandbytes", "accelerate")

__all__ = ["STACK", "VRAMCAL_VERSION", "software_versions", "dist_info_versions", "estimator_source_hash"]


def software_versions() -> dict[str, str | None]:
    """Installed versions of the stack that lays memory out."""
    return dict(_versions())


@lru_cache(maxsize=1)
def _versions() -> tuple[tuple[str, str | None], ...]:
    found = dist_info_versions(STACK)
    missing = [n for n in STACK if n not in found]
    if missing:  # an egg-info, editable or odd install: ask importlib.metadata (50 ms to import)
        from importlib import metadata

        for name in missing:
            try:
                found[name] = metadata.version(name)
            except metadata.PackageNotFoundError:
                found[name] = None
    return tuple((n, found[n]) for n in STACK)


def dist_info_versions(names) -> dict[str, str]:
    """Versions from the ``NAME-VERSION.dist-info`` folder names on ``sys.path`` (the wheel spec's
    layout), first match in path order as importlib.metadata finds them. A name with two such folders in
    one directory, or none, is left out for importlib.metadata to settle."""
    want = {n.lower().replace("-", "_"): n for n in names}
    found: dict[str, str | None] = {}
    for entry in sys.path:
        try:
            listing = os.listdir(entry or ".")
        except OSError:
            continue
        here: dict[str, list[str]] = {}
        for item in listing:
            if item.endswith(".dist-info"):
                name, _, version = item[:-len(".dist-info")].partition("-")
                key = name.lower().replace("-", "_").replace(".", "_")
                if key in want and want[key] not in found and version:
                    here.setdefault(want[key], []).append(version)
        for name, versions in here.items():
            found[name] = versions[0] if len(versions) == 1 else None  # ambiguous: later entries must not win
        if len(found) == len(want):
            break
    return {k: v for k, v in found.items() if v is not None}


@lru_cache(maxsize=1)
def estimator_source_hash() -> str:
    """A hash of the estimator's own source files: a cached figure computed by other arithmetic is never
    served (the disk cache's key includes it, beside :data:`VRAMCAL_VERSION`)."""
    root = Path(__file__).resolve().parent / "estimator"
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):  # subpackages too: a cached figure may come from any of them
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]
