"""Where vramcal keeps its files: one home for the XDG lookups.

- data  (``$XDG_DATA_HOME/vramcal``, ``~/.local/share/vramcal``): the records database, unrecorded runs;
- cache (``$VRAMCAL_CACHE``, else ``$XDG_CACHE_HOME/vramcal``, ``~/.cache/vramcal``): inventories, traces, plans;
- state (``$XDG_STATE_HOME/vramcal``, ``~/.local/state/vramcal``): journals of runs in flight for a server
  database.

An XDG variable that is empty or relative is ignored, as the XDG Base Directory specification says.
"""

from __future__ import annotations

import os
from pathlib import Path


def _xdg(variable: str, fallback: str) -> Path:
    value = os.environ.get(variable)
    if value and os.path.isabs(value):
        return Path(value)
    return Path(os.path.expanduser("~")) / fallback


def data_dir() -> Path:
    return _xdg("XDG_DATA_HOME", ".local/share") / "vramcal"


def cache_dir() -> Path:
    if os.environ.get("VRAMCAL_CACHE"):
        return Path(os.environ["VRAMCAL_CACHE"])
    return _xdg("XDG_CACHE_HOME", ".cache") / "vramcal"


def state_dir() -> Path:
    return _xdg("XDG_STATE_HOME", ".local/state") / "vramcal"
